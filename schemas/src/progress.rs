//! Progress of long work, for people and schedulers watching: not events.
//!
//! A service working on a request for a long time (the ingest validator hashing a million
//! files, the promoter copying a version) publishes a [`WorkProgress`] every few seconds on
//! core NATS (no JetStream: a lost or late progress message costs nothing, and the facts log
//! does not fill with them) at [`progress_subject`]. `stagehand ingest --wait` and
//! `stagehand stage wait` subscribe to their request's subject; the catalogue recorder mirrors
//! stage progress into the readiness bucket. Encoded like events: a MessagePack map with field
//! names.

use serde::{Deserialize, Serialize};

use crate::id::EventId;
use crate::subject::ROOT;

/// How far a piece of work has got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct WorkProgress {
    /// The request being worked on.
    pub request_id: EventId,
    /// The service doing the work.
    pub service: String,
    /// What it is doing, for a person (`hashing`, `copying`, `verifying`).
    pub phase: String,
    pub files_done: u64,
    pub files_total: u64,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Seconds the service expects the rest to take, when it can tell.
    #[serde(default)]
    pub eta_seconds: Option<u64>,
}

impl WorkProgress {
    /// MessagePack map with field names, as events are encoded.
    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings and integers always encodes.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<WorkProgress, rmp_serde::decode::Error> {
        rmp_serde::from_slice(bytes)
    }
}

/// The subject progress of the request `request_id` (of `kind`, in `project`) is published on:
/// `stagehand.progress.<kind>.<project>.<request id>`, so that permissions can let a project's
/// users watch their own requests only.
pub fn progress_subject(kind: &str, project: &str, request_id: &EventId) -> String {
    // Request ids may hold '.', which separates subject tokens; hex keeps the id one token.
    format!(
        "{ROOT}.progress.{kind}.{project}.{}",
        hex::encode(request_id.as_str())
    )
}

/// The filter of every progress report of one request kind, across projects and requests:
/// `stagehand.progress.<kind>.>` (what the catalogue recorder follows for `stage.requested`).
pub fn progress_filter(kind: &str) -> String {
    format!("{ROOT}.progress.{kind}.>")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_round_trips_and_its_subject_is_one_token_per_part() {
        let id = EventId::new("slurm-4815162.stage").unwrap();
        let p = WorkProgress {
            request_id: id.clone(),
            service: "promoter".into(),
            phase: "copying".into(),
            files_done: 3,
            files_total: 10,
            bytes_done: 300,
            bytes_total: 1000,
            eta_seconds: Some(7),
        };
        assert_eq!(WorkProgress::decode(&p.encode()).unwrap(), p);
        let subject = progress_subject("stage.requested", "vision-lab", &id);
        assert!(subject.starts_with("stagehand.progress.stage.requested.vision-lab."));
        assert_eq!(subject.split('.').count(), 6);
        let filter = progress_filter("stage.requested");
        assert_eq!(filter, "stagehand.progress.stage.requested.>");
        assert!(subject.starts_with(filter.trim_end_matches('>')));
    }
}
