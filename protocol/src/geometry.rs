//! The shape of one rank's KV cache: what P and D must agree on before a byte moves.
//!
//! A [`KvGeometry`] describes one engine rank (its TP and PP coordinates included). It derives the
//! region table the rank registers with NIXL ([`KvGeometry::regions`]) and the byte length of a
//! kernel block in each region.

use serde::{Deserialize, Serialize};

/// Most cache groups a geometry may have (full attention, sliding window, mamba, ...).
pub const MAX_CACHE_GROUPS: usize = 8;
/// Most layers a model may have.
pub const MAX_LAYERS: u32 = 4096;
/// Most TP or PP ranks an engine may have.
pub const MAX_PARALLEL: u32 = 1024;

/// Memory layout of one kernel block of an attention region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum KvLayout {
    /// Tokens outermost: `[block_size, heads, head_dim]`.
    Nhd,
    /// Heads outermost: `[heads, block_size, head_dim]`.
    Hnd,
}

/// What one cache group stores per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum CacheGroupKind {
    /// Attention over every token: K and V for every token.
    FullAttention,
    /// Attention over the last `window_tokens` tokens only.
    SlidingWindow {
        /// The window, in tokens.
        window_tokens: u32,
    },
    /// A state-space layer's fixed-size state; one block holds one request's state.
    Mamba {
        /// Bytes of convolution state per block, on this rank.
        conv_state_bytes: u64,
        /// Bytes of SSM state per block, on this rank.
        ssm_state_bytes: u64,
    },
}

/// A group of this rank's layers that share one block table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CacheGroup {
    /// What the group's layers store.
    pub kind: CacheGroupKind,
    /// How many of this rank's layers belong to the group.
    pub num_layers: u32,
}

/// Which part of a layer's cache a region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RegionKind {
    /// Keys of an attention layer.
    Key,
    /// Values of an attention layer.
    Value,
    /// The joint latent of an MLA layer.
    Latent,
    /// The state of a mamba layer.
    State,
}

/// One region of a rank's KV cache, before it has an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionSpec {
    /// Index of the cache group in [`KvGeometry::cache_groups`].
    pub group: usize,
    /// Layer index on this rank.
    pub layer: u32,
    /// Which part of the layer.
    pub kind: RegionKind,
    /// Bytes of one kernel block of this region.
    pub block_len: u64,
}

/// One registered region as advertised to the peer: `[base, len, num_blocks, block_len]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Address of kernel block 0 in the owner's address space.
    pub base: u64,
    /// Bytes in the region; at least `num_blocks * block_len`.
    pub len: u64,
    /// Kernel blocks in the region.
    pub num_blocks: u32,
    /// Bytes per kernel block (the stride between blocks).
    pub block_len: u64,
}

impl RegionDesc {
    /// Checks that the region is self-consistent and does not wrap the address space.
    ///
    /// # Errors
    /// [`GeometryError::BadRegion`] naming the broken rule.
    pub fn validate(&self) -> Result<(), GeometryError> {
        let bad = |why| Err(GeometryError::BadRegion { why });
        if self.block_len == 0 {
            return bad("block_len is zero");
        }
        let Some(needed) = u64::from(self.num_blocks).checked_mul(self.block_len) else {
            return bad("num_blocks * block_len overflows");
        };
        if needed > self.len {
            return bad("num_blocks * block_len exceeds len");
        }
        if self.base.checked_add(self.len).is_none() {
            return bad("base + len overflows");
        }
        Ok(())
    }
}

/// Why a geometry is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// A size that must be positive is zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// A count is above its limit.
    #[error("{field} is {value}, above the limit of {limit}")]
    TooLarge {
        /// The field's name.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// A rank is not below its group size.
    #[error("{field} rank {rank} is not below size {size}")]
    RankOutOfRange {
        /// `"tp"` or `"pp"`.
        field: &'static str,
        /// The rank given.
        rank: u32,
        /// The group size.
        size: u32,
    },
    /// KV heads cannot be split evenly over the TP ranks (nor replicated evenly).
    #[error(
        "{total_kv_heads} KV heads cannot be split over or replicated across {tp_size} TP ranks"
    )]
    HeadsNotDivisible {
        /// Total KV heads of the model.
        total_kv_heads: u32,
        /// TP size.
        tp_size: u32,
    },
    /// Layers cannot be split evenly over the PP ranks.
    #[error("{num_layers} layers cannot be split evenly over {pp_size} PP ranks")]
    LayersNotDivisible {
        /// Total layers of the model.
        num_layers: u32,
        /// PP size.
        pp_size: u32,
    },
    /// An MLA model stores one latent per layer, so it has exactly one KV head.
    #[error("an MLA geometry has exactly one KV head, not {total_kv_heads}")]
    MlaHeads {
        /// Total KV heads given.
        total_kv_heads: u32,
    },
    /// The cache groups do not cover this rank's layers exactly.
    #[error("cache groups hold {in_groups} layers but this rank has {local_layers}")]
    GroupLayers {
        /// Layers summed over the groups.
        in_groups: u64,
        /// Layers on this rank.
        local_layers: u32,
    },
    /// A sliding window of zero tokens, or a mamba group with no state.
    #[error("cache group {group} is degenerate: {why}")]
    BadGroup {
        /// Index of the group.
        group: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// A block's byte size does not fit in 64 bits.
    #[error("the block size in bytes overflows")]
    Overflow,
    /// A region descriptor is inconsistent.
    #[error("bad region: {why}")]
    BadRegion {
        /// What is wrong.
        why: &'static str,
    },
}

