//! The promoter runs as its own NATS user of `deploy/nats/accounts.conf`, which may not
//! provision: every subject, consumer, bucket and query it uses is granted (the operator
//! provisioned the streams and the promoter's bucket first, as `stagehand provision` does).
//! A right it lacks shows here as an answer that never comes, a progress report that never
//! arrives or a delivery that is never acked.

mod common;

use common::*;
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore};
use stagehand_schemas::{Body, progress::WorkProgress, subject};
use stagehand_testkit::{wait_for, wait_until};

/// As the `promoter` user (and a node agent as its node's user, `node-n1`): a request waits visibly for
/// validation (`stage.pending`, its ingests consumer), is copied from a manifest read out of
/// the services' Object Store bucket with progress on core NATS, answered with
/// `replica.created` and `stage.ready`; a node's `local` request is filled from hot by its
/// agent's own consumer; an unknown dataset fails with a reason (a catalogue query); a release
/// is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_promoter_stages_as_its_own_restricted_user() {
    let mut stack = Stack::start_with(Options {
        accounts: true,
        node_users: &["n1"],
        ..Options::default()
    })
    .await;
    let mut shared = stack.promoter_config("a");
    // A copy long enough for progress reports: 1 MiB at 512 KiB/s with one second of burst
    // takes about a second, several report periods.
    shared.service.mover.bytes_per_second = Some(512 << 10);
    stack.run_promoter(shared);
    stack.run_promoter(stack.node_agent_config("n1"));
    let js = stack.bus.jetstream().clone();

    let files: Vec<(String, Vec<u8>)> = (0..8u8)
        .map(|i| (format!("x/{i}.bin"), bytes(40 + i, 128 << 10)))
        .collect();
    let borrowed: Vec<(&str, Vec<u8>)> =
        files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
    let (prefix, refs) = stack.put_files("capacity", "perm", "v1", &borrowed);
    let version = stagehand_schemas::version_digest(&refs);
    // The validator's copy of the manifest in the services' bucket (put as the operator).
    let store = ManifestStore::catalogue(&js, BucketOptions::default())
        .await
        .unwrap();
    store
        .put(&Manifest::from_entries(refs.clone()))
        .await
        .unwrap();
    stack
        .ingest_requested("perm", "capacity", &prefix, &refs)
        .await;
    settled(&js, "a").await;

    let request = stage_request("perm", &version[..12], "hot", "job-perm", None, None);
    let progress = stagehand_schemas::progress::progress_subject(
        "stage.requested",
        None,
        PROJECT,
        &request.id,
    );
    let mut reports = stack.bus.client().subscribe(progress).await.unwrap();
    stack.publish(&request).await;
    wait_until(WAIT, "the request to wait for validation", || async {
        answers(&js, "stage.pending", &request.id)
            .await
            .iter()
            .any(|e| matches!(&e.body, Body::StagePending(p) if p.waiting_for == "validation"))
    })
    .await
    .unwrap();
    stack.validated("perm", "capacity", &prefix, &refs).await;
    let report = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut reports))
        .await
        .expect("a progress report as the promoter user")
        .unwrap();
    let report = WorkProgress::decode(&report.payload).unwrap();
    assert_eq!(
        (report.files_total, report.bytes_total),
        (8, 8 * (128 << 10))
    );
    let ready = wait_for(WAIT, "stage.ready as the promoter user", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap();
    let path = stack.tier("hot").join(format!("{PROJECT}/perm/{version}"));
    assert_eq!(ready_path(&ready), path.display().to_string());
    assert_eq!(std::fs::read(path.join("x/0.bin")).unwrap(), files[0].1);
    assert_eq!(facts(&js, "replica.created").await.len(), 1);

    let local = stage_request("perm", &version, "local", "job-perm", Some("n1"), None);
    stack.publish(&local).await;
    let ready = wait_for(WAIT, "local ready on n1 as n1's user", || async {
        answers(&js, "stage.ready", &local.id).await.pop()
    })
    .await
    .unwrap();
    let path = stack
        .tier("local-n1")
        .join(format!("{PROJECT}/perm/{version}"));
    assert_eq!(ready_path(&ready), path.display().to_string());
    assert_eq!(std::fs::read(path.join("x/7.bin")).unwrap(), files[7].1);

    let unknown = stage_request("nope", "0123456789abcdef", "hot", "job-u", None, None);
    stack.publish(&unknown).await;
    let failed = wait_for(WAIT, "an unknown dataset failed", || async {
        answers(&js, "stage.failed", &unknown.id).await.pop()
    })
    .await
    .unwrap();
    assert!(
        failed_reason(&failed)
            .0
            .contains("unknown dataset \"nope\""),
        "{failed:?}"
    );

    stack
        .publish(&stage_release("perm", &version[..12], "hot", "job-perm"))
        .await;
    wait_until(WAIT, "every request handled and acked", || async {
        drained(
            &js,
            subject::REQUESTS.name,
            &["promoter", "promoter-node-n1"],
        )
        .await
    })
    .await
    .unwrap();
    stack.stop().await;
}

