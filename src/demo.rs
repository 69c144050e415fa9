//! `kvhandoff demo`: a prefill engine (P) and a decode engine (D) in one process, handing real KV
//! bytes over the in-memory transport, with both races (D registers first, P finishes first).
//!
//! What runs:
//! - one [`Runtime`] hosting two ranks built with [`build_mem_rank`] on one [`MemFabric`]
//!   (`prefill-0` and `decode-0`, TP 1), each driven through its own [`KvConnector`];
//! - a small real model's geometry: 8 layers, 8 KV heads, head dim 128, bf16, 16-token blocks,
//!   HND, one full-attention group (512 KiB per logical block over the 16 K/V regions);
//! - two engine loops on two std threads, each with a free-list block allocator. P "prefills"
//!   each prompt by writing a deterministic pattern into its blocks ([`fill_kernel_block`]), then
//!   calls `request_finished`; D allocates and calls `request_allocated`; on `BlocksReady` D
//!   checks every byte of every block against [`expected_byte`].
//!
//! The races: when P's prefill of a request is done (its blocks are filled) at time `f`, P calls
//! `request_finished` at `f + a` and D calls `request_allocated` at `f + b`, with `a` and `b`
//! drawn independently from the seeded schedule (uniform in `[0, max_call_skew]`). So about half
//! the requests see D register first and half see P finish first, whatever the machine's speed.
//! The counts reported are the ones P's endpoint itself saw (its `Counters`).
//!
//! Deadlines: the ranks run [`Config::default`] (production deadlines). A healthy run never
//! reaches any of them; the demo's own overall limit ([`DemoOptions::timeout`], 60 s) bounds
//! every wait, and a run that hits it reports FAILED with the requests that never finished.
//! `Config::fast()` was not used: its 150 ms peer timeout can declare a live peer dead when the
//! runtime thread is starved by the two busy engine threads on a small machine.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::future::Future;
use std::sync::mpsc;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::machine::{Config, Counters, ReleaseCause};
use kvhandoff_actors::system::{
    build_mem_rank, BuildError, KvPool, QueryCounters, RankActor, RuntimeError, ShellConfig,
};
use kvhandoff_actors::transport::mem::{MemFabric, MemLimits};
use kvhandoff_protocol::{
    BlockIds, CacheGroup, CacheGroupKind, EngineId, KvGeometry, KvLayout, ModelIdentity,
    PairingKey, RegionKind, RequestId,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::{ConnectorEvent, ConnectorIdentity, KvConnector, KvTransferParams, Runtime};

/// P's engine id in the demo.
pub const PREFILL_ENGINE: &str = "prefill-0";
/// D's engine id in the demo.
pub const DECODE_ENGINE: &str = "decode-0";

/// How long an engine loop sleeps between event polls when it has nothing to do.
const IDLE_POLL: Duration = Duration::from_micros(100);

/// What the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoOptions {
    /// Requests to hand off (default 64).
    pub requests: usize,
    /// Seed of the schedule: prompt lengths, arrivals, call offsets and request ids (default 1).
    pub seed: u64,
    /// Shortest prompt, in tokens (default 16).
    pub min_prompt_tokens: u32,
    /// Longest prompt, in tokens (default 2048).
    pub max_prompt_tokens: u32,
    /// Logical blocks in each side's pool (default 1024: 512 MiB per side).
    pub pool_blocks: u32,
    /// Mean gap between prompt arrivals at P (exponential; default 2 ms).
    pub mean_arrival_gap: Duration,
    /// Upper bound of P's and D's call offsets after a prefill is done (default 10 ms: with
    /// less, a registration that waits behind a large copy on the shared runtime thread reaches
    /// P after P finished, and P counts most races as P-first).
    pub max_call_skew: Duration,
    /// How often each rank's writer polls the transport (default: [`ShellConfig`]'s, 200 µs).
    pub poll_interval: Duration,
    /// The whole run's limit; a run that reaches it reports FAILED (default 60 s).
    pub timeout: Duration,
    /// TEST ONLY: P writes a wrong pattern into one request's blocks, which D must catch.
    #[doc(hidden)]
    pub corrupt_one_request: bool,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            requests: 64,
            seed: 1,
            min_prompt_tokens: 16,
            max_prompt_tokens: 2048,
            pool_blocks: 1024,
            mean_arrival_gap: Duration::from_millis(2),
            max_call_skew: Duration::from_millis(10),
            poll_interval: ShellConfig::default().poll_interval,
            timeout: Duration::from_secs(60),
            corrupt_one_request: false,
        }
    }
}

/// Why the demo could not run at all (a run that ran and went wrong is a FAILED report).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The options contradict each other.
    #[error("invalid demo options: {0}")]
    Options(String),
    /// A rank could not be built.
    #[error("could not build a rank: {0}")]
    Build(#[from] BuildError),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// An engine thread could not start or panicked.
    #[error("engine thread: {0}")]
    Thread(String),
}

/// Race counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Races {
    /// D's registration reached P before P finished.
    pub decode_registers_first: u64,
    /// P finished before D's registration reached it.
    pub prefill_finishes_first: u64,
}

/// D's outcomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcomes {
    /// `BlocksReady`.
    pub ready: u64,
    /// `Failed`.
    pub failed: u64,
    /// No event before the run's deadline.
    pub missing: u64,
}

/// P's outcomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillOutcomes {
    /// `BlocksFree` after the write completed.
    pub sent: u64,
    /// `BlocksFree` without a completed write.
    pub released: u64,
    /// No event before the run's deadline.
    pub missing: u64,
}

/// Handoff latency percentiles, from the moment both sides had called to D's `BlocksReady`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Median, µs.
    pub p50: f64,
    /// 99th percentile, µs.
    pub p99: f64,
    /// Largest, µs.
    pub max: f64,
}

/// Engine events seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventCounts {
    /// Events on P.
    pub prefill: u64,
    /// Events on D.
    pub decode: u64,
    /// Events beyond the first for a request (either side).
    pub duplicates: u64,
    /// Events naming a request the engine does not know, or handing back other blocks.
    pub unknown: u64,
}

/// Blocks not back on a free list at the end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leaks {
    /// On P.
    pub prefill: u64,
    /// On D.
    pub decode: u64,
}

/// The model geometry the demo ran with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeometrySummary {
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// `"HND"` or `"NHD"`.
    pub layout: String,
    /// Bytes of one logical block over every region.
    pub block_bytes: u64,
}

