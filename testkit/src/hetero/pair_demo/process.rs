//! One rank of a heterogeneous pair as a process of its own (`kvhandoff node --model M
//! --prefill SPEC --decode SPEC --role R --rank N`), over NIXL, the way an engine runs one
//! worker per rank.
//!
//! Every process plans the same requests from the same seed (their prompts, prefix hits and
//! block ids: what a router and two engines would agree on) and holds only its own rank: its KV
//! tensors and its staging buffer per slot of the window, registered with its own NIXL agent,
//! and its own TCP side channel at its engine's base port + its rank index. What crosses the
//! process boundary is the protocol's: the handshake (each rank's geometry, and that it is
//! routed), D's registration with its block ids and the buffers it names
//! ([`Register::memory`](kvhandoff_protocol::Register::memory)), P's writes placed there at post
//! time (after P checked that D registered the blocks the request was planned for), and the
//! notifications. D runs its staging jobs and tail zeroing on its own rank after `BlocksReady`
//! and checks every byte of its rank in its own geometry; P checks that its memory did not
//! change.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvhandoff::{EngineRank, RankBuilder, Runtime, TransportKind};
use kvhandoff_protocol::hetero::{PairPlan, SideName};
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::{EngineId, PeerAddr};
use serde::Serialize;

use super::flight::{self, Pace, Placing, Rank};
use super::router::RouterClient;
use super::{
    model_identity, planned, rank_port, side_channel, slot_memory, HeteroDemoOptions, Tally,
    DECODE, PREFILL,
};
use crate::demo::{start_error, DemoError, DemoTransport, Leaks};

/// How often a D rank tries its P ranks' side channels while they start.
const WARM_RETRY: Duration = Duration::from_millis(100);

/// Which rank this process is, and where both engines listen.
#[derive(Debug, Clone, PartialEq)]
pub struct RankProcess {
    /// Its engine.
    pub side: SideName,
    /// Its rank index in its engine (`pp_rank × tp + tp_rank`).
    pub rank: u32,
    /// P's base side-channel address: P's rank `r` listens on its port + `r`.
    pub prefill_base: SocketAddr,
    /// D's, the same way.
    pub decode_base: SocketAddr,
    /// How long P stays after its last request ended, so that D hears every notification
    /// before P's agent goes away.
    pub linger: Duration,
    /// Run requests `start_at..` of the plan (a restarted rank continues its predecessor's).
    pub start_at: usize,
    /// Request `start_at + n` starts no earlier than `n × gap` after this rank met its peers.
    pub gap: Duration,
    /// A peer may die during the run (a survivor of a kill): the rank is ok when every request
    /// it started had exactly one typed outcome, no byte is wrong and every block is back,
    /// even if requests failed.
    pub expect_peer_loss: bool,
    /// The protocol's configuration (timing: heartbeat, lease, D's deadline).
    pub config: Config,
    /// The side channel's pre-shared key: every handshake authenticated with it, and refused
    /// by a peer with another key or none.
    pub psk: Option<kvhandoff::Psk>,
    /// The pair's router (`kvhandoff router`), which pull and read-backs need and push may use:
    /// P tells it each answer, D starts a request only once the router handed it P's (and the
    /// other way for a read-back).
    pub router: Option<SocketAddr>,
    /// With `bidir`, how long D's ranks keep each turn for its read-back (a survivor of a kill
    /// gets a short one: the turns a dead P rank never reads end within the run).
    pub keep_ttl: Duration,
}

/// What one rank's process did.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// `"nixl"`.
    pub transport: String,
    /// `"prefill"` or `"decode"`.
    pub engine: String,
    /// Its rank index in its engine.
    pub rank: u32,
    /// The pair: model and both sides' specs.
    pub pair: String,
    /// Requests of the run.
    pub requests: u64,
    /// D: requests whose every byte of this rank checked out; P: requests whose every link's
    /// write landed.
    pub done: u64,
    /// D: requests whose blocks came (`BlocksReady`); P: 0.
    pub ready: u64,
    /// Requests that ended otherwise on this rank (D failed, P released unsent).
    pub failed: u64,
    /// Requests without an event on this rank at the end.
    pub missing: u64,
    /// The first request this rank ran (`--start-at`).
    pub start_at: u64,
    /// Its events by typed outcome.
    pub outcomes: std::collections::BTreeMap<String, u64>,
    /// Whether a peer was expected to die (the verdict then asks for typed outcomes, not for
    /// every request done).
    pub expect_peer_loss: bool,
    /// Bytes this rank's memory holds wrongly.
    pub byte_errors: u64,
    /// Blocks of requests that never had their event on this rank.
    pub leaked_blocks: u64,
    /// Handshakes this rank's side channel refused, by reason (a peer of a geometry the pair's
    /// plan does not have: `incompatible`), and its own that failed.
    pub handshakes_refused: std::collections::BTreeMap<String, u64>,
    /// Its own handshakes that failed, by reason.
    pub handshakes_failed: std::collections::BTreeMap<String, u64>,
    /// Peers this rank's endpoint declared dead (silence, loss, or a restart).
    pub peer_deaths: u64,
    /// With `bidir`: the next turns' read-back (P: read back and checked; D: keeps read).
    pub read_back: Option<crate::demo::TurnCounts>,
    /// Whether the run passed its limit.
    pub timed_out: bool,
    /// The first errors.
    pub errors: Vec<String>,
    /// The whole process's time.
    pub wall_ms: f64,
    /// Every request done, nothing wrong, nothing leaked.
    pub ok: bool,
    /// One line.
    pub verdict: String,
}

