//! A set's fingerprint (issue 16, "checked before reuse"): taken at publish after the modes were
//! applied, it names every file flipped, deleted, added or made writable since, without
//! reading a byte; it survives its encoding; a set found in place sheds the entries its list
//! does not name; and a set with no fingerprint is verified by hash (`Mover::check_set`).
//! Posix here, SeaweedFS for S3.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use sha2::{Digest, Sha256};
use stagehand_mover::s3::{S3Config, S3Tier};
use stagehand_mover::{
    CancellationToken, Change, FileRef, Fingerprint, Mover, MoverConfig, PosixTier, Progress,
    SetAccess, SetCopy, Stamp, Tier,
};
use stagehand_testkit::{ACCESS_KEY, S3Server, SECRET_KEY};

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

fn write(root: &Path, rel: &str, bytes: &[u8]) -> FileRef {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    FileRef::new(rel, bytes.len() as u64, hex::encode(Sha256::digest(bytes)))
}

fn source(dir: &Path, n: u64) -> Vec<FileRef> {
    (0..n)
        .map(|i| {
            write(
                dir,
                &format!("shard-{}/part-{i:04}.bin", i % 3),
                &data(i, 500 + (i as usize % 5) * 3000),
            )
        })
        .collect()
}

fn set(dst_prefix: &str) -> SetCopy {
    SetCopy {
        src_prefix: "lab/v1".into(),
        dst_prefix: dst_prefix.into(),
        chunk_files: 16,
        ..SetCopy::default()
    }
}

async fn copy(
    mover: &Mover,
    src: &Tier,
    dst: &Tier,
    set: &SetCopy,
    files: &[FileRef],
) -> stagehand_mover::SetReport {
    mover
        .copy_set(
            src,
            dst,
            set,
            futures::stream::iter(files.to_vec()),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap()
}

/// Flips one byte of `path` in place, then puts its mtime back: only ctime (and the chmod
/// a writer needs on a read-only set) gives it away.
fn flip_keeping_mtime(path: &Path) {
    let before = std::fs::metadata(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    bytes[0] ^= 0x01;
    std::fs::write(path, &bytes).unwrap();
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
    std::fs::set_permissions(path, before.permissions()).unwrap();
}

fn changes(diff: &[stagehand_mover::Difference]) -> Vec<(String, &'static str)> {
    diff.iter()
        .map(|d| (d.path.clone(), d.change.as_str()))
        .collect()
}

/// The fingerprint a read-only publish records is what a walk finds afterwards (taken after the
/// modes), and it names a byte flipped under a restored mtime, a deleted file, a stray file and
/// a file made writable — each with how — while an untouched set compares equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fingerprint_names_every_change_made_since_publish() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 30);
    let src = Tier::Posix(PosixTier::open("capacity", src_dir.path()).unwrap());
    let gid = rustix::process::getgid().as_raw();
    let dst = Tier::Posix(PosixTier::open("hot", dst_dir.path()).unwrap())
        .with_access(Some(SetAccess::read_only(Some(gid))));
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let report = copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    let recorded = report
        .fingerprint
        .clone()
        .expect("a publish takes the fingerprint");
    assert_eq!(recorded.files(), 30);
    assert_eq!(
        recorded.entries().len(),
        30 + 3 + 1,
        "files, three folders and the set's own"
    );
    let now = dst.fingerprint("p/ds/v1").await.unwrap();
    assert!(
        recorded.compare(&now).is_empty(),
        "{:?}",
        recorded.compare(&now)
    );

    let set_dir = dst_dir.path().join("p/ds/v1");
    flip_keeping_mtime(&set_dir.join("shard-1/part-0004.bin"));
    std::fs::set_permissions(
        set_dir.join("shard-0"),
        std::fs::Permissions::from_mode(0o750),
    )
    .unwrap();
    std::fs::remove_file(set_dir.join("shard-0/part-0009.bin")).unwrap();
    std::fs::write(set_dir.join("shard-0/notes.txt"), b"a job wrote here").unwrap();
    std::fs::set_permissions(
        set_dir.join("shard-2/part-0002.bin"),
        std::fs::Permissions::from_mode(0o640),
    )
    .unwrap();

    let found = dst.fingerprint("p/ds/v1").await.unwrap();
    let diff = recorded.compare(&found);
    assert_eq!(
        changes(&diff),
        vec![
            ("shard-0".to_owned(), "modified"),
            ("shard-0/notes.txt".to_owned(), "stray"),
            ("shard-0/part-0009.bin".to_owned(), "missing"),
            ("shard-1/part-0004.bin".to_owned(), "modified"),
            ("shard-2/part-0002.bin".to_owned(), "modified"),
        ]
    );

    // Encoded and decoded, it is the same fingerprint; a flipped bit makes it unknown.
    let bytes = recorded.encode();
    assert_eq!(Fingerprint::decode(&bytes).unwrap(), recorded);
    let mut bad = bytes.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    assert!(Fingerprint::decode(&bad).is_err());
}

/// A set found in place whose files all verify but which holds entries its list does not name
/// (a stray file, a stray folder) is replaced by exactly its listed files — the strays go with
/// the exchange of folders — and the report counts them; the new fingerprint is the set's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strays_in_a_set_found_in_place_go_with_the_replacement() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 12);
    let src = Tier::Posix(PosixTier::open("capacity", src_dir.path()).unwrap());
    let dst = Tier::Posix(PosixTier::open("hot", dst_dir.path()).unwrap());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    let set_dir = dst_dir.path().join("p/ds/v1");
    std::fs::write(set_dir.join("shard-1/extra.bin"), b"stray").unwrap();
    std::fs::create_dir_all(set_dir.join("scratch/deeper")).unwrap();

    let report = copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    assert_eq!(
        (
            report.existed,
            report.replaced,
            report.strays,
            report.skipped
        ),
        (false, 0, 3, 12)
    );
    assert!(!set_dir.join("shard-1/extra.bin").exists());
    assert!(!set_dir.join("scratch").exists());
    let now = dst.fingerprint("p/ds/v1").await.unwrap();
    assert_eq!(now.files(), 12);
    assert!(report.fingerprint.unwrap().compare(&now).is_empty());

    // Found whole now: nothing is published, and the walk taken before hashing is the one to
    // record.
    let again = copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    assert!(again.existed);
    assert_eq!(again.strays, 0);
    assert!(again.fingerprint.unwrap().compare(&now).is_empty());
}

