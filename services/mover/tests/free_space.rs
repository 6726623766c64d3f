//! [`PosixTier::available_bytes`] on a filesystem of its own (a tmpfs of a few MiB; mounting
//! needs root, as in CI): the figure the promoter admits a copy by and `stagehand tier pool`
//! caps a pool's free space with.

use stagehand_mover::PosixTier;
use stagehand_testkit::Tmpfs;

const MIB: u64 = 1 << 20;

/// The figure is the filesystem's whole size while it is empty and drops by exactly what
/// another writer puts there (the tier's policy capacity plays no part), seen through the
/// root and through a folder beneath it alike, down to nothing when it is full.
#[test]
fn available_bytes_is_what_the_filesystem_under_the_root_can_still_take() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Tmpfs::mount(dir.path().join("hot"), "4m");
    let tier = PosixTier::open("hot", disk.path()).unwrap();
    assert_eq!(tier.available_bytes().unwrap(), Some(4 * MIB));
    std::fs::write(disk.path().join("others.bin"), vec![7u8; MIB as usize]).unwrap();
    assert_eq!(tier.available_bytes().unwrap(), Some(3 * MIB));
    let below = tier.beneath("lab/cats", true).unwrap();
    assert_eq!(below.available_bytes().unwrap(), Some(3 * MIB));
    disk.fill();
    assert_eq!(tier.available_bytes().unwrap(), Some(0));
    disk.free();
    assert_eq!(tier.available_bytes().unwrap(), Some(3 * MIB));
}
