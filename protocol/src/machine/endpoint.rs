//! `Endpoint`: one engine rank's whole protocol state, behind the sans-IO interface
//! `handle` / `handle_timeout` / `poll_output` / `poll_timeout`.
//!
//! It hosts the D request machines, P's [`PrefillTable`] and the [`Peer`] machines, and routes every
//! input to them by pairing key or peer. Nothing outside it routes or matches, so the actix
//! shells and the simulator run exactly this code.

mod decodes;
mod peers;
mod read_path;
#[cfg(test)]
mod tests;

use crate::{BlockIds, EngineId, Epoch, Incarnation, Message, PairingKey, RequestId, WriteFailure};

use super::config::ConfigError;
use super::counters::Gauges;
use super::decode::{DecodeInput, DecodeRequest};
use super::decode_table::DecodeTable;
use super::effects::Outbox;
use super::peer::{Peer, PeerInput};
use super::prefill_table::{PrefillTable, Sender};
use super::read_tables::{ExportTable, ImportTable};
use super::tables::Machines;
use super::types::{Counters, DropReason, EndpointCall, NetEvent, Output, Rejected, Time};
use super::{ActiveMutation, Config};
use crate::{PeerAddr, WriteId};

/// Sizes of an endpoint's tables, for reports and leak checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndpointStats {
    /// Live D requests.
    pub decode_requests: usize,
    /// Live P requests.
    pub prefill_requests: usize,
    /// Registrations waiting for their prefill.
    pub pending_registrations: usize,
    /// Writes posted and not yet finished.
    pub writes_in_flight: usize,
    /// Known peers (connecting, connected or recently dead).
    pub peers: usize,
    /// Remembered ended keys, both sides.
    pub tombstones: usize,
    /// Outputs not yet polled.
    pub queued_outputs: usize,
    /// Live exports (blocks held for a remote reader).
    pub exports: usize,
    /// Live imports (reads of a remote export).
    pub imports: usize,
    /// Reads posted and not yet finished.
    pub reads_in_flight: usize,
}

/// One engine rank's protocol state machine.
///
/// ```
/// use kvhandoff_protocol::machine::{
///     Config, DecodeStart, Endpoint, EndpointCall, NetEvent, Output, Time,
/// };
/// use kvhandoff_protocol::{
///     BlockIds, EngineId, Epoch, Incarnation, Message, PairingKey, PeerAddr, RequestId,
/// };
///
/// let mut d = Endpoint::new(EngineId::new("decode").unwrap(), 0, Config::default()).unwrap();
/// let p = PeerAddr::new(EngineId::new("prefill").unwrap(), 0);
/// let request = RequestId::new("cmpl-1-0-aaaaaaaa").unwrap();
/// d.handle_call(Time::ZERO, EndpointCall::DecodeAllocated(DecodeStart {
///     key: PairingKey::from_request_id(&request),
///     request,
///     epoch: Epoch::FIRST,
///     prefill: p.clone(),
///     blocks: BlockIds::single_group(vec![7, 8]),
///     num_tokens: 20,
///     expected_writes: 1,
/// })).unwrap();
/// // D needs a handshake with P before it registers.
/// assert_eq!(d.poll_output(), Some(Output::Connect { peer: p.clone() }));
/// let incarnation = Incarnation::random(); // from P's handshake
/// d.handle_event(Time::ZERO, NetEvent::PeerConnected { peer: p.clone(), incarnation });
/// assert!(matches!(
///     d.poll_output(),
///     Some(Output::Send { message: Message::Register(_), .. })
/// ));
/// assert!(d.poll_timeout().is_some());
/// ```
#[derive(Debug)]
pub struct Endpoint {
    own: PeerAddr,
    config: Config,
    decodes: DecodeTable,
    prefills: PrefillTable,
    exports: ExportTable,
    imports: ImportTable,
    peers: Machines<PeerAddr, Peer>,
    /// Peers this rank declared dead while connected, with the incarnation it declared dead
    /// and when it next dials it to ask (bounded by `max_peers`): a reconnection of the same
    /// one is a false death healed.
    fenced_runs: std::collections::BTreeMap<PeerAddr, (crate::Incarnation, Time)>,
    outbox: Outbox,
    /// Set by [`EndpointCall::Shutdown`]: no new requests are taken.
    shutting_down: bool,
    /// The deliberate bug in force (simulator only; see [`super::Mutation`]).
    mutation: ActiveMutation,
    /// Makes the trace ids of the attempts this rank starts (D's registrations, readers' asks).
    traces: crate::TraceIds,
}

