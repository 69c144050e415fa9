//! Table-driven tests of `PrefillTable`: every state a key can be in on P (unknown, pending
//! registration, held, writing, draining, and each tombstone kind) × every input of the table,
//! with the exact result, outputs, counters and the key's next state.

use std::collections::BTreeSet;

use crate::{
    BlockIds, CancelAck, EngineId, Epoch, LeaseRef, Message, PairingKey, Register, ReleaseReason,
    RequestId, WriteDone, WriteFailed, WriteFailure,
};

use super::tombstones::tombstone_for;
use super::{PendingRegistration, PrefillTable, PrefillTombstone};
use crate::machine::effects::Outbox;
use crate::machine::prefill::{
    Binding, DrainCause, Draining, Held, PrefillCommon, PrefillRequest, Writing,
};
use crate::machine::types::{
    Counters, DropReason, EndpointEvent, Output, PrefillOutcome, PrefillStart, Rejected,
    ReleaseCause, Time, WriteOrder,
};
use crate::machine::Config;
use crate::{PeerAddr, WriteId};

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

/// When the fixtures are set up.
const T0_MS: u64 = 1_000;
/// When every case's input happens unless it says otherwise.
const NOW_MS: u64 = 1_010;
/// Fixture deadlines (fast config, set up at T0): lease, write, registration and tombstone.
const LEASE_MS: u64 = T0_MS + 3_000;
const WRITE_DL_MS: u64 = T0_MS + 1_000;
const PENDING_MS: u64 = T0_MS + 5_000;
const TOMB_MS: u64 = T0_MS + 5_000;
const RANK: u32 = 0;
const EPOCH: Epoch = Epoch(2);
/// The first write a writer posts.
const W1: WriteId = WriteId(1);

fn config() -> Config {
    // lease 3000, extension 2000, registration_ttl 5000, write_timeout 1000, abandon 500,
    // tombstone_ttl 5000 (ms).
    Config::fast()
}

fn d() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 3)
}

fn d2() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 4)
}

fn key() -> PairingKey {
    PairingKey::new("key-1").unwrap()
}

fn other_key() -> PairingKey {
    PairingKey::new("key-2").unwrap()
}

fn req() -> RequestId {
    RequestId::new("req-p").unwrap()
}

fn p_blocks() -> BlockIds {
    BlockIds::single_group((10..=14).collect())
}

fn d_blocks() -> BlockIds {
    BlockIds::single_group(vec![500, 501])
}

fn registration(from: &PeerAddr, epoch: Epoch) -> Box<Register> {
    Box::new(Register {
        key: key(),
        epoch,
        decode_engine: from.engine.clone(),
        decode_request: RequestId::new("req-d").unwrap(),
        decode_rank: from.rank,
        blocks: d_blocks(),
        num_tokens: 40,
        trace_id: crate::TraceId::from_u128(0x7ace),
        memory: Vec::new(),
    })
}

fn start_with(request: RequestId, blocks: BlockIds) -> PrefillStart {
    PrefillStart {
        request,
        key: key(),
        blocks,
    }
}

fn start() -> PrefillStart {
    start_with(req(), p_blocks())
}

// ---- Inputs

#[derive(Debug, Clone)]
enum WInput {
    Register(PeerAddr, Box<Register>),
    Cancel(PeerAddr, Epoch),
    Release(Epoch, ReleaseReason),
    Heartbeat(Vec<PairingKey>),
    Finished(PrefillStart),
    Abort(RequestId),
    WriteCompleted(WriteId),
    WriteFailed(WriteId, WriteFailure),
    PeerDead(PeerAddr),
    Timeout,
}

fn register(epoch: Epoch) -> WInput {
    WInput::Register(d(), registration(&d(), epoch))
}

fn cancel(epoch: Epoch) -> WInput {
    WInput::Cancel(d(), epoch)
}

fn apply(w: &mut PrefillTable, now: Time, input: WInput, fx: &mut Outbox) -> Result<(), Rejected> {
    match input {
        WInput::Register(from, register) => w.on_register(now, from, register, fx),
        WInput::Cancel(from, epoch) => w.on_cancel(now, from, key(), epoch, fx),
        WInput::Release(epoch, reason) => w.on_release(now, d(), key(), epoch, reason, fx),
        WInput::Heartbeat(keys) => {
            let leases = keys
                .into_iter()
                .map(|key| LeaseRef { key, epoch: EPOCH })
                .collect();
            w.on_heartbeat(now, &d(), leases, fx);
        }
        WInput::Finished(start) => return w.finished(now, start, fx),
        WInput::Abort(request) => return w.abort(now, &request, fx),
        WInput::WriteCompleted(write) => w.on_write_result(now, write, None, fx),
        WInput::WriteFailed(write, failure) => w.on_write_result(now, write, Some(failure), fx),
        WInput::PeerDead(peer) => w.on_peer_dead(now, &peer, fx),
        WInput::Timeout => w.on_timeout(now, fx),
    }
    Ok(())
}

// ---- Fixtures: a writer with `key()` in a given state, set up at T0.

fn setup(config: Config, inputs: Vec<WInput>) -> PrefillTable {
    let mut w = PrefillTable::new(RANK, &config);
    drive(&mut w, ms(T0_MS), inputs);
    w
}

fn unknown() -> PrefillTable {
    setup(config(), vec![])
}

fn pending() -> PrefillTable {
    setup(config(), vec![register(EPOCH)])
}

fn held() -> PrefillTable {
    setup(config(), vec![WInput::Finished(start())])
}

fn writing() -> PrefillTable {
    setup(config(), vec![WInput::Finished(start()), register(EPOCH)])
}

fn draining() -> PrefillTable {
    setup(
        config(),
        vec![WInput::Finished(start()), register(EPOCH), cancel(EPOCH)],
    )
}

fn tomb_cancelled() -> PrefillTable {
    setup(config(), vec![cancel(EPOCH)])
}

fn tomb_released() -> PrefillTable {
    setup(
        config(),
        vec![WInput::Release(EPOCH, ReleaseReason::Aborted)],
    )
}

/// P aborted while it held the blocks: an `Ended` tombstone bound to no epoch.
fn tomb_aborted() -> PrefillTable {
    setup(
        config(),
        vec![WInput::Finished(start()), WInput::Abort(req())],
    )
}

/// D's registration for EPOCH waited in the pending table past its TTL: P answered it
/// `RegistrationExpired` and remembers that (set up at `PENDING_MS`, not T0).
fn tomb_answered() -> PrefillTable {
    let mut w = setup(config(), vec![register(EPOCH)]);
    let mut fx = Outbox::default();
    w.on_timeout(ms(PENDING_MS), &mut fx);
    w.check_invariants();
    w
}

/// P's write for EPOCH completed: an `Ended` tombstone that swallows that epoch's registrations.
fn tomb_sent() -> PrefillTable {
    setup(
        config(),
        vec![
            WInput::Finished(start()),
            register(EPOCH),
            WInput::WriteCompleted(W1),
        ],
    )
}

/// P's write for EPOCH failed: an `Ended` tombstone that replays the failure to that epoch.
fn tomb_failed() -> PrefillTable {
    setup(
        config(),
        vec![
            WInput::Finished(start()),
            register(EPOCH),
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
        ],
    )
}

// ---- Expected key states

#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct KeyState {
    request: Option<PrefillRequest>,
    pending: Option<PendingRegistration>,
    tombstone: Option<PrefillTombstone>,
}

fn snapshot(w: &PrefillTable) -> KeyState {
    KeyState {
        request: w.requests.get(&key()).cloned(),
        pending: w.pending.get(&key()).cloned(),
        tombstone: w.tombstone(&key()),
    }
}

fn nothing() -> KeyState {
    KeyState::default()
}

fn is_pending(from: PeerAddr, epoch: Epoch, expires: Time) -> KeyState {
    KeyState {
        pending: Some(PendingRegistration {
            register: registration(&from, epoch),
            from: from.into(),
            expires,
        }),
        ..KeyState::default()
    }
}

fn gave_up(epoch: Epoch, cause: ReleaseCause) -> PrefillTombstone {
    PrefillTombstone::GaveUpEarly { epoch, cause }
}

fn ended_tomb(
    epoch: Option<Epoch>,
    replay: Option<WriteFailure>,
    newer: WriteFailure,
) -> PrefillTombstone {
    PrefillTombstone::Ended {
        epoch,
        replay,
        newer,
    }
}

/// What an attempt that was served, or cancelled, or released after P finished leaves: a
/// registration for it (or an older one) is swallowed, a newer one is told `Unavailable`.
fn settled(epoch: Epoch) -> PrefillTombstone {
    ended_tomb(Some(epoch), None, WriteFailure::Unavailable)
}

/// What an unmatched request that ended on P's side leaves: every registration is told why.
fn unbound(failure: WriteFailure) -> PrefillTombstone {
    ended_tomb(None, Some(failure), failure)
}

/// What a registration P answered without ever binding blocks leaves: copies of it get the same
/// answer; newer ones are served.
fn answered(epoch: Epoch, replay: WriteFailure) -> PrefillTombstone {
    PrefillTombstone::Answered { epoch, replay }
}

fn tomb(tombstone: PrefillTombstone) -> KeyState {
    KeyState {
        tombstone: Some(tombstone),
        ..KeyState::default()
    }
}

fn live(request: PrefillRequest) -> KeyState {
    KeyState {
        request: Some(request),
        ..KeyState::default()
    }
}

fn common() -> PrefillCommon {
    PrefillCommon {
        request: req(),
        key: key(),
        blocks: p_blocks(),
        producing: None,
    }
}

fn is_held(lease_until: Time) -> KeyState {
    live(PrefillRequest::Held(Held {
        common: common(),
        lease_until,
    }))
}

fn binding(epoch: Epoch) -> Binding {
    Binding {
        epoch,
        to: d(),
        write: W1,
        trace: crate::TraceId::from_u128(0x7ace),
    }
}

fn is_writing(epoch: Epoch, write_deadline: Time) -> KeyState {
    live(PrefillRequest::Writing(Writing {
        common: common(),
        binding: binding(epoch),
        write_deadline,
    }))
}

fn is_draining(
    cause: DrainCause,
    cancel_requested: bool,
    abandoned: bool,
    deadline: Time,
) -> KeyState {
    live(PrefillRequest::Draining(Draining {
        common: common(),
        binding: binding(EPOCH),
        cause,
        cancel_requested,
        abandoned,
        stuck: false,
        deadline,
    }))
}

// ---- Expected outputs

fn event(outcome: PrefillOutcome) -> Output {
    event_with(outcome, p_blocks())
}

fn event_with(outcome: PrefillOutcome, blocks: BlockIds) -> Output {
    Output::Event(EndpointEvent::Prefill {
        request: req(),
        key: key(),
        outcome,
        blocks,
    })
}

fn released(cause: ReleaseCause) -> Output {
    event(PrefillOutcome::Released(cause))
}

fn write_failed_to(to: &PeerAddr, epoch: Epoch, reason: WriteFailure) -> Output {
    Output::Send {
        to: to.clone(),
        message: Message::WriteFailed(WriteFailed {
            key: key(),
            epoch,
            prefill_rank: RANK,
            reason,
        }),
    }
}

fn write_failed(epoch: Epoch, reason: WriteFailure) -> Output {
    write_failed_to(&d(), epoch, reason)
}

fn ack_to(to: &PeerAddr, epoch: Epoch) -> Output {
    Output::Send {
        to: to.clone(),
        message: Message::CancelAck(CancelAck {
            key: key(),
            epoch,
            prefill_rank: RANK,
        }),
    }
}

fn ack(epoch: Epoch) -> Output {
    ack_to(&d(), epoch)
}

