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
//!
//! The read path's kill tests (`--mode pull`, and conversations with `--mode bidir`) kill a node
//! in the middle of a chosen request: the node stops itself (SIGSTOP, `--stop-self-after K`)
//! 2 ms after its call for request K — long enough for that call's messages to leave, too short
//! for the request to finish — and the test SIGKILLs it as soon as it sees it stopped. A kill
//! at a random instant would rarely find a read in flight (one takes 2–4 ms here).
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
    // Self-healing, with nothing done to D: once P2 listens, D's next request finds the dead P
    // forgotten and handshakes with P2 by itself, within one heartbeat period (plus the slack).
    let link = &pv["link"];
    let (listening, met) = (
        link["listening_ms"].as_f64().unwrap_or(f64::NAN),
        link["waited_ms"].as_f64().unwrap_or(f64::NAN),
    );
    assert!(
        met - listening <= H_MS + SLACK_MS,
        "P2 listened after {listening:.0} ms and met D after {met:.0} ms\n{all}"
    );
    assert_eq!(pv["ok"], true, "P2's strict verdict\n{all}");
    assert!(d.status.is_some_and(|s| s.success()), "D's exit\n{all}");
    assert!(p2.status.is_some_and(|s| s.success()), "P2's exit\n{all}");
    println!(
        "kill P: D saw the death {detected:.0} ms after the kill (bound {BOUND_MS} ms); \
         {live} requests live at the kill (or sent to the dead P) ended within \
         {live_worst:.0} ms; K = {k}; D met P2 {:.0} ms after it listened; \
         D outcomes {counts:?}; all done in {took:?}",
        met - listening
    );
}

/// The request P (or D) stops itself after, in the read path's kill tests: 20 arrivals (about
/// 400 ms) into the schedule.
const STOP_AT: u64 = 20;
/// Requests of the read path's kill tests.
const READ_REQUESTS: u64 = 60;

