//! Hostile peers (seeded mode): a D rank that floods P with cancels and releases for made-up
//! keys ([`WorldConfig::flood_peer`](super::WorldConfig::flood_peer)), and P ranks whose answers
//! name another rank ([`WorldConfig::misname_rank`](super::WorldConfig::misname_rank)).
//!
//! The simulated engines are honest: every key a D rank names is one it registered, and every P
//! rank names itself in its answers. The defences against peers that are not (P's per-peer
//! budget of records for keys it holds nothing for, D's check that an answer counts only for the
//! rank that sent it) would then never be exercised, and their loss never seen. Each behaviour
//! draws from a ChaCha8 stream of its own, seeded from the world's seed, so the world's own
//! stream makes the same draws whether or not it runs (the extra messages still change the
//! world's course).
//!
//! The checks, from outside the machines:
//!
//! - B1 (the flood): P's rank 0 refuses its own engine's call for a full table while the
//!   flooding peer's made-up keys hold more young records than one peer's share of the table
//!   (`PeerBudget::peer_cap` in the protocol crate: a quarter). That is the budget's promise
//!   (`prefill_table/budget.rs`): one peer can never take more than its share, so the engine's
//!   admission is never lost to one peer's made-up keys beyond it. A record is counted only
//!   when P's answer shows it was written (the `CancelAck` P sent while handling the made-up
//!   cancel, at that time); releases, unanswered, are not counted, so the count never exceeds
//!   what P really wrote.
//! - R1 (misnamed ranks): an answer naming a rank other than its sender's changes nothing of
//!   D's request (as S5 for a stale epoch). Where the answer speaks for a sibling rank's share
//!   of a multi-rank request, a D that counted it also fails the ledger's own checks (S7/S8: a
//!   `Ready` before that rank's write landed; the hand-back judge: blocks back while it may
//!   still write).

use std::collections::BTreeMap;
use std::time::Duration;

use kvhandoff_protocol::machine::{DropReason, Time};
use kvhandoff_protocol::{
    Cancel, CancelReason, Epoch, Message, PairingKey, Release, ReleaseReason,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{micros, Ev, NetMsg, NodeId, World, FLOOD_MARKS, MISNAME_MARKS};

/// The D node that floods: D's rank 0, an ordinary rank with requests of its own, connected to
/// P like any other.
const FLOOD_NODE: NodeId = 1;

/// The P node it floods: P's rank 0, which serves every single-source request.
const FLOOD_TARGET: NodeId = 0;

/// Every made-up key starts with this (the simulator's own keys start with `k`).
const MADE_UP_PREFIX: &str = "made-up-";

/// Messages per burst, inclusive; a burst every eighth to quarter heartbeat: tens per heartbeat.
const BURST: std::ops::RangeInclusive<u32> = 3..=8;

/// What the hostile peers draw and what the checks saw of them.
#[derive(Debug)]
pub(crate) struct Hostile {
    flood_rng: ChaCha8Rng,
    misname_rng: ChaCha8Rng,
    /// When the next burst of made-up keys is due (`None` once the faulty phase is over).
    next_flood: Option<Time>,
    /// Made-up keys sent so far (each burst names fresh ones).
    made_up: u64,
    /// The made-up key P's rank 0 is handling now, if any.
    handling: Option<PairingKey>,
    /// Made-up keys P's rank 0 acknowledged while handling their cancel: the P incarnation and
    /// when (a record written then, for the flooding peer). Only the first acknowledgement of a
    /// key counts (a duplicate's finds the record already there).
    recorded: BTreeMap<PairingKey, (u32, Time)>,
}

impl Hostile {
    /// The streams of `seed`'s hostile peers; the first burst one heartbeat-share in.
    pub(crate) fn new(seed: u64, heartbeat: Duration) -> Hostile {
        let mut flood_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x666c_6f6f_645f_7065);
        let first = Time::ZERO + burst_gap(&mut flood_rng, heartbeat);
        Hostile {
            flood_rng,
            misname_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6d69_736e_616d_6564),
            next_flood: Some(first),
            made_up: 0,
            handling: None,
            recorded: BTreeMap::new(),
        }
    }
}

/// The time to the next burst: an eighth to a quarter of the heartbeat.
fn burst_gap(rng: &mut ChaCha8Rng, heartbeat: Duration) -> Duration {
    let hb = heartbeat.as_micros() as u64;
    micros(rng, (hb / 8).max(1), (hb / 4).max(2))
}

/// The key and named rank of a P→D answer.
fn answer_of(message: &Message) -> Option<(&PairingKey, u32)> {
    match message {
        Message::WriteDone(m) => Some((&m.key, m.prefill_rank)),
        Message::WriteFailed(m) => Some((&m.key, m.prefill_rank)),
        Message::CancelAck(m) => Some((&m.key, m.prefill_rank)),
        _ => None,
    }
}

