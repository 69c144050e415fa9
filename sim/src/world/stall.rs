//! Process stalls (chaos): a process stopped for a while — SIGSTOP, a paused VM or container, a
//! long GC pause, a debugger — and then resumed, possibly long past every fence of its peers.
//!
//! While a node is stalled nothing of its process runs: its endpoint gets no `handle_timeout`,
//! no `handle_event` and no engine call, and its shell polls nothing. What reaches it meanwhile
//! (messages that arrived at its transport, the ends of its transfers, its engine's own calls,
//! handshakes it dialled) is held, in arrival order. A message is judged by the network when it
//! arrives (a torn-down connection or a dead incarnation loses it then), not when the resumed
//! shell handles it: bytes already in the process's receive queue are handed over even if the
//! peer invalidated the connection in between.
//!
//! The transfers the node had posted either keep moving (RDMA needs no help from the poster's
//! CPU) or freeze until the resume (over UCX/TCP bytes move only while the poster's process
//! makes progress): chosen per stall. A frozen transfer's life clock is suspended with it, so it
//! may land after the stall, even later than `max_write_life` after its post — what reality
//! allows, and what the protocol's time fences assume cannot happen (`nixl/measured.rs`,
//! `LifeBound`).
//!
//! On resume the world does what the production shell does (issue 19): it runs the endpoint's
//! due timers first, then hands it what was held, in order.

use std::collections::VecDeque;
use std::time::Duration;

use kvhandoff_protocol::machine::{read_span, Time};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{micros, Ev, NodeId, World};

/// Most events one stall holds: far above what a stall of seconds gathers (heartbeats of a few
/// peers and the traffic of tens of requests), so reaching it means a model error.
const MAX_HELD: usize = 1 << 16;

/// Most rounds of due timers a resumed endpoint runs before it is handed what was held: each
/// round runs every timer due by then, so more than a few means a timer that re-arms in the
/// past.
const MAX_TIMER_ROUNDS: usize = 16;

/// A stall in progress.
#[derive(Debug)]
pub(crate) struct Stall {
    /// When it began (also its identity: its `Resume` event names it).
    pub since: Time,
    /// The node's transfers are frozen until the resume (else they keep moving).
    pub freeze: bool,
    /// The node's endpoint was connected to a peer when it stopped.
    pub connected: bool,
    /// What reached the stopped process, in arrival order.
    pub held: VecDeque<Ev>,
    /// Transfers whose bytes stopped with the process: their sequence number and how long
    /// their landing still had to go.
    pub frozen: Vec<(u64, Duration)>,
    /// The resume hands over what was held before the due timers run, whatever the world's
    /// share of such resumes draws (an aimed stall, `engine/leases.rs`).
    pub messages_first: bool,
}

impl World {
    /// Whether `node`'s process is stopped.
    pub(crate) fn stalled(&self, node: NodeId) -> bool {
        self.nodes[node].stall.is_some()
    }

    /// Draws this world's stalls (chaos, seeded mode) from a stream of their own, so a seed's
    /// other faults and timings are drawn as without them: 0 to twice `WorldConfig::stalls`
    /// stalls, each of a random node at a random time of the faulty phase.
    pub(crate) fn draw_stalls(&mut self) {
        if self.cfg.stalls <= 0.0 {
            return;
        }
        let mut rng: ChaCha8Rng =
            rand::SeedableRng::seed_from_u64(self.seed ^ 0x7374_616c_6c73_2121);
        // Bounded by the command line's own bound on the rate.
        let most = (2.0 * self.cfg.stalls.min(1_000.0)).round() as u32;
        let span = self.cfg.span.as_micros() as u64;
        for _ in 0..rng.gen_range(0..=most) {
            let node = if self.cfg.stall_prefill && rng.gen_bool(0.5) {
                0
            } else {
                rng.gen_range(0..self.nodes.len())
            };
            let at = micros(&mut rng, 0, span.max(1));
            let length = self.stall_length(&mut rng);
            let freeze = rng.gen_bool(self.cfg.stall_freeze.clamp(0.0, 1.0));
            self.schedule(
                at,
                Ev::Stall {
                    node,
                    length,
                    freeze,
                    messages_first: false,
                },
            );
            // Faults go on until the last process is running again.
            self.heal = self
                .heal
                .max(Time::ZERO + at + length + Duration::from_millis(200));
        }
    }

