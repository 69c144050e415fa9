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

use crate::geometry::{KvGeometry, RegionDesc, RegionSpec};
use crate::message::BlockIds;

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

/// Why a transfer cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The two region tables have different lengths.
    #[error("local side has {local} regions but remote side has {remote}")]
    RegionCountMismatch {
        /// Regions on the local side.
        local: usize,
        /// Regions on the remote side.
        remote: usize,
    },
    /// The region specs (group mapping) do not match the region tables in length.
    #[error("{specs} region specs for {regions} regions")]
    SpecCountMismatch {
        /// Specs given.
        specs: usize,
        /// Regions in each table.
        regions: usize,
    },
    /// A region's kernel block length differs between the two sides.
    #[error("region {region}: local block_len {local} differs from remote block_len {remote}")]
    BlockLenMismatch {
        /// Index of the region.
        region: usize,
        /// Local `block_len`.
        local: u64,
        /// Remote `block_len`.
        remote: u64,
    },
    /// A registered region's block length differs from the one its spec derives.
    #[error(
        "region {region}: registered block_len {registered} differs from spec block_len {spec}"
    )]
    SpecBlockLenMismatch {
        /// Index of the region.
        region: usize,
        /// `block_len` of the region spec.
        spec: u64,
        /// `block_len` of the local registered region.
        registered: u64,
    },
    /// A region descriptor is inconsistent.
    #[error("{side} region {region} is invalid: {why}")]
    InvalidRegion {
        /// Which table holds the region.
        side: Side,
        /// Index of the region.
        region: usize,
        /// The broken rule.
        why: &'static str,
    },
    /// A region's end address does not fit in 64 bits.
    #[error("{side} region {region} overflows the 64-bit address space")]
    AddressOverflow {
        /// Which table holds the region.
        side: Side,
        /// Index of the region.
        region: usize,
    },
    /// `kernel_blocks_per_logical` is zero.
    #[error("kernel_blocks_per_logical must be greater than zero")]
    ZeroKernelBlocksPerLogical,
    /// The two sides list block ids for different numbers of cache groups.
    #[error("local side lists {local} cache groups but remote side lists {remote}")]
    GroupCountMismatch {
        /// Groups on the local side.
        local: usize,
        /// Groups on the remote side.
        remote: usize,
    },
    /// A region belongs to a cache group for which no block ids were given.
    #[error("region {region} belongs to cache group {group} but only {groups} groups were given")]
    UnknownGroup {
        /// Index of the region.
        region: usize,
        /// The region's group.
        group: usize,
        /// Groups in the block id lists.
        groups: usize,
    },
    /// A cache group lists blocks but no region belongs to it, so they could not be moved.
    #[error("cache group {group} lists {blocks} blocks but no region belongs to it")]
    UncoveredGroup {
        /// The group.
        group: usize,
        /// Blocks the remote side lists for it.
        blocks: usize,
    },
    /// The remote side lists more blocks for a group than the local side holds.
    #[error("cache group {group}: remote lists {remote} blocks but local holds only {local}")]
    RemoteHasMoreBlocks {
        /// The group.
        group: usize,
        /// Blocks on the local side.
        local: usize,
        /// Blocks on the remote side.
        remote: usize,
    },
    /// A block id appears twice in the (trimmed) list of one side.
    #[error("{side} block {block} of cache group {group} is listed twice")]
    DuplicateBlock {
        /// Which side lists it.
        side: Side,
        /// The group.
        group: usize,
        /// The logical id.
        block: u32,
    },
    /// A logical block reaches past the kernel blocks of a region of its group.
    #[error(
        "{side} logical block {block} of cache group {group} ends at kernel block {kernel_end}, \
         past the {num_blocks} kernel blocks of region {region}"
    )]
    BlockOutOfRange {
        /// Which side.
        side: Side,
        /// The group.
        group: usize,
        /// The region it does not fit in.
        region: usize,
        /// The logical id (the highest of its group on that side).
        block: u32,
        /// One past its last kernel block.
        kernel_end: u64,
        /// Kernel blocks of the region.
        num_blocks: u32,
    },
    /// A total over the plan does not fit in 64 bits, or its descriptors cannot be allocated.
    #[error("{what} overflows")]
    Overflow {
        /// What overflowed.
        what: &'static str,
    },
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

