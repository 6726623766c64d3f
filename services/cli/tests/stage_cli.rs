//! `stagehand stage` as plugins call it, the built binary against a real nats-server: the
//! request and release are stored under the ids derived from the job (a repeat is a duplicate),
//! `wait` answers 0/1/2 from the stage's `stagehand_stages` entry (path, reason, last state),
//! `--json` prints the status, `status` lists a job's or a version's stages and why.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::ensure;
use futures::StreamExt;
use serde_json::{Value, json};
use stagehand::stage::{STAGES_BUCKET, Stage};
use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::{Body, EventId, wire};
use stagehand_testkit::NatsServer;

fn stagehand(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", url])
        .args(args)
        .env_remove("STAGEHAND_PROJECT")
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()
        .expect("run stagehand")
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stage(job: &str, tier: &str, node: Option<&str>) -> Stage {
    Stage {
        project: "lab".into(),
        dataset: "imagenet-mini".into(),
        version: "5f2c9a0e11b34d7a".into(),
        tier: tier.into(),
        job: job.into(),
        node: node.map(Into::into),
    }
}

fn args_of(s: &Stage) -> Vec<String> {
    let mut a = vec![
        format!("{}@{}", s.dataset, s.version),
        "--tier".into(),
        s.tier.clone(),
        "--job".into(),
        s.job.clone(),
        "--project".into(),
        s.project.clone(),
    ];
    if let Some(n) = &s.node {
        a.extend(["--node".into(), n.clone()]);
    }
    a
}

fn run_stage(url: &str, verb: &str, s: &Stage, extra: &[&str]) -> Output {
    let mut args = vec!["stage".to_owned(), verb.to_owned()];
    args.extend(args_of(s));
    args.extend(extra.iter().map(|e| e.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    stagehand(url, &refs)
}

async fn setup() -> anyhow::Result<(NatsServer, Bus, async_nats::jetstream::kv::Store)> {
    let server = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(server.url())).await?;
    bus.provision().await?;
    let kv = bus
        .jetstream()
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: STAGES_BUCKET.to_owned(),
            history: 5,
            ..Default::default()
        })
        .await?;
    Ok((server, bus, kv))
}

/// Writes the stage's status as the catalogue recorder does.
async fn put(
    kv: &async_nats::jetstream::kv::Store,
    s: &Stage,
    updated_at: &str,
    extra: Value,
) -> anyhow::Result<()> {
    let mut v = json!({
        "request_id": s.request_id(),
        "project": s.project,
        "dataset": s.dataset,
        "version": s.version,
        "tier": s.tier,
        "node": s.node,
        "job_id": s.job,
        "updated_at": updated_at,
    });
    for (k, x) in extra.as_object().into_iter().flatten() {
        v[k] = x.clone();
    }
    kv.put(s.status_key(), serde_json::to_vec(&v)?.into())
        .await?;
    Ok(())
}

#[tokio::test]
async fn request_and_release_are_stored_under_ids_from_the_job_and_a_repeat_is_a_duplicate()
-> anyhow::Result<()> {
    let (server, bus, _kv) = setup().await?;
    let url = server.url();
    let s = stage("slurm-c1-42", "local", Some("gpu-007"));
    let first = run_stage(
        &url,
        "request",
        &s,
        &["--deadline", "30m", "--form", "prepared", "--json"],
    );
    ensure!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let first: Value = serde_json::from_slice(&first.stdout)?;
    let id = EventId::for_stage(
        "lab",
        "slurm-c1-42",
        "imagenet-mini",
        "5f2c9a0e11b34d7a",
        "local",
        Some("gpu-007"),
    );
    ensure!(
        first["id"] == json!(id) && first["duplicate"] == json!(false),
        "{first}"
    );
    let again = run_stage(&url, "request", &s, &["--json"]);
    let again: Value = serde_json::from_slice(&again.stdout)?;
    ensure!(
        again["duplicate"] == json!(true) && again["sequence"] == first["sequence"],
        "{again}"
    );

    // What was stored is the contract's stage.requested.
    let stream = bus.jetstream().get_stream("STAGEHAND_REQUESTS").await?;
    let msg = stream
        .get_last_raw_message_by_subject("stagehand.req.stage.requested.lab")
        .await?;
    let event = wire::decode(&msg.payload)?;
    ensure!(event.id == id && event.correlation_id == id && event.project == "lab");
    let Body::StageRequested(req) = event.body else {
        anyhow::bail!("not a stage request");
    };
    ensure!(req.node.as_deref() == Some("gpu-007") && req.form.as_deref() == Some("prepared"));
    ensure!(req.job_id == "slurm-c1-42" && req.tier == "local");
    let deadline = req.deadline.expect("a deadline");
    let left = deadline - stagehand_schemas::event::now();
    ensure!(
        left > time::Duration::minutes(29) && left <= time::Duration::minutes(30),
        "deadline {deadline}"
    );

    let released = run_stage(&url, "release", &s, &[]);
    ensure!(released.status.success());
    ensure!(
        text(&released).trim() == s.release_id().as_str(),
        "{}",
        text(&released)
    );
    let msg = stream
        .get_last_raw_message_by_subject("stagehand.req.stage.released.lab")
        .await?;
    let event = wire::decode(&msg.payload)?;
    ensure!(event.id == s.release_id());
    ensure!(matches!(event.body, Body::StageReleased(r) if r.node.as_deref() == Some("gpu-007")));
    Ok(())
}

