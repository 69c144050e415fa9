//! One configuration for every subcommand: a TOML file (`--config FILE`, or `KVHANDOFF_CONFIG`),
//! environment variables (`KVHANDOFF_<SUBCOMMAND>_<KEY>`) and, for `node`, vLLM's
//! `--kv-transfer-config` JSON, layered under the command line.
//!
//! Every key is a long option of the subcommand it configures (`max-prompt-tokens` or
//! `max_prompt_tokens`), so the file, the environment and the flags cannot drift apart: the
//! layers become the options' defaults before clap parses, and clap's own value parsers judge
//! them, up front, with an error naming the file and key (or the variable) that carried the
//! value. Precedence, lowest first: built-in default, file, `--kv-transfer-config`, environment,
//! command line.
//!
//! The file is strict (a key or table that names no option is an error, since a typo there
//! would otherwise be silently ignored); the environment is lenient about names (a
//! `KVHANDOFF_…` variable that names no option is ignored: the prefix is shared with the test
//! script's own settings) but strict about values.
//!
//! ```toml
//! [node]
//! role = "decode"
//! listen = "127.0.0.1:5601"
//! peer = "127.0.0.1:5600"
//! requests = 200
//!
//! [bench.transfer]
//! json = true
//! ```
//!
//! Why no configuration crate (`figment`, `config`): their layers produce a struct, and the
//! struct here is clap's; merging into clap's defaults keeps one parser and one help text.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, Command};

#[cfg(test)]
mod tests;

/// The environment variable naming the configuration file when `--config` is not given.
pub(crate) const CONFIG_VAR: &str = "KVHANDOFF_CONFIG";
/// The prefix of the environment variables that set options.
const ENV_PREFIX: &str = "KVHANDOFF_";
/// The largest configuration file read.
const MAX_FILE_BYTES: u64 = 1 << 20;
/// The largest `--kv-transfer-config` accepted.
const MAX_VLLM_JSON_BYTES: usize = 64 << 10;
/// The connector class name vLLM is given for kvhandoff (`python/kvhandoff/vllm.py`).
const VLLM_CONNECTOR: &str = "KvHandoffConnector";
/// `KVTransferConfig` fields that mean nothing to a node (vLLM's own or other connectors').
const VLLM_FIELDS_IGNORED: [&str; 10] = [
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
];
/// Options no layer may set: they select the layers or only print.
const NOT_CONFIGURABLE: [&str; 4] = ["config", "help", "version", "kv-transfer-config"];

/// A configuration that cannot be used; each names where the bad value came from.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("the configuration file {path} is {bytes} bytes; the limit is {MAX_FILE_BYTES}")]
    TooLarge { path: PathBuf, bytes: u64 },
    /// The file is not TOML.
    #[error("the configuration file {path} is not valid TOML: {why}")]
    Syntax { path: PathBuf, why: String },
    /// A table of the file names no subcommand.
    #[error("{origin}: [{table}] names no subcommand (subcommands: {known})")]
    UnknownTable {
        origin: String,
        table: String,
        known: String,
    },
    /// A key names no option of its subcommand.
    #[error("{origin}: `{key}` is not an option of `kvhandoff {command}` (options: {known})")]
    UnknownKey {
        origin: String,
        command: String,
        key: String,
        known: String,
    },
    /// A key's value has a type no option takes (a table, a date).
    #[error("{origin}: `{key}` must be a string, a number, a boolean or an array of them")]
    BadType { origin: String, key: String },
    /// A value the option's parser refuses.
    #[error("{origin}: `{key}` = {value:?}: {why}")]
    BadValue {
        origin: String,
        key: String,
        value: String,
        why: String,
    },
    /// The file's `[rank]` table (the embedding API's settings) is wrong.
    #[error(transparent)]
    Rank(#[from] kvhandoff::SettingsError),
    /// `--kv-transfer-config` cannot configure a node.
    #[error("--kv-transfer-config: {0}")]
    Vllm(String),
}

/// One value for one option, and where it came from.
#[derive(Debug, Clone, PartialEq)]
struct Setting {
    origin: String,
    key: String,
    values: Vec<String>,
    /// From the environment: unknown names are skipped, flags take 1/0/yes/no/on/off too.
    lenient: bool,
}

