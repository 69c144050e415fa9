//! Tests of the descriptor planner: fixed cases, every error, the fragmented 70B transfer vLLM
//! reported, and properties over random block tables.

use std::collections::HashSet;

use kvhandoff_protocol::planner::{
    block_runs, descriptor_count, fragmented_70b_case, fragmented_70b_case_with_runs,
    plan_transfer, Descriptor, PlanError, PlanInput, PlanSummary, Planner, Side, TransferPlan,
};
use kvhandoff_protocol::{
    BlockIds, CacheGroup, CacheGroupKind, KvGeometry, KvLayout, RegionDesc, RegionKind, RegionSpec,
};
use proptest::prelude::*;

const LOCAL_BASE: u64 = 0x1_0000_0000;
const REMOTE_BASE: u64 = 0x9_0000_0000;
/// Distance between consecutive regions of a table.
const PITCH: u64 = 0x1000_0000;

fn geometry(groups: &[u32], kbpl: u32) -> KvGeometry {
    let num_layers = groups.iter().sum();
    KvGeometry {
        num_layers,
        total_kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
        kernel_block_size: 16,
        kernel_blocks_per_logical: kbpl,
        layout: KvLayout::Hnd,
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: groups
            .iter()
            .map(|&num_layers| CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers,
            })
            .collect(),
    }
}

/// One region per spec, `PITCH` apart from `base`, each with `num_blocks` kernel blocks.
fn table(specs: &[RegionSpec], base: u64, num_blocks: u32) -> Vec<RegionDesc> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| RegionDesc {
            base: base + i as u64 * PITCH,
            len: u64::from(num_blocks) * s.block_len,
            num_blocks,
            block_len: s.block_len,
        })
        .collect()
}

/// A valid setup: `layers[g]` layers in group `g` (K and V each), 100 logical blocks per side.
struct Setup {
    specs: Vec<RegionSpec>,
    local: Vec<RegionDesc>,
    remote: Vec<RegionDesc>,
    kbpl: u32,
}

impl Setup {
    fn new(layers: &[u32], kbpl: u32) -> Self {
        let specs = geometry(layers, kbpl).regions().unwrap();
        Self {
            local: table(&specs, LOCAL_BASE, 100 * kbpl),
            remote: table(&specs, REMOTE_BASE, 100 * kbpl),
            specs,
            kbpl,
        }
    }

    fn plan(&self, local: &BlockIds, remote: &BlockIds) -> Result<TransferPlan, PlanError> {
        let input = PlanInput::new(
            &self.local,
            &self.remote,
            &self.specs,
            local,
            remote,
            self.kbpl,
        );
        let plan = plan_transfer(&input);
        // The count-only path always agrees with the full plan.
        assert_eq!(
            descriptor_count(&input),
            plan.as_ref()
                .map(TransferPlan::descriptor_count)
                .map_err(Clone::clone)
        );
        plan
    }

    fn block_len(&self) -> u64 {
        self.specs[0].block_len
    }
}

fn one(ids: &[u32]) -> BlockIds {
    BlockIds::single_group(ids.to_vec())
}

#[test]
fn contiguous_blocks_make_one_descriptor_per_region() {
    let s = Setup::new(&[3], 1);
    let plan = s
        .plan(&one(&[10, 11, 12, 13]), &one(&[40, 41, 42, 43]))
        .unwrap();
    assert_eq!(plan.descriptor_count(), 6);
    let bl = s.block_len();
    for (i, d) in plan.descriptors.iter().enumerate() {
        let i = i as u64;
        assert_eq!(
            *d,
            Descriptor {
                local_addr: LOCAL_BASE + i * PITCH + 10 * bl,
                remote_addr: REMOTE_BASE + i * PITCH + 40 * bl,
                len: 4 * bl,
            }
        );
    }
    assert_eq!(plan.bytes, 6 * 4 * bl);
}

