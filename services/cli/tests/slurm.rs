//! Stagehand's Slurm integration on a real Slurm: each test starts a one-node cluster with
//! `deploy/slurm/slurm.sh start` (installing Slurm from the distribution when it is missing;
//! a machine where that fails fails the test with the reason), a real nats-server, and submits
//! real batch jobs with `sbatch` as the ordinary test user (root may not use burst buffers).
//!
//! The hooks (`deploy/slurm/burst_buffer.lua`, `deploy/slurm/stagehand-node.sh`) call the built
//! `stagehand` binary. What a job waits on is the stage's `stagehand_stages` KV entry, kept by
//! the real catalogue recorder (running in-process as `stagehand up` runs it) from the
//! promoter's facts, which these tests publish for the requests the hooks make.
//!
//! Every wait polls Slurm (`squeue`) or NATS against a deadline; nothing sleeps.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{Stagehand, VERSION};
use stagehand::stage::Stage;
use stagehand_schemas::{Body, sha256_hex};
use stagehand_testkit::wait_for;

/// Bound on a job getting from submit to where a test expects it.
const JOB: Duration = Duration::from_secs(60);
/// The prefix slurm.sh gives Slurm job ids in stage requests (STAGEHAND_JOB_PREFIX).
const JOB_PREFIX: &str = "slurm-stagehand-";
const PROJECT: &str = "lab";

/// A one-node Slurm cluster under a temp dir, stopped on drop.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    user: String,
    node: String,
}

fn slurm_sh() -> PathBuf {
    stagehand_testkit::repo_root().join("deploy/slurm/slurm.sh")
}

