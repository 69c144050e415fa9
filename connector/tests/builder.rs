//! `RankBuilder`: ranks started on memory the engine owns hand requests over byte for byte; the
//! raw-pointer entry registers the engine's memory in place; bad regions are refused with typed
//! errors before anything is registered or started. With the feature `nixl` (and the runtime of
//! `scripts/nixl-env.sh`), the same on NIXL.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvhandoff::{
    AdoptError, BlockIds, BuildError, ConnectorEvent, EngineId, EngineRank, KvCacheError,
    KvGeometry, KvLayout, KvRegion, KvTransferParams, LoadFailurePolicy, MemFabric, MemoryLocation,
    ModelIdentity, RankBuilder, RankSettings, RegionProblem, RequestId, Runtime, SettingValue,
    SettingsError, SideChannel, StartError, TransportKind,
};

const BLOCKS: u64 = 16;

fn geometry() -> KvGeometry {
    // 2 layers, K and V: 4 regions of 2 × 16 × 2 × 4 = 256-byte blocks.
    KvGeometry::dense(2, 2, 16, 2, 4, KvLayout::Nhd)
}

fn model() -> ModelIdentity {
    ModelIdentity {
        model: "builder-test".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    }
}

fn engine(name: &str) -> EngineId {
    EngineId::new(name).unwrap()
}

fn block_lens() -> Vec<u64> {
    geometry()
        .regions()
        .unwrap()
        .iter()
        .map(|s| s.block_len)
        .collect()
}

/// The engine's own buffers, one per region, `BLOCKS` blocks each.
fn owned_regions() -> Vec<KvRegion> {
    block_lens()
        .into_iter()
        .map(|len| KvRegion::new(vec![0u8; (len * BLOCKS) as usize]))
        .collect()
}

/// Counts its drops: the owner of a raw region.
#[derive(Clone)]
struct DropCount(Arc<AtomicUsize>);

impl Drop for DropCount {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Memory an engine keeps, passed by pointer, with an owner that counts its drop.
struct RawBuffers {
    ptrs: Vec<(NonNull<u8>, usize)>,
    drops: Arc<AtomicUsize>,
}

impl RawBuffers {
    fn regions(lens: &[u64]) -> (RawBuffers, Vec<KvRegion>) {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut ptrs = Vec::new();
        let mut regions = Vec::new();
        for &len in lens {
            let mut memory = vec![0u8; len as usize].into_boxed_slice();
            let (ptr, len) = (NonNull::new(memory.as_mut_ptr()).unwrap(), memory.len());
            ptrs.push((ptr, len));
            // SAFETY: the boxed slice is `len` writable host bytes; it moves into the owner
            // (its heap memory stays put) and is freed only when kvhandoff drops the owner;
            // this test reads it through `ptrs` only while the rank runs and after the
            // request's `BlocksReady`.
            regions.push(unsafe {
                KvRegion::from_raw_parts(
                    ptr,
                    len,
                    MemoryLocation::Host,
                    (memory, DropCount(drops.clone())),
                )
            });
        }
        (RawBuffers { ptrs, drops }, regions)
    }

    fn drops(&self) -> usize {
        self.drops.load(Ordering::SeqCst)
    }

    /// A copy of region `r`'s bytes, read through the engine's own pointer.
    fn read(&self, r: usize) -> Vec<u8> {
        let (ptr, len) = self.ptrs[r];
        // SAFETY: the rank is running (the owner is alive) and no transfer touches the blocks
        // read (the request's event came).
        unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len).to_vec() }
    }
}

fn builder(name: &str, regions: Vec<KvRegion>, fabric: &MemFabric) -> RankBuilder {
    RankBuilder::new(engine(name), geometry(), model())
        .regions(regions)
        .transport(TransportKind::Mem(fabric.clone()))
}

fn pattern(request: usize, region: usize, block: usize, offset: usize) -> u8 {
    (request * 37 + region * 11 + block * 5 + offset * 3 + offset / 253) as u8
}

/// Waits for `rank`'s events until `done` has seen what it needs.
fn events_until(rank: &mut EngineRank, mut done: impl FnMut(ConnectorEvent) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for event in rank.wait_events(Duration::from_millis(10)) {
            if done(event) {
                return;
            }
        }
    }
    panic!("timed out waiting for events");
}

