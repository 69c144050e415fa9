//! [`PlanError`]: why a transfer cannot be planned.

use super::Side;

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
