//! What the two engine loops share: the block allocator, the per-request records, how a loop is
//! paced, what passes between the engines besides the protocol, and what a loop hands back. The
//! loops themselves are in [`super::prefill_loop`] and [`super::decode_loop`]; each runs one
//! role alone against its own [`KvConnector`].
//!
//! # Pacing
//! - [`Pacing::Router`] (the in-process demo): P tells D, through the router link, when each
//!   prefill is done (`f`) and what `request_finished` answered; P calls at
//!   `f + prefill_delay`, D at `f + decode_delay`.
//! - [`Pacing::Clock`] (`kvhandoff node`, one role per process): both follow the schedule's
//!   clock from their own `start` (the moment their handshake completed, so within a few
//!   milliseconds of each other): P calls at `start + arrival + hold + prefill_delay` (or as
//!   soon as its fill is done, if later: then it ran late), D at
//!   `start + arrival + hold + decode_delay`. A pulled request needs P's answer (its block
//!   ids): it comes over the router link ([`ToDecode::Params`]), and D calls at its time or
//!   when the answer came, whichever is later.
//!
//! # The router link
//! What a router carries between the engines: P's answers for the decode leg ([`ToDecode`]),
//! and, in bidirectional conversations, D's answers for the next turn's prefill leg
//! ([`ToPrefill`]). In process it is a pair of channels; `kvhandoff node` bridges the same
//! channels over a TCP connection of its own (not the protocol's side channel).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_protocol::machine::{
    DecodeFailure, ExportEnd, ExportOutcome, FreeProof, ImportOutcome, ReadProof, ReleaseCause,
};
use kvhandoff_protocol::BlockIds;

use crate::hooks::StopAfter;
use kvhandoff::{ConnectorEvent, KvConnector, KvTransferParams};

/// How long an engine loop sleeps between event polls when it has nothing to do.
const IDLE_POLL: Duration = Duration::from_micros(100);

/// A free list of logical blocks (the mock engine's block pool) that counts double frees.
#[derive(Debug)]
pub struct FreeList {
    free: Vec<u32>,
    is_free: Vec<bool>,
    /// Blocks handed back while already free.
    pub double_frees: u64,
    /// Block ids handed back that the pool never had.
    pub bad_ids: u64,
}

impl FreeList {
    /// A pool of `blocks` free blocks, `0..blocks`.
    pub fn new(blocks: u32) -> Self {
        FreeList {
            free: (0..blocks).rev().collect(),
            is_free: vec![true; blocks as usize],
            double_frees: 0,
            bad_ids: 0,
        }
    }

    /// Blocks free now.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Blocks taken and not yet handed back.
    pub fn in_use(&self) -> u64 {
        (self.is_free.len() - self.free.len()) as u64
    }

    /// Takes `n` blocks; `None` (and nothing taken) if fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.is_free[b as usize] = false;
        }
        Some(blocks)
    }

    /// Returns the blocks of an event; a block that is already free is a double free.
    pub fn release(&mut self, blocks: &BlockIds) {
        for &b in blocks.groups.iter().flatten() {
            match self.is_free.get_mut(b as usize) {
                None => self.bad_ids += 1,
                Some(true) => self.double_frees += 1,
                Some(free) => {
                    *free = true;
                    self.free.push(b);
                }
            }
        }
    }
}

/// What P tells D (the router's decode leg).
#[derive(Debug, Clone)]
pub(crate) enum ToDecode {
    /// Request `i`'s prefill is done at `at`: D allocates at `at + decode_delay`
    /// ([`Pacing::Router`] only).
    PrefillDone { index: usize, at: Instant },
    /// P's `request_finished` answered with these parameters for the decode leg.
    Params {
        index: usize,
        params: KvTransferParams,
    },
    /// P gave up on request `i` (its call failed): D does not allocate it, nor any later turn
    /// of its conversation.
    Abandoned { index: usize },
}

/// What D tells P (the router's next-turn leg, bidirectional conversations only).
#[derive(Debug, Clone)]
pub(crate) enum ToPrefill {
    /// D kept turn `index`'s blocks for the conversation's next turn: `params` is what
    /// `keep_for_next_turn` answered, `since` when D called it (the keep's TTL started no
    /// earlier).
    Kept {
        index: usize,
        params: Box<KvTransferParams>,
        since: Instant,
    },
    /// Turn `index` ended on D without a keep (its handoff failed, or D gave up on it): the
    /// conversation's later turns never come.
    Ended { index: usize },
}

