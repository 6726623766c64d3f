//! Why the backup copier could not start, back up, drill or restore.

use std::path::PathBuf;

use stagehand_bus::BusError;
use stagehand_bus::runner;
use stagehand_catalogue::CatalogueError;
use stagehand_manifest::ManifestError;
use stagehand_mover::TransferError;
use stagehand_policy::PolicyError;
use stagehand_schemas::Retryable;

/// Everything that can go wrong, each able to say whether trying again can help.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The policy folder has no `backup.toml`: nothing says what to protect.
    #[error(
        "{} has no backup.toml: the backup copier needs a backup policy (see policies/backup.toml)",
        dir.display()
    )]
    NoBackupPolicy { dir: PathBuf },
    /// A tier could not be opened or used at start-up.
    #[error("tier {tier:?} ({location}): {source}")]
    Tier {
        tier: String,
        location: String,
        #[source]
        source: Box<TransferError>,
    },
    /// The S3 backup bucket cannot hold objects the way `[object_lock]` asks.
    #[error("backup tier {tier:?}: {detail}")]
    ObjectLock { tier: String, detail: String },
    #[error("cannot create {}: {source}", path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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
    /// The runner could not start or keep the service.
    #[error(transparent)]
    Run(Box<runner::RunError>),
}

impl BackupError {
    /// The copier's own error back out of the runner, or the runner's.
    pub(crate) fn from_run(e: runner::RunError) -> Self {
        e.into_service_error(BackupError::Run)
    }
}

impl Retryable for BackupError {
    /// Whether doing the same again later can succeed (a tier, NATS or the catalogue was
    /// briefly unavailable), as opposed to a configuration or data problem.
    fn is_retryable(&self) -> bool {
        match self {
            BackupError::Policy(_)
            | BackupError::NoBackupPolicy { .. }
            | BackupError::ObjectLock { .. }
            | BackupError::StateDir { .. }
            | BackupError::Refused(_)
            | BackupError::NotFound(_) => false,
            BackupError::Tier { source, .. } => source.is_retryable(),
            BackupError::Transfer(e) => e.is_retryable(),
            BackupError::Manifest(e) => e.is_retryable(),
            BackupError::Catalogue(e) => e.is_retryable(),
            BackupError::Bus(e) => e.is_retryable(),
            BackupError::Run(e) => e.exit_code() != runner::EXIT_CONFIG,
        }
    }
}
