//! Answers ahead of exports (swarm): P's engine hands the router its answer for a pulled
//! request before its rank has the export, as vLLM does — its scheduler answers at the end of
//! P's step, and its worker hands the export to the rank with the next step's metadata. D may
//! then ask before the export exists, and P answers that it exports nothing under the key.
//!
//! The answer is the session's own ([`Session::preview_call`]: the checks and the reply of the
//! call, nothing handed to the endpoint); the call itself follows a drawn delay later, and its
//! reply must be the answer the router already has (bar the expiry, which counts from each
//! one's time). In a world that draws it (`WorldConfig::early_answers`), that share of the
//! single-source pulls is answered so.
//!
//! Check R1: a reader keeps asking for `register_retry_interval` after its first ask, its asks
//! permitting ([`Config::ask_again_after`]), so an import whose holder's engine answered ahead
//! must not fail `Refused(Unavailable)` while the export was not filed at its first ask,
//! inside that window and with asks left. The checker counts the reader's asks as they leave it
//! (distinct ask numbers, from when its attempt started) and knows when the export was filed;
//! deliberate bug `give_up_on_early_refusal`. Marks `export_answered_early` (the router got an
//! answer ahead of its export) and `read_asked_before_export` (P handled a reader's ask for an
//! export answered but not filed yet).
//!
//! [`Session::preview_call`]: kvhandoff_protocol::session::Session::preview_call
//! [`Config::ask_again_after`]: kvhandoff_protocol::machine::Config::ask_again_after

use std::collections::{BTreeMap, BTreeSet};

use kvhandoff_protocol::machine::{export_hard_end, ImportFailure, Time};
use kvhandoff_protocol::session::{ConnectorCall, ConnectorError, ConnectorReply};
use kvhandoff_protocol::{Message, PairingKey, ReadRefusal, RequestId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{AttemptKind, Status};
use crate::ledger::Owner;
use crate::world::{micros, Ev, NetMsg, NodeId, World};

/// Most exports and read attempts remembered each: far above what a world of a few hundred
/// requests starts; past it, later ones are answered the usual way and not checked.
const MAX_REMEMBERED: usize = 1 << 16;

/// The longest the rank's call follows the engine's answer in the usual case: a few steps of
/// a busy engine.
const USUAL_FILING_DELAY_US: u64 = 60_000;

/// An export answered ahead of its call.
#[derive(Debug)]
struct EarlyExport {
    /// The call the engine's worker makes later, as the answer was computed from it.
    call: ConnectorCall,
    /// When the rank had the export (the call was accepted), if it has.
    filed: Option<Time>,
}

/// The asks of one read attempt, as they left the reader.
#[derive(Debug)]
struct ReaderAsks {
    /// The export the router named to it.
    export: RequestId,
    /// When its first ask left.
    first: Option<Time>,
    /// The ask numbers sent.
    numbers: BTreeSet<u32>,
}

/// What the world remembers of answers ahead of exports.
#[derive(Debug)]
pub(crate) struct EarlyAnswers {
    /// A stream of its own, so that the seed's other draws stay what they were.
    rng: ChaCha8Rng,
    exports: BTreeMap<RequestId, EarlyExport>,
    /// By (reader, key, epoch), reset when the reader's engine starts the attempt.
    asks: BTreeMap<(NodeId, PairingKey, u64), ReaderAsks>,
}

impl EarlyAnswers {
    pub(crate) fn new(seed: u64) -> EarlyAnswers {
        EarlyAnswers {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6561_726c_795f_616e),
            exports: BTreeMap::new(),
            asks: BTreeMap::new(),
        }
    }
}

impl World {
    /// P's engine finished attempt `attempt` of pulled request `request` into `blocks`: if
    /// drawn, the router gets the session's answer to `call` now and the rank the call later
    /// (true); false leaves the call to the usual path (not drawn, or the session refuses it,
    /// which the call itself then reports).
    pub(super) fn answer_ahead(
        &mut self,
        request: usize,
        attempt: usize,
        call: &ConnectorCall,
        blocks: &[u32],
    ) -> bool {
        let r = &self.requests[request];
        let eligible = self.cfg.early_answers > 0.0
            && !self.cfg.explore
            && r.transfer.pull
            && r.multi.is_none()
            && self.early.exports.len() < MAX_REMEMBERED;
        if !eligible || !self.early.rng.gen_bool(self.cfg.early_answers.min(1.0)) {
            return false;
        }
        let Some(session) = self.nodes[0].session.as_ref() else {
            return false;
        };
        let Ok(reply) = session.preview_call(self.now, call) else {
            return false;
        };
        let id = r.p[attempt].id.clone();
        self.record(format!("engine: P answers {id} ahead of its export"));
        self.mark("export_answered_early");
        self.keep_answer(&id, reply);
        // Mostly the worker's next step or two; one in eight slower than a reader asks for
        // (a stalled or overloaded worker), where the reader gives up and declines first.
        let window = self.cfg.machine.register_retry_interval.as_micros() as u64;
        let delay = if self.early.rng.gen_ratio(1, 8) {
            micros(&mut self.early.rng, window / 2, window * 3 / 2)
        } else {
            micros(&mut self.early.rng, 500, USUAL_FILING_DELAY_US)
        };
        let inc = self.nodes[0].incarnation;
        self.early.exports.insert(
            id,
            EarlyExport {
                call: call.clone(),
                filed: None,
            },
        );
        let a = &mut self.requests[request].p[attempt];
        a.blocks = blocks.to_vec();
        a.kind = AttemptKind::Export {
            hard_end: export_hard_end(self.now, self.cfg.machine.lease_duration, &self.cfg.machine),
            renewed: false,
        };
        a.status = Status::Live {
            node_inc: inc,
            started: self.now,
            fenced: None,
        };
        self.schedule(
            delay,
            Ev::FileExport {
                request,
                attempt,
                inc,
            },
        );
        true
    }

