//! The descriptor planner: turns the block ids of one transfer into the fewest NIXL descriptors.
//!
//! One transfer moves the KV blocks of one request between a local rank and a remote rank. Both
//! ranks register the same region table (one region per layer and part, see
//! [`KvGeometry::regions`]); the block ids are *logical* ids, one list per cache group, and
//! logical id `i` covers kernel blocks `i * kbpl .. (i + 1) * kbpl` of every region of its group
//! (`kbpl` is [`KvGeometry::kernel_blocks_per_logical`]).
//!
//! vLLM emits one descriptor per kernel block per region, so a fragmented block table turns a
//! 118-block transfer of a 160-region model into 18,880 descriptors. The planner instead merges
//! every run of blocks that is contiguous on *both* sides into one descriptor per region, which is
//! the least any valid plan can do (see [`plan_transfer`] for the proof).
//!
//! Everything here is pure: no I/O, no clock, and no panics on any input. The whole input is
//! validated with checked arithmetic before the first descriptor is written, so a failed plan
//! writes nothing and every address of a successful one is in bounds.
//!
//! Only equal geometries are planned today (equal kernel block size, layout, heads and
//! `kbpl` on both sides). [`PlanInput`] is `#[non_exhaustive]` and built through
//! [`PlanInput::new`], so heterogeneous TP or block-size ratios can later be added as new
//! optional fields without breaking callers.

mod engine;
mod error;
mod fixtures;

use crate::geometry::{KvGeometry, RegionDesc, RegionSpec};
use crate::message::BlockIds;

pub use engine::Planner;
pub use error::PlanError;
#[doc(hidden)]
pub use fixtures::{fragmented_70b_case, fragmented_70b_case_with_runs, FRAGMENTED_70B_BLOCKS};

/// Which side of the transfer a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The rank that builds and posts the transfer (P in push mode).
    Local,
    /// The peer rank (D in push mode).
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Everything the planner needs for one transfer.
///
/// Built with [`PlanInput::new`]; the struct is `#[non_exhaustive]` so that heterogeneous
/// geometries (a remote `kbpl`, a block-size ratio, a head split) can be added later.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PlanInput<'a> {
    /// The local rank's registered regions, in [`KvGeometry::regions`] order.
    pub local_regions: &'a [RegionDesc],
    /// The remote rank's registered regions, index for index with `local_regions`.
    pub remote_regions: &'a [RegionDesc],
    /// The regions' specs (from [`KvGeometry::regions`]); `specs[i].group` is region `i`'s
    /// cache group.
    pub specs: &'a [RegionSpec],
    /// Local logical block ids, one list per cache group, in token order.
    pub local_blocks: &'a BlockIds,
    /// Remote logical block ids, one list per cache group, in token order. A list shorter than
    /// the local one receives the local list's tail (prefix caching on the remote side).
    pub remote_blocks: &'a BlockIds,
    /// Kernel blocks per logical block, equal on both sides.
    pub kernel_blocks_per_logical: u32,
}

impl<'a> PlanInput<'a> {
    /// Bundles the inputs of one transfer between two ranks of equal geometry.
    pub fn new(
        local_regions: &'a [RegionDesc],
        remote_regions: &'a [RegionDesc],
        specs: &'a [RegionSpec],
        local_blocks: &'a BlockIds,
        remote_blocks: &'a BlockIds,
        kernel_blocks_per_logical: u32,
    ) -> Self {
        Self {
            local_regions,
            remote_regions,
            specs,
            local_blocks,
            remote_blocks,
            kernel_blocks_per_logical,
        }
    }
}

/// One NIXL descriptor pair: `len` bytes from `local_addr` to (or from) `remote_addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Descriptor {
    /// Start address in the local rank's address space.
    pub local_addr: u64,
    /// Start address in the remote rank's address space.
    pub remote_addr: u64,
    /// Bytes covered on each side.
    pub len: u64,
}

/// A maximal run of logical blocks contiguous on both sides: local ids
/// `local .. local + len` pair with remote ids `remote .. remote + len`, in that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Run {
    /// First local logical id.
    pub local: u32,
    /// First remote logical id.
    pub remote: u32,
    /// Logical blocks in the run (at least 1).
    pub len: u32,
}

