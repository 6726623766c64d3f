//! The backup copier: independent copies of what the backup policy selects, proven, held, and
//! restored in practice.
//!
//! - **Backups** ([`backup`]): a worker on the facts stream consumes the kinds
//!   `policies/backup.toml` selects (`dataset.validated`, `dataset.prepared`,
//!   `checkpoint.committed`, filtered by project and checkpoint tag), copies each version
//!   with the mover to the backup tier as one atomic, verified set holding its manifest
//!   ([`layout`]), and publishes `backup.completed`. A source in the backup tier's failure
//!   domain is refused at run time (tiers.toml already refuses a backup tier that shares one
//!   with a tier it protects, at start-up).
//! - **Object Lock** (`src/lock.rs`): on an S3 backup tier with `[object_lock]`, the bucket's
//!   default retention holds every object from the moment it is written.
//! - **Restore drills** ([`drill`]): on the policy's clock, a sample of protected versions
//!   (oldest untested first, bounded by files and bytes) is restored to a scratch folder,
//!   every byte verified against the version's manifest, and `restore.verified` or
//!   `restore.failed` (with every problem) recorded.
//! - **Restores** ([`restore`]): `stagehand restore D@V --to TIER` copies a backup back,
//!   verified, and records `replica.created`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), stagehand_backup_copier::BackupError> {
//! use stagehand_backup_copier::{config, run};
//! let config = config("nats://127.0.0.1:4222", "policies", ".stagehand/state/backup-copier");
//! run(config, stagehand_bus::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

pub mod backup;
mod copier;
pub mod drill;
mod error;
pub mod layout;
mod lock;
pub mod restore;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use stagehand_bus::runner::{self, Context, InvalidKey, ServiceConfig, ServiceSettings};
use stagehand_bus::{Bus, BusError, BusErrorKind, CLAIMS_BUCKET, CancellationToken, WorkerConfig};
use stagehand_catalogue::Catalogue;
use stagehand_mover::MoverConfig;
use stagehand_policy::Policies;
use stagehand_schemas::subject;
use time::OffsetDateTime;
use tracing::{info, warn};

pub use backup::{Backups, backup_step};
pub use copier::Copier;
pub use drill::{Candidate, DrillReport, DrillResult};
pub use error::BackupError;
pub use restore::{RestoreReport, RestoreRequest, restore_step};

/// The service name: its durable consumer, its dead-letter subject, its ledger file.
pub const SERVICE: &str = "backup-copier";

/// The copier's own settings: the `[service]` table of its configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The policy folder (`tiers.toml`, `backup.toml`, ...).
    pub policies_dir: PathBuf,
    /// Where the service keeps its ledger (`backup-copier.redb`).
    pub state_dir: PathBuf,
    /// A folder on local disk where drills restore their samples and manifests pass through;
    /// default `<state_dir>/scratch`. It needs room for one drill's `drill_sample_bytes`.
    #[serde(default)]
    pub scratch_dir: Option<PathBuf>,
    /// How often the drill clock looks whether a drill is due (never more often than
    /// `drill_every` asks). Default 60 s.
    #[serde(default = "defaults::drill_check", with = "stagehand_config::duration")]
    pub drill_check: Duration,
    /// The mover's tunables (engine, concurrency, bandwidth cap); defaults suit a small
    /// machine.
    #[serde(default)]
    pub mover: MoverConfig,
}

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`Settings`] as `[service]`.
pub type Config = ServiceConfig<Settings>;

mod defaults {
    use std::time::Duration;
    pub fn drill_check() -> Duration {
        Duration::from_secs(60)
    }
    /// Backups copied at once: backups are background work.
    pub const CONCURRENCY: usize = 2;
    pub const MAX_DELIVER: i64 = 10;
    pub const ACK_WAIT: Duration = Duration::from_secs(60);
}

