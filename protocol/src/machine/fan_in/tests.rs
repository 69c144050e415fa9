//! Table-driven tests of `FanIn`: sequences of sub-request ends on either side, with the exact
//! step each one yields, and every refused input.

use crate::machine::types::{
    DecodeFailure, DecodeOutcome, EndpointEvent, FreeProof, PrefillOutcome, ReleaseCause,
};
use crate::{BlockIds, Epoch, PairingKey, ReleaseReason, RequestId, WriteFailure};

use super::{FanIn, FanInError, FanInStep, FanOutcome, FanSide, SubFailure, SubRequest};

fn key() -> PairingKey {
    PairingKey::new("cmpl-1").unwrap()
}

fn id(n: u32) -> RequestId {
    RequestId::new(format!("sub-{n}")).unwrap()
}

fn shared() -> BlockIds {
    BlockIds::single_group(vec![7, 8])
}

fn sub(n: u32) -> SubRequest {
    SubRequest {
        request: id(n),
        key: key().for_pair(n, 0).unwrap(),
    }
}

fn fan(side: FanSide, subs: u32) -> FanIn {
    FanIn::new(side, shared(), (0..subs).map(sub)).unwrap()
}

/// One input to the fan-in.
#[derive(Clone, Copy)]
enum In {
    /// D: sub-request `n` ended with this outcome.
    Decode(u32, DecodeOutcome),
    /// P: sub-request `n` ended with this outcome.
    Prefill(u32, PrefillOutcome),
    /// The endpoint refused to start sub-request `n`.
    NotStarted(u32),
    /// The engine aborts the request; the abort list is checked as the step's.
    AbortAll,
}

/// What a step must be: the sub-requests to abort, the outcome decided (the number of the
/// sub-request whose failure it is, or `Ready`), and whether the blocks came back.
#[derive(Clone, Copy)]
struct Expect {
    abort: &'static [u32],
    outcome: Option<Out>,
    hand_back: bool,
}

#[derive(Clone, Copy)]
enum Out {
    Ready,
    Failed(u32, SubFailure),
}

const NOTHING: Expect = Expect {
    abort: &[],
    outcome: None,
    hand_back: false,
};

fn decode_event(n: u32, outcome: DecodeOutcome) -> EndpointEvent {
    let proof = match outcome {
        DecodeOutcome::Ready => FreeProof::WritesCompleted,
        DecodeOutcome::Failed(_) => FreeProof::CancelAcknowledged,
    };
    EndpointEvent::Decode {
        request: id(n),
        key: sub(n).key,
        epoch: Epoch::FIRST,
        outcome,
        proof,
        blocks: shared(),
    }
}

fn prefill_event(n: u32, outcome: PrefillOutcome) -> EndpointEvent {
    EndpointEvent::Prefill {
        request: id(n),
        key: sub(n).key,
        outcome,
        blocks: shared(),
    }
}

fn apply(fan: &mut FanIn, input: In) -> FanInStep {
    match input {
        In::Decode(n, outcome) => fan.on_event(&decode_event(n, outcome)).unwrap(),
        In::Prefill(n, outcome) => fan.on_event(&prefill_event(n, outcome)).unwrap(),
        In::NotStarted(n) => fan.not_started(&id(n)).unwrap(),
        In::AbortAll => FanInStep {
            abort: fan.abort_all(),
            ..FanInStep::default()
        },
    }
}

const READY: DecodeOutcome = DecodeOutcome::Ready;
const DEAD: DecodeOutcome = DecodeOutcome::Failed(DecodeFailure::PeerDead);
const ABORTED: DecodeOutcome = DecodeOutcome::Failed(DecodeFailure::Aborted);
const SENT: PrefillOutcome = PrefillOutcome::Sent;
const LEASE: ReleaseCause = ReleaseCause::LeaseExpired;