#[test]
fn scattered_blocks_make_one_descriptor_per_block_per_region() {
    let s = Setup::new(&[3], 1);
    let plan = s.plan(&one(&[1, 3, 5, 7]), &one(&[2, 4, 6, 8])).unwrap();
    assert_eq!(plan.descriptor_count(), 4 * 6);
    assert!(plan.descriptors.iter().all(|d| d.len == s.block_len()));
    // Contiguous on one side only is still scattered.
    let plan = s.plan(&one(&[1, 2, 3]), &one(&[9, 7, 5])).unwrap();
    assert_eq!(plan.descriptor_count(), 3 * 6);
}

#[test]
fn mixed_runs_are_merged_where_both_sides_are_contiguous() {
    let s = Setup::new(&[1], 1);
    let bl = s.block_len();
    // Runs: 4..=6 → 20..=22, 7 → 30, 9..=10 → 31..=32, 50 → 0.
    let plan = s
        .plan(
            &one(&[4, 5, 6, 7, 9, 10, 50]),
            &one(&[20, 21, 22, 30, 31, 32, 0]),
        )
        .unwrap();
    let expect = |l: u64, r: u64, n: u64, region: u64| Descriptor {
        local_addr: LOCAL_BASE + region * PITCH + l * bl,
        remote_addr: REMOTE_BASE + region * PITCH + r * bl,
        len: n * bl,
    };
    let mut want = Vec::new();
    for region in 0..2 {
        want.extend([
            expect(4, 20, 3, region),
            expect(7, 30, 1, region),
            expect(9, 31, 2, region),
            expect(50, 0, 1, region),
        ]);
    }
    assert_eq!(plan.descriptors, want);
}

#[test]
fn unordered_lists_still_merge_to_the_minimum() {
    let s = Setup::new(&[1], 1);
    // In token order nothing is adjacent, but 1→11, 2→12, 3→13 form one run by address.
    let plan = s
        .plan(&one(&[3, 1, 2, 40]), &one(&[13, 11, 12, 41]))
        .unwrap();
    assert_eq!(plan.descriptor_count(), 2 * 2);
    assert_eq!(plan.descriptors[0].len, 3 * s.block_len());
}

#[test]
fn partial_prefix_hit_writes_the_local_tail() {
    // §10.1 test 40: P holds [10..14], D registered [500, 501] → local [13, 14] → [500, 501].
    let mut s = Setup::new(&[1], 1);
    s.remote = table(&s.specs, REMOTE_BASE, 1000);
    let plan = s
        .plan(&one(&[10, 11, 12, 13, 14]), &one(&[500, 501]))
        .unwrap();
    let bl = s.block_len();
    assert_eq!(
        plan.descriptors,
        [
            Descriptor {
                local_addr: LOCAL_BASE + 13 * bl,
                remote_addr: REMOTE_BASE + 500 * bl,
                len: 2 * bl
            },
            Descriptor {
                local_addr: LOCAL_BASE + PITCH + 13 * bl,
                remote_addr: REMOTE_BASE + PITCH + 500 * bl,
                len: 2 * bl
            },
        ]
    );
    // The trimmed head is neither moved nor range-checked against the remote.
    let plan = s.plan(&one(&[99, 98, 5]), &one(&[7])).unwrap();
    assert_eq!(plan.descriptors[0].local_addr, LOCAL_BASE + 5 * bl);
}

#[test]
fn full_prefix_hit_moves_nothing() {
    let s = Setup::new(&[2], 1);
    let plan = s.plan(&one(&[1, 2, 3]), &one(&[])).unwrap();
    assert_eq!(plan, TransferPlan::default());
    let plan = s.plan(&one(&[]), &one(&[])).unwrap();
    assert_eq!(plan.descriptor_count(), 0);
}