    /// A stall's length: a quarter each shorter than the peer timeout (nobody notices), past it
    /// but within the grant fence (a false death), past the grant fence (a reader's grant goes
    /// stale) and past the quarantine (a dead peer's fence frees what the stalled writer still
    /// holds a registration for).
    fn stall_length(&self, rng: &mut ChaCha8Rng) -> Duration {
        if self.cfg.swarm {
            return self.swarm_stall_length(rng);
        }
        let m = &self.cfg.machine;
        let micros_of = |d: Duration| d.as_micros() as u64;
        let timeout = micros_of(m.peer_timeout);
        let fence = micros_of(read_span(m)).max(timeout + 1);
        let quarantine = micros_of(m.quarantine).max(fence + 1);
        let far = micros_of(m.quarantine + m.max_write_life + Duration::from_secs(1));
        let (lo, hi) = match rng.gen_range(0..4) {
            0 => (10_000.min(timeout), timeout),
            1 => (timeout, fence),
            2 => (fence, quarantine),
            _ => (quarantine, far.max(quarantine + 1)),
        };
        micros(rng, lo, hi)
    }

    /// A stall's length in a swarm world, whose thresholds may come in any order: between two
    /// neighbouring thresholds of its configuration, each band as likely (the peer timeout, a
    /// lease's extension, a read's span, the quarantine, D's deadline plus its quarantine, and
    /// the quarantine past the peer timeout), or shorter than all of them, or past the last.
    fn swarm_stall_length(&self, rng: &mut ChaCha8Rng) -> Duration {
        let m = &self.cfg.machine;
        let micros_of = |d: Duration| d.as_micros() as u64;
        let mut cuts: Vec<u64> = [
            m.peer_timeout,
            m.lease_extension,
            read_span(m),
            m.quarantine,
            m.decode_deadline + m.quarantine,
            m.peer_timeout + m.quarantine,
        ]
        .iter()
        .map(|&d| micros_of(d))
        .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let last = cuts.last().copied().unwrap_or(1);
        cuts.insert(0, 10_000.min(cuts.first().copied().unwrap_or(1)));
        cuts.push(last + micros_of(m.max_write_life + Duration::from_secs(1)));
        // One stall in three falls between the read span and the peer timeout where that band
        // exists: long enough to outlive a holder's grant fence and a lease, too short for the
        // stopped process to find its peers overdue, so only the deeper guards (the stale
        // grant, the late read) stand between a queued message and the blocks.
        let span = micros_of(read_span(m));
        let timeout = micros_of(m.peer_timeout);
        if timeout > span + 1 && rng.gen_ratio(1, 3) {
            return micros(rng, span, timeout);
        }
        let band = rng.gen_range(0..cuts.len() - 1);
        micros(rng, cuts[band], cuts[band + 1].max(cuts[band] + 1))
    }

    /// Swarm: `node` may stop right after it posted a transfer, its transfers frozen, so that a
    /// transfer in flight meets a stall and its report comes after the resume.
    pub(crate) fn maybe_stall_after_post(&mut self, node: NodeId) {
        let share = self.cfg.stall_after_post;
        if share <= 0.0
            || self.post_stalls >= super::config::MAX_POST_STALLS
            || !self.faulty()
            || self.stalled(node)
            || !self.rng.gen_bool(share.min(1.0))
        {
            return;
        }
        self.post_stalls += 1;
        let mut rng = self.rng.clone();
        let length = self.stall_length(&mut rng);
        self.rng = rng;
        self.stall_after_this_step(node, length, false);
    }

    /// `node` stops for `length` once the step in progress is over (a post's handler ends
    /// first), its transfers frozen; its resume hands over first if `messages_first`. Faults
    /// go on until it runs again.
    pub(crate) fn stall_after_this_step(
        &mut self,
        node: NodeId,
        length: Duration,
        messages_first: bool,
    ) {
        self.schedule(
            Duration::ZERO,
            Ev::Stall {
                node,
                length,
                freeze: true,
                messages_first,
            },
        );
        self.heal = self
            .heal
            .max(self.now + length + Duration::from_millis(200));
    }

