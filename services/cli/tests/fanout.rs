//! Node agents staging one version onto their nodes' `local` tiers fetch pieces from each
//! other as well as from the shared hot tier (issue 17 item 1). Each agent is a real
//! `stagehand-promoter` process in a network namespace of its own, with an address of its own,
//! on a real nats-server; recorder, validator and shared promoter run in-process
//! (`common::fanout::Fleet`). Needs root (network namespaces) and `cargo build -p
//! stagehand-promoter`.
//!
//! - eight nodes at once: every replica byte-exact, the shared tier read about once in all;
//! - an agent SIGKILLed mid-fan-out, after it announced a piece: the others still finish;
//! - a node whose replica rotted serves bad bytes: it is dropped, everyone ends byte-exact.

mod common;

use anyhow::{Context, ensure};
use common::WAIT;
use common::fanout::{Fleet, flip_a_byte_of_each_file, is_bad_of, is_have_of, write_version};
use stagehand_testkit::wait_for;

const DATASET: &str = "weights";
const SHARED: &str = r#"source="shared""#;
const PEER: &str = r#"source="peer""#;
const MIB: usize = 1 << 20;

/// Many small files, two of 5 MiB and one of 20 MiB, about 49 MiB: eight pieces of the
/// fan-out's (three runs of small files up to 8 MiB, a 5 MiB file alone twice, and the
/// 20 MiB file in three slices by the piece hashes the validator stored), so that eight agents
/// share them out.
fn version(root: &std::path::Path) -> anyhow::Result<u64> {
    write_version(root, 400, 48 * 1024, &[5 * MIB, 5 * MIB, 20 * MIB])
}

/// The pieces the version is cut into ([`version`]): the 20 MiB file as one piece instead of
/// three would make six.
const PIECES: usize = 8;

/// Agents in namespaces reach NATS across the bridge, answer `/readyz` and serve `/metrics` on
/// their own addresses, and stage onto their own local tiers (no `[service.fanout]`: each
/// copies from the shared tier alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_in_namespaces_stage_onto_their_own_local_tiers() -> anyhow::Result<()> {
    let mut fleet = Fleet::start(2, false).await?;
    fleet.start_agents(0..2).await?;
    let source = tempfile::tempdir()?;
    write_version(source.path(), 8, 4096, &[MIB])?;
    let digest = fleet.ingest_to_hot(source.path(), DATASET).await?;
    fleet.stage_everywhere(DATASET, &digest).await?;
    for i in 0..fleet.len() {
        fleet.assert_byte_exact(i, DATASET, &digest, source.path())?;
        let scrape = fleet.agent(i).scrape()?;
        ensure!(scrape.contains("stagehand_"), "{}", fleet.agent(i).node);
    }
    Ok(())
}

/// (a) Eight nodes stage one version at once: each replica is byte-exact, the agents together
/// read at most 1.25 × the version from the shared tier, and some bytes came from peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_nodes_read_the_shared_tier_about_once() -> anyhow::Result<()> {
    let mut fleet = Fleet::start(8, true).await?;
    fleet.start_agents(0..8).await?;
    let source = tempfile::tempdir()?;
    let bytes = version(source.path())?;
    let digest = fleet.ingest_to_hot(source.path(), DATASET).await?;
    fleet.stage_everywhere(DATASET, &digest).await?;
    for i in 0..fleet.len() {
        fleet.assert_byte_exact(i, DATASET, &digest, source.path())?;
    }
    let shared = fleet.sum_counter("stagehand_fanout_bytes_total", SHARED)?;
    let peer = fleet.sum_counter("stagehand_fanout_bytes_total", PEER)?;
    eprintln!(
        "version {bytes} B; read from the shared tier {shared} B ({:.2}×), from peers {peer} B",
        shared / bytes as f64
    );
    // Only the shared tier held the version at first: all of it was read there at least once.
    ensure!(
        shared >= bytes as f64,
        "the agents counted {shared} B read from the shared tier of a {bytes} B version"
    );
    ensure!(
        shared <= 1.25 * bytes as f64,
        "the agents read {shared} B of a {bytes} B version from the shared tier"
    );
    ensure!(peer > 0.0, "no agent fetched a byte from a peer");
    // Every node holds every piece: the large file's slices among them, so the validator's
    // side data reached the agents.
    for i in 0..fleet.len() {
        let node = Fleet::node(i);
        let held = fleet.swarm_keys(|k| is_have_of(k, &node)).await?.len();
        ensure!(
            held == PIECES,
            "{node} announced {held} pieces, not {PIECES}"
        );
    }
    Ok(())
}

