//! The service runner: how every Stagehand service starts, runs and stops.
//!
//! A service's `main.rs` is one call, [`main`], with its name and its `serve` function:
//!
//! 1. **config** — `--config FILE` (TOML, [`ServiceConfig`]: `[bus]`, `[worker]`,
//!    `[telemetry]` and the service's own `[service]` table), unknown keys refused, every error
//!    naming the file, the key and its line; then the `STAGEHAND_NATS_*` environment overrides
//!    ([`crate::env`](mod@crate::env));
//! 2. **telemetry** — logs (text or JSON), traces (OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is
//!    set), and a Prometheus `GET /metrics` endpoint on `telemetry.metrics_listen`, which also
//!    answers the probes `GET /healthz` (the process answers) and `GET /readyz` (connected, and
//!    every worker the service built consumes; `health`), with each worker's consumer
//!    backlog read into the metrics every few seconds (`backlog`);
//! 3. **connect** (with retries) and **provision** the streams and the claims bucket; then
//!    the instance's **heartbeat** (`heartbeat`: version, host, start, progress, restarts in
//!    the `stagehand_heartbeats` bucket, for `stagehand status`) until it stops;
//! 4. **signals** — SIGINT or SIGTERM starts a drain; a second one exits at once;
//! 5. **serve** — the service's function gets a [`Context`] (its settings, the connection, the
//!    worker tunables, the shutdown token), builds its worker(s) with [`Context::worker`] (the
//!    service's defaults, then `[worker]`) and runs them and any other tasks in a
//!    [`TaskGroup`] joined within the drain deadline ([`Context::join`]);
//! 6. **drain** within the deadline, then the **exit code**: 0 after a clean stop, 1 when the
//!    service failed (a dead store, a lost stream: the supervisor restarts it), 78 (`EX_CONFIG`)
//!    when the configuration is wrong (restarting cannot help).
//!
//! [`run`] is steps 3, 5 and 6 with a caller's shutdown token and no process-wide set-up, so
//! tests and `stagehand up` run services in-process exactly as their binaries do.
//!
//! ```no_run
//! use stagehand_bus::runner::{self, Context, InvalidKey, ServiceSettings};
//! use stagehand_bus::{BusError, Handler, HandlerError, WorkContext, WorkerConfig};
//! use stagehand_schemas::{Event, subject};
//!
//! #[derive(serde::Deserialize)]
//! #[serde(deny_unknown_fields)]
//! struct Settings {
//!     /// Where the ledger lives.
//!     state_dir: std::path::PathBuf,
//! }
//! impl ServiceSettings for Settings {}
//!
//! struct Echo;
//! impl Handler for Echo {
//!     async fn handle(&self, e: &Event, _: &WorkContext) -> Result<Vec<Event>, HandlerError> {
//!         Ok(vec![e.caused("echoed", e.body.clone())])
//!     }
//! }
//!
//! async fn serve(ctx: Context<Settings>) -> Result<(), BusError> {
//!     let echo = ctx.worker(WorkerConfig::new(
//!         "echo",
//!         subject::REQUESTS.name,
//!         vec![subject::kind_filter("req", "stage.released")],
//!         ctx.settings.state_dir.join("echo.redb"),
//!     ));
//!     ctx.run_worker(echo, Echo).await.map(|_| ())
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     runner::main("echo", serve)
//! }
//! ```

mod backlog;
mod config;
mod health;
mod heartbeat;
mod tasks;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::instrument::WithSubscriber;

use stagehand_schemas::{Event, Refusal, Retryable};
use stagehand_telemetry::metrics::MetricsEndpoint;
use stagehand_telemetry::names;
use tokio_util::sync::CancellationToken;

pub use config::{ConfigError, InvalidKey, ServiceConfig, ServiceSettings, WorkerSettings};
pub use heartbeat::{EVERY as HEARTBEAT_EVERY, Heartbeat, Progress, RECENT_STARTS, heartbeat_key};
pub use tasks::{TaskError, TaskGroup, every};

use crate::bus::Bus;
use crate::config::WorkerConfig;
use crate::error::{BusError, HandlerError};
use crate::worker::{Handler, WorkContext, WorkerHooks, WorkerStats, run_worker_with_hooks};
use health::Health;

/// Exit status for a configuration that cannot work (`EX_CONFIG` of sysexits.h); systemd
/// units list it in `RestartPreventExitStatus` so that a broken file is not restarted in a loop.
pub const EXIT_CONFIG: u8 = 78;
/// Exit status for a service that failed while running; its supervisor restarts it.
pub const EXIT_FAILED: u8 = 1;
/// How much longer than the service's drain deadline the runner waits for it.
const DRAIN_MARGIN: Duration = Duration::from_secs(2);

