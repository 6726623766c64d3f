//! The recorder as a service: rebuild if needed, then fold live facts (and stage requests),
//! serve queries, mirror readiness and stage statuses, until shutdown.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use stagehand_bus::runner::{self, Context, InvalidKey, ServiceConfig, ServiceSettings};
use stagehand_bus::{Bus, BusError, Handler, HandlerError, WorkContext, WorkerConfig, WorkerStats};
use stagehand_manifest::Spool;
use stagehand_schemas::subject::{self, DEAD_LETTERS, FACTS, REQUESTS};
use stagehand_schemas::{Event, Refusal};
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::files::FileLists;
use crate::live::{LiveFold, Mirror, follow_progress, mirror_all};
use crate::query::{Replies, serve as serve_queries};
use crate::replay::replay;
use crate::store::{Store, Writer};

/// The requests the recorder folds besides facts: stage requests and their releases, whose
/// statuses it keeps for schedulers (a comma-separated list of filters).
fn stage_requests_filter() -> String {
    [
        subject::kind_filter(subject::REQ, "stage.requested"),
        subject::kind_filter(subject::REQ, "stage.released"),
    ]
    .join(",")
}

/// The recorder's own settings: the `[service]` table of its configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecorderConfig {
    /// The instance name: its durable consumers are `<instance>` (facts), `<instance>-dlq`
    /// (dead letters) and `<instance>-stages` (stage requests and releases). Every recorder keeps a whole catalogue, so each instance needs its own
    /// name; queries are shared through the queue group.
    #[serde(default = "default_instance")]
    pub instance: String,
    /// The catalogue's redb file. Missing (or left incomplete) → rebuilt from the streams.
    pub store_path: PathBuf,
    /// Directory of the runtime's ledgers for the two workers.
    pub ledger_dir: PathBuf,
    /// Whether to count dead letters from the dead-letter stream.
    #[serde(default = "default_true")]
    pub dead_letters: bool,
    /// Where large manifests are spooled while their entries are written into the store
    /// (about 100 bytes per file of the largest version); default: the store's directory.
    #[serde(default)]
    pub manifest_spool: Option<PathBuf>,
    /// How long fetching one manifest may take before the fact is retried later.
    #[serde(
        default = "default_manifest_timeout",
        with = "stagehand_config::duration"
    )]
    pub manifest_timeout: std::time::Duration,
    /// Inbox prefixes whose inboxes catalogue queries are answered on, besides
    /// [`DEFAULT_INBOX_PREFIXES`]: those of clients that set their own (`bus.inbox_prefix`, a
    /// creds or NKey user). A query with any other reply subject is refused and counted.
    #[serde(default)]
    pub inbox_prefixes: Vec<String>,
    /// How long a stage request's record is kept once it holds nothing (released, failed, or
    /// past its job's `hold_until`) and has not changed (`"336h"`, 14 days, by default); then
    /// it is pruned with its indexes.
    #[serde(
        default = "default_stage_retention",
        with = "stagehand_config::duration"
    )]
    pub stage_retention: std::time::Duration,
    /// How often stage records are pruned (`"1h"` by default; the first time one interval
    /// after start).
    #[serde(
        default = "default_stage_prune_interval",
        with = "stagehand_config::duration"
    )]
    pub stage_prune_interval: std::time::Duration,
}

/// The inbox prefixes queries are answered on as shipped: the unauthenticated default
/// (`_INBOX`, a one-machine stack), `_R_`, the one-off reply subjects nats-server gives
/// requests that cross from another account (a tenant's or scheduler's: the server delivers the
/// answer into the asker's own account, so it can land nowhere in Stagehand's), and
/// `_INBOX_<user>` of each shipped user in Stagehand's own account that queries the catalogue
/// (`deploy/nats/accounts.conf` grants the recorder's user exactly these).
pub const DEFAULT_INBOX_PREFIXES: &[&str] = &[
    "_INBOX",
    "_R_",
    "_INBOX_scheduler",
    "_INBOX_promoter",
    "_INBOX_demoter",
    "_INBOX_backup-copier",
    "_INBOX_operator",
];

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`RecorderConfig`] as
/// `[service]`.
pub type Config = ServiceConfig<RecorderConfig>;

/// The service name: the metrics label and the default instance name.
pub const SERVICE: &str = "catalogue-recorder";

