//! The simulated notification network: connection generations, partitions, handshakes, and
//! sending and delivering control messages (with the faults chaos puts on them).

use kvhandoff_protocol::machine::NetEvent;
use kvhandoff_protocol::{Incarnation, Message};
use kvhandoff_protocol::{PairingKey, PeerAddr};
use rand::Rng;

use super::{micros, Ev, NetMsg, NodeId, World};
use kvhandoff_protocol::machine::Time;

impl World {
    /// The current connection generation between `a` and `b`.
    pub(crate) fn conn(&self, a: NodeId, b: NodeId) -> u64 {
        self.conns.get(&(a.min(b), a.max(b))).copied().unwrap_or(0)
    }

    /// The connection `a` uses to reach `b`: the one of its last handshake with `b`.
    pub(crate) fn view(&self, a: NodeId, b: NodeId) -> u64 {
        self.views.get(&(a, b)).copied().unwrap_or(0)
    }

    /// The incarnation of `b` that `a` knows from its last handshake.
    pub(crate) fn known_incarnation(&self, a: NodeId, b: NodeId) -> u32 {
        self.known.get(&(a, b)).copied().unwrap_or(0)
    }

    /// The incarnation id `node`'s current process sends in its handshakes.
    pub(crate) fn incarnation_id(&self, node: NodeId) -> Incarnation {
        super::incarnation_of(node, self.nodes[node].incarnation)
    }

    /// The incarnation of `b` that `a`'s endpoint is connected to, if any.
    pub(crate) fn connected_incarnation(&self, a: NodeId, b: NodeId) -> Option<Incarnation> {
        let peer = &self.nodes[b].addr;
        self.nodes[a].endpoint()?.connected_incarnation(peer)
    }

    /// Tears the connection between `a` and `b` down (a handshake or an invalidation).
    pub(crate) fn bump_conn(&mut self, a: NodeId, b: NodeId) {
        *self.conns.entry((a.min(b), a.max(b))).or_insert(0) += 1;
    }

    /// Whether the link between P and `node` (either end) is cut at `at`.
    pub(crate) fn partitioned(&self, a: NodeId, b: NodeId, at: Time) -> Option<Time> {
        if self.cfg.explore {
            return None;
        }
        self.partitions
            .iter()
            .filter(|(d, from, until)| (*d == a || *d == b) && *from <= at && at < *until)
            .map(|(_, _, until)| *until)
            .max()
    }

    pub(super) fn connect(&mut self, node: NodeId, peer: &PeerAddr) {
        let Some(&to) = self.by_addr.get(peer) else {
            self.violate(format!("node {node} connects to unknown {peer}"));
            return;
        };
        let fail =
            self.chance(self.rates.connect_fail) || self.partitioned(node, to, self.now).is_some();
        let delay = micros(&mut self.rng, 200, 5_000);
        let from_inc = self.nodes[node].incarnation;
        self.schedule(
            delay,
            Ev::Connect {
                from: node,
                from_inc,
                to,
                ok: !fail,
            },
        );
    }

    /// `message` from `from` to `to` on their current connection, aimed at the incarnation the
    /// sender shook hands with (lost if the peer restarted since).
    pub(crate) fn net_msg(&self, from: NodeId, to: NodeId, message: Message) -> NetMsg {
        NetMsg {
            from,
            from_inc: self.nodes[from].incarnation,
            to,
            to_inc: self.known_incarnation(from, to),
            conn: self.view(from, to),
            message,
        }
    }

