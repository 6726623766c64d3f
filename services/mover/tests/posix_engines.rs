//! posix → posix transfers on real files, run once per engine (io_uring and pread) so the
//! fallback is held to the same behaviour.

use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};
use stagehand_mover::{
    CommitMode, CopyOptions, CopyOutcome, EngineChoice, ErrorKind, FileRef, Mover, MoverConfig,
    PosixTier, Progress, SkipReason, Tier, VerifyMode,
};
use stagehand_schemas::Retryable;

/// Deterministic pseudo-random bytes (xorshift), different per seed.
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

/// Every file name beneath `root`, relative, sorted (temp files included, so leftovers show).
fn listing(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = walkdir::WalkDir::new(root)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| !e.file_type().is_dir())
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

fn config(engine: EngineChoice) -> MoverConfig {
    MoverConfig {
        engine,
        // Small blocks and few buffers so modest files cross many blocks and every buffer.
        block_size: 64 << 10,
        buffers: 4,
        ..MoverConfig::default()
    }
}

struct Env {
    _dir: tempfile::TempDir,
    src_root: std::path::PathBuf,
    dst_root: std::path::PathBuf,
    src: Tier,
    dst: Tier,
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let src_root = dir.path().join("src");
    let dst_root = dir.path().join("dst");
    std::fs::create_dir_all(&src_root).unwrap();
    std::fs::create_dir_all(&dst_root).unwrap();
    let src = Tier::Posix(PosixTier::open("src", &src_root).unwrap());
    let dst = Tier::Posix(PosixTier::open("dst", &dst_root).unwrap());
    Env {
        _dir: dir,
        src_root,
        dst_root,
        src,
        dst,
    }
}

pub async fn round_trip_with_hash_verification(engine: EngineChoice) {
    let e = env();
    let sizes = [
        0usize,
        1,
        4095,
        65_536,
        65_537,
        (64 << 10) * 4 * 4 + 123,
        3 << 20,
    ];
    let files: Vec<FileRef> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            write(
                &e.src_root,
                &format!("d{}/f{i}.bin", i % 3),
                &data(i as u64, n),
            )
        })
        .collect();
    let mover = Mover::new(config(engine)).unwrap();
    assert_eq!(
        mover.engine_name(),
        if engine == EngineChoice::Pread {
            "pread"
        } else {
            "io_uring"
        }
    );
    let progress = Progress::new();
    let report = mover
        .copy_all(&e.src, &e.dst, &files, &CopyOptions::default(), &progress)
        .await;
    assert_eq!(
        report.files_failed,
        0,
        "{:?}",
        report.failures().collect::<Vec<_>>()
    );
    assert_eq!(report.files_copied, files.len() as u64);
    assert_eq!(report.engine, mover.engine_name());
    for f in &files {
        let got = std::fs::read(e.dst_root.join(&f.path)).unwrap();
        assert_eq!(sha(&got), f.sha256, "{}", f.path);
    }
    assert_eq!(progress.bytes_done(), sizes.iter().sum::<usize>() as u64);
    assert_eq!(progress.files_done(), files.len() as u64);
    assert_eq!(
        listing(&e.dst_root),
        listing(&e.src_root),
        "no temp file left behind"
    );

    // A rerun finds every file in place, verified by reading it.
    let again = mover
        .copy_all(
            &e.src,
            &e.dst,
            &files,
            &CopyOptions::default(),
            &Progress::new(),
        )
        .await;
    assert_eq!(again.files_skipped, files.len() as u64);
    for r in &again.results {
        assert!(matches!(
            r.result,
            Ok(CopyOutcome::Skipped {
                reason: SkipReason::AlreadyPresentVerified,
                ..
            })
        ));
    }
}

pub async fn single_copy_durable_with_read_back(engine: EngineChoice) {
    let e = env();
    let f = write(&e.src_root, "a/b/c.bin", &data(7, 1 << 20));
    let mover = Mover::new(MoverConfig {
        commit_mode: CommitMode::Durable,
        ..config(engine)
    })
    .unwrap();
    let opts = CopyOptions {
        verify_destination: VerifyMode::ReadBack,
        ..CopyOptions::default()
    };
    let out = mover.copy(&e.src, &e.dst, &f, &opts).await.unwrap();
    assert_eq!(
        out,
        CopyOutcome::Copied {
            bytes: 1 << 20,
            sha256: f.sha256.clone(),
            engine: mover.engine_name()
        }
    );
    assert_eq!(
        sha(&std::fs::read(e.dst_root.join("a/b/c.bin")).unwrap()),
        f.sha256
    );
}

