use super::fragmentation::table;
use super::machine::{nixl_description, utc_date};
use super::plots::{linear_ticks, ticks_one_two_five as one_two_five};
use super::*;
use crate::model::Mode;
use crate::transfer::{LatencySamples, SweepPoint};

// ---------------------------------------------------------------------------------------------
// Markers.

const SECTION: &str = "### Generated\n\n| a | b |\n|---|---|\n| 1 | 2 |\n";

#[test]
fn without_markers_the_section_is_appended_after_a_blank_line() {
    let doc = "# Benchmarks\n\nHand-written history.\n";
    let out = splice_section(doc, SECTION).unwrap();
    assert_eq!(
        out,
        format!("{doc}\n{REPORT_BEGIN}\n{SECTION}{REPORT_END}\n"),
        "the hand-written text is kept byte for byte"
    );
    // No final newline, and an empty document.
    let out = splice_section("text", "x").unwrap();
    assert_eq!(out, format!("text\n\n{REPORT_BEGIN}\nx\n{REPORT_END}\n"));
    let out = splice_section("", "x\n").unwrap();
    assert_eq!(out, format!("{REPORT_BEGIN}\nx\n{REPORT_END}\n"));
    // The appended result splices again in place: a second run replaces, not appends.
    let again = splice_section(&out, "y\n").unwrap();
    assert_eq!(again, format!("{REPORT_BEGIN}\ny\n{REPORT_END}\n"));
}

#[test]
fn one_pair_of_markers_is_replaced_and_the_rest_kept() {
    let before = "# Title\n\nbefore `<!-- report:begin -->` quoted in prose\n\n";
    let after = "\n## After\n\nmore history\n";
    let doc = format!("{before}{REPORT_BEGIN}\nold 1\nold 2\n  {REPORT_END}  \n{after}");
    let out = splice_section(&doc, SECTION).unwrap();
    assert_eq!(
        out,
        format!("{before}{REPORT_BEGIN}\n{SECTION}  {REPORT_END}  \n{after}")
    );
    // Adjacent markers (an empty section) take one too.
    let doc = format!("a\n{REPORT_BEGIN}\n{REPORT_END}\nb\n");
    assert_eq!(
        splice_section(&doc, "new").unwrap(),
        format!("a\n{REPORT_BEGIN}\nnew\n{REPORT_END}\nb\n")
    );
    // A begin marker on the last line without a newline still pairs with nothing after it.
    assert!(matches!(
        splice_section(&format!("a\n{REPORT_BEGIN}"), "x"),
        Err(MarkerError::Unpaired { .. })
    ));
}

