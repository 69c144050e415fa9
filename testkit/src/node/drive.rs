//! Running a node: the rank, the meeting with the peer, the role's engine loop, the reports.

use std::time::{Duration, Instant};

use kvhandoff_actors::system::{blocking::ask, ShellConfig};
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::EngineId;
use kvhandoff_protocol::PeerAddr;

use super::facts::{
    decode_ends, lateness, prefill_ends, push, summary, FactsInput, Outcome, UnixClock,
};
use super::rank::{self, NodeRank, RankSpec};
use super::router::RouterGuard;
use super::router::{decode_side, prefill_side};
use super::wait::{await_decode, await_exit, await_prefill, side_channel, DeathWatch};
use super::{
    AddPeerAddress, LinkSummary, NodeOptions, NodeReport, NodeRole, NodeRun, PrefillReport,
};
use crate::demo::{
    self, build_report, check_options, query_counters, races_of, run_decode, run_prefill, schedule,
    turn_counts, turn_settings, DecodeLink, DecodeRun, DemoError, DemoMode, Facts, Pacing, Planned,
    PrefillLink, PrefillOutcomes, PrefillRun, Races, Tallies, TurnSettings, Workload,
    DECODE_ENGINE, PREFILL_ENGINE,
};
use crate::hooks::{Repeater, StopAfter};
use kvhandoff::{KvTransferParams, TransportKind};

/// The part of `plan` a node runs: requests `start_at..`, with arrivals shifted so that the
/// first arrives at the node's time zero (and the turns of conversations renumbered; a turn
/// whose turn before is not in the part starts its conversation here).
pub(super) fn part_of(plan: &[Planned], start_at: usize) -> Vec<Planned> {
    let Some(first) = plan.get(start_at) else {
        return Vec::new();
    };
    let zero = first.arrival;
    plan[start_at..]
        .iter()
        .map(|q| Planned {
            arrival: q.arrival.saturating_sub(zero),
            prev: q.prev.and_then(|i| i.checked_sub(start_at)),
            prefix_tokens: if q.prev.is_some_and(|i| i >= start_at) {
                q.prefix_tokens
            } else {
                0
            },
            next: q.next.map(|i| i - start_at),
            ..q.clone()
        })
        .collect()
}

/// What both roles' halves of a run share once the node met its peer.
struct Run<'a> {
    options: &'a NodeOptions,
    transport: &'static str,
    workload: Workload,
    plan: Vec<Planned>,
    config: Config,
    clock: UnixClock,
    wall: Instant,
    /// The schedule's time zero.
    start: Instant,
    deadline: Instant,
    pacing: Pacing,
    turns: TurnSettings,
    stop_after: StopAfter,
    /// Where the side channel listens, and how long the node waited for its peer.
    listen: std::net::SocketAddr,
    listening_ms: f64,
    waited_ms: f64,
    errors: Vec<String>,
}

impl Run<'_> {
    fn facts(&self) -> FactsInput<'_> {
        FactsInput {
            options: self.options,
            config: &self.config,
            clock: self.clock,
            start: self.start,
        }
    }
}

/// The router link's two ends: this node's, and the guard that closes it.
#[derive(Default)]
struct Links {
    prefill: Option<PrefillLink>,
    decode: Option<DecodeLink>,
    guard: Option<RouterGuard>,
}

/// What the halves hand back to the runtime once their loop ended.
struct Live {
    node: NodeRank,
    watch: DeathWatch,
    repeater: Repeater,
    links: Links,
}

