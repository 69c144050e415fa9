//! [`RankSettings`]: every tunable of a rank an engine embeds — the protocol's [`Config`], the
//! connector's [`ConnectorSettings`] and the shells' [`ShellConfig`] — under one set of keys,
//! loadable from the `[rank]` table of a TOML file, from `KVHANDOFF_RANK_<KEY>` environment
//! variables and from key–value pairs (the Python connector's keyword settings and vLLM's
//! `kv_connector_extra_config` go through the same table), each value checked when it is read,
//! with an error naming the key and where it came from.
//!
//! The file is the one the `kvhandoff` command line reads (`kvhandoff.toml`): its `[rank]`
//! table belongs to the embedding API, its other tables to the subcommands, so one deployment
//! file configures both. Precedence, lowest first: the protocol's defaults, the file, the
//! environment, then whatever the engine sets in code.
//!
//! ```
//! use std::time::Duration;
//! use kvhandoff::{RankSettings, SettingValue};
//!
//! let text = r#"
//! [rank]
//! lease_ms = 5000
//! load_failure_policy = "recompute"
//! "#;
//! let mut settings = RankSettings::from_toml(text, "kvhandoff.toml")?;
//! settings.apply_env([("KVHANDOFF_RANK_QUARANTINE_MS".to_string(), "300000".to_string())])?;
//! settings.set("max_requests", SettingValue::Int(4096), "code")?;
//! let config = settings.config()?;
//! assert_eq!(config.lease_duration, Duration::from_secs(5));
//! assert_eq!(config.quarantine, Duration::from_secs(300));
//! // The lease is shorter than the default extension: the extension follows it.
//! assert_eq!(config.lease_extension, Duration::from_secs(5));
//!
//! let err = RankSettings::from_toml("[rank]\nleese_ms = 1", "kvhandoff.toml").unwrap_err();
//! assert!(err.to_string().contains("`leese_ms` is not a rank setting"));
//! # Ok::<(), kvhandoff::SettingsError>(())
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvhandoff_actors::system::ShellConfig;
use kvhandoff_protocol::machine::{Config, ConfigError, LoadFailurePolicy};
use kvhandoff_protocol::session::ConnectorSettings;
use kvhandoff_protocol::KvGeometry;

mod keys;
#[cfg(test)]
mod tests;

use keys::{choice, count, duration, flag, Setter, KEYS};

/// The table of a TOML file that [`RankSettings::from_toml`] reads.
pub const RANK_TABLE: &str = "rank";
/// The prefix of the environment variables [`RankSettings::apply_env`] reads.
pub const RANK_ENV_PREFIX: &str = "KVHANDOFF_RANK_";
/// The largest settings file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// One value of one setting, as a file, a variable or an engine's code gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum SettingValue {
    /// A whole number.
    Int(i64),
    /// A number with a fraction (durations only).
    Float(f64),
    /// `true` or `false`.
    Bool(bool),
    /// Text: a choice (`"recompute"`), or any value as written in an environment variable.
    Text(String),
}

impl std::fmt::Display for SettingValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingValue::Int(n) => write!(f, "{n}"),
            SettingValue::Float(x) => write!(f, "{x}"),
            SettingValue::Bool(b) => write!(f, "{b}"),
            SettingValue::Text(t) => write!(f, "{t:?}"),
        }
    }
}

/// Rank settings that cannot be used; each names the key and where its value came from.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// The file could not be read.
    #[error("cannot read the settings file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is over 1 MiB.
    #[error("the settings file {path} is {bytes} bytes; the limit is {MAX_FILE_BYTES}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
    },
    /// The text is not TOML, or its `[rank]` is not a table.
    #[error("{origin}: {why}")]
    Syntax {
        /// The file.
        origin: String,
        /// What is wrong.
        why: String,
    },
    /// A key names no setting.
    #[error("{origin}: `{key}` is not a rank setting (settings: {known})")]
    UnknownKey {
        /// Where the key was read.
        origin: String,
        /// The key.
        key: String,
        /// Every key there is.
        known: String,
    },
    /// A value its key does not take.
    #[error("{origin}: `{key}` = {value}: {why}")]
    BadValue {
        /// Where the value was read.
        origin: String,
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What the key takes.
        why: String,
    },
    /// Each value is fine but together they break a rule of the protocol.
    #[error("the rank settings contradict each other: {0}")]
    Invalid(#[from] ConfigError),
}

