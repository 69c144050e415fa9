//! `kvhandoff demo --model M --prefill SPEC --decode SPEC`: every rank of a heterogeneous pair
//! (P at one TP / block size / layout, D at another) in one process, handing KV over the lease
//! protocol, then checked byte for byte in D's own geometry.
//!
//! What runs, per rank: a real rank ([`build_routed_rank`]: endpoint, transport actor, link)
//! in one [`Runtime`], its registered memory being the rank's KV tensors and its staging
//! buffer, driven through its own [`KvConnector`] with [`RankLinks`] from the pair's plan. So
//! every (P rank → D rank) link of a request is a 1:1 sub-request under its pair key: each D
//! rank registers with every P rank that writes to it and is `BlocksReady` only when each of
//! them wrote (`FanIn` in the connector); each P rank holds its blocks under the lease until
//! each of its D ranks registered and the write completed. The bytes cross the transport
//! (`mem` or, with `--transport nixl`, one NIXL agent per rank over loopback UCX); the rank's
//! [`PlannedRoute`] gives the driver each link's pieces.
//!
//! One request after another, each:
//! 1. its plan and reference KV ([`Handoff::prepare`]: shuffled block ids, P's blocks filled
//!    with the reference in P's geometry, junk everywhere else), P's staging jobs (the
//!    transforms the plan runs on P), and every arena copied into its rank's registered memory;
//! 2. P files each link's pieces with its route, then every rank's call is made in a seeded
//!    random order (P's `request_finished`, D's `request_allocated`), so that both races
//!    (D registers first, P finishes first) happen;
//! 3. once every rank has its event, D's memory is read back, D's staging jobs and tail zeroing
//!    run, and the verifier checks every byte of every arena of both sides.
//!
//! Requests run one at a time (so one staging buffer per rank serves all); the races are
//! between the ranks of one request. Staging addresses reach P's route in process: across
//! processes they would have to travel with D's registration, which is not built yet.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvhandoff::{
    ConnectorEvent, ConnectorIdentity, ConnectorSettings, KvConnector, KvTransferParams, RankLinks,
    Runtime,
};
use kvhandoff_actors::system::{
    agent_name, build_routed_rank, RankMemory, RankOptions, RoutedRegion, ShellConfig,
};
use kvhandoff_protocol::hetero::{
    model, plan_pair, HeteroError, PairPlan, SideName, SideSpec, Space,
};
use kvhandoff_protocol::machine::{BlockPairing, Config};
use kvhandoff_protocol::planner::Descriptor;
use kvhandoff_protocol::{EngineId, ModelIdentity, PairingKey, RequestId};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::handoff::{Handoff, RequestShape};
use super::route::PlannedRoute;
use crate::demo::{
    DemoError, DemoReport, DemoTransport, EventCounts, GeometrySummary, Latency, Leaks, Outcomes,
    PrefillOutcomes, Races, ReportRole, TurnCounts,
};
use crate::stats::percentile;

/// P's engine id in the heterogeneous demo.
pub const PREFILL: &str = "prefill";
/// D's engine id in the heterogeneous demo.
pub const DECODE: &str = "decode";
/// Most requests of one run.
pub const MAX_REQUESTS: usize = 4096;
/// Most errors a report keeps.
const MAX_ERRORS: usize = 32;

/// What the heterogeneous demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeteroDemoOptions {
    /// The catalog model.
    pub model: String,
    /// P's side.
    pub prefill: SideSpec,
    /// D's side.
    pub decode: SideSpec,
    /// What the bytes travel over.
    pub transport: DemoTransport,
    /// Requests, one after another (default 16).
    pub requests: usize,
    /// Seed of the prompt lengths, prefix hits, block ids and call orders (default 1).
    pub seed: u64,
    /// Longest prompt, tokens (default 600).
    pub max_prompt_tokens: u64,
    /// The whole run's limit (default 60 s).
    pub timeout: Duration,
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
            seed: 1,
            max_prompt_tokens: 600,
            timeout: Duration::from_secs(60),
            fault: None,
        }
    }
}

