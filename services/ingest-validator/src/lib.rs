//! The ingest validator: reads every byte of every upload and says whether it is what its
//! manifest claims, at any dataset size.
//!
//! For each `ingest.requested` it publishes one fact: `dataset.validated` or
//! `dataset.rejected`. In order:
//!
//! 1. **The request** ([`check::request_problems`]): the source tier is declared with role
//!    `source`; the source prefix is a confined relative path *beneath the project's own
//!    prefix* `<project>/` (else `outside_project`: no request names, hashes or validates
//!    another project's files); the declared entry count and byte total are within the
//!    policy's `max_entries` and `max_total_bytes`. A problem here rejects the request before
//!    its manifest is opened or any file read. An event carrying both inline `files` and a
//!    `manifest` reference is rejected too (`manifest_malformed`).
//! 2. **The manifest**, opened through `stagehand-manifest` (the one manifest reader): inline
//!    entries, or the object the reference names in the project's upload bucket, fetched to a
//!    local spool and verified (digest, counts, canonical lines) before any entry is used. An
//!    object whose bytes are not its digest is `manifest_mismatch`; one that is not canonical
//!    lines is `manifest_malformed` (naming the line). A missing object or bucket is not an
//!    answer: the request is retried with backoff and dead-lettered with the reason when its
//!    deliveries run out.
//! 3. **Every entry, streamed** ([`validate`]): entries arrive in path order a chunk at a time
//!    and are judged as they pass (path rules, duplicates — adjacent in path order —, hash
//!    form, size and suffix rules; [`check::EntryChecks`]). Those worth reading are read on
//!    the source tier, up to `read_concurrency` at once across files, so both cores hash
//!    whether the files are large or small. Each read is bounded ([`source`]): a confined
//!    stat (or S3 HEAD) first, so a missing path, a FIFO, socket, device or directory
//!    (`not_a_file`, without blocking), a size other than the declared one or over
//!    `max_file_size` is found without reading a byte; a path too long for the tier is that
//!    file's `path_rule`. Memory does not grow with the file count: no list of entries or set
//!    of paths is kept, only a bounded window of entries in flight.
//! 4. **Progress**: about once a second a `WorkProgress` (files and bytes done of the total,
//!    phase `hashing`, an estimate of the time left) on core NATS at
//!    `progress_subject("ingest.requested", project, request id)`, for `stagehand ingest
//!    --wait`; progress acks keep the message while it is worked on.
//! 5. **The verdict.** Valid: the verified manifest is stored in the services' manifest
//!    bucket (unless it fits inline in the event) and `dataset.validated` carries the
//!    reference (or the files) and `version` = the digest *measured* over what was read.
//!    Rejected: every problem, as it is found, goes into a bounded tally (the first that fit
//!    the event, a count per code, the total: `problems`, `problem_counts`, `problems_total`)
//!    and into a JSON-lines quarantine report spooled on local disk and then put with the
//!    mover beside the upload at `.stagehand/quarantine/<project>/<request-id>.jsonl` on the
//!    source tier ([`report`]); `quarantine` points at it. No event exceeds
//!    `wire::MAX_EVENT_BYTES` whatever the dataset. A rejected upload is never moved or
//!    deleted.
//!
//! Problems with the data are answers (a rejection); a tier or a manifest that cannot be
//! reached is not an answer, and the request is retried later with backoff by the worker
//! runtime.
//!
//! The handler ([`IngestValidator`]) is built from the opened tiers ([`SourceChecks`], no
//! connection needed, so a policy or tier mistake fails at start) and a JetStream context
//! (`IngestValidator::new(checks, bus.jetstream().clone(), options)`), through which it reads
//! and writes manifests and publishes progress.
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
pub mod report;
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

pub use handler::{
    IngestValidator, PHASE_HASHING, STEP_REJECTED, STEP_VALIDATED, SourceChecks, ValidatorOptions,
};
pub use report::report_path;

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
    /// A local directory for manifests too large for memory (about 100 bytes per file) and
    /// quarantine reports while they are written; the state directory when not set.
    #[serde(default)]
    pub spool_dir: Option<PathBuf>,
    /// Deliveries of a request before it is dead-lettered (a tier down that long).
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
            spool_dir: None,
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
        cfg.max_deliver = self.max_deliver;
        cfg.ack_wait = self.ack_wait;
        cfg
    }

    /// The handler's options: read concurrency, spool (the state directory unless
    /// `spool_dir` is set), manifest bucket replicas (the bus's).
    pub fn options(&self) -> ValidatorOptions {
        let mut options = ValidatorOptions::new(self.spool_dir.as_ref().unwrap_or(&self.state_dir));
        options.read.concurrency = self.read_concurrency.max(1);
        options.replicas = self.bus.replicas;
        options
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
    #[error("cannot prepare the spool directory {}: {source}", path.display())]
    Spool {
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
            ValidatorError::Policy(_)
            | ValidatorError::StateDir { .. }
            | ValidatorError::Spool { .. } => false,
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
    let checks = SourceChecks::open(&policies)?;
    std::fs::create_dir_all(&config.state_dir).map_err(|source| ValidatorError::StateDir {
        path: config.state_dir.clone(),
        source,
    })?;
    let bus = Bus::connect(&config.bus).await?;
    bus.provision().await?;
    let handler = IngestValidator::new(checks, bus.jetstream().clone(), config.options())?;
    tracing::info!(
        policies = %config.policies_dir.display(),
        source_tiers = ?policies.tiers().values().filter(|t| t.role == stagehand_policy::TierRole::Source).map(|t| t.location()).collect::<Vec<_>>(),
        "ingest validator started"
    );
    let stats = run_worker(bus, config.worker_config(), Arc::new(handler), shutdown).await?;
    Ok(stats)
}
