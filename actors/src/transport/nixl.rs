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
//! | [`Transport::invalidate_remote`] | `get_xfer_status` + release of the peer's requests, then `invalidate_remote_md` |
//! | [`Transport::post_write`] / [`Transport::post_read`] | two DRAM `XferDescList`s, `create_xfer_req` (notification in its `OptArgs`), `post_xfer_req` |
//! | [`Transport::poll_completions`] | `get_xfer_status` on every pending request; finished ones are released |
//! | [`Transport::abandon_write`] | `get_xfer_status`; refused while in progress (see below) |
//! | [`Transport::send_notification`] | `send_notification` (`genNotif`) |
//! | [`Transport::poll_notifications`] | `get_notifications` + `NotificationMap::get_notification_bytes` |
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
//!   invalidated (NIXL fails or, in older releases, frees the request), so
//!   [`Transport::invalidate_remote`] settles the peer's requests first: finished ones report
//!   their outcome, in-progress ones are released and reported as
//!   [`TransportError::PeerInvalidated`] — but, as above, **their bytes may still land in the
//!   peer's memory** (never their notification). A peer that reuses the target blocks of an
//!   invalidated writer must expect late bytes.
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
//! # Later
//!
//! Each post builds and syncs two descriptor lists and a request. Prepared lists
//! (`prepare_xfer_dlist` once per region table, `make_xfer_req` with block indices per post)
//! and reposting requests are the known optimisations; correctness first.

#[path = "nixl_memory.rs"]
mod memory;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use kvhandoff_protocol::{AgentName, MAX_REGIONS};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, NixlError, NotificationMap, OptArgs, RegistrationHandle,
    XferDescList, XferOp, XferRequest, XferStatus,
};

pub use memory::{HostBuffer, HOST_BUFFER_ALIGN};

use super::{
    AddrRange, Completion, Descriptor, Notification, Transport, TransportError,
    MAX_NOTIFICATION_LEN,
};
use crate::{PeerAddr, WriteId};

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

fn check_runtime() -> Result<(), String> {
    let name = CString::new(NIXL_CAPI_LIB).expect("invariant: no NUL in the library name");
    // SAFETY: `name` is a valid C string. The handle is kept open on purpose: the stubs open the
    // same library and keep it for the life of the process.
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
         (`source scripts/nixl-env.sh`). LD_LIBRARY_PATH={ld_path:?} (folders holding \
         {NIXL_CAPI_LIB}: {holders:?}), NIXL_PLUGIN_DIR={:?}",
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
    notifications: Unshared<NotificationMap>,
    /// `OptArgs` naming the UCX backend, for registrations.
    reg_args: Unshared<OptArgs>,
    /// `OptArgs` naming the UCX backend, plus the notification of the next request.
    xfer_args: Unshared<OptArgs>,
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
        // Release every request (in-progress ones may still move bytes until the agent is
        // destroyed), then deregister; the buffers themselves are freed after the agent.
        self.in_flight.clear();
        self.by_write.clear();
        for reg in self.regions.values_mut() {
            if let Some(mut handle) = reg.handle.take() {
                if let Err(err) = handle.deregister() {
                    tracing::warn!(buffer = ?reg.buffer, %err, "NIXL deregistration failed");
                }
            }
        }
    }
}

