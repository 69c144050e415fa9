//! Orphaned registrations with a sibling (swarm): P holds the registration of a D attempt
//! that gave up, its cancels lost, while a second D engine of the key heartbeats the key.
//!
//! A registration that came before P's prefill stays pending for `registration_ttl` after its
//! D's last renewal, and that D's quarantine counts on it: by the time D frees the blocks
//! without P's answer, P has expired the registration. Only the D that sent it may renew it
//! (`PrefillTable::on_heartbeat`): a sibling serving the same key (the router sent the decode
//! leg twice) heartbeats the same key and epoch, and if P took that for a renewal, the
//! registration would outlive the first D's quarantine and P's prefill would be written into
//! blocks D gave back (`ignore_heartbeat_sender`, the deliberate bug that renews whatever the
//! sender). Seeded worlds never reached it: their second decodes start within the world's
//! span, and the sibling's heartbeats end at its own deadline, before the first D's quarantine
//! ends. Here, in one chaos pushing seed in two (`WorldConfig::orphaned_registrations`), half
//! the single-source push requests that are not layer-wise are set up so: D's engine aborts soon after D
//! registers, every cancel D sends for the key is lost, a sibling starts late enough that its
//! heartbeats outlast the first D's quarantine (less the registration's TTL) yet early enough
//! that P still holds the first registration (the sibling's is a duplicate), and the router
//! hands P its leg only after the first D's quarantine. Mark
//! `heartbeat_for_anothers_registration`: P handled a heartbeat naming a key whose pending
//! registration another D sent.

use std::time::Duration;

use kvhandoff_protocol::machine::Time;
use kvhandoff_protocol::{Message, PairingKey};
use rand_chacha::ChaCha8Rng;

use crate::world::{micros, Ev, NetMsg, NodeId, World};

impl World {
    /// Sets request `i`, whose D starts at `d_at`, up as an orphan with a sibling; returns
    /// when P's leg starts, or `None` if this world's timings leave no room for the sibling.
    pub(crate) fn draw_orphan(
        &mut self,
        rng: &mut ChaCha8Rng,
        i: usize,
        d_at: Duration,
    ) -> Option<Duration> {
        let m = &self.cfg.machine;
        let ms = Duration::from_millis;
        let abort_at = d_at + micros(rng, 20_000, 60_000);
        // D frees at its quarantine, counted from the abort (its unanswered cancels do not
        // move it); their resend period is kept as a margin, so `freed` is an upper bound.
        let resends = m.cancel_retry_interval * (m.max_cancel_retries + 1);
        let freed = abort_at + resends + m.quarantine;
        // The sibling's heartbeats run to its deadline; under the bug each renews the first
        // registration for a TTL, past the first D's free.
        let earliest = (freed + ms(500))
            .saturating_sub(m.decode_deadline + m.registration_ttl)
            .max(abort_at + ms(100));
        // Its registration must find the first one still held, to be a duplicate.
        let latest = (abort_at + m.registration_ttl).saturating_sub(ms(500));
        if earliest >= latest {
            return None;
        }
        let spread = (latest - earliest).as_micros() as u64;
        let sibling_at = earliest + micros(rng, 0, spread);
        self.schedule(
            abort_at,
            Ev::Abort {
                request: i,
                decode: true,
            },
        );
        self.schedule(sibling_at, Ev::SecondDecode { request: i });
        let r = &self.requests[i];
        self.lost_cancels.insert((r.d_node, r.key.clone()));
        let p_at = freed + ms(1_000);
        self.heal = self.heal.max(Time::ZERO + p_at + ms(500));
        Some(p_at)
    }

    /// Whether `message` from `from` is a cancel the network loses (an orphan's).
    pub(crate) fn cancel_lost(&self, from: NodeId, message: &Message) -> bool {
        match message {
            Message::Cancel(cancel) => {
                !self.lost_cancels.is_empty()
                    && self.lost_cancels.contains(&(from, cancel.key.clone()))
            }
            _ => false,
        }
    }

    /// Before P handles `msg`: marks a heartbeat that names a key whose pending registration
    /// another D sent (P must not renew it).
    pub(crate) fn note_heartbeat_for_others(&mut self, msg: &NetMsg) {
        let Message::Heartbeat(heartbeat) = &msg.message else {
            return;
        };
        if !self.is_prefill(msg.to) {
            return;
        }
        let sender = &self.nodes[msg.from].addr;
        let Some(p) = self.nodes[msg.to].endpoint() else {
            return;
        };
        let others = heartbeat.leases.iter().any(|lease| {
            p.pending_registration(&lease.key)
                .is_some_and(|(from, _, _)| from != sender)
        });
        if others {
            self.mark("heartbeat_for_anothers_registration");
        }
    }
}

/// The keys whose cancels from a D node the network loses.
pub(crate) type LostCancels = std::collections::BTreeSet<(NodeId, PairingKey)>;
