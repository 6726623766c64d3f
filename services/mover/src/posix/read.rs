//! Confined reads of a posix tier: files opened (regular files only, never blocking on a
//! FIFO), measured, hashed and listed beneath the root.

use std::fs::File;
use std::sync::Arc;

use rustix::fs::{AtFlags, Mode, OFlags};

use stagehand_schemas::pieces::{PieceHasher, PieceHashes};

use crate::error::{ErrorKind, Side, TransferError};
use crate::transfer::{FileDigest, PiecedDigest, ReadLimit};

use super::hashing::{ReadFrom, hash_open_file, hash_uncached_file_pieces};
use super::{PosixTier, resolve};

impl PosixTier {
    /// Opens a regular file beneath the root for reading.
    pub fn open_read(&self, rel: &str) -> Result<File, TransferError> {
        self.open_read_side(rel, Side::Source)
    }

    /// Fills `buf` from `file` (opened from `rel` with [`PosixTier::open_read`]) at `offset`:
    /// a file that ends first is [`ErrorKind::SizeMismatch`], never fewer bytes (a range of a
    /// file, as a fan-out's slice is).
    pub fn read_exact_at(
        &self,
        file: &File,
        rel: &str,
        buf: &mut [u8],
        offset: u64,
    ) -> Result<(), TransferError> {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                TransferError::new(
                    ErrorKind::SizeMismatch,
                    Side::Source,
                    self.name(),
                    rel,
                    format!("the file ends before byte {}", offset + buf.len() as u64),
                )
            } else {
                TransferError::from_io(e, Side::Source, self.name(), rel, "read")
            }
        })
    }

    /// Opens `rel` without blocking and without creating it, and refuses anything that is
    /// not a regular file as [`ErrorKind::NotAFile`] before reading a byte: `O_NONBLOCK` makes
    /// the open of a FIFO return at once (without it, it waits for a writer for ever), a
    /// socket fails to open (`ENXIO`), and `fstat` tells a device or directory. The flag is
    /// cleared once the file is known to be regular (io_uring would otherwise hand back
    /// `EAGAIN` instead of waiting for a cold page).
    pub(crate) fn open_read_side(&self, rel: &str, side: Side) -> Result<File, TransferError> {
        self.open_read_stat(rel, side).map(|(file, _)| file)
    }

    /// [`PosixTier::open_read_side`], also returning the size `fstat` found.
    pub(crate) fn open_read_stat(
        &self,
        rel: &str,
        side: Side,
    ) -> Result<(File, u64), TransferError> {
        self.check_path(rel, side)?;
        let fd = rustix::fs::openat2(
            &*self.inner.root_fd,
            rel,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
            Mode::empty(),
            resolve(),
        )
        .map_err(|e| {
            // A device on a `nodev` mount or without a driver, or a socket, cannot be opened
            // at all: say what it is rather than "permission denied".
            if matches!(
                e,
                rustix::io::Errno::ACCESS
                    | rustix::io::Errno::PERM
                    | rustix::io::Errno::NXIO
                    | rustix::io::Errno::NODEV
                    | rustix::io::Errno::OPNOTSUPP
            ) && let Some(t) = self.special_type(rel)
            {
                return self.err(
                    ErrorKind::NotAFile,
                    side,
                    rel,
                    format!("{} is not a regular file; not read", describe_type(t)),
                );
            }
            TransferError::from_errno(e, side, self.name(), rel, "open")
        })?;
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| TransferError::from_errno(e, side, self.name(), rel, "fstat"))?;
        let file_type = rustix::fs::FileType::from_raw_mode(st.st_mode);
        if file_type != rustix::fs::FileType::RegularFile {
            return Err(self.err(
                ErrorKind::NotAFile,
                side,
                rel,
                format!(
                    "{} is not a regular file; not read",
                    describe_type(file_type)
                ),
            ));
        }
        let flags = rustix::fs::fcntl_getfl(&fd)
            .map_err(|e| TransferError::from_errno(e, side, self.name(), rel, "fcntl"))?;
        rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK)
            .map_err(|e| TransferError::from_errno(e, side, self.name(), rel, "fcntl"))?;
        Ok((File::from(fd), st.st_size as u64))
    }

    /// What is at `rel` when it is not a regular file (looked at through an `O_PATH` handle,
    /// which opens nothing).
    fn special_type(&self, rel: &str) -> Option<rustix::fs::FileType> {
        let fd = rustix::fs::openat2(
            &*self.inner.root_fd,
            rel,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            resolve(),
        )
        .ok()?;
        let t = rustix::fs::FileType::from_raw_mode(rustix::fs::fstat(&fd).ok()?.st_mode);
        (t != rustix::fs::FileType::RegularFile).then_some(t)
    }

    /// The size of the regular file at `rel`, or `None` when nothing is there.
    pub fn stat(&self, rel: &str) -> Result<Option<u64>, TransferError> {
        self.check_path(rel, Side::Destination)?;
        let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        if let Some(dir) = self.cached_dir(parent) {
            // The parent is already open beneath the root: one lookup of one name, which
            // `SYMLINK_NOFOLLOW` keeps from leaving it (a symlink is reported, not followed).
            return match rustix::fs::statat(&*dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => self.regular_size(rel, st.st_mode, st.st_size as u64),
                Err(rustix::io::Errno::NOENT) => Ok(None),
                Err(e) => Err(TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    rel,
                    "stat",
                )),
            };
        }
        let fd = match rustix::fs::openat2(
            &*self.inner.root_fd,
            rel,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            resolve(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => {
                return Err(TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    rel,
                    "stat",
                ));
            }
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel, "fstat")
        })?;
        self.regular_size(rel, st.st_mode, st.st_size as u64)
    }

    /// The size of what `stat` found, when it is a regular file.
    fn regular_size(&self, rel: &str, mode: u32, size: u64) -> Result<Option<u64>, TransferError> {
        match rustix::fs::FileType::from_raw_mode(mode) {
            rustix::fs::FileType::RegularFile => Ok(Some(size)),
            rustix::fs::FileType::Symlink => Err(self.err(
                ErrorKind::PathRefused,
                Side::Destination,
                rel,
                "a symlink is at this path; tiers never follow symlinks",
            )),
            _ => Err(self.err(
                ErrorKind::DestinationConflict,
                Side::Destination,
                rel,
                "something other than a regular file is at this path",
            )),
        }
    }

    /// Reads every byte of the file at `rel` and hashes it.
    pub fn hash_file(&self, rel: &str) -> Result<FileDigest, TransferError> {
        self.hash_file_side(rel, Side::Source)
    }

    pub(crate) fn hash_file_side(
        &self,
        rel: &str,
        side: Side,
    ) -> Result<FileDigest, TransferError> {
        let file = self.open_read_side(rel, side)?;
        hash_open_file(&file).map_err(|e| TransferError::from_io(e, side, self.name(), rel, "read"))
    }

    /// Hashes the file at `rel` within `limit`: not a regular file, too large, or not the
    /// declared size is an error before any byte is read (from `fstat`), and at most
    /// `declared_size + 1` bytes are read (a file that grows while read is `SizeMismatch`).
    pub fn hash_file_bounded(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<FileDigest, TransferError> {
        self.hash_file_from(rel, limit, ReadFrom::CacheFirst)
    }

    /// [`PosixTier::hash_file_bounded`] with its bytes taken `from` the page cache first, or
    /// from the device alone (the scrub's read).
    pub fn hash_file_from(
        &self,
        rel: &str,
        limit: ReadLimit,
        from: ReadFrom,
    ) -> Result<FileDigest, TransferError> {
        self.hash_bounded_with(rel, limit, PieceHasher::whole_only(), from)
            .map(|(digest, _)| digest)
    }

    /// [`PosixTier::hash_file_bounded`], with the piece hashes of a file declared larger than
    /// a piece taken in the same read.
    pub fn hash_file_pieces(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<PiecedDigest, TransferError> {
        let (digest, pieces) =
            self.hash_bounded_with(rel, limit, limit.piece_hasher(), ReadFrom::CacheFirst)?;
        Ok(PiecedDigest::new(digest, pieces))
    }

    fn hash_bounded_with(
        &self,
        rel: &str,
        limit: ReadLimit,
        hasher: PieceHasher,
        from: ReadFrom,
    ) -> Result<(FileDigest, PieceHashes), TransferError> {
        let (file, size) = self.open_read_stat(rel, Side::Source)?;
        limit
            .check_size(size)
            .map_err(|(kind, detail)| self.err(kind, Side::Source, rel, detail))?;
        let (digest, pieces) = hash_uncached_file_pieces(&file, limit.read_cap(), hasher, from)
            .map_err(|e| TransferError::from_io(e, Side::Source, self.name(), rel, "read"))?;
        limit
            .check_read(digest.size)
            .map_err(|(kind, detail)| self.err(kind, Side::Source, rel, detail))?;
        Ok((digest, pieces))
    }

    /// The names in directory `rel_dir` (confined; empty when it does not exist).
    pub fn list_dir(&self, rel_dir: &str) -> Result<Vec<String>, TransferError> {
        let fd = if rel_dir.is_empty() {
            self.inner.root_fd.clone()
        } else {
            match rustix::fs::openat2(
                &*self.inner.root_fd,
                rel_dir,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                resolve(),
            ) {
                Ok(fd) => Arc::new(fd),
                Err(rustix::io::Errno::NOENT) => return Ok(Vec::new()),
                Err(e) => {
                    return Err(TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        rel_dir,
                        "open directory",
                    ));
                }
            }
        };
        let mut names = Vec::new();
        let mut listing = rustix::fs::Dir::read_from(&*fd).map_err(|e| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel_dir, "read directory")
        })?;
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(|e| {
                TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    rel_dir,
                    "read directory",
                )
            })?;
            if let Ok(name) = entry.file_name().to_str()
                && name != "."
                && name != ".."
            {
                names.push(name.to_owned());
            }
        }
        Ok(names)
    }
}

/// What `fstat` says a non-regular file is, for errors.
pub(crate) fn describe_type(t: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType;
    match t {
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Symlink => "a symlink",
        _ => "something of unknown type",
    }
}
