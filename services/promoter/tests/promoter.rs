//! The promoter against a real nats-server with JetStream, the real catalogue recorder and
//! real posix tiers: a validated version is copied once and ready with its path, fifty
//! requests make one copy, a request waits visibly for validation and is answered by the
//! fact, deadlines end waits, failures say why and leave nothing on the tier, quotas hold
//! under races between two instances, and a node agent fills its node's local tier.

mod common;

use common::*;
use stagehand_catalogue::ReplicaState;
use stagehand_schemas::{Body, Event, EventId, Retryable, progress::WorkProgress};
use stagehand_testkit::{wait_for, wait_until};

/// A validated version on the capacity tier is copied to hot once, verified, published under
/// `<project>/<dataset>/<version>/`, and answered with `replica.created` and `stage.ready`
/// carrying the absolute path; a second request later is ready at once without a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_validated_version_is_copied_once_and_ready_with_its_path() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = [
        ("train/0001.jpg", bytes(1, 10_000)),
        ("train/0002.jpg", bytes(2, 300_000)),
        ("labels.csv", b"id,label\n1,cat\n".to_vec()),
    ];
    let (prefix, refs) = stack.put_files("capacity", "cats", "v1", &files);
    let version = stack.validated("cats", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();

    let first = stage_request("cats", &version[..12], "hot", "job-1", None, None);
    stack.publish(&first).await;
    let ready = wait_for(WAIT, "stage.ready for job-1", || async {
        answers(&js, "stage.ready", &first.id).await.pop()
    })
    .await
    .unwrap();
    let expected = stack.tier("hot").join(format!("{PROJECT}/cats/{version}"));
    assert_eq!(ready_path(&ready), expected.display().to_string());
    for (path, content) in &files {
        assert_eq!(
            &std::fs::read(expected.join(path)).unwrap(),
            content,
            "{path}"
        );
    }
    // Nothing else beside the published folder: no staging folder left behind.
    assert_eq!(
        list(&stack.tier("hot").join(format!("{PROJECT}/cats"))),
        vec![version.clone()]
    );
    let replicas = facts(&js, "replica.created").await;
    assert_eq!(replicas.len(), 1);
    match &replicas[0].body {
        Body::ReplicaCreated(r) => {
            assert_eq!(r.location.prefix, format!("{PROJECT}/cats/{version}"));
            assert_eq!(r.files, 3);
            assert_eq!(r.verified_by, "read-back");
        }
        other => panic!("{other:?}"),
    }

    let second = stage_request("cats", &version, "hot", "job-2", None, None);
    stack.publish(&second).await;
    let again = wait_for(WAIT, "stage.ready for job-2", || async {
        answers(&js, "stage.ready", &second.id).await.pop()
    })
    .await
    .unwrap();
    assert_eq!(ready_path(&again), expected.display().to_string());
    assert_eq!(
        facts(&js, "replica.created").await.len(),
        1,
        "no second copy"
    );
    stack.stop().await;
}

/// A copy on a shared source tier that names a node (a node's word, which its user may state
/// on its own node's subject) is never a source: the version's only copy is on the source tier,
/// a `replica.created` on capacity naming node n1 points elsewhere, and the stage is copied from
/// the source tier, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shared_copy_stated_by_a_node_is_no_source() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = [("a.bin", bytes(3, 50_000)), ("b.bin", bytes(4, 70_000))];
    let (prefix, refs) = stack.put_files("source", "forged", "v1", &files);
    let version = stack.validated("forged", "source", &prefix, &refs).await;
    let forged = Event::request(
        EventId::random(),
        PROJECT,
        Body::ReplicaCreated(stagehand_schemas::ReplicaCreated {
            dataset: "forged".into(),
            version: version.clone(),
            location: stagehand_schemas::Location {
                tier: "capacity".into(),
                prefix: format!("{PROJECT}/forged/elsewhere"),
            },
            files: 2,
            total_bytes: 120_000,
            verified_by: "read-back".into(),
            node: Some("n1".into()),
        }),
    );
    stack.publish(&forged).await;
    let catalogue = stack.catalogue();
    wait_until(WAIT, "the node's word folded", || async {
        (catalogue.version(Some(PROJECT), "forged", &version).await).is_ok_and(|v| {
            (v.replicas.iter()).any(|r| r.tier == "capacity" && r.node.as_deref() == Some("n1"))
        })
    })
    .await
    .unwrap();
    let js = stack.bus.jetstream().clone();
    let request = stage_request("forged", &version, "hot", "job-1", None, None);
    stack.publish(&request).await;
    let ready = wait_for(WAIT, "stage.ready from the source tier", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap();
    let staged = std::path::PathBuf::from(ready_path(&ready));
    for (path, content) in &files {
        assert_eq!(
            &std::fs::read(staged.join(path)).unwrap(),
            content,
            "{path}"
        );
    }
    stack.stop().await;
}