/// What a service's `serve` function is given: its settings, a connected and provisioned bus,
/// the `[worker]` tunables and the shutdown token.
#[derive(Debug)]
pub struct Context<S> {
    /// The service name (durable consumer, dead-letter subject, metric label).
    pub name: &'static str,
    /// The `[service]` table.
    pub settings: S,
    /// The connection, streams and claims bucket provisioned.
    pub bus: Bus,
    /// The `[worker]` table: applied by [`Context::worker`] and [`Context::own_worker`].
    pub worker: WorkerSettings,
    /// Cancelled when the service must stop.
    pub shutdown: CancellationToken,
    /// What `/readyz` answers: the workers started through this context count.
    health: Health,
    /// What the heartbeat reports as progress: every message its workers handle.
    progress: Progress,
}

impl<S> Context<S> {
    /// A context over an existing connection with default worker tunables: for running a
    /// service's `serve` in-process (tests).
    pub fn new(name: &'static str, settings: S, bus: Bus, shutdown: CancellationToken) -> Self {
        let health = Health::new(&shutdown);
        health.connected(bus.client());
        Self {
            name,
            settings,
            bus,
            worker: WorkerSettings::default(),
            shutdown,
            health,
            progress: Progress::default(),
        }
    }

    /// The instance's progress, which its heartbeat reports: the workers started through this
    /// context count each message; a clock's pass calls [`Progress::note`].
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// A worker of this service on a consumer its instances share, by the one precedence rule:
    /// the runtime's defaults ([`WorkerConfig::new`]), then the service's own (what `declared`
    /// sets: its consumer, stream, filters, ledger and any tunable it chooses), then every key
    /// the `[worker]` table gives. Its shutdown deadline is the service's
    /// [drain deadline](Context::drain_deadline).
    pub fn worker(&self, declared: WorkerConfig) -> WorkerConfig {
        self.worker.worker(declared)
    }

    /// A worker on a consumer of this instance's own (the recorder's, the promoter's facts):
    /// every instance sees every message, so there is no one to claim against and it never
    /// claims. Built like [`Context::worker`]; `[worker] claims = true` cannot apply to it and
    /// is refused with an error naming the key and the consumer, rather than ignored.
    pub fn own_worker(&self, declared: WorkerConfig) -> Result<WorkerConfig, BusError> {
        self.worker.own_worker(self.name, declared)
    }

    /// How long the service's work may take to finish once shutdown is asked for:
    /// `[worker] shutdown_deadline`, else [`crate::DEFAULT_SHUTDOWN_DEADLINE`]. Every worker built
    /// here stops within it, [`Context::join`] waits for a [`TaskGroup`] within it, and the runner
    /// gives the service this long (and 2 s more) before it gives up on it.
    pub fn drain_deadline(&self) -> Duration {
        self.worker.drain_deadline()
    }

    /// A task group stopped by this context's shutdown token.
    pub fn tasks(&self) -> TaskGroup {
        TaskGroup::new(self.name, &self.shutdown)
    }

    /// Waits for every task of `tasks`, within the [drain deadline](Context::drain_deadline)
    /// once shutdown is asked for; the first failure, as the service's.
    pub async fn join(&self, tasks: TaskGroup) -> Result<(), ServiceError> {
        Ok(tasks.join(self.drain_deadline()).await?)
    }

    /// Runs `handler` under `cfg` until shutdown, counting each call in the service's metrics
    /// ([`names::HANDLER_CALLS_TOTAL`], [`names::HANDLER_SECONDS`]).
    pub async fn run_worker<H: Handler>(
        &self,
        cfg: WorkerConfig,
        handler: H,
    ) -> Result<WorkerStats, BusError> {
        self.run_worker_until(cfg, handler, self.shutdown.clone())
            .await
    }

