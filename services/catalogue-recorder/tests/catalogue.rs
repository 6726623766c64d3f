//! The recorder against a real nats-server: live folding, rebuild from the stream, queries over
//! request/reply, versions of any size by reference, and the readiness bucket.

use std::time::Duration;

use anyhow::Context;
use async_nats::HeaderMap;
use futures::TryStreamExt;
use stagehand_bus::runner;
use stagehand_bus::{Bus, BusConfig, CancellationToken, MSG_ID_HEADER};
use stagehand_catalogue::*;
use stagehand_catalogue_recorder::{
    FoldItem, RecorderError, RecorderStats, SERVICE, Settings, Store, serve,
};
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore};
use stagehand_schemas::*;
use stagehand_testkit::{NatsServer, wait_until};

const WAIT: Duration = Duration::from_secs(30);

fn files(n: u32, tag: &str) -> Vec<FileRef> {
    (0..n)
        .map(|i| {
            FileRef::new(
                format!("{tag}/{i:07}.bin"),
                u64::from(i),
                sha256_hex(&i.to_le_bytes()),
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
            files: files(n, "train"),
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

/// A `dataset.validated` whose manifest is in the services' manifest bucket, by reference;
/// the manifest is put there unless `put` is false.
async fn by_reference(
    bus: &Bus,
    request: &str,
    dataset: &str,
    files: Vec<FileRef>,
    put: bool,
) -> anyhow::Result<(Event, Manifest)> {
    let manifest = Manifest::from_entries(files);
    if put {
        ManifestStore::catalogue(bus.jetstream(), BucketOptions::default())
            .await?
            .put(&manifest)
            .await?;
    }
    let req = Event::request(
        EventId::new(request)?,
        "lab-a",
        Body::IngestRequested(IngestRequested {
            dataset: dataset.into(),
            source: Location {
                tier: "source".into(),
                prefix: format!("lab-a/{dataset}"),
            },
            files: vec![],
            manifest: Some(manifest.reference()),
            requested_by: "alice".into(),
            labels: vec![],
        }),
    );
    let fact = req.caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: dataset.into(),
            version: manifest.digest().to_owned(),
            source: Location {
                tier: "source".into(),
                prefix: format!("lab-a/{dataset}"),
            },
            files: vec![],
            manifest: Some(manifest.reference()),
            total_bytes: manifest.bytes(),
            requested_by: "alice".into(),
            request_id: req.id.clone(),
            labels: vec![],
        }),
    );
    Ok((fact, manifest))
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
        prefix: "lab-a/cats/hot".into(),
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
                Problem::new("path_rule", Some("../etc"), "`..`"),
                Problem::new("missing", Some("gone"), "absent"),
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
            node: None,
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
            node: None,
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

/// Whether `consumer` has taken something and handled everything (the testkit's drained
/// check, which also notices a message dropped at `max_deliver`).
async fn drained(bus: &Bus, stream: &str, consumer: &str) -> bool {
    stagehand_testkit::drained_through(bus.jetstream(), stream, consumer)
        .await
        .is_some_and(|delivered| delivered > 0)
}

async fn dead_letters_stored(bus: &Bus) -> anyhow::Result<u64> {
    let mut s = bus
        .jetstream()
        .get_stream(subject::DEAD_LETTERS.name)
        .await?;
    Ok(s.info().await?.state.messages)
}

struct Running {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<RecorderStats, RecorderError>>,
}

fn start(bus: &Bus, dir: &std::path::Path) -> Running {
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve(runner::Context::new(
        SERVICE,
        Settings::under(dir),
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

async fn answering(catalogue: &Catalogue) -> anyhow::Result<()> {
    wait_until(WAIT, "the recorder to answer", || async {
        catalogue
            .ask(&Query::DeadLetters {
                limit: None,
                after: None,
            })
            .await
            .is_ok()
    })
    .await?;
    Ok(())
}

fn catalogue(bus: &Bus) -> Catalogue {
    Catalogue::new(bus.client().clone()).with_timeout(Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalogue_rebuilt_from_the_stream_equals_the_one_built_live() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let live_dir = dir.path().join("live");
    let live = start(&bus, &live_dir);
    let cat = catalogue(&bus);
    // Publish only once it runs live, so that everything below reaches it through the consumer.
    answering(&cat).await?;

    let mut facts = facts();
    // A stage request and its release come from the requests stream.
    let stage = Event::request(
        EventId::for_stage(
            "lab-a",
            "job-9",
            "cats",
            &version(&facts[0])[..12],
            "hot",
            None,
        ),
        "lab-a",
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: version(&facts[0])[..12].into(),
            tier: "hot".into(),
            job_id: "job-9".into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    );
    bus.publish(&stage).await?;
    // A version by reference, of more files than may travel inline.
    let (big, _) = by_reference(&bus, "req-big", "cats", files(5000, "big"), true).await?;
    facts.push(big);
    for fact in &facts {
        bus.publish(fact).await?;
        // The same id again: JetStream's duplicate window drops it.
        assert!(bus.publish(fact).await?.duplicate);
    }
    // Copies that do reach the stream, as redeliveries do: the fold must count them once.
    publish_copy(&bus, &facts[0]).await?;
    publish_copy(&bus, &facts[3]).await?;
    let dead = [dead_letter(1), dead_letter(2)];
    for d in &dead {
        bus.publish(d).await?;
    }
    // A copy is the same bytes (a redelivery, a republished message), not a new fact that
    // happens to reuse an id.
    publish_copy(&bus, &dead[0]).await?;

    wait_until(WAIT, "the live recorder to fold every fact", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
            && drained(&bus, subject::DEAD_LETTERS.name, "catalogue-recorder-dlq").await
            && drained(&bus, subject::REQUESTS.name, "catalogue-recorder-stages").await
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
        live_dump.rows("applied").len(),
        facts.len() + 3,
        "copies applied once"
    );
    assert_eq!(live_store.problem_count()?, 0);

    // A second recorder with no store: it rebuilds from the stream, then runs live.
    let rebuilt_dir = dir.path().join("rebuilt");
    let rebuilt = start(&bus, &rebuilt_dir);
    answering(&cat).await?;
    let stats = rebuilt.stop().await?;
    assert_eq!(stats.rebuilt, Some((facts.len() as u64 + 2, 3)));
    let rebuilt_dump = Store::open(rebuilt_dir.join("catalogue.redb"))?.dump()?;
    for ((table, rebuilt), (_, live)) in rebuilt_dump.tables.iter().zip(&live_dump.tables) {
        assert_eq!(rebuilt, live, "table {table}");
    }
    assert_eq!(rebuilt_dump, live_dump);

    // Restarting on a complete store does not rebuild.
    drop(live_store);
    let again = start(&bus, &live_dir);
    answering(&cat).await?;
    let Page { items, .. } = cat.problems(None, None).await.map(|(p, _)| p)?;
    assert!(items.is_empty());
    let Answer::DeadLetters { services, .. } = cat
        .ask(&Query::DeadLetters {
            limit: None,
            after: None,
        })
        .await?
    else {
        anyhow::bail!("not a dead letters answer")
    };
    assert_eq!(services[0].count, 2);
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
    let cat = catalogue(&bus);
    wait_until(WAIT, "every fact folded", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
    })
    .await?;

    let page = cat.datasets(None, None, None).await?;
    let names: Vec<&str> = page.items.iter().map(|d| d.dataset.as_str()).collect();
    assert_eq!(names, ["cats", "dogs"]);
    assert_eq!(page.next, None);
    let first = cat.datasets(None, Some(1), None).await?;
    assert_eq!(first.items[0].dataset, "cats");
    let second = cat.datasets(None, Some(1), first.next.as_deref()).await?;
    assert_eq!(second.items[0].dataset, "dogs");

    let cats = cat.dataset(None, "cats").await?;
    assert_eq!(cats.dataset.version_count, 2);
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

    let detail = cat.version(Some("lab-a"), "cats", &v1[..10]).await?;
    assert_eq!(detail.version.file_count, 3);
    let page = cat.files(None, "cats", &v1[..10], None, None).await?;
    assert_eq!(page.version, v1);
    assert_eq!(page.files.len(), 3);
    let (_, one) = cat.file(None, "cats", &v1, "train/0000001.bin").await?;
    assert_eq!(one.size, 1);
    assert!(
        cat.file(None, "cats", &v1, "train/nope")
            .await
            .unwrap_err()
            .is_not_found()
    );

    let missing = cat.dataset(Some("lab-a"), "nope").await.unwrap_err();
    assert!(missing.is_not_found(), "{missing}");

    // A malformed query gets an error answer, not silence.
    let reply = bus
        .client()
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

    // Readiness, asked and mirrored into the KV bucket a scheduler watches.
    let tiers = cat.readiness(None, "cats", &v1, None).await?;
    let by_tier: Vec<(&str, bool)> = tiers
        .items
        .iter()
        .map(|r| (r.key.tier.as_str(), r.ready))
        .collect();
    assert_eq!(by_tier, [("hot", true), ("local", false), ("source", true)]);
    let kv = bus.jetstream().get_key_value(READINESS_BUCKET).await?;
    let value = kv
        .get(format!("lab-a.cats.{v1}.hot"))
        .await?
        .context("hot readiness key")?;
    let ready: Readiness = serde_json::from_slice(&value)?;
    assert_eq!(
        ready.state,
        ReadinessState::Ready {
            path: "lab-a/cats/hot".into()
        }
    );
    assert_eq!(ready.jobs.ready, 1);
    let value = kv
        .get(format!("lab-a.cats.{v1}.local"))
        .await?
        .context("local readiness key")?;
    let local: Readiness = serde_json::from_slice(&value)?;
    assert!(!local.ready);
    assert_eq!(
        local.state,
        ReadinessState::Failed {
            reason: "quota exceeded".into(),
            retryable: false
        }
    );

    recorder.stop().await?;
    Ok(())
}

/// Times in answers are RFC 3339 in UTC (`…T…Z`), never the `2026-12-01 6:44:25.765729
/// +00:00:00` of `OffsetDateTime`'s Display.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_carry_rfc3339_times_in_utc() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let mut fact = validated(&ingest(2, "cats"));
    // Written with an offset: the answer says the same instant in UTC.
    fact.occurred_at = ::time::macros::datetime!(2026-12-01 08:44:25.765729 +02:00);
    bus.publish(&fact).await?;
    let cat = catalogue(&bus);
    wait_until(WAIT, "the fact folded", || async {
        cat.version(None, "cats", &version(&fact)).await.is_ok()
    })
    .await?;
    let reply = bus
        .client()
        .request(
            subject::CATALOGUE_QUERY,
            serde_json::to_vec(&Query::Version {
                project: None,
                dataset: "cats".into(),
                version: version(&fact),
                limit: None,
            })?
            .into(),
        )
        .await?;
    let json: serde_json::Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(
        json["version"]["provenance"]["at"],
        "2026-12-01T06:44:25.765729Z"
    );
    assert_eq!(
        json["replicas"][0]["stamp"]["at"],
        "2026-12-01T06:44:25.765729Z"
    );
    assert_eq!(
        stagehand_catalogue::time::human(fact.occurred_at),
        "2026-12-01T06:44:25Z"
    );
    recorder.stop().await?;
    Ok(())
}

/// A version of 300,000 files by reference: folded from its manifest object, then paged through
/// with `after` cursors — every file exactly once, in path order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_of_300000_files_by_reference_folds_and_pages_exactly() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let all = files(300_000, "frames");
    let (fact, manifest) = by_reference(&bus, "req-300k", "frames", all.clone(), true).await?;
    bus.publish(&fact).await?;
    let cat = catalogue(&bus).with_timeout(Duration::from_secs(20));
    let digest = manifest.digest().to_owned();
    wait_until(WAIT, "the version folded", || async {
        cat.version(None, "frames", &digest).await.is_ok()
    })
    .await?;
    let detail = cat.version(None, "frames", &digest).await?;
    assert_eq!(detail.version.file_count, 300_000);
    assert_eq!(detail.version.total_bytes, manifest.bytes());

    let mut paged =
        std::pin::pin!(cat.all_files(None, "frames".into(), digest[..12].into(), MAX_PAGE, None));
    let mut expected = all.iter();
    let mut count = 0u64;
    while let Some(file) = paged.try_next().await? {
        assert_eq!(Some(&file), expected.next(), "file {count} in path order");
        count += 1;
    }
    assert_eq!(count, 300_000);
    assert_eq!(expected.next(), None);

    // A page from the middle, and one file's entry.
    let page = cat
        .files(
            None,
            "frames",
            &digest,
            Some(100),
            Some("frames/0123456.bin"),
        )
        .await?;
    assert_eq!(page.files.len(), 100);
    assert_eq!(page.files[0], all[123_457]);
    assert_eq!(page.next.as_deref(), Some("frames/0123556.bin"));
    let (_, file) = cat
        .file(None, "frames", &digest, "frames/0299999.bin")
        .await?;
    assert_eq!(file, all[299_999]);
    recorder.stop().await?;
    Ok(())
}

/// However large the catalogue, no answer exceeds the message bound: thousands of datasets with
/// long names, a version of files with paths of the contract's maximum length, rejections of
/// the largest size. Every list is paged through to its exact end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_never_exceed_the_bound() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let store_path = dir.path().join("catalogue.redb");
    // Built offline (what a long-lived catalogue holds), then served.
    let long_files: Vec<FileRef> = (0..2000u32)
        .map(|i| {
            let component = format!("{i:05}{}", "p".repeat(250));
            let path = std::iter::repeat_n(component.as_str(), 16)
                .collect::<Vec<_>>()
                .join("/");
            FileRef::new(path, u64::from(i), sha256_hex(&i.to_le_bytes()))
        })
        .collect();
    assert!(long_files.iter().all(|f| f.path.len() == 16 * 255 + 15));
    let long = Manifest::from_entries(long_files.clone());
    let datasets = 3000u32;
    {
        let store = Store::open(&store_path)?;
        store.put_file_list(&long)?;
        let mut items = Vec::new();
        for i in 0..datasets {
            let name = format!("{i:05}-{}", "d".repeat(200));
            let req = Event::request(
                EventId::new(format!("r{i}"))?,
                "lab-a",
                Body::IngestRequested(IngestRequested {
                    dataset: name.clone(),
                    source: Location {
                        tier: "source".into(),
                        prefix: "lab-a/x".into(),
                    },
                    files: vec![],
                    manifest: Some(long.reference()),
                    requested_by: "alice".into(),
                    labels: vec![],
                }),
            );
            let body = if i < 2 {
                // Many versions' worth of rejections with problems of the largest size.
                Body::DatasetRejected(DatasetRejected {
                    dataset: name.clone(),
                    source: Location {
                        tier: "source".into(),
                        prefix: "lab-a/x".into(),
                    },
                    declared_version: "0".repeat(64),
                    requested_by: "mallory".into(),
                    request_id: req.id.clone(),
                    problems: (0..99)
                        .map(|j| {
                            Problem::new("missing", Some(&format!("{j}")), "\u{1}".repeat(1200))
                        })
                        .collect(),
                    quarantine: None,
                    problem_counts: vec![("missing".into(), 99)],
                    problems_total: Some(99),
                })
            } else {
                Body::DatasetValidated(DatasetValidated {
                    dataset: name,
                    version: long.digest().into(),
                    source: Location {
                        tier: "source".into(),
                        prefix: "lab-a/x".into(),
                    },
                    files: vec![],
                    manifest: Some(long.reference()),
                    total_bytes: long.bytes(),
                    requested_by: "alice".into(),
                    request_id: req.id.clone(),
                    labels: vec![],
                })
            };
            items.push(FoldItem {
                event: req.caused("done", body),
                sequence: None,
                problem: None,
            });
        }
        // Forty rejections of one dataset.
        for j in 0..40 {
            let req = ingest(1000 + j, "00000-x");
            items.push(FoldItem {
                event: req.caused(
                    "rejected",
                    Body::DatasetRejected(DatasetRejected {
                        dataset: format!("00000-{}", "d".repeat(200)),
                        source: Location {
                            tier: "source".into(),
                            prefix: "lab-a/x".into(),
                        },
                        declared_version: "0".repeat(64),
                        requested_by: "mallory".into(),
                        request_id: req.id.clone(),
                        problems: (0..99)
                            .map(|k| {
                                Problem::new("missing", Some(&format!("{k}")), "\u{1}".repeat(1200))
                            })
                            .collect(),
                        quarantine: None,
                        problem_counts: vec![("missing".into(), 99)],
                        problems_total: Some(99),
                    }),
                ),
                sequence: None,
                problem: None,
            });
        }
        let folded = store.apply_batch(&items)?;
        assert!(
            folded
                .iter()
                .all(|f| *f == stagehand_catalogue_recorder::Folded::Done)
        );
        store.mark_complete(0)?;
    }
    let recorder = start(&bus, dir.path());
    let client = bus.client().clone();
    let raw = |q: Query| {
        let client = client.clone();
        async move {
            let reply = client
                .request(subject::CATALOGUE_QUERY, serde_json::to_vec(&q)?.into())
                .await?;
            assert!(
                reply.payload.len() <= MAX_ANSWER_BYTES,
                "{} bytes answering {q:?}",
                reply.payload.len()
            );
            anyhow::Ok(serde_json::from_slice::<Answer>(&reply.payload)?)
        }
    };
    wait_until(WAIT, "the recorder to answer", || async {
        raw(Query::Problems {
            limit: None,
            after: None,
        })
        .await
        .is_ok()
    })
    .await?;

    let (mut seen, mut after, mut pages) = (0u32, None, 0);
    loop {
        let Answer::Datasets { datasets, next } = raw(Query::Datasets {
            project: None,
            limit: Some(MAX_PAGE),
            after: after.clone(),
        })
        .await?
        else {
            anyhow::bail!("not a datasets answer")
        };
        for d in &datasets {
            assert_eq!(d.dataset, format!("{seen:05}-{}", "d".repeat(200)));
            seen += 1;
        }
        pages += 1;
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(seen, datasets);
    assert!(pages > 1, "3000 long names do not fit one answer");

    let (mut files_seen, mut after) = (Vec::new(), None);
    loop {
        let Answer::Files { files, next, .. } = raw(Query::Files {
            project: None,
            dataset: format!("00002-{}", "d".repeat(200)),
            version: long.digest().into(),
            limit: Some(MAX_PAGE),
            after: after.clone(),
        })
        .await?
        else {
            anyhow::bail!("not a files answer")
        };
        assert!(!files.is_empty());
        files_seen.extend(files);
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(files_seen, long_files);

    let Answer::Dataset(detail) = raw(Query::Dataset {
        project: None,
        dataset: format!("00000-{}", "d".repeat(200)),
        limit: Some(MAX_PAGE),
    })
    .await?
    else {
        anyhow::bail!("not a dataset answer")
    };
    assert_eq!(detail.dataset.rejection_count, 41);
    assert!(detail.rejections.len() < 41 && detail.rejections_next.is_some());
    let (mut rejections, mut after) = (0, None);
    loop {
        let Answer::Rejections {
            rejections: page,
            next,
        } = raw(Query::Rejections {
            project: None,
            dataset: format!("00000-{}", "d".repeat(200)),
            limit: Some(MAX_PAGE),
            after: after.clone(),
        })
        .await?
        else {
            anyhow::bail!("not a rejections answer")
        };
        rejections += page.len();
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(rejections, 41);
    recorder.stop().await?;
    Ok(())
}

/// A rebuild whose manifest object of one version was deleted from the bucket reports that
/// version's facts (listed as problems, counted) and skips them, and rebuilds the rest. A
/// version already in the store is not fetched again for a later fact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_skips_and_lists_a_version_whose_manifest_is_gone() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let live = start(&bus, &dir.path().join("live"));
    let cat = catalogue(&bus);
    let (gone, gone_manifest) =
        by_reference(&bus, "req-gone", "cats", files(4000, "a"), true).await?;
    let (kept, kept_manifest) =
        by_reference(&bus, "req-kept", "cats", files(4000, "b"), true).await?;
    bus.publish(&gone).await?;
    bus.publish(&kept).await?;
    wait_until(WAIT, "both versions folded", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
    })
    .await?;
    let bucket = ManifestStore::catalogue(bus.jetstream(), BucketOptions::default()).await?;
    bucket.object_store().delete(gone_manifest.digest()).await?;
    // Another upload of the same bytes: its list is in the store, so nothing is fetched.
    let (again, _) = by_reference(&bus, "req-gone-again", "cats", files(4000, "a"), false).await?;
    bus.publish(&again).await?;
    wait_until(WAIT, "the second request counted", || async {
        cat.version(None, "cats", gone_manifest.digest())
            .await
            .is_ok_and(|v| v.version.request_count == 2)
    })
    .await?;
    live.stop().await?;

    let rebuilt = start(&bus, &dir.path().join("rebuilt"));
    answering(&cat).await?;
    let (problems, total) = cat.problems(None, None).await?;
    assert_eq!(total, 2);
    let mut ids: Vec<&str> = problems.items.iter().map(|p| p.event_id.as_str()).collect();
    ids.sort();
    let mut want = vec![gone.id.as_str(), again.id.as_str()];
    want.sort();
    assert_eq!(ids, want);
    assert!(
        problems
            .items
            .iter()
            .all(|p| p.code == FoldProblemCode::ManifestMissing
                && p.version.as_deref() == Some(gone_manifest.digest())
                && p.stream_sequence.is_some())
    );
    assert!(
        cat.version(None, "cats", gone_manifest.digest())
            .await
            .unwrap_err()
            .is_not_found()
    );
    let kept_detail = cat.version(None, "cats", kept_manifest.digest()).await?;
    assert_eq!(kept_detail.version.file_count, 4000);
    let page = cat
        .files(None, "cats", kept_manifest.digest(), Some(4000), None)
        .await?;
    assert_eq!(page.files.len(), 4000);
    let stats = rebuilt.stop().await?;
    assert_eq!(
        stats.rebuilt,
        Some((3, 0)),
        "every fact replayed, two of them skipped"
    );
    Ok(())
}

/// Facts of schema 1 (files inline, more of them than schema 2 lets travel inline) in an old
/// stream still fold, with their file lists — unless they name a location outside their
/// project, as the golden fixture does (the location rule holds for every schema).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_schema_1_fact_with_inline_files_still_folds() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    // The golden schema-1 bytes, exactly as a schema-1 validator wrote them.
    let fixture = std::fs::read(
        stagehand_testkit::repo_root().join("schemas/fixtures/v1/dataset.validated.msgpack"),
    )?;
    let golden = wire::decode(&fixture)?;
    assert_eq!(golden.schema, 1);
    bus.jetstream()
        .publish(
            subject::subject_for(&golden.body, &golden.project),
            fixture.into(),
        )
        .await?
        .await?;
    // And a schema-1 fact with 3,000 files inline (over schema 2's inline bound).
    let mut big = validated(&ingest(3000, "legacy"));
    big.schema = 1;
    let Body::DatasetValidated(p) = &big.body else {
        unreachable!()
    };
    assert!(stagehand_schemas::manifest::canonical_len(&p.files) > INLINE_MANIFEST_MAX_BYTES);
    bus.jetstream()
        .publish(
            subject::subject_for(&big.body, &big.project),
            rmp_serde::to_vec_named(&big)?.into(),
        )
        .await?
        .await?;
    let cat = catalogue(&bus);
    wait_until(WAIT, "both folded", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
    })
    .await?;
    let page = cat
        .files(None, "legacy", &version(&big), Some(MAX_PAGE), None)
        .await?;
    assert_eq!(page.files.len(), 3000);
    assert_eq!(page.next, None);
    // The golden fact's source (`uploads/vision-lab/...`) is not beneath its project's folder,
    // which schema-1 validators did not check: it decodes, and is listed as what it is — a
    // fact naming a location outside its project — rather than folded.
    let Body::DatasetValidated(g) = &golden.body else {
        unreachable!()
    };
    let (problems, total) = cat.problems(None, None).await?;
    assert_eq!(total, 1);
    assert_eq!(problems.items[0].event_id, golden.id);
    assert_eq!(problems.items[0].code, FoldProblemCode::OutsideProject);
    assert_eq!(
        problems.items[0].version.as_deref(),
        Some(g.version.as_str())
    );
    assert!(
        cat.version(Some(&golden.project), &g.dataset, &g.version)
            .await
            .unwrap_err()
            .is_not_found()
    );
    recorder.stop().await?;
    Ok(())
}

/// The live recorder does not Term (or ack) a fact whose manifest is not in the bucket yet:
/// it naks it, and folds it once the object appears — no dead letter, nothing dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_recorder_retries_a_fact_whose_manifest_is_missing_until_it_appears()
-> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let cat = catalogue(&bus);
    answering(&cat).await?;
    let (fact, manifest) = by_reference(&bus, "req-late", "late", files(3000, "x"), false).await?;
    bus.publish(&fact).await?;
    let js = bus.jetstream().clone();
    wait_until(WAIT, "the fact to be redelivered after a nak", || async {
        let Ok(s) = js.get_stream(subject::FACTS.name).await else {
            return false;
        };
        s.consumer_info("catalogue-recorder")
            .await
            .is_ok_and(|i| i.num_redelivered >= 1 || i.delivered.consumer_sequence >= 2)
    })
    .await?;
    assert!(cat.version(None, "late", manifest.digest()).await.is_err());
    ManifestStore::catalogue(bus.jetstream(), BucketOptions::default())
        .await?
        .put(&manifest)
        .await?;
    wait_until(
        WAIT,
        "the fact folded once its manifest is there",
        || async { cat.version(None, "late", manifest.digest()).await.is_ok() },
    )
    .await?;
    assert_eq!(
        cat.files(None, "late", manifest.digest(), Some(MAX_PAGE), None)
            .await?
            .files
            .len(),
        3000
    );
    wait_until(WAIT, "the fact acked", || async {
        drained(&bus, subject::FACTS.name, "catalogue-recorder").await
    })
    .await?;
    assert_eq!(dead_letters_stored(&bus).await?, 0, "no dead letter");
    assert_eq!(cat.problems(None, None).await?.1, 0);
    let stats = recorder.stop().await?;
    assert!(stats.facts.retried >= 1, "{stats:?}");
    assert_eq!(stats.facts.dead_lettered, 0);
    assert_eq!(stats.facts.handled, 1);
    Ok(())
}

