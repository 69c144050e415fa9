//! The pair plan: which P rank writes which D rank, what each link carries, how many writes
//! each D rank waits for, the transforms, and what each rank registers.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Serialize;

use super::transforms::{decide, Pipeline};
use super::{HeteroError, Model, SideLayout, SideName, SideSpec};

/// The heads one link carries, in global and in each side's block-local head indices.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct HeadLink {
    /// Global KV heads.
    pub global: Range<u32>,
    /// Heads of P's block (`global - P's first head`).
    pub prefill_local: Range<u32>,
    /// Heads of D's block (`global - D's first head`).
    pub decode_local: Range<u32>,
}

/// A byte range of one state slot on each side.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ByteLink {
    /// Bytes of P's slot.
    pub prefill: Range<u64>,
    /// Bytes of D's slot.
    pub decode: Range<u64>,
}

/// The mamba state heads one link carries, and their bytes in a state slot (a slot is the
/// rank's convolution state of every state head it holds, then its SSM state).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct StateLink {
    /// Global state heads.
    pub global: Range<u32>,
    /// Convolution state bytes.
    pub conv: ByteLink,
    /// SSM state bytes.
    pub ssm: ByteLink,
}

/// One P rank writing one D rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Link {
    /// Index of the P rank in [`PairPlan::prefill`].
    pub prefill: usize,
    /// Index of the D rank in [`PairPlan::decode`].
    pub decode: usize,
    /// Global layers both hold (the PP windows' overlap).
    pub layers: Range<u32>,
    /// Attention heads it carries in those layers (none: this P rank is not D's writer for
    /// any of D's heads, only for state).
    pub heads: Option<HeadLink>,
    /// Mamba state it carries in those layers.
    pub state: Option<StateLink>,
}

/// Everything about a pair of engines that does not depend on a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PairPlan {
    /// The model.
    pub model: Model,
    /// P's ranks.
    pub prefill: SideLayout,
    /// D's ranks.
    pub decode: SideLayout,
    /// Every link, ordered by P rank then D rank.
    pub links: Vec<Link>,
    /// Writes each D rank waits for (its distinct writers), by D rank index.
    pub completions: Vec<u32>,
    /// The attention pipeline (transforms and where they run).
    pub pipeline: Pipeline,
}

impl PairPlan {
    /// The links P rank `p` writes.
    pub fn links_from(&self, p: usize) -> impl Iterator<Item = (usize, &Link)> {
        self.links
            .iter()
            .enumerate()
            .filter(move |(_, l)| l.prefill == p)
    }

    /// The links D rank `d` receives.
    pub fn links_into(&self, d: usize) -> impl Iterator<Item = (usize, &Link)> {
        self.links
            .iter()
            .enumerate()
            .filter(move |(_, l)| l.decode == d)
    }

    /// The P ranks that write nothing (their heads are replicated and another replica writes).
    pub fn idle_prefill_ranks(&self) -> Vec<usize> {
        (0..self.prefill.ranks.len())
            .filter(|&p| self.links_from(p).next().is_none())
            .collect()
    }
}

fn overlap(a: &Range<u32>, b: &Range<u32>) -> Range<u32> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

/// The P TP rank that writes global head `head` to D TP rank `d_tp`: among the P ranks that
/// hold the head, the one at D's position among the D ranks that hold it (mod their count), so
/// every D rank has exactly one writer per head, and replicas on P share the work.
/// The link from P rank `pi` to D rank `di`, made (empty, over `layers`) on first use.
fn link_between<'a>(
    links: &'a mut BTreeMap<(usize, usize), Link>,
    pi: usize,
    di: usize,
    layers: &Range<u32>,
) -> &'a mut Link {
    links.entry((pi, di)).or_insert_with(|| Link {
        prefill: pi,
        decode: di,
        layers: layers.clone(),
        heads: None,
        state: None,
    })
}

fn writer(model: &Model, p: SideSpec, d: SideSpec, head: u32, d_tp: u32) -> u32 {
    let h = if model.mla { 1 } else { model.kv_heads };
    // P ranks holding `head`: one rank when P splits the heads, a run of replicas otherwise.
    let (first, count) = if p.tp <= h {
        (head / (h / p.tp), 1)
    } else {
        (head * (p.tp / h), p.tp / h)
    };
    let position = if d.tp <= h {
        0
    } else {
        d_tp - head * (d.tp / h)
    };
    first + position % count
}

