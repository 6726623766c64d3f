//! The ledger's single writer thread, a [`stagehand_store`] group-commit writer: every request
//! queued at a moment is applied in one transaction, each requester is answered after its
//! commit, and a failed write is followed by reopening the file redb latched as failed.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redb::{Database, ReadableTable};
use stagehand_schemas::{Attempt, EventId};
use stagehand_store::{CommitError, GroupWriter};
use time::OffsetDateTime;
use tracing::error;

use super::error::{LedgerError, LedgerErrorKind};
use super::key::EventKey;
use super::retention::prune_in;
use super::schema::{ATTEMPTS, BY_TIME, DEAD_LETTERS, OUTCOMES, StoredOutcome, Tag, micros};
use super::{Ledger, MAX_ATTEMPTS_KEPT, RecordedBytes};

/// Most requests folded into one write transaction.
const MAX_BATCH: usize = 4096;

/// Most requests waiting for the writer; a worker task past it waits for room. Each task waits
/// for its own write, so at most the worker's concurrency is ever queued.
const MAX_QUEUED: usize = 2 * MAX_BATCH;

/// Longest error text kept per attempt: a dead letter carries the history and must stay
/// under the message bound.
const MAX_ERROR_CHARS: usize = 1024;

/// What the worker is told when the ledger fails for good.
type OnFailed = Arc<dyn Fn(LedgerError) + Send + Sync>;

impl Ledger {
    /// Starts the single writer thread ([`stagehand_store`]). Dropping every [`LedgerWriter`]
    /// clone stops it once the queued requests are committed. `on_failed` runs once if the
    /// store fails for good.
    pub(crate) fn spawn_writer(
        &self,
        on_failed: Box<dyn Fn(LedgerError) + Send + Sync>,
    ) -> (LedgerWriter, std::thread::JoinHandle<()>) {
        let on_failed: OnFailed = on_failed.into();
        let stats = Arc::new(WriterStats::default());
        let (ledger, thread_stats, failed) = (self.clone(), stats.clone(), on_failed.clone());
        let apply = move |batch: &[Write]| {
            if ledger.store.reopen_wanted.load(Ordering::Acquire)
                && ledger.failure().is_none()
                && let Err(e) = ledger.reopen()
            {
                fail(&ledger, e, &*failed);
            }
            let result = ledger
                .db()
                .and_then(|db| apply(&db, batch).map_err(|e| ledger.write_err("writing", e)));
            thread_stats.commits.fetch_add(1, Ordering::Relaxed);
            thread_stats
                .writes
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            metrics::counter!(stagehand_telemetry::names::LEDGER_COMMITS_TOTAL).increment(1);
            let corrupt = |what| {
                Err(LedgerError::new(
                    LedgerErrorKind::Corrupt,
                    ledger.path(),
                    what,
                ))
            };
            Ok(result?
                .into_iter()
                .map(|reply| match reply {
                    Reply::Corrupt(what) => corrupt(what),
                    other => Ok(other),
                })
                .collect())
        };
        // Run once the failed batch's requesters were answered, so that none waits for the
        // reopening.
        let ledger = self.clone();
        let after_failure = move |e: &LedgerError| {
            if e.kind() == LedgerErrorKind::Io {
                error!(ledger = %ledger.path().display(), error = %e, "ledger write failed; reopening the store");
                if let Err(e) = ledger.reopen() {
                    fail(&ledger, e, &*on_failed);
                }
            }
        };
        let (queue, thread) = stagehand_store::writer("stagehand-ledger")
            .max_batch(MAX_BATCH)
            .queue(MAX_QUEUED)
            .on_failure(after_failure)
            .spawn(apply)
            .expect("spawning a thread only fails when the process is out of resources");
        (LedgerWriter { queue, stats }, thread.into_handle())
    }
}

/// Counters of the writer thread.
#[derive(Debug, Default)]
pub(crate) struct WriterStats {
    pub commits: AtomicU64,
    pub writes: AtomicU64,
}

enum Write {
    /// Record an event's outcome unless one is recorded; moves the attempt history into it.
    /// Answers with the facts recorded (the first outcome wins).
    Outcome { key: EventKey, facts: Vec<Vec<u8>> },
    /// Record a published dead letter under its id; moves `event`'s attempt history into it.
    DeadLetter {
        id: EventId,
        event: Option<EventKey>,
        bytes: Vec<u8>,
        error: Option<String>,
    },
    /// Append one failed attempt to an event's history.
    Attempt { key: EventKey, attempt: Attempt },
    /// Remove up to `limit` records from before `cutoff` (µs since the epoch).
    Prune { cutoff: u64, limit: usize },
}