/// A scheduler's view of one stage request, mirrored into `stagehand_stages`: pending with what
/// it waits for, copying with the promoter's progress, ready with the path, then released —
/// from the request and release (requests stream), the promoter's facts and its progress
/// messages; and the per-node readiness key beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_request_is_mirrored_for_schedulers_from_pending_to_released() -> anyhow::Result<()>
{
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let cat = catalogue(&bus);
    answering(&cat).await?;
    let validated = validated(&ingest(3, "cats"));
    bus.publish(&validated).await?;
    let v = version(&validated);
    let prefix = &v[..12];
    let node = Some("gpu-07");
    let id = EventId::for_stage("lab-a", "4815162", "cats", prefix, "local", node);
    let request = Event::request(
        id.clone(),
        "lab-a",
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: prefix.into(),
            tier: "local".into(),
            job_id: "4815162".into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: node.map(Into::into),
            form: None,
            hold_until: None,
        }),
    );
    bus.publish(&request).await?;
    let kv = bus.jetstream().get_key_value(STAGES_BUCKET).await?;
    let key = stage_kv_key("lab-a", &id);
    let status = |kv: async_nats::jetstream::kv::Store, key: String| async move {
        kv.get(key)
            .await
            .ok()
            .flatten()
            .and_then(|v| serde_json::from_slice::<StageStatus>(&v).ok())
    };
    wait_until(WAIT, "the request mirrored as pending", || async {
        status(kv.clone(), key.clone())
            .await
            .is_some_and(|s| s.state == StageState::Pending)
    })
    .await?;
    let estimate = stagehand_schemas::ReadyEstimate {
        from_tier: "hot".into(),
        to_tier: "local".into(),
        bytes_ahead: 3 << 20,
        copies_ahead: 2,
        bytes: 3,
        bytes_per_second: Some(1 << 20),
        ready_at: Some(
            stagehand_schemas::event::now().replace_nanosecond(0)? + ::time::Duration::seconds(3),
        ),
    };
    bus.publish(&request.caused(
        "pending:copy",
        Body::StagePending(StagePending {
            dataset: "cats".into(),
            version: prefix.into(),
            tier: "local".into(),
            node: node.map(Into::into),
            job_id: "4815162".into(),
            request_id: id.clone(),
            waiting_for: "copy".into(),
            reason: "waiting for a copy slot".into(),
            ready_estimate: Some(estimate.clone()),
        }),
    ))
    .await?;
    let pending = stagehand_testkit::wait_for(WAIT, "pending with what it waits for", || async {
        status(kv.clone(), key.clone())
            .await
            .filter(|s| s.waiting_for.as_deref() == Some("copy"))
    })
    .await?;
    assert_eq!(
        pending.ready_estimate.as_ref(),
        Some(&estimate),
        "the queued copy's estimate is mirrored"
    );
    let report = stagehand_schemas::progress::WorkProgress {
        request_id: id.clone(),
        service: "promoter".into(),
        phase: "copying".into(),
        files_done: 1,
        files_total: 3,
        bytes_done: 1,
        bytes_total: 3,
        eta_seconds: Some(2),
    };
    use stagehand_schemas::progress::progress_subject;
    let subject = progress_subject("stage.requested", node, "lab-a", &id);
    // The same request reported on by another node's agent, or on the shared tiers' subject
    // (a node's user may publish its own node's progress subjects): never this stage's copy.
    let forged = stagehand_schemas::progress::WorkProgress {
        files_done: 99,
        ..report.clone()
    };
    let elsewhere = [
        progress_subject("stage.requested", Some("gpu-08"), "lab-a", &id),
        progress_subject("stage.requested", None, "lab-a", &id),
    ];
    // Progress is core NATS and may be sent before anyone listens: send until it shows, the
    // forged reports right after the real one each time (the last report kept is shown).
    let copying = stagehand_testkit::wait_for(WAIT, "copying with progress", || async {
        bus.client()
            .publish(subject.clone(), report.encode().into())
            .await
            .ok()?;
        for other in &elsewhere {
            bus.client()
                .publish(other.clone(), forged.encode().into())
                .await
                .ok()?;
        }
        bus.client().flush().await.ok()?;
        status(kv.clone(), key.clone())
            .await
            .filter(|s| s.state == StageState::Copying)
    })
    .await?;
    assert_eq!(copying.progress.as_ref().map(|p| p.files_done), Some(1));
    assert_eq!(
        copying.ready_estimate, None,
        "a running copy's progress says when it is ready"
    );
    let path = format!("/nvme/lab-a/cats/{v}");
    bus.publish(&request.caused(
        "ready",
        Body::StageReady(StageReady {
            dataset: "cats".into(),
            version: v.clone(),
            location: Location {
                tier: "local".into(),
                prefix: format!("lab-a/cats/{v}"),
            },
            job_id: "4815162".into(),
            request_id: id.clone(),
            node: node.map(Into::into),
            path: Some(path.clone()),
        }),
    ))
    .await?;
    let ready = stagehand_testkit::wait_for(WAIT, "ready with the path", || async {
        status(kv.clone(), key.clone())
            .await
            .filter(|s| s.state == StageState::Ready)
    })
    .await?;
    assert_eq!(ready.path.as_deref(), Some(path.as_str()));
    assert_eq!(ready.resolved_version.as_deref(), Some(v.as_str()));
    assert_eq!(ready.progress, None);
    let readiness = bus.jetstream().get_key_value(READINESS_BUCKET).await?;
    let value = readiness
        .get(format!("lab-a.cats.{v}.local.gpu-07"))
        .await?
        .context("the node's readiness key")?;
    let node_ready: Readiness = serde_json::from_slice(&value)?;
    assert!(node_ready.ready);
    assert_eq!(node_ready.jobs.ready, 1);

    bus.publish(&Event::request(
        EventId::for_stage_release("lab-a", "4815162", "cats", prefix, "local", node),
        "lab-a",
        Body::StageReleased(StageReleased {
            dataset: "cats".into(),
            version: prefix.into(),
            tier: "local".into(),
            job_id: "4815162".into(),
            node: node.map(Into::into),
            reason: None,
        }),
    ))
    .await?;
    wait_until(WAIT, "released", || async {
        status(kv.clone(), key.clone())
            .await
            .is_some_and(|s| s.state == StageState::Released)
    })
    .await?;
    let listed = cat
        .stage_requests("lab-a", Some("4815162"), None, None, None)
        .await?;
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].state, StageState::Released);
    let stats = recorder.stop().await?;
    assert_eq!(
        stats.stage_requests.handled, 2,
        "the request and its release"
    );
    Ok(())
}

