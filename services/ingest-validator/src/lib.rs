//! The ingest validator: reads every byte of every upload and says whether it is what its
//! manifest claims.
//!
//! For each `ingest.requested` it checks each manifest entry against the path rules and the
//! validation policy (`policies/validation.toml`), reads and hashes every file on the source
//! tier (concurrently, with a bound), and publishes one fact: `dataset.validated` with the
//! version digest, or `dataset.rejected` listing *every* problem with its path and a stable
//! code. A rejected upload is never deleted: a marker naming the request and its problems is
//! written beneath the source tier at `.stagehand/quarantine/<project>/<request-id>.json`, and
//! the rejection's `quarantine` field says where.
//!
//! Problems with the data are answers (a rejection); a tier that cannot be reached is not an
//! answer, and the request is retried later with backoff by the worker runtime.
//!
//! ```no_run
//! # async fn demo() -> Result<(), stagehand_ingest_validator::ValidatorError> {
//! use stagehand_ingest_validator::{config, run};
//! let config = config("nats://127.0.0.1:4222", "policies", ".stagehand/state");
//! run(config, stagehand_bus::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

pub mod check;
mod handler;
pub mod source;
pub mod validate;

use std::path::PathBuf;

use serde::Deserialize;
use stagehand_bus::runner::{self, Context, InvalidKey, ServiceConfig, ServiceSettings};
use stagehand_bus::{BusConfig, BusError, CancellationToken, WorkerConfig, WorkerStats};
use stagehand_mover::TransferError;
use stagehand_policy::{Policies, PolicyError};
use stagehand_schemas::subject;

pub use handler::{IngestValidator, STEP_REJECTED, STEP_VALIDATED, marker_path};

/// The service name: its durable consumer, its dead-letter subject, its ledger file.
pub const SERVICE: &str = "ingest-validator";

/// The validator's own settings: the `[service]` table of its configuration file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The policy folder (`tiers.toml`, `validation.toml`, …).
    pub policies_dir: PathBuf,
    /// Where the service keeps its ledger (`ingest-validator.redb`).
    pub state_dir: PathBuf,
    /// Files read and hashed at once within one request.
    #[serde(default = "defaults::read_concurrency")]
    pub read_concurrency: usize,
}

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`Settings`] as `[service]`.
pub type Config = ServiceConfig<Settings>;

mod defaults {
    use std::time::Duration;
    pub fn concurrency() -> usize {
        4
    }
    pub fn read_concurrency() -> usize {
        8
    }
    pub fn max_deliver() -> i64 {
        8
    }
    pub fn ack_wait() -> Duration {
        Duration::from_secs(30)
    }
}

impl Settings {
    /// Settings with every tunable at its default.
    pub fn new(policies_dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            policies_dir: policies_dir.into(),
            state_dir: state_dir.into(),
            read_concurrency: defaults::read_concurrency(),
        }
    }

    /// The worker the validator runs, with the validator's defaults (4 requests at once, 8
    /// deliveries, 30 s ack wait) before the `[worker]` table's overrides: `ingest.requested`
    /// of every project from the requests stream.
    pub fn worker_config(&self) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(
            SERVICE,
            subject::REQUESTS.name,
            vec![subject::kind_filter("req", "ingest.requested")],
            self.state_dir.join(format!("{SERVICE}.redb")),
        );
        cfg.concurrency = defaults::concurrency();
        cfg.max_deliver = defaults::max_deliver();
        cfg.ack_wait = defaults::ack_wait();
        cfg
    }

    /// Settings for a one-machine stack under `home` (`stagehand up`).
    pub fn dev(home: &std::path::Path, policies_dir: &std::path::Path) -> Self {
        Self::new(policies_dir, home.join("state").join(SERVICE))
    }
}

