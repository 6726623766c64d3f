//! The runbooks are executed as written. Every fenced shell block (```sh or ```bash) of
//! `runbooks/*.md` runs verbatim, in order, with `bash -euo pipefail`, in the environment
//! `runbooks/README.md` documents (the built `stagehand` first on `PATH`, `STAGEHAND_NATS_URL`,
//! `STAGEHAND_HOME`, `STAGEHAND_PROJECT`, and the page's own variables from its *You need*
//! section), against a real nats-server with the real services in which the test first
//! produced the page's failure; the page's *Confirm* blocks must then succeed (they are run
//! again until they do, within a deadline, as an operator reruns `stagehand status`). A command
//! or flag that does not exist fails the suite twice: in the static check of every
//! `stagehand …` line and when its block runs. Blocks of another kind are output samples
//! (`text`) or file contents (`toml`, `json`); anything else (`console`, an untyped fence) is
//! refused, so that no command can hide from the run.
//!
//! Also checked: every `runbook_url` of `deploy/prometheus/alerts.rules.yml` and every page
//! `stagehand status` names is a page that exists, and the README lists every page.
//!
//! One stack for the pages that share it; its scenarios run one after the other, each
//! starting from a `stagehand status` that exits 0 and ending when it does again. What a
//! person does outside Stagehand (an uploader fixing a folder, a supervisor restarting a
//! service, a disk's owner moving files) the test does between the page's sections, as the
//! page says. Stage-stuck runs on a stack of its own, as it needs the validator from the start
//! and no promoter; so do replica-damaged and drill-failed, which need the backup copier;
//! nats-node-lost, whose services run on a three-node NATS cluster; new-project, whose
//! services run as their own NATS users of the shipped accounts config (`common::tenants`);
//! node-lost, which needs the demoter and two node agents, each with a local tier;
//! scrub-behind, whose demoter scrubs under a budget of the test's; drill-overdue, whose backup
//! copier's drill clock is held back; backlog-growing, whose validator is stopped;
//! s3-tier-unreachable, whose validator runs as its own process with an S3 tier's credentials;
//! fanout-peer-dropped, whose three node agents fan out to each other, one serving a copy that
//! rotted on its disk; and stage-failed, whose held job is a real Slurm job (`common::slurm`).
//! In every stack the bounded tiers (hot and local), whose fill `stagehand status` measures by
//! their filesystem, are filesystems of their own (`own_disks`): no status, quiet or loud,
//! hangs on how full the host's disk is.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{PROJECT, Stagehand, WAIT};
use stagehand_bus::runner::WorkerSettings;
use stagehand_manifest::{Manifest, ManifestStore};
use stagehand_schemas::{EventId, FileRef, Location, sha256_hex};
use stagehand_testkit::{
    NatsCluster, ServiceProcess, StageRequest, Tmpfs, repo_root, validated_fact,
    wait_until_blocking,
};
use time::OffsetDateTime;

/// Fence languages whose blocks run.
const SHELL: &[&str] = &["sh", "bash"];
/// Fence languages that are samples or file contents, never run.
const SAMPLES: &[&str] = &["text", "toml", "json"];

/// Pages whose failure this suite does not produce yet, each with why; their commands are
/// still checked against the CLI (`every_stagehand_command_in_the_pages_exists`).
const NOT_YET_RUN: &[(&str, &str)] = &[];

/// Pages the stack tests below run, each with its failure produced.
const RUN: &[&str] = &[
    "dead-letters-waiting.md",
    "inspect-rejected-upload.md",
    "catalogue-problems.md",
    "rebuild-catalogue.md",
    "tier-above-watermark.md",
    "quota-nearly-full.md",
    "stray-data.md",
    "service-silent.md",
    "stage-stuck.md",
    "replica-damaged.md",
    "drill-failed.md",
    "nats-node-lost.md",
    "new-project.md",
    "node-lost.md",
    "scrub-behind.md",
    "drill-overdue.md",
    "backlog-growing.md",
    "s3-tier-unreachable.md",
    "fanout-peer-dropped.md",
    "upgrade.md",
    "stage-failed.md",
];

#[test]
fn every_page_is_run_or_listed_as_not_yet_run() {
    let pages: BTreeSet<String> = page_names().into_iter().collect();
    let mut listed = BTreeSet::new();
    for page in RUN.iter().chain(NOT_YET_RUN.iter().map(|(p, _)| p)) {
        assert!(listed.insert((*page).to_owned()), "{page} listed twice");
    }
    assert_eq!(pages, listed, "runbooks/ against RUN and NOT_YET_RUN");
}

/// One fenced block of a page.
#[derive(Debug, Clone)]
struct Block {
    /// Line of the opening fence, from 1.
    line: usize,
    /// The `## ` heading the block is under.
    section: String,
    lang: String,
    code: String,
}

/// A runbook page: its headings and blocks.
#[derive(Debug)]
struct Page {
    name: String,
    headings: Vec<String>,
    blocks: Vec<Block>,
}

fn pages_dir() -> PathBuf {
    repo_root().join("runbooks")
}

impl Page {
    fn read(name: &str) -> Page {
        let path = pages_dir().join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let mut headings = Vec::new();
        let mut blocks = Vec::new();
        let mut section = String::new();
        let mut open: Option<(usize, String, String, String)> = None;
        for (i, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if let Some((start, indent, lang, mut code)) = open.take() {
                if trimmed.starts_with("```") {
                    blocks.push(Block {
                        line: start,
                        section: section.clone(),
                        lang,
                        code,
                    });
                } else {
                    code.push_str(line.strip_prefix(indent.as_str()).unwrap_or(trimmed));
                    code.push('\n');
                    open = Some((start, indent, lang, code));
                }
                continue;
            }
            if let Some(lang) = trimmed.strip_prefix("```") {
                let indent = line[..line.len() - trimmed.len()].to_owned();
                open = Some((i + 1, indent, lang.trim().to_owned(), String::new()));
            } else if let Some(h) = line.strip_prefix("## ") {
                section = h.trim().to_owned();
                headings.push(section.clone());
            }
        }
        assert!(open.is_none(), "{name}: a fence is never closed");
        Page {
            name: name.to_owned(),
            headings,
            blocks,
        }
    }

    fn shell_blocks(&self) -> impl Iterator<Item = &Block> {
        self.blocks
            .iter()
            .filter(|b| SHELL.contains(&b.lang.as_str()))
    }

    /// The blocks of the sections from the one whose heading starts with `from` (the first
    /// section when none) up to, not including, the one starting with `to` (to the end).
    fn between(&self, from: Option<&str>, to: Option<&str>) -> Vec<&Block> {
        let index = |wanted: &str| {
            self.headings
                .iter()
                .position(|h| h.starts_with(wanted))
                .unwrap_or_else(|| {
                    panic!(
                        "{}: no section {wanted:?} in {:?}",
                        self.name, self.headings
                    )
                })
        };
        let first = from.map_or(0, index);
        let end = to.map_or(self.headings.len(), index);
        self.shell_blocks()
            .filter(|b| {
                // Blocks before the first heading belong to no section: the page's opening.
                let at = self.headings.iter().position(|h| *h == b.section);
                at.is_some_and(|at| (first..end).contains(&at)) || (at.is_none() && from.is_none())
            })
            .collect()
    }
}

/// Every page of `runbooks/` but the README, sorted.
fn page_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(pages_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md") && n != "README.md")
        .collect();
    names.sort();
    names
}

/// `runbooks/<page>.md` named anywhere in `text`.
fn pages_named_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in text.match_indices("runbooks/") {
        let rest = &text[at + "runbooks/".len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'))
            .unwrap_or(rest.len());
        let name = rest[..end].trim_end_matches('.');
        if name.ends_with(".md") {
            out.insert(name.to_owned());
        }
    }
    out
}