/// Applies the configuration layers to `command` for the subcommand `argv` runs: the layers'
/// values become that subcommand's option defaults. `env` is the process environment.
pub(crate) fn configure(
    command: Command,
    argv: &[OsString],
    env: &[(String, String)],
) -> Result<Command, ConfigError> {
    let path = subcommand_path(&command, argv);
    let Some(leaf) = find(&command, &path) else {
        return Ok(command);
    };
    let file = option_value(argv, "--config")
        .map(PathBuf::from)
        .or_else(|| {
            env.iter()
                .find(|(k, _)| k == CONFIG_VAR)
                .map(|(_, v)| PathBuf::from(v))
        });
    let mut settings = Vec::new();
    if let Some(file) = file {
        settings.extend(file_settings(&command, &path, &file)?);
    }
    if path == ["node"] {
        if let Some(json) = option_value(argv, "--kv-transfer-config") {
            settings.extend(vllm_settings(&json.to_string_lossy())?);
        }
    }
    settings.extend(env_settings(&path, env));
    let defaults = resolve(leaf, &path, settings)?;
    if defaults.is_empty() {
        return Ok(command);
    }
    Ok(apply(command, &path, &defaults))
}

/// The subcommands `argv` names, outermost first (`["bench", "transfer"]`).
fn subcommand_path(command: &Command, argv: &[OsString]) -> Vec<String> {
    let mut path = Vec::new();
    let mut current = command;
    let mut args = argv.iter().skip(1);
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        if text == "--config" {
            args.next();
            continue;
        }
        if text.starts_with('-') {
            continue;
        }
        match current.find_subcommand(text.as_ref()) {
            Some(sub) => {
                path.push(sub.get_name().to_string());
                current = sub;
            }
            None => break,
        }
    }
    path
}

fn find<'a>(command: &'a Command, path: &[String]) -> Option<&'a Command> {
    let mut current = command;
    for name in path {
        current = current.find_subcommand(name)?;
    }
    (!path.is_empty() && !current.has_subcommands()).then_some(current)
}

/// The value of `--name VALUE` or `--name=VALUE` in `argv`, the last one given.
fn option_value(argv: &[OsString], name: &str) -> Option<OsString> {
    let mut found = None;
    let mut args = argv.iter().skip(1);
    let with_equals = format!("{name}=");
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        if text == name {
            found = args.next().cloned();
        } else if let Some(value) = text.strip_prefix(&with_equals) {
            found = Some(value.into());
        } else if text == "--" {
            break;
        }
    }
    found
}

/// The settings the file holds for the subcommand at `path`; every table and key of the file
/// must name a subcommand and an option (of any subcommand, checked for the one that runs).
fn file_settings(
    command: &Command,
    path: &[String],
    file: &Path,
) -> Result<Vec<Setting>, ConfigError> {
    let read_error = |source| ConfigError::Read {
        path: file.to_path_buf(),
        source,
    };
    let bytes = std::fs::metadata(file).map_err(read_error)?.len();
    if bytes > MAX_FILE_BYTES {
        return Err(ConfigError::TooLarge {
            path: file.to_path_buf(),
            bytes,
        });
    }
    let text = std::fs::read_to_string(file).map_err(read_error)?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Syntax {
            path: file.to_path_buf(),
            why: e.message().to_string(),
        })?;
    let origin = file.display().to_string();
    // `[rank]` is the embedding API's (`kvhandoff::RankSettings`), read by engines and the
    // Python connector from the same file; checked here too, so a typo in it fails every
    // command that reads the file rather than only the engine.
    kvhandoff::RankSettings::from_toml(&text, &origin)?;
    let mut found = Vec::new();
    walk_tables(command, &table, &mut Vec::new(), &origin, path, &mut found)?;
    Ok(found)
}

/// Checks `table` (the part of the file for the subcommand at `at`) and collects the settings
/// of the subcommand that runs (`wanted`).
fn walk_tables(
    command: &Command,
    table: &toml::Table,
    at: &mut Vec<String>,
    origin: &str,
    wanted: &[String],
    found: &mut Vec<Setting>,
) -> Result<(), ConfigError> {
    for (key, value) in table {
        if at.is_empty() && key == kvhandoff::RANK_TABLE {
            continue;
        }
        let sub = command.find_subcommand(key.as_str());
        match (value, sub) {
            (toml::Value::Table(inner), Some(sub)) => {
                at.push(sub.get_name().to_string());
                walk_tables(sub, inner, at, origin, wanted, found)?;
                at.pop();
            }
            (toml::Value::Table(_), None) => {
                let mut names = at.clone();
                names.push(key.clone());
                return Err(ConfigError::UnknownTable {
                    origin: origin.to_string(),
                    table: names.join("."),
                    known: subcommand_names(command),
                });
            }
            (value, _) => {
                if at.is_empty() || command.has_subcommands() {
                    return Err(ConfigError::UnknownTable {
                        origin: origin.to_string(),
                        table: key.clone(),
                        known: subcommand_names(command),
                    });
                }
                let values = toml_values(value).ok_or_else(|| ConfigError::BadType {
                    origin: format!("{origin} [{}]", at.join(".")),
                    key: key.clone(),
                })?;
                let setting = Setting {
                    origin: format!("{origin} [{}]", at.join(".")),
                    key: key.clone(),
                    values,
                    lenient: false,
                };
                // Keys of other subcommands are checked too: a typo there is as wrong.
                arg_in(command, at, &setting)?;
                if at.as_slice() == wanted {
                    found.push(setting);
                }
            }
        }
    }
    Ok(())
}

