use super::*;

fn tiny(transport: LayerwiseTransport) -> LayerwiseOptions {
    LayerwiseOptions {
        tokens: vec![64, 1_024],
        prefill_tokens_per_s: 50_000.0,
        layers: 4,
        parts: 2,
        min_tokens: 256,
        rounds: 1,
        transport,
        timeout: Duration::from_secs(30),
    }
}

/// Over the in-memory transport: both modes hand every byte over, the short prompt goes as one
/// part, and the report renders.
#[test]
fn every_byte_arrives_in_both_modes() {
    let report = layerwise(&tiny(LayerwiseTransport::Mem)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.rows.len(), 2);
    assert_eq!(report.rows[0].parts, 1, "below the threshold");
    assert_eq!(report.rows[1].parts, 2);
    for row in &report.rows {
        // One round of each mode, every byte of the request checked.
        assert_eq!(row.verified_bytes, 2 * row.bytes, "{row:?}");
        assert!(row.exposed_ms_whole > 0.0 && row.exposed_ms_layerwise > 0.0);
    }
    assert!(report.render_table().contains("reduction"));
}

#[test]
fn bad_options_are_refused() {
    for options in [
        LayerwiseOptions {
            tokens: vec![],
            ..LayerwiseOptions::default()
        },
        LayerwiseOptions {
            parts: 0,
            ..LayerwiseOptions::default()
        },
        LayerwiseOptions {
            prefill_tokens_per_s: f64::NAN,
            ..LayerwiseOptions::default()
        },
        LayerwiseOptions {
            rounds: 0,
            ..LayerwiseOptions::default()
        },
    ] {
        assert!(matches!(
            layerwise(&options),
            Err(LayerwiseBenchError::Options(_))
        ));
    }
}
