//! Reading uploads on a source tier, and putting quarantine reports beside them.
//!
//! [`SourceFiles`] is the one seam between the checks and storage: observe one file within a
//! [`ReadLimit`], and put a spooled report on the tier. The real implementation is the
//! mover's [`Tier`] (posix confined with `openat2`, or S3); tests may use a fake.
//!
//! Reads are bounded by the mover ([`Tier::hash_file_pieces`]) before any byte is read: a
//! FIFO, socket, device or directory is found without blocking (`O_NONBLOCK` open, `fstat`),
//! a size other than the declared one or over the policy's maximum from `fstat` or the GET's
//! `Content-Length`, and no more than the declared size + 1 byte is ever read. Every such
//! answer, and an object store's 4xx about one object, is that file's problem, never a retry
//! of the whole request. A joined prefix and path longer than the tier takes (PATH_MAX on
//! posix, 1024 bytes for an S3 key) is found before any request and reported as `path_rule`.

use std::future::Future;

use stagehand_mover::{
    CopyOptions, ErrorKind, Mover, Priority, ReadLimit, Side, Tier, TransferError,
};

use crate::check::Observed;
use crate::report::SpooledReport;
use stagehand_schemas::Retryable;
use stagehand_schemas::pieces::PieceHashes;

/// A source tier as the validator uses it.
pub trait SourceFiles: Send + Sync {
    /// Observes the file at the tier-relative path `rel` within `limit` (the declared size
    /// and the policy's `max_file_size`): its metadata first, then, for a regular file of the
    /// declared size, every byte hashed. Data problems (absent, not a file, wrong size, a
    /// symlink, no permission, an object the store refuses) are an [`Observed`] value; `Err`
    /// is left for failures a retry can fix (tier unreachable, I/O error).
    ///
    /// A file read whole that is declared larger than a piece also yields its piece hashes,
    /// from the same read (`crate::pieces`).
    fn observe(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> impl Future<Output = Result<Observation, TransferError>> + Send;

    /// Puts the spooled quarantine report on the tier at [`SpooledReport::rel`], atomically
    /// (never partly visible), with `mover`. A report already there counts as put: a
    /// redelivered request reports to the same place, and the first report stands.
    fn put_report(
        &self,
        mover: &Mover,
        report: &SpooledReport,
    ) -> impl Future<Output = Result<(), TransferError>> + Send;

    /// A display form of where `rel` is, for the rejection's `quarantine` field.
    fn describe(&self, rel: &str) -> String;
}

/// What observing one file gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub observed: Observed,
    /// The piece hashes of a file read whole and larger than a piece: its side data.
    pub pieces: Option<PieceHashes>,
}

impl From<Observed> for Observation {
    /// An observation without side data.
    fn from(observed: Observed) -> Self {
        Observation {
            observed,
            pieces: None,
        }
    }
}

/// Turns a read error into an observation, or keeps it as an error when a retry can help.
pub fn classify(err: TransferError) -> Result<Observed, TransferError> {
    match err.kind {
        ErrorKind::NotFound => Ok(Observed::Missing),
        ErrorKind::NotAFile => Ok(Observed::NotAFile(err.detail)),
        ErrorKind::SizeMismatch => Ok(Observed::SizeDiffers(err.detail)),
        ErrorKind::TooLarge => Ok(Observed::TooLarge(err.detail)),
        ErrorKind::PathRefused => Ok(Observed::Escapes(err.detail)),
        ErrorKind::PermissionDenied => Ok(Observed::Unreadable(err.detail)),
        _ if err.is_retryable() => Err(err),
        // Anything else permanent about one file (an object the store refuses) is still about
        // the data, not the service.
        _ => Ok(Observed::Unreadable(err.to_string())),
    }
}

/// Whether `rel` is too long to name a file on `tier` at all. `rel` is a prefix and a path
/// that each passed the path rules, so what the tier's own lexical check still refuses is the
/// length of the two together (PATH_MAX, an S3 key's 1024 bytes): reported as a path rule,
/// where the same refusal from a confined open would mean a symlink.
fn too_long_for(tier: &Tier, rel: &str) -> Option<Observed> {
    // The tier's own refusal may quote the whole path; the problem names it already.
    let (refused, limit) = match tier {
        Tier::Posix(posix) => (
            posix.check_path(rel, Side::Source).err(),
            "a path on a posix tier must be shorter than PATH_MAX".to_owned(),
        ),
        Tier::S3(s3) => (
            s3.key_for(rel, Side::Source).err(),
            format!(
                "an S3 object key (the tier's prefix, the source prefix and the path) is at most {} bytes",
                stagehand_mover::s3::MAX_KEY_LEN
            ),
        ),
    };
    refused.filter(|e| e.kind == ErrorKind::PathRefused).map(|_| {
        Observed::PathTooLong(format!(
            "the source prefix and this path together are {} bytes, too long for the tier: {limit}",
            rel.len()
        ))
    })
}

impl SourceFiles for Tier {
    async fn observe(&self, rel: &str, limit: ReadLimit) -> Result<Observation, TransferError> {
        if let Some(observed) = too_long_for(self, rel) {
            return Ok(observed.into());
        }
        match self.hash_file_pieces(rel, limit).await {
            Ok(read) => Ok(Observation {
                observed: Observed::Digest(read.digest),
                pieces: read.pieces,
            }),
            Err(e) => classify(e).map(Observation::from),
        }
    }

    async fn put_report(&self, mover: &Mover, report: &SpooledReport) -> Result<(), TransferError> {
        let options = CopyOptions {
            priority: Priority::Ingest,
            ..CopyOptions::default()
        };
        match mover
            .copy(report.tier(), self, report.file(), &options)
            .await
        {
            Ok(_) => Ok(()),
            // A redelivered request reports to the same place; the first report stands.
            Err(e) if e.kind == ErrorKind::DestinationConflict => Ok(()),
            Err(e) => Err(e),
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
        for (kind, observed) in [
            (ErrorKind::NotFound, Observed::Missing),
            (ErrorKind::NotAFile, Observed::NotAFile("detail".into())),
            (
                ErrorKind::SizeMismatch,
                Observed::SizeDiffers("detail".into()),
            ),
            (ErrorKind::TooLarge, Observed::TooLarge("detail".into())),
            (ErrorKind::PathRefused, Observed::Escapes("detail".into())),
            (
                ErrorKind::PermissionDenied,
                Observed::Unreadable("detail".into()),
            ),
        ] {
            assert_eq!(classify(err(kind)).unwrap(), observed, "{kind:?}");
        }
        // An S3 4xx about one object is that file's problem.
        assert!(matches!(
            classify(err(ErrorKind::ObjectRefused)),
            Ok(Observed::Unreadable(d)) if d.contains("ObjectRefused")
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

    #[test]
    fn paths_too_long_for_a_posix_tier_are_a_path_rule_not_an_escape() {
        let dir = tempfile::tempdir().unwrap();
        let tier = Tier::Posix(stagehand_mover::PosixTier::open("t", dir.path()).unwrap());
        // The path within the path rules (4081 bytes); with the prefix over PATH_MAX.
        let long = format!("{}/f", vec!["d".repeat(254); 16].join("/"));
        assert!(stagehand_schemas::check_relative_path(&long).is_ok());
        let joined = format!("lab-a/up/hostile/{long}");
        assert!(joined.len() >= 4096);
        assert!(matches!(
            too_long_for(&tier, &joined),
            Some(Observed::PathTooLong(_))
        ));
        assert_eq!(too_long_for(&tier, "a/b"), None);
    }
}
