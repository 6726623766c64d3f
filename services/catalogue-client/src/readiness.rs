//! Readiness: whether a dataset version is usable on a tier (and, for node-local tiers, on a
//! node), the one record every scheduler waits on.
//!
//! The catalogue recorder keeps it from the facts and mirrors it into the JetStream KV bucket
//! [`BUCKET`] under [`kv_key`]: `<project>.<dataset>.<version>.<tier>` (and a fifth token
//! `.<node>` for a node-local tier). A plugin reads one key by a direct get and starts its job
//! on `ready`; to wait, it reads again when its project's `stage.ready` or `stage.failed` fact
//! names the version, and every few seconds besides. It never watches the bucket: a watch is a
//! consumer, which no scheduler may create (schemas/README.md, *Readiness and stage status,
//! for schedulers*).
//!
//! ```
//! use stagehand_catalogue::{Readiness, ReadinessState};
//!
//! let value = br#"{"project":"lab-a","dataset":"cats","version":"3f2a","tier":"hot",
//!     "state":"ready","path":"lab-a/cats/3f2a","ready":true,"replica":"present",
//!     "jobs":{"pending":0,"ready":1,"failed":0,"released":0},"updated_at":null}"#;
//! let r: Readiness = serde_json::from_slice(value).unwrap();
//! assert!(matches!(r.state, ReadinessState::Ready { ref path } if path == "lab-a/cats/3f2a"));
//! ```

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::records::ReplicaState;
use crate::time::utc;

/// The readiness bucket.
pub const BUCKET: &str = "stagehand_readiness";

/// What a readiness record is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ReadinessKey {
    pub project: String,
    pub dataset: String,
    /// The full version digest.
    pub version: String,
    pub tier: String,
    /// The node, for a node-local tier; absent for a shared tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// How far a copy has come.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyProgress {
    pub files_done: u64,
    pub files: u64,
    pub bytes_done: u64,
    pub bytes: u64,
}

/// The state a scheduler acts on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ReadinessState {
    /// Asked for, not being copied yet; `reason` says what it waits for.
    Pending { reason: String },
    /// Being copied onto the tier.
    Copying {
        #[serde(default)]
        progress: Option<CopyProgress>,
    },
    /// Complete and verified on the tier, under `path` beneath the tier's root.
    Ready { path: String },
    /// Staging failed: the job must not start, and `reason` says why.
    Failed { reason: String, retryable: bool },
    /// No job holds it any more (and no verified copy is on the tier).
    Released,
}

/// How many jobs' stages are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCounts {
    pub pending: u64,
    pub ready: u64,
    pub failed: u64,
    pub released: u64,
}

impl JobCounts {
    /// Jobs that still hold the version on the tier (asked for it and did not release it).
    pub fn holding(&self) -> u64 {
        self.pending + self.ready
    }
}

/// Readiness of a version on a tier (or a node): the value mirrored into [`BUCKET`], and what
/// the `readiness` query answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    #[serde(flatten)]
    pub key: ReadinessKey,
    #[serde(flatten)]
    pub state: ReadinessState,
    /// Whether `state` is `ready`: what a plain watcher tests.
    pub ready: bool,
    /// The state of the tier's replica, if there is one.
    pub replica: Option<ReplicaState>,
    pub jobs: JobCounts,
    /// When the newest fact behind this record happened.
    #[serde(default, with = "utc::option")]
    pub updated_at: Option<OffsetDateTime>,
}

/// The bucket key of a readiness record. Every part is escaped to the characters a KV key
/// token allows: any byte outside `[A-Za-z0-9_-]` becomes `=XX` (hex), an empty part `=00`.
pub fn kv_key(key: &ReadinessKey) -> String {
    let mut parts = vec![
        token(&key.project),
        token(&key.dataset),
        token(&key.version),
        token(&key.tier),
    ];
    if let Some(node) = &key.node {
        parts.push(token(node));
    }
    parts.join(".")
}

fn token(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(b as char);
        } else {
            out.push_str(&format!("={b:02X}"));
        }
    }
    if out.is_empty() {
        out.push_str("=00");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(node: Option<&str>) -> ReadinessKey {
        ReadinessKey {
            project: "lab-a".into(),
            dataset: "cats v2/final".into(),
            version: "ab12".into(),
            tier: "local".into(),
            node: node.map(Into::into),
        }
    }

    #[test]
    fn keys_are_valid_kv_keys_and_grow_by_a_node() {
        assert_eq!(kv_key(&key(None)), "lab-a.cats=20v2=2Ffinal.ab12.local");
        assert_eq!(
            kv_key(&key(Some("gpu-07"))),
            "lab-a.cats=20v2=2Ffinal.ab12.local.gpu-07"
        );
    }

    #[test]
    fn every_state_round_trips_flat() {
        for state in [
            ReadinessState::Pending {
                reason: "waiting for a copy".into(),
            },
            ReadinessState::Copying {
                progress: Some(CopyProgress {
                    files_done: 1,
                    files: 2,
                    bytes_done: 3,
                    bytes: 4,
                }),
            },
            ReadinessState::Ready {
                path: "lab-a/cats".into(),
            },
            ReadinessState::Failed {
                reason: "quota exceeded".into(),
                retryable: false,
            },
            ReadinessState::Released,
        ] {
            let r = Readiness {
                key: key(Some("n1")),
                ready: matches!(state, ReadinessState::Ready { .. }),
                state,
                replica: None,
                jobs: JobCounts::default(),
                updated_at: None,
            };
            let json = serde_json::to_value(&r).unwrap();
            assert!(json["state"].is_string(), "{json}");
            assert_eq!(json["node"], "n1");
            let back: Readiness = serde_json::from_value(json).unwrap();
            assert_eq!(back, r);
        }
    }
}
