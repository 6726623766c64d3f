//! Stagehand's Slurm integration on a real Slurm: each test starts a one-node cluster with
//! `deploy/slurm/slurm.sh start` (installing Slurm from the distribution when it is missing;
//! a machine where that fails fails the test with the reason), a real nats-server with
//! Stagehand's services on it, and submits real batch jobs with `sbatch` as the ordinary test
//! user (root may not use burst buffers).
//!
//! The hooks (`deploy/slurm/burst_buffer.lua`, `deploy/slurm/stagehand-node.sh`) call the built
//! `stagehand` binary. Datasets are uploaded with the real `stagehand ingest` and validated by
//! the real ingest validator; the real promoter (and, for the `local` tier, the promoter agent
//! of the node) answers the hooks' requests; what a job waits on is the stage's
//! `stagehand_stages` entry kept by the real catalogue recorder. No test publishes a fact.
//!
//! A cluster per test, not one per test binary: the hooks' NATS address is part of the
//! cluster's configuration, and each test has its own server and services (so that one can
//! stop NATS, restart the controller, drain the node or start the validator late without
//! touching another); under cargo-nextest every test is a process of its own anyway. Starting
//! and stopping a cluster costs about 2.6 s. The cluster is `common::slurm`'s.
//!
//! Every wait polls Slurm (`squeue`) or NATS against a deadline; nothing sleeps.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use common::slurm::{JOB, JOB_PREFIX, Slurm, said, setup, setup_with, slurm_sh};
use common::{Options, PROJECT, Stagehand, write_files};
use stagehand::stage::{Stage, StageState};
use stagehand_schemas::{Body, sha256_hex};
use stagehand_testkit::wait_for;

/// The name of the one node (slurm.sh names it after the short host name).
fn slurm_node() -> anyhow::Result<String> {
    let out = Command::new("hostname").arg("-s").output()?;
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// A dataset folder on the "hot tier" (a folder the job can read), with its expected sums.
/// A batch script that prints where its data is and the SHA-256 of every file there.
fn reading_job(directives: &[String], var: &str) -> String {
    format!(
        "#!/bin/bash\n{}\nset -euo pipefail\necho \"path=${var}\"\ncd \"${var}\"\nfind . -type f | sort | xargs sha256sum\n",
        directives.join("\n")
    )
}

/// The (path, sha256) pairs a reading job printed, and the path it saw.
fn read_sums(output: &str) -> (String, Vec<(String, String)>) {
    let mut path = String::new();
    let mut sums = Vec::new();
    for line in output.lines() {
        if let Some(p) = line.strip_prefix("path=") {
            path = p.to_owned();
        } else if let Some((sum, file)) = line.split_once("  ") {
            sums.push((file.to_owned(), sum.to_owned()));
        }
    }
    sums.sort();
    (path, sums)
}

fn stage(job: u32, dataset: &str, version: &str, tier: &str, node: Option<&str>) -> Stage {
    Stage {
        project: PROJECT.to_owned(),
        dataset: dataset.to_owned(),
        version: version.to_owned(),
        tier: tier.to_owned(),
        job: format!("{JOB_PREFIX}{job}"),
        node: node.map(str::to_owned),
    }
}

fn directive(dataset: &str, version: &str, tier: &str) -> Vec<String> {
    vec![format!(
        "#BB_LUA stage dataset={dataset} version={version} tier={tier} project={PROJECT}"
    )]
}

/// Where the promoter puts a version on a tier of the test home.
fn on_tier(stagehand: &Stagehand, tier: &str, dataset: &str, digest: &str) -> PathBuf {
    stagehand
        .home
        .path()
        .join("tiers")
        .join(tier)
        .join(PROJECT)
        .join(dataset)
        .join(digest)
}

/// A dataset folder to ingest, and what its files' sums are.
fn dataset_folder(
    files: &[(&str, &[u8])],
) -> anyhow::Result<(tempfile::TempDir, Vec<(String, String)>)> {
    let dir = tempfile::tempdir()?;
    let sums = write_files(dir.path(), files)?;
    Ok((dir, sums))
}

fn with_validator() -> Options {
    Options {
        validator: true,
        promoter: true,
        ..Options::default()
    }
}

fn without_validator() -> Options {
    Options {
        promoter: true,
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_directive_is_refused_at_submit_and_sbatch_says_why() -> anyhow::Result<()> {
    let slurm = Slurm::start("nats://127.0.0.1:1")?;
    let cases = [
        (
            "#BB_LUA stage dataset=ds version=abc tier=hot project=lab",
            "line 2 (#BB_LUA stage dataset=ds version=abc tier=hot project=lab): version 'abc' must be a digest or a prefix of at least 12 lowercase hex characters",
        ),
        (
            "#BB_LUA stage dataset=ds version=5f2c9a0e11b34d7a tier=hot",
            "project= is missing and stagehand-slurm.conf sets no STAGEHAND_PROJECT",
        ),
        (
            "#BB_LUA stage dataset=ds version=5f2c9a0e11b34d7a tier=hot project=lab colour=red",
            "unknown key 'colour'",
        ),
        (
            "#BB_LUA fetch dataset=ds",
            "a #BB_LUA line must start with 'stage'",
        ),
    ];
    for (i, (line, message)) in cases.iter().enumerate() {
        let out = slurm.sbatch(
            &format!("bad{i}"),
            &format!("#!/bin/bash\n{line}\necho never\n"),
        )?;
        ensure!(
            !out.status.success(),
            "sbatch accepted {line:?}: {}",
            said(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            err.contains("sbatch: error: burst_buffer/lua: stagehand: ") && err.contains(message),
            "{line:?}: sbatch said {err:?}, expected {message:?}"
        );
    }
    Ok(())
}

/// (a) and (e): a job naming a validated dataset runs after the promoter staged it to the hot
/// tier, reads every file at `$STAGEHAND_DATA_<NAME>` with the checksums of the upload, and its
/// stage is released when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_after_stage_in_reads_its_data_and_releases_it() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup(with_validator()).await?;
    let (folder, expected) = dataset_folder(&[
        ("train/0.bin", b"first file"),
        ("train/1.bin", &[7u8; 100_000]),
        ("labels.csv", b"id,label\n0,cat\n1,dog\n"),
    ])?;
    let digest = stagehand.ingest(folder.path(), "imagenet-mini", true)?;
    let version = &digest[..16];
    let submitted = Instant::now();
    let asked_at = time::OffsetDateTime::now_utc();
    let mut directives = directive("imagenet-mini", version, "hot");
    directives[0].push_str(" hold=2d");
    let job = slurm.submit(
        "reads",
        &reading_job(&directives, "STAGEHAND_DATA_IMAGENET_MINI"),
    )?;
    let st = stage(job, "imagenet-mini", version, "hot", None);
    let ready = stagehand
        .status_where(&st, "the stage ready", |s| s.state == StageState::Ready)
        .await?;
    // hold=2d: the stage holds its data at most two days from its request.
    let hold_until = ready.hold_until.context("the stage's hold_until")?;
    let held_for = hold_until - asked_at;
    ensure!(
        held_for > time::Duration::hours(47) && held_for <= time::Duration::hours(49),
        "held until {hold_until}, {held_for} after the request"
    );
    let ready_at = Instant::now();
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    eprintln!(
        "submit→ready {:?}, ready→complete {:?}",
        ready_at - submitted,
        ready_at.elapsed()
    );
    let (path, sums) = read_sums(&slurm.output(job)?);
    let root = on_tier(&stagehand, "hot", "imagenet-mini", &digest);
    ensure!(
        path == root.display().to_string(),
        "job saw {path:?}, status {ready:?}"
    );
    ensure!(sums == expected, "job read {sums:?}, expected {expected:?}");
    // (e) teardown released it, with the id derived from the job; the status says so.
    stagehand.released(&st).await?;
    stagehand
        .status_where(&st, "the stage released", |s| {
            s.state == StageState::Released
        })
        .await?;
    Ok(())
}

/// Issue 17 item 4, test (e): a job whose stage-in waits for a copy queued behind another
/// shows, in its AdminComment (`scontrol show job`; Slurm's Reason says only that stage-in
/// runs), what it waits for and the estimate: the bytes queued ahead of its copy on that pair
/// of tiers. It runs with its data once the copy ahead is done and its own is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_job_shows_the_estimate_of_its_queued_copy() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup_with(
        Options {
            copy_slots: Some(1),
            // The copy ahead takes about eight seconds.
            copy_bytes_per_second: Some(1 << 20),
            ..with_validator()
        },
        vec![("STAGEHAND_STATUS_EVERY", "1".to_owned())],
    )
    .await?;
    let chunk = vec![5u8; 1 << 20];
    let big: Vec<(String, &[u8])> = (0..8)
        .map(|i| (format!("part-{i}.bin"), chunk.as_slice()))
        .collect();
    let big: Vec<(&str, &[u8])> = big.iter().map(|(p, b)| (p.as_str(), *b)).collect();
    let (folder, _) = dataset_folder(&big)?;
    let big_digest = stagehand.ingest(folder.path(), "big", true)?;
    let (folder, expected) = dataset_folder(&[("labels.csv", b"id,label\n0,cat\n")])?;
    let small_digest = stagehand.ingest(folder.path(), "small", true)?;
    // Another job's copy holds the only copy slot.
    let ahead = Stage {
        project: PROJECT.to_owned(),
        dataset: "big".to_owned(),
        version: big_digest.clone(),
        tier: "hot".to_owned(),
        job: "elsewhere-1".to_owned(),
        node: None,
    };
    stagehand
        .bus
        .publish(
            &stagehand_testkit::StageRequest::new(
                PROJECT,
                "big",
                &big_digest,
                "hot",
                "elsewhere-1",
            )
            .event(),
        )
        .await?;
    stagehand
        .status_where(&ahead, "the copy ahead running", |s| {
            s.state == StageState::Copying
        })
        .await?;
    let version = &small_digest[..16];
    let job = slurm.submit(
        "queued",
        &reading_job(&directive("small", version, "hot"), "STAGEHAND_DATA_SMALL"),
    )?;
    let comment = wait_for(
        JOB,
        "the job's AdminComment to show the estimate",
        || async {
            let shown = slurm.show_job(job).ok()?;
            let comment = shown
                .lines()
                .find_map(|l| l.trim().strip_prefix("AdminComment="))?
                .to_owned();
            comment.contains("queued ahead").then_some(comment)
        },
    )
    .await?;
    eprintln!("while queued: {comment}");
    let prefix = format!(
        "stagehand: waiting for small@{version} on hot: pending (waiting for copy): waiting for one of 1 copy slots"
    );
    ensure!(comment.starts_with(&prefix), "AdminComment {comment:?}");
    // Ingest left the versions on the source tier; nothing of source -> hot was measured yet.
    let (_, estimate) = comment
        .split_once("copy slots (class stage); ")
        .context("the estimate after the reason")?;
    let (ahead, rest) = estimate
        .split_once(" bytes in 1 copy queued ahead on source -> hot; ")
        .with_context(|| format!("AdminComment {comment:?}"))?;
    let ahead: u64 = ahead.parse()?;
    ensure!(ahead <= 8 << 20, "{ahead} bytes ahead of an 8 MiB copy");
    ensure!(
        rest == "no estimate yet (no copy on that pair measured)",
        "AdminComment {comment:?}"
    );
    let (_, reason) = slurm.job(job)?;
    eprintln!("squeue's reason meanwhile: {reason}");
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == on_tier(&stagehand, "hot", "small", &small_digest)
            .display()
            .to_string(),
        "job saw {path:?}"
    );
    ensure!(sums == expected, "job read {sums:?}, expected {expected:?}");
    Ok(())
}

