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

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::mpsc;
use std::time::Duration;

use kvhandoff_actors::machine::{
    DecodeFailure, DecodeOutcome, DecodeStart, EngineEvent, FreeProof, Input, PrefillOutcome,
    PrefillStart, Rejected, ReleaseCause,
};
use kvhandoff_actors::system::{AddPeerAddress, EngineCalls, RankHandle};
use kvhandoff_actors::PeerAddr;
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

/// Why a connector call failed. Nothing changed.
#[derive(Debug, thiserror::Error)]
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
    /// The runtime did not answer in time, or is gone.
    #[error("the kvhandoff runtime did not answer")]
    Unavailable,
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
    live: usize,
    /// Side-channel addresses already handed to the rank's link, per engine.
    known_peers: BTreeMap<EngineId, SocketAddr>,
}

/// Most remote engines whose side-channel address a connector remembers.
const MAX_KNOWN_PEERS: usize = 4096;

impl KvConnector {
    /// How long a call waits for the runtime's verdict.
    pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

    /// A connector over a started rank.
    pub fn new(identity: ConnectorIdentity, rank: RankHandle) -> Self {
        KvConnector {
            identity,
            rank,
            live: 0,
            known_peers: BTreeMap::new(),
        }
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
        // Per input: its result's index, and whether it starts a request.
        let mut slots = Vec::with_capacity(calls.len());
        for call in calls {
            let starts = !matches!(call, ConnectorCall::Abort { .. } | ConnectorCall::Shutdown);
            match self.prepare(call) {
                Ok((input, reply)) => {
                    slots.push((results.len(), starts));
                    inputs.push(input);
                    results.push(Ok(reply));
                }
                Err(error) => results.push(Err(error)),
            }
        }
        if inputs.is_empty() {
            return results;
        }
        let mut verdicts = match self.call_batch(inputs) {
            Ok(verdicts) => verdicts.into_iter(),
            Err(_) => Vec::new().into_iter(),
        };
        for (slot, starts) in slots {
            match verdicts.next() {
                Some(Ok(())) => {
                    if starts {
                        self.live += 1;
                    }
                }
                Some(Err(rejected)) => results[slot] = Err(ConnectorError::from(rejected)),
                None => results[slot] = Err(ConnectorError::Unavailable),
            }
        }
        results
    }

    /// Sends `inputs` to the rank as one message and waits for their verdicts.
    fn call_batch(
        &mut self,
        inputs: Vec<Input>,
    ) -> Result<Vec<Result<(), Rejected>>, ConnectorError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let calls = EngineCalls {
            inputs,
            reply: Some(Box::new(move |verdicts| {
                let _ = tx.send(verdicts);
            })),
        };
        self.rank.batches.try_send(calls).or_else(|err| match err {
            actix::prelude::SendError::Full(calls) => {
                self.rank.batches.do_send(calls);
                Ok(())
            }
            actix::prelude::SendError::Closed(_) => Err(ConnectorError::Unavailable),
        })?;
        rx.recv_timeout(Self::CALL_TIMEOUT)
            .map_err(|_| ConnectorError::Unavailable)
    }

    /// One call, through [`KvConnector::submit`].
    fn call_one(&mut self, call: ConnectorCall) -> Result<ConnectorReply, ConnectorError> {
        self.submit(vec![call])
            .pop()
            .unwrap_or(Err(ConnectorError::Unavailable))
    }

    /// Checks one call and turns it into the endpoint's input and the reply it earns if
    /// accepted.
    fn prepare(&mut self, call: ConnectorCall) -> Result<(Input, ConnectorReply), ConnectorError> {
        match call {
            ConnectorCall::RequestAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => Ok((
                self.decode_input(request, blocks, num_tokens, &params)?,
                ConnectorReply::Accepted,
            )),
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
                    Input::PrefillFinished(PrefillStart {
                        request,
                        key,
                        blocks,
                    }),
                    reply,
                ))
            }
            ConnectorCall::Abort { request } => {
                Ok((Input::Abort { request }, ConnectorReply::Accepted))
            }
            ConnectorCall::Shutdown => Ok((Input::Shutdown, ConnectorReply::Accepted)),
        }
    }

    fn decode_input(
        &mut self,
        request: RequestId,
        blocks: BlockIds,
        num_tokens: u64,
        params: &KvTransferParams,
    ) -> Result<Input, ConnectorError> {
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
        self.learn_peer_address(&engine, params)?;
        Ok(Input::DecodeAllocated(DecodeStart {
            request,
            key,
            epoch,
            prefill: PeerAddr::new(engine, self.identity.rank),
            blocks,
            num_tokens,
            expected_writes: 1,
        }))
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

    /// Tells a TCP rank's link where `engine`'s side channel is, from `remote_host` and
    /// `remote_port` (an in-process rank finds its peers by itself and ignores them).
    fn learn_peer_address(
        &mut self,
        engine: &EngineId,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        if self.rank.side_channel.is_none() {
            return Ok(());
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
        if self.known_peers.get(engine) == Some(&addr) {
            return Ok(());
        }
        if self.known_peers.len() >= MAX_KNOWN_PEERS && !self.known_peers.contains_key(engine) {
            return Err(ConnectorError::Unsupported(
                "more remote engines than the peer book holds",
            ));
        }
        // Sent before the request, so the link knows the address when the handshake starts.
        self.rank.link.do_send(AddPeerAddress {
            engine: engine.clone(),
            addr,
        });
        self.known_peers.insert(engine.clone(), addr);
        Ok(())
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
        while let Ok(event) = self.rank.events.try_recv() {
            self.live = self.live.saturating_sub(1);
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

    /// True while a request accepted by this connector has not had its event yet.
    pub fn has_pending_work(&self) -> bool {
        self.live > 0
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
