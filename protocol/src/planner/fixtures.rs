//! The fragmented Llama-3.3-70B case vLLM reported, shared by the doc tests, the tests and the
//! benchmarks (hidden from the documentation).

use super::{BlockIds, KvGeometry, RegionDesc};

/// Blocks per transfer in [`fragmented_70b_case`].
#[doc(hidden)]
pub const FRAGMENTED_70B_BLOCKS: u32 = 118;

/// The fragmented Llama-3.3-70B transfer vLLM reported (PR 35264): TP 8 (1 KV head per rank),
/// 80 layers, head_dim 128, bf16, 16-token kernel blocks, NHD, K and V regions per layer
/// (160 regions of 20,000 blocks), and 118 blocks of which no two are adjacent on either side,
/// so the minimal plan has 118 × 160 = 18,880 descriptors.
///
/// Returns `(geometry, local regions, remote regions, local ids, remote ids)`; the geometry holds
/// on both sides. Local ids ascend; remote ids are scattered in no order.
#[doc(hidden)]
pub fn fragmented_70b_case() -> (
    KvGeometry,
    Vec<RegionDesc>,
    Vec<RegionDesc>,
    BlockIds,
    BlockIds,
) {
    fragmented_70b_case_with_runs(FRAGMENTED_70B_BLOCKS)
}

/// [`fragmented_70b_case`] with the same 118 blocks split into `runs` maximal runs (clamped to
/// `1..=118`) that are contiguous on both sides, so the minimal plan has `runs × 160`
/// descriptors.
#[doc(hidden)]
pub fn fragmented_70b_case_with_runs(
    runs: u32,
) -> (
    KvGeometry,
    Vec<RegionDesc>,
    Vec<RegionDesc>,
    BlockIds,
    BlockIds,
) {
    use crate::geometry::{CacheGroup, CacheGroupKind, KvLayout};
    const NUM_BLOCKS: u32 = 20_000;
    let geometry = KvGeometry {
        num_layers: 80,
        total_kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        kernel_block_size: 16,
        kernel_blocks_per_logical: 1,
        layout: KvLayout::Nhd,
        tp_size: 8,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: vec![CacheGroup {
            kind: CacheGroupKind::FullAttention,
            num_layers: 80,
        }],
    };
    // 16 tokens × 1 head × 128 × 2 bytes.
    let block_len: u64 = 4096;
    let region_len = u64::from(NUM_BLOCKS) * block_len;
    // Regions sit 2 MiB apart, as separate allocations would.
    let pitch = region_len + (2 << 20);
    let table = |base: u64| {
        (0..160u64)
            .map(|i| RegionDesc {
                base: base + i * pitch,
                len: region_len,
                num_blocks: NUM_BLOCKS,
                block_len,
            })
            .collect::<Vec<_>>()
    };
    let runs = runs.clamp(1, FRAGMENTED_70B_BLOCKS);
    let mut local = Vec::with_capacity(FRAGMENTED_70B_BLOCKS as usize);
    let mut remote = Vec::with_capacity(FRAGMENTED_70B_BLOCKS as usize);
    for run in 0..runs {
        // Split 118 blocks into `runs` near-equal runs.
        let first = run * FRAGMENTED_70B_BLOCKS / runs;
        let last = (run + 1) * FRAGMENTED_70B_BLOCKS / runs;
        // Runs start 150 blocks apart locally; remotely they are scattered by a permutation of
        // the run index (97 is coprime with the 128 slots), 150 blocks apart as well.
        let local_start = 100 + run * 150;
        let remote_start = 40 + ((run * 97 + 13) % 128) * 150;
        for k in 0..(last - first) {
            local.push(local_start + k);
            remote.push(remote_start + k);
        }
    }
    (
        geometry,
        table(0x7f00_0000_0000),
        table(0x7e00_0000_0000),
        BlockIds::single_group(local),
        BlockIds::single_group(remote),
    )
}
