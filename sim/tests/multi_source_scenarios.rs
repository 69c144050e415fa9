//! Multi-rank push stories on real endpoints (issue 12): D's rank fed by P's ranks 0 and 1,
//! one 1:1 sub-request per pair under the pair's key, and the protocol crate's `FanIn` as D's
//! engine. The harness judges each sub-request's hand-back as any request's; these scenarios
//! judge the shared one: D's blocks go back only once no write of either P rank can land.

use kvhandoff_protocol::machine::{
    Config, DecodeFailure, DecodeOutcome, DecodeStart, EndpointCall, FanIn, FanOutcome, FanSide,
    FreeProof, Mutation, PrefillStart, SubFailure, SubRequest, Time,
};
use kvhandoff_protocol::{Epoch, PairingKey, PeerAddr, RequestId, WriteFailure, WriteId};
use kvhandoff_sim::scripted::*;

/// D's shared blocks.
const SHARED: [u32; 2] = [500, 501];

/// The pair key of P rank `rank` → D rank 0 for request 1.
fn pair_key(rank: u32) -> PairingKey {
    key(1).for_pair(rank, 0).unwrap()
}

fn d_sub(rank: u32) -> RequestId {
    RequestId::new(format!("{}-from-p{rank}", d_request(1))).unwrap()
}

fn p_rank(rank: u32) -> PeerAddr {
    if rank == 0 {
        p_addr()
    } else {
        p1_addr()
    }
}

/// D's engine over a fan-in: hands it every new D event, aborts the siblings it names, and
/// notes when it handed the shared blocks back and whether a write could still land then.
struct DecodeEngine {
    fan: FanIn,
    seen: usize,
    outcome: Option<FanOutcome>,
    /// (when, no write of either rank could still land in the shared blocks then)
    handed_back: Option<(Time, bool)>,
}

impl DecodeEngine {
    fn pump(&mut self, h: &mut Harness) {
        while let Some(event) = h.events_d().get(self.seen).cloned() {
            self.seen += 1;
            let step = self
                .fan
                .on_event(&event)
                .expect("a sub-request's one event");
            if let Some(outcome) = step.outcome {
                self.outcome = Some(outcome);
            }
            if step.hand_back.is_some() {
                let safe = !pending_into_shared(h);
                self.handed_back = Some((h.now, safe));
            }
            for sub in step.abort {
                // A sibling that ended meanwhile refuses; its event is on the way.
                let _ = h.abort(&d_addr(), sub);
            }
        }
    }
}

/// A write of any rank that may still land in D's shared blocks.
fn pending_into_shared(h: &Harness) -> bool {
    h.writes.values().any(|w| {
        w.order.to == d_addr()
            && !w.landed
            && w.order
                .remote
                .groups
                .iter()
                .flatten()
                .any(|b| SHARED.contains(b))
    })
}

/// P's ranks 0 and 1 finished request 1 (blocks [10, 11] and [20, 21]); D's rank allocated
/// [`SHARED`] once and registered one sub-request with each rank. Both writes are posted.
fn fed_by_two_ranks(mutation: Option<Mutation>) -> (Harness, DecodeEngine) {
    let mut h = Harness::new();
    h.add_endpoint(p1_addr(), Config::fast());
    for rank in 0..2 {
        let start = PrefillStart {
            request: RequestId::new(format!("{}-r{rank}", p_request(1))).unwrap(),
            key: pair_key(rank),
            blocks: blocks(&[10 + 10 * rank, 11 + 10 * rank]),
        };
        h.call(&p_rank(rank), EndpointCall::PrefillFinished(start))
            .unwrap();
    }
    let subs = (0..2).map(|rank| SubRequest {
        request: d_sub(rank),
        key: pair_key(rank),
    });
    let mut fan = FanIn::new(FanSide::Decode, blocks(&SHARED), subs).unwrap();
    fan.set_mutation(mutation);
    for rank in 0..2 {
        h.decode(DecodeStart {
            request: d_sub(rank),
            key: pair_key(rank),
            epoch: Epoch::FIRST,
            prefill: p_rank(rank),
            blocks: blocks(&SHARED),
            num_tokens: 32,
            expected_writes: 1,
        })
        .unwrap();
    }
    assert_eq!(h.writes.len(), 2, "each rank posted its write");
    let engine = DecodeEngine {
        fan,
        seen: 0,
        outcome: None,
        handed_back: None,
    };
    (h, engine)
}

/// The pending write of P rank `rank`.
fn write_of(h: &Harness, rank: u32) -> (PeerAddr, WriteId) {
    h.pending_writes()
        .into_iter()
        .find(|(from, _)| *from == p_rank(rank))
        .expect("the rank's write is pending")
}

