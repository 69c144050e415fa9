//! How `RankLinks` follow a pair's plan, and which links are refused.

use super::*;
use crate::hetero::{model, plan_pair};

fn plan(name: &str, p: &str, d: &str) -> PairPlan {
    plan_pair(model(name).unwrap(), p.parse().unwrap(), d.parse().unwrap()).unwrap()
}

#[test]
fn links_follow_the_plan_both_ways() {
    // GQA 2 heads, P at TP 8: ranks 0 and 4 hold the two heads' first replicas and write;
    // the others write nothing.
    let pair = plan(
        "gqa2",
        "tp=8,block=16,layout=NHD",
        "tp=1,block=16,layout=NHD",
    );
    let d = RankLinks::decode(&pair, 0).unwrap();
    assert_eq!((d.remote_tp, d.peers.len()), (8, 2));
    let writers: Vec<u32> = (0..8)
        .filter(|&p| !RankLinks::prefill(&pair, p).unwrap().peers.is_empty())
        .collect();
    assert_eq!(writers, d.peers);
    // MLA: every D rank has exactly one writer.
    let pair = plan(
        "mla",
        "tp=4,block=16,layout=NHD",
        "tp=2,block=64,layout=NHD",
    );
    for rank in 0..2 {
        assert_eq!(RankLinks::decode(&pair, rank).unwrap().peers.len(), 1);
    }
    for links in (0..4).map(|p| RankLinks::prefill(&pair, p).unwrap()) {
        links.validate().unwrap();
    }
}

#[test]
fn what_the_runtime_cannot_name_is_refused() {
    let pair = plan(
        "gqa8",
        "tp=2,block=16,layout=NHD",
        "tp=4,block=16,layout=NHD",
    );
    assert!(matches!(
        RankLinks::decode(&pair, 4),
        Err(ConnectorError::InvalidParam { .. })
    ));
    // Pipeline stages: P's stage 1 is rank 1 (TP 1), and writes to D's one rank.
    let staged = plan(
        "gqa8",
        "tp=1,block=16,layout=NHD,pp=2",
        "tp=1,block=16,layout=NHD",
    );
    assert_eq!(RankLinks::prefill(&staged, 1).unwrap().peers, vec![0]);
    assert_eq!(RankLinks::decode(&staged, 0).unwrap().peers, vec![0, 1]);
    assert!(RankLinks::prefill(&staged, 2).is_err());
    let links = |remote_tp, remote_ranks, peers: Vec<u32>| RankLinks {
        side: SideName::Decode,
        rank: 0,
        remote_tp,
        remote_ranks,
        peers,
    };
    links(2, 2, vec![0, 1]).validate().unwrap();
    links(2, 2, vec![]).validate().unwrap();
    links(2, 4, vec![1, 3]).validate().unwrap();
    for bad in [
        links(0, 0, vec![]),
        links(2, 3, vec![]),
        links(2, 2, vec![2]),
        links(4, 4, vec![1, 1]),
        links(4, 4, vec![3, 1]),
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}
