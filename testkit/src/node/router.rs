//! The router link between two nodes: what a router carries between P and D besides the
//! protocol — P's answers for the decode leg (a pulled request's block ids) and, in
//! conversations, D's answers for the next turn's prefill leg — over a TCP connection of its
//! own (`--router`; not the protocol's side channel). D listens, P connects (and reconnects to a
//! restarted D); each message is one line of JSON. The engine loops see the same channels as in
//! process ([`PrefillLink`], [`DecodeLink`]); the threads here bridge them.
//!
//! Indices on the wire are the whole seeded plan's (a node runs the part from its `start_at`);
//! a message about a request outside the receiver's part is dropped. Instants travel as ages
//! (µs before the send), taken as of the receipt on the other side.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::demo::{DecodeLink, PrefillLink, ToDecode, ToPrefill};
use kvhandoff::KvTransferParams;

/// How often the threads look at their stop flag, and retry a refused connect.
const POLL: Duration = Duration::from_millis(20);

/// One message on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Wire {
    PrefillDone {
        index: u64,
        age_us: u64,
    },
    Params {
        index: u64,
        params: KvTransferParams,
    },
    Abandoned {
        index: u64,
    },
    Kept {
        index: u64,
        params: KvTransferParams,
        age_us: u64,
    },
    Ended {
        index: u64,
    },
}

fn age(at: Instant) -> u64 {
    at.elapsed().as_micros() as u64
}

fn back(age_us: u64) -> Instant {
    let now = Instant::now();
    now.checked_sub(Duration::from_micros(age_us))
        .unwrap_or(now)
}

/// Converts between the loop's indices (from `start_at`) and the plan's, dropping indices
/// outside the part.
#[derive(Debug, Clone, Copy)]
struct Part {
    start_at: usize,
    len: usize,
}

impl Part {
    fn global(self, local: usize) -> u64 {
        (self.start_at + local) as u64
    }

    fn local(self, global: u64) -> Option<usize> {
        let global = usize::try_from(global).ok()?;
        global
            .checked_sub(self.start_at)
            .filter(|&local| local < self.len)
    }
}

fn to_wire_decode(m: ToDecode, part: Part) -> Wire {
    match m {
        ToDecode::PrefillDone { index, at } => Wire::PrefillDone {
            index: part.global(index),
            age_us: age(at),
        },
        ToDecode::Params { index, params } => Wire::Params {
            index: part.global(index),
            params,
        },
        ToDecode::Abandoned { index } => Wire::Abandoned {
            index: part.global(index),
        },
    }
}

fn to_wire_prefill(m: ToPrefill, part: Part) -> Wire {
    match m {
        ToPrefill::Kept {
            index,
            params,
            since,
        } => Wire::Kept {
            index: part.global(index),
            params: *params,
            age_us: age(since),
        },
        ToPrefill::Ended { index } => Wire::Ended {
            index: part.global(index),
        },
    }
}

fn from_wire_decode(w: Wire, part: Part) -> Option<ToDecode> {
    Some(match w {
        Wire::PrefillDone { index, age_us } => ToDecode::PrefillDone {
            index: part.local(index)?,
            at: back(age_us),
        },
        Wire::Params { index, params } => ToDecode::Params {
            index: part.local(index)?,
            params,
        },
        Wire::Abandoned { index } => ToDecode::Abandoned {
            index: part.local(index)?,
        },
        Wire::Kept { .. } | Wire::Ended { .. } => return None,
    })
}

fn from_wire_prefill(w: Wire, part: Part) -> Option<ToPrefill> {
    Some(match w {
        Wire::Kept {
            index,
            params,
            age_us,
        } => ToPrefill::Kept {
            index: part.local(index)?,
            params: Box::new(params),
            since: back(age_us),
        },
        Wire::Ended { index } => ToPrefill::Ended {
            index: part.local(index)?,
        },
        Wire::PrefillDone { .. } | Wire::Params { .. } | Wire::Abandoned { .. } => return None,
    })
}

fn write_line(stream: &mut TcpStream, w: &Wire) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(w).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

/// Reads lines from `stream` until it closes, handing what `convert` makes of each to `sink`.
fn read_lines<M: Send + 'static>(
    stream: TcpStream,
    sink: mpsc::Sender<M>,
    convert: impl Fn(Wire) -> Option<M> + Send + 'static,
) {
    thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            match serde_json::from_str::<Wire>(&line) {
                Ok(w) => {
                    if let Some(m) = convert(w) {
                        if sink.send(m).is_err() {
                            break;
                        }
                    }
                }
                Err(e) => tracing::warn!(%e, "router link: a line that is no message"),
            }
        }
    });
}

/// Stops the link's threads when dropped (the connections are shut down).
pub(super) struct RouterGuard {
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<TcpStream>>>,
}

