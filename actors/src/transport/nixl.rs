//! The NIXL transport (cargo feature `nixl`): one `nixl_sys::Agent` per rank, UCX backend, DRAM.
//!
//! # Runtime
//!
//! `nixl-sys` is built with `stub-api`: it links no NIXL library and `dlopen()`s
//! `libnixl_capi.so` on the first NIXL call, and *aborts the process* if that fails.
//! [`NixlTransport::new`] therefore checks [`nixl_runtime_available`] first and returns a
//! [`TransportError::Backend`] naming `LD_LIBRARY_PATH` and `NIXL_PLUGIN_DIR` instead
//! (`source scripts/nixl-env.sh` sets both for the pinned `nixl-cu12` wheel).
//!
//! # Mapping
//!
//! | [`Transport`] | NIXL |
//! |---|---|
//! | [`Transport::register_region`] | `register_memory` (one per [`HostBuffer`]) |
//! | [`Transport::local_metadata`] | `get_local_md` |
//! | [`Transport::load_remote`] | `load_remote_md` (returned name checked against `agent`) |
//! | [`Transport::invalidate_remote`] | `get_xfer_status` of the peer's requests; `invalidate_remote_md` once none is in progress (deferred until the last one ends) |
//! | [`Transport::post_write`] / [`Transport::post_read`] | two DRAM `XferDescList`s, `create_xfer_req` (notification in its `OptArgs`), `post_xfer_req`; or, when every descriptor is one prepared block, `make_xfer_req` with block indices (see below) |
//! | [`Transport::prepare_blocks`] | `prepare_xfer_dlist` of one block-granular list per region table (`""` = the initiator's own, NIXL's `NIXL_INIT_AGENT`) |
//! | [`Transport::poll_completions`] | `get_xfer_status` on every pending request; finished ones are released |
//! | [`Transport::abandon_write`] | `get_xfer_status`; refused while in progress (see below) |
//! | [`Transport::send_notification`] | `send_notification` (`genNotif`) |
//! | [`Transport::poll_notifications`] | `get_notifications` + `NotificationMap::get_notification_bytes` |
//!
//! # Arrivals
//!
//! NIXL has no arrival callback, so [`Transport::set_arrival_hook`] starts an arrival poller
//! ([`NixlConfig::poller`], `poller.rs`): a thread that fetches notifications on a µs cadence
//! while an arrival is likely (a transfer pending, the rank [expecting](Transport::set_expecting)
//! something, recent activity), hands them to [`Transport::poll_notifications`] in order, and
//! calls the hook when one came or a transfer is pending; idle, it parks. It ends with the
//! transport.
//!
//! # Notifications are bytes
//!
//! NIXL notifications are `nixl_blob_t` (a `std::string` used as a byte buffer): the C API takes
//! a pointer and a length, and `NotificationMap::get_notification_bytes` hands the bytes back.
//! Only `NotificationMap::take_notifs` turns them into `String`s (and fails on non-UTF-8), so
//! this transport never calls it. Frames therefore travel **unencoded**: the tests send all 256
//! byte values (NUL included) and get them back exactly, standalone and attached to a write.
//! On this machine notifications of up to 32 MiB arrived intact; the bound enforced is
//! [`NixlConfig::max_notification_len`] (default [`MAX_NOTIFICATION_LEN`], one protocol frame).
//!
//! # What NIXL (1.5.1, UCX over loopback) does, measured
//!
//! - **Landing inside the post.** Between two agents of one process UCX picks TCP + CMA, and
//!   `post_xfer_req` usually moves every byte before it returns (it reports "done", even for
//!   256 MiB; on a loaded machine a 1 MiB post was once still in progress); the completion is
//!   still reported by the next [`Transport::poll_completions`]. With `UCX_TLS=tcp` posts
//!   return "in progress".
//! - **A released request still lands.** Releasing an in-progress request (dropping its
//!   `XferRequest`) does not stop its bytes: a released 64 MiB TCP write landed completely
//!   within 500 ms, also after `invalidate_remote_md`. Its notification is never sent (NIXL sends
//!   it from `get_xfer_status` once the data is done). Hence [`Transport::abandon_write`]
//!   returns [`TransportError::AbandonRefused`] for a transfer that is still in progress, and
//!   reports the real outcome of one that finished; it never reports
//!   [`TransportError::Abandoned`].
//! - **Invalidation.** `get_xfer_status` must not be called once the remote's metadata is
//!   invalidated (NIXL fails or, in older releases, frees the request), and releasing an
//!   in-progress request does not stop its bytes (above). So
//!   [`Transport::invalidate_remote`] reports the peer's finished requests, refuses new posts
//!   and notifications to the peer at once, but keeps the requests still in progress pending —
//!   **never reporting a transfer failed while it may still read the local blocks or land in
//!   the peer's** — and invalidates the metadata only when the last of them has ended and been
//!   reported with its real result (`draining`). Reloading the same agent meanwhile cancels the
//!   deferred invalidation. A peer that reuses the target blocks of an invalidated writer must
//!   still expect late bytes: that is D's fence (`Config::quarantine`).
//! - **Dead peers.** Once a remote agent is gone (dropped in-process, mid-write over TCP), NIXL
//!   reports `NIXL_ERR_REMOTE_DISCONNECT` at once (within ~0.1 ms), but the C API collapses it
//!   into a generic backend error, and NIXL keeps the remote's metadata. So an in-flight write
//!   completes with [`TransportError::TransferFailed`], a later post fails with
//!   [`TransportError::PostFailed`], and a notification with
//!   [`TransportError::PeerUnreachable`] (the only failure `genNotif` has for a loaded peer).
//!   Should NIXL have dropped the metadata, posts and completions say
//!   [`TransportError::PeerUnreachable`] instead.
//! - **Remote ranges** are checked by `create_xfer_req` (it fails without saying why); on that
//!   failure each remote span is checked with `check_remote_metadata` to report
//!   [`TransportError::RemoteOutOfRange`] with the offending index.
//!
//! # Coalesced dynamic lists vs prepared block lists
//!
//! A post can reach NIXL two ways:
//!
//! - **Dynamic** (`create_xfer_req`): two `XferDescList`s built for this post from its
//!   descriptors. The planner coalesces runs of adjacent blocks into one descriptor, so a
//!   contiguous handoff is a handful of descriptors whatever its block count; NIXL then resolves
//!   each against the registrations of both agents, per post.
//! - **Prepared** (`make_xfer_req`): [`Transport::prepare_blocks`] prepares, once per region
//!   table, one list with an entry per block (entry `first(region) + block`, `block_len` bytes at
//!   `base + block * block_len`; `first` sums the blocks of the regions before it), for the local
//!   table (agent name `""`, NIXL's `NIXL_INIT_AGENT`) and for each loaded peer (dropped on
//!   invalidation and on reload). A post whose every descriptor is exactly one block on both
//!   sides (aligned to a block of a prepared region, `len == block_len`) is posted by index,
//!   with no per-request list and no per-post resolution.
//!
//! Fewer descriptors matter more than cheaper ones, so coalesced plans always take the dynamic
//! path; the prepared path serves fully scattered plans (every block its own descriptor), where
//! coalescing saved nothing. Any failure to prepare, or of `make_xfer_req`, falls back to the
//! dynamic path, which also produces the typed errors. [`NixlTransport::prepared_posts`] and
//! [`NixlTransport::dynamic_posts`] count the two; [`NixlConfig::prepared_lists`] `= false`
//! forces the dynamic path (for measuring the gain: `prepared_gain` of `bench transfer`). Reposting requests is a further, unexplored
//! optimisation.

