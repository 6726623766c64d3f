//! Temporaries on a posix tier: the names temp files and staging folders get (naming their
//! writer, [`crate::owner`]), and the sweeps that remove those whose writer is provably dead —
//! once per directory on the first write into it, and over a whole prefix at a service's start
//! ([`PosixTier::sweep_stale`]) — without ever touching a live writer's work.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, Mode, OFlags};
use stagehand_schemas::layout;

use super::{PosixTier, SWEPT_LIMIT, resolve};
use crate::error::{ErrorKind, Side, TransferError};
use crate::owner::{Liveness, Owner};

impl PosixTier {
    /// Records that `rel_dir` needs no look for stale temporaries. The record is bounded: at
    /// its limit it starts afresh, so a directory is read again at most once per
    /// [`SWEPT_LIMIT`] other directories written into.
    pub(super) fn mark_swept(&self, rel_dir: &str) {
        let mut swept = self.inner.swept.lock().unwrap_or_else(|p| p.into_inner());
        if swept.len() >= SWEPT_LIMIT {
            swept.clear();
        }
        swept.insert(rel_dir.to_owned());
    }

    /// The first time this tier writes into `rel_dir`, removes the temp files in it whose
    /// writers are provably dead (a killed copy of the same file, or of its neighbours).
    /// One `readdir` per directory per tier; a directory this tier created is never read.
    pub(super) fn sweep_dir_once(&self, rel_dir: &str, dir: &OwnedFd) {
        {
            let mut swept = self.inner.swept.lock().unwrap_or_else(|p| p.into_inner());
            if swept.contains(rel_dir) {
                return;
            }
            if swept.len() >= SWEPT_LIMIT {
                swept.clear();
            }
            swept.insert(rel_dir.to_owned());
        }
        match self.sweep_dir(dir, rel_dir, None, false) {
            Ok(found) => {
                if found.files_removed > 0 {
                    tracing::info!(
                        tier = self.name(),
                        dir = rel_dir,
                        files = found.files_removed,
                        bytes = found.bytes_removed,
                        "removed temp files of dead copies"
                    );
                }
                self.inner
                    .stale_files
                    .fetch_add(found.files_removed, Ordering::Relaxed);
                self.inner
                    .stale_bytes
                    .fetch_add(found.bytes_removed, Ordering::Relaxed);
            }
            // Garbage left for the next sweep is no reason to fail a copy.
            Err(e) => tracing::warn!(error = %e, "looking for stale temp files failed"),
        }
    }

    /// Removes every stale temporary beneath `prefix` (tier-relative, `""` for the whole
    /// tier) whose writer is provably dead — temp files always, staging folders of sets once
    /// older than [`SweepOptions::keep_sets_for`] — and says what it removed and what it
    /// left. Every service calls it at start on the tiers it writes, so a tier's usage never
    /// counts invisible garbage. The walk is confined like every other access: directories
    /// are opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from their parent and
    /// symlinks are never followed. A missing `prefix` is an empty report.
    pub fn sweep_stale(
        &self,
        prefix: &str,
        opts: SweepOptions,
    ) -> Result<SweepReport, TransferError> {
        self.sweep_stale_at(prefix, opts, true)
    }

    /// Like [`PosixTier::sweep_stale`], for the entries of `prefix` itself only: dead
    /// writers' temp files and staging folders directly in it are removed, its ordinary
    /// subfolders are not descended into. For a writer that stages its sets in one known
    /// folder (`stagehand ingest` in `<project>/<dataset>/`, beside published versions of
    /// millions of files it has no reason to walk).
    pub fn sweep_stale_entries(
        &self,
        prefix: &str,
        opts: SweepOptions,
    ) -> Result<SweepReport, TransferError> {
        self.sweep_stale_at(prefix, opts, false)
    }

    fn sweep_stale_at(
        &self,
        prefix: &str,
        opts: SweepOptions,
        descend: bool,
    ) -> Result<SweepReport, TransferError> {
        let fd = if prefix.is_empty() {
            self.inner.root_fd.clone()
        } else {
            self.check_path(prefix, Side::Destination)?;
            match rustix::fs::openat2(
                &*self.inner.root_fd,
                prefix,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                resolve(),
            ) {
                Ok(fd) => Arc::new(fd),
                Err(rustix::io::Errno::NOENT) => return Ok(SweepReport::default()),
                Err(e) => {
                    return Err(TransferError::from_errno(
                        e,
                        Side::Destination,
                        self.name(),
                        prefix,
                        "open directory",
                    ));
                }
            }
        };
        let report = self.sweep_dir(&fd, prefix, Some(opts), descend)?;
        tracing::info!(
            tier = self.name(),
            prefix,
            files = report.files_removed,
            bytes = report.bytes_removed,
            sets = report.sets_removed,
            sets_kept = report.sets_kept,
            live = report.live,
            unproven = report.unproven,
            "swept stale temporaries"
        );
        Ok(report)
    }