/// Hands `requests` requests of 1-3 blocks over from P to D (push), P's blocks filled through
/// its cache, every byte of D's checked through its cache (and through `d_raw` too when given).
fn hand_over(p: &mut EngineRank, d: &mut EngineRank, requests: usize, d_raw: Option<&RawBuffers>) {
    let regions = p.kv().num_regions();
    for r in 0..requests {
        let n = 1 + r % 3;
        // P's blocks from the low end of its pool, D's from the high end: they differ.
        let p_blocks: Vec<u32> = (0..n as u32).collect();
        let d_blocks: Vec<u32> = (0..n as u32).map(|b| BLOCKS as u32 - 1 - b).collect();
        for region in 0..regions {
            let len = p.kv().block_len(region).unwrap() as usize;
            for (i, &block) in p_blocks.iter().enumerate() {
                let bytes: Vec<u8> = (0..len).map(|o| pattern(r, region, i, o)).collect();
                p.kv().write_block(region, block, &bytes).unwrap();
            }
        }
        let request = RequestId::new(format!("req-{r}")).unwrap();
        let leg = KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        };
        let tokens = n as u64 * 4;
        let answer = p
            .request_finished(&request, BlockIds::single_group(p_blocks), tokens, &leg)
            .unwrap();
        d.request_allocated(
            &request,
            BlockIds::single_group(d_blocks.clone()),
            tokens,
            &answer,
        )
        .unwrap();
        events_until(d, |e| match e {
            ConnectorEvent::BlocksReady { request: q, .. } if q == request => true,
            other => panic!("D: {other:?}"),
        });
        events_until(p, |e| {
            matches!(e, ConnectorEvent::BlocksFree { released: None, .. })
        });
        for region in 0..regions {
            let len = d.kv().block_len(region).unwrap() as usize;
            let mut got = vec![0u8; len];
            for (i, &block) in d_blocks.iter().enumerate() {
                d.kv().read_block(region, block, &mut got).unwrap();
                let want: Vec<u8> = (0..len).map(|o| pattern(r, region, i, o)).collect();
                assert!(got == want, "req {r} region {region} block {block} differs");
                if let Some(raw) = d_raw {
                    let mem = raw.read(region);
                    let at = block as usize * len;
                    assert!(mem[at..at + len] == want[..], "not landed in place");
                }
            }
        }
    }
}

#[test]
fn engine_owned_memory_hands_requests_over_byte_for_byte() {
    let fabric = MemFabric::new();
    let mut runtime = Runtime::start().unwrap();
    let mut p = builder("prefill", owned_regions(), &fabric)
        .start_on(&mut runtime)
        .unwrap();
    let mut d = builder("decode", owned_regions(), &fabric)
        .start_on(&mut runtime)
        .unwrap();
    assert_eq!(p.kv().logical_blocks(), BLOCKS as u32);
    assert_eq!(p.kv().num_regions(), 4);
    hand_over(&mut p, &mut d, 6, None);
    drop((p, d));
    runtime.shutdown();
}

/// A rank configured from the deployment file's `[rank]` table hands requests over under
/// those settings; settings that contradict each other stop the builder, naming the rule.
#[test]
fn ranks_take_their_settings_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvhandoff.toml");
    let text = "[node]\nrequests = 4\n\n[rank]\nlease_ms = 5000\nlayerwise_parts = 2\nload_failure_policy = \"recompute\"\n";
    std::fs::write(&path, text).unwrap();
    let settings = RankSettings::from_file(&path).unwrap();
    let fabric = MemFabric::new();
    let mut runtime = Runtime::start().unwrap();
    let mut ranks = ["prefill", "decode"].map(|name| {
        builder(name, owned_regions(), &fabric)
            .settings(&settings)
            .unwrap()
            .start_on(&mut runtime)
            .unwrap()
    });
    let applied = *ranks[0].connector().settings();
    assert_eq!(applied.lease_duration, Duration::from_secs(5));
    assert_eq!(applied.layerwise_parts, 2);
    assert_eq!(applied.load_failure_policy, LoadFailurePolicy::Recompute);
    assert_eq!(
        applied.block_tokens,
        Some(4),
        "the builder's geometry: 4-token blocks"
    );
    let [p, d] = &mut ranks;
    hand_over(p, d, 3, None);
    drop(ranks);
    runtime.shutdown();

    let mut contradiction = settings.clone();
    contradiction
        .set("lease_extension_ms", SettingValue::Int(6000), "test")
        .unwrap();
    let err = builder("x", owned_regions(), &fabric)
        .settings(&contradiction)
        .unwrap_err();
    assert!(matches!(err, SettingsError::Invalid(_)), "{err:?}");
}

