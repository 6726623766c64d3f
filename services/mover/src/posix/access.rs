//! Who may read a set once it is published on a posix tier: the modes and group its files and
//! folders get before the rename that makes it visible, and making a published (read-only)
//! tree writable again just before it is removed.
//!
//! Staged data on the hot and local tiers is read by jobs of many projects on the same nodes.
//! A set published with a [`SetAccess`] is read-only and readable by its project's group only
//! (files 0440, folders 0550 as shipped): the staging folder is made private to the writer
//! (0700) as soon as it exists, so nothing in it is reachable by anyone else while it is
//! filled; then every file and folder in it gets its mode and group, and only then is it
//! renamed to its final name. Nothing is ever visible with wider rights.
//!
//! Setting a group needs the right to: the writer is root, holds `CAP_CHOWN`, or is a member of
//! the group (an owner may give its files to a group it belongs to).

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{AtFlags, Gid, Mode, OFlags};

use super::{PosixTier, resolve};
use crate::error::{ErrorKind, Side, TransferError};

/// The mode, and the group, every file and folder of a published set gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetAccess {
    /// Permission bits of each file (0440: owner and group read, nothing else).
    pub file_mode: u32,
    /// Permission bits of each folder, the set's own included (0550).
    pub dir_mode: u32,
    /// The group given every file and folder (a project's group); `None` keeps the writer's.
    pub gid: Option<u32>,
}

impl SetAccess {
    /// Read-only for the owner and `gid`, nothing for anyone else: files 0440, folders 0550.
    pub fn read_only(gid: Option<u32>) -> SetAccess {
        SetAccess {
            file_mode: 0o440,
            dir_mode: 0o550,
            gid,
        }
    }
}

/// The mode a staging folder of a restricted set has while it is filled: the writer's alone.
pub(crate) const PRIVATE_DIR_MODE: u32 = 0o700;

