//! The runtime's logs in a Python process: `KVHANDOFF_LOG` (a `tracing` filter, e.g. `info` or
//! `kvhandoff_actors=debug,warn`) writes them to stderr as the extension loads, as text or, with
//! `KVHANDOFF_LOG_FORMAT=json`, one JSON object per line (the per-request spans' `key`, `epoch`
//! and `trace_id` in each record, as `kvhandoff node --log-format json` prints them). Unset, the
//! runtime logs nothing, as before. Read once, when `kvhandoff` is first imported.

use pyo3::PyResult;
use tracing_subscriber::EnvFilter;

use crate::errors::config;

/// The variable holding the filter.
const LOG_VAR: &str = "KVHANDOFF_LOG";
/// The variable choosing `text` (the default) or `json`.
const FORMAT_VAR: &str = "KVHANDOFF_LOG_FORMAT";

/// Installs the process's `tracing` subscriber when `KVHANDOFF_LOG` is set. A filter or a format
/// that does not parse is a `ConfigError` at import, naming the variable; a process that has a
/// subscriber already (another extension's) keeps it.
pub(crate) fn init_from_env() -> PyResult<()> {
    let Ok(directives) = std::env::var(LOG_VAR) else {
        return Ok(());
    };
    if directives.trim().is_empty() {
        return Ok(());
    }
    let filter = EnvFilter::try_new(&directives)
        .map_err(|e| config(format!("{LOG_VAR}={directives:?}: {e}")))?;
    let format = std::env::var(FORMAT_VAR).unwrap_or_default();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_thread_names(true);
    // `try_init` fails only when a subscriber is installed already: that one stays.
    let _already = match format.as_str() {
        "" | "text" => builder.try_init(),
        "json" => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
        other => {
            return Err(config(format!(
                "{FORMAT_VAR}={other:?}: must be text or json"
            )))
        }
    };
    Ok(())
}
