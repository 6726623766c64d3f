//! Logging, tracing and trace-context propagation shared by every Stagehand service.
//!
//! [`init`] installs a `tracing` subscriber: human-readable logs filtered by `RUST_LOG`
//! (default `info`), plus an OpenTelemetry layer so every span has a trace and span id that
//! can travel to the next service in the NATS `traceparent` header. Spans are exported over
//! OTLP only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; otherwise they stay in-process and only
//! the ids flow. The returned [`TelemetryGuard`] flushes the exporter when dropped.
//!
//! Field and metric names live in [`names`], so that logs and dashboards agree on them.

pub mod names;
pub mod propagation;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, fmt};

pub use propagation::{HeaderExtractor, HeaderInjector, extract_context, inject_context};

/// The environment variable that turns span export on.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Why telemetry could not be set up. All are permanent: they come from configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    #[error("a global tracing subscriber is already installed in this process")]
    AlreadyInitialised,
    #[error("could not build the OTLP span exporter for {OTLP_ENDPOINT_ENV}: {0}")]
    Exporter(String),
}

/// Keeps the tracer provider alive; flushes and shuts it down when dropped.
#[must_use = "dropping the guard flushes and stops span export"]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
    exporting: bool,
}

impl TelemetryGuard {
    /// Whether spans are exported over OTLP (the endpoint variable was set).
    pub fn exporting(&self) -> bool {
        self.exporting
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if self.exporting {
            // Best effort: a collector that went away must not block the service's exit.
            let _ = self.provider.force_flush();
        }
        let _ = self.provider.shutdown();
    }
}

/// Installs logging and tracing for `service_name` as the process-wide subscriber.
pub fn init(service_name: &str) -> Result<TelemetryGuard, TelemetryError> {
    let exporting = std::env::var_os(OTLP_ENDPOINT_ENV).is_some_and(|v| !v.is_empty());
    let resource = Resource::builder()
        .with_service_name(service_name.to_owned())
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if exporting {
        // The exporter reads the endpoint and headers from the standard OTEL_* variables.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    let tracer = provider.tracer(service_name.to_owned());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt::layer().with_target(false))
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init()
        .map_err(|_| TelemetryError::AlreadyInitialised)?;
    Ok(TelemetryGuard {
        provider,
        exporting,
    })
}
