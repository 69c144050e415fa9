//! Integrity digests end to end (`Config::integrity_digest`): the in-memory transport corrupts
//! one byte of a write in flight (`MemFaults::corrupt_next_transfers`); with digests on D fails
//! the request with `WriteFailed(DigestMismatch)` and hands its blocks back, and the next
//! request goes through; with digests off the same corruption reaches the engine as
//! `BlocksReady` (the protocol cannot see it), which is what makes the first test able to fail.

mod fixture;
use fixture::{call, decode_start, fill, geometry, model, next_event, prefill_start, wrong_bytes};

/// How long a test waits for a rank's next event (virtual time: the tests pause the clock).
const EVENT_WITHIN: Duration = Duration::from_secs(30);

use std::time::Duration;

use kvhandoff_actors::system::{
    build_mem_rank, start_rank, Directory, Handshaker, KvPool, QueryCounters, QueryStats,
    RankHandle, ShellConfig,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{Config, DecodeFailure, EndpointCall, FreeProof};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::{AgentName, EngineId, WriteFailure};

struct Rank {
    handle: RankHandle,
    pool: KvPool,
    agent: AgentName,
}

fn start(fabric: &MemFabric, directory: &Directory, engine: &str, integrity: bool) -> Rank {
    let engine = EngineId::new(engine).unwrap();
    let config = Config {
        integrity_digest: integrity,
        ..Config::fast()
    };
    let (setup, pool) = build_mem_rank(
        fabric,
        &engine,
        geometry(),
        &model(),
        32,
        config,
        ShellConfig::default(),
    )
    .unwrap();
    let agent = setup.info.agent.clone();
    Rank {
        handle: start_rank(setup, Handshaker::InProcess(directory.clone()), None).unwrap(),
        pool,
        agent,
    }
}

/// Hands one request from P to D (D registers first) and returns D's first event.
async fn hand_off(
    p: &mut Rank,
    d: &mut Rank,
    name: &str,
    p_blocks: &[u32],
    d_blocks: &[u32],
) -> ConnectorEvent {
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start(
            &format!("{name}-11111111"),
            "prefill",
            d_blocks.to_vec(),
        )),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    fill(&p.pool, name, p_blocks);
    call(
        &p.handle,
        EndpointCall::PrefillFinished(prefill_start(
            &format!("{name}-22222222"),
            p_blocks.to_vec(),
        )),
    )
    .await
    .unwrap();
    next_event(&mut d.handle, EVENT_WITHIN).await
}

/// P's blocks come back once its write ended, whatever D found.
async fn p_frees_its_blocks(p: &mut Rank) {
    let event = next_event(&mut p.handle, EVENT_WITHIN).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksFree { .. }),
        "{event:?}"
    );
}

fn corrupt_next_write(fabric: &MemFabric, p: &Rank) {
    let mut faults = fabric.faults(&p.agent).unwrap();
    faults.corrupt_next_transfers = 1;
    fabric.set_faults(&p.agent, faults).unwrap();
}

#[actix_rt::test]
async fn a_byte_corrupted_in_flight_fails_the_request_with_the_digest_cause() {
    tokio::time::pause();
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let mut p = start(&fabric, &directory, "prefill", true);
    let mut d = start(&fabric, &directory, "decode", true);

    corrupt_next_write(&fabric, &p);
    let d_blocks = [3, 4, 5];
    let event = hand_off(&mut p, &mut d, "req-bad", &[20, 21, 22], &d_blocks).await;
    assert!(
        matches!(
            event,
            ConnectorEvent::Failed {
                reason: DecodeFailure::WriteFailed(WriteFailure::DigestMismatch),
                // The write's notification came after its data: nothing is in flight, and the
                // blocks come back as for any failed write.
                proof: FreeProof::PeerQuiesced,
                ..
            }
        ),
        "{event:?}"
    );
    // The corruption was real: one byte of D's blocks differs from what P wrote.
    assert_eq!(wrong_bytes(&d.pool, "req-bad", &d_blocks), 1);
    p_frees_its_blocks(&mut p).await;

    // The next request, into the same D blocks, goes through untouched.
    let event = hand_off(&mut p, &mut d, "req-good", &[20, 21, 22], &d_blocks).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(wrong_bytes(&d.pool, "req-good", &d_blocks), 0);
    p_frees_its_blocks(&mut p).await;

    // Counted, and nothing is left behind on either side.
    let counters = d.handle.rank.send(QueryCounters).await.unwrap();
    assert_eq!(counters.digest_mismatches, 1);
    for rank in [&p, &d] {
        let stats = rank.handle.rank.send(QueryStats).await.unwrap();
        assert_eq!(
            (
                stats.decode_requests,
                stats.prefill_requests,
                stats.writes_in_flight
            ),
            (0, 0, 0),
            "{stats:?}"
        );
    }
}

