//! The arrival poller: a thread per [`NixlTransport`](super::NixlTransport) that makes the
//! transport's owner poll as soon as something may have arrived, instead of on its next timer
//! tick.
//!
//! NIXL has no arrival callback: a notification or a finished transfer is only seen by calling
//! `get_notifications` / `get_xfer_status`. The transport actor polls on a tokio interval, and
//! tokio's timer has 1 ms resolution, so every hop of a handoff used to wait up to ~1 ms for the
//! next tick (`docs/benchmarks.md`, "Fixed cost per handoff"). This thread polls on a µs-precise
//! cadence instead, and calls the owner's [`ArrivalHook`] (the transport actor's `PollNow`,
//! coalesced to one in its mailbox) when there is something to report:
//!
//! - **notifications** it fetches itself (`get_notifications` on its own clone of the agent;
//!   `nixl-sys` serializes every call of one agent behind a lock) into a queue the transport
//!   drains first, and wakes the owner only when one came: an empty poll costs the owner
//!   nothing, which matters on a small machine where every wake-up of the actor's thread
//!   competes with the transfer;
//! - **transfers** it cannot check (their requests belong to the owner), so while one is pending
//!   it wakes the owner on every tick.
//!
//! It polls only while an arrival is likely:
//!
//! - **hot**: a transfer is pending, the rank expects something
//!   ([`Transport::set_expecting`](super::Transport::set_expecting): a live request), or
//!   something happened within [`PollerConfig::linger`] (a post, a sent or received
//!   notification, a completion). Right after activity it spins ([`PollerConfig::spin`],
//!   yielding between polls), then sleeps [`PollerConfig::interval`] between polls for
//!   [`PollerConfig::hot`], then backs off in proportion to how long it has been quiet, up to
//!   [`PollerConfig::max_interval`] (a 256 MiB write that takes 70 ms is then seen within ~1 ms,
//!   and polls during it — each of which slows the transfer — stay few);
//! - **idle**: otherwise it parks until the transport marks activity (a post, a send, the rank
//!   expecting work), with a deadline so that it also notices a stop that raced the park. An
//!   idle rank costs no wake-ups beyond the actor's own fallback timer.
//!
//! Order: every `get_notifications` of the agent, the owner's and the poller's, runs under the
//! queue's lock, and the owner takes the queue before fetching more, so notifications keep
//! their per-sender order. The thread ends when the transport is dropped (the drop joins it,
//! before the agent is destroyed), i.e. when the rank stops.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use nixl_sys::{Agent, NotificationMap};

use super::super::ArrivalHook;

/// Most notifications the thread holds for its owner; beyond it, it stops fetching (but still
/// rings the owner).
const MAX_FETCHED: usize = 1 << 16;

/// Notifications as NIXL hands them: the sender's agent name and the bytes.
pub(super) type RawNotes = Vec<(String, Vec<u8>)>;

/// Fetches the agent's new notifications into `out`, in NIXL's order per sender, and leaves
/// `map` empty.
pub(super) fn fetch(agent: &Agent, map: &mut NotificationMap, out: &mut RawNotes) {
    if let Err(err) = agent.get_notifications(map, None) {
        tracing::warn!(%err, "NIXL get_notifications failed");
    }
    if map.is_empty().unwrap_or(true) {
        return;
    }
    let senders: Vec<String> = map
        .agents()
        .filter_map(|a| a.ok().map(str::to_owned))
        .collect();
    for sender in senders {
        let count = map.get_notifications_size(&sender).unwrap_or(0);
        for index in 0..count {
            match map.get_notification_bytes(&sender, index) {
                Ok(bytes) => out.push((sender.clone(), bytes)),
                Err(err) => tracing::warn!(%sender, index, %err, "unreadable NIXL notification"),
            }
        }
    }
    // NIXL appends to the map and the C API has no clear that keeps binary payloads
    // (`take_notifs` fails on non-UTF-8 before clearing): start a fresh map.
    match NotificationMap::new() {
        Ok(fresh) => *map = fresh,
        Err(err) => tracing::error!(%err, "cannot replace the NIXL notification map"),
    }
}

