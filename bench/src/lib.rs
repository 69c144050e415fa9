//! kvhandoff's benchmarks, the library behind `kvhandoff bench`: `control` (this module),
//! [`transfer`], [`turns`] and [`kernels`]; [`report`] runs them all and writes
//! `docs/benchmarks.md`'s generated section and its plots.
//!
//! `kvhandoff bench control`: what the control path costs, without the bytes.
//!
//! - **machines**: two pure [`Endpoint`]s (P and D) stepped directly in one thread: no actix, no
//!   transport. Every `Output::Send` becomes the other side's `NetEvent::Received`; a `Connect`
//!   is answered with `PeerConnected` on both sides; a `PostWrite` completes at once (its
//!   notification goes to D, then `WriteCompleted` to P). One request lifecycle is D allocate →
//!   register → P finish → match → write → done → both events (or P finish first). The figure is
//!   wall time over the loop divided by requests: both sides together.
//! - **actix**: the actix system over the in-memory transport with tiny blocks, the way the demo
//!   runs it but without bytes to fill or check: a P thread and a D thread call their connectors
//!   as fast as they accept calls (bounded only by their block pools), each step submitting up
//!   to `actix_batch` calls at once through [`KvConnector::submit`] the way an engine's scheduler
//!   step would, and every event on both sides is counted. Each rank runs on its own arbiter
//!   thread of the one actix system, as the ranks of two engine processes would.

#![warn(missing_docs)]

pub mod kernels;
pub mod layerwise;
mod machines;
pub mod model;
mod pair;
pub mod report;
mod runtime;
mod stamps;
pub mod transfer;
pub mod turns;

use machines::{machine_loop, vllm_like_base, Order};
use runtime::actix_run;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{BuildError, Placement, RuntimeError};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{
    Config, DecodeOutcome, DecodeStart, Endpoint, EndpointCall, EndpointEvent, NetEvent, Output,
    PrefillOutcome, PrefillStart, Time,
};
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{
    BlockIds, EngineId, Epoch, Incarnation, KvGeometry, KvLayout, PairingKey, RequestId,
};
use serde::{Deserialize, Serialize};

use kvhandoff::{
    ConnectorCall, ConnectorError, ConnectorEvent, ConnectorSettings, KvConnector,
    KvTransferParams, RankBuilder, Runtime, TransportKind,
};
use kvhandoff_testkit::demo::{self, FreeList, Races, DECODE_ENGINE, PREFILL_ENGINE};
use kvhandoff_testkit::stats::{median, spread};

/// What `bench control` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlOptions {
    /// Requests per order through the pure machines (default 100,000).
    pub requests: usize,
    /// Requests through the actix system (default 20,000).
    pub actix_requests: usize,
    /// Logical blocks per side's pool in the actix run; each request takes one (default 1024).
    pub actix_pool_blocks: u32,
    /// Engine calls per [`KvConnector::submit`] in the actix run, like one scheduler step's
    /// worth (default 256; also bounded by the free blocks).
    pub actix_batch: usize,
    /// Rounds of each measurement (default 5); the report gives each one and their median, so
    /// that one disturbed round on a shared machine does not decide the figure.
    pub rounds: usize,
    /// Limit of each actix round (default 60 s).
    pub timeout: Duration,
}

impl Default for ControlOptions {
    fn default() -> Self {
        ControlOptions {
            requests: 100_000,
            actix_requests: 50_000,
            actix_pool_blocks: 1024,
            actix_batch: 256,
            rounds: 5,
            timeout: Duration::from_secs(60),
        }
    }
}

/// Most rounds one run may ask for.
pub const MAX_ROUNDS: usize = 101;

/// Why a benchmark could not produce numbers.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The options make no sense.
    #[error("invalid bench options: {0}")]
    Options(String),
    /// The machines did not do what a healthy run does (a bug, not a slow run).
    #[error("the machines misbehaved: {0}")]
    Machine(String),
    /// A rank could not be built.
    #[error("could not build a rank: {0}")]
    Build(#[from] BuildError),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The actix run went wrong (errors, lost events, deadline).
    #[error("the actix run failed: {0}")]
    Actix(String),
}

/// The pure-machine loop's numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineNumbers {
    /// Requests per order and round.
    pub requests: u64,
    /// ns per request, D registers first: the median round.
    pub decode_registers_first_ns: f64,
    /// ns per request, P finishes first: the median round.
    pub prefill_finishes_first_ns: f64,
    /// Every round's ns per request, D registers first, in the order they ran.
    pub decode_registers_first_rounds_ns: Vec<f64>,
    /// Every round's ns per request, P finishes first, in the order they ran.
    pub prefill_finishes_first_rounds_ns: Vec<f64>,
}

/// The actix run's numbers: its median round, and every round's rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActixNumbers {
    /// Requests per round.
    pub requests: u64,
    /// Blocks in each engine's pool (the most requests a side has in flight).
    pub pool_blocks: u32,
    /// Most engine calls submitted together (one `KvConnector::submit`) per side.
    pub batch: u64,
    /// From the first call to the last event, ms.
    pub wall_ms: f64,
    /// D requests that ended `BlocksReady`.
    pub ready: u64,
    /// P requests whose KV was sent.
    pub sent: u64,
    /// Races as P's endpoint counted them.
    pub races: Races,
    /// Every round's requests per second, in the order they ran.
    pub rounds_requests_per_sec: Vec<f64>,
}

