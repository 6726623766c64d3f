//! How a file lands on a posix tier: a temp file written and flushed, then renamed into place
//! without replacing anything ([`CommitMode`]), one at a time or as a batch.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};

use crate::error::{ErrorKind, Side, TransferError};
use crate::transfer::FileDigest;

use super::PosixTier;
use super::hashing::{hash_uncached_file_capped, set_direct};
use super::temporaries::temp_name;

/// Below this size a destination is not preallocated: the extra call costs more than it saves.
const PREALLOCATE_FROM: u64 = 1 << 20;

impl PosixTier {
    /// Creates a temp file beside `rel` (creating parent directories beneath the root) that
    /// becomes `rel` only when committed.
    pub fn create_atomic(&self, rel: &str, size_hint: u64) -> Result<AtomicFile, TransferError> {
        self.check_path(rel, Side::Destination)?;
        let (parent, name) = match rel.rsplit_once('/') {
            Some((p, n)) => (p, n),
            None => ("", rel),
        };
        let dir = self.dir_fd(parent, rel)?;
        self.sweep_dir_once(parent, &dir);
        let (tmp_name, fd) = loop {
            let tmp_name = temp_name(name);
            match rustix::fs::openat(
                &*dir,
                tmp_name.as_str(),
                OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::from_raw_mode(0o644),
            ) {
                Ok(fd) => break (tmp_name, fd),
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => {
                    return Err(TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        rel,
                        "create temp file",
                    ));
                }
            }
        };
        let atomic = AtomicFile {
            tier: self.clone(),
            rel: rel.to_owned(),
            dir,
            tmp_name,
            final_name: name.to_owned(),
            file: File::from(fd),
            armed: true,
        };
        if size_hint >= PREALLOCATE_FROM {
            // Reserve the space up front so a full filesystem fails now, before any copying,
            // with a clear ENOSPC; KEEP_SIZE so a short copy never leaves zeros counted as data.
            match rustix::fs::fallocate(
                &atomic.file,
                rustix::fs::FallocateFlags::KEEP_SIZE,
                0,
                size_hint,
            ) {
                Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => {}
                Err(e) => {
                    return Err(TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        rel,
                        "preallocate",
                    ));
                }
            }
        }
        Ok(atomic)
    }

    /// Makes a batch of written temp files durable and visible (see [`CommitMode::Batched`](super::CommitMode::Batched)).
    /// Returns one result per entry, in order.
    pub fn commit_batch(&self, batch: Vec<PendingRename>) -> Vec<Result<(), TransferError>> {
        if batch.is_empty() {
            return Vec::new();
        }
        if let Err(e) = rustix::fs::syncfs(&*self.inner.root_fd) {
            return batch
                .iter()
                .map(|p| {
                    Err(TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        &p.rel,
                        "syncfs before rename",
                    ))
                })
                .collect();
        }
        let mut results: Vec<Result<(), TransferError>> =
            batch.into_iter().map(|p| p.rename()).collect();
        if let Err(e) = rustix::fs::syncfs(&*self.inner.root_fd) {
            for r in results.iter_mut() {
                if r.is_ok() {
                    // The rename happened but may not survive a crash; the caller must not ack it.
                    *r = Err(TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        "",
                        "syncfs after rename",
                    ));
                }
            }
        }
        results
    }
}

/// A file being written beside its final name; it appears under that name only on commit.
#[derive(Debug)]
pub struct AtomicFile {
    tier: PosixTier,
    rel: String,
    dir: Arc<OwnedFd>,
    tmp_name: String,
    final_name: String,
    file: File,
    armed: bool,
}

impl AtomicFile {
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The destination path this file will be committed to.
    pub fn rel(&self) -> &str {
        &self.rel
    }

    /// Writes all of `buf` at `offset`; a short write is continued, never ignored.
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> Result<(), TransferError> {
        self.file.write_all_at(buf, offset).map_err(|e| {
            TransferError::from_io(e, Side::Destination, self.tier.name(), &self.rel, "write")
        })
    }

    /// Switches the temp file to direct writes (`O_DIRECT`: the page cache skipped, so a
    /// large sequential write costs no copy into the cache and no writeback later, and its
    /// commit's `fdatasync` waits for metadata only). Each later write's offset, length and
    /// buffer address must then be multiples of [`DIRECT_ALIGN`](super::hashing::DIRECT_ALIGN) until [`Self::end_direct`].
    /// `false` when the filesystem does not take it: the file stays buffered.
    pub fn begin_direct(&self) -> bool {
        set_direct(&self.file, true).is_ok()
    }