#[test]
fn kernel_blocks_per_logical_scale_addresses_and_lengths() {
    let s = Setup::new(&[1], 4);
    let bl = s.block_len();
    let plan = s.plan(&one(&[2, 3, 8]), &one(&[5, 6, 99])).unwrap();
    assert_eq!(
        plan.descriptors[..2],
        [
            Descriptor {
                local_addr: LOCAL_BASE + 2 * 4 * bl,
                remote_addr: REMOTE_BASE + 5 * 4 * bl,
                len: 2 * 4 * bl
            },
            Descriptor {
                local_addr: LOCAL_BASE + 8 * 4 * bl,
                remote_addr: REMOTE_BASE + 99 * 4 * bl,
                len: 4 * bl
            },
        ]
    );
    assert_eq!(plan.descriptor_count(), 4);
    assert_eq!(plan.bytes, 2 * 3 * 4 * bl);
}

#[test]
fn cache_groups_use_their_own_lists() {
    // Group 0 has 2 layers (4 regions), group 1 has 1 layer (2 regions).
    let s = Setup::new(&[2, 1], 1);
    let local = BlockIds {
        groups: vec![vec![1, 2, 3], vec![10, 20, 30, 31]],
    };
    let remote = BlockIds {
        groups: vec![vec![4, 5, 6], vec![60, 61]],
    };
    let plan = s.plan(&local, &remote).unwrap();
    // Group 0: one run in each of 4 regions; group 1: tail [30, 31] → [60, 61], one run × 2.
    assert_eq!(plan.descriptor_count(), 4 + 2);
    let bl = s.block_len();
    assert_eq!(plan.descriptors[3].local_addr, LOCAL_BASE + 3 * PITCH + bl);
    assert_eq!(
        plan.descriptors[4],
        Descriptor {
            local_addr: LOCAL_BASE + 4 * PITCH + 30 * bl,
            remote_addr: REMOTE_BASE + 4 * PITCH + 60 * bl,
            len: 2 * bl,
        }
    );
    assert_eq!(plan.bytes, (4 * 3 + 2 * 2) * bl);
}

#[test]
fn plan_into_reuses_and_clears_the_buffer() {
    let s = Setup::new(&[2], 1);
    let (local, remote) = (one(&[1, 3]), one(&[1, 3]));
    let input = PlanInput::new(&s.local, &s.remote, &s.specs, &local, &remote, 1);
    let mut planner = Planner::new();
    let mut out = vec![Descriptor {
        local_addr: 1,
        remote_addr: 2,
        len: 3,
    }];
    let summary = planner.plan_into(&input, &mut out).unwrap();
    assert_eq!(
        summary,
        PlanSummary {
            descriptors: 8,
            bytes: 8 * s.block_len()
        }
    );
    assert_eq!(out, plan_transfer(&input).unwrap().descriptors);
    assert_eq!(planner.summary(&input).unwrap(), summary);
    // An error leaves the buffer empty.
    let bad = one(&[1, 300]);
    let input = PlanInput::new(&s.local, &s.remote, &s.specs, &bad, &remote, 1);
    assert!(planner.plan_into(&input, &mut out).is_err());
    assert!(out.is_empty());
}

#[test]
fn block_runs_is_public_and_lazy() {
    let mut runs = block_runs(&[1, 2, 5], &[1, 2, 3]);
    let first = runs.next().unwrap();
    assert_eq!((first.local, first.remote, first.len), (1, 1, 2));
    assert_eq!((first.local_end(), first.remote_end()), (3, 3));
    assert_eq!(runs.count(), 1);
}

// ---------------------------------------------------------------------------------------------
// Errors: one test per variant.

#[test]
fn error_region_count_mismatch() {
    let mut s = Setup::new(&[2], 1);
    s.remote.pop();
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::RegionCountMismatch {
            local: 4,
            remote: 3
        })
    );
}

#[test]
fn error_spec_count_mismatch() {
    let mut s = Setup::new(&[2], 1);
    s.specs.pop();
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::SpecCountMismatch {
            specs: 3,
            regions: 4
        })
    );
}

#[test]
fn error_block_len_mismatch() {
    let mut s = Setup::new(&[2], 1);
    let bl = s.block_len();
    s.remote[2].block_len = bl / 2;
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::BlockLenMismatch {
            region: 2,
            local: bl,
            remote: bl / 2
        })
    );
}