/// The KV-cache geometry of one engine rank.
///
/// ```
/// use kvhandoff_protocol::{CacheGroup, CacheGroupKind, KvGeometry, KvLayout};
/// let g = KvGeometry {
///     num_layers: 8,
///     total_kv_heads: 8,
///     head_dim: 128,
///     dtype_bytes: 2,
///     kernel_block_size: 16,
///     kernel_blocks_per_logical: 1,
///     layout: KvLayout::Hnd,
///     tp_size: 2,
///     tp_rank: 0,
///     pp_size: 1,
///     pp_rank: 0,
///     mla: false,
///     cache_groups: vec![CacheGroup { kind: CacheGroupKind::FullAttention, num_layers: 8 }],
/// };
/// g.validate().unwrap();
/// assert_eq!(g.heads_per_rank(), 4);
/// assert_eq!(g.attention_block_len().unwrap(), 16 * 4 * 128 * 2);
/// assert_eq!(g.regions().unwrap().len(), 16); // K and V for each of 8 layers
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGeometry {
    /// Layers of the whole model (all PP ranks).
    pub num_layers: u32,
    /// KV heads of the whole model (all TP ranks); 1 for MLA.
    pub total_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per cache element (2 for bf16, 1 for fp8).
    pub dtype_bytes: u32,
    /// Tokens per kernel (physical) block.
    pub kernel_block_size: u32,
    /// Kernel blocks per logical block (the engine's block manager counts logical blocks).
    pub kernel_blocks_per_logical: u32,
    /// Layout of attention blocks.
    pub layout: KvLayout,
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
    /// This rank's TP rank.
    pub tp_rank: u32,
    /// Pipeline-parallel size of the engine.
    pub pp_size: u32,
    /// This rank's PP rank.
    pub pp_rank: u32,
    /// Multi-head latent attention: one latent per layer, replicated on every TP rank.
    pub mla: bool,
    /// The cache groups of this rank's layers, in block-table order.
    pub cache_groups: Vec<CacheGroup>,
}

