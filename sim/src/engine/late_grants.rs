//! Late grants (swarm): a reader that handles its grant near the end of the grant's delivery
//! bound, posts its reads, and stops with them frozen past the holder's grant fence.
//!
//! A reader trusts a read only until its trust horizon (the ask the grant answers plus a read's
//! span) and gives up on its reads at the fabric's bound after the post (plus the abandon wait).
//! The holder fences its blocks a read's span after it sent the grant. When the grant reaches
//! the reader's handling fast, the reader gives up before the holder's fence, and a read that
//! lands after the fence is never counted, whatever the trust horizon says: the late-read
//! check (`ImportFailure::LateRead`) is then redundant and its mutation (`trust_late_reads`)
//! invisible. The check carries weight only when the grant was handled late: more than
//! `max_message_delay − abandon_timeout` after it was sent (a slow network, or a reader
//! stopped with the grant in its receive queue), so that the reader still waits for its reads
//! when the holder's fence frees the blocks. A reader stopped right after that post, its read
//! frozen (measured: over UCX/TCP a stopped poster's bytes stop too), then lands what the
//! holder's freed blocks hold at the resume.
//!
//! In one stalling seed in three that reads (`WorldConfig::late_grant`), some grants meet
//! that: the reader stops as the grant arrives, until a time drawn where the grant is late
//! but not stale (within `max_message_delay` of its ask), and its resume hands the grant
//! over first (where the world's shell may do so, `stall_messages_first`; with the timers
//! first the ask is resent, and the copy moves the holder's fence past the reader's bound).
//! The reader posts, and stops again at once, its reads frozen, until just past the holder's
//! fence and before its own bound. Mark `frozen_read_landed_after_holder_freed`: a frozen
//! read landed (not failed) after the holder freed a block it reads.

use std::collections::BTreeMap;
use std::time::Duration;

use kvhandoff_protocol::machine::{read_span, Time};
use kvhandoff_protocol::{Message, PairingKey};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::world::{micros, NetMsg, NodeId, World};

/// Most aimed stalls per world: each stops a reader for about a read's span.
pub(crate) const MAX_LATE_GRANT_STALLS: u32 = 3;

/// Most asks and grants remembered each: far above what a world of a few hundred requests
/// sends (one ask and grant per read attempt and resend), so that the tables stay bounded
/// whatever the load; past it, later ones meet no aimed stall.
const MAX_REMEMBERED: usize = 1 << 16;

/// An ask or a grant of one attempt: (reader, key, epoch, ask number).
type AskId = (NodeId, PairingKey, u64, u32);

/// What the world remembers for the aimed stalls.
#[derive(Debug)]
pub(crate) struct LateGrants {
    /// A stream of its own, so that the seed's other draws stay what they were.
    rng: ChaCha8Rng,
    /// When each ask left its reader.
    asked: BTreeMap<AskId, Time>,
    /// When each grant left its holder.
    granted: BTreeMap<AskId, Time>,
    /// Readers stopped with a late grant queued, by (reader, key): the holder's grant fence.
    aimed: BTreeMap<(NodeId, PairingKey), Time>,
    /// Aimed stalls begun.
    stalls: u32,
}

impl LateGrants {
    pub(crate) fn new(seed: u64) -> LateGrants {
        LateGrants {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6c61_7465_5f67_7274),
            asked: BTreeMap::new(),
            granted: BTreeMap::new(),
            aimed: BTreeMap::new(),
            stalls: 0,
        }
    }
}

/// How much later than the delivery bound less the abandon wait a grant must be handled for
/// the reader's bound to pass the holder's fence by a usable margin.
const LATE_BY: Duration = Duration::from_millis(20);

/// How long before the ask's delivery bound the aimed resume comes (the grant is then not
/// stale).
const BEFORE_STALE: Duration = Duration::from_millis(2);

/// The aimed second resume's distance from the holder's fence and from the reader's own bound
/// (room for the frozen read's rest, its report and the abandon's confirmation).
const PAST_FENCE: Duration = Duration::from_millis(5);
const BEFORE_BOUND: Duration = Duration::from_millis(20);

