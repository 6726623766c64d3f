//! The ingest validator against a real nats-server with JetStream and real posix and S3
//! source tiers: good uploads are validated with the right digest, bad ones rejected once
//! with every problem and a report beside the upload, manifests by reference verified before
//! use, bounded reads that never block or read past a declared size, projects confined to
//! their own prefix, poison messages dead-lettered without affecting the next request, and a
//! request published many times validated once.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use stagehand_bus::{Bus, BusConfig, CancellationToken, run_worker};
use stagehand_ingest_validator::report::SpooledReport;
use stagehand_ingest_validator::source::SourceFiles;
use stagehand_ingest_validator::{
    IngestValidator, SERVICE, Settings, SourceChecks, ValidatorOptions, config, report_path, run,
};
use stagehand_manifest::{BucketOptions, ManifestStore};
use stagehand_mover::s3::{S3Config, S3Tier};
use stagehand_mover::{Mover, ReadLimit, Tier, TransferError};
use stagehand_policy::{Policies, TierRole};
use stagehand_schemas::Retryable;
use stagehand_schemas::manifest::canonical_bytes;
use stagehand_schemas::{
    Body, Event, EventId, FileRef, ManifestRef, sha256_hex, subject, version_digest, wire,
};
use stagehand_testkit::{NatsServer, S3Server, wait_for, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_upload_is_validated_with_its_version_digest() {
    let h = Harness::start().await;
    let prefix = "lab-a/up/cats-1";
    let files = vec![
        put(&h.source_root, prefix, "train/0001.jpg", b"meow"),
        put(
            &h.source_root,
            prefix,
            "train/0002.jpg",
            &vec![7u8; 300_000],
        ),
        put(&h.source_root, prefix, "labels.csv", b""),
    ];
    let event = request("good-1", prefix, files.clone());
    h.bus.publish(&event).await.unwrap();

    let fact = fact_for(&h.js, "good-1").await;
    assert_eq!(
        fact.id,
        EventId::for_fact(&event.project, &event.id, "validated")
    );
    assert_eq!(fact.correlation_id.as_str(), "good-1");
    assert_eq!(fact.project, PROJECT);
    let Body::DatasetValidated(v) = &fact.body else {
        panic!("expected dataset.validated, got {fact:?}")
    };
    assert_eq!(v.version, version_digest(&files));
    // A small manifest travels inline, in path order.
    assert_eq!(v.files, sorted(files));
    assert_eq!(v.manifest, None);
    assert_eq!(v.total_bytes, 300_004);
    assert_eq!(v.request_id.as_str(), "good-1");
    assert_eq!(v.requested_by, "alice");
    assert_eq!(v.labels, vec![("modality".to_owned(), "image".to_owned())]);
    let stats = h.stop().await;
    assert_eq!(stats.handled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_upload_is_rejected_once_with_every_problem_and_reported_not_deleted() {
    let h = Harness::start().await;
    let prefix = "lab-a/up/bad";
    let root = &h.source_root;
    let ok = put(root, prefix, "ok.bin", b"fine");
    let mut short = put(root, prefix, "short.bin", b"abc");
    short.size = 4;
    let mut corrupt = put(root, prefix, "corrupt.bin", b"abc");
    corrupt.sha256 = sha256_hex(b"abd");
    let tool = put(root, prefix, "tool.exe", b"MZ");
    std::os::unix::fs::symlink("/etc/passwd", root.join(prefix).join("escape")).unwrap();
    std::fs::create_dir_all(root.join(prefix).join("a-directory")).unwrap();
    let sha = sha256_hex(b"x");
    let files = vec![
        ok.clone(),
        FileRef::new("../x", 1, &sha),
        FileRef::new("/etc/passwd", 1, &sha),
        FileRef::new("escape", 1, &sha),
        ok.clone(),
        short,
        corrupt,
        FileRef::new("gone.bin", 1, &sha),
        tool,
        FileRef::new("huge.bin", 2 << 20, &sha),
        FileRef::new("a-directory", 1, &sha),
    ];
    let event = request("bad-1", prefix, files.clone());
    h.bus.publish(&event).await.unwrap();

    let fact = fact_for(&h.js, "bad-1").await;
    let want = |code: &str, path: &str| (code.to_owned(), Some(path.to_owned()));
    // In path order, as the manifest streams them.
    let every = vec![
        want("path_rule", "../x"),
        want("path_rule", "/etc/passwd"),
        want("not_a_file", "a-directory"),
        want("checksum_mismatch", "corrupt.bin"),
        want("symlink_escape", "escape"),
        want("missing", "gone.bin"),
        want("too_large", "huge.bin"),
        want("duplicate_path", "ok.bin"),
        want("size_mismatch", "short.bin"),
        want("suffix_denied", "tool.exe"),
    ];
    assert_eq!(problems_of(&fact), every);
    let rejected = rejection(&fact);
    assert_eq!(rejected.declared_version, version_digest(&files));
    assert_eq!(rejected.request_id.as_str(), "bad-1");
    assert_eq!(rejected.problems_total, Some(10));
    assert_eq!(
        rejected.problem_counts,
        vec![
            ("checksum_mismatch".to_owned(), 1),
            ("duplicate_path".to_owned(), 1),
            ("missing".to_owned(), 1),
            ("not_a_file".to_owned(), 1),
            ("path_rule".to_owned(), 2),
            ("size_mismatch".to_owned(), 1),
            ("suffix_denied".to_owned(), 1),
            ("symlink_escape".to_owned(), 1),
            ("too_large".to_owned(), 1),
        ]
    );
    let report_rel = report_path(PROJECT, &event.id);
    let quarantine = rejected.quarantine.as_deref().expect("quarantine location");
    assert!(quarantine.contains(&report_rel), "{quarantine}");
    let report = std::fs::read(root.join(&report_rel)).unwrap();
    let lines = report_lines(&report);
    assert_eq!(lines[0]["kind"], "request");
    assert_eq!(lines[0]["request_id"], "bad-1");
    assert_eq!(lines[0]["declared_version"], version_digest(&files));
    assert_eq!(report_problems(&report), every);
    assert_eq!(lines.last().unwrap()["kind"], "summary");
    assert_eq!(lines.last().unwrap()["problems_total"], 10);
    // The upload is left where it was.
    assert_eq!(
        std::fs::read(root.join(prefix).join("ok.bin")).unwrap(),
        b"fine"
    );
    assert_eq!(
        std::fs::read(root.join(prefix).join("corrupt.bin")).unwrap(),
        b"abc"
    );

    wait_idle(&h.js).await;
    assert_eq!(
        facts_caused_by(&h.js, "bad-1").await.len(),
        1,
        "one rejection only"
    );
    h.stop().await;
}

/// Issue 6 item 7: a FIFO, a socket or a device named in a manifest is `not_a_file` without
/// blocking (an open for reading of a FIFO waits for a writer for ever); a sparse terabyte
/// declared as one byte, and a file of another size than declared, are judged from their
/// size without being read; a prefix and path together longer than PATH_MAX are that file's
/// `path_rule`, not a retry of the whole request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_files_oversized_and_overlong_paths_are_per_file_problems_found_without_reading() {
    let h = Harness::start().await;
    let prefix = "lab-a/up/hostile";
    let root = h.source_root.join(prefix);
    std::fs::create_dir_all(&root).unwrap();
    let fine = put(&h.source_root, prefix, "fine.bin", b"fine");
    let status = std::process::Command::new("mkfifo")
        .arg(root.join("pipe"))
        .status()
        .unwrap();
    assert!(status.success());
    let _socket = std::os::unix::net::UnixListener::bind(root.join("socket")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", root.join("zero")).unwrap();
    // A character device that never ends (/dev/zero's numbers): a read would hash for ever.
    let status = std::process::Command::new("mknod")
        .arg(root.join("device"))
        .args(["c", "1", "5"])
        .status()
        .unwrap();
    assert!(status.success(), "mknod needs CAP_MKNOD");
    let sparse = std::fs::File::create(root.join("sparse.bin")).unwrap();
    sparse.set_len(1 << 40).unwrap();
    std::fs::write(root.join("longer.bin"), b"five!").unwrap();
    let long = format!("{}/f", vec!["d".repeat(254); 16].join("/"));
    assert!(long.len() <= 4096 && prefix.len() + 1 + long.len() >= 4096);
    let sha = sha256_hex(b"x");
    let files = vec![
        fine.clone(),
        FileRef::new("pipe", 1, &sha),
        FileRef::new("socket", 1, &sha),
        FileRef::new("zero", 1, &sha),
        FileRef::new("device", 1, &sha),
        FileRef::new("sparse.bin", 1, &sha),
        FileRef::new("longer.bin", 1, &sha),
        FileRef::new(long.clone(), 1, &sha),
    ];
    h.bus
        .publish(&request("hostile-1", prefix, files))
        .await
        .unwrap();
    let fact = wait_for(
        Duration::from_secs(20),
        "a verdict, not a read blocked on the FIFO",
        || async { facts_caused_by(&h.js, "hostile-1").await.into_iter().next() },
    )
    .await
    .unwrap();
    let want = |code: &str, path: &str| (code.to_owned(), Some(path.to_owned()));
    assert_eq!(
        problems_of(&fact),
        vec![
            want("path_rule", &long),
            want("not_a_file", "device"),
            want("size_mismatch", "longer.bin"),
            want("not_a_file", "pipe"),
            want("not_a_file", "socket"),
            want("too_large", "sparse.bin"),
            want("symlink_escape", "zero"),
        ]
    );
    let rejected = rejection(&fact);
    let detail = |path: &str| {
        rejected
            .problems
            .iter()
            .find(|p| p.path.as_deref() == Some(path))
            .unwrap()
            .detail
            .clone()
    };
    let longer = detail("longer.bin");
    assert!(
        longer.contains("5 bytes") && longer.contains("not read"),
        "{longer}"
    );
    assert!(detail("pipe").contains("FIFO"), "{}", detail("pipe"));
    assert!(detail("sparse.bin").contains(&format!("{} bytes", 1u64 << 40)));
    assert!(detail(&long).contains("PATH_MAX"), "{}", detail(&long));
    assert!(
        detail(&long).len() < 200,
        "the detail does not repeat the path"
    );
    wait_idle(&h.js).await;
    let stats = h.stop().await;
    assert_eq!((stats.handled, stats.retried), (1, 0), "{stats:?}");
}

/// A source tier that counts what the validator asks of it: the seam through which the
/// hostile-producer test proves nothing was read.
struct Counting {
    tier: Tier,
    observed: Arc<AtomicUsize>,
}

impl SourceFiles for Counting {
    async fn observe(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<stagehand_ingest_validator::source::Observation, TransferError> {
        self.observed.fetch_add(1, Ordering::SeqCst);
        self.tier.observe(rel, limit).await
    }
    async fn put_report(&self, mover: &Mover, report: &SpooledReport) -> Result<(), TransferError> {
        self.tier.put_report(mover, report).await
    }
    fn describe(&self, rel: &str) -> String {
        self.tier.describe(rel)
    }
}

/// Issue 6 item 5: project A's request naming B's prefix is rejected `outside_project`, and
/// nothing of B's is read (not one file observed), whether it names B's folder, the tier
/// root, or a sibling whose name merely starts with A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_another_projects_prefix_reads_nothing_and_is_rejected() {
    let observed = Arc::new(AtomicUsize::new(0));
    let count = observed.clone();
    let h = Harness::start_worker(
        move |tier| Counting {
            tier,
            observed: count,
        },
        |_| {},
    )
    .await;
    // B's upload, with the right manifest: a read would validate it.
    let secret = vec![put(
        &h.source_root,
        "lab-b/secret",
        "weights.bin",
        b"B's data",
    )];
    for (id, prefix) in [
        ("hostile-b", "lab-b/secret"),
        ("hostile-root", ""),
        ("hostile-sibling", "lab-a-other/secret"),
    ] {
        h.bus
            .publish(&request(id, prefix, secret.clone()))
            .await
            .unwrap();
        let fact = fact_for(&h.js, id).await;
        let expect_path = (!prefix.is_empty()).then(|| prefix.to_owned());
        assert_eq!(
            problems_of(&fact),
            vec![("outside_project".to_owned(), expect_path)],
            "{id}"
        );
        let rejected = rejection(&fact);
        assert_eq!(rejected.problems_total, Some(1));
        // The report goes to the validator's own quarantine area, not into B's prefix.
        let report = std::fs::read(
            h.source_root
                .join(report_path(PROJECT, &EventId::new(id).unwrap())),
        )
        .unwrap();
        assert_eq!(report_problems(&report).len(), 1);
    }
    assert_eq!(observed.load(Ordering::SeqCst), 0, "nothing was read");
    // The same upload asked for by its own project is read and validated.
    let own = request_in("lab-b", "own-b", "lab-b/secret", secret.clone(), None);
    h.bus.publish(&own).await.unwrap();
    let fact = fact_for(&h.js, "own-b").await;
    assert!(matches!(fact.body, Body::DatasetValidated(_)), "{fact:?}");
    assert_eq!(observed.load(Ordering::SeqCst), 1);
    h.stop().await;
}

/// A manifest by reference whose object's bytes are not its digest is refused with
/// `manifest_mismatch`, one that is not canonical lines with `manifest_malformed` naming the
/// line; an event carrying both inline files and a reference is rejected. None reads a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_that_are_not_what_they_claim_are_rejected_before_any_file_is_read() {
    let observed = Arc::new(AtomicUsize::new(0));
    let count = observed.clone();
    let h = Harness::start_worker(
        move |tier| Counting {
            tier,
            observed: count,
        },
        |_| {},
    )
    .await;
    let prefix = "lab-a/up/m";
    let files = vec![
        put(&h.source_root, prefix, "a.bin", b"a"),
        put(&h.source_root, prefix, "b.bin", b"b"),
    ];
    let uploads = ManifestStore::uploads(&h.js, PROJECT, BucketOptions::default())
        .await
        .unwrap();

    // The object named by the manifest's digest holds other bytes.
    let right = canonical_bytes(&files);
    let digest = sha256_hex(&right);
    let wrong = canonical_bytes(&files[..1]);
    uploads
        .object_store()
        .put(digest.as_str(), &mut wrong.as_slice())
        .await
        .unwrap();
    let reference = ManifestRef {
        digest: digest.clone(),
        files: 2,
        bytes: 2,
    };
    h.bus
        .publish(&request_in(
            PROJECT,
            "mismatch-1",
            prefix,
            vec![],
            Some(reference.clone()),
        ))
        .await
        .unwrap();

    // Out of order, named by its own hash: the digest matches, the lines do not.
    let unsorted = format!("{}{}", files[1].manifest_line(), files[0].manifest_line());
    let unsorted_digest = sha256_hex(unsorted.as_bytes());
    uploads
        .object_store()
        .put(unsorted_digest.as_str(), &mut unsorted.as_bytes())
        .await
        .unwrap();
    h.bus
        .publish(&request_in(
            PROJECT,
            "malformed-1",
            prefix,
            vec![],
            Some(ManifestRef {
                digest: unsorted_digest,
                files: 2,
                bytes: 2,
            }),
        ))
        .await
        .unwrap();

    h.bus
        .publish(&request_in(
            PROJECT,
            "both-1",
            prefix,
            files.clone(),
            Some(reference),
        ))
        .await
        .unwrap();

    let mismatch = fact_for(&h.js, "mismatch-1").await;
    assert_eq!(
        problems_of(&mismatch),
        vec![("manifest_mismatch".to_owned(), None)]
    );
    assert_eq!(rejection(&mismatch).declared_version, digest);
    let malformed = fact_for(&h.js, "malformed-1").await;
    assert_eq!(
        problems_of(&malformed),
        vec![("manifest_malformed".to_owned(), None)]
    );
    let detail = &rejection(&malformed).problems[0].detail;
    assert!(
        detail.contains("line 2") && detail.contains("not sorted"),
        "{detail}"
    );
    let both = fact_for(&h.js, "both-1").await;
    assert_eq!(
        problems_of(&both),
        vec![("manifest_malformed".to_owned(), None)]
    );
    assert!(rejection(&both).problems[0].detail.contains("both"));
    assert_eq!(observed.load(Ordering::SeqCst), 0, "no file was read");
    wait_idle(&h.js).await;
    assert_eq!(facts(&h.js).await.len(), 3);
    h.stop().await;
}

/// A manifest object that is not there (yet), or an upload bucket that does not exist, is
/// not an answer: the request is retried with backoff and, when its deliveries run out,
/// dead-lettered with the reason. No verdict is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_manifest_is_retried_then_dead_lettered_with_the_reason() {
    let h = Harness::start_worker(
        |tier| tier,
        |cfg| {
            cfg.max_attempts = 2;
            cfg.retry.initial = Duration::from_millis(100);
        },
    )
    .await;
    let files = vec![put(&h.source_root, "lab-a/up/late", "a.bin", b"a")];
    // lab-a's bucket exists (another manifest is in it); the referenced object does not.
    h.upload_manifest(PROJECT, &[FileRef::new("other", 1, sha256_hex(b"o"))])
        .await;
    let absent = ManifestRef {
        digest: version_digest(&files),
        files: 1,
        bytes: 1,
    };
    h.bus
        .publish(&request_in(
            PROJECT,
            "late-1",
            "lab-a/up/late",
            vec![],
            Some(absent.clone()),
        ))
        .await
        .unwrap();
    // lab-c never uploaded anything: it has no bucket at all.
    h.bus
        .publish(&request_in(
            "lab-c",
            "nobucket-1",
            "lab-c/up",
            vec![],
            Some(absent),
        ))
        .await
        .unwrap();

    let dead = wait_for(TIMEOUT, "two dead letters", || async {
        let letters: Vec<Event> = stream_messages(&h.js, subject::DEAD_LETTERS.name)
            .await
            .iter()
            .map(|m| m.event().unwrap())
            .collect();
        (letters.len() >= 2).then_some(letters)
    })
    .await
    .unwrap();
    for (id, reason) in [
        ("late-1", "no such object"),
        ("nobucket-1", "no such bucket"),
    ] {
        let letter = dead
            .iter()
            .find_map(|e| match &e.body {
                Body::DeadLetter(d) if d.original_id.as_ref().is_some_and(|o| o.as_str() == id) => {
                    Some(d)
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("no dead letter for {id}: {dead:?}"));
        assert_eq!(letter.service, SERVICE);
        assert_eq!(letter.delivered, 2, "{letter:?}");
        assert_eq!(letter.errors.len(), 2, "every attempt recorded: {letter:?}");
        for attempt in &letter.errors {
            assert!(!attempt.permanent);
            assert!(attempt.error.contains(reason), "{id}: {}", attempt.error);
        }
    }
    assert!(
        facts(&h.js).await.is_empty(),
        "a missing manifest decides nothing"
    );
    let stats = h.stop().await;
    assert_eq!((stats.retried, stats.dead_lettered), (2, 2), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_the_next_request_is_validated() {
    let h = Harness::start().await;
    let subject = subject::subject_for(&request("x", "", vec![]).body, PROJECT);
    let garbage = b"\xc1 this is not msgpack".to_vec();
    let unknown_kind = {
        let mut value = serde_json::to_value(request("unknown-kind-1", "", vec![])).unwrap();
        value["kind"] = "ingest.teleported".into();
        rmp_serde::to_vec_named(&value).unwrap()
    };
    // A well-formed event of a kind this service does not handle, on its subject.
    let wrong_kind = {
        let mut event = request("wrong-kind-1", "", vec![]);
        event.body = Body::StageReleased(stagehand_schemas::StageReleased {
            dataset: "cats".into(),
            version: "v".into(),
            tier: "hot".into(),
            job_id: "1".into(),
            node: None,
            reason: None,
        });
        wire::encode(&event).unwrap()
    };
    for (id, bytes) in [
        ("poison-1", &garbage),
        ("poison-2", &unknown_kind),
        ("poison-3", &wrong_kind),
    ] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        h.js.publish_with_headers(subject.clone(), headers, bytes.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let files = vec![put(
        &h.source_root,
        "lab-a/up/next",
        "a.txt",
        b"after the poison",
    )];
    h.bus
        .publish(&request("after-poison", "lab-a/up/next", files.clone()))
        .await
        .unwrap();

    let fact = fact_for(&h.js, "after-poison").await;
    assert!(
        matches!(fact.body, Body::DatasetValidated(ref v) if v.version == version_digest(&files))
    );

    let dead = wait_for(TIMEOUT, "three dead letters", || async {
        let letters: Vec<Event> = stream_messages(&h.js, subject::DEAD_LETTERS.name)
            .await
            .iter()
            .map(|m| m.event().unwrap())
            .collect();
        (letters.len() >= 3).then_some(letters)
    })
    .await
    .unwrap();
    let originals: Vec<Vec<u8>> = dead
        .iter()
        .map(|e| match &e.body {
            Body::DeadLetter(d) => {
                assert_eq!(d.service, SERVICE);
                assert!(!d.errors.is_empty(), "{d:?}");
                d.original.clone()
            }
            other => panic!("not a dead letter: {other:?}"),
        })
        .collect();
    for bytes in [&garbage, &unknown_kind, &wrong_kind] {
        assert!(originals.contains(bytes), "original bytes kept");
    }
    // Only the good request caused a fact.
    assert_eq!(facts(&h.js).await.len(), 1);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_published_fifty_times_is_validated_once() {
    let h = Harness::start().await;
    let files = vec![put(&h.source_root, "lab-a/up/dup", "a.txt", b"once")];
    let event = request("dup-1", "lab-a/up/dup", files);
    let bytes = wire::encode(&event).unwrap();
    let subject = subject::subject_for(&event.body, PROJECT);
    for i in 0..50 {
        // Half reuse the request's id (JetStream drops them); half carry a new message id, as
        // a producer that lost track would, and reach the validator's ledger.
        let msg_id = if i % 2 == 0 {
            "dup-1".to_owned()
        } else {
            format!("dup-1-resent-{i}")
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id.as_str());
        h.js.publish_with_headers(subject.clone(), headers, bytes.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let fact = fact_for(&h.js, "dup-1").await;
    assert!(matches!(fact.body, Body::DatasetValidated(_)));
    wait_idle(&h.js).await;
    let all = facts(&h.js).await;
    assert_eq!(all.len(), 1, "one validation fact: {all:?}");
    let stats = h.stop().await;
    assert_eq!(stats.handled, 1, "{stats:?}");
    // 26 messages were stored: one handled, every other copy answered from the ledger or the
    // claim, or — arriving while the first was in flight — acked as redundant.
    assert_eq!(stats.replayed + stats.redundant, 25, "{stats:?}");
}

/// The S3 source tier: read, reported beside the upload, and an object key over 1024 bytes
/// is that file's `path_rule`, found without a request to the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_source_tier_is_read_and_reported_too() {
    let nats = NatsServer::start();
    let s3 = S3Server::shared();
    let bucket = s3.unique_bucket("src");
    let tmp = tempfile::tempdir().unwrap();

    // The same policy checks apply; the tier itself is built with the server's keys.
    let policies_dir = tmp.path().join("policies");
    write_policies(&policies_dir, &tmp.path().join("unused"));
    let policies = Policies::load_dir_with_home(&policies_dir, tmp.path()).unwrap();
    let mut config = S3Config::new(&bucket, "tier");
    config.endpoint = Some(s3.endpoint());
    config.region = s3.region().to_owned();
    let tier = S3Tier::connect_with_keys("lake", config, s3.access_key(), s3.secret_key()).unwrap();
    let tiers = HashMap::from([("lake".to_owned(), (TierRole::Source, Some(Tier::S3(tier))))]);
    let checks = SourceChecks::from_parts(policies.validation().clone(), tiers);

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let js = bus.jetstream().clone();
    let state = tmp.path().join("state");
    let handler = IngestValidator::new(checks, js.clone(), ValidatorOptions::new(&state)).unwrap();
    let cfg = Settings::new(&policies_dir, &state).worker_config();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        bus.clone(),
        cfg,
        Arc::new(handler),
        shutdown.clone(),
    ));

    let prefix = "lab-a/up/s3";
    let mut files = Vec::new();
    for (path, body) in [("img/1.png", &b"one"[..]), ("img/2.png", &b"two"[..])] {
        s3.put_object(&bucket, &format!("tier/{prefix}/{path}"), body)
            .unwrap();
        files.push(FileRef::new(path, body.len() as u64, sha256_hex(body)));
    }
    let long_key = vec!["k".repeat(250); 4].join("/") + "/x.png";
    let mut good = request("s3-good", prefix, files.clone());
    let mut bad = request(
        "s3-bad",
        prefix,
        vec![
            files[0].clone(),
            FileRef::new("img/3.png", 1, sha256_hex(b"3")),
            FileRef::new(long_key.clone(), 1, sha256_hex(b"3")),
        ],
    );
    for event in [&mut good, &mut bad] {
        let Body::IngestRequested(r) = &mut event.body else {
            unreachable!()
        };
        r.source.tier = "lake".into();
    }
    bus.publish(&good).await.unwrap();
    bus.publish(&bad).await.unwrap();

    let fact = fact_for(&js, "s3-good").await;
    assert!(
        matches!(fact.body, Body::DatasetValidated(ref v) if v.version == version_digest(&files)),
        "{fact:?}"
    );
    let fact = fact_for(&js, "s3-bad").await;
    let expected = vec![
        ("missing".to_owned(), Some("img/3.png".to_owned())),
        ("path_rule".to_owned(), Some(long_key)),
    ];
    assert_eq!(problems_of(&fact), expected);
    assert!(rejection(&fact).problems[1].detail.contains("1024"));
    let report = s3
        .get_object(&bucket, &format!("tier/{}", report_path(PROJECT, &bad.id)))
        .unwrap();
    assert_eq!(report_problems(&report), expected);
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_policy_stops_the_service_at_start_naming_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let policies = tmp.path().join("policies");
    write_policies(&policies, &tmp.path().join("source"));
    std::fs::write(
        policies.join("validation.toml"),
        VALIDATION.replace("max_entries = 1000000", "max_entries = -3"),
    )
    .unwrap();
    // No server is needed: the policies are checked before connecting.
    let config = config("nats://127.0.0.1:1", &policies, tmp.path().join("state"));
    let err = run(config, CancellationToken::new()).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("validation.toml") && text.contains("max_entries"),
        "{text}"
    );
    assert!(!err.is_retryable());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_tier_is_retried_with_backoff_not_rejected() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let policies_dir = tmp.path().join("policies");
    write_policies(&policies_dir, &tmp.path().join("unused"));
    let policies = Policies::load_dir_with_home(&policies_dir, tmp.path()).unwrap();
    // Nothing listens on port 1: every read fails as unreachable.
    let mut config = S3Config::new("lake-bucket", "");
    config.endpoint = Some("http://127.0.0.1:1".into());
    let tier = S3Tier::connect_with_keys("lake", config, "key", "secret").unwrap();
    let tiers = HashMap::from([("lake".to_owned(), (TierRole::Source, Some(Tier::S3(tier))))]);
    let checks = SourceChecks::from_parts(policies.validation().clone(), tiers);

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let js = bus.jetstream().clone();
    let state = tmp.path().join("state");
    let handler = IngestValidator::new(checks, js.clone(), ValidatorOptions::new(&state)).unwrap();
    let mut cfg = Settings::new(&policies_dir, &state).worker_config();
    cfg.retry.initial = Duration::from_millis(100);
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        bus.clone(),
        cfg,
        Arc::new(handler),
        shutdown.clone(),
    ));

    let mut event = request(
        "unreachable-1",
        "lab-a/up",
        vec![FileRef::new("a", 1, sha256_hex(b"a"))],
    );
    let Body::IngestRequested(r) = &mut event.body else {
        unreachable!()
    };
    r.source.tier = "lake".into();
    bus.publish(&event).await.unwrap();

    wait_until(TIMEOUT, "the request to be delivered again", || async {
        let stream = js.get_stream(subject::REQUESTS.name).await.unwrap();
        stream
            .consumer_info(SERVICE)
            .await
            .is_ok_and(|info| info.delivered.stream_sequence >= 1 && info.num_redelivered >= 1)
    })
    .await
    .unwrap();
    shutdown.cancel();
    let stats = worker.await.unwrap().unwrap();
    assert!(stats.retried >= 1, "{stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert!(
        facts(&js).await.is_empty(),
        "an unreachable tier decides nothing"
    );
}
