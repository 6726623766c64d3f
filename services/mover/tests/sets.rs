//! Whole sets published atomically on posix ([`Mover::copy_set`] / [`Mover::stage_set`]):
//! visible complete or not at all, streamed in bounded chunks, a corrupt file failing the set
//! by name, cancellation, a final name chosen after staging (ingest), and confinement against
//! a symlink planted in the shared root. Killed-process resumes are in `cp_command.rs`.

use std::path::Path;

use sha2::{Digest, Sha256};
use stagehand_mover::{
    CancellationToken, CopyOptions, EngineChoice, ErrorKind, FileRef, Mover, MoverConfig,
    PosixTier, Progress, SetCopy, Tier, VerifyMode,
};
use stagehand_schemas::Retryable;

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn write(root: &Path, rel: &str, bytes: &[u8]) -> FileRef {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    FileRef::new(rel, bytes.len() as u64, sha(bytes))
}

/// Every entry beneath `root` (files and folders, hidden ones included), relative, sorted.
fn listing(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = walkdir::WalkDir::new(root)
        .min_depth(1)
        .into_iter()
        .map(|e| e.unwrap())
        .map(|e| {
            e.path()
                .strip_prefix(root)
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    v.sort();
    v
}

/// `n` files of a few KiB to 300 KiB in nested folders, with their recorded hashes.
fn source(dir: &Path, n: u64) -> Vec<FileRef> {
    (0..n)
        .map(|i| {
            write(
                dir,
                &format!("shard-{}/part-{i:04}.bin", i % 7),
                &data(i, 1000 + (i as usize % 13) * 23_000),
            )
        })
        .collect()
}

fn tiers(src: &Path, dst: &Path) -> (Tier, Tier, PosixTier) {
    let d = PosixTier::open("hot", dst).unwrap();
    (
        Tier::Posix(PosixTier::open("capacity", src).unwrap()),
        Tier::Posix(d.clone()),
        d,
    )
}

fn set_of(dst_prefix: &str, verify: VerifyMode) -> SetCopy {
    SetCopy {
        src_prefix: "lab/v1".into(),
        dst_prefix: dst_prefix.into(),
        opts: CopyOptions {
            verify_destination: verify,
            ..CopyOptions::default()
        },
        chunk_files: 64,
        totals: None,
    }
}

/// 300 files streamed in chunks of 64 appear at once under the final name, every byte
/// verified, with progress counted and each file reported in stream order; a rerun finds the
/// set present and reads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_appears_whole_under_its_final_name() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 300);
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let pread = Mover::new(MoverConfig {
        engine: EngineChoice::Pread,
        ..MoverConfig::default()
    })
    .unwrap();
    let progress = Progress::new();
    let mut seen = Vec::new();
    // Each engine once, with each verification mode.
    for (mover, verify) in [
        (&mover, VerifyMode::HashedInFlight),
        (&pread, VerifyMode::ReadBack),
    ] {
        let prefix = format!("proj/ds/{verify}");
        let report = mover
            .copy_set(
                &src,
                &dst,
                &set_of(&prefix, verify),
                futures::stream::iter(files.clone()),
                &progress,
                &CancellationToken::new(),
                |f| seen.push(f.clone()),
            )
            .await
            .unwrap();
        assert_eq!(
            (report.files, report.copied, report.skipped, report.existed),
            (300, 300, 0, false)
        );
        assert_eq!(
            report.bytes_copied,
            files.iter().map(|f| f.size).sum::<u64>()
        );
        for f in &files {
            let landed = std::fs::read(dst_dir.path().join(&prefix).join(&f.path)).unwrap();
            assert_eq!(sha(&landed), f.sha256, "{}", f.path);
        }
    }
    assert_eq!(seen.len(), 600);
    assert_eq!(
        &seen[..300],
        &files[..],
        "reported in stream order, hashes proven"
    );
    assert_eq!((progress.files_done(), progress.files_total()), (600, 600));
    // Nothing but the two sets: no staging folder, no temp file.
    let top = listing(&dst_dir.path().join("proj/ds"));
    assert_eq!(
        top.iter().filter(|e| !e.contains('/')).count(),
        2,
        "{top:?}"
    );
    assert!(top.iter().all(|e| !e.contains(".stagehand-")), "{top:?}");

    // Found in place, the set is not taken on its name: every file is read and verified,
    // nothing is copied or published.
    let mut verified = 0;
    let again = mover
        .copy_set(
            &src,
            &dst,
            &set_of("proj/ds/hashed-in-flight", VerifyMode::HashedInFlight),
            futures::stream::iter(files.clone()),
            &Progress::new(),
            &CancellationToken::new(),
            |_| verified += 1,
        )
        .await
        .unwrap();
    assert!(again.existed);
    assert_eq!(
        (again.files, again.copied, again.skipped, again.replaced),
        (300, 0, 300, 0)
    );
    assert_eq!(verified, 300);
    let top = listing(&dst_dir.path().join("proj/ds"));
    assert!(top.iter().all(|e| !e.contains(".stagehand-")), "{top:?}");
}

/// Guards issue 19's trusted set: a set already under its final name with two files of the
/// same size but other bytes, one missing and one the list does not name is not taken for the
/// copy: the three wrong files are replaced by verified copies, the set swapped in whole in
/// one exchange of folders (the stray file goes with the old folder), and no staging folder is
/// left beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_set_found_in_place_is_replaced_by_a_verified_one() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 40);
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let found = dst_dir.path().join("proj/ds/v1");
    for (i, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(src_dir.path().join("lab/v1").join(&f.path)).unwrap();
        match i {
            3 | 17 => {
                let last = bytes.len() - 1;
                bytes[last] ^= 0xff;
            }
            29 => continue,
            _ => {}
        }
        let path = found.join(&f.path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
    std::fs::write(found.join("stray.bin"), b"not in the list").unwrap();
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let report = mover
        .copy_set(
            &src,
            &dst,
            &set_of("proj/ds/v1", VerifyMode::ReadBack),
            futures::stream::iter(files.clone()),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap();
    assert!(!report.existed);
    assert_eq!(
        (report.files, report.replaced, report.copied, report.skipped),
        (40, 3, 3, 37)
    );
    for f in &files {
        let landed = std::fs::read(found.join(&f.path)).unwrap();
        assert_eq!(sha(&landed), f.sha256, "{}", f.path);
    }
    assert!(!found.join("stray.bin").exists());
    let top = listing(&dst_dir.path().join("proj/ds"));
    assert!(top.iter().all(|e| !e.contains(".stagehand-")), "{top:?}");
}

/// A source file whose bytes do not match its recorded hash fails the whole set with that
/// file named; nothing appears under the final name, and the staging folder stays hidden.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_source_file_fails_the_set_and_nothing_is_visible() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut files = source(&src_dir.path().join("lab/v1"), 100);
    files[77].sha256 = sha(b"what the manifest promised");
    let bad = files[77].path.clone();
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let err = mover
        .copy_set(
            &src,
            &dst,
            &set_of("proj/ds/v1", VerifyMode::HashedInFlight),
            futures::stream::iter(files),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
    assert_eq!(err.path, bad);
    assert!(!err.is_retryable());
    assert!(!dst_dir.path().join("proj/ds/v1").exists());
    let parent = listing(&dst_dir.path().join("proj/ds"));
    let top: Vec<&String> = parent.iter().filter(|e| !e.contains('/')).collect();
    assert_eq!(top.len(), 1, "{top:?}");
    assert!(top[0].starts_with(".v1.stagehand-set-"), "{top:?}");
}

/// A set cancelled by its caller publishes nothing; a later run resumes the staging folder
/// this process left and copies only the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_set_publishes_nothing_and_resumes_later() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 200);
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let cancel = CancellationToken::new();
    let mut reported = 0;
    // Cancelled from the file callback once the first chunk of 64 is in.
    let err = mover
        .copy_set(
            &src,
            &dst,
            &set_of("proj/ds/v1", VerifyMode::HashedInFlight),
            futures::stream::iter(files.clone()),
            &Progress::new(),
            &cancel,
            |_| {
                reported += 1;
                if reported == 64 {
                    cancel.cancel();
                }
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Cancelled, "{err}");
    assert_eq!(reported, 64);
    assert!(!dst_dir.path().join("proj/ds/v1").exists());

    let report = mover
        .copy_set(
            &src,
            &dst,
            &set_of("proj/ds/v1", VerifyMode::HashedInFlight),
            futures::stream::iter(files),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!((report.copied, report.skipped), (136, 64));
    assert!(report.resumed);
}

/// `files` listed without their hashes, and the set named `name` that measures them while it
/// copies: how ingest and a checkpoint part's offload list what they copy.
fn listed_unhashed(files: &[FileRef], name: &str) -> (Vec<FileRef>, SetCopy) {
    let unknown = (files.iter())
        .map(|f| FileRef::new(f.path.clone(), f.size, ""))
        .collect();
    let set = SetCopy {
        opts: CopyOptions {
            expected_hash_unknown: true,
            ..CopyOptions::default()
        },
        ..set_of(name, VerifyMode::HashedInFlight)
    };
    (unknown, set)
}

/// Ingest's shape: hashes unknown (measured while copying), the final name (the version
/// digest) known only after every file is staged. Publishing the same content again finds
/// the name taken and removes the second staging folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_staged_with_unknown_hashes_is_published_under_a_name_chosen_after() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 40);
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let (unknown, set) = listed_unhashed(&files, "proj/ds/upload-1");
    for round in 0..2 {
        let mut measured = Vec::new();
        let staged = mover
            .stage_set(
                &src,
                &dst,
                &set,
                futures::stream::iter(unknown.clone()),
                &Progress::new(),
                &CancellationToken::new(),
                |f| measured.push(f.clone()),
            )
            .await
            .unwrap();
        assert_eq!(measured, files, "measured hashes are the real ones");
        let digest = sha(measured
            .iter()
            .map(|f| format!("{}\t{}\t{}\n", f.path, f.size, f.sha256))
            .collect::<String>()
            .as_bytes());
        let report = staged
            .publish_as(&format!("proj/ds/{}", &digest[..16]))
            .await
            .unwrap();
        assert_eq!(report.existed, round == 1);
        let names = listing(&dst_dir.path().join("proj/ds"));
        let top: Vec<&String> = names.iter().filter(|e| !e.contains('/')).collect();
        assert_eq!(top, vec![&digest[..16].to_owned()], "round {round}");
    }
}

/// Regression (issue 6 item 9): staging folders were made with `create_dir_all` and renamed
/// with `std::fs::rename` on path strings, which follow a symlink planted in the shared root.
/// Through confined handles the planted link is refused and nothing lands outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_planted_in_the_shared_root_cannot_redirect_a_set() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let outside = tempfile::tempdir().unwrap();
    let files = source(&src_dir.path().join("lab/v1"), 5);
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    // Another tenant plants `proj -> outside` (at the project level) and, in a second case,
    // `other/ds -> outside` (at the dataset level).
    std::os::unix::fs::symlink(outside.path(), dst_dir.path().join("proj")).unwrap();
    std::fs::create_dir(dst_dir.path().join("other")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dst_dir.path().join("other/ds")).unwrap();
    for prefix in ["proj/ds/v1", "other/ds/v1"] {
        let err = mover
            .copy_set(
                &src,
                &dst,
                &set_of(prefix, VerifyMode::HashedInFlight),
                futures::stream::iter(files.clone()),
                &Progress::new(),
                &CancellationToken::new(),
                |_| {},
            )
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::PathRefused, "{prefix}: {err}");
        assert!(!err.is_retryable());
    }
    assert_eq!(listing(outside.path()), Vec::<String>::new());

    // The same for a publish: a link planted where the final name's parent goes.
    let staged = mover
        .stage_set(
            &src,
            &dst,
            &set_of("safe/ds/upload", VerifyMode::HashedInFlight),
            futures::stream::iter(files),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap();
    std::os::unix::fs::symlink(outside.path(), dst_dir.path().join("safe/ds/digests")).unwrap();
    let err = staged.publish_as("safe/ds/digests/v1").await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::PathRefused, "{err}");
    assert_eq!(listing(outside.path()), Vec::<String>::new());
}

/// A writer of new files (the resharder's shards) stages an empty set, writes into its
/// staging tier, and publishes: nothing is visible until then, everything after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_written_into_a_staged_set_appear_with_it() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    std::fs::create_dir_all(src_dir.path().join("lab/v1")).unwrap();
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let staged = mover
        .stage_set(
            &src,
            &dst,
            &set_of("proj/ds/shards", VerifyMode::HashedInFlight),
            futures::stream::iter(Vec::<FileRef>::new()),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap();
    let tier = staged.staging_tier().unwrap();
    for i in 0..3 {
        tier.write_small(&format!("shard-{i:05}.tar"), data(i, 5000))
            .await
            .unwrap();
    }
    assert!(!dst_dir.path().join("proj/ds/shards").exists());
    let report = staged.publish().await.unwrap();
    assert!(!report.existed);
    assert_eq!(
        listing(&dst_dir.path().join("proj/ds/shards")),
        vec!["shard-00000.tar", "shard-00001.tar", "shard-00002.tar"]
    );
}

/// A set found in place, listed without hashes (a checkpoint part's offload redelivered), is
/// verified against its source and each file reported with the SHA-256 it verified as, never
/// with the empty one it was listed with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_found_in_place_with_unknown_hashes_reports_the_proven_ones() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 12);
    let (src, dst, _) = tiers(src_dir.path(), dst_dir.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let (unknown, set) = listed_unhashed(&files, "lab/ckpt/part-0");
    for round in 0..2 {
        let mut measured = Vec::new();
        let report = mover
            .copy_set(
                &src,
                &dst,
                &set,
                futures::stream::iter(unknown.clone()),
                &Progress::new(),
                &CancellationToken::new(),
                |f| measured.push(f.clone()),
            )
            .await
            .unwrap();
        assert_eq!(report.existed, round == 1);
        assert_eq!(measured, files, "round {round}: the proven hashes");
    }
}
