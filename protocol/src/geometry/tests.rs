//! Unit tests of the KV geometry: its validation rules, region tables and block sizes.

use super::*;

/// 8 layers, 8 KV heads of 128 bf16 elements, 16-token blocks, TP 2, one full-attention
/// group.
fn dense() -> KvGeometry {
    KvGeometry {
        num_layers: 8,
        total_kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        kernel_block_size: 16,
        kernel_blocks_per_logical: 1,
        layout: KvLayout::Hnd,
        tp_size: 2,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: vec![CacheGroup {
            kind: CacheGroupKind::FullAttention,
            num_layers: 8,
        }],
    }
}

fn with(f: impl FnOnce(&mut KvGeometry)) -> KvGeometry {
    let mut g = dense();
    f(&mut g);
    g
}

fn err(f: impl FnOnce(&mut KvGeometry)) -> GeometryError {
    with(f).validate().unwrap_err()
}

const MAMBA: CacheGroupKind = CacheGroupKind::Mamba {
    conv_state_bytes: 3000,
    ssm_state_bytes: 70_000,
};

#[test]
fn the_dense_geometry_is_valid() {
    let g = dense();
    assert_eq!(g.validate(), Ok(()));
    assert_eq!(g.local_layers(), 8);
    assert_eq!(g.heads_per_rank(), 4);
    assert_eq!(g.logical_block_size(), 16);
}

#[test]
fn every_positive_field_must_be_positive() {
    type Zero = fn(&mut KvGeometry);
    let fields: [(&str, Zero); 8] = [
        ("num_layers", |g| g.num_layers = 0),
        ("total_kv_heads", |g| g.total_kv_heads = 0),
        ("head_dim", |g| g.head_dim = 0),
        ("dtype_bytes", |g| g.dtype_bytes = 0),
        ("kernel_block_size", |g| g.kernel_block_size = 0),
        ("kernel_blocks_per_logical", |g| {
            g.kernel_blocks_per_logical = 0
        }),
        ("tp_size", |g| g.tp_size = 0),
        ("pp_size", |g| g.pp_size = 0),
    ];
    for (field, zero) in fields {
        assert_eq!(err(zero), GeometryError::Zero { field }, "{field}");
    }
    assert_eq!(
        err(|g| g.cache_groups.clear()),
        GeometryError::Zero {
            field: "cache_groups"
        }
    );
}

#[test]
fn counts_above_their_limits_are_refused() {
    assert_eq!(
        err(|g| g.num_layers = MAX_LAYERS + 1),
        GeometryError::TooLarge {
            field: "num_layers",
            value: u64::from(MAX_LAYERS) + 1,
            limit: MAX_LAYERS.into()
        }
    );
    assert_eq!(
        err(|g| g.tp_size = MAX_PARALLEL + 1),
        GeometryError::TooLarge {
            field: "tp_size",
            value: u64::from(MAX_PARALLEL) + 1,
            limit: MAX_PARALLEL.into()
        }
    );
    assert_eq!(
        err(|g| g.pp_size = MAX_PARALLEL + 1),
        GeometryError::TooLarge {
            field: "pp_size",
            value: u64::from(MAX_PARALLEL) + 1,
            limit: MAX_PARALLEL.into()
        }
    );
    let groups = MAX_CACHE_GROUPS + 1;
    assert_eq!(
        err(|g| {
            g.num_layers = groups as u32;
            g.cache_groups = vec![
                CacheGroup {
                    kind: CacheGroupKind::FullAttention,
                    num_layers: 1
                };
                groups
            ];
        }),
        GeometryError::TooLarge {
            field: "cache_groups",
            value: groups as u64,
            limit: MAX_CACHE_GROUPS as u64
        }
    );
    // At the limits: fine.
    let g = with(|g| {
        g.num_layers = MAX_LAYERS;
        g.cache_groups[0].num_layers = MAX_LAYERS;
        g.total_kv_heads = 1;
        g.tp_size = MAX_PARALLEL;
        g.tp_rank = MAX_PARALLEL - 1;
    });
    assert_eq!(g.validate(), Ok(()));
}