impl Drop for RouterGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// D's end: listens on `addr` for P's connections (the latest is the one D answers on).
///
/// # Errors
/// The listener cannot bind.
pub(super) fn decode_side(
    addr: SocketAddr,
    start_at: usize,
    len: usize,
) -> std::io::Result<(DecodeLink, RouterGuard)> {
    let part = Part { start_at, len };
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let current: Arc<Mutex<Option<TcpStream>>> = Arc::new(Mutex::new(None));
    let (to_loop, from_prefill) = mpsc::channel();
    let (to_prefill, from_loop) = mpsc::channel::<ToPrefill>();
    let written = Arc::new(AtomicU64::new(0));
    {
        let (stop, current) = (stop.clone(), current.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        let _ = stream.set_nodelay(true);
                        if let Ok(reader) = stream.try_clone() {
                            read_lines(reader, to_loop.clone(), move |w| from_wire_decode(w, part));
                        }
                        *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(stream);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => thread::sleep(POLL),
                    Err(e) => {
                        tracing::warn!(%e, "router link: accept failed");
                        thread::sleep(POLL);
                    }
                }
            }
        });
    }
    {
        let (stop, current, count) = (stop.clone(), current.clone(), written.clone());
        thread::spawn(move || {
            // What waits for P to connect.
            let mut queue: VecDeque<Wire> = VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                match from_loop.recv_timeout(POLL) {
                    Ok(m) => queue.push_back(to_wire_prefill(m, part)),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) if queue.is_empty() => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => thread::sleep(POLL),
                }
                let mut slot = current.lock().unwrap_or_else(|e| e.into_inner());
                let Some(stream) = slot.as_mut() else {
                    continue;
                };
                while let Some(w) = queue.pop_front() {
                    if let Err(e) = write_line(stream, &w) {
                        // P is gone: what it missed is for P's part of the plan, which ended.
                        tracing::warn!(%e, "router link: P's connection broke");
                        *slot = None;
                        break;
                    }
                    count.fetch_add(1, Ordering::Release);
                }
            }
        });
    }
    Ok((
        DecodeLink::new(from_prefill, to_prefill, Some(written)),
        RouterGuard { stop, current },
    ))
}

/// P's end: connects to D's listener at `addr` (retrying until `deadline`, and again after the
/// connection breaks: a restarted D listens on the same address).
pub(super) fn prefill_side(
    addr: SocketAddr,
    start_at: usize,
    len: usize,
    deadline: Instant,
) -> (PrefillLink, RouterGuard) {
    let part = Part { start_at, len };
    let stop = Arc::new(AtomicBool::new(false));
    let current: Arc<Mutex<Option<TcpStream>>> = Arc::new(Mutex::new(None));
    let (to_decode, from_loop) = mpsc::channel::<ToDecode>();
    let (to_loop, from_decode) = mpsc::channel();
    let written = Arc::new(AtomicU64::new(0));
    {
        let (stop, current, count) = (stop.clone(), current.clone(), written.clone());
        thread::spawn(move || {
            let mut queue: VecDeque<Wire> = VecDeque::new();
            let mut stream: Option<TcpStream> = None;
            let mut loop_gone = false;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                if stream.is_none() {
                    match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            if let Ok(reader) = s.try_clone() {
                                read_lines(reader, to_loop.clone(), move |w| {
                                    from_wire_prefill(w, part)
                                });
                            }
                            if let Ok(copy) = s.try_clone() {
                                *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(copy);
                            }
                            stream = Some(s);
                        }
                        Err(_) => thread::sleep(POLL),
                    }
                }
                if loop_gone {
                    if queue.is_empty() {
                        break;
                    }
                    thread::sleep(POLL);
                } else {
                    match from_loop.recv_timeout(POLL) {
                        Ok(m) => queue.push_back(to_wire_decode(m, part)),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => loop_gone = true,
                    }
                }
                let Some(s) = stream.as_mut() else { continue };
                while let Some(w) = queue.front() {
                    if let Err(e) = write_line(s, w) {
                        // D is gone; a restarted one may connect: keep the message for it.
                        tracing::warn!(%e, "router link: D's connection broke");
                        stream = None;
                        break;
                    }
                    queue.pop_front();
                    count.fetch_add(1, Ordering::Release);
                }
            }
        });
    }
    (
        PrefillLink::new(to_decode, from_decode, Some(written)),
        RouterGuard { stop, current },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_cross_with_plan_indices_and_ages() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        // D runs the plan from 2, P from 0.
        let (d, _dg) = decode_side(addr, 2, 8).unwrap();
        let (p, _pg) = prefill_side(addr, 0, 10, deadline);
        let params = KvTransferParams {
            remote_block_ids: Some(vec![vec![1, 2]]),
            ..KvTransferParams::default()
        };
        p.send(ToDecode::Abandoned { index: 1 });
        p.send(ToDecode::Params {
            index: 3,
            params: params.clone(),
        });
        let at = Instant::now() - Duration::from_millis(50);
        p.send(ToDecode::PrefillDone { index: 4, at });
        p.flush(Duration::from_secs(5));
        let wait = Duration::from_secs(5);
        // Index 1 is not in D's part: dropped.
        match d.from_prefill.recv_timeout(wait).unwrap() {
            ToDecode::Params { index, params: got } => {
                assert_eq!(index, 1);
                assert_eq!(got, params);
            }
            other => panic!("{other:?}"),
        }
        match d.from_prefill.recv_timeout(wait).unwrap() {
            ToDecode::PrefillDone { index, at: got } => {
                assert_eq!(index, 2);
                assert!(got <= Instant::now() - Duration::from_millis(50));
            }
            other => panic!("{other:?}"),
        }
        d.send(ToPrefill::Kept {
            index: 0,
            params: Box::new(params.clone()),
            since: Instant::now(),
        });
        d.send(ToPrefill::Ended { index: 1 });
        match p.from_decode.recv_timeout(wait).unwrap() {
            ToPrefill::Kept { index, .. } => assert_eq!(index, 2),
            other => panic!("{other:?}"),
        }
        match p.from_decode.recv_timeout(wait).unwrap() {
            ToPrefill::Ended { index } => assert_eq!(index, 3),
            other => panic!("{other:?}"),
        }
    }
}
