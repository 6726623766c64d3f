//! The wire format: every kind round-trips, readers tolerate what the contract allows
//! (unknown fields, any field order, compact integers, other producers' encodings) and refuse
//! the rest with an error that names what is wrong.

mod common;

use common::*;
use serde::Serialize;
use serde_json::{Value, json};
use stagehand_schemas::Retryable;
use stagehand_schemas::subject::{
    self, STREAMS, dead_letter_subject, replayed_subject, subject_for, subject_matches,
};
use stagehand_schemas::wire::{
    self, DecodeError, EncodeError, MAX_DEAD_LETTER_BYTES, MAX_DECODE_BYTES, MAX_EVENT_BYTES,
};
use stagehand_schemas::{
    ALL_KINDS, Body, DeadLetter, Event, EventId, FileRef, SCHEMA_VERSION, sha256_hex,
};

/// A msgpack map encoded from a JSON value, as a Python or Go producer would write it.
fn msgpack(value: &Value) -> Vec<u8> {
    rmp_serde::to_vec_named(value).unwrap()
}

/// The example of `kind` as JSON, for a kind whose payload has no byte fields.
fn plain_kinds() -> impl Iterator<Item = &'static str> {
    ALL_KINDS.iter().copied().filter(|k| *k != "dead.letter")
}

#[test]
fn every_kind_round_trips() {
    let examples = all_examples();
    assert_eq!(examples.len(), ALL_KINDS.len());
    for event in examples {
        let bytes = wire::encode(&event).unwrap();
        assert_eq!(wire::decode(&bytes).unwrap(), event, "{}", event.kind());
    }
}

#[test]
fn built_events_round_trip_with_derived_ids() {
    let request = example_event("ingest.requested");
    let Body::IngestRequested(ingest) = &request.body else {
        unreachable!()
    };
    let fact = request.caused(
        "replica:source",
        Body::ReplicaCreated(stagehand_schemas::ReplicaCreated {
            dataset: ingest.dataset.clone(),
            version: stagehand_schemas::version_digest(&ingest.files),
            location: ingest.source.clone(),
            files: ingest.files.len() as u64,
            total_bytes: stagehand_schemas::total_bytes(&ingest.files),
            verified_by: "read-back".into(),
            node: None,
        }),
    );
    assert_eq!(fact.schema, SCHEMA_VERSION);
    assert_eq!(
        fact.id,
        EventId::for_fact(&request.project, &request.id, "replica:source")
    );
    assert_eq!(fact.causation_id.as_ref(), Some(&request.id));
    assert_eq!(fact.correlation_id, request.correlation_id);
    let bytes = wire::encode(&fact).unwrap();
    assert_eq!(wire::decode(&bytes).unwrap(), fact);
}

#[test]
fn unknown_fields_are_ignored_in_envelope_and_payload() {
    for kind in plain_kinds() {
        let mut doc = example_json(kind);
        doc["added_in_v2"] = json!({"nested": [1, 2, {"deep": null}]});
        doc["payload"]["added_in_v2"] = json!("text");
        for nested in ["source", "location", "from", "to"] {
            if doc["payload"].get(nested).is_some() {
                doc["payload"][nested]["added_in_v2"] = json!(true);
            }
        }
        for list in ["files", "problems"] {
            if let Some(items) = doc["payload"].get_mut(list).and_then(Value::as_array_mut) {
                for item in items {
                    item["added_in_v2"] = json!(-7);
                }
            }
        }
        let event = wire::decode(&msgpack(&doc)).unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(event, example_event(kind), "{kind}");
    }
}

#[test]
fn unknown_fields_are_ignored_in_a_dead_letter() {
    let event = example_event("dead.letter");
    let mut bytes = wire::encode(&event).unwrap();
    // Append one more key to the top-level fixmap: bump its length and add `"extra": 1`.
    assert!((0x80..0x8f).contains(&bytes[0]));
    bytes[0] += 1;
    bytes.extend_from_slice(&rmp_serde::to_vec(&"extra").unwrap());
    bytes.push(0x01);
    assert_eq!(wire::decode(&bytes).unwrap(), event);
}