/// What a demo run did, and whether every byte arrived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DemoReport {
    /// `"mem"`.
    pub transport: String,
    /// The schedule's seed.
    pub seed: u64,
    /// Requests handed off.
    pub requests: u64,
    /// Requests whose every byte D checked and found right.
    pub verified: u64,
    /// Bytes that D found wrong, over all requests.
    pub byte_errors: u64,
    /// Races as P's endpoint counted them.
    pub races: Races,
    /// Races as the engines' call times ordered them (P's `request_finished` vs D's
    /// `request_allocated`); may differ from `races` by the registration's flight time.
    pub call_order: Races,
    /// D's outcomes.
    pub outcomes: Outcomes,
    /// P's outcomes.
    pub prefill_outcomes: PrefillOutcomes,
    /// Bytes the transport moved (P's agent's landed bytes).
    pub bytes: u64,
    /// Bytes the requests' blocks hold (what should have moved).
    pub expected_bytes: u64,
    /// Prompt tokens over all requests.
    pub tokens: u64,
    /// Blocks per side over all requests.
    pub blocks: u64,
    /// `bytes` over the handoff window, in GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// From the first handoff's start (both sides had called) to the last `BlocksReady`, ms.
    pub handoff_window_ms: f64,
    /// Handoff latency percentiles.
    pub handoff_latency_us: Latency,
    /// The whole run, setup and teardown included, ms.
    pub wall_ms: f64,
    /// Engine events seen.
    pub events: EventCounts,
    /// Blocks freed while already free.
    pub double_frees: u64,
    /// Blocks not back on a free list at the end.
    pub leaked_blocks: Leaks,
    /// Logical blocks per side's pool.
    pub pool_blocks: u32,
    /// The model geometry.
    pub geometry: GeometrySummary,
    /// Whether the run hit its overall limit.
    pub timed_out: bool,
    /// Everything that went wrong, in words (at most 32 kept).
    pub errors: Vec<String>,
    /// [`DemoReport::verdict_ok`] at the end of the run.
    pub ok: bool,
    /// The verdict line.
    pub verdict: String,
}

impl DemoReport {
    /// True only if every request ended `Ready` and verified with no byte error, no block was
    /// freed twice, every block came back on both sides, and both engines saw exactly one event
    /// per request.
    pub fn verdict_ok(&self) -> bool {
        let n = self.requests;
        n > 0
            && !self.timed_out
            && self.errors.is_empty()
            && self.outcomes.ready == n
            && self.verified == n
            && self.byte_errors == 0
            && self.prefill_outcomes.sent == n
            && self.double_frees == 0
            && self.leaked_blocks == Leaks::default()
            && self.events.prefill == n
            && self.events.decode == n
            && self.events.duplicates == 0
            && self.events.unknown == 0
    }

    fn verdict_line(&self) -> String {
        if self.verdict_ok() {
            return format!(
                "verdict: OK — {}/{} requests verified, 0 byte errors",
                self.verified, self.requests
            );
        }
        let mut why = vec![format!(
            "{}/{} requests verified, {} byte errors",
            self.verified, self.requests, self.byte_errors
        )];
        if self.timed_out {
            why.push("timed out".into());
        }
        if self.outcomes.failed > 0 || self.outcomes.missing > 0 {
            why.push(format!(
                "D: {} failed, {} without an event",
                self.outcomes.failed, self.outcomes.missing
            ));
        }
        if self.prefill_outcomes.released > 0 || self.prefill_outcomes.missing > 0 {
            why.push(format!(
                "P: {} released unsent, {} without an event",
                self.prefill_outcomes.released, self.prefill_outcomes.missing
            ));
        }
        if self.double_frees > 0 {
            why.push(format!("{} double frees", self.double_frees));
        }
        if self.leaked_blocks != Leaks::default() {
            why.push(format!(
                "leaked blocks P {} / D {}",
                self.leaked_blocks.prefill, self.leaked_blocks.decode
            ));
        }
        if self.events.duplicates > 0 || self.events.unknown > 0 {
            why.push(format!(
                "{} duplicate and {} unknown events",
                self.events.duplicates, self.events.unknown
            ));
        }
        if let Some(first) = self.errors.first() {
            why.push(format!("{} errors (first: {first})", self.errors.len()));
        }
        format!("verdict: FAILED — {}", why.join("; "))
    }

