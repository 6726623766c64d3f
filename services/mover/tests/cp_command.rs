//! The mover's recursive copy (what `stagehand cp` runs) end to end: in-process through
//! `run_cp`, and as a real process (`stagehand-mover-cp`, options as JSON) killed with SIGKILL
//! in the middle of a large transfer and of an atomic set, then rerun.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sha2::{Digest, Sha256};
use stagehand_mover::cp::{CpOptions, CpSummary, run_cp};
use stagehand_mover::{EngineChoice, PosixTier, Progress, SweepOptions};

fn opts(src: &str, dst: &str) -> CpOptions {
    CpOptions {
        src: src.into(),
        dst: dst.into(),
        ..CpOptions::default()
    }
}

async fn cp(o: CpOptions) -> CpSummary {
    run_cp(&o, &Progress::new()).await.unwrap()
}

fn engine(name: &str) -> EngineChoice {
    match name {
        "io_uring" => EngineChoice::IoUring,
        _ => EngineChoice::Pread,
    }
}

/// Starts `stagehand-mover-cp` with these options.
fn spawn(o: &CpOptions) -> Child {
    Command::new(env!("CARGO_BIN_EXE_stagehand-mover-cp"))
        .arg(serde_json::to_string(o).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Runs `stagehand-mover-cp` to the end and returns its summary.
fn run_process(o: &CpOptions) -> CpSummary {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand-mover-cp"))
        .arg(serde_json::to_string(o).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Waits until `done` holds (the filesystem shows what is waited for), failing if the copy
/// finished first: the state must be seen while the child still runs.
fn wait_while_running(child: &mut Child, what: &str, mut done: impl FnMut() -> bool + Send) {
    let mut finished_first = false;
    stagehand_testkit::wait_until_blocking(Duration::from_secs(60), what, || {
        if done() {
            return true;
        }
        finished_first = child.try_wait().unwrap().is_some();
        finished_first
    })
    .unwrap();
    assert!(!finished_first, "the copy finished before {what}");
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
    let tree = || CpOptions {
        recursive: true,
        ..opts(s, d)
    };

    let first = cp(tree()).await;
    assert_eq!((first.files, first.copied, first.failed), (51, 51, 0));
    assert_eq!(first.exit_code(), 0);
    assert!(first.engine == "io_uring" || first.engine == "pread");
    assert_eq!(std::fs::read(dst.join("n1/m1/f1")).unwrap(), data(1, 4000));

    let second = cp(tree()).await;
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
    let m = cp(CpOptions {
        manifest: Some(mpath.clone()),
        ..opts(s, dst2.to_str().unwrap())
    })
    .await;
    assert_eq!((m.copied, m.failed), (4, 1));
    assert_eq!(m.exit_code(), 1);
    assert_eq!(m.failures[0].path, "n3/m0/f3");
    assert_eq!(m.failures[0].kind, "ChecksumMismatch");
    assert!(!dst2.join("n3/m0/f3").exists());

    // The same manifest as an atomic set: the corrupt file fails the whole set, named, and
    // nothing appears under the destination's name.
    let dst3 = dir.path().join("dst3");
    let a = cp(CpOptions {
        manifest: Some(mpath),
        atomic: true,
        ..opts(s, dst3.to_str().unwrap())
    })
    .await;
    assert_eq!((a.failed, a.exit_code()), (1, 1));
    assert_eq!(a.failures[0].path, "n3/m0/f3");
    assert_eq!(a.failures[0].kind, "ChecksumMismatch");
    assert!(!dst3.exists(), "nothing visible under the set's name");

    // A single file under a new name, like `cp a b`.
    let one = dir.path().join("renamed.bin");
    let r = cp(opts(&format!("{s}/n2/m2/f2"), one.to_str().unwrap())).await;
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

/// Names of the temp files in `dir` (any owner).
fn temps_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".stagehand-") && n.ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Regression (issue 6 item 9): a copy killed mid-transfer left its hidden temp file for
/// ever, beside the finished file of a successful rerun. The rerun now removes it.
fn kill_mid_transfer_then_rerun(engine_name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let dst = dir.path().join("dst");
    for (i, name) in ["a1.bin", "a2.bin", "a3.bin"].iter().enumerate() {
        put(&src, name, &data(i as u8, 2 << 20));
    }
    let big = data(9, 256 << 20);
    put(&src, "z.bin", &big);
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    // One file at a time, in name order, and a byte-rate limit so z.bin takes seconds.
    let slow = CpOptions {
        recursive: true,
        concurrency: 1,
        bytes_per_second: Some(48 << 20),
        engine: engine(engine_name),
        ..opts(s, d)
    };
    let mut child = spawn(&slow);
    wait_while_running(&mut child, "z.bin's temp file appeared", || {
        temp_of(&dst, "z.bin")
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!dst.join("z.bin").exists(), "nothing under the final name");
    assert_eq!(
        temps_in(&dst).len(),
        1,
        "the killed copy left its temp file"
    );
    for (i, name) in ["a1.bin", "a2.bin", "a3.bin"].iter().enumerate() {
        assert_eq!(
            std::fs::read(dst.join(name)).unwrap(),
            data(i as u8, 2 << 20),
            "{name} was complete"
        );
    }

    let summary = run_process(&CpOptions {
        recursive: true,
        engine: engine(engine_name),
        ..opts(s, d)
    });
    assert_eq!(summary.skipped, 3, "{summary:?}");
    assert_eq!(summary.copied, 1, "{summary:?}");
    assert_eq!(summary.engine, engine_name);
    assert_eq!(summary.stale_removed, 1, "{summary:?}");
    assert_eq!(sha(&std::fs::read(dst.join("z.bin")).unwrap()), sha(&big));
    assert_eq!(
        temps_in(&dst),
        Vec::<String>::new(),
        "no stale temp file left"
    );
}

#[test]
fn kill_9_mid_transfer_io_uring() {
    kill_mid_transfer_then_rerun("io_uring");
}

#[test]
fn kill_9_mid_transfer_pread() {
    kill_mid_transfer_then_rerun("pread");
}

/// A sweep never takes a live copy's temp file, and removes it (with its bytes counted) once
/// its writer is provably dead.
#[test]
fn sweep_spares_a_live_copy_and_removes_a_killed_ones_temp_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let dst = dir.path().join("dst");
    put(&src, "big.bin", &data(3, 64 << 20));
    std::fs::create_dir_all(&dst).unwrap();
    let mut child = spawn(&CpOptions {
        recursive: true,
        bytes_per_second: Some(8 << 20),
        ..opts(src.to_str().unwrap(), dst.to_str().unwrap())
    });
    let tier = PosixTier::open("dst", &dst).unwrap();
    wait_while_running(&mut child, "the temp file appeared", || {
        temp_of(&dst, "big.bin")
    });
    let live = tier.sweep_stale("", SweepOptions::default()).unwrap();
    assert_eq!((live.files_removed, live.live), (0, 1), "{live:?}");
    assert!(temp_of(&dst, "big.bin"), "a live copy's temp file is kept");
    child.kill().unwrap();
    child.wait().unwrap();
    let temp = dst.join(&temps_in(&dst)[0]);
    let size = std::fs::metadata(&temp).unwrap().len();
    let dead = tier.sweep_stale("", SweepOptions::default()).unwrap();
    assert_eq!((dead.files_removed, dead.live), (1, 0), "{dead:?}");
    assert_eq!(dead.bytes_removed, size);
    assert!(!temp.exists());
}

/// Regular, non-temp files directly in `dir`.
fn finished_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}

/// The staging folders in `dir`.
fn staging_dirs(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".stagehand-set-"))
        .map(|e| e.path())
        .collect()
}

/// An atomic set copy killed with SIGKILL leaves nothing under the final name; the rerun
/// resumes the dead run's staging folder and copies only the files it had not finished.
#[test]
fn kill_9_mid_atomic_set_then_resume_without_recopying() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let out = dir.path().join("out");
    let fin = out.join("v1");
    let names: Vec<String> = (0..8).map(|i| format!("f{i}.bin")).collect();
    for (i, name) in names.iter().enumerate() {
        put(&src, name, &data(i as u8, 2 << 20));
    }
    let set = CpOptions {
        recursive: true,
        atomic: true,
        concurrency: 1,
        ..opts(src.to_str().unwrap(), fin.to_str().unwrap())
    };
    let mut child = spawn(&CpOptions {
        bytes_per_second: Some(8 << 20),
        ..set.clone()
    });
    wait_while_running(&mut child, "three files were staged", || {
        std::fs::create_dir_all(&out).unwrap();
        staging_dirs(&out)
            .first()
            .is_some_and(|s| finished_files(s).len() >= 3)
    });
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!fin.exists(), "nothing visible under the final name");
    let staged = staging_dirs(&out);
    assert_eq!(staged.len(), 1);
    let done_before = finished_files(&staged[0]).len() as u64;
    assert!((3..8).contains(&done_before), "{done_before}");

    let rerun = run_process(&set);
    assert_eq!(rerun.failed, 0, "{rerun:?}");
    assert_eq!(
        (rerun.skipped, rerun.copied),
        (done_before, 8 - done_before),
        "finished files are not copied again"
    );
    assert_eq!(finished_files(&fin), names);
    for (i, name) in names.iter().enumerate() {
        assert_eq!(
            sha(&std::fs::read(fin.join(name)).unwrap()),
            sha(&data(i as u8, 2 << 20))
        );
    }
    assert_eq!(
        staging_dirs(&out).len(),
        0,
        "the staging folder became the set"
    );
    assert_eq!(temps_in(&fin), Vec::<String>::new());
    // Once published, a rerun finds the set present and reads nothing.
    let again = run_process(&set);
    assert_eq!((again.copied, again.skipped), (0, 8));
}