/// Every setting of one rank, with where each came from checked as it was read.
///
/// Start from [`RankSettings::default`] (the protocol's defaults), a file
/// ([`RankSettings::from_file`], [`RankSettings::from_toml`]) or both a file and the
/// environment ([`RankSettings::load`]); override in code with [`RankSettings::set`]; hand the
/// result to [`RankBuilder::settings`](crate::RankBuilder::settings).
#[derive(Debug, Clone, PartialEq)]
pub struct RankSettings {
    config: Config,
    shell: ShellConfig,
    load_failure_policy: LoadFailurePolicy,
    next_turn_ttl: Option<Duration>,
    recompute_threshold: Option<u64>,
    layerwise_parts: Option<u32>,
    layerwise_min_tokens: Option<u64>,
    /// The keys set so far (a lease shorter than the defaults of the others pulls them along
    /// unless they were set too).
    given: Vec<&'static str>,
}

impl Default for RankSettings {
    fn default() -> Self {
        RankSettings {
            config: Config::default(),
            shell: ShellConfig::default(),
            load_failure_policy: LoadFailurePolicy::Fail,
            next_turn_ttl: None,
            recompute_threshold: None,
            layerwise_parts: None,
            layerwise_min_tokens: None,
            given: Vec::new(),
        }
    }
}