#[test]
fn malformed_markers_are_typed_errors() {
    let b = REPORT_BEGIN;
    let e = REPORT_END;
    assert_eq!(
        splice_section(&format!("x\n{b}\ny\n"), SECTION),
        Err(MarkerError::Unpaired {
            found: REPORT_BEGIN,
            missing: REPORT_END,
            line: 2
        })
    );
    assert_eq!(
        splice_section(&format!("{e}\n"), SECTION),
        Err(MarkerError::Unpaired {
            found: REPORT_END,
            missing: REPORT_BEGIN,
            line: 1
        })
    );
    assert_eq!(
        splice_section(&format!("{e}\nmiddle\n{b}\n"), SECTION),
        Err(MarkerError::Misordered { begin: 3, end: 1 })
    );
    assert_eq!(
        splice_section(&format!("{b}\n{e}\n{b}\n{e}\n"), SECTION),
        Err(MarkerError::Duplicate {
            marker: REPORT_BEGIN,
            first: 1,
            second: 3
        })
    );
    assert_eq!(
        splice_section(&format!("{b}\n{e}\n{e}\n"), SECTION),
        Err(MarkerError::Duplicate {
            marker: REPORT_END,
            first: 2,
            second: 3
        })
    );
    assert_eq!(
        splice_section("doc\n", &format!("a\n{e}\n")),
        Err(MarkerError::MarkerInSection)
    );
    // The messages name the lines.
    let err = splice_section(&format!("{e}\n{b}\n"), "").unwrap_err();
    assert!(err.to_string().contains("line 1"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Fragmentation.

#[test]
fn a_table_skips_one_id_at_each_broken_boundary() {
    assert_eq!(table(5, &[]).groups[0], [0, 1, 2, 3, 4]);
    assert_eq!(table(5, &[2, 4]).groups[0], [0, 1, 3, 4, 6]);
    assert_eq!(table(3, &[1, 2]).groups[0], [0, 2, 4]);
}

#[test]
fn more_fragmentation_never_makes_fewer_descriptors() {
    let sweep = fragmentation_sweep(&default_geometry(), 128, 20).unwrap();
    assert_eq!(sweep.regions, 64);
    assert_eq!((sweep.minimum, sweep.maximum), (64, 64 * 128));
    assert_eq!(sweep.points.len(), 21);
    let first = &sweep.points[0];
    let last = &sweep.points[20];
    assert_eq!((first.p_scattered, first.both_scattered), (64, 64));
    assert_eq!((last.p_scattered, last.both_scattered), (8192, 8192));
    for pair in sweep.points.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(b.fraction > a.fraction && b.breaks >= a.breaks);
        assert!(b.p_scattered >= a.p_scattered, "{a:?} -> {b:?}");
        assert!(b.both_scattered >= a.both_scattered, "{a:?} -> {b:?}");
    }
    for p in &sweep.points {
        // One side's breaks alone: one descriptor per run per region.
        assert_eq!(p.p_scattered, 64 * (p.breaks as usize + 1), "{p:?}");
        assert!(p.both_scattered >= p.p_scattered, "{p:?}");
    }
    // Small requests and other geometries too.
    for (blocks, steps) in [(1, 1), (2, 3), (7, 10)] {
        let s = fragmentation_sweep(&default_geometry(), blocks, steps).unwrap();
        assert!(s
            .points
            .windows(2)
            .all(|w| w[1].both_scattered >= w[0].both_scattered));
    }
    assert!(fragmentation_sweep(&default_geometry(), 0, 5).is_err());
    assert!(fragmentation_sweep(&default_geometry(), 8, 0).is_err());
}

// ---------------------------------------------------------------------------------------------
// Plots.

/// A document whose tags nest: every opened element closes, in order.
fn assert_well_formed(svg: &str) {
    assert!(
        svg.trim_start().starts_with("<svg"),
        "{}",
        &svg[..80.min(svg.len())]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    let mut stack: Vec<&str> = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        let close = rest[open..].find('>').expect("an unclosed tag") + open;
        let tag = &rest[open + 1..close];
        assert!(!tag.contains('<'), "a '<' inside a tag: {tag}");
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop(), Some(name.trim()), "mismatched </{name}>");
        } else if !tag.ends_with('/') && !tag.starts_with('?') && !tag.starts_with('!') {
            stack.push(tag.split_whitespace().next().unwrap_or(""));
        }
        rest = &rest[close + 1..];
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
}

fn check_plot(dir: &std::path::Path, file: &str, svg: &str, names: &[&str]) {
    let path = write_svg(dir, file, svg).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_well_formed(&text);
    for name in names {
        assert!(text.contains(name), "{file} lacks {name}");
    }
}

fn sweep_points() -> Vec<SweepPoint> {
    [1u32, 4, 16, 64]
        .iter()
        .map(|&run| SweepPoint {
            run_blocks: run,
            descriptors: 1024 / run as usize,
            descriptor_bytes: 4096 * u64::from(run),
            raw_gbps: 1.0 + f64::from(run).log2(),
            kvhandoff_gbps: 0.9 + f64::from(run).log2(),
            ratio: 0.9,
            raw_p50_us: 100.0,
            kvhandoff_p50_us: 110.0,
        })
        .collect()
}

fn small_model() -> Vec<crate::model::FitPair> {
    let base = ModelOptions {
        requests: 20,
        runs: 1,
        ..ModelOptions::seed(Mode::Push, 4, 512, 128, 4.0)
    };
    crate::model::tp4_pairs(&base).unwrap()
}

#[test]
fn every_plot_is_a_well_formed_svg_with_its_series() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    check_plot(
        d,
        BANDWIDTH_PLOT,
        &bandwidth_svg(&sweep_points(), "test").unwrap(),
        &[
            "raw NIXL",
            "kvhandoff",
            "4 KiB",
            "256 KiB",
            "bytes per descriptor",
        ],
    );
    let samples = LatencySamples {
        raw_us: (1..=40).map(|i| 500.0 + f64::from(i) * 10.0).collect(),
        kvhandoff_us: (1..=40).map(|i| 700.0 + f64::from(i) * 25.0).collect(),
    };
    check_plot(
        d,
        LATENCY_CDF_PLOT,
        &latency_cdf_svg(&samples, "test").unwrap(),
        &[
            "raw NIXL WRITE + notification",
            "kvhandoff handoff",
            "1.0 ms",
        ],
    );
    let sweep = fragmentation_sweep(&default_geometry(), 32, 8).unwrap();
    check_plot(
        d,
        FRAGMENTATION_PLOT,
        &fragmentation_svg(&sweep).unwrap(),
        &["P scattered, D contiguous", "both scattered", "40%"],
    );
    check_plot(
        d,
        MODEL_PLOT,
        &model_svg(&small_model()).unwrap(),
        &[
            "seed, pull",
            "model, pull",
            "seed, push",
            "model, push",
            "512/64/4",
            "2048/128/4",
        ],
    );
    let rows: Vec<LayerwisePoint> = [256u32, 1024, 4096]
        .iter()
        .map(|&tokens| LayerwisePoint {
            tokens,
            exposed_ms_whole: f64::from(tokens) / 100.0,
            exposed_ms_layerwise: f64::from(tokens) / 800.0,
        })
        .collect();
    check_plot(
        d,
        LAYERWISE_PLOT,
        &layerwise_svg(&rows, "test").unwrap(),
        &["whole request", "layer-wise", "prompt tokens"],
    );
    // Text is escaped: a name with markup stays inside its element.
    let svg = bandwidth_svg(&sweep_points(), "a <b> & c").unwrap();
    assert_well_formed(&svg);
    assert!(svg.contains("a &lt;b&gt; &amp; c"));
}