impl NixlTransport {
    /// Creates the agent `name` with a UCX backend.
    ///
    /// # Errors
    /// [`TransportError::Backend`] when the NIXL runtime cannot be loaded (see
    /// [`nixl_runtime_available`]), the UCX plugin is missing (`NIXL_PLUGIN_DIR`), or NIXL
    /// refuses to create the agent or the backend (e.g. `UCX_TLS` naming only shared-memory
    /// transports, which this machine kind refuses).
    pub fn new(name: AgentName, config: NixlConfig) -> Result<Self, TransportError> {
        nixl_runtime_available()?;
        let agent_config = AgentConfig {
            enable_prog_thread: config.progress_thread,
            pthr_delay_us: config.pthr_delay_us,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name.as_str(), &agent_config)
            .map_err(|e| backend_error("create agent", e))?;
        let plugins = agent
            .get_available_plugins()
            .map_err(|e| backend_error("list plugins", e))?;
        let plugins: Vec<String> = plugins
            .iter()
            .filter_map(Result::ok)
            .map(str::to_owned)
            .collect();
        if !plugins.iter().any(|p| p == BACKEND) {
            return Err(TransportError::Backend {
                reason: format!(
                    "NIXL plugin {BACKEND} not found (plugins: {plugins:?}); set \
                     NIXL_PLUGIN_DIR to the nixl-cu12 wheel's .nixl_cu12.mesonpy.libs/plugins \
                     (`source scripts/nixl-env.sh`); NIXL_PLUGIN_DIR={:?}",
                    std::env::var("NIXL_PLUGIN_DIR").ok()
                ),
            });
        }
        let (_mems, params) = agent
            .get_plugin_params(BACKEND)
            .map_err(|e| backend_error("UCX plugin parameters", e))?;
        let backend = agent
            .create_backend(BACKEND, &params)
            .map_err(|e| backend_error("create UCX backend (is UCX_TLS restricted?)", e))?;
        let with_backend = || -> Result<OptArgs, TransportError> {
            let mut args = OptArgs::new().map_err(|e| backend_error("opt args", e))?;
            args.add_backend(&backend)
                .map_err(|e| backend_error("opt args: add backend", e))?;
            Ok(args)
        };
        let reg_args = with_backend()?;
        let xfer_args = with_backend()?;
        let notifications =
            NotificationMap::new().map_err(|e| backend_error("notification map", e))?;
        Ok(Self {
            name,
            config,
            in_flight: BTreeMap::new(),
            by_write: HashMap::new(),
            next_seq: 0,
            done: VecDeque::new(),
            peers: HashMap::new(),
            agents: HashMap::new(),
            tombstones: VecDeque::new(),
            notifications: Unshared(notifications),
            reg_args: Unshared(reg_args),
            xfer_args: Unshared(xfer_args),
            _backend: backend,
            agent,
            regions: BTreeMap::new(),
        })
    }

    /// The configuration the transport was created with.
    pub fn config(&self) -> &NixlConfig {
        &self.config
    }

    /// Transfers posted and not yet reported.
    pub fn pending(&self) -> usize {
        self.in_flight.len() + self.done.len()
    }

    /// The registered buffer holding `[addr, addr + len)`, if any.
    fn local_region(&self, addr: u64, len: u64) -> Option<u64> {
        self.regions
            .range(..=addr)
            .next_back()
            .filter(|(_, r)| r.buffer.range().contains(addr, len))
            .map(|(&base, _)| base)
    }

    fn is_pending(&self, write: WriteId) -> bool {
        self.by_write.contains_key(&write) || self.done.iter().any(|c| c.write == write)
    }

    /// Whether NIXL still holds metadata for `agent` (it drops it itself after a disconnect).
    fn nixl_knows(&self, agent: &AgentName) -> bool {
        self.agent.check_remote_metadata(agent.as_str(), None)
    }

    fn loaded_agent(&self, peer: &PeerAddr) -> Result<AgentName, TransportError> {
        match self.peers.get(peer) {
            None => Err(TransportError::UnknownPeer { peer: peer.clone() }),
            Some(PeerState::Invalidated) => {
                Err(TransportError::PeerInvalidated { peer: peer.clone() })
            }
            Some(PeerState::Loaded(agent)) => Ok(agent.clone()),
        }
    }

    fn remember_invalidated(&mut self, peer: &PeerAddr) {
        self.peers.insert(peer.clone(), PeerState::Invalidated);
        self.tombstones.retain(|p| p != peer);
        self.tombstones.push_back(peer.clone());
        while self.tombstones.len() > self.config.max_peers {
            if let Some(old) = self.tombstones.pop_front() {
                if self.peers.get(&old) == Some(&PeerState::Invalidated) {
                    self.peers.remove(&old);
                }
            }
        }
    }

    /// Why `create_xfer_req` failed, after every local check passed.
    fn diagnose_create(
        &self,
        agent: &AgentName,
        descriptors: &[Descriptor],
        err: NixlError,
    ) -> TransportError {
        if !self.nixl_knows(agent) {
            return TransportError::PeerUnreachable {
                agent: agent.clone(),
            };
        }
        for (index, d) in descriptors.iter().enumerate() {
            let mut one = match XferDescList::new(MemType::Dram) {
                Ok(list) => list,
                Err(e) => return backend_error("descriptor list", e),
            };
            one.add_desc(d.remote_addr as usize, d.len as usize, 0);
            if !self.agent.check_remote_metadata(agent.as_str(), Some(&one)) {
                return TransportError::RemoteOutOfRange {
                    index,
                    addr: d.remote_addr,
                    len: d.len,
                };
            }
        }
        TransportError::PostFailed {
            reason: format!("NIXL create_xfer_req: {err}"),
        }
    }