/// The name of every poller thread (`/proc/<pid>/task/*/comm`; tests count them).
pub const POLLER_THREAD_NAME: &str = "kvh-nixl-poll";

/// How eagerly the arrival poller polls (the poller itself is described in the module
/// `transport::nixl::poller`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollerConfig {
    /// After activity, poll back to back (yielding in between) for this long: a notification
    /// hop between two agents of one machine takes tens of µs, and a sleep, however short,
    /// costs a scheduler round trip.
    pub spin: Duration,
    /// Then sleep this long between polls (the thread's timer slack is set to 1 µs, so this is
    /// what it sleeps, not the kernel's default 50 µs more).
    pub interval: Duration,
    /// For this long after the last activity.
    pub hot: Duration,
    /// Then sleep a sixteenth of the time since the last activity, at most this long. Not
    /// shorter: each poll during a long transfer slows it (measured, `docs/benchmarks.md`: a
    /// 100 µs cap cost the 256 MiB fragmented handoff 12–20% of its throughput, 1 ms ~2%).
    pub max_interval: Duration,
    /// With no transfer pending and nothing expected, keep polling this long after the last
    /// activity (a reply usually follows within it), then park.
    pub linger: Duration,
    /// A parked poller wakes at least this often to check whether its transport is gone
    /// (every wait has a deadline); it polls nothing then.
    pub park_deadline: Duration,
}

impl Default for PollerConfig {
    fn default() -> Self {
        PollerConfig {
            spin: Duration::from_micros(50),
            interval: Duration::from_micros(10),
            hot: Duration::from_millis(2),
            max_interval: Duration::from_millis(1),
            linger: Duration::from_millis(20),
            park_deadline: Duration::from_secs(1),
        }
    }
}

/// What the transport and its poller thread share.
struct Shared {
    /// Set by the transport's drop: the thread ends.
    stop: AtomicBool,
    /// The rank has live work that an arrival may advance.
    expecting: AtomicBool,
    /// Transfers posted and not yet reported.
    pending: AtomicUsize,
    /// Nanoseconds since `epoch` at the last activity.
    last_activity: AtomicU64,
    epoch: Instant,
    /// The owner's hook; replaced when the owner sets a new one.
    hook: Mutex<Option<ArrivalHook>>,
    /// Notifications the thread fetched and the owner has not taken yet. Every
    /// `get_notifications` of the agent runs under this lock (see the module documentation).
    notes: Mutex<RawNotes>,
}

impl Shared {
    fn since_activity(&self) -> Duration {
        let now = self.epoch.elapsed();
        now.saturating_sub(Duration::from_nanos(
            self.last_activity.load(Ordering::Acquire),
        ))
    }

    fn hot(&self, quiet: Duration, config: &PollerConfig) -> bool {
        self.expecting.load(Ordering::Acquire)
            || self.pending.load(Ordering::Acquire) > 0
            || quiet < config.linger
    }
}

/// The transport's end of the poller: starts the thread on the first hook, marks activity,
/// stops and joins the thread on drop.
pub(super) struct Poller {
    config: PollerConfig,
    /// A handle to the transport's agent, for the thread.
    agent: Agent,
    shared: Arc<Shared>,
    thread: Option<(Thread, JoinHandle<()>)>,
}

impl Poller {
    pub(super) fn new(config: PollerConfig, agent: Agent) -> Self {
        Poller {
            config,
            agent,
            shared: Arc::new(Shared {
                stop: AtomicBool::new(false),
                expecting: AtomicBool::new(false),
                pending: AtomicUsize::new(0),
                last_activity: AtomicU64::new(0),
                epoch: Instant::now(),
                hook: Mutex::new(None),
                notes: Mutex::new(Vec::new()),
            }),
            thread: None,
        }
    }

    /// Installs the owner's hook and starts the thread if it is not running. A thread that
    /// cannot start leaves the owner on its timer (logged): polling is an optimisation.
    pub(super) fn set_hook(&mut self, hook: ArrivalHook) {
        *lock(&self.shared.hook) = Some(hook);
        if self.thread.is_some() {
            self.activity();
            return;
        }
        let shared = Arc::clone(&self.shared);
        let config = self.config.clone();
        let agent = self.agent.clone();
        match thread::Builder::new()
            .name(POLLER_THREAD_NAME.into())
            .spawn(move || run(&shared, &config, &agent))
        {
            Ok(handle) => {
                self.thread = Some((handle.thread().clone(), handle));
                self.activity();
            }
            Err(err) => {
                tracing::warn!(%err, "NIXL arrival poller not started; polling on the timer")
            }
        }
    }

