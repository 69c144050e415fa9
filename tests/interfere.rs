//! Two `kvhandoff node` processes over NIXL (UCX) on loopback, disturbed without being killed:
//! (a) each side's live handshake reaches the other again in the middle of the run (a second
//! dial and a raw copy from a plain socket, `--repeat-handshake-ms`): a repeat of the live
//! incarnation changes nothing — every request is handed off, no byte is wrong, no death or
//! restart is declared; (b) P is stopped (SIGSTOP) for longer than the peer timeout and then
//! resumed (SIGCONT): D declares a live P dead, fences what it had exposed to it, and still
//! never hands out a wrong byte; both sides end every request with one typed outcome and get
//! every block back. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test interfere`.
#![cfg(feature = "nixl")]

mod nodes;

use std::thread;
use std::time::{Duration, Instant};

use nodes::*;

/// Every request of a node's report carries no wrong byte.
fn no_byte_errors(report: &serde_json::Value, all: &str) {
    for r in ends(report) {
        assert_eq!(
            r.byte_errors, 0,
            "request {} ({}) has wrong bytes\n{all}",
            r.index, r.outcome
        );
    }
}

fn count(report: &serde_json::Value, field: &str) -> u64 {
    report["node"][field].as_u64().unwrap_or(u64::MAX)
}

/// Waits for `nodes`; each must exit 0 with one typed outcome per request, every block back and
/// no wrong byte. Returns their reports (in order) and everything they printed.
fn finish_clean(nodes: Vec<Node>) -> (Vec<serde_json::Value>, String) {
    let done = finish_all(nodes, Instant::now() + WAIT);
    let all: String = done.iter().map(Finished::show).collect();
    let reports = done
        .iter()
        .map(|node| {
            assert!(
                node.status.is_some_and(|s| s.success()),
                "{} did not exit 0\n{all}",
                node.name
            );
            let report = node.json(&all);
            check_node(&report, REQUESTS, &all);
            no_byte_errors(&report, &all);
            report
        })
        .collect();
    (reports, all)
}

/// (a) Both sides' handshakes arrive again mid-run: P's at 600 ms into the schedule, D's at
/// 900 ms, each as a second dial and as a raw copy. The run is a clean one: both exit 0 with the
/// strict verdict (every request handed off), and each side counted the repeats and nothing
/// else.
#[test]
fn a_repeated_handshake_mid_run_changes_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (p_addr, d_addr) = two_ports();
    let requests = REQUESTS.to_string();
    let p = Node::start(
        "P",
        "prefill",
        p_addr,
        d_addr,
        &["--requests", &requests, "--repeat-handshake-ms", "600"],
    );
    let d = Node::start(
        "D",
        "decode",
        d_addr,
        p_addr,
        &["--requests", &requests, "--repeat-handshake-ms", "900"],
    );
    let (reports, all) = finish_clean(vec![p, d]);
    for (report, name) in reports.iter().zip(["P", "D"]) {
        // Each side gets the other's second dial and raw copy, and the answer to its own dial.
        assert!(
            count(report, "repeated_handshakes") >= 2,
            "{name}: repeats not seen\n{all}"
        );
        assert_eq!(count(report, "peer_restarts"), 0, "{name}\n{all}");
        assert_eq!(count(report, "peer_deaths"), 0, "{name}\n{all}");
    }
    let d = &reports[1];
    let ready = d["node"]["outcomes"]["Ready"].as_u64().unwrap_or(0);
    assert_eq!(ready, REQUESTS, "every request Ready on D\n{all}");
    eprintln!(
        "repeated handshakes: P counted {}, D counted {}; {ready} requests Ready, 0 byte errors",
        count(&reports[0], "repeated_handshakes"),
        count(d, "repeated_handshakes")
    );
}

/// (b) P is stopped 500 ms into the schedule for 1.2 s (four peer timeouts), then resumed.
/// D declares the live P dead; whatever D had exposed to it comes back only through a proof or
/// the fence, so P's writes that land after the resume never reach a reused block. Both run as
/// survivors (`--expect-peer-loss`): every request has exactly one typed outcome, every block
/// is back, no error is unexplained, and no request on D has a wrong byte.
#[test]
fn a_stopped_prefill_is_fenced_and_both_sides_recover() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (p_addr, d_addr) = two_ports();
    let requests = REQUESTS.to_string();
    let survivor = ["--requests", &requests, "--expect-peer-loss"];
    let mut p = Node::start("P", "prefill", p_addr, d_addr, &survivor);
    let mut d = Node::start("D", "decode", d_addr, p_addr, &survivor);
    let started = Instant::now();
    p.await_schedule(started + WAIT);
    d.await_schedule(started + WAIT);
    thread::sleep(Duration::from_millis(500));
    let stopped = p.signal("STOP");
    thread::sleep(Duration::from_millis(1_200));
    let resumed = p.signal("CONT");
    let (reports, all) = finish_clean(vec![p, d]);
    let d = &reports[1];
    let deaths = count(d, "peer_deaths");
    assert!(deaths >= 1, "D declared no death of the stopped P\n{all}");
    let seen = d["node"]["peer_deaths_seen_unix_ms"][0]
        .as_f64()
        .unwrap_or(f64::MAX);
    assert!(
        seen >= stopped && seen <= resumed + SLACK_MS,
        "D saw the death at {seen:.0}, stopped {stopped:.0}, resumed {resumed:.0}\n{all}"
    );
    assert_eq!(count(d, "peer_restarts"), 0, "P never restarted\n{all}");
    let outcomes = &d["node"]["outcomes"];
    eprintln!(
        "P stopped {:.0} ms: D declared it dead {:.0} ms after the stop; D outcomes {outcomes}",
        resumed - stopped,
        seen - stopped
    );
}
