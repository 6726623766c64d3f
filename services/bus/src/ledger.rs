//! The ledger: which events this service has finished, and what it published for them.
//!
//! One redb file per service. For every event handled to the end it holds the outcome — the
//! encoded facts (exact bytes, so a replay republishes the very same events), or the dead
//! letter and the permanent error — and, while an event is still being retried, the history of
//! its failed attempts. An outcome is committed *before* its facts are published and the
//! message acked, so a redelivery after a crash finds it and republishes the same facts.
//!
//! redb allows one write transaction at a time, and each commit fsyncs. All writes therefore
//! go through one writer thread that takes every request queued at that moment, applies them in
//! one transaction and answers each requester after the commit: many concurrent outcomes share
//! one fsync.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};
use stagehand_schemas::{Attempt, Event, EventId, wire};
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot};

/// Outcome of each finished event, by event id (or dead-letter id for undecodable messages).
const OUTCOMES: TableDefinition<&str, &[u8]> = TableDefinition::new("outcomes");
/// Failed attempts of events not finished yet, by event id.
const ATTEMPTS: TableDefinition<&str, &[u8]> = TableDefinition::new("attempts");

/// Most requests folded into one write transaction.
const MAX_BATCH: usize = 4096;

/// Why the ledger could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("ledger {path}: {detail}")]
    Open { path: PathBuf, detail: String },
    #[error("ledger storage: {0}")]
    Storage(String),
    #[error("ledger record for {key} is unreadable: {detail}")]
    Corrupt { key: String, detail: String },
    #[error("ledger writer has stopped")]
    WriterGone,
}

impl LedgerError {
    /// A storage error or a stopped writer may pass; a corrupt record or an unopenable file
    /// will not.
    pub fn is_retryable(&self) -> bool {
        matches!(self, LedgerError::Storage(_) | LedgerError::WriterGone)
    }
}

fn storage(e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Storage(e.to_string())
}

/// What the ledger stores for a finished event.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredOutcome {
    /// Facts as published, wire-encoded.
    facts: Vec<serde_bytes::ByteBuf>,
    /// The dead letter as published, wire-encoded.
    #[serde(default)]
    dead_letter: Option<serde_bytes::ByteBuf>,
    #[serde(default)]
    permanent_error: Option<String>,
    #[serde(default)]
    attempts: Vec<Attempt>,
    #[serde(with = "time::serde::rfc3339")]
    recorded_at: OffsetDateTime,
}

/// A finished event's outcome, as recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The facts the handler produced, in order; empty for a dead-lettered event.
    pub facts: Vec<Event>,
    /// The dead letter published instead of facts.
    pub dead_letter: Option<Event>,
    /// Why it was dead-lettered, when it was.
    pub permanent_error: Option<String>,
    /// Failed attempts before the outcome, oldest first.
    pub attempts: Vec<Attempt>,
    pub recorded_at: OffsetDateTime,
}

impl Outcome {
    pub fn is_dead_lettered(&self) -> bool {
        self.dead_letter.is_some()
    }
}

/// What the runtime needs to replay an outcome: the exact bytes it published.
#[derive(Debug, Clone)]
pub(crate) struct RecordedBytes {
    pub facts: Vec<Vec<u8>>,
    pub dead_letter: Option<Vec<u8>>,
}

/// A service's ledger (a redb file). Cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    db: Arc<Database>,
    path: PathBuf,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("path", &self.path).finish()
    }
}

impl Ledger {
    /// Opens the ledger at `path`, creating it (and its tables) if missing. The file is
    /// locked to this process while open.
    pub fn open(path: impl AsRef<Path>) -> Result<Ledger, LedgerError> {
        let path = path.as_ref().to_path_buf();
        let open_err = |e: &dyn std::fmt::Display| LedgerError::Open {
            path: path.clone(),
            detail: e.to_string(),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| open_err(&e))?;
        }
        let db = Database::create(&path).map_err(|e| open_err(&e))?;
        let txn = db.begin_write().map_err(|e| open_err(&e))?;
        txn.open_table(OUTCOMES).map_err(|e| open_err(&e))?;
        txn.open_table(ATTEMPTS).map_err(|e| open_err(&e))?;
        txn.commit().map_err(|e| open_err(&e))?;
        Ok(Ledger {
            db: Arc::new(db),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded outcome of `id`, if it finished.
    pub fn outcome(&self, id: &EventId) -> Result<Option<Outcome>, LedgerError> {
        let Some(stored) = self.stored(id.as_str())? else {
            return Ok(None);
        };
        let decode = |bytes: &[u8]| {
            wire::decode(bytes).map_err(|e| LedgerError::Corrupt {
                key: id.to_string(),
                detail: e.to_string(),
            })
        };
        Ok(Some(Outcome {
            facts: stored
                .facts
                .iter()
                .map(|b| decode(b))
                .collect::<Result<_, _>>()?,
            dead_letter: stored
                .dead_letter
                .as_deref()
                .map(|b| decode(b))
                .transpose()?,
            permanent_error: stored.permanent_error,
            attempts: stored.attempts,
            recorded_at: stored.recorded_at,
        }))
    }

    /// Failed attempts of `id` recorded so far (empty once it finished: they move into the
    /// outcome).
    pub fn attempts(&self, id: &EventId) -> Result<Vec<Attempt>, LedgerError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let table = txn.open_table(ATTEMPTS).map_err(storage)?;
        match table.get(id.as_str()).map_err(storage)? {
            Some(v) => decode_attempts(id.as_str(), v.value()),
            None => Ok(Vec::new()),
        }
    }

    /// Number of finished events recorded.
    pub fn len(&self) -> Result<u64, LedgerError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let table = txn.open_table(OUTCOMES).map_err(storage)?;
        table.len().map_err(storage)
    }

