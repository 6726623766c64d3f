//! The vocabulary of a transfer shared by every engine and backend: what to copy and how
//! carefully, how it ended, and the live counters a progress bar reads.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use stagehand_schemas::manifest::FileRef;

/// SHA-256 of the empty input, as lowercase hex.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// What a file or object holds, measured by reading every byte of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDigest {
    pub size: u64,
    /// Lowercase hex SHA-256.
    pub sha256: String,
}

/// Transfer priority classes, most urgent first.
///
/// A class's weight is its share of free transfer slots when several classes wait:
/// a checkpoint copy gets eight grants for every one a backup gets, so a bulk backup
/// can never starve an urgent checkpoint, and a backup still makes progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Priority {
    Checkpoint,
    Stage,
    #[default]
    Ingest,
    Backup,
}

impl Priority {
    /// All classes, most urgent first.
    pub const ALL: [Priority; 4] = [
        Priority::Checkpoint,
        Priority::Stage,
        Priority::Ingest,
        Priority::Backup,
    ];

    /// The class's share of grants when every class is waiting.
    pub fn weight(self) -> u32 {
        match self {
            Priority::Checkpoint => 8,
            Priority::Stage => 4,
            Priority::Ingest => 2,
            Priority::Backup => 1,
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Priority::Checkpoint => "checkpoint",
            Priority::Stage => "stage",
            Priority::Ingest => "ingest",
            Priority::Backup => "backup",
        })
    }
}

/// What proves that the bytes which landed on the destination are the bytes that were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VerifyDestination {
    /// Every block is hashed from the very buffer that is then written, and every write is
    /// checked for its full length; the data is `fdatasync`ed before it becomes visible.
    /// This proves what was handed to the destination filesystem, not what its media holds
    /// (the filesystem's own integrity is trusted). One read of the source, no read-back.
    #[default]
    InFlight,
    /// As `InFlight`, and then the temporary file is read back and hashed again before it is
    /// renamed into place. Costs a second full read (from the page cache when warm) and is
    /// the choice when the destination filesystem is not trusted.
    ReadBack,
}

/// How one transfer should be done.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CopyOptions {
    pub priority: Priority,
    /// Trust the SHA-256 recorded in the [`FileRef`] instead of re-reading bytes where that
    /// saves work: an existing destination of the right size is skipped without hashing it,
    /// and a posix → posix copy may use `FICLONE` / `copy_file_range` without hashing the source
    /// (the recorded hash was proven when the file was first ingested).
    pub trust_recorded_hash: bool,
    pub verify_destination: VerifyDestination,
    /// When the caller has no recorded hash (a plain `stagehand cp` without a manifest), the
    /// `sha256` of the [`FileRef`] is ignored: the copy hashes the source in flight and the
    /// destination is proven against that.
    pub expected_hash_unknown: bool,
}

/// Why a transfer did nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// The destination holds the same size and hash, verified by reading it.
    AlreadyPresentVerified,
    /// The destination holds the same size; its hash was trusted from the record.
    AlreadyPresentTrusted,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipReason::AlreadyPresentVerified => "already present (verified)",
            SkipReason::AlreadyPresentTrusted => {
                "already present (size matches, recorded hash trusted)"
            }
        })
    }
}

/// How one transfer ended when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyOutcome {
    /// Bytes were moved and proven. `engine` names what moved them (`io_uring`, `pread`,
    /// `copy_file_range`, `s3-multipart`, ...). `sha256` is the hash that was proven.
    Copied {
        bytes: u64,
        sha256: String,
        engine: &'static str,
    },
    Skipped {
        reason: SkipReason,
        sha256: String,
    },
}

impl CopyOutcome {
    /// The bytes moved (zero when skipped).
    pub fn bytes(&self) -> u64 {
        match self {
            CopyOutcome::Copied { bytes, .. } => *bytes,
            CopyOutcome::Skipped { .. } => 0,
        }
    }
}

/// Live counters of a batch of transfers; clones share the same counters.
///
/// Backends add bytes as blocks land (so a progress bar moves during one large file) and
/// count a file once it is done, whether copied, skipped or failed.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    inner: Arc<ProgressInner>,
}

#[derive(Debug, Default)]
struct ProgressInner {
    bytes_done: AtomicU64,
    files_done: AtomicU64,
    files_skipped: AtomicU64,
    files_failed: AtomicU64,
    bytes_total: AtomicU64,
    files_total: AtomicU64,
}

impl Progress {
    pub fn new() -> Self {
        Self::default()
    }

    /// Announces more work (a progress bar's length).
    pub fn add_total(&self, files: u64, bytes: u64) {
        self.inner.files_total.fetch_add(files, Ordering::Relaxed);
        self.inner.bytes_total.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn add_bytes(&self, bytes: u64) {
        self.inner.bytes_done.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn file_done(&self) {
        self.inner.files_done.fetch_add(1, Ordering::Relaxed);
    }

    pub fn file_skipped(&self) {
        self.inner.files_skipped.fetch_add(1, Ordering::Relaxed);
        self.file_done();
    }

    pub fn file_failed(&self) {
        self.inner.files_failed.fetch_add(1, Ordering::Relaxed);
        self.file_done();
    }

    pub fn bytes_done(&self) -> u64 {
        self.inner.bytes_done.load(Ordering::Relaxed)
    }

    pub fn files_done(&self) -> u64 {
        self.inner.files_done.load(Ordering::Relaxed)
    }

    pub fn files_skipped(&self) -> u64 {
        self.inner.files_skipped.load(Ordering::Relaxed)
    }

    pub fn files_failed(&self) -> u64 {
        self.inner.files_failed.load(Ordering::Relaxed)
    }

    pub fn bytes_total(&self) -> u64 {
        self.inner.bytes_total.load(Ordering::Relaxed)
    }

    pub fn files_total(&self) -> u64 {
        self.inner.files_total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_clones_share_counters() {
        let a = Progress::new();
        let b = a.clone();
        a.add_bytes(10);
        b.file_done();
        b.file_skipped();
        assert_eq!(a.bytes_done(), 10);
        assert_eq!(a.files_done(), 2);
        assert_eq!(a.files_skipped(), 1);
    }

    #[test]
    fn weights_order_the_classes() {
        let w: Vec<u32> = Priority::ALL.iter().map(|p| p.weight()).collect();
        assert!(w.windows(2).all(|p| p[0] > p[1]), "{w:?}");
    }

    #[test]
    fn empty_sha_constant_is_right() {
        assert_eq!(stagehand_schemas::manifest::sha256_hex(b""), EMPTY_SHA256);
    }
}
