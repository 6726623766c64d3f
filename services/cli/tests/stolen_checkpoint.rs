//! Issue 19 item 1, end to end with the shipped accounts: project `demo`'s training job
//! (`trainer-demo`) commits a checkpoint whose location is project `labb`'s folder on the source
//! tier, and demo's scheduler asks for it on the hot tier. Every service runs as its own shipped
//! user, every command as its tenant's. Nothing of `labb`'s file reaches demo: the catalogue
//! refuses the commit (a problem and a dead letter naming the rule), the stage fails with a
//! reason naming the rule and holding nothing of labb's file (its size, its hash), and no byte
//! of it is copied under `hot:demo/`, even when the commit states labb's file exactly.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_schemas::{
    Body, CheckpointCommitted, Event, EventId, FileRef, Location, sha256_hex, version_digest,
};
use stagehand_testkit::{NatsServer, user_url, wait_for};

const WAIT: Duration = Duration::from_secs(60);

/// Runs the real `stagehand` binary as the user of `url`.
fn stagehand(url: &str, home: &Path, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(args).stdin(Stdio::null());
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    Ok(cmd
        .env("STAGEHAND_NATS_URL", url)
        .env("STAGEHAND_HOME", home)
        .output()?)
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A connection as a user that checks rather than manages streams, as tenants and services do.
async fn bus_as(url: &str) -> anyhow::Result<Bus> {
    let mut cfg = BusConfig::new(url);
    cfg.provision = false;
    Ok(Bus::connect(&cfg).await?)
}

/// Every file beneath `dir` whose bytes are `bytes`.
fn copies_of(dir: &Path, bytes: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(copies_of(&path, bytes));
        } else if std::fs::read(&path).is_ok_and(|b| b == bytes) {
            found.push(path.display().to_string());
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_cannot_stage_another_projects_files() -> anyhow::Result<()> {
    let server = NatsServer::builder()
        .shipped_accounts_with_projects(&["labb"])
        .start();
    let home = tempfile::tempdir()?;
    let policies = home.path().join("policies");
    stagehand::up::write_default_policies(&policies, home.path())?;
    for tier in ["source", "capacity", "hot", "local"] {
        std::fs::create_dir_all(home.path().join("tiers").join(tier))?;
    }
    let operator = user_url(&server, "operator", "OPERATOR");
    let out = stagehand(
        &operator,
        home.path(),
        &["provision", "--project", "demo", "--project", "labb"],
    )?;
    ensure!(out.status.success(), "{}", said(&out));

    // labb's model on the source tier, in labb's folder.
    let secret: Vec<u8> = (0..4099u32).map(|i| (i * 7 % 251) as u8).collect();
    let secret_sha = sha256_hex(&secret);
    let labb_dir = home.path().join("tiers/source/labb/models/m1");
    std::fs::create_dir_all(&labb_dir)?;
    std::fs::write(labb_dir.join("weights.bin"), &secret)?;

    // The recorder and the promoter, each as its own user.
    let shutdown = CancellationToken::new();
    let mut recorder = stagehand_catalogue_recorder::config(
        &user_url(&server, "catalogue-recorder", "CATALOGUE_RECORDER"),
        home.path().join("state/catalogue"),
    );
    recorder.bus.provision = false;
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(
        recorder,
        shutdown.clone(),
    ));
    let mut promoter = stagehand_promoter::config(
        &user_url(&server, "promoter", "PROMOTER"),
        &policies,
        home.path().join("state/promoter"),
    );
    promoter.bus.provision = false;
    let promoter = tokio::spawn(stagehand_promoter::run(promoter, shutdown.clone()));

    // demo's training job states two steps at labb's folder: one with a made-up manifest (the
    // size and hash a stage used to correct in its answer), one with labb's file exactly.
    let trainer = bus_as(&user_url(&server, "trainer-demo", "TRAINER_DEMO")).await?;
    let guessed = vec![FileRef::new("weights.bin", 1, "0".repeat(64))];
    let exact = vec![FileRef::new(
        "weights.bin",
        secret.len() as u64,
        &secret_sha,
    )];
    let mut commits = Vec::new();
    for (step, files) in [(1u64, guessed), (2, exact)] {
        let commit = Event::request(
            EventId::for_checkpoint("demo", "r1", step),
            "demo",
            Body::CheckpointCommitted(CheckpointCommitted {
                run: "r1".into(),
                step,
                location: Location {
                    tier: "source".into(),
                    prefix: "labb/models/m1".into(),
                },
                total_bytes: files.iter().map(|f| f.size).sum(),
                files: files.clone(),
                manifest: None,
                tags: vec![],
            }),
        );
        trainer.publish(&commit).await?;
        commits.push((commit.id.clone(), version_digest(&files)));
    }
    ensure!(
        trainer.permission_violations().is_empty(),
        "{:?}",
        trainer.permission_violations()
    );

    // The catalogue lists both as problems naming the rule, and folds neither.
    let problems = wait_for(WAIT, "both commits listed as problems", || {
        let operator = operator.clone();
        let home = home.path().to_owned();
        async move {
            let out = stagehand(&operator, &home, &["catalogue", "problems", "--json"]).ok()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            (out.status.success() && refused_commits(&text) >= 2).then_some(text)
        }
    })
    .await?;
    for (id, _) in &commits {
        ensure!(
            problems.contains(id.as_str()),
            "{id} not listed: {problems}"
        );
    }
    ensure!(
        problems.contains("labb/models/m1") && !problems.contains(&secret_sha),
        "{problems}"
    );

    // demo's scheduler asks for each step's version on the hot tier, and waits.
    let scheduler = user_url(&server, "scheduler", "SCHEDULER");
    for (n, (_, version)) in commits.iter().enumerate() {
        let target = format!("ckpt-r1@{version}");
        let job = format!("job-{n}");
        let place = [
            "--tier",
            "hot",
            "--job",
            &job,
            "--project",
            "demo",
            "--policies",
            policies.to_str().context("utf-8")?,
        ];
        let mut request = vec!["stage", "request", &target];
        request.extend_from_slice(&place);
        let out = stagehand(&scheduler, home.path(), &request)?;
        ensure!(out.status.success(), "stage request: {}", said(&out));
        let mut wait = vec!["stage", "wait", &target, "--timeout", "60"];
        wait.extend_from_slice(&place);
        let out = stagehand(&scheduler, home.path(), &wait)?;
        let text = said(&out);
        ensure!(
            out.status.code() == Some(1),
            "the stage did not fail: {text}"
        );
        ensure!(text.contains("outside_project"), "no rule named: {text}");
        for leak in [
            secret_sha.as_str(),
            &secret_sha[..8],
            "4099",
            "holds",
            "hash to",
        ] {
            ensure!(!text.contains(leak), "the reason shows {leak:?}: {text}");
        }
    }

    // Not one byte of labb's file is anywhere under demo's folder on the hot tier.
    let hot_demo = home.path().join("tiers/hot/demo");
    let copies = copies_of(&hot_demo, &secret);
    ensure!(copies.is_empty(), "labb's file was copied: {copies:?}");
    ensure!(
        !hot_demo.join("ckpt-r1").exists(),
        "a folder was staged for the refused checkpoint"
    );

    // Each refused commit was dead-lettered by the recorder, naming the rule.
    let operator_bus = Bus::connect(&BusConfig::new(&operator)).await?;
    let js = operator_bus.jetstream().clone();
    wait_for(WAIT, "the recorder's dead letters", || {
        let js = js.clone();
        async move {
            let mut dlq = js.get_stream("STAGEHAND_DEAD_LETTERS").await.ok()?;
            (dlq.info().await.ok()?.state.messages >= 2).then_some(())
        }
    })
    .await?;
    let dlq = js.get_stream("STAGEHAND_DEAD_LETTERS").await?;
    let last = dlq
        .get_last_raw_message_by_subject("stagehand.dlq.dead.letter.catalogue-recorder")
        .await?;
    let Body::DeadLetter(dead) = stagehand_schemas::wire::decode(&last.payload)?.body else {
        anyhow::bail!("not a dead letter");
    };
    ensure!(
        dead.errors
            .iter()
            .any(|e| e.error.contains("outside_project")),
        "{:?}",
        dead.errors
    );

    shutdown.cancel();
    recorder.await??;
    promoter.await??;
    Ok(())
}

/// How many problems of `stagehand catalogue problems --json` are checkpoint commits refused
/// for the location rule.
fn refused_commits(text: &str) -> usize {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return 0;
    };
    value["problems"].as_array().map_or(0, |problems| {
        problems
            .iter()
            .filter(|p| p["kind"] == "checkpoint.committed" && p["code"] == "outside_project")
            .count()
    })
}
