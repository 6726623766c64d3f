//! Reading uploads on a source tier, and putting quarantine reports beside them.
//!
//! [`SourceFiles`] is the one seam between the checks and storage: observe one file within a
//! [`ReadLimit`], and put a spooled report on the tier. The real implementation is the
//! mover's [`Tier`] (posix confined with `openat2`, or S3); tests may use a fake.
//!
//! Reads are bounded before any byte is read: a confined `stat` (an `O_PATH` open, which
//! never blocks, even on a FIFO) or an S3 HEAD tells a missing path, something that is not a
//! regular file, and a size other than the declared one or over the policy's maximum, and
//! only a regular file of exactly the declared size is then opened and hashed. A joined
//! prefix and path longer than the tier takes (PATH_MAX on posix, 1024 bytes for an S3 key)
//! is that file's problem, found before any request is made.

use std::future::Future;

use stagehand_mover::{CopyOptions, ErrorKind, Mover, Priority, Side, Tier, TransferError};

use crate::check::Observed;
use crate::report::SpooledReport;

/// Linux `PATH_MAX`, counting the terminating NUL: a path handed to a system call holds at
/// most one byte less.
pub const PATH_MAX: usize = 4096;

/// The longest S3 object key, in bytes.
pub const MAX_S3_KEY_BYTES: usize = 1024;

/// Bounds on reading one manifest entry: the size its manifest declares and the policy's
/// largest file. A file of another size, or a larger one, is judged from its metadata and
/// never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimit {
    /// The size the manifest declares.
    pub declared_size: u64,
    /// The policy's `max_file_size`.
    pub max_size: u64,
}

impl ReadLimit {
    /// What a size found before reading says: `None` when the file is to be read.
    pub fn judge_size(&self, found: u64) -> Option<Observed> {
        if found > self.max_size {
            return Some(Observed::TooLarge(format!(
                "the file holds {found} bytes, over the limit of {} (validation.max_file_size); not read",
                self.max_size
            )));
        }
        (found != self.declared_size).then(|| {
            Observed::SizeDiffers(format!(
                "declared {} bytes, found {found}; not read",
                self.declared_size
            ))
        })
    }
}

/// A source tier as the validator uses it.
pub trait SourceFiles: Send + Sync {
    /// Observes the file at the tier-relative path `rel` within `limit`: its metadata first,
    /// then, for a regular file of the declared size, every byte hashed. Data problems
    /// (absent, not a file, wrong size, a symlink, no permission) are an [`Observed`] value;
    /// `Err` is left for failures a retry can fix (tier unreachable, I/O error).
    fn observe(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> impl Future<Output = Result<Observed, TransferError>> + Send;

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

/// Why `rel` cannot name a file on `tier` at all: longer than its system calls or keys take.
fn too_long_for(tier: &Tier, rel: &str) -> Option<Observed> {
    match tier {
        Tier::Posix(_) if rel.len() >= PATH_MAX => Some(Observed::PathTooLong(format!(
            "the source prefix and this path together are {} bytes, over the {} a path on a posix tier may hold (PATH_MAX)",
            rel.len(),
            PATH_MAX - 1
        ))),
        Tier::Posix(_) => None,
        Tier::S3(s3) => {
            let key = s3.key_for(rel, Side::Source).ok()?;
            (key.len() > MAX_S3_KEY_BYTES).then(|| {
                Observed::PathTooLong(format!(
                    "the object key for this path is {} bytes, over the {MAX_S3_KEY_BYTES} an S3 key may hold",
                    key.len()
                ))
            })
        }
    }
}

fn task_failed(tier: &str, rel: &str, e: tokio::task::JoinError) -> TransferError {
    TransferError::new(
        ErrorKind::Io,
        Side::Source,
        tier,
        rel,
        format!("reading task failed: {e}"),
    )
}

/// The posix read: a confined stat, the size judged, then the open and the hash. Blocking.
fn observe_posix(
    posix: &stagehand_mover::PosixTier,
    rel: &str,
    limit: ReadLimit,
) -> Result<Observed, TransferError> {
    let stat = |rel: &str| match posix.stat(rel) {
        Ok(None) => Ok(Err(Observed::Missing)),
        Ok(Some(size)) => Ok(Ok(size)),
        // The tier's name for "something other than a regular file is at this path".
        Err(e) if e.kind == ErrorKind::DestinationConflict => Ok(Err(Observed::NotAFile)),
        Err(e) => classify(e).map(Err),
    };
    let size = match stat(rel)? {
        Ok(size) => size,
        Err(observed) => return Ok(observed),
    };
    if let Some(observed) = limit.judge_size(size) {
        return Ok(observed);
    }
    match posix.hash_file(rel) {
        Ok(digest) => Ok(Observed::Digest(digest)),
        // The open reports "not a regular file" as NotFound too: what is there now?
        Err(err) if err.kind == ErrorKind::NotFound => match stat(rel)? {
            Err(observed) => Ok(observed),
            // A regular file again: it was replaced while we looked.
            Ok(_) => Err(TransferError::new(
                ErrorKind::SourceChanged,
                Side::Source,
                posix.name(),
                rel,
                "the file was replaced while it was being read",
            )),
        },
        Err(err) => classify(err),
    }
}

impl SourceFiles for Tier {
    async fn observe(&self, rel: &str, limit: ReadLimit) -> Result<Observed, TransferError> {
        if let Some(observed) = too_long_for(self, rel) {
            return Ok(observed);
        }
        match self {
            Tier::Posix(posix) => {
                let posix = posix.clone();
                let rel_owned = rel.to_owned();
                tokio::task::spawn_blocking(move || observe_posix(&posix, &rel_owned, limit))
                    .await
                    .map_err(|e| task_failed(self.name(), rel, e))?
            }
            Tier::S3(s3) => {
                let size = match s3.stat(rel).await {
                    Ok(None) => return Ok(Observed::Missing),
                    Ok(Some(info)) => info.size,
                    Err(e) => return classify(e),
                };
                if let Some(observed) = limit.judge_size(size) {
                    return Ok(observed);
                }
                match s3.hash_file(rel).await {
                    Ok(digest) => Ok(Observed::Digest(digest)),
                    Err(e) => classify(e),
                }
            }
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

    #[test]
    fn sizes_are_judged_before_reading() {
        let limit = ReadLimit {
            declared_size: 10,
            max_size: 100,
        };
        assert_eq!(limit.judge_size(10), None);
        assert!(
            matches!(limit.judge_size(9), Some(Observed::SizeDiffers(d)) if d.contains("declared 10 bytes, found 9"))
        );
        // A sparse terabyte declared as ten bytes is judged from its size alone.
        assert!(matches!(
            limit.judge_size(1 << 40),
            Some(Observed::TooLarge(_))
        ));
    }

    #[test]
    fn paths_too_long_for_a_posix_tier_are_the_files_problem() {
        let dir = tempfile::tempdir().unwrap();
        let tier = Tier::Posix(stagehand_mover::PosixTier::open("t", dir.path()).unwrap());
        let long = format!("{}/{}", "p".repeat(200), "a/".repeat(2000) + "f");
        assert!(long.len() >= PATH_MAX);
        assert!(matches!(
            too_long_for(&tier, &long),
            Some(Observed::PathTooLong(_))
        ));
        assert_eq!(too_long_for(&tier, "a/b"), None);
    }
}
