//! Table-driven tests of `ImportRequest`: every (state, input) pair, with the exact next state
//! (or terminal record), outputs (asks sent, reads posted) and counters.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};

use crate::{
    BlockIds, EngineId, Epoch, Message, PairingKey, ReadAsk, ReadRefusal, ReleaseReason, RequestId,
    WriteId,
};

use super::{
    release_message, Asking, Connecting, ImportCommon, ImportCtx, ImportEnded, ImportInput,
    ImportRequest, Reading,
};
use crate::machine::effects::{Outbox, Step};
use crate::machine::read_types::{
    ImportFailure, ImportOutcome, ImportStart, LoadFailurePolicy, ReadOrder, FIRST_READ_ID,
};
use crate::machine::shape::Machine;
use crate::machine::types::{Counters, DropReason, Output, Time};
use crate::machine::{ActiveMutation, Config};
use crate::{PeerAddr, Release};

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

/// When every case's input happens unless it says otherwise.
const NOW_MS: u64 = 1_000;
/// The import's deadline in the fixtures.
const DEADLINE_MS: u64 = 6_000;
/// The `Asking` fixture, as if the ask was sent at NOW: when it is sent again.
const NEXT_ASK_MS: u64 = NOW_MS + 500;
/// The `Reading` fixture, as if granted at NOW: when every read posted has ended.
/// `max_write_life` (2 s) plus `abandon_timeout` (500 ms) for the last report.
const READS_END_MS: u64 = NOW_MS + 2_500;
/// `max_register_retries` of the config.
const ASKS: u32 = 3;
/// The reader's attempt.
const EPOCH: Epoch = Epoch(2);
/// Tokens per block, and tokens of the fixture (the last of its 4 blocks is partly filled).
const BLOCK_TOKENS: u32 = 16;
const TOKENS: u64 = 60;

const FAIL: LoadFailurePolicy = LoadFailurePolicy::Fail;
const RECOMPUTE: LoadFailurePolicy = LoadFailurePolicy::Recompute;

fn config() -> Config {
    // register_retry_interval 500 ms, max_register_retries 3, max_write_life 2 s,
    // read_chunk_blocks 64.
    Config::fast()
}

fn own() -> PeerAddr {
    PeerAddr::new(EngineId::new("decode").unwrap(), 3)
}

fn holder() -> PeerAddr {
    PeerAddr::new(EngineId::new("prefill").unwrap(), 0)
}

fn key() -> PairingKey {
    PairingKey::new("key-1").unwrap()
}

fn request() -> RequestId {
    RequestId::new("req-r").unwrap()
}

/// The `n`th read id a case allocates (every case starts its counter at `FIRST_READ_ID`).
fn rid(n: u64) -> WriteId {
    WriteId(FIRST_READ_ID + n)
}

fn single(ids: &[u32]) -> BlockIds {
    BlockIds::single_group(ids.to_vec())
}

fn groups(groups: &[&[u32]]) -> BlockIds {
    BlockIds {
        groups: groups.iter().map(|g| g.to_vec()).collect(),
    }
}

/// The reader's blocks: one group of four.
const LOCAL: [u32; 4] = [500, 501, 502, 503];

fn common_of(policy: LoadFailurePolicy, blocks: BlockIds, num_tokens: u64) -> ImportCommon {
    ImportCommon {
        request: request(),
        key: key(),
        epoch: EPOCH,
        holder: holder(),
        blocks,
        num_tokens,
        block_tokens: BLOCK_TOKENS,
        policy,
        deadline: ms(DEADLINE_MS),
        trace: crate::TraceId::from_u128(0x7ace),
    }
}

fn common(policy: LoadFailurePolicy) -> ImportCommon {
    common_of(policy, single(&LOCAL), TOKENS)
}

/// Two cache groups of two blocks each.
fn two_groups(policy: LoadFailurePolicy) -> ImportCommon {
    common_of(policy, groups(&[&[500, 501], &[600, 601]]), 32)
}

fn connecting(policy: LoadFailurePolicy) -> ImportRequest {
    ImportRequest::new(common(policy))
}

fn asking_with(policy: LoadFailurePolicy, next_ask: Time, asks_left: u32) -> ImportRequest {
    ImportRequest::Asking(Asking {
        common: common(policy),
        next_ask,
        asks_left,
        asked_at: vec![ms(NOW_MS)],
    })
}

/// `asking` with another ask sent at `at` (a resend).
fn asked_also_at(asking: ImportRequest, at: Time) -> ImportRequest {
    match asking {
        ImportRequest::Asking(mut s) => {
            s.asked_at.push(at);
            ImportRequest::Asking(s)
        }
        other => other,
    }
}

fn asking(policy: LoadFailurePolicy) -> ImportRequest {
    asking_with(policy, ms(NEXT_ASK_MS), ASKS)
}

/// A `Reading` fixture: by default granted at NOW, nothing failed.
struct ReadingAt {
    common: ImportCommon,
    /// (read number, index of its first local block).
    pending: &'static [(u64, usize)],
    first_failed_block: Option<usize>,
    failure: Option<ImportFailure>,
    granted: Time,
    /// When the ask the grant answered was sent.
    asked: Time,
    abandoned: bool,
    /// When the reads' bound falls, if not the grant's.
    reads_end_by: Option<Time>,
}

impl ReadingAt {
    fn new(policy: LoadFailurePolicy, pending: &'static [(u64, usize)]) -> Self {
        ReadingAt::of(common(policy), pending)
    }

    fn of(common: ImportCommon, pending: &'static [(u64, usize)]) -> Self {
        ReadingAt {
            common,
            pending,
            first_failed_block: None,
            failure: None,
            granted: ms(NOW_MS),
            asked: ms(NOW_MS),
            abandoned: false,
            reads_end_by: None,
        }
    }

    /// Granted at `at` instead of NOW.
    fn granted_at(self, at: Time) -> Self {
        ReadingAt {
            granted: at,
            ..self
        }
    }

    /// Under a grant of an ask sent at `at` instead of NOW.
    fn asked_at(self, at: Time) -> Self {
        ReadingAt { asked: at, ..self }
    }

    /// Its unreported reads were abandoned at `at` (the bound): it waits an abandon's
    /// confirmation time for the transport's word.
    fn abandoned_at(self, at: Time) -> Self {
        ReadingAt {
            abandoned: true,
            reads_end_by: Some(at + config().abandon_timeout),
            ..self
        }
    }

    fn reads_end_by(self, at: Time) -> Self {
        ReadingAt {
            reads_end_by: Some(at),
            ..self
        }
    }

    fn failed_from(self, block: usize) -> Self {
        ReadingAt {
            first_failed_block: Some(block),
            ..self
        }
    }

    fn failure(self, failure: ImportFailure) -> Self {
        ReadingAt {
            failure: Some(failure),
            ..self
        }
    }

    fn build(self) -> ImportRequest {
        ImportRequest::Reading(Reading {
            common: self.common,
            pending: self
                .pending
                .iter()
                .map(|&(n, first)| (rid(n), first))
                .collect::<BTreeMap<_, _>>(),
            first_failed_block: self.first_failed_block,
            failure: self.failure,
            reads_end_by: self
                .reads_end_by
                .unwrap_or(self.granted + (ms(READS_END_MS) - ms(NOW_MS))),
            trusted_until: self.asked + crate::machine::read_span(&config()),
            abandoned: self.abandoned,
        })
    }
}

