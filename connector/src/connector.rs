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
//! Calls are synchronous, for an engine's scheduler thread; each waits for its verdict for at
//! most [`KvConnector::CALL_TIMEOUT`]. Never call them from inside the runtime's own thread.

use std::net::ToSocketAddrs;
use std::sync::mpsc;
use std::time::Duration;

use kvhandoff_actors::system::{AddPeerAddress, Calls, RankHandle};
use kvhandoff_protocol::machine::{
    DecodeFailure, DecodeOutcome, DecodeStart, EngineCall, EngineEvent, FreeProof, PrefillOutcome,
    PrefillStart, Rejected, ReleaseCause,
};
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{BlockIds, EngineId, Epoch, IdError, PairingKey, RequestId};
use serde::{Deserialize, Serialize};

/// The transfer parameters that travel through the router between P and D, with vLLM's key
/// names plus ours (`transfer_id`, `epoch`). Unknown keys are ignored.
///
/// ```
/// use kvhandoff::KvTransferParams;
/// let params: KvTransferParams = serde_json::from_str(r#"{
///     "do_remote_prefill": true, "remote_engine_id": "prefill-0",
///     "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1
/// }"#).unwrap();
/// assert!(params.do_remote_prefill);
/// assert_eq!(params.epoch, None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// D: the prefill ran remotely and its KV must be received.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// P: the decode runs remotely and the KV must be kept for it.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// The other engine.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// The other engine's side-channel host.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// The other engine's side-channel port.
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// The other engine's id of the request.
    #[serde(default)]
    pub remote_request_id: Option<String>,
    /// The other engine's TP size.
    #[serde(default)]
    pub tp_size: Option<u32>,
    /// An explicit pairing key chosen by the router; preferred over request-id pairing.
    #[serde(default)]
    pub transfer_id: Option<String>,
    /// The attempt, chosen by the router on retries (default 1).
    #[serde(default)]
    pub epoch: Option<u64>,
    /// `"push"` for this connector.
    #[serde(default)]
    pub transfer_mode: Option<String>,
}

/// Why a connector call failed. Nothing changed — except for [`ConnectorError::VerdictLate`],
/// which says that it is not known yet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectorError {
    /// The endpoint refused the input.
    #[error(transparent)]
    Rejected(#[from] Rejected),
    /// A required transfer parameter is missing.
    #[error("kv_transfer_params lacks {0}")]
    MissingParam(&'static str),
    /// A transfer parameter or id is invalid.
    #[error("invalid {name}: {why}")]
    InvalidParam {
        /// The parameter.
        name: &'static str,
        /// Why.
        why: String,
    },
    /// The request asks for something this build does not do yet.
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// The runtime is gone (or refused the call before taking it): nothing changed.
    #[error("the kvhandoff runtime is not running")]
    Unavailable,
    /// The runtime took the call but gave no verdict within [`KvConnector::CALL_TIMEOUT`]. The
    /// call may still be applied, so nothing may be assumed: keep the request's blocks. Its
    /// fate comes through [`KvConnector::poll_events`] — the request's one event if it was
    /// accepted, or [`ConnectorEvent::Refused`] if not — and
    /// [`KvConnector::has_pending_work`] stays true until then.
    #[error("the kvhandoff runtime took the call but has not answered yet; its event will tell")]
    VerdictLate,
}

impl ConnectorError {
    fn invalid(name: &'static str, err: IdError) -> Self {
        ConnectorError::InvalidParam {
            name,
            why: err.to_string(),
        }
    }
}

/// What the engine learns each step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorEvent {
    /// D: the request's KV has arrived in its blocks; schedule it.
    BlocksReady {
        /// The request.
        request: RequestId,
        /// Its blocks, now holding the prompt's KV.
        blocks: BlockIds,
    },
    /// D: the request's KV will not arrive; the blocks are free again.
    Failed {
        /// The request.
        request: RequestId,
        /// Why.
        reason: DecodeFailure,
        /// What made it safe to hand the blocks back (`DeadPeerFence` or `Quarantine`: a
        /// deadline passed, not a proof; the request waited for it).
        proof: FreeProof,
        /// The blocks, free to reuse.
        blocks: BlockIds,
    },
    /// A call whose verdict came late ([`ConnectorError::VerdictLate`]) was refused after all:
    /// nothing changed, and its blocks are the engine's again.
    Refused {
        /// The request of the refused call.
        request: RequestId,
        /// Why.
        error: ConnectorError,
    },
    /// P: the request's blocks may be freed.
    BlocksFree {
        /// The request.
        request: RequestId,
        /// `None` when the KV was sent; otherwise why it was released unsent.
        released: Option<ReleaseCause>,
        /// The blocks, free to reuse.
        blocks: BlockIds,
    },
}