impl ServiceSettings for Settings {
    /// Checks the bounds. The policies themselves are loaded when the service starts (their
    /// errors name the policy file and key).
    fn validate(&self) -> Result<(), InvalidKey> {
        if !(1..=1024).contains(&self.read_concurrency) {
            return Err(InvalidKey::new(
                "read_concurrency",
                format!("{} is not in 1..=1024", self.read_concurrency),
            ));
        }
        if self.policies_dir.as_os_str().is_empty() {
            return Err(InvalidKey::new(
                "policies_dir",
                "must name the policy folder",
            ));
        }
        Ok(())
    }
}

/// A configuration for running the validator in-process against `nats_url` (tests,
/// `stagehand up`): every other table at its defaults.
pub fn config(
    nats_url: &str,
    policies_dir: impl Into<PathBuf>,
    state_dir: impl Into<PathBuf>,
) -> Config {
    ServiceConfig::new(
        BusConfig {
            client_name: SERVICE.into(),
            ..BusConfig::new(nats_url)
        },
        Settings::new(policies_dir, state_dir),
    )
}

/// Why the validator could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidatorError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("cannot open source tier {tier:?} at {location}: {source}")]
    Tier {
        tier: String,
        location: String,
        #[source]
        source: Box<TransferError>,
    },
    #[error("cannot create the state directory {}: {source}", path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The runner could not start or keep the service (configuration, metrics endpoint).
    #[error(transparent)]
    Run(Box<runner::RunError>),
}

impl ValidatorError {
    /// Whether starting again unchanged can succeed (NATS or a tier was briefly unavailable).
    pub fn is_retryable(&self) -> bool {
        match self {
            ValidatorError::Policy(_) | ValidatorError::StateDir { .. } => false,
            ValidatorError::Tier { source, .. } => source.is_retryable(),
            ValidatorError::Bus(e) => e.is_retryable(),
            ValidatorError::Run(e) => e.exit_code() != runner::EXIT_CONFIG,
        }
    }

    /// The validator's own error back out of the runner, or the runner's.
    fn from_run(e: runner::RunError) -> Self {
        match e {
            runner::RunError::Bus(e) => ValidatorError::Bus(e),
            runner::RunError::Service(source) => match source.downcast::<ValidatorError>() {
                Ok(own) => *own,
                Err(other) => ValidatorError::Run(Box::new(runner::RunError::Service(other))),
            },
            other => ValidatorError::Run(Box::new(other)),
        }
    }
}

/// Loads the policies and opens the source tiers (so that a mistake there fails before
/// anything connects), then runs the validator through the service runner until `shutdown`
/// is cancelled; in-flight requests then finish or are left for redelivery within the
/// runtime's shutdown deadline.
pub async fn run(
    config: Config,
    shutdown: CancellationToken,
) -> Result<WorkerStats, ValidatorError> {
    let handler = open(&config.service)?;
    runner::run(SERVICE, config, shutdown, move |ctx| {
        serve_with(handler, ctx)
    })
    .await
    .map_err(ValidatorError::from_run)
}

/// What the runner calls (the binary's `main`): opens the policies and tiers, then serves.
pub async fn serve(ctx: Context<Settings>) -> Result<WorkerStats, ValidatorError> {
    let handler = open(&ctx.settings)?;
    serve_with(handler, ctx).await
}

fn open(settings: &Settings) -> Result<IngestValidator, ValidatorError> {
    let policies = Policies::load_dir(&settings.policies_dir)?;
    let handler = IngestValidator::open(&policies, settings.read_concurrency)?;
    std::fs::create_dir_all(&settings.state_dir).map_err(|source| ValidatorError::StateDir {
        path: settings.state_dir.clone(),
        source,
    })?;
    tracing::info!(
        policies = %settings.policies_dir.display(),
        source_tiers = ?policies.tiers().values().filter(|t| t.role == stagehand_policy::TierRole::Source).map(|t| t.location()).collect::<Vec<_>>(),
        "ingest validator ready"
    );
    Ok(handler)
}

async fn serve_with(
    handler: IngestValidator,
    ctx: Context<Settings>,
) -> Result<WorkerStats, ValidatorError> {
    let mut cfg = ctx.settings.worker_config();
    ctx.worker.apply(&mut cfg);
    Ok(ctx.run_worker(cfg, handler).await?)
}