/// What a node's user is refused, the server's word on each (a compromised node's credentials
/// used by hand): no fact on another node's subject or a shared tier's, no record of another
/// node in the promoter's bucket, no consumer but its own. What it may do, it can: its own
/// node's fact is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nodes_user_states_nothing_about_another_node_or_a_shared_tier() {
    use stagehand_testkit::{node_inbox_prefix, node_role, node_user, role_password};
    let stack = Stack::start_with(Options {
        accounts: true,
        node_users: &["n1", "n2"],
        ..Options::default()
    })
    .await;
    let n1 = async_nats::ConnectOptions::with_user_and_password(
        node_user("n1"),
        role_password(&node_role("n1")),
    )
    .custom_inbox_prefix(node_inbox_prefix("n1"))
    .connect(stack.nats.url())
    .await
    .unwrap();
    let refused = [
        // Another node's answer and copy, and a shared tier's copy (what would let the last
        // hot copy be removed) and answer.
        "stagehand.fact.stage.ready.n2.demo".to_owned(),
        "stagehand.fact.replica.created.n2.demo".to_owned(),
        "stagehand.fact.replica.created.demo".to_owned(),
        "stagehand.fact.stage.ready.demo".to_owned(),
        // Kinds no node states, on its own node's subject too.
        "stagehand.fact.replica.unreachable.n1.demo".to_owned(),
        "stagehand.fact.checkpoint.committed.demo".to_owned(),
        // Its demoter's kinds, on another node's subject or a shared tier's.
        "stagehand.fact.replica.removed.n2.demo".to_owned(),
        "stagehand.fact.replica.removed.demo".to_owned(),
        "stagehand.fact.replica.verified.demo".to_owned(),
        // Another node's records, and the shared tiers' use records.
        "$KV.stagehand_promoter.node.n2".to_owned(),
        "$KV.stagehand_promoter.quota.local.n2".to_owned(),
        "$KV.stagehand_promoter.replica.hot.00".to_owned(),
        // Another consumer's deliveries, acked or pulled.
        "$JS.ACK.STAGEHAND_REQUESTS.promoter.1.1.1.1.1.1".to_owned(),
        "$JS.API.CONSUMER.MSG.NEXT.STAGEHAND_REQUESTS.promoter-node-n2".to_owned(),
        "$JS.API.CONSUMER.CREATE.STAGEHAND_REQUESTS.promoter".to_owned(),
        // … the shared demoter's or another node's demoter's, and their scrub claims and
        // heartbeats.
        "$JS.API.CONSUMER.CREATE.STAGEHAND_FACTS.demoter".to_owned(),
        "$JS.API.CONSUMER.MSG.NEXT.STAGEHAND_REQUESTS.demoter-node-n2".to_owned(),
        "$JS.ACK.STAGEHAND_FACTS.demoter.1.1.1.1.1.1".to_owned(),
        "$KV.stagehand_claims.demoter.scrub.demo.scrub.00".to_owned(),
        "$KV.stagehand_claims.demoter-node-n2.scrub.demo.scrub.00".to_owned(),
        "$KV.stagehand_heartbeats.demoter.node-n2".to_owned(),
        // Readiness: its node's keys are read, never written; another node's not even read.
        "$KV.stagehand_readiness.demo.d.v.local.n1".to_owned(),
        "$JS.API.DIRECT.GET.KV_stagehand_readiness.$KV.stagehand_readiness.demo.d.v.local.n2"
            .to_owned(),
        // … nor watched (a consumer over every key, or another node's), nor anyone's
        // consumer on that bucket deleted.
        "$JS.API.CONSUMER.CREATE.KV_stagehand_readiness".to_owned(),
        "$JS.API.CONSUMER.CREATE.KV_stagehand_readiness.w.$KV.stagehand_readiness.demo.d.v.local.n2"
            .to_owned(),
        "$JS.API.CONSUMER.DELETE.KV_stagehand_readiness.w".to_owned(),
        // Copying progress on another node's stage, or a shared tier's.
        "stagehand.progress.stage.requested.n2.demo.00".to_owned(),
        "stagehand.progress.stage.requested.demo.00".to_owned(),
        // The fan-out board: pieces announced, or a peer reported, in another node's name.
        "$KV.stagehand_swarms.swarm.s.have.0.n2".to_owned(),
        "$KV.stagehand_swarms.swarm.s.bad.n2.n3".to_owned(),
    ];
    for subject in &refused {
        n1.publish(subject.clone(), "forged".into()).await.unwrap();
    }
    // … while its own word there, and a claim (anyone's to take over), are its to write.
    for subject in [
        "$KV.stagehand_swarms.swarm.s.have.0.n1",
        "$KV.stagehand_swarms.swarm.s.bad.n2.n1",
        "$KV.stagehand_swarms.swarm.s.claim.0",
        "stagehand.progress.stage.requested.n1.demo.00",
        // Its demoter's scrub claims, heartbeat, and watch of its node's readiness.
        "$KV.stagehand_claims.demoter-node-n1.scrub.demo.scrub.00",
        "$KV.stagehand_heartbeats.demoter.node-n1",
        "$JS.API.CONSUMER.CREATE.KV_stagehand_readiness.w.$KV.stagehand_readiness.demo.d.v.local.n1",
    ] {
        n1.publish(subject, "its own".into()).await.unwrap();
    }
    // Its own node's fact, after them on the same connection: once it is stored, the server
    // has dealt with every publish before it.
    let own = "stagehand.fact.stage.ready.n1.demo";
    let ack = async_nats::jetstream::new(n1.clone())
        .publish(own, "own".into())
        .await
        .unwrap();
    ack.await.expect("its own node's subject is its to publish");
    let log_path = stack.nats.log_path();
    let violations = wait_for(WAIT, "the server's word on every refused publish", || {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let refused = refused.clone();
        async move {
            let lines: Vec<String> = (log.lines())
                .filter(|l| l.contains("user:node-n1") && l.contains("Publish Violation"))
                .map(str::to_owned)
                .collect();
            refused
                .iter()
                .all(|s| lines.iter().any(|l| l.contains(&format!("\"{s}\""))))
                .then_some(lines)
        }
    })
    .await
    .unwrap();
    assert_eq!(violations.len(), refused.len(), "{violations:#?}");
    assert!(
        !violations.iter().any(|l| l.contains(own)),
        "{violations:#?}"
    );
    // Nothing forged was stored: the facts stream holds its own fact alone.
    let js = stack.bus.jetstream().clone();
    let stored: Vec<String> = stagehand_testkit::stored_messages(&js, subject::FACTS.name, "")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.subject)
        .collect();
    assert_eq!(stored, vec![own.to_owned()]);
    stack.stop().await;
}