/// Runs one node whose rank is built by [`kvhandoff::RankBuilder`] on memory the node
/// allocates itself, as an engine would ([`engine_memory`](crate::demo::engine_memory)), over `kind` (the report names it
/// `"mem"` or `"nixl"`): on NIXL the node's own buffers are registered in place, P fills its
/// blocks and D checks what P wrote into its blocks through the rank's
/// [`KvCache`](kvhandoff::KvCache). The node prints where its KV memory is on stderr
/// ([`NodeMemory::describe`](super::NodeMemory::describe)).
///
/// # Errors
/// [`DemoError`] when the node cannot start: bad options, a transport or rank that cannot be
/// built, a side channel that cannot listen. A node that starts and goes wrong (the peer never
/// came, a request failed) returns a report whose verdict is FAILED.
pub fn run_full_on(options: &NodeOptions, kind: TransportKind) -> Result<NodeRun, DemoError> {
    let wall = Instant::now();
    let clock = UnixClock::now();
    let ranked = options.for_rank()?;
    let options = &ranked;
    let opts = &options.schedule;
    let deadline = wall + opts.timeout;
    let mut workload = check_options(opts)?;
    workload.geometry.tp_size = options.tp;
    workload.geometry.tp_rank = options.rank;
    workload.block_bytes = workload
        .geometry
        .logical_block_bytes(0)
        .map_err(|e| DemoError::Options(e.to_string()))?;
    let router = router_addr(options)?;
    let whole = schedule(opts, workload.block_tokens)?;
    if options.start_at >= whole.len() {
        return Err(DemoError::Options(format!(
            "start_at {} is not below requests {}",
            options.start_at,
            whole.len()
        )));
    }
    let plan = part_of(&whole, options.start_at);
    let config = options.timing.config().map_err(DemoError::Options)?;
    // D listens on the router link before anything else, so that P finds it at once.
    let links = open_links(options, router, plan.len(), deadline)?;
    let (own, other) = engines(options.role)?;
    let node = rank::start(
        RankSpec {
            own: &own,
            geometry: &workload.geometry,
            pool_blocks: opts.pool_blocks,
            config: &config,
            shell: ShellConfig {
                poll_interval: opts.poll_interval,
                ..ShellConfig::default()
            },
            listen: options.listen,
            psk: options.psk.clone(),
        },
        kind,
    )?;
    let listening_ms = wall.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "kvhandoff node: {own} listening on {}, peer {other} at {}",
        node.listen, options.peer
    );
    eprintln!("{}", node.memory.describe(&own));
    let watch = DeathWatch::start(node.rank.clone());
    let added = ask(
        &node.link,
        AddPeerAddress {
            peer: PeerAddr::new(other.clone(), options.rank),
            addr: options.peer,
        },
        Duration::from_secs(5),
    );
    if !matches!(added, Some(Ok(()))) {
        return Err(DemoError::Options(format!(
            "the link did not take the peer's address {}",
            options.peer
        )));
    }
    let mut errors = Vec::new();
    let met = match options.role {
        NodeRole::Decode => await_prefill(
            &node.link,
            options.peer,
            &PeerAddr::new(other.clone(), options.rank),
            deadline,
        ),
        NodeRole::Prefill => await_decode(&node.link, deadline),
    };
    // The schedule's time zero: when P saw the handshake complete (D's estimate of it on D).
    let start = met.unwrap_or_else(|why| {
        errors.push(why);
        Instant::now()
    });
    let waited_ms = (Instant::now() - wall).as_secs_f64() * 1e3;
    eprintln!(
        "kvhandoff node: {own} met {other} after {waited_ms:.0} ms; running the schedule \
         (requests {}..{})",
        options.start_at,
        whole.len()
    );
    let repeater = repeater(options, &node, &other, (start, deadline));
    let run = Run {
        options,
        transport: node.memory.transport,
        workload,
        plan,
        config,
        clock,
        wall,
        start,
        deadline,
        // Conversations follow P's reports (a later turn's time is not on any clock); the
        // other modes both sides' clocks.
        pacing: match opts.mode {
            DemoMode::Bidir => Pacing::Router,
            _ => Pacing::Clock { hold: options.hold },
        },
        turns: turn_settings(opts),
        stop_after: stop_after(options),
        listen: node.listen,
        listening_ms,
        waited_ms,
        errors,
    };
    let live = Live {
        node,
        watch,
        repeater,
        links,
    };
    Ok(match options.role {
        NodeRole::Decode => run_decode_role(run, live),
        NodeRole::Prefill => run_prefill_role(run, live),
    })
}

/// The router link's address, which every mode but push needs.
fn router_addr(options: &NodeOptions) -> Result<Option<std::net::SocketAddr>, DemoError> {
    // A pulled request needs P's answer (its block ids) at D, and a conversation's next turn
    // D's answer at P: they travel over the router link.
    match (options.schedule.mode, options.router) {
        (DemoMode::Push, _) => Ok(None),
        (_, Some(addr)) => Ok(Some(addr)),
        (mode, None) => Err(DemoError::Options(format!(
            "--mode {} needs the router link's address (--router)",
            mode.name()
        ))),
    }
}

/// Opens this role's end of the router link (D listens, P connects), if there is one.
fn open_links(
    options: &NodeOptions,
    router: Option<std::net::SocketAddr>,
    requests: usize,
    deadline: Instant,
) -> Result<Links, DemoError> {
    let Some(addr) = router else {
        return Ok(Links::default());
    };
    Ok(match options.role {
        NodeRole::Decode => {
            let (link, g) = decode_side(addr, options.start_at, requests).map_err(|e| {
                DemoError::Options(format!("the router link cannot listen on {addr}: {e}"))
            })?;
            Links {
                decode: Some(link),
                guard: Some(g),
                ..Links::default()
            }
        }
        NodeRole::Prefill => {
            let (link, g) = prefill_side(addr, options.start_at, requests, deadline);
            Links {
                prefill: Some(link),
                guard: Some(g),
                ..Links::default()
            }
        }
    })
}

