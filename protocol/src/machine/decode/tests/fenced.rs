//! Sequences through one D request fenced by its P's death: the early event comes once, at the
//! death, and the request then ends only with a proof or the fence, `Failed` as told.

use super::{
    config, failed_told, fenced_told, ms, registered, step, told_fenced, Next, QUARANTINE_MS,
};
use crate::machine::decode::{DecodeInput, DecodeRequest};
use crate::machine::types::{DecodeFailure, FreeProof, Time};

/// Steps `state` through `inputs` at NOW, expecting it to stay live and silent.
fn quietly(mut state: DecodeRequest, now: Time, inputs: &[DecodeInput]) -> DecodeRequest {
    for input in inputs {
        let (next, outputs, _) = step(state, now, input.clone());
        assert!(outputs.is_empty(), "{input:?}: {outputs:?}");
        let Next::Live(next) = next else {
            panic!("{input:?} ended the request: {next:?}");
        };
        state = next;
    }
    state
}

/// Rank 0 had landed; P dies; rank 1's write lands after all. Every expected write landed, but
/// the engine was told the request failed: it ends `Failed(PeerDead)` on the writes' proof.
#[test]
fn every_write_landing_after_the_early_event_still_ends_failed() {
    let now = ms(super::NOW_MS);
    let (next, outputs, counters) = step(registered(2, &[0]), now, DecodeInput::PeerDead);
    assert_eq!(outputs, vec![fenced_told(DecodeFailure::PeerDead)]);
    assert_eq!(counters, told_fenced());
    let Next::Live(fenced) = next else {
        panic!("a death fences, it does not end: {next:?}");
    };
    // Timers, a second death, an abort: nothing more is told, nothing is handed back.
    let fenced = quietly(
        fenced,
        now,
        &[
            DecodeInput::Timeout,
            DecodeInput::PeerDead,
            DecodeInput::Abort,
        ],
    );
    let (next, outputs, _) = step(fenced, now, DecodeInput::WriteDone { rank: 1 });
    assert!(outputs.is_empty());
    assert_eq!(
        next,
        failed_told(2, DecodeFailure::PeerDead, FreeProof::WritesCompleted)
    );
}

/// No proof comes: the request is handed back at the fence and not a moment before.
#[test]
fn without_a_proof_the_fence_hands_back() {
    let now = ms(super::NOW_MS);
    let (next, _, _) = step(registered(1, &[]), now, DecodeInput::PeerDead);
    let Next::Live(fenced) = next else {
        panic!("a death fences, it does not end: {next:?}");
    };
    assert_eq!(
        super::Machine::next_timer(&fenced, &config()),
        ms(QUARANTINE_MS),
        "precondition: fenced until the quarantine"
    );
    let fenced = quietly(fenced, ms(QUARANTINE_MS - 1), &[DecodeInput::Timeout]);
    let (next, outputs, _) = step(fenced, ms(QUARANTINE_MS), DecodeInput::Timeout);
    assert!(outputs.is_empty());
    assert_eq!(
        next,
        failed_told(1, DecodeFailure::PeerDead, FreeProof::DeadPeerFence)
    );
}
