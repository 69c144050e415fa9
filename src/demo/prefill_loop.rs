//! P's engine loop: prompts arrive on the schedule, P "prefills" each by writing the pattern into
//! its blocks (one block per step, so events and due calls are never kept waiting long), calls
//! `request_finished` when the pacing says so (asking for the request's transfer mode, as a
//! router would), and frees the blocks on `BlocksFree` (push) or `ExportEnded` (pull).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use kvhandoff_actors::system::KvPool;
use kvhandoff_protocol::{BlockIds, RequestId};

use super::engines::{
    idle, note, FreeList, PrefillPacing, PrefillRecord, PrefillRun, PrefillSide, SideResult,
    ToDecode,
};
use super::pattern::pattern_block;
use super::schedule::Planned;
use kvhandoff::{ConnectorError, ConnectorEvent, KvConnector, KvTransferParams};
use kvhandoff_protocol::machine::ExportOutcome;

/// Runs P's side of `plan` on `conn` until every request had its event or `run.deadline`.
pub(crate) fn run_prefill(
    conn: KvConnector,
    pool: KvPool,
    plan: &[Planned],
    run: PrefillRun,
) -> PrefillSide {
    PrefillLoop {
        conn,
        pool,
        plan,
        run,
    }
    .run()
}

struct PrefillLoop<'a> {
    conn: KvConnector,
    pool: KvPool,
    plan: &'a [Planned],
    run: PrefillRun,
}

/// P's bookkeeping while the loop runs.
struct State {
    records: Vec<PrefillRecord>,
    held: Vec<Option<Vec<u32>>>,
    free: FreeList,
    errors: Vec<String>,
    duplicates: u64,
    unknown: u64,
    /// Requests whose event came (or whose call failed).
    done: usize,
}

