//! Transfers to, from and within the S3 tier against a real SeaweedFS server (testkit):
//! round trips with hash verification, empty and multipart-sized objects, many small files,
//! wrong hashes, small objects proven from their GET response alone, an object replaced between
//! the ranges of a download, server-side copies, missing objects, unreachable endpoints and
//! refused keys.

use std::path::Path;

use futures::StreamExt;
use sha2::{Digest, Sha256};
use stagehand_mover::s3::{self, S3Config, S3Tier};
use stagehand_mover::{
    CopyOptions, CopyOutcome, ErrorKind, FileRef, PosixTier, Progress, SkipReason,
};
use stagehand_schemas::Retryable;
use stagehand_testkit::{ACCESS_KEY, S3Server, SECRET_KEY};

const MIB: u64 = 1024 * 1024;

async fn server() -> &'static S3Server {
    tokio::task::spawn_blocking(S3Server::shared).await.unwrap()
}

/// A tier on a fresh bucket with small parts, so a few MiB already exercise multipart paths.
async fn tier(name: &str) -> S3Tier {
    let server = server().await;
    let bucket = tokio::task::spawn_blocking(|| server.unique_bucket("mover"))
        .await
        .unwrap();
    let mut config = S3Config::new(bucket, "data/set");
    config.endpoint = Some(server.endpoint());
    config.part_size = 5 * MIB;
    config.multipart_threshold = 5 * MIB;
    config.concurrency = 8;
    S3Tier::connect_with_keys(name, config, ACCESS_KEY, SECRET_KEY).unwrap()
}

/// Deterministic pseudo-random bytes (xorshift), different per seed.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn write(root: &Path, rel: &str, data: &[u8]) -> FileRef {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, data).unwrap();
    FileRef::new(rel, data.len() as u64, hex::encode(Sha256::digest(data)))
}

fn posix(name: &str, dir: &tempfile::TempDir) -> PosixTier {
    PosixTier::open(name, dir.path()).unwrap()
}