#[test]
fn tcp_side_channel_and_own_runtimes() {
    let fabric = MemFabric::new();
    let tcp = || SideChannel::tcp("127.0.0.1:0".parse().unwrap());
    let mut p = builder("prefill", owned_regions(), &fabric)
        .side_channel(tcp())
        .start()
        .unwrap();
    let p_addr = p.side_channel().unwrap();
    assert_eq!(p.identity().port, p_addr.port());
    let mut d = builder("decode", owned_regions(), &fabric)
        .side_channel(tcp())
        .peer(engine("prefill"), p_addr)
        .start()
        .unwrap();
    p.add_peer(&engine("decode"), d.side_channel().unwrap())
        .unwrap();
    hand_over(&mut p, &mut d, 3, None);
    d.shutdown();
    p.shutdown();
}

#[test]
fn raw_regions_are_used_in_place_and_released_when_the_rank_stops() {
    let fabric = MemFabric::new();
    let lens: Vec<u64> = block_lens().iter().map(|l| l * BLOCKS).collect();
    let (p_raw, p_regions) = RawBuffers::regions(&lens);
    let (d_raw, d_regions) = RawBuffers::regions(&lens);
    let mut runtime = Runtime::start().unwrap();
    let mut p = builder("prefill", p_regions, &fabric)
        .start_on(&mut runtime)
        .unwrap();
    let mut d = builder("decode", d_regions, &fabric)
        .start_on(&mut runtime)
        .unwrap();
    // What P's engine writes through its cache is in its own memory.
    p.kv().write(1, 5, &[9, 8, 7]).unwrap();
    assert_eq!(&p_raw.read(1)[5..8], &[9, 8, 7]);
    hand_over(&mut p, &mut d, 4, Some(&d_raw));
    let kv = d.kv().clone();
    assert_eq!((p_raw.drops(), d_raw.drops()), (0, 0));
    drop((p, d));
    runtime.shutdown();
    // Every owner dropped once the ranks stopped, even with a cache handle left; the handle
    // then fails instead of touching freed memory.
    assert_eq!((p_raw.drops(), d_raw.drops()), (4, 4));
    let mut buf = [0u8; 4];
    assert!(matches!(
        kv.read(0, 0, &mut buf),
        Err(KvCacheError::Access(_))
    ));
}

/// A refused start registered nothing: the same engine starts at once on the same fabric
/// (its agent name is free), and the raw owners of the refused regions were dropped.
fn refused(regions: Vec<KvRegion>) -> StartError {
    let fabric = MemFabric::new();
    let mut runtime = Runtime::start().unwrap();
    let error = builder("prefill", regions, &fabric)
        .start_on(&mut runtime)
        .unwrap_err();
    let again = builder("prefill", owned_regions(), &fabric).start_on(&mut runtime);
    assert!(again.is_ok(), "the agent name was left taken: {again:?}");
    drop(again);
    runtime.shutdown();
    error
}

#[test]
fn bad_regions_are_refused_with_typed_errors_and_nothing_is_left() {
    let lens = block_lens();
    let fits: Vec<u64> = lens.iter().map(|l| l * BLOCKS).collect();

    // Wrong count.
    let (raw, mut regions) = RawBuffers::regions(&fits);
    regions.pop();
    let e = refused(regions);
    assert!(matches!(
        e,
        StartError::Build(BuildError::RegionCount {
            expected: 4,
            got: 3
        })
    ));
    // The three given, and the one popped.
    assert_eq!(raw.drops(), 4);

    // Zero length.
    let mut regions = owned_regions();
    regions[2] = KvRegion::new(Vec::new());
    let e = refused(regions);
    assert!(matches!(
        e,
        StartError::Build(BuildError::RegionSize {
            index: 2,
            problem: RegionProblem::Empty,
            ..
        })
    ));

    // Not a whole number of blocks.
    let mut odd = fits.clone();
    odd[1] += 3;
    let (raw, regions) = RawBuffers::regions(&odd);
    let e = refused(regions);
    assert!(matches!(
        e,
        StartError::Build(BuildError::RegionSize {
            index: 1,
            problem: RegionProblem::NotBlockAligned { .. },
            ..
        })
    ));
    assert_eq!(raw.drops(), 4);

    // Unequal block counts.
    let mut short = fits.clone();
    short[3] = lens[3] * (BLOCKS - 1);
    let (_, regions) = RawBuffers::regions(&short);
    let e = refused(regions);
    assert!(matches!(
        e,
        StartError::Build(BuildError::RegionSize {
            index: 3,
            problem: RegionProblem::BlockCount { .. },
            ..
        })
    ));

    // Device memory on a host-only transport: typed, before anything is registered.
    let drops = Arc::new(AtomicUsize::new(0));
    let mut regions = owned_regions();
    let fake = NonNull::<u8>::dangling();
    // SAFETY: never dereferenced: the build refuses device memory before adopting anything.
    regions[0] = unsafe {
        KvRegion::from_raw_parts(
            fake,
            (lens[0] * BLOCKS) as usize,
            MemoryLocation::Device { device: 0 },
            DropCount(drops.clone()),
        )
    };
    let e = refused(regions);
    assert!(matches!(
        e,
        StartError::Build(BuildError::Adopt {
            index: 0,
            source: AdoptError::Unsupported {
                transport: "mem",
                location: MemoryLocation::Device { device: 0 }
            }
        })
    ));
    assert_eq!(drops.load(Ordering::SeqCst), 1);

    // No transport.
    let e = RankBuilder::new(engine("other"), geometry(), model())
        .regions(owned_regions())
        .start()
        .unwrap_err();
    assert!(matches!(e, StartError::NoTransport));
}