impl PosixTier {
    /// Gives everything beneath the directory `dir` (open, at tier-relative `rel`) the modes
    /// and group of `access`, deepest first, and `dir` itself its group — and its mode too
    /// with `own_mode` (a set's own folder gets its mode only once renamed into place: a
    /// read-only folder cannot move to another parent). Only regular files and folders are
    /// expected (the writer's own staging folder, private while filled); anything else is
    /// refused as a `DestinationConflict`, never followed.
    pub(crate) fn apply_access(
        &self,
        dir: &OwnedFd,
        rel: &str,
        access: &SetAccess,
        own_mode: bool,
    ) -> Result<(), TransferError> {
        let err = |e: rustix::io::Errno, what: &str| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel, what)
        };
        let gid = access.gid.map(Gid::from_raw);
        for (name, file_type) in self.entries_of(dir, rel)? {
            let child_rel = format!("{rel}/{name}");
            match file_type {
                rustix::fs::FileType::Directory => {
                    let child = rustix::fs::openat2(
                        dir,
                        name.as_str(),
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                        Mode::empty(),
                        resolve(),
                    )
                    .map_err(|e| err(e, "open directory"))?;
                    self.apply_access(&child, &child_rel, access, true)?;
                }
                rustix::fs::FileType::RegularFile => {
                    if gid.is_some() {
                        rustix::fs::chownat(
                            dir,
                            name.as_str(),
                            None,
                            gid,
                            AtFlags::SYMLINK_NOFOLLOW,
                        )
                        .map_err(|e| {
                            TransferError::from_errno(
                                e,
                                Side::Destination,
                                self.name(),
                                &child_rel,
                                "give the file to its project's group",
                            )
                        })?;
                    }
                    // The type was just read in a folder only the writer can reach.
                    rustix::fs::chmodat(
                        dir,
                        name.as_str(),
                        Mode::from_raw_mode(access.file_mode),
                        AtFlags::empty(),
                    )
                    .map_err(|e| {
                        TransferError::from_errno(
                            e,
                            Side::Destination,
                            self.name(),
                            &child_rel,
                            "set the file's mode",
                        )
                    })?;
                }
                other => {
                    return Err(TransferError::new(
                        ErrorKind::DestinationConflict,
                        Side::Destination,
                        self.name(),
                        &child_rel,
                        format!(
                            "{} is in a set's staging folder; only files and folders are published",
                            super::describe_type(other)
                        ),
                    ));
                }
            }
        }
        if gid.is_some() {
            rustix::fs::fchown(dir, None, gid)
                .map_err(|e| err(e, "give the folder to its project's group"))?;
        }
        if own_mode {
            self.set_dir_mode(dir, rel, access)?;
        }
        Ok(())
    }

    /// Gives the open directory `dir` the folder mode of `access`.
    pub(crate) fn set_dir_mode(
        &self,
        dir: &OwnedFd,
        rel: &str,
        access: &SetAccess,
    ) -> Result<(), TransferError> {
        rustix::fs::fchmod(dir, Mode::from_raw_mode(access.dir_mode)).map_err(|e| {
            TransferError::from_errno(
                e,
                Side::Destination,
                self.name(),
                rel,
                "set the folder's mode",
            )
        })
    }

    /// Makes the directory `dir` (at tier-relative `rel`) writable and searchable by its owner
    /// when it is not (a published set's folders are read-only): what removing its entries, or
    /// writing into a staging folder again, needs. Only an owner (or `CAP_FOWNER`) may.
    pub(crate) fn make_writable(&self, dir: &OwnedFd, rel: &str) -> Result<(), TransferError> {
        let st = rustix::fs::fstat(dir).map_err(|e| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel, "fstat")
        })?;
        let mode = st.st_mode & 0o7777;
        if mode & PRIVATE_DIR_MODE == PRIVATE_DIR_MODE {
            return Ok(());
        }
        rustix::fs::fchmod(dir, Mode::from_raw_mode(mode | PRIVATE_DIR_MODE)).map_err(|e| {
            TransferError::from_errno(
                e,
                Side::Destination,
                self.name(),
                rel,
                "make the read-only folder writable to remove it",
            )
        })
    }

    /// Makes every folder of the tree at `dir` writable by its owner again (a staging folder
    /// a dead run had already made read-only before it was killed, now resumed).
    pub(crate) fn make_tree_writable(&self, dir: &OwnedFd, rel: &str) -> Result<(), TransferError> {
        self.make_writable(dir, rel)?;
        for (name, file_type) in self.entries_of(dir, rel)? {
            if file_type != rustix::fs::FileType::Directory {
                continue;
            }
            let child_rel = format!("{rel}/{name}");
            let child = rustix::fs::openat2(
                dir.as_fd(),
                name.as_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::empty(),
                resolve(),
            )
            .map_err(|e| {
                TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    &child_rel,
                    "open directory",
                )
            })?;
            self.make_tree_writable(&child, &child_rel)?;
        }
        Ok(())
    }

    /// The entries of an open directory with their types (from the listing, or `statat` where
    /// the filesystem does not say).
    fn entries_of(
        &self,
        dir: &OwnedFd,
        rel: &str,
    ) -> Result<Vec<(String, rustix::fs::FileType)>, TransferError> {
        let err = |e: rustix::io::Errno| {
            TransferError::from_errno(e, Side::Destination, self.name(), rel, "read directory")
        };
        let mut out = Vec::new();
        let mut listing = rustix::fs::Dir::read_from(dir).map_err(err)?;
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(err)?;
            let Ok(name) = entry.file_name().to_str() else {
                return Err(TransferError::new(
                    ErrorKind::Io,
                    Side::Destination,
                    self.name(),
                    rel,
                    "holds a name that is not UTF-8",
                ));
            };
            if name == "." || name == ".." {
                continue;
            }
            let mut file_type = entry.file_type();
            if file_type == rustix::fs::FileType::Unknown {
                file_type = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
                    .map(|st| rustix::fs::FileType::from_raw_mode(st.st_mode))
                    .map_err(err)?;
            }
            out.push((name.to_owned(), file_type));
        }
        Ok(out)
    }
}
