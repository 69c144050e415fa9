//! A D request fenced by its P's death reaches the engine twice: `DecodeFenced` at the death
//! (the blocks still held, work still pending) and `Failed` with the same reason when the
//! blocks come back; the connector owes the engine the second one until it came. (How a
//! multi-rank request folds its pairs' deaths into one `DecodeFenced` is the session's, tested
//! with it: `kvhandoff_protocol::session`.)
//!
//! The rank is a real in-memory D rank (it takes the calls), but the connector's event channel
//! is the test's: it plays the session's events of a death, which a single process cannot
//! stage without a second engine dying.

use kvhandoff::{ConnectorEvent, ConnectorIdentity, KvConnector, KvTransferParams, Runtime};
use kvhandoff_actors::system::{build_mem_rank, KvPool, RankOptions, ShellConfig};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{Config, DecodeFailure, FreeProof};
use kvhandoff_protocol::{BlockIds, EngineId, KvGeometry, KvLayout, ModelIdentity, RequestId};
use tokio::sync::mpsc::UnboundedSender;

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn blocks() -> BlockIds {
    BlockIds::single_group(vec![2, 3])
}

/// A connector on a real D rank whose events the test sends.
fn connector() -> (Runtime, KvConnector, UnboundedSender<ConnectorEvent>) {
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
    let conn = KvConnector::new(identity, handle);
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

fn fenced(request: &RequestId) -> ConnectorEvent {
    ConnectorEvent::DecodeFenced {
        request: request.clone(),
        reason: DecodeFailure::PeerDead,
    }
}

fn freed(request: &RequestId) -> ConnectorEvent {
    ConnectorEvent::Failed {
        request: request.clone(),
        reason: DecodeFailure::PeerDead,
        proof: FreeProof::DeadPeerFence,
        blocks: blocks(),
    }
}

#[test]
fn a_fenced_request_fails_early_and_hands_back_later() {
    let (runtime, mut conn, events) = connector();
    let request = id("d-1");
    allocate(&mut conn, &request, 1);
    assert!(conn.has_pending_work(), "precondition: the request is live");
    events.send(fenced(&request)).unwrap();
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
    events.send(freed(&request)).unwrap();
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
