//! The kernels' bandwidth against a plain copy of the same bytes (`kvhandoff bench kernels`).
//!
//! Every CPU kernel of the crate runs over buffers of [`Workload::blocks`] kernel blocks of one
//! realistic shape (by default one Llama-3.3-70B K or V region at TP 1: 8 KV heads of 128 bf16
//! elements, 16-token kernel blocks, 32 KiB a block; 2,048 blocks, 64 MiB a buffer, twice the
//! 32 MiB L3 of the reference machine, so DRAM is what is measured). Its figure is the bytes it
//! writes over its wall time (GB/s, 10⁹ bytes); its reference is `copy_from_slice` of as many
//! bytes as it writes (from a buffer of its own that no kernel reads, split into `threads`
//! contiguous runs on as many threads as the kernels get): the same output bytes moved by a
//! plain copy. A kernel that
//! writes half a buffer (head slicing) is compared with a copy of half a buffer, not of a whole
//! one. Each round runs, for every kernel in turn, its reference copy and then the kernel, into
//! one pre-faulted output buffer; after one untimed round the report gives the median over
//! `rounds` and the range, and each kernel's `ratio` is the median over the rounds of its
//! bandwidth over that of the copy run just before it (so a slower or faster stretch of the
//! machine moves both sides of a ratio together).
//!
//! The integrity digest ([`crate::digest`]) is measured the same way, over a plain buffer of
//! its own, one digest per kernel block: its figure counts the bytes it reads.
//!
//! With the feature `cuda` the run also compiles every CUDA kernel with NVRTC and, where a CUDA
//! driver and GPU are present, runs each on the same workload, checks its output against the CPU
//! kernel's and reports its bandwidth against a device-to-device copy; where there is none the
//! report says `ran: false` and why.
#![forbid(unsafe_code)]

pub mod workload;

use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use workload::{fill_random, Case, Workload};

use crate::digest::digest_blocks;
use crate::{default_threads, BlockShape, KernelError};

/// What a kernel benchmark runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelBenchOptions {
    /// The shape and buffer size every kernel works on.
    pub workload: Workload,
    /// Timed rounds (default 7); one untimed round runs first.
    pub rounds: usize,
    /// Threads for the copy and for every kernel (default: the machine's parallelism).
    pub threads: usize,
    /// Compile the CUDA kernels and run them where a GPU is present (default true; without the
    /// feature `cuda` the report says they were not built).
    pub cuda: bool,
    /// Seed of the input bytes.
    pub seed: u64,
}

impl KernelBenchOptions {
    /// The default workload: Llama-3.3-70B at TP 1, one K or V region (8 KV heads × 128 × bf16,
    /// 16-token kernel blocks), 2,048 blocks (64 MiB), regrouped by 4 (16 → 64 tokens), heads
    /// split over 2 ranks.
    pub const DEFAULT_WORKLOAD: Workload = Workload {
        shape: BlockShape::new(16, 8, 128, 2),
        blocks: 2048,
        ratio: 4,
        tp_split: 2,
    };
}

impl Default for KernelBenchOptions {
    fn default() -> Self {
        KernelBenchOptions {
            workload: Self::DEFAULT_WORKLOAD,
            rounds: 7,
            threads: default_threads(),
            cuda: true,
            seed: 1,
        }
    }
}

/// Why a benchmark could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelBenchError {
    /// The options are not usable.
    #[error("bad options: {0}")]
    Options(KernelError),
    /// A kernel refused its buffers (a bug of the benchmark).
    #[error("kernel {kernel}: {error}")]
    Kernel {
        /// The kernel.
        kernel: String,
        /// Its error.
        error: KernelError,
    },
}

/// One measured figure: the median and the range over the rounds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gbps {
    /// Median over the rounds, GB/s (10⁹ bytes a second).
    pub median: f64,
    /// Slowest round.
    pub min: f64,
    /// Fastest round.
    pub max: f64,
}

