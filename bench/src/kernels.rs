//! `kvhandoff bench kernels`: the KV block transforms of [`kvhandoff_kernels`] (NHD/HND permute,
//! kernel-block regroup, TP head slicing) against a plain `copy_from_slice` of the same bytes,
//! and their CUDA versions: compiled to PTX by NVRTC, and run against the CPU kernels where a
//! GPU is present (otherwise the report says `ran: false` and why).
//!
//! The measurement lives in the kernels crate ([`kvhandoff_kernels::bench`], where the workload,
//! the rounds and each figure are described) so that the crate's own example
//! (`cargo run --release -p kvhandoff-kernels --example bench_kernels`) runs the same code
//! without the CLI; this module is the CLI's entry. `--json` prints [`KernelBenchReport`] as
//! is: `{"memcpy_gbps", "kernels": [{"name", "gbps", "ratio", ...}], "cuda": {"compiled",
//! "ran", ...}, ...}`; the table is [`KernelBenchReport::render_table`].

pub use kvhandoff_kernels::bench::{
    Case, CudaKernelResult, CudaResult, KernelBenchError, KernelBenchOptions, KernelBenchReport,
    KernelResult, PtxResult, Workload,
};

/// Runs `bench kernels`.
///
/// # Errors
/// [`KernelBenchError::Options`] for unusable options (zero rounds, threads or blocks, a head
/// split that does not divide the heads); [`KernelBenchError::Kernel`] if a kernel refuses its
/// buffers.
pub fn run(options: KernelBenchOptions) -> Result<KernelBenchReport, KernelBenchError> {
    kvhandoff_kernels::bench::run(&options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvhandoff_kernels::BlockShape;

    /// A tiny run prints the JSON shape `--json` promises (no timing is asserted).
    #[test]
    fn a_tiny_run_has_the_json_shape() {
        let options = KernelBenchOptions {
            workload: Workload {
                shape: BlockShape::new(16, 2, 64, 2),
                blocks: 6,
                ratio: 2,
                tp_split: 2,
            },
            rounds: 1,
            threads: 1,
            ..KernelBenchOptions::default()
        };
        let report = run(options).unwrap_or_else(|e| panic!("{e}"));
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["memcpy_gbps"].is_number());
        let kernels = json["kernels"].as_array().unwrap();
        assert_eq!(kernels.len(), Case::all().len());
        for k in kernels {
            assert!(k["name"].is_string() && k["gbps"].is_number() && k["ratio"].is_number());
        }
        assert!(json["cuda"]["compiled"].is_boolean() && json["cuda"]["ran"].is_boolean());
        assert!(!report.render_table().is_empty());
    }

    #[test]
    fn zero_rounds_are_refused() {
        let options = KernelBenchOptions {
            rounds: 0,
            ..KernelBenchOptions::default()
        };
        assert!(matches!(run(options), Err(KernelBenchError::Options(_))));
    }
}
