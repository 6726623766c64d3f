//! Bounded reads on a posix tier (issue 6 item 7): what a manifest names is read only when it
//! is a regular file of the declared size, without blocking on a FIFO and without hashing a
//! sparse terabyte, and a path the kernel cannot take is that file's permanent problem.

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};
use stagehand_mover::{
    CopyOptions, ErrorKind, FileRef, Mover, MoverConfig, PosixTier, ReadLimit, Tier,
};
use stagehand_schemas::Retryable;

const TIB: u64 = 1 << 40;

fn tier(dir: &Path) -> Tier {
    Tier::Posix(PosixTier::open("source", dir).unwrap())
}

/// Runs `f` with a guard: a read that blocks (a FIFO opened without `O_NONBLOCK`) would
/// never return, so the test fails instead of hanging.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what} blocked"))
}

fn mknod(dir: &Path, name: &str, kind: rustix::fs::FileType, dev: rustix::fs::Dev) {
    let root = std::fs::File::open(dir).unwrap();
    rustix::fs::mknodat(
        &root,
        name,
        kind,
        rustix::fs::Mode::from_raw_mode(0o644),
        dev,
    )
    .unwrap();
}

/// Regression: `openat2` on a FIFO blocked for ever (and progress acks kept the request
/// alive); a FIFO, a socket, a character device and a directory are each `NotAFile`, found
/// without reading, by the bounded hash and by a copy alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_files_are_not_a_file_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    mknod(
        dir.path(),
        "fifo",
        rustix::fs::FileType::Fifo,
        rustix::fs::makedev(0, 0),
    );
    let _socket = UnixListener::bind(dir.path().join("socket")).unwrap();
    // The same device numbers as /dev/null.
    mknod(
        dir.path(),
        "null",
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::makedev(1, 3),
    );
    std::fs::create_dir(dir.path().join("folder")).unwrap();
    let src = tier(dir.path());
    for name in ["fifo", "socket", "null", "folder"] {
        let limit = ReadLimit::declared(0, None);
        let err = within(name, src.hash_file_bounded(name, limit))
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::NotAFile, "{name}: {err}");
        assert!(!err.is_retryable(), "{name}");
        assert_eq!(err.path, name);
        let whole = within(name, src.hash_file(name)).await.unwrap_err();
        assert_eq!(whole.kind, ErrorKind::NotAFile, "{name}: {whole}");
    }

    // A copy whose source is a FIFO fails the same way, and writes nothing.
    let out = tempfile::tempdir().unwrap();
    let dst = tier(out.path());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let opts = CopyOptions {
        expected_hash_unknown: true,
        ..CopyOptions::default()
    };
    let err = within(
        "copying a FIFO",
        mover.copy(&src, &dst, &FileRef::new("fifo", 0, ""), &opts),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotAFile, "{err}");
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
}