/// The runs of one cache group, as a slice of [`Planner`]'s run buffer.
#[derive(Debug, Clone, Copy, Default)]
struct GroupRuns {
    /// Range of the group's runs in `Planner::runs`.
    start: usize,
    end: usize,
    /// One past the highest local logical id (0 when the group is empty).
    local_end: u64,
    /// One past the highest remote logical id (0 when the group is empty).
    remote_end: u64,
    /// The highest local and remote logical ids, for error reports.
    local_max: u32,
    remote_max: u32,
    /// Logical blocks moved for the group.
    blocks: u64,
    /// Whether some region belongs to the group.
    covered: bool,
}

/// A reusable planner: keeps its scratch buffers between calls, so that planning many transfers
/// allocates only when a transfer is larger than every one before it.
///
/// ```
/// # use kvhandoff_protocol::planner::{fragmented_70b_case, PlanInput, Planner};
/// let (geometry, local, remote, p_blocks, d_blocks) = fragmented_70b_case();
/// let specs = geometry.regions().unwrap();
/// let input = PlanInput::new(&local, &remote, &specs, &p_blocks, &d_blocks, 1);
/// let mut planner = Planner::new();
/// let mut descriptors = Vec::new();
/// let summary = planner.plan_into(&input, &mut descriptors).unwrap();
/// assert_eq!(summary.descriptors, 118 * 160);
/// assert_eq!(descriptors.len(), 118 * 160);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Planner {
    runs: Vec<Run>,
    groups: Vec<GroupRuns>,
    pairs: Vec<(u32, u32)>,
    ids: Vec<u32>,
}

impl Planner {
    /// A planner with empty scratch buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Plans one transfer into a new [`TransferPlan`]; see [`plan_transfer`].
    ///
    /// # Errors
    /// Those of [`plan_transfer`].
    pub fn plan(&mut self, input: &PlanInput<'_>) -> Result<TransferPlan, PlanError> {
        let mut descriptors = Vec::new();
        let summary = self.plan_into(input, &mut descriptors)?;
        Ok(TransferPlan {
            descriptors,
            bytes: summary.bytes,
        })
    }

    /// Clears `out` and fills it with the plan's descriptors (see [`plan_transfer`]), reusing its
    /// capacity.
    ///
    /// # Errors
    /// Those of [`plan_transfer`]; `out` is then left empty, as the whole input is checked before
    /// the first descriptor is written.
    pub fn plan_into(
        &mut self,
        input: &PlanInput<'_>,
        out: &mut Vec<Descriptor>,
    ) -> Result<PlanSummary, PlanError> {
        out.clear();
        let summary = self.prepare(input)?;
        out.try_reserve(summary.descriptors)
            .map_err(|_| PlanError::Overflow {
                what: "descriptor buffer",
            })?;
        self.emit(input, out);
        Ok(summary)
    }

    /// The number of descriptors and bytes of the plan, without building the descriptors.
    ///
    /// # Errors
    /// Those of [`plan_transfer`].
    pub fn summary(&mut self, input: &PlanInput<'_>) -> Result<PlanSummary, PlanError> {
        self.prepare(input)
    }