#[test]
fn error_spec_block_len_mismatch() {
    let mut s = Setup::new(&[2], 1);
    let bl = s.block_len();
    s.specs[1].block_len = 7;
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::SpecBlockLenMismatch {
            region: 1,
            spec: 7,
            registered: bl
        })
    );
}

#[test]
fn error_invalid_region() {
    let mut s = Setup::new(&[1], 1);
    s.local[1].len -= 1;
    assert!(matches!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::InvalidRegion {
            side: Side::Local,
            region: 1,
            ..
        })
    ));
    let mut s = Setup::new(&[1], 1);
    s.remote[0].block_len = 0;
    assert!(matches!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::InvalidRegion {
            side: Side::Remote,
            region: 0,
            why: "block_len is zero"
        })
    ));
}

#[test]
fn error_address_overflow() {
    let mut s = Setup::new(&[1], 1);
    s.remote[1].base = u64::MAX - s.remote[1].len + 1;
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::AddressOverflow {
            side: Side::Remote,
            region: 1
        })
    );
    // num_blocks * block_len itself overflows.
    let mut s = Setup::new(&[1], 1);
    for table in [&mut s.local, &mut s.remote] {
        for r in table.iter_mut() {
            r.block_len = 1 << 40;
            r.num_blocks = 1 << 30;
        }
    }
    for spec in &mut s.specs {
        spec.block_len = 1 << 40;
    }
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::AddressOverflow {
            side: Side::Local,
            region: 0
        })
    );
}

#[test]
fn error_zero_kernel_blocks_per_logical() {
    let mut s = Setup::new(&[1], 1);
    s.kbpl = 0;
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::ZeroKernelBlocksPerLogical)
    );
}

#[test]
fn error_group_count_mismatch() {
    let s = Setup::new(&[1], 1);
    let two = BlockIds {
        groups: vec![vec![1], vec![]],
    };
    assert_eq!(
        s.plan(&two, &one(&[1])),
        Err(PlanError::GroupCountMismatch {
            local: 2,
            remote: 1
        })
    );
}

#[test]
fn error_unknown_group() {
    let s = Setup::new(&[1, 1], 1);
    assert_eq!(
        s.plan(&one(&[1]), &one(&[1])),
        Err(PlanError::UnknownGroup {
            region: 2,
            group: 1,
            groups: 1
        })
    );
}

#[test]
fn error_uncovered_group() {
    let s = Setup::new(&[1], 1);
    let two = |a: u32| BlockIds {
        groups: vec![vec![a], vec![a, a + 1]],
    };
    assert_eq!(
        s.plan(&two(1), &two(5)),
        Err(PlanError::UncoveredGroup {
            group: 1,
            blocks: 2
        })
    );
    // An extra group with nothing to move is harmless.
    let empty = |a: u32| BlockIds {
        groups: vec![vec![a], vec![]],
    };
    assert_eq!(s.plan(&empty(1), &empty(5)).unwrap().descriptor_count(), 2);
}

#[test]
fn error_remote_has_more_blocks() {
    let s = Setup::new(&[1], 1);
    assert_eq!(
        s.plan(&one(&[1, 2]), &one(&[1, 2, 3])),
        Err(PlanError::RemoteHasMoreBlocks {
            group: 0,
            local: 2,
            remote: 3
        })
    );
}

#[test]
fn error_duplicate_block() {
    let s = Setup::new(&[1], 1);
    assert_eq!(
        s.plan(&one(&[4, 2, 4]), &one(&[1, 2, 3])),
        Err(PlanError::DuplicateBlock {
            side: Side::Local,
            group: 0,
            block: 4
        })
    );
    assert_eq!(
        s.plan(&one(&[1, 2, 3]), &one(&[9, 3, 9])),
        Err(PlanError::DuplicateBlock {
            side: Side::Remote,
            group: 0,
            block: 9
        })
    );
    // A duplicate in the trimmed-off head does not matter.
    assert!(s.plan(&one(&[7, 7, 1, 2]), &one(&[1, 2])).is_ok());
}

