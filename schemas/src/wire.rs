//! Encoding and decoding events as MessagePack maps with field names.

use serde::Deserialize;

use crate::event::{ALL_KINDS, Body, Event, SCHEMA_VERSION};
use crate::id::EventId;
use crate::id::is_valid_id;
use crate::retryable::Retryable;
use crate::subject::is_subject_token;

/// The largest event a writer encodes (and the request and fact streams' `max_msg_size`).
/// Manifests travel by reference, so no event needs more; the bound leaves room for a dead
/// letter to carry any event under nats-server's default `max_payload` (1 MiB).
pub const MAX_EVENT_BYTES: usize = 512 * 1024;

/// The largest encoded `dead.letter` a writer encodes: a message of up to [`MAX_EVENT_BYTES`]
/// plus its headers and (bounded) error history, and 8 KiB under the default `max_payload`
/// for the message headers.
pub const MAX_DEAD_LETTER_BYTES: usize = 1024 * 1024 - 8 * 1024;

/// The largest message a reader decodes. Schema-1 writers wrote events of up to 8 MiB (and
/// dead letters of up to 9 MiB) when manifests travelled inline; they stay readable in the
/// streams that hold them.
pub const MAX_DECODE_BYTES: usize = 9 * 1024 * 1024;

/// The size bound a writer keeps for an encoded event of `kind`: the bound of the stream it is
/// stored in (dead letters and their replay records share the dead-letter stream's).
pub fn max_bytes_for(kind: &str) -> usize {
    if kind == DEAD_LETTER || kind == DEAD_LETTER_REPLAYED {
        MAX_DEAD_LETTER_BYTES
    } else {
        MAX_EVENT_BYTES
    }
}

const DEAD_LETTER: &str = "dead.letter";
const DEAD_LETTER_REPLAYED: &str = "dead.letter.replayed";

/// Why bytes are not an event we can handle. Every variant is permanent: redelivering the same
/// bytes cannot help, so the runtime dead-letters them at once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("message is {len} bytes, over the limit of {MAX_DECODE_BYTES}")]
    TooLarge { len: usize },
    #[error("not a Stagehand event (MessagePack map): {0}")]
    Malformed(#[from] rmp_serde::decode::Error),
    #[error(
        "event was written with schema version {found}; this reader knows up to {SCHEMA_VERSION}"
    )]
    NewerSchema { found: u32 },
    #[error("event field `{field}` is invalid: {reason}")]
    InvalidField { field: &'static str, reason: String },
    /// The envelope names a kind this reader does not know (at a schema version it does know).
    #[error("unknown event kind {kind:?} at schema version {schema}; known kinds: {known}", known = ALL_KINDS.join(", "))]
    UnknownKind { kind: String, schema: u32 },
}

impl Retryable for DecodeError {
    /// Always false: the same bytes fail the same way on every delivery.
    fn is_retryable(&self) -> bool {
        false
    }
}

/// Why an event could not be encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    #[error("could not encode event: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    #[error(
        "encoded event is {len} bytes, over the limit of {MAX_EVENT_BYTES} ({MAX_DEAD_LETTER_BYTES} for a dead letter)"
    )]
    TooLarge { len: usize },
}

impl Retryable for EncodeError {
    /// Always false: encoding the same event fails the same way again.
    fn is_retryable(&self) -> bool {
        false
    }
}

/// Encodes an event as a MessagePack map with field names.
pub fn encode(event: &Event) -> Result<Vec<u8>, EncodeError> {
    let bytes = rmp_serde::to_vec_named(event)?;
    if bytes.len() > max_bytes_for(event.kind()) {
        return Err(EncodeError::TooLarge { len: bytes.len() });
    }
    Ok(bytes)
}

/// The two envelope fields read before anything else, so that a newer producer's event gets
/// `NewerSchema` (not a shape error) and an unknown kind is named as such.
#[derive(Deserialize)]
struct Preamble {
    #[serde(default)]
    schema: Option<u32>,
    #[serde(default)]
    kind: Option<String>,
}

