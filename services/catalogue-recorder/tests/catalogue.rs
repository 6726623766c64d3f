//! The recorder against a real nats-server: live folding, rebuild from the stream, queries over
//! request/reply and the readiness bucket.

use std::time::Duration;

use anyhow::Context;
use async_nats::HeaderMap;
use stagehand_bus::runner;
use stagehand_bus::{Bus, BusConfig, CancellationToken, MSG_ID_HEADER};
use stagehand_catalogue_recorder::*;
use stagehand_schemas::*;
use stagehand_testkit::{NatsServer, wait_until};

const WAIT: Duration = Duration::from_secs(30);

fn files(n: u32) -> Vec<FileRef> {
    (0..n)
        .map(|i| {
            FileRef::new(
                format!("train/{i:04}.bin"),
                u64::from(i),
                sha256_hex(&[i as u8]),
            )
        })
        .collect()
}

fn ingest(n: u32, dataset: &str) -> Event {
    Event::request(
        EventId::new(format!("req-{dataset}-{n}")).unwrap(),
        "lab-a",
        Body::IngestRequested(IngestRequested {
            dataset: dataset.into(),
            source: Location {
                tier: "source".into(),
                prefix: format!("lab-a/{dataset}/{n}"),
            },
            files: files(n),
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    )
}

fn validated(req: &Event) -> Event {
    let Body::IngestRequested(p) = &req.body else {
        unreachable!()
    };
    req.caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: p.dataset.clone(),
            version: version_digest(&p.files),
            source: p.source.clone(),
            files: p.files.clone(),
            manifest: None,
            total_bytes: total_bytes(&p.files),
            requested_by: p.requested_by.clone(),
            request_id: req.id.clone(),
            labels: vec![("modality".into(), "image".into())],
        }),
    )
}

fn version(ev: &Event) -> String {
    match &ev.body {
        Body::DatasetValidated(p) => p.version.clone(),
        _ => unreachable!(),
    }
}

/// A mix of every kind of fact the catalogue folds.
fn facts() -> Vec<Event> {
    let mut out = Vec::new();
    let r1 = ingest(3, "cats");
    let v1 = validated(&r1);
    let v = version(&v1);
    let hot = Location {
        tier: "hot".into(),
        prefix: "cats".into(),
    };
    out.push(v1.clone());
    out.push(validated(&ingest(5, "cats")));
    out.push(validated(&ingest(2, "dogs")));
    let bad = ingest(4, "cats");
    out.push(bad.caused(
        "rejected",
        Body::DatasetRejected(DatasetRejected {
            dataset: "cats".into(),
            source: Location {
                tier: "source".into(),
                prefix: "x".into(),
            },
            declared_version: "0".repeat(64),
            requested_by: "mallory".into(),
            request_id: bad.id.clone(),
            problems: vec![
                Problem {
                    code: "path_rule".into(),
                    path: Some("../etc".into()),
                    detail: "`..`".into(),
                },
                Problem {
                    code: "missing".into(),
                    path: Some("gone".into()),
                    detail: "absent".into(),
                },
            ],
            quarantine: Some("quarantine/x".into()),
            problem_counts: vec![("missing".into(), 1), ("path_rule".into(), 1)],
            problems_total: Some(2),
        }),
    ));
    out.push(v1.caused(
        "replica:hot",
        Body::ReplicaCreated(ReplicaCreated {
            dataset: "cats".into(),
            version: v.clone(),
            location: hot.clone(),
            files: 3,
            total_bytes: 3,
            verified_by: "read-back".into(),
        }),
    ));
    out.push(v1.caused(
        "ready:job-1",
        Body::StageReady(StageReady {
            dataset: "cats".into(),
            version: v.clone(),
            location: hot.clone(),
            job_id: "job-1".into(),
            request_id: EventId::new("stage-1").unwrap(),
            node: None,
            path: None,
        }),
    ));
    out.push(v1.caused(
        "failed:job-2",
        Body::StageFailed(StageFailed {
            dataset: "cats".into(),
            version: v.clone(),
            tier: "local".into(),
            job_id: "job-2".into(),
            request_id: EventId::new("stage-2").unwrap(),
            reason: "quota exceeded".into(),
            retryable: false,
            node: None,
        }),
    ));
    out.push(v1.caused(
        "removed:hot",
        Body::ReplicaRemoved(ReplicaRemoved {
            dataset: "dogs".into(),
            version: "f".repeat(64),
            location: hot,
            reason: "idle".into(),
        }),
    ));
    out
}

