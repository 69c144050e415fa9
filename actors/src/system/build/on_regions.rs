//! Building a rank on memory the engine owns: its regions checked, then adopted and registered
//! as they are (no copy). Kept apart from the builds that allocate the rank's memory themselves.

use kvhandoff_protocol::driver::PeerInfo;
use kvhandoff_protocol::machine::{Config, Endpoint};
use kvhandoff_protocol::{
    EngineId, GeometryError, KvGeometry, ModelIdentity, RegionDesc, RegionSpec,
};

use super::{
    own_info, refuse_routed_integrity, BuildError, KvPool, RegionProblem, RoutedRegion, MAX_BLOCKS,
    MAX_ROUTED_REGIONS,
};
use crate::system::regions::{AdoptError, AdoptMemory, KvRegion};
use crate::system::{RankSetup, ShellConfig};
use crate::transport::AddrRange;

/// Checks `regions` against `geometry` before anything is adopted or registered: one region per
/// [`RegionSpec`], each a whole, equal number of logical blocks (at most
/// [`MAX_POOL_BLOCKS`](super::MAX_POOL_BLOCKS)),
/// in memory the transport can register. Returns the pool's logical blocks.
fn check_regions<T: AdoptMemory>(
    geometry: &KvGeometry,
    specs: &[RegionSpec],
    regions: &[KvRegion],
) -> Result<u32, BuildError> {
    if regions.len() != specs.len() {
        return Err(BuildError::RegionCount {
            expected: specs.len(),
            got: regions.len(),
        });
    }
    let mut first = None;
    for (index, (spec, region)) in specs.iter().zip(regions).enumerate() {
        let len = region.len();
        let bad = |problem| BuildError::RegionSize {
            index,
            len,
            problem,
        };
        if len == 0 {
            return Err(bad(RegionProblem::Empty));
        }
        let block_len = spec
            .block_len
            .checked_mul(u64::from(geometry.kernel_blocks_per_logical))
            .ok_or(GeometryError::Overflow)?;
        if block_len == 0 || len % block_len != 0 {
            return Err(bad(RegionProblem::NotBlockAligned { block_len }));
        }
        let blocks = len / block_len;
        if blocks > MAX_BLOCKS {
            return Err(bad(RegionProblem::TooManyBlocks {
                blocks,
                max: MAX_BLOCKS,
            }));
        }
        let expected = *first.get_or_insert(blocks);
        if blocks != expected {
            return Err(bad(RegionProblem::BlockCount { blocks, expected }));
        }
        check_location::<T>(index, region)?;
    }
    let blocks = first.unwrap_or(0);
    u32::try_from(blocks).map_err(|_| BuildError::PoolSize {
        got: blocks,
        max: MAX_BLOCKS,
    })
}

fn check_location<T: AdoptMemory>(index: usize, region: &KvRegion) -> Result<(), BuildError> {
    let location = region.location();
    if T::supports(location) {
        return Ok(());
    }
    Err(BuildError::Adopt {
        index,
        source: AdoptError::Unsupported {
            transport: T::NAME,
            location,
        },
    })
}

/// The endpoint (its configuration checked before anything is registered), the engine's
/// `regions` adopted and registered (`block_len` as in [`adopt_all`]), and the rank's handshake.
fn adopt_and_describe<T: AdoptMemory>(
    transport: &mut T,
    engine: &EngineId,
    geometry: &KvGeometry,
    model: &ModelIdentity,
    regions: Vec<KvRegion>,
    config: Config,
    block_len: impl Fn(usize, u64) -> u64,
) -> Result<(Endpoint, PeerInfo, Vec<RoutedRegion>), BuildError> {
    let endpoint = Endpoint::new(engine.clone(), geometry.rank_index(), config)?;
    let (descs, registered) = adopt_all(transport, regions, block_len)?;
    let info = own_info(
        &*transport,
        engine,
        geometry,
        model,
        descs,
        endpoint.config(),
    )?;
    Ok((endpoint, info, registered))
}

