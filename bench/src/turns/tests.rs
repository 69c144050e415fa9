use super::*;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn the_70b_geometry_has_the_stated_bytes() {
    let g = ModelGeometry::llama_3_3_70b(4);
    // 2 (K, V) × 80 layers × 8 heads × 128 × 2 bytes.
    assert_eq!(g.bytes_per_token(), 327_680);
    assert_eq!(g.kv_heads_per_rank(), 2);
    assert_eq!(g.bytes_per_token_per_rank(), 81_920);
    assert_eq!(
        ModelGeometry::llama_3_3_70b(1).bytes_per_token_per_rank(),
        327_680
    );
    // Whole blocks move: 500 tokens are 32 blocks of 16.
    assert_eq!(g.blocks(500), 32);
    assert_eq!(g.read_bytes(500), 32 * 16 * 81_920);
    assert_eq!(g.read_bytes(16), 16 * 81_920);
    assert_eq!(g.descriptors(500, TableKind::Fragmented), 32 * 160);
    assert_eq!(g.descriptors(500, TableKind::Contiguous), 160);
    // What the transport registers agrees: 160 regions of 16 tokens × 2 heads × 128 × 2 bytes.
    let kv = g.kv_geometry();
    kv.validate().unwrap();
    let specs = kv.regions().unwrap();
    assert_eq!(specs.len(), 160);
    assert!(specs.iter().all(|s| s.block_len == 8192));
    assert_eq!(
        specs.iter().map(|s| s.block_len).sum::<u64>(),
        16 * g.bytes_per_token_per_rank()
    );
    assert!(ModelGeometry::llama_3_3_70b(3).check().is_err());
}

#[test]
fn the_seed_calibration_is_the_stated_arithmetic() {
    let c = ComputeModel::from_seed();
    let cal = c
        .calibration
        .clone()
        .expect("the seed's model says how it was derived");
    assert!(close(cal.saved_ms, 1049.77 - 498.15));
    assert_eq!(cal.mean_prefix_tokens, 4500.0);
    assert!(close(c.tokens_per_s, 4500.0 / 0.55162));
    assert!(close(c.ms_per_token * c.tokens_per_s, 1e3));
    // Recomputing the mean prefix costs exactly what pulling saved.
    assert!(close(c.recompute_ms(4500), 551.62));
    assert!(close(c.recompute_ms(0), 0.0));
    // The FLOPs bound: 4 × 989 TFLOPS over 2 × 70.6 GFLOP per token.
    let f = &c.flops_check;
    assert_eq!(f.gpus, 4);
    assert!(close(f.peak_tokens_per_s, 4.0 * 989e12 / 141.2e9));
    assert!(close(f.implied_mfu, c.tokens_per_s / f.peak_tokens_per_s));
    assert!(c.source.contains("1049.77") && c.source.contains("498.15"));

    let given = ComputeModel::with_tokens_per_s(10_000.0, "given".into(), 8);
    assert!(given.calibration.is_none());
    assert!(close(given.recompute_ms(2500), 250.0));
}

#[test]
fn rows_ratios_and_thresholds_follow_from_the_times() {
    let g = ModelGeometry::llama_3_3_70b(4);
    // 1 ms per token.
    let c = ComputeModel::with_tokens_per_s(1000.0, "test".into(), 4);
    let row = TurnRow::new(&g, 100, 7, true, &[30.0, 10.0, 20.0], &c);
    assert_eq!(row.read_ms, 20.0);
    assert_eq!((row.read_ms_min, row.read_ms_max), (10.0, 30.0));
    assert!(close(row.recompute_ms, 100.0));
    assert!(close(row.ratio, 0.2));
    assert!(close(row.saved_ms, 80.0));
    assert!(close(row.read_gbps, row.bytes as f64 / 20e6)); // bytes per ms / 10⁶
    assert!(row.read_wins());

    let at = |tokens: u32, read_ms: f64| TurnRow::new(&g, tokens, 0, true, &[read_ms], &c);
    // Loses at 16, wins at 64 and up (rows in any order).
    assert_eq!(
        threshold_tokens(&[at(256, 10.0), at(16, 20.0), at(64, 10.0)]),
        Some(64)
    );
    // A win below a loss does not count: it must win from there on.
    assert_eq!(
        threshold_tokens(&[at(16, 1.0), at(64, 100.0), at(256, 10.0)]),
        Some(256)
    );
    assert_eq!(threshold_tokens(&[at(16, 1.0), at(64, 100.0)]), None);
    // A tie is not a win.
    assert_eq!(threshold_tokens(&[at(16, 16.0)]), None);
}

