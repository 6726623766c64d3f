//! The ledger: which events this service has finished, and what it published for them.
//!
//! One redb file per service. For every event handled to the end it holds the outcome — the
//! encoded facts, exact bytes, so that a replay republishes the very same events — keyed by
//! [`EventKey`] (the event's project, kind *and* id: no event of another project or kind
//! shares a record, so nothing one publisher sends can make another's event look finished).
//! Dead letters are kept apart, keyed by the dead letter's own id, so that a replayed copy of a
//! dead-lettered event is worked on again rather than answered with its old dead letter
//! (step G of the consume loop). While an event is still being retried the ledger also holds the
//! history of its failed attempts.
//!
//! redb allows one write transaction at a time, and each commit fsyncs. All writes therefore
//! go through one writer thread (`stagehand_store`'s group-commit writer) that takes every
//! request queued at that moment, applies them in one transaction and answers each requester
//! after the commit: many concurrent outcomes share one fsync.
//!
//! **A failed store is reopened, or the worker stops.** redb latches an I/O failure (ENOSPC or
//! EIO in a write or fsync): every later call returns `PreviousIo` until the database is
//! reopened. After any I/O failure the writer drops the database, reopens the file, checks its
//! integrity and that it is the same ledger (an id written at creation) and carries on; the
//! requests of the failed transaction get a retryable error. When the file cannot be reopened
//! and checked within [`REOPEN_FOR`], the ledger is *failed*: every call returns
//! [`LedgerErrorKind::Failed`] and the worker stops with that error, so that the service exits
//! non-zero and its supervisor restarts it — it never keeps consuming with a dead store.
//!
//! **Bounded growth.** [`Ledger::prune_before`] (and the worker's timer, see
//! `WorkerConfig::ledger_retention`) removes outcomes, dead letters and attempt histories
//! recorded before a cutoff, oldest first, in bounded batches, through an index by time.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use redb::{Database, ReadableDatabase, ReadableTableMetadata, TableDefinition};
use stagehand_schemas::{Attempt, Event, EventId, wire};
use time::OffsetDateTime;
use tracing::info;

mod error;
mod key;
mod recovery;
mod retention;
mod schema;
mod writer;

pub use error::{LedgerError, LedgerErrorKind};
pub use key::EventKey;
pub use recovery::REOPEN_FOR;
pub(crate) use writer::{LedgerWriter, bounded};

use schema::{
    ATTEMPTS, DEAD_LETTERS, OUTCOMES, StoredOutcome, decode_attempts, decode_stored, init,
    migrate_v1,
};

/// Longest attempt history kept per event; the worker refuses a `max_attempts` above it.
pub const MAX_ATTEMPTS_KEPT: usize = 100;

/// A finished event's outcome, or a dead letter, as recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The facts the handler produced, in order; empty for a dead letter.
    pub facts: Vec<Event>,
    /// The dead letter published instead of facts.
    pub dead_letter: Option<Event>,
    /// The last error, when it was dead-lettered.
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

/// The open database and what is known about its health.
struct Store {
    path: PathBuf,
    /// The id written at creation; a reopened file must carry the same.
    id: Vec<u8>,
    /// `None` while the writer reopens the file, and for good once it failed.
    db: RwLock<Option<Arc<Database>>>,
    /// Why the store failed for good, once it did.
    failed: Mutex<Option<String>>,
    /// Set by a reader that met an I/O failure, so the writer reopens even without a write.
    reopen_wanted: AtomicBool,
    reopens: AtomicU64,
    /// Since when keys name the kind ([`KINDS_SINCE`]); 0 for a ledger created with them.
    kinds_since: u64,
}

/// A service's ledger (a redb file). Cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    store: Arc<Store>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("path", &self.store.path)
            .finish()
    }
}