fn said(out: &Output) -> String {
    format!(
        "exit {:?}, stdout {:?}, stderr {:?}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

impl Slurm {
    fn start(nats_url: &str) -> anyhow::Result<Slurm> {
        let dir = tempfile::Builder::new()
            .prefix("stagehand-slurm-")
            .tempdir()?;
        // The job user runs the TaskProlog and the jobs beneath it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let user = "stagehand-job".to_owned();
        let out = Command::new("bash")
            .arg(slurm_sh())
            .arg("start")
            .env("STAGEHAND_SLURM_DIR", dir.path())
            .env("STAGEHAND_SLURM_USER", &user)
            .env("STAGEHAND_BIN", env!("CARGO_BIN_EXE_stagehand"))
            .env("STAGEHAND_NATS_URL", nats_url)
            .env("STAGEHAND_STAGE_IN_TIMEOUT", "120")
            .env("STAGEHAND_PROLOG_TIMEOUT", "60")
            .env("STAGEHAND_CONNECT_TIMEOUT", "2")
            .output()
            .context("running deploy/slurm/slurm.sh start")?;
        let slurm = Slurm {
            conf: dir.path().join("etc/slurm.conf"),
            dir,
            user,
            node: hostname()?,
        };
        ensure!(
            out.status.success(),
            "deploy/slurm/slurm.sh start failed: {}",
            said(&out)
        );
        for sub in ["jobs", "out", "data"] {
            let d = slurm.dir.path().join(sub);
            std::fs::create_dir(&d)?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))?;
        }
        // Job output goes where the job user may write.
        let out_dir = slurm.dir.path().join("out");
        let status = Command::new("chown")
            .arg(&slurm.user)
            .arg(&out_dir)
            .status()?;
        ensure!(status.success(), "chown {}", out_dir.display());
        Ok(slurm)
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Folder for test data (readable by the job user).
    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `sbatch` of `script` as the test user.
    fn sbatch(&self, name: &str, script: &str) -> anyhow::Result<Output> {
        let path = self.dir.path().join("jobs").join(format!("{name}.sh"));
        std::fs::write(&path, script)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        let out = self
            .cmd("runuser")
            .args(["-u", &self.user, "--", "env"])
            .arg(format!("SLURM_CONF={}", self.conf.display()))
            .args(["sbatch", "--parsable"])
            .arg(format!(
                "--output={}/%j.out",
                self.dir.path().join("out").display()
            ))
            .arg(&path)
            .output()?;
        Ok(out)
    }

    fn submit(&self, name: &str, script: &str) -> anyhow::Result<u32> {
        let out = self.sbatch(name, script)?;
        ensure!(out.status.success(), "sbatch {name}: {}", said(&out));
        let id = String::from_utf8(out.stdout)?;
        id.trim()
            .split(';')
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("sbatch printed {id:?}"))
    }

    /// The job's state and reason as squeue shows them (also for finished jobs).
    fn job(&self, id: u32) -> anyhow::Result<(String, String)> {
        let out = self
            .cmd("squeue")
            .args(["-h", "-t", "all", "-j", &id.to_string(), "-o", "%T|%r"])
            .output()?;
        ensure!(out.status.success(), "squeue: {}", said(&out));
        let text = String::from_utf8(out.stdout)?;
        let (state, reason) = text.trim().split_once('|').unwrap_or((text.trim(), ""));
        Ok((state.to_owned(), reason.to_owned()))
    }

    /// Waits until the job's (state, reason) satisfies `pred`; returns it.
    async fn wait_job(
        &self,
        id: u32,
        what: &str,
        pred: impl Fn(&str, &str) -> bool,
    ) -> anyhow::Result<(String, String)> {
        let mut last = (String::new(), String::new());
        let found = wait_for(JOB, what, || {
            let seen = self.job(id);
            let hit = match &seen {
                Ok((s, r)) => pred(s, r).then(|| (s.clone(), r.clone())),
                Err(_) => None,
            };
            if let Ok(s) = seen {
                last = s;
            }
            async move { hit }
        })
        .await;
        found.map_err(|e| anyhow::anyhow!("job {id}: {e}; last seen {last:?}; {}", self.logs()))
    }

    fn output(&self, id: u32) -> anyhow::Result<String> {
        let path = self.dir.path().join("out").join(format!("{id}.out"));
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    fn logs(&self) -> String {
        let tail = |name: &str| {
            let text =
                std::fs::read_to_string(self.dir.path().join("log").join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        };
        format!(
            "slurmctld.log:\n{}\nslurmd.log:\n{}",
            tail("slurmctld.log"),
            tail("slurmd.log")
        )
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(slurm_sh())
            .arg("stop")
            .env("STAGEHAND_SLURM_DIR", self.dir.path())
            .output();
    }
}

fn hostname() -> anyhow::Result<String> {
    let out = Command::new("hostname").arg("-s").output()?;
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// A dataset folder on the "hot tier" (a folder the job can read), with its expected sums.
fn write_dataset(root: &Path, files: &[(&str, &[u8])]) -> anyhow::Result<Vec<(String, String)>> {
    let mut sums = Vec::new();
    for (rel, bytes) in files {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().expect("a file has a parent"))?;
        std::fs::write(&path, bytes)?;
        sums.push((format!("./{rel}"), sha256_hex(bytes)));
    }
    let mut dirs = vec![root.to_owned()];
    while let Some(d) = dirs.pop() {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))?;
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                dirs.push(e.path());
            }
        }
    }
    sums.sort();
    Ok(sums)
}

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

fn hot_stage(job: u32, dataset: &str, version: &str) -> Stage {
    Stage {
        project: PROJECT.to_owned(),
        dataset: dataset.to_owned(),
        version: version.to_owned(),
        tier: "hot".to_owned(),
        job: format!("{JOB_PREFIX}{job}"),
        node: None,
    }
}

