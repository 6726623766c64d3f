//! The copy down to an S3 capacity tier (SeaweedFS) by the real demoter binary: the mover's
//! set copy to S3 (per-object checksums, the completion marker last), announced before the
//! hot copy goes.

mod common;

use common::*;
use stagehand_testkit::wait_until;

/// Guards the copy down to an S3 capacity tier (SeaweedFS): the replica whose only verified
/// copy is on hot lands on S3 whole, with its completion marker, before it leaves hot.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_last_copy_is_copied_down_to_an_s3_capacity_tier_before_it_leaves_hot() {
    let s3 = tokio::task::spawn_blocking(stagehand_testkit::S3Server::shared)
        .await
        .unwrap();
    let bucket = s3.unique_bucket("demote");
    let stack = Stack::start(Options {
        idle_after: "1h",
        s3_capacity: Some((s3.endpoint(), bucket.clone())),
        ..Options::default()
    })
    .await;
    let p = stack.place("to-s3", 9, 3, 300_000, false).await;
    stack.stage(&p, "job", ago(120)).await;
    stack.release(&p, "job", ago(90)).await;
    stack.recorded(&p, 1, 1).await;
    let env = [
        ("AWS_ACCESS_KEY_ID", s3.access_key()),
        ("AWS_SECRET_ACCESS_KEY", s3.secret_key()),
        ("AWS_REGION", s3.region()),
        ("NO_PROXY", "127.0.0.1,localhost"),
    ];
    let mut demoter = spawn(&stack, "s3", &env);
    let js = stack.bus.jetstream().clone();
    wait_until(WAIT, "the replica removed from hot", || async {
        removed_from_hot(&js).await.len() == 1 && !stack.tier("hot").join(p.prefix()).exists()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "s3")));
    for (name, content) in &p.files {
        let got = s3
            .get_object(&bucket, &format!("{}/{name}", p.prefix()))
            .unwrap();
        assert_eq!(&got, content, "{name}");
    }
    s3.get_object(&bucket, &format!("{}/.stagehand-set-complete", p.prefix()))
        .expect("the set's completion marker");
    let facts = replica_facts(&js).await;
    let created = facts
        .iter()
        .position(|(k, t, v, _)| k == "created" && t == "capacity" && v == &p.version)
        .expect("replica.created on capacity");
    let removed = facts
        .iter()
        .position(|(k, t, _, _)| k == "removed" && t == "hot")
        .unwrap();
    assert!(created < removed);
    demoter.kill().unwrap();
    demoter.wait().unwrap();
    stack.stop().await;
}