/// Adopts and registers `regions` on `transport`, in order; `block_len(i)` is region `i`'s
/// kernel-block stride in the handshake's region table.
fn adopt_all<T: AdoptMemory>(
    transport: &mut T,
    regions: Vec<KvRegion>,
    block_len: impl Fn(usize, u64) -> u64,
) -> Result<(Vec<RegionDesc>, Vec<RoutedRegion>), BuildError> {
    let mut descs = Vec::with_capacity(regions.len());
    let mut out = Vec::with_capacity(regions.len());
    for (index, region) in regions.into_iter().enumerate() {
        let (handle, bytes) = transport
            .adopt(region)
            .map_err(|source| BuildError::Adopt { index, source })?;
        let AddrRange { base, len } = transport.register_region(&handle)?;
        let stride = block_len(index, len);
        let num_blocks = u32::try_from(len / stride.max(1)).map_err(|_| BuildError::PoolSize {
            got: len / stride.max(1),
            max: MAX_BLOCKS,
        })?;
        descs.push(RegionDesc {
            base,
            len,
            num_blocks,
            block_len: stride,
        });
        out.push(RoutedRegion { base, len, bytes });
    }
    Ok((descs, out))
}

/// Builds a rank on `transport` whose KV cache is `regions`, memory the engine owns, registered
/// as it is (no copy): region `i` is the memory of [`RegionSpec`] `i` of
/// [`KvGeometry::regions`], and logical block `b` is its `b`-th slice of
/// `block_len × kernel_blocks_per_logical` bytes. Everything is checked before the first
/// region is adopted, so a refused build registers nothing and hands the memory back (drops
/// it).
///
/// Returns the rank's setup, its pool (the engine's byte access, by block) and the regions as
/// registered (their addresses in the transport's address space), in the order given.
///
/// # Errors
/// [`BuildError::RegionCount`], [`BuildError::RegionSize`] (empty, not a whole number of
/// logical blocks, unequal block counts, too many), [`BuildError::Adopt`] (memory the
/// transport cannot register, e.g. a GPU's on a host-only transport), an invalid geometry or
/// configuration, or a transport refusal.
pub fn build_rank_on_regions<T: AdoptMemory>(
    mut transport: T,
    engine: &EngineId,
    geometry: KvGeometry,
    model: &ModelIdentity,
    regions: Vec<KvRegion>,
    config: Config,
    shell: ShellConfig,
) -> Result<(RankSetup<T>, KvPool, Vec<RoutedRegion>), BuildError> {
    geometry.validate()?;
    let specs = geometry.regions()?;
    let logical_blocks = check_regions::<T>(&geometry, &specs, &regions)?;
    let (endpoint, info, registered) = adopt_and_describe(
        &mut transport,
        engine,
        &geometry,
        model,
        regions,
        config,
        |i, _| specs[i].block_len,
    )?;
    let pool = KvPool {
        geometry,
        specs,
        regions: registered.iter().map(|r| r.bytes.clone()).collect(),
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
        registered,
    ))
}

/// As [`build_routed_rank`](super::build_routed_rank), on `regions`, memory the engine owns (its
/// KV tensors and staging buffers, laid out by its owner), registered as it is.
///
/// # Errors
/// As [`build_routed_rank`](super::build_routed_rank); [`BuildError::RegionSize`] for an empty
/// region and [`BuildError::Adopt`] for memory the transport cannot register, both before
/// anything is registered.
#[allow(clippy::too_many_arguments)]
pub fn build_routed_rank_on_regions<T: AdoptMemory>(
    mut transport: T,
    engine: &EngineId,
    geometry: KvGeometry,
    model: &ModelIdentity,
    regions: Vec<KvRegion>,
    config: Config,
    shell: ShellConfig,
    route: kvhandoff_protocol::driver::SharedRoute,
) -> Result<(RankSetup<T>, Vec<RoutedRegion>), BuildError> {
    geometry.validate()?;
    if regions.is_empty() || regions.len() > MAX_ROUTED_REGIONS {
        return Err(BuildError::PoolSize {
            got: regions.len() as u64,
            max: MAX_ROUTED_REGIONS as u64,
        });
    }
    for (index, region) in regions.iter().enumerate() {
        if region.is_empty() {
            return Err(BuildError::RegionSize {
                index,
                len: 0,
                problem: RegionProblem::Empty,
            });
        }
        check_location::<T>(index, region)?;
    }
    refuse_routed_integrity(&config)?;
    let (endpoint, mut info, registered) = adopt_and_describe(
        &mut transport,
        engine,
        &geometry,
        model,
        regions,
        config,
        |_, len| len,
    )?;
    info.routed = true;
    Ok((
        RankSetup {
            endpoint,
            transport,
            info,
            shell,
            route: Some(route),
        },
        registered,
    ))
}
