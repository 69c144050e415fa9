//! Late siblings (swarm): a second D engine of a key (the router sent the decode leg twice)
//! that starts registering as P's record of the key's ended request ages.
//!
//! P answers a registration for an attempt it settled from its record of the key, and writes
//! the record again (`PrefillTable::refresh`): the registration's resends and late copies count
//! from the sibling's own first send, not from when the record was written. The seeded worlds'
//! second decodes start within the world's span, seconds before a record ages, so a record
//! left as it was written (`skip_record_refresh`) expired under a sibling's copies in one world
//! of thousands (push seed 689). Here, in every chaos pushing world with two D engines and a
//! table with room (`WorldConfig::late_siblings`), that share of the single-source push
//! requests whose P request failed (its record has an answer to replay) gets a sibling when
//! P's request ends, timed for its registration to reach the record shortly before the
//! record's first expiry; each of its registrations gets a late copy, which arrives after it.
//! Mark `sibling_copy_past_record`: P handled a registration of a late sibling after the time
//! its key's record, as first written, expired.

use std::collections::BTreeMap;

use kvhandoff_protocol::machine::{PrefillOutcome, ReleaseCause, Time};
use kvhandoff_protocol::{Message, PairingKey};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::world::{micros, Ev, NetMsg, NodeId, World};

/// Most late siblings remembered: far above what a world of a few hundred requests draws.
const MAX_REMEMBERED: usize = 1 << 16;

/// What the world remembers of late siblings.
#[derive(Debug)]
pub(crate) struct LateSiblings {
    /// A stream of its own, so that the seed's other draws stay what they were.
    rng: ChaCha8Rng,
    /// By key: when the record that P wrote at its request's end first expires.
    record_expiry: BTreeMap<PairingKey, Time>,
}

impl LateSiblings {
    pub(crate) fn new(seed: u64) -> LateSiblings {
        LateSiblings {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6c61_7465_5f73_6962),
            record_expiry: BTreeMap::new(),
        }
    }
}

impl World {
    /// P's request of single-source push request `request` ended now with `outcome`, leaving
    /// its record of the key: if drawn, a sibling D of the key starts so that its registration
    /// reaches the record up to most of a message's delay bound before the record first
    /// expires. Only a record with an answer to replay (the request failed) answers the
    /// sibling, which then gives up; one that swallows the registration leaves the sibling
    /// waiting, its copies unjudged by the checker.
    pub(super) fn maybe_late_sibling(&mut self, request: usize, outcome: PrefillOutcome) {
        let replays = match outcome {
            PrefillOutcome::Sent
            | PrefillOutcome::Released(
                ReleaseCause::CancelledByPeer
                | ReleaseCause::ReleasedByPeer(_)
                | ReleaseCause::PeerDead
                | ReleaseCause::Empty,
            ) => false,
            PrefillOutcome::Released(
                ReleaseCause::LeaseExpired
                | ReleaseCause::Aborted
                | ReleaseCause::Rejected
                | ReleaseCause::WriteFailed(_),
            ) => true,
        };
        let r = &self.requests[request];
        let eligible = replays
            && self.cfg.late_siblings > 0.0
            && !self.cfg.explore
            && self.faulty()
            && self.cfg.decode_engines >= 2
            && !r.transfer.pull
            && r.multi.is_none()
            && !self.siblings.record_expiry.contains_key(&r.key)
            && self.siblings.record_expiry.len() < MAX_REMEMBERED;
        if !eligible || !self.siblings.rng.gen_bool(self.cfg.late_siblings.min(1.0)) {
            return;
        }
        let m = &self.cfg.machine;
        let (ttl, delay_bound) = (m.tombstone_ttl, m.max_message_delay);
        let expiry = self.now + ttl;
        // A late copy takes 60–100% of the bound: a registration that reaches the record less
        // than that before its expiry has copies that arrive after it.
        let before = micros(
            &mut self.siblings.rng,
            10_000,
            (delay_bound.as_micros() as u64 * 3 / 5).max(10_001),
        );
        let at = ttl.saturating_sub(before);
        let key = r.key.clone();
        self.siblings.record_expiry.insert(key, expiry);
        self.schedule(at, Ev::SecondDecode { request });
        // The copies are drawn in the faulty phase only.
        self.heal = self.heal.max(expiry + delay_bound * 2);
    }

    /// Whether `message`, leaving D `from`, is a late sibling's registration (it gets a late
    /// copy: `late_register_copy`).
    pub(crate) fn late_sibling_register(&self, from: NodeId, message: &Message) -> bool {
        let Message::Register(register) = message else {
            return false;
        };
        self.siblings.record_expiry.contains_key(&register.key)
            && self
                .keys
                .get(&register.key)
                .is_some_and(|&i| self.requests[i].d_node != from)
    }

    /// Before P handles `msg`: a late sibling's registration after its key's record, as first
    /// written, expired (where only a record written again still answers it).
    pub(crate) fn note_sibling_past_record(&mut self, msg: &NetMsg) {
        let Message::Register(register) = &msg.message else {
            return;
        };
        let past = self
            .siblings
            .record_expiry
            .get(&register.key)
            .is_some_and(|&expiry| self.now > expiry);
        if past && self.is_prefill(msg.to) && self.late_sibling_register(msg.from, &msg.message) {
            self.mark("sibling_copy_past_record");
        }
    }
}