/// A dead run's staging folder is kept by `sweep_stale` while it is young enough to be
/// resumed (only the temp file it was killed in the middle of goes), and removed whole, its
/// files and bytes counted, once older than `keep_sets_for`.
#[test]
fn sweep_keeps_a_dead_runs_staging_folder_for_a_resume_then_removes_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let out = dir.path().join("out");
    for i in 0..6u8 {
        put(&src, &format!("f{i}.bin"), &data(i, 2 << 20));
    }
    let mut child = spawn(&CpOptions {
        recursive: true,
        atomic: true,
        concurrency: 1,
        bytes_per_second: Some(8 << 20),
        ..opts(src.to_str().unwrap(), out.join("v1").to_str().unwrap())
    });
    wait_while_running(&mut child, "a file was staged", || {
        std::fs::create_dir_all(&out).unwrap();
        staging_dirs(&out)
            .first()
            .is_some_and(|s| !finished_files(s).is_empty())
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let staging = staging_dirs(&out).remove(0);
    let finished = finished_files(&staging);
    let temps = temps_in(&staging).len() as u64;
    let tier = PosixTier::open("out", &out).unwrap();

    let young = tier
        .sweep_stale(
            "",
            SweepOptions {
                keep_sets_for: Duration::from_secs(3600),
            },
        )
        .unwrap();
    assert_eq!(
        (young.sets_kept, young.sets_removed, young.files_removed),
        (1, 0, temps),
        "{young:?}"
    );
    assert_eq!(
        finished_files(&staging),
        finished,
        "finished files stay for a resume"
    );
    assert_eq!(temps_in(&staging), Vec::<String>::new());

    let old = tier
        .sweep_stale(
            "",
            SweepOptions {
                keep_sets_for: Duration::ZERO,
            },
        )
        .unwrap();
    assert_eq!(
        (old.sets_removed, old.files_removed, old.bytes_removed),
        (1, finished.len() as u64, finished.len() as u64 * (2 << 20)),
        "{old:?}"
    );
    assert!(!staging.exists());
    assert!(!out.join("v1").exists());
}
