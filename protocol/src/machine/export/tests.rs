//! Table-driven tests of `ExportRequest`: every (state, input) pair, with the exact next state
//! (or terminal record), outputs and counters.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::{
    BlockIds, EngineId, Epoch, Message, PairingKey, ReadGrant, ReadRefusal, ReadRefused,
    ReleaseReason, RequestId,
};

use super::{
    read_span, released_outcome, ExportCommon, ExportCtx, ExportEnded, ExportInput, ExportRequest,
    Granted, Offered,
};
use crate::machine::effects::{Outbox, Step};
use crate::machine::read_types::{ExportEnd, ExportOutcome, ExportStart, ReadProof};
use crate::machine::shape::Machine;
use crate::machine::types::{Counters, DropReason, Output, Time};
use crate::machine::{ActiveMutation, Config};
use crate::PeerAddr;

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

/// When every case's input happens unless it says otherwise.
const NOW_MS: u64 = 10_000;
/// The fixtures' hard end (`created + 2 × lease + span`: created at 0 with an 8.5 s lease).
const HARD_END_MS: u64 = 20_000;
/// The fixtures' renewal cap (`created + 2 × lease`): the latest the lease can run.
const RENEW_CAP_MS: u64 = HARD_END_MS - SPAN_MS;
/// The `Offered` fixture's lease end.
const LEASE_MS: u64 = 11_000;
/// `max_message_delay + max_write_life` of the config (checked by `fixtures_follow_the_config`).
const SPAN_MS: u64 = 3_000;
/// The `Granted` fixture's fence: granted at NOW.
const FENCE_MS: u64 = NOW_MS + SPAN_MS;
/// The last moment a grant still fits before the hard end.
const LAST_GRANT_MS: u64 = HARD_END_MS - SPAN_MS;
/// `lease_extension` of the config.
const EXTENSION_MS: u64 = 2_000;
/// The reader's attempt in the `Granted` fixture.
const EPOCH: Epoch = Epoch(2);

fn config() -> Config {
    // max_message_delay 1 s, max_write_life 2 s, lease_extension 2 s.
    Config::fast()
}

fn own() -> PeerAddr {
    PeerAddr::new(EngineId::new("prefill").unwrap(), 2)
}

/// The reader the `Granted` fixture is bound to.
fn reader() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 1)
}

/// Another rank of the reader's engine.
fn other_rank() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 4)
}

/// Another engine.
fn stranger() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode-b").unwrap(), 1)
}

fn key() -> PairingKey {
    PairingKey::new("key-1").unwrap()
}

fn blocks() -> BlockIds {
    BlockIds {
        groups: vec![vec![7, 8, 9], vec![20, 21, 22]],
    }
}

fn common() -> ExportCommon {
    ExportCommon {
        request: RequestId::new("req-x").unwrap(),
        key: key(),
        blocks: blocks(),
        num_tokens: 40,
        renew_cap: ms(RENEW_CAP_MS),
        hard_end: ms(HARD_END_MS),
        aborted: false,
    }
}

fn aborted_common() -> ExportCommon {
    ExportCommon {
        aborted: true,
        ..common()
    }
}

fn offered_until(lease_until: Time) -> ExportRequest {
    ExportRequest::new(common(), lease_until)
}

fn offered() -> ExportRequest {
    offered_until(ms(LEASE_MS))
}

/// A `Granted` fixture: by default bound to `reader()` at `EPOCH`, granted at NOW.
struct GrantedAt {
    reader: PeerAddr,
    epoch: Epoch,
    fence: Time,
    aborted: bool,
}

impl GrantedAt {
    fn new() -> Self {
        GrantedAt {
            reader: reader(),
            epoch: EPOCH,
            fence: ms(FENCE_MS),
            aborted: false,
        }
    }

    fn epoch(self, epoch: Epoch) -> Self {
        GrantedAt { epoch, ..self }
    }

    fn fence(self, fence: Time) -> Self {
        GrantedAt { fence, ..self }
    }

    fn aborted(self) -> Self {
        GrantedAt {
            aborted: true,
            ..self
        }
    }

    fn build(self) -> ExportRequest {
        ExportRequest::Granted(Granted {
            common: ExportCommon {
                aborted: self.aborted,
                ..common()
            },
            reader: self.reader,
            epoch: self.epoch,
            fence: self.fence,
            trace: crate::TraceId::from_u128(0x7ace),
        })
    }
}

