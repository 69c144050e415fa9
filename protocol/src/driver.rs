//! `TransportDriver`: the shell's half of the sans-IO contract, without the actor. It turns the
//! endpoint's transport outputs ([`TransportOp`]) into transport calls and everything the
//! transport reports (completions, notifications, refusals) into endpoint [`NetEvent`]s, and it
//! decides what a finished handshake means for the rank ([`handshake_step`]).
//!
//! The actix shells drive it (`TransportActor` owns one; `RankActor` asks [`handshake_step`]);
//! the tests drive it directly over the in-memory transport and its fault switches. Every
//! decision the shell makes lives here, so a test of this type is a test of the shell:
//! - a write that cannot be planned or posted is `WriteFailed(PostFailed)`;
//! - a notification the transport refuses because the peer is unreachable or invalidated is
//!   `PeerLost` (any other send error is counted and dropped: the endpoint's timers cover it);
//! - an abandon the transport refuses changes nothing (the write's end still comes);
//! - a failed transfer is `WriteFailed(TransferFailed)`; bytes that do not decode are
//!   `Malformed`; a notification from an agent the transport does not know is counted and
//!   dropped.
//!
//! A rank whose peers may have another geometry (heterogeneous TP, block size, layout) carries
//! a [`TransferRoute`]: it says which peer geometries the rank accepts at the handshake, and it
//! gives each transfer's descriptors in place of the equal-geometry [`Planner`].

use std::collections::BTreeMap;
use std::sync::Arc;

mod integrity;
mod observe;
mod posting;
mod routing;
mod streams;

pub use integrity::{DigestFn, MAX_TRACKED_REGISTRATIONS};
pub use observe::TransferObserver;
pub use routing::{connected_input, handshake_step, route, HandshakeStep, Routed};

use crate::machine::{NetEvent, ReadOrder, WriteOrder};
use crate::planner::Planner;
use crate::transport::{Completion, Descriptor, Notification, Transport, TransportError};
use crate::{
    wire, AgentName, CompatHash, Handshake, Incarnation, KvGeometry, Message, PeerAddr, RegionDesc,
    RegionSpec, TransferMode, WriteFailure, WriteId, PROTOCOL_VERSION,
};
use integrity::digest_layout;

/// What a rank tells a peer about itself in a handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank.
    pub peer: PeerAddr,
    /// Its transport agent.
    pub agent: AgentName,
    /// Its transport metadata, for `load_remote`.
    pub metadata: Vec<u8>,
    /// Its registered regions, in `KvGeometry::regions` order (a routed rank: its buffers).
    pub regions: Vec<RegionDesc>,
    /// Its transfers are placed by a route ([`Handshake::routed`]).
    pub routed: bool,
    /// Its geometry.
    pub geometry: KvGeometry,
    /// Its compatibility hash.
    pub compat: CompatHash,
    /// Its process run: made when the rank is built, the same in every handshake of the run.
    pub incarnation: Incarnation,
}

impl PeerInfo {
    /// This rank's handshake message, advertising `modes`, stamped with `clock_sample_us`, for
    /// the connection traced by `trace_id` (the dialler's, which the answer repeats).
    pub fn handshake(
        &self,
        modes: Vec<TransferMode>,
        clock_sample_us: u64,
        trace_id: crate::TraceId,
    ) -> Handshake {
        Handshake {
            protocol_version: PROTOCOL_VERSION,
            engine_id: self.peer.engine.clone(),
            incarnation: self.incarnation,
            agent_name: self.agent.clone(),
            agent_metadata: self.metadata.clone(),
            regions: self.regions.clone(),
            routed: self.routed,
            geometry: self.geometry.clone(),
            compat_hash: self.compat,
            modes,
            clock_sample_us,
            trace_id,
        }
    }

    /// The peer a received handshake describes: rank = its geometry's
    /// [`rank_index`](KvGeometry::rank_index) (the TP rank, with one pipeline stage).
    pub fn from_handshake(handshake: Handshake) -> PeerInfo {
        PeerInfo {
            peer: PeerAddr::new(handshake.engine_id, handshake.geometry.rank_index()),
            agent: handshake.agent_name,
            metadata: handshake.agent_metadata,
            regions: handshake.regions,
            routed: handshake.routed,
            geometry: handshake.geometry,
            compat: handshake.compat_hash,
            incarnation: handshake.incarnation,
        }
    }
}

