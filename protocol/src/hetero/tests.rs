//! The pair planner's rules, case by case (requests: `request/tests.rs`).

use super::*;
use crate::geometry::{KvLayout, RegionKind};

pub(super) const HND: KvLayout = KvLayout::Hnd;
pub(super) const NHD: KvLayout = KvLayout::Nhd;

/// The plan of a catalog model between two spec strings (the case must plan).
pub(super) fn pair(name: &str, p: &str, d: &str) -> PairPlan {
    plan_pair(model(name).unwrap(), p.parse().unwrap(), d.parse().unwrap()).unwrap()
}

/// A side of `n` TP ranks.
pub(super) fn tp(n: u32, block: u32, layout: KvLayout) -> SideSpec {
    SideSpec::new(n, block, layout)
}

/// `(P rank index, D rank index)` of every link.
fn pairs(plan: &PairPlan) -> Vec<(usize, usize)> {
    plan.links.iter().map(|l| (l.prefill, l.decode)).collect()
}

#[test]
fn gqa2_tp4_into_tp1_has_two_writers_p0_and_p2() {
    let plan = pair(
        "gqa2",
        "tp=4,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    assert_eq!(pairs(&plan), [(0, 0), (2, 0)]);
    assert_eq!(plan.completions, [2]);
    assert_eq!(plan.idle_prefill_ranks(), [1, 3]);
    let heads: Vec<_> = plan
        .links
        .iter()
        .map(|l| l.heads.clone().unwrap())
        .collect();
    assert_eq!(
        heads,
        [
            HeadLink {
                global: 0..1,
                prefill_local: 0..1,
                decode_local: 0..1
            },
            HeadLink {
                global: 1..2,
                prefill_local: 0..1,
                decode_local: 1..2
            },
        ]
    );
}

#[test]
fn gqa2_tp2_into_tp8_gives_each_d_rank_one_writer() {
    let plan = pair(
        "gqa2",
        "tp=2,block=16,layout=HND",
        "tp=8,block=16,layout=HND",
    );
    assert_eq!(plan.completions, [1; 8]);
    let writers: Vec<usize> = plan.links.iter().map(|l| l.prefill).collect();
    assert_eq!(writers, [0, 0, 0, 0, 1, 1, 1, 1]);
}

#[test]
fn replicas_on_p_share_the_writes_to_replicated_d_ranks() {
    // gqa2 at tp 8 on both sides: each head on 4 P ranks and 4 D ranks; each D rank is
    // written by the P replica at its own position.
    let plan = pair(
        "gqa2",
        "tp=8,block=16,layout=HND",
        "tp=8,block=16,layout=HND",
    );
    assert_eq!(pairs(&plan), (0..8).map(|r| (r, r)).collect::<Vec<_>>());
    // P tp=8 into D tp=4: D ranks 0,1 hold head 0 (P replicas 0..4), 2,3 head 1 (P 4..8).
    let plan = pair(
        "gqa2",
        "tp=8,block=16,layout=HND",
        "tp=4,block=16,layout=HND",
    );
    let mut by_d: Vec<(usize, usize)> = pairs(&plan).into_iter().map(|(p, d)| (d, p)).collect();
    by_d.sort();
    assert_eq!(by_d, [(0, 0), (1, 1), (2, 4), (3, 5)]);
}

#[test]
fn mla_every_d_rank_has_one_writer_spread_over_p() {
    for p in [1, 2, 4, 8] {
        for d in [1, 2, 4, 8] {
            let plan = plan_pair(model("mla").unwrap(), tp(p, 16, HND), tp(d, 16, NHD)).unwrap();
            assert_eq!(plan.completions, vec![1; d as usize], "P tp{p} → D tp{d}");
            for link in &plan.links {
                assert_eq!(link.prefill, link.decode % p as usize);
                assert_eq!(link.heads.as_ref().unwrap().global, 0..1);
            }
        }
    }
}

/// Every head and state head of every layer of every D rank is written exactly once.
fn assert_exact_cover(plan: &PairPlan) {
    let m = &plan.model;
    for (di, d) in plan.decode.ranks.iter().enumerate() {
        for layer in d.layers.clone() {
            let writers = plan
                .links_into(di)
                .filter(|(_, l)| l.layers.contains(&layer))
                .map(|(_, l)| l);
            let mut covered: Vec<u32> = Vec::new();
            let attention = m.is_attention_layer(layer);
            for link in writers {
                let range = if attention {
                    link.heads.as_ref().map(|h| h.global.clone())
                } else {
                    link.state.as_ref().map(|s| s.global.clone())
                };
                covered.extend(range.into_iter().flatten());
            }
            covered.sort();
            let want: Vec<u32> = if attention {
                d.heads.clone().collect()
            } else {
                d.state_heads.clone().collect()
            };
            assert_eq!(covered, want, "D rank {di} layer {layer}");
        }
    }
}

#[test]
fn every_d_head_of_every_layer_has_exactly_one_writer() {
    for m in MODELS {
        for p in [1u32, 2, 4, 8] {
            for d in [1u32, 2, 4, 8] {
                for pp in [1u32, 2] {
                    let mut ps = tp(p, 16, HND);
                    ps.pp = pp;
                    let plan = plan_pair(&m, ps, tp(d, 32, NHD)).unwrap();
                    assert_exact_cover(&plan);
                    let stages = plan.completions.iter().map(|&c| c % pp).sum::<u32>();
                    assert_eq!(stages, 0, "each P stage writes its own window");
                }
            }
        }
    }
}

#[test]
fn pp_stages_write_their_layer_windows() {
    let plan = pair(
        "gqa8",
        "tp=2,pp=2,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    assert_eq!(plan.completions, [4]);
    let windows: Vec<_> = plan.links.iter().map(|l| l.layers.clone()).collect();
    assert_eq!(windows, [0..2, 0..2, 2..4, 2..4]);
    // And a D with PP: each D stage hears only from the P stage over its window.
    let plan = pair(
        "gqa8",
        "tp=1,pp=2,block=16,layout=HND",
        "tp=1,pp=2,block=16,layout=HND",
    );
    assert_eq!(pairs(&plan), [(0, 0), (1, 1)]);
    let plan = pair(
        "gqa8",
        "tp=1,pp=4,block=16,layout=HND",
        "tp=1,pp=2,block=16,layout=HND",
    );
    assert_eq!(pairs(&plan), [(0, 0), (1, 0), (2, 1), (3, 1)]);
    assert_eq!(plan.completions, [2, 2]);
}

#[test]
fn mamba_state_moves_as_per_head_byte_ranges() {
    // 8 state heads, 24 conv + 64 SSM bytes each. P tp=1 → D tp=2: P's slot is 8 conv heads
    // (192 bytes) then 8 SSM heads; each D rank takes its half of both.
    let plan = pair(
        "mamba",
        "tp=1,block=16,layout=HND",
        "tp=2,block=16,layout=HND",
    );
    let states: Vec<_> = plan
        .links
        .iter()
        .map(|l| l.state.clone().unwrap())
        .collect();
    assert_eq!(states[0].conv.prefill, 0..96);
    assert_eq!(states[0].conv.decode, 0..96);
    assert_eq!(states[0].ssm.prefill, 192..448);
    assert_eq!(states[0].ssm.decode, 96..352);
    assert_eq!(states[1].conv.prefill, 96..192);
    assert_eq!(states[1].ssm.prefill, 448..704);
    assert_eq!(states[1].ssm.decode, 96..352);
    // P tp=4 → D tp=1: four writers of state, and the attention heads (4) come from the same
    // four ranks.
    let plan = pair(
        "mamba",
        "tp=4,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    assert_eq!(plan.completions, [4]);
    let s = plan.links[3].state.clone().unwrap();
    assert_eq!((s.conv.prefill, s.conv.decode), (0..48, 144..192));
}

#[test]
fn shared_tensors_are_registered_once() {
    let plan = pair(
        "swa",
        "tp=1,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    let rank = &plan.prefill.ranks[0];
    assert_eq!(rank.regions.len(), 8, "K and V of four layers");
    assert_eq!(
        rank.tensors.len(),
        4,
        "full layer j shares with sliding layer j"
    );
    for t in &rank.tensors {
        let groups: Vec<usize> = t.regions.iter().map(|&r| rank.regions[r].group).collect();
        assert_eq!(groups, [0, 1]);
    }
    // Layers 0 and 1 (full, sliding) share the first K tensor.
    let k0 = rank.region(0, RegionKind::Key).unwrap();
    let k1 = rank.region(1, RegionKind::Key).unwrap();
    assert_eq!(rank.regions[k0].tensor, rank.regions[k1].tensor);
    let plan = pair(
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=16,layout=HND",
    );
    assert_eq!(
        plan.prefill.ranks[0].tensors.len(),
        6,
        "no sharing: 2×(K,V) + 2 states"
    );
}

#[test]
fn impossible_pairs_say_why() {
    let err = |name: &str, p: &str, d: &str| {
        plan_pair(model(name).unwrap(), p.parse().unwrap(), d.parse().unwrap())
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        err(
            "gqa8",
            "tp=3,block=16,layout=HND",
            "tp=1,block=16,layout=HND"
        ),
        "P side: 8 KV heads cannot be split over or replicated across 3 TP ranks"
    );
    assert!(err(
        "mamba",
        "tp=1,block=16,layout=HND",
        "tp=16,block=16,layout=HND"
    )
    .starts_with("D side: the model's 8 mamba state heads cannot be split evenly over tp=16"));
    assert!(err(
        "swa",
        "tp=1,pp=4,block=16,layout=HND",
        "tp=1,block=16,layout=HND"
    )
    .starts_with("P side: pp=4 leaves stage 0 with no sliding-window layer"));
    assert!(err(
        "gqa8",
        "tp=1,pp=3,block=16,layout=HND",
        "tp=1,block=16,layout=HND"
    )
    .contains("4 layers cannot be split evenly over 3 PP ranks"));
    assert!(err(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=1,block=24,layout=HND"
    )
    .starts_with("kernel block sizes 16 (P) and 24 (D) do not divide one another"));
    let zero = plan_pair(model("gqa8").unwrap(), tp(0, 16, HND), tp(1, 16, HND));
    assert!(matches!(
        zero,
        Err(HeteroError::Spec {
            side: SideName::Prefill,
            ..
        })
    ));
}

fn kinds(plan: &PairPlan) -> Vec<(TransformKind, RunsOn)> {
    plan.pipeline
        .transforms
        .iter()
        .map(|t| (t.kind, t.runs_on))
        .filter(|(k, _)| *k != TransformKind::ZeroTail)
        .collect()
}

#[test]
fn the_pipeline_puts_each_transform_where_the_rules_say() {
    use RunsOn::*;
    use TransformKind::*;
    let case = |m: &str, p: &str, d: &str| {
        let plan = pair(m, p, d);
        (
            kinds(&plan),
            plan.pipeline.prefill_stage.is_some(),
            plan.pipeline.decode_stage.is_some(),
        )
    };
    let same = "tp=2,block=16,layout=HND";
    assert_eq!(case("gqa8", same, same), (vec![], false, false));
    // HND slices and gathers by addressing.
    assert_eq!(
        case(
            "gqa8",
            "tp=1,block=16,layout=HND",
            "tp=2,block=16,layout=HND"
        ),
        (vec![(SliceHeads, Addressing)], false, false)
    );
    assert_eq!(
        case(
            "gqa8",
            "tp=4,block=16,layout=HND",
            "tp=1,block=16,layout=HND"
        ),
        (vec![(GatherHeads, Addressing)], false, false)
    );
    // NHD slices on P, gathers on D.
    assert_eq!(
        case(
            "gqa8",
            "tp=1,block=16,layout=NHD",
            "tp=2,block=16,layout=NHD"
        ),
        (vec![(SliceHeads, Prefill)], true, false)
    );
    assert_eq!(
        case(
            "gqa8",
            "tp=4,block=16,layout=NHD",
            "tp=1,block=16,layout=NHD"
        ),
        (vec![(GatherHeads, Decode)], false, true)
    );
    // Equal TP, different layouts: a tie, so P permutes.
    assert_eq!(
        case(
            "gqa8",
            "tp=2,block=16,layout=NHD",
            "tp=2,block=16,layout=HND"
        ),
        (vec![(Permute, Prefill)], true, false)
    );
    // D holds fewer heads per rank (more ranks): D permutes.
    assert_eq!(
        case(
            "gqa8",
            "tp=1,block=16,layout=HND",
            "tp=2,block=16,layout=NHD"
        ),
        (
            vec![(SliceHeads, Addressing), (Permute, Decode)],
            false,
            true
        )
    );
    // One head per link: layouts and block sizes cost nothing.
    assert_eq!(
        case(
            "mla",
            "tp=1,block=16,layout=NHD",
            "tp=8,block=64,layout=HND"
        ),
        (
            vec![(Permute, Addressing), (Regroup, Addressing)],
            false,
            false
        )
    );
    // Block sizes: free in NHD, a kernel in HND.
    assert_eq!(
        case(
            "gqa8",
            "tp=1,block=16,layout=NHD",
            "tp=1,block=64,layout=NHD"
        ),
        (vec![(Regroup, Addressing)], false, false)
    );
    assert_eq!(
        case(
            "gqa8",
            "tp=1,block=16,layout=HND",
            "tp=1,block=64,layout=HND"
        ),
        (vec![(Regroup, Prefill)], true, false)
    );
    let plan = pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
    );
    let stage = plan.pipeline.prefill_stage.unwrap();
    assert_eq!(stage.ops, [StageOp::Regroup { from: 16, to: 64 }]);
}
