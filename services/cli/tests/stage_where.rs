//! `stagehand stage where` (issue 17 item 3) as the built binary, against a real nats-server
//! with the catalogue recorder, the ingest validator, the shared promoter and the promoter
//! agent of one node running in-process: a version staged onto that node's local tier is
//! listed on that node (text, `--hostlist`, `--json`, exit 0), by its digest and by a prefix;
//! once the copy is found damaged (the `replica.damaged` a scrub publishes) the node is listed
//! as not usable and the exit code says no node holds it; another project sees nothing of it.
//! `deploy/k8s/prefer-nodes.sh` turns the list into a pod's preferred node affinity.

mod common;

use std::process::{Command, Output};

use anyhow::{Context, ensure};
use common::{PROJECT, Stagehand, WAIT};
use serde_json::Value;
use stagehand::stage::{EX_NOWHERE, RequestOptions, Stage, StageState, WaitOutcome};
use stagehand_schemas::{Body, DamagedFile, Event, EventId, Location, ReplicaDamaged};
use stagehand_testkit::wait_for;

const NODE: &str = "gpu-a";

/// The real binary against `url`, with no project from the environment.
fn stagehand_where(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", url, "stage", "where"])
        .args(args)
        .env_remove("STAGEHAND_PROJECT")
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()?)
}

/// `deploy/k8s/prefer-nodes.sh` with the built binary, as a pod's maker runs it.
fn prefer_nodes(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new("sh")
        .arg(stagehand_testkit::repo_root().join("deploy/k8s/prefer-nodes.sh"))
        .args(args)
        .env_remove("STAGEHAND_PROJECT")
        .env("STAGEHAND_BIN", env!("CARGO_BIN_EXE_stagehand"))
        .env("STAGEHAND_NATS_URL", url)
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()?)
}

/// The hostnames a pod patch of `prefer-nodes.sh` prefers (none when it is `{}`).
fn preferred(patch: &Value) -> anyhow::Result<Vec<String>> {
    if patch.as_object().is_some_and(serde_json::Map::is_empty) {
        return Ok(Vec::new());
    }
    let terms = patch
        .pointer("/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution")
        .and_then(Value::as_array)
        .with_context(|| format!("no preferred node affinity in {patch}"))?;
    ensure!(terms.len() == 1 && terms[0]["weight"] == 100, "{patch}");
    let expr = &terms[0]["preference"]["matchExpressions"][0];
    ensure!(
        expr["key"] == "kubernetes.io/hostname" && expr["operator"] == "In",
        "{patch}"
    );
    Ok(expr["values"]
        .as_array()
        .context("values")?
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect())
}