    /// Puts a control message (or a write's notification) on the network.
    pub(crate) fn send(&mut self, from: NodeId, to: &PeerAddr, message: Message) {
        let Some(&to) = self.by_addr.get(to) else {
            self.violate(format!("node {from} sends to unknown {to}"));
            return;
        };
        let message = self.hostile_send(from, to, message);
        self.note_sent(from, &message);
        self.note_read_message(from, to, &message);
        self.note_ask_sent(from, &message);
        if let Message::Cancel(cancel) = &message {
            self.note_cancel(from, to, cancel);
        }
        let msg = self.net_msg(from, to, message);
        // In explore mode the scheduler chooses every delivery and due times are ignored, but
        // when a message left decides when it is lost past its bound: no random delay there,
        // so that a state is the same whatever the stream drew before it.
        let mut delay = if self.cfg.explore {
            std::time::Duration::ZERO
        } else {
            micros(&mut self.rng, 50, 2_000)
        };
        if self.chance(self.rates.slow_msg) {
            let slowest = self.cfg.slow_message_max.as_micros() as u64;
            delay = micros(&mut self.rng, 20_000, slowest.max(20_001));
        }
        if matches!(msg.message, Message::WriteDone(_)) && self.chance(self.rates.slow_write_done) {
            delay = delay.max(self.cfg.slow_message_max);
        }
        if let Some(until) = self.partitioned(from, to, self.now) {
            delay = delay.max(until.saturating_since(self.now));
        }
        if self.chance(self.rates.drop) {
            let line = format!("net drop {}", describe(&msg));
            self.record(line);
            return;
        }
        if self.cancel_lost(from, &msg.message) {
            let line = format!("net lose cancel {}", describe(&msg));
            self.record(line);
            return;
        }
        if matches!(msg.message, Message::ReadAsk(_)) && self.chance(self.rates.lose_ask) {
            let line = format!("net lose ask {}", describe(&msg));
            self.record(line);
            return;
        }
        if self.answer_muted(&msg.message) {
            let line = format!("net mute {}", describe(&msg));
            self.record(line);
            return;
        }
        let notification = is_notification(&msg.message);
        if (notification || self.cfg.dup_control) && self.chance(self.rates.dup) {
            // Mostly right behind the original; one in five much later, up to the delivery
            // bound (a copy that arrives after the attempt it belongs to was retried, or after
            // its key's tombstone was evicted).
            let bound = self.cfg.machine.max_message_delay.saturating_sub(delay);
            let extra = if self.rng.gen_bool(0.2) && bound > std::time::Duration::from_millis(30) {
                micros(&mut self.rng, 30_000, bound.as_micros() as u64)
            } else {
                micros(&mut self.rng, 0, 30_000)
            };
            self.schedule(delay + extra, Ev::Deliver(msg.clone()));
        }
        let sibling = self.late_sibling_register(from, &msg.message);
        if let Some(late) = self.late_register_copy(&msg.message, delay, sibling) {
            self.schedule(late, Ev::Deliver(msg.clone()));
        }
        self.schedule(delay, Ev::Deliver(msg));
    }

    /// Whether `message` is a P→D answer about a key whose answers are lost (decided once per
    /// key, during the faulty phase only).
    fn answer_muted(&mut self, message: &Message) -> bool {
        let key = match message {
            Message::WriteDone(m) => &m.key,
            Message::WritePartDone(m) => &m.key,
            Message::WriteFailed(m) => &m.key,
            Message::CancelAck(m) => &m.key,
            Message::Handshake(_)
            | Message::Register(_)
            | Message::Cancel(_)
            | Message::Heartbeat(_)
            | Message::Release(_)
            | Message::ReadAsk(_)
            | Message::ReadGrant(_)
            | Message::ReadRefused(_) => return false,
        };
        if !self.faulty() {
            return false;
        }
        if self.mute_decided.insert(key.clone()) && self.chance(self.rates.mute_answers) {
            self.muted.insert(key.clone());
        }
        self.muted.contains(key)
    }

    pub(super) fn connect_done(&mut self, from: NodeId, from_inc: u32, to: NodeId, ok: bool) {
        let line = format!("connect {from}->{to} ok={ok}");
        self.record(line);
        if self.nodes[from].incarnation != from_inc || !self.alive(from) {
            return;
        }
        let peer = self.nodes[to].addr.clone();
        if ok && self.alive(to) {
            let (live_from, live_to) = (self.incarnation_id(from), self.incarnation_id(to));
            if self.connected_incarnation(from, to) == Some(live_to)
                && self.connected_incarnation(to, from) == Some(live_from)
            {
                // Both shells see the incarnation they are connected to: nothing is reloaded.
                self.repeated_handshake(from, to);
                return;
            }
            for (a, b, live) in [(from, to, live_to), (to, from, live_from)] {
                if self
                    .connected_incarnation(a, b)
                    .is_some_and(|known| known != live)
                {
                    self.mark("new_incarnation_while_connected");
                }
            }
            // The shell replaces whatever incarnation it knew: the old connection's writes
            // and messages are gone.
            self.invalidate(from, to);
            let generation = self.conn(from, to);
            self.views.insert((from, to), generation);
            self.views.insert((to, from), generation);
            self.known.insert((from, to), self.nodes[to].incarnation);
            self.known.insert((to, from), self.nodes[from].incarnation);
            // Each side's shell loads the other (the accepting side first, as the listener
            // answers only once it has) and tells its endpoint.
            self.shell_handshake(to, from);
            self.shell_handshake(from, to);
        } else {
            let reason = kvhandoff_protocol::machine::ConnectFailure::Refused("simulated".into());
            self.feed(from, NetEvent::PeerConnectFailed { peer, reason });
        }
    }

