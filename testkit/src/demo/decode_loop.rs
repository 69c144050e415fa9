//! D's engine loop: allocates blocks for each request when the pacing says so and calls
//! `request_allocated` (with the decode leg's parameters as a router builds them, or P's answer
//! when it came), then, on `BlocksReady` (push) or `Imported` / `Loaded` (pull), checks every
//! byte of every block against the pattern (one block per step) and frees the blocks ("the
//! decode is over"). A pulled request needs P's answer (its `remote_block_ids`): D allocates it
//! once the answer came, at the schedule's time or later.
//!
//! A turn of a conversation with a next turn ([`DemoMode::Bidir`](super::DemoMode::Bidir)) gets
//! room for what D decodes with its blocks: after the check D "decodes" (writes the pattern of
//! the decoded tokens into the extra blocks), keeps all of them for the next turn
//! (`keep_for_next_turn`, with the run's TTL), sends the answer to P over the router link, and
//! frees them on `ExportEnded` (read by P, declined, or expired).
//!
//! This file has the loop and D's calls; `events` handles what reaches the loop (the router
//! link's messages and the connector's events).

mod decode_events;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use kvhandoff_actors::system::blocking::block_on_timeout;
use kvhandoff_actors::system::QueryTransportStats;
use kvhandoff_protocol::{BlockIds, RequestId};

use super::engines::{
    idle, no_answer_note, note, DecodeRecord, DecodeRun, DecodeSide, FreeList, Pacing, SideResult,
    ToDecode, ToPrefill, Work,
};
use super::schedule::Planned;
use crate::pattern::pattern_block;
use kvhandoff::{
    ConnectorError, ConnectorEvent, KvCache, KvConnector, KvTransferParams, TransferMode,
};

/// Runs D's side of `plan` on `conn` until every request is verified (or failed) or
/// `run.deadline`.
pub(crate) fn run_decode(
    conn: KvConnector,
    kv: KvCache,
    plan: &[Planned],
    run: DecodeRun,
) -> DecodeSide {
    let g = kv.geometry();
    let block_tokens = g.kernel_block_size * g.kernel_blocks_per_logical;
    DecodeLoop {
        conn,
        kv,
        plan,
        run,
        block_tokens,
    }
    .run()
}

struct DecodeLoop<'a> {
    conn: KvConnector,
    kv: KvCache,
    plan: &'a [Planned],
    run: DecodeRun,
    block_tokens: u32,
}

/// D's bookkeeping while the loop runs.
struct State {
    records: Vec<DecodeRecord>,
    /// Each request's blocks (its prompt's, and room for what it decodes if it is kept), from
    /// the allocation until they are freed.
    held: Vec<Option<Vec<u32>>>,
    /// P's answers, when they pass through this process.
    params: Vec<Option<KvTransferParams>>,
    /// When P's prefill of each request was done, as the in-process router told.
    prefill_done: Vec<Option<Instant>>,
    /// [`Pacing::Clock`]: when the schedule has D allocate each request.
    clock_due: Vec<Option<Instant>>,
    /// Pulled requests waiting for P's answer: when D gives each up.
    waiting: BTreeSet<(Instant, usize)>,
    free: FreeList,
    errors: Vec<String>,
    duplicates: u64,
    unknown: u64,
    /// Requests over: verified (and their keep ended), failed or abandoned.
    done: usize,
    /// Checks of arrived blocks, then the decode into the extra ones, one block per step.
    work: VecDeque<Work>,
}