enum Reply {
    Done,
    /// The outcome sent is the one recorded.
    Ours,
    /// An outcome was recorded before: its facts.
    Recorded(Vec<Vec<u8>>),
    Pruned(u64),
    /// This request alone could not be applied (a damaged record); the others commit.
    Corrupt(String),
}

/// Sends writes to the writer thread and waits for their commit.
#[derive(Clone)]
pub(crate) struct LedgerWriter {
    queue: GroupWriter<Write, Result<Reply, LedgerError>, LedgerError>,
    pub stats: Arc<WriterStats>,
}
impl LedgerWriter {
    /// Records `key`'s outcome. Returns `None` when `facts` are what the ledger now holds, or
    /// the facts of an outcome recorded before (which must be published instead).
    pub async fn record_outcome(
        &self,
        key: &EventKey,
        facts: Vec<Vec<u8>>,
    ) -> Result<Option<Vec<Vec<u8>>>, LedgerError> {
        match self
            .send(Write::Outcome {
                key: key.clone(),
                facts,
            })
            .await?
        {
            Reply::Recorded(facts) => Ok(Some(facts)),
            Reply::Ours | Reply::Done | Reply::Pruned(_) | Reply::Corrupt(_) => Ok(None),
        }
    }

    pub async fn record_dead_letter(
        &self,
        id: &EventId,
        event: Option<&EventKey>,
        bytes: Vec<u8>,
        error: Option<String>,
    ) -> Result<(), LedgerError> {
        self.send(Write::DeadLetter {
            id: id.clone(),
            event: event.cloned(),
            bytes,
            error,
        })
        .await
        .map(drop)
    }

    pub async fn record_attempt(
        &self,
        key: &EventKey,
        attempt: Attempt,
    ) -> Result<(), LedgerError> {
        self.send(Write::Attempt {
            key: key.clone(),
            attempt,
        })
        .await
        .map(drop)
    }

    /// Removes up to `limit` records from before `cutoff`; returns how many.
    pub async fn prune(&self, cutoff: OffsetDateTime, limit: usize) -> Result<u64, LedgerError> {
        match self
            .send(Write::Prune {
                cutoff: micros(cutoff),
                limit,
            })
            .await?
        {
            Reply::Pruned(n) => Ok(n),
            _ => Ok(0),
        }
    }

    async fn send(&self, write: Write) -> Result<Reply, LedgerError> {
        match self.queue.submit(write).await {
            Ok(reply) => reply,
            // Each requester of a failed batch gets the batch's error, cause and all.
            Err(CommitError::Failed(e)) => Err((*e).clone()),
            Err(CommitError::Stopped(_)) => Err(LedgerError {
                kind: LedgerErrorKind::WriterGone,
                path: std::path::PathBuf::new(),
                what: "the writer has stopped".into(),
                source: None,
            }),
        }
    }
}

pub(super) fn fail(ledger: &Ledger, e: LedgerError, on_failed: &dyn Fn(LedgerError)) {
    error!(ledger = %ledger.path().display(), error = %e, "the ledger failed and cannot be reopened; the worker stops");
    ledger.fail(&e);
    on_failed(e);
}