impl Ledger {
    /// Opens the ledger at `path`, creating it (and its tables) if missing, and migrating a
    /// schema-1 ledger (keyed by bare event ids) to project-scoped keys. A ledger whose keys
    /// do not name the kind yet notes when it began to ([`EventKey`]): its records stay where
    /// they are, answer for messages stored before then, and age out with pruning. The file is
    /// locked to this process while open.
    pub fn open(path: impl AsRef<Path>) -> Result<Ledger, LedgerError> {
        let path = path.as_ref().to_path_buf();
        let open_err =
            |what: &str, e: redb::Error| LedgerError::caused(LedgerErrorKind::Open, &path, what, e);
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                LedgerError::caused(LedgerErrorKind::Open, &path, "creating its directory", e)
            })?;
        }
        let db = stagehand_store::open_redb(&path).map_err(|e| open_err("opening", e.into()))?;
        let (id, kinds_since) = init(&db).map_err(|e| open_err("initialising", e))?;
        let migrated = migrate_v1(&db).map_err(|e| open_err("migrating schema-1 records", e))?;
        if migrated > 0 {
            info!(ledger = %path.display(), migrated, "ledger records moved to project-scoped keys");
        }
        Ok(Ledger {
            store: Arc::new(Store {
                path,
                id,
                db: RwLock::new(Some(Arc::new(db))),
                failed: Mutex::new(None),
                reopen_wanted: AtomicBool::new(false),
                reopens: AtomicU64::new(0),
                kinds_since,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.store.path
    }

    /// How often the store was reopened after an I/O failure.
    pub fn reopens(&self) -> u64 {
        self.store.reopens.load(Ordering::Relaxed)
    }

    /// Why the store failed for good, if it did.
    pub fn failure(&self) -> Option<String> {
        self.store
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn err(&self, kind: LedgerErrorKind, what: impl Into<String>) -> LedgerError {
        LedgerError::new(kind, &self.store.path, what)
    }

    /// The recorded outcome of `project`'s event `id` of `kind`, if it finished.
    pub fn outcome(
        &self,
        project: &str,
        kind: &str,
        id: &EventId,
    ) -> Result<Option<Outcome>, LedgerError> {
        let key = EventKey::new(project, kind, id);
        self.decoded(OUTCOMES, key.as_str())
    }

    /// The dead letter recorded under its id, if this service published it.
    pub fn dead_letter(&self, dead_letter_id: &EventId) -> Result<Option<Outcome>, LedgerError> {
        self.decoded(DEAD_LETTERS, dead_letter_id.as_str())
    }

    fn decoded(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
    ) -> Result<Option<Outcome>, LedgerError> {
        let Some(stored) = self.stored(table, key)? else {
            return Ok(None);
        };
        let decode = |bytes: &[u8]| {
            wire::decode(bytes).map_err(|e| {
                LedgerError::caused(
                    LedgerErrorKind::Corrupt,
                    &self.store.path,
                    format!("record {key} holds an event that does not decode"),
                    e,
                )
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

    /// Failed attempts of `project`'s event `id` of `kind` recorded so far (empty once it
    /// finished: they move into the outcome or the dead letter).
    pub fn attempts(
        &self,
        project: &str,
        kind: &str,
        id: &EventId,
    ) -> Result<Vec<Attempt>, LedgerError> {
        self.attempts_of(&EventKey::new(project, kind, id))
    }

    pub(crate) fn attempts_of(&self, key: &EventKey) -> Result<Vec<Attempt>, LedgerError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(|e| self.read_err("reading", e))?;
        let table = txn
            .open_table(ATTEMPTS)
            .map_err(|e| self.read_err("reading", e))?;
        match table
            .get(key.as_str())
            .map_err(|e| self.read_err("reading", e))?
        {
            Some(v) => decode_attempts(&self.store.path, key.as_str(), v.value()),
            None => Ok(Vec::new()),
        }
    }

    /// Number of finished events recorded (dead letters not counted).
    pub fn len(&self) -> Result<u64, LedgerError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(|e| self.read_err("reading", e))?;
        let table = txn
            .open_table(OUTCOMES)
            .map_err(|e| self.read_err("reading", e))?;
        table.len().map_err(|e| self.read_err("reading", e))
    }

    pub fn is_empty(&self) -> Result<bool, LedgerError> {
        Ok(self.len()? == 0)
    }

    /// Number of dead letters recorded.
    pub fn dead_letter_count(&self) -> Result<u64, LedgerError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(|e| self.read_err("reading", e))?;
        let table = txn
            .open_table(DEAD_LETTERS)
            .map_err(|e| self.read_err("reading", e))?;
        table.len().map_err(|e| self.read_err("reading", e))
    }

    pub(crate) fn recorded_bytes(
        &self,
        key: &EventKey,
    ) -> Result<Option<RecordedBytes>, LedgerError> {
        if let Some(stored) = self.stored(OUTCOMES, key.as_str())? {
            return Ok(Some(RecordedBytes::from(stored)));
        }
        match &key.earlier {
            Some((earlier, stored_at)) if *stored_at < self.store.kinds_since => {
                Ok(self.stored(OUTCOMES, earlier)?.map(RecordedBytes::from))
            }
            _ => Ok(None),
        }
    }

    pub(crate) fn recorded_dead_letter(
        &self,
        dead_letter_id: &EventId,
    ) -> Result<Option<RecordedBytes>, LedgerError> {
        Ok(self
            .stored(DEAD_LETTERS, dead_letter_id.as_str())?
            .map(RecordedBytes::from))
    }

    fn stored(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
    ) -> Result<Option<StoredOutcome>, LedgerError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(|e| self.read_err("reading", e))?;
        let table = txn
            .open_table(table)
            .map_err(|e| self.read_err("reading", e))?;
        match table.get(key).map_err(|e| self.read_err("reading", e))? {
            Some(v) => decode_stored(&self.store.path, key, v.value()).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::schema::{LEDGER_ID, META, OUTCOMES_V1};
    use super::*;
    use stagehand_schemas::{Body, StageReleased};

    fn event(project: &str, id: &str) -> Event {
        Event::request(
            EventId::new(id).unwrap(),
            project,
            Body::StageReleased(StageReleased {
                dataset: "d".into(),
                version: "v".into(),
                tier: "hot".into(),
                job_id: "j".into(),
                node: None,
                reason: None,
            }),
        )
    }

    fn writer(ledger: &Ledger) -> (LedgerWriter, std::thread::JoinHandle<()>) {
        ledger.spawn_writer(Box::new(|_: LedgerError| {}))
    }

    #[tokio::test]
    async fn outcome_survives_reopen_and_the_first_record_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.redb");
        let req = event("lab-a", "req-1");
        let key = EventKey::new("lab-a", req.kind(), &req.id);
        let fact = req.caused("done", req.body.clone());
        let other = req.caused("other", req.body.clone());
        {
            let ledger = Ledger::open(&path).unwrap();
            let (writer, thread) = writer(&ledger);
            let attempt = Attempt {
                delivery: 1,
                at: stagehand_schemas::now(),
                error: "tier offline".into(),
                permanent: false,
            };
            writer.record_attempt(&key, attempt.clone()).await.unwrap();
            assert_eq!(
                ledger.attempts("lab-a", req.kind(), &req.id).unwrap(),
                vec![attempt]
            );
            let bytes = wire::encode(&fact).unwrap();
            let recorded = writer
                .record_outcome(&key, vec![bytes.clone()])
                .await
                .unwrap();
            assert_eq!(recorded, None, "ours is the outcome");
            // A racing second outcome is told the first one's facts, and must publish those.
            let late = writer
                .record_outcome(&key, vec![wire::encode(&other).unwrap()])
                .await
                .unwrap();
            assert_eq!(late, Some(vec![bytes]));
            drop(writer);
            thread.join().unwrap();
        }
        let ledger = Ledger::open(&path).unwrap();
        let outcome = ledger
            .outcome("lab-a", req.kind(), &req.id)
            .unwrap()
            .unwrap();
        assert_eq!(outcome.facts, vec![fact]);
        assert_eq!(outcome.attempts.len(), 1);
        assert!(
            ledger
                .attempts("lab-a", req.kind(), &req.id)
                .unwrap()
                .is_empty()
        );
        // Scoped by project: the same id in another project has no outcome.
        assert!(
            ledger
                .outcome("lab-b", req.kind(), &req.id)
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn concurrent_outcomes_share_commits() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path().join("l.redb")).unwrap();
        let (writer, thread) = writer(&ledger);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..500 {
            let w = writer.clone();
            tasks.spawn(async move {
                let key = EventKey::new(
                    "p",
                    "stage.released",
                    &EventId::new(format!("e{i}")).unwrap(),
                );
                w.record_outcome(&key, vec![]).await.unwrap()
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

    /// Pruning with an injected clock removes what was recorded before the cutoff, oldest
    /// first and in bounded batches, and keeps every record from after it.
    #[tokio::test]
    async fn pruning_removes_old_records_in_batches_and_keeps_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path().join("l.redb")).unwrap();
        let (writer, thread) = writer(&ledger);
        let key = |i: usize| {
            EventKey::new(
                "p",
                "stage.released",
                &EventId::new(format!("old-{i}")).unwrap(),
            )
        };
        for i in 0..25 {
            writer.record_outcome(&key(i), vec![]).await.unwrap();
        }
        let dl = EventId::new("dl-old").unwrap();
        writer
            .record_dead_letter(&dl, None, b"x".to_vec(), None)
            .await
            .unwrap();
        let stale = EventKey::new("p", "stage.released", &EventId::new("stale").unwrap());
        let long_ago = stagehand_schemas::now() - time::Duration::days(40);
        let attempt = Attempt {
            delivery: 1,
            at: long_ago,
            error: "offline".into(),
            permanent: false,
        };
        writer.record_attempt(&stale, attempt).await.unwrap();
        let cutoff = stagehand_schemas::now() + time::Duration::milliseconds(1);
        let live = EventKey::new("p", "stage.released", &EventId::new("live").unwrap());
        // Recorded "after the cutoff": the injected clock says the cutoff is before it.
        std::thread::sleep(Duration::from_millis(2));
        writer.record_outcome(&live, vec![]).await.unwrap();

        assert_eq!(writer.prune(cutoff, 10).await.unwrap(), 10);
        assert_eq!(writer.prune(cutoff, 10).await.unwrap(), 10);
        assert_eq!(writer.prune(cutoff, 10).await.unwrap(), 7);
        assert_eq!(writer.prune(cutoff, 10).await.unwrap(), 0);
        assert_eq!(ledger.len().unwrap(), 1);
        assert!(
            ledger
                .outcome("p", "stage.released", &EventId::new("live").unwrap())
                .unwrap()
                .is_some()
        );
        assert_eq!(ledger.dead_letter_count().unwrap(), 0);
        assert!(
            ledger
                .attempts("p", "stage.released", &EventId::new("stale").unwrap())
                .unwrap()
                .is_empty()
        );
        drop(writer);
        thread.join().unwrap();
    }

    /// A schema-1 ledger (bare event ids) opens with its outcomes under project-scoped keys and
    /// its dead letters under their own ids.
    #[test]
    fn schema_1_records_move_to_scoped_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.redb");
        let req = event("lab-a", "req-1");
        let fact = req.caused("done", req.body.clone());
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut t = txn.open_table(OUTCOMES_V1).unwrap();
                let stored = StoredOutcome {
                    facts: vec![serde_bytes::ByteBuf::from(wire::encode(&fact).unwrap())],
                    dead_letter: None,
                    permanent_error: None,
                    attempts: vec![],
                    recorded_at: stagehand_schemas::now(),
                };
                let bytes = rmp_serde::to_vec_named(&stored).unwrap();
                t.insert("req-1", bytes.as_slice()).unwrap();
                let empty = StoredOutcome {
                    facts: vec![],
                    ..stored
                };
                let bytes = rmp_serde::to_vec_named(&empty).unwrap();
                t.insert("no-facts", bytes.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        let ledger = Ledger::open(&path).unwrap();
        // Under the project-scoped key of the ledgers that followed: it answers for a message
        // stored before kinds were part of keys.
        let before = EventKey::of_message(&req, stagehand_schemas::now() - Duration::from_secs(60));
        assert_eq!(
            ledger.recorded_bytes(&before).unwrap().unwrap().facts,
            vec![wire::encode(&fact).unwrap()]
        );
        assert_eq!(ledger.len().unwrap(), 1);
    }

    /// Guards the kind in the key: an event of another kind with the same project and id (a
    /// training job's checkpoint commit carrying the id of the project's next verdict) never
    /// answers for this one; a record of a ledger written before kinds were part of keys answers
    /// only for messages the stream stored before the upgrade, never for later ones.
    #[test]
    fn records_are_scoped_by_kind_and_earlier_records_answer_only_for_earlier_messages() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v2.redb");
        let req = event("lab-a", "req-1");
        let fact = req.caused("done", req.body.clone());
        let stored = StoredOutcome {
            facts: vec![serde_bytes::ByteBuf::from(wire::encode(&fact).unwrap())],
            dead_letter: None,
            permanent_error: None,
            attempts: vec![],
            recorded_at: stagehand_schemas::now(),
        };
        let bytes = rmp_serde::to_vec_named(&stored).unwrap();
        {
            // A ledger of project-scoped keys without kinds, as written before.
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                txn.open_table(OUTCOMES)
                    .unwrap()
                    .insert("lab-a/req-1", bytes.as_slice())
                    .unwrap();
                txn.open_table(META)
                    .unwrap()
                    .insert(LEDGER_ID, b"an earlier ledger".as_slice())
                    .unwrap();
            }
            txn.commit().unwrap();
        }
        let ledger = Ledger::open(&path).unwrap();
        let at = |secs: i64| stagehand_schemas::now() + time::Duration::seconds(secs);
        assert!(
            ledger
                .recorded_bytes(&EventKey::of_message(&req, at(-60)))
                .unwrap()
                .is_some(),
            "a message stored before the upgrade is not done twice"
        );
        assert!(
            ledger
                .recorded_bytes(&EventKey::of_message(&req, at(60)))
                .unwrap()
                .is_none(),
            "a message stored after the upgrade cannot borrow an earlier record"
        );
        assert!(
            ledger
                .outcome("lab-a", req.kind(), &req.id)
                .unwrap()
                .is_none()
        );
        drop(ledger);

        // Kinds: the same project and id recorded for one kind says nothing of another.
        let (ledger, _dir) = {
            let dir = tempfile::tempdir().unwrap();
            (Ledger::open(dir.path().join("v3.redb")).unwrap(), dir)
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (writer, thread) = writer(&ledger);
        let key = EventKey::of_message(&req, at(0));
        rt.block_on(writer.record_outcome(&key, vec![wire::encode(&fact).unwrap()]))
            .unwrap();
        let mut other_kind = req.clone();
        other_kind.body = Body::StageRequested(stagehand_schemas::StageRequested {
            dataset: "d".into(),
            version: "v".into(),
            tier: "hot".into(),
            job_id: "j".into(),
            requested_by: "s".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        });
        assert!(ledger.recorded_bytes(&key).unwrap().is_some());
        assert!(
            ledger
                .recorded_bytes(&EventKey::of_message(&other_kind, at(0)))
                .unwrap()
                .is_none()
        );
        drop(writer);
        thread.join().unwrap();
    }
}
