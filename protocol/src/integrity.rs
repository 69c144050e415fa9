//! Optional integrity digests of written KV blocks (`Config::integrity_digest`, off by default).
//!
//! P's shell digests the bytes of the blocks it writes, just before it posts the write, and
//! sends the digests with the write's completion ([`WriteDone::digests`], or
//! [`WritePartDone::digests`] per part of a layer-wise write). D's shell digests the same blocks
//! of its own memory when that completion arrives (the notification comes after the data), and
//! reports a mismatch to the endpoint as a failed write ([`WriteFailure::DigestMismatch`]), so
//! the request fails and its blocks go back through the same path as any failed write. The
//! pure protocol never touches memory: this module only says *which* bytes a digest covers;
//! the hash itself is `kvhandoff_kernels::digest` (XXH3-64), which guards against corruption in
//! flight, not against an adversary.
//!
//! # What one digest covers
//!
//! The registration's blocks are taken in order, group after group (P's `local` list and D's
//! registered list pair up position by position), and cut into runs of
//! [`blocks_per_digest`] blocks: one block per digest up to [`MAX_WRITE_DIGESTS`] blocks, which
//! bounds the digests of a write at 512 KiB on the wire (a `WriteDone` stays well under
//! [`crate::wire::MAX_PAYLOAD_LEN`] at [`crate::MAX_BLOCKS_PER_REQUEST`]). A run's digest is the
//! hash of the concatenation, block after block, of each block's bytes in every region of its
//! cache group, in region order ([`KvGeometry::regions`](crate::KvGeometry::regions)): the K
//! and V of each layer. A part of a layer-wise write covers only the regions of its layers.
//!
//! Both sides walk their own region table with the same geometry, so the rule holds for pairs
//! of equal geometry (the planner's pairs). A heterogeneous pair rearranges bytes on the way
//! (a transfer route, staging memory, kernels), so there is no common byte string to digest:
//! a rank built with a route refuses `integrity_digest`.
//!
//! # Agreement
//!
//! Both sides must run with the same setting: it is folded into the compatibility hash
//! ([`with_integrity`]), so a P and a D that disagree refuse each other at the handshake
//! (`ConnectFailure::Incompatible`) instead of failing every request later.

use std::ops::Range;

use sha2::{Digest, Sha256};

use crate::geometry::{RegionDesc, RegionSpec};
use crate::message::{BlockIds, CompatHash};
use crate::transport::TransportError;
#[cfg(doc)]
use crate::{WriteDone, WriteFailure, WritePartDone};

/// Most digests one completion carries (8 bytes each on the wire, plus a length prefix).
pub const MAX_WRITE_DIGESTS: usize = 1 << 16;

/// Blocks each digest of a write of `blocks` blocks covers: 1 up to [`MAX_WRITE_DIGESTS`]
/// blocks, then as few as keep the count within the bound.
///
/// ```
/// use kvhandoff_protocol::integrity::{blocks_per_digest, digest_count, MAX_WRITE_DIGESTS};
/// assert_eq!(blocks_per_digest(100), 1);
/// assert_eq!(blocks_per_digest(MAX_WRITE_DIGESTS), 1);
/// assert_eq!(blocks_per_digest(MAX_WRITE_DIGESTS + 1), 2);
/// assert_eq!(digest_count(MAX_WRITE_DIGESTS + 1), MAX_WRITE_DIGESTS / 2 + 1);
/// assert_eq!(digest_count(0), 0);
/// ```
pub fn blocks_per_digest(blocks: usize) -> usize {
    blocks.div_ceil(MAX_WRITE_DIGESTS).max(1)
}

/// Digests of a write of `blocks` blocks (at most [`MAX_WRITE_DIGESTS`]).
pub fn digest_count(blocks: usize) -> usize {
    blocks.div_ceil(blocks_per_digest(blocks))
}

/// The compatibility hash of a rank with integrity digests `on`: `hash` itself when off (so
/// ranks without the feature are unaffected), a hash of it with a tag when on.
///
/// ```
/// use kvhandoff_protocol::{integrity::with_integrity, CompatHash};
/// let base = CompatHash([7; 32]);
/// assert_eq!(with_integrity(base, false), base);
/// assert_ne!(with_integrity(base, true), base);
/// ```
pub fn with_integrity(hash: CompatHash, on: bool) -> CompatHash {
    if !on {
        return hash;
    }
    let mut h = Sha256::new();
    h.update(b"kvhandoff.integrity_digest.xxh3_64.v1");
    h.update(hash.0);
    CompatHash(h.finalize().into())
}

/// Why digests could not be computed over a rank's memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntegrityError {
    /// A block id lies past its region's blocks (a registration that does not fit the rank).
    #[error("block {block} of cache group {group} is outside its regions")]
    BlockOutOfRange {
        /// The cache group.
        group: usize,
        /// The logical block id.
        block: u32,
    },
    /// The transport could not read its memory (NIXL: device memory is not readable here).
    #[error("reading registered memory: {0}")]
    Read(#[from] TransportError),
}

/// Where [`DigestLayout::digests`] sends the spans it walks: the shell reads each span's bytes
/// into the running digest and closes one digest per run.
pub trait SpanSink {
    /// Appends the `len` bytes at `addr` to the running digest.
    ///
    /// # Errors
    /// The memory could not be read.
    fn span(&mut self, addr: u64, len: u64) -> Result<(), IntegrityError>;

    /// Ends the running digest and returns it; the next span starts a new one.
    fn finish(&mut self) -> u64;
}

