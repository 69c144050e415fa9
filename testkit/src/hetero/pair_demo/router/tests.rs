//! The router over its TCP lines: ranks connect, holders answer, readers get the decisions.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::*;

fn send(stream: &mut TcpStream, line: &str) {
    stream.write_all(line.as_bytes()).unwrap();
    stream.write_all(b"\n").unwrap();
}

fn connect(addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => return stream,
            Err(e) if Instant::now() >= deadline => panic!("the router: {e}"),
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// A P rank answers two requests (one with parameters, one refused), a D rank reads the
/// decisions, a hello of a rank the engine lacks and a line that is no message are refused.
#[test]
fn holders_answers_reach_the_readers_and_bad_lines_are_counted() {
    let addr = crate::ports::loopback_ports::<1>()[0];
    let plan = RouterPlan {
        prefill_ranks: 1,
        decode_ranks: 1,
        requests: 2,
        turns: false,
    };
    let router = thread::spawn(move || run_router(addr, plan, Duration::from_secs(20)));
    let mut d = connect(addr);
    send(&mut d, r#"{"kind":"hello","side":"decode","rank":0}"#);
    let mut stranger = connect(addr);
    send(
        &mut stranger,
        r#"{"kind":"hello","side":"prefill","rank":7}"#,
    );
    send(&mut stranger, "not a message");
    // The stranger's lines are read before the run can end (the router stops once every
    // request is decided).
    thread::sleep(Duration::from_millis(300));
    let mut p = connect(addr);
    send(&mut p, r#"{"kind":"hello","side":"prefill","rank":0}"#);
    send(
        &mut p,
        r#"{"kind":"answer","index":0,"params":{"remote_port":17500}}"#,
    );
    send(&mut p, r#"{"kind":"answer","index":1,"params":null}"#);
    let mut lines = BufReader::new(d.try_clone().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let second = lines.next().unwrap().unwrap();
    assert!(
        first.contains("\"params\"") && first.contains("17500"),
        "{first}"
    );
    assert!(
        second.contains("\"abandoned\"") && second.contains("\"index\":1"),
        "{second}"
    );
    let report = router.join().unwrap().unwrap();
    assert_eq!(
        (report.forwarded, report.abandoned, report.undecided),
        (1, 1, 0)
    );
    assert_eq!(report.bad_lines, 2, "{report:?}");
    assert_eq!(report.prefill_connections, 1);
    assert!(report.ok);
}
