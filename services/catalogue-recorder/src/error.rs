//! Errors of the catalogue recorder, each able to say whether retrying can help.

use stagehand_schemas::Retryable;

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
    /// The batch of folds holding this one failed to commit, for this shared cause.
    #[error(transparent)]
    Batch(std::sync::Arc<StoreError>),
    /// The store's single writer is gone (the recorder is shutting down).
    #[error("catalogue writer stopped")]
    WriterGone,
    /// A record would be larger than a record may be (so that every answer stays bounded).
    #[error("catalogue record {what} would be {bytes} bytes, over the bound of {max}")]
    TooLarge {
        what: String,
        bytes: usize,
        max: usize,
    },
    /// Writing or reading the manifest spool beside the store failed (a full disk, EIO).
    #[error("manifest spool: {0}")]
    Spool(String),
    /// The store failed while folding (the first failure, `detail`): the recorder stops and
    /// exits non-zero, and its supervisor restarts it with the store reopened.
    #[error("catalogue store {} failed: {detail}; the recorder stops so that it is restarted with the store reopened", path.display())]
    Failed {
        path: std::path::PathBuf,
        detail: String,
    },
}

impl StoreError {
    /// Whether the recorder's own disk failed rather than anything about a fact: any redb
    /// error while folding (ENOSPC, EIO, a failed commit — which redb latches until the
    /// database is reopened) or a failed spool. Retrying the fact would only spend its
    /// attempts until it is dead-lettered and the catalogue lacks it for good, so the recorder
    /// stops instead and the fact waits for the restart.
    pub fn is_store_failure(&self) -> bool {
        match self {
            StoreError::Batch(cause) => cause.is_store_failure(),
            _ => matches!(
                self,
                StoreError::Redb(_) | StoreError::Spool(_) | StoreError::Failed { .. }
            ),
        }
    }
}

impl Retryable for StoreError {
    /// Whether retrying the same operation can succeed.
    fn is_retryable(&self) -> bool {
        match self {
            StoreError::Batch(cause) => cause.is_retryable(),
            // I/O can be transient (a full disk gets space); the writer restarts with the recorder.
            StoreError::Redb(_)
            | StoreError::WriterGone
            | StoreError::Spool(_)
            | StoreError::Failed { .. } => true,
            StoreError::Corrupt { .. } | StoreError::TooLarge { .. } => false,
        }
    }
}

stagehand_store::from_redb!(StoreError::Redb);

/// A failure of the recorder service as a whole.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecorderError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// NATS or JetStream refused or failed an operation; `what` says which.
    #[error("{what}: {detail}")]
    Nats { what: &'static str, detail: String },
    /// The runtime or the connection failed; its kind says whether retrying can help.
    #[error(transparent)]
    Bus(#[from] stagehand_bus::BusError),
    /// One of the recorder's tasks (facts, dead letters, queries) failed, or the service
    /// runner could not run it (configuration, telemetry, metrics).
    #[error(transparent)]
    Service(#[from] stagehand_bus::runner::ServiceError),
    /// A blocking task of the recorder (store access) panicked or was cancelled.
    #[error("catalogue store task: {0}")]
    Blocking(#[from] tokio::task::JoinError),
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
}

impl Retryable for RecorderError {
    fn is_retryable(&self) -> bool {
        match self {
            RecorderError::Store(e) => e.is_retryable(),
            RecorderError::Nats { .. } => true,
            RecorderError::Bus(e) => e.is_retryable(),
            RecorderError::Service(e) => e.is_retryable(),
            RecorderError::Blocking(_) | RecorderError::Encode(_) => false,
        }
    }
}
