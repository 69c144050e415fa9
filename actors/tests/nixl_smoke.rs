//! Smoke tests against the real NIXL runtime (UCX backend, DRAM only).
//!
//! `nixl-sys` is built with `stub-api`: it links no NIXL library and
//! `dlopen()`s `libnixl_capi.so` on first use. Run with the environment of
//! `scripts/nixl-env.sh` (which `scripts/test.sh` sources), i.e. with
//! `LD_LIBRARY_PATH` holding the `nixl-cu12` wheel's `.nixl_cu12.mesonpy.libs`
//! and `NIXL_PLUGIN_DIR` its `plugins` folder. Without the library these tests
//! fail with a message naming both variables (they do not skip).
//!
//! Run: `cargo test -p kvhandoff-actors --features nixl --test nixl_smoke -- --nocapture`
//! (`--nocapture` shows the measured timings).
#![cfg(feature = "nixl")]

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap,
    OptArgs, RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};

/// Every wait in this file polls against this deadline; nothing waits unbounded.
const DEADLINE: Duration = Duration::from_secs(30);
/// Size of the smoke-test WRITE.
const WRITE_LEN: usize = 1 << 20;
/// Name of the wheel's C API library, exactly as `nixl-sys`'s stubs dlopen it.
const CAPI_LIB: &str = "libnixl_capi.so";

/// NIXL keeps process-wide state (plugin manager, UCX contexts); the tests of
/// this binary take turns so they neither race on it nor skew the timings.
static NIXL_SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    NIXL_SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The agent configuration of these tests.
///
/// - `enable_prog_thread: true`: with the progress thread off, a WRITE over
///   UCX/TCP only completes while the *target* agent is progressed too (by
///   polling it); in one process polling only the initiator it never does.
/// - `pthr_delay_us: 10`: the crate default (`AgentConfig::default()`) is 0,
///   which on the reference machine gave a ~10 ms notification round trip
///   between two processes; 10 µs gave the lowest one there (~80 µs) at a
///   still-usable bandwidth (see
///   /work/shared/reference/nixl-on-this-machine.md). In this one-process test
///   0 gave an 8-32 ms round trip, 1 and 10 both ~16-90 µs.
/// - the rest is the crate default: no listen thread (metadata is exchanged
///   in-process), `ThreadSync::None` (each agent is driven from one thread),
///   one worker, no telemetry.
fn agent_config() -> AgentConfig {
    AgentConfig {
        enable_prog_thread: true,
        pthr_delay_us: 10,
        ..AgentConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Runtime checks: fail clearly instead of letting the stubs abort the process.
// ---------------------------------------------------------------------------

/// Panics with a clear message unless `libnixl_capi.so` can be loaded.
///
/// The `stub-api` build calls `std::abort()` on the first NIXL call when the
/// library is missing, which would kill the whole test binary without a test
/// failure; so check first, with the very same `dlopen` the stubs use.
fn require_nixl_runtime() {
    let name = CString::new(CAPI_LIB).expect("no NUL in library name");
    // SAFETY: `name` is a valid C string; the handle is intentionally kept
    // open (the stubs open the same library and keep it for the process).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by libc.
        let reason = unsafe {
            let err = libc::dlerror();
            if err.is_null() {
                "unknown dlopen error".to_owned()
            } else {
                CStr::from_ptr(err).to_string_lossy().into_owned()
            }
        };
        panic!("{}", missing_runtime_message(&reason));
    }
    // The stubs' own view (they dlopen once and remember the result).
    assert!(
        !nixl_sys::is_stub(),
        "{}",
        missing_runtime_message("nixl_sys::is_stub() reports no NIXL library")
    );
}

fn missing_runtime_message(reason: &str) -> String {
    let ld_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let holders: Vec<&str> = ld_path
        .split(':')
        .filter(|dir| !dir.is_empty() && Path::new(dir).join(CAPI_LIB).is_file())
        .collect();
    format!(
        "NIXL runtime not loadable: {reason}.\n\
         These tests need the NIXL C API library {CAPI_LIB} (nixl-sys is built with \
         `stub-api` and dlopens it at run time) and the UCX plugin.\n\
         Set LD_LIBRARY_PATH to include the nixl-cu12==1.5.1 wheel's \
         .nixl_cu12.mesonpy.libs folder and NIXL_PLUGIN_DIR to its plugins folder, \
         e.g. `source scripts/nixl-env.sh` (scripts/test.sh installs the wheel and does this).\n\
         LD_LIBRARY_PATH={ld_path:?} (folders holding {CAPI_LIB}: {holders:?})\n\
         NIXL_PLUGIN_DIR={:?}",
        std::env::var("NIXL_PLUGIN_DIR").ok()
    )
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// A heap DRAM buffer handed to NIXL by raw pointer.
///
/// NIXL (its UCX progress thread) writes into it behind Rust's back, so it is
/// held as a raw allocation, not behind a reference, and only read once the
/// transfer has been reported complete.
#[derive(Debug)]
struct DramRegion {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is plain heap memory owned by this struct.
unsafe impl Send for DramRegion {}
// SAFETY: shared access only reads; writes go through `&mut self` or NIXL
// (whose completion is awaited before reading).
unsafe impl Sync for DramRegion {}

impl DramRegion {
    fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        let raw = Box::into_raw(bytes.into_boxed_slice()) as *mut u8;
        Self {
            ptr: NonNull::new(raw).expect("Box pointers are non-null"),
            len,
        }
    }

    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: ptr/len come from a live boxed slice owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for DramRegion {
    fn drop(&mut self) {
        // SAFETY: reconstructs exactly the boxed slice leaked in `from_vec`.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            )));
        }
    }
}

impl MemoryRegion for DramRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DramRegion {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// `len` bytes from a 64-bit LCG (Knuth's MMIX constants), high bits first.
fn lcg_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 56) as u8
        })
        .collect()
}

