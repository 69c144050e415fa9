//! D's engine loop: allocates blocks for each request when the pacing says so and calls
//! `request_allocated` (with the decode leg's parameters as a router builds them), then, on
//! `BlocksReady` (push) or `Imported` / `Loaded` (pull), checks every byte of every block
//! against the pattern (one block per step) and frees the blocks ("the decode is over"). A
//! pulled request needs P's answer (its `remote_block_ids`): D allocates it once the answer
//! came, at the schedule's time or later.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use kvhandoff_actors::system::KvPool;
use kvhandoff_protocol::{BlockIds, RequestId};

use super::engines::{
    idle, note, DecodePacing, DecodeRecord, DecodeRun, DecodeSide, FreeList, SideResult, ToDecode,
};
use super::pattern::pattern_block;
use super::schedule::Planned;
use kvhandoff::{ConnectorError, ConnectorEvent, KvConnector, KvTransferParams, TransferMode};
use kvhandoff_protocol::machine::{DecodeFailure, FreeProof, ImportOutcome};

/// Runs D's side of `plan` on `conn` until every request is verified (or failed) or
/// `run.deadline`.
pub(crate) fn run_decode(
    conn: KvConnector,
    pool: KvPool,
    plan: &[Planned],
    run: DecodeRun,
) -> DecodeSide {
    DecodeLoop {
        conn,
        pool,
        plan,
        run,
    }
    .run()
}

struct DecodeLoop<'a> {
    conn: KvConnector,
    pool: KvPool,
    plan: &'a [Planned],
    run: DecodeRun,
}

/// D's bookkeeping while the loop runs.
struct State {
    records: Vec<DecodeRecord>,
    held: Vec<Option<Vec<u32>>>,
    /// P's answers, when they pass through this process.
    params: Vec<Option<KvTransferParams>>,
    /// When P's prefill of each request was done, as the in-process router told.
    prefill_done: Vec<Option<Instant>>,
    free: FreeList,
    errors: Vec<String>,
    duplicates: u64,
    unknown: u64,
    /// Requests verified, failed or abandoned.
    done: usize,
    /// (request, blocks, next block to check)
    verifying: VecDeque<(usize, Vec<u32>, usize)>,
}