impl PrefillLoop<'_> {
    fn run(mut self) -> PrefillSide {
        let n = self.plan.len();
        let mut st = State {
            records: vec![PrefillRecord::default(); n],
            held: vec![None; n],
            free: FreeList::new(self.pool.logical_blocks()),
            errors: Vec::new(),
            duplicates: 0,
            unknown: 0,
            done: 0,
        };
        let index: BTreeMap<RequestId, usize> = self
            .plan
            .iter()
            .enumerate()
            .map(|(i, p)| (p.prefill_id.clone(), i))
            .collect();
        // (request, its blocks, next block to fill)
        let mut filling: Option<(usize, Vec<u32>, usize)> = None;
        let mut next_arrival = 0usize;
        let mut finishes: BTreeSet<(Instant, usize)> = BTreeSet::new();
        let (mut scratch, mut unused) = (Vec::new(), Vec::new());
        let mut timed_out = false;
        let mut pending: VecDeque<ConnectorEvent> = VecDeque::new();
        let start = self.run.start;

        while st.done < n {
            let now = Instant::now();
            if now >= self.run.deadline {
                timed_out = true;
                break;
            }
            pending.extend(self.conn.poll_events());
            while let Some(event) = pending.pop_front() {
                on_event(event, &index, &mut st);
            }

            // 1. A finish that is due.
            if let Some(&(due, i)) = finishes.first() {
                if due <= now {
                    finishes.pop_first();
                    self.finish(i, &mut st);
                    continue;
                }
            }
            // 2. Start the next prefill once its prompt arrived and blocks are free.
            if filling.is_none() && next_arrival < n {
                let p = &self.plan[next_arrival];
                if start + p.arrival <= now {
                    if let Some(blocks) = st.free.alloc(p.blocks) {
                        filling = Some((next_arrival, blocks, 0));
                        next_arrival += 1;
                    }
                }
            }
            // 3. One block of prefill work.
            if let Some((i, blocks, j)) = filling.as_mut() {
                let p = &self.plan[*i];
                let key = if self.run.corrupt == Some(*i) {
                    p.key ^ 0x5a5a
                } else {
                    p.key
                };
                if let Err(e) = pattern_block(
                    &self.pool,
                    key,
                    blocks[*j],
                    *j as u64,
                    false,
                    &mut scratch,
                    &mut unused,
                ) {
                    note(&mut st.errors, format!("P fill: {e}"));
                }
                *j += 1;
                if *j == blocks.len() {
                    let (i, blocks, _) = filling.take().expect("filling");
                    let at = Instant::now();
                    st.held[i] = Some(blocks);
                    st.records[i].filled_at = Some(at);
                    let p = &self.plan[i];
                    let due = match &self.run.pacing {
                        PrefillPacing::Router(to_decode) => {
                            let _ = to_decode.send(ToDecode::PrefillDone { index: i, at });
                            at + p.prefill_delay
                        }
                        PrefillPacing::Clock { hold } => {
                            at.max(start + p.arrival + *hold + p.prefill_delay)
                        }
                    };
                    finishes.insert((due, i));
                }
                continue;
            }
            // 4. Nothing to do: wait for an event, the next finish or the next arrival.
            let mut until = now + Duration::from_millis(1);
            if let Some(&(due, _)) = finishes.first() {
                until = until.min(due);
            }
            if next_arrival < n && st.free.available() >= self.plan[next_arrival].blocks {
                until = until.min(start + self.plan[next_arrival].arrival);
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

    fn finish(&mut self, i: usize, st: &mut State) {
        let p = &self.plan[i];
        let blocks = st.held[i].clone().unwrap_or_default();
        let router = KvTransferParams {
            do_remote_decode: true,
            transfer_mode: Some(p.mode_name().into()),
            ..KvTransferParams::default()
        };
        st.records[i].finish_call = Some(Instant::now());
        match self.conn.request_finished(
            &p.prefill_id,
            BlockIds::single_group(blocks),
            u64::from(p.tokens),
            &router,
        ) {
            Ok(params) => {
                if let PrefillPacing::Router(to_decode) = &self.run.pacing {
                    let _ = to_decode.send(ToDecode::Params { index: i, params });
                }
            }
            Err(e) => {
                note(
                    &mut st.errors,
                    format!("P request_finished({}): {e}", p.prefill_id),
                );
                if let PrefillPacing::Router(to_decode) = &self.run.pacing {
                    let _ = to_decode.send(ToDecode::Abandoned { index: i });
                }
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
}

/// Why a request's blocks came back without the KV having gone.
#[derive(Debug, Clone, Copy)]
enum Unsent {
    /// Push: P's release cause.
    Push(kvhandoff_protocol::machine::ReleaseCause),
    /// Pull: how the export ended.
    Pull(kvhandoff_protocol::machine::ExportEnd),
}

/// Handles one of P's events: the request's blocks come back.
fn on_event(event: ConnectorEvent, index: &BTreeMap<RequestId, usize>, st: &mut State) {
    if let ConnectorEvent::Refused { request, error } = &event {
        // A call whose verdict came late was refused: its blocks are ours again.
        note(
            &mut st.errors,
            format!("P: {request} refused late: {error}"),
        );
        if let Some(&i) = index.get(request) {
            if let Some(blocks) = st.held[i].take() {
                st.free.release(&BlockIds::single_group(blocks));
            }
            st.records[i].events += 1;
            st.done += 1;
        }
        return;
    }
    // Push hands the blocks back with `BlocksFree`, pull with `ExportEnded`; either way the
    // KV went, or why not.
    let (request, blocks, unsent) = match event {
        ConnectorEvent::BlocksFree {
            request,
            released,
            blocks,
        } => (request, blocks, released.map(Unsent::Push)),
        ConnectorEvent::ExportEnded {
            request,
            outcome,
            blocks,
            ..
        } => {
            let unsent = match outcome {
                ExportOutcome::Read => None,
                ExportOutcome::Released(end) => Some(Unsent::Pull(end)),
            };
            (request, blocks, unsent)
        }
        other => {
            st.unknown += 1;
            note(&mut st.errors, format!("P got a decode event: {other:?}"));
            return;
        }
    };
    let Some(&i) = index.get(&request) else {
        st.unknown += 1;
        note(
            &mut st.errors,
            format!("P event for unknown request {request}"),
        );
        return;
    };
    let r = &mut st.records[i];
    r.events += 1;
    if r.events > 1 {
        st.duplicates += 1;
        note(&mut st.errors, format!("P: second event for {request}"));
    } else {
        r.ended_at = Some(Instant::now());
    }
    match st.held[i].take() {
        Some(given) if BlockIds::single_group(given.clone()) == blocks => {}
        other => {
            st.unknown += 1;
            note(
                &mut st.errors,
                format!("P: {request} handed back {blocks:?}, gave {other:?}"),
            );
        }
    }
    st.free.release(&blocks);
    match unsent {
        None => r.sent = true,
        Some(why) => {
            match why {
                Unsent::Push(cause) => r.released = Some(cause),
                Unsent::Pull(end) => r.export_end = Some(end),
            }
            note(
                &mut st.errors,
                format!("P: {request} released unsent: {why:?}"),
            );
        }
    }
    if r.events == 1 {
        st.done += 1;
    }
}
