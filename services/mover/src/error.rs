//! What can go wrong moving a file, said with what, where, and whether a retry can help.

use std::fmt;

/// Which side of a transfer an error happened on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// The kind of a transfer failure. Callers branch on this, never on message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The path is not a confined relative path (`..`, absolute, NUL, symlink escape).
    PathRefused,
    /// The source file or object does not exist.
    NotFound,
    /// The bytes read do not hash to the expected SHA-256.
    ChecksumMismatch,
    /// The size differs from the expected size.
    SizeMismatch,
    /// The source changed while it was being copied.
    SourceChanged,
    /// The destination filesystem or bucket is full (ENOSPC, EDQUOT).
    NoSpace,
    /// Permission denied (EACCES, EPERM, S3 403).
    PermissionDenied,
    /// The endpoint could not be reached (connect refused, DNS, timeout).
    Unreachable,
    /// The endpoint asked us to slow down (S3 503 SlowDown, 429).
    Throttled,
    /// The destination already holds different bytes under that name.
    DestinationConflict,
    /// The transfer was cancelled by its caller.
    Cancelled,
    /// Any other I/O error.
    Io,
    /// Any other object-store error.
    ObjectStore,
    /// The tier configuration is invalid.
    Config,
}

impl ErrorKind {
    /// Whether trying the same transfer again later can succeed without anyone changing anything.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::Unreachable
                | ErrorKind::Throttled
                | ErrorKind::SourceChanged
                | ErrorKind::Io
                | ErrorKind::ObjectStore
                | ErrorKind::NoSpace
        )
    }
}

/// A failed transfer step: what went wrong, on which tier and path, and why.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?} on {side} tier {tier:?} at {path:?}: {detail}")]
pub struct TransferError {
    pub kind: ErrorKind,
    pub side: Side,
    /// The tier's name (or a display form of its root when it has no name).
    pub tier: String,
    /// The relative path or key concerned.
    pub path: String,
    pub detail: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl TransferError {
    pub fn new(
        kind: ErrorKind,
        side: Side,
        tier: impl Into<String>,
        path: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            side,
            tier: tier.into(),
            path: path.into(),
            detail: detail.into(),
            source: None,
        }
    }

    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}
