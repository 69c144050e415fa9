//! Tests of the in-memory transport against the `Transport` contract.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvhandoff_actors::transport::mem::{MemFabric, MemFaults, MemLimits, MemRegion, MemTransport};
use kvhandoff_actors::transport::{
    AddrRange, Completion, Descriptor, Notification, Transport, TransportError,
};
use kvhandoff_protocol::{AgentName, EngineId};
use kvhandoff_protocol::{PeerAddr, WriteId};
use proptest::prelude::*;

const LEN: u64 = 4096;

fn name(s: &str) -> AgentName {
    AgentName::new(s).unwrap()
}

fn addr(engine: &str, rank: u32) -> PeerAddr {
    PeerAddr::new(EngineId::new(engine).unwrap(), rank)
}

/// P and D on one fabric, one registered region each, each loaded with the other's metadata.
struct Pair {
    fabric: MemFabric,
    p: MemTransport,
    d: MemTransport,
    p_addr: PeerAddr,
    d_addr: PeerAddr,
    src: MemRegion,
    dst: MemRegion,
    src_r: AddrRange,
    dst_r: AddrRange,
}

impl Pair {
    fn new() -> Self {
        Self::with_limits(MemLimits::default())
    }

    fn with_limits(limits: MemLimits) -> Self {
        let fabric = MemFabric::with_limits(limits);
        let mut p = fabric.agent(name("p")).unwrap();
        let mut d = fabric.agent(name("d")).unwrap();
        let src = p.alloc_region(LEN).unwrap();
        let dst = d.alloc_region(LEN).unwrap();
        let src_r = p.register_region(&src).unwrap();
        let dst_r = d.register_region(&dst).unwrap();
        let (p_addr, d_addr) = (addr("prefill", 0), addr("decode", 0));
        p.load_remote(&d_addr, &name("d"), &d.local_metadata().unwrap())
            .unwrap();
        d.load_remote(&p_addr, &name("p"), &p.local_metadata().unwrap())
            .unwrap();
        Self {
            fabric,
            p,
            d,
            p_addr,
            d_addr,
            src,
            dst,
            src_r,
            dst_r,
        }
    }

    /// `len` bytes from `src + off` to `dst + off`.
    fn desc(&self, off: u64, len: u64) -> Descriptor {
        Descriptor {
            local_addr: self.src_r.base + off,
            remote_addr: self.dst_r.base + off,
            len,
        }
    }

    fn write(&mut self, id: u64, descs: &[Descriptor], note: Option<&[u8]>) {
        let d_addr = self.d_addr.clone();
        self.p
            .post_write(WriteId(id), &d_addr, descs, note.map(<[u8]>::to_vec))
            .unwrap();
    }

    fn p_poll(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        self.p.poll_completions(&mut out);
        out
    }

    fn d_notes(&mut self) -> Vec<Notification> {
        let mut out = Vec::new();
        self.d.poll_notifications(&mut out);
        out
    }

    fn dst_bytes(&self, off: u64, len: u64) -> Vec<u8> {
        let mut buf = vec![0; len as usize];
        self.dst.read(off, &mut buf).unwrap();
        buf
    }
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn ok(id: u64) -> Completion {
    Completion {
        write: WriteId(id),
        result: Ok(()),
    }
}

fn err(id: u64, e: TransportError) -> Completion {
    Completion {
        write: WriteId(id),
        result: Err(e),
    }
}

#[test]
fn fabric_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<MemFabric>();
    send_sync::<MemTransport>();
    send_sync::<MemRegion>();
}

#[test]
fn bytes_land_intact_on_the_nth_poll_and_not_before() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.land_after_polls = 3);
    let data = pattern(1000, 5);
    t.src.write(100, &data).unwrap();
    // Two descriptors: 100..600 -> 2000..2500 and 600..1100 -> 3000..3500.
    let descs = [
        Descriptor {
            local_addr: t.src_r.base + 100,
            remote_addr: t.dst_r.base + 2000,
            len: 500,
        },
        Descriptor {
            local_addr: t.src_r.base + 600,
            remote_addr: t.dst_r.base + 3000,
            len: 500,
        },
    ];
    t.write(1, &descs, Some(b"landed"));
    for _ in 0..2 {
        assert!(t.p_poll().is_empty());
        assert!(t.d_notes().is_empty());
        assert_eq!(t.dst.to_vec(), vec![0; LEN as usize]);
    }
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert_eq!(t.dst_bytes(2000, 500), data[..500]);
    assert_eq!(t.dst_bytes(3000, 500), data[500..]);
    // Nothing else changed.
    let all = t.dst.to_vec();
    assert!(all[..2000].iter().all(|&b| b == 0));
    assert!(all[2500..3000].iter().all(|&b| b == 0));
    assert!(all[3500..].iter().all(|&b| b == 0));
    let stats = t.p.stats();
    assert_eq!(
        (stats.posted, stats.landed, stats.bytes_landed),
        (1, 1, 1000)
    );
    assert_eq!(stats.polls, 3);
}