fn subcommand_names(command: &Command) -> String {
    let names: Vec<&str> = command
        .get_subcommands()
        .map(|s| s.get_name())
        .filter(|n| *n != "help")
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

fn toml_values(value: &toml::Value) -> Option<Vec<String>> {
    let one = |v: &toml::Value| match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(_) | toml::Value::Array(_) | toml::Value::Table(_) => None,
    };
    match value {
        toml::Value::Array(items) => items.iter().map(one).collect(),
        other => one(other).map(|v| vec![v]),
    }
}

/// `KVHANDOFF_<PATH>_<KEY>` variables for the subcommand at `path` (`KVHANDOFF_NODE_REQUESTS`,
/// `KVHANDOFF_BENCH_TRANSFER_JSON`).
fn env_settings(path: &[String], env: &[(String, String)]) -> Vec<Setting> {
    let prefix = format!(
        "{ENV_PREFIX}{}_",
        path.join("_").to_ascii_uppercase().replace('-', "_")
    );
    let mut found: Vec<Setting> = env
        .iter()
        .filter_map(|(name, value)| {
            let key = name.strip_prefix(&prefix)?;
            Some(Setting {
                origin: format!("environment variable {name}"),
                key: key.to_ascii_lowercase(),
                values: vec![value.clone()],
                lenient: true,
            })
        })
        .collect();
    // The environment has no order; make the layering deterministic.
    found.sort_by(|a, b| a.origin.cmp(&b.origin));
    found
}

/// vLLM's `--kv-transfer-config` for a node: `kv_role` picks the role, and
/// `kv_connector_extra_config` holds node options under the file's keys.
fn vllm_settings(json: &str) -> Result<Vec<Setting>, ConfigError> {
    if json.len() > MAX_VLLM_JSON_BYTES {
        return Err(ConfigError::Vllm(format!(
            "{} bytes; the limit is {MAX_VLLM_JSON_BYTES}",
            json.len()
        )));
    }
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| ConfigError::Vllm(format!("not JSON: {e}")))?;
    let serde_json::Value::Object(fields) = value else {
        return Err(ConfigError::Vllm("not a JSON object".into()));
    };
    let mut settings = Vec::new();
    let origin = "--kv-transfer-config".to_string();
    for (field, value) in &fields {
        match field.as_str() {
            "kv_connector" => match value {
                serde_json::Value::Null => {}
                serde_json::Value::String(name) if name == VLLM_CONNECTOR => {}
                other => {
                    return Err(ConfigError::Vllm(format!(
                        "kv_connector is {other}; a kvhandoff node is \"{VLLM_CONNECTOR}\""
                    )))
                }
            },
            "kv_role" => {
                let role = match value.as_str() {
                    Some("kv_producer") => "prefill",
                    Some("kv_consumer") => "decode",
                    Some("kv_both") => {
                        return Err(ConfigError::Vllm(
                            "kv_role \"kv_both\": a node runs one role; give kv_producer or \
                             kv_consumer"
                                .into(),
                        ))
                    }
                    _ => {
                        return Err(ConfigError::Vllm(format!(
                            "kv_role is {value}; expected \"kv_producer\" or \"kv_consumer\""
                        )))
                    }
                };
                settings.push(Setting {
                    origin: format!("{origin} kv_role"),
                    key: "role".into(),
                    values: vec![role.into()],
                    lenient: false,
                });
            }
            "kv_connector_extra_config" => {
                let serde_json::Value::Object(extra) = value else {
                    return Err(ConfigError::Vllm(
                        "kv_connector_extra_config is not an object".into(),
                    ));
                };
                for (key, value) in extra {
                    let values = json_values(value).ok_or_else(|| ConfigError::BadType {
                        origin: format!("{origin} kv_connector_extra_config"),
                        key: key.clone(),
                    })?;
                    settings.push(Setting {
                        origin: format!("{origin} kv_connector_extra_config"),
                        key: key.clone(),
                        values,
                        lenient: false,
                    });
                }
            }
            ignored if VLLM_FIELDS_IGNORED.contains(&ignored) => {}
            unknown => {
                return Err(ConfigError::Vllm(format!(
                    "`{unknown}` is not a field of vLLM's KVTransferConfig"
                )))
            }
        }
    }
    Ok(settings)
}

