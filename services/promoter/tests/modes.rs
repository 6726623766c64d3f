//! Staged data is readable by its project only (issue 19, item 9): a version the real
//! promoter stages onto the hot tier is read-only and not world-readable — every file 0440,
//! every folder 0550, the project's group from tiers.toml's `[groups]` — so a job of another
//! project (another user of this host) can neither read nor list it, and the owning project's
//! job (a member of its group) reads it. Checked as second, unprivileged users (`runuser`).
//!
//! Before the fix the files were 0644 and the folders 0755: any job read any project's data.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;
use stagehand_testkit::{HostGroup, HostUser, wait_for};

/// Every folder and file beneath `set`, the set itself included, with mode and group.
fn modes(set: &Path) -> Vec<(String, u32, u32)> {
    let mut out = Vec::new();
    let mut todo = vec![set.to_owned()];
    while let Some(p) = todo.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        }
        let rel = p.strip_prefix(set).unwrap().display().to_string();
        out.push((rel, m.mode() & 0o7777, m.gid()));
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staged_version_is_read_only_and_readable_by_its_projects_group_alone() {
    let group = HostGroup::add();
    let member = HostUser::add(&[&group]);
    let other = HostUser::add(&[]);

    let mut stack = Stack::start().await;
    // Other users reach the tiers through the test's folder, as jobs reach a mounted tier.
    std::fs::set_permissions(stack.root(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let tiers = stack.policies.join("tiers.toml");
    let mut text = std::fs::read_to_string(&tiers).unwrap();
    text.push_str(&format!("\n[groups]\n{PROJECT} = \"{}\"\n", group.name));
    std::fs::write(&tiers, text).unwrap();
    stack.run_promoter(stack.promoter_config("a"));

    let files = [
        ("train/0001.jpg", bytes(1, 10_000)),
        ("train/deep/0002.jpg", bytes(2, 300_000)),
        ("labels.csv", b"id,label\n1,cat\n".to_vec()),
    ];
    let (prefix, refs) = stack.put_files("capacity", "cats", "v1", &files);
    let version = stack.validated("cats", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();
    let request = stage_request("cats", &version, "hot", "job-1", None, None);
    stack.publish(&request).await;
    let ready = wait_for(WAIT, "stage.ready", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap();
    let set = std::path::PathBuf::from(ready_path(&ready));

    let found = modes(&set);
    assert_eq!(
        found.len(),
        3 + 3,
        "three files, the set's folder and two beneath it"
    );
    for (rel, mode, gid) in &found {
        let want = if rel.contains('.') { 0o440 } else { 0o550 };
        assert_eq!((*mode, *gid), (want, group.gid), "{rel:?}");
    }

    let file = set.join("train/deep/0002.jpg");
    let file = file.to_str().unwrap();
    let mine = member.run("cat", &[file]);
    assert!(
        mine.status.success(),
        "the owning project's job reads its data: {}",
        String::from_utf8_lossy(&mine.stderr)
    );
    assert_eq!(mine.stdout, files[1].1);
    let theirs = other.run("cat", &[file]);
    assert!(
        !theirs.status.success(),
        "a job of another project may not read it"
    );
    assert!(String::from_utf8_lossy(&theirs.stderr).contains("Permission denied"));
    let listing = other.run("ls", &[set.to_str().unwrap()]);
    assert!(!listing.status.success(), "nor list the version's folder");
    stack.stop().await;
}