#[test]
fn notification_follows_the_data_and_completion_comes_once() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.land_after_polls = 2);
    let data = pattern(LEN, 9);
    t.src.write(0, &data).unwrap();
    t.write(7, &[t.desc(0, LEN)], Some(b"note"));
    let mut completions = Vec::new();
    let mut seen_note = false;
    for _ in 0..10 {
        t.p.poll_completions(&mut completions);
        let notes = t.d_notes();
        if !notes.is_empty() {
            // The data is there whenever the notification is.
            assert_eq!(t.dst.to_vec(), data);
            assert_eq!(notes.len(), 1);
            assert_eq!(notes[0].from, name("p"));
            assert_eq!(notes[0].peer, Some(t.p_addr.clone()));
            assert_eq!(notes[0].bytes, b"note");
            assert!(!seen_note, "notification delivered twice");
            seen_note = true;
        } else if !seen_note {
            assert_eq!(t.dst.to_vec(), vec![0; LEN as usize]);
            assert!(completions.is_empty(), "completion before the data landed");
        }
    }
    assert!(seen_note);
    assert_eq!(completions, vec![ok(7)]);
    assert_eq!(t.d.stats().notifications_received, 1);
    // Its id is free again once reported.
    assert_eq!(
        t.p.abandon_write(WriteId(7)),
        Err(TransportError::UnknownWrite { write: WriteId(7) })
    );
    t.write(7, &[t.desc(0, 8)], None);
}

#[test]
fn source_is_read_at_landing_time() {
    let mut t = Pair::new();
    t.src.fill(1);
    t.write(1, &[t.desc(0, 16)], None);
    t.src.fill(2);
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert_eq!(t.dst_bytes(0, 16), vec![2; 16]);
}

#[test]
fn land_after_zero_polls_lands_inside_the_post() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.land_after_polls = 0);
    t.src.fill(3);
    t.write(1, &[t.desc(0, 64)], Some(b"x"));
    assert_eq!(t.dst_bytes(0, 64), vec![3; 64]);
    assert_eq!(t.d_notes().len(), 1);
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert!(t.p_poll().is_empty());
}

#[test]
fn transfers_land_in_post_order() {
    let mut t = Pair::new();
    for id in 1..=5u64 {
        t.src.write(id * 10, &[id as u8]).unwrap();
        // All five write the same target byte: the last posted must win.
        let d = Descriptor {
            local_addr: t.src_r.base + id * 10,
            remote_addr: t.dst_r.base,
            len: 1,
        };
        t.write(id, &[d], Some(&[id as u8]));
    }
    assert_eq!(t.p_poll(), (1..=5).map(ok).collect::<Vec<_>>());
    assert_eq!(t.dst_bytes(0, 1), vec![5]);
    let notes: Vec<u8> = t.d_notes().iter().map(|n| n.bytes[0]).collect();
    assert_eq!(notes, vec![1, 2, 3, 4, 5]);
}

#[test]
fn reads_copy_remote_into_local_and_notify_the_remote() {
    let mut t = Pair::new();
    let data = pattern(256, 77);
    t.dst.write(512, &data).unwrap();
    let d_addr = t.d_addr.clone();
    t.p.post_read(
        WriteId(3),
        &d_addr,
        &[t.desc(512, 256)],
        Some(b"read".to_vec()),
    )
    .unwrap();
    assert!(t.d_notes().is_empty());
    assert_eq!(t.p_poll(), vec![ok(3)]);
    let mut got = vec![0; 256];
    t.src.read(512, &mut got).unwrap();
    assert_eq!(got, data);
    assert_eq!(t.d_notes()[0].bytes, b"read");
}

