//! The endpoint's peer handling: running a peer's machine and acting on its notices (connect,
//! wake or fail the D requests bound to it, declare it dead, send heartbeats).

use crate::{Heartbeat, Incarnation, LeaseRef, Message, PairingKey, MAX_HEARTBEAT_LEASES};

use super::Endpoint;
use crate::machine::decode::{DecodeInput, DecodeRequest};
use crate::machine::import::ImportInput;
use crate::machine::peer::{Peer, PeerCtx, PeerDown, PeerInput, PeerNotice};
use crate::machine::shape::Machine;
use crate::machine::types::{DropReason, Output, Time};
use crate::machine::Mutation;
use crate::PeerAddr;

impl Endpoint {
    /// A message arrived from `peer`: true if the peer is connected (and now heard from), false
    /// if the message must be dropped. The hot path of every message, so it touches the peer
    /// table once and leaves the timer alone: hearing from a peer only pushes its liveness
    /// deadline later, and a timer that fires early is answered by the machine re-checking.
    pub(super) fn heard(&mut self, now: Time, peer: &PeerAddr) -> bool {
        // A message from a peer whose deadline passed before we got to it sat in a queue while
        // this process was stalled: the peer is dead as the timer would have found it, and
        // what it says now may be older than any fence its side already passed.
        let overdue = self
            .peers
            .get(peer)
            .is_some_and(|p| p.overdue(now, &self.config));
        if overdue && !self.mutation.is(Mutation::AcceptFromOverduePeer) {
            self.outbox.counters.stale_messages_refused += 1;
            self.peer_input(now, peer, PeerInput::Timeout);
            return false;
        }
        let config = &self.config;
        let ctx = PeerCtx { now, config };
        let fx = &mut self.outbox;
        let transition = |current: Peer| {
            if !current.is_connected() {
                return (current, false);
            }
            let (next, notice) = current.handle(&ctx, PeerInput::Heard, fx);
            debug_assert_eq!(notice, PeerNotice::Quiet);
            (next, true)
        };
        self.peers
            .step_keeping_timer(peer, config, transition)
            .unwrap_or(false)
    }

