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
use std::process::{Command, Output};

use anyhow::ensure;
use common::slurm::{JOB_PREFIX, Slurm, said};
use common::{Options, PROJECT, Stagehand, write_files};
use stagehand::stage::{Stage, StageState};

/// The real `stagehand` behind a wrapper that drops every `stage release`: the teardown that
/// never ran. In a folder of its own, made before the cluster whose hooks call it.
fn without_release() -> anyhow::Result<(tempfile::TempDir, String)> {
    let dir = tempfile::Builder::new()
        .prefix("stagehand-without-release-")
        .tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let wrapper = dir.path().join("stagehand");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = release ] && exit 0; done\nexec '{}' \"$@\"\n",
            env!("CARGO_BIN_EXE_stagehand")
        ),
    )?;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    let wrapper = wrapper.display().to_string();
    Ok((dir, wrapper))
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
    let (_wrapper_dir, wrapper) = without_release()?;
    let slurm =
        tokio::task::spawn_blocking(move || Slurm::start_with(&url, &[("STAGEHAND_BIN", wrapper)]));
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
        .wait_job(cancelled, "the job cancelled", |s, _| s == "CANCELLED")
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
    ensure!(slurm.job(live)?.0 == "PENDING");
    let kept_status = stagehand
        .status_where(&kept, "the live job's stage", |_| true)
        .await?;
    ensure!(kept_status.state == StageState::Pending, "{kept_status:?}");
    let out = slurm.cmd("scancel").arg(live.to_string()).output()?;
    ensure!(out.status.success(), "scancel: {}", said(&out));
    Ok(())
}
