//! The byte patterns every harness writes and checks: the one function from a byte's
//! coordinates to its value, used by the demo and the node (homogeneous pools, checked block by
//! block: [`fill_kernel_block`], [`pattern_block`]), by the heterogeneous executor (the
//! reference KV in any geometry: [`reference_row`], checked arena by arena in
//! `hetero::verify`, which also locates and classifies a wrong byte) and by the benches' pools.
//!
//! A row is one head's bytes of one token in one part of one layer (for a Mamba state, one
//! state head's bytes with token 0). Its seed mixes the request's key and the row's
//! coordinates ([`row_seed`]); byte `b` of the row is byte `b % 8` of the 64-bit word `b / 8`
//! of a counter-based stream from that seed ([`row_word`]), so any byte is computed on its
//! own, in any process. A row written to the wrong request, layer, part, head or token differs
//! from the expected one in nearly every byte, and so does [`junk`].
//!
//! The benches' placement stamps (`kvhandoff-bench`, `stamps`) are not these patterns: they
//! tag only a block's two ends, so that checking a transfer of gigabytes costs nothing next to
//! the transfer.

use kvhandoff::KvCache;
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

/// The key of the heterogeneous executor's reference KV: it depends on the row alone, not on
/// the request.
pub const REFERENCE_KEY: u64 = 0;

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finaliser: a bijective mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Which part of a layer a row belongs to (a Mamba state splits into its two halves).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// Keys.
    Key,
    /// Values.
    Value,
    /// MLA's latent.
    Latent,
    /// Mamba convolution state.
    Conv,
    /// Mamba SSM state.
    Ssm,
}

impl Part {
    /// The attention part of a region kind (`None` for state, which has two parts).
    pub fn of(kind: RegionKind) -> Option<Part> {
        match kind {
            RegionKind::Key => Some(Part::Key),
            RegionKind::Value => Some(Part::Value),
            RegionKind::Latent => Some(Part::Latent),
            RegionKind::State => None,
        }
    }

    /// The part a homogeneous pool's region is filled as, row by row: a state region as its
    /// first half.
    pub fn of_region(kind: RegionKind) -> Part {
        Part::of(kind).unwrap_or(Part::Conv)
    }

    fn code(self) -> u64 {
        match self {
            Part::Key => 1,
            Part::Value => 2,
            Part::Latent => 3,
            Part::Conv => 4,
            Part::Ssm => 5,
        }
    }
}

/// The seed of one row: everything but the byte within the row.
pub fn row_seed(key: u64, layer: u32, part: Part, head: u32, token: u64) -> u64 {
    let place = (u64::from(layer) << 40) | (part.code() << 32) | u64::from(head);
    mix(key ^ mix(place) ^ token.wrapping_mul(GOLDEN).rotate_left(17))
}

/// The 8 pattern bytes of word `word` of a row (splitmix64 from the row's seed).
pub fn row_word(seed: u64, word: u64) -> [u8; 8] {
    mix(seed.wrapping_add(word.wrapping_add(1).wrapping_mul(GOLDEN))).to_le_bytes()
}