/// kill -9 of P in the middle of a read (`--mode pull`).
///
/// D (`--expect-peer-loss --decode-deadline-ms 1500`) and P run 60 pulled requests; P stops
/// itself right after answering request 20 (its answer, the block ids, reaches D over the
/// router link; D asks for the read) and is killed. From D's JSON:
/// - every request has exactly one typed outcome; D's pool is all free; no unexplained error;
/// - D declared P dead after the kill and within `2 H + SLACK`;
/// - requests that ended before the kill: `Ready`, every byte right;
/// - every read that was in progress at P's death, request 20's among them (allocated before
///   the death was seen, not ended at the kill): `Import(Failed(PeerDead))` within
///   `2 H + SLACK` of D seeing the death (or `Ready`, a read that had landed, within the bound
///   of the kill); a read started after D saw the death ends typed within the bound of its
///   call;
/// - requests whose answer never came (P was dead): `NoAnswer`, never called.
#[test]
fn kill_prefill_mid_read_in_pull_mode() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr, router) = three_ports();
    let (n, router, k) = (
        READ_REQUESTS.to_string(),
        router.to_string(),
        STOP_AT.to_string(),
    );
    let d = Node::start(
        "D",
        "decode",
        d_addr,
        p_addr,
        &[
            "--requests",
            &n,
            "--mode",
            "pull",
            "--router",
            &router,
            "--expect-peer-loss",
            "--decode-deadline-ms",
            &DECODE_DEADLINE_MS.to_string(),
        ],
    );
    let mut p = Node::start(
        "P",
        "prefill",
        p_addr,
        d_addr,
        &[
            "--requests",
            &n,
            "--mode",
            "pull",
            "--router",
            &router,
            "--stop-self-after",
            &k,
        ],
    );
    p.await_stopped(deadline);
    let killed = p.kill();
    let p_err = p.stderr();
    drop(p);
    let d = d.finish(deadline);
    let took = started.elapsed();
    let all = format!("--- P stderr (killed)\n{p_err}\n{}", d.show());
    assert!(d.status.is_some(), "killed at the deadline\n{all}");

    let dv = d.json(&all);
    check_node(&dv, READ_REQUESTS, &all);
    let detected = check_detection(&dv, killed, "D", &all);
    let seen = killed + detected;
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let (mut live, mut live_worst) = (0, 0.0f64);
    for r in ends(&dv) {
        *counts.entry(r.outcome.clone()).or_default() += 1;
        if r.outcome == "NoAnswer" {
            assert!(r.called.is_none(), "request {} was called\n{all}", r.index);
            continue;
        }
        let ended = r.ended.unwrap_or(f64::NAN);
        let called = r.called.expect("a called request has a call time");
        if r.outcome == "Ready" {
            assert_eq!(r.byte_errors, 0, "request {}\n{all}", r.index);
            assert!(
                ended - killed <= BOUND_MS,
                "request {} Ready {:.0} ms after the kill\n{all}",
                r.index,
                ended - killed
            );
            continue;
        }
        assert!(
            r.outcome.starts_with("Import(Failed("),
            "request {}: {} after P's death\n{all}",
            r.index,
            r.outcome
        );
        if called < seen {
            // In progress when P died (or asked a dead P before D noticed).
            live += 1;
            live_worst = live_worst.max(ended - seen);
            assert_eq!(
                r.outcome, "Import(Failed(PeerDead))",
                "request {}\n{all}",
                r.index
            );
            assert!(
                ended - seen <= BOUND_MS,
                "request {} ended {:.0} ms after D saw the death (bound {BOUND_MS} ms)\n{all}",
                r.index,
                ended - seen
            );
        } else {
            assert!(
                ended - called <= BOUND_MS,
                "request {}: {} took {:.0} ms\n{all}",
                r.index,
                r.outcome,
                ended - called
            );
        }
    }
    let stopped_at = ends(&dv)
        .into_iter()
        .find(|r| r.index == STOP_AT)
        .expect("request K");
    assert_eq!(
        stopped_at.outcome, "Import(Failed(PeerDead))",
        "the read P stopped in the middle of\n{all}"
    );
    assert!(live >= 1, "{all}");
    assert!(d.status.is_some_and(|s| s.success()), "D's exit\n{all}");
    println!(
        "kill P mid-read: D saw the death {detected:.0} ms after the kill (bound {BOUND_MS} ms); \
         {live} reads in progress ended typed within {live_worst:.0} ms of D seeing it; \
         D outcomes {counts:?}; all done in {took:?}"
    );
}

