//! The recorder as a service: rebuild if needed, then fold live facts, serve queries, mirror
//! readiness, until shutdown.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};

use stagehand_bus::{Bus, HandlerError, WorkerConfig, WorkerStats, run_worker};
use stagehand_manifest::Spool;
use stagehand_schemas::subject::{DEAD_LETTERS, FACTS, REQUESTS};
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::files::FileLists;
use crate::live::{LiveFold, Mirror, follow_progress, mirror_all};
use crate::query::serve;
use crate::replay::replay;
use crate::store::{Store, Writer};

/// The requests the recorder folds besides facts: stage requests and their releases, whose
/// statuses it keeps for schedulers (a comma-separated list of filters).
const STAGE_REQUESTS_FILTER: &str =
    "stagehand.req.stage.requested.*,stagehand.req.stage.released.*";

/// Configuration of one recorder instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecorderConfig {
    /// The instance name: its durable consumers are `<instance>` (facts) and `<instance>-dlq`
    /// (dead letters). Every recorder keeps a whole catalogue, so each instance needs its own
    /// name; queries are shared through the queue group.
    #[serde(default = "default_instance")]
    pub instance: String,
    /// The catalogue's redb file. Missing (or left incomplete) → rebuilt from the streams.
    pub store_path: PathBuf,
    /// Directory of the runtime's ledgers for the two workers.
    pub ledger_dir: PathBuf,
    /// Facts folded at once (the writer commits whatever is queued in one transaction).
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Whether to count dead letters from the dead-letter stream.
    #[serde(default = "default_true")]
    pub dead_letters: bool,
    /// How long in-flight folds may take after shutdown is asked for.
    #[serde(default = "default_deadline", with = "stagehand_bus::duration_str")]
    pub shutdown_deadline: std::time::Duration,
    /// Where large manifests are spooled while their entries are written into the store
    /// (about 100 bytes per file of the largest version); default: the store's directory.
    #[serde(default)]
    pub manifest_spool: Option<PathBuf>,
    /// How long fetching one manifest may take before the fact is retried later.
    #[serde(
        default = "default_manifest_timeout",
        with = "stagehand_bus::duration_str"
    )]
    pub manifest_timeout: std::time::Duration,
}

fn default_instance() -> String {
    "catalogue-recorder".into()
}
fn default_concurrency() -> usize {
    64
}
fn default_true() -> bool {
    true
}
fn default_deadline() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}
fn default_manifest_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(120)
}