fn json_values(value: &serde_json::Value) -> Option<Vec<String>> {
    let one = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        serde_json::Value::Null | serde_json::Value::Array(_) | serde_json::Value::Object(_) => {
            None
        }
    };
    match value {
        serde_json::Value::Array(items) => items.iter().map(one).collect(),
        other => one(other).map(|v| vec![v]),
    }
}

/// The option `setting` names in `command`, the subcommand at `path`.
fn arg_in<'a>(
    command: &'a Command,
    path: &[String],
    setting: &Setting,
) -> Result<&'a Arg, ConfigError> {
    let long = setting.key.replace('_', "-");
    command
        .get_arguments()
        .find(|a| a.get_long() == Some(long.as_str()) && !NOT_CONFIGURABLE.contains(&long.as_str()))
        .ok_or_else(|| ConfigError::UnknownKey {
            origin: setting.origin.clone(),
            command: path.join(" "),
            key: setting.key.clone(),
            known: command
                .get_arguments()
                .filter_map(Arg::get_long)
                .filter(|l| !NOT_CONFIGURABLE.contains(l))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Checks every setting against its option's parser; the last layer's value of each option
/// wins. Returns (option id, values).
fn resolve(
    command: &Command,
    path: &[String],
    settings: Vec<Setting>,
) -> Result<Vec<(String, Vec<String>)>, ConfigError> {
    let mut defaults: Vec<(String, Vec<String>)> = Vec::new();
    for mut setting in settings {
        let arg = match arg_in(command, path, &setting) {
            Ok(arg) => arg,
            Err(_) if setting.lenient => continue,
            Err(e) => return Err(e),
        };
        let flag = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
        if flag && setting.lenient {
            for value in &mut setting.values {
                *value = match value.to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" | "on" => "true".into(),
                    "0" | "false" | "no" | "off" | "" => "false".into(),
                    _ => value.clone(),
                };
            }
        }
        let many = matches!(arg.get_action(), ArgAction::Append)
            || arg.get_num_args().is_some_and(|n| n.max_values() > 1);
        if setting.values.len() != 1 && !many {
            return Err(ConfigError::BadValue {
                origin: setting.origin,
                key: setting.key,
                value: setting.values.join(", "),
                why: "takes one value".into(),
            });
        }
        for value in &setting.values {
            check_value(arg, value).map_err(|why| ConfigError::BadValue {
                origin: setting.origin.clone(),
                key: setting.key.clone(),
                value: value.clone(),
                why,
            })?;
        }
        let id = arg.get_id().to_string();
        defaults.retain(|(known, _)| *known != id);
        defaults.push((id, setting.values));
    }
    Ok(defaults)
}

/// Runs the option's own value parser on `value` (in a command of that option alone, since
/// clap keeps a parser's entry point to itself).
fn check_value(arg: &Arg, value: &str) -> Result<(), String> {
    if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return match value {
            "true" | "false" => Ok(()),
            _ => Err("a flag takes true or false".into()),
        };
    }
    let Some(long) = arg.get_long() else {
        return Ok(());
    };
    let probe = Command::new("kvhandoff").no_binary_name(true).arg(
        Arg::new(arg.get_id().clone())
            .long(long.to_string())
            .value_parser(arg.get_value_parser().clone()),
    );
    probe
        .try_get_matches_from([format!("--{long}={value}")])
        .map(drop)
        .map_err(|e| {
            let text = e.to_string();
            let line = text.lines().next().unwrap_or_default();
            line.trim_start_matches("error: ").to_string()
        })
}

/// Makes `defaults` the defaults of the options of the subcommand at `path`.
fn apply(command: Command, path: &[String], defaults: &[(String, Vec<String>)]) -> Command {
    match path.split_first() {
        None => defaults.iter().fold(command, |c, (id, values)| {
            let values = values.clone();
            c.mut_arg(id.as_str(), move |a| {
                a.default_values(values).required(false)
            })
        }),
        Some((name, rest)) => {
            let name = name.clone();
            command.mut_subcommand(name, |sub| apply(sub, rest, defaults))
        }
    }
}
