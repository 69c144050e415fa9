//! The reusable [`Planner`]: its scratch buffers, the validation of a whole input before the
//! first descriptor is written, and the emission of one descriptor per region and run.

#[cfg(doc)]
use super::plan_transfer;
use super::{
    block_runs, Descriptor, PlanError, PlanInput, PlanSummary, Run, Runs, Side, TransferPlan,
};
use crate::geometry::RegionDesc;

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

pub(super) fn strictly_ascending(ids: &[u32]) -> bool {
    ids.windows(2).all(|w| w[0] < w[1])
}

/// The first value that repeats in a sorted slice.
pub(super) fn first_repeat(sorted: &[u32]) -> Option<u32> {
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}
