//! Trace ids: what joins one request's log records on P and on D.
//!
//! A [`TraceId`] is 128 bits, printed as 32 lowercase hex digits (the W3C Trace Context form, so
//! an OpenTelemetry exporter can take it as is). It is made on the side that sends a request's
//! first message (D's `Register` when pushing, the reader's `ReadAsk` when reading), carried in
//! that message and adopted by the other side; a handshake carries the connection's own.
//!
//! Why not derive it from the pairing key and epoch, which both sides already share? Because
//! they repeat: a D rank that restarted retries a key at epoch 1 again, and a router may reuse a
//! transfer id, so records of unrelated attempts would join. An id made fresh for every attempt
//! never repeats (within the 2^-64 odds of a birthday collision).
//!
//! The machines stay deterministic: an endpoint makes its ids with a [`TraceIds`] generator, a
//! keyed hash of a per-process seed (the shells seed it at random; the simulator's seed follows
//! its own) and a counter, so an id is unpredictable between processes and never repeats within
//! one.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The 128-bit id of one request's attempt (or of one side-channel connection), shared by P and
/// D. Never all zeros on the wire (`FieldError::ZeroTraceId`): W3C Trace Context reserves the
/// zero id for "no trace".
///
/// ```
/// use kvhandoff_protocol::TraceId;
/// let id = TraceId::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
/// assert_eq!(id.to_string(), "0123456789abcdef0011223344556677");
/// assert_eq!("0123456789abcdef0011223344556677".parse::<TraceId>().unwrap(), id);
/// assert!(TraceId::from_u128(0).validate().is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TraceId(pub [u8; 16]);

/// Why a trace id is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TraceIdError {
    /// All 128 bits are zero.
    #[error("trace id is all zeros")]
    Zero,
    /// Text that is not exactly 32 hex digits.
    #[error("trace id is not 32 hex digits")]
    NotHex,
}

impl TraceId {
    /// The id whose big-endian bits are `value` (so it prints as `value` in hex).
    pub fn from_u128(value: u128) -> TraceId {
        TraceId(value.to_be_bytes())
    }

    /// The id as a number (big endian, as printed).
    pub fn as_u128(self) -> u128 {
        u128::from_be_bytes(self.0)
    }

    /// A new random id (UUID v4 bits; the shells use it for connections, never the machines).
    pub fn random() -> TraceId {
        TraceId::from_u128(uuid::Uuid::new_v4().as_u128())
    }

    /// Checks the id's rule: not all zeros.
    ///
    /// # Errors
    /// [`TraceIdError::Zero`].
    pub fn validate(self) -> Result<(), TraceIdError> {
        if self.0 == [0; 16] {
            return Err(TraceIdError::Zero);
        }
        Ok(())
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.as_u128())
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({self})")
    }
}

impl std::str::FromStr for TraceId {
    type Err = TraceIdError;

    /// Exactly 32 hex digits (either case), not all zeros.
    fn from_str(s: &str) -> Result<TraceId, TraceIdError> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TraceIdError::NotHex);
        }
        let value = u128::from_str_radix(s, 16).map_err(|_| TraceIdError::NotHex)?;
        let id = TraceId::from_u128(value);
        id.validate()?;
        Ok(id)
    }
}

/// Makes an endpoint's trace ids: SHA-256 of a seed and a counter, truncated to 128 bits. Pure
/// (no randomness of its own), so a seeded simulation stays reproducible; seeded at random by
/// the shells, so two processes' ids are unrelated.
///
/// ```
/// use kvhandoff_protocol::TraceIds;
/// let mut ids = TraceIds::new(7);
/// let (a, b) = (ids.next_id(), ids.next_id());
/// assert_ne!(a, b);
/// assert_eq!(TraceIds::new(7).next_id(), a);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceIds {
    seed: u128,
    next: u64,
}

impl TraceIds {
    /// A generator seeded with `seed`.
    pub fn new(seed: u128) -> TraceIds {
        TraceIds { seed, next: 0 }
    }

    /// A generator seeded by `rank`'s address: reproducible, distinct between ranks, but the same
    /// in every run of the rank (the shells call [`TraceIds::new`] with a random seed instead).
    pub fn for_rank(rank: &crate::PeerAddr) -> TraceIds {
        let mut hash = Sha256::new();
        hash.update(b"kvhandoff.trace.rank");
        hash.update((rank.engine.as_str().len() as u64).to_le_bytes());
        hash.update(rank.engine.as_str().as_bytes());
        hash.update(rank.rank.to_le_bytes());
        let digest = hash.finalize();
        let mut seed = [0u8; 16];
        seed.copy_from_slice(&digest[..16]);
        TraceIds::new(u128::from_le_bytes(seed))
    }

    /// A new id, never the zero id nor one this generator made before.
    pub fn next_id(&mut self) -> TraceId {
        loop {
            let mut hash = Sha256::new();
            hash.update(b"kvhandoff.trace");
            hash.update(self.seed.to_le_bytes());
            hash.update(self.next.to_le_bytes());
            // 2^64 requests would take centuries; wrapping keeps this total.
            self.next = self.next.wrapping_add(1);
            let digest = hash.finalize();
            let mut bytes = [0u8; 16];
            bytes.copy_from_slice(&digest[..16]);
            let id = TraceId(bytes);
            if id.validate().is_ok() {
                return id;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_and_bad_text_is_refused() {
        let id = TraceId::from_u128(0xabc);
        assert_eq!(id.to_string(), format!("{:032x}", 0xabc));
        assert_eq!(id.to_string().parse::<TraceId>(), Ok(id));
        assert_eq!(
            "ABCDEF0123456789ABCDEF0123456789".parse::<TraceId>(),
            Ok(TraceId::from_u128(0xabcdef0123456789abcdef0123456789))
        );
        for bad in [
            "",
            "abc",
            &"0".repeat(33),
            &"g".repeat(32),
            "+0000000000000000000000000000001",
        ] {
            assert_eq!(bad.parse::<TraceId>(), Err(TraceIdError::NotHex), "{bad:?}");
        }
        assert_eq!("0".repeat(32).parse::<TraceId>(), Err(TraceIdError::Zero));
    }

    #[test]
    fn generated_ids_differ_by_seed_and_counter() {
        let mut a = TraceIds::new(1);
        let mut b = TraceIds::new(2);
        let ids: std::collections::BTreeSet<TraceId> =
            (0..1000).flat_map(|_| [a.next_id(), b.next_id()]).collect();
        assert_eq!(ids.len(), 2000);
        assert!(ids.iter().all(|id| id.validate().is_ok()));
    }

    #[test]
    fn random_ids_are_valid_and_differ() {
        let (a, b) = (TraceId::random(), TraceId::random());
        assert_ne!(a, b);
        assert!(a.validate().is_ok());
    }
}