#[test]
fn error_block_out_of_range() {
    let s = Setup::new(&[1], 1);
    assert_eq!(
        s.plan(&one(&[1, 100]), &one(&[1, 2])),
        Err(PlanError::BlockOutOfRange {
            side: Side::Local,
            group: 0,
            region: 0,
            block: 100,
            kernel_end: 101,
            num_blocks: 100
        })
    );
    assert_eq!(
        s.plan(&one(&[1, 2]), &one(&[u32::MAX, 0])),
        Err(PlanError::BlockOutOfRange {
            side: Side::Remote,
            group: 0,
            region: 0,
            block: u32::MAX,
            kernel_end: 1 << 32,
            num_blocks: 100
        })
    );
    // Logical 99 is in range; with 4 kernel blocks per logical, kernel blocks 396..400 are too,
    // but a region one kernel block short rejects it.
    let mut s = Setup::new(&[1], 4);
    assert!(s.plan(&one(&[99]), &one(&[99])).is_ok());
    s.remote[1].num_blocks = 399;
    assert_eq!(
        s.plan(&one(&[99]), &one(&[99])),
        Err(PlanError::BlockOutOfRange {
            side: Side::Remote,
            group: 0,
            region: 1,
            block: 99,
            kernel_end: 400,
            num_blocks: 399
        })
    );
}

#[test]
fn error_overflow_of_total_bytes() {
    // Two (overlapping) regions of 3 blocks of 2^62 bytes: each fits, their sum does not.
    let spec = RegionSpec {
        group: 0,
        layer: 0,
        kind: RegionKind::Key,
        block_len: 1 << 62,
    };
    let region = RegionDesc {
        base: 0,
        len: 3 << 62,
        num_blocks: 3,
        block_len: 1 << 62,
    };
    let (specs, regions) = ([spec, spec], [region, region]);
    let ids = one(&[0, 1, 2]);
    let input = PlanInput::new(&regions, &regions, &specs, &ids, &ids, 1);
    assert_eq!(
        plan_transfer(&input),
        Err(PlanError::Overflow {
            what: "total bytes"
        })
    );
}

#[test]
fn errors_display() {
    let e = PlanError::BlockOutOfRange {
        side: Side::Remote,
        group: 1,
        region: 3,
        block: 9,
        kernel_end: 10,
        num_blocks: 8,
    };
    assert_eq!(
        e.to_string(),
        "remote logical block 9 of cache group 1 ends at kernel block 10, past the 8 kernel \
         blocks of region 3"
    );
}

// ---------------------------------------------------------------------------------------------
// The fragmented Llama-3.3-70B transfer (PR 35264: 118 blocks → 18,880 descriptors).

fn plan_70b(runs: u32) -> TransferPlan {
    let (geometry, local, remote, p, d) = fragmented_70b_case_with_runs(runs);
    let specs = geometry.regions().unwrap();
    let input = PlanInput::new(
        &local,
        &remote,
        &specs,
        &p,
        &d,
        geometry.kernel_blocks_per_logical,
    );
    plan_transfer(&input).unwrap()
}

#[test]
fn fragmented_70b_needs_one_descriptor_per_block_per_region() {
    let (geometry, local, remote, p, d) = fragmented_70b_case();
    assert_eq!(geometry.regions().unwrap().len(), 160);
    let specs = geometry.regions().unwrap();
    let input = PlanInput::new(&local, &remote, &specs, &p, &d, 1);
    let plan = plan_transfer(&input).unwrap();
    assert_eq!(plan.descriptor_count(), 118 * 160);
    assert_eq!(plan.descriptor_count(), 18_880);
    assert_eq!(plan.bytes, 118 * 160 * 4096);
    assert_eq!(descriptor_count(&input), Ok(18_880));
}

#[test]
fn fragmented_70b_in_runs_needs_one_descriptor_per_run_per_region() {
    for runs in [1, 10, 59] {
        let plan = plan_70b(runs);
        assert_eq!(plan.descriptor_count(), runs as usize * 160, "{runs} runs");
        assert_eq!(plan.bytes, 118 * 160 * 4096);
    }
}

