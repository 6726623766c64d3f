//! What the filesystem under a posix tier's root can still take: the one definition the
//! promoter admits a copy by and `stagehand tier pool` reports. A tier on Lustre, WEKA or
//! CephFS is shared with writers outside Stagehand, so its policy capacity says nothing of the
//! room actually left; `fstatvfs` of the open root does.

use crate::error::{Side, TransferError};

use super::PosixTier;

impl PosixTier {
    /// Bytes an unprivileged writer may still write to the filesystem under the root:
    /// `f_bavail * f_frsize` of `fstatvfs` on the root held open, what `df` shows as available
    /// (the blocks a filesystem keeps for root are left out: the jobs reading the data do not
    /// run as root, and neither need the services). `None` when the filesystem reports no
    /// size at all (`f_blocks` 0, as procfs and FUSE filesystems without `statfs` do): that
    /// says nothing of its room, and taking it for "full" would refuse every copy.
    pub fn available_bytes(&self) -> Result<Option<u64>, TransferError> {
        let s = rustix::fs::fstatvfs(self.root_fd()).map_err(|e| {
            let mut err = TransferError::from_errno(
                e,
                Side::Destination,
                self.name(),
                "",
                "statvfs of tier root",
            );
            err.detail = format!("statvfs of tier root {}: {e}", self.root().display());
            err
        })?;
        if s.f_blocks == 0 {
            return Ok(None);
        }
        Ok(Some(s.f_bavail.saturating_mul(s.f_frsize)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// On an ordinary directory the figure agrees with `statvfs` of its path, within what
    /// others (this very build, say) wrote between the two calls.
    #[test]
    fn available_bytes_agrees_with_statvfs_of_the_root_path() {
        let dir = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("scratch", dir.path()).unwrap();
        let available = tier
            .available_bytes()
            .unwrap()
            .expect("a disk reports its size");
        let s = rustix::fs::statvfs(dir.path()).unwrap();
        assert!(available > 0);
        assert!(
            available <= s.f_blocks * s.f_frsize,
            "{available} > the disk"
        );
        let again = s.f_bavail * s.f_frsize;
        assert!(
            available.abs_diff(again) < 256 * MIB,
            "{available} vs {again}"
        );
    }

    /// A filesystem that reports no size (procfs) is not taken for a full one.
    #[test]
    fn a_filesystem_that_reports_no_size_has_no_figure() {
        let tier = PosixTier::open("proc", "/proc").unwrap();
        assert_eq!(tier.available_bytes().unwrap(), None);
    }
}
