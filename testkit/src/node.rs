//! `kvhandoff node`: one engine role of the demo as its own process, talking to the other role's
//! process over the TCP side channel and NIXL.
//!
//! ```text
//! kvhandoff node --role decode  --listen 127.0.0.1:5601 --peer 127.0.0.1:5600 --requests 200
//! kvhandoff node --role prefill --listen 127.0.0.1:5600 --peer 127.0.0.1:5601 --requests 200
//! ```
//!
//! Each process starts one rank of the demo's geometry (`prefill-0` or `decode-0`, TP 1) the way
//! an engine does: it allocates its KV cache itself ([`engine_memory`](crate::demo::engine_memory): one
//! buffer per region),
//! hands the buffers to a [`kvhandoff::RankBuilder`] as they are (with NIXL, registered in
//! place: the rank's regions are the node's own addresses, which it prints on stderr, see
//! [`NodeMemory`]), with a TCP side channel on `--listen`, and puts the other role's `--peer`
//! address in its link's peer book ([`AddPeerAddress`]). P fills and D checks the blocks
//! through the rank's [`KvCache`](kvhandoff::KvCache), that same memory. Both derive the same seeded
//! schedule from the same options (`--requests`, `--seed`, `--max-prompt-tokens` must match):
//! P fills each request's blocks with the pattern and calls `request_finished`, D allocates,
//! calls `request_allocated` with the parameters a router would give it (`remote_engine_id
//! prefill-0`, `remote_host`/`remote_port` = `--peer`, `tp_size 1`, `do_remote_prefill`) and
//! checks every byte on `BlocksReady`.
//!
//! # Modes and the router link
//! `--mode` (both processes must agree) is the demo's: `push` (the default), `pull`, `mixed` or
//! `bidir`. Every mode but push needs what a router carries besides the protocol: P's answer to
//! `request_finished` (a pulled request's `remote_block_ids`) for D, and, in conversations, D's
//! answer to `keep_for_next_turn` for P's next turn. It travels over the router link
//! (`--router HOST:PORT`, both processes given the same: D listens, P connects; see
//! `testkit/src/node/router.rs`), never over the protocol's side channel. D calls `request_allocated`
//! for a pulled request at its scheduled time or when P's answer came, whichever is later, and
//! reads P's blocks over NIXL; a pulled request whose answer has not come `--decode-deadline-ms`
//! after its time is given up uncalled (`NoAnswer`: P is gone). Conversations (`bidir`) follow P's
//! reports over the link instead of the clock (a later turn's time depends on the turn before):
//! P tells D when each prefill is done, D keeps each turn's blocks for the next, and P reads
//! them back (or declines and recomputes) as in the demo; P gives a conversation's later turns
//! up (`Abandoned`) when D never got a turn, or when D's keep has not come
//! `--decode-deadline-ms` after the turn was handed over.
//!
//! # Finding each other
//! Either process may start first. Everything is bounded by one deadline from the process's
//! start ([`DemoOptions::timeout`], `--timeout-secs`, default 60 s).
//! - D probes P's side channel with plain TCP connects until one is accepted, then asks its
//!   link for the handshake ([`Connect`]) and waits until it completed
//!   ([`SideChannelStats::outgoing_ok`]), so that no request pays for it (and no request's own
//!   handshake can race it). A failed handshake is retried.
//! - P waits until D's handshake arrived ([`SideChannelStats::incoming_ok`] `>= 1`).
//! - With `--psk-file` ([`NodeOptions::psk`]) the handshake is authenticated. One that fails
//!   authentication (the keys differ, or one node has none) is not retried: D gives up at once
//!   and P, when its deadline ends, says how many handshakes failed authentication; both exit 1.
//!
//! The schedule's time zero is the moment P saw the handshake complete; D takes the middle of
//! its handshake for it (each side loads the other's metadata before counting the handshake,
//! which takes about as long on both: tens of milliseconds with NIXL). So the two clocks agree
//! within a few milliseconds; from then on nothing passes between the processes but the
//! protocol. Both follow the schedule's clock: prompt `i` reaches P at `arrival_i`, its prefill
//! is due done at `arrival_i + hold`, P calls `request_finished` `prefill_delay_i` and D calls
//! `request_allocated` `decode_delay_i` after that. So both races happen, in about equal
//! numbers, as long as P's fills keep up with the arrivals (P's report says how late it ran: a
//! late P makes D register first).
//!
//! # Ending
//! D ends when every request is verified (or failed), P when every request had its event
//! (`Sent` or `Released`) — which needs D's registrations. P then stays until D's side channel
//! refuses connections (D has exited, so every notification P sent has been read) or for at most
//! [`NodeOptions::linger`]. Each prints its report and exits 0 only if its own side is OK: D's
//! report is a [`DemoReport`] ([`ReportRole::Decode`](crate::demo::ReportRole::Decode), the demo's keys), P's a
//! [`PrefillReport`] with P's counts, the race counts of its endpoint included.
//!
//! # Kills and restarts
//! A node survives the death of its peer (`kill -9`) and serves the peer's next incarnation:
//! the endpoint declares the peer dead after [`Config::peer_timeout`] of silence (1.5
//! heartbeats with `--heartbeat-ms`), fails what was bound to it with a typed outcome, and takes
//! a new handshake from the same engine as a restart. For tests of that:
//! - `--start-at K` runs requests `K..` of the same seeded plan (a restarted node continues the
//!   plan its predecessor was running; same seed, so the same ids and pairing keys). Its clock
//!   is shifted so that request `K` arrives at its time zero (its handshake).
//! - `--heartbeat-ms H` (peer timeout 1.5 H), `--lease-ms`, `--decode-deadline-ms` set the
//!   protocol's timing ([`NodeTiming`]), kept valid for [`Config::validate`].
//! - Every node reports, besides its role's report, a [`NodeFacts`] section (`"node"` in the
//!   JSON): each request's typed outcome and when it ended (unix ms), the pool's free blocks at
//!   the end, and the peer deaths its endpoint declared (with when the node saw each).
//! - (feature `test-hooks`) `--stop-self-after K` stops the node (SIGSTOP) right after its last call for request `K`
//!   ([`NodeOptions::stop_self_after`]), once what that call sent has left the process: the
//!   read path's kill tests kill it there, in the middle of a read.
//! - (feature `test-hooks`) `--repeat-handshake-ms T` sends the peer this rank's handshake again T ms into the
//!   schedule, as a second dial and as a raw copy ([`NodeOptions::repeat_handshake_after`]).
//! - `--expect-peer-loss` makes the node a survivor: it exits 0 when [`NodeFacts::ok`] holds
//!   (every request has exactly one typed outcome, no byte error in a `Ready` request, every
//!   block back, nothing else went wrong) even if some requests failed; without it a node also
//!   needs its role's strict verdict (every request handed off).
//!
//! P runs until every request of its plan has an outcome, whatever happens to D: requests whose
//! D never registers end by lease expiry (`--lease-ms`). Then it stays until D exits, for at most
//! `--linger-ms`.
//!
//! Without the cargo feature `nixl`, [`run`] returns [`DemoError::NoNixl`] and the CLI prints
//! that message and exits 1. [`run_on`] runs a node on any [`TransportKind`] whose agents can reach
//! each other (the tests run two in-memory nodes on one fabric in one process).

