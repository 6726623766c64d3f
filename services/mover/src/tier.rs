//! A storage tier: a posix root or an S3 bucket prefix, behind one small enum.

use std::sync::Arc;

use crate::error::{ErrorKind, Side, TransferError};
use crate::posix::{PosixTier, ReadFrom};
use crate::s3::S3Tier;
use crate::transfer::{FileDigest, PiecedDigest, Priority, ReadLimit};

/// Where files live. Paths handed to a tier are always relative to its root (or prefix).
#[derive(Debug, Clone)]
pub enum Tier {
    Posix(PosixTier),
    S3(S3Tier),
}

impl Tier {
    /// The tier's name, used in errors and reports.
    pub fn name(&self) -> &str {
        match self {
            Tier::Posix(t) => t.name(),
            Tier::S3(t) => t.name(),
        }
    }

    /// Writes a small file or object (a marker, an index) at `rel`, atomically: never visible
    /// partly written. An existing file or object at `rel` is `DestinationConflict` on posix
    /// (publish without replace) and replaced on S3 (a PUT is all or nothing).
    pub async fn write_small(&self, rel: &str, bytes: Vec<u8>) -> Result<(), TransferError> {
        match self {
            Tier::Posix(t) => {
                let t = t.clone();
                let rel_owned = rel.to_owned();
                self.blocking(rel, Side::Destination, "writing", move || {
                    let file = t.create_atomic(&rel_owned, bytes.len() as u64)?;
                    file.write_all_at(&bytes, 0)?;
                    file.commit()
                })
                .await
            }
            Tier::S3(t) => t.put_small(rel, bytes).await,
        }
    }

    /// Reads every byte of the file or object at `rel` (confined beneath the tier root) and
    /// hashes it. A path that leaves the root or crosses a symlink is `PathRefused`; a missing
    /// one is `NotFound`.
    pub async fn hash_file(&self, rel: &str) -> Result<FileDigest, TransferError> {
        match self {
            Tier::Posix(t) => {
                let t = t.clone();
                let rel_owned = rel.to_owned();
                self.blocking(rel, Side::Source, "hashing", move || {
                    t.hash_file(&rel_owned)
                })
                .await
            }
            Tier::S3(t) => t.hash_file(rel).await,
        }
    }

    /// The bytes `range` of the file or object at `rel` (confined beneath the tier root): a
    /// fan-out's piece of a large file. A file that ends before the range does is
    /// [`ErrorKind::SizeMismatch`].
    pub async fn read_range(
        &self,
        rel: &str,
        range: std::ops::Range<u64>,
    ) -> Result<Vec<u8>, TransferError> {
        match self {
            Tier::Posix(t) => {
                let t = t.clone();
                let rel_owned = rel.to_owned();
                self.blocking(rel, Side::Source, "reading", move || {
                    let file = t.open_read(&rel_owned)?;
                    let mut out = vec![0u8; range.end.saturating_sub(range.start) as usize];
                    t.read_exact_at(&file, &rel_owned, &mut out, range.start)?;
                    Ok(out)
                })
                .await
            }
            Tier::S3(t) => t.read_range(rel, range).await,
        }
    }
}