fn default_instance() -> String {
    SERVICE.into()
}
fn default_true() -> bool {
    true
}
fn default_manifest_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(120)
}
fn default_stage_retention() -> std::time::Duration {
    crate::prune::DEFAULT_STAGE_RETENTION
}
fn default_stage_prune_interval() -> std::time::Duration {
    crate::prune::DEFAULT_STAGE_PRUNE_INTERVAL
}
/// Facts folded at once (the writer commits whatever is queued in one transaction), unless
/// `[worker] concurrency` says otherwise.
const DEFAULT_CONCURRENCY: usize = 64;
/// How long in-flight folds may take after shutdown is asked for, unless `[worker]
/// shutdown_deadline` says otherwise.
const DEFAULT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl RecorderConfig {
    /// A configuration with its store and ledgers under `dir`.
    pub fn under(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        Self {
            instance: default_instance(),
            store_path: dir.join("catalogue.redb"),
            ledger_dir: dir.join("catalogue-ledger"),
            dead_letters: true,
            manifest_spool: None,
            manifest_timeout: default_manifest_timeout(),
            inbox_prefixes: Vec::new(),
            stage_retention: default_stage_retention(),
            stage_prune_interval: default_stage_prune_interval(),
        }
    }

    /// Where answers to queries may go: the shipped inbox prefixes and the configured ones.
    pub fn replies(&self) -> Replies {
        Replies::new(
            DEFAULT_INBOX_PREFIXES
                .iter()
                .copied()
                .chain(self.inbox_prefixes.iter().map(String::as_str)),
        )
    }

    /// The file lists reader this configuration asks for.
    fn file_lists(&self, bus: &Bus, store: &Arc<Store>) -> FileLists {
        let spool = self
            .manifest_spool
            .clone()
            .or_else(|| self.store_path.parent().map(std::path::Path::to_path_buf))
            .unwrap_or_else(std::env::temp_dir);
        FileLists::new(
            bus.jetstream().clone(),
            store.clone(),
            Spool::in_dir(spool),
            self.manifest_timeout,
        )
    }

    /// Settings for a one-machine stack under `home` (`stagehand up`).
    pub fn dev(home: &std::path::Path, _policies_dir: &std::path::Path) -> Self {
        Self::under(home.join("state").join("catalogue"))
    }
}

impl ServiceSettings for RecorderConfig {
    fn validate(&self) -> Result<(), InvalidKey> {
        if !stagehand_schemas::subject::is_subject_token(&self.instance) || self.instance.len() > 60
        {
            return Err(InvalidKey::new(
                "instance",
                format!(
                    "{:?} must be 1-60 characters of [a-z0-9_-] (it names durable consumers)",
                    self.instance
                ),
            ));
        }
        for prefix in &self.inbox_prefixes {
            let body = prefix.trim_end_matches('.');
            let plain = !body.is_empty()
                && !body.split('.').any(str::is_empty)
                && !body
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '*' | '>'));
            if !plain || body.starts_with('$') || subject::is_under_root(body) {
                return Err(InvalidKey::new(
                    "inbox_prefixes",
                    format!(
                        "{prefix:?} is no inbox prefix: it must be a plain subject prefix \
                         (no wildcard, blank or empty token), and neither a `$` API subject \
                         nor a `stagehand.` one"
                    ),
                ));
            }
        }
        if self.stage_prune_interval.is_zero() {
            return Err(InvalidKey::new(
                "stage_prune_interval",
                "must be longer than zero",
            ));
        }
        Ok(())
    }
}

/// A configuration for running a recorder in-process against `nats_url` with its files under
/// `dir` (tests, `stagehand up`).
pub fn config(nats_url: &str, dir: impl Into<PathBuf>) -> Config {
    ServiceConfig::new(
        stagehand_bus::BusConfig {
            client_name: SERVICE.into(),
            ..stagehand_bus::BusConfig::new(nats_url)
        },
        RecorderConfig::under(dir),
    )
}

/// What a recorder did before it stopped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecorderStats {
    /// The rebuild at start, if the store needed one: facts and dead letters replayed.
    pub rebuilt: Option<(u64, u64)>,
    pub facts: WorkerStats,
    pub dead_letters: WorkerStats,
    /// Stage requests and releases (from the requests stream).
    pub stage_requests: WorkerStats,
    /// Catalogue queries refused because their reply subject was no inbox it answers.
    pub queries_refused: u64,
}

