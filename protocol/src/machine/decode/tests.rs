//! Table-driven tests of `DecodeRequest`: every (state, input) pair, with the exact next state,
//! outputs and counters.

use std::collections::BTreeSet;

use crate::{
    BlockIds, Cancel, CancelReason, EngineId, Epoch, Message, PairingKey, Register, RequestId,
    WriteFailure,
};

use super::{
    cancel_reason, Cancelling, Connecting, DecodeCommon, DecodeCtx, DecodeEnded, DecodeInput,
    DecodeRequest, Registered,
};
use crate::machine::effects::{Outbox, Step};
use crate::machine::shape::Machine;
use crate::machine::types::{
    Counters, DecodeFailure, DecodeOutcome, DropReason, EndpointEvent, FreeProof, Output, Time,
};
use crate::machine::Config;
use crate::PeerAddr;

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

/// When every case's input happens unless it says otherwise.
const NOW_MS: u64 = 1_000;
/// D's deadline in the fixtures.
const DEADLINE_MS: u64 = 6_000;
/// The fixtures' `Cancelling` state, as if it was entered at NOW: next resend and quarantine
/// end (checked against the config by `fixtures_follow_the_config`).
const RESEND_MS: u64 = 1_100;
const QUARANTINE_MS: u64 = 9_500;

fn config() -> Config {
    // cancel_retry_interval 100 ms, max_cancel_retries 5, quarantine 8500 ms.
    Config::fast()
}

fn own() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 3)
}

fn prefill() -> PeerAddr {
    PeerAddr::new(EngineId::new("prefill").unwrap(), 0)
}

fn key() -> PairingKey {
    PairingKey::new("key-1").unwrap()
}

fn common(expected_writes: u32) -> DecodeCommon {
    DecodeCommon {
        request: RequestId::new("req-d").unwrap(),
        key: key(),
        epoch: Epoch(2),
        prefill: prefill(),
        blocks: BlockIds::single_group(vec![500, 501]),
        num_tokens: 40,
        expected_writes,
        deadline: ms(DEADLINE_MS),
        parts: Default::default(),
        trace: crate::TraceId::from_u128(0x7ace),
    }
}

fn connecting() -> DecodeRequest {
    DecodeRequest::new(common(1))
}

/// The fixtures' `Registered` state, as if it was entered at NOW: the registration's resend.
const REGISTER_AGAIN_MS: u64 = NOW_MS + 500;

fn registered_with(
    expected_writes: u32,
    landed: &[u32],
    next_register: Time,
    registers_left: u32,
) -> DecodeRequest {
    DecodeRequest::Registered(Registered {
        common: common(expected_writes),
        landed: landed.iter().copied().collect(),
        next_register,
        registers_left,
    })
}

fn registered(expected_writes: u32, landed: &[u32]) -> DecodeRequest {
    let left = config().max_register_retries;
    registered_with(expected_writes, landed, ms(REGISTER_AGAIN_MS), left)
}

struct CancellingAt {
    expected: u32,
    reason: DecodeFailure,
    settled: &'static [u32],
    next_resend: Time,
    resends_left: u32,
    quarantine_until: Time,
    announced: bool,
}

impl CancellingAt {
    /// The fixture: cancelled for `Aborted`, nothing settled, every resend left.
    fn new(expected: u32) -> Self {
        CancellingAt {
            expected,
            reason: DecodeFailure::Aborted,
            settled: &[],
            next_resend: ms(RESEND_MS),
            resends_left: config().max_cancel_retries,
            quarantine_until: ms(QUARANTINE_MS),
            announced: false,
        }
    }

    /// The engine was told of the failure (`EndpointEvent::DecodeFenced`).
    fn announced(self) -> Self {
        CancellingAt {
            announced: true,
            ..self
        }
    }

    /// As P's death leaves a registered request: fenced, no resend, the engine told.
    fn fenced(expected: u32) -> Self {
        CancellingAt::new(expected)
            .reason(DecodeFailure::PeerDead)
            .resends(0, ms(NOW_MS))
            .announced()
    }

    fn reason(self, reason: DecodeFailure) -> Self {
        CancellingAt { reason, ..self }
    }