/// A fact whose manifest object is not the manifest its digest names cannot be folded by any
/// retry: it is listed as a catalogue problem and dead-lettered (replayable once the object is
/// fixed), never acked or dropped silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fact_whose_manifest_is_damaged_is_listed_and_dead_lettered() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let cat = catalogue(&bus);
    answering(&cat).await?;
    let (fact, manifest) =
        by_reference(&bus, "req-damaged", "damaged", files(3000, "d"), false).await?;
    let bucket = ManifestStore::catalogue(bus.jetstream(), BucketOptions::default()).await?;
    // An object under the version's name whose bytes are something else.
    bucket
        .object_store()
        .put(manifest.digest(), &mut &b"not/the/manifest\t1\tabc\n"[..])
        .await?;
    bus.publish(&fact).await?;
    let (problems, total) =
        stagehand_testkit::wait_for(WAIT, "the fact listed as a problem", || async {
            cat.problems(None, None)
                .await
                .ok()
                .filter(|(_, total)| *total == 1)
        })
        .await?;
    assert_eq!(total, 1);
    assert_eq!(problems.items[0].event_id, fact.id);
    assert_eq!(problems.items[0].code, FoldProblemCode::ManifestMismatch);
    wait_until(WAIT, "the fact dead-lettered", || async {
        dead_letters_stored(&bus).await.is_ok_and(|n| n == 1)
    })
    .await?;
    assert!(
        cat.version(None, "damaged", manifest.digest())
            .await
            .unwrap_err()
            .is_not_found()
    );
    let stats = recorder.stop().await?;
    assert_eq!(stats.facts.dead_lettered, 1);
    assert_eq!(stats.facts.handled, 0);
    Ok(())
}

