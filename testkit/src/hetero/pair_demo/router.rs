//! The router of a heterogeneous pair whose ranks run as processes of their own
//! (`kvhandoff router`, started by `kvhandoff cluster --model …`): what vLLM's proxy does
//! between the engines. Every P rank tells it its answer to each request's prefill leg (the
//! `kv_transfer_params` its `request_finished` returned, push or pull, or that it refused);
//! once every P rank answered, the router hands the decode leg's parameters — P rank 0's
//! answer, as the proxy takes the engine's one response — to every D rank, which only then
//! calls `request_allocated`. So across processes a push is always P-finishes-first, as behind
//! vLLM's proxy; both races run in one process (`demo --model`) and in the simulator.
//!
//! A conversation's next turn goes the other way: D's ranks keep their blocks and answer
//! (`keep_for_next_turn`'s parameters), and the router hands D rank 0's answer to every P rank
//! once every D rank answered.
//!
//! A request a holder rank refused, skipped (a restarted rank runs from its `--start-at`) or
//! will never answer (its connection closed and it did not come back in time) is abandoned:
//! the readers are told so and never start it (`router/table.rs`).
//!
//! One TCP connection per rank, one line of JSON per message: the rank's `hello` first, then the
//! holders' `answer`s one way and the router's `params` or `abandoned` the other. A rank that
//! connects late (a restart) gets every decision made so far.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff::KvTransferParams;
use serde::{Deserialize, Serialize};

use crate::demo::DemoError;
use table::{Refused, Side, Table, Verdict};

mod table;

/// How often the router and its clients look at their clocks and connections.
const POLL: Duration = Duration::from_millis(5);
/// Longest line a peer may send (a request's parameters are well under it).
const MAX_LINE: usize = 1 << 20;

/// One message between a rank and the router.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    /// A rank introduces itself; its process runs requests `start_at..` of each turn (a
    /// restart's `--start-at`).
    Hello {
        side: String,
        rank: u32,
        #[serde(default)]
        start_at: u64,
    },
    /// Holder rank → router: its answer to request `index` (`None`: it refused the call).
    Answer {
        index: u64,
        params: Option<KvTransferParams>,
    },
    /// Router → readers: request `index`'s reader leg.
    Params {
        index: u64,
        params: KvTransferParams,
    },
    /// Router → readers: request `index` will not be read (a holder rank refused it, restarted
    /// past it or went away).
    Abandoned { index: u64 },
}

/// What the router did, for its report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouterReport {
    /// Requests handed to the readers.
    pub forwarded: u64,
    /// Requests abandoned because a holder rank refused them, restarted past them or went away.
    pub abandoned: u64,
    /// Requests with no decision when the router stopped.
    pub undecided: u64,
    /// P ranks that connected (restarts counted again).
    pub prefill_connections: u64,
    /// D ranks that connected (restarts counted again).
    pub decode_connections: u64,
    /// Connections of ranks that came back past requests (`start_at` above 0).
    pub restarts: u64,
    /// Holder ranks whose connection closed and that did not come back within the grace.
    pub gone: u64,
    /// Answers to requests decided already (a rank that came back after it was given up on).
    pub late_answers: u64,
    /// Lines refused (not JSON, too long, out of place; a `hello` of a rank the engine lacks).
    pub bad_lines: u64,
    /// Connections dropped past the bound (four per rank of both engines, and 16).
    pub refused_connections: u64,
    /// Whether every request was decided.
    pub ok: bool,
}

enum Event {
    Connected(TcpStream),
    Line(u64, Box<Line>),
    Closed(u64),
    Bad,
}

/// What the router decides: `requests` first turns, held by P's `prefill_ranks` (a push's or a
/// pull's prefill leg), and with `turns` their next turns too, held by D's `decode_ranks`
/// (numbered `requests + r`).
#[derive(Debug, Clone, Copy)]
pub struct RouterPlan {
    /// Ranks of P's engine.
    pub prefill_ranks: u32,
    /// Ranks of D's engine.
    pub decode_ranks: u32,
    /// First turns.
    pub requests: u64,
    /// Whether every first turn has a next turn read back.
    pub turns: bool,
}