impl ActixNumbers {
    /// Requests per second of this round.
    fn rate(&self) -> f64 {
        if self.wall_ms > 0.0 {
            self.requests as f64 / (self.wall_ms / 1e3)
        } else {
            0.0
        }
    }
}

/// What `bench control` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlReport {
    /// ns per request lifecycle through the pure machines, both sides, D registering first
    /// (median of the rounds).
    pub machine_ns_per_request: f64,
    /// The same with P finishing first.
    pub machine_ns_per_request_prefill_first: f64,
    /// Request lifecycles per second through the actix system over the in-memory transport
    /// (median of the rounds).
    pub actix_requests_per_sec: f64,
    /// Details of the machine loop.
    pub machine: MachineNumbers,
    /// Details of the actix run.
    pub actix: ActixNumbers,
}

impl ControlReport {
    /// The report as a table for people.
    pub fn render_table(&self) -> String {
        let mut out = String::from("kvhandoff bench control: the control path without bytes\n");
        let rows = [
            ("machines, D first", {
                let (lo, hi) = spread(&self.machine.decode_registers_first_rounds_ns);
                format!(
                        "{:>10.0} ns/request  (median of {} rounds of {} requests, one thread; {lo:.0}–{hi:.0})",
                        self.machine_ns_per_request,
                        self.machine.decode_registers_first_rounds_ns.len(),
                        self.machine.requests
                    )
            }),
            ("machines, P first", {
                let (lo, hi) = spread(&self.machine.prefill_finishes_first_rounds_ns);
                format!(
                    "{:>10.0} ns/request  ({lo:.0}–{hi:.0})",
                    self.machine_ns_per_request_prefill_first,
                )
            }),
            ("actix over mem", {
                let (lo, hi) = spread(&self.actix.rounds_requests_per_sec);
                format!(
                        "{:>10.0} requests/s  (median of {} rounds of {} requests, {lo:.0}–{hi:.0}; {} blocks a side, batches of {}; median round: races D first {} / P first {})",
                        self.actix_requests_per_sec,
                        self.actix.rounds_requests_per_sec.len(),
                        self.actix.requests,
                        self.actix.pool_blocks,
                        self.actix.batch,
                        self.actix.races.decode_registers_first,
                        self.actix.races.prefill_finishes_first
                    )
            }),
        ];
        for (name, value) in rows {
            let _ = writeln!(out, "  {name:<18} {value}");
        }
        out
    }
}

/// Runs both control benchmarks.
///
/// # Errors
/// [`BenchError`] for bad options, misbehaving machines, or an actix run that fails.
pub fn control(options: &ControlOptions) -> Result<ControlReport, BenchError> {
    if options.requests == 0 || options.actix_requests == 0 {
        return Err(BenchError::Options(
            "request counts must be positive".into(),
        ));
    }
    if options.actix_batch == 0 {
        return Err(BenchError::Options("batches need calls".into()));
    }
    if options.actix_pool_blocks == 0 {
        return Err(BenchError::Options("the pool needs blocks".into()));
    }
    if options.rounds == 0 || options.rounds > MAX_ROUNDS {
        return Err(BenchError::Options(format!(
            "rounds must be 1 to {MAX_ROUNDS}"
        )));
    }
    let mut decode_first = Vec::with_capacity(options.rounds);
    let mut prefill_first = Vec::with_capacity(options.rounds);
    for _ in 0..options.rounds {
        decode_first.push(machine_loop(options.requests, Order::DecodeFirst)?);
        prefill_first.push(machine_loop(options.requests, Order::PrefillFirst)?);
    }
    let mut rounds = Vec::with_capacity(options.rounds);
    for _ in 0..options.rounds {
        rounds.push(actix_run(options)?);
    }
    let rates: Vec<f64> = rounds.iter().map(ActixNumbers::rate).collect();
    let actix_requests_per_sec = median(&rates);
    // The round whose rate is nearest the median stands for the run in the details.
    let mut actix = rounds
        .into_iter()
        .min_by(|a, b| {
            let off = |r: &ActixNumbers| (r.rate() - actix_requests_per_sec).abs();
            off(a).total_cmp(&off(b))
        })
        .ok_or_else(|| BenchError::Options("no rounds".into()))?;
    actix.rounds_requests_per_sec = rates;
    Ok(ControlReport {
        machine_ns_per_request: median(&decode_first),
        machine_ns_per_request_prefill_first: median(&prefill_first),
        actix_requests_per_sec,
        machine: MachineNumbers {
            requests: options.requests as u64,
            decode_registers_first_ns: median(&decode_first),
            prefill_finishes_first_ns: median(&prefill_first),
            decode_registers_first_rounds_ns: decode_first,
            prefill_finishes_first_rounds_ns: prefill_first,
        },
        actix,
    })
}

/// The two engines of `bench control` and a configuration whose tables hold `n` requests.
fn engines_and_config(n: usize) -> Result<(EngineId, EngineId, Config), BenchError> {
    let engine = |name: &str| EngineId::new(name).map_err(|e| BenchError::Options(e.to_string()));
    let config = Config {
        max_requests: n.max(1 << 16),
        max_tombstones: (2 * n).max(1 << 17),
        ..Config::default()
    };
    Ok((engine(PREFILL_ENGINE)?, engine(DECODE_ENGINE)?, config))
}

#[cfg(test)]
mod tests;