// Scenario: D is fed by P ranks 0 and 1; rank 0's write lands, then rank 1 dies with its write
// in flight. D's sub-request from rank 0 is ready at once, the one from rank 1 is fenced; the
// request has failed, but D's blocks come back only when the fence ends, after both
// sub-requests settled.
#[test]
fn d_fed_by_two_ranks_frees_its_blocks_only_after_the_dead_ranks_fence() {
    let (mut h, mut engine) = fed_by_two_ranks(None);
    let w0 = write_of(&h, 0);
    h.complete_write(&w0);
    engine.pump(&mut h);
    assert_eq!(
        h.d_results(),
        vec![(DecodeOutcome::Ready, FreeProof::WritesCompleted)],
        "precondition: rank 0's sub-request is ready"
    );
    assert_eq!((&engine.outcome, engine.handed_back), (&None, None));

    h.crash(&p1_addr());
    let config = h.d().config().clone();
    h.advance(config.peer_timeout + config.heartbeat_interval);
    engine.pump(&mut h);
    assert_eq!(
        h.d().counters().peers_declared_dead,
        1,
        "rank 1 declared dead"
    );
    assert_eq!(h.d_results().len(), 1, "rank 1's sub-request is fenced");
    assert_eq!(
        engine.handed_back, None,
        "the shared blocks wait for the fence"
    );

    h.advance(config.quarantine);
    engine.pump(&mut h);
    assert_eq!(
        h.d_results()[1],
        (
            DecodeOutcome::Failed(DecodeFailure::PeerDead),
            FreeProof::DeadPeerFence
        ),
        "precondition: rank 1's sub-request failed"
    );
    assert_eq!(
        engine.outcome,
        Some(FanOutcome::Failed {
            request: d_sub(1),
            failure: SubFailure::Decode(DecodeFailure::PeerDead),
        })
    );
    let (at, safe) = engine.handed_back.expect("the shared blocks came back");
    assert!(safe, "no write could land in them then");
    let last = h.event_time(&d_addr(), &d_sub(1)).unwrap();
    assert!(at >= last && at >= h.event_time(&d_addr(), &d_sub(0)).unwrap());
    h.assert_no_leak();
}

// Scenario: rank 1's write fails while rank 0's is still in flight. D fails the request at
// once and aborts the sub-request from rank 0, which cancels at rank 0; rank 0 drains its
// write, and only then do D's blocks come back. The deliberate bug
// `free_on_first_source_settled` hands them back at rank 1's failure: rank 0's write then
// lands in blocks D gave back, and the check sees it.
#[test]
fn a_failed_rank_aborts_its_sibling_and_the_blocks_wait_for_its_drain() {
    for mutation in [None, Some(Mutation::FreeOnFirstSourceSettled)] {
        let (mut h, mut engine) = fed_by_two_ranks(mutation);
        let w1 = write_of(&h, 1);
        h.fail_write(&w1, WriteFailure::TransferFailed);
        engine.pump(&mut h);
        assert_eq!(
            h.d_results(),
            vec![(
                DecodeOutcome::Failed(DecodeFailure::WriteFailed(WriteFailure::TransferFailed)),
                FreeProof::PeerQuiesced
            )],
            "precondition: rank 1's sub-request failed first"
        );
        assert!(
            h.count_sent(&d_addr(), is_cancel) >= 1,
            "the sibling cancels at rank 0"
        );
        assert!(pending_into_shared(&h), "rank 0's write is still in flight");

        let w0 = write_of(&h, 0);
        h.complete_write(&w0);
        h.advance(ms(100));
        engine.pump(&mut h);
        assert_eq!(
            h.d_results()[1..],
            [(
                DecodeOutcome::Failed(DecodeFailure::Aborted),
                FreeProof::WritesCompleted
            )],
            "the aborted sibling settles by its write's end"
        );
        let (at, safe) = engine.handed_back.expect("the shared blocks came back");
        let landed_after = h.landings.iter().any(|l| l.to == d_addr() && l.at >= at);
        match mutation {
            None => {
                assert!(
                    safe && !landed_after,
                    "back only after rank 0's write ended"
                );
                h.assert_no_leak();
            }
            Some(_) => {
                assert!(!safe, "the mutation hands back while rank 0 writes");
                assert!(
                    landed_after,
                    "and rank 0's write lands in the returned blocks"
                );
                // The harness judged each sub-request alone: both were sound.
                assert!(h.take_violations().is_empty());
            }
        }
    }
}
