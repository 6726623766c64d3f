//! Catalogue queries over NATS request/reply.
//!
//! A client sends one JSON [`Query`] to [`stagehand_schemas::subject::CATALOGUE_QUERY`] and gets
//! one JSON [`Answer`]. Recorders subscribe in the queue group [`QUEUE_GROUP`], so several of
//! them can serve and each query is answered once. Examples:
//!
//! ```text
//! {"query":"datasets"}                                   → {"answer":"datasets","datasets":[…]}
//! {"query":"dataset","project":"lab-a","dataset":"cats"} → {"answer":"dataset","dataset":{…},"versions":[…],…}
//! {"query":"version","project":"lab-a","dataset":"cats","version":"3f2a9c01"}
//! {"query":"readiness","project":"lab-a","dataset":"cats","version":"3f2a…","tier":"hot"}
//! {"query":"dead_letters"}
//! ```
//! A failed query answers `{"answer":"error","code":"not_found"|"ambiguous"|"bad_query"|
//! "internal","message":"…"}`.

use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use stagehand_schemas::subject::CATALOGUE_QUERY;
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::fold::{TierKey, decode, key, prefix};
use crate::model::*;
use crate::store::Store;

/// The queue group recorders answer queries in.
pub const QUEUE_GROUP: &str = "catalogue-recorder";

/// The shortest version prefix a query may use.
pub const MIN_VERSION_PREFIX: usize = 8;

/// A question to the catalogue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "query", rename_all = "snake_case", deny_unknown_fields)]
pub enum Query {
    /// Every dataset, or those of one project.
    Datasets {
        #[serde(default)]
        project: Option<String>,
    },
    /// One dataset: versions, replicas with states, stages, rejections with reasons.
    Dataset { project: String, dataset: String },
    /// One version with its files; `version` is a digest or a unique prefix of ≥ 8 characters.
    Version {
        project: String,
        dataset: String,
        version: String,
    },
    /// Readiness of a version per tier (or on one tier).
    Readiness {
        project: String,
        dataset: String,
        version: String,
        #[serde(default)]
        tier: Option<String>,
    },
    /// Dead letters per service.
    DeadLetters,
}

/// Why a query failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    NotFound,
    Ambiguous,
    BadQuery,
    Internal,
}

/// The catalogue's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    Datasets { datasets: Vec<DatasetRecord> },
    Dataset(DatasetDetail),
    Version(VersionDetail),
    Readiness { tiers: Vec<TierReadiness> },
    DeadLetters { services: Vec<DeadLetterRecord> },
    Error { code: ErrorCode, message: String },
}

impl Answer {
    fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Answer::Error {
            code,
            message: message.into(),
        }
    }
}

fn scan<T: serde::de::DeserializeOwned>(store: &Store, prefix: &str) -> Result<Vec<T>, StoreError> {
    store
        .scan(prefix)?
        .into_iter()
        .map(|(k, v)| decode(&k, &v))
        .collect()
}

fn get<T: serde::de::DeserializeOwned>(store: &Store, key: &str) -> Result<Option<T>, StoreError> {
    store.get(key)?.map(|v| decode(key, &v)).transpose()
}

/// Answers a query from the store. Store failures become `internal` answers.
pub fn answer(store: &Store, query: &Query) -> Answer {
    match try_answer(store, query) {
        Ok(answer) => answer,
        Err(e) => Answer::error(ErrorCode::Internal, e.to_string()),
    }
}

