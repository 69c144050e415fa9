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
//! [`ConnectorEvent::ExportEnded`]). Bidirectional conversations add the reverse direction
//! between turns: D keeps a finished turn's blocks with [`KvConnector::keep_for_next_turn`],
//! and P's next turn reads them with [`KvConnector::next_turn_allocated`]. A reader that will
//! not read (it recomputes instead) lets the holder go with [`KvConnector::decline_export`].
//!
//! Calls are synchronous, for an engine's scheduler thread; each waits for its verdict for at
//! most [`KvConnector::CALL_TIMEOUT`]. Never call them from inside the runtime's own thread.

mod reads;

use std::net::ToSocketAddrs;
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{AddPeerAddress, Calls, RankHandle};
use kvhandoff_protocol::machine::{
    DecodeOutcome, DecodeStart, EngineCall, EngineEvent, PrefillOutcome, PrefillStart, Rejected,
};
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{BlockIds, EngineId, RequestId};

use crate::params::{epoch, mode_name, pairing_key};
use crate::{
    ConnectorCall, ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorReply,
    ConnectorSettings, KvTransferParams, TransferMode,
};

/// Why a batch has no verdict.
enum Late {
    /// It never reached the runtime (or the runtime dropped it): nothing changed.
    NotSent,
    /// The runtime took it; its verdict will come on this channel.
    NoVerdict(mpsc::Receiver<Verdicts>),
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
    /// The read path's settings.
    settings: ConnectorSettings,
}

/// Most batches waiting for a late verdict; past it the runtime is taken as hung and calls are
/// refused (`Unavailable`) without being sent.
const MAX_LATE_BATCHES: usize = 1024;

type Verdicts = Vec<Result<(), Rejected>>;

/// A call checked by the connector: the endpoint's input, the side-channel address that
/// travels with it, and the reply it earns if accepted.
type Prepared = (EngineCall, Option<AddPeerAddress>, ConnectorReply);

