//! Errors of the catalogue recorder, each able to say whether retrying can help.

/// A failure of the catalogue store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// redb failed (I/O, a full disk, a lock held by another process).
    #[error("catalogue store: {0}")]
    Redb(#[from] redb::Error),
    /// A stored value does not decode: the store was damaged or written by an incompatible
    /// version. Rebuild the catalogue from the facts stream (see `runbooks/rebuild-catalogue.md`).
    #[error("catalogue record {key:?} is corrupt: {detail}")]
    Corrupt { key: String, detail: String },
    /// The store's single writer is gone (the recorder is shutting down).
    #[error("catalogue writer stopped")]
    WriterGone,
}

impl StoreError {
    /// Whether retrying the same operation can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            // I/O can be transient (a full disk gets space); the writer restarts with the recorder.
            StoreError::Redb(_) | StoreError::WriterGone => true,
            StoreError::Corrupt { .. } => false,
        }
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::Redb(e.into())
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

/// A failure of the recorder service as a whole.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecorderError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// NATS or JetStream refused or failed an operation; `what` says which.
    #[error("{what}: {detail}")]
    Nats { what: &'static str, detail: String },
    /// The worker runtime failed; its kind says whether restarting can help.
    #[error("catalogue worker: {0}")]
    Worker(#[from] stagehand_bus::BusError),
    /// A blocking task of the recorder (store access) panicked or was cancelled.
    #[error("catalogue store task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// A readiness entry could not be encoded.
    #[error("encoding readiness: {0}")]
    Encode(#[from] serde_json::Error),
}

impl RecorderError {
    pub(crate) fn nats(what: &'static str, e: impl std::fmt::Display) -> Self {
        RecorderError::Nats {
            what,
            detail: e.to_string(),
        }
    }

    pub fn is_retryable(&self) -> bool {
        match self {
            RecorderError::Store(e) => e.is_retryable(),
            RecorderError::Nats { .. } => true,
            RecorderError::Worker(e) => e.is_retryable(),
            RecorderError::Task(_) | RecorderError::Encode(_) => false,
        }
    }
}