#[test]
fn ranks_must_be_below_their_sizes() {
    assert_eq!(
        err(|g| g.tp_rank = 2),
        GeometryError::RankOutOfRange {
            field: "tp",
            rank: 2,
            size: 2
        }
    );
    assert_eq!(
        err(|g| g.pp_rank = 1),
        GeometryError::RankOutOfRange {
            field: "pp",
            rank: 1,
            size: 1
        }
    );
    assert_eq!(with(|g| g.tp_rank = 1).validate(), Ok(()));
}

#[test]
fn heads_split_evenly_or_replicate_evenly() {
    // Split: 8 heads over 4 ranks.
    let g = with(|g| g.tp_size = 4);
    assert_eq!(g.validate(), Ok(()));
    assert_eq!(g.heads_per_rank(), 2);
    // Replicated: 2 heads over 8 ranks, each rank stores one head.
    let g = with(|g| {
        g.total_kv_heads = 2;
        g.tp_size = 8;
        g.tp_rank = 7;
    });
    assert_eq!(g.validate(), Ok(()));
    assert_eq!(g.heads_per_rank(), 1);
    assert_eq!(g.attention_block_len(), Ok(16 * 128 * 2));
    // 3 heads over 6 ranks replicate; over 4 they neither split nor replicate.
    assert_eq!(
        with(|g| {
            g.total_kv_heads = 3;
            g.tp_size = 6;
        })
        .validate(),
        Ok(())
    );
    assert_eq!(
        err(|g| {
            g.total_kv_heads = 6;
            g.tp_size = 4;
        }),
        GeometryError::HeadsNotDivisible {
            total_kv_heads: 6,
            tp_size: 4
        }
    );
    assert_eq!(
        err(|g| {
            g.total_kv_heads = 3;
            g.tp_size = 4;
        }),
        GeometryError::HeadsNotDivisible {
            total_kv_heads: 3,
            tp_size: 4
        }
    );
}

#[test]
fn layers_split_evenly_over_pp() {
    assert_eq!(
        err(|g| g.pp_size = 3),
        GeometryError::LayersNotDivisible {
            num_layers: 8,
            pp_size: 3
        }
    );
    let g = with(|g| {
        g.pp_size = 2;
        g.pp_rank = 1;
        g.cache_groups[0].num_layers = 4;
    });
    assert_eq!(g.validate(), Ok(()));
    assert_eq!(g.local_layers(), 4);
    assert_eq!(g.regions().unwrap().len(), 8);
}

#[test]
fn mla_has_one_latent_per_layer_on_every_rank() {
    assert_eq!(
        err(|g| g.mla = true),
        GeometryError::MlaHeads { total_kv_heads: 8 }
    );
    // Any TP size: the latent is replicated.
    let g = with(|g| {
        g.mla = true;
        g.total_kv_heads = 1;
        g.head_dim = 576;
        g.tp_size = 3;
        g.tp_rank = 2;
    });
    assert_eq!(g.validate(), Ok(()));
    assert_eq!(g.heads_per_rank(), 1);
    let regions = g.regions().unwrap();
    assert_eq!(regions.len(), 8);
    for (i, r) in regions.iter().enumerate() {
        assert_eq!(r.kind, RegionKind::Latent);
        assert_eq!(r.layer, i as u32);
        assert_eq!(r.group, 0);
        assert_eq!(r.block_len, 16 * 576 * 2);
    }
}

