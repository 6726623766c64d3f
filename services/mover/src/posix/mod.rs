//! The posix tier: a root directory whose every path is opened confined beneath it, and the
//! atomic way a file lands there.
//!
//! Every path is checked lexically ([`check_relative_path`]) and then opened with `openat2`
//! relative to the root's directory fd with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`, so neither `..`, an absolute path, nor a symlink
//! planted on the tier can lead a read or a write outside the root. Directories are created
//! with `mkdirat` and renamed with `renameat2` on such confined handles, never by path string.
//! A source is opened with `O_NONBLOCK` and refused unless `fstat` says it is a regular file,
//! so a FIFO never blocks a read.
//!
//! A file lands as: a temp file `.<name>.stagehand-<owner>-<n>.tmp` created with `O_EXCL` in the
//! destination directory → data → `fdatasync` → `renameat2(RENAME_NOREPLACE)` → `fsync` of the
//! directory ([`CommitMode::Durable`]). For many small files [`CommitMode::Batched`] replaces
//! the per-file flushes by one `syncfs` before the batch's renames and one after them: the
//! first makes every temp file's data durable before any name points at it, the second makes
//! the renames durable, and the caller is told "done" only after the second returns. Since
//! Linux 5.8 `syncfs` reports writeback errors of the filesystem, so a failed flush fails the
//! batch instead of going unnoticed. A temp file never committed is unlinked on drop; one a
//! killed process left is removed later by whoever can prove its writer dead
//! (see `posix/temporaries.rs` and [`PosixTier::sweep_stale`]).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags, ResolveFlags};
use sha2::{Digest, Sha256};
use stagehand_schemas::check_relative_path;

use crate::error::{ErrorKind, Side, TransferError};
use crate::transfer::{FileDigest, ReadLimit};

mod access;
mod temporaries;

pub(crate) use access::PRIVATE_DIR_MODE;
pub use access::SetAccess;
use temporaries::temp_name;
pub use temporaries::{SweepOptions, SweepReport, is_temp_name};
pub(crate) use temporaries::{Temporary, parse_temporary, staging_name};

/// How a written file is made durable before its name appears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommitMode {
    /// `fdatasync` the file, rename, `fsync` the directory: one file at a time.
    #[default]
    Durable,
    /// `syncfs` once before a batch of renames and once after (see the module docs).
    Batched,
}

/// How many directories a tier remembers as already swept for stale temporaries.
const SWEPT_LIMIT: usize = 1 << 16;
/// How many directory fds the tier keeps open before it forgets them all.
const DIR_CACHE_LIMIT: usize = 4096;
/// Below this size a destination is not preallocated: the extra call costs more than it saves.
const PREALLOCATE_FROM: u64 = 1 << 20;
/// Block size of the plain hashing reader.
const HASH_BLOCK: usize = 1 << 20;
/// The longest path (with its terminating NUL) the kernel accepts in one call.
const PATH_MAX: usize = libc::PATH_MAX as usize;

pub(crate) fn resolve() -> ResolveFlags {
    ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV
}

/// A posix tier: a name and a root directory, held open.
#[derive(Debug, Clone)]
pub struct PosixTier {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: String,
    root: PathBuf,
    root_fd: Arc<OwnedFd>,
    /// Directories already opened (or created) beneath the root, so a batch of many files
    /// in few folders creates and opens each folder once.
    dirs: Mutex<HashMap<String, Arc<OwnedFd>>>,
    /// Directories whose stale temp files were already looked for (or that this tier
    /// created, so none can be there), so each directory is read once per tier.
    swept: Mutex<HashSet<String>>,
    /// Stale temp files removed so far by writes into this tier.
    stale_files: AtomicU64,
    stale_bytes: AtomicU64,
    /// The modes and group sets published through this handle get (see [`SetAccess`]);
    /// `None` publishes them as written.
    access: Option<SetAccess>,
}

