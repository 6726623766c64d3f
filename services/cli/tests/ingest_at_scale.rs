//! Issue 7: a dataset of 300,000 files ingested end to end through `stagehand up` as it runs
//! for users — the real `stagehand up` process with its own nats-server (stock `max_payload`),
//! the real `stagehand ingest --wait` — validated as one version, whose files the catalogue
//! lists exactly, page after page, with `stagehand catalogue show D@V --limit/--after`, and
//! streams with `--json`. It is the suite's longest test (about a minute on two cores: 120
//! times the inline manifest bound, thirty pages); the 1,000,000-file figures are
//! `loadtest/ingest`'s.

mod up_child;

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, bail, ensure};
use up_child::Up;

const FILES: usize = 300_000;
const FOLDERS: usize = 300;

fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    Ok(cmd
        .args(args)
        .env("STAGEHAND_NATS_URL", url)
        .env_remove("STAGEHAND_HOME")
        .stdin(Stdio::null())
        .output()?)
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_thousand_files_through_stagehand_up_are_one_version_paged_exactly()
-> anyhow::Result<()> {
    // Everything (the folder, the home with its tiers and nats-server's store) on a tmpfs of
    // its own: the test is about counts and pages, and a disk shared with other builds makes
    // tens of thousands of creates and unlinks take minutes.
    let scratch = tempfile::tempdir()?;
    // 8g: nats-server gives JetStream 75 % of the space it finds, and the project's upload
    // bucket reserves its 4 GiB bound at creation (the tmpfs takes memory only as written).
    let tmpfs = stagehand_testkit::Tmpfs::mount(scratch.path().join("fs"), "8g");
    let home = tempfile::tempdir_in(tmpfs.path())?;
    // The shipped policies, as `up` writes them (max_entries far above this version's).
    let policies = home.path().join("policies");
    stagehand::up::write_default_policies(&policies, home.path())?;

    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut up = Up::start(
        home.path(),
        port,
        home.path().join("up.stderr"),
        &[("RUST_LOG", "warn")],
    )?;
    // The files, on the local disk, written while `up` starts.
    let folder = tempfile::tempdir_in(tmpfs.path())?;
    let mut expected = Vec::with_capacity(FILES);
    for d in 0..FOLDERS {
        let dir = folder.path().join(format!("shard-{d:03}"));
        std::fs::create_dir(&dir)?;
        for f in 0..FILES / FOLDERS {
            let name = format!("{f:04}.txt");
            std::fs::write(dir.join(&name), format!("{d}/{f}\n"))?;
            expected.push(format!("shard-{d:03}/{name}"));
        }
    }
    expected.sort();
    up.wait_up().await?;
    let url = format!("nats://127.0.0.1:{port}");

    let out = stagehand(
        &url,
        &[
            "ingest",
            folder.path().to_str().context("utf-8")?,
            "--project",
            "lab-a",
            "--dataset",
            "frames",
            "--policies",
            policies.to_str().context("utf-8")?,
            "--wait",
            "--timeout",
            "1800",
            "--json",
        ],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(report["files"], FILES, "{report}");
    assert_eq!(report["by_reference"], true);
    let version = report["outcome"]["validated"]["version"]
        .as_str()
        .with_context(|| format!("not validated: {report}"))?
        .to_owned();
    assert_eq!(report["digest"], version.as_str());

    // Every file, page after page, each page starting after the last path of the one before.
    let target = format!("frames@{}", &version[..16]);
    let mut listed: Vec<String> = Vec::with_capacity(FILES);
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut args = vec![
            "catalogue",
            "show",
            &target,
            "--project",
            "lab-a",
            "--limit",
            "10000",
        ];
        if let Some(a) = &after {
            args.extend(["--after", a.as_str()]);
        }
        let out = stagehand(&url, &args)?;
        ensure!(out.status.success(), "{}", said(&out));
        let text = String::from_utf8(out.stdout)?;
        if pages == 0 {
            ensure!(
                text.contains(&format!("{FILES} files")),
                "the version says how many files it has: {text:.400}"
            );
        }
        let before = listed.len();
        // File lines are `    path<TAB>size<TAB>sha256`; replica lines have no tab.
        listed.extend(
            text.lines()
                .filter_map(|l| l.strip_prefix("    "))
                .filter_map(|l| match l.split('\t').collect::<Vec<_>>()[..] {
                    [path, _, sha256] if sha256.len() == 64 => Some(path.to_owned()),
                    _ => None,
                }),
        );
        pages += 1;
        ensure!(
            listed.len() > before,
            "page {pages} listed no file: {text:.400}"
        );
        match text.lines().find_map(|l| l.split_once("more: ")) {
            Some((_, more)) => {
                let next = more
                    .rsplit_once("--after ")
                    .map(|(_, p)| p.trim_matches('\'').to_owned())
                    .context("a cursor")?;
                ensure!(
                    Some(&next) == listed.last(),
                    "the cursor is the page's last path"
                );
                after = Some(next);
            }
            None => break,
        }
        if pages > FILES / 100 {
            bail!("paging does not end");
        }
    }
    assert_eq!(listed.len(), FILES, "after {pages} pages");
    assert!(pages > 1);
    assert_eq!(listed, expected);

    // Streamed with --json: one JSON line per file, every file once, in path order.
    let out = stagehand(
        &url,
        &["catalogue", "show", &target, "--project", "lab-a", "--json"],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let streamed: Vec<String> = String::from_utf8(out.stdout)?
        .lines()
        .map(|l| {
            let file: serde_json::Value = serde_json::from_str(l)?;
            file["path"]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("a file line without a path: {l}"))
        })
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(streamed, expected);

    // Stopped as a person stops it.
    up.ctrl_c()?;
    let status = up.wait_exit().await?;
    assert!(status.success(), "{status}");
    Ok(())
}
