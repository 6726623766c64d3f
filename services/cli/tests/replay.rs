//! `stagehand dlq replay` redoes the work. An ingest request whose S3 source tier cannot be
//! reached is retried until the validator gives up and dead-letters it; once the tier is
//! back, the dead letter is replayed and the real validator validates the upload. `dlq list`
//! shows who replayed it, and a dead letter from a subject that is no request or fact is
//! refused.
//!
//! The tier's endpoint is a loopback port on which nothing listens (connections are refused,
//! as from a stopped server) until the test forwards it to the real SeaweedFS server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use stagehand::dlq;
use stagehand_bus::{Bus, BusConfig, CancellationToken, run_worker};
use stagehand_ingest_validator::{
    IngestValidator, SERVICE, Settings, SourceChecks, ValidatorOptions,
};
use stagehand_mover::Tier;
use stagehand_mover::s3::{S3Config, S3Tier};
use stagehand_policy::{Policies, TierRole};
use stagehand_schemas::{
    Body, Event, EventId, FileRef, IngestRequested, Location, sha256_hex, subject, version_digest,
};
use stagehand_testkit::{NatsServer, S3Server, wait_for, wait_until};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(60);

/// A port nobody listens on yet: taken from the kernel, then let go.
async fn idle_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

/// Forwards every connection to `port` on to `to`, until the task is aborted.
async fn forward(port: u16, to: SocketAddr) -> tokio::task::JoinHandle<()> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    })
}

