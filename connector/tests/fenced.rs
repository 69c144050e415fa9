//! A D request fenced by its P's death reaches the engine twice: `DecodeFenced` at the death
//! (the blocks still held, work still pending) and `Failed` with the same reason when the
//! blocks come back. A multi-rank request forwards one `DecodeFenced` for the whole request.
//!
//! The rank is a real in-memory D rank (it takes the calls), but the connector's event channel
//! is the test's: it plays the endpoint's events of a death, which a single process cannot
//! stage without a second engine dying.

use kvhandoff::actors::system::{build_mem_rank, KvPool, RankOptions, ShellConfig};
use kvhandoff::actors::transport::mem::MemFabric;
use kvhandoff::protocol::hetero::SideName;
use kvhandoff::protocol::machine::{Config, DecodeFailure, DecodeOutcome, EngineEvent, FreeProof};
use kvhandoff::protocol::{
    BlockIds, EngineId, Epoch, KvGeometry, KvLayout, ModelIdentity, PairingKey, RequestId,
};
use kvhandoff::{
    ConnectorEvent, ConnectorIdentity, KvConnector, KvTransferParams, RankLinks, Runtime,
};
use tokio::sync::mpsc::UnboundedSender;

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn blocks() -> BlockIds {
    BlockIds::single_group(vec![2, 3])
}

/// A connector on a real D rank whose events the test sends.
fn connector(links: Option<RankLinks>) -> (Runtime, KvConnector, UnboundedSender<EngineEvent>) {
    let fabric = MemFabric::new();
    let engine = EngineId::new("decode").unwrap();
    let model = ModelIdentity {
        model: "fenced".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    };
    let (setup, _pool): (_, KvPool) = build_mem_rank(
        &fabric,
        &engine,
        KvGeometry::dense(2, 2, 8, 2, 16, KvLayout::Hnd),
        &model,
        16,
        Config::default(),
        ShellConfig::default(),
    )
    .unwrap();
    let mut runtime = Runtime::start().unwrap();
    let mut handle = runtime.add_rank(setup, RankOptions::default()).unwrap();
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    handle.events = events_rx;
    let identity = ConnectorIdentity {
        engine,
        rank: 0,
        tp_size: 1,
        host: "127.0.0.1".into(),
        port: 0,
    };
    let mut conn = KvConnector::new(identity, handle);
    if let Some(links) = links {
        conn.set_links(links).unwrap();
    }
    (runtime, conn, events_tx)
}

fn allocate(conn: &mut KvConnector, request: &RequestId, tp: u32) {
    let params = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some("prefill".into()),
        tp_size: Some(tp),
        ..KvTransferParams::default()
    };
    conn.request_allocated(request, blocks(), 32, &params)
        .unwrap();
}

fn fenced(request: &RequestId, key: PairingKey, failure: DecodeFailure) -> EngineEvent {
    EngineEvent::DecodeFenced {
        request: request.clone(),
        key,
        epoch: Epoch::FIRST,
        failure,
    }
}

fn freed(request: &RequestId, key: PairingKey, failure: DecodeFailure) -> EngineEvent {
    EngineEvent::Decode {
        request: request.clone(),
        key,
        epoch: Epoch::FIRST,
        outcome: DecodeOutcome::Failed(failure),
        proof: FreeProof::DeadPeerFence,
        blocks: blocks(),
    }
}

#[test]
fn a_fenced_request_fails_early_and_hands_back_later() {
    let (runtime, mut conn, events) = connector(None);
    let request = id("d-1");
    allocate(&mut conn, &request, 1);
    assert!(conn.has_pending_work(), "precondition: the request is live");
    let key = PairingKey::from_request_id(&request);
    events
        .send(fenced(&request, key.clone(), DecodeFailure::PeerDead))
        .unwrap();
    assert_eq!(
        conn.poll_events(),
        vec![ConnectorEvent::DecodeFenced {
            request: request.clone(),
            reason: DecodeFailure::PeerDead,
        }]
    );
    assert!(
        conn.has_pending_work(),
        "the blocks are still out: the final event is owed"
    );
    events
        .send(freed(&request, key, DecodeFailure::PeerDead))
        .unwrap();
    let last = conn.poll_events();
    assert_eq!(
        last,
        vec![ConnectorEvent::Failed {
            request,
            reason: DecodeFailure::PeerDead,
            proof: FreeProof::DeadPeerFence,
            blocks: blocks(),
        }]
    );
    assert!(last[0].hands_back());
    assert!(!conn.has_pending_work());
    drop(conn);
    runtime.shutdown();
}

/// D rank 0 fed by P ranks 0 and 1; both die. The engine hears one `DecodeFenced` for its
/// request (at the first pair fenced), and one `Failed` once both pairs handed back.
#[test]
fn a_multi_rank_request_is_told_once() {
    let links = RankLinks {
        side: SideName::Decode,
        remote_tp: 2,
        remote_ranks: 2,
        peers: vec![0, 1],
    };
    let (runtime, mut conn, events) = connector(Some(links));
    let request = id("d-2");
    allocate(&mut conn, &request, 2);
    let key = PairingKey::from_request_id(&request);
    let sub = |p: u32| (id(&format!("d-2#p{p}d0")), key.for_pair(p, 0).unwrap());
    let ((sub0, key0), (sub1, key1)) = (sub(0), sub(1));
    assert!(conn.has_pending_work(), "precondition: both pairs are live");
    events
        .send(fenced(&sub1, key1.clone(), DecodeFailure::PeerDead))
        .unwrap();
    assert_eq!(
        conn.poll_events(),
        vec![ConnectorEvent::DecodeFenced {
            request: request.clone(),
            reason: DecodeFailure::PeerDead,
        }]
    );
    // The sibling, aborted by the fan-in, is fenced too when its own P rank dies.
    events
        .send(fenced(&sub0, key0.clone(), DecodeFailure::Aborted))
        .unwrap();
    events
        .send(freed(&sub0, key0, DecodeFailure::Aborted))
        .unwrap();
    assert_eq!(conn.poll_events(), vec![], "told once; rank 1 still fenced");
    assert!(conn.has_pending_work());
    events
        .send(freed(&sub1, key1, DecodeFailure::PeerDead))
        .unwrap();
    assert_eq!(
        conn.poll_events(),
        vec![ConnectorEvent::Failed {
            request,
            reason: DecodeFailure::PeerDead,
            proof: FreeProof::DeadPeerFence,
            blocks: blocks(),
        }]
    );
    assert!(!conn.has_pending_work());
    drop(conn);
    runtime.shutdown();
}
