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
//!    whether the files are large or small. Each read is bounded by the mover
//!    (`Tier::hash_file_pieces`, [`source`]): a FIFO, socket, device or directory is
//!    `not_a_file` without blocking, a size other than the declared one or over
//!    `max_file_size` is found from `fstat` or the GET's `Content-Length` before any byte is
//!    read, and no file is read past its declared size + 1 byte; a path too long for the tier
//!    and an object store's 4xx about one object are that file's problems, not a retry.
//!    A posix file the page cache does not hold — the CLI writes its large copies with direct
//!    I/O, so an upload just placed is one — is read with `O_DIRECT` straight into the
//!    hashing buffer: the kernel's read-ahead and page-cache copy would otherwise cost about
//!    as much CPU as the hash, on the same two cores. A file larger than a piece
//!    (`stagehand_schemas::pieces::PIECE_BYTES`) also has the BLAKE3 hash of each piece taken in
//!    the same read, and its read task stores them in the services' manifest bucket, keyed by
//!    the SHA-256 found, before it ends ([`pieces`]): the side data node agents check each
//!    piece against when they fan the version out. Memory does not grow with the file
//!    count: no list of entries, set of paths or side data is kept, only a bounded window of
//!    entries in flight.
//! 4. **Progress**: about once a second a `WorkProgress` (files and bytes done of the total,
//!    phase `hashing`, an estimate of the time left) on core NATS at
//!    `progress_subject("ingest.requested", None, project, request id)`, for `stagehand ingest
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
//! use stagehand_ingest_validator::{config, run};
//! let config = config("nats://127.0.0.1:4222", "policies", ".stagehand/state");
//! run(config, stagehand_bus::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

pub mod check;
mod handler;
pub mod pieces;
pub mod report;
pub mod source;
pub mod validate;

use std::path::PathBuf;

use serde::Deserialize;
use stagehand_bus::runner::{
    self, Context, InvalidKey, ServiceConfig, ServiceError, ServiceSettings,
};
use stagehand_bus::{BusError, CancellationToken, WorkerConfig, WorkerStats};
use stagehand_policy::{Policies, PolicyError, TierError};
use stagehand_schemas::subject;

pub use handler::{
    IngestValidator, PHASE_HASHING, STEP_REJECTED, STEP_VALIDATED, SourceChecks, ValidatorOptions,
};
pub use report::report_path;
use stagehand_schemas::Retryable;

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
    /// A local directory for manifests too large for memory (about 100 bytes per file) and
    /// quarantine reports while they are written; `state_dir` when not set.
    #[serde(default)]
    pub spool_dir: Option<PathBuf>,
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
    pub fn max_attempts() -> u32 {
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
            spool_dir: None,
        }
    }

    /// The handler's options: read concurrency, spool (`state_dir` unless `spool_dir` is
    /// set), and `replicas` for the services' manifest bucket when the validator creates it.
    pub fn options(&self, replicas: usize) -> ValidatorOptions {
        let mut options = ValidatorOptions::new(self.spool_dir.as_ref().unwrap_or(&self.state_dir));
        options.read.concurrency = self.read_concurrency.max(1);
        options.replicas = replicas;
        options
    }

    /// The worker the validator runs, with the validator's defaults (4 requests at once, 8
    /// attempts, 30 s ack wait) before the `[worker]` table's overrides: `ingest.requested`
    /// of every project from the requests stream.
    pub fn worker_config(&self) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(
            SERVICE,
            subject::REQUESTS.name,
            vec![subject::kind_filter("req", "ingest.requested")],
            self.state_dir.join(format!("{SERVICE}.redb")),
        );
        cfg.concurrency = defaults::concurrency();
        cfg.max_attempts = defaults::max_attempts();
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
    ServiceConfig::in_process(SERVICE, nats_url, Settings::new(policies_dir, state_dir))
}

/// Why the validator could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidatorError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error("cannot prepare the spool directory {}: {source}", path.display())]
    Spool {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The state folder, or the runner (configuration, metrics endpoint).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl Retryable for ValidatorError {
    /// Whether starting again unchanged can succeed (NATS or a tier was briefly unavailable).
    fn is_retryable(&self) -> bool {
        match self {
            ValidatorError::Policy(_) | ValidatorError::Spool { .. } => false,
            ValidatorError::Tier(e) => e.is_retryable(),
            ValidatorError::Bus(e) => e.is_retryable(),
            ValidatorError::Service(e) => e.is_retryable(),
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
    let checks = open(&config.service).await?;
    runner::run(SERVICE, config, shutdown, move |ctx| {
        serve_with(checks, ctx)
    })
    .await
    .map_err(runner::RunError::into_service_error)
}

/// What the runner calls (the binary's `main`): opens the policies and tiers, then serves.
pub async fn serve(ctx: Context<Settings>) -> Result<WorkerStats, ValidatorError> {
    let checks = open(&ctx.settings).await?;
    serve_with(checks, ctx).await
}

/// The policies loaded and the source tiers opened: what can fail before connecting.
async fn open(settings: &Settings) -> Result<SourceChecks, ValidatorError> {
    let policies = Policies::load_dir(&settings.policies_dir)?;
    let checks = SourceChecks::open(&policies).await?;
    runner::create_state_dirs([settings.state_dir.as_path()])?;
    tracing::info!(
        policies = %settings.policies_dir.display(),
        source_tiers = ?policies.tiers().values().filter(|t| t.role == stagehand_policy::TierRole::Source).map(|t| t.location()).collect::<Vec<_>>(),
        "ingest validator ready"
    );
    Ok(checks)
}

/// The handler over the runner's connection (manifest buckets and progress go through it),
/// run as the validator's worker.
async fn serve_with(
    checks: SourceChecks,
    ctx: Context<Settings>,
) -> Result<WorkerStats, ValidatorError> {
    let options = ctx.settings.options(ctx.bus.replicas());
    let handler = IngestValidator::new(checks, ctx.bus.jetstream().clone(), options)?;
    let requests = ctx.worker(ctx.settings.worker_config());
    Ok(ctx.run_worker(requests, handler).await?)
}
