//! `kvhandoff node --metrics-addr`: P and D as two processes over NIXL (as in
//! `tests/two_process.rs`), each serving the runtime's Prometheus metrics. The test scrapes
//! both endpoints during the run and once more after each node printed its report
//! (`--metrics-linger-ms` keeps them serving), and checks that the final figures are the
//! reports' own: requests by outcome, bytes, failures, peer deaths. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --all-features --test metrics_node`.
#![cfg(feature = "nixl")]

mod nodes;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nodes::{finish_all, require_runtime, Node, ONE_AT_A_TIME};
use serde_json::Value;

const REQUESTS: u64 = 60;
const WAIT: Duration = Duration::from_secs(90);
/// How long each node keeps serving after its report: many scrape intervals.
const LINGER_MS: &str = "1500";

const ARGS: [&str; 14] = [
    "--requests",
    "60",
    "--seed",
    "11",
    "--max-prompt-tokens",
    "16",
    "--pool-blocks",
    "32",
    "--mean-arrival-gap-ms",
    "12",
    "--timeout-secs",
    "60",
    "--metrics-linger-ms",
    LINGER_MS,
];

/// Four free loopback ports, all bound at once so that they differ, from below the ephemeral
/// range.
fn four_ports() -> [SocketAddr; 4] {
    kvhandoff_testkit::ports::loopback_ports()
}

/// `GET /metrics`: the status line and the body, or `None` when nothing listens (yet).
fn scrape(addr: SocketAddr) -> Option<(String, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    Some((head.to_string(), body.to_string()))
}

/// The samples of a text exposition: `name{a="x",b="y"}` (labels sorted) → value.
fn samples(body: &str) -> BTreeMap<String, f64> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let key = match key.split_once('{') {
                Some((name, labels)) => {
                    let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                    labels.sort_unstable();
                    format!("{name}{{{}}}", labels.join(","))
                }
                None => key.to_string(),
            };
            Some((key, value.parse().ok()?))
        })
        .collect()
}

/// What the scraper of one node saw.
#[derive(Default)]
struct Scrapes {
    /// A scrape taken while the node ran its schedule (before its report).
    during: Option<(String, String)>,
    /// The first scrape begun after the node said its report was printed.
    after: Option<(String, String)>,
}

/// Scrapes `addr` every 50 ms until a scrape begun after the report came back, or `deadline`.
fn scraper(addr: SocketAddr, stderr: Arc<Mutex<String>>, deadline: Instant) -> Scrapes {
    let mut seen = Scrapes::default();
    let text = || stderr.lock().unwrap_or_else(|e| e.into_inner()).clone();
    while Instant::now() < deadline {
        let before = text();
        let reported = before.contains("report printed");
        let running = before.contains("running the schedule");
        if let Some(got) = scrape(addr) {
            if reported {
                seen.after = Some(got);
                break;
            }
            if running && seen.during.is_none() {
                seen.during = Some(got);
            }
        }
        thread::sleep(Duration::from_millis(50));
    }
    seen
}

