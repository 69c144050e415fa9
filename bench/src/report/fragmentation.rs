//! Descriptors against fragmentation: how many descriptors the planner
//! ([`kvhandoff_protocol::planner`]) makes for one request as its block table breaks into more
//! runs. Pure: no transfer, no clock.
//!
//! The request is `bench transfer`'s (2,048 tokens of the 8B-class geometry: 128 blocks in 64
//! regions) unless told otherwise. At fragmentation `f`, `round(f × (blocks − 1))` of the
//! request's block boundaries are broken: the block after a broken boundary is not adjacent to
//! the one before it (its id skips one). Which boundaries break is a fixed shuffle per side, and
//! a higher `f` breaks a prefix of the same shuffle, so the broken boundaries at `f` are a subset
//! of those at any higher `f`: more fragmentation never merges a run that a lower one split.
//! Two series: P's table scattered with D's contiguous (a fresh D allocation), and both
//! scattered, each side by its own shuffle (a run merges only where neither side breaks).

use kvhandoff_protocol::planner::{descriptor_count, PlanInput};
use kvhandoff_protocol::{BlockIds, KvGeometry, KvLayout, RegionDesc};
use serde::{Deserialize, Serialize};

/// One fragmentation level and the descriptors planned at it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FragmentationPoint {
    /// Fraction of the request's block boundaries broken (0: one run, 1: no two blocks adjacent).
    pub fraction: f64,
    /// Boundaries broken on each scattered side.
    pub breaks: u32,
    /// Descriptors with P's table scattered and D's contiguous.
    pub p_scattered: usize,
    /// Descriptors with both tables scattered (independently).
    pub both_scattered: usize,
}

/// The sweep's request and its points.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FragmentationSweep {
    /// Logical blocks of the request.
    pub blocks: u32,
    /// Regions per rank (K and V per layer).
    pub regions: usize,
    /// The fewest descriptors any plan has: one per region.
    pub minimum: usize,
    /// The most: one per block and region.
    pub maximum: usize,
    /// One point per level, from 0 to 1.
    pub points: Vec<FragmentationPoint>,
}

/// Why the fragmentation sweep could not run (a bad geometry or a planner refusal: a bug).
#[derive(Debug, thiserror::Error)]
#[error("fragmentation sweep: {0}")]
pub struct FragmentationError(pub(super) String);

/// The default request: `bench transfer`'s geometry (32 layers, 8 KV heads of 128, bf16,
/// 16-token blocks) and 128 blocks (2,048 tokens).
pub fn default_geometry() -> KvGeometry {
    KvGeometry::dense(32, 8, 128, 2, 16, KvLayout::Nhd)
}

/// Plans the request of `blocks` blocks of `geometry` at `steps + 1` fragmentation levels from 0
/// to 1.
///
/// # Errors
/// [`FragmentationError`] for no blocks or steps, a geometry without regions, or a plan the
/// planner refuses.
pub fn fragmentation_sweep(
    geometry: &KvGeometry,
    blocks: u32,
    steps: u32,
) -> Result<FragmentationSweep, FragmentationError> {
    if blocks == 0 || steps == 0 || blocks > 1 << 20 {
        return Err(FragmentationError(
            "needs 1 to 2^20 blocks and at least one step".into(),
        ));
    }
    let specs = geometry
        .regions()
        .map_err(|e| FragmentationError(e.to_string()))?;
    let pool = 2 * blocks;
    let regions = |base: u64| -> Vec<RegionDesc> {
        specs
            .iter()
            .enumerate()
            .map(|(i, s)| RegionDesc {
                base: base + ((i as u64) << 36),
                len: s.block_len * u64::from(pool),
                num_blocks: pool,
                block_len: s.block_len,
            })
            .collect()
    };
    let (local_regions, remote_regions) = (regions(1 << 44), regions(1 << 45));
    let count = |local: &BlockIds, remote: &BlockIds| {
        descriptor_count(&PlanInput::new(
            &local_regions,
            &remote_regions,
            &specs,
            local,
            remote,
            geometry.kernel_blocks_per_logical,
        ))
        .map_err(|e| FragmentationError(e.to_string()))
    };
    let boundaries = blocks - 1;
    let (p_order, d_order) = (shuffled(boundaries, 1), shuffled(boundaries, 2));
    let contiguous = BlockIds::single_group((0..blocks).collect());
    let mut points = Vec::with_capacity(steps as usize + 1);
    for step in 0..=steps {
        let fraction = f64::from(step) / f64::from(steps);
        let breaks = (fraction * f64::from(boundaries)).round() as u32;
        let p = table(blocks, &p_order[..breaks as usize]);
        let d = table(blocks, &d_order[..breaks as usize]);
        points.push(FragmentationPoint {
            fraction,
            breaks,
            p_scattered: count(&p, &contiguous)?,
            both_scattered: count(&p, &d)?,
        });
    }
    Ok(FragmentationSweep {
        blocks,
        regions: specs.len(),
        minimum: specs.len(),
        maximum: specs.len() * blocks as usize,
        points,
    })
}

/// Block ids of `blocks` blocks from 0, skipping one id before each block whose index (1 to
/// `blocks − 1`) is in `broken` (boundary `k` lies between blocks `k − 1` and `k`).
pub(super) fn table(blocks: u32, broken: &[u32]) -> BlockIds {
    let mut gap = vec![false; blocks as usize];
    for &k in broken {
        if let Some(g) = gap.get_mut(k as usize) {
            *g = true;
        }
    }
    let mut next = 0u32;
    let ids = gap
        .iter()
        .map(|&skip| {
            next += u32::from(skip);
            let id = next;
            next += 1;
            id
        })
        .collect();
    BlockIds::single_group(ids)
}

/// Boundaries `1..=n` in a fixed order drawn from `seed` (Fisher–Yates over splitmix64).
fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (1..=n).collect();
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..order.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}
