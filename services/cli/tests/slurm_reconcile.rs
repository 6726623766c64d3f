//! `stagehand stage reconcile --scheduler slurm` on a real Slurm (`deploy/slurm/slurm.sh`, the
//! distribution's 22.05 here): a job cancelled during stage-in whose teardown never released
//! its stage leaves the stage held; the reconciler asks Slurm, releases it with a reason that
//! says who and why, and leaves the stage of a job still pending alone. While Slurm cannot be
//! asked, it releases nothing.
//!
//! On 22.05 slurmctld can kill the teardown script when `scancel` races it and never retries
//! it; that race cannot be provoked on demand, so the cluster's hooks here call the real
//! `stagehand` through a wrapper that drops `stage release` — the teardown runs and releases
//! nothing, which is what the lost teardown leaves behind.
//!
//! Every wait polls Slurm (`squeue`) or NATS against a deadline; nothing sleeps.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, ensure};
use common::{Options, PROJECT, Stagehand, write_files};
use stagehand::stage::{Stage, StageState};
use stagehand_testkit::wait_for;

/// Bound on a job getting from submit to where the test expects it.
const JOB: Duration = Duration::from_secs(60);
/// The prefix slurm.sh gives Slurm job ids in stage requests (STAGEHAND_JOB_PREFIX).
const JOB_PREFIX: &str = "slurm-stagehand-";

fn said(out: &Output) -> String {
    format!(
        "exit {:?}, stdout {:?}, stderr {:?}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

fn slurm_sh() -> PathBuf {
    stagehand_testkit::repo_root().join("deploy/slurm/slurm.sh")
}

/// A one-node Slurm cluster under a temp dir whose hooks never release, stopped on drop.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    user: String,
}

impl Slurm {
    fn start(nats_url: &str) -> anyhow::Result<Slurm> {
        let dir = tempfile::Builder::new()
            .prefix("stagehand-slurm-")
            .tempdir()?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        // The teardown that never ran: every `stage release` of the hooks is dropped.
        let wrapper = dir.path().join("stagehand-without-release");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = release ] && exit 0; done\nexec '{}' \"$@\"\n",
                env!("CARGO_BIN_EXE_stagehand")
            ),
        )?;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
        let user = "stagehand-job".to_owned();
        let out = Command::new("bash")
            .arg(slurm_sh())
            .arg("start")
            .env("STAGEHAND_SLURM_DIR", dir.path())
            .env("STAGEHAND_SLURM_USER", &user)
            .env("STAGEHAND_BIN", &wrapper)
            .env("STAGEHAND_NATS_URL", nats_url)
            .env("STAGEHAND_STAGE_IN_TIMEOUT", "120")
            .env("STAGEHAND_CONNECT_TIMEOUT", "2")
            .output()
            .context("running deploy/slurm/slurm.sh start")?;
        let slurm = Slurm {
            conf: dir.path().join("etc/slurm.conf"),
            dir,
            user,
        };
        ensure!(
            out.status.success(),
            "deploy/slurm/slurm.sh start failed: {}",
            said(&out)
        );
        let jobs = slurm.dir.path().join("jobs");
        std::fs::create_dir(&jobs)?;
        std::fs::set_permissions(&jobs, std::fs::Permissions::from_mode(0o755))?;
        Ok(slurm)
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `sbatch` of `script` as the test user; the job id.
    fn submit(&self, name: &str, script: &str) -> anyhow::Result<u32> {
        let path = self.dir.path().join("jobs").join(format!("{name}.sh"));
        std::fs::write(&path, script)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        let out = self
            .cmd("runuser")
            .args(["-u", &self.user, "--", "env"])
            .arg(format!("SLURM_CONF={}", self.conf.display()))
            .args(["sbatch", "--parsable", "--output=/dev/null"])
            .arg(&path)
            .output()?;
        ensure!(out.status.success(), "sbatch {name}: {}", said(&out));
        let id = String::from_utf8(out.stdout)?;
        id.trim()
            .split(';')
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("sbatch printed {id:?}"))
    }

    /// The job's state as squeue shows it (also for finished jobs).
    fn state(&self, id: u32) -> anyhow::Result<String> {
        let out = self
            .cmd("squeue")
            .args(["-h", "-t", "all", "-j", &id.to_string(), "-o", "%T"])
            .output()?;
        ensure!(out.status.success(), "squeue: {}", said(&out));
        Ok(String::from_utf8(out.stdout)?.trim().to_owned())
    }

    async fn wait_state(&self, id: u32, what: &str, want: &str) -> anyhow::Result<()> {
        wait_for(JOB, what, || async {
            self.state(id).ok().filter(|s| s == want)
        })
        .await
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("job {id}: {e}; now {:?}", self.state(id)))
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

