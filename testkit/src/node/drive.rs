//! Running a node: the rank, the meeting with the peer, the role's engine loop, the reports.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{
    agent_name, blocking::ask, build_rank, RankActor, RankMemory, RankOptions, ShellConfig,
    SideChannelConfig,
};
use kvhandoff_actors::transport::TransportError;
#[cfg(feature = "test-hooks")]
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{AgentName, EngineId};

use super::facts::{
    decode_ends, lateness, prefill_ends, push, summary, FactsInput, Outcome, UnixClock,
};
use super::router::{decode_side, prefill_side};
use super::wait::{await_decode, await_exit, await_prefill, side_channel};
use super::{
    AddPeerAddress, Handshaker, LinkSummary, NodeOptions, NodeReport, NodeRole, NodeRun,
    PrefillReport,
};
use crate::demo::{
    self, build_report, check_options, identity, model, query_counters, races_of, run_decode,
    run_prefill, schedule, turn_counts, turn_settings, DecodeRun, DemoError, DemoMode, Facts,
    Pacing, Planned, PrefillOutcomes, PrefillRun, Races, Tallies, DECODE_ENGINE, PREFILL_ENGINE,
};
use crate::hooks::{Repeater, StopAfter};
use kvhandoff::{ConnectorIdentity, ConnectorSettings, KvConnector, KvTransferParams, Runtime};

/// Watches the endpoint's `peers_declared_dead` on its own thread, every 10 ms, and notes when
/// each death was first seen.
struct DeathWatch {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Vec<Instant>>>,
}

impl DeathWatch {
    const POLL: Duration = Duration::from_millis(10);

    fn start(rank: actix::Addr<RankActor>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::Builder::new()
            .name("node-death-watch".into())
            .spawn(move || {
                let mut seen = Vec::new();
                let mut deaths = 0;
                while !flag.load(Ordering::Relaxed) {
                    if let Some(c) = query_counters(&rank) {
                        let now = Instant::now();
                        while deaths < c.peers_declared_dead {
                            deaths += 1;
                            seen.push(now);
                        }
                    }
                    thread::sleep(Self::POLL);
                }
                seen
            })
            .ok();
        DeathWatch { stop, thread }
    }