#[test]
fn block_access_is_checked() {
    let fabric = MemFabric::new();
    let rank = builder("prefill", owned_regions(), &fabric)
        .start()
        .unwrap();
    let kv = rank.kv();
    let len = kv.block_len(0).unwrap() as usize;
    assert!(matches!(
        kv.write_block(0, BLOCKS as u32, &vec![0; len]),
        Err(KvCacheError::NoBlock { .. })
    ));
    assert!(matches!(
        kv.write_block(0, 0, &vec![0; len - 1]),
        Err(KvCacheError::BlockLen { .. })
    ));
    assert!(matches!(
        kv.write_block(9, 0, &vec![0; len]),
        Err(KvCacheError::NoRegion { .. })
    ));
    assert!(matches!(
        kv.write(0, BLOCKS * len as u64 - 1, &[1, 2]),
        Err(KvCacheError::Access(_))
    ));
    rank.shutdown();
}

#[test]
fn a_heterogeneous_pairing_starts_routed_ranks_in_process_only() {
    use kvhandoff::SideName;
    use kvhandoff_protocol::hetero::{model as catalog, plan_pair};
    let plan = plan_pair(
        catalog("gqa8").unwrap(),
        "tp=1,block=16,layout=NHD".parse().unwrap(),
        "tp=2,block=32,layout=HND".parse().unwrap(),
    )
    .unwrap();
    let fabric = MemFabric::new();
    let mut runtime = Runtime::start().unwrap();
    let d0 = plan.decode.ranks[0].geometry.clone();
    let routed = |geometry: KvGeometry| {
        RankBuilder::new(engine("decode"), geometry, model())
            .regions([KvRegion::zeroed(4096), KvRegion::zeroed(1024)])
            .transport(TransportKind::Mem(fabric.clone()))
            .pairing(plan.clone(), SideName::Decode)
    };
    let rank = routed(d0.clone()).start_on(&mut runtime).unwrap();
    assert!(rank.route().is_some());
    assert!(rank.connector().links().is_some());
    assert!(matches!(
        rank.kv().block_len(0),
        Err(KvCacheError::NotBlocks)
    ));
    drop(rank);
    // Over a TCP side channel too: its handshake says it is routed, and a peer's route decides.
    let tcp = RankBuilder::new(engine("decode"), d0.clone(), model())
        .regions([KvRegion::zeroed(4096), KvRegion::zeroed(1024)])
        .transport(TransportKind::Mem(MemFabric::new()))
        .pairing(plan.clone(), SideName::Decode)
        .side_channel(SideChannel::tcp("127.0.0.1:0".parse().unwrap()))
        .start_on(&mut runtime)
        .unwrap();
    assert!(tcp.side_channel().is_some());
    assert!(tcp.peer_info().routed);
    drop(tcp);
    let mut other = d0;
    other.tp_rank = 7;
    let wrong = routed(other).start_on(&mut runtime).unwrap_err();
    assert!(matches!(wrong, StartError::Pairing(_)), "{wrong}");
    runtime.shutdown();
}

#[cfg(feature = "nixl")]
mod nixl {
    use super::*;
    use kvhandoff_actors::transport::nixl::nixl_runtime_available;

