//! The actix system over the in-memory transport, on a paused tokio clock: both races end to
//! end with real bytes, and a P rank that goes silent.

mod fixture;
use fixture::{call, decode_start, fill, geometry, model, next_event, prefill_start, wrong_bytes};

/// How long a test waits for a rank's next event (virtual time: the tests pause the clock).
const EVENT_WITHIN: Duration = Duration::from_secs(30);

use std::time::Duration;

use kvhandoff_actors::metrics;
use kvhandoff_actors::system::{
    build_mem_rank, start_rank, Directory, Handshaker, KvPool, RankHandle, ShellConfig,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{Config, DecodeFailure, EndpointCall, FreeProof, Rejected};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::{EngineId, RequestId};

struct Rank {
    handle: RankHandle,
    pool: KvPool,
}

fn start(fabric: &MemFabric, directory: &Directory, engine: &str) -> Rank {
    let engine = EngineId::new(engine).unwrap();
    let (setup, pool) = build_mem_rank(
        fabric,
        &engine,
        geometry(),
        &model(),
        32,
        Config::fast(),
        ShellConfig::default(),
    )
    .unwrap();
    Rank {
        handle: start_rank(setup, Handshaker::InProcess(directory.clone()), None).unwrap(),
        pool,
    }
}

#[actix_rt::test]
async fn both_races_deliver_every_byte() {
    tokio::time::pause();
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let mut p = start(&fabric, &directory, "prefill");
    let mut d = start(&fabric, &directory, "decode");
    let before = metrics::transfer_snapshot();

    // D registers first: D allocates, then P finishes later.
    let d_blocks = vec![3, 4, 5];
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start("req-a-11111111", "prefill", d_blocks.clone())),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let p_blocks = vec![20, 21, 22];
    fill(&p.pool, "req-a", &p_blocks);
    call(
        &p.handle,
        EndpointCall::PrefillFinished(prefill_start("req-a-22222222", p_blocks)),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(&event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(
        wrong_bytes(&d.pool, "req-a", &d_blocks),
        0,
        "every byte of req-a"
    );
    let event = next_event(&mut p.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksFree { released: None, .. }),
        "{event:?}"
    );

    // P finishes first: P holds its blocks until D registers.
    let p_blocks = vec![1, 9, 10];
    fill(&p.pool, "req-b", &p_blocks);
    call(
        &p.handle,
        EndpointCall::PrefillFinished(prefill_start("req-b-33333333", p_blocks)),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let d_blocks = vec![7, 8, 0];
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start("req-b-44444444", "prefill", d_blocks.clone())),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(
        wrong_bytes(&d.pool, "req-b", &d_blocks),
        0,
        "every byte of req-b"
    );
    let event = next_event(&mut p.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksFree { released: None, .. }),
        "{event:?}"
    );

    // Each write was timed and sized once by P's transport actor (other tests of this binary
    // may add theirs), and the ranks publish their peers: each sees the other connected.
    let after = metrics::transfer_snapshot();
    assert!(after.xfer_time_seconds.count >= before.xfer_time_seconds.count + 2);
    assert!(after.post_time_seconds.count >= before.post_time_seconds.count + 2);
    assert!(after.num_descriptors.count >= before.num_descriptors.count + 2);
    assert!(after.bytes_transferred.sum > before.bytes_transferred.sum);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(metrics::endpoint_snapshot().peers_connected >= 2);
}

#[actix_rt::test]
async fn engine_errors_come_back_typed() {
    tokio::time::pause();
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let _p = start(&fabric, &directory, "prefill");
    let d = start(&fabric, &directory, "decode");
    let unknown = RequestId::new("nobody").unwrap();
    assert_eq!(
        call(
            &d.handle,
            EndpointCall::Abort {
                request: unknown.clone()
            }
        )
        .await,
        Err(Rejected::UnknownRequest(unknown))
    );
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start("dup-1", "prefill", vec![1])),
    )
    .await
    .unwrap();
    assert!(matches!(
        call(
            &d.handle,
            EndpointCall::DecodeAllocated(decode_start("dup-1", "prefill", vec![2]))
        )
        .await,
        Err(Rejected::DuplicateRequest(_))
    ));
}

#[actix_rt::test]
async fn d_fails_with_a_typed_outcome_when_p_is_missing() {
    tokio::time::pause();
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let mut d = start(&fabric, &directory, "decode");
    let before = metrics::transfer_snapshot();
    // No P rank exists: the handshake fails and D hands its blocks back at once.
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start("lonely-1", "prefill", vec![1, 2])),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(
            event,
            ConnectorEvent::Failed {
                reason: DecodeFailure::HandshakeFailed,
                proof: FreeProof::NeverExposed,
                ..
            }
        ),
        "{event:?}"
    );
    // Counted once by its cause and by its proof (other tests of this binary may add).
    let after = metrics::transfer_snapshot();
    let cause = metrics::FailureCause::HandshakeFailed;
    assert!(after.failed_transfers[&cause] > before.failed_transfers[&cause]);
    let proof = FreeProof::NeverExposed;
    assert!(after.decode_failed_by_proof[&proof] > before.decode_failed_by_proof[&proof]);
}
