//! Requests: sliding-window clipping, the prefix end trim, pieces and their merging, mamba
//! slots, bad requests, and a fuzz that no input panics.

use super::super::tests::{pair, tp, HND, NHD};
use super::super::*;
use crate::message::BlockIds;

/// Contiguous block ids from `start` for each group, sized for `tokens` at `logical` tokens per
/// block, minus `cached` blocks at the front of the full-attention groups.
fn ids(plan: &PairPlan, side: &SideSpec, tokens: u64, cached_tokens: u64, start: u32) -> BlockIds {
    let lb = side.logical_block();
    let blocks = tokens.div_ceil(lb) as u32;
    let skip = (cached_tokens / lb) as u32;
    let mut next = start;
    let groups = plan
        .model
        .groups
        .iter()
        .map(|g| {
            let n = match g {
                ModelGroup::Mamba { .. } => 1,
                _ => blocks - skip,
            };
            let list: Vec<u32> = (next..next + n).collect();
            next += n;
            list
        })
        .collect();
    BlockIds { groups }
}

struct Req {
    plan: RequestPlan,
}

fn request(plan: &PairPlan, tokens: u64, cached: u64) -> Result<Req, HeteroError> {
    let (pm, dm) = (
        SideMemory::packed(&plan.prefill, 64).unwrap(),
        SideMemory::packed(&plan.decode, 64).unwrap(),
    );
    let p = ids(plan, &plan.prefill.spec, tokens, 0, 0);
    let d = ids(plan, &plan.decode.spec, tokens, cached, 0);
    let input = RequestInput {
        tokens,
        prefill_blocks: &p,
        decode_blocks: &d,
        prefill_memory: &pm,
        decode_memory: &dm,
    };
    plan_request(plan, &input).map(|plan| Req { plan })
}

