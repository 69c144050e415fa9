//! The simulated NIXL: writes from P's registered blocks into D's, with real bytes, landing at
//! a chosen later time (posts reach it through the shell's driver and the simulated transport
//! of `transport.rs`, which also refuses posts, as NIXL's `post_xfer_req` may); transfers that
//! fail later (possibly after part of the
//! data landed — NIXL does not roll back), or hang until the fabric's bound. NIXL's rules are
//! assertions here: no repost of an active write, no release of a block while a transfer reads
//! or writes it (checked by the ledger's pins), and the notification leaves only after the data
//! landed.
//!
//! As hostile as the NIXL we measured (`actors/tests/nixl_transport.rs`, NIXL 1.5.1, UCX,
//! `tcp_in_progress_semantics` with its child `child_tcp_in_progress`):
//! - abandoning a transfer in progress is refused, and it completes in its own time: here an
//!   abandon changes nothing, and the write lands or fails on its own;
//! - invalidating the peer does not stop it either: bytes still landed after an invalidation
//!   (up to the whole 64 MiB within 1.5 s, step 2 of the child), and the target invalidating
//!   the poster (what D does when it declares P dead, step 3) did not stop it either — all
//!   64 MiB landed and the target still took the notification: here neither side's
//!   invalidation touches a posted write, and a write posted on a connection the target has
//!   torn down still reaches the target's registered memory;
//! - a write to an agent that was dropped fails (`write_to_dropped_peer_fails_typed`, and step 4
//!   of the child above): a write aimed at an incarnation that died fails;
//! - assumed, not measured: every write ends (lands or fails) within `max_write_life` of its
//!   post; a hung write ends at that bound, and a write held up by a partition lands after it
//!   heals if the bound allows, else fails.

pub(crate) mod measured;
mod sim_reads;

use kvhandoff_protocol::machine::WriteOrder;
use kvhandoff_protocol::WriteId;
use kvhandoff_protocol::{Message, WriteFailure};
use rand::Rng;

use crate::ledger::{Owner, BLOCK_BYTES};
use crate::world::{micros, Ev, NodeId, World};
use measured::{effect, Effect, Happening};

/// Where a simulated transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    /// Posted; lands at its `Land` event.
    Posted,
    /// Posted; never lands or completes on its own.
    Hung,
    /// The data landed; the completion is on its way to the poster.
    Landed,
    /// Will never land (failed, abandoned, invalidated, or its poster died).
    Cut,
}

/// One transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SimWrite {
    pub poster: NodeId,
    pub poster_inc: u32,
    pub id: WriteId,
    pub target: NodeId,
    pub target_inc: u32,
    /// The connection generation it was posted on.
    pub conn: u64,
    pub request: usize,
    pub epoch: u64,
    pub p_owner: Option<Owner>,
    pub local: Vec<u32>,
    pub remote: Vec<u32>,
    /// The bytes of each block it carries: all of them, or the poster's slice of a D rank fed
    /// by several P ranks.
    pub slice: std::ops::Range<usize>,
    pub notification: Message,
    /// When it was posted (it ends by `posted + max_write_life`).
    pub posted: kvhandoff_protocol::machine::Time,
    /// The poster asked to abandon it (NIXL went on with it).
    pub abandoned: bool,
    pub phase: Phase,
    pub reported: bool,
    /// D's target blocks are pinned (until the write lands or fails). P's source blocks are
    /// pinned until the report, whatever happens to the connection. For a read: the holder's
    /// (the NIXL target's) source blocks, until the read lands or fails.
    pub d_pinned: bool,
    /// A read (pull, bidirectional): the data flows from the target (the holder) into the
    /// poster's (the reader's) `local` blocks, owned by this owner.
    pub read: Option<Owner>,
    /// A stall of its poster froze it (its life clock suspended): it may land later than
    /// `max_write_life` after its post.
    pub frozen: bool,
}

impl SimWrite {
    pub(crate) fn in_flight(&self) -> bool {
        matches!(self.phase, Phase::Posted | Phase::Hung)
    }
}