impl DecodeLoop<'_> {
    fn run(mut self) -> DecodeSide {
        let n = self.plan.len();
        let mut st = State {
            records: vec![DecodeRecord::default(); n],
            held: vec![None; n],
            params: vec![None; n],
            prefill_done: vec![None; n],
            free: FreeList::new(self.pool.logical_blocks()),
            errors: Vec::new(),
            duplicates: 0,
            unknown: 0,
            done: 0,
            verifying: VecDeque::new(),
        };
        let index: BTreeMap<RequestId, usize> = self
            .plan
            .iter()
            .enumerate()
            .map(|(i, p)| (p.decode_id.clone(), i))
            .collect();
        let mut allocs: BTreeSet<(Instant, usize)> = BTreeSet::new();
        if let DecodePacing::Clock { hold } = self.run.pacing {
            for (i, p) in self.plan.iter().enumerate() {
                let ready = self.run.start + p.arrival + hold;
                st.records[i].planned_finish = Some(ready + p.prefill_delay);
                allocs.insert((ready + p.decode_delay, i));
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
            if let DecodePacing::Router(from_prefill) = &self.run.pacing {
                while let Ok(message) = from_prefill.try_recv() {
                    on_router(message, self.plan, &mut allocs, &mut st);
                }
            }
            pending.extend(self.conn.poll_events());
            while let Some(event) = pending.pop_front() {
                on_event(event, now, &index, &mut st);
            }

            // 1. An allocation that is due (in order; the head waits for free blocks).
            if let Some(&(due, i)) = allocs.first() {
                if due <= now {
                    if let Some(blocks) = st.free.alloc(self.plan[i].blocks) {
                        allocs.pop_first();
                        if !self.allocate(i, blocks, &mut st) {
                            st.done += 1;
                        }
                        continue;
                    }
                }
            }
            // 2. One block of verification.
            if let Some((i, blocks, j)) = st.verifying.front_mut() {
                match pattern_block(
                    &self.pool,
                    self.plan[*i].key,
                    blocks[*j],
                    *j as u64,
                    true,
                    &mut scratch,
                    &mut actual,
                ) {
                    Ok(errs) => st.records[*i].byte_errors += errs,
                    Err(e) => note(&mut st.errors, format!("D verify: {e}")),
                }
                *j += 1;
                if *j == blocks.len() {
                    let (i, blocks, _) = st.verifying.pop_front().expect("verifying");
                    let r = &mut st.records[i];
                    r.verified = r.byte_errors == 0;
                    if r.byte_errors > 0 {
                        let wrong = r.byte_errors;
                        note(
                            &mut st.errors,
                            format!("D: {} has {wrong} wrong bytes", self.plan[i].decode_id),
                        );
                    }
                    // The "decode" is over: the blocks go back to the free list.
                    st.free.release(&BlockIds::single_group(blocks));
                    st.done += 1;
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

    /// Calls `request_allocated`; false when the call failed (the request is then over).
    fn allocate(&mut self, i: usize, blocks: Vec<u32>, st: &mut State) -> bool {
        let p = &self.plan[i];
        // P finished first and its answer came through the router; otherwise the router builds
        // the decode leg's parameters from what it knows about P.
        let params = st.params[i]
            .clone()
            .unwrap_or_else(|| self.run.params.clone());
        let tokens = u64::from(p.tokens);
        st.held[i] = Some(blocks.clone());
        st.records[i].allocate_call = Some(Instant::now());
        match self.conn.request_allocated(
            &p.decode_id,
            BlockIds::single_group(blocks),
            tokens,
            &params,
        ) {
            Ok(()) => true,
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
}

/// Handles one message of the in-process router.
fn on_router(
    message: ToDecode,
    plan: &[Planned],
    allocs: &mut BTreeSet<(Instant, usize)>,
    st: &mut State,
) {
    let pulled = |index: usize| plan[index].mode == TransferMode::Pull;
    match message {
        ToDecode::PrefillDone { index, at } => {
            st.prefill_done[index] = Some(at);
            if !pulled(index) {
                allocs.insert((at + plan[index].decode_delay, index));
            }
        }
        ToDecode::Params { index, params } => {
            st.params[index] = Some(params);
            if pulled(index) {
                // P's answer names the blocks to read: D allocates now or at its time.
                let done = st.prefill_done[index].unwrap_or_else(Instant::now);
                allocs.insert((done + plan[index].decode_delay, index));
            }
        }
        ToDecode::Abandoned { index } => {
            if allocs.iter().any(|&(_, i)| i == index) {
                allocs.retain(|&(_, i)| i != index);
                st.records[index].abandoned = true;
                st.done += 1;
            } else if st.held[index].is_some() {
                // Already registered: its deadline fails it; the run times out first.
                note(&mut st.errors, format!("D: P abandoned request {index}"));
            } else if pulled(index) && st.records[index].allocate_call.is_none() {
                // Still waiting for P's answer, which will not come.
                st.records[index].abandoned = true;
                st.done += 1;
            }
        }
    }
}

/// Why a request's KV did not arrive.
#[derive(Debug, Clone, Copy)]
enum Failure {
    /// Push: D's failure and what freed the blocks.
    Push(DecodeFailure, FreeProof),
    /// Pull: the import's outcome (not `Loaded`).
    Import(ImportOutcome),
}

/// Handles one of D's events: ready blocks go to verification, failed ones back to the list.
fn on_event(
    event: ConnectorEvent,
    now: Instant,
    index: &BTreeMap<RequestId, usize>,
    st: &mut State,
) {
    let (request, blocks, failure) = match event {
        ConnectorEvent::BlocksReady { request, blocks } => (request, blocks, None),
        ConnectorEvent::Imported {
            request,
            outcome: ImportOutcome::Loaded,
            blocks,
        } => (request, blocks, None),
        ConnectorEvent::Imported {
            request,
            outcome,
            blocks,
        } => {
            note(&mut st.errors, format!("D: {request} import: {outcome:?}"));
            (request, blocks, Some(Failure::Import(outcome)))
        }
        ConnectorEvent::Failed {
            request,
            reason,
            proof,
            blocks,
        } => {
            note(&mut st.errors, format!("D: {request} failed: {reason:?}"));
            (request, blocks, Some(Failure::Push(reason, proof)))
        }
        ConnectorEvent::Refused { request, error } => {
            // A call whose verdict came late was refused: its blocks are ours again.
            note(
                &mut st.errors,
                format!("D: {request} refused late: {error}"),
            );
            if let Some(&i) = index.get(&request) {
                if let Some(blocks) = st.held[i].take() {
                    st.free.release(&BlockIds::single_group(blocks));
                }
                st.records[i].events += 1;
                st.records[i].failed = true;
                st.done += 1;
            }
            return;
        }
        ConnectorEvent::BlocksFree { .. } | ConnectorEvent::ExportEnded { .. } => {
            st.unknown += 1;
            note(
                &mut st.errors,
                format!("D got an event of another mode: {event:?}"),
            );
            return;
        }
    };
    let Some(&i) = index.get(&request) else {
        st.unknown += 1;
        note(
            &mut st.errors,
            format!("D event for unknown request {request}"),
        );
        return;
    };
    let r = &mut st.records[i];
    r.events += 1;
    if r.events > 1 {
        st.duplicates += 1;
        note(&mut st.errors, format!("D: second event for {request}"));
        st.free.release(&blocks);
        return;
    }
    r.ended_at = Some(Instant::now());
    let given = st.held[i].take();
    if given.as_ref().map(|g| BlockIds::single_group(g.clone())) != Some(blocks.clone()) {
        st.unknown += 1;
        note(
            &mut st.errors,
            format!("D: {request} handed back {blocks:?}, gave {given:?}"),
        );
    }
    match failure {
        None => {
            r.ready = true;
            r.ready_at = Some(now);
            let list = blocks.groups.into_iter().flatten().collect();
            st.verifying.push_back((i, list, 0));
        }
        Some(failure) => {
            r.failed = true;
            match failure {
                Failure::Push(reason, proof) => {
                    r.failure = Some(reason);
                    r.proof = Some(proof);
                }
                Failure::Import(outcome) => r.import_failure = Some(outcome),
            }
            st.free.release(&blocks);
            st.done += 1;
        }
    }
}
