use super::runtime::tiny_geometry;
use super::*;
use kvhandoff::{ConnectorError, ConnectorReply};

#[test]
fn bad_options_are_refused() {
    for options in [
        ControlOptions {
            rounds: 0,
            ..ControlOptions::default()
        },
        ControlOptions {
            rounds: MAX_ROUNDS + 1,
            ..ControlOptions::default()
        },
        ControlOptions {
            actix_batch: 0,
            ..ControlOptions::default()
        },
        ControlOptions {
            requests: 0,
            ..ControlOptions::default()
        },
    ] {
        assert!(matches!(control(&options), Err(BenchError::Options(_))));
    }
}

/// One in-memory rank of `engine` on its own runtime (its own thread), and its connector.
fn one_rank(engine: &str) -> (Runtime, KvConnector) {
    let geometry = tiny_geometry();
    let mut runtime = Runtime::start().unwrap();
    let rank = RankBuilder::new(
        EngineId::new(engine).unwrap(),
        geometry.clone(),
        demo::model(),
    )
    .regions(demo::engine_memory(&geometry, 8).unwrap())
    .transport(TransportKind::Mem(MemFabric::new()))
    .connector_settings(ConnectorSettings::default())
    .placement(Placement::OwnThread)
    .start_on(&mut runtime)
    .unwrap();
    (runtime, rank.into_parts().0)
}

#[test]
fn submit_returns_one_result_per_call_in_order() {
    let (runtime, mut conn) = one_rank(DECODE_ENGINE);
    let router = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some(PREFILL_ENGINE.into()),
        tp_size: Some(1),
        ..KvTransferParams::default()
    };
    let id = |s: &str| RequestId::new(s).unwrap();
    let allocated = |request: &str, params: &KvTransferParams| ConnectorCall::RequestAllocated {
        request: id(request),
        blocks: BlockIds::single_group(vec![0]),
        num_tokens: 16,
        params: params.clone(),
    };
    let not_remote = KvTransferParams {
        do_remote_prefill: false,
        ..router.clone()
    };
    let results = conn.submit(vec![
        allocated("r1", &router),
        allocated("r2", &not_remote),
        allocated("r1", &router),
        ConnectorCall::RequestFinished {
            request: id("p1"),
            blocks: BlockIds::single_group(vec![1]),
            num_tokens: 16,
            params: KvTransferParams::default(),
        },
        ConnectorCall::Abort {
            request: id("nope"),
        },
    ]);
    assert_eq!(results.len(), 5);
    assert!(matches!(results[0], Ok(ConnectorReply::Accepted)));
    assert!(matches!(
        results[1],
        Err(ConnectorError::InvalidParam {
            name: "do_remote_prefill",
            ..
        })
    ));
    assert!(matches!(results[2], Err(ConnectorError::Rejected(_))));
    match &results[3] {
        Ok(ConnectorReply::DecodeParams(params)) => {
            assert_eq!(params.remote_request_id.as_deref(), Some("p1"));
            assert_eq!(params.remote_engine_id.as_deref(), Some(DECODE_ENGINE));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(results[4], Err(ConnectorError::Rejected(_))));
    assert!(conn.has_pending_work());
    // The single-call hooks go through the same path (r1 may already have failed: there is
    // no P to connect to; p1 waits for its D).
    let aborted = conn.abort(&id("p1"));
    assert!(aborted.is_ok(), "{aborted:?}");
    assert!(matches!(
        conn.abort(&id("nope")),
        Err(ConnectorError::Rejected(_))
    ));
    assert!(conn.submit(Vec::new()).is_empty());
    runtime.shutdown();
}