impl RecorderConfig {
    /// A configuration with its store and ledgers under `dir`.
    pub fn under(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        Self {
            instance: default_instance(),
            store_path: dir.join("catalogue.redb"),
            ledger_dir: dir.join("catalogue-ledger"),
            concurrency: default_concurrency(),
            dead_letters: true,
            shutdown_deadline: default_deadline(),
            manifest_spool: None,
            manifest_timeout: default_manifest_timeout(),
        }
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
    let complete = tokio::task::spawn_blocking(move || s.is_complete())
        .await
        .map_err(|e| RecorderError::Worker(e.to_string()))??;
    if complete {
        return Ok(None);
    }
    tracing::info!(store = %store.path().display(), "catalogue store missing or incomplete: rebuilding from the facts stream");
    let facts = replay(
        bus.jetstream(),
        FACTS.name,
        "stagehand.fact.>",
        store,
        files,
    )
    .await?;
    let dead = replay(
        bus.jetstream(),
        DEAD_LETTERS.name,
        "stagehand.dlq.>",
        store,
        files,
    )
    .await?;
    let requests = replay(
        bus.jetstream(),
        REQUESTS.name,
        STAGE_REQUESTS_FILTER,
        store,
        files,
    )
    .await?;
    let touched = [facts.touched.clone(), requests.touched.clone()].concat();
    let stages = [facts.stages.clone(), requests.stages.clone()].concat();
    mirror_all(store, mirror, touched, stages).await?;
    let s = store.clone();
    let through = facts.through;
    tokio::task::spawn_blocking(move || s.mark_complete(through))
        .await
        .map_err(|e| RecorderError::Worker(e.to_string()))??;
    tracing::info!(
        facts = facts.events,
        dead_letters = dead.events,
        stage_requests = requests.events,
        undecodable = facts.undecodable + dead.undecodable,
        skipped = facts.skipped + dead.skipped,
        batches = facts.batches + dead.batches,
        "catalogue rebuilt"
    );
    Ok(Some((facts.events, dead.events)))
}

/// Runs the recorder until `shutdown` is cancelled: rebuilds the store if needed, then folds
/// facts (and dead letters) live through the worker runtime, answers queries and mirrors
/// readiness. Provisions nothing but its own consumers and the readiness bucket; the streams
/// come from [`Bus::provision`].
pub async fn run(
    bus: Bus,
    config: RecorderConfig,
    shutdown: CancellationToken,
) -> Result<RecorderStats, RecorderError> {
    // A child: a failing worker stops this recorder, not whoever runs it beside other services.
    let shutdown = shutdown.child_token();
    let path = config.store_path.clone();
    let store = Arc::new(
        tokio::task::spawn_blocking(move || Store::open(path))
            .await
            .map_err(|e| RecorderError::Worker(e.to_string()))??,
    );
    let mirror = Mirror::open(bus.jetstream()).await?;
    let files = config.file_lists(&bus, &store);
    let rebuilt = rebuild_if_needed(&bus, &store, &files, &mirror).await?;
    let (writer, writer_thread) = Writer::start(store.clone());
    let store_failed = Arc::new(AtomicBool::new(false));
    let handler = Arc::new(LiveFold {
        store: store.clone(),
        writer,
        files,
        mirror: mirror.clone(),
        stop: shutdown.clone(),
        store_failed: store_failed.clone(),
    });

    let queries = tokio::spawn(serve(bus.client().clone(), store.clone(), shutdown.clone()));
    let progress = tokio::spawn(follow_progress(
        bus.client().clone(),
        store.clone(),
        mirror,
        shutdown.clone(),
    ));

    let worker = |service: String, stream: &str, filter: &str| {
        let mut cfg = WorkerConfig::new(
            service.clone(),
            stream,
            filter.split(',').map(str::to_owned).collect(),
            config.ledger_dir.join(format!("{service}.redb")),
        );
        cfg.concurrency = config.concurrency;
        cfg.shutdown_deadline = config.shutdown_deadline;
        // Folding is idempotent and every instance folds every fact: nothing to claim.
        cfg.claims = false;
        cfg
    };
    let facts_cfg = worker(config.instance.clone(), FACTS.name, "stagehand.fact.>");
    let dlq_cfg = worker(
        format!("{}-dlq", config.instance),
        DEAD_LETTERS.name,
        "stagehand.dlq.>",
    );
    let stages_cfg = worker(
        format!("{}-stages", config.instance),
        REQUESTS.name,
        STAGE_REQUESTS_FILTER,
    );
    let facts = run_worker(bus.clone(), facts_cfg, handler.clone(), shutdown.clone());
    let stage_requests = run_worker(bus.clone(), stages_cfg, handler.clone(), shutdown.clone());
    let dead_letters = async {
        if config.dead_letters {
            run_worker(bus.clone(), dlq_cfg, handler.clone(), shutdown.clone()).await
        } else {
            Ok(WorkerStats::default())
        }
    };
    let (facts, dead_letters, stage_requests) = tokio::join!(facts, dead_letters, stage_requests);
    // Any worker failing stops the whole recorder.
    shutdown.cancel();
    let _ = queries.await;
    let _ = progress.await;
    // Release the store (the writer thread holds it) before returning, so that whoever runs
    // the recorder can reopen the file at once. A handler still held by an abandoned task would
    // keep it; the wait is bounded by the shutdown deadline.
    drop(handler);
    let joined = tokio::task::spawn_blocking(move || writer_thread.join());
    if tokio::time::timeout(config.shutdown_deadline, joined)
        .await
        .is_err()
    {
        tracing::warn!("catalogue writer still busy at the shutdown deadline");
    }
    if store_failed.load(Ordering::SeqCst) {
        return Err(RecorderError::Store(StoreError::Redb(
            redb::Error::PreviousIo,
        )));
    }
    let facts = facts.map_err(|e| RecorderError::Worker(e.to_string()))?;
    let dead_letters = dead_letters.map_err(|e| RecorderError::Worker(e.to_string()))?;
    let stage_requests = stage_requests.map_err(|e| RecorderError::Worker(e.to_string()))?;
    Ok(RecorderStats {
        rebuilt,
        facts,
        dead_letters,
        stage_requests,
    })
}

impl From<StoreError> for HandlerError {
    fn from(e: StoreError) -> Self {
        if e.is_retryable() {
            HandlerError::retryable(e)
        } else {
            HandlerError::permanent(e)
        }
    }
}