fn try_answer(store: &Store, query: &Query) -> Result<Answer, StoreError> {
    Ok(match query {
        Query::Datasets { project } => {
            let prefix = match project {
                Some(p) => prefix('D', &[p]),
                None => prefix('D', &[]),
            };
            Answer::Datasets {
                datasets: scan(store, &prefix)?,
            }
        }
        Query::Dataset { project, dataset } => {
            let Some(record) = get::<DatasetRecord>(store, &key('D', &[project, dataset]))? else {
                return Ok(Answer::error(
                    ErrorCode::NotFound,
                    format!("no dataset {dataset:?} in project {project:?}"),
                ));
            };
            let mut versions: Vec<VersionRecord> = scan(store, &prefix('V', &[project, dataset]))?;
            versions
                .sort_by(|a, b| (a.provenance.at, &a.version).cmp(&(b.provenance.at, &b.version)));
            Answer::Dataset(DatasetDetail {
                dataset: record,
                versions,
                replicas: scan(store, &prefix('R', &[project, dataset]))?,
                stages: scan(store, &prefix('S', &[project, dataset]))?,
                rejections: scan(store, &prefix('X', &[project, dataset]))?,
            })
        }
        Query::Version {
            project,
            dataset,
            version,
        } => match resolve(store, project, dataset, version)? {
            Err(answer) => answer,
            Ok(record) => {
                let v = record.version.clone();
                let files = get(store, &key('F', &[project, dataset, &v]))?.unwrap_or_default();
                Answer::Version(VersionDetail {
                    version: record,
                    files,
                    replicas: scan(store, &prefix('R', &[project, dataset, &v]))?,
                    stages: scan(store, &prefix('S', &[project, dataset, &v]))?,
                })
            }
        },
        Query::Readiness {
            project,
            dataset,
            version,
            tier,
        } => match resolve(store, project, dataset, version)? {
            Err(answer) => answer,
            Ok(record) => {
                let mut tiers: Vec<String> = match tier {
                    Some(t) => vec![t.clone()],
                    None => {
                        let replicas: Vec<ReplicaRecord> =
                            scan(store, &prefix('R', &[project, dataset, &record.version]))?;
                        let stages: Vec<StageRecord> =
                            scan(store, &prefix('S', &[project, dataset, &record.version]))?;
                        replicas
                            .into_iter()
                            .map(|r| r.tier)
                            .chain(stages.into_iter().map(|s| s.tier))
                            .collect()
                    }
                };
                tiers.sort();
                tiers.dedup();
                let tiers = tiers
                    .into_iter()
                    .map(|tier| {
                        tier_readiness(
                            store,
                            &TierKey {
                                project: project.clone(),
                                dataset: dataset.clone(),
                                version: record.version.clone(),
                                tier,
                            },
                        )
                    })
                    .collect::<Result<_, _>>()?;
                Answer::Readiness { tiers }
            }
        },
        Query::DeadLetters => Answer::DeadLetters {
            services: scan(store, &prefix('L', &[]))?,
        },
    })
}

/// Finds the version a digest or a unique prefix names.
fn resolve(
    store: &Store,
    project: &str,
    dataset: &str,
    version: &str,
) -> Result<Result<VersionRecord, Answer>, StoreError> {
    if version.len() < MIN_VERSION_PREFIX && version.len() != 64 {
        return Ok(Err(Answer::error(
            ErrorCode::BadQuery,
            format!(
                "version {version:?} is too short: give at least {MIN_VERSION_PREFIX} characters of the digest"
            ),
        )));
    }
    let mut p = prefix('V', &[project, dataset]);
    p.push_str(version);
    let mut found: Vec<VersionRecord> = scan(store, &p)?;
    Ok(match found.len() {
        0 => Err(Answer::error(
            ErrorCode::NotFound,
            format!("no version {version:?} of dataset {dataset:?} in project {project:?}"),
        )),
        1 => Ok(found.remove(0)),
        n => Err(Answer::error(
            ErrorCode::Ambiguous,
            format!(
                "version prefix {version:?} matches {n} versions of {dataset:?}; give more characters"
            ),
        )),
    })
}

/// The readiness of one version on one tier, from its replica and stage records.
pub fn tier_readiness(store: &Store, tier: &TierKey) -> Result<TierReadiness, StoreError> {
    let replica: Option<ReplicaRecord> = get(
        store,
        &key(
            'R',
            &[&tier.project, &tier.dataset, &tier.version, &tier.tier],
        ),
    )?;
    let stages: Vec<StageRecord> = scan(
        store,
        &prefix(
            'S',
            &[&tier.project, &tier.dataset, &tier.version, &tier.tier],
        ),
    )?;
    let reason = stages
        .iter()
        .filter(|s| s.state == StageState::Failed)
        .max_by(|a, b| a.stamp.cmp(&b.stamp))
        .and_then(|s| s.reason.clone());
    Ok(TierReadiness {
        project: tier.project.clone(),
        dataset: tier.dataset.clone(),
        version: tier.version.clone(),
        tier: tier.tier.clone(),
        ready: replica
            .as_ref()
            .is_some_and(|r| r.state == ReplicaState::Present)
            || stages.iter().any(|s| s.state == StageState::Ready),
        replica: replica.map(|r| r.state),
        jobs: stages.into_iter().map(|s| (s.job_id, s.state)).collect(),
        reason,
    })
}