impl World {
    /// Carries out a write `node`'s shell posted; `layers` is the slice of each block a
    /// layer-wise part carries (`None`: the whole write).
    pub(crate) fn post_write(
        &mut self,
        node: NodeId,
        order: WriteOrder,
        layers: Option<std::ops::Range<usize>>,
    ) {
        let inc = self.nodes[node].incarnation;
        if self.active_writes.contains_key(&(node, inc, order.write)) {
            self.violate(format!("S6: write {} reposted while active", order.write));
            return;
        }
        let Some(&target) = self.by_addr.get(&order.to) else {
            self.violate(format!("write {} to unknown {}", order.write, order.to));
            return;
        };
        let shapes_match = order.local.groups.len() == order.remote.groups.len()
            && order
                .local
                .groups
                .iter()
                .zip(&order.remote.groups)
                .all(|(l, r)| l.len() == r.len());
        if !shapes_match {
            self.violate(format!(
                "write {}: local and remote lists differ",
                order.write
            ));
            return;
        }
        let local: Vec<u32> = order.local.groups.concat();
        let remote: Vec<u32> = order.remote.groups.concat();
        let Some(&request) = self.keys.get(&order.key) else {
            self.violate(format!("write for unknown key {}", order.key));
            return;
        };
        let p_owner = self.nodes[node].pool.state(local[0]).and_then(|s| s.owner);
        for &b in &local {
            let owner = self.nodes[node].pool.state(b).and_then(|s| s.owner);
            if owner.is_none_or(|o| o.request != request) {
                self.violate(format!(
                    "S2: write {} reads P block {b} leased to {owner:?}, not request {request}",
                    order.write
                ));
            }
        }
        self.nodes[node].pool.pin(&local, 1);
        // Aimed at the memory of the incarnation P shook hands with: if that one died, the
        // write fails, even if a new incarnation is up by the time it would land.
        let target_inc = self.known_incarnation(node, target);
        let conn = self.view(node, target);
        // A connection the target tore down (invalidated) still reaches its registered memory:
        // only the target's death stops a write.
        let d_pinned = self.alive(target) && self.nodes[target].incarnation == target_inc;
        if d_pinned {
            self.nodes[target].pool.pin(&remote, 1);
        }
        let slice = self.requests[request]
            .multi
            .as_ref()
            .map_or(0..BLOCK_BYTES, |m| m.slice(node, target));
        // Layer-wise requests are single-source: a part's layers are its slice of the block.
        let part = layers.clone();
        let slice = layers.unwrap_or(slice);
        let seq = self.next_seq;
        let mut write = SimWrite {
            poster: node,
            poster_inc: inc,
            id: order.write,
            target,
            target_inc,
            conn,
            request,
            epoch: order.epoch.0,
            p_owner,
            local,
            remote,
            slice,
            notification: order.notification,
            posted: self.now,
            abandoned: false,
            phase: Phase::Posted,
            reported: false,
            d_pinned,
            read: None,
            frozen: false,
        };
        self.active_writes.insert((node, inc, order.write), seq);
        const _: () = assert!(matches!(effect(Happening::LifeBound), Effect::HasEnded));
        let life = self.cfg.machine.max_write_life;
        let delay = if self.chance(self.rates.hang) {
            // Hangs until the fabric's bound, then lands or fails.
            write.phase = Phase::Hung;
            life
        } else if self.chance(self.rates.slow_write) {
            micros(&mut self.rng, 200_000, 1_500_000).min(life)
        } else {
            micros(&mut self.rng, 100, 3_000)
        };
        self.writes.insert(seq, write);
        let scheduled = self.schedule(delay, Ev::Land { write: seq });
        assert_eq!(scheduled, seq, "the write's id is its landing event's");
        if let Some(layers) = part {
            self.maybe_stall_mid_layers(node, seq, &layers);
        }
        self.maybe_stall_after_post(node);
    }

    fn schedule_report(&mut self, seq: u64, failure: Option<WriteFailure>, lo: u64, hi: u64) {
        let delay = micros(&mut self.rng, lo, hi);
        self.schedule(
            delay,
            Ev::Report {
                write: seq,
                failure,
            },
        );
    }

    pub(crate) fn unpin_target(&mut self, write: &mut SimWrite) {
        if write.d_pinned {
            write.d_pinned = false;
            if self.nodes[write.target].incarnation == write.target_inc {
                self.nodes[write.target].pool.pin(&write.remote, -1);
            }
        }
    }