pub async fn ten_thousand_small_files(engine: EngineChoice) {
    let e = env();
    let mut files = Vec::new();
    for i in 0..10_000u64 {
        let rel = format!("p{:02}/q{:02}/{i:05}.dat", i % 50, i % 7);
        files.push(write(&e.src_root, &rel, &data(i, (i % 300) as usize)));
    }
    let mover = Mover::new(config(engine)).unwrap();
    // Without recorded hashes: hashed in flight, proven against that.
    let opts = CopyOptions {
        expected_hash_unknown: true,
        ..CopyOptions::default()
    };
    let unknown: Vec<FileRef> = files
        .iter()
        .map(|f| FileRef::new(f.path.clone(), f.size, ""))
        .collect();
    let report = mover
        .copy_all(&e.src, &e.dst, &unknown, &opts, &Progress::new())
        .await;
    assert_eq!(report.files_failed, 0, "{:?}", report.failures().next());
    assert_eq!(report.files_copied, 10_000);
    for (f, r) in files.iter().zip(&report.results) {
        let Ok(CopyOutcome::Copied { sha256, .. }) = &r.result else {
            panic!("{r:?}")
        };
        assert_eq!(sha256, &f.sha256, "the in-flight hash is the file's hash");
    }
    for f in files.iter().step_by(97) {
        assert_eq!(
            sha(&std::fs::read(e.dst_root.join(&f.path)).unwrap()),
            f.sha256
        );
    }
    assert_eq!(
        listing(&e.dst_root).len(),
        10_000,
        "every file, and no temp file"
    );
}

pub async fn source_modified_during_copy(engine: EngineChoice) {
    let e = env();
    let f = write(&e.src_root, "big.bin", &data(3, 24 << 20));
    // A byte-rate limit makes the copy last long enough to change the source underneath it.
    let mover = Mover::new(MoverConfig {
        bytes_per_second: Some(8 << 20),
        ..config(engine)
    })
    .unwrap();
    let progress = Progress::new();
    let (src, dst, file, p) = (e.src.clone(), e.dst.clone(), f.clone(), progress.clone());
    let copy = async move {
        let r = mover
            .copy_all(
                &src,
                &dst,
                std::slice::from_ref(&file),
                &CopyOptions::default(),
                &p,
            )
            .await;
        r.results.into_iter().next().unwrap().result
    };
    let modify = async {
        stagehand_testkit::wait_until(Duration::from_secs(60), "the copy to start", || async {
            progress.bytes_done() > 0
        })
        .await
        .unwrap();
        use std::io::Write;
        let mut w = std::fs::OpenOptions::new()
            .append(true)
            .open(e.src_root.join("big.bin"))
            .unwrap();
        w.write_all(b"appended while copying").unwrap();
    };
    let (result, ()) = tokio::join!(copy, modify);
    let err = result.unwrap_err();
    assert_eq!(err.kind, ErrorKind::SourceChanged, "{err}");
    assert!(err.to_string().contains("big.bin"), "{err}");
    assert!(
        listing(&e.dst_root).is_empty(),
        "nothing published, no temp file: {:?}",
        listing(&e.dst_root)
    );
}

pub async fn wrong_manifest_hash_fails_that_file_only(engine: EngineChoice) {
    let e = env();
    let mut files: Vec<FileRef> = (0..5)
        .map(|i| write(&e.src_root, &format!("f{i}"), &data(i, 100_000)))
        .collect();
    files[2].sha256 = sha(b"something else");
    let mover = Mover::new(config(engine)).unwrap();
    let report = mover
        .copy_all(
            &e.src,
            &e.dst,
            &files,
            &CopyOptions::default(),
            &Progress::new(),
        )
        .await;
    assert_eq!(report.files_copied, 4);
    assert_eq!(report.files_failed, 1);
    let (path, err) = report.failures().next().unwrap();
    assert_eq!(path, "f2");
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch);
    assert!(!err.is_retryable());
    assert_eq!(listing(&e.dst_root), vec!["f0", "f1", "f3", "f4"]);
}