/// Fills `out` with the stream seeded by `seed`: word `w` of it is [`row_word`]`(seed, w)`.
pub fn fill_row(seed: u64, out: &mut [u8]) {
    for (w, chunk) in out.chunks_mut(8).enumerate() {
        let bytes = row_word(seed, w as u64);
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
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
    let seed = row_seed(key, layer, Part::of_region(kind), head, token);
    row_word(seed, u64::from(dim_byte / 8))[(dim_byte % 8) as usize]
}

/// Fills `out` with the reference row of `(layer, part, head, token)` of the heterogeneous
/// executor (key [`REFERENCE_KEY`]; `head` counted over the whole model); for state, `token`
/// is 0 and the "row" is one state head's bytes.
pub fn reference_row(layer: u32, part: Part, head: u32, token: u64, out: &mut [u8]) {
    fill_row(row_seed(REFERENCE_KEY, layer, part, head, token), out);
}

/// The reference value of one byte (what [`reference_row`] writes at `byte`).
///
/// ```
/// use kvhandoff_testkit::pattern::{reference_byte, reference_row, Part};
/// let mut row = [0u8; 16];
/// reference_row(3, Part::Value, 5, 100, &mut row);
/// assert_eq!(reference_byte(3, Part::Value, 5, 100, 9), row[9]);
/// assert_ne!(reference_byte(3, Part::Value, 6, 100, 9), row[9]); // another head
/// ```
pub fn reference_byte(layer: u32, part: Part, head: u32, token: u64, byte: usize) -> u8 {
    let seed = row_seed(REFERENCE_KEY, layer, part, head, token);
    row_word(seed, (byte / 8) as u64)[byte % 8]
}

/// Junk for arena `arena` under `seed`: what unwritten memory holds.
pub fn junk(seed: u64, arena: usize, out: &mut [u8]) {
    fill_row(
        mix(seed ^ 0xdead_beef) ^ (arena as u64).wrapping_mul(0x1000_0000_01b3),
        out,
    );
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
/// slot is written, padding tokens past the prompt's end included (with their token index);
/// each of the rank's heads is seeded by its head index in the model (so TP ranks differ).
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
    let part = Part::of_region(kind);
    debug_assert_eq!(out.len(), row * heads as usize * tokens as usize);
    // Row strides, as in `block_byte_offset`, hoisted out of the loop.
    let (head_stride, token_stride) = match geometry.layout {
        KvLayout::Hnd => (tokens as usize * row, row),
        KvLayout::Nhd => (row, heads as usize * row),
    };
    // The model's head, so that each TP rank's bytes differ (a rank paired with the wrong
    // peer rank fails the check).
    let first_head = if geometry.mla {
        0
    } else {
        (geometry.tp_rank * heads) % geometry.total_kv_heads.max(1)
    };
    for head in 0..heads {
        for t in 0..tokens {
            let seed = row_seed(
                key,
                layer,
                part,
                first_head + head,
                first_token + u64::from(t),
            );
            let start = head as usize * head_stride + t as usize * token_stride;
            fill_row(seed, &mut out[start..start + row]);
        }
    }
}

/// Fills (or, with `check`, compares) one logical block of a request across every region of a
/// rank's [`KvCache`] (the engine's own memory, as the rank registered it). Returns the number
/// of differing bytes when checking.
pub fn pattern_block(
    kv: &KvCache,
    key: u64,
    block: u32,
    block_index: u64,
    check: bool,
    scratch: &mut Vec<u8>,
    actual: &mut Vec<u8>,
) -> Result<u64, String> {
    let g = kv.geometry();
    let kbs = u64::from(g.kernel_block_size);
    let kbpl = u64::from(g.kernel_blocks_per_logical);
    let specs = g
        .regions()
        .map_err(|e| format!("the cache's geometry: {e}"))?;
    let mut errors = 0u64;
    for (index, spec) in specs.iter().enumerate() {
        let len = kv
            .block_len(index)
            .map_err(|e| format!("block {block}: {e}"))? as usize;
        let kernel = spec.block_len as usize;
        scratch.resize(len, 0);
        for (s, out) in scratch.chunks_mut(kernel).enumerate() {
            let first = (block_index * kbpl + s as u64) * kbs;
            fill_kernel_block(g, key, spec.layer, spec.kind, first, out);
        }
        if check {
            actual.resize(len, 0);
            kv.read_block(index, block, actual)
                .map_err(|e| format!("read of block {block}: {e}"))?;
            if actual != scratch {
                errors += actual
                    .iter()
                    .zip(scratch.iter())
                    .filter(|(a, b)| a != b)
                    .count() as u64;
            }
        } else {
            kv.write_block(index, block, scratch)
                .map_err(|e| format!("write of block {block}: {e}"))?;
        }
    }
    Ok(errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each TP rank holds other heads of the model, so its pattern differs: bytes a rank got
    /// from the wrong peer rank fail the check.
    #[test]
    fn tp_ranks_hold_different_bytes() {
        let block = |tp_rank| {
            let g = KvGeometry {
                tp_size: 2,
                tp_rank,
                ..demo_geometry()
            };
            let len = g.attention_block_len().unwrap() as usize;
            let mut out = vec![0u8; len];
            fill_kernel_block(&g, 7, 0, RegionKind::Key, 0, &mut out);
            out
        };
        assert_ne!(block(0), block(1));
        let whole = demo_geometry();
        let mut rank0_of_one = vec![0u8; whole.attention_block_len().unwrap() as usize];
        fill_kernel_block(&whole, 7, 0, RegionKind::Key, 0, &mut rank0_of_one);
        // At TP 1 the pattern is what it always was (rank 0's heads lead it in HND).
        assert_eq!(&rank0_of_one[..block(0).len()], &block(0)[..]);
    }

    #[test]
    fn every_coordinate_changes_the_row() {
        let row = |layer, part, head, token| {
            let mut r = [0u8; 16];
            reference_row(layer, part, head, token, &mut r);
            r
        };
        let base = row(1, Part::Key, 2, 3);
        for other in [
            row(0, Part::Key, 2, 3),
            row(1, Part::Value, 2, 3),
            row(1, Part::Key, 1, 3),
            row(1, Part::Key, 2, 4),
        ] {
            let same = base.iter().zip(&other).filter(|(a, b)| a == b).count();
            assert!(same <= 2, "{base:?} vs {other:?}");
        }
    }
}