/// Several directives in one job: each dataset is staged, and the job finds each at its own
/// variable (`name=` given, or the dataset's name upper-cased); teardown releases both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_two_directives_reads_each_dataset_at_its_own_variable() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup(with_validator()).await?;
    let (train, train_sums) = dataset_folder(&[("t/0.bin", &[1u8; 20_000]), ("t/1.bin", b"one")])?;
    let (labels, label_sums) = dataset_folder(&[("labels.csv", b"id,label\n0,cat\n")])?;
    let train_digest = stagehand.ingest(train.path(), "train-set", true)?;
    let label_digest = stagehand.ingest(labels.path(), "labels", true)?;
    let script = format!(
        "#!/bin/bash\n\
         #BB_LUA stage dataset=train-set version={} tier=hot project={PROJECT}\n\
         #BB_LUA stage dataset=labels version={} tier=hot project={PROJECT} name=LBL\n\
         set -euo pipefail\n\
         for v in STAGEHAND_DATA_TRAIN_SET STAGEHAND_DATA_LBL; do\n\
           echo \"$v=${{!v}}\"; (cd \"${{!v}}\" && find . -type f | sort | xargs sha256sum)\n\
         done\n",
        &train_digest[..16],
        &label_digest[..16]
    );
    let job = slurm.submit("two", &script)?;
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let output = slurm.output(job)?;
    let (before, after) = output
        .split_once("STAGEHAND_DATA_LBL=")
        .context(format!("no second dataset in {output:?}"))?;
    let train_seen = before
        .lines()
        .find_map(|l| l.strip_prefix("STAGEHAND_DATA_TRAIN_SET="))
        .unwrap_or_default();
    ensure!(
        train_seen
            == on_tier(&stagehand, "hot", "train-set", &train_digest)
                .display()
                .to_string(),
        "{output}"
    );
    ensure!(
        after.lines().next()
            == Some(
                on_tier(&stagehand, "hot", "labels", &label_digest)
                    .display()
                    .to_string()
                    .as_str()
            ),
        "{output}"
    );
    ensure!(read_sums(before).1 == train_sums, "{output}");
    ensure!(read_sums(after).1 == label_sums, "{output}");
    for (dataset, digest) in [("train-set", &train_digest), ("labels", &label_digest)] {
        stagehand
            .released(&stage(job, dataset, &digest[..16], "hot", None))
            .await?;
    }
    Ok(())
}

