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
//! go through one writer thread that takes every request queued at that moment, applies them in
//! one transaction and answers each requester after the commit: many concurrent outcomes share
//! one fsync.
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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle,
};
use serde::{Deserialize, Serialize};
use stagehand_schemas::Retryable;
use stagehand_schemas::{Attempt, Event, EventId, wire};
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

/// Outcome of each finished event, by [`EventKey`].
const OUTCOMES: TableDefinition<&str, &[u8]> = TableDefinition::new("outcomes_v2");
/// Dead letters published, by dead-letter id.
const DEAD_LETTERS: TableDefinition<&str, &[u8]> = TableDefinition::new("dead_letters_v2");
/// Failed attempts of events not finished yet, by [`EventKey`].
const ATTEMPTS: TableDefinition<&str, &[u8]> = TableDefinition::new("attempts_v2");
/// (recorded at, µs since the epoch; tagged key) → (): what pruning walks, oldest first. The
/// tag says which table the key is in ([`Tag`]).
const BY_TIME: TableDefinition<(u64, &str), ()> = TableDefinition::new("by_time_v2");
/// The ledger's identity, so that a reopen can tell its own file from a replaced one.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const LEDGER_ID: &str = "ledger_id";
/// Meta key: since when (µs since the epoch, big-endian) keys name the event's kind. A record
/// under an earlier key answers only for messages stored before then ([`EventKey`]).
const KINDS_SINCE: &str = "kinds_since";

/// Schema-1 tables (keyed by bare event id), migrated into the scoped ones at open.
const OUTCOMES_V1: TableDefinition<&str, &[u8]> = TableDefinition::new("outcomes");
const ATTEMPTS_V1: TableDefinition<&str, &[u8]> = TableDefinition::new("attempts");

/// Most requests folded into one write transaction.
const MAX_BATCH: usize = 4096;

/// How long the writer keeps trying to reopen a failed store before the ledger is failed.
pub const REOPEN_FOR: Duration = Duration::from_secs(30);

/// Longest attempt history kept per event; the worker refuses a `max_attempts` above it.
pub const MAX_ATTEMPTS_KEPT: usize = 100;

/// Longest error text kept per attempt: a dead letter carries the history and must stay
/// under the message bound.
const MAX_ERROR_CHARS: usize = 1024;

/// What kind of ledger failure this is, for callers to branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LedgerErrorKind {
    /// The file could not be opened or created (a missing or unwritable directory, locked by
    /// another process, not a ledger).
    Open,
    /// A read or write failed; the store is being reopened and may work again.
    Io,
    /// A record does not decode.
    Corrupt,
    /// The store failed and could not be reopened and checked, or was replaced by another
    /// file: nothing more can be recorded, and the worker must stop.
    Failed,
    /// The writer thread has stopped (the worker is shutting down).
    WriterGone,
}

impl Retryable for LedgerErrorKind {
    fn is_retryable(&self) -> bool {
        matches!(self, LedgerErrorKind::Io | LedgerErrorKind::WriterGone)
    }
}

/// Why the ledger could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("ledger {}: {what}", path.display())]
pub struct LedgerError {
    kind: LedgerErrorKind,
    path: PathBuf,
    what: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl LedgerError {
    fn new(kind: LedgerErrorKind, path: &Path, what: impl Into<String>) -> Self {
        Self {
            kind,
            path: path.to_owned(),
            what: what.into(),
            source: None,
        }
    }

    fn caused(
        kind: LedgerErrorKind,
        path: &Path,
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            source: Some(source.into()),
            ..Self::new(kind, path, what)
        }
    }

