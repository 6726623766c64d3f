//! Checkpoints written to node-local NVMe and offloaded before they count (issue item 2, its
//! test (d)), with the real `stagehand` binary against a real nats-server, the catalogue
//! recorder, the shared promoter (which completes each step once its parts are offloaded) and
//! four promoter agents in-process, each node with a local tier of its own: a
//! step whose four parts are all offloaded becomes the run's latest and restores byte-exact;
//! a step whose fourth node's agent is gone before it offloads stays at risk, naming that part
//! and node, and the previous step stays latest; a part commit naming another project's folder,
//! a folder that is not the part's or a shared tier is refused with a reason, nothing copied.
//! Once a step is committed whole, each node's agent removes its part from the node's local
//! tier and the catalogue records it (`checkpoint.part.removed`), but only once its copy off
//! the node is read back whole (a copy that went bad after it was hashed in flight is copied
//! again from the node first); the parts of a step not committed stay on their nodes.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, ensure};
use common::{PROJECT, Stagehand, WAIT};
use serde_json::Value;
use stagehand_catalogue::Catalogue;
use stagehand_schemas::{Body, CheckpointPartCommitted, Event, EventId, FileRef, Location};
use stagehand_testkit::wait_for;

const NODES: [&str; 4] = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"];
const RUN: &str = "llm";

fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", url])
        .args(args)
        .env_remove("STAGEHAND_PROJECT")
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()?)
}