#[test]
fn invalid_posts_are_rejected_with_the_right_error_and_post_nothing() {
    let mut t = Pair::new();
    let d_addr = t.d_addr.clone();
    // Memory of P that is allocated but not registered.
    let unregistered = t.p.alloc_region(LEN).unwrap();
    let (s, r) = (t.src_r.base, t.dst_r.base);
    let cases: Vec<(Vec<Descriptor>, TransportError)> = vec![
        (vec![], TransportError::NoDescriptors),
        (
            vec![t.desc(0, 8), t.desc(8, 0)],
            TransportError::EmptyDescriptor { index: 1 },
        ),
        (
            vec![t.desc(0, 8), t.desc(LEN - 8, 9)],
            TransportError::LocalOutOfRange {
                index: 1,
                addr: s + LEN - 8,
                len: 9,
            },
        ),
        (
            vec![Descriptor {
                local_addr: s - 1,
                remote_addr: r,
                len: 1,
            }],
            TransportError::LocalOutOfRange {
                index: 0,
                addr: s - 1,
                len: 1,
            },
        ),
        (
            vec![Descriptor {
                local_addr: unregistered.base(),
                remote_addr: r,
                len: 1,
            }],
            TransportError::LocalOutOfRange {
                index: 0,
                addr: unregistered.base(),
                len: 1,
            },
        ),
        (
            // D's memory as the local side.
            vec![Descriptor {
                local_addr: r,
                remote_addr: r,
                len: 1,
            }],
            TransportError::LocalOutOfRange {
                index: 0,
                addr: r,
                len: 1,
            },
        ),
        (
            vec![Descriptor {
                local_addr: s,
                remote_addr: r + LEN,
                len: 1,
            }],
            TransportError::RemoteOutOfRange {
                index: 0,
                addr: r + LEN,
                len: 1,
            },
        ),
        (
            // P's own memory as the remote side.
            vec![Descriptor {
                local_addr: s,
                remote_addr: s,
                len: 1,
            }],
            TransportError::RemoteOutOfRange {
                index: 0,
                addr: s,
                len: 1,
            },
        ),
        (
            vec![Descriptor {
                local_addr: s,
                remote_addr: u64::MAX,
                len: 2,
            }],
            TransportError::RemoteOutOfRange {
                index: 0,
                addr: u64::MAX,
                len: 2,
            },
        ),
    ];
    let n = cases.len() as u64;
    for (descs, want) in cases {
        let got = t.p.post_write(WriteId(1), &d_addr, &descs, None);
        assert_eq!(got, Err(want));
    }
    let unknown = addr("nobody", 0);
    assert_eq!(
        t.p.post_write(WriteId(1), &unknown, &[t.desc(0, 1)], None),
        Err(TransportError::UnknownPeer { peer: unknown })
    );
    for _ in 0..3 {
        assert!(t.p_poll().is_empty());
    }
    assert!(t.d_notes().is_empty());
    let stats = t.p.stats();
    assert_eq!((stats.posted, stats.post_errors), (0, n + 1));
    // The id is still free.
    t.write(1, &[t.desc(0, 1)], None);
    assert_eq!(
        t.p.post_write(WriteId(1), &d_addr, &[t.desc(0, 1)], None),
        Err(TransportError::DuplicateWrite { write: WriteId(1) })
    );
}

#[test]
fn metadata_is_checked_and_is_a_snapshot() {
    let mut t = Pair::new();
    let d_md = t.d.local_metadata().unwrap();
    let x = addr("x", 0);
    assert_eq!(
        t.p.load_remote(&x, &name("other"), &d_md),
        Err(TransportError::MetadataMismatch {
            expected: name("other"),
            found: name("d"),
        })
    );
    assert!(matches!(
        t.p.load_remote(&x, &name("d"), b"garbage"),
        Err(TransportError::BadMetadata { .. })
    ));
    assert!(matches!(
        t.p.load_remote(&x, &name("d"), &d_md[..d_md.len() - 1]),
        Err(TransportError::BadMetadata { .. })
    ));
    // The same agent under a second peer address conflicts.
    assert_eq!(
        t.p.load_remote(&x, &name("d"), &d_md),
        Err(TransportError::LoadConflict {
            peer: x.clone(),
            agent: name("d"),
        })
    );
    // Metadata from another fabric.
    let other = MemFabric::new();
    let stranger = other.agent(name("d")).unwrap();
    assert!(matches!(
        t.p.load_remote(
            &t.d_addr.clone(),
            &name("d"),
            &stranger.local_metadata().unwrap()
        ),
        Err(TransportError::BadMetadata { .. })
    ));
    // A region D registers after handing out its metadata is unknown to P until it reloads.
    let late = t.d.alloc_region(64).unwrap();
    let late_r = t.d.register_region(&late).unwrap();
    let d_addr = t.d_addr.clone();
    let desc = Descriptor {
        local_addr: t.src_r.base,
        remote_addr: late_r.base,
        len: 64,
    };
    assert!(matches!(
        t.p.post_write(WriteId(1), &d_addr, &[desc], None),
        Err(TransportError::RemoteOutOfRange { .. })
    ));
    t.p.load_remote(&d_addr, &name("d"), &t.d.local_metadata().unwrap())
        .unwrap();
    t.p.post_write(WriteId(1), &d_addr, &[desc], None).unwrap();
    assert_eq!(t.p_poll(), vec![ok(1)]);
}

#[test]
fn registration_errors() {
    let mut t = Pair::new();
    assert_eq!(
        t.p.register_region(&t.src.clone()),
        Err(TransportError::AlreadyRegistered { base: t.src_r.base })
    );
    let d_mem = t.d.alloc_region(8).unwrap();
    assert_eq!(
        t.p.register_region(&d_mem),
        Err(TransportError::ForeignRegion { base: d_mem.base() })
    );
    let mut other = MemFabric::new().agent(name("p")).unwrap();
    let alien = other.alloc_region(8).unwrap();
    assert!(matches!(
        t.p.register_region(&alien),
        Err(TransportError::ForeignRegion { .. })
    ));
    assert_eq!(
        t.p.alloc_region(0).unwrap_err(),
        TransportError::BadRegionLen { len: 0 }
    );
    assert_eq!(
        t.src.write(LEN - 1, &[1, 2]),
        Err(TransportError::RegionOutOfBounds {
            base: t.src_r.base,
            offset: LEN - 1,
            len: 2,
        })
    );
    // Regions never overlap and never touch.
    let a = t.p.alloc_region(1).unwrap();
    let b = t.p.alloc_region(1).unwrap();
    assert!(b.base() > a.base() + a.len());
    assert_eq!(a.range().to_region_desc(1, 1).base, a.base());
}

