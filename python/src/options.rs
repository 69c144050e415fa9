//! The connector's keyword settings. Every rank setting goes through the engine API's own key
//! table ([`RankSettings`]: the same keys as a file's `[rank]` table and the
//! `KVHANDOFF_RANK_<KEY>` variables); the Python shell adds its own keys ([`SHELL_KEYS`]).
//! Layers, lowest first: the protocol's defaults, `defaults`, `config_file`, the environment,
//! the keywords. An unknown key or an invalid value is a `ConfigError` naming the
//! key and where it came from.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};

use kvhandoff::{Config, ConnectorSettings, KvGeometry, RankSettings, SettingValue, ShellConfig};

use crate::errors::config;

/// The keys the Python shell reads itself, beside [`RankSettings::keys`]: its two timeouts,
/// a settings file (its `[rank]` table) and `defaults`, settings applied beneath the file and
/// the environment (an adapter's own defaults, which a deployment's file may override).
pub(crate) const SHELL_KEYS: [&str; 4] = [
    "call_timeout_ms",
    "close_timeout_ms",
    "config_file",
    "defaults",
];

/// The settings one connector starts with.
pub(crate) struct Options {
    pub config: Config,
    pub shell: ShellConfig,
    rank: RankSettings,
    pub call_timeout: Option<Duration>,
    pub close_timeout: Duration,
}

/// Where a keyword's errors say it came from.
const ORIGIN: &str = "keyword setting";

impl Options {
    /// Reads `kwargs` over `config_file` (when given) and the `KVHANDOFF_RANK_*` environment.
    pub(crate) fn from_kwargs(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Options> {
        let mut given = Vec::new();
        if let Some(kwargs) = kwargs {
            for (key, value) in kwargs.iter() {
                let key: String = key.extract()?;
                if !value.is_none() {
                    given.push((key, value));
                }
            }
        }
        let file = match given.iter().find(|(key, _)| key == "config_file") {
            Some((_, value)) => Some(
                value
                    .extract::<PathBuf>()
                    .map_err(|_| config("config_file must be a path"))?,
            ),
            None => None,
        };
        let mut rank = RankSettings::default();
        if let Some((_, defaults)) = given.iter().find(|(key, _)| key == "defaults") {
            let defaults = defaults
                .cast::<PyDict>()
                .map_err(|_| config("defaults must be a dict of settings"))?;
            for (key, value) in defaults.iter() {
                let key: String = key
                    .extract()
                    .map_err(|_| config("defaults: every key must be a str"))?;
                let value = setting_value(&key, &value)?;
                rank.set(&key, value, "defaults")
                    .map_err(|e| config(e.to_string()))?;
            }
        }
        if let Some(file) = &file {
            rank.apply_file(file).map_err(|e| config(e.to_string()))?;
        }
        rank.apply_env(std::env::vars())
            .map_err(|e| config(e.to_string()))?;
        let mut call_timeout = None;
        let mut close_timeout = Duration::from_secs(5);
        for (key, value) in &given {
            match key.as_str() {
                "config_file" | "defaults" => {}
                "call_timeout_ms" => call_timeout = Some(millis(key, value)?),
                "close_timeout_ms" => close_timeout = millis(key, value)?,
                _ => {
                    let value = setting_value(key, value)?;
                    rank.set(key, value, ORIGIN).map_err(|e| {
                        let mut text = e.to_string();
                        if let kvhandoff::SettingsError::UnknownKey { .. } = e {
                            text.push_str(&format!(
                                ", and the connector's {}",
                                SHELL_KEYS.join(", ")
                            ));
                        }
                        config(text)
                    })?;
                }
            }
        }
        let config_checked = rank
            .config()
            .map_err(|e| config(format!("invalid settings: {e}")))?;
        Ok(Options {
            config: config_checked,
            shell: rank.shell(),
            rank,
            call_timeout,
            close_timeout,
        })
    }

    /// The connector's settings for a rank of `geometry`.
    pub(crate) fn settings(&self, geometry: &KvGeometry) -> ConnectorSettings {
        self.rank.connector_settings(&self.config, geometry)
    }
}

/// A Python value as a setting's value (`bool` before `int`: Python's `True` is an `int`).
fn setting_value(key: &str, value: &Bound<'_, PyAny>) -> PyResult<SettingValue> {
    if value.is_instance_of::<PyBool>() {
        return Ok(SettingValue::Bool(value.extract()?));
    }
    if value.is_instance_of::<PyInt>() {
        let n: i64 = value
            .extract()
            .map_err(|_| config(format!("{ORIGIN}: `{key}` is out of range")))?;
        return Ok(SettingValue::Int(n));
    }
    if value.is_instance_of::<PyFloat>() {
        return Ok(SettingValue::Float(value.extract()?));
    }
    if value.is_instance_of::<PyString>() {
        return Ok(SettingValue::Text(value.extract()?));
    }
    Err(config(format!(
        "{ORIGIN}: `{key}` must be a number, a boolean or a string"
    )))
}

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