/// Issue 19 item 1: a training job of `lab-a` commits a checkpoint at `lab-b`'s prefix, and a
/// validation travels on another kind's subject. The recorder folds neither: each is listed as
/// a catalogue problem naming its rule and dead-lettered, live and again in a rebuild from
/// the stream, and no version, replica or checkpoint of them appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn facts_breaking_the_location_or_subject_rules_are_listed_and_never_folded()
-> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let live = start(&bus, &dir.path().join("live"));
    let cat = catalogue(&bus);
    answering(&cat).await?;
    let stolen = files(1, "model");
    let digest = version_digest(&stolen);
    let commit = Event::request(
        EventId::for_checkpoint("lab-a", "r1", 100),
        "lab-a",
        Body::CheckpointCommitted(CheckpointCommitted {
            run: "r1".into(),
            step: 100,
            location: Location {
                tier: "source".into(),
                prefix: "lab-b/secret/run-7".into(),
            },
            files: stolen.clone(),
            manifest: None,
            total_bytes: total_bytes(&stolen),
            tags: vec![],
        }),
    );
    bus.publish(&commit).await?;
    // A validation of lab-a, published where replicas are announced.
    let misfiled = validated(&ingest(2, "cats"));
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, misfiled.id.as_str());
    bus.jetstream()
        .publish_with_headers(
            "stagehand.fact.replica.created.lab-a",
            headers,
            wire::encode(&misfiled)?.into(),
        )
        .await?
        .await?;
    let check = |problems: &[FoldProblem]| {
        let of = |id: &EventId| {
            problems
                .iter()
                .find(|p| &p.event_id == id)
                .unwrap_or_else(|| panic!("{id} not listed: {problems:?}"))
        };
        let p = of(&commit.id);
        assert_eq!(p.code, FoldProblemCode::OutsideProject);
        assert_eq!(p.dataset.as_deref(), Some("ckpt-r1"));
        assert_eq!(p.version.as_deref(), Some(digest.as_str()));
        for part in ["outside_project", "payload.location", "lab-b/secret/run-7"] {
            assert!(p.detail.contains(part), "{part} missing: {}", p.detail);
        }
        let p = of(&misfiled.id);
        assert_eq!(p.code, FoldProblemCode::WrongSubject);
        assert!(p.detail.contains("subject_kind"), "{}", p.detail);
    };
    let (problems, _) = stagehand_testkit::wait_for(WAIT, "both listed", || async {
        cat.problems(None, None)
            .await
            .ok()
            .filter(|(_, total)| *total == 2)
    })
    .await?;
    check(&problems.items);
    wait_until(WAIT, "both dead-lettered", || async {
        dead_letters_stored(&bus).await.is_ok_and(|n| n == 2)
    })
    .await?;
    nothing_folded(&cat, &digest).await;
    let stats = live.stop().await?;
    assert_eq!((stats.facts.handled, stats.facts.dead_lettered), (0, 2));

    let rebuilt = start(&bus, &dir.path().join("rebuilt"));
    answering(&cat).await?;
    let (problems, total) = cat.problems(None, None).await?;
    assert_eq!(total, 2);
    check(&problems.items);
    nothing_folded(&cat, &digest).await;
    let stats = rebuilt.stop().await?;
    assert_eq!(stats.rebuilt, Some((2, 2)), "both replayed, both skipped");
    Ok(())
}

