//! What reaches P's loop: D's answers over the router link (a turn kept for the next, or a
//! conversation over) and P's connector events (a prefix read back, the blocks of a handoff
//! coming back, a late refusal).

use std::collections::BTreeMap;
use std::time::Instant;

use kvhandoff_protocol::machine::{ExportOutcome, ImportOutcome};
use kvhandoff_protocol::{BlockIds, RequestId};

use super::{PrefillLoop, State};
use crate::demo::engines::{note, released_note, unread_note, ToPrefill, TurnStart, Work};
use kvhandoff::ConnectorEvent;

impl PrefillLoop<'_> {
    /// Handles one of D's answers over the router link.
    pub(super) fn on_decode(&self, answer: ToPrefill, st: &mut State) {
        match answer {
            ToPrefill::Kept {
                index,
                params,
                since,
            } => {
                let Some(next) = self.plan.get(index).and_then(|p| p.next) else {
                    st.unknown += 1;
                    note(
                        &mut st.errors,
                        format!("P: D kept request {index}, which has no next turn"),
                    );
                    return;
                };
                if st.records[next].abandoned {
                    return;
                }
                st.keep_waits.retain(|&(_, k)| k != next);
                st.kept[next] = Some((*params, since + self.run.turns.ttl));
                st.arrivals.insert((since + self.plan[next].think, next));
            }
            ToPrefill::Ended { index } => {
                if index < self.plan.len() {
                    self.abandon_after(index, st);
                }
            }
        }
    }

    /// Handles one of P's events: a prefix read back, or the blocks of a handoff coming back.
    pub(super) fn on_event(
        &self,
        event: ConnectorEvent,
        index: &BTreeMap<RequestId, usize>,
        st: &mut State,
    ) {
        if let ConnectorEvent::Refused { request, error } = &event {
            note(
                &mut st.errors,
                format!("P: {request} refused late: {error}"),
            );
            let Some(&i) = index.get(request) else {
                st.unknown += 1;
                return;
            };
            if st.records[i].finish_call.is_none() && st.records[i].turn_start.is_some() {
                // The late call was the read back: nothing was read; recompute.
                st.records[i].import_events += 1;
                st.records[i].read_ended_at = Some(Instant::now());
                if let Some(blocks) = st.held[i].clone() {
                    st.work.push_back(Work {
                        index: i,
                        blocks,
                        next: 0,
                        check_until: 0,
                    });
                }
                return;
            }
            // The late call was `request_finished`: its blocks are ours again.
            if let Some(blocks) = st.held[i].take() {
                st.free.release(&BlockIds::single_group(blocks));
            }
            st.records[i].events += 1;
            st.done += 1;
            return;
        }
        if let ConnectorEvent::Imported {
            request,
            outcome,
            blocks,
        } = event
        {
            self.on_imported(request, outcome, blocks, index, st);
            return;
        }
        // Push hands the blocks back with `BlocksFree`, pull with `ExportEnded`; either way the
        // KV went, or why not.
        let (request, blocks, unsent, proof) = match event {
            ConnectorEvent::BlocksFree {
                request,
                released,
                blocks,
            } => (request, blocks, released.map(Unsent::Push), None),
            ConnectorEvent::ExportEnded {
                request,
                outcome,
                blocks,
                proof,
            } => {
                let unsent = match outcome {
                    ExportOutcome::Read => None,
                    ExportOutcome::Released(end) => Some(Unsent::Pull(end)),
                };
                (request, blocks, unsent, Some(proof))
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
        r.export_proof = proof;
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
        let sent = unsent.is_none();
        match unsent {
            None => r.sent = true,
            Some(Unsent::Push(cause)) => {
                r.released = Some(cause);
                note(&mut st.errors, released_note(&request, cause));
            }
            Some(Unsent::Pull(end)) => {
                r.export_end = Some(end);
                note(&mut st.errors, unread_note(&request, end));
            }
        }
        if r.events > 1 {
            return;
        }
        st.done += 1;
        let Some(next) = self.plan[i].next else {
            return;
        };
        if !sent {
            // D never got this turn: it keeps nothing, the conversation is over.
            self.abandon_after(i, st);
        } else if let (Some(wait), false) = (self.run.answer_wait, st.started(next)) {
            st.keep_waits.insert((Instant::now() + wait, next));
        }
    }

    /// A later turn's read back ended: check what arrived, then prefill the rest (or all of it).
    fn on_imported(
        &self,
        request: RequestId,
        outcome: ImportOutcome,
        blocks: BlockIds,
        index: &BTreeMap<RequestId, usize>,
        st: &mut State,
    ) {
        let Some(&i) = index.get(&request) else {
            st.unknown += 1;
            note(
                &mut st.errors,
                format!("P import event for unknown request {request}"),
            );
            return;
        };
        let p = &self.plan[i];
        let r = &mut st.records[i];
        r.import_events += 1;
        if r.import_events > 1 || r.turn_start != Some(TurnStart::Read) {
            st.duplicates += 1;
            note(
                &mut st.errors,
                format!("P: unexpected import event for {request}: {outcome:?}"),
            );
            return;
        }
        r.import_outcome = Some(outcome);
        r.read_ended_at = Some(Instant::now());
        let Some(held) = st.held[i].clone() else {
            st.unknown += 1;
            note(&mut st.errors, format!("P: {request} read into no blocks"));
            return;
        };
        let prefix = p.prefix_blocks(self.block_tokens);
        if blocks != BlockIds::single_group(held[..prefix].to_vec()) {
            st.unknown += 1;
            note(
                &mut st.errors,
                format!(
                    "P: {request} read back into {blocks:?}, gave {:?}",
                    &held[..prefix]
                ),
            );
        }
        let check_until = if outcome == ImportOutcome::Loaded {
            r.read_blocks = prefix as u64;
            prefix
        } else {
            note(
                &mut st.errors,
                format!("P: {request} read back: {outcome:?}"),
            );
            0
        };
        st.work.push_back(Work {
            index: i,
            blocks: held,
            next: 0,
            check_until,
        });
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