/// (b): a job submitted while its dataset's upload is not validated yet stays pending in
/// stage-in (the status says it waits for validation), and runs once the version is validated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waits_pending_until_its_dataset_is_validated() -> anyhow::Result<()> {
    let (mut stagehand, slurm) = setup(without_validator()).await?;
    let (folder, expected) = dataset_folder(&[("a.txt", b"arrives later"), ("b/c.txt", b"too")])?;
    // Uploaded, but no validator runs yet.
    let digest = stagehand.ingest(folder.path(), "later", false)?;
    let version = &digest[..16];
    let job = slurm.submit(
        "waits",
        &reading_job(&directive("later", version, "hot"), "STAGEHAND_DATA_LATER"),
    )?;
    let st = stage(job, "later", version, "hot", None);
    let pending = stagehand
        .status_where(&st, "the stage waiting for validation", |s| {
            s.waiting_for.as_deref() == Some("validation")
        })
        .await?;
    // 22.05 shows BurstBufferResources while data_in runs (its scheduler sets
    // WAIT_BURST_BUFFER_STAGING, then job_mgr.c overwrites it for ESLURM_BURST_BUFFER_WAIT);
    // backfill and later releases show BurstBufferStageIn.
    let (state, reason) = slurm
        .wait_job(job, "the job pending in stage-in", |s, r| {
            s == "PENDING" && (r == "BurstBufferStageIn" || r == "BurstBufferResources")
        })
        .await?;
    eprintln!(
        "while not validated: {state} {reason}; stagehand: {:?}",
        pending.reason
    );
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args([
            "--nats",
            &stagehand.url,
            "stage",
            "status",
            &st.job,
            "--project",
            PROJECT,
        ])
        .output()?;
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        shown.contains("waiting for validation"),
        "stage status said {shown:?}"
    );
    stagehand.start_validator();
    let validating = Instant::now();
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    eprintln!("validator started→complete {:?}", validating.elapsed());
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == on_tier(&stagehand, "hot", "later", &digest)
            .display()
            .to_string()
    );
    ensure!(sums == expected, "{sums:?}");
    Ok(())
}

/// (c): a job naming an unknown dataset, and one naming a rejected version, are held with the
/// promoter's reason in squeue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_naming_an_unknown_or_rejected_dataset_is_held_with_the_reason() -> anyhow::Result<()>
{
    let (stagehand, slurm) = setup(with_validator()).await?;
    // A rejected upload: the declared manifest does not match the file.
    let (folder, _) = dataset_folder(&[("x.bin", b"the real bytes")])?;
    let manifest = folder.path().join("../declared.tsv");
    let wrong = sha256_hex(b"other bytes");
    std::fs::write(&manifest, format!("x.bin\t14\t{wrong}\n"))?;
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", &stagehand.url, "ingest"])
        .arg(folder.path())
        .args([
            "--project",
            PROJECT,
            "--dataset",
            "broken",
            "--wait",
            "--json",
        ])
        .arg("--manifest")
        .arg(&manifest)
        .arg("--policies")
        .arg(&stagehand.policies)
        .env("STAGEHAND_HOME", stagehand.home.path())
        .output()?;
    ensure!(
        out.status.code() == Some(1),
        "a mismatching upload not rejected: {}",
        said(&out)
    );
    let declared = stagehand_schemas::version_digest(&[stagehand_schemas::FileRef {
        path: "x.bin".into(),
        size: 14,
        sha256: wrong,
    }]);
    for (name, dataset, version) in [
        ("unknown", "nosuch", "0123456789abcdef"),
        ("rejected", "broken", &declared[..16]),
    ] {
        let job = slurm.submit(name, &reading_job(&directive(dataset, version, "hot"), "X"))?;
        let st = stage(job, dataset, version, "hot", None);
        let failed = stagehand
            .status_where(&st, "the stage failed", |s| s.state == StageState::Failed)
            .await?;
        let why = failed.reason.clone().unwrap_or_default();
        let (state, reason) = slurm
            .wait_job(job, "the job held with the reason", |s, r| {
                s == "PENDING" && r.contains(&why)
            })
            .await?;
        eprintln!("{name}: {state} {reason}");
        ensure!(
            reason.starts_with(&format!(
                "burst_buffer/lua: slurm_bb_data_in: stagehand: {dataset}@{version} on hot failed: "
            )),
            "{reason}"
        );
    }
    Ok(())
}

/// A directive's `deadline=` reaches the promoter: a job whose upload is still not validated
/// when its deadline passes is held, squeue showing the promoter's reason (what it waited for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_deadline_passes_before_validation_is_held_with_the_reason()
-> anyhow::Result<()> {
    let (stagehand, slurm) = setup(without_validator()).await?;
    let (folder, _) = dataset_folder(&[("late.bin", b"validated too late")])?;
    let digest = stagehand.ingest(folder.path(), "late", false)?;
    let version = &digest[..16];
    let directives = vec![format!(
        "#BB_LUA stage dataset=late version={version} tier=hot project={PROJECT} deadline=3s"
    )];
    let submitted = Instant::now();
    let job = slurm.submit("deadline", &reading_job(&directives, "STAGEHAND_DATA_LATE"))?;
    let st = stage(job, "late", version, "hot", None);
    let failed = stagehand
        .status_where(&st, "the stage failed at its deadline", |s| {
            s.state == StageState::Failed
        })
        .await?;
    let why = failed.reason.clone().unwrap_or_default();
    ensure!(
        why.starts_with("the deadline ") && why.contains("passed while waiting for validation"),
        "{why}"
    );
    let (_, reason) = slurm
        .wait_job(job, "the job held with the reason", |s, r| {
            s == "PENDING" && r.contains(&why)
        })
        .await?;
    eprintln!("held {:?} after sbatch: {reason}", submitted.elapsed());
    ensure!(
        !slurm.output(job).is_ok_and(|o| o.contains("path=")),
        "the job ran without its data"
    );
    Ok(())
}

/// (d) and (e): a node-local job gets its data on its node through the Prolog: data_in stages
/// the version to the hot tier, the Prolog asks for the node's local tier (--node), the node's
/// promoter agent copies it there, the TaskProlog exports the path; the Epilog releases the
/// local stage and teardown the hot one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_tier_job_gets_its_data_on_its_node_through_the_prolog() -> anyhow::Result<()> {
    let node = slurm_node()?;
    let (stagehand, slurm) = setup(Options {
        node_agent: Some(node.clone()),
        ..with_validator()
    })
    .await?;
    let (folder, expected) = dataset_folder(&[("s0.tar", &[1u8; 50_000]), ("index.json", b"{}")])?;
    let digest = stagehand.ingest(folder.path(), "shards", true)?;
    let version = &digest[..16];
    let job = slurm.submit(
        "local",
        &reading_job(
            &directive("shards", version, "local"),
            "STAGEHAND_DATA_SHARDS",
        ),
    )?;
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    let root = on_tier(&stagehand, "local", "shards", &digest);
    ensure!(path == root.display().to_string(), "job saw {path:?}");
    ensure!(sums == expected, "job read {sums:?}");
    let hot = stage(job, "shards", version, "hot", None);
    let local = stage(job, "shards", version, "local", Some(&node));
    let request = stagehand.requested(&local).await?;
    let Body::StageRequested(req) = &request.body else {
        bail!("not a stage request: {request:?}");
    };
    ensure!(req.node.as_deref() == Some(node.as_str()), "{req:?}");
    stagehand.released(&local).await?;
    stagehand.released(&hot).await?;
    Ok(())
}