#[test]
fn sliding_window_keeps_the_last_cdiv_window_block_plus_one_blocks_tail_aligned() {
    // Window 48. Block 16: ⌈48/16⌉+1 = 4 blocks; 150 tokens are 10 blocks, so 96..150 moves.
    let plan = pair(
        "swa",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let req = request(&plan, 150, 0).unwrap().plan;
    let sw = req.groups[1].clone().unwrap();
    assert_eq!(sw.tokens, 96..150);
    assert_eq!((sw.prefill.len(), sw.decode.len()), (4, 4));
    assert_eq!(
        sw.prefill,
        [16, 17, 18, 19],
        "the last 4 of P's 10 (ids 10..20)"
    );
    assert_eq!(req.groups[0].clone().unwrap().tokens, 0..150);
    // P block 16 (4 blocks kept: from 96), D block 64 (⌈48/64⌉+1 = 2: from 64): the tokens
    // both keep move, and D's 64..96 are left alone.
    let plan = pair(
        "swa",
        "tp=1,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
    );
    let sw = request(&plan, 150, 0).unwrap().plan.groups[1]
        .clone()
        .unwrap();
    assert_eq!(sw.tokens, 96..150);
    assert_eq!(sw.decode.len(), 2);
    assert_eq!(sw.decode_first_token, 64);
    assert_eq!(sw.prefill_first_token, 96);
    // The other way round: D keeps from 96, P (block 64, 2 blocks) from 64; P's first kept
    // block is trimmed to the one holding token 96.
    let plan = pair(
        "swa",
        "tp=1,block=64,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let sw = request(&plan, 150, 0).unwrap().plan.groups[1]
        .clone()
        .unwrap();
    assert_eq!(sw.tokens, 96..150);
    assert_eq!((sw.prefill.len(), sw.prefill_first_token), (2, 64));
    assert_eq!((sw.decode.len(), sw.decode_first_token), (4, 96));
    // Block 32 with kbpl 2 (logical 64): ⌈48/64⌉+1 = 2 logical blocks.
    let plan = pair(
        "swa",
        "tp=1,block=32,kbpl=2,layout=HND",
        "tp=1,block=32,layout=HND",
    );
    let sw = request(&plan, 150, 0).unwrap().plan.groups[1]
        .clone()
        .unwrap();
    assert_eq!((sw.prefill.len(), sw.prefill_first_token), (2, 64));
    assert_eq!((sw.decode.len(), sw.decode_first_token), (3, 64));
}

#[test]
fn the_prefix_hit_end_trims_p_to_the_tokens_d_lacks() {
    // Same block size: D cached 64 of 100 tokens (4 blocks), lists 3; P's 7 are trimmed to
    // the last 3.
    let plan = pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let req = request(&plan, 100, 64).unwrap().plan;
    let full = req.groups[0].clone().unwrap();
    assert_eq!(full.tokens, 64..100);
    assert_eq!(full.prefill, [4, 5, 6]);
    assert_eq!(full.decode, [0, 1, 2]);
    // One piece per region: the runs are contiguous on both sides.
    assert_eq!(req.descriptors(), 8);
    // P block 64: D lacks 64..100 = P's second block.
    let plan = pair(
        "gqa8",
        "tp=1,block=64,layout=NHD",
        "tp=1,block=16,layout=NHD",
    );
    let full = request(&plan, 100, 64).unwrap().plan.groups[0]
        .clone()
        .unwrap();
    assert_eq!(
        (full.prefill.clone(), full.prefill_first_token),
        (vec![1], 64)
    );
    // D block 32 cached 32: P's first block (0..64) holds D's first needed token.
    let plan = pair(
        "gqa8",
        "tp=1,block=64,layout=NHD",
        "tp=1,block=32,layout=NHD",
    );
    let full = request(&plan, 100, 32).unwrap().plan.groups[0]
        .clone()
        .unwrap();
    assert_eq!(
        (full.prefill.clone(), full.prefill_first_token),
        (vec![0, 1], 0)
    );
    assert_eq!(full.tokens, 32..100);
}

#[test]
fn pieces_merge_runs_and_follow_the_head_layout() {
    // Equal geometry, contiguous ids: one piece per region for the whole request.
    let plan = pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let req = request(&plan, 100, 0).unwrap().plan;
    assert_eq!(req.descriptors(), 8);
    assert_eq!(
        req.bytes(),
        8 * 7 * 16 * 8 * 16,
        "whole blocks, tail included"
    );
    // HND head slice: one piece per block (the other heads sit between blocks' slices).
    let plan = pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=2,block=16,layout=HND",
    );
    let req = request(&plan, 100, 0).unwrap().plan;
    assert_eq!(req.descriptors(), 2 * 8 * 7);
    // NHD, P block 16 into D block 64, same heads: the 16-token blocks are contiguous on both
    // sides here, so one piece per region again.
    let plan = pair(
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=1,block=64,layout=NHD",
    );
    let req = request(&plan, 100, 0).unwrap().plan;
    assert_eq!(req.descriptors(), 8);
    // The tail 100..112 of D's last block: zeroed, one range per region in NHD, one per head
    // in HND.
    let nhd = pair(
        "gqa8",
        "tp=1,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    );
    let req = request(&nhd, 100, 0).unwrap().plan;
    assert_eq!(req.zero.len(), 8);
    assert!(req.zero.iter().all(|z| z.len == 12 * 8 * 16));
    let req = request(
        &plan_pair(&nhd.model, tp(1, 16, HND), tp(1, 16, HND)).unwrap(),
        100,
        0,
    )
    .unwrap()
    .plan;
    assert_eq!(req.zero.len(), 8 * 8);
}

#[test]
fn mamba_moves_one_state_slot_per_layer() {
    let plan = pair(
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let req = request(&plan, 100, 0).unwrap().plan;
    let span = req.groups[1].clone().unwrap();
    assert_eq!((span.prefill.len(), span.decode.len()), (1, 1));
    // Each writer's conv and SSM halves land apart in D's slot: 2 pieces per layer per link.
    let state: Vec<usize> = req
        .transfers
        .iter()
        .map(|t| {
            t.pieces
                .iter()
                .filter(|p| p.len == 96 || p.len == 256)
                .count()
        })
        .collect();
    assert_eq!(state.iter().sum::<usize>(), 2 * 2 * 2);
}

#[test]
fn bad_requests_say_why() {
    let plan = pair(
        "swa",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let pm = SideMemory::packed(&plan.prefill, 32).unwrap();
    let dm = SideMemory::packed(&plan.decode, 32).unwrap();
    let run = |tokens: u64, p: Vec<Vec<u32>>, d: Vec<Vec<u32>>| {
        let (p, d) = (BlockIds { groups: p }, BlockIds { groups: d });
        plan_request(
            &plan,
            &RequestInput {
                tokens,
                prefill_blocks: &p,
                decode_blocks: &d,
                prefill_memory: &pm,
                decode_memory: &dm,
            },
        )
        .map(|_| ())
        .unwrap_err()
    };
    let d_ok = vec![vec![0, 1], vec![2, 3]];
    assert_eq!(run(0, d_ok.clone(), d_ok.clone()), HeteroError::NoTokens);
    assert!(matches!(
        run(1 << 40, d_ok.clone(), d_ok.clone()),
        HeteroError::TooManyTokens { .. }
    ));
    assert_eq!(
        run(20, vec![vec![0, 1]], d_ok.clone()),
        HeteroError::GroupCount {
            side: SideName::Prefill,
            given: 1,
            expected: 2
        }
    );
    assert_eq!(
        run(20, vec![vec![0, 1, 4], vec![2, 3]], d_ok.clone()),
        HeteroError::ListTooLong {
            side: SideName::Prefill,
            group: 0,
            len: 3,
            max: 2
        }
    );
    assert_eq!(
        run(20, vec![vec![0, 1], vec![2, 99]], d_ok.clone()),
        HeteroError::BlockOutOfRange {
            side: SideName::Prefill,
            group: 1,
            block: 99,
            pool: 32
        }
    );
    // The two groups share tensors: one id in both would be one block written twice.
    assert_eq!(
        run(20, vec![vec![0, 1], vec![1, 3]], d_ok.clone()),
        HeteroError::DuplicateBlock {
            side: SideName::Prefill,
            block: 1,
            first: 0,
            second: 1
        }
    );
    let e = run(20, vec![vec![1], vec![2, 3]], d_ok.clone());
    assert_eq!(
        e.to_string(),
        "cache group 0: P's blocks start at token 16, after token 0 that D needs"
    );
    // Memory that does not match the side.
    let wrong = SideMemory {
        pool_blocks: 32,
        ranks: vec![],
    };
    let (p, d) = (
        BlockIds {
            groups: d_ok.clone(),
        },
        BlockIds { groups: d_ok },
    );
    let e = plan_request(
        &plan,
        &RequestInput {
            tokens: 20,
            prefill_blocks: &p,
            decode_blocks: &d,
            prefill_memory: &wrong,
            decode_memory: &dm,
        },
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "P memory: 0 ranks described, the side has 1");
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn spec() -> impl Strategy<Value = SideSpec> {
        (
            0u32..10,
            0u32..3,
            prop::sample::select(vec![0u32, 1, 8, 16, 24, 64]),
            0u32..3,
            any::<bool>(),
        )
            .prop_map(|(tp, pp, block, kbpl, hnd)| SideSpec {
                tp,
                pp,
                block,
                kbpl,
                layout: if hnd { HND } else { NHD },
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Any specs and any block lists: a plan or an error, never a panic; and a plan's pieces
        /// stay inside the memory they name.
        #[test]
        fn never_panics(
            m in 0usize..5,
            p in spec(),
            d in spec(),
            tokens in 0u64..300,
            lists in prop::collection::vec(prop::collection::vec(0u32..40, 0..12), 0..4),
            dlists in prop::collection::vec(prop::collection::vec(0u32..40, 0..12), 0..4),
        ) {
            let Ok(plan) = plan_pair(&MODELS[m], p, d) else { return Ok(()) };
            let pm = SideMemory::packed(&plan.prefill, 40).unwrap();
            let dm = SideMemory::packed(&plan.decode, 40).unwrap();
            let (pb, db) = (BlockIds { groups: lists }, BlockIds { groups: dlists });
            let input = RequestInput {
                tokens,
                prefill_blocks: &pb,
                decode_blocks: &db,
                prefill_memory: &pm,
                decode_memory: &dm,
            };
            if let Ok(req) = plan_request(&plan, &input) {
                for t in &req.transfers {
                    let link = &plan.links[t.link];
                    for piece in &t.pieces {
                        let end = |rank: &RankLayout, mem: &RankMemory, space, addr: u64, staging: u64| {
                            match space {
                                Space::Staging => addr + piece.len <= mem.staging_base + staging,
                                Space::Kv => rank.tensors.iter().zip(&mem.tensor_bases).any(|(t, &b)| {
                                    addr >= b && addr + piece.len <= b + tensor_len(t, 40).unwrap()
                                }),
                            }
                        };
                        prop_assert!(end(&plan.prefill.ranks[link.prefill], &pm.ranks[link.prefill],
                            t.src_space, piece.src, req.prefill_staging[link.prefill]));
                        prop_assert!(end(&plan.decode.ranks[link.decode], &dm.ranks[link.decode],
                            t.dst_space, piece.dst, req.decode_staging[link.decode]));
                    }
                }
            }
        }
    }
}

#[test]
fn a_piece_never_spans_two_regions() {
    // Region K0's last block is its tensor's last, V0's first block is its tensor's first, on
    // both sides: the bytes run on across the two tensors, but they are two registrations.
    let plan = pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let pm = SideMemory::packed(&plan.prefill, 8).unwrap();
    let dm = SideMemory::packed(&plan.decode, 8).unwrap();
    let p = BlockIds::single_group(vec![0, 5, 7]);
    let d = BlockIds::single_group(vec![0, 3, 7]);
    let req = plan_request(
        &plan,
        &RequestInput {
            tokens: 48,
            prefill_blocks: &p,
            decode_blocks: &d,
            prefill_memory: &pm,
            decode_memory: &dm,
        },
    )
    .unwrap();
    assert_eq!(req.descriptors(), 8 * 3);
    let block = plan.prefill.ranks[0].tensors[0].block_len;
    assert!(req.transfers[0].pieces.iter().all(|p| p.len == block));
}