mod drive;
mod facts;
mod node_report;
mod rank;
mod router;
mod wait;

use std::net::SocketAddr;
use std::time::Duration;

use kvhandoff::TransportKind;
use kvhandoff_actors::system::{AddPeerAddress, Connect, SideChannelStats};
use kvhandoff_protocol::machine::Config;
use serde::{Deserialize, Serialize};

use crate::demo::{DemoError, DemoOptions, DemoReport};

pub use drive::run_full_on;
pub use node_report::{
    LinkSummary, NodeFacts, NodeReport, NodeRun, PoolSummary, PrefillReport, RequestEnd,
};
pub use rank::NodeMemory;

/// When each request of the seeded plan of `schedule` arrives, from the schedule's time zero:
/// what every node given these schedule options follows (`kvhandoff cluster --kill` times its
/// kill and picks the restart's `--start-at` on it).
///
/// # Errors
/// [`DemoError::Options`] for options a node would refuse.
pub fn arrivals(schedule: &DemoOptions) -> Result<Vec<Duration>, DemoError> {
    let workload = crate::demo::check_options(schedule)?;
    let plan = crate::demo::schedule(schedule, workload.block_tokens)?;
    Ok(plan.into_iter().map(|q| q.arrival).collect())
}

/// Which engine a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// `prefill-0`: fills and sends.
    Prefill,
    /// `decode-0`: receives and verifies.
    Decode,
}

