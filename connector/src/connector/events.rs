//! What the engine polls: each request's one event, and whether work is still pending.

use std::time::Duration;

use kvhandoff_protocol::machine::{DecodeOutcome, EngineEvent, PrefillOutcome};

use super::KvConnector;
use crate::ConnectorEvent;

impl KvConnector {
    /// Everything that happened since the last call; exactly one event per request.
    pub fn poll_events(&mut self) -> Vec<ConnectorEvent> {
        let mut events = std::mem::take(&mut self.fans.queued);
        if !self.late.is_empty() {
            self.settle_late(&mut events);
        }
        while let Ok(event) = self.rank.events.try_recv() {
            self.live -= 1;
            if self.fan_event(&event, &mut events).is_some() {
                continue;
            }
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
        self.live > 0 || !self.late.is_empty() || !self.fans.queued.is_empty()
    }
}