/// Neither of the refused facts above left anything in the catalogue.
async fn nothing_folded(cat: &Catalogue, digest: &str) {
    assert!(
        cat.version(Some("lab-a"), "ckpt-r1", digest)
            .await
            .unwrap_err()
            .is_not_found()
    );
    assert!(
        cat.dataset(Some("lab-a"), "cats")
            .await
            .unwrap_err()
            .is_not_found()
    );
}

/// `[worker] claims` used to be overwritten with `false` after the table was applied, so
/// `claims = true` was silently ignored. Every consumer of a recorder is its instance's own
/// (every recorder folds every fact): it cannot apply, and is refused at start, naming the
/// key and the consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_refused_rather_than_ignored() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut config = stagehand_catalogue_recorder::config(&nats.url(), dir.path());
    config.worker.claims = Some(true);
    let ran = tokio::time::timeout(
        WAIT,
        stagehand_catalogue_recorder::run(config, CancellationToken::new()),
    )
    .await
    .expect("the recorder refuses to start instead of running");
    let err = ran.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("worker.claims"), "{text}");
    assert!(text.contains("catalogue-recorder"), "{text}");
    assert!(!err.is_retryable(), "{text}");
}

fn replayed(dead: &Event) -> Event {
    let Body::DeadLetter(d) = &dead.body else {
        panic!("not a dead letter")
    };
    dead.caused(
        "replayed",
        Body::DeadLetterReplayed(DeadLetterReplayed {
            service: d.service.clone(),
            dead_letter_id: dead.id.clone(),
            dead_letter_sequence: d.stream_sequence,
            subject: d.subject.clone(),
            original_id: None,
            replay_msg_id: format!("replay-{}", d.stream_sequence),
            replayed_by: "operator".into(),
        }),
    )
}