impl Endpoint {
    /// An endpoint for `rank` of `engine`.
    ///
    /// # Errors
    /// [`ConfigError`] if the configuration is invalid.
    pub fn new(engine: EngineId, rank: u32, config: Config) -> Result<Endpoint, ConfigError> {
        config.validate()?;
        let own_for_traces = PeerAddr::new(engine.clone(), rank);
        Ok(Endpoint {
            own: PeerAddr::new(engine, rank),
            prefills: PrefillTable::new(rank, &config),
            decodes: DecodeTable::new(&config),
            exports: ExportTable::new(&config),
            imports: ImportTable::new(&config),
            config,
            peers: Machines::default(),
            fenced_runs: std::collections::BTreeMap::new(),
            outbox: Outbox::default(),
            shutting_down: false,
            mutation: ActiveMutation::default(),
            traces: crate::TraceIds::for_rank(&own_for_traces),
        })
    }

    /// Runs this endpoint with a deliberate bug, for the simulator's mutation check.
    #[cfg(feature = "mutations")]
    #[doc(hidden)]
    pub fn set_mutation(&mut self, mutation: Option<super::Mutation>) {
        self.mutation = ActiveMutation(mutation);
        self.prefills.set_mutation(self.mutation);
    }

    /// Seeds the trace ids of the attempts this endpoint starts. The shells pass a random seed
    /// (two processes' ids must not repeat each other's); left unseeded (seeded by the rank's
    /// address, as in the simulator), ids are reproducible, and repeat those of an earlier run
    /// of the same rank.
    pub fn set_trace_seed(&mut self, seed: u128) {
        self.traces = crate::TraceIds::new(seed);
    }

    /// This endpoint's own address.
    pub fn address(&self) -> &PeerAddr {
        &self.own
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Counters of drops, renewals, races and the like.
    pub fn counters(&self) -> &Counters {
        &self.outbox.counters
    }

    /// The incarnation `peer` is connected to, if it is connected. A handshake naming this
    /// incarnation is a repeat: the shell must not reload the peer for it (see
    /// [`NetEvent::PeerConnected`]).
    pub fn connected_incarnation(&self, peer: &PeerAddr) -> Option<Incarnation> {
        self.peers.get(peer).and_then(Peer::incarnation)
    }

    /// The incarnation of `peer` that was declared dead while requests had blocks exposed to
    /// it, as long as those requests wait for its proofs (the endpoint dials it meanwhile, and
    /// asks it again if the same incarnation answers). For observers: the simulator checks
    /// with it that a rejoined peer is asked.
    pub fn fenced_run(&self, peer: &PeerAddr) -> Option<Incarnation> {
        self.fenced_runs.get(peer).map(|&(run, _)| run)
    }

    /// Sizes of every table.
    pub fn stats(&self) -> EndpointStats {
        EndpointStats {
            decode_requests: self.decodes.len(),
            prefill_requests: self.prefills.live_requests(),
            pending_registrations: self.prefills.pending_registrations(),
            writes_in_flight: self.prefills.writes_in_flight(),
            peers: self.peers.len(),
            tombstones: self.decodes.tombstones()
                + self.prefills.tombstones()
                + self.exports.tombstones()
                + self.imports.tombstones(),
            queued_outputs: self.outbox.out.len(),
            exports: self.exports.len(),
            imports: self.imports.len(),
            reads_in_flight: self.imports.reads_in_flight(),
        }
    }

    /// What the endpoint holds now, for gauges: blocks in quarantine, peers by liveness state.
    /// It walks the live D requests and the peers, so the shell reads it on a cadence of its
    /// own, not after every step.
    pub fn gauges(&self) -> Gauges {
        let mut g = Gauges::default();
        for request in self.decodes.values() {
            if let DecodeRequest::Cancelling(c) = request {
                let blocks: usize = c.common.blocks.groups.iter().map(Vec::len).sum();
                g.blocks_quarantined = g.blocks_quarantined.saturating_add(blocks as u64);
            }
        }
        for peer in self.peers.values() {
            match peer {
                Peer::Connecting(_) => g.peers_connecting += 1,
                Peer::Connected(_) => g.peers_connected += 1,
                Peer::Dead(_) => g.peers_dead += 1,
            }
        }
        g
    }

    /// Tombstones evicted at capacity so far, both sides (each one a key whose late messages
    /// may now look new).
    pub fn tombstones_evicted(&self) -> u64 {
        self.decodes.tombstones_evicted() + self.prefills.tombstones_evicted()
    }

    /// True while any request is live or any output is queued: the engine loop must keep
    /// stepping.
    pub fn has_pending_work(&self) -> bool {
        !self.decodes.is_empty()
            || self.prefills.live_requests() > 0
            || self.exports.len() > 0
            || self.imports.len() > 0
            || !self.outbox.out.is_empty()
    }

    /// The next thing for the shell to do.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outbox.out.pop_front()
    }

