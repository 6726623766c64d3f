//! Every example under `schemas/examples/` is valid against its kind's schema and the
//! envelope schema, decodes in Rust, and survives JSON → Event → MessagePack → Event. The
//! schemas are also checked to refuse what the decoder refuses, so they are not vacuous.

mod common;

use common::*;
use serde_json::{Value, json};
use stagehand_schemas::{ALL_KINDS, Body, EventId, total_bytes, version_digest, wire};

#[test]
fn every_kind_has_exactly_one_example() {
    let mut found: Vec<String> = std::fs::read_dir(crate_dir().join("examples"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "json"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    found.sort();
    let mut expected: Vec<String> = ALL_KINDS.iter().map(|k| k.to_string()).collect();
    expected.sort();
    assert_eq!(found, expected);
}

#[test]
fn every_example_validates_against_its_schema_and_the_envelope() {
    for kind in ALL_KINDS {
        let example = example_json(kind);
        let errors = schema_errors(kind, &example);
        assert!(errors.is_empty(), "examples/{kind}.json: {errors:#?}");
        let errors = schema_errors("envelope", &example);
        assert!(
            errors.is_empty(),
            "examples/{kind}.json vs envelope: {errors:#?}"
        );
    }
}

#[test]
fn no_example_validates_against_another_kinds_schema() {
    for kind in ALL_KINDS {
        for other in ALL_KINDS.iter().filter(|o| *o != kind) {
            assert!(
                !validator(other).is_valid(&example_json(kind)),
                "examples/{kind}.json passes json/{other}.json"
            );
        }
    }
}

#[test]
fn every_example_decodes_and_round_trips_through_msgpack() {
    for kind in ALL_KINDS {
        let event = example_event(kind);
        assert_eq!(
            event.kind(),
            *kind,
            "examples/{kind}.json has the wrong kind"
        );
        let bytes = wire::encode(&event).unwrap();
        let back = wire::decode(&bytes).unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(back, event, "{kind}");
        // And back to JSON: the same document a producer would write, modulo timestamp form.
        let again: stagehand_schemas::Event =
            serde_json::from_value(serde_json::to_value(&back).unwrap()).unwrap();
        assert_eq!(again, event, "{kind} via JSON");
    }
}

#[test]
fn rust_encoded_events_validate_against_the_schemas() {
    // What the services write (serde's JSON view of the same map) must satisfy the schema
    // that outside producers read, including `original` as an array of byte values.
    for kind in ALL_KINDS {
        let json = serde_json::to_value(example_event(kind)).unwrap();
        let errors = schema_errors(kind, &json);
        assert!(errors.is_empty(), "{kind}: {errors:#?}");
    }
}

#[test]
fn examples_follow_the_contract_rules() {
    // The examples are documentation: their digests and ids follow the rules they illustrate.
    let ingest = example_event("ingest.requested");
    let Body::IngestRequested(request) = &ingest.body else {
        unreachable!()
    };
    let manifest = request
        .manifest
        .as_ref()
        .expect("the example shows a manifest by reference");
    assert!(
        request.files.is_empty(),
        "inline files and a reference exclude each other"
    );
    let version = manifest.digest.clone();
    assert_eq!(
        ingest.id,
        EventId::for_ingest(&ingest.project, &request.dataset, &version)
    );
    assert!(
        request
            .source
            .prefix
            .starts_with(&format!("{}/", ingest.project)),
        "a source prefix lies beneath its project's own"
    );

    let validated = example_event("dataset.validated");
    let Body::DatasetValidated(fact) = &validated.body else {
        unreachable!()
    };
    assert_eq!(fact.version, version);
    assert_eq!(fact.manifest.as_ref(), Some(manifest));
    assert_eq!(fact.total_bytes, manifest.bytes);
    assert_eq!(
        validated.id,
        EventId::for_fact(&ingest.project, &ingest.id, "validated")
    );
    assert_eq!(validated.causation_id.as_ref(), Some(&ingest.id));
    assert_eq!(validated.correlation_id, ingest.id);

    let prepared = example_event("dataset.prepared");
    let Body::DatasetPrepared(derived) = &prepared.body else {
        unreachable!()
    };
    let shards = derived.manifest.as_ref().unwrap();
    assert_eq!(derived.version, shards.digest);
    assert_eq!(derived.total_bytes, shards.bytes);
    assert_eq!(derived.derived_from, version);

    let checkpoint = example_event("checkpoint.committed");
    let Body::CheckpointCommitted(ckpt) = &checkpoint.body else {
        unreachable!()
    };
    assert_eq!(ckpt.total_bytes, total_bytes(&ckpt.files));
    for file in &ckpt.files {
        file.check().unwrap();
    }

    let rejected = example_event("dataset.rejected");
    let Body::DatasetRejected(rejection) = &rejected.body else {
        unreachable!()
    };
    let counted: u64 = rejection.problem_counts.iter().map(|(_, n)| n).sum();
    assert_eq!(Some(counted), rejection.problems_total);

    let dead = example_event("dead.letter");
    let Body::DeadLetter(letter) = &dead.body else {
        unreachable!()
    };
    assert_eq!(
        dead.id,
        EventId::for_dead_letter(&letter.stream, &letter.consumer, letter.stream_sequence)
    );
    assert!(wire::decode(&letter.original).is_err());

    let replayed = example_event("dead.letter.replayed");
    let Body::DeadLetterReplayed(replay) = &replayed.body else {
        unreachable!()
    };
    assert_eq!(replay.dead_letter_id, dead.id);
    assert_eq!(replay.subject, letter.subject);
    // A version-1 upload's manifest still travels inline, and its digest is over those lines.
    let v1: stagehand_schemas::Event = serde_json::from_value(read_json(
        &crate_dir().join("fixtures/v1/ingest.requested.json"),
    ))
    .unwrap();
    let Body::IngestRequested(old) = &v1.body else {
        unreachable!()
    };
    assert_eq!(
        v1.id,
        EventId::for_ingest(&v1.project, &old.dataset, &version_digest(&old.files))
    );
}

/// Sets `pointer` in a copy of `value`.
fn with(value: &Value, pointer: &str, new: Value) -> Value {
    let mut value = value.clone();
    *value
        .pointer_mut(pointer)
        .unwrap_or_else(|| panic!("{pointer}")) = new;
    value
}

#[test]
fn schemas_refuse_what_the_contract_refuses() {
    let mut ingest = example_json("ingest.requested");
    // An inline manifest, to check its entries' rules too.
    ingest["payload"]["files"] = json!([{
        "path": "images/000001.jpg",
        "size": 180735,
        "sha256": "18f335e5ca4827f2c1774485396bea1a89bcafdfa370bec70d91542f3a2d6c2f"
    }]);
    assert!(schema_errors("ingest.requested", &ingest).is_empty());
    let bad: &[(&str, Value)] = &[
        ("/project", json!("Vision Lab")),
        ("/project", json!("x".repeat(65))),
        ("/id", json!("has space")),
        ("/id", json!("x".repeat(129))),
        ("/correlation_id", json!("")),
        ("/schema", json!(0)),
        ("/schema", json!("1")),
        ("/occurred_at", json!("yesterday")),
        ("/kind", json!("dataset.validated")),
        ("/payload/files/0/sha256", json!("ABC")),
        ("/payload/files/0/size", json!(-1)),
        ("/payload/files/0/path", json!("")),
        ("/payload/labels/0", json!(["modality"])),
        ("/payload/manifest/digest", json!("be7246df1859")),
        ("/payload/manifest/files", json!(-1)),
    ];
    for (pointer, value) in bad {
        let instance = with(&ingest, pointer, value.clone());
        assert!(
            !validator("ingest.requested").is_valid(&instance),
            "ingest.requested schema accepts {pointer} = {value}"
        );
    }
    let mut missing = ingest.clone();
    missing["payload"]
        .as_object_mut()
        .unwrap()
        .remove("dataset");
    assert!(!validator("ingest.requested").is_valid(&missing));

    let dead = example_json("dead.letter");
    for value in [json!([256]), json!("bytes"), json!([-1])] {
        let instance = with(&dead, "/payload/original", value.clone());
        assert!(
            !validator("dead.letter").is_valid(&instance),
            "original = {value}"
        );
    }
    let validated = example_json("dataset.validated");
    let short = with(&validated, "/payload/version", json!("be7246df1859"));
    assert!(!validator("dataset.validated").is_valid(&short));
    let stage = example_json("stage.requested");
    let prefix = with(&stage, "/payload/version", json!("be7246df185"));
    assert!(
        !validator("stage.requested").is_valid(&prefix),
        "prefix under 12"
    );
}

#[test]
fn schemas_accept_unknown_fields_and_omitted_optional_ones() {
    let mut ingest = example_json("ingest.requested");
    ingest["added_later"] = json!({"any": "shape"});
    ingest["payload"]["added_later"] = json!(1);
    ingest["payload"]["manifest"]["added_later"] = json!(null);
    ingest["payload"].as_object_mut().unwrap().remove("labels");
    ingest.as_object_mut().unwrap().remove("causation_id");
    assert!(schema_errors("ingest.requested", &ingest).is_empty());
    // The Rust reader agrees with the schema.
    let event: stagehand_schemas::Event = serde_json::from_value(ingest).unwrap();
    let Body::IngestRequested(request) = event.body else {
        unreachable!()
    };
    assert!(request.labels.is_empty());
}
