//! What the two engine loops share: the block allocator, the per-request records, how a loop is
//! paced, and what it hands back. The loops themselves are in [`super::prefill_loop`] and
//! [`super::decode_loop`]; each runs one role alone against its own [`KvConnector`].
//!
//! # Pacing
//! - [`PrefillPacing::Router`] / [`DecodePacing::Router`] (the in-process demo): P tells D,
//!   through a channel playing the router, when each prefill is done (`f`) and what
//!   `request_finished` answered; P calls at `f + prefill_delay`, D at `f + decode_delay`.
//! - [`PrefillPacing::Clock`] / [`DecodePacing::Clock`] (`kvhandoff node`, one role per
//!   process): nothing passes between the engines but the protocol. Both follow the schedule's
//!   clock from their own `start` (the moment their handshake completed, so within a few
//!   milliseconds of each other): P calls at `start + arrival + hold + prefill_delay` (or as
//!   soon as its fill is done, if later: then it ran late), D at
//!   `start + arrival + hold + decode_delay`.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_protocol::machine::{
    DecodeFailure, ExportEnd, FreeProof, ImportOutcome, ReleaseCause,
};
use kvhandoff_protocol::BlockIds;

use kvhandoff::{ConnectorEvent, KvConnector, KvTransferParams};

/// How long an engine loop sleeps between event polls when it has nothing to do.
const IDLE_POLL: Duration = Duration::from_micros(100);

/// A free list of logical blocks that counts double frees.
#[derive(Debug)]
pub(crate) struct FreeList {
    free: Vec<u32>,
    is_free: Vec<bool>,
    pub(crate) double_frees: u64,
    pub(crate) bad_ids: u64,
}

impl FreeList {
    pub(crate) fn new(blocks: u32) -> Self {
        FreeList {
            free: (0..blocks).rev().collect(),
            is_free: vec![true; blocks as usize],
            double_frees: 0,
            bad_ids: 0,
        }
    }

    pub(crate) fn available(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn in_use(&self) -> u64 {
        (self.is_free.len() - self.free.len()) as u64
    }

    pub(crate) fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
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
    pub(crate) fn release(&mut self, blocks: &BlockIds) {
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

/// What P tells D in process (the "router" of the demo).
pub(crate) enum ToDecode {
    /// Request `i`'s prefill is done at `at`: D allocates at `at + decode_delay`.
    PrefillDone { index: usize, at: Instant },
    /// P's `request_finished` answered with these parameters for the decode leg.
    Params {
        index: usize,
        params: KvTransferParams,
    },
    /// P gave up on request `i` (its call failed): D does not allocate it.
    Abandoned { index: usize },
}

/// How P times its `request_finished` calls (see the module docs).
pub(crate) enum PrefillPacing {
    /// In process: P reports each prefill to D through this channel.
    Router(mpsc::Sender<ToDecode>),
    /// One role per process: P follows the schedule's clock.
    Clock {
        /// The schedule's time from a prompt's arrival to its prefill being done.
        hold: Duration,
    },
}

/// How D times its `request_allocated` calls (see the module docs).
pub(crate) enum DecodePacing {
    /// In process: D learns of P's prefills through this channel.
    Router(mpsc::Receiver<ToDecode>),
    /// One role per process: D follows the schedule's clock.
    Clock {
        /// As [`PrefillPacing::Clock::hold`]; both sides must use the same.
        hold: Duration,
    },
}

/// One P loop's settings.
pub(crate) struct PrefillRun {
    /// The schedule's time zero.
    pub(crate) start: Instant,
    /// The loop gives up (and reports a time-out) here.
    pub(crate) deadline: Instant,
    /// TEST ONLY: this request's blocks get a wrong pattern.
    pub(crate) corrupt: Option<usize>,
    pub(crate) pacing: PrefillPacing,
}

/// One D loop's settings.
pub(crate) struct DecodeRun {
    /// The schedule's time zero.
    pub(crate) start: Instant,
    /// The loop gives up (and reports a time-out) here.
    pub(crate) deadline: Instant,
    pub(crate) pacing: DecodePacing,
    /// The decode leg's parameters as a router builds them when P's answer is not known (or
    /// never passes through this process).
    pub(crate) params: KvTransferParams,
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
    /// When the loop took the request's first event.
    pub(crate) ended_at: Option<Instant>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct DecodeRecord {
    pub(crate) allocate_call: Option<Instant>,
    /// [`DecodePacing::Clock`]: when the schedule has P call `request_finished`, in D's clock.
    pub(crate) planned_finish: Option<Instant>,
    pub(crate) ready_at: Option<Instant>,
    /// When the loop took the request's first event (`BlocksReady` or `Failed`).
    pub(crate) ended_at: Option<Instant>,
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