impl Gbps {
    fn of(mut samples: Vec<f64>) -> Gbps {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let median = match n {
            0 => 0.0,
            _ if n % 2 == 1 => samples[n / 2],
            _ => (samples[n / 2 - 1] + samples[n / 2]) / 2.0,
        };
        Gbps {
            median,
            min: samples.first().copied().unwrap_or(0.0),
            max: samples.last().copied().unwrap_or(0.0),
        }
    }
}

/// One CPU kernel's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelResult {
    /// The kernel and direction (`permute_nhd_to_hnd`, ...).
    pub name: String,
    /// Bytes it writes per run (its output buffer).
    pub bytes: usize,
    /// Median bandwidth, GB/s of output bytes.
    pub gbps: f64,
    /// Slowest and fastest round, GB/s.
    pub gbps_range: [f64; 2],
    /// Its reference: `copy_from_slice` of `bytes` bytes, run just before it in every round,
    /// median GB/s.
    pub memcpy_gbps: f64,
    /// Median over the rounds of the kernel's bandwidth over its reference copy's in the same
    /// round.
    pub ratio: f64,
}

/// One CUDA source compiled to PTX.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtxResult {
    /// The source (`kvh_permute`, `kvh_regroup`, `kvh_heads`).
    pub name: String,
    /// Bytes of PTX.
    pub ptx_bytes: usize,
    /// Kernel entries in the PTX.
    pub entries: usize,
}

/// One CUDA kernel run on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CudaKernelResult {
    /// The kernel and direction, as for the CPU kernels.
    pub name: String,
    /// Bandwidth, GB/s of output bytes.
    pub gbps: f64,
    /// `gbps` over the device-to-device copy's.
    pub ratio: f64,
    /// Whether its output equals the CPU kernel's on the same input.
    pub matches_cpu: bool,
}

/// The CUDA side of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CudaResult {
    /// Every CUDA kernel compiled to PTX with NVRTC.
    pub compiled: bool,
    /// The NVRTC version used, `major.minor`.
    pub nvrtc: Option<String>,
    /// Each compiled source.
    pub ptx: Vec<PtxResult>,
    /// The kernels ran on a GPU.
    pub ran: bool,
    /// Why they did not compile or run.
    pub reason: Option<String>,
    /// The GPU, when they ran.
    pub device: Option<String>,
    /// Device-to-device copy bandwidth, GB/s, when they ran.
    pub memcpy_gbps: Option<f64>,
    /// Each kernel, when they ran.
    pub kernels: Vec<CudaKernelResult>,
}

impl CudaResult {
    fn not_compiled(reason: String) -> CudaResult {
        CudaResult {
            compiled: false,
            nvrtc: None,
            ptx: Vec::new(),
            ran: false,
            reason: Some(reason),
            device: None,
            memcpy_gbps: None,
            kernels: Vec::new(),
        }
    }
}

/// What `bench kernels` reports (`--json` prints it as is).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelBenchReport {
    /// The workload.
    pub workload: Workload,
    /// Bytes of one plain buffer (`blocks` blocks of the shape).
    pub buffer_bytes: usize,
    /// Threads of the copy and the kernels.
    pub threads: usize,
    /// Timed rounds.
    pub rounds: usize,
    /// `copy_from_slice` of a plain buffer (`buffer_bytes`), median GB/s over every round of
    /// every kernel that writes that many bytes (the reference of each is in its own result).
    pub memcpy_gbps: f64,
    /// Slowest and fastest of those copies, GB/s.
    pub memcpy_gbps_range: [f64; 2],
    /// Each CPU kernel.
    pub kernels: Vec<KernelResult>,
    /// The integrity digest ([`crate::digest::digest_blocks`]) of a plain buffer, one digest per
    /// kernel block, on `threads` threads: `bytes` and `gbps` count the bytes it *reads* (it
    /// writes 8 bytes a block), against a copy of as many bytes run just before it in each
    /// round.
    pub digest: KernelResult,
    /// The CUDA kernels.
    pub cuda: CudaResult,
}