    /// Stops the watch; the deaths seen, in order.
    fn finish(mut self) -> Vec<Instant> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for DeathWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

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

/// Runs one node on the transport `make` creates for the rank's agent name; `transport` names
/// it in the report.
///
/// # Errors
/// [`DemoError`] when the node cannot start: bad options, a transport or rank that cannot be
/// built, a side channel that cannot listen. A node that starts and goes wrong (the peer never
/// came, a request failed) returns a report whose verdict is FAILED.
pub fn run_full_on<T, F>(
    transport: &'static str,
    options: &NodeOptions,
    make: F,
) -> Result<NodeRun, DemoError>
where
    T: RankMemory + Unpin + Send + 'static,
    F: FnOnce(AgentName) -> Result<T, TransportError>,
{
    let wall = Instant::now();
    let clock = UnixClock::now();
    let opts = &options.schedule;
    let deadline = wall + opts.timeout;
    let workload = check_options(opts)?;
    // A pulled request needs P's answer (its block ids) at D, and a conversation's next turn
    // D's answer at P: they travel over the router link.
    let router = match (opts.mode, options.router) {
        (DemoMode::Push, _) => None,
        (_, Some(addr)) => Some(addr),
        (mode, None) => {
            return Err(DemoError::Options(format!(
                "--mode {} needs the router link's address (--router)",
                mode.name()
            )))
        }
    };
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
    let (mut p_link, mut d_link, mut guard) = (None, None, None);
    if let Some(addr) = router {
        match options.role {
            NodeRole::Decode => {
                let (link, g) = decode_side(addr, options.start_at, plan.len()).map_err(|e| {
                    DemoError::Options(format!("the router link cannot listen on {addr}: {e}"))
                })?;
                (d_link, guard) = (Some(link), Some(g));
            }
            NodeRole::Prefill => {
                let (link, g) = prefill_side(addr, options.start_at, plan.len(), deadline);
                (p_link, guard) = (Some(link), Some(g));
            }
        }
    }
    // Conversations follow P's reports (a later turn's time is not on any clock); the other
    // modes both sides' clocks.
    let pacing = match opts.mode {
        DemoMode::Bidir => Pacing::Router,
        _ => Pacing::Clock { hold: options.hold },
    };
    let turns = turn_settings(opts);
    #[cfg(feature = "test-hooks")]
    let stop_after = StopAfter::at(
        options
            .stop_self_after
            .and_then(|k| k.checked_sub(options.start_at)),
    );
    #[cfg(not(feature = "test-hooks"))]
    let stop_after = StopAfter::NEVER;
    let engine_id = |name| EngineId::new(name).map_err(|e| DemoError::Options(e.to_string()));
    let (own, other) = match options.role {
        NodeRole::Prefill => (engine_id(PREFILL_ENGINE)?, engine_id(DECODE_ENGINE)?),
        NodeRole::Decode => (engine_id(DECODE_ENGINE)?, engine_id(PREFILL_ENGINE)?),
    };
    let name = agent_name(&own, 0).map_err(|e| DemoError::Options(e.to_string()))?;
    let rank_transport = make(name).map_err(|e| DemoError::Build(e.into()))?;
    let shell = ShellConfig {
        poll_interval: opts.poll_interval,
        ..ShellConfig::default()
    };
    let (setup, pool) = build_rank(
        rank_transport,
        &own,
        workload.geometry.clone(),
        &model(),
        opts.pool_blocks,
        config.clone(),
        shell,
    )?;
    #[cfg(feature = "test-hooks")]
    let own_info = setup.info.clone();
    let mut runtime = Runtime::start()?;
    let handle = runtime.add_rank(
        setup,
        RankOptions {
            handshaker: Some(Handshaker::Tcp(SideChannelConfig::new(options.listen))),
            ..RankOptions::default()
        },
    )?;
    let listen = handle.side_channel.unwrap_or(options.listen);
    eprintln!(
        "kvhandoff node: {own} listening on {listen}, peer {other} at {}",
        options.peer
    );
    let link = handle.link.clone();
    let rank = handle.rank.clone();
    let watch = DeathWatch::start(rank.clone());
    let added = ask(
        &link,
        AddPeerAddress {
            engine: other.clone(),
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
    let conn = KvConnector::with_settings(
        ConnectorIdentity {
            host: listen.ip().to_string(),
            port: listen.port(),
            ..identity(own.as_str())?
        },
        handle,
        ConnectorSettings::new(&config, &workload.geometry),
    );

    let mut errors = Vec::new();
    let met = match options.role {
        NodeRole::Decode => await_prefill(&link, options.peer, &other, deadline),
        NodeRole::Prefill => await_decode(&link, deadline),
    };
    // The schedule's time zero: when P saw the handshake complete (D's estimate of it on D).
    let start = match met {
        Ok(at) => at,
        Err(why) => {
            errors.push(why);
            Instant::now()
        }
    };
    let waited_ms = (Instant::now() - wall).as_secs_f64() * 1e3;
    eprintln!(
        "kvhandoff node: {own} met {other} after {waited_ms:.0} ms; running the schedule \
         (requests {}..{})",
        options.start_at,
        whole.len()
    );
    let facts = FactsInput {
        options,
        config: &config,
        clock,
        start,
    };
    #[cfg(feature = "test-hooks")]
    let repeater = match options.repeat_handshake_after {
        Some(after) => Repeater::start(
            link.clone().recipient(),
            own_info,
            PeerAddr::new(other.clone(), 0),
            options.peer,
            (start + after).min(deadline),
        ),
        None => Repeater::NONE,
    };
    #[cfg(not(feature = "test-hooks"))]
    let repeater = Repeater::NONE;

    let run = match options.role {
        NodeRole::Decode => {
            let side = run_decode(
                conn,
                pool,
                &plan,
                DecodeRun {
                    start,
                    deadline,
                    pacing,
                    link: d_link.take(),
                    answer_wait: Some(config.decode_deadline),
                    turns,
                    stop_after,
                    params: KvTransferParams {
                        do_remote_prefill: true,
                        remote_engine_id: Some(PREFILL_ENGINE.into()),
                        remote_host: Some(options.peer.ip().to_string()),
                        remote_port: Some(options.peer.port()),
                        tp_size: Some(1),
                        ..KvTransferParams::default()
                    },
                },
            );
            drop(guard.take());
            let counters = query_counters(&rank);
            let deaths = watch.finish();
            errors.extend(side.errors);
            repeater.join(&mut errors);
            let bytes = plan
                .iter()
                .zip(&side.records)
                .filter(|(_, r)| r.ready)
                .map(|(q, _)| q.blocks as u64 * workload.block_bytes)
                .sum();
            drop(rank);
            runtime.shutdown();
            let (ends, explained) = decode_ends(&plan, &side.records, options.start_at, clock);
            let node = facts.build(Outcome {
                ends,
                explained,
                errors: &errors,
                free: &side.free,
                pool_blocks: opts.pool_blocks,
                counters: counters.as_ref(),
                deaths,
                timed_out: side.timed_out,
            });
            let report = NodeReport::Decode(build_report(
                Facts {
                    options: opts,
                    transport,
                    workload: &workload,
                    plan: &plan,
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
                    wall,
                },
            ));
            NodeRun { report, node }
        }
        NodeRole::Prefill => {
            let side = run_prefill(
                conn,
                pool,
                &plan,
                PrefillRun {
                    start,
                    deadline,
                    corrupt: opts.corrupt_one_request.then_some(plan.len() / 2),
                    pacing,
                    link: p_link.take(),
                    turns,
                    answer_wait: Some(config.decode_deadline),
                    stop_after,
                },
            );
            let peer_exited = await_exit(
                options.peer,
                (Instant::now() + options.linger).min(deadline),
            );
            drop(guard.take());
            let counters = query_counters(&rank);
            let deaths = watch.finish();
            let stats = side_channel(&link);
            repeater.join(&mut errors);
            drop(rank);
            runtime.shutdown();
            errors.extend(side.errors);
            let (ends, explained) = prefill_ends(&plan, &side.records, options.start_at, clock);
            let node = facts.build(Outcome {
                ends,
                explained,
                errors: &errors,
                free: &side.free,
                pool_blocks: opts.pool_blocks,
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
            let (late, lag) = lateness(&plan, &side.records, start, options.hold);
            let records = &side.records;
            let blocks: u64 = plan.iter().map(|q| q.blocks as u64).sum();
            let turns = turn_counts(opts, &plan, records, &[], workload.block_bytes);
            let mut r = PrefillReport {
                transport: transport.into(),
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
                bytes: demo::sent_bytes(&plan, records, workload.block_bytes),
                expected_bytes: blocks * workload.block_bytes + turns.read_back_bytes,
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
                wall_ms: wall.elapsed().as_secs_f64() * 1e3,
                timed_out: side.timed_out,
                errors,
                ok: false,
                verdict: String::new(),
            };
            if let Some(s) = stats {
                r.link = summary(&s, listen, options.peer, waited_ms);
            }
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
            r.ok = r.verdict_ok();
            r.verdict = r.verdict_line();
            NodeRun {
                report: NodeReport::Prefill(r),
                node,
            }
        }
    };
    Ok(run)
}