fn dead_letter(seq: u64) -> Event {
    ingest(1, "cats").caused(
        &format!("dead:{seq}"),
        Body::DeadLetter(DeadLetter {
            service: "ingest-validator".into(),
            stream: "STAGEHAND_REQUESTS".into(),
            consumer: "ingest-validator".into(),
            stream_sequence: seq,
            subject: "stagehand.req.ingest.requested.lab-a".into(),
            delivered: 8,
            original: vec![0xc1],
            headers: vec![],
            errors: vec![],
            original_id: None,
        }),
    )
}

/// Publishes `event` a second time under another `Nats-Msg-Id`, so that the stream holds two
/// copies — what a redelivery or a producer retry outside the duplicate window looks like.
async fn publish_copy(bus: &Bus, event: &Event) -> anyhow::Result<()> {
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, format!("{}-copy", event.id).as_str());
    bus.jetstream()
        .publish_with_headers(
            subject::subject_for(&event.body, &event.project),
            headers,
            wire::encode(event)?.into(),
        )
        .await?
        .await?;
    Ok(())
}

async fn drained(bus: &Bus, stream: &str, consumer: &str) -> bool {
    let Ok(s) = bus.jetstream().get_stream(stream).await else {
        return false;
    };
    match s.consumer_info(consumer).await {
        Ok(info) => {
            info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence > 0
        }
        Err(_) => false,
    }
}

struct Running {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<RecorderStats, RecorderError>>,
}

fn start(bus: &Bus, dir: &std::path::Path) -> Running {
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve(runner::Context::new(
        SERVICE,
        RecorderConfig::under(dir),
        bus.clone(),
        shutdown.clone(),
    )));
    Running { shutdown, task }
}

impl Running {
    async fn stop(self) -> anyhow::Result<RecorderStats> {
        self.shutdown.cancel();
        Ok(self.task.await??)
    }
}

