//! One side of a pair: every rank's geometry, layer window, heads, regions and the distinct
//! tensors it registers.

use std::ops::Range;

use serde::Serialize;

use super::{
    HeteroError, Model, ModelGroup, SideName, SideSpec, SpecError, MAX_BLOCK_TOKENS, MAX_KBPL,
    MAX_RANKS,
};
use crate::geometry::{
    CacheGroup, CacheGroupKind, GeometryError, KvGeometry, KvLayout, RegionKind, MAX_PARALLEL,
};

/// A rank's coordinates in its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RankId {
    /// TP rank.
    pub tp: u32,
    /// PP rank (stage).
    pub pp: u32,
}

impl std::fmt::Display for RankId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp{}pp{}", self.tp, self.pp)
    }
}

/// One region of a rank (a part of one layer), in [`KvGeometry::regions`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct RankRegion {
    /// Cache group (model order).
    pub group: usize,
    /// Global layer index.
    pub layer: u32,
    /// K, V, latent or state.
    pub kind: RegionKind,
    /// Bytes of one kernel block (attention) or one state slot (mamba).
    pub block_len: u64,
    /// Index of the tensor that holds it in [`RankLayout::tensors`].
    pub tensor: usize,
}

/// One distinct tensor of a rank: what it registers once, however many regions share it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Tensor {
    /// Bytes per kernel block (the stride between blocks).
    pub block_len: u64,
    /// Kernel blocks per logical block id: the side's `kbpl` for attention, 1 for mamba state
    /// (indexed by logical id).
    pub blocks_per_logical: u32,
    /// The regions it holds (indices into [`RankLayout::regions`]); more than one when cache
    /// groups share tensors.
    pub regions: Vec<usize>,
}

/// One rank of a side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankLayout {
    /// Its coordinates.
    pub rank: RankId,
    /// Its geometry (validated).
    pub geometry: KvGeometry,
    /// The global layers it holds.
    pub layers: Range<u32>,
    /// The global KV heads it holds (one head when TP exceeds the heads: replicated; the latent
    /// for MLA).
    pub heads: Range<u32>,
    /// The global mamba state heads it holds (empty without mamba).
    pub state_heads: Range<u32>,
    /// Its regions, in [`KvGeometry::regions`] order.
    pub regions: Vec<RankRegion>,
    /// Its distinct tensors, in first-seen order over the regions (what it registers).
    pub tensors: Vec<Tensor>,
}

impl RankLayout {
    /// The region of `layer`'s `kind`, if the rank holds it.
    pub fn region(&self, layer: u32, kind: RegionKind) -> Option<usize> {
        self.regions
            .iter()
            .position(|r| r.layer == layer && r.kind == kind)
    }

    /// KV heads in one of its attention blocks.
    pub fn block_heads(&self) -> u32 {
        self.geometry.heads_per_rank()
    }

    /// Tokens per kernel block.
    pub fn kernel_block(&self) -> u32 {
        self.geometry.kernel_block_size
    }

    /// Layout of its attention blocks.
    pub fn layout(&self) -> KvLayout {
        self.geometry.layout
    }
}

/// Every rank of one side; rank `pp × tp_size + tp` at that index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SideLayout {
    /// Which side.
    pub side: SideName,
    /// Its spec.
    pub spec: SideSpec,
    /// Its ranks.
    pub ranks: Vec<RankLayout>,
}

/// The global KV heads TP rank `rank` of `tp` holds: its share, or one head (replicated) when
/// `tp` exceeds `heads`, or the latent for MLA. `tp` must split or replicate `heads` evenly.
///
/// ```
/// use kvhandoff_protocol::hetero::rank_heads;
/// assert_eq!(rank_heads(8, 2, 1, false), 4..8);
/// assert_eq!(rank_heads(2, 8, 5, false), 1..2); // ranks 4..8 replicate head 1
/// assert_eq!(rank_heads(1, 4, 3, true), 0..1);
/// ```
pub fn rank_heads(heads: u32, tp: u32, rank: u32, mla: bool) -> Range<u32> {
    if mla || tp == 0 {
        return 0..1;
    }
    let at = |r: u32| (u64::from(r) * u64::from(heads) / u64::from(tp)) as u32;
    if tp <= heads {
        at(rank)..at(rank + 1)
    } else {
        at(rank)..at(rank) + 1
    }
}

impl SideLayout {
    /// Builds and validates every rank of `spec` for `model`.
    ///
    /// # Errors
    /// [`HeteroError::TooManyRanks`], [`HeteroError::Geometry`] (heads, layers, sizes),
    /// [`HeteroError::StateHeads`], [`HeteroError::PpSplitsGroup`].
    pub fn build(model: &Model, spec: SideSpec, side: SideName) -> Result<SideLayout, HeteroError> {
        check_spec(spec, side)?;
        if spec.ranks() > u64::from(MAX_RANKS) {
            return Err(HeteroError::TooManyRanks {
                side,
                ranks: spec.ranks(),
                limit: MAX_RANKS,
            });
        }
        if let Some((state_heads, _, _)) = model.mamba() {
            if spec.tp > state_heads || state_heads % spec.tp != 0 {
                return Err(HeteroError::StateHeads {
                    side,
                    state_heads,
                    tp: spec.tp,
                });
            }
        }
        let mut ranks = Vec::new();
        for pp in 0..spec.pp {
            for tp in 0..spec.tp {
                ranks.push(build_rank(model, spec, side, RankId { tp, pp })?);
            }
        }
        Ok(SideLayout { side, spec, ranks })
    }

