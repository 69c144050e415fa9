//! One monotonic clock for the whole process: the ranks' machine time, the side channel's
//! handshake clock samples and the connector's exported expiries all read it, so that a peer's
//! clock offset, measured at the handshake, converts the peer's times into ours.

use std::sync::OnceLock;
use std::time::Duration;

// Tokio's clock: the real monotonic clock, except in tests that pause it, where the ranks'
// timers and this clock advance together.
use actix::clock::Instant;

static ORIGIN: OnceLock<Instant> = OnceLock::new();

/// Time since this process's clock origin (fixed at the first call).
///
/// ```
/// let a = kvhandoff_actors::system::process_clock();
/// let b = kvhandoff_actors::system::process_clock();
/// assert!(b >= a);
/// ```
pub fn process_clock() -> Duration {
    let origin = *ORIGIN.get_or_init(Instant::now);
    Instant::now().saturating_duration_since(origin)
}
