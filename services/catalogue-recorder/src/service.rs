//! The recorder as a service: rebuild if needed, then fold live facts (and stage requests),
//! serve queries, mirror readiness and stage statuses, until shutdown.

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

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
use crate::store::{Store, Writer, WriterThread};

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
pub struct Settings {
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
    // Every node's services: `_INBOX_node.<node>`, one user per node.
    "_INBOX_node",
];

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`Settings`] as
/// `[service]`.
pub type Config = ServiceConfig<Settings>;

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

impl Settings {
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

    /// The facts worker, before the `[worker]` table's overrides: every fact, on the
    /// instance's own consumer `<instance>` (every recorder folds every fact).
    pub fn facts_worker(&self) -> WorkerConfig {
        self.worker(
            &self.instance,
            FACTS.name,
            &subject::class_filter(subject::FACT),
        )
    }

    /// The dead-letter counter's worker, on `<instance>-dlq`.
    pub fn dead_letters_worker(&self) -> WorkerConfig {
        let consumer = format!("{}-dlq", self.instance);
        self.worker(
            &consumer,
            DEAD_LETTERS.name,
            &subject::class_filter(subject::DLQ),
        )
    }

    /// The worker of stage requests and releases (their statuses, for schedulers), on
    /// `<instance>-stages`.
    pub fn stage_requests_worker(&self) -> WorkerConfig {
        let consumer = format!("{}-stages", self.instance);
        self.worker(&consumer, REQUESTS.name, &stage_requests_filter())
    }

    /// A worker of `consumer` on `stream` for `filter` (comma-separated subjects), its ledger
    /// under `ledger_dir`, folding [`DEFAULT_CONCURRENCY`] at once.
    fn worker(&self, consumer: &str, stream: &str, filter: &str) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(
            consumer,
            stream,
            filter.split(',').map(str::to_owned).collect(),
            self.ledger_dir.join(format!("{consumer}.redb")),
        );
        cfg.concurrency = DEFAULT_CONCURRENCY;
        cfg
    }
}

impl ServiceSettings for Settings {
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
    ServiceConfig::in_process(SERVICE, nats_url, Settings::under(dir))
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
        .map_err(runner::RunError::into_service_error)
}

/// Serves a recorder on a connected bus until `ctx.shutdown` is cancelled: rebuilds the store
/// if needed, then folds facts (and dead letters) live through the worker runtime, answers
/// queries and mirrors readiness and stage statuses — tasks of one group, so that any of them
/// failing stops the recorder (its supervisor restarts it) instead of leaving a half-working
/// one.
pub async fn serve(ctx: Context<Settings>) -> Result<RecorderStats, RecorderError> {
    let settings = &ctx.settings;
    let facts = ctx.own_worker(settings.facts_worker())?;
    let dead_letters = ctx.own_worker(settings.dead_letters_worker())?;
    let stage_requests = ctx.own_worker(settings.stage_requests_worker())?;
    let (store, files, mirror, rebuilt) = open(&ctx).await?;
    crate::live::report_dead_letters_waiting(&store).await;
    let (writer, writer_thread) = Writer::start(store.clone());
    let mut tasks = ctx.tasks();
    let token = tasks.shutdown().clone();
    let store_failed: Arc<Mutex<Option<StoreError>>> = Arc::default();
    let fold = SharedFold(Arc::new(LiveFold {
        store: store.clone(),
        writer,
        files,
        mirror: mirror.clone(),
        stop: token.clone(),
        store_failed: store_failed.clone(),
    }));
    let replies = settings.replies();
    let (client, stats) = (ctx.bus.client().clone(), Stats::default());
    let worker =
        |cfg, into: &Slot| into.fill(ctx.run_worker_until(cfg, fold.clone(), token.clone()));
    let (retention, every) = (settings.stage_retention, settings.stage_prune_interval);
    tasks.spawn(
        "queries",
        serve_queries(
            client.clone(),
            store.clone(),
            replies.clone(),
            token.clone(),
        ),
    );
    tasks.spawn(
        "stage-pruning",
        crate::prune::every(store.clone(), retention, every, token.clone()),
    );
    tasks.spawn(
        "progress",
        follow_progress(client, store, mirror, token.clone()),
    );
    tasks.spawn(
        "stage-requests",
        worker(stage_requests, &stats.stage_requests),
    );
    tasks.spawn("facts", worker(facts, &stats.facts));
    if settings.dead_letters {
        tasks.spawn("dead-letters", worker(dead_letters, &stats.dead_letters));
    }
    let joined = ctx.join(tasks).await;
    release(fold, writer_thread, ctx.drain_deadline()).await;
    if let Some(e) = store_failed
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
    {
        return Err(RecorderError::Store(e));
    }
    joined?;
    Ok(RecorderStats {
        rebuilt,
        facts: stats.facts.take(),
        dead_letters: stats.dead_letters.take(),
        stage_requests: stats.stage_requests.take(),
        queries_refused: replies.refused(),
    })
}

/// The store opened (and upgraded, and rebuilt from the streams if it is missing or
/// incomplete), its file lists and the readiness mirror; the events a rebuild replayed.
async fn open(
    ctx: &Context<Settings>,
) -> Result<(Arc<Store>, FileLists, Mirror, Option<(u64, u64)>), RecorderError> {
    let path = ctx.settings.store_path.clone();
    let store = Arc::new(tokio::task::spawn_blocking(move || Store::open(path)).await??);
    note_upgrade_through(&ctx.bus, &store).await?;
    let mirror = Mirror::open(&ctx.bus).await?;
    let files = ctx.settings.file_lists(&ctx.bus, &store);
    let rebuilt = rebuild_if_needed(&ctx.bus, &store, &files, &mirror).await?;
    Ok((store, files, mirror, rebuilt))
}

/// Releases the store (the writer thread holds it) before the recorder returns, so that
/// whoever runs it can reopen the file at once. A handler still held by an abandoned task
/// would keep it; the wait is bounded by `deadline`.
async fn release(fold: SharedFold, writer_thread: WriterThread, deadline: Duration) {
    drop(fold);
    let released = tokio::task::spawn_blocking(move || writer_thread.join());
    if tokio::time::timeout(deadline, released).await.is_err() {
        tracing::warn!("catalogue writer still busy at the shutdown deadline");
    }
}

/// What each of the recorder's workers did, filled as each stops.
#[derive(Default)]
struct Stats {
    facts: Slot,
    dead_letters: Slot,
    stage_requests: Slot,
}

/// One worker's statistics, once it has stopped.
#[derive(Default, Clone)]
struct Slot(Arc<Mutex<WorkerStats>>);

impl Slot {
    /// `worker`, its statistics kept here when it stops cleanly.
    fn fill<W>(&self, worker: W) -> impl Future<Output = Result<(), BusError>> + Send + use<W>
    where
        W: Future<Output = Result<WorkerStats, BusError>> + Send + 'static,
    {
        let slot = self.clone();
        async move {
            let stats = worker.await?;
            *slot.0.lock().unwrap_or_else(PoisonError::into_inner) = stats;
            Ok(())
        }
    }

    fn take(&self) -> WorkerStats {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The fold handler shared by the recorder's workers.
#[derive(Clone)]
struct SharedFold(Arc<LiveFold>);

impl Handler for SharedFold {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.0.handle(event, ctx).await
    }

    async fn refused(&self, event: &Event, stream_sequence: u64, refusal: &Refusal) {
        self.0.refused(event, stream_sequence, refusal).await
    }
}
