//! Building a rank over the in-memory transport: its KV pool, its regions and its handshake.

use kvhandoff_protocol::{
    compatibility_hash, AgentName, EngineId, GeometryError, IdError, KvGeometry, ModelIdentity,
    RegionDesc, RegionSpec,
};

use super::{PeerInfo, RankSetup, ShellConfig};
use crate::machine::{Config, ConfigError, Endpoint};
use crate::transport::mem::{MemFabric, MemRegion, MemTransport};
use crate::transport::{Transport, TransportError};
use crate::PeerAddr;

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
}

/// One rank's KV cache in engine terms: logical blocks across every region, with byte access.
#[derive(Clone)]
pub struct KvPool {
    geometry: KvGeometry,
    specs: Vec<RegionSpec>,
    regions: Vec<MemRegion>,
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
    pub fn regions(&self) -> impl Iterator<Item = (&RegionSpec, &MemRegion)> {
        self.specs.iter().zip(&self.regions)
    }

    /// Byte offset and length of `logical` block inside a region of `spec`.
    pub fn block_span(&self, spec: &RegionSpec, logical: u32) -> (u64, u64) {
        let len = spec.block_len * u64::from(self.geometry.kernel_blocks_per_logical);
        (u64::from(logical) * len, len)
    }
}

/// Builds a rank on `fabric`: allocates and registers one region per geometry region, sized for
/// `logical_blocks` blocks, and prepares its endpoint and handshake.
///
/// # Errors
/// [`BuildError`] for an invalid geometry, configuration or pool size, or a transport refusal.
pub fn build_mem_rank(
    fabric: &MemFabric,
    engine: &EngineId,
    geometry: KvGeometry,
    model: &ModelIdentity,
    logical_blocks: u32,
    config: Config,
    shell: ShellConfig,
) -> Result<(RankSetup<MemTransport>, KvPool), BuildError> {
    geometry.validate()?;
    const MAX_BLOCKS: u64 = 1 << 24;
    if logical_blocks == 0 || u64::from(logical_blocks) > MAX_BLOCKS {
        return Err(BuildError::PoolSize {
            got: logical_blocks.into(),
            max: MAX_BLOCKS,
        });
    }
    let rank = geometry.tp_rank;
    let agent = AgentName::new(format!("{engine}-rank{rank}"))?;
    let mut transport = fabric.agent(agent.clone())?;
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
        let region = transport.alloc_region(len)?;
        let range = transport.register_region(&region)?;
        descs.push(RegionDesc {
            base: range.base,
            len: range.len,
            num_blocks: kernel_blocks,
            block_len: spec.block_len,
        });
        regions.push(region);
    }
    let info = PeerInfo {
        peer: PeerAddr::new(engine.clone(), rank),
        agent,
        metadata: transport.local_metadata()?,
        regions: descs,
        compat: compatibility_hash(model, &geometry),
        geometry: geometry.clone(),
    };
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
        },
        pool,
    ))
}