#[test]
fn every_block_is_a_shell_block_or_a_sample_and_every_page_has_symptoms_and_confirm() {
    let mut wrong = Vec::new();
    for name in page_names() {
        let page = Page::read(&name);
        for b in &page.blocks {
            if !SHELL.contains(&b.lang.as_str()) && !SAMPLES.contains(&b.lang.as_str()) {
                wrong.push(format!(
                    "{name}:{}: a ```{} block (shell blocks are sh or bash; samples text, toml or json)",
                    b.line, b.lang
                ));
            }
        }
        for wanted in ["Symptoms", "Confirm"] {
            if !page.headings.iter().any(|h| h.starts_with(wanted)) {
                wrong.push(format!("{name}: no `## {wanted}` section"));
            }
        }
        if page.shell_blocks().next().is_none() {
            wrong.push(format!("{name}: no shell block"));
        }
        if page.between(Some("Confirm"), None).is_empty() {
            wrong.push(format!("{name}: its Confirm section has no shell block"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_page_the_alerts_status_and_readme_name_exists_and_the_readme_lists_every_page() {
    let pages: BTreeSet<String> = page_names().into_iter().collect();
    let root = repo_root();
    let alerts = std::fs::read_to_string(root.join("deploy/prometheus/alerts.rules.yml")).unwrap();
    let urls: Vec<&str> = alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("runbook_url:"))
        .map(str::trim)
        .collect();
    assert!(urls.len() >= 8, "runbook_urls: {urls:?}");
    let mut missing = Vec::new();
    for url in &urls {
        match url.strip_prefix("runbooks/") {
            Some(page) if pages.contains(page) => {}
            _ => missing.push(format!("alerts.rules.yml: runbook_url {url}")),
        }
    }
    let status = std::fs::read_to_string(root.join("services/cli/src/status.rs")).unwrap();
    let named = pages_named_in(&status);
    assert!(named.len() >= 5, "status.rs names {named:?}");
    for page in named {
        if !pages.contains(&page) {
            missing.push(format!("status.rs: runbooks/{page}"));
        }
    }
    let readme = std::fs::read_to_string(pages_dir().join("README.md")).unwrap();
    for page in &pages {
        if !readme.contains(&format!("]({page})")) {
            missing.push(format!("README.md does not list {page}"));
        }
    }
    for name in &pages {
        for linked in pages_named_in(&std::fs::read_to_string(pages_dir().join(name)).unwrap()) {
            if !pages.contains(&linked) {
                missing.push(format!("{name}: links runbooks/{linked}"));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// Each `stagehand …` command of a shell line: its words up to the end of the command.
fn stagehand_commands(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in code.lines() {
        // A comment starts at a `#` after a blank.
        let line = match line.find(" #") {
            Some(at) => &line[..at],
            None if line.trim_start().starts_with('#') => "",
            None => line,
        };
        let mut rest = line;
        while let Some(at) = rest.find("stagehand ") {
            let before = rest[..at].trim_end();
            let starts_command = before.is_empty()
                || ["|", ";", "&&", "||", "$(", "do", "then", "!"]
                    .iter()
                    .any(|sep| before.ends_with(sep));
            let tail = &rest[at + "stagehand ".len()..];
            let end = tail.find(['|', ';', ')', '&']).unwrap_or(tail.len());
            if starts_command {
                out.push(tail[..end].split_whitespace().map(str::to_owned).collect());
            }
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn every_stagehand_command_in_the_pages_exists_with_its_flags() {
    let mut wrong = Vec::new();
    let mut seen = 0;
    for name in page_names().into_iter().chain(["README.md".to_owned()]) {
        let page = Page::read(&name);
        for b in page.shell_blocks() {
            for words in stagehand_commands(&b.code) {
                seen += 1;
                // The subcommands: the leading plain words.
                let path: Vec<&str> = words
                    .iter()
                    .map(String::as_str)
                    .take_while(|w| {
                        w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
                    })
                    .collect();
                let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
                    .args(&path)
                    .arg("--help")
                    .output()
                    .unwrap();
                let help = String::from_utf8_lossy(&out.stdout);
                if !out.status.success() {
                    wrong.push(format!(
                        "{name}:{}: `stagehand {}`: {}",
                        b.line,
                        path.join(" "),
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                    continue;
                }
                for flag in words.iter().filter(|w| w.starts_with("--")) {
                    let flag = flag.split('=').next().unwrap();
                    let known = help
                        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '<')
                        .any(|w| w == flag);
                    if !known {
                        wrong.push(format!(
                            "{name}:{}: `stagehand {}` has no {flag}",
                            b.line,
                            path.join(" ")
                        ));
                    }
                }
            }
        }
    }
    assert!(seen > 20, "only {seen} stagehand commands found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// An operator's shell: the environment `runbooks/README.md` documents, and the variables the
/// blocks run so far have set.
struct Shell {
    env: BTreeMap<String, String>,
    dir: tempfile::TempDir,
    /// Flags this operator gives `stagehand status` (a page's threshold, such as
    /// `--backlog-after`), in the shell's own status checks as in the page's.
    status_flags: Vec<String>,
}

/// What one run of blocks did.
struct Ran {
    ok: bool,
    output: String,
}

impl Shell {
    /// The shell of an operator of the Stagehand at `url` (its NATS servers, comma separated)
    /// whose home is `home`.
    fn new(url: &str, stagehand_home: &Path) -> Shell {
        let dir = tempfile::tempdir().unwrap();
        let bin = Path::new(env!("CARGO_BIN_EXE_stagehand")).parent().unwrap();
        let home = dir.path().join("operator");
        std::fs::create_dir_all(&home).unwrap();
        let env = BTreeMap::from([
            (
                "PATH".to_owned(),
                format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display()),
            ),
            ("HOME".to_owned(), home.display().to_string()),
            ("USER".to_owned(), "oncall".to_owned()),
            ("LANG".to_owned(), "C.UTF-8".to_owned()),
            (stagehand_bus::env::NATS_URL.to_owned(), url.to_owned()),
            (
                "STAGEHAND_HOME".to_owned(),
                stagehand_home.display().to_string(),
            ),
            ("STAGEHAND_PROJECT".to_owned(), PROJECT.to_owned()),
        ]);
        Shell {
            env,
            dir,
            status_flags: Vec::new(),
        }
    }

    fn set(&mut self, var: &str, value: impl Into<String>) {
        self.env.insert(var.to_owned(), value.into());
    }

    /// Runs `blocks` as one script; on success the variables they set stay set.
    fn run(&mut self, page: &str, blocks: &[&Block]) -> Ran {
        let mut script = String::from("set -a\n");
        for b in blocks {
            script.push_str(&format!("# runbooks/{page}:{}\n{}", b.line, b.code));
        }
        script.push_str("env -0 > \"$1\"\n");
        let keep = self.dir.path().join("env");
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script, "runbook"])
            .arg(&keep)
            .env_clear()
            .envs(&self.env)
            .current_dir(self.dir.path())
            .output()
            .unwrap();
        let output = format!(
            "{script}\n--- stdout\n{}--- stderr\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            return Ran { ok: false, output };
        }
        let kept = std::fs::read(&keep).unwrap();
        for pair in kept.split(|b| *b == 0).filter(|p| !p.is_empty()) {
            let pair = String::from_utf8_lossy(pair);
            if let Some((k, v)) = pair.split_once('=')
                && !["PWD", "OLDPWD", "SHLVL", "_"].contains(&k)
            {
                self.env.insert(k.to_owned(), v.to_owned());
            }
        }
        Ran { ok: true, output }
    }

    /// Runs the blocks of `page` from section `from` up to section `to`; returns the script and
    /// its output, and panics with them when they fail.
    fn steps(&mut self, page: &Page, from: Option<&str>, to: Option<&str>) -> String {
        let blocks = page.between(from, to);
        assert!(
            !blocks.is_empty(),
            "{}: no shell block between {from:?} and {to:?}",
            page.name
        );
        let ran = self.run(&page.name, &blocks);
        assert!(ran.ok, "runbooks/{} failed:\n{}", page.name, ran.output);
        ran.output
    }

    /// Runs the page's Confirm blocks until they succeed.
    fn confirm(&mut self, page: &Page) {
        let blocks = page.between(Some("Confirm"), None);
        let mut last = String::new();
        let done = wait_until_blocking(WAIT, &format!("runbooks/{} confirmed", page.name), || {
            let ran = self.run(&page.name, &blocks);
            last = ran.output;
            ran.ok
        });
        if let Err(e) = done {
            let services = self
                .status()
                .map(|(_, r)| r["services"].clone())
                .unwrap_or_default();
            panic!("{e}; the last run:\n{last}\nservices now: {services:#}");
        }
    }

    /// Runs the page's Confirm blocks once and panics if they succeed: while the failure the
    /// test produced holds, a Confirm that passes would confirm nothing.
    fn not_yet_confirmed(&mut self, page: &Page) {
        let blocks = page.between(Some("Confirm"), None);
        let ran = self.run(&page.name, &blocks);
        assert!(
            !ran.ok,
            "runbooks/{} confirmed before its failure was fixed:\n{}",
            page.name, ran.output
        );
    }

    /// Runs the built `stagehand` with `args` in this shell's environment.
    fn stagehand(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_stagehand"))
            .args(args)
            .env_clear()
            .envs(&self.env)
            .output()
            .unwrap()
    }

    /// Has a job stage `target` on `tier`, as its prolog does: requests it and waits until it
    /// is ready; panics with the CLI's output when it is not.
    fn stage(&self, target: &str, tier: &str, job: &str) {
        self.stage_with(target, tier, job, &[]);
    }

    /// [`Shell::stage`] onto `node`'s node-local `tier`.
    fn stage_on_node(&self, target: &str, tier: &str, node: &str, job: &str) {
        self.stage_with(target, tier, job, &["--node", node]);
    }

    /// [`Shell::stage`] with `more` arguments to both the request and the wait.
    fn stage_with(&self, target: &str, tier: &str, job: &str, more: &[&str]) {
        let request = ["stage", "request", target, "--tier", tier, "--job", job];
        let wait = [
            "stage",
            "wait",
            target,
            "--tier",
            tier,
            "--job",
            job,
            "--timeout",
            "60",
        ];
        for args in [&request[..], &wait[..]] {
            let args = [args, more].concat();
            let out = self.stagehand(&args);
            assert!(
                out.status.success(),
                "stagehand {}: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Has `job` release its stage of `target` on `tier` (`more`: `--node N`), as its epilog
    /// does, and waits until the catalogue shows it released: a copy no job holds is left to
    /// the next request when it is found damaged, not repaired at once.
    fn release(&self, target: &str, tier: &str, job: &str, more: &[&str]) {
        let args = [
            &["stage", "release", target, "--tier", tier, "--job", job][..],
            more,
        ]
        .concat();
        let out = self.stagehand(&args);
        assert!(
            out.status.success(),
            "stagehand {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let dataset = target.split('@').next().unwrap();
        wait_until_blocking(WAIT, &format!("{target} released by {job}"), || {
            let out = self.stagehand(&["stage", "status", job, "--json"]);
            let stages: Vec<serde_json::Value> =
                serde_json::from_slice(&out.stdout).unwrap_or_default();
            stages
                .iter()
                .any(|s| s["dataset"] == dataset && s["tier"] == tier && s["state"] == "released")
        })
        .unwrap();
    }

    /// `stagehand status --json` as this shell runs it: its exit code and its object.
    fn status(&self) -> Option<(i32, serde_json::Value)> {
        let mut args = vec!["status", "--json"];
        args.extend(self.status_flags.iter().map(String::as_str));
        let out = self.stagehand(&args);
        let code = out.status.code()?;
        (code == 0 || code == 1).then(|| (code, serde_json::from_slice(&out.stdout).unwrap()))
    }

    /// Waits until `stagehand status` exits 0: nothing needs a person.
    fn quiet(&self, before: &str) {
        let mut last = serde_json::Value::Null;
        let done = wait_until_blocking(
            WAIT,
            &format!("status quiet before {before}"),
            || match self.status() {
                Some((code, report)) => {
                    last = report;
                    code == 0
                }
                None => false,
            },
        );
        if let Err(e) = done {
            // The findings are what keeps it loud; the consumers' table would bury them.
            panic!("{e}: {:#}", last["findings"]);
        }
    }

    /// Waits until `stagehand status` names `page` for a finding; returns the finding.
    fn status_names(&self, page: &str) -> serde_json::Value {
        let mut last = serde_json::Value::Null;
        let wanted = format!("runbooks/{page}");
        let found = wait_until_blocking(WAIT, &format!("status naming {wanted}"), || {
            let Some((code, report)) = self.status() else {
                return false;
            };
            let hit = code == 1
                && report["findings"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f["run"].as_str().unwrap().contains(&wanted));
            last = report;
            hit
        });
        if let Err(e) = found {
            panic!("{e}: {last:#}");
        }
        last["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["run"].as_str().unwrap().contains(&wanted))
            .unwrap()
            .clone()
    }
}

/// Writes `n` small files of an upload beneath `folder`: enough of them that the manifest
/// travels by reference, through the project's upload bucket.
fn write_upload(folder: &Path, n: usize) {
    for i in 0..n {
        let path = folder.join(format!("shard-{:02}/sample-{i:05}.txt", i % 16));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, format!("sample {i}\n")).unwrap();
    }
}

/// Size of the filesystem each bounded tier has of its own ([`own_disks`]), MiB.
const TIER_DISK_MIB: u64 = 64;
/// What Stagehand may place on each of them (`capacity`), MiB: less than the filesystem, so
/// that what `stagehand status` counts is what Stagehand placed there.
const TIER_CAPACITY_MIB: u64 = 48;
/// Every project's quota on each of them, MiB.
const TIER_QUOTA_MIB: u64 = 40;

/// Puts every bounded posix tier of the policies at `policies` (hot and local: the tiers whose
/// fill `stagehand status` measures, by `statvfs` of their root) on a tmpfs of its own of
/// [`TIER_DISK_MIB`], of which Stagehand may use [`TIER_CAPACITY_MIB`] and each project
/// [`TIER_QUOTA_MIB`]: what status finds there is then what the test put there, however full
/// the host's disk is (on the host's disk, a tier's unused capacity the disk can no longer
/// give counts as used). Called before any service that opens those tiers starts (the
/// promoter, a node agent, the demoter hold a tier's root open from their start, and would
/// write beneath the mount) and that reads `tiers.toml`'s limits. Returns the mounts by tier
/// name; they are unmounted when dropped, which must be before the home is removed.
fn own_disks(home: &Path, policies: &Path) -> BTreeMap<String, Tmpfs> {
    let load = || stagehand_policy::Policies::load_dir_with_home(policies, home).unwrap();
    let bounded: BTreeMap<String, PathBuf> = (load().tiers().values())
        .filter(|t| t.limits.is_some())
        .filter_map(|t| match &t.kind {
            stagehand_policy::TierKind::Posix { root } => Some((t.name.clone(), root.clone())),
            stagehand_policy::TierKind::S3(_) => None,
        })
        .collect();
    assert!(bounded.contains_key("hot"), "{bounded:?}");
    // Each bounded tier's capacity, and each quota on it, made to fit its filesystem.
    let tiers = policies.join("tiers.toml");
    let text = std::fs::read_to_string(&tiers).unwrap();
    let mut section = String::new();
    let text: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with('[') {
                section = l.trim().to_owned();
            }
            let Some((key, _)) = l
                .split_once('=')
                .filter(|_| !l.trim_start().starts_with('#'))
            else {
                return l.to_owned();
            };
            let key = key.trim();
            let limit = bounded.keys().find_map(|t| {
                if section == format!("[tiers.{t}]") && key == "capacity" {
                    Some(TIER_CAPACITY_MIB)
                } else if section == format!("[tiers.{t}.quotas]") {
                    Some(TIER_QUOTA_MIB)
                } else {
                    None
                }
            });
            match limit {
                Some(mib) => format!("{key} = \"{mib} MiB\""),
                None => l.to_owned(),
            }
        })
        .collect();
    std::fs::write(&tiers, text.join("\n") + "\n").unwrap();
    let mib = |n: u64| n << 20;
    for tier in load()
        .tiers()
        .values()
        .filter(|t| bounded.contains_key(&t.name))
    {
        let limits = tier.limits.as_ref().unwrap();
        assert_eq!(limits.capacity, mib(TIER_CAPACITY_MIB), "{}", tier.name);
        assert!(
            (limits.quotas.values().chain(&limits.default_quota))
                .all(|q| *q == mib(TIER_QUOTA_MIB)),
            "{}: {limits:?}",
            tier.name
        );
    }
    bounded
        .into_iter()
        .map(|(name, root)| {
            // Mounted over, anything already there would be hidden from the tier's readers.
            let written = std::fs::read_dir(&root).map_or(0, |d| d.count());
            assert_eq!(written, 0, "{} written to before its disk", root.display());
            let disk = Tmpfs::mount(&root, &format!("{TIER_DISK_MIB}m"));
            // As the stack made it: jobs, an ordinary user, read the hot and local tiers.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
            (name, disk)
        })
        .collect()
}

/// The pages that need no more than the shared stack (a nats-server, the recorder, the
/// validator), each with its failure produced and fixed in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_page_run_verbatim_fixes_the_failure_the_test_produced() {
    let mut stack = Stagehand::start(common::Options::default()).await.unwrap();
    // The hot tier is a 64 MiB filesystem of its own, of which Stagehand may use 48 MiB and
    // the project 40 MiB.
    let disks = own_disks(stack.home.path(), &stack.policies);
    let tiers = stack.policies.join("tiers.toml");
    let hot = stack.home.path().join("tiers/hot");
    let disk = &disks["hot"];
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let mut exercised = BTreeSet::new();
    shell.quiet("the first page");

    // dead-letters-waiting: an upload whose manifest object vanished before the validator
    // read it is retried, then dead-lettered; the uploader puts it back and on-call replays.
    let page = Page::read("dead-letters-waiting.md");
    let uploads = tempfile::tempdir().unwrap();
    let birds = uploads.path().join("birds");
    write_upload(&birds, 4000);
    stack.ingest(&birds, "birds", false).unwrap();
    let manifests = stack
        .bus
        .jetstream()
        .get_object_store(stagehand_schemas::subject::upload_manifest_bucket(PROJECT))
        .await
        .unwrap();
    let names: Vec<String> = {
        use futures::TryStreamExt;
        manifests
            .list()
            .await
            .unwrap()
            .map_ok(|o| o.name)
            .try_collect()
            .await
            .unwrap()
    };
    assert_eq!(names.len(), 1, "{names:?}");
    manifests.delete(&names[0]).await.unwrap();
    stack.start_validator_with(WorkerSettings {
        max_attempts: Some(2),
        retry: Some(stagehand_bus::RetrySchedule {
            initial: std::time::Duration::from_millis(100),
            ..Default::default()
        }),
        ..Default::default()
    });
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["subject"], "ingest-validator", "{finding:#}");
    shell.set("SERVICE", "ingest-validator");
    shell.steps(&page, None, Some("3."));
    // The uploader uploads again, which puts the manifest back.
    stack.ingest(&birds, "birds", false).unwrap();
    shell.steps(&page, Some("3."), Some("Confirm"));
    shell.confirm(&page);
    wait_until_blocking(WAIT, "the replayed upload validated", || {
        validated(&shell, "birds")
    })
    .unwrap();
    exercised.insert(page.name.clone());

    // inspect-rejected-upload: an upload with editor litter in it is rejected; the uploader
    // removes it and submits again.
    let page = Page::read("inspect-rejected-upload.md");
    shell.quiet(&page.name);
    let cats = uploads.path().join("cats");
    write_upload(&cats, 3);
    std::fs::write(cats.join(".DS_Store"), b"litter").unwrap();
    let rejected = shell.stagehand(&[
        "ingest",
        "--dataset",
        "cats",
        "--wait",
        "--timeout",
        "60",
        cats.to_str().unwrap(),
    ]);
    assert_eq!(
        rejected.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&rejected.stderr)
    );
    shell.set("DATASET", "cats");
    shell.set("FOLDER", cats.display().to_string());
    shell.set(
        "SOURCE_ROOT",
        stack.home.path().join("tiers/source").display().to_string(),
    );
    shell.steps(&page, None, Some("3."));
    std::fs::remove_file(cats.join(".DS_Store")).unwrap();
    shell.steps(&page, Some("3."), Some("Confirm"));
    shell.confirm(&page);
    exercised.insert(page.name.clone());

    // catalogue-problems: a version validated while the services' bucket held other bytes
    // under its manifest's name cannot be folded; once the manifest is put back, the
    // recorder's dead letter of the fact is replayed and folds it.
    let page = Page::read("catalogue-problems.md");
    shell.quiet(&page.name);
    let files: Vec<FileRef> = (0..3)
        .map(|i| {
            let body = format!("otter {i}\n");
            FileRef::new(
                format!("otter-{i}.txt"),
                body.len() as u64,
                sha256_hex(body.as_bytes()),
            )
        })
        .collect();
    let manifest = Manifest::from_entries(files.clone());
    stack
        .bus
        .jetstream()
        .get_object_store(stagehand_schemas::subject::MANIFEST_BUCKET)
        .await
        .unwrap()
        .put(manifest.digest(), &mut &b"not the manifest\n"[..])
        .await
        .unwrap();
    stack
        .bus
        .publish(&validated_fact(
            PROJECT,
            EventId::new("otters-upload-1").unwrap(),
            "otters",
            Location {
                tier: "source".into(),
                prefix: format!("{PROJECT}/otters"),
            },
            &files,
            Some(manifest.reference()),
        ))
        .await
        .unwrap();
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["area"], "catalogue", "{finding:#}");
    shell.steps(&page, None, Some("3."));
    // The manifest put back, as validating the upload again puts it.
    ManifestStore::open(
        stack.bus.jetstream(),
        stagehand_schemas::subject::MANIFEST_BUCKET,
    )
    .await
    .unwrap()
    .put(&manifest)
    .await
    .unwrap();
    shell.steps(&page, Some("3."), Some("Confirm"));
    shell.confirm(&page);
    exercised.insert(page.name.clone());

    // rebuild-catalogue: the recorder's store is lost; a recorder started without it
    // rebuilds the catalogue from the streams.
    let rebuild = Page::read("rebuild-catalogue.md");
    shell.quiet(&rebuild.name);
    shell.set(
        "STORE",
        stack
            .home
            .path()
            .join("state/catalogue/catalogue.redb")
            .display()
            .to_string(),
    );
    stack.stop_recorder().await.unwrap();
    shell.steps(&rebuild, None, Some("3."));
    stack.start_recorder();
    shell.confirm(&rebuild);
    exercised.insert(rebuild.name.clone());

    // tier-above-watermark: others' files fill the hot tier's filesystem; their owner moves
    // them away.
    let page = Page::read("tier-above-watermark.md");
    shell.quiet(&page.name);
    disk.fill();
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["subject"], "hot", "{finding:#}");
    shell.set("TIER", "hot");
    shell.set("TIER_ROOT", hot.display().to_string());
    shell.steps(&page, None, Some("Confirm"));
    disk.free();
    shell.confirm(&page);
    exercised.insert(page.name.clone());

    // quota-nearly-full: a job stages 37 MiB of the project on hot, whose quota is 40 MiB;
    // the project's owner is given more.
    let page = Page::read("quota-nearly-full.md");
    shell.quiet(&page.name);
    stack.start_promoter();
    let seals = uploads.path().join("seals");
    for i in 0..37 {
        let path = seals.join(format!("part-{i:02}.bin"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, vec![i as u8; 1 << 20]).unwrap();
    }
    let version = stack.ingest(&seals, "seals", true).unwrap();
    shell.stage(&format!("seals@{version}"), "hot", "train-7");
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["subject"], "lab on hot", "{finding:#}");
    shell.set("TIER", "hot");
    shell.steps(&page, None, Some("Confirm"));
    // The project is given 48 MiB on hot.
    let text = std::fs::read_to_string(&tiers).unwrap();
    let text = text.replacen(
        "[tiers.hot.quotas]\n",
        "[tiers.hot.quotas]\nlab = \"48 MiB\"\n",
        1,
    );
    std::fs::write(&tiers, text).unwrap();
    shell.confirm(&page);
    exercised.insert(page.name.clone());

    // stray-data: a job's copy on hot vanishes behind Stagehand's back and someone leaves a
    // folder there; the audit reports both, announces the copy lost, and quarantines the
    // folder once past the grace. The next job staging the version repairs the copy.
    let page = Page::read("stray-data.md");
    shell.quiet(&page.name);
    let birds_version = common::digest_of(&birds).unwrap();
    shell.stage(&format!("birds@{birds_version}"), "hot", "train-8");
    let birds_on_hot = hot.join(format!("{PROJECT}/birds/{birds_version}"));
    assert!(birds_on_hot.is_dir(), "{}", birds_on_hot.display());
    let strays = hot.join(format!("{PROJECT}/strays"));
    stagehand_testkit::put_files(&strays, &[("x/a.bin", [1u8; 1000])]);
    // Untouched for longer than scrub.toml's `quarantine_after` (7 days).
    stagehand_testkit::backdate(&strays, 8);
    std::fs::remove_dir_all(&birds_on_hot).unwrap();
    shell.set("TIER", "hot");
    shell.steps(&page, None, Some("3."));
    let audited: serde_json::Value =
        serde_json::from_slice(&std::fs::read(shell.dir.path().join("audit.json")).unwrap())
            .unwrap();
    let listed = |list: &str, key: &str| -> Vec<String> {
        audited[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e[key].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        (listed("stray", "path"), listed("lost", "dataset")),
        (vec![format!("{PROJECT}/strays")], vec!["birds".to_owned()]),
        "{audited:#}"
    );
    // The audit announced the copy lost: the catalogue holds it damaged.
    let finding = shell.status_names("replica-damaged.md");
    assert!(
        finding["subject"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{PROJECT}/birds@{}", &birds_version[..12])),
        "{finding:#}"
    );
    shell.steps(&page, Some("3."), Some("Confirm"));
    assert!(!strays.exists(), "{} not quarantined", strays.display());
    // The next job asking for the version on hot has the promoter copy it again.
    shell.stage(&format!("birds@{birds_version}"), "hot", "train-9");
    shell.confirm(&page);
    exercised.insert(page.name.clone());

    // service-silent: a demoter killed without unwinding stops beating; its supervisor starts
    // it again.
    let page = Page::read("service-silent.md");
    shell.quiet(&page.name);
    let (binary, config) = demoter_process(&stack);
    let log = stack.home.path().join("demoter.log");
    let mut demoter = ServiceProcess::spawn(&binary, &config, &log, &[]);
    wait_until_blocking(WAIT, "the demoter alive", || demoter_alive(&shell))
        .unwrap_or_else(|e| panic!("{e}: {}", std::fs::read_to_string(&log).unwrap_or_default()));
    demoter.kill();
    // A heartbeat is silent after `--silent-after`, a minute: the wait is that long.
    let finding = wait_for_blocking(std::time::Duration::from_secs(120), || {
        shell.status().and_then(|(_, r)| {
            r["findings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["subject"] == "demoter on runbooks")
                .cloned()
        })
    });
    assert!(
        finding["run"]
            .as_str()
            .unwrap()
            .contains("runbooks/service-silent.md"),
        "{finding:#}"
    );
    shell.set("SERVICE", "demoter");
    shell.steps(&page, None, Some("Confirm"));
    let _demoter = ServiceProcess::spawn(&binary, &config, &log, &[]);
    wait_until_blocking(WAIT, "the restarted demoter alive", || {
        demoter_alive(&shell)
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {:#}\n{}",
            shell
                .status()
                .map(|(_, r)| r["services"].clone())
                .unwrap_or_default(),
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    shell.confirm(&page);
    exercised.insert(page.name.clone());

    let not_yet: BTreeSet<String> = NOT_YET_RUN.iter().map(|(p, _)| (*p).to_owned()).collect();
    for page in &exercised {
        assert!(
            !not_yet.contains(page),
            "{page} runs: take it off NOT_YET_RUN"
        );
    }
    let run: BTreeSet<String> = RUN.iter().map(|p| (*p).to_owned()).collect();
    assert!(
        exercised.is_subset(&run),
        "pages run here but not listed in RUN: {:?}",
        exercised.difference(&run).collect::<Vec<_>>()
    );
    drop(disks);
}

/// The demoter's binary, built beside `stagehand`, and a config of it (instance `runbooks`)
/// for `stack`: run as its own process, as its supervisor would, so that a test can kill it.
fn demoter_process(stack: &Stagehand) -> (PathBuf, PathBuf) {
    let binary = Path::new(env!("CARGO_BIN_EXE_stagehand")).with_file_name("stagehand-demoter");
    assert!(
        binary.exists(),
        "{} is missing: cargo build -p stagehand-demoter",
        binary.display()
    );
    let config = stack.home.path().join("demoter.toml");
    std::fs::write(
        &config,
        format!(
            "[bus]\nservers = [\"{}\"]\nclient_name = \"demoter\"\n\n[worker]\ninstance_id = \"runbooks\"\n\n\
             [service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\n",
            stack.url,
            stack.policies.display(),
            stack.home.path().join("state/demoter").display()
        ),
    )
    .unwrap();
    (binary, config)
}

/// Replaces `from` by `to` in the stack's policy file `name`, before the service reading it
/// starts.
fn edit_policy(stack: &Stagehand, name: &str, from: &str, to: &str) {
    let path = stack.policies.join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{} has no {from:?}", path.display());
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
}

/// Whether `stagehand status` shows a demoter instance alive.
fn demoter_alive(shell: &Shell) -> bool {
    shell.status().is_some_and(|(_, r)| {
        r["services"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["service"] == "demoter" && s["state"] == "alive")
    })
}

/// Whether the catalogue lists a validated version of `dataset` in the shell's project.
fn validated(shell: &Shell, dataset: &str) -> bool {
    let out = shell.stagehand(&["catalogue", "show", dataset, "--json", "--project", PROJECT]);
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    shown["versions"].as_array().is_some_and(|v| !v.is_empty())
}

/// [`wait_until_blocking`] for a value: polls `f` until it gives one; panics at `timeout`.
fn wait_for_blocking<T: Send>(
    timeout: std::time::Duration,
    mut f: impl FnMut() -> Option<T> + Send,
) -> T {
    let mut found = None;
    wait_until_blocking(timeout, "a status finding", || {
        found = f();
        found.is_some()
    })
    .unwrap();
    found.unwrap()
}

/// stage-stuck: a stage a job asked for two hours ago still waits (no promoter runs); the job
/// is gone, and on-call cancels it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stuck_stage_is_found_and_cancelled_by_its_page() {
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("stage-stuck.md");
    let uploads = tempfile::tempdir().unwrap();
    let cats = uploads.path().join("cats");
    write_upload(&cats, 3);
    let version = stack.ingest(&cats, "cats", true).unwrap();
    shell.quiet(&page.name);
    let request = StageRequest::new(PROJECT, "cats", &version, "hot", "train-42")
        .at(OffsetDateTime::now_utc() - time::Duration::hours(2))
        .event();
    stack.bus.publish(&request).await.unwrap();
    let finding = shell.status_names(&page.name);
    assert!(
        finding["subject"]
            .as_str()
            .unwrap()
            .ends_with("on hot for job train-42"),
        "{finding:#}"
    );
    shell.set("TARGET", format!("cats@{}", &version[..12]));
    shell.set("TIER", "hot");
    shell.set("JOB", "train-42");
    shell.steps(&page, None, Some("2."));
    shell.steps(&page, Some("3."), Some("Confirm"));
    // The promoter carries a cancel out; this stage waited because none ran, and on-call
    // brings it back (the page's table, first row): the cancel, kept in the stream, is
    // carried out then, or the stage it lets through turns ready.
    stack.start_promoter();
    shell.confirm(&page);
}

/// replica-damaged: a copy on hot no job holds any more is lost, and `stagehand audit`
/// announces it damaged. A hot copy is not the scrub's to repair, and the promoter repairs one
/// only while a job holds it, so it stays damaged until on-call restores it from the version's
/// backup.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_copy_is_restored_from_its_backup_by_its_page() {
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    stack.start_promoter();
    stack.start_backup_copier();
    stack.ready().await.unwrap();
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("replica-damaged.md");
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    let owls_version = stack.ingest(&owls, "owls", true).unwrap();
    // A second, larger copy on hot, so that losing the first stays below the audit's
    // `stop_above_fraction` of the tier.
    let gulls = uploads.path().join("gulls");
    std::fs::create_dir_all(&gulls).unwrap();
    std::fs::write(gulls.join("part-00.bin"), vec![7u8; 1 << 20]).unwrap();
    let gulls_version = stack.ingest(&gulls, "gulls", true).unwrap();
    shell.stage(&format!("owls@{owls_version}"), "hot", "train-3");
    shell.stage(&format!("gulls@{gulls_version}"), "hot", "train-3");
    wait_until_blocking(WAIT, "owls backed up", || {
        let out = shell.stagehand(&["backup", "status", "--json"]);
        String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap_or_default();
            line["version"] == owls_version.as_str() && !line["last_backup"].is_null()
        })
    })
    .unwrap();
    shell.quiet(&page.name);
    let owls_on_hot = stack
        .home
        .path()
        .join(format!("tiers/hot/{PROJECT}/owls/{owls_version}"));
    assert!(owls_on_hot.is_dir(), "{}", owls_on_hot.display());
    // train-3 ends and releases owls (a copy a job holds would be repaired by the promoter at
    // once); then the copy is lost.
    shell.release(&format!("owls@{owls_version}"), "hot", "train-3", &[]);
    std::fs::remove_dir_all(&owls_on_hot).unwrap();
    let audited = shell.stagehand(&["audit", "hot"]);
    assert_eq!(
        audited.status.code(),
        Some(1),
        "{}{}",
        String::from_utf8_lossy(&audited.stdout),
        String::from_utf8_lossy(&audited.stderr)
    );
    let finding = shell.status_names(&page.name);
    assert!(
        finding["subject"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{PROJECT}/owls@{}", &owls_version[..12])),
        "{finding:#}"
    );
    shell.set("DATASET", "owls");
    shell.set("VERSION", &owls_version[..12]);
    shell.set("TIER", "hot");
    shell.steps(&page, None, Some("Confirm"));
    shell.confirm(&page);
    assert!(
        owls_on_hot.is_dir(),
        "{} not restored",
        owls_on_hot.display()
    );
}

/// drill-failed: one byte of a version's backup is flipped, as a failing disk would. The next
/// restore drill fails, and the catalogue holds that backup damaged; the demoter's scrub
/// repairs it from the source tier's copy, and the drill after the repair verifies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_drill_is_repaired_and_drilled_again_by_its_page() {
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    // A drill every two seconds and a scrub pass every second, so that the page's waits are
    // the test's seconds rather than production's day.
    edit_policy(
        &stack,
        "backup.toml",
        "drill_every = \"24h\"",
        "drill_every = \"2s\"",
    );
    edit_policy(
        &stack,
        "scrub.toml",
        "check_every = \"10m\"",
        "check_every = \"1s\"",
    );
    stack.start_backup_copier();
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("drill-failed.md");
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    let version = stack.ingest(&owls, "owls", true).unwrap();
    wait_until_blocking(WAIT, "the backup of owls drilled", || {
        let out = shell.stagehand(&["backup", "status", "--json"]);
        String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap_or_default();
            line["version"] == version.as_str() && line["last_drill"]["ok"] == true
        })
    })
    .unwrap();
    shell.quiet(&page.name);

    let sample = "shard-00/sample-00000.txt";
    let backup = stack
        .home
        .path()
        .join(format!("tiers/backup/{PROJECT}/owls/{version}/{sample}"));
    let good = std::fs::read(owls.join(sample)).unwrap();
    assert_eq!(std::fs::read(&backup).unwrap(), good);
    let mut flipped = good.clone();
    flipped[0] ^= 0x01;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&backup, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&backup, &flipped).unwrap();

    let finding = shell.status_names(&page.name);
    assert_eq!(
        finding["subject"],
        format!("{PROJECT}/owls@{} on backup", &version[..12]),
        "{finding:#}"
    );
    shell.set("BACKUP_TIER", "backup");
    let found = shell.steps(&page, None, Some("2."));
    assert!(found.contains("checksum_mismatch"), "{found}");
    // The demoter runs in production all along; started only now, its repair cannot hide the
    // failed drill from the page before the page has found it.
    let (binary, config) = demoter_process(&stack);
    let log = stack.home.path().join("demoter.log");
    let demoter = ServiceProcess::spawn(&binary, &config, &log, &[]);
    shell.steps(&page, Some("2."), Some("Confirm"));
    shell.confirm(&page);
    assert_eq!(
        std::fs::read(&backup).unwrap(),
        good,
        "the backup's file is not repaired byte for byte:\n{}",
        demoter.log()
    );
}

/// node-lost: two nodes hold a version on their local tiers; node B's agent stops and stays
/// silent past `agent_silent_after`, so the demoter marks B's copy unreachable and status names
/// B. The page finds the node; B's supervisor starts its agent again (the page's step 2, first
/// case), which re-checks the copy, and the page confirms the node's line gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_nodes_copies_are_found_and_its_agents_return_confirmed_by_its_page() {
    const NODE_A: &str = "gpu-a";
    const NODE_B: &str = "gpu-b";
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        // Seconds rather than production's two minutes, so that the page's wait is short; ten
        // of them (a beat every 2.5 s), so that a machine busy with builds does not make a
        // beating agent look silent.
        agent_silent_after: Some("10s".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    // The services that open the hot and local tiers start once those have their disks: the
    // promoter, the two nodes' agents, and the demoter (its own process, as its supervisor
    // runs it).
    let _disks = own_disks(stack.home.path(), &stack.policies);
    stack.start_promoter();
    for node in [NODE_A, NODE_B] {
        stack.start_node_agent(node).unwrap();
    }
    stack.ready().await.unwrap();
    let (binary, config) = demoter_process(&stack);
    let log = stack.home.path().join("demoter.log");
    let demoter = ServiceProcess::spawn(&binary, &config, &log, &[]);
    let mut shell = Shell::new(&stack.url, stack.home.path());
    wait_until_blocking(WAIT, "the demoter alive", || demoter_alive(&shell))
        .unwrap_or_else(|e| panic!("{e}: {}", demoter.log()));
    let page = Page::read("node-lost.md");
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    let version = stack.ingest(&owls, "owls", true).unwrap();
    let target = format!("owls@{version}");
    for node in [NODE_A, NODE_B] {
        shell.stage_on_node(&target, "local", node, &format!("train-{node}"));
    }
    usable_on(&shell, &target, &[NODE_A, NODE_B]);
    shell.quiet(&page.name);
    // The shared promoter and both agents run on this one host: each is an instance of its
    // own, none a restart of another.
    let (_, report) = shell.status().unwrap();
    let promoters: Vec<&serde_json::Value> = (report["services"].as_array().unwrap().iter())
        .filter(|s| s["service"] == "promoter")
        .collect();
    assert_eq!(promoters.len(), 3, "{:#}", report["services"]);
    assert!(
        promoters.iter().all(|s| s["restarts"] == 0),
        "{:#}",
        report["services"]
    );

    stack.stop_node_agent(NODE_B).await.unwrap();
    let finding = shell.status_names(&page.name);
    let subject = format!("{NODE_B} (tier local)");
    assert_eq!(finding["subject"], subject.as_str(), "{finding:#}");
    usable_on(&shell, &target, &[NODE_A]);
    shell.set("NODE", NODE_B);
    let said = shell.steps(&page, None, Some("Confirm"));
    let seen: Vec<serde_json::Value> = serde_json::Deserializer::from_str(
        said.split("--- stdout\n")
            .nth(1)
            .unwrap()
            .split("--- stderr\n")
            .next()
            .unwrap(),
    )
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap_or_else(|e| panic!("{e}: {said}"));
    assert!(
        seen.len() == 1 && seen[0]["subject"] == subject.as_str(),
        "{said}"
    );
    // Its supervisor starts the agent again.
    stack.start_node_agent(NODE_B).unwrap();
    shell.confirm(&page);
    usable_on(&shell, &target, &[NODE_A, NODE_B]);
}

/// Waits until `stagehand stage where` lists exactly `nodes` as holding a usable copy of
/// `target`; panics with its last answer.
fn usable_on(shell: &Shell, target: &str, nodes: &[&str]) {
    let mut last = String::new();
    let listed = wait_until_blocking(WAIT, &format!("{target} usable on {nodes:?}"), || {
        let out = shell.stagehand(&["stage", "where", target, "--json"]);
        last = String::from_utf8_lossy(&out.stdout).into_owned();
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let usable: Vec<&str> = answer["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["node"].as_str())
            .collect();
        usable == nodes
    });
    if let Err(e) = listed {
        panic!("{e}: {last}");
    }
}

/// nats-node-lost: one node of the three-node cluster under `stagehand up`'s services is
/// killed. Stagehand goes on through the two others; the page finds the node gone and every
/// stream's replica on it behind, from the other nodes' monitoring; once the node runs again,
/// as its host's supervisor starts it, the page confirms every replica current.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_nats_node_is_found_and_its_return_confirmed_by_its_page() {
    let mut cluster = NatsCluster::start(3);
    let home = tempfile::Builder::new()
        .prefix("stagehand-home-")
        .tempdir()
        .unwrap();
    let policies = home.path().join("policies");
    stagehand::up::write_default_policies(&policies, home.path()).unwrap();
    let _disks = own_disks(home.path(), &policies);
    let url = cluster.urls().join(",");
    let stack = stagehand::up::Stack::start(stagehand::up::UpOptions {
        home: home.path().to_owned(),
        nats: Some(stagehand_bus::BusConfig::new(&url)),
        port: 0,
        policies: Some(policies),
    })
    .await
    .unwrap();
    stack.ready(WAIT).await.unwrap();
    let mut shell = Shell::new(&url, home.path());
    let page = Page::read("nats-node-lost.md");
    shell.quiet(&page.name);
    // The demoter opens its tiers and state before it creates its consumers; a service doing
    // that while the streams elect new leaders fails (its unit would start it again). The
    // loss is to meet services at work: wait until its consumers exist.
    wait_until_blocking(WAIT, "the demoter's consumers", || {
        shell.status().is_some_and(|(_, r)| {
            ["STAGEHAND_REQUESTS", "STAGEHAND_FACTS"]
                .iter()
                .all(|stream| {
                    r["consumers"].as_array().unwrap().iter().any(|c| {
                        c["stream"] == *stream
                            && c["consumer"]
                                .as_str()
                                .is_some_and(|n| n.starts_with("demoter"))
                    })
                })
        })
    })
    .unwrap();
    let monitors = |cluster: &NatsCluster| {
        let addrs: Vec<String> = cluster.nodes().iter().map(|n| n.monitor_addr()).collect();
        addrs.join(" ")
    };
    shell.set("NATS_MONITORS", monitors(&cluster));
    let lost = cluster.nodes()[2].monitor_addr();
    let survivors: Vec<String> = cluster.nodes()[..2]
        .iter()
        .map(|n| n.monitor_addr())
        .collect();
    cluster.node_mut(2).kill();
    // The leaders find the node's replicas behind once its routes have been silent a while.
    wait_until_blocking(WAIT, "every stream's leader to find n3 behind", || {
        let behind = replicas_behind(&survivors);
        !behind.is_empty() && behind.iter().all(|(_, nodes)| nodes == &["n3"])
    })
    .unwrap();
    // `stagehand status` names the node, from JetStream's own view of its replicas.
    let mut last = serde_json::Value::Null;
    let named = wait_until_blocking(WAIT, "status to name NATS node n3", || {
        let Some((1, report)) = shell.status() else {
            return false;
        };
        last = report["findings"].clone();
        last.as_array().unwrap().iter().any(|f| {
            f["area"] == "nats"
                && f["subject"] == "NATS node n3"
                && f["run"] == "runbooks/nats-node-lost.md"
        })
    });
    if let Err(e) = named {
        panic!("{e}: {last:#}");
    }
    let said = shell.steps(&page, None, Some("Confirm"));
    assert!(said.contains(&format!("{lost}: no answer")), "{said}");
    assert!(said.contains("NATS node n3"), "{said}");
    let streams = said
        .lines()
        .filter(|l| l.starts_with("{\"stream\":"))
        .collect::<Vec<_>>();
    assert!(
        streams.len() >= 3 && streams.iter().all(|l| l.contains(r#""behind":["n3"]"#)),
        "{said}"
    );
    // Its host's supervisor starts it again, with its store.
    cluster.node_mut(2).restart();
    shell.set("NATS_MONITORS", monitors(&cluster));
    shell.confirm(&page);
    stack.stop().await.unwrap();
}

/// new-project.md: Stagehand runs with the shipped accounts config, whose only tenant is
/// project `demo`, and a new project's uploader is refused. Its step 1 (the accounts config
/// edited, the server reloaded and restarted) is text; the test does it with the recipe of
/// deploy/README.md (`accounts_conf_with_projects`), a reload that must log no error and a
/// restart, then runs the page's blocks as the operator; once confirmed, the new project's
/// uploader ingests a dataset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_project_is_added_by_its_page() {
    use common::tenants::{Tenants, VICTIM};
    use stagehand::ingest::Outcome;

    let mut tenants = Tenants::start_declaring(&[]).await.unwrap();
    let files = vec![("part-0.bin".to_owned(), vec![7u8; 4096])];
    let refused = tenants.ingest(VICTIM, "first", &files).await;
    assert!(
        refused.is_err(),
        "the uploader of a project the accounts config does not declare ingested: {:?}",
        refused.map(|r| r.outcome)
    );
    // Step 1, as its text says: the accounts config extended and reloaded (the reload must log
    // no error: an account limit above the server's own makes it refuse every account's
    // JetStream), then the server restarted, as a reload alone leaves the new account's
    // imports unanswered ("no stream found").
    tenants.declare(&[VICTIM]).unwrap();
    tenants.server.restart();
    let operator = stagehand_testkit::user_url(&tenants.server, "operator", "OPERATOR");
    let mut shell = Shell::new(&operator, tenants.home.path());
    shell.set("STAGEHAND_PROJECT", VICTIM);
    let page = Page::read("new-project.md");
    let said = shell.steps(&page, None, Some("Confirm"));
    assert!(
        said.contains(&format!("stagehand_uploads_{VICTIM}")),
        "{said}"
    );
    shell.confirm(&page);
    let report = tenants
        .ingest(VICTIM, "first", &files)
        .await
        .unwrap_or_else(|e| panic!("the new project's first ingest: {e:#}"));
    assert!(
        matches!(report.outcome, Some(Outcome::Validated(_))),
        "the new project's first ingest: {:?}",
        report.outcome
    );
}

/// Each stream a node monitored at one of `addrs` leads, with the replicas it finds not
/// current or offline (what the page's second block lists).
fn replicas_behind(addrs: &[String]) -> Vec<(String, Vec<String>)> {
    let get = |addr: &str, path: &str| -> serde_json::Value {
        let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
        match stagehand_testkit::http_get(port, path) {
            Ok((200, body)) => serde_json::from_slice(&body).unwrap_or_default(),
            _ => serde_json::Value::Null,
        }
    };
    let mut out = Vec::new();
    for addr in addrs {
        let me = get(addr, "/varz")["server_name"].clone();
        let jsz = get(addr, "/jsz?streams=true");
        let accounts = jsz["account_details"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for stream in accounts
            .iter()
            .flat_map(|a| a["stream_detail"].as_array().cloned().unwrap_or_default())
            .filter(|s| s["cluster"]["leader"] == me)
        {
            let behind = stream["cluster"]["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["current"] != true || r["offline"] == true)
                .map(|r| r["name"].as_str().unwrap_or_default().to_owned())
                .collect();
            out.push((
                stream["name"].as_str().unwrap_or_default().to_owned(),
                behind,
            ));
        }
    }
    out
}

/// scrub-behind: the source tier is to be scrubbed every three seconds, and the budget lets the
/// demoter open one file a second. Its two copies (five and six files) take longer to read one
/// after the other than the period, so whenever one is verified the other's verification is
/// older than the period: the tier's coverage never reaches 100 %, and `stagehand status` names
/// the tier with the page. The page finds how far behind; on-call raises the budget, checks the
/// edit and restarts the demoter (its supervisor does, in the test), and the page confirms the
/// coverage back and the status line gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scrub_behind_its_period_is_given_its_budget_by_its_page() {
    const PERIOD_SECONDS: i64 = 3;
    let stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    edit_policy(
        &stack,
        "scrub.toml",
        "check_every = \"10m\"",
        "check_every = \"1s\"",
    );
    edit_policy(
        &stack,
        "scrub.toml",
        "[period]\n",
        &format!("[period]\nsource = \"{PERIOD_SECONDS}s\"\n"),
    );
    edit_policy(
        &stack,
        "scrub.toml",
        "files_per_second = 2000",
        "files_per_second = 1",
    );
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("scrub-behind.md");
    // Quiet before the copies are made: with no demoter yet, they would soon be behind.
    shell.quiet(&page.name);
    let uploads = tempfile::tempdir().unwrap();
    for (dataset, files) in [("owls", 5), ("gulls", 6)] {
        let folder = uploads.path().join(dataset);
        write_upload(&folder, files);
        stack.ingest(&folder, dataset, true).unwrap();
    }
    let (binary, config) = demoter_process(&stack);
    let mut demoter = ServiceProcess::spawn(
        &binary,
        &config,
        &stack.home.path().join("demoter.log"),
        &[],
    );
    // Behind: status names the tier once a copy waited past the period and two of the scrub's
    // looks (a second each here).
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["area"], "scrub", "{finding:#}");
    assert_eq!(finding["subject"], "source", "{finding:#}");
    assert!(
        (finding["detail"].as_str().unwrap()).starts_with("scrub behind on tier source: coverage "),
        "{finding:#}\n{}",
        demoter.log()
    );
    assert!(
        finding["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("of period {PERIOD_SECONDS}s; oldest {PROJECT}/")),
        "{finding:#}"
    );
    shell.set("TIER", "source");
    let said = shell.steps(&page, None, Some("3."));
    let line = said
        .lines()
        .find(|l| l.starts_with("{\"coverage\":"))
        .unwrap_or_else(|| panic!("no coverage line: {said}"));
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    assert!(line["coverage"].as_f64().unwrap() < 1.0, "{said}");
    shell.not_yet_confirmed(&page);
    // On-call gives the scrub the budget the tier needs, checks the edit (the page's step 3),
    // and the demoter's supervisor restarts it, as the budget is read at start.
    edit_policy(
        &stack,
        "scrub.toml",
        "files_per_second = 1",
        "files_per_second = 2000",
    );
    shell.steps(&page, Some("3."), Some("Confirm"));
    demoter.kill();
    let demoter = ServiceProcess::spawn(
        &binary,
        &config,
        &stack.home.path().join("demoter-restarted.log"),
        &[],
    );
    shell.confirm(&page);
    drop(demoter);
}

/// drill-overdue: the backup copier started with the shipped day between drills (its clock
/// looking once an hour, so that it first looks long after this test); `backup.toml` is then
/// changed to a drill every two seconds, which the running copier does not read. Two of those
/// intervals after the backup, status names the version never drilled; the page finds it, the
/// copier is restarted with the policy (the page's step 2, last case), and its first drill
/// confirms the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_overdue_drill_is_found_and_run_again_by_its_page() {
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    stack.start_backup_copier_with(|s| s.drill_check = std::time::Duration::from_secs(3600));
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("drill-overdue.md");
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    let version = stack.ingest(&owls, "owls", true).unwrap();
    wait_until_blocking(WAIT, "owls backed up", || {
        let out = shell.stagehand(&["backup", "status", "--json"]);
        String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap_or_default();
            line["version"] == version.as_str() && !line["last_backup"].is_null()
        })
    })
    .unwrap();
    shell.quiet(&page.name);
    edit_policy(
        &stack,
        "backup.toml",
        "drill_every = \"24h\"",
        "drill_every = \"2s\"",
    );
    let finding = shell.status_names(&page.name);
    assert_eq!(
        finding["subject"],
        format!("{PROJECT}/owls@{} on backup", &version[..12]),
        "{finding:#}"
    );
    shell.set("BACKUP_TIER", "backup");
    let said = shell.steps(&page, None, Some("Confirm"));
    let flagged: Vec<serde_json::Value> = said
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        flagged.len() == 1
            && flagged[0]["version"] == version.as_str()
            && flagged[0]["flag"] == "never_drilled",
        "{said}"
    );
    shell.not_yet_confirmed(&page);
    // The copier restarted with the policy, as the page's step 2 says.
    stack
        .stop_service(stagehand_backup_copier::SERVICE)
        .await
        .unwrap();
    stack.start_backup_copier();
    shell.confirm(&page);
}

/// backlog-growing: the ingest validator is stopped (cleanly: it says so in its heartbeat) and
/// an upload's request waits on its consumer. With the threshold the page documents set to
/// three seconds, status names the consumer; the page shows the consumer and the service
/// stopped, its supervisor starts it (the page's first case), and the page confirms the
/// backlog gone and the upload validated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_backlog_is_found_and_its_service_started_by_its_page() {
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    let mut shell = Shell::new(&stack.url, stack.home.path());
    shell.set("BACKLOG_AFTER", "3s");
    shell.status_flags = vec!["--backlog-after".into(), "3s".into()];
    let page = Page::read("backlog-growing.md");
    shell.quiet(&page.name);
    stack
        .stop_service(stagehand_ingest_validator::SERVICE)
        .await
        .unwrap();
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    stack.ingest(&owls, "owls", false).unwrap();
    let finding = shell.status_names(&page.name);
    assert_eq!(
        finding["subject"],
        format!(
            "{} on STAGEHAND_REQUESTS",
            stagehand_ingest_validator::SERVICE
        ),
        "{finding:#}"
    );
    shell.set("CONSUMER", stagehand_ingest_validator::SERVICE);
    let said = shell.steps(&page, None, Some("Confirm"));
    assert!(
        said.contains("\"pending\": 1") && said.contains("\"state\": \"stopped\""),
        "{said}"
    );
    assert!(!validated(&shell, "owls"), "validated with no validator");
    shell.not_yet_confirmed(&page);
    // Its supervisor starts it again.
    stack.start_validator();
    shell.confirm(&page);
    assert!(
        validated(&shell, "owls"),
        "the waiting upload not validated"
    );
}

/// s3-tier-unreachable: an S3 source tier `lake` (a real SeaweedFS) answers through a loopback
/// port the test forwards to it. With the forward cut, as when the network is, `stagehand
/// status` names the tier unreachable with the page, and an upload waits there: the validator
/// (its own process, with the tier's credentials in its environment, as under systemd) retries
/// the request, then dead-letters it. The page lists what waits on the tier; its owners bring
/// the tier back (the forward again, on the same port), the page replays the dead letter and
/// confirms (status quiet: the tier answers, nothing waits), and the upload is validated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_s3_tier_is_brought_back_and_its_work_redone_by_its_page() {
    use stagehand_schemas::{Body, Event, IngestRequested};
    const TIER: &str = "lake";
    let stack = Stagehand::start(common::Options::default()).await.unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    let s3 = stagehand_testkit::S3Server::shared();
    let bucket = s3.unique_bucket("runbooks");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    // On-call's shell holds the tier's credentials, as the services' environment does: status
    // probes the S3 tiers with them.
    let mut shell = Shell::new(&stack.url, stack.home.path());
    for (var, value) in s3.client_env() {
        shell.set(var, value);
    }
    let page = Page::read("s3-tier-unreachable.md");
    // Quiet before the tier is declared: unreachable from the start, it would be named at once.
    shell.quiet(&page.name);
    let tiers = stack.policies.join("tiers.toml");
    let mut text = std::fs::read_to_string(&tiers).unwrap();
    text.push_str(&format!(
        "\n[tiers.{TIER}]\nkind = \"s3\"\nrole = \"source\"\nfailure_domain = \"lake-bucket\"\n\
         endpoint = \"{endpoint}\"\nallow_plaintext = true\nbucket = \"{bucket}\"\nprefix = \"tier\"\n"
    ));
    std::fs::write(&tiers, text).unwrap();
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["subject"], TIER, "{finding:#}");
    assert!(
        (finding["detail"].as_str().unwrap()).starts_with(&format!("tier {TIER} unreachable: ")),
        "{finding:#}"
    );
    // Regression: an operator without the tier's credentials was told it is unreachable (the
    // SDK fails such a request as a dispatch failure); the probe is said not to be made.
    let (_, bare) = Shell::new(&stack.url, stack.home.path()).status().unwrap();
    assert!(
        (bare["findings"].as_array().unwrap())
            .iter()
            .all(|f| f["subject"] != TIER),
        "{bare:#}"
    );
    assert!(
        (bare["not_checked"].as_array().unwrap()).iter().any(|n| {
            n.as_str()
                .unwrap()
                .starts_with(&format!("whether S3 tier {TIER} answers: "))
                && n.as_str().unwrap().contains("no credentials")
        }),
        "{bare:#}"
    );

    let mut files = Vec::new();
    for (path, body) in [("img/1.png", &b"one"[..]), ("img/2.png", &b"two"[..])] {
        s3.put_object(&bucket, &format!("tier/{PROJECT}/cats/{path}"), body)
            .unwrap();
        files.push(FileRef::new(path, body.len() as u64, sha256_hex(body)));
    }
    let (binary, config) = validator_process(&stack);
    let validator = ServiceProcess::spawn(
        &binary,
        &config,
        &stack.home.path().join("validator.log"),
        &s3.client_env(),
    );
    // The uploader's request, for files already in the bucket; nothing listens on the port.
    let request = Event::request(
        EventId::new("cats-upload-1").unwrap(),
        PROJECT,
        Body::IngestRequested(IngestRequested {
            dataset: "cats".into(),
            source: Location {
                tier: TIER.into(),
                prefix: format!("{PROJECT}/cats"),
            },
            files,
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    );
    stack.bus.publish(&request).await.unwrap();
    let finding = shell.status_names("dead-letters-waiting.md");
    assert_eq!(
        finding["subject"],
        stagehand_ingest_validator::SERVICE,
        "{finding:#}\n{}",
        validator.log()
    );
    shell.set("TIER", TIER);
    shell.set("ENDPOINT", &endpoint);
    let said = shell.steps(&page, None, Some("3."));
    let waiting: Vec<&str> = said
        .split("--- stdout\n")
        .nth(1)
        .unwrap()
        .split("--- stderr\n")
        .next()
        .unwrap()
        .lines()
        .collect();
    assert!(
        waiting.len() == 1 && waiting[0].contains(stagehand_ingest_validator::SERVICE),
        "{said}"
    );
    assert!(!validated(&shell, "cats"), "validated with its tier down");
    shell.not_yet_confirmed(&page);
    // Its owners bring the tier back: the same endpoint answers again.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let to: std::net::SocketAddr = ([127, 0, 0, 1], s3.port()).into();
    let forward = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    shell.steps(&page, Some("3."), Some("Confirm"));
    shell.confirm(&page);
    assert!(
        validated(&shell, "cats"),
        "the replayed upload not validated:\n{}",
        validator.log()
    );
    forward.abort();
}

/// The ingest validator's binary, built beside `stagehand`, and a config of it for `stack`
/// that gives a request up after two quick attempts: run as its own process, so that the S3
/// credentials are in its environment only.
fn validator_process(stack: &Stagehand) -> (PathBuf, PathBuf) {
    let binary =
        Path::new(env!("CARGO_BIN_EXE_stagehand")).with_file_name("stagehand-ingest-validator");
    assert!(
        binary.exists(),
        "{} is missing: cargo build -p stagehand-ingest-validator",
        binary.display()
    );
    let config = stack.home.path().join("ingest-validator.toml");
    std::fs::write(
        &config,
        format!(
            "[bus]\nservers = [\"{}\"]\nclient_name = \"ingest-validator\"\n\n\
             [worker]\ninstance_id = \"runbooks\"\nmax_attempts = 2\n\n\
             [worker.retry]\ninitial = \"100ms\"\nmax = \"1s\"\nfactor = 2.0\njitter = 0.0\n\n\
             [service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\n",
            stack.url,
            stack.policies.display(),
            stack.home.path().join("state/ingest-validator").display()
        ),
    )
    .unwrap();
    (binary, config)
}

/// fanout-peer-dropped: three node agents with fan-out on, in process, each its own local tier
/// and piece server on the loopback. n1 stages a version of three pieces, then its copy rots on
/// its disk (one byte of every file flipped, metadata unchanged); n2 and n3 stage the same
/// version and fetch pieces from n1, whose bytes do not verify: it is dropped from the swarm and
/// reported on the board, and its own agent withdraws its copy. Status names n1 with the page;
/// the page shows the copy damaged, stages it on n1 again (which copies it anew from a verified
/// copy) and confirms n1 no longer named.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_serving_bad_bytes_in_a_fan_out_is_found_and_its_copy_made_anew_by_its_page() {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = Stagehand::start(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    stack.start_promoter();
    stack.ready().await.unwrap();
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("fanout-peer-dropped.md");
    shell.quiet(&page.name);
    // Forty small files (one piece) and two larger than a piece: three pieces.
    let uploads = tempfile::tempdir().unwrap();
    let shards = uploads.path().join("shards");
    let mut files: Vec<(String, Vec<u8>)> = (0..40u8)
        .map(|i| {
            let bytes = stagehand_testkit::pattern_bytes(i, 200 * 1024);
            (format!("part/{i:03}.bin"), bytes)
        })
        .collect();
    files.push((
        "big/a.bin".into(),
        stagehand_testkit::pattern_bytes(101, 9 << 20),
    ));
    files.push((
        "big/b.bin".into(),
        stagehand_testkit::pattern_bytes(102, 9 << 20),
    ));
    for (name, bytes) in &files {
        let path = shards.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap();
    }
    let version = stack.ingest(&shards, "shards", true).unwrap();
    let target = format!("shards@{version}");
    let token = stack.home.path().join("fanout.token");
    std::fs::write(&token, "stagehand-runbook-agents-token-0123456789\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let with_fanout = |settings: &mut stagehand_promoter::Settings| {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        settings.fanout = Some(stagehand_promoter::fanout::FanoutSettings {
            listen: ([127, 0, 0, 1], port).into(),
            advertise: None,
            token_file: token.clone(),
            claim_patience: std::time::Duration::from_secs(5),
            parallel: 4,
            tls: None,
        });
    };
    stack.start_node_agent_with("n1", with_fanout).unwrap();
    stack.ready().await.unwrap();
    shell.stage_on_node(&target, "local", "n1", "train-n1");
    // n1's job ends (a copy a job holds would be repaired by its agent at once); its copy,
    // kept on the node, rots on its disk after it was verified.
    shell.release(&target, "local", "train-n1", &["--node", "n1"]);
    let folder = stack
        .node_local_root("n1")
        .join(format!("{PROJECT}/shards/{version}"));
    for (name, _) in &files {
        let path = folder.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[0] ^= 0xff;
        let mode = std::fs::metadata(&path).unwrap().permissions();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, mode).unwrap();
    }
    for node in ["n2", "n3"] {
        stack.start_node_agent_with(node, with_fanout).unwrap();
    }
    stack.ready().await.unwrap();
    for node in ["n2", "n3"] {
        shell.stage_on_node(&target, "local", node, &format!("train-{node}"));
    }
    let finding = shell.status_names(&page.name);
    assert_eq!(finding["area"], "fanout", "{finding:#}");
    assert_eq!(finding["subject"], "n1", "{finding:#}");
    assert!(
        (finding["detail"].as_str().unwrap())
            .contains(&format!("({PROJECT}/shards@{} on local", &version[..12])),
        "{finding:#}"
    );
    shell.set("NODE", "n1");
    shell.set("DATASET", "shards");
    shell.set("VERSION", &version[..12]);
    // Its own agent withdrew the copy once it hashed it: the page's step 1 shows it damaged.
    let damaged = wait_until_blocking(WAIT, "n1's copy damaged", || {
        let said = shell.steps(&page, None, Some("2."));
        let stdout = said.split("--- stdout\n").nth(1).unwrap_or_default();
        stdout
            .lines()
            .any(|l| l.contains("n1") && l.contains("damaged"))
    });
    if let Err(e) = damaged {
        panic!("{e}: {}", shell.steps(&page, None, Some("2.")));
    }
    shell.not_yet_confirmed(&page);
    shell.steps(&page, Some("3."), Some("Confirm"));
    shell.confirm(&page);
}

