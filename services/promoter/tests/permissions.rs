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

/// As the `promoter` user (and a node agent as the same user): a request waits visibly for
/// validation (`stage.pending`, its ingests consumer), is copied from a manifest read out of
/// the services' Object Store bucket with progress on core NATS, answered with
/// `replica.created` and `stage.ready`; a node's `local` request is filled from hot by its
/// agent's own consumer; an unknown dataset fails with a reason (a catalogue query); a release
/// is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_promoter_stages_as_its_own_restricted_user() {
    let mut stack = Stack::start_with(Options {
        accounts: true,
        ..Options::default()
    })
    .await;
    let mut shared = stack.promoter_config("a");
    // A copy long enough for progress reports: 1 MiB at 512 KiB/s with one second of burst
    // takes about a second, several report periods.
    shared.service.mover.bytes_per_second = Some(512 << 10);
    stack.run_promoter(shared);
    let mut agent = stack.promoter_config("agent-n1");
    agent.service.node = Some("n1".into());
    stack.run_promoter(agent);
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
    let progress =
        stagehand_schemas::progress::progress_subject("stage.requested", PROJECT, &request.id);
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
    let ready = wait_for(WAIT, "local ready on n1 as the promoter user", || async {
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