/// Fifty jobs asking for the same version at once get fifty `stage.ready` answers from one
/// copy (one `replica.created`), shared between two promoter instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_requests_for_one_version_make_one_copy_across_two_instances() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    stack.run_promoter(stack.promoter_config("b"));
    let files: Vec<(String, Vec<u8>)> = (0..40)
        .map(|i| (format!("shard-{i:03}.tar"), bytes(i as u8, 64 << 10)))
        .collect();
    let borrowed: Vec<(&str, Vec<u8>)> =
        files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
    let (prefix, refs) = stack.put_files("capacity", "dogs", "v1", &borrowed);
    let version = stack.validated("dogs", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();
    let requests: Vec<_> = (0..50)
        .map(|i| stage_request("dogs", &version, "hot", &format!("job-{i}"), None, None))
        .collect();
    futures::future::join_all(requests.iter().map(|r| stack.publish(r))).await;
    wait_until(WAIT, "fifty stage.ready answers", || async {
        facts(&js, "stage.ready").await.len() >= 50
    })
    .await
    .unwrap();
    let ready = facts(&js, "stage.ready").await;
    assert_eq!(ready.len(), 50, "one answer per request");
    let mut answered: Vec<_> = ready
        .iter()
        .filter_map(|e| e.causation_id.clone())
        .collect();
    answered.sort();
    answered.dedup();
    assert_eq!(answered.len(), 50);
    assert_eq!(facts(&js, "replica.created").await.len(), 1, "one copy");
    assert!(facts(&js, "stage.failed").await.is_empty());
    stack.stop().await;
}

/// A request for a version whose upload is still being validated waits, visibly
/// (`stage.pending`, waiting for validation, with a reason), and is answered as soon as
/// `dataset.validated` arrives — not by the clock, which is an hour in these tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_waits_for_validation_and_is_answered_when_the_fact_arrives() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let js = stack.bus.jetstream().clone();
    let files = [("a.bin", bytes(7, 5000))];
    let (prefix, refs) = stack.put_files("capacity", "birds", "v1", &files);
    let version = stagehand_schemas::version_digest(&refs);
    stack
        .ingest_requested("birds", "capacity", &prefix, &refs)
        .await;
    // The promoter has seen the upload (its ingests consumer) before the request comes.
    settled(&js, "a").await;
    let request = stage_request("birds", &version[..16], "hot", "job-w", None, None);
    stack.publish(&request).await;
    wait_until(WAIT, "the request to wait for validation", || async {
        answers(&js, "stage.pending", &request.id).await.iter().any(|e| {
            matches!(&e.body, Body::StagePending(p) if p.waiting_for == "validation" && p.reason.contains("being validated"))
        })
    })
    .await
    .unwrap();
    assert!(answers(&js, "stage.ready", &request.id).await.is_empty());
    stack.validated("birds", "capacity", &prefix, &refs).await;
    let ready = wait_for(WAIT, "stage.ready after validation", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap();
    assert!(ready_path(&ready).ends_with(&format!("{PROJECT}/birds/{version}")));
    stack.stop().await;
}

/// A wait ends at the request's deadline with `stage.failed` saying what it waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_ends_at_its_deadline_with_the_reason() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let js = stack.bus.jetstream().clone();
    let files = [("a.bin", bytes(8, 100))];
    let (prefix, refs) = stack.put_files("capacity", "owls", "v1", &files);
    let version = stagehand_schemas::version_digest(&refs);
    stack
        .ingest_requested("owls", "capacity", &prefix, &refs)
        .await;
    settled(&js, "a").await;
    let deadline = stagehand_schemas::now() + time::Duration::seconds(2);
    let request = stage_request("owls", &version, "hot", "job-d", None, Some(deadline));
    stack.publish(&request).await;
    let failed = wait_for(WAIT, "stage.failed at the deadline", || async {
        answers(&js, "stage.failed", &request.id).await.pop()
    })
    .await
    .unwrap();
    assert!(
        answers(&js, "stage.pending", &request.id)
            .await
            .iter()
            .any(|e| matches!(&e.body, Body::StagePending(p) if p.waiting_for == "validation")),
        "it waited visibly first"
    );
    let (reason, retryable) = failed_reason(&failed);
    assert!(
        reason.contains("deadline") && reason.contains("validation"),
        "{reason}"
    );
    assert!(retryable);
    assert!(stagehand_schemas::now() >= deadline);
    stack.stop().await;
}