/// With no fingerprint to compare, `check_set` reads every listed file: a byte flipped under an
/// unchanged size and mtime is a `hash` difference, a deleted file `missing`, a file of another
/// size `size` with both sizes, an unlisted file `stray`; nothing on the tier is changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_without_a_fingerprint_is_verified_by_hash() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files = source(&src_dir.path().join("lab/v1"), 10);
    let src = Tier::Posix(PosixTier::open("capacity", src_dir.path()).unwrap());
    let dst = Tier::Posix(PosixTier::open("hot", dst_dir.path()).unwrap());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    let check = mover
        .check_set(&dst, "p/ds/v1", futures::stream::iter(files.clone()))
        .await
        .unwrap();
    assert!(check.differences.is_empty(), "{:?}", check.differences);
    assert_eq!(check.files, 10);

    let set_dir = dst_dir.path().join("p/ds/v1");
    flip_keeping_mtime(&set_dir.join(&files[3].path));
    std::fs::remove_file(set_dir.join(&files[5].path)).unwrap();
    std::fs::write(set_dir.join(&files[7].path), b"short").unwrap();
    std::fs::write(set_dir.join("unlisted.txt"), b"?").unwrap();
    let check = mover
        .check_set(&dst, "p/ds/v1", futures::stream::iter(files.clone()))
        .await
        .unwrap();
    let mut got = changes(&check.differences);
    got.sort();
    let mut want = vec![
        (files[3].path.clone(), "hash"),
        (files[5].path.clone(), "missing"),
        (files[7].path.clone(), "size"),
        ("unlisted.txt".to_owned(), "stray"),
    ];
    want.sort();
    assert_eq!(got, want);
    let size = check
        .differences
        .iter()
        .find(|d| d.path == files[7].path)
        .unwrap();
    assert_eq!(
        size.change,
        Change::Size {
            expected: files[7].size,
            found: 5
        }
    );
    assert!(
        set_dir.join("unlisted.txt").exists(),
        "a check changes nothing"
    );
}

/// A flat folder of thousands of files is walked on several threads: every file is there once
/// with the size and inode `stat` gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flat_folder_is_walked_whole() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    for i in 0..3000 {
        std::fs::create_dir_all(dir.path().join("v/flat")).unwrap();
        std::fs::write(
            dir.path().join(format!("v/flat/f{i:05}")),
            vec![0u8; i % 17],
        )
        .unwrap();
    }
    let tier = Tier::Posix(PosixTier::open("hot", dir.path()).unwrap());
    let print = tier.fingerprint("v").await.unwrap();
    assert_eq!(print.files(), 3000);
    for e in print.entries() {
        let meta = std::fs::symlink_metadata(dir.path().join("v").join(&e.path)).unwrap();
        match &e.stamp {
            Stamp::File { size, ino, .. } => {
                assert_eq!((*size, *ino), (meta.len(), meta.ino()), "{}", e.path)
            }
            Stamp::Dir { ino, .. } => assert_eq!(*ino, meta.ino(), "{}", e.path),
            other => panic!("{other:?} at {}", e.path),
        }
    }
}

