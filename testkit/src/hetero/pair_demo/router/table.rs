//! The router's decisions, apart from its connections: which holder ranks answered each
//! request, which will never answer it (a rank restarted past it, or gone), and what the readers
//! are told.
//!
//! Request `i < requests` is a first turn, held by P's ranks (a push's prefill leg or a pull's
//! export); `requests + r`, with turns, is request `r`'s next turn, held by D's ranks (a kept
//! turn). A request is decided once every holder rank either answered it or will not: it is
//! forwarded (holder rank 0's answer) when every holder answered with parameters, and abandoned
//! otherwise — a holder that refused, or went away (its connection closed and no new one came
//! within [`LOST_GRACE`]), cannot serve its part. A rank of either engine that restarts past a
//! request (its `hello` says `start_at`) abandons it, undecided, on both turns: its engine
//! cannot complete it. An abandoned first turn has no next turn.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kvhandoff::KvTransferParams;

/// How long a holder rank whose connection closed may take to come back (a restart says
/// `hello` again) before the router stops waiting for its answers: a restart took under 2 s on
/// a loaded 2-core host.
pub(super) const LOST_GRACE: Duration = Duration::from_secs(10);

/// The engine a rank belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Side {
    Prefill,
    Decode,
}

impl Side {
    /// The side a `hello` names.
    pub(super) fn parse(name: &str) -> Option<Side> {
        match name {
            "prefill" => Some(Side::Prefill),
            "decode" => Some(Side::Decode),
            _ => None,
        }
    }
}

/// What the router decided for one request.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Verdict {
    /// The readers get holder rank 0's answer.
    Forward(Box<KvTransferParams>),
    /// No reader starts it.
    Abandon,
}

/// Why an answer was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// Out of the run, from the side that does not hold the request, or from a rank the side
    /// does not have.
    Bad,
    /// The request was decided already (a rank that came back answering what was given up).
    Late,
}

/// One rank's standing.
#[derive(Debug, Clone, Default)]
struct Standing {
    /// Its connection closed at this time and no new one came.
    lost_since: Option<Instant>,
    /// Lost for longer than [`LOST_GRACE`]: what it has not answered, it never will.
    gone: bool,
}

/// The router's table of answers and decisions.
#[derive(Debug)]
pub(super) struct Table {
    requests: u64,
    decisions: u64,
    prefill_ranks: u32,
    decode_ranks: u32,
    /// Undecided requests' answers so far, by holder rank (`None`: that rank refused).
    answers: BTreeMap<u64, BTreeMap<u32, Option<KvTransferParams>>>,
    decided: BTreeSet<u64>,
    standing: BTreeMap<(Side, u32), Standing>,
}

impl Table {
    /// A table for `requests` first turns (and as many next turns with `turns`).
    pub(super) fn new(requests: u64, turns: bool, prefill_ranks: u32, decode_ranks: u32) -> Table {
        Table {
            requests,
            decisions: if turns {
                requests.saturating_mul(2)
            } else {
                requests
            },
            prefill_ranks,
            decode_ranks,
            answers: BTreeMap::new(),
            decided: BTreeSet::new(),
            standing: BTreeMap::new(),
        }
    }

    /// Whether `side` has a rank `rank`.
    pub(super) fn has_rank(&self, side: Side, rank: u32) -> bool {
        rank < match side {
            Side::Prefill => self.prefill_ranks,
            Side::Decode => self.decode_ranks,
        }
    }

    /// Requests to decide in all.
    pub(super) fn decisions(&self) -> u64 {
        self.decisions
    }

    /// Requests decided so far.
    pub(super) fn decided(&self) -> u64 {
        self.decided.len() as u64
    }

    /// Which side holds request `index`, and how many ranks it has.
    fn holders(&self, index: u64) -> (Side, u32) {
        if index < self.requests {
            (Side::Prefill, self.prefill_ranks)
        } else {
            (Side::Decode, self.decode_ranks)
        }
    }

    /// A rank (re)introduced itself: it runs requests `start_at..` of each turn. The requests
    /// it skips cannot complete on its engine: each one undecided is abandoned, by either side.
    /// Returns the decisions this made.
    pub(super) fn hello(&mut self, side: Side, rank: u32, start_at: u64) -> Vec<(u64, Verdict)> {
        self.standing.insert((side, rank), Standing::default());
        let mut made = Vec::new();
        for first in 0..start_at.min(self.requests) {
            for index in [first, self.requests.saturating_add(first)] {
                if index < self.decisions && self.decided.insert(index) {
                    self.answers.remove(&index);
                    made.push((index, Verdict::Abandon));
                }
            }
        }
        made
    }

    /// With turns: first turn `first` was abandoned, so its next turn is too.
    fn abandon_next_turn(&mut self, first: u64) -> Option<(u64, Verdict)> {
        let next = self.requests.checked_add(first)?;
        if next >= self.decisions || !self.decided.insert(next) {
            return None;
        }
        self.answers.remove(&next);
        Some((next, Verdict::Abandon))
    }