mod agent;
mod host_buffer;
mod nixl_transport;
mod poller;
mod prepared;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use kvhandoff_protocol::{AgentName, MAX_REGIONS};
use nixl_sys::{
    Agent, Backend, NixlError, NotificationMap, OptArgs, RegistrationHandle, XferRequest,
};

pub use host_buffer::{HostBuffer, HOST_BUFFER_ALIGN};
pub use poller::{PollerConfig, POLLER_THREAD_NAME};

use super::{
    AddrRange, Completion, Descriptor, Notification, Transport, TransportError,
    MAX_NOTIFICATION_LEN,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

/// The C API library `nixl-sys`'s stubs `dlopen()`, by exactly this name.
pub const NIXL_CAPI_LIB: &str = "libnixl_capi.so";

/// The NIXL backend plugin this transport uses.
const BACKEND: &str = "UCX";

/// Configuration of a [`NixlTransport`]: the agent's progress thread and the bounds of its
/// tables (each bounded like [`super::mem::MemLimits`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlConfig {
    /// Run NIXL's progress thread (`AgentConfig::enable_prog_thread`). Keep it on: with it off a
    /// WRITE over UCX/TCP completes only while the *target* agent is progressed too, and in one
    /// process polling only the initiator it never does
    /// (`/work/shared/reference/nixl-on-this-machine.md`).
    pub progress_thread: bool,
    /// The progress thread's sleep between sweeps (`AgentConfig::pthr_delay_us`). Default 10:
    /// measured on this machine kind (reference doc, two processes), the crate default 0 gives a
    /// 9.4–10.4 ms notification round trip; 1 µs ~280 µs; 10 µs ~80 µs (the lowest) at
    /// ~1.5 GB/s for a 32 MiB write; 100 µs ~110 µs at ~2.1 GB/s; 1000 µs ~320 µs. The round
    /// trip is on every request's critical path (handshake, completion notices), bandwidth is
    /// dominated by the write itself, so the lowest-latency setting wins.
    pub pthr_delay_us: u64,
    /// Most transfers pending (posted and not yet reported).
    pub max_in_flight: usize,
    /// Most descriptors per transfer.
    pub max_descriptors: usize,
    /// Most bytes per notification.
    pub max_notification_len: usize,
    /// Most loaded peers (invalidated peers are remembered up to the same number).
    pub max_peers: usize,
    /// Most registered buffers.
    pub max_regions: usize,
    /// The arrival poller ([`PollerConfig`]): a thread that makes the transport's owner poll
    /// as soon as a notification or a completion may be there, while one is likely, instead
    /// of on the owner's timer. `None`: the owner's timer only (every hop of a handoff then
    /// waits for its next tick, ~1 ms under tokio).
    pub poller: Option<PollerConfig>,
    /// Use prepared block lists ([`Transport::prepare_blocks`], `make_xfer_req`) for posts
    /// whose every descriptor is one prepared block (default true). False makes
    /// `prepare_blocks` a no-op and sends every post through dynamic lists
    /// (`create_xfer_req`): the switch `bench transfer` uses to measure `prepared_gain`.
    pub prepared_lists: bool,
}