impl KernelBenchReport {
    /// The report as a table for a terminal.
    pub fn render_table(&self) -> String {
        let w = &self.workload;
        let s = &w.shape;
        let mib = |b: usize| b as f64 / f64::from(1u32 << 20);
        let mut out = format!(
            "bench kernels: {} blocks of {} tokens x {} heads x {} x {} B ({:.0} KiB a block, \
             {:.0} MiB a buffer), regroup by {}, heads split over {}; {} thread(s), median of \
             {} rounds\n",
            w.blocks,
            s.tokens,
            s.heads,
            s.head_dim,
            s.dtype_bytes,
            s.block_bytes().unwrap_or(0) as f64 / 1024.0,
            mib(self.buffer_bytes),
            w.ratio,
            w.tp_split,
            self.threads,
            self.rounds,
        );
        out.push_str(&format!(
            "{:<22} {:>8} {:>8}  {:>13}  {:>11}  {:>9}\n",
            "kernel", "MiB out", "GB/s", "range", "memcpy GB/s", "vs memcpy"
        ));
        out.push_str(&format!(
            "{:<22} {:>8.0} {:>8.2}  {:>13}  {:>11}  {:>9}\n",
            "memcpy",
            mib(self.buffer_bytes),
            self.memcpy_gbps,
            format!(
                "{:.2}-{:.2}",
                self.memcpy_gbps_range[0], self.memcpy_gbps_range[1]
            ),
            "",
            "1.00"
        ));
        for k in self.kernels.iter().chain([&self.digest]) {
            out.push_str(&format!(
                "{:<22} {:>8.0} {:>8.2}  {:>13}  {:>11.2}  {:>9.2}\n",
                k.name,
                mib(k.bytes),
                k.gbps,
                format!("{:.2}-{:.2}", k.gbps_range[0], k.gbps_range[1]),
                k.memcpy_gbps,
                k.ratio
            ));
        }
        let c = &self.cuda;
        let entries: usize = c.ptx.iter().map(|p| p.entries).sum();
        out.push_str(&match (c.compiled, c.ran) {
            (false, _) => format!(
                "CUDA: not compiled ({})\n",
                c.reason.as_deref().unwrap_or("?")
            ),
            (true, false) => format!(
                "CUDA: {} sources ({entries} kernels) compiled to PTX by NVRTC {}; not run ({})\n",
                c.ptx.len(),
                c.nvrtc.as_deref().unwrap_or("?"),
                c.reason.as_deref().unwrap_or("?")
            ),
            (true, true) => {
                let mut t = format!(
                    "CUDA on {}: device memcpy {:.1} GB/s\n",
                    c.device.as_deref().unwrap_or("?"),
                    c.memcpy_gbps.unwrap_or(0.0)
                );
                for k in &c.kernels {
                    t.push_str(&format!(
                        "{:<22} {:>8.1} GB/s  {:>5.2}  {}\n",
                        k.name,
                        k.gbps,
                        k.ratio,
                        if k.matches_cpu {
                            "matches the CPU"
                        } else {
                            "DIFFERS FROM THE CPU"
                        }
                    ));
                }
                t
            }
        });
        out
    }
}

