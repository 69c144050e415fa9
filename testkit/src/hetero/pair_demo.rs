//! `kvhandoff demo --model M --prefill SPEC --decode SPEC`: every rank of a heterogeneous pair
//! (P at one TP / block size / layout, D at another) in one process, handing KV over the lease
//! protocol, then checked byte for byte in D's own geometry.
//!
//! What runs, per rank: a real rank started by a [`RankBuilder`] paired into the plan
//! ([`RankBuilder::pairing`]: endpoint, transport actor, link, route and [`RankLinks`]) in one
//! [`Runtime`], on memory the engine allocated itself (its KV tensors and its staging buffer,
//! registered as they are), driven through its own [`KvConnector`] and its memory filled and
//! read back through its [`KvCache`]. So
//! every (P rank → D rank) link of a request is a 1:1 sub-request under its pair key: each D
//! rank registers with every P rank that writes to it and is `BlocksReady` only when each of
//! them wrote (`FanIn` in the connector); each P rank holds its blocks under the lease until
//! each of its D ranks registered and the write completed. The bytes cross the transport
//! (`mem` or, with `--transport nixl`, one NIXL agent per rank over loopback UCX); the rank's
//! [`PlannedRoute`](kvhandoff::route::PlannedRoute) gives the driver each link's pieces.
//!
//! Up to [`HeteroDemoOptions::window`] requests are in flight at once, each in a memory slot of
//! its own on every rank (a KV and a staging buffer per slot), so that later requests' calls
//! interleave with earlier requests' writes and events on the same endpoints. Each request:
//! 1. its plan and reference KV ([`Handoff::prepare`]: shuffled block ids, P's blocks filled
//!    with the reference in P's geometry, junk everywhere else), every arena copied into its
//!    slot;
//! 2. P files each link's pieces and staging work (the transforms the plan runs on P) with its
//!    route, then every rank's call is made in a seeded random order (P's `request_finished`,
//!    D's `request_allocated`), so that both races (D registers first, P finishes first)
//!    happen; the route runs a link's staging when D's registration has come, right before
//!    the write, since the plan aligns P's staging to D's blocks;
//! 3. once every rank has its event, D's memory is read back, D's staging jobs and tail zeroing
//!    run, and the verifier checks every byte of every arena of both sides; the slot is free.
//!
//! Staging addresses reach P's route in process: across processes they would have to travel
//! with D's registration, which is not built yet.

mod flight;
mod process;
mod pull;
mod ranks;
mod read_back;
mod router;
mod summary;

use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(doc)]
use kvhandoff::{KvCache, KvConnector, RankLinks};
use kvhandoff::{RankBuilder, Runtime, TransportKind};
use kvhandoff_actors::system::MAX_ROUTED_REGIONS;
use kvhandoff_protocol::hetero::{model, plan_pair, HeteroError, PairPlan, SideName, SideSpec};
use kvhandoff_protocol::machine::Config;
use rand::{Rng, SeedableRng};

use super::handoff::{Handoff, RequestShape};
use crate::demo::{start_error, DemoError, DemoReport, DemoTransport};
use flight::Rank;
pub use process::{run_rank, RankProcess, RankReport};
use ranks::{
    agent_names, model_identity, rank_port, ranks_of, region_lens, side_channel, slot_memory,
};
use read_back::{read_back_turns, ReadBack};
pub use router::{run_router, RouterPlan, RouterReport};
use summary::Tally;

/// P's engine id in the heterogeneous demo.
pub const PREFILL: &str = "prefill";
/// D's engine id in the heterogeneous demo.
pub const DECODE: &str = "decode";
/// Most requests of one run.
pub const MAX_REQUESTS: usize = 4096;
/// Most requests in flight at once: each takes a KV and a staging buffer of every rank.
pub const MAX_WINDOW: usize = MAX_ROUTED_REGIONS / 2;
/// Most ranks of one engine with side channels in one process (each its own port).
const MAX_SIDE_RANKS: usize = 64;