    /// When [`Endpoint::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Time> {
        [
            self.decodes.next_timer(),
            self.prefills.next_timer(),
            self.exports.next_timer(),
            self.imports.next_timer(),
            self.peers.next_timer(),
            self.fenced_runs.values().map(|&(_, probe)| probe).min(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Handles one call from the local engine. A refused call ([`Rejected`]) changed nothing.
    ///
    /// # Errors
    /// [`Rejected`] for a call that breaks a rule.
    pub fn handle_call(&mut self, now: Time, call: EndpointCall) -> Result<(), Rejected> {
        let result = match call {
            EndpointCall::DecodeAllocated(_)
            | EndpointCall::PrefillFinished(_)
            | EndpointCall::PrefillStarted { .. }
            | EndpointCall::Export(_)
            | EndpointCall::Import(_)
                if self.shutting_down =>
            {
                Err(Rejected::ShuttingDown)
            }
            EndpointCall::DecodeAllocated(start) => self.decode_allocated(now, start),
            EndpointCall::Shutdown => {
                self.shutdown(now);
                Ok(())
            }
            EndpointCall::PrefillFinished(start) => {
                let fx = &mut self.outbox;
                self.prefills.finished(now, start, fx)
            }
            EndpointCall::PrefillStarted { start, plan } => {
                let fx = &mut self.outbox;
                self.prefills.started(now, start, plan, fx)
            }
            EndpointCall::LayersReady { request, ready } => {
                let fx = &mut self.outbox;
                self.prefills.layers_ready(now, &request, ready, fx)
            }
            EndpointCall::Abort { request } => self.abort(now, &request),
            EndpointCall::Export(start) => self.export_call(now, start),
            EndpointCall::Import(start) => self.import_call(now, start),
            EndpointCall::DeclineExport { key, epoch, holder } => {
                self.decline_export(now, key, epoch, holder)
            }
        };
        self.check_invariants();
        result
    }

    /// Handles one report of the network or the transport. Events are never refused: what
    /// cannot be used is counted in [`Counters::dropped`].
    pub fn handle_event(&mut self, now: Time, event: NetEvent) {
        match event {
            NetEvent::Received { from, message } => self.received(now, from, message),
            NetEvent::Malformed { from, error } => {
                tracing::debug!(?from, %error, "malformed message dropped");
                self.outbox.counters.drop(DropReason::Malformed);
            }
            NetEvent::PeerConnected { peer, incarnation } => {
                self.peer_input(now, &peer, PeerInput::Connected(incarnation));
            }
            NetEvent::PeerConnectFailed { peer, reason } => {
                self.peer_input(now, &peer, PeerInput::ConnectFailed(reason));
            }
            NetEvent::PeerLost { peer } => self.peer_input(now, &peer, PeerInput::Lost),
            NetEvent::WriteCompleted { write } if super::is_read(write) => {
                self.read_result(now, write, false);
            }
            NetEvent::WriteFailed { write, .. } if super::is_read(write) => {
                self.read_result(now, write, true);
            }
            NetEvent::WriteCompleted { write } => self.write_result(now, write, None),
            NetEvent::WriteFailed { write, failure } => {
                self.write_result(now, write, Some(failure));
            }
            NetEvent::DigestMismatch {
                from,
                key,
                epoch,
                prefill_rank,
            } => {
                tracing::warn!(peer = %from, %key, %epoch, "landed bytes do not match P's digests");
                self.outbox.counters.digest_mismatches += 1;
                let input = DecodeInput::WriteFailed {
                    rank: prefill_rank,
                    reason: WriteFailure::DigestMismatch,
                };
                self.route_to_decode(now, &from, prefill_rank, &key, epoch, input);
            }
        }
        self.check_invariants();
    }

    /// Fires every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        if let Some(due) = self.poll_timeout() {
            let late = now.saturating_since(due);
            if late > self.config.stall_allowance() {
                // Only a stopped process (or a shell starved for that long) runs a timer this
                // late; a write it had in flight may land after a peer's fence.
                self.outbox.counters.stalls_past_allowance += 1;
                tracing::error!(
                    late_ms = late.as_millis() as u64,
                    allowance_ms = self.config.stall_allowance().as_millis() as u64,
                    "this rank ran its timers late by more than the stall allowance \
                     (quarantine − fence floor): a transfer it had in flight may have landed \
                     after a peer's time-based fence; raise quarantine or prevent such stops"
                );
            }
        }
        for key in self.decodes.take_due(now) {
            self.step_decode(now, &key, DecodeInput::Timeout);
        }
        {
            let fx = &mut self.outbox;
            self.prefills.on_timeout(now, fx);
        }
        for key in self.exports.take_due(now) {
            self.step_export(now, &key, super::export::ExportInput::Timeout);
        }
        for key in self.imports.take_due(now) {
            self.step_import(now, &key, super::import::ImportInput::Timeout);
        }
        for peer in self.peers.take_due(now) {
            self.peer_input(now, &peer, PeerInput::Timeout);
        }
        self.probe_fenced_peers(now);
        self.check_invariants();
    }