/// What a transition is expected to leave behind.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Live(ImportRequest),
    Ended(ImportEnded),
}

/// An end before any read was posted.
fn ended_unread(
    common: ImportCommon,
    outcome: ImportOutcome,
    release: Option<ReleaseReason>,
) -> Next {
    Next::Ended(ImportEnded {
        common,
        outcome,
        release,
        read: false,
    })
}

/// An end after reads were posted.
fn ended_read(
    common: ImportCommon,
    outcome: ImportOutcome,
    release: Option<ReleaseReason>,
) -> Next {
    Next::Ended(ImportEnded {
        common,
        outcome,
        release,
        read: true,
    })
}

fn failed(failure: ImportFailure) -> ImportOutcome {
    ImportOutcome::Failed(failure)
}

fn recompute(valid_tokens: u64, failure: ImportFailure) -> ImportOutcome {
    ImportOutcome::Recompute {
        valid_tokens,
        failure,
    }
}

fn ask_sent() -> Output {
    ask_sent_n(0)
}

/// The `n`th ask of the attempt (0: the first).
fn ask_sent_n(n: u32) -> Output {
    Output::Send {
        to: holder(),
        message: Message::ReadAsk(ReadAsk {
            key: key(),
            epoch: EPOCH,
            reader_request: request(),
            reader_rank: 3,
            ask: FIRST_ASK.wrapping_add(n),
            trace_id: crate::TraceId::from_u128(0x7ace),
        }),
    }
}

fn read_posted(n: u64, local: BlockIds, remote: BlockIds) -> Output {
    Output::PostRead(Box::new(ReadOrder {
        read: rid(n),
        from: holder(),
        key: key(),
        epoch: EPOCH,
        local,
        remote,
        remote_memory: Vec::new(),
    }))
}

fn no_counters() -> Counters {
    Counters::default()
}

fn dropped(reason: DropReason) -> Counters {
    let mut counters = Counters::default();
    counters.drop(reason);
    counters
}

fn posted(reads: u64) -> Counters {
    Counters {
        reads_posted: reads,
        ..Counters::default()
    }
}

fn abandon(n: u64) -> Output {
    Output::AbandonWrite { write: rid(n) }
}

fn abandoned_reads(n: u64) -> Counters {
    Counters {
        reads_abandoned: n,
        ..Counters::default()
    }
}

fn one_failed_read() -> Counters {
    Counters {
        reads_failed: 1,
        ..Counters::default()
    }
}

struct Case {
    name: &'static str,
    state: ImportRequest,
    now: Time,
    /// `read_chunk_blocks` of the case's config.
    chunk: u32,
    input: ImportInput,
    next: Next,
    outputs: Vec<Output>,
    counters: Counters,
}