    /// A rank's connection closed at `now` (a later `hello` of the same rank undoes it).
    pub(super) fn lost(&mut self, side: Side, rank: u32, now: Instant) {
        if let Some(standing) = self.standing.get_mut(&(side, rank)) {
            standing.lost_since.get_or_insert(now);
        }
    }

    /// Holder rank `rank` of `side` answered request `index`.
    pub(super) fn answer(
        &mut self,
        side: Side,
        rank: u32,
        index: u64,
        params: Option<KvTransferParams>,
    ) -> Result<Vec<(u64, Verdict)>, Refused> {
        let (holder, ranks) = self.holders(index);
        if index >= self.decisions || holder != side || rank >= ranks {
            return Err(Refused::Bad);
        }
        if self.decided.contains(&index) {
            return Err(Refused::Late);
        }
        self.answers.entry(index).or_default().insert(rank, params);
        Ok(self.settle(index))
    }

    /// At `now`: ranks lost past [`LOST_GRACE`] are gone. Returns the decisions this made.
    pub(super) fn tick(&mut self, now: Instant) -> Vec<(u64, Verdict)> {
        let mut sides = BTreeSet::new();
        for ((side, _), standing) in &mut self.standing {
            let expired = standing
                .lost_since
                .is_some_and(|since| now.saturating_duration_since(since) >= LOST_GRACE);
            if expired && !standing.gone {
                standing.gone = true;
                sides.insert(*side);
            }
        }
        sides
            .into_iter()
            .flat_map(|s| self.settle_side(s))
            .collect()
    }

    /// Ranks that went away for good so far.
    pub(super) fn gone(&self) -> u64 {
        self.standing.values().filter(|s| s.gone).count() as u64
    }

    /// Settles every undecided request `side` holds.
    fn settle_side(&mut self, side: Side) -> Vec<(u64, Verdict)> {
        let range = match side {
            Side::Prefill => 0..self.requests,
            Side::Decode => self.requests..self.decisions,
        };
        let mut made = Vec::new();
        for index in range {
            made.extend(self.settle(index));
        }
        made
    }

    /// Whether holder rank `rank` of `side` will never answer what it has not.
    fn never(&self, side: Side, rank: u32) -> bool {
        self.standing.get(&(side, rank)).is_some_and(|s| s.gone)
    }

