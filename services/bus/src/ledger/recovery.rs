//! A failed store reopened, or the ledger failed: redb latches an I/O failure until the
//! database is reopened, so the writer reopens the file, checks its integrity and identity,
//! and gives up after [`REOPEN_FOR`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use redb::{Database, ReadableDatabase};
use stagehand_schemas::Retryable;
use tracing::warn;

use super::Ledger;
use super::error::{LedgerError, LedgerErrorKind, is_io};
use super::schema::{LEDGER_ID, META};

/// How long the writer keeps trying to reopen a failed store before the ledger is failed.
pub const REOPEN_FOR: Duration = Duration::from_secs(30);

impl Ledger {
    /// The database, unless the writer is reopening it or it failed.
    pub(super) fn db(&self) -> Result<Arc<Database>, LedgerError> {
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
    pub(super) fn read_err(&self, what: &str, e: impl Into<redb::Error>) -> LedgerError {
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

    pub(super) fn write_err(&self, what: &str, e: redb::Error) -> LedgerError {
        let kind = if is_io(&e) {
            LedgerErrorKind::Io
        } else {
            LedgerErrorKind::Corrupt
        };
        LedgerError::caused(kind, &self.store.path, what.to_owned(), e)
    }

    /// Drops the database, reopens the file, checks its integrity and identity, and puts it
    /// back; retried with backoff for [`REOPEN_FOR`]. Called by the writer only.
    pub(super) fn reopen(&self) -> Result<(), LedgerError> {
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

    pub(super) fn fail(&self, why: &LedgerError) {
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