#[tokio::test]
async fn wait_answers_ready_failed_or_timed_out_from_the_stage_status() -> anyhow::Result<()> {
    let (server, bus, kv) = setup().await?;
    let url = server.url();

    // No status yet: timed out (2), saying so.
    let none = stage("j-none", "hot", None);
    let out = run_stage(&url, "wait", &none, &["--timeout", "300ms"]);
    ensure!(out.status.code() == Some(2), "{out:?}");
    ensure!(
        text(&out).contains("no status yet for request"),
        "{}",
        text(&out)
    );

    // Pending: timed out with the last state and reason.
    let pending = stage("j-pending", "hot", None);
    put(
        &kv,
        &pending,
        "2026-12-01T10:00:00Z",
        json!({"state": "pending", "waiting_for": "validation", "reason": "not validated yet"}),
    )
    .await?;
    let out = run_stage(&url, "wait", &pending, &["--timeout", "0"]);
    ensure!(out.status.code() == Some(2), "{out:?}");
    ensure!(
        text(&out).trim() == "pending (waiting for validation): not validated yet",
        "{}",
        text(&out)
    );

    // Ready while waiting: the watch sees it, exit 0, the path.
    let ready = stage("j-ready", "hot", None);
    put(&kv, &ready, "2026-12-01T10:00:01Z", json!({"state": "copying", "progress": {"files_done": 1, "files_total": 3, "bytes_done": 10, "bytes_total": 30}})).await?;
    let child = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", &url, "stage", "wait"])
        .args(args_of(&ready))
        .args(["--timeout", "20s"])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    // Once it watches (a consumer filtered on the stage's key exists), the data arrives.
    let js = bus.jetstream().clone();
    let subject = format!("$KV.{STAGES_BUCKET}.{}", ready.status_key());
    stagehand_testkit::wait_until(Duration::from_secs(10), "wait to watch the key", || {
        let (js, subject) = (js.clone(), subject.clone());
        async move {
            let Ok(stream) = js.get_stream(format!("KV_{STAGES_BUCKET}")).await else {
                return false;
            };
            let mut consumers = stream.consumers();
            while let Some(Ok(info)) = consumers.next().await {
                if info.config.filter_subject == subject
                    || info.config.filter_subjects.contains(&subject)
                {
                    return true;
                }
            }
            false
        }
    })
    .await?;
    put(
        &kv,
        &ready,
        "2026-12-01T10:00:02Z",
        json!({"state": "ready", "path": "/tiers/hot/lab/imagenet-mini/5f2c"}),
    )
    .await?;
    let out = child.wait_with_output()?;
    ensure!(out.status.code() == Some(0), "{out:?}");
    ensure!(
        text(&out) == "/tiers/hot/lab/imagenet-mini/5f2c\n",
        "{}",
        text(&out)
    );

    // --json prints the status.
    let out = run_stage(&url, "wait", &ready, &["--timeout", "0", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        v["state"] == json!("ready") && v["path"] == json!("/tiers/hot/lab/imagenet-mini/5f2c"),
        "{v}"
    );

    // Failed: exit 1, the reason.
    let failed = stage("j-failed", "hot", None);
    put(
        &kv,
        &failed,
        "2026-12-01T10:00:03Z",
        json!({"state": "failed", "reason": "quota of lab on hot exceeded", "retryable": true}),
    )
    .await?;
    let out = run_stage(&url, "wait", &failed, &["--timeout", "5s"]);
    ensure!(out.status.code() == Some(1), "{out:?}");
    ensure!(
        text(&out) == "quota of lab on hot exceeded\n",
        "{}",
        text(&out)
    );

    // Status: by job, by version, by project.
    let out = stagehand(&url, &["stage", "status", "j-failed"]);
    ensure!(
        text(&out)
            == "lab/imagenet-mini@5f2c9a0e11b34d7a on hot for job j-failed: failed: quota of lab on hot exceeded\n",
        "{}",
        text(&out)
    );
    let out = stagehand(
        &url,
        &["stage", "status", "imagenet-mini@5f2c9a0e11b3", "--json"],
    );
    let all: Vec<Value> = serde_json::from_slice(&out.stdout)?;
    let jobs: Vec<&str> = all.iter().filter_map(|v| v["job_id"].as_str()).collect();
    ensure!(jobs == ["j-pending", "j-ready", "j-failed"], "{jobs:?}");
    let out = stagehand(&url, &["stage", "status", "--project", "other"]);
    ensure!(text(&out) == "no stage requests\n", "{}", text(&out));
    Ok(())
}
