//! `kvhandoff demo`: a prefill engine (P) and a decode engine (D) in one process, handing real KV
//! bytes over the in-memory transport or over NIXL, with both races (D registers first, P
//! finishes first).
//!
//! What runs:
//! - one [`Runtime`] hosting two ranks started with a [`RankBuilder`] (`prefill-0` and
//!   `decode-0`, TP 1) on KV memory each engine allocated itself ([`engine_memory`], registered
//!   as it is), each driven through its own [`KvConnector`] and its blocks filled and checked
//!   through its [`KvCache`](kvhandoff::KvCache), found through the runtime's directory.
//!   With [`DemoTransport::Mem`] both ranks are agents of one [`MemFabric`]; with
//!   [`DemoTransport::Nixl`] (cargo feature `nixl`) each is its own NIXL agent (UCX backend,
//!   DRAM), so every byte crosses NIXL;
//! - a small real model's geometry ([`demo_geometry`](crate::pattern::demo_geometry)): 8 layers, 8 KV heads, head dim 128,
//!   bf16, 16-token blocks, HND, one full-attention group (512 KiB per logical block over the
//!   16 K/V regions);
//! - two engine loops on two std threads, each with a free-list block allocator. P "prefills"
//!   each prompt by writing a deterministic pattern into its blocks ([`fill_kernel_block`](crate::pattern::fill_kernel_block)), then
//!   calls `request_finished`; D allocates and calls `request_allocated`; on `BlocksReady` D
//!   checks every byte of every block against [`expected_byte`](crate::pattern::expected_byte).
//!
//! The races: when P's prefill of a request is done (its blocks are filled) at time `f`, P calls
//! `request_finished` at `f + a` and D calls `request_allocated` at `f + b`, with `a` and `b`
//! drawn independently from the seeded schedule (uniform in `[0, max_call_skew]`). So about half
//! the requests see D register first and half see P finish first, whatever the machine's speed.
//! The counts reported are the ones P's endpoint itself saw (its `Counters`).
//!
//! Modes ([`DemoMode`]): each request is pushed (P writes into D's registered blocks; the races
//! above) or pulled (P exports its blocks and D reads them: the router asks P for
//! `transfer_mode: "pull"`, and D, which needs P's `remote_block_ids`, calls at
//! `max(f + b, P's answer)`). `mixed` draws each request's mode from the seed. Every byte is
//! checked either way; the bytes moved are read by D's agent in pull mode.
//!
//! `bidir` runs multi-turn conversations (`requests` turns in all, [`DemoOptions::turns`] per
//! conversation; see `schedule`): every turn is a handoff as above, pushed or pulled as its
//! conversation was drawn, whose prompt is the whole conversation so far. After checking a turn
//! D "decodes" (writes the pattern of its decoded tokens into blocks it allocated for them) and
//! keeps the blocks for the next turn (`keep_for_next_turn`, TTL [`DemoOptions::keep_ttl`], 2 s
//! by default); its answer reaches P through the in-process router, and the next turn reaches
//! P a think time later. P then reads the kept prefix back into the new turn's first blocks
//! (`next_turn_allocated`: NIXL READs from D's agent into P's) and checks every byte of it, or
//! declines D's blocks (`decline_export`) and recomputes the prefix (fills the pattern itself)
//! when it is shorter than [`DemoOptions::recompute_threshold`] tokens, or when less than a
//! quarter of the TTL is left (`declined_near_expiry`: one turn in eight comes back that late
//! by design). The report's `turns` counts them.
//!
//! Deadlines: the ranks run [`Config::default`] (production deadlines). A healthy run never
//! reaches any of them; the demo's own overall limit ([`DemoOptions::timeout`], 60 s) bounds
//! every wait, and a run that hits it reports FAILED with the requests that never finished.
//! `Config::fast()` was not used: its 150 ms peer timeout can declare a live peer dead when the
//! runtime thread is starved by the two busy engine threads on a small machine.
//!
//! Layout: `schedule` (the seeded schedule), `engines` (allocator,
//! records, pacing), `prefill_loop` and `decode_loop` (one role each, runnable alone against a
//! connector: `kvhandoff node` runs one of them per process, see [`crate::node`]), `report`.

mod decode_loop;
mod engines;
mod prefill_loop;
mod report;
mod schedule;

use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{
    blocking::ask, BuildError, QueryCounters, RankActor, RuntimeError, ShellConfig,
};
#[cfg(doc)]
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{Config, Counters};
use kvhandoff_protocol::{EngineId, KvGeometry, ModelIdentity};

