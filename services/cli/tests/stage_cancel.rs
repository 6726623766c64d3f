//! `stagehand stage cancel` (issue 18 item 6) as the built binary, against a real nats-server
//! and Stagehand's services: the operator's cancel of a waiting stage makes its promoter fail
//! it with `cancelled by <who>: <why>`, which waiters see; on two tenants with the shipped
//! accounts config (every service its own NATS user), another project's users — its
//! scheduler, its uploader — and the shared scheduler cannot cancel the victim's ready stage,
//! which stays ready until the operator's cancel releases it. Each cancel is listed by
//! `stagehand status --actions`, newest first.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use common::tenants::{ATTACKER, Plan, Tenants, VICTIM, project_scheduler, scheduler, uploader};
use serde_json::Value;
use stagehand::stage::{RequestOptions, Stage, StageState, WaitOutcome};

const OPERATOR: &str = "oncall-ana";

fn operator_user() -> (String, String) {
    ("operator".into(), "OPERATOR".into())
}

/// The real binary as the user of `url`, named [`OPERATOR`] in what it records.
fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(args).stdin(Stdio::null());
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    Ok(cmd
        .env("STAGEHAND_NATS_URL", url)
        .env("STAGEHAND_OPERATOR", OPERATOR)
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()?)
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
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
    let listed = actions_at(&sh.url)?;
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
    let listed = actions(tenants)?;
    ensure!(
        listed.iter().any(|a| a["action"] == "stage.cancel"
            && a["request_id"] == stage.request_id().as_str()
            && a["reason"] == "tier maintenance"),
        "{listed:?}"
    );
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
