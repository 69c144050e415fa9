//! The kill's section of the cluster's report and its verdict.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::{Killer, Phase, KILLED, RESTARTED, SURVIVOR};
use crate::cli::cluster::RankLine;

impl Killer {
    /// The kill section of the report, with its verdict, from every rank's line and its JSON.
    pub(crate) fn report(self, ranks: &[RankLine], texts: &[String]) -> KillReport {
        let requests = u64::from(self.requests);
        let startup = self.startup();
        let mut why = Vec::new();
        for r in ranks.iter().filter(|r| r.life.is_none()) {
            if r.engine == "router" {
                // A pair's router: every request decided (forwarded or abandoned).
                if !r.ok {
                    why.push(format!(
                        "the router: {}",
                        r.error.as_deref().unwrap_or("not ok")
                    ));
                }
                continue;
            }
            if !r.ok || r.done != requests {
                why.push(format!(
                    "{} rank {}: {}/{requests} done{}",
                    r.engine,
                    r.rank,
                    r.done,
                    r.error
                        .as_deref()
                        .map_or(String::new(), |e| format!(" ({e})"))
                ));
            }
        }
        let other_pairs_ok = why.is_empty();
        let kill = match self.phase {
            Phase::Killed(kill) => Some(kill),
            Phase::Armed => {
                why.push("the run ended before the kill".into());
                None
            }
            Phase::Missed(reason) => {
                why.push(format!("the victim was not killed: {reason}"));
                None
            }
        };
        if let Some(victim) = ranks.iter().find(|r| r.life == Some(KILLED)) {
            if victim.signal != Some(9) {
                why.push(format!("the killed process ended otherwise: {victim:?}"));
            }
        }
        let k = kill.as_ref().and_then(|k| k.restart_at);
        if kill.is_some() && k.is_none() {
            why.push(
                "no request of the plan arrives a restart's lead after the kill: nothing was \
                 restarted (give more --requests or an earlier @N)"
                    .into(),
            );
        }
        let restarted = ranks
            .iter()
            .find(|r| r.life == Some(RESTARTED))
            .map(|r| Incarnation {
                pid: r.pid,
                exit_code: r.exit_code,
                ok: r.ok,
                done: r.done,
            });
        let part = k.map_or(0, |k| requests - k);
        if let Some(r) = &restarted {
            // A pair's restart is typed throughout (its first requests may have been given up
            // on before it met its peers) and must have served at least half of its part.
            let served_enough = if self.pair {
                r.done * 2 >= part && r.done > 0
            } else {
                r.done == part
            };
            if !r.ok || !served_enough {
                why.push(format!(
                    "the restarted rank: {}/{part} done, exit {:?}",
                    r.done, r.exit_code
                ));
            }
        }
        if self.pair {
            // Every rank but the victim survived it: each must account for every request.
            for r in ranks.iter().filter(|r| r.life == Some(SURVIVOR)) {
                if !r.ok || r.byte_errors > 0 || r.leaked_blocks > 0 {
                    why.push(format!(
                        "survivor {} rank {}: exit {:?}, {} byte errors, {} leaked blocks{}",
                        r.engine,
                        r.rank,
                        r.exit_code,
                        r.byte_errors,
                        r.leaked_blocks,
                        r.error
                            .as_deref()
                            .map_or(String::new(), |e| format!(" ({e})"))
                    ));
                }
            }
        }
        // The survivor reported on: the victim's peer rank (in a pair, the first rank of the
        // other engine).
        let victim_engine = self.spec.engine.name();
        let survivor = ranks
            .iter()
            .zip(texts)
            .find(|(r, _)| r.life == Some(SURVIVOR) && r.engine != victim_engine)
            .map(|(r, text)| survivor(r, text, k));
        let mut served = 0;
        match &survivor {
            Some((s, after)) => {
                if !s.ok || s.byte_errors > 0 || s.leaked_blocks > 0 {
                    why.push(format!(
                        "the survivor: exit {:?}, {} byte errors, {} leaked blocks{}",
                        s.exit_code,
                        s.byte_errors,
                        s.leaked_blocks,
                        s.error
                            .as_deref()
                            .map_or(String::new(), |e| format!(" ({e})"))
                    ));
                }
                let restarted_done = restarted.as_ref().map_or(0, |r| r.done);
                served = if self.pair {
                    restarted_done
                } else {
                    (*after).min(restarted_done)
                };
                if k.is_some() && !self.pair && served != part {
                    why.push(format!("{served}/{part} requests served after the restart"));
                }
            }
            None => why.push("no survivor's report".into()),
        }
        KillReport {
            engine: self.spec.engine.name(),
            rank: self.spec.rank,
            at_request: self.spec.at,
            killed_pid: kill.as_ref().map(|k| k.pid),
            killed_run_ms: kill.as_ref().map(|k| k.run_ms),
            killed_schedule_ms: kill.as_ref().map(|k| k.schedule_ms),
            request_at_kill: kill.as_ref().map(|k| k.request),
            victim_startup_ms: startup.map(|d| d.as_secs_f64() * 1e3),
            restart_lead_ms: kill.as_ref().map(|k| k.lead.as_secs_f64() * 1e3),
            restart_at: k,
            restarted,
            survivor: survivor.map(|(s, _)| s),
            served_after_restart: served,
            other_pairs_ok,
            ok: why.is_empty(),
            why,
        }
    }
}