/// kill -9 of D while P holds exported blocks for it (`--mode pull`).
///
/// P (`--expect-peer-loss`) and D run 60 pulled requests; D stops itself right after
/// allocating request 20 (its ask for the read has left: P grants it, but D never reads nor
/// releases) and is killed. From P's JSON:
/// - every request has exactly one typed outcome; P's pool is all free; no unexplained error;
/// - P declared D dead after the kill and within `2 H + SLACK`;
/// - requests read before the kill: `Read`;
/// - exports granted to D (request 20's among them): `Unread(GrantFenced)`, freed by the grant's
///   fence and never before it: no earlier than the export's start plus the fence
///   (`max_message_delay + max_write_life`; the grant came after the start), no later than the
///   kill plus the fence (it came before);
/// - exports D never asked for: `Unread(LeaseExpired)`, one lease after P's answer (no reader
///   renewed them) — D's death changes nothing for them.
#[test]
fn kill_decode_holding_pulled_exports() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr, router) = three_ports();
    let (n, router, k) = (
        READ_REQUESTS.to_string(),
        router.to_string(),
        STOP_AT.to_string(),
    );
    let p = Node::start(
        "P",
        "prefill",
        p_addr,
        d_addr,
        &[
            "--requests",
            &n,
            "--mode",
            "pull",
            "--router",
            &router,
            "--expect-peer-loss",
            "--linger-ms",
            "2000",
        ],
    );
    let mut d = Node::start(
        "D",
        "decode",
        d_addr,
        p_addr,
        &[
            "--requests",
            &n,
            "--mode",
            "pull",
            "--router",
            &router,
            "--stop-self-after",
            &k,
        ],
    );
    d.await_stopped(deadline);
    let killed = d.kill();
    let d_err = d.stderr();
    drop(d);
    let p = p.finish(deadline);
    let took = started.elapsed();
    let all = format!("--- D stderr (killed)\n{d_err}\n{}", p.show());
    assert!(p.status.is_some(), "killed at the deadline\n{all}");

    let pv = p.json(&all);
    check_node(&pv, READ_REQUESTS, &all);
    let detected = check_detection(&pv, killed, "P", &all);
    let fence = pv["node"]["grant_fence_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("P reports its grant fence\n{all}"));
    assert!(
        (1000.0..5000.0).contains(&fence),
        "the fence flags took: {fence} ms\n{all}"
    );
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let (mut fenced, mut fence_margin) = (0, f64::INFINITY);
    let mut expired = 0;
    for r in ends(&pv) {
        *counts.entry(r.outcome.clone()).or_default() += 1;
        let ended = r.ended.unwrap_or(f64::NAN);
        let called = r.called.expect("P answered every request");
        match (r.outcome.as_str(), r.proof.as_deref()) {
            ("Read", _) => assert!(
                ended - killed <= BOUND_MS,
                "request {} read {:.0} ms after the kill\n{all}",
                r.index,
                ended - killed
            ),
            ("Unread(GrantFenced)", Some("GrantFence")) => {
                fenced += 1;
                // Never freed before the fence: the grant came after the export started.
                assert!(
                    ended >= called + fence - 20.0,
                    "request {} freed {:.0} ms after its export started, before the fence \
                     ({fence} ms)\n{all}",
                    r.index,
                    ended - called
                );
                assert!(
                    ended <= killed + fence + SLACK_MS,
                    "request {} freed {:.0} ms after the kill (fence {fence} ms)\n{all}",
                    r.index,
                    ended - killed
                );
                fence_margin = fence_margin.min(ended - called - fence);
            }
            ("Unread(LeaseExpired)", Some("NeverGranted")) => {
                expired += 1;
                assert!(
                    ended >= called + LEASE_MS - 20.0
                        && ended <= called.max(killed) + LEASE_MS + SLACK_MS,
                    "request {}: lease expired {:.0} ms after its export (lease {LEASE_MS})\n{all}",
                    r.index,
                    ended - called
                );
            }
            (o, proof) => panic!("request {}: {o} ({proof:?}) after D's kill\n{all}", r.index),
        }
    }
    let stopped_at = ends(&pv)
        .into_iter()
        .find(|r| r.index == STOP_AT)
        .expect("request K");
    assert_eq!(
        stopped_at.outcome, "Unread(GrantFenced)",
        "the export D stopped in the middle of reading\n{all}"
    );
    assert!(fenced >= 1 && expired >= 1, "{counts:?}\n{all}");
    assert!(p.status.is_some_and(|s| s.success()), "P's exit\n{all}");
    println!(
        "kill D holding exports: P saw the death {detected:.0} ms after the kill (bound \
         {BOUND_MS} ms); {fenced} granted exports freed by the fence ({fence} ms), the earliest \
         {fence_margin:.0} ms after its start plus the fence; {expired} offered ones by their \
         lease; P outcomes {counts:?}; all done in {took:?}"
    );
}

