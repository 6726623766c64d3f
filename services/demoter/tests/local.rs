//! A node's demoter (`node = "<name>"` in `[service]`) on the `local` tier, where two nodes'
//! replicas are in the catalogue, connected as its node's own NATS user: it removes its own
//! node's replicas that a shared tier still holds (readiness withdrawn per node, facts carrying
//! the node), keeps the one no shared tier holds (it copies nothing down: its user states
//! nothing about a shared tier), and touches nothing of the other node's, although both
//! nodes' folders lie under the one root here.

mod common;

use common::*;
use stagehand_schemas::Body;
use stagehand_testkit::wait_until;

const MINE: &str = "n1";
const OTHER: &str = "n2";

/// Places an idle version on `node`'s local tier: staged, then released `released` minutes
/// ago. `shared`: a verified copy is on the capacity tier too; else its only other copy (on the
/// source tier, which its lab deleted) is gone, and the node's is the last one.
async fn idle_on_local(
    stack: &Stack,
    (dataset, seed): (&str, u8),
    node: &str,
    shared: bool,
    released: i64,
) -> Placed {
    let p = stack
        .place_on("local", Some(node), dataset, seed, 3, 128 * 1024, shared)
        .await;
    stack
        .stage_on(&p, "job", "local", Some(node), ago(released + 100))
        .await;
    stack
        .release_on(&p, "job", "local", Some(node), ago(released))
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

/// Guards "per local tier" and "a node's user states nothing about a shared tier": node n1's
/// demoter, connected as `node-n1`, removes n1's idle replica that capacity holds too
/// (`replica.removed` with node n1, n1's readiness withdrawn), keeps n1's idle replica that no
/// shared tier holds (nothing copied down, nothing stated on capacity), leaves n2's two idle
/// replicas whole, ready and unannounced, and is refused nothing by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nodes_demoter_demotes_only_its_own_nodes_replicas_that_a_shared_tier_holds() {
    // One step at a time, the least recently used first: a demoter that took the last copy
    // would carry it first, and its copy down (or the refusal of its fact about capacity)
    // would stop the pass before the other replica's removal, which the test waits for.
    let stack = Stack::start(Options {
        idle_after: "1h",
        nodes: &[MINE, OTHER],
        max_concurrent: 1,
        ..Options::default()
    })
    .await;
    let last = idle_on_local(&stack, ("mine-last", 2), MINE, false, 300).await;
    let shared = idle_on_local(&stack, ("mine-shared", 1), MINE, true, 200).await;
    let other = [
        idle_on_local(&stack, ("other-a", 3), OTHER, true, 400).await,
        idle_on_local(&stack, ("other-b", 4), OTHER, false, 400).await,
    ];
    let bucket = stack.readiness().await;
    let everything = [
        (&shared, MINE),
        (&last, MINE),
        (&other[0], OTHER),
        (&other[1], OTHER),
    ];
    wait_until(WAIT, "every local replica recorded ready", || async {
        let mut all = true;
        for (p, node) in everything {
            all &= is_ready(&bucket, &key_on(p, "local", Some(node))).await;
        }
        all
    })
    .await
    .unwrap();
    for (p, _) in everything {
        stack.recorded_requests(p, 1, 1).await;
    }

    let config = stack.node_demoter_config(MINE);
    let token = stack.shutdown.child_token();
    let demoter = tokio::spawn(stagehand_demoter::run(config, token.clone()));
    // What the server refused n1's user, which a wait below that times out names.
    let refused = || {
        let log = std::fs::read_to_string(stack.nats.log_path()).unwrap();
        (log.lines())
            .filter(|l| l.contains(&format!("user:{}", stagehand_testkit::node_user(MINE))))
            .filter(|l| l.contains(" Violation - "))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };

    wait_until(
        WAIT,
        "n1's replica that capacity holds removed from the local tier",
        || async {
            !removed_from_local(&stack).await.is_empty()
                && list(
                    &stack
                        .tier("local")
                        .join(format!("{PROJECT}/{}", shared.dataset)),
                )
                .is_empty()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; refused to n1's user: {:#?}", refused()));
    // The pass that removed it chose among all of n1's idle replicas at once (every one was
    // recorded before the demoter started), and would have carried the last copy's step first.
    assert_eq!(
        removed_from_local(&stack).await,
        vec![(shared.version.clone(), Some(MINE.to_owned()))]
    );
    assert!(!is_ready(&bucket, &key_on(&shared, "local", Some(MINE))).await);
    // The last copy stays, ready, and was not copied down.
    assert!(whole_on(&stack, "local", &last), "{}", last.dataset);
    assert!(is_ready(&bucket, &key_on(&last, "local", Some(MINE))).await);
    assert!(!whole_on(&stack, "capacity", &last), "{}", last.dataset);
    for p in &other {
        assert!(whole_on(&stack, "local", p), "{}", p.dataset);
        assert!(is_ready(&bucket, &key_on(p, "local", Some(OTHER))).await);
    }
    // Nothing was stated about the shared tiers.
    let created_on_shared = replica_facts(stack.bus.jetstream())
        .await
        .into_iter()
        .filter(|(k, t, _, _)| k == "created" && t != "local")
        .count();
    assert_eq!(created_on_shared, 0);
    // The node's user was enough for all of it: the server refused its demoter nothing.
    assert_eq!(refused(), Vec::<String>::new());

    token.cancel();
    demoter.await.unwrap().unwrap();
    stack.stop().await;
}