fn write_policies(dir: &std::path::Path) {
    std::fs::create_dir_all(dir.join("unused")).unwrap();
    std::fs::write(
        dir.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n",
            dir.join("unused").display()
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("validation.toml"),
        "max_file_size = \"1 MiB\"\nmax_entries = 1000\nmax_total_bytes = \"100 MiB\"\n\
         allowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dead_lettered_while_its_tier_was_unreachable_is_validated_after_replay() {
    let nats = NatsServer::start();
    let s3 = S3Server::shared();
    let bucket = s3.unique_bucket("replay");
    let tmp = tempfile::tempdir().unwrap();
    let policies_dir = tmp.path().join("policies");
    write_policies(&policies_dir);
    let policies = Policies::load_dir_with_home(&policies_dir, tmp.path()).unwrap();

    let port = idle_port().await;
    let mut s3_config = S3Config::new(&bucket, "tier");
    s3_config.endpoint = Some(format!("http://127.0.0.1:{port}"));
    s3_config.region = s3.region().to_owned();
    let tier =
        S3Tier::connect_with_keys("lake", s3_config, s3.access_key(), s3.secret_key()).unwrap();
    let tiers = HashMap::from([("lake".to_owned(), (TierRole::Source, Some(Tier::S3(tier))))]);
    let checks = SourceChecks::from_parts(policies.validation().clone(), tiers);

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let state = tmp.path().join("state");
    let validator = IngestValidator::new(
        checks,
        bus.jetstream().clone(),
        ValidatorOptions::new(&state),
    )
    .unwrap();
    let mut cfg = Settings::new(&policies_dir, &state).worker_config();
    cfg.max_attempts = 2;
    cfg.retry.initial = Duration::from_millis(100);
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        bus.clone(),
        cfg,
        Arc::new(validator),
        shutdown.clone(),
    ));

    let mut files = Vec::new();
    for (path, body) in [("img/1.png", &b"one"[..]), ("img/2.png", &b"two"[..])] {
        s3.put_object(&bucket, &format!("tier/lab-a/cats/{path}"), body)
            .unwrap();
        files.push(FileRef::new(path, body.len() as u64, sha256_hex(body)));
    }
    let request = Event::request(
        EventId::new("cats-upload-1").unwrap(),
        "lab-a",
        Body::IngestRequested(IngestRequested {
            dataset: "cats".into(),
            source: Location {
                tier: "lake".into(),
                prefix: "lab-a/cats".into(),
            },
            files: files.clone(),
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    );
    bus.publish(&request).await.unwrap();

    // Unreachable: retried, then given up on.
    let listed = wait_for(WAIT, "the request dead-lettered", || async {
        let items = dlq::list(&bus, Some(SERVICE)).await.ok()?;
        (items.len() == 1).then_some(items)
    })
    .await
    .unwrap();
    assert_eq!(listed[0].original_id.as_deref(), Some("cats-upload-1"));
    assert_eq!(listed[0].delivered, 2, "{listed:?}");
    assert!(listed[0].replays.is_empty());

    // The tier is back; on-call replays the dead letter.
    let forwarder = forward(port, ([127, 0, 0, 1], s3.port()).into()).await;
    let replayed = dlq::replay_as(&bus, listed[0].sequence, "oncall@example")
        .await
        .unwrap();
    assert_eq!(replayed.subject, "stagehand.req.ingest.requested.lab-a");
    let js = bus.jetstream().clone();
    let verdict = wait_for(WAIT, "the replayed request's verdict", || async {
        stagehand_testkit::facts_caused_by(&js, &request.id)
            .await
            .into_iter()
            .next()
    })
    .await
    .unwrap();
    let Body::DatasetValidated(v) = &verdict.body else {
        panic!("expected a validation, got {verdict:?}")
    };
    assert_eq!(v.version, version_digest(&files));

    // On-call can see who replayed what, and when.
    let listed = dlq::list(&bus, Some(SERVICE)).await.unwrap();
    assert_eq!(listed.len(), 1, "the replay record is not a dead letter");
    assert_eq!(listed[0].replays.len(), 1);
    assert_eq!(listed[0].replays[0].replayed_by, "oncall@example");
    assert_eq!(listed[0].replays[0].replay_msg_id, replayed.msg_id);
    assert!(dlq::list_text(&listed).contains("oncall@example"));

    shutdown.cancel();
    let stats = worker.await.unwrap().unwrap();
    assert_eq!((stats.dead_lettered, stats.handled), (1, 1), "{stats:?}");
    forwarder.abort();

    wait_until(WAIT, "the validator idle", || {
        stagehand_testkit::drained(&js, subject::REQUESTS.name, &[SERVICE])
    })
    .await
    .unwrap();
}

/// A dead letter carries the subject its message came from; replaying onto anything but a
/// request or fact subject (a dead letter of dead letters, say) is refused, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_refuses_a_message_that_was_not_on_a_request_or_fact_subject() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let dl_id = EventId::for_dead_letter(subject::DEAD_LETTERS.name, "recorder-dlq", 7);
    let dead = Event {
        id: dl_id.clone(),
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: "unknown".into(),
        correlation_id: dl_id,
        causation_id: None,
        body: Body::DeadLetter(stagehand_schemas::DeadLetter {
            service: "recorder-dlq".into(),
            stream: subject::DEAD_LETTERS.name.into(),
            consumer: "recorder-dlq".into(),
            stream_sequence: 7,
            subject: "stagehand.dlq.dead.letter.ingest-validator".into(),
            delivered: 1,
            original: vec![1, 2, 3],
            headers: vec![],
            errors: vec![],
            original_id: None,
        }),
    };
    let ack = bus.publish(&dead).await.unwrap();
    let err = dlq::replay_as(&bus, ack.sequence, "oncall")
        .await
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("stagehand.dlq.dead.letter.ingest-validator")
            && text.contains("only request"),
        "{text}"
    );
    let mut dlq_stream = bus
        .jetstream()
        .get_stream(subject::DEAD_LETTERS.name)
        .await
        .unwrap();
    assert_eq!(
        dlq_stream.info().await.unwrap().state.messages,
        1,
        "nothing republished, nothing recorded"
    );
}