    /// Back to writes through the page cache (for an unaligned tail).
    pub fn end_direct(&self) -> Result<(), TransferError> {
        set_direct(&self.file, false).map_err(|e| {
            TransferError::from_io(
                e,
                Side::Destination,
                self.tier.name(),
                &self.rel,
                "leave O_DIRECT",
            )
        })
    }

    /// Reads the temp file back and hashes it (for [`crate::VerifyMode::ReadBack`]): from the
    /// device where the page cache does not hold it (the direct-written body of a large file),
    /// into the hashing buffer in one step, as the scrub reads. Through the cache, the kernel's
    /// read-ahead and the copy out cost as much CPU as the hash and made a read-back a third of
    /// the copy's rate (`loadtest/offload`). Nothing but the commit follows it on this handle,
    /// which the `O_DIRECT` the read may leave set does not affect.
    pub fn hash_written(&self) -> Result<FileDigest, TransferError> {
        hash_uncached_file_capped(&self.file, u64::MAX).map_err(|e| {
            TransferError::from_io(
                e,
                Side::Destination,
                self.tier.name(),
                &self.rel,
                "read back",
            )
        })
    }

    /// `fdatasync` → `renameat2(RENAME_NOREPLACE)` → `fsync` of the directory.
    pub fn commit(mut self) -> Result<(), TransferError> {
        rustix::fs::fdatasync(&self.file).map_err(|e| {
            TransferError::from_errno(
                e,
                Side::Destination,
                self.tier.name(),
                &self.rel,
                "fdatasync",
            )
        })?;
        self.rename_noreplace()?;
        self.armed = false;
        rustix::fs::fsync(&*self.dir).map_err(|e| {
            TransferError::from_errno(
                e,
                Side::Destination,
                self.tier.name(),
                &self.rel,
                "fsync directory",
            )
        })
    }

    /// Closes the data file and hands back the rename to do in [`PosixTier::commit_batch`].
    pub fn into_pending(mut self) -> PendingRename {
        self.armed = false;
        PendingRename {
            tier: self.tier.clone(),
            rel: std::mem::take(&mut self.rel),
            dir: self.dir.clone(),
            tmp_name: std::mem::take(&mut self.tmp_name),
            final_name: std::mem::take(&mut self.final_name),
            armed: true,
        }
    }

    fn rename_noreplace(&self) -> Result<(), TransferError> {
        rename_noreplace(
            &self.tier,
            &self.dir,
            &self.tmp_name,
            &self.final_name,
            &self.rel,
        )
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = rustix::fs::unlinkat(&*self.dir, self.tmp_name.as_str(), AtFlags::empty());
        }
    }
}

fn rename_noreplace(
    tier: &PosixTier,
    dir: &OwnedFd,
    tmp: &str,
    name: &str,
    rel: &str,
) -> Result<(), TransferError> {
    rustix::fs::renameat_with(dir.as_fd(), tmp, dir.as_fd(), name, RenameFlags::NOREPLACE).map_err(
        |e| {
            if e == rustix::io::Errno::EXIST {
                TransferError::new(
                    ErrorKind::DestinationConflict,
                    Side::Destination,
                    tier.name(),
                    rel,
                    "another file appeared under this name while copying; it was left untouched",
                )
            } else {
                TransferError::from_errno(
                    e,
                    Side::Destination,
                    tier.name(),
                    rel,
                    "rename into place",
                )
            }
        },
    )
}

/// A written, closed temp file waiting for its batch's rename.
#[derive(Debug)]
pub struct PendingRename {
    tier: PosixTier,
    rel: String,
    dir: Arc<OwnedFd>,
    tmp_name: String,
    final_name: String,
    armed: bool,
}

impl PendingRename {
    pub fn rel(&self) -> &str {
        &self.rel
    }

    fn rename(mut self) -> Result<(), TransferError> {
        let r = rename_noreplace(
            &self.tier,
            &self.dir,
            &self.tmp_name,
            &self.final_name,
            &self.rel,
        );
        if r.is_ok() {
            self.armed = false;
        }
        r
    }
}

impl Drop for PendingRename {
    fn drop(&mut self) {
        if self.armed {
            let _ = rustix::fs::unlinkat(&*self.dir, self.tmp_name.as_str(), AtFlags::empty());
        }
    }
}
