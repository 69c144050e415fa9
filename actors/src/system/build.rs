//! Building a rank on a transport: its KV pool, its regions and its handshake.

mod on_regions;

use std::sync::Arc;

use kvhandoff_protocol::{
    compatibility_hash, integrity::with_integrity, AgentName, EngineId, GeometryError, IdError,
    Incarnation, KvGeometry, ModelIdentity, RegionDesc, RegionSpec,
};

pub use on_regions::{build_rank_on_regions, build_routed_rank_on_regions};

use super::regions::AdoptError;
use super::{RankSetup, ShellConfig};
use crate::transport::mem::{MemFabric, MemRegion, MemTransport};
use crate::transport::{AddrRange, Transport, TransportError};
use kvhandoff_protocol::driver::PeerInfo;
use kvhandoff_protocol::machine::{Config, ConfigError, Endpoint};
use kvhandoff_protocol::PeerAddr;

/// Why a rank could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The geometry is invalid.
    #[error("geometry: {0}")]
    Geometry(#[from] GeometryError),
    /// The protocol configuration is invalid.
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    /// The transport refused.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// An id is invalid.
    #[error("id: {0}")]
    Id(#[from] IdError),
    /// The pool would have no blocks, or too many.
    #[error("a pool needs between 1 and {max} logical blocks, not {got}")]
    PoolSize {
        /// Blocks asked for.
        got: u64,
        /// The most allowed.
        max: u64,
    },
    /// The engine gave a number of regions other than the geometry has.
    #[error("the geometry has {expected} regions (one per layer and K/V part); {got} were given")]
    RegionCount {
        /// Regions the geometry has ([`KvGeometry::regions`]).
        expected: usize,
        /// Regions given.
        got: usize,
    },
    /// A region given by the engine does not fit the geometry.
    #[error("region {index} ({len} bytes): {problem}")]
    RegionSize {
        /// The region's index, in the order given.
        index: usize,
        /// Its length in bytes.
        len: u64,
        /// What is wrong with it.
        problem: RegionProblem,
    },
    /// The transport cannot take a region the engine gave.
    #[error("region {index}: {source}")]
    Adopt {
        /// The region's index, in the order given.
        index: usize,
        /// Why.
        source: AdoptError,
    },
}

/// What is wrong with one engine region ([`BuildError::RegionSize`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegionProblem {
    /// It has no bytes.
    #[error("a region cannot be empty")]
    Empty,
    /// Its length is not a whole number of logical blocks.
    #[error("not a whole number of {block_len}-byte logical blocks")]
    NotBlockAligned {
        /// Bytes of one logical block of this region.
        block_len: u64,
    },
    /// It holds another number of logical blocks than the first region.
    #[error("{blocks} logical blocks, but region 0 has {expected}")]
    BlockCount {
        /// Its blocks.
        blocks: u64,
        /// The first region's.
        expected: u64,
    },
    /// It holds no more than the most blocks a pool may have.
    #[error("{blocks} logical blocks, above the limit of {max}")]
    TooManyBlocks {
        /// Its blocks.
        blocks: u64,
        /// The most allowed.
        max: u64,
    },
}

/// Byte access to one registered region, whatever memory backs it.
pub trait RegionBytes: Send + Sync {
    /// Copies `bytes` into the region at `offset`.
    ///
    /// # Errors
    /// [`TransportError`] if the span is outside the region.
    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), TransportError>;

    /// Copies the region's bytes at `offset` into `buf`.
    ///
    /// # Errors
    /// [`TransportError`] if the span is outside the region.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), TransportError>;
}

impl RegionBytes for MemRegion {
    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), TransportError> {
        MemRegion::write(self, offset, bytes)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), TransportError> {
        MemRegion::read(self, offset, buf)
    }
}

#[cfg(feature = "nixl")]
impl RegionBytes for crate::transport::nixl::HostBuffer {
    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), TransportError> {
        crate::transport::nixl::HostBuffer::write(self, offset, bytes)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), TransportError> {
        crate::transport::nixl::HostBuffer::read(self, offset, buf)
    }
}

/// One rank's KV cache in engine terms: logical blocks across every region, with byte access.
#[derive(Clone)]
pub struct KvPool {
    geometry: KvGeometry,
    specs: Vec<RegionSpec>,
    regions: Vec<Arc<dyn RegionBytes>>,
    logical_blocks: u32,
}

impl KvPool {
    /// The rank's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Logical blocks in the pool.
    pub fn logical_blocks(&self) -> u32 {
        self.logical_blocks
    }

    /// The pool's regions with their specs, in registration order.
    pub fn regions(&self) -> impl Iterator<Item = (&RegionSpec, &dyn RegionBytes)> {
        self.specs
            .iter()
            .zip(self.regions.iter().map(|r| r.as_ref()))
    }

