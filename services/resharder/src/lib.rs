//! The resharder: packs a validated dataset version of many small files into WebDataset tar
//! shards — a **derived version** — so that staging a million images becomes staging a few
//! hundred files, without losing the proof of a single byte.
//!
//! For each `dataset.validated` that `policies/packing.toml` selects it:
//!
//! 1. opens the raw version's manifest (`stagehand-manifest`, verified against its digest);
//! 2. sorts every member by the seeded order of its sample ([`sample`], [`sort`]: a keyed
//!    hash, an external sort — keys, never bytes, in bounded memory);
//! 3. groups members into samples, judges them against the policy (required extensions;
//!    abort, warn or exclude) and places them in shards of the target size ([`plan`]);
//!    A raw version on an S3 source tier is fetched into the spool first (`fetch.rs`),
//!    every object checked against the manifest on the way;
//! 4. reads every member from the source tier on several threads, re-hashing it and comparing
//!    with the manifest, while one writer appends them to deterministic tar shards with a
//!    per-sample index of offsets, sizes and SHA-256 ([`mod@derive`], [`shard`]);
//! 5. publishes the shards, their indexes and `prepared.json` as one set, atomically, through
//!    the mover (`Mover::stage_set` → `StagedSet::publish_as`) under
//!    `<project>/<dataset>/<derived version>/` on the policy's target tier;
//! 6. publishes `dataset.prepared` with `derived_from`, the layout, the sample count, the seed
//!    and the shard manifest (inline when small, else in `stagehand_manifests`).
//!
//! The same raw version and seed give byte-identical shards, so the same derived version
//! digest. A member whose bytes no longer match the upload fails the derivation, naming its
//! path; nothing is published. A process killed mid-derivation leaves only a hidden staging
//! folder, which the retry removes before deriving again.
//!
//! ```no_run
//! # async fn demo() -> Result<(), stagehand_resharder::ReshardError> {
//! use stagehand_resharder::{config, run};
//! let config = config("nats://127.0.0.1:4222", "policies", ".stagehand/state/resharder");
//! run(config, stagehand_bus::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

pub mod derive;
mod fetch;
mod handler;
pub mod plan;
pub mod sample;
pub mod shard;
pub mod sort;

use std::path::PathBuf;

use serde::Deserialize;
use stagehand_bus::runner::{
    self, Context, InvalidKey, ServiceConfig, ServiceError, ServiceSettings,
};
use stagehand_bus::{BusError, CancellationToken, WorkerConfig, WorkerStats};
use stagehand_policy::{ByteSize, PolicyError, TierError};
use stagehand_schemas::{Retryable, subject};

pub use derive::{DeriveError, Derived, INCOMPLETE_FILE, PREPARED_FILE};
pub use handler::{Resharder, STEP_PREPARED, problem_report_path};

/// The service name: its durable consumer, its dead-letter subject, its ledger file.
pub const SERVICE: &str = "resharder";

/// The resharder's own settings: the `[service]` table of its configuration file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The policy folder (`tiers.toml`, `packing.toml`, …).
    pub policies_dir: PathBuf,
    /// Where the service keeps its ledger (`resharder.redb`) and spools manifests and the
    /// shuffle's sort runs (`spool/`; unnamed temporary files, gone with the process).
    pub state_dir: PathBuf,
    /// Threads reading and hashing members from the source tier.
    #[serde(default = "defaults::read_threads")]
    pub read_threads: usize,
    /// Bytes of member data handed to a reader at once.
    #[serde(default = "defaults::batch_bytes")]
    pub batch_bytes: ByteSize,
    /// Members larger than this are streamed into their shard instead of read whole first.
    #[serde(default = "defaults::stream_above")]
    pub stream_above: ByteSize,
    /// Memory the shuffle's sort uses before it spills a run to `state_dir/spool`.
    #[serde(default = "defaults::sort_memory")]
    pub sort_memory: ByteSize,
    /// A bound on bytes read from source tiers per second; absent means none.
    #[serde(default)]
    pub max_read_bytes_per_sec: Option<ByteSize>,
}

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`Settings`] as `[service]`.
pub type Config = ServiceConfig<Settings>;

mod defaults {
    use std::time::Duration;

    use stagehand_policy::ByteSize;

    pub fn read_threads() -> usize {
        4
    }
    pub fn batch_bytes() -> ByteSize {
        ByteSize(2 << 20)
    }
    pub fn stream_above() -> ByteSize {
        ByteSize(16 << 20)
    }
    pub fn sort_memory() -> ByteSize {
        ByteSize(64 << 20)
    }
    /// One derivation at a time: each already keeps every core busy.
    pub fn concurrency() -> usize {
        1
    }
    /// A failed derivation (a tier down, the disk full) is retried a few times: each costs a
    /// full pass over the version.
    pub fn max_attempts() -> u32 {
        5
    }
    pub fn ack_wait() -> Duration {
        Duration::from_secs(60)
    }
}

