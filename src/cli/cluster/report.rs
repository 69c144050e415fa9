//! The cluster's report: each process's line, read from the JSON report it printed, and the
//! table printed without `--json`. Kept apart from starting and watching the processes.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use serde::Serialize;
use serde_json::Value;

use super::kill::{self, KillReport};
use super::{pair, RankSpec};

/// One rank's process and what it reported.
#[derive(Debug, Serialize)]
pub(super) struct RankLine {
    pub(super) engine: &'static str,
    pub(super) rank: u32,
    pub(super) listen: String,
    /// The process id (reaped by the time the report is printed).
    pub(super) pid: u32,
    /// The exit code (`null`: killed or ended by a signal).
    pub(super) exit_code: Option<i32>,
    /// The signal that ended the process, if one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) signal: Option<i32>,
    /// With `--kill`: `"killed"`, `"restarted"` or `"survivor"` (the killed rank's peer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) life: Option<&'static str>,
    /// The node's verdict.
    pub(super) ok: bool,
    /// D: requests whose every byte checked out; P: requests sent.
    pub(super) done: u64,
    pub(super) byte_errors: u64,
    /// Blocks not back in the rank's pool at its end.
    pub(super) leaked_blocks: u64,
    /// A pair's `--mode bidir`: P, the next turns read back and checked in its geometry; D,
    /// its keeps that P read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) read_back: Option<u64>,
    /// A pair's rank: its requests by typed outcome (D: `Ready` pushed, `Loaded` pulled, …).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub(super) outcomes: std::collections::BTreeMap<String, u64>,
    /// Why the line is not ok, when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) error: Option<String>,
}

#[derive(Debug, Serialize)]
pub(super) struct ClusterReport {
    pub(super) transport: &'static str,
    pub(super) mode: String,
    pub(super) tp: u32,
    /// With `--model`: the pair (model, P's spec, D's spec).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pair: Option<String>,
    pub(super) processes: usize,
    pub(super) requests: u64,
    /// Requests verified on every D rank (a killed and restarted rank: what its processes
    /// reported, together).
    pub(super) verified: u64,
    pub(super) byte_errors: u64,
    pub(super) leaked_blocks: u64,
    /// Whether every process this command started has exited (none left running).
    pub(super) all_exited: bool,
    /// Set when the run was interrupted (Ctrl-C, SIGTERM) or passed its deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) stopped: Option<String>,
    pub(super) wall_s: f64,
    pub(super) ok: bool,
    pub(super) ranks: Vec<RankLine>,
    /// With `--kill`: the kill, the restart and what the survivor saw.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kill: Option<KillReport>,
}

/// One rank's line from its exit status and the JSON report it printed.
pub(super) fn rank_line(spec: RankSpec, status: Option<&ExitStatus>, text: &str) -> RankLine {
    let mut line = RankLine {
        engine: spec.engine,
        rank: spec.rank,
        listen: spec.listen.to_string(),
        pid: spec.pid,
        exit_code: status.and_then(ExitStatus::code),
        signal: status.and_then(ExitStatus::signal),
        life: spec.life,
        ok: false,
        done: 0,
        byte_errors: 0,
        leaked_blocks: 0,
        read_back: None,
        outcomes: std::collections::BTreeMap::new(),
        error: None,
    };
    if spec.life == Some(kill::KILLED) {
        line.error = Some("killed by --kill".to_string());
        return line;
    }
    let report = match report_of(text) {
        Ok(report) => report,
        Err(e) => {
            line.error = Some(format!("no report ({e})"));
            return line;
        }
    };
    if let Some(forwarded) = report.get("forwarded") {
        // A pair's router: every request decided.
        line.done = forwarded.as_u64().unwrap_or(0);
        line.ok = report["ok"] == true && line.exit_code == Some(0);
        if !line.ok {
            line.error = Some(format!("{} requests undecided", report["undecided"]));
        }
        return line;
    }
    if report.get("done").is_some() {
        // A heterogeneous pair's rank (`node --model`).
        let (done, byte_errors, leaked, ok, verdict) = pair::rank_counts(&report);
        line.done = done;
        line.byte_errors = byte_errors;
        line.leaked_blocks = leaked;
        if let Some(outcomes) = report["outcomes"].as_object() {
            line.outcomes = outcomes
                .iter()
                .map(|(name, n)| (name.clone(), n.as_u64().unwrap_or(0)))
                .collect();
        }
        let turns = &report["read_back"];
        line.read_back = match spec.engine {
            "decode" => turns["kept_read"].as_u64(),
            _ => turns["read_back_verified"].as_u64(),
        };
        line.ok = ok && line.exit_code == Some(0);
        if !line.ok {
            line.error = verdict;
        }
        return line;
    }
    let count = |v: &Value| v.as_u64().unwrap_or(0);
    line.done = match spec.engine {
        "decode" => count(&report["verified"]),
        _ => count(&report["prefill_outcomes"]["sent"]),
    };
    line.byte_errors = count(&report["byte_errors"]);
    let pool = &report["node"]["pool"];
    line.leaked_blocks = count(&pool["blocks"]).saturating_sub(count(&pool["free_at_end"]));
    // A survivor (`--expect-peer-loss`) is judged on its node verdict: every request typed,
    // every block back; its role's strict verdict fails by design.
    let verdict = if report["node"]["expect_peer_loss"] == true {
        &report["node"]
    } else {
        &report
    };
    line.ok = verdict["ok"] == true && line.exit_code == Some(0);
    if !line.ok {
        line.error = verdict["verdict"].as_str().map(str::to_string);
    }
    line
}

