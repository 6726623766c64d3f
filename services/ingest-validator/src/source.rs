//! Reading uploads on a source tier, and marking rejected ones.
//!
//! [`SourceFiles`] is the one seam between the checks and storage: hash a file, and write a
//! small marker. The real implementation is the mover's [`Tier`] (posix confined with
//! `openat2`, or S3); tests may use a fake.

use std::future::Future;

use stagehand_mover::{ErrorKind, Side, Tier, TransferError};

use crate::check::Observed;

/// A source tier as the validator uses it.
pub trait SourceFiles: Send + Sync {
    /// Reads and hashes the file at the tier-relative path `rel`. Data problems (absent, not a
    /// file, a symlink, no permission) are an [`Observed`] value; `Err` is left for failures a
    /// retry can fix (tier unreachable, I/O error).
    fn observe(&self, rel: &str) -> impl Future<Output = Result<Observed, TransferError>> + Send;

    /// Writes `bytes` at the tier-relative path `rel`, atomically (never partly visible). A
    /// marker already at `rel` counts as written: a redelivered request marks the same place.
    fn write_marker(
        &self,
        rel: &str,
        bytes: Vec<u8>,
    ) -> impl Future<Output = Result<(), TransferError>> + Send;

    /// A display form of where `rel` is, for the rejection's `quarantine` field.
    fn describe(&self, rel: &str) -> String;
}

/// Turns a read error into an observation, or keeps it as an error when a retry can help.
pub fn classify(err: TransferError) -> Result<Observed, TransferError> {
    match err.kind {
        ErrorKind::NotFound => Ok(Observed::Missing),
        ErrorKind::NotAFile => Ok(Observed::NotAFile),
        ErrorKind::PathRefused => Ok(Observed::Escapes(err.detail)),
        ErrorKind::PermissionDenied => Ok(Observed::Unreadable(err.detail)),
        _ if err.is_retryable() => Err(err),
        // Anything else permanent about one file is still about the data, not the service.
        _ => Ok(Observed::Unreadable(err.to_string())),
    }
}

impl SourceFiles for Tier {
    async fn observe(&self, rel: &str) -> Result<Observed, TransferError> {
        match self.hash_file(rel).await {
            Ok(digest) => Ok(Observed::Digest(digest)),
            Err(err) if err.kind == ErrorKind::NotFound => match self {
                // A posix open reports "not a regular file" as NotFound too; a confined stat
                // tells an absent path from a directory or special file.
                Tier::Posix(posix) => {
                    let posix = posix.clone();
                    let rel = rel.to_owned();
                    let stat = tokio::task::spawn_blocking(move || posix.stat(&rel))
                        .await
                        .map_err(|e| {
                            TransferError::new(
                                ErrorKind::Io,
                                Side::Source,
                                self.name(),
                                "",
                                format!("stat task failed: {e}"),
                            )
                        })?;
                    match stat {
                        Ok(None) => Ok(Observed::Missing),
                        // It exists as a regular file now: it appeared while we looked.
                        Ok(Some(_)) => Err(TransferError::new(
                            ErrorKind::SourceChanged,
                            Side::Source,
                            self.name(),
                            err.path,
                            "the file appeared while it was being read",
                        )),
                        Err(e) if e.kind == ErrorKind::DestinationConflict => {
                            Ok(Observed::NotAFile)
                        }
                        Err(e) => classify(e),
                    }
                }
                Tier::S3(_) => Ok(Observed::Missing),
            },
            Err(err) => classify(err),
        }
    }

    async fn write_marker(&self, rel: &str, bytes: Vec<u8>) -> Result<(), TransferError> {
        match self.write_small(rel, bytes).await {
            // A redelivered request marks the same place; the first marker stands.
            Err(e) if e.kind == ErrorKind::DestinationConflict => Ok(()),
            other => other,
        }
    }

    fn describe(&self, rel: &str) -> String {
        match self {
            Tier::Posix(posix) => format!(
                "{}:{rel} ({})",
                self.name(),
                posix.root().join(rel).display()
            ),
            Tier::S3(s3) => {
                let key = s3
                    .key_for(rel, Side::Destination)
                    .unwrap_or_else(|_| rel.to_owned());
                format!("{}:{rel} (s3://{}/{key})", self.name(), s3.bucket())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(kind: ErrorKind) -> TransferError {
        TransferError::new(kind, Side::Source, "source", "a", "detail")
    }

    #[test]
    fn data_errors_become_observations_and_transient_ones_stay_errors() {
        assert_eq!(
            classify(err(ErrorKind::NotFound)).unwrap(),
            Observed::Missing
        );
        assert!(matches!(
            classify(err(ErrorKind::PathRefused)),
            Ok(Observed::Escapes(_))
        ));
        assert!(matches!(
            classify(err(ErrorKind::PermissionDenied)),
            Ok(Observed::Unreadable(_))
        ));
        for transient in [
            ErrorKind::Unreachable,
            ErrorKind::Throttled,
            ErrorKind::Io,
            ErrorKind::ObjectStore,
        ] {
            assert!(classify(err(transient)).is_err(), "{transient:?}");
        }
    }
}