/// Issue 17 item 3, as `deploy/slurm/README.md` (*Sending a job where its data already is*)
/// documents it for 22.05: once a job's Prolog made the node's local copy, `stagehand stage
/// where --hostlist` names that node, and a second job submitted with `--nodelist=<that list>`
/// runs there and reads the same copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_sent_where_stage_where_lists_reads_the_copy_already_there() -> anyhow::Result<()> {
    let node = slurm_node()?;
    let (stagehand, slurm) = setup(Options {
        node_agent: Some(node.clone()),
        ..with_validator()
    })
    .await?;
    let (folder, expected) = dataset_folder(&[("s0.tar", &[5u8; 30_000]), ("index.json", b"{}")])?;
    let digest = stagehand.ingest(folder.path(), "shards", true)?;
    let version = &digest[..16];
    let script = reading_job(
        &directive("shards", version, "local"),
        "STAGEHAND_DATA_SHARDS",
    );
    let where_held = || -> anyhow::Result<Output> {
        Ok(Command::new(env!("CARGO_BIN_EXE_stagehand"))
            .args(["--nats", &stagehand.url, "stage", "where"])
            .arg(format!("shards@{version}"))
            .args(["--project", PROJECT, "--tier", "local", "--hostlist"])
            .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
            .output()?)
    };
    // The recorder may still be starting its queries (exit 69, "no responders"): ask until it
    // answers.
    let out = wait_for(JOB, "the catalogue to answer stage where", || async {
        where_held()
            .ok()
            .filter(|out| out.status.code() != Some(69))
    })
    .await?;
    ensure!(
        out.status.code() == Some(3) && out.stdout.is_empty(),
        "before any job: {}",
        said(&out)
    );

    let first = slurm.submit("where-first", &script)?;
    slurm
        .wait_job(first, "the first job to complete", |s, _| s == "COMPLETED")
        .await?;
    // The replica is folded into the catalogue from the agent's fact, which the job did not
    // wait for: poll until the node is listed.
    let held = wait_for(JOB, "stage where to name the node", || async {
        let out = where_held().ok()?;
        (out.status.code() == Some(0))
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    })
    .await?;
    ensure!(
        held == node,
        "stage where --hostlist printed {held:?}, not {node:?}"
    );

    let second = slurm.submit_with("where-second", &script, &[&format!("--nodelist={held}")])?;
    slurm
        .wait_job(second, "the job sent to the node to complete", |s, _| {
            s == "COMPLETED"
        })
        .await?;
    let shown = slurm.show_job(second)?;
    ensure!(
        shown.contains(&format!("ReqNodeList={node}"))
            && shown.contains(&format!("NodeList={node}")),
        "{shown}"
    );
    let (path, sums) = read_sums(&slurm.output(second)?);
    let root = on_tier(&stagehand, "local", "shards", &digest);
    ensure!(path == root.display().to_string(), "job saw {path:?}");
    ensure!(sums == expected, "job read {sums:?}");
    Ok(())
}

/// A node-local stage that fails in the Prolog (the project's local quota is too small):
/// Slurm's rule for a failing Prolog applies (the job is requeued and held, the node drained),
/// the job's AdminComment carries the promoter's reason, and this run's stages are released.
/// Released by an administrator, the requeued job stages afresh, as run `.r1` (a release is
/// final, so the first run's ids cannot be asked again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_local_stage_holds_the_job_with_the_reason_and_a_requeue_stages_afresh()
-> anyhow::Result<()> {
    let node = slurm_node()?;
    let (stagehand, slurm) = setup(Options {
        node_agent: Some(node.clone()),
        local_quota: Some("default = \"1 KiB\"".to_owned()),
        ..with_validator()
    })
    .await?;
    let (folder, _) = dataset_folder(&[("big.bin", &[3u8; 10_000])])?;
    let digest = stagehand.ingest(folder.path(), "big", true)?;
    let version = &digest[..16];
    let job = slurm.submit(
        "local-fails",
        &reading_job(&directive("big", version, "local"), "STAGEHAND_DATA_BIG"),
    )?;
    let (state, reason) = slurm
        .wait_job(job, "the job requeued and held", |s, r| {
            s == "PENDING" && r.starts_with("JobHeld")
        })
        .await?;
    eprintln!("after the Prolog failed: {state} {reason}");
    // 22.05's squeue has no AdminComment field; scontrol shows it on a line of its own.
    let shown = slurm.show_job(job)?;
    let comment = shown
        .lines()
        .find_map(|l| l.trim().strip_prefix("AdminComment="))
        .unwrap_or_default()
        .to_owned();
    let prefix =
        format!("stagehand: big@{version} on local for node {node} failed: quota exceeded: ");
    ensure!(comment.starts_with(&prefix), "AdminComment {comment:?}");
    ensure!(
        !slurm.output(job).is_ok_and(|o| o.contains("path=")),
        "the job ran without its data"
    );
    let out = slurm
        .cmd("sinfo")
        .args(["-h", "-n", &node, "-o", "%T"])
        .output()?;
    let node_state = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    ensure!(node_state.starts_with("drain"), "node state {node_state:?}");
    // The first run's stages are released: the Epilog the node-local one, teardown the hot one.
    let local = stage(job, "big", version, "local", Some(&node));
    let hot = stage(job, "big", version, "hot", None);
    stagehand.released(&local).await?;
    stagehand.released(&hot).await?;

    // An administrator resumes the node and releases the job: its second run asks afresh.
    for args in [
        vec![
            "update".to_owned(),
            format!("NodeName={node}"),
            "State=RESUME".to_owned(),
        ],
        vec!["release".to_owned(), job.to_string()],
        // Slurm defers a requeued job two minutes; make it eligible now.
        vec![
            "update".to_owned(),
            format!("JobId={job}"),
            "StartTime=now".to_owned(),
        ],
    ] {
        let out = slurm.cmd("scontrol").args(&args).output()?;
        ensure!(out.status.success(), "scontrol {args:?}: {}", said(&out));
    }
    let second = Stage {
        job: format!("{JOB_PREFIX}{job}.r1"),
        ..hot.clone()
    };
    if let Err(e) = stagehand.requested(&second).await {
        bail!("{e}: {}\n{}", slurm.show_job(job)?, slurm.logs());
    }
    Ok(())
}