    pub fn is_empty(&self) -> Result<bool, LedgerError> {
        Ok(self.len()? == 0)
    }

    pub(crate) fn recorded_bytes(&self, key: &str) -> Result<Option<RecordedBytes>, LedgerError> {
        Ok(self.stored(key)?.map(|s| RecordedBytes {
            facts: s.facts.into_iter().map(|b| b.into_vec()).collect(),
            dead_letter: s.dead_letter.map(|b| b.into_vec()),
        }))
    }

    fn stored(&self, key: &str) -> Result<Option<StoredOutcome>, LedgerError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let table = txn.open_table(OUTCOMES).map_err(storage)?;
        match table.get(key).map_err(storage)? {
            Some(v) => {
                rmp_serde::from_slice(v.value())
                    .map(Some)
                    .map_err(|e| LedgerError::Corrupt {
                        key: key.to_owned(),
                        detail: e.to_string(),
                    })
            }
            None => Ok(None),
        }
    }

    /// Starts the single writer thread. Dropping every [`LedgerWriter`] clone stops it once
    /// the queued requests are committed.
    pub(crate) fn spawn_writer(&self) -> (LedgerWriter, std::thread::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(WriterStats::default());
        let db = self.db.clone();
        let thread_stats = stats.clone();
        let handle = std::thread::Builder::new()
            .name("stagehand-ledger".into())
            .spawn(move || writer_loop(&db, rx, &thread_stats))
            .expect("spawning a thread only fails when the process is out of resources");
        (LedgerWriter { tx, stats }, handle)
    }
}

fn decode_attempts(key: &str, bytes: &[u8]) -> Result<Vec<Attempt>, LedgerError> {
    rmp_serde::from_slice(bytes).map_err(|e| LedgerError::Corrupt {
        key: key.to_owned(),
        detail: e.to_string(),
    })
}

/// Counters of the writer thread.
#[derive(Debug, Default)]
pub(crate) struct WriterStats {
    pub commits: AtomicU64,
    pub writes: AtomicU64,
}

enum Write {
    /// Record an outcome; moves the attempt history into it and clears it.
    Outcome {
        key: String,
        facts: Vec<Vec<u8>>,
        dead_letter: Option<Vec<u8>>,
        permanent_error: Option<String>,
    },
    /// Append one failed attempt to `key`'s history.
    Attempt { key: String, attempt: Attempt },
}

struct Request {
    write: Write,
    done: oneshot::Sender<Result<(), LedgerError>>,
}

/// Sends writes to the writer thread and waits for their commit.
#[derive(Clone)]
pub(crate) struct LedgerWriter {
    tx: mpsc::UnboundedSender<Request>,
    pub stats: Arc<WriterStats>,
}

impl LedgerWriter {
    pub async fn record_outcome(
        &self,
        key: &str,
        facts: Vec<Vec<u8>>,
        dead_letter: Option<Vec<u8>>,
        permanent_error: Option<String>,
    ) -> Result<(), LedgerError> {
        self.send(Write::Outcome {
            key: key.to_owned(),
            facts,
            dead_letter,
            permanent_error,
        })
        .await
    }

    pub async fn record_attempt(&self, key: &str, attempt: Attempt) -> Result<(), LedgerError> {
        self.send(Write::Attempt {
            key: key.to_owned(),
            attempt,
        })
        .await
    }

    async fn send(&self, write: Write) -> Result<(), LedgerError> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Request { write, done })
            .map_err(|_| LedgerError::WriterGone)?;
        rx.await.map_err(|_| LedgerError::WriterGone)?
    }
}

