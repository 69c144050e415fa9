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
    DecodeOutcome, DecodeStart, EngineCall, EngineEvent, PrefillOutcome, PrefillStart, Rejected,
};
use kvhandoff_protocol::PeerAddr;
use kvhandoff_protocol::{BlockIds, EngineId, RequestId};

use crate::params::{epoch, pairing_key};
use crate::{
    ConnectorCall, ConnectorError, ConnectorEvent, ConnectorIdentity, ConnectorReply,
    KvTransferParams,
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
