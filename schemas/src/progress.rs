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
use crate::subject::{ROOT, node_token};

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
/// `stagehand.progress.<kind>.<project>.<request id>`, or, for a request naming a node (a stage
/// onto that node's own tier, which its agent copies), `stagehand.progress.<kind>.<node>.<project>.<request id>`,
/// the node written as its subject token ([`node_token`]). So permissions can let a project's
/// users watch their own requests only, and a node's user report on its own node's work only.
pub fn progress_subject(
    kind: &str,
    node: Option<&str>,
    project: &str,
    request_id: &EventId,
) -> String {
    // Request ids may hold '.', which separates subject tokens; hex keeps the id one token.
    let id = hex::encode(request_id.as_str());
    match node {
        Some(node) => format!("{ROOT}.progress.{kind}.{}.{project}.{id}", node_token(node)),
        None => format!("{ROOT}.progress.{kind}.{project}.{id}"),
    }
}

/// What a progress subject of `kind` names: the node's token (for a request naming a node)
/// and the project, or `None` for any other subject. What it says of which request is for the
/// caller to hold against the report's body ([`progress_subject`] of both).
pub fn progress_place(kind: &str, subject: &str) -> Option<(Option<String>, String)> {
    let rest = subject.strip_prefix(&format!("{ROOT}.progress.{kind}."))?;
    let tokens: Vec<&str> = rest.split('.').collect();
    match tokens[..] {
        [project, _id] => Some((None, project.to_owned())),
        [node, project, _id] => Some((Some(node.to_owned()), project.to_owned())),
        _ => None,
    }
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
        let subject = progress_subject("stage.requested", None, "vision-lab", &id);
        assert!(subject.starts_with("stagehand.progress.stage.requested.vision-lab."));
        assert_eq!(subject.split('.').count(), 6);
        let filter = progress_filter("stage.requested");
        assert_eq!(filter, "stagehand.progress.stage.requested.>");
        assert!(subject.starts_with(filter.trim_end_matches('>')));
        assert_eq!(
            progress_place("stage.requested", &subject),
            Some((None, "vision-lab".to_owned()))
        );
        // A node's stage: its node before the project, as its token.
        let on_node = progress_subject("stage.requested", Some("gpu-07"), "vision-lab", &id);
        assert!(on_node.starts_with("stagehand.progress.stage.requested.gpu-07.vision-lab."));
        assert!(on_node.starts_with(filter.trim_end_matches('>')));
        assert_eq!(
            progress_place("stage.requested", &on_node),
            Some((Some("gpu-07".to_owned()), "vision-lab".to_owned()))
        );
        let dns = progress_subject("stage.requested", Some("gpu-07.cluster"), "vision-lab", &id);
        let (token, _) = progress_place("stage.requested", &dns).unwrap();
        assert_eq!(token, Some(node_token("gpu-07.cluster")));
        // Anything else is no progress subject of that kind.
        for other in [
            "stagehand.progress.stage.requested.vision-lab",
            "stagehand.progress.stage.requested.a.b.c.d",
            "stagehand.progress.ingest.requested.vision-lab.00",
        ] {
            assert_eq!(progress_place("stage.requested", other), None, "{other}");
        }
    }
}