impl Run {
    /// One past the last local logical id, widened so that it cannot overflow.
    pub fn local_end(&self) -> u64 {
        u64::from(self.local) + u64::from(self.len)
    }

    /// One past the last remote logical id, widened so that it cannot overflow.
    pub fn remote_end(&self) -> u64 {
        u64::from(self.remote) + u64::from(self.len)
    }
}

/// A planned transfer: the descriptors in region-major order and the bytes they move.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferPlan {
    /// Descriptors, region by region; within a region, by ascending local address.
    pub descriptors: Vec<Descriptor>,
    /// Bytes moved, summed over all descriptors.
    pub bytes: u64,
}

impl TransferPlan {
    /// Number of descriptors in the plan.
    pub fn descriptor_count(&self) -> usize {
        self.descriptors.len()
    }
}

/// The size of a plan without its descriptors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PlanSummary {
    /// Number of descriptors the plan has.
    pub descriptors: usize,
    /// Bytes moved, summed over all descriptors.
    pub bytes: u64,
}

/// Iterator of maximal runs over `(local, remote)` pairs taken in order; see [`block_runs`].
#[derive(Debug, Clone)]
pub struct Runs<I> {
    pairs: I,
    pending: Option<Run>,
}

impl<I> Runs<I> {
    /// Groups the pairs yielded by `pairs` into maximal runs, in order.
    pub fn new(pairs: I) -> Self {
        Self {
            pairs,
            pending: None,
        }
    }
}

impl<I: Iterator<Item = (u32, u32)>> Iterator for Runs<I> {
    type Item = Run;

    fn next(&mut self) -> Option<Run> {
        let mut run = match self.pending.take() {
            Some(run) => run,
            None => {
                let (local, remote) = self.pairs.next()?;
                Run {
                    local,
                    remote,
                    len: 1,
                }
            }
        };
        for (local, remote) in self.pairs.by_ref() {
            let extends = u64::from(local) == run.local_end()
                && u64::from(remote) == run.remote_end()
                && run.len < u32::MAX;
            if extends {
                run.len += 1;
            } else {
                self.pending = Some(Run {
                    local,
                    remote,
                    len: 1,
                });
                return Some(run);
            }
        }
        Some(run)
    }
}

/// The maximal runs of `local[k] → remote[k]` pairs, taken in list order (the shorter list bounds
/// the pairs): a run grows while both ids go up by exactly one.
///
/// When `local` is ascending (the usual case) these are exactly the fewest runs that cover the
/// pairs; [`Planner`] sorts the pairs by local id first, so its runs are minimal for any order.
///
/// ```
/// use kvhandoff_protocol::planner::{block_runs, Run};
/// let runs: Vec<Run> = block_runs(&[4, 5, 6, 9], &[20, 21, 30, 31]).collect();
/// assert_eq!(
///     runs,
///     [
///         Run { local: 4, remote: 20, len: 2 },
///         Run { local: 6, remote: 30, len: 1 },
///         Run { local: 9, remote: 31, len: 1 },
///     ]
/// );
/// ```
pub fn block_runs<'a>(
    local: &'a [u32],
    remote: &'a [u32],
) -> Runs<impl Iterator<Item = (u32, u32)> + Clone + 'a> {
    Runs::new(local.iter().copied().zip(remote.iter().copied()))
}