/// Rebuilds `store` from the facts, dead-letter and (stage) request streams if it is not
/// complete, and mirrors what the replay touched. Returns the events replayed (facts, dead
/// letters), or `None` when the store was complete already.
pub(crate) async fn rebuild_if_needed(
    bus: &Bus,
    store: &Arc<Store>,
    files: &FileLists,
    mirror: &Mirror,
) -> Result<Option<(u64, u64)>, RecorderError> {
    let s = store.clone();
    let complete = tokio::task::spawn_blocking(move || s.is_complete()).await??;
    if complete {
        return Ok(None);
    }
    tracing::info!(store = %store.path().display(), "catalogue store missing or incomplete: rebuilding from the facts stream");
    let js = bus.jetstream();
    let facts = replay(
        js,
        FACTS.name,
        &subject::class_filter(subject::FACT),
        store,
        files,
    )
    .await?;
    let dead = replay(
        js,
        DEAD_LETTERS.name,
        &subject::class_filter(subject::DLQ),
        store,
        files,
    )
    .await?;
    let requests = replay(js, REQUESTS.name, &stage_requests_filter(), store, files).await?;
    let touched = [facts.touched.clone(), requests.touched.clone()].concat();
    let stages = [facts.stages.clone(), requests.stages.clone()].concat();
    mirror_all(store, mirror, touched, stages).await?;
    let s = store.clone();
    let through = facts.through;
    tokio::task::spawn_blocking(move || s.mark_complete(through)).await??;
    tracing::info!(
        facts = facts.events,
        dead_letters = dead.events,
        stage_requests = requests.events,
        undecodable = facts.undecodable + dead.undecodable + requests.undecodable,
        skipped = facts.skipped + dead.skipped + requests.skipped,
        batches = facts.batches + dead.batches + requests.batches,
        "catalogue rebuilt"
    );
    Ok(Some((facts.events, dead.events)))
}

/// For a store just upgraded from layout 4, notes each stream's last sequence before anything
/// is folded: layout 4's applied events (by bare id) answer for messages up to it only.
async fn note_upgrade_through(bus: &Bus, store: &Arc<Store>) -> Result<(), RecorderError> {
    let s = store.clone();
    if !tokio::task::spawn_blocking(move || s.upgrade_pending()).await?? {
        return Ok(());
    }
    let mut through = Vec::new();
    for stream in [FACTS.name, DEAD_LETTERS.name, REQUESTS.name] {
        let mut handle = bus
            .jetstream()
            .get_stream(stream)
            .await
            .map_err(|e| RecorderError::nats("reading a stream's last sequence", e))?;
        let info = handle
            .info()
            .await
            .map_err(|e| RecorderError::nats("reading a stream's last sequence", e))?;
        through.push((stream, info.state.last_sequence));
    }
    tracing::info!(
        ?through,
        "upgraded catalogue: earlier applied events answer for messages up to these sequences"
    );
    let s = store.clone();
    tokio::task::spawn_blocking(move || s.note_upgrade_through(&through)).await??;
    Ok(())
}

/// Runs a recorder through the service runner (connect, provision, serve, drain) until
/// `shutdown` is cancelled.
pub async fn run(
    config: Config,
    shutdown: CancellationToken,
) -> Result<RecorderStats, RecorderError> {
    runner::run(SERVICE, config, shutdown, serve)
        .await
        .map_err(|e| match e {
            runner::RunError::Service(source) => match source.downcast::<RecorderError>() {
                Ok(own) => *own,
                Err(other) => RecorderError::Runner(runner::RunError::Service(other)),
            },
            runner::RunError::Bus(e) => RecorderError::Bus(e),
            other => RecorderError::Runner(other),
        })
}