/// Plans the pair `prefill` → `decode` for `model`.
///
/// # Errors
/// Either side's [`SideLayout::build`] errors, and [`HeteroError::BlockSizesNotNested`].
///
/// ```
/// use kvhandoff_protocol::hetero::{model, plan_pair, SideSpec};
/// use kvhandoff_protocol::KvLayout;
/// // gqa2 at P tp=4 (each head on two P ranks) into D tp=1: P ranks 0 and 2 write, once each.
/// let pair = plan_pair(
///     model("gqa2").unwrap(),
///     SideSpec::new(4, 16, KvLayout::Hnd),
///     SideSpec::new(1, 16, KvLayout::Hnd),
/// )
/// .unwrap();
/// let writers: Vec<usize> = pair.links.iter().map(|l| l.prefill).collect();
/// assert_eq!(writers, [0, 2]);
/// assert_eq!(pair.completions, [2]);
/// assert_eq!(pair.idle_prefill_ranks(), [1, 3]);
/// ```
pub fn plan_pair(
    model: &Model,
    prefill: SideSpec,
    decode: SideSpec,
) -> Result<PairPlan, HeteroError> {
    let p_side = SideLayout::build(model, prefill, SideName::Prefill)?;
    let d_side = SideLayout::build(model, decode, SideName::Decode)?;
    if prefill.block % decode.block != 0 && decode.block % prefill.block != 0 {
        return Err(HeteroError::BlockSizesNotNested {
            prefill: prefill.block,
            decode: decode.block,
        });
    }
    let mut links: BTreeMap<(usize, usize), Link> = BTreeMap::new();
    for (di, d) in d_side.ranks.iter().enumerate() {
        for stage in 0..prefill.pp {
            let p_window = {
                let r = &p_side.ranks[p_side.index(super::RankId { tp: 0, pp: stage })];
                r.layers.clone()
            };
            let layers = overlap(&d.layers, &p_window);
            if layers.is_empty() {
                continue;
            }
            let attention = layers.clone().any(|l| model.is_attention_layer(l));
            let mamba = layers.clone().any(|l| !model.is_attention_layer(l));
            if attention {
                // Group D's heads by writer: each writer's heads are a contiguous run.
                let mut runs: Vec<(u32, Range<u32>)> = Vec::new();
                for head in d.heads.clone() {
                    let w = writer(model, prefill, decode, head, d.rank.tp);
                    match runs.last_mut() {
                        Some((lw, r)) if *lw == w && r.end == head => r.end = head + 1,
                        _ => runs.push((w, head..head + 1)),
                    }
                }
                for (w, global) in runs {
                    let pi = p_side.index(super::RankId { tp: w, pp: stage });
                    let p = &p_side.ranks[pi];
                    let link = link_between(&mut links, pi, di, &layers);
                    link.heads = Some(HeadLink {
                        prefill_local: global.start - p.heads.start..global.end - p.heads.start,
                        decode_local: global.start - d.heads.start..global.end - d.heads.start,
                        global,
                    });
                }
            }
            if let (true, Some((_, conv, ssm))) = (mamba, model.mamba()) {
                for w in 0..prefill.tp {
                    let pi = p_side.index(super::RankId { tp: w, pp: stage });
                    let p = &p_side.ranks[pi];
                    let global = overlap(&p.state_heads, &d.state_heads);
                    if global.is_empty() {
                        continue;
                    }
                    let bytes = |rank_heads: &Range<u32>, per: u64, base: u64| {
                        let at = |h: u32| base + u64::from(h - rank_heads.start) * per;
                        at(global.start)..at(global.end)
                    };
                    let p_conv_total = u64::from(p.state_heads.end - p.state_heads.start) * conv;
                    let d_conv_total = u64::from(d.state_heads.end - d.state_heads.start) * conv;
                    let state = StateLink {
                        conv: ByteLink {
                            prefill: bytes(&p.state_heads, conv, 0),
                            decode: bytes(&d.state_heads, conv, 0),
                        },
                        ssm: ByteLink {
                            prefill: bytes(&p.state_heads, ssm, p_conv_total),
                            decode: bytes(&d.state_heads, ssm, d_conv_total),
                        },
                        global,
                    };
                    let link = link_between(&mut links, pi, di, &layers);
                    link.state = Some(state);
                }
            }
        }
    }
    let links: Vec<Link> = links.into_values().collect();
    let mut completions = vec![0u32; d_side.ranks.len()];
    for link in &links {
        completions[link.decode] += 1;
    }
    let has_attention = model.groups.iter().any(|g| g.is_attention());
    let pipeline = decide(&p_side, &d_side, has_attention);
    Ok(PairPlan {
        model: *model,
        prefill: p_side,
        decode: d_side,
        links,
        completions,
        pipeline,
    })
}