impl RankSettings {
    /// Every key a rank setting takes, in the order of the documentation.
    pub fn keys() -> impl Iterator<Item = &'static str> {
        KEYS.iter().map(|(name, _)| *name)
    }

    /// The settings of the `[rank]` table of TOML `text` over the defaults; `origin` (a file
    /// name) is what errors name. See [`RankSettings::apply_toml`].
    pub fn from_toml(text: &str, origin: &str) -> Result<RankSettings, SettingsError> {
        let mut settings = RankSettings::default();
        settings.apply_toml(text, origin)?;
        Ok(settings)
    }

    /// [`RankSettings::from_toml`] on the file at `path` (at most 1 MiB).
    pub fn from_file(path: &Path) -> Result<RankSettings, SettingsError> {
        let mut settings = RankSettings::default();
        settings.apply_file(path)?;
        Ok(settings)
    }

    /// The file at `path` (when given), then this process's `KVHANDOFF_RANK_<KEY>` variables,
    /// over the defaults.
    pub fn load(path: Option<&Path>) -> Result<RankSettings, SettingsError> {
        let mut settings = RankSettings::default();
        if let Some(path) = path {
            settings.apply_file(path)?;
        }
        settings.apply_env(std::env::vars())?;
        Ok(settings)
    }

    /// Applies the `[rank]` table of TOML `text`; `origin` (a file name) is what errors name.
    /// Other tables are left alone (they configure the command line); a key of `[rank]` that
    /// names no setting is an error, and leaves these settings as they were.
    pub fn apply_toml(
        &mut self,
        text: &str,
        origin: &str,
    ) -> Result<&mut RankSettings, SettingsError> {
        let root: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| SettingsError::Syntax {
                    origin: origin.to_string(),
                    why: format!("not valid TOML: {}", e.message()),
                })?;
        let Some(table) = root.get(RANK_TABLE) else {
            return Ok(self);
        };
        let Some(table) = table.as_table() else {
            return Err(SettingsError::Syntax {
                origin: origin.to_string(),
                why: format!("`{RANK_TABLE}` must be a table ([{RANK_TABLE}])"),
            });
        };
        let origin = format!("{origin} [{RANK_TABLE}]");
        let mut next = self.clone();
        for (key, value) in table {
            let value = match value {
                toml::Value::Integer(n) => SettingValue::Int(*n),
                toml::Value::Float(x) => SettingValue::Float(*x),
                toml::Value::Boolean(b) => SettingValue::Bool(*b),
                toml::Value::String(s) => SettingValue::Text(s.clone()),
                other => {
                    return Err(SettingsError::BadValue {
                        origin,
                        key: key.clone(),
                        value: other.to_string(),
                        why: "must be a number, a boolean or a string".into(),
                    })
                }
            };
            next.set(key, value, &origin)?;
        }
        *self = next;
        Ok(self)
    }

    /// [`RankSettings::apply_toml`] on the file at `path` (at most 1 MiB).
    pub fn apply_file(&mut self, path: &Path) -> Result<&mut RankSettings, SettingsError> {
        let read = |source| SettingsError::Read {
            path: path.to_path_buf(),
            source,
        };
        let bytes = std::fs::metadata(path).map_err(read)?.len();
        if bytes > MAX_FILE_BYTES {
            return Err(SettingsError::TooLarge {
                path: path.to_path_buf(),
                bytes,
            });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        self.apply_toml(&text, &path.display().to_string())
    }

    /// Applies the `KVHANDOFF_RANK_<KEY>` variables among `vars` (`KEY` is a key in capitals:
    /// `KVHANDOFF_RANK_LEASE_MS=5000`). The prefix is the rank's alone, so a variable under it
    /// that names no setting is an error, as is a value its key does not take; flags take
    /// `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`. On an error these settings are left as
    /// they were.
    pub fn apply_env(
        &mut self,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<&mut RankSettings, SettingsError> {
        let mut vars: Vec<(String, String)> = vars
            .into_iter()
            .filter(|(name, _)| name.starts_with(RANK_ENV_PREFIX))
            .collect();
        // The environment's order is arbitrary; errors and contradictions should not be.
        vars.sort();
        let mut next = self.clone();
        for (name, value) in vars {
            let key = name[RANK_ENV_PREFIX.len()..].to_ascii_lowercase();
            let origin = format!("environment variable {name}");
            next.set(&key, SettingValue::Text(value), &origin)?;
        }
        *self = next;
        Ok(self)
    }

    /// Sets one key; `origin` is what an error names (a file, a variable, "code").
    pub fn set(
        &mut self,
        key: &str,
        value: SettingValue,
        origin: &str,
    ) -> Result<&mut RankSettings, SettingsError> {
        let Some(&(name, setter)) = KEYS.iter().find(|(name, _)| *name == key) else {
            return Err(SettingsError::UnknownKey {
                origin: origin.to_string(),
                key: key.to_string(),
                known: RankSettings::keys().collect::<Vec<_>>().join(", "),
            });
        };
        let bad = |why: String| SettingsError::BadValue {
            origin: origin.to_string(),
            key: key.to_string(),
            value: value.to_string(),
            why,
        };
        match setter {
            Setter::Duration(unit, set) => set(self, duration(&value, unit).map_err(bad)?),
            Setter::Count(min, max, set) => set(self, count(&value, min, max).map_err(bad)?),
            Setter::Flag(set) => set(self, flag(&value).map_err(bad)?),
            Setter::Choice(words, set) => set(self, choice(&value, words).map_err(bad)?),
        }
        if !self.given.contains(&name) {
            self.given.push(name);
        }
        Ok(self)
    }

    /// Whether `key` was set (by a file, a variable or [`RankSettings::set`]).
    pub fn is_set(&self, key: &str) -> bool {
        self.given.contains(&key)
    }

    /// The protocol's configuration, checked. A lease shorter than the default extension (or
    /// an extension no longer than the default heartbeat) pulls those along unless they were
    /// set too: the defaults would otherwise contradict it. Likewise a `handshake_timeout_ms`
    /// set without `connect_timeout_ms` is the endpoint's connect deadline too (and the other
    /// way round, see [`RankSettings::shell`]): one key sets how long a handshake may take.
    pub fn config(&self) -> Result<Config, SettingsError> {
        let mut config = self.config.clone();
        if !self.is_set("lease_extension_ms") && config.lease_extension > config.lease_duration {
            config.lease_extension = config.lease_duration;
        }
        if !self.is_set("heartbeat_interval_ms")
            && config.heartbeat_interval >= config.lease_extension
        {
            config.heartbeat_interval = config.lease_extension / 4;
        }
        // The endpoint gives up on a peer connection at `connect_timeout`: a longer handshake
        // budget alone would be cut short by it.
        if self.is_set("handshake_timeout_ms") && !self.is_set("connect_timeout_ms") {
            config.connect_timeout = self.shell.handshake_timeout;
        }
        config.validate()?;
        Ok(config)
    }

    /// The shells' tuning (the handshake timeout, the transport's poll interval). A
    /// `connect_timeout_ms` set without `handshake_timeout_ms` is the handshake's budget too.
    pub fn shell(&self) -> ShellConfig {
        let mut shell = self.shell.clone();
        if self.is_set("connect_timeout_ms") && !self.is_set("handshake_timeout_ms") {
            shell.handshake_timeout = self.config.connect_timeout;
        }
        shell
    }

    /// The connector's settings for a rank of `geometry` running `config` (from
    /// [`RankSettings::config`]).
    pub fn connector_settings(&self, config: &Config, geometry: &KvGeometry) -> ConnectorSettings {
        let mut settings = ConnectorSettings::new(config, geometry);
        settings.load_failure_policy = self.load_failure_policy;
        if let Some(ttl) = self.next_turn_ttl {
            settings.next_turn_ttl = ttl;
        }
        if let Some(threshold) = self.recompute_threshold {
            settings.recompute_threshold = threshold;
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