#[test]
fn fault_fail_next_posts() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.fail_next_posts = 2);
    let d_addr = t.d_addr.clone();
    for _ in 0..2 {
        assert!(matches!(
            t.p.post_write(WriteId(1), &d_addr, &[t.desc(0, 8)], None),
            Err(TransportError::PostFailed { .. })
        ));
    }
    assert!(t.p_poll().is_empty());
    t.write(1, &[t.desc(0, 8)], None);
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert_eq!(t.p.faults().fail_next_posts, 0);
}

#[test]
fn fault_fail_next_transfers_lands_nothing_and_notifies_nothing() {
    let mut t = Pair::new();
    t.src.fill(9);
    t.p.update_faults(|f| f.fail_next_transfers = 1);
    t.write(1, &[t.desc(0, LEN)], Some(b"n"));
    t.write(2, &[t.desc(0, 8)], Some(b"m"));
    let got = t.p_poll();
    assert!(matches!(
        &got[0],
        Completion {
            write: WriteId(1),
            result: Err(TransportError::TransferFailed { .. })
        }
    ));
    assert_eq!(got[1], ok(2));
    assert_eq!(t.dst_bytes(8, LEN - 8), vec![0; (LEN - 8) as usize]);
    let notes = t.d_notes();
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].bytes, b"m");
    assert_eq!(t.p.stats().failed, 1);
}

#[test]
fn fault_partial_transfer_lands_the_first_half() {
    let mut t = Pair::new();
    let data = pattern(LEN, 1);
    t.src.write(0, &data).unwrap();
    t.p.update_faults(|f| f.partial_next_transfers = 1);
    // Three descriptors of 1000 bytes: the first 1500 bytes land.
    let descs: Vec<_> = (0..3).map(|i| t.desc(i * 1000, 1000)).collect();
    t.write(1, &descs, Some(b"n"));
    let got = t.p_poll();
    assert!(matches!(
        got[..],
        [Completion {
            result: Err(TransportError::TransferFailed { .. }),
            ..
        }]
    ));
    assert_eq!(t.dst_bytes(0, 1500), data[..1500]);
    assert_eq!(t.dst_bytes(1500, 1500), vec![0; 1500]);
    assert!(t.d_notes().is_empty());
    assert_eq!(t.p.stats().bytes_landed, 1500);
}

#[test]
fn fault_delay_by_polls_and_by_time() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.land_after_polls = 1 + 4);
    t.write(1, &[t.desc(0, 8)], None);
    for _ in 0..4 {
        assert!(t.p_poll().is_empty());
    }
    assert_eq!(t.p_poll(), vec![ok(1)]);

    // A time delay: never sooner than asked (no sleep; poll until it lands).
    let delay = Duration::from_millis(20);
    t.p.set_faults(MemFaults {
        land_after: delay,
        ..MemFaults::default()
    });
    let start = Instant::now();
    t.write(2, &[t.desc(0, 8)], None);
    let deadline = start + Duration::from_secs(10);
    loop {
        let got = t.p_poll();
        if !got.is_empty() {
            assert_eq!(got, vec![ok(2)]);
            break;
        }
        assert!(Instant::now() < deadline, "never landed");
        std::thread::yield_now();
    }
    assert!(start.elapsed() >= delay);
}

#[test]
fn fault_drop_notifications() {
    let mut t = Pair::new();
    t.src.fill(4);
    t.p.update_faults(|f| f.drop_next_notifications = 2);
    t.write(1, &[t.desc(0, 8)], Some(b"lost"));
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert_eq!(t.dst_bytes(0, 8), vec![4; 8]);
    let d_addr = t.d_addr.clone();
    t.p.send_notification(&d_addr, b"lost too".to_vec())
        .unwrap();
    t.p.send_notification(&d_addr, b"kept".to_vec()).unwrap();
    let notes = t.d_notes();
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].bytes, b"kept");
    let stats = t.p.stats();
    assert_eq!(
        (stats.notifications_dropped, stats.notifications_sent),
        (2, 1)
    );
}

#[test]
fn arrival_hook_rings_once_per_drained_inbox() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let mut t = Pair::new();
    let rings = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&rings);
    t.d.set_arrival_hook(Arc::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let d_addr = t.d_addr.clone();
    t.p.send_notification(&d_addr, b"one".to_vec()).unwrap();
    t.p.send_notification(&d_addr, b"two".to_vec()).unwrap();
    assert_eq!(
        rings.load(Ordering::SeqCst),
        1,
        "one ring for a queue that was empty"
    );
    assert_eq!(t.d_notes().len(), 2);
    // A landing write's notification rings too, once the queue was drained.
    t.write(1, &[t.desc(0, 8)], Some(b"landed"));
    assert_eq!(
        rings.load(Ordering::SeqCst),
        1,
        "nothing arrived before the landing"
    );
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert_eq!(rings.load(Ordering::SeqCst), 2);
    assert_eq!(t.d_notes()[0].bytes, b"landed");
    // P has no hook: what arrives for P rings nothing.
    let p_addr = t.p_addr.clone();
    t.d.send_notification(&p_addr, b"to p".to_vec()).unwrap();
    assert_eq!(rings.load(Ordering::SeqCst), 2);
}

