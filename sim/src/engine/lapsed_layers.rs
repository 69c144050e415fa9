//! Stalls in the middle of a layer-wise write (swarm): P stops right after it posted a part
//! with parts still to come, until D gave up on the request and freed the blocks the next part
//! would land in.
//!
//! A layer-wise write's parts are posted as the prefill produces them, each into the blocks
//! D's registration names; D renews the registration with its heartbeats while it waits. A P
//! stopped between two parts misses the renewals; when it runs again its registration has
//! lapsed and no part may follow (`ExtendLapsedRegistration` is the deliberate bug that posts
//! it anyway). The generic stall right after a post (`WorldConfig::stall_after_post`) hits a
//! part with parts to come and lasts long enough for D to free the blocks in about one seed of
//! 300 in some day ranges, so a day of `swarm-check.sh` could miss the bug. Here, in one
//! layer-wise stalling seed in three (`WorldConfig::stall_mid_layers`), such a part stops P for
//! longer than D takes to give up and free (its deadline or peer timeout, then its
//! quarantine), at most twice per world. Mark `layers_resumed_past_d_free`: P resumed from such
//! a stall with D's blocks of the request already freed.

use std::ops::Range;
use std::time::Duration;

use kvhandoff_protocol::machine::Config;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::ledger::BLOCK_BYTES;
use crate::world::{micros, NodeId, World};

/// Most aimed stalls per world: each stops P for longer than D's quarantine.
const MAX_MID_LAYER_STALLS: u32 = 2;

/// A part P stopped after: whose blocks on which D it would write next.
#[derive(Debug, Clone)]
struct StoppedPart {
    poster: NodeId,
    request: usize,
    decode: NodeId,
    decode_inc: u32,
    blocks: Vec<u32>,
}

/// What the world remembers for the aimed stalls.
#[derive(Debug)]
pub(crate) struct MidLayerStalls {
    /// A stream of its own, so that the seed's other draws stay what they were.
    rng: ChaCha8Rng,
    stopped: Vec<StoppedPart>,
    begun: u32,
}

impl MidLayerStalls {
    pub(crate) fn new(seed: u64) -> MidLayerStalls {
        MidLayerStalls {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6d69_645f_6c61_7972),
            stopped: Vec::new(),
            begun: 0,
        }
    }
}

/// A stall length past D's free of blocks P was to write: D gives up at its deadline (or finds
/// P dead at its peer timeout) and frees at its quarantine; a little more, so that its timers
/// have run, and up to a write's life beyond.
pub(super) fn past_d_free(m: &Config, rng: &mut ChaCha8Rng) -> Duration {
    let freed_by = m.decode_deadline.max(m.peer_timeout) + m.quarantine;
    let lo = (freed_by + Duration::from_millis(100)).as_micros() as u64;
    let hi = (freed_by + m.max_write_life).as_micros() as u64;
    micros(rng, lo, hi.max(lo))
}

impl World {
    /// `node` posted write `seq`, a part of a layer-wise write carrying `layers` of each block:
    /// if parts are still to come, it may stop now until D freed the blocks.
    pub(crate) fn maybe_stall_mid_layers(&mut self, node: NodeId, seq: u64, layers: &Range<usize>) {
        let share = self.cfg.stall_mid_layers;
        if share <= 0.0
            || layers.end >= BLOCK_BYTES
            || !self.faulty()
            || self.stalled(node)
            || self.mid_layer_stalls.begun >= MAX_MID_LAYER_STALLS
            || !self.mid_layer_stalls.rng.gen_bool(share.min(1.0))
        {
            return;
        }
        let Some(write) = self.writes.get(&seq) else {
            return;
        };
        let part = StoppedPart {
            poster: node,
            request: write.request,
            decode: write.target,
            decode_inc: write.target_inc,
            blocks: write.remote.clone(),
        };
        let length = past_d_free(&self.cfg.machine, &mut self.mid_layer_stalls.rng);
        self.mid_layer_stalls.begun += 1;
        self.mid_layer_stalls.stopped.push(part);
        self.stall_after_this_step(node, length, false);
    }

    /// `node` resumed: marks a stall of this module that outlived D's hold on the blocks.
    pub(crate) fn note_mid_layer_resume(&mut self, node: NodeId) {
        let (mine, others): (Vec<StoppedPart>, Vec<StoppedPart>) = self
            .mid_layer_stalls
            .stopped
            .drain(..)
            .partition(|s| s.poster == node);
        self.mid_layer_stalls.stopped = others;
        for part in mine {
            let d = &self.nodes[part.decode];
            let freed = d.incarnation != part.decode_inc
                || !d.pool.all_leased_to(&part.blocks, part.request);
            if freed {
                self.mark("layers_resumed_past_d_free");
            }
        }
    }
}