use crate::hooks::StopAfter;
#[cfg(doc)]
use kvhandoff::KvConnector;
use kvhandoff::{
    ConnectorIdentity, KvRegion, KvTransferParams, RankBuilder, Runtime, StartError, TransportKind,
};

pub(crate) use decode_loop::run_decode;
pub use engines::FreeList;
pub(crate) use engines::{
    failed_note, import_note, no_answer_note, released_note, router_link, unread_note, DecodeLink,
    DecodeRecord, DecodeRun, Pacing, PrefillLink, PrefillRecord, PrefillRun, PrefillSide, ToDecode,
    ToPrefill, TurnSettings, TurnStart,
};
pub(crate) use prefill_loop::run_prefill;
pub(crate) use report::{build as build_report, turn_counts, Facts, Tallies};
pub use report::{
    DemoReport, EventCounts, GeometrySummary, HeteroSummary, Latency, Leaks, Outcomes,
    PrefillOutcomes, Races, ReportRole, TurnCounts,
};
pub(crate) use schedule::{
    check as check_options, near_expiry_margin, schedule, Planned, Workload,
};

/// P's engine id in the demo.
pub const PREFILL_ENGINE: &str = "prefill-0";
/// D's engine id in the demo.
pub const DECODE_ENGINE: &str = "decode-0";

/// What the KV bytes travel over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DemoTransport {
    /// The in-memory transport: both ranks are agents of one fabric (the default).
    #[default]
    Mem,
    /// NIXL (UCX backend, DRAM): two agents in one process. Needs the cargo feature `nixl`
    /// and the NIXL runtime (`source scripts/nixl-env.sh`).
    Nixl,
}

impl DemoTransport {
    /// `"mem"` or `"nixl"`, as reports name it.
    pub fn name(self) -> &'static str {
        match self {
            DemoTransport::Mem => "mem",
            DemoTransport::Nixl => "nixl",
        }
    }
}

/// How the demo's requests move their KV.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DemoMode {
    /// Every request is pushed: P writes into D's registered blocks (the default).
    #[default]
    Push,
    /// Every request is pulled: P exports its blocks, D reads them.
    Pull,
    /// Each request's mode is drawn from the seed (about half each).
    Mixed,
    /// Multi-turn conversations: each turn's prompt is the conversation so far, handed from P
    /// to D by push or pull (drawn per conversation); between turns D keeps its blocks
    /// (`keep_for_next_turn`) and P reads them back for the next turn (`next_turn_allocated`),
    /// or declines (`decline_export`) and recomputes. See [`DemoOptions::turns`].
    Bidir,
}

impl DemoMode {
    /// `"push"`, `"pull"` or `"mixed"`, as reports name it.
    pub fn name(self) -> &'static str {
        match self {
            DemoMode::Push => "push",
            DemoMode::Pull => "pull",
            DemoMode::Mixed => "mixed",
            DemoMode::Bidir => "bidir",
        }
    }
}

/// What the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoOptions {
    /// What the bytes travel over (default [`DemoTransport::Mem`]).
    pub transport: DemoTransport,
    /// How the requests move their KV (default [`DemoMode::Push`]).
    pub mode: DemoMode,
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
    /// How often each rank's writer polls the transport (default: the shell's, 200 µs).
    pub poll_interval: Duration,
    /// [`DemoMode::Bidir`]: turns per conversation (default 4); `requests` counts turns, so
    /// there are `requests / turns` conversations (rounded up; the last may be shorter).
    pub turns: u32,
    /// [`DemoMode::Bidir`]: how long D keeps a finished turn's blocks for the next one
    /// (`keep_for_next_turn`'s TTL; default 2 s, short for a demo: vLLM's default is minutes).
    /// P's heartbeats renew it while P reads, up to twice this.
    pub keep_ttl: Duration,
    /// [`DemoMode::Bidir`]: P reads a later turn's prefix back from D only when it saves at
    /// least this many tokens; below, P declines and recomputes (default 64, vLLM's
    /// threshold).
    pub recompute_threshold: u32,
    /// The whole run's limit, at least (default 60 s); a run that reaches it reports FAILED.
    /// A larger run gets more when [`DemoOptions::limit_grows_with_work`]: its last arrival,
    /// plus D's deadline for a request (`Config::decode_deadline`: by then every request has
    /// ended or is reported failed), plus every byte of the plan moved at
    /// [`FLOOR_BYTES_PER_SEC`].
    pub timeout: Duration,
    /// Whether the run's limit grows with the work (default true); false makes `timeout` the
    /// limit exactly (a test of the limit itself).
    pub limit_grows_with_work: bool,
    /// Both ranks run with integrity digests (`Config::integrity_digest`; default false): P
    /// digests every block it writes, D checks every block that lands.
    pub integrity_digest: bool,
    /// TEST ONLY: P writes a wrong pattern into one request's blocks, which D must catch.
    #[doc(hidden)]
    pub corrupt_one_request: bool,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            transport: DemoTransport::Mem,
            mode: DemoMode::Push,
            requests: 64,
            seed: 1,
            min_prompt_tokens: 16,
            max_prompt_tokens: 2048,
            pool_blocks: 1024,
            mean_arrival_gap: Duration::from_millis(2),
            max_call_skew: Duration::from_millis(10),
            poll_interval: ShellConfig::default().poll_interval,
            turns: 4,
            keep_ttl: Duration::from_secs(2),
            recompute_threshold: 64,
            timeout: Duration::from_secs(60),
            limit_grows_with_work: true,
            integrity_digest: false,
            corrupt_one_request: false,
        }
    }
}