    /// Looks at the entries of one directory: removes dead writers' temp files; with `sets`,
    /// also handles staging folders, and with `descend` as well goes into ordinary
    /// subdirectories.
    fn sweep_dir(
        &self,
        dir: &OwnedFd,
        rel_dir: &str,
        sets: Option<SweepOptions>,
        descend: bool,
    ) -> Result<SweepReport, TransferError> {
        let io_err = |e: rustix::io::Errno, what: &str| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel_dir, what)
        };
        let mut report = SweepReport::default();
        let mut entries: Vec<(String, rustix::fs::FileType)> = Vec::new();
        let mut listing =
            rustix::fs::Dir::read_from(dir).map_err(|e| io_err(e, "read directory"))?;
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(|e| io_err(e, "read directory"))?;
            let Ok(name) = entry.file_name().to_str() else {
                continue;
            };
            if name == "." || name == ".." {
                continue;
            }
            let mut file_type = entry.file_type();
            if file_type == rustix::fs::FileType::Unknown {
                // Filesystems without `d_type` in their listings (some network ones).
                if let Ok(st) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                    file_type = rustix::fs::FileType::from_raw_mode(st.st_mode);
                }
            }
            entries.push((name.to_owned(), file_type));
        }
        drop(listing);
        let join = |name: &str| {
            if rel_dir.is_empty() {
                name.to_owned()
            } else {
                format!("{rel_dir}/{name}")
            }
        };
        for (name, file_type) in entries {
            match parse_temporary(&name) {
                Some(Temporary::File { owner, .. }) => match owner.liveness() {
                    Liveness::Dead => {
                        let size =
                            match rustix::fs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                            {
                                Ok(st) => st.st_size as u64,
                                Err(_) => 0,
                            };
                        match rustix::fs::unlinkat(dir, name.as_str(), AtFlags::empty()) {
                            Ok(()) => {
                                report.files_removed += 1;
                                report.bytes_removed += size;
                            }
                            Err(rustix::io::Errno::NOENT) => {}
                            Err(e) => return Err(io_err(e, &format!("remove {name}"))),
                        }
                    }
                    Liveness::Alive => report.live += 1,
                    Liveness::Unknown => report.unproven += 1,
                },
                Some(Temporary::Set { owner, .. }) => {
                    let Some(opts) = sets else { continue };
                    match owner.liveness() {
                        Liveness::Dead => {
                            let age =
                                rustix::fs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                                    .ok()
                                    .and_then(|st| {
                                        let mtime = std::time::UNIX_EPOCH
                                            + std::time::Duration::new(
                                                st.st_mtime.max(0) as u64,
                                                st.st_mtime_nsec as u32,
                                            );
                                        std::time::SystemTime::now().duration_since(mtime).ok()
                                    })
                                    .unwrap_or_default();
                            if age >= opts.keep_sets_for {
                                report.add(self.remove_tree_at(dir, &name, &join(&name))?);
                                report.sets_removed += 1;
                            } else {
                                // Kept for a resume; the file its writer was killed in the
                                // middle of is garbage either way.
                                report.sets_kept += 1;
                                if let Some(fd) = self.open_subdir(dir, &name, &join(&name))? {
                                    // Made read-only already if its run died just before
                                    // the rename.
                                    self.make_writable(&fd, &join(&name))?;
                                    report.add(self.sweep_dir(&fd, &join(&name), None, false)?);
                                }
                            }
                        }
                        Liveness::Alive => report.live += 1,
                        Liveness::Unknown => report.unproven += 1,
                    }
                }
                None if descend
                    && sets.is_some()
                    && file_type == rustix::fs::FileType::Directory =>
                {
                    if let Some(fd) = self.open_subdir(dir, &name, &join(&name))? {
                        report.add(self.sweep_dir(&fd, &join(&name), sets, true)?);
                    }
                }
                None => {}
            }
        }
        Ok(report)
    }

    /// Opens the subdirectory `name` of `dir` confined (`None` when it vanished).
    fn open_subdir(
        &self,
        dir: &OwnedFd,
        name: &str,
        rel: &str,
    ) -> Result<Option<OwnedFd>, TransferError> {
        match rustix::fs::openat2(
            dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            resolve(),
        ) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(TransferError::from_errno(
                e,
                Side::Destination,
                self.name(),
                rel,
                "open directory",
            )),
        }
    }

    /// Removes the directory `name` of `dir` and everything in it, confined (a symlink inside
    /// is removed as a link, never followed). Counts the regular files and their bytes.
    fn remove_tree_at(
        &self,
        dir: &OwnedFd,
        name: &str,
        rel: &str,
    ) -> Result<SweepReport, TransferError> {
        let io_err = |e: rustix::io::Errno, what: &str| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel, what)
        };
        let mut report = SweepReport::default();
        let Some(fd) = self.open_subdir(dir, name, rel)? else {
            return Ok(report);
        };
        // A published set's folders are read-only (0550): writable again just before their
        // entries go, by the owner that wrote them.
        self.make_writable(&fd, rel)?;
        let mut entries = Vec::new();
        let mut listing =
            rustix::fs::Dir::read_from(&fd).map_err(|e| io_err(e, "read directory"))?;
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(|e| io_err(e, "read directory"))?;
            let Ok(child) = entry.file_name().to_str() else {
                return Err(self.err(
                    ErrorKind::Io,
                    Side::Destination,
                    rel,
                    "holds a name that is not UTF-8; left in place",
                ));
            };
            if child != "." && child != ".." {
                entries.push((child.to_owned(), entry.file_type()));
            }
        }
        drop(listing);
        for (child, file_type) in entries {
            let child_rel = format!("{rel}/{child}");
            if file_type == rustix::fs::FileType::Directory {
                report.add(self.remove_tree_at(&fd, &child, &child_rel)?);
                continue;
            }
            let size = rustix::fs::statat(&fd, child.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .ok()
                .filter(|st| {
                    rustix::fs::FileType::from_raw_mode(st.st_mode)
                        == rustix::fs::FileType::RegularFile
                })
                .map(|st| st.st_size as u64);
            match rustix::fs::unlinkat(&fd, child.as_str(), AtFlags::empty()) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(rustix::io::Errno::ISDIR) => {
                    report.add(self.remove_tree_at(&fd, &child, &child_rel)?);
                    continue;
                }
                Err(e) => return Err(io_err(e, &format!("remove {child}"))),
            }
            if let Some(size) = size {
                report.files_removed += 1;
                report.bytes_removed += size;
            }
        }
        match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(report),
            Err(e) => Err(io_err(e, "remove directory")),
        }
    }

    /// Every entry beneath the folder `rel` that is not a folder (regular files, and links,
    /// FIFOs or sockets someone placed there), as paths relative to `rel` with `/` between
    /// components, in no particular order; `None` when the folder is not there. Confined as
    /// every open here: a symlink is listed as an entry, never followed. What a caller about
    /// to remove a folder compares with the list of what it copied.
    pub fn list_files(&self, rel: &str) -> Result<Option<Vec<String>>, TransferError> {
        let folder = match self.beneath(rel, false) {
            Ok(folder) => folder,
            Err(e) if e.kind == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        let root = folder
            .root_fd()
            .try_clone()
            .map_err(|e| TransferError::from_io(e, Side::Destination, self.name(), rel, "dup"))?;
        self.list_files_at(&root, rel, "", &mut out)?;
        Ok(Some(out))
    }

    fn list_files_at(
        &self,
        dir: &OwnedFd,
        rel: &str,
        within: &str,
        out: &mut Vec<String>,
    ) -> Result<(), TransferError> {
        let io_err = |e: rustix::io::Errno| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel, "read directory")
        };
        let mut entries = Vec::new();
        let mut listing = rustix::fs::Dir::read_from(dir).map_err(io_err)?;
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(io_err)?;
            let Ok(name) = entry.file_name().to_str() else {
                return Err(self.err(
                    ErrorKind::Io,
                    Side::Destination,
                    rel,
                    "holds a name that is not UTF-8",
                ));
            };
            if name != "." && name != ".." {
                entries.push((name.to_owned(), entry.file_type()));
            }
        }
        drop(listing);
        for (name, file_type) in entries {
            let path = if within.is_empty() {
                name.clone()
            } else {
                format!("{within}/{name}")
            };
            // Some filesystems do not say the type in the listing.
            let file_type = match file_type {
                rustix::fs::FileType::Unknown => {
                    rustix::fs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                        .map(|st| rustix::fs::FileType::from_raw_mode(st.st_mode))
                        .unwrap_or(file_type)
                }
                known => known,
            };
            if file_type != rustix::fs::FileType::Directory {
                out.push(path);
            } else if let Some(fd) = self.open_subdir(dir, &name, &format!("{rel}/{path}"))? {
                self.list_files_at(&fd, rel, &path, out)?;
            }
        }
        Ok(())
    }

    /// Removes the directory `rel` and everything beneath it, confined.
    pub fn remove_tree(&self, rel: &str) -> Result<SweepReport, TransferError> {
        self.check_path(rel, Side::Destination)?;
        let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        let parent_fd = self.dir_fd(parent, rel)?;
        self.forget_dirs();
        self.remove_tree_at(&parent_fd, name, rel)
    }
}