/// What the heterogeneous demo runs.
#[derive(Debug, Clone, PartialEq)]
pub struct HeteroDemoOptions {
    /// The catalog model.
    pub model: String,
    /// P's side.
    pub prefill: SideSpec,
    /// D's side.
    pub decode: SideSpec,
    /// What the bytes travel over.
    pub transport: DemoTransport,
    /// Requests (default 16).
    pub requests: usize,
    /// Requests in flight at once, each in its own memory slot of every rank (default 4, at
    /// most [`MAX_WINDOW`]).
    pub window: usize,
    /// Seed of the prompt lengths, prefix hits, block ids and call orders (default 1).
    pub seed: u64,
    /// Longest prompt, tokens (default 600).
    pub max_prompt_tokens: u64,
    /// The whole run's limit (default 60 s).
    pub timeout: Duration,
    /// Share of requests (0 to 1) that arm one transport fault on a random P rank as they start
    /// (`mem` only): its next post is refused, or its next write fails, or lands half its bytes
    /// and fails, or lands late. Default 0. The run is then FAILED by design; what must hold is
    /// the accounting (one event per request and side, nothing leaked, every ready request
    /// verified).
    pub chaos: f64,
    /// Every rank pairs over its own TCP side channel on loopback (each engine's rank `R` at
    /// its base port + `R`), and P places its pieces in the memory D's registration names
    /// (`Register::memory`): the wire a pair across processes uses, in one process. Default
    /// false: in process, P's engine files each link's pieces knowing D's memory.
    pub side_channels: bool,
    /// D reads (pull) instead of P writing (push): P's ranks export, the router hands P's
    /// answer to D's ranks, each D rank reads every link into it, and runs every transform of
    /// the pair on its side (see `pair_demo/pull.rs`). Default false.
    pub pull: bool,
    /// Each request pushed or pulled, drawn from the seed (about half each; every process of a
    /// pair draws the same): both paths interleave on the same ranks and endpoints, and each
    /// rank's memory holds what either needs. Not with `pull`. Default false.
    pub mixed: bool,
    /// A conversation's next turn after each request (whose first turn is pushed, pulled or
    /// mixed as `pull` and `mixed` say): once every request's first turn ended, D keeps each
    /// request's blocks (`keep_for_next_turn`) and P reads them back into
    /// its own geometry (`next_turn_allocated`), the pair planned the other way (D's engine the
    /// holder); every byte of the read-back checked in P's geometry. Default false.
    pub bidir: bool,
    /// TEST ONLY: a deliberate fault in the middle request, which the run must report.
    #[doc(hidden)]
    pub fault: Option<HeteroFault>,
}

/// A deliberate fault of the heterogeneous demo (tests show that the report catches each).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeteroFault {
    /// P files nothing for the request's first link: its write is refused (`PostFailed`).
    UnfiledLink,
    /// One piece of the request's first non-empty link lands one row off.
    ShiftedPiece,
    /// P files its links without their staging work: the write moves staging P never filled.
    Unstaged,
    /// D's first rank aborts the request after every D rank registered and before any P rank
    /// finished.
    DecodeAborts,
}

impl HeteroDemoOptions {
    /// The defaults for a pair.
    pub fn new(model: &str, prefill: SideSpec, decode: SideSpec) -> HeteroDemoOptions {
        HeteroDemoOptions {
            model: model.into(),
            prefill,
            decode,
            transport: DemoTransport::Mem,
            requests: 16,
            window: 4,
            seed: 1,
            max_prompt_tokens: 600,
            timeout: Duration::from_secs(60),
            chaos: 0.0,
            side_channels: false,
            pull: false,
            mixed: false,
            bidir: false,
            fault: None,
        }
    }
}

/// Runs the heterogeneous demo.
///
/// # Errors
/// [`DemoError::Options`] for an unknown model, a pair the planner refuses (with its reason),
/// or bad counts; [`DemoError::NoNixl`]/[`DemoError::NixlUnavailable`]
/// for NIXL without its runtime; a rank that cannot be built. A run that starts and goes wrong
/// returns a FAILED report.
pub fn run(options: &HeteroDemoOptions) -> Result<DemoReport, DemoError> {
    let wall = Instant::now();
    let run = planned(options)?;
    match options.transport {
        DemoTransport::Mem => mem_run(options, run, wall),
        DemoTransport::Nixl => nixl_run(options, run, wall),
    }
}

