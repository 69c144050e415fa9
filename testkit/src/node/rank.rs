//! The node's rank, started the way an engine starts one: the node allocates its KV cache
//! itself ([`engine_memory`]: one buffer per region of the geometry, `pool_blocks` logical
//! blocks each), hands the
//! buffers to a [`RankBuilder`] as they are ([`KvRegion::new`]: moved, never copied; on NIXL
//! registered in place, at the addresses the node allocated), and from then on fills P's blocks
//! and checks D's through the rank's [`KvCache`], which reads and writes that same memory.

use std::net::SocketAddr;

use kvhandoff::{
    EngineId, EngineRank, KvCache, KvConnector, KvRegion, RankBuilder, Runtime, ShellConfig,
    SideChannel, TransportKind,
};
use kvhandoff_actors::system::{LinkActor, RankActor};
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::KvGeometry;

use crate::demo::{engine_memory, model, start_error, transport_name, DemoError};

/// Where a node's KV cache lives: what the node allocated, and where its rank registered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMemory {
    /// `"mem"` or `"nixl"`.
    pub transport: &'static str,
    /// Regions (buffers the node allocated), one per region of the geometry.
    pub regions: usize,
    /// Bytes over every region.
    pub bytes: u64,
    /// Where each buffer started when the node allocated it.
    pub allocated: Vec<u64>,
    /// Where the rank registered each region ([`KvCache::region_addr`]): on NIXL the engine's
    /// own addresses, on the in-memory fabric synthetic ones.
    pub registered: Vec<u64>,
}

impl NodeMemory {
    /// Whether every region is registered at the address the node allocated it (no copy, no
    /// staging): what NIXL reports. The in-memory fabric names regions by addresses of its
    /// own, so this is false there (its regions are the node's buffers all the same: moved,
    /// not copied).
    pub fn in_place(&self) -> bool {
        !self.allocated.is_empty() && self.allocated == self.registered
    }

    /// The line the node prints on stderr once its rank started.
    pub fn describe(&self, engine: &EngineId) -> String {
        let how = if self.in_place() {
            "in place, at the addresses the node allocated"
        } else {
            "as moved (no copy), at the fabric's own addresses"
        };
        format!(
            "kvhandoff node: {engine}'s KV cache is the node's own memory: {} regions, {} bytes, \
             registered with {} {how}",
            self.regions, self.bytes, self.transport
        )
    }
}

/// What [`start`] needs besides the transport.
pub(super) struct RankSpec<'a> {
    pub(super) own: &'a EngineId,
    pub(super) geometry: &'a KvGeometry,
    pub(super) pool_blocks: u32,
    pub(super) config: &'a Config,
    pub(super) shell: ShellConfig,
    pub(super) listen: SocketAddr,
    /// The side channel's pre-shared key, if any.
    pub(super) psk: Option<kvhandoff::Psk>,
}

/// A started node rank, taken apart for the node's loops.
pub(super) struct NodeRank {
    pub(super) conn: KvConnector,
    pub(super) kv: KvCache,
    pub(super) runtime: Runtime,
    pub(super) link: actix::Addr<LinkActor>,
    pub(super) rank: actix::Addr<RankActor>,
    /// Where the side channel listens (port 0 resolved).
    pub(super) listen: SocketAddr,
    /// The handshake the rank hands its peers (the repeated-handshake test sends it again).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub(super) info: kvhandoff_protocol::driver::PeerInfo,
    pub(super) memory: NodeMemory,
}

/// Starts the node's rank on memory the node allocates ([`engine_memory`]), over `kind`, with a TCP
/// side channel on `spec.listen`, on a runtime of its own.
///
/// # Errors
/// [`DemoError`] when the memory, the transport or the rank cannot be had.
pub(super) fn start(spec: RankSpec<'_>, kind: TransportKind) -> Result<NodeRank, DemoError> {
    let transport = transport_name(&kind);
    let regions = engine_memory(spec.geometry, spec.pool_blocks)?;
    let allocated: Vec<u64> = regions.iter().map(KvRegion::addr).collect();
    let bytes = regions.iter().map(KvRegion::len).sum();
    let mut runtime = Runtime::start()?;
    let side_channel = match spec.psk {
        Some(psk) => SideChannel::tcp(spec.listen).with_psk(psk),
        None => SideChannel::tcp(spec.listen),
    };
    let rank = RankBuilder::new(spec.own.clone(), spec.geometry.clone(), model())
        .regions(regions)
        .transport(kind)
        .side_channel(side_channel)
        .config(spec.config.clone())
        .shell(spec.shell)
        .start_on(&mut runtime)
        .map_err(start_error)?;
    let listen = rank.side_channel().unwrap_or(spec.listen);
    let info = rank.peer_info().clone();
    let (link, actor) = (rank.rank().link.clone(), rank.rank().rank.clone());
    let (conn, kv, _) = EngineRank::into_parts(rank);
    let memory = NodeMemory {
        transport,
        regions: kv.num_regions(),
        bytes,
        registered: (0..kv.num_regions())
            .map(|i| kv.region_addr(i).unwrap_or(0))
            .collect(),
        allocated,
    };
    Ok(NodeRank {
        conn,
        kv,
        runtime,
        link,
        rank: actor,
        listen,
        info,
        memory,
    })
}
