//! Pull mode and bidirectional turns through the connector, two ranks over the in-memory
//! transport: P exports and D reads (every byte checked), a full prefix hit, a decline, a turn
//! whose blocks D keeps and P reads back, and the typed refusals of ill-formed parameters.

use std::time::{Duration, Instant};

use kvhandoff::{
    ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorSettings, KvConnector,
    KvTransferParams, Runtime, TransferMode,
};
use kvhandoff_actors::system::agent_name;
use kvhandoff_actors::system::{build_mem_rank, KvPool, RankOptions, ShellConfig};
use kvhandoff_actors::transport::mem::{MemFabric, MemFaults};
use kvhandoff_protocol::machine::{
    Config, ExportEnd, ExportOutcome, ImportOutcome, LoadFailurePolicy, ReadProof, Rejected,
};
use kvhandoff_protocol::{BlockIds, EngineId, KvGeometry, KvLayout, ModelIdentity, RequestId};

const PREFILL: &str = "prefill-0";
const DECODE: &str = "decode-0";
const POOL_BLOCKS: u32 = 32;

fn geometry() -> KvGeometry {
    // 2 layers × K/V, 2 heads of 8 bf16: 512 bytes per block and region.
    KvGeometry::dense(2, 2, 8, 2, 16, KvLayout::Hnd)
}

fn model() -> ModelIdentity {
    ModelIdentity {
        model: "pull-test".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    }
}

/// One engine: its connector and its KV cache.
struct Engine {
    conn: KvConnector,
    pool: KvPool,
}

/// Both engines as in-process ranks of one runtime on one fabric; `settings` for both
/// connectors (`None`: what the rank's config and geometry give).
fn pair(settings: Option<ConnectorSettings>) -> (Runtime, Engine, Engine) {
    let (runtime, p, d, _) = pair_on_fabric(settings);
    (runtime, p, d)
}

/// [`pair`], with the fabric (to set a rank's transport faults).
fn pair_on_fabric(settings: Option<ConnectorSettings>) -> (Runtime, Engine, Engine, MemFabric) {
    let mut runtime = Runtime::start().unwrap();
    let fabric = MemFabric::new();
    let config = Config::default();
    let settings = settings.unwrap_or_else(|| ConnectorSettings::new(&config, &geometry()));
    let mut engine = |name: &str| {
        let id = EngineId::new(name).unwrap();
        let (setup, pool) = build_mem_rank(
            &fabric,
            &id,
            geometry(),
            &model(),
            POOL_BLOCKS,
            config.clone(),
            ShellConfig::default(),
        )
        .unwrap();
        let handle = runtime.add_rank(setup, RankOptions::default()).unwrap();
        let identity = ConnectorIdentity {
            engine: id,
            rank: 0,
            tp_size: 1,
            host: "127.0.0.1".into(),
            port: 0,
        };
        Engine {
            conn: KvConnector::with_settings(identity, handle, settings),
            pool,
        }
    };
    let p = engine(PREFILL);
    let d = engine(DECODE);
    (runtime, p, d, fabric)
}

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

/// The byte at `offset` of the `position`-th block of a request tagged `tag`, in region
/// `region`.
fn pattern(tag: u64, region: usize, position: usize, offset: usize) -> u8 {
    let mut z = tag ^ ((region as u64) << 48) ^ ((position as u64) << 32) ^ offset as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u8
}

/// Writes the pattern of `tag` into `blocks` (the request's blocks in order) in every region.
fn fill(pool: &KvPool, blocks: &[u32], tag: u64) {
    for (region, (spec, bytes)) in pool.regions().enumerate() {
        for (position, &block) in blocks.iter().enumerate() {
            let (offset, len) = pool.block_span(spec, block);
            let data: Vec<u8> = (0..len as usize)
                .map(|i| pattern(tag, region, position, i))
                .collect();
            bytes.write(offset, &data).unwrap();
        }
    }
}

