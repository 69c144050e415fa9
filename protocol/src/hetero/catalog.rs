//! The catalog of small test models with fixed names, one per kind of cache the planner handles.
//!
//! They are tiny on purpose (4 layers, rows of 16–48 bytes) so that every cell of the
//! verification matrix runs in milliseconds; what matters is their *shape*: how many KV heads
//! (so which TP sizes split and which replicate), MLA, a sliding-window group beside a full
//! one, and mamba state beside attention.

use serde::Serialize;

use super::HeteroError;

/// One cache group of a model: what its layers store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ModelGroup {
    /// Attention over every token.
    Full,
    /// Attention over the last `window_tokens` tokens.
    SlidingWindow {
        /// The window, in tokens.
        window_tokens: u32,
    },
    /// A state-space layer's state: a convolution state and an SSM state per state head,
    /// sharded over TP by state head.
    Mamba {
        /// State heads of the whole model.
        state_heads: u32,
        /// Bytes of convolution state per state head.
        conv_bytes_per_head: u64,
        /// Bytes of SSM state per state head.
        ssm_bytes_per_head: u64,
    },
}

impl ModelGroup {
    /// Whether the group stores attention KV (full or sliding window).
    pub fn is_attention(&self) -> bool {
        matches!(self, ModelGroup::Full | ModelGroup::SlidingWindow { .. })
    }

    /// A short name: `full`, `sliding-window` or `mamba`.
    pub fn label(&self) -> &'static str {
        match self {
            ModelGroup::Full => "full-attention",
            ModelGroup::SlidingWindow { .. } => "sliding-window",
            ModelGroup::Mamba { .. } => "mamba",
        }
    }
}

/// A model of the catalog: what every rank's geometry is derived from (with a side's TP, PP,
/// block size, kernel blocks per logical block and layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Model {
    /// The fixed name (`gqa8`, `gqa2`, `mla`, `swa`, `mamba`).
    pub name: &'static str,
    /// One line on what it exercises.
    pub about: &'static str,
    /// Layers of the whole model.
    pub num_layers: u32,
    /// KV heads of the whole model (1 for MLA: the latent).
    pub kv_heads: u32,
    /// Elements per head (the latent's width for MLA).
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Multi-head latent attention: the latent is replicated on every TP rank.
    pub mla: bool,
    /// The cache groups, in block-table order.
    pub groups: &'static [ModelGroup],
    /// The group of each layer, by global layer index.
    pub layer_groups: &'static [u8],
    /// Whether the attention groups share tensors (the hybrid allocator's pool): the `j`-th
    /// layer of every attention group on a rank lives in the same tensor, and the groups' block
    /// ids are disjoint ids of that one pool.
    pub shared_tensors: bool,
}

/// The catalog, in a fixed order.
pub const MODELS: [Model; 5] = [
    Model {
        name: "gqa8",
        about: "dense GQA, 8 KV heads: TP 1-8 split the heads",
        num_layers: 4,
        kv_heads: 8,
        head_dim: 8,
        dtype_bytes: 2,
        mla: false,
        groups: &[ModelGroup::Full],
        layer_groups: &[0, 0, 0, 0],
        shared_tensors: false,
    },
    Model {
        name: "gqa2",
        about: "dense GQA, 2 KV heads: TP 4 and 8 replicate each head",
        num_layers: 4,
        kv_heads: 2,
        head_dim: 8,
        dtype_bytes: 2,
        mla: false,
        groups: &[ModelGroup::Full],
        layer_groups: &[0, 0, 0, 0],
        shared_tensors: false,
    },
    Model {
        name: "mla",
        about: "MLA: one latent per layer, replicated on every TP rank",
        num_layers: 4,
        kv_heads: 1,
        head_dim: 24,
        dtype_bytes: 2,
        mla: true,
        groups: &[ModelGroup::Full],
        layer_groups: &[0, 0, 0, 0],
        shared_tensors: false,
    },
    Model {
        name: "swa",
        about: "hybrid: full attention and a 48-token sliding window interleaved, sharing tensors, 4 KV heads",
        num_layers: 4,
        kv_heads: 4,
        head_dim: 8,
        dtype_bytes: 2,
        mla: false,
        groups: &[
            ModelGroup::Full,
            ModelGroup::SlidingWindow { window_tokens: 48 },
        ],
        layer_groups: &[0, 1, 0, 1],
        shared_tensors: true,
    },
    Model {
        name: "mamba",
        about: "hybrid: attention (4 KV heads) and mamba layers (8 state heads: conv + SSM state)",
        num_layers: 4,
        kv_heads: 4,
        head_dim: 8,
        dtype_bytes: 2,
        mla: false,
        groups: &[
            ModelGroup::Full,
            ModelGroup::Mamba {
                state_heads: 8,
                conv_bytes_per_head: 24,
                ssm_bytes_per_head: 64,
            },
        ],
        layer_groups: &[0, 1, 0, 1],
        shared_tensors: false,
    },
];

/// The catalog's names, for messages.
pub const MODEL_NAMES: &str = "gqa8, gqa2, mla, swa, mamba";

/// The model of the catalog called `name`.
///
/// # Errors
/// [`HeteroError::UnknownModel`] naming the catalog.
///
/// ```
/// use kvhandoff_protocol::hetero::model;
/// assert_eq!(model("gqa2").unwrap().kv_heads, 2);
/// assert!(model("llama").unwrap_err().to_string().contains("gqa8, gqa2, mla, swa, mamba"));
/// ```
pub fn model(name: &str) -> Result<&'static Model, HeteroError> {
    MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| HeteroError::UnknownModel {
            name: name.chars().take(64).collect(),
            known: MODEL_NAMES,
        })
}

impl Model {
    /// The group of global layer `layer` (0 for a layer out of range; callers iterate layers
    /// below [`Model::num_layers`]).
    pub fn group_of(&self, layer: u32) -> usize {
        self.layer_groups
            .get(layer as usize)
            .map_or(0, |&g| usize::from(g))
    }

    /// Whether global layer `layer` stores attention KV.
    pub fn is_attention_layer(&self, layer: u32) -> bool {
        self.groups
            .get(self.group_of(layer))
            .is_some_and(ModelGroup::is_attention)
    }

    /// The mamba group's state heads and per-head byte sizes, if the model has one.
    pub fn mamba(&self) -> Option<(u32, u64, u64)> {
        self.groups.iter().find_map(|g| match *g {
            ModelGroup::Mamba {
                state_heads,
                conv_bytes_per_head,
                ssm_bytes_per_head,
            } => Some((state_heads, conv_bytes_per_head, ssm_bytes_per_head)),
            ModelGroup::Full | ModelGroup::SlidingWindow { .. } => None,
        })
    }

    /// Bytes of one row: one token of one head.
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.dtype_bytes)
    }

    /// Whether the model has a group that is not full attention (vLLM's hybrid allocator, HMA).
    pub fn is_hybrid(&self) -> bool {
        self.groups.iter().any(|g| *g != ModelGroup::Full)
    }
}