    /// A handshake between two ranks connected to each other's live incarnations completes
    /// again. S9: it changes nothing (no death declared, no request of either side touched).
    fn repeated_handshake(&mut self, a: NodeId, b: NodeId) {
        self.mark("duplicate_handshake_same_incarnation");
        let snapshot = |w: &World| {
            let deaths: Vec<u64> = [a, b]
                .iter()
                .map(|&n| {
                    w.nodes[n]
                        .endpoint()
                        .map_or(0, |e| e.counters().peers_declared_dead)
                })
                .collect();
            let states: Vec<Option<String>> = (0..w.requests.len())
                .flat_map(|r| w.decode_keys(r))
                .filter(|(node, _)| [a, b].contains(node))
                .map(|(node, key)| w.decode_state_of(node, &key))
                .collect();
            (deaths, states)
        };
        // A process resumed from a stall may get the repeat before its overdue timers ran
        // (`stall_messages_first`), and a timer due at this very instant may be scheduled
        // after the handshake: then its peer's deadline has come, and declaring the peer dead
        // is what the timer would have done — the one case S9 allows a death.
        let overdue = [a, b].iter().any(|&n| {
            self.nodes[n]
                .endpoint()
                .and_then(|e| e.poll_timeout())
                .is_some_and(|due| due <= self.now)
        });
        let before = snapshot(self);
        for (x, y) in [(b, a), (a, b)] {
            self.shell_handshake(x, y);
        }
        let after = snapshot(self);
        if overdue {
            self.mark("repeated_handshake_while_overdue");
        } else if before.0 != after.0 {
            self.violate(format!(
                "S9: a repeated handshake between {a} and {b} declared a peer dead"
            ));
        } else if before.1 != after.1 || !self.step_decode_events.is_empty() {
            self.violate(format!(
                "S9: a repeated handshake between {a} and {b} changed a request"
            ));
        }
    }

    /// The state of D `node`'s live request for `key`, as text.
    fn decode_state_of(&self, node: NodeId, key: &PairingKey) -> Option<String> {
        self.nodes[node].endpoint()?.decode_state(key)
    }

    /// The (D node, key) of `request`'s decodes: its key on its D node, or the pair key of each
    /// sub-request of a multi-rank request on its D rank.
    fn decode_keys(&self, request: usize) -> Vec<(NodeId, PairingKey)> {
        let r = &self.requests[request];
        match &r.multi {
            None => vec![(r.d_node, r.key.clone())],
            Some(multi) => multi
                .pairs
                .iter()
                .map(|pair| (pair.d, pair.key.clone()))
                .collect(),
        }
    }

    /// Delivers a network message to its destination: the network judges it now (lost with
    /// its connection or its incarnation), and the destination's shell handles it now, or when
    /// its process resumes if it is stalled.
    pub(crate) fn deliver(&mut self, msg: NetMsg) {
        let line = format!("deliver {}", describe(&msg));
        self.record(line);
        if !self.alive(msg.to) || self.nodes[msg.to].incarnation != msg.to_inc {
            return;
        }
        if msg.conn != self.conn(msg.from, msg.to) {
            // Its connection was torn down (handshake or invalidation) while it travelled.
            self.mark("message_lost_with_connection");
            return;
        }
        self.maybe_stall_at_lease_end(&msg);
        self.maybe_stall_before_late_grant(&msg);
        if self.stalled(msg.to) {
            // In the stopped process's receive queue: it stays there, whatever happens to the
            // connection meanwhile, until the process runs again.
            self.hold(msg.to, Ev::Handle(msg));
            return;
        }
        let registered = match &msg.message {
            Message::Register(register) if self.is_prefill(msg.to) => {
                Some((msg.to, register.key.clone()))
            }
            _ => None,
        };
        self.handle(msg);
        if let Some((node, key)) = registered {
            self.maybe_stall_with_registration_pending(node, &key);
        }
    }

    /// A message held through its destination's stall, handed to the resumed shell (unless the
    /// process died meanwhile).
    pub(crate) fn handle_held(&mut self, msg: NetMsg) {
        let line = format!("handle held {}", describe(&msg));
        self.record(line);
        if !self.alive(msg.to) || self.nodes[msg.to].incarnation != msg.to_inc {
            return;
        }
        self.handle(msg);
    }