impl DecodeLoop<'_> {
    fn run(mut self) -> DecodeSide {
        let n = self.plan.len();
        let mut st = State {
            records: vec![DecodeRecord::default(); n],
            held: vec![None; n],
            params: vec![None; n],
            prefill_done: vec![None; n],
            clock_due: vec![None; n],
            waiting: BTreeSet::new(),
            free: FreeList::new(self.kv.logical_blocks()),
            errors: Vec::new(),
            duplicates: 0,
            unknown: 0,
            done: 0,
            work: VecDeque::new(),
        };
        let index: BTreeMap<RequestId, usize> = self
            .plan
            .iter()
            .enumerate()
            .map(|(i, p)| (p.decode_id.clone(), i))
            .collect();
        let mut allocs: BTreeSet<(Instant, usize)> = BTreeSet::new();
        if let Pacing::Clock { hold } = self.run.pacing {
            for (i, p) in self.plan.iter().enumerate() {
                let ready = self.run.start + p.arrival + hold;
                let due = ready + p.decode_delay;
                st.records[i].planned_finish = Some(ready + p.prefill_delay);
                st.clock_due[i] = Some(due);
                if p.mode == TransferMode::Pull {
                    // Its time, or P's answer, whichever comes later.
                    if let Some(wait) = self.run.answer_wait {
                        st.waiting.insert((due + wait, i));
                    }
                } else {
                    allocs.insert((due, i));
                }
            }
        }
        let (mut scratch, mut actual) = (Vec::new(), Vec::new());
        let mut timed_out = false;
        let mut pending: VecDeque<ConnectorEvent> = VecDeque::new();

        while st.done < n {
            let now = Instant::now();
            if now >= self.run.deadline {
                timed_out = true;
                break;
            }
            let messages: Vec<ToDecode> = match &self.run.link {
                Some(link) => link.from_prefill.try_iter().collect(),
                None => Vec::new(),
            };
            for message in messages {
                self.on_router(message, &mut allocs, &mut st);
            }
            pending.extend(self.conn.poll_events());
            while let Some(event) = pending.pop_front() {
                self.on_event(event, now, &index, &mut st);
            }

            // 0. Pulled requests whose answer never came.
            while let Some(&(until, i)) = st.waiting.first() {
                if until > now {
                    break;
                }
                st.waiting.pop_first();
                let r = &mut st.records[i];
                r.no_answer = true;
                r.ended_at = Some(now);
                note(&mut st.errors, no_answer_note(&self.plan[i].decode_id));
                st.done += 1;
                self.end_conversation(i, &mut st);
            }
            // 1. An allocation that is due (in order; the head waits for free blocks).
            if let Some(&(due, i)) = allocs.first() {
                if due <= now {
                    let want = self.plan[i].decode_blocks(self.block_tokens);
                    if let Some(blocks) = st.free.alloc(want) {
                        allocs.pop_first();
                        if !self.allocate(i, blocks, &mut st) {
                            st.done += 1;
                            self.end_conversation(i, &mut st);
                        }
                        continue;
                    }
                }
            }
            // 2. One block of verification, or of decoding.
            if let Some(w) = st.work.front_mut() {
                let i = w.index;
                let check = w.next < w.check_until;
                match pattern_block(
                    &self.kv,
                    self.plan[i].key,
                    w.blocks[w.next],
                    w.next as u64,
                    check,
                    &mut scratch,
                    &mut actual,
                ) {
                    Ok(errs) => st.records[i].byte_errors += errs,
                    Err(e) => note(&mut st.errors, format!("D verify: {e}")),
                }
                w.next += 1;
                if w.next == w.blocks.len() {
                    let w = st.work.pop_front().expect("work");
                    self.decoded(w, &mut st);
                }
                continue;
            }
            // 3. Nothing to do.
            let mut until = now + Duration::from_millis(1);
            if let Some(&(due, _)) = allocs.first() {
                if due > now {
                    until = until.min(due);
                }
            }
            if let Some(&(due, _)) = st.waiting.first() {
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

    /// Calls `request_allocated` for the prompt's part of `blocks`; false when the call failed
    /// (the request is then over).
    fn allocate(&mut self, i: usize, blocks: Vec<u32>, st: &mut State) -> bool {
        let p = &self.plan[i];
        // P finished first and its answer came through the router; otherwise the router builds
        // the decode leg's parameters from what it knows about P.
        let params = st.params[i]
            .clone()
            .unwrap_or_else(|| self.run.params.clone());
        let tokens = u64::from(p.tokens);
        let prompt = blocks[..p.blocks].to_vec();
        st.held[i] = Some(blocks);
        st.records[i].allocate_call = Some(Instant::now());
        match self.conn.request_allocated(
            &p.decode_id,
            BlockIds::single_group(prompt),
            tokens,
            &params,
        ) {
            Ok(()) => {
                if self.run.stop_after.is(i) && p.next.is_none() {
                    self.await_transport();
                    self.run.stop_after.stop_here();
                }
                true
            }
            Err(e) => {
                note(
                    &mut st.errors,
                    format!("D request_allocated({}): {e}", p.decode_id),
                );
                if matches!(e, ConnectorError::VerdictLate) {
                    // It may still be applied: the blocks stay held until its event (or its
                    // refusal) comes.
                    return true;
                }
                if let Some(blocks) = st.held[i].take() {
                    st.free.release(&BlockIds::single_group(blocks));
                }
                false
            }
        }
    }

    /// Waits until what the last call made the rank send has left through its transport: the
    /// rank flushes a call's messages to its transport actor before it takes the next message
    /// (the counters' query), and the transport actor sends them before it answers the next
    /// one (the stats' query).
    fn await_transport(&self) {
        let rank = self.conn.rank();
        let limit = Duration::from_secs(1);
        let _ = rank.counters(limit);
        let _ = block_on_timeout(rank.transport.send(QueryTransportStats), limit);
    }

    /// Request `i`'s blocks are checked (and, if the conversation goes on, its decoded tokens
    /// written): the decode is over. Frees them, or keeps them for the next turn.
    fn decoded(&mut self, w: Work, st: &mut State) {
        let i = w.index;
        let p = &self.plan[i];
        let r = &mut st.records[i];
        r.verified = r.byte_errors == 0;
        if r.byte_errors > 0 {
            let wrong = r.byte_errors;
            note(
                &mut st.errors,
                format!("D: {} has {wrong} wrong bytes", p.decode_id),
            );
        }
        if p.next.is_none() {
            if let Some(blocks) = st.held[i].take() {
                st.free.release(&BlockIds::single_group(blocks));
            }
            st.done += 1;
            return;
        }
        // The conversation goes on: keep the blocks for the next turn's prefill to read.
        let params = st.params[i]
            .clone()
            .unwrap_or_else(|| self.run.params.clone());
        let since = Instant::now();
        r.keep_call = Some(since);
        match self.conn.keep_for_next_turn(
            &p.decode_id,
            BlockIds::single_group(w.blocks),
            u64::from(p.kept_tokens),
            self.run.turns.ttl,
            &params,
        ) {
            Ok(answer) => {
                if let Some(link) = &self.run.link {
                    link.send(ToPrefill::Kept {
                        index: i,
                        params: Box::new(answer),
                        since,
                    });
                }
                if self.run.stop_after.is(i) {
                    // Once the answer is on its way to P (which reads the blocks back).
                    if let Some(link) = &self.run.link {
                        link.flush(Duration::from_secs(1));
                    }
                    self.run.stop_after.stop_here();
                }
            }
            Err(e) => {
                note(
                    &mut st.errors,
                    format!("D keep_for_next_turn({}): {e}", p.decode_id),
                );
                self.end_conversation(i, st);
                if matches!(e, ConnectorError::VerdictLate) {
                    // It may still be applied: its `ExportEnded` (or refusal) frees the blocks.
                    return;
                }
                if let Some(blocks) = st.held[i].take() {
                    st.free.release(&BlockIds::single_group(blocks));
                }
                st.done += 1;
            }
        }
    }

    /// Request `i`'s conversation ends with it: P is told that no keep comes (if a next turn
    /// was planned), and the later turns are over here.
    fn end_conversation(&self, i: usize, st: &mut State) {
        if self.plan[i].next.is_none() {
            return;
        }
        if let Some(link) = &self.run.link {
            link.send(ToPrefill::Ended { index: i });
        }
        self.abandon_after(i, st);
    }

    /// The later turns of request `i`'s conversation never come.
    fn abandon_after(&self, i: usize, st: &mut State) {
        let mut next = self.plan[i].next;
        while let Some(j) = next {
            let r = &mut st.records[j];
            if !r.abandoned && st.held[j].is_none() && r.events == 0 && !r.no_answer {
                r.abandoned = true;
                st.done += 1;
                st.waiting.retain(|&(_, k)| k != j);
            }
            next = self.plan[j].next;
        }
    }
}
