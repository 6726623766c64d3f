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
    let env = s3.client_env();
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
    demoter.kill();
    stack.stop().await;
}

/// Guards issue 19's trusted copy-down on S3: the capacity prefix already holds the set with
/// its completion marker, but two objects with other bytes and one missing. The marker is not
/// taken for the copy: every object is read and hashed, the wrong ones are written again, the
/// marker last, and the hot copy goes only after `replica.created` on capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_set_already_on_s3_capacity_is_replaced_before_the_hot_copy_goes() {
    let s3 = tokio::task::spawn_blocking(stagehand_testkit::S3Server::shared)
        .await
        .unwrap();
    let bucket = s3.unique_bucket("stale");
    let stack = Stack::start(Options {
        idle_after: "1h",
        s3_capacity: Some((s3.endpoint(), bucket.clone())),
        ..Options::default()
    })
    .await;
    let p = stack.place("stale-s3", 11, 8, 4096, false).await;
    for (i, (name, bytes)) in p.files.iter().enumerate() {
        let mut bytes = bytes.clone();
        match i {
            2 | 5 => bytes[100] ^= 0xff,
            7 => continue,
            _ => {}
        }
        s3.put_object(&bucket, &format!("{}/{name}", p.prefix()), &bytes)
            .unwrap();
    }
    s3.put_object(
        &bucket,
        &format!("{}/.stagehand-set-complete", p.prefix()),
        br#"{"files":8,"bytes":32768}"#,
    )
    .unwrap();
    stack.stage(&p, "job", ago(120)).await;
    stack.release(&p, "job", ago(90)).await;
    stack.recorded(&p, 1, 1).await;
    let env = s3.client_env();
    let mut demoter = spawn(&stack, "s3-stale", &env);
    let js = stack.bus.jetstream().clone();
    wait_until(WAIT, "the replica removed from hot", || async {
        removed_from_hot(&js).await.len() == 1 && !stack.tier("hot").join(p.prefix()).exists()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "s3-stale")));
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
    demoter.kill();
    stack.stop().await;
}