#[test]
fn the_fit_recovers_a_line_and_its_break_even() {
    const MIB: u64 = 1 << 20;
    // 2 ms + 0.5 ms per MiB.
    let points: Vec<(u64, f64)> = [1u64, 4, 16, 64]
        .iter()
        .map(|&m| (m * MIB, 2.0 + 0.5 * m as f64))
        .collect();
    let fit = ReadFit::fit(&points).unwrap();
    assert!(
        close(fit.fixed_ms, 2.0) && close(fit.ms_per_mib, 0.5),
        "{fit:?}"
    );
    assert_eq!(fit.points, 4);
    assert!(close(fit.gbps, MIB as f64 / 0.5e6));
    assert!(close(fit.read_ms(128 * MIB), 66.0));
    // Per token: 1 MiB read (0.5 ms) against 1.5 ms of compute gains 1 ms a token: the 2 ms
    // fixed cost is paid back at 2 tokens, a 10 ms step more at 12.
    let even = fit.break_even_tokens(MIB, 1.5, 0.0).unwrap();
    assert!(close(even, 2.0));
    assert!(close(fit.break_even_tokens(MIB, 1.5, 10.0).unwrap(), 12.0));
    // Reading a token slower than computing it never wins.
    assert_eq!(fit.break_even_tokens(MIB, 0.4, 0.0), None);

    // One size: through the origin. A negative intercept: through the origin too.
    let one = ReadFit::fit(&[(2 * MIB, 4.0)]).unwrap();
    assert!(close(one.fixed_ms, 0.0) && close(one.ms_per_mib, 2.0));
    let negative = ReadFit::fit(&[(MIB, 0.5), (3 * MIB, 4.5)]).unwrap();
    assert_eq!(negative.fixed_ms, 0.0);
    assert!(negative.ms_per_mib > 0.0);
    assert_eq!(ReadFit::fit(&[]), None);
}

#[test]
fn bad_options_are_refused() {
    let cases = [
        TurnsOptions {
            prefixes: vec![],
            ..TurnsOptions::tiny()
        },
        TurnsOptions {
            prefixes: vec![0, 16],
            ..TurnsOptions::tiny()
        },
        TurnsOptions {
            repeats: 0,
            ..TurnsOptions::tiny()
        },
        TurnsOptions {
            max_read_bytes: 1,
            ..TurnsOptions::tiny()
        },
        TurnsOptions {
            tokens_per_s: Some(0.0),
            ..TurnsOptions::tiny()
        },
        TurnsOptions {
            geometry: ModelGeometry::llama_3_3_70b(3),
            ..TurnsOptions::tiny()
        },
    ];
    for options in cases {
        assert!(
            matches!(turns(&options), Err(TurnsBenchError::Options(_))),
            "{options:?}"
        );
    }
}