fn case(
    name: &'static str,
    state: ImportRequest,
    input: ImportInput,
    next: Next,
    outputs: Vec<Output>,
    counters: Counters,
) -> Case {
    Case {
        name,
        state,
        now: ms(NOW_MS),
        chunk: config().read_chunk_blocks,
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

    fn chunk(self, chunk: u32) -> Case {
        Case { chunk, ..self }
    }
}

fn grant(blocks: BlockIds) -> ImportInput {
    grant_of_ask(blocks, 0)
}

/// The number of the test attempt's first ask: the low bits of its trace id
/// (`ImportCommon::first_ask`).
const FIRST_ASK: u32 = 0x7ace;

/// A grant answering the attempt's `ask`th ask (0: the first).
fn grant_of_ask(blocks: BlockIds, ask: u32) -> ImportInput {
    ImportInput::Grant {
        blocks,
        ask: FIRST_ASK.wrapping_add(ask),
        memory: Vec::new(),
    }
}

fn refused(reason: ReadRefusal) -> ImportInput {
    ImportInput::Refused { reason }
}

fn done(n: u64) -> ImportInput {
    ImportInput::ReadDone { read: rid(n) }
}

fn read_failed(n: u64) -> ImportInput {
    ImportInput::ReadFailed { read: rid(n) }
}

fn cases() -> Vec<Case> {
    use ImportFailure as F;
    use ImportInput as I;
    use ReleaseReason as R;
    let live = Next::Live;
    let aborted = Some(R::Aborted);
    let read_failed_release = Some(R::ReadFailed);
    vec![
        // ---- Connecting: nothing asked, nothing read.
        case(
            "connecting + peer connected: ask, Asking",
            connecting(FAIL),
            I::PeerConnected,
            live(asking(FAIL)),
            vec![ask_sent()],
            no_counters(),
        ),
        case(
            "connecting + connect failed (fail): HandshakeFailed, no release",
            connecting(FAIL),
            I::PeerConnectFailed,
            ended_unread(common(FAIL), failed(F::HandshakeFailed), None),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + connect failed (recompute): recompute all, no release",
            connecting(RECOMPUTE),
            I::PeerConnectFailed,
            ended_unread(common(RECOMPUTE), recompute(0, F::HandshakeFailed), None),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + peer dead: PeerDead, no release",
            connecting(FAIL),
            I::PeerDead,
            ended_unread(common(FAIL), failed(F::PeerDead), None),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + grant: unexpected",
            connecting(FAIL),
            grant(single(&[1, 2, 3, 4])),
            live(connecting(FAIL)),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + refused: unexpected",
            connecting(FAIL),
            refused(ReadRefusal::Busy),
            live(connecting(FAIL)),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + read done: unexpected",
            connecting(FAIL),
            done(0),
            live(connecting(FAIL)),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + read failed: unexpected",
            connecting(FAIL),
            read_failed(0),
            live(connecting(FAIL)),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "connecting + abort (fail): Aborted, release Aborted",
            connecting(FAIL),
            I::Abort,
            ended_unread(common(FAIL), failed(F::Aborted), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + abort (recompute): Aborted whatever the policy",
            connecting(RECOMPUTE),
            I::Abort,
            ended_unread(common(RECOMPUTE), failed(F::Aborted), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + shutdown (recompute): Shutdown whatever the policy",
            connecting(RECOMPUTE),
            I::Shutdown,
            ended_unread(common(RECOMPUTE), failed(F::Shutdown), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "connecting + timeout before the deadline: waits",
            connecting(FAIL),
            I::Timeout,
            live(connecting(FAIL)),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS - 1)),
        case(
            "connecting + timeout at the deadline (fail): Deadline, release Aborted",
            connecting(FAIL),
            I::Timeout,
            ended_unread(common(FAIL), failed(F::Deadline), aborted),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS)),
        case(
            "connecting + timeout after the deadline (recompute): recompute all",
            connecting(RECOMPUTE),
            I::Timeout,
            ended_unread(common(RECOMPUTE), recompute(0, F::Deadline), aborted),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS + 3)),
        // ---- Asking: nothing is read before the grant.
        case(
            "asking + grant, same blocks: one read, Reading",
            asking(FAIL),
            grant(single(&[100, 101, 102, 103])),
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![read_posted(
                0,
                single(&LOCAL),
                single(&[100, 101, 102, 103]),
            )],
            posted(1),
        ),
        case(
            "asking + grant just within a grant's travel after the latest ask: read",
            asking(FAIL),
            grant(single(&[100, 101, 102, 103])),
            live(
                ReadingAt::new(FAIL, &[(0, 0)])
                    .granted_at(ms(NOW_MS + 1_000))
                    .build(),
            ),
            vec![read_posted(
                0,
                single(&LOCAL),
                single(&[100, 101, 102, 103]),
            )],
            posted(1),
        )
        .at(ms(NOW_MS + 1_000)),
        case(
            "asking + grant later than a grant can travel after the latest ask (a stall): \
             nothing read, the holder let go",
            asking(RECOMPUTE),
            grant(single(&[100, 101, 102, 103])),
            ended_unread(
                common(RECOMPUTE),
                recompute(0, F::StaleGrant),
                Some(R::Declined),
            ),
            vec![],
            {
                let mut counters = no_counters();
                counters.stale_grants_refused = 1;
                counters
            },
        )
        .at(ms(NOW_MS + 1_001)),
        case(
            "asking + grant of the first ask, handled after a resend and later than a grant can \
             travel after that ask (a stopped reader resent on its resume): nothing read",
            asked_also_at(asking(RECOMPUTE), ms(NOW_MS + 1_500)),
            grant_of_ask(single(&[100, 101, 102, 103]), 0),
            ended_unread(
                common(RECOMPUTE),
                recompute(0, F::StaleGrant),
                Some(R::Declined),
            ),
            vec![],
            {
                let mut counters = no_counters();
                counters.stale_grants_refused = 1;
                counters
            },
        )
        .at(ms(NOW_MS + 1_600)),
        case(
            "asking + grant of the resend, within a grant's travel after it: read, trusted from \
             the resend",
            asked_also_at(asking(FAIL), ms(NOW_MS + 1_500)),
            grant_of_ask(single(&[100, 101, 102, 103]), 1),
            live(
                ReadingAt::new(FAIL, &[(0, 0)])
                    .granted_at(ms(NOW_MS + 1_600))
                    .asked_at(ms(NOW_MS + 1_500))
                    .build(),
            ),
            vec![read_posted(
                0,
                single(&LOCAL),
                single(&[100, 101, 102, 103]),
            )],
            posted(1),
        )
        .at(ms(NOW_MS + 1_600)),
        case(
            "asking + grant naming an ask never sent (a peer's bug): nothing read, the holder \
             let go",
            asking(RECOMPUTE),
            grant_of_ask(single(&[100, 101, 102, 103]), 7),
            ended_unread(
                common(RECOMPUTE),
                recompute(0, F::StaleGrant),
                Some(R::Declined),
            ),
            vec![],
            {
                let mut counters = no_counters();
                counters.stale_grants_refused = 1;
                counters
            },
        ),
        case(
            "asking + grant naming ask 0, the number an earlier attempt at this key and epoch \
             asked under before its tombstone went (the grant never sent for this attempt, held \
             in a stopped reader's queue; found by the simulator, seed 6974): nothing read, the \
             holder let go",
            asking(RECOMPUTE),
            ImportInput::Grant {
                blocks: single(&[100, 101, 102, 103]),
                ask: 0,
                memory: Vec::new(),
            },
            ended_unread(
                common(RECOMPUTE),
                recompute(0, F::StaleGrant),
                Some(R::Declined),
            ),
            vec![],
            {
                let mut counters = no_counters();
                counters.stale_grants_refused = 1;
                counters
            },
        ),
        case(
            "asking + grant, chunks of 2: two reads in order",
            asking(FAIL),
            grant(single(&[100, 101, 102, 103])),
            live(ReadingAt::new(FAIL, &[(0, 0), (1, 2)]).build()),
            vec![
                read_posted(0, single(&[500, 501]), single(&[100, 101])),
                read_posted(1, single(&[502, 503]), single(&[102, 103])),
            ],
            posted(2),
        )
        .chunk(2),
        case(
            "asking + grant, chunks of 3: the last chunk is short",
            asking(FAIL),
            grant(single(&[100, 101, 102, 103])),
            live(ReadingAt::new(FAIL, &[(0, 0), (1, 3)]).build()),
            vec![
                read_posted(0, single(&[500, 501, 502]), single(&[100, 101, 102])),
                read_posted(1, single(&[503]), single(&[103])),
            ],
            posted(2),
        )
        .chunk(3),
        case(
            "asking + grant, chunks of 1: one read per block",
            asking(RECOMPUTE),
            grant(single(&[100, 101, 102, 103])),
            live(ReadingAt::new(RECOMPUTE, &[(0, 0), (1, 1), (2, 2), (3, 3)]).build()),
            vec![
                read_posted(0, single(&[500]), single(&[100])),
                read_posted(1, single(&[501]), single(&[101])),
                read_posted(2, single(&[502]), single(&[102])),
                read_posted(3, single(&[503]), single(&[103])),
            ],
            posted(4),
        )
        .chunk(1),
        case(
            "asking + grant of more blocks than ours: reads the holder's last blocks",
            asking(FAIL),
            grant(single(&[100, 101, 102, 103, 104, 105])),
            live(ReadingAt::new(FAIL, &[(0, 0), (1, 2)]).build()),
            vec![
                read_posted(0, single(&[500, 501]), single(&[102, 103])),
                read_posted(1, single(&[502, 503]), single(&[104, 105])),
            ],
            posted(2),
        )
        .chunk(2),
        case(
            "asking + grant of fewer blocks than ours: PlanMismatch, release ReadFailed",
            asking(FAIL),
            grant(single(&[100, 101, 102])),
            ended_unread(common(FAIL), failed(F::PlanMismatch), read_failed_release),
            vec![],
            no_counters(),
        ),
        case(
            "asking + grant with another group count: PlanMismatch",
            asking(FAIL),
            grant(groups(&[&[100, 101, 102, 103], &[200, 201, 202, 203]])),
            ended_unread(common(FAIL), failed(F::PlanMismatch), read_failed_release),
            vec![],
            no_counters(),
        ),
        case(
            "asking + mismatched grant (recompute): recompute all",
            asking(RECOMPUTE),
            grant(single(&[])),
            ended_unread(
                common(RECOMPUTE),
                recompute(0, F::PlanMismatch),
                read_failed_release,
            ),
            vec![],
            no_counters(),
        ),
        case(
            "asking + refused (busy): Refused, no release",
            asking(FAIL),
            refused(ReadRefusal::Busy),
            ended_unread(common(FAIL), failed(F::Refused(ReadRefusal::Busy)), None),
            vec![],
            no_counters(),
        ),
        case(
            // The holder's engine may have answered the router before its rank had the export.
            "asking + refused unavailable soon after the first ask: asks again soon",
            asking(FAIL),
            refused(ReadRefusal::Unavailable),
            live(asking_with(
                FAIL,
                ms(NOW_MS + 10) + config().ask_again_after(),
                ASKS,
            )),
            vec![],
            Counters {
                reads_asked_again: 1,
                ..Counters::default()
            },
        )
        .at(ms(NOW_MS + 10)),
        case(
            "asking + refused unavailable a retry interval after the first ask: Refused",
            asking(FAIL),
            refused(ReadRefusal::Unavailable),
            ended_unread(
                common(FAIL),
                failed(F::Refused(ReadRefusal::Unavailable)),
                None,
            ),
            vec![],
            no_counters(),
        )
        .at(ms(NOW_MS) + config().register_retry_interval),
        case(
            "asking + refused unavailable with no ask left: Refused",
            asking_with(FAIL, ms(NEXT_ASK_MS), 0),
            refused(ReadRefusal::Unavailable),
            ended_unread(
                common(FAIL),
                failed(F::Refused(ReadRefusal::Unavailable)),
                None,
            ),
            vec![],
            no_counters(),
        )
        .at(ms(NOW_MS + 10)),
        case(
            "asking + refused near expiry (recompute): recompute all, no release",
            asking(RECOMPUTE),
            refused(ReadRefusal::NearExpiry),
            ended_unread(
                common(RECOMPUTE),
                recompute(0, F::Refused(ReadRefusal::NearExpiry)),
                None,
            ),
            vec![],
            no_counters(),
        ),
        case(
            "asking + peer dead: PeerDead, no release",
            asking(FAIL),
            I::PeerDead,
            ended_unread(common(FAIL), failed(F::PeerDead), None),
            vec![],
            no_counters(),
        ),
        case(
            "asking + peer connected: unchanged",
            asking(FAIL),
            I::PeerConnected,
            live(asking(FAIL)),
            vec![],
            no_counters(),
        ),
        case(
            "asking + connect failed: unchanged",
            asking(FAIL),
            I::PeerConnectFailed,
            live(asking(FAIL)),
            vec![],
            no_counters(),
        ),
        case(
            "asking + read done: unexpected",
            asking(FAIL),
            done(0),
            live(asking(FAIL)),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "asking + read failed: unexpected",
            asking(FAIL),
            read_failed(0),
            live(asking(FAIL)),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "asking + abort: Aborted, release Aborted (a grant may be on its way)",
            asking(RECOMPUTE),
            I::Abort,
            ended_unread(common(RECOMPUTE), failed(F::Aborted), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "asking + shutdown: Shutdown, release Aborted",
            asking(FAIL),
            I::Shutdown,
            ended_unread(common(FAIL), failed(F::Shutdown), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "asking + timeout before the next ask: waits",
            asking(FAIL),
            I::Timeout,
            live(asking(FAIL)),
            vec![],
            no_counters(),
        )
        .at(ms(NEXT_ASK_MS - 1)),
        case(
            "asking + timeout at the next ask: ask again",
            asking(FAIL),
            I::Timeout,
            live(asked_also_at(
                asking_with(FAIL, ms(NEXT_ASK_MS + 500), ASKS - 1),
                ms(NEXT_ASK_MS),
            )),
            vec![ask_sent_n(1)],
            no_counters(),
        )
        .at(ms(NEXT_ASK_MS)),
        case(
            "asking + late timeout after the next ask: ask again, next one from now",
            asking_with(FAIL, ms(NEXT_ASK_MS), 1),
            I::Timeout,
            live(asked_also_at(
                asking_with(FAIL, ms(NEXT_ASK_MS + 200 + 500), 0),
                ms(NEXT_ASK_MS + 200),
            )),
            vec![ask_sent_n(1)],
            no_counters(),
        )
        .at(ms(NEXT_ASK_MS + 200)),
        case(
            "asking + timeout with no asks left: waits for the grant or the deadline",
            asking_with(FAIL, ms(NEXT_ASK_MS), 0),
            I::Timeout,
            live(asking_with(FAIL, ms(NEXT_ASK_MS), 0)),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS - 1)),
        case(
            "asking + timeout at the deadline with an ask due: Deadline, no ask",
            asking_with(FAIL, ms(DEADLINE_MS - 100), 2),
            I::Timeout,
            ended_unread(common(FAIL), failed(F::Deadline), aborted),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS)),
        case(
            "asking + timeout at the deadline (recompute): recompute all, release Aborted",
            asking_with(RECOMPUTE, ms(NEXT_ASK_MS), 0),
            I::Timeout,
            ended_unread(common(RECOMPUTE), recompute(0, F::Deadline), aborted),
            vec![],
            no_counters(),
        )
        .at(ms(DEADLINE_MS)),
        // ---- Asking with two cache groups: one read covers every group.
        case(
            "asking, two groups + grant: one read of every group",
            ImportRequest::Asking(Asking {
                common: two_groups(FAIL),
                next_ask: ms(NEXT_ASK_MS),
                asks_left: ASKS,
                asked_at: vec![ms(NOW_MS)],
            }),
            grant(groups(&[&[100, 101], &[200, 201]])),
            live(ReadingAt::of(two_groups(FAIL), &[(0, 0)]).build()),
            vec![read_posted(
                0,
                groups(&[&[500, 501], &[600, 601]]),
                groups(&[&[100, 101], &[200, 201]]),
            )],
            posted(1),
        )
        .chunk(1),
        case(
            "asking, two groups + longer grant: the holder's last blocks of each group",
            ImportRequest::Asking(Asking {
                common: two_groups(FAIL),
                next_ask: ms(NEXT_ASK_MS),
                asks_left: ASKS,
                asked_at: vec![ms(NOW_MS)],
            }),
            grant(groups(&[&[100, 101, 102], &[200, 201, 202, 203]])),
            live(ReadingAt::of(two_groups(FAIL), &[(0, 0)]).build()),
            vec![read_posted(
                0,
                groups(&[&[500, 501], &[600, 601]]),
                groups(&[&[101, 102], &[202, 203]]),
            )],
            posted(1),
        ),
        case(
            "asking, two groups + one group short: PlanMismatch",
            ImportRequest::Asking(Asking {
                common: two_groups(FAIL),
                next_ask: ms(NEXT_ASK_MS),
                asks_left: ASKS,
                asked_at: vec![ms(NOW_MS)],
            }),
            grant(groups(&[&[100, 101, 102], &[200]])),
            ended_unread(
                two_groups(FAIL),
                failed(F::PlanMismatch),
                read_failed_release,
            ),
            vec![],
            no_counters(),
        ),
        case(
            "asking, two groups + a one-group grant: PlanMismatch",
            ImportRequest::Asking(Asking {
                common: two_groups(FAIL),
                next_ask: ms(NEXT_ASK_MS),
                asks_left: ASKS,
                asked_at: vec![ms(NOW_MS)],
            }),
            grant(single(&[100, 101, 102, 103])),
            ended_unread(
                two_groups(FAIL),
                failed(F::PlanMismatch),
                read_failed_release,
            ),
            vec![],
            no_counters(),
        ),
        // ---- Reading: ends once every read has ended (reported, or past the fabric's bound).
        case(
            "reading + the only read done: Loaded, release ReadDone",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            done(0),
            ended_read(common(FAIL), ImportOutcome::Loaded, Some(R::ReadDone)),
            vec![],
            no_counters(),
        ),
        case(
            "reading + the only read done at the earliest holder fence: Loaded",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            done(0),
            ended_read(common(FAIL), ImportOutcome::Loaded, Some(R::ReadDone)),
            vec![],
            no_counters(),
        )
        .at(ms(NOW_MS + 3_000)),
        case(
            "reading + the only read done after the fabric's bound, past the earliest holder \
             fence (this process stalled): not trusted, nothing valid",
            ReadingAt::new(RECOMPUTE, &[(0, 0)]).build(),
            done(0),
            ended_read(
                common(RECOMPUTE),
                recompute(0, F::LateRead),
                read_failed_release,
            ),
            vec![],
            {
                let mut counters = no_counters();
                counters.late_reads_distrusted = 1;
                counters
            },
        )
        .at(ms(NOW_MS + 3_001)),
        case(
            "reading, peer dead + the last read done after the fabric's bound: not Loaded",
            ReadingAt::new(FAIL, &[(1, 2)]).failure(F::PeerDead).build(),
            done(1),
            ended_read(common(FAIL), failed(F::PeerDead), None),
            vec![],
            {
                let mut counters = no_counters();
                counters.late_reads_distrusted = 1;
                counters
            },
        )
        .at(ms(NOW_MS + 3_001)),
        case(
            "reading + one of two reads done: waits",
            ReadingAt::new(FAIL, &[(0, 0), (1, 2)]).build(),
            done(1),
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            no_counters(),
        ),
        case(
            "reading + unknown read done: dropped",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            done(7),
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "reading + the only read failed (fail): ReadFailed, release ReadFailed",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            read_failed(0),
            ended_read(common(FAIL), failed(F::ReadFailed), read_failed_release),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading + last read failed after the first landed (recompute): 2 blocks valid",
            ReadingAt::new(RECOMPUTE, &[(1, 2)]).build(),
            read_failed(1),
            ended_read(
                common(RECOMPUTE),
                recompute(2 * u64::from(BLOCK_TOKENS), F::ReadFailed),
                read_failed_release,
            ),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading + one of two reads failed: waits, the failed block noted",
            ReadingAt::new(RECOMPUTE, &[(0, 0), (1, 2)]).build(),
            read_failed(1),
            live(ReadingAt::new(RECOMPUTE, &[(0, 0)]).failed_from(2).build()),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading + an earlier chunk fails after a later one did: the lowest counts",
            ReadingAt::new(RECOMPUTE, &[(0, 0)]).failed_from(2).build(),
            read_failed(0),
            ended_read(
                common(RECOMPUTE),
                recompute(0, F::ReadFailed),
                read_failed_release,
            ),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading + a later chunk fails after an earlier one did: the lowest stays",
            ReadingAt::new(RECOMPUTE, &[(3, 3)]).failed_from(1).build(),
            read_failed(3),
            ended_read(
                common(RECOMPUTE),
                recompute(u64::from(BLOCK_TOKENS), F::ReadFailed),
                read_failed_release,
            ),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading + a failed block past the tokens (recompute): valid capped at num_tokens",
            ReadingAt::of(common_of(RECOMPUTE, single(&LOCAL), 20), &[(1, 2)]).build(),
            read_failed(1),
            ended_read(
                common_of(RECOMPUTE, single(&LOCAL), 20),
                recompute(20, F::ReadFailed),
                read_failed_release,
            ),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading + the last read done after one failed (fail): ReadFailed",
            ReadingAt::new(FAIL, &[(0, 0)]).failed_from(2).build(),
            done(0),
            ended_read(common(FAIL), failed(F::ReadFailed), read_failed_release),
            vec![],
            no_counters(),
        ),
        case(
            "reading + unknown read failed: dropped, not counted as a failure",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            read_failed(9),
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            dropped(DropReason::UnknownWrite),
        ),
        case(
            "reading + peer dead: waits for the reads",
            ReadingAt::new(FAIL, &[(0, 0), (1, 2)]).build(),
            I::PeerDead,
            live(
                ReadingAt::new(FAIL, &[(0, 0), (1, 2)])
                    .failure(F::PeerDead)
                    .build(),
            ),
            vec![],
            no_counters(),
        ),
        case(
            "reading, peer dead + the last read done: Loaded, no release",
            ReadingAt::new(FAIL, &[(1, 2)]).failure(F::PeerDead).build(),
            done(1),
            ended_read(common(FAIL), ImportOutcome::Loaded, None),
            vec![],
            no_counters(),
        ),
        case(
            "reading, peer dead + the last read failed (recompute): PeerDead, no release",
            ReadingAt::new(RECOMPUTE, &[(1, 2)])
                .failure(F::PeerDead)
                .build(),
            read_failed(1),
            ended_read(
                common(RECOMPUTE),
                recompute(2 * u64::from(BLOCK_TOKENS), F::PeerDead),
                None,
            ),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading, peer dead + peer dead again: unchanged",
            ReadingAt::new(FAIL, &[(0, 0)]).failure(F::PeerDead).build(),
            I::PeerDead,
            live(ReadingAt::new(FAIL, &[(0, 0)]).failure(F::PeerDead).build()),
            vec![],
            no_counters(),
        ),
        case(
            "reading + abort: waits for the reads",
            ReadingAt::new(RECOMPUTE, &[(0, 0)]).build(),
            I::Abort,
            live(
                ReadingAt::new(RECOMPUTE, &[(0, 0)])
                    .failure(F::Aborted)
                    .build(),
            ),
            vec![],
            no_counters(),
        ),
        case(
            "reading, peer dead + abort: the abort is the reason now",
            ReadingAt::new(FAIL, &[(0, 0)]).failure(F::PeerDead).build(),
            I::Abort,
            live(ReadingAt::new(FAIL, &[(0, 0)]).failure(F::Aborted).build()),
            vec![],
            no_counters(),
        ),
        case(
            "reading, aborted + the last read done: Aborted, release Aborted",
            ReadingAt::new(RECOMPUTE, &[(0, 0)])
                .failure(F::Aborted)
                .build(),
            done(0),
            ended_read(common(RECOMPUTE), failed(F::Aborted), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "reading, aborted + the last read failed (recompute): Aborted, release ReadFailed",
            ReadingAt::new(RECOMPUTE, &[(1, 2)])
                .failure(F::Aborted)
                .build(),
            read_failed(1),
            ended_read(common(RECOMPUTE), failed(F::Aborted), read_failed_release),
            vec![],
            one_failed_read(),
        ),
        case(
            "reading, aborted + peer dead: the abort stays the reason",
            ReadingAt::new(FAIL, &[(0, 0)]).failure(F::Aborted).build(),
            I::PeerDead,
            live(ReadingAt::new(FAIL, &[(0, 0)]).failure(F::Aborted).build()),
            vec![],
            no_counters(),
        ),
        case(
            "reading + shutdown: waits for the reads",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            I::Shutdown,
            live(ReadingAt::new(FAIL, &[(0, 0)]).failure(F::Shutdown).build()),
            vec![],
            no_counters(),
        ),
        case(
            "reading, shut down + the last read done: Shutdown, release Aborted",
            ReadingAt::new(FAIL, &[(0, 0)]).failure(F::Shutdown).build(),
            done(0),
            ended_read(common(FAIL), failed(F::Shutdown), aborted),
            vec![],
            no_counters(),
        ),
        case(
            "reading + timeout before the reads' bound: waits",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            I::Timeout,
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            no_counters(),
        )
        .at(ms(READS_END_MS - 1)),
        // Past the bound a read still unreported was frozen by a stall of this process (or its
        // report is lost): abandoned, and its blocks wait for the transport's word.
        case(
            "reading + timeout at the bound, nothing reported (recompute): both abandoned, waits",
            ReadingAt::new(RECOMPUTE, &[(0, 0), (1, 2)]).build(),
            I::Timeout,
            live(
                ReadingAt::new(RECOMPUTE, &[(0, 0), (1, 2)])
                    .failed_from(0)
                    .failure(F::Deadline)
                    .abandoned_at(ms(READS_END_MS))
                    .build(),
            ),
            vec![abandon(0), abandon(1)],
            abandoned_reads(2),
        )
        .at(ms(READS_END_MS)),
        case(
            "reading + timeout at the bound, the first chunk landed (recompute): the second \
             abandoned, 2 blocks valid so far",
            ReadingAt::new(RECOMPUTE, &[(1, 2)]).build(),
            I::Timeout,
            live(
                ReadingAt::new(RECOMPUTE, &[(1, 2)])
                    .failed_from(2)
                    .failure(F::Deadline)
                    .abandoned_at(ms(READS_END_MS))
                    .build(),
            ),
            vec![abandon(1)],
            abandoned_reads(1),
        )
        .at(ms(READS_END_MS)),
        case(
            "reading + timeout after the bound (fail): abandoned, Deadline noted",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            I::Timeout,
            live(
                ReadingAt::new(FAIL, &[(0, 0)])
                    .failed_from(0)
                    .failure(F::Deadline)
                    .abandoned_at(ms(READS_END_MS + 10))
                    .build(),
            ),
            vec![abandon(0)],
            abandoned_reads(1),
        )
        .at(ms(READS_END_MS + 10)),
        case(
            "reading + timeout at the bound after an earlier read failed: lowest block kept",
            ReadingAt::new(RECOMPUTE, &[(1, 2)]).failed_from(0).build(),
            I::Timeout,
            live(
                ReadingAt::new(RECOMPUTE, &[(1, 2)])
                    .failed_from(0)
                    .failure(F::Deadline)
                    .abandoned_at(ms(READS_END_MS))
                    .build(),
            ),
            vec![abandon(1)],
            abandoned_reads(1),
        )
        .at(ms(READS_END_MS)),
        case(
            "reading, peer dead + timeout at the bound: abandoned, PeerDead stays the reason",
            ReadingAt::new(FAIL, &[(0, 0)]).failure(F::PeerDead).build(),
            I::Timeout,
            live(
                ReadingAt::new(FAIL, &[(0, 0)])
                    .failed_from(0)
                    .failure(F::PeerDead)
                    .abandoned_at(ms(READS_END_MS))
                    .build(),
            ),
            vec![abandon(0)],
            abandoned_reads(1),
        )
        .at(ms(READS_END_MS)),
        case(
            "reading, aborted + timeout at the bound: abandoned, Aborted stays the reason",
            ReadingAt::new(RECOMPUTE, &[(1, 2)])
                .failure(F::Aborted)
                .build(),
            I::Timeout,
            live(
                ReadingAt::new(RECOMPUTE, &[(1, 2)])
                    .failed_from(2)
                    .failure(F::Aborted)
                    .abandoned_at(ms(READS_END_MS))
                    .build(),
            ),
            vec![abandon(1)],
            abandoned_reads(1),
        )
        .at(ms(READS_END_MS)),
        case(
            "reading, abandoned + the transport confirms the read's end: Deadline, all lost",
            ReadingAt::new(RECOMPUTE, &[(0, 0)])
                .failed_from(0)
                .failure(F::Deadline)
                .abandoned_at(ms(READS_END_MS))
                .build(),
            read_failed(0),
            ended_read(
                common(RECOMPUTE),
                recompute(0, F::Deadline),
                read_failed_release,
            ),
            vec![],
            one_failed_read(),
        )
        .at(ms(READS_END_MS + 100)),
        case(
            "reading, abandoned (fail) + the read lands after all, after the fabric's bound \
             (a stall froze it): not trusted, Deadline",
            ReadingAt::new(FAIL, &[(0, 0)])
                .failed_from(0)
                .failure(F::Deadline)
                .abandoned_at(ms(READS_END_MS))
                .build(),
            done(0),
            ended_read(common(FAIL), failed(F::Deadline), read_failed_release),
            vec![],
            {
                let mut counters = no_counters();
                counters.late_reads_distrusted = 1;
                counters
            },
        )
        .at(ms(NOW_MS + 3_001)),
        case(
            "reading, abandoned + timeout, the abandon not confirmed: stuck, the blocks stay",
            ReadingAt::new(FAIL, &[(0, 0)])
                .failed_from(0)
                .failure(F::Deadline)
                .abandoned_at(ms(READS_END_MS))
                .build(),
            I::Timeout,
            live(
                ReadingAt::new(FAIL, &[(0, 0)])
                    .failed_from(0)
                    .failure(F::Deadline)
                    .abandoned_at(ms(READS_END_MS))
                    .reads_end_by(ms(READS_END_MS + 500 + 2_000))
                    .build(),
            ),
            vec![],
            {
                let mut counters = no_counters();
                counters.stuck_reads = 1;
                counters
            },
        )
        .at(ms(READS_END_MS + 500)),
        case(
            "reading + grant again: duplicate",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            grant(single(&[100, 101, 102, 103])),
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            dropped(DropReason::Duplicate),
        ),
        case(
            "reading + refused: dropped as unexpected (the grant in force stands)",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            refused(ReadRefusal::Busy),
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            dropped(DropReason::Unexpected),
        ),
        case(
            "reading + peer connected: unchanged",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            I::PeerConnected,
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            no_counters(),
        ),
        case(
            "reading + connect failed: unchanged",
            ReadingAt::new(FAIL, &[(0, 0)]).build(),
            I::PeerConnectFailed,
            live(ReadingAt::new(FAIL, &[(0, 0)]).build()),
            vec![],
            no_counters(),
        ),
    ]
}

// Adding a state or an input breaks one of these matches: add its name to the list beside it,
// and the coverage test below then demands its cases.
const STATES: [&str; 3] = ["Connecting", "Asking", "Reading"];
const INPUTS: [&str; 10] = [
    "PeerConnected",
    "PeerConnectFailed",
    "PeerDead",
    "Grant",
    "Refused",
    "ReadDone",
    "ReadFailed",
    "Abort",
    "Shutdown",
    "Timeout",
];

fn state_name(state: &ImportRequest) -> &'static str {
    match state {
        ImportRequest::Connecting(Connecting { .. }) => "Connecting",
        ImportRequest::Asking(_) => "Asking",
        ImportRequest::Reading(_) => "Reading",
    }
}

fn input_name(input: &ImportInput) -> &'static str {
    match input {
        ImportInput::PeerConnected => "PeerConnected",
        ImportInput::PeerConnectFailed => "PeerConnectFailed",
        ImportInput::PeerDead => "PeerDead",
        ImportInput::Grant { .. } => "Grant",
        ImportInput::Refused { .. } => "Refused",
        ImportInput::ReadDone { .. } => "ReadDone",
        ImportInput::ReadFailed { .. } => "ReadFailed",
        ImportInput::Abort => "Abort",
        ImportInput::Shutdown => "Shutdown",
        ImportInput::Timeout => "Timeout",
    }
}

