//! The engine-facing connector: the hooks an engine already calls each step, in our terms.
//!
//! - D side: [`KvConnector::request_allocated`] once blocks are allocated for a request whose
//!   prefill runs remotely (its `kv_transfer_params` came from the router).
//! - P side: [`KvConnector::request_finished`] when a prefill finishes; it returns the
//!   `kv_transfer_params` to hand to the router for the decode leg.
//! - Either side: [`KvConnector::abort`], [`KvConnector::poll_events`] (each step) and
//!   [`KvConnector::has_pending_work`] (keeps the engine loop alive).
//!
//! - A whole step's calls at once: [`KvConnector::submit`] (one round trip to the runtime).
//!
//! Each request moves its KV one of two ways, chosen by the router's `transfer_mode`
//! ([`TransferMode`]): **push** (the default: D registers its blocks, P writes into them; D
//! gets [`ConnectorEvent::BlocksReady`], P [`ConnectorEvent::BlocksFree`]) or **pull** (P
//! exports its blocks and D reads them; D gets [`ConnectorEvent::Imported`], P
//! [`ConnectorEvent::ExportEnded`]). A push request on D whose P dies after D exposed its
//! blocks fails at once with [`ConnectorEvent::DecodeFenced`] (recompute it elsewhere; the
//! blocks stay held) and hands the blocks back later with [`ConnectorEvent::Failed`], when the
//! fence passes or the old P proves it wrote nothing more. Bidirectional conversations add the reverse direction
//! between turns: D keeps a finished turn's blocks with [`KvConnector::keep_for_next_turn`],
//! and P's next turn reads them with [`KvConnector::next_turn_allocated`]. A reader that will
//! not read (it recomputes instead) lets the holder go with [`KvConnector::decline_export`].
//!
//! Between engines of different geometries (TP, block size, layout; see
//! `kvhandoff_protocol::hetero`), [`KvConnector::set_links`] gives the rank its [`RankLinks`]:
//! each push request then runs as one sub-request per (P rank → D rank) pair this rank takes
//! part in, and the engine still sees exactly one final event per request, and at most one
//! `DecodeFenced` before it (see `connector/fan.rs`).
//!
//! Calls are synchronous, for an engine's scheduler thread; each waits for its verdict for at
//! most [`KvConnector::CALL_TIMEOUT`]. Never call them from inside the runtime's own thread.
//!
//! The connector is a thin handle: what a call means — its parameters into the endpoint's
//! input, the sub-requests of a multi-rank request and their events folded into one — is the
//! rank's [`Session`](kvhandoff_protocol::session::Session), which the rank's actor hosts and
//! the simulator steps. Here: the hooks, one call each; `submit` the round trip to the rank (and
//! the verdicts that came late).

mod submit;

use std::time::Duration;

use kvhandoff_actors::system::{blocking, ConfigureSession, RankHandle, SetLinks, SetTurnLinks};
use kvhandoff_protocol::{BlockIds, RequestId};

#[cfg(doc)]
use crate::TransferMode;
use crate::{
    ConnectorCall, ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorReply,
    ConnectorSettings, KvTransferParams, RankLinks,
};
use submit::LateBatch;

/// How often [`KvConnector::wait_events`] checks a late verdict, which does not wake it.
const LATE_RECHECK: Duration = Duration::from_micros(200);

/// Wakes the thread that waits in [`KvConnector::wait_events`].
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.0.unpark();
    }
}

/// One engine rank's connector.
pub struct KvConnector {
    identity: ConnectorIdentity,
    rank: RankHandle,
    /// Requests accepted whose event has not been polled yet. Signed: an event of a call
    /// whose verdict came late may be polled before the verdict.
    live: i64,
    /// Batches the runtime took without answering in time; their verdicts settle `live` (and
    /// refusals become [`ConnectorEvent::Refused`]) when they come.
    late: Vec<LateBatch>,
    /// How long a call waits for its verdict ([`Self::CALL_TIMEOUT`] unless a test shortens it).
    call_timeout: Duration,
    /// The settings the rank's session was given.
    settings: ConnectorSettings,
    /// The links the rank's session was given.
    links: Option<RankLinks>,
    /// The rank's event channel closed: the rank is gone (see [`KvConnector::rank_stopped`]).
    stopped: bool,
}

impl KvConnector {
    /// How long a call waits for the runtime's verdict.
    pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

    /// A connector over a started rank, with the default [`ConnectorSettings`] (enough for
    /// push; reading needs [`ConnectorSettings::block_tokens`]: see [`Self::with_settings`]).
    pub fn new(identity: ConnectorIdentity, rank: RankHandle) -> Self {
        Self::with_settings(identity, rank, ConnectorSettings::default())
    }