    pub fn kind(&self) -> LedgerErrorKind {
        self.kind
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Retryable for LedgerError {
    /// An I/O failure may pass (the store is reopened); a corrupt record, an unopenable or
    /// failed store will not.
    fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}

/// Whether a redb error is an I/O failure (which redb latches until the database is
/// reopened), rather than a logic or data error.
fn is_io(e: &redb::Error) -> bool {
    matches!(
        e,
        redb::Error::Io(_) | redb::Error::PreviousIo | redb::Error::DatabaseClosed
    )
}

/// Where the ledger keeps an event: `<project>/<kind>/<event id>`. Project tokens are
/// `[a-z0-9_-]`, kinds `[a-z.]` and ids `[A-Za-z0-9._:-]`, so no two (project, kind, id)
/// triples share a key: an event of one kind (a training job's checkpoint commit) can never
/// answer for another kind's with the same id (the validator's verdict of the same project).
///
/// Ledgers written before kinds were part of the key keyed an event `<project>/<event id>`.
/// Such a record still answers for a message the stream stored before this ledger began
/// scoping by kind (see [`Ledger::open`]), never for a later one: an event finished before the
/// upgrade is not done twice, and nothing published after it can borrow an old record.
#[derive(Debug, Clone)]
pub struct EventKey {
    key: String,
    /// The key an earlier ledger used, and when the stream stored the message (µs since the
    /// epoch, the server's clock).
    earlier: Option<(String, u64)>,
}

impl EventKey {
    pub fn new(project: &str, kind: &str, id: &EventId) -> Self {
        Self {
            key: format!("{project}/{kind}/{id}"),
            earlier: None,
        }
    }

    /// The key of `event` as delivered in a message the stream stored at `stored_at`.
    pub(crate) fn of_message(event: &Event, stored_at: OffsetDateTime) -> Self {
        Self {
            earlier: Some((earlier_key(&event.project, &event.id), micros(stored_at))),
            ..Self::new(&event.project, event.kind(), &event.id)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.key
    }
}

/// The key ledgers written before kind-scoped keys gave `project`'s event `id`.
fn earlier_key(project: &str, id: &EventId) -> String {
    format!("{project}/{id}")
}

impl PartialEq for EventKey {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for EventKey {}

impl std::hash::Hash for EventKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl std::fmt::Display for EventKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key)
    }
}

/// Which table a [`BY_TIME`] entry points into: the first byte of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Outcome,
    DeadLetter,
    Attempts,
}

impl Tag {
    fn prefix(self) -> &'static str {
        match self {
            Tag::Outcome => "o:",
            Tag::DeadLetter => "d:",
            Tag::Attempts => "a:",
        }
    }

    fn tagged(self, key: &str) -> String {
        format!("{}{key}", self.prefix())
    }

    fn split(tagged: &str) -> Option<(Tag, &str)> {
        [Tag::Outcome, Tag::DeadLetter, Tag::Attempts]
            .into_iter()
            .find_map(|t| tagged.strip_prefix(t.prefix()).map(|k| (t, k)))
    }
}

fn micros(t: OffsetDateTime) -> u64 {
    u64::try_from(t.unix_timestamp_nanos() / 1_000).unwrap_or(0)
}