/// A stage-in that starts while NATS is down is not held: the hooks ask again while the
/// stage-in budget lasts, and the job runs once NATS is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_submitted_while_nats_is_down_runs_once_it_is_back() -> anyhow::Result<()> {
    let (mut stagehand, slurm) = setup(with_validator()).await?;
    let (folder, expected) = dataset_folder(&[("x.bin", b"after the outage")])?;
    let digest = stagehand.ingest(folder.path(), "outage", true)?;
    let version = &digest[..16];
    stagehand.server.kill();
    let job = slurm.submit(
        "outage",
        &reading_job(
            &directive("outage", version, "hot"),
            "STAGEHAND_DATA_OUTAGE",
        ),
    )?;
    slurm
        .wait_job(job, "the job in stage-in", |s, r| {
            s == "PENDING" && (r == "BurstBufferStageIn" || r == "BurstBufferResources")
        })
        .await?;
    stagehand.server.restart();
    let back = Instant::now();
    if let Err(e) = slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await
    {
        let st = stage(job, "outage", version, "hot", None);
        bail!("{e}\n{}", stagehand.explain(&st).await);
    }
    eprintln!("NATS back→complete {:?}", back.elapsed());
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == on_tier(&stagehand, "hot", "outage", &digest)
            .display()
            .to_string()
    );
    ensure!(sums == expected, "{sums:?}");
    Ok(())
}

/// slurmctld restarted while a job waits in stage-in: Slurm tears the job's burst buffer down
/// and stages it in again, so every hook runs twice. The
/// teardown of a job still pending must not release its stage (a release is final), and the
/// second stage-in asks the same request: the job runs once its data is ready, and its stage is
/// released once, when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restart_during_stage_in_keeps_the_request_and_the_job_runs()
-> anyhow::Result<()> {
    let (mut stagehand, slurm) = setup(without_validator()).await?;
    let (folder, expected) = dataset_folder(&[("r.bin", b"staged across a restart")])?;
    let digest = stagehand.ingest(folder.path(), "restart", false)?;
    let version = &digest[..16];
    let job = slurm.submit(
        "restart",
        &reading_job(
            &directive("restart", version, "hot"),
            "STAGEHAND_DATA_RESTART",
        ),
    )?;
    let st = stage(job, "restart", version, "hot", None);
    stagehand
        .status_where(&st, "the stage waiting for validation", |s| {
            s.waiting_for.as_deref() == Some("validation")
        })
        .await?;
    let out = Command::new("bash")
        .arg(slurm_sh())
        .arg("restart-controller")
        .env("STAGEHAND_SLURM_DIR", slurm.dir.path())
        .output()?;
    ensure!(out.status.success(), "restart-controller: {}", said(&out));
    // The teardown after the restart saw the job pending and kept its stage.
    let log = slurm.dir.path().join("log/slurmctld.log");
    let line = format!("stagehand: job {job} pending again");
    wait_for(JOB, "the teardown after the restart", || {
        let seen = std::fs::read_to_string(&log)
            .is_ok_and(|text| text.contains(&line))
            .then_some(());
        async move { seen }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}; {}", slurm.logs()))?;
    let (state, _) = slurm.job(job)?;
    ensure!(state == "PENDING", "after the restart the job is {state}");
    stagehand.start_validator();
    let started = Instant::now();
    // Slurm defers a job a minute after tearing its buffer down; what an administrator
    // does to skip that (it is Slurm's wait, not Stagehand's) keeps the test short.
    let out = slurm
        .cmd("scontrol")
        .args(["update", &format!("JobId={job}"), "StartTime=now"])
        .output()?;
    ensure!(out.status.success(), "scontrol update: {}", said(&out));
    let (state, _) = wait_for(JOB, "the job to complete", || {
        let seen = slurm
            .job(job)
            .ok()
            .filter(|(s, _)| s == "COMPLETED" || s == "FAILED");
        async move { seen }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}; {}", slurm.logs()))?;
    ensure!(state == "COMPLETED", "{state}");
    eprintln!("ran {:?} after the validator started", started.elapsed());
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == on_tier(&stagehand, "hot", "restart", &digest)
            .display()
            .to_string()
    );
    ensure!(sums == expected, "{sums:?}");
    stagehand.released(&st).await?;
    Ok(())
}

/// A `stagehand` for the hooks that writes down the command line and environment it was run
/// with, and those of the shell that ran it, then runs the real binary: what any user of the
/// machine could read in `/proc/<pid>/cmdline` (and root in `environ`) while a hook runs.
fn recording_bin(dir: &std::path::Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let log = dir.join("seen.log");
    let bin = dir.join("stagehand");
    std::fs::write(
        &bin,
        format!(
            "#!/bin/sh\n\
             {{ echo \"cmdline: $(tr '\\0' ' ' </proc/$$/cmdline)\"\n\
                echo \"parent: $(tr '\\0' ' ' </proc/$PPID/cmdline)\"\n\
                echo \"environ: $(tr '\\0' ' ' </proc/$$/environ)\"; }} >>'{}'\n\
             exec '{}' \"$@\"\n",
            log.display(),
            env!("CARGO_BIN_EXE_stagehand")
        ),
    )?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    Ok((bin, log))
}

/// Issue 19, "Schedulers act for their users only", on a real Slurm and a nats-server with the
/// shipped accounts. stagehand-slurm.conf allows the test user project `lab` and account `labb`
/// project `labb`: a job of account `demo` naming `project=labb` is refused at sbatch with the
/// reason (before, it ran and printed labb's bytes), a job of account `labb` runs and reads
/// labb's data, a waiting job's account cannot be changed to one that may not stage its
/// project, and `scontrol show bbstat` shows a user no stage of labb (22.05 cannot tell who
/// asks). The hooks run as the shipped `scheduler` user with its password in a root-only file:
/// no command line they run, and no environment, holds the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_stage_only_their_users_projects_and_the_hooks_show_no_secret() -> anyhow::Result<()> {
    use stagehand_testkit::{role_password, user_url};
    let server = stagehand_testkit::NatsServer::builder()
        .shipped_accounts_with_projects(&["labb"])
        .start();
    let operator = user_url(&server, "operator", "OPERATOR");
    let password = role_password("SCHEDULER");
    let secrets = tempfile::tempdir()?;
    std::fs::set_permissions(secrets.path(), std::fs::Permissions::from_mode(0o700))?;
    let password_file = secrets.path().join("stagehand-nats.password");
    std::fs::write(&password_file, format!("{password}\n"))?;
    std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600))?;
    let (bin, seen) = recording_bin(secrets.path())?;
    let hooks_url = format!("nats://scheduler@127.0.0.1:{}", server.port());
    let settings = vec![
        ("STAGEHAND_BIN", bin.display().to_string()),
        (
            "STAGEHAND_NATS_PASSWORD_FILE",
            password_file.display().to_string(),
        ),
        (
            "STAGEHAND_SLURM_ALLOW",
            "user=stagehand-job lab;account=labb labb".to_owned(),
        ),
    ];
    // Slurm first: it makes the job user, whose group reads both projects' staged data here
    // (what keeps labb's data from demo's jobs in this test is the accounts, not the files).
    let slurm =
        tokio::task::spawn_blocking(move || Slurm::start_with(&hooks_url, &settings)).await??;
    let stagehand = Stagehand::start_on(
        server,
        Options {
            nats_url: Some(operator),
            job_groups: vec![
                (PROJECT.to_owned(), slurm.user.clone()),
                ("labb".to_owned(), slurm.user.clone()),
            ],
            ..with_validator()
        },
    )
    .await?;
    let (folder, expected) = dataset_folder(&[("weights.bin", &[5u8; 4099]), ("notes", b"labb")])?;
    let digest = stagehand.ingest_to("labb", folder.path(), "labb-private", true)?;
    let version = &digest[..16];
    let directives = vec![format!(
        "#BB_LUA stage dataset=labb-private version={version} tier=hot project=labb"
    )];
    let script = reading_job(&directives, "STAGEHAND_DATA_LABB_PRIVATE");

    // Account demo may not stage labb: refused at submit, sbatch says why.
    let out = slurm.sbatch_with("demo-asks-labb", &script, &["--account=demo"])?;
    ensure!(
        !out.status.success(),
        "a job of account demo naming project=labb was accepted: {}",
        said(&out)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        err.contains("sbatch: error: stagehand: line 2 (")
            && err.contains("account demo may not stage project 'labb'")
            && err.contains("allows this job: lab)"),
        "sbatch said {err:?}"
    );

    // Account labb may: the job runs and reads labb's files.
    let job = slurm.submit_with("labb-asks-labb", &script, &["--account=labb"])?;
    slurm
        .wait_job(job, "the labb job to complete", |s, _| s == "COMPLETED")
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(sums == expected, "the labb job read {sums:?} at {path}");
    let labb = Stage {
        project: "labb".to_owned(),
        ..stage(job, "labb-private", version, "hot", None)
    };
    stagehand.released(&labb).await?;

    // A waiting job of account labb cannot be moved to account demo.
    let held = slurm.submit_with("held", &script, &["--account=labb", "--hold"])?;
    let out = slurm
        .cmd("runuser")
        .args(["-u", &slurm.user, "--", "env"])
        .arg(format!("SLURM_CONF={}", slurm.conf.display()))
        .args([
            "scontrol",
            "update",
            &format!("JobId={held}"),
            "Account=demo",
        ])
        .output()?;
    ensure!(
        !out.status.success(),
        "the account of a job naming labb was changed to demo: {}",
        said(&out)
    );
    ensure!(
        slurm.show_job(held)?.contains("Account=labb"),
        "{}",
        slurm.show_job(held)?
    );

    // bbstat shows the test user no stage of labb (22.05 does not say who asks).
    for words in [vec!["project=labb"], vec![&st_job(job)[..], "project=labb"]] {
        let out = slurm
            .cmd("runuser")
            .args(["-u", &slurm.user, "--", "env"])
            .arg(format!("SLURM_CONF={}", slurm.conf.display()))
            .args(["scontrol", "show", "bbstat"])
            .args(&words)
            .output()?;
        let shown = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            !shown.contains("labb-private") && shown.contains("does not tell bbstat who asks"),
            "bbstat {words:?} showed {shown:?}"
        );
    }

    // The hooks ran the CLI as `scheduler` (the job above got its data), with the password in
    // no command line and no environment.
    let seen = std::fs::read_to_string(&seen)?;
    ensure!(
        seen.contains("--password-file") && seen.contains("stage request"),
        "the hooks ran no stagehand: {seen:?}"
    );
    ensure!(
        !seen.contains(&password),
        "a hook's command line or environment holds the password:\n{seen}"
    );
    Ok(())
}

