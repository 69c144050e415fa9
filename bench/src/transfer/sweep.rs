//! Bandwidth by descriptor size: one request moved by raw NIXL and by kvhandoff with block
//! tables whose runs of adjacent blocks grow from one block to the whole request, so that the
//! planner's descriptors grow from one block to a region's share of the request while the bytes
//! stay the same (`bench report`'s `bandwidth_vs_descriptor_size.svg`).
//!
//! The request: [`SweepOptions::blocks`] blocks of a small geometry (by default 2 layers, one KV
//! head of 128, bf16, 16-token blocks: 4 KiB per block and region, 4 regions). At run length
//! `k`, both sides hold the request in runs of `k` adjacent blocks with one free block between
//! runs ([`run_table`]), so every region's bytes go as `blocks / k` descriptors of `k` blocks.
//! Each point alternates raw and kvhandoff repetitions after one untimed warm-up of each, as
//! [`transfer`](super::transfer) does, on one raw agent pair and one pair of kvhandoff ranks
//! reused for every point; every repetition checks the bytes landed.

use super::*;

/// What the descriptor-size sweep runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepOptions {
    /// Logical blocks of the request (default 4,096: 64 MiB with the default geometry).
    pub blocks: u32,
    /// Layers (default 2).
    pub num_layers: u32,
    /// KV heads (default 1).
    pub kv_heads: u32,
    /// Head dimension (default 128).
    pub head_dim: u32,
    /// Run lengths, blocks: one point each (default 1, 2, 4, … 4,096).
    pub runs: Vec<u32>,
    /// Timed repetitions per point and path (default 10), after one untimed warm-up.
    pub repeats: usize,
    /// Limit of every single wait (default 30 s).
    pub timeout: Duration,
}

impl Default for SweepOptions {
    fn default() -> Self {
        SweepOptions {
            blocks: 4096,
            num_layers: 2,
            kv_heads: 1,
            head_dim: 128,
            runs: (0..=12).map(|p| 1 << p).collect(),
            repeats: 10,
            timeout: Duration::from_secs(30),
        }
    }
}

impl SweepOptions {
    /// A short sweep (`bench report --quick`): 512 blocks (8 MiB), runs of 1, 4, 16, 64 and 512
    /// blocks, 3 repetitions.
    pub fn quick() -> Self {
        SweepOptions {
            blocks: 512,
            runs: vec![1, 4, 16, 64, 512],
            repeats: 3,
            ..SweepOptions::default()
        }
    }

    /// The geometry of the request (TP 1, bf16, 16-token kernel blocks, NHD).
    pub fn geometry(&self) -> KvGeometry {
        KvGeometry::dense(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            2,
            BLOCK_TOKENS,
            KvLayout::Nhd,
        )
    }

    pub(super) fn check(&self) -> Result<(), TransferBenchError> {
        let bad = |why: &str| Err(TransferBenchError::Options(why.into()));
        if self.blocks == 0 || self.blocks > 1 << 20 {
            return bad("the sweep's blocks must be between 1 and 2^20");
        }
        if self.num_layers == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return bad("layers, heads and head_dim must be positive");
        }
        if self.runs.is_empty() || self.runs.iter().any(|&r| r == 0 || r > self.blocks) {
            return bad("run lengths must be between 1 and the request's blocks");
        }
        if self.repeats == 0 {
            return bad("repetition counts must be positive");
        }
        if self.timeout.is_zero() {
            return bad("the timeout must be positive");
        }
        let regions = 2 * u64::from(self.num_layers);
        let most = regions
            * u64::from(
                self.blocks
                    .div_ceil(self.runs.iter().copied().min().unwrap_or(1)),
            );
        if most > crate::turns::MAX_DESCRIPTORS_PER_POST {
            return bad("the shortest run makes more descriptors than one post may carry (65,536)");
        }
        Ok(())
    }
}

/// One point of the sweep: a run length and what both paths made of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Adjacent blocks per run on both sides.
    pub run_blocks: u32,
    /// Descriptors the planner makes (both paths post them).
    pub descriptors: usize,
    /// Bytes per descriptor (the request's bytes over its descriptors).
    pub descriptor_bytes: u64,
    /// Raw NIXL: request bytes over the time to the target's notification, GB/s (median).
    pub raw_gbps: f64,
    /// kvhandoff: request bytes over the handoff latency, GB/s (median).
    pub kvhandoff_gbps: f64,
    /// `kvhandoff_gbps / raw_gbps`.
    pub ratio: f64,
    /// Raw NIXL, first list entry to the notification, µs (median).
    pub raw_p50_us: f64,
    /// kvhandoff, start of D's call to D's `BlocksReady`, µs (median).
    pub kvhandoff_p50_us: f64,
}

/// What the sweep measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    /// Bytes moved per request.
    pub request_bytes: u64,
    /// Bytes of one block in one region.
    pub block_bytes: u64,
    /// Regions per rank (K and V per layer).
    pub regions: usize,
    /// Timed repetitions per point and path.
    pub repeats: usize,
    /// One point per run length, in the order given.
    pub points: Vec<SweepPoint>,
}

/// The block table of `blocks` blocks in runs of `run` adjacent blocks with one free block
/// between runs, the same ids on both sides (each side has its own pool); the pool it fits in is
/// [`sweep_pool`]`(blocks)`.
///
/// ```
/// use kvhandoff_bench::transfer::run_table;
/// let table = run_table(6, 2);
/// assert_eq!(table.local.groups[0], [0, 1, 3, 4, 6, 7]);
/// assert_eq!(table.remote, table.local);
/// assert_eq!(run_table(3, 3).local.groups[0], [0, 1, 2]);
/// ```
pub fn run_table(blocks: u32, run: u32) -> BlockTable {
    let run = run.max(1);
    let ids: Vec<u32> = (0..blocks).map(|i| i / run * (run + 1) + i % run).collect();
    BlockTable {
        name: "runs",
        local: BlockIds::single_group(ids.clone()),
        remote: BlockIds::single_group(ids),
    }
}

/// Blocks in each side's pool for a sweep of `blocks` blocks: room for every [`run_table`].
pub fn sweep_pool(blocks: u32) -> u32 {
    2 * blocks
}

/// Runs the descriptor-size sweep.
///
/// # Errors
/// [`TransferBenchError::NixlFeatureMissing`] without the `nixl` feature; otherwise bad options,
/// a NIXL failure (the runtime missing included), or a run that goes wrong.
pub fn descriptor_sweep(options: &SweepOptions) -> Result<SweepReport, TransferBenchError> {
    options.check()?;
    #[cfg(feature = "nixl")]
    {
        super::live::sweep(options)
    }
    #[cfg(not(feature = "nixl"))]
    {
        Err(TransferBenchError::NixlFeatureMissing)
    }
}