async fn setup() -> anyhow::Result<(Stagehand, Slurm)> {
    let stagehand = Stagehand::start().await?;
    let slurm = Slurm::start(&stagehand.url)?;
    Ok((stagehand, slurm))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_directive_is_refused_at_submit_and_sbatch_says_why() -> anyhow::Result<()> {
    let (_stagehand, slurm) = setup().await?;
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

/// (a) and (e): a job whose data is ready runs after stage-in, reads every file at
/// `$STAGEHAND_DATA_<NAME>` with matching checksums, and its stage is released when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_after_stage_in_reads_its_data_and_releases_it() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup().await?;
    let root = slurm.data_dir().join("hot/lab/imagenet-mini").join(VERSION);
    let expected = write_dataset(
        &root,
        &[
            ("train/0.bin", b"first file"),
            ("train/1.bin", &[7u8; 10_000]),
            ("labels.csv", b"id,label\n0,cat\n1,dog\n"),
        ],
    )?;
    let directives = vec![format!(
        "#BB_LUA stage dataset=imagenet-mini version={VERSION} tier=hot project={PROJECT}"
    )];
    let submitted = Instant::now();
    let job = slurm.submit(
        "reads",
        &reading_job(&directives, "STAGEHAND_DATA_IMAGENET_MINI"),
    )?;
    let stage = hot_stage(job, "imagenet-mini", VERSION);
    let request = stagehand.requested(&stage).await?;
    let Body::StageRequested(req) = &request.body else {
        bail!("not a stage request: {request:?}");
    };
    ensure!(req.tier == "hot" && req.node.is_none() && req.job_id == stage.job);
    stagehand.ready(&stage, &root).await?;
    let ready = Instant::now();
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let ran = ready.elapsed();
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(path == root.display().to_string(), "job saw {path:?}");
    ensure!(sums == expected, "job read {sums:?}, expected {expected:?}");
    eprintln!(
        "submit→complete {:?}, ready→complete {ran:?}",
        submitted.elapsed()
    );
    // (e) teardown released it, with the id derived from the job.
    let released = stagehand.released(&stage).await?;
    ensure!(matches!(released.body, Body::StageReleased(_)));
    Ok(())
}

/// (b): a job whose data is not ready yet stays pending in stage-in, and runs once it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waits_pending_until_its_data_is_ready() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup().await?;
    let root = slurm.data_dir().join("hot/lab/later").join(VERSION);
    let expected = write_dataset(&root, &[("a.txt", b"arrives later")])?;
    let directives = vec![format!(
        "#BB_LUA stage dataset=later version={VERSION} tier=hot project={PROJECT} name=IN"
    )];
    let job = slurm.submit("waits", &reading_job(&directives, "STAGEHAND_DATA_IN"))?;
    let stage = hot_stage(job, "later", VERSION);
    stagehand.requested(&stage).await?;
    stagehand
        .pending(
            &stage,
            "validation",
            "version 5f2c9a0e11b3 is not validated yet",
        )
        .await?;
    // 22.05 shows BurstBufferResources while data_in runs (its scheduler sets
    // WAIT_BURST_BUFFER_STAGING, then job_mgr.c overwrites it for ESLURM_BURST_BUFFER_WAIT);
    // backfill and later releases show BurstBufferStageIn.
    let (state, reason) = slurm
        .wait_job(job, "the job pending in stage-in", |s, r| {
            s == "PENDING" && (r == "BurstBufferStageIn" || r == "BurstBufferResources")
        })
        .await?;
    eprintln!("while the data is pending: {state} {reason}");
    // Still pending a while later (the hook is waiting, not done).
    let (state, _) = slurm.job(job)?;
    ensure!(
        state == "PENDING",
        "job left pending before its data was ready: {state}"
    );
    stagehand.ready(&stage, &root).await?;
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == root.display().to_string() && sums == expected,
        "{path} {sums:?}"
    );
    Ok(())
}

/// (c): a job whose stage fails (unknown or rejected dataset) is held, and squeue shows
/// Stagehand's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_stage_holds_the_job_with_the_reason_in_squeue() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup().await?;
    let directives = vec![format!(
        "#BB_LUA stage dataset=nosuch version={VERSION} tier=hot project={PROJECT}"
    )];
    let job = slurm.submit("fails", &reading_job(&directives, "STAGEHAND_DATA_NOSUCH"))?;
    let stage = hot_stage(job, "nosuch", VERSION);
    stagehand.requested(&stage).await?;
    let why = "dataset lab/nosuch is not in the catalogue";
    stagehand.failed(&stage, why).await?;
    let (state, reason) = slurm
        .wait_job(job, "the job held with the reason", |s, r| {
            s == "PENDING" && r.contains(why)
        })
        .await?;
    eprintln!("held: {state} {reason}");
    ensure!(
        reason.contains("stagehand: nosuch@5f2c9a0e11b34d7a on hot failed"),
        "{reason}"
    );
    Ok(())
}