/// The job id Stagehand sees for Slurm job `job`.
fn st_job(job: u32) -> String {
    format!("{JOB_PREFIX}{job}")
}

/// `stagehand <args>` on the test's stack.
fn stagehand_cli(stagehand: &Stagehand) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(["--nats", &stagehand.url]);
    cmd
}

/// Whether the stage's request is in the requests stream now.
async fn request_stored(stagehand: &Stagehand, st: &Stage) -> anyhow::Result<bool> {
    let subject = stagehand_schemas::subject::kind_filter("req", "stage.requested");
    let events =
        stagehand_testkit::stored_events(stagehand.bus.jetstream(), "STAGEHAND_REQUESTS", &subject)
            .await
            .map_err(|e| anyhow::anyhow!("reading the requests: {e}"))?;
    Ok(events.iter().any(|event| event.id == st.request_id()))
}

impl Slurm {
    /// The file `stagehand tier pool --slurm` writes and `slurm_bb_pools` reads (slurm.sh's
    /// STAGEHAND_POOL_FILE).
    fn pool_file(&self) -> PathBuf {
        self.dir.path().join("stagehand/pools")
    }

    /// The `PoolName[..]=<pool> ...` line of `scontrol show burst`: the pool as slurmctld
    /// counts it.
    fn pool_line(&self, pool: &str) -> anyhow::Result<String> {
        let out = self.cmd("scontrol").args(["show", "burst"]).output()?;
        ensure!(out.status.success(), "scontrol show burst: {}", said(&out));
        let text = String::from_utf8(out.stdout)?;
        Ok(text
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("PoolName[") && l.contains(&format!("]={pool} ")))
            .unwrap_or_default()
            .to_owned())
    }

    /// Waits until slurmctld shows the pool's free space as `free` (it reads the pools at
    /// start and every 30 s).
    async fn wait_pool_free(&self, pool: &str, free: &str) -> anyhow::Result<String> {
        let want = format!("FreeSpace={free} ");
        let mut last = String::new();
        let found = wait_for(
            JOB,
            &format!("slurmctld to see {want}in pool {pool}"),
            || {
                let line = self.pool_line(pool).unwrap_or_default();
                let hit = line.contains(&want).then(|| line.clone());
                last = line;
                async move { hit }
            },
        )
        .await;
        found.map_err(|e| anyhow::anyhow!("{e}; last seen {last:?}; {}", self.logs()))
    }
}

/// Runs `stagehand tier pool hot --slurm <the cluster's pool file>` until the file says `free`
/// bytes of hot are free (the catalogue records a stage's hold or release a moment after the
/// stage's own status).
async fn write_pool_file(stagehand: &Stagehand, slurm: &Slurm, free: u64) -> anyhow::Result<()> {
    write_pool_file_saying(stagehand, slurm, &format!("\npool hot {HOT_POOL} {free}\n")).await
}

/// [`write_pool_file`] until the file holds `want`.
async fn write_pool_file_saying(
    stagehand: &Stagehand,
    slurm: &Slurm,
    want: &str,
) -> anyhow::Result<()> {
    let mut last = String::new();
    let found = wait_for(JOB, &format!("the pool file to say {want:?}"), || {
        let out = stagehand_cli(stagehand)
            .args(["tier", "pool", "hot", "--policies"])
            .arg(&stagehand.policies)
            .arg("--slurm")
            .arg(slurm.pool_file())
            .output();
        let text = std::fs::read_to_string(slurm.pool_file()).unwrap_or_default();
        let hit = text.contains(want).then_some(());
        last = match out {
            Ok(out) if !out.status.success() => said(&out),
            _ => text,
        };
        async move { hit }
    })
    .await;
    found.map_err(|e| anyhow::anyhow!("{e}; last {last:?}"))
}

/// The hot tier's capacity in the pool test: 64 KiB.
const HOT_POOL: u64 = 65_536;

