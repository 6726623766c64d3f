//! A node's demoter (`node = "<name>"` in `[service]`) on the `local` tier, where two nodes'
//! replicas are in the catalogue: it demotes its own node's replicas by the shared demoter's
//! rules (copied down first when no durable copy exists, readiness withdrawn per node, facts
//! carrying the node) and touches nothing of the other node's, although both nodes' folders
//! lie under the one root here.

mod common;

use common::*;
use stagehand_schemas::Body;
use stagehand_testkit::wait_until;

const MINE: &str = "n1";
const OTHER: &str = "n2";

/// Places an idle version (staged and released long ago) on `node`'s local tier, its only
/// verified copy there.
async fn idle_on_local(stack: &Stack, dataset: &str, seed: u8, node: &str) -> Placed {
    let p = stack
        .place_on("local", Some(node), dataset, seed, 3, 128 * 1024, false)
        .await;
    stack
        .stage_on(&p, "job", "local", Some(node), ago(300))
        .await;
    stack
        .release_on(&p, "job", "local", Some(node), ago(200))
        .await;
    p
}

/// `replica.removed` facts on the local tier, each as (version, node).
async fn removed_from_local(stack: &Stack) -> Vec<(String, Option<String>)> {
    facts(stack.bus.jetstream(), "replica.removed")
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            Body::ReplicaRemoved(r) if r.location.tier == "local" => Some((r.version, r.node)),
            _ => None,
        })
        .collect()
}

/// Guards "per local tier": node n1's demoter removes n1's two idle replicas from the local
/// tier (each copied down to capacity and verified first, `replica.removed` with node n1, n1's
/// readiness withdrawn) and leaves n2's two idle replicas whole, ready and unannounced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nodes_demoter_demotes_only_its_own_nodes_local_replicas() {
    // Under deploy/nats/accounts.conf: the node's demoter connects as the `demoter` user and
    // creates its own consumers (demoter-node-n1) with that user's rights.
    let stack = Stack::start(Options {
        idle_after: "1h",
        accounts: true,
        ..Options::default()
    })
    .await;
    let mine = [
        idle_on_local(&stack, "mine-a", 1, MINE).await,
        idle_on_local(&stack, "mine-b", 2, MINE).await,
    ];
    let other = [
        idle_on_local(&stack, "other-a", 3, OTHER).await,
        idle_on_local(&stack, "other-b", 4, OTHER).await,
    ];
    let bucket = stack.readiness().await;
    wait_until(WAIT, "every local replica recorded ready", || async {
        let mut all = true;
        for (p, node) in mine
            .iter()
            .map(|p| (p, MINE))
            .chain(other.iter().map(|p| (p, OTHER)))
        {
            all &= is_ready(&bucket, &key_on(p, "local", Some(node))).await;
        }
        all
    })
    .await
    .unwrap();
    for p in mine.iter().chain(&other) {
        stack.recorded_requests(p, 1, 1).await;
    }

    let mut config = stack.demoter_config();
    config.service.node = Some(MINE.into());
    let token = stack.shutdown.child_token();
    let demoter = tokio::spawn(stagehand_demoter::run(config, token.clone()));

    wait_until(
        WAIT,
        "n1's replicas removed from the local tier",
        || async {
            removed_from_local(&stack).await.len() == 2
                && mine.iter().all(|p| {
                    list(&stack.tier("local").join(format!("{PROJECT}/{}", p.dataset))).is_empty()
                })
        },
    )
    .await
    .unwrap();
    let mut removed = removed_from_local(&stack).await;
    removed.sort();
    let mut expected: Vec<(String, Option<String>)> = mine
        .iter()
        .map(|p| (p.version.clone(), Some(MINE.to_owned())))
        .collect();
    expected.sort();
    assert_eq!(removed, expected);
    for p in &mine {
        assert!(whole_on(&stack, "capacity", p), "{}", p.dataset);
        assert!(!is_ready(&bucket, &key_on(p, "local", Some(MINE))).await);
    }
    for p in &other {
        assert!(whole_on(&stack, "local", p), "{}", p.dataset);
        assert!(!whole_on(&stack, "capacity", p), "{}", p.dataset);
        assert!(is_ready(&bucket, &key_on(p, "local", Some(OTHER))).await);
    }
    // Nothing was copied to or removed from the shared tiers on n2's behalf either.
    let created_on_capacity = replica_facts(stack.bus.jetstream())
        .await
        .into_iter()
        .filter(|(k, t, _, _)| k == "created" && t == "capacity")
        .count();
    assert_eq!(created_on_capacity, 2);

    token.cancel();
    demoter.await.unwrap().unwrap();
    stack.stop().await;
}