/// Runs the router on `listen` until every request of `plan` was decided and handed to every
/// rank connected, or `timeout`. A request waits for every rank of the side that holds it
/// (`router/table.rs`: a holder that refused, restarted past a request or went away has it
/// abandoned).
///
/// # Errors
/// [`DemoError::Options`] when it cannot listen.
pub fn run_router(
    listen: SocketAddr,
    plan: RouterPlan,
    timeout: Duration,
) -> Result<RouterReport, DemoError> {
    let listener = TcpListener::bind(listen)
        .map_err(|e| DemoError::Options(format!("the router cannot listen on {listen}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| DemoError::Options(e.to_string()))?;
    let deadline = Instant::now() + timeout;
    let (tx, rx) = mpsc::channel::<Event>();
    let mut report = RouterReport::default();
    let mut table = Table::new(
        plan.requests,
        plan.turns,
        plan.prefill_ranks,
        plan.decode_ranks,
    );
    let mut decided: Vec<Line> = Vec::new();
    // Every connection, with how many decisions it was sent.
    let mut clients: Vec<(TcpStream, usize)> = Vec::new();
    // Who each connection is, and each rank's latest connection.
    let mut who: BTreeMap<u64, (Side, u32)> = BTreeMap::new();
    let mut latest: BTreeMap<(Side, u32), u64> = BTreeMap::new();
    let mut next_id = 0u64;
    while Instant::now() < deadline && table.decided() < table.decisions() {
        while let Ok((stream, _)) = listener.accept() {
            let _ = tx.send(Event::Connected(stream));
        }
        let made = match rx.recv_timeout(POLL) {
            Err(_) => Vec::new(),
            Ok(Event::Connected(stream)) => {
                // Every rank and a few restarts each; past that a connection is dropped.
                let most = 4 * (plan.prefill_ranks + plan.decode_ranks) as usize + 16;
                if clients.len() < most {
                    next_id += 1;
                    spawn_reader(next_id, &stream, tx.clone());
                    clients.push((stream, 0));
                } else {
                    report.refused_connections += 1;
                }
                Vec::new()
            }
            Ok(Event::Bad) => {
                report.bad_lines += 1;
                Vec::new()
            }
            Ok(Event::Closed(id)) => {
                if let Some(&(side, rank)) = who.get(&id) {
                    if latest.get(&(side, rank)) == Some(&id) {
                        table.lost(side, rank, Instant::now());
                    }
                }
                Vec::new()
            }
            Ok(Event::Line(id, line)) => match *line {
                Line::Hello {
                    side,
                    rank,
                    start_at,
                } => match Side::parse(&side) {
                    Some(side) if !who.contains_key(&id) && table.has_rank(side, rank) => {
                        match side {
                            Side::Prefill => report.prefill_connections += 1,
                            Side::Decode => report.decode_connections += 1,
                        }
                        report.restarts += u64::from(start_at > 0);
                        who.insert(id, (side, rank));
                        latest.insert((side, rank), id);
                        table.hello(side, rank, start_at)
                    }
                    _ => {
                        report.bad_lines += 1;
                        Vec::new()
                    }
                },
                Line::Answer { index, params } => {
                    let Some(&(side, rank)) = who.get(&id) else {
                        report.bad_lines += 1;
                        continue;
                    };
                    match table.answer(side, rank, index, params) {
                        Ok(made) => made,
                        Err(Refused::Bad) => {
                            report.bad_lines += 1;
                            Vec::new()
                        }
                        Err(Refused::Late) => {
                            report.late_answers += 1;
                            Vec::new()
                        }
                    }
                }
                Line::Params { .. } | Line::Abandoned { .. } => {
                    report.bad_lines += 1;
                    Vec::new()
                }
            },
        };
        for (index, verdict) in made.into_iter().chain(table.tick(Instant::now())) {
            decided.push(match verdict {
                Verdict::Forward(params) => {
                    report.forwarded += 1;
                    Line::Params {
                        index,
                        params: *params,
                    }
                }
                Verdict::Abandon => {
                    report.abandoned += 1;
                    Line::Abandoned { index }
                }
            });
        }
        // Every connection gets every decision (holders ignore them); a late one gets the
        // history.
        clients.retain_mut(|(stream, sent)| send_new(stream, sent, &decided).is_ok());
    }
    report.gone = table.gone();
    report.undecided = table.decisions().saturating_sub(table.decided());
    report.ok = report.undecided == 0;
    // The readers read the last decisions before the connections close.
    thread::sleep(Duration::from_millis(200));
    Ok(report)
}

/// Sends the decisions of `all` past the `sent` this stream had.
fn send_new(stream: &mut TcpStream, sent: &mut usize, all: &[Line]) -> std::io::Result<()> {
    for line in &all[(*sent).min(all.len())..] {
        let text = serde_json::to_string(line).map_err(std::io::Error::other)?;
        stream.write_all(text.as_bytes())?;
        stream.write_all(b"\n")?;
    }
    *sent = all.len();
    Ok(())
}

/// Reads `stream` line by line on a thread of its own, each line parsed (`None`: not a message
/// of ours, or past [`MAX_LINE`]) and handed to `each`, until the stream ends or `each` says
/// stop; then calls `closed`.
fn spawn_line_reader(
    stream: TcpStream,
    mut each: impl FnMut(Option<Line>) -> bool + Send + 'static,
    closed: impl FnOnce() + Send + 'static,
) {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match (&mut reader).take(MAX_LINE as u64).read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !each(serde_json::from_str::<Line>(line.trim()).ok()) {
                        break;
                    }
                }
            }
        }
        closed();
    });
}

