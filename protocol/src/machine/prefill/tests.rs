//! Table-driven tests of `PrefillRequest`: every (state, input) pair — `Draining` once per
//! `DrainCause` — with the exact next state, outputs and counters, plus `pair_blocks`.

use std::collections::BTreeSet;

use crate::{
    BlockIds, CancelAck, EngineId, Epoch, Message, PairingKey, Register, ReleaseReason, RequestId,
    WriteDone, WriteFailed, WriteFailure,
};

use super::{
    pair_blocks, Binding, DrainCause, Draining, Held, PrefillCommon, PrefillCtx, PrefillEnded,
    PrefillInput, PrefillRequest, Writing,
};
use crate::machine::effects::{Outbox, Step};
use crate::machine::shape::Machine;
use crate::machine::types::{
    Counters, DropReason, Output, PrefillOutcome, ReleaseCause, Time, WriteOrder,
};
use crate::machine::{BlockPairing, Config};
use crate::{PeerAddr, WriteId};

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

/// When every case's input happens unless it says otherwise.
const NOW_MS: u64 = 1_000;
/// The `Held` fixture's lease end.
const LEASE_MS: u64 = 4_000;
/// The `Writing` fixture's write deadline, and the `Draining` fixture's deadline.
const WRITE_DL_MS: u64 = 2_000;
/// The write id the next posted write gets, and the fixtures' bound write.
const WRITE: WriteId = WriteId(7);
const OWN_RANK: u32 = 0;
/// The epoch the fixtures are bound to.
const EPOCH: Epoch = Epoch(2);

fn config() -> Config {
    // lease 3000 ms, extension 2000 ms, write_timeout 1000 ms, abandon_timeout 500 ms.
    Config::fast()
}

/// The D rank the fixtures are bound to.
fn d() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 3)
}

/// Another rank of the same D engine.
fn d2() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 4)
}

/// A peer nothing here is bound to.
fn stranger() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode-x").unwrap(), 0)
}

fn key() -> PairingKey {
    PairingKey::new("key-1").unwrap()
}

/// P's blocks: `[10, 11, 12, 13, 14]`.
fn p_blocks() -> BlockIds {
    BlockIds::single_group((10..=14).collect())
}

fn common_with(blocks: BlockIds) -> PrefillCommon {
    PrefillCommon {
        request: RequestId::new("req-p").unwrap(),
        key: key(),
        blocks,
        producing: None,
    }
}

fn common() -> PrefillCommon {
    common_with(p_blocks())
}

fn register_from(from: &PeerAddr, epoch: Epoch, blocks: BlockIds) -> PrefillInput {
    PrefillInput::Registered {
        from: from.clone(),
        register: Box::new(Register {
            key: key(),
            epoch,
            decode_engine: from.engine.clone(),
            decode_request: RequestId::new("req-d").unwrap(),
            decode_rank: from.rank,
            blocks,
            num_tokens: 40,
            trace_id: crate::TraceId::from_u128(0x7ace),
            memory: Vec::new(),
        }),
    }
}

fn register(epoch: Epoch) -> PrefillInput {
    register_from(&d(), epoch, d_blocks())
}

/// D's blocks: `[500, 501]`.
fn d_blocks() -> BlockIds {
    BlockIds::single_group(vec![500, 501])
}

fn held() -> PrefillRequest {
    PrefillRequest::Held(Held {
        common: common(),
        lease_until: ms(LEASE_MS),
    })
}

fn held_until(lease_until: Time) -> PrefillRequest {
    PrefillRequest::Held(Held {
        common: common(),
        lease_until,
    })
}

fn binding() -> Binding {
    Binding {
        epoch: EPOCH,
        to: d(),
        write: WRITE,
        trace: crate::TraceId::from_u128(0x7ace),
    }
}

fn writing() -> PrefillRequest {
    writing_until(ms(WRITE_DL_MS))
}

fn writing_until(write_deadline: Time) -> PrefillRequest {
    PrefillRequest::Writing(Writing {
        common: common(),
        binding: binding(),
        write_deadline,
    })
}

fn draining(cause: DrainCause, cancel_requested: bool, abandoned: bool) -> PrefillRequest {
    draining_until(cause, cancel_requested, abandoned, ms(WRITE_DL_MS))
}

fn draining_until(
    cause: DrainCause,
    cancel_requested: bool,
    abandoned: bool,
    deadline: Time,
) -> PrefillRequest {
    PrefillRequest::Draining(Draining {
        common: common(),
        binding: binding(),
        cause,
        cancel_requested,
        abandoned,
        stuck: false,
        deadline,
    })
}

/// Abandoned, unconfirmed past the abandon deadline at `now`: the source blocks stay held.
fn stuck_at(cause: DrainCause, cancel_requested: bool, now: Time) -> PrefillRequest {
    PrefillRequest::Draining(Draining {
        common: common(),
        binding: binding(),
        cause,
        cancel_requested,
        abandoned: true,
        stuck: true,
        deadline: now + config().max_write_life,
    })
}

