//! Logging, tracing and trace-context propagation shared by every Stagehand service.
//!
//! [`init`] installs a `tracing` subscriber: human-readable logs filtered by `RUST_LOG`
//! (default `info`), plus an OpenTelemetry layer so every span has a trace and span id that
//! can travel to the next service in the NATS `traceparent` header. Spans are exported over
//! OTLP only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; otherwise they stay in-process and only
//! the ids flow. The returned [`TelemetryGuard`] flushes the exporter when dropped.
//!
//! [`init_with`] takes the `[telemetry]` table of a service's configuration
//! ([`TelemetryConfig`]): log format and level, and the address of the Prometheus scrape
//! endpoint ([`metrics`]) that the service runner starts. [`service_dispatch`] builds the same
//! subscriber for one service of a process that runs several (`stagehand up`), so that each
//! exports its spans under its own `service.name`; [`export_layer`] is the OpenTelemetry layer
//! alone, for the `stagehand` command, whose span joins the caller's `TRACEPARENT`
//! ([`env_context`]).
//!
//! Field and metric names live in [`names`], so that logs and dashboards agree on them; the
//! metrics of the work itself (bytes moved, stage latency, tier fill, backlog, drills) are
//! recorded through the functions of [`work`].

pub mod http;
pub mod metrics;
pub mod names;
pub mod propagation;
pub mod work;

use std::io::IsTerminal;
use std::net::SocketAddr;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, fmt};

pub use propagation::{
    HeaderExtractor, HeaderInjector, env_context, extract_context, inject_context,
};

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
    #[error("telemetry.log_level: {0}")]
    LogLevel(String),
}

/// How log lines are written (to stderr).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event; colour only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// The `[telemetry]` table of a service's configuration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// `text` or `json`.
    pub log_format: LogFormat,
    /// A `tracing` filter such as `info` or `info,stagehand_bus=debug`; `RUST_LOG`, when set,
    /// takes its place.
    pub log_level: String,
    /// Where to serve Prometheus's `GET /metrics`, e.g. `127.0.0.1:9464`; none when absent.
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_format: LogFormat::Text,
            log_level: "info".into(),
            metrics_listen: None,
        }
    }
}

impl TelemetryConfig {
    /// Checks that `log_level` is a filter `tracing` accepts.
    pub fn validate(&self) -> Result<(), TelemetryError> {
        EnvFilter::try_new(&self.log_level)
            .map(|_| ())
            .map_err(|e| TelemetryError::LogLevel(format!("{:?}: {e}", self.log_level)))
    }
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

/// Installs logging and tracing for `service_name` as the process-wide subscriber, with the
/// default [`TelemetryConfig`].
pub fn init(service_name: &str) -> Result<TelemetryGuard, TelemetryError> {
    init_with(service_name, &TelemetryConfig::default())
}

/// Installs logging (format and level from `config`, `RUST_LOG` first) and tracing for
/// `service_name` as the process-wide subscriber. The metrics endpoint is not started here:
/// the runner binds `config.metrics_listen` so that a taken port is a start-up error.
pub fn init_with(
    service_name: &str,
    config: &TelemetryConfig,
) -> Result<TelemetryGuard, TelemetryError> {
    let (layers, guard) = layers(service_name, config)?;
    tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .map_err(|_| TelemetryError::AlreadyInitialised)?;
    Ok(guard)
}

/// Logging and tracing for one service of a process that runs several (`stagehand up`): the
/// same layers as [`init_with`], as a subscriber of its own rather than the process-wide one,
/// so that the service's spans are exported under its own `service.name`. The caller runs the
/// service's futures with it (`tracing::instrument::WithSubscriber`); tasks the service spawns
/// take it along with `with_current_subscriber`.
pub fn service_dispatch(
    service_name: &str,
    config: &TelemetryConfig,
) -> Result<(tracing::Dispatch, TelemetryGuard), TelemetryError> {
    let (layers, guard) = layers(service_name, config)?;
    Ok((
        tracing::Dispatch::new(tracing_subscriber::registry().with(layers)),
        guard,
    ))
}

/// The OpenTelemetry layer alone, for a command that sets up its own logging (`stagehand`):
/// spans at `info` and above, exported over OTLP under `service_name`; `None` when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is not set, so that a command run by hand exports nothing
/// and starts no exporter.
pub fn export_layer<S>(
    service_name: &str,
) -> Result<Option<(impl Layer<S> + Send + Sync, TelemetryGuard)>, TelemetryError>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
{
    if !exporting() {
        return Ok(None);
    }
    let (tracer, guard) = tracer(service_name)?;
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(LevelFilter::INFO);
    Ok(Some((layer, guard)))
}

/// Whether `OTEL_EXPORTER_OTLP_ENDPOINT` asks for span export.
fn exporting() -> bool {
    std::env::var_os(OTLP_ENDPOINT_ENV).is_some_and(|v| !v.is_empty())
}

/// A tracer whose spans carry `service.name` = `service_name`, exported in batches over OTLP
/// when [`exporting`], and the guard that flushes them.
fn tracer(
    service_name: &str,
) -> Result<(opentelemetry_sdk::trace::Tracer, TelemetryGuard), TelemetryError> {
    let exporting = exporting();
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
    Ok((
        tracer,
        TelemetryGuard {
            provider,
            exporting,
        },
    ))
}

/// The layers of a service's subscriber: the filter, the log lines and the OpenTelemetry layer.
fn layers(
    service_name: &str,
    config: &TelemetryConfig,
) -> Result<(Box<dyn Layer<Registry> + Send + Sync>, TelemetryGuard), TelemetryError> {
    config.validate()?;
    let (tracer, guard) = tracer(service_name)?;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&config.log_level))
        .map_err(|e| TelemetryError::LogLevel(e.to_string()))?;
    let ansi = std::io::stderr().is_terminal();
    let (text, json) = match config.log_format {
        LogFormat::Text => (
            Some(
                fmt::layer()
                    .with_target(false)
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            ),
            None,
        ),
        LogFormat::Json => (None, Some(fmt::layer().json().with_writer(std::io::stderr))),
    };
    let layers = filter
        .and_then(text)
        .and_then(json)
        .and_then(tracing_opentelemetry::layer().with_tracer(tracer));
    Ok((Box::new(layers), guard))
}
