//! The compatibility hash: what must be identical on P and D for their KV bytes to mean the
//! same thing.
//!
//! TP size, block size and KV layout are deliberately left out: they may differ between P and D
//! and are negotiated from the handshake's geometry instead.

use sha2::{Digest, Sha256};

use crate::geometry::{CacheGroupKind, KvGeometry};
use crate::message::CompatHash;
use crate::wire::PROTOCOL_VERSION;

/// Names that identify what produced the KV cache, beyond its shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelIdentity {
    /// The model, e.g. `"meta-llama/Llama-3.1-8B-Instruct"`.
    pub model: String,
    /// The model's compute dtype, e.g. `"bfloat16"`.
    pub dtype: String,
    /// The KV-cache dtype, e.g. `"bfloat16"` or `"fp8_e4m3"`.
    pub cache_dtype: String,
}

/// Appends one tagged, length-prefixed field, so that no two different inputs share an encoding.
fn field(hasher: &mut Sha256, tag: &str, value: &[u8]) {
    hasher.update((tag.len() as u64).to_le_bytes());
    hasher.update(tag.as_bytes());
    hasher.update((value.len() as u64).to_le_bytes());
    hasher.update(value);
}

/// SHA-256 over the protocol version, the model identity, and the geometry's model-level
/// fields: total KV heads, head dim, layers, MLA, and the kind (and window) of every cache
/// group.
///
/// ```
/// use kvhandoff_protocol::{compatibility_hash, CacheGroup, CacheGroupKind, KvGeometry, KvLayout, ModelIdentity};
/// let model = ModelIdentity { model: "m".into(), dtype: "bfloat16".into(), cache_dtype: "bfloat16".into() };
/// let mut p = KvGeometry {
///     num_layers: 4, total_kv_heads: 8, head_dim: 64, dtype_bytes: 2,
///     kernel_block_size: 16, kernel_blocks_per_logical: 1, layout: KvLayout::Hnd,
///     tp_size: 1, tp_rank: 0, pp_size: 1, pp_rank: 0, mla: false,
///     cache_groups: vec![CacheGroup { kind: CacheGroupKind::FullAttention, num_layers: 4 }],
/// };
/// let mut d = p.clone();
/// d.tp_size = 2;
/// d.kernel_block_size = 32;
/// d.layout = KvLayout::Nhd;
/// assert_eq!(compatibility_hash(&model, &p), compatibility_hash(&model, &d));
/// p.head_dim = 128;
/// assert_ne!(compatibility_hash(&model, &p), compatibility_hash(&model, &d));
/// ```
pub fn compatibility_hash(identity: &ModelIdentity, geometry: &KvGeometry) -> CompatHash {
    let mut h = Sha256::new();
    field(&mut h, "kvhandoff.compat", b"1");
    field(&mut h, "protocol_version", &PROTOCOL_VERSION.to_le_bytes());
    field(&mut h, "model", identity.model.as_bytes());
    field(&mut h, "dtype", identity.dtype.as_bytes());
    field(&mut h, "cache_dtype", identity.cache_dtype.as_bytes());
    field(&mut h, "dtype_bytes", &geometry.dtype_bytes.to_le_bytes());
    field(
        &mut h,
        "total_kv_heads",
        &geometry.total_kv_heads.to_le_bytes(),
    );
    field(&mut h, "head_dim", &geometry.head_dim.to_le_bytes());
    field(&mut h, "num_layers", &geometry.num_layers.to_le_bytes());
    field(&mut h, "mla", &[u8::from(geometry.mla)]);
    for group in &geometry.cache_groups {
        let (tag, window) = match group.kind {
            CacheGroupKind::FullAttention => ("full_attention", 0),
            CacheGroupKind::SlidingWindow { window_tokens } => ("sliding_window", window_tokens),
            // State sizes are per TP rank, so only the kind must match.
            CacheGroupKind::Mamba { .. } => ("mamba", 0),
        };
        field(&mut h, "cache_group", tag.as_bytes());
        field(&mut h, "window_tokens", &window.to_le_bytes());
    }
    CompatHash(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{CacheGroup, KvLayout};

    fn identity() -> ModelIdentity {
        ModelIdentity {
            model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            dtype: "bfloat16".into(),
            cache_dtype: "bfloat16".into(),
        }
    }

    fn geometry() -> KvGeometry {
        KvGeometry {
            num_layers: 32,
            total_kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            kernel_block_size: 16,
            kernel_blocks_per_logical: 1,
            layout: KvLayout::Hnd,
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            mla: false,
            cache_groups: vec![CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers: 32,
            }],
        }
    }

    fn hex(hash: CompatHash) -> String {
        hash.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn hash_with(f: impl FnOnce(&mut ModelIdentity, &mut KvGeometry)) -> CompatHash {
        let (mut i, mut g) = (identity(), geometry());
        f(&mut i, &mut g);
        compatibility_hash(&i, &g)
    }

    /// The hash of one fixed input, pinned: it is part of protocol version 8. If it changes, the
    /// hash's inputs or encoding changed, and so must `PROTOCOL_VERSION` (which is hashed too, so
    /// a version bump changes this value and the pin must then be updated). The value was
    /// reproduced independently (Python `hashlib`) from the field encoding in docs/protocol.md.
    #[test]
    fn the_hash_is_stable() {
        assert_eq!(
            PROTOCOL_VERSION, 8,
            "update the pinned hash with the version"
        );
        assert_eq!(
            hex(compatibility_hash(&identity(), &geometry())),
            "47152183f314715ae6e156b9ac1b7a88f866818ec93d346cc8e43fd1baf0332d"
        );
    }

    /// The integrity setting's fold, pinned the same way (reproduced with Python `hashlib`:
    /// SHA-256 of the tag bytes then the 32 bytes of the hash above; docs/protocol.md §7).
    #[test]
    fn the_integrity_fold_is_stable() {
        let on =
            crate::integrity::with_integrity(compatibility_hash(&identity(), &geometry()), true);
        assert_eq!(
            hex(on),
            "80b17f6eac655cc350f6adf3654a1d6cc9513daa7338b7933f3c65104eb7e7b5"
        );
    }

    #[test]
    fn what_must_match_changes_the_hash() {
        let base = compatibility_hash(&identity(), &geometry());
        type Change = fn(&mut ModelIdentity, &mut KvGeometry);
        let changes: [(&str, Change); 13] = [
            ("model", |i, _| i.model.push('x')),
            ("dtype", |i, _| i.dtype = "float16".into()),
            ("cache dtype", |i, _| i.cache_dtype = "fp8_e4m3".into()),
            ("element size", |_, g| g.dtype_bytes = 1),
            ("heads", |_, g| g.total_kv_heads = 4),
            ("head dim", |_, g| g.head_dim = 64),
            ("layers", |_, g| g.num_layers = 16),
            ("mla", |_, g| g.mla = true),
            ("group kind", |_, g| {
                g.cache_groups[0].kind = CacheGroupKind::SlidingWindow {
                    window_tokens: 4096,
                }
            }),
            ("mamba group", |_, g| {
                g.cache_groups[0].kind = CacheGroupKind::Mamba {
                    conv_state_bytes: 1,
                    ssm_state_bytes: 1,
                }
            }),
            ("extra group", |_, g| {
                g.cache_groups[0].num_layers = 31;
                g.cache_groups.push(CacheGroup {
                    kind: CacheGroupKind::FullAttention,
                    num_layers: 1,
                });
            }),
            ("group order", |_, g| {
                g.cache_groups = vec![
                    CacheGroup {
                        kind: CacheGroupKind::SlidingWindow { window_tokens: 128 },
                        num_layers: 16,
                    },
                    CacheGroup {
                        kind: CacheGroupKind::FullAttention,
                        num_layers: 16,
                    },
                ];
            }),
            // Moving text from one field into the next must not collide.
            ("field boundary", |i, _| {
                i.model = "meta-llama/Llama-3.1-8B-Instructb".into();
                i.dtype = "float16".into();
            }),
        ];
        for (what, change) in changes {
            assert_ne!(hash_with(change), base, "{what} does not change the hash");
        }
        // The window size matters, not only the kind.
        let window = |w| {
            hash_with(move |_, g| {
                g.cache_groups[0].kind = CacheGroupKind::SlidingWindow { window_tokens: w }
            })
        };
        assert_ne!(window(4096), window(8192));
        // And the order of groups.
        let two = |first, second| {
            hash_with(move |_, g| {
                g.cache_groups = vec![
                    CacheGroup {
                        kind: first,
                        num_layers: 16,
                    },
                    CacheGroup {
                        kind: second,
                        num_layers: 16,
                    },
                ]
            })
        };
        let full = CacheGroupKind::FullAttention;
        let swa = CacheGroupKind::SlidingWindow { window_tokens: 128 };
        assert_ne!(two(full, swa), two(swa, full));
    }

    #[test]
    fn what_may_differ_between_p_and_d_does_not_change_the_hash() {
        let base = compatibility_hash(&identity(), &geometry());
        type Change = fn(&mut ModelIdentity, &mut KvGeometry);
        let changes: [(&str, Change); 8] = [
            ("tp size", |_, g| g.tp_size = 8),
            ("tp rank", |_, g| {
                g.tp_size = 4;
                g.tp_rank = 3;
            }),
            ("block size", |_, g| g.kernel_block_size = 64),
            ("layout", |_, g| g.layout = KvLayout::Nhd),
            ("blocks per logical", |_, g| g.kernel_blocks_per_logical = 4),
            ("pp rank", |_, g| {
                g.pp_size = 2;
                g.pp_rank = 1;
                g.cache_groups[0].num_layers = 16;
            }),
            ("pp size (layers per group follow)", |_, g| {
                g.pp_size = 4;
                g.cache_groups[0].num_layers = 8;
            }),
            ("mamba state sizes (per TP rank)", |_, g| {
                g.cache_groups[0].kind = CacheGroupKind::Mamba {
                    conv_state_bytes: 2,
                    ssm_state_bytes: 3,
                }
            }),
        ];
        for (what, change) in &changes[..7] {
            assert_eq!(hash_with(change), base, "{what} changes the hash");
        }
        // State sizes: compare two mamba geometries that differ only in sizes.
        let mamba = |conv, ssm| {
            hash_with(move |_, g| {
                g.cache_groups[0].kind = CacheGroupKind::Mamba {
                    conv_state_bytes: conv,
                    ssm_state_bytes: ssm,
                }
            })
        };
        assert_eq!(mamba(2, 3), mamba(1000, 70_000), "{}", changes[7].0);
    }

    #[test]
    fn the_hash_is_deterministic() {
        assert_eq!(
            compatibility_hash(&identity(), &geometry()),
            compatibility_hash(&identity(), &geometry().clone())
        );
    }
}
