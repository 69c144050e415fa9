//! `--otel-endpoint`: the spans exported to an OpenTelemetry collector over OTLP/HTTP, by the
//! maintained crates (`opentelemetry-otlp` with its blocking HTTP client, a batch span
//! processor on its own thread, `tracing-opentelemetry` as the bridge from `tracing`).
//!
//! The OpenTelemetry trace id of a span is the exporting process's own; kvhandoff's request
//! `trace_id` (the one P and D share, `protocol/src/trace.rs`) travels as an attribute of the
//! request's spans, so a query on that attribute finds both sides of a handoff.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The longest URL taken.
const MAX_ENDPOINT_LEN: usize = 2048;

/// A running export; [`Drop`] flushes what is queued and stops it.
#[derive(Debug)]
pub(crate) struct Export {
    provider: SdkTracerProvider,
}

impl Export {
    /// Starts the export to `endpoint` and returns the layer that feeds it.
    ///
    /// # Errors
    /// An endpoint that is not an `http://` URL, or an exporter that cannot be built.
    pub(crate) fn start<S>(
        endpoint: &str,
    ) -> Result<(Export, Box<dyn Layer<S> + Send + Sync>), String>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        check_endpoint(endpoint)?;
        use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(endpoint)
            .with_timeout(std::time::Duration::from_secs(5))
            .with_headers(Default::default())
            .build()
            .map_err(|e| format!("--otel-endpoint {endpoint}: {e}"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name("kvhandoff").build())
            .build();
        let tracer = provider.tracer("kvhandoff");
        let layer = tracing_opentelemetry::layer().with_tracer(tracer).boxed();
        Ok((Export { provider }, layer))
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        // Flushes the queued spans (bounded by the exporter's own timeout).
        if let Err(error) = self.provider.shutdown() {
            eprintln!("kvhandoff: the OpenTelemetry export did not flush: {error}");
        }
    }
}

/// Only plain `http://host[:port]/path` URLs: the exporter is built without TLS.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("--otel-endpoint {endpoint:?}: {why}"));
    if endpoint.len() > MAX_ENDPOINT_LEN {
        return bad("longer than 2048 bytes");
    }
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return bad("expected an http:// URL (this build exports without TLS)");
    };
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || rest.chars().any(char::is_whitespace) {
        return bad("expected http://HOST[:PORT]/PATH");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked() {
        assert!(check_endpoint("http://127.0.0.1:4318/v1/traces").is_ok());
        for bad in [
            "https://x/v1/traces",
            "127.0.0.1:4318",
            "http:///v1",
            "http://a b/",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
    }
}
