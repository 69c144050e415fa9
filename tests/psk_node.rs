//! `kvhandoff node --psk-file`: P and D as two processes over NIXL (as in `tests/two_process.rs`)
//! with an authenticated side channel. The same key file on both sides: the run verifies every
//! request. Different keys: both exit non-zero within their `--timeout-secs`, each naming the
//! authentication failure. A bad key file exits 2 at once. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test psk_node`.
#![cfg(feature = "nixl")]

mod nodes;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use nodes::{finish_all, require_runtime, two_ports, Node, ONE_AT_A_TIME};

const REQUESTS: &str = "40";

/// A small run: tiny prompts, a small pool.
const ARGS: [&str; 10] = [
    "--requests",
    REQUESTS,
    "--seed",
    "11",
    "--max-prompt-tokens",
    "16",
    "--pool-blocks",
    "32",
    "--mean-arrival-gap-ms",
    "12",
];

/// A key file in a temporary directory (removed with it).
fn key_file(dir: &tempfile::TempDir, name: &str, contents: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

fn run_pair(p_key: &PathBuf, d_key: &PathBuf, timeout_secs: &str) -> Vec<nodes::Finished> {
    let (p_addr, d_addr) = two_ports();
    let mut args: Vec<&str> = ARGS.to_vec();
    args.extend(["--timeout-secs", timeout_secs, "--linger-ms", "2000"]);
    let with_key = |key: &PathBuf| {
        let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        a.extend(["--psk-file".into(), key.display().to_string()]);
        a
    };
    let (pa, da) = (with_key(p_key), with_key(d_key));
    let pa: Vec<&str> = pa.iter().map(String::as_str).collect();
    let da: Vec<&str> = da.iter().map(String::as_str).collect();
    let d = Node::spawn("D", "decode", d_addr, p_addr, &da);
    let p = Node::spawn("P", "prefill", p_addr, d_addr, &pa);
    finish_all(vec![p, d], Instant::now() + Duration::from_secs(90))
}

#[test]
fn the_same_key_file_on_both_nodes_verifies_the_run() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let dir = tempfile::tempdir().unwrap();
    // As `openssl rand -hex 32 > key` writes it: 64 characters and a newline.
    let key = key_file(&dir, "key", format!("{}\n", "5e".repeat(32)).as_bytes());
    let done = run_pair(&key, &key, "60");
    let all: String = done.iter().map(|f| f.show()).collect();
    for f in &done {
        assert_eq!(f.status.and_then(|s| s.code()), Some(0), "{all}");
    }
    let (p, d) = (done[0].json(&all), done[1].json(&all));
    let requests: u64 = REQUESTS.parse().unwrap();
    assert_eq!(d["verified"], requests, "D verified every request: {all}");
    assert_eq!(
        (d["ok"].clone(), p["ok"].clone()),
        (true.into(), true.into()),
        "{all}"
    );
    assert!(
        done[1].stderr.contains("handshake with prefill-0/0 took"),
        "{all}"
    );
}

#[test]
fn different_keys_fail_both_nodes_within_their_timeout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let dir = tempfile::tempdir().unwrap();
    let a = key_file(&dir, "a", b"the key of the prefill node, 32B");
    let b = key_file(&dir, "b", b"the key of the decode node, 32 B");
    let started = Instant::now();
    let done = run_pair(&a, &b, "8");
    let took = started.elapsed();
    let all: String = done.iter().map(|f| f.show()).collect();
    for f in &done {
        let code = f.status.and_then(|s| s.code());
        assert!(
            code.is_some_and(|c| c != 0),
            "{} exits non-zero: {all}",
            f.name
        );
        let said = format!("{}{}", f.stdout, f.stderr);
        assert!(
            said.contains("failed authentication"),
            "{} names the authentication failure: {all}",
            f.name
        );
    }
    // 8 s of timeout, P's linger (2 s) and start-up; killed at 90 s otherwise.
    assert!(took < Duration::from_secs(30), "{took:?}: {all}");
}

#[test]
fn a_bad_key_file_exits_2_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let short = key_file(&dir, "short", b"too short\n");
    let empty = key_file(&dir, "empty", b"\n");
    let missing = dir.path().join("missing");
    let (p_addr, d_addr) = two_ports();
    for (path, says) in [
        (&short, "at least 16"),
        (&empty, "empty"),
        (&missing, "cannot read"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
            .args(["node", "--role", "decode"])
            .args([
                "--listen",
                &d_addr.to_string(),
                "--peer",
                &p_addr.to_string(),
            ])
            .arg("--psk-file")
            .arg(path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{path:?}: {stderr}");
        assert!(
            stderr.contains("--psk-file") && stderr.contains(says),
            "{path:?}: {stderr}"
        );
    }
}