async fn open_uploads(tier: &S3Tier) -> usize {
    tier.client()
        .list_multipart_uploads()
        .bucket(tier.bucket())
        .send()
        .await
        .unwrap()
        .uploads()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_verifies_small_empty_and_multipart_objects() {
    let cold = tier("cold").await;
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (src, dst) = (posix("lab", &src_dir), posix("scratch", &dst_dir));
    let files = [
        write(src_dir.path(), "a/small.bin", &bytes(70_000, 1)),
        write(src_dir.path(), "empty", b""),
        // Larger than the 5 MiB part: a multipart upload and parallel ranged GETs.
        write(
            src_dir.path(),
            "big/shard.tar",
            &bytes((23 * MIB + 12_345) as usize, 2),
        ),
    ];
    let opts = CopyOptions::default();
    let progress = Progress::new();
    for file in &files {
        let up = s3::upload(&src, &cold, file, &opts, &progress)
            .await
            .unwrap();
        let engine = match &up {
            CopyOutcome::Copied { sha256, engine, .. } => {
                assert_eq!(sha256, &file.sha256);
                *engine
            }
            other => panic!("{other:?}"),
        };
        let want = if file.size > 5 * MIB {
            "s3-multipart"
        } else {
            "s3-put"
        };
        assert_eq!(engine, want, "{}", file.path);
        let info = cold
            .stat(&file.path)
            .await
            .unwrap()
            .expect("object visible");
        assert_eq!(info.size, file.size);
        assert_eq!(info.sha256_meta.as_deref(), Some(file.sha256.as_str()));
        assert_eq!(
            cold.hash_file(&file.path).await.unwrap().sha256,
            file.sha256
        );

        let down = s3::download(&cold, &dst, file, &opts, &progress)
            .await
            .unwrap();
        let want = if file.size > 5 * MIB {
            "s3-ranged-get"
        } else {
            "s3-get"
        };
        assert!(
            matches!(down, CopyOutcome::Copied { engine, .. } if engine == want),
            "{down:?}"
        );
        let landed = std::fs::read(dst_dir.path().join(&file.path)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&landed)), file.sha256);
    }
    assert_eq!(open_uploads(&cold).await, 0);
    let total: u64 = files.iter().map(|f| f.size).sum();
    assert_eq!(progress.bytes_done(), 2 * total);

    // Run again: everything is already there and is verified, not copied.
    for file in &files {
        let up = s3::upload(&src, &cold, file, &opts, &progress)
            .await
            .unwrap();
        assert!(
            matches!(
                up,
                CopyOutcome::Skipped {
                    reason: SkipReason::AlreadyPresentVerified,
                    ..
                }
            ),
            "{up:?}"
        );
        let down = s3::download(&cold, &dst, file, &opts, &progress)
            .await
            .unwrap();
        assert!(
            matches!(
                down,
                CopyOutcome::Skipped {
                    reason: SkipReason::AlreadyPresentVerified,
                    ..
                }
            ),
            "{down:?}"
        );
    }
    let trusting = CopyOptions {
        trust_recorded_hash: true,
        ..CopyOptions::default()
    };
    let up = s3::upload(&src, &cold, &files[2], &trusting, &progress)
        .await
        .unwrap();
    assert!(
        matches!(
            up,
            CopyOutcome::Skipped {
                reason: SkipReason::AlreadyPresentTrusted,
                ..
            }
        ),
        "{up:?}"
    );

    let listed = cold.list("").await.unwrap();
    let names: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["a/small.bin", "big/shard.tar", "empty"]);
    assert_eq!(
        cold.list("big").await.unwrap(),
        vec![("big/shard.tar".to_owned(), files[2].size)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_small_files_go_up_and_down_concurrently() {
    let cold = tier("cold").await;
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (src, dst) = (posix("lab", &src_dir), posix("scratch", &dst_dir));
    let files: Vec<FileRef> = (0..2000)
        .map(|i| {
            write(
                src_dir.path(),
                &format!("d{}/f{i:05}.bin", i % 17),
                &bytes(512 + i * 3, i as u64 + 10),
            )
        })
        .collect();
    let opts = CopyOptions::default();
    let progress = Progress::new();
    let results: Vec<_> = futures::stream::iter(&files)
        .map(|f| s3::upload(&src, &cold, f, &opts, &progress))
        .buffer_unordered(64)
        .collect()
        .await;
    assert!(
        results.iter().all(Result::is_ok),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    assert_eq!(cold.list("").await.unwrap().len(), 2000);

    let results: Vec<_> = futures::stream::iter(&files)
        .map(|f| s3::download(&cold, &dst, f, &opts, &progress))
        .buffer_unordered(64)
        .collect()
        .await;
    assert!(
        results.iter().all(Result::is_ok),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    for file in &files {
        let landed = std::fs::read(dst_dir.path().join(&file.path)).unwrap();
        assert_eq!(
            hex::encode(Sha256::digest(&landed)),
            file.sha256,
            "{}",
            file.path
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_hash_fails_that_file_only_and_leaves_no_object() {
    let cold = tier("cold").await;
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (src, dst) = (posix("lab", &src_dir), posix("scratch", &dst_dir));
    let good = write(src_dir.path(), "good.bin", &bytes(10_000, 3));
    let mut bad_small = write(src_dir.path(), "bad-small.bin", &bytes(10_000, 4));
    let mut bad_big = write(
        src_dir.path(),
        "bad-big.bin",
        &bytes((11 * MIB) as usize, 5),
    );
    bad_small.sha256 = "0".repeat(64);
    bad_big.sha256 = "1".repeat(64);
    let opts = CopyOptions::default();
    let progress = Progress::new();
    let (a, b, c) = tokio::join!(
        s3::upload(&src, &cold, &good, &opts, &progress),
        s3::upload(&src, &cold, &bad_small, &opts, &progress),
        s3::upload(&src, &cold, &bad_big, &opts, &progress),
    );
    a.unwrap();
    for (err, path) in [
        (b.unwrap_err(), "bad-small.bin"),
        (c.unwrap_err(), "bad-big.bin"),
    ] {
        assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
        assert_eq!(err.path, path);
        assert!(
            cold.stat(path).await.unwrap().is_none(),
            "{path} must not be visible"
        );
    }
    // The failed multipart upload was aborted, not left behind.
    assert_eq!(open_uploads(&cold).await, 0);
    assert!(cold.stat("good.bin").await.unwrap().is_some());

    // Downloading against a wrong hash publishes nothing either.
    let mut wrong = good.clone();
    wrong.sha256 = "2".repeat(64);
    let err = s3::download(&cold, &dst, &wrong, &opts, &progress)
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
    assert_eq!(
        std::fs::read_dir(dst_dir.path()).unwrap().count(),
        0,
        "no file, no temp file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_hashing_wrong_without_metadata_publishes_nothing() {
    let cold = tier("cold").await;
    let dst_dir = tempfile::tempdir().unwrap();
    let dst = posix("scratch", &dst_dir);
    // An object written by someone else: no recorded hash, so only streaming can prove it.
    let data = bytes((12 * MIB) as usize, 6);
    cold.client()
        .put_object()
        .bucket(cold.bucket())
        .key("data/set/foreign.bin")
        .body(data.clone().into())
        .send()
        .await
        .unwrap();
    let mut file = FileRef::new("foreign.bin", data.len() as u64, "3".repeat(64));
    let err = s3::download(
        &cold,
        &dst,
        &file,
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
    assert_eq!(std::fs::read_dir(dst_dir.path()).unwrap().count(), 0);
    file.sha256 = hex::encode(Sha256::digest(&data));
    s3::download(
        &cold,
        &dst,
        &file,
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(dst_dir.path().join("foreign.bin")).unwrap(),
        data
    );
}

/// Puts `data` under the tier-relative `rel` directly through the client, with `sha256` as the
/// recorded hash when given (as another writer, or a corrupting one, would).
async fn put_raw(tier: &S3Tier, rel: &str, data: &[u8], sha256: Option<&str>) {
    tier.client()
        .put_object()
        .bucket(tier.bucket())
        .key(format!("{}/{rel}", tier.prefix()))
        .set_metadata(sha256.map(|h| [(s3::SHA256_METADATA_KEY.to_owned(), h.to_owned())].into()))
        .body(data.to_vec().into())
        .send()
        .await
        .unwrap();
}

fn sha_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// A ranged download whose object is replaced (same size, other bytes) after its first range
/// started must fail as `SourceChanged` through `If-Match`, and publish neither the file nor a
/// temp file; the size and even a hash check cannot be what catches it here, only the ETag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_replaced_between_ranges_fails_as_source_changed_and_publishes_nothing() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let cold = tier("cold").await;
    let dst_dir = tempfile::tempdir().unwrap();
    let dst = posix("scratch", &dst_dir);
    let old = bytes((23 * MIB) as usize, 21);
    let new = bytes(old.len(), 22);
    put_raw(&cold, "shard.tar", &old, Some(&sha_hex(&old))).await;
    let file = FileRef::new("shard.tar", old.len() as u64, sha_hex(&old));

    // The seam runs before each range after the first; the first call replaces the object
    // and the download only goes on once the replacement is stored.
    let replaced_before = Arc::new(AtomicU64::new(0));
    let (client, bucket, key) = (
        cold.client().clone(),
        cold.bucket().to_owned(),
        format!("{}/shard.tar", cold.prefix()),
    );
    let (replacement, seen) = (new.clone(), replaced_before.clone());
    let gated = cold.with_range_hook(Arc::new(move |_rel: &str, offset: u64| {
        let (client, bucket, key, data, seen) = (
            client.clone(),
            bucket.clone(),
            key.clone(),
            replacement.clone(),
            seen.clone(),
        );
        Box::pin(async move {
            if seen.load(Ordering::SeqCst) == 0 {
                client
                    .put_object()
                    .bucket(bucket)
                    .key(key)
                    .body(data.into())
                    .send()
                    .await
                    .unwrap();
                seen.store(offset, Ordering::SeqCst);
            }
        })
    }));

    for opts in [
        CopyOptions::default(),
        // Without a hash to prove, only the ETag stands between the caller and a mixed file.
        CopyOptions {
            expected_hash_unknown: true,
            ..CopyOptions::default()
        },
    ] {
        put_raw(&cold, "shard.tar", &old, Some(&sha_hex(&old))).await;
        replaced_before.store(0, Ordering::SeqCst);
        let err = s3::download(&gated, &dst, &file, &opts, &Progress::new())
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::SourceChanged, "{err}");
        assert_eq!(err.path, "shard.tar");
        assert!(err.is_retryable(), "a changed source is worth another try");
        assert_eq!(
            replaced_before.load(Ordering::SeqCst),
            5 * MIB,
            "replaced after the first 5 MiB range had started"
        );
        assert_eq!(
            std::fs::read_dir(dst_dir.path()).unwrap().count(),
            0,
            "no file, no temp file"
        );
    }

    // A retry under the new version's reference goes through the same seam and lands whole.
    let file = FileRef::new("shard.tar", new.len() as u64, sha_hex(&new));
    s3::download(
        &gated,
        &dst,
        &file,
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(dst_dir.path().join("shard.tar")).unwrap(),
        new
    );
}

/// A small object is one GET: what a HEAD would have refused is refused from the GET response
/// (size, recorded hash), and the bytes are proven against the recorded hash when the caller
/// has none. Nothing is published on any refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_object_is_proven_from_its_get_response() {
    let cold = tier("cold").await;
    let dst_dir = tempfile::tempdir().unwrap();
    let dst = posix("scratch", &dst_dir);
    let data = bytes(70_000, 31);
    let unknown = CopyOptions {
        expected_hash_unknown: true,
        ..CopyOptions::default()
    };

    // The listing said another size: refused before a byte is written.
    put_raw(&cold, "a/grown.bin", &data, Some(&sha_hex(&data))).await;
    let err = s3::download(
        &cold,
        &dst,
        &FileRef::new("a/grown.bin", 100, sha_hex(&data)),
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");

    // The recorded hash contradicts the reference.
    let err = s3::download(
        &cold,
        &dst,
        &FileRef::new("a/grown.bin", data.len() as u64, "4".repeat(64)),
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");

    // No reference hash, and the recorded one is wrong for the bytes: the bytes are refused.
    put_raw(&cold, "a/rotten.bin", &data, Some(&"5".repeat(64))).await;
    let err = s3::download(
        &cold,
        &dst,
        &FileRef::new("a/rotten.bin", data.len() as u64, ""),
        &unknown,
        &Progress::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
    assert!(err.to_string().contains("recorded"), "{err}");
    assert_eq!(
        walk_count(dst_dir.path()),
        0,
        "no file and no temp file anywhere"
    );

    // Proven against the recorded hash, the same object lands.
    let outcome = s3::download(
        &cold,
        &dst,
        &FileRef::new("a/grown.bin", data.len() as u64, ""),
        &unknown,
        &Progress::new(),
    )
    .await
    .unwrap();
    match outcome {
        CopyOutcome::Copied { sha256, engine, .. } => {
            assert_eq!(sha256, sha_hex(&data));
            assert_eq!(engine, "s3-get");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        std::fs::read(dst_dir.path().join("a/grown.bin")).unwrap(),
        data
    );
    // Already there and equal: skipped through the HEAD path.
    let again = s3::download(
        &cold,
        &dst,
        &FileRef::new("a/grown.bin", data.len() as u64, sha_hex(&data)),
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap();
    assert!(
        matches!(
            again,
            CopyOutcome::Skipped {
                reason: SkipReason::AlreadyPresentVerified,
                ..
            }
        ),
        "{again:?}"
    );
}

/// Everything beneath `root` that is not a directory (files, temp files, links), recursively.
fn walk_count(root: &Path) -> usize {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk_count(&e.path())
            } else {
                1
            }
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_to_s3_copies_are_verified() {
    let hot = tier("hot").await;
    let cold = tier("cold").await;
    let src_dir = tempfile::tempdir().unwrap();
    let src = posix("lab", &src_dir);
    let opts = CopyOptions::default();
    let progress = Progress::new();
    let file = write(src_dir.path(), "x/model.bin", &bytes((7 * MIB) as usize, 7));
    s3::upload(&src, &hot, &file, &opts, &progress)
        .await
        .unwrap();

    let out = s3::copy_within(&hot, &cold, &file, &opts, &progress)
        .await
        .unwrap();
    assert!(
        matches!(
            out,
            CopyOutcome::Copied {
                engine: "s3-server-copy",
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(
        cold.hash_file(&file.path).await.unwrap().sha256,
        file.sha256
    );
    let again = s3::copy_within(&hot, &cold, &file, &opts, &progress)
        .await
        .unwrap();
    assert!(matches!(again, CopyOutcome::Skipped { .. }), "{again:?}");

    // A source without recorded metadata is hashed once, and the copy records the hash.
    let data = bytes(300_000, 8);
    hot.client()
        .put_object()
        .bucket(hot.bucket())
        .key("data/set/plain.bin")
        .body(data.clone().into())
        .send()
        .await
        .unwrap();
    let plain = FileRef::new(
        "plain.bin",
        data.len() as u64,
        hex::encode(Sha256::digest(&data)),
    );
    s3::copy_within(&hot, &cold, &plain, &opts, &progress)
        .await
        .unwrap();
    assert_eq!(
        cold.stat("plain.bin").await.unwrap().unwrap().sha256_meta,
        Some(plain.sha256.clone())
    );
    let mut lying = plain.clone();
    lying.path = "plain.bin".into();
    lying.sha256 = "4".repeat(64);
    let err = s3::copy_within(&hot, &cold, &lying, &opts, &progress)
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");

    // Another endpoint (the same server under another name): streamed, not server-side.
    let mut config = cold.config().clone();
    config.endpoint = Some(config.endpoint.unwrap().replace("127.0.0.1", "localhost"));
    config.prefix = "elsewhere".into();
    let other = S3Tier::connect_with_keys("other", config, ACCESS_KEY, SECRET_KEY).unwrap();
    let out = s3::copy_within(&hot, &other, &file, &opts, &progress)
        .await
        .unwrap();
    assert!(
        matches!(
            out,
            CopyOutcome::Copied {
                engine: "s3-multipart",
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(
        other.hash_file(&file.path).await.unwrap().sha256,
        file.sha256
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_objects_are_not_found() {
    let cold = tier("cold").await;
    let hot = tier("hot").await;
    let dst_dir = tempfile::tempdir().unwrap();
    let dst = posix("scratch", &dst_dir);
    let file = FileRef::new("nope/missing.bin", 5, "5".repeat(64));
    let opts = CopyOptions::default();
    let err = s3::download(&cold, &dst, &file, &opts, &Progress::new())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert_eq!(err.path, "nope/missing.bin");
    assert!(!err.is_retryable());
    let err = s3::copy_within(&cold, &hot, &file, &opts, &Progress::new())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    let err = cold.hash_file("nope/missing.bin").await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert_eq!(cold.stat("nope/missing.bin").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_is_unreachable_and_named() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut config = S3Config::new("data", "");
    config.endpoint = Some(endpoint.clone());
    let tier = S3Tier::connect_with_keys("offline", config, "k", "s").unwrap();
    let err = tier.stat("a.bin").await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unreachable, "{err}");
    assert!(err.is_retryable());
    assert!(err.to_string().contains(&endpoint), "{err}");
    let dst_dir = tempfile::tempdir().unwrap();
    let file = FileRef::new("a.bin", 1, "6".repeat(64));
    let err = s3::download(
        &tier,
        &posix("scratch", &dst_dir),
        &file,
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unreachable, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_leave_the_prefix_are_refused() {
    let cold = tier("cold").await;
    let src_dir = tempfile::tempdir().unwrap();
    let src = posix("lab", &src_dir);
    write(src_dir.path(), "ok.bin", b"abc");
    for bad in [
        "../escape.bin",
        "/etc/passwd",
        "a/../../b",
        "a\0b",
        "a//b",
        "",
    ] {
        let err = cold
            .key_for(bad, stagehand_mover::Side::Destination)
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::PathRefused, "{bad:?}: {err}");
        let file = FileRef::new(bad, 3, hex::encode(Sha256::digest(b"abc")));
        let err = s3::upload(
            &src,
            &cold,
            &file,
            &CopyOptions::default(),
            &Progress::new(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind, ErrorKind::PathRefused, "{bad:?}: {err}");
        let err = cold.stat(bad).await.unwrap_err();
        assert_eq!(err.kind, ErrorKind::PathRefused, "{bad:?}: {err}");
    }
    let everything = cold
        .client()
        .list_objects_v2()
        .bucket(cold.bucket())
        .send()
        .await
        .unwrap();
    assert!(
        everything.contents().is_empty(),
        "nothing was written: {:?}",
        everything.contents()
    );
}

#[test]
fn a_config_with_an_unknown_key_is_refused() {
    let err = toml::from_str::<S3Config>("bucket = \"data\"\npart_sise = 5").unwrap_err();
    assert!(err.to_string().contains("part_sise"), "{err}");
}

/// The validator's read of an object: one GET gives its SHA-256 and, for an object declared
/// larger than a piece, its piece hashes; one declared a piece or smaller has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_larger_than_a_piece_is_hashed_piece_by_piece_in_the_same_read() {
    use stagehand_mover::{ReadLimit, Tier};
    use stagehand_schemas::pieces::{PIECE_BYTES, PieceHashes};
    let cold = Tier::S3(tier("cold").await);
    let Tier::S3(raw) = &cold else { unreachable!() };
    let large = bytes(2 * PIECE_BYTES as usize + 123, 11);
    let small = bytes(PIECE_BYTES as usize, 12);
    put_raw(raw, "large.bin", &large, None).await;
    put_raw(raw, "small.bin", &small, None).await;

    let read = cold
        .hash_file_pieces("large.bin", ReadLimit::declared(large.len() as u64, None))
        .await
        .unwrap();
    assert_eq!(
        (read.digest.size, read.digest.sha256),
        (large.len() as u64, sha_hex(&large))
    );
    assert_eq!(read.pieces, Some(PieceHashes::of(&large)));

    let read = cold
        .hash_file_pieces("small.bin", ReadLimit::declared(PIECE_BYTES, None))
        .await
        .unwrap();
    assert_eq!(read.digest.sha256, sha_hex(&small));
    assert_eq!(read.pieces, None);
    // The bounds are those of every bounded read.
    let err = cold
        .hash_file_pieces("large.bin", ReadLimit::declared(PIECE_BYTES + 1, None))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");
}

/// A fan-out's slice of a large object read from an S3 shared tier: one ranged GET gives
/// exactly the bytes of the range; a range running past the object's end is a size mismatch,
/// never fewer bytes handed on as the slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_an_object_is_read_exactly_or_refused() {
    use stagehand_mover::Tier;
    let cold = Tier::S3(tier("cold").await);
    let Tier::S3(raw) = &cold else { unreachable!() };
    let data = bytes(3 << 20, 13);
    put_raw(raw, "large.bin", &data, None).await;
    let got = cold
        .read_range("large.bin", 1_000_000..2_500_001)
        .await
        .unwrap();
    assert!(got == data[1_000_000..2_500_001], "the range's bytes");
    assert!(cold.read_range("large.bin", 5..5).await.unwrap().is_empty());
    let err = cold
        .read_range("large.bin", (3 << 20) - 10..(3 << 20) + 10)
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");
    let err = cold.read_range("missing.bin", 0..10).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
}

/// Bounded reads of objects (issue 6 item 7): the GET response's `Content-Length` is checked
/// against the declared and maximum sizes before the body is read; a key over S3's 1024
/// bytes is refused before any request, as that file's permanent problem; a missing object
/// is permanent too. Only an unreachable endpoint stays retryable (tested above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_object_reads_check_sizes_first_and_refuse_overlong_keys() {
    use stagehand_mover::{ReadLimit, Tier};
    let cold = Tier::S3(tier("cold").await);
    let Tier::S3(raw) = &cold else { unreachable!() };
    let body = bytes(300_000, 7);
    put_raw(raw, "a/obj.bin", &body, None).await;

    let ok = cold
        .hash_file_bounded("a/obj.bin", ReadLimit::declared(300_000, Some(1 << 20)))
        .await
        .unwrap();
    assert_eq!((ok.size, ok.sha256), (300_000, sha_hex(&body)));

    let err = cold
        .hash_file_bounded("a/obj.bin", ReadLimit::declared(1, None))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");
    assert!(err.detail.contains("300000"), "{err}");
    assert!(!err.is_retryable());
    let err = cold
        .hash_file_bounded("a/obj.bin", ReadLimit::declared(300_000, Some(1000)))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::TooLarge, "{err}");
    assert!(!err.is_retryable());

    let err = cold
        .hash_file_bounded("a/none.bin", ReadLimit::declared(1, None))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(!err.is_retryable());

    // Every component within NAME_MAX, the whole key over S3's 1024 bytes.
    let long = vec!["k".repeat(220); 5].join("/");
    let err = cold
        .hash_file_bounded(&long, ReadLimit::declared(1, None))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::PathRefused, "{err}");
    assert!(!err.is_retryable());
    assert_eq!(err.path, long);
}

/// An S3 set (no rename on S3): every object is atomic, and the completion marker written
/// last is what makes the prefix present. A corrupt file fails the set with no marker; the
/// rerun after the fix uploads only what is missing and writes the marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_on_s3_is_present_only_with_its_completion_marker() {
    use stagehand_mover::{
        CancellationToken, Mover, MoverConfig, SET_COMPLETE_MARKER, SetCopy, Tier,
    };
    let cold = Tier::S3(tier("cold").await);
    let src_dir = tempfile::tempdir().unwrap();
    let mut files: Vec<FileRef> = (0..30u64)
        .map(|i| {
            write(
                &src_dir.path().join("v1"),
                &format!("f{i:02}"),
                &bytes(20_000, i),
            )
        })
        .collect();
    let good = files[29].sha256.clone();
    files[29].sha256 = sha_hex(b"not it");
    let src = Tier::Posix(posix("lab", &src_dir));
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let set = SetCopy {
        src_prefix: "v1".into(),
        dst_prefix: "ds/v1".into(),
        chunk_files: 8,
        ..SetCopy::default()
    };
    let err = mover
        .copy_set(
            &src,
            &cold,
            &set,
            futures::stream::iter(files.clone()),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap_err();
    assert_eq!(
        (err.kind, err.path.as_str()),
        (ErrorKind::ChecksumMismatch, "f29")
    );
    assert!(!cold.set_present("ds/v1").await.unwrap());

    files[29].sha256 = good;
    let report = mover
        .copy_set(
            &src,
            &cold,
            &set,
            futures::stream::iter(files),
            &Progress::new(),
            &CancellationToken::new(),
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!((report.copied, report.skipped), (1, 29));
    assert!(cold.set_present("ds/v1").await.unwrap());
    let Tier::S3(raw) = &cold else { unreachable!() };
    let listed = raw.list("ds/v1").await.unwrap();
    assert_eq!(listed.len(), 31, "30 objects and the marker");
    assert!(
        listed
            .iter()
            .any(|(k, _)| k == &format!("ds/v1/{SET_COMPLETE_MARKER}"))
    );
}

/// A request the real server refuses (HTTP 403 for a wrong secret) is a permanent problem of
/// that file, never retried as if the server were down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_is_permanent() {
    use stagehand_mover::{ReadLimit, Tier};
    let good = tier("cold").await;
    put_raw(&good, "a/obj.bin", b"bytes", None).await;
    let server = server().await;
    let mut config = S3Config::new(good.bucket(), good.prefix());
    config.endpoint = Some(server.endpoint());
    let refused =
        Tier::S3(S3Tier::connect_with_keys("cold", config, ACCESS_KEY, "not-the-secret").unwrap());
    let err = refused
        .hash_file_bounded("a/obj.bin", ReadLimit::declared(5, None))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.detail.contains("403"), "{err}");
    assert!(!err.is_retryable());
    assert_eq!(err.path, "a/obj.bin");
}

/// The ETag a listing gives `rel` (as the audit pins its quarantine moves to it).
async fn listed_etag(tier: &S3Tier, rel: &str) -> String {
    let (objects, _) = tier.list_stamped_page("a", None).await.unwrap();
    objects
        .into_iter()
        .find(|o| o.rel == rel)
        .unwrap_or_else(|| panic!("{rel} not listed"))
        .etag
}

/// Guards the S3 rename the audit quarantines with: an object (written in one part, and one
/// written in parts, whose ETag is no MD5) ends at its new key with the same bytes and
/// recorded hash and is gone from the old one; an object replaced since it was listed is
/// `SourceChanged` and neither copied nor deleted; a taken new key moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_renamed_on_s3_is_copied_checked_and_only_then_deleted() {
    let tier = tier("quarantine").await;
    let one = bytes(70_000, 41);
    put_raw(&tier, "a/one.bin", &one, Some(&sha_hex(&one))).await;
    let src_dir = tempfile::tempdir().unwrap();
    let big = write(
        src_dir.path(),
        "a/big.bin",
        &bytes((11 * MIB + 7) as usize, 42),
    );
    s3::upload(
        &posix("lab", &src_dir),
        &tier,
        &big,
        &CopyOptions::default(),
        &Progress::new(),
    )
    .await
    .unwrap();

    for (rel, sha) in [
        ("a/one.bin", sha_hex(&one)),
        ("a/big.bin", big.sha256.clone()),
    ] {
        let etag = listed_etag(&tier, rel).await;
        assert_eq!(etag.contains('-'), rel == "a/big.bin", "{etag}");
        let to = format!("q/{rel}");
        let renamed = s3::rename_object(&tier, rel, &to, &etag).await.unwrap();
        assert_eq!(renamed, s3::Renamed::Moved, "{rel}");
        assert!(tier.stat(rel).await.unwrap().is_none(), "{rel} still there");
        let moved = tier.stat(&to).await.unwrap().expect("the copy");
        assert_eq!(moved.sha256_meta.as_deref(), Some(sha.as_str()), "{rel}");
        assert_eq!(tier.hash_file(&to).await.unwrap().sha256, sha, "{rel}");
    }

    // Replaced after it was listed: the listed ETag no longer pins it.
    put_raw(&tier, "a/two.bin", &bytes(5_000, 43), None).await;
    let listed = listed_etag(&tier, "a/two.bin").await;
    let newer = bytes(5_000, 44);
    put_raw(&tier, "a/two.bin", &newer, None).await;
    let err = s3::rename_object(&tier, "a/two.bin", "q/a/two.bin", &listed)
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SourceChanged, "{err}");
    assert!(tier.stat("q/a/two.bin").await.unwrap().is_none());
    assert_eq!(
        tier.hash_file("a/two.bin").await.unwrap().sha256,
        sha_hex(&newer)
    );

    // Something at the new key already: nothing copied over it, nothing deleted.
    let three = bytes(3_000, 45);
    put_raw(&tier, "a/three.bin", &three, None).await;
    put_raw(&tier, "q/a/three.bin", b"other", None).await;
    let etag = listed_etag(&tier, "a/three.bin").await;
    let renamed = s3::rename_object(&tier, "a/three.bin", "q/a/three.bin", &etag)
        .await
        .unwrap();
    assert_eq!(renamed, s3::Renamed::DestinationTaken);
    assert_eq!(
        tier.hash_file("a/three.bin").await.unwrap().sha256,
        sha_hex(&three)
    );
    assert_eq!(
        tier.hash_file("q/a/three.bin").await.unwrap().sha256,
        sha_hex(b"other")
    );
}