/// What the heterogeneous demo adds to the demo's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct HeteroSummary {
    /// The catalog model.
    pub model: String,
    /// P's side spec.
    pub prefill: String,
    /// D's side spec.
    pub decode: String,
    /// P's ranks.
    pub prefill_ranks: u32,
    /// D's ranks.
    pub decode_ranks: u32,
    /// Links (P rank → D rank pairs that move bytes).
    pub links: u32,
    /// P ranks that write nothing (replicas).
    pub idle_prefill_ranks: u32,
    /// Sub-requests started over all ranks and requests (one per link and side).
    pub sub_requests: u64,
    /// Descriptors posted over all requests.
    pub descriptors: u64,
    /// P's staging jobs over all requests.
    pub prefill_jobs: u64,
    /// D's staging jobs over all requests.
    pub decode_jobs: u64,
    /// Bytes D zeroed (tails of partly covered blocks).
    pub zeroed_bytes: u64,
    /// Each transform: what, where, why.
    pub transforms: Vec<String>,
}

/// One rank as the demo drives it.
struct Rank {
    side: SideName,
    /// Index in its side's `ranks`.
    index: usize,
    tp: u32,
    conn: KvConnector,
    /// KV tensors, then staging.
    regions: [RoutedRegion; 2],
    route: Arc<PlannedRoute>,
}

