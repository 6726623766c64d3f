//! `stagehand cp` end to end: in-process through `run_cp`, and as a real process killed with
//! SIGKILL in the middle of a large transfer.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use sha2::{Digest, Sha256};
use stagehand_mover::cp::{CpArgs, run_cp};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: CpArgs,
}

fn args(list: &[&str]) -> CpArgs {
    let mut v = vec!["stagehand-cp"];
    v.extend_from_slice(list);
    Cli::parse_from(v).args
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `len` bytes that differ per seed and per MiB (cheap to make in a debug build).
fn data(seed: u8, len: usize) -> Vec<u8> {
    let block: Vec<u8> = (0..(1usize << 20))
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut out = Vec::with_capacity(len);
    let mut n = 0u32;
    while out.len() < len {
        let take = (len - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
        out.extend_from_slice(&n.to_le_bytes()[..(len - out.len()).min(4)]);
        n += 1;
    }
    out.truncate(len);
    out
}

fn put(root: &Path, rel: &str, bytes: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_copies_a_tree_then_skips_it_and_verifies_a_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let dst = dir.path().join("dst");
    for i in 0..50u8 {
        put(
            &src,
            &format!("n{}/m{}/f{i}", i % 4, i % 3),
            &data(i, 1000 + usize::from(i) * 3000),
        );
    }
    put(&src, "empty", b"");
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());

    let first = run_cp(args(&[s, d, "-r", "--json"])).await.unwrap();
    assert_eq!((first.files, first.copied, first.failed), (51, 51, 0));
    assert_eq!(first.exit_code(), 0);
    assert!(first.engine == "io_uring" || first.engine == "pread");
    assert_eq!(std::fs::read(dst.join("n1/m1/f1")).unwrap(), data(1, 4000));

    let second = run_cp(args(&[s, d, "-r"])).await.unwrap();
    assert_eq!(
        (second.copied, second.skipped),
        (0, 51),
        "a rerun skips verified files"
    );

    // A manifest with one wrong hash: that entry fails, the others land and are verified.
    let dst2 = dir.path().join("dst2");
    let mut manifest = String::new();
    for i in 0..5u8 {
        let rel = format!("n{}/m{}/f{i}", i % 4, i % 3);
        let bytes = data(i, 1000 + usize::from(i) * 3000);
        let hash = if i == 3 {
            sha(b"not these bytes")
        } else {
            sha(&bytes)
        };
        manifest.push_str(&format!("{rel}\t{}\t{hash}\n", bytes.len()));
    }
    let mpath = dir.path().join("manifest.tsv");
    std::fs::write(&mpath, manifest).unwrap();
    let m = run_cp(args(&[
        s,
        dst2.to_str().unwrap(),
        "--manifest",
        mpath.to_str().unwrap(),
        "--json",
    ]))
    .await
    .unwrap();
    assert_eq!((m.copied, m.failed), (4, 1));
    assert_eq!(m.exit_code(), 1);
    assert_eq!(m.failures[0].path, "n3/m0/f3");
    assert_eq!(m.failures[0].kind, "ChecksumMismatch");
    assert!(!dst2.join("n3/m0/f3").exists());

    // A single file under a new name, like `cp a b`.
    let one = dir.path().join("renamed.bin");
    let r = run_cp(args(&[&format!("{s}/n2/m2/f2"), one.to_str().unwrap()]))
        .await
        .unwrap();
    assert_eq!(r.copied, 1);
    assert_eq!(std::fs::read(&one).unwrap(), data(2, 7000));
}

fn temp_of(dir: &Path, name: &str) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok).any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!(".{name}.stagehand-"))
            })
        })
        .unwrap_or(false)
}

fn kill_mid_transfer_then_rerun(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let dst = dir.path().join("dst");
    for (i, name) in ["a1.bin", "a2.bin", "a3.bin"].iter().enumerate() {
        put(&src, name, &data(i as u8, 2 << 20));
    }
    let big = data(9, 256 << 20);
    put(&src, "z.bin", &big);
    let bin = env!("CARGO_BIN_EXE_stagehand-mover-cp");
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    // One file at a time, in name order, and a byte-rate limit so z.bin takes seconds.
    let mut child = Command::new(bin)
        .args([
            s,
            d,
            "-r",
            "--quiet",
            "--concurrency",
            "1",
            "--bwlimit",
            "48M",
            "--engine",
            engine,
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !temp_of(&dst, "z.bin") {
        assert!(
            child.try_wait().unwrap().is_none(),
            "cp finished before it could be killed"
        );
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "z.bin's temp file never appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!dst.join("z.bin").exists(), "nothing under the final name");
    for (i, name) in ["a1.bin", "a2.bin", "a3.bin"].iter().enumerate() {
        assert_eq!(
            std::fs::read(dst.join(name)).unwrap(),
            data(i as u8, 2 << 20),
            "{name} was complete"
        );
    }

    let out = Command::new(bin)
        .args([s, d, "-r", "--json", "--engine", engine])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["skipped"], 3, "{summary}");
    assert_eq!(summary["copied"], 1, "{summary}");
    assert_eq!(summary["engine"], engine.replace('-', "_"));
    assert_eq!(sha(&std::fs::read(dst.join("z.bin")).unwrap()), sha(&big));
}

#[test]
fn kill_9_mid_transfer_io_uring() {
    kill_mid_transfer_then_rerun("io-uring");
}

#[test]
fn kill_9_mid_transfer_pread() {
    kill_mid_transfer_then_rerun("pread");
}
