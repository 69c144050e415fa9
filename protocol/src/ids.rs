//! Identifiers shared by P and D: engines, requests, pairing keys and epochs.
//!
//! Every string id is bounded ([`MAX_ID_LEN`] bytes), non-empty and free of control characters,
//! so that an id read from a peer can be logged, used as a map key and echoed back safely.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest id, in bytes, that any identifier may have.
pub const MAX_ID_LEN: usize = 256;

/// Why a string was refused as an identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The id was empty.
    #[error("{kind} is empty")]
    Empty {
        /// Which kind of id.
        kind: &'static str,
    },
    /// The id was longer than [`MAX_ID_LEN`] bytes.
    #[error("{kind} is {len} bytes long, more than the limit of {MAX_ID_LEN}")]
    TooLong {
        /// Which kind of id.
        kind: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The id contained a control character (newline, NUL, ...).
    #[error("{kind} contains a control character at byte {at}")]
    ControlCharacter {
        /// Which kind of id.
        kind: &'static str,
        /// Byte offset of the offending character.
        at: usize,
    },
}

fn check_id(kind: &'static str, value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if value.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            kind,
            len: value.len(),
        });
    }
    if let Some((at, _)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(IdError::ControlCharacter { kind, at });
    }
    Ok(())
}

/// The first 16 bytes of `text`, big-endian, zero-padded. Comparing heads orders two texts as
/// comparing the texts does whenever the heads differ (a text that ends early pads with zeros,
/// which sort first, as the shorter of two texts sharing a prefix does); equal heads leave the
/// order to the texts themselves.
fn head_of(text: &str) -> u128 {
    let mut head = [0u8; 16];
    let n = text.len().min(head.len());
    head[..n].copy_from_slice(&text.as_bytes()[..n]);
    u128::from_be_bytes(head)
}

/// Reads a string straight into shared text: one allocation, where going through a `String`
/// took two (the string, then its copy into the `Arc`).
struct SharedTextVisitor;

impl serde::de::Visitor<'_> for SharedTextVisitor {
    type Value = Arc<str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Arc<str>, E> {
        Ok(Arc::from(text))
    }

    fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Arc<str>, E> {
        Ok(Arc::from(text))
    }
}

macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident, $kind:literal) => {
        $(#[$meta])*
        ///
        /// Shared, immutable text: a clone is a reference-count increment, not a copy. On the
        /// wire it is a plain string. Ordered, compared and hashed exactly as its text.
        #[derive(Clone)]
        pub struct $name {
            /// The text's first bytes (see [`head_of`]): most comparisons end here, without
            /// reading the shared text.
            head: u128,
            text: Arc<str>,
        }

        impl $name {
            fn wrap(text: Arc<str>) -> Self {
                Self {
                    head: head_of(&text),
                    text,
                }
            }
        }

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                self.head == other.head && self.text == other.text
            }
        }

        impl Eq for $name {}

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
                Some(self.cmp(other))
            }
        }

        impl Ord for $name {
            fn cmp(&self, other: &Self) -> Ordering {
                self.head
                    .cmp(&other.head)
                    .then_with(|| self.text.cmp(&other.text))
            }
        }

        impl Hash for $name {
            fn hash<H: Hasher>(&self, state: &mut H) {
                self.text.hash(state);
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.text)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_str(SharedTextVisitor).map(Self::wrap)
            }
        }

        impl $name {
            /// Checks `value` and wraps it.
            ///
            /// # Errors
            /// [`IdError`] when the value is empty, longer than [`MAX_ID_LEN`] bytes or holds a
            /// control character.
            pub fn new(value: impl AsRef<str>) -> Result<Self, IdError> {
                let value = value.as_ref();
                check_id($kind, value)?;
                // Straight from the text into shared text: one allocation.
                Ok(Self::wrap(Arc::from(value)))
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.text
            }

            /// Re-checks an id that was built without validation (e.g. decoded from a peer).
            ///
            /// # Errors
            /// The same as [`Self::new`].
            pub fn validate(&self) -> Result<(), IdError> {
                check_id($kind, &self.text)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.text)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.text)
            }
        }
    };
}

string_id!(
    /// An engine instance (one prefill or decode deployment unit), e.g. `"prefill-0"`.
    ///
    /// ```
    /// use kvhandoff_protocol::EngineId;
    /// let id = EngineId::new("decode-3").unwrap();
    /// assert_eq!(id.as_str(), "decode-3");
    /// assert!(EngineId::new("").is_err());
    /// ```
    EngineId,
    "engine id"
);