/// What the ledger stores for a finished event or a dead letter.
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
        let db = Database::create(&path).map_err(|e| open_err("opening", e.into()))?;
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

    /// The database, unless the writer is reopening it or it failed.
    fn db(&self) -> Result<Arc<Database>, LedgerError> {
        let guard = self
            .store
            .db
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_ref() {
            Some(db) => Ok(db.clone()),
            None => Err(match self.failure() {
                Some(why) => self.err(LedgerErrorKind::Failed, why),
                None => self.err(LedgerErrorKind::Io, "being reopened after an I/O failure"),
            }),
        }
    }

    /// Maps a redb error of a read; an I/O failure asks the writer to reopen the store.
    fn read_err(&self, what: &str, e: impl Into<redb::Error>) -> LedgerError {
        let e = e.into();
        if is_io(&e) {
            self.store.reopen_wanted.store(true, Ordering::Release);
            LedgerError::caused(LedgerErrorKind::Io, &self.store.path, what.to_owned(), e)
        } else {
            LedgerError::caused(
                LedgerErrorKind::Corrupt,
                &self.store.path,
                what.to_owned(),
                e,
            )
        }
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

    /// Removes, oldest first, at most `limit` outcomes, dead letters and attempt histories
    /// recorded before `cutoff`, and returns how many it removed. The worker calls this on a
    /// timer with `cutoff` = now − `ledger_retention`; pass the clock you want.
    pub fn prune_before(&self, cutoff: OffsetDateTime, limit: usize) -> Result<u64, LedgerError> {
        let db = self.db()?;
        prune(&db, micros(cutoff), limit).map_err(|e| self.write_err("pruning", e))
    }

    fn write_err(&self, what: &str, e: redb::Error) -> LedgerError {
        let kind = if is_io(&e) {
            LedgerErrorKind::Io
        } else {
            LedgerErrorKind::Corrupt
        };
        LedgerError::caused(kind, &self.store.path, what.to_owned(), e)
    }

    /// Starts the single writer thread. Dropping every [`LedgerWriter`] clone stops it once
    /// the queued requests are committed. `on_failed` runs once if the store fails for good.
    pub(crate) fn spawn_writer(
        &self,
        on_failed: Box<dyn Fn(LedgerError) + Send>,
    ) -> (LedgerWriter, std::thread::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(WriterStats::default());
        let ledger = self.clone();
        let thread_stats = stats.clone();
        let handle = std::thread::Builder::new()
            .name("stagehand-ledger".into())
            .spawn(move || writer_loop(&ledger, rx, &thread_stats, &*on_failed))
            .expect("spawning a thread only fails when the process is out of resources");
        (LedgerWriter { tx, stats }, handle)
    }

    /// Drops the database, reopens the file, checks its integrity and identity, and puts it
    /// back; retried with backoff for [`REOPEN_FOR`]. Called by the writer only.
    fn reopen(&self) -> Result<(), LedgerError> {
        let started = Instant::now();
        let old = self
            .store
            .db
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        // Readers hold clones for the length of one read; wait for them to let go, since redb
        // refuses to open a file this process still has open.
        if let Some(mut old) = old {
            loop {
                match Arc::try_unwrap(old) {
                    Ok(db) => {
                        drop(db);
                        break;
                    }
                    Err(still_shared) if started.elapsed() < REOPEN_FOR => {
                        old = still_shared;
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => {
                        return Err(self.err(
                            LedgerErrorKind::Failed,
                            "the failed store is still in use after 30 s; it cannot be reopened",
                        ));
                    }
                }
            }
        }
        let mut delays =
            crate::RetrySchedule::exponential(Duration::from_millis(50), Duration::from_secs(5))
                .delays();
        loop {
            match self.open_checked() {
                Ok(db) => {
                    *self
                        .store
                        .db
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(db));
                    self.store.reopens.fetch_add(1, Ordering::Relaxed);
                    self.store.reopen_wanted.store(false, Ordering::Release);
                    return Ok(());
                }
                Err(e)
                    if e.is_retryable()
                        && let Some(delay) = delays.next()
                        && started.elapsed() + delay < REOPEN_FOR =>
                {
                    warn!(ledger = %self.store.path.display(), error = %e, ?delay, "reopening the ledger failed; retrying");
                    std::thread::sleep(delay);
                }
                Err(e) => {
                    return Err(LedgerError {
                        kind: LedgerErrorKind::Failed,
                        ..e
                    });
                }
            }
        }
    }

    /// Opens the existing file (never creates one: a missing ledger is a failure, not a fresh
    /// start), checks and repairs its integrity, and checks it is this ledger.
    fn open_checked(&self) -> Result<Database, LedgerError> {
        let path = &self.store.path;
        let io = |what: &str, e: redb::Error| {
            let kind = if is_io(&e) {
                LedgerErrorKind::Io
            } else {
                LedgerErrorKind::Failed
            };
            LedgerError::caused(kind, path, what.to_owned(), e)
        };
        if !path.exists() {
            return Err(self.err(
                LedgerErrorKind::Failed,
                "the file is gone; refusing to start an empty ledger in its place",
            ));
        }
        let mut db = Database::open(path).map_err(|e| io("reopening", e.into()))?;
        let clean = db
            .check_integrity()
            .map_err(|e| io("checking integrity", e.into()))?;
        if !clean {
            warn!(ledger = %path.display(), "ledger repaired on reopen");
        }
        let txn = db
            .begin_read()
            .map_err(|e| io("checking identity", e.into()))?;
        let meta = txn
            .open_table(META)
            .map_err(|e| io("checking identity", e.into()))?;
        let id = meta
            .get(LEDGER_ID)
            .map_err(|e| io("checking identity", e.into()))?
            .map(|v| v.value().to_vec());
        drop(meta);
        drop(txn);
        if id.as_deref() != Some(self.store.id.as_slice()) {
            return Err(self.err(
                LedgerErrorKind::Failed,
                "the reopened file is another ledger than the one opened at start",
            ));
        }
        Ok(db)
    }

    fn fail(&self, why: &LedgerError) {
        let mut failed = self
            .store
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if failed.is_none() {
            *failed = Some(why.to_string());
        }
        drop(failed);
        // Leave no database behind: every later call reports the failure.
        self.store
            .db
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }
}

impl From<StoredOutcome> for RecordedBytes {
    fn from(s: StoredOutcome) -> Self {
        RecordedBytes {
            facts: s
                .facts
                .into_iter()
                .map(serde_bytes::ByteBuf::into_vec)
                .collect(),
            dead_letter: s.dead_letter.map(serde_bytes::ByteBuf::into_vec),
        }
    }
}

