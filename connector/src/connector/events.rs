//! What the engine polls: each request's one final event (after, for a D request fenced by its
//! P's death, its one early `DecodeFenced`), and whether work is still pending.

use std::time::Duration;

use super::KvConnector;
use crate::ConnectorEvent;

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
            let event = match self.rank.events.try_recv() {
                Ok(event) => event,
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    if !self.stopped {
                        tracing::error!(
                            in_progress = self.live,
                            "the rank stopped: no event will come for the requests in progress"
                        );
                    }
                    self.stopped = true;
                    break;
                }
            };
            if event.hands_back() {
                self.live -= 1;
            }
            events.push(event);
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
