//! JSON Schemas (draft 2020-12) of the envelope and of every event kind, generated from the
//! Rust types so that the published contract cannot drift from what the services decode.
//!
//! A MessagePack map mirrors a JSON object, so the same schema describes both encodings; the
//! one difference is `dead.letter`'s `original`, which is MessagePack `bin` on the wire and an
//! array of byte values in JSON. The committed files under `schemas/json/` are checked against
//! this module by `tests/json_schema.rs` (`STAGEHAND_BLESS=1` rewrites them).
//!
//! Every object schema allows additional properties: readers ignore fields they do not know,
//! which is how optional fields are added without breaking older readers.

use std::borrow::Cow;

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde_json::{Map, Value, json};

use crate::event::{self, ALL_KINDS, SCHEMA_VERSION};

/// JSON Schema dialect of every generated document.
pub const DIALECT: &str = "https://json-schema.org/draft/2020-12/schema";
/// An event id (see [`crate::id`]).
pub const ID_PATTERN: &str = "^[A-Za-z0-9._:-]{1,128}$";
/// A project: one NATS subject token (see [`crate::subject::is_subject_token`]).
pub const PROJECT_PATTERN: &str = "^[a-z0-9_-]{1,64}$";
/// A SHA-256 as 64 lowercase hex characters: file hashes and full version digests.
pub const SHA256_PATTERN: &str = "^[0-9a-f]{64}$";
/// A version digest or a unique prefix of one, as a scheduler may write it.
pub const VERSION_PREFIX_PATTERN: &str = "^[0-9a-f]{12,64}$";

/// An RFC 3339 timestamp string, the wire form of every time in an event.
pub struct Timestamp;

impl JsonSchema for Timestamp {
    fn schema_name() -> Cow<'static, str> {
        "Timestamp".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "format": "date-time",
            "description": "RFC 3339 date-time, e.g. 2026-11-29T20:00:00Z; writers use UTC."
        })
    }
}

/// The file name of a kind's schema under `schemas/json/`.
pub fn file_name(kind: &str) -> String {
    format!("{kind}.json")
}

/// The schema of the envelope alone: every kind, with `payload` any object.
pub fn envelope() -> Value {
    let mut generator = generator();
    let mut properties = envelope_properties(&mut generator);
    properties.insert(
        "kind".into(),
        json!({
            "description": "Selects the shape of `payload`; one schema per kind under schemas/json/.",
            "enum": ALL_KINDS,
        }),
    );
    properties.insert(
        "payload".into(),
        json!({
            "description": "The kind's payload (see that kind's schema).",
            "type": "object",
        }),
    );
    document(
        "urn:stagehand:schema:envelope",
        "Stagehand event envelope",
        "The fields every Stagehand event carries, whatever its kind. Encoded as a MessagePack map \
         with field names; unknown fields are ignored by readers.",
        properties,
        generator,
    )
}