fn said(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The bytes of part `part` of `step`: distinct per step and part.
fn part_files(step: u64, part: usize) -> Vec<(String, Vec<u8>)> {
    vec![
        (
            format!("__{part}_0.distcp"),
            (0..20_000u32)
                .map(|i| (i as u64 * 7 + step * 13 + part as u64) as u8)
                .collect(),
        ),
        (
            ".metadata".to_owned(),
            format!("{step}/{part}").into_bytes(),
        ),
    ]
}

/// The part's folder on the node's local tier, as the layout rule makes it.
fn part_dir(policies: &Path, step: u64, part: usize) -> anyhow::Result<PathBuf> {
    Ok(
        local_root(policies)?.join(stagehand_schemas::layout::checkpoint_part_folder(
            PROJECT,
            &stagehand_catalogue::checkpoint_dataset(RUN),
            step,
            part as u32,
        )),
    )
}

/// The `local` tier's root of a node's policy folder (`Stagehand::start_node_agent`:
/// `<home>/policies-<node>` has its root at `<home>/tiers/local-<node>`).
fn local_root(policies: &Path) -> anyhow::Result<PathBuf> {
    let name = policies
        .file_name()
        .and_then(|n| n.to_str())
        .context("a name")?;
    let node = name
        .strip_prefix("policies-")
        .context("a node's policies")?;
    let home = policies.parent().context("the home")?;
    Ok(home.join("tiers").join(format!("local-{node}")))
}

/// Writes part `part` of `step` (of 4) on its node and commits it with the real binary.
fn write_and_commit(
    url: &str,
    node: &str,
    policies: &Path,
    step: u64,
    part: usize,
) -> anyhow::Result<()> {
    write_and_commit_of(url, node, policies, (step, part, NODES.len()))
}

/// Writes part `part` of `step` of `parts` on its node and commits it with the real binary.
fn write_and_commit_of(
    url: &str,
    node: &str,
    policies: &Path,
    (step, part, parts): (u64, usize, usize),
) -> anyhow::Result<()> {
    let dir = part_dir(policies, step, part)?;
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in part_files(step, part) {
        std::fs::write(dir.join(name), bytes)?;
    }
    let count = parts as u64;
    let (step, part, parts) = (step.to_string(), part.to_string(), parts.to_string());
    let out = stagehand(
        url,
        &[
            "checkpoint",
            "commit",
            "--project",
            PROJECT,
            "--run",
            RUN,
            "--step",
            &step,
            "--tier",
            "local",
            "--node",
            node,
            "--part",
            &part,
            "--parts",
            &parts,
            "--policies",
            policies.to_str().context("utf-8")?,
            "--json",
            dir.to_str().context("utf-8")?,
        ],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let answer: Value = serde_json::from_slice(&out.stdout).with_context(|| said(&out))?;
    ensure!(
        answer["node"] == node && answer["parts"].as_u64() == Some(count) && answer["files"] == 2,
        "{answer}"
    );
    Ok(())
}

/// `checkpoint list --json` of the run.
fn list(url: &str, policies: &Path) -> anyhow::Result<Vec<Value>> {
    let out = stagehand(
        url,
        &[
            "checkpoint",
            "list",
            RUN,
            "--project",
            PROJECT,
            "--policies",
            policies.to_str().context("utf-8")?,
            "--json",
        ],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    serde_json::from_slice::<Vec<Value>>(&out.stdout).with_context(|| said(&out))
}

fn step_of(listed: &[Value], step: u64) -> Option<&Value> {
    listed.iter().find(|c| c["step"] == step)
}

/// Waits until `checkpoint list` shows `step` in `state`.
async fn listed_as(url: &str, policies: &Path, step: u64, state: &str) -> anyhow::Result<Value> {
    let mut last = Vec::new();
    let found = wait_for(WAIT, &format!("step {step} listed {state}"), || {
        let got = list(url, policies).ok();
        if let Some(got) = &got {
            last = got.clone();
        }
        async move {
            step_of(got.as_deref()?, step)
                .filter(|c| c["state"] == state)
                .cloned()
        }
    })
    .await;
    found.with_context(|| format!("last listing: {last:#?}"))
}

/// `checkpoint restore` of the latest step onto hot: the folder it prints.
fn restore_latest(url: &str, policies: &Path) -> anyhow::Result<PathBuf> {
    let out = stagehand(
        url,
        &[
            "checkpoint",
            "restore",
            RUN,
            "--project",
            PROJECT,
            "--tier",
            "hot",
            "--job",
            "resume-1",
            "--policies",
            policies.to_str().context("utf-8")?,
            "--timeout",
            "60",
            "--json",
        ],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let answer: Value = serde_json::from_slice(&out.stdout).with_context(|| said(&out))?;
    Ok(PathBuf::from(
        answer["path"].as_str().with_context(|| said(&out))?,
    ))
}

/// The parts of `step` the catalogue records removed from their nodes, as (part, node).
async fn removed_parts(catalogue: &Catalogue, step: u64) -> anyhow::Result<Vec<(u32, String)>> {
    let parts = catalogue.checkpoint_parts(PROJECT, RUN, Some(step)).await?;
    Ok(parts
        .into_iter()
        .filter(|p| p.is_removed())
        .map(|p| (p.part, p.node))
        .collect())
}

/// Waits until every part of `step` is gone from its node's local tier, with the step's
/// folder there (each node held one part), and the catalogue records each removed by its own
/// node; its offloaded copy is still on hot.
async fn parts_left_their_nodes(
    sh: &Stagehand,
    catalogue: &Catalogue,
    policies: &[PathBuf],
    step: u64,
) -> anyhow::Result<()> {
    let every: Vec<(u32, String)> = (0..NODES.len())
        .map(|part| (part as u32, NODES[part].to_owned()))
        .collect();
    let on_node = || -> Vec<usize> {
        (0..NODES.len())
            .filter(|&part| {
                part_dir(&policies[part], step, part)
                    .is_ok_and(|d| d.exists() || d.parent().is_some_and(Path::exists))
            })
            .collect()
    };
    let gone = wait_for(
        WAIT,
        &format!("the parts of step {step} off their nodes"),
        || async {
            let removed = removed_parts(catalogue, step).await.ok()?;
            (on_node().is_empty() && removed == every).then_some(())
        },
    )
    .await;
    if gone.is_err() {
        anyhow::bail!(
            "step {step}: parts still on their nodes {:?}; the catalogue records removed {:?}",
            on_node(),
            removed_parts(catalogue, step).await?
        );
    }
    let hot_step = sh
        .home
        .path()
        .join(format!("tiers/hot/lab/ckpt-llm/step-{step}"));
    holds_step(&hot_step, step)
}

/// Waits until `checkpoint list` shows three parts of `step` offloaded (the fourth node's
/// agent away) and returns the step as listed.
async fn three_offloaded(url: &str, policies: &Path, step: u64) -> anyhow::Result<Value> {
    wait_for(
        WAIT,
        &format!("three parts of step {step} offloaded"),
        || {
            let listed = list(url, policies).ok();
            async move {
                step_of(listed.as_deref()?, step)
                    .filter(|c| c["offload"]["offloaded"] == 3)
                    .cloned()
            }
        },
    )
    .await
    .map_err(Into::into)
}

/// Starts the agents of the first three nodes, commits every part of step 1 on its node and
/// waits until those three are offloaded (gpu-d's agent not started): the stack's URL, a
/// catalogue client and each node's policies.
async fn step_one_offloaded_but_for_gpu_d(
    sh: &mut Stagehand,
) -> anyhow::Result<(String, Catalogue, Vec<PathBuf>)> {
    let mut policies = Vec::new();
    for node in &NODES[..3] {
        policies.push(sh.start_node_agent(node)?);
    }
    policies.push(sh.write_node_policies(NODES[3])?);
    sh.ready().await?;
    let url = sh.url.clone();
    let catalogue = Catalogue::new(sh.bus.client().clone());
    for (part, node) in NODES.iter().enumerate() {
        write_and_commit(&url, node, &policies[part], 1, part)?;
    }
    three_offloaded(&url, &sh.policies, 1).await?;
    Ok((url, catalogue, policies))
}

/// Every part's files of `step` are in `dir` under `part-<i>/`, byte for byte.
fn holds_step(dir: &Path, step: u64) -> anyhow::Result<()> {
    for part in 0..NODES.len() {
        for (name, bytes) in part_files(step, part) {
            let path = dir.join(format!("part-{part}")).join(&name);
            let found = std::fs::read(&path).with_context(|| path.display().to_string())?;
            ensure!(
                found == bytes,
                "{} differs from part {part} of step {step}",
                path.display()
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_on_node_nvme_is_latest_only_once_every_part_is_offloaded() -> anyhow::Result<()> {
    let mut sh = Stagehand::start(common::Options {
        promoter: true,
        ..Default::default()
    })
    .await?;
    let mut policies = Vec::new();
    for node in NODES {
        policies.push(sh.start_node_agent(node)?);
    }
    sh.ready().await?;
    let url = sh.url.clone();
    let catalogue = Catalogue::new(sh.bus.client().clone());

    // Steps 1 and 2: every node commits its part; each is offloaded and the step committed
    // whole on hot; then every part leaves its node.
    for step in [1, 2] {
        for (part, node) in NODES.iter().enumerate() {
            write_and_commit(&url, node, &policies[part], step, part)?;
        }
        let whole = listed_as(&url, &sh.policies, step, "committed").await?;
        ensure!(whole["tiers"] == serde_json::json!(["hot"]), "{whole}");
        ensure!(whole.get("offload").is_none(), "{whole}");
    }
    for step in [1, 2] {
        parts_left_their_nodes(&sh, &catalogue, &policies, step).await?;
    }
    each_agent_heard_only_its_own_nodes_parts(&sh, 2).await?;
    // The list still says committed, on hot, nothing at risk.
    let listed = list(&url, &sh.policies)?;
    for step in [1, 2] {
        ensure!(
            step_of(&listed, step).is_some_and(|c| c["state"] == "committed"
                && c["tiers"] == serde_json::json!(["hot"])
                && c.get("offload").is_none()),
            "{listed:#?}"
        );
    }
    let restored = restore_latest(&url, &sh.policies)?;
    ensure!(
        restored.ends_with("lab/ckpt-llm/step-2"),
        "{}",
        restored.display()
    );
    holds_step(&restored, 2)?;

    // Step 3: the fourth node is gone before its agent offloads its part.
    sh.stop_node_agent(NODES[3]).await?;
    for (part, node) in NODES.iter().enumerate() {
        write_and_commit(&url, node, &policies[part], 3, part)?;
    }
    let at_risk = three_offloaded(&url, &sh.policies, 3).await?;
    ensure!(at_risk["state"] == "at_risk", "{at_risk}");
    ensure!(
        at_risk["offload"]["on_node"] == serde_json::json!([{ "part": 3, "node": "gpu-d" }]),
        "{at_risk}"
    );
    ensure!(
        at_risk["offload"]["bytes_on_node"] == 20_000 + 3,
        "{at_risk}"
    );
    // Its step not committed, no part leaves its node, offloaded or not.
    let stays = |what: &str| -> anyhow::Result<()> {
        for (part, node_policies) in policies.iter().enumerate() {
            for (name, bytes) in part_files(3, part) {
                let path = part_dir(node_policies, 3, part)?.join(name);
                let found = std::fs::read(&path).with_context(|| format!("{what}: {path:?}"))?;
                ensure!(found == bytes, "{what}: {path:?} changed");
            }
        }
        Ok(())
    };
    stays("three parts offloaded")?;
    ensure!(removed_parts(&catalogue, 3).await?.is_empty());
    // The three offloaded parts are on hot; the step is not, nor the missing part.
    let hot_step = sh.home.path().join("tiers/hot/lab/ckpt-llm/step-3");
    ensure!(hot_step.join("part-2/.metadata").is_file());
    ensure!(!hot_step.join("part-3").exists());
    // Part 2's copy on hot goes bad after it was hashed in flight (retention.toml's
    // `[offload] verify` as shipped): a byte of it flips on the media. Its node keeps the
    // part until the copy is read back, so the bad copy is found and made whole from it.
    let (rotted_name, rotted_bytes) = part_files(3, 2).swap_remove(0);
    let rotted = hot_step.join("part-2").join(&rotted_name);
    let mut flipped = rotted_bytes.clone();
    flipped[1000] ^= 0xff;
    std::fs::set_permissions(&rotted, std::fs::Permissions::from_mode(0o644))?;
    std::fs::write(&rotted, &flipped)?;
    // Step 2 stays latest: listed committed, and what `restore` gives.
    let listed = list(&url, &sh.policies)?;
    ensure!(
        step_of(&listed, 2).is_some_and(|c| c["state"] == "committed"),
        "{listed:#?}"
    );
    let restored = restore_latest(&url, &sh.policies)?;
    ensure!(
        restored.ends_with("lab/ckpt-llm/step-2"),
        "{}",
        restored.display()
    );
    holds_step(&restored, 2)?;
    // Asked for by name, step 3 is refused, naming what is missing.
    let out = stagehand(
        &url,
        &[
            "checkpoint",
            "restore",
            RUN,
            "--step",
            "3",
            "--project",
            PROJECT,
            "--tier",
            "hot",
            "--job",
            "resume-2",
            "--policies",
            sh.policies.to_str().context("utf-8")?,
        ],
    )?;
    ensure!(
        out.status.code() == Some(1)
            && String::from_utf8_lossy(&out.stderr).contains("incomplete: 3 of 4 parts offloaded")
            && String::from_utf8_lossy(&out.stderr).contains("part 3 on gpu-d"),
        "{}",
        said(&out)
    );
    // The text names the step at risk, the part and its node.
    let out = stagehand(
        &url,
        &[
            "checkpoint",
            "list",
            RUN,
            "--project",
            PROJECT,
            "--policies",
            sh.policies.to_str().context("utf-8")?,
        ],
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("checkpoint list, step 3 at risk:\n{text}");
    ensure!(
        text.contains("at risk") && text.contains("part 3 on gpu-d") && text.contains("3 of 4"),
        "{}",
        said(&out)
    );

    // The audit of that node's local tier takes none of its parts, the only copy of part 3,
    // for stray data.
    let out = stagehand(
        &url,
        &[
            "audit",
            "local",
            "--node",
            NODES[3],
            "--policies",
            policies[3].to_str().context("utf-8")?,
            "--json",
        ],
    )?;
    let report: Value = serde_json::from_slice(&out.stdout).with_context(|| said(&out))?;
    ensure!(
        report["stray"].as_array().is_some_and(Vec::is_empty),
        "{report:#}"
    );
    stays("step 3 still incomplete")?;
    ensure!(removed_parts(&catalogue, 3).await?.is_empty());

    // The node comes back: its agent offloads the part it left, and step 3 becomes latest.
    sh.start_node_agent(NODES[3])?;
    sh.ready().await?;
    listed_as(&url, &sh.policies, 3, "committed").await?;
    parts_left_their_nodes(&sh, &catalogue, &policies, 3).await?;
    // Part 2 left gpu-c only after its copy on hot was read back and copied again.
    ensure!(
        std::fs::read(&rotted)? == rotted_bytes,
        "{} was not made whole before its part left the node",
        rotted.display()
    );
    let restored = restore_latest(&url, &sh.policies)?;
    ensure!(
        restored.ends_with("lab/ckpt-llm/step-3"),
        "{}",
        restored.display()
    );
    holds_step(&restored, 3)?;
    Ok(())
}

/// Each node's agent is handed its own node's part commits and no other's: of the
/// `steps × NODES` parts in the facts stream, its consumer's filter lets through only the ones
/// on its node's subject, and it has none left to take.
async fn each_agent_heard_only_its_own_nodes_parts(
    sh: &Stagehand,
    steps: usize,
) -> anyhow::Result<()> {
    use stagehand_schemas::subject::{FACT, FACTS, kind_filter, node_kind_filter, subject_matches};
    let commits = facts(sh, "checkpoint.part.committed").await?;
    ensure!(
        commits.len() == steps * NODES.len(),
        "{} part commits",
        commits.len()
    );
    let stream = sh.bus.jetstream().get_stream(FACTS.name).await?;
    for node in NODES {
        let info = stream
            .consumer_info(format!("promoter-offload-{node}"))
            .await?;
        let filters = &info.config.filter_subjects;
        let mine = node_kind_filter(FACT, "checkpoint.part.committed", node);
        ensure!(filters.contains(&mine), "{node}: {filters:?}");
        ensure!(
            filters.contains(&kind_filter(FACT, "checkpoint.committed")),
            "{node}: {filters:?}"
        );
        let heard: Vec<&Event> = commits
            .iter()
            .filter(|commit| {
                let subject =
                    stagehand_schemas::subject::subject_for(&commit.body, &commit.project);
                filters.iter().any(|f| subject_matches(f, &subject))
            })
            .collect();
        ensure!(
            heard.len() == steps,
            "{node} hears {} part commits",
            heard.len()
        );
        for commit in heard {
            let Body::CheckpointPartCommitted(part) = &commit.body else {
                anyhow::bail!("{node} hears a {}", commit.kind());
            };
            ensure!(part.node == node, "{node} hears {}'s part", part.node);
        }
        ensure!(
            info.num_pending == 0,
            "{node}: {} pending",
            info.num_pending
        );
    }
    Ok(())
}

/// The errors of the dead letter in which gpu-a's offload refused the event `id`, once there.
async fn offload_refusal(sh: &Stagehand, id: &str) -> anyhow::Result<Vec<String>> {
    let letter = wait_for(WAIT, &format!("the refusal of {id}"), || async {
        common::tenants::dead_letters(&sh.bus)
            .await
            .ok()?
            .into_iter()
            .find_map(|e| match e.body {
                Body::DeadLetter(d)
                    if d.original_id.as_ref().map(EventId::as_str) == Some(id)
                        && d.consumer == "promoter-offload-gpu-a" =>
                {
                    Some(d)
                }
                _ => None,
            })
    })
    .await?;
    Ok(letter.errors.into_iter().map(|a| a.error).collect())
}

/// A forged `checkpoint.part.committed` of project `lab` for node gpu-a.
fn forged(id: &str, tier: &str, prefix: &str, files: Vec<FileRef>) -> anyhow::Result<Event> {
    Ok(Event::request(
        EventId::new(id)?,
        PROJECT,
        Body::CheckpointPartCommitted(CheckpointPartCommitted {
            run: RUN.into(),
            step: 1,
            part: 0,
            parts: 1,
            node: NODES[0].into(),
            location: Location {
                tier: tier.into(),
                prefix: prefix.into(),
            },
            total_bytes: files.iter().map(|f| f.size).sum(),
            files,
            stamps: vec![],
            tags: vec![],
        }),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_naming_anything_but_its_own_folder_on_its_node_is_refused() -> anyhow::Result<()> {
    let mut sh = Stagehand::start(common::Options {
        promoter: true,
        ..Default::default()
    })
    .await?;
    let policies = sh.start_node_agent(NODES[0])?;
    sh.ready().await?;
    let local = local_root(&policies)?;
    // Files a lying commit points at, on the node and in another project's folder.
    let secret = b"not a checkpoint".to_vec();
    let file = FileRef::new(
        "key.bin",
        secret.len() as u64,
        stagehand_schemas::sha256_hex(&secret),
    );
    for dir in ["lab/secrets", "other/ckpt-llm/step-1/part-0"] {
        std::fs::create_dir_all(local.join(dir))?;
        std::fs::write(local.join(dir).join("key.bin"), &secret)?;
    }
    let attempts = [
        (
            "part-other-project",
            forged(
                "part-other-project",
                "local",
                "other/ckpt-llm/step-1/part-0",
                vec![file.clone()],
            )?,
            "outside",
        ),
        (
            "part-not-its-folder",
            forged(
                "part-not-its-folder",
                "local",
                "lab/secrets",
                vec![file.clone()],
            )?,
            "is not the part's folder",
        ),
        (
            "part-on-shared-tier",
            forged(
                "part-on-shared-tier",
                "hot",
                "lab/ckpt-llm/step-1/part-0",
                vec![file.clone()],
            )?,
            "is not a node-local tier",
        ),
    ];
    for (_, event, _) in &attempts {
        sh.bus.publish(event).await?;
    }
    for (id, _, why) in &attempts {
        let errors = offload_refusal(&sh, id).await?;
        ensure!(
            errors.iter().any(|e| e.contains(why)),
            "{id}: refused for {errors:?}, not {why:?}"
        );
    }
    // Nothing was copied anywhere off the node.
    let hot = sh.home.path().join("tiers/hot");
    for gone in ["lab/secrets", "other", "lab/ckpt-llm"] {
        ensure!(!hot.join(gone).exists(), "{gone} was copied onto hot");
    }
    // The CLI refuses a part that is not in its own folder before publishing anything.
    let elsewhere = local.join("lab/secrets");
    let out = stagehand(
        &sh.url,
        &[
            "checkpoint",
            "commit",
            "--project",
            PROJECT,
            "--run",
            RUN,
            "--step",
            "1",
            "--tier",
            "local",
            "--node",
            NODES[0],
            "--part",
            "0",
            "--parts",
            "1",
            "--policies",
            policies.to_str().context("utf-8")?,
            "--complete",
            elsewhere.to_str().context("utf-8")?,
        ],
    )?;
    ensure!(out.status.code() == Some(64), "{}", said(&out));
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("lab/ckpt-llm/step-1/part-0"),
        "{}",
        said(&out)
    );
    Ok(())
}

/// Rewrites each `key = ...` line of the policy file `file` in `dir` to `key = value`.
fn set_policy(dir: &Path, file: &str, key: &str, value: &str) -> anyhow::Result<()> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path)?;
    let text: Vec<String> = text
        .lines()
        .map(|l| match l.starts_with(&format!("{key} =")) {
            true => format!("{key} = {value}"),
            false => l.to_owned(),
        })
        .collect();
    std::fs::write(&path, text.join("\n") + "\n")?;
    Ok(())
}

/// Makes `dir` and everything beneath it writable again (a published set is read-only).
fn writable(dir: &Path) -> anyhow::Result<()> {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        match path.is_dir() {
            true => writable(&path)?,
            false => std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?,
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_leaves_its_node_only_once_its_agent_has_read_its_copy_back() -> anyhow::Result<()> {
    // The offload reads its copy back before the step counts (`read-back`), and still the
    // agent reads it back again before it removes the part: what it removes is proven now,
    // not by the catalogue's record of an offload once verified. A part no copy of which can
    // be proven stays on its node.
    let mut sh = Stagehand::start(common::Options {
        promoter: true,
        ..Default::default()
    })
    .await?;
    set_policy(&sh.policies, "retention.toml", "verify", "\"read-back\"")?;
    let (url, catalogue, policies) = step_one_offloaded_but_for_gpu_d(&mut sh).await?;
    // The catalogue says parts 0-2 are offloaded and verified; on hot, part 0's copy is gone
    // (lost, or never made: an offload stated by another) and a byte of part 1's has flipped.
    let hot_step = sh.home.path().join("tiers/hot/lab/ckpt-llm/step-1");
    writable(&hot_step)?;
    std::fs::remove_dir_all(hot_step.join("part-0"))?;
    let (name, bytes) = part_files(1, 1).swap_remove(0);
    let mut flipped = bytes.clone();
    flipped[7] ^= 0x01;
    std::fs::write(hot_step.join("part-1").join(&name), &flipped)?;
    // Part 2's copy went bad too, and so did its bytes on gpu-c: no copy of it is proven.
    let (name_2, bytes_2) = part_files(1, 2).swap_remove(0);
    let mut flipped_2 = bytes_2.clone();
    flipped_2[7] ^= 0x01;
    std::fs::write(hot_step.join("part-2").join(&name_2), &flipped_2)?;
    let on_gpu_c = part_dir(&policies[2], 1, 2)?.join(&name_2);
    std::fs::write(&on_gpu_c, &flipped_2)?;

    // The fourth node's agent offloads its part; the step is committed whole and parts 0, 1
    // and 3 leave their nodes — 0 and 1 only once copied again from their nodes.
    sh.start_node_agent(NODES[3])?;
    sh.ready().await?;
    listed_as(&url, &sh.policies, 1, "committed").await?;
    let left = vec![
        (0, NODES[0].to_owned()),
        (1, NODES[1].to_owned()),
        (3, NODES[3].to_owned()),
    ];
    wait_for(WAIT, "parts 0, 1 and 3 off their nodes", || async {
        (removed_parts(&catalogue, 1).await.ok()? == left).then_some(())
    })
    .await?;
    for part in [0, 1, 3] {
        for (name, bytes) in part_files(1, part) {
            let path = hot_step.join(format!("part-{part}")).join(&name);
            ensure!(std::fs::read(&path)? == bytes, "{} differs", path.display());
        }
    }
    // gpu-c's agent has handled the step's commit, and part 2, whose copy could not be made
    // whole, is still on its node, not recorded removed.
    let js = sh.bus.jetstream().clone();
    stagehand_testkit::wait_until(WAIT, "gpu-c's agent done with the step's commit", || {
        stagehand_testkit::drained(
            &js,
            stagehand_schemas::subject::FACTS.name,
            &["promoter-offload-gpu-c"],
        )
    })
    .await?;
    ensure!(removed_parts(&catalogue, 1).await? == left);
    ensure!(std::fs::read(&on_gpu_c)? == flipped_2, "part 2 left gpu-c");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_of_a_step_expired_while_its_agent_was_away_goes_as_the_step_did()
-> anyhow::Result<()> {
    // gpu-c's agent offloads its part and goes away before the step is committed whole; the
    // step is committed, its other parts leave their nodes, and retention expires it (its copy
    // on hot deleted) before gpu-c's agent is back. The agent then removes its part without
    // reading back a copy that is gone on purpose, and makes nothing again where the step no
    // longer is: the part goes as its step did.
    let mut sh = Stagehand::start(common::Options {
        promoter: true,
        ..Default::default()
    })
    .await?;
    let (url, catalogue, policies) = step_one_offloaded_but_for_gpu_d(&mut sh).await?;
    sh.stop_node_agent(NODES[2]).await?;
    sh.start_node_agent(NODES[3])?;
    sh.ready().await?;
    listed_as(&url, &sh.policies, 1, "committed").await?;
    let others = vec![
        (0, NODES[0].to_owned()),
        (1, NODES[1].to_owned()),
        (3, NODES[3].to_owned()),
    ];
    wait_for(WAIT, "parts 0, 1 and 3 off their nodes", || async {
        (removed_parts(&catalogue, 1).await.ok()? == others).then_some(())
    })
    .await?;
    // Retention expires the step, as the demoter does: its folder on hot goes, then the fact.
    let hot_step = sh.home.path().join("tiers/hot/lab/ckpt-llm/step-1");
    writable(&hot_step)?;
    std::fs::remove_dir_all(&hot_step)?;
    let expired = Event::request(
        EventId::new("test-step-1-expired")?,
        PROJECT,
        Body::CheckpointExpired(stagehand_schemas::CheckpointExpired {
            run: RUN.into(),
            step: 1,
            location: Location {
                tier: "hot".into(),
                prefix: "lab/ckpt-llm/step-1".into(),
            },
            rule: "keep_last".into(),
        }),
    );
    sh.bus.publish(&expired).await?;
    wait_for(WAIT, "step 1 expired in the catalogue", || async {
        let page = catalogue
            .checkpoints(PROJECT, RUN, Some(1), Some(0))
            .await
            .ok()?;
        page.items
            .first()
            .filter(|c| c.step == 1 && c.state == stagehand_catalogue::CheckpointState::Expired)
            .map(|_| ())
    })
    .await?;
    // gpu-c's agent is back: its part leaves the node, recorded, and hot holds nothing again.
    let on_gpu_c = part_dir(&policies[2], 1, 2)?;
    ensure!(
        on_gpu_c.exists(),
        "part 2 left gpu-c while its agent was away"
    );
    sh.start_node_agent(NODES[2])?;
    sh.ready().await?;
    let every: Vec<(u32, String)> = (0..NODES.len())
        .map(|part| (part as u32, NODES[part].to_owned()))
        .collect();
    wait_for(WAIT, "part 2 off gpu-c", || async {
        (removed_parts(&catalogue, 1).await.ok()? == every).then_some(())
    })
    .await?;
    ensure!(!on_gpu_c.exists(), "part 2 is still on gpu-c");
    ensure!(
        !hot_step.exists(),
        "the expired step's folder was made again on hot: {}",
        hot_step.display()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offload_waits_for_room_on_the_offload_tier_and_status_says_why() -> anyhow::Result<()> {
    // Hot, the offload tier, holds 16 KiB: a part of 20,003 bytes does not fit.
    let mut sh = Stagehand::start(common::Options {
        hot_capacity: Some("16 KiB".into()),
        promoter: true,
        ..Default::default()
    })
    .await?;
    set_policy(&sh.policies, "retention.toml", "deadline", "\"1s\"")?;
    let policies = sh.start_node_agent(NODES[0])?;
    sh.ready().await?;
    let url = sh.url.clone();
    write_and_commit_of(&url, NODES[0], &policies, (1, 0, 1))?;

    // Late, and `stagehand status` says why: the offload tier cannot fit the part.
    let finding = wait_for(WAIT, "status naming the full offload tier", || {
        let out = stagehand(
            &url,
            &[
                "status",
                "--policies",
                sh.policies.to_str().unwrap_or_default(),
                "--json",
            ],
        );
        async move {
            let report: Value = serde_json::from_slice(&out.ok()?.stdout).ok()?;
            report["findings"]
                .as_array()?
                .iter()
                .find(|f| f["subject"] == "lab/llm step 1")
                .filter(|f| {
                    f["detail"]
                        .as_str()
                        .is_some_and(|d| d.contains("offload tier hot cannot fit it"))
                })
                .cloned()
        }
    })
    .await?;
    ensure!(
        finding["detail"]
            .as_str()
            .is_some_and(|d| d.contains("part 0 on gpu-a") && d.contains("a part needs 20003")),
        "{finding}"
    );
    // Nothing copied, and the part still on its node.
    ensure!(
        !sh.home
            .path()
            .join("tiers/hot/lab/ckpt-llm/step-1")
            .exists()
    );
    ensure!(part_dir(&policies, 1, 0)?.join(".metadata").is_file());

    // Room made (the tier's capacity raised): the same commit, retried, is offloaded, the
    // step committed and the part leaves its node; no reservation is left behind.
    sh.stop_node_agent(NODES[0]).await?;
    set_policy(&policies, "tiers.toml", "capacity", "\"1 MiB\"")?;
    set_policy(&policies, "tiers.toml", "default", "\"1 MiB\"")?;
    sh.start_node_agent(NODES[0])?;
    sh.ready().await?;
    let whole = listed_as(&url, &sh.policies, 1, "committed").await?;
    ensure!(whole["tiers"] == serde_json::json!(["hot"]), "{whole}");
    wait_for(WAIT, "the part off its node", || {
        let gone = part_dir(&policies, 1, 0).is_ok_and(|d| !d.exists());
        async move { gone.then_some(()) }
    })
    .await?;
    let promoter = (sh.bus.jetstream())
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await?;
    let reserved = stagehand_bus::placement::reservations(&promoter, "hot", None)
        .await?
        .value
        .unwrap_or_default();
    ensure!(reserved.replicas.is_empty(), "{reserved:?}");
    Ok(())
}

/// The facts of `kind` stored for the project.
async fn facts(sh: &Stagehand, kind: &str) -> anyhow::Result<Vec<Event>> {
    // A checkpoint part's subject names its node before the project: any node.
    let node = if stagehand_schemas::subject::routed_by_node(kind) {
        ".*"
    } else {
        ""
    };
    let subject = format!("stagehand.fact.{kind}{node}.{PROJECT}");
    stagehand_testkit::stored_events(sh.bus.jetstream(), "STAGEHAND_FACTS", subject)
        .await
        .map_err(|e| anyhow::anyhow!("reading {kind}: {e}"))
}

/// The part's files as written, each with the SHA-256 of its bytes, in path order.
fn hashed_part(step: u64, part: usize) -> Vec<FileRef> {
    let mut files: Vec<FileRef> = part_files(step, part)
        .into_iter()
        .map(|(name, bytes)| {
            FileRef::new(
                name,
                bytes.len() as u64,
                stagehand_schemas::sha256_hex(&bytes),
            )
        })
        .collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    files
}

/// `checkpoint restore` of `step` onto the local tier of `node`, as job `job`: its output.
fn restore_onto_node(url: &str, step: u64, node: &str, job: &str) -> anyhow::Result<Output> {
    stagehand(
        url,
        &[
            "checkpoint",
            "restore",
            RUN,
            "--step",
            &step.to_string(),
            "--project",
            PROJECT,
            "--tier",
            "local",
            "--node",
            node,
            "--job",
            job,
            "--timeout",
            "60",
            "--json",
        ],
    )
}

/// Issue 17 item 2: a part's commit on node NVMe stamps its files and reads none of their
/// bytes; its node's agent hashes each file once, as it copies it, and states the SHA-256,
/// which the step's commit lists and a restore verifies. A file rewritten after the commit
/// and before the offload is refused, named, and the step never becomes the latest; a part
/// committed with hashes (a writer before stamps) is still offloaded against them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_is_stamped_at_commit_and_hashed_once_by_its_offload() -> anyhow::Result<()> {
    let mut sh = Stagehand::start(common::Options {
        promoter: true,
        ..Default::default()
    })
    .await?;
    let policies = sh.start_node_agent(NODES[0])?;
    sh.start_node_agent(NODES[1])?;
    sh.ready().await?;
    let url = sh.url.clone();

    // Step 1: committed by stamps, offloaded with the hashes the agent computed.
    write_and_commit_of(&url, NODES[0], &policies, (1, 0, 1))?;
    listed_as(&url, &sh.policies, 1, "committed").await?;
    let part_id = EventId::for_checkpoint_part(PROJECT, RUN, 1, 0);
    let commits = facts(&sh, "checkpoint.part.committed").await?;
    let Some(Body::CheckpointPartCommitted(commit)) =
        commits.iter().find(|e| e.id == part_id).map(|e| &e.body)
    else {
        anyhow::bail!("no stored commit of part 0 of step 1: {commits:#?}");
    };
    let written = hashed_part(1, 0);
    ensure!(
        commit.files.is_empty(),
        "the commit carries hashes: {commit:?}"
    );
    let stamped: Vec<(&str, u64)> = commit
        .stamps
        .iter()
        .map(|s| (s.path.as_str(), s.size))
        .collect();
    let expected: Vec<(&str, u64)> = written.iter().map(|f| (f.path.as_str(), f.size)).collect();
    ensure!(stamped == expected, "{commit:?}");
    let offloads = facts(&sh, "checkpoint.part.offloaded").await?;
    let Some(Body::CheckpointPartOffloaded(offload)) = offloads
        .iter()
        .find(|e| e.causation_id.as_ref() == Some(&part_id))
        .map(|e| &e.body)
    else {
        anyhow::bail!("no stored offload of part 0 of step 1: {offloads:#?}");
    };
    ensure!(offload.hashed == written, "{offload:?}");
    let step_id = EventId::for_checkpoint(PROJECT, RUN, 1);
    let steps = facts(&sh, "checkpoint.committed").await?;
    let Some(Body::CheckpointCommitted(step)) =
        steps.iter().find(|e| e.id == step_id).map(|e| &e.body)
    else {
        anyhow::bail!("no stored commit of step 1: {steps:#?}");
    };
    let listed: Vec<FileRef> = written
        .iter()
        .map(|f| FileRef::new(format!("part-0/{}", f.path), f.size, f.sha256.clone()))
        .collect();
    ensure!(step.files == listed, "{step:?}");

    // A restore onto another node's NVMe copies from hot and verifies every file against
    // those hashes: byte-exact.
    let out = restore_onto_node(&url, 1, NODES[1], "resume-b")?;
    ensure!(out.status.success(), "{}", said(&out));
    let answer: Value = serde_json::from_slice(&out.stdout).with_context(|| said(&out))?;
    let restored = PathBuf::from(answer["path"].as_str().with_context(|| said(&out))?);
    for (name, bytes) in part_files(1, 0) {
        let path = restored.join("part-0").join(&name);
        let found = std::fs::read(&path).with_context(|| path.display().to_string())?;
        ensure!(found == bytes, "{} differs", path.display());
    }

    // Step 2: committed with the agent away, then a file rewritten (same size) before the
    // agent is back: refused, the file named, nothing offloaded, step 1 still the latest.
    sh.stop_node_agent(NODES[0]).await?;
    write_and_commit_of(&url, NODES[0], &policies, (2, 0, 1))?;
    let rewritten = part_dir(&policies, 2, 0)?.join("__0_0.distcp");
    let mut bytes = std::fs::read(&rewritten)?;
    bytes[7] ^= 0xff;
    std::fs::write(&rewritten, &bytes)?;
    sh.start_node_agent(NODES[0])?;
    sh.ready().await?;
    let refused_id = EventId::for_checkpoint_part(PROJECT, RUN, 2, 0);
    let errors = offload_refusal(&sh, refused_id.as_str()).await?;
    ensure!(
        errors.iter().any(|e| e.contains("__0_0.distcp")
            && e.contains("since the part was committed")
            && e.contains("not offloaded")),
        "refused for {errors:?}"
    );
    let hot = sh.home.path().join("tiers/hot/lab/ckpt-llm");
    ensure!(
        !hot.join("step-2").exists(),
        "the rewritten part reached hot"
    );
    let listed = list(&url, &sh.policies)?;
    ensure!(
        step_of(&listed, 2).is_some_and(|c| c["state"] == "at_risk"),
        "{listed:#?}"
    );
    let latest = restore_latest(&url, &sh.policies)?;
    ensure!(
        latest.ends_with("lab/ckpt-llm/step-1"),
        "{}",
        latest.display()
    );
    ensure!(rewritten.is_file(), "the refused part left its node");

    // Step 3: a part committed with its hashes, as a writer before stamps did: offloaded
    // against them, and the step committed whole.
    let dir = part_dir(&policies, 3, 0)?;
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in part_files(3, 0) {
        std::fs::write(dir.join(name), bytes)?;
    }
    let mut old = forged(
        EventId::for_checkpoint_part(PROJECT, RUN, 3, 0).as_str(),
        "local",
        &stagehand_schemas::layout::checkpoint_part_folder(
            PROJECT,
            &stagehand_catalogue::checkpoint_dataset(RUN),
            3,
            0,
        ),
        hashed_part(3, 0),
    )?;
    if let Body::CheckpointPartCommitted(p) = &mut old.body {
        p.step = 3;
    }
    sh.bus.publish(&old).await?;
    listed_as(&url, &sh.policies, 3, "committed").await?;
    let latest = restore_latest(&url, &sh.policies)?;
    ensure!(
        latest.ends_with("lab/ckpt-llm/step-3"),
        "{}",
        latest.display()
    );
    for (name, bytes) in part_files(3, 0) {
        let found = std::fs::read(latest.join("part-0").join(&name))?;
        ensure!(found == bytes, "{name} of step 3 differs");
    }
    Ok(())
}