/// (b) One agent is SIGKILLed mid-fan-out, after it announced a piece and before the others
/// are all ready: the others all become ready, byte-exact (what it claimed and never
/// announced is read from the shared tier after `claim_patience`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_others_finish_when_an_agent_dies_mid_fan_out() -> anyhow::Result<()> {
    const VICTIM: usize = 1;
    let mut fleet = Fleet::start(4, true).await?;
    // Serving is slowed to 200 Mbit/s per node, so the fan-out lasts long enough to kill an
    // agent in the middle of it.
    for i in 0..fleet.len() {
        fleet.net.limit_egress(i, "200mbit")?;
    }
    fleet.start_agents(0..4).await?;
    let source = tempfile::tempdir()?;
    version(source.path())?;
    let digest = fleet.ingest_to_hot(source.path(), DATASET).await?;
    let mut stages = Vec::new();
    for i in 0..fleet.len() {
        stages.push(fleet.request_local(DATASET, &digest, i).await?);
    }
    let victim = Fleet::node(VICTIM);
    let announced = wait_for(WAIT, "the victim announces a piece", || async {
        let keys = fleet.swarm_keys(|k| is_have_of(k, &victim)).await.ok()?;
        keys.into_iter().next()
    })
    .await?;
    let mut ready = 0;
    for (i, stage) in stages.iter().enumerate() {
        if i != VICTIM && fleet.is_ready(stage).await? {
            ready += 1;
        }
    }
    fleet.agent_mut(VICTIM).kill();
    eprintln!(
        "{victim} killed after announcing {announced}; {ready} of {} others ready",
        fleet.len() - 1
    );
    ensure!(
        ready < fleet.len() - 1,
        "every other node was ready before {victim} was killed (it announced {announced}): \
         the fan-out ended too soon for this test"
    );
    for (i, stage) in stages.iter().enumerate() {
        if i != VICTIM {
            fleet
                .wait_ready(stage)
                .await
                .with_context(|| fleet.agent(i).log())?;
            fleet.assert_byte_exact(i, DATASET, &digest, source.path())?;
        }
    }
    Ok(())
}

/// (c) One node stages the version alone; then a byte of every file of its published replica
/// is flipped, so it serves bad bytes. The others stage: each ends byte-exact, the bad node's
/// `bad` key is written, and some agent counts a dropped peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_serving_bad_bytes_is_dropped_and_everyone_ends_byte_exact() -> anyhow::Result<()> {
    const BAD: usize = 0;
    let mut fleet = Fleet::start(4, true).await?;
    fleet.start_agents(0..4).await?;
    let source = tempfile::tempdir()?;
    version(source.path())?;
    let digest = fleet.ingest_to_hot(source.path(), DATASET).await?;
    let first = fleet.request_local(DATASET, &digest, BAD).await?;
    fleet.wait_ready(&first).await?;
    fleet.assert_byte_exact(BAD, DATASET, &digest, source.path())?;
    let bad = Fleet::node(BAD);
    let flipped = flip_a_byte_of_each_file(&fleet.replica(BAD, DATASET, &digest))?;
    ensure!(
        fleet
            .assert_byte_exact(BAD, DATASET, &digest, source.path())
            .is_err(),
        "flipping a byte of {flipped} files left {bad}'s replica intact"
    );
    let mut stages = Vec::new();
    for i in (0..fleet.len()).filter(|i| *i != BAD) {
        stages.push((i, fleet.request_local(DATASET, &digest, i).await?));
    }
    for (i, stage) in &stages {
        fleet.wait_ready(stage).await?;
        fleet.assert_byte_exact(*i, DATASET, &digest, source.path())?;
    }
    let marked = fleet.swarm_keys(|k| is_bad_of(k, &bad)).await?;
    ensure!(
        !marked.is_empty(),
        "no swarm.<swarm>.bad.{bad} key was written"
    );
    let dropped = fleet.sum_counter("stagehand_fanout_peers_dropped_total", "")?;
    ensure!(dropped > 0.0, "no agent counted a dropped peer");
    Ok(())
}
