//! The connector's keyword settings: each maps onto one field of the protocol's [`Config`], the
//! shell's handshake timeout or the connector's own settings, and is checked up front (an
//! unknown key or an invalid value is a `ConfigError` naming the key).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvhandoff::LoadFailurePolicy;
use kvhandoff::{Config, ConnectorSettings, KvGeometry};

use crate::errors::config;

/// The settings one connector starts with.
pub(crate) struct Options {
    pub config: Config,
    pub handshake_timeout: Option<Duration>,
    pub call_timeout: Option<Duration>,
    pub close_timeout: Duration,
    pub load_failure_policy: LoadFailurePolicy,
    pub next_turn_ttl: Option<Duration>,
    /// Layer-wise push: parts per request (`None`: the connector's default).
    pub layerwise_parts: Option<u32>,
    /// Layer-wise push: prompts shorter than this go as one part (`None`: the default).
    pub layerwise_min_tokens: Option<u64>,
}

/// Durations in milliseconds, by key, and the config field each sets.
const MILLISECOND_KEYS: &[&str] = &[
    "lease_ms",
    "lease_extension_ms",
    "heartbeat_interval_ms",
    "peer_timeout_ms",
    "connect_timeout_ms",
    "decode_deadline_ms",
    "registration_ttl_ms",
    "write_timeout_ms",
    "abandon_timeout_ms",
    "max_write_life_ms",
    "max_message_delay_ms",
    "quarantine_ms",
    "tombstone_ttl_ms",
    "handshake_timeout_ms",
    "call_timeout_ms",
    "close_timeout_ms",
];

fn millis(key: &str, value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let ms: f64 = value
        .extract()
        .map_err(|_| config(format!("{key} must be a number of milliseconds")))?;
    if !ms.is_finite() || ms <= 0.0 || ms > 1.0e10 {
        return Err(config(format!(
            "{key} must be positive and finite (got {ms})"
        )));
    }
    Ok(Duration::from_secs_f64(ms / 1000.0))
}

impl Options {
    /// Reads `kwargs` (the keys above, `load_failure_policy`, `next_turn_ttl_s`,
    /// `max_requests`, `layerwise_parts`, `layerwise_min_tokens`); the protocol's defaults for
    /// the rest.
    pub(crate) fn from_kwargs(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Options> {
        let mut options = Options {
            config: Config::default(),
            handshake_timeout: None,
            call_timeout: None,
            close_timeout: Duration::from_secs(5),
            load_failure_policy: LoadFailurePolicy::Fail,
            next_turn_ttl: None,
            layerwise_parts: None,
            layerwise_min_tokens: None,
        };
        let Some(kwargs) = kwargs else {
            return Ok(options);
        };
        let mut given = Vec::new();
        for (key, value) in kwargs.iter() {
            let key: String = key.extract()?;
            if value.is_none() {
                continue;
            }
            given.push(key.clone());
            if MILLISECOND_KEYS.contains(&key.as_str()) {
                let d = millis(&key, &value)?;
                let c = &mut options.config;
                match key.as_str() {
                    "lease_ms" => c.lease_duration = d,
                    "lease_extension_ms" => c.lease_extension = d,
                    "heartbeat_interval_ms" => c.heartbeat_interval = d,
                    "peer_timeout_ms" => c.peer_timeout = d,
                    "connect_timeout_ms" => c.connect_timeout = d,
                    "decode_deadline_ms" => c.decode_deadline = d,
                    "registration_ttl_ms" => c.registration_ttl = d,
                    "write_timeout_ms" => c.write_timeout = d,
                    "abandon_timeout_ms" => c.abandon_timeout = d,
                    "max_write_life_ms" => c.max_write_life = d,
                    "max_message_delay_ms" => c.max_message_delay = d,
                    "quarantine_ms" => c.quarantine = d,
                    "tombstone_ttl_ms" => c.tombstone_ttl = d,
                    "handshake_timeout_ms" => options.handshake_timeout = Some(d),
                    "call_timeout_ms" => options.call_timeout = Some(d),
                    _ => options.close_timeout = d,
                }
                continue;
            }
            match key.as_str() {
                "load_failure_policy" => {
                    let text: String = value.extract().map_err(|_| {
                        config("load_failure_policy must be \"fail\" or \"recompute\"")
                    })?;
                    options.load_failure_policy = match text.as_str() {
                        "fail" => LoadFailurePolicy::Fail,
                        "recompute" => LoadFailurePolicy::Recompute,
                        other => {
                            return Err(config(format!(
                                "load_failure_policy must be \"fail\" or \"recompute\" (got {other:?})"
                            )))
                        }
                    };
                }
                "next_turn_ttl_s" => {
                    options.next_turn_ttl = Some(millis(&key, &value)? * 1000);
                }
                "max_requests" => {
                    let n: usize = value
                        .extract()
                        .map_err(|_| config("max_requests must be a positive int"))?;
                    if n == 0 {
                        return Err(config("max_requests must be a positive int"));
                    }
                    options.config.max_requests = n;
                }
                "layerwise_parts" => {
                    let n: u32 = value
                        .extract()
                        .map_err(|_| config("layerwise_parts must be a positive int"))?;
                    if n == 0 {
                        return Err(config("layerwise_parts must be a positive int"));
                    }
                    options.layerwise_parts = Some(n);
                }
                "layerwise_min_tokens" => {
                    let n: u64 = value.extract().map_err(|_| {
                        config("layerwise_min_tokens must be an int, 0 or more")
                    })?;
                    options.layerwise_min_tokens = Some(n);
                }
                other => {
                    return Err(config(format!(
                        "unknown setting {other:?} (known: {}, load_failure_policy, next_turn_ttl_s, max_requests, layerwise_parts, layerwise_min_tokens)",
                        MILLISECOND_KEYS.join(", ")
                    )))
                }
            }
        }
        // A lease shorter than the default extension (or heartbeat) makes the defaults
        // contradict it; follow the lease unless the caller set them too.
        let set = |key: &str| given.iter().any(|k| k == key);
        let c = &mut options.config;
        if !set("lease_extension_ms") && c.lease_extension > c.lease_duration {
            c.lease_extension = c.lease_duration;
        }
        if !set("heartbeat_interval_ms") && c.heartbeat_interval >= c.lease_extension {
            c.heartbeat_interval = c.lease_extension / 4;
        }
        options
            .config
            .validate()
            .map_err(|e| config(format!("invalid settings: {e}")))?;
        Ok(options)
    }

    /// The connector's settings for a rank of `geometry`.
    pub(crate) fn settings(&self, geometry: &KvGeometry) -> ConnectorSettings {
        let mut settings = ConnectorSettings::new(&self.config, geometry);
        settings.load_failure_policy = self.load_failure_policy;
        if let Some(ttl) = self.next_turn_ttl {
            settings.next_turn_ttl = ttl;
        }
        if let Some(parts) = self.layerwise_parts {
            settings.layerwise_parts = parts;
        }
        if let Some(tokens) = self.layerwise_min_tokens {
            settings.layerwise_min_tokens = tokens;
        }
        settings
    }
}