    /// The report as a table for people, ending with the verdict line.
    pub fn render_table(&self) -> String {
        let g = &self.geometry;
        let mut out = String::new();
        let mut lines: Vec<(&str, String)> = vec![
            (
                "transport",
                format!("{} (P and D in one process, one actix runtime)", self.transport),
            ),
            (
                "model geometry",
                format!(
                    "{} layers x {} KV heads x {} dim, {} B/elem, {}-token blocks, {} ({} per block)",
                    g.layers,
                    g.kv_heads,
                    g.head_dim,
                    g.dtype_bytes,
                    g.block_tokens,
                    g.layout,
                    human_bytes(g.block_bytes)
                ),
            ),
            (
                "requests",
                format!(
                    "{} (seed {}), {} tokens, {} blocks per side",
                    self.requests, self.seed, self.tokens, self.blocks
                ),
            ),
            (
                "races (P's count)",
                format!(
                    "D registers first {:>4}   P finishes first {:>4}",
                    self.races.decode_registers_first, self.races.prefill_finishes_first
                ),
            ),
            (
                "races (call order)",
                format!(
                    "D registers first {:>4}   P finishes first {:>4}",
                    self.call_order.decode_registers_first,
                    self.call_order.prefill_finishes_first
                ),
            ),
            (
                "D outcomes",
                format!(
                    "ready {}   failed {}   no event {}",
                    self.outcomes.ready, self.outcomes.failed, self.outcomes.missing
                ),
            ),
            (
                "P outcomes",
                format!(
                    "sent {}   released {}   no event {}",
                    self.prefill_outcomes.sent,
                    self.prefill_outcomes.released,
                    self.prefill_outcomes.missing
                ),
            ),
            (
                "verified",
                format!(
                    "{}/{} requests, every byte; {} byte errors",
                    self.verified, self.requests, self.byte_errors
                ),
            ),
            (
                "bytes moved",
                format!(
                    "{} (expected {}) in {:.1} ms -> {:.2} GB/s",
                    human_bytes(self.bytes),
                    human_bytes(self.expected_bytes),
                    self.handoff_window_ms,
                    self.gbps
                ),
            ),
            (
                "handoff latency",
                format!(
                    "p50 {:.0} us   p99 {:.0} us   max {:.0} us",
                    self.handoff_latency_us.p50,
                    self.handoff_latency_us.p99,
                    self.handoff_latency_us.max
                ),
            ),
            (
                "blocks",
                format!(
                    "pool {} per side; double frees {}; not returned P {} / D {}",
                    self.pool_blocks,
                    self.double_frees,
                    self.leaked_blocks.prefill,
                    self.leaked_blocks.decode
                ),
            ),
            (
                "events",
                format!(
                    "P {}   D {}   duplicates {}   unknown {}",
                    self.events.prefill,
                    self.events.decode,
                    self.events.duplicates,
                    self.events.unknown
                ),
            ),
            ("wall time", format!("{:.1} ms", self.wall_ms)),
        ];
        for (i, e) in self.errors.iter().take(5).enumerate() {
            lines.push((if i == 0 { "errors" } else { "" }, e.clone()));
        }
        out.push_str("kvhandoff demo: prefill -> decode KV handoff\n");
        for (name, value) in lines {
            let _ = writeln!(out, "  {name:<19} {value}");
        }
        out.push_str(&self.verdict);
        out.push('\n');
        out
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

// ---------------------------------------------------------------------------------------------
// The byte pattern.

/// The demo model's geometry: 8 layers, 8 KV heads, head dim 128, bf16, 16-token kernel blocks,
/// one kernel block per logical block, HND, one full-attention group, TP 1.
pub fn demo_geometry() -> KvGeometry {
    KvGeometry {
        num_layers: 8,
        total_kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        kernel_block_size: 16,
        kernel_blocks_per_logical: 1,
        layout: KvLayout::Hnd,
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        mla: false,
        cache_groups: vec![CacheGroup {
            kind: CacheGroupKind::FullAttention,
            num_layers: 8,
        }],
    }
}

/// A request's pattern key: a hash of its pairing key, which P and D derive independently
/// from their own request ids.
pub fn request_key(key: &PairingKey) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in key.as_str().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn kind_code(kind: RegionKind) -> u64 {
    match kind {
        RegionKind::Key => 1,
        RegionKind::Value => 2,
        RegionKind::Latent => 3,
        RegionKind::State => 4,
    }
}

/// The seed of one head's row of one token: everything but the byte within the row.
fn row_seed(key: u64, layer: u32, kind: RegionKind, token: u64, head: u32) -> u64 {
    let place = (u64::from(layer) << 40) | (kind_code(kind) << 32) | u64::from(head);
    mix(key ^ mix(place) ^ token.wrapping_mul(GOLDEN).rotate_left(17))
}

/// The 8 pattern bytes of word `word` of a row (splitmix64 from the row's seed).
fn row_word(seed: u64, word: u64) -> [u8; 8] {
    mix(seed.wrapping_add(word.wrapping_add(1).wrapping_mul(GOLDEN))).to_le_bytes()
}

/// The byte P writes, and D expects, at byte `dim_byte` (0 ..= head_dim * dtype_bytes - 1) of
/// head `head` of prompt token `token` (counted from the prompt's start), in the `kind` region
/// of layer `layer`, for the request whose [`request_key`] is `key`.
pub fn expected_byte(
    key: u64,
    layer: u32,
    kind: RegionKind,
    token: u64,
    head: u32,
    dim_byte: u32,
) -> u8 {
    let seed = row_seed(key, layer, kind, token, head);
    row_word(seed, u64::from(dim_byte / 8))[(dim_byte % 8) as usize]
}

/// Byte offset, inside one kernel block of an attention region, of byte `dim_byte` of head
/// `head` of the block's `token_in_block`-th token: `[heads, block_size, head_dim]` for HND,
/// `[block_size, heads, head_dim]` for NHD.
pub fn block_byte_offset(
    geometry: &KvGeometry,
    token_in_block: u32,
    head: u32,
    dim_byte: u32,
) -> usize {
    let row = geometry.head_dim as usize * geometry.dtype_bytes as usize;
    let heads = geometry.heads_per_rank() as usize;
    let tokens = geometry.kernel_block_size as usize;
    let (t, h) = (token_in_block as usize, head as usize);
    let row_index = match geometry.layout {
        KvLayout::Hnd => h * tokens + t,
        KvLayout::Nhd => t * heads + h,
    };
    row_index * row + dim_byte as usize
}

/// Fills `out` (one kernel block of an attention region: `heads * block_size * head_dim *
/// dtype_bytes` bytes) with the pattern of the block whose first token is `first_token`. Every
/// slot is written, padding tokens past the prompt's end included (with their token index).
pub fn fill_kernel_block(
    geometry: &KvGeometry,
    key: u64,
    layer: u32,
    kind: RegionKind,
    first_token: u64,
    out: &mut [u8],
) {
    let row = geometry.head_dim as usize * geometry.dtype_bytes as usize;
    let heads = geometry.heads_per_rank();
    let tokens = geometry.kernel_block_size;
    debug_assert_eq!(out.len(), row * heads as usize * tokens as usize);
    // Row strides, as in `block_byte_offset`, hoisted out of the loop.
    let (head_stride, token_stride) = match geometry.layout {
        KvLayout::Hnd => (tokens as usize * row, row),
        KvLayout::Nhd => (row, heads as usize * row),
    };
    for head in 0..heads {
        for t in 0..tokens {
            let seed = row_seed(key, layer, kind, first_token + u64::from(t), head);
            let start = head as usize * head_stride + t as usize * token_stride;
            for (w, chunk) in out[start..start + row].chunks_mut(8).enumerate() {
                let bytes = row_word(seed, w as u64);
                chunk.copy_from_slice(&bytes[..chunk.len()]);
            }
        }
    }
}

/// Fills (or, with `check`, compares) one logical block of a request across every region.
/// Returns the number of differing bytes when checking.
fn pattern_block(
    pool: &KvPool,
    key: u64,
    block: u32,
    block_index: u64,
    check: bool,
    scratch: &mut Vec<u8>,
    actual: &mut Vec<u8>,
) -> Result<u64, String> {
    let g = pool.geometry();
    let kbs = u64::from(g.kernel_block_size);
    let kbpl = u64::from(g.kernel_blocks_per_logical);
    let mut errors = 0u64;
    for (spec, region) in pool.regions() {
        let (offset, len) = pool.block_span(spec, block);
        let len = len as usize;
        let kernel = spec.block_len as usize;
        scratch.resize(len, 0);
        for (s, out) in scratch.chunks_mut(kernel).enumerate() {
            let first = (block_index * kbpl + s as u64) * kbs;
            fill_kernel_block(g, key, spec.layer, spec.kind, first, out);
        }
        if check {
            actual.resize(len, 0);
            region
                .read(offset, actual)
                .map_err(|e| format!("read of block {block}: {e}"))?;
            if actual != scratch {
                errors += actual
                    .iter()
                    .zip(scratch.iter())
                    .filter(|(a, b)| a != b)
                    .count() as u64;
            }
        } else {
            region
                .write(offset, scratch)
                .map_err(|e| format!("write of block {block}: {e}"))?;
        }
    }
    Ok(errors)
}

// ---------------------------------------------------------------------------------------------
// Block allocators.

/// A free list of logical blocks that counts double frees.
#[derive(Debug)]
pub(crate) struct FreeList {
    free: Vec<u32>,
    is_free: Vec<bool>,
    pub(crate) double_frees: u64,
    pub(crate) bad_ids: u64,
}

impl FreeList {
    pub(crate) fn new(blocks: u32) -> Self {
        FreeList {
            free: (0..blocks).rev().collect(),
            is_free: vec![true; blocks as usize],
            double_frees: 0,
            bad_ids: 0,
        }
    }

    pub(crate) fn available(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn in_use(&self) -> u64 {
        (self.is_free.len() - self.free.len()) as u64
    }

    pub(crate) fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.is_free[b as usize] = false;
        }
        Some(blocks)
    }

    /// Returns the blocks of an event; a block that is already free is a double free.
    pub(crate) fn release(&mut self, blocks: &BlockIds) {
        for &b in blocks.groups.iter().flatten() {
            match self.is_free.get_mut(b as usize) {
                None => self.bad_ids += 1,
                Some(true) => self.double_frees += 1,
                Some(free) => {
                    *free = true;
                    self.free.push(b);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The schedule.

#[derive(Debug, Clone)]
struct Planned {
    prefill_id: RequestId,
    decode_id: RequestId,
    key: u64,
    tokens: u32,
    blocks: usize,
    /// When the prompt reaches P, from the start.
    arrival: Duration,
    /// P calls `request_finished` this long after its prefill is done.
    prefill_delay: Duration,
    /// D calls `request_allocated` this long after P's prefill is done.
    decode_delay: Duration,
}

fn hex(rng: &mut ChaCha8Rng, digits: usize) -> String {
    (0..digits)
        .map(|_| char::from_digit(rng.gen_range(0..16), 16).unwrap_or('0'))
        .collect()
}

fn schedule(options: &DemoOptions, block_tokens: u32) -> Result<Vec<Planned>, DemoError> {
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let mut arrival = Duration::ZERO;
    let skew = options.max_call_skew.as_nanos() as u64;
    let mean_gap = options.mean_arrival_gap.as_secs_f64();
    let mut plan = Vec::with_capacity(options.requests);
    for _ in 0..options.requests {
        let uuid = format!(
            "{}-{}-{}-{}-{}",
            hex(&mut rng, 8),
            hex(&mut rng, 4),
            hex(&mut rng, 4),
            hex(&mut rng, 4),
            hex(&mut rng, 12)
        );
        let base = format!("cmpl-{uuid}-0");
        let p_suffix = hex(&mut rng, 8);
        let mut d_suffix = hex(&mut rng, 8);
        while d_suffix == p_suffix {
            d_suffix = hex(&mut rng, 8);
        }
        let prefill_id = RequestId::new(format!("{base}-{p_suffix}"))
            .map_err(|e| DemoError::Options(e.to_string()))?;
        let decode_id = RequestId::new(format!("{base}-{d_suffix}"))
            .map_err(|e| DemoError::Options(e.to_string()))?;
        let pairing = PairingKey::from_request_id(&prefill_id);
        debug_assert_eq!(pairing, PairingKey::from_request_id(&decode_id));
        let tokens = rng.gen_range(options.min_prompt_tokens..=options.max_prompt_tokens);
        let gap = -mean_gap * (1.0 - rng.gen::<f64>()).ln();
        arrival += Duration::from_secs_f64(gap);
        plan.push(Planned {
            prefill_id,
            decode_id,
            key: request_key(&pairing),
            tokens,
            blocks: tokens.div_ceil(block_tokens) as usize,
            arrival,
            prefill_delay: Duration::from_nanos(rng.gen_range(0..=skew)),
            decode_delay: Duration::from_nanos(rng.gen_range(0..=skew)),
        });
    }
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// The engine loops.

/// What P tells D (the "router" of the demo).
enum ToDecode {
    /// Request `i`'s prefill is done at `at`: D allocates at `at + decode_delay`.
    PrefillDone { index: usize, at: Instant },
    /// P's `request_finished` answered with these parameters for the decode leg.
    Params {
        index: usize,
        params: KvTransferParams,
    },
    /// P gave up on request `i` (its call failed): D does not allocate it.
    Abandoned { index: usize },
}

#[derive(Debug, Clone, Default)]
struct PrefillRecord {
    finish_call: Option<Instant>,
    events: u32,
    sent: bool,
    released: Option<ReleaseCause>,
}

#[derive(Debug, Clone, Default)]
struct DecodeRecord {
    allocate_call: Option<Instant>,
    ready_at: Option<Instant>,
    events: u32,
    ready: bool,
    failed: bool,
    verified: bool,
    byte_errors: u64,
    abandoned: bool,
}

struct SideResult<R> {
    records: Vec<R>,
    free: FreeList,
    duplicates: u64,
    unknown: u64,
    errors: Vec<String>,
    timed_out: bool,
}

fn note(errors: &mut Vec<String>, error: String) {
    tracing::warn!(%error, "demo");
    if errors.len() < 32 {
        errors.push(error);
    }
}

/// Polls `conn` until an event arrives or `until` passes.
fn idle(conn: &mut KvConnector, until: Instant) -> Vec<ConnectorEvent> {
    loop {
        let events = conn.poll_events();
        let now = Instant::now();
        if !events.is_empty() || now >= until {
            return events;
        }
        thread::sleep(IDLE_POLL.min(until - now));
    }
}

struct PrefillLoop {
    conn: KvConnector,
    pool: KvPool,
    plan: Arc<Vec<Planned>>,
    to_decode: mpsc::Sender<ToDecode>,
    start: Instant,
    deadline: Instant,
    corrupt: Option<usize>,
}

impl PrefillLoop {
    fn run(mut self) -> SideResult<PrefillRecord> {
        let n = self.plan.len();
        let mut free = FreeList::new(self.pool.logical_blocks());
        let mut records = vec![PrefillRecord::default(); n];
        let mut errors = Vec::new();
        let (mut duplicates, mut unknown) = (0u64, 0u64);
        let index: BTreeMap<RequestId, usize> = self
            .plan
            .iter()
            .enumerate()
            .map(|(i, p)| (p.prefill_id.clone(), i))
            .collect();
        let mut held: Vec<Option<Vec<u32>>> = vec![None; n];
        // (request, its blocks, next block to fill)
        let mut filling: Option<(usize, Vec<u32>, usize)> = None;
        let mut next_arrival = 0usize;
        let mut finishes: BTreeSet<(Instant, usize)> = BTreeSet::new();
        let mut done = 0usize;
        let (mut scratch, mut unused) = (Vec::new(), Vec::new());
        let mut timed_out = false;
        let mut pending: VecDeque<ConnectorEvent> = VecDeque::new();

        while done < n {
            let now = Instant::now();
            if now >= self.deadline {
                timed_out = true;
                break;
            }
            pending.extend(self.conn.poll_events());
            while let Some(event) = pending.pop_front() {
                let ConnectorEvent::BlocksFree {
                    request,
                    released,
                    blocks,
                } = event
                else {
                    unknown += 1;
                    note(&mut errors, format!("P got a decode event: {event:?}"));
                    continue;
                };
                let Some(&i) = index.get(&request) else {
                    unknown += 1;
                    note(
                        &mut errors,
                        format!("P event for unknown request {request}"),
                    );
                    continue;
                };
                let r = &mut records[i];
                r.events += 1;
                if r.events > 1 {
                    duplicates += 1;
                    note(&mut errors, format!("P: second event for {request}"));
                }
                match held[i].take() {
                    Some(given) if BlockIds::single_group(given.clone()) == blocks => {}
                    other => {
                        unknown += 1;
                        note(
                            &mut errors,
                            format!("P: {request} handed back {blocks:?}, gave {other:?}"),
                        );
                    }
                }
                free.release(&blocks);
                match released {
                    None => r.sent = true,
                    Some(cause) => {
                        r.released = Some(cause);
                        note(
                            &mut errors,
                            format!("P: {request} released unsent: {cause:?}"),
                        );
                    }
                }
                if r.events == 1 {
                    done += 1;
                }
            }

            // 1. A finish that is due.
            if let Some(&(due, i)) = finishes.first() {
                if due <= now {
                    finishes.pop_first();
                    self.finish(
                        i,
                        &mut records,
                        &mut held,
                        &mut free,
                        &mut errors,
                        &mut done,
                    );
                    continue;
                }
            }
            // 2. Start the next prefill once its prompt arrived and blocks are free.
            if filling.is_none() && next_arrival < n {
                let p = &self.plan[next_arrival];
                if self.start + p.arrival <= now {
                    if let Some(blocks) = free.alloc(p.blocks) {
                        filling = Some((next_arrival, blocks, 0));
                        next_arrival += 1;
                    }
                }
            }
            // 3. One block of prefill work.
            if let Some((i, blocks, j)) = filling.as_mut() {
                let p = &self.plan[*i];
                let key = if self.corrupt == Some(*i) {
                    p.key ^ 0x5a5a
                } else {
                    p.key
                };
                if let Err(e) = pattern_block(
                    &self.pool,
                    key,
                    blocks[*j],
                    *j as u64,
                    false,
                    &mut scratch,
                    &mut unused,
                ) {
                    note(&mut errors, format!("P fill: {e}"));
                }
                *j += 1;
                if *j == blocks.len() {
                    let (i, blocks, _) = filling.take().expect("filling");
                    let at = Instant::now();
                    held[i] = Some(blocks);
                    finishes.insert((at + self.plan[i].prefill_delay, i));
                    let _ = self.to_decode.send(ToDecode::PrefillDone { index: i, at });
                }
                continue;
            }
            // 4. Nothing to do: wait for an event, the next finish or the next arrival.
            let mut until = now + Duration::from_millis(1);
            if let Some(&(due, _)) = finishes.first() {
                until = until.min(due);
            }
            if next_arrival < n && free.available() >= self.plan[next_arrival].blocks {
                until = until.min(self.start + self.plan[next_arrival].arrival);
            }
            pending.extend(idle(&mut self.conn, until.min(self.deadline)));
        }
        SideResult {
            records,
            free,
            duplicates,
            unknown,
            errors,
            timed_out,
        }
    }

    fn finish(
        &mut self,
        i: usize,
        records: &mut [PrefillRecord],
        held: &mut [Option<Vec<u32>>],
        free: &mut FreeList,
        errors: &mut Vec<String>,
        done: &mut usize,
    ) {
        let p = &self.plan[i];
        let blocks = held[i].clone().unwrap_or_default();
        let router = KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        };
        records[i].finish_call = Some(Instant::now());
        match self
            .conn
            .request_finished(&p.prefill_id, BlockIds::single_group(blocks), &router)
        {
            Ok(params) => {
                let _ = self.to_decode.send(ToDecode::Params { index: i, params });
            }
            Err(e) => {
                note(errors, format!("P request_finished({}): {e}", p.prefill_id));
                if let Some(blocks) = held[i].take() {
                    free.release(&BlockIds::single_group(blocks));
                }
                // No event will come: count the request as done (the error fails the verdict).
                *done += 1;
                let _ = self.to_decode.send(ToDecode::Abandoned { index: i });
            }
        }
    }
}

struct DecodeLoop {
    conn: KvConnector,
    pool: KvPool,
    plan: Arc<Vec<Planned>>,
    from_prefill: mpsc::Receiver<ToDecode>,
    deadline: Instant,
}

impl DecodeLoop {
    fn run(mut self) -> SideResult<DecodeRecord> {
        let n = self.plan.len();
        let mut free = FreeList::new(self.pool.logical_blocks());
        let mut records = vec![DecodeRecord::default(); n];
        let mut errors = Vec::new();
        let (mut duplicates, mut unknown) = (0u64, 0u64);
        let index: BTreeMap<RequestId, usize> = self
            .plan
            .iter()
            .enumerate()
            .map(|(i, p)| (p.decode_id.clone(), i))
            .collect();
        let mut params: Vec<Option<KvTransferParams>> = vec![None; n];
        let mut allocs: BTreeSet<(Instant, usize)> = BTreeSet::new();
        let mut held: Vec<Option<Vec<u32>>> = vec![None; n];
        // (request, blocks, next block to check)
        let mut verifying: VecDeque<(usize, Vec<u32>, usize)> = VecDeque::new();
        let mut done = 0usize;
        let (mut scratch, mut actual) = (Vec::new(), Vec::new());
        let mut timed_out = false;
        let mut pending: VecDeque<ConnectorEvent> = VecDeque::new();

        while done < n {
            let now = Instant::now();
            if now >= self.deadline {
                timed_out = true;
                break;
            }
            while let Ok(message) = self.from_prefill.try_recv() {
                match message {
                    ToDecode::PrefillDone { index, at } => {
                        allocs.insert((at + self.plan[index].decode_delay, index));
                    }
                    ToDecode::Params { index, params: p } => params[index] = Some(p),
                    ToDecode::Abandoned { index } => {
                        if allocs.iter().any(|&(_, i)| i == index) {
                            allocs.retain(|&(_, i)| i != index);
                            records[index].abandoned = true;
                            done += 1;
                        } else if held[index].is_some() {
                            // Already registered: its deadline fails it; the run times out first.
                            note(&mut errors, format!("D: P abandoned request {index}"));
                        }
                    }
                }
            }
            pending.extend(self.conn.poll_events());
            while let Some(event) = pending.pop_front() {
                let (request, blocks, ready) = match event {
                    ConnectorEvent::BlocksReady { request, blocks } => (request, blocks, true),
                    ConnectorEvent::Failed {
                        request,
                        reason,
                        blocks,
                    } => {
                        note(&mut errors, format!("D: {request} failed: {reason:?}"));
                        (request, blocks, false)
                    }
                    ConnectorEvent::BlocksFree { .. } => {
                        unknown += 1;
                        note(&mut errors, format!("D got a prefill event: {event:?}"));
                        continue;
                    }
                };
                let Some(&i) = index.get(&request) else {
                    unknown += 1;
                    note(
                        &mut errors,
                        format!("D event for unknown request {request}"),
                    );
                    continue;
                };
                let r = &mut records[i];
                r.events += 1;
                if r.events > 1 {
                    duplicates += 1;
                    note(&mut errors, format!("D: second event for {request}"));
                    free.release(&blocks);
                    continue;
                }
                let given = held[i].take();
                if given.as_ref().map(|g| BlockIds::single_group(g.clone())) != Some(blocks.clone())
                {
                    unknown += 1;
                    note(
                        &mut errors,
                        format!("D: {request} handed back {blocks:?}, gave {given:?}"),
                    );
                }
                if ready {
                    r.ready = true;
                    r.ready_at = Some(now);
                    let list = blocks.groups.into_iter().flatten().collect();
                    verifying.push_back((i, list, 0));
                } else {
                    r.failed = true;
                    free.release(&blocks);
                    done += 1;
                }
            }

            // 1. An allocation that is due (in order; the head waits for free blocks).
            if let Some(&(due, i)) = allocs.first() {
                if due <= now {
                    if let Some(blocks) = free.alloc(self.plan[i].blocks) {
                        allocs.pop_first();
                        if self.allocate(
                            i,
                            blocks,
                            &mut records,
                            &mut held,
                            &params,
                            &mut free,
                            &mut errors,
                        ) {
                            continue;
                        }
                        done += 1;
                        continue;
                    }
                }
            }
            // 2. One block of verification.
            if let Some((i, blocks, j)) = verifying.front_mut() {
                match pattern_block(
                    &self.pool,
                    self.plan[*i].key,
                    blocks[*j],
                    *j as u64,
                    true,
                    &mut scratch,
                    &mut actual,
                ) {
                    Ok(errs) => records[*i].byte_errors += errs,
                    Err(e) => note(&mut errors, format!("D verify: {e}")),
                }
                *j += 1;
                if *j == blocks.len() {
                    let (i, blocks, _) = verifying.pop_front().expect("verifying");
                    records[i].verified = records[i].byte_errors == 0;
                    if records[i].byte_errors > 0 {
                        note(
                            &mut errors,
                            format!(
                                "D: {} has {} wrong bytes",
                                self.plan[i].decode_id, records[i].byte_errors
                            ),
                        );
                    }
                    // The "decode" is over: the blocks go back to the free list.
                    free.release(&BlockIds::single_group(blocks));
                    done += 1;
                }
                continue;
            }
            // 3. Nothing to do.
            let mut until = now + Duration::from_millis(1);
            if let Some(&(due, _)) = allocs.first() {
                if due > now {
                    until = until.min(due);
                }
            }
            pending.extend(idle(&mut self.conn, until.min(self.deadline)));
        }
        SideResult {
            records,
            free,
            duplicates,
            unknown,
            errors,
            timed_out,
        }
    }

    /// Calls `request_allocated`; false when the call failed (the request is then over).
    #[allow(clippy::too_many_arguments)]
    fn allocate(
        &mut self,
        i: usize,
        blocks: Vec<u32>,
        records: &mut [DecodeRecord],
        held: &mut [Option<Vec<u32>>],
        params: &[Option<KvTransferParams>],
        free: &mut FreeList,
        errors: &mut Vec<String>,
    ) -> bool {
        let p = &self.plan[i];
        // P finished first: its answer came through the router. Otherwise the router builds the
        // decode leg's parameters from what it knows about P.
        let params = params[i].clone().unwrap_or_else(|| KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some(PREFILL_ENGINE.into()),
            tp_size: Some(1),
            ..KvTransferParams::default()
        });
        let tokens = u64::from(p.tokens);
        held[i] = Some(blocks.clone());
        records[i].allocate_call = Some(Instant::now());
        match self.conn.request_allocated(
            &p.decode_id,
            BlockIds::single_group(blocks),
            tokens,
            &params,
        ) {
            Ok(()) => true,
            Err(e) => {
                note(errors, format!("D request_allocated({}): {e}", p.decode_id));
                if let Some(blocks) = held[i].take() {
                    free.release(&BlockIds::single_group(blocks));
                }
                false
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Blocking on an actix request from a plain thread.

struct ThreadWaker(thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `future` on the calling thread until it is ready or `timeout` passes. For futures that
/// need no executor of their own (actix's `Addr::send` answers through a channel).
pub(crate) fn block_on_timeout<F: Future>(future: F, timeout: Duration) -> Option<F::Output> {
    let deadline = Instant::now() + timeout;
    let waker = Waker::from(Arc::new(ThreadWaker(thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return Some(out);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        thread::park_timeout(deadline - now);
    }
}

/// P's endpoint counters, asked for on its rank actor.
pub(crate) fn query_counters(rank: &actix::Addr<RankActor>) -> Option<Counters> {
    block_on_timeout(rank.send(QueryCounters), Duration::from_secs(5))?.ok()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn identity(engine: &str) -> Result<ConnectorIdentity, DemoError> {
    Ok(ConnectorIdentity {
        engine: EngineId::new(engine).map_err(|e| DemoError::Options(e.to_string()))?,
        rank: 0,
        tp_size: 1,
        host: "127.0.0.1".into(),
        port: 0,
    })
}

pub(crate) fn model() -> ModelIdentity {
    ModelIdentity {
        model: "kvhandoff-demo-8l-8kvh-128d".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    }
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Runs the demo.
///
/// # Errors
/// [`DemoError`] when the run cannot start (bad options, a rank that cannot be built, a dead
/// runtime) or an engine thread panics. A run that starts and goes wrong returns a report whose
/// [`DemoReport::verdict_ok`] is false.
pub fn run(options: &DemoOptions) -> Result<DemoReport, DemoError> {
    let wall = Instant::now();
    let geometry = demo_geometry();
    let block_tokens = geometry.kernel_block_size * geometry.kernel_blocks_per_logical;
    if options.requests == 0 {
        return Err(DemoError::Options("requests must be at least 1".into()));
    }
    if options.min_prompt_tokens == 0 || options.min_prompt_tokens > options.max_prompt_tokens {
        return Err(DemoError::Options(
            "prompt lengths need 1 <= min_prompt_tokens <= max_prompt_tokens".into(),
        ));
    }
    let max_blocks = options.max_prompt_tokens.div_ceil(block_tokens);
    if max_blocks > options.pool_blocks {
        return Err(DemoError::Options(format!(
            "a {}-token prompt needs {max_blocks} blocks; the pool has {}",
            options.max_prompt_tokens, options.pool_blocks
        )));
    }
    if options.poll_interval.is_zero() || options.timeout.is_zero() {
        return Err(DemoError::Options(
            "poll_interval and timeout must be positive".into(),
        ));
    }
    let block_bytes = geometry
        .logical_block_bytes(0)
        .map_err(|e| DemoError::Options(e.to_string()))?;
    let plan = Arc::new(schedule(options, block_tokens)?);

    let pool_bytes = block_bytes * u64::from(options.pool_blocks);
    let fabric = MemFabric::with_limits(MemLimits {
        max_fabric_bytes: (2 * pool_bytes).max(MemLimits::default().max_fabric_bytes),
        ..MemLimits::default()
    });
    let shell = ShellConfig {
        poll_interval: options.poll_interval,
        ..ShellConfig::default()
    };
    let p_engine = EngineId::new(PREFILL_ENGINE).map_err(|e| DemoError::Options(e.to_string()))?;
    let d_engine = EngineId::new(DECODE_ENGINE).map_err(|e| DemoError::Options(e.to_string()))?;
    let (p_setup, p_pool) = build_mem_rank(
        &fabric,
        &p_engine,
        geometry.clone(),
        &model(),
        options.pool_blocks,
        Config::default(),
        shell.clone(),
    )?;
    let (d_setup, d_pool) = build_mem_rank(
        &fabric,
        &d_engine,
        geometry.clone(),
        &model(),
        options.pool_blocks,
        Config::default(),
        shell,
    )?;
    let p_agent = p_setup.info.agent.clone();
    let runtime = Runtime::start()?;
    let p_handle = runtime.add_rank(p_setup)?;
    let d_handle = runtime.add_rank(d_setup)?;
    let p_rank = p_handle.rank.clone();
    let p_conn = KvConnector::new(identity(PREFILL_ENGINE)?, p_handle);
    let d_conn = KvConnector::new(identity(DECODE_ENGINE)?, d_handle);

    let (to_decode, from_prefill) = mpsc::channel();
    let start = Instant::now();
    let deadline = start + options.timeout;
    let corrupt = options.corrupt_one_request.then_some(plan.len() / 2);
    let prefill = PrefillLoop {
        conn: p_conn,
        pool: p_pool,
        plan: Arc::clone(&plan),
        to_decode,
        start,
        deadline,
        corrupt,
    };
    let decode = DecodeLoop {
        conn: d_conn,
        pool: d_pool,
        plan: Arc::clone(&plan),
        from_prefill,
        deadline,
    };
    let spawn = |name: &str| thread::Builder::new().name(name.into());
    let p_thread = spawn("demo-prefill")
        .spawn(move || prefill.run())
        .map_err(|e| DemoError::Thread(e.to_string()))?;
    let d_thread = spawn("demo-decode")
        .spawn(move || decode.run())
        .map_err(|e| DemoError::Thread(e.to_string()))?;
    let p = p_thread
        .join()
        .map_err(|_| DemoError::Thread("the prefill loop panicked".into()))?;
    let d = d_thread
        .join()
        .map_err(|_| DemoError::Thread("the decode loop panicked".into()))?;

    let counters = query_counters(&p_rank);
    let bytes = fabric.stats(&p_agent).map_or(0, |s| s.bytes_landed);
    drop(p_rank);
    runtime.shutdown();

    let mut errors = p.errors;
    errors.extend(d.errors);
    let races = match &counters {
        Some(c) => Races {
            decode_registers_first: c.decode_registered_first,
            prefill_finishes_first: c.prefill_finished_first,
        },
        None => {
            note(&mut errors, "P's counters did not come back".into());
            Races::default()
        }
    };
    Ok(build_report(
        options,
        &geometry,
        block_bytes,
        &plan,
        &p.records,
        &d.records,
        Tallies {
            races,
            bytes,
            errors,
            timed_out: p.timed_out || d.timed_out,
            double_frees: p.free.double_frees + d.free.double_frees,
            bad_ids: p.free.bad_ids + d.free.bad_ids,
            leaks: Leaks {
                prefill: p.free.in_use(),
                decode: d.free.in_use(),
            },
            duplicates: p.duplicates + d.duplicates,
            unknown: p.unknown + d.unknown,
            wall,
        },
    ))
}

struct Tallies {
    races: Races,
    bytes: u64,
    errors: Vec<String>,
    timed_out: bool,
    double_frees: u64,
    bad_ids: u64,
    leaks: Leaks,
    duplicates: u64,
    unknown: u64,
    wall: Instant,
}

fn build_report(
    options: &DemoOptions,
    geometry: &KvGeometry,
    block_bytes: u64,
    plan: &[Planned],
    p: &[PrefillRecord],
    d: &[DecodeRecord],
    t: Tallies,
) -> DemoReport {
    let mut errors = t.errors;
    if t.bad_ids > 0 {
        note(
            &mut errors,
            format!("{} block ids outside the pool", t.bad_ids),
        );
    }
    let mut call_order = Races::default();
    let mut latencies = Vec::new();
    let mut first_start: Option<Instant> = None;
    let mut last_ready: Option<Instant> = None;
    for (pr, dr) in p.iter().zip(d) {
        let (Some(pf), Some(da)) = (pr.finish_call, dr.allocate_call) else {
            continue;
        };
        if da <= pf {
            call_order.decode_registers_first += 1;
        } else {
            call_order.prefill_finishes_first += 1;
        }
        let both = pf.max(da);
        first_start = Some(first_start.map_or(both, |f| f.min(both)));
        if let Some(ready) = dr.ready_at {
            latencies.push(ready.saturating_duration_since(both).as_secs_f64() * 1e6);
            last_ready = Some(last_ready.map_or(ready, |l| l.max(ready)));
        }
    }
    latencies.sort_by(f64::total_cmp);
    let window = match (first_start, last_ready) {
        (Some(a), Some(b)) => b.saturating_duration_since(a),
        _ => Duration::ZERO,
    };
    let count = |f: &dyn Fn(&DecodeRecord) -> bool| d.iter().filter(|r| f(r)).count() as u64;
    let blocks: u64 = plan.iter().map(|q| q.blocks as u64).sum();
    let mut report = DemoReport {
        transport: "mem".into(),
        seed: options.seed,
        requests: plan.len() as u64,
        verified: count(&|r| r.verified),
        byte_errors: d.iter().map(|r| r.byte_errors).sum(),
        races: t.races,
        call_order,
        outcomes: Outcomes {
            ready: count(&|r| r.ready),
            failed: count(&|r| r.failed),
            missing: count(&|r| r.events == 0),
        },
        prefill_outcomes: PrefillOutcomes {
            sent: p.iter().filter(|r| r.sent).count() as u64,
            released: p.iter().filter(|r| r.released.is_some()).count() as u64,
            missing: p.iter().filter(|r| r.events == 0).count() as u64,
        },
        bytes: t.bytes,
        expected_bytes: blocks * block_bytes,
        tokens: plan.iter().map(|q| u64::from(q.tokens)).sum(),
        blocks,
        gbps: if window.is_zero() {
            0.0
        } else {
            t.bytes as f64 / window.as_secs_f64() / 1e9
        },
        handoff_window_ms: window.as_secs_f64() * 1e3,
        handoff_latency_us: Latency {
            p50: percentile(&latencies, 50.0),
            p99: percentile(&latencies, 99.0),
            max: latencies.last().copied().unwrap_or(0.0),
        },
        wall_ms: t.wall.elapsed().as_secs_f64() * 1e3,
        events: EventCounts {
            prefill: p.iter().map(|r| u64::from(r.events)).sum(),
            decode: d.iter().map(|r| u64::from(r.events)).sum(),
            duplicates: t.duplicates,
            unknown: t.unknown,
        },
        double_frees: t.double_frees,
        leaked_blocks: t.leaks,
        pool_blocks: options.pool_blocks,
        geometry: GeometrySummary {
            layers: geometry.num_layers,
            kv_heads: geometry.total_kv_heads,
            head_dim: geometry.head_dim,
            dtype_bytes: geometry.dtype_bytes,
            block_tokens: geometry.kernel_block_size * geometry.kernel_blocks_per_logical,
            layout: match geometry.layout {
                KvLayout::Hnd => "HND".into(),
                KvLayout::Nhd => "NHD".into(),
            },
            block_bytes,
        },
        timed_out: t.timed_out,
        errors,
        ok: false,
        verdict: String::new(),
    };
    if report.timed_out {
        let missing = report.outcomes.missing + report.prefill_outcomes.missing;
        note(
            &mut report.errors,
            format!(
                "the run reached its {:?} limit with {missing} events missing",
                options.timeout
            ),
        );
    }
    if report.bytes != report.expected_bytes {
        note(
            &mut report.errors,
            format!(
                "the transport moved {} bytes; the blocks hold {}",
                report.bytes, report.expected_bytes
            ),
        );
    }
    report.ok = report.verdict_ok();
    report.verdict = report.verdict_line();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_list_counts_double_frees() {
        let mut f = FreeList::new(4);
        let a = f.alloc(3).unwrap();
        assert_eq!(f.available(), 1);
        assert!(f.alloc(2).is_none());
        f.release(&BlockIds::single_group(a.clone()));
        assert_eq!(f.double_frees, 0);
        f.release(&BlockIds::single_group(vec![a[0]]));
        assert_eq!(f.double_frees, 1);
        f.release(&BlockIds::single_group(vec![99]));
        assert_eq!(f.bad_ids, 1);
        assert_eq!(f.in_use(), 0);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn schedule_pairs_ids_and_varies_suffixes() {
        let plan = schedule(&DemoOptions::default(), 16).unwrap();
        assert_eq!(plan.len(), 64);
        for p in &plan {
            assert_ne!(p.prefill_id, p.decode_id);
            assert_eq!(
                PairingKey::from_request_id(&p.prefill_id),
                PairingKey::from_request_id(&p.decode_id)
            );
            assert!(p.prefill_id.as_str().starts_with("cmpl-"));
            assert_eq!(p.blocks, p.tokens.div_ceil(16) as usize);
        }
        let d_first = plan
            .iter()
            .filter(|p| p.decode_delay < p.prefill_delay)
            .count();
        assert!(d_first > 16 && d_first < 48, "{d_first}");
    }
}
