//! The mover's part of the work metrics (issue 18 item 2): bytes and files moved and the copy
//! throughput, per tier pair and priority class, counted only for copies that moved bytes.

use std::path::Path;

use sha2::{Digest, Sha256};
use stagehand_mover::{
    CopyOptions, FileRef, Mover, MoverConfig, PosixTier, Priority, Progress, Tier,
};
use stagehand_telemetry::names;

fn write(root: &Path, rel: &str, bytes: &[u8]) -> FileRef {
    std::fs::write(root.join(rel), bytes).unwrap();
    FileRef::new(rel, bytes.len() as u64, hex::encode(Sha256::digest(bytes)))
}

use stagehand_testkit::scrape_sample as sample;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_count_bytes_and_files_per_tier_pair_and_class_and_skips_count_nothing() {
    let handle = stagehand_telemetry::metrics::install();
    let dir = tempfile::tempdir().unwrap();
    let (src_root, dst_root) = (dir.path().join("src"), dir.path().join("dst"));
    std::fs::create_dir_all(&src_root).unwrap();
    std::fs::create_dir_all(&dst_root).unwrap();
    // Tier names unique to this test, so its series are its own.
    let src = Tier::Posix(PosixTier::open("metrics-src", &src_root).unwrap());
    let dst = Tier::Posix(PosixTier::open("metrics-dst", &dst_root).unwrap());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let big = write(&src_root, "big", &vec![7u8; 2 << 20]);
    let small: Vec<FileRef> = (0..3)
        .map(|i| write(&src_root, &format!("small-{i}"), &[i as u8; 100]))
        .collect();
    let stage = CopyOptions {
        priority: Priority::Stage,
        ..CopyOptions::default()
    };
    let backup = CopyOptions {
        priority: Priority::Backup,
        ..CopyOptions::default()
    };

    mover.copy(&src, &dst, &big, &stage).await.unwrap();
    let report = mover
        .copy_all(&src, &dst, &small, &backup, &Progress::new())
        .await;
    assert_eq!(report.files_copied, 3, "{report:?}");
    // Copied again: every file is already there and verified, so nothing more is counted.
    mover.copy(&src, &dst, &big, &stage).await.unwrap();
    mover
        .copy_all(&src, &dst, &small, &backup, &Progress::new())
        .await;

    let scrape = handle.render();
    let pair =
        |class: &str| format!(r#"from_tier="metrics-src",to_tier="metrics-dst",class="{class}""#);
    assert_eq!(
        sample(&scrape, names::BYTES_MOVED_TOTAL, &pair("stage")),
        Some((2 << 20) as f64),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::FILES_MOVED_TOTAL, &pair("stage")),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::BYTES_MOVED_TOTAL, &pair("backup")),
        Some(300.0),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::FILES_MOVED_TOTAL, &pair("backup")),
        Some(3.0),
        "{scrape}"
    );
    // The 2 MiB copy is observed in the throughput histogram; the 300-byte batch is not.
    let count = format!("{}_count", names::COPY_THROUGHPUT);
    assert_eq!(
        sample(&scrape, &count, &pair("stage")),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(sample(&scrape, &count, &pair("backup")), None, "{scrape}");
}
