//! Encoding and decoding events as MessagePack maps with field names.

use crate::event::{Event, SCHEMA_VERSION};
use crate::id::is_valid_id;
use crate::subject::is_subject_token;

/// The largest encoded event accepted (and the stream's `max_msg_size`). A manifest larger than
/// this must be split into several datasets or referenced by an object.
pub const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// Why bytes are not an event we can handle. Every variant is permanent: redelivering the same
/// bytes cannot help, so the runtime dead-letters them at once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("message is {len} bytes, over the limit of {MAX_EVENT_BYTES}")]
    TooLarge { len: usize },
    #[error("not a Stagehand event (MessagePack map): {0}")]
    Malformed(#[from] rmp_serde::decode::Error),
    #[error("event was written with schema version {found}; this reader knows up to {SCHEMA_VERSION}")]
    NewerSchema { found: u32 },
    #[error("event field `{field}` is invalid: {reason}")]
    InvalidField { field: &'static str, reason: String },
}

/// Why an event could not be encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    #[error("could not encode event: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    #[error("encoded event is {len} bytes, over the limit of {MAX_EVENT_BYTES}")]
    TooLarge { len: usize },
}

/// Encodes an event as a MessagePack map with field names.
pub fn encode(event: &Event) -> Result<Vec<u8>, EncodeError> {
    let bytes = rmp_serde::to_vec_named(event)?;
    if bytes.len() > MAX_EVENT_BYTES {
        return Err(EncodeError::TooLarge { len: bytes.len() });
    }
    Ok(bytes)
}

/// Decodes and checks an event: size bound, shape, schema version, id and project form.
///
/// Never panics, whatever the input (a property test and a fuzz target hold it to that).
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    if bytes.len() > MAX_EVENT_BYTES {
        return Err(DecodeError::TooLarge { len: bytes.len() });
    }
    let event: Event = rmp_serde::from_slice(bytes)?;
    if event.schema > SCHEMA_VERSION {
        return Err(DecodeError::NewerSchema {
            found: event.schema,
        });
    }
    if !is_subject_token(&event.project) {
        return Err(DecodeError::InvalidField {
            field: "project",
            reason: format!(
                "{:?} must be 1-64 characters of [a-z0-9_-]",
                event.project
            ),
        });
    }
    for (field, id) in [
        ("id", Some(&event.id)),
        ("correlation_id", Some(&event.correlation_id)),
        ("causation_id", event.causation_id.as_ref()),
    ] {
        if let Some(id) = id
            && !is_valid_id(id.as_str())
        {
            return Err(DecodeError::InvalidField {
                field,
                reason: format!("{:?} must be 1-128 characters of [A-Za-z0-9._:-]", id.as_str()),
            });
        }
    }
    Ok(event)
}