    /// [`Context::run_worker`] stopped by `shutdown` (a [`TaskGroup`]'s token).
    pub fn run_worker_until<H: Handler>(
        &self,
        cfg: WorkerConfig,
        handler: H,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<WorkerStats, BusError>> + Send + 'static {
        let handler = Arc::new(Metered {
            service: self.name,
            progress: self.progress.clone(),
            inner: handler,
        });
        // Counted now, not when the future first runs: the service is not ready until this
        // worker consumes, however its tasks are scheduled.
        self.health.worker_built();
        let started = self.health.clone();
        let hooks = WorkerHooks {
            started: Some(Arc::new(move || started.worker_started())),
            ..WorkerHooks::default()
        };
        let backlog = (self.bus.clone(), cfg.stream.clone(), cfg.service.clone());
        let worker = run_worker_with_hooks(self.bus.clone(), cfg, handler, shutdown, hooks);
        let health = self.health.clone();
        let service = self.name;
        async move {
            let stop_watching = CancellationToken::new();
            let (bus, stream, consumer) = backlog;
            let watcher = tokio::spawn(
                backlog::watch(bus, service, stream, consumer, stop_watching.clone())
                    .with_current_subscriber(),
            );
            let stats = worker.await;
            stop_watching.cancel();
            let _ = watcher.await;
            health.worker_stopped();
            stats
        }
    }
}

/// A handler counted in the service's metrics.
struct Metered<H> {
    service: &'static str,
    progress: Progress,
    inner: H,
}

impl<H: Handler> Handler for Metered<H> {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let started = Instant::now();
        let result = self.inner.handle(event, ctx).await;
        self.progress.handled();
        let label = match &result {
            Ok(_) => names::result::OK,
            Err(e) if e.is_permanent() => names::result::PERMANENT,
            Err(_) => names::result::RETRYABLE,
        };
        metrics::counter!(
            names::HANDLER_CALLS_TOTAL,
            names::label::SERVICE => self.service,
            names::label::RESULT => label
        )
        .increment(1);
        metrics::histogram!(names::HANDLER_SECONDS, names::label::SERVICE => self.service)
            .record(started.elapsed().as_secs_f64());
        result
    }

    async fn refused(&self, event: &Event, stream_sequence: u64, refusal: &Refusal) {
        self.inner.refused(event, stream_sequence, refusal).await
    }
}

/// Why a service did not run to a clean stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("telemetry: {0}")]
    Telemetry(#[from] stagehand_telemetry::TelemetryError),
    #[error("cannot serve metrics on telemetry.metrics_listen {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The service's own error.
    #[error("{0}")]
    Service(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl RunError {
    /// What the runner returned as the service's own error type `E`: the service's own error
    /// as it returned it, a bus error through `E: From<BusError>`, anything else
    /// (configuration, telemetry, another error type) as [`ServiceError::Run`].
    pub fn into_service_error<E>(self) -> E
    where
        E: std::error::Error + From<BusError> + From<ServiceError> + Send + Sync + 'static,
    {
        match self {
            RunError::Bus(e) => E::from(e),
            RunError::Service(source) => match source.downcast::<E>() {
                Ok(own) => *own,
                Err(other) => E::from(ServiceError::Run(Box::new(RunError::Service(other)))),
            },
            other => E::from(ServiceError::Run(Box::new(other))),
        }
    }

    /// The process exit status for this error: [`EXIT_CONFIG`] when only a change of the
    /// configuration can help, else [`EXIT_FAILED`].
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Config(_) | RunError::Telemetry(_) | RunError::Metrics { .. } => EXIT_CONFIG,
            RunError::Bus(e) if !e.is_retryable() => EXIT_CONFIG,
            RunError::Bus(_) | RunError::Service(_) => EXIT_FAILED,
        }
    }
}

/// What can stop any service, whichever it is: its state folder, one of its tasks, or the
/// runner itself. Each service's error wraps it beside its own variants
/// (`#[error(transparent)] Service(#[from] ServiceError)`), so these are written once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// A folder the service keeps its state, spool or scratch files in could not be created.
    #[error("cannot create {}: {source}", path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// One of the service's tasks (a worker, a clock) failed, which stopped the others.
    #[error(transparent)]
    Task(#[from] TaskError),
    /// The runner could not start or keep the service (configuration, metrics endpoint).
    #[error(transparent)]
    Run(Box<RunError>),
}

impl Retryable for ServiceError {
    /// Whether starting again unchanged can succeed: a failed task (its cause is logged; the
    /// supervisor's restart is the retry) unless it failed on a bus error that cannot be
    /// retried, and a runner error unless the configuration must change.
    fn is_retryable(&self) -> bool {
        match self {
            ServiceError::StateDir { .. } => false,
            ServiceError::Task(e) => e
                .source
                .downcast_ref::<BusError>()
                .is_none_or(BusError::is_retryable),
            ServiceError::Run(e) => e.exit_code() != EXIT_CONFIG,
        }
    }
}

