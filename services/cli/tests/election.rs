//! Publishes ride out a JetStream leader election (issue 19, item 10). On a three-node cluster
//! with every stream replicated three times, a loop of `stagehand ingest --wait` and `stagehand
//! stage request` — the built binary, as a lab uploader and a Slurm `data_in` hook run it — goes
//! on while the node leading `STAGEHAND_REQUESTS` is killed with SIGKILL. Every command of the
//! run succeeds, and the requests stream holds each request exactly once.
//!
//! The defect it guards: the publishes right after the kill were answered "no stream found for
//! given subject" (no responders, while the survivors elected a new leader) and each command
//! failed at once, although it had a minute left.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand::up::{Stack, UpOptions};
use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::{Body, subject};
use stagehand_testkit::{NatsCluster, wait_until};

const WAIT: Duration = Duration::from_secs(120);
/// Commands of the run: each round one ingest and one stage request.
const ROUNDS: usize = 8;
/// Rounds completed before the leader is killed.
const KILL_AFTER: usize = 2;
const PROJECT: &str = "lab-e";

/// The index of the node leading `stream`, once the cluster names one (through an election).
async fn leader_of(bus: &Bus, stream: &str) -> anyhow::Result<usize> {
    stagehand_testkit::stream_leader(bus.jetstream(), stream)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Runs the `stagehand` binary with every node of the cluster; its output, or an error saying
/// what it printed when it failed.
async fn stagehand(servers: &str, home: &Path, args: &[String]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(args)
        .env("STAGEHAND_NATS_URL", servers)
        .env("STAGEHAND_HOME", home)
        .env_remove("STAGEHAND_PROJECT")
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "`stagehand {}` exited with {}: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One round: ingest a folder and wait for its verdict, then ask for the version on the hot
/// tier for a job. Returns the two request ids.
async fn round(
    servers: &str,
    home: &Path,
    folders: &Path,
    i: usize,
) -> anyhow::Result<(String, String)> {
    let folder = folders.join(format!("d{i}"));
    std::fs::create_dir_all(&folder)?;
    std::fs::write(
        folder.join("data.bin"),
        format!("round {i}\n").repeat(i + 1),
    )?;
    let ingest: Vec<String> = [
        "ingest",
        folder.to_str().context("a UTF-8 temp path")?,
        "--project",
        PROJECT,
        "--dataset",
        &format!("ds-{i}"),
        "--wait",
        "--timeout",
        "60",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let report: serde_json::Value =
        serde_json::from_str(&stagehand(servers, home, &ingest).await?)?;
    ensure!(
        report["outcome"]["validated"].is_object(),
        "round {i}: not validated: {report}"
    );
    let digest = report["digest"].as_str().context("a digest")?.to_owned();
    let ingest_id = report["request_id"]
        .as_str()
        .context("a request id")?
        .to_owned();
    let request: Vec<String> = [
        "stage",
        "request",
        &format!("ds-{i}@{digest}"),
        "--tier",
        "hot",
        "--job",
        &format!("job-{i}"),
        "--project",
        PROJECT,
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let published: serde_json::Value =
        serde_json::from_str(&stagehand(servers, home, &request).await?)?;
    let stage_id = published["id"].as_str().context("an id")?.to_owned();
    Ok((ingest_id, stage_id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_requests_leader_mid_run_fails_no_command_and_stores_each_request_once()
-> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
    let mut cluster = NatsCluster::start(3);
    let servers = cluster.urls().join(",");
    let bus_cfg = BusConfig::new(&servers);
    let bus = Bus::connect(&bus_cfg).await?;
    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(bus_cfg.clone()),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    let leader = leader_of(&bus, subject::REQUESTS.name).await?;

    // The run: rounds one after another, as a hook would run them, counted as they finish.
    let done = Arc::new(AtomicUsize::new(0));
    let folders = tempfile::tempdir()?;
    let run = {
        let (servers, home, folders, done) = (
            servers.clone(),
            home.path().to_owned(),
            folders.path().to_owned(),
            done.clone(),
        );
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0..ROUNDS {
                ids.push(round(&servers, &home, &folders, i).await?);
                done.fetch_add(1, Ordering::SeqCst);
            }
            anyhow::Ok(ids)
        })
    };
    // Mid-run, the node leading the requests stream dies as in a crash; the next round's
    // commands are already under way.
    wait_until(WAIT, "the rounds before the kill", || async {
        done.load(Ordering::SeqCst) >= KILL_AFTER || run.is_finished()
    })
    .await?;
    cluster.node_mut(leader).kill();
    let ids = run.await??;
    assert_eq!(ids.len(), ROUNDS);
    let new_leader = leader_of(&bus, subject::REQUESTS.name).await?;
    assert_ne!(new_leader, leader, "a survivor leads the requests stream");

    // Each request stored exactly once.
    let stored = stagehand_testkit::stored_events_through_election(
        bus.jetstream(),
        subject::REQUESTS.name,
        ">",
    )
    .await
    .map_err(|e| anyhow::anyhow!("reading {}: {e}", subject::REQUESTS.name))?;
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for event in &stored {
        *per_id.entry(event.id.to_string()).or_default() += 1;
    }
    for (i, (ingest_id, stage_id)) in ids.iter().enumerate() {
        assert_eq!(
            per_id.get(ingest_id),
            Some(&1),
            "round {i}: ingest request {ingest_id} stored once"
        );
        assert_eq!(
            per_id.get(stage_id),
            Some(&1),
            "round {i}: stage request {stage_id} stored once"
        );
    }
    let ingests = stored
        .iter()
        .filter(|e| matches!(e.body, Body::IngestRequested(_)))
        .count();
    let stages = stored
        .iter()
        .filter(|e| matches!(e.body, Body::StageRequested(_)))
        .count();
    assert_eq!(
        (ingests, stages),
        (ROUNDS, ROUNDS),
        "nothing else was stored"
    );
    stack.stop().await?;
    Ok(())
}