/// An agent with a UCX backend, plus opt-args naming that backend.
struct UcxAgent {
    agent: Agent,
    backend: Backend,
    opt_args: OptArgs,
}

fn ucx_agent(name: &str) -> UcxAgent {
    let agent = Agent::new_configured(name, &agent_config())
        .unwrap_or_else(|e| panic!("creating NIXL agent {name:?}: {e}"));
    let plugins = agent.get_available_plugins().expect("listing NIXL plugins");
    let names: Vec<String> = plugins
        .iter()
        .filter_map(Result::ok)
        .map(str::to_owned)
        .collect();
    assert!(
        names.iter().any(|p| p == "UCX"),
        "NIXL UCX plugin not found (plugins found: {names:?}); set NIXL_PLUGIN_DIR to the \
         nixl-cu12 wheel's .nixl_cu12.mesonpy.libs/plugins folder (`source scripts/nixl-env.sh`); \
         NIXL_PLUGIN_DIR={:?}",
        std::env::var("NIXL_PLUGIN_DIR").ok()
    );
    let (_mems, params) = agent
        .get_plugin_params("UCX")
        .expect("UCX plugin parameters");
    let backend = agent
        .create_backend("UCX", &params)
        .unwrap_or_else(|e| panic!("creating the UCX backend for {name:?}: {e} (UCX_TLS set? shared-memory transports are refused here)"));
    let mut opt_args = OptArgs::new().expect("opt args");
    opt_args
        .add_backend(&backend)
        .expect("opt args: add backend");
    UcxAgent {
        agent,
        backend,
        opt_args,
    }
}

fn register(agent: &UcxAgent, region: &DramRegion) -> RegistrationHandle {
    agent
        .agent
        .register_memory(region, Some(&agent.opt_args))
        .unwrap_or_else(|e| panic!("registering {} bytes of DRAM: {e}", region.len))
}

fn dram_dlist(addr: usize, len: usize) -> XferDescList<'static> {
    let mut list = XferDescList::new(MemType::Dram).expect("xfer descriptor list");
    list.add_desc(addr, len, 0);
    list
}

/// Polls `poll` until it yields a value, panicking after [`DEADLINE`].
fn wait_for<T>(what: &str, mut poll: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = poll() {
            return value;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        thread::yield_now();
    }
}

fn wait_xfer_done(agent: &Agent, req: &XferRequest) {
    wait_for("the transfer to complete", || {
        match agent.get_xfer_status(req).expect("transfer status") {
            XferStatus::Success => Some(()),
            XferStatus::InProgress => None,
        }
    });
}