fn post(epoch: Epoch) -> Output {
    Output::PostWrite(Box::new(WriteOrder {
        write: W1,
        to: d(),
        key: key(),
        epoch,
        local: BlockIds::single_group(vec![13, 14]),
        remote: d_blocks(),
        notification: Message::WriteDone(WriteDone {
            key: key(),
            epoch,
            prefill_rank: RANK,
            digests: Vec::new(),
        }),
        stream: None,
        remote_memory: Vec::new(),
    }))
}

fn none() -> Counters {
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

// ---- The table

struct Case {
    name: &'static str,
    build: fn() -> PrefillTable,
    now: Time,
    input: WInput,
    result: Result<(), Rejected>,
    next: KeyState,
    outputs: Vec<Output>,
    counters: Counters,
}

fn case(
    name: &'static str,
    build: fn() -> PrefillTable,
    input: WInput,
    next: KeyState,
    outputs: Vec<Output>,
    counters: Counters,
) -> Case {
    Case {
        name,
        build,
        now: ms(NOW_MS),
        input,
        result: Ok(()),
        next,
        outputs,
        counters,
    }
}

impl Case {
    fn at(self, now: Time) -> Case {
        Case { now, ..self }
    }

    fn refused(self, rejected: Rejected) -> Case {
        Case {
            result: Err(rejected),
            ..self
        }
    }
}

fn unknown_cases() -> Vec<Case> {
    vec![
        case(
            "unknown + register: pending until the registration ttl",
            unknown,
            register(EPOCH),
            is_pending(d(), EPOCH, ms(NOW_MS + 5_000)),
            vec![],
            none(),
        ),
        case(
            "unknown + register naming another rank than its sender: unexpected",
            unknown,
            WInput::Register(d2(), registration(&d(), EPOCH)),
            nothing(),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "unknown + register, pending table full: unavailable",
            || {
                let config = Config {
                    max_pending_registrations: 1,
                    ..config()
                };
                let mut other = registration(&d(), EPOCH);
                other.key = other_key();
                setup(config, vec![WInput::Register(d(), other)])
            },
            register(EPOCH),
            tomb(answered(EPOCH, WriteFailure::Unavailable)),
            vec![write_failed(EPOCH, WriteFailure::Unavailable)],
            dropped(DropReason::TableFull),
        ),
        case(
            "unknown + cancel: remembered and acknowledged",
            unknown,
            cancel(EPOCH),
            tomb(gave_up(EPOCH, ReleaseCause::CancelledByPeer)),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "unknown + release: remembered",
            unknown,
            WInput::Release(EPOCH, ReleaseReason::FullPrefixHit),
            tomb(gave_up(
                EPOCH,
                ReleaseCause::ReleasedByPeer(ReleaseReason::FullPrefixHit),
            )),
            vec![],
            none(),
        ),
        case(
            "unknown + heartbeat: nothing to renew",
            unknown,
            WInput::Heartbeat(vec![key()]),
            nothing(),
            vec![],
            none(),
        ),
        case(
            "unknown + finished: held under a lease",
            unknown,
            WInput::Finished(start()),
            is_held(ms(NOW_MS + 3_000)),
            vec![],
            none(),
        ),
        case(
            "unknown + finished with no blocks: ends at once",
            unknown,
            WInput::Finished(start_with(req(), BlockIds::single_group(vec![]))),
            tomb(ended_tomb(None, None, WriteFailure::Unavailable)),
            vec![event_with(
                PrefillOutcome::Released(ReleaseCause::Empty),
                BlockIds::single_group(vec![]),
            )],
            none(),
        ),
        case(
            "unknown + finished, request table full: refused",
            || {
                let config = Config {
                    max_requests: 1,
                    ..config()
                };
                let mut other = start_with(RequestId::new("req-other").unwrap(), p_blocks());
                other.key = other_key();
                setup(config, vec![WInput::Finished(other)])
            },
            WInput::Finished(start()),
            nothing(),
            vec![],
            none(),
        )
        .refused(Rejected::TableFull {
            table: "prefill requests",
            limit: 1,
        }),
        case(
            "unknown + abort: unknown request",
            unknown,
            WInput::Abort(req()),
            nothing(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "unknown + write completed: unknown write",
            unknown,
            WInput::WriteCompleted(W1),
            nothing(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "unknown + write failed: unknown write",
            unknown,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            nothing(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "unknown + peer dead: nothing",
            unknown,
            WInput::PeerDead(d()),
            nothing(),
            vec![],
            none(),
        ),
        case(
            "unknown + timeout: nothing",
            unknown,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS + 1)),
    ]
}

fn pending_cases() -> Vec<Case> {
    let pending_at_t0 = || is_pending(d(), EPOCH, ms(PENDING_MS));
    vec![
        case(
            "pending + register, same epoch: duplicate",
            pending,
            register(EPOCH),
            pending_at_t0(),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "pending + register, older epoch: stale",
            pending,
            register(Epoch(1)),
            pending_at_t0(),
            vec![],
            dropped(DropReason::StaleEpoch),
        ),
        case(
            "pending + register, newer epoch: replaces the pending one",
            pending,
            register(Epoch(3)),
            is_pending(d(), Epoch(3), ms(NOW_MS + 5_000)),
            vec![],
            none(),
        ),
        case(
            "pending + cancel of its epoch: forgotten, remembered as cancelled, acknowledged",
            pending,
            cancel(EPOCH),
            tomb(gave_up(EPOCH, ReleaseCause::CancelledByPeer)),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "pending + cancel of an older epoch: the registration stays",
            pending,
            cancel(Epoch(1)),
            KeyState {
                tombstone: Some(gave_up(Epoch(1), ReleaseCause::CancelledByPeer)),
                ..pending_at_t0()
            },
            vec![ack(Epoch(1))],
            none(),
        ),
        case(
            "pending + release: remembered next to the registration",
            pending,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            KeyState {
                tombstone: Some(gave_up(
                    EPOCH,
                    ReleaseCause::ReleasedByPeer(ReleaseReason::Aborted),
                )),
                ..pending_at_t0()
            },
            vec![],
            none(),
        ),
        case(
            "pending + heartbeat: registration ttl renewed",
            pending,
            WInput::Heartbeat(vec![key(), other_key()]),
            is_pending(d(), EPOCH, ms(NOW_MS + 5_000)),
            vec![],
            counted(|c| c.leases_renewed = 1),
        ),
        case(
            "pending + finished: D registered first, write posted",
            pending,
            WInput::Finished(start()),
            is_writing(EPOCH, ms(NOW_MS + 1_000)),
            vec![post(EPOCH)],
            counted(|c| {
                c.decode_registered_first = 1;
                c.writes_posted = 1;
            }),
        ),
        case(
            "pending + finished with fewer blocks than D lists: rejected",
            pending,
            WInput::Finished(start_with(req(), BlockIds::single_group(vec![10]))),
            tomb(ended_tomb(
                Some(EPOCH),
                Some(WriteFailure::PlanMismatch),
                WriteFailure::Unavailable,
            )),
            vec![
                write_failed(EPOCH, WriteFailure::PlanMismatch),
                event_with(
                    PrefillOutcome::Released(ReleaseCause::Rejected),
                    BlockIds::single_group(vec![10]),
                ),
            ],
            counted(|c| c.decode_registered_first = 1),
        ),
        case(
            "pending + finished with no blocks: ends, D told unavailable, and the answer remembered",
            pending,
            WInput::Finished(start_with(req(), BlockIds::single_group(vec![]))),
            // The Empty outcome's tombstone has no epoch: the answer to EPOCH replaces it.
            tomb(answered(EPOCH, WriteFailure::Unavailable)),
            vec![
                event_with(
                    PrefillOutcome::Released(ReleaseCause::Empty),
                    BlockIds::single_group(vec![]),
                ),
                write_failed(EPOCH, WriteFailure::Unavailable),
            ],
            none(),
        ),
        case(
            "pending + abort: P has no such request yet",
            pending,
            WInput::Abort(req()),
            pending_at_t0(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "pending + write completed: unknown write",
            pending,
            WInput::WriteCompleted(W1),
            pending_at_t0(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "pending + write failed: unknown write",
            pending,
            WInput::WriteFailed(W1, WriteFailure::PostFailed),
            pending_at_t0(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "pending + registrant dead: forgotten, blocks that finish later are released at once",
            pending,
            WInput::PeerDead(d()),
            tomb(gave_up(EPOCH, ReleaseCause::PeerDead)),
            vec![],
            none(),
        ),
        case(
            "pending + other peer dead: kept",
            pending,
            WInput::PeerDead(d2()),
            pending_at_t0(),
            vec![],
            none(),
        ),
        case(
            "pending + timeout before expiry: kept",
            pending,
            WInput::Timeout,
            pending_at_t0(),
            vec![],
            none(),
        )
        .at(ms(PENDING_MS - 1)),
        case(
            "pending + timeout at expiry: D told the registration expired, and it is remembered",
            pending,
            WInput::Timeout,
            tomb(answered(EPOCH, WriteFailure::RegistrationExpired)),
            vec![write_failed(EPOCH, WriteFailure::RegistrationExpired)],
            none(),
        )
        .at(ms(PENDING_MS)),
    ]
}

fn held_cases() -> Vec<Case> {
    let held_t0 = || is_held(ms(LEASE_MS));
    vec![
        case(
            "held + register: P finished first, write posted",
            held,
            register(EPOCH),
            is_writing(EPOCH, ms(NOW_MS + 1_000)),
            vec![post(EPOCH)],
            counted(|c| {
                c.prefill_finished_first = 1;
                c.writes_posted = 1;
            }),
        ),
        case(
            "held + register that does not fit: rejected",
            held,
            WInput::Register(d(), {
                let mut r = registration(&d(), EPOCH);
                r.blocks = BlockIds::single_group((500..=505).collect());
                r
            }),
            tomb(ended_tomb(
                Some(EPOCH),
                Some(WriteFailure::PlanMismatch),
                WriteFailure::Unavailable,
            )),
            vec![
                write_failed(EPOCH, WriteFailure::PlanMismatch),
                released(ReleaseCause::Rejected),
            ],
            counted(|c| c.prefill_finished_first = 1),
        ),
        case(
            "held + register naming another rank than its sender: unexpected",
            held,
            WInput::Register(d(), registration(&d2(), EPOCH)),
            held_t0(),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "held + cancel: acknowledged, released",
            held,
            cancel(EPOCH),
            tomb(settled(EPOCH)),
            vec![ack(EPOCH), released(ReleaseCause::CancelledByPeer)],
            none(),
        ),
        case(
            "held + release: released by peer",
            held,
            WInput::Release(EPOCH, ReleaseReason::FullPrefixHit),
            tomb(settled(EPOCH)),
            vec![released(ReleaseCause::ReleasedByPeer(
                ReleaseReason::FullPrefixHit,
            ))],
            none(),
        ),
        case(
            "held + heartbeat early: renewed, lease not shortened",
            held,
            WInput::Heartbeat(vec![key()]),
            held_t0(),
            vec![],
            counted(|c| c.leases_renewed = 1),
        ),
        case(
            "held + heartbeat late: lease extended",
            held,
            WInput::Heartbeat(vec![key()]),
            is_held(ms(3_500 + 2_000)),
            vec![],
            counted(|c| c.leases_renewed = 1),
        )
        .at(ms(3_500)),
        case(
            "held + heartbeat for other keys: nothing",
            held,
            WInput::Heartbeat(vec![other_key()]),
            held_t0(),
            vec![],
            none(),
        ),
        case(
            "held + finished again: duplicate request",
            held,
            WInput::Finished(start()),
            held_t0(),
            vec![],
            none(),
        )
        .refused(Rejected::DuplicateRequest(req())),
        case(
            "held + finished, another request with the same key: duplicate key",
            held,
            WInput::Finished(start_with(RequestId::new("req-p2").unwrap(), p_blocks())),
            held_t0(),
            vec![],
            none(),
        )
        .refused(Rejected::DuplicateKey(key())),
        case(
            "held + abort: released",
            held,
            WInput::Abort(req()),
            tomb(unbound(WriteFailure::PrefillAborted)),
            vec![released(ReleaseCause::Aborted)],
            none(),
        ),
        case(
            "held + write completed: unknown write",
            held,
            WInput::WriteCompleted(W1),
            held_t0(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "held + write failed: unknown write",
            held,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            held_t0(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "held + peer dead: held blocks are bound to nobody",
            held,
            WInput::PeerDead(d()),
            held_t0(),
            vec![],
            none(),
        ),
        case(
            "held + timeout before lease end: held",
            held,
            WInput::Timeout,
            held_t0(),
            vec![],
            none(),
        )
        .at(ms(LEASE_MS - 1)),
        case(
            "held + timeout at lease end: lease expired",
            held,
            WInput::Timeout,
            tomb(unbound(WriteFailure::LeaseExpired)),
            vec![released(ReleaseCause::LeaseExpired)],
            none(),
        )
        .at(ms(LEASE_MS)),
    ]
}

fn writing_cases() -> Vec<Case> {
    let writing_t0 = || is_writing(EPOCH, ms(WRITE_DL_MS));
    vec![
        case(
            "writing + register, same epoch: duplicate (not a race)",
            writing,
            register(EPOCH),
            writing_t0(),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "writing + register, newer epoch from another rank: unavailable to it, remembered",
            writing,
            WInput::Register(d2(), registration(&d2(), Epoch(3))),
            KeyState {
                tombstone: Some(answered(Epoch(3), WriteFailure::Unavailable)),
                ..writing_t0()
            },
            vec![write_failed_to(&d2(), Epoch(3), WriteFailure::Unavailable)],
            dropped(DropReason::FutureEpoch),
        ),
        case(
            "writing + cancel of its epoch: draining, the epoch becomes the floor",
            writing,
            cancel(EPOCH),
            KeyState {
                tombstone: Some(gave_up(EPOCH, ReleaseCause::CancelledByPeer)),
                ..is_draining(DrainCause::Cancelled, true, false, ms(WRITE_DL_MS))
            },
            vec![],
            none(),
        ),
        case(
            "writing + cancel of an older epoch: acknowledged, the epoch becomes the floor",
            writing,
            cancel(Epoch(1)),
            KeyState {
                tombstone: Some(gave_up(Epoch(1), ReleaseCause::CancelledByPeer)),
                ..writing_t0()
            },
            vec![ack(Epoch(1))],
            none(),
        ),
        case(
            "writing + release: unexpected",
            writing,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            writing_t0(),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "writing + heartbeat: nothing to renew",
            writing,
            WInput::Heartbeat(vec![key()]),
            writing_t0(),
            vec![],
            none(),
        ),
        case(
            "writing + finished again: duplicate request",
            writing,
            WInput::Finished(start()),
            writing_t0(),
            vec![],
            none(),
        )
        .refused(Rejected::DuplicateRequest(req())),
        case(
            "writing + abort: draining",
            writing,
            WInput::Abort(req()),
            is_draining(DrainCause::Aborted, false, false, ms(WRITE_DL_MS)),
            vec![],
            none(),
        ),
        case(
            "writing + write completed: sent",
            writing,
            WInput::WriteCompleted(W1),
            tomb(settled(EPOCH)),
            vec![event(PrefillOutcome::Sent)],
            none(),
        ),
        case(
            "writing + completion of another write: unknown write",
            writing,
            WInput::WriteCompleted(WriteId(99)),
            writing_t0(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "writing + write failed: D told, released",
            writing,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            tomb(ended_tomb(
                Some(EPOCH),
                Some(WriteFailure::TransferFailed),
                WriteFailure::Unavailable,
            )),
            vec![
                write_failed(EPOCH, WriteFailure::TransferFailed),
                released(ReleaseCause::WriteFailed(WriteFailure::TransferFailed)),
            ],
            none(),
        ),
        case(
            "writing + bound peer dead: abandon",
            writing,
            WInput::PeerDead(d()),
            is_draining(DrainCause::PeerDead, false, true, ms(NOW_MS + 500)),
            vec![Output::AbandonWrite { write: W1 }],
            counted(|c| c.writes_abandoned = 1),
        ),
        case(
            "writing + other peer dead: unchanged",
            writing,
            WInput::PeerDead(d2()),
            writing_t0(),
            vec![],
            none(),
        ),
        case(
            "writing + timeout before the write deadline: unchanged",
            writing,
            WInput::Timeout,
            writing_t0(),
            vec![],
            none(),
        )
        .at(ms(WRITE_DL_MS - 1)),
        case(
            "writing + timeout at the write deadline: abandon",
            writing,
            WInput::Timeout,
            is_draining(DrainCause::TimedOut, false, true, ms(WRITE_DL_MS + 500)),
            vec![Output::AbandonWrite { write: W1 }],
            counted(|c| c.writes_abandoned = 1),
        )
        .at(ms(WRITE_DL_MS)),
    ]
}

fn draining_cases() -> Vec<Case> {
    // The fixture's cancel of EPOCH left EPOCH as the key's floor.
    let floor = |state: KeyState| KeyState {
        tombstone: Some(gave_up(EPOCH, ReleaseCause::CancelledByPeer)),
        ..state
    };
    let draining_t0 = move || {
        floor(is_draining(
            DrainCause::Cancelled,
            true,
            false,
            ms(WRITE_DL_MS),
        ))
    };
    vec![
        case(
            "draining + register, same epoch: below the floor, late",
            draining,
            register(EPOCH),
            draining_t0(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "draining + cancel again: one ack owed",
            draining,
            cancel(EPOCH),
            draining_t0(),
            vec![],
            none(),
        ),
        case(
            "draining + cancel of another epoch: acknowledged",
            draining,
            cancel(Epoch(1)),
            draining_t0(),
            vec![ack(Epoch(1))],
            none(),
        ),
        case(
            "draining + cancel from a peer the key is not bound to: refused",
            draining,
            WInput::Cancel(d2(), Epoch(1)),
            draining_t0(),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "draining + release: unexpected",
            draining,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            draining_t0(),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "draining + heartbeat: nothing",
            draining,
            WInput::Heartbeat(vec![key()]),
            draining_t0(),
            vec![],
            none(),
        ),
        case(
            "draining + finished again: duplicate request",
            draining,
            WInput::Finished(start()),
            draining_t0(),
            vec![],
            none(),
        )
        .refused(Rejected::DuplicateRequest(req())),
        case(
            "draining + abort: already draining",
            draining,
            WInput::Abort(req()),
            draining_t0(),
            vec![],
            none(),
        ),
        case(
            "draining + write completed: acknowledged, released",
            draining,
            WInput::WriteCompleted(W1),
            tomb(settled(EPOCH)),
            vec![ack(EPOCH), released(ReleaseCause::CancelledByPeer)],
            none(),
        ),
        case(
            "draining + write failed: D told, acknowledged, released",
            draining,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            tomb(settled(EPOCH)),
            vec![
                write_failed(EPOCH, WriteFailure::TransferFailed),
                ack(EPOCH),
                released(ReleaseCause::CancelledByPeer),
            ],
            none(),
        ),
        case(
            "draining + bound peer dead: abandon",
            draining,
            WInput::PeerDead(d()),
            floor(is_draining(
                DrainCause::PeerDead,
                true,
                true,
                ms(NOW_MS + 500),
            )),
            vec![Output::AbandonWrite { write: W1 }],
            counted(|c| c.writes_abandoned = 1),
        ),
        case(
            "draining + timeout before deadline: unchanged",
            draining,
            WInput::Timeout,
            draining_t0(),
            vec![],
            none(),
        )
        .at(ms(WRITE_DL_MS - 1)),
        case(
            "draining + timeout at deadline: abandon",
            draining,
            WInput::Timeout,
            floor(is_draining(
                DrainCause::Cancelled,
                true,
                true,
                ms(WRITE_DL_MS + 500),
            )),
            vec![Output::AbandonWrite { write: W1 }],
            counted(|c| c.writes_abandoned = 1),
        )
        .at(ms(WRITE_DL_MS)),
        case(
            "draining, abandoned + timeout at deadline: unconfirmed, source blocks held (stuck)",
            || {
                let mut w = draining();
                let mut fx = Outbox::default();
                w.on_timeout(ms(WRITE_DL_MS), &mut fx);
                assert_eq!(fx.out, [Output::AbandonWrite { write: W1 }]);
                w
            },
            WInput::Timeout,
            floor(KeyState {
                request: Some(PrefillRequest::Draining(Draining {
                    common: common(),
                    binding: binding(EPOCH),
                    cause: DrainCause::Cancelled,
                    cancel_requested: true,
                    abandoned: true,
                    stuck: true,
                    deadline: ms(WRITE_DL_MS + 500) + config().max_write_life,
                })),
                ..is_draining(DrainCause::Cancelled, true, true, ms(WRITE_DL_MS))
            }),
            vec![],
            counted(|c| c.stuck_writes = 1),
        )
        .at(ms(WRITE_DL_MS + 500)),
    ]
}

fn tombstone_cases() -> Vec<Case> {
    let mut cases = gave_up_cases();
    cases.extend(answered_cases());
    cases.extend(ended_unbound_cases());
    cases.extend(ended_sent_cases());
    cases.extend(ended_failed_cases());
    cases
}

fn gave_up_cases() -> Vec<Case> {
    let cancelled = || tomb(gave_up(EPOCH, ReleaseCause::CancelledByPeer));
    let released_cause = ReleaseCause::ReleasedByPeer(ReleaseReason::Aborted);
    let released_t = move || tomb(gave_up(EPOCH, released_cause));
    vec![
        // ---- GaveUpEarly, by a cancel
        case(
            "cancelled + register of that epoch: overtaken, swallowed",
            tomb_cancelled,
            register(EPOCH),
            cancelled(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "cancelled + register of an older epoch: swallowed",
            tomb_cancelled,
            register(Epoch(1)),
            cancelled(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "cancelled + register of a newer epoch: pending",
            tomb_cancelled,
            register(Epoch(3)),
            KeyState {
                tombstone: Some(gave_up(EPOCH, ReleaseCause::CancelledByPeer)),
                ..is_pending(d(), Epoch(3), ms(NOW_MS + 5_000))
            },
            vec![],
            none(),
        ),
        case(
            "cancelled + cancel again: acknowledged",
            tomb_cancelled,
            cancel(EPOCH),
            cancelled(),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "cancelled + cancel of a newer epoch: remembered, acknowledged",
            tomb_cancelled,
            cancel(Epoch(3)),
            tomb(gave_up(Epoch(3), ReleaseCause::CancelledByPeer)),
            vec![ack(Epoch(3))],
            none(),
        ),
        case(
            "cancelled + cancel of an older epoch: acknowledged, newest kept",
            tomb_cancelled,
            cancel(Epoch(1)),
            cancelled(),
            vec![ack(Epoch(1))],
            none(),
        ),
        case(
            "cancelled + newer registration pending + cancel of it: forgotten, raised",
            || setup(config(), vec![cancel(EPOCH), register(Epoch(3))]),
            cancel(Epoch(3)),
            tomb(gave_up(Epoch(3), ReleaseCause::CancelledByPeer)),
            vec![ack(Epoch(3))],
            none(),
        ),
        case(
            "cancelled + release: late",
            tomb_cancelled,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            cancelled(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "cancelled + heartbeat: nothing",
            tomb_cancelled,
            WInput::Heartbeat(vec![key()]),
            cancelled(),
            vec![],
            none(),
        ),
        case(
            "cancelled + finished: released at once, the blocks are gone",
            tomb_cancelled,
            WInput::Finished(start()),
            tomb(settled(EPOCH)),
            vec![released(ReleaseCause::CancelledByPeer)],
            none(),
        ),
        case(
            "cancelled + newer registration pending + finished: the newer attempt is served",
            || setup(config(), vec![cancel(EPOCH), register(Epoch(3))]),
            WInput::Finished(start()),
            // The early cancel stays as an epoch floor for registrations it overtook.
            KeyState {
                tombstone: Some(PrefillTombstone::GaveUpEarly {
                    epoch: EPOCH,
                    cause: ReleaseCause::CancelledByPeer,
                }),
                ..is_writing(Epoch(3), ms(NOW_MS + 1_000))
            },
            vec![post(Epoch(3))],
            counted(|c| {
                c.decode_registered_first = 1;
                c.writes_posted = 1;
            }),
        ),
        case(
            "cancelled + abort: unknown request",
            tomb_cancelled,
            WInput::Abort(req()),
            cancelled(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "cancelled + write completed: unknown write",
            tomb_cancelled,
            WInput::WriteCompleted(W1),
            cancelled(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "cancelled + write failed: unknown write",
            tomb_cancelled,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            cancelled(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "cancelled + peer dead: nothing",
            tomb_cancelled,
            WInput::PeerDead(d()),
            cancelled(),
            vec![],
            none(),
        ),
        case(
            "cancelled + timeout before expiry: kept",
            tomb_cancelled,
            WInput::Timeout,
            cancelled(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS - 1)),
        case(
            "cancelled + timeout at expiry: forgotten",
            tomb_cancelled,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS)),
        // ---- GaveUpEarly, by a release
        case(
            "released + register of that epoch: swallowed",
            tomb_released,
            register(EPOCH),
            released_t(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "released + register of a newer epoch: pending",
            tomb_released,
            register(Epoch(3)),
            KeyState {
                tombstone: Some(gave_up(EPOCH, released_cause)),
                ..is_pending(d(), Epoch(3), ms(NOW_MS + 5_000))
            },
            vec![],
            none(),
        ),
        case(
            "released + cancel of that epoch: acknowledged",
            tomb_released,
            cancel(EPOCH),
            released_t(),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "released + cancel of a newer epoch: floor raised, now a cancel",
            tomb_released,
            cancel(Epoch(3)),
            tomb(gave_up(Epoch(3), ReleaseCause::CancelledByPeer)),
            vec![ack(Epoch(3))],
            none(),
        ),
        case(
            "released + release again: late",
            tomb_released,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            released_t(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "released + heartbeat: nothing",
            tomb_released,
            WInput::Heartbeat(vec![key()]),
            released_t(),
            vec![],
            none(),
        ),
        case(
            "released + finished: released at once, the blocks are gone",
            tomb_released,
            WInput::Finished(start()),
            tomb(settled(EPOCH)),
            vec![released(released_cause)],
            none(),
        ),
        case(
            "released + newer registration pending + finished: the newer attempt is served",
            || {
                setup(
                    config(),
                    vec![
                        WInput::Release(EPOCH, ReleaseReason::Aborted),
                        register(Epoch(3)),
                    ],
                )
            },
            WInput::Finished(start()),
            KeyState {
                tombstone: Some(PrefillTombstone::GaveUpEarly {
                    epoch: EPOCH,
                    cause: ReleaseCause::ReleasedByPeer(ReleaseReason::Aborted),
                }),
                ..is_writing(Epoch(3), ms(NOW_MS + 1_000))
            },
            vec![post(Epoch(3))],
            counted(|c| {
                c.decode_registered_first = 1;
                c.writes_posted = 1;
            }),
        ),
        case(
            "released + abort: unknown request",
            tomb_released,
            WInput::Abort(req()),
            released_t(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "released + write completed: unknown write",
            tomb_released,
            WInput::WriteCompleted(W1),
            released_t(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "released + write failed: unknown write",
            tomb_released,
            WInput::WriteFailed(W1, WriteFailure::PostFailed),
            released_t(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "released + peer dead: nothing",
            tomb_released,
            WInput::PeerDead(d()),
            released_t(),
            vec![],
            none(),
        ),
        case(
            "released + timeout at expiry: forgotten",
            tomb_released,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS)),
    ]
}

fn answered_cases() -> Vec<Case> {
    let answered_t = || tomb(answered(EPOCH, WriteFailure::RegistrationExpired));
    // The fixture is set up at PENDING_MS; its tombstone expires a tombstone_ttl later.
    let after = ms(PENDING_MS + 10);
    let expiry = ms(PENDING_MS + 5_000);
    vec![
        // ---- Answered: P told D its registration expired; P never held blocks for it
        case(
            "answered + the same registration again (a duplicate): the same answer, no blocks",
            tomb_answered,
            register(EPOCH),
            answered_t(),
            vec![write_failed(EPOCH, WriteFailure::RegistrationExpired)],
            dropped(DropReason::Duplicate),
        )
        .at(after),
        case(
            "answered + cancel: acknowledged, the answer stays the floor",
            tomb_answered,
            cancel(EPOCH),
            answered_t(),
            vec![ack(EPOCH)],
            none(),
        )
        .at(after),
        case(
            "answered + release: late",
            tomb_answered,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            answered_t(),
            vec![],
            dropped(DropReason::Late),
        )
        .at(after),
        case(
            "answered + heartbeat: nothing",
            tomb_answered,
            WInput::Heartbeat(vec![key()]),
            answered_t(),
            vec![],
            none(),
        )
        .at(after),
        case(
            "answered + finished: held, and the answer stays as a floor for copies",
            tomb_answered,
            WInput::Finished(start()),
            KeyState {
                tombstone: Some(answered(EPOCH, WriteFailure::RegistrationExpired)),
                ..is_held(ms(PENDING_MS + 10 + 3_000))
            },
            vec![],
            none(),
        )
        .at(after),
        case(
            "answered + abort: unknown request",
            tomb_answered,
            WInput::Abort(req()),
            answered_t(),
            vec![],
            none(),
        )
        .at(after)
        .refused(Rejected::UnknownRequest(req())),
        case(
            "answered + write completed: unknown write",
            tomb_answered,
            WInput::WriteCompleted(W1),
            answered_t(),
            vec![],
            dropped(DropReason::UnknownWrite),
        )
        .at(after),
        case(
            "answered + write failed: unknown write",
            tomb_answered,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            answered_t(),
            vec![],
            dropped(DropReason::UnknownWrite),
        )
        .at(after),
        case(
            "answered + peer dead: nothing",
            tomb_answered,
            WInput::PeerDead(d()),
            answered_t(),
            vec![],
            none(),
        )
        .at(after),
        case(
            "answered + timeout at expiry: forgotten",
            tomb_answered,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(expiry),
    ]
}

fn ended_unbound_cases() -> Vec<Case> {
    let aborted = || tomb(unbound(WriteFailure::PrefillAborted));
    vec![
        // ---- Ended, bound to no epoch (P aborted while it held the blocks)
        case(
            "aborted + register: late, D told why, the epoch becomes the floor",
            tomb_aborted,
            register(EPOCH),
            tomb(ended_tomb(
                Some(EPOCH),
                Some(WriteFailure::PrefillAborted),
                WriteFailure::PrefillAborted,
            )),
            vec![write_failed(EPOCH, WriteFailure::PrefillAborted)],
            dropped(DropReason::Late),
        ),
        case(
            "aborted + register of a newer epoch from another rank: told why, floor raised",
            tomb_aborted,
            WInput::Register(d2(), registration(&d2(), Epoch(3))),
            tomb(ended_tomb(
                Some(Epoch(3)),
                Some(WriteFailure::PrefillAborted),
                WriteFailure::PrefillAborted,
            )),
            vec![write_failed_to(
                &d2(),
                Epoch(3),
                WriteFailure::PrefillAborted,
            )],
            dropped(DropReason::Late),
        ),
        case(
            "aborted + cancel: acknowledged, nothing in flight, the epoch becomes the floor",
            tomb_aborted,
            cancel(EPOCH),
            tomb(unbound_raised(EPOCH)),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "aborted + release: late",
            tomb_aborted,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            aborted(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "aborted + heartbeat: nothing",
            tomb_aborted,
            WInput::Heartbeat(vec![key()]),
            aborted(),
            vec![],
            none(),
        ),
        case(
            "aborted + finished: a new request for the key supersedes the tombstone",
            tomb_aborted,
            WInput::Finished(start()),
            is_held(ms(NOW_MS + 3_000)),
            vec![],
            none(),
        ),
        case(
            "aborted + abort: unknown request",
            tomb_aborted,
            WInput::Abort(req()),
            aborted(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "aborted + write completed: unknown write",
            tomb_aborted,
            WInput::WriteCompleted(W1),
            aborted(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "aborted + write failed: unknown write",
            tomb_aborted,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            aborted(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "aborted + peer dead: nothing",
            tomb_aborted,
            WInput::PeerDead(d()),
            aborted(),
            vec![],
            none(),
        ),
        case(
            "aborted + timeout at expiry: forgotten",
            tomb_aborted,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS)),
    ]
}

fn ended_sent_cases() -> Vec<Case> {
    let sent = || tomb(settled(EPOCH));
    vec![
        // ---- Ended, bound to EPOCH, nothing to replay (P's write landed)
        case(
            "sent + register of that epoch: duplicate, swallowed (D has its data)",
            tomb_sent,
            register(EPOCH),
            sent(),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "sent + register of an older epoch: late, swallowed",
            tomb_sent,
            register(Epoch(1)),
            sent(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "sent + register of a newer epoch: late, unavailable at once, floor raised",
            tomb_sent,
            register(Epoch(3)),
            tomb(settled(Epoch(3))),
            vec![write_failed(Epoch(3), WriteFailure::Unavailable)],
            dropped(DropReason::Late),
        ),
        case(
            "sent + cancel: acknowledged, nothing remembered",
            tomb_sent,
            cancel(EPOCH),
            sent(),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "sent + cancel of a newer epoch: acknowledged, floor raised",
            tomb_sent,
            cancel(Epoch(3)),
            tomb(settled(Epoch(3))),
            vec![ack(Epoch(3))],
            none(),
        ),
        case(
            "sent + release: late",
            tomb_sent,
            WInput::Release(EPOCH, ReleaseReason::ReadDone),
            sent(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "sent + heartbeat: nothing",
            tomb_sent,
            WInput::Heartbeat(vec![key()]),
            sent(),
            vec![],
            none(),
        ),
        case(
            "sent + finished: a new request for the key keeps the tombstone as a floor",
            tomb_sent,
            WInput::Finished(start_with(RequestId::new("req-p2").unwrap(), p_blocks())),
            // The old request's tombstone stays as an epoch floor for overtaken registrations.
            KeyState {
                tombstone: Some(settled(EPOCH)),
                ..live(PrefillRequest::Held(Held {
                    common: PrefillCommon {
                        request: RequestId::new("req-p2").unwrap(),
                        ..common()
                    },
                    lease_until: ms(NOW_MS + 3_000),
                }))
            },
            vec![],
            none(),
        ),
        case(
            "sent + abort: unknown request",
            tomb_sent,
            WInput::Abort(req()),
            sent(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "sent + write completed again: unknown write",
            tomb_sent,
            WInput::WriteCompleted(W1),
            sent(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "sent + write failed: unknown write",
            tomb_sent,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            sent(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "sent + peer dead: nothing",
            tomb_sent,
            WInput::PeerDead(d()),
            sent(),
            vec![],
            none(),
        ),
        case(
            "sent + timeout before expiry: kept",
            tomb_sent,
            WInput::Timeout,
            sent(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS - 1)),
        case(
            "sent + timeout at expiry: forgotten",
            tomb_sent,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS)),
    ]
}

fn ended_failed_cases() -> Vec<Case> {
    let failed = || {
        tomb(ended_tomb(
            Some(EPOCH),
            Some(WriteFailure::TransferFailed),
            WriteFailure::Unavailable,
        ))
    };
    vec![
        // ---- Ended, bound to EPOCH, with a failure to replay (P's write failed)
        case(
            "failed + register of that epoch: duplicate, the failure told again",
            tomb_failed,
            register(EPOCH),
            failed(),
            vec![write_failed(EPOCH, WriteFailure::TransferFailed)],
            dropped(DropReason::Duplicate),
        ),
        case(
            "failed + register of an older epoch: late, the failure told again",
            tomb_failed,
            register(Epoch(1)),
            failed(),
            vec![write_failed(Epoch(1), WriteFailure::TransferFailed)],
            dropped(DropReason::Late),
        ),
        case(
            "failed + register of a newer epoch: late, unavailable, floor raised",
            tomb_failed,
            register(Epoch(3)),
            tomb(ended_tomb(
                Some(Epoch(3)),
                Some(WriteFailure::TransferFailed),
                WriteFailure::Unavailable,
            )),
            vec![write_failed(Epoch(3), WriteFailure::Unavailable)],
            dropped(DropReason::Late),
        ),
        case(
            "failed + register of that epoch from another rank: duplicate, told the failure",
            tomb_failed,
            WInput::Register(d2(), registration(&d2(), EPOCH)),
            failed(),
            vec![write_failed_to(&d2(), EPOCH, WriteFailure::TransferFailed)],
            dropped(DropReason::Duplicate),
        ),
        case(
            "failed + cancel: acknowledged, nothing remembered",
            tomb_failed,
            cancel(EPOCH),
            failed(),
            vec![ack(EPOCH)],
            none(),
        ),
        case(
            "failed + release: late",
            tomb_failed,
            WInput::Release(EPOCH, ReleaseReason::Aborted),
            failed(),
            vec![],
            dropped(DropReason::Late),
        ),
        case(
            "failed + heartbeat: nothing",
            tomb_failed,
            WInput::Heartbeat(vec![key()]),
            failed(),
            vec![],
            none(),
        ),
        case(
            "failed + finished: a new request for the key keeps the tombstone as a floor",
            tomb_failed,
            WInput::Finished(start_with(RequestId::new("req-p2").unwrap(), p_blocks())),
            // The old request's tombstone stays as an epoch floor for overtaken registrations.
            KeyState {
                tombstone: Some(ended_tomb(
                    Some(EPOCH),
                    Some(WriteFailure::TransferFailed),
                    WriteFailure::Unavailable,
                )),
                ..live(PrefillRequest::Held(Held {
                    common: PrefillCommon {
                        request: RequestId::new("req-p2").unwrap(),
                        ..common()
                    },
                    lease_until: ms(NOW_MS + 3_000),
                }))
            },
            vec![],
            none(),
        ),
        case(
            "failed + abort: unknown request",
            tomb_failed,
            WInput::Abort(req()),
            failed(),
            vec![],
            none(),
        )
        .refused(Rejected::UnknownRequest(req())),
        case(
            "failed + write completed: unknown write",
            tomb_failed,
            WInput::WriteCompleted(W1),
            failed(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "failed + write failed again: unknown write",
            tomb_failed,
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            failed(),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "failed + peer dead: nothing",
            tomb_failed,
            WInput::PeerDead(d()),
            failed(),
            vec![],
            none(),
        ),
        case(
            "failed + timeout at expiry: forgotten",
            tomb_failed,
            WInput::Timeout,
            nothing(),
            vec![],
            none(),
        )
        .at(ms(TOMB_MS)),
    ]
}

fn cases() -> Vec<Case> {
    let mut cases = unknown_cases();
    cases.extend(pending_cases());
    cases.extend(held_cases());
    cases.extend(writing_cases());
    cases.extend(draining_cases());
    cases.extend(tombstone_cases());
    cases
}

// Adding a request state, a tombstone kind or an input breaks one of these matches: add its
// name to the list beside it, and the coverage test below then demands its cases.
const STATES: [&str; 11] = [
    "Unknown",
    "Pending",
    "Held",
    "Writing",
    "Draining",
    "Tomb/GaveUpEarly(cancelled)",
    "Tomb/GaveUpEarly(released)",
    "Tomb/Answered",
    "Tomb/Ended(unbound)",
    "Tomb/Ended(swallows)",
    "Tomb/Ended(replays)",
];
const INPUTS: [&str; 10] = [
    "Register",
    "Cancel",
    "Release",
    "Heartbeat",
    "Finished",
    "Abort",
    "WriteCompleted",
    "WriteFailed",
    "PeerDead",
    "Timeout",
];

/// The key's state: its live request if any, else its tombstone, else its pending registration.
fn state_name(state: &KeyState) -> &'static str {
    if let Some(request) = &state.request {
        return match request {
            PrefillRequest::Held(_) => "Held",
            PrefillRequest::Writing(_) => "Writing",
            PrefillRequest::Draining(_) => "Draining",
        };
    }
    if let Some(tombstone) = &state.tombstone {
        // The kinds that answer a registration differently. A cause or a shape no fixture
        // builds falls out of STATES and fails the coverage test.
        return match tombstone {
            PrefillTombstone::GaveUpEarly { cause, .. } => match cause {
                ReleaseCause::CancelledByPeer => "Tomb/GaveUpEarly(cancelled)",
                ReleaseCause::ReleasedByPeer(_) => "Tomb/GaveUpEarly(released)",
                _ => "Tomb/GaveUpEarly(other)",
            },
            PrefillTombstone::Answered { .. } => "Tomb/Answered",
            PrefillTombstone::Ended {
                epoch: None,
                replay: _,
                newer: _,
            } => "Tomb/Ended(unbound)",
            PrefillTombstone::Ended {
                epoch: Some(_),
                replay: None,
                newer: _,
            } => "Tomb/Ended(swallows)",
            PrefillTombstone::Ended {
                epoch: Some(_),
                replay: Some(_),
                newer: _,
            } => "Tomb/Ended(replays)",
        };
    }
    if state.pending.is_some() {
        return "Pending";
    }
    "Unknown"
}

fn input_name(input: &WInput) -> &'static str {
    match input {
        WInput::Register(..) => "Register",
        WInput::Cancel(..) => "Cancel",
        WInput::Release(..) => "Release",
        WInput::Heartbeat(_) => "Heartbeat",
        WInput::Finished(_) => "Finished",
        WInput::Abort(_) => "Abort",
        WInput::WriteCompleted(_) => "WriteCompleted",
        WInput::WriteFailed(..) => "WriteFailed",
        WInput::PeerDead(_) => "PeerDead",
        WInput::Timeout => "Timeout",
    }
}

#[test]
fn every_state_and_input() {
    let mut names = BTreeSet::new();
    for case in cases() {
        let name = case.name;
        assert!(names.insert(name), "case names are unique: {name}");
        let mut w = (case.build)();
        w.check_invariants();
        let mut fx = Outbox::default();
        let result = apply(&mut w, case.now, case.input.clone(), &mut fx);
        w.check_invariants();
        let outputs: Vec<Output> = fx.out.into_iter().collect();
        assert_eq!(result, case.result, "case `{name}`: result");
        assert_eq!(snapshot(&w), case.next, "case `{name}`: next state");
        assert_eq!(outputs, case.outputs, "case `{name}`: outputs");
        assert_eq!(fx.counters, case.counters, "case `{name}`: fx.counters");

        // Safety: blocks are handed back only when no write of theirs is in flight.
        let freed = outputs
            .iter()
            .any(|o| matches!(o, Output::Event(EndpointEvent::Prefill { .. })));
        if freed {
            assert!(
                !w.writes.values().any(|k| *k == key()),
                "case `{name}`: blocks freed with a write in flight"
            );
        }
        // Safety: a cancel from the key's own D is answered now, or owed by a drain of that
        // very epoch (a cancel from another peer is refused, and counted).
        if let WInput::Cancel(from, epoch) = &case.input {
            let refused = fx.counters.dropped(DropReason::Unexpected) == 1 && outputs.is_empty();
            let acked = refused || outputs.contains(&ack_to(from, *epoch));
            let owed = matches!(
                &case.next.request,
                Some(PrefillRequest::Draining(s)) if s.cancel_requested && s.binding.epoch == *epoch
            );
            assert!(acked || owed, "case `{name}`: cancel unanswered");
        }
    }
}

#[test]
fn table_covers_every_state_input_pair() {
    let covered: BTreeSet<(&str, &str)> = cases()
        .iter()
        .map(|c| (state_name(&snapshot(&(c.build)())), input_name(&c.input)))
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
fn tombstone_per_outcome() {
    use PrefillOutcome::{Released as R, Sent};
    use ReleaseCause as C;
    use WriteFailure as W;
    let e = Some(EPOCH);
    // (outcome, bound epoch, replay to that epoch or older, answer to any other)
    let table = [
        (Sent, e, None, W::Unavailable),
        (R(C::CancelledByPeer), e, None, W::Unavailable),
        (R(C::CancelledByPeer), None, None, W::Unavailable),
        (
            R(C::ReleasedByPeer(ReleaseReason::ReadDone)),
            e,
            None,
            W::Unavailable,
        ),
        (
            R(C::ReleasedByPeer(ReleaseReason::FullPrefixHit)),
            None,
            None,
            W::Unavailable,
        ),
        (R(C::PeerDead), e, None, W::Unavailable),
        (R(C::Empty), None, None, W::Unavailable),
        (
            R(C::LeaseExpired),
            None,
            Some(W::LeaseExpired),
            W::LeaseExpired,
        ),
        (
            R(C::Aborted),
            None,
            Some(W::PrefillAborted),
            W::PrefillAborted,
        ),
        (R(C::Aborted), e, Some(W::PrefillAborted), W::PrefillAborted),
        (R(C::Rejected), e, Some(W::PlanMismatch), W::Unavailable),
        (
            R(C::WriteFailed(W::PostFailed)),
            e,
            Some(W::PostFailed),
            W::Unavailable,
        ),
        (
            R(C::WriteFailed(W::TransferTimedOut)),
            e,
            Some(W::TransferTimedOut),
            W::Unavailable,
        ),
    ];
    for (outcome, epoch, replay, newer) in table {
        assert_eq!(
            tombstone_for(outcome, epoch),
            PrefillTombstone::Ended {
                epoch,
                replay,
                newer
            },
            "{outcome:?} {epoch:?}"
        );
    }
}

#[test]
fn next_timer_is_the_earliest_of_every_table() {
    assert_eq!(unknown().next_timer(), None);
    assert_eq!(pending().next_timer(), Some(ms(PENDING_MS)));
    assert_eq!(held().next_timer(), Some(ms(LEASE_MS)));
    assert_eq!(writing().next_timer(), Some(ms(WRITE_DL_MS)));
    assert_eq!(tomb_cancelled().next_timer(), Some(ms(TOMB_MS)));
    assert_eq!(tomb_sent().next_timer(), Some(ms(TOMB_MS)));
    let w = writing();
    assert_eq!(
        (
            w.live_requests(),
            w.pending_registrations(),
            w.writes_in_flight(),
            w.tombstones()
        ),
        (1, 0, 1, 0)
    );
    assert!(w.has_request(&req()));
}

/// Every write id is used once for the prefill table's whole life, whichever request posts it.
#[test]
fn write_ids_are_never_reused() {
    let mut w = writing();
    let mut fx = Outbox::default();
    w.on_write_result(ms(NOW_MS), W1, None, &mut fx);
    let mut second = start_with(RequestId::new("req-p2").unwrap(), p_blocks());
    second.key = other_key();
    w.finished(ms(NOW_MS), second, &mut fx).unwrap();
    let mut r = registration(&d(), EPOCH);
    r.key = other_key();
    w.on_register(ms(NOW_MS), d(), r, &mut fx);
    w.check_invariants();
    let posted: Vec<WriteId> = fx
        .out
        .iter()
        .filter_map(|o| {
            if let Output::PostWrite(order) = o {
                Some(order.write)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(posted, [WriteId(2)]);
}

/// After P released a key because D cancelled (or released) epoch 2, a registration for epoch 3
/// is told `Unavailable` at once: the blocks are gone, so it must not wait as pending until the
/// registration ttl expires. The answered epoch becomes the key's floor; the rest of the
/// tombstone is kept as it was.
#[test]
fn newer_registration_after_release_fails_fast() {
    let gave_up = [
        cancel(EPOCH),
        WInput::Release(EPOCH, ReleaseReason::FullPrefixHit),
    ];
    for give_up in gave_up {
        let mut w = setup(config(), vec![WInput::Finished(start()), give_up.clone()]);
        assert_eq!(snapshot(&w), tomb(settled(EPOCH)), "{give_up:?}");
        let mut fx = Outbox::default();
        w.on_register(ms(NOW_MS), d(), registration(&d(), Epoch(3)), &mut fx);
        w.check_invariants();
        assert_eq!(
            fx.out.into_iter().collect::<Vec<_>>(),
            [write_failed(Epoch(3), WriteFailure::Unavailable)],
            "{give_up:?}"
        );
        assert_eq!(fx.counters, dropped(DropReason::Late), "{give_up:?}");
        assert!(w.pending.is_empty(), "{give_up:?}");
        assert_eq!(snapshot(&w), tomb(settled(Epoch(3))), "{give_up:?}");
    }
}

/// The same once the blocks were released when the prefill finished after D gave up early.
#[test]
fn newer_registration_after_an_early_give_up_fails_fast_once_the_blocks_are_gone() {
    let mut w = setup(config(), vec![cancel(EPOCH), WInput::Finished(start())]);
    let mut fx = Outbox::default();
    w.on_register(ms(NOW_MS), d(), registration(&d(), Epoch(3)), &mut fx);
    w.check_invariants();
    assert_eq!(
        fx.out.into_iter().collect::<Vec<_>>(),
        [write_failed(Epoch(3), WriteFailure::Unavailable)]
    );
    assert_eq!(fx.counters, dropped(DropReason::Late));
    assert!(w.pending.is_empty());
    assert_eq!(
        snapshot(&w),
        tomb(settled(Epoch(3))),
        "the answered epoch is the floor"
    );
}

// ---- Every epoch P answers raises the key's floor

/// Feeds one input at `now`; the table must accept it and stay consistent.
fn feed(w: &mut PrefillTable, now: Time, input: WInput) -> (Vec<Output>, Counters) {
    let mut fx = Outbox::default();
    apply(w, now, input, &mut fx).unwrap();
    w.check_invariants();
    (fx.out.into_iter().collect(), fx.counters)
}

fn second_req() -> RequestId {
    RequestId::new("req-p2").unwrap()
}

/// P's second request for `key()`, held since `now` (its blocks as the first one's).
fn second_held(now: Time, tombstone: PrefillTombstone) -> KeyState {
    KeyState {
        request: Some(PrefillRequest::Held(Held {
            common: PrefillCommon {
                request: second_req(),
                ..common()
            },
            lease_until: now + config().lease_duration,
        })),
        tombstone: Some(tombstone),
        ..KeyState::default()
    }
}

/// The write P posts when `register` (from `to`) meets blocks held for `key()`.
fn post_to(write: WriteId, to: &PeerAddr, epoch: Epoch) -> Output {
    Output::PostWrite(Box::new(WriteOrder {
        write,
        to: to.clone(),
        key: key(),
        epoch,
        local: BlockIds::single_group(vec![13, 14]),
        remote: d_blocks(),
        notification: Message::WriteDone(WriteDone {
            key: key(),
            epoch,
            prefill_rank: RANK,
            digests: Vec::new(),
        }),
        stream: None,
        remote_memory: Vec::new(),
    }))
}

/// After P answered a registration for epoch e, P finishes a new request for the key: a
/// duplicate of that registration arriving now is dropped `Late` (no write), and only a newer
/// attempt gets the blocks. Checked from the end of the first request itself: the registration
/// was answered by an `Ended` tombstone (the blocks were gone) or while the blocks were still
/// bound to an older attempt (Writing or Draining), and the floor outlives that request.
fn assert_answered_copy_never_reaches_later_blocks(
    name: &str,
    mut w: PrefillTable,
    answered_floor: PrefillTombstone,
    copy: WInput,
    newer: (PeerAddr, Epoch),
    next_write: WriteId,
) {
    let now = ms(NOW_MS + 100);
    let (outputs, counters) = feed(
        &mut w,
        now,
        WInput::Finished(start_with(second_req(), p_blocks())),
    );
    assert_eq!(outputs, [], "{name}: the new request holds its blocks");
    assert_eq!(counters, none(), "{name}");
    assert_eq!(
        snapshot(&w),
        second_held(now, answered_floor),
        "{name}: the floor stays"
    );

    let (outputs, counters) = feed(&mut w, now, copy);
    assert_eq!(outputs, [], "{name}: the copy reaches no blocks");
    assert_eq!(counters, dropped(DropReason::Late), "{name}");
    assert_eq!(
        snapshot(&w),
        second_held(now, answered_floor),
        "{name}: nothing changed"
    );
    assert_eq!(w.writes_in_flight(), 0, "{name}");

    let (from, epoch) = newer;
    let (outputs, counters) = feed(
        &mut w,
        now,
        WInput::Register(from.clone(), registration(&from, epoch)),
    );
    assert_eq!(
        outputs,
        [post_to(next_write, &from, epoch)],
        "{name}: a newer attempt is served"
    );
    assert_eq!(
        counters,
        counted(|c| {
            c.prefill_finished_first = 1;
            c.writes_posted = 1;
        }),
        "{name}"
    );
}

/// Rule: a registration that is not for the attempt an `Ended` tombstone is bound to (it has
/// none, or the registration is newer) is answered, and its epoch becomes the key's floor.
#[test]
fn registration_answered_by_an_ended_tombstone_never_reaches_a_later_request() {
    // (fixture, the registration answered, its answer, the tombstone it leaves, the next write)
    let cases = [
        (
            "sent",
            tomb_sent as fn() -> PrefillTable,
            Epoch(3),
            WriteFailure::Unavailable,
            settled(Epoch(3)),
            WriteId(2),
        ),
        (
            "failed",
            tomb_failed,
            Epoch(3),
            WriteFailure::Unavailable,
            ended_tomb(
                Some(Epoch(3)),
                Some(WriteFailure::TransferFailed),
                WriteFailure::Unavailable,
            ),
            WriteId(2),
        ),
        (
            "aborted (bound to no epoch)",
            tomb_aborted,
            EPOCH,
            WriteFailure::PrefillAborted,
            unbound_raised(EPOCH),
            W1,
        ),
    ];
    for (name, build, epoch, answer, floor, next_write) in cases {
        let mut w = build();
        let (outputs, counters) = feed(&mut w, ms(NOW_MS), register(epoch));
        assert_eq!(outputs, [write_failed(epoch, answer)], "{name}");
        assert_eq!(counters, dropped(DropReason::Late), "{name}");
        assert_eq!(snapshot(&w), tomb(floor), "{name}");
        assert_answered_copy_never_reaches_later_blocks(
            name,
            w,
            floor,
            register(epoch),
            (d(), Epoch(epoch.0 + 1)),
            next_write,
        );
    }
}

/// Rule: a record that refuses a registration is written again, so that it outlives that
/// registration's copies as a new record would. A sibling D of the key (the router sent the
/// decode leg twice) may start registering long after the record was written, and each D
/// counts its sends' span from its own first one; before, a copy of a registration the record
/// answered just before it expired found no record and became a pending registration for a
/// later prefill of the key (found by the swarm with late registration copies outside the
/// small tables, push seed 689).
#[test]
fn a_record_refusing_a_registration_outlives_that_registrations_copies() {
    let config = config();
    let mut w = tomb_answered();
    let answer = [write_failed(EPOCH, WriteFailure::RegistrationExpired)];
    // Just before the record would expire, a registration it answers.
    let late = ms(PENDING_MS) + (config.tombstone_ttl - std::time::Duration::from_millis(1));
    let (outputs, _) = feed(&mut w, late, register(EPOCH));
    assert_eq!(outputs, answer, "the record answers");
    // A copy of it, past the record's first expiry, within the span a record must cover.
    let copy = late + config.tombstone_min_life();
    assert!(copy > ms(PENDING_MS) + config.tombstone_ttl);
    // P's timers ran by then (they sweep expired records).
    w.on_timeout(copy, &mut Outbox::default());
    let (outputs, _) = feed(&mut w, copy, register(EPOCH));
    assert_eq!(
        outputs, answer,
        "the copy finds the record, not an empty table"
    );
    assert_eq!(
        snapshot(&w),
        tomb(answered(EPOCH, WriteFailure::RegistrationExpired))
    );
}

/// The aborted fixture's tombstone once a registration for `epoch` was answered.
fn unbound_raised(epoch: Epoch) -> PrefillTombstone {
    ended_tomb(
        Some(epoch),
        Some(WriteFailure::PrefillAborted),
        WriteFailure::PrefillAborted,
    )
}

/// Rule: a registration for a newer attempt than the one a live request's blocks are bound to
/// (Writing or Draining) is answered by the table, not the request, and remembered; the floor
/// outlives the request, so a copy of it never reaches the blocks of the next request of the key.
#[test]
fn newer_registration_answered_while_bound_never_reaches_a_later_request() {
    let draining_aborted = || {
        setup(
            config(),
            vec![
                WInput::Finished(start()),
                register(EPOCH),
                WInput::Abort(req()),
            ],
        )
    };
    // (fixture, its state, how its write ends, what that sends and the tombstone it leaves)
    let cases = [
        (
            "writing",
            writing as fn() -> PrefillTable,
            is_writing(EPOCH, ms(WRITE_DL_MS)),
            WInput::WriteCompleted(W1),
            vec![event(PrefillOutcome::Sent)],
            settled(Epoch(3)),
        ),
        (
            "draining (aborted)",
            draining_aborted,
            is_draining(DrainCause::Aborted, false, false, ms(WRITE_DL_MS)),
            WInput::WriteFailed(W1, WriteFailure::TransferFailed),
            vec![
                write_failed(EPOCH, WriteFailure::PrefillAborted),
                released(ReleaseCause::Aborted),
            ],
            unbound_raised(Epoch(3)),
        ),
    ];
    for (name, build, bound, write_ends, ended, floor) in cases {
        let mut w = build();
        let newer = || WInput::Register(d2(), registration(&d2(), Epoch(3)));
        let (outputs, counters) = feed(&mut w, ms(NOW_MS), newer());
        assert_eq!(
            outputs,
            [write_failed_to(&d2(), Epoch(3), WriteFailure::Unavailable)],
            "{name}"
        );
        assert_eq!(counters, dropped(DropReason::FutureEpoch), "{name}");
        let answered_while_bound = KeyState {
            tombstone: Some(answered(Epoch(3), WriteFailure::Unavailable)),
            ..bound.clone()
        };
        assert_eq!(
            snapshot(&w),
            answered_while_bound,
            "{name}: the request is not stepped"
        );

        // A copy while the blocks are still bound: the same answer again, nothing stepped.
        let (outputs, counters) = feed(&mut w, ms(NOW_MS), newer());
        assert_eq!(outputs, [], "{name}: the copy is below the floor");
        assert_eq!(counters, dropped(DropReason::Late), "{name}");
        assert_eq!(snapshot(&w), answered_while_bound, "{name}");

        let (outputs, counters) = feed(&mut w, ms(NOW_MS), write_ends);
        assert_eq!(outputs, ended, "{name}");
        assert_eq!(counters, none(), "{name}");
        assert_eq!(
            snapshot(&w),
            tomb(floor),
            "{name}: the answered epoch is the floor"
        );

        assert_answered_copy_never_reaches_later_blocks(
            name,
            w,
            floor,
            newer(),
            (d2(), Epoch(4)),
            WriteId(2),
        );
    }
}

/// Rule: when P finishes with no blocks while a registration waits, the registration is answered
/// and remembered (the `Empty` tombstone has no epoch): a copy of it never reaches the blocks of
/// P's next request of the key.
#[test]
fn registration_answered_by_an_empty_prefill_never_reaches_a_later_request() {
    let mut w = pending();
    let empty = start_with(req(), BlockIds::single_group(vec![]));
    let (outputs, counters) = feed(&mut w, ms(NOW_MS), WInput::Finished(empty));
    assert_eq!(
        outputs,
        [
            event_with(
                PrefillOutcome::Released(ReleaseCause::Empty),
                BlockIds::single_group(vec![]),
            ),
            write_failed(EPOCH, WriteFailure::Unavailable),
        ]
    );
    assert_eq!(counters, none());
    let floor = answered(EPOCH, WriteFailure::Unavailable);
    assert_eq!(snapshot(&w), tomb(floor));
    assert_answered_copy_never_reaches_later_blocks(
        "empty",
        w,
        floor,
        register(EPOCH),
        (d(), Epoch(3)),
        W1,
    );
}

/// Only the D the key is bound to may cancel it: another peer's cancel of a key whose blocks are
/// being written for D is dropped, unanswered, and the write goes on.
#[test]
fn a_cancel_from_another_peer_is_refused() {
    let mut w = setup(config(), vec![WInput::Finished(start()), register(EPOCH)]);
    let mut fx = Outbox::default();
    w.on_cancel(ms(NOW_MS), d2(), key(), EPOCH, &mut fx);
    w.on_release(
        ms(NOW_MS),
        d2(),
        key(),
        EPOCH,
        ReleaseReason::Aborted,
        &mut fx,
    );
    w.check_invariants();
    assert!(fx.out.is_empty(), "no ack and no drain: {:?}", fx.out);
    assert_eq!(fx.counters.dropped(DropReason::Unexpected), 2);
    assert_eq!(snapshot(&w), is_writing(EPOCH, ms(T0_MS + 1_000)));
}

/// A registration whose D died leaves a tombstone: the blocks that finish later for the key are
/// released at once, not at the end of their lease.
#[test]
fn blocks_finishing_after_their_registrant_died_are_released_at_once() {
    let mut w = setup(config(), vec![register(EPOCH), WInput::PeerDead(d())]);
    let mut fx = Outbox::default();
    w.finished(ms(NOW_MS), start(), &mut fx).unwrap();
    w.check_invariants();
    assert!(
        fx.out.iter().any(|o| matches!(
            o,
            Output::Event(EndpointEvent::Prefill {
                outcome: PrefillOutcome::Released(ReleaseCause::PeerDead),
                ..
            })
        )),
        "{:?}",
        fx.out
    );
    assert_eq!(w.live_requests(), 0);
}

/// A cancel or release of an attempt an older request of the key settled (a late copy) reaches
/// a newer request of the key whose blocks no attempt claimed yet: it must not end it (D's next
/// attempt would find the blocks gone). A cancel is still acknowledged; a cancel of a newer
/// attempt still ends the request.
#[test]
fn a_stale_cancel_or_release_never_ends_a_newer_request() {
    let newer = || WInput::Finished(start_with(RequestId::new("req-p2").unwrap(), p_blocks()));
    let stale = [
        (cancel(EPOCH), vec![ack(EPOCH)]),
        (WInput::Release(EPOCH, ReleaseReason::FullPrefixHit), vec![]),
    ];
    for (input, answer) in stale {
        // The first request was sent for EPOCH; a second one for the key is held.
        let mut w = tomb_sent();
        drive(&mut w, ms(NOW_MS), vec![newer()]);
        // The precondition: a held request of the key, and EPOCH settled below it.
        assert!(matches!(
            w.requests.get(&key()),
            Some(PrefillRequest::Held(_))
        ));
        assert_eq!(w.epoch_floor(&key()), Some(EPOCH));
        let (out, counters) = drive(&mut w, ms(NOW_MS), vec![input.clone()]);
        assert!(
            matches!(w.requests.get(&key()), Some(PrefillRequest::Held(_))),
            "{input:?} ended the newer request"
        );
        assert_eq!(out, answer, "{input:?}");
        assert_eq!(counters.stale_settles_ignored, 1, "{input:?}");
        assert_eq!(counters.dropped(DropReason::StaleEpoch), 1, "{input:?}");
    }
    // A cancel of a newer attempt than the floor is D giving up on the live one: it ends it.
    let mut w = tomb_sent();
    let newer_cancel = cancel(Epoch(EPOCH.0 + 1));
    let (_, counters) = drive(&mut w, ms(NOW_MS), vec![newer(), newer_cancel]);
    assert!(
        w.requests.get(&key()).is_none(),
        "the newer attempt's cancel ends it"
    );
    assert_eq!(counters.stale_settles_ignored, 0);
}

/// Applies `inputs` at `now` (each accepted), checking the invariants after each; returns the
/// outputs and counters they made.
fn drive(w: &mut PrefillTable, now: Time, inputs: Vec<WInput>) -> (Vec<Output>, Counters) {
    let mut fx = Outbox::default();
    for input in inputs {
        apply(w, now, input, &mut fx).unwrap();
        w.check_invariants();
    }
    (fx.out.into_iter().collect(), fx.counters)
}

/// Admission control of P's tombstones: with a 3-record table, three requests ending fill it
/// with young records; while they are young a new request is refused (typed, nothing kept), a
/// cancel for a key P holds nothing for gets no answer (its acknowledgement would need a
/// record), and no record is evicted. Once the records are older than `tombstone_min_life`,
/// work is admitted again and an old record is what makes room.
#[test]
fn young_tombstones_are_never_evicted() {
    let config = Config {
        max_tombstones: 3,
        ..config()
    };
    let life = config.tombstone_min_life();
    let mut w = PrefillTable::new(RANK, &config);
    let mut fx = Outbox::default();
    let start_of = |n: u32| {
        let request = RequestId::new(format!("req-{n}")).unwrap();
        PrefillStart {
            key: PairingKey::new(format!("key-{n}")).unwrap(),
            request,
            blocks: p_blocks(),
        }
    };
    let t0 = ms(T0_MS);
    // Two requests live while one record exists: room for each to leave one.
    w.finished(t0, start_of(1), &mut fx).unwrap();
    w.finished(t0, start_of(2), &mut fx).unwrap();
    w.abort(t0, &RequestId::new("req-1").unwrap(), &mut fx)
        .unwrap();
    w.abort(t0, &RequestId::new("req-2").unwrap(), &mut fx)
        .unwrap();
    w.finished(t0, start_of(3), &mut fx).unwrap();
    w.abort(t0, &RequestId::new("req-3").unwrap(), &mut fx)
        .unwrap();
    assert_eq!(w.tombstones(), 3, "three young records");
    // The precondition: the table is full of young records.
    let young = t0 + life / 2;
    assert_eq!(w.young_tombstones(young), 3);
    let refused = w.finished(young, start_of(4), &mut fx);
    assert!(
        matches!(refused, Err(Rejected::TableFull { .. })),
        "{refused:?}"
    );
    let outputs_before = fx.out.len();
    let unknown = PairingKey::new("key-unknown").unwrap();
    w.on_cancel(young, d(), unknown.clone(), EPOCH, &mut fx);
    assert_eq!(
        fx.out.len(),
        outputs_before,
        "no acknowledgement without a record"
    );
    assert_eq!(fx.counters.dropped(DropReason::TableFull), 1);
    assert_eq!(w.tombstones_evicted(), 0);
    w.check_invariants();
    // Aged past the window: admitted again; the records it evicts are old ones.
    let old = t0 + life;
    w.finished(old, start_of(4), &mut fx).unwrap();
    w.on_cancel(old, d(), unknown.clone(), EPOCH, &mut fx);
    assert!(
        matches!(
            fx.out.back(),
            Some(Output::Send { message: Message::CancelAck(a), .. }) if a.key == unknown
        ),
        "acknowledged once a record can be made"
    );
    assert_eq!(w.tombstones_evicted(), 1, "one old record made room");
    w.check_invariants();
}

/// The bug admission control prevents, shown directly (the sweeps reach it only rarely): with a
/// one-record table, a key sent for EPOCH leaves its floor; another key ending then evicts that
/// young record, the key's next prefill is held, and a late copy of the old registration binds
/// it: P writes the new prefill into blocks D freed after EPOCH. With admission control the
/// other key is refused while the floor is young, and the late copy stays below the floor.
#[test]
fn a_young_floor_evicted_lets_a_late_registration_copy_bind() {
    let small = Config {
        max_tombstones: 1,
        ..config()
    };
    let other = || start_with(RequestId::new("req-other").unwrap(), p_blocks());
    let other = || PrefillStart {
        key: other_key(),
        ..other()
    };
    let next = || start_with(RequestId::new("req-next").unwrap(), p_blocks());
    let run = |mutated: bool| {
        let mut w = setup(
            small.clone(),
            vec![
                WInput::Finished(start()),
                register(EPOCH),
                WInput::WriteCompleted(W1),
            ],
        );
        #[cfg(not(feature = "mutations"))]
        let _ = mutated;
        #[cfg(feature = "mutations")]
        if mutated {
            w.set_mutation(super::super::ActiveMutation(Some(
                super::super::Mutation::EvictYoungTombstones,
            )));
        }
        let mut fx = Outbox::default();
        let now = ms(NOW_MS);
        assert_eq!(
            w.epoch_floor(&key()),
            Some(EPOCH),
            "the precondition: a floor"
        );
        let admitted = w.finished(now, other(), &mut fx).is_ok();
        if admitted {
            w.abort(now, &RequestId::new("req-other").unwrap(), &mut fx)
                .unwrap();
        }
        let held = w.finished(now, next(), &mut fx).is_ok();
        let before = fx.out.len();
        w.on_register(now, d(), registration(&d(), EPOCH), &mut fx);
        let posted = fx
            .out
            .iter()
            .skip(before)
            .any(|o| matches!(o, Output::PostWrite(_)));
        (admitted, held, posted, w.tombstones_evicted())
    };
    assert_eq!(
        run(false),
        (false, false, false, 0),
        "admission control: both prefills wait while the floor is young; the copy is stale"
    );
    #[cfg(feature = "mutations")]
    assert_eq!(
        run(true),
        (true, true, true, 1),
        "without it: the young floor is evicted and the late copy is written"
    );
}

/// A shell that runs late (a stalled process) calls `finished` after a pending registration's
/// wait ended, before the timer: the registration is answered as expired first and never
/// matched — D may already have handed its blocks back, its fence counting on this expiry.
#[test]
fn a_registration_past_its_wait_is_never_matched_even_if_the_timer_is_late() {
    let mut w = pending();
    let mut fx = Outbox::default();
    // The precondition: the registration waits until PENDING_MS, and no timer has run.
    assert!(w.pending.contains_key(&key()));
    let late = ms(PENDING_MS + 1);
    w.finished(late, start(), &mut fx).unwrap();
    w.check_invariants();
    let outputs: Vec<Output> = fx.out.into_iter().collect();
    assert!(
        !outputs.iter().any(|o| matches!(o, Output::PostWrite(_))),
        "no write for an expired registration: {outputs:?}"
    );
    assert!(
        outputs.contains(&write_failed(EPOCH, WriteFailure::RegistrationExpired)),
        "{outputs:?}"
    );
    assert!(matches!(
        w.requests.get(&key()),
        Some(PrefillRequest::Held(_))
    ));
}

/// Issue 19, finding 6: one peer floods P with cancels for keys P never saw. Each cancel P
/// acknowledges writes a young record, and admission control counts young records, so without
/// a budget the flood fills the table: P refuses its own prefills, and another peer's cancels,
/// for `tombstone_min_life`. With the budget the flooding peer gets at most its share
/// (`PeerBudget::peer_cap`) answered; the rest of its flood is left unanswered and counted, and
/// the engine and the other peers keep their room.
#[test]
fn a_cancel_flood_from_one_peer_leaves_room_for_the_engine_and_the_other_peers() {
    use super::budget::PeerBudget;
    let config = Config {
        max_tombstones: 16,
        ..config()
    };
    let share = PeerBudget::peer_cap(&config);
    let now = ms(NOW_MS);
    let made_up = |n: usize| PairingKey::new(format!("made-up-{n}")).unwrap();
    let acked_to = |fx: &Outbox, peer: &PeerAddr, key: &PairingKey| {
        fx.out.iter().any(|o| {
            matches!(o, Output::Send { to, message: Message::CancelAck(a) }
                if to == peer && &a.key == key)
        })
    };
    let run = |mutated: bool| {
        let mut w = PrefillTable::new(RANK, &config);
        #[cfg(not(feature = "mutations"))]
        let _ = mutated;
        #[cfg(feature = "mutations")]
        if mutated {
            w.set_mutation(super::super::ActiveMutation(Some(
                super::super::Mutation::UnboundedPeerTombstones,
            )));
        }
        let mut fx = Outbox::default();
        // The flood: as many cancels as the table has records, for keys P never saw.
        for n in 0..config.max_tombstones {
            w.on_cancel(now, d(), made_up(n), EPOCH, &mut fx);
            w.check_invariants();
        }
        let flood_acked = (0..config.max_tombstones)
            .filter(|&n| acked_to(&fx, &d(), &made_up(n)))
            .count();
        // The precondition: the flooding peer filled (at least) its share with young records.
        assert!(flood_acked >= share, "{flood_acked} of a share of {share}");
        assert!(w.young_tombstones(now) >= share);
        let own = w.finished(now, start(), &mut fx);
        let other = made_up(1_000);
        w.on_cancel(now, d2(), other.clone(), EPOCH, &mut fx);
        w.check_invariants();
        let budget_drops = fx.counters.dropped(DropReason::TombstoneBudget);
        (flood_acked, budget_drops, own, acked_to(&fx, &d2(), &other))
    };
    let flood = config.max_tombstones;
    assert_eq!(
        run(false),
        (share, (flood - share) as u64, Ok(()), true),
        "the flood gets its share answered; the engine's prefill and the other peer's cancel \
         are taken"
    );
    #[cfg(feature = "mutations")]
    {
        let (acked, drops, own, other) = run(true);
        assert_eq!(
            (acked, drops, other),
            (flood, 0, false),
            "no budget: the flood fills it"
        );
        assert!(
            matches!(own, Err(Rejected::TableFull { .. })),
            "the engine's own prefill is refused: {own:?}"
        );
    }
}

/// Issue 19, finding 7: P's memory of a key is scoped by the D run it was written for. D's
/// first incarnation (`old`) left a record of key() at epoch 1 — a give-up (its pending
/// registration when it died), or an ended request whose failure a copy would be told again —
/// and D restarts (`new`); the router retries at epoch 1. Inside the restart window the new
/// run's registrations are left unanswered (any of them may be a late copy of the old run's);
/// past it the old run's record judges nothing: the retry is served, not swallowed, not told
/// the old attempt's failure, and the old give-up does not release the retry's prefill.
#[test]
fn a_restarted_ds_retry_is_not_judged_by_the_old_runs_record() {
    use super::Sender;
    use crate::Incarnation;
    let config = config();
    let (old, new) = (Incarnation(1), Incarnation(2));
    let of = |run| Sender { addr: d(), run };
    let t0 = ms(T0_MS);
    let restart = t0 + config.lease_duration / 2;
    let past_window = restart + config.max_message_delay;
    let retry = || start_with(RequestId::new("req-retry").unwrap(), p_blocks());
    let posted = |fx: &Outbox| fx.out.iter().any(|o| matches!(o, Output::PostWrite(_)));
    let failed = |fx: &Outbox| {
        fx.out.iter().any(|o| {
            matches!(
                o,
                Output::Send {
                    message: Message::WriteFailed(_),
                    ..
                }
            )
        })
    };

    // The old run's registration was pending when it died: a give-up of epoch 1.
    let mut w = PrefillTable::new(RANK, &config);
    let mut fx = Outbox::default();
    w.on_peer_connected(t0, &d(), old);
    w.on_register(t0, of(old), registration(&d(), Epoch(1)), &mut fx);
    w.on_peer_dead(t0, &d(), &mut fx);
    assert_eq!(
        w.tombstone(&key()),
        Some(gave_up(Epoch(1), ReleaseCause::PeerDead)),
        "the precondition: the old run gave epoch 1 up"
    );
    w.on_peer_connected(restart, &d(), new);
    w.finished(restart, retry(), &mut fx).unwrap();
    assert!(
        matches!(w.requests.get(&key()), Some(PrefillRequest::Held(_))),
        "the old run's give-up does not release the retry's blocks"
    );
    let mut fx = Outbox::default();
    w.on_register(restart, of(new), registration(&d(), Epoch(1)), &mut fx);
    assert!(fx.out.is_empty(), "inside the window: no answer, no write");
    assert_eq!(fx.counters.dropped(DropReason::PriorIncarnation), 1);
    w.on_register(past_window, of(new), registration(&d(), Epoch(1)), &mut fx);
    assert!(posted(&fx), "past the window the retry is written");
    w.check_invariants();

    // The old run's request ended in a failure a copy of its registration is told again.
    let mut w = PrefillTable::new(RANK, &config);
    let mut fx = Outbox::default();
    w.on_peer_connected(t0, &d(), old);
    w.finished(t0, start(), &mut fx).unwrap();
    w.on_register(t0, of(old), registration(&d(), Epoch(1)), &mut fx);
    w.on_write_result(t0, W1, Some(WriteFailure::TransferFailed), &mut fx);
    assert!(
        matches!(
            w.tombstone(&key()),
            Some(PrefillTombstone::Ended {
                epoch: Some(Epoch(1)),
                replay: Some(_),
                ..
            })
        ),
        "the precondition: an ended attempt at epoch 1 with a replay"
    );
    w.on_peer_connected(restart, &d(), new);
    let mut fx = Outbox::default();
    w.on_register(past_window, of(new), registration(&d(), Epoch(1)), &mut fx);
    assert!(
        !failed(&fx),
        "not told the old attempt's failure: {:?}",
        fx.out
    );
    assert!(
        w.pending.contains_key(&key()),
        "the retry waits for its prefill"
    );
    w.finished(past_window, retry(), &mut fx).unwrap();
    assert!(posted(&fx), "and is written when it finishes");
    assert!(!w.bound.is_empty());
    w.check_invariants();
}

/// A pending registration is renewed only by the heartbeat of the rank that sent it: another D
/// engine serving the same key (a second decode) must not keep alive a registration whose D may
/// have freed its blocks. Under the deliberate bug `ignore_heartbeat_sender` it is renewed. (The
/// seeded sweeps reached this only through a D freeing by its fence while a second decode kept
/// renewing; since a D asks a rejoined P for proofs instead of waiting out the fence, 20,000 ×
/// 200 push seeds no longer reach it; the simulator's swarm now sets it up on purpose, its
/// orphaned registrations, `sim/tests/stalls.rs::seed_1_…`.)
#[test]
fn another_ranks_heartbeat_never_renews_a_pending_registration() {
    let renewed_by_stranger = |mutation: Option<crate::machine::Mutation>| {
        let mut w = pending();
        #[cfg(feature = "mutations")]
        w.set_mutation(super::super::ActiveMutation(mutation));
        #[cfg(not(feature = "mutations"))]
        let _ = mutation;
        let (_, _, before) = w
            .pending_of(&key())
            .map(|(a, e, t)| (a.clone(), e, t))
            .unwrap();
        let later = ms(T0_MS + 1_000);
        let mut fx = Outbox::default();
        let leases = vec![LeaseRef {
            key: key(),
            epoch: EPOCH,
        }];
        w.on_heartbeat(later, &d2(), leases, &mut fx);
        let (_, _, after) = w
            .pending_of(&key())
            .map(|(a, e, t)| (a.clone(), e, t))
            .unwrap();
        after > before
    };
    assert!(!renewed_by_stranger(None));
    #[cfg(feature = "mutations")]
    assert!(renewed_by_stranger(Some(
        crate::machine::Mutation::IgnoreHeartbeatSender
    )));
}

/// A restarted D's registration for a newer attempt, answered while P's request still held
/// the blocks for the old run's attempt, keeps being answered after that request ends: the
/// ended request's record speaks for the live run, not for the replaced one its blocks were
/// bound to. Before, the record was filed for the replaced run, a copy of the answered
/// registration found it speaking for nobody and waited as a pending registration for a later
/// prefill of the key, in blocks D had freed on the answer (found by the swarm with late
/// registration copies, seed 353786: P stalled with the copies queued and handled the first
/// one before learning the old run's request had ended).
#[test]
fn a_record_filed_after_answering_a_restarted_run_speaks_for_that_run() {
    use super::Sender;
    use crate::Incarnation;
    let config = config();
    let (old, new) = (Incarnation(1), Incarnation(2));
    let of = |run| Sender { addr: d(), run };
    let t0 = ms(T0_MS);
    let restart = t0 + config.write_timeout / 4;
    let past_window = restart + config.max_message_delay;
    let mut w = PrefillTable::new(RANK, &config);
    let mut fx = Outbox::default();
    w.on_peer_connected(t0, &d(), old);
    w.finished(t0, start(), &mut fx).unwrap();
    w.on_register(t0, of(old), registration(&d(), Epoch(1)), &mut fx);
    assert!(
        matches!(w.requests.get(&key()), Some(PrefillRequest::Writing(_))),
        "the precondition: the old run's attempt is being written"
    );
    w.on_peer_connected(restart, &d(), new);
    let mut fx = Outbox::default();
    w.on_register(past_window, of(new), registration(&d(), Epoch(2)), &mut fx);
    assert_eq!(
        fx.out,
        vec![write_failed_to(&d(), Epoch(2), WriteFailure::Unavailable)],
        "the precondition: the new run's attempt is answered while the old one holds the blocks"
    );
    // The old run's write fails: its request ends.
    w.on_write_result(past_window, W1, Some(WriteFailure::TransferFailed), &mut fx);
    assert!(w.requests.get(&key()).is_none(), "the request ended");
    let mut fx = Outbox::default();
    let copy = past_window + config.register_retry_interval;
    w.on_register(copy, of(new), registration(&d(), Epoch(2)), &mut fx);
    assert!(
        !w.pending.contains_key(&key()),
        "a copy of the answered registration never waits for a later prefill: {:?}",
        fx.out
    );
    w.finished(copy, start_with(second_req(), p_blocks()), &mut fx)
        .unwrap();
    assert!(
        !fx.out.iter().any(|o| matches!(o, Output::PostWrite(_))),
        "a later prefill of the key writes nothing to the freed blocks: {:?}",
        fx.out
    );
    w.check_invariants();
}