    /// The index of `rank` in [`SideLayout::ranks`].
    pub fn index(&self, rank: RankId) -> usize {
        (rank.pp * self.spec.tp + rank.tp) as usize
    }
}

/// The spec's own limits, for specs built in code rather than parsed.
fn check_spec(spec: SideSpec, side: SideName) -> Result<(), HeteroError> {
    let fields = [
        ("tp", spec.tp, MAX_PARALLEL),
        ("pp", spec.pp, MAX_PARALLEL),
        ("block", spec.block, MAX_BLOCK_TOKENS),
        ("kbpl", spec.kbpl, MAX_KBPL),
    ];
    for (field, value, limit) in fields {
        let source = if value == 0 {
            SpecError::Zero { field }
        } else if value > limit {
            SpecError::TooLarge {
                field,
                value: value.into(),
                limit: limit.into(),
            }
        } else {
            continue;
        };
        return Err(HeteroError::Spec { side, source });
    }
    Ok(())
}

fn build_rank(
    model: &Model,
    spec: SideSpec,
    side: SideName,
    rank: RankId,
) -> Result<RankLayout, HeteroError> {
    let to_geometry = HeteroError::geometry(side);
    // Layers must split evenly over the stages before windows mean anything.
    if model.num_layers % spec.pp != 0 {
        return Err(to_geometry(GeometryError::LayersNotDivisible {
            num_layers: model.num_layers,
            pp_size: spec.pp,
        }));
    }
    let per_stage = model.num_layers / spec.pp;
    let layers = rank.pp * per_stage..(rank.pp + 1) * per_stage;
    let state_heads = match model.mamba() {
        Some((heads, _, _)) => {
            let per = heads / spec.tp;
            rank.tp * per..(rank.tp + 1) * per
        }
        None => 0..0,
    };
    let state_share = u64::from(state_heads.end - state_heads.start);
    let mut cache_groups = Vec::new();
    for (g, group) in model.groups.iter().enumerate() {
        let count = layers.clone().filter(|&l| model.group_of(l) == g).count() as u32;
        if count == 0 {
            return Err(HeteroError::PpSplitsGroup {
                side,
                pp: spec.pp,
                stage: rank.pp,
                group: group.label(),
            });
        }
        let kind = match *group {
            ModelGroup::Full => CacheGroupKind::FullAttention,
            ModelGroup::SlidingWindow { window_tokens } => {
                CacheGroupKind::SlidingWindow { window_tokens }
            }
            ModelGroup::Mamba {
                conv_bytes_per_head,
                ssm_bytes_per_head,
                ..
            } => CacheGroupKind::Mamba {
                conv_state_bytes: conv_bytes_per_head.checked_mul(state_share).ok_or(
                    HeteroError::Overflow {
                        what: "mamba state",
                    },
                )?,
                ssm_state_bytes: ssm_bytes_per_head.checked_mul(state_share).ok_or(
                    HeteroError::Overflow {
                        what: "mamba state",
                    },
                )?,
            },
        };
        cache_groups.push(CacheGroup {
            kind,
            num_layers: count,
        });
    }
    let geometry = KvGeometry {
        num_layers: model.num_layers,
        total_kv_heads: model.kv_heads,
        head_dim: model.head_dim,
        dtype_bytes: model.dtype_bytes,
        kernel_block_size: spec.block,
        kernel_blocks_per_logical: spec.kbpl,
        layout: spec.layout,
        tp_size: spec.tp,
        tp_rank: rank.tp,
        pp_size: spec.pp,
        pp_rank: rank.pp,
        mla: model.mla,
        cache_groups,
    };
    geometry.validate().map_err(&to_geometry)?;
    let specs = geometry.regions().map_err(&to_geometry)?;
    // The geometry numbers a group's layers in order; map the j-th layer of group g on this
    // rank to its global index, and give each distinct tensor an index in first-seen order.
    let mut regions = Vec::with_capacity(specs.len());
    let mut tensors: Vec<Tensor> = Vec::new();
    let mut shared: Vec<((usize, RegionKind), usize)> = Vec::new();
    for spec_region in &specs {
        let g = spec_region.group;
        let first_local = geometry.cache_groups[..g]
            .iter()
            .map(|c| c.num_layers)
            .sum::<u32>();
        let j = (spec_region.layer - first_local) as usize;
        let Some(layer) = layers.clone().filter(|&l| model.group_of(l) == g).nth(j) else {
            return Err(HeteroError::Overflow {
                what: "layer numbering",
            });
        };
        let attention = model.groups[g].is_attention();
        let index = regions.len();
        let key = (attention && model.shared_tensors).then_some((j, spec_region.kind));
        let found = key.and_then(|k| shared.iter().find(|(s, _)| *s == k).map(|&(_, t)| t));
        let tensor = match found {
            Some(t) if tensors[t].block_len == spec_region.block_len => {
                tensors[t].regions.push(index);
                t
            }
            _ => {
                tensors.push(Tensor {
                    block_len: spec_region.block_len,
                    blocks_per_logical: if attention { spec.kbpl } else { 1 },
                    regions: vec![index],
                });
                if let Some(k) = key {
                    shared.push((k, tensors.len() - 1));
                }
                tensors.len() - 1
            }
        };
        regions.push(RankRegion {
            group: g,
            layer,
            kind: spec_region.kind,
            block_len: spec_region.block_len,
            tensor,
        });
    }
    Ok(RankLayout {
        rank,
        heads: rank_heads(model.kv_heads, spec.tp, rank.tp, model.mla),
        geometry,
        layers,
        state_heads,
        regions,
        tensors,
    })
}