/// Runs the benchmark.
///
/// # Errors
/// [`KernelBenchError::Options`] for unusable options; [`KernelBenchError::Kernel`] if a kernel
/// refuses its buffers.
pub fn run(options: &KernelBenchOptions) -> Result<KernelBenchReport, KernelBenchError> {
    let w = options.workload;
    w.validate().map_err(KernelBenchError::Options)?;
    for (field, value) in [("rounds", options.rounds), ("threads", options.threads)] {
        if value == 0 {
            return Err(KernelBenchError::Options(KernelError::Zero { field }));
        }
    }
    let cases = Case::all();
    let sizes = cases
        .iter()
        .map(|&c| w.sizes(c))
        .collect::<Result<Vec<_>, _>>()
        .map_err(KernelBenchError::Options)?;
    let plain = w.buffer_bytes().map_err(KernelBenchError::Options)?;

    // One random input buffer per distinct (length, position among the case's inputs), shared
    // by the cases that need one; one output buffer, pre-faulted.
    let mut inputs: Vec<Vec<u8>> = Vec::new();
    let mut keys: Vec<(usize, usize)> = Vec::new();
    let mut case_inputs: Vec<Vec<usize>> = Vec::new();
    for (input_lens, _) in &sizes {
        let mut ids = Vec::new();
        for (position, &len) in input_lens.iter().enumerate() {
            let id = match keys.iter().position(|&key| key == (len, position)) {
                Some(id) => id,
                None => {
                    let mut b = vec![0u8; len];
                    fill_random(&mut b, options.seed.wrapping_add(inputs.len() as u64));
                    inputs.push(b);
                    keys.push((len, position));
                    inputs.len() - 1
                }
            };
            ids.push(id);
        }
        case_inputs.push(ids);
    }
    let out_len = sizes.iter().map(|(_, o)| *o).max().unwrap_or(0).max(plain);
    let mut out = vec![1u8; out_len];
    // The reference copies read a buffer of their own: one a kernel also read would leave the
    // kernel's input partly in the cache.
    let mut copy_src = vec![0u8; out_len];
    fill_random(&mut copy_src, options.seed.wrapping_sub(1));

    // Per case and round: (kernel GB/s, its reference copy's GB/s).
    let mut samples: Vec<Vec<(f64, f64)>> = vec![Vec::new(); cases.len()];
    // The digest reads a buffer of its own too, for the same reason.
    let block_bytes = w.shape.block_bytes().map_err(KernelBenchError::Options)?;
    let mut digest_src = vec![0u8; plain];
    fill_random(&mut digest_src, options.seed.wrapping_add(1 << 32));
    let mut digests = vec![0u64; plain / block_bytes.max(1)];
    let mut digest_samples: Vec<(f64, f64)> = Vec::new();
    for round in 0..=options.rounds {
        for (c, &case) in cases.iter().enumerate() {
            let ins: Vec<&[u8]> = case_inputs[c]
                .iter()
                .map(|&i| inputs[i].as_slice())
                .collect();
            let len = sizes[c].1;
            let start = Instant::now();
            copy_threads(&copy_src[..len], &mut out[..len], options.threads);
            let copy = gbps(len, start.elapsed().as_secs_f64());
            let start = Instant::now();
            w.run_cpu(case, &ins, &mut out[..len], options.threads)
                .map_err(|error| KernelBenchError::Kernel {
                    kernel: case.name(),
                    error,
                })?;
            let t = start.elapsed().as_secs_f64();
            if round > 0 {
                samples[c].push((gbps(len, t), copy));
            }
        }
        let start = Instant::now();
        copy_threads(&copy_src[..plain], &mut out[..plain], options.threads);
        let copy = gbps(plain, start.elapsed().as_secs_f64());
        let start = Instant::now();
        digest_blocks(&digest_src, block_bytes, &mut digests, options.threads).map_err(
            |error| KernelBenchError::Kernel {
                kernel: DIGEST_NAME.to_string(),
                error,
            },
        )?;
        let t = start.elapsed().as_secs_f64();
        std::hint::black_box(&digests);
        if round > 0 {
            digest_samples.push((gbps(plain, t), copy));
        }
    }
    let memcpy = Gbps::of(
        samples
            .iter()
            .zip(&sizes)
            .filter(|(_, (_, bytes))| *bytes == plain)
            .flat_map(|(s, _)| s.iter().map(|&(_, copy)| copy))
            .collect(),
    );
    let kernels = cases
        .iter()
        .zip(samples)
        .zip(&sizes)
        .map(|((case, s), (_, bytes))| result(case.name(), *bytes, &s))
        .collect();
    Ok(KernelBenchReport {
        workload: w,
        buffer_bytes: plain,
        threads: options.threads,
        rounds: options.rounds,
        memcpy_gbps: memcpy.median,
        memcpy_gbps_range: [memcpy.min, memcpy.max],
        kernels,
        digest: result(DIGEST_NAME.to_string(), plain, &digest_samples),
        cuda: cuda_part(options),
    })
}