    fn post(
        &mut self,
        op: XferOp,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        let config = &self.config;
        if let Some(n) = &notification {
            if n.len() > config.max_notification_len {
                return Err(TransportError::NotificationTooLarge {
                    len: n.len(),
                    limit: config.max_notification_len,
                });
            }
        }
        if descriptors.is_empty() {
            return Err(TransportError::NoDescriptors);
        }
        if descriptors.len() > config.max_descriptors {
            return Err(TransportError::TooManyDescriptors {
                count: descriptors.len(),
                limit: config.max_descriptors,
            });
        }
        if self.is_pending(write) {
            return Err(TransportError::DuplicateWrite { write });
        }
        if self.pending() >= config.max_in_flight {
            return Err(TransportError::TooManyInFlight {
                limit: config.max_in_flight,
            });
        }
        let agent = self.loaded_agent(peer)?;
        let mut local = XferDescList::new(MemType::Dram)
            .map_err(|e| backend_error("local descriptor list", e))?;
        let mut remote = XferDescList::new(MemType::Dram)
            .map_err(|e| backend_error("remote descriptor list", e))?;
        for (index, d) in descriptors.iter().enumerate() {
            if d.len == 0 {
                return Err(TransportError::EmptyDescriptor { index });
            }
            // Inside a registered buffer, so the address and length fit a `usize`.
            if self.local_region(d.local_addr, d.len).is_none() {
                return Err(TransportError::LocalOutOfRange {
                    index,
                    addr: d.local_addr,
                    len: d.len,
                });
            }
            let remote_span = usize::try_from(d.remote_addr)
                .ok()
                .filter(|addr| addr.checked_add(d.len as usize).is_some());
            let Some(remote_addr) = remote_span else {
                return Err(TransportError::RemoteOutOfRange {
                    index,
                    addr: d.remote_addr,
                    len: d.len,
                });
            };
            local.add_desc(d.local_addr as usize, d.len as usize, 0);
            remote.add_desc(remote_addr, d.len as usize, 0);
        }
        let args = &mut self.xfer_args.0;
        match &notification {
            Some(bytes) => {
                args.set_has_notification(true)
                    .map_err(|e| backend_error("opt args: notification flag", e))?;
                args.set_notification_message(bytes)
                    .map_err(|e| backend_error("opt args: notification", e))?;
            }
            None => args
                .set_has_notification(false)
                .map_err(|e| backend_error("opt args: notification flag", e))?,
        }
        let req = self
            .agent
            .create_xfer_req(op, &local, &remote, agent.as_str(), Some(&self.xfer_args.0))
            .map_err(|e| self.diagnose_create(&agent, descriptors, e))?;
        let in_progress = match self.agent.post_xfer_req(&req, None) {
            Ok(in_progress) => in_progress,
            Err(err) => {
                drop(req);
                return Err(if self.nixl_knows(&agent) {
                    TransportError::PostFailed {
                        reason: format!("NIXL post_xfer_req: {err}"),
                    }
                } else {
                    TransportError::PeerUnreachable { agent }
                });
            }
        };
        if in_progress {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.by_write.insert(write, seq);
            self.in_flight.insert(
                seq,
                InFlight {
                    write,
                    peer: peer.clone(),
                    agent,
                    req,
                },
            );
        } else {
            // Done within the post (data and notification); reported by the next poll.
            drop(req);
            self.done.push_back(Completion {
                write,
                result: Ok(()),
            });
        }
        Ok(())
    }

    /// The outcome of a pending request, `None` while it is in progress.
    fn status(&self, x: &InFlight) -> Option<Result<(), TransportError>> {
        match self.agent.get_xfer_status(&x.req) {
            Ok(XferStatus::InProgress) => None,
            Ok(XferStatus::Success) => Some(Ok(())),
            Err(err) if !self.nixl_knows(&x.agent) => {
                tracing::debug!(write = %x.write, %err, "transfer failed, remote disconnected");
                Some(Err(TransportError::PeerUnreachable {
                    agent: x.agent.clone(),
                }))
            }
            Err(err) => Some(Err(TransportError::TransferFailed {
                reason: format!("NIXL get_xfer_status: {err}"),
            })),
        }
    }

