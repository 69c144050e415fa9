use super::*;

fn tiny() -> KernelBenchOptions {
    KernelBenchOptions {
        workload: Workload {
            shape: BlockShape::new(16, 4, 64, 2),
            blocks: 10,
            ratio: 4,
            tp_split: 2,
        },
        rounds: 2,
        threads: 2,
        cuda: true,
        seed: 3,
    }
}

/// A tiny run produces the JSON the CLI prints: `memcpy_gbps`, `kernels[{name, gbps, ratio}]`
/// and `cuda{compiled, ran}` (no timing is asserted).
#[test]
fn a_tiny_run_has_the_report_shape() {
    let report = run(&tiny()).unwrap();
    let json = serde_json::to_value(&report).unwrap();
    assert!(json["memcpy_gbps"].is_number());
    let kernels = json["kernels"].as_array().unwrap();
    let names: Vec<&str> = kernels
        .iter()
        .map(|k| k["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "permute_nhd_to_hnd",
            "permute_hnd_to_nhd",
            "regroup_gather_hnd",
            "regroup_split_hnd",
            "slice_heads_hnd",
            "gather_heads_hnd",
            "regroup_gather_nhd",
            "regroup_split_nhd",
            "slice_heads_nhd",
            "gather_heads_nhd",
        ]
    );
    for k in kernels {
        assert!(
            k["gbps"].is_number() && k["ratio"].is_number() && k["memcpy_gbps"].is_number(),
            "{k}"
        );
    }
    // Each kernel's reference copy moves as many bytes as it writes: head slicing writes half a
    // buffer, and is compared with a copy of half a buffer.
    let slices: Vec<&KernelResult> = report
        .kernels
        .iter()
        .filter(|k| k.name.starts_with("slice_heads"))
        .collect();
    assert_eq!(slices.len(), 2);
    for k in slices {
        assert_eq!(k.bytes, report.buffer_bytes / 2, "{}", k.name);
    }
    assert!(json["cuda"]["compiled"].is_boolean());
    assert!(json["cuda"]["ran"].is_boolean());
    // No GPU is lent to this crate's CI: when the kernels did not run, the report says why.
    if !report.cuda.ran {
        assert!(report.cuda.reason.is_some());
    }
    if cfg!(not(feature = "cuda")) {
        assert!(!report.cuda.compiled);
    }
    // The digest reads one plain buffer, next to a copy of as many bytes in the same rounds.
    assert_eq!(report.digest.name, super::DIGEST_NAME);
    assert_eq!(report.digest.bytes, report.buffer_bytes);
    assert!(json["digest"]["gbps"].is_number() && json["digest"]["ratio"].is_number());
    let table = report.render_table();
    assert!(
        table.contains("permute_nhd_to_hnd")
            && table.contains("CUDA")
            && table.contains("digest_xxh3"),
        "{table}"
    );
    let back: KernelBenchReport = serde_json::from_value(json).unwrap();
    assert_eq!(back.kernels.len(), report.kernels.len());
}

#[test]
fn unusable_options_are_refused() {
    let mut o = tiny();
    o.rounds = 0;
    assert_eq!(
        run(&o),
        Err(KernelBenchError::Options(KernelError::Zero {
            field: "rounds"
        }))
    );
    let mut o = tiny();
    o.workload.tp_split = 3;
    assert!(matches!(
        run(&o),
        Err(KernelBenchError::Options(KernelError::Mismatch { .. }))
    ));
    let mut o = tiny();
    o.workload.blocks = 0;
    assert_eq!(
        run(&o),
        Err(KernelBenchError::Options(KernelError::Zero {
            field: "blocks"
        }))
    );
}

#[test]
fn the_sizes_follow_the_workload() {
    let w = KernelBenchOptions::DEFAULT_WORKLOAD;
    w.validate().unwrap();
    assert_eq!(w.buffer_bytes().unwrap(), 64 << 20);
    let (inputs, out) = w
        .sizes(Case::GatherHeads {
            layout: crate::Layout::Hnd,
        })
        .unwrap();
    assert_eq!(inputs, vec![32 << 20; 2]);
    assert_eq!(out, 64 << 20);
    let (inputs, out) = w
        .sizes(Case::RegroupGather {
            layout: crate::Layout::Hnd,
        })
        .unwrap();
    assert_eq!((inputs[0], out), (64 << 20, 64 << 20));
}