    /// Every live request gives up; registered D requests still wait for their proof (the
    /// endpoint keeps running until `has_pending_work` is false).
    fn shutdown(&mut self, now: Time) {
        self.shutting_down = true;
        let keys: Vec<PairingKey> = self.decodes.keys().cloned().collect();
        for key in keys {
            self.step_decode(now, &key, DecodeInput::Shutdown);
        }
        for request in self.prefills.live_request_ids() {
            let fx = &mut self.outbox;
            // Every listed request is live, so the abort cannot be refused.
            let _ = self.prefills.abort(now, &request, fx);
        }
        let exports: Vec<PairingKey> = self.exports.keys().cloned().collect();
        for key in exports {
            self.step_export(now, &key, super::export::ExportInput::Abort);
        }
        let imports: Vec<PairingKey> = self.imports.keys().cloned().collect();
        for key in imports {
            self.step_import(now, &key, super::import::ImportInput::Shutdown);
        }
    }

    fn abort(&mut self, now: Time, request: &RequestId) -> Result<(), Rejected> {
        if let Some(key) = self.decodes.key_of(request).cloned() {
            self.step_decode(now, &key, DecodeInput::Abort);
            return Ok(());
        }
        if let Some(key) = self.imports.key_of(request).cloned() {
            self.step_import(now, &key, super::import::ImportInput::Abort);
            return Ok(());
        }
        if let Some(key) = self.exports.key_of(request).cloned() {
            self.step_export(now, &key, super::export::ExportInput::Abort);
            return Ok(());
        }
        let fx = &mut self.outbox;
        self.prefills.abort(now, request, fx)
    }

    /// Sends `message` to `peer` now, or after the handshake if one is needed.
    fn send_or_queue(&mut self, now: Time, peer: &PeerAddr, message: Message) {
        if self.peers.get(peer).is_some_and(Peer::is_connected) {
            self.outbox.out.push_back(Output::Send {
                to: peer.clone(),
                message,
            });
            return;
        }
        self.peer_input(now, peer, PeerInput::ConnectRequested);
        let config = &self.config;
        let queued = self
            .peers
            .get_mut(peer)
            .is_some_and(|p| p.queue(message, config));
        if !queued {
            // Best effort: P's lease frees its blocks anyway.
            self.outbox.counters.drop(DropReason::TableFull);
        }
    }

