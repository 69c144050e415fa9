//! The reference KV: the value every byte of a request's cache must have, whatever geometry
//! holds it, and the junk that fills everything else.
//!
//! A row's bytes depend on (layer, part, global head, token) through a 64-bit mix, and byte `b`
//! of the row is byte `b` of the stream seeded by it: a row written to the wrong head, token,
//! layer or part differs from the expected one in nearly every byte, and so does junk.

use kvhandoff_protocol::RegionKind;

/// Which part of a layer a row belongs to (the state splits into its two halves).
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

/// SplitMix64's finaliser: a bijective mix of 64 bits.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Fills `out` with the reference row of `(layer, part, head, token)`; for state, `token` is 0
/// and the "row" is one state head's bytes.
pub fn reference_row(layer: u32, part: Part, head: u32, token: u64, out: &mut [u8]) {
    let key = mix(u64::from(layer) << 40 ^ part.code() << 32 ^ u64::from(head))
        ^ mix(token ^ 0x5555_0000_0000_0000);
    fill_stream(mix(key), out);
}

/// The reference value of one byte (what [`reference_row`] writes at `byte`).
///
/// ```
/// use kvhandoff_testkit::hetero::reference::{reference_byte, reference_row, Part};
/// let mut row = [0u8; 16];
/// reference_row(3, Part::Value, 5, 100, &mut row);
/// assert_eq!(reference_byte(3, Part::Value, 5, 100, 9), row[9]);
/// assert_ne!(reference_byte(3, Part::Value, 6, 100, 9), row[9]); // another head
/// ```
pub fn reference_byte(layer: u32, part: Part, head: u32, token: u64, byte: usize) -> u8 {
    let mut row = vec![0u8; byte + 1];
    reference_row(layer, part, head, token, &mut row);
    row[byte]
}

/// Fills `out` with the stream seeded by `seed` (8 bytes per step).
pub fn fill_stream(mut seed: u64, out: &mut [u8]) {
    for chunk in out.chunks_mut(8) {
        seed = mix(seed);
        let bytes = seed.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// Junk for arena `arena` under `seed`: what unwritten memory holds.
pub fn junk(seed: u64, arena: usize, out: &mut [u8]) {
    fill_stream(
        mix(seed ^ 0xdead_beef) ^ (arena as u64).wrapping_mul(0x1000_0000_01b3),
        out,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

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