/// P's ends of the router link.
pub(crate) struct PrefillLink {
    to_decode: mpsc::Sender<ToDecode>,
    pub(crate) from_decode: mpsc::Receiver<ToPrefill>,
    /// Messages sent.
    sent: Cell<u64>,
    /// Across processes: messages the bridge wrote to the wire.
    written: Option<Arc<AtomicU64>>,
}

/// D's ends of the router link.
pub(crate) struct DecodeLink {
    pub(crate) from_prefill: mpsc::Receiver<ToDecode>,
    to_prefill: mpsc::Sender<ToPrefill>,
    sent: Cell<u64>,
    written: Option<Arc<AtomicU64>>,
}

/// Waits (at most `limit`) until `written` caught up with `sent`.
fn await_written(sent: u64, written: Option<&Arc<AtomicU64>>, limit: Duration) {
    let Some(written) = written else { return };
    let until = Instant::now() + limit;
    while written.load(Ordering::Acquire) < sent && Instant::now() < until {
        thread::sleep(Duration::from_micros(50));
    }
}

impl PrefillLink {
    /// P's ends of a link whose bridge counts what it wrote in `written` (`None` in process).
    pub(crate) fn new(
        to_decode: mpsc::Sender<ToDecode>,
        from_decode: mpsc::Receiver<ToPrefill>,
        written: Option<Arc<AtomicU64>>,
    ) -> Self {
        PrefillLink {
            to_decode,
            from_decode,
            sent: Cell::new(0),
            written,
        }
    }

    /// Sends `message` to D (lost if the other end is gone).
    pub(crate) fn send(&self, message: ToDecode) {
        self.sent.set(self.sent.get() + 1);
        let _ = self.to_decode.send(message);
    }

    /// Waits (at most `limit`) until everything sent is on the wire.
    pub(crate) fn flush(&self, limit: Duration) {
        await_written(self.sent.get(), self.written.as_ref(), limit);
    }
}

impl DecodeLink {
    /// D's ends of a link whose bridge counts what it wrote in `written` (`None` in process).
    pub(crate) fn new(
        from_prefill: mpsc::Receiver<ToDecode>,
        to_prefill: mpsc::Sender<ToPrefill>,
        written: Option<Arc<AtomicU64>>,
    ) -> Self {
        DecodeLink {
            from_prefill,
            to_prefill,
            sent: Cell::new(0),
            written,
        }
    }

    /// Sends `message` to P (lost if the other end is gone).
    pub(crate) fn send(&self, message: ToPrefill) {
        self.sent.set(self.sent.get() + 1);
        let _ = self.to_prefill.send(message);
    }

    /// Waits (at most `limit`) until everything sent is on the wire.
    pub(crate) fn flush(&self, limit: Duration) {
        await_written(self.sent.get(), self.written.as_ref(), limit);
    }
}

/// Both ends of an in-process router link.
pub(crate) fn router_link() -> (PrefillLink, DecodeLink) {
    let (to_decode, from_prefill) = mpsc::channel();
    let (to_prefill, from_decode) = mpsc::channel();
    (
        PrefillLink::new(to_decode, from_decode, None),
        DecodeLink::new(from_prefill, to_prefill, None),
    )
}

/// How a loop times its calls (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pacing {
    /// P reports each prefill to D over the router link.
    Router,
    /// Both follow the schedule's clock.
    Clock {
        /// The schedule's time from a prompt's arrival to its prefill being done (both sides
        /// must use the same).
        hold: Duration,
    },
}

/// The settings of bidirectional conversations (both sides must agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TurnSettings {
    /// D's `keep_for_next_turn` TTL.
    pub(crate) ttl: Duration,
    /// P reads a prefix back only if it is at least this many tokens.
    pub(crate) threshold: u32,
    /// P reads a prefix back only if at least this much of D's TTL is left.
    pub(crate) margin: Duration,
}