/// One rank's memory as the digests see it: its region table and geometry.
#[derive(Debug, Clone, Copy)]
pub struct DigestLayout<'a> {
    /// Registered regions, in [`KvGeometry::regions`](crate::KvGeometry::regions) order.
    pub regions: &'a [RegionDesc],
    /// What each region holds.
    pub specs: &'a [RegionSpec],
    /// Kernel blocks per logical block.
    pub kernel_blocks_per_logical: u32,
}

impl DigestLayout<'_> {
    /// Computes the digests of `blocks` over the regions of `layers`: `sink.span(addr, len)` for
    /// every span of a digest's run, in order, then `sink.finish()` gives that digest.
    ///
    /// # Errors
    /// [`IntegrityError::BlockOutOfRange`] for a block past its regions (before any span of it
    /// is read), or the first error of `sink.span`.
    pub fn digests(
        &self,
        blocks: &BlockIds,
        layers: Range<u32>,
        sink: &mut impl SpanSink,
    ) -> Result<Vec<u64>, IntegrityError> {
        let per = blocks_per_digest(blocks.total());
        let mut out = Vec::with_capacity(digest_count(blocks.total()));
        let mut in_run = 0;
        let flat = blocks
            .groups
            .iter()
            .enumerate()
            .flat_map(|(g, ids)| ids.iter().map(move |&id| (g, id)));
        for (group, block) in flat {
            self.block_spans(group, block, &layers, sink)?;
            in_run += 1;
            if in_run == per {
                out.push(sink.finish());
                in_run = 0;
            }
        }
        if in_run > 0 {
            out.push(sink.finish());
        }
        Ok(out)
    }

    fn block_spans(
        &self,
        group: usize,
        block: u32,
        layers: &Range<u32>,
        sink: &mut impl SpanSink,
    ) -> Result<(), IntegrityError> {
        let kbpl = u64::from(self.kernel_blocks_per_logical);
        let out = || IntegrityError::BlockOutOfRange { group, block };
        for (region, spec) in self.regions.iter().zip(self.specs) {
            if spec.group != group || !layers.contains(&spec.layer) {
                continue;
            }
            let first = u64::from(block).checked_mul(kbpl).ok_or_else(out)?;
            let end = first.checked_add(kbpl).ok_or_else(out)?;
            if end > u64::from(region.num_blocks) {
                return Err(out());
            }
            let len = kbpl.checked_mul(region.block_len).ok_or_else(out)?;
            let addr = first
                .checked_mul(region.block_len)
                .and_then(|offset| region.base.checked_add(offset))
                .ok_or_else(out)?;
            sink.span(addr, len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::RegionKind;

    fn layout_parts() -> (Vec<RegionDesc>, Vec<RegionSpec>) {
        let spec = |layer, kind| RegionSpec {
            group: 0,
            layer,
            kind,
            block_len: 16,
        };
        let specs = vec![
            spec(0, RegionKind::Key),
            spec(0, RegionKind::Value),
            spec(1, RegionKind::Key),
            spec(1, RegionKind::Value),
        ];
        let regions = (0..4u64)
            .map(|r| RegionDesc {
                base: 0x1000 * (r + 1),
                len: 16 * 8,
                num_blocks: 8,
                block_len: 16,
            })
            .collect();
        (regions, specs)
    }

    fn spans_of(
        blocks: &BlockIds,
        layers: Range<u32>,
    ) -> Result<Vec<Vec<(u64, u64)>>, IntegrityError> {
        let (regions, specs) = layout_parts();
        let layout = DigestLayout {
            regions: &regions,
            specs: &specs,
            kernel_blocks_per_logical: 2,
        };
        let mut runs = Runs(vec![Vec::new()]);
        layout.digests(blocks, layers, &mut runs)?;
        runs.0.pop();
        Ok(runs.0)
    }

    /// Records the spans of each run.
    struct Runs(Vec<Vec<(u64, u64)>>);

    impl SpanSink for Runs {
        fn span(&mut self, addr: u64, len: u64) -> Result<(), IntegrityError> {
            if let Some(run) = self.0.last_mut() {
                run.push((addr, len));
            }
            Ok(())
        }

        fn finish(&mut self) -> u64 {
            self.0.push(Vec::new());
            0
        }
    }

    #[test]
    fn one_digest_per_block_over_every_region_of_its_layers() {
        let runs = spans_of(&BlockIds::single_group(vec![3, 0]), 0..2).unwrap();
        // Block 3 with 2 kernel blocks per logical: kernel blocks 6..8, 32 bytes per region.
        assert_eq!(
            runs,
            vec![
                vec![
                    (0x1000 + 96, 32),
                    (0x2000 + 96, 32),
                    (0x3000 + 96, 32),
                    (0x4000 + 96, 32)
                ],
                vec![(0x1000, 32), (0x2000, 32), (0x3000, 32), (0x4000, 32)],
            ]
        );
        let part = spans_of(&BlockIds::single_group(vec![3]), 1..2).unwrap();
        assert_eq!(part, vec![vec![(0x3000 + 96, 32), (0x4000 + 96, 32)]]);
    }

    #[test]
    fn a_block_past_its_regions_is_refused() {
        assert_eq!(
            spans_of(&BlockIds::single_group(vec![4]), 0..2),
            Err(IntegrityError::BlockOutOfRange { group: 0, block: 4 })
        );
        assert!(spans_of(&BlockIds::single_group(vec![u32::MAX]), 0..2).is_err());
    }
}
