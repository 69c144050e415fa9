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

pub mod transfer;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{
    build_mem_rank, BuildError, Placement, RankOptions, RuntimeError, ShellConfig,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{
    Config, DecodeOutcome, DecodeStart, Endpoint, EngineCall, EngineEvent, NetEvent, Output,
    PrefillOutcome, PrefillStart, Time,
};
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{
    BlockIds, EngineId, Epoch, Incarnation, KvGeometry, KvLayout, PairingKey, RequestId,
};
use serde::{Deserialize, Serialize};

use crate::demo::{self, FreeList, Races, DECODE_ENGINE, PREFILL_ENGINE};
use crate::stats::{median, spread};
use kvhandoff::{
    ConnectorCall, ConnectorError, ConnectorEvent, KvConnector, KvTransferParams, Runtime,
};

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

// ---------------------------------------------------------------------------------------------
// The pure machines.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    DecodeFirst,
    PrefillFirst,
}

/// Two endpoints and the wire between them.
struct Pair {
    p: Endpoint,
    d: Endpoint,
    p_addr: PeerAddr,
    d_addr: PeerAddr,
    ready: u64,
    sent: u64,
    other: u64,
}

#[derive(Clone, Copy)]
enum Side {
    P,
    D,
}

impl Pair {
    fn side(&mut self, side: Side) -> (&mut Endpoint, &mut Endpoint, &PeerAddr, &PeerAddr) {
        match side {
            Side::P => (&mut self.p, &mut self.d, &self.p_addr, &self.d_addr),
            Side::D => (&mut self.d, &mut self.p, &self.d_addr, &self.p_addr),
        }
    }

    /// Delivers every output of both endpoints until neither has any.
    fn pump(&mut self, now: Time) -> Result<(), BenchError> {
        loop {
            let mut moved = false;
            for side in [Side::P, Side::D] {
                while let Some(output) = self.side(side).0.poll_output() {
                    moved = true;
                    self.deliver(side, now, output)?;
                }
            }
            if !moved {
                return Ok(());
            }
        }
    }

    fn deliver(&mut self, side: Side, now: Time, output: Output) -> Result<(), BenchError> {
        match output {
            Output::Send { message, .. } => {
                let (_, other, me, _) = self.side(side);
                let from = me.clone();
                other.handle_event(now, NetEvent::Received { from, message });
            }
            Output::Connect { .. } => {
                let (this, other, me, them) = self.side(side);
                let (me, them) = (me.clone(), them.clone());
                // One process run each for the whole bench.
                let incarnation = Incarnation(1);
                this.handle_event(
                    now,
                    NetEvent::PeerConnected {
                        peer: them,
                        incarnation,
                    },
                );
                other.handle_event(
                    now,
                    NetEvent::PeerConnected {
                        peer: me,
                        incarnation,
                    },
                );
            }
            Output::PostWrite(order) => {
                let (this, other, me, _) = self.side(side);
                let from = me.clone();
                other.handle_event(
                    now,
                    NetEvent::Received {
                        from,
                        message: order.notification,
                    },
                );
                this.handle_event(now, NetEvent::WriteCompleted { write: order.write });
            }
            Output::AbandonWrite { write } => {
                return Err(BenchError::Machine(format!("abandoned {write}")));
            }
            Output::Invalidate { peer } => {
                return Err(BenchError::Machine(format!("invalidated {peer}")));
            }
            Output::Event(event) => match event {
                EngineEvent::Decode {
                    outcome: DecodeOutcome::Ready,
                    ..
                } => self.ready += 1,
                EngineEvent::Prefill {
                    outcome: PrefillOutcome::Sent,
                    ..
                } => self.sent += 1,
                _ => self.other += 1,
            },
        }
        Ok(())
    }

    fn timers(&mut self, now: Time) {
        for e in [&mut self.p, &mut self.d] {
            if e.poll_timeout().is_some_and(|at| at <= now) {
                e.handle_timeout(now);
            }
        }
    }
}