/// Decodes and checks an event: size bound, shape, schema version, kind, id and project form.
///
/// Payload contents (paths, hashes, sizes) are *not* judged here: a malformed manifest is the
/// ingest validator's to reject with every reason, not the decoder's to dead-letter.
///
/// Never panics, whatever the input (a property test and a fuzz target hold it to that).
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    if bytes.len() > MAX_DECODE_BYTES {
        return Err(DecodeError::TooLarge { len: bytes.len() });
    }
    // Only a map is an event: struct-as-array would be read by position and a field added
    // later would shift every other one.
    match bytes.first() {
        Some(0x80..=0x8f | 0xde | 0xdf) => {}
        Some(marker) => {
            return Err(malformed(format!(
                "expected a map at the top level, found MessagePack marker 0x{marker:02x}"
            )));
        }
        None => return Err(malformed("empty message".to_owned())),
    }
    let preamble: Preamble = from_slice_bounded(bytes)?;
    let schema = preamble.schema.unwrap_or(0);
    if schema > SCHEMA_VERSION {
        return Err(DecodeError::NewerSchema { found: schema });
    }
    if preamble.schema == Some(0) {
        return Err(DecodeError::InvalidField {
            field: "schema",
            reason: "0 is not a schema version; the first is 1".to_owned(),
        });
    }
    if let Some(kind) = &preamble.kind
        && !ALL_KINDS.contains(&kind.as_str())
    {
        return Err(DecodeError::UnknownKind {
            kind: kind.clone(),
            schema,
        });
    }
    let event: Event = match from_slice_bounded(bytes) {
        Ok(event) => event,
        // Name the kind, so that "invalid type" says which payload it was about.
        Err(e) => {
            return Err(match preamble.kind {
                Some(kind) => malformed(format!("`{kind}` event: {e}")),
                None => DecodeError::Malformed(e),
            });
        }
    };
    check(&event)?;
    Ok(event)
}

/// The deepest nesting of maps and arrays accepted. An event needs 5 levels (envelope,
/// payload, list, entry, tuple); rmp-serde's default of 1024 overflows a 2 MiB thread stack in
/// a debug build well before it is reached, so a hostile message could abort the process.
pub const MAX_NESTING: usize = 32;

fn from_slice_bounded<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
) -> Result<T, rmp_serde::decode::Error> {
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(bytes);
    deserializer.set_max_depth(MAX_NESTING);
    T::deserialize(&mut deserializer)
}

fn malformed(reason: String) -> DecodeError {
    DecodeError::Malformed(rmp_serde::decode::Error::Syntax(reason))
}

/// The checks [`decode`] applies to a decoded event: project and every id.
pub fn check(event: &Event) -> Result<(), DecodeError> {
    if !is_subject_token(&event.project) {
        return Err(DecodeError::InvalidField {
            field: "project",
            reason: format!("{:?} must be 1-64 characters of [a-z0-9_-]", event.project),
        });
    }
    let payload_ids: [(&'static str, Option<&EventId>); 2] = match &event.body {
        Body::DatasetValidated(p) => [("payload.request_id", Some(&p.request_id)), ("", None)],
        Body::DatasetRejected(p) => [("payload.request_id", Some(&p.request_id)), ("", None)],
        Body::StagePending(p) => [("payload.request_id", Some(&p.request_id)), ("", None)],
        Body::StageReady(p) => [("payload.request_id", Some(&p.request_id)), ("", None)],
        Body::StageFailed(p) => [("payload.request_id", Some(&p.request_id)), ("", None)],
        Body::DeadLetter(p) => [("payload.original_id", p.original_id.as_ref()), ("", None)],
        Body::DeadLetterReplayed(p) => [
            ("payload.dead_letter_id", Some(&p.dead_letter_id)),
            ("payload.original_id", p.original_id.as_ref()),
        ],
        Body::OperatorAction(p) => [
            ("payload.dead_letter_id", p.dead_letter_id.as_ref()),
            ("payload.request_id", p.request_id.as_ref()),
        ],
        _ => [("", None), ("", None)],
    };
    for (field, id) in [
        ("id", Some(&event.id)),
        ("correlation_id", Some(&event.correlation_id)),
        ("causation_id", event.causation_id.as_ref()),
    ]
    .into_iter()
    .chain(payload_ids)
    {
        if let Some(id) = id
            && !is_valid_id(id.as_str())
        {
            return Err(DecodeError::InvalidField {
                field,
                reason: format!(
                    "{:?} must be 1-128 characters of [A-Za-z0-9._:-]",
                    id.as_str()
                ),
            });
        }
    }
    Ok(())
}
