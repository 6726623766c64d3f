//! The recorder as a service: rebuild if needed, then fold live facts, serve queries, mirror
//! readiness, until shutdown.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use stagehand_bus::{
    Bus, Handler, HandlerError, WorkContext, WorkerConfig, WorkerStats, run_worker,
};
use stagehand_schemas::Event;
use stagehand_schemas::subject::{DEAD_LETTERS, FACTS};
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::fold::TierKey;
use crate::query::{serve, tier_readiness};
use crate::readiness::{mirror, open_bucket};
use crate::replay::replay;
use crate::store::{Store, Writer};

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
        }
    }
}

/// What a recorder did before it stopped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecorderStats {
    /// The rebuild at start, if the store needed one: facts and dead letters replayed.
    pub rebuilt: Option<(u64, u64)>,
    pub facts: WorkerStats,
    pub dead_letters: WorkerStats,
}

/// The worker runtime's handler: folds one event, mirrors the readiness it touched, and causes
/// no facts.
struct Fold {
    store: Arc<Store>,
    writer: Writer,
    bucket: async_nats::jetstream::kv::Store,
}

impl Handler for Fold {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let touched = self.writer.apply(event.clone()).await?;
        mirror_all(&self.store, &self.bucket, touched)
            .await
            .map_err(HandlerError::retryable)?;
        Ok(Vec::new())
    }
}

async fn mirror_all(
    store: &Arc<Store>,
    bucket: &async_nats::jetstream::kv::Store,
    touched: Vec<TierKey>,
) -> Result<(), RecorderError> {
    for tier in touched {
        let s = store.clone();
        let readiness = tokio::task::spawn_blocking(move || tier_readiness(&s, &tier)).await??;
        mirror(bucket, &readiness).await?;
    }
    Ok(())
}

/// Rebuilds `store` from the facts and dead-letter streams if it is not complete, and mirrors
/// the readiness the replay touched. Returns the events replayed (facts, dead letters), or
/// `None` when the store was complete already.
pub async fn rebuild_if_needed(
    bus: &Bus,
    store: &Arc<Store>,
    bucket: &async_nats::jetstream::kv::Store,
) -> Result<Option<(u64, u64)>, RecorderError> {
    let s = store.clone();
    let complete = tokio::task::spawn_blocking(move || s.is_complete()).await??;
    if complete {
        return Ok(None);
    }
    tracing::info!(store = %store.path().display(), "catalogue store missing or incomplete: rebuilding from the facts stream");
    let facts = replay(bus.jetstream(), FACTS.name, "stagehand.fact.>", store).await?;
    let dead = replay(bus.jetstream(), DEAD_LETTERS.name, "stagehand.dlq.>", store).await?;
    mirror_all(store, bucket, facts.touched.clone()).await?;
    let s = store.clone();
    let through = facts.through;
    tokio::task::spawn_blocking(move || s.mark_complete(through)).await??;
    tracing::info!(
        facts = facts.events,
        dead_letters = dead.events,
        undecodable = facts.undecodable + dead.undecodable,
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
    let store = Arc::new(tokio::task::spawn_blocking(move || Store::open(path)).await??);
    let bucket = open_bucket(bus.jetstream()).await?;
    let rebuilt = rebuild_if_needed(&bus, &store, &bucket).await?;
    let (writer, writer_thread) = Writer::start(store.clone());
    let handler = Arc::new(Fold {
        store: store.clone(),
        writer,
        bucket,
    });

    let queries = tokio::spawn(serve(bus.client().clone(), store.clone(), shutdown.clone()));

    let worker = |service: String, stream: &str, filter: &str| {
        let mut cfg = WorkerConfig::new(
            service.clone(),
            stream,
            vec![filter.to_owned()],
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
    let facts = run_worker(bus.clone(), facts_cfg, handler.clone(), shutdown.clone());
    let dead_letters = async {
        if config.dead_letters {
            run_worker(bus.clone(), dlq_cfg, handler.clone(), shutdown.clone()).await
        } else {
            Ok(WorkerStats::default())
        }
    };
    let (facts, dead_letters) = tokio::join!(facts, dead_letters);
    // Either worker failing stops the whole recorder.
    shutdown.cancel();
    let _ = queries.await;
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
    let facts = facts?;
    let dead_letters = dead_letters?;
    Ok(RecorderStats {
        rebuilt,
        facts,
        dead_letters,
    })
}

impl From<StoreError> for HandlerError {
    /// A fact the store cannot fold for a storage failure is not the fact's fault: the recorder
    /// stops (fatal), its supervisor restarts it, and the fact is redelivered — never
    /// dead-lettered and terminated, which would leave it out of this catalogue.
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Redb(_) => HandlerError::fatal(e),
            StoreError::WriterGone => HandlerError::retryable(e),
            StoreError::Corrupt { .. } => HandlerError::permanent(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a fold that failed on the store's I/O was a retryable error, dead-lettered
    /// and terminated once its attempts ran out — a fact missing from this catalogue for good.
    /// Now the recorder stops and the fact comes back after the restart.
    #[test]
    fn a_store_failure_stops_the_recorder_instead_of_dead_lettering_the_fact() {
        let io: HandlerError = StoreError::Redb(redb::Error::PreviousIo).into();
        assert!(io.is_fatal(), "{io:?}");
        let corrupt: HandlerError = StoreError::Corrupt {
            key: "k".into(),
            detail: "truncated".into(),
        }
        .into();
        assert!(corrupt.is_permanent());
        let gone: HandlerError = StoreError::WriterGone.into();
        assert!(gone.is_retryable());
    }
}