/// Why a batch has no verdict.
enum Late {
    /// It never reached the runtime (or the runtime dropped it): nothing changed.
    NotSent,
    /// The runtime took it; its verdict will come on this channel.
    NoVerdict(mpsc::Receiver<Verdicts>),
}

/// One engine hook call, for [`KvConnector::submit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorCall {
    /// D side, as [`KvConnector::request_allocated`].
    RequestAllocated {
        /// The request.
        request: RequestId,
        /// Its allocated blocks.
        blocks: BlockIds,
        /// Tokens expected.
        num_tokens: u64,
        /// The router's parameters.
        params: KvTransferParams,
    },
    /// P side, as [`KvConnector::request_finished`].
    RequestFinished {
        /// The request.
        request: RequestId,
        /// Its blocks, holding the KV.
        blocks: BlockIds,
        /// The router's parameters for the prefill leg.
        params: KvTransferParams,
    },
    /// Either side, as [`KvConnector::abort`].
    Abort {
        /// The request.
        request: RequestId,
    },
    /// Either side, as [`KvConnector::shutdown`].
    Shutdown,
}

impl ConnectorEvent {
    /// The request the event is about.
    pub fn request(&self) -> &RequestId {
        match self {
            ConnectorEvent::BlocksReady { request, .. }
            | ConnectorEvent::Failed { request, .. }
            | ConnectorEvent::Refused { request, .. }
            | ConnectorEvent::BlocksFree { request, .. } => request,
        }
    }
}

impl ConnectorCall {
    /// The request the call is about (none for `Shutdown`).
    pub fn request(&self) -> Option<&RequestId> {
        match self {
            ConnectorCall::RequestAllocated { request, .. }
            | ConnectorCall::RequestFinished { request, .. }
            | ConnectorCall::Abort { request } => Some(request),
            ConnectorCall::Shutdown => None,
        }
    }
}

/// What an accepted [`ConnectorCall`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectorReply {
    /// Accepted (`RequestAllocated`, `Abort`).
    Accepted,
    /// Accepted (`RequestFinished`): the parameters for the router to send with the decode leg.
    DecodeParams(KvTransferParams),
}