/// `cmpl-<32 hex>-0`: a vLLM-like request id base, distinct per `i` and random-looking, so that
/// id comparisons in the machines' ordered maps cost what they cost with real uuids (a shared
/// prefix such as `cmpl-bench-0000` would make every comparison scan it).
fn vllm_like_base(i: usize) -> String {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let (hi, lo) = (mix(i as u64), mix(!(i as u64)));
    format!("cmpl-{hi:016x}{lo:016x}-0")
}

/// ns per request lifecycle over `n` requests in `order`.
fn machine_loop(n: usize, order: Order) -> Result<f64, BenchError> {
    let bug = |e: kvhandoff_protocol::machine::Rejected| BenchError::Machine(e.to_string());
    let engine = |name: &str| EngineId::new(name).map_err(|e| BenchError::Options(e.to_string()));
    let (p_engine, d_engine) = (engine(PREFILL_ENGINE)?, engine(DECODE_ENGINE)?);
    let config = Config {
        max_requests: n.max(1 << 16),
        max_tombstones: (2 * n).max(1 << 17),
        ..Config::default()
    };
    let mut pair = Pair {
        p: Endpoint::new(p_engine.clone(), 0, config.clone())
            .map_err(|e| BenchError::Options(e.to_string()))?,
        d: Endpoint::new(d_engine.clone(), 0, config)
            .map_err(|e| BenchError::Options(e.to_string()))?,
        p_addr: PeerAddr::new(p_engine, 0),
        d_addr: PeerAddr::new(d_engine, 0),
        ready: 0,
        sent: 0,
        other: 0,
    };
    // Ids and inputs are made before the clock starts: the loop measures the machines.
    let mut inputs = Vec::with_capacity(n);
    for i in 0..n {
        let base = vllm_like_base(i);
        let p_id = RequestId::new(format!("{base}-{:08x}", i as u32 ^ 0xaaaa_aaaa))
            .map_err(|e| BenchError::Options(e.to_string()))?;
        let d_id = RequestId::new(format!("{base}-{:08x}", i as u32 ^ 0x5555_5555))
            .map_err(|e| BenchError::Options(e.to_string()))?;
        let key = PairingKey::from_request_id(&p_id);
        let block = (i % 1024) as u32;
        let decode = EngineCall::DecodeAllocated(DecodeStart {
            request: d_id,
            key: key.clone(),
            epoch: Epoch::FIRST,
            prefill: pair.p_addr.clone(),
            blocks: BlockIds::single_group(vec![block]),
            num_tokens: 16,
            expected_writes: 1,
        });
        let prefill = EngineCall::PrefillFinished(PrefillStart {
            request: p_id,
            key,
            blocks: BlockIds::single_group(vec![block]),
        });
        inputs.push((decode, prefill));
    }
    let start = Instant::now();
    for (decode, prefill) in inputs {
        let now = Time::from_duration(start.elapsed());
        pair.timers(now);
        let (first, second, first_is_d) = match order {
            Order::DecodeFirst => (decode, prefill, true),
            Order::PrefillFirst => (prefill, decode, false),
        };
        let (a, b) = if first_is_d {
            (Side::D, Side::P)
        } else {
            (Side::P, Side::D)
        };
        pair.side(a).0.handle_call(now, first).map_err(bug)?;
        pair.pump(now)?;
        pair.side(b).0.handle_call(now, second).map_err(bug)?;
        pair.pump(now)?;
    }
    let elapsed = start.elapsed();
    if pair.ready != n as u64 || pair.sent != n as u64 || pair.other != 0 {
        return Err(BenchError::Machine(format!(
            "{n} requests: {} ready, {} sent, {} other events",
            pair.ready, pair.sent, pair.other
        )));
    }
    let counters = pair.p.counters();
    let (d_first, p_first) = (
        counters.decode_registered_first,
        counters.prefill_finished_first,
    );
    let expected = match order {
        Order::DecodeFirst => (n as u64, 0),
        Order::PrefillFirst => (0, n as u64),
    };
    if (d_first, p_first) != expected {
        return Err(BenchError::Machine(format!(
            "{order:?}: P counted {d_first} D-first and {p_first} P-first races"
        )));
    }
    Ok(elapsed.as_nanos() as f64 / n as f64)
}