    /// Removes a pending request (releasing it) and queues its completion.
    fn finish(&mut self, seq: u64, result: Result<(), TransportError>) {
        if let Some(x) = self.in_flight.remove(&seq) {
            self.by_write.remove(&x.write);
            self.done.push_back(Completion {
                write: x.write,
                result,
            });
        }
    }
}

impl Transport for NixlTransport {
    type Region = HostBuffer;

    fn agent_name(&self) -> &AgentName {
        &self.name
    }

    /// Registers one allocation (NIXL: `register_memory`). A buffer may back several
    /// [`kvhandoff_protocol::RegionDesc`]s; register it once.
    ///
    /// # Errors
    /// [`TransportError::AlreadyRegistered`] when the buffer (or memory overlapping it) is
    /// registered already, [`TransportError::TooManyRegions`], or a NIXL refusal
    /// ([`TransportError::Backend`]).
    fn register_region(&mut self, region: &HostBuffer) -> Result<AddrRange, TransportError> {
        let range = region.range();
        let end = range
            .end()
            .ok_or(TransportError::BadRegionLen { len: range.len })?;
        if let Some((&base, _)) = self.regions.range(..end).next_back().filter(|(_, r)| {
            r.buffer
                .range()
                .end()
                .is_some_and(|other_end| other_end > range.base)
        }) {
            return Err(TransportError::AlreadyRegistered { base });
        }
        if self.regions.len() >= self.config.max_regions {
            return Err(TransportError::TooManyRegions {
                limit: self.config.max_regions,
            });
        }
        let handle = self
            .agent
            .register_memory(region, Some(&self.reg_args.0))
            .map_err(|e| backend_error("register_memory", e))?;
        self.regions.insert(
            range.base,
            Registered {
                handle: Some(handle),
                buffer: region.clone(),
            },
        );
        Ok(range)
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.agent
            .get_local_md()
            .map_err(|e| backend_error("get_local_md", e))
    }

    fn load_remote(
        &mut self,
        peer: &PeerAddr,
        agent: &AgentName,
        metadata: &[u8],
    ) -> Result<(), TransportError> {
        let conflict = || TransportError::LoadConflict {
            peer: peer.clone(),
            agent: agent.clone(),
        };
        let refresh = match self.peers.get(peer) {
            Some(PeerState::Loaded(loaded)) if loaded != agent => return Err(conflict()),
            Some(PeerState::Loaded(_)) => true,
            _ => false,
        };
        if self.agents.get(agent).is_some_and(|p| p != peer) {
            return Err(conflict());
        }
        if !refresh && self.agents.len() >= self.config.max_peers {
            return Err(TransportError::TooManyPeers {
                limit: self.config.max_peers,
            });
        }
        if metadata.is_empty() {
            return Err(TransportError::BadMetadata {
                why: "empty metadata",
            });
        }
        let found = self.agent.load_remote_md(metadata).map_err(|err| {
            tracing::debug!(%peer, %err, "NIXL refused remote metadata");
            TransportError::BadMetadata {
                why: "NIXL load_remote_md refused it",
            }
        })?;
        if found != agent.as_str() {
            // Undo the load, unless it refreshed an agent this transport uses for another peer.
            if !self.agents.keys().any(|a| a.as_str() == found) {
                if let Err(err) = self.agent.invalidate_remote_md(&found) {
                    tracing::debug!(%found, %err, "could not unload mismatched metadata");
                }
            }
            return Err(match AgentName::new(found.as_str()) {
                Ok(found) => TransportError::MetadataMismatch {
                    expected: agent.clone(),
                    found,
                },
                Err(_) => TransportError::BadMetadata {
                    why: "metadata names an invalid agent name",
                },
            });
        }
        self.tombstones.retain(|p| p != peer);
        self.peers
            .insert(peer.clone(), PeerState::Loaded(agent.clone()));
        self.agents.insert(agent.clone(), peer.clone());
        Ok(())
    }