/// The JSON report in a node's stdout. UCX logs to stdout as well (a warning at teardown after
/// a peer died comes after the report), so the report is the first value from the line that
/// opens it, whatever surrounds it.
pub(super) fn report_of(text: &str) -> Result<Value, String> {
    let start = if text.starts_with('{') {
        Some(0)
    } else {
        text.find("\n{").map(|i| i + 1)
    };
    let start = start.ok_or_else(|| "nothing on stdout opens one".to_string())?;
    match serde_json::Deserializer::from_str(&text[start..])
        .into_iter::<Value>()
        .next()
    {
        Some(report) => report.map_err(|e| e.to_string()),
        None => Err("nothing on stdout opens one".to_string()),
    }
}

pub(super) fn render(report: &ClusterReport) -> String {
    let mut out = match &report.pair {
        Some(pair) => format!(
            "kvhandoff cluster: {pair}, {} processes, {} over {}, {} requests\n",
            report.processes, report.mode, report.transport, report.requests
        ),
        None => format!(
            "kvhandoff cluster: {} ranks per engine, {} processes, {} over {}, {} requests per rank pair\n",
            report.tp, report.processes, report.mode, report.transport, report.requests
        ),
    };
    for r in &report.ranks {
        out.push_str(&format!(
            "  {:<7} rank {} on {:<21} exit {:<5} {} {:>6}  byte errors {}  leaked blocks {}{}{}\n",
            r.engine,
            r.rank,
            r.listen,
            match (r.exit_code, r.signal) {
                (Some(code), _) => code.to_string(),
                (None, Some(signal)) => format!("sig{signal}"),
                (None, None) => "-".to_string(),
            },
            match (r.engine, report.mode.as_str()) {
                ("decode", _) => "verified ",
                ("router", _) => "forwarded",
                (_, "pull") => "read     ",
                _ => "sent     ",
            },
            r.done,
            r.byte_errors,
            r.leaked_blocks,
            r.life.map_or(String::new(), |life| format!("  [{life}]")),
            r.error
                .as_deref()
                .map_or(String::new(), |e| format!("  ({e})")),
        ));
    }
    if let Some(kill) = &report.kill {
        out.push_str(&kill.render());
    }
    out.push_str(&format!(
        "verdict: {} — {}, {} byte errors, {} leaked blocks, {} in {:.1} s{}\n",
        if report.ok { "OK" } else { "FAILED" },
        match &report.kill {
            Some(kill) => kill.verdict_head(report.requests),
            None => format!(
                "{}/{} requests verified on every D rank",
                report.verified, report.requests
            ),
        },
        report.byte_errors,
        report.leaked_blocks,
        if report.all_exited {
            "every process exited"
        } else {
            "processes left running"
        },
        report.wall_s,
        report
            .stopped
            .as_deref()
            .map_or(String::new(), |s| format!(" ({s})")),
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::report_of;

    #[test]
    fn a_report_is_found_among_ucx_lines_on_stdout() {
        let text = "[1.0] [vm:1:0] UCX WARN before\n{\n  \"ok\": true\n}\n[2.0] UCX WARN after\n";
        assert_eq!(report_of(text).expect("a report")["ok"], true);
        assert_eq!(report_of("{\"ok\": false}").expect("a report")["ok"], false);
        assert!(report_of("").is_err());
        assert!(report_of("[1.0] UCX WARN only\n").is_err());
    }
}
