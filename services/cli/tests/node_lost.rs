//! Node failure has a defined cost (issue item 5), against a real nats-server with the
//! catalogue recorder, the ingest validator, the shared promoter, the shared demoter and the
//! agents of two nodes (each with a local tier of its own) running in-process: both nodes hold
//! verified copies of two versions; node B's agent stops and stays silent past
//! `agent_silent_after`, and its copies become unreachable — `stage where` lists only node A
//! (B among the unusable, with why), the catalogue's tier usage no longer counts B's bytes,
//! `stagehand status` names B. One file of B's copy of one version is rewritten while B is
//! away; B's agent starts again: the intact copy is usable again, the rewritten one is found
//! `damaged` and, as a job still holds it, copied anew by B's agent at once.

mod common;

use std::process::{Command, Output};

use anyhow::{Context, ensure};
use common::{PROJECT, Stagehand, WAIT};
use serde_json::Value;
use stagehand::stage::{RequestOptions, Stage, WaitOutcome};
use stagehand_testkit::wait_for;

const NODE_A: &str = "gpu-a";
const NODE_B: &str = "gpu-b";

fn said(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `stagehand stage where --json` of `target` in the test project, once the catalogue answers.
fn stage_where(url: &str, target: &str) -> Option<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args([
            "--nats",
            url,
            "stage",
            "where",
            target,
            "--project",
            PROJECT,
        ])
        .arg("--json")
        .env_remove("STAGEHAND_PROJECT")
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()
        .ok()?;
    matches!(out.status.code(), Some(0 | 3))
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// The (node, state) of every copy `stage where` answered, usable ones then the others.
fn copies(answer: &Value) -> (Vec<String>, Vec<(String, String, String)>) {
    let usable = answer["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["node"].as_str().map(str::to_owned))
        .collect();
    let unusable = answer["unusable"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let field = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (field("node"), field("state"), field("reason"))
        })
        .collect();
    (usable, unusable)
}

/// `stagehand status --json --policies`: its object.
fn status(stack: &Stagehand) -> anyhow::Result<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["status", "--json", "--policies"])
        .arg(&stack.policies)
        .args(["--nats", &stack.url])
        .output()?;
    ensure!(matches!(out.status.code(), Some(0 | 1)), "{}", said(&out));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The `node` findings of a status report, as (subject, detail, run).