fn granted() -> ExportRequest {
    GrantedAt::new().build()
}

/// What a transition is expected to leave behind.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Live(ExportRequest),
    Ended(ExportEnded),
}

fn ended_with(common: ExportCommon, outcome: ExportOutcome, proof: ReadProof) -> Next {
    Next::Ended(ExportEnded {
        common,
        outcome,
        proof,
    })
}

fn ended(outcome: ExportOutcome, proof: ReadProof) -> Next {
    ended_with(common(), outcome, proof)
}

fn released(end: ExportEnd, proof: ReadProof) -> Next {
    ended(ExportOutcome::Released(end), proof)
}

fn grant_sent(to: PeerAddr, epoch: Epoch) -> Output {
    Output::Send {
        to,
        message: Message::ReadGrant(Box::new(ReadGrant {
            key: key(),
            epoch,
            holder_rank: 2,
            blocks: blocks(),
            num_tokens: 40,
            ask: 0,
            memory: Vec::new(),
        })),
    }
}

fn refused_sent(to: PeerAddr, epoch: Epoch, reason: ReadRefusal) -> Output {
    Output::Send {
        to,
        message: Message::ReadRefused(ReadRefused {
            key: key(),
            epoch,
            holder_rank: 2,
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

fn one_grant() -> Counters {
    Counters {
        reads_granted: 1,
        ..Counters::default()
    }
}

fn one_near_expiry() -> Counters {
    Counters {
        reads_declined_near_expiry: 1,
        ..Counters::default()
    }
}

fn one_renewal() -> Counters {
    Counters {
        exports_renewed: 1,
        ..Counters::default()
    }
}

fn one_fence_free() -> Counters {
    Counters {
        grant_fence_frees: 1,
        ..Counters::default()
    }
}

struct Case {
    name: &'static str,
    state: ExportRequest,
    now: Time,
    input: ExportInput,
    next: Next,
    outputs: Vec<Output>,
    counters: Counters,
}

fn case(
    name: &'static str,
    state: ExportRequest,
    input: ExportInput,
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

fn ask(from: PeerAddr, epoch: Epoch) -> ExportInput {
    ExportInput::Ask {
        from,
        epoch,
        ask: 0,
        trace: crate::TraceId::from_u128(0x7ace),
    }
}

fn release(from: PeerAddr, epoch: Epoch, reason: ReleaseReason) -> ExportInput {
    ExportInput::Release {
        from,
        epoch,
        reason,
    }
}

fn renew() -> ExportInput {
    ExportInput::Renew { from: reader() }
}

fn cases() -> Vec<Case> {
    use ExportEnd as E;
    use ExportInput as I;
    use ReadProof as P;
    use ReleaseReason as R;
    let live = Next::Live;
    let never = P::NeverGranted;
    vec![
        // ---- Offered: nothing granted, so every end is `NeverGranted`.
        case(
            "offered + ask: grant, Granted with the fence from now",
            offered(),
            ask(reader(), EPOCH),
            live(granted()),
            vec![grant_sent(reader(), EPOCH)],
            one_grant(),
        ),
        case(
            "offered + ask in the last moment of a capped lease: fence just before the hard end",
            offered_until(ms(RENEW_CAP_MS)),
            ask(reader(), Epoch(5)),
            live(
                GrantedAt::new()
                    .epoch(Epoch(5))
                    .fence(ms(HARD_END_MS - 1))
                    .build(),
            ),
            vec![grant_sent(reader(), Epoch(5))],
            one_grant(),
        )
        .at(ms(RENEW_CAP_MS - 1)),
        case(
            "offered + ask once the lease ended (its timer late): Expired, LeaseExpired",
            offered_until(ms(RENEW_CAP_MS)),
            ask(reader(), EPOCH),
            released(E::LeaseExpired, never),
            vec![refused_sent(reader(), EPOCH, ReadRefusal::Expired)],
            no_counters(),
        )
        .at(ms(RENEW_CAP_MS)),
        case(
            "offered + release (read done): Read",
            offered(),
            release(reader(), EPOCH, R::ReadDone),
            ended(ExportOutcome::Read, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + release (read failed): ReaderFailed",
            offered(),
            release(reader(), EPOCH, R::ReadFailed),
            released(E::ReaderFailed, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + release (declined): Declined",
            offered(),
            release(reader(), EPOCH, R::Declined),
            released(E::Declined, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + release (full prefix hit): FullPrefixHit",
            offered(),
            release(reader(), Epoch(1), R::FullPrefixHit),
            released(E::FullPrefixHit, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + release (aborted): ReaderAborted",
            offered(),
            release(reader(), EPOCH, R::Aborted),
            released(E::ReaderAborted, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + release from any peer: ends (nothing was granted to anyone)",
            offered(),
            release(stranger(), Epoch(9), R::Declined),
            released(E::Declined, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + renew: lease moved to now + extension",
            offered(),
            renew(),
            live(offered_until(ms(NOW_MS + EXTENSION_MS))),
            vec![],
            one_renewal(),
        ),
        case(
            "offered + renew that would shorten the lease: unchanged, not counted",
            offered(),
            renew(),
            live(offered()),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS - EXTENSION_MS - 1)),
        case(
            "offered + renew that lands exactly on the lease: unchanged, not counted",
            offered(),
            renew(),
            live(offered()),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS - EXTENSION_MS)),
        case(
            "offered + renew near the renewal cap: capped there",
            offered_until(ms(RENEW_CAP_MS - 500)),
            renew(),
            live(offered_until(ms(RENEW_CAP_MS))),
            vec![],
            one_renewal(),
        )
        .at(ms(RENEW_CAP_MS - 1_000)),
        case(
            "offered + renew at the renewal cap already: unchanged, not counted",
            offered_until(ms(RENEW_CAP_MS)),
            renew(),
            live(offered_until(ms(RENEW_CAP_MS))),
            vec![],
            no_counters(),
        )
        .at(ms(RENEW_CAP_MS - 100)),
        case(
            "offered + abort: Aborted",
            offered(),
            I::Abort,
            released(E::Aborted, never),
            vec![],
            no_counters(),
        ),
        case(
            "offered + timeout before the lease: waits",
            offered(),
            I::Timeout,
            live(offered()),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS - 1)),
        case(
            "offered + timeout at the lease: LeaseExpired",
            offered(),
            I::Timeout,
            released(E::LeaseExpired, never),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS)),
        case(
            "offered + timeout after the lease: LeaseExpired",
            offered(),
            I::Timeout,
            released(E::LeaseExpired, never),
            vec![],
            no_counters(),
        )
        .at(ms(LEASE_MS + 250)),
        // ---- Granted: the blocks come back only with the reader's release or at the fence.
        case(
            "granted + same ask again (same reader, same epoch): same grant again",
            granted(),
            ask(reader(), EPOCH),
            live(granted()),
            vec![grant_sent(reader(), EPOCH)],
            no_counters(),
        ),
        case(
            "granted + ask of a newer epoch: granted afresh, fence from now",
            granted(),
            ask(reader(), Epoch(3)),
            live(
                GrantedAt::new()
                    .epoch(Epoch(3))
                    .fence(ms(NOW_MS + 1_000 + SPAN_MS))
                    .build(),
            ),
            vec![grant_sent(reader(), Epoch(3))],
            one_grant(),
        )
        .at(ms(NOW_MS + 1_000)),
        case(
            "granted + ask of a newer epoch at the last moment: fence at the hard end",
            granted(),
            ask(reader(), Epoch(7)),
            live(
                GrantedAt::new()
                    .epoch(Epoch(7))
                    .fence(ms(HARD_END_MS))
                    .build(),
            ),
            vec![grant_sent(reader(), Epoch(7))],
            one_grant(),
        )
        .at(ms(LAST_GRANT_MS)),
        case(
            "granted + ask of a newer epoch too late: NearExpiry, the grant in force stands",
            granted(),
            ask(reader(), Epoch(3)),
            live(granted()),
            vec![refused_sent(reader(), Epoch(3), ReadRefusal::NearExpiry)],
            one_near_expiry(),
        )
        .at(ms(LAST_GRANT_MS + 1)),
        case(
            "granted + ask of an older epoch: StaleEpoch",
            granted(),
            ask(reader(), Epoch(1)),
            live(granted()),
            vec![refused_sent(reader(), Epoch(1), ReadRefusal::StaleEpoch)],
            no_counters(),
        ),
        case(
            "granted + ask from another rank, same epoch: Busy",
            granted(),
            ask(other_rank(), EPOCH),
            live(granted()),
            vec![refused_sent(other_rank(), EPOCH, ReadRefusal::Busy)],
            no_counters(),
        ),
        case(
            "granted + ask from another engine, newer epoch: Busy",
            granted(),
            ask(stranger(), Epoch(3)),
            live(granted()),
            vec![refused_sent(stranger(), Epoch(3), ReadRefusal::Busy)],
            no_counters(),
        ),
        case(
            "granted + ask from another engine, older epoch: Busy",
            granted(),
            ask(stranger(), Epoch(1)),
            live(granted()),
            vec![refused_sent(stranger(), Epoch(1), ReadRefusal::Busy)],
            no_counters(),
        ),
        case(
            "granted + reader's release (read done): Read, reader released",
            granted(),
            release(reader(), EPOCH, R::ReadDone),
            ended(ExportOutcome::Read, P::ReaderReleased),
            vec![],
            no_counters(),
        ),
        case(
            "granted + reader's release (read failed): ReaderFailed, reader released",
            granted(),
            release(reader(), EPOCH, R::ReadFailed),
            released(E::ReaderFailed, P::ReaderReleased),
            vec![],
            no_counters(),
        ),
        case(
            "granted + reader's release (declined): Declined, reader released",
            granted(),
            release(reader(), EPOCH, R::Declined),
            released(E::Declined, P::ReaderReleased),
            vec![],
            no_counters(),
        ),
        case(
            "granted + reader's release (full prefix hit): FullPrefixHit, reader released",
            granted(),
            release(reader(), EPOCH, R::FullPrefixHit),
            released(E::FullPrefixHit, P::ReaderReleased),
            vec![],
            no_counters(),
        ),
        case(
            "granted + reader's release (aborted): ReaderAborted, reader released",
            granted(),
            release(reader(), EPOCH, R::Aborted),
            released(E::ReaderAborted, P::ReaderReleased),
            vec![],
            no_counters(),
        ),
        case(
            "granted + release from another rank: unexpected, the grant stands",
            granted(),
            release(other_rank(), EPOCH, R::ReadDone),
            live(granted()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "granted + release from another engine: unexpected, the grant stands",
            granted(),
            release(stranger(), EPOCH, R::Declined),
            live(granted()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "granted + reader's release of an older epoch: stale, the grant stands",
            granted(),
            release(reader(), Epoch(1), R::ReadDone),
            live(granted()),
            vec![],
            dropped(DropReason::StaleEpoch),
        ),
        case(
            "granted + reader's release of a newer epoch: future, the grant stands",
            granted(),
            release(reader(), Epoch(3), R::Declined),
            live(granted()),
            vec![],
            dropped(DropReason::FutureEpoch),
        ),
        case(
            "granted + renew: unchanged (the fence is the bound now)",
            granted(),
            renew(),
            live(granted()),
            vec![],
            no_counters(),
        ),
        case(
            "granted + abort: stays granted, aborted",
            granted(),
            I::Abort,
            live(GrantedAt::new().aborted().build()),
            vec![],
            no_counters(),
        ),
        case(
            "granted, aborted + abort again: unchanged",
            GrantedAt::new().aborted().build(),
            I::Abort,
            live(GrantedAt::new().aborted().build()),
            vec![],
            no_counters(),
        ),
        case(
            "granted, aborted + reader's release (read done): Aborted wins, reader released",
            GrantedAt::new().aborted().build(),
            release(reader(), EPOCH, R::ReadDone),
            ended_with(
                aborted_common(),
                ExportOutcome::Released(E::Aborted),
                P::ReaderReleased,
            ),
            vec![],
            no_counters(),
        ),
        case(
            "granted, aborted + reader's release (read failed): Aborted wins, reader released",
            GrantedAt::new().aborted().build(),
            release(reader(), EPOCH, R::ReadFailed),
            ended_with(
                aborted_common(),
                ExportOutcome::Released(E::Aborted),
                P::ReaderReleased,
            ),
            vec![],
            no_counters(),
        ),
        case(
            "granted, aborted + release from another rank: unexpected, still held",
            GrantedAt::new().aborted().build(),
            release(other_rank(), EPOCH, R::ReadDone),
            live(GrantedAt::new().aborted().build()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "granted + timeout before the fence: waits",
            granted(),
            I::Timeout,
            live(granted()),
            vec![],
            no_counters(),
        )
        .at(ms(FENCE_MS - 1)),
        case(
            "granted + timeout at the fence: GrantFenced",
            granted(),
            I::Timeout,
            released(E::GrantFenced, P::GrantFence),
            vec![],
            one_fence_free(),
        )
        .at(ms(FENCE_MS)),
        case(
            "granted + timeout after the fence: GrantFenced",
            granted(),
            I::Timeout,
            released(E::GrantFenced, P::GrantFence),
            vec![],
            one_fence_free(),
        )
        .at(ms(FENCE_MS + 40)),
        case(
            "granted, aborted + timeout at the fence: Aborted wins, freed by the fence",
            GrantedAt::new().aborted().build(),
            I::Timeout,
            ended_with(
                aborted_common(),
                ExportOutcome::Released(E::Aborted),
                P::GrantFence,
            ),
            vec![],
            one_fence_free(),
        )
        .at(ms(FENCE_MS)),
    ]
}

// Adding a state or an input breaks one of these matches: add its name to the list beside it,
// and the coverage test below then demands its cases.
const STATES: [&str; 2] = ["Offered", "Granted"];
const INPUTS: [&str; 5] = ["Ask", "Release", "Renew", "Abort", "Timeout"];

fn state_name(state: &ExportRequest) -> &'static str {
    match state {
        ExportRequest::Offered(Offered { .. }) => "Offered",
        ExportRequest::Granted(Granted { .. }) => "Granted",
    }
}

fn input_name(input: &ExportInput) -> &'static str {
    match input {
        ExportInput::Ask { .. } => "Ask",
        ExportInput::Release { .. } => "Release",
        ExportInput::Renew { .. } => "Renew",
        ExportInput::Abort => "Abort",
        ExportInput::Timeout => "Timeout",
    }
}

fn step(state: ExportRequest, now: Time, input: ExportInput) -> (Next, Vec<Output>, Counters) {
    step_with(state, now, input, ActiveMutation::default())
}

fn step_with(
    state: ExportRequest,
    now: Time,
    input: ExportInput,
    mutation: ActiveMutation,
) -> (Next, Vec<Output>, Counters) {
    let config = config();
    let own = own();
    let ctx = ExportCtx {
        now,
        own: &own,
        config: &config,
        mutation,
    };
    let mut fx = Outbox::default();
    let next = match state.handle(&ctx, input, &mut fx) {
        Step::Live(next) => Next::Live(next),
        Step::Ended(ended) => Next::Ended(ended),
    };
    (next, fx.out.into_iter().collect(), fx.counters)
}

/// The invariant every live export keeps: it is back by its hard end whatever happens.
fn assert_bounded(live: &ExportRequest, what: &str) {
    let hard_end = live.common().hard_end;
    match live {
        ExportRequest::Offered(s) => assert!(s.lease_until <= hard_end, "{what}: lease"),
        ExportRequest::Granted(s) => assert!(s.fence <= hard_end, "{what}: fence"),
    }
    assert!(live.next_timer(&config()) <= hard_end, "{what}: timer");
}

#[test]
fn every_state_and_input() {
    let cases = cases();
    let mut names = BTreeSet::new();
    for case in cases {
        let name = case.name;
        assert!(names.insert(name), "case names are unique: {name}");
        assert_bounded(&case.state, name);
        let (next, outputs, counters) = step(case.state, case.now, case.input);
        assert_eq!(next, case.next, "case `{name}`: next state");
        assert_eq!(outputs, case.outputs, "case `{name}`: outputs");
        assert_eq!(counters, case.counters, "case `{name}`: counters");
        match &next {
            Next::Live(live) => {
                assert_bounded(live, name);
                assert_eq!(live.common().key, key(), "case `{name}`: key");
            }
            Next::Ended(ended) => {
                // Blocks go back to the engine with the record: never lost on the way.
                assert_eq!(ended.common.blocks, blocks(), "case `{name}`: blocks");
            }
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
fn fixtures_follow_the_config() {
    let config = config();
    config.validate().unwrap();
    assert_eq!(read_span(&config), Duration::from_millis(SPAN_MS));
    assert_eq!(ms(FENCE_MS), ms(NOW_MS) + read_span(&config));
    assert_eq!(ms(LAST_GRANT_MS) + read_span(&config), ms(HARD_END_MS));
    assert_eq!(config.lease_extension, Duration::from_millis(EXTENSION_MS));
    assert!(
        ms(LEASE_MS) > ms(NOW_MS),
        "the Offered fixture is live at NOW"
    );
    assert!(ms(FENCE_MS) <= ms(HARD_END_MS));
    assert_eq!(own().rank, 2, "grant_sent and refused_sent name rank 2");
}

#[test]
fn timers_per_state() {
    let table = [
        (offered(), ms(LEASE_MS)),
        (offered_until(ms(RENEW_CAP_MS)), ms(RENEW_CAP_MS)),
        (granted(), ms(FENCE_MS)),
        (GrantedAt::new().aborted().build(), ms(FENCE_MS)),
    ];
    for (state, timer) in table {
        assert_eq!(state.next_timer(&config()), timer, "{state:?}");
        assert_eq!(state.common().key, key());
    }
}

#[test]
fn release_reasons_map_to_outcomes() {
    let table = [
        (ReleaseReason::ReadDone, ExportOutcome::Read),
        (
            ReleaseReason::ReadFailed,
            ExportOutcome::Released(ExportEnd::ReaderFailed),
        ),
        (
            ReleaseReason::Declined,
            ExportOutcome::Released(ExportEnd::Declined),
        ),
        (
            ReleaseReason::FullPrefixHit,
            ExportOutcome::Released(ExportEnd::FullPrefixHit),
        ),
        (
            ReleaseReason::Aborted,
            ExportOutcome::Released(ExportEnd::ReaderAborted),
        ),
    ];
    for (reason, outcome) in table {
        assert_eq!(released_outcome(reason), outcome, "{reason:?}");
    }
}

#[test]
fn hard_end_is_twice_the_lease_and_a_read_span_from_the_start() {
    let start = ExportStart {
        request: RequestId::new("req-x").unwrap(),
        key: key(),
        blocks: blocks(),
        num_tokens: 40,
        lease: Duration::from_millis(RENEW_CAP_MS / 2),
    };
    assert_eq!(ExportCommon::from_start(start, ms(0), &config()), common());
}

#[test]
#[should_panic(expected = "an empty export ends at once")]
fn an_export_has_blocks() {
    let c = ExportCommon {
        blocks: BlockIds::single_group(vec![]),
        ..common()
    };
    let _ = ExportRequest::new(c, ms(LEASE_MS));
}

#[test]
#[should_panic]
fn a_lease_never_starts_past_the_renewal_cap() {
    let _ = offered_until(ms(RENEW_CAP_MS + 1));
}

/// The machine checks its own invariant after every transition that leaves it live.
#[test]
#[should_panic(expected = "a grant never outlives the export's hard end")]
fn a_fence_past_the_hard_end_is_caught() {
    let broken = GrantedAt::new().fence(ms(HARD_END_MS + 1)).build();
    let _ = step(broken, ms(NOW_MS), renew());
}

/// Abort while a reader holds the grant: the blocks stay until the reader's release, whose
/// outcome the abort overrides, and the reader's proof is kept.
#[test]
fn abort_while_granted_waits_for_the_release() {
    let (next, outputs, counters) = step(offered(), ms(NOW_MS), ask(reader(), EPOCH));
    assert_eq!(outputs, vec![grant_sent(reader(), EPOCH)]);
    assert_eq!(counters, one_grant());
    let Next::Live(state) = next else {
        panic!("a grant keeps the export live")
    };
    let (next, outputs, _) = step(state, ms(NOW_MS + 100), ExportInput::Abort);
    assert_eq!(outputs, vec![]);
    let Next::Live(state) = next else {
        panic!("an abort under a grant waits for the reader")
    };
    let (next, _, _) = step(
        state,
        ms(NOW_MS + 200),
        release(reader(), EPOCH, ReleaseReason::ReadDone),
    );
    assert_eq!(
        next,
        ended_with(
            aborted_common(),
            ExportOutcome::Released(ExportEnd::Aborted),
            ReadProof::ReaderReleased,
        )
    );
}

/// Whatever the time, a transition never leaves a live export past its hard end, and every
/// fresh grant it counts is covered by the fence it leaves.
#[test]
fn no_transition_leaves_a_live_export_past_its_hard_end() {
    let states = || {
        vec![
            offered(),
            offered_until(ms(RENEW_CAP_MS)),
            granted(),
            GrantedAt::new().aborted().build(),
            GrantedAt::new()
                .fence(ms(HARD_END_MS))
                .epoch(Epoch(3))
                .build(),
        ]
    };
    let inputs = || {
        vec![
            ask(reader(), Epoch(1)),
            ask(reader(), EPOCH),
            ask(reader(), Epoch(3)),
            ask(reader(), Epoch(4)),
            ask(stranger(), EPOCH),
            release(reader(), EPOCH, ReleaseReason::ReadDone),
            renew(),
            ExportInput::Abort,
            ExportInput::Timeout,
        ]
    };
    for t in (NOW_MS..=HARD_END_MS + 500).step_by(250) {
        for state in states() {
            for input in inputs() {
                let what = format!("{state:?} + {input:?} at {t} ms");
                let (next, _, counters) = step(state.clone(), ms(t), input);
                if let Next::Live(live) = &next {
                    assert_bounded(live, &what);
                    if counters.reads_granted > 0 {
                        let ExportRequest::Granted(g) = live else {
                            panic!("{what}: a grant leaves the export granted");
                        };
                        assert_eq!(g.fence, ms(t) + read_span(&config()), "{what}");
                    }
                }
            }
        }
    }
}

/// A grant sent again (the reader re-asked: the first copy may have been lost) can be read
/// under as well as the first one: a read posted on its arrival runs until `now +
/// max_message_delay + max_write_life`. The fence must cover that, or the blocks may be handed
/// back while that read still runs (found by this test; fixed: the fence moves with the copy,
/// and a copy that could outlive the hard end is refused).
#[test]
fn a_resent_grant_is_covered_by_the_fence() {
    let span = read_span(&config());
    for t in (NOW_MS..=HARD_END_MS).step_by(500) {
        let (next, outputs, _) = step(granted(), ms(t), ask(reader(), EPOCH));
        let Next::Live(ExportRequest::Granted(g)) = next else {
            panic!("a repeated ask leaves the export granted");
        };
        assert!(
            g.fence <= ms(HARD_END_MS),
            "at {t} ms: fence past the hard end"
        );
        if outputs.contains(&grant_sent(reader(), EPOCH)) {
            assert!(
                g.fence >= ms(t) + span,
                "at {t} ms: a grant sent now is fenced at {} only",
                g.fence
            );
        }
    }
}

/// After the engine's abort the blocks are kept only for the reader already granted; a new
/// attempt is refused (`ReadRefusal::Aborted` says exactly this), not granted afresh with a
/// fence from now.
#[test]
fn an_aborted_export_grants_no_new_attempt() {
    let aborted = || GrantedAt::new().aborted().build();
    let (next, outputs, counters) = step(aborted(), ms(NOW_MS + 1_000), ask(reader(), Epoch(3)));
    assert_eq!(next, Next::Live(aborted()));
    assert_eq!(
        outputs,
        vec![refused_sent(reader(), Epoch(3), ReadRefusal::Aborted)]
    );
    assert_eq!(counters, no_counters());
}

/// The table catches the deliberate bug of a fence that forgets the read's own life.
#[cfg(feature = "mutations")]
#[test]
fn the_table_catches_a_short_grant_fence() {
    let mutation = ActiveMutation(Some(crate::machine::Mutation::ShortGrantFence));
    let mut caught = Vec::new();
    for case in cases() {
        let (next, outputs, counters) = step_with(case.state, case.now, case.input, mutation);
        if next != case.next || outputs != case.outputs || counters != case.counters {
            caught.push(case.name);
        }
    }
    assert!(!caught.is_empty(), "no case tells the mutation apart");
}

/// The table tells apart the deliberate bug of a fence sized with the quarantine, which moves
/// the hard end with it: the machine's own check passes on every case (nothing panics), so
/// only a checker that remembers the hard end promised at the start (the simulator's L3) can
/// catch it.
#[cfg(feature = "mutations")]
#[test]
fn the_table_tells_apart_a_long_grant_fence() {
    let mutation = ActiveMutation(Some(crate::machine::Mutation::LongGrantFence));
    let mut caught = Vec::new();
    for case in cases() {
        let (next, outputs, counters) = step_with(case.state, case.now, case.input, mutation);
        if next != case.next || outputs != case.outputs || counters != case.counters {
            caught.push(case.name);
        }
    }
    assert!(!caught.is_empty(), "no case tells the mutation apart");
}