async fn setup() -> anyhow::Result<(NatsServer, Bus)> {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    Ok((nats, bus))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalogue_rebuilt_from_the_stream_equals_the_one_built_live() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let live_dir = dir.path().join("live");
    let live = start(&bus, &live_dir);
    let client = bus.client().clone();
    // Publish only once it runs live, so that everything below reaches it through the consumer.
    wait_until(WAIT, "the live recorder to answer", || async {
        ask(&client, &Query::DeadLetters, Duration::from_secs(2))
            .await
            .is_ok()
    })
    .await?;

    let facts = facts();
    for fact in &facts {
        bus.publish(fact).await?;
        // The same id again: JetStream's duplicate window drops it.
        assert!(bus.publish(fact).await?.duplicate);
    }
    // Copies that do reach the stream, as redeliveries do: the fold must count them once.
    publish_copy(&bus, &facts[0]).await?;
    publish_copy(&bus, &facts[3]).await?;
    let dead = [dead_letter(1), dead_letter(2)];
    for letter in &dead {
        bus.publish(letter).await?;
    }
    // A redelivered copy carries the same bytes (the same `occurred_at`); a copy made later
    // would be a newer fact whose fold order against the second letter decides the record.
    publish_copy(&bus, &dead[0]).await?;

    wait_until(WAIT, "the live recorder to fold every fact", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
            && drained(&bus, subject::DEAD_LETTERS.name, "catalogue-recorder-dlq").await
    })
    .await?;
    let stats = live.stop().await?;
    assert_eq!(
        stats.rebuilt,
        Some((0, 0)),
        "a fresh store against empty streams"
    );
    let live_store = Store::open(live_dir.join("catalogue.redb"))?;
    let live_dump = live_store.dump()?;
    assert_eq!(
        live_dump.applied.len(),
        facts.len() + 2,
        "copies applied once"
    );

    // A second recorder with no store: it rebuilds from the stream, then runs live.
    let rebuilt_dir = dir.path().join("rebuilt");
    let rebuilt = start(&bus, &rebuilt_dir);
    wait_until(WAIT, "the rebuilt recorder to answer", || async {
        matches!(
            ask(&client, &Query::DeadLetters, Duration::from_secs(2)).await,
            Ok(Answer::DeadLetters { .. })
        )
    })
    .await?;
    let stats = rebuilt.stop().await?;
    assert_eq!(stats.rebuilt, Some((facts.len() as u64 + 2, 3)));
    let rebuilt_dump = Store::open(rebuilt_dir.join("catalogue.redb"))?.dump()?;
    assert_eq!(rebuilt_dump, live_dump);

    let dead: DeadLetterRecord = fold::decode(
        "L",
        &live_store
            .get(&fold::key('L', &["ingest-validator"]))?
            .context("dead letters")?,
    )?;
    assert_eq!(dead.count, 2);

    // Restarting on a complete store does not rebuild.
    drop(live_store);
    let again = start(&bus, &live_dir);
    wait_until(WAIT, "the restarted recorder to answer", || async {
        ask(&client, &Query::DeadLetters, Duration::from_secs(2))
            .await
            .is_ok()
    })
    .await?;
    assert_eq!(again.stop().await?.rebuilt, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_over_request_reply_and_readiness_in_kv() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let facts = facts();
    for fact in &facts {
        bus.publish(fact).await?;
    }
    let client = bus.client().clone();
    let q = |query: Query| {
        let client = client.clone();
        async move { ask(&client, &query, Duration::from_secs(5)).await }
    };
    wait_until(WAIT, "every fact folded", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
    })
    .await?;

    let Answer::Datasets { datasets } = q(Query::Datasets { project: None }).await? else {
        anyhow::bail!("not a datasets answer")
    };
    let names: Vec<&str> = datasets.iter().map(|d| d.dataset.as_str()).collect();
    assert_eq!(names, ["cats", "dogs"]);

    let Answer::Dataset(cats) = q(Query::Dataset {
        project: "lab-a".into(),
        dataset: "cats".into(),
    })
    .await?
    else {
        anyhow::bail!("not a dataset answer")
    };
    assert_eq!(cats.versions.len(), 2);
    assert_eq!(cats.rejections.len(), 1);
    assert_eq!(cats.rejections[0].problems.len(), 2, "every reason kept");
    let v1 = version(&facts[0]);
    let hot = cats
        .replicas
        .iter()
        .find(|r| r.tier == "hot" && r.version == v1)
        .context("hot replica")?;
    assert_eq!(hot.state, ReplicaState::Present);
    assert_eq!(hot.verified_by.as_deref(), Some("read-back"));
    let v = cats
        .versions
        .iter()
        .find(|x| x.version == v1)
        .context("v1")?;
    assert_eq!(v.provenance.by, "alice");
    assert_eq!(
        v.provenance.labels,
        vec![("modality".to_string(), "image".to_string())]
    );

    let Answer::Version(detail) = q(Query::Version {
        project: "lab-a".into(),
        dataset: "cats".into(),
        version: v1[..10].into(),
    })
    .await?
    else {
        anyhow::bail!("not a version answer")
    };
    assert_eq!(detail.files.len(), 3);
    assert_eq!(detail.version.file_count, 3);

    let missing = q(Query::Dataset {
        project: "lab-a".into(),
        dataset: "nope".into(),
    })
    .await?;
    assert!(
        matches!(
            missing,
            Answer::Error {
                code: ErrorCode::NotFound,
                ..
            }
        ),
        "{missing:?}"
    );

    // A malformed query gets an error answer, not silence.
    let reply = client
        .request(
            subject::CATALOGUE_QUERY,
            "{\"query\":\"frobnicate\"}".into(),
        )
        .await?;
    let answer: Answer = serde_json::from_slice(&reply.payload)?;
    assert!(matches!(
        answer,
        Answer::Error {
            code: ErrorCode::BadQuery,
            ..
        }
    ));

    // Readiness mirrored into the KV bucket a scheduler watches.
    let kv = bus.jetstream().get_key_value(readiness::BUCKET).await?;
    let key = format!("lab-a.cats.{v1}.hot");
    let value = kv.get(&key).await?.context("hot readiness key")?;
    let ready: TierReadiness = serde_json::from_slice(&value)?;
    assert!(ready.ready);
    assert_eq!(ready.jobs.get("job-1"), Some(&StageState::Ready));
    let value = kv
        .get(format!("lab-a.cats.{v1}.local"))
        .await?
        .context("local readiness key")?;
    let local: TierReadiness = serde_json::from_slice(&value)?;
    assert!(!local.ready);
    assert_eq!(local.reason.as_deref(), Some("quota exceeded"));

    recorder.stop().await?;
    Ok(())
}
