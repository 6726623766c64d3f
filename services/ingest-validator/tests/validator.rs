//! The ingest validator against a real nats-server with JetStream and real posix and S3
//! source tiers: good uploads are validated with the right digest, bad ones rejected once
//! with every problem, poison messages dead-lettered without affecting the next request,
//! and a request published many times validated once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use stagehand_bus::{Bus, BusConfig, CancellationToken, WorkerStats, run_worker};
use stagehand_ingest_validator::{IngestValidator, SERVICE, Settings, config, marker_path, run};
use stagehand_mover::Tier;
use stagehand_mover::s3::{S3Config, S3Tier};
use stagehand_policy::{Policies, TierRole};
use stagehand_schemas::{
    Body, Event, EventId, FileRef, IngestRequested, Location, sha256_hex, subject, version_digest,
    wire,
};
use stagehand_testkit::{NatsServer, S3Server, wait_for, wait_until};

const TIMEOUT: Duration = Duration::from_secs(60);
const PROJECT: &str = "lab-a";

const VALIDATION: &str = r#"
max_file_size = "1 MiB"
max_entries = 1000
max_total_bytes = "100 MiB"
allowed_suffixes = []
denied_suffixes = [".exe"]
allow_hidden = false
"#;

fn write_policies(dir: &Path, source_root: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"hot\"\ncapacity = \"1 GiB\"\n",
            source_root.display()
        ),
    )
    .unwrap();
    std::fs::write(dir.join("validation.toml"), VALIDATION).unwrap();
}

/// A nats-server, a posix source tier in a temp dir, and the validator running in-process.
struct Harness {
    _nats: NatsServer,
    _tmp: tempfile::TempDir,
    source_root: PathBuf,
    bus: Bus,
    js: jetstream::Context,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<WorkerStats>,
}

impl Harness {
    async fn start() -> Harness {
        let nats = NatsServer::start();
        let tmp = tempfile::tempdir().unwrap();
        let source_root = tmp.path().join("source");
        std::fs::create_dir_all(&source_root).unwrap();
        let policies = tmp.path().join("policies");
        write_policies(&policies, &source_root);
        let mut config = config(&nats.url(), &policies, tmp.path().join("state"));
        config.service.read_concurrency = 4;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(config, shutdown.clone()));
        let task = tokio::spawn(async move { task.await.unwrap().expect("validator run") });
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        let js = bus.jetstream().clone();
        Harness {
            _nats: nats,
            _tmp: tmp,
            source_root,
            bus,
            js,
            shutdown,
            task,
        }
    }

    async fn stop(self) -> WorkerStats {
        self.shutdown.cancel();
        self.task.await.unwrap()
    }
}

/// Writes `bytes` at `rel` beneath `root` and returns its manifest entry (path relative to
/// `prefix`).
fn put(root: &Path, prefix: &str, path: &str, bytes: &[u8]) -> FileRef {
    let full = root.join(prefix).join(path);
    std::fs::create_dir_all(full.parent().unwrap()).unwrap();
    std::fs::write(full, bytes).unwrap();
    FileRef::new(path, bytes.len() as u64, sha256_hex(bytes))
}

fn request(id: &str, prefix: &str, files: Vec<FileRef>) -> Event {
    Event::request(
        EventId::new(id).unwrap(),
        PROJECT,
        Body::IngestRequested(IngestRequested {
            dataset: "cats".into(),
            source: Location {
                tier: "source".into(),
                prefix: prefix.into(),
            },
            files,
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![("modality".into(), "image".into())],
        }),
    )
}

/// Every message in a stream, in order.
async fn stream_messages(
    js: &jetstream::Context,
    stream: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let info = stream.info().await.unwrap().clone();
    let mut out = Vec::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        if info.state.messages == 0 {
            break;
        }
        if let Ok(msg) = stream.get_raw_message(seq).await {
            out.push(msg);
        }
    }
    out
}

async fn facts(js: &jetstream::Context) -> Vec<Event> {
    stream_messages(js, subject::FACTS.name)
        .await
        .iter()
        .map(|m| wire::decode(&m.payload).expect("facts decode"))
        .collect()
}

async fn facts_caused_by(js: &jetstream::Context, id: &str) -> Vec<Event> {
    facts(js)
        .await
        .into_iter()
        .filter(|e| e.causation_id.as_ref().is_some_and(|c| c.as_str() == id))
        .collect()
}

/// Waits for the first fact caused by request `id`.
async fn fact_for(js: &jetstream::Context, id: &str) -> Event {
    wait_for(TIMEOUT, &format!("a fact caused by {id}"), || async {
        facts_caused_by(js, id).await.into_iter().next()
    })
    .await
    .unwrap()
}

/// Waits until the validator's consumer has acked (or terminated) everything in the stream.
async fn wait_idle(js: &jetstream::Context) {
    wait_until(TIMEOUT, "the validator to finish every request", || async {
        let mut stream = js.get_stream(subject::REQUESTS.name).await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let Ok(info) = stream.consumer_info(SERVICE).await else {
            return false;
        };
        info.ack_floor.stream_sequence >= last && info.num_ack_pending == 0
    })
    .await
    .unwrap();
}

