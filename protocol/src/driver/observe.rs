//! [`TransferObserver`]: what a shell learns about each transfer as the driver posts and ends
//! it, for per-transfer metrics (time, bytes, descriptors) and failed notifications.
//!
//! The driver never reads a clock: it calls the observer at the moments that matter, and the
//! shell's observer reads its own (the actor's `Instant`), so that this crate stays free of
//! time and the tests can drive the driver without one.

use crate::machine::NetEvent;
use crate::transport::{Transport, TransportError};
use crate::WriteId;

use super::TransportDriver;

/// Told by a [`TransportDriver`](super::TransportDriver) about each transfer (a write, a
/// layer-wise write as a whole, or a read). Every method defaults to nothing; the calls are
/// made on the driver's thread, in order: `posting`, then `posted` (the post succeeded) or
/// nothing more (it failed, and the transfer's `WriteFailed(PostFailed)` goes to the endpoint),
/// then `ended` once.
pub trait TransferObserver: Send {
    /// The transport's post call for a transfer starts now (planning is done).
    fn posting(&mut self) {}

    /// The post of `id` returned successfully: `descriptors` descriptors of `bytes` bytes in
    /// all are in flight.
    fn posted(&mut self, id: WriteId, descriptors: usize, bytes: u64) {
        let _ = (id, descriptors, bytes);
    }

    /// The transfer `id` ended: the transport reported it complete (`ok`) or failed. Called
    /// once per posted transfer (a layer-wise write once, when its last part ends).
    fn ended(&mut self, id: WriteId, ok: bool) {
        let _ = (id, ok);
    }

    /// A notification (a control message other than a heartbeat) could not be sent.
    fn notification_failed(&mut self, error: &TransportError) {
        let _ = error;
    }
}

impl<T: Transport> TransportDriver<T> {
    pub(super) fn observe(&mut self, f: impl FnOnce(&mut dyn TransferObserver)) {
        if let Some(observer) = self.observer.as_deref_mut() {
            f(observer);
        }
    }

    /// Tells the observer that the transfer an end event names has ended (an id it never saw
    /// posted, such as a refused post's, it ignores).
    pub(super) fn observe_end(&mut self, end: Option<&NetEvent>) {
        match end {
            Some(NetEvent::WriteCompleted { write }) => {
                let write = *write;
                self.observe(|o| o.ended(write, true));
            }
            Some(NetEvent::WriteFailed { write, .. }) => {
                let write = *write;
                self.observe(|o| o.ended(write, false));
            }
            _ => {}
        }
    }
}