#[test]
fn fault_hang_never_lands_until_abandoned() {
    let mut t = Pair::new();
    t.src.fill(5);
    t.p.update_faults(|f| f.hang_next_transfers = 1);
    t.write(1, &[t.desc(0, 8)], Some(b"n"));
    t.write(2, &[t.desc(8, 8)], None);
    assert_eq!(t.p_poll(), vec![ok(2)]);
    for _ in 0..50 {
        assert!(t.p_poll().is_empty());
    }
    assert_eq!(t.dst_bytes(0, 8), vec![0; 8]);
    t.p.abandon_write(WriteId(1)).unwrap();
    assert_eq!(t.p_poll(), vec![err(1, TransportError::Abandoned)]);
    assert!(t.d_notes().is_empty());
}

#[test]
fn fault_stall_holds_everything_until_cleared() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.stall = true);
    t.write(1, &[t.desc(0, 8)], None);
    for _ in 0..5 {
        assert!(t.p_poll().is_empty());
    }
    t.p.update_faults(|f| f.stall = false);
    assert_eq!(t.p_poll(), vec![ok(1)]);
}

#[test]
fn faults_can_be_set_through_the_fabric() {
    let mut t = Pair::new();
    let faults = MemFaults {
        fail_next_posts: 1,
        ..MemFaults::default()
    };
    t.fabric.set_faults(&name("p"), faults.clone()).unwrap();
    assert_eq!(t.fabric.faults(&name("p")), Some(faults));
    let d_addr = t.d_addr.clone();
    assert!(t
        .p
        .post_write(WriteId(1), &d_addr, &[t.desc(0, 8)], None)
        .is_err());
    assert_eq!(
        t.fabric.set_faults(&name("zz"), MemFaults::default()),
        Err(TransportError::UnknownAgent { agent: name("zz") })
    );
    assert_eq!(t.fabric.stats(&name("p")).unwrap().post_errors, 1);
}

#[test]
fn completion_lag_opens_a_window_where_abandon_finds_a_landed_write() {
    let mut t = Pair::new();
    t.src.fill(6);
    t.p.update_faults(|f| f.completion_lag_polls = 2);
    t.write(1, &[t.desc(0, 8)], Some(b"n"));
    assert!(t.p_poll().is_empty());
    // Landed and notified, but P does not know yet.
    assert_eq!(t.dst_bytes(0, 8), vec![6; 8]);
    assert_eq!(t.d_notes().len(), 1);
    // Abandoning it now is fine: it is complete, and its completion stays Ok.
    t.p.abandon_write(WriteId(1)).unwrap();
    assert!(t.p_poll().is_empty());
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert!(t.p_poll().is_empty());
}

#[test]
fn abandon_before_landing_lands_nothing_and_reports_once() {
    let mut t = Pair::new();
    t.src.fill(8);
    t.write(1, &[t.desc(0, LEN)], Some(b"n"));
    t.p.abandon_write(WriteId(1)).unwrap();
    // Abandoning again before the report is harmless.
    t.p.abandon_write(WriteId(1)).unwrap();
    assert_eq!(t.p_poll(), vec![err(1, TransportError::Abandoned)]);
    for _ in 0..5 {
        assert!(t.p_poll().is_empty());
    }
    assert_eq!(t.dst.to_vec(), vec![0; LEN as usize]);
    assert!(t.d_notes().is_empty());
    assert_eq!(
        t.p.abandon_write(WriteId(1)),
        Err(TransportError::UnknownWrite { write: WriteId(1) })
    );
    assert_eq!(t.p.stats().abandoned, 1);
}

#[test]
fn fault_refuse_abandon() {
    let mut t = Pair::new();
    t.p.update_faults(|f| f.refuse_abandon = true);
    t.write(1, &[t.desc(0, 8)], None);
    assert_eq!(
        t.p.abandon_write(WriteId(1)),
        Err(TransportError::AbandonRefused { write: WriteId(1) })
    );
    // Refused: it still lands and completes normally.
    assert_eq!(t.p_poll(), vec![ok(1)]);
}