/// A batch the runtime took without answering in time.
struct LateBatch {
    verdicts: mpsc::Receiver<Verdicts>,
    /// Per input: its request (if any) and whether an acceptance starts a request.
    inputs: Vec<(Option<RequestId>, bool)>,
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
        KvConnector {
            identity,
            rank,
            live: 0,
            late: Vec::new(),
            call_timeout: Self::CALL_TIMEOUT,
            settings,
        }
    }

    /// The connector's settings.
    pub fn settings(&self) -> &ConnectorSettings {
        &self.settings
    }

    /// The clock of the `remote_blocks_expiry_time` this process's connectors advertise:
    /// seconds on the process's monotonic clock ([`Instant`]) since its first connector was
    /// made, or this was first called if that was earlier (an arbitrary origin, like the
    /// `perf_counter` clock vLLM uses). Only comparable within this process.
    pub fn clock_secs() -> f64 {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed().as_secs_f64()
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

    /// Runs a batch of engine hook calls (one scheduler step's worth) with one round trip to
    /// the runtime: each call is checked as its single-call form checks it, the valid ones go to
    /// the rank together and are handled in order, and one result per call comes back, in
    /// order. A call refused here or by the endpoint changes nothing; the others still run.
    ///
    /// ```no_run
    /// # fn step(conn: &mut kvhandoff::KvConnector, calls: Vec<kvhandoff::ConnectorCall>) {
    /// for result in conn.submit(calls) {
    ///     match result {
    ///         Ok(kvhandoff::ConnectorReply::DecodeParams(params)) => { /* to the router */ }
    ///         Ok(kvhandoff::ConnectorReply::NextTurnParams(params)) => { /* to the router */ }
    ///         Ok(kvhandoff::ConnectorReply::Accepted) => {}
    ///         Err(error) => eprintln!("{error}"),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn submit(
        &mut self,
        calls: Vec<ConnectorCall>,
    ) -> Vec<Result<ConnectorReply, ConnectorError>> {
        let mut results = Vec::with_capacity(calls.len());
        let mut inputs = Vec::with_capacity(calls.len());
        let mut addresses = Vec::new();
        // Per input: its result's index, its request, and whether it starts a request.
        let mut slots = Vec::with_capacity(calls.len());
        for call in calls {
            let starts = call.starts_request();
            let request = call.request().cloned();
            match self.prepare(call) {
                Ok((input, address, reply)) => {
                    slots.push((results.len(), request, starts));
                    inputs.push(input);
                    addresses.extend(address);
                    results.push(Ok(reply));
                }
                Err(error) => results.push(Err(error)),
            }
        }
        if inputs.is_empty() {
            return results;
        }
        match self.call_batch(inputs, addresses) {
            Ok(verdicts) => {
                let mut verdicts = verdicts.into_iter();
                for (slot, _, starts) in slots {
                    match verdicts.next() {
                        Some(Ok(())) => self.live += i64::from(starts),
                        Some(Err(rejected)) => results[slot] = Err(ConnectorError::from(rejected)),
                        None => results[slot] = Err(ConnectorError::Unavailable),
                    }
                }
            }
            Err(Late::NotSent) => {
                for (slot, _, _) in slots {
                    results[slot] = Err(ConnectorError::Unavailable);
                }
            }
            Err(Late::NoVerdict(verdicts)) => {
                let mut inputs = Vec::with_capacity(slots.len());
                for (slot, request, starts) in slots {
                    results[slot] = Err(ConnectorError::VerdictLate);
                    inputs.push((request, starts));
                }
                self.late.push(LateBatch { verdicts, inputs });
            }
        }
        results
    }

    /// Sends `inputs` to the rank as one message and waits for their verdicts, up to
    /// [`Self::CALL_TIMEOUT`]; past it the batch may still be applied ([`Late::NoVerdict`]).
    fn call_batch(
        &mut self,
        inputs: Vec<EngineCall>,
        addresses: Vec<AddPeerAddress>,
    ) -> Result<Verdicts, Late> {
        if self.late.len() >= MAX_LATE_BATCHES {
            return Err(Late::NotSent);
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let calls = Calls {
            calls: inputs,
            addresses,
            reply: Some(Box::new(move |verdicts| {
                let _ = tx.send(verdicts);
            })),
        };
        self.rank.batches.try_send(calls).or_else(|err| match err {
            actix::prelude::SendError::Full(calls) => {
                self.rank.batches.do_send(calls);
                Ok(())
            }
            actix::prelude::SendError::Closed(_) => Err(Late::NotSent),
        })?;
        match rx.recv_timeout(self.call_timeout) {
            Ok(verdicts) => Ok(verdicts),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Late::NoVerdict(rx)),
            // The runtime dropped the batch unanswered: it is gone.
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Late::NotSent),
        }
    }

    /// Settles the late batches whose verdicts have come: acceptances count as live requests,
    /// refusals become [`ConnectorEvent::Refused`].
    fn settle_late(&mut self, events: &mut Vec<ConnectorEvent>) {
        let mut still_late = Vec::new();
        for batch in std::mem::take(&mut self.late) {
            match batch.verdicts.try_recv() {
                Ok(verdicts) => {
                    for ((request, starts), verdict) in batch.inputs.into_iter().zip(verdicts) {
                        match verdict {
                            Ok(()) => self.live += i64::from(starts),
                            Err(rejected) => {
                                if let Some(request) = request {
                                    events.push(ConnectorEvent::Refused {
                                        request,
                                        error: ConnectorError::from(rejected),
                                    });
                                }
                            }
                        }
                    }
                }
                Err(mpsc::TryRecvError::Empty) => still_late.push(batch),
                // The runtime is gone without a verdict: nothing more will come for them.
                Err(mpsc::TryRecvError::Disconnected) => {}
            }
        }
        self.late = still_late;
    }

    /// One call, through [`KvConnector::submit`].
    fn call_one(&mut self, call: ConnectorCall) -> Result<ConnectorReply, ConnectorError> {
        self.submit(vec![call])
            .pop()
            .unwrap_or(Err(ConnectorError::Unavailable))
    }

    /// Checks one call and turns it into the endpoint's input, the side-channel address that
    /// travels with it (if any), and the reply it earns if accepted.
    fn prepare(&mut self, call: ConnectorCall) -> Result<Prepared, ConnectorError> {
        match call {
            ConnectorCall::RequestAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                let (input, address) = if params.transfer_mode()? == TransferMode::Pull {
                    self.check_remote_prefill(&params)?;
                    self.import_input(request, blocks, num_tokens, &params)?
                } else {
                    self.decode_input(request, blocks, num_tokens, &params)?
                };
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::RequestFinished {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                let key = pairing_key(&request, &params)?;
                let pull = params.transfer_mode()? == TransferMode::Pull;
                let mut reply = KvTransferParams {
                    do_remote_prefill: true,
                    do_remote_decode: false,
                    remote_engine_id: Some(self.identity.engine.to_string()),
                    remote_host: Some(self.identity.host.clone()),
                    remote_port: Some(self.identity.port),
                    remote_request_id: Some(request.to_string()),
                    tp_size: Some(self.identity.tp_size),
                    transfer_id: params.transfer_id,
                    epoch: params.epoch,
                    transfer_mode: Some(mode_name(TransferMode::Push).into()),
                    remote_num_tokens: Some(num_tokens),
                    ..KvTransferParams::default()
                };
                let input = if pull {
                    let lease = self.settings.lease_duration;
                    self.export_input(request, key, blocks, num_tokens, lease, &mut reply)?
                } else {
                    EngineCall::PrefillFinished(PrefillStart {
                        request,
                        key,
                        blocks,
                    })
                };
                Ok((input, None, ConnectorReply::DecodeParams(reply)))
            }
            ConnectorCall::KeepForNextTurn {
                request,
                blocks,
                num_tokens,
                ttl,
                params,
            } => {
                let (input, reply) = self.keep_input(request, blocks, num_tokens, ttl, &params)?;
                Ok((input, None, ConnectorReply::NextTurnParams(reply)))
            }
            ConnectorCall::NextTurnAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => {
                if params.transfer_mode()? == TransferMode::Push {
                    return Err(ConnectorError::InvalidParam {
                        name: "transfer_mode",
                        why: "a later turn reads the previous turns' KV: \"pull\" or absent".into(),
                    });
                }
                let (input, address) = self.import_input(request, blocks, num_tokens, &params)?;
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::DeclineExport { request, params } => {
                let (input, address) = self.decline_input(&request, &params)?;
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::Abort { request } => Ok((
                EngineCall::Abort { request },
                None,
                ConnectorReply::Accepted,
            )),
            ConnectorCall::Shutdown => Ok((EngineCall::Shutdown, None, ConnectorReply::Accepted)),
        }
    }

    fn decode_input(
        &mut self,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<(EngineCall, Option<AddPeerAddress>), ConnectorError> {
        self.check_remote_prefill(params)?;
        let (prefill, address) = self.remote_peer(params, params.tp_size)?;
        let key = pairing_key(&request, params)?;
        let epoch = epoch(params)?;
        let call = EngineCall::DecodeAllocated(DecodeStart {
            request,
            key,
            epoch,
            prefill,
            blocks,
            num_tokens,
            expected_writes: 1,
        });
        Ok((call, address))
    }

    /// D's hook is only for a request whose prefill ran remotely.
    fn check_remote_prefill(&self, params: &KvTransferParams) -> Result<(), ConnectorError> {
        if params.do_remote_prefill {
            return Ok(());
        }
        Err(ConnectorError::InvalidParam {
            name: "do_remote_prefill",
            why: "must be true for a request whose prefill ran remotely".into(),
        })
    }

    /// The rank of the other engine `params` name (`remote_engine_id`; this rank's index, as
    /// TP sizes must be equal), and its side-channel address if this rank needs one.
    /// `remote_tp`: the other engine's TP size (`tp_size`), required.
    fn remote_peer(
        &self,
        params: &KvTransferParams,
        remote_tp: Option<u32>,
    ) -> Result<(PeerAddr, Option<AddPeerAddress>), ConnectorError> {
        let engine = params
            .remote_engine_id
            .as_deref()
            .ok_or(ConnectorError::MissingParam("remote_engine_id"))?;
        let engine =
            EngineId::new(engine).map_err(|e| ConnectorError::invalid("remote_engine_id", e))?;
        let remote_tp = remote_tp.ok_or(ConnectorError::MissingParam("tp_size"))?;
        if remote_tp != self.identity.tp_size {
            return Err(ConnectorError::Unsupported(
                "P and D with different TP sizes (heterogeneous TP comes later)",
            ));
        }
        let address = self.peer_address(&engine, params)?;
        Ok((PeerAddr::new(engine, self.identity.rank), address))
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

    /// Where `engine`'s side channel listens, from `remote_host` and `remote_port`, for a TCP
    /// rank (it travels to the rank with the call); `None` for an in-process rank, which finds
    /// its peers by itself.
    fn peer_address(
        &self,
        engine: &EngineId,
        params: &KvTransferParams,
    ) -> Result<Option<AddPeerAddress>, ConnectorError> {
        if self.rank.side_channel.is_none() {
            return Ok(None);
        }
        let host = params
            .remote_host
            .as_deref()
            .ok_or(ConnectorError::MissingParam("remote_host"))?;
        let port = params
            .remote_port
            .ok_or(ConnectorError::MissingParam("remote_port"))?;
        let bad_host = |why: String| ConnectorError::InvalidParam {
            name: "remote_host",
            why,
        };
        let addr = (host, port)
            .to_socket_addrs()
            .map_err(|e| bad_host(e.to_string()))?
            .next()
            .ok_or_else(|| bad_host(format!("{host} resolves to no address")))?;
        Ok(Some(AddPeerAddress {
            engine: engine.clone(),
            addr,
        }))
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
        match self.call_one(ConnectorCall::RequestFinished {
            request: request.clone(),
            blocks,
            num_tokens,
            params: params.clone(),
        })? {
            ConnectorReply::DecodeParams(params) => Ok(params),
            ConnectorReply::Accepted | ConnectorReply::NextTurnParams(_) => {
                Err(ConnectorError::Unavailable)
            }
        }
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

    /// Everything that happened since the last call; exactly one event per request.
    pub fn poll_events(&mut self) -> Vec<ConnectorEvent> {
        let mut events = Vec::new();
        if !self.late.is_empty() {
            self.settle_late(&mut events);
        }
        while let Ok(event) = self.rank.events.try_recv() {
            self.live -= 1;
            events.push(match event {
                EngineEvent::Decode {
                    request,
                    outcome: DecodeOutcome::Ready,
                    blocks,
                    ..
                } => ConnectorEvent::BlocksReady { request, blocks },
                EngineEvent::Decode {
                    request,
                    outcome: DecodeOutcome::Failed(reason),
                    proof,
                    blocks,
                    ..
                } => ConnectorEvent::Failed {
                    request,
                    reason,
                    proof,
                    blocks,
                },
                EngineEvent::Prefill {
                    request,
                    outcome,
                    blocks,
                    ..
                } => ConnectorEvent::BlocksFree {
                    request,
                    released: match outcome {
                        PrefillOutcome::Sent => None,
                        PrefillOutcome::Released(cause) => Some(cause),
                    },
                    blocks,
                },
                EngineEvent::Export {
                    request,
                    outcome,
                    proof,
                    blocks,
                    ..
                } => ConnectorEvent::ExportEnded {
                    request,
                    outcome,
                    proof,
                    blocks,
                },
                EngineEvent::Import {
                    request,
                    outcome,
                    blocks,
                    ..
                } => ConnectorEvent::Imported {
                    request,
                    outcome,
                    blocks,
                },
            });
        }
        events
    }

    /// Waits up to `timeout` for at least one event, then returns all that are queued.
    pub fn wait_events(&mut self, timeout: Duration) -> Vec<ConnectorEvent> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let events = self.poll_events();
            if !events.is_empty() || std::time::Instant::now() >= deadline {
                return events;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// True while a request accepted by this connector has not had its event yet, or a call's
    /// verdict is still late.
    pub fn has_pending_work(&self) -> bool {
        self.live > 0 || !self.late.is_empty()
    }
}