fn writer_loop(db: &Database, mut rx: mpsc::UnboundedReceiver<Request>, stats: &WriterStats) {
    let mut batch = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let result = apply(db, &batch);
        stats.commits.fetch_add(1, Ordering::Relaxed);
        stats
            .writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for req in batch.drain(..) {
            let r = match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(LedgerError::Storage(e.to_string())),
            };
            // The requester may have been cancelled by a shutdown deadline; its write stands.
            let _ = req.done.send(r);
        }
    }
}

fn apply(db: &Database, batch: &[Request]) -> Result<(), LedgerError> {
    let txn = db.begin_write().map_err(storage)?;
    {
        let mut outcomes = txn.open_table(OUTCOMES).map_err(storage)?;
        let mut attempts = txn.open_table(ATTEMPTS).map_err(storage)?;
        for req in batch {
            match &req.write {
                Write::Outcome {
                    key,
                    facts,
                    dead_letter,
                    permanent_error,
                } => {
                    // The first recorded outcome wins: a racing duplicate must not replace
                    // facts that may already have been published.
                    if outcomes.get(key.as_str()).map_err(storage)?.is_some() {
                        continue;
                    }
                    let history = match attempts.remove(key.as_str()).map_err(storage)? {
                        Some(v) => decode_attempts(key, v.value()).unwrap_or_default(),
                        None => Vec::new(),
                    };
                    let stored = StoredOutcome {
                        facts: facts
                            .iter()
                            .cloned()
                            .map(serde_bytes::ByteBuf::from)
                            .collect(),
                        dead_letter: dead_letter.clone().map(serde_bytes::ByteBuf::from),
                        permanent_error: permanent_error.clone(),
                        attempts: history,
                        recorded_at: stagehand_schemas::now(),
                    };
                    let bytes = rmp_serde::to_vec_named(&stored).map_err(storage)?;
                    outcomes
                        .insert(key.as_str(), bytes.as_slice())
                        .map_err(storage)?;
                }
                Write::Attempt { key, attempt } => {
                    let mut history = match attempts.get(key.as_str()).map_err(storage)? {
                        Some(v) => decode_attempts(key, v.value()).unwrap_or_default(),
                        None => Vec::new(),
                    };
                    if history.iter().any(|a| a.delivery == attempt.delivery) {
                        continue;
                    }
                    history.push(attempt.clone());
                    let bytes = rmp_serde::to_vec_named(&history).map_err(storage)?;
                    attempts
                        .insert(key.as_str(), bytes.as_slice())
                        .map_err(storage)?;
                }
            }
        }
    }
    txn.commit().map_err(storage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::{Body, StageReleased};

    fn event(id: &str) -> Event {
        Event::request(
            EventId::new(id).unwrap(),
            "lab-a",
            Body::StageReleased(StageReleased {
                dataset: "d".into(),
                version: "v".into(),
                tier: "hot".into(),
                job_id: "j".into(),
                node: None,
            }),
        )
    }

    #[tokio::test]
    async fn outcome_survives_reopen_and_first_record_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.redb");
        let req = event("req-1");
        let fact = req.caused("done", req.body.clone());
        {
            let ledger = Ledger::open(&path).unwrap();
            let (writer, thread) = ledger.spawn_writer();
            let attempt = Attempt {
                delivery: 1,
                at: stagehand_schemas::now(),
                error: "tier offline".into(),
                permanent: false,
            };
            writer
                .record_attempt("req-1", attempt.clone())
                .await
                .unwrap();
            assert_eq!(ledger.attempts(&req.id).unwrap(), vec![attempt]);
            let bytes = wire::encode(&fact).unwrap();
            writer
                .record_outcome("req-1", vec![bytes], None, None)
                .await
                .unwrap();
            writer
                .record_outcome("req-1", vec![], None, Some("late".into()))
                .await
                .unwrap();
            drop(writer);
            thread.join().unwrap();
        }
        let ledger = Ledger::open(&path).unwrap();
        let outcome = ledger.outcome(&req.id).unwrap().unwrap();
        assert_eq!(outcome.facts, vec![fact]);
        assert_eq!(outcome.permanent_error, None);
        assert_eq!(outcome.attempts.len(), 1);
        assert!(ledger.attempts(&req.id).unwrap().is_empty());
        assert!(
            ledger
                .outcome(&EventId::new("other").unwrap())
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn concurrent_outcomes_share_commits() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path().join("l.redb")).unwrap();
        let (writer, thread) = ledger.spawn_writer();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..500 {
            let w = writer.clone();
            tasks.spawn(async move {
                w.record_outcome(&format!("e{i}"), vec![], None, None)
                    .await
                    .unwrap()
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        let commits = writer.stats.commits.load(Ordering::Relaxed);
        assert_eq!(writer.stats.writes.load(Ordering::Relaxed), 500);
        assert!(commits < 500, "{commits} commits for 500 outcomes");
        assert_eq!(ledger.len().unwrap(), 500);
        drop(writer);
        thread.join().unwrap();
    }
}