/// On S3 the fingerprint is each object's size, ETag and last-modified: an object rewritten
/// with the same size and a stray object are found, the completion marker is not part of it;
/// a set found in place sheds its stray objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_fingerprint_finds_a_rewritten_object_and_a_stray() {
    let server = tokio::task::spawn_blocking(S3Server::shared).await.unwrap();
    let bucket = tokio::task::spawn_blocking(|| server.unique_bucket("fingerprint"))
        .await
        .unwrap();
    let mut config = S3Config::new(bucket, "tier");
    config.endpoint = Some(server.endpoint());
    let s3 = S3Tier::connect_with_keys("hot-s3", config, ACCESS_KEY, SECRET_KEY).unwrap();
    let dst = Tier::S3(s3.clone());
    let src_dir = tempfile::tempdir().unwrap();
    let files = source(&src_dir.path().join("lab/v1"), 8);
    let src = Tier::Posix(PosixTier::open("capacity", src_dir.path()).unwrap());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let report = copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    let recorded = report.fingerprint.unwrap();
    assert_eq!(
        recorded.entries().len(),
        8,
        "the marker is not part of the set"
    );

    let mut rewritten = data(99, files[2].size as usize);
    rewritten[0] ^= 1;
    s3.put_small(&format!("p/ds/v1/{}", files[2].path), rewritten)
        .await
        .unwrap();
    s3.put_small("p/ds/v1/stray.txt", b"x".to_vec())
        .await
        .unwrap();
    let found = dst.fingerprint("p/ds/v1").await.unwrap();
    assert_eq!(
        changes(&recorded.compare(&found)),
        vec![
            (files[2].path.clone(), "modified"),
            ("stray.txt".to_owned(), "stray")
        ]
    );

    let report = copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    assert_eq!((report.replaced, report.strays), (1, 1));
    assert!(s3.stat("p/ds/v1/stray.txt").await.unwrap().is_none());
    assert!(dst.set_present("p/ds/v1").await.unwrap());
    let now = dst.fingerprint("p/ds/v1").await.unwrap();
    assert!(report.fingerprint.unwrap().compare(&now).is_empty());
}

/// A listed file that is missing keeps its folders listed: a folder whose only file was deleted
/// is that file `missing`, not a `stray` folder as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_whose_only_file_is_missing_is_no_stray() {
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut files = source(&src_dir.path().join("lab/v1"), 4);
    files.push(write(
        &src_dir.path().join("lab/v1"),
        "solo/only.bin",
        &data(99, 700),
    ));
    let src = Tier::Posix(PosixTier::open("capacity", src_dir.path()).unwrap());
    let dst = Tier::Posix(PosixTier::open("hot", dst_dir.path()).unwrap());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    copy(&mover, &src, &dst, &set("p/ds/v1"), &files).await;
    let solo = dst_dir.path().join("p/ds/v1/solo");
    std::fs::set_permissions(&solo, std::fs::Permissions::from_mode(0o750)).unwrap();
    std::fs::remove_file(solo.join("only.bin")).unwrap();
    let check = mover
        .check_set(&dst, "p/ds/v1", futures::stream::iter(files.clone()))
        .await
        .unwrap();
    assert_eq!(
        changes(&check.differences),
        vec![("solo/only.bin".to_owned(), "missing")]
    );
}

/// A checkpoint part's commit records each listed file's stamp from one walk (no byte read);
/// compared with a later walk it names a byte flipped under a restored mtime, a file deleted
/// and a file replaced by another of the same size, and looks at nothing it does not list (a
/// file written beside them, the folders).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parts_file_stamps_name_each_listed_file_changed_since_and_nothing_else() {
    let root = tempfile::tempdir().unwrap();
    let files = source(&root.path().join("lab/v1"), 6);
    let tier = Tier::Posix(PosixTier::open("local", root.path()).unwrap());
    let walked = tier.fingerprint("lab/v1").await.unwrap();
    let stamps: Vec<_> = files
        .iter()
        .map(|f| walked.file_stamp(&f.path).unwrap())
        .collect();
    assert!(
        walked.file_stamp("shard-0").is_none(),
        "a folder has no file stamp"
    );
    for (s, f) in stamps.iter().zip(&files) {
        assert_eq!((s.path.as_str(), s.size), (f.path.as_str(), f.size));
    }
    let recorded = Fingerprint::of_file_stamps(&stamps);
    let dir = root.path().join("lab/v1");
    write(&dir, "shard-0/written-after.bin", b"not listed");
    let now = tier.fingerprint("lab/v1").await.unwrap();
    assert!(recorded.compare_files(&now).is_empty());

    flip_keeping_mtime(&dir.join(&files[1].path));
    std::fs::remove_file(dir.join(&files[2].path)).unwrap();
    let replaced = dir.join(&files[4].path);
    let same_size = std::fs::read(&replaced).unwrap();
    std::fs::write(dir.join("replacement"), &same_size).unwrap();
    std::fs::rename(dir.join("replacement"), &replaced).unwrap();
    let now = tier.fingerprint("lab/v1").await.unwrap();
    let mut expected = vec![
        (files[1].path.clone(), "modified"),
        (files[2].path.clone(), "missing"),
        (files[4].path.clone(), "modified"),
    ];
    expected.sort();
    assert_eq!(changes(&recorded.compare_files(&now)), expected);
}