    /// The notifications the thread fetched, then the agent's newer ones (with the owner's
    /// `map`), in order.
    pub(super) fn collect(&self, agent: &Agent, map: &mut NotificationMap, out: &mut RawNotes) {
        let mut notes = lock(&self.shared.notes);
        out.append(&mut notes);
        fetch(agent, map, out);
    }

    /// Something happened that a reply or a completion may follow: poll hot again.
    pub(super) fn activity(&self) {
        let now = u64::try_from(self.shared.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.shared.last_activity.store(now, Ordering::Release);
        self.wake();
    }

    pub(super) fn set_pending(&self, pending: usize) {
        let before = self.shared.pending.swap(pending, Ordering::AcqRel);
        if pending > before {
            self.wake();
        }
    }

    pub(super) fn set_expecting(&self, expecting: bool) {
        let before = self.shared.expecting.swap(expecting, Ordering::AcqRel);
        if expecting && !before {
            self.activity();
        }
    }

    fn wake(&self) {
        if let Some((thread, _)) = &self.thread {
            thread.unpark();
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some((thread, handle)) = self.thread.take() {
            thread.unpark();
            // The thread only sleeps (bounded) and calls the hook (which never blocks), so this
            // returns within one of its waits.
            if handle.join().is_err() {
                tracing::error!("NIXL arrival poller panicked");
            }
        }
    }
}

extern "C" {
    fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
}

/// `PR_SET_TIMERSLACK`: how late the kernel may end this thread's sleeps.
const PR_SET_TIMERSLACK: std::ffi::c_int = 29;

/// A lock whose holder cannot leave its data inconsistent (a queue, a slot): a panic elsewhere
/// does not stop the poller.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn run(shared: &Shared, config: &PollerConfig, agent: &Agent) {
    // Linux lets a normal thread's sleep end up to 50 µs late by default, which would be most
    // of a hot poll interval; one nanosecond makes `thread::sleep` as precise as the machine
    // allows (measured on the 2-core VM: a 10 µs sleep took 84 µs, median of 5,000, with the
    // default slack, 29–31 µs with 1 ns).
    // SAFETY: PR_SET_TIMERSLACK takes one unsigned long and changes only this thread's slack.
    let slack_set = unsafe { prctl(PR_SET_TIMERSLACK, 1 as std::ffi::c_ulong) } == 0;
    if !slack_set {
        tracing::debug!("PR_SET_TIMERSLACK refused; the poller's sleeps run late");
    }
    // Made here: a notification map is a C++ object this thread alone uses.
    let mut map = match NotificationMap::new() {
        Ok(map) => map,
        Err(err) => {
            tracing::warn!(%err, "NIXL arrival poller has no notification map; polling on the timer");
            return;
        }
    };
    let mut fetched = Vec::new();
    while !shared.stop.load(Ordering::Acquire) {
        let quiet = shared.since_activity();
        if !shared.hot(quiet, config) {
            // Idle: a post, a send or the rank expecting work unparks us.
            thread::park_timeout(config.park_deadline);
            continue;
        }
        let arrived = {
            let mut notes = lock(&shared.notes);
            // Bounded: an owner that stopped taking them leaves the rest queued in NIXL.
            if notes.len() < MAX_FETCHED {
                fetch(agent, &mut map, &mut fetched);
            }
            notes.append(&mut fetched);
            !notes.is_empty()
        };
        if arrived || shared.pending.load(Ordering::Acquire) > 0 {
            if let Some(hook) = lock(&shared.hook).clone() {
                hook();
            }
        }
        if quiet < config.spin {
            thread::yield_now();
        } else if quiet < config.hot {
            thread::sleep(config.interval);
        } else {
            let cap = config.max_interval.max(config.interval);
            thread::sleep((quiet / 16).clamp(config.interval, cap));
        }
    }
}
