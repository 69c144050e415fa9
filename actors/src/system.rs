//! The actix shells around the pure machines.
//!
//! Per engine rank there are three actors, and they only translate:
//! - [`RankActor`] hosts the rank's [`kvhandoff_protocol::machine::Endpoint`]: engine calls
//!   become `handle_call(..)`; decoded messages, completions and handshake results become
//!   `handle_event(..)`; it keeps one timer at `poll_timeout()`; its outputs go to the other two
//!   actors or to the engine's event queue.
//! - [`TransportActor`] owns the rank's [`crate::transport::Transport`] and alone calls
//!   it: it plans and posts writes, sends notifications, abandons and invalidates, and polls
//!   completions and notifications back into the rank actor.
//! - [`LinkActor`] makes the peer connections: it runs the handshake (through an in-process
//!   [`Directory`], or across processes through the TCP side channel, see [`side_channel`]) and
//!   loads the peer into the transport actor's transport.
//!
//! No routing or matching happens here: everything is decided by the endpoint.

pub mod blocking;
mod build;
mod clock;
mod link;
pub mod messages;
mod rank;
mod regions;
mod runtime;
pub mod side_channel;
mod transport_actor;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use actix::{Actor, Addr, AsyncContext, Recipient};
use kvhandoff_protocol::driver::PeerInfo;

pub use build::{
    agent_name, build_mem_rank, build_rank, build_rank_on_regions, build_routed_rank,
    build_routed_rank_on_regions, BuildError, KvPool, RankMemory, RegionBytes, RegionProblem,
    RoutedRegion, MAX_POOL_BLOCKS, MAX_ROUTED_REGIONS,
};
pub use clock::process_clock;
pub use link::LinkActor;
pub use messages::{
    AddPeerAddress, Call, Calls, ClockMeasured, ConfigureSession, Connect, Expecting, Feed, Hello,
    LinkUp, LoadPeer, QueryCounters, QuerySideChannel, QueryStats, QueryTransportStats, SetLinks,
    SetTurnLinks, TransportOps, Verdict, Verdicts,
};
pub use rank::RankActor;
pub use regions::{AdoptError, AdoptMemory, KvRegion, MemoryLocation};
pub use runtime::{Runtime, RuntimeError};
pub use side_channel::{
    AcceptPolicy, AuthFailure, ClockEstimate, HandshakeError, PeerBook, PeerBookFull, Psk,
    PskError, RejectReason, SideChannelConfig, SideChannelStats, MAC_LEN, NONCE_LEN, PSK_MAX_LEN,
    PSK_MIN_LEN,
};
pub use transport_actor::TransportActor;

use crate::transport::Transport;
use kvhandoff_protocol::machine::{Counters, Endpoint, EndpointStats};
use kvhandoff_protocol::session::{ConnectorEvent, ConnectorIdentity, ConnectorSettings, Session};
use kvhandoff_protocol::PeerAddr;

/// Where in-process ranks find each other: a shared table of handshake payloads and link
/// actors. (Across processes the TCP side channel plays this role.)
#[derive(Clone, Default)]
pub struct Directory {
    inner: Arc<Mutex<DirectoryTable>>,
}

type DirectoryTable = BTreeMap<PeerAddr, (PeerInfo, Recipient<Hello>)>;

impl Directory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    fn publish(&self, info: PeerInfo, link: Recipient<Hello>) {
        if let Ok(mut table) = self.inner.lock() {
            table.insert(info.peer.clone(), (info, link));
        }
    }

    fn lookup(&self, peer: &PeerAddr) -> Option<(PeerInfo, Recipient<Hello>)> {
        self.inner.lock().ok()?.get(peer).cloned()
    }

    /// Removes a rank (its process "died"); later handshakes with it fail.
    pub fn withdraw(&self, peer: &PeerAddr) {
        if let Ok(mut table) = self.inner.lock() {
            table.remove(peer);
        }
    }
}

/// Tuning of the shells (the protocol's own deadlines live in the endpoint's `Config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellConfig {
    /// How often the transport actor polls its transport for completions and notifications.
    pub poll_interval: std::time::Duration,
    /// How long a handshake may take before it is reported failed: in process, the peer's
    /// answer; over TCP, each side's whole part (the initiator's from its dial to its rank's
    /// load of the peer, the listener's from the accept to its answer), so a peer that stalls
    /// for less than this is waited for. The endpoint's own deadline for a peer connection is
    /// `Config::connect_timeout`: keep it at least this long, or it gives up first.
    pub handshake_timeout: std::time::Duration,
}

