//! `stagehand policy check DIR` (issue 18 item 6) as the built binary: the shipped policies
//! pass with exit 0; a folder with several broken files fails with exit 78 and every problem
//! named as a service at start names it; nothing is connected (the NATS URL given points at a
//! port nothing listens on).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies")
}

fn check(dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", "nats://127.0.0.1:1", "policy", "check"])
        .arg(dir)
        .env_remove("STAGEHAND_NATS_URL")
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn the_shipped_policies_pass_without_a_server() {
    let out = check(&shipped());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("valid") && said.contains("tiers.toml") && said.contains("backup.toml"),
        "{said}"
    );
}

#[test]
fn every_broken_file_is_named_and_the_exit_is_78() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(shipped()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let append = |file: &str, line: &str| {
        let path = dir.join(file);
        let old = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{old}\n{line}\n")).unwrap();
    };
    append("validation.toml", "no_such_key = 1");
    append("backup.toml", "misspelt = true");
    let out = check(&dir);
    let said = text(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{said}");
    assert!(
        said.contains("validation.toml") && said.contains("no_such_key"),
        "{said}"
    );
    assert!(
        said.contains("backup.toml") && said.contains("misspelt"),
        "{said}"
    );
    assert!(said.contains("2 problems"), "{said}");
    // The first line is what a service started with this folder refuses to start with.
    let service = stagehand_policy::Policies::load_dir(&dir).unwrap_err();
    assert_eq!(said.lines().next(), Some(service.to_string().as_str()));
}

#[test]
fn a_folder_that_does_not_exist_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nowhere");
    let out = check(&missing);
    let said = text(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{said}");
    assert!(said.contains(&missing.display().to_string()), "{said}");
}