/// This node's engine and its peer's.
fn engines(role: NodeRole) -> Result<(EngineId, EngineId), DemoError> {
    let id = |name| EngineId::new(name).map_err(|e| DemoError::Options(e.to_string()));
    Ok(match role {
        NodeRole::Prefill => (id(PREFILL_ENGINE)?, id(DECODE_ENGINE)?),
        NodeRole::Decode => (id(DECODE_ENGINE)?, id(PREFILL_ENGINE)?),
    })
}

/// TEST HOOK: the request after which the node stops itself (never without `test-hooks`).
fn stop_after(options: &NodeOptions) -> StopAfter {
    #[cfg(feature = "test-hooks")]
    {
        StopAfter::at(
            options
                .stop_self_after
                .and_then(|k| k.checked_sub(options.start_at)),
        )
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = options;
        StopAfter::NEVER
    }
}

/// TEST HOOK: the thread that repeats this rank's handshake to the peer (none without
/// `test-hooks`, or when not asked for).
fn repeater(
    options: &NodeOptions,
    node: &NodeRank,
    other: &EngineId,
    (start, deadline): (Instant, Instant),
) -> Repeater {
    #[cfg(feature = "test-hooks")]
    if let Some(after) = options.repeat_handshake_after {
        return Repeater::start(
            node.link.clone().recipient(),
            node.info.clone(),
            PeerAddr::new(other.clone(), options.rank),
            options.peer,
            (start + after).min(deadline),
        );
    }
    let _ = (options, node, other, start, deadline);
    Repeater::NONE
}

/// D's half: the decode loop on the node's rank, then its report.
fn run_decode_role(mut run: Run<'_>, live: Live) -> NodeRun {
    let Live {
        node,
        watch,
        repeater,
        mut links,
    } = live;
    let options = run.options;
    let side = run_decode(
        node.conn,
        node.kv,
        &run.plan,
        DecodeRun {
            start: run.start,
            deadline: run.deadline,
            pacing: run.pacing,
            link: links.decode.take(),
            answer_wait: Some(run.config.decode_deadline),
            turns: run.turns,
            stop_after: run.stop_after,
            params: KvTransferParams {
                do_remote_prefill: true,
                remote_engine_id: Some(PREFILL_ENGINE.into()),
                remote_host: Some(options.peer.ip().to_string()),
                // P's base (rank 0) port: the session adds the rank it pairs with.
                remote_port: Some(
                    options
                        .peer
                        .port()
                        .saturating_sub(u16::try_from(options.rank).unwrap_or(u16::MAX)),
                ),
                tp_size: Some(options.tp),
                ..KvTransferParams::default()
            },
        },
    );
    drop(links.guard.take());
    let counters = query_counters(&node.rank);
    let deaths = watch.finish();
    let mut errors = std::mem::take(&mut run.errors);
    errors.extend(side.errors);
    repeater.join(&mut errors);
    let block_bytes = run.workload.block_bytes;
    let bytes = run
        .plan
        .iter()
        .zip(&side.records)
        .filter(|(_, r)| r.ready)
        .map(|(q, _)| q.blocks as u64 * block_bytes)
        .sum();
    drop(node.rank);
    node.runtime.shutdown();
    let (ends, explained) = decode_ends(&run.plan, &side.records, options.start_at, run.clock);
    let facts = run.facts().build(Outcome {
        ends,
        explained,
        errors: &errors,
        free: &side.free,
        pool_blocks: options.schedule.pool_blocks,
        counters: counters.as_ref(),
        deaths,
        timed_out: side.timed_out,
    });
    let report = NodeReport::Decode(build_report(
        Facts {
            options: &options.schedule,
            transport: run.transport,
            workload: &run.workload,
            plan: &run.plan,
            prefill: None,
            decode: &side.records,
        },
        Tallies {
            races: Races::default(),
            bytes,
            errors,
            timed_out: side.timed_out,
            double_frees: side.free.double_frees,
            bad_ids: side.free.bad_ids,
            leaks: demo::Leaks {
                prefill: 0,
                decode: side.free.in_use(),
            },
            duplicates: side.duplicates,
            unknown: side.unknown,
            wall: run.wall,
        },
    ));
    NodeRun {
        report,
        node: facts,
    }
}

