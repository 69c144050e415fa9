//! The Python exceptions, and how each Rust error maps onto one.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use kvhandoff::{ConnectorError, KvCacheError, StartError};

create_exception!(
    kvhandoff,
    KvHandoffError,
    PyException,
    "Every kvhandoff error."
);
create_exception!(
    kvhandoff,
    ConfigError,
    KvHandoffError,
    "An invalid argument or setting, or a rank that could not start."
);
create_exception!(
    kvhandoff,
    InvalidParams,
    KvHandoffError,
    "kv_transfer_params lack a key or hold an invalid value."
);
create_exception!(
    kvhandoff,
    Rejected,
    KvHandoffError,
    "The endpoint refused the call; nothing changed."
);
create_exception!(
    kvhandoff,
    Unsupported,
    KvHandoffError,
    "The call asks for something this rank cannot do."
);
create_exception!(
    kvhandoff,
    Unavailable,
    KvHandoffError,
    "The runtime is not running or did not answer."
);
create_exception!(
    kvhandoff,
    VerdictLate,
    KvHandoffError,
    "The runtime took the call but has not answered; its event will tell."
);
create_exception!(
    kvhandoff,
    RegionError,
    KvHandoffError,
    "A block or region out of range, or memory that cannot be a region."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvHandoffError", py.get_type::<KvHandoffError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("InvalidParams", py.get_type::<InvalidParams>())?;
    m.add("Rejected", py.get_type::<Rejected>())?;
    m.add("Unsupported", py.get_type::<Unsupported>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("VerdictLate", py.get_type::<VerdictLate>())?;
    m.add("RegionError", py.get_type::<RegionError>())?;
    Ok(())
}

/// The message of `error` and of every error under it.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let next = inner.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = inner.source();
    }
    text
}

/// An exception of type `T` whose `cause` attribute is `cause`.
pub(crate) fn raise<T: pyo3::PyTypeInfo>(message: String, cause: String) -> PyErr {
    Python::attach(|py| {
        let err = PyErr::new::<T, _>(message);
        // Setting an attribute on a fresh exception instance cannot fail in practice; if it
        // did, the exception still carries the message.
        let _ = err.value(py).setattr("cause", cause);
        err
    })
}

/// A configuration problem, naming what is wrong.
pub(crate) fn config(message: impl Into<String>) -> PyErr {
    let message = message.into();
    raise::<ConfigError>(message.clone(), message)
}

pub(crate) fn connector(error: ConnectorError) -> PyErr {
    let cause = chain(&error);
    match error {
        ConnectorError::MissingParam(_) | ConnectorError::InvalidParam { .. } => {
            raise::<InvalidParams>(cause.clone(), cause)
        }
        ConnectorError::Rejected(_) => raise::<Rejected>(cause.clone(), cause),
        ConnectorError::Unsupported(_) => raise::<Unsupported>(cause.clone(), cause),
        ConnectorError::NotConfigured(_) => raise::<ConfigError>(cause.clone(), cause),
        ConnectorError::Unavailable | ConnectorError::VerdictUnknown => {
            raise::<Unavailable>(cause.clone(), cause)
        }
        ConnectorError::VerdictLate => raise::<VerdictLate>(cause.clone(), cause),
    }
}

pub(crate) fn start(error: StartError) -> PyErr {
    let cause = chain(&error);
    raise::<ConfigError>(format!("the rank could not start: {cause}"), cause)
}

pub(crate) fn warm_up(error: StartError) -> PyErr {
    let cause = chain(&error);
    raise::<Unavailable>(cause.clone(), cause)
}

pub(crate) fn cache(error: KvCacheError) -> PyErr {
    let cause = chain(&error);
    raise::<RegionError>(cause.clone(), cause)
}

pub(crate) fn closed() -> PyErr {
    let cause = "the connector is closed".to_string();
    raise::<Unavailable>(cause.clone(), cause)
}