pub async fn refused_paths_create_nothing_outside(engine: EngineChoice) {
    let e = env();
    let outside = e.src_root.parent().unwrap().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"secret").unwrap();
    write(&e.src_root, "ok", b"ok");
    // A symlink on the source tier pointing out of it, and one on the destination tier.
    std::os::unix::fs::symlink(&outside, e.src_root.join("link")).unwrap();
    std::os::unix::fs::symlink(&outside, e.dst_root.join("dlink")).unwrap();
    std::os::unix::fs::symlink(outside.join("secret"), e.src_root.join("filelink")).unwrap();
    let mover = Mover::new(config(engine)).unwrap();
    let s = sha(b"secret");
    for (src_rel, why) in [
        ("../outside/secret", "dotdot"),
        ("/etc/passwd", "absolute"),
        ("a\0b", "nul"),
        ("link/secret", "symlink dir escape"),
        ("filelink", "symlink file"),
    ] {
        let f = FileRef::new(src_rel, 6, s.clone());
        let err = mover
            .copy(&e.src, &e.dst, &f, &CopyOptions::default())
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::PathRefused, "{why}: {err}");
        assert!(!err.is_retryable());
    }
    // Writing through a symlinked directory on the destination is refused too.
    let dst_view = FileRef::new("dlink/new", 2, sha(b"ok"));
    let src_tier = PosixTier::open("src", &e.src_root).unwrap();
    let dst_tier = PosixTier::open("dst", &e.dst_root).unwrap();
    std::fs::create_dir_all(e.src_root.join("dlink")).unwrap();
    std::fs::write(e.src_root.join("dlink/new"), b"ok").unwrap();
    let err = mover
        .copy(
            &Tier::Posix(src_tier),
            &Tier::Posix(dst_tier),
            &dst_view,
            &CopyOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::PathRefused, "{err}");
    assert_eq!(
        listing(&outside),
        vec!["secret"],
        "nothing created outside the root"
    );
    assert_eq!(listing(&e.dst_root), vec!["dlink"]);
}

pub async fn trusted_hash_uses_the_kernel_and_skips_by_size(engine: EngineChoice) {
    let e = env();
    let f = write(&e.src_root, "t.bin", &data(9, 5 << 20));
    let mover = Mover::new(config(engine)).unwrap();
    let opts = CopyOptions {
        trust_recorded_hash: true,
        ..CopyOptions::default()
    };
    let out = mover.copy(&e.src, &e.dst, &f, &opts).await.unwrap();
    let CopyOutcome::Copied { engine: name, .. } = out else {
        panic!("{out:?}")
    };
    assert!(name == "reflink" || name == "copy_file_range", "{name}");
    assert_eq!(
        sha(&std::fs::read(e.dst_root.join("t.bin")).unwrap()),
        f.sha256
    );
    let again = mover.copy(&e.src, &e.dst, &f, &opts).await.unwrap();
    assert!(matches!(
        again,
        CopyOutcome::Skipped {
            reason: SkipReason::AlreadyPresentTrusted,
            ..
        }
    ));
    // A destination of the same size but other bytes is a conflict when not trusting.
    std::fs::write(e.dst_root.join("t.bin"), data(10, 5 << 20)).unwrap();
    let err = mover
        .copy(&e.src, &e.dst, &f, &CopyOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::DestinationConflict, "{err}");
}

/// Unmounts the test's tmpfs even when an assertion fails.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

pub async fn full_destination_is_a_clear_no_space(engine: EngineChoice) {
    let e = env();
    let small = e.dst_root.parent().unwrap().join("small");
    std::fs::create_dir_all(&small).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&small)
        .status()
        .expect("running mount");
    assert!(status.success(), "mounting a 1 MiB tmpfs needs root");
    let _mount = Mount(small.clone());
    let dst = Tier::Posix(PosixTier::open("small", &small).unwrap());
    let big = write(&e.src_root, "big.bin", &data(1, 3 << 20));
    // Many small files whose total overflows the filesystem (no preallocation below 1 MiB).
    let mut files = vec![big];
    for i in 0..40 {
        files.push(write(
            &e.src_root,
            &format!("s/{i:02}"),
            &data(100 + i, 64 << 10),
        ));
    }
    let mover = Mover::new(MoverConfig {
        commit_mode: CommitMode::Durable,
        ..config(engine)
    })
    .unwrap();
    let report = mover
        .copy_all(
            &e.src,
            &dst,
            &files,
            &CopyOptions::default(),
            &Progress::new(),
        )
        .await;
    let big_err = report.results[0].result.as_ref().unwrap_err();
    assert_eq!(big_err.kind, ErrorKind::NoSpace, "{big_err}");
    assert!(
        big_err.to_string().contains("big.bin") && big_err.to_string().contains("small"),
        "{big_err}"
    );
    assert!(report.files_failed >= 2, "the small files overflow it too");
    for r in &report.results {
        if let Err(err) = &r.result {
            assert_eq!(err.kind, ErrorKind::NoSpace, "{err}");
        }
    }
    // Only complete, verified files are visible; no temp file is left.
    for name in listing(&small) {
        assert!(!name.contains(".stagehand-"), "temp file left: {name}");
        let want = files
            .iter()
            .find(|f| f.path == name)
            .expect("only requested names");
        assert_eq!(sha(&std::fs::read(small.join(&name)).unwrap()), want.sha256);
    }
}