fn stage(job: u32, dataset: &str, version: &str) -> Stage {
    Stage {
        project: PROJECT.to_owned(),
        dataset: dataset.to_owned(),
        version: version.to_owned(),
        tier: "hot".to_owned(),
        job: format!("{JOB_PREFIX}{job}"),
        node: None,
    }
}

fn job_script(dataset: &str, version: &str) -> String {
    format!(
        "#!/bin/bash\n#BB_LUA stage dataset={dataset} version={version} tier=hot project={PROJECT}\ntrue\n"
    )
}

/// `stagehand stage reconcile --scheduler slurm` against the cluster at `slurm_conf`.
fn reconcile(stagehand: &Stagehand, slurm_conf: &std::path::Path) -> anyhow::Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .env("SLURM_CONF", slurm_conf)
        .args([
            "--nats",
            &stagehand.url,
            "stage",
            "reconcile",
            "--scheduler",
            "slurm",
            "--job-prefix",
            JOB_PREFIX,
        ])
        .output()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_whose_job_was_cancelled_without_its_teardown_is_released_by_the_reconciler()
-> anyhow::Result<()> {
    let server = stagehand_testkit::NatsServer::start();
    let url = server.url();
    let slurm = tokio::task::spawn_blocking(move || Slurm::start(&url));
    // No validator: the uploads stay unvalidated, so both jobs stay in stage-in.
    let stagehand = Stagehand::start_on(
        server,
        Options {
            promoter: true,
            ..Options::default()
        },
    )
    .await?;
    let slurm = slurm.await??;
    let folder = tempfile::tempdir()?;
    write_files(folder.path(), &[("a.bin", &[7u8; 4096])])?;
    let digest = stagehand.ingest(folder.path(), "pending-set", false)?;
    let version = &digest[..16];

    let cancelled = slurm.submit("cancelled", &job_script("pending-set", version))?;
    let live = slurm.submit("live", &job_script("pending-set", version))?;
    let (gone, kept) = (
        stage(cancelled, "pending-set", version),
        stage(live, "pending-set", version),
    );
    for st in [&gone, &kept] {
        stagehand
            .status_where(st, "the stage waiting for validation", |s| {
                s.waiting_for.as_deref() == Some("validation")
            })
            .await?;
    }
    let out = slurm.cmd("scancel").arg(cancelled.to_string()).output()?;
    ensure!(out.status.success(), "scancel: {}", said(&out));
    slurm
        .wait_state(cancelled, "the job cancelled", "CANCELLED")
        .await?;
    // Its teardown released nothing: the stage is still held.
    let held = stagehand
        .status_where(&gone, "the cancelled job's stage", |_| true)
        .await?;
    ensure!(held.state == StageState::Pending, "{held:?}");

    // Slurm cannot be asked: nothing is released, and the command says so (exit 69).
    let out = reconcile(&stagehand, &slurm.dir.path().join("no-such/slurm.conf"))?;
    ensure!(out.status.code() == Some(69), "{}", said(&out));
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("none is released"),
        "{}",
        said(&out)
    );
    let still = stagehand.status_where(&gone, "the stage", |_| true).await?;
    ensure!(still.state == StageState::Pending, "{still:?}");

    let out = reconcile(&stagehand, &slurm.conf)?;
    ensure!(out.status.success(), "{}", said(&out));
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        printed.lines().count() == 1
            && printed.contains(&gone.job)
            && printed.contains("CANCELLED"),
        "{printed}"
    );
    let released = stagehand
        .status_where(&gone, "the cancelled job's stage released", |s| {
            s.state == StageState::Released
        })
        .await?;
    let reason = released.reason.unwrap_or_default();
    ensure!(
        reason.contains("stagehand stage reconcile")
            && reason.contains(&format!("Slurm job {cancelled} is CANCELLED")),
        "{reason}"
    );
    // The pending job keeps its stage.
    ensure!(slurm.state(live)? == "PENDING");
    let kept_status = stagehand
        .status_where(&kept, "the live job's stage", |_| true)
        .await?;
    ensure!(kept_status.state == StageState::Pending, "{kept_status:?}");
    let out = slurm.cmd("scancel").arg(live.to_string()).output()?;
    ensure!(out.status.success(), "scancel: {}", said(&out));
    Ok(())
}
