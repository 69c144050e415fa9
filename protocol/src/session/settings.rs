//! What a connector needs to know beyond the router's parameters: the rank's lease, how long a
//! read may run, the engine's load-failure policy and the geometry's block size.

use std::time::Duration;

use crate::machine::{Config, LoadFailurePolicy};
use crate::KvGeometry;

/// A connector's own settings, for the read path (pull and bidirectional turns). Push needs
/// none of them.
///
/// ```
/// use std::time::Duration;
/// use kvhandoff_protocol::session::ConnectorSettings;
/// use kvhandoff_protocol::machine::{Config, LoadFailurePolicy};
/// use kvhandoff_protocol::{KvGeometry, KvLayout};
/// let geometry = KvGeometry::dense(8, 8, 128, 2, 16, KvLayout::Hnd);
/// let settings = ConnectorSettings::new(&Config::fast(), &geometry);
/// assert_eq!(settings.block_tokens, Some(16));
/// assert_eq!(settings.load_failure_policy, LoadFailurePolicy::Fail);
/// assert_eq!(settings.lease_duration, Duration::from_secs(3));
/// let settings = ConnectorSettings::new(&Config::default(), &geometry);
/// assert_eq!(settings.lease_duration, Duration::from_secs(30));
/// assert_eq!(settings.read_span, Duration::from_secs(70)); // 10 s delivery + 60 s write life
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectorSettings {
    /// How long a pull export waits for its reader; a waiting reader's heartbeats renew it, up
    /// to twice this from the start. [`ConnectorSettings::new`] takes the rank's
    /// [`Config::lease_duration`].
    pub lease_duration: Duration,
    /// How long a read granted now may still run: the grant's delivery
    /// ([`Config::max_message_delay`]) plus a transfer's life ([`Config::max_write_life`]).
    /// An export's hard end, when its blocks are back whatever happens, is twice its lease plus
    /// this after its start
    /// ([`export_hard_end`](crate::machine::export_hard_end)): what the answer
    /// exports as `remote_blocks_expiry_time`.
    pub read_span: Duration,
    /// What a failed read means to this engine (vLLM's `kv_load_failure_policy`; default
    /// [`LoadFailurePolicy::Fail`]).
    pub load_failure_policy: LoadFailurePolicy,
    /// Tokens per logical block of this rank's geometry (kernel block size × kernel blocks per
    /// logical block): where a recompute starts after a partly failed read. `None` (the
    /// default, when the connector was not told the geometry): reads are refused with
    /// [`ConnectorError::NotConfigured`](super::ConnectorError::NotConfigured).
    pub block_tokens: Option<u32>,
    /// How long D keeps a finished turn's blocks for the next turn (vLLM's
    /// `decoder_kv_blocks_ttl`; default [`DEFAULT_NEXT_TURN_TTL`], 480 s): the `ttl` to pass to
    /// `kvhandoff::KvConnector::keep_for_next_turn`.
    pub next_turn_ttl: Duration,
    /// The fewest tokens a read of the previous turn must save for P to read rather than
    /// recompute (vLLM's `kv_recompute_threshold`; default
    /// [`DEFAULT_RECOMPUTE_THRESHOLD`], 64; 0 reads whatever it saves). See
    /// [`ConnectorSettings::worth_reading`].
    pub recompute_threshold: u64,
    /// This rank's layers (from its geometry), for layer-wise push; `None` when the connector
    /// was not told the geometry: layer-wise calls are refused with
    /// [`ConnectorError::NotConfigured`](super::ConnectorError::NotConfigured).
    pub layers: Option<u32>,
    /// Layer-wise push: how many parts a request's layers are written in (default
    /// 8, `DEFAULT_LAYERWISE_PARTS`; each part is one transfer and one notification).
    pub layerwise_parts: u32,
    /// Layer-wise push: prompts of fewer tokens go as one part, when the last layer is ready
    /// (default 256, `DEFAULT_LAYERWISE_MIN_TOKENS`): below it a part's fixed cost outweighs what
    /// it hides.
    pub layerwise_min_tokens: u64,
}

/// How many parts a layer-wise request is written in by default.
pub const DEFAULT_LAYERWISE_PARTS: u32 = 8;

