//! Answers ahead of exports (swarm): P's engine hands the router its answer for a pulled
//! request before its rank has the export, as vLLM does — its scheduler answers at the end of
//! P's step, and its worker hands the export to the rank with the next step's metadata. D may
//! then ask before the export exists, and P answers that it exports nothing under the key.
//!
//! The answer is the session's own ([`Session::preview_call`]: the checks and the reply of the
//! call, nothing handed to the endpoint); the call itself follows a drawn delay later, and its
//! reply must be the answer the router already has (bar the expiry, which counts from each
//! one's time). In a world that draws it (`WorldConfig::early_answers`), that share of the
//! single-source pulls is answered so; `multi/early.rs` answers multi-rank pulls ahead,
//! `early_keeps.rs` and `multi/turn/early.rs` D's keeps for a second turn, with the
//! bookkeeping here.
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
use std::time::Duration;

use kvhandoff_protocol::machine::{export_hard_end, ImportFailure, Time};
use kvhandoff_protocol::session::{ConnectorCall, ConnectorError, ConnectorReply, RankLinks};
use kvhandoff_protocol::{Message, PairingKey, ReadRefusal, RequestId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{AttemptKind, Status};
use crate::ledger::Owner;
use crate::world::{Ev, NetMsg, NodeId, World};

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
    kind: EarlyKind,
}

/// What an engine answered ahead of its rank's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EarlyKind {
    /// P's export of a single-source pull.
    Single,
    /// A P rank's share of a multi-rank pull.
    Part,
    /// D's keep of a request's blocks for its second turn.
    Keep,
    /// A D rank's share of a multi-rank request's keep for its second turn.
    TurnPart,
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

/// A P rank's share of a multi-rank pull answered ahead: the call its worker makes later.
#[derive(Debug)]
pub(super) struct SubFiling {
    pub call: ConnectorCall,
    pub links: RankLinks,
    pub blocks: Vec<u32>,
    /// The rank's attempts the call starts, and their attempt number.
    pub pending: Vec<usize>,
    pub epoch: u64,
}

/// What the world remembers of answers ahead of exports.
#[derive(Debug)]
pub(crate) struct EarlyAnswers {
    /// A stream of its own, so that the seed's other draws stay what they were.
    rng: ChaCha8Rng,
    /// Multi-rank pulls' draws, on another, and second turns' keeps on a third: a world's
    /// single pulls draw what they drew before the others were answered ahead.
    parts_rng: ChaCha8Rng,
    keeps_rng: ChaCha8Rng,
    /// By the export's id: a single export's, or a P sub-request's of a multi-rank pull.
    exports: BTreeMap<RequestId, EarlyExport>,
    /// By (reader, key, epoch), reset when the reader's engine starts the attempt.
    asks: BTreeMap<(NodeId, PairingKey, u64), ReaderAsks>,
    /// Second turns' reads started on a keep answered ahead, by (reader, key): their first ask
    /// names the epoch they are counted under in `asks`.
    turn_reads: BTreeMap<(NodeId, PairingKey), RequestId>,
    /// Whether attempt (request, epoch) of a multi-rank pull is answered ahead, drawn once for
    /// all its P ranks.
    multi_draws: BTreeMap<(usize, u64), bool>,
    /// The multi-rank shares answered ahead and not filed yet, by (request, P rank node).
    pub(super) sub_filings: BTreeMap<(usize, NodeId), SubFiling>,
    /// Whether a multi-rank request's keep for its second turn is answered ahead, drawn at
    /// its first D rank and kept for the others.
    turn_draws: BTreeMap<usize, bool>,
    /// The D ranks' keeps answered ahead and not filed yet, by (request, D rank node).
    pub(super) turn_filings: BTreeMap<(usize, NodeId), TurnFiling>,
}

/// A D rank's share of a multi-rank request's keep answered ahead: the call its worker makes
/// later, with the links it makes it with, over the blocks it keeps under `owner`.
#[derive(Debug)]
pub(super) struct TurnFiling {
    pub call: ConnectorCall,
    pub turn: RankLinks,
    pub forward: RankLinks,
    pub blocks: Vec<u32>,
    pub owner: Owner,
}

