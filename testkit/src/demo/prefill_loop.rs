//! P's engine loop: prompts arrive on the schedule, P "prefills" each by writing the pattern into
//! its blocks (one block per step, so events and due calls are never kept waiting long), calls
//! `request_finished` when the pacing says so (asking for the request's transfer mode, as a
//! router would), and frees the blocks on `BlocksFree` (push) or `ExportEnded` (pull).
//!
//! A later turn of a conversation ([`DemoMode::Bidir`](super::DemoMode::Bidir)) reaches P a
//! think time after D kept the turn before (D's answer comes over the router link). P allocates
//! the turn's blocks, then either reads the prefix D kept into the first of them
//! (`next_turn_allocated`; on `Imported` / `Loaded` every byte read is checked against the
//! pattern) or declines D's blocks (`decline_export`) and recomputes the prefix itself: when the
//! prefix is below the recompute threshold, or when less than the near-expiry margin of D's TTL
//! is left. Then it prefills the rest of the turn and hands it to D like any request.
//!
//! This file has the loop and P's calls; `events` handles what reaches the loop (D's answers
//! over the router link and the connector's events).

mod prefill_events;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use kvhandoff_protocol::{BlockIds, RequestId};

use super::engines::{
    idle, note, FreeList, Pacing, PrefillRecord, PrefillRun, PrefillSide, SideResult, ToDecode,
    ToPrefill, TurnStart, Work,
};
use super::schedule::Planned;
use crate::pattern::pattern_block;
use kvhandoff::{
    ConnectorError, ConnectorEvent, KvCache, KvConnector, KvTransferParams, TransferMode,
};

/// Runs P's side of `plan` on `conn` until every request had its event or `run.deadline`.
pub(crate) fn run_prefill(
    conn: KvConnector,
    kv: KvCache,
    plan: &[Planned],
    run: PrefillRun,
) -> PrefillSide {
    let g = kv.geometry();
    let block_tokens = g.kernel_block_size * g.kernel_blocks_per_logical;
    PrefillLoop {
        conn,
        kv,
        plan,
        run,
        block_tokens,
    }
    .run()
}

struct PrefillLoop<'a> {
    conn: KvConnector,
    kv: KvCache,
    plan: &'a [Planned],
    run: PrefillRun,
    block_tokens: u32,
}

/// P's bookkeeping while the loop runs.
struct State {
    records: Vec<PrefillRecord>,
    /// Each request's blocks, from its allocation until they come back.
    held: Vec<Option<Vec<u32>>>,
    free: FreeList,
    errors: Vec<String>,
    duplicates: u64,
    unknown: u64,
    /// Requests whose event came (or whose call failed, or that never came).
    done: usize,
    /// Prompts due to arrive: turn 1 on the schedule, later turns once D kept the turn before.
    arrivals: BTreeSet<(Instant, usize)>,
    /// D's answers to a keep, by the turn that reads them: the parameters and the earliest end
    /// of D's TTL.
    kept: Vec<Option<(KvTransferParams, Instant)>>,
    /// Fills (and checks of blocks read back), one block per step.
    work: VecDeque<Work>,
    /// Later turns waiting for D's keep of the turn before: when P gives them up.
    keep_waits: BTreeSet<(Instant, usize)>,
}

impl State {
    /// Whether D's keep for later turn `j` came (it is due, or started, or over).
    fn started(&self, j: usize) -> bool {
        self.kept[j].is_some()
            || self.held[j].is_some()
            || self.records[j].turn_start.is_some()
            || self.records[j].abandoned
            || self.arrivals.iter().any(|&(_, k)| k == j)
    }
}