impl Default for ShellConfig {
    fn default() -> Self {
        Self {
            poll_interval: std::time::Duration::from_micros(200),
            handshake_timeout: std::time::Duration::from_secs(5),
        }
    }
}

/// How a rank finds its peers and hands them its handshake.
#[derive(Clone)]
pub enum Handshaker {
    /// In process: through a shared [`Directory`].
    InProcess(Directory),
    /// Across processes: through a TCP side channel listening on `config.listen`; peers'
    /// addresses come from [`AddPeerAddress`].
    Tcp(SideChannelConfig),
}

/// The addresses of one running rank.
pub struct RankHandle {
    /// The rank actor (engine calls go here).
    pub rank: Addr<RankActor>,
    /// The rank's link actor ([`AddPeerAddress`], [`QuerySideChannel`] go here).
    pub link: Addr<LinkActor>,
    /// Where the rank's TCP side channel listens (the bound address, so port 0 is resolved);
    /// `None` for an in-process rank.
    pub side_channel: Option<std::net::SocketAddr>,
    /// Where engine calls go, type-erased.
    pub calls: Recipient<Call>,
    /// Where batches of engine calls go, type-erased.
    pub batches: Recipient<Calls>,
    /// The rank's transport actor, for its counters ([`QueryTransportStats`]).
    pub transport: Recipient<QueryTransportStats>,
    /// The engine's events.
    pub events: tokio::sync::mpsc::UnboundedReceiver<ConnectorEvent>,
}

impl RankHandle {
    /// The rank's endpoint counters, or `None` if the rank did not answer within `timeout`.
    /// Blocks the calling thread: never call it from the runtime's own threads.
    pub fn counters(&self, timeout: std::time::Duration) -> Option<Counters> {
        blocking::ask(&self.rank, QueryCounters, timeout)
    }

    /// The sizes of the rank's tables, or `None` if the rank did not answer within `timeout`.
    pub fn stats(&self, timeout: std::time::Duration) -> Option<EndpointStats> {
        blocking::ask(&self.rank, QueryStats, timeout)
    }

    /// The side channel's counters, or `None` if the link did not answer within `timeout`.
    pub fn side_channel_stats(&self, timeout: std::time::Duration) -> Option<SideChannelStats> {
        blocking::ask(&self.link, QuerySideChannel, timeout)
    }
}

/// Everything needed to start one rank.
pub struct RankSetup<T: Transport> {
    /// The rank's protocol state machine.
    pub endpoint: Endpoint,
    /// The rank's transport, with its regions already registered.
    pub transport: T,
    /// The rank's handshake payload (its own regions, geometry, metadata).
    pub info: PeerInfo,
    /// Shell tuning.
    pub shell: ShellConfig,
    /// How the rank pairs with peers of another geometry and places their transfers; `None`:
    /// only peers of its own per-rank layout, transfers planned from the region tables. Used
    /// by in-process ranks (the TCP side channel still demands the same layout).
    pub route: Option<kvhandoff_protocol::driver::SharedRoute>,
}

/// Where a rank's actors run on a [`Runtime`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Placement {
    /// On the runtime's own thread, beside its other shared ranks.
    #[default]
    Shared,
    /// On a new thread of its own: ranks placed this way run in parallel, the way ranks of
    /// separate engine processes do.
    OwnThread,
    /// The rank on one new thread and its transport actor (posting, sending, polling) on
    /// another, so that the endpoint's work and the transport's run in parallel.
    OwnThreads,
}

/// How [`Runtime::add_rank`] starts a rank: how it meets its peers, and where it runs.
///
/// ```
/// use kvhandoff_actors::system::{Placement, RankOptions};
/// let options = RankOptions { placement: Placement::OwnThreads, ..RankOptions::default() };
/// assert!(options.handshaker.is_none()); // in process, through the runtime's directory
/// ```
#[derive(Clone, Default)]
pub struct RankOptions {
    /// How the rank meets its peers; `None`: in process, through the runtime's [`Directory`].
    pub handshaker: Option<Handshaker>,
    /// Where its actors run.
    pub placement: Placement,
}