impl Settings {
    /// Settings with every tunable at its default.
    pub fn new(policies_dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            policies_dir: policies_dir.into(),
            state_dir: state_dir.into(),
            scratch_dir: None,
            drill_check: defaults::drill_check(),
            mover: MoverConfig::default(),
        }
    }

    /// Settings for a one-machine stack under `home` (`stagehand up`).
    pub fn dev(home: &Path, policies_dir: &Path) -> Self {
        Self::new(policies_dir, home.join("state").join(SERVICE))
    }

    /// The scratch folder.
    pub fn scratch(&self) -> PathBuf {
        self.scratch_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("scratch"))
    }

    /// The backup worker with the copier's defaults (2 at once, 10 deliveries, 60 s ack
    /// wait) before the `[worker]` table's overrides: the kinds `policy` selects, of every
    /// project, from the facts stream.
    pub fn worker_config(&self, policy: &stagehand_policy::BackupPolicy) -> WorkerConfig {
        let filters = policy
            .select
            .iter()
            .map(|k| subject::kind_filter("fact", k.kind()))
            .collect();
        let mut cfg = WorkerConfig::new(
            SERVICE,
            subject::FACTS.name,
            filters,
            self.state_dir.join(format!("{SERVICE}.redb")),
        );
        cfg.concurrency = defaults::CONCURRENCY;
        cfg.max_deliver = defaults::MAX_DELIVER;
        cfg.ack_wait = defaults::ACK_WAIT;
        cfg
    }
}

impl ServiceSettings for Settings {
    /// Checks the bounds; the policies are loaded when the service starts (their errors name
    /// the policy file and key).
    fn validate(&self) -> Result<(), InvalidKey> {
        if self.policies_dir.as_os_str().is_empty() {
            return Err(InvalidKey::new(
                "policies_dir",
                "must name the policy folder",
            ));
        }
        if self.drill_check.is_zero() {
            return Err(InvalidKey::new("drill_check", "must be longer than 0"));
        }
        if self.mover.concurrency == 0 {
            return Err(InvalidKey::new("mover.concurrency", "must be at least 1"));
        }
        Ok(())
    }
}

/// A configuration for running the copier in-process against `nats_url` (tests, `stagehand
/// up`): every other table at its defaults.
pub fn config(
    nats_url: &str,
    policies_dir: impl Into<PathBuf>,
    state_dir: impl Into<PathBuf>,
) -> Config {
    ServiceConfig::in_process(SERVICE, nats_url, Settings::new(policies_dir, state_dir))
}

/// Loads the policies and opens the tiers (so that a mistake there fails before anything
/// connects), then runs the copier through the service runner until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), BackupError> {
    let copier = open(&config.service)?;
    runner::run(SERVICE, config, shutdown, move |ctx| {
        serve_with(copier, ctx)
    })
    .await
    .map_err(runner::RunError::into_service_error)
}

/// What the runner calls (the binary's `main`): opens the policies and tiers, then serves.
pub async fn serve(ctx: Context<Settings>) -> Result<(), BackupError> {
    let copier = open(&ctx.settings)?;
    serve_with(copier, ctx).await
}

/// The copier `settings` describe: policies loaded (a backup tier sharing a failure domain
/// with a tier it protects is refused here, by the policy crate), the backup tier and the
/// scratch folder opened.
pub fn open(settings: &Settings) -> Result<Copier, BackupError> {
    let policies = Policies::load_dir(&settings.policies_dir)?;
    runner::create_state_dirs([settings.state_dir.as_path()])?;
    Copier::open(policies, &settings.scratch(), settings.mover.clone())
}

/// The backups worker and the drill clock, once the bucket's Object Lock is checked and what
/// killed runs left is swept.
async fn serve_with(copier: Copier, ctx: Context<Settings>) -> Result<(), BackupError> {
    copier.ensure_object_lock().await?;
    copier.sweep().await?;
    let copier = Arc::new(copier);
    info!(
        target_tier = %copier.target().name,
        location = %copier.target().location(),
        select = ?copier.policy().select.iter().map(|k| k.kind()).collect::<Vec<_>>(),
        drill_every = ?copier.policy().drill_every,
        "backup copier ready"
    );
    let backups = ctx.worker(ctx.settings.worker_config(copier.policy()));
    let mut tasks = ctx.tasks();
    let token = tasks.shutdown().clone();
    let handler = Backups::new(copier.clone(), ctx.bus.jetstream().clone());
    tasks.spawn(
        "backups",
        ctx.run_worker_until(backups, handler, token.clone()),
    );
    let clock = DrillClock::new(copier, ctx.bus.clone());
    tasks.spawn("drills", clock.every(ctx.settings.drill_check, token));
    Ok(ctx.join(tasks).await?)
}

