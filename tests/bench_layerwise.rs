//! `kvhandoff bench layerwise`: whole-request and layer-wise push over the real NIXL runtime
//! with the `nixl` feature (the in-memory run is the crate's unit test). Figures are measured,
//! not asserted: the test checks that both modes handed every byte over and that the report
//! says what ran.
//!
//! Run: `source scripts/nixl-env.sh && cargo test --features nixl --test bench_layerwise`.

#[cfg(feature = "nixl")]
use kvhandoff_bench::layerwise::LayerwiseTransport;
use kvhandoff_bench::layerwise::{layerwise, LayerwiseOptions};

#[cfg(not(feature = "nixl"))]
#[test]
fn without_nixl_the_bench_refuses_clearly() {
    let err = layerwise(&LayerwiseOptions::default()).expect_err("no NIXL in this build");
    assert!(err.to_string().contains("`nixl` cargo feature"), "{err}");
}

#[cfg(feature = "nixl")]
#[test]
fn both_modes_move_every_byte_over_nixl() {
    let options = LayerwiseOptions {
        tokens: vec![128, 1_024],
        rounds: 2,
        transport: LayerwiseTransport::Nixl,
        ..LayerwiseOptions::default()
    };
    let report = layerwise(&options).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.rows.len(), 2);
    assert_eq!(report.rows[0].parts, 1, "128 tokens is below the threshold");
    assert_eq!(report.rows[1].parts, 8);
    for row in &report.rows {
        // Two rounds of each mode, every byte of the request checked on D each time.
        assert_eq!(row.verified_bytes, 4 * row.bytes, "{row:?}");
        assert_eq!(row.rounds_ms_whole.len(), 2);
        assert!(row.exposed_ms_whole.is_finite() && row.exposed_ms_layerwise.is_finite());
    }
    let json = serde_json::to_value(&report).expect("renders");
    for key in ["rows", "target_met", "prefill_tokens_per_s"] {
        assert!(json.get(key).is_some(), "{key} missing");
    }
}