/// A dead letter of `service` (consumer of the same name on `stream`) carrying `original`,
/// the message at sequence `at`, from `subject` with `headers`, published on the service's dead-letter subject as the
/// service would; returns its sequence in the dead-letter stream.
async fn dead_letter_of(
    bus: &Bus,
    at: u64,
    service: &str,
    stream: &str,
    subject: &str,
    headers: &[(&str, &str)],
    original: Vec<u8>,
) -> u64 {
    let id = EventId::for_dead_letter(stream, service, at);
    let dead = Event {
        id: id.clone(),
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: "unknown".into(),
        correlation_id: id,
        causation_id: None,
        body: Body::DeadLetter(stagehand_schemas::DeadLetter {
            service: service.into(),
            stream: stream.into(),
            consumer: service.into(),
            stream_sequence: at,
            subject: subject.into(),
            delivered: 1,
            original,
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            errors: vec![],
            original_id: None,
        }),
    };
    bus.publish(&dead).await.unwrap().sequence
}

async fn requests_stored(bus: &Bus) -> u64 {
    let mut s = bus
        .jetstream()
        .get_stream(subject::REQUESTS.name)
        .await
        .unwrap();
    s.info().await.unwrap().state.messages
}

/// Regression: `dlq replay` republished, as the operator, whatever subject and headers a dead
/// letter held. A tenant whose message was dead-lettered could have the replay carry headers
/// it chose, or land on a request subject it may not use. Now the replay keeps only the trace
/// context (and rebuilds `Nats-Msg-Id` and `Stagehand-Replay`), naming what it dropped, and
/// refuses a subject that the dead letter's service does not consume, or a service with no
/// consumer on the stream named, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_only_stagehands_headers_and_the_subjects_the_service_consumes() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    // The validator's durable consumer, as its runtime declares it.
    let cfg = Settings::new(
        std::path::Path::new("/nonexistent"),
        std::path::Path::new("/nonexistent"),
    )
    .worker_config();
    stagehand_bus::provision_consumer(&bus, &cfg).await.unwrap();
    let ingest = "stagehand.req.ingest.requested.labb";
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    let seq = dead_letter_of(
        &bus,
        1,
        SERVICE,
        subject::REQUESTS.name,
        ingest,
        &[
            ("Nats-Msg-Id", "tenant-chosen"),
            ("Stagehand-Replay", "tenant-chosen"),
            ("X-Forged", "by labb"),
            ("traceparent", traceparent),
        ],
        b"\xc1 undecodable".to_vec(),
    )
    .await;
    let replayed = dlq::replay_as(&bus, seq, "oncall").await.unwrap();
    assert_eq!(replayed.subject, ingest);
    assert_eq!(replayed.dropped_headers, ["X-Forged"]);
    let stream = bus
        .jetstream()
        .get_stream(subject::REQUESTS.name)
        .await
        .unwrap();
    let copy = stream
        .get_raw_message(replayed.stream_sequence)
        .await
        .unwrap();
    let mut names: Vec<String> = copy
        .headers
        .iter()
        .map(|(k, _)| k.to_string().to_ascii_lowercase())
        .collect();
    names.sort();
    assert_eq!(names, ["nats-msg-id", "stagehand-replay", "traceparent"]);
    assert_eq!(
        copy.headers.get("traceparent").unwrap().as_str(),
        traceparent
    );
    assert_eq!(
        copy.headers.get("Nats-Msg-Id").unwrap().as_str(),
        replayed.msg_id
    );

    // A request subject the validator does not consume (a release an uploader may not publish).
    let before = requests_stored(&bus).await;
    let release = "stagehand.req.stage.released.labb";
    let seq = dead_letter_of(
        &bus,
        2,
        SERVICE,
        subject::REQUESTS.name,
        release,
        &[],
        b"\xc1".to_vec(),
    )
    .await;
    let err = dlq::replay_as(&bus, seq, "oncall").await.unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains(release) && text.contains("does not consume") && text.contains(SERVICE),
        "{text}"
    );

    // A service with no consumer on the stream it names: nothing says what it consumes.
    let seq = dead_letter_of(
        &bus,
        3,
        "ghost",
        subject::REQUESTS.name,
        ingest,
        &[],
        b"\xc1".to_vec(),
    )
    .await;
    let err = dlq::replay_as(&bus, seq, "oncall").await.unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("no consumer") && text.contains("ghost"),
        "{text}"
    );
    assert_eq!(requests_stored(&bus).await, before, "nothing republished");
}