    /// Validates the whole input and computes the runs of every group; after it succeeds every
    /// descriptor is in bounds on both sides.
    fn prepare(&mut self, input: &PlanInput<'_>) -> Result<PlanSummary, PlanError> {
        let kbpl = input.kernel_blocks_per_logical;
        if kbpl == 0 {
            return Err(PlanError::ZeroKernelBlocksPerLogical);
        }
        check_tables(input)?;
        let local_groups = &input.local_blocks.groups;
        let remote_groups = &input.remote_blocks.groups;
        if local_groups.len() != remote_groups.len() {
            return Err(PlanError::GroupCountMismatch {
                local: local_groups.len(),
                remote: remote_groups.len(),
            });
        }
        self.runs.clear();
        self.groups.clear();
        for (group, (local, remote)) in local_groups.iter().zip(remote_groups).enumerate() {
            let runs = self.group_runs(group, local, remote)?;
            self.groups.push(runs);
        }
        self.check_regions(input)
    }

    /// End-trims, checks and sorts one group's pairs, and appends their runs to `self.runs`.
    fn group_runs(
        &mut self,
        group: usize,
        local: &[u32],
        remote: &[u32],
    ) -> Result<GroupRuns, PlanError> {
        let Some(skip) = local.len().checked_sub(remote.len()) else {
            return Err(PlanError::RemoteHasMoreBlocks {
                group,
                local: local.len(),
                remote: remote.len(),
            });
        };
        let local = &local[skip..];
        if !strictly_ascending(remote) {
            self.ids.clear();
            self.ids.extend_from_slice(remote);
            self.ids.sort_unstable();
            if let Some(block) = first_repeat(&self.ids) {
                return Err(PlanError::DuplicateBlock {
                    side: Side::Remote,
                    group,
                    block,
                });
            }
        }
        let start = self.runs.len();
        if strictly_ascending(local) {
            self.runs.extend(block_runs(local, remote));
        } else {
            self.pairs.clear();
            self.pairs
                .extend(local.iter().copied().zip(remote.iter().copied()));
            self.pairs.sort_unstable_by_key(|&(l, _)| l);
            if let Some(pair) = self.pairs.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(PlanError::DuplicateBlock {
                    side: Side::Local,
                    group,
                    block: pair[0].0,
                });
            }
            self.runs.extend(Runs::new(self.pairs.iter().copied()));
        }
        let mut runs = GroupRuns {
            start,
            end: self.runs.len(),
            blocks: local.len() as u64,
            ..GroupRuns::default()
        };
        for run in &self.runs[start..] {
            if run.local_end() > runs.local_end {
                runs.local_end = run.local_end();
                runs.local_max = run.local.saturating_add(run.len.saturating_sub(1));
            }
            if run.remote_end() > runs.remote_end {
                runs.remote_end = run.remote_end();
                runs.remote_max = run.remote.saturating_add(run.len.saturating_sub(1));
            }
        }
        Ok(runs)
    }

    /// Checks that every group's blocks fit every region of the group on both sides, and sums
    /// the plan's size.
    fn check_regions(&mut self, input: &PlanInput<'_>) -> Result<PlanSummary, PlanError> {
        let kbpl = u64::from(input.kernel_blocks_per_logical);
        let groups = self.groups.len();
        let mut summary = PlanSummary::default();
        let tables = input.local_regions.iter().zip(input.remote_regions);
        for (region, (spec, (local, remote))) in input.specs.iter().zip(tables).enumerate() {
            let Some(runs) = self.groups.get_mut(spec.group) else {
                return Err(PlanError::UnknownGroup {
                    region,
                    group: spec.group,
                    groups,
                });
            };
            runs.covered = true;
            let sides = [
                (Side::Local, local, runs.local_end, runs.local_max),
                (Side::Remote, remote, runs.remote_end, runs.remote_max),
            ];
            for (side, desc, end, max) in sides {
                // At most (2^32) * (2^32 - 1), so this cannot overflow; checked all the same.
                let kernel_end = end
                    .checked_mul(kbpl)
                    .ok_or(PlanError::Overflow { what: "kernel end" })?;
                if kernel_end > u64::from(desc.num_blocks) {
                    return Err(PlanError::BlockOutOfRange {
                        side,
                        group: spec.group,
                        region,
                        block: max,
                        kernel_end,
                        num_blocks: desc.num_blocks,
                    });
                }
            }
            let bytes = runs
                .blocks
                .checked_mul(kbpl)
                .and_then(|k| k.checked_mul(local.block_len))
                .and_then(|b| b.checked_add(summary.bytes))
                .ok_or(PlanError::Overflow {
                    what: "total bytes",
                })?;
            summary.bytes = bytes;
            summary.descriptors = summary
                .descriptors
                .checked_add(runs.end.saturating_sub(runs.start))
                .ok_or(PlanError::Overflow {
                    what: "descriptor count",
                })?;
        }
        let unused = self
            .groups
            .iter()
            .enumerate()
            .find(|(_, runs)| runs.blocks > 0 && !runs.covered);
        if let Some((group, runs)) = unused {
            return Err(PlanError::UncoveredGroup {
                group,
                blocks: usize::try_from(runs.blocks).unwrap_or(usize::MAX),
            });
        }
        Ok(summary)
    }

    /// Appends the descriptors of every region; `prepare` must have succeeded on `input`.
    ///
    /// `prepare` proved, for every region, that the last logical block of its group ends at or
    /// before `num_blocks * block_len <= len` bytes into the region on each side, and that
    /// `base + len` fits in 64 bits. Every offset, length and address below is therefore at most
    /// `base + len`, so the saturating operations never saturate: they are exact, and they keep
    /// the loop free of branches.
    fn emit(&self, input: &PlanInput<'_>, out: &mut Vec<Descriptor>) {
        let kbpl = u64::from(input.kernel_blocks_per_logical);
        let tables = input.local_regions.iter().zip(input.remote_regions);
        for (spec, (local, remote)) in input.specs.iter().zip(tables) {
            let Some(group) = self.groups.get(spec.group) else {
                continue; // unreachable: `prepare` checked every region's group
            };
            let runs = self.runs.get(group.start..group.end).unwrap_or(&[]);
            let stride = kbpl.saturating_mul(local.block_len);
            let (local_base, remote_base) = (local.base, remote.base);
            out.extend(runs.iter().map(|run| Descriptor {
                local_addr: local_base.saturating_add(u64::from(run.local).saturating_mul(stride)),
                remote_addr:
                    remote_base.saturating_add(u64::from(run.remote).saturating_mul(stride)),
                len: u64::from(run.len).saturating_mul(stride),
            }));
        }
    }
}

