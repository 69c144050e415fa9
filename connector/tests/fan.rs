//! Multi-rank requests through the connector: ranks of two engines of different TP as routed
//! in-process ranks over the in-memory transport (a test route places each write: P rank `p`
//! copies its buffer into its own part of D's), with `RankLinks` from the pair's plan. A D rank
//! fed by two P ranks is ready only when both wrote; a P rank feeding two D ranks frees its
//! blocks once both pairs settled; an abort and a late verdict still end in the request's one
//! event.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvhandoff::{
    ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorSettings, KvConnector,
    KvTransferParams, RankLinks, Runtime,
};
use kvhandoff_actors::system::agent_name;
use kvhandoff_actors::system::{build_routed_rank, RankOptions, RoutedRegion, ShellConfig};
use kvhandoff_actors::transport::mem::{MemFabric, MemFaults};
use kvhandoff_protocol::driver::{RouteError, RouteRequest, TransferRoute};
use kvhandoff_protocol::hetero::{model, plan_pair, PairPlan, SideName};
use kvhandoff_protocol::machine::{BlockPairing, Config, DecodeFailure, Rejected, ReleaseCause};
use kvhandoff_protocol::planner::Descriptor;
use kvhandoff_protocol::{BlockIds, EngineId, KvGeometry, ModelIdentity, RequestId};

const PART: u64 = 4096;

/// P rank `p` writes its buffer's first `PART` bytes to D's buffer at `p × PART`, or D reads
/// them there (pull); the buffers' addresses are filled in once every rank is built.
struct TestRoute {
    peers: Vec<KvGeometry>,
    /// Known once the buffer is registered.
    own_base: Arc<Mutex<u64>>,
    own_tp: u32,
    /// This rank is D's (it reads in pull).
    decode: bool,
    /// Each rank's buffer, by (D's, TP rank).
    bases: Arc<Mutex<BTreeMap<(bool, u32), u64>>>,
}

impl TransferRoute for TestRoute {
    fn accepts(&self, _: &KvGeometry, peer: &KvGeometry) -> Result<(), RouteError> {
        if self.peers.contains(peer) {
            Ok(())
        } else {
            Err(RouteError("not a planned rank".into()))
        }
    }

    fn descriptors(
        &self,
        request: &RouteRequest<'_>,
        out: &mut Vec<Descriptor>,
    ) -> Result<(), RouteError> {
        let bases = self.bases.lock().unwrap();
        let peer_tp = request.peer.geometry.tp_rank;
        let Some(&base) = bases.get(&(!self.decode, peer_tp)) else {
            return Err(RouteError("unknown peer rank".into()));
        };
        let own = *self.own_base.lock().unwrap();
        out.push(if self.decode {
            Descriptor {
                local_addr: own + u64::from(peer_tp) * PART,
                remote_addr: base,
                len: PART,
            }
        } else {
            Descriptor {
                local_addr: own,
                remote_addr: base + u64::from(self.own_tp) * PART,
                len: PART,
            }
        });
        Ok(())
    }
}

struct Rank {
    tp: u32,
    conn: KvConnector,
    buffer: RoutedRegion,
}

/// Every rank of both sides of `pair`, P's buffers filled with `p + 1`.
fn build(pair: &PairPlan) -> (Runtime, Vec<Rank>, Vec<Rank>) {
    build_with(pair, true)
}

/// [`build`], D's routes accepting P's geometries only if `decode_accepts`.
fn build_with(pair: &PairPlan, decode_accepts: bool) -> (Runtime, Vec<Rank>, Vec<Rank>) {
    let (runtime, p, d, _) = build_on(pair, decode_accepts);
    (runtime, p, d)
}