    /// Byte offset and length of `logical` block inside a region of `spec`.
    pub fn block_span(&self, spec: &RegionSpec, logical: u32) -> (u64, u64) {
        let len = spec.block_len * u64::from(self.geometry.kernel_blocks_per_logical);
        (u64::from(logical) * len, len)
    }
}

/// What a rank is built on: a transport, and how to allocate one region's memory for it.
pub trait RankMemory: Transport + Sized {
    /// Allocates `len` zeroed bytes for one region; returns the transport's handle (to
    /// register) and the engine's byte access.
    ///
    /// # Errors
    /// [`TransportError`] if the memory cannot be had.
    fn allocate(
        &mut self,
        len: u64,
    ) -> Result<(Self::Region, Arc<dyn RegionBytes>), TransportError>;
}

impl RankMemory for MemTransport {
    fn allocate(&mut self, len: u64) -> Result<(MemRegion, Arc<dyn RegionBytes>), TransportError> {
        let region = self.alloc_region(len)?;
        Ok((region.clone(), Arc::new(region)))
    }
}

#[cfg(feature = "nixl")]
impl RankMemory for crate::transport::nixl::NixlTransport {
    fn allocate(
        &mut self,
        len: u64,
    ) -> Result<(crate::transport::nixl::HostBuffer, Arc<dyn RegionBytes>), TransportError> {
        let buffer = crate::transport::nixl::HostBuffer::new(len)?;
        Ok((buffer.clone(), Arc::new(buffer)))
    }
}

/// Most logical blocks of one pool.
pub const MAX_POOL_BLOCKS: u64 = 1 << 24;
const MAX_BLOCKS: u64 = MAX_POOL_BLOCKS;

/// The agent name of `rank` of `engine`.
///
/// # Errors
/// [`IdError`] if the name is not a valid id.
pub fn agent_name(engine: &EngineId, rank: u32) -> Result<AgentName, IdError> {
    AgentName::new(format!("{engine}-rank{rank}"))
}

/// Builds a rank on `transport`: allocates and registers one region per geometry region, sized
/// for `logical_blocks` blocks, and prepares its endpoint and handshake.
///
/// # Errors
/// [`BuildError`] for an invalid geometry, configuration or pool size, or a transport refusal.
pub fn build_rank<T: RankMemory>(
    mut transport: T,
    engine: &EngineId,
    geometry: KvGeometry,
    model: &ModelIdentity,
    logical_blocks: u32,
    config: Config,
    shell: ShellConfig,
) -> Result<(RankSetup<T>, KvPool), BuildError> {
    geometry.validate()?;
    if logical_blocks == 0 || u64::from(logical_blocks) > MAX_BLOCKS {
        return Err(BuildError::PoolSize {
            got: logical_blocks.into(),
            max: MAX_BLOCKS,
        });
    }
    let rank = geometry.rank_index();
    let specs = geometry.regions()?;
    let kernel_blocks = logical_blocks
        .checked_mul(geometry.kernel_blocks_per_logical)
        .ok_or(GeometryError::Overflow)?;
    let mut regions = Vec::with_capacity(specs.len());
    let mut descs = Vec::with_capacity(specs.len());
    for spec in &specs {
        let len = spec
            .block_len
            .checked_mul(u64::from(kernel_blocks))
            .ok_or(GeometryError::Overflow)?;
        let (handle, bytes) = transport.allocate(len)?;
        let AddrRange { base, len } = transport.register_region(&handle)?;
        descs.push(RegionDesc {
            base,
            len,
            num_blocks: kernel_blocks,
            block_len: spec.block_len,
        });
        regions.push(bytes);
    }
    let info = own_info(&transport, engine, &geometry, model, descs, &config)?;
    let endpoint = Endpoint::new(engine.clone(), rank, config)?;
    let pool = KvPool {
        geometry,
        specs,
        regions,
        logical_blocks,
    };
    Ok((
        RankSetup {
            endpoint,
            transport,
            info,
            shell,
            route: None,
        },
        pool,
    ))
}

/// The handshake payload of a rank of `engine` on `transport` with `geometry` and `regions`
/// registered; a new incarnation.
fn own_info<T: Transport>(
    transport: &T,
    engine: &EngineId,
    geometry: &KvGeometry,
    model: &ModelIdentity,
    regions: Vec<RegionDesc>,
    config: &Config,
) -> Result<PeerInfo, BuildError> {
    if config.integrity_digest {
        // Digests need the transport to read its own memory (one of device memory could
        // not): refuse the rank now rather than fail every write it posts.
        if let Some(region) = regions.first() {
            transport.read_local(region.base, 1, &mut Vec::new())?;
        }
    }
    Ok(PeerInfo {
        peer: PeerAddr::new(engine.clone(), geometry.rank_index()),
        agent: transport.agent_name().clone(),
        metadata: transport.local_metadata()?,
        regions,
        // Integrity digests must be on on both sides or on neither: a rank that disagrees
        // has another hash, so the handshake refuses the pair (`Incompatible`).
        compat: with_integrity(compatibility_hash(model, geometry), config.integrity_digest),
        geometry: geometry.clone(),
        incarnation: Incarnation::random(),
        routed: false,
    })
}