#[test]
fn groups_must_cover_the_local_layers_exactly() {
    assert_eq!(
        err(|g| g.cache_groups[0].num_layers = 7),
        GeometryError::GroupLayers {
            in_groups: 7,
            local_layers: 8
        }
    );
    assert_eq!(
        err(|g| g.cache_groups.push(CacheGroup {
            kind: MAMBA,
            num_layers: 1
        })),
        GeometryError::GroupLayers {
            in_groups: 9,
            local_layers: 8
        }
    );
    // Sums of u32::MAX layers do not wrap.
    assert_eq!(
        err(|g| {
            g.cache_groups = vec![
                CacheGroup {
                    kind: CacheGroupKind::FullAttention,
                    num_layers: u32::MAX
                };
                2
            ];
        }),
        GeometryError::GroupLayers {
            in_groups: 2 * u64::from(u32::MAX),
            local_layers: 8
        }
    );
}

#[test]
fn degenerate_groups_are_refused() {
    let bad = |kind, num_layers| {
        err(|g| {
            g.cache_groups = vec![
                CacheGroup {
                    kind: CacheGroupKind::FullAttention,
                    num_layers: 8,
                },
                CacheGroup { kind, num_layers },
            ]
        })
    };
    assert_eq!(
        bad(CacheGroupKind::FullAttention, 0),
        GeometryError::BadGroup {
            group: 1,
            why: "it has no layers"
        }
    );
    assert_eq!(
        bad(CacheGroupKind::SlidingWindow { window_tokens: 0 }, 1),
        GeometryError::BadGroup {
            group: 1,
            why: "window of zero tokens"
        }
    );
    assert_eq!(
        bad(
            CacheGroupKind::Mamba {
                conv_state_bytes: 0,
                ssm_state_bytes: 0
            },
            1
        ),
        GeometryError::BadGroup {
            group: 1,
            why: "mamba state of zero bytes"
        }
    );
    // One of the two mamba states may be empty.
    let g = with(|g| {
        g.cache_groups = vec![CacheGroup {
            kind: CacheGroupKind::Mamba {
                conv_state_bytes: 0,
                ssm_state_bytes: 1,
            },
            num_layers: 8,
        }]
    });
    assert_eq!(g.validate(), Ok(()));
}

#[test]
fn block_sizes_that_overflow_are_refused() {
    assert_eq!(
        err(|g| {
            g.head_dim = u32::MAX;
            g.kernel_block_size = u32::MAX;
        }),
        GeometryError::Overflow
    );
    assert_eq!(
        err(|g| g.cache_groups[0].kind = CacheGroupKind::Mamba {
            conv_state_bytes: u64::MAX,
            ssm_state_bytes: 1,
        }),
        GeometryError::Overflow
    );
}

#[test]
fn hybrid_regions_follow_group_then_layer_order() {
    // 2 full-attention layers, 1 sliding-window layer, 1 mamba layer.
    let g = with(|g| {
        g.num_layers = 4;
        g.cache_groups = vec![
            CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers: 2,
            },
            CacheGroup {
                kind: CacheGroupKind::SlidingWindow {
                    window_tokens: 4096,
                },
                num_layers: 1,
            },
            CacheGroup {
                kind: MAMBA,
                num_layers: 1,
            },
        ];
    });
    assert_eq!(g.validate(), Ok(()));
    let attention = 16 * 4 * 128 * 2;
    let spec = |group, layer, kind, block_len| RegionSpec {
        group,
        layer,
        kind,
        block_len,
    };
    assert_eq!(
        g.regions().unwrap(),
        vec![
            spec(0, 0, RegionKind::Key, attention),
            spec(0, 0, RegionKind::Value, attention),
            spec(0, 1, RegionKind::Key, attention),
            spec(0, 1, RegionKind::Value, attention),
            spec(1, 2, RegionKind::Key, attention),
            spec(1, 2, RegionKind::Value, attention),
            spec(2, 3, RegionKind::State, 73_000),
        ]
    );
    // Per logical block (2 kernel blocks here), summed over each group's regions.
    let g = with(|g| {
        g.num_layers = 4;
        g.kernel_blocks_per_logical = 2;
        g.cache_groups = vec![
            CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers: 2,
            },
            CacheGroup {
                kind: CacheGroupKind::SlidingWindow {
                    window_tokens: 4096,
                },
                num_layers: 1,
            },
            CacheGroup {
                kind: MAMBA,
                num_layers: 1,
            },
        ];
    });
    assert_eq!(g.logical_block_size(), 32);
    assert_eq!(g.logical_block_bytes(0), Ok(4 * attention * 2));
    assert_eq!(g.logical_block_bytes(1), Ok(2 * attention * 2));
    assert_eq!(g.logical_block_bytes(2), Ok(73_000 * 2));
    assert_eq!(
        g.logical_block_bytes(3),
        Err(GeometryError::BadGroup {
            group: 3,
            why: "no such cache group"
        })
    );
}