/// Unknown datasets, rejected versions and damaged source files fail with a reason a person
/// can act on, and nothing appears on the hot tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failures_say_why_and_leave_nothing_on_the_tier() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let js = stack.bus.jetstream().clone();

    let unknown = stage_request("nope", "0123456789abcdef", "hot", "job-u", None, None);
    stack.publish(&unknown).await;
    let f = wait_for(WAIT, "unknown dataset failed", || async {
        answers(&js, "stage.failed", &unknown.id).await.pop()
    })
    .await
    .unwrap();
    assert!(
        failed_reason(&f).0.contains("unknown dataset \"nope\""),
        "{f:?}"
    );

    let bad_files = [("x.bin", bytes(3, 10))];
    let (_, bad_refs) = stack.put_files("source", "frogs", "up", &bad_files);
    let rejected = stack.rejected("frogs", &bad_refs, "x.bin").await;
    settled(&js, "a").await;
    let r = stage_request("frogs", &rejected[..20], "hot", "job-r", None, None);
    stack.publish(&r).await;
    let f = wait_for(WAIT, "rejected version failed", || async {
        answers(&js, "stage.failed", &r.id).await.pop()
    })
    .await
    .unwrap();
    let (reason, retryable) = failed_reason(&f);
    assert!(
        reason.contains("rejected") && reason.contains("checksum_mismatch at x.bin"),
        "{reason}"
    );
    assert!(!retryable);

    // One file's bytes on the capacity tier differ from its manifest entry.
    let files = [
        ("good.bin", bytes(4, 70_000)),
        ("bad.bin", bytes(5, 70_000)),
    ];
    let (prefix, refs) = stack.put_files("capacity", "toads", "v1", &files);
    std::fs::write(
        stack.tier("capacity").join(&prefix).join("bad.bin"),
        bytes(6, 70_000),
    )
    .unwrap();
    let version = stack.validated("toads", "capacity", &prefix, &refs).await;
    let c = stage_request("toads", &version, "hot", "job-c", None, None);
    stack.publish(&c).await;
    let f = wait_for(WAIT, "corrupt source failed", || async {
        answers(&js, "stage.failed", &c.id).await.pop()
    })
    .await
    .unwrap();
    let (reason, _) = failed_reason(&f);
    assert!(
        reason.contains("bad.bin") && reason.contains("capacity"),
        "{reason}"
    );
    assert!(
        list(&stack.tier("hot").join(format!("{PROJECT}/toads"))).is_empty(),
        "nothing visible, no staging left"
    );
    assert!(facts(&js, "replica.created").await.is_empty());
    // The space it reserved is given back: a small version fits afterwards.
    stack.stop().await;
}

/// Two instances racing for a quota that fits one of two versions: exactly one is staged,
/// the other fails with the quota in its reason; the tier's capacity is enforced the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_cannot_together_exceed_a_quota() {
    let mut stack = Stack::start_with(Options {
        hot_quotas: "default = \"1 MiB\"",
        ..Options::default()
    })
    .await;
    stack.run_promoter(stack.promoter_config("a"));
    stack.run_promoter(stack.promoter_config("b"));
    let js = stack.bus.jetstream().clone();
    let mut requests = Vec::new();
    for (i, name) in ["big-1", "big-2", "big-3"].iter().enumerate() {
        let files = [("blob.bin", bytes(i as u8, 600 << 10))];
        let (prefix, refs) = stack.put_files("capacity", name, "v1", &files);
        let version = stack.validated(name, "capacity", &prefix, &refs).await;
        requests.push(stage_request(
            name,
            &version,
            "hot",
            &format!("job-{name}"),
            None,
            None,
        ));
    }
    futures::future::join_all(requests.iter().map(|r| stack.publish(r))).await;
    wait_until(WAIT, "all three answered", || async {
        facts(&js, "stage.ready").await.len() + facts(&js, "stage.failed").await.len() == 3
    })
    .await
    .unwrap();
    assert_eq!(
        facts(&js, "stage.ready").await.len(),
        1,
        "600 KiB of a 1 MiB quota"
    );
    let failed = facts(&js, "stage.failed").await;
    assert_eq!(failed.len(), 2);
    for f in &failed {
        let (reason, retryable) = failed_reason(f);
        assert!(
            reason.contains("quota exceeded") && reason.contains("lab-a"),
            "{reason}"
        );
        assert!(retryable);
    }
    stack.stop().await;
}