    /// Decides request `index` if every holder answered or never will (an abandoned first
    /// turn abandons its next turn too).
    fn settle(&mut self, index: u64) -> Vec<(u64, Verdict)> {
        if self.decided.contains(&index) {
            return Vec::new();
        }
        let (side, ranks) = self.holders(index);
        let empty = BTreeMap::new();
        let answers = self.answers.get(&index).unwrap_or(&empty);
        let mut complete = true;
        for rank in 0..ranks {
            if !answers.contains_key(&rank) && !self.never(side, rank) {
                complete = false;
            }
        }
        if !complete {
            return Vec::new();
        }
        let all = self.answers.remove(&index).unwrap_or_default();
        let verdict = match all.get(&0).cloned().flatten() {
            Some(params) if all.len() == ranks as usize && all.values().all(Option::is_some) => {
                Verdict::Forward(Box::new(params))
            }
            _ => Verdict::Abandon,
        };
        self.decided.insert(index);
        let mut made = Vec::new();
        if verdict == Verdict::Abandon && index < self.requests {
            made.extend(self.abandon_next_turn(index));
        }
        made.insert(0, (index, verdict));
        made
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(port: u16) -> Option<KvTransferParams> {
        Some(KvTransferParams {
            remote_port: Some(port),
            ..KvTransferParams::default()
        })
    }

    fn forward(index: u64, port: u16) -> (u64, Verdict) {
        (
            index,
            Verdict::Forward(Box::new(params(port).unwrap_or_default())),
        )
    }

    #[test]
    fn a_request_is_forwarded_once_every_holder_answered() {
        let mut table = Table::new(4, false, 2, 1);
        table.hello(Side::Prefill, 0, 0);
        table.hello(Side::Prefill, 1, 0);
        assert_eq!(table.answer(Side::Prefill, 1, 0, params(2)), Ok(vec![]));
        assert_eq!(
            table.answer(Side::Prefill, 0, 0, params(1)),
            Ok(vec![forward(0, 1)])
        );
        assert_eq!(
            table.answer(Side::Prefill, 0, 0, params(1)),
            Err(Refused::Late)
        );
        // A refusal by any holder abandons the request.
        assert_eq!(table.answer(Side::Prefill, 0, 1, params(1)), Ok(vec![]));
        assert_eq!(
            table.answer(Side::Prefill, 1, 1, None),
            Ok(vec![(1, Verdict::Abandon)])
        );
        assert_eq!(table.decided(), 2);
    }

    #[test]
    fn answers_out_of_place_are_refused() {
        let mut table = Table::new(4, true, 2, 3);
        // Past the run, from the side that does not hold it, or a rank the side lacks.
        assert_eq!(
            table.answer(Side::Prefill, 0, 8, params(1)),
            Err(Refused::Bad)
        );
        assert_eq!(
            table.answer(Side::Decode, 0, 1, params(1)),
            Err(Refused::Bad)
        );
        assert_eq!(
            table.answer(Side::Prefill, 0, 5, params(1)),
            Err(Refused::Bad)
        );
        assert_eq!(
            table.answer(Side::Decode, 3, 5, params(1)),
            Err(Refused::Bad)
        );
        assert_eq!(table.decisions(), 8);
        assert_eq!(table.decided(), 0);
    }

    #[test]
    fn an_abandoned_first_turn_abandons_its_next_turn() {
        let mut table = Table::new(2, true, 1, 1);
        assert_eq!(
            table.answer(Side::Prefill, 0, 1, None),
            Ok(vec![(1, Verdict::Abandon), (3, Verdict::Abandon)])
        );
        assert_eq!(
            table.answer(Side::Decode, 0, 3, params(5)),
            Err(Refused::Late)
        );
        assert_eq!(
            table.answer(Side::Decode, 0, 2, params(5)),
            Ok(vec![forward(2, 5)])
        );
    }

    #[test]
    fn a_restarted_holder_abandons_what_it_skipped_and_serves_the_rest() {
        let mut table = Table::new(6, true, 2, 1);
        table.hello(Side::Prefill, 0, 0);
        table.hello(Side::Prefill, 1, 0);
        table.hello(Side::Decode, 0, 0);
        // Rank 1 answered request 0, then died; rank 0 answered 0..3.
        assert!(table.answer(Side::Prefill, 1, 0, params(2)).is_ok());
        for index in 0..3 {
            let _ = table.answer(Side::Prefill, 0, index, params(1));
        }
        assert_eq!(table.decided(), 1);
        let now = Instant::now();
        table.lost(Side::Prefill, 1, now);
        // Its restart runs requests 4.. of each turn: first turns 1..4, undecided, and the next
        // turns of 0..4 (6..10) are abandoned.
        let decided = table.hello(Side::Prefill, 1, 4);
        let mut abandoned: Vec<u64> = decided
            .iter()
            .filter(|(_, v)| *v == Verdict::Abandon)
            .map(|(i, _)| *i)
            .collect();
        abandoned.sort_unstable();
        assert_eq!(abandoned, vec![1, 2, 3, 6, 7, 8, 9], "{decided:?}");
        assert_eq!(
            table.answer(Side::Prefill, 0, 3, params(1)),
            Err(Refused::Late)
        );
        // Request 4 waits for the restart's answer, which serves it.
        assert_eq!(table.answer(Side::Prefill, 0, 4, params(1)), Ok(vec![]));
        assert!(table.tick(now + LOST_GRACE).is_empty());
        assert_eq!(
            table.answer(Side::Prefill, 1, 4, params(2)),
            Ok(vec![forward(4, 1)])
        );
        // Next turns (6 + r) are D's: r = 4 goes through.
        assert_eq!(
            table.answer(Side::Decode, 0, 10, params(3)),
            Ok(vec![forward(10, 3)])
        );
    }

    #[test]
    fn a_restarted_reader_abandons_what_it_skipped_on_both_sides() {
        let mut table = Table::new(4, false, 1, 2);
        let _ = table.answer(Side::Prefill, 0, 0, params(1));
        let _ = table.answer(Side::Prefill, 0, 2, params(1));
        assert_eq!(table.decided(), 2);
        // D rank 1 comes back at request 3: P need not hold 1 (nor any other 0..3) for it.
        assert_eq!(table.hello(Side::Decode, 1, 3), vec![(1, Verdict::Abandon)]);
        assert_eq!(
            table.answer(Side::Prefill, 0, 3, params(1)),
            Ok(vec![forward(3, 1)])
        );
    }

    #[test]
    fn a_holder_gone_past_the_grace_abandons_everything_it_did_not_answer() {
        let mut table = Table::new(3, false, 2, 1);
        table.hello(Side::Prefill, 0, 0);
        table.hello(Side::Prefill, 1, 0);
        let _ = table.answer(Side::Prefill, 1, 0, params(2));
        let _ = table.answer(Side::Prefill, 0, 1, params(1));
        let now = Instant::now();
        table.lost(Side::Prefill, 1, now);
        assert!(table.tick(now + LOST_GRACE / 2).is_empty());
        assert_eq!(
            table.tick(now + LOST_GRACE),
            vec![(1, Verdict::Abandon)],
            "request 1 had every other answer; 0 and 2 still wait for rank 0"
        );
        assert_eq!(table.gone(), 1);
        assert_eq!(
            table.answer(Side::Prefill, 0, 0, params(1)),
            Ok(vec![forward(0, 1)])
        );
        assert_eq!(
            table.answer(Side::Prefill, 0, 2, params(1)),
            Ok(vec![(2, Verdict::Abandon)])
        );
        // A rank that comes back answers again from its hello on.
        table.hello(Side::Prefill, 1, 0);
        assert_eq!(table.gone(), 0);
    }
}