pub use schedule::FLOOR_BYTES_PER_SEC;

/// The message of [`DemoError::NoNixl`].
pub const NO_NIXL: &str = "this build has no NIXL support; rebuild with --features nixl";

/// Why the demo could not run at all (a run that ran and went wrong is a FAILED report).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The options contradict each other.
    #[error("invalid demo options: {0}")]
    Options(String),
    /// NIXL was asked for, but this build has no NIXL support (cargo feature `nixl`).
    #[error("{NO_NIXL}")]
    NoNixl,
    /// NIXL was asked for, but its runtime cannot be loaded.
    #[error("{0}")]
    NixlUnavailable(String),
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

// ---------------------------------------------------------------------------------------------
// The run.

/// Runs the demo.
///
/// # Errors
/// [`DemoError`] when the run cannot start (bad options, NIXL asked for but not available, a
/// rank that cannot be built, a dead runtime) or an engine thread panics. A run that starts
/// and goes wrong returns a report whose [`DemoReport::verdict_ok`] is false.
pub fn run(options: &DemoOptions) -> Result<DemoReport, DemoError> {
    let wall = Instant::now();
    let workload = check_options(options)?;
    let plan = schedule(options, workload.block_tokens)?;
    match options.transport {
        DemoTransport::Mem => mem::run(options, &workload, &plan, wall),
        DemoTransport::Nixl => nixl_run(options, &workload, &plan, wall),
    }
}

#[cfg(feature = "nixl")]
fn nixl_run(
    options: &DemoOptions,
    workload: &Workload,
    plan: &[Planned],
    wall: Instant,
) -> Result<DemoReport, DemoError> {
    nixl::run(options, workload, plan, wall)
}

#[cfg(not(feature = "nixl"))]
fn nixl_run(
    _: &DemoOptions,
    _: &Workload,
    _: &[Planned],
    _: Instant,
) -> Result<DemoReport, DemoError> {
    Err(DemoError::NoNixl)
}

mod mem {
    use super::*;
    use kvhandoff_actors::system::agent_name;
    use kvhandoff_actors::transport::mem::{MemFabric, MemLimits};

    /// Both ranks on one in-memory fabric; the bytes moved are P's agent's landed bytes.
    pub(super) fn run(
        options: &DemoOptions,
        workload: &Workload,
        plan: &[Planned],
        wall: Instant,
    ) -> Result<DemoReport, DemoError> {
        let pool_bytes = workload.block_bytes * u64::from(options.pool_blocks);
        let fabric = MemFabric::with_limits(MemLimits {
            max_fabric_bytes: (2 * pool_bytes).max(MemLimits::default().max_fabric_bytes),
            ..MemLimits::default()
        });
        // The builder names each rank's agent after its engine and rank.
        let [p_engine, d_engine] = engines()?;
        let name = |engine: &EngineId| {
            agent_name(engine, 0).map_err(|e| DemoError::Options(e.to_string()))
        };
        let (p_agent, d_agent) = (name(&p_engine)?, name(&d_engine)?);
        let kind = TransportKind::Mem(fabric.clone());
        // P's writes (push), D's reads (pull) and P's reads (turns read back).
        run_pair(options, workload, plan, wall, kind, |_| {
            let landed = |agent| fabric.stats(agent).map_or(0, |s| s.bytes_landed);
            landed(&p_agent) + landed(&d_agent)
        })
    }
}