/// What a [`TransferRoute`] is asked to place: one write (this rank is P) or one read (this
/// rank is the reader) with a peer.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Whether the bytes go from this rank to the peer (a write) or come back (a read).
    pub direction: RouteDirection,
    /// The peer.
    pub peer: &'a PeerInfo,
    /// The pairing key the transfer serves.
    pub key: &'a crate::PairingKey,
    /// Its epoch.
    pub epoch: crate::Epoch,
    /// This rank's logical block ids.
    pub local: &'a crate::BlockIds,
    /// The peer's logical block ids.
    pub remote: &'a crate::BlockIds,
    /// Where the peer said the bytes are: for a write to a routed D, where its registration
    /// said the pieces may land ([`Register::memory`](crate::Register::memory)); for a read
    /// from a routed holder, where its grant said the blocks are
    /// ([`ReadGrant::memory`](crate::ReadGrant::memory)); empty otherwise.
    pub remote_memory: &'a [crate::MemorySpan],
}

/// Which way a routed transfer moves its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteDirection {
    /// From this rank's memory into the peer's.
    Write,
    /// From the peer's memory into this rank's.
    Read,
}

/// Why a [`TransferRoute`] refused a peer or a transfer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RouteError(pub String);

/// How a rank pairs with peers whose geometry differs from its own, and where the bytes of
/// such a transfer are.
///
/// The equal-geometry rules (the same per-rank layout on both sides, descriptors planned from
/// the two region tables) need no route. A heterogeneous pair does: which P rank writes which
/// heads, layers and byte ranges of which D rank, through which staging memory, is a plan of
/// both sides' geometries (`kvhandoff_protocol::hetero`), and only the rank's owner knows where
/// its staging memory is. The link asks [`TransferRoute::accepts`] at the handshake (instead of
/// demanding the same layout); the driver asks [`TransferRoute::descriptors`] for every transfer
/// (instead of the planner). A transfer the route refuses fails as `WriteFailed(PostFailed)`,
/// as an unplannable one always did, so the protocol's failure paths cover it.
///
/// ```
/// use kvhandoff_protocol::driver::{RouteError, RouteRequest, TransferRoute};
/// use kvhandoff_protocol::planner::Descriptor;
/// use kvhandoff_protocol::KvGeometry;
///
/// /// Accepts nobody different, places nothing.
/// struct SameOnly;
/// impl TransferRoute for SameOnly {
///     fn accepts(&self, own: &KvGeometry, peer: &KvGeometry) -> Result<(), RouteError> {
///         if own == peer { Ok(()) } else { Err(RouteError("geometry differs".into())) }
///     }
///     fn descriptors(&self, _: &RouteRequest<'_>, _: &mut Vec<Descriptor>) -> Result<(), RouteError> {
///         Err(RouteError("nothing to place".into()))
///     }
/// }
/// ```
pub trait TransferRoute: Send + Sync {
    /// Whether this rank (geometry `own`) may pair with a peer of geometry `peer`; the
    /// compatibility hash (the same model) is checked before, by the caller.
    ///
    /// # Errors
    /// [`RouteError`] saying why the pair cannot work.
    fn accepts(&self, own: &crate::KvGeometry, peer: &crate::KvGeometry) -> Result<(), RouteError>;

    /// Appends the descriptors of one transfer to `out` (local addresses in this rank's
    /// registered memory, remote in the peer's).
    ///
    /// # Errors
    /// [`RouteError`] for a transfer the route cannot place (its blocks are not the ones the
    /// rank planned, an unknown key); nothing may be appended then.
    fn descriptors(
        &self,
        request: &RouteRequest<'_>,
        out: &mut Vec<Descriptor>,
    ) -> Result<(), RouteError>;

    /// The memory this rank names for `key`: as D, in its registration
    /// ([`Register::memory`](crate::Register::memory)), where a writer of another process may
    /// place the request's pieces; as a holder, in its grant
    /// ([`ReadGrant::memory`](crate::ReadGrant::memory)), where a reader of another process
    /// finds the blocks' bytes. Asked each time such a message is sent (a repeat names the
    /// same); the default names none, for a peer that knows this rank's memory by itself.
    fn named_memory(&self, key: &crate::PairingKey) -> Vec<crate::MemorySpan> {
        let _ = key;
        Vec::new()
    }
}

/// A shared [`TransferRoute`]: the link and the transport of one rank hold the same one.
pub type SharedRoute = Arc<dyn TransferRoute>;

/// One thing the rank actor asks the transport actor to do.
#[derive(Debug)]
pub enum TransportOp {
    /// Encode and send a control message as a notification.
    Send {
        /// The peer.
        to: PeerAddr,
        /// The message.
        message: Message,
    },
    /// Plan and post a write.
    PostWrite(Box<WriteOrder>),
    /// Post the next layers, `from .. to`, of a layer-wise write.
    ExtendWrite {
        /// The write.
        write: WriteId,
        /// First layer of the part.
        from: u32,
        /// End of the part.
        to: u32,
    },
    /// Plan and post a read.
    PostRead(Box<ReadOrder>),
    /// Make sure a write never lands.
    Abandon(WriteId),
    /// Cut a dead peer off.
    Invalidate(PeerAddr),
}

