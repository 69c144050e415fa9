//! Reads in the simulated NIXL (pull mode, bidirectional turns): the poster (the reader) reads
//! the target's (the holder's) registered blocks into its own. The same measured table as for
//! writes applies (`measured.rs`): nothing the holder or the reader does stops a posted read, a
//! read from a dead holder fails, a dead reader's reads vanish, and every read ends within
//! `max_write_life` of its post. No notification follows a read: the reader tells the holder
//! with a message once all its reads ended.
//!
//! Both ends are pinned until the read lands or fails: the holder's source blocks (the ledger
//! flags a holder that frees them meanwhile, S2), and the reader's destination blocks (a
//! landing after the reader freed them is S1).

use kvhandoff_protocol::machine::ReadOrder;
use kvhandoff_protocol::WriteFailure;

use super::measured::{effect, Effect, Happening};
use super::{Phase, SimWrite};
use crate::ledger::BLOCK_BYTES;
use crate::world::{micros, Ev, NodeId, World};

impl World {
    /// `node` posts `order` (the shell planned it; `pairs` are its (local, remote) blocks).
    pub(crate) fn post_read(&mut self, node: NodeId, order: ReadOrder, pairs: Vec<(u32, u32)>) {
        let inc = self.nodes[node].incarnation;
        if self.active_writes.contains_key(&(node, inc, order.read)) {
            self.violate(format!("S6: read {} reposted while active", order.read));
            return;
        }
        let Some(&target) = self.by_addr.get(&order.from) else {
            self.violate(format!("read {} from unknown {}", order.read, order.from));
            return;
        };
        let Some(&request) = self.keys.get(&order.key) else {
            self.violate(format!("read for unknown key {}", order.key));
            return;
        };
        let (local, remote): (Vec<u32>, Vec<u32>) = pairs.into_iter().unzip();
        if local.is_empty() {
            self.violate(format!("read {} covers no block", order.read));
            return;
        }
        // The reader reads into blocks its own attempt at the request holds.
        let dst_owner = self.nodes[node].pool.state(local[0]).and_then(|s| s.owner);
        let Some(dst_owner) = dst_owner.filter(|o| o.request == request) else {
            self.violate(format!(
                "S2: read {} lands in block {} leased to {dst_owner:?}, not request {request}",
                order.read, local[0]
            ));
            return;
        };
        // And the holder's blocks it reads are the request's, as long as they stay leased.
        let target_inc = self.known_incarnation(node, target);
        let target_current = self.alive(target) && self.nodes[target].incarnation == target_inc;
        if target_current {
            for &b in &remote {
                let owner = self.nodes[target].pool.state(b).and_then(|s| s.owner);
                if owner.is_none_or(|o| o.request != request) {
                    self.violate(format!(
                        "S2: read {} reads block {b} of node {target} leased to {owner:?}, not request {request}",
                        order.read
                    ));
                }
            }
            self.nodes[target].pool.pin(&remote, 1);
        }
        self.nodes[node].pool.pin(&local, 1);
        // A D rank reading from several P ranks reads each one's slice of every block (its
        // heads), and so does a P rank reading a later turn back from several D ranks: the
        // blocks are whole only when every pair's read landed.
        let slice = match self.requests[request].multi.as_ref() {
            Some(m) if !self.is_prefill(target) => m.turn_slice(target, node),
            Some(m) => m.slice(target, node),
            None => 0..BLOCK_BYTES,
        };
        let seq = self.next_seq;
        let mut read = SimWrite {
            poster: node,
            poster_inc: inc,
            id: order.read,
            target,
            target_inc,
            conn: self.view(node, target),
            request,
            epoch: order.epoch.0,
            p_owner: None,
            local,
            remote,
            slice,
            notification: kvhandoff_protocol::Message::Heartbeat(kvhandoff_protocol::Heartbeat {
                engine: self.nodes[node].addr.engine.clone(),
                leases: Vec::new(),
            }),
            posted: self.now,
            abandoned: false,
            phase: Phase::Posted,
            reported: false,
            d_pinned: target_current,
            read: Some(dst_owner),
            frozen: false,
        };
        self.active_writes.insert((node, inc, order.read), seq);
        const _: () = assert!(matches!(effect(Happening::LifeBound), Effect::HasEnded));
        let life = self.cfg.machine.max_write_life;
        let delay = if self.chance(self.rates.hang) {
            read.phase = Phase::Hung;
            life
        } else if self.chance(self.rates.slow_write) {
            micros(&mut self.rng, 200_000, 1_500_000).min(life)
        } else {
            micros(&mut self.rng, 100, 3_000)
        };
        self.record(format!(
            "post read {} of node {node} from {target}",
            order.read
        ));
        self.writes.insert(seq, read);
        let scheduled = self.schedule(delay, Ev::Land { write: seq });
        assert_eq!(scheduled, seq, "the read's id is its landing event's");
        self.maybe_stall_after_late_read(node, &order.key);
        self.maybe_stall_after_post(node);
    }