#[test]
fn invalidate_fails_in_flight_writes_and_blocks_the_peer_until_reloaded() {
    let mut t = Pair::new();
    t.src.fill(7);
    t.p.update_faults(|f| f.land_after_polls = 3);
    t.write(1, &[t.desc(0, 8)], Some(b"a"));
    t.write(2, &[t.desc(8, 8)], Some(b"b"));
    assert!(t.p_poll().is_empty());
    let d_addr = t.d_addr.clone();
    t.p.invalidate_remote(&d_addr);
    let invalid = || TransportError::PeerInvalidated {
        peer: addr("decode", 0),
    };
    assert_eq!(t.p_poll(), vec![err(1, invalid()), err(2, invalid())]);
    for _ in 0..5 {
        assert!(t.p_poll().is_empty());
    }
    assert_eq!(t.dst.to_vec(), vec![0; LEN as usize]);
    assert!(t.d_notes().is_empty());
    assert_eq!(
        t.p.post_write(WriteId(3), &d_addr, &[t.desc(0, 8)], None),
        Err(invalid())
    );
    assert_eq!(
        t.p.send_notification(&d_addr, b"x".to_vec()),
        Err(invalid())
    );
    // Notifications from D are no longer attributed to a peer.
    let p_addr = t.p_addr.clone();
    t.d.send_notification(&p_addr, b"hi".to_vec()).unwrap();
    let mut notes = Vec::new();
    t.p.poll_notifications(&mut notes);
    assert_eq!(notes[0].peer, None);
    // Reloaded: usable again.
    t.p.load_remote(&d_addr, &name("d"), &t.d.local_metadata().unwrap())
        .unwrap();
    t.p.update_faults(|f| f.land_after_polls = 1);
    t.write(3, &[t.desc(0, 8)], Some(b"c"));
    assert_eq!(t.p_poll(), vec![ok(3)]);
    assert_eq!(t.dst_bytes(0, 8), vec![7; 8]);
    assert_eq!(t.d_notes()[0].bytes, b"c");
    assert_eq!(t.p.stats().invalidated, 2);
}

#[test]
fn a_dead_target_fails_transfers_and_notifications() {
    let mut t = Pair::new();
    t.write(1, &[t.desc(0, 8)], None);
    let Pair {
        mut p, d, d_addr, ..
    } = t;
    // D's name stays taken while it lives.
    assert!(matches!(
        p.fabric().agent(name("d")),
        Err(TransportError::AgentNameInUse { .. })
    ));
    drop(d);
    let mut out = Vec::new();
    p.poll_completions(&mut out);
    assert_eq!(
        out,
        vec![err(1, TransportError::PeerUnreachable { agent: name("d") })]
    );
    assert_eq!(
        p.send_notification(&d_addr, b"x".to_vec()),
        Err(TransportError::PeerUnreachable { agent: name("d") })
    );
    // A new incarnation of D: P must load its metadata again.
    let mut d2 = p.fabric().agent(name("d")).unwrap();
    let mem = d2.alloc_region(8).unwrap();
    let mem_r = d2.register_region(&mem).unwrap();
    p.load_remote(&d_addr, &name("d"), &d2.local_metadata().unwrap())
        .unwrap();
    p.send_notification(&d_addr, b"again".to_vec()).unwrap();
    let mut notes = Vec::new();
    d2.poll_notifications(&mut notes);
    assert_eq!(notes[0].bytes, b"again");
    assert_eq!(mem_r.len, 8);
}

#[test]
fn a_dead_initiator_lands_nothing() {
    let mut t = Pair::new();
    t.src.fill(1);
    t.write(1, &[t.desc(0, 8)], Some(b"n"));
    let Pair {
        p,
        mut d,
        fabric,
        dst,
        ..
    } = t;
    drop(p);
    assert_eq!(dst.to_vec(), vec![0; LEN as usize]);
    let mut notes = Vec::new();
    d.poll_notifications(&mut notes);
    assert!(notes.is_empty());
    assert_eq!(fabric.stats(&name("p")).unwrap().posted, 1);
}

#[test]
fn bound_on_in_flight_transfers() {
    let mut t = Pair::with_limits(MemLimits {
        max_in_flight: 3,
        ..MemLimits::default()
    });
    for id in 0..3 {
        t.write(id, &[t.desc(0, 1)], None);
    }
    let d_addr = t.d_addr.clone();
    assert_eq!(
        t.p.post_write(WriteId(9), &d_addr, &[t.desc(0, 1)], None),
        Err(TransportError::TooManyInFlight { limit: 3 })
    );
    // Abandoned but unreported transfers still count.
    t.p.abandon_write(WriteId(0)).unwrap();
    assert!(t
        .p
        .post_write(WriteId(9), &d_addr, &[t.desc(0, 1)], None)
        .is_err());
    assert_eq!(t.p_poll().len(), 3);
    t.write(9, &[t.desc(0, 1)], None);
}

#[test]
fn bounds_on_notifications_and_descriptors() {
    let mut t = Pair::with_limits(MemLimits {
        max_notification_len: 16,
        max_inbox: 2,
        max_descriptors: 4,
        ..MemLimits::default()
    });
    assert_eq!(t.p.max_notification_len(), 16);
    let d_addr = t.d_addr.clone();
    assert_eq!(
        t.p.send_notification(&d_addr, vec![0; 17]),
        Err(TransportError::NotificationTooLarge { len: 17, limit: 16 })
    );
    assert_eq!(
        t.p.post_write(WriteId(1), &d_addr, &[t.desc(0, 1)], Some(vec![0; 17])),
        Err(TransportError::NotificationTooLarge { len: 17, limit: 16 })
    );
    let five: Vec<_> = (0..5).map(|i| t.desc(i, 1)).collect();
    assert_eq!(
        t.p.post_write(WriteId(1), &d_addr, &five, None),
        Err(TransportError::TooManyDescriptors { count: 5, limit: 4 })
    );
    // Fill D's queue.
    t.p.send_notification(&d_addr, vec![1]).unwrap();
    t.p.send_notification(&d_addr, vec![2]).unwrap();
    assert_eq!(
        t.p.send_notification(&d_addr, vec![3]),
        Err(TransportError::PeerInboxFull { agent: name("d") })
    );
    // A write whose notification does not fit waits; one without a notification does not.
    t.write(1, &[t.desc(0, 1)], Some(&[4]));
    t.write(2, &[t.desc(1, 1)], None);
    assert_eq!(t.p_poll(), vec![ok(2)]);
    assert!(t.p_poll().is_empty());
    assert_eq!(t.d_notes().len(), 2);
    assert_eq!(t.p_poll(), vec![ok(1)]);
    assert_eq!(t.d_notes()[0].bytes, vec![4]);
}