    /// Lands the write's slice of every block of `seq` (`whole`), or the first half of it (a
    /// partial landing).
    fn copy_data(&mut self, seq: u64, whole: bool) {
        let w = self.writes[&seq].clone();
        if self.nodes[w.target].incarnation != w.target_inc || !self.alive(w.target) {
            return;
        }
        let owner = Owner {
            request: w.request,
            epoch: w.epoch,
        };
        let range = if whole {
            w.slice.clone()
        } else {
            w.slice.start..w.slice.start + w.slice.len() / 2
        };
        for (&l, &r) in w.local.iter().zip(&w.remote) {
            let data = *self.nodes[w.poster]
                .pool
                .bytes(l)
                .expect("P blocks exist while the write is in flight");
            let landed = self.nodes[w.target]
                .pool
                .land(r, &data, range.clone(), whole, owner);
            if let Err(e) = landed {
                self.stale_writes += 1;
                self.violate(format!("{e} (write {} of node {})", w.id, w.poster));
            }
        }
    }

    /// The `Land` event of write `seq`; `fail` forces a failure (explore mode).
    pub(crate) fn land(&mut self, seq: u64, fail: bool) {
        let Some(w) = self.writes.get(&seq).cloned() else {
            return;
        };
        if w.read.is_some() {
            self.land_read(seq, fail);
            return;
        }
        self.record(format!("land {} of node {} fail={fail}", w.id, w.poster));
        if !w.in_flight() {
            return;
        }
        let Some(fail) = self.past_partition(seq, &w, fail) else {
            return;
        };
        const _: () = assert!(matches!(effect(Happening::TargetDies), Effect::Fails));
        let target_gone = !self.alive(w.target) || self.nodes[w.target].incarnation != w.target_inc;
        let fail = fail || target_gone || self.chance(self.rates.fail_later);
        if !fail {
            if w.conn != self.conn(w.poster, w.target) {
                self.mark("write_landed_after_invalidate");
            }
            if w.abandoned {
                self.mark("write_landed_after_abandon");
            }
        }
        if fail {
            if !target_gone && self.chance(0.5) {
                self.mark("partial_landing");
                self.copy_data(seq, false);
            }
            let mut w = self.writes.remove(&seq).expect("present");
            self.unpin_target(&mut w);
            w.phase = Phase::Cut;
            self.writes.insert(seq, w);
            self.schedule_report(seq, Some(WriteFailure::TransferFailed), 50, 1_000);
            return;
        }
        self.copy_data(seq, true);
        let mut w = self.writes.remove(&seq).expect("present");
        self.unpin_target(&mut w);
        w.phase = Phase::Landed;
        let notification = w.notification.clone();
        let (poster, target, key) = (
            w.poster,
            w.target,
            (w.target, w.target_inc, w.request, w.epoch),
        );
        self.writes.insert(seq, w);
        *self.landed.entry(key).or_insert(0) += 1;
        if let Message::WritePartDone(part) = &notification {
            *self.parts_landed.entry((key.2, key.3)).or_insert(0) += part.count;
        }
        let (node, inc, request, epoch) = key;
        *self
            .landed_pairs
            .entry((node, inc, request, epoch, poster))
            .or_insert(0) += 1;
        // NIXL sends the notification once the data is in place: never before.
        let to = self.nodes[target].addr.clone();
        self.send(poster, &to, notification);
        self.schedule_report(seq, None, 50, 1_000);
    }

    /// A transfer `w` (write or read) whose landing time came while its pair is partitioned:
    /// its landing moves past the partition if the fabric's bound allows (`None`: re-armed), or
    /// it fails at the bound (`Some(true)`). Unpartitioned, `Some(fail)` as asked.
    fn past_partition(&mut self, seq: u64, w: &SimWrite, fail: bool) -> Option<bool> {
        let Some(until) = self.partitioned(w.poster, w.target, self.now) else {
            return Some(fail);
        };
        let end_by = w.posted + self.cfg.machine.max_write_life;
        if until < end_by {
            let delay = until.saturating_since(self.now) + micros(&mut self.rng, 0, 500);
            let delay = delay.min(end_by.saturating_since(self.now));
            self.schedule_at_seq(seq, delay);
            return None;
        }
        // The partition outlasts the transfer's life: it fails (the bound holds).
        Some(true)
    }

    /// Re-arms the landing of `seq` (kept under the same sequence number).
    pub(crate) fn schedule_at_seq(&mut self, seq: u64, after: std::time::Duration) {
        let at = self.now + after;
        self.queue.insert(seq, (at, Ev::Land { write: seq }));
        self.due.insert((at, seq));
    }