    /// The destination's shell handles a message that arrived (the S5 check around it).
    fn handle(&mut self, msg: NetMsg) {
        let stale_key = self.note_delivered(&msg);
        // S5: a P→D message for an epoch D does not hold changes nothing of D's live request.
        let before = stale_key.map(|(request, key)| {
            let state = self.decode_state_of(msg.to, &key);
            (request, key, state)
        });
        let kind = describe(&msg);
        let renewals_before = self.exports_renewed(msg.to);
        let refused_before = self.stale_messages_refused(msg.to);
        let hostile = self.hostile_before(&msg);
        self.lease_heartbeat(msg.to, &msg.message);
        let past_lease = self.register_past_lease(&msg);
        self.note_heartbeat_for_others(&msg);
        let ended_before = self.ended_attempt_registered(&msg);
        self.note_ask_before_export(&msg);
        self.note_sibling_past_record(&msg);
        self.shell_notification(msg.to, msg.from, msg.from_inc, &msg.message);
        self.check_register_after_end(&msg, ended_before);
        // A message handled after its sender's deadline (a stall handed it over before the
        // timers) declares the sender dead instead: that death, not the message, changes the
        // requests bound to the sender.
        let sender_declared_dead = self.stale_messages_refused(msg.to) > refused_before;
        if let Some(before) = hostile {
            self.hostile_after(&msg, before, sender_declared_dead);
        }
        if let Some(past) = past_lease.filter(|_| !sender_declared_dead) {
            self.note_register_past_lease(msg.to, past);
        }
        if let Message::Heartbeat(heartbeat) = &msg.message {
            if self.exports_renewed(msg.to) > renewals_before {
                let keys: Vec<_> = heartbeat.leases.iter().map(|l| l.key.clone()).collect();
                self.note_renewals(msg.to, &keys);
            }
        }
        if let Some((request, key, before)) = before.filter(|_| !sender_declared_dead) {
            if self.step_decode_events.contains(&request) {
                self.violate(format!(
                    "S5: a stale-epoch message ended request {request} on D ({kind})"
                ));
            } else if self.decode_state_of(msg.to, &key) != before {
                self.violate(format!(
                    "S5: a stale-epoch message changed request {request} on D ({kind})"
                ));
            }
        }
    }
}

impl World {
    /// Messages `node`'s endpoint refused as from a peer past its deadline (this incarnation).
    fn stale_messages_refused(&self, node: NodeId) -> u64 {
        self.nodes[node]
            .endpoint()
            .map_or(0, |e| e.counters().stale_messages_refused)
    }

    /// Export leases `node`'s endpoint has renewed so far (this incarnation).
    fn exports_renewed(&self, node: NodeId) -> u64 {
        self.nodes[node]
            .endpoint()
            .map_or(0, |e| e.counters().exports_renewed)
    }
}

/// P→D notifications (the only messages chaos duplicates unless `dup_control` is set).
pub(crate) fn is_notification(message: &Message) -> bool {
    matches!(
        message,
        Message::WriteDone(_)
            | Message::WritePartDone(_)
            | Message::WriteFailed(_)
            | Message::CancelAck(_)
    )
}

/// A short, deterministic description of a network message.
pub(crate) fn describe(msg: &NetMsg) -> String {
    let m = match &msg.message {
        Message::Register(r) => format!("Register({} {} {:?})", r.key, r.epoch, r.blocks.groups),
        Message::WriteDone(m) => format!("WriteDone({} {})", m.key, m.epoch),
        Message::WritePartDone(m) => format!(
            "WritePartDone({} {} {}+{}/{})",
            m.key, m.epoch, m.first, m.count, m.of
        ),
        Message::WriteFailed(m) => format!("WriteFailed({} {} {:?})", m.key, m.epoch, m.reason),
        Message::Cancel(m) => format!("Cancel({} {} {:?})", m.key, m.epoch, m.reason),
        Message::CancelAck(m) => format!("CancelAck({} {})", m.key, m.epoch),
        Message::Release(m) => format!("Release({} {} {:?})", m.key, m.epoch, m.reason),
        Message::Heartbeat(h) => format!("Heartbeat({})", h.leases.len()),
        other => format!("{other:?}"),
    };
    format!("{}->{} {m}", msg.from, msg.to)
}