// ---------------------------------------------------------------------------------------------
// The actix system.

fn tiny_geometry() -> KvGeometry {
    KvGeometry::dense(1, 1, 8, 2, 16, KvLayout::Hnd)
}

struct Engine {
    conn: KvConnector,
    free: FreeList,
    /// The block of each call whose verdict came late, until its event or refusal.
    late: std::collections::HashMap<RequestId, u32>,
    ids: Arc<Vec<(RequestId, RequestId)>>,
    decode: bool,
    batch: usize,
    deadline: Instant,
}

struct EngineResult {
    good: u64,
    bad: u64,
    errors: Vec<String>,
    last_event: Option<Instant>,
}

impl Engine {
    fn handle(&mut self, events: Vec<ConnectorEvent>, r: &mut EngineResult) {
        for event in events {
            r.last_event = Some(Instant::now());
            if !matches!(event, ConnectorEvent::Refused { .. }) && !self.late.is_empty() {
                // A late call was accepted after all: its event brings the block back.
                self.late.remove(event.request());
            }
            let (why_bad, blocks) = match event {
                ConnectorEvent::BlocksReady { blocks, .. } => (
                    (!self.decode).then(|| "P got BlocksReady".to_string()),
                    blocks,
                ),
                ConnectorEvent::BlocksFree {
                    released, blocks, ..
                } => {
                    let why = match released {
                        Some(cause) => Some(format!("P released: {cause:?}")),
                        None if self.decode => Some("D got BlocksFree".to_string()),
                        None => None,
                    };
                    (why, blocks)
                }
                ConnectorEvent::Failed { reason, blocks, .. } => {
                    (Some(format!("D failed: {reason:?}")), blocks)
                }
                ConnectorEvent::Refused { request, error } => {
                    let Some(block) = self.late.remove(&request) else {
                        r.bad += 1;
                        r.errors
                            .push(format!("refusal of an unknown call: {request}"));
                        continue;
                    };
                    (
                        Some(format!("refused late: {error}")),
                        BlockIds::single_group(vec![block]),
                    )
                }
            };
            match why_bad {
                None => r.good += 1,
                Some(why) => {
                    r.bad += 1;
                    if r.errors.len() < 8 {
                        r.errors.push(why);
                    }
                }
            }
            self.free.release(&blocks);
        }
    }