    /// A connector over a started rank, with `settings` (build them with
    /// [`ConnectorSettings::new`] from the rank's config and geometry).
    pub fn with_settings(
        identity: ConnectorIdentity,
        rank: RankHandle,
        settings: ConnectorSettings,
    ) -> Self {
        // Start the clock of `remote_blocks_expiry_time` no later than the first connector.
        let _ = Self::clock_secs();
        // Ahead of every call in the rank's mailbox.
        rank.rank.do_send(ConfigureSession {
            identity: identity.clone(),
            settings,
            fan_limit: None,
        });
        KvConnector {
            identity,
            rank,
            live: 0,
            late: Vec::new(),
            call_timeout: Self::CALL_TIMEOUT,
            settings,
            links: None,
            stopped: false,
        }
    }

    /// Makes this rank split every push request into one sub-request per pair of ranks in
    /// `links` (see [`RankLinks`]). Set it before the first request.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidParam`] for links that are not distinct ranks of the other
    /// engine ([`RankLinks::validate`]) or that name another rank than this connector's;
    /// [`ConnectorError::Unavailable`] if the rank does not answer.
    pub fn set_links(&mut self, links: RankLinks) -> Result<(), ConnectorError> {
        links.validate()?;
        if links.rank != self.identity.rank {
            return Err(ConnectorError::InvalidParam {
                name: "links",
                why: format!(
                    "links of rank {}, for the connector of rank {}",
                    links.rank, self.identity.rank
                ),
            });
        }
        blocking::ask(&self.rank.rank, SetLinks(links.clone()), self.call_timeout)
            .ok_or(ConnectorError::Unavailable)??;
        self.links = Some(links);
        Ok(())
    }

    /// Gives the rank its links for a conversation's later turns: the pair planned the other
    /// way, D's engine the holder of the kept blocks (see
    /// [`Session::set_turn_links`](kvhandoff_protocol::session::Session::set_turn_links)).
    /// [`RankBuilder::pairing`](crate::RankBuilder::pairing) sets them when the pair plans
    /// both ways.
    ///
    /// # Errors
    /// As [`KvConnector::set_links`].
    pub fn set_turn_links(&mut self, links: RankLinks) -> Result<(), ConnectorError> {
        links.validate()?;
        if links.rank != self.identity.rank {
            return Err(ConnectorError::InvalidParam {
                name: "turn links",
                why: format!(
                    "links of rank {}, for the connector of rank {}",
                    links.rank, self.identity.rank
                ),
            });
        }
        blocking::ask(&self.rank.rank, SetTurnLinks(links), self.call_timeout)
            .ok_or(ConnectorError::Unavailable)?
    }

    /// The links set with [`KvConnector::set_links`].
    pub fn links(&self) -> Option<&RankLinks> {
        self.links.as_ref()
    }

    /// Lowers the bound on multi-rank requests in progress, for tests of the bound.
    #[doc(hidden)]
    pub fn set_fan_limit(&mut self, limit: usize) {
        self.rank.rank.do_send(ConfigureSession {
            identity: self.identity.clone(),
            settings: self.settings,
            fan_limit: Some(limit),
        });
    }

    /// The connector's settings.
    pub fn settings(&self) -> &ConnectorSettings {
        &self.settings
    }

    /// The clock of the `remote_blocks_expiry_time` this process's connectors advertise:
    /// seconds on the process's one monotonic clock
    /// ([`process_clock`](kvhandoff_actors::system::process_clock)), from an arbitrary origin
    /// like the `perf_counter` clock vLLM uses. The ranks' machine time and the side channel's
    /// handshake clock samples read the same clock, so a reader converts a holder's expiry into
    /// its own time with the clock offset its handshake measured.
    pub fn clock_secs() -> f64 {
        kvhandoff_actors::system::process_clock().as_secs_f64()
    }

    /// The rank this connector drives: its blocking queries (`counters`, `stats`,
    /// `side_channel_stats`) for an engine's metrics.
    pub fn rank(&self) -> &RankHandle {
        &self.rank
    }

    /// Shortens (or lengthens) the wait for a call's verdict; for tests of late verdicts.
    #[doc(hidden)]
    pub fn set_call_timeout(&mut self, timeout: Duration) {
        self.call_timeout = timeout;
    }

    /// The rank this connector serves.
    pub fn identity(&self) -> &ConnectorIdentity {
        &self.identity
    }