/// Runs one transition with `read_chunk_blocks = chunk` and the read counter at `next_read`;
/// gives back the counter's value after it too.
fn step_from(
    state: ImportRequest,
    now: Time,
    chunk: u32,
    next_read: u64,
    input: ImportInput,
) -> (Next, Vec<Output>, Counters, u64) {
    step_mutated(
        state,
        now,
        chunk,
        next_read,
        input,
        ActiveMutation::default(),
    )
}

fn step_mutated(
    state: ImportRequest,
    now: Time,
    chunk: u32,
    next_read: u64,
    input: ImportInput,
    mutation: ActiveMutation,
) -> (Next, Vec<Output>, Counters, u64) {
    let config = Config {
        read_chunk_blocks: chunk,
        ..config()
    };
    let own = own();
    let next_read = Cell::new(next_read);
    let ctx = ImportCtx {
        now,
        own: &own,
        config: &config,
        next_read: &next_read,
        mutation,
    };
    let mut fx = Outbox::default();
    let next = match state.handle(&ctx, input, &mut fx) {
        Step::Live(next) => Next::Live(next),
        Step::Ended(ended) => Next::Ended(ended),
    };
    (
        next,
        fx.out.into_iter().collect(),
        fx.counters,
        next_read.get(),
    )
}

fn step(state: ImportRequest, now: Time, input: ImportInput) -> (Next, Vec<Output>, Counters) {
    let chunk = config().read_chunk_blocks;
    let (next, outputs, counters, _) = step_from(state, now, chunk, FIRST_READ_ID, input);
    (next, outputs, counters)
}