impl World {
    fn late_grants_on(&self) -> bool {
        self.cfg.late_grant > 0.0 && self.cfg.may_stall() && self.cfg.stall_messages_first > 0.0
    }

    /// Remembers when asks and grants leave (`send`).
    pub(crate) fn note_read_message(&mut self, from: NodeId, to: NodeId, message: &Message) {
        if !self.late_grants_on() || !self.faulty() {
            return;
        }
        let (table, id) = match message {
            Message::ReadAsk(ask) => (
                &mut self.late_grants.asked,
                (from, ask.key.clone(), ask.epoch.0, ask.ask),
            ),
            Message::ReadGrant(grant) => (
                &mut self.late_grants.granted,
                (to, grant.key.clone(), grant.epoch.0, grant.ask),
            ),
            _ => return,
        };
        if table.len() < MAX_REMEMBERED {
            table.insert(id, self.now);
        }
    }

    /// A grant reaches its reader (`deliver`): the reader may stop now, until the grant is
    /// late but not stale, its resume handing the grant over first.
    pub(crate) fn maybe_stall_before_late_grant(&mut self, msg: &NetMsg) {
        let Message::ReadGrant(grant) = &msg.message else {
            return;
        };
        let reader = msg.to;
        if !self.late_grants_on()
            || !self.faulty()
            || self.late_grants.stalls >= MAX_LATE_GRANT_STALLS
            || !self.alive(reader)
            || self.stalled(reader)
        {
            return;
        }
        let id = (reader, grant.key.clone(), grant.epoch.0, grant.ask);
        let (Some(&asked), Some(&sent)) = (
            self.late_grants.asked.get(&id),
            self.late_grants.granted.get(&id),
        ) else {
            return;
        };
        let share = self.cfg.late_grant.min(1.0);
        if !self.late_grants.rng.gen_bool(share) {
            return;
        }
        let m = &self.cfg.machine;
        let late = sent + m.max_message_delay.saturating_sub(m.abandon_timeout) + LATE_BY;
        let Some(latest) = before(asked + m.max_message_delay, BEFORE_STALE) else {
            return;
        };
        let earliest = late.max(self.now);
        if earliest >= latest {
            return;
        }
        let span = latest.saturating_since(earliest).as_micros() as u64;
        let resume = earliest + micros(&mut self.late_grants.rng, 0, span);
        let length = resume.saturating_since(self.now);
        if length.is_zero() {
            return;
        }
        let fence = sent + read_span(&self.cfg.machine);
        self.late_grants.stalls += 1;
        self.late_grants
            .aimed
            .insert((reader, grant.key.clone()), fence);
        // Messages first: with the timers first the ask is resent, and its copy moves the
        // holder's fence past the reader's bound (`late_grants_on` needs a world whose shell
        // may hand over first).
        self.stall(reader, length, true, true);
        self.heal = self.heal.max(resume + Duration::from_millis(200));
    }

    /// `node` posted a read of `key` (`post_read`): if it handled a late grant of the key, it
    /// stops at once, its reads frozen, until just past the holder's fence and before its own
    /// bound on the reads.
    pub(crate) fn maybe_stall_after_late_read(&mut self, node: NodeId, key: &PairingKey) {
        let Some(fence) = self.late_grants.aimed.remove(&(node, key.clone())) else {
            return;
        };
        let m = &self.cfg.machine;
        let bound = self.now + m.max_write_life + m.abandon_timeout;
        let earliest = fence + PAST_FENCE;
        let Some(latest) = before(bound, BEFORE_BOUND) else {
            return;
        };
        if earliest >= latest || self.stalled(node) || !self.alive(node) {
            return;
        }
        let span = latest.saturating_since(earliest).as_micros() as u64;
        let resume = earliest + micros(&mut self.late_grants.rng, 0, span);
        self.stall_after_this_step(node, resume.saturating_since(self.now), false);
    }
}

/// `d` before `t`, if `t` is that far from the origin.
fn before(t: Time, d: Duration) -> Option<Time> {
    t.since_origin().checked_sub(d).map(Time::from_duration)
}