/// Creates `dirs` (and their parents) where they are missing: the folders a service keeps its
/// state, spool or scratch files in.
pub fn create_state_dirs<'a>(dirs: impl IntoIterator<Item = &'a Path>) -> Result<(), ServiceError> {
    for dir in dirs {
        std::fs::create_dir_all(dir).map_err(|source| ServiceError::StateDir {
            path: dir.to_owned(),
            source,
        })?;
    }
    Ok(())
}

/// Runs a service in-process: the metrics endpoint (when configured) → connect → provision →
/// `serve` → drain, until `shutdown` is cancelled or `serve` fails. No logging set-up and no
/// signal handling: that is [`main`]'s.
pub async fn run<S, F, Fut, T, E>(
    name: &'static str,
    config: ServiceConfig<S>,
    shutdown: CancellationToken,
    serve: F,
) -> Result<T, RunError>
where
    S: ServiceSettings,
    F: FnOnce(Context<S>) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    let ServiceConfig {
        mut bus,
        worker,
        telemetry,
        service,
    } = config;
    let health = Health::new(&shutdown);
    let metrics = match telemetry.metrics_listen {
        Some(addr) => {
            let readiness = health.clone();
            let endpoint = MetricsEndpoint::bind(addr)
                .await
                .map_err(|source| RunError::Metrics { addr, source })?
                .with_readiness(Arc::new(move || readiness.check()));
            let bound = endpoint.local_addr().unwrap_or(addr);
            tracing::info!(service = name, metrics = %bound, "serving Prometheus metrics on /metrics, probes on /healthz and /readyz");
            let stop = shutdown.clone();
            Some(AbortOnDrop(tokio::spawn(
                endpoint.serve(async move { stop.cancelled().await }),
            )))
        }
        None => None,
    };
    if bus.client_name == crate::config::BusConfig::default().client_name {
        bus.client_name = name.to_owned();
    }
    let connected = Bus::connect(&bus).await?;
    connected.provision().await?;
    health.connected(connected.client());
    tracing::info!(
        service = name,
        servers = %connected.servers(),
        replicas = connected.replicas(),
        "connected and provisioned"
    );
    let info = metrics::gauge!(
        names::SERVICE_INFO,
        names::label::SERVICE => name,
        names::label::VERSION => env!("CARGO_PKG_VERSION")
    );
    info.set(1.0);
    let progress = Progress::default();
    let instance = (worker.instance_id.clone())
        .or_else(|| service.instance())
        .unwrap_or_else(crate::host_name);
    let beating = heartbeat::start(&connected, name, instance, progress.clone()).await;
    let ctx = Context {
        name,
        settings: service,
        bus: connected,
        worker: worker.clone(),
        shutdown: shutdown.clone(),
        health,
        progress,
    };
    let deadline = worker.drain_deadline() + DRAIN_MARGIN;
    let served = serve(ctx);
    tokio::pin!(served);
    // The service drains by itself once `shutdown` is cancelled; past the deadline it is cut
    // off (its un-acked messages are redelivered to the next instance).
    // The service's own error becomes a `RunError` at once: the last heartbeat is awaited
    // below, and the service's error type need not be `Send`.
    let outcome = tokio::select! {
        r = &mut served => Ok(r.map_err(|e| RunError::Service(e.into()))),
        _ = async {
            shutdown.cancelled().await;
            tokio::time::sleep(deadline).await;
        } => Err(format!("{name} did not stop within {deadline:?} of shutdown")),
    };
    info.set(0.0);
    let result = match outcome {
        Ok(result) => result,
        Err(message) => {
            tracing::warn!(
                service = name,
                ?deadline,
                "the service did not drain within its deadline"
            );
            if let Some(beating) = beating {
                beating
                    .finish(heartbeat::Ending::Failed(message.clone()))
                    .await;
            }
            return Err(RunError::Service(message.into()));
        }
    };
    if let Some(beating) = beating {
        let ending = match &result {
            Ok(_) => heartbeat::Ending::Stopped,
            Err(e) => heartbeat::Ending::Failed(e.to_string()),
        };
        beating.finish(ending).await;
    }
    // The endpoint stops with the token, or here when the service failed on its own.
    drop(metrics);
    result
}

