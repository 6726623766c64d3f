//! A promoter process killed with SIGKILL in the middle of a copy leaves nothing visible on
//! the tier, and after a restart the request completes without copying again the files that
//! were already in place and verified.

mod common;

use std::os::unix::fs::MetadataExt;

use common::*;
use stagehand_testkit::wait_for;

/// The files in the hidden staging folders beside `dir`'s children (`.<name>.stagehand-set-…`).
fn staged_files(dir: &std::path::Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for entry in list(dir) {
        if entry.starts_with('.') && entry.contains("stagehand-set") {
            for f in list(&dir.join(&entry)) {
                if !f.starts_with('.')
                    && let Ok(m) = std::fs::metadata(dir.join(&entry).join(&f))
                {
                    out.push((f, m.ino()));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_promoter_killed_mid_copy_leaves_nothing_visible_and_resumes_without_recopying() {
    let stack = Stack::start().await;
    let js = stack.bus.jetstream().clone();
    // Files of 1 MiB and more are published one by one inside the staging folder (smaller
    // ones a batch at a time), so a kill finds whole files there to resume from.
    let files: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| (format!("part-{i:02}.bin"), bytes(i as u8, 1 << 20)))
        .collect();
    let borrowed: Vec<(&str, Vec<u8>)> =
        files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
    let (prefix, refs) = stack.put_files("capacity", "crashme", "v1", &borrowed);
    let version = stack.validated("crashme", "capacity", &prefix, &refs).await;
    let parent = stack.tier("hot").join(format!("{PROJECT}/crashme"));

    // Slow enough (2 MiB/s, six seconds for the set) to be killed half-way.
    let mut first = spawn(&stack, "first", Some(2 << 20), &[]);
    let request = stage_request("crashme", &version, "hot", "job-k", None, None);
    stack.publish(&request).await;
    let before = wait_for(WAIT, "a few files staged", || async {
        let staged = staged_files(&parent);
        (staged.len() >= 3).then_some(staged)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "first")));
    first.kill();
    // Nothing visible: only the hidden staging folder.
    assert!(!parent.join(&version).exists());
    assert!(answers(&js, "stage.ready", &request.id).await.is_empty());

    let mut second = spawn(&stack, "second", None, &[]);
    let ready = wait_for(WAIT, "stage.ready after the restart", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "second")));
    let published = parent.join(&version);
    assert_eq!(ready_path(&ready), published.display().to_string());
    for (path, content) in &files {
        assert_eq!(
            &std::fs::read(published.join(path)).unwrap(),
            content,
            "{path}"
        );
    }
    // The files the first run had finished are the very same files (same inodes): verified
    // again, not copied again.
    for (name, ino) in &before {
        let now = std::fs::metadata(published.join(name)).unwrap().ino();
        assert_eq!(now, *ino, "{name} was copied again");
    }
    assert_eq!(
        list(&parent),
        vec![version.clone()],
        "no staging folder left"
    );
    assert_eq!(facts(&js, "replica.created").await.len(), 1);
    assert!(before.len() < files.len(), "killed before the end");
    second.kill();
    stack.stop().await;
}