impl RankReport {
    /// The report as a few lines of text.
    pub fn render_table(&self) -> String {
        let mut out = format!(
            "kvhandoff node: {} rank {} of {} over {}\n  requests  {}   done {}   failed {}   \
             no event {}\n  bytes     {} wrong   leaked blocks {}   {:.0} ms\n",
            self.engine,
            self.rank,
            self.pair,
            self.transport,
            self.requests,
            self.done,
            self.failed,
            self.missing,
            self.byte_errors,
            self.leaked_blocks,
            self.wall_ms
        );
        for (reason, n) in &self.handshakes_refused {
            out.push_str(&format!("  handshakes refused: {n} {reason}\n"));
        }
        for error in &self.errors {
            out.push_str(&format!("  error: {error}\n"));
        }
        out.push_str(&self.verdict);
        out.push('\n');
        out
    }
}

/// Runs rank `process` of the pair `options` names until every request ended on it, or the
/// options' timeout.
///
/// # Errors
/// [`DemoError::Options`] for options the demo refuses, a rank the pair does not have, or the
/// in-memory transport (one process only); [`DemoError::NoNixl`] /
/// [`DemoError::NixlUnavailable`]; a rank that cannot start. A run that starts and goes wrong
/// returns a report that is not ok.
pub fn run_rank(
    options: &HeteroDemoOptions,
    process: &RankProcess,
) -> Result<RankReport, DemoError> {
    let wall = Instant::now();
    if options.transport != DemoTransport::Nixl {
        return Err(DemoError::Options(
            "a rank in a process of its own needs --transport nixl (the in-memory fabric is one \
             process's)"
                .into(),
        ));
    }
    let run = planned(options)?;
    let layout = match process.side {
        SideName::Prefill => &run.pair.prefill,
        SideName::Decode => &run.pair.decode,
    };
    let Some(index) = layout
        .ranks
        .iter()
        .position(|r| r.geometry.rank_index() == process.rank)
    else {
        return Err(DemoError::Options(format!(
            "{} {} has {} ranks: no rank {}",
            process.side,
            layout.spec,
            layout.ranks.len(),
            process.rank
        )));
    };
    let kind = nixl_kind()?;
    let geometry = layout.ranks[index].geometry.clone();
    let lens = run
        .lens
        .iter()
        .find(|(at, _)| *at == (process.side, index))
        .map(|(_, lens)| *lens)
        .ok_or_else(|| DemoError::Options("no memory planned for the rank".into()))?;
    let (own_engine, own_base, p_base) = match process.side {
        SideName::Prefill => (PREFILL, process.prefill_base, process.prefill_base),
        SideName::Decode => (DECODE, process.decode_base, process.prefill_base),
    };
    let engine = EngineId::new(own_engine).map_err(|e| DemoError::Options(e.to_string()))?;
    let mut runtime = Runtime::start()?;
    let started = RankBuilder::new(engine, geometry.clone(), model_identity(&run.pair))
        .regions(slot_memory(lens, options.window)?)
        .transport(kind)
        .config(process.config.clone())
        .pairing(run.pair.clone(), process.side)
        .side_channel(match process.psk.clone() {
            Some(psk) => side_channel(process.side, rank_port(own_base, &geometry)?)?.with_psk(psk),
            None => side_channel(process.side, rank_port(own_base, &geometry)?)?,
        })
        .start_on(&mut runtime)
        .map_err(start_error)?;
    let deadline = Instant::now() + options.timeout;
    let mut tally = Tally::default();
    let router = match process.router {
        Some(addr) => Some(RouterClient::connect(
            addr,
            own_engine,
            process.rank,
            process.start_at,
            deadline,
        )?),
        None if options.pull || options.mixed || options.bidir => {
            return Err(DemoError::Options(
                "a pair's ranks pull and read back across processes through a router: --router"
                    .into(),
            ))
        }
        // A push without a router: each side derives the other's parameters from the plan.
        None => None,
    };
    if process.side == SideName::Decode {
        if let Err(why) = meet_prefill(&started, &run.pair, index, p_base, deadline) {
            tally.error(why);
        }
    }
    let route = started
        .route()
        .cloned()
        .ok_or_else(|| DemoError::Options("the rank has no route".into()))?;
    let (conn, kv, _) = started.into_parts();
    let mut ranks = vec![Rank {
        side: process.side,
        index,
        id: process.rank,
        conn,
        kv,
        route,
        remote: (process.side == SideName::Decode).then_some(p_base),
    }];
    let shared: Vec<flight::Shared> = run
        .handoffs
        .into_iter()
        .map(|h| Arc::new(std::sync::Mutex::new(h)))
        .collect();
    let met = tally.errors.is_empty();
    eprintln!(
        "kvhandoff node: {} rank {} {}; running the schedule (requests {}..{})",
        process.side,
        process.rank,
        if met {
            "is up"
        } else {
            "did not meet its peers"
        },
        process.start_at,
        shared.len()
    );
    if met {
        flight::run_all(
            &shared,
            &run.pair,
            &mut ranks,
            options.window,
            options.seed ^ 0x5eed_ca11,
            None,
            Placing::AtPost,
            &run.pulled,
            None,
            router.as_ref(),
            Pace {
                first: process.start_at,
                gap: process.gap,
            },
            &mut |_| false,
            deadline,
            &mut tally,
        );
    }
    let requests_of_run = shared.len() as u64;
    let read_back = match (met, run.read_back) {
        (true, Some((reversed, back))) => {
            if let Some(router) = &router {
                // The next turns are the router's requests after the first turns'.
                router.set_offset(requests_of_run);
            }
            let turn = super::ReadBack {
                reversed: &reversed,
                back,
                placing: Placing::AtPost,
                router: router.as_ref(),
                first: process.start_at,
                keep: process.keep_ttl,
            };
            Some(super::read_back_turns(
                options, turn, &mut ranks, deadline, &mut tally,
            ))
        }
        (_, _) => None,
    };
    if process.side == SideName::Prefill {
        // D may still be taking the last notifications: P's agent stays up a while.
        std::thread::sleep(
            process
                .linger
                .min(deadline.saturating_duration_since(Instant::now())),
        );
    }
    let requests = shared.len().saturating_sub(process.start_at) as u64;
    if !met {
        // No request started: each is one without an event here.
        tally.decode_missing = requests;
    }
    let stats = side_channel_stats(&ranks);
    let peer_deaths = ranks
        .first()
        .and_then(|r| crate::demo::query_counters(&r.conn.rank().rank))
        .map_or(0, |c| c.peers_declared_dead);
    for rank in &mut ranks {
        if rank.route.pending() > 0 {
            tally.error(format!(
                "{} rank {}: {} filings never used",
                rank.side,
                rank.id,
                rank.route.pending()
            ));
        }
        let _ = rank.conn.shutdown();
    }
    drop(ranks);
    runtime.shutdown();
    let mut report = report(options, &run.pair, process, requests, tally, wall);
    report.peer_deaths = peer_deaths;
    if let Some(turns) = read_back {
        // P reads every request back and checks it; D's every keep is read.
        let all = match process.side {
            SideName::Prefill => turns.read_back_verified == requests,
            SideName::Decode => turns.kept_read == requests,
        };
        if report.ok && !all && !process.expect_peer_loss {
            report.ok = false;
            report.verdict = format!(
                "verdict: FAILED — {} rank {}: read-back {} of {requests} ({} kept read)",
                report.engine, process.rank, turns.read_back_verified, turns.kept_read
            );
        }
        report.read_back = Some(turns);
    }
    if let Some(stats) = stats {
        let named =
            |counts: &std::collections::BTreeMap<kvhandoff_actors::system::RejectReason, u64>| {
                counts
                    .iter()
                    .map(|(reason, n)| (reason.label().to_string(), *n))
                    .collect()
            };
        report.handshakes_refused = named(&stats.rejected);
        report.handshakes_failed = named(&stats.outgoing_failed);
    }
    Ok(report)
}

