//! Event ids, and how a fact's id follows from its cause.
//!
//! Rules (also in `schemas/README.md`):
//!
//! 1. A **request** id is chosen by its producer: any 1–128 characters from `[A-Za-z0-9._:-]`.
//!    A producer that retries publishes the same id. `stagehand ingest` uses
//!    [`EventId::for_ingest`], i.e. [`EventId::for_content`] over (project, dataset, version
//!    digest), so re-running the same upload is the same request.
//! 2. A **fact** id is [`EventId::for_fact`]`(project, cause, step)`, which is
//!    [`EventId::for_content`]`(["fact", project, cause, step])` (defined below). `step` names
//!    what the service did (`"validated"`, `"rejected"`, `"replica:hot"`). A redelivered cause
//!    therefore yields the very same fact ids, and JetStream's duplicate window (the
//!    `Nats-Msg-Id` header is the event id scoped by its subject, `<subject>:<id>`) drops the
//!    copies. The project is part of it so that two projects' requests that happen to share an
//!    id cause facts of different ids. Ids follow from public names, so no id is secret: a
//!    publisher proves a duplicate acknowledgement against what is stored (`schemas/README.md`,
//!    *A duplicate is proven, not believed*).
//!    (Schema-1 writers used [`EventId::derive`]`(cause, step)`; facts they recorded keep
//!    those ids.)
//! 3. A **dead letter**'s id is [`EventId::for_dead_letter`]: [`EventId::for_content`] over
//!    (`"dead-letter"`, stream, consumer, stream sequence as 8 big-endian bytes) of the message
//!    it carries, so dead-lettering the same delivery twice stores it once.
//!
//! [`EventId::for_content`]`(parts)` is the first 16 bytes, as 32 lowercase hex characters, of
//! `SHA-256("stagehand/v1" ++ for each part: 0x00 ++ u64_be(len(part)) ++ part)`.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The longest id accepted.
pub const MAX_ID_LEN: usize = 128;

/// An event id. Scoped by its subject, also the `Nats-Msg-Id` of the message that carries it.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EventId(String);

/// Why a string is not an acceptable event id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("event id {0:?} must be 1-128 characters of [A-Za-z0-9._:-]")]
pub struct BadEventId(pub String);

impl EventId {
    /// Accepts a producer-chosen id after checking its form.
    pub fn new(id: impl Into<String>) -> Result<Self, BadEventId> {
        let id = id.into();
        if is_valid_id(&id) {
            Ok(Self(id))
        } else {
            Err(BadEventId(id))
        }
    }

    /// The id of the fact that `step` of handling `cause`, an event of `project`, produces.
    pub fn for_fact(project: &str, cause: &EventId, step: &str) -> Self {
        Self::hashed(&[
            b"fact",
            project.as_bytes(),
            cause.0.as_bytes(),
            step.as_bytes(),
        ])
    }

    /// An id derived from another id and a step, within one project's namespace: how a stage
    /// release's id follows from its request's ([`EventId::for_stage_release`]), and how
    /// schema-1 writers derived fact ids.
    pub fn derive(cause: &EventId, step: &str) -> Self {
        Self::hashed(&[cause.0.as_bytes(), step.as_bytes()])
    }

    /// An id derived from content: the same parts give the same id.
    pub fn for_content(parts: &[&[u8]]) -> Self {
        Self::hashed(parts)
    }

    /// The id `stagehand ingest` gives an ingest request: the same upload of the same bytes to
    /// the same dataset is the same request, however often it is published.
    pub fn for_ingest(project: &str, dataset: &str, version: &str) -> Self {
        Self::for_content(&[project.as_bytes(), dataset.as_bytes(), version.as_bytes()])
    }

    /// The id of a scheduler's stage request: the same job asking for the same data on the same
    /// tier (and node) is the same request, however often its hook runs (slurmctld re-runs
    /// hooks after a restart).
    pub fn for_stage(
        project: &str,
        job_id: &str,
        dataset: &str,
        version: &str,
        tier: &str,
        node: Option<&str>,
    ) -> Self {
        Self::for_content(&[
            b"stage",
            project.as_bytes(),
            job_id.as_bytes(),
            dataset.as_bytes(),
            version.as_bytes(),
            tier.as_bytes(),
            node.unwrap_or("").as_bytes(),
        ])
    }