/// A routed rank rearranges bytes on the way (staging memory, kernels), so P's bytes and D's
/// are not the same string: there is nothing to digest on both sides.
fn refuse_routed_integrity(config: &Config) -> Result<(), BuildError> {
    if config.integrity_digest {
        return Err(BuildError::Config(ConfigError::Contradiction(
            "integrity_digest needs equal geometries: a rank with a transfer route cannot digest its blocks",
        )));
    }
    Ok(())
}

/// One buffer of a routed rank ([`build_routed_rank`]): where the transport registered it and
/// the engine's byte access to it.
#[derive(Clone)]
pub struct RoutedRegion {
    /// Its address in the rank's transport address space.
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The engine's access to its bytes.
    pub bytes: Arc<dyn RegionBytes>,
}

impl std::fmt::Debug for RoutedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedRegion")
            .field("base", &self.base)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Most buffers one routed rank registers.
pub const MAX_ROUTED_REGIONS: usize = kvhandoff_protocol::MAX_ROUTED_BUFFERS;

/// Builds a rank whose registered memory is `region_lens` buffers laid out by its owner (a
/// heterogeneous rank's KV tensors and staging memory), with `route` placing every transfer and
/// accepting peers of other geometries (see
/// [`TransferRoute`](kvhandoff_protocol::driver::TransferRoute)). `geometry` is the rank's
/// own, as its handshake advertises it; the handshake's region table lists the buffers (each
/// one block of its whole length) and says the rank is routed
/// ([`Handshake::routed`](kvhandoff_protocol::Handshake::routed)), so only a peer whose own
/// route accepts this geometry pairs with it, in process or over the side channel.
///
/// # Errors
/// [`BuildError`] for an invalid geometry or configuration, no buffers, more than
/// [`MAX_ROUTED_REGIONS`] or an empty one ([`BuildError::PoolSize`]), or a transport refusal.
#[allow(clippy::too_many_arguments)]
pub fn build_routed_rank<T: RankMemory>(
    mut transport: T,
    engine: &EngineId,
    geometry: KvGeometry,
    model: &ModelIdentity,
    region_lens: &[u64],
    config: Config,
    shell: ShellConfig,
    route: kvhandoff_protocol::driver::SharedRoute,
) -> Result<(RankSetup<T>, Vec<RoutedRegion>), BuildError> {
    geometry.validate()?;
    refuse_routed_integrity(&config)?;
    if region_lens.is_empty() || region_lens.len() > MAX_ROUTED_REGIONS {
        return Err(BuildError::PoolSize {
            got: region_lens.len() as u64,
            max: MAX_ROUTED_REGIONS as u64,
        });
    }
    let mut regions = Vec::with_capacity(region_lens.len());
    let mut descs = Vec::with_capacity(region_lens.len());
    for &len in region_lens {
        if len == 0 {
            return Err(BuildError::PoolSize {
                got: 0,
                max: u64::MAX,
            });
        }
        let (handle, bytes) = transport.allocate(len)?;
        let AddrRange { base, len } = transport.register_region(&handle)?;
        descs.push(RegionDesc {
            base,
            len,
            num_blocks: 1,
            block_len: len,
        });
        regions.push(RoutedRegion { base, len, bytes });
    }
    let mut info = own_info(&transport, engine, &geometry, model, descs, &config)?;
    // Its table lists its buffers, not its geometry's regions: the handshake says so.
    info.routed = true;
    let endpoint = Endpoint::new(engine.clone(), geometry.rank_index(), config)?;
    Ok((
        RankSetup {
            endpoint,
            transport,
            info,
            shell,
            route: Some(route),
        },
        regions,
    ))
}

/// Builds a rank on a new agent of `fabric` (see [`build_rank`]).
///
/// # Errors
/// As [`build_rank`], and if the agent name is taken.
pub fn build_mem_rank(
    fabric: &MemFabric,
    engine: &EngineId,
    geometry: KvGeometry,
    model: &ModelIdentity,
    logical_blocks: u32,
    config: Config,
    shell: ShellConfig,
) -> Result<(RankSetup<MemTransport>, KvPool), BuildError> {
    let transport = fabric.agent(agent_name(engine, geometry.rank_index())?)?;
    build_rank(
        transport,
        engine,
        geometry,
        model,
        logical_blocks,
        config,
        shell,
    )
}