/// What a node runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOptions {
    /// This process's engine.
    pub role: NodeRole,
    /// Where this rank's side channel listens (port 0 picks one; it is printed on stderr).
    pub listen: SocketAddr,
    /// The other role's side channel.
    pub peer: SocketAddr,
    /// The schedule, pool and deadline, as in the demo ([`DemoOptions::transport`] is not
    /// used). Both processes must be given the same schedule options. `timeout` bounds the
    /// whole process, waiting for the peer included.
    pub schedule: DemoOptions,
    /// The schedule's time from a prompt's arrival to its prefill being done (default 20 ms).
    pub hold: Duration,
    /// How long P stays, after its last event, waiting for D to exit (default 10 s).
    pub linger: Duration,
    /// The first request of the plan this node runs (default 0; see the module docs).
    pub start_at: usize,
    /// The protocol's timing (default: [`Config::default`]).
    pub timing: NodeTiming,
    /// The peer is expected to die during the run: the exit status follows [`NodeFacts::ok`]
    /// alone (default false).
    pub expect_peer_loss: bool,
    /// The router link's address: D listens there, P connects (needed by every mode but push;
    /// both nodes are given the same; see `testkit/src/node/router.rs`).
    pub router: Option<SocketAddr>,
    /// The side channel's pre-shared key (`--psk-file`): the handshake is authenticated with it
    /// and refused without it (default: none). A handshake that fails authentication is not
    /// retried: D gives up at once, P reports it when its wait ends.
    pub psk: Option<kvhandoff::Psk>,
    /// TP ranks of each engine (default 1): both engines run the demo geometry split over this
    /// many ranks, each rank a process of its own, and rank `r` of D pairs with rank `r` of P.
    /// Every node of a run must be given the same.
    pub tp: u32,
    /// This process's rank in its engine, below [`NodeOptions::tp`] (default 0). Rank `r` adds
    /// `r` to the port of `listen`, `peer` and `router` (the engine's rank-0 addresses), as
    /// vLLM's side channel does: one address list serves every rank of an engine.
    pub rank: u32,
    /// TEST HOOK of the kill tests: right after this node's last engine call for request `K`
    /// of the plan (P: `request_finished`; D: `keep_for_next_turn` for a turn it keeps,
    /// `request_allocated` otherwise) the node waits 2 ms and stops itself with SIGSTOP, so
    /// that the test finds it in the middle of that request (and kills it there). Default:
    /// never.
    #[cfg(feature = "test-hooks")]
    pub stop_self_after: Option<usize>,
    /// This long into the schedule, send the peer this rank's handshake again: once through
    /// the link (a second dial) and once as a raw copy from a plain socket (what a late
    /// duplicate or a third party delivers). Both repeat the live incarnation, so the peer must
    /// change nothing ([`NodeFacts::repeated_handshakes`] counts them there). Default: never.
    #[cfg(feature = "test-hooks")]
    pub repeat_handshake_after: Option<Duration>,
}

/// The protocol timing of a node; `None` keeps [`Config::default`]'s value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeTiming {
    /// The heartbeat interval H; the peer timeout becomes 1.5 H (at least 10 ms).
    pub heartbeat: Option<Duration>,
    /// How long P holds finished blocks without a registration or renewal.
    pub lease: Option<Duration>,
    /// How long D waits for P's data after allocating.
    pub decode_deadline: Option<Duration>,
    /// How long P keeps a registration whose prefill has not finished, without renewal. Both
    /// sides must agree: D's fence is sized on P's value.
    pub registration_ttl: Option<Duration>,
    /// The longest a posted write may stay in flight (the fabric's bound; both sides must
    /// agree). P's write deadline and abandon wait shrink to fit inside it.
    pub max_write_life: Option<Duration>,
    /// The longest a control message may travel (both sides must agree).
    pub max_message_delay: Option<Duration>,
}