#[test]
fn bounds_on_peers_regions_and_memory() {
    let fabric = MemFabric::with_limits(MemLimits {
        max_peers: 1,
        max_regions: 1,
        max_fabric_bytes: 100,
        ..MemLimits::default()
    });
    let mut a = fabric.agent(name("a")).unwrap();
    let b = fabric.agent(name("b")).unwrap();
    let c = fabric.agent(name("c")).unwrap();
    let r1 = a.alloc_region(50).unwrap();
    let r2 = a.alloc_region(50).unwrap();
    assert_eq!(
        a.alloc_region(1).unwrap_err(),
        TransportError::OutOfMemory {
            requested: 1,
            available: 0,
        }
    );
    a.register_region(&r1).unwrap();
    assert_eq!(
        a.register_region(&r2),
        Err(TransportError::TooManyRegions { limit: 1 })
    );
    a.load_remote(&addr("b", 0), &name("b"), &b.local_metadata().unwrap())
        .unwrap();
    // Reloading the same peer is not a new peer.
    a.load_remote(&addr("b", 0), &name("b"), &b.local_metadata().unwrap())
        .unwrap();
    assert_eq!(
        a.load_remote(&addr("c", 0), &name("c"), &c.local_metadata().unwrap()),
        Err(TransportError::TooManyPeers { limit: 1 })
    );
    // Invalidating frees the slot; the tombstone of b is evicted by c's (bound 1).
    a.invalidate_remote(&addr("b", 0));
    a.load_remote(&addr("c", 0), &name("c"), &c.local_metadata().unwrap())
        .unwrap();
    a.invalidate_remote(&addr("c", 0));
    assert_eq!(
        a.send_notification(&addr("b", 0), vec![]),
        Err(TransportError::UnknownPeer { peer: addr("b", 0) })
    );
    assert_eq!(
        a.send_notification(&addr("c", 0), vec![]),
        Err(TransportError::PeerInvalidated { peer: addr("c", 0) })
    );
}