/// Runs the heterogeneous demo.
///
/// # Errors
/// [`DemoError::Options`] for an unknown model, a pair the planner refuses (with its reason),
/// a pipeline-parallel side, or bad counts; [`DemoError::NoNixl`]/[`DemoError::NixlUnavailable`]
/// for NIXL without its runtime; a rank that cannot be built. A run that starts and goes wrong
/// returns a FAILED report.
pub fn run(options: &HeteroDemoOptions) -> Result<DemoReport, DemoError> {
    let wall = Instant::now();
    let opt = |e: HeteroError| DemoError::Options(e.to_string());
    let model = model(&options.model).map_err(opt)?;
    let pair = plan_pair(model, options.prefill, options.decode).map_err(opt)?;
    if options.requests == 0 || options.requests > MAX_REQUESTS {
        return Err(DemoError::Options(format!(
            "--requests must be in 1..={MAX_REQUESTS}"
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
    // The runtime names ranks by TP rank alone: no pipeline stages yet.
    RankLinks::for_rank(&pair, SideName::Prefill, 0)
        .map_err(|e| DemoError::Options(e.to_string()))?;
    let handoffs = prepare(&pair, options)?;
    match options.transport {
        DemoTransport::Mem => mem_run(options, pair, handoffs, wall),
        DemoTransport::Nixl => nixl_run(options, pair, handoffs, wall),
    }
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

fn mem_run(
    options: &HeteroDemoOptions,
    pair: PairPlan,
    handoffs: Vec<Handoff>,
    wall: Instant,
) -> Result<DemoReport, DemoError> {
    use kvhandoff_actors::transport::mem::{MemFabric, MemLimits};
    let total: u64 = region_lens(&pair, &handoffs)
        .iter()
        .flat_map(|(_, lens)| lens.iter())
        .sum();
    let fabric = MemFabric::with_limits(MemLimits {
        max_fabric_bytes: total
            .saturating_mul(2)
            .max(MemLimits::default().max_fabric_bytes),
        ..MemLimits::default()
    });
    let agents = std::cell::RefCell::new(Vec::new());
    let make = |name: kvhandoff_protocol::AgentName| {
        agents.borrow_mut().push(name.clone());
        fabric.agent(name).map_err(|e| DemoError::Build(e.into()))
    };
    let landed = || {
        agents
            .borrow()
            .iter()
            .filter_map(|a| fabric.stats(a))
            .map(|s| s.bytes_landed)
            .sum()
    };
    drive(options, pair, handoffs, wall, "mem", make, Some(&landed))
}

#[cfg(feature = "nixl")]
fn nixl_run(
    options: &HeteroDemoOptions,
    pair: PairPlan,
    handoffs: Vec<Handoff>,
    wall: Instant,
) -> Result<DemoReport, DemoError> {
    use kvhandoff_actors::transport::nixl::{nixl_runtime_available, NixlConfig, NixlTransport};
    nixl_runtime_available().map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
    let make = |name: kvhandoff_protocol::AgentName| {
        NixlTransport::new(name, NixlConfig::default()).map_err(|e| DemoError::Build(e.into()))
    };
    drive(options, pair, handoffs, wall, "nixl", make, None)
}

#[cfg(not(feature = "nixl"))]
fn nixl_run(
    _: &HeteroDemoOptions,
    _: PairPlan,
    _: Vec<Handoff>,
    _: Instant,
) -> Result<DemoReport, DemoError> {
    Err(DemoError::NoNixl)
}

/// Per rank (side, index): the lengths of its KV and staging memory, the largest any request
/// needs.
fn region_lens(pair: &PairPlan, handoffs: &[Handoff]) -> Vec<((SideName, usize), [u64; 2])> {
    let mut out = Vec::new();
    for (side, layout) in [
        (SideName::Prefill, &pair.prefill),
        (SideName::Decode, &pair.decode),
    ] {
        for index in 0..layout.ranks.len() {
            let mut lens = [1u64, 1u64];
            for h in handoffs {
                for (slot, space) in [Space::Kv, Space::Staging].into_iter().enumerate() {
                    let len = h.arenas[h.arena(side, index, space)].bytes.len() as u64;
                    lens[slot] = lens[slot].max(len);
                }
            }
            out.push(((side, index), lens));
        }
    }
    out
}

fn model_identity(pair: &PairPlan) -> ModelIdentity {
    ModelIdentity {
        model: format!("kvhandoff-catalog-{}", pair.model.name),
        dtype: "bfloat16".into(),
        cache_dtype: format!("{}-byte", pair.model.dtype_bytes),
    }
}

/// Builds every rank, runs every request, and reports.
fn drive<T, M>(
    options: &HeteroDemoOptions,
    pair: PairPlan,
    mut handoffs: Vec<Handoff>,
    wall: Instant,
    transport: &'static str,
    mut make: M,
    landed: Option<&dyn Fn() -> u64>,
) -> Result<DemoReport, DemoError>
where
    T: RankMemory + Unpin + Send + 'static,
    M: FnMut(kvhandoff_protocol::AgentName) -> Result<T, DemoError>,
{
    let config = Config::default();
    let identity = model_identity(&pair);
    let mut runtime = Runtime::start()?;
    let mut ranks = Vec::new();
    for ((side, index), lens) in region_lens(&pair, &handoffs) {
        let (engine, layout) = match side {
            SideName::Prefill => (PREFILL, &pair.prefill),
            SideName::Decode => (DECODE, &pair.decode),
        };
        let rank = &layout.ranks[index];
        let engine_id = EngineId::new(engine).map_err(|e| DemoError::Options(e.to_string()))?;
        let name =
            agent_name(&engine_id, rank.rank.tp).map_err(|e| DemoError::Options(e.to_string()))?;
        let route = Arc::new(PlannedRoute::new(&pair, side));
        // P hands its whole block list to the route, whose plan aligns the sides by tokens.
        let rank_config = Config {
            block_pairing: BlockPairing::AsGiven,
            ..config.clone()
        };
        let (setup, regions) = build_routed_rank(
            make(name)?,
            &engine_id,
            rank.geometry.clone(),
            &identity,
            &lens,
            rank_config,
            ShellConfig::default(),
            route.clone(),
        )?;
        let [kv, staging]: [RoutedRegion; 2] = regions
            .try_into()
            .map_err(|_| DemoError::Options("a rank registered other than two buffers".into()))?;
        let handle = runtime.add_rank(setup, RankOptions::default())?;
        let mut conn = KvConnector::with_settings(
            ConnectorIdentity {
                engine: engine_id,
                rank: rank.rank.tp,
                tp_size: layout.spec.tp,
                host: "127.0.0.1".into(),
                port: 0,
            },
            handle,
            ConnectorSettings::new(&config, &rank.geometry),
        );
        let links = RankLinks::for_rank(&pair, side, rank.rank.tp)
            .map_err(|e| DemoError::Options(e.to_string()))?;
        conn.set_links(links)
            .map_err(|e| DemoError::Options(e.to_string()))?;
        ranks.push(Rank {
            side,
            index,
            tp: rank.rank.tp,
            conn,
            regions: [kv, staging],
            route,
        });
    }
    let deadline = Instant::now() + options.timeout;
    let mut tally = Tally::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(options.seed ^ 0x5eed_ca11);
    let start = Instant::now();
    for (r, h) in handoffs.iter_mut().enumerate() {
        if Instant::now() >= deadline {
            tally.timed_out = true;
            tally.error(format!(
                "request {r} and later: not started, the run timed out"
            ));
            break;
        }
        let fault = options.fault.filter(|_| r == options.requests / 2);
        if let Err(error) = one_request(
            r, h, &pair, &mut ranks, &mut rng, deadline, fault, &mut tally,
        ) {
            tally.error(format!("request {r}: {error}"));
        }
    }
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
                rank.side, rank.tp
            ));
        }
        if rank.route.pending() > 0 {
            tally.error(format!(
                "{} rank {}: {} filed writes were never posted",
                rank.side,
                rank.tp,
                rank.route.pending()
            ));
        }
        let _ = rank.conn.shutdown();
    }
    let bytes = match landed {
        Some(landed) => landed(),
        None => tally.sent_bytes,
    };
    drop(ranks);
    runtime.shutdown();
    Ok(report(
        options, &pair, &handoffs, tally, bytes, window, wall, transport,
    ))
}

/// What the run saw.
#[derive(Default)]
struct Tally {
    ready: u64,
    failed: u64,
    decode_missing: u64,
    sent: u64,
    released: u64,
    prefill_missing: u64,
    verified: u64,
    byte_errors: u64,
    races: Races,
    call_order: Races,
    prefill_events: u64,
    decode_events: u64,
    duplicates: u64,
    unknown: u64,
    leaks: Leaks,
    sent_bytes: u64,
    sub_requests: u64,
    descriptors: u64,
    prefill_jobs: u64,
    decode_jobs: u64,
    zeroed: u64,
    latencies_us: Vec<f64>,
    timed_out: bool,
    errors: Vec<String>,
}

impl Tally {
    fn error(&mut self, error: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(error);
        }
    }
}

