//! A small tmpfs for tests of what happens when a disk fills up: mounted on a directory of
//! the caller's, filled to the last byte on demand, emptied again, unmounted on drop.
//! Mounting needs root (the tests that use it run as root in CI and in the dev container).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A mounted tmpfs. Unmounted (lazily, so that a file still open does not keep it) on drop.
#[derive(Debug)]
pub struct Tmpfs {
    dir: PathBuf,
    filler: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (a `mount -o size=` value such as `"2m"`) on `dir`, creating
    /// the directory. Panics, saying that root is needed, when mounting fails.
    pub fn mount(dir: impl AsRef<Path>, size: &str) -> Tmpfs {
        let dir = dir.as_ref().to_owned();
        std::fs::create_dir_all(&dir).expect("create the tmpfs mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("running mount");
        assert!(
            status.success(),
            "mounting a tmpfs on {} needs root",
            dir.display()
        );
        let filler = dir.join(".filler");
        Tmpfs { dir, filler }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes a filler file until the filesystem has no byte left; returns its size.
    pub fn fill(&self) -> u64 {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.filler)
            .expect("create the filler file");
        let block = vec![0xa5u8; 4096];
        loop {
            match f.write(&block) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling {}: {e}", self.dir.display()),
            }
        }
        // Whatever is left is smaller than a block: take it byte by byte.
        while let Ok(1) = f.write(&block[..1]) {}
        let _ = f.sync_all();
        std::fs::metadata(&self.filler)
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// Removes the filler file: the space is back.
    pub fn free(&self) {
        let _ = std::fs::remove_file(&self.filler);
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}