#[test]
fn two_agents_write_to_each_other_concurrently() {
    const WRITES: u64 = 200;
    const CHUNK: u64 = 64;
    let fabric = MemFabric::new();
    let mut a = fabric.agent(name("a")).unwrap();
    let mut b = fabric.agent(name("b")).unwrap();
    let setup = |t: &mut MemTransport| {
        let src = t.alloc_region(WRITES * CHUNK).unwrap();
        let dst = t.alloc_region(WRITES * CHUNK).unwrap();
        let src_r = t.register_region(&src).unwrap();
        let dst_r = t.register_region(&dst).unwrap();
        (src, dst, src_r, dst_r)
    };
    let (a_src, a_dst, a_src_r, a_dst_r) = setup(&mut a);
    let (b_src, b_dst, b_src_r, b_dst_r) = setup(&mut b);
    a.load_remote(&addr("b", 0), &name("b"), &b.local_metadata().unwrap())
        .unwrap();
    b.load_remote(&addr("a", 0), &name("a"), &a.local_metadata().unwrap())
        .unwrap();
    a_src.write(0, &pattern(WRITES * CHUNK, 1)).unwrap();
    b_src.write(0, &pattern(WRITES * CHUNK, 2)).unwrap();

    fn run(mut t: MemTransport, peer: PeerAddr, src: AddrRange, dst: AddrRange) -> Vec<Vec<u8>> {
        let mut done = BTreeMap::new();
        let mut notes = Vec::new();
        let mut out = Vec::new();
        let mut next = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.len() < WRITES as usize || notes.len() < WRITES as usize {
            assert!(Instant::now() < deadline, "stuck");
            if next < WRITES {
                let d = Descriptor {
                    local_addr: src.base + next * CHUNK,
                    remote_addr: dst.base + next * CHUNK,
                    len: CHUNK,
                };
                match t.post_write(
                    WriteId(next),
                    &peer,
                    &[d],
                    Some(next.to_le_bytes().to_vec()),
                ) {
                    Ok(()) => next += 1,
                    Err(TransportError::PeerInboxFull { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            t.poll_completions(&mut out);
            for c in out.drain(..) {
                assert_eq!(c.result, Ok(()));
                assert!(done.insert(c.write, ()).is_none(), "two completions");
            }
            let mut got = Vec::new();
            t.poll_notifications(&mut got);
            notes.extend(got.into_iter().map(|n| n.bytes));
        }
        notes
    }

    let ta = std::thread::spawn(move || run(a, addr("b", 0), a_src_r, b_dst_r));
    let tb = std::thread::spawn(move || run(b, addr("a", 0), b_src_r, a_dst_r));
    let notes_at_a = ta.join().unwrap();
    let notes_at_b = tb.join().unwrap();
    let in_order: Vec<Vec<u8>> = (0..WRITES).map(|i| i.to_le_bytes().to_vec()).collect();
    assert_eq!(notes_at_a, in_order);
    assert_eq!(notes_at_b, in_order);
    assert_eq!(b_dst.to_vec(), pattern(WRITES * CHUNK, 1));
    assert_eq!(a_dst.to_vec(), pattern(WRITES * CHUNK, 2));
}

/// One step of the random walk below.
#[derive(Debug, Clone)]
enum Step {
    Post {
        slot: u8,
        notify: bool,
    },
    Poll,
    Abandon(u8),
    Invalidate,
    Reload,
    Faults {
        fail: bool,
        hang: bool,
        lag: u8,
        delay: u8,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u8..32, any::<bool>()).prop_map(|(slot, notify)| Step::Post { slot, notify }),
        4 => Just(Step::Poll),
        1 => (0u8..64).prop_map(Step::Abandon),
        1 => Just(Step::Invalidate),
        1 => Just(Step::Reload),
        1 => (any::<bool>(), any::<bool>(), 0u8..3, 0u8..3)
            .prop_map(|(fail, hang, lag, delay)| Step::Faults { fail, hang, lag, delay }),
    ]
}

proptest! {
    /// Whatever happens, every accepted post is reported exactly once, a notification is only
    /// ever seen with its data in place, and only for a write that completes `Ok`.
    #[test]
    fn every_post_is_reported_once_and_notifications_follow_data(
        steps in proptest::collection::vec(step(), 1..80)
    ) {
        const SLOT: u64 = 64;
        let mut t = Pair::new();
        let d_addr = t.d_addr.clone();
        let mut next_id = 0u64;
        let mut posted: BTreeMap<u64, u8> = BTreeMap::new(); // id -> slot
        let mut reported: BTreeMap<u64, Result<(), TransportError>> = BTreeMap::new();
        let mut notified: Vec<u64> = Vec::new();
        let check_notes = |t: &mut Pair, posted: &BTreeMap<u64, u8>, notified: &mut Vec<u64>| {
            for n in t.d_notes() {
                let id = u64::from_le_bytes(n.bytes.try_into().unwrap());
                let slot = u64::from(posted[&id]);
                // Each write fills its slot with the low byte of its id.
                assert_eq!(t.dst_bytes(slot * SLOT, SLOT), vec![id as u8; SLOT as usize]);
                notified.push(id);
            }
        };
        for s in steps {
            match s {
                Step::Post { slot, notify } => {
                    let id = next_id;
                    next_id += 1;
                    // Only one pending write per slot, so a slot's content names its writer.
                    let busy = posted.iter().any(|(i, &sl)| sl == slot && !reported.contains_key(i));
                    if busy {
                        continue;
                    }
                    t.src.write(u64::from(slot) * SLOT, &[id as u8; SLOT as usize]).unwrap();
                    let note = notify.then(|| id.to_le_bytes().to_vec());
                    let desc = t.desc(u64::from(slot) * SLOT, SLOT);
                    if t.p.post_write(WriteId(id), &d_addr, &[desc], note).is_ok() {
                        posted.insert(id, slot);
                    }
                }
                Step::Poll => {
                    for c in t.p_poll() {
                        prop_assert!(posted.contains_key(&c.write.0));
                        prop_assert!(reported.insert(c.write.0, c.result).is_none());
                    }
                }
                Step::Abandon(k) => {
                    let _ = t.p.abandon_write(WriteId(u64::from(k)));
                }
                Step::Invalidate => t.p.invalidate_remote(&d_addr),
                Step::Reload => {
                    let md = t.d.local_metadata().unwrap();
                    t.p.load_remote(&d_addr, &name("d"), &md).unwrap();
                }
                Step::Faults { fail, hang, lag, delay } => t.p.set_faults(MemFaults {
                    fail_next_transfers: u32::from(fail),
                    hang_next_transfers: u32::from(hang),
                    completion_lag_polls: u32::from(lag),
                    land_after_polls: 1 + u32::from(delay),
                    ..MemFaults::default()
                }),
            }
            check_notes(&mut t, &posted, &mut notified);
        }
        // Drain: hung writes need abandoning; everything else finishes within a few polls.
        for &id in posted.keys() {
            if !reported.contains_key(&id) {
                let _ = t.p.abandon_write(WriteId(id));
            }
        }
        for _ in 0..10 {
            for c in t.p_poll() {
                prop_assert!(reported.insert(c.write.0, c.result).is_none());
            }
            check_notes(&mut t, &posted, &mut notified);
        }
        prop_assert_eq!(reported.keys().collect::<Vec<_>>(), posted.keys().collect::<Vec<_>>());
        for id in &notified {
            prop_assert_eq!(&reported[id], &Ok(()));
        }
        let mut unique = notified.clone();
        unique.sort_unstable();
        unique.dedup();
        prop_assert_eq!(unique.len(), notified.len());
    }
}