    /// The `Land` event of read `seq`: the holder's bytes into the reader's blocks, or a
    /// failure; both ends unpinned; the reader's transport reports it a little later.
    pub(super) fn land_read(&mut self, seq: u64, fail: bool) {
        let Some(r) = self.writes.get(&seq).cloned() else {
            return;
        };
        self.record(format!(
            "land read {} of node {} fail={fail}",
            r.id, r.poster
        ));
        if !r.in_flight() {
            return;
        }
        let Some(fail) = self.past_partition(seq, &r, fail) else {
            return;
        };
        const _: () = assert!(matches!(effect(Happening::TargetDies), Effect::Fails));
        let holder_gone = !self.alive(r.target) || self.nodes[r.target].incarnation != r.target_inc;
        let fail = fail || holder_gone || self.chance(self.rates.fail_later);
        if !fail
            && r.frozen
            && !self.nodes[r.target]
                .pool
                .all_leased_to(&r.remote, r.request)
        {
            // What lands is not the holder's KV: only the reader's late-read check stands
            // between it and a `Loaded` import (`engine/late_grants.rs`).
            self.mark("frozen_read_landed_after_holder_freed");
        }
        if !fail {
            self.copy_read(&r, true);
            *self
                .landed
                .entry((r.poster, r.poster_inc, r.request, r.epoch))
                .or_insert(0) += 1;
            if self.requests[r.request].multi.is_some() {
                *self
                    .landed_pairs
                    .entry((r.poster, r.poster_inc, r.request, r.epoch, r.target))
                    .or_insert(0) += 1;
            }
        } else if !holder_gone && self.chance(0.5) {
            self.mark("partial_landing");
            self.copy_read(&r, false);
        }
        let mut r = self.writes.remove(&seq).expect("present");
        self.unpin_target(&mut r);
        if self.nodes[r.poster].incarnation == r.poster_inc {
            self.nodes[r.poster].pool.pin(&r.local, -1);
        }
        r.phase = if fail { Phase::Cut } else { Phase::Landed };
        self.writes.insert(seq, r);
        let failure = fail.then_some(WriteFailure::TransferFailed);
        self.schedule_report(seq, failure, 50, 1_000);
    }

    /// Copies the read's slice of every block it covers from the holder into the reader
    /// (`whole`), or the first half of it (a partial landing).
    fn copy_read(&mut self, r: &SimWrite, whole: bool) {
        let Some(owner) = r.read else {
            return;
        };
        if self.nodes[r.poster].incarnation != r.poster_inc || !self.alive(r.poster) {
            return;
        }
        let range = if whole {
            r.slice.clone()
        } else {
            r.slice.start..r.slice.start + r.slice.len() / 2
        };
        for (&local, &remote) in r.local.iter().zip(&r.remote) {
            let Some(&data) = self.nodes[r.target].pool.bytes(remote) else {
                continue;
            };
            if let Err(e) =
                self.nodes[r.poster]
                    .pool
                    .land(local, &data, range.clone(), whole, owner)
            {
                self.stale_writes += 1;
                self.violate(format!("{e} (read {} of node {})", r.id, r.poster));
            }
        }
    }

    /// Reads in flight into `node`'s blocks for (`request`, `epoch`) of its current
    /// incarnation (a reader's hand-back must find none), and how many of them a stall froze.
    pub(crate) fn reads_into(&self, node: NodeId, request: usize, epoch: u64) -> (usize, usize) {
        let inc = self.nodes[node].incarnation;
        let reads: Vec<bool> = self
            .writes
            .values()
            .filter(|w| w.read.is_some() && w.poster == node && w.poster_inc == inc)
            .filter(|w| w.request == request && w.epoch == epoch && w.in_flight())
            .map(|w| w.frozen)
            .collect();
        (reads.len(), reads.iter().filter(|&&f| f).count())
    }
}
