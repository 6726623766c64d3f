//! `stagehand cp` as people run it: the real binary's arguments reach the mover, its JSON
//! summary comes back, and a failed file sets the exit code. The copy itself (kill -9, resume,
//! stale temp files) is tested in the mover's own `tests/cp_command.rs`.

use std::process::Command;

fn stagehand(args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .arg("cp")
        .args(args)
        .output()
        .unwrap();
    let summary = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap(), summary)
}

#[test]
fn stagehand_cp_copies_a_tree_atomically_and_reports_failures_in_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    for i in 0..5 {
        std::fs::write(src.join(format!("a/b/f{i}")), vec![i as u8; 1000 * (i + 1)]).unwrap();
    }
    let dst = dir.path().join("out/v1");
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    let (code, summary) = stagehand(&[
        s,
        d,
        "-r",
        "--atomic",
        "--json",
        "--engine",
        "pread",
        "--priority",
        "stage",
        "--verify",
        "read-back",
    ]);
    assert_eq!(code, 0, "{summary}");
    assert_eq!(
        (summary["copied"].as_u64(), summary["failed"].as_u64()),
        (Some(5), Some(0))
    );
    assert_eq!(summary["engine"], "pread");
    assert_eq!(std::fs::read(dst.join("a/b/f4")).unwrap(), vec![4u8; 5000]);

    // A manifest whose one entry is wrong: exit 1, the file named.
    let manifest = dir.path().join("m.tsv");
    std::fs::write(&manifest, format!("a/b/f0\t1000\t{}\n", "0".repeat(64))).unwrap();
    let (code, summary) = stagehand(&[
        s,
        dir.path().join("other").to_str().unwrap(),
        "--manifest",
        manifest.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 1, "{summary}");
    assert_eq!(summary["failures"][0]["path"], "a/b/f0");
    assert_eq!(summary["failures"][0]["kind"], "ChecksumMismatch");
}