/// Regression: a sparse 1 TiB file declared as 1 byte was hashed to its end. Its size comes
/// from `fstat` before any byte is read: a size other than the declared one is
/// `SizeMismatch`, one above the maximum `TooLarge`, both at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_are_checked_before_any_byte_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let sparse = std::fs::File::create(dir.path().join("sparse")).unwrap();
    sparse.set_len(TIB).unwrap();
    std::fs::write(dir.path().join("exact"), b"twelve bytes").unwrap();
    let src = tier(dir.path());

    let err = within(
        "a sparse terabyte",
        src.hash_file_bounded("sparse", ReadLimit::declared(1, None)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");
    assert!(err.detail.contains(&TIB.to_string()), "{err}");
    assert!(!err.is_retryable());

    let err = within(
        "a sparse terabyte",
        src.hash_file_bounded("sparse", ReadLimit::declared(TIB, Some(1 << 30))),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::TooLarge, "{err}");
    assert!(!err.is_retryable());

    let err = src
        .hash_file_bounded(
            "sparse",
            ReadLimit {
                declared_size: None,
                max_size: Some(1 << 20),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::TooLarge, "{err}");

    let ok = src
        .hash_file_bounded("exact", ReadLimit::declared(12, Some(12)))
        .await
        .unwrap();
    assert_eq!(ok.size, 12);
    assert_eq!(ok.sha256, hex::encode(Sha256::digest(b"twelve bytes")));
    let short = src
        .hash_file_bounded("exact", ReadLimit::declared(13, None))
        .await
        .unwrap_err();
    assert_eq!(short.kind, ErrorKind::SizeMismatch);
    let missing = src
        .hash_file_bounded("absent", ReadLimit::declared(1, None))
        .await
        .unwrap_err();
    assert_eq!(missing.kind, ErrorKind::NotFound);
}

/// A joined prefix + path longer than PATH_MAX, or a component longer than NAME_MAX, is
/// `PathRefused` about that one file (permanent), not a request-wide retryable I/O error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_paths_are_refused_per_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = tier(dir.path());
    // Exactly 4096 bytes: a valid relative path, one byte over what the kernel takes with
    // its terminating NUL (ENAMETOOLONG was an `Io` error, retried for ever).
    let at_limit = format!("{}/x", vec!["abcdefgh"; 455].join("/"));
    assert_eq!(at_limit.len(), 4096);
    let long_path = vec!["abcdefgh"; 520].join("/");
    let long_name = "n".repeat(300);
    for rel in [at_limit.as_str(), long_path.as_str(), long_name.as_str()] {
        let err = src
            .hash_file_bounded(rel, ReadLimit::declared(1, None))
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::PathRefused, "{err}");
        assert!(!err.is_retryable());
        assert_eq!(err.path, rel);
    }
}

/// The validator's read of a posix file: its SHA-256 and, for a file declared larger than a
/// piece, its piece hashes from the same read, whether the file is in the page cache or not
/// (an uncached one is read with `O_DIRECT`); a file declared a piece or smaller has none.
#[tokio::test]
async fn a_file_larger_than_a_piece_is_hashed_piece_by_piece_in_the_same_read() {
    use stagehand_schemas::pieces::{PIECE_BYTES, PieceHashes};
    let dir = tempfile::tempdir().unwrap();
    let large: Vec<u8> = (0..2 * PIECE_BYTES + 123)
        .map(|i| (i * 13 + i / 4093) as u8)
        .collect();
    let small = vec![5u8; PIECE_BYTES as usize];
    std::fs::write(dir.path().join("large"), &large).unwrap();
    std::fs::write(dir.path().join("small"), &small).unwrap();
    let src = tier(dir.path());
    let limit = ReadLimit::declared(large.len() as u64, Some(1 << 30));
    for evicted in [false, true] {
        if evicted {
            let file = std::fs::File::open(dir.path().join("large")).unwrap();
            file.sync_all().unwrap();
            rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        }
        let read = src.hash_file_pieces("large", limit).await.unwrap();
        assert_eq!(read.digest.size, large.len() as u64);
        assert_eq!(read.digest.sha256, hex::encode(Sha256::digest(&large)));
        assert_eq!(
            read.pieces,
            Some(PieceHashes::of(&large)),
            "evicted: {evicted}"
        );
    }
    let read = src
        .hash_file_pieces("small", ReadLimit::declared(PIECE_BYTES, None))
        .await
        .unwrap();
    assert_eq!(read.digest.sha256, hex::encode(Sha256::digest(&small)));
    assert_eq!(read.pieces, None);
    let err = src
        .hash_file_pieces("large", ReadLimit::declared(PIECE_BYTES, None))
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");
}

/// A fan-out's slice of a large file read from a posix shared tier: exactly the range's
/// bytes; a range running past the file's end is a size mismatch; the path is confined like
/// every read.
#[tokio::test]
async fn a_range_of_a_file_is_read_exactly_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..3u32 << 20).map(|i| (i * 7 + i / 509) as u8).collect();
    std::fs::write(dir.path().join("large"), &data).unwrap();
    let src = tier(dir.path());
    let got = src.read_range("large", 1_000_000..2_500_001).await.unwrap();
    assert!(got == data[1_000_000..2_500_001], "the range's bytes");
    let end = data.len() as u64;
    let err = src
        .read_range("large", end - 10..end + 10)
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::SizeMismatch, "{err}");
    let err = src.read_range("../large", 0..10).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::PathRefused, "{err}");
    let err = src.read_range("missing", 0..10).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
}
