//! The byte pattern P writes and D checks, and the demo model's geometry.
//!
//! Every byte of a request's KV is a function of the request's pairing key and of the byte's
//! coordinates (layer, K/V, token, head, byte in the head's row), so P and D compute it
//! independently, in any process.

use kvhandoff_actors::system::KvPool;
use kvhandoff_protocol::{KvGeometry, KvLayout, PairingKey, RegionKind};

/// The demo model's geometry: 8 layers, 8 KV heads, head dim 128, bf16, 16-token kernel blocks,
/// one kernel block per logical block, HND, one full-attention group, TP 1.
pub fn demo_geometry() -> KvGeometry {
    KvGeometry::dense(8, 8, 128, 2, 16, KvLayout::Hnd)
}

/// A request's pattern key: a hash of its pairing key, which P and D derive independently
/// from their own request ids.
pub fn request_key(key: &PairingKey) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in key.as_str().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn kind_code(kind: RegionKind) -> u64 {
    match kind {
        RegionKind::Key => 1,
        RegionKind::Value => 2,
        RegionKind::Latent => 3,
        RegionKind::State => 4,
    }
}

/// The seed of one head's row of one token: everything but the byte within the row.
fn row_seed(key: u64, layer: u32, kind: RegionKind, token: u64, head: u32) -> u64 {
    let place = (u64::from(layer) << 40) | (kind_code(kind) << 32) | u64::from(head);
    mix(key ^ mix(place) ^ token.wrapping_mul(GOLDEN).rotate_left(17))
}

/// The 8 pattern bytes of word `word` of a row (splitmix64 from the row's seed).
fn row_word(seed: u64, word: u64) -> [u8; 8] {
    mix(seed.wrapping_add(word.wrapping_add(1).wrapping_mul(GOLDEN))).to_le_bytes()
}

/// The byte P writes, and D expects, at byte `dim_byte` (0 ..= head_dim * dtype_bytes - 1) of
/// head `head` of prompt token `token` (counted from the prompt's start), in the `kind` region
/// of layer `layer`, for the request whose [`request_key`] is `key`.
pub fn expected_byte(
    key: u64,
    layer: u32,
    kind: RegionKind,
    token: u64,
    head: u32,
    dim_byte: u32,
) -> u8 {
    let seed = row_seed(key, layer, kind, token, head);
    row_word(seed, u64::from(dim_byte / 8))[(dim_byte % 8) as usize]
}

/// Byte offset, inside one kernel block of an attention region, of byte `dim_byte` of head
/// `head` of the block's `token_in_block`-th token: `[heads, block_size, head_dim]` for HND,
/// `[block_size, heads, head_dim]` for NHD.
pub fn block_byte_offset(
    geometry: &KvGeometry,
    token_in_block: u32,
    head: u32,
    dim_byte: u32,
) -> usize {
    let row = geometry.head_dim as usize * geometry.dtype_bytes as usize;
    let heads = geometry.heads_per_rank() as usize;
    let tokens = geometry.kernel_block_size as usize;
    let (t, h) = (token_in_block as usize, head as usize);
    let row_index = match geometry.layout {
        KvLayout::Hnd => h * tokens + t,
        KvLayout::Nhd => t * heads + h,
    };
    row_index * row + dim_byte as usize
}

/// Fills `out` (one kernel block of an attention region: `heads * block_size * head_dim *
/// dtype_bytes` bytes) with the pattern of the block whose first token is `first_token`. Every
/// slot is written, padding tokens past the prompt's end included (with their token index).
pub fn fill_kernel_block(
    geometry: &KvGeometry,
    key: u64,
    layer: u32,
    kind: RegionKind,
    first_token: u64,
    out: &mut [u8],
) {
    let row = geometry.head_dim as usize * geometry.dtype_bytes as usize;
    let heads = geometry.heads_per_rank();
    let tokens = geometry.kernel_block_size;
    debug_assert_eq!(out.len(), row * heads as usize * tokens as usize);
    // Row strides, as in `block_byte_offset`, hoisted out of the loop.
    let (head_stride, token_stride) = match geometry.layout {
        KvLayout::Hnd => (tokens as usize * row, row),
        KvLayout::Nhd => (row, heads as usize * row),
    };
    for head in 0..heads {
        for t in 0..tokens {
            let seed = row_seed(key, layer, kind, first_token + u64::from(t), head);
            let start = head as usize * head_stride + t as usize * token_stride;
            for (w, chunk) in out[start..start + row].chunks_mut(8).enumerate() {
                let bytes = row_word(seed, w as u64);
                chunk.copy_from_slice(&bytes[..chunk.len()]);
            }
        }
    }
}

/// Fills (or, with `check`, compares) one logical block of a request across every region.
/// Returns the number of differing bytes when checking.
pub(crate) fn pattern_block(
    pool: &KvPool,
    key: u64,
    block: u32,
    block_index: u64,
    check: bool,
    scratch: &mut Vec<u8>,
    actual: &mut Vec<u8>,
) -> Result<u64, String> {
    let g = pool.geometry();
    let kbs = u64::from(g.kernel_block_size);
    let kbpl = u64::from(g.kernel_blocks_per_logical);
    let mut errors = 0u64;
    for (spec, region) in pool.regions() {
        let (offset, len) = pool.block_span(spec, block);
        let len = len as usize;
        let kernel = spec.block_len as usize;
        scratch.resize(len, 0);
        for (s, out) in scratch.chunks_mut(kernel).enumerate() {
            let first = (block_index * kbpl + s as u64) * kbs;
            fill_kernel_block(g, key, spec.layer, spec.kind, first, out);
        }
        if check {
            actual.resize(len, 0);
            region
                .read(offset, actual)
                .map_err(|e| format!("read of block {block}: {e}"))?;
            if actual != scratch {
                errors += actual
                    .iter()
                    .zip(scratch.iter())
                    .filter(|(a, b)| a != b)
                    .count() as u64;
            }
        } else {
            region
                .write(offset, scratch)
                .map_err(|e| format!("write of block {block}: {e}"))?;
        }
    }
    Ok(errors)
}