/// Checks the region tables and specs against each other and each region on its own.
fn check_tables(input: &PlanInput<'_>) -> Result<(), PlanError> {
    let (local, remote) = (input.local_regions, input.remote_regions);
    if local.len() != remote.len() {
        return Err(PlanError::RegionCountMismatch {
            local: local.len(),
            remote: remote.len(),
        });
    }
    if input.specs.len() != local.len() {
        return Err(PlanError::SpecCountMismatch {
            specs: input.specs.len(),
            regions: local.len(),
        });
    }
    for (region, (spec, (l, r))) in input.specs.iter().zip(local.iter().zip(remote)).enumerate() {
        check_region(Side::Local, region, l)?;
        check_region(Side::Remote, region, r)?;
        if l.block_len != r.block_len {
            return Err(PlanError::BlockLenMismatch {
                region,
                local: l.block_len,
                remote: r.block_len,
            });
        }
        if spec.block_len != l.block_len {
            return Err(PlanError::SpecBlockLenMismatch {
                region,
                spec: spec.block_len,
                registered: l.block_len,
            });
        }
    }
    Ok(())
}

/// Checks one region: blocks fit in its length, and its end fits in the address space.
fn check_region(side: Side, region: usize, desc: &RegionDesc) -> Result<(), PlanError> {
    let invalid = |why| PlanError::InvalidRegion { side, region, why };
    if desc.block_len == 0 {
        return Err(invalid("block_len is zero"));
    }
    let Some(needed) = u64::from(desc.num_blocks).checked_mul(desc.block_len) else {
        return Err(PlanError::AddressOverflow { side, region });
    };
    if needed > desc.len {
        return Err(invalid("num_blocks * block_len exceeds len"));
    }
    if desc.base.checked_add(desc.len).is_none() {
        return Err(PlanError::AddressOverflow { side, region });
    }
    Ok(())
}

