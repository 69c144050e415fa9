//! A run's second turns: every request's KV read back the other way (D's engine holds, P's
//! reads it into its own geometry), every byte checked, counted with the run's first turns.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvhandoff_protocol::hetero::{PairPlan, SideName};

use super::flight::{self, Rank};
use super::{router, HeteroDemoOptions, Tally};
use crate::hetero::handoff::Handoff;

/// What a run's read-back turns run on: the pair planned the other way, each request's
/// read-back, how the readers' routes place their pieces, the router (across processes) and
/// the first request this process runs.
pub(super) struct ReadBack<'a> {
    pub(super) reversed: &'a PairPlan,
    pub(super) back: Vec<Handoff>,
    pub(super) placing: flight::Placing,
    pub(super) router: Option<&'a router::RouterClient>,
    pub(super) first: usize,
    /// How long the holders keep each turn for its read-back.
    pub(super) keep: Duration,
}

/// Every request's next turn, once every first turn ended: the ranks play the pair planned the
/// other way (D's engine holds, P's reads), D keeps each request's blocks and P reads them
/// back into its own geometry, every byte checked. Its errors, leaks and byte errors join the
/// run's.
pub(super) fn read_back_turns(
    options: &HeteroDemoOptions,
    ReadBack {
        reversed,
        back,
        placing,
        router,
        first,
        keep,
    }: ReadBack<'_>,
    ranks: &mut [Rank],
    deadline: Instant,
    tally: &mut Tally,
) -> crate::demo::TurnCounts {
    let swap = |ranks: &mut [Rank]| {
        for rank in ranks.iter_mut() {
            rank.side = match rank.side {
                SideName::Prefill => SideName::Decode,
                SideName::Decode => SideName::Prefill,
            };
        }
    };
    let shared: Vec<flight::Shared> = back
        .into_iter()
        .map(|h| Arc::new(std::sync::Mutex::new(h)))
        .collect();
    let mut turn = Tally::default();
    let pulled = vec![true; shared.len()];
    swap(ranks);
    flight::run_all(
        &shared,
        reversed,
        ranks,
        options.window,
        options.seed ^ 0x7e57_ba11,
        None,
        placing,
        &pulled,
        Some(keep),
        router,
        flight::Pace {
            first,
            gap: Duration::ZERO,
        },
        &mut |_| false,
        deadline,
        &mut turn,
    );
    swap(ranks);
    for error in std::mem::take(&mut turn.errors) {
        tally.error(format!("read-back: {error}"));
    }
    tally.timed_out |= turn.timed_out;
    tally.byte_errors += turn.byte_errors;
    // The read-back's sides are the engines' swapped: its holders are D's ranks.
    tally.leaks.prefill += turn.leaks.decode;
    tally.leaks.decode += turn.leaks.prefill;
    let n = shared.len().saturating_sub(first) as u64;
    crate::demo::TurnCounts {
        conversations: n,
        later_turns: n,
        pulled_from_decode: turn.ready,
        recomputed: turn.failed + turn.decode_missing,
        read_back_verified: turn.verified,
        read_back_bytes: turn.sent_bytes,
        kept: n,
        kept_read: turn.sent,
        kept_unread: turn.released + turn.prefill_missing,
        keep_ttl_ms: keep.as_secs_f64() * 1e3,
        ..crate::demo::TurnCounts::default()
    }
}