impl PosixTier {
    /// Opens the tier rooted at `root`, which must be an existing directory.
    pub fn open(name: &str, root: impl AsRef<Path>) -> Result<PosixTier, TransferError> {
        let root = root.as_ref();
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            let mut err =
                TransferError::from_errno(e, Side::Destination, name, "", "open tier root");
            err.detail = format!("open tier root {}: {}", root.display(), e);
            if err.kind == ErrorKind::NotFound {
                err.kind = ErrorKind::Config;
            }
            err
        })?;
        Ok(PosixTier {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                root: root.to_owned(),
                root_fd: Arc::new(fd),
                dirs: Mutex::new(HashMap::new()),
                swept: Mutex::new(HashSet::new()),
                stale_files: AtomicU64::new(0),
                stale_bytes: AtomicU64::new(0),
                access: None,
            }),
        })
    }

    /// This tier, publishing every set written through the returned handle with `access`
    /// (its files' and folders' modes and group, set before the set becomes visible; see
    /// [`SetAccess`]); `None` publishes them as written. The root stays open once.
    pub fn with_access(&self, access: Option<SetAccess>) -> PosixTier {
        PosixTier {
            inner: Arc::new(Inner {
                name: self.inner.name.clone(),
                root: self.inner.root.clone(),
                root_fd: self.inner.root_fd.clone(),
                dirs: Mutex::new(HashMap::new()),
                swept: Mutex::new(HashSet::new()),
                stale_files: AtomicU64::new(0),
                stale_bytes: AtomicU64::new(0),
                access,
            }),
        }
    }

    /// The modes and group sets published through this handle get.
    pub fn access(&self) -> Option<SetAccess> {
        self.inner.access
    }

    /// The directory `rel_dir` beneath the root as a tier of its own (same name), opened
    /// confined; with `create`, missing directories are made with `mkdirat` on confined
    /// parents. Paths given to the new tier are relative to `rel_dir`; it can never reach
    /// above it. `""` is this tier.
    pub fn beneath(&self, rel_dir: &str, create: bool) -> Result<PosixTier, TransferError> {
        if rel_dir.is_empty() {
            return Ok(self.clone());
        }
        let side = if create {
            Side::Destination
        } else {
            Side::Source
        };
        self.check_path(rel_dir, side)?;
        let fd = if create {
            self.dir_fd(rel_dir, rel_dir)?
        } else {
            Arc::new(
                rustix::fs::openat2(
                    &*self.inner.root_fd,
                    rel_dir,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                    resolve(),
                )
                .map_err(|e| {
                    TransferError::from_errno(e, side, self.name(), rel_dir, "open directory")
                })?,
            )
        };
        Ok(PosixTier {
            inner: Arc::new(Inner {
                name: self.inner.name.clone(),
                root: self.inner.root.join(rel_dir),
                root_fd: fd,
                dirs: Mutex::new(HashMap::new()),
                swept: Mutex::new(HashSet::new()),
                stale_files: AtomicU64::new(0),
                stale_bytes: AtomicU64::new(0),
                access: self.inner.access,
            }),
        })
    }

    /// Stale temp files (of writers proven dead, see [`PosixTier::sweep_stale`]) that writes into this
    /// tier removed so far: the first write into a directory removes the dead temporaries
    /// in it, so the rerun of a killed copy leaves none behind.
    pub fn stale_removed(&self) -> SweepReport {
        SweepReport {
            files_removed: self.inner.stale_files.load(Ordering::Relaxed),
            bytes_removed: self.inner.stale_bytes.load(Ordering::Relaxed),
            ..SweepReport::default()
        }
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The root directory's fd (for `syncfs` and confined opens).
    pub fn root_fd(&self) -> &OwnedFd {
        &self.inner.root_fd
    }

    fn err(
        &self,
        kind: ErrorKind,
        side: Side,
        rel: &str,
        detail: impl Into<String>,
    ) -> TransferError {
        TransferError::new(kind, side, self.inner.name.clone(), rel, detail)
    }

    /// Refuses a path that is not relative and normalised, or longer than the kernel takes
    /// (PATH_MAX), before any system call: a problem of that one path, never a retry.
    pub fn check_path(&self, rel: &str, side: Side) -> Result<(), TransferError> {
        check_relative_path(rel).map_err(|e| {
            self.err(
                ErrorKind::PathRefused,
                side,
                &rel.replace('\0', "\\0"),
                e.to_string(),
            )
        })?;
        if rel.len() >= PATH_MAX {
            return Err(self.err(
                ErrorKind::PathRefused,
                side,
                rel,
                format!(
                    "the path is {} bytes long; a path on a posix tier must be shorter than PATH_MAX ({PATH_MAX})",
                    rel.len()
                ),
            ));
        }
        Ok(())
    }

    /// Opens a regular file beneath the root for reading.
    pub fn open_read(&self, rel: &str) -> Result<File, TransferError> {
        self.open_read_side(rel, Side::Source)
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

    /// The directory `rel_dir` if it is already open (the root for `""`).
    fn cached_dir(&self, rel_dir: &str) -> Option<Arc<OwnedFd>> {
        if rel_dir.is_empty() {
            return Some(self.inner.root_fd.clone());
        }
        self.inner
            .dirs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(rel_dir)
            .cloned()
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
        let (file, size) = self.open_read_stat(rel, Side::Source)?;
        limit
            .check_size(size)
            .map_err(|(kind, detail)| self.err(kind, Side::Source, rel, detail))?;
        let digest = hash_uncached_file_capped(&file, limit.read_cap())
            .map_err(|e| TransferError::from_io(e, Side::Source, self.name(), rel, "read"))?;
        limit
            .check_read(digest.size)
            .map_err(|(kind, detail)| self.err(kind, Side::Source, rel, detail))?;
        Ok(digest)
    }

    /// Forgets the directories opened so far (call between batches, so a directory removed
    /// behind the tier's back is created again instead of written into while unlinked).
    pub fn forget_dirs(&self) {
        self.inner
            .dirs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Renames the directory `from` to `to` (both tier-relative; `to`'s parents are created
    /// confined) with `renameat2(RENAME_NOREPLACE)` between confined handles of the two
    /// parents, then `fsync`s both parents. `Ok(false)` when something is already at `to`
    /// (nothing was moved).
    pub fn rename_dir_noreplace(&self, from: &str, to: &str) -> Result<bool, TransferError> {
        self.check_path(from, Side::Destination)?;
        self.check_path(to, Side::Destination)?;
        let (from_parent, from_name) = from.rsplit_once('/').unwrap_or(("", from));
        let (to_parent, to_name) = to.rsplit_once('/').unwrap_or(("", to));
        let from_dir = self.dir_fd(from_parent, from)?;
        let to_dir = self.dir_fd(to_parent, to)?;
        match rustix::fs::renameat_with(
            from_dir.as_fd(),
            from_name,
            to_dir.as_fd(),
            to_name,
            RenameFlags::NOREPLACE,
        ) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => return Ok(false),
            Err(e) => {
                return Err(TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    to,
                    "rename into place",
                ));
            }
        }
        // Handles opened beneath the old name now point beneath the new one.
        self.forget_dirs();
        for dir in [&to_dir, &from_dir] {
            rustix::fs::fsync(&**dir).map_err(|e| {
                TransferError::from_errno(e, Side::Destination, self.name(), to, "fsync directory")
            })?;
            if from_parent == to_parent {
                break;
            }
        }
        Ok(true)
    }

    /// Swaps the directories `from` and `to` (both tier-relative, both present) with one
    /// `renameat2(RENAME_EXCHANGE)` between confined handles of their parents, then `fsync`s
    /// both parents: a reader finds either the old folder or the new one whole under `to`,
    /// never neither. `Ok(false)` when `to` is not there (nothing was moved).
    pub fn exchange_dirs(&self, from: &str, to: &str) -> Result<bool, TransferError> {
        self.check_path(from, Side::Destination)?;
        self.check_path(to, Side::Destination)?;
        let (from_parent, from_name) = from.rsplit_once('/').unwrap_or(("", from));
        let (to_parent, to_name) = to.rsplit_once('/').unwrap_or(("", to));
        let from_dir = self.dir_fd(from_parent, from)?;
        let to_dir = self.dir_fd(to_parent, to)?;
        match rustix::fs::renameat_with(
            from_dir.as_fd(),
            from_name,
            to_dir.as_fd(),
            to_name,
            RenameFlags::EXCHANGE,
        ) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOENT) => return Ok(false),
            Err(e) => {
                return Err(TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    to,
                    "exchange into place",
                ));
            }
        }
        self.forget_dirs();
        for dir in [&to_dir, &from_dir] {
            rustix::fs::fsync(&**dir).map_err(|e| {
                TransferError::from_errno(e, Side::Destination, self.name(), to, "fsync directory")
            })?;
            if from_parent == to_parent {
                break;
            }
        }
        Ok(true)
    }

    /// Hard-links the file `rel` of `from` (a folder of the same filesystem: a tier beneath
    /// this one's parent) to `rel` beneath this tier, creating parents confined: a verified
    /// file of a set found in place joins its replacement without a copy. Already there is
    /// fine (a resumed staging folder).
    pub fn link_from(&self, from: &PosixTier, rel: &str) -> Result<(), TransferError> {
        self.check_path(rel, Side::Destination)?;
        from.check_path(rel, Side::Source)?;
        let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        let from_dir = from.dir_fd(parent, rel)?;
        let to_dir = self.dir_fd(parent, rel)?;
        let link = || {
            rustix::fs::linkat(
                from_dir.as_fd(),
                name,
                to_dir.as_fd(),
                name,
                AtFlags::empty(),
            )
        };
        let linked = match link() {
            // What a resumed staging folder holds under the name is not what was verified.
            Err(rustix::io::Errno::EXIST) => {
                rustix::fs::unlinkat(to_dir.as_fd(), name, AtFlags::empty()).and_then(|()| link())
            }
            other => other,
        };
        linked
            .map_err(|e| TransferError::from_errno(e, Side::Destination, self.name(), rel, "link"))
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

    /// Opens (creating where missing) the directory `rel_dir` beneath the root.
    fn dir_fd(&self, rel_dir: &str, rel_for_errors: &str) -> Result<Arc<OwnedFd>, TransferError> {
        if rel_dir.is_empty() {
            return Ok(self.inner.root_fd.clone());
        }
        if let Some(fd) = self
            .inner
            .dirs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(rel_dir)
        {
            return Ok(fd.clone());
        }
        let (parent_fd, name) = match rel_dir.rsplit_once('/') {
            Some((parent, name)) => (self.dir_fd(parent, rel_for_errors)?, name),
            None => (self.inner.root_fd.clone(), rel_dir),
        };
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let open = || rustix::fs::openat2(&*parent_fd, name, flags, Mode::empty(), resolve());
        let fd = match open() {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => {
                match rustix::fs::mkdirat(&*parent_fd, name, Mode::from_raw_mode(0o755)) {
                    Ok(()) => {
                        // Created here: no temporary of anyone else can be inside yet.
                        self.mark_swept(rel_dir);
                    }
                    Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => {
                        return Err(TransferError::from_errno(
                            e,
                            Side::Destination,
                            self.name(),
                            rel_for_errors,
                            &format!("create directory {rel_dir}"),
                        ));
                    }
                }
                open().map_err(|e| {
                    TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        rel_for_errors,
                        &format!("open directory {rel_dir}"),
                    )
                })?
            }
            Err(rustix::io::Errno::NOTDIR) => {
                return Err(self.err(
                    ErrorKind::DestinationConflict,
                    Side::Destination,
                    rel_for_errors,
                    format!("{rel_dir} exists and is not a directory"),
                ));
            }
            Err(e) => {
                return Err(TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    rel_for_errors,
                    &format!("open directory {rel_dir}"),
                ));
            }
        };
        let fd = Arc::new(fd);
        let mut dirs = self.inner.dirs.lock().unwrap_or_else(|p| p.into_inner());
        if dirs.len() >= DIR_CACHE_LIMIT {
            dirs.clear();
        }
        dirs.insert(rel_dir.to_owned(), fd.clone());
        Ok(fd)
    }

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

    /// Makes a batch of written temp files durable and visible (see [`CommitMode::Batched`]).
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
    /// buffer address must then be multiples of [`DIRECT_ALIGN`] until [`Self::end_direct`].
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

    /// Reads the temp file back and hashes it (for [`crate::VerifyMode::ReadBack`]).
    pub fn hash_written(&self) -> Result<FileDigest, TransferError> {
        hash_open_file(&self.file).map_err(|e| {
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

/// Hashes a whole open file with positioned reads (the file offset is left alone).
pub(crate) fn hash_open_file(file: &File) -> io::Result<FileDigest> {
    hash_open_file_capped(file, u64::MAX)
}

/// Hashes an open file from offset 0 up to its end or `cap` bytes, whichever comes first.
fn hash_open_file_capped(file: &File, cap: u64) -> io::Result<FileDigest> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_BLOCK.min(usize::try_from(cap).unwrap_or(usize::MAX).max(1))];
    let mut offset = 0u64;
    while offset < cap {
        let want = (cap - offset).min(buf.len() as u64) as usize;
        let n = match file.read_at(&mut buf[..want], offset) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    Ok(FileDigest {
        size: offset,
        sha256: hex::encode(hasher.finalize()),
    })
}

/// Offset, length and buffer-address alignment of a direct (`O_DIRECT`) read or write: the
/// largest logical block size in common use.
pub const DIRECT_ALIGN: usize = 4096;

/// [`hash_open_file_capped`] for a file this call may switch to `O_DIRECT` (its caller opened
/// it for this read alone): each block is first read from the page cache only
/// (`preadv2(RWF_NOWAIT)`); from the first block the cache does not hold, the rest is read
/// with `O_DIRECT`. A file written with direct writes (the mover's large copies), or evicted,
/// is then read from the device into the hashing buffer in one step, instead of through the
/// kernel's read-ahead into the page cache and copied out again, which costs as much CPU as
/// the hash itself when memory is full of cache and halves the rate on two cores; a cached
/// file is still read from memory. A filesystem without direct reads (or without
/// `RWF_NOWAIT`) is read as before. No more than `cap` bytes are read either way: the
/// unaligned end of a read goes through the cache.
fn hash_uncached_file_capped(file: &File, cap: u64) -> io::Result<FileDigest> {
    use rustix::io::{Errno, ReadWriteFlags};
    let block = HASH_BLOCK.min(usize::try_from(cap).unwrap_or(usize::MAX).max(1));
    let mut raw = vec![0u8; block + DIRECT_ALIGN];
    let start = raw.as_ptr().align_offset(DIRECT_ALIGN);
    let buf = &mut raw[start..start + block];
    let mut hasher = Sha256::new();
    let mut offset = 0u64;
    // Whether blocks are probed in the cache first; off once the device is read directly, or
    // when the kernel has no RWF_NOWAIT.
    let mut probe = true;
    // Whether the file is open `O_DIRECT` (only ever switched on, once).
    let mut direct = false;
    while offset < cap {
        let want = (cap - offset).min(buf.len() as u64) as usize;
        let aligned = want / DIRECT_ALIGN * DIRECT_ALIGN;
        let direct_ok = offset.is_multiple_of(DIRECT_ALIGN as u64) && aligned > 0;
        let mut n = None;
        if probe && !direct {
            match rustix::io::preadv2(
                file,
                &mut [io::IoSliceMut::new(&mut buf[..want])],
                offset,
                ReadWriteFlags::NOWAIT,
            ) {
                Ok(read) => n = Some(read),
                Err(Errno::INTR) => continue,
                // Not (all) in the page cache: read the rest from the device.
                Err(Errno::AGAIN) => {
                    probe = false;
                    direct = set_direct(file, true).is_ok();
                }
                // No RWF_NOWAIT here: plain reads.
                Err(Errno::OPNOTSUPP | Errno::INVAL) => probe = false,
                Err(e) => return Err(e.into()),
            }
        }
        let n = match n {
            Some(n) => n,
            None if direct && direct_ok => {
                match rustix::io::pread(file, &mut buf[..aligned], offset) {
                    Ok(n) => n,
                    Err(Errno::INTR) => continue,
                    // A direct read the filesystem refuses after all: buffered from here on.
                    Err(Errno::INVAL) => {
                        set_direct(file, false)?;
                        direct = false;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            None => {
                if direct {
                    // An unaligned offset or end: through the cache.
                    set_direct(file, false)?;
                    direct = false;
                }
                match file.read_at(&mut buf[..want], offset) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
        };
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    Ok(FileDigest {
        size: offset,
        sha256: hex::encode(hasher.finalize()),
    })
}

/// Whether the page cache holds less than half of the first `len` bytes of `file`, asked
/// with `cachestat(2)` (Linux 6.5): one call, no data read. `false` when the kernel cannot
/// say (older, or the call refused), so a caller keeps to buffered reads.
pub(crate) fn mostly_uncached(file: &File, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    /// `struct cachestat_range` of the kernel's uapi.
    #[repr(C)]
    struct CachestatRange {
        off: u64,
        len: u64,
    }
    /// `struct cachestat` of the kernel's uapi (pages).
    #[repr(C)]
    #[derive(Default)]
    struct Cachestat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    /// The system call's number: new calls share one number on every architecture.
    const SYS_CACHESTAT: libc::c_long = 451;
    if len == 0 {
        return false;
    }
    let range = CachestatRange { off: 0, len };
    let mut stat = Cachestat::default();
    // SAFETY: both pointers are to live values of the layouts the kernel expects; the call
    // writes only `stat`.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0u32,
        )
    };
    let pages = len.div_ceil(DIRECT_ALIGN as u64);
    // Dirty pages would be written back before a direct read of them: those files stay buffered.
    rc == 0 && stat.nr_dirty == 0 && stat.nr_cache * 2 < pages
}

/// Turns `O_DIRECT` on or off for the open file description behind `file`; turning it on
/// fails on a filesystem that does not take it (the file stays as it was).
pub(crate) fn set_direct(file: &File, on: bool) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    let new = if on {
        flags | OFlags::DIRECT
    } else {
        flags - OFlags::DIRECT
    };
    if new != flags {
        rustix::fs::fcntl_setfl(file, new)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_hash_reads_no_further_than_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        let file = File::open(&path).unwrap();
        let d = hash_open_file_capped(&file, 4).unwrap();
        assert_eq!(d.size, 4);
        assert_eq!(d.sha256, stagehand_schemas::manifest::sha256_hex(b"0123"));
        assert_eq!(hash_open_file(&file).unwrap().size, 10);
    }

    /// The validator's reader: a file out of the page cache (read with `O_DIRECT`), partly in
    /// it, or wholly in it hashes to its bytes, its unaligned end included, and a cap is
    /// honoured to the byte.
    #[test]
    fn an_uncached_file_hashes_to_its_bytes_within_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let body: Vec<u8> = (0..(3 * HASH_BLOCK + 12345))
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        std::fs::write(&path, &body).unwrap();
        let evict = |from: u64| {
            let file = File::open(&path).unwrap();
            file.sync_all().unwrap();
            rustix::fs::fadvise(&file, from, None, rustix::fs::Advice::DontNeed).unwrap();
        };
        let sha = stagehand_schemas::manifest::sha256_hex;
        for (evicted_from, cap) in [
            (0, u64::MAX),
            (HASH_BLOCK as u64, u64::MAX),
            (0, body.len() as u64 + 1),
            (0, 2 * HASH_BLOCK as u64 + 4097),
            (0, 100),
        ] {
            evict(evicted_from);
            let file = File::open(&path).unwrap();
            let d = hash_uncached_file_capped(&file, cap).unwrap();
            let expect = &body[..body.len().min(usize::try_from(cap).unwrap_or(usize::MAX))];
            assert_eq!(d.size, expect.len() as u64, "cap {cap}");
            assert_eq!(
                d.sha256,
                sha(expect),
                "cap {cap}, evicted from {evicted_from}"
            );
        }
        // Cached: the same answer.
        let file = File::open(&path).unwrap();
        assert_eq!(
            hash_uncached_file_capped(&file, u64::MAX).unwrap().sha256,
            sha(&body)
        );
    }

    /// Guards the io_uring engine's choice of direct reads: a file evicted from the page
    /// cache is mostly uncached, the same file read back into it is not, and a file with
    /// dirty pages never is (a direct read would have to write them back first).
    #[test]
    fn a_file_out_of_the_page_cache_is_mostly_uncached_and_a_read_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let body = vec![7u8; 4 << 20];
        std::fs::write(&path, &body).unwrap();
        let file = File::open(&path).unwrap();
        let len = body.len() as u64;
        assert!(
            !mostly_uncached(&file, len),
            "just written: dirty or cached"
        );
        file.sync_all().unwrap();
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        assert!(mostly_uncached(&file, len), "evicted");
        std::io::copy(&mut &file, &mut std::io::sink()).unwrap();
        assert!(!mostly_uncached(&file, len), "read back into the cache");
        assert!(!mostly_uncached(&file, 0), "nothing to read");
    }
}