/// Times planning of the fragmented 70B case; run with
/// `cargo test --release -p kvhandoff-protocol --test planner -- --ignored --nocapture`.
#[test]
#[ignore = "timing, not a check"]
fn time_fragmented_70b() {
    use std::time::Instant;
    let (geometry, local, remote, p, d) = fragmented_70b_case();
    let specs = geometry.regions().unwrap();
    let input = PlanInput::new(&local, &remote, &specs, &p, &d, 1);
    let mut planner = Planner::new();
    let mut out = Vec::new();
    let iters = 5_000u32;
    for _ in 0..100 {
        planner.plan_into(&input, &mut out).unwrap();
    }
    let start = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(planner.plan_into(&input, &mut out).unwrap());
        std::hint::black_box(&out);
    }
    let reused = start.elapsed() / iters;
    let start = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(plan_transfer(&input).unwrap());
    }
    let fresh = start.elapsed() / iters;
    let start = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(planner.summary(&input).unwrap());
    }
    let count = start.elapsed() / iters;
    println!(
        "fragmented 70B ({} descriptors): plan_into reused {:.1} µs, plan_transfer fresh {:.1} µs, \
         summary {:.2} µs",
        out.len(),
        reused.as_secs_f64() * 1e6,
        fresh.as_secs_f64() * 1e6,
        count.as_secs_f64() * 1e6,
    );
}

// ---------------------------------------------------------------------------------------------
// Properties.

/// A random valid transfer.
#[derive(Debug, Clone)]
struct Case {
    kbpl: u32,
    specs: Vec<RegionSpec>,
    local: Vec<RegionDesc>,
    remote: Vec<RegionDesc>,
    local_ids: BlockIds,
    remote_ids: BlockIds,
}

/// A subset of `0..cap`, shuffled or sorted.
fn ids(cap: u32) -> impl Strategy<Value = Vec<u32>> {
    let all: Vec<u32> = (0..cap).collect();
    (
        prop::sample::subsequence(all, 0..=cap as usize).prop_shuffle(),
        any::<bool>(),
    )
        .prop_map(|(mut ids, sort)| {
            if sort {
                ids.sort_unstable();
            }
            ids
        })
}

fn table_of(specs: &[RegionSpec], base: u64, num_blocks: &[u32], slack: &[u64]) -> Vec<RegionDesc> {
    let mut at = base;
    specs
        .iter()
        .zip(num_blocks.iter().zip(slack))
        .map(|(s, (&n, &slack))| {
            let len = u64::from(n) * s.block_len + slack;
            let r = RegionDesc {
                base: at,
                len,
                num_blocks: n,
                block_len: s.block_len,
            };
            at += len + 64;
            r
        })
        .collect()
}

fn case() -> impl Strategy<Value = Case> {
    (1u32..=3, 1usize..=3, 1u32..=20, 1u32..=20).prop_flat_map(|(kbpl, groups, lcap, rcap)| {
        // Every group gets one region, plus up to 4 more in random groups.
        let extra = prop::collection::vec(0..groups, 0..=4);
        let group_ids = prop::collection::vec((ids(lcap), ids(rcap)), groups);
        (extra, group_ids, Just((kbpl, groups, lcap, rcap)))
            .prop_flat_map(|(extra, group_ids, params)| {
                let n = params.1 + extra.len();
                (
                    Just((extra, group_ids, params)),
                    prop::collection::vec(1u64..=48, n),
                    prop::collection::vec((0u32..3, 0u32..3, 0u64..40, 0u64..40), n),
                )
            })
            .prop_map(
                |((extra, group_ids, (kbpl, groups, lcap, rcap)), lens, pads)| {
                    let specs: Vec<RegionSpec> = (0..groups)
                        .chain(extra)
                        .zip(&lens)
                        .enumerate()
                        .map(|(layer, (group, &block_len))| RegionSpec {
                            group,
                            layer: layer as u32,
                            kind: RegionKind::Key,
                            block_len,
                        })
                        .collect();
                    let lblocks: Vec<u32> = pads.iter().map(|p| lcap * kbpl + p.0).collect();
                    let rblocks: Vec<u32> = pads.iter().map(|p| rcap * kbpl + p.1).collect();
                    let lslack: Vec<u64> = pads.iter().map(|p| p.2).collect();
                    let rslack: Vec<u64> = pads.iter().map(|p| p.3).collect();
                    let (mut local_ids, mut remote_ids) = (Vec::new(), Vec::new());
                    for (l, mut r) in group_ids {
                        r.truncate(l.len());
                        local_ids.push(l);
                        remote_ids.push(r);
                    }
                    Case {
                        kbpl,
                        local: table_of(&specs, 0x1000, &lblocks, &lslack),
                        remote: table_of(&specs, 0x50_0000_0000, &rblocks, &rslack),
                        specs,
                        local_ids: BlockIds { groups: local_ids },
                        remote_ids: BlockIds { groups: remote_ids },
                    }
                },
            )
    })
}