/// The keys the JSON must carry, at the top and in every row.
fn assert_json_keys(report: &TurnsReport) -> serde_json::Value {
    let text = serde_json::to_string_pretty(report).expect("serializes");
    let json: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    for key in [
        "model",
        "compute_model",
        "transport",
        "rows",
        "threshold_tokens",
        "seed",
    ] {
        assert!(json.get(key).is_some(), "missing {key} in {text}");
    }
    assert!(json["compute_model"]["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(json["compute_model"]["source"].as_str().is_some());
    assert_eq!(json["model"]["bytes_per_token_per_rank"], 81_920 / 40);
    assert_eq!(json["seed"]["recompute_mean_ttft_ms"], 1049.77);
    assert_eq!(json["seed"]["pull_mean_ttft_ms"], 498.15);
    let transport = json["transport"].as_str().unwrap();
    assert!(transport == "nixl" || transport == "mem", "{transport}");
    let rows = json["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        for key in [
            "prefix_tokens",
            "bytes",
            "read_ms",
            "recompute_ms",
            "ratio",
            "saved_ms",
        ] {
            assert!(row.get(key).is_some(), "missing rows[].{key} in {text}");
        }
    }
    json
}

#[test]
fn a_tiny_run_over_memory_reads_every_block_and_reports_json() {
    let options = TurnsOptions {
        transport: TurnsTransport::Mem,
        ..TurnsOptions::tiny()
    };
    let report = turns(&options).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.transport, "mem");
    assert!(report.transport_note.contains("--transport mem"));
    assert_eq!(report.rows.len(), 2);
    let (a, b) = (&report.rows[0], &report.rows[1]);
    assert_eq!((a.prefix_tokens, b.prefix_tokens), (16, 48));
    assert!(a.measured && b.measured);
    // 2 layers: 4 regions; fragmented: one descriptor per block and region, as planned.
    assert_eq!((a.descriptors, b.descriptors), (4, 12));
    assert_eq!(a.bytes, 16 * 2048);
    for row in &report.rows {
        // Small reads are repeated four times as often.
        assert_eq!(row.samples, 2 * SMALL_READ_REPEATS);
        assert!(row.read_ms > 0.0 && row.read_ms_min <= row.read_ms);
        assert!(row.read_ms <= row.read_ms_max);
        assert!(row.recompute_ms > 0.0);
    }
    assert_json_keys(&report);
    assert!(!report.render_table().is_empty());
}

#[test]
fn reads_above_the_cap_are_extrapolated_from_the_line() {
    let options = TurnsOptions {
        transport: TurnsTransport::Mem,
        prefixes: vec![64, 16, 32, 16],
        table: TableKind::Contiguous,
        tokens_per_s: Some(5_000.0),
        // 32 tokens of 2 layers are 64 KiB: the 64-token prefix is above.
        max_read_bytes: 64 << 10,
        ..TurnsOptions::tiny()
    };
    let report = turns(&options).unwrap_or_else(|e| panic!("{e}"));
    let prefixes: Vec<u32> = report.rows.iter().map(|r| r.prefix_tokens).collect();
    assert_eq!(prefixes, [16, 32, 64], "sorted, deduplicated");
    assert!(report.rows[0].measured && report.rows[1].measured);
    let last = &report.rows[2];
    assert!(!last.measured);
    assert_eq!(last.samples, 0);
    assert_eq!(last.descriptors, 4, "contiguous: one per region");
    assert!(close(last.read_ms, report.read_fit.read_ms(last.bytes)));
    assert_eq!(report.read_fit.points, 2);
    assert!(close(report.compute_model.tokens_per_s, 5_000.0));
    assert!(close(last.recompute_ms, 64.0 / 5.0));
    assert_eq!(report.table, "contiguous");
}

/// The command's default transport: NIXL when built with it and the runtime loads (this is
/// then a real NIXL run), the in-memory transport with a note otherwise.
#[test]
fn a_tiny_run_with_the_default_transport_says_which_it_used() {
    let report = turns(&TurnsOptions::tiny()).unwrap_or_else(|e| panic!("{e}"));
    let json = assert_json_keys(&report);
    #[cfg(not(feature = "nixl"))]
    {
        assert_eq!(json["transport"], "mem");
        assert!(report.transport_note.contains("NOT NIXL"), "{report:?}");
    }
    #[cfg(feature = "nixl")]
    {
        let available = kvhandoff_actors::transport::nixl::nixl_runtime_available().is_ok();
        assert_eq!(json["transport"], if available { "nixl" } else { "mem" });
    }
    assert!(report.rows.iter().all(|r| r.measured && r.read_ms > 0.0));
}

#[cfg(not(feature = "nixl"))]
#[test]
fn asking_for_nixl_without_it_is_an_error() {
    let options = TurnsOptions {
        transport: TurnsTransport::Nixl,
        ..TurnsOptions::tiny()
    };
    assert!(matches!(turns(&options), Err(TurnsBenchError::Nixl(_))));
}