/// Issue "Slurm pool ignores the filesystem's own free space": a hot tier whose policy
/// capacity (1 GiB) is far beyond its filesystem (a 4 MiB tmpfs; mounting needs root, as in
/// CI) used to admit a copy by the policy alone, and the copy died of ENOSPC midway. A version
/// larger than the filesystem can take fails retryably before any byte is written, as a full
/// tier's does, naming the tier, the bytes wanted and the bytes available, and reserves
/// nothing. A copy that fits beside what a running copy has still to write is admitted; one
/// that fits only in what the filesystem shows free now, not beside that copy, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_the_tier_s_filesystem_cannot_take_fails_before_it_starts() {
    const MIB: u64 = 1 << 20;
    let mut stack = Stack::start().await;
    // Mounted before the promoter opens the tier's root.
    let disk = stagehand_testkit::Tmpfs::mount(stack.tier("hot"), "4m");
    let mut config = stack.promoter_config("a");
    // The copy that fits takes about eight seconds: the next request comes while it runs.
    config.service.mover.bytes_per_second = Some(256 << 10);
    stack.run_promoter(config);
    let js = stack.bus.jetstream().clone();
    let store = js
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .unwrap();
    let version_of = |dataset: &str, parts: u8| {
        let files: Vec<(String, Vec<u8>)> = (0..parts)
            .map(|i| (format!("part-{i}.bin"), bytes(i, 512 << 10)))
            .collect();
        let borrowed: Vec<(&str, Vec<u8>)> =
            files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
        stack.put_files("capacity", dataset, "v1", &borrowed)
    };
    let reserved_on_hot = || async {
        let r = stagehand_bus::placement::reservations(&store, "hot", None)
            .await
            .unwrap();
        r.value.unwrap_or_default().replicas
    };

    // 5 MiB onto a 4 MiB filesystem.
    let (prefix, refs) = version_of("huge", 10);
    let huge = stack.validated("huge", "capacity", &prefix, &refs).await;
    let request = stage_request("huge", &huge, "hot", "job-huge", None, None);
    stack.publish(&request).await;
    let failed = wait_for(WAIT, "stage.failed for the huge version", || async {
        answers(&js, "stage.failed", &request.id).await.pop()
    })
    .await
    .unwrap();
    let (reason, retryable) = failed_reason(&failed);
    assert!(
        reason.starts_with(&format!(
            "tier hot is full: its filesystem has {} bytes available, and version {huge} needs {}",
            4 * MIB,
            5 * MIB
        )),
        "{reason}"
    );
    assert!(retryable, "a full filesystem may have room later");
    assert!(list(&stack.tier("hot").join(PROJECT)).is_empty());
    assert!(reserved_on_hot().await.is_empty());

    // 2 MiB fits and is copied; while it runs, 2.5 MiB fits in what the filesystem shows
    // free, but not beside what the running copy has still to write.
    let (prefix, refs) = version_of("fits", 4);
    let fits = stack.validated("fits", "capacity", &prefix, &refs).await;
    let (prefix, refs) = version_of("second", 5);
    let second = stack.validated("second", "capacity", &prefix, &refs).await;
    let running = stage_request("fits", &fits, "hot", "job-fits", None, None);
    let subject = stagehand_schemas::progress::progress_subject(
        "stage.requested",
        None,
        PROJECT,
        &running.id,
    );
    let mut progress = stack.bus.client().subscribe(subject).await.unwrap();
    stack.publish(&running).await;
    tokio::time::timeout(WAIT, futures::StreamExt::next(&mut progress))
        .await
        .expect("the copy that fits reports progress")
        .unwrap();
    let request = stage_request("second", &second, "hot", "job-second", None, None);
    stack.publish(&request).await;
    let failed = wait_for(WAIT, "stage.failed for the second version", || async {
        answers(&js, "stage.failed", &request.id).await.pop()
    })
    .await
    .unwrap();
    let (reason, retryable) = failed_reason(&failed);
    assert!(
        reason.starts_with("tier hot is full: its filesystem has ")
            && reason.contains(" of them promised to copies onto it still running or queued")
            && reason.contains(&format!("version {second} needs {}", 5 * (512 << 10))),
        "{reason}"
    );
    assert!(retryable);
    let ready = wait_for(WAIT, "stage.ready for the version that fits", || async {
        answers(&js, "stage.ready", &running.id).await.pop()
    })
    .await
    .unwrap();
    assert!(ready_path(&ready).ends_with(&format!("{PROJECT}/fits/{fits}")));
    assert_eq!(
        list(&stack.tier("hot").join(PROJECT)),
        vec!["fits".to_owned()]
    );
    let reserved: Vec<String> = reserved_on_hot().await.into_keys().collect();
    assert_eq!(reserved, vec![format!("{PROJECT}/fits/{fits}")]);
    stack.stop().await;
    drop(disk);
}

