//! Facts for the unit tests.

use stagehand_schemas::*;

pub fn request(n: u32) -> Event {
    let files = vec![
        FileRef::new(format!("f{n}.bin"), 3, sha256_hex(b"abc")),
        FileRef::new("labels.csv", 0, sha256_hex(b"")),
    ];
    Event::request(
        EventId::new(format!("req-{n}")).unwrap(),
        "lab-a",
        Body::IngestRequested(IngestRequested {
            dataset: "cats".into(),
            source: Location {
                tier: "source".into(),
                prefix: "lab-a/cats/x".into(),
            },
            files,
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    )
}

pub fn validated(n: u32) -> Event {
    let req = request(n);
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

pub fn version_of(e: &Event) -> String {
    match &e.body {
        Body::DatasetValidated(p) => p.version.clone(),
        _ => unreachable!(),
    }
}

pub fn rejected(n: u32) -> Event {
    let req = request(n);
    req.caused(
        "rejected",
        Body::DatasetRejected(DatasetRejected {
            dataset: "cats".into(),
            source: Location {
                tier: "source".into(),
                prefix: "p".into(),
            },
            declared_version: "0".repeat(64),
            requested_by: "mallory".into(),
            request_id: req.id.clone(),
            problems: vec![
                Problem::new("path_rule", Some("../x"), "parent component"),
                Problem::new("missing", Some("gone.bin"), "not on the tier"),
            ],
            quarantine: None,
            problem_counts: vec![],
            problems_total: None,
        }),
    )
}

pub fn replica(n: u32, removed: bool) -> Event {
    let v = validated(n);
    let location = Location {
        tier: "hot".into(),
        prefix: "lab-a/cats/hot".into(),
    };
    let body = if removed {
        Body::ReplicaRemoved(ReplicaRemoved {
            dataset: "cats".into(),
            version: version_of(&v),
            location,
            reason: "idle".into(),
            node: None,
        })
    } else {
        Body::ReplicaCreated(ReplicaCreated {
            dataset: "cats".into(),
            version: version_of(&v),
            location,
            files: 2,
            total_bytes: 3,
            verified_by: "read-back".into(),
            node: None,
        })
    };
    v.caused(if removed { "removed" } else { "created" }, body)
}

/// `replica.created` (or `.removed`) of version `n` on the `local` tier of `node`, at `at`
/// seconds.
pub fn node_replica(n: u32, node: &str, removed: bool, at: i64) -> Event {
    let v = validated(n);
    let location = Location {
        tier: "local".into(),
        prefix: "lab-a/cats/v".into(),
    };
    let body = if removed {
        Body::ReplicaRemoved(ReplicaRemoved {
            dataset: "cats".into(),
            version: version_of(&v),
            location,
            reason: "idle".into(),
            node: Some(node.into()),
        })
    } else {
        Body::ReplicaCreated(ReplicaCreated {
            dataset: "cats".into(),
            version: version_of(&v),
            location,
            files: 2,
            total_bytes: 3,
            verified_by: "read-back".into(),
            node: Some(node.into()),
        })
    };
    let step = format!(
        "{}:local:{node}",
        if removed { "removed" } else { "replica" }
    );
    let mut e = v.caused(&step, body);
    e.occurred_at = time::OffsetDateTime::from_unix_timestamp(1_700_000_000 + at).unwrap();
    e
}

pub fn stage(n: u32, job: &str, ready: bool) -> Event {
    let v = validated(n);
    let body = if ready {
        Body::StageReady(StageReady {
            dataset: "cats".into(),
            version: version_of(&v),
            location: Location {
                tier: "local".into(),
                prefix: "lab-a/cats/v".into(),
            },
            job_id: job.into(),
            request_id: EventId::new(format!("stage-{job}")).unwrap(),
            node: None,
            path: Some("/mnt/local/lab-a/cats/v".into()),
        })
    } else {
        Body::StageFailed(StageFailed {
            dataset: "cats".into(),
            version: version_of(&v),
            tier: "local".into(),
            job_id: job.into(),
            request_id: EventId::new(format!("stage-{job}")).unwrap(),
            reason: "quota exceeded".into(),
            retryable: false,
            node: None,
        })
    };
    v.caused(&format!("{job}:{ready}"), body)
}

pub fn dead_letter(n: u64) -> Event {
    request(1).caused(
        &format!("dl{n}"),
        Body::DeadLetter(DeadLetter {
            service: "ingest-validator".into(),
            stream: "S".into(),
            consumer: "c".into(),
            stream_sequence: n,
            subject: "stagehand.req.ingest.requested.lab-a".into(),
            delivered: 5,
            original: vec![1, 2],
            headers: vec![],
            errors: vec![],
            original_id: None,
        }),
    )
}

/// A store with `events` folded, their inline file lists written first (what the recorder's
/// [`crate::files::FileLists`] does for a fact before its fold).
pub fn store_with(dir: &std::path::Path, name: &str, events: &[Event]) -> crate::store::Store {
    let store = crate::store::Store::open(dir.join(name)).unwrap();
    fold_into(&store, events);
    store
}

pub fn fold_into(store: &crate::store::Store, events: &[Event]) -> Vec<crate::store::Folded> {
    for e in events {
        if let Some(stagehand_manifest::ManifestSource::Inline(files)) =
            stagehand_manifest::ManifestSource::of(e).unwrap()
        {
            store
                .put_file_list(&stagehand_manifest::Manifest::from_entries(files))
                .unwrap();
        }
    }
    let items: Vec<_> = events
        .iter()
        .map(|e| crate::store::FoldItem {
            event: e.clone(),
            sequence: None,
            problem: None,
        })
        .collect();
    store.apply_batch(&items).unwrap()
}

/// The commit of `step` of run `r1` in project `lab-a`, `second` seconds into the run.
pub fn checkpoint_committed(step: u64, tags: &[&str], second: i64) -> Event {
    let mut e = Event::request(
        EventId::for_checkpoint("lab-a", "r1", step),
        "lab-a",
        Body::CheckpointCommitted(CheckpointCommitted {
            run: "r1".into(),
            step,
            location: Location {
                tier: "hot".into(),
                prefix: format!("lab-a/checkpoints/r1/step-{step}"),
            },
            // Each step's own content, so each is its own version of `ckpt-r1`.
            files: vec![FileRef::new(
                "model.pt",
                8,
                sha256_hex(format!("{step:08}").as_bytes()),
            )],
            manifest: None,
            total_bytes: 8,
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
        }),
    );
    e.occurred_at = at(second);
    e
}

/// The demotion of the commit of `step` to `capacity` by `rule`, `second` seconds in.
pub fn checkpoint_demoted(step: u64, rule: Option<&str>, second: i64) -> Event {
    let commit = checkpoint_committed(step, &[], 0);
    let Body::CheckpointCommitted(c) = &commit.body else {
        unreachable!()
    };
    let mut e = commit.caused(
        "demoted",
        Body::CheckpointDemoted(CheckpointDemoted {
            run: c.run.clone(),
            step,
            from: c.location.clone(),
            to: Location {
                tier: "capacity".into(),
                prefix: c.location.prefix.clone(),
            },
            total_bytes: c.total_bytes,
            rule: rule.map(str::to_owned),
        }),
    );
    e.occurred_at = at(second);
    e
}

/// The expiry of the commit of `step` from hot, `second` seconds in.
pub fn checkpoint_expired(step: u64, second: i64) -> Event {
    let commit = checkpoint_committed(step, &[], 0);
    let Body::CheckpointCommitted(c) = &commit.body else {
        unreachable!()
    };
    let mut e = commit.caused(
        "expired",
        Body::CheckpointExpired(CheckpointExpired {
            run: c.run.clone(),
            step,
            location: c.location.clone(),
            rule: "expired".into(),
        }),
    );
    e.occurred_at = at(second);
    e
}

fn at(second: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(1_800_000_000 + second).expect("a valid time")
}