impl KvGeometry {
    /// The geometry of a dense model on one rank (TP 1, PP 1, no MLA): every layer in one
    /// full-attention group, one kernel block per logical block.
    ///
    /// ```
    /// use kvhandoff_protocol::{KvGeometry, KvLayout};
    /// let g = KvGeometry::dense(8, 8, 128, 2, 16, KvLayout::Hnd);
    /// g.validate().unwrap();
    /// assert_eq!(g.regions().unwrap().len(), 16);
    /// ```
    pub fn dense(
        num_layers: u32,
        total_kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        kernel_block_size: u32,
        layout: KvLayout,
    ) -> KvGeometry {
        KvGeometry {
            num_layers,
            total_kv_heads,
            head_dim,
            dtype_bytes,
            kernel_block_size,
            kernel_blocks_per_logical: 1,
            layout,
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            mla: false,
            cache_groups: vec![CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers,
            }],
        }
    }

    /// The geometry of an engine whose blocks kvhandoff moves as opaque bytes (TP 1, PP 1):
    /// `num_regions` regions (one per layer, as vLLM's CPU backend lays out its cache), each
    /// block of each region `block_bytes` long, `block_tokens` tokens per block. What is inside
    /// a block is the engine's business (its attention kernel's packing): the two engines must
    /// agree on it, which the model identity's dtype and the block shape stand for.
    ///
    /// Expressed as one latent region per layer (the region kind that holds a whole block of a
    /// layer), one byte per element: `head_dim` is `block_bytes / block_tokens`.
    ///
    /// ```
    /// use kvhandoff_protocol::KvGeometry;
    /// let g = KvGeometry::opaque_blocks(2, 32 * 1024, 32).unwrap();
    /// let regions = g.regions().unwrap();
    /// assert_eq!(regions.len(), 2);
    /// assert_eq!(regions[1].block_len, 32 * 1024);
    /// ```
    ///
    /// # Errors
    /// [`GeometryError::Zero`] for a zero argument; [`GeometryError::BadGroup`] when
    /// `block_bytes` is not a whole number of bytes per token, or the result is not a valid
    /// geometry.
    pub fn opaque_blocks(
        num_regions: u32,
        block_bytes: u64,
        block_tokens: u32,
    ) -> Result<KvGeometry, GeometryError> {
        for (field, value) in [
            ("num_regions", u64::from(num_regions)),
            ("block_bytes", block_bytes),
            ("block_tokens", u64::from(block_tokens)),
        ] {
            if value == 0 {
                return Err(GeometryError::Zero { field });
            }
        }
        let per_token = block_bytes / u64::from(block_tokens);
        if per_token * u64::from(block_tokens) != block_bytes {
            return Err(GeometryError::BadGroup {
                group: 0,
                why: "block_bytes is not a whole number of bytes per token",
            });
        }
        let head_dim = u32::try_from(per_token).map_err(|_| GeometryError::Overflow)?;
        let geometry = KvGeometry {
            mla: true,
            ..KvGeometry::dense(num_regions, 1, head_dim, 1, block_tokens, KvLayout::Nhd)
        };
        geometry.validate()?;
        Ok(geometry)
    }

    /// Checks every rule a usable geometry follows.
    ///
    /// # Errors
    /// The first broken rule, as a [`GeometryError`].
    pub fn validate(&self) -> Result<(), GeometryError> {
        let positive = [
            ("num_layers", self.num_layers),
            ("total_kv_heads", self.total_kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("kernel_block_size", self.kernel_block_size),
            ("kernel_blocks_per_logical", self.kernel_blocks_per_logical),
            ("tp_size", self.tp_size),
            ("pp_size", self.pp_size),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(GeometryError::Zero { field });
            }
        }
        let limits = [
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("tp_size", self.tp_size, MAX_PARALLEL),
            ("pp_size", self.pp_size, MAX_PARALLEL),
        ];
        for (field, value, limit) in limits {
            if value > limit {
                return Err(GeometryError::TooLarge {
                    field,
                    value: value.into(),
                    limit: limit.into(),
                });
            }
        }
        if self.tp_rank >= self.tp_size {
            return Err(GeometryError::RankOutOfRange {
                field: "tp",
                rank: self.tp_rank,
                size: self.tp_size,
            });
        }
        if self.pp_rank >= self.pp_size {
            return Err(GeometryError::RankOutOfRange {
                field: "pp",
                rank: self.pp_rank,
                size: self.pp_size,
            });
        }
        if self.mla && self.total_kv_heads != 1 {
            return Err(GeometryError::MlaHeads {
                total_kv_heads: self.total_kv_heads,
            });
        }
        let split = self.total_kv_heads % self.tp_size == 0;
        let replicated = self.tp_size % self.total_kv_heads == 0;
        if !self.mla && !split && !replicated {
            return Err(GeometryError::HeadsNotDivisible {
                total_kv_heads: self.total_kv_heads,
                tp_size: self.tp_size,
            });
        }
        if self.num_layers % self.pp_size != 0 {
            return Err(GeometryError::LayersNotDivisible {
                num_layers: self.num_layers,
                pp_size: self.pp_size,
            });
        }
        self.validate_groups()?;
        // Computing every block length proves none overflows.
        self.regions().map(|_| ())
    }

    fn validate_groups(&self) -> Result<(), GeometryError> {
        if self.cache_groups.is_empty() {
            return Err(GeometryError::Zero {
                field: "cache_groups",
            });
        }
        if self.cache_groups.len() > MAX_CACHE_GROUPS {
            return Err(GeometryError::TooLarge {
                field: "cache_groups",
                value: self.cache_groups.len() as u64,
                limit: MAX_CACHE_GROUPS as u64,
            });
        }
        for (group, g) in self.cache_groups.iter().enumerate() {
            let why = match g.kind {
                _ if g.num_layers == 0 => Some("it has no layers"),
                CacheGroupKind::SlidingWindow { window_tokens: 0 } => Some("window of zero tokens"),
                CacheGroupKind::Mamba {
                    conv_state_bytes: 0,
                    ssm_state_bytes: 0,
                } => Some("mamba state of zero bytes"),
                CacheGroupKind::FullAttention
                | CacheGroupKind::SlidingWindow { .. }
                | CacheGroupKind::Mamba { .. } => None,
            };
            if let Some(why) = why {
                return Err(GeometryError::BadGroup { group, why });
            }
        }
        let in_groups: u64 = self
            .cache_groups
            .iter()
            .map(|g| u64::from(g.num_layers))
            .sum();
        let local_layers = self.local_layers();
        if in_groups != u64::from(local_layers) {
            return Err(GeometryError::GroupLayers {
                in_groups,
                local_layers,
            });
        }
        Ok(())
    }

    /// The rank's index in its engine, what [`PeerAddr::rank`](crate::PeerAddr) names: its TP
    /// rank within its pipeline stage, the stages in order (`pp_rank × tp_size + tp_rank`). The
    /// TP rank itself when the engine has one stage.
    ///
    /// ```
    /// use kvhandoff_protocol::{KvGeometry, KvLayout};
    /// let mut g = KvGeometry::dense(4, 8, 64, 2, 16, KvLayout::Hnd);
    /// (g.tp_size, g.tp_rank) = (2, 1);
    /// assert_eq!(g.rank_index(), 1);
    /// (g.pp_size, g.pp_rank) = (2, 1);
    /// assert_eq!(g.rank_index(), 3);
    /// ```
    pub fn rank_index(&self) -> u32 {
        self.pp_rank
            .saturating_mul(self.tp_size)
            .saturating_add(self.tp_rank)
    }

    /// Layers held by this PP rank.
    pub fn local_layers(&self) -> u32 {
        self.num_layers / self.pp_size.max(1)
    }

    /// KV heads stored on this rank: the rank's share, or 1 when heads are replicated (more TP
    /// ranks than heads) or the model is MLA.
    pub fn heads_per_rank(&self) -> u32 {
        if self.mla {
            return 1;
        }
        (self.total_kv_heads / self.tp_size.max(1)).max(1)
    }

    /// Tokens per logical block.
    pub fn logical_block_size(&self) -> u64 {
        u64::from(self.kernel_block_size) * u64::from(self.kernel_blocks_per_logical)
    }

    /// Bytes of one kernel block of one attention region (K, V or latent) on this rank.
    ///
    /// # Errors
    /// [`GeometryError::Overflow`] if the product does not fit in 64 bits.
    pub fn attention_block_len(&self) -> Result<u64, GeometryError> {
        [
            u64::from(self.heads_per_rank()),
            u64::from(self.head_dim),
            u64::from(self.dtype_bytes),
        ]
        .into_iter()
        .try_fold(u64::from(self.kernel_block_size), u64::checked_mul)
        .ok_or(GeometryError::Overflow)
    }

    /// The regions this rank registers, in registration order: for each cache group, for each
    /// of its layers, K then V (or the latent for MLA, or the state for mamba).
    ///
    /// # Errors
    /// [`GeometryError::Overflow`] if a block length does not fit in 64 bits.
    pub fn regions(&self) -> Result<Vec<RegionSpec>, GeometryError> {
        let attention = self.attention_block_len()?;
        let mut regions = Vec::new();
        let mut layer = 0u32;
        for (group, g) in self.cache_groups.iter().enumerate() {
            let parts: Vec<(RegionKind, u64)> = match g.kind {
                CacheGroupKind::FullAttention | CacheGroupKind::SlidingWindow { .. } => {
                    if self.mla {
                        vec![(RegionKind::Latent, attention)]
                    } else {
                        vec![(RegionKind::Key, attention), (RegionKind::Value, attention)]
                    }
                }
                CacheGroupKind::Mamba {
                    conv_state_bytes,
                    ssm_state_bytes,
                } => {
                    let state = conv_state_bytes
                        .checked_add(ssm_state_bytes)
                        .ok_or(GeometryError::Overflow)?;
                    vec![(RegionKind::State, state)]
                }
            };
            for _ in 0..g.num_layers {
                for &(kind, block_len) in &parts {
                    regions.push(RegionSpec {
                        group,
                        layer,
                        kind,
                        block_len,
                    });
                }
                layer += 1;
            }
        }
        Ok(regions)
    }

    /// Bytes one logical block occupies across every region of one cache group on this rank.
    ///
    /// # Errors
    /// [`GeometryError::Overflow`] on overflow; [`GeometryError::BadGroup`] for an unknown group.
    pub fn logical_block_bytes(&self, group: usize) -> Result<u64, GeometryError> {
        if group >= self.cache_groups.len() {
            return Err(GeometryError::BadGroup {
                group,
                why: "no such cache group",
            });
        }
        self.regions()?
            .iter()
            .filter(|r| r.group == group)
            .try_fold(0u64, |sum, r| {
                r.block_len
                    .checked_mul(u64::from(self.kernel_blocks_per_logical))
                    .and_then(|b| sum.checked_add(b))
            })
            .ok_or(GeometryError::Overflow)
    }
}

#[cfg(test)]
mod tests;