impl Settings {
    /// Settings with every tunable at its default.
    pub fn new(policies_dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            policies_dir: policies_dir.into(),
            state_dir: state_dir.into(),
            read_threads: defaults::read_threads(),
            batch_bytes: defaults::batch_bytes(),
            stream_above: defaults::stream_above(),
            sort_memory: defaults::sort_memory(),
            max_read_bytes_per_sec: None,
        }
    }

    /// Settings for a one-machine stack under `home` (`stagehand up`).
    pub fn dev(home: &std::path::Path, policies_dir: &std::path::Path) -> Self {
        Self::new(policies_dir, home.join("state").join(SERVICE))
    }

    /// The worker the resharder runs, with its defaults (one derivation at a time, 5
    /// attempts, 60 s ack wait, renewed by progress acks while a derivation runs) before the
    /// `[worker]` table's overrides: `dataset.validated` of every project from the facts
    /// stream.
    pub fn worker_config(&self) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(
            SERVICE,
            subject::FACTS.name,
            vec![subject::kind_filter("fact", "dataset.validated")],
            self.state_dir.join(format!("{SERVICE}.redb")),
        );
        cfg.concurrency = defaults::concurrency();
        cfg.max_attempts = defaults::max_attempts();
        cfg.ack_wait = defaults::ack_wait();
        cfg
    }

    /// Where manifests and sort runs are spooled.
    pub fn spool_dir(&self) -> PathBuf {
        self.state_dir.join("spool")
    }
}

impl ServiceSettings for Settings {
    /// Checks the bounds. The policies themselves are loaded when the service starts (their
    /// errors name the policy file and key).
    fn validate(&self) -> Result<(), InvalidKey> {
        if self.policies_dir.as_os_str().is_empty() {
            return Err(InvalidKey::new(
                "policies_dir",
                "must name the policy folder",
            ));
        }
        if !(1..=256).contains(&self.read_threads) {
            return Err(InvalidKey::new(
                "read_threads",
                format!("{} is not in 1..=256", self.read_threads),
            ));
        }
        if !(64 << 10..=1 << 30).contains(&self.batch_bytes.bytes()) {
            return Err(InvalidKey::new(
                "batch_bytes",
                format!("{} is not between 64 KiB and 1 GiB", self.batch_bytes),
            ));
        }
        if self.stream_above.bytes() > 1 << 30 {
            return Err(InvalidKey::new(
                "stream_above",
                format!("{} is above 1 GiB", self.stream_above),
            ));
        }
        if self.sort_memory.bytes() < 1 << 20 {
            return Err(InvalidKey::new(
                "sort_memory",
                format!("{} is below 1 MiB", self.sort_memory),
            ));
        }
        if self.max_read_bytes_per_sec.is_some_and(|b| b.bytes() == 0) {
            return Err(InvalidKey::new(
                "max_read_bytes_per_sec",
                "must be more than 0; leave it out for no limit",
            ));
        }
        Ok(())
    }
}

/// A configuration for running the resharder in-process against `nats_url` (tests, `stagehand
/// up`): every other table at its defaults.
pub fn config(
    nats_url: &str,
    policies_dir: impl Into<PathBuf>,
    state_dir: impl Into<PathBuf>,
) -> Config {
    ServiceConfig::in_process(SERVICE, nats_url, Settings::new(policies_dir, state_dir))
}

/// Why the resharder could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReshardError {
    /// A policy file is wrong, or `packing.toml`, which the resharder needs, is absent.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The packing policy's target tier cannot hold shards written by this service.
    #[error("target tier {tier:?}: {reason}")]
    Target { tier: String, reason: String },
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The state folder, or the runner (configuration, metrics endpoint).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl Retryable for ReshardError {
    /// Whether starting again unchanged can succeed (NATS or a tier was briefly unavailable).
    fn is_retryable(&self) -> bool {
        match self {
            ReshardError::Policy(_) | ReshardError::Target { .. } => false,
            ReshardError::Tier(e) => e.is_retryable(),
            ReshardError::Bus(e) => e.is_retryable(),
            ReshardError::Service(e) => e.is_retryable(),
        }
    }
}

/// Runs the resharder through the service runner until `shutdown` is cancelled (tests,
/// `stagehand up`); a derivation in flight is then dropped unpublished and redelivered later.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<WorkerStats, ReshardError> {
    runner::run(SERVICE, config, shutdown, serve)
        .await
        .map_err(runner::RunError::into_service_error)
}

/// What the runner calls (the binary's `main`): loads the policies, opens the tiers, sweeps
/// what a killed run left on the target tier, then serves `dataset.validated`.
pub async fn serve(ctx: Context<Settings>) -> Result<WorkerStats, ReshardError> {
    let resharder = Resharder::open(&ctx.settings, &ctx.bus).await?;
    let validated = ctx.worker(ctx.settings.worker_config());
    Ok(ctx.run_worker(validated, resharder).await?)
}