/// Waits for the next notifications to arrive at `agent` and returns them,
/// by sender. `map` is drained (`take_notifs` clears it).
fn wait_notifs(agent: &Agent, map: &mut NotificationMap) -> HashMap<String, Vec<String>> {
    wait_for("a notification", || {
        agent
            .get_notifications(map, None)
            .expect("fetching notifications");
        if map.is_empty().expect("notification map size") {
            None
        } else {
            Some(map.take_notifs().expect("reading notifications"))
        }
    })
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

/// Two agents in one process: agent A WRITEs 1 MiB of its DRAM into agent B's
/// DRAM with a notification; every byte and the notification text must land.
#[test]
fn ucx_write_one_mib_with_notification() {
    let _serial = serial();
    require_nixl_runtime();

    let a = ucx_agent("kvh-smoke-a");
    let b = ucx_agent("kvh-smoke-b");

    let pattern = lcg_bytes(0x6b76_6861_6e64_6f66, WRITE_LEN);
    // B starts as the bitwise complement: every byte differs before the write.
    let src = DramRegion::from_vec(pattern.clone());
    let dst = DramRegion::from_vec(pattern.iter().map(|byte| !byte).collect());
    let _src_reg = register(&a, &src);
    let _dst_reg = register(&b, &dst);

    // Exchange metadata both ways (B answers A's pings below).
    let b_name = a
        .agent
        .load_remote_md(&b.agent.get_local_md().expect("B metadata"))
        .expect("A loads B's metadata");
    assert_eq!(b_name, "kvh-smoke-b");
    let a_name = b
        .agent
        .load_remote_md(&a.agent.get_local_md().expect("A metadata"))
        .expect("B loads A's metadata");
    assert_eq!(a_name, "kvh-smoke-a");

    let message = format!("kvhandoff smoke: WRITE {WRITE_LEN} bytes A->B, lcg pattern");
    let mut xfer_args = OptArgs::new().expect("opt args");
    xfer_args
        .add_backend(&a.backend)
        .expect("xfer args: backend");
    xfer_args.set_has_notification(true).expect("has notif");
    xfer_args
        .set_notification_message(message.as_bytes())
        .expect("notif message");

    let local = dram_dlist(src.addr(), WRITE_LEN);
    let remote = dram_dlist(dst.addr(), WRITE_LEN);
    let req = a
        .agent
        .create_xfer_req(XferOp::Write, &local, &remote, &b_name, Some(&xfer_args))
        .expect("create WRITE request");

    // The first WRITE (includes UCX endpoint wire-up to B).
    let mut notifs_at_b = NotificationMap::new().expect("notification map");
    let start = Instant::now();
    let in_progress = a.agent.post_xfer_req(&req, None).expect("post WRITE");
    if in_progress {
        wait_xfer_done(&a.agent, &req);
    }
    let cold_done = start.elapsed();
    let got = wait_notifs(&b.agent, &mut notifs_at_b);
    let cold_notified = start.elapsed();

    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        vec!["kvh-smoke-a"],
        "notifications must come from A only: {got:?}"
    );
    assert_eq!(
        got["kvh-smoke-a"],
        vec![message.clone()],
        "notification text must be exactly what was sent"
    );
    if let Some(offset) = dst.bytes().iter().zip(&pattern).position(|(d, p)| d != p) {
        panic!(
            "byte {offset} of {WRITE_LEN} did not land: got {:#04x}, want {:#04x}",
            dst.bytes()[offset],
            pattern[offset]
        );
    }
    assert_eq!(src.bytes(), &pattern[..], "the source must be unchanged");

    // Warm WRITEs: repost the same request (and drain its notification).
    let mut warm_done = Vec::new();
    let mut warm_notified = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        if a.agent.post_xfer_req(&req, None).expect("repost WRITE") {
            wait_xfer_done(&a.agent, &req);
        }
        warm_done.push(start.elapsed());
        let got = wait_notifs(&b.agent, &mut notifs_at_b);
        warm_notified.push(start.elapsed());
        assert_eq!(got["kvh-smoke-a"], vec![message.clone()]);
    }
    assert_eq!(dst.bytes(), &pattern[..]);

    // Notification round trip: A -> B, then B -> A.
    let mut notifs_at_a = NotificationMap::new().expect("notification map");
    let mut round_trips = Vec::new();
    for i in 0..21 {
        let ping = format!("ping {i}");
        let pong = format!("pong {i}");
        let start = Instant::now();
        a.agent
            .send_notification(&b_name, ping.as_bytes(), None)
            .expect("A notifies B");
        let got = wait_notifs(&b.agent, &mut notifs_at_b);
        assert_eq!(got["kvh-smoke-a"], vec![ping]);
        b.agent
            .send_notification(&a_name, pong.as_bytes(), None)
            .expect("B notifies A");
        let got = wait_notifs(&a.agent, &mut notifs_at_a);
        assert_eq!(got["kvh-smoke-b"], vec![pong]);
        if i > 0 {
            round_trips.push(start.elapsed());
        }
    }

    println!(
        "nixl_smoke timings (pthr_delay_us={}): 1 MiB WRITE cold: done {cold_done:?}, \
         notified {cold_notified:?}; warm (median of 5): done {:?}, notified {:?}; \
         notification round trip A->B->A (20 samples): min {:?}, median {:?}, max {:?}",
        agent_config().pthr_delay_us,
        median(warm_done),
        median(warm_notified),
        round_trips.iter().min().expect("samples"),
        median(round_trips.clone()),
        round_trips.iter().max().expect("samples"),
    );
}

