//! `kvhandoff node --log-format json`: P and D as two processes over NIXL, each logging its
//! per-request records as JSON lines on stderr. The test parses both streams and checks that
//! the records join: for every request, P's records and D's carry the same `trace_id` (the one D,
//! or the reader, made for the attempt and sent in its first message), and no two requests share
//! one; each side-channel connection's records on both sides carry the dialler's trace id.
//! Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test trace_node`.
#![cfg(feature = "nixl")]

mod nodes;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use nodes::{require_runtime, run_d_then_p, three_ports, Finished, ONE_AT_A_TIME};
use serde_json::Value;

const REQUESTS: usize = 24;
const WAIT: Duration = Duration::from_secs(90);

/// What one process's JSON log says: per pairing key, the trace ids its request records carry,
/// and the trace ids of its side-channel handshakes (served and completed).
#[derive(Default)]
struct Log {
    by_key: BTreeMap<String, BTreeSet<String>>,
    served: BTreeSet<String>,
    completed: BTreeSet<String>,
    records: usize,
}

/// Every `{key, trace_id}` pair an object names (a record's fields or a span's).
fn note(object: &Value, log: &mut Log) {
    if let (Some(key), Some(trace)) = (object["key"].as_str(), object["trace_id"].as_str()) {
        log.by_key
            .entry(key.to_string())
            .or_default()
            .insert(trace.to_string());
    }
}

fn parse(node: &Finished, all: &str) -> Log {
    let mut log = Log::default();
    for line in node.stderr.lines() {
        // The node's own progress lines are plain text; every tracing record is one object.
        if !line.starts_with('{') {
            continue;
        }
        let record: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{}: not a JSON line ({e}): {line}\n{all}", node.name));
        log.records += 1;
        assert!(record["level"].is_string(), "{line}");
        let fields = &record["fields"];
        note(fields, &mut log);
        note(&record["span"], &mut log);
        for span in record["spans"].as_array().into_iter().flatten() {
            note(span, &mut log);
        }
        if let Some(trace) = fields["trace_id"].as_str() {
            match fields["message"].as_str() {
                Some("side channel handshake served") => log.served.insert(trace.to_string()),
                Some("side channel handshake completed") => log.completed.insert(trace.to_string()),
                _ => false,
            };
        }
    }
    log
}

fn is_trace_id(text: &str) -> bool {
    text.len() == 32
        && text
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        && text.bytes().any(|b| b != b'0')
}

/// `REQUESTS` requests in `mode`, both nodes logging JSON at the level of the per-request
/// records; the two logs must join request by request and connection by connection.
fn run_traced(mode: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (p_addr, d_addr, router) = three_ports();
    let (router, requests) = (router.to_string(), REQUESTS.to_string());
    let args = [
        "--requests",
        &requests,
        "--seed",
        "11",
        "--max-prompt-tokens",
        "16",
        "--pool-blocks",
        "64",
        "--mean-arrival-gap-ms",
        "12",
        "--timeout-secs",
        "60",
        "--mode",
        mode,
        "--router",
        &router,
        "--log-format",
        "json",
        "--log-level",
        "info,kvhandoff_protocol=debug",
    ];
    let (d, p, all) = run_d_then_p((d_addr, &args), (p_addr, &args), Instant::now() + WAIT);
    assert!(
        d.status.is_some_and(|s| s.success()) && p.status.is_some_and(|s| s.success()),
        "{all}"
    );
    let (dl, pl) = (parse(&d, &all), parse(&p, &all));
    assert!(dl.records > 0 && pl.records > 0, "no JSON records\n{all}");

    // Every request of the schedule has records on D, each under exactly one trace id (a clean
    // run makes one attempt per request), and P's records of it carry that id and no other.
    assert_eq!(
        dl.by_key.len(),
        REQUESTS,
        "D's keys: {:?}\n{all}",
        dl.by_key
    );
    let mut seen = BTreeSet::new();
    for (key, d_traces) in &dl.by_key {
        assert_eq!(
            d_traces.len(),
            1,
            "{key}: D's trace ids {d_traces:?}\n{all}"
        );
        let trace = d_traces.iter().next().expect("one");
        assert!(is_trace_id(trace), "{key}: {trace:?} is not 32 hex digits");
        let p_traces = pl.by_key.get(key);
        assert_eq!(
            p_traces,
            Some(d_traces),
            "{key}: P's trace ids differ from D's {trace}\n{all}"
        );
        assert!(
            seen.insert(trace.clone()),
            "{key}: {trace} shared by two requests"
        );
    }
    assert_eq!(
        pl.by_key.len(),
        REQUESTS,
        "P's keys: {:?}",
        pl.by_key.keys()
    );

    // Connections: each side's completed (dialled) handshake is served by the other under the
    // same trace id.
    assert!(
        !dl.completed.is_empty() || !pl.completed.is_empty(),
        "no handshake\n{all}"
    );
    for (dialler, server) in [(&dl, &pl), (&pl, &dl)] {
        for trace in &dialler.completed {
            assert!(is_trace_id(trace), "{trace:?}");
            assert!(server.served.contains(trace), "{trace} not served\n{all}");
        }
    }
    println!(
        "{mode}: {} D records, {} P records, {} requests joined",
        dl.records,
        pl.records,
        seen.len()
    );
}

#[test]
fn push_requests_join_across_p_and_d_by_trace_id() {
    run_traced("push");
}

#[test]
fn pull_requests_join_across_p_and_d_by_trace_id() {
    run_traced("pull");
}
