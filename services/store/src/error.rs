//! How a write did not become durable ([`CommitError`]), and the typed failure of a service's
//! redb state file ([`StateError`]), each saying whether retrying can help.

use std::path::PathBuf;
use std::sync::Arc;

use stagehand_schemas::Retryable;

/// How a queued write did not become durable.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommitError<E> {
    /// The batch holding the write failed to commit (or to apply): nothing of it was written.
    /// Every waiter of the batch holds the one cause, shared: a store's error need not be
    /// `Clone` (redb's are not), and none is flattened into text to be copied.
    #[error(transparent)]
    Failed(Arc<E>),
    /// The writer thread is gone (it panicked, or the store is closing); the write may or may
    /// not have been committed.
    #[error("the {0} writer thread has stopped")]
    Stopped(&'static str),
}

/// A failure of a service's redb state file, typed so that callers branch on what failed
/// and on [`Retryable`], never on its text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The file could not be opened or created (an unwritable folder, another process holds
    /// it, not a redb file, a failing disk).
    #[error("state file {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: redb::Error,
    },
    /// redb failed reading or writing the file.
    #[error("state file: {0}")]
    Redb(#[from] redb::Error),
    /// A stored record does not decode: the file was damaged or written by an incompatible
    /// version.
    #[error("state record {what} does not decode: {source}")]
    Decode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// A record could not be encoded.
    #[error("state record {what} cannot be encoded: {source}")]
    Encode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// The batch of writes holding this one failed to commit, for this shared cause.
    #[error(transparent)]
    Batch(Arc<StateError>),
    /// The store's writer thread has stopped (the service is closing, or it panicked).
    #[error("the {0} writer thread has stopped")]
    Stopped(&'static str),
    /// The store's writer thread could not be started (the process is out of resources).
    #[error("starting the {name} writer thread: {source}")]
    Spawn {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Opens the state file at `path`, creating it whole if missing ([`crate::open_redb`]); an
/// error names the file.
pub fn create_state_file(path: &std::path::Path) -> Result<redb::Database, StateError> {
    crate::open_redb(path).map_err(|e| StateError::Open {
        path: path.to_owned(),
        source: e.into(),
    })
}

impl StateError {
    /// A record that does not decode; `what` names it (its table and key).
    pub fn decode(what: impl Into<String>, source: serde_json::Error) -> StateError {
        StateError::Decode {
            what: what.into(),
            source,
        }
    }

    /// A record that cannot be encoded; `what` names it.
    pub fn encode(what: impl Into<String>, source: serde_json::Error) -> StateError {
        StateError::Encode {
            what: what.into(),
            source,
        }
    }
}

impl From<CommitError<StateError>> for StateError {
    fn from(e: CommitError<StateError>) -> Self {
        match e {
            CommitError::Failed(cause) => StateError::Batch(cause),
            CommitError::Stopped(name) => StateError::Stopped(name),
        }
    }
}

/// Implements `From` for each of redb's per-operation errors (opening, transactions, tables,
/// storage, commits) by way of [`redb::Error`] into one variant of a store's error, so that
/// `?` works on every redb call: `stagehand_store::from_redb!(StoreError::Redb);` beside an
/// enum with `Redb(#[from] redb::Error)`.
#[macro_export]
macro_rules! from_redb {
    ($($variant:ident)::+) => {
        $crate::from_redb!(@each $($variant)::+;
            $crate::__redb::DatabaseError,
            $crate::__redb::TransactionError,
            $crate::__redb::TableError,
            $crate::__redb::StorageError,
            $crate::__redb::CommitError);
    };
    (@each $error:ident :: $variant:ident; $($t:ty),*) => {$(
        impl From<$t> for $error {
            fn from(e: $t) -> Self {
                $error::$variant(e.into())
            }
        }
    )*};
}
from_redb!(StateError::Redb);

/// Whether a redb failure may pass: I/O (a full disk gets space; redb latches it until the
/// file is reopened, which a restart does), or a file another process still holds. Anything
/// else (a damaged file, a table of another type, a value too large) stays as it is.
pub fn redb_is_transient(e: &redb::Error) -> bool {
    matches!(
        e,
        redb::Error::Io(_)
            | redb::Error::PreviousIo
            | redb::Error::DatabaseClosed
            | redb::Error::DatabaseAlreadyOpen
            | redb::Error::WouldBlock
    )
}

impl Retryable for StateError {
    fn is_retryable(&self) -> bool {
        match self {
            StateError::Open { source, .. } | StateError::Redb(source) => redb_is_transient(source),
            StateError::Decode { .. } | StateError::Encode { .. } => false,
            StateError::Batch(cause) => cause.is_retryable(),
            StateError::Stopped(_) | StateError::Spawn { .. } => true,
        }
    }
}
