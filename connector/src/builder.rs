//! [`RankBuilder`]: one engine rank, started from what the engine has — its identity, geometry,
//! model, its own KV memory, a transport and a side channel — in one call.
//!
//! What it assembles (the pieces a harness would otherwise wire by hand): the transport's agent
//! (named after the engine and rank), the rank's regions (the engine's memory, registered as it
//! is: [`KvRegion`]), its endpoint and handshake, its actors on a [`Runtime`]
//! ([`Runtime::add_rank`]), the side channel (TCP or in process), the peers' addresses, the
//! [`ConnectorIdentity`] and [`ConnectorSettings`], and — for a pair of engines of different
//! geometries — the rank's [`PlannedRoute`] and [`RankLinks`](crate::RankLinks).

use std::net::SocketAddr;
use std::sync::Arc;

use kvhandoff_actors::system::{
    agent_name, build_rank_on_regions, build_routed_rank_on_regions, AdoptMemory, BuildError,
    Handshaker, KvRegion, Placement, Psk, RankOptions, RankSetup, RoutedRegion, RuntimeError,
    ShellConfig, SideChannelConfig,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_actors::transport::TransportError;
use kvhandoff_protocol::hetero::{PairPlan, SideName};
use kvhandoff_protocol::machine::{BlockPairing, Config};
use kvhandoff_protocol::{EngineId, IdError, KvGeometry, ModelIdentity, PeerAddr};

use crate::route::PlannedRoute;
use crate::settings::{RankSettings, SettingsError};
use crate::{
    ConnectorError, ConnectorIdentity, ConnectorSettings, KvCache, KvConnector, RankLinks, Runtime,
};

mod rank;

pub use rank::EngineRank;

/// What a rank's bytes travel over.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum TransportKind {
    /// The in-memory transport: an agent on this fabric (share one fabric between the ranks of
    /// one process that talk to each other). Host memory only.
    Mem(MemFabric),
    /// NIXL (UCX), with this configuration (cargo feature `nixl`; run with the environment of
    /// `scripts/nixl-env.sh`). Host memory for now.
    #[cfg(feature = "nixl")]
    Nixl(kvhandoff_actors::transport::nixl::NixlConfig),
}

impl TransportKind {
    /// NIXL with its default configuration.
    #[cfg(feature = "nixl")]
    pub fn nixl() -> TransportKind {
        TransportKind::Nixl(kvhandoff_actors::transport::nixl::NixlConfig::default())
    }
}

/// How a rank meets its peers.
#[derive(Clone, Debug, Default)]
pub enum SideChannel {
    /// In process, through the [`Runtime`]'s directory: every peer must be a rank of the same
    /// runtime ([`RankBuilder::start_on`]).
    #[default]
    InProcess,
    /// A TCP side channel with this configuration (listen address, timeouts, accepted
    /// engines...). A rank takes handshakes only from engines it knows
    /// ([`RankBuilder::peer`], [`EngineRank::add_peer`], or the parameters of a call) unless
    /// the configuration's `accept` says otherwise.
    Tcp(SideChannelConfig),
}

impl SideChannel {
    /// A TCP side channel listening on `listen` (port 0: any free port; see
    /// [`EngineRank::side_channel`]), with the default configuration.
    pub fn tcp(listen: SocketAddr) -> SideChannel {
        SideChannel::Tcp(SideChannelConfig::new(listen))
    }

    /// This side channel with every handshake authenticated by the pre-shared key `psk`
    /// ([`SideChannelConfig::psk`]: HMAC-SHA256 challenge–response; every peer needs the same
    /// key). In-process ranks share one runtime and exchange nothing over a network: for
    /// [`SideChannel::InProcess`] the key is not used.
    ///
    /// ```
    /// use kvhandoff::{Psk, SideChannel};
    /// let key = Psk::new(*b"a key of 16 byte").unwrap();
    /// let side = SideChannel::tcp("127.0.0.1:0".parse().unwrap()).with_psk(key.clone());
    /// assert!(matches!(side, SideChannel::Tcp(c) if c.psk == Some(key)));
    /// ```
    pub fn with_psk(self, psk: Psk) -> SideChannel {
        match self {
            SideChannel::InProcess => SideChannel::InProcess,
            SideChannel::Tcp(config) => SideChannel::Tcp(SideChannelConfig {
                psk: Some(psk),
                ..config
            }),
        }
    }
}