#[test]
fn field_order_does_not_matter() {
    for kind in plain_kinds() {
        let doc = example_json(kind);
        // Payload first, envelope fields reversed: a map's order is the producer's business.
        let mut reordered = serde_json::Map::new();
        reordered.insert("payload".into(), doc["payload"].clone());
        let mut rest: Vec<(&String, &Value)> = doc.as_object().unwrap().iter().collect();
        rest.reverse();
        for (key, value) in rest {
            if key != "payload" {
                reordered.insert(key.clone(), value.clone());
            }
        }
        // serde_json::Map sorts keys; encode entry by entry to keep this order on the wire.
        let bytes = encode_ordered(&reordered);
        assert_eq!(wire::decode(&bytes).unwrap(), example_event(kind), "{kind}");
    }
}

fn encode_ordered(map: &serde_json::Map<String, Value>) -> Vec<u8> {
    assert!(map.len() < 16, "fixmap only");
    let mut out = vec![0x80 | map.len() as u8];
    // `payload` first, then the rest in reverse key order.
    let mut keys: Vec<&String> = map.keys().collect();
    keys.sort_by_key(|k| (k.as_str() != "payload", std::cmp::Reverse(k.as_str())));
    for key in keys {
        out.extend(rmp_serde::to_vec(key).unwrap());
        out.extend(rmp_serde::to_vec_named(&map[key]).unwrap());
    }
    out
}

#[test]
fn other_producers_encodings_decode() {
    // Timestamps with an offset and without fractions; `original` as an array of integers
    // rather than `bin`; causation_id absent rather than nil.
    let mut doc = example_json("dead.letter");
    doc["occurred_at"] = json!("2026-11-29T11:15:00.25+01:00");
    doc.as_object_mut().unwrap().remove("causation_id");
    let event = wire::decode(&msgpack(&doc)).unwrap();
    assert_eq!(event, example_event("dead.letter"));

    let mut doc = example_json("stage.requested");
    doc["payload"]["deadline"] = json!("2026-11-29T11:30:00.000000000Z");
    assert_eq!(
        wire::decode(&msgpack(&doc)).unwrap(),
        example_event("stage.requested")
    );
    doc["payload"].as_object_mut().unwrap().remove("deadline");
    let event = wire::decode(&msgpack(&doc)).unwrap();
    let Body::StageRequested(stage) = event.body else {
        unreachable!()
    };
    assert_eq!(stage.deadline, None);
}

#[test]
fn unknown_kind_is_named() {
    let mut doc = example_json("ingest.requested");
    doc["kind"] = json!("dataset.teleported");
    let err = wire::decode(&msgpack(&doc)).unwrap_err();
    assert!(
        matches!(&err, DecodeError::UnknownKind { kind, schema } if kind == "dataset.teleported" && *schema == SCHEMA_VERSION),
        "{err:?}"
    );
    assert!(err.to_string().contains("\"dataset.teleported\""), "{err}");
    assert!(!err.is_retryable());
}

#[test]
fn newer_schema_is_refused_before_its_shape_is_judged() {
    let mut doc = example_json("ingest.requested");
    doc["schema"] = json!(SCHEMA_VERSION + 1);
    let err = wire::decode(&msgpack(&doc)).unwrap_err();
    assert!(matches!(err, DecodeError::NewerSchema { found } if found == SCHEMA_VERSION + 1));
    // A newer producer may add kinds and reshape payloads; the answer is still NewerSchema.
    doc["kind"] = json!("dataset.teleported");
    doc["payload"] = json!([1, 2, 3]);
    doc["project"] = json!("Not A Token");
    let err = wire::decode(&msgpack(&doc)).unwrap_err();
    assert!(matches!(err, DecodeError::NewerSchema { .. }), "{err:?}");
    let version = format!("schema version {}", SCHEMA_VERSION + 1);
    assert!(err.to_string().contains(&version), "{err}");
}