    /// Tells the poster how its write ended.
    pub(crate) fn report(&mut self, seq: u64, failure: Option<WriteFailure>) {
        let Some(mut w) = self.writes.remove(&seq) else {
            return;
        };
        self.record(format!("report {} of node {}: {failure:?}", w.id, w.poster));
        if w.reported {
            self.violate(format!("S6: write {} reported twice", w.id));
            return;
        }
        w.reported = true;
        self.unpin_target(&mut w);
        self.active_writes.remove(&(w.poster, w.poster_inc, w.id));
        let poster_current = self.nodes[w.poster].incarnation == w.poster_inc;
        if poster_current && w.read.is_none() {
            // A read's local blocks were unpinned when it landed or failed.
            self.nodes[w.poster].pool.pin(&w.local, -1);
        }
        let (poster, id, owner) = (w.poster, w.id, w.p_owner);
        // Keep nothing of a finished write.
        drop(w);
        if !poster_current || !self.alive(poster) {
            return;
        }
        if owner.is_some_and(|o| !self.p_attempt_live(o)) {
            self.mark("completion_after_lease");
        }
        // The poster's transport reports the end; its shell makes the input of it.
        self.shell_completion(poster, id, failure.is_some());
    }

    /// P's endpoint abandons a write. Real NIXL refuses to stop a transfer in progress
    /// (releasing it leaves its bytes landing), so nothing changes: the write lands or fails on
    /// its own, within `max_write_life`, and is reported then.
    pub(crate) fn abandon_write(&mut self, node: NodeId, id: WriteId) {
        let inc = self.nodes[node].incarnation;
        let Some(&seq) = self.active_writes.get(&(node, inc, id)) else {
            // Nothing pending under the id (reported already, or never posted): the transport
            // answers `UnknownWrite`, which the shell's driver reports as a failed transfer.
            self.record(format!("abandon {id} of node {node}: not active"));
            self.shell_completion(node, id, true);
            return;
        };
        let phase = self.writes.get(&seq).map(|w| w.phase);
        self.record(format!("abandon {id} of node {node}: {phase:?}"));
        let Some(w) = self.writes.get_mut(&seq) else {
            return;
        };
        if !w.in_flight() {
            return; // landed or cut: its report is on the way
        }
        const _: () = assert!(matches!(effect(Happening::PosterAbandons), Effect::GoesOn));
        w.abandoned = true;
        self.mark("abandon_unconfirmed");
    }

    /// `node` invalidated its connection to `peer`: control messages on the old connection are
    /// lost, but writes in flight go on (measured: invalidation does not fence them).
    pub(crate) fn invalidate(&mut self, node: NodeId, peer: NodeId) {
        const _: () = assert!(matches!(effect(Happening::Invalidation), Effect::GoesOn));
        self.bump_conn(node, peer);
        self.record(format!("invalidate {node}->{peer}"));
        let outstanding = self.writes.values().any(|w| {
            !w.reported
                && ((w.poster == node && w.target == peer)
                    || (w.poster == peer && w.target == node))
        });
        if outstanding {
            self.mark("peer_died_with_write_outstanding");
        }
    }

    /// The poster of these writes died: each may land partly (NIXL does not roll back) and
    /// then never again; nobody is told.
    pub(crate) fn writes_of_crashed(&mut self, node: NodeId) {
        const _: () = assert!(matches!(effect(Happening::PosterDies), Effect::Vanishes));
        let seqs: Vec<u64> = self
            .writes
            .iter()
            .filter(|(_, w)| w.poster == node)
            .map(|(s, _)| *s)
            .collect();
        for seq in seqs {
            if self.writes[&seq].in_flight() && self.writes[&seq].read.is_none() {
                self.mark("poster_crashed_mid_write");
                let partial = if self.cfg.explore {
                    false
                } else {
                    self.rng.gen_bool(0.5)
                };
                if partial {
                    self.mark("partial_landing");
                    self.copy_data(seq, false);
                }
            }
            self.unschedule(seq);
            let mut w = self.writes.remove(&seq).expect("present");
            self.unpin_target(&mut w);
            self.active_writes.remove(&(w.poster, w.poster_inc, w.id));
        }
    }
}