/// The side channel's counts of the rank held here.
fn side_channel_stats(ranks: &[Rank]) -> Option<kvhandoff::SideChannelStats> {
    let rank = ranks.first()?;
    kvhandoff_actors::system::blocking::ask(
        &rank.conn.rank().link,
        kvhandoff_actors::system::QuerySideChannel,
        Duration::from_secs(5),
    )
}

#[cfg(feature = "nixl")]
fn nixl_kind() -> Result<TransportKind, DemoError> {
    kvhandoff_actors::transport::nixl::nixl_runtime_available()
        .map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
    Ok(TransportKind::nixl())
}

#[cfg(not(feature = "nixl"))]
fn nixl_kind() -> Result<TransportKind, DemoError> {
    Err(DemoError::NoNixl)
}

/// D: hands every P rank that writes to D rank `index` its handshake, retrying while they
/// start, so that the first request does not find a P rank not listening yet.
fn meet_prefill(
    rank: &EngineRank,
    pair: &PairPlan,
    index: usize,
    p_base: SocketAddr,
    deadline: Instant,
) -> Result<(), String> {
    let prefill = EngineId::new(PREFILL).map_err(|e| e.to_string())?;
    for link in pair.links.iter().filter(|l| l.decode == index) {
        let p = pair.prefill.ranks[link.prefill].geometry.rank_index();
        let peer = PeerAddr::new(prefill.clone(), p);
        let at = rank_port(p_base, &pair.prefill.ranks[link.prefill].geometry)
            .map_err(|e| e.to_string())?;
        rank.add_peer_rank(&peer, at).map_err(|e| e.to_string())?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rank.warm_up(&peer, left.min(Duration::from_secs(5))) {
                Ok(()) => break,
                Err(error) if left <= WARM_RETRY => {
                    return Err(format!("P rank {p} at {p_base} + {p}: {error}"));
                }
                Err(_) => std::thread::sleep(WARM_RETRY),
            }
        }
    }
    Ok(())
}

