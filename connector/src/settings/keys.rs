//! The key table of [`RankSettings`]: every key, the kind of value it takes and the field it
//! sets, with the checks that turn a file's, a variable's or code's value into that field. Kept
//! apart so that adding a key touches only this table, not the loading and merging logic.

use std::time::Duration;

use kvhandoff_protocol::machine::{BlockPairing, Config, LoadFailurePolicy};

use super::{RankSettings, SettingValue};

/// The unit a duration key is given in.
#[derive(Debug, Clone, Copy)]
pub(super) enum Unit {
    Seconds,
    Millis,
    Micros,
}

/// What a key takes, and where the value goes.
#[derive(Clone, Copy)]
pub(super) enum Setter {
    /// A positive, finite duration, at most 30 days.
    Duration(Unit, fn(&mut RankSettings, Duration)),
    /// A whole number from `min` to `max`.
    Count(u64, u64, fn(&mut RankSettings, u64)),
    /// `true` or `false`.
    Flag(fn(&mut RankSettings, bool)),
    /// One of these words (the setter gets its index).
    Choice(&'static [&'static str], fn(&mut RankSettings, usize)),
}

const MS: Unit = Unit::Millis;
/// The most retries a retry count takes.
const RETRIES: u64 = Config::MAX_RETRIES as u64;
/// The largest table bound a key takes.
const BOUND: u64 = 1 << 24;
/// The largest token count a key takes.
const TOKENS: u64 = 1 << 40;

/// Every key and what it takes. The names of durations carry their unit; they are the names
/// the Python connector has always taken.
pub(super) const KEYS: &[(&str, Setter)] = &[
    (
        "lease_ms",
        Setter::Duration(MS, |s, d| s.config.lease_duration = d),
    ),
    (
        "lease_extension_ms",
        Setter::Duration(MS, |s, d| s.config.lease_extension = d),
    ),
    (
        "heartbeat_interval_ms",
        Setter::Duration(MS, |s, d| s.config.heartbeat_interval = d),
    ),
    (
        "peer_timeout_ms",
        Setter::Duration(MS, |s, d| s.config.peer_timeout = d),
    ),
    (
        "connect_timeout_ms",
        Setter::Duration(MS, |s, d| s.config.connect_timeout = d),
    ),
    (
        "decode_deadline_ms",
        Setter::Duration(MS, |s, d| s.config.decode_deadline = d),
    ),
    (
        "registration_ttl_ms",
        Setter::Duration(MS, |s, d| s.config.registration_ttl = d),
    ),
    (
        "write_timeout_ms",
        Setter::Duration(MS, |s, d| s.config.write_timeout = d),
    ),
    (
        "abandon_timeout_ms",
        Setter::Duration(MS, |s, d| s.config.abandon_timeout = d),
    ),
    (
        "max_write_life_ms",
        Setter::Duration(MS, |s, d| s.config.max_write_life = d),
    ),
    (
        "max_message_delay_ms",
        Setter::Duration(MS, |s, d| s.config.max_message_delay = d),
    ),
    (
        "register_retry_interval_ms",
        Setter::Duration(MS, |s, d| s.config.register_retry_interval = d),
    ),
    (
        "max_register_retries",
        Setter::Count(0, RETRIES, |s, n| s.config.max_register_retries = narrow(n)),
    ),
    (
        "cancel_retry_interval_ms",
        Setter::Duration(MS, |s, d| s.config.cancel_retry_interval = d),
    ),
    (
        "max_cancel_retries",
        Setter::Count(0, RETRIES, |s, n| s.config.max_cancel_retries = narrow(n)),
    ),
    (
        "quarantine_ms",
        Setter::Duration(MS, |s, d| s.config.quarantine = d),
    ),
    (
        "tombstone_ttl_ms",
        Setter::Duration(MS, |s, d| s.config.tombstone_ttl = d),
    ),
    (
        "max_requests",
        Setter::Count(1, BOUND, |s, n| s.config.max_requests = widen(n)),
    ),
    (
        "max_pending_registrations",
        Setter::Count(1, BOUND, |s, n| {
            s.config.max_pending_registrations = widen(n)
        }),
    ),
    (
        "max_tombstones",
        Setter::Count(1, BOUND, |s, n| s.config.max_tombstones = widen(n)),
    ),
    (
        "max_peers",
        Setter::Count(1, BOUND, |s, n| s.config.max_peers = widen(n)),
    ),
    (
        "max_queued_per_peer",
        Setter::Count(1, BOUND, |s, n| s.config.max_queued_per_peer = widen(n)),
    ),
    (
        "read_chunk_blocks",
        Setter::Count(1, 1 << 20, |s, n| s.config.read_chunk_blocks = narrow(n)),
    ),
    (
        "block_pairing",
        Setter::Choice(&["tail_aligned", "as_given"], |s, i| {
            s.config.block_pairing = [BlockPairing::TailAligned, BlockPairing::AsGiven][i]
        }),
    ),
    (
        "integrity_digest",
        Setter::Flag(|s, b| s.config.integrity_digest = b),
    ),
    (
        "handshake_timeout_ms",
        Setter::Duration(MS, |s, d| s.shell.handshake_timeout = d),
    ),
    (
        "poll_interval_us",
        Setter::Duration(Unit::Micros, |s, d| s.shell.poll_interval = d),
    ),
    (
        "load_failure_policy",
        Setter::Choice(&["fail", "recompute"], |s, i| {
            s.load_failure_policy = [LoadFailurePolicy::Fail, LoadFailurePolicy::Recompute][i]
        }),
    ),
    (
        "next_turn_ttl_s",
        Setter::Duration(Unit::Seconds, |s, d| s.next_turn_ttl = Some(d)),
    ),
    (
        "recompute_threshold",
        Setter::Count(0, TOKENS, |s, n| s.recompute_threshold = Some(n)),
    ),
    (
        "layerwise_parts",
        Setter::Count(1, 1 << 16, |s, n| s.layerwise_parts = Some(narrow(n))),
    ),
    (
        "layerwise_min_tokens",
        Setter::Count(0, TOKENS, |s, n| s.layerwise_min_tokens = Some(n)),
    ),
];

