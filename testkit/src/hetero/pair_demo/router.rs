//! The router of a heterogeneous pair whose ranks run as processes of their own
//! (`kvhandoff router`, started by `kvhandoff cluster --model … --mode pull`): what vLLM's proxy
//! does between the engines. Every P rank tells it its answer to each request's prefill leg
//! (the `kv_transfer_params` its `request_finished` returned, or that it refused); once every P
//! rank answered, the router hands the decode leg's parameters — P rank 0's answer, as the proxy
//! takes the engine's one response — to every D rank, which only then calls
//! `request_allocated`. A request some P rank refused is abandoned: D's ranks are told so and
//! never start it.
//!
//! A conversation's next turn goes the other way: D's ranks keep their blocks and answer
//! (`keep_for_next_turn`'s parameters), and the router hands D rank 0's answer to every P rank
//! once every D rank answered. Whichever side answers a request is its holder; the router
//! waits for all of that side's ranks.
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

/// How often the router and its clients look at their clocks and connections.
const POLL: Duration = Duration::from_millis(5);
/// Longest line a peer may send (a request's parameters are well under it).
const MAX_LINE: usize = 1 << 20;

/// One message between a rank and the router.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    /// A rank introduces itself.
    Hello { side: String, rank: u32 },
    /// P rank → router: its answer to request `index` (`None`: it refused the call).
    Answer {
        index: u64,
        params: Option<KvTransferParams>,
    },
    /// Router → D ranks: request `index`'s decode leg.
    Params {
        index: u64,
        params: KvTransferParams,
    },
    /// Router → D ranks: request `index` will not be read (a P rank refused it).
    Abandoned { index: u64 },
}

/// What the router did, for its report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouterReport {
    /// Requests handed to D's ranks.
    pub forwarded: u64,
    /// Requests abandoned because a P rank refused them.
    pub abandoned: u64,
    /// Requests with no decision when the router stopped.
    pub undecided: u64,
    /// P ranks and D ranks that connected (restarts counted again).
    pub prefill_connections: u64,
    /// D connections.
    pub decode_connections: u64,
    /// Lines refused (not JSON, too long, out of place).
    pub bad_lines: u64,
    /// Whether every request was decided.
    pub ok: bool,
}

enum Event {
    Connected(TcpStream),
    Line(u64, Box<Line>),
    Bad,
}

/// Runs the router on `listen` until `requests` requests were decided and handed to every rank
/// connected, or `timeout`. A request answered by P's ranks waits for all `prefill_ranks` of
/// them, one answered by D's ranks (a kept turn) for all `decode_ranks`.
///
/// # Errors
/// [`DemoError::Options`] when it cannot listen.
pub fn run_router(
    listen: SocketAddr,
    prefill_ranks: u32,
    decode_ranks: u32,
    requests: u64,
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
    // Per request: its holders' side, and their answers so far.
    type Answers = (String, BTreeMap<u32, Option<KvTransferParams>>);
    let mut answers: BTreeMap<u64, Answers> = BTreeMap::new();
    let mut decided: Vec<Line> = Vec::new();
    // Every connection, with how many decisions it was sent.
    let mut clients: Vec<(TcpStream, usize)> = Vec::new();
    let mut who: BTreeMap<u64, (String, u32)> = BTreeMap::new();
    let mut next_id = 0u64;
    while Instant::now() < deadline && (decided.len() as u64) < requests {
        while let Ok((stream, _)) = listener.accept() {
            let _ = tx.send(Event::Connected(stream));
        }
        let Ok(event) = rx.recv_timeout(POLL) else {
            continue;
        };
        match event {
            Event::Connected(stream) => {
                next_id += 1;
                spawn_reader(next_id, &stream, tx.clone());
                who.insert(next_id, (String::new(), 0));
                clients.push((stream, 0));
            }
            Event::Bad => report.bad_lines += 1,
            Event::Line(id, line) => match *line {
                Line::Hello { side, rank } => {
                    match side.as_str() {
                        "prefill" => report.prefill_connections += 1,
                        "decode" => report.decode_connections += 1,
                        _ => report.bad_lines += 1,
                    }
                    who.insert(id, (side, rank));
                }
                Line::Answer { index, params } => {
                    let Some((side, rank)) = who.get(&id).cloned() else {
                        report.bad_lines += 1;
                        continue;
                    };
                    let holders = match side.as_str() {
                        "prefill" => prefill_ranks,
                        "decode" => decode_ranks,
                        _ => 0,
                    };
                    // A peer's index past the run (first turns, then their next turns), or
                    // a request beyond the run's count still undecided, is refused: the
                    // table of answers stays bounded.
                    let fresh = !answers.contains_key(&index);
                    if index >= requests.saturating_mul(2)
                        || (fresh && answers.len() as u64 >= requests)
                    {
                        report.bad_lines += 1;
                        continue;
                    }
                    let entry = answers
                        .entry(index)
                        .or_insert_with(|| (side.clone(), BTreeMap::new()));
                    if entry.0 != side || rank >= holders {
                        report.bad_lines += 1;
                        continue;
                    }
                    entry.1.insert(rank, params);
                    if entry.1.len() == holders as usize {
                        let all = answers
                            .remove(&index)
                            .map(|(_, all)| all)
                            .unwrap_or_default();
                        let line = match all.get(&0).cloned().flatten() {
                            Some(params) if all.values().all(Option::is_some) => {
                                report.forwarded += 1;
                                Line::Params { index, params }
                            }
                            _ => {
                                report.abandoned += 1;
                                Line::Abandoned { index }
                            }
                        };
                        decided.push(line);
                    }
                }
                Line::Params { .. } | Line::Abandoned { .. } => report.bad_lines += 1,
            },
        }
        // Every connection gets every decision (P's ignore them); a late one gets the history.
        clients.retain_mut(|(stream, sent)| send_new(stream, sent, &decided).is_ok());
    }
    report.undecided = requests.saturating_sub(decided.len() as u64);
    report.ok = report.undecided == 0;
    // The D ranks read the last decisions before the connections close.
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
/// stop.
fn spawn_line_reader(
    stream: TcpStream,
    mut each: impl FnMut(Option<Line>) -> bool + Send + 'static,
) {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match (&mut reader).take(MAX_LINE as u64).read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !each(serde_json::from_str::<Line>(line.trim()).ok()) {
                        return;
                    }
                }
            }
        }
    });
}

fn spawn_reader(id: u64, stream: &TcpStream, tx: mpsc::Sender<Event>) {
    let Ok(stream) = stream.try_clone() else {
        return;
    };
    spawn_line_reader(stream, move |line| {
        let event = line.map_or(Event::Bad, |l| Event::Line(id, Box::new(l)));
        tx.send(event).is_ok()
    });
}

/// What a rank learns from the router about request `index`.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Decision {
    /// The reader's parameters.
    Read(Box<KvTransferParams>),
    /// A P rank refused the request: D does not start it.
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
    /// Connects to the router at `addr` (retrying until `deadline`) as rank `rank` of `side`.
    pub(super) fn connect(
        addr: SocketAddr,
        side: &str,
        rank: u32,
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
        spawn_line_reader(stream, move |line| {
            let decision = match line {
                Some(Line::Params { index, params }) => (index, Decision::Read(Box::new(params))),
                Some(Line::Abandoned { index }) => (index, Decision::Abandoned),
                Some(Line::Hello { .. } | Line::Answer { .. }) | None => return true,
            };
            if let Ok(mut d) = decisions.lock() {
                d.insert(decision.0, decision.1);
            }
            true
        });
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