/// A released request that was waiting stops waiting: the fact that would have answered it
/// later does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_waiting_request_is_not_answered_later() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let js = stack.bus.jetstream().clone();
    let files = [("a.bin", bytes(9, 100))];
    let (prefix, refs) = stack.put_files("capacity", "bats", "v1", &files);
    let version = stagehand_schemas::version_digest(&refs);
    stack
        .ingest_requested("bats", "capacity", &prefix, &refs)
        .await;
    settled(&js, "a").await;
    let request = stage_request("bats", &version, "hot", "job-x", None, None);
    let other = stage_request("bats", &version, "hot", "job-y", None, None);
    stack.publish(&request).await;
    stack.publish(&other).await;
    wait_until(WAIT, "both requests waiting", || async {
        !answers(&js, "stage.pending", &request.id).await.is_empty()
            && !answers(&js, "stage.pending", &other.id).await.is_empty()
    })
    .await
    .unwrap();
    stack
        .publish(&stage_release("bats", &version, "hot", "job-x"))
        .await;
    // The release is handled before the validation fact: wait for the promoter's consumer to
    // have acked it (its ack floor passed the release).
    wait_until(WAIT, "the release handled", || async {
        drained(
            &js,
            stagehand_schemas::subject::REQUESTS.name,
            &["promoter"],
        )
        .await
    })
    .await
    .unwrap();
    stack.validated("bats", "capacity", &prefix, &refs).await;
    wait_for(WAIT, "the other request ready", || async {
        answers(&js, "stage.ready", &other.id).await.pop()
    })
    .await
    .unwrap();
    assert!(answers(&js, "stage.ready", &request.id).await.is_empty());
    assert!(answers(&js, "stage.failed", &request.id).await.is_empty());
    stack.stop().await;
}

/// A long copy publishes `WorkProgress` (files, bytes, ETA) on the request's progress subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_copy_publishes_its_progress() {
    let mut stack = Stack::start().await;
    let mut config = stack.promoter_config("a");
    // About two seconds of copying.
    config.service.mover.bytes_per_second = Some(512 << 10);
    stack.run_promoter(config);
    let js = stack.bus.jetstream().clone();
    let files: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| (format!("f{i}.bin"), bytes(i as u8, 128 << 10)))
        .collect();
    let borrowed: Vec<(&str, Vec<u8>)> =
        files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
    let (prefix, refs) = stack.put_files("capacity", "slow", "v1", &borrowed);
    let version = stack.validated("slow", "capacity", &prefix, &refs).await;
    let request = stage_request("slow", &version, "hot", "job-p", None, None);
    let subject = stagehand_schemas::progress::progress_subject(
        "stage.requested",
        None,
        PROJECT,
        &request.id,
    );
    let mut sub = stack.bus.client().subscribe(subject).await.unwrap();
    stack.publish(&request).await;
    let mut seen = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut sub)).await {
        let p = WorkProgress::decode(&m.payload).unwrap();
        let done = p.bytes_done == p.bytes_total;
        seen.push(p);
        if done {
            break;
        }
    }
    assert!(seen.len() >= 2, "{seen:?}");
    let last = seen.last().unwrap();
    assert_eq!((last.files_total, last.bytes_total), (8, 8 * (128 << 10)));
    assert!(
        seen.iter()
            .any(|p| p.bytes_done < p.bytes_total && p.eta_seconds.is_some()),
        "{seen:?}"
    );
    wait_for(WAIT, "stage.ready", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap();
    stack.stop().await;
}