/// Creates the tables of a fresh ledger and returns its id (writing one if missing) and since
/// when its keys name the kind (noting it now for a ledger of earlier keys, 0 for a new one).
fn init(db: &Database) -> Result<(Vec<u8>, u64), redb::Error> {
    let txn = db.begin_write()?;
    // A file without tables is a new ledger: none of its keys will be of the earlier form.
    let fresh = txn.list_tables()?.next().is_none();
    let id = {
        txn.open_table(OUTCOMES)?;
        txn.open_table(DEAD_LETTERS)?;
        txn.open_table(ATTEMPTS)?;
        txn.open_table(BY_TIME)?;
        let mut meta = txn.open_table(META)?;
        let existing = meta.get(LEDGER_ID)?.map(|v| v.value().to_vec());
        match existing {
            Some(id) => id,
            None => {
                let id = uuid::Uuid::new_v4().as_bytes().to_vec();
                meta.insert(LEDGER_ID, id.as_slice())?;
                id
            }
        }
    };
    let kinds_since = {
        let mut meta = txn.open_table(META)?;
        let noted = meta
            .get(KINDS_SINCE)?
            .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
            .map(u64::from_be_bytes);
        match noted {
            Some(since) => since,
            None => {
                let since = if fresh {
                    0
                } else {
                    micros(stagehand_schemas::now())
                };
                meta.insert(KINDS_SINCE, since.to_be_bytes().as_slice())?;
                since
            }
        }
    };
    txn.commit()?;
    Ok((id, kinds_since))
}

/// Moves schema-1 outcomes (keyed by bare event id) to project-scoped keys: the project comes
/// from the recorded facts, a dead letter moves to the dead-letter table under its own id, and
/// an outcome without facts (its project unknown) is dropped — a later copy of that event is
/// worked on again. Schema-1 attempt histories are dropped. Returns how many records moved.
fn migrate_v1(db: &Database) -> Result<u64, redb::Error> {
    let txn = db.begin_write()?;
    let names: Vec<String> = txn.list_tables()?.map(|t| t.name().to_owned()).collect();
    if !names
        .iter()
        .any(|n| n == OUTCOMES_V1.name() || n == ATTEMPTS_V1.name())
    {
        return Ok(0);
    }
    let mut moved = 0;
    if names.iter().any(|n| n == OUTCOMES_V1.name()) {
        let legacy = txn.open_table(OUTCOMES_V1)?;
        let mut outcomes = txn.open_table(OUTCOMES)?;
        let mut dead = txn.open_table(DEAD_LETTERS)?;
        let mut by_time = txn.open_table(BY_TIME)?;
        for entry in legacy.iter()? {
            let (k, v) = entry?;
            let Ok(stored) = rmp_serde::from_slice::<StoredOutcome>(v.value()) else {
                continue;
            };
            let at = micros(stored.recorded_at);
            if let Some(dl) = stored
                .dead_letter
                .as_deref()
                .and_then(|b| wire::decode(b).ok())
            {
                dead.insert(dl.id.as_str(), v.value())?;
                by_time.insert((at, Tag::DeadLetter.tagged(dl.id.as_str()).as_str()), ())?;
                moved += 1;
            } else if let Some(first) = stored.facts.first().and_then(|b| wire::decode(b).ok())
                && let Ok(id) = EventId::new(k.value())
            {
                // The kind of the event is not recorded: the key of the ledgers that followed,
                // consulted for messages stored before kinds were part of keys.
                let key = earlier_key(&first.project, &id);
                outcomes.insert(key.as_str(), v.value())?;
                by_time.insert((at, Tag::Outcome.tagged(key.as_str()).as_str()), ())?;
                moved += 1;
            }
        }
    }
    if names.iter().any(|n| n == OUTCOMES_V1.name()) {
        txn.delete_table(OUTCOMES_V1)?;
    }
    if names.iter().any(|n| n == ATTEMPTS_V1.name()) {
        txn.delete_table(ATTEMPTS_V1)?;
    }
    txn.commit()?;
    Ok(moved)
}

fn decode_stored(path: &Path, key: &str, bytes: &[u8]) -> Result<StoredOutcome, LedgerError> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        LedgerError::caused(
            LedgerErrorKind::Corrupt,
            path,
            format!("record {key} does not decode"),
            e,
        )
    })
}

fn decode_attempts(path: &Path, key: &str, bytes: &[u8]) -> Result<Vec<Attempt>, LedgerError> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        LedgerError::caused(
            LedgerErrorKind::Corrupt,
            path,
            format!("attempts of {key} do not decode"),
            e,
        )
    })
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