/// Sizes around the direct-write threshold and the alignment of direct writes, copied with
/// direct writes on and off (the io_uring engine writes files of 1 MiB and more with
/// `O_DIRECT`, an unaligned last block through the page cache), and small files copied
/// inline: every byte lands, the in-flight hash is the file's, a read-back after a direct
/// copy works, and small files say they were copied inline.
pub async fn direct_buffered_and_inline_paths_agree(engine: EngineChoice) {
    let sizes = [
        4096usize,
        (1 << 20) - 1,
        1 << 20,
        (1 << 20) + 1,
        (2 << 20) + 4096,
        (5 << 20) + 4095,
    ];
    for direct in [true, false] {
        let e = env();
        let files: Vec<FileRef> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| write(&e.src_root, &format!("x/f{i}"), &data(50 + i as u64, n)))
            .collect();
        let mover = Mover::new(MoverConfig {
            direct_writes: direct,
            ..config(engine)
        })
        .unwrap();
        let opts = CopyOptions {
            verify_destination: VerifyMode::ReadBack,
            ..CopyOptions::default()
        };
        let report = mover
            .copy_all(&e.src, &e.dst, &files, &opts, &Progress::new())
            .await;
        assert_eq!(report.files_failed, 0, "{:?}", report.failures().next());
        for (f, r) in files.iter().zip(&report.results) {
            let Ok(CopyOutcome::Copied {
                sha256, engine: by, ..
            }) = &r.result
            else {
                panic!("{r:?}")
            };
            assert_eq!(sha256, &f.sha256, "direct {direct}: {}", f.path);
            let want = if f.size < 128 << 10 {
                "inline"
            } else {
                mover.engine_name()
            };
            assert_eq!(*by, want, "{}", f.path);
            let got = std::fs::read(e.dst_root.join(&f.path)).unwrap();
            assert_eq!(got.len() as u64, f.size, "direct {direct}: {}", f.path);
            assert_eq!(sha(&got), f.sha256, "direct {direct}: {}", f.path);
        }
        assert_eq!(listing(&e.dst_root).len(), files.len(), "no temp file left");
    }
}

/// Sources out of the page cache (as a capacity tier's files are) copied with direct reads
/// on — the io_uring engine reads files of 1 MiB and more that the cache holds less than
/// half of with `O_DIRECT`, each read rounded up to the alignment, the file's end making the
/// last one short — and, read back into the cache, copied again: every byte lands and the
/// in-flight hash is the file's either way.
pub async fn cold_and_cached_sources_copy_every_byte(engine: EngineChoice) {
    let sizes = [1usize << 20, (1 << 20) + 1, (3 << 20) + 4095, 8 << 20];
    for cold in [true, false] {
        let e = env();
        let files: Vec<FileRef> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| write(&e.src_root, &format!("c/f{i}"), &data(90 + i as u64, n)))
            .collect();
        for f in &files {
            let file = std::fs::File::open(e.src_root.join(&f.path)).unwrap();
            file.sync_all().unwrap();
            if cold {
                rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            } else {
                std::io::copy(&mut &file, &mut std::io::sink()).unwrap();
            }
        }
        let mover = Mover::new(config(engine)).unwrap();
        let report = mover
            .copy_all(
                &e.src,
                &e.dst,
                &files,
                &CopyOptions::default(),
                &Progress::new(),
            )
            .await;
        assert_eq!(report.files_failed, 0, "{:?}", report.failures().next());
        for (f, r) in files.iter().zip(&report.results) {
            let Ok(CopyOutcome::Copied { sha256, .. }) = &r.result else {
                panic!("cold {cold}: {r:?}")
            };
            assert_eq!(sha256, &f.sha256, "cold {cold}: {}", f.path);
            let got = std::fs::read(e.dst_root.join(&f.path)).unwrap();
            assert_eq!(got.len() as u64, f.size, "cold {cold}: {}", f.path);
            assert_eq!(sha(&got), f.sha256, "cold {cold}: {}", f.path);
        }
    }
}

macro_rules! engine_tests {
    ($module:ident, $engine:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn round_trip() {
                round_trip_with_hash_verification($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn single_durable_read_back() {
                single_copy_durable_with_read_back($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn small_files() {
                ten_thousand_small_files($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn modified_source() {
                source_modified_during_copy($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn wrong_hash() {
                wrong_manifest_hash_fails_that_file_only($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn confinement() {
                refused_paths_create_nothing_outside($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn trusted_hash() {
                trusted_hash_uses_the_kernel_and_skips_by_size($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn direct_buffered_inline() {
                direct_buffered_and_inline_paths_agree($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cold_and_cached_sources() {
                cold_and_cached_sources_copy_every_byte($engine).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn no_space() {
                full_destination_is_a_clear_no_space($engine).await;
            }
        }
    };
}

engine_tests!(io_uring, EngineChoice::IoUring);
engine_tests!(pread, EngineChoice::Pread);