fn node_findings(report: &Value) -> Vec<(String, String, String)> {
    report["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["area"] == "node")
        .map(|f| {
            let field = |k: &str| f[k].as_str().unwrap_or_default().to_owned();
            (field("subject"), field("detail"), field("run"))
        })
        .collect()
}

/// Stages `dataset@digest` on `node`'s local tier for a job and waits until it is ready.
async fn stage_on(sh: &Stagehand, dataset: &str, digest: &str, node: &str) -> anyhow::Result<()> {
    let stage = Stage {
        project: PROJECT.into(),
        dataset: dataset.into(),
        version: digest.into(),
        tier: "local".into(),
        job: format!("job-{dataset}-{node}"),
        node: Some(node.into()),
    };
    let options = RequestOptions {
        requested_by: "scheduler".into(),
        ..Default::default()
    };
    stagehand::stage::request(&sh.bus, &stage, &options).await?;
    let outcome = stagehand::stage::wait(&sh.bus, &stage, WAIT).await?;
    ensure!(
        matches!(outcome, WaitOutcome::Ready(_)),
        "{dataset} on {node} did not become ready: {outcome:?}"
    );
    Ok(())
}

/// The bytes per node the catalogue's tier usage counts on the local tier.
async fn local_usage(sh: &Stagehand) -> anyhow::Result<Vec<(String, u64)>> {
    let catalogue = stagehand_catalogue::Catalogue::new(sh.bus.client().clone());
    let mut out: Vec<(String, u64)> = catalogue
        .tier_usage(Some("local"))
        .await?
        .into_iter()
        .map(|u| (u.node.unwrap_or_default(), u.bytes))
        .collect();
    out.sort();
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_nodes_copies_are_unreachable_and_come_back_verified() -> anyhow::Result<()> {
    let mut sh = Stagehand::start(common::Options {
        validator: true,
        promoter: true,
        demoter: true,
        node_agents: vec![NODE_A.into(), NODE_B.into()],
        agent_silent_after: Some("3s".into()),
        ..Default::default()
    })
    .await?;
    let kept = tempfile::tempdir()?;
    common::write_files(kept.path(), &[("s0.tar", &[7u8; 20_000])])?;
    let kept_digest = sh.ingest(kept.path(), "kept", true)?;
    let changed = tempfile::tempdir()?;
    common::write_files(changed.path(), &[("s0.tar", &[9u8; 10_000])])?;
    let changed_digest = sh.ingest(changed.path(), "changed", true)?;
    for node in [NODE_A, NODE_B] {
        stage_on(&sh, "kept", &kept_digest, node).await?;
        stage_on(&sh, "changed", &changed_digest, node).await?;
    }
    let kept_target = format!("kept@{kept_digest}");
    let changed_target = format!("changed@{changed_digest}");
    let both = vec![NODE_A.to_owned(), NODE_B.to_owned()];
    wait_for(WAIT, "both nodes listed with usable copies", || async {
        let kept = stage_where(&sh.url, &kept_target)?;
        let changed = stage_where(&sh.url, &changed_target)?;
        (copies(&kept).0 == both && copies(&changed).0 == both).then_some(())
    })
    .await?;
    let before = local_usage(&sh).await?;
    ensure!(
        before == [(NODE_A.into(), 30_000), (NODE_B.into(), 30_000)],
        "{before:?}"
    );
    // Both nodes beat: nobody is judged silent.
    ensure!(node_findings(&status(&sh)?).is_empty());

    // Each agent's liveness record, as the server stored it a moment ago.
    let placement = sh
        .bus
        .jetstream()
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await?;
    for node in [NODE_A, NODE_B] {
        let record = stagehand_bus::placement::liveness(&placement, node)
            .await?
            .with_context(|| format!("no liveness record of {node}"))?;
        let age = time::OffsetDateTime::now_utc() - record.stored_at;
        ensure!(age.whole_seconds().abs() < 10, "{node}: {record:?}");
    }

    // Node B goes away.
    let stopped = std::time::Instant::now();
    sh.stop_node_agent(NODE_B).await?;
    let answer = wait_for(WAIT, "node B's copies unreachable", || async {
        let answer = stage_where(&sh.url, &kept_target)?;
        let (usable, unusable) = copies(&answer);
        (usable == [NODE_A]
            && unusable
                .iter()
                .any(|(n, s, _)| n == NODE_B && s == "unreachable"))
        .then_some(answer)
    })
    .await?;
    // Not before its record was `agent_silent_after` old (the last beat at most a quarter of
    // it before the stop).
    let judged_after = stopped.elapsed();
    eprintln!("node B judged unreachable {judged_after:?} after its agent stopped");
    ensure!(
        judged_after >= std::time::Duration::from_millis(2_000),
        "{judged_after:?}"
    );
    let (_, unusable) = copies(&answer);
    ensure!(
        unusable.len() == 1 && unusable[0].2.contains("node gpu-b silent since"),
        "{answer}"
    );
    // The other version's copy too (every present copy on the node).
    wait_for(WAIT, "node B's other copy unreachable", || async {
        let (usable, unusable) = copies(&stage_where(&sh.url, &changed_target)?);
        (usable == [NODE_A] && unusable.iter().any(|(_, s, _)| s == "unreachable")).then_some(())
    })
    .await?;
    // Its bytes are no longer counted on the tier (nor against the project's quota there).
    let after = local_usage(&sh).await?;
    ensure!(after == [(NODE_A.into(), 30_000)], "{after:?}");
    // On-call is told, with the page to read.
    let report = status(&sh)?;
    let findings = node_findings(&report);
    ensure!(findings.len() == 1, "{report}");
    let (subject, detail, run) = &findings[0];
    ensure!(subject == "gpu-b (tier local)", "{report}");
    ensure!(detail.starts_with("2 copies"), "{report}");
    ensure!(run.contains("runbooks/node-lost.md"), "{report}");
    ensure!(report["needs_person"] == true, "{report}");

    // While B is away, a file of its copy of `changed` is rewritten (same size, other bytes).
    let file = sh
        .node_local_root(NODE_B)
        .join(PROJECT)
        .join("changed")
        .join(&changed_digest)
        .join("s0.tar");
    let mut perms = std::fs::metadata(&file)
        .with_context(|| file.display().to_string())?
        .permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o640);
    std::fs::set_permissions(&file, perms)?;
    std::fs::write(&file, [1u8; 10_000])?;

    // B returns: each copy is re-checked against its fingerprint.
    sh.start_node_agent(NODE_B)?;
    sh.ready().await?;
    wait_for(WAIT, "node B's intact copy usable again", || async {
        (copies(&stage_where(&sh.url, &kept_target)?).0 == both).then_some(())
    })
    .await?;
    // The rewritten copy is found damaged by its fingerprint; a job still holds it, so B's own
    // agent copies the rewritten file anew at once, and the copy is listed usable again.
    let js = sh.bus.jetstream();
    let on_b = |node: &Option<String>, dataset: &str| {
        node.as_deref() == Some(NODE_B) && dataset == "changed"
    };
    let repaired = wait_for(WAIT, "node B's rewritten copy repaired", || async {
        stagehand_testkit::stored_facts(js, "replica.repaired")
            .await
            .into_iter()
            .find_map(|e| match e.body {
                stagehand_schemas::Body::ReplicaRepaired(r) if on_b(&r.node, &r.dataset) => Some(r),
                _ => None,
            })
    })
    .await?;
    ensure!(
        repaired.repaired == ["s0.tar"] && repaired.from_tier != "local",
        "{repaired:?}"
    );
    let damaged: Vec<_> = stagehand_testkit::stored_facts(js, "replica.damaged")
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            stagehand_schemas::Body::ReplicaDamaged(d) if on_b(&d.node, &d.dataset) => Some(d),
            _ => None,
        })
        .collect();
    ensure!(
        damaged
            .first()
            .is_some_and(|d| d.files.iter().any(|f| f.path == "s0.tar")),
        "{damaged:?}"
    );
    ensure!(
        std::fs::read(&file)? == [9u8; 10_000],
        "node B's copy holds the rewritten bytes still"
    );
    wait_for(WAIT, "node B's repaired copy usable", || async {
        (copies(&stage_where(&sh.url, &changed_target)?).0 == both).then_some(())
    })
    .await?;
    // Nothing is unreachable any more.
    wait_for(WAIT, "status no longer naming node B", || async {
        node_findings(&status(&sh).ok()?).is_empty().then_some(())
    })
    .await?;
    Ok(())
}