    /// `node`'s process stops for `length`; its resume hands over what queued before the due
    /// timers if `messages_first` (an aimed stall), else as the world's share draws.
    pub(crate) fn stall(
        &mut self,
        node: NodeId,
        length: Duration,
        freeze: bool,
        messages_first: bool,
    ) {
        let line = format!(
            "stall {} for {length:?} (transfers {})",
            self.nodes[node].addr,
            if freeze { "frozen" } else { "moving" }
        );
        self.record(line);
        if !self.alive(node) || self.stalled(node) {
            return;
        }
        let connected = (0..self.nodes.len())
            .any(|peer| peer != node && self.connected_incarnation(node, peer).is_some());
        let mut frozen = Vec::new();
        if freeze {
            let inc = self.nodes[node].incarnation;
            // A write frozen longer than the stall allowance (quarantine − fence floor) may land
            // after D's time-based frees: measured, and nothing the protocol can do stops it
            // (`actors/tests/nixl_stall.rs`), so the allowance is a deployment requirement. The
            // world keeps to it unless told to break it (`stall_past_allowance`), where the
            // checker must find the blocks handed out. Reads freeze for any stall: the reader's
            // own defences (it distrusts a read reported past its bound, and keeps its blocks
            // until the transport reports the read) cover them.
            let writes_freeze =
                self.cfg.stall_past_allowance || length <= self.cfg.machine.stall_allowance();
            let mine: Vec<u64> = self
                .writes
                .iter()
                .filter(|(_, w)| w.poster == node && w.poster_inc == inc && w.in_flight())
                .filter(|(_, w)| w.read.is_some() || writes_freeze)
                .map(|(&seq, _)| seq)
                .collect();
            use crate::nixl::measured::{effect, Effect, Happening};
            const _: () = assert!(matches!(effect(Happening::PosterStalls), Effect::GoesOn));
            for seq in mine {
                // A transfer's landing is its own sequence number's event.
                if let Some((at, _)) = self.unschedule(seq) {
                    frozen.push((seq, at.saturating_since(self.now)));
                    let Some(mut w) = self.writes.remove(&seq) else {
                        continue;
                    };
                    w.frozen = true;
                    if w.read.is_some() {
                        // The holder's grant fence may free its source blocks before the read
                        // moves again: what the read then copies is not the holder's KV, and
                        // the reader must not trust it (the byte check of a `Loaded` import
                        // judges that), so the sources are no longer pinned.
                        self.unpin_target(&mut w);
                    }
                    self.writes.insert(seq, w);
                }
            }
            self.stall_frozen += frozen.len() as u64;
        }
        self.stalls_run += 1;
        let since = self.now;
        self.nodes[node].stall = Some(Stall {
            since,
            freeze,
            connected,
            held: VecDeque::new(),
            frozen,
            messages_first,
        });
        self.schedule(length, Ev::Resume { node, since });
    }

    /// Holds `ev` for stalled `node` until it resumes.
    pub(crate) fn hold(&mut self, node: NodeId, ev: Ev) {
        let line = format!("held by stalled node {node}: {}", ev_name(&ev));
        self.record(line);
        let Some(stall) = self.nodes[node].stall.as_mut() else {
            return;
        };
        if stall.held.len() >= MAX_HELD {
            self.violate(format!(
                "model: stalled node {node} holds {MAX_HELD} events"
            ));
            return;
        }
        stall.held.push_back(ev);
    }

    /// The stalled node that `ev` must wait for, if any: the process whose endpoint, shell or
    /// engine the event runs. A message's arrival is not held (its handling is, see
    /// `deliver`); nor are landings (a frozen transfer's landing was taken out of the queue when
    /// the stall began), crashes (a stopped process can be killed) and restarts.
    pub(crate) fn held_by_stall(&self, ev: &Ev) -> Option<NodeId> {
        let r = |request: usize| &self.requests[request];
        let owners: Vec<NodeId> = match ev {
            Ev::Deliver(_)
            | Ev::Handle(_)
            | Ev::Land { .. }
            | Ev::Crash { .. }
            | Ev::Restart { .. }
            | Ev::Stall { .. }
            | Ev::Resume { .. } => Vec::new(),
            // The poster's shell polls its transfers' ends.
            Ev::Report { write, .. } => self
                .writes
                .get(write)
                .filter(|w| self.nodes[w.poster].incarnation == w.poster_inc)
                .map(|w| vec![w.poster])
                .unwrap_or_default(),
            // The dialler's shell completes its handshake (a stalled listener fails the dial,
            // see `run_event`).
            Ev::Connect { from, .. } => vec![*from],
            Ev::RepeatHandshake { a, b } => vec![*a, *b],
            Ev::DecodeStart { request } => vec![r(*request).d_node],
            Ev::PrefillStart { .. }
            | Ev::FileExport { .. }
            | Ev::SecondTurn { .. }
            | Ev::LayersReady { .. } => vec![0],
            Ev::SubDecodeStart { node, .. }
            | Ev::SubPrefillStart { node, .. }
            | Ev::FileSubExports { node, .. }
            | Ev::FileKeep { node, .. }
            | Ev::FileTurnKeep { node, .. }
            | Ev::SiblingDecline { node, .. }
            | Ev::TurnBack { node, .. } => vec![*node],
            Ev::SecondDecode { request } => {
                vec![1 + (r(*request).d_node % self.cfg.decode_engines.max(1))]
            }
            Ev::Abort { request, decode } => match (&r(*request).multi, *decode) {
                (None, true) => vec![r(*request).d_node],
                (None, false) => vec![0],
                // Every D rank of a multi-rank request aborts in one engine step: it waits for
                // all of them to run.
                (Some(multi), true) => multi.pairs.iter().map(|pair| pair.d).collect(),
                (Some(multi), false) => vec![multi.abort_p],
            },
        };
        owners.into_iter().find(|&node| self.stalled(node))
    }