impl PrefillLoop<'_> {
    fn run(mut self) -> PrefillSide {
        let n = self.plan.len();
        let start = self.run.start;
        let mut st = State {
            records: vec![PrefillRecord::default(); n],
            held: vec![None; n],
            free: FreeList::new(self.kv.logical_blocks()),
            errors: Vec::new(),
            duplicates: 0,
            unknown: 0,
            done: 0,
            arrivals: self
                .plan
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.later_turn())
                .map(|(i, p)| (start + p.arrival, i))
                .collect(),
            kept: vec![None; n],
            work: VecDeque::new(),
            keep_waits: BTreeSet::new(),
        };
        let index: BTreeMap<RequestId, usize> = self
            .plan
            .iter()
            .enumerate()
            .map(|(i, p)| (p.prefill_id.clone(), i))
            .collect();
        let mut finishes: BTreeSet<(Instant, usize)> = BTreeSet::new();
        let (mut scratch, mut actual) = (Vec::new(), Vec::new());
        let mut timed_out = false;
        let mut pending: VecDeque<ConnectorEvent> = VecDeque::new();

        while st.done < n {
            let now = Instant::now();
            if now >= self.run.deadline {
                timed_out = true;
                break;
            }
            let answers: Vec<ToPrefill> = match &self.run.link {
                Some(link) => link.from_decode.try_iter().collect(),
                None => Vec::new(),
            };
            for answer in answers {
                self.on_decode(answer, &mut st);
            }
            pending.extend(self.conn.poll_events());
            while let Some(event) = pending.pop_front() {
                self.on_event(event, &index, &mut st);
            }

            // 0. Later turns whose keep never came (D is gone): their conversation is over.
            while let Some(&(until, j)) = st.keep_waits.first() {
                if until > now {
                    break;
                }
                st.keep_waits.pop_first();
                if let (Some(before), false) = (self.plan[j].prev, st.started(j)) {
                    self.abandon_after(before, &mut st);
                }
            }
            // 1. A finish that is due.
            if let Some(&(due, i)) = finishes.first() {
                if due <= now {
                    finishes.pop_first();
                    self.finish(i, &mut st);
                    continue;
                }
            }
            // 2. The next prompt, once it arrived and blocks are free (one prefill at a time).
            if st.work.is_empty() {
                if let Some(&(due, i)) = st.arrivals.first() {
                    if due <= now {
                        if let Some(blocks) = st.free.alloc(self.plan[i].blocks) {
                            st.arrivals.pop_first();
                            self.arrive(i, blocks, &mut st);
                            continue;
                        }
                    }
                }
            }
            // 3. One block of prefill work (or of checking a prefix read back).
            if let Some(w) = st.work.front_mut() {
                let i = w.index;
                let p = &self.plan[i];
                let check = w.next < w.check_until;
                let key = if self.run.corrupt == Some(i) && !check {
                    p.key ^ 0x5a5a
                } else {
                    p.key
                };
                match pattern_block(
                    &self.kv,
                    key,
                    w.blocks[w.next],
                    w.next as u64,
                    check,
                    &mut scratch,
                    &mut actual,
                ) {
                    Ok(wrong) => st.records[i].read_byte_errors += wrong,
                    Err(e) => note(&mut st.errors, format!("P fill: {e}")),
                }
                w.next += 1;
                if w.next == w.blocks.len() {
                    let w = st.work.pop_front().expect("work");
                    if let Some(due) = self.prefilled(&w, &mut st) {
                        finishes.insert((due, w.index));
                    }
                }
                continue;
            }
            // 4. Nothing to do: wait for an event, the next finish or the next arrival.
            let mut until = now + Duration::from_millis(1);
            if let Some(&(due, _)) = finishes.first() {
                until = until.min(due);
            }
            if let Some(&(due, i)) = st.arrivals.first() {
                if st.free.available() >= self.plan[i].blocks {
                    until = until.min(due);
                }
            }
            if let Some(&(due, _)) = st.keep_waits.first() {
                until = until.min(due.max(now));
            }
            pending.extend(idle(&mut self.conn, until.min(self.run.deadline)));
        }
        SideResult {
            records: st.records,
            free: st.free,
            duplicates: st.duplicates,
            unknown: st.unknown,
            errors: st.errors,
            timed_out,
        }
    }

    /// Request `i`'s prompt arrived and got its blocks: turn 1 is prefilled; a later turn reads
    /// its prefix back from D first, or declines D's blocks and recomputes.
    fn arrive(&mut self, i: usize, blocks: Vec<u32>, st: &mut State) {
        st.held[i] = Some(blocks.clone());
        let p = &self.plan[i];
        let fill_all = Work {
            index: i,
            blocks: blocks.clone(),
            next: 0,
            check_until: 0,
        };
        if !p.later_turn() {
            st.work.push_back(fill_all);
            return;
        }
        let Some((params, ttl_end)) = st.kept[i].take() else {
            note(
                &mut st.errors,
                format!("P: {} arrived without D's answer", p.prefill_id),
            );
            st.records[i].turn_start = Some(TurnStart::Recomputed);
            st.work.push_back(fill_all);
            return;
        };
        let left = ttl_end.saturating_duration_since(Instant::now());
        let start = if left < self.run.turns.margin {
            TurnStart::DeclinedNearExpiry
        } else if p.prefix_tokens < self.run.turns.threshold {
            TurnStart::Recomputed
        } else {
            TurnStart::Read
        };
        st.records[i].turn_start = Some(start);
        if start != TurnStart::Read {
            if let Err(e) = self.conn.decline_export(&p.prefill_id, &params) {
                note(
                    &mut st.errors,
                    format!("P decline_export({}): {e}", p.prefill_id),
                );
            }
            st.work.push_back(fill_all);
            return;
        }
        let prefix = blocks[..p.prefix_blocks(self.block_tokens)].to_vec();
        st.records[i].read_call = Some(Instant::now());
        match self.conn.next_turn_allocated(
            &p.prefill_id,
            BlockIds::single_group(prefix),
            u64::from(p.prefix_tokens),
            &params,
        ) {
            // The import's event (`Imported`, or `Refused` after a late verdict) continues.
            Ok(()) => {}
            Err(e) => {
                note(
                    &mut st.errors,
                    format!("P next_turn_allocated({}): {e}", p.prefill_id),
                );
                if !matches!(e, ConnectorError::VerdictLate) {
                    // Nothing was started: recompute.
                    st.work.push_back(fill_all);
                }
            }
        }
    }

    /// Request `i`'s blocks hold its whole prompt (the work `w` is done): notes what the check
    /// of a prefix read back found, and returns when to call `request_finished`.
    fn prefilled(&mut self, w: &Work, st: &mut State) -> Option<Instant> {
        let i = w.index;
        let p = &self.plan[i];
        let r = &mut st.records[i];
        if w.check_until > 0 {
            r.read_verified = r.read_byte_errors == 0;
            if r.read_byte_errors > 0 {
                let wrong = r.read_byte_errors;
                note(
                    &mut st.errors,
                    format!("P: {} read back {wrong} wrong bytes", p.prefill_id),
                );
            }
        }
        let at = Instant::now();
        r.filled_at = Some(at);
        Some(match self.run.pacing {
            Pacing::Router => {
                if let Some(link) = &self.run.link {
                    link.send(ToDecode::PrefillDone { index: i, at });
                }
                at + p.prefill_delay
            }
            Pacing::Clock { hold } => at.max(self.run.start + p.arrival + hold + p.prefill_delay),
        })
    }

    fn finish(&mut self, i: usize, st: &mut State) {
        let p = &self.plan[i];
        let blocks = st.held[i].clone().unwrap_or_default();
        let router = KvTransferParams {
            do_remote_decode: true,
            transfer_mode: Some(p.mode_name().into()),
            ..KvTransferParams::default()
        };
        st.records[i].finish_call = Some(Instant::now());
        // D hears of the answer when it needs it: always when P reports its prefills, for the
        // pulled requests (which need P's block ids) when both follow the clock.
        let tell = matches!(self.run.pacing, Pacing::Router) || p.mode == TransferMode::Pull;
        match self.conn.request_finished(
            &p.prefill_id,
            BlockIds::single_group(blocks),
            u64::from(p.tokens),
            &router,
        ) {
            Ok(params) => {
                if let (Some(link), true) = (&self.run.link, tell) {
                    link.send(ToDecode::Params { index: i, params });
                }
                if self.run.stop_after.is(i) {
                    // Once the answer is on its way to D (which asks for the read at once).
                    if let Some(link) = &self.run.link {
                        link.flush(Duration::from_secs(1));
                    }
                    self.run.stop_after.stop_here();
                }
            }
            Err(e) => {
                note(
                    &mut st.errors,
                    format!("P request_finished({}): {e}", p.prefill_id),
                );
                if let Some(link) = &self.run.link {
                    link.send(ToDecode::Abandoned { index: i });
                }
                self.abandon_after(i, st);
                if matches!(e, ConnectorError::VerdictLate) {
                    // It may still be applied: the blocks stay held until its event (or its
                    // refusal) comes, and that event counts the request as done.
                    return;
                }
                if let Some(blocks) = st.held[i].take() {
                    st.free.release(&BlockIds::single_group(blocks));
                }
                // No event will come: count the request as done (the error fails the verdict).
                st.done += 1;
            }
        }
    }

    /// The conversation of request `i` ends with it: its later turns never come.
    fn abandon_after(&self, i: usize, st: &mut State) {
        let mut next = self.plan[i].next;
        while let Some(j) = next {
            let r = &mut st.records[j];
            if !r.abandoned && st.held[j].is_none() && r.events == 0 {
                r.abandoned = true;
                st.done += 1;
                st.kept[j] = None;
                st.arrivals.retain(|&(_, k)| k != j);
                st.keep_waits.retain(|&(_, k)| k != j);
            }
            next = self.plan[j].next;
        }
    }
}
