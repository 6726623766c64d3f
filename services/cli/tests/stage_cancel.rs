//! `stagehand stage cancel` (issue 18 item 6) as the built binary, against a real nats-server
//! and Stagehand's services: the operator's cancel of a waiting stage makes its promoter fail
//! it with `cancelled by <who>: <why>`, which waiters see; on two tenants with the shipped
//! accounts config (every service its own NATS user), another project's users — its
//! scheduler, its uploader — and the shared scheduler cannot cancel the victim's ready stage,
//! which stays ready until the operator's cancel releases it. A cancel of a stage whose copy
//! runs stops the copy: its staging folder is removed and nothing is published. Each cancel is
//! listed by `stagehand status --actions`, newest first.

mod common;

use std::process::Output;
use std::time::Duration;

use anyhow::{Context, ensure};
use common::tenants::{
    ATTACKER, Plan, Tenants, VICTIM, project_scheduler, said, scheduler, uploader,
};
use serde_json::Value;
use stagehand::stage::{RequestOptions, Stage, StageState, WaitOutcome};

const OPERATOR: &str = "oncall-ana";

fn operator_user() -> (String, String) {
    ("operator".into(), "OPERATOR".into())
}

/// The real binary as the user of `url`, named [`OPERATOR`] in what it records.
fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(common::tenants::stagehand_command(url, args)
        .env("STAGEHAND_OPERATOR", OPERATOR)
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()?)
}

fn cancel_args<'a>(target: &'a str, stage: &'a Stage, why: &'a str) -> Vec<&'a str> {
    vec![
        "--publish-timeout",
        "3s",
        "stage",
        "cancel",
        target,
        "--tier",
        &stage.tier,
        "--job",
        &stage.job,
        "--project",
        &stage.project,
        "--reason",
        why,
        "--json",
    ]
}

/// Every operator action `stagehand status --actions --json` lists, as the operator.
fn actions(tenants: &Tenants) -> anyhow::Result<Vec<Value>> {
    actions_at(&tenants.url(&operator_user()))
}

/// Every operator action `stagehand status --actions --json` lists, as the user of `url`.
fn actions_at(url: &str) -> anyhow::Result<Vec<Value>> {
    let out = stagehand(url, &["status", "--actions", "--json"])?;
    ensure!(out.status.success(), "{}", said(&out));
    let list: Value = serde_json::from_slice(&out.stdout)?;
    list.as_array().cloned().context("a JSON array")
}