/// P's half: the prefill loop on the node's rank, the wait for D's exit, then its report.
fn run_prefill_role(mut run: Run<'_>, live: Live) -> NodeRun {
    let Live {
        node,
        watch,
        repeater,
        mut links,
    } = live;
    let options = run.options;
    let side = run_prefill(
        node.conn,
        node.kv,
        &run.plan,
        PrefillRun {
            start: run.start,
            deadline: run.deadline,
            corrupt: options
                .schedule
                .corrupt_one_request
                .then_some(run.plan.len() / 2),
            pacing: run.pacing,
            link: links.prefill.take(),
            turns: run.turns,
            answer_wait: Some(run.config.decode_deadline),
            stop_after: run.stop_after,
        },
    );
    let peer_exited = await_exit(
        options.peer,
        (Instant::now() + options.linger).min(run.deadline),
    );
    drop(links.guard.take());
    let counters = query_counters(&node.rank);
    let deaths = watch.finish();
    let stats = side_channel(&node.link);
    let mut errors = std::mem::take(&mut run.errors);
    repeater.join(&mut errors);
    drop(node.rank);
    node.runtime.shutdown();
    errors.extend(side.errors.iter().cloned());
    let (ends, explained) = prefill_ends(&run.plan, &side.records, options.start_at, run.clock);
    let facts = run.facts().build(Outcome {
        ends,
        explained,
        errors: &errors,
        free: &side.free,
        pool_blocks: options.schedule.pool_blocks,
        counters: counters.as_ref(),
        deaths,
        timed_out: side.timed_out,
    });
    let races = match &counters {
        Some(c) => races_of(c),
        None => {
            errors.push("P's counters did not come back".into());
            Races::default()
        }
    };
    let mut r = prefill_report(&run, &side, races, errors, peer_exited);
    if let Some(s) = stats {
        r.link = summary(
            &s,
            run.listen,
            options.peer,
            (run.listening_ms, run.waited_ms),
        );
    }
    r.ok = r.verdict_ok();
    r.verdict = r.verdict_line();
    NodeRun {
        report: NodeReport::Prefill(r),
        node: facts,
    }
}

/// P's report of its loop's `side` (without the link's summary and the verdict).
fn prefill_report(
    run: &Run<'_>,
    side: &demo::PrefillSide,
    races: Races,
    errors: Vec<String>,
    peer_exited: bool,
) -> PrefillReport {
    let (opts, plan, records) = (&run.options.schedule, &run.plan, &side.records);
    let block_bytes = run.workload.block_bytes;
    let (late, lag) = lateness(plan, records, run.start, run.options.hold);
    let blocks: u64 = plan.iter().map(|q| q.blocks as u64).sum();
    let turns = turn_counts(opts, plan, records, &[], block_bytes);
    let mut r = PrefillReport {
        transport: run.transport.into(),
        role: NodeRole::Prefill,
        seed: opts.seed,
        requests: plan.len() as u64,
        races,
        prefill_outcomes: PrefillOutcomes {
            sent: records.iter().filter(|r| r.sent).count() as u64,
            released: records
                .iter()
                .filter(|r| r.released.is_some() || r.export_end.is_some())
                .count() as u64,
            missing: records.iter().filter(|r| r.events == 0).count() as u64,
        },
        bytes: demo::sent_bytes(plan, records, block_bytes),
        expected_bytes: blocks * block_bytes + turns.read_back_bytes,
        mode: opts.mode.name().into(),
        pulled: plan
            .iter()
            .filter(|q| q.mode == kvhandoff::TransferMode::Pull)
            .count() as u64,
        turns,
        tokens: plan.iter().map(|q| u64::from(q.tokens)).sum(),
        blocks,
        late_finishes: late,
        max_finish_lag_ms: lag,
        events: records.iter().map(|r| u64::from(r.events)).sum(),
        duplicates: side.duplicates,
        unknown: side.unknown,
        double_frees: side.free.double_frees,
        leaked_blocks: side.free.in_use(),
        pool_blocks: opts.pool_blocks,
        link: LinkSummary::default(),
        peer_exited,
        wall_ms: run.wall.elapsed().as_secs_f64() * 1e3,
        timed_out: side.timed_out,
        errors,
        ok: false,
        verdict: String::new(),
    };
    if side.free.bad_ids > 0 {
        push(
            &mut r.errors,
            format!("{} block ids outside the pool", side.free.bad_ids),
        );
    }
    if r.timed_out {
        push(
            &mut r.errors,
            format!(
                "the run reached its {:?} limit with {} events missing",
                opts.timeout, r.prefill_outcomes.missing
            ),
        );
    }
    r
}