/// `dead-letters` counts every dead letter and, apart, those still waiting for a person: a
/// replayed one stops waiting, one replayed twice (or whose replay record was redelivered)
/// counts once, and a replay folded before its dead letter still leaves it done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_dead_letter_no_longer_waits() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let cat = catalogue(&bus);
    answering(&cat).await?;
    let (first, second, third) = (dead_letter(1), dead_letter(2), dead_letter(3));
    // The third's replay is folded before the third itself.
    bus.publish(&replayed(&third)).await?;
    for dead in [&first, &second, &third] {
        bus.publish(dead).await?;
    }
    bus.publish(&replayed(&first)).await?;
    publish_copy(&bus, &replayed(&first)).await?;
    wait_until(WAIT, "three dead letters, one waiting", || async {
        let Ok(Answer::DeadLetters { services, .. }) = cat
            .ask(&Query::DeadLetters {
                limit: None,
                after: None,
            })
            .await
        else {
            return false;
        };
        services
            .iter()
            .any(|s| s.service == "ingest-validator" && s.count == 3 && s.waiting == Some(1))
    })
    .await?;
    recorder.stop().await?;
    Ok(())
}

fn stage_request(project: &str, job: &str) -> Event {
    let id = EventId::for_stage(project, job, "cats", "0123456789ab", "local", Some("gpu-1"));
    Event::request(
        id,
        project,
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: "0123456789ab".into(),
            tier: "local".into(),
            job_id: job.into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: Some("gpu-1".into()),
            form: None,
            hold_until: None,
        }),
    )
}