/// (d): a node-local job gets its data on its node through the Prolog: the hot tier first (by
/// data_in), then the node's local tier (requested with --node), exported by the TaskProlog;
/// the Epilog releases the local stage and teardown the hot one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_tier_job_gets_its_data_on_its_node_through_the_prolog() -> anyhow::Result<()> {
    let (stagehand, slurm) = setup().await?;
    let hot_root = slurm.data_dir().join("hot/lab/shards").join(VERSION);
    write_dataset(&hot_root, &[("s0.tar", b"hot copy")])?;
    let local_root = slurm.data_dir().join("local/lab/shards").join(VERSION);
    let expected = write_dataset(
        &local_root,
        &[("s0.tar", b"hot copy"), ("index.json", b"{}")],
    )?;
    let directives = vec![format!(
        "#BB_LUA stage dataset=shards version={VERSION} tier=local project={PROJECT}"
    )];
    let job = slurm.submit("local", &reading_job(&directives, "STAGEHAND_DATA_SHARDS"))?;
    let hot = hot_stage(job, "shards", VERSION);
    stagehand.requested(&hot).await?;
    stagehand.ready(&hot, &hot_root).await?;
    let local = Stage {
        tier: "local".to_owned(),
        node: Some(slurm.node.clone()),
        ..hot.clone()
    };
    let request = stagehand.requested(&local).await?;
    let Body::StageRequested(req) = &request.body else {
        bail!("not a stage request: {request:?}");
    };
    ensure!(req.node.as_deref() == Some(slurm.node.as_str()), "{req:?}");
    stagehand.ready(&local, &local_root).await?;
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(path == local_root.display().to_string(), "job saw {path:?}");
    ensure!(sums == expected, "job read {sums:?}");
    stagehand.released(&local).await?;
    stagehand.released(&hot).await?;
    Ok(())
}

/// A stage-in that starts while NATS is down is not held: the hooks ask again while the
/// stage-in budget lasts, and the job runs once NATS is back and its data is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_submitted_while_nats_is_down_runs_once_it_is_back() -> anyhow::Result<()> {
    let (mut stagehand, slurm) = setup().await?;
    let root = slurm.data_dir().join("hot/lab/outage").join(VERSION);
    let expected = write_dataset(&root, &[("x.bin", b"after the outage")])?;
    stagehand.server.kill();
    let directives = vec![format!(
        "#BB_LUA stage dataset=outage version={VERSION} tier=hot project={PROJECT}"
    )];
    let job = slurm.submit("outage", &reading_job(&directives, "STAGEHAND_DATA_OUTAGE"))?;
    slurm
        .wait_job(job, "the job in stage-in", |s, r| {
            s == "PENDING" && (r == "BurstBufferStageIn" || r == "BurstBufferResources")
        })
        .await?;
    stagehand.server.restart();
    let stage = hot_stage(job, "outage", VERSION);
    stagehand.requested(&stage).await?;
    stagehand.ready(&stage, &root).await?;
    slurm
        .wait_job(job, "the job to complete", |s, _| s == "COMPLETED")
        .await?;
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == root.display().to_string() && sums == expected,
        "{path} {sums:?}"
    );
    Ok(())
}