/// The options checked, the pair planned and every request prepared.
fn planned(options: &HeteroDemoOptions) -> Result<Prepared, DemoError> {
    let opt = |e: HeteroError| DemoError::Options(e.to_string());
    let model = model(&options.model).map_err(opt)?;
    let pair = plan_pair(model, options.prefill, options.decode).map_err(opt)?;
    if options.requests == 0 || options.requests > MAX_REQUESTS {
        return Err(DemoError::Options(format!(
            "--requests must be in 1..={MAX_REQUESTS}"
        )));
    }
    if !(0.0..=1.0).contains(&options.chaos) {
        return Err(DemoError::Options(
            "chaos is a share of requests, 0 to 1".into(),
        ));
    }
    if (options.pull || options.mixed) && options.fault.is_some() {
        return Err(DemoError::Options(
            "the deliberate faults tamper with P's writes: not with pull or mixed".into(),
        ));
    }
    if options.mixed && options.pull {
        return Err(DemoError::Options(
            "mixed draws push or pull per request: not with pull".into(),
        ));
    }
    if options.side_channels && options.fault.is_some() {
        return Err(DemoError::Options(
            "the deliberate faults tamper with pieces filed ahead: not with side channels".into(),
        ));
    }
    if options.chaos > 0.0 && options.transport != DemoTransport::Mem {
        return Err(DemoError::Options(
            "chaos arms the in-memory transport's faults: --transport mem".into(),
        ));
    }
    if options.window == 0 || options.window > MAX_WINDOW {
        return Err(DemoError::Options(format!(
            "the window must be in 1..={MAX_WINDOW}"
        )));
    }
    let d_logical = pair.decode.spec.logical_block();
    if options.max_prompt_tokens <= d_logical
        || options.max_prompt_tokens > kvhandoff_protocol::hetero::MAX_REQUEST_TOKENS
    {
        return Err(DemoError::Options(format!(
            "the longest prompt must be above D's {d_logical}-token logical block and at most {}",
            kvhandoff_protocol::hetero::MAX_REQUEST_TOKENS
        )));
    }
    let handoffs = prepare(&pair, options)?;
    let pulled = pulled_requests(options);
    let mut lens = region_lens(&pair, &handoffs, &pulled);
    let read_back = if options.bidir {
        if options.fault.is_some() || options.chaos > 0.0 {
            return Err(DemoError::Options(
                "a read-back runs without deliberate faults or chaos".into(),
            ));
        }
        let reversed = plan_pair(model, options.decode, options.prefill).map_err(|e| {
            DemoError::Options(format!("the pair cannot be planned the other way: {e}"))
        })?;
        let back = prepare(&reversed, options)?;
        // The read-back's holders are D's ranks and its readers P's: each rank's memory must
        // hold both turns' needs.
        for ((side, index), back_lens) in region_lens(&reversed, &back, &vec![true; back.len()]) {
            let engine_side = match side {
                SideName::Prefill => SideName::Decode,
                SideName::Decode => SideName::Prefill,
            };
            if let Some((_, lens)) = lens
                .iter_mut()
                .find(|(key, _)| *key == (engine_side, index))
            {
                lens[0] = lens[0].max(back_lens[0]);
                lens[1] = lens[1].max(back_lens[1]);
            }
        }
        Some((reversed, back))
    } else {
        None
    };
    Ok(Prepared {
        pair,
        handoffs,
        pulled,
        lens,
        read_back,
    })
}

/// Per request, whether it is pulled: all with `pull`, none in push, and with `mixed` a seeded
/// draw every process of the pair makes alike.
fn pulled_requests(options: &HeteroDemoOptions) -> Vec<bool> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(options.seed ^ 0x6d69_7865_6400);
    (0..options.requests)
        .map(|_| options.pull || (options.mixed && rng.gen_bool(0.5)))
        .collect()
}

/// Every request's plan and arenas, drawn from the seed.
fn prepare(pair: &PairPlan, options: &HeteroDemoOptions) -> Result<Vec<Handoff>, DemoError> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(options.seed);
    let d_logical = pair.decode.spec.logical_block();
    (0..options.requests)
        .map(|r| {
            let tokens = rng.gen_range(1..=options.max_prompt_tokens);
            let hits = (tokens - 1) / d_logical;
            let cached = if hits > 0 && rng.gen_bool(0.25) {
                rng.gen_range(1..=hits) * d_logical
            } else {
                0
            };
            let shape = RequestShape {
                tokens,
                cached_tokens: cached,
                seed: options.seed.wrapping_mul(1_000_003).wrapping_add(r as u64),
            };
            Handoff::prepare(pair.clone(), shape)
                .map_err(|e| DemoError::Options(format!("request {r}: {e}")))
        })
        .collect()
}

