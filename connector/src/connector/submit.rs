//! The plumbing of the calls: a step's calls checked and sent to the rank in one round trip
//! ([`KvConnector::submit`]), and the verdicts that came too late settled when they come.

use std::sync::mpsc;

use kvhandoff_actors::system::{AddPeerAddress, Calls};
use kvhandoff_protocol::machine::{EngineCall, Rejected};
use kvhandoff_protocol::RequestId;

use super::KvConnector;
use crate::{ConnectorCall, ConnectorError, ConnectorEvent, ConnectorReply};

/// Why a batch has no verdict.
enum Late {
    /// It never reached the runtime: nothing changed.
    NotSent,
    /// The runtime took it; its verdict will come on this channel.
    NoVerdict(mpsc::Receiver<Verdicts>),
    /// The runtime took it and the rank dropped it unanswered (it panicked or stopped while
    /// handling the batch): any prefix of its calls may have been applied.
    Lost,
}

/// Most batches waiting for a late verdict; past it the runtime is taken as hung and calls are
/// refused (`Unavailable`) without being sent.
const MAX_LATE_BATCHES: usize = 1024;

type Verdicts = Vec<Result<(), Rejected>>;

/// A batch the runtime took without answering in time.
pub(super) struct LateBatch {
    verdicts: mpsc::Receiver<Verdicts>,
    /// Per input: its request (if any) and whether an acceptance starts a request.
    inputs: Vec<(Option<RequestId>, bool)>,
}

impl KvConnector {
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
        if self.links.is_some() {
            // Each call becomes several sub-requests: one round trip per call.
            return calls
                .into_iter()
                .map(|call| self.linked_call(call))
                .collect();
        }
        self.submit_batch(calls)
    }

    /// [`KvConnector::submit`] for a rank without links: the whole batch in one round trip.
    fn submit_batch(
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
            Err(Late::Lost) => {
                for (slot, _, _) in slots {
                    results[slot] = Err(ConnectorError::VerdictUnknown);
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
            // The rank took the batch and dropped it unanswered: it died handling it, maybe
            // halfway through. "Nothing changed" would be a guess; say that nobody knows.
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Late::Lost),
        }
    }

    /// Settles the late batches whose verdicts have come: acceptances count as live requests,
    /// refusals become [`ConnectorEvent::Refused`].
    pub(super) fn settle_late(&mut self, events: &mut Vec<ConnectorEvent>) {
        let mut still_late = Vec::new();
        for batch in std::mem::take(&mut self.late) {
            match batch.verdicts.try_recv() {
                Ok(verdicts) => {
                    for ((request, starts), verdict) in batch.inputs.into_iter().zip(verdicts) {
                        match (verdict, request) {
                            (Ok(()), _) => self.live += i64::from(starts),
                            // A refused abort or decline started nothing and ended nothing: the
                            // request it names has (or had) its own one event. A `Refused`
                            // would tell the engine its blocks are back a second time.
                            (Err(rejected), _) if !starts => {
                                tracing::debug!(%rejected, "a late verdict refused a call that starts nothing");
                            }
                            // A sub-request the rank refused: its fan decides the event.
                            (Err(_), Some(request)) if self.is_sub_request(&request) => {
                                self.sub_not_started(&request, events);
                            }
                            (Err(rejected), Some(request)) => {
                                events.push(ConnectorEvent::Refused {
                                    request,
                                    error: ConnectorError::from(rejected),
                                })
                            }
                            (Err(_), None) => {}
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

    /// Engine inputs built by the connector itself (a multi-rank request's sub-requests, or
    /// the aborts of its siblings), in one round trip: each input's verdict, in order. A late
    /// batch is settled as [`KvConnector::submit`]'s are (acceptances of starts count as live).
    ///
    /// # Errors
    /// [`ConnectorError::Unavailable`] when the batch never reached the runtime;
    /// [`ConnectorError::VerdictLate`] when it did but its verdicts are late;
    /// [`ConnectorError::VerdictUnknown`] when the rank dropped it unanswered.
    pub(super) fn call_inputs(
        &mut self,
        inputs: Vec<EngineCall>,
        addresses: Vec<AddPeerAddress>,
    ) -> Result<Verdicts, ConnectorError> {
        let pending: Vec<(Option<RequestId>, bool)> = inputs
            .iter()
            .map(|input| match input {
                EngineCall::DecodeAllocated(start) => (Some(start.request.clone()), true),
                EngineCall::PrefillFinished(start) => (Some(start.request.clone()), true),
                _ => (None, false),
            })
            .collect();
        match self.call_batch(inputs, addresses) {
            Ok(verdicts) => Ok(verdicts),
            Err(Late::NotSent) => Err(ConnectorError::Unavailable),
            Err(Late::Lost) => Err(ConnectorError::VerdictUnknown),
            Err(Late::NoVerdict(verdicts)) => {
                self.late.push(LateBatch {
                    verdicts,
                    inputs: pending,
                });
                Err(ConnectorError::VerdictLate)
            }
        }
    }

    /// One call, through [`KvConnector::submit`].
    pub(super) fn call_one(
        &mut self,
        call: ConnectorCall,
    ) -> Result<ConnectorReply, ConnectorError> {
        self.submit(vec![call])
            .pop()
            .unwrap_or(Err(ConnectorError::Unavailable))
    }

    /// One call as a rank without links makes it.
    fn unlinked_call(&mut self, call: ConnectorCall) -> Result<ConnectorReply, ConnectorError> {
        self.submit_batch(vec![call])
            .pop()
            .unwrap_or(Err(ConnectorError::Unavailable))
    }

    /// One call on a rank with links: push requests split into pair sub-requests, aborts of
    /// multi-rank requests abort every sub-request; everything else as without links.
    fn linked_call(&mut self, call: ConnectorCall) -> Result<ConnectorReply, ConnectorError> {
        let Some(links) = self.links.clone() else {
            return self.unlinked_call(call);
        };
        match call {
            ConnectorCall::RequestAllocated {
                request,
                blocks,
                num_tokens,
                params,
            } => self
                .fan_allocated(&links, &request, blocks, num_tokens, &params)
                .map(|()| ConnectorReply::Accepted),
            ConnectorCall::RequestFinished { .. } => match self.prepare(call)? {
                (EngineCall::PrefillFinished(start), _, reply) => {
                    self.fan_finished(&links, start).map(|()| reply)
                }
                _ => Err(ConnectorError::Unsupported(
                    "pull between engines of different geometries",
                )),
            },
            ConnectorCall::Abort { request } if self.is_fan(&request) => {
                self.abort_fan(&request).map(|()| ConnectorReply::Accepted)
            }
            ConnectorCall::KeepForNextTurn { .. }
            | ConnectorCall::NextTurnAllocated { .. }
            | ConnectorCall::DeclineExport { .. } => Err(ConnectorError::Unsupported(
                "bidirectional turns between engines of different geometries",
            )),
            other @ (ConnectorCall::Abort { .. } | ConnectorCall::Shutdown) => {
                self.unlinked_call(other)
            }
        }
    }
}
