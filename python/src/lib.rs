//! `kvhandoff._native`: the Python extension over the `kvhandoff` crate.
//!
//! What Python imports as `kvhandoff` is the package in `python/kvhandoff`, which re-exports this
//! module and adds the region handling (buffers, torch tensors) on top of [`NativeConnector`].
//! Every call that waits on the runtime releases the GIL; every Rust error becomes a typed Python
//! exception (`KvHandoffError` and its subclasses) whose `cause` is the Rust error's message.

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod connector;
mod convert;
mod errors;
mod logging;
mod options;

pub use connector::NativeConnector;

/// This process's counters (every rank of it), as the runtime counts them.
#[pyfunction]
fn metrics(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let m = kvhandoff::metrics::snapshot();
    let endpoints = kvhandoff::metrics::endpoint_snapshot();
    let dict = PyDict::new(py);
    for (name, value) in [
        ("requests_ready", m.requests_ready),
        ("requests_failed", m.requests_failed),
        ("requests_recomputed", m.requests_recomputed),
        ("requests_sent", m.requests_sent),
        ("requests_released", m.requests_released),
        ("requests_fenced", m.requests_fenced),
        ("requests_expired", m.requests_expired),
        ("calls_refused_late", m.calls_refused_late),
        ("bytes_sent", m.bytes_sent),
        ("bytes_received", m.bytes_received),
        ("reads_asked_again", endpoints.reads_asked_again),
    ] {
        dict.set_item(name, value)?;
    }
    Ok(dict)
}

/// The same figures and the ranks' endpoint counters as Prometheus text (what `kvhandoff node
/// --metrics-addr` serves), for an engine that serves its own `/metrics`.
#[pyfunction]
fn prometheus_text() -> String {
    kvhandoff::metrics::prometheus_text()
}

/// The monotonic clock that `remote_blocks_expiry_time` is written in, in seconds.
#[pyfunction]
fn clock_secs() -> f64 {
    kvhandoff::KvConnector::clock_secs()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    logging::init_from_env()?;
    m.add_class::<NativeConnector>()?;
    m.add_function(wrap_pyfunction!(metrics, m)?)?;
    m.add_function(wrap_pyfunction!(clock_secs, m)?)?;
    m.add_function(wrap_pyfunction!(prometheus_text, m)?)?;
    m.add_function(wrap_pyfunction!(connector::threads_outside, m)?)?;
    // Every keyword setting the connector takes (the rank's, then the shell's own), so the
    // vLLM adapter passes on exactly those.
    let keys: Vec<&str> = kvhandoff::RankSettings::keys()
        .chain(options::SHELL_KEYS)
        .collect();
    m.add("SETTING_KEYS", pyo3::types::PyTuple::new(m.py(), keys)?)?;
    Ok(())
}
