//! A minimal `/metrics` endpoint over `std::net`: `GET /metrics` answers
//! [`prometheus_text`], anything else a short error.
//!
//! Why no HTTP framework: a scrape is one `GET` without a body, answered once and closed
//! (`Connection: close`), so only the request line is parsed and the headers are read (up to
//! a bound) and ignored. A server crate would add an executor or a thread pool and its own
//! parsing for that; the runtime's dependencies stay small. What keeps a slow or hostile
//! client from hurting the node: every connection is served on its own short-lived thread, at
//! most [`MAX_CONNECTIONS`] at once (more are closed unanswered), with a read and a write
//! timeout, and a request head larger than [`MAX_REQUEST_BYTES`] is refused. The node's own
//! threads never wait on this server.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::{prometheus_text, CONTENT_TYPE};

/// The largest request head read (request line and headers), bytes.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 8;
/// How long one connection may take to send its request, or to take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the metrics endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsServerError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the system said.
        source: std::io::Error,
    },
    /// The accepting thread could not be started.
    #[error("cannot start the metrics thread: {0}")]
    Thread(std::io::Error),
}

/// A running `/metrics` endpoint; stops accepting when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<thread::JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` (port 0 picks one: see [`MetricsServer::local_addr`]) and serves
    /// `GET /metrics` on a thread of its own.
    ///
    /// # Errors
    /// [`MetricsServerError`] when the address cannot be bound or the thread not started.
    pub fn start(addr: SocketAddr) -> Result<MetricsServer, MetricsServerError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| MetricsServerError::Bind { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| MetricsServerError::Bind { addr, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let accept = thread::Builder::new()
            .name("kvhandoff-metrics".into())
            .spawn(move || accept_loop(&listener, &flag))
            .map_err(MetricsServerError::Thread)?;
        Ok(MetricsServer {
            addr: local,
            stop,
            accept: Some(accept),
        })
    }

    /// Where the endpoint listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own; it then sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, stop: &AtomicBool) {
    let busy = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else {
            // A connection that failed before it was accepted (reset, out of descriptors):
            // nothing to answer; a short pause so that a persistent error does not spin.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            busy.fetch_sub(1, Ordering::SeqCst);
            drop(stream);
            continue;
        }
        let count = busy.clone();
        let spawned = thread::Builder::new()
            .name("kvhandoff-metrics-conn".into())
            .spawn(move || {
                serve(stream);
                count.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    Metrics,
    NotFound,
    WrongMethod,
    Malformed,
    TooLarge,
}

/// Reads the request head (until the blank line, the bound, the timeout or the end).
fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, Asked> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return Ok(head);
        }
        if head.len() >= MAX_REQUEST_BYTES {
            return Err(Asked::TooLarge);
        }
        match stream.read(&mut buf) {
            Ok(0) => return Ok(head),
            Ok(n) => head.extend_from_slice(&buf[..n.min(MAX_REQUEST_BYTES + 4 - head.len())]),
            Err(_) => return Err(Asked::Malformed),
        }
    }
}

/// Parses the request line alone: `METHOD TARGET HTTP/x.y`.
fn parse(head: &[u8]) -> Asked {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Asked::Malformed;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Asked::Malformed;
    };
    if !version.starts_with("HTTP/1.") {
        return Asked::Malformed;
    }
    if method != "GET" {
        return Asked::WrongMethod;
    }
    // A query string (`/metrics?name[]=...`) is ignored: every family is always served.
    match target.split('?').next() {
        Some("/metrics") => Asked::Metrics,
        _ => Asked::NotFound,
    }
}

fn serve(mut stream: TcpStream) {
    // Without these a client that sends nothing, or reads nothing, holds the thread forever.
    if stream.set_read_timeout(Some(IO_TIMEOUT)).is_err()
        || stream.set_write_timeout(Some(IO_TIMEOUT)).is_err()
    {
        return;
    }
    let asked = match read_head(&mut stream) {
        Ok(head) => parse(&head),
        Err(why) => why,
    };
    let (status, content_type, body) = match asked {
        Asked::Metrics => ("200 OK", CONTENT_TYPE, prometheus_text()),
        Asked::NotFound => ("404 Not Found", "text/plain", "not found\n".to_string()),
        Asked::WrongMethod => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n".to_string(),
        ),
        Asked::Malformed => ("400 Bad Request", "text/plain", "bad request\n".to_string()),
        Asked::TooLarge => (
            "431 Request Header Fields Too Large",
            "text/plain",
            "request too large\n".to_string(),
        ),
    };
    let allow = if asked == Asked::WrongMethod {
        "Allow: GET\r\n"
    } else {
        ""
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}\
         Connection: close\r\n\r\n",
        body.len()
    );
    // A client that went away gets nothing more; the node does not care.
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()))
        .and_then(|()| stream.flush());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request).unwrap();
        let mut out = String::new();
        // A refused request may be closed with unread bytes (a reset): what came is enough.
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest() {
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr();
        let ok = ask(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("Content-Type: text/plain; version=0.0.4\r\n"),
            "{ok}"
        );
        assert!(ok.contains("kvhandoff_requests_total"), "{ok}");
        let missing = ask(addr, b"GET / HTTP/1.1\r\n\r\n");
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = ask(addr, b"POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let junk = ask(addr, b"hello\r\n\r\n");
        assert!(junk.starts_with("HTTP/1.1 400"), "{junk}");
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.extend(std::iter::repeat_n(b'a', 2 * MAX_REQUEST_BYTES));
        let refused = ask(addr, &huge);
        // The server closes with the rest unread: the client may see the reset first.
        assert!(
            refused.is_empty() || refused.starts_with("HTTP/1.1 431"),
            "{refused}"
        );
        // And it still serves.
        assert!(ask(addr, b"GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn a_silent_client_does_not_block_the_next() {
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr();
        // Connected, sends nothing: its thread waits out the read timeout alone.
        let _silent = TcpStream::connect(addr).unwrap();
        let started = std::time::Instant::now();
        let ok = ask(addr, b"GET /metrics HTTP/1.0\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(started.elapsed() < IO_TIMEOUT, "{:?}", started.elapsed());
    }

    #[test]
    fn a_taken_address_is_a_bind_error() {
        let first = MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let second = MetricsServer::start(first.local_addr());
        assert!(matches!(second, Err(MetricsServerError::Bind { .. })));
    }
}