/// The restore-drill clock: on each tick, a drill if one is due (see [`drill`]).
#[derive(Clone)]
pub struct DrillClock {
    copier: Arc<Copier>,
    bus: Bus,
    catalogue: Catalogue,
    /// When this process last started a drill.
    last: Arc<Mutex<Option<OffsetDateTime>>>,
}

impl DrillClock {
    pub fn new(copier: Arc<Copier>, bus: Bus) -> Self {
        let catalogue = Catalogue::new(bus.client().clone());
        DrillClock {
            copier,
            bus,
            catalogue,
            last: Arc::default(),
        }
    }

    /// Looks whether a drill is due every `check` (never less often than the policy's
    /// `drill_every` asks) until `stop` is cancelled.
    pub async fn every(self, check: Duration, stop: CancellationToken) -> Result<(), BackupError> {
        let period = check.min(self.copier.policy().drill_every);
        runner::every(period, stop.clone(), move || {
            let (clock, stop) = (self.clone(), stop.clone());
            async move {
                clock.tick(&stop).await;
                Ok(())
            }
        })
        .await
    }

    /// Runs a drill when one is due. A drill that cannot run (the catalogue or NATS
    /// unreachable) is said in the log and tried again on the next tick; it never stops the
    /// service.
    pub async fn tick(&self, cancel: &CancellationToken) {
        match self.tick_once(cancel).await {
            Ok(Some(report)) => info!(
                drill = %report.drill_id,
                verified = report.results.iter().filter(|r| r.problems.is_empty()).count(),
                failed = report.results.iter().filter(|r| !r.problems.is_empty()).count(),
                inconclusive = report.inconclusive.len(),
                "restore drill done"
            ),
            Ok(None) => {}
            Err(e) => {
                warn!(error = %e, "restore drill could not run; trying again on the next tick")
            }
        }
    }

    /// A drill if one is due: `None` when none was.
    pub async fn tick_once(
        &self,
        cancel: &CancellationToken,
    ) -> Result<Option<DrillReport>, BackupError> {
        let every = self.copier.policy().drill_every;
        let now = stagehand_schemas::now();
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| now - at < every) {
            return Ok(None);
        }
        let candidates = self.copier.drill_candidates(&self.catalogue).await?;
        let tier = &self.copier.target().name;
        drill::record_survey(tier, &candidates, None, now, every);
        if !drill::drill_due(&candidates, now, every) {
            return Ok(None);
        }
        if !self.claim(now, every).await? {
            return Ok(None);
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
        let id = drill::drill_id(&self.copier.target().name, now);
        let report = self
            .copier
            .drill(&self.bus, &candidates, &id, cancel)
            .await?;
        drill::record_survey(tier, &candidates, Some(&report), now, every);
        Ok(Some(report))
    }

    /// Claims this drill period of the backup tier in the claims bucket, so that of several
    /// copier instances one drills it; false when another has.
    async fn claim(&self, now: OffsetDateTime, every: Duration) -> Result<bool, BackupError> {
        let period = every.as_millis().max(1);
        let slot = (now.unix_timestamp_nanos() / 1_000_000).max(0) as u128 / period;
        let key = format!("{SERVICE}.drill.{}.{slot}", self.copier.target().name);
        let kv = self
            .bus
            .jetstream()
            .get_key_value(CLAIMS_BUCKET)
            .await
            .map_err(|e| {
                BackupError::Bus(BusError::with_source(
                    BusErrorKind::Claim,
                    format!("opening the claims bucket {CLAIMS_BUCKET} to claim a drill"),
                    e,
                ))
            })?;
        match kv.create(&key, "drill".into()).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
                Ok(false)
            }
            Err(e) => Err(BackupError::Bus(BusError::with_source(
                BusErrorKind::Claim,
                format!("claiming drill {key}"),
                e,
            ))),
        }
    }
}
