//! A set published with a [`SetAccess`] by a writer that is not root, as a service runs under
//! its own user: every file 0440 and folder 0550 with the project's group (the writer a member
//! of it), nothing readable by another user at any moment, and the read-only tree still
//! removable by the writer (the demoter's removal, the promoter's clean-up, the sweep) — which
//! root, bypassing permissions, would never show.
//!
//! The test runs itself a second time as an unprivileged user (`runuser`): the parent, as
//! root, makes the users and the group and checks the result as the other user; the child
//! does the mover's work.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use stagehand_mover::{
    CancellationToken, FileRef, Mover, MoverConfig, PosixTier, Progress, SetAccess, SetCopy, Tier,
};
use stagehand_testkit::{HostGroup, HostUser};

/// Set in the child: the folder to work in, and the project's gid.
const CHILD_DIR: &str = "STAGEHAND_ACCESS_TEST_DIR";
const CHILD_GID: &str = "STAGEHAND_ACCESS_TEST_GID";
const TEST: &str =
    "a_set_published_read_only_by_an_unprivileged_writer_is_its_groups_alone_and_still_removable";

const FILES: &[(&str, &[u8])] = &[
    ("a.bin", b"first file\n"),
    ("deep/er/b.bin", b"second file, two folders down\n"),
];

fn refs() -> Vec<FileRef> {
    FILES
        .iter()
        .map(|(p, b)| FileRef::new(*p, b.len() as u64, hex::encode(Sha256::digest(b))))
        .collect()
}

fn mode(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.mode() & 0o7777, m.gid())
}

/// Every folder and file of the set at `set` with its mode and group.
fn modes(set: &Path) -> Vec<(String, u32, u32)> {
    let mut out = Vec::new();
    for e in walkdir::WalkDir::new(set) {
        let e = e.unwrap();
        let (m, g) = mode(e.path());
        let rel = e.path().strip_prefix(set).unwrap().display().to_string();
        out.push((rel, m, g));
    }
    out.sort();
    out
}

/// The child, as the unprivileged writer: publishes the set twice (two versions), checks the
/// modes, then removes one read-only tree.
async fn child(dir: PathBuf, gid: u32) {
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let src = Tier::Posix(PosixTier::open("capacity", dir.join("capacity")).unwrap());
    let hot = PosixTier::open("hot", dir.join("hot")).unwrap();
    let dst = Tier::Posix(hot.clone()).with_access(Some(SetAccess::read_only(Some(gid))));
    for version in ["v1", "v2"] {
        let set = SetCopy {
            src_prefix: "lab-a/ds/v1".into(),
            dst_prefix: format!("lab-a/ds/{version}"),
            ..SetCopy::default()
        };
        let report = mover
            .copy_set(
                &src,
                &dst,
                &set,
                futures::stream::iter(refs()),
                &Progress::new(),
                &CancellationToken::new(),
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(report.copied, FILES.len() as u64);
        for (rel, m, g) in modes(&dir.join("hot/lab-a/ds").join(version)) {
            let want = if rel.ends_with(".bin") { 0o440 } else { 0o550 };
            assert_eq!((m, g), (want, gid), "{version}/{rel}");
        }
    }
    // The writer removes a read-only tree it published (as the demoter does after renaming it
    // out of the namespace): its folders are made writable just before their entries go.
    let removed = hot.remove_tree("lab-a/ds/v2").unwrap();
    assert_eq!(removed.files_removed, FILES.len() as u64);
    assert!(!dir.join("hot/lab-a/ds/v2").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_published_read_only_by_an_unprivileged_writer_is_its_groups_alone_and_still_removable()
 {
    if let (Ok(dir), Ok(gid)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_GID)) {
        return child(dir.into(), gid.parse().unwrap()).await;
    }
    let project = HostGroup::add();
    let service = HostUser::add(&[&project]);
    let member = HostUser::add(&[&project]);
    let other = HostUser::add(&[]);

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    for (p, b) in FILES {
        let path = dir.join("capacity/lab-a/ds/v1").join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b).unwrap();
    }
    std::fs::create_dir_all(dir.join("hot")).unwrap();
    std::os::unix::fs::chown(dir.join("hot"), Some(service.uid), Some(service.gid)).unwrap();

    // The test binary may lie beneath a folder the writer cannot enter (a clone in root's
    // home): the child runs from a copy of it that every user may execute.
    let bin = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = bin.path().join("access-test");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = service
        .command(&exe)
        .current_dir(bin.path())
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(CHILD_DIR, dir)
        .env(CHILD_GID, project.gid.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the writer as {}: {}\n{}",
        service.name,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let file = dir.join("hot/lab-a/ds/v1/deep/er/b.bin");
    let read = |user: &HostUser| user.run("cat", &[file.to_str().unwrap()]);
    let theirs = read(&member);
    assert!(
        theirs.status.success(),
        "a member of the project's group reads its data"
    );
    assert_eq!(theirs.stdout, FILES[1].1);
    let denied = read(&other);
    assert!(!denied.status.success(), "another user may not read it");
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    let listing = other.run("ls", &[dir.join("hot/lab-a/ds/v1").to_str().unwrap()]);
    assert!(!listing.status.success(), "nor list its folder");
    let written = member.run(
        "touch",
        &[dir.join("hot/lab-a/ds/v1/new").to_str().unwrap()],
    );
    assert!(!written.status.success(), "and nobody writes into it");
}