struct Request {
    write: Write,
    done: oneshot::Sender<Result<Reply, LedgerError>>,
}

/// Sends writes to the writer thread and waits for their commit.
#[derive(Clone)]
pub(crate) struct LedgerWriter {
    tx: mpsc::UnboundedSender<Request>,
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
        let (done, rx) = oneshot::channel();
        let gone = || LedgerError {
            kind: LedgerErrorKind::WriterGone,
            path: PathBuf::new(),
            what: "the writer has stopped".into(),
            source: None,
        };
        self.tx.send(Request { write, done }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

fn writer_loop(
    ledger: &Ledger,
    mut rx: mpsc::UnboundedReceiver<Request>,
    stats: &WriterStats,
    on_failed: &dyn Fn(LedgerError),
) {
    let mut batch = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        if ledger.store.reopen_wanted.load(Ordering::Acquire)
            && ledger.failure().is_none()
            && let Err(e) = ledger.reopen()
        {
            fail(ledger, e, on_failed);
        }
        let result = ledger
            .db()
            .and_then(|db| apply(&db, &batch).map_err(|e| ledger.write_err("writing", e)));
        stats.commits.fetch_add(1, Ordering::Relaxed);
        stats
            .writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        metrics::counter!(stagehand_telemetry::names::LEDGER_COMMITS_TOTAL).increment(1);
        match result {
            Ok(replies) => {
                for (req, reply) in batch.drain(..).zip(replies) {
                    let reply = match reply {
                        Reply::Corrupt(what) => Err(LedgerError::new(
                            LedgerErrorKind::Corrupt,
                            ledger.path(),
                            what,
                        )),
                        other => Ok(other),
                    };
                    // The requester may have been cancelled by a shutdown deadline; its write
                    // stands.
                    let _ = req.done.send(reply);
                }
            }
            Err(e) => {
                let kind = e.kind();
                for req in batch.drain(..) {
                    let _ =
                        req.done
                            .send(Err(LedgerError::new(kind, ledger.path(), e.to_string())));
                }
                if kind == LedgerErrorKind::Io {
                    error!(ledger = %ledger.path().display(), error = %e, "ledger write failed; reopening the store");
                    if let Err(e) = ledger.reopen() {
                        fail(ledger, e, on_failed);
                    }
                }
            }
        }
    }
}

fn fail(ledger: &Ledger, e: LedgerError, on_failed: &dyn Fn(LedgerError)) {
    error!(ledger = %ledger.path().display(), error = %e, "the ledger failed and cannot be reopened; the worker stops");
    ledger.fail(&e);
    on_failed(e);
}

fn apply(db: &Database, batch: &[Request]) -> Result<Vec<Reply>, redb::Error> {
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
        for req in batch {
            let reply = match &req.write {
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

fn prune(db: &Database, cutoff: u64, limit: usize) -> Result<u64, redb::Error> {
    let txn = db.begin_write()?;
    let removed = {
        let mut outcomes = txn.open_table(OUTCOMES)?;
        let mut dead = txn.open_table(DEAD_LETTERS)?;
        let mut attempts = txn.open_table(ATTEMPTS)?;
        let mut by_time = txn.open_table(BY_TIME)?;
        prune_in(
            &mut outcomes,
            &mut dead,
            &mut attempts,
            &mut by_time,
            cutoff,
            limit,
        )?
    };
    txn.commit()?;
    Ok(removed)
}

fn prune_in(
    outcomes: &mut redb::Table<&str, &[u8]>,
    dead: &mut redb::Table<&str, &[u8]>,
    attempts: &mut redb::Table<&str, &[u8]>,
    by_time: &mut redb::Table<(u64, &str), ()>,
    cutoff: u64,
    limit: usize,
) -> Result<u64, redb::Error> {
    let old: Vec<(u64, String)> = by_time
        .range(..(cutoff, ""))?
        .take(limit)
        .map(|e| e.map(|(k, _)| (k.value().0, k.value().1.to_owned())))
        .collect::<Result<_, _>>()?;
    for (at, tagged) in &old {
        match Tag::split(tagged) {
            Some((Tag::Outcome, key)) => drop(outcomes.remove(key)?),
            Some((Tag::DeadLetter, key)) => drop(dead.remove(key)?),
            Some((Tag::Attempts, key)) => drop(attempts.remove(key)?),
            None => {}
        }
        by_time.remove((*at, tagged.as_str()))?;
    }
    Ok(old.len() as u64)
}

#[cfg(test)]
mod tests {
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
