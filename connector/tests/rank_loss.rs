//! A rank that dies while it handles a step's calls: the connector must not report "nothing
//! changed" (`Unavailable`) for calls that may have been applied, and must not keep the engine
//! waiting forever for events that can no longer come.
//!
//! The rank is a real in-memory rank, but the connector's batches go through a stand-in actor
//! that hands the batch's first call to the real rank and then panics, as a rank whose endpoint
//! panicked halfway through a batch would; the connector's event channel belongs to the stand-in,
//! so it closes when the stand-in dies, as a dead rank's does.

use std::sync::mpsc;
use std::time::Duration;

use actix::{Actor, Context, Handler, Recipient};
use kvhandoff::{
    ConnectorCall, ConnectorError, ConnectorIdentity, KvConnector, KvTransferParams, Runtime,
};
use kvhandoff_actors::system::{build_mem_rank, Calls, KvPool, RankOptions, ShellConfig};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::{BlockIds, EngineId, KvGeometry, KvLayout, ModelIdentity, RequestId};

const PREFILL: &str = "prefill-0";

/// Hands the first call of its first batch to the real rank, then dies without answering.
struct DiesMidBatch {
    real: Recipient<Calls>,
    /// The connector's event channel: dropped with the actor, as a dead rank's is.
    _events: tokio::sync::mpsc::UnboundedSender<kvhandoff::ConnectorEvent>,
}

impl Actor for DiesMidBatch {
    type Context = Context<Self>;
}

impl Handler<Calls> for DiesMidBatch {
    type Result = ();

    fn handle(&mut self, mut calls: Calls, _: &mut Context<Self>) {
        let first = calls.calls.remove(0);
        self.real.do_send(Calls {
            calls: vec![first],
            reply: None,
        });
        panic!("deliberate: the rank dies halfway through a batch");
    }
}

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

#[test]
fn a_rank_that_dies_mid_batch_gives_verdict_unknown_and_no_endless_wait() {
    let fabric = MemFabric::new();
    let engine = EngineId::new(PREFILL).unwrap();
    let model = ModelIdentity {
        model: "rank-loss".into(),
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

    // The stand-in lives on an actix system of its own thread.
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let (addr_tx, addr_rx) = mpsc::channel();
    let real = handle.batches.clone();
    let stand_in_thread = std::thread::spawn(move || {
        let system = actix::System::new();
        system.block_on(async move {
            let stand_in = DiesMidBatch {
                real,
                _events: events_tx,
            }
            .start();
            addr_tx.send(stand_in.recipient::<Calls>()).unwrap();
        });
        // Runs until the test ends the process; the panic stays inside the actor's task.
        let _ = system.run();
    });
    handle.batches = addr_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    handle.events = events_rx;
    let identity = ConnectorIdentity {
        engine,
        rank: 0,
        tp_size: 1,
        host: "127.0.0.1".into(),
        port: 0,
    };
    let mut conn = KvConnector::new(identity, handle);

    let finished = |request: &str| ConnectorCall::RequestFinished {
        request: id(request),
        blocks: BlockIds::single_group(vec![1]),
        num_tokens: 16,
        params: KvTransferParams::default(),
    };
    let results = conn.submit(vec![
        finished("applied-before-the-panic"),
        finished("never-run"),
    ]);
    assert_eq!(results.len(), 2);
    for result in &results {
        assert!(
            matches!(result, Err(ConnectorError::VerdictUnknown)),
            "a call the dying rank took is not 'nothing changed': {result:?}"
        );
    }
    // The precondition: the batch's first call really was applied by the real rank.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stats = conn.rank().stats(Duration::from_secs(1));
        if stats.is_some_and(|s| s.prefill_requests == 1) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the first call never reached the real rank"
        );
        std::thread::sleep(Duration::from_millis(2));
    }

    // No event can come any more: the engine is told so and is not kept waiting. The channel
    // closes when the dead actor's state is dropped, a moment after its batch was.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !conn.rank_stopped() {
        assert!(conn.poll_events().is_empty());
        assert!(
            std::time::Instant::now() < deadline,
            "the rank's event channel never closed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!conn.has_pending_work());
    drop(conn);
    runtime.shutdown();
    drop(stand_in_thread);
}
