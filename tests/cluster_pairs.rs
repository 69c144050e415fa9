//! `kvhandoff cluster --model M --prefill SPEC --decode SPEC`: heterogeneous pairs across
//! processes. Every rank of both engines is its own `kvhandoff node --model …` process with its
//! own NIXL agent and TCP side channel; a routed rank's handshake is accepted by the peer's
//! route, D names its request's buffers in each registration (`Register::memory`) and P places
//! its pieces there; every D rank checks every byte of its own rank in its own geometry. Needs
//! the NIXL runtime: `source scripts/nixl-env.sh && cargo test --features nixl --test
//! cluster_pairs`.
#![cfg(feature = "nixl")]

mod nodes;

use std::process::Command;

use nodes::pair_cluster::{kill, run_mode};
use nodes::{require_runtime, ONE_AT_A_TIME};
use serde_json::Value;

/// Runs the pair's push through `cluster` (and its router), checks the report and returns it.
fn pair(model: &str, prefill: &str, decode: &str, ranks: (u64, u64), requests: u32) -> Value {
    run_mode("push", model, prefill, decode, ranks, requests, 7)
}

/// Less TP on D (each D rank gathers the heads of two P processes), larger blocks, another
/// layout.
#[test]
fn tp_down_with_another_block_size_and_layout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "gqa8",
        "tp=4,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
        (4, 2),
        32,
    );
}

/// More TP on D (one P process writes a slice of its heads to each of four D processes), and
/// another layout.
#[test]
fn tp_up_with_another_layout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "gqa8",
        "tp=1,block=16,layout=HND",
        "tp=4,block=16,layout=NHD",
        (1, 4),
        32,
    );
}

/// A hybrid cache (sliding-window layers beside full attention) with P's pipeline stages: each
/// stage writes its layers to the D ranks that hold them.
#[test]
fn a_sliding_window_hybrid_from_pipeline_stages() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "swa",
        "tp=1,block=32,layout=NHD,pp=2",
        "tp=2,block=16,layout=HND",
        (2, 2),
        32,
    );
}

/// A mamba hybrid: the state slots move beside the attention blocks, block size and TP differ.
#[test]
fn a_mamba_hybrid_across_tp_and_block_size() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    pair(
        "mamba",
        "tp=2,block=16,layout=HND",
        "tp=1,block=64,layout=HND",
        (2, 1),
        32,
    );
}

/// Two engines started with different pairs cannot pair: P's route refuses D's handshake (a
/// geometry its plan does not have), counted by reason on P; D starts no request and both end
/// at their limit, FAILED, with nothing written.
#[test]
fn ranks_of_different_pairs_refuse_each_other() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (p_addr, d_addr) = nodes::two_ports();
    let node = |role: &str, listen: std::net::SocketAddr, peer: std::net::SocketAddr, d: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .args(["node", "--json", "--role", role, "--rank", "0"])
            .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
            .args(["--model", "gqa8", "--prefill", "tp=1,block=16,layout=NHD"])
            .args(["--decode", d, "--requests", "4", "--timeout-secs", "4"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kvhandoff starts")
    };
    let p = node("prefill", p_addr, d_addr, "tp=1,block=32,layout=HND");
    let d = node("decode", d_addr, p_addr, "tp=1,block=64,layout=HND");
    let (p, d) = (
        p.wait_with_output().expect("P ends"),
        d.wait_with_output().expect("D ends"),
    );
    let all = format!(
        "P:\n{}\n{}\nD:\n{}\n{}",
        String::from_utf8_lossy(&p.stdout),
        String::from_utf8_lossy(&p.stderr),
        String::from_utf8_lossy(&d.stdout),
        String::from_utf8_lossy(&d.stderr)
    );
    let json = |out: &std::process::Output| -> Value {
        let text = String::from_utf8_lossy(&out.stdout);
        let start = text.find('{').unwrap_or_else(|| panic!("no report\n{all}"));
        serde_json::Deserializer::from_str(&text[start..])
            .into_iter::<Value>()
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("no report\n{all}"))
    };
    let (pr, dr) = (json(&p), json(&d));
    assert!(
        pr["handshakes_refused"]["incompatible"].as_u64() >= Some(1),
        "P refused D's handshake as incompatible\n{all}"
    );
    assert_eq!(pr["ok"], false, "{all}");
    assert_eq!(pr["done"], 0, "{all}");
    assert_eq!(dr["ok"], false, "{all}");
    assert_eq!(dr["done"], 0, "{all}");
    assert_eq!(dr["missing"], 4, "D started nothing\n{all}");
    assert!(!p.status.success() && !d.status.success(), "{all}");
}