    /// D side: `blocks` were allocated for `request`, whose prefill ran on the engine named in
    /// `params`; `num_tokens` tokens are expected. With all-empty `blocks` (a full prefix hit)
    /// the request is ready at once and P is told to free its copy.
    ///
    /// The mode is the parameters' `transfer_mode` (P's answer carries the one P used):
    /// - push (absent or `"push"`): D registers `blocks` with P, which writes into them; the
    ///   request ends with [`ConnectorEvent::BlocksReady`] or [`ConnectorEvent::Failed`].
    /// - pull (`"pull"`): D reads P's export (`remote_block_ids`, required; each local group
    ///   may be shorter than P's, after a partial prefix hit: the tail is read) into `blocks`,
    ///   under the connector's [`ConnectorSettings::load_failure_policy`]; the request ends
    ///   with [`ConnectorEvent::Imported`]. Needs [`ConnectorSettings::block_tokens`]. `tp_size`
    ///   defaults to 1, as in vLLM's pull connector. `remote_blocks_expiry_time` is not used:
    ///   it is in P's clock, whose offset from ours the connector does not know; P's export
    ///   refuses a read that could outlive it instead.
    ///
    /// # Errors
    /// [`ConnectorError`] for missing or invalid parameters, an unsupported TP ratio, a
    /// missing setting, or a refusal by the endpoint (duplicate request, full table).
    pub fn request_allocated(
        &mut self,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        self.call_one(ConnectorCall::RequestAllocated {
            request: request.clone(),
            blocks,
            num_tokens,
            params: params.clone(),
        })
        .map(|_| ())
    }