#[test]
fn empty_inputs_are_refused_not_drawn() {
    assert!(matches!(
        bandwidth_svg(&[], "x"),
        Err(PlotError::NoData { .. })
    ));
    assert!(matches!(
        latency_cdf_svg(&LatencySamples::default(), "x"),
        Err(PlotError::NoData { .. })
    ));
    assert!(matches!(model_svg(&[]), Err(PlotError::NoData { .. })));
    assert!(matches!(
        layerwise_svg(&[], "x"),
        Err(PlotError::NoData { .. })
    ));
    let err = write_svg(std::path::Path::new("/nonexistent/dir"), "x.svg", "<svg/>").unwrap_err();
    assert!(matches!(err, PlotError::Write { .. }), "{err}");
}

#[test]
fn ticks_are_round_values() {
    assert_eq!(
        one_two_five(1.0, 100.0),
        [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
    );
    assert_eq!(one_two_five(300.0, 900.0), [500.0]);
    assert!(one_two_five(0.0, 10.0).is_empty());
    assert_eq!(
        linear_ticks(0.0, 1.0),
        [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
    );
    let t = linear_ticks(0.0, 9000.0);
    assert_eq!(t.first(), Some(&0.0));
    assert!(t.len() >= 4 && t.len() <= 10, "{t:?}");
}

// ---------------------------------------------------------------------------------------------
// The markdown section.

fn data(plots: &[&str], layerwise: Outcome<Vec<LayerwisePoint>>) -> ReportData {
    let plan = ReportPlan::quick();
    ReportData {
        machine: MachineInfo {
            cores: 2,
            cpu: Some("Test CPU".into()),
            memory_gib: Some(23.4),
            kernel: Some("6.18".into()),
            nixl: "nixl-cu12 1.5.1".into(),
            build: "release".into(),
            features: vec!["nixl".into()],
            commit: Some("abc1234".into()),
            date_utc: "2026-11-27 12:00 UTC".into(),
        },
        command: "kvhandoff bench report --quick --out-dir docs".into(),
        quick: true,
        steps: vec![StepSummary {
            name: "control".into(),
            ran: false,
            seconds: 0.5,
            note: "a | pipe".into(),
        }],
        control: Outcome::Skipped("not in this test".into()),
        transfer: Outcome::Skipped("no NIXL here".into()),
        sweep: Outcome::Skipped("no NIXL here".into()),
        fragmentation: fragmentation_sweep(&default_geometry(), 16, 4).unwrap(),
        turns: Outcome::Skipped("not in this test".into()),
        model: small_model(),
        layerwise,
        kernels: Outcome::Skipped("no `cuda` feature".into()),
        plots: plots.iter().map(|p| p.to_string()).collect(),
        plan,
    }
}

#[test]
fn the_section_names_the_run_every_bench_and_its_plots() {
    let text = render_section(&data(
        &[FRAGMENTATION_PLOT, MODEL_PLOT],
        Outcome::Skipped("this build has no `nixl` cargo feature".into()),
    ));
    for needle in [
        "**Command:** `kvhandoff bench report --quick --out-dir docs`",
        "quick:",
        "2 cores, Test CPU, 23 GiB, Linux 6.18",
        "commit `abc1234`",
        "2026-11-27 12:00 UTC",
        "a \\| pipe",
        "### Control path (`bench control`)",
        "kvhandoff bench control --requests 20000",
        "Skipped: not in this test.",
        "kvhandoff bench transfer --tokens 256",
        "Skipped: no NIXL here.",
        "(No `plots/handoff_latency_cdf.svg` in this run.)",
        "(No `plots/bandwidth_vs_descriptor_size.svg` in this run.)",
        "![descriptors vs fragmentation](plots/descriptors_vs_fragmentation.svg)",
        "| 0 | 0% | 64 | 64 |",
        "kvhandoff bench turns --prefixes 16,256,1000",
        "| 512/64/4 | Pull | 110.94 |",
        "![model vs seed mean TTFT](plots/model_ttft_vs_seed.svg)",
        "Not run: this build has no `nixl` cargo feature",
        "kvhandoff bench kernels",
        "Skipped: no `cuda` feature.",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(!text.contains("](plots/layerwise_exposed.svg)"));
    // It splices (no marker lines of its own).
    assert!(splice_section("# doc\n", &text).is_ok());
}

#[test]
fn layerwise_rows_become_a_table_and_a_plot_link() {
    let rows = vec![LayerwisePoint {
        tokens: 2048,
        exposed_ms_whole: 10.0,
        exposed_ms_layerwise: 2.5,
    }];
    let text = render_section(&data(&[LAYERWISE_PLOT], Outcome::Ran(rows)));
    assert!(text.contains("| 2048 | 10.000 | 2.500 | 75% |"), "{text}");
    assert!(text.contains("](plots/layerwise_exposed.svg)"));
}

// ---------------------------------------------------------------------------------------------
// The machine.

#[test]
fn dates_and_nixl_versions_read_as_written() {
    use std::time::{Duration, UNIX_EPOCH};
    assert_eq!(utc_date(UNIX_EPOCH), "1970-01-01 00:00 UTC");
    assert_eq!(
        utc_date(UNIX_EPOCH + Duration::from_secs(1_764_000_000)),
        "2025-11-24 16:00 UTC"
    );
    assert_eq!(
        utc_date(UNIX_EPOCH + Duration::from_secs(951_782_400)),
        "2000-02-29 00:00 UTC"
    );
    if cfg!(feature = "nixl") {
        assert!(nixl_description(Some("/root/.cache/kvhandoff/nixl-cu12-1.5.1")).contains("1.5.1"));
        assert!(nixl_description(Some("/opt/nixl/")).contains("unknown"));
        assert!(nixl_description(None).contains("unknown"));
    } else {
        assert!(nixl_description(Some("/x/nixl-cu12-1.5.1")).contains("not in this build"));
    }
}

// ---------------------------------------------------------------------------------------------
// The runner.

/// A bad output folder or malformed markers stop the run before any bench.
#[test]
fn unusable_output_fails_before_the_benches() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join(MARKDOWN_FILE),
        format!("{REPORT_END}\n{REPORT_BEGIN}\n"),
    )
    .unwrap();
    let options = ReportOptions {
        out_dir: dir.path().to_path_buf(),
        quick: true,
        command: "test".into(),
    };
    let start = std::time::Instant::now();
    let err = run_report(&options, &mut Silent).unwrap_err();
    assert!(matches!(err, ReportError::Markers { .. }), "{err}");
    assert!(start.elapsed().as_secs() < 5, "no bench ran");
    // A file where the folder should be.
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let options = ReportOptions {
        out_dir: file,
        ..options
    };
    assert!(matches!(
        run_report(&options, &mut Silent),
        Err(ReportError::Io { .. })
    ));
}