/// The prompt length below which a layer-wise request goes as one part, by default (the
/// threshold below which published layer-wise transfer slowed TTFT down).
pub const DEFAULT_LAYERWISE_MIN_TOKENS: u64 = 256;

/// vLLM's default `decoder_kv_blocks_ttl`.
pub const DEFAULT_NEXT_TURN_TTL: Duration = Duration::from_secs(480);

/// vLLM's default `kv_recompute_threshold`, in tokens.
pub const DEFAULT_RECOMPUTE_THRESHOLD: u64 = 64;

impl Default for ConnectorSettings {
    /// As [`ConnectorSettings::new`] with the default [`Config`], block size unknown.
    fn default() -> Self {
        ConnectorSettings {
            block_tokens: None,
            layers: None,
            ..Self::of_config(&Config::default())
        }
    }
}

impl ConnectorSettings {
    /// The settings of a rank running `config` on `geometry`, with policy `Fail`.
    pub fn new(config: &Config, geometry: &KvGeometry) -> Self {
        ConnectorSettings {
            block_tokens: geometry
                .kernel_block_size
                .checked_mul(geometry.kernel_blocks_per_logical)
                .filter(|&tokens| tokens > 0),
            layers: geometry
                .regions()
                .ok()
                .and_then(|specs| specs.iter().map(|s| s.layer + 1).max()),
            ..Self::of_config(config)
        }
    }

    /// Whether P's next turn should read the previous turn's KV back from D (call
    /// `kvhandoff::KvConnector::next_turn_allocated`) or
    /// recompute it (call `kvhandoff::KvConnector::decline_export`,
    /// so D lets go at once): vLLM's rule, `min(remote_num_tokens, prompt_tokens) −
    /// local_hit_tokens` saved tokens, read iff positive and at least the threshold (any
    /// positive saving with a threshold of 0).
    ///
    /// ```
    /// use kvhandoff_protocol::session::ConnectorSettings;
    /// let settings = ConnectorSettings::default(); // threshold 64
    /// assert!(settings.worth_reading(4_000, 4_100, 0));
    /// assert!(!settings.worth_reading(4_000, 4_100, 3_950)); // 50 tokens saved
    /// assert!(!settings.worth_reading(0, 100, 0));
    /// ```
    pub fn worth_reading(
        &self,
        remote_num_tokens: u64,
        prompt_tokens: u64,
        local_hit_tokens: u64,
    ) -> bool {
        let saved = remote_num_tokens
            .min(prompt_tokens)
            .saturating_sub(local_hit_tokens);
        saved > 0 && saved >= self.recompute_threshold
    }

    /// The layer plan of a layer-wise request of `num_tokens` prompt tokens: one part below
    /// [`Self::layerwise_min_tokens`], else [`Self::layerwise_parts`] parts (fewer when the
    /// rank has fewer layers). `None` when the rank's layers are unknown.
    ///
    /// ```
    /// use kvhandoff_protocol::session::ConnectorSettings;
    /// let settings = ConnectorSettings { layers: Some(80), ..ConnectorSettings::default() };
    /// assert_eq!(settings.layer_plan(4_096).map(|p| p.part_layers), Some(10));
    /// assert_eq!(settings.layer_plan(100).map(|p| p.part_layers), Some(80));
    /// ```
    pub fn layer_plan(&self, num_tokens: u64) -> Option<crate::machine::LayerPlan> {
        let layers = self.layers.filter(|&l| l > 0)?;
        let parts = self.layerwise_parts.clamp(1, layers);
        let part_layers = if num_tokens < self.layerwise_min_tokens {
            layers
        } else {
            layers.div_ceil(parts)
        };
        Some(crate::machine::LayerPlan {
            layers,
            part_layers,
        })
    }

    fn of_config(config: &Config) -> Self {
        ConnectorSettings {
            lease_duration: config.lease_duration,
            read_span: crate::machine::read_span(config),
            load_failure_policy: LoadFailurePolicy::Fail,
            next_turn_ttl: DEFAULT_NEXT_TURN_TTL,
            recompute_threshold: DEFAULT_RECOMPUTE_THRESHOLD,
            block_tokens: None,
            layers: None,
            layerwise_parts: DEFAULT_LAYERWISE_PARTS,
            layerwise_min_tokens: DEFAULT_LAYERWISE_MIN_TOKENS,
        }
    }
}