/// One P loop's settings.
pub(crate) struct PrefillRun {
    /// The schedule's time zero.
    pub(crate) start: Instant,
    /// The loop gives up (and reports a time-out) here.
    pub(crate) deadline: Instant,
    /// TEST ONLY: this request's blocks get a wrong pattern.
    pub(crate) corrupt: Option<usize>,
    pub(crate) pacing: Pacing,
    /// The router link (needed by [`Pacing::Router`], pulled requests and conversations).
    pub(crate) link: Option<PrefillLink>,
    pub(crate) turns: TurnSettings,
    /// Conversations: how long after a turn was handed off P waits for D's keep of it before
    /// it gives the conversation's later turns up (D may be gone); `None`: until the run's
    /// deadline.
    pub(crate) answer_wait: Option<Duration>,
    /// TEST HOOK: right after its `request_finished` for this request, the process stops itself
    /// ([`StopAfter::stop_here`]).
    pub(crate) stop_after: StopAfter,
}

/// One D loop's settings.
pub(crate) struct DecodeRun {
    /// The schedule's time zero.
    pub(crate) start: Instant,
    /// The loop gives up (and reports a time-out) here.
    pub(crate) deadline: Instant,
    pub(crate) pacing: Pacing,
    /// The router link (needed by [`Pacing::Router`], pulled requests and conversations).
    pub(crate) link: Option<DecodeLink>,
    /// The decode leg's parameters as a router builds them when P's answer is not known (or
    /// never passes through this process).
    pub(crate) params: KvTransferParams,
    /// [`Pacing::Clock`]: how long after its time a pulled request waits for P's answer before
    /// D gives it up uncalled ([`DecodeRecord::no_answer`]); `None`: until the run's deadline.
    pub(crate) answer_wait: Option<Duration>,
    pub(crate) turns: TurnSettings,
    /// TEST HOOK: right after its last call for this request (`keep_for_next_turn` if it keeps
    /// the request for a next turn, `request_allocated` otherwise), the process stops itself
    /// ([`StopAfter::stop_here`]).
    pub(crate) stop_after: StopAfter,
}