impl Tier {
    /// Runs `work`, a posix call that blocks, on a blocking thread; a task that fails (a
    /// panic) is an `Io` error about `rel` saying what it was doing.
    async fn blocking<T: Send + 'static>(
        &self,
        rel: &str,
        side: Side,
        what: &str,
        work: impl FnOnce() -> Result<T, TransferError> + Send + 'static,
    ) -> Result<T, TransferError> {
        tokio::task::spawn_blocking(work).await.map_err(|e| {
            TransferError::new(
                ErrorKind::Io,
                side,
                self.name(),
                rel,
                format!("{what} task failed: {e}"),
            )
        })?
    }

    /// This tier, publishing every set written through the returned handle with `access` on
    /// posix (see [`crate::SetAccess`]); an S3 tier has no modes and is returned as it is.
    pub fn with_access(&self, access: Option<crate::SetAccess>) -> Tier {
        match self {
            Tier::Posix(t) => Tier::Posix(t.with_access(access)),
            Tier::S3(t) => Tier::S3(t.clone()),
        }
    }

    /// The tier rooted at `rel` beneath this one (confined like every path; `""` is this
    /// tier). A posix directory is opened, not created.
    pub fn beneath(&self, rel: &str) -> Result<Tier, TransferError> {
        match self {
            Tier::Posix(t) => t.beneath(rel, false).map(Tier::Posix),
            Tier::S3(t) => t.beneath(rel).map(Tier::S3),
        }
    }

    /// The size of the regular file or object at `rel`, or `None` when nothing is there: what
    /// a size mismatch found, for a report of the damage.
    pub async fn size(&self, rel: &str) -> Result<Option<u64>, TransferError> {
        match self {
            Tier::Posix(t) => {
                let t = t.clone();
                let rel_owned = rel.to_owned();
                self.blocking(rel, Side::Source, "stat", move || t.stat(&rel_owned))
                    .await
            }
            Tier::S3(t) => Ok(t.stat(rel).await?.map(|info| info.size)),
        }
    }

    /// Hashes the file or object at `rel` within `limit` — the validator's one call per
    /// manifest entry. Before any byte is read: something that is not a regular file
    /// (directory, FIFO, socket, device; opened without blocking) is
    /// [`ErrorKind::NotAFile`], a size above `limit.max_size` is [`ErrorKind::TooLarge`], a
    /// size other than `limit.declared_size` is [`ErrorKind::SizeMismatch`]; at most
    /// `declared_size + 1` bytes are read. A path too long for the tier (PATH_MAX, or an S3
    /// key over 1024 bytes) is [`ErrorKind::PathRefused`]. Every one of these, and an S3 4xx
    /// about the object, is permanent and about this file only; unreachable endpoints, 5xx
    /// and I/O errors are retryable.
    pub async fn hash_file_bounded(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<FileDigest, TransferError> {
        self.hash_file_from(rel, limit, ReadFrom::CacheFirst, Priority::default())
            .await
    }

    /// [`Tier::hash_file_bounded`] of what the storage holds, for a mover class: the scrub's
    /// read, of several files one after another, each file's result in its place. On posix
    /// each file is read from the device, never the page cache ([`ReadFrom::Device`]: a
    /// cached copy would hide rot on the disk until it is evicted, and a scrub's reads would
    /// push jobs' data out of the cache), all of them on one reading thread, which a read in
    /// the background class puts in the kernel's idle I/O class, so it yields the disk to
    /// every other process's reads and writes, not only to this process's classes. One
    /// hand-off to a reading thread per batch, not per file: over a tier of small files, the
    /// hand-offs were a tenth of the scrub's time (loadtest/scrub/README.md). An S3 tier is
    /// always read from the store.
    pub async fn hash_files_on_device(
        &self,
        files: Arc<[(String, ReadLimit)]>,
        priority: Priority,
    ) -> Vec<Result<FileDigest, TransferError>> {
        match self {
            Tier::Posix(t) => {
                let (t, listed) = (t.clone(), files.clone());
                let first = files.first().map_or("", |(rel, _)| rel.as_str());
                let hashed = self
                    .blocking(first, Side::Source, "hashing", move || {
                        let _class = crate::posix::IoClass::enter(priority);
                        Ok((listed.iter())
                            .map(|(rel, limit)| t.hash_file_from(rel, *limit, ReadFrom::Device))
                            .collect::<Vec<_>>())
                    })
                    .await;
                match hashed {
                    Ok(each) => each,
                    // The reading thread failed as a whole: every file of the batch says so.
                    Err(e) => (files.iter())
                        .map(|(rel, _)| {
                            Err(TransferError::new(e.kind, e.side, &e.tier, rel, &e.detail))
                        })
                        .collect(),
                }
            }
            Tier::S3(t) => {
                let mut each = Vec::with_capacity(files.len());
                for (rel, limit) in files.iter() {
                    each.push(t.hash_file_bounded(rel, *limit).await);
                }
                each
            }
        }
    }

    async fn hash_file_from(
        &self,
        rel: &str,
        limit: ReadLimit,
        from: ReadFrom,
        priority: Priority,
    ) -> Result<FileDigest, TransferError> {
        match self {
            Tier::Posix(t) => {
                let t = t.clone();
                let rel_owned = rel.to_owned();
                self.blocking(rel, Side::Source, "hashing", move || {
                    let _class = crate::posix::IoClass::enter(priority);
                    t.hash_file_from(&rel_owned, limit, from)
                })
                .await
            }
            Tier::S3(t) => t.hash_file_bounded(rel, limit).await,
        }
    }

    /// [`Tier::hash_file_bounded`], also taking the piece hashes of a file declared larger
    /// than a piece (`stagehand_schemas::pieces`) in the same read: the side data of the
    /// ingest validator. A file declared a piece or smaller is hashed once, as by
    /// [`Tier::hash_file_bounded`], and has none.
    pub async fn hash_file_pieces(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<PiecedDigest, TransferError> {
        match self {
            Tier::Posix(t) => {
                let t = t.clone();
                let rel_owned = rel.to_owned();
                self.blocking(rel, Side::Source, "hashing", move || {
                    t.hash_file_pieces(&rel_owned, limit)
                })
                .await
            }
            Tier::S3(t) => t.hash_file_pieces(rel, limit).await,
        }
    }
}

impl From<PosixTier> for Tier {
    fn from(t: PosixTier) -> Self {
        Tier::Posix(t)
    }
}

impl From<S3Tier> for Tier {
    fn from(t: S3Tier) -> Self {
        Tier::S3(t)
    }
}
