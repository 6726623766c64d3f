//! Stagehand's mover: verified, crash-safe transfers between posix and S3 tiers.
//!
//! A transfer takes a [`FileRef`] (relative path, size, SHA-256) from one [`Tier`] to another
//! and proves it arrived: every byte is read once, hashed while it flies, written from the
//! same buffer, and published atomically (temp file → `fdatasync` → rename without replace →
//! directory `fsync`), so a partial file is never visible under its real name. Paths are
//! confined beneath each tier's root with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`.
//!
//! Whole sets of files (a dataset version, shards, a checkpoint) are copied and published at
//! once with [`Mover::copy_set`]: staged in a hidden folder named after its writer, then
//! renamed into place, resumable after a crash (on S3: a completion marker written last).
//! Reads are bounded ([`Tier::hash_file_bounded`]: not a regular file, too large or not the
//! declared size is found before any byte is read), and temp files a killed process left are
//! removed once their writer is provably dead ([`PosixTier::sweep_stale`]).
//!
//! posix → posix runs on an io_uring engine (its own ring thread with registered buffers and
//! one hashing thread per core; files of 1 MiB and more written with `O_DIRECT`) or, where io_uring is
//! unavailable, on a `pread`/`pwrite` engine with the same semantics; [`Mover::engine_name`]
//! says which. In [`Mover::copy_all`] small files skip the engine: a blocking thread copies a
//! group of them in a row with the same proofs ([`MoverConfig::inline_below`]), because for
//! a few KiB the hand-offs between threads cost more than the bytes. Transfers involving S3
//! go through [`s3`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), stagehand_mover::TransferError> {
//! use stagehand_mover::{CopyOptions, FileRef, Mover, MoverConfig, PosixTier, Tier};
//! let mover = Mover::new(MoverConfig::default())?;
//! let src = Tier::Posix(PosixTier::open("lab", "/data/lab")?);
//! let dst = Tier::Posix(PosixTier::open("scratch", "/scratch")?);
//! let file = FileRef::new("shard-0.tar", 1024, "ab".repeat(32));
//! let outcome = mover.copy(&src, &dst, &file, &CopyOptions::default()).await?;
//! println!("{outcome:?} by {}", mover.engine_name());
//! # Ok(()) }
//! ```

pub mod cp;
mod engine;
pub mod error;
mod fingerprint;
mod mover;
mod owner;
pub mod posix;
pub mod s3;
mod sched;
mod set;
mod tier;
pub mod transfer;

pub use engine::EngineChoice;
pub use error::{ErrorKind, Side, TransferError};
pub use fingerprint::{
    Change, Difference, Entry, Fingerprint, FingerprintError, SetCheck, Stamp, Time, walk_posix,
};
pub use mover::{BatchReport, FileResult, Mover, MoverConfig};
pub use posix::{
    AtomicFile, CommitMode, DIRECT_ALIGN, PendingRename, PosixTier, SetAccess, SweepOptions,
    SweepReport,
};
pub use sched::{Permit, RateLimiter, Scheduler};
pub use set::{SET_COMPLETE_MARKER, SetCopy, SetReport, StagedSet};
pub use tier::Tier;
pub use tokio_util::sync::CancellationToken;
pub use transfer::{
    CopyOptions, CopyOutcome, EMPTY_SHA256, FileDigest, FileRef, PiecedDigest, Priority, Progress,
    ReadLimit, SkipReason, VerifyMode,
};