/// kill -9 of D holding a conversation's kept turn while P reads it back (`--mode bidir`).
///
/// Both run with a 1 s heartbeat (peer timeout 1.5 s), and D is killed 400 ms after it
/// stopped, so that P is surely waiting for D's grant when D dies (the turn comes back 5–150 ms
/// after the keep) and D's silence alone has not made P declare it dead yet; the bounds are
/// `2 H + SLACK` of that heartbeat.
///
/// P (`--expect-peer-loss`) and D run 40 turns (10 conversations of 4); D stops itself right
/// after keeping request 24 (conversation 6's first turn, about 120 ms into the schedule; its
/// answer reaches P over the router link) and is killed. P's turn 2 of that conversation
/// (request 25: with seed 11 its prefix is above the recompute threshold and its think time
/// short) comes a think time later and asks D for the kept blocks: the read waits for a D that
/// never answers. From P's JSON:
/// - every request has exactly one typed outcome (`Abandoned` for later turns of a
///   conversation D never kept); P's pool is all free; no unexplained error;
/// - P declared D dead after the kill and within `2 H + SLACK`;
/// - every read back that failed (request 25's among them, `Read(Failed(PeerDead))`) ended
///   within `2 H + SLACK` of P seeing the death, or of its call if it came later.
#[test]
fn kill_decode_holding_a_kept_turn_while_p_reads_it_back() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let started = Instant::now();
    let deadline = started + WAIT;
    let (p_addr, d_addr, router) = three_ports();
    let router = router.to_string();
    const KEPT: u64 = 24;
    // Conversations grow: longer prompts (so that prefixes reach the recompute threshold) and
    // a larger pool.
    const H: f64 = 1000.0;
    let bound = 2.0 * H + SLACK_MS;
    let sizes = [
        ("--max-prompt-tokens", "256"),
        ("--pool-blocks", "256"),
        ("--heartbeat-ms", "1000"),
    ];
    let p = Node::start_with(
        "P",
        "prefill",
        p_addr,
        d_addr,
        &sizes,
        &[
            "--requests",
            "40",
            "--mode",
            "bidir",
            "--router",
            &router,
            "--expect-peer-loss",
            "--decode-deadline-ms",
            &DECODE_DEADLINE_MS.to_string(),
            "--linger-ms",
            "2000",
        ],
    );
    let mut d = Node::start_with(
        "D",
        "decode",
        d_addr,
        p_addr,
        &sizes,
        &[
            "--requests",
            "40",
            "--mode",
            "bidir",
            "--router",
            &router,
            "--stop-self-after",
            &KEPT.to_string(),
        ],
    );
    d.await_stopped(deadline);
    // P's turn comes back 5–150 ms after the keep and asks the stopped D; D is killed after
    // that, well before its silence could make P declare it dead (1.5 s).
    thread::sleep(Duration::from_millis(400));
    let killed = d.kill();
    let d_err = d.stderr();
    drop(d);
    let p = p.finish(deadline);
    let took = started.elapsed();
    let all = format!("--- D stderr (killed)\n{d_err}\n{}", p.show());
    assert!(p.status.is_some(), "killed at the deadline\n{all}");

    let pv = p.json(&all);
    check_node(&pv, 40, &all);
    assert_eq!(pv["node"]["heartbeat_ms"], H, "{all}");
    let detected = check_detection_within(&pv, killed, bound, "P", &all);
    let seen = killed + detected;
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    let mut turns = std::collections::BTreeMap::<String, u64>::new();
    let (mut failed_reads, mut worst) = (0, f64::NEG_INFINITY);
    for r in ends(&pv) {
        *counts.entry(r.outcome.clone()).or_default() += 1;
        let Some(turn) = r.turn.clone() else { continue };
        *turns.entry(turn.clone()).or_default() += 1;
        if !turn.starts_with("Read(") || turn == "Read(Loaded)" {
            continue;
        }
        failed_reads += 1;
        let (called, ended) = (
            r.turn_called.expect("a read back has a call time"),
            r.turn_ended.expect("a failed read back has an end"),
        );
        let since = ended - seen.max(called);
        worst = worst.max(since);
        assert!(
            since <= bound,
            "request {}: read back {turn} ended {since:.0} ms after P saw the death (or its \
             call) (bound {bound} ms)\n{all}",
            r.index
        );
    }
    let waiting = ends(&pv)
        .into_iter()
        .find(|r| r.index == KEPT + 1)
        .expect("the next turn");
    assert_eq!(
        waiting.turn.as_deref(),
        Some("Read(Failed(PeerDead))"),
        "P's read back of the kept turn\n{all}"
    );
    assert!(
        waiting.turn_called.is_some_and(|c| c < seen),
        "P was waiting when D died\n{all}"
    );
    assert!(p.status.is_some_and(|s| s.success()), "P's exit\n{all}");
    println!(
        "kill D holding a kept turn: P saw the death {detected:.0} ms after the kill (bound \
         {bound} ms, heartbeat {H} ms); {failed_reads} reads back failed typed, the latest \
         {worst:.0} ms after P saw the death (or its call); P outcomes {counts:?}; turns \
         {turns:?}; all done in {took:?}"
    );
}