string_id!(
    /// An engine's own id of one request. P and D usually hold different request ids for the
    /// same logical request (vLLM appends a random 8-hex suffix on each side).
    RequestId,
    "request id"
);

string_id!(
    /// The key under which P and D find each other's half of one handoff.
    ///
    /// Built with [`PairingKey::from_transfer_id`] when the router supplies an explicit transfer
    /// id, or derived with [`PairingKey::from_request_id`] otherwise.
    ///
    /// ```
    /// use kvhandoff_protocol::{PairingKey, RequestId};
    /// let p = RequestId::new("cmpl-5b1c9a52-6f0e-4c1b-9a7e-0c4c3f2d1e00-0-aaaaaaaa").unwrap();
    /// let d = RequestId::new("cmpl-5b1c9a52-6f0e-4c1b-9a7e-0c4c3f2d1e00-0-BBBBBBBB").unwrap();
    /// assert_eq!(PairingKey::from_request_id(&p), PairingKey::from_request_id(&d));
    /// ```
    PairingKey,
    "pairing key"
);

string_id!(
    /// The NIXL agent name of one engine rank.
    AgentName,
    "agent name"
);

/// Length of the random suffix that engines append to a request id.
const RANDOM_SUFFIX_HEX_DIGITS: usize = 8;

impl PairingKey {
    /// The pairing key of an explicit, router-supplied transfer id: the id itself.
    ///
    /// # Errors
    /// [`IdError`] for an invalid id.
    pub fn from_transfer_id(transfer_id: &str) -> Result<Self, IdError> {
        Self::new(transfer_id)
    }

    /// The pairing key derived from an engine's request id: the id with one trailing
    /// `-` + 8 hex digits (either case) removed, if it has one.
    ///
    /// The completion index (`cmpl-<uuid>-0` vs `cmpl-<uuid>-1`) is kept, so different prompts
    /// of one batch never pair. The key is never empty: an id that is only a suffix keeps it.
    pub fn from_request_id(request_id: &RequestId) -> Self {
        let id = request_id.as_str();
        let suffix_len = 1 + RANDOM_SUFFIX_HEX_DIGITS;
        // The suffix is ASCII, so a split that would fall inside a multi-byte character means
        // there is no suffix (and `split_at` there would panic).
        if id.len() > suffix_len && id.is_char_boundary(id.len() - suffix_len) {
            let (base, suffix) = id.split_at(id.len() - suffix_len);
            let mut chars = suffix.chars();
            let dash = chars.next() == Some('-');
            if dash && chars.all(|c| c.is_ascii_hexdigit()) {
                return Self::wrap(Arc::from(base));
            }
        }
        Self {
            head: request_id.head,
            text: Arc::clone(&request_id.text),
        }
    }

    /// The key of one (P rank → D rank) sub-request of a multi-rank request: this key followed
    /// by `#p<source_rank>d<target_rank>`.
    ///
    /// A request whose D rank is fed by several P ranks (or whose P rank feeds several D ranks)
    /// is split into one ordinary 1:1 handoff per pair. Both sides derive the pair's key from
    /// the request's key and the two ranks alone, so they agree without talking, and the keys
    /// of different pairs never collide: the suffix holds no `#`, so the last `#` of a pair key
    /// splits it back into the request's key and the two ranks. A deployment that uses
    /// multi-rank requests must not use plain keys of that form.
    ///
    /// ```
    /// use kvhandoff_protocol::PairingKey;
    /// let key = PairingKey::new("cmpl-7").unwrap();
    /// assert_eq!(key.for_pair(3, 0).unwrap().as_str(), "cmpl-7#p3d0");
    /// assert_ne!(key.for_pair(1, 23).unwrap(), key.for_pair(12, 3).unwrap());
    /// ```
    ///
    /// # Errors
    /// [`IdError::TooLong`] when the pair's key would pass [`MAX_ID_LEN`] bytes.
    pub fn for_pair(&self, source_rank: u32, target_rank: u32) -> Result<PairingKey, IdError> {
        // Checked before building, so a long key costs no allocation of the too-long text.
        let digits = |n: u32| n.checked_ilog10().map_or(1, |d| d as usize + 1);
        let len = self.text.len() + "#pd".len() + digits(source_rank) + digits(target_rank);
        if len > MAX_ID_LEN {
            return Err(IdError::TooLong {
                kind: "pairing key",
                len,
            });
        }
        PairingKey::new(format!("{self}#p{source_rank}d{target_rank}"))
    }
}