#[test]
fn mla_with_mamba_has_latents_and_states() {
    let g = with(|g| {
        g.mla = true;
        g.total_kv_heads = 1;
        g.num_layers = 3;
        g.cache_groups = vec![
            CacheGroup {
                kind: CacheGroupKind::FullAttention,
                num_layers: 2,
            },
            CacheGroup {
                kind: MAMBA,
                num_layers: 1,
            },
        ];
    });
    assert_eq!(g.validate(), Ok(()));
    let kinds: Vec<_> = g.regions().unwrap().iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [RegionKind::Latent, RegionKind::Latent, RegionKind::State]
    );
}

#[test]
fn region_count_and_block_len_per_kind() {
    // Dense: K and V per layer.
    let g = dense();
    let regions = g.regions().unwrap();
    assert_eq!(regions.len(), 16);
    assert!(regions
        .iter()
        .all(|r| r.block_len == g.attention_block_len().unwrap()));
    assert_eq!(g.attention_block_len(), Ok(16 * 4 * 128 * 2));
    // The layout changes where bytes lie inside a block, never its length.
    let nhd = with(|g| g.layout = KvLayout::Nhd);
    assert_eq!(nhd.regions(), g.regions());
    // logical_block_bytes of the dense geometry: 16 regions, 1 kernel block each.
    assert_eq!(g.logical_block_bytes(0), Ok(16 * 16 * 4 * 128 * 2));
}

#[test]
fn logical_block_bytes_overflow_is_an_error() {
    let g = with(|g| {
        g.kernel_blocks_per_logical = u32::MAX;
        g.head_dim = 1 << 20;
        g.kernel_block_size = 1 << 10;
    });
    assert_eq!(g.validate(), Ok(()));
    assert_eq!(g.logical_block_bytes(0), Err(GeometryError::Overflow));
}

#[test]
fn region_descriptors_are_checked() {
    let ok = RegionDesc {
        base: 0x1000,
        len: 4096,
        num_blocks: 4,
        block_len: 1024,
    };
    assert_eq!(ok.validate(), Ok(()));
    let bad = |f: fn(&mut RegionDesc)| {
        let mut r = ok;
        f(&mut r);
        r.validate().unwrap_err()
    };
    let why = |e: GeometryError| match e {
        GeometryError::BadRegion { why } => why,
        other => panic!("{other:?}"),
    };
    assert_eq!(why(bad(|r| r.block_len = 0)), "block_len is zero");
    assert_eq!(
        why(bad(|r| {
            r.num_blocks = u32::MAX;
            r.block_len = u64::MAX / 2;
        })),
        "num_blocks * block_len overflows"
    );
    assert_eq!(
        why(bad(|r| r.num_blocks = 5)),
        "num_blocks * block_len exceeds len"
    );
    assert_eq!(why(bad(|r| r.base = u64::MAX)), "base + len overflows");
    // Slack after the blocks and an empty region are fine.
    let mut r = ok;
    r.len = 5000;
    assert_eq!(r.validate(), Ok(()));
    r.num_blocks = 0;
    assert_eq!(r.validate(), Ok(()));
}

#[test]
fn errors_display() {
    assert_eq!(
        GeometryError::HeadsNotDivisible {
            total_kv_heads: 6,
            tp_size: 4
        }
        .to_string(),
        "6 KV heads cannot be split over or replicated across 4 TP ranks"
    );
}