/// A run's requests, planned: the pair, every request's plan and arenas, and the memory each
/// rank registers per slot ([`region_lens`]).
struct Prepared {
    pair: PairPlan,
    handoffs: Vec<Handoff>,
    /// Per request, whether it is pulled ([`pulled_requests`]).
    pulled: Vec<bool>,
    lens: Vec<((SideName, usize), [u64; 2])>,
    /// With `bidir`: the pair planned the other way, and each request's read-back.
    read_back: Option<(PairPlan, Vec<Handoff>)>,
}

fn mem_run(
    options: &HeteroDemoOptions,
    run: Prepared,
    wall: Instant,
) -> Result<DemoReport, DemoError> {
    use kvhandoff_actors::transport::mem::{MemFabric, MemLimits};
    let total: u64 = run
        .lens
        .iter()
        .flat_map(|(_, lens)| lens.iter())
        .sum::<u64>()
        .saturating_mul(options.window as u64);
    let fabric = MemFabric::with_limits(MemLimits {
        max_fabric_bytes: total
            .saturating_mul(2)
            .max(MemLimits::default().max_fabric_bytes),
        ..MemLimits::default()
    });
    // The builder names each rank's agent after its engine and rank.
    let agents = agent_names(&run)?;
    let landed = || {
        agents
            .iter()
            .filter_map(|a| fabric.stats(a))
            .map(|s| s.bytes_landed)
            .sum()
    };
    let mut chaos = |rng: &mut rand_chacha::ChaCha8Rng| {
        if options.chaos <= 0.0 || !rng.gen_bool(options.chaos) {
            return false;
        }
        // The side that posts the transfers: P's writes, or D's reads (mixed: either).
        let poster = if options.pull || (options.mixed && rng.gen_bool(0.5)) {
            DECODE
        } else {
            PREFILL
        };
        let writers: Vec<_> = agents
            .iter()
            .filter(|a| a.as_str().starts_with(poster))
            .collect();
        let Some(agent) = writers.get(rng.gen_range(0..writers.len().max(1))) else {
            return false;
        };
        let Some(mut faults) = fabric.faults(agent) else {
            return false;
        };
        match rng.gen_range(0..4) {
            0 => faults.fail_next_posts += 1,
            1 => faults.fail_next_transfers += 1,
            2 => faults.partial_next_transfers += 1,
            _ => faults.land_after_polls = rng.gen_range(2..40),
        }
        fabric.set_faults(agent, faults).is_ok()
    };
    let hooks = Hooks {
        transport: "mem",
        landed: Some(&landed),
        chaos: &mut chaos,
    };
    drive(
        options,
        run,
        wall,
        TransportKind::Mem(fabric.clone()),
        hooks,
    )
}

#[cfg(feature = "nixl")]
fn nixl_run(
    options: &HeteroDemoOptions,
    run: Prepared,
    wall: Instant,
) -> Result<DemoReport, DemoError> {
    use kvhandoff_actors::transport::nixl::nixl_runtime_available;
    nixl_runtime_available().map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
    let hooks = Hooks {
        transport: "nixl",
        landed: None,
        chaos: &mut |_| false,
    };
    drive(options, run, wall, TransportKind::nixl(), hooks)
}

#[cfg(not(feature = "nixl"))]
fn nixl_run(_: &HeteroDemoOptions, _: Prepared, _: Instant) -> Result<DemoReport, DemoError> {
    Err(DemoError::NoNixl)
}

/// What differs between the transports a run drives.
struct Hooks<'a> {
    /// `"mem"` or `"nixl"`.
    transport: &'static str,
    /// Bytes the transport landed, when it counts them (else: the bytes of requests sent).
    landed: Option<&'a dyn Fn() -> u64>,
    /// Arms a fault as a request starts (`chaos`); whether it did.
    chaos: &'a mut dyn FnMut(&mut rand_chacha::ChaCha8Rng) -> bool,
}

