//! Finding the peer: TCP probes of its side channel and waits on this node's link; watching
//! for its deaths.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{LinkActor, QuerySideChannel, RankActor, RejectReason};
use kvhandoff_protocol::PeerAddr;

use super::{Connect, SideChannelStats};
use crate::demo::query_counters;
use kvhandoff_actors::system::blocking::ask;

/// How often the waits look again.
const WAIT_POLL: Duration = Duration::from_millis(2);
/// How often a refused TCP probe is repeated.
const PROBE_POLL: Duration = Duration::from_millis(20);

pub(super) fn side_channel(link: &actix::Addr<LinkActor>) -> Option<SideChannelStats> {
    ask(link, QuerySideChannel, Duration::from_secs(5))
}

/// Whether a TCP connection to `addr` is accepted now.
fn accepts(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

/// D: waits until P's side channel accepts, then hands P our handshake and waits until it
/// completed. Returns D's estimate of the moment P saw the handshake complete: the middle of
/// the handshake (P counts it after loading D and answering; D after loading P, which takes
/// about as long: with NIXL, tens of milliseconds each).
pub(super) fn await_prefill(
    link: &actix::Addr<LinkActor>,
    peer: SocketAddr,
    prefill: &PeerAddr,
    deadline: Instant,
) -> Result<Instant, String> {
    let never = || format!("P's side channel at {peer} never completed a handshake");
    loop {
        while !accepts(peer) {
            if Instant::now() + PROBE_POLL >= deadline {
                return Err(format!("P's side channel at {peer} never accepted"));
            }
            thread::sleep(PROBE_POLL);
        }
        let before = side_channel(link);
        let failed_before = before
            .as_ref()
            .map_or(0, |s| s.outgoing_failed.values().sum());
        let auth_before = before.map_or(0, |s| s.failures(RejectReason::AuthenticationFailed));
        let sent = Instant::now();
        link.do_send(Connect(prefill.clone()));
        loop {
            let Some(s) = side_channel(link) else {
                return Err("the link did not answer".into());
            };
            if s.outgoing_ok >= 1 {
                let took = sent.elapsed();
                eprintln!(
                    "kvhandoff node: handshake with {prefill} took {:.1} ms",
                    took.as_secs_f64() * 1e3
                );
                return Ok(sent + took / 2);
            }
            if s.failures(RejectReason::AuthenticationFailed) > auth_before {
                // Not a restart: the keys differ (or one side has none); retrying cannot help.
                return Err(format!(
                    "the handshake with {prefill} at {peer} failed authentication (check that \
                     both nodes have the same --psk-file, or both none)"
                ));
            }
            if s.outgoing_failed.values().sum::<u64>() > failed_before {
                // Refused or cut off: P may be restarting. Probe and try again.
                break;
            }
            if Instant::now() >= deadline {
                return Err(never());
            }
            thread::sleep(WAIT_POLL);
        }
        if Instant::now() + PROBE_POLL >= deadline {
            return Err(never());
        }
        thread::sleep(PROBE_POLL);
    }
}

/// P: waits until D's handshake arrived; returns when P saw it.
pub(super) fn await_decode(
    link: &actix::Addr<LinkActor>,
    deadline: Instant,
) -> Result<Instant, String> {
    loop {
        match side_channel(link) {
            Some(s) if s.incoming_ok >= 1 => return Ok(Instant::now()),
            Some(_) => {}
            None => return Err("the link did not answer".into()),
        }
        if Instant::now() >= deadline {
            let refused =
                side_channel(link).map_or(0, |s| s.rejections(RejectReason::AuthenticationFailed));
            return Err(if refused > 0 {
                format!(
                    "D never connected: {refused} handshake(s) failed authentication (check \
                     that both nodes have the same --psk-file, or both none)"
                )
            } else {
                "D never connected".into()
            });
        }
        thread::sleep(WAIT_POLL);
    }
}

/// P, after its last event: waits until D's side channel refuses connections (D exited) or
/// `until`. Returns whether D exited.
pub(super) fn await_exit(peer: SocketAddr, until: Instant) -> bool {
    loop {
        if !accepts(peer) {
            return true;
        }
        if Instant::now() + PROBE_POLL >= until {
            return false;
        }
        thread::sleep(PROBE_POLL);
    }
}

/// Watches the endpoint's `peers_declared_dead` on its own thread, every 10 ms, and notes when
/// each death was first seen.
pub(super) struct DeathWatch {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Vec<Instant>>>,
}

impl DeathWatch {
    const POLL: Duration = Duration::from_millis(10);

    pub(super) fn start(rank: actix::Addr<RankActor>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::Builder::new()
            .name("node-death-watch".into())
            .spawn(move || {
                let mut seen = Vec::new();
                let mut deaths = 0;
                while !flag.load(Ordering::Relaxed) {
                    if let Some(c) = query_counters(&rank) {
                        let now = Instant::now();
                        while deaths < c.peers_declared_dead {
                            deaths += 1;
                            seen.push(now);
                        }
                    }
                    thread::sleep(Self::POLL);
                }
                seen
            })
            .ok();
        DeathWatch { stop, thread }
    }

    /// Stops the watch; the deaths seen, in order.
    pub(super) fn finish(mut self) -> Vec<Instant> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for DeathWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