#[cfg(feature = "nixl")]
mod nixl {
    use super::*;
    use kvhandoff_actors::transport::nixl::nixl_runtime_available;

    /// Two NIXL agents in this process. NIXL counts no bytes: the bytes moved are those of the
    /// requests whose write completed (P's `Sent`) or that D read (P's export ended `Read`),
    /// and of the prefixes P read back from D.
    pub(super) fn run(
        options: &DemoOptions,
        workload: &Workload,
        plan: &[Planned],
        wall: Instant,
    ) -> Result<DemoReport, DemoError> {
        nixl_runtime_available().map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
        run_pair(
            options,
            workload,
            plan,
            wall,
            TransportKind::nixl(),
            |records| sent_bytes(plan, records, workload.block_bytes),
        )
    }
}

/// The bytes of the blocks of the requests whose write completed or that were read, and of
/// the prefixes P read back from D.
pub(crate) fn sent_bytes(plan: &[Planned], p: &[engines::PrefillRecord], block_bytes: u64) -> u64 {
    plan.iter()
        .zip(p)
        .map(|(q, r)| (u64::from(r.sent) * q.blocks as u64 + r.read_blocks) * block_bytes)
        .sum()
}

fn engines() -> Result<[EngineId; 2], DemoError> {
    let id = |name| EngineId::new(name).map_err(|e| DemoError::Options(e.to_string()));
    Ok([id(PREFILL_ENGINE)?, id(DECODE_ENGINE)?])
}

/// Starts both ranks with a [`RankBuilder`] on memory each engine allocated itself
/// ([`engine_memory`]), over `kind` (both agents on it), in one runtime, runs both engine loops
/// on two threads with the in-process router between them, and builds the report.
fn run_pair<B>(
    options: &DemoOptions,
    workload: &Workload,
    plan: &[Planned],
    wall: Instant,
    kind: TransportKind,
    bytes: B,
) -> Result<DemoReport, DemoError>
where
    B: FnOnce(&[engines::PrefillRecord]) -> u64,
{
    let transport = transport_name(&kind);
    let shell = ShellConfig {
        poll_interval: options.poll_interval,
        ..ShellConfig::default()
    };
    let [p_engine, d_engine] = engines()?;
    let mut runtime = Runtime::start()?;
    let mut start_rank = |engine: &EngineId| -> Result<_, DemoError> {
        let rank = RankBuilder::new(engine.clone(), workload.geometry.clone(), model())
            .regions(engine_memory(&workload.geometry, options.pool_blocks)?)
            .transport(kind.clone())
            .config(Config {
                integrity_digest: options.integrity_digest,
                ..Config::default()
            })
            .shell(shell.clone())
            .start_on(&mut runtime)
            .map_err(start_error)?;
        Ok(rank.into_parts())
    };
    let (p_conn, p_kv, _) = start_rank(&p_engine)?;
    let (d_conn, d_kv, _) = start_rank(&d_engine)?;
    let p_rank = p_conn.rank().rank.clone();

    let (p_link, d_link) = router_link();
    let start = Instant::now();
    let deadline = start + schedule::run_limit(options, plan, workload.block_bytes);
    let turns = turn_settings(options);
    let prefill = PrefillRun {
        start,
        deadline,
        corrupt: options.corrupt_one_request.then_some(plan.len() / 2),
        pacing: Pacing::Router,
        link: Some(p_link),
        turns,
        answer_wait: None,
        stop_after: StopAfter::NEVER,
    };
    let decode = DecodeRun {
        start,
        deadline,
        pacing: Pacing::Router,
        link: Some(d_link),
        // What a router knows of P before P answered (an in-process rank needs no address).
        params: KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some(PREFILL_ENGINE.into()),
            tp_size: Some(1),
            ..KvTransferParams::default()
        },
        answer_wait: None,
        turns,
        stop_after: StopAfter::NEVER,
    };
    let (p, d) = thread::scope(|s| {
        let spawn = |name: &str| thread::Builder::new().name(name.into());
        let p_thread = spawn("demo-prefill")
            .spawn_scoped(s, move || run_prefill(p_conn, p_kv, plan, prefill))
            .map_err(|e| DemoError::Thread(e.to_string()))?;
        let d_thread = spawn("demo-decode")
            .spawn_scoped(s, move || run_decode(d_conn, d_kv, plan, decode))
            .map_err(|e| DemoError::Thread(e.to_string()))?;
        let p = p_thread
            .join()
            .map_err(|_| DemoError::Thread("the prefill loop panicked".into()))?;
        let d = d_thread
            .join()
            .map_err(|_| DemoError::Thread("the decode loop panicked".into()))?;
        Ok::<_, DemoError>((p, d))
    })?;

    let counters = query_counters(&p_rank);
    let bytes = bytes(&p.records);
    drop(p_rank);
    runtime.shutdown();

    Ok(pair_report(
        Facts {
            options,
            transport,
            workload,
            plan,
            prefill: Some(&p.records),
            decode: &d.records,
        },
        (&p, &d),
        counters,
        bytes,
        wall,
    ))
}