    fn received(&mut self, now: Time, from: PeerAddr, message: Message) {
        if !self.heard(now, &from) {
            self.outbox.counters.drop(DropReason::UnknownPeer);
            return;
        }
        match message {
            Message::Handshake(_) => self.outbox.counters.drop(DropReason::WrongPath),
            Message::Register(register) => {
                let Some(from) = self.sender(from) else {
                    return;
                };
                let fx = &mut self.outbox;
                self.prefills.on_register(now, from, register, fx);
            }
            Message::Cancel(cancel) => {
                let Some(from) = self.sender(from) else {
                    return;
                };
                let fx = &mut self.outbox;
                self.prefills
                    .on_cancel(now, from, cancel.key, cancel.epoch, fx);
            }
            Message::ReadAsk(_) | Message::ReadGrant(_) | Message::ReadRefused(_) => {
                self.received_read_path(now, from, message)
            }
            Message::Release(ref release) if self.exports.contains(&release.key) => {
                self.received_read_path(now, from, message);
            }
            Message::Release(release) => {
                let Some(from) = self.sender(from) else {
                    return;
                };
                let fx = &mut self.outbox;
                let (key, epoch, reason) = (release.key, release.epoch, release.reason);
                self.prefills.on_release(now, from, key, epoch, reason, fx);
            }
            Message::Heartbeat(heartbeat) => {
                if heartbeat.engine != from.engine {
                    self.outbox.counters.drop(DropReason::Unexpected);
                    return;
                }
                let leases = self.renew_exports(now, &from, heartbeat.leases);
                let fx = &mut self.outbox;
                self.prefills.on_heartbeat(now, &from, leases, fx);
            }
            Message::WriteDone(m) => {
                let rank = m.prefill_rank;
                let input = DecodeInput::WriteDone { rank };
                self.route_to_decode(now, &from, rank, &m.key, m.epoch, input);
            }
            Message::WritePartDone(m) => {
                let rank = m.prefill_rank;
                let input = DecodeInput::PartDone {
                    rank,
                    first: m.first,
                    count: m.count,
                    of: m.of,
                };
                self.route_to_decode(now, &from, rank, &m.key, m.epoch, input);
            }
            Message::WriteFailed(m) => {
                let rank = m.prefill_rank;
                let input = DecodeInput::WriteFailed {
                    rank,
                    reason: m.reason,
                };
                self.route_to_decode(now, &from, rank, &m.key, m.epoch, input);
            }
            Message::CancelAck(m) => {
                let rank = m.prefill_rank;
                let input = DecodeInput::CancelAck { rank };
                self.route_to_decode(now, &from, rank, &m.key, m.epoch, input);
            }
        }
    }

    /// A D rank's message to P's table, taken as from the incarnation P is connected to (see
    /// `prefill_table/runs.rs`); `None` (counted) if the peer is not connected.
    fn sender(&mut self, from: PeerAddr) -> Option<Sender> {
        let Some(run) = self.connected_incarnation(&from) else {
            self.outbox.counters.drop(DropReason::UnknownPeer);
            return None;
        };
        Some(Sender { addr: from, run })
    }

    fn write_result(&mut self, now: Time, write: WriteId, failure: Option<crate::WriteFailure>) {
        let fx = &mut self.outbox;
        self.prefills.on_write_result(now, write, failure, fx);
    }

    /// Asserts every cross-table invariant (debug builds only; O(table size)).
    fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        self.decodes.check_invariants(&self.config);
        assert!(self.peers.len() <= self.config.max_peers);
        assert!(self.peers.all_armed(), "every peer has a timer");
        for request in self.decodes.values() {
            let common = request.common();
            // A request fenced after its peer's death outlives the peer's entry.
            if !matches!(request, DecodeRequest::Cancelling(_)) {
                let peer = self.peers.get(&common.prefill);
                assert!(
                    peer.is_some_and(|p| !p.is_dead()),
                    "a D request that may still register or be written has a live peer"
                );
            }
        }
        self.prefills.check_invariants();
        self.exports.check_invariants(&self.config);
        self.imports.check_invariants(&self.config);
        for (_, import) in self.imports.iter() {
            if import.waits_for_grant() {
                let peer = self.peers.get(&import.common().holder);
                assert!(
                    peer.is_some_and(|p| !p.is_dead()),
                    "an import waiting for a grant has a live peer"
                );
            }
        }
    }

    /// Whether this rank is reading the export `key` of `holder` (an import of it is live): a
    /// decline of that export is refused ([`Rejected::ImportInProgress`]).
    pub fn is_reading(&self, key: &PairingKey, holder: &PeerAddr) -> bool {
        self.imports
            .get(key)
            .is_some_and(|import| import.common().holder == *holder)
    }

    /// The state of the live D request of `key`, as text (for the simulator's check that a
    /// stale message changes nothing).
    #[doc(hidden)]
    pub fn decode_state(&self, key: &PairingKey) -> Option<String> {
        self.decodes.get(key).map(|r| format!("{r:?}"))
    }

    /// The registration P holds pending for `key` (waiting for its prefill): who sent it, for
    /// which epoch, until when (for the simulator's check that no freed attempt can still be
    /// written).
    #[doc(hidden)]
    pub fn pending_registration(&self, key: &PairingKey) -> Option<(&PeerAddr, Epoch, Time)> {
        self.prefills.pending_of(key)
    }

    /// Engine ids of every live P request (for leak checks in tests and the simulator).
    pub fn live_prefill_requests(&self) -> impl Iterator<Item = &RequestId> {
        self.prefills.live_request_iter()
    }

    /// Blocks of every live D request (for leak checks in tests and the simulator).
    pub fn live_decode_blocks(&self) -> impl Iterator<Item = (&RequestId, &BlockIds)> {
        self.decodes
            .values()
            .map(|r| (&r.common().request, &r.common().blocks))
    }
}