/// [`build_with`], and the fabric every rank's transport is on.
fn build_on(pair: &PairPlan, decode_accepts: bool) -> (Runtime, Vec<Rank>, Vec<Rank>, MemFabric) {
    let mut runtime = Runtime::start().unwrap();
    let fabric = MemFabric::new();
    let model_id = ModelIdentity {
        model: "fan-test".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    };
    let bases = Arc::new(Mutex::new(BTreeMap::new()));
    let mut sides = Vec::new();
    for (side, engine, layout, other) in [
        (SideName::Prefill, "prefill", &pair.prefill, &pair.decode),
        (SideName::Decode, "decode", &pair.decode, &pair.prefill),
    ] {
        let id = EngineId::new(engine).unwrap();
        let mut ranks = Vec::new();
        for rank in &layout.ranks {
            let tp = rank.rank.tp;
            let transport = fabric
                .agent(kvhandoff_actors::system::agent_name(&id, tp).unwrap())
                .unwrap();
            let own_base = Arc::new(Mutex::new(0));
            let route = Arc::new(TestRoute {
                peers: if side == SideName::Decode && !decode_accepts {
                    Vec::new()
                } else {
                    other.ranks.iter().map(|r| r.geometry.clone()).collect()
                },
                own_base: own_base.clone(),
                own_tp: tp,
                decode: side == SideName::Decode,
                bases: bases.clone(),
            });
            let config = Config {
                block_pairing: BlockPairing::AsGiven,
                ..Config::default()
            };
            let (setup, mut regions) = build_routed_rank(
                transport,
                &id,
                rank.geometry.clone(),
                &model_id,
                &[4 * PART],
                config.clone(),
                ShellConfig::default(),
                route,
            )
            .unwrap();
            let buffer = regions.remove(0);
            *own_base.lock().unwrap() = buffer.base;
            if side == SideName::Prefill {
                buffer
                    .bytes
                    .write(0, &[tp as u8 + 1; PART as usize])
                    .unwrap();
            }
            bases
                .lock()
                .unwrap()
                .insert((side == SideName::Decode, tp), buffer.base);
            let handle = runtime.add_rank(setup, RankOptions::default()).unwrap();
            let mut conn = KvConnector::with_settings(
                ConnectorIdentity {
                    engine: id.clone(),
                    rank: tp,
                    tp_size: layout.spec.tp,
                    host: "127.0.0.1".into(),
                    port: 0,
                },
                handle,
                ConnectorSettings::new(&config, &rank.geometry),
            );
            conn.set_links(RankLinks::for_rank(pair, side, tp).unwrap())
                .unwrap();
            ranks.push(Rank { tp, conn, buffer });
        }
        sides.push(ranks);
    }
    let d = sides.pop().unwrap();
    let p = sides.pop().unwrap();
    (runtime, p, d, fabric)
}

fn pair(p: &str, d: &str) -> PairPlan {
    plan_pair(
        model("gqa8").unwrap(),
        p.parse().unwrap(),
        d.parse().unwrap(),
    )
    .unwrap()
}

fn blocks() -> BlockIds {
    BlockIds::single_group(vec![3, 1])
}

fn finish(rank: &mut Rank, request: &RequestId) -> Result<KvTransferParams, ConnectorError> {
    rank.conn.request_finished(
        request,
        blocks(),
        32,
        &KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        },
    )
}

fn allocate(rank: &mut Rank, request: &RequestId, p_tp: u32) -> Result<(), ConnectorError> {
    rank.conn.request_allocated(
        request,
        blocks(),
        32,
        &KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("prefill".into()),
            tp_size: Some(p_tp),
            ..KvTransferParams::default()
        },
    )
}