    fn settled(self, settled: &'static [u32]) -> Self {
        CancellingAt { settled, ..self }
    }

    fn resends(self, resends_left: u32, next_resend: Time) -> Self {
        CancellingAt {
            resends_left,
            next_resend,
            ..self
        }
    }

    fn build(self) -> DecodeRequest {
        DecodeRequest::Cancelling(Cancelling {
            common: common(self.expected),
            reason: self.reason,
            settled: self.settled.iter().copied().collect(),
            next_resend: self.next_resend,
            resends_left: self.resends_left,
            quarantine_until: self.quarantine_until,
            announced: self.announced,
        })
    }
}

/// What a transition is expected to leave behind.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Live(DecodeRequest),
    Ended(DecodeEnded),
}

fn ended(expected_writes: u32, outcome: DecodeOutcome, proof: FreeProof) -> Next {
    Next::Ended(DecodeEnded {
        common: common(expected_writes),
        outcome,
        proof,
        announced: None,
    })
}

/// A request whose engine was told of its failure early ends with that same failure.
fn failed_told(expected_writes: u32, reason: DecodeFailure, proof: FreeProof) -> Next {
    Next::Ended(DecodeEnded {
        common: common(expected_writes),
        outcome: DecodeOutcome::Failed(reason),
        proof,
        announced: Some(reason),
    })
}

/// The early event a peer's death gives the engine.
fn fenced_told(failure: DecodeFailure) -> Output {
    Output::Event(EndpointEvent::DecodeFenced {
        request: RequestId::new("req-d").unwrap(),
        key: key(),
        epoch: Epoch(2),
        failure,
    })
}

fn told_fenced() -> Counters {
    Counters {
        decodes_fenced: 1,
        ..Counters::default()
    }
}

fn failed(expected_writes: u32, reason: DecodeFailure, proof: FreeProof) -> Next {
    ended(expected_writes, DecodeOutcome::Failed(reason), proof)
}

fn register_sent() -> Output {
    Output::Send {
        to: prefill(),
        message: Message::Register(Box::new(Register {
            key: key(),
            epoch: Epoch(2),
            decode_engine: own().engine,
            decode_request: RequestId::new("req-d").unwrap(),
            decode_rank: 3,
            blocks: BlockIds::single_group(vec![500, 501]),
            num_tokens: 40,
            trace_id: crate::TraceId::from_u128(0x7ace),
            memory: Vec::new(),
        })),
    }
}

fn cancel_sent(reason: CancelReason) -> Output {
    Output::Send {
        to: prefill(),
        message: Message::Cancel(Cancel {
            key: key(),
            epoch: Epoch(2),
            reason,
        }),
    }
}

fn no_counters() -> Counters {
    Counters::default()
}

fn dropped(reason: DropReason) -> Counters {
    let mut counters = Counters::default();
    counters.drop(reason);
    counters
}

fn resent() -> Counters {
    Counters {
        cancel_resends: 1,
        ..Counters::default()
    }
}

struct Case {
    name: &'static str,
    state: DecodeRequest,
    now: Time,
    input: DecodeInput,
    next: Next,
    outputs: Vec<Output>,
    counters: Counters,
}

fn case(
    name: &'static str,
    state: DecodeRequest,
    input: DecodeInput,
    next: Next,
    outputs: Vec<Output>,
    counters: Counters,
) -> Case {
    Case {
        name,
        state,
        now: ms(NOW_MS),
        input,
        next,
        outputs,
        counters,
    }
}

impl Case {
    fn at(self, now: Time) -> Case {
        Case { now, ..self }
    }
}

fn write_done(rank: u32) -> DecodeInput {
    DecodeInput::WriteDone { rank }
}

fn cancel_ack(rank: u32) -> DecodeInput {
    DecodeInput::CancelAck { rank }
}

fn write_failed(rank: u32) -> DecodeInput {
    DecodeInput::WriteFailed {
        rank,
        reason: WriteFailure::TransferFailed,
    }
}

const FAILED_WRITE: DecodeFailure = DecodeFailure::WriteFailed(WriteFailure::TransferFailed);