fn stuck_counted() -> Counters {
    counted(|c| c.stuck_writes = 1)
}

#[derive(Debug, PartialEq, Eq)]
enum Next {
    Live(PrefillRequest),
    Ended(PrefillEnded),
}

fn ended(outcome: PrefillOutcome, epoch: Option<Epoch>) -> Next {
    ended_with(common(), outcome, epoch)
}

fn ended_with(common: PrefillCommon, outcome: PrefillOutcome, epoch: Option<Epoch>) -> Next {
    Next::Ended(PrefillEnded {
        common,
        outcome,
        epoch,
    })
}

fn released(cause: ReleaseCause) -> Next {
    ended(PrefillOutcome::Released(cause), Some(EPOCH))
}

fn sent() -> Next {
    ended(PrefillOutcome::Sent, Some(EPOCH))
}

fn write_failed_to(to: &PeerAddr, epoch: Epoch, reason: WriteFailure) -> Output {
    Output::Send {
        to: to.clone(),
        message: Message::WriteFailed(WriteFailed {
            key: key(),
            epoch,
            prefill_rank: OWN_RANK,
            reason,
        }),
    }
}

fn write_failed(reason: WriteFailure) -> Output {
    write_failed_to(&d(), EPOCH, reason)
}

fn cancel_ack_to(to: &PeerAddr, epoch: Epoch) -> Output {
    Output::Send {
        to: to.clone(),
        message: Message::CancelAck(CancelAck {
            key: key(),
            epoch,
            prefill_rank: OWN_RANK,
        }),
    }
}

fn cancel_ack() -> Output {
    cancel_ack_to(&d(), EPOCH)
}

fn post(to: &PeerAddr, local: BlockIds, remote: BlockIds) -> Output {
    Output::PostWrite(Box::new(WriteOrder {
        write: WRITE,
        to: to.clone(),
        key: key(),
        epoch: EPOCH,
        local,
        remote,
        notification: Message::WriteDone(WriteDone {
            key: key(),
            epoch: EPOCH,
            prefill_rank: OWN_RANK,
            digests: Vec::new(),
        }),
        stream: None,
        remote_memory: Vec::new(),
    }))
}

fn abandon() -> Output {
    Output::AbandonWrite { write: WRITE }
}

fn no_counters() -> Counters {
    Counters::default()
}

fn dropped(reason: DropReason) -> Counters {
    let mut counters = Counters::default();
    counters.drop(reason);
    counters
}

fn counted(f: impl FnOnce(&mut Counters)) -> Counters {
    let mut counters = Counters::default();
    f(&mut counters);
    counters
}

fn posted() -> Counters {
    counted(|c| c.writes_posted = 1)
}

fn abandoned() -> Counters {
    counted(|c| c.writes_abandoned = 1)
}

fn renewed() -> Counters {
    counted(|c| c.leases_renewed = 1)
}

struct Case {
    name: &'static str,
    state: PrefillRequest,
    now: Time,
    input: PrefillInput,
    next: Next,
    outputs: Vec<Output>,
    counters: Counters,
}

