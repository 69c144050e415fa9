//! `kvhandoff node --otel-endpoint`: P and D as two processes over NIXL, each exporting its
//! spans over OTLP/HTTP to a collector of its own (a few lines of HTTP here, storing each
//! request's protobuf body). The spans of every request must reach both collectors under the
//! request's `trace_id` attribute, the same on both sides: that is what joins a handoff in a
//! tracing backend. Needs the NIXL runtime and the `otel` feature:
//! `source scripts/nixl-env.sh && cargo test --features nixl,otel --test otel_node`.
#![cfg(all(feature = "nixl", feature = "otel"))]

mod nodes;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nodes::{require_runtime, run_d_then_p, ONE_AT_A_TIME};

const REQUESTS: usize = 16;
const WAIT: Duration = Duration::from_secs(90);
/// The largest body the collector takes.
const MAX_BODY: usize = 16 << 20;

/// A stand-in OTLP/HTTP collector: answers every POST with 200 and keeps its body.
struct Collector {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
}

impl Collector {
    fn start(addr: SocketAddr) -> Collector {
        let listener = TcpListener::bind(addr).expect("the collector binds");
        listener.set_nonblocking(true).expect("nonblocking");
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (keep, stopped) = (bodies.clone(), stop.clone());
        thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let keep = keep.clone();
                        thread::spawn(move || serve(stream, &keep));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Collector { addr, bodies, stop }
    }

    fn bodies(&self) -> Vec<Vec<u8>> {
        self.bodies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Serves the requests of one keep-alive connection.
fn serve(stream: TcpStream, keep: &Mutex<Vec<Vec<u8>>>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        let mut first = true;
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if first {
                assert!(
                    line.starts_with("POST "),
                    "an OTLP export is a POST: {line}"
                );
                first = false;
            }
            let header = line.trim_end().to_ascii_lowercase();
            if header.is_empty() {
                break;
            }
            if let Some(value) = header.strip_prefix("content-length:") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        assert!(length <= MAX_BODY, "a {length}-byte export");
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        keep.lock().unwrap_or_else(|e| e.into_inner()).push(body);
        let answer =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// The values of every `trace_id` string attribute in OTLP protobuf bodies: the key's bytes,
/// then (a few bytes of field tags and lengths) the 32 hex digits of the value.
fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn trace_ids(bodies: &[Vec<u8>]) -> BTreeSet<String> {
    const KEY: &[u8] = b"trace_id";
    let mut found = BTreeSet::new();
    for body in bodies {
        let mut at = 0;
        while let Some(pos) = body[at..].windows(KEY.len()).position(|w| w == KEY) {
            let after = at + pos + KEY.len();
            for skip in 0..8 {
                let Some(value) = body.get(after + skip..after + skip + 32) else {
                    break;
                };
                if value
                    .iter()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
                {
                    found.insert(String::from_utf8_lossy(value).into_owned());
                    break;
                }
            }
            at = after;
        }
    }
    found
}

#[test]
fn both_sides_export_every_requests_spans_under_its_trace_id() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_runtime();
    let [p_addr, d_addr, p_otel, d_otel] = kvhandoff_testkit::ports::loopback_ports();
    let (p_collector, d_collector) = (Collector::start(p_otel), Collector::start(d_otel));
    let requests = REQUESTS.to_string();
    let args = |collector: &Collector| {
        vec![
            "--requests".to_string(),
            requests.clone(),
            "--seed".into(),
            "5".into(),
            "--max-prompt-tokens".into(),
            "16".into(),
            "--pool-blocks".into(),
            "64".into(),
            "--timeout-secs".into(),
            "60".into(),
            "--log-level".into(),
            "warn,kvhandoff_protocol=debug".into(),
            "--otel-endpoint".into(),
            format!("http://{}/v1/traces", collector.addr),
        ]
    };
    let (d_args, p_args) = (args(&d_collector), args(&p_collector));
    let (d, p, all) = run_d_then_p(
        (d_addr, &as_strs(&d_args)),
        (p_addr, &as_strs(&p_args)),
        Instant::now() + WAIT,
    );
    assert!(
        d.status.is_some_and(|s| s.success()) && p.status.is_some_and(|s| s.success()),
        "{all}"
    );
    // Each node flushed its export before it exited.
    let (p_bodies, d_bodies) = (p_collector.bodies(), d_collector.bodies());
    assert!(
        !p_bodies.is_empty() && !d_bodies.is_empty(),
        "exports: P {} D {}\n{all}",
        p_bodies.len(),
        d_bodies.len()
    );
    let (p_ids, d_ids) = (trace_ids(&p_bodies), trace_ids(&d_bodies));
    let joined: BTreeSet<&String> = p_ids.intersection(&d_ids).collect();
    assert!(
        joined.len() >= REQUESTS,
        "{} trace ids on both sides (P {}, D {}), {REQUESTS} requests\n{all}",
        joined.len(),
        p_ids.len(),
        d_ids.len()
    );
    println!(
        "otel: P {} exports, D {} exports, {} requests' trace ids on both sides",
        p_bodies.len(),
        d_bodies.len(),
        joined.len()
    );
}