/// A rank process of a pair, its stderr watched for the line that starts its schedule.
struct Rank {
    child: std::process::Child,
    spawned: std::time::Instant,
    up: std::sync::Arc<std::sync::OnceLock<std::time::Instant>>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Rank {
    fn start(
        role: &str,
        rank: u32,
        ports: (std::net::SocketAddr, std::net::SocketAddr),
        extra: &[String],
    ) -> Rank {
        use std::io::BufRead;
        let (p, d) = ports;
        let (listen, peer) = if role == "prefill" { (p, d) } else { (d, p) };
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .args([
                "node",
                "--json",
                "--role",
                role,
                "--rank",
                &rank.to_string(),
            ])
            .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
            .args(KILL_PAIR)
            .args(["--mean-arrival-gap-ms", &GAP_MS.to_string()])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kvhandoff starts");
        let up = std::sync::Arc::new(std::sync::OnceLock::new());
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let pipe = child.stderr.take().expect("stderr");
        let (mark, text) = (up.clone(), stderr.clone());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if line.contains("running the schedule") {
                    let _ = mark.set(std::time::Instant::now());
                }
                if let Ok(mut all) = text.lock() {
                    all.push_str(&line);
                    all.push('\n');
                }
            }
        });
        Rank {
            child,
            spawned: std::time::Instant::now(),
            up,
            stderr,
        }
    }

    /// When it started its schedule, waiting at most until `deadline`.
    fn await_up(&self, deadline: std::time::Instant) -> std::time::Instant {
        loop {
            if let Some(at) = self.up.get() {
                return *at;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a rank never started its schedule"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Its report (or a panic with everything it printed).
    fn finish(self) -> (Value, std::process::ExitStatus, String) {
        let out = self.child.wait_with_output().expect("the rank ends");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let err = self.stderr.lock().map(|s| s.clone()).unwrap_or_default();
        let all = format!("{text}\n{err}");
        let start = text.find('{').unwrap_or_else(|| panic!("no report\n{all}"));
        let report = serde_json::Deserializer::from_str(&text[start..])
            .into_iter::<Value>()
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("no report\n{all}"));
        (report, out.status, all)
    }
}

/// The pair of the kill test and the flags every rank of it gets: less TP on D (its one rank
/// gathers both P ranks' heads, so every request needs the victim), a fixed gap between
/// request starts ([`GAP_MS`]), 16 in flight, and the timings a kill needs within the run (a 500 ms
/// heartbeat, fabric bounds that make D's fence about 4 s, D's deadline 2 s; the surviving P's
/// lease 3 s, for requests D gave up on before registering with it).
const KILL_PAIR: [&str; 22] = [
    "--model",
    "gqa8",
    "--prefill",
    "tp=2,block=16,layout=NHD",
    "--decode",
    "tp=1,block=32,layout=HND",
    "--requests",
    "240",
    "--window",
    "16",
    "--timeout-secs",
    "40",
    "--heartbeat-ms",
    "500",
    "--registration-ttl-ms",
    "1000",
    "--max-write-life-ms",
    "1500",
    "--max-message-delay-ms",
    "500",
    "--decode-deadline-ms",
    "2000",
];

/// The gap between request starts in [`KILL_PAIR`], ms.
const GAP_MS: u64 = 40;

/// kill -9 of one P rank of a pair whose D rank gathers from both P ranks, in the middle of the
/// run, and its restart with the rest of the plan: every rank ends every request it started
/// with one typed outcome, no byte is wrong, no block is left out, the requests in flight at
/// the death fail typed on D (and are cancelled on the other P rank), and the restarted rank
/// serves every request from K on.
#[test]
fn a_killed_prefill_rank_of_a_pair_fails_typed_and_is_served_after_restart() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    // Each engine's base port, its ranks above it: P's at 0 and 1, D's at 2.
    let [p_base, _, d_base, _] = kvhandoff_testkit::ports::loopback_ports::<4>();
    let ports = (p_base, d_base);
    let survivor = ["--expect-peer-loss".to_string()];
    let d = Rank::start("decode", 0, ports, &survivor);
    let p_survivor = [
        "--expect-peer-loss".to_string(),
        "--lease-ms".to_string(),
        "3000".to_string(),
    ];
    let p0 = Rank::start("prefill", 0, ports, &p_survivor);
    let mut p1 = Rank::start("prefill", 1, ports, &[]);
    let d_zero = d.await_up(deadline);
    let p1_zero = p1.await_up(deadline);
    let startup = p1_zero.saturating_duration_since(p1.spawned);
    // Request 40 is due on the victim's schedule 1.6 s in.
    let kill_at = p1_zero + std::time::Duration::from_millis(40 * GAP_MS);
    std::thread::sleep(kill_at.saturating_duration_since(std::time::Instant::now()));
    p1.child.kill().expect("kill -9");
    let killed = std::time::Instant::now();
    let _ = p1.child.wait();
    // K: the first request due on D's schedule a lead after now, the lead the victim's
    // start-up and 1.5 s more, so that the new process met D before D allocates K.
    let lead = startup + std::time::Duration::from_millis(1500);
    let due = (killed + lead)
        .saturating_duration_since(d_zero)
        .as_millis() as u64;
    let k = due / GAP_MS + 1;
    let into = killed.saturating_duration_since(p1_zero).as_millis() as u64 / GAP_MS;
    assert!(
        (into + 10..230).contains(&k) && into < 240,
        "the kill landed mid-run (request {into} of the victim's, K = {k}); start-up {startup:?}, \
         D up {:?} after the victim",
        d_zero.saturating_duration_since(p1_zero)
    );
    let restart = [
        "--start-at".to_string(),
        k.to_string(),
        "--expect-peer-loss".to_string(),
    ];
    let p1b = Rank::start("prefill", 1, ports, &restart);
    let (dr, ds, d_all) = d.finish();
    let (p0r, p0s, p0_all) = p0.finish();
    let (p1r, p1s, p1_all) = p1b.finish();
    let all = format!("K = {k}, killed at request {into}\n--- D\n{d_all}\n--- P0\n{p0_all}\n--- P1 restarted\n{p1_all}");
    // Every survivor: one typed outcome per request, nothing wrong, nothing leaked.
    for (name, r, status) in [("D", &dr, ds), ("P0", &p0r, p0s)] {
        assert_eq!(r["ok"], true, "{name}\n{all}");
        assert!(status.success(), "{name}\n{all}");
        assert_eq!(r["missing"], 0, "{name}\n{all}");
        assert_eq!(r["byte_errors"], 0, "{name}\n{all}");
        assert_eq!(r["leaked_blocks"], 0, "{name}\n{all}");
        let outcomes = r["outcomes"].as_object().expect("outcomes");
        let total: u64 = outcomes.values().filter_map(Value::as_u64).sum();
        assert_eq!(total, 240, "{name}: one event per request\n{all}");
    }
    // D: the requests in flight at the death and those allocated while P1 was down failed,
    // typed by a cause the death explains; everything from K on came.
    let d_outcomes = dr["outcomes"].as_object().expect("outcomes");
    let failed: u64 = d_outcomes
        .iter()
        .filter(|(o, _)| *o != "Ready")
        .map(|(_, n)| n.as_u64().unwrap_or(0))
        .sum();
    assert!(failed > 0, "the death failed requests on D\n{all}");
    for outcome in d_outcomes.keys().filter(|o| *o != "Ready") {
        assert!(
            [
                "Failed(PeerDead)",
                "Failed(HandshakeFailed)",
                "Failed(Deadline)"
            ]
            .contains(&outcome.as_str())
                || outcome.starts_with("Failed(WriteFailed("),
            "D: {outcome} is not a cause a P death explains\n{all}"
        );
    }
    assert!(
        dr["done"].as_u64() >= Some(240 - k),
        "D verified K..\n{all}"
    );
    // P0: what D gave up on was cancelled, or P0's lease on it ended.
    for outcome in p0r["outcomes"].as_object().expect("outcomes").keys() {
        assert!(
            [
                "Sent",
                "Released(CancelledByPeer)",
                "Released(LeaseExpired)"
            ]
            .contains(&outcome.as_str())
                || outcome.starts_with("Released(WriteFailed("),
            "P0: {outcome}\n{all}"
        );
    }
    // The restarted rank: served again. Every request from K on has one typed outcome; those
    // D gave up on before the new process met it (a start-up slower than the lead on a
    // loaded host) ended by the lease, and at least half of them were sent.
    assert_eq!(p1r["ok"], true, "{all}");
    assert!(p1s.success(), "{all}");
    assert_eq!(p1r["start_at"], k, "{all}");
    assert_eq!(p1r["requests"], 240 - k, "{all}");
    assert_eq!(p1r["missing"], 0, "{all}");
    assert!(
        p1r["done"].as_u64().unwrap_or(0) * 2 >= 240 - k,
        "the restarted rank served K..\n{all}"
    );
    for outcome in p1r["outcomes"].as_object().expect("outcomes").keys() {
        assert!(
            ["Sent", "Released(LeaseExpired)"].contains(&outcome.as_str()),
            "P1 restarted: {outcome}\n{all}"
        );
    }
    eprintln!(
        "killed P rank 1 at its request {into}, restarted at K = {k}; D {}; P0 {}; P1 restarted {}",
        dr["outcomes"], p0r["outcomes"], p1r["outcomes"]
    );
}