/// The schema of one event kind (envelope with `kind` fixed and the kind's payload), or `None`
/// for a name that is not a kind.
pub fn for_kind(kind: &str) -> Option<Value> {
    let mut generator = generator();
    let payload = payload_ref(kind, &mut generator)?;
    let description = generator
        .definitions()
        .get(payload_type_name(kind)?)
        .and_then(|def| def.get("description"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let mut properties = envelope_properties(&mut generator);
    properties.insert("kind".into(), json!({ "const": kind }));
    properties.insert("payload".into(), payload.to_value());
    Some(document(
        &format!("urn:stagehand:schema:{kind}"),
        &format!("Stagehand event `{kind}`"),
        &description,
        properties,
        generator,
    ))
}

/// Every schema document: `(file name, schema)`, the envelope first, then each kind.
pub fn all() -> Vec<(String, Value)> {
    let mut out = vec![("envelope.json".to_owned(), envelope())];
    for kind in ALL_KINDS {
        let schema = for_kind(kind).unwrap_or_else(|| panic!("kind {kind} has no payload type"));
        out.push((file_name(kind), schema));
    }
    out
}

fn generator() -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .for_deserialize()
        .into_generator()
}

fn envelope_properties(generator: &mut SchemaGenerator) -> Map<String, Value> {
    let id = generator.subschema_for::<crate::id::EventId>().to_value();
    let timestamp = generator.subschema_for::<Timestamp>().to_value();
    let mut properties = Map::new();
    properties.insert(
        "id".into(),
        with_description(
            &id,
            "Deterministic event id; also sent as the Nats-Msg-Id header.",
        ),
    );
    properties.insert(
        "schema".into(),
        json!({
            "description": format!(
                "Contract version the producer wrote; readers refuse versions above their own (this one: {SCHEMA_VERSION})."
            ),
            "type": "integer",
            "minimum": 1,
            "maximum": u32::MAX,
        }),
    );
    properties.insert(
        "occurred_at".into(),
        with_description(&timestamp, "When the fact became true (RFC 3339, UTC)."),
    );
    properties.insert(
        "project".into(),
        json!({
            "description": "The project (tenant) the data belongs to; the last subject token.",
            "type": "string",
            "pattern": PROJECT_PATTERN,
        }),
    );
    properties.insert(
        "correlation_id".into(),
        with_description(
            &id,
            "Id of the request that started this chain (a request's own id for a request).",
        ),
    );
    properties.insert(
        "causation_id".into(),
        json!({
            "description": "Id of the event that directly caused this one; null or absent for a request.",
            "anyOf": [id, { "type": "null" }],
        }),
    );
    properties
}

fn with_description(schema: &Value, description: &str) -> Value {
    // A `$ref` with sibling keywords is valid in 2020-12; the description documents the use.
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.insert("description".into(), description.into());
    }
    schema
}

fn document(
    id: &str,
    title: &str,
    description: &str,
    properties: Map<String, Value>,
    mut generator: SchemaGenerator,
) -> Value {
    let mut doc = Map::new();
    doc.insert("$schema".into(), DIALECT.into());
    doc.insert("$id".into(), id.into());
    doc.insert("title".into(), title.into());
    doc.insert("description".into(), description.into());
    doc.insert("type".into(), "object".into());
    doc.insert(
        "required".into(),
        json!([
            "id",
            "kind",
            "schema",
            "occurred_at",
            "project",
            "correlation_id",
            "payload"
        ]),
    );
    doc.insert("properties".into(), Value::Object(properties));
    doc.insert("additionalProperties".into(), true.into());
    doc.insert(
        "$defs".into(),
        Value::Object(generator.take_definitions(true).into_iter().collect()),
    );
    Value::Object(doc)
}

macro_rules! kinds {
    ($($kind:literal => $ty:ident),* $(,)?) => {
        fn payload_ref(kind: &str, generator: &mut SchemaGenerator) -> Option<Schema> {
            match kind {
                $($kind => Some(generator.subschema_for::<event::$ty>()),)*
                _ => None,
            }
        }

        fn payload_type_name(kind: &str) -> Option<&'static str> {
            match kind {
                $($kind => Some(stringify!($ty)),)*
                _ => None,
            }
        }
    };
}

kinds! {
    "ingest.requested" => IngestRequested,
    "dataset.validated" => DatasetValidated,
    "dataset.rejected" => DatasetRejected,
    "dataset.prepared" => DatasetPrepared,
    "stage.requested" => StageRequested,
    "stage.released" => StageReleased,
    "stage.pending" => StagePending,
    "stage.ready" => StageReady,
    "stage.failed" => StageFailed,
    "replica.created" => ReplicaCreated,
    "replica.removed" => ReplicaRemoved,
    "replica.damaged" => ReplicaDamaged,
    "replica.verified" => ReplicaVerified,
    "replica.repaired" => ReplicaRepaired,
    "replica.unreachable" => ReplicaUnreachable,
    "checkpoint.committed" => CheckpointCommitted,
    "checkpoint.demoted" => CheckpointDemoted,
    "checkpoint.expired" => CheckpointExpired,
    "checkpoint.held" => CheckpointHeld,
    "checkpoint.part.committed" => CheckpointPartCommitted,
    "checkpoint.part.offloaded" => CheckpointPartOffloaded,
    "checkpoint.part.removed" => CheckpointPartRemoved,
    "backup.completed" => BackupCompleted,
    "restore.verified" => RestoreVerified,
    "restore.failed" => RestoreFailed,
    "dead.letter" => DeadLetter,
    "dead.letter.replayed" => DeadLetterReplayed,
    "operator.action" => OperatorAction,
}
