//! The round trip of the calls: a step's calls taken to the rank's session in one message
//! ([`KvConnector::submit`]), and the verdicts that came too late settled when they come.

use std::sync::mpsc;

use kvhandoff_actors::system::Calls;
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

type Verdicts = Vec<Result<ConnectorReply, ConnectorError>>;

/// A batch the runtime took without answering in time.
pub(super) struct LateBatch {
    verdicts: mpsc::Receiver<Verdicts>,
    /// Per call: its request (if any) and whether an acceptance starts a request.
    calls: Vec<(Option<RequestId>, bool)>,
}

impl KvConnector {
    /// Runs a batch of engine hook calls (one scheduler step's worth) with one round trip to
    /// the runtime: the rank's session handles them in order, each as its single-call form,
    /// and one result per call comes back, in order. A refused call changes nothing; the
    /// others still run.
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
        if calls.is_empty() {
            return Vec::new();
        }
        let n = calls.len();
        let starts: Vec<(Option<RequestId>, bool)> = calls
            .iter()
            .map(|call| (call.request().cloned(), call.starts_request()))
            .collect();
        match self.call_batch(calls) {
            Ok(mut results) => {
                results.resize_with(n, || Err(ConnectorError::Unavailable));
                for (result, (_, starts)) in results.iter().zip(&starts) {
                    if result.is_ok() {
                        self.live += i64::from(*starts);
                    }
                }
                results
            }
            Err(Late::NotSent) => vec![Err(ConnectorError::Unavailable); n],
            // The rank took the batch and dropped it unanswered: it died handling it, maybe
            // halfway through. "Nothing changed" would be a guess; say that nobody knows.
            Err(Late::Lost) => vec![Err(ConnectorError::VerdictUnknown); n],
            Err(Late::NoVerdict(verdicts)) => {
                self.late.push(LateBatch {
                    verdicts,
                    calls: starts,
                });
                vec![Err(ConnectorError::VerdictLate); n]
            }
        }
    }

    /// Sends `calls` to the rank as one message and waits for their results, up to
    /// [`Self::CALL_TIMEOUT`]; past it the batch may still be applied ([`Late::NoVerdict`]).
    fn call_batch(&mut self, calls: Vec<ConnectorCall>) -> Result<Verdicts, Late> {
        if self.late.len() >= MAX_LATE_BATCHES {
            return Err(Late::NotSent);
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let calls = Calls {
            calls,
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
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Late::Lost),
        }
    }

    /// Settles the late batches whose verdicts have come: acceptances count as live requests,
    /// refusals of calls that start one become [`ConnectorEvent::Refused`].
    pub(super) fn settle_late(&mut self, events: &mut Vec<ConnectorEvent>) {
        let mut still_late = Vec::new();
        for batch in std::mem::take(&mut self.late) {
            match batch.verdicts.try_recv() {
                Ok(verdicts) => {
                    for ((request, starts), verdict) in batch.calls.into_iter().zip(verdicts) {
                        match (verdict, request) {
                            (Ok(_), _) => self.live += i64::from(starts),
                            // A refused abort or decline started nothing and ended nothing: the
                            // request it names has (or had) its own one event. A `Refused`
                            // would tell the engine its blocks are back a second time.
                            (Err(error), _) if !starts => {
                                tracing::debug!(%error, "a late verdict refused a call that starts nothing");
                            }
                            (Err(error), Some(request)) => {
                                events.push(ConnectorEvent::Refused { request, error })
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

    /// One call, through [`KvConnector::submit`].
    pub(super) fn call_one(
        &mut self,
        call: ConnectorCall,
    ) -> Result<ConnectorReply, ConnectorError> {
        self.submit(vec![call])
            .pop()
            .unwrap_or(Err(ConnectorError::Unavailable))
    }
}
