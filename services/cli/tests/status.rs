//! `stagehand status` as a real process against a real nats-server with the real catalogue
//! recorder running under the service runner (so keeping its heartbeat): a quiet installation
//! exits 0; a planted stuck stage, a dead letter, a hot tier above its high watermark, a
//! silent service and a crash-looping one each appear with the command to run, and the exit
//! code is 1; a replayed dead letter no longer counts as waiting. A copy withdrawn as damaged,
//! a backup whose restore drill failed and one never drilled two intervals after it was made
//! each need a person too. A consumer's backlog is aged from its own subjects' oldest waiting
//! message, not from another subject's message after its ack floor.

mod common;

use std::path::Path;
use std::process::Command;

use common::{PROJECT, Stagehand, WAIT};
use stagehand_bus::runner::Heartbeat;
use stagehand_schemas::{
    BackupCompleted, Body, DamagedFile, DatasetValidated, DeadLetter, DeadLetterReplayed, Event,
    EventId, FileRef, Location, Problem, ReplicaCreated, ReplicaDamaged, RestoreFailed,
    StageRequested, sha256_hex, version_digest,
};
use stagehand_testkit::wait_until;
use time::OffsetDateTime;

const MIB: u64 = 1 << 20;

/// Policies with a 10 MiB hot tier whose high watermark is 85 %.
fn policies(dir: &Path, root: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for tier in ["source", "capacity", "hot"] {
        std::fs::create_dir_all(root.join(tier)).unwrap();
    }
    std::fs::write(
        dir.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
             [tiers.capacity]\nkind = \"posix\"\nrole = \"capacity\"\nfailure_domain = \"cap\"\nroot = \"{}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{}\"\n\
             capacity = \"10 MiB\"\nhigh_watermark = 0.85\nlow_watermark = 0.5\n",
            root.join("source").display(),
            root.join("capacity").display(),
            root.join("hot").display()
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("validation.toml"),
        "max_file_size = \"1 GiB\"\nmax_entries = 1000\nmax_total_bytes = \"1 GiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("demotion.toml"),
        "idle_after = \"1d\"\ncheck_every = \"1h\"\ntarget = \"capacity\"\n",
    )
    .unwrap();
}