fn problems_of(event: &Event) -> Vec<(String, Option<String>)> {
    let Body::DatasetRejected(r) = &event.body else {
        panic!("expected a rejection, got {event:?}")
    };
    r.problems
        .iter()
        .map(|p| (p.code.clone(), p.path.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_upload_is_validated_with_its_version_digest() {
    let h = Harness::start().await;
    let files = vec![
        put(&h.source_root, "up/cats-1", "train/0001.jpg", b"meow"),
        put(
            &h.source_root,
            "up/cats-1",
            "train/0002.jpg",
            &vec![7u8; 300_000],
        ),
        put(&h.source_root, "up/cats-1", "labels.csv", b""),
    ];
    let event = request("good-1", "up/cats-1", files.clone());
    h.bus.publish(&event).await.unwrap();

    let fact = fact_for(&h.js, "good-1").await;
    assert_eq!(fact.id, EventId::derive(&event.id, "validated"));
    assert_eq!(fact.correlation_id.as_str(), "good-1");
    assert_eq!(fact.project, PROJECT);
    let Body::DatasetValidated(v) = &fact.body else {
        panic!("expected dataset.validated, got {fact:?}")
    };
    assert_eq!(v.version, version_digest(&files));
    assert_eq!(v.files, files);
    assert_eq!(v.total_bytes, 300_004);
    assert_eq!(v.request_id.as_str(), "good-1");
    assert_eq!(v.requested_by, "alice");
    assert_eq!(v.labels, vec![("modality".to_owned(), "image".to_owned())]);
    let stats = h.stop().await;
    assert_eq!(stats.handled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_upload_is_rejected_once_with_every_problem_and_marked_not_deleted() {
    let h = Harness::start().await;
    let prefix = "up/bad";
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
    assert_eq!(
        problems_of(&fact),
        vec![
            want("path_rule", "../x"),
            want("path_rule", "/etc/passwd"),
            want("duplicate_path", "ok.bin"),
            want("suffix_denied", "tool.exe"),
            want("too_large", "huge.bin"),
            want("symlink_escape", "escape"),
            want("size_mismatch", "short.bin"),
            want("checksum_mismatch", "corrupt.bin"),
            want("missing", "gone.bin"),
            want("not_a_file", "a-directory"),
        ]
    );
    let Body::DatasetRejected(rejected) = &fact.body else {
        unreachable!()
    };
    assert_eq!(rejected.declared_version, version_digest(&files));
    assert_eq!(rejected.request_id.as_str(), "bad-1");
    let marker_rel = marker_path(PROJECT, &event.id);
    let quarantine = rejected.quarantine.as_deref().expect("quarantine location");
    assert!(quarantine.contains(&marker_rel), "{quarantine}");
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join(&marker_rel)).unwrap()).unwrap();
    assert_eq!(marker["request_id"], "bad-1");
    assert_eq!(marker["problems"].as_array().unwrap().len(), 10);
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
    let files = vec![put(&h.source_root, "up/next", "a.txt", b"after the poison")];
    h.bus
        .publish(&request("after-poison", "up/next", files.clone()))
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
            .map(|m| wire::decode(&m.payload).unwrap())
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
    let files = vec![put(&h.source_root, "up/dup", "a.txt", b"once")];
    let event = request("dup-1", "up/dup", files);
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
    // 26 messages were stored: one handled, every other copy answered from the ledger.
    assert_eq!(stats.replayed, 25, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_source_tier_is_read_and_marked_too() {
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
    let handler = IngestValidator::from_parts(policies.validation().clone(), tiers, 4);

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let js = bus.jetstream().clone();
    let cfg = Settings::new(&policies_dir, tmp.path().join("state")).worker_config();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        bus.clone(),
        cfg,
        Arc::new(handler),
        shutdown.clone(),
    ));

    let mut files = Vec::new();
    for (path, body) in [("img/1.png", &b"one"[..]), ("img/2.png", &b"two"[..])] {
        s3.put_object(&bucket, &format!("tier/up/s3/{path}"), body)
            .unwrap();
        files.push(FileRef::new(path, body.len() as u64, sha256_hex(body)));
    }
    let mut good = request("s3-good", "up/s3", files.clone());
    let mut bad = request(
        "s3-bad",
        "up/s3",
        vec![
            files[0].clone(),
            FileRef::new("img/3.png", 1, sha256_hex(b"3")),
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
    assert_eq!(
        problems_of(&fact),
        vec![("missing".to_owned(), Some("img/3.png".to_owned()))]
    );
    let marker = s3
        .get_object(&bucket, &format!("tier/{}", marker_path(PROJECT, &bad.id)))
        .unwrap();
    let marker: serde_json::Value = serde_json::from_slice(&marker).unwrap();
    assert_eq!(marker["problems"][0]["code"], "missing");
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
        VALIDATION.replace("max_entries = 1000", "max_entries = -3"),
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
    let handler = IngestValidator::from_parts(policies.validation().clone(), tiers, 4);

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let js = bus.jetstream().clone();
    let mut cfg = Settings::new(&policies_dir, tmp.path().join("state")).worker_config();
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
        "",
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