    fn run(mut self) -> EngineResult {
        let n = self.ids.len();
        let mut r = EngineResult {
            good: 0,
            bad: 0,
            errors: Vec::new(),
            last_event: None,
        };
        let router = KvTransferParams {
            do_remote_prefill: self.decode,
            do_remote_decode: !self.decode,
            remote_engine_id: self.decode.then(|| PREFILL_ENGINE.to_string()),
            tp_size: Some(1),
            ..KvTransferParams::default()
        };
        let ids = Arc::clone(&self.ids);
        let mut next = 0usize;
        let mut failed_calls = 0u64;
        while (r.good + r.bad + failed_calls) < n as u64 {
            if Instant::now() >= self.deadline {
                r.errors
                    .push(format!("deadline with {} of {n} events", r.good + r.bad));
                break;
            }
            let events = self.conn.poll_events();
            self.handle(events, &mut r);
            // One engine step: every request that has blocks, up to the batch, in one call.
            let mut calls = Vec::with_capacity(self.batch);
            // The one block and the request of each call, to take back if the call is refused.
            let mut taken = Vec::with_capacity(self.batch);
            while next < n && calls.len() < self.batch {
                let Some(blocks) = self.free.alloc(1) else {
                    break;
                };
                let (p_id, d_id) = &ids[next];
                let request = if self.decode { d_id } else { p_id };
                taken.extend(blocks.first().map(|&b| (b, request.clone())));
                let blocks = BlockIds::single_group(blocks);
                calls.push(if self.decode {
                    ConnectorCall::RequestAllocated {
                        request: d_id.clone(),
                        blocks,
                        num_tokens: 16,
                        params: router.clone(),
                    }
                } else {
                    ConnectorCall::RequestFinished {
                        request: p_id.clone(),
                        blocks,
                        params: router.clone(),
                    }
                });
                next += 1;
            }
            if !calls.is_empty() {
                for (result, (block, request)) in self.conn.submit(calls).into_iter().zip(taken) {
                    match result {
                        Ok(_) => {}
                        // It may still be applied: the block stays out until its event tells.
                        Err(ConnectorError::VerdictLate) => {
                            self.late.insert(request, block);
                        }
                        Err(e) => {
                            failed_calls += 1;
                            self.free.release(&BlockIds::single_group(vec![block]));
                            if r.errors.len() < 8 {
                                r.errors.push(e.to_string());
                            }
                        }
                    }
                }
                continue;
            }
            let events = self.conn.wait_events(Duration::from_millis(1));
            self.handle(events, &mut r);
        }
        if self.free.double_frees > 0 || self.free.in_use() > 0 {
            r.errors.push(format!(
                "{} double frees, {} blocks not returned",
                self.free.double_frees,
                self.free.in_use()
            ));
        }
        r
    }
}

