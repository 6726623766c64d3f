//! `stagehand stage` as plugins call it, the built binary against a real nats-server: the
//! request and release are stored under the ids derived from the job (a repeat is a duplicate),
//! `wait` answers 0/1/2 from the stage's `stagehand_stages` entry (path, reason, last state),
//! `--json` prints the status, `status` lists a job's or a version's stages and why (from the
//! real catalogue recorder, folding the real promoter's facts).

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::{Value, json};
use stagehand::stage::{STAGES_BUCKET, Stage};
use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::{Body, EventId, wire};
use stagehand_testkit::NatsServer;

fn stagehand_cmd(url: &str, args: &[&str]) -> Output {
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
    stagehand_cmd(url, &refs)
}

async fn setup() -> anyhow::Result<(NatsServer, Bus)> {
    let server = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(server.url())).await?;
    bus.provision().await?;
    Ok((server, bus))
}

#[tokio::test]
async fn request_and_release_are_stored_under_ids_from_the_job_and_a_repeat_is_a_duplicate()
-> anyhow::Result<()> {
    let (server, bus) = setup().await?;
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

    // What was stored is the contract's stage.requested, on the subject of its node (for
    // that node's agent alone) and project.
    let stream = bus.jetstream().get_stream("STAGEHAND_REQUESTS").await?;
    let msg = stream
        .get_last_raw_message_by_subject("stagehand.req.stage.requested.gpu-007.lab")
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
        .get_last_raw_message_by_subject("stagehand.req.stage.released.gpu-007.lab")
        .await?;
    let event = wire::decode(&msg.payload)?;
    ensure!(event.id == s.release_id());
    ensure!(matches!(event.body, Body::StageReleased(r) if r.node.as_deref() == Some("gpu-007")));
    Ok(())
}

/// `wait` and `status` against the real promoter and recorder: an upload not validated yet is
/// pending (exit 2 with its reason), ready once the validator has run (exit 0, the path, while
/// `wait` watches), an unknown dataset failed (exit 1, the promoter's reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_answers_ready_failed_or_timed_out_from_the_stage_status() -> anyhow::Result<()> {
    let mut stagehand = common::Stagehand::start(common::Options {
        promoter: true,
        ..common::Options::default()
    })
    .await?;
    let url = stagehand.url.clone();

    // Uploaded; the validator starts later.
    let folder = tempfile::tempdir()?;
    common::write_files(
        folder.path(),
        &[("a.bin", b"waited for"), ("d/b.bin", &[5u8; 3000])],
    )?;
    let digest = stagehand.ingest(folder.path(), "imagenet-mini", false)?;
    let at = |job: &str| Stage {
        version: digest[..16].to_owned(),
        ..stage(job, "hot", None)
    };

    // Never requested, so no status: timed out (2), saying so.
    let none = at("j-none");
    let out = run_stage(&url, "wait", &none, &["--timeout", "300ms"]);
    ensure!(out.status.code() == Some(2), "{out:?}");
    ensure!(
        text(&out).contains("no status yet for request"),
        "{}",
        text(&out)
    );

    // Requested and waiting for validation: timed out with the last state and reason.
    let pending = at("j-pending");
    let out = run_stage(&url, "request", &pending, &[]);
    ensure!(out.status.success(), "{out:?}");
    let status = stagehand
        .status_where(&pending, "the pending status", |s| {
            s.waiting_for.as_deref() == Some("validation")
        })
        .await?;
    let reason = status.reason.unwrap_or_default();
    ensure!(reason.contains(&digest), "{reason}");
    let out = run_stage(&url, "wait", &pending, &["--timeout", "0"]);
    ensure!(out.status.code() == Some(2), "{out:?}");
    ensure!(
        text(&out) == format!("pending (waiting for validation): {reason}\n"),
        "{}",
        text(&out)
    );

    // Ready while waiting: exit 0, the path.
    let ready = at("j-ready");
    ensure!(run_stage(&url, "request", &ready, &[]).status.success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", &url, "stage", "wait"])
        .args(args_of(&ready))
        .args(["--timeout", "30s"])
        .env("RUST_LOG", "stagehand::stage=debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // Once it waits (subscribed to the stage facts, the status read once and not ready), the
    // data arrives. It says so on stderr at debug level.
    let stderr = child.stderr.take().context("the child's stderr")?;
    let waiting = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut said = Vec::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let line = line.unwrap_or_default();
            let found = line.contains("waiting for the stage's status");
            said.push(line);
            if found {
                return Ok(());
            }
        }
        Err(anyhow::anyhow!(
            "stage wait ended without waiting: {said:?}"
        ))
    });
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .context("stage wait did not start waiting within 10 s")???;
    stagehand.start_validator();
    let out = child.wait_with_output()?;
    ensure!(out.status.code() == Some(0), "{out:?}");
    let path = stagehand
        .home
        .path()
        .join("tiers/hot/lab/imagenet-mini")
        .join(&digest);
    ensure!(
        text(&out) == format!("{}\n", path.display()),
        "{}",
        text(&out)
    );
    ensure!(
        path.join("d/b.bin").is_file(),
        "nothing at {}",
        path.display()
    );

    // --json prints the status, with the version the promoter resolved.
    let out = run_stage(&url, "wait", &ready, &["--timeout", "0", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        v["state"] == json!("ready")
            && v["path"] == json!(path.display().to_string())
            && v["resolved_version"] == json!(digest),
        "{v}"
    );

    // Failed (a dataset nobody uploaded): exit 1, the promoter's reason.
    let failed = Stage {
        dataset: "nosuch".into(),
        version: "0123456789abcdef".into(),
        ..stage("j-failed", "hot", None)
    };
    ensure!(run_stage(&url, "request", &failed, &[]).status.success());
    let out = run_stage(&url, "wait", &failed, &["--timeout", "10s"]);
    ensure!(out.status.code() == Some(1), "{out:?}");
    let why = text(&out);
    ensure!(why.starts_with("unknown dataset \"nosuch\""), "{why}");

    // Status: by job, by version, by project.
    let out = stagehand_cmd(&url, &["stage", "status", "j-failed", "--project", "lab"]);
    ensure!(
        text(&out) == format!("lab/nosuch@0123456789abcdef on hot for job j-failed: failed: {why}"),
        "{}",
        text(&out)
    );
    let out = stagehand_cmd(
        &url,
        &[
            "stage",
            "status",
            &format!("imagenet-mini@{}", &digest[..12]),
            "--project",
            "lab",
            "--json",
        ],
    );
    let all: Vec<Value> = serde_json::from_slice(&out.stdout)?;
    let mut jobs: Vec<&str> = all.iter().filter_map(|v| v["job_id"].as_str()).collect();
    jobs.sort();
    ensure!(jobs == ["j-pending", "j-ready"], "{jobs:?}");
    let out = stagehand_cmd(&url, &["stage", "status", "--project", "lab"]);
    ensure!(text(&out).lines().count() == 3, "{out:?}");
    let out = stagehand_cmd(&url, &["stage", "status", "--project", "other"]);
    ensure!(text(&out) == "no stage requests\n", "{out:?}");
    Ok(())
}

