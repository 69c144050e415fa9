//! The per-request spans: every transition of a request (and the filing of its end) runs in a
//! `debug` span named for its role (`decode`, `prefill`, `import`, `export`) that carries the
//! pairing `key`, the `rank`, and once known the attempt's `epoch` and `trace_id`, which P and D
//! share (it travels in the attempt's first message), so the two sides' records join.
//!
//! The span is made for every input, so it stays cheap: with `debug` off for this crate the
//! macro returns a disabled span after one cached check, and nothing is formatted.

use tracing::field::display;
use tracing::Span;

use crate::{Epoch, TraceId};

/// Records what is known of the request's attempt on its span.
pub(crate) fn record_attempt(span: &Span, epoch: Option<Epoch>, trace: Option<TraceId>) {
    if span.is_disabled() {
        return;
    }
    if let Some(epoch) = epoch {
        span.record("epoch", display(epoch));
    }
    if let Some(trace) = trace {
        span.record("trace_id", display(trace));
    }
}