/// The survivor's section from its line and JSON, and how many of requests `k..` it completed.
fn survivor(line: &RankLine, text: &str, k: Option<u64>) -> (Survivor, u64) {
    let report = crate::cli::cluster::report_of(text).unwrap_or(Value::Null);
    // A pair rank's report (`node --model`) has its outcomes at the top.
    let node = if report["node"].is_null() {
        &report
    } else {
        &report["node"]
    };
    let outcomes: BTreeMap<String, u64> = node["outcomes"]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(name, n)| (name.clone(), n.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    // What a request that went through is called on the survivor's side: a push's, then a
    // pull's (a replica's export, which no D rank needed, as read).
    let successes: &[&str] = if line.engine == "decode" {
        &["Ready", "Loaded"]
    } else {
        &["Sent", "Read", "Released(FullPrefixHit)"]
    };
    let success = successes[0];
    let total: u64 = outcomes.values().sum();
    let through: u64 = successes
        .iter()
        .map(|s| outcomes.get(*s).copied().unwrap_or(0))
        .sum();
    let failed = total - through.min(total);
    let after = k.map_or(0, |k| {
        node["requests"].as_array().map_or(0, |list| {
            list.iter()
                .filter(|r| r["index"].as_u64().is_some_and(|i| i >= k))
                .filter(|r| r["outcome"] == success && r["byte_errors"].as_u64() == Some(0))
                .count() as u64
        })
    });
    let survivor = Survivor {
        engine: line.engine,
        rank: line.rank,
        pid: line.pid,
        exit_code: line.exit_code,
        ok: line.ok,
        outcomes,
        failed,
        byte_errors: line.byte_errors,
        leaked_blocks: line.leaked_blocks,
        peer_deaths: node["peer_deaths"].as_u64().unwrap_or(0),
        error: line.error.clone(),
    };
    (survivor, after)
}

/// The restarted process.
#[derive(Debug, Serialize)]
pub(super) struct Incarnation {
    pid: u32,
    exit_code: Option<i32>,
    /// Its strict verdict: every request of its part handed off.
    ok: bool,
    /// D: requests verified; P: requests sent (of its part, `K..`).
    done: u64,
}

/// The killed rank's peer, which ran on.
#[derive(Debug, Serialize)]
pub(super) struct Survivor {
    engine: &'static str,
    rank: u32,
    pid: u32,
    exit_code: Option<i32>,
    /// Its node verdict: every request one typed outcome, every block back.
    ok: bool,
    /// Its requests by typed outcome (`Ready` / `Sent` for pushes that went through, `Loaded`
    /// / `Read` for pulls).
    outcomes: BTreeMap<String, u64>,
    /// Requests that did not go through (every outcome but the successes above).
    failed: u64,
    byte_errors: u64,
    leaked_blocks: u64,
    /// Peers its endpoint declared dead.
    peer_deaths: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// `--kill` in the report.
#[derive(Debug, Serialize)]
pub(crate) struct KillReport {
    engine: &'static str,
    rank: u32,
    /// `@N`: the request at whose arrival the rank was to die.
    at_request: u32,
    killed_pid: Option<u32>,
    /// When it was killed, ms into the run (from the command's start).
    killed_run_ms: Option<f64>,
    /// When it was killed, ms into its schedule (from its handshake).
    killed_schedule_ms: Option<f64>,
    /// The last request that had arrived on its schedule when it was killed.
    request_at_kill: Option<u64>,
    /// The victim's first start-up, from its spawn to listening, ms (the restart's lead is
    /// sized on it).
    victim_startup_ms: Option<f64>,
    /// How long after the kill (on the plan) the restart's first request arrives, ms.
    restart_lead_ms: Option<f64>,
    /// K: the restarted process ran requests `K..` of the plan.
    restart_at: Option<u64>,
    restarted: Option<Incarnation>,
    survivor: Option<Survivor>,
    /// Requests `K..` that went through on both sides of the restarted pair.
    served_after_restart: u64,
    /// Whether every rank pair but the killed rank's verified (D) and sent (P) every request.
    other_pairs_ok: bool,
    /// Whether the kill went as the issue asks: the other pairs all verified, the survivor's
    /// outcomes all typed with no byte error and no leak, the restart served `K..`.
    pub(crate) ok: bool,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    why: Vec<String>,
}

impl KillReport {
    /// The verdict line's count of requests: the other pairs', then the killed rank's pair's.
    pub(crate) fn verdict_head(&self, requests: u64) -> String {
        let others = if self.other_pairs_ok {
            "every other rank pair verified every request"
        } else {
            "not every other rank pair verified every request"
        };
        let survivor = self.survivor.as_ref().map_or(String::new(), |s| {
            format!(
                "{} of {requests} went through and {} failed typed, ",
                requests - s.failed.min(requests),
                s.failed
            )
        });
        let part = self.restart_at.map_or(0, |k| requests.saturating_sub(k));
        format!(
            "{others}; the killed rank's pair: {survivor}{}/{part} served after the restart",
            self.served_after_restart
        )
    }

    /// The section's lines for the table.
    pub(crate) fn render(&self) -> String {
        let mut out = format!(
            "kill: {} rank {} at request {}",
            self.engine, self.rank, self.at_request
        );
        if let (Some(pid), Some(run), Some(into), Some(request)) = (
            self.killed_pid,
            self.killed_run_ms,
            self.killed_schedule_ms,
            self.request_at_kill,
        ) {
            out.push_str(&format!(
                ": pid {pid} killed {into:.0} ms into its schedule (request {request}), \
                 {run:.0} ms into the run"
            ));
        }
        out.push('\n');
        if let (Some(k), Some(r)) = (self.restart_at, &self.restarted) {
            out.push_str(&format!(
                "  restarted: pid {} with --start-at {k} ({:.0} ms lead), exit {}, {} done; \
                 {} requests {k}.. served\n",
                r.pid,
                self.restart_lead_ms.unwrap_or(0.0),
                r.exit_code.map_or("-".into(), |c| c.to_string()),
                r.done,
                self.served_after_restart
            ));
        }
        if let Some(s) = &self.survivor {
            let outcomes: Vec<String> =
                s.outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
            out.push_str(&format!(
                "  survivor: {} rank {} (pid {}), exit {}: {}; {} failed typed, {} byte errors, \
                 {} leaked blocks, {} peer deaths\n",
                s.engine,
                s.rank,
                s.pid,
                s.exit_code.map_or("-".into(), |c| c.to_string()),
                outcomes.join(", "),
                s.failed,
                s.byte_errors,
                s.leaked_blocks,
                s.peer_deaths
            ));
        }
        for why in &self.why {
            out.push_str(&format!("  not ok: {why}\n"));
        }
        out
    }
}