/// What the transport actor did, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Writes posted.
    pub posted: u64,
    /// Descriptors posted, over all writes.
    pub descriptors: u64,
    /// Bytes posted, over all writes.
    pub bytes: u64,
    /// Writes that failed to plan or post.
    pub post_failures: u64,
    /// Notifications that could not be sent.
    pub send_failures: u64,
    /// Notifications from agents the transport does not know.
    pub unknown_senders: u64,
    /// Writes whose landed bytes did not match their integrity digests (D), or whose
    /// registration was unknown when their completion arrived.
    pub digest_mismatches: u64,
}

/// The transport of one rank and what the shell knows around it: the rank's own handshake
/// payload, the peers loaded, the planner and its buffers.
pub struct TransportDriver<T: Transport> {
    transport: T,
    own: PeerInfo,
    specs: Vec<RegionSpec>,
    peers: BTreeMap<PeerAddr, PeerInfo>,
    planner: Planner,
    route: Option<SharedRoute>,
    descriptors: Vec<Descriptor>,
    completions: Vec<Completion>,
    notifications: Vec<Notification>,
    stats: TransportStats,
    streams: streams::Streams,
    observer: Option<Box<dyn TransferObserver>>,
    integrity: Option<integrity::Integrity>,
}

impl<T: Transport + std::fmt::Debug> std::fmt::Debug for TransportDriver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportDriver")
            .field("transport", &self.transport)
            .field("peers", &self.peers.keys().collect::<Vec<_>>())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> TransportDriver<T> {
    /// A driver for `transport`, whose registered regions `own` describes.
    pub fn new(transport: T, own: PeerInfo) -> Self {
        // The rank's own geometry was validated before its regions were registered.
        let specs = own.geometry.regions().unwrap_or_default();
        TransportDriver {
            transport,
            own,
            specs,
            peers: BTreeMap::new(),
            planner: Planner::new(),
            route: None,
            descriptors: Vec::new(),
            completions: Vec::new(),
            notifications: Vec::new(),
            stats: TransportStats::default(),
            streams: streams::Streams::default(),
            observer: None,
            integrity: None,
        }
    }

    /// Tells `observer` about every transfer from now on (see [`TransferObserver`]).
    pub fn set_observer(&mut self, observer: Box<dyn TransferObserver>) {
        self.observer = Some(observer);
    }

    /// Places every transfer with `route` instead of the equal-geometry planner (see
    /// [`TransferRoute`]).
    pub fn set_route(&mut self, route: SharedRoute) {
        self.route = Some(route);
    }

    /// Turns integrity digests on (`Config::integrity_digest`, see [`crate::integrity`]): P's
    /// writes carry digests of their blocks made with `hash` from the transport's
    /// [`Transport::read_local`], and D checks the blocks of every write that lands against
    /// them, reporting a mismatch as [`NetEvent::DigestMismatch`]. Only for equal-geometry
    /// ranks (no [`TransferRoute`]).
    pub fn set_integrity(&mut self, hash: DigestFn) {
        self.integrity = Some(integrity::Integrity::new(hash));
    }

    /// The transport, for what the shell sets up around it (an arrival hook).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// What the driver did so far.
    pub fn stats(&self) -> TransportStats {
        self.stats
    }

    /// Prepares the rank's own block lists (an optimisation: without them posts take the
    /// dynamic path).
    pub fn prepare_own(&mut self) {
        if let Err(error) = self.transport.prepare_blocks(None, &self.own.regions) {
            tracing::warn!(%error, "own region table not prepared; posting dynamically");
        }
    }

    /// Loads a handshaken peer, replacing whatever incarnation of it was loaded.
    ///
    /// # Errors
    /// The transport's refusal (bad metadata, a conflicting agent, too many peers).
    pub fn load_peer(&mut self, info: PeerInfo) -> Result<(), TransportError> {
        self.transport.invalidate_remote(&info.peer);
        self.transport
            .load_remote(&info.peer, &info.agent, &info.metadata)?;
        if let Err(error) = self
            .transport
            .prepare_blocks(Some(&info.peer), &info.regions)
        {
            tracing::warn!(peer = %info.peer, %error, "peer region table not prepared; posting dynamically");
        }
        self.peers.insert(info.peer.clone(), info);
        Ok(())
    }

    /// Performs one operation; what it means for the endpoint goes to `feed`.
    pub fn perform(&mut self, op: TransportOp, feed: &mut Vec<NetEvent>) {
        match op {
            TransportOp::Send { to, mut message } => {
                // The machines leave the memory out: only the route knows where it is.
                match (&mut message, &self.route) {
                    (Message::Register(register), Some(route)) => {
                        register.memory = route.named_memory(&register.key);
                    }
                    (Message::ReadGrant(grant), Some(route)) => {
                        grant.memory = route.named_memory(&grant.key);
                    }
                    _ => {}
                }
                if let Some(integrity) = self.integrity.as_mut() {
                    integrity.sending(&to, &message);
                }
                let bytes = wire::encode(&message);
                if let Err(error) = self.transport.send_notification(&to, bytes) {
                    tracing::debug!(peer = %to, %error, "notification not sent");
                    self.stats.send_failures += 1;
                    // As vLLM: a heartbeat that could not be sent is not a failed notification
                    // (the peer's liveness deadline covers it).
                    if !matches!(message, Message::Heartbeat(_)) {
                        self.observe(|o| o.notification_failed(&error));
                    }
                    if matches!(
                        error,
                        TransportError::PeerUnreachable { .. }
                            | TransportError::PeerInvalidated { .. }
                    ) {
                        feed.push(NetEvent::PeerLost { peer: to });
                    }
                }
            }
            TransportOp::PostWrite(mut order) => feed.extend(match order.stream {
                Some(stream) => self.post_stream(&order, stream),
                None => self.post(&mut order),
            }),
            TransportOp::ExtendWrite { write, from, to } => {
                tracing::trace!(%write, from, to, "write part");
                let layout = digest_layout(&self.own, &self.specs);
                let digests = self.integrity.as_mut().map(|i| (i, &layout));
                let end = self.streams.extend(&mut self.transport, write, to, digests);
                self.observe_end(end.as_ref());
                feed.extend(end);
            }
            TransportOp::PostRead(order) => feed.extend(self.post_read(&order)),
            TransportOp::Abandon(write) => {
                if let Some(end) = self.streams.abandon(&mut self.transport, write) {
                    self.observe_end(end.as_ref());
                    feed.extend(end);
                } else {
                    self.abandon(write, feed);
                }
            }
            TransportOp::Invalidate(peer) => {
                if let Some(integrity) = self.integrity.as_mut() {
                    integrity.forget_peer(&peer);
                }
                self.transport.invalidate_remote(&peer);
                self.peers.remove(&peer);
            }
        }
    }

    fn abandon(&mut self, write: WriteId, feed: &mut Vec<NetEvent>) {
        match self.transport.abandon_write(write) {
            Ok(()) => {}
            // Nothing is in flight under the id: its end was reported already (then this
            // second report is dropped as unknown) or it was never posted. Either way it
            // will never land: say so, or the machine waiting for it waits forever.
            Err(TransportError::UnknownWrite { .. }) => feed.push(NetEvent::WriteFailed {
                write,
                failure: WriteFailure::TransferFailed,
            }),
            // On refusal the write stays in flight and its completion still comes.
            Err(error) => tracing::warn!(%write, %error, "abandon refused"),
        }
    }

    /// Collects what the transport reports (write ends, notifications) into `feed`.
    pub fn poll(&mut self, feed: &mut Vec<NetEvent>) {
        self.transport.poll_completions(&mut self.completions);
        // Taken out (and put back, its capacity kept) so that the observer may be told of each.
        let mut completions = std::mem::take(&mut self.completions);
        for completion in completions.drain(..) {
            if self.streams.owns_part(completion.write) {
                let ok = completion.result.is_ok();
                let end = self.streams.part_ended(completion.write, ok);
                self.observe_end(end.as_ref());
                feed.extend(end);
                continue;
            }
            let (write, ok) = (completion.write, completion.result.is_ok());
            self.observe(|o| o.ended(write, ok));
            feed.push(match completion.result {
                Ok(()) => NetEvent::WriteCompleted {
                    write: completion.write,
                },
                Err(error) => {
                    tracing::debug!(write = %completion.write, %error, "write failed");
                    NetEvent::WriteFailed {
                        write: completion.write,
                        failure: WriteFailure::TransferFailed,
                    }
                }
            });
        }
        self.completions = completions;
        self.transport.poll_notifications(&mut self.notifications);
        for note in self.notifications.drain(..) {
            let Some(from) = note.peer else {
                self.stats.unknown_senders += 1;
                continue;
            };
            let message = match wire::decode(&note.bytes) {
                Ok(message) => message,
                Err(error) => {
                    feed.push(NetEvent::Malformed {
                        from: Some(from),
                        error,
                    });
                    continue;
                }
            };
            feed.extend(match self.integrity.as_mut() {
                Some(integrity) => {
                    let layout = digest_layout(&self.own, &self.specs);
                    let mismatches = &mut self.stats.digest_mismatches;
                    integrity.screen(&self.transport, &layout, from, message, mismatches)
                }
                None => Some(NetEvent::Received { from, message }),
            });
        }
    }
}
