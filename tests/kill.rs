//! Kill tests: `kvhandoff node` processes over NIXL (UCX) on loopback, one of them killed with
//! SIGKILL in the middle of the run and restarted. The survivor must declare the peer dead
//! within two heartbeat intervals of the kill, give every affected request a typed terminal
//! outcome (P at once; D after its fence: blocks exposed to a P declared dead come back only
//! after the quarantine, since a falsely-dead P's writes would still land), free all its
//! blocks, and serve the restarted peer. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test kill`.
//!
//! Both tests run the nodes with `--heartbeat-ms 200` (peer timeout 300 ms). "Within two
//! heartbeat intervals" is checked as `2 H + SLACK`: [`SLACK`] covers the test's own polling,
//! the node's 10 ms counter watch and scheduling on a loaded 2-core machine. Kill instants are
//! taken just before the SIGKILL, so every measured delay is an over-estimate.
//!
//! Every wait has a deadline, and every child is killed when its guard drops (a failing test
//! leaves no process behind).
#![cfg(feature = "nixl")]

mod nodes;

use std::thread;
use std::time::{Duration, Instant};

use nodes::*;

/// kill -9 of D in the middle of the run; D restarted with the rest of the plan.
///
/// P (`--requests 120`) and D1 (`--requests 60`, the plan's first half) run; 500 ms into the
/// schedule D1 is killed and D2 starts with `--start-at 60 --requests 120`. P (the survivor,
/// `--expect-peer-loss`) keeps running and takes D2's handshake as a restart. From P's JSON:
/// - every request has exactly one typed outcome; P's pool is all free; no unexplained error;
/// - P declared D dead after the kill and within `2 H + SLACK`;
/// - requests 0..60: ended before the kill → `Sent`; otherwise one of
///   - `Sent` ending within the bound (a write in flight at the kill that had landed),
///   - `Released(PeerDead)` / `Released(WriteFailed(..))` within the bound (bound to D1),
///   - `Released(LeaseExpired)` one lease after P finished it (or after the kill, whichever is
///     later): P holds finished blocks no live D registered — D1 never registered them, or its
///     registration was pending when it died (P drops pending registrations of a dead peer and
///     cannot tell which D a held request is for) — until the lease ends;
/// - requests 60..120: `Sent`, and D2's JSON has all 60 `Ready` with 0 byte errors.
#[test]
fn kill_decode_mid_run_then_restart_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr) = two_ports();
    let n = REQUESTS.to_string();
    let p = Node::start(
        "P",
        "prefill",
        p_addr,
        d_addr,
        &[
            "--requests",
            &n,
            "--expect-peer-loss",
            "--linger-ms",
            "8000",
        ],
    );
    let mut d1 = Node::start("D1", "decode", d_addr, p_addr, &["--requests", "60"]);
    d1.await_schedule(deadline);
    thread::sleep(Duration::from_millis(500));
    let killed = d1.kill();
    let d1_err = d1.stderr();
    drop(d1);
    let d2 = Node::start(
        "D2",
        "decode",
        d_addr,
        p_addr,
        &["--requests", &n, "--start-at", "60"],
    );
    let done = finish_all(vec![p, d2], deadline);
    let took = started.elapsed();
    let all = format!(
        "--- D1 stderr (killed)\n{d1_err}\n{}\n{}",
        done[0].show(),
        done[1].show()
    );
    let (p, d2) = (&done[0], &done[1]);
    assert!(
        p.status.is_some() && d2.status.is_some(),
        "killed at the deadline\n{all}"
    );

    let pv = p.json(&all);
    check_node(&pv, REQUESTS, &all);
    let detected = check_detection(&pv, killed, "P", &all);
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let (mut bound, mut bound_worst) = (0, 0.0f64);
    for r in ends(&pv) {
        let ended = r.ended.unwrap_or(f64::NAN);
        let since_kill = ended - killed;
        *counts.entry(r.outcome.clone()).or_default() += 1;
        if r.index >= 60 {
            assert_eq!(r.outcome, "Sent", "request {} (D2's part)\n{all}", r.index);
            continue;
        }
        if since_kill < 0.0 {
            assert_eq!(
                r.outcome, "Sent",
                "request {} ended before the kill\n{all}",
                r.index
            );
            continue;
        }
        match r.outcome.as_str() {
            "Sent" | "Released(PeerDead)" => {
                bound += 1;
                bound_worst = bound_worst.max(since_kill);
                assert!(
                    since_kill <= BOUND_MS,
                    "request {} ended {} {since_kill:.0} ms after the kill\n{all}",
                    r.index,
                    r.outcome
                );
            }
            o if o.starts_with("Released(WriteFailed(") => {
                bound += 1;
                bound_worst = bound_worst.max(since_kill);
                assert!(since_kill <= BOUND_MS, "request {}: {o}\n{all}", r.index);
            }
            "Released(LeaseExpired)" => {
                let called = r.called.expect("a finished request has a call time");
                let earliest = called + LEASE_MS - SLACK_MS;
                let latest = called.max(killed) + LEASE_MS + SLACK_MS;
                assert!(
                    (earliest..=latest).contains(&ended),
                    "request {}: lease expired {:.0} ms after its finish (lease {LEASE_MS})\n{all}",
                    r.index,
                    ended - called
                );
            }
            o => panic!("request {}: unexpected outcome {o}\n{all}", r.index),
        }
    }

    let dv = d2.json(&all);
    check_node(&dv, REQUESTS - 60, &all);
    assert_eq!(dv["requests"], REQUESTS - 60, "{all}");
    assert_eq!(dv["outcomes"]["ready"], REQUESTS - 60, "{all}");
    assert_eq!(dv["verified"], REQUESTS - 60, "{all}");
    assert_eq!(dv["byte_errors"], 0, "{all}");
    assert_eq!(dv["ok"], true, "D2's strict verdict\n{all}");
    assert_eq!(dv["node"]["start_at"], 60, "{all}");
    for r in ends(&dv) {
        assert!(
            r.index >= 60 && r.outcome == "Ready" && r.byte_errors == 0,
            "{all}"
        );
    }
    assert!(p.status.is_some_and(|s| s.success()), "P's exit\n{all}");
    assert!(d2.status.is_some_and(|s| s.success()), "D2's exit\n{all}");
    println!(
        "kill D: P saw the death {detected:.0} ms after the kill (bound {BOUND_MS} ms); \
         {bound} requests bound to D1 at the kill ended within {bound_worst:.0} ms; \
         P outcomes {counts:?}; \
         all done in {took:?}"
    );
}