/// A call whose verdict is late is not reported as "nothing changed": it is `VerdictLate`,
/// the connector keeps counting it as pending work, and its fate comes through
/// `poll_events` — the request's event if it was accepted, `Refused` if not.
#[test]
fn a_late_verdict_is_settled_by_poll_events() {
    let (runtime, mut conn) = one_rank(PREFILL_ENGINE);
    let finished = |request: &str| ConnectorCall::RequestFinished {
        request: RequestId::new(request).unwrap(),
        blocks: BlockIds::single_group(vec![1]),
        num_tokens: 16,
        params: KvTransferParams::default(),
    };
    // No wait at all: the rank (on its own thread) can rarely answer in time. On a loaded
    // machine it sometimes does, so each call is retried (boundedly) until its verdict is late.
    conn.set_call_timeout(Duration::ZERO);
    const TRIES: usize = 200;
    let mut late_request = None;
    for attempt in 0..TRIES {
        let request = format!("p-late-{attempt}");
        match conn.submit(vec![finished(&request)]).pop().unwrap() {
            Err(ConnectorError::VerdictLate) => {
                late_request = Some(request);
                break;
            }
            // Accepted within no time at all: abort it and wait for its blocks, then retry.
            Ok(_) => {
                conn.abort(&RequestId::new(request.as_str()).unwrap())
                    .unwrap();
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut freed = false;
                while !freed && Instant::now() < deadline {
                    for event in conn.poll_events() {
                        assert!(
                            matches!(event, ConnectorEvent::BlocksFree { .. }),
                            "{event:?}"
                        );
                        freed = true;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(freed, "{request}: aborted, its blocks never came back");
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    let late_request = late_request.expect("the verdict was never late in 200 calls");
    assert!(conn.has_pending_work(), "a late call is pending work");
    // The same request again: a refusal, also late (one answered in time changed nothing).
    let mut refusal_late = false;
    for _ in 0..TRIES {
        match conn.submit(vec![finished(&late_request)]).pop().unwrap() {
            Err(ConnectorError::VerdictLate) => {
                refusal_late = true;
                break;
            }
            Err(ConnectorError::Rejected(
                kvhandoff_protocol::machine::Rejected::DuplicateRequest(_),
            )) => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(
        refusal_late,
        "the refusal's verdict was never late in {TRIES} calls"
    );
    conn.set_call_timeout(KvConnector::CALL_TIMEOUT);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut refused = Vec::new();
    while Instant::now() < deadline && refused.is_empty() {
        for event in conn.poll_events() {
            match event {
                ConnectorEvent::Refused { request, error } => refused.push((request, error)),
                other => panic!("no other event yet: {other:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0.as_str(), late_request);
    assert!(matches!(
        refused[0].1,
        ConnectorError::Rejected(kvhandoff_protocol::machine::Rejected::DuplicateRequest(_))
    ));
    // The accepted one is live: aborting it brings its one event, then no work is left.
    conn.abort(&RequestId::new(late_request.as_str()).unwrap())
        .unwrap();
    let mut freed = 0;
    while Instant::now() < deadline && conn.has_pending_work() {
        for event in conn.poll_events() {
            assert!(
                matches!(event, ConnectorEvent::BlocksFree { .. }),
                "{event:?}"
            );
            freed += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(freed, 1);
    assert!(!conn.has_pending_work());
    runtime.shutdown();
}

/// An abort whose verdict comes late, for a request that already ended (its `BlocksFree` was
/// polled): the rank refuses it (`UnknownRequest`), and that late refusal must not become a
/// second event — `Refused` says the blocks are the engine's again, which it already believes.
#[test]
fn a_late_refused_abort_gives_no_second_event() {
    let (runtime, mut conn) = one_rank(PREFILL_ENGINE);
    let request = RequestId::new("p-ended-then-aborted").unwrap();
    conn.submit(vec![ConnectorCall::RequestFinished {
        request: request.clone(),
        blocks: BlockIds::single_group(vec![1]),
        num_tokens: 16,
        params: KvTransferParams::default(),
    }])
    .pop()
    .unwrap()
    .unwrap();
    conn.abort(&request).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut first = Vec::new();
    while first.is_empty() && Instant::now() < deadline {
        first = conn.poll_events();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        matches!(first.as_slice(), [ConnectorEvent::BlocksFree { .. }]),
        "{first:?}"
    );
    assert!(!conn.has_pending_work());

    // The engine aborts it again (its own bookkeeping lagged), and the verdict is late.
    conn.set_call_timeout(Duration::ZERO);
    const TRIES: usize = 200;
    let mut late = false;
    for _ in 0..TRIES {
        match conn.abort(&request) {
            Err(ConnectorError::VerdictLate) => {
                late = true;
                break;
            }
            // Answered in time: refused, nothing changed.
            Err(ConnectorError::Rejected(
                kvhandoff_protocol::machine::Rejected::UnknownRequest(_),
            )) => {}
            other => panic!("{other:?}"),
        }
    }
    // The precondition: a refusal whose verdict was late.
    assert!(late, "the abort's verdict was never late in {TRIES} calls");
    conn.set_call_timeout(KvConnector::CALL_TIMEOUT);
    let deadline = Instant::now() + Duration::from_secs(5);
    while conn.has_pending_work() && Instant::now() < deadline {
        let events = conn.poll_events();
        assert!(events.is_empty(), "a second event: {events:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!conn.has_pending_work(), "the late verdict never settled");
    assert!(conn.poll_events().is_empty());
    runtime.shutdown();
}