/// upgrade: the ingest validator runs as its own process, as under systemd. The page checks the
/// policies and that nothing needs a person; the validator is stopped as `systemctl stop` does
/// (SIGTERM: it drains and says so in its heartbeat), which its Confirm does not pass, then its
/// binary is started again (the release built here stands for the new one); the page confirms
/// it alive at the release's version, started since the upgrade began, and an upload sent
/// while it was down is validated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_is_upgraded_in_turn_by_its_page() {
    let stack = Stagehand::start(common::Options::default()).await.unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    let (binary, config) = validator_process(&stack);
    let mut validator = ServiceProcess::spawn(
        &binary,
        &config,
        &stack.home.path().join("validator.log"),
        &[],
    );
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("upgrade.md");
    wait_until_blocking(WAIT, "the validator alive", || {
        shell.status().is_some_and(|(_, r)| {
            (r["services"].as_array().unwrap()).iter().any(|s| {
                s["service"] == stagehand_ingest_validator::SERVICE && s["state"] == "alive"
            })
        })
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", validator.log()));
    shell.quiet(&page.name);
    shell.set("SERVICE", stagehand_ingest_validator::SERVICE);
    shell.set("NEW_VERSION", env!("CARGO_PKG_VERSION"));
    let said = shell.steps(&page, None, Some("2."));
    assert!(
        said.contains(&format!(
            "{} runbooks v{} alive",
            stagehand_ingest_validator::SERVICE,
            env!("CARGO_PKG_VERSION")
        )),
        "{said}"
    );
    // Not upgraded yet: it runs, but was started before the upgrade began.
    shell.not_yet_confirmed(&page);
    // systemctl stop: SIGTERM, and the service drains and exits.
    let pid = validator.child().id().to_string();
    let term = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(term.success());
    let exit = validator.child().wait().unwrap();
    assert!(exit.success(), "{exit:?}\n{}", validator.log());
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    stack.ingest(&owls, "owls", false).unwrap();
    let said = shell.steps(&page, Some("2."), Some("Confirm"));
    assert!(said.contains("\"state\":\"stopped\""), "{said}");
    shell.not_yet_confirmed(&page);
    // systemctl start of the new binary.
    let validator = ServiceProcess::spawn(
        &binary,
        &config,
        &stack.home.path().join("validator-new.log"),
        &[],
    );
    shell.confirm(&page);
    wait_until_blocking(WAIT, "the upload sent while it was down validated", || {
        validated(&shell, "owls")
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", validator.log()));
}

/// stage-failed: a Slurm job (a real cluster, `common::slurm`) names a version of a dataset the
/// lab has not uploaded yet: its stage fails and Slurm holds the job with the reason. The lab
/// uploads it between the page's sections; the page's `scontrol release` lets the job's
/// stage-in ask again (as its next attempt, the failed one released), and the job runs with
/// the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_slurm_job_whose_stage_failed_runs_once_released_by_its_page() {
    let (mut stack, slurm) = common::slurm::setup(common::Options {
        validator: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let _disks = own_disks(stack.home.path(), &stack.policies);
    stack.start_promoter();
    stack.ready().await.unwrap();
    let mut shell = Shell::new(&stack.url, stack.home.path());
    let page = Page::read("stage-failed.md");
    shell.quiet(&page.name);
    let uploads = tempfile::tempdir().unwrap();
    let owls = uploads.path().join("owls");
    write_upload(&owls, 3);
    let digest = common::digest_of(&owls).unwrap();
    let version = &digest[..16];
    let script = format!(
        "#!/bin/bash\n#BB_LUA stage dataset=owls version={version} tier=hot project={PROJECT}\n\
         set -euo pipefail\ncd \"$STAGEHAND_DATA_OWLS\"\nfind . -type f | sort | xargs sha256sum\n"
    );
    let job = slurm.submit("owls", &script).unwrap();
    let job_id = format!("{}{job}", common::slurm::JOB_PREFIX);
    let (_, reason) = slurm
        .wait_job(job, "the job held with the reason", |s, r| {
            s == "PENDING" && r.contains("unknown dataset")
        })
        .await
        .unwrap();
    assert!(
        reason.contains(&format!("stagehand: owls@{version} on hot failed: ")),
        "{reason}"
    );
    let finding = shell.status_names(&page.name);
    assert!(
        (finding["subject"].as_str().unwrap()).ends_with(&format!(" for job {job_id}")),
        "{finding:#}"
    );
    shell.set("TARGET", format!("owls@{}", &version[..12]));
    shell.set("TIER", "hot");
    shell.set("JOB", &job_id);
    shell.set("SLURM_JOB", job.to_string());
    shell.set("SLURM_CONF", slurm.conf.display().to_string());
    let said = shell.steps(&page, None, Some("2."));
    assert!(
        said.contains("failed") && said.contains("unknown dataset"),
        "{said}"
    );
    // Released before the cause is fixed, the job would only fail again: not confirmed.
    shell.not_yet_confirmed(&page);
    // The lab uploads the version the job names.
    assert_eq!(stack.ingest(&owls, "owls", true).unwrap(), digest);
    shell.steps(&page, Some("2."), Some("Confirm"));
    // Released, it is staged in afresh and runs (the hooks' log lines if it does not).
    slurm
        .wait_job(job, "the released job ended", |s, _| s == "COMPLETED")
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}\nscontrol show job: {}",
                slurm.show_job(job).unwrap_or_default()
            )
        });
    shell.confirm(&page);
    // The job read the version's bytes where its stage-in put them.
    let output = slurm.output(job).unwrap();
    let mut expected = Vec::new();
    for entry in walkdir::WalkDir::new(&owls) {
        let entry = entry.unwrap();
        if !entry.file_type().is_file() {
            continue;
        }
        let bytes = std::fs::read(entry.path()).unwrap();
        let name = entry
            .path()
            .strip_prefix(&owls)
            .unwrap()
            .display()
            .to_string();
        expected.push(format!("{}  ./{name}", sha256_hex(&bytes)));
    }
    expected.sort();
    let mut read: Vec<String> = output.lines().map(str::to_owned).collect();
    read.sort();
    assert_eq!(read, expected, "{output}");
    // The failed attempt was released when the job asked again, and the second attempt is
    // the one the job ran with.
    use stagehand_catalogue::StageState::{Ready, Released};
    let attempt = |job: String| stagehand::stage::Stage {
        project: PROJECT.into(),
        dataset: "owls".into(),
        version: version.into(),
        tier: "hot".into(),
        job,
        node: None,
    };
    let first = stack
        .status_where(
            &attempt(job_id.clone()),
            "the failed attempt released",
            |s| s.state == Released,
        )
        .await
        .unwrap();
    assert!(first.path.is_none(), "{first:?}");
    stack
        .status_where(
            &attempt(format!("{job_id}.a1")),
            "the second attempt staged",
            |s| matches!(s.state, Ready | Released),
        )
        .await
        .unwrap();
}