    /// P's worker hands the rank the export its engine answered for earlier (incarnation
    /// `inc` of P's process: a crash took the prefill with it).
    pub(crate) fn file_export(&mut self, request: usize, attempt: usize, inc: u32) {
        let a = self.requests[request].p[attempt].clone();
        let live = matches!(a.status, Status::Live { node_inc, .. } if node_inc == inc);
        if !self.alive(0) || self.nodes[0].incarnation != inc || !live {
            return;
        }
        let Some(call) = self.early.exports.get(&a.id).map(|e| e.call.clone()) else {
            self.violate(format!("export {} filed without its answer", a.id));
            return;
        };
        self.record(format!("engine: P's worker files {}", a.id));
        match self.call(0, call) {
            Ok(ConnectorReply::DecodeParams(mut filed)) => {
                let Some(mut early) = self.answers.get(&a.id).cloned() else {
                    self.violate(format!("no answer of export {}", a.id));
                    return;
                };
                // Each counts its expiry from its own time; everything else must agree.
                early.remote_blocks_expiry_time = None;
                filed.remote_blocks_expiry_time = None;
                if early != filed {
                    self.violate(format!(
                        "the rank answered {} with {filed:?}, its engine with {early:?}",
                        a.id
                    ));
                }
                if let Some(export) = self.early.exports.get_mut(&a.id) {
                    export.filed = Some(self.now);
                }
                let hard_end =
                    export_hard_end(self.now, self.cfg.machine.lease_duration, &self.cfg.machine);
                let a = &mut self.requests[request].p[attempt];
                a.kind = AttemptKind::Export {
                    hard_end,
                    renewed: false,
                };
                a.status = Status::Live {
                    node_inc: inc,
                    started: self.now,
                    fenced: None,
                };
                self.last_progress = self.now;
                self.drain(0);
            }
            Ok(reply) => self.violate(format!("export {} answered {reply:?}", a.id)),
            Err(error) => {
                // The rank refuses what its engine promised (a full table): the blocks go
                // back and the reader's asks find nothing; the router starts over.
                if !matches!(error, ConnectorError::Rejected(_)) {
                    self.violate(format!("export {} refused by P: {error}", a.id));
                }
                self.mark("early_export_refused");
                let owner = Owner {
                    request,
                    epoch: a.epoch,
                };
                for e in self.nodes[0].pool.free(&a.blocks, owner) {
                    self.violate(format!("node 0: {e}"));
                }
                self.wake_waiters(0, a.blocks.len());
                self.requests[request].p[attempt].status = Status::Skipped;
            }
        }
    }

    /// D `node`'s engine starts read attempt `epoch` of `key` on export `export`: its asks are
    /// counted from now.
    pub(super) fn note_read_started(
        &mut self,
        node: NodeId,
        key: &PairingKey,
        epoch: u64,
        export: &RequestId,
    ) {
        if !self.early.exports.contains_key(export) || self.early.asks.len() >= MAX_REMEMBERED {
            return;
        }
        self.early.asks.insert(
            (node, key.clone(), epoch),
            ReaderAsks {
                export: export.clone(),
                first: None,
                numbers: BTreeSet::new(),
            },
        );
    }

    /// An ask leaves reader `from` (`send`).
    pub(crate) fn note_ask_sent(&mut self, from: NodeId, message: &Message) {
        let Message::ReadAsk(ask) = message else {
            return;
        };
        let now = self.now;
        if let Some(asks) = self
            .early
            .asks
            .get_mut(&(from, ask.key.clone(), ask.epoch.0))
        {
            asks.first.get_or_insert(now);
            asks.numbers.insert(ask.ask);
        }
    }

    /// P is about to handle `msg`: an ask for an export its engine answered but its rank
    /// does not have yet is the race this module is for.
    pub(crate) fn note_ask_before_export(&mut self, msg: &NetMsg) {
        let Message::ReadAsk(ask) = &msg.message else {
            return;
        };
        if !self.is_prefill(msg.to) {
            return;
        }
        let unfiled = self
            .early
            .asks
            .get(&(msg.from, ask.key.clone(), ask.epoch.0))
            .and_then(|asks| self.early.exports.get(&asks.export))
            .is_some_and(|export| export.filed.is_none());
        if unfiled {
            self.mark("read_asked_before_export");
        }
    }

    /// R1: reader `node`'s attempt `epoch` at request `request` ended `failure`.
    pub(super) fn check_gave_up_early(
        &mut self,
        node: NodeId,
        request: usize,
        epoch: u64,
        failure: Option<ImportFailure>,
    ) {
        if failure != Some(ImportFailure::Refused(ReadRefusal::Unavailable)) {
            return;
        }
        let key = self.requests[request].key.clone();
        let Some(asks) = self.early.asks.get(&(node, key.clone(), epoch)) else {
            return;
        };
        let (Some(first), Some(export)) = (asks.first, self.early.exports.get(&asks.export)) else {
            return;
        };
        let unfiled_at_first_ask = export.filed.is_none_or(|filed| filed > first);
        let m = &self.cfg.machine;
        let asks_sent = asks.numbers.len();
        let within = self.now < first + m.register_retry_interval;
        let asks_left = asks_sent < 1 + m.max_register_retries as usize;
        if unfiled_at_first_ask && within && asks_left {
            let waited = self.now.saturating_since(first);
            self.violate(format!(
                "R1: reader {node} gave up on {} ({key} e{epoch}), answered ahead of its export, \
                 {waited:?} after its first ask with {asks_sent} ask(s) sent",
                asks.export
            ));
        }
    }
}