/// The demo's report of both loops' results.
fn pair_report(
    facts: Facts<'_>,
    (p, d): (&engines::PrefillSide, &engines::DecodeSide),
    counters: Option<Counters>,
    bytes: u64,
    wall: Instant,
) -> DemoReport {
    let mut errors = p.errors.clone();
    errors.extend(d.errors.iter().cloned());
    let races = match &counters {
        Some(c) => races_of(c),
        None => {
            engines::note(&mut errors, "P's counters did not come back".into());
            Races::default()
        }
    };
    build_report(
        facts,
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
    )
}

/// The conversations' settings of `options` (both sides use the same).
pub(crate) fn turn_settings(options: &DemoOptions) -> TurnSettings {
    TurnSettings {
        ttl: options.keep_ttl,
        threshold: options.recompute_threshold,
        margin: near_expiry_margin(options.keep_ttl),
    }
}

/// The race counts of P's endpoint counters.
pub(crate) fn races_of(c: &Counters) -> Races {
    Races {
        decode_registers_first: c.decode_registered_first,
        prefill_finishes_first: c.prefill_finished_first,
    }
}

// ---------------------------------------------------------------------------------------------
// Blocking on an actix request from a plain thread.

/// A rank's endpoint counters, asked for on its rank actor.
pub fn query_counters(rank: &actix::Addr<RankActor>) -> Option<Counters> {
    ask(rank, QueryCounters, Duration::from_secs(5))
}

/// A harness engine's KV cache, allocated by the engine itself as a real one does: one zeroed
/// buffer per region of `geometry` (in [`KvGeometry::regions`] order), `pool_blocks` logical
/// blocks each, to hand to a [`RankBuilder`] as it is.
///
/// # Errors
/// [`DemoError::Options`] for a geometry without regions or a pool too large to allocate.
pub fn engine_memory(geometry: &KvGeometry, pool_blocks: u32) -> Result<Vec<KvRegion>, DemoError> {
    let specs = geometry
        .regions()
        .map_err(|e| DemoError::Options(e.to_string()))?;
    specs
        .iter()
        .map(|spec| {
            let len = spec
                .block_len
                .checked_mul(u64::from(geometry.kernel_blocks_per_logical))
                .and_then(|b| b.checked_mul(u64::from(pool_blocks)))
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| DemoError::Options(format!("{pool_blocks} blocks overflow")))?;
            Ok(KvRegion::new(vec![0u8; len]))
        })
        .collect()
}

/// The transport's name in reports (`"mem"`, `"nixl"`).
pub(crate) fn transport_name(kind: &TransportKind) -> &'static str {
    match kind {
        TransportKind::Mem(_) => "mem",
        #[cfg(feature = "nixl")]
        TransportKind::Nixl(_) => "nixl",
        #[allow(unreachable_patterns)]
        _ => "other",
    }
}

/// A [`RankBuilder`]'s refusal as the harness's error (the messages
/// the hand-built ranks gave: a transport or build refusal is [`DemoError::Build`]).
pub(crate) fn start_error(error: StartError) -> DemoError {
    match error {
        StartError::Build(e) => DemoError::Build(e),
        StartError::Transport(e) => DemoError::Build(e.into()),
        StartError::Runtime(e) => DemoError::Runtime(e),
        other => DemoError::Options(other.to_string()),
    }
}

/// The identity of the harness's engine `engine`: rank 0 of TP 1 on localhost.
pub fn identity(engine: &str) -> Result<ConnectorIdentity, DemoError> {
    Ok(ConnectorIdentity {
        engine: EngineId::new(engine).map_err(|e| DemoError::Options(e.to_string()))?,
        rank: 0,
        tp_size: 1,
        host: "127.0.0.1".into(),
        port: 0,
    })
}

/// The model every harness's engines serve (8 layers, 8 KV heads of 128, bfloat16).
pub fn model() -> ModelIdentity {
    ModelIdentity {
        model: "kvhandoff-demo-8l-8kvh-128d".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    }
}