    /// Runs one input through a peer's machine and acts on what it says.
    pub(super) fn peer_input(&mut self, now: Time, peer: &PeerAddr, input: PeerInput) {
        if let PeerInput::Connected(run) = &input {
            // A repeat of the connected incarnation's handshake (a late copy, a second dial)
            // that this process gets to only after the peer's deadline passed (it was stalled
            // with it queued) would make an overdue peer look fresh, and the stale messages
            // queued behind it would pass `heard`. The peer is dead, as the timer would have
            // found it; a new dial (with its reload) connects it again.
            let overdue_repeat = self
                .peers
                .get(peer)
                .is_some_and(|p| p.overdue(now, &self.config) && p.incarnation() == Some(*run));
            if overdue_repeat && !self.mutation.is(Mutation::AcceptFromOverduePeer) {
                self.outbox.counters.stale_messages_refused += 1;
                self.peer_input(now, peer, PeerInput::Timeout);
                return;
            }
        }
        let run_before = self.peers.get(peer).and_then(Peer::incarnation);
        let config = &self.config;
        let ctx = PeerCtx { now, config };
        let fx = &mut self.outbox;
        let transition = |current: Peer| {
            let (next, notice) = current.handle(&ctx, input.clone(), fx);
            let forget = matches!(notice, PeerNotice::ConnectFailed(_) | PeerNotice::Forget);
            ((!forget).then_some(next), notice)
        };
        let notice = if let Some(notice) = self.peers.step(peer, config, transition) {
            notice
        } else {
            match input {
                PeerInput::ConnectRequested => {
                    if self.peers.len() >= self.config.max_peers {
                        self.fail_waiting_decodes(now, peer);
                        return;
                    }
                    self.outbox
                        .out
                        .push_back(Output::Connect { peer: peer.clone() });
                    let fresh = Peer::connecting(now, &self.config);
                    self.peers.insert(peer.clone(), fresh, &self.config);
                    return;
                }
                PeerInput::Connected(_) => {
                    if self.peers.len() >= self.config.max_peers {
                        self.outbox.counters.drop(DropReason::TableFull);
                        return;
                    }
                    // A peer that connected to us: as if it had been known and dead.
                    let unknown = Peer::Dead(PeerDown { until: now });
                    let ctx = PeerCtx {
                        now,
                        config: &self.config,
                    };
                    let (next, notice) = unknown.handle(&ctx, input, &mut self.outbox);
                    self.peers.insert(peer.clone(), next, &self.config);
                    notice
                }
                PeerInput::ConnectFailed(_) | PeerInput::Lost | PeerInput::Timeout => return,
                PeerInput::Heard => {
                    self.outbox.counters.drop(DropReason::UnknownPeer);
                    return;
                }
            }
        };
        match notice {
            PeerNotice::Quiet | PeerNotice::Forget => {}
            PeerNotice::Connect => self
                .outbox
                .out
                .push_back(Output::Connect { peer: peer.clone() }),
            PeerNotice::NotConnected => self.outbox.counters.drop(DropReason::UnknownPeer),
            PeerNotice::Up(queued) => {
                tracing::debug!(peer = %peer, "peer connected");
                let run = self.peers.get(peer).and_then(Peer::incarnation);
                let fenced = self.fenced_runs.remove(peer).map(|(run, _)| run);
                let rejoined = run.is_some() && fenced == run;
                for message in queued {
                    self.outbox.out.push_back(Output::Send {
                        to: peer.clone(),
                        message,
                    });
                }
                self.note_connected(now, peer);
                self.wake_connecting_decodes(now, peer);
                if rejoined && !self.mutation.is(Mutation::WaitOutRejoinedPeersFence) {
                    self.ask_rejoined_peer(now, peer);
                }
            }
            PeerNotice::Repeated if self.mutation.is(Mutation::HandshakeAlwaysRestart) => {
                self.outbox.counters.peer_restarts += 1;
                self.peer_died(now, peer, false);
            }
            PeerNotice::Repeated => {
                tracing::debug!(peer = %peer, "repeated handshake of the connected incarnation");
                self.outbox.counters.repeated_handshakes += 1;
            }
            PeerNotice::Restarted => {
                // Requests fenced from the old incarnation wait out their fence: the new one
                // cannot answer for the old one's writes.
                self.fenced_runs.remove(peer);
                self.outbox.counters.peer_restarts += 1;
                tracing::info!(peer = %peer, "peer restarted; its old incarnation is dead");
                // The shell replaced the old incarnation before reporting the new one (see
                // `NetEvent::PeerConnected`): invalidating now would cut the new one.
                self.peer_died(now, peer, false);
                self.note_connected(now, peer);
                self.wake_connecting_decodes(now, peer);
            }
            PeerNotice::ConnectFailed(reason) => {
                tracing::info!(peer = %peer, ?reason, "handshake failed");
                self.fail_waiting_decodes(now, peer);
            }
            PeerNotice::Died => {
                tracing::info!(peer = %peer, "peer declared dead");
                if let Some(run) = run_before {
                    self.remember_fenced_run(now, peer, run);
                }
                self.peer_died(now, peer, true);
            }
            PeerNotice::HeartbeatDue => self.send_heartbeats(peer),
        }
    }

    /// Tells P's table which incarnation of `peer` it is now connected to: a registration, a
    /// cancel or a release is then taken as that incarnation's, and one that replaced another
    /// opens the old one's restart window (`prefill_table/runs.rs`).
    fn note_connected(&mut self, now: Time, peer: &PeerAddr) {
        if let Some(run) = self.peers.get(peer).and_then(Peer::incarnation) {
            self.prefills.on_peer_connected(now, peer, run);
        }
    }

    /// Remembers which incarnation of `peer` this rank declared dead (bounded by `max_peers`):
    /// if the same one connects again, the death was false and it can answer for its writes.
    fn remember_fenced_run(&mut self, now: Time, peer: &PeerAddr, run: Incarnation) {
        if !self.fenced_runs.contains_key(peer) && self.fenced_runs.len() >= self.config.max_peers {
            self.fenced_runs.pop_first();
        }
        let probe = now + self.config.peer_timeout;
        self.fenced_runs.insert(peer.clone(), (run, probe));
    }