/// Waits for job `job` to complete and checks that it read `dataset@digest` on hot, byte for
/// byte (`expected`).
async fn read_its_data_on_hot(
    stagehand: &Stagehand,
    slurm: &Slurm,
    job: u32,
    (dataset, digest): (&str, &str),
    expected: &[(String, String)],
) -> anyhow::Result<()> {
    slurm
        .wait_job(job, &format!("job {job} to complete"), |s, _| {
            s == "COMPLETED"
        })
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    let want = on_tier(stagehand, "hot", dataset, digest);
    ensure!(path == want.display().to_string(), "job {job} read {path}");
    ensure!(sums == expected, "{sums:?}");
    Ok(())
}

/// Checks that job `job` still waits for its pool, staged nothing, once Slurm has tried it
/// again: a plain job's scheduling pass ends with Slurm's stage-in attempt for jobs waiting on
/// the burst buffer (`schedule` → `bb_g_job_try_stage_in`), so once a plain job has run, `job`
/// was tried against the pools as they are now.
async fn still_waits_for_its_pool(slurm: &Slurm, job: u32, why: &str) -> anyhow::Result<()> {
    let plain = slurm.submit(&format!("plain-{job}"), "#!/bin/bash\ntrue\n")?;
    slurm
        .wait_job(plain, "a plain job to complete", |s, _| s == "COMPLETED")
        .await?;
    let shown = slurm.show_job(job)?;
    ensure!(
        shown.contains("Reason=BurstBufferResources") && shown.contains("BurstBufferState=pending"),
        "job {job} was staged in {why}: scontrol show job {job}: {shown}"
    );
    Ok(())
}

/// (e) The hot tier as a Slurm pool. `stagehand tier pool` writes its capacity and what the
/// promoter would still reserve there; `slurm_bb_pools` reports it; Slurm stages in only jobs
/// whose declared size (`capacity=`) fits what is free. A stage held outside Slurm (an
/// interactive job) leaves 24 KiB: job A's 10 KiB fit, A is staged and reads its data; job B's
/// 30 000 bytes do not, and B is not staged — no request, no copy — while squeue shows it
/// waiting for burst buffer resources. Once the holder lets go its replica stays on hot, unheld
/// beside A's: the promoter still refuses B (`hot is full`), and the pool says 14 KiB free, so
/// Slurm still does not stage B in. A job that declares less than its data is held with the
/// reason and asks for nothing; one that declares nothing on the pool tier is refused at
/// submit. A stale pool file reports the pool unbounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_data_cannot_fit_the_hot_pool_is_not_staged() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup_with(
        Options {
            hot_capacity: Some("64 KiB".into()),
            ..with_validator()
        },
        vec![("STAGEHAND_POOL_TIERS", "hot".into())],
    )
    .await?;
    // Before any pool file, hot is reported unbounded: jobs are staged as without pools.
    slurm.wait_pool_free("hot", "1PiB").await?;
    let (holder, _) = dataset_folder(&[("h.bin", &[1u8; 40_960])])?;
    let (small, expected) = dataset_folder(&[("s.bin", &[2u8; 10_240])])?;
    let (big, _) = dataset_folder(&[("b.bin", &[3u8; 30_000])])?;
    let holder = stagehand.ingest(holder.path(), "holder", true)?;
    let small = stagehand.ingest(small.path(), "small", true)?;
    let big = stagehand.ingest(big.path(), "big", true)?;

    // The holder: a stage of an interactive job, which Slurm knows nothing of.
    let held = Stage {
        job: "interactive-1".into(),
        ..stage(0, "holder", &holder[..16], "hot", None)
    };
    let target = [
        "holder@".to_owned() + &holder[..16],
        "--tier".into(),
        "hot".into(),
        "--job".into(),
        held.job.clone(),
        "--project".into(),
        PROJECT.into(),
    ];
    let out = stagehand_cli(&stagehand)
        .args(["stage", "request"])
        .args(&target)
        .output()?;
    ensure!(out.status.success(), "stage request: {}", said(&out));
    let out = stagehand_cli(&stagehand)
        .args(["stage", "wait"])
        .args(&target)
        .args(["--timeout", "60"])
        .output()?;
    ensure!(out.status.success(), "stage wait: {}", said(&out));
    write_pool_file(&stagehand, &slurm, HOT_POOL - 40_960).await?;
    let line = slurm.wait_pool_free("hot", "24KiB").await?;
    eprintln!("slurmctld's pool: {line}");

    let declare = |dataset: &str, digest: &str, bytes: u64| {
        vec![format!(
            "#BB_LUA stage dataset={dataset} version={} tier=hot project={PROJECT} capacity={bytes} pool=hot",
            &digest[..16]
        )]
    };
    // On a pool tier a directive must declare its size: refused at submit, saying how.
    let undeclared = slurm.sbatch(
        "undeclared",
        &reading_job(
            &directive("small", &small[..16], "hot"),
            "STAGEHAND_DATA_SMALL",
        ),
    )?;
    let refusal = String::from_utf8_lossy(&undeclared.stderr);
    ensure!(
        !undeclared.status.success()
            && refusal.contains(
                "tier hot is a Slurm pool (STAGEHAND_POOL_TIERS): add capacity=<bytes of small@"
            ),
        "a directive without capacity= on the pool tier: {refusal}"
    );
    // A fits; the liar declares 1 000 bytes for big's 30 000, which Slurm would fit too.
    let a = slurm.submit(
        "fits",
        &reading_job(&declare("small", &small, 10_240), "STAGEHAND_DATA_SMALL"),
    )?;
    let liar = slurm.submit(
        "liar",
        &reading_job(&declare("big", &big, 1_000), "STAGEHAND_DATA_BIG"),
    )?;
    read_its_data_on_hot(&stagehand, &slurm, a, ("small", &small), &expected).await?;
    let (_, reason) = slurm
        .wait_job(liar, "the liar held", |s, r| {
            s == "PENDING" && r.contains("slurm_bb_data_in")
        })
        .await?;
    ensure!(
        reason.contains(&format!(
            "{PROJECT}/big@{big} is 30000 bytes, more than the 1000 bytes declared for it (capacity=)"
        )),
        "the liar's reason: {reason:?}"
    );
    ensure!(
        !request_stored(&stagehand, &stage(liar, "big", &big[..16], "hot", None)).await?,
        "the liar's stage was requested"
    );

    // B does not fit the 24 KiB left: not staged.
    let b = slurm.submit(
        "too-big",
        &reading_job(&declare("big", &big, 30_000), "STAGEHAND_DATA_BIG"),
    )?;
    let (_, reason) = slurm
        .wait_job(b, "job B pending for burst buffer resources", |s, r| {
            s == "PENDING" && r == "BurstBufferResources"
        })
        .await?;
    let b_stage = stage(b, "big", &big[..16], "hot", None);
    ensure!(
        !request_stored(&stagehand, &b_stage).await?,
        "job B's stage was requested while its data could not fit ({reason})"
    );
    ensure!(
        !on_tier(&stagehand, "hot", "big", &big).exists(),
        "big was copied to hot"
    );
    let shown = slurm.show_job(b)?;
    ensure!(
        shown.contains("Reason=BurstBufferResources") && shown.contains("BurstBufferState=pending"),
        "scontrol show job {b}: {shown}"
    );

    // The holder lets go; its replica stays on hot, held by no one, beside A's (the demoter
    // removes unheld replicas only above the high watermark). The promoter counts both and
    // refuses big; the pool file counts both too: 64 KiB less 40 KiB less 10 KiB.
    let out = stagehand_cli(&stagehand)
        .args(["stage", "release"])
        .args(&target)
        .output()?;
    ensure!(out.status.success(), "stage release: {}", said(&out));
    let refused = [
        "big@".to_owned() + &big[..16],
        "--tier".into(),
        "hot".into(),
        "--job".into(),
        "interactive-2".into(),
        "--project".into(),
        PROJECT.into(),
    ];
    let out = stagehand_cli(&stagehand)
        .args(["stage", "request"])
        .args(&refused)
        .output()?;
    ensure!(out.status.success(), "stage request: {}", said(&out));
    let out = stagehand_cli(&stagehand)
        .args(["stage", "wait"])
        .args(&refused)
        .args(["--timeout", "60"])
        .output()?;
    // Refused counting 40 KiB + 10 KiB of 64 KiB (the test's project quota is hot's capacity,
    // so the quota speaks first: `quota exceeded`, else `hot is full`).
    let said_why = said(&out);
    ensure!(
        !out.status.success() && said_why.contains("51200") && said_why.contains("65536"),
        "the promoter did not refuse big beside the unheld replicas: {said_why}"
    );
    write_pool_file(&stagehand, &slurm, HOT_POOL - 40_960 - 10_240).await?;
    slurm.wait_pool_free("hot", "14KiB").await?;
    // Tried again against the 14 KiB, B still waits.
    still_waits_for_its_pool(&slurm, b, "while the promoter would refuse it").await?;
    ensure!(
        !request_stored(&stagehand, &b_stage).await?,
        "job B's stage was requested while the promoter would refuse it"
    );

    // A stale pool file (its writer stopped) fails no job: the pool is reported unbounded
    // again, and slurmctld's log says why.
    std::fs::write(
        slurm.pool_file(),
        format!("written 1\npool hot {HOT_POOL} 0\n"),
    )?;
    slurm.wait_pool_free("hot", "1PiB").await?;
    let log = std::fs::read_to_string(slurm.dir.path().join("log/slurmctld.log"))?;
    ensure!(
        log.contains("stagehand: pools hot reported unbounded: ")
            && log.contains("more than STAGEHAND_POOL_MAX_AGE (300 s)"),
        "slurmctld.log does not say why the pool is unbounded: {}",
        slurm.logs()
    );
    Ok(())
}