/// Issue 17 item 4: a copy queued behind another on the same pair of tiers is answered
/// `stage.pending` with the bytes queued ahead of it and, once a copy of that pair was
/// measured, when it should be ready — before any was, with no estimate (rather than an
/// invented one). The recorder mirrors the estimate into the stage's status for schedulers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_copy_states_the_bytes_ahead_and_when_it_should_be_ready() {
    let mut stack = Stack::start_with(Options {
        max_concurrent: 1,
        ..Options::default()
    })
    .await;
    let mut config = stack.promoter_config("a");
    // The long copy takes about four seconds: the short one queues behind it.
    config.service.mover.bytes_per_second = Some(512 << 10);
    stack.run_promoter(config);
    let js = stack.bus.jetstream().clone();
    let long_files: Vec<(String, Vec<u8>)> = (0..4)
        .map(|i| (format!("f{i}.bin"), bytes(i as u8, 512 << 10)))
        .collect();
    let long_bytes = 4 * ((512 << 10) + 1);
    let mut versions = Vec::new();
    for round in ["a", "b"] {
        let long: Vec<(&str, Vec<u8>)> = long_files
            .iter()
            .map(|(p, b)| (p.as_str(), [b.as_slice(), round.as_bytes()].concat()))
            .collect();
        let (prefix, refs) = stack.put_files("capacity", &format!("long-{round}"), "v1", &long);
        let long = stack
            .validated(&format!("long-{round}"), "capacity", &prefix, &refs)
            .await;
        let short = [(
            "one.bin",
            [bytes(9, 1000).as_slice(), round.as_bytes()].concat(),
        )];
        let (prefix, refs) = stack.put_files("capacity", &format!("short-{round}"), "v1", &short);
        let short = stack
            .validated(&format!("short-{round}"), "capacity", &prefix, &refs)
            .await;
        versions.push((round, long, short));
    }
    let stages = js
        .get_key_value(stagehand_catalogue::STAGES_BUCKET)
        .await
        .unwrap();

    for (round, long, short) in &versions {
        let running = stage_request(
            &format!("long-{round}"),
            long,
            "hot",
            "job-long",
            None,
            None,
        );
        let subject = stagehand_schemas::progress::progress_subject(
            "stage.requested",
            None,
            PROJECT,
            &running.id,
        );
        let mut progress = stack.bus.client().subscribe(subject).await.unwrap();
        stack.publish(&running).await;
        // The long copy holds the only slot once it reports progress.
        tokio::time::timeout(WAIT, futures::StreamExt::next(&mut progress))
            .await
            .expect("the long copy reports progress")
            .unwrap();
        let queued = stage_request(
            &format!("short-{round}"),
            short,
            "hot",
            "job-short",
            None,
            None,
        );
        stack.publish(&queued).await;
        let pending = wait_for(WAIT, "the queued copy's stage.pending", || async {
            answers(&js, "stage.pending", &queued.id).await.pop()
        })
        .await
        .unwrap();
        let Body::StagePending(p) = &pending.body else {
            panic!("{pending:?}")
        };
        assert_eq!(p.waiting_for, "copy");
        let estimate = p
            .ready_estimate
            .clone()
            .expect("a queued copy states an estimate");
        assert_eq!(
            (estimate.from_tier.as_str(), estimate.to_tier.as_str()),
            ("capacity", "hot")
        );
        assert_eq!(estimate.copies_ahead, 1, "{estimate:?}");
        assert!(estimate.bytes_ahead <= long_bytes, "{estimate:?}");
        assert_eq!(estimate.bytes, 1001);
        if *round == "a" {
            // Nothing of capacity -> hot was measured yet.
            assert_eq!((estimate.bytes_per_second, estimate.ready_at), (None, None));
            assert!(
                estimate
                    .describe(pending.occurred_at)
                    .contains("no estimate yet"),
                "{estimate:?}"
            );
        } else {
            // Round a's two copies were measured.
            assert!(
                estimate.bytes_per_second.is_some_and(|r| r > 0),
                "{estimate:?}"
            );
            assert!(
                estimate.ready_at.is_some_and(|at| at > pending.occurred_at),
                "{estimate:?}"
            );
        }
        let key = stagehand_catalogue::stage_kv_key(PROJECT, &queued.id);
        let mirrored = wait_for(WAIT, "the estimate in the stage's status", || async {
            let value = stages.get(key.clone()).await.ok().flatten()?;
            let status: stagehand_catalogue::StageStatus = serde_json::from_slice(&value).ok()?;
            status.ready_estimate
        })
        .await
        .unwrap();
        assert_eq!(mirrored, estimate);
        for id in [&running.id, &queued.id] {
            wait_for(WAIT, "stage.ready", || async {
                answers(&js, "stage.ready", id).await.pop()
            })
            .await
            .unwrap();
        }
    }
    stack.stop().await;
}

