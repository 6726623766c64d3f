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
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use stagehand_schemas::check_relative_path;

use crate::error::{ErrorKind, Side, TransferError};

mod access;
mod folders;
mod hashing;
mod io_class;
mod landing;
mod read;
mod space;
mod temporaries;

pub(crate) use access::PRIVATE_DIR_MODE;
pub use access::SetAccess;
pub use hashing::{DIRECT_ALIGN, ReadFrom};
pub(crate) use hashing::{hash_open_file, mostly_uncached, set_direct};
pub(crate) use io_class::IoClass;
pub use landing::{AtomicFile, PendingRename};
pub(crate) use read::describe_type;
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

    /// Forgets the directories opened so far (call between batches, so a directory removed
    /// behind the tier's back is created again instead of written into while unlinked).
    pub fn forget_dirs(&self) {
        self.inner
            .dirs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
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
}