/// The trimmed `(local, remote)` logical pairs of each group.
fn pairs(c: &Case) -> Vec<Vec<(u32, u32)>> {
    c.local_ids
        .groups
        .iter()
        .zip(&c.remote_ids.groups)
        .map(|(l, r)| {
            let l = &l[l.len() - r.len()..];
            l.iter().copied().zip(r.iter().copied()).collect()
        })
        .collect()
}

/// Splits a descriptor into `(local kernel block address, remote kernel block address)` pairs
/// after checking that it lies inside one region on each side.
fn split(c: &Case, d: &Descriptor) -> Vec<(u64, u64)> {
    assert!(d.len > 0, "empty descriptor {d:?}");
    let i = c
        .local
        .iter()
        .position(|r| r.base <= d.local_addr && d.local_addr < r.base + r.len)
        .unwrap_or_else(|| panic!("{d:?} starts outside every local region"));
    let (l, r) = (&c.local[i], &c.remote[i]);
    let bl = l.block_len;
    assert_eq!(d.len % bl, 0);
    assert_eq!((d.local_addr - l.base) % bl, 0);
    assert!(d.local_addr + d.len <= l.base + u64::from(l.num_blocks) * bl);
    assert!(d.remote_addr >= r.base);
    assert_eq!((d.remote_addr - r.base) % bl, 0);
    assert!(d.remote_addr + d.len <= r.base + u64::from(r.num_blocks) * bl);
    (0..d.len / bl)
        .map(|k| (d.local_addr + k * bl, d.remote_addr + k * bl))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn plans_cover_exactly_the_requested_blocks_with_the_fewest_descriptors(c in case()) {
        let input = PlanInput::new(
            &c.local, &c.remote, &c.specs, &c.local_ids, &c.remote_ids, c.kbpl,
        );
        let plan = plan_transfer(&input).unwrap();
        let kbpl = u64::from(c.kbpl);
        let pairs = pairs(&c);

        // (a) and (c): the descriptors cover each requested kernel block pair exactly once, and
        // stay inside their regions on both sides.
        let mut want = Vec::new();
        let mut min_count = 0;
        let mut bytes = 0;
        for (i, spec) in c.specs.iter().enumerate() {
            let (l, r) = (&c.local[i], &c.remote[i]);
            let group = &pairs[spec.group];
            for &(lid, rid) in group {
                for k in 0..kbpl {
                    want.push((
                        l.base + (u64::from(lid) * kbpl + k) * l.block_len,
                        r.base + (u64::from(rid) * kbpl + k) * r.block_len,
                    ));
                }
            }
            bytes += group.len() as u64 * kbpl * l.block_len;
            // (b) brute force: a pair starts a run unless (l - 1, r - 1) is also requested.
            let set: HashSet<(u32, u32)> = group.iter().copied().collect();
            min_count += group
                .iter()
                .filter(|&&(lid, rid)| {
                    lid == 0 || rid == 0 || !set.contains(&(lid - 1, rid - 1))
                })
                .count();
        }
        let mut got: Vec<(u64, u64)> = plan.descriptors.iter().flat_map(|d| split(&c, d)).collect();
        want.sort_unstable();
        got.sort_unstable();
        prop_assert_eq!(got, want);
        prop_assert_eq!(plan.descriptor_count(), min_count);
        prop_assert_eq!(plan.bytes, bytes);
        prop_assert_eq!(
            plan.bytes,
            plan.descriptors.iter().map(|d| d.len).sum::<u64>()
        );

        // The count-only and buffer-filling paths agree.
        prop_assert_eq!(descriptor_count(&input), Ok(min_count));
        let mut planner = Planner::new();
        let mut out = vec![Descriptor { local_addr: 0, remote_addr: 0, len: 0 }; 3];
        let summary = planner.plan_into(&input, &mut out).unwrap();
        prop_assert_eq!(summary, PlanSummary { descriptors: min_count, bytes });
        prop_assert_eq!(&out, &plan.descriptors);
    }

    #[test]
    fn any_input_is_planned_in_bounds_or_rejected(
        c in case(),
        mutations in prop::collection::vec(
            (
                0u8..16,
                any::<usize>(),
                prop_oneof![
                    0u64..64,
                    any::<u64>(),
                    (0u64..64).prop_map(|d| u64::MAX - d),
                    (0u64..64).prop_map(|d| u64::from(u32::MAX) - d),
                ],
            ),
            0..4,
        ),
    ) {
        let Case { mut kbpl, mut specs, mut local, mut remote, local_ids, remote_ids } = c;
        let (mut local_ids, mut remote_ids) = (local_ids.groups, remote_ids.groups);
        let unmutated = mutations.is_empty();
        for (what, at, v) in mutations {
            let n = specs.len();
            let (i, id) = (at % n, v as u32);
            let g = at % local_ids.len().max(1);
            match what {
                0 => local[i].base = v,
                1 => local[i].len = v,
                2 => local[i].num_blocks = id,
                3 => local[i].block_len = v,
                4..=7 => {
                    if let Some(r) = remote.get_mut(i) {
                        match what {
                            4 => r.base = v,
                            5 => r.len = v,
                            6 => r.num_blocks = id,
                            _ => r.block_len = v,
                        }
                    }
                }
                8 => specs[i].group = (v % 5) as usize,
                9 => specs[i].block_len = v,
                10 => kbpl = (v % 5) as u32,
                11 => local_ids.get_mut(g).into_iter().for_each(|ids| ids.push(id)),
                12 => remote_ids.get_mut(g).into_iter().for_each(|ids| ids.push(id)),
                13 => {
                    if let Some(x) = remote_ids.get_mut(g).and_then(|ids| ids.first_mut()) {
                        *x = id;
                    }
                }
                14 => {
                    remote.pop();
                }
                _ => {
                    local_ids.pop();
                }
            }
        }
        let (local_ids, remote_ids) = (
            BlockIds { groups: local_ids },
            BlockIds { groups: remote_ids },
        );
        let input = PlanInput::new(&local, &remote, &specs, &local_ids, &remote_ids, kbpl);
        let count = descriptor_count(&input);
        match plan_transfer(&input) {
            Ok(plan) => {
                prop_assert_eq!(count, Ok(plan.descriptor_count()));
                for d in &plan.descriptors {
                    let inside = |r: &RegionDesc, addr: u64| {
                        addr >= r.base
                            && (addr - r.base) % r.block_len == 0
                            && (addr - r.base)
                                .checked_add(d.len)
                                .is_some_and(|end| end <= u64::from(r.num_blocks) * r.block_len)
                    };
                    prop_assert!(d.len > 0);
                    prop_assert!(
                        local.iter().zip(&remote).any(|(l, r)| inside(l, d.local_addr)
                            && inside(r, d.remote_addr)),
                        "{:?} is outside every region pair", d
                    );
                }
            }
            Err(e) => {
                prop_assert!(!unmutated, "a valid case was rejected: {}", e);
                prop_assert_eq!(count, Err(e));
            }
        }
    }
}