    /// Dials, every `peer_timeout`, each peer declared dead that still has D requests fenced
    /// by its death: nothing else may reconnect it (an engine whose pool the fence holds makes
    /// no new request), and if the death was false the same incarnation answers and settles
    /// them (`ask_rejoined_peer`). Stops once none is left (the fence freed them, or a restart
    /// replaced the incarnation).
    pub(super) fn probe_fenced_peers(&mut self, now: Time) {
        let due: Vec<PeerAddr> = self
            .fenced_runs
            .iter()
            .filter(|(_, &(_, probe))| probe <= now)
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in due {
            let fenced = self
                .decodes_bound_to(&peer)
                .iter()
                .any(|key| matches!(self.decodes.get(key), Some(DecodeRequest::Cancelling(_))));
            if !fenced || self.mutation.is(Mutation::WaitOutRejoinedPeersFence) {
                self.fenced_runs.remove(&peer);
                continue;
            }
            if let Some(entry) = self.fenced_runs.get_mut(&peer) {
                entry.1 = now + self.config.peer_timeout;
            }
            let dead = self.peers.get(&peer).is_none_or(Peer::is_dead);
            if dead {
                self.outbox.counters.fenced_peer_probes += 1;
                self.peer_input(now, &peer, PeerInput::ConnectRequested);
            }
        }
    }

    /// The incarnation this rank declared dead is connected again (a false death healed: a
    /// stall, a network blip): the D requests it fenced ask it again with a cancel. P answers
    /// one only once nothing of the attempt is in flight (and never writes it after), so its
    /// acknowledgement frees the blocks within a round trip instead of the quarantine.
    fn ask_rejoined_peer(&mut self, now: Time, peer: &PeerAddr) {
        self.outbox.counters.peers_rejoined += 1;
        for key in self.decodes_bound_to(peer) {
            if matches!(self.decodes.get(&key), Some(DecodeRequest::Cancelling(_))) {
                self.step_decode(now, &key, DecodeInput::PeerConnected);
            }
        }
    }

    fn decodes_bound_to(&self, peer: &PeerAddr) -> Vec<PairingKey> {
        self.decodes
            .iter()
            .filter(|(_, r)| &r.common().prefill == peer)
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn wake_connecting_decodes(&mut self, now: Time, peer: &PeerAddr) {
        for key in self.decodes_bound_to(peer) {
            if matches!(self.decodes.get(&key), Some(DecodeRequest::Connecting(_))) {
                self.step_decode(now, &key, DecodeInput::PeerConnected);
            }
        }
        self.imports_peer_input(now, peer, ImportInput::PeerConnected);
    }

    fn fail_waiting_decodes(&mut self, now: Time, peer: &PeerAddr) {
        for key in self.decodes_bound_to(peer) {
            self.step_decode(now, &key, DecodeInput::PeerConnectFailed);
        }
        self.imports_peer_input(now, peer, ImportInput::PeerConnectFailed);
    }

    /// Invalidates the peer first, so that by the time a request learns of the death no write
    /// from the peer can land any more; then fails everything bound to it.
    fn peer_died(&mut self, now: Time, peer: &PeerAddr, invalidate: bool) {
        self.outbox.counters.peers_declared_dead += 1;
        if invalidate {
            self.outbox
                .out
                .push_back(Output::Invalidate { peer: peer.clone() });
        }
        for key in self.decodes_bound_to(peer) {
            self.step_decode(now, &key, DecodeInput::PeerDead);
        }
        self.imports_peer_input(now, peer, ImportInput::PeerDead);
        let fx = &mut self.outbox;
        self.prefills.on_peer_dead(now, peer, fx);
    }

    /// A heartbeat to `peer`, naming every lease D wants P to keep (several messages if the
    /// list is long; one empty message is still a liveness ping).
    fn send_heartbeats(&mut self, peer: &PeerAddr) {
        let mut leases: Vec<LeaseRef> = self
            .decodes
            .values()
            .filter(|r| &r.common().prefill == peer && r.holds_lease())
            .map(|r| LeaseRef {
                key: r.common().key.clone(),
                epoch: r.common().epoch,
            })
            .collect();
        leases.extend(self.import_leases(peer));
        let mut chunks: Vec<Vec<LeaseRef>> = leases
            .chunks(MAX_HEARTBEAT_LEASES)
            .map(<[LeaseRef]>::to_vec)
            .collect();
        if chunks.is_empty() {
            chunks.push(Vec::new());
        }
        for leases in chunks {
            self.outbox.counters.heartbeats_sent += 1;
            self.outbox.out.push_back(Output::Send {
                to: peer.clone(),
                message: Message::Heartbeat(Heartbeat {
                    engine: self.own.engine.clone(),
                    leases,
                }),
            });
        }
    }
}