/// The name of the digest's line in the report.
pub const DIGEST_NAME: &str = "digest_xxh3";

/// One kernel's figures from its (kernel GB/s, reference copy GB/s) pairs.
fn result(name: String, bytes: usize, s: &[(f64, f64)]) -> KernelResult {
    let g = Gbps::of(s.iter().map(|&(k, _)| k).collect());
    let reference = Gbps::of(s.iter().map(|&(_, copy)| copy).collect());
    let ratio = Gbps::of(
        s.iter()
            .filter(|&&(_, copy)| copy > 0.0)
            .map(|&(k, copy)| k / copy)
            .collect(),
    );
    KernelResult {
        name,
        bytes,
        gbps: g.median,
        gbps_range: [g.min, g.max],
        memcpy_gbps: reference.median,
        ratio: ratio.median,
    }
}

/// The reference copy: `copy_from_slice` of `threads` contiguous runs, one per thread.
fn copy_threads(src: &[u8], dst: &mut [u8], threads: usize) {
    let threads = if dst.len() < crate::PAR_MIN_BYTES {
        1
    } else {
        threads.max(1)
    };
    let run = dst.len().div_ceil(threads).max(1);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    std::thread::scope(|scope| {
        let mut pairs = dst.chunks_mut(run).zip(src.chunks(run));
        let first = pairs.next();
        for (d, s) in pairs {
            scope.spawn(move || d.copy_from_slice(s));
        }
        if let Some((d, s)) = first {
            d.copy_from_slice(s);
        }
    });
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_part(_options: &KernelBenchOptions) -> CudaResult {
    CudaResult::not_compiled("built without the `cuda` feature of kvhandoff-kernels".to_string())
}

#[cfg(feature = "cuda")]
fn cuda_part(options: &KernelBenchOptions) -> CudaResult {
    use crate::cuda;
    if !options.cuda {
        return CudaResult::not_compiled("not asked for (options.cuda is false)".to_string());
    }
    let compiled = match cuda::compile_all() {
        Ok(compiled) => compiled,
        Err(e) => return CudaResult::not_compiled(e.to_string()),
    };
    let mut result = CudaResult::not_compiled(String::new());
    result.compiled = true;
    result.nvrtc = cuda::nvrtc_version()
        .ok()
        .map(|(major, minor)| format!("{major}.{minor}"));
    result.ptx = compiled
        .iter()
        .map(|k| PtxResult {
            name: k.name.to_string(),
            ptx_bytes: k.ptx.len(),
            entries: k.entries.len(),
        })
        .collect();
    let device_options = cuda::device::DeviceOptions {
        workload: options.workload,
        rounds: options.rounds,
        seed: options.seed,
        threads: options.threads,
    };
    match cuda::device::run(&compiled, &device_options) {
        Ok(report) => {
            result.ran = true;
            result.reason = None;
            result.device = Some(report.device);
            result.memcpy_gbps = Some(report.memcpy_gbps);
            result.kernels = report
                .kernels
                .into_iter()
                .map(|k| CudaKernelResult {
                    name: k.name,
                    gbps: k.gbps,
                    ratio: if report.memcpy_gbps > 0.0 {
                        k.gbps / report.memcpy_gbps
                    } else {
                        0.0
                    },
                    matches_cpu: k.matches_cpu,
                })
                .collect();
        }
        Err(e) => result.reason = Some(e.to_string()),
    }
    result
}

#[cfg(test)]
mod tests;
