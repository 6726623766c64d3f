//! The vocabulary of a transfer shared by every engine and backend: what to copy and how
//! carefully, how it ended, and the live counters a progress bar reads.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use stagehand_schemas::manifest::FileRef;
use stagehand_schemas::pieces::{PieceHasher, PieceHashes};

/// SHA-256 of the empty input, as lowercase hex.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// What a file or object holds, measured by reading every byte of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDigest {
    pub size: u64,
    /// Lowercase hex SHA-256.
    pub sha256: String,
}

/// A file's digest and, for a file larger than a piece, the BLAKE3 hash of each of its pieces,
/// from the same read ([`crate::Tier::hash_file_pieces`]): the side data a service that hashed
/// the bytes itself records for readers that verify a file piece by piece
/// (`stagehand_schemas::pieces`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PiecedDigest {
    pub digest: FileDigest,
    /// `None` for a file of a piece or less, which has no side data.
    pub pieces: Option<PieceHashes>,
}

impl PiecedDigest {
    pub(crate) fn new(digest: FileDigest, pieces: PieceHashes) -> PiecedDigest {
        PiecedDigest {
            digest,
            pieces: (!pieces.pieces.is_empty()).then_some(pieces),
        }
    }
}

/// Bounds on reading one file whose size a manifest declares (see
/// [`crate::Tier::hash_file_bounded`]): the size is checked from `fstat` (posix) or the
/// response's `Content-Length` (S3) before any byte is read, and no more than
/// `declared_size + 1` bytes are ever read, so a sparse 1 TiB file declared as 1 byte costs
/// one `fstat`, not a terabyte of hashing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadLimit {
    /// The size the manifest declares; a file of another size is
    /// [`crate::ErrorKind::SizeMismatch`] before any byte is read. `None` reads to the end
    /// (still bounded by `max_size`).
    pub declared_size: Option<u64>,
    /// The largest file the caller accepts (a policy's `max_file_size`); a larger one is
    /// [`crate::ErrorKind::TooLarge`] before any byte is read. `None` for no maximum.
    pub max_size: Option<u64>,
}

impl ReadLimit {
    /// A file must be exactly `declared_size` bytes, and at most `max_size` when given.
    pub fn declared(declared_size: u64, max_size: Option<u64>) -> ReadLimit {
        ReadLimit {
            declared_size: Some(declared_size),
            max_size,
        }
    }

    /// Checks a size found before reading; the error says which bound it broke.
    pub(crate) fn check_size(&self, size: u64) -> Result<(), (crate::ErrorKind, String)> {
        if let Some(max) = self.max_size
            && size > max
        {
            return Err((
                crate::ErrorKind::TooLarge,
                format!("the file holds {size} bytes, more than the maximum of {max}; not read"),
            ));
        }
        if let Some(declared) = self.declared_size
            && size != declared
        {
            return Err((
                crate::ErrorKind::SizeMismatch,
                format!("the file holds {size} bytes, the manifest says {declared}; not read"),
            ));
        }
        Ok(())
    }

    /// The most bytes a read may take: one past the declared size (to notice growth), else
    /// one past the maximum, else unbounded.
    pub(crate) fn read_cap(&self) -> u64 {
        match (self.declared_size, self.max_size) {
            (Some(d), _) => d.saturating_add(1),
            (None, Some(m)) => m.saturating_add(1),
            (None, None) => u64::MAX,
        }
    }

    /// The hasher of a read that also wants piece hashes: a file declared a piece or smaller
    /// has none, so it is hashed whole only and pays no second hash.
    pub(crate) fn piece_hasher(&self) -> PieceHasher {
        PieceHasher::for_size(self.declared_size)
    }

    /// Checks what a bounded read found (the file may have grown or shrunk since its size was
    /// checked).
    pub(crate) fn check_read(&self, read: u64) -> Result<(), (crate::ErrorKind, String)> {
        if let Some(declared) = self.declared_size
            && read != declared
        {
            return Err((
                crate::ErrorKind::SizeMismatch,
                if read > declared {
                    format!(
                        "the file grew past the {declared} bytes the manifest says while it was read; reading stopped there"
                    )
                } else {
                    format!(
                        "the file shrank to {read} bytes while it was read, the manifest says {declared}"
                    )
                },
            ));
        }
        if let Some(max) = self.max_size
            && read > max
        {
            return Err((
                crate::ErrorKind::TooLarge,
                format!(
                    "the file grew past the maximum of {max} bytes while it was read; reading stopped there"
                ),
            ));
        }
        Ok(())
    }
}

/// Transfer priority classes, most urgent first: the one definition Stagehand has (the
/// policy files name them in lowercase, `priorities.toml`'s `[classes.<name>]`; the CLI's
/// `--priority` takes the same words).
///
/// A class's weight is its share of free transfer slots when several classes wait:
/// a checkpoint copy gets eight grants for every one a backup gets, so a bulk backup
/// can never starve an urgent checkpoint, and a backup still makes progress.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
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

    /// The class's name as policies and the command line spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Checkpoint => "checkpoint",
            Priority::Stage => "stage",
            Priority::Ingest => "ingest",
            Priority::Backup => "backup",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Priority {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Priority::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                format!("{s:?} is not a priority class (checkpoint, stage, ingest, backup)")
            })
    }
}

/// What proves that the bytes which landed on the destination are the bytes that were read:
/// the one definition of the verification mode (`promotion.toml`'s `verify`, the CLI's
/// `--verify`), spelled `hashed-in-flight` / `read-back`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VerifyMode {
    /// Every block is hashed from the very buffer that is then written, and every write is
    /// checked for its full length; the data is `fdatasync`ed before it becomes visible.
    /// This proves what was handed to the destination filesystem, not what its media holds
    /// (the filesystem's own integrity is trusted). One read of the source, no read-back.
    #[default]
    HashedInFlight,
    /// As `HashedInFlight`, and then the temporary file is read back and hashed again before
    /// it is renamed into place. Costs a second full read (from the page cache when warm) and
    /// is the choice when the destination filesystem is not trusted.
    ReadBack,
}

impl VerifyMode {
    /// Both modes, the default first.
    pub const ALL: [VerifyMode; 2] = [VerifyMode::HashedInFlight, VerifyMode::ReadBack];

    /// The mode's name as policies and the command line spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            VerifyMode::HashedInFlight => "hashed-in-flight",
            VerifyMode::ReadBack => "read-back",
        }
    }
}

impl fmt::Display for VerifyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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
    pub verify_destination: VerifyMode,
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
    fn class_and_mode_names_round_trip() {
        for p in Priority::ALL {
            assert_eq!(p.as_str().parse::<Priority>(), Ok(p));
        }
        assert!("urgent".parse::<Priority>().is_err());
        assert_eq!(VerifyMode::ReadBack.as_str(), "read-back");
        assert_eq!(VerifyMode::HashedInFlight.to_string(), "hashed-in-flight");
    }

    #[test]
    fn empty_sha_constant_is_right() {
        assert_eq!(stagehand_schemas::manifest::sha256_hex(b""), EMPTY_SHA256);
    }
}