/// A task stopped when its handle is dropped: the metrics endpoint of a service that returned
/// early (a failed connection) must not keep its port.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `name` made one subject token, as a consumer name must be (a node's name in the consumer
/// of that node's agent): every character outside `[A-Za-z0-9_-]` becomes `-`.
pub fn consumer_token(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// The whole life of a service binary: reads `--config FILE`, sets up telemetry, runs the
/// service with [`run`] until SIGINT or SIGTERM, and returns its exit status.
pub fn main<S, F, Fut, T, E>(name: &'static str, serve: F) -> ExitCode
where
    S: ServiceSettings,
    F: FnOnce(Context<S>) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    T: std::fmt::Debug,
{
    let path = match config_path(name, std::env::args_os().skip(1)) {
        Ok(Some(path)) => path,
        Ok(None) => return ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{name}: {message}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let config = match ServiceConfig::<S>::load(&path) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let _telemetry = match stagehand_telemetry::init_with(name, &config.telemetry) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let outcome = runtime.block_on(async {
        let shutdown = CancellationToken::new();
        if let Err(e) = stop_on_signals(name, shutdown.clone()) {
            return Err(RunError::Service(e.into()));
        }
        tracing::info!(service = name, config = %path.display(), "starting");
        run(name, config, shutdown, serve).await
    });
    match outcome {
        Ok(stats) => {
            tracing::info!(service = name, ?stats, "stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(service = name, error = %e, "stopped with an error");
            eprintln!("{name}: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// `--config FILE` (or `--config=FILE`) from the arguments; `None` after printing help or the
/// version.
fn config_path(
    name: &str,
    mut args: impl Iterator<Item = std::ffi::OsString>,
) -> Result<Option<PathBuf>, String> {
    let usage = format!(
        "usage: {name} --config FILE\n\nFILE is TOML with the tables [bus], [worker], [telemetry] and [service]; \
         see deploy/config/ and services/bus/README.md. Environment overrides: {}.",
        crate::env::ALL.join(", ")
    );
    let mut path = None;
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        match text.as_ref() {
            "-h" | "--help" => {
                println!("{usage}");
                return Ok(None);
            }
            "-V" | "--version" => {
                println!("{name} {}", env!("CARGO_PKG_VERSION"));
                return Ok(None);
            }
            "--config" | "-c" => {
                path = Some(PathBuf::from(
                    args.next()
                        .ok_or_else(|| format!("--config needs a file\n{usage}"))?,
                ))
            }
            other => match other.strip_prefix("--config=") {
                Some(p) => path = Some(PathBuf::from(p)),
                None => return Err(format!("unknown argument {other:?}\n{usage}")),
            },
        }
    }
    path.map(Some)
        .ok_or_else(|| format!("--config FILE is required\n{usage}"))
}

/// Cancels `shutdown` on the first SIGINT or SIGTERM; a second one exits the process at once
/// (status 130), for an operator who does not want to wait for the drain.
fn stop_on_signals(name: &'static str, shutdown: CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        for n in 0.. {
            let which = tokio::select! {
                _ = interrupt.recv() => "SIGINT",
                _ = terminate.recv() => "SIGTERM",
            };
            if n == 0 {
                tracing::info!(service = name, signal = which, "draining");
                shutdown.cancel();
            } else {
                tracing::warn!(
                    service = name,
                    signal = which,
                    "second signal: exiting without draining"
                );
                std::process::exit(130);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> impl Iterator<Item = std::ffi::OsString> {
        list.iter()
            .map(|s| std::ffi::OsString::from(*s))
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn the_config_flag_is_required_and_nothing_else_is_accepted() {
        assert_eq!(
            config_path("svc", args(&["--config", "/etc/x.toml"])).unwrap(),
            Some(PathBuf::from("/etc/x.toml"))
        );
        assert_eq!(
            config_path("svc", args(&["--config=/etc/y.toml"])).unwrap(),
            Some(PathBuf::from("/etc/y.toml"))
        );
        assert!(
            config_path("svc", args(&[]))
                .unwrap_err()
                .contains("--config FILE is required")
        );
        assert!(
            config_path("svc", args(&["--nats", "x"]))
                .unwrap_err()
                .contains("unknown argument")
        );
        assert!(
            config_path("svc", args(&["--config"]))
                .unwrap_err()
                .contains("needs a file")
        );
    }

    #[test]
    fn configuration_errors_exit_with_ex_config_and_failures_with_one() {
        let cfg = RunError::Config(ConfigError::Invalid {
            file: "x".into(),
            key: "bus.replicas".into(),
            line: Some(2),
            message: "no".into(),
        });
        assert_eq!(cfg.exit_code(), EXIT_CONFIG);
        let failed = RunError::Service("the ledger's disk failed".into());
        assert_eq!(failed.exit_code(), EXIT_FAILED);
        let down = RunError::Bus(BusError::new(
            crate::error::BusErrorKind::Connect,
            "could not connect to NATS at nats://h:1: refused",
        ));
        assert_eq!(down.exit_code(), EXIT_FAILED);
    }
}