/// Starts every rank with a [`RankBuilder`] paired into the plan, on memory each engine
/// allocated itself ([`slot_memory`]) over `kind`, runs every request, and reports.
fn drive(
    options: &HeteroDemoOptions,
    run: Prepared,
    wall: Instant,
    kind: TransportKind,
    hooks: Hooks<'_>,
) -> Result<DemoReport, DemoError> {
    let config = Config::default();
    let identity = model_identity(&run.pair);
    let mut runtime = Runtime::start()?;
    let mut ranks = Vec::new();
    // Each engine's base port, its ranks above it (TP × PP ranks: 32 at most in the catalog's
    // specs, 64 checked by `rank_port`'s caller below).
    let bases = options.side_channels.then(|| {
        let ports = crate::ports::loopback_ports::<{ 2 * MAX_SIDE_RANKS }>();
        (ports[0], ports[MAX_SIDE_RANKS])
    });
    if bases.is_some()
        && (run.pair.prefill.ranks.len() > MAX_SIDE_RANKS
            || run.pair.decode.ranks.len() > MAX_SIDE_RANKS)
    {
        return Err(DemoError::Options(format!(
            "side channels here hold {MAX_SIDE_RANKS} ranks per engine"
        )));
    }
    for (rank, &((side, index), lens)) in ranks_of(&run).zip(&run.lens) {
        let (engine, geometry) = rank?;
        // The builder pairs blocks as given: P hands its whole block list to the route, whose
        // plan aligns the sides by tokens.
        let mut builder = RankBuilder::new(engine, geometry.clone(), identity.clone())
            .regions(slot_memory(lens, options.window)?)
            .transport(kind.clone())
            .config(config.clone())
            .pairing(run.pair.clone(), side);
        let mut remote = None;
        if let Some((p_base, d_base)) = bases {
            let base = match side {
                SideName::Prefill => p_base,
                SideName::Decode => {
                    remote = Some(p_base);
                    d_base
                }
            };
            builder = builder.side_channel(side_channel(side, rank_port(base, geometry)?)?);
        }
        let started = builder.start_on(&mut runtime).map_err(start_error)?;
        let route = started
            .route()
            .cloned()
            .ok_or_else(|| DemoError::Options(format!("{side} rank {index}: no route")))?;
        let (conn, kv, _) = started.into_parts();
        ranks.push(Rank {
            side,
            index,
            id: geometry.rank_index(),
            conn,
            kv,
            route,
            remote,
        });
    }
    let Prepared {
        pair,
        handoffs,
        pulled,
        read_back,
        ..
    } = run;
    let deadline = Instant::now() + options.timeout;
    let mut tally = Tally::default();
    let start = Instant::now();
    let fault = options.fault.map(|f| (options.requests / 2, f));
    let shared: Vec<flight::Shared> = handoffs
        .into_iter()
        .map(|h| Arc::new(std::sync::Mutex::new(h)))
        .collect();
    flight::run_all(
        &shared,
        &pair,
        &mut ranks,
        options.window,
        options.seed ^ 0x5eed_ca11,
        fault,
        if options.side_channels {
            flight::Placing::AtPost
        } else {
            flight::Placing::Ahead
        },
        &pulled,
        None,
        None,
        flight::Pace::default(),
        hooks.chaos,
        deadline,
        &mut tally,
    );
    let turns = match read_back {
        Some((reversed, back)) => {
            let placing = if options.side_channels {
                flight::Placing::AtPost
            } else {
                flight::Placing::Ahead
            };
            let turn = ReadBack {
                reversed: &reversed,
                back,
                placing,
                router: None,
                first: 0,
                keep: pull::KEEP_TTL,
            };
            Some(read_back_turns(
                options, turn, &mut ranks, deadline, &mut tally,
            ))
        }
        None => None,
    };
    let window = start.elapsed();
    for rank in &mut ranks {
        if let Some(c) = rank.conn.rank().counters(Duration::from_secs(5)) {
            if rank.side == SideName::Prefill {
                tally.races.decode_registers_first += c.decode_registered_first;
                tally.races.prefill_finishes_first += c.prefill_finished_first;
            }
        } else {
            tally.error(format!(
                "{} rank {}: counters did not come back",
                rank.side, rank.id
            ));
        }
        if rank.route.pending() > 0 {
            tally.error(format!(
                "{} rank {}: {} filed writes were never posted",
                rank.side,
                rank.id,
                rank.route.pending()
            ));
        }
        let _ = rank.conn.shutdown();
    }
    let read_back_bytes = turns.as_ref().map_or(0, |t| t.read_back_bytes);
    let bytes = match hooks.landed {
        Some(landed) => landed(),
        None => tally.sent_bytes + read_back_bytes,
    };
    drop(ranks);
    runtime.shutdown();
    let mut report = summary::report(
        options,
        &pair,
        &shared,
        &pulled,
        tally,
        bytes,
        window,
        wall,
        hooks.transport,
    );
    if let Some(turns) = turns {
        report.mode = "bidir".into();
        report.expected_bytes += turns.read_back_bytes;
        report.turns = turns;
        report.ok = report.verdict_ok();
        report.verdict = report.verdict_line();
    }
    Ok(report)
}