/// `wait` learns of a change without a consumer: the promoter's `stage.ready` fact for its
/// request wakes it, and it reads the stage's status again (at once, then after 10 ms,
/// doubling) until the recorder has written it there. Nothing else would read it again within
/// the hour here, so the answer can only come through the wake. The server holds no facts
/// stream, only the stage-status bucket: a request on a facts subject has a responder only
/// once the wait has subscribed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_is_woken_by_its_stage_fact_and_reads_the_status_again() -> anyhow::Result<()> {
    let server = NatsServer::start();
    let mut cfg = BusConfig::new(server.url());
    cfg.provision = false;
    let bus = Bus::connect(&cfg).await?;
    let kv = bus
        .jetstream()
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: STAGES_BUCKET.into(),
            ..Default::default()
        })
        .await?;
    let waited = stage("j-woken", "hot", None);
    let path = "/tiers/hot/lab/imagenet-mini/5f2c9a0e11b34d7a";
    let status = |state: &str| {
        json!({
            "request_id": waited.request_id(), "project": waited.project,
            "dataset": waited.dataset, "version": waited.version, "tier": waited.tier,
            "job_id": waited.job, "state": state,
            "path": (state == "ready").then_some(path),
            "updated_at": "2026-01-01T00:00:00Z",
        })
        .to_string()
    };
    kv.put(waited.status_key(), status("copying").into())
        .await?;

    let waiter = {
        let (bus, waited) = (bus.clone(), waited.clone());
        tokio::spawn(async move {
            stagehand::stage::wait_rereading(
                &bus,
                &waited,
                Duration::from_secs(30),
                Duration::from_secs(3600),
            )
            .await
        })
    };
    let ready_subject = format!("stagehand.fact.stage.ready.{}", waited.project);
    stagehand_testkit::wait_until(Duration::from_secs(10), "the wait to subscribe", || {
        let (client, subject) = (bus.client().clone(), ready_subject.clone());
        async move {
            // No responders is answered at once; a subscriber that does not reply lets the
            // request time out.
            tokio::time::timeout(
                Duration::from_millis(200),
                client.request(subject, "probe".into()),
            )
            .await
            .is_err()
        }
    })
    .await?;

    // The promoter's fact, then (as the recorder folds it) the status.
    let request = stagehand_schemas::Event::request(
        waited.request_id(),
        waited.project.clone(),
        Body::StageRequested(stagehand_schemas::StageRequested {
            dataset: waited.dataset.clone(),
            version: waited.version.clone(),
            tier: waited.tier.clone(),
            job_id: waited.job.clone(),
            requested_by: "test".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    );
    let fact = request.caused(
        "ready",
        Body::StageReady(stagehand_schemas::StageReady {
            dataset: waited.dataset.clone(),
            version: waited.version.clone(),
            location: stagehand_schemas::Location {
                tier: waited.tier.clone(),
                prefix: format!("lab/{}/{}", waited.dataset, waited.version),
            },
            job_id: waited.job.clone(),
            request_id: waited.request_id(),
            node: None,
            path: Some(path.into()),
        }),
    );
    bus.client()
        .publish(ready_subject.clone(), wire::encode(&fact)?.into())
        .await?;
    bus.client().flush().await?;
    kv.put(waited.status_key(), status("ready").into()).await?;

    let outcome = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .context("the wait was not woken")???;
    match outcome {
        stagehand::stage::WaitOutcome::Ready(s) => {
            ensure!(s.path.as_deref() == Some(path), "{s:?}")
        }
        other => anyhow::bail!("{other:?}"),
    }
    Ok(())
}