/// One case: (name, side, sub-requests, inputs with the step each must yield).
type Case = (&'static str, FanSide, u32, Vec<(In, Expect)>);

fn cases() -> Vec<Case> {
    let ready = |hand_back| Expect {
        abort: &[],
        outcome: Some(Out::Ready),
        hand_back,
    };
    let back = Expect {
        hand_back: true,
        ..NOTHING
    };
    vec![
        (
            "every source ready: ready at the last, blocks back then",
            FanSide::Decode,
            3,
            vec![
                (In::Decode(0, READY), NOTHING),
                (In::Decode(2, READY), NOTHING),
                (In::Decode(1, READY), ready(true)),
            ],
        ),
        (
            "one source: an ordinary request",
            FanSide::Decode,
            1,
            vec![(In::Decode(0, READY), ready(true))],
        ),
        (
            "a source fails after another landed: failed at once, blocks wait for the sibling",
            FanSide::Decode,
            3,
            vec![
                (In::Decode(0, READY), NOTHING),
                (
                    In::Decode(1, DEAD),
                    Expect {
                        abort: &[2],
                        outcome: Some(Out::Failed(1, SubFailure::Decode(DecodeFailure::PeerDead))),
                        hand_back: false,
                    },
                ),
                (In::Decode(2, ABORTED), back),
            ],
        ),
        (
            "the first failure aborts every live sibling, once; one that lands anyway is fine",
            FanSide::Decode,
            3,
            vec![
                (
                    In::Decode(0, DEAD),
                    Expect {
                        abort: &[1, 2],
                        outcome: Some(Out::Failed(0, SubFailure::Decode(DecodeFailure::PeerDead))),
                        hand_back: false,
                    },
                ),
                (In::Decode(1, ABORTED), NOTHING),
                (In::Decode(2, READY), back),
            ],
        ),
        (
            "a sub-request the endpoint refused fails the request and aborts the started ones",
            FanSide::Decode,
            2,
            vec![
                (
                    In::NotStarted(1),
                    Expect {
                        abort: &[0],
                        outcome: Some(Out::Failed(1, SubFailure::NotStarted)),
                        hand_back: false,
                    },
                ),
                (In::Decode(0, ABORTED), back),
            ],
        ),
        (
            "the engine aborts the request: no sub-request is named twice",
            FanSide::Decode,
            2,
            vec![
                (
                    In::AbortAll,
                    Expect {
                        abort: &[0, 1],
                        ..NOTHING
                    },
                ),
                (
                    In::Decode(1, ABORTED),
                    Expect {
                        abort: &[],
                        outcome: Some(Out::Failed(1, SubFailure::Decode(DecodeFailure::Aborted))),
                        hand_back: false,
                    },
                ),
                (In::Decode(0, ABORTED), back),
            ],
        ),
        (
            "P writing to two D ranks: sources back after both writes",
            FanSide::Prefill,
            2,
            vec![
                (In::Prefill(1, SENT), NOTHING),
                (In::Prefill(0, SENT), ready(true)),
            ],
        ),
        (
            "P: a D rank that needed nothing is no failure",
            FanSide::Prefill,
            2,
            vec![
                (
                    In::Prefill(
                        0,
                        PrefillOutcome::Released(ReleaseCause::ReleasedByPeer(
                            ReleaseReason::FullPrefixHit,
                        )),
                    ),
                    NOTHING,
                ),
                (In::Prefill(1, SENT), ready(true)),
            ],
        ),
        (
            "P: one D rank never registered; the other's write still reads the sources",
            FanSide::Prefill,
            2,
            vec![
                (
                    In::Prefill(0, PrefillOutcome::Released(LEASE)),
                    Expect {
                        abort: &[1],
                        outcome: Some(Out::Failed(0, SubFailure::Prefill(LEASE))),
                        hand_back: false,
                    },
                ),
                (
                    In::Prefill(
                        1,
                        PrefillOutcome::Released(ReleaseCause::WriteFailed(
                            WriteFailure::PrefillAborted,
                        )),
                    ),
                    back,
                ),
            ],
        ),
    ]
}

#[test]
fn every_case_yields_its_steps() {
    for (name, side, subs, inputs) in cases() {
        let mut fan = fan(side, subs);
        let last = inputs.len() - 1;
        for (i, (input, expect)) in inputs.into_iter().enumerate() {
            let step = apply(&mut fan, input);
            let abort: Vec<RequestId> = expect.abort.iter().map(|&n| id(n)).collect();
            assert_eq!(step.abort, abort, "{name}: step {i}: abort");
            let outcome = expect.outcome.map(|o| match o {
                Out::Ready => FanOutcome::Ready,
                Out::Failed(n, failure) => FanOutcome::Failed {
                    request: id(n),
                    failure,
                },
            });
            assert_eq!(step.outcome, outcome, "{name}: step {i}: outcome");
            assert_eq!(
                step.hand_back,
                expect.hand_back.then(shared),
                "{name}: step {i}: hand-back"
            );
            assert_eq!(fan.is_handed_back(), i == last, "{name}: step {i}");
        }
        assert_eq!(fan.counts().live, 0, "{name}");
        assert_eq!(fan.live().count(), 0, "{name}");
    }
}

#[test]
fn refused_inputs_change_nothing() {
    let prefill_to_decode = prefill_event(0, SENT);
    let export = EndpointEvent::Export {
        request: id(0),
        key: sub(0).key,
        outcome: crate::machine::ExportOutcome::Read,
        proof: crate::machine::ReadProof::ReaderReleased,
        blocks: shared(),
    };
    let mut other_key = decode_event(0, READY);
    if let EndpointEvent::Decode { key: k, .. } = &mut other_key {
        *k = key().for_pair(9, 0).unwrap();
    }
    let mut other_blocks = decode_event(0, READY);
    if let EndpointEvent::Decode { blocks, .. } = &mut other_blocks {
        *blocks = BlockIds::single_group(vec![7]);
    }
    let cases: Vec<(&str, EndpointEvent, FanInError)> = vec![
        (
            "unknown sub-request",
            decode_event(5, READY),
            FanInError::UnknownRequest(id(5)),
        ),
        (
            "a prefill event on D's side",
            prefill_to_decode,
            FanInError::WrongSide {
                expected: FanSide::Decode,
                got: "prefill",
            },
        ),
        (
            "an export event",
            export,
            FanInError::WrongSide {
                expected: FanSide::Decode,
                got: "export",
            },
        ),
        (
            "another key",
            other_key,
            FanInError::KeyMismatch {
                request: id(0),
                expected: sub(0).key,
                got: key().for_pair(9, 0).unwrap(),
            },
        ),
        (
            "other blocks",
            other_blocks,
            FanInError::BlocksMismatch(id(0)),
        ),
    ];
    for (name, event, error) in cases {
        let mut fan = fan(FanSide::Decode, 2);
        let before = fan.clone();
        assert_eq!(fan.on_event(&event), Err(error), "{name}");
        assert_eq!(fan, before, "{name}: a refused input changed nothing");
    }
    let mut fan = fan(FanSide::Decode, 2);
    fan.on_event(&decode_event(0, READY)).unwrap();
    let before = fan.clone();
    assert_eq!(
        fan.on_event(&decode_event(0, DEAD)),
        Err(FanInError::AlreadyEnded(id(0)))
    );
    assert_eq!(
        fan.not_started(&id(0)),
        Err(FanInError::AlreadyEnded(id(0)))
    );
    assert_eq!(
        fan.not_started(&id(4)),
        Err(FanInError::UnknownRequest(id(4)))
    );
    assert_eq!(fan, before);
}

#[test]
fn a_fan_in_needs_distinct_sub_requests() {
    let none: [SubRequest; 0] = [];
    assert_eq!(
        FanIn::new(FanSide::Decode, shared(), none),
        Err(FanInError::NoSubRequests)
    );
    let same_key = SubRequest {
        request: id(1),
        key: sub(0).key,
    };
    assert_eq!(
        FanIn::new(FanSide::Decode, shared(), [sub(0), same_key]),
        Err(FanInError::DuplicateKey(sub(0).key))
    );
    let same_id = SubRequest {
        request: id(0),
        key: sub(1).key,
    };
    assert_eq!(
        FanIn::new(FanSide::Prefill, shared(), [sub(0), same_id]),
        Err(FanInError::DuplicateRequest(id(0)))
    );
    let limit = super::MAX_SUB_REQUESTS as u32;
    assert!(FanIn::new(FanSide::Decode, shared(), (0..limit).map(sub)).is_ok());
    assert_eq!(
        FanIn::new(FanSide::Decode, shared(), (0..=limit).map(sub)),
        Err(FanInError::TooManySubRequests)
    );
}

/// The deliberate bug hands the shared blocks back at the first failed sub-request's own
/// hand-back, while its sibling is still live: the step the table forbids.
#[cfg(feature = "mutations")]
#[test]
fn the_mutation_hands_back_at_the_first_failure() {
    let mut fan = fan(FanSide::Decode, 2);
    fan.set_mutation(Some(crate::machine::Mutation::FreeOnFirstSourceSettled));
    let step = fan.on_event(&decode_event(0, DEAD)).unwrap();
    assert_eq!(step.hand_back, Some(shared()));
    assert_eq!(fan.live().collect::<Vec<_>>(), vec![&id(1)]);
    let step = fan.on_event(&decode_event(1, ABORTED)).unwrap();
    assert_eq!(step.hand_back, None, "handed back once");
}

fn import_event(n: u32, outcome: crate::machine::ImportOutcome) -> EndpointEvent {
    EndpointEvent::Import {
        request: id(n),
        key: sub(n).key,
        epoch: Epoch::FIRST,
        outcome,
        blocks: shared(),
    }
}

/// A reader's fan-in: one loaded part is not the read. Without the deliberate bug the read
/// fails at the sibling's failure; with `reader_ready_on_first_part` it is `Ready` at the first
/// loaded part, and the later failure neither fails it nor aborts anything.
#[test]
fn a_reader_is_ready_only_when_every_part_loaded() {
    use crate::machine::{ImportFailure, ImportOutcome};
    let failed = ImportOutcome::Failed(ImportFailure::ReadFailed);
    let mut reader = fan(FanSide::Reader, 3);
    let step = reader
        .on_event(&import_event(0, ImportOutcome::Loaded))
        .unwrap();
    assert_eq!(step, FanInStep::default(), "one part is not the read");
    let step = reader.on_event(&import_event(1, failed)).unwrap();
    assert_eq!(step.abort, vec![id(2)]);
    assert_eq!(
        step.outcome,
        Some(FanOutcome::Failed {
            request: id(1),
            failure: SubFailure::Import(ImportFailure::ReadFailed),
        })
    );
    #[cfg(feature = "mutations")]
    {
        let mut reader = fan(FanSide::Reader, 3);
        reader.set_mutation(Some(crate::machine::Mutation::ReaderReadyOnFirstPart));
        let step = reader
            .on_event(&import_event(0, ImportOutcome::Loaded))
            .unwrap();
        assert_eq!(
            step.outcome,
            Some(FanOutcome::Ready),
            "the bug: ready at once"
        );
        let step = reader.on_event(&import_event(1, failed)).unwrap();
        assert_eq!((step.abort, step.outcome), (vec![], None));
        let step = reader
            .on_event(&import_event(2, ImportOutcome::Loaded))
            .unwrap();
        assert_eq!(step.hand_back, Some(shared()));
        assert_eq!(reader.outcome(), Some(&FanOutcome::Ready));
    }
}

fn fenced_event(n: u32, failure: DecodeFailure) -> EndpointEvent {
    EndpointEvent::DecodeFenced {
        request: id(n),
        key: sub(n).key,
        epoch: Epoch::FIRST,
        failure,
    }
}

fn fence_freed(n: u32, failure: DecodeFailure) -> EndpointEvent {
    EndpointEvent::Decode {
        request: id(n),
        key: sub(n).key,
        epoch: Epoch::FIRST,
        outcome: DecodeOutcome::Failed(failure),
        proof: FreeProof::DeadPeerFence,
        blocks: shared(),
    }
}

/// P rank 1 dies: its sub-request tells its failure early, the request fails at once (its
/// sibling aborted, the engine told once) while the shared blocks wait for the fence; a second
/// sub-request fenced tells the engine nothing new.
#[test]
fn the_first_sub_request_fenced_fails_the_request_once_and_holds_the_blocks() {
    let mut fan = fan(FanSide::Decode, 3);
    let landed = fan.on_event(&decode_event(0, READY)).unwrap();
    assert_eq!(
        landed,
        FanInStep::default(),
        "precondition: one pair landed"
    );
    let step = fan
        .on_event(&fenced_event(1, DecodeFailure::PeerDead))
        .unwrap();
    let failed = FanOutcome::Failed {
        request: id(1),
        failure: SubFailure::Decode(DecodeFailure::PeerDead),
    };
    assert_eq!(
        step,
        FanInStep {
            abort: vec![id(2)],
            outcome: Some(failed.clone()),
            hand_back: None,
            fenced: true,
        }
    );
    assert!(fan.is_fenced());
    assert_eq!(fan.counts().live, 2, "the fenced one has not handed back");
    // The aborted sibling is fenced too (its P rank died as well): nothing new to tell.
    let step = fan
        .on_event(&fenced_event(2, DecodeFailure::Aborted))
        .unwrap();
    assert_eq!(step, FanInStep::default());
    let step = fan
        .on_event(&fence_freed(2, DecodeFailure::Aborted))
        .unwrap();
    assert_eq!(step, FanInStep::default(), "rank 1's blocks still out");
    let step = fan
        .on_event(&fence_freed(1, DecodeFailure::PeerDead))
        .unwrap();
    assert_eq!(step.hand_back, Some(shared()));
    assert_eq!((step.outcome, step.fenced), (None, false));
    assert_eq!(fan.outcome(), Some(&failed));
}

/// A sibling's final failure decided the outcome; a later fenced sub-request still tells the
/// engine, once, that the blocks stay out.
#[test]
fn a_fence_after_the_outcome_is_told_without_a_new_outcome() {
    let mut fan = fan(FanSide::Decode, 2);
    let step = fan.on_event(&decode_event(0, ABORTED)).unwrap();
    assert_eq!(step.abort, vec![id(1)], "precondition: the request failed");
    assert!(step.outcome.is_some());
    let step = fan
        .on_event(&fenced_event(1, DecodeFailure::Aborted))
        .unwrap();
    assert_eq!(
        step,
        FanInStep {
            fenced: true,
            ..FanInStep::default()
        }
    );
    let step = fan
        .on_event(&fence_freed(1, DecodeFailure::Aborted))
        .unwrap();
    assert_eq!(step.hand_back, Some(shared()));
    assert!(!step.fenced);
}

#[test]
fn a_fenced_sub_request_keeps_its_promise() {
    let mut fan = fan(FanSide::Decode, 2);
    fan.on_event(&fenced_event(0, DecodeFailure::PeerDead))
        .unwrap();
    assert!(fan.is_fenced(), "precondition: told fenced");
    let before = fan.clone();
    let refused = [
        (
            fenced_event(0, DecodeFailure::PeerDead),
            FanInError::AlreadyFenced(id(0)),
        ),
        (
            decode_event(0, READY),
            FanInError::FencedOutcomeChanged(id(0)),
        ),
        (
            fence_freed(0, DecodeFailure::Deadline),
            FanInError::FencedOutcomeChanged(id(0)),
        ),
        (
            fenced_event(5, DecodeFailure::PeerDead),
            FanInError::UnknownRequest(id(5)),
        ),
    ];
    for (event, error) in refused {
        assert_eq!(fan.on_event(&event), Err(error.clone()), "{error}");
        assert_eq!(fan, before, "{error}: a refused input changed nothing");
    }
    let mut p = self::fan(FanSide::Prefill, 2);
    assert_eq!(
        p.on_event(&fenced_event(0, DecodeFailure::PeerDead)),
        Err(FanInError::WrongSide {
            expected: FanSide::Prefill,
            got: "decode-fenced",
        })
    );
    let mut ended = self::fan(FanSide::Decode, 2);
    ended.on_event(&decode_event(0, READY)).unwrap();
    assert_eq!(
        ended.on_event(&fenced_event(0, DecodeFailure::PeerDead)),
        Err(FanInError::AlreadyEnded(id(0)))
    );
}
