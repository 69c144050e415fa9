//! The bench's geometry and the block tables both sides transfer between.

use super::*;

/// The geometry of the request (TP 1, bf16, 16-token kernel blocks, NHD, one full-attention
/// group).
pub fn bench_geometry(options: &TransferOptions) -> KvGeometry {
    KvGeometry::dense(
        options.num_layers,
        options.kv_heads,
        options.head_dim,
        2,
        BLOCK_TOKENS,
        KvLayout::Nhd,
    )
}

/// One block table: P's (local) and D's (remote) ids in token order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTable {
    /// `contiguous` or `fragmented`.
    pub name: &'static str,
    /// P's blocks.
    pub local: BlockIds,
    /// D's blocks.
    pub remote: BlockIds,
}

/// The two block tables of `blocks` blocks, and the pool size (`2 × blocks`) they fit in.
///
/// ```
/// use kvhandoff_bench::transfer::block_tables;
/// let (pool, [contiguous, fragmented]) = block_tables(4);
/// assert_eq!(pool, 8);
/// assert_eq!(contiguous.local.groups[0], [0, 1, 2, 3]);
/// assert_eq!(contiguous.remote.groups[0], [4, 5, 6, 7]);
/// assert_eq!(fragmented.local.groups[0], [1, 3, 5, 7]);
/// assert!(fragmented.remote.groups[0].iter().all(|b| b % 2 == 0));
/// ```
pub fn block_tables(blocks: u32) -> (u32, [BlockTable; 2]) {
    let n = blocks;
    let contiguous = BlockTable {
        name: "contiguous",
        local: BlockIds::single_group((0..n).collect()),
        remote: BlockIds::single_group((n..2 * n).collect()),
    };
    // Odd ids locally; even ids remotely, visited by a permutation `i -> (i * a + c) mod n` with
    // `a` coprime to `n`. No two ids of a side are adjacent, so no run merges.
    let a = (n / 2..n.max(2))
        .map(|a| a | 1)
        .find(|&a| gcd(a, n) == 1)
        .unwrap_or(1);
    let c = n / 3;
    let fragmented = BlockTable {
        name: "fragmented",
        local: BlockIds::single_group((0..n).map(|i| 2 * i + 1).collect()),
        remote: BlockIds::single_group(
            (0..n)
                .map(|i| 2 * ((u64::from(i) * u64::from(a) + u64::from(c)) % u64::from(n)) as u32)
                .collect(),
        ),
    };
    (2 * n, [contiguous, fragmented])
}

pub(super) fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

// ---------------------------------------------------------------------------------------------
// Statistics.

pub(super) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