#[test]
fn every_state_and_input() {
    let cases = cases();
    let mut names = BTreeSet::new();
    for case in cases {
        let name = case.name;
        assert!(names.insert(name), "case names are unique: {name}");
        let was_reading = matches!(case.state, ImportRequest::Reading(_));
        let (next, outputs, counters, next_read) =
            step_from(case.state, case.now, case.chunk, FIRST_READ_ID, case.input);
        assert_eq!(next, case.next, "case `{name}`: next state");
        assert_eq!(outputs, case.outputs, "case `{name}`: outputs");
        assert_eq!(counters, case.counters, "case `{name}`: counters");
        // One id per read posted, taken from the table's counter.
        assert_eq!(
            next_read - FIRST_READ_ID,
            counters.reads_posted,
            "case `{name}`: read ids allocated"
        );
        match &next {
            Next::Live(live) => {
                // Every live state has a timer no later than its bound.
                let bound = match live {
                    ImportRequest::Connecting(s) => s.common.deadline,
                    ImportRequest::Asking(s) => s.common.deadline,
                    ImportRequest::Reading(s) => s.reads_end_by,
                };
                assert!(
                    live.next_timer(&config()) <= bound,
                    "case `{name}`: timer bound"
                );
                if let ImportRequest::Reading(s) = live {
                    assert!(
                        !s.pending.is_empty(),
                        "case `{name}`: reading waits for reads"
                    );
                }
            }
            Next::Ended(ended) => {
                // A record says a read was posted exactly when the import had been reading.
                assert_eq!(ended.read, was_reading, "case `{name}`: read flag");
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
    assert_eq!(ms(NEXT_ASK_MS), ms(NOW_MS) + config.register_retry_interval);
    assert_eq!(
        ms(READS_END_MS),
        ms(NOW_MS) + config.max_write_life + config.abandon_timeout
    );
    assert_eq!(ASKS, config.max_register_retries);
    assert_eq!(config.read_chunk_blocks, 64);
    assert!(
        LOCAL.len() <= config.read_chunk_blocks as usize,
        "the default chunk reads the fixture at once"
    );
    assert_eq!(own().rank, 3, "ask_sent names rank 3");
    // The fixture's last block is partly filled.
    assert!(TOKENS > 3 * u64::from(BLOCK_TOKENS) && TOKENS < 4 * u64::from(BLOCK_TOKENS));
}

#[test]
fn timers_and_waiting_per_state() {
    // (state, next timer, waits for a grant, pending reads).
    let table = [
        (connecting(FAIL), ms(DEADLINE_MS), true, vec![]),
        (asking(FAIL), ms(NEXT_ASK_MS), true, vec![]),
        (
            asking_with(FAIL, ms(NEXT_ASK_MS), 0),
            ms(DEADLINE_MS),
            true,
            vec![],
        ),
        // A resend due after the deadline: the deadline comes first.
        (
            asking_with(FAIL, ms(DEADLINE_MS + 300), 2),
            ms(DEADLINE_MS),
            true,
            vec![],
        ),
        (
            ReadingAt::new(FAIL, &[(0, 0), (1, 2)]).build(),
            ms(READS_END_MS),
            false,
            vec![rid(0), rid(1)],
        ),
    ];
    for (state, timer, waits, pending) in table {
        assert_eq!(state.next_timer(&config()), timer, "{state:?}");
        assert_eq!(state.waits_for_grant(), waits, "{state:?}");
        assert_eq!(
            state.pending_reads().copied().collect::<Vec<_>>(),
            pending,
            "{state:?}"
        );
        assert_eq!(state.common().key, key());
    }
}

/// Read ids come from the table's counter, wherever it stands, and move it on.
#[test]
fn read_ids_continue_from_the_counter() {
    let start = FIRST_READ_ID + 41;
    let (next, outputs, counters, next_read) = step_from(
        asking(FAIL),
        ms(NOW_MS),
        2,
        start,
        grant(single(&[100, 101, 102, 103])),
    );
    assert_eq!(next_read, start + 2);
    assert_eq!(counters, posted(2));
    let ids: Vec<WriteId> = outputs
        .iter()
        .map(|o| match o {
            Output::PostRead(order) => order.read,
            other => panic!("only reads are posted: {other:?}"),
        })
        .collect();
    assert_eq!(ids, vec![WriteId(start), WriteId(start + 1)]);
    let Next::Live(ImportRequest::Reading(reading)) = next else {
        panic!("a grant that fits starts the reads");
    };
    assert_eq!(
        reading.pending,
        BTreeMap::from([(WriteId(start), 0), (WriteId(start + 1), 2)])
    );
    assert!(ids.iter().all(|&id| crate::machine::is_read(id)));
}

/// The whole way: connect, ask, a lost grant's resend, the reads in chunks, the release.
#[test]
fn connect_ask_read_release() {
    let next_read = FIRST_READ_ID;
    let (next, outputs, _, next_read) = step_from(
        connecting(RECOMPUTE),
        ms(NOW_MS),
        3,
        next_read,
        ImportInput::PeerConnected,
    );
    assert_eq!(outputs, vec![ask_sent()]);
    let Next::Live(state) = next else { panic!() };
    let (next, outputs, _, next_read) =
        step_from(state, ms(NEXT_ASK_MS), 3, next_read, ImportInput::Timeout);
    assert_eq!(outputs, vec![ask_sent_n(1)], "no grant yet: ask again");
    let Next::Live(state) = next else { panic!() };
    let granted_at = NEXT_ASK_MS + 100;
    let (next, outputs, counters, next_read) = step_from(
        state,
        ms(granted_at),
        3,
        next_read,
        grant(single(&[99, 100, 101, 102, 103])),
    );
    assert_eq!(counters, posted(2));
    assert_eq!(
        outputs,
        vec![
            read_posted(0, single(&[500, 501, 502]), single(&[100, 101, 102])),
            read_posted(1, single(&[503]), single(&[103])),
        ]
    );
    let Next::Live(state) = next else { panic!() };
    assert_eq!(
        state.next_timer(&config()),
        ms(granted_at) + config().max_write_life + config().abandon_timeout
    );
    let (next, _, _, next_read) = step_from(state, ms(granted_at + 10), 3, next_read, done(1));
    let Next::Live(state) = next else {
        panic!("one read still runs")
    };
    let (next, outputs, counters, _) = step_from(state, ms(granted_at + 20), 3, next_read, done(0));
    assert_eq!(outputs, vec![]);
    assert_eq!(counters, no_counters());
    assert_eq!(
        next,
        ended_read(
            common(RECOMPUTE),
            ImportOutcome::Loaded,
            Some(ReleaseReason::ReadDone)
        )
    );
}

/// The release the endpoint sends for an ended import names the attempt.
#[test]
fn release_names_key_and_epoch() {
    assert_eq!(
        release_message(&key(), EPOCH, ReleaseReason::ReadFailed),
        Message::Release(Release {
            key: key(),
            epoch: EPOCH,
            reason: ReleaseReason::ReadFailed,
        })
    );
}

#[test]
fn common_from_start_keeps_the_fields() {
    let start = ImportStart {
        request: request(),
        key: key(),
        epoch: EPOCH,
        holder: holder(),
        blocks: single(&LOCAL),
        remote_blocks: single(&[100, 101, 102, 103]),
        num_tokens: TOKENS,
        block_tokens: BLOCK_TOKENS,
        policy: RECOMPUTE,
        expires: None,
    };
    assert_eq!(
        ImportCommon::from_start(start, ms(DEADLINE_MS), crate::TraceId::from_u128(0x7ace)),
        common(RECOMPUTE)
    );
}

#[test]
#[should_panic(expected = "an import of nothing ends at once")]
fn an_import_has_blocks() {
    let _ = ImportRequest::new(common_of(FAIL, single(&[]), 0));
}

/// Nothing is read before the grant, whatever else happens first.
#[test]
fn no_read_before_the_grant() {
    let inputs = [
        ImportInput::PeerConnected,
        ImportInput::PeerConnectFailed,
        ImportInput::PeerDead,
        refused(ReadRefusal::Busy),
        done(0),
        read_failed(0),
        ImportInput::Abort,
        ImportInput::Shutdown,
        ImportInput::Timeout,
    ];
    for state in [connecting(FAIL), asking(FAIL)] {
        for input in inputs.clone() {
            for t in [NOW_MS, NEXT_ASK_MS, DEADLINE_MS] {
                let (next, outputs, counters) = step(state.clone(), ms(t), input.clone());
                let what = format!("{state:?} + {input:?} at {t} ms");
                assert!(
                    !outputs.iter().any(|o| matches!(o, Output::PostRead(_))),
                    "{what}: no read without a grant"
                );
                assert_eq!(counters.reads_posted, 0, "{what}");
                assert!(
                    !matches!(next, Next::Live(ImportRequest::Reading(_))),
                    "{what}"
                );
            }
        }
    }
}

/// The names of the table's cases whose step differs under `mutation`.
#[cfg(feature = "mutations")]
fn caught_under(mutation: crate::machine::Mutation) -> Vec<&'static str> {
    let mutation = ActiveMutation(Some(mutation));
    let mut caught = Vec::new();
    for case in cases() {
        let (next, outputs, counters, _) = step_mutated(
            case.state,
            case.now,
            case.chunk,
            FIRST_READ_ID,
            case.input,
            mutation,
        );
        if next != case.next || outputs != case.outputs || counters != case.counters {
            caught.push(case.name);
        }
    }
    caught
}

/// The table catches the deliberate bug of a reader that takes one completion for all.
#[cfg(feature = "mutations")]
#[test]
fn the_table_catches_a_release_before_the_reads_end() {
    let caught = caught_under(crate::machine::Mutation::ReleaseBeforeReadsEnd);
    assert!(!caught.is_empty(), "no case tells the mutation apart");
}

/// The table tells apart the deliberate bug of a read counted but never posted: the counter
/// says one read more than the outputs carry (the simulator's accounting of reads posted
/// against the shell's posts is what catches it in a sweep).
#[cfg(feature = "mutations")]
#[test]
fn the_table_tells_apart_a_lost_read_post() {
    let mutation = ActiveMutation(Some(crate::machine::Mutation::LoseLastReadPost));
    let mut caught = Vec::new();
    for case in cases() {
        let (next, outputs, counters, _) = step_mutated(
            case.state,
            case.now,
            case.chunk,
            FIRST_READ_ID,
            case.input,
            mutation,
        );
        let posted = outputs
            .iter()
            .filter(|o| matches!(o, Output::PostRead(_)))
            .count() as u64;
        if counters.reads_posted != posted {
            caught.push(case.name);
        }
        if next != case.next || outputs != case.outputs || counters != case.counters {
            assert!(
                caught.contains(&case.name),
                "{}: differs only by its count",
                case.name
            );
        }
    }
    assert!(!caught.is_empty(), "no case tells the mutation apart");
}

/// The table catches the deliberate bug of a reader that reads under a grant that arrived
/// later than a grant can travel after the ask it answers (`read_on_stale_grant`): exactly the
/// four stale-grant cases (the earlier attempt's grant included).
#[cfg(feature = "mutations")]
#[test]
fn the_table_catches_a_read_on_a_stale_grant() {
    let caught = caught_under(crate::machine::Mutation::ReadOnStaleGrant);
    assert_eq!(caught.len(), 4, "{caught:?}");
    assert!(
        caught
            .iter()
            .all(|name| name.contains("later than a grant can travel")
                || name.contains("never sent")),
        "{caught:?}"
    );
}

/// The table catches the deliberate bug of a reader that trusts a read reported after the
/// fabric's bound (`trust_late_reads`): exactly the three late-report cases.
#[cfg(feature = "mutations")]
#[test]
fn the_table_catches_trusting_a_late_read() {
    let caught = caught_under(crate::machine::Mutation::TrustLateReads);
    assert_eq!(caught.len(), 3, "{caught:?}");
    assert!(
        caught
            .iter()
            .all(|name| name.contains("after the fabric's bound")),
        "{caught:?}"
    );
}

/// The table catches the deliberate bug of a reader that hands its blocks back at the bound
/// although a read is unreported (`return_blocks_at_read_bound`): every at-the-bound case.
#[cfg(feature = "mutations")]
#[test]
fn the_table_catches_blocks_returned_at_the_read_bound() {
    let caught = caught_under(crate::machine::Mutation::ReturnBlocksAtReadBound);
    assert!(caught.len() >= 6, "{caught:?}");
    assert!(
        caught.iter().all(|name| name.contains("timeout")),
        "{caught:?}"
    );
}