fn as_str(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The value of `key` in `m`, or a failure naming it.
fn get(m: &BTreeMap<String, f64>, key: &str, all: &str) -> u64 {
    let v = m
        .get(key)
        .unwrap_or_else(|| panic!("{key} missing from the scrape\n{all}"));
    *v as u64
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// The names every scrape shows, whatever the node's role.
const NAMES: [&str; 23] = [
    "kvhandoff_xfer_time_seconds",
    "kvhandoff_post_time_seconds",
    "kvhandoff_bytes_transferred",
    "kvhandoff_num_descriptors",
    "kvhandoff_handshake_time_seconds",
    "kvhandoff_num_failed_transfers_total",
    "kvhandoff_num_failed_notifications_total",
    "kvhandoff_requests_by_proof_total",
    "kvhandoff_side_channel_rejections_total",
    "kvhandoff_blocks_quarantined",
    "kvhandoff_peers",
    "kvhandoff_requests_total",
    "kvhandoff_bytes_transferred_total",
    "kvhandoff_calls_refused_late_total",
    "kvhandoff_requests_fenced_total",
    "kvhandoff_num_kv_expired_reqs_total",
    "kvhandoff_stuck_writes_total",
    "kvhandoff_messages_dropped_total",
    "kvhandoff_peers_declared_dead_total",
    "kvhandoff_tombstones_evicted_total",
    "kvhandoff_writes_posted_total",
    "kvhandoff_reads_posted_total",
    "kvhandoff_ranks",
];

fn check_names(head: &str, body: &str, who: &str, all: &str) {
    assert!(head.starts_with("HTTP/1.1 200"), "{who}: {head}\n{all}");
    assert!(
        head.contains("text/plain; version=0.0.4"),
        "{who}: {head}\n{all}"
    );
    for name in NAMES {
        assert!(
            body.contains(&format!("# TYPE {name} ")),
            "{who}: {name} missing\n{body}\n{all}"
        );
    }
}

#[test]
fn a_scrape_during_and_after_a_two_process_run_matches_the_reports() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let [p_addr, d_addr, p_metrics, d_metrics] = four_ports();
    let with_metrics = |addr: SocketAddr| {
        let mut args: Vec<String> = ARGS.iter().map(|s| s.to_string()).collect();
        args.extend(["--metrics-addr".to_string(), addr.to_string()]);
        args
    };
    let (d_args, p_args) = (with_metrics(d_metrics), with_metrics(p_metrics));
    let deadline = Instant::now() + WAIT;
    let d = Node::spawn("D", "decode", d_addr, p_addr, &as_str(&d_args));
    thread::sleep(Duration::from_millis(300));
    let p = Node::spawn("P", "prefill", p_addr, d_addr, &as_str(&p_args));
    let (d_err, p_err) = (d.stderr_handle(), p.stderr_handle());
    let d_scraper = thread::spawn(move || scraper(d_metrics, d_err, deadline));
    let p_scraper = thread::spawn(move || scraper(p_metrics, p_err, deadline));
    let mut done = finish_all(vec![d, p], deadline).into_iter();
    let (d, p) = (done.next().expect("D"), done.next().expect("P"));
    let (ds, ps) = (
        d_scraper.join().expect("D's scraper"),
        p_scraper.join().expect("P's scraper"),
    );
    let all = format!("{}\n{}", d.show(), p.show());
    assert!(
        d.status.is_some_and(|s| s.success()) && p.status.is_some_and(|s| s.success()),
        "{all}"
    );
    assert!(d.stderr.contains("metrics on http://"), "{all}");
    let (dv, pv) = (d.json(&all), p.json(&all));
    assert_eq!(dv["transport"], "nixl", "{all}");
    assert_eq!(n(&dv["outcomes"]["ready"]), REQUESTS, "{all}");
    assert_eq!(n(&pv["prefill_outcomes"]["sent"]), REQUESTS, "{all}");

    for (who, s) in [("D", &ds), ("P", &ps)] {
        let (head, body) = s
            .during
            .as_ref()
            .unwrap_or_else(|| panic!("{who}: no scrape during the run\n{all}"));
        check_names(head, body, who, &all);
    }
    let (dh, db) = ds
        .after
        .as_ref()
        .unwrap_or_else(|| panic!("D: no scrape after the report\n{all}"));
    let (ph, pb) = ps
        .after
        .as_ref()
        .unwrap_or_else(|| panic!("P: no scrape after the report\n{all}"));
    check_names(dh, db, "D", &all);
    check_names(ph, pb, "P", &all);
    let (dm, pm) = (samples(db), samples(pb));
    let all = format!("{all}\n--- D's last scrape\n{db}\n--- P's last scrape\n{pb}");

    // D received: every request ready, every byte of the report, no failure.
    let receiving = |m: &BTreeMap<String, f64>, outcome: &str| {
        get(
            m,
            &format!("kvhandoff_requests_total{{outcome=\"{outcome}\",side=\"receiving\"}}"),
            &all,
        )
    };
    let sending = |m: &BTreeMap<String, f64>, outcome: &str| {
        get(
            m,
            &format!("kvhandoff_requests_total{{outcome=\"{outcome}\",side=\"sending\"}}"),
            &all,
        )
    };
    let bytes = |m: &BTreeMap<String, f64>, direction: &str| {
        get(
            m,
            &format!("kvhandoff_bytes_transferred_total{{direction=\"{direction}\"}}"),
            &all,
        )
    };
    assert_eq!(
        receiving(&dm, "ready"),
        n(&dv["outcomes"]["ready"]),
        "{all}"
    );
    assert_eq!(
        receiving(&dm, "failed"),
        n(&dv["outcomes"]["failed"]),
        "{all}"
    );
    assert_eq!(receiving(&dm, "recomputed"), 0, "{all}");
    assert_eq!(bytes(&dm, "received"), n(&dv["bytes"]), "{all}");
    assert_eq!(sending(&dm, "sent"), 0, "{all}");
    assert_eq!(bytes(&dm, "sent"), 0, "{all}");
    // P sent: every request, every byte of its report, nothing released or expired.
    assert_eq!(
        sending(&pm, "sent"),
        n(&pv["prefill_outcomes"]["sent"]),
        "{all}"
    );
    assert_eq!(
        sending(&pm, "released"),
        n(&pv["prefill_outcomes"]["released"]),
        "{all}"
    );
    assert_eq!(bytes(&pm, "sent"), n(&pv["bytes"]), "{all}");
    assert_eq!(receiving(&pm, "ready"), 0, "{all}");
    assert!(
        get(&pm, "kvhandoff_writes_posted_total", &all) >= REQUESTS,
        "{all}"
    );
    for (m, v) in [(&dm, &dv), (&pm, &pv)] {
        assert_eq!(
            get(m, "kvhandoff_num_kv_expired_reqs_total", &all),
            0,
            "{all}"
        );
        assert_eq!(get(m, "kvhandoff_requests_fenced_total", &all), 0, "{all}");
        assert_eq!(get(m, "kvhandoff_stuck_writes_total", &all), 0, "{all}");
        assert_eq!(
            get(m, "kvhandoff_peers_declared_dead_total", &all),
            n(&v["node"]["peer_deaths"]),
            "{all}"
        );
        // The rank has ended by the report: its figures stay, as the retired ranks' totals.
        assert_eq!(get(m, "kvhandoff_ranks", &all), 0, "{all}");
        assert!(
            m.contains_key("kvhandoff_messages_dropped_total{reason=\"malformed\"}"),
            "{all}"
        );
    }
    // D's and P's bytes agree with each other too: what P sent is what D received.
    assert_eq!(bytes(&pm, "sent"), bytes(&dm, "received"), "{all}");

    // The per-transfer histograms: P posted every write (push), and each completed, so each
    // was timed and sized once, and their bytes are the report's; D posted nothing.
    let writes = get(&pm, "kvhandoff_writes_posted_total", &all);
    for family in [
        "kvhandoff_xfer_time_seconds",
        "kvhandoff_post_time_seconds",
        "kvhandoff_bytes_transferred",
        "kvhandoff_num_descriptors",
    ] {
        assert_eq!(
            get(&pm, &format!("{family}_count"), &all),
            writes,
            "{family}\n{all}"
        );
        assert_eq!(
            get(&dm, &format!("{family}_count"), &all),
            0,
            "{family}\n{all}"
        );
        // The +Inf bucket holds every observation.
        assert_eq!(
            get(&pm, &format!("{family}_bucket{{le=\"+Inf\"}}"), &all),
            writes,
            "{family}\n{all}"
        );
    }
    assert_eq!(
        get(&pm, "kvhandoff_bytes_transferred_sum", &all),
        n(&pv["bytes"]),
        "{all}"
    );
    assert!(
        get(&pm, "kvhandoff_num_descriptors_sum", &all) >= writes,
        "{all}"
    );
    let xfer_secs = pm["kvhandoff_xfer_time_seconds_sum"];
    assert!(xfer_secs > 0.0 && xfer_secs < 60.0 * writes as f64, "{all}");
    // For the log (docs/benchmarks.md quotes a run): what the histograms say of this run.
    eprintln!(
        "P's transfers: {writes}, mean post {:.1} µs, mean post-to-completion {:.3} ms, mean \
         {:.0} bytes in {:.1} descriptors",
        pm["kvhandoff_post_time_seconds_sum"] / writes as f64 * 1e6,
        xfer_secs / writes as f64 * 1e3,
        pm["kvhandoff_bytes_transferred_sum"] / writes as f64,
        pm["kvhandoff_num_descriptors_sum"] / writes as f64,
    );
    let sum_of = |m: &BTreeMap<String, f64>, family: &str| -> u64 {
        m.iter()
            .filter(|(k, _)| k.starts_with(&format!("{family}{{")))
            .map(|(_, v)| *v as u64)
            .sum()
    };
    // The side channel: every handshake P's link completed was timed, and every connection it
    // rejected (D's readiness probes, closed before a byte) is counted by its reason, as P's
    // report says (D's report has no link summary: D dialled, so it timed one at least).
    let link = &pv["link"];
    assert_eq!(
        get(&pm, "kvhandoff_handshake_time_seconds_count", &all),
        n(&link["incoming_ok"]) + n(&link["outgoing_ok"]),
        "{all}"
    );
    assert!(n(&link["incoming_ok"]) >= 1, "{all}");
    assert!(
        get(&dm, "kvhandoff_handshake_time_seconds_count", &all) >= 1,
        "{all}"
    );
    assert_eq!(
        sum_of(&pm, "kvhandoff_side_channel_rejections_total"),
        n(&link["rejected"]),
        "{all}"
    );
    for m in [&dm, &pm] {
        assert_eq!(
            sum_of(m, "kvhandoff_side_channel_rejections_total"),
            get(
                m,
                "kvhandoff_side_channel_rejections_total{reason=\"closed\"}",
                &all
            ),
            "only probes were rejected\n{all}"
        );
    }
    // No failure of any cause on either side, and D's failures by proof are its failures.
    for m in [&dm, &pm] {
        for family in [
            "kvhandoff_num_failed_transfers_total",
            "kvhandoff_num_failed_notifications_total",
        ] {
            assert_eq!(sum_of(m, family), 0, "{family}\n{all}");
        }
        for key in [
            "kvhandoff_num_failed_transfers_total{cause=\"peer_dead\"}",
            "kvhandoff_num_failed_notifications_total{cause=\"peer_unreachable\"}",
            "kvhandoff_side_channel_rejections_total{reason=\"bad_magic\"}",
            "kvhandoff_peers{state=\"connected\"}",
            "kvhandoff_requests_by_proof_total{outcome=\"failed\",proof=\"dead_peer_fence\",side=\"receiving\"}",
        ] {
            assert!(m.contains_key(key), "{key}\n{all}");
        }
        // The ranks have ended: their gauges left with them.
        assert_eq!(get(m, "kvhandoff_blocks_quarantined", &all), 0, "{all}");
        assert_eq!(sum_of(m, "kvhandoff_peers"), 0, "{all}");
    }
    assert_eq!(
        sum_of(&dm, "kvhandoff_requests_by_proof_total"),
        receiving(&dm, "failed"),
        "{all}"
    );
}