/// The control: without digests the same corruption reaches the engine as ready blocks.
#[actix_rt::test]
async fn without_digests_the_same_corruption_goes_unnoticed() {
    tokio::time::pause();
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let mut p = start(&fabric, &directory, "prefill", false);
    let mut d = start(&fabric, &directory, "decode", false);

    corrupt_next_write(&fabric, &p);
    let d_blocks = [3, 4, 5];
    let event = hand_off(&mut p, &mut d, "req-bad", &[20, 21, 22], &d_blocks).await;
    assert!(
        matches!(event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(wrong_bytes(&d.pool, "req-bad", &d_blocks), 1);
    let counters = d.handle.rank.send(QueryCounters).await.unwrap();
    assert_eq!(counters.digest_mismatches, 0);
}

/// The setting is part of the compatibility hash: a P and a D that disagree refuse each other
/// at the handshake, and D hands its blocks back at once.
#[actix_rt::test]
async fn sides_that_disagree_on_digests_refuse_each_other() {
    tokio::time::pause();
    let fabric = MemFabric::new();
    let directory = Directory::new();
    let _p = start(&fabric, &directory, "prefill", true);
    let mut d = start(&fabric, &directory, "decode", false);
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start("mixed-11111111", "prefill", vec![1, 2])),
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
}

/// Layer-wise writes, at the driver: a corrupt part is withheld from D's endpoint (its request
/// cannot become ready) and the mismatch is reported only once every part arrived (none is in
/// flight any more); a clean write's parts all pass.
mod layerwise {
    use super::{geometry, model};
    use kvhandoff_actors::system::{build_mem_rank, ShellConfig};
    use kvhandoff_actors::transport::mem::{MemFabric, MemTransport};
    use kvhandoff_protocol::driver::{PeerInfo, TransportDriver, TransportOp};
    use kvhandoff_protocol::machine::{Config, NetEvent, StreamedLayers, WriteOrder};
    use kvhandoff_protocol::{
        BlockIds, EngineId, Epoch, Message, PairingKey, Register, RequestId, WriteDone, WriteId,
    };

    struct Side {
        driver: TransportDriver<MemTransport>,
        info: PeerInfo,
    }

    fn side(fabric: &MemFabric, name: &str) -> Side {
        let config = Config {
            integrity_digest: true,
            ..Config::fast()
        };
        let engine = EngineId::new(name).unwrap();
        let (setup, pool) = build_mem_rank(
            fabric,
            &engine,
            geometry(),
            &model(),
            16,
            config,
            ShellConfig::default(),
        )
        .unwrap();
        // Distinct bytes in every block, so that a digest of the wrong bytes cannot match.
        for (r, (spec, region)) in pool.regions().enumerate() {
            for b in 0..16 {
                let (offset, len) = pool.block_span(spec, b);
                let bytes: Vec<u8> = (0..len)
                    .map(|i| (i as usize * 7 + r * 31 + b as usize) as u8)
                    .collect();
                region.write(offset, &bytes).unwrap();
            }
        }
        let mut driver = TransportDriver::new(setup.transport, setup.info.clone());
        driver.set_integrity(kvhandoff_kernels::digest::digest);
        Side {
            driver,
            info: setup.info,
        }
    }

    fn poll(side: &mut Side) -> Vec<NetEvent> {
        let mut feed = Vec::new();
        for _ in 0..3 {
            side.driver.poll(&mut feed);
        }
        feed
    }

    fn perform(side: &mut Side, op: TransportOp) -> Vec<NetEvent> {
        let mut feed = Vec::new();
        side.driver.perform(op, &mut feed);
        feed
    }

    /// D registers blocks 3 and 4 for `key`; P writes its blocks 1 and 2 there, layer by layer.
    fn start(p: &mut Side, d: &mut Side, key: &PairingKey, write: u64) {
        let register = Message::Register(Box::new(Register {
            key: key.clone(),
            epoch: Epoch::FIRST,
            decode_engine: d.info.peer.engine.clone(),
            decode_request: RequestId::new("req-11111111").unwrap(),
            decode_rank: 0,
            blocks: BlockIds::single_group(vec![3, 4]),
            num_tokens: 8,
            trace_id: kvhandoff_protocol::TraceId::from_u128(11),
            memory: Vec::new(),
        }));
        let to_p = p.info.peer.clone();
        perform(
            d,
            TransportOp::Send {
                to: to_p,
                message: register,
            },
        );
        poll(p);
        let order = WriteOrder {
            write: WriteId(write),
            to: d.info.peer.clone(),
            key: key.clone(),
            epoch: Epoch::FIRST,
            local: BlockIds::single_group(vec![1, 2]),
            remote: BlockIds::single_group(vec![3, 4]),
            notification: Message::WriteDone(WriteDone {
                key: key.clone(),
                epoch: Epoch::FIRST,
                prefill_rank: 0,
                digests: Vec::new(),
            }),
            stream: Some(StreamedLayers {
                layers: 2,
                posted: 1,
            }),
            remote_memory: Vec::new(),
        };
        assert!(perform(p, TransportOp::PostWrite(Box::new(order))).is_empty());
    }

    fn parts(feed: &[NetEvent]) -> Vec<(u32, usize)> {
        feed.iter()
            .filter_map(|e| match e {
                NetEvent::Received {
                    message: Message::WritePartDone(m),
                    ..
                } => Some((m.first, m.digests.len())),
                _ => None,
            })
            .collect()
    }

    fn mismatches(feed: &[NetEvent]) -> usize {
        feed.iter()
            .filter(|e| matches!(e, NetEvent::DigestMismatch { .. }))
            .count()
    }

    #[test]
    fn a_corrupt_part_is_withheld_and_reported_after_the_last_part() {
        let fabric = MemFabric::new();
        let (mut p, mut d) = (side(&fabric, "prefill"), side(&fabric, "decode"));
        p.driver.load_peer(d.info.clone()).unwrap();
        d.driver.load_peer(p.info.clone()).unwrap();

        // A clean write: both parts reach D's endpoint, each with one digest per block.
        let clean = PairingKey::new("clean").unwrap();
        start(&mut p, &mut d, &clean, 1);
        poll(&mut p);
        let first = poll(&mut d);
        perform(
            &mut p,
            TransportOp::ExtendWrite {
                write: WriteId(1),
                from: 1,
                to: 2,
            },
        );
        poll(&mut p);
        let second = poll(&mut d);
        assert_eq!(
            (parts(&first), parts(&second)),
            (vec![(0, 2)], vec![(1, 2)])
        );
        assert_eq!(mismatches(&first) + mismatches(&second), 0);

        // The first part of the next write lands with a byte flipped.
        let bad = PairingKey::new("bad").unwrap();
        p.driver
            .transport_mut()
            .update_faults(|f| f.corrupt_next_transfers = 1);
        start(&mut p, &mut d, &bad, 2);
        poll(&mut p);
        let first = poll(&mut d);
        assert_eq!(
            (parts(&first), mismatches(&first)),
            (vec![], 0),
            "{first:?}"
        );
        perform(
            &mut p,
            TransportOp::ExtendWrite {
                write: WriteId(2),
                from: 1,
                to: 2,
            },
        );
        poll(&mut p);
        let last = poll(&mut d);
        assert_eq!((parts(&last), mismatches(&last)), (vec![], 1), "{last:?}");
        assert_eq!(d.driver.stats().digest_mismatches, 1);
    }
}

/// A routed (heterogeneous) rank rearranges bytes on the way, so there is nothing common to
/// digest: the build refuses the setting before it allocates anything.
#[test]
fn a_routed_rank_refuses_integrity_digests() {
    use std::sync::Arc;

    use kvhandoff_actors::system::{agent_name, build_routed_rank, BuildError};
    use kvhandoff_protocol::driver::{RouteError, RouteRequest, TransferRoute};
    use kvhandoff_protocol::machine::ConfigError;
    use kvhandoff_protocol::planner::Descriptor;
    use kvhandoff_protocol::KvGeometry;

    struct Nowhere;
    impl TransferRoute for Nowhere {
        fn accepts(&self, _: &KvGeometry, _: &KvGeometry) -> Result<(), RouteError> {
            Ok(())
        }
        fn descriptors(
            &self,
            _: &RouteRequest<'_>,
            _: &mut Vec<Descriptor>,
        ) -> Result<(), RouteError> {
            Err(RouteError("nothing to place".into()))
        }
    }

    let fabric = MemFabric::new();
    let engine = EngineId::new("routed").unwrap();
    let transport = fabric.agent(agent_name(&engine, 0).unwrap()).unwrap();
    let config = Config {
        integrity_digest: true,
        ..Config::fast()
    };
    let built = build_routed_rank(
        transport,
        &engine,
        geometry(),
        &model(),
        &[4096],
        config,
        ShellConfig::default(),
        Arc::new(Nowhere),
    );
    assert!(
        matches!(
            built,
            Err(BuildError::Config(ConfigError::Contradiction(_)))
        ),
        "{:?}",
        built.err()
    );
}