/// The bytes of `blocks` that differ from the pattern of `tag` at `positions` (the positions
/// of the blocks they should hold, in the request of `tag`).
fn wrong_bytes(pool: &KvPool, blocks: &[u32], positions: &[usize], tag: u64) -> usize {
    let mut wrong = 0;
    for (region, (spec, bytes)) in pool.regions().enumerate() {
        for (&block, &position) in blocks.iter().zip(positions) {
            let (offset, len) = pool.block_span(spec, block);
            let mut data = vec![0u8; len as usize];
            bytes.read(offset, &mut data).unwrap();
            wrong += data
                .iter()
                .enumerate()
                .filter(|&(i, &b)| b != pattern(tag, region, position, i))
                .count();
        }
    }
    wrong
}

fn wait_for_event(conn: &mut KvConnector) -> ConnectorEvent {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(event) = conn.poll_events().into_iter().next() {
            return event;
        }
        assert!(Instant::now() < deadline, "no event before the deadline");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// What the router sends P with a pull request's prefill leg.
fn pull_router() -> KvTransferParams {
    KvTransferParams {
        do_remote_decode: true,
        transfer_mode: Some("pull".into()),
        ..KvTransferParams::default()
    }
}

fn expect_imported(conn: &mut KvConnector, request: &RequestId) -> (ImportOutcome, BlockIds) {
    match wait_for_event(conn) {
        ConnectorEvent::Imported {
            request: r,
            outcome,
            blocks,
        } if &r == request => (outcome, blocks),
        other => panic!("expected {request} Imported: {other:?}"),
    }
}

fn expect_export_ended(
    conn: &mut KvConnector,
    request: &RequestId,
) -> (ExportOutcome, ReadProof, BlockIds) {
    match wait_for_event(conn) {
        ConnectorEvent::ExportEnded {
            request: r,
            outcome,
            proof,
            blocks,
        } if &r == request => (outcome, proof, blocks),
        other => panic!("expected {request} ExportEnded: {other:?}"),
    }
}

#[test]
fn pull_hands_every_byte_from_p_to_d() {
    let (runtime, mut p, mut d) = pair(None);
    let lease = p.conn.settings().lease_duration;

    // P prefills and exports.
    let p_request = id("cmpl-pull-0-aaaaaaaa");
    let p_blocks = vec![3, 5, 7];
    fill(&p.pool, &p_blocks, 0xfeed);
    let before = KvConnector::clock_secs();
    let params = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(p_blocks.clone()),
            40,
            &pull_router(),
        )
        .unwrap();
    let after = KvConnector::clock_secs();
    assert_eq!(params.transfer_mode().unwrap(), TransferMode::Pull);
    assert_eq!(params.transfer_mode.as_deref(), Some("pull"));
    assert!(params.do_remote_prefill);
    assert_eq!(params.remote_engine_id.as_deref(), Some(PREFILL));
    assert_eq!(params.remote_block_ids, Some(vec![p_blocks.clone()]));
    assert_eq!(params.remote_num_tokens, Some(40));
    let expiry = params.remote_blocks_expiry_time.expect("an expiry");
    // The hard end: twice the lease and a read's span after the export.
    let hard_end = 2.0 * lease.as_secs_f64() + p.conn.settings().read_span.as_secs_f64();
    assert!(
        before + hard_end <= expiry && expiry <= after + hard_end,
        "{before} {expiry} {after}"
    );
    // What the router carries, as vLLM spells it.
    let json = serde_json::to_value(&params).unwrap();
    assert_eq!(json["transfer_mode"], "pull");
    assert_eq!(json["remote_block_ids"], serde_json::json!([[3, 5, 7]]));
    assert_eq!(json["remote_num_tokens"], 40);
    assert!(json["remote_blocks_expiry_time"].is_f64());

    // D reads into blocks of its own.
    let d_request = id("cmpl-pull-0-bbbbbbbb");
    let d_blocks = vec![9, 2, 4];
    d.conn
        .request_allocated(
            &d_request,
            BlockIds::single_group(d_blocks.clone()),
            40,
            &params,
        )
        .unwrap();
    let (outcome, blocks) = expect_imported(&mut d.conn, &d_request);
    assert_eq!(outcome, ImportOutcome::Loaded);
    assert_eq!(blocks, BlockIds::single_group(d_blocks.clone()));
    assert_eq!(wrong_bytes(&d.pool, &d_blocks, &[0, 1, 2], 0xfeed), 0);
    let (outcome, proof, blocks) = expect_export_ended(&mut p.conn, &p_request);
    assert_eq!(outcome, ExportOutcome::Read);
    assert_eq!(proof, ReadProof::ReaderReleased);
    assert_eq!(blocks, BlockIds::single_group(p_blocks));

    // A partial prefix hit: D holds the first block already and reads the tail.
    let p_request = id("cmpl-pull-1-aaaaaaaa");
    let p_blocks = vec![10, 11, 12];
    fill(&p.pool, &p_blocks, 0xbeef);
    let params = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(p_blocks),
            48,
            &pull_router(),
        )
        .unwrap();
    let d_request = id("cmpl-pull-1-bbbbbbbb");
    let d_blocks = vec![13, 14];
    d.conn
        .request_allocated(
            &d_request,
            BlockIds::single_group(d_blocks.clone()),
            32,
            &params,
        )
        .unwrap();
    let (outcome, _) = expect_imported(&mut d.conn, &d_request);
    assert_eq!(outcome, ImportOutcome::Loaded);
    assert_eq!(wrong_bytes(&d.pool, &d_blocks, &[1, 2], 0xbeef), 0);
    let (outcome, _, _) = expect_export_ended(&mut p.conn, &p_request);
    assert_eq!(outcome, ExportOutcome::Read);

    assert!(!p.conn.has_pending_work() && !d.conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

/// D's engine may start reading before P's rank has the export: vLLM's P scheduler hands the
/// router its answer at once, and its worker hands the blocks to the rank at its next step.
/// D's first ask then finds nothing under the key; the reader asks again soon instead of
/// failing, and reads the export once P filed it. (A real vLLM in pull mode on a loaded host
/// lost requests this way, `Refused(Unavailable)`: `docs/testing.md`.)
#[test]
fn a_read_asked_before_the_export_is_filed_is_served() {
    let (runtime, mut p, mut d) = pair(None);
    let router = |transfer: &str| KvTransferParams {
        transfer_id: Some(transfer.into()),
        ..pull_router()
    };
    // A first request read as usual: both ranks know each other, so the early ask below goes
    // out at once.
    let (p_first, d_first) = (id("cmpl-early-0-aaaaaaaa"), id("cmpl-early-0-bbbbbbbb"));
    fill(&p.pool, &[3, 5], 0xa1);
    let first = p
        .conn
        .request_finished(
            &p_first,
            BlockIds::single_group(vec![3, 5]),
            32,
            &router("t-0"),
        )
        .unwrap();
    d.conn
        .request_allocated(&d_first, BlockIds::single_group(vec![6, 8]), 32, &first)
        .unwrap();
    assert_eq!(
        expect_imported(&mut d.conn, &d_first).0,
        ImportOutcome::Loaded
    );
    assert_eq!(
        expect_export_ended(&mut p.conn, &p_first).0,
        ExportOutcome::Read
    );

    // The second request's answer as P's scheduler would give it, before P's rank has it.
    let p_blocks = vec![7, 9];
    let early = KvTransferParams {
        transfer_id: Some("t-1".into()),
        remote_block_ids: Some(vec![p_blocks.clone()]),
        ..first
    };
    let (p_request, d_request) = (id("cmpl-early-1-aaaaaaaa"), id("cmpl-early-1-bbbbbbbb"));
    let d_blocks = vec![2, 4];
    d.conn
        .request_allocated(
            &d_request,
            BlockIds::single_group(d_blocks.clone()),
            32,
            &early,
        )
        .unwrap();
    // The precondition: P refused the first ask, as it has nothing under the key yet.
    let asked_again = || {
        d.conn
            .rank()
            .counters(Duration::from_secs(5))
            .map_or(0, |c| c.reads_asked_again)
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while asked_again() == 0 {
        assert!(
            Instant::now() < deadline,
            "D never asked again after P refused its early ask"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    fill(&p.pool, &p_blocks, 0xb2);
    let answer = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(p_blocks.clone()),
            32,
            &router("t-1"),
        )
        .unwrap();
    assert_eq!(answer.transfer_id, early.transfer_id);
    assert_eq!(answer.remote_block_ids, early.remote_block_ids);
    let (outcome, blocks) = expect_imported(&mut d.conn, &d_request);
    assert_eq!(outcome, ImportOutcome::Loaded);
    assert_eq!(blocks, BlockIds::single_group(d_blocks.clone()));
    assert_eq!(wrong_bytes(&d.pool, &d_blocks, &[0, 1], 0xb2), 0);
    assert_eq!(
        expect_export_ended(&mut p.conn, &p_request).0,
        ExportOutcome::Read
    );
    assert!(!p.conn.has_pending_work() && !d.conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

#[test]
fn a_full_prefix_hit_reads_nothing_and_lets_p_go() {
    let (runtime, mut p, mut d) = pair(None);
    let p_request = id("cmpl-hit-0-aaaaaaaa");
    let params = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(vec![1, 2]),
            32,
            &pull_router(),
        )
        .unwrap();
    let d_request = id("cmpl-hit-0-bbbbbbbb");
    d.conn
        .request_allocated(&d_request, BlockIds::single_group(vec![]), 32, &params)
        .unwrap();
    let (outcome, blocks) = expect_imported(&mut d.conn, &d_request);
    assert_eq!(outcome, ImportOutcome::Loaded);
    assert!(blocks.is_empty());
    let (outcome, proof, blocks) = expect_export_ended(&mut p.conn, &p_request);
    assert_eq!(outcome, ExportOutcome::Released(ExportEnd::FullPrefixHit));
    assert_eq!(proof, ReadProof::NeverGranted);
    assert_eq!(blocks, BlockIds::single_group(vec![1, 2]));
    assert!(!p.conn.has_pending_work() && !d.conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

#[test]
fn a_declined_export_is_let_go_at_once() {
    let (runtime, mut p, mut d) = pair(None);
    let p_request = id("cmpl-decline-0-aaaaaaaa");
    let params = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(vec![4, 6]),
            20,
            &pull_router(),
        )
        .unwrap();
    let d_request = id("cmpl-decline-0-bbbbbbbb");
    d.conn.decline_export(&d_request, &params).unwrap();
    // Nothing was started on D: no event is owed.
    assert!(!d.conn.has_pending_work());
    let (outcome, proof, blocks) = expect_export_ended(&mut p.conn, &p_request);
    assert_eq!(outcome, ExportOutcome::Released(ExportEnd::Declined));
    assert_eq!(proof, ReadProof::NeverGranted);
    assert_eq!(blocks, BlockIds::single_group(vec![4, 6]));
    assert!(d.conn.poll_events().is_empty());
    drop((p, d));
    runtime.shutdown();
}

/// A sibling request with the same `kv_transfer_params` (one the engine will recompute, or the
/// engine reacting to an error) declines the export D is reading at that moment. The decline
/// must not let P go: P would reuse the blocks while D's reads still land from them, and D would
/// report another request's bytes as `Loaded`.
#[test]
fn a_decline_while_reading_is_refused_and_the_read_lands_the_right_bytes() {
    let (runtime, mut p, mut d, fabric) = pair_on_fabric(None);
    let p_request = id("cmpl-sibling-0-aaaaaaaa");
    let p_blocks = vec![5, 6, 7];
    fill(&p.pool, &p_blocks, 0x51b1);
    let params = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(p_blocks.clone()),
            40,
            &pull_router(),
        )
        .unwrap();
    // D's reads are posted but land only when D's transport is let go.
    let d_agent = agent_name(&EngineId::new(DECODE).unwrap(), 0).unwrap();
    let stalled = MemFaults {
        stall: true,
        ..MemFaults::default()
    };
    fabric.set_faults(&d_agent, stalled).unwrap();
    let d_request = id("cmpl-sibling-0-bbbbbbbb");
    let d_blocks = vec![11, 12, 13];
    d.conn
        .request_allocated(
            &d_request,
            BlockIds::single_group(d_blocks.clone()),
            40,
            &params,
        )
        .unwrap();
    // The precondition: D's reads are in flight.
    let deadline = Instant::now() + Duration::from_secs(10);
    while d
        .conn
        .rank()
        .counters(Duration::from_secs(1))
        .is_none_or(|c| c.reads_posted == 0)
    {
        assert!(Instant::now() < deadline, "D never posted its reads");
        std::thread::sleep(Duration::from_millis(2));
    }

    // The sibling declines with the very same parameters.
    let sibling = id("cmpl-sibling-0-cccccccc");
    let declined = d.conn.decline_export(&sibling, &params);
    // P's engine reuses its blocks for another request the moment the export ends.
    let mut ended_early = None;
    let watch = Instant::now() + Duration::from_millis(300);
    while Instant::now() < watch && ended_early.is_none() {
        if let Some(event) = p.conn.poll_events().into_iter().next() {
            if let ConnectorEvent::ExportEnded { blocks, .. } = &event {
                fill(&p.pool, &blocks.groups[0], 0x0be5);
            }
            ended_early = Some(event);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    fabric.set_faults(&d_agent, MemFaults::default()).unwrap();
    let (outcome, _) = expect_imported(&mut d.conn, &d_request);
    assert_eq!(outcome, ImportOutcome::Loaded);
    assert_eq!(
        wrong_bytes(&d.pool, &d_blocks, &[0, 1, 2], 0x51b1),
        0,
        "D loaded bytes P reused (P's export ended early: {ended_early:?})"
    );
    assert_eq!(ended_early, None, "P's export ended while D was reading it");
    assert!(
        matches!(
            declined,
            Err(ConnectorError::Rejected(Rejected::ImportInProgress(_)))
        ),
        "{declined:?}"
    );
    let (outcome, proof, _) = expect_export_ended(&mut p.conn, &p_request);
    assert_eq!(outcome, ExportOutcome::Read);
    assert_eq!(proof, ReadProof::ReaderReleased);
    assert!(!p.conn.has_pending_work() && !d.conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

#[test]
fn d_keeps_a_turn_and_p_reads_it_back() {
    let (runtime, mut p, mut d) = pair(None);

    // Turn 1, pushed (no transfer_mode): P writes its prefill into D's blocks.
    let p_request = id("cmpl-chat-0-aaaaaaaa");
    let p_blocks = vec![1, 2, 3];
    fill(&p.pool, &p_blocks, 0x7e57);
    let params = p
        .conn
        .request_finished(
            &p_request,
            BlockIds::single_group(p_blocks),
            40,
            &KvTransferParams {
                do_remote_decode: true,
                ..KvTransferParams::default()
            },
        )
        .unwrap();
    assert_eq!(params.transfer_mode.as_deref(), Some("push"));
    let d_request = id("cmpl-chat-0-bbbbbbbb");
    let d_blocks = vec![20, 21, 22];
    d.conn
        .request_allocated(
            &d_request,
            BlockIds::single_group(d_blocks.clone()),
            40,
            &params,
        )
        .unwrap();
    match wait_for_event(&mut d.conn) {
        ConnectorEvent::BlocksReady { request, .. } => assert_eq!(request, d_request),
        other => panic!("D: {other:?}"),
    }
    assert_eq!(wrong_bytes(&d.pool, &d_blocks, &[0, 1, 2], 0x7e57), 0);
    match wait_for_event(&mut p.conn) {
        ConnectorEvent::BlocksFree { released, .. } => assert_eq!(released, None),
        other => panic!("P: {other:?}"),
    }

    // D decodes (its blocks now hold the whole conversation) and keeps them for turn 2.
    fill(&d.pool, &d_blocks, 0x2d2d);
    let ttl = Duration::from_secs(480);
    let turn2 = d
        .conn
        .keep_for_next_turn(
            &d_request,
            BlockIds::single_group(d_blocks.clone()),
            48,
            ttl,
            &params,
        )
        .unwrap();
    assert_eq!(turn2.transfer_mode.as_deref(), Some("pull"));
    assert!(turn2.do_remote_decode && !turn2.do_remote_prefill);
    assert_eq!(turn2.remote_engine_id.as_deref(), Some(DECODE));
    assert_eq!(turn2.remote_request_id.as_deref(), Some(d_request.as_str()));
    assert_eq!(turn2.transfer_id.as_deref(), Some("cmpl-chat-0"));
    assert_eq!(turn2.remote_block_ids, Some(vec![d_blocks.clone()]));
    assert_eq!(turn2.remote_num_tokens, Some(48));
    assert!(turn2.remote_blocks_expiry_time.unwrap() >= 2.0 * ttl.as_secs_f64());

    // Turn 2 is another request on P; it reads D's blocks into fresh ones.
    let p_turn2 = id("cmpl-chat-turn2-0-cccccccc");
    let p_fresh = vec![30, 31, 29];
    p.conn
        .next_turn_allocated(
            &p_turn2,
            BlockIds::single_group(p_fresh.clone()),
            48,
            &turn2,
        )
        .unwrap();
    let (outcome, blocks) = expect_imported(&mut p.conn, &p_turn2);
    assert_eq!(outcome, ImportOutcome::Loaded);
    assert_eq!(blocks, BlockIds::single_group(p_fresh.clone()));
    assert_eq!(wrong_bytes(&p.pool, &p_fresh, &[0, 1, 2], 0x2d2d), 0);
    let (outcome, proof, blocks) = expect_export_ended(&mut d.conn, &d_request);
    assert_eq!(outcome, ExportOutcome::Read);
    assert_eq!(proof, ReadProof::ReaderReleased);
    assert_eq!(blocks, BlockIds::single_group(d_blocks));
    assert!(!p.conn.has_pending_work() && !d.conn.has_pending_work());
    drop((p, d));
    runtime.shutdown();
}

/// Durations the engine passes near `Duration::MAX` once overflowed the expiry arithmetic (a
/// panic on the engine's thread, or in the rank actor halfway through a batch): now typed
/// refusals that change nothing.
#[test]
fn a_huge_next_turn_ttl_is_a_typed_refusal() {
    let (runtime, mut p, mut d) = pair(None);
    let request = id("cmpl-huge-0-bbbbbbbb");
    let params = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some(PREFILL.into()),
        ..KvTransferParams::default()
    };
    for ttl in [
        Duration::MAX,
        Duration::MAX / 2,
        Duration::from_secs(u64::MAX / 4),
    ] {
        let kept = d.conn.keep_for_next_turn(
            &request,
            BlockIds::single_group(vec![1, 2]),
            32,
            ttl,
            &params,
        );
        assert!(
            matches!(
                kept,
                Err(ConnectorError::Rejected(Rejected::TooLong { .. }))
            ),
            "{ttl:?}: {kept:?}"
        );
    }
    assert!(!d.conn.has_pending_work());
    // The rank is still serving: a lease within the limit is taken.
    let kept = d.conn.keep_for_next_turn(
        &request,
        BlockIds::single_group(vec![1, 2]),
        32,
        Duration::from_secs(60),
        &params,
    );
    assert!(kept.is_ok(), "{kept:?}");
    d.conn.abort(&request).unwrap();
    let (outcome, _, _) = expect_export_ended(&mut d.conn, &request);
    assert_eq!(outcome, ExportOutcome::Released(ExportEnd::Aborted));
    drop((p.conn.shutdown(), p, d));
    runtime.shutdown();
}

#[test]
fn ill_formed_read_parameters_are_typed_refusals() {
    let unconfigured = ConnectorSettings {
        block_tokens: None,
        ..ConnectorSettings::new(&Config::default(), &geometry())
    };
    let (runtime, mut p, mut d) = pair(Some(unconfigured));
    let blocks = || BlockIds::single_group(vec![1, 2]);

    let sideways = KvTransferParams {
        transfer_mode: Some("sideways".into()),
        ..KvTransferParams::default()
    };
    assert!(matches!(
        p.conn
            .request_finished(&id("cmpl-e-0-aaaaaaaa"), blocks(), 32, &sideways),
        Err(ConnectorError::InvalidParam {
            name: "transfer_mode",
            ..
        })
    ));

    let pulled = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some(PREFILL.into()),
        tp_size: Some(1),
        transfer_mode: Some("pull".into()),
        remote_block_ids: Some(vec![vec![5, 6]]),
        ..KvTransferParams::default()
    };
    let d_request = id("cmpl-e-0-bbbbbbbb");
    let allocate = |d: &mut Engine, params: &KvTransferParams| {
        d.conn.request_allocated(&d_request, blocks(), 32, params)
    };
    assert_eq!(
        allocate(
            &mut d,
            &KvTransferParams {
                remote_block_ids: None,
                ..pulled.clone()
            }
        ),
        Err(ConnectorError::MissingParam("remote_block_ids"))
    );
    assert!(matches!(
        allocate(
            &mut d,
            &KvTransferParams {
                remote_block_ids: Some(vec![vec![5]]),
                ..pulled.clone()
            }
        ),
        Err(ConnectorError::InvalidParam {
            name: "remote_block_ids",
            ..
        })
    ));
    assert_eq!(
        allocate(
            &mut d,
            &KvTransferParams {
                remote_engine_id: None,
                ..pulled.clone()
            }
        ),
        Err(ConnectorError::MissingParam("remote_engine_id"))
    );
    assert!(matches!(
        allocate(
            &mut d,
            &KvTransferParams {
                do_remote_prefill: false,
                ..pulled.clone()
            }
        ),
        Err(ConnectorError::InvalidParam {
            name: "do_remote_prefill",
            ..
        })
    ));
    // Well-formed, but this connector was not told its block size.
    assert_eq!(
        allocate(&mut d, &pulled),
        Err(ConnectorError::NotConfigured("block_tokens"))
    );
    assert!(matches!(
        p.conn.next_turn_allocated(
            &id("cmpl-e-1-aaaaaaaa"),
            blocks(),
            32,
            &KvTransferParams {
                transfer_mode: Some("push".into()),
                ..pulled.clone()
            }
        ),
        Err(ConnectorError::InvalidParam {
            name: "transfer_mode",
            ..
        })
    ));
    assert!(matches!(
        d.conn.keep_for_next_turn(
            &d_request,
            blocks(),
            32,
            Duration::ZERO,
            &KvTransferParams::default()
        ),
        Err(ConnectorError::Rejected(Rejected::Invalid(_)))
    ));
    assert_eq!(
        d.conn.settings().load_failure_policy,
        LoadFailurePolicy::Fail
    );
    // Nothing was started by any of them.
    assert!(!p.conn.has_pending_work() && !d.conn.has_pending_work());
    assert!(p.conn.poll_events().is_empty() && d.conn.poll_events().is_empty());
    drop((p, d));
    runtime.shutdown();
}