fn strictly_ascending(ids: &[u32]) -> bool {
    ids.windows(2).all(|w| w[0] < w[1])
}

/// The first value that repeats in a sorted slice.
fn first_repeat(sorted: &[u32]) -> Option<u32> {
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// Blocks per transfer in [`fragmented_70b_case`].
#[doc(hidden)]
pub const FRAGMENTED_70B_BLOCKS: u32 = 118;

/// The fragmented Llama-3.3-70B transfer vLLM reported (PR 35264): TP 8 (1 KV head per rank),
/// 80 layers, head_dim 128, bf16, 16-token kernel blocks, NHD, K and V regions per layer
/// (160 regions of 20,000 blocks), and 118 blocks of which no two are adjacent on either side,
/// so the minimal plan has 118 × 160 = 18,880 descriptors.
///
/// Returns `(geometry, local regions, remote regions, local ids, remote ids)`; the geometry holds
/// on both sides. Local ids ascend; remote ids are scattered in no order.
#[doc(hidden)]
pub fn fragmented_70b_case() -> (
    KvGeometry,
    Vec<RegionDesc>,
    Vec<RegionDesc>,
    BlockIds,
    BlockIds,
) {
    fragmented_70b_case_with_runs(FRAGMENTED_70B_BLOCKS)
}

/// [`fragmented_70b_case`] with the same 118 blocks split into `runs` maximal runs (clamped to
/// `1..=118`) that are contiguous on both sides, so the minimal plan has `runs × 160`
/// descriptors.
#[doc(hidden)]
pub fn fragmented_70b_case_with_runs(
    runs: u32,
) -> (
    KvGeometry,
    Vec<RegionDesc>,
    Vec<RegionDesc>,
    BlockIds,
    BlockIds,
) {
    use crate::geometry::{CacheGroup, CacheGroupKind, KvLayout};
    const NUM_BLOCKS: u32 = 20_000;
    let geometry = KvGeometry {
        num_layers: 80,
        total_kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        kernel_block_size: 16,
        kernel_blocks_per_logical: 1,
        layout: KvLayout::Nhd,
        tp_size: 8,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: vec![CacheGroup {
            kind: CacheGroupKind::FullAttention,
            num_layers: 80,
        }],
    };
    // 16 tokens × 1 head × 128 × 2 bytes.
    let block_len: u64 = 4096;
    let region_len = u64::from(NUM_BLOCKS) * block_len;
    // Regions sit 2 MiB apart, as separate allocations would.
    let pitch = region_len + (2 << 20);
    let table = |base: u64| {
        (0..160u64)
            .map(|i| RegionDesc {
                base: base + i * pitch,
                len: region_len,
                num_blocks: NUM_BLOCKS,
                block_len,
            })
            .collect::<Vec<_>>()
    };
    let runs = runs.clamp(1, FRAGMENTED_70B_BLOCKS);
    let mut local = Vec::with_capacity(FRAGMENTED_70B_BLOCKS as usize);
    let mut remote = Vec::with_capacity(FRAGMENTED_70B_BLOCKS as usize);
    for run in 0..runs {
        // Split 118 blocks into `runs` near-equal runs.
        let first = run * FRAGMENTED_70B_BLOCKS / runs;
        let last = (run + 1) * FRAGMENTED_70B_BLOCKS / runs;
        // Runs start 150 blocks apart locally; remotely they are scattered by a permutation of
        // the run index (97 is coprime with the 128 slots), 150 blocks apart as well.
        let local_start = 100 + run * 150;
        let remote_start = 40 + ((run * 97 + 13) % 128) * 150;
        for k in 0..(last - first) {
            local.push(local_start + k);
            remote.push(remote_start + k);
        }
    }
    (
        geometry,
        table(0x7f00_0000_0000),
        table(0x7e00_0000_0000),
        BlockIds::single_group(local),
        BlockIds::single_group(remote),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(local: &[u32], remote: &[u32]) -> Vec<(u32, u32, u32)> {
        block_runs(local, remote)
            .map(|r| (r.local, r.remote, r.len))
            .collect()
    }

    #[test]
    fn runs_of_empty_lists() {
        assert!(runs(&[], &[]).is_empty());
    }

    #[test]
    fn runs_need_contiguity_on_both_sides() {
        assert_eq!(runs(&[1, 2, 3], &[7, 8, 9]), [(1, 7, 3)]);
        assert_eq!(runs(&[1, 2, 3], &[7, 9, 10]), [(1, 7, 1), (2, 9, 2)]);
        assert_eq!(runs(&[1, 3, 4], &[7, 8, 9]), [(1, 7, 1), (3, 8, 2)]);
        // Descending ids are not contiguous in the same order.
        assert_eq!(runs(&[3, 2], &[8, 7]), [(3, 8, 1), (2, 7, 1)]);
    }

    #[test]
    fn runs_stop_at_the_top_of_the_id_space() {
        let max = u32::MAX;
        assert_eq!(
            runs(&[max - 1, max, 0], &[max - 1, max, 0]),
            [(max - 1, max - 1, 2), (0, 0, 1)]
        );
    }

    #[test]
    fn runs_use_the_shorter_list() {
        assert_eq!(runs(&[1, 2, 3], &[5, 6]), [(1, 5, 2)]);
    }

    #[test]
    fn ascending_and_repeat_helpers() {
        assert!(strictly_ascending(&[]));
        assert!(strictly_ascending(&[1, 5]));
        assert!(!strictly_ascending(&[1, 1]));
        assert_eq!(first_repeat(&[1, 2, 2, 3, 3]), Some(2));
        assert_eq!(first_repeat(&[1, 2, 3]), None);
    }

    #[test]
    fn planner_sorts_unordered_pairs_into_minimal_runs() {
        // Token order 5, 3, 4 pairs with 7, 5, 6: all three are one run once sorted by local id.
        let spec = RegionSpec {
            group: 0,
            layer: 0,
            kind: crate::RegionKind::Key,
            block_len: 8,
        };
        let region = RegionDesc {
            base: 1000,
            len: 80,
            num_blocks: 10,
            block_len: 8,
        };
        let local = BlockIds::single_group(vec![5, 3, 4]);
        let remote = BlockIds::single_group(vec![7, 5, 6]);
        let (regions, specs) = ([region], [spec]);
        let input = PlanInput::new(&regions, &regions, &specs, &local, &remote, 1);
        let plan = plan_transfer(&input).unwrap();
        assert_eq!(
            plan.descriptors,
            [Descriptor {
                local_addr: 1000 + 3 * 8,
                remote_addr: 1000 + 5 * 8,
                len: 24
            }]
        );
    }

    #[test]
    fn fragmented_case_shapes() {
        let (geometry, local, remote, p, d) = fragmented_70b_case();
        geometry.validate().unwrap();
        assert_eq!(geometry.regions().unwrap().len(), 160);
        assert_eq!(geometry.attention_block_len().unwrap(), 4096);
        assert_eq!((local.len(), remote.len()), (160, 160));
        assert_eq!((p.total(), d.total()), (118, 118));
        for group in p.groups.iter().chain(&d.groups) {
            let mut sorted = group.clone();
            sorted.sort_unstable();
            assert!(
                sorted.windows(2).all(|w| w[1] > w[0] + 1),
                "no two adjacent"
            );
        }
        for n in [1, 10, 117, 118] {
            let (_, _, _, p, d) = fragmented_70b_case_with_runs(n);
            assert_eq!(block_runs(&p.groups[0], &d.groups[0]).count(), n as usize);
        }
    }
}