/// A node-local stage that fails in the Prolog: Slurm's rule for a failing Prolog applies (the
/// job is requeued and held, the node drained), and the job's AdminComment carries Stagehand's
/// reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_local_stage_holds_the_job_with_the_reason_in_its_admin_comment()
-> anyhow::Result<()> {
    let (stagehand, slurm) = setup().await?;
    let hot_root = slurm.data_dir().join("hot/lab/big").join(VERSION);
    write_dataset(&hot_root, &[("s0.tar", b"hot copy")])?;
    let directives = vec![format!(
        "#BB_LUA stage dataset=big version={VERSION} tier=local project={PROJECT}"
    )];
    let job = slurm.submit(
        "local-fails",
        &reading_job(&directives, "STAGEHAND_DATA_BIG"),
    )?;
    let hot = hot_stage(job, "big", VERSION);
    stagehand.requested(&hot).await?;
    stagehand.ready(&hot, &hot_root).await?;
    let local = Stage {
        tier: "local".to_owned(),
        node: Some(slurm.node.clone()),
        ..hot.clone()
    };
    stagehand.requested(&local).await?;
    let why = "quota of lab on local (node vm) exceeded: 60 GiB asked, 50 GiB allowed";
    stagehand.failed(&local, why).await?;
    let (state, reason) = slurm
        .wait_job(job, "the job requeued and held", |s, r| {
            s == "PENDING" && r.starts_with("JobHeld")
        })
        .await?;
    eprintln!("after the Prolog failed: {state} {reason}");
    // 22.05's squeue has no AdminComment field; scontrol shows it on a line of its own.
    let out = slurm
        .cmd("scontrol")
        .args(["show", "job", &job.to_string()])
        .output()?;
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    let comment = shown
        .lines()
        .find_map(|l| l.trim().strip_prefix("AdminComment="))
        .unwrap_or_default()
        .to_owned();
    ensure!(
        comment
            == format!(
                "stagehand: big@{VERSION} on local for node {} failed: {why}",
                slurm.node
            ),
        "AdminComment {comment:?}"
    );
    ensure!(
        !slurm.output(job).is_ok_and(|o| o.contains("path=")),
        "the job ran without its data"
    );
    let out = slurm
        .cmd("sinfo")
        .args(["-h", "-n", &slurm.node, "-o", "%T"])
        .output()?;
    let node_state = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    ensure!(node_state.starts_with("drain"), "node state {node_state:?}");
    Ok(())
}

/// slurmctld restarted while a job waits in stage-in: Slurm tears the job's burst buffer down
/// and stages it in again (after deferring the job a minute), so every hook runs twice. The
/// teardown of a job still pending must not release its stage (a release is final), and the
/// second stage-in asks the same request: the job runs once its data is ready, and its stage is
/// released once, when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restart_during_stage_in_keeps_the_request_and_the_job_runs()
-> anyhow::Result<()> {
    let (stagehand, slurm) = setup().await?;
    let root = slurm.data_dir().join("hot/lab/restart").join(VERSION);
    let expected = write_dataset(&root, &[("r.bin", b"staged across a restart")])?;
    let directives = vec![format!(
        "#BB_LUA stage dataset=restart version={VERSION} tier=hot project={PROJECT}"
    )];
    let job = slurm.submit(
        "restart",
        &reading_job(&directives, "STAGEHAND_DATA_RESTART"),
    )?;
    let stage = hot_stage(job, "restart", VERSION);
    stagehand.requested(&stage).await?;
    stagehand.pending(&stage, "copy", "copying").await?;
    let out = Command::new("bash")
        .arg(slurm_sh())
        .arg("restart-controller")
        .env("STAGEHAND_SLURM_DIR", slurm.dir.path())
        .output()?;
    ensure!(out.status.success(), "restart-controller: {}", said(&out));
    // The teardown after the restart has run once the job's burst buffer is pending again.
    slurm
        .wait_job(job, "the job pending after the restart", |s, _| {
            s == "PENDING"
        })
        .await?;
    stagehand.ready(&stage, &root).await?;
    let started = Instant::now();
    // Slurm defers the job 60 s after tearing its buffer down.
    let (state, _) = wait_for(Duration::from_secs(150), "the job to complete", || {
        let seen = slurm
            .job(job)
            .ok()
            .filter(|(s, _)| s == "COMPLETED" || s == "FAILED");
        async move { seen }
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}; {}", slurm.logs()))?;
    ensure!(state == "COMPLETED", "{state}");
    eprintln!("ran {:?} after the data was ready", started.elapsed());
    let (path, sums) = read_sums(&slurm.output(job)?);
    ensure!(
        path == root.display().to_string() && sums == expected,
        "{path} {sums:?}"
    );
    stagehand.released(&stage).await?;
    let log = std::fs::read_to_string(slurm.dir.path().join("log/slurmctld.log"))?;
    ensure!(
        log.contains(&format!("stagehand: job {job} pending again")),
        "the teardown after the restart did not see the job pending"
    );
    Ok(())
}