/// Misuse reports typed errors (no abort, no hang), and the agent still works.
#[test]
fn ucx_misuse_returns_typed_errors() {
    let _serial = serial();
    require_nixl_runtime();

    const LEN: usize = 64 * 1024;
    let a = ucx_agent("kvh-errors-a");
    let b = ucx_agent("kvh-errors-b");
    let src = DramRegion::from_vec(lcg_bytes(7, LEN));
    let dst = DramRegion::from_vec(vec![0; LEN]);
    let unregistered = DramRegion::from_vec(vec![0; LEN]);
    let _src_reg = register(&a, &src);
    let _dst_reg = register(&b, &dst);
    let b_name = a
        .agent
        .load_remote_md(&b.agent.get_local_md().expect("B metadata"))
        .expect("A loads B's metadata");

    let local = dram_dlist(src.addr(), LEN);
    let remote = dram_dlist(dst.addr(), LEN);

    // 1. A remote agent whose metadata was never loaded.
    let err = a
        .agent
        .create_xfer_req(XferOp::Write, &local, &remote, "kvh-no-such-agent", None)
        .err()
        .expect("a WRITE to an unknown agent must be refused");
    assert!(
        matches!(err, NixlError::FailedToCreateXferRequest),
        "unknown agent: {err:?}"
    );

    // 2. Local memory that was never registered.
    let err = a
        .agent
        .create_xfer_req(
            XferOp::Write,
            &dram_dlist(unregistered.addr(), LEN),
            &remote,
            &b_name,
            None,
        )
        .err()
        .expect("a WRITE from unregistered memory must be refused");
    assert!(
        matches!(err, NixlError::FailedToCreateXferRequest),
        "unregistered local memory: {err:?}"
    );

    // 3. A remote descriptor running past the end of B's registered region.
    let err = a
        .agent
        .create_xfer_req(
            XferOp::Write,
            &local,
            &dram_dlist(dst.addr() + LEN / 2, LEN),
            &b_name,
            None,
        )
        .err()
        .expect("a WRITE past the remote region must be refused");
    assert!(
        matches!(err, NixlError::FailedToCreateXferRequest),
        "remote descriptor out of bounds: {err:?}"
    );

    // 4. Preparing descriptors for, and notifying, an unknown agent.
    let err = a
        .agent
        .prepare_xfer_dlist("kvh-no-such-agent", &remote, None)
        .err()
        .expect("preparing descriptors of an unknown agent must be refused");
    assert!(
        matches!(err, NixlError::NotFound),
        "prep for unknown agent: {err:?}"
    );
    let err = a
        .agent
        .send_notification("kvh-no-such-agent", b"hello?", None)
        .expect_err("notifying an unknown agent must be refused");
    assert!(
        matches!(err, NixlError::NotFound),
        "notify unknown agent: {err:?}"
    );

    // The agent is still usable after all of that.
    let req = a
        .agent
        .create_xfer_req(XferOp::Write, &local, &remote, &b_name, None)
        .expect("a valid WRITE after the errors");
    if a.agent.post_xfer_req(&req, None).expect("post WRITE") {
        wait_xfer_done(&a.agent, &req);
    }
    assert_eq!(dst.bytes(), src.bytes());
}