/// A node agent answers its own node's `local` requests from the hot tier (where the
/// shared promoter put the version), and skips another node's; the shared promoter ignores
/// `local` requests. The agent's copy is a fact like a shared one: `replica.created` names
/// its node, the catalogue lists that replica per node beside the hot one, and the demoter's
/// `replica.removed` naming the node gives the node's reserved space back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_agent_fills_its_local_tier_from_hot() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("shared"));
    let mut agent = stack.promoter_config("agent-n1");
    agent.service.node = Some("n1".into());
    stack.run_promoter(agent);
    let js = stack.bus.jetstream().clone();
    let files = [("w.bin", bytes(11, 50_000))];
    let (prefix, refs) = stack.put_files("capacity", "ckpt-run7", "v1", &files);
    let version = stack
        .validated("ckpt-run7", "capacity", &prefix, &refs)
        .await;
    let hot = stage_request("ckpt-run7", &version, "hot", "job-h", None, None);
    stack.publish(&hot).await;
    wait_for(WAIT, "hot ready", || async {
        answers(&js, "stage.ready", &hot.id).await.pop()
    })
    .await
    .unwrap();
    let elsewhere = stage_request("ckpt-run7", &version, "local", "job-l", Some("n2"), None);
    let mine = stage_request("ckpt-run7", &version, "local", "job-l", Some("n1"), None);
    stack.publish(&elsewhere).await;
    stack.publish(&mine).await;
    let ready = wait_for(WAIT, "local ready on n1", || async {
        answers(&js, "stage.ready", &mine.id).await.pop()
    })
    .await
    .unwrap();
    let path = stack
        .tier("local-n1")
        .join(format!("{PROJECT}/ckpt-run7/{version}"));
    assert_eq!(ready_path(&ready), path.display().to_string());
    assert_eq!(std::fs::read(path.join("w.bin")).unwrap(), files[0].1);
    match &ready.body {
        Body::StageReady(r) => assert_eq!(r.node.as_deref(), Some("n1")),
        other => panic!("{other:?}"),
    }
    // n2's request: nobody here answers it (no agent for n2; the shared promoter ignores it).
    wait_until(
        WAIT,
        "the agent and the promoter passed n2's request",
        || async {
            drained(
                &js,
                stagehand_schemas::subject::REQUESTS.name,
                &["promoter-node-n1", "promoter"],
            )
            .await
        },
    )
    .await
    .unwrap();
    for kind in ["stage.ready", "stage.failed", "stage.pending"] {
        assert!(answers(&js, kind, &elsewhere.id).await.is_empty(), "{kind}");
    }
    // Each copy is a replica.created: the hot one shared, the local one naming its node.
    let replicas = wait_for(WAIT, "both replica.created", || async {
        let all = facts(&js, "replica.created").await;
        (all.len() >= 2).then_some(all)
    })
    .await
    .unwrap();
    let mut placed: Vec<(String, Option<String>, String, u64)> = replicas
        .iter()
        .map(|e| match &e.body {
            Body::ReplicaCreated(r) => (
                r.location.tier.clone(),
                r.node.clone(),
                r.location.prefix.clone(),
                r.files,
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    placed.sort();
    let prefix = format!("{PROJECT}/ckpt-run7/{version}");
    assert_eq!(
        placed,
        [
            ("hot".into(), None, prefix.clone(), 1),
            ("local".into(), Some("n1".into()), prefix.clone(), 1),
        ]
    );
    // The catalogue lists the node's replica as its own, beside the hot one.
    let catalogue = stagehand_catalogue::Catalogue::new(stack.bus.client().clone());
    let listed = |want: Vec<(&'static str, Option<&'static str>, ReplicaState)>| {
        let catalogue = catalogue.clone();
        let version = version.clone();
        async move {
            let detail = catalogue
                .version(Some(PROJECT), "ckpt-run7", &version)
                .await
                .ok()?;
            let got: Vec<_> = detail
                .replicas
                .iter()
                .map(|r| (r.tier.as_str(), r.node.as_deref(), r.state))
                .filter(|(t, _, _)| *t != "capacity")
                .collect();
            (got == want).then_some(())
        }
    };
    wait_for(WAIT, "the catalogue lists hot and local@n1", || {
        listed(vec![
            ("hot", None, ReplicaState::Present),
            ("local", Some("n1"), ReplicaState::Present),
        ])
    })
    .await
    .unwrap();
    // n1's space holds the copy until the demoter removes it there; then it is given back,
    // and the catalogue shows that node's replica removed, the hot one still present.
    let quota = js
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .unwrap();
    let reserved = |quota: async_nats::jetstream::kv::Store, prefix: String| async move {
        let value = quota
            .get("quota.local.n1")
            .await
            .unwrap()
            .unwrap_or_default();
        let r: stagehand_promoter::kv::Reservations =
            serde_json::from_slice(&value).unwrap_or_default();
        r.replicas.contains_key(&prefix)
    };
    assert!(reserved(quota.clone(), prefix.clone()).await);
    // What the node's demoter does: the folder goes, then `replica.removed` names the node
    // (space is never given back for a folder still on the tier).
    std::fs::remove_dir_all(&path).unwrap();
    stack
        .removed("ckpt-run7", &version, ("local", Some("n1")), &prefix)
        .await;
    wait_until(WAIT, "n1's reservation released", || async {
        !reserved(quota.clone(), prefix.clone()).await
    })
    .await
    .unwrap();
    wait_for(WAIT, "the catalogue shows local@n1 removed", || {
        listed(vec![
            ("hot", None, ReplicaState::Present),
            ("local", Some("n1"), ReplicaState::Removed),
        ])
    })
    .await
    .unwrap();
    stack.stop().await;
}

/// `form = prepared`: a request for a validated version whose prepared form does not exist yet
/// waits for preparation (the packing policy would prepare it) and is staged with the prepared
/// version once `dataset.prepared` names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prepared_form_is_waited_for_and_staged() {
    let mut stack = Stack::start().await;
    std::fs::write(
        stack.policies.join("packing.toml"),
        "enabled = true\nmin_files = 2\nmax_mean_file_size = \"4 MiB\"\nshard_size = \"1 GiB\"\nlayout = \"webdataset\"\nseed = 0\ntarget_tier = \"capacity\"\n",
    )
    .unwrap();
    stack.run_promoter(stack.promoter_config("a"));
    let js = stack.bus.jetstream().clone();
    let raw_files = [("s/1.jpg", bytes(31, 1000)), ("s/2.jpg", bytes(32, 1000))];
    let (prefix, refs) = stack.put_files("capacity", "packed", "raw", &raw_files);
    let raw = stack.validated("packed", "capacity", &prefix, &refs).await;
    settled(&js, "a").await;
    let request = stage_request_form(
        "packed",
        &raw,
        "hot",
        "job-pp",
        None,
        None,
        Some("prepared"),
    );
    stack.publish(&request).await;
    wait_until(WAIT, "waiting for preparation", || async {
        answers(&js, "stage.pending", &request.id)
            .await
            .iter()
            .any(|e| matches!(&e.body, Body::StagePending(p) if p.waiting_for == "preparation"))
    })
    .await
    .unwrap();
    let shard = [("shard-000000.tar", bytes(33, 4096))];
    let (shard_prefix, shard_refs) = stack.put_files("capacity", "packed", "shards", &shard);
    let prepared = stack
        .prepared("packed", &raw, "capacity", &shard_prefix, &shard_refs)
        .await;
    let ready = wait_for(WAIT, "the prepared form ready", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap();
    let path = stack
        .tier("hot")
        .join(format!("{PROJECT}/packed/{prepared}"));
    assert_eq!(ready_path(&ready), path.display().to_string());
    assert_eq!(
        std::fs::read(path.join("shard-000000.tar")).unwrap(),
        shard[0].1
    );
    stack.stop().await;
}

/// `[worker] claims` used to be dropped for the facts and ingests workers, each on this
/// instance's own consumer, after the table was applied: `claims = true` was silently
/// ignored there, and a promoter with every policy it needs ran on. It cannot apply to them,
/// so it is refused at start, naming the key and the consumer; nothing is consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_the_own_consumers_cannot_honour_are_refused_at_start() {
    let stack = Stack::start().await;
    let mut config = stack.promoter_config("p1");
    config.worker.claims = Some(true);
    let ran = tokio::time::timeout(
        WAIT,
        stagehand_promoter::run(config, stagehand_bus::CancellationToken::new()),
    )
    .await
    .expect("the promoter refuses to start instead of running");
    let err = ran.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("worker.claims"), "{text}");
    assert!(text.contains("promoter-facts-p1"), "{text}");
    assert!(!err.is_retryable(), "{text}");
    stack.stop().await;
}