    /// `node`'s process runs again after the stall that began at `since`: frozen transfers move
    /// on (their life clock was suspended), the endpoint's due timers run, and then everything
    /// held is handed over in arrival order.
    pub(crate) fn resume(&mut self, node: NodeId, since: Time) {
        let current = self.nodes[node]
            .stall
            .as_ref()
            .is_some_and(|s| s.since == since);
        let line = format!("resume {}", self.nodes[node].addr);
        self.record(line);
        if !current {
            // That stall ended with a crash.
            return;
        }
        let Some(stall) = self.nodes[node].stall.take() else {
            return;
        };
        if stall.freeze {
            let line = format!("{} transfer(s) move again", stall.frozen.len());
            self.record(line);
        }
        let length = self.now.saturating_since(since);
        self.nodes[node].stalled_spans.push((since, self.now));
        for (seq, left) in stall.frozen {
            let Some(w) = self.writes.get_mut(&seq) else {
                continue;
            };
            if !w.in_flight() {
                continue;
            }
            w.posted = w.posted + length;
            self.schedule_at_seq(seq, left);
        }
        if stall.connected && length > self.cfg.machine.peer_timeout {
            self.mark("stall_past_peer_timeout");
        }
        self.note_mid_layer_resume(node);
        let share = self.cfg.stall_messages_first.clamp(0.0, 1.0);
        // Drawn only where asked for, so that other worlds keep their streams.
        let messages_first = stall.messages_first || (share > 0.0 && self.rng.gen_bool(share));
        if messages_first {
            self.record("held events first".to_string());
            self.hand_over(node, stall.held);
            self.run_due_timers(node);
        } else {
            // Timers first (the shell's order since issue 19): what is due by now is decided
            // before any message that waited through the stall is looked at.
            self.run_due_timers(node);
            self.hand_over(node, stall.held);
        }
    }

    /// Runs `node`'s timers due by now.
    fn run_due_timers(&mut self, node: NodeId) {
        for _ in 0..MAX_TIMER_ROUNDS {
            let due = self.nodes[node]
                .endpoint()
                .and_then(|e| e.poll_timeout())
                .is_some_and(|t| t <= self.now);
            if !due {
                break;
            }
            self.fire_timer(node);
        }
    }

    /// Hands resumed `node` what it held through its stall, in arrival order.
    fn hand_over(&mut self, node: NodeId, held: VecDeque<Ev>) {
        for ev in held {
            if matches!(ev, Ev::Handle(_)) && self.alive(node) {
                self.mark("stale_message_after_stall");
            }
            self.run_event(ev);
        }
    }

    /// `node` crashed while stopped: the stall ends with the process, and what it held goes
    /// back to the queue, to be judged against the new state (messages and transfer ends of
    /// the dead incarnation are lost; the engine's own calls wait for the restart).
    pub(crate) fn end_stall_by_crash(&mut self, node: NodeId) {
        let Some(stall) = self.nodes[node].stall.take() else {
            return;
        };
        self.nodes[node].stalled_spans.push((stall.since, self.now));
        for ev in stall.held {
            self.schedule(Duration::ZERO, ev);
        }
    }

    /// Transfers in flight that a stall froze and that reference one of `blocks` of `node`'s
    /// current incarnation, at either end (for the violations they cause).
    pub(crate) fn frozen_touching(&self, node: NodeId, blocks: &[u32]) -> usize {
        let inc = self.nodes[node].incarnation;
        self.writes
            .values()
            .filter(|w| w.frozen && w.in_flight())
            .filter(|w| {
                let local = w.poster == node && w.poster_inc == inc;
                let remote = w.target == node && w.target_inc == inc;
                (local && w.local.iter().any(|b| blocks.contains(b)))
                    || (remote && w.remote.iter().any(|b| blocks.contains(b)))
            })
            .count()
    }

    /// How long `node` was stopped since `since` (its own deadlines could not run meanwhile:
    /// the bounds on what it does, L1 and L3, move by as much).
    pub(crate) fn stalled_since(&self, node: NodeId, since: Time) -> Duration {
        let now = self.now;
        let current = self.nodes[node].stall.as_ref().map(|s| (s.since, now));
        self.nodes[node]
            .stalled_spans
            .iter()
            .copied()
            .chain(current)
            .map(|(from, until)| until.saturating_since(from.max(since)))
            .sum()
    }
}

/// A short name of an event, for the trace.
fn ev_name(ev: &Ev) -> String {
    match ev {
        Ev::Deliver(msg) | Ev::Handle(msg) => super::describe(msg),
        Ev::Report { write, failure } => format!("report #{write} {failure:?}"),
        other => format!("{other:?}"),
    }
}