fn said(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json_of(out: &Output) -> anyhow::Result<Value> {
    serde_json::from_slice(&out.stdout).with_context(|| said(out))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_a_verified_copy_is_listed_until_it_is_found_damaged() -> anyhow::Result<()>
{
    let sh = Stagehand::start(common::Options {
        validator: true,
        promoter: true,
        node_agent: Some(NODE.into()),
        ..Default::default()
    })
    .await?;
    let folder = tempfile::tempdir()?;
    common::write_files(
        folder.path(),
        &[("s0.tar", &[7u8; 20_000]), ("index.json", b"{}")],
    )?;
    let digest = sh.ingest(folder.path(), "shards", true)?;
    let target = format!("shards@{digest}");
    let by_prefix = format!("shards@{}", &digest[..16]);

    // Validated, staged nowhere yet: no node holds it. The recorder may still be starting
    // its queries (exit 69, "no responders"): ask until it answers.
    let out = wait_for(
        common::WAIT,
        "the catalogue to answer stage where",
        || async {
            stagehand_where(&sh.url, &[&target, "--project", PROJECT])
                .ok()
                .filter(|out| out.status.code() != Some(69))
        },
    )
    .await?;
    ensure!(out.status.code() == Some(EX_NOWHERE), "{}", said(&out));

    let stage = Stage {
        project: PROJECT.into(),
        dataset: "shards".into(),
        version: digest[..16].into(),
        tier: "local".into(),
        job: "job-where-1".into(),
        node: Some(NODE.into()),
    };
    stagehand::stage::request(
        &sh.bus,
        &stage,
        &RequestOptions {
            requested_by: "scheduler".into(),
            ..Default::default()
        },
    )
    .await?;
    let outcome = stagehand::stage::wait(&sh.bus, &stage, WAIT).await?;
    ensure!(
        matches!(outcome, WaitOutcome::Ready(_)),
        "the local stage did not become ready: {outcome:?}"
    );

    // The stage's readiness and the catalogue's replica come from the same facts, but the
    // replica may be folded a moment after the stage: poll until it is listed.
    let listed = wait_for(WAIT, "stage where to list the node", || async {
        let out = stagehand_where(&sh.url, &[&target, "--project", PROJECT, "--json"]).ok()?;
        (out.status.code() == Some(0)).then_some(out)
    })
    .await?;
    let answer = json_of(&listed)?;
    ensure!(
        answer["project"] == PROJECT
            && answer["dataset"] == "shards"
            && answer["version"] == digest.as_str(),
        "{answer}"
    );
    let nodes = answer["nodes"].as_array().context("nodes")?;
    ensure!(nodes.len() == 1, "{answer}");
    ensure!(
        nodes[0]["node"] == NODE
            && nodes[0]["tier"] == "local"
            && nodes[0]["bytes"] == 20_002
            && nodes[0]["state"] == "present",
        "{answer}"
    );
    ensure!(
        answer["unusable"].as_array().is_some_and(Vec::is_empty),
        "{answer}"
    );
    let prefix = nodes[0]["prefix"].as_str().context("prefix")?.to_owned();

    // The text names the node and tier; a prefix of the version finds the same copy.
    let out = stagehand_where(&sh.url, &[&by_prefix, "--project", PROJECT])?;
    ensure!(out.status.code() == Some(0), "{}", said(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("stage where, the copy verified:\n{text}");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(NODE))
        .with_context(|| said(&out))?;
    ensure!(
        line.contains("local") && line.contains("20002 bytes"),
        "{text}"
    );
    let out = stagehand_where(&sh.url, &[&target, "--project", PROJECT, "--hostlist"])?;
    ensure!(
        out.status.code() == Some(0) && String::from_utf8_lossy(&out.stdout) == format!("{NODE}\n"),
        "{}",
        said(&out)
    );
    // The Kubernetes side: a pod patch preferring that node.
    let out = prefer_nodes(&sh.url, &[&target, "--project", PROJECT])?;
    ensure!(out.status.success(), "{}", said(&out));
    ensure!(preferred(&json_of(&out)?)? == [NODE], "{}", said(&out));
    // Only the tier asked for: there is no copy on the hot tier's nodes (it has none).
    let out = stagehand_where(
        &sh.url,
        &[&target, "--project", PROJECT, "--tier", "hot", "--hostlist"],
    )?;
    ensure!(
        out.status.code() == Some(EX_NOWHERE) && out.stdout.is_empty(),
        "{}",
        said(&out)
    );

    // Another project asks for the same version: the catalogue has none of its, and it
    // learns nothing of the copy.
    let out = stagehand_where(&sh.url, &[&target, "--project", "labz", "--json"])?;
    ensure!(out.status.code() == Some(EX_NOWHERE), "{}", said(&out));
    let theirs = json_of(&out)?;
    ensure!(
        theirs["nodes"].as_array().is_some_and(Vec::is_empty)
            && theirs["unusable"].as_array().is_some_and(Vec::is_empty),
        "{theirs}"
    );
    let out = stagehand_where(&sh.url, &[&target, "--project", "labz", "--hostlist"])?;
    ensure!(
        out.status.code() == Some(EX_NOWHERE) && out.stdout.is_empty(),
        "{}",
        said(&out)
    );

    // The job ends and releases the copy (one a job holds would be repaired at once by its
    // agent); later a scrub reads the copy back and finds a file rotten: it publishes
    // `replica.damaged`, and the copy stays withdrawn until a request repairs it.
    stagehand::stage::release(&sh.bus, &stage).await?;
    sh.status_where(&stage, "the stage released", |s| {
        s.state == StageState::Released
    })
    .await?;
    sh.bus
        .publish(&Event::request(
            EventId::random(),
            PROJECT,
            Body::ReplicaDamaged(ReplicaDamaged {
                dataset: "shards".into(),
                version: digest.clone(),
                location: Location {
                    tier: "local".into(),
                    prefix,
                },
                node: Some(NODE.into()),
                found_by: "scrub".into(),
                files: vec![DamagedFile {
                    path: "s0.tar".into(),
                    how: "hash".into(),
                    expected_size: None,
                    found_size: None,
                }],
                damaged_total: 1,
                reason: "being repaired from tier hot".into(),
            }),
        ))
        .await?;
    let out = wait_for(
        WAIT,
        "stage where to list the node as not usable",
        || async {
            let out = stagehand_where(&sh.url, &[&target, "--project", PROJECT, "--json"]).ok()?;
            (out.status.code() == Some(EX_NOWHERE)).then_some(out)
        },
    )
    .await?;
    let answer = json_of(&out)?;
    ensure!(
        answer["nodes"].as_array().is_some_and(Vec::is_empty),
        "{answer}"
    );
    let unusable = answer["unusable"].as_array().context("unusable")?;
    ensure!(
        unusable.len() == 1
            && unusable[0]["node"] == NODE
            && unusable[0]["tier"] == "local"
            && unusable[0]["state"] == "damaged",
        "{answer}"
    );
    let out = stagehand_where(&sh.url, &[&target, "--project", PROJECT])?;
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("stage where, the copy damaged:\n{text}");
    ensure!(
        out.status.code() == Some(EX_NOWHERE)
            && text.starts_with("no node holds a usable copy")
            && text.contains("not usable:")
            && text
                .lines()
                .any(|l| l.trim_start().starts_with(NODE) && l.contains("damaged")),
        "{}",
        said(&out)
    );
    let out = stagehand_where(&sh.url, &[&target, "--project", PROJECT, "--hostlist"])?;
    ensure!(
        out.status.code() == Some(EX_NOWHERE) && out.stdout.is_empty(),
        "{}",
        said(&out)
    );
    // No node to prefer: an empty patch, and the pod is made as it is.
    let out = prefer_nodes(&sh.url, &[&target, "--project", PROJECT])?;
    ensure!(out.status.success(), "{}", said(&out));
    ensure!(preferred(&json_of(&out)?)?.is_empty(), "{}", said(&out));
    Ok(())
}

/// Arguments are checked before anything connects: a missing project, a malformed target,
/// and `--json` with `--hostlist` are usage errors (64), with no server to ask; and
/// `deploy/k8s/prefer-nodes.sh` passes the CLI's failures on.
#[test]
fn bad_arguments_fail_before_connecting() -> anyhow::Result<()> {
    let nowhere = "nats://127.0.0.1:9";
    for args in [
        vec!["shards@0123456789abcdef"],
        vec!["shards", "--project", "lab"],
        vec!["shards@xyz", "--project", "lab"],
        vec!["shards@0123456789abcdef", "--project", "Lab!"],
        vec![
            "shards@0123456789abcdef",
            "--project",
            "lab",
            "--json",
            "--hostlist",
        ],
    ] {
        let out = stagehand_where(nowhere, &args)?;
        ensure!(
            out.status.code() == Some(stagehand::args::EX_USAGE),
            "{args:?}: {}",
            said(&out)
        );
    }
    // prefer-nodes.sh passes a usage error on; with no server to ask, it fails as the CLI
    // does (69), never printing a patch that would prefer nothing.
    for (args, code) in [
        (vec![], 64),
        (vec!["shards@xyz", "--project", "lab"], 64),
        (
            vec![
                "shards@0123456789abcdef",
                "--project",
                "lab",
                "--connect-timeout",
                "1s",
            ],
            69,
        ),
    ] {
        let out = prefer_nodes(nowhere, &args)?;
        ensure!(
            out.status.code() == Some(code) && out.stdout.is_empty(),
            "prefer-nodes.sh {args:?}: {}",
            said(&out)
        );
    }
    Ok(())
}
