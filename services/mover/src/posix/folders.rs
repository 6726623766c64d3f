//! Whole folders renamed or exchanged by one confined rename, and files linked in from
//! another tier on the same filesystem.

use std::os::fd::AsFd;

use rustix::fs::{AtFlags, RenameFlags};

use crate::error::{Side, TransferError};

use super::PosixTier;

impl PosixTier {
    /// Renames the directory `from` to `to` (both tier-relative; `to`'s parents are created
    /// confined) with `renameat2(RENAME_NOREPLACE)` between confined handles of the two
    /// parents, then `fsync`s both parents. `Ok(false)` when something is already at `to`
    /// (nothing was moved).
    pub fn rename_dir_noreplace(&self, from: &str, to: &str) -> Result<bool, TransferError> {
        self.rename_dir_with(
            from,
            to,
            RenameFlags::NOREPLACE,
            rustix::io::Errno::EXIST,
            "rename into place",
        )
    }

    /// Swaps the directories `from` and `to` (both tier-relative, both present) with one
    /// `renameat2(RENAME_EXCHANGE)` between confined handles of their parents, then `fsync`s
    /// both parents: a reader finds either the old folder or the new one whole under `to`,
    /// never neither. `Ok(false)` when `to` is not there (nothing was moved).
    pub fn exchange_dirs(&self, from: &str, to: &str) -> Result<bool, TransferError> {
        self.rename_dir_with(
            from,
            to,
            RenameFlags::EXCHANGE,
            rustix::io::Errno::NOENT,
            "exchange into place",
        )
    }

    /// One confined `renameat2(flags)` of the directory `from` to `to`, then `fsync` of both
    /// parents; `Ok(false)` when the rename fails with `refused` (nothing was moved).
    fn rename_dir_with(
        &self,
        from: &str,
        to: &str,
        flags: RenameFlags,
        refused: rustix::io::Errno,
        what: &str,
    ) -> Result<bool, TransferError> {
        self.check_path(from, Side::Destination)?;
        self.check_path(to, Side::Destination)?;
        let (from_parent, from_name) = from.rsplit_once('/').unwrap_or(("", from));
        let (to_parent, to_name) = to.rsplit_once('/').unwrap_or(("", to));
        let from_dir = self.dir_fd(from_parent, from)?;
        let to_dir = self.dir_fd(to_parent, to)?;
        match rustix::fs::renameat_with(from_dir.as_fd(), from_name, to_dir.as_fd(), to_name, flags)
        {
            Ok(()) => {}
            Err(e) if e == refused => return Ok(false),
            Err(e) => {
                return Err(TransferError::from_errno(
                    e,
                    Side::Destination,
                    self.name(),
                    to,
                    what,
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

    /// Removes the directory `rel` if it is empty (one confined `rmdir`, which the kernel
    /// refuses for a folder that holds anything, so nothing written meanwhile is lost):
    /// `Ok(false)` when it holds something or is gone.
    pub fn remove_dir_if_empty(&self, rel: &str) -> Result<bool, TransferError> {
        self.check_path(rel, Side::Destination)?;
        let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        let dir = match self.dir_fd(parent, rel) {
            Ok(d) => d,
            Err(e) if e.kind == crate::error::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        match rustix::fs::unlinkat(dir.as_fd(), name, AtFlags::REMOVEDIR) {
            Ok(()) => {
                self.forget_dirs();
                Ok(true)
            }
            Err(
                rustix::io::Errno::NOTEMPTY | rustix::io::Errno::EXIST | rustix::io::Errno::NOENT,
            ) => Ok(false),
            Err(e) => Err(TransferError::from_errno(
                e,
                Side::Destination,
                self.name(),
                rel,
                "remove an empty folder",
            )),
        }
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
}
