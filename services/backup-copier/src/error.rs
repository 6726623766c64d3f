//! Why the backup copier could not start, back up, drill or restore.

use stagehand_bus::BusError;
use stagehand_bus::runner::ServiceError;
use stagehand_catalogue::CatalogueError;
use stagehand_manifest::ManifestError;
use stagehand_mover::TransferError;
use stagehand_policy::{PolicyError, TierError};
use stagehand_schemas::Retryable;

/// Everything that can go wrong, each able to say whether trying again can help.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    /// A policy file is wrong, or `backup.toml`, which says what to protect, is absent.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A tier could not be opened.
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The S3 backup bucket cannot hold objects the way `[object_lock]` asks.
    #[error("backup tier {tier:?}: {detail}")]
    ObjectLock { tier: String, detail: String },
    /// A copy the rules forbid (same failure domain, a name that cannot be a path, a version
    /// whose manifest is not its digest). Permanent.
    #[error("{0}")]
    Refused(String),
    /// What a restore names is not in the catalogue, or has no backup. Permanent.
    #[error("{0}")]
    NotFound(String),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(transparent)]
    Catalogue(#[from] CatalogueError),
    #[error(transparent)]
    Bus(#[from] BusError),
    /// A folder of its own, one of its tasks, or the runner (configuration, metrics).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl Retryable for BackupError {
    /// Whether doing the same again later can succeed (a tier, NATS or the catalogue was
    /// briefly unavailable), as opposed to a configuration or data problem.
    fn is_retryable(&self) -> bool {
        match self {
            BackupError::Policy(_)
            | BackupError::ObjectLock { .. }
            | BackupError::Refused(_)
            | BackupError::NotFound(_) => false,
            BackupError::Tier(e) => e.is_retryable(),
            BackupError::Transfer(e) => e.is_retryable(),
            BackupError::Manifest(e) => e.is_retryable(),
            BackupError::Catalogue(e) => e.is_retryable(),
            BackupError::Bus(e) => e.is_retryable(),
            BackupError::Service(e) => e.is_retryable(),
        }
    }
}