    /// P side: `request`'s prefill finished with its KV in `blocks`, `num_tokens` tokens.
    /// `params` are the ones the router sent with the prefill leg (for `transfer_id` and
    /// `transfer_mode`). Returns the parameters for the router to send with the decode leg.
    ///
    /// - push (`transfer_mode` absent or `"push"`): P holds the blocks under its lease until D
    ///   registers, then writes them; [`ConnectorEvent::BlocksFree`] hands them back.
    /// - pull (`"pull"`): P exports the blocks for D to read, for the connector's
    ///   [`ConnectorSettings::lease_duration`] (renewed by D's heartbeats up to twice that);
    ///   [`ConnectorEvent::ExportEnded`] hands them back. The answer adds `remote_block_ids`
    ///   (these blocks), `remote_num_tokens` and `remote_blocks_expiry_time`: the export's
    ///   hard end (twice the lease plus [`ConnectorSettings::read_span`] after this call) in
    ///   [`KvConnector::clock_secs`] — a lower bound, since the rank starts the export a
    ///   moment after the call.
    ///
    /// # Errors
    /// [`ConnectorError`] for an invalid `transfer_id` or `transfer_mode`, or a refusal by the
    /// endpoint.
    pub fn request_finished(
        &mut self,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<KvTransferParams, ConnectorError> {
        self.call_one(ConnectorCall::RequestFinished {
            request: request.clone(),
            blocks,
            num_tokens,
            params: params.clone(),
        })
        .and_then(decode_params)
    }

    /// P side, layer-wise push: `request`'s prefill starts into `blocks` (`num_tokens` prompt
    /// tokens); report its layers with [`KvConnector::layers_ready`] as the forward pass
    /// produces them. In place of [`KvConnector::request_finished`] (which must not follow),
    /// and answered as it is. Once D registered, each part of
    /// [`ConnectorSettings::layerwise_parts`] goes out as soon as its layers are ready; below
    /// [`ConnectorSettings::layerwise_min_tokens`] the whole request goes as one part, with the
    /// last layer. [`ConnectorEvent::BlocksFree`] hands the blocks back, possibly before the
    /// last layer when D gave up: later reports of the request are then taken and do nothing.
    ///
    /// ```no_run
    /// # fn f(connector: &mut kvhandoff::KvConnector, request: kvhandoff::RequestId,
    /// #      blocks: kvhandoff::BlockIds, params: kvhandoff::KvTransferParams, layers: u32)
    /// # -> Result<(), kvhandoff::ConnectorError> {
    /// let answer = connector.prefill_started(&request, blocks, 4_096, &params)?;
    /// for layer in 0..layers {
    ///     // ... the forward pass writes layer `layer`'s KV into the blocks ...
    ///     connector.layers_ready(&request, layer + 1)?;
    /// }
    /// # let _ = answer; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`KvConnector::request_finished`]; [`ConnectorError::NotConfigured`] when the rank's
    /// geometry (its layers) is unknown; [`ConnectorError::InvalidParam`] for `"pull"`.
    pub fn prefill_started(
        &mut self,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<KvTransferParams, ConnectorError> {
        self.call_one(ConnectorCall::PrefillStarted {
            request: request.clone(),
            blocks,
            num_tokens,
            params: params.clone(),
        })
        .and_then(decode_params)
    }

    /// P side, layer-wise push: layers `0 .. ready` of `request`'s blocks hold their KV (this
    /// rank's layer indices; `ready` equal to the rank's layers ends the prefill). A request
    /// that already ended (D gave up) takes it and does nothing. Several requests' reports of
    /// one step go in one round trip with [`KvConnector::submit`].
    ///
    /// # Errors
    /// [`ConnectorError::Rejected`] for a request this rank never started layer-wise.
    pub fn layers_ready(&mut self, request: &RequestId, ready: u32) -> Result<(), ConnectorError> {
        self.call_one(ConnectorCall::LayersReady {
            request: request.clone(),
            ready,
        })
        .map(|_| ())
    }

    /// D side, bidirectional: `request`'s turn is over and its blocks (`num_tokens` tokens of
    /// the conversation) are kept for the next turn's prefill to read, for `ttl` (renewed by
    /// the reader's heartbeats up to twice that). `params` are the ones the turn came with
    /// (for `transfer_id`). Returns the parameters for the router to send with the next turn's
    /// prefill leg, for P's [`KvConnector::next_turn_allocated`]: `transfer_mode` `"pull"`,
    /// `do_remote_decode`, this rank as `remote_engine_id` (with its side channel),
    /// `remote_block_ids`, `remote_num_tokens`, `remote_blocks_expiry_time` (the export's
    /// hard end, as in [`KvConnector::request_finished`]) and the pairing key as
    /// `transfer_id`. [`ConnectorEvent::ExportEnded`] hands the blocks back.
    ///
    /// # Errors
    /// [`ConnectorError`] for an invalid `transfer_id`, or a refusal by the endpoint (a zero
    /// `ttl`, a duplicate request or key, a full table).
    pub fn keep_for_next_turn(
        &mut self,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        ttl: Duration,
        params: &KvTransferParams,
    ) -> Result<KvTransferParams, ConnectorError> {
        match self.call_one(ConnectorCall::KeepForNextTurn {
            request: request.clone(),
            blocks,
            num_tokens,
            ttl,
            params: params.clone(),
        })? {
            ConnectorReply::NextTurnParams(params) => Ok(params),
            ConnectorReply::Accepted | ConnectorReply::DecodeParams(_) => {
                Err(ConnectorError::Unavailable)
            }
        }
    }

    /// P side, bidirectional: `blocks` were allocated for a later turn's `request` to read the
    /// previous turns' KV (`num_tokens` tokens) from the D that kept it; `params` are the ones
    /// D returned from [`KvConnector::keep_for_next_turn`]. Reads as D does in pull mode (see
    /// [`KvConnector::request_allocated`]), from the D named in `params`; all-empty `blocks` (a
    /// full prefix hit) read nothing and let D go at once. Ends with
    /// [`ConnectorEvent::Imported`].
    ///
    /// # Errors
    /// [`ConnectorError`] for missing or invalid parameters (a `transfer_mode` of `"push"`
    /// included), a missing setting, or a refusal by the endpoint.
    pub fn next_turn_allocated(
        &mut self,
        request: &RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        self.call_one(ConnectorCall::NextTurnAllocated {
            request: request.clone(),
            blocks,
            num_tokens,
            params: params.clone(),
        })
        .map(|_| ())
    }

    /// Reader side (D in pull mode, P on a later turn): `request` will not read the export
    /// `params` describe (it recomputes instead); the holder lets its blocks go at once. No
    /// event follows: nothing was started here.
    ///
    /// # Errors
    /// [`ConnectorError`] for missing or invalid parameters, or a refusal by the endpoint.
    pub fn decline_export(
        &mut self,
        request: &RequestId,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        self.call_one(ConnectorCall::DeclineExport {
            request: request.clone(),
            params: params.clone(),
        })
        .map(|_| ())
    }

    /// Either side: the engine aborted `request`. Its blocks come back through
    /// [`KvConnector::poll_events`] once it is safe to reuse them.
    ///
    /// # Errors
    /// [`ConnectorError::Rejected`] if no such request is in progress.
    pub fn abort(&mut self, request: &RequestId) -> Result<(), ConnectorError> {
        self.call_one(ConnectorCall::Abort {
            request: request.clone(),
        })
        .map(|_| ())
    }

    /// Either side: the engine is shutting down. Every request in progress gives up — D's
    /// registered ones cancel and still come back through [`KvConnector::poll_events`] only
    /// once their blocks are safe — and new requests are refused. Keep polling until
    /// [`KvConnector::has_pending_work`] is false.
    ///
    /// # Errors
    /// [`ConnectorError::Unavailable`] if the runtime does not answer.
    pub fn shutdown(&mut self) -> Result<(), ConnectorError> {
        self.call_one(ConnectorCall::Shutdown).map(|_| ())
    }
}

/// What the engine polls: each request's one final event (after, for a D request fenced by its
/// P's death, its one early `DecodeFenced`), and whether work is still pending.
impl KvConnector {
    /// Everything that happened since the last call: exactly one final event per request
    /// ([`ConnectorEvent::hands_back`]), and before it, for a D request whose P died, at most
    /// one [`ConnectorEvent::DecodeFenced`].
    pub fn poll_events(&mut self) -> Vec<ConnectorEvent> {
        let mut events = Vec::new();
        if !self.late.is_empty() {
            self.settle_late(&mut events);
        }
        loop {
            match self.rank.events.try_recv() {
                Ok(event) => self.take_event(event, &mut events),
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    self.rank_gone();
                    break;
                }
            }
        }
        events
    }

    fn take_event(&mut self, event: ConnectorEvent, events: &mut Vec<ConnectorEvent>) {
        if event.hands_back() {
            self.live -= 1;
        }
        events.push(event);
    }

    fn rank_gone(&mut self) {
        if !self.stopped {
            tracing::error!(
                in_progress = self.live,
                "the rank stopped: no event will come for the requests in progress"
            );
        }
        self.stopped = true;
    }

    /// Waits up to `timeout` for at least one event, then returns all that are queued.
    ///
    /// The wait is woken by the event itself (the rank's channel wakes this thread), not by a
    /// poll timer, so the event reaches the engine as soon as the rank sends it; the thread
    /// uses no CPU meanwhile. A late verdict (a call that outlived
    /// [`KvConnector::CALL_TIMEOUT`]) does not wake it, so while one is outstanding the wait
    /// also checks every 200 µs.
    pub fn wait_events(&mut self, timeout: Duration) -> Vec<ConnectorEvent> {
        let deadline = std::time::Instant::now() + timeout;
        let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
        let mut cx = std::task::Context::from_waker(&waker);
        loop {
            let mut events = self.poll_events();
            let now = std::time::Instant::now();
            if !events.is_empty() || now >= deadline || self.stopped {
                return events;
            }
            // Registers the waker for the next event (or takes one that raced the poll above).
            match self.rank.events.poll_recv(&mut cx) {
                std::task::Poll::Ready(Some(event)) => {
                    self.take_event(event, &mut events);
                    events.extend(self.poll_events());
                    return events;
                }
                std::task::Poll::Ready(None) => {
                    self.rank_gone();
                    return events;
                }
                std::task::Poll::Pending => {}
            }
            let mut wait = deadline.saturating_duration_since(now);
            if !self.late.is_empty() {
                wait = wait.min(LATE_RECHECK);
            }
            // Returns on the event's wake-up, at the deadline, or spuriously (the loop checks).
            std::thread::park_timeout(wait);
        }
    }

    /// True while a request accepted by this connector has not had its event yet, or a call's
    /// verdict is still late — and the rank is running: once it stopped
    /// ([`KvConnector::rank_stopped`]), nothing more can come, so there is no work to wait for.
    pub fn has_pending_work(&self) -> bool {
        !self.stopped && (self.live > 0 || !self.late.is_empty())
    }

    /// True once [`KvConnector::poll_events`] found the rank gone (it panicked, or the runtime
    /// shut down). The requests in progress then never get their event and their fate is
    /// unknown: a peer may still write into (D) or read from (P) their blocks, so the engine
    /// must keep those blocks out of use for the life of the process, and start a new rank
    /// (a new incarnation, which peers fence from the old one) to serve again.
    pub fn rank_stopped(&self) -> bool {
        self.stopped
    }
}

/// The decode leg's parameters a P-side start call answers with.
fn decode_params(reply: ConnectorReply) -> Result<KvTransferParams, ConnectorError> {
    match reply {
        ConnectorReply::DecodeParams(params) => Ok(params),
        ConnectorReply::Accepted | ConnectorReply::NextTurnParams(_) => {
            Err(ConnectorError::Unavailable)
        }
    }
}
