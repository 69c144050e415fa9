//! [`KvCache`]: the engine's safe byte access to the regions its rank registered.

use std::sync::Arc;

use kvhandoff_actors::system::RoutedRegion;
use kvhandoff_actors::transport::TransportError;
use kvhandoff_protocol::KvGeometry;

/// Why a [`KvCache`] access failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvCacheError {
    /// No region of that index.
    #[error("no region {region} (the rank has {regions})")]
    NoRegion {
        /// The index asked for.
        region: usize,
        /// Regions the rank has.
        regions: usize,
    },
    /// No logical block of that index.
    #[error("no block {block} (the pool has {blocks})")]
    NoBlock {
        /// The block asked for.
        block: u32,
        /// Logical blocks in the pool.
        blocks: u32,
    },
    /// The rank's regions are buffers laid out by their owner, not a pool of blocks (a rank of
    /// a heterogeneous pair): use [`KvCache::read`] and [`KvCache::write`].
    #[error("the rank's regions are not a pool of blocks (a heterogeneous pair's rank)")]
    NotBlocks,
    /// A block access needs a buffer of exactly one logical block.
    #[error("a block of this region is {expected} bytes; the buffer has {got}")]
    BlockLen {
        /// Bytes of one logical block of the region.
        expected: u64,
        /// Bytes of the buffer given.
        got: usize,
    },
    /// The access itself failed: out of the region's bounds, or the memory was released (the
    /// rank stopped).
    #[error("access: {0}")]
    Access(#[from] TransportError),
}

/// One region as the cache sees it.
#[derive(Clone, Debug)]
struct CacheRegion {
    region: RoutedRegion,
    /// Bytes of one logical block; `None` for a heterogeneous rank's buffer.
    block_len: Option<u64>,
}

/// The engine's access to its rank's KV cache: the regions it gave the builder, registered as
/// they are, read and written safely (under the transport's lock, so an access never tears a
/// landing). Cheap to clone, `Send + Sync`: a copy can live on another thread.
///
/// Logical block `b` of region `r` is bytes `[b × block_len(r), (b + 1) × block_len(r))`
/// of region `r`, where `block_len(r)` is the region's kernel block length
/// ([`RegionSpec::block_len`](kvhandoff_protocol::RegionSpec::block_len)) times
/// `kernel_blocks_per_logical`.
///
/// Only touch a request's blocks when the protocol says they are the engine's: P fills them
/// before `request_finished` and leaves them alone until `BlocksFree`; D reads them after
/// `BlocksReady`.
///
/// Once the rank has stopped, accesses to memory the rank owned fail
/// ([`KvCacheError::Access`]) on the in-memory transport; on NIXL the cache keeps the memory
/// alive until its last clone goes.
#[derive(Clone, Debug)]
pub struct KvCache {
    geometry: KvGeometry,
    regions: Arc<[CacheRegion]>,
    logical_blocks: u32,
}

impl KvCache {
    /// The cache of a rank built on a pool (`block_lens`: one logical block's bytes per region)
    /// or on a heterogeneous rank's buffers (`block_lens` `None`).
    pub(crate) fn new(
        geometry: KvGeometry,
        regions: Vec<RoutedRegion>,
        block_lens: Option<Vec<u64>>,
        logical_blocks: u32,
    ) -> KvCache {
        let regions = regions
            .into_iter()
            .enumerate()
            .map(|(i, region)| CacheRegion {
                region,
                block_len: block_lens.as_ref().and_then(|l| l.get(i).copied()),
            })
            .collect();
        KvCache {
            geometry,
            regions,
            logical_blocks,
        }
    }

    /// The rank's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Regions, in the order the engine gave them.
    pub fn num_regions(&self) -> usize {
        self.regions.len()
    }

    /// Logical blocks in every region (0 for a heterogeneous rank's buffers).
    pub fn logical_blocks(&self) -> u32 {
        self.logical_blocks
    }

    /// Bytes in `region`.
    ///
    /// # Errors
    /// [`KvCacheError::NoRegion`].
    pub fn region_len(&self, region: usize) -> Result<u64, KvCacheError> {
        Ok(self.region(region)?.region.len)
    }

    /// Where `region` starts in the transport's address space (what descriptors name: the
    /// engine's own address on NIXL, a synthetic one on the in-memory fabric).
    ///
    /// # Errors
    /// [`KvCacheError::NoRegion`].
    pub fn region_addr(&self, region: usize) -> Result<u64, KvCacheError> {
        Ok(self.region(region)?.region.base)
    }

    /// Bytes of one logical block of `region`.
    ///
    /// # Errors
    /// [`KvCacheError::NoRegion`]; [`KvCacheError::NotBlocks`] on a heterogeneous rank.
    pub fn block_len(&self, region: usize) -> Result<u64, KvCacheError> {
        self.region(region)?
            .block_len
            .ok_or(KvCacheError::NotBlocks)
    }

    /// Copies `bytes` into `region` at `offset`.
    ///
    /// # Errors
    /// [`KvCacheError::NoRegion`]; [`KvCacheError::Access`] out of bounds or after the memory
    /// was released.
    pub fn write(&self, region: usize, offset: u64, bytes: &[u8]) -> Result<(), KvCacheError> {
        Ok(self.region(region)?.region.bytes.write(offset, bytes)?)
    }

    /// Copies `region`'s bytes at `offset` into `buf` (filling it).
    ///
    /// # Errors
    /// As [`KvCache::write`].
    pub fn read(&self, region: usize, offset: u64, buf: &mut [u8]) -> Result<(), KvCacheError> {
        Ok(self.region(region)?.region.bytes.read(offset, buf)?)
    }

    /// Writes logical block `block` of `region`: `bytes` must be exactly one block.
    ///
    /// # Errors
    /// [`KvCacheError::NoRegion`], [`KvCacheError::NoBlock`], [`KvCacheError::BlockLen`],
    /// [`KvCacheError::NotBlocks`], [`KvCacheError::Access`].
    pub fn write_block(&self, region: usize, block: u32, bytes: &[u8]) -> Result<(), KvCacheError> {
        let offset = self.block_offset(region, block, bytes.len())?;
        self.write(region, offset, bytes)
    }

    /// Reads logical block `block` of `region` into `buf`, which must be exactly one block.
    ///
    /// # Errors
    /// As [`KvCache::write_block`].
    pub fn read_block(
        &self,
        region: usize,
        block: u32,
        buf: &mut [u8],
    ) -> Result<(), KvCacheError> {
        let offset = self.block_offset(region, block, buf.len())?;
        self.read(region, offset, buf)
    }

    fn region(&self, region: usize) -> Result<&CacheRegion, KvCacheError> {
        self.regions.get(region).ok_or(KvCacheError::NoRegion {
            region,
            regions: self.regions.len(),
        })
    }

    fn block_offset(&self, region: usize, block: u32, len: usize) -> Result<u64, KvCacheError> {
        let block_len = self.block_len(region)?;
        if block >= self.logical_blocks {
            return Err(KvCacheError::NoBlock {
                block,
                blocks: self.logical_blocks,
            });
        }
        if len as u64 != block_len {
            return Err(KvCacheError::BlockLen {
                expected: block_len,
                got: len,
            });
        }
        // At most `logical_blocks × block_len`, the region's length.
        Ok(u64::from(block) * block_len)
    }
}