/// `stagehand status --json`: its exit code and its object; `None` (with what it said) when
/// it could not tell (a recorder still starting answers nothing).
fn try_status(stack: &Stagehand, policies: &Path) -> Result<(i32, serde_json::Value), String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["status", "--json", "--policies"])
        .arg(policies)
        .args(["--nats", &stack.url])
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    if code != 0 && code != 1 {
        return Err(format!(
            "exit {code}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok((code, serde_json::from_slice(&out.stdout).unwrap()))
}

fn status(stack: &Stagehand, policies: &Path) -> (i32, serde_json::Value) {
    try_status(stack, policies).unwrap_or_else(|e| panic!("stagehand status: {e}"))
}

/// The findings of `area` about `subject`, as (detail, run).
fn findings(report: &serde_json::Value, area: &str, subject: &str) -> Vec<(String, String)> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["area"] == area && f["subject"].as_str().unwrap().contains(subject))
        .map(|f| {
            (
                f["detail"].as_str().unwrap().to_owned(),
                f["run"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A 3 MiB version of `dataset` present on hot, as the validator and the promoter announce it.
async fn place_on_hot(stack: &Stagehand, dataset: &str) {
    let refs = vec![FileRef::new(
        "data.bin",
        3 * MIB,
        sha256_hex(dataset.as_bytes()),
    )];
    let version = version_digest(&refs);
    let prefix = format!("{PROJECT}/{dataset}/{version}");
    let ingest = EventId::for_ingest(PROJECT, dataset, &version);
    let location = |tier: &str| Location {
        tier: tier.into(),
        prefix: prefix.clone(),
    };
    for event in [
        Event::request(
            EventId::derive(&ingest, "validated"),
            PROJECT,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.into(),
                version: version.clone(),
                source: location("capacity"),
                files: refs.clone(),
                manifest: None,
                total_bytes: 3 * MIB,
                requested_by: "test".into(),
                request_id: ingest.clone(),
                labels: vec![],
            }),
        ),
        Event::request(
            EventId::derive(&ingest, "replica:hot"),
            PROJECT,
            Body::ReplicaCreated(ReplicaCreated {
                dataset: dataset.into(),
                version: version.clone(),
                location: location("hot"),
                files: 1,
                total_bytes: 3 * MIB,
                verified_by: "read-back".into(),
                node: None,
            }),
        ),
    ] {
        stack.bus.publish(&event).await.unwrap();
    }
}

fn dead_letter() -> Event {
    let id = EventId::for_ingest(PROJECT, "cats", "dead");
    Event::request(
        EventId::derive(&id, "dead-letter"),
        PROJECT,
        Body::DeadLetter(DeadLetter {
            service: "ingest-validator".into(),
            stream: "STAGEHAND_REQUESTS".into(),
            consumer: "ingest-validator".into(),
            stream_sequence: 7,
            subject: "stagehand.req.ingest.requested.lab".into(),
            delivered: 8,
            original: vec![0xc1],
            headers: vec![],
            errors: vec![],
            original_id: None,
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn status_names_what_needs_a_person_and_exits_1_until_nothing_does() {
    let stack = Stagehand::start(common::Options::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let policy_dir = dir.path().join("policies");
    policies(&policy_dir, &dir.path().join("tiers"));

    // Quiet: the recorder's heartbeat shows it alive, and nothing needs a person.
    wait_until(WAIT, "the recorder alive, nothing to do", || async {
        let Ok((code, report)) = try_status(&stack, &policy_dir) else {
            return false;
        };
        code == 0
            && report["services"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["service"] == "catalogue-recorder" && s["state"] == "alive")
    })
    .await
    .unwrap();

    // A stage request pending, unchanged for two hours.
    let mut stuck = Event::request(
        EventId::for_stage(PROJECT, "stuck-job", "cats", "0123456789ab", "hot", None),
        PROJECT,
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: "0123456789ab".into(),
            tier: "hot".into(),
            job_id: "stuck-job".into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    );
    stuck.occurred_at = OffsetDateTime::now_utc() - time::Duration::hours(2);
    stack.bus.publish(&stuck).await.unwrap();
    // A dead letter.
    let dead = dead_letter();
    stack.bus.publish(&dead).await.unwrap();
    // 9 MiB on a 10 MiB hot tier whose high watermark is 85 %.
    for dataset in ["a", "b", "c"] {
        place_on_hot(&stack, dataset).await;
    }
    // A promoter instance that stopped beating an hour ago without saying so.
    let an_hour_ago = OffsetDateTime::now_utc() - time::Duration::hours(1);
    let ghost = Heartbeat {
        service: "promoter".into(),
        instance: "ghost".into(),
        version: "0.1.0".into(),
        host: "gpu-07".into(),
        pid: 4242,
        started_at: an_hour_ago,
        beat_at: an_hour_ago,
        every_seconds: 10,
        last_progress_at: None,
        handled: 0,
        starts: 1,
        recent_starts: vec![an_hour_ago],
        unclean_stops: 0,
        stopped_at: None,
        failed_at: None,
        error: None,
    };
    let beats = stack
        .bus
        .jetstream()
        .get_key_value(stagehand_bus::HEARTBEATS_BUCKET)
        .await
        .unwrap();
    beats
        .put(
            stagehand_bus::runner::heartbeat_key("promoter", "ghost"),
            serde_json::to_vec(&ghost).unwrap().into(),
        )
        .await
        .unwrap();
    // A demoter alive, but started four times in the last three minutes: a crash loop.
    let now = OffsetDateTime::now_utc();
    let flapping = Heartbeat {
        service: "demoter".into(),
        instance: "flappy".into(),
        started_at: now,
        beat_at: now,
        starts: 4,
        unclean_stops: 3,
        recent_starts: (0..4)
            .map(|m| now - time::Duration::minutes(3 - m))
            .collect(),
        ..ghost.clone()
    };
    beats
        .put(
            stagehand_bus::runner::heartbeat_key("demoter", "flappy"),
            serde_json::to_vec(&flapping).unwrap().into(),
        )
        .await
        .unwrap();

    let mut last = serde_json::Value::Null;
    wait_until(WAIT, "each planted thing to show", || {
        let (code, report) = status(&stack, &policy_dir);
        let all = code == 1
            && !findings(&report, "stage", "stuck-job").is_empty()
            && !findings(&report, "dead_letters", "ingest-validator").is_empty()
            && !findings(&report, "tier", "hot").is_empty()
            && !findings(&report, "service", "promoter on ghost").is_empty()
            && !findings(&report, "service", "demoter on flappy").is_empty();
        last = report;
        async move { all }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {last:#}"));
    let has = |area: &str, subject: &str, run: &str| {
        findings(&last, area, subject)
            .iter()
            .any(|(_, r)| r.contains(run))
    };
    assert!(has(
        "stage",
        "stuck-job",
        "stagehand stage status --project lab stuck-job"
    ));
    assert!(has(
        "dead_letters",
        "ingest-validator",
        "stagehand dlq list --service ingest-validator"
    ));
    assert!(has("tier", "hot", "stagehand tier usage hot"));
    assert!(has(
        "service",
        "promoter on ghost",
        "runbooks/service-silent.md"
    ));
    assert!(
        findings(&last, "service", "demoter on flappy")[0]
            .0
            .starts_with("started 4 times"),
        "{last:#}"
    );
    assert_eq!(last["needs_person"], true);
    assert_eq!(last["stages"]["counts"]["pending"], 1);

    // The human view leads with the same, each with what to run.
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["status", "--policies"])
        .arg(&policy_dir)
        .args(["--nats", &stack.url])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("5 things need a person:"), "{text}");
    assert!(
        text.contains("run: stagehand dlq list --service ingest-validator"),
        "{text}"
    );

    // Replayed (as `stagehand dlq replay` records it): the dead letter no longer waits.
    let Body::DeadLetter(d) = &dead.body else {
        unreachable!()
    };
    let replayed = dead.caused(
        "replayed",
        Body::DeadLetterReplayed(DeadLetterReplayed {
            service: d.service.clone(),
            dead_letter_id: dead.id.clone(),
            dead_letter_sequence: 1,
            subject: d.subject.clone(),
            original_id: None,
            replay_msg_id: "replay-1".into(),
            replayed_by: "operator".into(),
        }),
    );
    stack.bus.publish(&replayed).await.unwrap();
    wait_until(
        WAIT,
        "the replayed dead letter to stop counting",
        || async {
            let (_, report) = status(&stack, &policy_dir);
            findings(&report, "dead_letters", "ingest-validator").is_empty()
                && report["dead_letters"][0]["waiting"] == 0
                && report["dead_letters"][0]["count"] == 1
        },
    )
    .await
    .unwrap();
}

/// A validated version of `dataset` (one 1 KiB file) on capacity, and its id; its events
/// happened `ago`.
async fn validated(stack: &Stagehand, dataset: &str, ago: time::Duration) -> (String, EventId) {
    let refs = vec![FileRef::new(
        "data.bin",
        1024,
        sha256_hex(dataset.as_bytes()),
    )];
    let version = version_digest(&refs);
    let ingest = EventId::for_ingest(PROJECT, dataset, &version);
    let mut event = Event::request(
        EventId::derive(&ingest, "validated"),
        PROJECT,
        Body::DatasetValidated(DatasetValidated {
            dataset: dataset.into(),
            version: version.clone(),
            source: Location {
                tier: "capacity".into(),
                prefix: format!("{PROJECT}/{dataset}/{version}"),
            },
            files: refs,
            manifest: None,
            total_bytes: 1024,
            requested_by: "test".into(),
            request_id: ingest.clone(),
            labels: vec![],
        }),
    );
    event.occurred_at = OffsetDateTime::now_utc() - ago;
    stack.bus.publish(&event).await.unwrap();
    (version, ingest)
}

/// The version's copy on `tier`, as the backup copier records one, made `ago`.
async fn backed_up(stack: &Stagehand, dataset: &str, ago: time::Duration) -> (String, EventId) {
    let (version, ingest) = validated(stack, dataset, ago).await;
    let mut event = Event::request(
        EventId::derive(&ingest, "backup"),
        PROJECT,
        Body::BackupCompleted(BackupCompleted {
            dataset: dataset.into(),
            version: version.clone(),
            location: Location {
                tier: "backup".into(),
                prefix: format!("{PROJECT}/{dataset}/{version}"),
            },
            files: 1,
            total_bytes: 1024,
        }),
    );
    event.occurred_at = OffsetDateTime::now_utc() - ago;
    stack.bus.publish(&event).await.unwrap();
    (version, ingest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_copy_and_failed_or_overdue_drills_need_a_person_with_their_pages() {
    let stack = Stagehand::start(common::Options::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let policy_dir = dir.path().join("policies");
    let root = dir.path().join("tiers");
    policies(&policy_dir, &root);
    std::fs::create_dir_all(root.join("backup")).unwrap();
    let tiers = std::fs::read_to_string(policy_dir.join("tiers.toml")).unwrap();
    std::fs::write(
        policy_dir.join("tiers.toml"),
        format!(
            "{tiers}\n[tiers.backup]\nkind = \"posix\"\nrole = \"backup\"\nfailure_domain = \"vault\"\nroot = \"{}\"\n",
            root.join("backup").display()
        ),
    )
    .unwrap();
    std::fs::write(
        policy_dir.join("backup.toml"),
        "target = \"backup\"\nselect = [\"dataset.validated\"]\nprojects = []\ncheckpoint_tags = []\n\
         verify = \"read-back\"\ndrill_every = \"1d\"\ndrill_sample_files = 1\ndrill_sample_bytes = \"1 MiB\"\n",
    )
    .unwrap();
    let hour = time::Duration::hours(1);

    // A copy on capacity, then found damaged by a scrub with nothing to repair it from.
    let (damaged, ingest) = validated(&stack, "dmg", hour).await;
    stack
        .bus
        .publish(&Event::request(
            EventId::derive(&ingest, "damaged:capacity"),
            PROJECT,
            Body::ReplicaDamaged(ReplicaDamaged {
                dataset: "dmg".into(),
                version: damaged.clone(),
                location: Location {
                    tier: "capacity".into(),
                    prefix: format!("{PROJECT}/dmg/{damaged}"),
                },
                node: None,
                found_by: "scrub".into(),
                files: vec![DamagedFile {
                    path: "data.bin".into(),
                    how: "hash".into(),
                    expected_size: None,
                    found_size: None,
                }],
                damaged_total: 1,
                reason: "no verified replica to repair it from".into(),
            }),
        ))
        .await
        .unwrap();
    // A backup whose drill failed; one backed up three days ago (the drill interval is a
    // day) and never drilled; one backed up an hour ago, whose drill is not due yet.
    let (failed, ingest) = backed_up(&stack, "bad", hour).await;
    stack
        .bus
        .publish(&Event::request(
            EventId::derive(&ingest, "drill"),
            PROJECT,
            Body::RestoreFailed(RestoreFailed {
                dataset: "bad".into(),
                version: failed.clone(),
                location: Location {
                    tier: "backup".into(),
                    prefix: format!("{PROJECT}/bad/{failed}"),
                },
                problems: vec![Problem {
                    code: "checksum_mismatch".into(),
                    path: Some("data.bin".into()),
                    detail: "does not hash to its SHA-256".into(),
                }],
                problem_counts: vec![],
                problems_total: Some(1),
            }),
        ))
        .await
        .unwrap();
    let (overdue, _) = backed_up(&stack, "old", 72 * hour).await;
    backed_up(&stack, "new", hour).await;

    let mut last = serde_json::Value::Null;
    wait_until(WAIT, "the damaged copy and both drills to show", || {
        // The recorder may still be starting: it answers nothing until then.
        let (code, report) =
            try_status(&stack, &policy_dir).unwrap_or((-1, serde_json::Value::Null));
        let all = code == 1
            && report["findings"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|f| f["area"] == "replica" || f["area"] == "drill")
                .count()
                == 4
            && report["drills"]["versions"] == 3;
        last = report;
        async move { all }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {last:#}"));
    let only = |area: &str, subject: &str| {
        let found = findings(&last, area, subject);
        assert_eq!(found.len(), 1, "{area} {subject}: {last:#}");
        found.into_iter().next().unwrap()
    };
    let (detail, run) = only("replica", &format!("{PROJECT}/dmg@{}", &damaged[..12]));
    assert!(detail.contains("no verified replica"), "{detail}");
    assert!(
        run.contains("runbooks/replica-damaged.md") && run.contains("--project lab"),
        "{run}"
    );
    // The backup whose drill failed is also a damaged copy, waiting for the scrub's repair.
    let (detail, _) = only("replica", &format!("{PROJECT}/bad@{}", &failed[..12]));
    assert!(detail.contains("found by restore drill"), "{detail}");
    let (detail, run) = only("drill", &format!("{PROJECT}/bad@{}", &failed[..12]));
    assert!(detail.contains("failed"), "{detail}");
    assert!(run.contains("runbooks/drill-failed.md"), "{run}");
    let (detail, run) = only("drill", &format!("{PROJECT}/old@{}", &overdue[..12]));
    assert!(detail.contains("never drilled"), "{detail}");
    assert!(run.contains("runbooks/drill-overdue.md"), "{run}");
    assert!(findings(&last, "drill", "/new@").is_empty(), "{last:#}");
    assert_eq!(last["drills"]["failed"], 1);
    assert_eq!(last["drills"]["overdue"], 1);
    let damaged_on: Vec<(String, u64)> = (last["damaged"].as_array().unwrap().iter())
        .map(|t| {
            (
                t["tier"].as_str().unwrap().to_owned(),
                t["damaged"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        damaged_on,
        [("backup".to_owned(), 1), ("capacity".to_owned(), 1)],
        "{last:#}"
    );

    // `stagehand scrub status` names the same copy under its tier and exits 1 while it is
    // damaged; the tiers it reads are the ones scrub.toml gives a period.
    std::fs::write(
        policy_dir.join("scrub.toml"),
        "[period]\ncapacity = \"30d\"\nhot = \"7d\"\n\n[budget]\nbytes_per_second = \"200 MiB\"\nfiles_per_second = 2000\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["scrub", "status", "--json", "--policies"])
        .arg(&policy_dir)
        .args(["--nats", &stack.url])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "scrub status: {said}");
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = |tier: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["tier"] == tier)
            .cloned()
            .unwrap_or_else(|| panic!("no {tier} row: {rows:#}"))
    };
    let capacity = row("capacity");
    assert_eq!(capacity["damaged_total"], 1, "{capacity:#}");
    let copy = capacity["damaged"][0]["replica"].as_str().unwrap();
    assert!(copy.contains(&format!("dmg@{}", &damaged[..12])), "{copy}");
    assert!(
        capacity["damaged"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no verified replica")),
        "{capacity:#}"
    );
    assert_eq!(row("hot")["damaged_total"], 0, "{rows:#}");
}

/// Regression: the backlog's age was read from the message right after a consumer's ack
/// floor, which may be of another subject of the stream (on the requests stream, another
/// service's), older than anything the consumer waits on. The oldest waiting message is the
/// first after the floor of the consumer's own filter subjects, the earliest over several.
#[tokio::test]
async fn the_oldest_waiting_message_is_of_the_consumers_own_subjects() {
    use async_nats::jetstream::{self, consumer::pull};
    use futures::StreamExt;
    let server = stagehand_testkit::NatsServer::start();
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: stagehand_testkit::unique_name("BACKLOG"),
            subjects: vec!["old.>".into(), "work.>".into(), "more.>".into()],
            allow_direct: true,
            ..Default::default()
        })
        .await
        .unwrap();
    // Sequence 1, right after every consumer's ack floor: of a subject none of them reads.
    for subject in ["old.1", "work.1", "more.1", "work.2"] {
        js.publish(subject, "x".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let consumer = |name: &str, filters: &[&str]| pull::Config {
        durable_name: Some(name.into()),
        filter_subjects: filters.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    };
    let oldest = |name: &'static str| {
        let stream = stream.clone();
        async move {
            let info = stream.consumer_info(name).await.unwrap();
            stagehand::status::oldest_waiting(&stream, &info)
                .await
                .map(|m| (m.sequence, m.subject.to_string()))
        }
    };
    let worker = stream
        .create_consumer(pull::Config {
            filter_subject: "work.>".into(),
            ..consumer("worker", &[])
        })
        .await
        .unwrap();
    for (name, filters) in [
        ("both", &["more.>", "work.>"][..]),
        ("idle", &["none.>"][..]),
        ("all", &[][..]),
    ] {
        stream
            .create_consumer(consumer(name, filters))
            .await
            .unwrap();
    }
    assert_eq!(oldest("worker").await, Some((2, "work.1".into())));
    // Of several filter subjects, the earliest message over them, whatever their order.
    assert_eq!(oldest("both").await, Some((2, "work.1".into())));
    assert_eq!(oldest("idle").await, None);
    // A consumer of every subject waits on the stream's first message.
    assert_eq!(oldest("all").await, Some((1, "old.1".into())));

    // work.1 acknowledged: the floor moves to 2; sequence 3 (more.1) is not the worker's.
    let mut batch = worker.fetch().max_messages(1).messages().await.unwrap();
    let first = batch.next().await.unwrap().unwrap();
    assert_eq!(first.subject.as_str(), "work.1");
    first.double_ack().await.unwrap();
    assert_eq!(oldest("worker").await, Some((4, "work.2".into())));
}

/// A node another agent caught serving bytes that did not verify in a fan-out (its
/// `swarm.<s>.bad.<node>.<by>` key, as the agents write it) needs a person, named with the version
/// its swarm is of and the page, until that node's own copy is read whole again after the
/// report. A report of a swarm the catalogue knows no copy of stays named with the page alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_served_bad_bytes_needs_a_person_until_its_copy_is_read_again() {
    use stagehand_promoter::fanout::Fanout;
    use stagehand_schemas::ReplicaVerified;
    let stack = Stagehand::start(common::Options::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let policy_dir = dir.path().join("policies");
    let root = dir.path().join("tiers");
    policies(&policy_dir, &root);
    std::fs::create_dir_all(root.join("local")).unwrap();
    let tiers = std::fs::read_to_string(policy_dir.join("tiers.toml")).unwrap();
    std::fs::write(
        policy_dir.join("tiers.toml"),
        format!(
            "{tiers}\n[tiers.local]\nkind = \"posix\"\nrole = \"local\"\nfailure_domain = \"nvme\"\nroot = \"{}\"\ncapacity = \"1 GiB\"\n",
            root.join("local").display()
        ),
    )
    .unwrap();
    let (version, ingest) = validated(&stack, "owls", time::Duration::hours(1)).await;
    let location = Location {
        tier: "local".into(),
        prefix: format!("{PROJECT}/owls/{version}"),
    };
    let mut made = Event::request(
        EventId::derive(&ingest, "replica:local:gpu-2"),
        PROJECT,
        Body::ReplicaCreated(ReplicaCreated {
            dataset: "owls".into(),
            version: version.clone(),
            location: location.clone(),
            files: 1,
            total_bytes: 1024,
            verified_by: "read-back".into(),
            node: Some("gpu-2".into()),
        }),
    );
    made.occurred_at = OffsetDateTime::now_utc() - time::Duration::hours(1);
    stack.bus.publish(&made).await.unwrap();
    wait_until(WAIT, "quiet before the reports", || async {
        try_status(&stack, &policy_dir).is_ok_and(|(code, _)| code == 0)
    })
    .await
    .unwrap();

    let board = stack
        .bus
        .provision_kv(&stagehand_bus::SWARMS)
        .await
        .unwrap();
    let swarm = Fanout::swarm("local", PROJECT, "owls", &version);
    let report = || {
        serde_json::json!({"file": "data.bin", "why": "sha256 differs"})
            .to_string()
            .into()
    };
    board
        .put(format!("swarm.{swarm}.bad.gpu-2.gpu-1"), report())
        .await
        .unwrap();
    let unknown = "0".repeat(32);
    board
        .put(format!("swarm.{unknown}.bad.gpu-3.gpu-1"), report())
        .await
        .unwrap();
    let mut last = serde_json::Value::Null;
    let named = wait_until(WAIT, "both reports named", || {
        let (code, report) = status(&stack, &policy_dir);
        let hit = code == 1
            && !findings(&report, "fanout", "gpu-2").is_empty()
            && !findings(&report, "fanout", "gpu-3").is_empty();
        last = report;
        std::future::ready(hit)
    })
    .await;
    if let Err(e) = named {
        panic!("{e}: {:#}", last["findings"]);
    }
    let (detail, run) = &findings(&last, "fanout", "gpu-2")[0];
    assert!(
        detail.starts_with(&format!(
            "node gpu-2 served bad bytes in swarm {swarm} ({PROJECT}/owls@{} on local, its copy present): data.bin: sha256 differs (caught by gpu-1,",
            &version[..12]
        )),
        "{detail}"
    );
    assert_eq!(
        run,
        &format!(
            "stagehand catalogue show owls@{} --project {PROJECT} (runbooks/fanout-peer-dropped.md)",
            &version[..12]
        )
    );
    let (detail, run) = &findings(&last, "fanout", "gpu-3")[0];
    assert!(detail.contains("no copy of it on that node"), "{detail}");
    assert_eq!(run, "runbooks/fanout-peer-dropped.md");

    // gpu-2's own copy read whole again after the report (its agent's check, a scrub).
    stack
        .bus
        .publish(&Event::request(
            EventId::derive(&ingest, "verified:local:gpu-2"),
            PROJECT,
            Body::ReplicaVerified(ReplicaVerified {
                dataset: "owls".into(),
                version: version.clone(),
                location,
                node: Some("gpu-2".into()),
                files: 1,
                total_bytes: 1024,
                verified_by: "scrub".into(),
            }),
        ))
        .await
        .unwrap();
    wait_until(WAIT, "gpu-2 no longer named, gpu-3 still", || {
        let (_, report) = status(&stack, &policy_dir);
        let done = findings(&report, "fanout", "gpu-2").is_empty()
            && !findings(&report, "fanout", "gpu-3").is_empty();
        last = report;
        std::future::ready(done)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {:#}", last["findings"]));
}
