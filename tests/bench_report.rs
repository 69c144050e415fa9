//! `kvhandoff bench report --quick`: the whole report run through the binary into a temporary
//! folder whose `benchmarks.md` already has hand-written text around the markers.
//!
//! Without the `nixl` feature the transfer benches are skipped (and the report says so); with it
//! they run against the NIXL runtime (`source scripts/nixl-env.sh`), and their plots must exist.
//! With `--all-features` (scripts/test.sh) the kernels run too.

use std::path::Path;
use std::process::Command;

const BEGIN: &str = "<!-- report:begin -->";
const END: &str = "<!-- report:end -->";

fn svg(dir: &Path, name: &str) -> String {
    let path = dir.join("plots").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        text.starts_with("<svg") && text.trim_end().ends_with("</svg>"),
        "{name}"
    );
    text
}

#[test]
fn a_quick_report_writes_the_section_and_the_plots() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let out = dir.path();
    let markdown = out.join("benchmarks.md");
    let hand = "# Benchmarks\n\nHand-written history.\n\n";
    let tail = "\n## Later section\n\nkept as written\n";
    std::fs::write(&markdown, format!("{hand}{BEGIN}\nstale\n{END}\n{tail}")).expect("written");

    let output = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .args(["bench", "report", "--quick", "--json", "--out-dir"])
        .arg(out)
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    // Not a terminal: one plain line per step on stderr.
    assert!(stderr.contains("[1/10] control"), "{stderr}");

    let summary: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(summary["quick"], true);
    let steps = summary["steps"].as_array().expect("steps");
    let ran = |name: &str| {
        steps
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no step {name}: {stdout}"))["ran"]
            == true
    };
    for name in [
        "control",
        "fragmentation",
        "turns",
        "model",
        "plots",
        "markdown",
    ] {
        assert!(ran(name), "{name} did not run: {stdout}");
    }
    assert_eq!(ran("layer-wise"), cfg!(feature = "nixl"), "{stdout}");
    assert_eq!(ran("transfer"), cfg!(feature = "nixl"), "{stdout}");
    assert_eq!(ran("descriptor sweep"), cfg!(feature = "nixl"), "{stdout}");
    assert_eq!(ran("kernels"), cfg!(feature = "cuda"), "{stdout}");

    let text = std::fs::read_to_string(&markdown).expect("the markdown");
    assert!(
        text.starts_with(hand),
        "the text before the markers is kept"
    );
    assert!(text.ends_with(&format!("{END}\n{tail}")), "and after");
    assert!(!text.contains("stale"), "the old section is replaced");
    assert_eq!(text.matches(BEGIN).count(), 1);
    for needle in [
        "### Control path",
        "### Descriptors vs fragmentation",
        "### The deployment model vs the seed's TP 4 table",
        "### Layer-wise vs whole-request push",
        "](plots/descriptors_vs_fragmentation.svg)",
        "](plots/model_ttft_vs_seed.svg)",
    ] {
        assert!(text.contains(needle), "missing {needle:?}:\n{text}");
    }
    assert!(svg(out, "descriptors_vs_fragmentation.svg").contains("both scattered"));
    assert!(svg(out, "model_ttft_vs_seed.svg").contains("seed, push"));
    if cfg!(feature = "nixl") {
        assert!(svg(out, "layerwise_exposed.svg").contains("layer-wise"));
        assert!(text.contains("](plots/layerwise_exposed.svg)"));
        assert!(svg(out, "bandwidth_vs_descriptor_size.svg").contains("kvhandoff"));
        assert!(svg(out, "handoff_latency_cdf.svg").contains("raw NIXL"));
        assert!(text.contains("](plots/handoff_latency_cdf.svg)"));
    } else {
        assert!(text.contains("no `nixl` cargo feature"), "{text}");
        assert!(!out.join("plots/layerwise_exposed.svg").exists());
    }
}