/// Why a rank could not start. Nothing is left running or registered after any of them: the
/// engine's memory is dropped (or, for a raw region, its owner).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No transport was chosen ([`RankBuilder::transport`]).
    #[error("no transport: call RankBuilder::transport")]
    NoTransport,
    /// The rank could not be built: a region that does not fit the geometry, memory the
    /// transport cannot register, an invalid geometry or configuration, a transport refusal.
    #[error("build: {0}")]
    Build(#[from] BuildError),
    /// The transport's agent could not be created.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// The agent name derived from the engine id is invalid.
    #[error("agent name: {0}")]
    Id(#[from] IdError),
    /// The runtime is gone, or the side channel could not listen.
    #[error("runtime: {0}")]
    Runtime(#[from] RuntimeError),
    /// The heterogeneous pairing does not fit this rank.
    #[error("pairing: {0}")]
    Pairing(String),
    /// The rank's link did not take a peer's address (its book is full, or it did not answer).
    #[error("the rank did not take the address of {engine}")]
    Peer {
        /// The peer engine.
        engine: EngineId,
    },
    /// The connector refused the pairing's links.
    #[error("connector: {0}")]
    Connector(#[from] ConnectorError),
    /// A handshake made ahead of the first request ([`EngineRank::warm_up`]) failed.
    #[error("warming up the connection to {peer} failed: {why}")]
    WarmUp {
        /// The peer rank.
        peer: PeerAddr,
        /// What happened.
        why: String,
    },
}

/// A heterogeneous pairing: this rank is on `side` of `plan`.
#[derive(Clone, Debug)]
struct Pairing {
    plan: PairPlan,
    side: SideName,
}

/// Builds and starts one engine rank on the engine's own memory.
///
/// Required: the engine's id, geometry (its `tp_rank`/`tp_size`/`pp_*` are the rank's identity)
/// and model; its regions ([`RankBuilder::region`]: one per
/// [`RegionSpec`](kvhandoff_protocol::RegionSpec) of [`KvGeometry::regions`], in that order,
/// each the same whole number of logical blocks); a transport. Optional: the side channel
/// (default in process), the protocol [`Config`], peers' addresses, a heterogeneous pairing,
/// shell tuning and placement.
///
/// ```
/// use kvhandoff::{
///     Config, EngineId, KvGeometry, KvLayout, KvRegion, MemFabric, ModelIdentity, RankBuilder,
///     Runtime, TransportKind,
/// };
///
/// let geometry = KvGeometry::dense(2, 2, 16, 2, 4, KvLayout::Hnd); // 2 layers: 4 regions
/// let blocks = 8;
/// let regions = geometry.regions().unwrap().iter().map(|spec| {
///     // The engine's own memory, handed over (no copy).
///     KvRegion::new(vec![0u8; (spec.block_len * blocks) as usize])
/// }).collect::<Vec<_>>();
/// let model = ModelIdentity {
///     model: "my-model".into(),
///     dtype: "bfloat16".into(),
///     cache_dtype: "bfloat16".into(),
/// };
/// let mut runtime = Runtime::start().unwrap();
/// let fabric = MemFabric::new();
/// let rank = RankBuilder::new(EngineId::new("prefill-0").unwrap(), geometry, model)
///     .regions(regions)
///     .transport(TransportKind::Mem(fabric))
///     .config(Config::default())
///     .start_on(&mut runtime)
///     .unwrap();
/// assert_eq!(rank.kv().logical_blocks(), blocks as u32);
/// rank.kv().write_block(0, 3, &vec![7u8; rank.kv().block_len(0).unwrap() as usize]).unwrap();
/// drop(rank);
/// runtime.shutdown();
/// ```
#[derive(Debug)]
pub struct RankBuilder {
    engine: EngineId,
    geometry: KvGeometry,
    model: ModelIdentity,
    regions: Vec<KvRegion>,
    transport: Option<TransportKind>,
    side_channel: SideChannel,
    advertise_host: Option<String>,
    config: Config,
    settings: Option<ConnectorSettings>,
    peers: Vec<(EngineId, SocketAddr)>,
    warm_peers: bool,
    pairing: Option<Pairing>,
    shell: ShellConfig,
    placement: Placement,
}

impl RankBuilder {
    /// A builder for the rank of `engine` with `geometry` (whose TP/PP sizes and ranks say which
    /// rank) serving `model`.
    pub fn new(engine: EngineId, geometry: KvGeometry, model: ModelIdentity) -> RankBuilder {
        RankBuilder {
            engine,
            geometry,
            model,
            regions: Vec::new(),
            transport: None,
            side_channel: SideChannel::InProcess,
            advertise_host: None,
            config: Config::default(),
            settings: None,
            peers: Vec::new(),
            warm_peers: false,
            pairing: None,
            shell: ShellConfig::default(),
            placement: Placement::Shared,
        }
    }

    /// Adds the next region of the engine's KV cache (in [`KvGeometry::regions`] order).
    pub fn region(mut self, region: KvRegion) -> RankBuilder {
        self.regions.push(region);
        self
    }

    /// Adds the next regions, in order.
    pub fn regions(mut self, regions: impl IntoIterator<Item = KvRegion>) -> RankBuilder {
        self.regions.extend(regions);
        self
    }

    /// What the bytes travel over (required).
    pub fn transport(mut self, transport: TransportKind) -> RankBuilder {
        self.transport = Some(transport);
        self
    }

    /// How the rank meets its peers (default: in process).
    pub fn side_channel(mut self, side_channel: SideChannel) -> RankBuilder {
        self.side_channel = side_channel;
        self
    }

    /// The host the rank's answers advertise for its side channel (`remote_host` of the
    /// parameters it returns). Default: the address the side channel bound (for an
    /// unspecified address such as `0.0.0.0`, set this to one peers can reach).
    pub fn advertise_host(mut self, host: impl Into<String>) -> RankBuilder {
        self.advertise_host = Some(host.into());
        self
    }

    /// The protocol's configuration (default [`Config::default`]).
    pub fn config(mut self, config: Config) -> RankBuilder {
        self.config = config;
        self
    }

    /// The connector's settings (default: [`ConnectorSettings::new`] of the configuration and
    /// geometry).
    pub fn connector_settings(mut self, settings: ConnectorSettings) -> RankBuilder {
        self.settings = Some(settings);
        self
    }

    /// Everything [`RankSettings`] holds — the protocol's configuration, the connector's
    /// settings for this builder's geometry and the shell tuning — in one call, e.g. from a
    /// file and the environment ([`RankSettings::load`]). Fails when the settings contradict
    /// each other; a later [`config`](Self::config), [`connector_settings`](Self::connector_settings)
    /// or [`shell`](Self::shell) call overrides its part.
    pub fn settings(mut self, settings: &RankSettings) -> Result<RankBuilder, SettingsError> {
        let config = settings.config()?;
        self.settings = Some(settings.connector_settings(&config, &self.geometry));
        self.config = config;
        self.shell = settings.shell();
        Ok(self)
    }

    /// Where `engine`'s rank of this rank's index listens (TCP only; the rank then takes
    /// `engine`'s handshakes). More can be added once started ([`EngineRank::add_peer`],
    /// [`EngineRank::add_peer_rank`] for a rank of another index).
    pub fn peer(mut self, engine: EngineId, addr: SocketAddr) -> RankBuilder {
        self.peers.push((engine, addr));
        self
    }

    /// Makes the handshake with the rank of the same index of every [`peer`](Self::peer)
    /// engine as the rank starts ([`EngineRank::warm_up`], each within the configuration's
    /// `connect_timeout`), so that no first request pays it. A peer not up yet is logged and
    /// left to its first request: either side may start first.
    pub fn warm_peers(mut self) -> RankBuilder {
        self.warm_peers = true;
        self
    }

    /// Pairs this rank with an engine of another geometry: it is a rank of `side` in `plan`
    /// (from `kvhandoff_protocol::hetero::plan_pair`), and its `geometry` must be that rank's.
    /// The rank then registers its regions as buffers laid out by the engine (KV tensors and
    /// staging memory, each any length), accepts exactly the plan's peers, pairs blocks as
    /// given ([`BlockPairing::AsGiven`]), runs each request as one sub-request per link
    /// ([`RankLinks`]; push and pull), and places P's writes and D's reads by what the
    /// engine files with its route ([`EngineRank::route`]). In process or over a TCP side channel: a routed rank's
    /// handshake says so, and only a peer whose own route accepts its geometry pairs with it;
    /// across processes P's engine places each write in the memory D's registration names
    /// ([`PlannedRoute::file_planner`](crate::route::PlannedRoute::file_planner),
    /// [`PlannedRoute::file_memory`](crate::route::PlannedRoute::file_memory)).
    pub fn pairing(mut self, plan: PairPlan, side: SideName) -> RankBuilder {
        self.pairing = Some(Pairing { plan, side });
        self
    }

    /// Shell tuning (poll interval, handshake timeout).
    pub fn shell(mut self, shell: ShellConfig) -> RankBuilder {
        self.shell = shell;
        self
    }

    /// Where the rank's actors run on the runtime (default: its shared thread).
    pub fn placement(mut self, placement: Placement) -> RankBuilder {
        self.placement = placement;
        self
    }

    /// Starts the rank on `runtime`, which may host other ranks (in process, they find each
    /// other through it). The rank runs until the runtime shuts down — dropping the
    /// [`EngineRank`] does not stop it, and its agent name stays taken until then — and the
    /// engine's memory is released then (on NIXL, once the last [`KvCache`] clone is gone too).
    ///
    /// # Errors
    /// [`StartError`]; nothing of the rank is left running or registered.
    pub fn start_on(mut self, runtime: &mut Runtime) -> Result<EngineRank, StartError> {
        let transport = self.transport.take().ok_or(StartError::NoTransport)?;
        if let Some(pairing) = &self.pairing {
            check_pairing(&pairing.plan, pairing.side, &self.geometry)?;
        }
        match transport {
            TransportKind::Mem(fabric) => {
                let name = agent_name(&self.engine, self.geometry.rank_index())?;
                let agent = fabric.agent(name)?;
                self.start_with(agent, runtime)
            }
            #[cfg(feature = "nixl")]
            TransportKind::Nixl(config) => {
                use kvhandoff_actors::transport::nixl::NixlTransport;
                let name = agent_name(&self.engine, self.geometry.rank_index())?;
                // Checks that the NIXL library loads before the first NIXL call.
                let agent = NixlTransport::new(name, config)?;
                self.start_with(agent, runtime)
            }
        }
    }

    /// Starts the rank on a runtime of its own, which the returned [`EngineRank`] owns and
    /// shuts down when dropped. (An in-process side channel then reaches no other rank: use
    /// [`RankBuilder::start_on`] with a shared runtime for that.)
    ///
    /// # Errors
    /// As [`RankBuilder::start_on`].
    pub fn start(self) -> Result<EngineRank, StartError> {
        let mut runtime = Runtime::start()?;
        let mut rank = self.start_on(&mut runtime)?;
        rank.runtime = Some(runtime);
        Ok(rank)
    }

    fn start_with<T>(self, transport: T, runtime: &mut Runtime) -> Result<EngineRank, StartError>
    where
        T: AdoptMemory + Unpin + Send + 'static,
    {
        let RankBuilder {
            engine,
            geometry,
            model,
            regions,
            transport: _,
            side_channel,
            advertise_host,
            config,
            settings,
            peers,
            warm_peers,
            pairing,
            shell,
            placement,
        } = self;
        let rank_index = geometry.rank_index();
        let connect_timeout = config.connect_timeout;
        let (setup, cache, route, links) = match pairing {
            None => {
                let (setup, pool, registered) = build_rank_on_regions(
                    transport,
                    &engine,
                    geometry.clone(),
                    &model,
                    regions,
                    config.clone(),
                    shell,
                )?;
                let block_lens = pool
                    .regions()
                    .map(|(spec, _)| pool.block_span(spec, 0).1)
                    .collect();
                let cache = KvCache::new(
                    geometry.clone(),
                    registered,
                    Some(block_lens),
                    pool.logical_blocks(),
                );
                (setup, cache, None, None)
            }
            Some(Pairing { plan, side }) => {
                let links = RankLinks::for_rank(&plan, side, rank_index)?;
                // A conversation's later turns read D's kept blocks back into P: the pair
                // planned the other way, when the planner can (else turns stay unsupported).
                let other = match side {
                    SideName::Prefill => SideName::Decode,
                    SideName::Decode => SideName::Prefill,
                };
                let turn_links = kvhandoff_protocol::hetero::plan_pair(
                    &plan.model,
                    plan.decode.spec,
                    plan.prefill.spec,
                )
                .ok()
                .and_then(|reversed| RankLinks::for_rank(&reversed, other, rank_index).ok());
                let route = Arc::new(PlannedRoute::new(&plan, side));
                // P hands its whole block list to the route, whose plan aligns the sides (and a
                // reader reads both whole lists in one read).
                let config = Config {
                    block_pairing: BlockPairing::AsGiven,
                    ..config.clone()
                };
                let (setup, registered): (RankSetup<T>, Vec<RoutedRegion>) =
                    build_routed_rank_on_regions(
                        transport,
                        &engine,
                        geometry.clone(),
                        &model,
                        regions,
                        config,
                        shell,
                        route.clone(),
                    )?;
                let cache = KvCache::new(geometry.clone(), registered, None, 0);
                (setup, cache, Some(route), Some((links, turn_links)))
            }
        };
        let handshaker = match side_channel {
            SideChannel::InProcess => None,
            SideChannel::Tcp(config) => Some(Handshaker::Tcp(config)),
        };
        let info = setup.info.clone();
        let handle = runtime.add_rank(
            setup,
            RankOptions {
                handshaker,
                placement,
            },
        )?;
        let (host, port) = match handle.side_channel {
            Some(addr) => (
                advertise_host.unwrap_or_else(|| addr.ip().to_string()),
                addr.port(),
            ),
            None => (advertise_host.unwrap_or_else(|| "127.0.0.1".into()), 0),
        };
        let identity = ConnectorIdentity {
            engine,
            rank: rank_index,
            tp_size: geometry.tp_size,
            host,
            port,
        };
        let settings = settings.unwrap_or_else(|| ConnectorSettings::new(&config, &geometry));
        let mut connector = KvConnector::with_settings(identity, handle, settings);
        if let Some((links, turn_links)) = links {
            connector.set_links(links)?;
            if let Some(turn_links) = turn_links {
                connector.set_turn_links(turn_links)?;
            }
        }
        let rank = EngineRank {
            connector,
            kv: cache,
            route,
            info,
            runtime: None,
        };
        for (engine, addr) in &peers {
            rank.add_peer(engine, *addr)?;
        }
        if warm_peers {
            for (engine, _) in &peers {
                let peer = PeerAddr::new(engine.clone(), rank_index);
                if let Err(error) = rank.warm_up(&peer, connect_timeout) {
                    tracing::warn!(%error, "peer not warmed up; its first request will connect");
                }
            }
        }
        Ok(rank)
    }
}

/// Whether `geometry` is one of `side`'s ranks in `plan`.
fn check_pairing(plan: &PairPlan, side: SideName, geometry: &KvGeometry) -> Result<(), StartError> {
    let layout = match side {
        SideName::Prefill => &plan.prefill,
        SideName::Decode => &plan.decode,
    };
    if layout.ranks.iter().any(|r| &r.geometry == geometry) {
        return Ok(());
    }
    Err(StartError::Pairing(format!(
        "the rank's geometry (TP {} rank {}, PP {} rank {}) is none of the plan's {side} ranks",
        geometry.tp_size, geometry.tp_rank, geometry.pp_size, geometry.pp_rank
    )))
}