/// Identity and placement of the engine rank a connector serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectorIdentity {
    /// The engine.
    pub engine: EngineId,
    /// This rank.
    pub rank: u32,
    /// The engine's TP size.
    pub tp_size: u32,
    /// The side-channel address advertised to the router.
    pub host: String,
    /// The side-channel port advertised to the router.
    pub port: u16,
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

    /// A connector over a started rank.
    pub fn new(identity: ConnectorIdentity, rank: RankHandle) -> Self {
        KvConnector {
            identity,
            rank,
            live: 0,
            late: Vec::new(),
            call_timeout: Self::CALL_TIMEOUT,
        }
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
            let starts = !matches!(call, ConnectorCall::Abort { .. } | ConnectorCall::Shutdown);
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
                let (input, address) = self.decode_input(request, blocks, num_tokens, &params)?;
                Ok((input, address, ConnectorReply::Accepted))
            }
            ConnectorCall::RequestFinished {
                request,
                blocks,
                params,
            } => {
                let key = pairing_key(&request, &params)?;
                let reply = ConnectorReply::DecodeParams(KvTransferParams {
                    do_remote_prefill: true,
                    do_remote_decode: false,
                    remote_engine_id: Some(self.identity.engine.to_string()),
                    remote_host: Some(self.identity.host.clone()),
                    remote_port: Some(self.identity.port),
                    remote_request_id: Some(request.to_string()),
                    tp_size: Some(self.identity.tp_size),
                    transfer_id: params.transfer_id,
                    epoch: params.epoch,
                    transfer_mode: Some("push".into()),
                });
                Ok((
                    EngineCall::PrefillFinished(PrefillStart {
                        request,
                        key,
                        blocks,
                    }),
                    None,
                    reply,
                ))
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
        if !params.do_remote_prefill {
            return Err(ConnectorError::InvalidParam {
                name: "do_remote_prefill",
                why: "must be true for a request whose prefill ran remotely".into(),
            });
        }
        let engine = params
            .remote_engine_id
            .as_deref()
            .ok_or(ConnectorError::MissingParam("remote_engine_id"))?;
        let engine =
            EngineId::new(engine).map_err(|e| ConnectorError::invalid("remote_engine_id", e))?;
        let remote_tp = params
            .tp_size
            .ok_or(ConnectorError::MissingParam("tp_size"))?;
        if remote_tp != self.identity.tp_size {
            return Err(ConnectorError::Unsupported(
                "P and D with different TP sizes (heterogeneous TP comes later)",
            ));
        }
        let key = pairing_key(&request, params)?;
        let epoch = epoch(params)?;
        let address = self.peer_address(&engine, params)?;
        let call = EngineCall::DecodeAllocated(DecodeStart {
            request,
            key,
            epoch,
            prefill: PeerAddr::new(engine, self.identity.rank),
            blocks,
            num_tokens,
            expected_writes: 1,
        });
        Ok((call, address))
    }

    /// D side: `blocks` were allocated for `request`, whose prefill ran on the engine named in
    /// `params`; `num_tokens` tokens are expected. With all-empty `blocks` (a full prefix hit)
    /// the request is ready at once and P is told to free its copy.
    ///
    /// # Errors
    /// [`ConnectorError`] for missing or invalid parameters, an unsupported TP ratio, or a
    /// refusal by the endpoint (duplicate request, full table).
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

    /// P side: `request`'s prefill finished with its KV in `blocks`. `params` are the ones the
    /// router sent with the prefill leg (for `transfer_id`). Returns the parameters for the
    /// router to send with the decode leg.
    ///
    /// # Errors
    /// [`ConnectorError`] for an invalid `transfer_id` or a refusal by the endpoint.
    pub fn request_finished(
        &mut self,
        request: &RequestId,
        blocks: BlockIds,
        params: &KvTransferParams,
    ) -> Result<KvTransferParams, ConnectorError> {
        match self.call_one(ConnectorCall::RequestFinished {
            request: request.clone(),
            blocks,
            params: params.clone(),
        })? {
            ConnectorReply::DecodeParams(params) => Ok(params),
            ConnectorReply::Accepted => Err(ConnectorError::Unavailable),
        }
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

fn pairing_key(
    request: &RequestId,
    params: &KvTransferParams,
) -> Result<PairingKey, ConnectorError> {
    match &params.transfer_id {
        Some(id) => {
            PairingKey::from_transfer_id(id).map_err(|e| ConnectorError::invalid("transfer_id", e))
        }
        None => Ok(PairingKey::from_request_id(request)),
    }
}

fn epoch(params: &KvTransferParams) -> Result<Epoch, ConnectorError> {
    match params.epoch.map(Epoch) {
        None => Ok(Epoch::FIRST),
        Some(epoch) if epoch.is_valid() => Ok(epoch),
        Some(epoch) => Err(ConnectorError::InvalidParam {
            name: "epoch",
            why: format!("{epoch} is out of range: epochs run 1..={}", Epoch::MAX),
        }),
    }
}