/// `message` (an answer) naming `rank` and, if given, `key` instead.
fn renamed(message: Message, rank: u32, key: Option<PairingKey>) -> Message {
    match message {
        Message::WriteDone(mut m) => {
            m.prefill_rank = rank;
            m.key = key.unwrap_or(m.key);
            Message::WriteDone(m)
        }
        Message::WriteFailed(mut m) => {
            m.prefill_rank = rank;
            m.key = key.unwrap_or(m.key);
            Message::WriteFailed(m)
        }
        Message::CancelAck(mut m) => {
            m.prefill_rank = rank;
            m.key = key.unwrap_or(m.key);
            Message::CancelAck(m)
        }
        other => other,
    }
}

/// What [`World::hostile_before`] saw before a message was handled.
pub(crate) enum Before {
    /// A made-up key's cancel or release reaching P: its budget drops so far.
    Flood { budget_drops: u64 },
    /// An answer naming another rank than its sender's, reaching D.
    Misnamed {
        key: PairingKey,
        request: Option<usize>,
        state: Option<String>,
        unexpected_drops: u64,
        events: usize,
    },
}

impl World {
    /// Sends the burst of made-up keys that is due no later than the world's next event and
    /// next timer, as a step of its own; false if none is (none once the faulty phase is over).
    pub(crate) fn flood_step(&mut self, event: Option<Time>, timer: Option<Time>) -> bool {
        if !self.cfg.floods() {
            return false;
        }
        let Some(at) = self.hostile.next_flood else {
            return false;
        };
        let next = event.into_iter().chain(timer).min();
        if at >= self.heal || next.is_none_or(|next| at > next) {
            return false;
        }
        self.now = self.now.max(at);
        self.flood_burst();
        self.check_step();
        true
    }

    /// The flooding rank sends a burst of cancels and releases for made-up keys to P, on its
    /// live connection, if its process runs and it is connected; the next burst is drawn.
    fn flood_burst(&mut self) {
        let heartbeat = self.cfg.machine.heartbeat_interval;
        let gap = burst_gap(&mut self.hostile.flood_rng, heartbeat);
        self.hostile.next_flood = Some(self.now + gap);
        let (from, to) = (FLOOD_NODE, FLOOD_TARGET);
        let sending = self.alive(from)
            && !self.stalled(from)
            && self.connected_incarnation(from, to).is_some();
        let n = self.hostile.flood_rng.gen_range(BURST);
        self.record(format!(
            "flood {from}->{to}: {n} made-up keys, sent={sending}"
        ));
        if !sending {
            return;
        }
        for _ in 0..n {
            self.hostile.made_up += 1;
            let Ok(key) = PairingKey::new(format!("{MADE_UP_PREFIX}{}", self.hostile.made_up))
            else {
                return;
            };
            // Mostly cancels: P answers those, which shows the record it wrote.
            let message = if self.hostile.flood_rng.gen_ratio(3, 4) {
                Message::Cancel(Cancel {
                    key,
                    epoch: Epoch::FIRST,
                    reason: CancelReason::Aborted,
                })
            } else {
                Message::Release(Release {
                    key,
                    epoch: Epoch::FIRST,
                    reason: ReleaseReason::Aborted,
                })
            };
            let msg = self.net_msg(from, to, message);
            // The delay comes from the flood's stream; a partition holds these as any message.
            let mut delay = micros(&mut self.hostile.flood_rng, 50, 2_000);
            if let Some(until) = self.partitioned(from, to, self.now) {
                delay = delay.max(until.saturating_since(self.now));
            }
            self.schedule(delay, Ev::Deliver(msg));
        }
    }