    /// The id of the release of the stage request [`EventId::for_stage`] gives for the same
    /// arguments.
    pub fn for_stage_release(
        project: &str,
        job_id: &str,
        dataset: &str,
        version: &str,
        tier: &str,
        node: Option<&str>,
    ) -> Self {
        Self::derive(
            &Self::for_stage(project, job_id, dataset, version, tier, node),
            "release",
        )
    }

    /// The id of a `checkpoint.committed` fact: committing the same step of the same run of a
    /// project again (a retried hook, a re-run launcher) is the same fact, which the duplicate
    /// window drops and the catalogue folds once.
    pub fn for_checkpoint(project: &str, run: &str, step: u64) -> Self {
        Self::for_content(&[
            b"checkpoint",
            project.as_bytes(),
            run.as_bytes(),
            &step.to_be_bytes(),
        ])
    }

    /// The id of a `checkpoint.part.committed` fact: the same part of the same step committed
    /// again is the same fact.
    pub fn for_checkpoint_part(project: &str, run: &str, step: u64, part: u32) -> Self {
        Self::for_content(&[
            b"checkpoint-part",
            project.as_bytes(),
            run.as_bytes(),
            &step.to_be_bytes(),
            &part.to_be_bytes(),
        ])
    }

    /// The id of the dead letter for the message at `stream_sequence` of `stream` as delivered
    /// to `consumer`: dead-lettering the same delivery twice yields the same id.
    pub fn for_dead_letter(stream: &str, consumer: &str, stream_sequence: u64) -> Self {
        Self::for_content(&[
            b"dead-letter",
            stream.as_bytes(),
            consumer.as_bytes(),
            &stream_sequence.to_be_bytes(),
        ])
    }

    /// A fresh random id, for requests that are not content-addressed.
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().simple().to_string())
    }

    fn hashed(parts: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"stagehand/v1");
        for part in parts {
            hasher.update([0u8]);
            // Length-prefix each part so ("ab","c") and ("a","bc") differ.
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hex::encode(&hasher.finalize()[..16]))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

pub(crate) fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

#[cfg(feature = "json-schema")]
impl schemars::JsonSchema for EventId {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "EventId".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": crate::json_schema::ID_PATTERN,
            "description": "An event id: 1-128 characters of [A-Za-z0-9._:-]. Also the Nats-Msg-Id of the message."
        })
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_part_ids_are_pinned() {
        assert_eq!(
            EventId::for_checkpoint_part("vision-lab", "llama-ft-7b-r3", 12000, 1).as_str(),
            "dee7d1b8ef0b56bf18d0515f6ead789a"
        );
    }

    #[test]
    fn derive_is_deterministic_and_step_sensitive() {
        let cause = EventId::new("req-1").unwrap();
        assert_eq!(
            EventId::derive(&cause, "validated"),
            EventId::derive(&cause, "validated")
        );
        assert_ne!(
            EventId::derive(&cause, "validated"),
            EventId::derive(&cause, "rejected")
        );
        assert_eq!(EventId::derive(&cause, "validated").as_str().len(), 32);
        // Pinned: changing the derivation would break dedup across upgrades.
        assert_eq!(
            EventId::derive(&cause, "validated").as_str(),
            EventId::for_content(&[b"req-1", b"validated"]).as_str()
        );
    }

    #[test]
    fn parts_are_length_prefixed() {
        assert_ne!(
            EventId::for_content(&[b"ab", b"c"]),
            EventId::for_content(&[b"a", b"bc"])
        );
    }

    #[test]
    fn producer_ids_are_checked() {
        assert!(EventId::new("lab-a:2026-11-29.upload_7").is_ok());
        for bad in ["", "has space", "sub.>", "a*", &"x".repeat(129)] {
            assert!(EventId::new(bad).is_err(), "{bad:?}");
        }
    }
}