/// Waits until [`actions_at`] lists an action `wanted` holds for, and returns that list: the
/// recorder folds the operator's fact after the command that stated it has returned.
async fn actions_listing(
    url: &str,
    wanted: impl Fn(&Value) -> bool + Sync,
) -> anyhow::Result<Vec<Value>> {
    let last = std::sync::Mutex::new(Vec::new());
    let (last_ref, wanted) = (&last, &wanted);
    let listed =
        stagehand_testkit::wait_until(common::WAIT, "the operator action listed", || async move {
            let Ok(listed) = actions_at(url) else {
                return false;
            };
            let hit = listed.iter().any(wanted);
            *last_ref
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = listed;
            hit
        })
        .await;
    let last = last
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    listed.map_err(|e| anyhow::anyhow!("{e}: {last:?}"))?;
    Ok(last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stage_cancelled_fails_and_its_waiters_see_who_and_why() -> anyhow::Result<()> {
    // The validator is not started: the upload stays in flight and the stage waits for it.
    let sh = common::Stagehand::start(common::Options {
        promoter: true,
        ..Default::default()
    })
    .await?;
    let folder = tempfile::tempdir()?;
    common::write_files(folder.path(), &[("a.bin", b"alpha"), ("b.bin", b"beta")])?;
    let version = sh.ingest(folder.path(), "owls", false)?;
    let stage = Stage {
        project: common::PROJECT.into(),
        dataset: "owls".into(),
        version: version.clone(),
        tier: "hot".into(),
        job: "job-7".into(),
        node: None,
    };
    let opts = RequestOptions {
        requested_by: "scheduler".into(),
        deadline: Some(stagehand_schemas::event::now() + Duration::from_secs(600)),
        ..Default::default()
    };
    stagehand::stage::request(&sh.bus, &stage, &opts).await?;
    sh.status_where(&stage, "the stage to wait for validation", |s| {
        s.state == StageState::Pending
    })
    .await?;

    let target = format!("owls@{version}");
    let out = stagehand(
        &sh.url,
        &cancel_args(&target, &stage, "the job was withdrawn"),
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let answer: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        answer["was"] == "pending" && answer["done"] == "failing",
        "{answer}"
    );
    let expected = format!("cancelled by {OPERATOR}: the job was withdrawn");
    let failed = sh
        .status_where(&stage, "the cancelled stage to fail", |s| {
            s.state == StageState::Failed
        })
        .await?;
    ensure!(
        failed.reason.as_deref() == Some(expected.as_str()),
        "{failed:?}"
    );
    // A waiter sees the failure and why.
    match stagehand::stage::wait(&sh.bus, &stage, Duration::from_secs(10)).await? {
        WaitOutcome::Failed(s) => ensure!(s.reason.as_deref() == Some(expected.as_str())),
        other => anyhow::bail!("a waiter saw {other:?}"),
    }
    let listed = actions_listing(&sh.url, |a| a["action"] == "stage.cancel").await?;
    ensure!(listed.len() == 1, "{listed:?}");
    let action = &listed[0];
    ensure!(
        action["action"] == "stage.cancel"
            && action["by"] == OPERATOR
            && action["project"] == common::PROJECT
            && action["reason"] == "the job was withdrawn"
            && action["request_id"] == stage.request_id().as_str(),
        "{action}"
    );
    Ok(())
}

/// A stage cancelled while its copy runs: the copy stops (its promoter's mover is held to
/// 256 KiB/s, so the 4 MiB version takes 16 s), its hidden staging folder is removed, and no
/// replica is published. Were the copy left to run, the version would appear on the tier.
/// A later job asking for the version gets it. With a second job waiting for the same
/// version, the cancel of the first leaves the copy to finish for the second.
/// A stack whose promoter copies at 256 KiB/s, with a validated 4 MiB version of `herons`
/// (4 files); returns the stack, the version and the dataset's folder on the hot tier.
async fn slow_copy_stack() -> anyhow::Result<(common::Stagehand, String, std::path::PathBuf)> {
    let sh = common::Stagehand::start(common::Options {
        validator: true,
        promoter: true,
        copy_bytes_per_second: Some(256 * 1024),
        ..Default::default()
    })
    .await?;
    let folder = tempfile::tempdir()?;
    let blobs: Vec<(String, Vec<u8>)> = (0..4u8)
        .map(|i| {
            (
                format!("part-{i}.bin"),
                stagehand_testkit::pattern_bytes(i, 1 << 20),
            )
        })
        .collect();
    let files: Vec<(&str, &[u8])> = blobs
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    common::write_files(folder.path(), &files)?;
    let version = sh.ingest(folder.path(), "herons", true)?;
    let dataset_dir = sh
        .home
        .path()
        .join("tiers/hot")
        .join(common::PROJECT)
        .join("herons");
    Ok((sh, version, dataset_dir))
}

fn herons_stage(version: &str, job: &str) -> Stage {
    Stage {
        project: common::PROJECT.into(),
        dataset: "herons".into(),
        version: version.to_owned(),
        tier: "hot".into(),
        job: job.into(),
        node: None,
    }
}

fn entries(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Asks `stage` and waits until its copy has moved bytes.
async fn request_until_copying(sh: &common::Stagehand, stage: &Stage) -> anyhow::Result<()> {
    let opts = RequestOptions {
        requested_by: "scheduler".into(),
        deadline: Some(stagehand_schemas::event::now() + Duration::from_secs(600)),
        ..Default::default()
    };
    stagehand::stage::request(&sh.bus, stage, &opts).await?;
    sh.status_where(stage, "the stage's copy to make progress", |s| {
        s.state == StageState::Copying && s.progress.as_ref().is_some_and(|p| p.bytes_done > 0)
    })
    .await?;
    Ok(())
}

/// Cancels `stage` with the real binary and waits until it failed with the cancel's reason.
async fn cancel_and_see_it_fail(
    sh: &common::Stagehand,
    stage: &Stage,
    why: &str,
) -> anyhow::Result<()> {
    let target = format!("{}@{}", stage.dataset, stage.version);
    let out = stagehand(&sh.url, &cancel_args(&target, stage, why))?;
    ensure!(out.status.success(), "{}", said(&out));
    let answer: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(answer["was"] == "copying", "{answer}");
    let failed = sh
        .status_where(stage, "the cancelled stage to fail", |s| {
            s.state == StageState::Failed
        })
        .await?;
    let expected = format!("cancelled by {OPERATOR}: {why}");
    ensure!(
        failed.reason.as_deref() == Some(expected.as_str()),
        "{failed:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_cancelled_while_copying_stops_its_copy_and_leaves_nothing_on_the_tier()
-> anyhow::Result<()> {
    let (sh, version, dataset_dir) = slow_copy_stack().await?;
    let stage = herons_stage(&version, "job-9");
    request_until_copying(&sh, &stage).await?;
    let copying = entries(&dataset_dir);
    ensure!(
        copying.len() == 1 && copying[0].starts_with('.'),
        "one hidden staging folder while the copy runs: {copying:?}"
    );
    cancel_and_see_it_fail(&sh, &stage, "the wrong version was asked for").await?;
    stagehand_testkit::wait_until(common::WAIT, "the staging folder to be removed", || {
        let left = entries(&dataset_dir);
        async move { left.is_empty() }
    })
    .await
    .with_context(|| format!("left on the tier: {:?}", entries(&dataset_dir)))?;
    ensure!(
        !dataset_dir.join(&version).exists(),
        "the version was published on the tier after its stage was cancelled"
    );
    // A later job asking for the version gets it: the cancel is not taken for a failed copy
    // (which would answer every request of the version with it for a while).
    let again = herons_stage(&version, "job-11");
    let opts = RequestOptions {
        requested_by: "scheduler".into(),
        deadline: Some(stagehand_schemas::event::now() + Duration::from_secs(600)),
        ..Default::default()
    };
    stagehand::stage::request(&sh.bus, &again, &opts).await?;
    let answered = sh
        .status_where(&again, "the later job's stage to be answered", |s| {
            s.state == StageState::Ready || s.state == StageState::Failed
        })
        .await?;
    ensure!(answered.state == StageState::Ready, "{answered:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_leaves_the_copy_running_for_another_job_that_waits_for_it() -> anyhow::Result<()>
{
    let (sh, version, dataset_dir) = slow_copy_stack().await?;
    let first = herons_stage(&version, "job-9");
    request_until_copying(&sh, &first).await?;
    // The second job names the version by a prefix, as a job script may.
    let second = herons_stage(&version[..16], "job-10");
    let opts = RequestOptions {
        requested_by: "scheduler".into(),
        deadline: Some(stagehand_schemas::event::now() + Duration::from_secs(600)),
        ..Default::default()
    };
    stagehand::stage::request(&sh.bus, &second, &opts).await?;
    sh.status_where(&second, "the second job to wait for the copy", |s| {
        s.waiting_for.as_deref() == Some("copy")
    })
    .await?;
    cancel_and_see_it_fail(&sh, &first, "job-9 was withdrawn").await?;
    let ready = sh
        .status_where(&second, "the second job's stage to be ready", |s| {
            s.state == StageState::Ready || s.state == StageState::Failed
        })
        .await?;
    ensure!(ready.state == StageState::Ready, "{ready:?}");
    // The replica is the first job's copy, carried on, not a second copy started over.
    let created = stagehand_testkit::stored_events(
        sh.bus.jetstream(),
        "STAGEHAND_FACTS",
        &format!("stagehand.fact.replica.created.{}", common::PROJECT),
    )
    .await
    .map_err(|e| anyhow::anyhow!("reading the facts: {e}"))?;
    let causes: Vec<_> = created.iter().map(|e| e.causation_id.clone()).collect();
    ensure!(
        causes == [Some(first.request_id())],
        "replica.created caused by {causes:?}, not only by the first job's request {}",
        first.request_id()
    );
    let published = dataset_dir.join(&version);
    for i in 0..4u8 {
        let bytes = std::fs::read(published.join(format!("part-{i}.bin")))?;
        ensure!(
            bytes == stagehand_testkit::pattern_bytes(i, 1 << 20),
            "part-{i}.bin differs"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_cancels_another_projects_ready_stage_and_that_releases_it()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("cancel-ready");
    tenants
        .ingest(VICTIM, &plan.dataset, &plan.files)
        .await
        .context("the victim's ingest")?;
    let stage = plan.stage();
    let outcome = tenants.stage(&stage, None).await?;
    ensure!(matches!(outcome, WaitOutcome::Ready(_)), "{outcome:?}");
    let target = format!("{}@{}", stage.dataset, stage.version);

    for who in [project_scheduler(ATTACKER), uploader(ATTACKER), scheduler()] {
        let out = stagehand(&tenants.url(&who), &cancel_args(&target, &stage, "hostile"))?;
        ensure!(
            !out.status.success(),
            "{} cancelled {VICTIM}'s stage: {}",
            who.0,
            said(&out)
        );
    }
    let still = tenants
        .stage_status_where(&stage, "the victim's stage", |_| true)
        .await?;
    ensure!(still.state == StageState::Ready, "{still:?}");
    ensure!(
        !actions(tenants)?
            .iter()
            .any(|a| a["request_id"] == stage.request_id().as_str()),
        "an operator action names the victim's stage"
    );

    let out = stagehand(
        &tenants.url(&operator_user()),
        &cancel_args(&target, &stage, "tier maintenance"),
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let answer: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        answer["was"] == "ready" && answer["done"] == "released",
        "{answer}"
    );
    tenants
        .stage_status_where(&stage, "the cancelled ready stage released", |s| {
            s.state == StageState::Released
        })
        .await?;
    let listed = actions_listing(&tenants.url(&operator_user()), |a| {
        a["action"] == "stage.cancel"
            && a["request_id"] == stage.request_id().as_str()
            && a["reason"] == "tier maintenance"
    })
    .await?;
    // Newest first.
    let times: Vec<time::OffsetDateTime> = listed
        .iter()
        .map(|a| {
            let at = a["stamp"]["at"].as_str().context("a stamp")?;
            Ok(time::OffsetDateTime::parse(
                at,
                &time::format_description::well_known::Rfc3339,
            )?)
        })
        .collect::<anyhow::Result<_>>()?;
    ensure!(times.windows(2).all(|w| w[0] >= w[1]), "{listed:?}");
    Ok(())
}