/// Serves a recorder on a connected bus until `ctx.shutdown` is cancelled: rebuilds the store
/// if needed, then folds facts (and dead letters) live through the worker runtime, answers
/// queries and mirrors readiness and stage statuses — tasks of one group, so that any of them failing stops
/// the recorder (its supervisor restarts it) instead of leaving a half-working one.
pub async fn serve(ctx: Context<RecorderConfig>) -> Result<RecorderStats, RecorderError> {
    let config = ctx.settings.clone();
    let path = config.store_path.clone();
    let store = Arc::new(tokio::task::spawn_blocking(move || Store::open(path)).await??);
    note_upgrade_through(&ctx.bus, &store).await?;
    let mirror = Mirror::open(&ctx.bus).await?;
    let files = config.file_lists(&ctx.bus, &store);
    let rebuilt = rebuild_if_needed(&ctx.bus, &store, &files, &mirror).await?;
    let (writer, writer_thread) = Writer::start(store.clone());
    let mut tasks = ctx.tasks();
    let token = tasks.shutdown().clone();
    let store_failed: Arc<Mutex<Option<StoreError>>> = Arc::default();
    let handler = Arc::new(LiveFold {
        store: store.clone(),
        writer,
        files,
        mirror: mirror.clone(),
        stop: token.clone(),
        store_failed: store_failed.clone(),
    });

    let worker = |consumer: &str, stream: &str, filter: &str| {
        let mut cfg = WorkerConfig::new(
            consumer,
            stream,
            filter.split(',').map(str::to_owned).collect(),
            config.ledger_dir.join(format!("{consumer}.redb")),
        );
        cfg.concurrency = DEFAULT_CONCURRENCY;
        cfg.shutdown_deadline = DEFAULT_DEADLINE;
        ctx.worker.apply(&mut cfg);
        // Folding is idempotent and every instance folds every fact: nothing to claim.
        cfg.claims = false;
        cfg
    };
    let facts_cfg = worker(
        &config.instance,
        FACTS.name,
        &subject::class_filter(subject::FACT),
    );
    let dlq_cfg = worker(
        &format!("{}-dlq", config.instance),
        DEAD_LETTERS.name,
        &subject::class_filter(subject::DLQ),
    );
    let stages_cfg = worker(
        &format!("{}-stages", config.instance),
        REQUESTS.name,
        &stage_requests_filter(),
    );
    let deadline = facts_cfg.shutdown_deadline;

    let facts_stats = Arc::new(std::sync::Mutex::new(WorkerStats::default()));
    let dlq_stats = Arc::new(std::sync::Mutex::new(WorkerStats::default()));
    let stages_stats = Arc::new(std::sync::Mutex::new(WorkerStats::default()));
    let replies = config.replies();
    tasks.spawn(
        "queries",
        serve_queries(
            ctx.bus.client().clone(),
            store.clone(),
            replies.clone(),
            token.clone(),
        ),
    );
    tasks.spawn(
        "stage-pruning",
        crate::prune::every(
            store.clone(),
            config.stage_retention,
            config.stage_prune_interval,
            token.clone(),
        ),
    );
    tasks.spawn(
        "progress",
        follow_progress(
            ctx.bus.client().clone(),
            store.clone(),
            mirror,
            token.clone(),
        ),
    );
    let stages = ctx.run_worker_until(stages_cfg, SharedFold(handler.clone()), token.clone());
    let into = stages_stats.clone();
    tasks.spawn("stage-requests", async move {
        let stats = stages.await?;
        *into.lock().unwrap_or_else(|p| p.into_inner()) = stats;
        Ok::<(), BusError>(())
    });
    let facts = ctx.run_worker_until(facts_cfg, SharedFold(handler.clone()), token.clone());
    let into = facts_stats.clone();
    tasks.spawn("facts", async move {
        let stats = facts.await?;
        *into.lock().unwrap_or_else(|p| p.into_inner()) = stats;
        Ok::<(), BusError>(())
    });
    if config.dead_letters {
        let dead = ctx.run_worker_until(dlq_cfg, SharedFold(handler.clone()), token.clone());
        let into = dlq_stats.clone();
        tasks.spawn("dead-letters", async move {
            let stats = dead.await?;
            *into.lock().unwrap_or_else(|p| p.into_inner()) = stats;
            Ok::<(), BusError>(())
        });
    }
    let joined = tasks.join(deadline).await;
    // Release the store (the writer thread holds it) before returning, so that whoever runs
    // the recorder can reopen the file at once. A handler still held by an abandoned task would
    // keep it; the wait is bounded by the shutdown deadline.
    drop(handler);
    let released = tokio::task::spawn_blocking(move || writer_thread.join());
    if tokio::time::timeout(deadline, released).await.is_err() {
        tracing::warn!("catalogue writer still busy at the shutdown deadline");
    }
    let failed = store_failed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(e) = failed {
        return Err(RecorderError::Store(e));
    }
    joined?;
    let facts = facts_stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let dead_letters = dlq_stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let stage_requests = stages_stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(RecorderStats {
        rebuilt,
        facts,
        dead_letters,
        stage_requests,
        queries_refused: replies.refused(),
    })
}

/// The fold handler shared by the recorder's workers.
struct SharedFold(Arc<LiveFold>);

impl Handler for SharedFold {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.0.handle(event, ctx).await
    }

    async fn refused(&self, event: &Event, stream_sequence: u64, refusal: &Refusal) {
        self.0.refused(event, stream_sequence, refusal).await
    }
}
