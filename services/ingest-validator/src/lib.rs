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
//! use stagehand_ingest_validator::{Config, run};
//! let config = Config::new("nats://127.0.0.1:4222", "policies", ".stagehand/state");
//! run(config, stagehand_bus::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

pub mod check;
mod handler;
pub mod source;
pub mod validate;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use stagehand_bus::{
    Bus, BusConfig, BusError, CancellationToken, WorkerConfig, WorkerStats, run_worker,
};
use stagehand_mover::TransferError;
use stagehand_policy::{Policies, PolicyError};
use stagehand_schemas::subject;

pub use handler::{IngestValidator, STEP_REJECTED, STEP_VALIDATED, marker_path};

/// The service name: its durable consumer, its dead-letter subject, its ledger file.
pub const SERVICE: &str = "ingest-validator";

/// How the validator runs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How to reach NATS.
    pub bus: BusConfig,
    /// The policy folder (`tiers.toml`, `validation.toml`, …).
    pub policies_dir: PathBuf,
    /// Where the service keeps its ledger (`ingest-validator.redb`).
    pub state_dir: PathBuf,
    /// Requests validated at once.
    #[serde(default = "defaults::concurrency")]
    pub concurrency: usize,
    /// Files read and hashed at once within one request.
    #[serde(default = "defaults::read_concurrency")]
    pub read_concurrency: usize,
    /// Failed attempts of a request before it is dead-lettered (a tier down that long). The
    /// runtime counts failures, not deliveries: waiting for another instance's claim is free.
    #[serde(default = "defaults::max_deliver")]
    pub max_deliver: i64,
    /// How long the server waits for an ack; progress acks restart it while files are hashed.
    #[serde(default = "defaults::ack_wait", with = "stagehand_bus::duration_str")]
    pub ack_wait: Duration,
}

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

impl Config {
    /// A configuration with every tunable at its default.
    pub fn new(
        nats_url: impl Into<String>,
        policies_dir: impl Into<PathBuf>,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            bus: BusConfig {
                client_name: SERVICE.into(),
                ..BusConfig::new(nats_url)
            },
            policies_dir: policies_dir.into(),
            state_dir: state_dir.into(),
            concurrency: defaults::concurrency(),
            read_concurrency: defaults::read_concurrency(),
            max_deliver: defaults::max_deliver(),
            ack_wait: defaults::ack_wait(),
        }
    }

    /// The worker the validator runs: `ingest.requested` of every project from the requests
    /// stream.
    pub fn worker_config(&self) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(
            SERVICE,
            subject::REQUESTS.name,
            vec![subject::kind_filter("req", "ingest.requested")],
            self.state_dir.join(format!("{SERVICE}.redb")),
        );
        cfg.concurrency = self.concurrency.max(1);
        let most = stagehand_bus::ledger::MAX_ATTEMPTS_KEPT as i64;
        cfg.max_attempts = u32::try_from(self.max_deliver.clamp(1, most)).unwrap_or(1);
        cfg.ack_wait = self.ack_wait;
        cfg
    }
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
}

impl ValidatorError {
    /// Whether starting again unchanged can succeed (NATS or a tier was briefly unavailable).
    pub fn is_retryable(&self) -> bool {
        match self {
            ValidatorError::Policy(_) | ValidatorError::StateDir { .. } => false,
            ValidatorError::Tier { source, .. } => source.is_retryable(),
            ValidatorError::Bus(e) => e.is_retryable(),
        }
    }
}

/// Loads the policies, opens the source tiers, connects, provisions the streams and runs the
/// worker until `shutdown` is cancelled; in-flight requests then finish or are left for
/// redelivery within the runtime's shutdown deadline.
pub async fn run(
    config: Config,
    shutdown: CancellationToken,
) -> Result<WorkerStats, ValidatorError> {
    let policies = Policies::load_dir(&config.policies_dir)?;
    let handler = IngestValidator::open(&policies, config.read_concurrency)?;
    std::fs::create_dir_all(&config.state_dir).map_err(|source| ValidatorError::StateDir {
        path: config.state_dir.clone(),
        source,
    })?;
    let bus = Bus::connect(&config.bus).await?;
    bus.provision().await?;
    tracing::info!(
        policies = %config.policies_dir.display(),
        source_tiers = ?policies.tiers().values().filter(|t| t.role == stagehand_policy::TierRole::Source).map(|t| t.location()).collect::<Vec<_>>(),
        "ingest validator started"
    );
    let stats = run_worker(bus, config.worker_config(), Arc::new(handler), shutdown).await?;
    Ok(stats)
}