impl NodeTiming {
    /// The endpoint configuration: [`Config::default`] with these values, and the values that
    /// depend on them moved so that [`Config::validate`] holds: a heartbeat renews a lease by at
    /// most the lease and by more than one heartbeat (`lease_extension`), the quarantine covers
    /// the latest a late write can land, and ended keys are remembered for at least the peer
    /// timeout.
    ///
    /// # Errors
    /// A heartbeat under 10 ms, a lease not above the heartbeat, or any other invalid result.
    pub fn config(&self) -> Result<Config, String> {
        let mut c = Config::default();
        if let Some(h) = self.heartbeat {
            if h < Duration::from_millis(10) {
                return Err(format!("a heartbeat of {h:?} is below 10 ms"));
            }
            c.heartbeat_interval = h;
            c.peer_timeout = h * 3 / 2;
        }
        if let Some(lease) = self.lease {
            c.lease_duration = lease;
        }
        if let Some(deadline) = self.decode_deadline {
            c.decode_deadline = deadline;
        }
        c.lease_extension = c.lease_extension.min(c.lease_duration);
        if c.lease_extension <= c.heartbeat_interval {
            // A renewal must outlast the next heartbeat: renew by the whole lease.
            c.lease_extension = c.lease_duration;
        }
        if c.lease_extension <= c.heartbeat_interval {
            return Err(format!(
                "the lease ({:?}) must exceed the heartbeat interval ({:?})",
                c.lease_duration, c.heartbeat_interval
            ));
        }
        if let Some(ttl) = self.registration_ttl {
            c.registration_ttl = ttl;
        }
        if let Some(delay) = self.max_message_delay {
            c.max_message_delay = delay;
        }
        if let Some(life) = self.max_write_life {
            c.max_write_life = life;
            if c.write_timeout + c.abandon_timeout > life {
                // P gives up on a write, and waits for the abandon, within the write's life.
                c.write_timeout = life * 2 / 3;
                c.abandon_timeout = life - c.write_timeout;
            }
        }
        let latest_write = c.fence_floor();
        let fence_given = self.registration_ttl.is_some()
            || self.max_write_life.is_some()
            || self.max_message_delay.is_some();
        if fence_given || c.quarantine <= latest_write {
            // The fence is sized on the bounds given: one heartbeat above its floor.
            c.quarantine = latest_write + c.heartbeat_interval;
        }
        c.tombstone_ttl = c
            .tombstone_ttl
            .max(c.peer_timeout)
            .max(c.tombstone_min_life());
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

impl NodeOptions {
    /// The defaults for `role` between `listen` and `peer`: the demo's schedule options but
    /// prompts of at most 512 tokens arriving 20 ms apart on average (so that P's fills keep up
    /// on a small machine) and call offsets of up to 30 ms (so that D's registration, which
    /// crosses processes, still often reaches P before P finishes).
    pub fn new(role: NodeRole, listen: SocketAddr, peer: SocketAddr) -> Self {
        NodeOptions {
            role,
            listen,
            peer,
            schedule: DemoOptions {
                max_prompt_tokens: 512,
                mean_arrival_gap: Duration::from_millis(20),
                max_call_skew: Duration::from_millis(30),
                ..DemoOptions::default()
            },
            hold: Duration::from_millis(20),
            linger: Duration::from_secs(10),
            start_at: 0,
            timing: NodeTiming::default(),
            expect_peer_loss: false,
            router: None,
            psk: None,
            tp: 1,
            rank: 0,
            #[cfg(feature = "test-hooks")]
            stop_self_after: None,
            #[cfg(feature = "test-hooks")]
            repeat_handshake_after: None,
        }
    }
}

impl NodeOptions {
    /// These options as rank [`NodeOptions::rank`] runs them: `listen`, `peer` and `router` moved
    /// by the rank (a port 0 stays 0: the system picks one).
    ///
    /// # Errors
    /// A rank not below `tp`, a `tp` the demo geometry's heads do not divide, or a port past
    /// 65535.
    pub fn for_rank(&self) -> Result<NodeOptions, DemoError> {
        let heads = crate::pattern::demo_geometry().total_kv_heads;
        if self.tp == 0 || heads % self.tp != 0 {
            return Err(DemoError::Options(format!(
                "--tp {} does not divide the demo model's {heads} KV heads",
                self.tp
            )));
        }
        if self.rank >= self.tp {
            return Err(DemoError::Options(format!(
                "--rank {} is not below --tp {}",
                self.rank, self.tp
            )));
        }
        let moved = |addr: SocketAddr, what: &str| -> Result<SocketAddr, DemoError> {
            if addr.port() == 0 {
                return Ok(addr);
            }
            let port = u16::try_from(u32::from(addr.port()) + self.rank).map_err(|_| {
                DemoError::Options(format!(
                    "{what} port {} + rank {} is past 65535",
                    addr.port(),
                    self.rank
                ))
            })?;
            Ok(SocketAddr::new(addr.ip(), port))
        };
        Ok(NodeOptions {
            listen: moved(self.listen, "--listen")?,
            peer: moved(self.peer, "--peer")?,
            router: self.router.map(|r| moved(r, "--router")).transpose()?,
            ..self.clone()
        })
    }
}

/// Runs one node on NIXL (cargo feature `nixl`); its role's report only (see [`run_full`]).
///
/// # Errors
/// As [`run_full`].
pub fn run(options: &NodeOptions) -> Result<NodeReport, DemoError> {
    run_full(options).map(|run| run.report)
}

/// Runs one node on NIXL (cargo feature `nixl`): its rank registers the node's own buffers
/// with NIXL in place (see [`run_full_on`]).
///
/// # Errors
/// [`DemoError::NoNixl`] without the feature; [`DemoError::NixlUnavailable`] without the NIXL
/// runtime; otherwise as [`run_full_on`].
pub fn run_full(options: &NodeOptions) -> Result<NodeRun, DemoError> {
    #[cfg(feature = "nixl")]
    {
        use kvhandoff_actors::transport::nixl::nixl_runtime_available;
        nixl_runtime_available().map_err(|e| DemoError::NixlUnavailable(e.to_string()))?;
        run_full_on(options, TransportKind::nixl())
    }
    #[cfg(not(feature = "nixl"))]
    {
        let _ = options;
        Err(DemoError::NoNixl)
    }
}

/// [`run_full_on`], the role's report only.
///
/// # Errors
/// As [`run_full_on`].
pub fn run_on(options: &NodeOptions, kind: TransportKind) -> Result<NodeReport, DemoError> {
    run_full_on(options, kind).map(|run| run.report)
}

#[cfg(test)]
mod tests;