    /// NIXL on the engine's memory: owned buffers are registered where they are (the cache's
    /// addresses are the engine's), and P's writes land in D's raw memory, read back through
    /// D's own pointer.
    #[test]
    fn nixl_registers_and_writes_the_engines_own_memory() {
        if let Err(e) = nixl_runtime_available() {
            panic!("{e} (source scripts/nixl-env.sh)");
        }
        let p_regions = owned_regions();
        let addrs: Vec<u64> = p_regions.iter().map(KvRegion::addr).collect();
        let lens: Vec<u64> = block_lens().iter().map(|l| l * BLOCKS).collect();
        let (d_raw, d_regions) = RawBuffers::regions(&lens);
        let mut runtime = Runtime::start().unwrap();
        let nixl = |name: &str, regions| {
            RankBuilder::new(engine(name), geometry(), model())
                .regions(regions)
                .transport(TransportKind::nixl())
        };
        let mut p = nixl("prefill", p_regions).start_on(&mut runtime).unwrap();
        let mut d = nixl("decode", d_regions).start_on(&mut runtime).unwrap();
        for (i, addr) in addrs.iter().enumerate() {
            assert_eq!(
                p.kv().region_addr(i).unwrap(),
                *addr,
                "region {i} was copied"
            );
            assert_eq!(
                d.kv().region_addr(i).unwrap(),
                d_raw.ptrs[i].0.as_ptr() as u64
            );
        }
        hand_over(&mut p, &mut d, 4, Some(&d_raw));
        drop((p, d));
        runtime.shutdown();
        assert_eq!(d_raw.drops(), 4, "NIXL let go of the engine's memory");
    }

    /// Integrity digests over NIXL (host memory): P digests its blocks as it posts, D checks
    /// what landed before `BlocksReady`; every request verifies and nothing mismatches.
    #[test]
    fn nixl_ranks_carry_integrity_digests() {
        if let Err(e) = nixl_runtime_available() {
            panic!("{e} (source scripts/nixl-env.sh)");
        }
        let mut settings = RankSettings::default();
        settings
            .set("integrity_digest", SettingValue::Bool(true), "test")
            .unwrap();
        let mut runtime = Runtime::start().unwrap();
        let nixl = |name: &str| {
            RankBuilder::new(engine(name), geometry(), model())
                .regions(owned_regions())
                .transport(TransportKind::nixl())
                .settings(&settings)
                .unwrap()
        };
        let mut p = nixl("prefill-digest").start_on(&mut runtime).unwrap();
        let mut d = nixl("decode-digest").start_on(&mut runtime).unwrap();
        hand_over(&mut p, &mut d, 4, None);
        let counters = kvhandoff::metrics::endpoint_snapshot();
        drop((p, d));
        runtime.shutdown();
        assert_eq!(counters.digest_mismatches, 0);
    }
}

/// `warm_peers`: D's handshake with P happens as D starts, so the first request makes none;
/// without it, the first request makes it. A peer that is not up is a typed warm-up error.
#[test]
fn warm_peers_makes_the_handshake_before_the_first_request() {
    let fabric = MemFabric::new();
    let tcp = || SideChannel::tcp("127.0.0.1:0".parse().unwrap());
    for warm in [true, false] {
        // P takes D's handshake before it learns D's address, as a P that D engines dial.
        let mut p_side = kvhandoff::SideChannelConfig::new("127.0.0.1:0".parse().unwrap());
        p_side.accept = kvhandoff::AcceptPolicy::Known([engine("decode")].into());
        let mut p = builder("prefill", owned_regions(), &fabric)
            .side_channel(SideChannel::Tcp(p_side))
            .start()
            .unwrap();
        let p_addr = p.side_channel().unwrap();
        let mut d = builder("decode", owned_regions(), &fabric)
            .side_channel(tcp())
            .peer(engine("prefill"), p_addr);
        if warm {
            d = d.warm_peers();
        }
        let mut d = d.start().unwrap();
        p.add_peer(&engine("decode"), d.side_channel().unwrap())
            .unwrap();
        let before = d
            .side_channel_stats()
            .expect("a TCP side channel")
            .outgoing_ok;
        assert_eq!(before, u64::from(warm), "warm_peers = {warm}");
        hand_over(&mut p, &mut d, 2, None);
        let after = d.side_channel_stats().unwrap().outgoing_ok;
        assert_eq!(after, 1, "one handshake in all, warm_peers = {warm}");
        d.shutdown();
        p.shutdown();
    }
    // Nobody listens there: a typed error, and the rank is fine.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let d = builder("decode", owned_regions(), &fabric)
        .side_channel(tcp())
        .peer(engine("prefill"), closed)
        .start()
        .unwrap();
    let peer = kvhandoff::PeerAddr::new(engine("prefill"), 0);
    let err = d.warm_up(&peer, Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, StartError::WarmUp { .. }), "{err}");
    d.shutdown();
}