/// Starts the three actors of one rank in the running actix system: the rank and link actors
/// on the current arbiter, the transport actor there too or on `transport_arbiter`. An
/// in-process rank is published in its [`Directory`]; for [`Handshaker::Tcp`] the listener is
/// bound before anything starts, and [`RankHandle::side_channel`] reports where. (Engines use
/// [`Runtime::add_rank`], which calls this on the runtime's threads.)
///
/// # Errors
/// For [`Handshaker::Tcp`]: the address cannot be bound, or the rank's own handshake breaks
/// the wire limits (`InvalidInput`). [`Handshaker::InProcess`] never fails.
pub fn start_rank<T>(
    setup: RankSetup<T>,
    handshaker: Handshaker,
    transport_arbiter: Option<&actix::ArbiterHandle>,
) -> std::io::Result<RankHandle>
where
    T: Transport + Unpin + Send + 'static,
{
    let start_transport = |actor: TransportActor<T>| match transport_arbiter {
        Some(arbiter) => TransportActor::start_in_arbiter(arbiter, move |_| actor),
        None => actor.start(),
    };
    match handshaker {
        Handshaker::InProcess(directory) => Ok(spawn_rank(
            setup,
            link::LinkMode::InProcess(directory),
            None,
            start_transport,
        )),
        Handshaker::Tcp(config) => {
            let budget = setup.shell.handshake_timeout;
            side_channel::Local::new(setup.info.clone(), config.clone(), budget, None)
                .check_own()?;
            let (listener, addr) = side_channel::bind(config.listen)?;
            let mode = link::LinkMode::Tcp {
                listener: Some(listener),
                config,
            };
            Ok(spawn_rank(setup, mode, Some(addr), start_transport))
        }
    }
}

fn spawn_rank<T>(
    setup: RankSetup<T>,
    mode: link::LinkMode,
    listen: Option<std::net::SocketAddr>,
    start_transport: impl FnOnce(TransportActor<T>) -> actix::Addr<TransportActor<T>>,
) -> RankHandle
where
    T: Transport + Unpin + 'static,
{
    let RankSetup {
        mut endpoint,
        transport,
        info,
        shell,
        route,
    } = setup;
    // A random seed per process run: a restarted rank's trace ids never repeat its last run's.
    endpoint.set_trace_seed(kvhandoff_protocol::TraceId::random().as_u128());
    let (events_tx, events) = tokio::sync::mpsc::unbounded_channel();
    let counter = crate::metrics::EventCounter::new(
        (0..info.geometry.cache_groups.len())
            .map(|group| info.geometry.logical_block_bytes(group).unwrap_or(0))
            .collect(),
    );
    // The rank's address exists before the rank does, so its transport actor and link can be wired
    // to it first.
    let rank_ctx = actix::Context::<RankActor>::new();
    let rank_addr = rank_ctx.address();
    let transport = start_transport(TransportActor::new(
        transport,
        info.clone(),
        rank_addr.clone().recipient(),
        shell.poll_interval,
        route.clone(),
        endpoint.config().integrity_digest,
    ));
    let directory = match &mode {
        link::LinkMode::InProcess(directory) => Some(directory.clone()),
        link::LinkMode::Tcp { .. } => None,
    };
    let link = LinkActor::new(
        info.clone(),
        mode,
        listen,
        link::RankInbox {
            up: rank_addr.clone().recipient(),
            feed: rank_addr.clone().recipient(),
            clocks: rank_addr.clone().recipient(),
        },
        shell.handshake_timeout,
        route,
    )
    .start();
    if let Some(directory) = directory {
        directory.publish(info, link.clone().recipient());
    }
    let transport_ops = transport.clone().recipient();
    let loader = transport.clone().recipient();
    // Until the engine's connector configures it: the endpoint's own name, TP 1, the side
    // channel's address, default settings.
    let own = endpoint.address().clone();
    let mut identity = ConnectorIdentity::in_process(own.engine, own.rank, 1);
    if let Some(addr) = listen {
        identity.host = addr.ip().to_string();
        identity.port = addr.port();
    }
    let mut session = Session::new(endpoint, identity, ConnectorSettings::default());
    session.set_peer_addresses(listen.is_some());
    let rank = rank_ctx.run(RankActor::new(
        session,
        rank::TransportInbox {
            ops: transport_ops,
            expecting: transport.clone().recipient(),
        },
        loader,
        link.clone().recipient(),
        link.clone().recipient(),
        events_tx,
        counter,
    ));
    let transport = transport.recipient();
    RankHandle {
        calls: rank.clone().recipient(),
        batches: rank.clone().recipient(),
        transport,
        rank,
        link,
        side_channel: listen,
        events,
    }
}