/// How one rank's part of a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Ready,
    Failed,
    Sent,
    Released,
}

/// Runs request `r` over every rank (see the module documentation).
#[allow(clippy::too_many_arguments)]
fn one_request(
    r: usize,
    h: &mut Handoff,
    pair: &PairPlan,
    ranks: &mut [Rank],
    rng: &mut rand_chacha::ChaCha8Rng,
    deadline: Instant,
    fault: Option<HeteroFault>,
    tally: &mut Tally,
) -> Result<(), String> {
    let request = RequestId::new(format!("req-{r}")).map_err(|e| e.to_string())?;
    let key = PairingKey::from_request_id(&request);
    h.check_no_overlap().map_err(|e| e.to_string())?;
    h.run_prefill_jobs().map_err(|e| e.to_string())?;
    for rank in ranks.iter() {
        for (slot, space) in [Space::Kv, Space::Staging].into_iter().enumerate() {
            let bytes = &h.arenas[h.arena(rank.side, rank.index, space)].bytes;
            rank.regions[slot]
                .bytes
                .write(0, bytes)
                .map_err(|e| format!("{} rank {}: {e}", rank.side, rank.tp))?;
        }
    }
    file_routes(h, pair, ranks, &key, fault)?;
    tally.descriptors += h.plan.descriptors() as u64;

    // Every rank's call, in a seeded order.
    let mut order: Vec<usize> = (0..ranks.len()).collect();
    order.shuffle(rng);
    let abort = fault == Some(HeteroFault::DecodeAborts);
    if abort {
        // Every D rank registers first, so that the abort below comes before any write.
        order.sort_by_key(|&i| ranks[i].side == SideName::Prefill);
    }
    let mut called: BTreeMap<(SideName, u32), usize> = BTreeMap::new();
    let tokens = h.shape.tokens;
    for (turn, &i) in order.iter().enumerate() {
        if abort
            && ranks[i].side == SideName::Prefill
            && !called.keys().any(|k| k.0 == SideName::Prefill)
        {
            if let Some(rank) = ranks.iter_mut().find(|r| r.side == SideName::Decode) {
                if let Err(error) = rank.conn.abort(&request) {
                    tally.error(format!("request {r}: D rank {} abort: {error}", rank.tp));
                }
            }
        }
        let rank = &mut ranks[i];
        let result = match rank.side {
            SideName::Prefill => rank
                .conn
                .request_finished(
                    &request,
                    h.prefill_blocks.clone(),
                    tokens,
                    &KvTransferParams {
                        do_remote_decode: true,
                        ..KvTransferParams::default()
                    },
                )
                .map(|_| ()),
            SideName::Decode => rank.conn.request_allocated(
                &request,
                h.decode_blocks.clone(),
                tokens,
                &KvTransferParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(PREFILL.into()),
                    tp_size: Some(pair.prefill.spec.tp),
                    ..KvTransferParams::default()
                },
            ),
        };
        if let Err(error) = result {
            tally.error(format!(
                "request {r}: {} rank {}: {error}",
                rank.side, rank.tp
            ));
        }
        called.insert((rank.side, rank.tp), turn);
    }
    let both_called = Instant::now();
    for link in &pair.links {
        let p = pair.prefill.ranks[link.prefill].rank.tp;
        let d = pair.decode.ranks[link.decode].rank.tp;
        match (
            called.get(&(SideName::Prefill, p)),
            called.get(&(SideName::Decode, d)),
        ) {
            (Some(a), Some(b)) if b < a => tally.call_order.decode_registers_first += 1,
            (Some(_), Some(_)) => tally.call_order.prefill_finishes_first += 1,
            _ => {}
        }
    }
    tally.sub_requests += 2 * pair.links.len() as u64;

    // Every rank's one event.
    let mut ended: Vec<Option<Ended>> = vec![None; ranks.len()];
    while ended.iter().any(Option::is_none) && Instant::now() < deadline {
        let mut quiet = true;
        for (i, rank) in ranks.iter_mut().enumerate() {
            for event in rank.conn.poll_events() {
                quiet = false;
                let (id, end) = match &event {
                    ConnectorEvent::BlocksReady { request, blocks } => {
                        if *blocks != h.decode_blocks {
                            tally.error(format!("{request}: D's blocks came back changed"));
                        }
                        (request, Ended::Ready)
                    }
                    ConnectorEvent::Failed {
                        request, reason, ..
                    } => {
                        tally.error(format!("{request}: D rank {} failed: {reason:?}", rank.tp));
                        (request, Ended::Failed)
                    }
                    ConnectorEvent::BlocksFree {
                        request, released, ..
                    } => match released {
                        None => (request, Ended::Sent),
                        Some(cause) => {
                            tally.error(format!(
                                "{request}: P rank {} released unsent: {cause:?}",
                                rank.tp
                            ));
                            (request, Ended::Released)
                        }
                    },
                    other => {
                        tally.unknown += 1;
                        tally.error(format!(
                            "{} rank {}: unexpected {other:?}",
                            rank.side, rank.tp
                        ));
                        continue;
                    }
                };
                if *id != request {
                    tally.unknown += 1;
                } else if ended[i].is_some() {
                    tally.duplicates += 1;
                } else {
                    ended[i] = Some(end);
                }
            }
        }
        if quiet {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    tally
        .latencies_us
        .push(both_called.elapsed().as_secs_f64() * 1e6);
    let mut all_ready = true;
    let mut all_sent = true;
    let mut decode_missing = false;
    let mut prefill_missing = false;
    for (rank, end) in ranks.iter().zip(&ended) {
        match (rank.side, end) {
            (SideName::Decode, Some(Ended::Ready)) | (SideName::Prefill, Some(Ended::Sent)) => {}
            (SideName::Decode, Some(_)) => all_ready = false,
            (SideName::Prefill, Some(_)) => all_sent = false,
            (SideName::Decode, None) => {
                decode_missing = true;
                all_ready = false;
                tally.leaks.decode += h.decode_blocks.total() as u64;
            }
            (SideName::Prefill, None) => {
                prefill_missing = true;
                all_sent = false;
                tally.leaks.prefill += h.prefill_blocks.total() as u64;
            }
        }
    }
    // The report counts requests: a side's event is the request's once every rank of it had
    // its own.
    tally.decode_events += u64::from(!decode_missing);
    tally.prefill_events += u64::from(!prefill_missing);
    if decode_missing {
        tally.decode_missing += 1;
        tally.timed_out = true;
    } else if all_ready {
        tally.ready += 1;
    } else {
        tally.failed += 1;
    }
    if prefill_missing {
        tally.prefill_missing += 1;
        tally.timed_out = true;
    } else if all_sent {
        tally.sent += 1;
        tally.sent_bytes += h.plan.bytes();
    } else {
        tally.released += 1;
    }
    if !all_ready {
        return Err("not every D rank got its blocks".into());
    }

    // D's half, then every byte of both sides.
    for rank in ranks.iter() {
        for (slot, space) in [Space::Kv, Space::Staging].into_iter().enumerate() {
            let arena = h.arena(rank.side, rank.index, space);
            let bytes = &mut h.arenas[arena].bytes;
            rank.regions[slot]
                .bytes
                .read(0, bytes)
                .map_err(|e| format!("{} rank {}: {e}", rank.side, rank.tp))?;
        }
    }
    let stats = h.run_decode_side().map_err(|e| e.to_string())?;
    tally.prefill_jobs += stats.prefill_jobs as u64;
    tally.decode_jobs += stats.decode_jobs as u64;
    tally.zeroed += stats.zeroed_bytes;
    match h.verify() {
        Ok(()) => tally.verified += 1,
        Err(mismatch) => {
            tally.byte_errors += mismatch.wrong_bytes.max(1);
            tally.error(format!("request {r}: {mismatch}"));
        }
    }
    Ok(())
}

/// Files each link's pieces with its P rank's route, under the link's pair key, as addresses in
/// the two ranks' registered memory. Every link of the plan is filed, also one that moves
/// nothing in this request, so that each sub-request has its write.
fn file_routes(
    h: &Handoff,
    pair: &PairPlan,
    ranks: &[Rank],
    key: &PairingKey,
    fault: Option<HeteroFault>,
) -> Result<(), String> {
    let find = |side: SideName, index: usize| {
        ranks
            .iter()
            .find(|r| r.side == side && r.index == index)
            .ok_or_else(|| format!("no {side} rank {index}"))
    };
    let slot = |space: Space| usize::from(space == Space::Staging);
    let mut by_link: BTreeMap<usize, Vec<Descriptor>> =
        (0..pair.links.len()).map(|l| (l, Vec::new())).collect();
    for t in &h.plan.transfers {
        let link = &pair.links[t.link];
        let (p, d) = (
            find(SideName::Prefill, link.prefill)?,
            find(SideName::Decode, link.decode)?,
        );
        let (src, dst) = (&p.regions[slot(t.src_space)], &d.regions[slot(t.dst_space)]);
        let out = by_link.entry(t.link).or_default();
        for piece in &t.pieces {
            out.push(Descriptor {
                local_addr: src.base + piece.src,
                remote_addr: dst.base + piece.dst,
                len: piece.len,
            });
        }
    }
    match fault {
        Some(HeteroFault::UnfiledLink) => {
            by_link.remove(&0);
        }
        Some(HeteroFault::DecodeAborts) | None => {}
        Some(HeteroFault::ShiftedPiece) => {
            let row = pair.model.row_bytes();
            if let Some(d) = by_link.values_mut().find_map(|d| d.first_mut()) {
                d.remote_addr += row;
            }
        }
    }
    for (l, descriptors) in by_link {
        let link = &pair.links[l];
        let p = find(SideName::Prefill, link.prefill)?;
        let d = find(SideName::Decode, link.decode)?;
        let pair_key = key.for_pair(p.tp, d.tp).map_err(|e| e.to_string())?;
        p.route
            .file(
                pair_key,
                h.prefill_blocks.clone(),
                h.decode_blocks.clone(),
                descriptors,
            )
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn report(
    options: &HeteroDemoOptions,
    pair: &PairPlan,
    handoffs: &[Handoff],
    t: Tally,
    bytes: u64,
    window: Duration,
    wall: Instant,
    transport: &str,
) -> DemoReport {
    let mut latencies = t.latencies_us.clone();
    latencies.sort_by(f64::total_cmp);
    let m = pair.model;
    let spec = pair.prefill.spec;
    let summary = HeteroSummary {
        model: m.name.into(),
        prefill: spec.to_string(),
        decode: pair.decode.spec.to_string(),
        prefill_ranks: pair.prefill.ranks.len() as u32,
        decode_ranks: pair.decode.ranks.len() as u32,
        links: pair.links.len() as u32,
        idle_prefill_ranks: pair.idle_prefill_ranks().len() as u32,
        sub_requests: t.sub_requests,
        descriptors: t.descriptors,
        prefill_jobs: t.prefill_jobs,
        decode_jobs: t.decode_jobs,
        zeroed_bytes: t.zeroed,
        transforms: pair
            .pipeline
            .transforms
            .iter()
            .map(|x| format!("{} {}: {}", x.kind.label(), x.runs_on.label(), x.reason))
            .collect(),
    };
    let mut report = DemoReport {
        transport: transport.into(),
        mode: "push".into(),
        pulled: 0,
        role: ReportRole::Both,
        seed: options.seed,
        requests: handoffs.len() as u64,
        verified: t.verified,
        byte_errors: t.byte_errors,
        races: t.races,
        call_order: t.call_order,
        outcomes: Outcomes {
            ready: t.ready,
            failed: t.failed,
            missing: t.decode_missing,
        },
        prefill_outcomes: PrefillOutcomes {
            sent: t.sent,
            released: t.released,
            missing: t.prefill_missing,
        },
        bytes,
        expected_bytes: handoffs.iter().map(|h| h.plan.bytes()).sum(),
        tokens: handoffs.iter().map(|h| h.shape.tokens).sum(),
        blocks: handoffs
            .iter()
            .map(|h| h.prefill_blocks.total() as u64)
            .sum(),
        gbps: if window.is_zero() {
            0.0
        } else {
            bytes as f64 / window.as_secs_f64() / 1e9
        },
        handoff_window_ms: window.as_secs_f64() * 1e3,
        handoff_latency_us: Latency {
            p50: percentile(&latencies, 50.0),
            p99: percentile(&latencies, 99.0),
            max: latencies.last().copied().unwrap_or(0.0),
        },
        wall_ms: wall.elapsed().as_secs_f64() * 1e3,
        events: EventCounts {
            prefill: t.prefill_events,
            decode: t.decode_events,
            duplicates: t.duplicates,
            unknown: t.unknown,
        },
        turns: TurnCounts::default(),
        double_frees: 0,
        leaked_blocks: t.leaks,
        pool_blocks: handoffs
            .iter()
            .map(|h| {
                h.prefill_memory
                    .pool_blocks
                    .max(h.decode_memory.pool_blocks)
            })
            .max()
            .unwrap_or(0),
        geometry: GeometrySummary {
            layers: m.num_layers,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            dtype_bytes: m.dtype_bytes,
            block_tokens: spec.block,
            layout: format!(
                "P {} -> D {}",
                kvhandoff_protocol::hetero::layout_name(spec.layout),
                kvhandoff_protocol::hetero::layout_name(pair.decode.spec.layout)
            ),
            block_bytes: m.row_bytes()
                * u64::from(m.kv_heads)
                * 2
                * u64::from(m.num_layers)
                * spec.logical_block(),
        },
        timed_out: t.timed_out,
        errors: t.errors,
        ok: false,
        verdict: String::new(),
        hetero: Some(Box::new(summary)),
    };
    report.ok = report.verdict_ok();
    report.verdict = report.verdict_line();
    report
}