/// Plans one transfer with a fresh [`Planner`].
///
/// For every region `i` (in table order) and every maximal run of its group's blocks, the plan
/// holds one descriptor of `run.len * kbpl * block_len` bytes, from
/// `local_base + run.local * kbpl * block_len` to `remote_base + run.remote * kbpl * block_len`.
/// For each group, the local list is first end-trimmed to the length of the remote list (the
/// remote side only registered its uncached suffix), and the pairs are sorted by local id.
///
/// # Minimality
///
/// Fix a region, and let `S` be the set of requested logical pairs `(l, r)` of its group; kernel
/// blocks, and so bytes, pair up as `l * kbpl + k → r * kbpl + k`. Call `(l, r)` a *head* when
/// `(l - 1, r - 1)` is not in `S`. A valid plan covers exactly the requested bytes on both sides,
/// and each descriptor lies in one registered region (NIXL checks this; regions are disjoint
/// allocations), maps one contiguous local range onto one contiguous remote range byte for byte,
/// and is non-empty.
///
/// * Every pair is covered, so some descriptor covers the first byte of each head `(l, r)`. If
///   that descriptor also covered the byte just before it, that byte is the last byte of local
///   block `l - 1`, paired with the last byte of remote block `r - 1`, so `(l - 1, r - 1)` would
///   be requested, contradicting that `(l, r)` is a head. So the descriptor *starts* at the head.
///   Descriptors start at one address each, so distinct heads need distinct descriptors: any
///   valid plan has at least `#heads` descriptors per region.
/// * Local ids are unique, so once the pairs are sorted by local id the only pair that can
///   precede `(l, r)` in a run is its neighbour in that order; the maximal runs therefore start
///   exactly at the heads, and the planner emits exactly `#heads` descriptors per region, each
///   covering only requested pairs. (Runs are cut at `u32::MAX` blocks;
///   real block lists are far shorter.)
///
/// Summed over the regions, the plan is therefore the smallest valid one.
///
/// # Errors
///
/// A [`PlanError`] for any input that could yield a descriptor outside a region, an ambiguous or
/// lossy pairing, or an overflowing address. Nothing is planned in that case.
///
/// # Example
///
/// ```
/// use kvhandoff_protocol::planner::{plan_transfer, Descriptor, PlanInput};
/// use kvhandoff_protocol::{BlockIds, CacheGroup, CacheGroupKind, KvGeometry, KvLayout, RegionDesc};
///
/// let geometry = KvGeometry {
///     num_layers: 1,
///     total_kv_heads: 1,
///     head_dim: 64,
///     dtype_bytes: 2,
///     kernel_block_size: 16,
///     kernel_blocks_per_logical: 1,
///     layout: KvLayout::Hnd,
///     tp_size: 1,
///     tp_rank: 0,
///     pp_size: 1,
///     pp_rank: 0,
///     mla: false,
///     cache_groups: vec![CacheGroup { kind: CacheGroupKind::FullAttention, num_layers: 1 }],
/// };
/// let specs = geometry.regions().unwrap(); // K and V of the one layer
/// let block_len = specs[0].block_len; // 2048 bytes
/// let region = |base: u64| RegionDesc { base, len: 1024 * block_len, num_blocks: 1024, block_len };
/// let local = [region(0x1000_0000), region(0x2000_0000)];
/// let remote = [region(0x9000_0000), region(0xa000_0000)];
///
/// // P holds blocks 10..=14; D only registered 2 (a prefix hit), so P's last 2 go to D's.
/// let p_blocks = BlockIds::single_group(vec![10, 11, 12, 13, 14]);
/// let d_blocks = BlockIds::single_group(vec![500, 501]);
/// let input = PlanInput::new(&local, &remote, &specs, &p_blocks, &d_blocks, 1);
/// let plan = plan_transfer(&input).unwrap();
/// assert_eq!(plan.descriptor_count(), 2); // one per region: 13..=14 → 500..=501 is one run
/// assert_eq!(
///     plan.descriptors[0],
///     Descriptor {
///         local_addr: 0x1000_0000 + 13 * block_len,
///         remote_addr: 0x9000_0000 + 500 * block_len,
///         len: 2 * block_len,
///     }
/// );
/// assert_eq!(plan.bytes, 2 * 2 * block_len);
/// ```
pub fn plan_transfer(input: &PlanInput<'_>) -> Result<TransferPlan, PlanError> {
    Planner::new().plan(input)
}

/// The number of descriptors [`plan_transfer`] would produce, without building them.
///
/// # Errors
/// Exactly those of [`plan_transfer`].
pub fn descriptor_count(input: &PlanInput<'_>) -> Result<usize, PlanError> {
    Planner::new().summary(input).map(|s| s.descriptors)
}

#[cfg(test)]
mod tests;