impl Default for NixlConfig {
    fn default() -> Self {
        Self {
            progress_thread: true,
            pthr_delay_us: 10,
            max_in_flight: 1024,
            max_descriptors: 1 << 16,
            max_notification_len: MAX_NOTIFICATION_LEN,
            max_peers: 1024,
            max_regions: MAX_REGIONS,
            poller: Some(PollerConfig::default()),
            prepared_lists: true,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Runtime check
// ---------------------------------------------------------------------------------------------

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

/// `RTLD_NOW | RTLD_LOCAL` on Linux: the flags `nixl-sys`'s stubs use.
const RTLD_NOW_LOCAL: c_int = 2;

/// Whether the NIXL runtime can be used: `libnixl_capi.so` loads (the very `dlopen` the
/// `nixl-sys` stubs do) and the stubs found it too. Call before any other NIXL call: without
/// the library the stubs abort the process. The answer is computed once per process.
///
/// # Errors
/// [`TransportError::Backend`] with the loader's reason, the values of `LD_LIBRARY_PATH` and
/// `NIXL_PLUGIN_DIR` and how to set them.
pub fn nixl_runtime_available() -> Result<(), TransportError> {
    static CHECK: OnceLock<Result<(), String>> = OnceLock::new();
    CHECK
        .get_or_init(check_runtime)
        .clone()
        .map_err(|reason| TransportError::Backend { reason })
}

/// The `nixl-cu12` wheel `scripts/test.sh` installs, and where it goes by default.
const PINNED_NIXL_WHEEL: &str = "nixl-cu12-1.5.1";

/// Where a NIXL runtime may be when the loader's own path does not find it: `$NIXL_HOME`'s,
/// then the default install location of the pinned wheel (`scripts/test.sh`'s), so that a
/// binary run without `source scripts/nixl-env.sh` still finds it.
fn runtime_candidates() -> Vec<std::path::PathBuf> {
    let libs = |home: std::path::PathBuf| home.join(".nixl_cu12.mesonpy.libs");
    let mut homes = Vec::new();
    if let Some(home) = std::env::var_os("NIXL_HOME") {
        homes.push(std::path::PathBuf::from(home));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")));
    if let Some(cache) = cache {
        homes.push(cache.join("kvhandoff").join(PINNED_NIXL_WHEEL));
    }
    homes.into_iter().map(libs).collect()
}

/// The folder holding the NIXL runtime this process would load: the first folder of
/// `LD_LIBRARY_PATH`, then of the install locations, that has `libnixl_capi.so`. The pinned
/// wheel's folder is named for its version (`…/nixl-cu12-1.5.1/.nixl_cu12.mesonpy.libs`), which
/// `kvhandoff version` prints.
pub fn nixl_runtime_folder() -> Option<std::path::PathBuf> {
    let ld_path = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    std::env::split_paths(&ld_path)
        .chain(runtime_candidates())
        .find(|dir| dir.join(NIXL_CAPI_LIB).is_file())
}

/// `dlopen`s `path` (with the stubs' flags); whether it loaded.
fn open_library(path: &CStr) -> bool {
    // SAFETY: `path` is a valid C string. The handle is kept open on purpose: the stubs open
    // the same library (by its name, which then matches this loaded object) and keep it for
    // the life of the process.
    !unsafe { dlopen(path.as_ptr(), RTLD_NOW_LOCAL) }.is_null()
}

/// Loads the runtime from the first candidate folder that has it, and points NIXL at that
/// folder's plugins if nothing else did; the folder, if one loaded.
fn load_from_candidates() -> Option<std::path::PathBuf> {
    for dir in runtime_candidates() {
        let library = dir.join(NIXL_CAPI_LIB);
        let Ok(path) = CString::new(library.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        if library.is_file() && open_library(&path) {
            if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
                // Read by NIXL when an agent creates its backend, after this check: this runs
                // once, before any agent exists.
                std::env::set_var("NIXL_PLUGIN_DIR", dir.join("plugins"));
            }
            return Some(dir);
        }
    }
    None
}

fn check_runtime() -> Result<(), String> {
    let name = CString::new(NIXL_CAPI_LIB).expect("invariant: no NUL in the library name");
    if !open_library(&name) && load_from_candidates().is_some() {
        tracing::info!("NIXL runtime found at its install location (no LD_LIBRARY_PATH needed)");
    }
    // SAFETY: `name` is a valid C string; see `open_library`.
    let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by libc, read at once.
        let reason = unsafe {
            let err = dlerror();
            if err.is_null() {
                "unknown dlopen error".to_owned()
            } else {
                CStr::from_ptr(err).to_string_lossy().into_owned()
            }
        };
        return Err(missing_runtime(&reason));
    }
    // The stubs' own view (they dlopen once and remember the result); this call never aborts.
    if nixl_sys::is_stub() {
        return Err(missing_runtime(
            "nixl_sys::is_stub() reports no NIXL library",
        ));
    }
    Ok(())
}

fn missing_runtime(reason: &str) -> String {
    let ld_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let holders: Vec<&str> = ld_path
        .split(':')
        .filter(|dir| !dir.is_empty() && Path::new(dir).join(NIXL_CAPI_LIB).is_file())
        .collect();
    format!(
        "NIXL runtime not loadable: {reason}. nixl-sys is built with `stub-api` and dlopens \
         {NIXL_CAPI_LIB} at run time; set LD_LIBRARY_PATH to include the nixl-cu12==1.5.1 \
         wheel's .nixl_cu12.mesonpy.libs folder and NIXL_PLUGIN_DIR to its plugins folder \
         (`source scripts/nixl-env.sh`), or install the wheel where it is searched (`scripts/\
         test.sh` does: {:?}). LD_LIBRARY_PATH={ld_path:?} (folders holding {NIXL_CAPI_LIB}: \
         {holders:?}), NIXL_PLUGIN_DIR={:?}",
        runtime_candidates(),
        std::env::var("NIXL_PLUGIN_DIR").ok()
    )
}

fn backend_error(what: &str, err: NixlError) -> TransportError {
    TransportError::Backend {
        reason: format!("NIXL {what}: {err}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The transport
// ---------------------------------------------------------------------------------------------

/// A C-API object with no thread affinity (`OptArgs`, `NotificationMap`: plain heap objects),
/// which `nixl-sys` leaves `!Send` only because it holds a raw pointer.
struct Unshared<T>(T);

// SAFETY: the wrapped objects are heap data of the NIXL C API that no other thread references;
// they are only used through `&mut NixlTransport` (or `&`, for calls that only read them), so
// moving the transport to another thread moves them with it and never shares them.
unsafe impl<T> Send for Unshared<T> {}

/// A registered buffer. `handle` is declared first so that it deregisters before `buffer`
/// (possibly the last handle to the memory) is dropped.
struct Registered {
    handle: Option<RegistrationHandle>,
    buffer: HostBuffer,
}

/// A posted transfer that NIXL has not finished.
struct InFlight {
    write: WriteId,
    peer: PeerAddr,
    agent: AgentName,
    req: XferRequest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerState {
    Loaded(AgentName),
    Invalidated,
}

/// One rank's NIXL agent as a [`Transport`]; see the [module documentation](self).
///
/// Registered memory is [`HostBuffer`]s (DRAM). `register_region` is per *allocation*: when
/// several layers share one tensor, register the tensor once; the handshake's region table may
/// then have several [`kvhandoff_protocol::RegionDesc`]s pointing inside it (descriptors are
/// checked against the registered allocations, not against region descriptors).
///
/// ```no_run
/// use kvhandoff_actors::transport::nixl::{HostBuffer, NixlConfig, NixlTransport};
/// use kvhandoff_actors::transport::Transport;
/// use kvhandoff_protocol::AgentName;
///
/// let mut p = NixlTransport::new(AgentName::new("prefill-0/0")?, NixlConfig::default())?;
/// let kv = HostBuffer::new(1 << 20)?;
/// let range = p.register_region(&kv)?;
/// let metadata = p.local_metadata()?; // hand to the peer over the side channel
/// # let _ = (range, metadata);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct NixlTransport {
    name: AgentName,
    config: NixlConfig,
    /// Pending requests by post order (a sequence number), and their ids.
    in_flight: BTreeMap<u64, InFlight>,
    by_write: HashMap<WriteId, u64>,
    next_seq: u64,
    /// Finished transfers not reported yet, in finishing order.
    done: VecDeque<Completion>,
    peers: HashMap<PeerAddr, PeerState>,
    /// Loaded agents, to resolve notification senders (and refuse double pairings).
    agents: HashMap<AgentName, PeerAddr>,
    /// Invalidated peers, oldest first (bounded by `max_peers`).
    tombstones: VecDeque<PeerAddr>,
    /// Agents invalidated while transfers to them were in progress: NIXL cannot stop those, so
    /// their metadata stays loaded (for `get_xfer_status`) until the last one ends and is
    /// reported with its real result; then it is invalidated.
    draining: BTreeSet<AgentName>,
    notifications: Unshared<NotificationMap>,
    /// `OptArgs` naming the UCX backend, for registrations.
    reg_args: Unshared<OptArgs>,
    /// `OptArgs` naming the UCX backend, plus the notification of the next request.
    xfer_args: Unshared<OptArgs>,
    /// This agent's region table, prepared ([`Transport::prepare_blocks`] with `None`).
    local_blocks: Option<prepared::PreparedBlocks>,
    /// Loaded peers' region tables, prepared; dropped on invalidation and reload.
    peer_blocks: HashMap<PeerAddr, prepared::PreparedBlocks>,
    /// Posts that took the prepared path, and the dynamic one.
    prepared_posts: u64,
    dynamic_posts: u64,
    /// The arrival poller, when configured; its thread starts with the owner's arrival hook
    /// and is joined when the transport is dropped.
    poller: Option<poller::Poller>,
    _backend: Backend,
    /// Declared before `regions`: once the explicit `Drop` released the requests and
    /// deregistered the buffers, this is the last handle to the agent, so the agent (and its
    /// UCX workers, which may still run released transfers) is destroyed before the buffers
    /// are freed.
    agent: Agent,
    /// Registered buffers by base address.
    regions: BTreeMap<u64, Registered>,
}

impl fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlTransport")
            .field("name", &self.name)
            .field("in_flight", &self.in_flight.len())
            .field("done", &self.done.len())
            .field("peers", &self.agents.len())
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        // Stop and join the poller first: its thread holds a handle to the agent, which must
        // be destroyed below, before the buffers.
        self.poller = None;
        // Release every request (in-progress ones may still move bytes until the agent is
        // destroyed), then deregister; the buffers themselves are freed after the agent.
        self.in_flight.clear();
        self.by_write.clear();
        // Prepared lists hold a raw pointer to the agent: release them while it lives.
        self.local_blocks = None;
        self.peer_blocks.clear();
        for reg in self.regions.values_mut() {
            if let Some(mut handle) = reg.handle.take() {
                if let Err(err) = handle.deregister() {
                    tracing::warn!(buffer = ?reg.buffer, %err, "NIXL deregistration failed");
                }
            }
        }
    }
}