fn actix_run(options: &ControlOptions) -> Result<ActixNumbers, BenchError> {
    let n = options.actix_requests;
    let fabric = MemFabric::new();
    let engine = |name: &str| EngineId::new(name).map_err(|e| BenchError::Options(e.to_string()));
    let (p_engine, d_engine) = (engine(PREFILL_ENGINE)?, engine(DECODE_ENGINE)?);
    let config = Config {
        max_requests: n.max(1 << 16),
        max_tombstones: (2 * n).max(1 << 17),
        ..Config::default()
    };
    let build = |engine: &EngineId| {
        build_mem_rank(
            &fabric,
            engine,
            tiny_geometry(),
            &demo::model(),
            options.actix_pool_blocks,
            config.clone(),
            ShellConfig::default(),
        )
    };
    let (p_setup, _p_pool) = build(&p_engine)?;
    let (d_setup, _d_pool) = build(&d_engine)?;
    // P and D are separate engines: each rank gets a thread of its own, as in separate
    // processes.
    let mut runtime = Runtime::start()?;
    let own_threads = RankOptions {
        placement: Placement::OwnThreads,
        ..RankOptions::default()
    };
    let p_handle = runtime.add_rank(p_setup, own_threads.clone())?;
    let d_handle = runtime.add_rank(d_setup, own_threads)?;
    let p_rank = p_handle.rank.clone();
    let ident = |name| demo::identity(name).map_err(|e| BenchError::Options(e.to_string()));
    let p_conn = KvConnector::new(ident(PREFILL_ENGINE)?, p_handle);
    let d_conn = KvConnector::new(ident(DECODE_ENGINE)?, d_handle);
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let base = vllm_like_base(i);
        let id = |suffix: u32| {
            RequestId::new(format!("{base}-{suffix:08x}"))
                .map_err(|e| BenchError::Options(e.to_string()))
        };
        ids.push((id(i as u32 ^ 0xaaaa_aaaa)?, id(i as u32 ^ 0x5555_5555)?));
    }
    let ids = Arc::new(ids);
    let start = Instant::now();
    let deadline = start + options.timeout;
    let make = |conn, decode| Engine {
        late: std::collections::HashMap::new(),
        conn,
        free: FreeList::new(options.actix_pool_blocks),
        ids: Arc::clone(&ids),
        decode,
        batch: options.actix_batch,
        deadline,
    };
    let (p, d) = (make(p_conn, false), make(d_conn, true));
    let p_thread = thread::spawn(move || p.run());
    let d_thread = thread::spawn(move || d.run());
    let p = p_thread
        .join()
        .map_err(|_| BenchError::Actix("the P thread panicked".into()))?;
    let d = d_thread
        .join()
        .map_err(|_| BenchError::Actix("the D thread panicked".into()))?;
    let counters = demo::query_counters(&p_rank);
    drop(p_rank);
    runtime.shutdown();

    let mut problems: VecDeque<String> = p.errors.into_iter().chain(d.errors).collect();
    if p.good != n as u64 || d.good != n as u64 {
        problems.push_front(format!(
            "{n} requests: P sent {} (+{} other), D ready {} (+{} other)",
            p.good, p.bad, d.good, d.bad
        ));
    }
    if !problems.is_empty() {
        let shown: Vec<&str> = problems.iter().take(4).map(String::as_str).collect();
        return Err(BenchError::Actix(format!(
            "{} ({} problems)",
            shown.join("; "),
            problems.len()
        )));
    }
    let end = match (p.last_event, d.last_event) {
        (Some(a), Some(b)) => a.max(b),
        _ => Instant::now(),
    };
    let counters = counters.unwrap_or_default();
    Ok(ActixNumbers {
        requests: n as u64,
        pool_blocks: options.actix_pool_blocks,
        batch: options.actix_batch as u64,
        wall_ms: end.saturating_duration_since(start).as_secs_f64() * 1e3,
        ready: d.good,
        sent: p.good,
        races: Races {
            decode_registers_first: counters.decode_registered_first,
            prefill_finishes_first: counters.prefill_finished_first,
        },
        rounds_requests_per_sec: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvhandoff::{ConnectorError, ConnectorReply};

    #[test]
    fn bad_options_are_refused() {
        for options in [
            ControlOptions {
                rounds: 0,
                ..ControlOptions::default()
            },
            ControlOptions {
                rounds: MAX_ROUNDS + 1,
                ..ControlOptions::default()
            },
            ControlOptions {
                actix_batch: 0,
                ..ControlOptions::default()
            },
            ControlOptions {
                requests: 0,
                ..ControlOptions::default()
            },
        ] {
            assert!(matches!(control(&options), Err(BenchError::Options(_))));
        }
    }

    /// One in-memory rank of `engine` on its own runtime, and its connector.
    fn one_rank(engine: &str) -> (Runtime, KvConnector) {
        let fabric = MemFabric::new();
        let (setup, _pool) = build_mem_rank(
            &fabric,
            &EngineId::new(engine).unwrap(),
            tiny_geometry(),
            &demo::model(),
            8,
            Config::default(),
            ShellConfig::default(),
        )
        .unwrap();
        let mut runtime = Runtime::start().unwrap();
        let own_thread = RankOptions {
            placement: Placement::OwnThread,
            ..RankOptions::default()
        };
        let handle = runtime.add_rank(setup, own_thread).unwrap();
        let conn = KvConnector::new(demo::identity(engine).unwrap(), handle);
        (runtime, conn)
    }

    #[test]
    fn submit_returns_one_result_per_call_in_order() {
        let (runtime, mut conn) = one_rank(DECODE_ENGINE);
        let router = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some(PREFILL_ENGINE.into()),
            tp_size: Some(1),
            ..KvTransferParams::default()
        };
        let id = |s: &str| RequestId::new(s).unwrap();
        let allocated =
            |request: &str, params: &KvTransferParams| ConnectorCall::RequestAllocated {
                request: id(request),
                blocks: BlockIds::single_group(vec![0]),
                num_tokens: 16,
                params: params.clone(),
            };
        let not_remote = KvTransferParams {
            do_remote_prefill: false,
            ..router.clone()
        };
        let results = conn.submit(vec![
            allocated("r1", &router),
            allocated("r2", &not_remote),
            allocated("r1", &router),
            ConnectorCall::RequestFinished {
                request: id("p1"),
                blocks: BlockIds::single_group(vec![1]),
                params: KvTransferParams::default(),
            },
            ConnectorCall::Abort {
                request: id("nope"),
            },
        ]);
        assert_eq!(results.len(), 5);
        assert!(matches!(results[0], Ok(ConnectorReply::Accepted)));
        assert!(matches!(
            results[1],
            Err(ConnectorError::InvalidParam {
                name: "do_remote_prefill",
                ..
            })
        ));
        assert!(matches!(results[2], Err(ConnectorError::Rejected(_))));
        match &results[3] {
            Ok(ConnectorReply::DecodeParams(params)) => {
                assert_eq!(params.remote_request_id.as_deref(), Some("p1"));
                assert_eq!(params.remote_engine_id.as_deref(), Some(DECODE_ENGINE));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(results[4], Err(ConnectorError::Rejected(_))));
        assert!(conn.has_pending_work());
        // The single-call hooks go through the same path (r1 may already have failed: there is
        // no P to connect to; p1 waits for its D).
        let aborted = conn.abort(&id("p1"));
        assert!(aborted.is_ok(), "{aborted:?}");
        assert!(matches!(
            conn.abort(&id("nope")),
            Err(ConnectorError::Rejected(_))
        ));
        assert!(conn.submit(Vec::new()).is_empty());
        runtime.shutdown();
    }

    /// A call whose verdict is late is not reported as "nothing changed": it is `VerdictLate`,
    /// the connector keeps counting it as pending work, and its fate comes through
    /// `poll_events` — the request's event if it was accepted, `Refused` if not.
    #[test]
    fn a_late_verdict_is_settled_by_poll_events() {
        let (runtime, mut conn) = one_rank(PREFILL_ENGINE);
        let finished = |request: &str| ConnectorCall::RequestFinished {
            request: RequestId::new(request).unwrap(),
            blocks: BlockIds::single_group(vec![1]),
            params: KvTransferParams::default(),
        };
        // No wait at all: the rank (on its own thread) cannot answer in time.
        conn.set_call_timeout(Duration::ZERO);
        let late = |conn: &mut KvConnector, request: &str| {
            match conn.submit(vec![finished(request)]).pop().unwrap() {
                Err(ConnectorError::VerdictLate) => true,
                // Answered within no time at all.
                Err(ConnectorError::Rejected(_)) | Ok(_) => false,
                Err(other) => panic!("{other:?}"),
            }
        };
        assert!(late(&mut conn, "p-late"), "the verdict was never late");
        assert!(conn.has_pending_work(), "a late call is pending work");
        // The same request again: a refusal, also late.
        assert!(
            late(&mut conn, "p-late"),
            "the refusal's verdict was never late"
        );
        conn.set_call_timeout(KvConnector::CALL_TIMEOUT);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut refused = Vec::new();
        while Instant::now() < deadline && refused.is_empty() {
            for event in conn.poll_events() {
                match event {
                    ConnectorEvent::Refused { request, error } => refused.push((request, error)),
                    other => panic!("no other event yet: {other:?}"),
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0.as_str(), "p-late");
        assert!(matches!(
            refused[0].1,
            ConnectorError::Rejected(kvhandoff_protocol::machine::Rejected::DuplicateRequest(_))
        ));
        // The accepted one is live: aborting it brings its one event, then no work is left.
        conn.abort(&RequestId::new("p-late").unwrap()).unwrap();
        let mut freed = 0;
        while Instant::now() < deadline && conn.has_pending_work() {
            for event in conn.poll_events() {
                assert!(
                    matches!(event, ConnectorEvent::BlocksFree { .. }),
                    "{event:?}"
                );
                freed += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(freed, 1);
        assert!(!conn.has_pending_work());
        runtime.shutdown();
    }
}
