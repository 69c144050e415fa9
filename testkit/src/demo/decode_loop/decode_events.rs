//! What reaches D's loop: the router link's messages (P's prefills done, its answers, requests
//! it abandoned) and D's connector events (blocks ready or failed, an import's end, a kept
//! turn's blocks coming back).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use kvhandoff_protocol::machine::{DecodeFailure, FreeProof, ImportOutcome};
use kvhandoff_protocol::{BlockIds, RequestId};

use super::{DecodeLoop, State};
use crate::demo::engines::{failed_note, import_note, note, Pacing, ToDecode, Work};
use kvhandoff::{ConnectorEvent, TransferMode};

impl DecodeLoop<'_> {
    /// Handles one message of the router link.
    pub(super) fn on_router(
        &self,
        message: ToDecode,
        allocs: &mut BTreeSet<(Instant, usize)>,
        st: &mut State,
    ) {
        let plan = self.plan;
        let pulled = |index: usize| plan[index].mode == TransferMode::Pull;
        let index = match &message {
            ToDecode::PrefillDone { index, .. }
            | ToDecode::Params { index, .. }
            | ToDecode::Abandoned { index } => *index,
        };
        if index >= plan.len() || st.records[index].abandoned || st.records[index].no_answer {
            // Not ours, or given up already.
            return;
        }
        match message {
            ToDecode::PrefillDone { index, at } => {
                st.prefill_done[index] = Some(at);
                // When P calls (seen from D alone: a node's report of the races).
                st.records[index]
                    .planned_finish
                    .get_or_insert(at + plan[index].prefill_delay);
                if !pulled(index) && self.run.pacing == Pacing::Router {
                    allocs.insert((at + plan[index].decode_delay, index));
                }
            }
            ToDecode::Params { index, params } => {
                st.params[index] = Some(params);
                if !pulled(index) || st.records[index].allocate_call.is_some() {
                    return;
                }
                // P's answer names the blocks to read: D allocates now or at its time.
                let due = match self.run.pacing {
                    Pacing::Router => {
                        let done = st.prefill_done[index].unwrap_or_else(Instant::now);
                        done + plan[index].decode_delay
                    }
                    Pacing::Clock { .. } => {
                        st.waiting.retain(|&(_, k)| k != index);
                        st.clock_due[index]
                            .unwrap_or_else(Instant::now)
                            .max(Instant::now())
                    }
                };
                allocs.insert((due, index));
            }
            ToDecode::Abandoned { index } => {
                if allocs.iter().any(|&(_, i)| i == index) {
                    allocs.retain(|&(_, i)| i != index);
                    st.records[index].abandoned = true;
                    st.done += 1;
                } else if st.held[index].is_some() {
                    // Already registered: its deadline fails it; the run times out first.
                    note(&mut st.errors, format!("D: P abandoned request {index}"));
                } else if st.records[index].allocate_call.is_none() {
                    // Not due yet, or still waiting for P's answer, which will not come.
                    st.waiting.retain(|&(_, k)| k != index);
                    st.records[index].abandoned = true;
                    st.done += 1;
                }
                self.abandon_after(index, st);
            }
        }
    }

    /// Handles one of D's events: ready blocks go to verification, failed ones back to the
    /// list, kept ones back to the list when their keep ends.
    pub(super) fn on_event(
        &self,
        event: ConnectorEvent,
        now: Instant,
        index: &BTreeMap<RequestId, usize>,
        st: &mut State,
    ) {
        let (request, blocks, failure) = match event {
            ConnectorEvent::DecodeFenced { request, .. } => {
                // Not an end: the blocks stay held until the request's `Failed`, which carries
                // the same failure and is noted (and explained) as any failure is.
                match index.get(&request) {
                    Some(&i) => {
                        st.records[i].fenced_at.get_or_insert(now);
                    }
                    None => st.unknown += 1,
                }
                return;
            }
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
                note(&mut st.errors, import_note(&request, outcome));
                (request, blocks, Some(Failure::Import(outcome)))
            }
            ConnectorEvent::Failed {
                request,
                reason,
                proof,
                blocks,
            } => {
                note(&mut st.errors, failed_note(&request, reason));
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
                    let r = &mut st.records[i];
                    if r.keep_call.is_some() {
                        // The keep was refused (P was told already).
                        r.export_events += 1;
                    } else {
                        r.events += 1;
                        r.failed = true;
                        self.end_conversation(i, st);
                    }
                    st.done += 1;
                }
                return;
            }
            ConnectorEvent::ExportEnded {
                request,
                outcome,
                proof,
                blocks,
            } => {
                self.on_export_ended(request, outcome, proof, blocks, index, st);
                return;
            }
            ConnectorEvent::BlocksFree { .. } => {
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
        let p = &self.plan[i];
        let r = &mut st.records[i];
        r.events += 1;
        if r.events > 1 {
            st.duplicates += 1;
            note(&mut st.errors, format!("D: second event for {request}"));
            return;
        }
        r.ended_at = Some(Instant::now());
        let held = st.held[i].clone();
        let prompt = held.as_ref().map(|h| h[..p.blocks.min(h.len())].to_vec());
        if prompt.map(BlockIds::single_group) != Some(blocks.clone()) {
            st.unknown += 1;
            note(
                &mut st.errors,
                format!("D: {request} handed back {blocks:?}, gave {held:?}"),
            );
        }
        match failure {
            None => {
                r.ready = true;
                r.ready_at = Some(now);
                let all = held.unwrap_or_else(|| blocks.groups.into_iter().flatten().collect());
                st.work.push_back(Work {
                    index: i,
                    check_until: p.blocks.min(all.len()),
                    blocks: all,
                    next: 0,
                });
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
                match st.held[i].take() {
                    Some(all) => st.free.release(&BlockIds::single_group(all)),
                    None => st.free.release(&blocks),
                }
                st.done += 1;
                self.end_conversation(i, st);
            }
        }
    }

    /// The blocks D kept for a next turn came back.
    fn on_export_ended(
        &self,
        request: RequestId,
        outcome: kvhandoff_protocol::machine::ExportOutcome,
        proof: kvhandoff_protocol::machine::ReadProof,
        blocks: BlockIds,
        index: &BTreeMap<RequestId, usize>,
        st: &mut State,
    ) {
        let Some(&i) = index.get(&request) else {
            st.unknown += 1;
            note(
                &mut st.errors,
                format!("D export event for unknown request {request}"),
            );
            return;
        };
        let r = &mut st.records[i];
        r.export_events += 1;
        if r.export_events > 1 || r.keep_call.is_none() {
            st.duplicates += 1;
            note(
                &mut st.errors,
                format!("D: unexpected export event for {request}: {outcome:?}"),
            );
            return;
        }
        r.export_outcome = Some(outcome);
        r.export_proof = Some(proof);
        r.export_ended_at = Some(Instant::now());
        match st.held[i].take() {
            Some(given) if BlockIds::single_group(given.clone()) == blocks => {}
            other => {
                st.unknown += 1;
                note(
                    &mut st.errors,
                    format!("D: {request} kept {other:?}, got back {blocks:?}"),
                );
            }
        }
        st.free.release(&blocks);
        st.done += 1;
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
