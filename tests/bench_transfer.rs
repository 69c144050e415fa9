//! `kvhandoff bench transfer`: the planning case always; a tiny transfer run against the real
//! NIXL runtime with the `nixl` feature.
//!
//! Run: `source scripts/nixl-env.sh && cargo test --features nixl --test bench_transfer`.
//! Without the NIXL runtime libraries the NIXL test fails with a message naming
//! `LD_LIBRARY_PATH` and `NIXL_PLUGIN_DIR` (it does not skip).

use kvhandoff_bench::transfer::{
    bench_geometry, block_tables, plan_fragmented_70b, BlockTable, TransferOptions,
    FRAGMENTED_70B_MIN_DESCRIPTORS,
};
use kvhandoff_protocol::planner::{descriptor_count, PlanInput};
use kvhandoff_protocol::RegionDesc;

/// What the planner makes of `table` for the geometry of `options` (addresses do not matter:
/// only runs do).
fn planner_count(options: &TransferOptions, table: &BlockTable) -> usize {
    let geometry = bench_geometry(options);
    let specs = geometry.regions().expect("valid geometry");
    let (pool, _) = block_tables(options.blocks());
    let regions = |base: u64| -> Vec<RegionDesc> {
        specs
            .iter()
            .enumerate()
            .map(|(i, s)| RegionDesc {
                base: base + ((i as u64) << 36),
                len: s.block_len * u64::from(pool),
                num_blocks: pool,
                block_len: s.block_len,
            })
            .collect()
    };
    let (local, remote) = (regions(1 << 44), regions(1 << 45));
    descriptor_count(&PlanInput::new(
        &local,
        &remote,
        &specs,
        &table.local,
        &table.remote,
        geometry.kernel_blocks_per_logical,
    ))
    .expect("the bench tables plan")
}

#[test]
fn the_70b_case_plans_the_minimum() {
    let case = plan_fragmented_70b(5).expect("plans");
    assert_eq!(case.descriptors, 18_880);
    assert_eq!(case.minimum, FRAGMENTED_70B_MIN_DESCRIPTORS);
    assert!(case.plan_us > 0.0 && case.plan_us_p99 >= case.plan_us);
    assert_eq!(case.plans, 5);
}

#[test]
fn the_default_tables_have_the_expected_descriptor_counts() {
    let options = TransferOptions::default();
    let (pool, [contiguous, fragmented]) = block_tables(options.blocks());
    assert_eq!(pool, 256);
    assert_eq!(planner_count(&options, &contiguous), 64);
    assert_eq!(planner_count(&options, &fragmented), 128 * 64);
}

#[cfg(not(feature = "nixl"))]
#[test]
fn without_nixl_the_bench_refuses_clearly() {
    let err = kvhandoff_bench::transfer::transfer(&TransferOptions::tiny())
        .expect_err("no NIXL in this build");
    assert!(err.to_string().contains("`nixl` cargo feature"), "{err}");
}

#[cfg(feature = "nixl")]
mod nixl {
    use super::*;
    use kvhandoff_bench::transfer::transfer;

    #[test]
    fn a_tiny_run_moves_the_blocks_and_reports_positive_numbers() {
        let options = TransferOptions::tiny();
        let report = transfer(&options).unwrap_or_else(|e| panic!("{e}"));
        let (_, [contiguous, fragmented]) = block_tables(options.blocks());

        // Descriptors are the planner's, per table; the headline is the fragmented table.
        assert_eq!(report.tables.len(), 2);
        assert_eq!(report.tables[0].table, "contiguous");
        assert_eq!(
            report.tables[0].descriptors,
            planner_count(&options, &contiguous)
        );
        assert_eq!(
            report.tables[1].descriptors,
            planner_count(&options, &fragmented)
        );
        assert_eq!(report.headline_table, "fragmented");
        assert_eq!(report.descriptors, planner_count(&options, &fragmented));
        assert_eq!(
            report.descriptors,
            4 * 4,
            "4 blocks x 4 regions, nothing merges"
        );
        assert_eq!(report.fragmented_70b.descriptors, 18_880);

        for value in [
            report.memcpy_gbps,
            report.raw_nixl_gbps,
            report.kvhandoff_gbps,
            report.ratio,
            report.notification_rtt_us,
            report.handoff_latency_p50_us,
            report.fragmented_70b.plan_us,
        ] {
            assert!(value.is_finite() && value > 0.0, "{value} in {report:?}");
        }
        for t in &report.tables {
            assert!(t.raw.gbps > 0.0 && t.kvhandoff.gbps > 0.0, "{t:?}");
            assert!(t.kvhandoff.latency_p99_us >= t.kvhandoff.latency_p50_us);
            // The dynamic-lists-only ranks moved the same bytes (checked per repetition).
            assert!(t.kvhandoff_dynamic.gbps > 0.0, "{t:?}");
            assert!(
                t.prepared_gain.is_finite() && t.prepared_gain > 0.0,
                "{t:?}"
            );
        }
        assert_eq!(report.repeats, 2);
        assert_eq!(report.request.request_bytes, 4 * 4 * 2048);

        // The JSON carries the keys the brief requires.
        let json = serde_json::to_value(&report).expect("serializes");
        for key in [
            "memcpy_gbps",
            "raw_nixl_gbps",
            "kvhandoff_gbps",
            "ratio",
            "descriptors",
            "notification_rtt_us",
            "handoff_latency_p50_us",
            "handoff_latency_p99_us",
            "prepared_gain",
            "tables",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert_eq!(json["fragmented_70b"]["descriptors"], 18_880);
        // The one-block handoff: one block in each of the 4 regions, both paths timed.
        for key in [
            "raw_us",
            "kvhandoff_us",
            "ratio",
            "dynamic_us",
            "prepared_gain",
        ] {
            let value = json["latency"][key].as_f64().unwrap_or(f64::NAN);
            assert!(value.is_finite() && value > 0.0, "latency.{key} = {value}");
        }
        assert_eq!(report.latency.blocks, 1);
        assert_eq!(report.latency.descriptors, 4);
        assert_eq!(report.latency.bytes, 4 * 2048);
        assert_eq!(report.latency.repeats, options.latency_repeats);
        assert!(report.arrival_poller);
        assert!(report.idle_cpu.is_none(), "idle_secs 0 skips it");
        assert!(json["fragmented_70b"]["plan_us"].as_f64().is_some());
        assert!(!report.render_table().is_empty());
    }
}
