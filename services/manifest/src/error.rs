//! Why a manifest could not be built, stored, fetched or read.

use stagehand_schemas::Retryable;
use std::path::Path;

/// What kind of failure, so callers branch on it: a missing or unreachable manifest is worth
/// retrying, a manifest whose bytes are not what its reference says never will be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ManifestErrorKind {
    /// No object of that digest in the bucket (or no such bucket). Retryable: an uploader may
    /// still be putting it; after the retries run out the request is dead-lettered.
    NotFound,
    /// The object's bytes do not hash to the digest, or its entry count or byte total differ
    /// from the reference. Permanent.
    Mismatch,
    /// The bytes are not canonical manifest lines (a line that does not parse, entries out of
    /// order, a missing final newline). Permanent.
    Malformed,
    /// An event carries both an inline manifest and a reference, or an entry cannot be
    /// written as a manifest line (a path holding a tab or a newline). Permanent.
    Invalid,
    /// NATS or JetStream failed (a timeout, a lost connection). Retryable.
    Nats,
    /// Reading or writing the local spool failed (disk full, I/O error). Retryable.
    Io,
}

impl Retryable for ManifestErrorKind {
    fn is_retryable(&self) -> bool {
        matches!(
            self,
            ManifestErrorKind::NotFound | ManifestErrorKind::Nats | ManifestErrorKind::Io
        )
    }
}

/// A manifest failure: its kind, what it concerns, and the cause.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {detail}")]
pub struct ManifestError {
    pub kind: ManifestErrorKind,
    /// The manifest concerned: `bucket/digest`, or a spool path.
    pub what: String,
    pub detail: String,
    /// For [`ManifestErrorKind::Malformed`]: the 1-based line.
    pub line: Option<u64>,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl ManifestError {
    pub fn new(
        kind: ManifestErrorKind,
        what: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        ManifestError {
            kind,
            what: what.into(),
            detail: detail.into(),
            line: None,
            source: None,
        }
    }

    pub(crate) fn malformed(what: &str, line: u64, detail: impl Into<String>) -> Self {
        ManifestError {
            line: Some(line),
            ..ManifestError::new(ManifestErrorKind::Malformed, what, detail)
        }
        .at_line()
    }

    /// More than the reference declares, found at `line`: the object is not the manifest the
    /// request promised, and reading on would only spool what will be refused.
    pub(crate) fn exceeds(what: &str, line: u64, detail: impl Into<String>) -> Self {
        ManifestError {
            line: Some(line),
            ..ManifestError::new(ManifestErrorKind::Mismatch, what, detail)
        }
        .at_line()
    }

    fn at_line(mut self) -> Self {
        if let Some(line) = self.line {
            self.detail = format!("line {line}: {}", self.detail);
        }
        self
    }

    pub(crate) fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    pub(crate) fn io(path: &Path, e: std::io::Error) -> Self {
        ManifestError::new(
            ManifestErrorKind::Io,
            path.display().to_string(),
            e.to_string(),
        )
        .with_source(e)
    }

    pub(crate) fn spool(dir: &Path, e: std::io::Error) -> Self {
        ManifestError::new(
            ManifestErrorKind::Io,
            format!("manifest spool in {}", dir.display()),
            e.to_string(),
        )
        .with_source(e)
    }
}

impl Retryable for ManifestError {
    fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}