/// Every event `rank` reports until it has one, or 20 s.
fn one_event(rank: &mut Rank) -> ConnectorEvent {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut events = rank.conn.poll_events();
        if !events.is_empty() {
            assert_eq!(events.len(), 1, "{events:?}");
            return events.remove(0);
        }
        assert!(Instant::now() < deadline, "rank {} had no event", rank.tp);
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

/// D at TP 1 fed by P at TP 2: not ready after one P rank finished, ready once both wrote, with
/// both halves in its buffer; each P rank frees its blocks once.
#[test]
fn a_decode_rank_is_ready_only_when_every_source_wrote() {
    let (runtime, mut p, mut d) = build(&pair(
        "tp=2,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    ));
    let request = id("req-1");
    allocate(&mut d[0], &request, 2).unwrap();
    finish(&mut p[0], &request).unwrap();
    // P rank 0's write lands; D still waits for P rank 1.
    assert!(matches!(
        one_event(&mut p[0]),
        ConnectorEvent::BlocksFree { released: None, .. }
    ));
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        d[0].conn.poll_events().is_empty(),
        "ready before every source wrote"
    );
    assert!(d[0].conn.has_pending_work());
    finish(&mut p[1], &request).unwrap();
    match one_event(&mut d[0]) {
        ConnectorEvent::BlocksReady {
            request: r,
            blocks: b,
        } => {
            assert_eq!((r, b), (request.clone(), blocks()));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        one_event(&mut p[1]),
        ConnectorEvent::BlocksFree { released: None, .. }
    ));
    let mut got = vec![0u8; 2 * PART as usize];
    d[0].buffer.bytes.read(0, &mut got).unwrap();
    assert!(got[..PART as usize].iter().all(|&b| b == 1));
    assert!(got[PART as usize..].iter().all(|&b| b == 2));
    assert!(!d[0].conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

/// P at TP 1 feeding D at TP 2 aborts: each pair's sub-request ends, and P gets one
/// `BlocksFree` (released) only after both; each D rank fails its request.
#[test]
fn an_abort_ends_every_pair_and_frees_the_blocks_once() {
    let (runtime, mut p, mut d) = build(&pair(
        "tp=1,block=16,layout=NHD",
        "tp=2,block=16,layout=NHD",
    ));
    let request = id("req-2");
    // P finished, no D registered yet: both pairs are held under P's lease.
    finish(&mut p[0], &request).unwrap();
    p[0].conn.abort(&request).unwrap();
    match one_event(&mut p[0]) {
        ConnectorEvent::BlocksFree {
            released: Some(ReleaseCause::Aborted),
            blocks: b,
            ..
        } => assert_eq!(b, blocks()),
        other => panic!("{other:?}"),
    }
    // A D rank that registers now finds its pair gone and fails; its blocks come back.
    allocate(&mut d[1], &request, 1).unwrap();
    match one_event(&mut d[1]) {
        ConnectorEvent::Failed { request: r, .. } => assert_eq!(r, request),
        other => panic!("{other:?}"),
    }
    drop((p, d));
    runtime.shutdown();
}

/// A D rank fed by two P ranks aborts after registering with both: one `Failed` under the
/// engine's request id, never a sub-request's.
#[test]
fn a_decode_abort_reports_under_the_engine_request_id() {
    let (runtime, mut p, mut d) = build(&pair(
        "tp=2,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    ));
    let request = id("req-3");
    allocate(&mut d[0], &request, 2).unwrap();
    d[0].conn.abort(&request).unwrap();
    match one_event(&mut d[0]) {
        ConnectorEvent::Failed {
            request: r, reason, ..
        } => {
            assert_eq!(r, request);
            assert_eq!(reason, DecodeFailure::Aborted);
        }
        other => panic!("{other:?}"),
    }
    // P ranks that finish afterwards find the pairs cancelled and free their blocks.
    for rank in &mut p {
        finish(rank, &request).unwrap();
        assert!(matches!(one_event(rank), ConnectorEvent::BlocksFree { .. }));
    }
    drop((p, d));
    runtime.shutdown();
}

/// A verdict that comes too late: the call says so, and the request's one event still comes,
/// under the engine's id. Each attempt is a new request; retried (bounded) until one is late.
#[test]
fn a_late_verdict_still_ends_in_the_requests_one_event() {
    let (runtime, mut p, mut d) = build(&pair(
        "tp=2,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    ));
    d[0].conn.set_call_timeout(Duration::ZERO);
    let mut late = None;
    for attempt in 0..200 {
        let request = id(&format!("late-{attempt}"));
        match allocate(&mut d[0], &request, 2) {
            Err(ConnectorError::VerdictLate) => {
                late = Some(request);
                break;
            }
            Ok(()) => {
                // In time: abort it and wait for its end before the next attempt.
                d[0].conn.set_call_timeout(Duration::from_secs(10));
                d[0].conn.abort(&request).unwrap();
                assert!(matches!(
                    one_event(&mut d[0]),
                    ConnectorEvent::Failed { .. }
                ));
                d[0].conn.set_call_timeout(Duration::ZERO);
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    let request = late.expect("a late verdict within 200 attempts");
    d[0].conn.set_call_timeout(Duration::from_secs(10));
    for rank in &mut p {
        finish(rank, &request).unwrap();
    }
    match one_event(&mut d[0]) {
        ConnectorEvent::BlocksReady { request: r, .. } => assert_eq!(r, request),
        other => panic!("{other:?}"),
    }
    assert!(!d[0].conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

/// The links must be the plan's: a D rank linked to TP 2 refuses a router saying TP 4, and a
/// pull whose holder's list has another number of cache groups is refused.
#[test]
fn calls_that_do_not_fit_the_links_are_refused() {
    let (runtime, _p, mut d) = build(&pair(
        "tp=2,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    ));
    let request = id("req-5");
    assert!(matches!(
        allocate(&mut d[0], &request, 4),
        Err(ConnectorError::InvalidParam {
            name: "tp_size",
            ..
        })
    ));
    // A pull whose holder's list names another number of cache groups than D's blocks.
    let pull = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some("prefill".into()),
        tp_size: Some(2),
        transfer_mode: Some("pull".into()),
        remote_block_ids: Some(vec![vec![1, 2], vec![3]]),
        ..KvTransferParams::default()
    };
    assert!(matches!(
        d[0].conn.request_allocated(&request, blocks(), 32, &pull),
        Err(ConnectorError::InvalidParam {
            name: "remote_block_ids",
            ..
        })
    ));
    assert!(!d[0].conn.has_pending_work());
    drop(d);
    runtime.shutdown();
}

/// D at TP 1 declines the export of P at TP 2 (it will recompute): each P rank's part is let go
/// at once, `Released(Declined)` (not at its lease's end), its blocks back; D owes no event. A
/// decline of an export D is reading at that moment is refused whole, and the read completes.
#[test]
fn a_reader_declines_a_multi_rank_export_at_every_holder() {
    let (runtime, mut p, mut d, fabric) = build_on(
        &pair("tp=2,block=16,layout=NHD", "tp=1,block=16,layout=NHD"),
        true,
    );
    let pull = KvTransferParams {
        do_remote_decode: true,
        transfer_mode: Some("pull".into()),
        ..KvTransferParams::default()
    };
    let request = id("req-decline");
    let mut answer = None;
    for rank in &mut p {
        answer = Some(
            rank.conn
                .request_finished(&request, blocks(), 32, &pull)
                .unwrap(),
        );
    }
    let mut params = answer.unwrap();
    params.do_remote_prefill = true;
    params.do_remote_decode = false;
    d[0].conn.decline_export(&request, &params).unwrap();
    assert!(!d[0].conn.has_pending_work());
    for rank in &mut p {
        match one_event(rank) {
            ConnectorEvent::ExportEnded {
                request: ended,
                outcome,
                blocks: back,
                ..
            } => {
                assert_eq!(ended, request, "P rank {}", rank.tp);
                assert_eq!(
                    outcome,
                    kvhandoff_protocol::machine::ExportOutcome::Released(
                        kvhandoff_protocol::machine::ExportEnd::Declined
                    ),
                    "P rank {}",
                    rank.tp
                );
                assert_eq!(back, blocks(), "P rank {}", rank.tp);
            }
            other => panic!("P rank {}: {other:?}", rank.tp),
        }
    }
    assert!(d[0].conn.poll_events().is_empty());

    // A second export, which D reads (its reads stalled in flight) while a sibling request
    // with the same parameters declines it: refused whole, and the read loads.
    let reading = id("req-read");
    let mut answer = None;
    for rank in &mut p {
        answer = Some(
            rank.conn
                .request_finished(&reading, blocks(), 32, &pull)
                .unwrap(),
        );
    }
    let mut params = answer.unwrap();
    params.do_remote_prefill = true;
    params.do_remote_decode = false;
    let d_agent = agent_name(&EngineId::new("decode").unwrap(), 0).unwrap();
    let stalled = MemFaults {
        stall: true,
        ..MemFaults::default()
    };
    fabric.set_faults(&d_agent, stalled).unwrap();
    d[0].conn
        .request_allocated(&reading, blocks(), 32, &params)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while d[0]
        .conn
        .rank()
        .counters(Duration::from_secs(1))
        .is_none_or(|c| c.reads_posted < 2)
    {
        assert!(Instant::now() < deadline, "D never posted both reads");
        std::thread::sleep(Duration::from_millis(2));
    }
    let declined = d[0].conn.decline_export(&reading, &params);
    assert!(
        matches!(
            declined,
            Err(ConnectorError::Rejected(Rejected::ImportInProgress(_)))
        ),
        "{declined:?}"
    );
    fabric.set_faults(&d_agent, MemFaults::default()).unwrap();
    match one_event(&mut d[0]) {
        ConnectorEvent::Imported { outcome, .. } => {
            assert_eq!(outcome, kvhandoff_protocol::machine::ImportOutcome::Loaded)
        }
        other => panic!("D: {other:?}"),
    }
    // Both P ranks' parts landed, untouched by the refused decline.
    let mut got = vec![0u8; 2 * PART as usize];
    d[0].buffer.bytes.read(0, &mut got).unwrap();
    assert!(got[..PART as usize].iter().all(|&b| b == 1));
    assert!(got[PART as usize..].iter().all(|&b| b == 2));
    for rank in &mut p {
        assert!(
            matches!(
                one_event(rank),
                ConnectorEvent::ExportEnded {
                    outcome: kvhandoff_protocol::machine::ExportOutcome::Read,
                    ..
                }
            ),
            "P rank {}",
            rank.tp
        );
    }
    drop((p, d));
    runtime.shutdown();
}

/// The fan-in table is bounded: past the bound a new multi-rank request is refused with
/// `TableFull` and nothing of it reaches the rank; once the live one ends, a new one is taken.
#[test]
fn multi_rank_requests_in_progress_are_bounded() {
    let (runtime, mut p, mut d) = build(&pair(
        "tp=2,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    ));
    d[0].conn.set_fan_limit(1);
    let (first, second) = (id("bound-1"), id("bound-2"));
    allocate(&mut d[0], &first, 2).unwrap();
    match allocate(&mut d[0], &second, 2) {
        Err(ConnectorError::Rejected(kvhandoff_protocol::machine::Rejected::TableFull {
            limit: 1,
            ..
        })) => {}
        other => panic!("{other:?}"),
    }
    // The refused request exposed nothing: P ranks that finish it find no registration of it,
    // and D's rank has one request's two sub-requests only.
    let stats = d[0].conn.rank().stats(Duration::from_secs(5)).unwrap();
    assert_eq!(stats.decode_requests, 2, "{stats:?}");
    for rank in &mut p {
        finish(rank, &first).unwrap();
    }
    assert!(matches!(
        one_event(&mut d[0]),
        ConnectorEvent::BlocksReady { .. }
    ));
    allocate(&mut d[0], &second, 2).unwrap();
    d[0].conn.abort(&second).unwrap();
    assert!(matches!(
        one_event(&mut d[0]),
        ConnectorEvent::Failed { .. }
    ));
    drop((p, d));
    runtime.shutdown();
}

/// Without a route that accepts the peer's geometry, ranks of different layouts do not pair:
/// D's sub-requests fail at the handshake before anything is exposed, and D gets one `Failed`.
#[test]
fn a_route_that_refuses_the_peer_geometry_fails_the_request() {
    let (runtime, _p, mut d) = build_with(
        &pair("tp=2,block=16,layout=NHD", "tp=1,block=32,layout=HND"),
        false,
    );
    let request = id("refused");
    allocate(&mut d[0], &request, 2).unwrap();
    match one_event(&mut d[0]) {
        ConnectorEvent::Failed {
            request: r,
            reason,
            proof,
            ..
        } => {
            assert_eq!(r, request);
            // The machine reports every refused connection as a failed handshake.
            assert_eq!(reason, DecodeFailure::HandshakeFailed);
            assert_eq!(proof, kvhandoff_protocol::machine::FreeProof::NeverExposed);
        }
        other => panic!("{other:?}"),
    }
    drop(d);
    runtime.shutdown();
}