/// A count checked against bounds that fit in u32.
fn narrow(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A count checked against bounds that fit in usize.
fn widen(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

pub(super) fn count(value: &SettingValue, min: u64, max: u64) -> Result<u64, String> {
    let n = match value {
        SettingValue::Int(n) => u64::try_from(*n).ok(),
        SettingValue::Text(t) => t.trim().parse::<u64>().ok(),
        SettingValue::Float(_) | SettingValue::Bool(_) => None,
    };
    n.filter(|n| (min..=max).contains(n))
        .ok_or_else(|| format!("must be a whole number from {min} to {max}"))
}

pub(super) fn flag(value: &SettingValue) -> Result<bool, String> {
    let why = || "must be true or false".to_string();
    match value {
        SettingValue::Bool(b) => Ok(*b),
        SettingValue::Text(t) => match t.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(why()),
        },
        SettingValue::Int(_) | SettingValue::Float(_) => Err(why()),
    }
}

pub(super) fn choice(value: &SettingValue, words: &[&str]) -> Result<usize, String> {
    let text = match value {
        SettingValue::Text(t) => Some(t.trim()),
        SettingValue::Int(_) | SettingValue::Float(_) | SettingValue::Bool(_) => None,
    };
    text.and_then(|t| words.iter().position(|w| *w == t))
        .ok_or_else(|| format!("must be one of {}", words.join(", ")))
}

/// A positive, finite duration of at most [`Config::MAX_DURATION`], given in `unit`s.
pub(super) fn duration(value: &SettingValue, unit: Unit) -> Result<Duration, String> {
    let (unit_secs, name) = match unit {
        Unit::Seconds => (1.0, "seconds"),
        Unit::Millis => (1e-3, "milliseconds"),
        Unit::Micros => (1e-6, "microseconds"),
    };
    let amount = match value {
        SettingValue::Int(n) => Some(*n as f64),
        SettingValue::Float(x) => Some(*x),
        SettingValue::Text(t) => t.trim().parse::<f64>().ok(),
        SettingValue::Bool(_) => None,
    };
    let max = Config::MAX_DURATION.as_secs_f64() / unit_secs;
    amount
        .filter(|x| x.is_finite() && *x > 0.0 && *x <= max)
        .map(|x| Duration::from_secs_f64(x * unit_secs))
        .ok_or_else(|| format!("must be a positive number of {name}, at most {max} (30 days)"))
}