/// kill -9 of P in the middle of the run; P restarted with a later part of the plan.
///
/// D (`--requests 120 --expect-peer-loss --decode-deadline-ms 1500`) and P1 (`--requests 120`)
/// run; 400 ms into the schedule P1 is killed and P2 starts with `--start-at K`, K being the
/// first request the schedule brings well after P2 can be up (about 1.2 s later; the mean
/// arrival gap is 20 ms). From D's JSON:
/// - every request has exactly one typed outcome; D's pool is all free; no unexplained error;
/// - D declared P dead after the kill and within `2 H + SLACK`;
/// - requests that ended before the kill: `Ready`;
/// - requests live at the kill (allocated before it, not ended): `Ready` (P1's write had landed)
///   within `2 H + SLACK` of the kill, or `Failed(PeerDead)`: at once if never registered,
///   otherwise after D's fence (no earlier than the death plus the quarantine, no later than
///   `2 H + SLACK` plus the quarantine) — see [`check_fenced_end`];
/// - requests allocated after the kill, in the gap:
///   - `Failed(PeerDead)` after the fence: registered with the dead P before D noticed;
///   - `Failed(HandshakeFailed)`: allocated while no P listened (the connect is refused), ended
///     at once (within the bound of the call);
///   - `Failed(Deadline)` for `index < K`: allocated once P2 was up; P2 never prefills them
///     (its plan starts at K), so D's deadline ends them, one deadline after the call;
/// - requests `K..`: `Ready` with 0 byte errors; P2's JSON: all sent, strict verdict OK.
#[test]
fn kill_prefill_mid_run_then_restart_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr) = two_ports();
    let n = REQUESTS.to_string();
    let mut d = Node::start(
        "D",
        "decode",
        d_addr,
        p_addr,
        &[
            "--requests",
            &n,
            "--expect-peer-loss",
            "--decode-deadline-ms",
            &DECODE_DEADLINE_MS.to_string(),
        ],
    );
    let mut p1 = Node::start("P1", "prefill", p_addr, d_addr, &["--requests", &n]);
    d.await_schedule(deadline);
    let met = Instant::now();
    thread::sleep(Duration::from_millis(400));
    let killed = p1.kill();
    let p1_err = p1.stderr();
    drop(p1);
    // The first request due 1.2 s after now on D's schedule (arrivals 20 ms apart on average).
    let due = met.elapsed().as_secs_f64() * 1e3 + 1200.0;
    let k = ((due / GAP_MS).ceil() as u64).min(REQUESTS - 10);
    let p2 = Node::start(
        "P2",
        "prefill",
        p_addr,
        d_addr,
        &[
            "--requests",
            &n,
            "--start-at",
            &k.to_string(),
            "--linger-ms",
            "8000",
        ],
    );
    let done = finish_all(vec![d, p2], deadline);
    let took = started.elapsed();
    let all = format!(
        "K = {k}\n--- P1 stderr (killed)\n{p1_err}\n{}\n{}",
        done[0].show(),
        done[1].show()
    );
    let (d, p2) = (&done[0], &done[1]);
    assert!(
        d.status.is_some() && p2.status.is_some(),
        "killed at the deadline\n{all}"
    );

    let dv = d.json(&all);
    check_node(&dv, REQUESTS, &all);
    let detected = check_detection(&dv, killed, "D", &all);
    let quarantine = dv["node"]["quarantine_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("D reports its quarantine\n{all}"));
    assert!(
        quarantine < 5_000.0,
        "the fence flags took: {quarantine} ms\n{all}"
    );
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let (mut live, mut live_worst) = (0, 0.0f64);
    for r in ends(&dv) {
        let ended = r.ended.unwrap_or(f64::NAN);
        let called = r.called.expect("an allocated request has a call time");
        let since_kill = ended - killed;
        *counts.entry(r.outcome.clone()).or_default() += 1;
        if r.outcome == "Ready" {
            assert_eq!(r.byte_errors, 0, "request {}\n{all}", r.index);
        }
        if r.index >= k {
            assert_eq!(
                r.outcome,
                "Ready",
                "request {} (P2's part) allocated {:.0} ms after the kill\n{all}",
                r.index,
                called - killed
            );
            continue;
        }
        if since_kill < 0.0 {
            assert_eq!(
                r.outcome, "Ready",
                "request {} ended before the kill\n{all}",
                r.index
            );
            continue;
        }
        if called < killed {
            // Live at the kill.
            live += 1;
            live_worst = live_worst.max(since_kill);
            assert!(
                r.outcome == "Failed(PeerDead)" || r.outcome == "Ready",
                "request {} live at the kill ended {}\n{all}",
                r.index,
                r.outcome
            );
            check_fenced_end(&r, since_kill, detected, quarantine, &all);
            continue;
        }
        match r.outcome.as_str() {
            // Registered with the dead P before D noticed.
            "Failed(PeerDead)" => {
                live += 1;
                live_worst = live_worst.max(since_kill);
                check_fenced_end(&r, since_kill, detected, quarantine, &all);
            }
            "Failed(HandshakeFailed)" => assert!(
                ended - called <= BOUND_MS,
                "request {}: refused handshake took {:.0} ms\n{all}",
                r.index,
                ended - called
            ),
            "Failed(Deadline)" => {
                let waited = ended - called;
                assert!(
                    (DECODE_DEADLINE_MS - SLACK_MS..=DECODE_DEADLINE_MS + BOUND_MS)
                        .contains(&waited),
                    "request {}: deadline after {waited:.0} ms\n{all}",
                    r.index
                );
            }
            o => panic!(
                "request {}: unexpected outcome {o} in the gap\n{all}",
                r.index
            ),
        }
    }

    let pv = p2.json(&all);
    check_node(&pv, REQUESTS - k, &all);
    assert_eq!(pv["prefill_outcomes"]["sent"], REQUESTS - k, "{all}");
    assert_eq!(pv["ok"], true, "P2's strict verdict\n{all}");
    assert!(d.status.is_some_and(|s| s.success()), "D's exit\n{all}");
    assert!(p2.status.is_some_and(|s| s.success()), "P2's exit\n{all}");
    println!(
        "kill P: D saw the death {detected:.0} ms after the kill (bound {BOUND_MS} ms); \
         {live} requests live at the kill (or sent to the dead P) ended within \
         {live_worst:.0} ms; K = {k}; \
         D outcomes {counts:?}; all done in {took:?}"
    );
}