fn report(
    options: &HeteroDemoOptions,
    pair: &PairPlan,
    process: &RankProcess,
    requests: u64,
    t: Tally,
    wall: Instant,
) -> RankReport {
    let (done, ready, failed, missing, leaked) = match process.side {
        SideName::Decode => (
            t.verified,
            t.ready,
            t.failed,
            t.decode_missing,
            t.leaks.decode,
        ),
        SideName::Prefill => (t.sent, 0, t.released, t.prefill_missing, t.leaks.prefill),
    };
    // Every request has its one event here, nothing wrong, nothing leaked; and unless a peer
    // was expected to die, every request done without an error.
    let accounted = !t.timed_out
        && missing == 0
        && done + failed == requests
        && t.byte_errors == 0
        && t.duplicates == 0
        && t.unknown == 0
        && t.leaks == Leaks::default();
    let ok = accounted && (process.expect_peer_loss || (t.errors.is_empty() && done == requests));
    let engine = match process.side {
        SideName::Prefill => PREFILL,
        SideName::Decode => DECODE,
    };
    let verdict = if ok {
        format!(
            "verdict: OK — {engine} rank {}: {done}/{requests} requests {}, 0 byte errors",
            process.rank,
            if process.side == SideName::Decode {
                "verified"
            } else {
                "sent"
            }
        )
    } else {
        format!(
            "verdict: FAILED — {engine} rank {}: {done}/{requests} done, {failed} failed, \
             {missing} without an event, {} byte errors, {leaked} leaked blocks{}{}",
            process.rank,
            t.byte_errors,
            if t.timed_out { "; timed out" } else { "" },
            t.errors
                .first()
                .map_or(String::new(), |e| format!("; first error: {e}"))
        )
    };
    RankReport {
        transport: "nixl".into(),
        engine: engine.into(),
        rank: process.rank,
        pair: format!(
            "{}: P {} -> D {}",
            options.model, pair.prefill.spec, pair.decode.spec
        ),
        requests,
        done,
        ready,
        failed,
        missing,
        start_at: process.start_at as u64,
        outcomes: t.outcomes.clone(),
        expect_peer_loss: process.expect_peer_loss,
        byte_errors: t.byte_errors,
        leaked_blocks: leaked,
        handshakes_refused: std::collections::BTreeMap::new(),
        handshakes_failed: std::collections::BTreeMap::new(),
        peer_deaths: 0,
        read_back: None,
        timed_out: t.timed_out,
        errors: t.errors,
        wall_ms: wall.elapsed().as_secs_f64() * 1e3,
        ok,
        verdict,
    }
}