fn apply(db: &Database, batch: &[Write]) -> Result<Vec<Reply>, redb::Error> {
    let txn = db.begin_write()?;
    let mut replies = Vec::with_capacity(batch.len());
    {
        let mut outcomes = txn.open_table(OUTCOMES)?;
        let mut dead = txn.open_table(DEAD_LETTERS)?;
        let mut attempts = txn.open_table(ATTEMPTS)?;
        let mut by_time = txn.open_table(BY_TIME)?;
        // Outcomes recorded earlier in this batch, so that a duplicate in the same batch gets
        // the first one's facts too.
        let mut fresh: HashMap<&str, &Vec<Vec<u8>>> = HashMap::new();
        for write in batch {
            let reply = match write {
                Write::Outcome { key, facts } => {
                    if let Some(first) = fresh.get(key.as_str()) {
                        Reply::Recorded((*first).clone())
                    } else if let Some(existing) = outcomes.get(key.as_str())? {
                        // The first recorded outcome wins: a racing duplicate must publish the
                        // facts that may already have been published, never its own.
                        match rmp_serde::from_slice::<StoredOutcome>(existing.value()) {
                            Ok(stored) => Reply::Recorded(RecordedBytes::from(stored).facts),
                            Err(e) => Reply::Corrupt(format!("record {key} does not decode: {e}")),
                        }
                    } else {
                        let history = take_attempts(&mut attempts, &mut by_time, key.as_str())?;
                        let now = stagehand_schemas::now();
                        let stored = StoredOutcome {
                            facts: facts
                                .iter()
                                .cloned()
                                .map(serde_bytes::ByteBuf::from)
                                .collect(),
                            dead_letter: None,
                            permanent_error: None,
                            attempts: history,
                            recorded_at: now,
                        };
                        let bytes = rmp_serde::to_vec_named(&stored)
                            .map_err(|e| redb::Error::Corrupted(e.to_string()))?;
                        outcomes.insert(key.as_str(), bytes.as_slice())?;
                        by_time.insert(
                            (micros(now), Tag::Outcome.tagged(key.as_str()).as_str()),
                            (),
                        )?;
                        fresh.insert(key.as_str(), facts);
                        Reply::Ours
                    }
                }
                Write::DeadLetter {
                    id,
                    event,
                    bytes,
                    error,
                } => {
                    if dead.get(id.as_str())?.is_none() {
                        let history = match event {
                            Some(k) => take_attempts(&mut attempts, &mut by_time, k.as_str())?,
                            None => Vec::new(),
                        };
                        let now = stagehand_schemas::now();
                        let stored = StoredOutcome {
                            facts: Vec::new(),
                            dead_letter: Some(serde_bytes::ByteBuf::from(bytes.clone())),
                            permanent_error: error.clone(),
                            attempts: history,
                            recorded_at: now,
                        };
                        let encoded = rmp_serde::to_vec_named(&stored)
                            .map_err(|e| redb::Error::Corrupted(e.to_string()))?;
                        dead.insert(id.as_str(), encoded.as_slice())?;
                        by_time.insert(
                            (micros(now), Tag::DeadLetter.tagged(id.as_str()).as_str()),
                            (),
                        )?;
                    }
                    Reply::Done
                }
                Write::Attempt { key, attempt } => {
                    let mut history = match attempts.get(key.as_str())? {
                        Some(v) => {
                            rmp_serde::from_slice::<Vec<Attempt>>(v.value()).unwrap_or_default()
                        }
                        None => Vec::new(),
                    };
                    let known = history
                        .iter()
                        .any(|a| a.delivery == attempt.delivery && a.at == attempt.at);
                    if !known && history.len() < MAX_ATTEMPTS_KEPT {
                        if history.is_empty() {
                            by_time.insert(
                                (
                                    micros(attempt.at),
                                    Tag::Attempts.tagged(key.as_str()).as_str(),
                                ),
                                (),
                            )?;
                        }
                        history.push(bounded(attempt.clone()));
                        let bytes = rmp_serde::to_vec_named(&history)
                            .map_err(|e| redb::Error::Corrupted(e.to_string()))?;
                        attempts.insert(key.as_str(), bytes.as_slice())?;
                    }
                    Reply::Done
                }
                Write::Prune { cutoff, limit } => Reply::Pruned(prune_in(
                    &mut outcomes,
                    &mut dead,
                    &mut attempts,
                    &mut by_time,
                    *cutoff,
                    *limit,
                )?),
            };
            replies.push(reply);
        }
    }
    txn.commit()?;
    Ok(replies)
}

/// An attempt with its error text cut to [`MAX_ERROR_CHARS`].
pub(crate) fn bounded(mut attempt: Attempt) -> Attempt {
    if attempt.error.chars().count() > MAX_ERROR_CHARS {
        attempt.error = attempt
            .error
            .chars()
            .take(MAX_ERROR_CHARS)
            .collect::<String>()
            + "…";
    }
    attempt
}

/// Removes and returns `key`'s attempt history, with its index entry.
fn take_attempts(
    attempts: &mut redb::Table<&str, &[u8]>,
    by_time: &mut redb::Table<(u64, &str), ()>,
    key: &str,
) -> Result<Vec<Attempt>, redb::Error> {
    let history = match attempts.remove(key)? {
        Some(v) => rmp_serde::from_slice::<Vec<Attempt>>(v.value()).unwrap_or_default(),
        None => return Ok(Vec::new()),
    };
    if let Some(first) = history.first() {
        by_time.remove((micros(first.at), Tag::Attempts.tagged(key).as_str()))?;
    }
    Ok(history)
}
