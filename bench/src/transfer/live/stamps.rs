//! Stamps: proof that every block landed where the table says.

use super::*;

pub(super) fn tag(region: usize, block: u32) -> [u8; 8] {
    (((region as u64) << 32 | u64::from(block)) ^ 0x6b76_6861_6e64_6f66).to_le_bytes()
}

pub(super) fn ends(block: u32, block_bytes: u64) -> [u64; 2] {
    let start = u64::from(block) * block_bytes;
    [start, start + block_bytes - 8]
}

/// Writes a non-zero pattern over the first `len` bytes of every region.
pub(super) fn fill(regions: &[&dyn RegionBytes], len: u64) -> Result<(), TransferBenchError> {
    const CHUNK: u64 = 1 << 20;
    for (r, region) in regions.iter().enumerate() {
        let pattern: Vec<u8> = (0..CHUNK)
            .map(|i| (i as u8).wrapping_mul(31) ^ (r as u8) ^ 0xa5)
            .collect();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(CHUNK);
            region
                .write(at, &pattern[..n as usize])
                .map_err(|e| run_error(format!("fill: {e}")))?;
            at += n;
        }
    }
    Ok(())
}

pub(super) fn stamp(
    regions: &[&dyn RegionBytes],
    block_bytes: u64,
    blocks: &[u32],
) -> Result<(), TransferBenchError> {
    for (r, region) in regions.iter().enumerate() {
        for &b in blocks {
            for at in ends(b, block_bytes) {
                region
                    .write(at, &tag(r, b))
                    .map_err(|e| run_error(format!("stamp: {e}")))?;
            }
        }
    }
    Ok(())
}

pub(super) fn clear(
    regions: &[&dyn RegionBytes],
    block_bytes: u64,
    blocks: &[u32],
) -> Result<(), TransferBenchError> {
    for region in regions {
        for &b in blocks {
            for at in ends(b, block_bytes) {
                region
                    .write(at, &[0; 8])
                    .map_err(|e| run_error(format!("clear: {e}")))?;
            }
        }
    }
    Ok(())
}

pub(super) fn check(
    what: &str,
    regions: &[&dyn RegionBytes],
    block_bytes: u64,
    (local, remote): (&[u32], &[u32]),
) -> Result<(), TransferBenchError> {
    let mut buf = [0u8; 8];
    for (r, region) in regions.iter().enumerate() {
        for (&l, &d) in local.iter().zip(remote) {
            for at in ends(d, block_bytes) {
                region
                    .read(at, &mut buf)
                    .map_err(|e| run_error(format!("check: {e}")))?;
                if buf != tag(r, l) {
                    return Err(run_error(format!(
                        "{what}: region {r} block {d} does not hold P's block {l}"
                    )));
                }
            }
        }
    }
    Ok(())
}