impl EarlyAnswers {
    pub(crate) fn new(seed: u64) -> EarlyAnswers {
        EarlyAnswers {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6561_726c_795f_616e),
            parts_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x7061_7274_735f_6561),
            keeps_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6b65_6570_735f_6561),
            exports: BTreeMap::new(),
            asks: BTreeMap::new(),
            turn_reads: BTreeMap::new(),
            multi_draws: BTreeMap::new(),
            sub_filings: BTreeMap::new(),
            turn_draws: BTreeMap::new(),
            turn_filings: BTreeMap::new(),
        }
    }

    /// Whether there is room to remember one more export answered ahead.
    pub(super) fn has_room(&self) -> bool {
        self.exports.len() < MAX_REMEMBERED
            && self.sub_filings.len() < MAX_REMEMBERED
            && self.turn_filings.len() < MAX_REMEMBERED
    }

    /// Whether attempt `epoch` of multi-rank pull `request` is answered ahead (`share` of
    /// them are), drawn at its first P rank and kept for the others.
    pub(super) fn draw_multi(&mut self, request: usize, epoch: u64, share: f64) -> bool {
        if let Some(&drawn) = self.multi_draws.get(&(request, epoch)) {
            return drawn;
        }
        let drawn =
            self.multi_draws.len() < MAX_REMEMBERED && self.parts_rng.gen_bool(share.min(1.0));
        self.multi_draws.insert((request, epoch), drawn);
        drawn
    }

    /// How long after the engine's answer its worker hands the rank the export: mostly the
    /// worker's next step or two; one in eight slower than a reader asks for (a stalled or
    /// overloaded worker), where the reader gives up and declines first. `window` is
    /// `register_retry_interval`.
    pub(super) fn filing_delay(&mut self, window: Duration, kind: EarlyKind) -> Duration {
        let window = window.as_micros() as u64;
        let rng = self.stream(kind);
        let us = if rng.gen_ratio(1, 8) {
            rng.gen_range(window / 2..=window * 3 / 2)
        } else {
            rng.gen_range(500..=USUAL_FILING_DELAY_US)
        };
        Duration::from_micros(us)
    }

    /// The draws of answers of `kind`.
    fn stream(&mut self, kind: EarlyKind) -> &mut ChaCha8Rng {
        match kind {
            EarlyKind::Single => &mut self.rng,
            EarlyKind::Part => &mut self.parts_rng,
            EarlyKind::Keep | EarlyKind::TurnPart => &mut self.keeps_rng,
        }
    }

    /// Whether multi-rank request `request`'s keep for its second turn is answered ahead
    /// (`share` of them are), drawn at its first D rank and kept for the others.
    pub(super) fn draw_turn(&mut self, request: usize, share: f64) -> bool {
        if let Some(&drawn) = self.turn_draws.get(&request) {
            return drawn;
        }
        let drawn =
            self.turn_draws.len() < MAX_REMEMBERED && self.keeps_rng.gen_bool(share.min(1.0));
        self.turn_draws.insert(request, drawn);
        drawn
    }

    /// Whether a keep for a second turn is answered ahead (`share` of them are).
    pub(super) fn draw_keep(&mut self, share: f64) -> bool {
        self.keeps_rng.gen_bool(share.min(1.0))
    }

    /// Export `id` of `kind` was answered ahead of `call`.
    pub(super) fn answered(&mut self, id: RequestId, call: ConnectorCall, kind: EarlyKind) {
        self.exports.insert(
            id,
            EarlyExport {
                call,
                filed: None,
                kind,
            },
        );
    }

    /// The call answered ahead as export `id`, if it was.
    pub(super) fn call_of(&self, id: &RequestId) -> Option<ConnectorCall> {
        self.exports.get(id).map(|e| e.call.clone())
    }

    /// The rank has export `id` since `now`.
    pub(super) fn filed(&mut self, id: &RequestId, now: Time) {
        if let Some(export) = self.exports.get_mut(id) {
            export.filed = Some(now);
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
            && self.early.has_room();
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
        let delay = self
            .early
            .filing_delay(self.cfg.machine.register_retry_interval, EarlyKind::Single);
        let inc = self.nodes[0].incarnation;
        self.early.answered(id, call.clone(), EarlyKind::Single);
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
        if !self.alive(0) || self.nodes[0].incarnation != inc {
            // The process died with the prefill; its restart starts over.
            return;
        }
        if !matches!(a.status, Status::Live { node_inc, .. } if node_inc == inc) {
            self.filed_after_end(0, &a.id);
            return;
        }
        let Some(call) = self.early.call_of(&a.id) else {
            self.violate(format!("export {} filed without its answer", a.id));
            return;
        };
        self.record(format!("engine: P's worker files {}", a.id));
        match self.call(0, call) {
            Ok(reply @ ConnectorReply::DecodeParams(_)) => {
                self.check_filed_reply(&a.id, reply);
                self.early.filed(&a.id, self.now);
                let hard_end =
                    export_hard_end(self.now, self.cfg.machine.lease_duration, &self.cfg.machine);
                self.requests[request].p[attempt].export_live(inc, self.now, hard_end);
                self.last_progress = self.now;
                self.drain(0);
            }
            Ok(reply) => self.violate(format!("export {} answered {reply:?}", a.id)),
            Err(error) => {
                // The router starts over.
                let owner = Owner {
                    request,
                    epoch: a.epoch,
                };
                self.filing_refused(0, &a.id, error, &a.blocks, owner);
                self.requests[request].p[attempt].status = Status::Skipped;
            }
        }
    }

    /// The call for `id` comes after the attempt it starts ended: nothing in the engine model
    /// ends one before its call (a crash takes the call with it), and its blocks would stay out.
    pub(super) fn filed_after_end(&mut self, node: NodeId, id: &RequestId) {
        self.violate(format!(
            "node {node}'s call for {id}, answered ahead, comes after its attempt ended"
        ));
    }

    /// The rank's call for `id`, answered ahead, replied `reply`: the router has the
    /// engine's answer, and the two must agree bar the expiry (each counts it from its own
    /// time).
    pub(super) fn check_filed_reply(&mut self, id: &RequestId, reply: ConnectorReply) {
        let (ConnectorReply::DecodeParams(mut filed) | ConnectorReply::NextTurnParams(mut filed)) =
            reply
        else {
            self.violate(format!("{id} answered {reply:?} at its call"));
            return;
        };
        let Some(mut early) = self.answers.get(id).cloned() else {
            self.violate(format!("no answer of {id}"));
            return;
        };
        early.remote_blocks_expiry_time = None;
        filed.remote_blocks_expiry_time = None;
        if early != filed {
            self.violate(format!(
                "the rank answered {id} with {filed:?}, its engine with {early:?}"
            ));
        }
    }

    /// `node`'s rank refused the call for `id` its engine had answered for: a full table is
    /// the rank's right (the blocks, leased to `owner`, go back, and the asks of its readers
    /// find nothing); any other refusal is a violation.
    pub(super) fn filing_refused(
        &mut self,
        node: NodeId,
        id: &RequestId,
        error: ConnectorError,
        blocks: &[u32],
        owner: Owner,
    ) {
        if !matches!(error, ConnectorError::Rejected(_)) {
            self.violate(format!("{id} refused by node {node} at its call: {error}"));
        }
        self.mark("early_export_refused");
        for e in self.nodes[node].pool.free(blocks, owner) {
            self.violate(format!("node {node}: {e}"));
        }
        self.wake_waiters(node, blocks.len());
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

    /// P `node`'s engine starts reading the second turn kept as `export` under `key`: its
    /// asks are counted from its first.
    pub(super) fn note_turn_read_started(
        &mut self,
        node: NodeId,
        key: &PairingKey,
        export: &RequestId,
    ) {
        let full = self.early.asks.len() >= MAX_REMEMBERED
            || self.early.turn_reads.len() >= MAX_REMEMBERED;
        if !self.early.exports.contains_key(export) || full {
            return;
        }
        self.early
            .turn_reads
            .insert((node, key.clone()), export.clone());
    }

    /// An ask leaves reader `from` (`send`).
    pub(crate) fn note_ask_sent(&mut self, from: NodeId, message: &Message) {
        let Message::ReadAsk(ask) = message else {
            return;
        };
        let now = self.now;
        let at = (from, ask.key.clone(), ask.epoch.0);
        if !self.early.asks.contains_key(&at) {
            let Some(export) = self.early.turn_reads.remove(&(from, ask.key.clone())) else {
                return;
            };
            let asks = ReaderAsks {
                export,
                first: None,
                numbers: BTreeSet::new(),
            };
            self.early.asks.insert(at.clone(), asks);
        }
        if let Some(asks) = self.early.asks.get_mut(&at) {
            asks.first.get_or_insert(now);
            asks.numbers.insert(ask.ask);
        }
    }

    /// A holder is about to handle `msg`: an ask for an export its engine answered but its
    /// rank does not have yet is the race this module is for.
    pub(crate) fn note_ask_before_export(&mut self, msg: &NetMsg) {
        let Message::ReadAsk(ask) = &msg.message else {
            return;
        };
        let unfiled = self
            .early
            .asks
            .get(&(msg.from, ask.key.clone(), ask.epoch.0))
            .and_then(|asks| self.early.exports.get(&asks.export))
            .filter(|export| export.filed.is_none())
            .map(|export| export.kind);
        match unfiled {
            Some(EarlyKind::Single) => self.mark("read_asked_before_export"),
            Some(EarlyKind::Part) => self.mark("part_asked_before_export"),
            Some(EarlyKind::Keep) => self.mark("turn_asked_before_keep"),
            Some(EarlyKind::TurnPart) => self.mark("turn_part_asked_before_keep"),
            None => {}
        }
    }

    /// R1: reader `node`'s attempt `epoch` under `key` (a request's, or a pair's of a
    /// multi-rank read) ended `failure`.
    pub(super) fn check_gave_up_early(
        &mut self,
        node: NodeId,
        key: &PairingKey,
        epoch: u64,
        failure: Option<ImportFailure>,
    ) {
        if failure != Some(ImportFailure::Refused(ReadRefusal::Unavailable)) {
            return;
        }
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
