//! Stalls with a registration pending (swarm): D registered before P's prefill ended, and P
//! stops right after it took the registration, until D gave up on it and freed its blocks.
//!
//! P keeps a registration that came before its prefill pending for `registration_ttl` after
//! D's last renewal, and D's fence counts on that: a registration P has not matched by then is
//! answered as expired, never written. A P that was stopped meanwhile must expire it before it
//! matches anything (`PrefillTable::expire_pending_before_use`), or the prefill's end, handed
//! over on the resume ahead of the timers, matches a registration D already gave up on and the
//! write lands in blocks D freed (`match_expired_registration`, the deliberate bug that waits
//! for the timer). Its precondition — a P stopped past D's free with a registration pending,
//! its engine's finish queued and the resume handing it over first — came about in 5 seeds of
//! 1,200. Here, in one stalling seed in three that pushes and may hand messages first
//! (`WorldConfig::stall_pending_registration`), P stops right after taking such a registration
//! for longer than D takes to give up and free, at most twice per world, its resume handing
//! over first. Mark `finish_after_pending_registration_expired`: P's engine finished a prefill
//! whose registration was still pending past its expiry (the timer had not run).

use kvhandoff_protocol::PairingKey;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::world::{NodeId, World};

/// Most aimed stalls per world: each stops P for longer than D's quarantine.
const MAX_PENDING_STALLS: u32 = 2;

/// What the world remembers for the aimed stalls.
#[derive(Debug)]
pub(crate) struct PendingStalls {
    /// A stream of its own, so that the seed's other draws stay what they were.
    rng: ChaCha8Rng,
    begun: u32,
}

impl PendingStalls {
    pub(crate) fn new(seed: u64) -> PendingStalls {
        PendingStalls {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x7065_6e64_5f72_6567),
            begun: 0,
        }
    }
}

impl World {
    /// P rank `node` handled a registration of `key`: if it holds it pending (its prefill has
    /// not ended), it may stop now until D freed the blocks, its resume handing over first.
    pub(crate) fn maybe_stall_with_registration_pending(&mut self, node: NodeId, key: &PairingKey) {
        let share = self.cfg.stall_pending_registration;
        if share <= 0.0
            || !self.faulty()
            || !self.alive(node)
            || self.stalled(node)
            || self.pending_stalls.begun >= MAX_PENDING_STALLS
        {
            return;
        }
        let pending = self.nodes[node]
            .endpoint()
            .is_some_and(|e| e.pending_registration(key).is_some());
        if !pending || !self.pending_stalls.rng.gen_bool(share.min(1.0)) {
            return;
        }
        let length =
            super::lapsed_layers::past_d_free(&self.cfg.machine, &mut self.pending_stalls.rng);
        self.pending_stalls.begun += 1;
        self.stall_after_this_step(node, length, true);
    }

    /// P rank `node`'s engine is about to finish the prefill of `key`: marks a finish that
    /// meets a registration still pending past its expiry.
    pub(crate) fn note_finish_with_expired_registration(&mut self, node: NodeId, key: &PairingKey) {
        let expired = self.nodes[node]
            .endpoint()
            .and_then(|e| e.pending_registration(key))
            .is_some_and(|(_, _, until)| until <= self.now);
        if expired {
            self.mark("finish_after_pending_registration_expired");
        }
    }
}