/// One attempt at a handoff for a pairing key. Every retry of the same key uses a strictly
/// larger epoch, and a message for an older epoch than the one in force changes nothing.
///
/// ```
/// use kvhandoff_protocol::Epoch;
/// let first = Epoch::FIRST;
/// assert!(first.next() > Some(first));
/// ```
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch of the first attempt.
    pub const FIRST: Epoch = Epoch(1);

    /// The largest epoch an attempt may use. Epochs never saturate: every retry needs a
    /// strictly larger one, so an attempt past this bound is refused (a typed error at the
    /// engine's call) instead of reusing an epoch.
    pub const MAX: Epoch = Epoch(1 << 53);

    /// The epoch of the next attempt, or `None` past [`Epoch::MAX`].
    ///
    /// ```
    /// use kvhandoff_protocol::Epoch;
    /// assert_eq!(Epoch::FIRST.next(), Some(Epoch(2)));
    /// assert_eq!(Epoch::MAX.next(), None);
    /// ```
    #[must_use]
    pub fn next(self) -> Option<Epoch> {
        (self < Epoch::MAX).then(|| Epoch(self.0 + 1))
    }

    /// Whether an attempt may use this epoch (`1..=MAX`).
    pub fn is_valid(self) -> bool {
        self >= Epoch::FIRST && self <= Epoch::MAX
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

/// One run of a rank's process: a random 128-bit id (a UUID v4) made when the rank starts and
/// sent in every handshake it makes or answers.
///
/// It is what tells a late or repeated handshake from a restart: a handshake that repeats the
/// incarnation a rank is connected to changes nothing; one with another incarnation means the
/// old process is gone (its writes may still land until the fence ends, see
/// docs/architecture.md).
///
/// ```
/// use kvhandoff_protocol::Incarnation;
/// let a = Incarnation::random();
/// assert_ne!(a, Incarnation::random());
/// assert_eq!(a.to_string().len(), 36); // printed as a UUID
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Incarnation(pub u128);

impl Incarnation {
    /// A new random incarnation (UUID v4).
    pub fn random() -> Incarnation {
        Incarnation(uuid::Uuid::new_v4().as_u128())
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        uuid::Uuid::from_u128(self.0).hyphenated().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> PairingKey {
        PairingKey::from_request_id(&RequestId::new(id).unwrap())
    }

    const UUID_A: &str = "12345678-aaaa-bbbb-cccc-1234567890ab";
    const UUID_B: &str = "87654321-aaaa-bbbb-cccc-1234567890ab";

    #[test]
    fn random_suffixes_of_the_same_base_pair() {
        let p = key(&format!("cmpl-{UUID_A}-0-aaaaaaaa"));
        let d = key(&format!("cmpl-{UUID_A}-0-bbbbbbbb"));
        assert_eq!(p, d);
        assert_eq!(p.as_str(), format!("cmpl-{UUID_A}-0"));
    }

    #[test]
    fn suffix_is_case_insensitive() {
        assert_eq!(
            key(&format!("cmpl-{UUID_A}-0-ABCDEF01")),
            key(&format!("cmpl-{UUID_A}-0-abcdef01"))
        );
    }

    #[test]
    fn pair_keys_are_deterministic_distinct_and_bounded() {
        let a = PairingKey::new("k").unwrap();
        let b = PairingKey::new("k#p1d2").unwrap();
        assert_eq!(a.for_pair(1, 2), a.for_pair(1, 2));
        let mut seen = std::collections::BTreeSet::new();
        for key in [&a, &b] {
            for s in [0, 1, 2, 12, u32::MAX] {
                for t in [0, 1, 2, 12, u32::MAX] {
                    assert!(seen.insert(key.for_pair(s, t).unwrap()), "{key} {s} {t}");
                }
            }
        }
        // `b` is itself `a`'s key for pair (1, 2): its pairs stay apart from `a`'s.
        assert_eq!(a.for_pair(1, 2).unwrap(), b);
        let room = MAX_ID_LEN - "#p0d0".len();
        let fits = PairingKey::new("x".repeat(room)).unwrap();
        assert_eq!(fits.for_pair(0, 0).unwrap().as_str().len(), MAX_ID_LEN);
        assert_eq!(
            fits.for_pair(10, 0),
            Err(IdError::TooLong {
                kind: "pairing key",
                len: MAX_ID_LEN + 1
            })
        );
    }

    #[test]
    fn different_uuids_never_pair() {
        assert_ne!(
            key(&format!("cmpl-{UUID_A}-0-aaaaaaaa")),
            key(&format!("cmpl-{UUID_B}-0-aaaaaaaa"))
        );
    }

    #[test]
    fn completion_index_is_kept() {
        assert_ne!(
            key(&format!("cmpl-{UUID_A}-0-aaaaaaaa")),
            key(&format!("cmpl-{UUID_A}-1-aaaaaaaa"))
        );
    }

    #[test]
    fn only_one_suffix_is_removed() {
        assert_eq!(key("req-aaaaaaaa-bbbbbbbb").as_str(), "req-aaaaaaaa");
    }

    #[test]
    fn ids_without_a_hex_suffix_are_kept_whole() {
        for id in [
            "req-1",
            "req-aaaaaaa",   // 7 digits
            "req-aaaaaaaaa", // 9 digits: the last 8 follow a hex digit, not a dash
            "req-aaaaaaag",  // not hex
            "req_aaaaaaaa",  // no dash
            "-aaaaaaaa",     // nothing would be left
        ] {
            assert_eq!(key(id).as_str(), id, "{id}");
        }
    }

    #[test]
    fn non_ascii_ids_do_not_split_inside_a_character() {
        let id = "réquête-ünïcødé";
        assert_eq!(key(id).as_str(), id);
    }

    #[test]
    fn transfer_id_is_the_key_itself() {
        let k = PairingKey::from_transfer_id("xfer-42-aaaaaaaa").unwrap();
        assert_eq!(k.as_str(), "xfer-42-aaaaaaaa");
    }

    #[test]
    fn invalid_ids_are_refused_with_a_reason() {
        assert_eq!(
            RequestId::new(""),
            Err(IdError::Empty { kind: "request id" })
        );
        assert!(matches!(
            EngineId::new("x".repeat(MAX_ID_LEN + 1)),
            Err(IdError::TooLong { len, .. }) if len == MAX_ID_LEN + 1
        ));
        assert_eq!(
            PairingKey::new("a\nb"),
            Err(IdError::ControlCharacter {
                kind: "pairing key",
                at: 1
            })
        );
        assert!(EngineId::new("x".repeat(MAX_ID_LEN)).is_ok());
    }

    #[test]
    fn ids_order_compare_and_hash_as_their_text() {
        use std::collections::hash_map::DefaultHasher;
        let texts = [
            "a",
            "ab",
            "abc",
            "cmpl-0123456789abcdef",
            "cmpl-0123456789abcdef-0",
            "cmpl-0123456789abcdeg",
            "cmpl-0123456789abcdef-1",
            "cmpl-0123456789abcde",
            "z",
            "é",
            "0123456789abcdef",
            "0123456789abcdef0",
        ];
        let hash = |h: &dyn Fn(&mut DefaultHasher)| {
            let mut state = DefaultHasher::new();
            h(&mut state);
            state.finish()
        };
        for a in texts {
            for b in texts {
                let (ia, ib) = (RequestId::new(a).unwrap(), RequestId::new(b).unwrap());
                assert_eq!(ia.cmp(&ib), a.cmp(b), "{a} vs {b}");
                assert_eq!(ia == ib, a == b, "{a} vs {b}");
            }
            let id = PairingKey::new(a).unwrap();
            assert_eq!(hash(&|s| id.hash(s)), hash(&|s| a.to_owned().hash(s)));
            assert_eq!(format!("{id:?}"), format!("PairingKey({a:?})"));
        }
    }

    #[test]
    fn epochs_order_and_advance() {
        assert_eq!(Epoch::FIRST.next(), Some(Epoch(2)));
        assert_eq!(Epoch::MAX.next(), None);
        assert_eq!(Epoch(u64::MAX).next(), None);
        assert!(!Epoch(0).is_valid() && !Epoch(u64::MAX).is_valid() && Epoch::MAX.is_valid());
        assert_eq!(Epoch(7).to_string(), "e7");
    }
}