/// A temp-file name beside `name`: `.<name>.stagehand-<owner>-<n>.tmp`, unique within the
/// process (a counter) and across processes (the owner token; `O_EXCL` makes a collision
/// harmless anyway), and naming its writer so that it can later be proven stale.
pub(super) fn temp_name(name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        ".{}.stagehand-{}-{n:x}.tmp",
        layout::name_stem(name),
        Owner::current().token()
    )
}

/// The name of the hidden folder a set bound for `name` is staged in by `owner`:
/// `.<name>.stagehand-set-<owner>` (`stagehand_schemas::layout::staging_folder_name`).
pub(crate) fn staging_name(name: &str, owner: &Owner) -> String {
    layout::staging_folder_name(name, &owner.token())
}

/// Whether `name` (a final path component) is one of Stagehand's temp files.
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp") && name.contains(".stagehand-")
}

/// A temporary Stagehand left, recognised by its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Temporary {
    /// A temp file that would have become `final_name`.
    File { final_name: String, owner: Owner },
    /// A staging folder of a set bound for `final_name`.
    Set { final_name: String, owner: Owner },
}

/// Parses a temporary's name; names of older versions (no owner) are not recognised, so
/// nothing unprovable is ever removed.
pub(crate) fn parse_temporary(name: &str) -> Option<Temporary> {
    let rest = name.strip_prefix('.')?;
    if let Some((final_name, token)) = rest.rsplit_once(layout::STAGING_MARK) {
        return Some(Temporary::Set {
            final_name: final_name.to_owned(),
            owner: Owner::parse(token)?,
        });
    }
    let (final_name, tail) = rest.strip_suffix(".tmp")?.rsplit_once(".stagehand-")?;
    let (token, counter) = tail.rsplit_once('-')?;
    u64::from_str_radix(counter, 16).ok()?;
    Some(Temporary::File {
        final_name: final_name.to_owned(),
        owner: Owner::parse(token)?,
    })
}

