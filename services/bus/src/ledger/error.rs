//! The ledger's error: what kind of failure, which file, what was being done.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use stagehand_schemas::Retryable;

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

/// Why the ledger could not be read or written. Cloned, it shares its cause: every requester
/// of a batch that failed to commit is told the one failure.
#[derive(Debug, Clone, thiserror::Error)]
#[error("ledger {}: {what}", path.display())]
pub struct LedgerError {
    pub(super) kind: LedgerErrorKind,
    pub(super) path: PathBuf,
    pub(super) what: String,
    #[source]
    pub(super) source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl LedgerError {
    pub(super) fn new(kind: LedgerErrorKind, path: &Path, what: impl Into<String>) -> Self {
        Self {
            kind,
            path: path.to_owned(),
            what: what.into(),
            source: None,
        }
    }

    pub(super) fn caused(
        kind: LedgerErrorKind,
        path: &Path,
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            source: Some(Arc::from(source.into())),
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
pub(super) fn is_io(e: &redb::Error) -> bool {
    matches!(
        e,
        redb::Error::Io(_) | redb::Error::PreviousIo | redb::Error::DatabaseClosed
    )
}