    fn invalidate_remote(&mut self, peer: &PeerAddr) {
        let Some(PeerState::Loaded(agent)) = self.peers.get(peer).cloned() else {
            self.remember_invalidated(peer);
            return;
        };
        // Settle the peer's requests before NIXL forgets the remote: `get_xfer_status` must not
        // see a request whose remote metadata is gone.
        let seqs: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, x)| &x.peer == peer)
            .map(|(&seq, _)| seq)
            .collect();
        for seq in seqs {
            let result = match self.in_flight.get(&seq).and_then(|x| self.status(x)) {
                Some(result) => result,
                // Released below; its bytes may still land (see the module documentation).
                None => Err(TransportError::PeerInvalidated { peer: peer.clone() }),
            };
            self.finish(seq, result);
        }
        if let Err(err) = self.agent.invalidate_remote_md(agent.as_str()) {
            tracing::debug!(%peer, %agent, %err, "NIXL invalidate_remote_md failed");
        }
        self.agents.remove(&agent);
        self.remember_invalidated(peer);
    }

    fn post_write(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        self.post(XferOp::Write, write, peer, descriptors, notification)
    }

    fn post_read(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        self.post(XferOp::Read, write, peer, descriptors, notification)
    }

    /// Gives up on a pending transfer if NIXL has finished it (its real outcome is reported);
    /// refuses while it is in progress, because releasing a NIXL request does not stop its
    /// bytes (see the module documentation).
    ///
    /// # Errors
    /// [`TransportError::UnknownWrite`], or [`TransportError::AbandonRefused`] while the
    /// transfer is in progress.
    fn abandon_write(&mut self, write: WriteId) -> Result<(), TransportError> {
        if self.done.iter().any(|c| c.write == write) {
            return Ok(());
        }
        let Some(&seq) = self.by_write.get(&write) else {
            return Err(TransportError::UnknownWrite { write });
        };
        match self.in_flight.get(&seq).and_then(|x| self.status(x)) {
            None => Err(TransportError::AbandonRefused { write }),
            Some(result) => {
                self.finish(seq, result);
                Ok(())
            }
        }
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>) {
        let finished: Vec<(u64, Result<(), TransportError>)> = self
            .in_flight
            .iter()
            .filter_map(|(&seq, x)| self.status(x).map(|result| (seq, result)))
            .collect();
        for (seq, result) in finished {
            self.finish(seq, result);
        }
        out.extend(self.done.drain(..));
    }

    /// # Errors
    /// As the trait; a remote that NIXL reports as failing (`NIXL_ERR_REMOTE_DISCONNECT`
    /// reaches the C API as a generic backend error) is [`TransportError::PeerUnreachable`].
    fn send_notification(&mut self, peer: &PeerAddr, bytes: Vec<u8>) -> Result<(), TransportError> {
        if bytes.len() > self.config.max_notification_len {
            return Err(TransportError::NotificationTooLarge {
                len: bytes.len(),
                limit: self.config.max_notification_len,
            });
        }
        let agent = self.loaded_agent(peer)?;
        self.agent
            .send_notification(agent.as_str(), &bytes, None)
            .map_err(|err| {
                tracing::debug!(%peer, %agent, %err, "NIXL send_notification failed");
                TransportError::PeerUnreachable { agent }
            })
    }

    /// Appends the received notifications, in arrival order per sender (NIXL groups them by
    /// sender, and the order across senders is not kept).
    fn poll_notifications(&mut self, out: &mut Vec<Notification>) {
        let map = &mut self.notifications.0;
        if let Err(err) = self.agent.get_notifications(map, None) {
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
            let from = AgentName::new(sender.as_str());
            for index in 0..count {
                let bytes = match map.get_notification_bytes(&sender, index) {
                    Ok(bytes) => bytes,
                    Err(err) => {
                        tracing::warn!(%sender, index, %err, "unreadable NIXL notification");
                        continue;
                    }
                };
                let Ok(from) = from.clone() else {
                    tracing::warn!(%sender, "notification from an invalid agent name dropped");
                    continue;
                };
                let peer = self.agents.get(&from).cloned();
                out.push(Notification { from, peer, bytes });
            }
        }
        // NIXL appends to the map and the C API has no clear that keeps binary payloads
        // (`take_notifs` fails on non-UTF-8 before clearing): start a fresh map.
        match NotificationMap::new() {
            Ok(fresh) => *map = fresh,
            Err(err) => tracing::error!(%err, "cannot replace the NIXL notification map"),
        }
    }

    fn max_notification_len(&self) -> usize {
        self.config.max_notification_len
    }
}