    /// A message `from` sends to `to`, as it goes on the network: a P rank's answer may name
    /// another rank (`misname_rank`), and P's acknowledgement of a made-up key is noted (B1).
    pub(crate) fn hostile_send(&mut self, from: NodeId, to: NodeId, message: Message) -> Message {
        if let (Message::CancelAck(ack), Some(handling)) = (&message, &self.hostile.handling) {
            if from == FLOOD_TARGET && to == FLOOD_NODE && &ack.key == handling {
                let at = (self.nodes[from].incarnation, self.now);
                self.hostile.recorded.entry(ack.key.clone()).or_insert(at);
            }
        }
        if !self.cfg.misnames()
            || !self.faulty()
            || !self.is_prefill(from)
            || self.is_prefill(to)
            || answer_of(&message).is_none()
            || !self
                .hostile
                .misname_rng
                .gen_bool(self.cfg.misname_rank.min(1.0))
        {
            return message;
        }
        let own = self.nodes[from].addr.rank;
        // A sibling: another P rank writing the same D rank for the same multi-rank request.
        let siblings: Vec<(u32, PairingKey)> = answer_of(&message)
            .and_then(|(key, _)| self.keys.get(key))
            .and_then(|&i| self.requests[i].multi.as_ref())
            .map(|multi| {
                multi
                    .pairs
                    .iter()
                    .filter(|pair| pair.d == to && pair.p != from)
                    .map(|pair| (self.nodes[pair.p].addr.rank, pair.key.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let rng = &mut self.hostile.misname_rng;
        let (rank, key) = if !siblings.is_empty() && rng.gen_bool(0.5) {
            let (rank, key) = siblings[rng.gen_range(0..siblings.len())].clone();
            (rank, Some(key))
        } else {
            let others = self.cfg.prefill_ranks.max(2) as u32 - 1;
            let pick = rng.gen_range(0..others);
            (if pick >= own { pick + 1 } else { pick }, None)
        };
        let line = format!("misname {from}->{to}: rank {own} answers as rank {rank}");
        self.record(line);
        renamed(message, rank, key)
    }

    /// What the checks need from before `msg` is handled (`None`: not a hostile message).
    pub(crate) fn hostile_before(&mut self, msg: &NetMsg) -> Option<Before> {
        let endpoint = self.nodes[msg.to].endpoint()?;
        let made_up = match &msg.message {
            Message::Cancel(m) => Some(&m.key),
            Message::Release(m) => Some(&m.key),
            _ => None,
        }
        .filter(|key| key.as_str().starts_with(MADE_UP_PREFIX));
        if let Some(key) = made_up {
            let budget_drops = endpoint.counters().dropped(DropReason::TombstoneBudget);
            self.hostile.handling = Some(key.clone());
            return Some(Before::Flood { budget_drops });
        }
        let (key, rank) = answer_of(&msg.message)?;
        if !self.is_prefill(msg.from) || rank == self.nodes[msg.from].addr.rank {
            return None;
        }
        Some(Before::Misnamed {
            key: key.clone(),
            request: self.keys.get(key).copied(),
            state: endpoint.decode_state(key),
            unexpected_drops: endpoint.counters().dropped(DropReason::Unexpected),
            events: self.step_decode_events.len(),
        })
    }

    /// The marks and the R1 check once `msg` was handled (`sender_declared_dead`: it was taken
    /// as from a peer past its deadline, whose death may change D's requests).
    pub(crate) fn hostile_after(
        &mut self,
        msg: &NetMsg,
        before: Before,
        sender_declared_dead: bool,
    ) {
        self.hostile.handling = None;
        let Some(endpoint) = self.nodes[msg.to].endpoint() else {
            return;
        };
        match before {
            Before::Flood { budget_drops } => {
                if endpoint.counters().dropped(DropReason::TombstoneBudget) > budget_drops {
                    self.mark(FLOOD_MARKS[0]); // peer_flood_refused
                }
            }
            Before::Misnamed {
                key,
                request,
                state,
                unexpected_drops,
                events,
            } => {
                let refused =
                    endpoint.counters().dropped(DropReason::Unexpected) > unexpected_drops;
                let changed = endpoint.decode_state(&key) != state;
                if refused {
                    self.mark(MISNAME_MARKS[0]); // misnamed_rank_refused
                }
                if sender_declared_dead {
                    return;
                }
                let ended = request.is_some_and(|r| self.step_decode_events[events..].contains(&r));
                if ended || changed {
                    let what = if ended { "ended" } else { "changed" };
                    let named = answer_of(&msg.message).map_or(0, |(_, rank)| rank);
                    let sender = self.nodes[msg.from].addr.rank;
                    self.violate(format!(
                        "R1: an answer for {key} from P rank {sender} naming rank {named} {what} \
                         D's request on node {} ({})",
                        msg.to,
                        super::describe(msg)
                    ));
                }
            }
        }
    }

    /// B1, when `node`'s engine was refused for a full table: if it is the flooded P rank, the
    /// flooding peer's made-up keys must not hold more young records than one peer's share.
    pub(crate) fn check_flood_admission(&mut self, node: NodeId) {
        if !self.cfg.floods() || node != FLOOD_TARGET {
            return;
        }
        let table = self.cfg.machine.max_tombstones;
        // `PeerBudget::peer_cap` and its window (`budget.rs`): a quarter of the table, for
        // `tombstone_min_life`.
        let cap = (table / 4).max(1);
        let young_for = self.cfg.machine.tombstone_min_life();
        let inc = self.nodes[node].incarnation;
        let young = self
            .hostile
            .recorded
            .values()
            .filter(|&&(i, at)| i == inc && at + young_for > self.now)
            .count();
        if young > cap {
            self.violate(format!(
                "B1: P rank 0 refused its engine for a full table while peer {} held {young} \
                 young records of made-up keys, over one peer's share of {cap} (table {}, young \
                 for {young_for:?})",
                self.nodes[FLOOD_NODE].addr, table
            ));
        }
    }
}

#[cfg(test)]
mod tests;