/// (e) A project's share of the hot pool. Hot has 64 KiB, project `lab` a quota of 16 KiB
/// there: `slurm_bb_pools` reports pool `hot.lab` as its quota less what the project holds,
/// never more than hot has free. Job A's 10 KiB fit the 16 KiB and are staged; its replica
/// stays reserved to the project once A ends, which leaves `hot.lab` 6 KiB while hot has
/// 54 KiB free: job B's 10 KiB in `hot.lab` are not staged (no request, no copy), and squeue
/// shows B waiting for burst buffer resources. Without the project's pool Slurm would stage B
/// in and the promoter refuse it over the quota. Another project's pool is refused at submit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_over_its_project_s_quota_is_not_staged() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup_with(
        Options {
            hot_capacity: Some("64 KiB".into()),
            hot_quota: Some(format!("{PROJECT} = \"16 KiB\"")),
            ..with_validator()
        },
        vec![
            ("STAGEHAND_POOL_TIERS", "hot".into()),
            // Another project, allowed to another user: its pool `hot.vision` is reported.
            (
                "STAGEHAND_SLURM_ALLOW",
                format!("user=stagehand-job {PROJECT};user=root vision"),
            ),
        ],
    )
    .await?;
    let (first, expected) = dataset_folder(&[("f.bin", &[4u8; 10_240])])?;
    let (second, _) = dataset_folder(&[("g.bin", &[5u8; 10_240])])?;
    let first = stagehand.ingest(first.path(), "first", true)?;
    let second = stagehand.ingest(second.path(), "second", true)?;
    let own_pool = format!("hot.{PROJECT}");
    let declare = |dataset: &str, digest: &str, pool: &str| {
        vec![format!(
            "#BB_LUA stage dataset={dataset} version={} tier=hot project={PROJECT} capacity=10240 pool={pool}",
            &digest[..16]
        )]
    };
    write_pool_file_saying(
        &stagehand,
        &slurm,
        &format!("\npool hot {HOT_POOL} {HOT_POOL}\nquota-default hot {HOT_POOL}\nquota hot {PROJECT} 16384 0\n"),
    )
    .await?;
    slurm.wait_pool_free(&own_pool, "16KiB").await?;
    slurm.wait_pool_free("hot.vision", "64KiB").await?;

    // Another project's share is not this job's to draw on: refused at submit.
    let other = slurm.sbatch(
        "other-pool",
        &reading_job(
            &declare("first", &first, "hot.vision"),
            "STAGEHAND_DATA_FIRST",
        ),
    )?;
    let refusal = String::from_utf8_lossy(&other.stderr);
    ensure!(
        !other.status.success() && refusal.contains(&format!("capacity= needs pool={own_pool}")),
        "a directive drawing on another project's pool: {refusal}"
    );

    // A fits the project's 16 KiB: staged, and reads its data.
    let a = slurm.submit(
        "fits-quota",
        &reading_job(&declare("first", &first, &own_pool), "STAGEHAND_DATA_FIRST"),
    )?;
    read_its_data_on_hot(&stagehand, &slurm, a, ("first", &first), &expected).await?;

    // A's replica stays on hot, reserved to the project: 6 KiB of its quota left, 54 KiB of hot.
    write_pool_file_saying(
        &stagehand,
        &slurm,
        &format!("\npool hot {HOT_POOL} 55296\nquota-default hot {HOT_POOL}\nquota hot {PROJECT} 16384 10240\n"),
    )
    .await?;
    let line = slurm.wait_pool_free(&own_pool, "6KiB").await?;
    eprintln!("slurmctld's pool of the project: {line}");
    let hot = slurm.wait_pool_free("hot", "54KiB").await?;
    eprintln!("slurmctld's pool of the tier: {hot}");

    // B's 10 KiB fit hot but not the project's share: not staged.
    let b = slurm.submit(
        "over-quota",
        &reading_job(
            &declare("second", &second, &own_pool),
            "STAGEHAND_DATA_SECOND",
        ),
    )?;
    let (_, reason) = slurm
        .wait_job(b, "job B pending for burst buffer resources", |s, r| {
            s == "PENDING" && r == "BurstBufferResources"
        })
        .await?;
    // Tried again against the 6 KiB, B still waits.
    still_waits_for_its_pool(&slurm, b, "over its project's quota").await?;
    ensure!(
        !request_stored(&stagehand, &stage(b, "second", &second[..16], "hot", None)).await?,
        "job B's stage was requested over its project's quota ({reason})"
    );
    ensure!(
        !on_tier(&stagehand, "hot", "second", &second).exists(),
        "second was copied to hot"
    );
    Ok(())
}