fn spawn_reader(id: u64, stream: &TcpStream, tx: mpsc::Sender<Event>) {
    let Ok(stream) = stream.try_clone() else {
        return;
    };
    let closed = tx.clone();
    spawn_line_reader(
        stream,
        move |line| {
            let event = line.map_or(Event::Bad, |l| Event::Line(id, Box::new(l)));
            tx.send(event).is_ok()
        },
        move || {
            let _ = closed.send(Event::Closed(id));
        },
    );
}

/// What a rank learns from the router about request `index`.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Decision {
    /// The reader's parameters.
    Read(Box<KvTransferParams>),
    /// A holder rank refused the request, restarted past it or went away: the readers do not
    /// start it.
    Abandoned,
}

/// A rank's connection to the router.
pub(super) struct RouterClient {
    stream: Mutex<TcpStream>,
    decisions: Arc<Mutex<BTreeMap<u64, Decision>>>,
    /// Added to every request index: a conversation's next turns are numbered after the
    /// first turns' (`requests + r`).
    offset: std::sync::atomic::AtomicU64,
}

impl RouterClient {
    /// Connects to the router at `addr` (retrying until `deadline`) as rank `rank` of `side`,
    /// whose process runs requests `start_at..` of each turn.
    pub(super) fn connect(
        addr: SocketAddr,
        side: &str,
        rank: u32,
        start_at: usize,
        deadline: Instant,
    ) -> Result<RouterClient, DemoError> {
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(DemoError::Options(format!("the router at {addr}: {e}")))
                }
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        };
        let hello = Line::Hello {
            side: side.into(),
            rank,
            start_at: start_at as u64,
        };
        let client = RouterClient {
            stream: Mutex::new(
                stream
                    .try_clone()
                    .map_err(|e| DemoError::Options(e.to_string()))?,
            ),
            decisions: Arc::new(Mutex::new(BTreeMap::new())),
            offset: std::sync::atomic::AtomicU64::new(0),
        };
        client.send(&hello)?;
        let decisions = Arc::clone(&client.decisions);
        spawn_line_reader(
            stream,
            move |line| {
                let decision = match line {
                    Some(Line::Params { index, params }) => {
                        (index, Decision::Read(Box::new(params)))
                    }
                    Some(Line::Abandoned { index }) => (index, Decision::Abandoned),
                    Some(Line::Hello { .. } | Line::Answer { .. }) | None => return true,
                };
                if let Ok(mut d) = decisions.lock() {
                    d.insert(decision.0, decision.1);
                }
                true
            },
            || {},
        );
        Ok(client)
    }

    fn send(&self, line: &Line) -> Result<(), DemoError> {
        let text = serde_json::to_string(line).map_err(|e| DemoError::Options(e.to_string()))?;
        let mut stream = self
            .stream
            .lock()
            .map_err(|_| DemoError::Options("the router link is poisoned".into()))?;
        stream
            .write_all(format!("{text}\n").as_bytes())
            .map_err(|e| DemoError::Options(format!("the router link: {e}")))
    }

    /// From now on, request `r` is the router's `offset + r` (a conversation's next turns).
    pub(super) fn set_offset(&self, offset: u64) {
        self.offset
            .store(offset, std::sync::atomic::Ordering::Relaxed);
    }

    fn index(&self, index: usize) -> u64 {
        self.offset.load(std::sync::atomic::Ordering::Relaxed) + index as u64
    }

    /// A holder: its answer to request `index` (`None`: its call was refused).
    pub(super) fn answered(
        &self,
        index: usize,
        params: Option<&KvTransferParams>,
    ) -> Result<(), String> {
        self.send(&Line::Answer {
            index: self.index(index),
            params: params.cloned(),
        })
        .map_err(|e| e.to_string())
    }

    /// A reader: what the router decided for request `index`, if it did yet.
    pub(super) fn decision(&self, index: usize) -> Option<Decision> {
        let index = self.index(index);
        self.decisions.lock().ok()?.get(&index).cloned()
    }
}

#[cfg(test)]
mod tests;