fn case(
    name: &'static str,
    state: PrefillRequest,
    input: PrefillInput,
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

fn cancel(from: &PeerAddr, epoch: Epoch) -> PrefillInput {
    PrefillInput::Cancel {
        from: from.clone(),
        epoch,
    }
}

fn release(epoch: Epoch) -> PrefillInput {
    PrefillInput::Release {
        epoch,
        reason: ReleaseReason::Aborted,
    }
}

fn failed(failure: WriteFailure) -> PrefillInput {
    PrefillInput::WriteFailed { failure }
}

fn peer_dead(peer: PeerAddr) -> PrefillInput {
    PrefillInput::PeerDead { peer }
}

fn held_cases() -> Vec<Case> {
    use PrefillInput as I;
    let live = Next::Live;
    let writing_now = |to: PeerAddr, blocks: BlockIds| {
        live(PrefillRequest::Writing(Writing {
            common: common_with(blocks),
            binding: Binding {
                epoch: EPOCH,
                to,
                write: WRITE,
                trace: crate::TraceId::from_u128(0x7ace),
            },
            write_deadline: ms(NOW_MS + 1_000),
        }))
    };
    let two_groups = || BlockIds {
        groups: vec![vec![10, 11, 12], vec![20, 21]],
    };
    let held_two_groups = || {
        PrefillRequest::Held(Held {
            common: common_with(two_groups()),
            lease_until: ms(LEASE_MS),
        })
    };
    let rejected = || {
        (
            released(ReleaseCause::Rejected),
            vec![write_failed(WriteFailure::PlanMismatch)],
        )
    };
    let misfit = |name, blocks: BlockIds| {
        let (next, outputs) = rejected();
        case(
            name,
            held(),
            register_from(&d(), EPOCH, blocks),
            next,
            outputs,
            no_counters(),
        )
    };
    vec![
        case(
            "held + register, D caches a prefix: post the tail [13, 14]",
            held(),
            register(EPOCH),
            writing_now(d(), p_blocks()),
            vec![post(&d(), BlockIds::single_group(vec![13, 14]), d_blocks())],
            posted(),
        ),
        case(
            "held + register, same length: post every block",
            held(),
            register_from(&d(), EPOCH, BlockIds::single_group((500..=504).collect())),
            writing_now(d(), p_blocks()),
            vec![post(
                &d(),
                p_blocks(),
                BlockIds::single_group((500..=504).collect()),
            )],
            posted(),
        ),
        case(
            "held + register, two groups: each group tail-aligned",
            held_two_groups(),
            register_from(
                &d2(),
                EPOCH,
                BlockIds {
                    groups: vec![vec![600, 601], vec![700, 701]],
                },
            ),
            writing_now(d2(), two_groups()),
            vec![post(
                &d2(),
                BlockIds {
                    groups: vec![vec![11, 12], vec![20, 21]],
                },
                BlockIds {
                    groups: vec![vec![600, 601], vec![700, 701]],
                },
            )],
            posted(),
        ),
        misfit(
            "held + register, group count differs: rejected",
            BlockIds {
                groups: vec![vec![500], vec![600]],
            },
        ),
        misfit(
            "held + register, D lists more blocks than P has: rejected",
            BlockIds::single_group((500..=505).collect()),
        ),
        misfit(
            "held + register, D lists no block: rejected",
            BlockIds::single_group(vec![]),
        ),
        case(
            "held + heartbeat: lease pushed to now + extension",
            held(),
            I::Heartbeat,
            live(held_until(ms(3_000 + 2_000))),
            vec![],
            renewed(),
        )
        .at(ms(3_000)),
        case(
            "held + register after the lease ended, its timer not run (a stall): released, \
             WriteFailed(LeaseExpired), nothing posted",
            held(),
            register(EPOCH),
            ended(
                PrefillOutcome::Released(ReleaseCause::LeaseExpired),
                Some(EPOCH),
            ),
            vec![write_failed(WriteFailure::LeaseExpired)],
            counted(|c| c.expired_leases_refused = 1),
        )
        .at(ms(LEASE_MS)),
        case(
            "held + heartbeat after the lease ended, its timer not run: released, not renewed",
            held(),
            I::Heartbeat,
            ended(PrefillOutcome::Released(ReleaseCause::LeaseExpired), None),
            vec![],
            counted(|c| c.expired_leases_refused = 1),
        )
        .at(ms(LEASE_MS + 1)),
        case(
            "held + heartbeat: a lease is never shortened",
            held(),
            I::Heartbeat,
            live(held()),
            vec![],
            renewed(),
        ),
        case(
            "held + cancel: acknowledged at once, released",
            held(),
            cancel(&d(), EPOCH),
            released(ReleaseCause::CancelledByPeer),
            vec![cancel_ack()],
            no_counters(),
        ),
        case(
            "held + cancel from another rank and epoch: acknowledged to it",
            held(),
            cancel(&d2(), Epoch(5)),
            ended(
                PrefillOutcome::Released(ReleaseCause::CancelledByPeer),
                Some(Epoch(5)),
            ),
            vec![cancel_ack_to(&d2(), Epoch(5))],
            no_counters(),
        ),
        case(
            "held + release: released by peer",
            held(),
            PrefillInput::Release {
                epoch: EPOCH,
                reason: ReleaseReason::FullPrefixHit,
            },
            released(ReleaseCause::ReleasedByPeer(ReleaseReason::FullPrefixHit)),
            vec![],
            no_counters(),
        ),
        case(
            "held + abort: released, no epoch",
            held(),
            I::Abort,
            ended(PrefillOutcome::Released(ReleaseCause::Aborted), None),
            vec![],
            no_counters(),
        ),
        case(
            "held + write completed: unknown write",
            held(),
            I::WriteCompleted,
            live(held()),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "held + write failed: unknown write",
            held(),
            failed(WriteFailure::TransferFailed),
            live(held()),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "held + peer dead: held blocks are bound to nobody",
            held(),
            peer_dead(d()),
            live(held()),
            vec![],
            no_counters(),
        ),
        case(
            "held + timeout before lease end: waits",
            held(),
            I::Timeout,
            live(held()),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS - 1)),
        case(
            "held + timeout at lease end: lease expired",
            held(),
            I::Timeout,
            ended(PrefillOutcome::Released(ReleaseCause::LeaseExpired), None),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS)),
        case(
            "held + timeout after lease end: lease expired",
            held(),
            I::Timeout,
            ended(PrefillOutcome::Released(ReleaseCause::LeaseExpired), None),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS + 9)),
    ]
}

