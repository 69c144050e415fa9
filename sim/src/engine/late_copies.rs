//! Late registration copies (swarm): a copy of D's `Register` that reaches P after its key's
//! request ended, and the checker's view of what P does with it.
//!
//! P refuses such a copy by its record of the key (the epoch floor), which admission control
//! keeps alive for `tombstone_min_life` however full the table. Without that control
//! (`evict_young_tombstones`) a burst of ends in a small table evicts a young record, and the
//! copy becomes a pending registration that the key's next prefill would write into blocks D
//! gave back. In every chaos seed that pushes with a small table, the swarm shrinks the table
//! to 6–12 records and gives registrations late copies
//! (`WorldConfig::late_register_copies`); the checker asks P after every registration whose D
//! attempt has ended whether it now holds it. Mark `register_after_decode_ended`.

use kvhandoff_protocol::{Message, PairingKey};

use super::Status;
use crate::world::{micros, NetMsg, NodeId, World};

impl World {
    /// When a late copy of `message` (sent now, delivered after `delay`) arrives, if it is a
    /// registration drawn for one (`WorldConfig::late_register_copies`; always for a late
    /// sibling's, `aimed`): as late as a message may be, past the end of most requests it
    /// registers for.
    pub(crate) fn late_register_copy(
        &mut self,
        message: &Message,
        delay: std::time::Duration,
        aimed: bool,
    ) -> Option<std::time::Duration> {
        // `chance` draws nothing outside the faulty phase or at a rate of 0.
        let rate = if aimed {
            1.0
        } else {
            self.cfg.late_register_copies
        };
        if !matches!(message, Message::Register(_)) || !self.chance(rate) {
            return None;
        }
        let bound = self.cfg.machine.max_message_delay.as_micros() as u64;
        let earliest = (bound * 3 / 5).max(delay.as_micros() as u64);
        Some(micros(&mut self.rng, earliest, bound.max(earliest)))
    }

    /// Before P handles `msg`: if it is a registration from D's current incarnation (a
    /// restarted D starts over at its epochs) whose attempt has ended, the attempt's request.
    pub(crate) fn ended_attempt_registered(&self, msg: &NetMsg) -> Option<usize> {
        let Message::Register(register) = &msg.message else {
            return None;
        };
        let current = self.alive(msg.from) && self.nodes[msg.from].incarnation == msg.from_inc;
        if !self.is_prefill(msg.to) || !current {
            return None;
        }
        self.decode_attempt_ended(msg.from, &register.key, register.epoch.0)
    }

    /// The request of D `node`'s attempt at `key` for `epoch`, if that attempt has ended and
    /// none of the key's attempts on that node runs at that epoch now.
    fn decode_attempt_ended(&self, node: NodeId, key: &PairingKey, epoch: u64) -> Option<usize> {
        let i = *self.keys.get(key)?;
        let attempts = || {
            self.requests[i].d.iter().filter(|a| {
                a.node == node && a.epoch == epoch && a.sub.as_ref().is_none_or(|s| &s.key == key)
            })
        };
        let ended = attempts().any(|a| a.status == Status::Done)
            && !attempts().any(|a| matches!(a.status, Status::Live { .. } | Status::Pending));
        ended.then_some(i)
    }

    /// After P `msg.to` handled a registration: one whose D attempt had ended (a late copy)
    /// must leave P holding nothing of it — P's record of the key, its epoch floor, refuses
    /// it. Held, it would match the key's next prefill on P and write into blocks D handed
    /// back (the hand-back's own check sees only registrations P took before it).
    pub(crate) fn check_register_after_end(&mut self, msg: &NetMsg, ended: Option<usize>) {
        let (Message::Register(register), Some(request)) = (&msg.message, ended) else {
            return;
        };
        self.mark("register_after_decode_ended");
        let d_addr = &self.nodes[msg.from].addr;
        let now = self.now;
        let held = self.nodes[msg.to]
            .endpoint()
            .and_then(|p| p.pending_registration(&register.key))
            .is_some_and(|(from, e, expires)| {
                from == d_addr && e == register.epoch && expires > now
            });
        if held {
            self.violate(format!(
                "proof: P took request {request} e{}'s registration after D ended the attempt",
                register.epoch.0
            ));
        }
    }
}