#[test]
fn schema_zero_is_invalid() {
    let mut doc = example_json("stage.released");
    doc["schema"] = json!(0);
    let err = wire::decode(&msgpack(&doc)).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::InvalidField {
                field: "schema",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn oversize_messages_are_refused_before_parsing() {
    let junk = vec![0xc1u8; MAX_DECODE_BYTES + 1];
    assert!(matches!(
        wire::decode(&junk),
        Err(DecodeError::TooLarge { len }) if len == MAX_DECODE_BYTES + 1
    ));
}

/// An ingest request whose manifest makes it about `target` bytes encoded.
fn big_ingest(target: usize) -> Event {
    let mut event = example_event("ingest.requested");
    let Body::IngestRequested(request) = &mut event.body else {
        unreachable!()
    };
    let sha = sha256_hex(b"x");
    let file = |i: usize| FileRef::new(format!("images/{i:012}.jpg"), 1 << 20, sha.clone());
    let per_file = rmp_serde::to_vec_named(&file(0)).unwrap().len();
    request.files = (0..target / per_file).map(file).collect();
    event
}

#[test]
fn oversize_events_are_refused_by_writers_and_read_up_to_the_old_bound() {
    let event = big_ingest(MAX_EVENT_BYTES + 4096);
    let Err(err) = wire::encode(&event) else {
        panic!("an oversize event was encoded");
    };
    assert!(matches!(err, EncodeError::TooLarge { len } if len > MAX_EVENT_BYTES));
    assert!(!err.is_retryable());
    // Schema-1 writers put manifests of up to 8 MiB inline; their events stay readable.
    let mut old = big_ingest(8 * 1024 * 1024 - 4096);
    old.schema = 1;
    let bytes = rmp_serde::to_vec_named(&old).unwrap();
    assert!(bytes.len() > MAX_EVENT_BYTES && bytes.len() <= MAX_DECODE_BYTES);
    assert_eq!(wire::decode(&bytes).unwrap(), old);
    // Just under the writers' bound is fine.
    let event = big_ingest(MAX_EVENT_BYTES - 64 * 1024);
    let bytes = wire::encode(&event).unwrap();
    assert_eq!(wire::decode(&bytes).unwrap(), event);
}

#[test]
fn a_dead_letter_can_carry_a_message_of_the_largest_size() {
    let mut event = example_event("dead.letter");
    let Body::DeadLetter(letter) = &mut event.body else {
        unreachable!()
    };
    letter.original = vec![0xc1; MAX_EVENT_BYTES];
    let bytes = wire::encode(&event).unwrap();
    assert!(bytes.len() > MAX_EVENT_BYTES);
    assert_eq!(wire::decode(&bytes).unwrap(), event);
    letter_too_big(event);
}

fn letter_too_big(mut event: Event) {
    let Body::DeadLetter(DeadLetter { original, .. }) = &mut event.body else {
        unreachable!()
    };
    original.resize(MAX_DEAD_LETTER_BYTES, 0);
    assert!(matches!(
        wire::encode(&event),
        Err(EncodeError::TooLarge { .. })
    ));
}

#[test]
fn invalid_project_and_ids_name_the_field() {
    let cases: &[(&str, &str, Value)] = &[
        ("project", "/project", json!("Vision-Lab")),
        ("project", "/project", json!("vision.lab")),
        ("project", "/project", json!("")),
        ("project", "/project", json!("x".repeat(65))),
        ("id", "/id", json!("two words")),
        ("id", "/id", json!("x".repeat(129))),
        ("correlation_id", "/correlation_id", json!("")),
        ("causation_id", "/causation_id", json!("stagehand.>")),
        ("payload.request_id", "/payload/request_id", json!("a/b")),
    ];
    for (field, pointer, value) in cases {
        let mut doc = example_json("dataset.validated");
        *doc.pointer_mut(pointer).unwrap() = value.clone();
        let err = wire::decode(&msgpack(&doc)).unwrap_err();
        assert!(
            matches!(&err, DecodeError::InvalidField { field: f, .. } if f == field),
            "{pointer} = {value}: {err:?}"
        );
        assert!(err.to_string().contains(field), "{err}");
    }
}

#[test]
fn shapes_that_are_not_events_are_malformed_with_a_reason() {
    let cases: &[(Vec<u8>, &str)] = &[
        (Vec::new(), "empty"),
        (vec![0x93, 1, 2, 3], "expected a map"),
        (vec![0xa3, b'a', b'b', b'c'], "expected a map"),
        (vec![0x81, 0xa4, b'k', b'i', b'n', b'd'], ""),
    ];
    for (bytes, reason) in cases {
        let err = wire::decode(bytes).unwrap_err();
        assert!(
            matches!(err, DecodeError::Malformed(_)),
            "{bytes:?}: {err:?}"
        );
        assert!(err.to_string().contains(reason), "{err}");
    }
    // A known kind with a payload of the wrong shape names the kind.
    let mut doc = example_json("ingest.requested");
    doc["payload"]["manifest"]["files"] = json!("many");
    let err = wire::decode(&msgpack(&doc)).unwrap_err();
    assert!(
        err.to_string().contains("`ingest.requested` event"),
        "{err}"
    );
    let mut doc = example_json("ingest.requested");
    doc.as_object_mut().unwrap().remove("payload");
    let err = wire::decode(&msgpack(&doc)).unwrap_err();
    assert!(err.to_string().contains("payload"), "{err}");
    let mut doc = example_json("ingest.requested");
    doc["occurred_at"] = json!("29/11/2026");
    assert!(matches!(
        wire::decode(&msgpack(&doc)),
        Err(DecodeError::Malformed(_))
    ));
}

#[test]
fn deep_nesting_in_an_unknown_field_is_an_error_not_a_crash() {
    let event = example_event("stage.released");
    let mut bytes = wire::encode(&event).unwrap();
    bytes[0] += 1;
    bytes.extend_from_slice(&rmp_serde::to_vec(&"extra").unwrap());
    bytes.extend(std::iter::repeat_n(0x91u8, 100_000));
    bytes.push(0xc0);
    assert!(matches!(
        wire::decode(&bytes),
        Err(DecodeError::Malformed(_))
    ));
}

#[test]
fn subjects_follow_the_map_and_land_in_exactly_one_stream() {
    for event in all_examples() {
        let subject = subject_for(&event.body, &event.project);
        let expected = match &event.body {
            Body::DeadLetter(letter) => dead_letter_subject(&letter.service),
            Body::DeadLetterReplayed(replay) => replayed_subject(&replay.service),
            body if body.is_request() => {
                format!("stagehand.req.{}.{}", event.kind(), event.project)
            }
            // A checkpoint part's facts name the node (the examples': gpu-07) first.
            _ if subject::routed_by_node(event.kind()) => {
                format!("stagehand.fact.{}.gpu-07.{}", event.kind(), event.project)
            }
            _ => format!("stagehand.fact.{}.{}", event.kind(), event.project),
        };
        assert_eq!(subject, expected);
        let streams: Vec<&str> = STREAMS
            .iter()
            .filter(|s| s.subjects.iter().any(|f| subject_matches(f, &subject)))
            .map(|s| s.name)
            .collect();
        assert_eq!(streams.len(), 1, "{subject} is in {streams:?}");
        let stream = STREAMS.iter().find(|s| s.name == streams[0]).unwrap();
        assert_eq!(
            stream.max_msg_size as usize,
            wire::max_bytes_for(event.kind()),
            "{subject}: the stream and the decoder must agree on the size bound"
        );
    }
}

#[test]
fn id_helpers_follow_the_written_rules() {
    // A stage hook that runs twice publishes the same request (and the same release).
    let stage = EventId::for_stage(
        "vision-lab",
        "4815162",
        "street",
        "9b1113d91ed7",
        "local",
        Some("gpu07"),
    );
    assert_eq!(
        stage,
        EventId::for_content(&[
            b"stage",
            b"vision-lab",
            b"4815162",
            b"street",
            b"9b1113d91ed7",
            b"local",
            b"gpu07",
        ])
    );
    assert_ne!(
        stage,
        EventId::for_stage(
            "vision-lab",
            "4815162",
            "street",
            "9b1113d91ed7",
            "local",
            Some("gpu08")
        )
    );
    assert_eq!(
        EventId::for_stage_release(
            "vision-lab",
            "4815162",
            "street",
            "9b1113d91ed7",
            "local",
            Some("gpu07")
        ),
        EventId::derive(&stage, "release")
    );
    // Pinned values (computed independently with Python's hashlib from the rule in id.rs):
    // changing them breaks deduplication across an upgrade.
    let cause = EventId::new("req-1").unwrap();
    assert_eq!(
        EventId::derive(&cause, "validated").as_str(),
        "4ce4af8486a3d2cd4ba27cfc7f2918a8"
    );
    assert_eq!(
        EventId::for_fact("lab-a", &cause, "validated").as_str(),
        "6374f5bfa61b283ce7c27d95cc10e871"
    );
    // Committing a step of a run again is the same fact; another project's is another.
    assert_eq!(
        EventId::for_checkpoint("vision-lab", "llama-ft-7b-r3", 12000).as_str(),
        "f8192333650f9db57d3d60a6b5761e16"
    );
    assert_ne!(
        EventId::for_checkpoint("vision-lab", "r1", 5),
        EventId::for_checkpoint("lab-b", "r1", 5)
    );
    // The same request id in two projects gives two projects' facts different ids.
    assert_ne!(
        EventId::for_fact("lab-a", &cause, "validated"),
        EventId::for_fact("lab-b", &cause, "validated")
    );
    assert_eq!(
        EventId::for_dead_letter("STAGEHAND_REQUESTS", "ingest-validator", 1042),
        EventId::for_content(&[
            b"dead-letter",
            b"STAGEHAND_REQUESTS",
            b"ingest-validator",
            &1042u64.to_be_bytes(),
        ])
    );
    assert_eq!(
        EventId::for_ingest("lab-a", "cats", "abc"),
        EventId::for_content(&[b"lab-a", b"cats", b"abc"])
    );
    assert_eq!(
        EventId::for_ingest(
            "lab-a",
            "cats",
            "62a5d72b12e05973548dc641bb57e6b0b9f73a5aea0c39e7163c4fc0d5af4684"
        )
        .as_str(),
        "2334775aaf50be0e3ac2250046d43240"
    );
}

#[derive(Serialize)]
struct NotAnEvent {
    id: &'static str,
}

#[test]
fn a_map_that_is_not_an_event_says_what_is_missing() {
    let bytes = rmp_serde::to_vec_named(&NotAnEvent { id: "x" }).unwrap();
    let err = wire::decode(&bytes).unwrap_err();
    assert!(err.to_string().contains("missing field"), "{err}");
}

/// The longest path the path rules allow: 4096 bytes in components of 255.
fn longest_path(i: usize) -> String {
    let mut path = format!("{i:012}");
    while path.len() + 256 <= stagehand_schemas::path::MAX_PATH_BYTES {
        path.push('/');
        path.push_str(&"p".repeat(255));
    }
    stagehand_schemas::check_relative_path(&path).unwrap();
    path
}

/// What nats-server accepts by default (`max_payload`), headers included.
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

#[test]
fn the_largest_instance_of_every_kind_fits_a_stock_nats_server() {
    use stagehand_schemas::problem::{ProblemTally, code};
    use stagehand_schemas::{MAX_ATTEMPT_ERROR_BYTES, MAX_RECORDED_ATTEMPTS, Problem};

    let mut largest: Vec<(String, usize)> = Vec::new();
    let mut check = |label: &str, event: &Event| {
        let bytes = wire::encode(event).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert!(
            bytes.len() + 8 * 1024 <= DEFAULT_MAX_PAYLOAD,
            "{label}: {} bytes",
            bytes.len()
        );
        largest.push((label.to_owned(), bytes.len()));
    };
    // Every example as it is.
    for event in all_examples() {
        check(event.kind(), &event);
    }
    // An inline manifest at the inline bound, of the shortest entries (the most per byte).
    let mut ingest = example_event("ingest.requested");
    if let Body::IngestRequested(request) = &mut ingest.body {
        request.manifest = None;
        let sha = sha256_hex(b"x");
        let mut files = Vec::new();
        let mut len = 0;
        for i in 0.. {
            let file = FileRef::new(format!("{i}"), 0, sha.clone());
            len += file.manifest_line().len() as u64;
            if len > stagehand_schemas::INLINE_MANIFEST_MAX_BYTES {
                break;
            }
            files.push(file);
        }
        request.files = files;
    }
    check("ingest.requested at the inline bound", &ingest);
    // A rejection of a million files, each problem with the longest path and a long detail.
    let mut tally = ProblemTally::new();
    let paths: Vec<String> = (0..50).map(longest_path).collect();
    let detail = format!(
        "sha256 is {} but the manifest says {}",
        "a".repeat(64),
        "b".repeat(64)
    );
    for i in 0..1_000_000 {
        tally.add(Problem::new(
            code::CHECKSUM_MISMATCH,
            Some(&paths[i % 50]),
            detail.clone(),
        ));
    }
    let (problems, problem_counts, total) = tally.finish();
    let mut rejected = example_event("dataset.rejected");
    if let Body::DatasetRejected(r) = &mut rejected.body {
        r.source.prefix = longest_path(0);
        r.quarantine = Some(longest_path(1));
        r.problems = problems.clone();
        r.problem_counts = stagehand_schemas::problem::code::ALL
            .iter()
            .map(|c| ((*c).to_owned(), u64::MAX))
            .collect();
        r.problems_total = Some(total);
    }
    assert_eq!(problem_counts.len(), 1);
    check("dataset.rejected with 1,000,000 problems", &rejected);
    let mut failed = example_event("restore.failed");
    if let Body::RestoreFailed(r) = &mut failed.body {
        r.problems = problems;
        r.problems_total = Some(total);
    }
    check("restore.failed with 1,000,000 problems", &failed);
    // A dead letter carrying the largest event, with the longest history kept.
    let mut dead = example_event("dead.letter");
    if let Body::DeadLetter(letter) = &mut dead.body {
        letter.original = vec![0xc1; MAX_EVENT_BYTES];
        letter.headers = vec![("traceparent".into(), "0".repeat(55)); 16];
        letter.errors = (0..MAX_RECORDED_ATTEMPTS as u64)
            .map(|delivery| stagehand_schemas::Attempt {
                delivery,
                at: stagehand_schemas::now(),
                error: "e".repeat(MAX_ATTEMPT_ERROR_BYTES),
                permanent: false,
            })
            .collect();
    }
    check("dead.letter of the largest event and history", &dead);
    assert!(largest.len() > ALL_KINDS.len());
}

/// `node` on `replica.created`/`replica.removed` (added within schema 2) travels when a node
/// agent names its node, is left out (not `nil`) for a shared tier, and older writers' facts
/// without it decode as shared replicas; the JSON Schema accepts both forms.
#[test]
fn replica_facts_carry_their_node_only_for_a_node_local_copy() {
    for kind in ["replica.created", "replica.removed"] {
        let shared = example_event(kind);
        let mut local = shared.clone();
        match &mut local.body {
            Body::ReplicaCreated(p) => {
                assert_eq!(p.node, None, "examples/{kind}.json");
                p.node = Some("gpu-07".into());
            }
            Body::ReplicaRemoved(p) => {
                assert_eq!(p.node, None, "examples/{kind}.json");
                p.node = Some("gpu-07".into());
            }
            other => panic!("{kind}: {other:?}"),
        }
        assert_eq!(
            wire::decode(&wire::encode(&local).unwrap()).unwrap(),
            local,
            "{kind}"
        );
        let local_json = serde_json::to_value(&local).unwrap();
        assert_eq!(local_json["payload"]["node"], json!("gpu-07"), "{kind}");
        assert!(schema_errors(kind, &local_json).is_empty(), "{kind}");
        // A shared replica's fact has no `node` key at all, in JSON and on the wire.
        let shared_json = serde_json::to_value(&shared).unwrap();
        assert!(
            shared_json["payload"].get("node").is_none(),
            "{kind}: {shared_json}"
        );
        let shared_wire: Value = rmp_serde::from_slice(&wire::encode(&shared).unwrap()).unwrap();
        assert!(
            shared_wire["payload"].get("node").is_none(),
            "{kind}: {shared_wire}"
        );
        assert_eq!(
            wire::decode(&wire::encode(&shared).unwrap()).unwrap(),
            shared,
            "{kind}"
        );
    }
}