/// What a sweep for stale temporaries found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Temp files of dead writers removed (including those inside removed staging folders).
    pub files_removed: u64,
    /// Their bytes (apparent size).
    pub bytes_removed: u64,
    /// Staging folders of dead writers removed (older than [`SweepOptions::keep_sets_for`]).
    pub sets_removed: u64,
    /// Staging folders of dead writers kept because a rerun may still resume them.
    pub sets_kept: u64,
    /// Temporaries of live writers, left alone.
    pub live: u64,
    /// Temporaries written on another machine or in another pid namespace: nothing can be
    /// proven about them from here, so they are left alone.
    pub unproven: u64,
}

impl SweepReport {
    fn add(&mut self, other: SweepReport) {
        self.files_removed += other.files_removed;
        self.bytes_removed += other.bytes_removed;
        self.sets_removed += other.sets_removed;
        self.sets_kept += other.sets_kept;
        self.live += other.live;
        self.unproven += other.unproven;
    }
}

/// How [`PosixTier::sweep_stale`] treats staging folders of dead writers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepOptions {
    /// A dead writer's staging folder younger than this (by its mtime) is kept: the rerun of
    /// the same set resumes from it instead of copying everything again. Older ones are
    /// removed. Temp files of dead writers are always removed.
    pub keep_sets_for: std::time::Duration,
}

impl Default for SweepOptions {
    fn default() -> Self {
        SweepOptions {
            keep_sets_for: std::time::Duration::from_secs(24 * 3600),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporaries_name_their_owner() {
        let me = Owner::current();
        let t = temp_name("data.bin");
        assert_eq!(
            parse_temporary(&t),
            Some(Temporary::File {
                final_name: "data.bin".into(),
                owner: me
            })
        );
        let s = staging_name("v1", &me);
        assert!(layout::is_staging_folder_name(&s) && !is_temp_name(&s));
        assert_eq!(
            parse_temporary(&s),
            Some(Temporary::Set {
                final_name: "v1".into(),
                owner: me
            })
        );
        // Names of older versions carry no owner and are never taken for stale.
        assert_eq!(parse_temporary(".x.stagehand-0123456789abcdef.tmp"), None);
        assert_eq!(parse_temporary("plain.tmp"), None);
    }

    #[test]
    fn temp_names_are_recognised_and_bounded() {
        let long = "x".repeat(255);
        let t = temp_name(&long);
        assert!(t.len() <= 255, "{}", t.len());
        assert!(is_temp_name(&t));
        assert!(!is_temp_name("data.tmp"));
        assert_ne!(temp_name("a"), temp_name("a"));
    }
}