/// `cluster --kill` of a D rank of a pair whose one P rank writes to both D ranks: the router
/// abandons the requests the restart skips (P holds none of them for it), every survivor
/// accounts for every request (typed, nothing wrong, nothing leaked), the restarted D rank is
/// served again, and every process is gone.
#[test]
fn cluster_kills_and_restarts_a_decode_rank_of_a_pair() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let (report, all) = kill(
        "push",
        "decode",
        "tp=1,block=16,layout=NHD",
        "tp=2,block=32,layout=HND",
    );
    assert_eq!(report["kill"]["survivor"]["engine"], "prefill", "{all}");
}

/// Ranks of a pair authenticate their handshakes with a pre-shared key (`--psk-file`): with the
/// same key they hand off every request; with another key P refuses D's handshakes as failed
/// authentication and D starts nothing.
#[test]
fn a_pair_authenticates_its_handshakes_with_a_pre_shared_key() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let dir = std::env::temp_dir().join(format!("kvh-pair-psk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let key = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("a key file");
        path.to_string_lossy().to_string()
    };
    let (one, other) = (
        key("one", "0123456789abcdef0123456789abcdef"),
        key("other", "fedcba9876543210fedcba9876543210"),
    );
    let run = |p_key: &str, d_key: &str| {
        let (p_addr, d_addr) = nodes::two_ports();
        let node =
            |role: &str, listen: std::net::SocketAddr, peer: std::net::SocketAddr, k: &str| {
                Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
                    .args(["node", "--json", "--role", role, "--rank", "0"])
                    .args(["--listen", &listen.to_string(), "--peer", &peer.to_string()])
                    .args(["--model", "gqa8", "--prefill", "tp=1,block=16,layout=NHD"])
                    .args(["--decode", "tp=1,block=32,layout=HND", "--requests", "8"])
                    .args(["--timeout-secs", "4", "--psk-file", k])
                    .output()
            };
        let d = std::thread::scope(|scope| {
            let d = scope.spawn(|| node("decode", d_addr, p_addr, d_key));
            let p = node("prefill", p_addr, d_addr, p_key).expect("P runs");
            (d.join().expect("D's thread").expect("D runs"), p)
        });
        let json = |out: &std::process::Output| -> Value {
            let text = String::from_utf8_lossy(&out.stdout);
            let start = text.find('{').unwrap_or(0);
            serde_json::Deserializer::from_str(&text[start..])
                .into_iter::<Value>()
                .next()
                .and_then(Result::ok)
                .unwrap_or(Value::Null)
        };
        let all = format!(
            "D:\n{}\n{}\nP:\n{}\n{}",
            String::from_utf8_lossy(&d.0.stdout),
            String::from_utf8_lossy(&d.0.stderr),
            String::from_utf8_lossy(&d.1.stdout),
            String::from_utf8_lossy(&d.1.stderr)
        );
        (json(&d.0), json(&d.1), all)
    };
    let (d, p, all) = run(&one, &one);
    assert_eq!(d["ok"], true, "the same key\n{all}");
    assert_eq!(d["done"], 8, "{all}");
    assert_eq!(p["ok"], true, "{all}");
    let (d, p, all) = run(&one, &other);
    assert_eq!(d["ok"], false, "another key\n{all}");
    assert_eq!(d["done"], 0, "{all}");
    assert!(
        p["handshakes_refused"]["authentication_failed"].as_u64() >= Some(1),
        "P refused D's handshakes as failed authentication\n{all}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
