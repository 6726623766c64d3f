//! A version validated on an S3 capacity tier (SeaweedFS) is staged onto the posix hot tier
//! by the real promoter binary: ranged GETs hashed on the way, published atomically.

mod common;

use common::*;
use stagehand_schemas::{FileRef, sha256_hex};
use stagehand_testkit::{S3Server, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_on_an_s3_capacity_tier_is_staged_to_hot() {
    let s3 = tokio::task::spawn_blocking(S3Server::shared).await.unwrap();
    let bucket = s3.unique_bucket("promo");
    let stack = Stack::start_with(Options {
        s3_capacity: Some((s3.endpoint(), bucket.clone())),
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let prefix = format!("{PROJECT}/ships/v1");
    let files = [
        ("a/one.bin", bytes(21, 200_000)),
        ("two.bin", bytes(22, 3_000)),
    ];
    let mut refs = Vec::new();
    for (path, content) in &files {
        s3.put_object(&bucket, &format!("{prefix}/{path}"), content)
            .unwrap();
        refs.push(FileRef::new(
            *path,
            content.len() as u64,
            sha256_hex(content),
        ));
    }
    let version = stack.validated("ships", "capacity", &prefix, &refs).await;
    let env = s3.client_env();
    let mut promoter = spawn(&stack, "s3", None, &env);
    let request = stage_request("ships", &version, "hot", "job-s3", None, None);
    stack.publish(&request).await;
    let ready = wait_for(WAIT, "stage.ready from S3", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "s3")));
    let published = stack.tier("hot").join(format!("{PROJECT}/ships/{version}"));
    assert_eq!(ready_path(&ready), published.display().to_string());
    for (path, content) in &files {
        assert_eq!(
            &std::fs::read(published.join(path)).unwrap(),
            content,
            "{path}"
        );
    }
    promoter.kill();
    stack.stop().await;
}