fn cases() -> Vec<Case> {
    use DecodeFailure as F;
    use DecodeInput as I;
    use FreeProof as P;
    let live = Next::Live;
    let cancelled_at_now = |expected, reason, settled: &'static [u32]| {
        // `Registered` cancelling at NOW: first resend and quarantine counted from NOW.
        live(
            CancellingAt {
                expected,
                reason,
                settled,
                next_resend: ms(NOW_MS + 100),
                resends_left: 5,
                quarantine_until: ms(NOW_MS + 8_500),
                announced: false,
            }
            .build(),
        )
    };
    let c1 = || CancellingAt::new(1).build();
    vec![
        // ---- Connecting: nothing is exposed yet, so every end is `NeverExposed`.
        case(
            "connecting + peer connected: register, Registered",
            connecting(),
            I::PeerConnected,
            live(registered(1, &[])),
            vec![register_sent()],
            no_counters(),
        ),
        case(
            "connecting + connect failed: HandshakeFailed",
            connecting(),
            I::PeerConnectFailed,
            failed(1, F::HandshakeFailed, P::NeverExposed),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + peer dead: PeerDead",
            connecting(),
            I::PeerDead,
            failed(1, F::PeerDead, P::NeverExposed),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + write done: unexpected",
            connecting(),
            write_done(0),
            live(connecting()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + write failed: unexpected",
            connecting(),
            write_failed(0),
            live(connecting()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + cancel ack: unexpected",
            connecting(),
            cancel_ack(0),
            live(connecting()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + abort: Aborted",
            connecting(),
            I::Abort,
            failed(1, F::Aborted, P::NeverExposed),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + shutdown: Shutdown, never exposed",
            connecting(),
            I::Shutdown,
            failed(1, F::Shutdown, P::NeverExposed),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + timeout before deadline: waits",
            connecting(),
            I::Timeout,
            live(connecting()),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS - 1)),
        case(
            "connecting + timeout at deadline: Deadline",
            connecting(),
            I::Timeout,
            failed(1, F::Deadline, P::NeverExposed),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS)),
        case(
            "connecting + timeout after deadline: Deadline",
            connecting(),
            I::Timeout,
            failed(1, F::Deadline, P::NeverExposed),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS + 7)),
        // ---- Registered: P may write at any time.
        case(
            "registered + peer connected: unchanged",
            registered(1, &[]),
            I::PeerConnected,
            live(registered(1, &[])),
            vec![],
            no_counters(),
        ),
        case(
            "registered + connect failed: unchanged",
            registered(2, &[0]),
            I::PeerConnectFailed,
            live(registered(2, &[0])),
            vec![],
            no_counters(),
        ),
        case(
            "registered + peer dead: fenced (no cancel to a dead peer), the engine told now",
            registered(2, &[0]),
            I::PeerDead,
            live(CancellingAt::fenced(2).settled(&[0]).build()),
            vec![fenced_told(F::PeerDead)],
            told_fenced(),
        ),
        case(
            "fenced + timeout before the quarantine: still fenced",
            CancellingAt::fenced(1).build(),
            I::Timeout,
            live(CancellingAt::fenced(1).build()),
            vec![],
            no_counters(),
        ),
        case(
            "fenced + write done (old incarnation's proof): failed as told, never Ready",
            CancellingAt::fenced(1).build(),
            write_done(0),
            failed_told(1, F::PeerDead, P::WritesCompleted),
            vec![],
            no_counters(),
        ),
        case(
            "registered(1) + write done: Ready",
            registered(1, &[]),
            write_done(0),
            ended(1, DecodeOutcome::Ready, P::WritesCompleted),
            vec![],
            no_counters(),
        ),
        case(
            "registered(2) + first write done: waits for the second",
            registered(2, &[]),
            write_done(0),
            live(registered(2, &[0])),
            vec![],
            no_counters(),
        ),
        case(
            "registered(2) + second rank's write done: Ready",
            registered(2, &[0]),
            write_done(1),
            ended(2, DecodeOutcome::Ready, P::WritesCompleted),
            vec![],
            no_counters(),
        ),
        case(
            "registered(2) + same rank's write done again: duplicate",
            registered(2, &[0]),
            write_done(0),
            live(registered(2, &[0])),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "registered(1) + write failed: Failed, quiesced",
            registered(1, &[]),
            write_failed(0),
            failed(1, FAILED_WRITE, P::PeerQuiesced),
            vec![],
            no_counters(),
        ),
        case(
            "registered(2) + write failed, other rank pending: cancel",
            registered(2, &[]),
            write_failed(0),
            cancelled_at_now(2, FAILED_WRITE, &[0]),
            vec![cancel_sent(CancelReason::Aborted)],
            no_counters(),
        ),
        case(
            "registered(2) + write failed, other rank landed: Failed, quiesced",
            registered(2, &[0]),
            write_failed(1),
            failed(2, FAILED_WRITE, P::PeerQuiesced),
            vec![],
            no_counters(),
        ),
        case(
            "registered + cancel ack: unexpected",
            registered(1, &[]),
            cancel_ack(0),
            live(registered(1, &[])),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "registered(2) + cancel ack of a landed rank: unexpected, nothing settles",
            registered(2, &[0]),
            cancel_ack(0),
            live(registered(2, &[0])),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "registered + abort: cancel (Aborted)",
            registered(1, &[]),
            I::Abort,
            cancelled_at_now(1, F::Aborted, &[]),
            vec![cancel_sent(CancelReason::Aborted)],
            no_counters(),
        ),
        case(
            "registered + shutdown: cancel (Shutdown), blocks kept until the proof",
            registered(1, &[]),
            I::Shutdown,
            cancelled_at_now(1, F::Shutdown, &[]),
            vec![cancel_sent(CancelReason::Shutdown)],
            no_counters(),
        ),
        case(
            "registered(2) + abort after one landed: landed ranks are settled",
            registered(2, &[1]),
            I::Abort,
            cancelled_at_now(2, F::Aborted, &[1]),
            vec![cancel_sent(CancelReason::Aborted)],
            no_counters(),
        ),
        case(
            "registered + timeout before deadline, resends spent: waits",
            registered_with(1, &[], ms(REGISTER_AGAIN_MS), 0),
            I::Timeout,
            live(registered_with(1, &[], ms(REGISTER_AGAIN_MS), 0)),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS - 1)),
        case(
            "registered + timeout before the resend: waits",
            registered(1, &[]),
            I::Timeout,
            live(registered(1, &[])),
            vec![],
            no_counters(),
        )
        .at(ms(REGISTER_AGAIN_MS - 1)),
        case(
            "registered + timeout at the resend, nothing landed: Register again",
            registered(1, &[]),
            I::Timeout,
            live(registered_with(1, &[], ms(REGISTER_AGAIN_MS + 500), 2)),
            vec![register_sent()],
            Counters {
                register_resends: 1,
                ..Counters::default()
            },
        )
        .at(ms(REGISTER_AGAIN_MS)),
        case(
            // A timer that fires late does not push the next resend later: each keeps the
            // time counted from the first registration.
            "registered + timeout late within the grace, nothing landed: Register again, the \
             next one at its own time",
            registered(1, &[]),
            I::Timeout,
            live(registered_with(1, &[], ms(REGISTER_AGAIN_MS + 500), 2)),
            vec![register_sent()],
            Counters {
                register_resends: 1,
                ..Counters::default()
            },
        )
        .at(ms(REGISTER_AGAIN_MS + 100)),
        case(
            // A stall of D's process carried the resend past its grace: a copy sent now could
            // reach P after the span P's records of the key count on.
            "registered + timeout past the grace (a stall), nothing landed: the resend is \
             skipped",
            registered(1, &[]),
            I::Timeout,
            live(registered_with(1, &[], ms(REGISTER_AGAIN_MS + 500), 2)),
            vec![],
            Counters {
                register_resends_skipped: 1,
                ..Counters::default()
            },
        )
        .at(ms(REGISTER_AGAIN_MS + 200)),
        case(
            "registered + timeout after a stall past two resends' times, within the third's \
             grace: two skipped, the last sent",
            registered(1, &[]),
            I::Timeout,
            live(registered_with(1, &[], ms(REGISTER_AGAIN_MS + 1_500), 0)),
            vec![register_sent()],
            Counters {
                register_resends: 1,
                register_resends_skipped: 2,
                ..Counters::default()
            },
        )
        .at(ms(REGISTER_AGAIN_MS + 1_050)),
        case(
            "registered + timeout at the resend, a write landed: P has it, waits",
            registered(2, &[0]),
            I::Timeout,
            live(registered(2, &[0])),
            vec![],
            no_counters(),
        )
        .at(ms(REGISTER_AGAIN_MS)),
        case(
            "registered + timeout at deadline: cancel (Deadline)",
            registered(1, &[]),
            I::Timeout,
            live(
                CancellingAt {
                    expected: 1,
                    reason: F::Deadline,
                    settled: &[],
                    next_resend: ms(DEADLINE_MS + 100),
                    resends_left: 5,
                    quarantine_until: ms(DEADLINE_MS + 8_500),
                    announced: false,
                }
                .build(),
            ),
            vec![cancel_sent(CancelReason::Deadline)],
            no_counters(),
        )
        .at(ms(DEADLINE_MS)),
        // ---- Cancelling: ends only with a proof (or the quarantine).
        case(
            "cancelling, fenced by P's death + the same incarnation connected again (a false \
             death healed): cancel again now, every resend back",
            CancellingAt::fenced(1).build(),
            I::PeerConnected,
            live(
                CancellingAt::fenced(1)
                    .resends(
                        config().max_cancel_retries,
                        ms(NOW_MS) + config().cancel_retry_interval,
                    )
                    .build(),
            ),
            vec![cancel_sent(CancelReason::Aborted)],
            resent(),
        ),
        case(
            "cancelling + connect failed: unchanged",
            c1(),
            I::PeerConnectFailed,
            live(c1()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling + peer dead: no more resends; the quarantine from the cancel stands; \
             fenced now, so the engine is told (the first reason stands)",
            CancellingAt::new(2).settled(&[0]).build(),
            I::PeerDead,
            live(
                CancellingAt::new(2)
                    .settled(&[0])
                    .resends(0, ms(RESEND_MS))
                    .announced()
                    .build(),
            ),
            vec![fenced_told(F::Aborted)],
            told_fenced(),
        ),
        case(
            "cancelling, told already + peer dead again (after a rejoin): nothing told twice",
            CancellingAt::fenced(1).resends(3, ms(RESEND_MS)).build(),
            I::PeerDead,
            live(CancellingAt::fenced(1).resends(0, ms(RESEND_MS)).build()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling, told + ack (the rejoined incarnation's proof): failed as told",
            CancellingAt::new(1).reason(F::Deadline).announced().build(),
            cancel_ack(0),
            failed_told(1, F::Deadline, P::CancelAcknowledged),
            vec![],
            no_counters(),
        ),
        case(
            "fenced + timeout at the quarantine: freed by the fence, failed as told",
            CancellingAt::fenced(1).build(),
            I::Timeout,
            failed_told(1, F::PeerDead, P::DeadPeerFence),
            vec![],
            no_counters(),
        )
        .at(ms(QUARANTINE_MS)),
        case(
            "cancelling(1) + write done: writes completed, first reason stands",
            CancellingAt::new(1).reason(F::Deadline).build(),
            write_done(0),
            failed(1, F::Deadline, P::WritesCompleted),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + first write done: settled, waits",
            CancellingAt::new(2).build(),
            write_done(1),
            live(CancellingAt::new(2).settled(&[1]).build()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + last write done: writes completed",
            CancellingAt::new(2).settled(&[1]).build(),
            write_done(0),
            failed(2, F::Aborted, P::WritesCompleted),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + write done of a settled rank: duplicate",
            CancellingAt::new(2).settled(&[1]).build(),
            write_done(1),
            live(CancellingAt::new(2).settled(&[1]).build()),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "cancelling(1) + write failed: quiesced",
            c1(),
            write_failed(0),
            failed(1, F::Aborted, P::PeerQuiesced),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + first write failed: settled, waits",
            CancellingAt::new(2).build(),
            write_failed(0),
            live(CancellingAt::new(2).settled(&[0]).build()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + write failed of a settled rank: duplicate",
            CancellingAt::new(2).settled(&[0]).build(),
            write_failed(0),
            live(CancellingAt::new(2).settled(&[0]).build()),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "cancelling + cancel ack: acknowledged",
            CancellingAt::new(1).reason(FAILED_WRITE).build(),
            cancel_ack(0),
            failed(1, FAILED_WRITE, P::CancelAcknowledged),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + first cancel ack: settled, waits",
            CancellingAt::new(2).build(),
            cancel_ack(0),
            live(CancellingAt::new(2).settled(&[0]).build()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + cancel ack of the last rank: acknowledged",
            CancellingAt::new(2).settled(&[1]).build(),
            cancel_ack(0),
            failed(2, F::Aborted, P::CancelAcknowledged),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling(2) + cancel ack of a settled rank: duplicate",
            CancellingAt::new(2).settled(&[0]).build(),
            cancel_ack(0),
            live(CancellingAt::new(2).settled(&[0]).build()),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "cancelling + abort: first reason stands",
            CancellingAt::new(1).reason(F::Deadline).build(),
            I::Abort,
            live(CancellingAt::new(1).reason(F::Deadline).build()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling + shutdown: first reason stands",
            CancellingAt::new(1).reason(F::Deadline).build(),
            I::Shutdown,
            live(CancellingAt::new(1).reason(F::Deadline).build()),
            vec![],
            no_counters(),
        ),
        case(
            "cancelling + timeout before resend and quarantine: waits",
            c1(),
            I::Timeout,
            live(c1()),
            vec![],
            no_counters(),
        )
        .at(ms(RESEND_MS - 1)),
        case(
            "cancelling + timeout at resend: cancel again (Aborted)",
            c1(),
            I::Timeout,
            live(CancellingAt::new(1).resends(4, ms(RESEND_MS + 100)).build()),
            vec![cancel_sent(CancelReason::Aborted)],
            resent(),
        )
        .at(ms(RESEND_MS)),
        case(
            "cancelling(Deadline) + timeout after resend, the last: cancel again (Deadline), and \
             with nothing answered the engine told (P alive, its answers lost)",
            CancellingAt::new(1)
                .reason(F::Deadline)
                .resends(1, ms(RESEND_MS))
                .build(),
            I::Timeout,
            live(
                CancellingAt::new(1)
                    .reason(F::Deadline)
                    .resends(0, ms(RESEND_MS + 50 + 100))
                    .announced()
                    .build(),
            ),
            vec![
                cancel_sent(CancelReason::Deadline),
                fenced_told(DecodeFailure::Deadline),
            ],
            {
                let mut counters = resent();
                counters.decodes_fenced = 1;
                counters.cancels_unanswered = 1;
                counters
            },
        )
        .at(ms(RESEND_MS + 50)),
        case(
            "cancelling, told already + the last resend: cancel again, nothing told twice",
            CancellingAt::new(1)
                .reason(F::Deadline)
                .resends(1, ms(RESEND_MS))
                .announced()
                .build(),
            I::Timeout,
            live(
                CancellingAt::new(1)
                    .reason(F::Deadline)
                    .resends(0, ms(RESEND_MS + 50 + 100))
                    .announced()
                    .build(),
            ),
            vec![cancel_sent(CancelReason::Deadline)],
            resent(),
        )
        .at(ms(RESEND_MS + 50)),
        case(
            "cancelling + timeout at resend with no resends left: waits for quarantine",
            CancellingAt::new(1).resends(0, ms(RESEND_MS)).build(),
            I::Timeout,
            live(CancellingAt::new(1).resends(0, ms(RESEND_MS)).build()),
            vec![],
            no_counters(),
        )
        .at(ms(QUARANTINE_MS - 1)),
        case(
            "cancelling + timeout at quarantine: freed by quarantine",
            CancellingAt::new(2)
                .settled(&[0])
                .resends(0, ms(RESEND_MS))
                .build(),
            I::Timeout,
            failed(2, F::Aborted, P::Quarantine),
            vec![],
            no_counters(),
        )
        .at(ms(QUARANTINE_MS)),
        case(
            "cancelling + timeout at quarantine with a resend due: quarantine wins",
            CancellingAt::new(1)
                .reason(F::Deadline)
                .resends(3, ms(QUARANTINE_MS))
                .build(),
            I::Timeout,
            failed(1, F::Deadline, P::Quarantine),
            vec![],
            no_counters(),
        )
        .at(ms(QUARANTINE_MS + 1)),
    ]
}

// Adding a state or an input breaks one of these matches: add its name to the list beside it,
// and the coverage test below then demands its cases.
const STATES: [&str; 3] = ["Connecting", "Registered", "Cancelling"];
const INPUTS: [&str; 9] = [
    "PeerConnected",
    "PeerConnectFailed",
    "PeerDead",
    "WriteDone",
    "WriteFailed",
    "CancelAck",
    "Abort",
    "Shutdown",
    "Timeout",
];

fn state_name(state: &DecodeRequest) -> &'static str {
    match state {
        DecodeRequest::Connecting(Connecting { .. }) => "Connecting",
        DecodeRequest::Registered(_) => "Registered",
        DecodeRequest::Cancelling(_) => "Cancelling",
    }
}

fn input_name(input: &DecodeInput) -> &'static str {
    match input {
        DecodeInput::PeerConnected => "PeerConnected",
        DecodeInput::PeerConnectFailed => "PeerConnectFailed",
        DecodeInput::PeerDead => "PeerDead",
        DecodeInput::WriteDone { .. } => "WriteDone",
        DecodeInput::PartDone { .. } => "PartDone",
        DecodeInput::WriteFailed { .. } => "WriteFailed",
        DecodeInput::CancelAck { .. } => "CancelAck",
        DecodeInput::Abort => "Abort",
        DecodeInput::Shutdown => "Shutdown",
        DecodeInput::Timeout => "Timeout",
    }
}

fn step(state: DecodeRequest, now: Time, input: DecodeInput) -> (Next, Vec<Output>, Counters) {
    let config = config();
    let own = own();
    let ctx = DecodeCtx {
        now,
        own: &own,
        config: &config,
        mutation: Default::default(),
    };
    let mut fx = Outbox::default();
    let next = match state.handle(&ctx, input, &mut fx) {
        Step::Live(next) => Next::Live(next),
        Step::Ended(ended) => Next::Ended(ended),
    };
    (next, fx.out.into_iter().collect(), fx.counters)
}

#[test]
fn every_state_and_input() {
    let cases = cases();
    let mut names = BTreeSet::new();
    for case in cases {
        let name = case.name;
        assert!(names.insert(name), "case names are unique: {name}");
        let (next, outputs, counters) = step(case.state, case.now, case.input);
        assert_eq!(next, case.next, "case `{name}`: next state");
        assert_eq!(outputs, case.outputs, "case `{name}`: outputs");
        assert_eq!(counters, case.counters, "case `{name}`: counters");
        if let Next::Live(live) = &next {
            // Every live state waits with a deadline no later than its quarantine or deadline.
            let bound = match live {
                DecodeRequest::Connecting(s) => s.common.deadline,
                DecodeRequest::Registered(s) => s.common.deadline,
                DecodeRequest::Cancelling(s) => s.quarantine_until,
            };
            assert!(
                live.next_timer(&config()) <= bound,
                "case `{name}`: timer bound"
            );
        }
    }
}

#[test]
fn table_covers_every_state_input_pair() {
    let covered: BTreeSet<(&str, &str)> = cases()
        .iter()
        .map(|c| (state_name(&c.state), input_name(&c.input)))
        .collect();
    let all: BTreeSet<(&str, &str)> = STATES
        .iter()
        .flat_map(|s| INPUTS.iter().map(move |i| (*s, *i)))
        .collect();
    let missing: Vec<_> = all.difference(&covered).collect();
    let unknown: Vec<_> = covered.difference(&all).collect();
    assert!(missing.is_empty(), "pairs without a case: {missing:?}");
    assert!(
        unknown.is_empty(),
        "names missing from STATES/INPUTS: {unknown:?}"
    );
}

#[test]
fn timers_and_leases_per_state() {
    // (state, next timer, holds a lease). Only `Registered` renews P's lease: a request that
    // gave up must not keep P's registration alive (the quarantine assumes renewals stop).
    let table = [
        (connecting(), ms(DEADLINE_MS), false),
        (registered(2, &[0]), ms(DEADLINE_MS), true),
        // Nothing landed: the registration's resend comes first, until the resends are spent.
        (registered(1, &[]), ms(REGISTER_AGAIN_MS), true),
        (
            registered_with(1, &[], ms(REGISTER_AGAIN_MS), 0),
            ms(DEADLINE_MS),
            true,
        ),
        (CancellingAt::new(1).build(), ms(RESEND_MS), false),
        (
            CancellingAt::new(1).resends(0, ms(RESEND_MS)).build(),
            ms(QUARANTINE_MS),
            false,
        ),
        (
            CancellingAt::new(1)
                .resends(2, ms(QUARANTINE_MS + 5))
                .build(),
            ms(QUARANTINE_MS),
            false,
        ),
        (
            CancellingAt::new(2).settled(&[0]).build(),
            ms(RESEND_MS),
            false,
        ),
    ];
    for (state, timer, lease) in table {
        assert_eq!(state.next_timer(&Config::default()), timer, "{state:?}");
        assert_eq!(state.holds_lease(), lease, "{state:?}");
        assert_eq!(state.common().key, key());
    }
}

#[test]
fn fixtures_follow_the_config() {
    let config = config();
    assert_eq!(ms(RESEND_MS), ms(NOW_MS) + config.cancel_retry_interval);
    assert_eq!(
        ms(REGISTER_AGAIN_MS),
        ms(NOW_MS) + config.register_retry_interval
    );
    assert_eq!(ms(QUARANTINE_MS), ms(NOW_MS) + config.quarantine);
    config.validate().unwrap();
}

#[test]
fn cancel_reasons() {
    let table = [
        (DecodeFailure::Deadline, CancelReason::Deadline),
        (DecodeFailure::Aborted, CancelReason::Aborted),
        (DecodeFailure::PeerDead, CancelReason::Aborted),
        (FAILED_WRITE, CancelReason::Aborted),
        (DecodeFailure::HandshakeFailed, CancelReason::Aborted),
        (DecodeFailure::Incompatible, CancelReason::Aborted),
    ];
    for (failure, reason) in table {
        assert_eq!(cancel_reason(failure), reason, "{failure:?}");
    }
}

#[test]
#[should_panic(expected = "expects a write")]
fn a_request_expects_a_write() {
    let _ = DecodeRequest::new(common(0));
}

#[test]
#[should_panic(expected = "full hit")]
fn a_request_has_blocks() {
    let mut c = common(1);
    c.blocks = BlockIds::single_group(vec![]);
    let _ = DecodeRequest::new(c);
}

/// With two source ranks, a `CancelAck` proves only that the rank which sent it has drained; the
/// other rank may still be writing: the blocks stay held until that rank settles too.
#[test]
fn cancel_ack_from_one_of_two_ranks_does_not_free() {
    let (next, outputs, counters) = step(
        CancellingAt::new(2).build(),
        ms(NOW_MS),
        DecodeInput::CancelAck { rank: 0 },
    );
    assert_eq!(
        next,
        Next::Live(CancellingAt::new(2).settled(&[0]).build()),
        "one rank's ack is not a proof for the other"
    );
    assert_eq!(outputs, vec![]);
    assert_eq!(counters, Counters::default());
    // The other rank's ack is: the blocks come back with the ack as proof.
    let Next::Live(state) = next else {
        unreachable!()
    };
    let (next, outputs, counters) = step(state, ms(NOW_MS), DecodeInput::CancelAck { rank: 1 });
    assert_eq!(
        next,
        failed(2, DecodeFailure::Aborted, FreeProof::CancelAcknowledged)
    );
    assert_eq!(outputs, vec![]);
    assert_eq!(counters, Counters::default());
}

mod fenced;