/// Serves queries until `shutdown` is cancelled.
pub async fn serve(
    client: async_nats::Client,
    store: std::sync::Arc<Store>,
    shutdown: CancellationToken,
) -> Result<(), RecorderError> {
    let mut subscription = client
        .queue_subscribe(CATALOGUE_QUERY, QUEUE_GROUP.into())
        .await
        .map_err(|e| RecorderError::nats("subscribing to catalogue queries", e))?;
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            message = subscription.next() => match message {
                Some(m) => m,
                None => break,
            },
        };
        let Some(reply) = message.reply.clone() else {
            continue;
        };
        let store = store.clone();
        let answer = tokio::task::spawn_blocking(move || {
            match serde_json::from_slice::<Query>(&message.payload) {
                Ok(query) => answer(&store, &query),
                Err(e) => Answer::error(ErrorCode::BadQuery, format!("not a catalogue query: {e}")),
            }
        })
        .await
        .unwrap_or_else(|e| Answer::error(ErrorCode::Internal, e.to_string()));
        let bytes = serde_json::to_vec(&answer).unwrap_or_default();
        if let Err(e) = client.publish(reply, bytes.into()).await {
            tracing::warn!(error = %e, "could not send a catalogue answer");
        }
    }
    let _ = subscription.unsubscribe().await;
    Ok(())
}

/// Why asking the catalogue failed (the catalogue's own `error` answers are not failures).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AskError {
    #[error("catalogue query over NATS failed (is a catalogue recorder running?): {0}")]
    Request(String),
    #[error("catalogue answered something that is not an answer: {0}")]
    BadAnswer(String),
}

impl AskError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, AskError::Request(_))
    }
}

/// Asks the catalogue one query and waits up to `timeout` for the answer.
pub async fn ask(
    client: &async_nats::Client,
    query: &Query,
    timeout: Duration,
) -> Result<Answer, AskError> {
    let bytes = serde_json::to_vec(query).map_err(|e| AskError::Request(e.to_string()))?;
    let response = tokio::time::timeout(timeout, client.request(CATALOGUE_QUERY, bytes.into()))
        .await
        .map_err(|_| AskError::Request(format!("no answer within {timeout:?}")))?
        .map_err(|e| AskError::Request(e.to_string()))?;
    serde_json::from_slice(&response.payload).map_err(|e| AskError::BadAnswer(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::tests::{rejected, replica, validated};

    #[test]
    fn queries_answer_from_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("c.redb")).unwrap();
        store
            .apply_batch(&[validated(1), rejected(2), replica(1, false)])
            .unwrap();
        let Answer::Datasets { datasets } = answer(&store, &Query::Datasets { project: None })
        else {
            panic!()
        };
        assert_eq!(datasets.len(), 1);
        let Answer::Dataset(detail) = answer(
            &store,
            &Query::Dataset {
                project: "lab-a".into(),
                dataset: "cats".into(),
            },
        ) else {
            panic!()
        };
        assert_eq!(detail.versions.len(), 1);
        assert_eq!(detail.replicas.len(), 2, "source and hot");
        assert_eq!(detail.rejections[0].problems.len(), 2);
        let digest = detail.versions[0].version.clone();
        let q = |v: &str| Query::Version {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: v.into(),
        };
        let Answer::Version(v) = answer(&store, &q(&digest[..8])) else {
            panic!()
        };
        assert_eq!(v.files.len(), 2);
        assert!(matches!(
            answer(&store, &q(&digest[..7])),
            Answer::Error {
                code: ErrorCode::BadQuery,
                ..
            }
        ));
        assert!(matches!(
            answer(&store, &q("ffffffffff")),
            Answer::Error {
                code: ErrorCode::NotFound,
                ..
            }
        ));
        let Answer::Readiness { tiers } = answer(
            &store,
            &Query::Readiness {
                project: "lab-a".into(),
                dataset: "cats".into(),
                version: digest,
                tier: None,
            },
        ) else {
            panic!()
        };
        assert_eq!(tiers.len(), 2);
        assert!(tiers.iter().all(|t| t.ready));
    }

    #[test]
    fn query_json_is_the_documented_shape() {
        let q: Query = serde_json::from_str(r#"{"query":"datasets"}"#).unwrap();
        assert_eq!(q, Query::Datasets { project: None });
        assert!(serde_json::from_str::<Query>(r#"{"query":"datasets","x":1}"#).is_err());
        let a = serde_json::to_value(Answer::error(ErrorCode::NotFound, "x")).unwrap();
        assert_eq!(a["answer"], "error");
        assert_eq!(a["code"], "not_found");
    }
}
