//! The long-running subcommands' logs (`node`, `demo`): `--log-format text|json` and
//! `--log-level`, written to stderr (stdout stays the report's).
//!
//! The runtime logs through `tracing`; each request's transitions run in a span (`decode`,
//! `prefill`, `import`, `export`) carrying its pairing `key`, `epoch` and `trace_id`, which P
//! and D share, so the two processes' JSON lines join on `trace_id` (docs/operations.md,
//! "Tracing").
//!
//! With the `otel` feature, `--otel-endpoint URL` also exports the spans to an OpenTelemetry
//! collector over OTLP/HTTP (`otel.rs`); each span keeps its fields as attributes, so a
//! collector joins P's and D's spans of a request on `trace_id`.

use clap::Args;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer};

#[cfg(feature = "otel")]
mod otel;

/// How log records are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// One human-readable line per record.
    #[default]
    Text,
    /// One JSON object per line: the record's fields, its span (`span`) and every span it is
    /// in (`spans`, outermost first), with their fields.
    Json,
}

/// The logging flags a long-running subcommand takes.
#[derive(Debug, Clone, Args)]
pub(crate) struct LogArgs {
    /// How log records are written on stderr: `text`, or `json` (one object per line, with the
    /// fields of the record and of the spans it is in: a request's `key`, `epoch` and
    /// `trace_id`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Which records are written: a `tracing` filter such as `info` or
    /// `warn,kvhandoff_protocol=debug` (the per-request records are `debug` of
    /// `kvhandoff_protocol`). Without it `RUST_LOG` is read, and without that `warn`.
    #[arg(long, value_name = "FILTER")]
    log_level: Option<String>,
    /// Also export the spans (those `--log-level` lets through) to an OpenTelemetry collector,
    /// over OTLP/HTTP in protobuf, e.g. `http://127.0.0.1:4318/v1/traces` (the full traces URL;
    /// plain HTTP). Needs a build with `--features otel`.
    #[arg(long, value_name = "URL")]
    otel_endpoint: Option<String>,
}

/// Keeps the log pipeline alive: dropping it flushes and stops the OpenTelemetry export (if
/// any), so hold it until the subcommand's end.
#[must_use = "dropping the guard stops the span export"]
#[derive(Debug)]
pub(crate) struct LogGuard {
    #[cfg(feature = "otel")]
    _otel: Option<otel::Export>,
}

impl LogArgs {
    /// Installs the process's subscriber.
    ///
    /// # Errors
    /// A filter (`--log-level` or `RUST_LOG`) that does not parse, an `--otel-endpoint` this
    /// build cannot serve or that is not an `http://` URL, or a subscriber already set.
    pub(crate) fn init(&self) -> Result<LogGuard, String> {
        let filter = match &self.log_level {
            Some(text) => {
                EnvFilter::try_new(text).map_err(|e| format!("--log-level {text:?}: {e}"))?
            }
            None => match std::env::var(EnvFilter::DEFAULT_ENV) {
                Ok(text) => {
                    EnvFilter::try_new(&text).map_err(|e| format!("RUST_LOG {text:?}: {e}"))?
                }
                Err(_) => EnvFilter::new("warn"),
            },
        };
        let text = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
        let lines: Box<dyn Layer<_> + Send + Sync> = match self.log_format {
            LogFormat::Text => text.with_ansi(false).boxed(),
            LogFormat::Json => text
                .json()
                .with_current_span(true)
                .with_span_list(true)
                .boxed(),
        };
        let registry = tracing_subscriber::registry().with(filter).with(lines);
        match &self.otel_endpoint {
            None => {
                registry
                    .try_init()
                    .map_err(|e| format!("cannot install the log subscriber: {e}"))?;
                Ok(LogGuard {
                    #[cfg(feature = "otel")]
                    _otel: None,
                })
            }
            #[cfg(feature = "otel")]
            Some(endpoint) => {
                let (export, layer) = otel::Export::start(endpoint)?;
                registry
                    .with(layer)
                    .try_init()
                    .map_err(|e| format!("cannot install the log subscriber: {e}"))?;
                Ok(LogGuard {
                    _otel: Some(export),
                })
            }
            #[cfg(not(feature = "otel"))]
            Some(_) => Err(
                "--otel-endpoint: this build has no OpenTelemetry export (build with \
                 `--features otel`)"
                    .into(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn the_default_is_text_and_json_parses() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.log.log_format, LogFormat::Text);
        assert_eq!(cli.log.log_level, None);
        let cli =
            Cli::try_parse_from(["x", "--log-format", "json", "--log-level", "debug"]).unwrap();
        assert_eq!(cli.log.log_format, LogFormat::Json);
        assert_eq!(cli.log.log_level.as_deref(), Some("debug"));
        assert!(Cli::try_parse_from(["x", "--log-format", "xml"]).is_err());
    }

    #[cfg(not(feature = "otel"))]
    #[test]
    fn an_otel_endpoint_needs_the_feature() {
        let cli = Cli::try_parse_from(["x", "--otel-endpoint", "http://127.0.0.1:4318/v1/traces"])
            .unwrap();
        let error = cli.log.init().unwrap_err();
        assert!(error.contains("--features otel"), "{error}");
    }

    #[test]
    fn a_bad_filter_is_a_clear_error_not_a_panic() {
        let cli = Cli::try_parse_from(["x", "--log-level", "kvhandoff=notalevel"]).unwrap();
        let error = cli.log.init().unwrap_err();
        assert!(error.starts_with("--log-level"), "{error}");
    }
}