/// How a later turn's prefix came to P.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TurnStart {
    /// P asked D for its kept blocks (`next_turn_allocated`); the import's outcome says how it
    /// went.
    Read,
    /// The prefix was below the recompute threshold: P declined D's blocks and recomputed.
    Recomputed,
    /// Too little of D's TTL was left: P declined D's blocks and recomputed.
    DeclinedNearExpiry,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct PrefillRecord {
    /// When P's fill of the blocks was done.
    pub(crate) filled_at: Option<Instant>,
    pub(crate) finish_call: Option<Instant>,
    pub(crate) events: u32,
    /// The KV went: written (push) or read by D (pull).
    pub(crate) sent: bool,
    /// Push: why the blocks were released unsent.
    pub(crate) released: Option<ReleaseCause>,
    /// Pull: why the export ended unread.
    pub(crate) export_end: Option<ExportEnd>,
    /// Pull: what made it safe to free the exported blocks.
    pub(crate) export_proof: Option<ReadProof>,
    /// When the loop took the request's first event.
    pub(crate) ended_at: Option<Instant>,
    /// A later turn: how its prefix came.
    pub(crate) turn_start: Option<TurnStart>,
    /// A later turn read back: when P called `next_turn_allocated`.
    pub(crate) read_call: Option<Instant>,
    /// A later turn read back: the import's outcome.
    pub(crate) import_outcome: Option<ImportOutcome>,
    /// A later turn read back: when the import's event came.
    pub(crate) read_ended_at: Option<Instant>,
    /// `Imported` events (a later turn read back has exactly one).
    pub(crate) import_events: u32,
    /// Blocks read back from D (on `Loaded`).
    pub(crate) read_blocks: u64,
    /// Bytes of the blocks read back that P found wrong.
    pub(crate) read_byte_errors: u64,
    /// Every byte read back was checked and right.
    pub(crate) read_verified: bool,
    /// The turn never came: the conversation ended before it.
    pub(crate) abandoned: bool,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct DecodeRecord {
    pub(crate) allocate_call: Option<Instant>,
    /// [`DecodePacing::Clock`]: when the schedule has P call `request_finished`, in D's clock.
    pub(crate) planned_finish: Option<Instant>,
    pub(crate) ready_at: Option<Instant>,
    /// When the loop took the request's first event (`BlocksReady` or `Failed`).
    pub(crate) ended_at: Option<Instant>,
    /// When the request was told it failed while its blocks stayed fenced (`DecodeFenced`,
    /// its P declared dead): a real engine would recompute it from then, not from `ended_at`.
    pub(crate) fenced_at: Option<Instant>,
    pub(crate) events: u32,
    pub(crate) ready: bool,
    pub(crate) failed: bool,
    /// Why it failed, for `Failed`.
    pub(crate) failure: Option<DecodeFailure>,
    /// What freed its blocks, for `Failed`.
    pub(crate) proof: Option<FreeProof>,
    /// Pull: the import's outcome when it did not load.
    pub(crate) import_failure: Option<ImportOutcome>,
    pub(crate) verified: bool,
    pub(crate) byte_errors: u64,
    pub(crate) abandoned: bool,
    /// Pulled ([`Pacing::Clock`]): P's answer never came within [`DecodeRun::answer_wait`];
    /// D never called.
    pub(crate) no_answer: bool,
    /// A turn with a next one: when D called `keep_for_next_turn`.
    pub(crate) keep_call: Option<Instant>,
    /// `ExportEnded` events of the kept blocks (exactly one when kept).
    pub(crate) export_events: u32,
    /// How the keep ended.
    pub(crate) export_outcome: Option<ExportOutcome>,
    /// What made it safe to free the kept blocks.
    pub(crate) export_proof: Option<ReadProof>,
    /// When the keep ended.
    pub(crate) export_ended_at: Option<Instant>,
}

/// What one engine loop hands back.
pub(crate) struct SideResult<R> {
    pub(crate) records: Vec<R>,
    pub(crate) free: FreeList,
    pub(crate) duplicates: u64,
    pub(crate) unknown: u64,
    pub(crate) errors: Vec<String>,
    pub(crate) timed_out: bool,
}

/// P's side of a run.
pub(crate) type PrefillSide = SideResult<PrefillRecord>;
/// D's side of a run.
pub(crate) type DecodeSide = SideResult<DecodeRecord>;

/// Records an error (at most 32 are kept).
pub(crate) fn note(errors: &mut Vec<String>, error: String) {
    tracing::warn!(%error, "demo");
    if errors.len() < 32 {
        errors.push(error);
    }
}

/// A step-by-step job on a request's blocks, one block per loop step: blocks before
/// `check_until` are checked against the pattern, the rest filled with it.
#[derive(Debug, Clone)]
pub(crate) struct Work {
    pub(crate) index: usize,
    pub(crate) blocks: Vec<u32>,
    pub(crate) next: usize,
    pub(crate) check_until: usize,
}

/// The note P's loop makes when a pushed request's blocks come back unsent (node reports name
/// it as explained by the typed outcome).
pub(crate) fn released_note(request: &impl std::fmt::Display, cause: ReleaseCause) -> String {
    format!("P: {request} released unsent: {cause:?}")
}

/// The note P's loop makes when a pulled request's export ends unread.
pub(crate) fn unread_note(request: &impl std::fmt::Display, end: ExportEnd) -> String {
    format!("P: {request} export ended unread: {end:?}")
}

/// The note D's loop makes when a pulled request's import does not load.
pub(crate) fn import_note(request: &impl std::fmt::Display, outcome: ImportOutcome) -> String {
    format!("D: {request} import: {outcome:?}")
}

/// The note D's loop makes when a pushed request fails.
pub(crate) fn failed_note(request: &impl std::fmt::Display, reason: DecodeFailure) -> String {
    format!("D: {request} failed: {reason:?}")
}

/// The note D's loop makes when a pulled request's answer never came.
pub(crate) fn no_answer_note(request: &impl std::fmt::Display) -> String {
    format!("D: {request}: P's answer never came; not called")
}

/// Polls `conn` until an event arrives or `until` passes.
pub(crate) fn idle(conn: &mut KvConnector, until: Instant) -> Vec<ConnectorEvent> {
    loop {
        let events = conn.poll_events();
        let now = Instant::now();
        if !events.is_empty() || now >= until {
            return events;
        }
        thread::sleep(IDLE_POLL.min(until - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_list_counts_double_frees() {
        let mut f = FreeList::new(4);
        let a = f.alloc(3).unwrap();
        assert_eq!(f.available(), 1);
        assert!(f.alloc(2).is_none());
        f.release(&BlockIds::single_group(a.clone()));
        assert_eq!(f.double_frees, 0);
        f.release(&BlockIds::single_group(vec![a[0]]));
        assert_eq!(f.double_frees, 1);
        f.release(&BlockIds::single_group(vec![99]));
        assert_eq!(f.bad_ids, 1);
        assert_eq!(f.in_use(), 0);
    }
}