fn writing_cases() -> Vec<Case> {
    use DrainCause as C;
    use PrefillInput as I;
    let live = Next::Live;
    vec![
        case(
            "writing + register, same epoch: duplicate",
            writing(),
            register(EPOCH),
            live(writing()),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "writing + register, older epoch: stale",
            writing(),
            register(Epoch(1)),
            live(writing()),
            vec![],
            dropped(DropReason::StaleEpoch),
        ),
        case(
            "writing + register, newer epoch: unavailable",
            writing(),
            register(Epoch(3)),
            live(writing()),
            vec![write_failed_to(&d(), Epoch(3), WriteFailure::Unavailable)],
            dropped(DropReason::FutureEpoch),
        ),
        case(
            "writing + register, newer epoch from another rank: answered to the registrant",
            writing(),
            register_from(&d2(), Epoch(3), d_blocks()),
            live(writing()),
            vec![write_failed_to(&d2(), Epoch(3), WriteFailure::Unavailable)],
            dropped(DropReason::FutureEpoch),
        ),
        case(
            "writing + heartbeat: the write deadline bounds the hold",
            writing(),
            I::Heartbeat,
            live(writing()),
            vec![],
            no_counters(),
        ),
        case(
            "writing + cancel, same epoch: drain, the write may finish until its deadline",
            writing(),
            cancel(&d(), EPOCH),
            live(draining(C::Cancelled, true, false)),
            vec![],
            no_counters(),
        ),
        case(
            "writing + cancel, older epoch: nothing of it in flight, acknowledged",
            writing(),
            cancel(&d(), Epoch(1)),
            live(writing()),
            vec![cancel_ack_to(&d(), Epoch(1))],
            no_counters(),
        ),
        case(
            "writing + cancel, newer epoch from another rank: acknowledged to it",
            writing(),
            cancel(&d2(), Epoch(3)),
            live(writing()),
            vec![cancel_ack_to(&d2(), Epoch(3))],
            no_counters(),
        ),
        case(
            "writing + release, older epoch: stale",
            writing(),
            release(Epoch(1)),
            live(writing()),
            vec![],
            dropped(DropReason::StaleEpoch),
        ),
        case(
            "writing + release, same epoch: unexpected, the registration wins",
            writing(),
            release(EPOCH),
            live(writing()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "writing + release, newer epoch: unexpected",
            writing(),
            release(Epoch(3)),
            live(writing()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "writing + abort: drain without abandoning",
            writing(),
            I::Abort,
            live(draining(C::Aborted, false, false)),
            vec![],
            no_counters(),
        ),
        case(
            "writing + write completed: sent",
            writing(),
            I::WriteCompleted,
            sent(),
            vec![],
            no_counters(),
        ),
        case(
            "writing + write failed: D told, released",
            writing(),
            failed(WriteFailure::PostFailed),
            released(ReleaseCause::WriteFailed(WriteFailure::PostFailed)),
            vec![write_failed(WriteFailure::PostFailed)],
            no_counters(),
        ),
        case(
            "writing + bound peer dead: abandon at once",
            writing(),
            peer_dead(d()),
            live(draining_until(C::PeerDead, false, true, ms(NOW_MS + 500))),
            vec![abandon()],
            abandoned(),
        ),
        case(
            "writing + other peer dead: unchanged",
            writing(),
            peer_dead(d2()),
            live(writing()),
            vec![],
            no_counters(),
        ),
        case(
            "writing + timeout before the write deadline: waits",
            writing(),
            I::Timeout,
            live(writing()),
            vec![],
            no_counters(),
        )
        .at(ms(WRITE_DL_MS - 1)),
        case(
            "writing + timeout at the write deadline: abandon",
            writing(),
            I::Timeout,
            live(draining_until(
                C::TimedOut,
                false,
                true,
                ms(WRITE_DL_MS + 500),
            )),
            vec![abandon()],
            abandoned(),
        )
        .at(ms(WRITE_DL_MS)),
        case(
            "writing + timeout after the write deadline: abandon",
            writing_until(ms(NOW_MS - 10)),
            I::Timeout,
            live(draining_until(C::TimedOut, false, true, ms(NOW_MS + 500))),
            vec![abandon()],
            abandoned(),
        ),
    ]
}

/// The reachable `(cause, cancel_requested, abandoned)` combinations of `Draining`.
const DRAIN_FLAGS: [(DrainCause, bool, bool); 10] = [
    (DrainCause::Cancelled, true, false),
    (DrainCause::Cancelled, true, true),
    (DrainCause::Aborted, false, false),
    (DrainCause::Aborted, false, true),
    (DrainCause::Aborted, true, false),
    (DrainCause::Aborted, true, true),
    (DrainCause::PeerDead, false, true),
    (DrainCause::PeerDead, true, true),
    (DrainCause::TimedOut, false, true),
    (DrainCause::TimedOut, true, true),
];

/// The end of a drain: a completion, a failure, and a due timer, for every reachable flag
/// combination. Outputs are spelled out row by row.
fn draining_end_cases() -> Vec<Case> {
    use DrainCause as C;
    use PrefillInput as I;
    use WriteFailure as W;
    let live = Next::Live;
    let due = ms(WRITE_DL_MS);
    let abandoned_until = |cause, cr| live(draining_until(cause, cr, true, ms(WRITE_DL_MS + 500)));
    let cancelled = || released(ReleaseCause::CancelledByPeer);
    let aborted = || released(ReleaseCause::Aborted);
    let dead = || released(ReleaseCause::PeerDead);
    let timed_out = || released(ReleaseCause::WriteFailed(W::TransferTimedOut));
    let tf = || failed(W::TransferFailed);
    vec![
        // Cancelled: D gets its ack (and a WriteFailed when nothing landed).
        case(
            "draining(cancelled) + completed: ack",
            draining(C::Cancelled, true, false),
            I::WriteCompleted,
            cancelled(),
            vec![cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(cancelled, abandoned) + completed: ack",
            draining(C::Cancelled, true, true),
            I::WriteCompleted,
            cancelled(),
            vec![cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(cancelled) + failed: write failed, ack",
            draining(C::Cancelled, true, false),
            tf(),
            cancelled(),
            vec![write_failed(W::TransferFailed), cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(cancelled, abandoned) + failed: write failed, ack",
            draining(C::Cancelled, true, true),
            failed(W::PostFailed),
            cancelled(),
            vec![write_failed(W::PostFailed), cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(cancelled) + timeout at deadline: abandon",
            draining(C::Cancelled, true, false),
            I::Timeout,
            abandoned_until(C::Cancelled, true),
            vec![abandon()],
            abandoned(),
        )
        .at(due),
        case(
            "draining(cancelled, abandoned) + timeout at deadline: unconfirmed, source blocks held (stuck)",
            draining(C::Cancelled, true, true),
            I::Timeout,
            live(stuck_at(C::Cancelled, true, due)),
            vec![],
            stuck_counted(),
        )
        .at(due),
        // Aborted: P's own abort; D learns PrefillAborted unless the data landed.
        case(
            "draining(aborted) + completed: sent",
            draining(C::Aborted, false, false),
            I::WriteCompleted,
            sent(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(aborted, abandoned) + completed: sent",
            draining(C::Aborted, false, true),
            I::WriteCompleted,
            sent(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(aborted, cancel requested) + completed: sent, ack",
            draining(C::Aborted, true, false),
            I::WriteCompleted,
            sent(),
            vec![cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(aborted, cancel requested, abandoned) + completed: sent, ack",
            draining(C::Aborted, true, true),
            I::WriteCompleted,
            sent(),
            vec![cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(aborted) + failed: D told PrefillAborted",
            draining(C::Aborted, false, false),
            tf(),
            aborted(),
            vec![write_failed(W::PrefillAborted)],
            no_counters(),
        ),
        case(
            "draining(aborted, abandoned) + failed: D told PrefillAborted",
            draining(C::Aborted, false, true),
            tf(),
            aborted(),
            vec![write_failed(W::PrefillAborted)],
            no_counters(),
        ),
        case(
            "draining(aborted, cancel requested) + failed: PrefillAborted, ack",
            draining(C::Aborted, true, false),
            tf(),
            aborted(),
            vec![write_failed(W::PrefillAborted), cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(aborted, cancel requested, abandoned) + failed: PrefillAborted, ack",
            draining(C::Aborted, true, true),
            tf(),
            aborted(),
            vec![write_failed(W::PrefillAborted), cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(aborted) + timeout at deadline: abandon",
            draining(C::Aborted, false, false),
            I::Timeout,
            abandoned_until(C::Aborted, false),
            vec![abandon()],
            abandoned(),
        )
        .at(due),
        case(
            "draining(aborted, cancel requested) + timeout at deadline: abandon",
            draining(C::Aborted, true, false),
            I::Timeout,
            abandoned_until(C::Aborted, true),
            vec![abandon()],
            abandoned(),
        )
        .at(due),
        case(
            "draining(aborted, abandoned) + timeout at deadline: unconfirmed, source blocks held (stuck)",
            draining(C::Aborted, false, true),
            I::Timeout,
            live(stuck_at(C::Aborted, false, due)),
            vec![],
            stuck_counted(),
        )
        .at(due),
        case(
            "draining(aborted, cancel requested, abandoned) + timeout after deadline: unconfirmed, source blocks held (stuck)",
            draining(C::Aborted, true, true),
            I::Timeout,
            live(stuck_at(C::Aborted, true, ms(WRITE_DL_MS + 3))),
            vec![],
            stuck_counted(),
        )
        .at(ms(WRITE_DL_MS + 3)),
        // PeerDead: nothing is sent to a dead peer.
        case(
            "draining(peer dead) + completed: sent, silent",
            draining(C::PeerDead, false, true),
            I::WriteCompleted,
            sent(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(peer dead, cancel requested) + completed: sent, no ack to the dead",
            draining(C::PeerDead, true, true),
            I::WriteCompleted,
            sent(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(peer dead) + failed: released, silent",
            draining(C::PeerDead, false, true),
            tf(),
            dead(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(peer dead, cancel requested) + failed: released, silent",
            draining(C::PeerDead, true, true),
            tf(),
            dead(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(peer dead) + timeout at deadline: unconfirmed, source blocks held (stuck)",
            draining(C::PeerDead, false, true),
            I::Timeout,
            live(stuck_at(C::PeerDead, false, due)),
            vec![],
            stuck_counted(),
        )
        .at(due),
        case(
            "draining(peer dead, cancel requested) + timeout at deadline: unconfirmed, source blocks held (stuck)",
            draining(C::PeerDead, true, true),
            I::Timeout,
            live(stuck_at(C::PeerDead, true, due)),
            vec![],
            stuck_counted(),
        )
        .at(due),
        // TimedOut: D learns TransferTimedOut unless the data landed.
        case(
            "draining(timed out) + completed: sent",
            draining(C::TimedOut, false, true),
            I::WriteCompleted,
            sent(),
            vec![],
            no_counters(),
        ),
        case(
            "draining(timed out, cancel requested) + completed: sent, ack",
            draining(C::TimedOut, true, true),
            I::WriteCompleted,
            sent(),
            vec![cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(timed out) + failed: D told TransferTimedOut",
            draining(C::TimedOut, false, true),
            tf(),
            timed_out(),
            vec![write_failed(W::TransferTimedOut)],
            no_counters(),
        ),
        case(
            "draining(timed out, cancel requested) + failed: TransferTimedOut, ack",
            draining(C::TimedOut, true, true),
            tf(),
            timed_out(),
            vec![write_failed(W::TransferTimedOut), cancel_ack()],
            no_counters(),
        ),
        case(
            "draining(timed out) + timeout at deadline: unconfirmed, source blocks held (stuck)",
            draining(C::TimedOut, false, true),
            I::Timeout,
            live(stuck_at(C::TimedOut, false, due)),
            vec![],
            stuck_counted(),
        )
        .at(due),
        case(
            "draining(timed out, cancel requested) + timeout at deadline: unconfirmed, source blocks held (stuck)",
            draining(C::TimedOut, true, true),
            I::Timeout,
            live(stuck_at(C::TimedOut, true, due)),
            vec![],
            stuck_counted(),
        )
        .at(due),
    ]
}

/// Every other input of `Draining`, for every cause.
fn draining_other_cases() -> Vec<Case> {
    use DrainCause as C;
    use PrefillInput as I;
    let live = Next::Live;
    let same = |s: &PrefillRequest| live(s.clone());
    let mut cases = Vec::new();
    // (cause, cancel_requested, abandoned) of the fixture per cause.
    let fixtures = [
        (C::Cancelled, true, false),
        (C::Aborted, false, false),
        (C::PeerDead, false, true),
        (C::TimedOut, false, true),
    ];
    for (cause, cr, ab) in fixtures {
        let s = draining(cause, cr, ab);
        cases.extend([
            case(
                "draining + register, same epoch: duplicate",
                s.clone(),
                register(EPOCH),
                same(&s),
                vec![],
                dropped(DropReason::Duplicate),
            ),
            case(
                "draining + register, older epoch: stale",
                s.clone(),
                register(Epoch(1)),
                same(&s),
                vec![],
                dropped(DropReason::StaleEpoch),
            ),
            case(
                "draining + register, newer epoch from another rank: unavailable to it",
                s.clone(),
                register_from(&d2(), Epoch(3), d_blocks()),
                same(&s),
                vec![write_failed_to(&d2(), Epoch(3), WriteFailure::Unavailable)],
                dropped(DropReason::FutureEpoch),
            ),
            case(
                "draining + heartbeat: unchanged",
                s.clone(),
                I::Heartbeat,
                same(&s),
                vec![],
                no_counters(),
            ),
            case(
                "draining + cancel, same epoch: ack owed after the drain",
                s.clone(),
                cancel(&d(), EPOCH),
                live(draining(cause, true, ab)),
                vec![],
                no_counters(),
            ),
            case(
                "draining + cancel, other epoch: acknowledged at once",
                s.clone(),
                cancel(&d2(), Epoch(1)),
                same(&s),
                vec![cancel_ack_to(&d2(), Epoch(1))],
                no_counters(),
            ),
            case(
                "draining + release, older epoch: stale",
                s.clone(),
                release(Epoch(1)),
                same(&s),
                vec![],
                dropped(DropReason::StaleEpoch),
            ),
            case(
                "draining + release, same epoch: unexpected",
                s.clone(),
                release(EPOCH),
                same(&s),
                vec![],
                dropped(DropReason::Unexpected),
            ),
            case(
                "draining + abort: already draining",
                s.clone(),
                I::Abort,
                same(&s),
                vec![],
                no_counters(),
            ),
            case(
                "draining + other peer dead: unchanged",
                s.clone(),
                peer_dead(stranger()),
                same(&s),
                vec![],
                no_counters(),
            ),
            case(
                "draining + timeout before deadline: waits",
                s.clone(),
                I::Timeout,
                same(&s),
                vec![],
                no_counters(),
            )
            .at(ms(WRITE_DL_MS - 1)),
        ]);
        // The bound peer dies: the cause becomes PeerDead; abandon unless already abandoned.
        let dead = if ab {
            case(
                "draining(abandoned) + bound peer dead: cause PeerDead, deadline kept",
                s.clone(),
                peer_dead(d()),
                live(draining(C::PeerDead, cr, true)),
                vec![],
                no_counters(),
            )
        } else {
            case(
                "draining + bound peer dead: abandon now",
                s.clone(),
                peer_dead(d()),
                live(draining_until(C::PeerDead, cr, true, ms(NOW_MS + 500))),
                vec![abandon()],
                abandoned(),
            )
        };
        cases.push(dead);
    }
    cases.push(case(
        "draining(aborted, cancel requested) + cancel again: still one ack owed",
        draining(C::Aborted, true, false),
        cancel(&d(), EPOCH),
        live(draining(C::Aborted, true, false)),
        vec![],
        no_counters(),
    ));
    cases
}

fn cases() -> Vec<Case> {
    let mut cases = held_cases();
    cases.extend(writing_cases());
    cases.extend(draining_end_cases());
    cases.extend(draining_other_cases());
    cases
}

// Adding a state, a drain cause or an input breaks one of these matches: add its name to the
// list beside it, and the coverage test below then demands its cases.
const STATES: [&str; 6] = [
    "Held",
    "Writing",
    "Draining/Cancelled",
    "Draining/Aborted",
    "Draining/PeerDead",
    "Draining/TimedOut",
];
const INPUTS: [&str; 9] = [
    "Registered",
    "Heartbeat",
    "Cancel",
    "Release",
    "Abort",
    "WriteCompleted",
    "WriteFailed",
    "PeerDead",
    "Timeout",
];

fn state_name(state: &PrefillRequest) -> &'static str {
    match state {
        PrefillRequest::Held(_) => "Held",
        PrefillRequest::Writing(_) => "Writing",
        PrefillRequest::Draining(s) => match s.cause {
            DrainCause::Cancelled => "Draining/Cancelled",
            DrainCause::Aborted => "Draining/Aborted",
            DrainCause::PeerDead => "Draining/PeerDead",
            DrainCause::TimedOut => "Draining/TimedOut",
        },
    }
}

fn input_name(input: &PrefillInput) -> &'static str {
    match input {
        PrefillInput::Registered { .. } => "Registered",
        PrefillInput::Heartbeat => "Heartbeat",
        PrefillInput::LayersReady { .. } => "LayersReady",
        PrefillInput::Cancel { .. } => "Cancel",
        PrefillInput::Release { .. } => "Release",
        PrefillInput::Abort => "Abort",
        PrefillInput::WriteCompleted => "WriteCompleted",
        PrefillInput::WriteFailed { .. } => "WriteFailed",
        PrefillInput::PeerDead { .. } => "PeerDead",
        PrefillInput::Timeout => "Timeout",
    }
}

fn step(state: PrefillRequest, now: Time, input: PrefillInput) -> (Next, Vec<Output>, Counters) {
    let config = config();
    let ctx = PrefillCtx {
        now,
        own_rank: OWN_RANK,
        config: &config,
        next_write: WRITE,
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
    for (i, case) in cases().into_iter().enumerate() {
        let name = format!("#{i} {} [{}]", case.name, state_name(&case.state));
        let before = case.state.write();
        let (next, outputs, counters) = step(case.state, case.now, case.input);
        assert_eq!(next, case.next, "case `{name}`: next state");
        assert_eq!(outputs, case.outputs, "case `{name}`: outputs");
        assert_eq!(counters, case.counters, "case `{name}`: counters");
        match &next {
            // A live request keeps its write (at most one per request).
            Next::Live(live) => {
                if before.is_some() {
                    assert_eq!(live.write(), before, "case `{name}`: the write is kept");
                }
            }
            // A request may end while its write can still read the blocks only if the write
            // is known to be over: no ended case leaves an abandon unconfirmed.
            Next::Ended(_) => assert!(
                !outputs
                    .iter()
                    .any(|o| matches!(o, Output::AbandonWrite { .. } | Output::PostWrite(_))),
                "case `{name}`: ends with no write in flight"
            ),
        }
    }
}

#[test]
fn table_covers_every_state_input_pair() {
    let cases = cases();
    let covered: BTreeSet<(&str, &str)> = cases
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

    // Every reachable drain flag combination meets a completion, a failure and a due timer.
    let ends: Vec<(DrainCause, bool, bool, &str)> = cases
        .iter()
        .filter_map(|c| match &c.state {
            PrefillRequest::Draining(s) => {
                let due = !matches!(c.input, PrefillInput::Timeout) || c.now >= s.deadline;
                let input = input_name(&c.input);
                due.then_some((s.cause, s.cancel_requested, s.abandoned, input))
            }
            PrefillRequest::Held(_) | PrefillRequest::Writing(_) => None,
        })
        .collect();
    for (cause, cr, ab) in DRAIN_FLAGS {
        for input in ["WriteCompleted", "WriteFailed", "Timeout"] {
            assert!(
                ends.contains(&(cause, cr, ab, input)),
                "no case for draining({cause:?}, cancel_requested {cr}, abandoned {ab}) + {input}"
            );
        }
    }
}

#[test]
fn timers_and_writes_per_state() {
    let table = [
        (held(), ms(LEASE_MS), None),
        (writing(), ms(WRITE_DL_MS), Some(WRITE)),
        (
            draining_until(DrainCause::Aborted, false, false, ms(77)),
            ms(77),
            Some(WRITE),
        ),
    ];
    for (state, timer, write) in table {
        assert_eq!(state.next_timer(&config()), timer, "{state:?}");
        assert_eq!(state.write(), write, "{state:?}");
        assert_eq!(state.common(), &common());
    }
    let config = config();
    assert_eq!(
        PrefillRequest::held(common(), ms(NOW_MS), &config),
        held_until(ms(NOW_MS) + config.lease_duration)
    );
}

#[test]
#[should_panic(expected = "ends at once")]
fn held_needs_blocks() {
    let _ = PrefillRequest::held(common_with(BlockIds::default()), ms(0), &config());
}

#[test]
fn pair_blocks_is_tail_aligned() {
    let one = BlockIds::single_group;
    let groups = |g: Vec<Vec<u32>>| BlockIds { groups: g };
    // (P's blocks, D's blocks, what P sends)
    let table = [
        (
            one((10..=14).collect()),
            one(vec![500, 501]),
            Some(one(vec![13, 14])),
        ),
        (
            one((10..=14).collect()),
            one((500..=504).collect()),
            Some(one((10..=14).collect())),
        ),
        (one(vec![10]), one(vec![500]), Some(one(vec![10]))),
        (
            groups(vec![vec![10, 11, 12], vec![20, 21]]),
            groups(vec![vec![600], vec![700, 701]]),
            Some(groups(vec![vec![12], vec![20, 21]])),
        ),
        // A group D already holds entirely: nothing of it is sent.
        (
            groups(vec![vec![10, 11], vec![20, 21]]),
            groups(vec![vec![600], vec![]]),
            Some(groups(vec![vec![11], vec![]])),
        ),
        // D lists more blocks than P has.
        (one(vec![10, 11]), one(vec![500, 501, 502]), None),
        (
            groups(vec![vec![10, 11], vec![20]]),
            groups(vec![vec![600], vec![700, 701]]),
            None,
        ),
        // Group counts differ.
        (one(vec![10, 11]), groups(vec![vec![500], vec![600]]), None),
        (groups(vec![vec![10], vec![20]]), one(vec![500]), None),
        // D lists nothing (a full hit is a Release, not a Register).
        (one(vec![10, 11]), one(vec![]), None),
        (
            groups(vec![vec![10], vec![20]]),
            groups(vec![vec![], vec![]]),
            None,
        ),
    ];
    for (local, remote, expected) in table {
        let paired = pair_blocks(&local, &remote, BlockPairing::TailAligned);
        assert_eq!(paired, expected, "pair_blocks({local:?}, {remote:?})");
        if let Some(paired) = paired {
            let lens = |b: &BlockIds| b.groups.iter().map(Vec::len).collect::<Vec<_>>();
            assert_eq!(
                lens(&paired),
                lens(&remote),
                "one local block per remote block"
            );
        }
        // A heterogeneous pair's plan aligns the lists by tokens: P hands its whole list,
        // whatever D's count (more blocks than P's too), and still refuses what no plan pairs.
        let as_given = pair_blocks(&local, &remote, BlockPairing::AsGiven);
        let pairable = local.groups.len() == remote.groups.len() && !remote.is_empty();
        assert_eq!(
            as_given,
            pairable.then(|| local.clone()),
            "as given: {local:?}, {remote:?}"
        );
    }
}

/// Without the lease check (the deliberate bug `write_on_expired_lease`), a registration that
/// reaches held blocks after their lease ended — the timer not run, a stalled process — is
/// written; the table case above shows the check refuses it.
#[cfg(feature = "mutations")]
#[test]
fn a_lapsed_lease_is_written_under_its_mutation() {
    let config = config();
    let ctx = PrefillCtx {
        now: ms(LEASE_MS),
        own_rank: OWN_RANK,
        config: &config,
        next_write: WRITE,
        mutation: crate::machine::ActiveMutation(Some(
            crate::machine::Mutation::WriteOnExpiredLease,
        )),
    };
    let mut fx = Outbox::default();
    let next = held().handle(&ctx, register(EPOCH), &mut fx);
    assert!(matches!(next, Step::Live(PrefillRequest::Writing(_))));
    assert!(fx.out.iter().any(|o| matches!(o, Output::PostWrite(_))));
}
