//! Stamps: proof that every block a transfer moved landed where its table says, for the
//! benches that move bytes (`transfer`, `turns`).
//!
//! These are not the test kit's byte patterns (`kvhandoff_testkit::pattern`, every byte of a
//! block a function of its coordinates, checked in full): a bench moves gigabytes in its timed
//! loop, so only a block's first and last 8 bytes carry a tag naming the block they came from
//! (its region and its id in the source table); the rest of the memory holds a plain filler
//! written once, so that no page is the shared zero page when the first transfer touches it.

#[cfg(feature = "nixl")]
use kvhandoff::KvCache;
use kvhandoff_actors::system::{KvPool, RegionBytes};

/// One region's bytes, as a stamp reads and writes them.
pub(crate) trait StampRegion {
    /// Copies `bytes` into the region at `offset`.
    fn put(&self, offset: u64, bytes: &[u8]) -> Result<(), String>;
    /// Copies the region's bytes at `offset` into `buf`.
    fn get(&self, offset: u64, buf: &mut [u8]) -> Result<(), String>;
}

impl StampRegion for &dyn RegionBytes {
    fn put(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.write(offset, bytes).map_err(|e| e.to_string())
    }

    fn get(&self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        self.read(offset, buf).map_err(|e| e.to_string())
    }
}

/// Region `.1` of a rank's [`KvCache`] (the engine's own memory).
#[cfg(feature = "nixl")]
pub(crate) struct CacheRegion<'a>(&'a KvCache, usize);

#[cfg(feature = "nixl")]
impl StampRegion for CacheRegion<'_> {
    fn put(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.0
            .write(self.1, offset, bytes)
            .map_err(|e| e.to_string())
    }

    fn get(&self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        self.0.read(self.1, offset, buf).map_err(|e| e.to_string())
    }
}

/// Every region of `kv`, in the engine's order.
#[cfg(feature = "nixl")]
pub(crate) fn cache_regions(kv: &KvCache) -> Vec<CacheRegion<'_>> {
    (0..kv.num_regions()).map(|r| CacheRegion(kv, r)).collect()
}

/// The tag of block `block` of region `region` of the source.
fn tag(region: usize, block: u32) -> [u8; 8] {
    (((region as u64) << 32 | u64::from(block)) ^ 0x6b76_6861_6e64_6f66).to_le_bytes()
}

/// The offsets of a block's first and last 8 bytes.
fn ends(block: u32, block_bytes: u64) -> [u64; 2] {
    let start = u64::from(block) * block_bytes;
    [start, start + block_bytes - 8]
}

/// The byte access of every region of `pool`, in the pool's order.
pub(crate) fn pool_regions(pool: &KvPool) -> Vec<&dyn RegionBytes> {
    pool.regions().map(|(_, bytes)| bytes).collect()
}

/// The bytes of one logical block of `pool` (the same in each of its regions).
pub(crate) fn pool_block_bytes(pool: &KvPool) -> u64 {
    pool.regions()
        .next()
        .map_or(0, |(spec, _)| pool.block_span(spec, 0).1)
}

/// Writes a non-zero filler over the first `len` bytes of every region.
pub(crate) fn fill(regions: &[impl StampRegion], len: u64) -> Result<(), String> {
    const CHUNK: u64 = 1 << 20;
    for (r, region) in regions.iter().enumerate() {
        let pattern: Vec<u8> = (0..CHUNK)
            .map(|i| (i as u8).wrapping_mul(31) ^ (r as u8) ^ 0xa5)
            .collect();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(CHUNK);
            region
                .put(at, &pattern[..n as usize])
                .map_err(|e| format!("fill: {e}"))?;
            at += n;
        }
    }
    Ok(())
}

/// Tags both ends of `blocks` (of `block_bytes` each) in every region of the source.
pub(crate) fn stamp(
    regions: &[impl StampRegion],
    block_bytes: u64,
    blocks: &[u32],
) -> Result<(), String> {
    for (r, region) in regions.iter().enumerate() {
        for &b in blocks {
            for at in ends(b, block_bytes) {
                region
                    .put(at, &tag(r, b))
                    .map_err(|e| format!("stamp: {e}"))?;
            }
        }
    }
    Ok(())
}

/// Zeroes both ends of `blocks` in every region of the destination, before a transfer into
/// them.
pub(crate) fn clear(
    regions: &[impl StampRegion],
    block_bytes: u64,
    blocks: &[u32],
) -> Result<(), String> {
    for region in regions {
        for &b in blocks {
            for at in ends(b, block_bytes) {
                region.put(at, &[0; 8]).map_err(|e| format!("clear: {e}"))?;
            }
        }
    }
    Ok(())
}

/// Checks that block `destination[i]` of every region of the destination carries the tags of
/// block `source[i]` of the source.
pub(crate) fn check(
    what: &str,
    regions: &[impl StampRegion],
    block_bytes: u64,
    (source, destination): (&[u32], &[u32]),
) -> Result<(), String> {
    let mut buf = [0u8; 8];
    for (r, region) in regions.iter().enumerate() {
        for (&s, &d) in source.iter().zip(destination) {
            for at in ends(d, block_bytes) {
                region
                    .get(at, &mut buf)
                    .map_err(|e| format!("check: {e}"))?;
                if buf != tag(r, s) {
                    return Err(format!(
                        "{what}: region {r} block {d} does not hold the source's block {s}"
                    ));
                }
            }
        }
    }
    Ok(())
}