/// `open_stages` lists the pending and the failed stage requests of every project (or of the
/// projects asked for) from their index, pages without losing or repeating one, counts them
/// all, and drops a request from it once it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_stages_across_projects_page_and_count() -> anyhow::Result<()> {
    let (_nats, bus) = setup().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&bus, dir.path());
    let cat = catalogue(&bus);
    answering(&cat).await?;
    let mut requests = Vec::new();
    for project in ["lab-a", "lab-b", "lab-c"] {
        for job in 0..5 {
            let request = stage_request(project, &format!("{job}"));
            bus.publish(&request).await?;
            requests.push(request);
        }
    }
    let failed = &requests[7];
    bus.publish(&failed.caused(
        "failed",
        Body::StageFailed(StageFailed {
            dataset: "cats".into(),
            version: "0123456789ab".into(),
            tier: "local".into(),
            job_id: "2".into(),
            request_id: failed.id.clone(),
            reason: "no such version".into(),
            retryable: false,
            node: Some("gpu-1".into()),
        }),
    ))
    .await?;
    wait_until(WAIT, "14 pending, 1 failed", || async {
        cat.open_stages(StageState::Failed, &[], None, None)
            .await
            .is_ok_and(|(_, c)| c.pending == 14 && c.failed == 1)
    })
    .await?;
    let (page, _) = cat.open_stages(StageState::Failed, &[], None, None).await?;
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].state, StageState::Failed);
    assert_eq!(page.items[0].reason.as_deref(), Some("no such version"));
    // Pending, three at a time, oldest change first: every one once.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let (page, _) = cat
            .open_stages(StageState::Pending, &[], Some(3), after.as_deref())
            .await?;
        seen.extend(
            page.items
                .iter()
                .map(|s| (s.updated_at, s.request_id.clone())),
        );
        match page.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(seen.len(), 14);
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "oldest first");
    let mut ids: Vec<_> = seen.iter().map(|(_, id)| id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 14, "none repeated");
    let (page, counts) = cat
        .open_stages(StageState::Pending, &["lab-b".into()], None, None)
        .await?;
    assert_eq!((counts.pending, counts.failed), (4, 1));
    assert!(page.items.iter().all(|s| s.project == "lab-b"));
    assert!(
        cat.open_stages(StageState::Ready, &[], None, None)
            .await
            .is_err(),
        "only pending or failed stages are open"
    );
    recorder.stop().await?;
    Ok(())
}
