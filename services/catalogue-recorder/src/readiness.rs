//! Readiness: derived per (project, dataset, version, tier, node) from the tier's replica
//! record and the key's [`ReadinessAggregate`], and mirrored into the JetStream KV bucket
//! schedulers read ([`stagehand_catalogue::READINESS_BUCKET`], keys from
//! [`stagehand_catalogue::kv_key`]).
//!
//! The state follows this order: a replica found damaged (`replica.damaged`), or on a node
//! out of reach (`replica.unreachable`), makes it `pending` with what was found, whatever stages still hold it (readiness is withdrawn first,
//! before the replica is verified or repaired); a verified replica on the tier (or a job's
//! `stage.ready`) makes it `ready` with its path; else a newest stage fact that failed makes it `failed` with
//! the reason; else a job still waiting makes it `pending` (or `copying` while a replica is
//! being made); else — nothing holds it and no copy is there — `released`. The bucket is a
//! view like the redb file: writing the same state twice is harmless, and a rebuild rewrites
//! every key it touches.

use async_nats::jetstream::kv;
use stagehand_catalogue::{
    Readiness, ReadinessKey, ReadinessState, ReplicaRecord, ReplicaState, StageState, kv_key,
};

use crate::error::{RecorderError, StoreError};
use crate::model::ReadinessAggregate;
use crate::store::{READINESS, REPLICAS, Store, decode};

/// Readiness of `key` from its records.
pub fn derive(
    key: ReadinessKey,
    aggregate: &ReadinessAggregate,
    replica: Option<&ReplicaRecord>,
) -> Readiness {
    let replica_state = replica.map(|r| r.state);
    let state = if let Some(r) = replica.filter(|r| r.state.is_withdrawn()) {
        ReadinessState::Pending {
            reason: format!(
                "the replica on tier {} is {}",
                key.tier,
                r.reason.as_deref().unwrap_or("withdrawn")
            ),
        }
    } else if let Some(r) = replica.filter(|r| r.state == ReplicaState::Present) {
        ReadinessState::Ready {
            path: r.prefix.clone(),
        }
    } else if aggregate.jobs.ready > 0 {
        ReadinessState::Ready {
            path: aggregate
                .ready_path
                .as_ref()
                .map(|(_, p)| p.clone())
                .unwrap_or_default(),
        }
    } else if let Some(failed) = aggregate
        .newest
        .as_ref()
        .filter(|n| n.state == StageState::Failed)
    {
        ReadinessState::Failed {
            reason: failed.reason.clone().unwrap_or_default(),
            retryable: failed.retryable.unwrap_or(false),
        }
    } else if aggregate.jobs.pending > 0 {
        if replica_state == Some(ReplicaState::Staging) {
            ReadinessState::Copying { progress: None }
        } else {
            ReadinessState::Pending {
                reason: format!("waiting for a verified copy on tier {}", key.tier),
            }
        }
    } else {
        ReadinessState::Released
    };
    let updated_at = [
        replica.and_then(|r| r.stamp.as_ref()).map(|s| s.at),
        aggregate.newest.as_ref().map(|n| n.stamp.at),
    ]
    .into_iter()
    .flatten()
    .max();
    Readiness {
        ready: matches!(state, ReadinessState::Ready { .. }),
        key,
        state,
        replica: replica_state,
        jobs: aggregate.jobs,
        updated_at,
    }
}

/// The readiness of `key` in `store`; `None` when nothing is known of it.
pub fn current(store: &Store, key: &ReadinessKey) -> Result<Option<Readiness>, StoreError> {
    let txn = store.reader()?;
    let node = key.node.as_deref().unwrap_or("");
    let rkey = (
        key.project.as_str(),
        key.dataset.as_str(),
        key.version.as_str(),
        key.tier.as_str(),
        node,
    );
    let Some(aggregate) = txn
        .open_table(READINESS)?
        .get(rkey)?
        .map(|v| decode::<ReadinessAggregate>(v.value(), || format!("readiness {rkey:?}")))
        .transpose()?
    else {
        return Ok(None);
    };
    let replica = replica_of(&txn, key)?;
    Ok(Some(derive(key.clone(), &aggregate, replica.as_ref())))
}

/// The replica record a readiness key stands on: the tier's, or the node's on a node-local
/// tier.
pub(crate) fn replica_of(
    txn: &redb::ReadTransaction,
    key: &ReadinessKey,
) -> Result<Option<ReplicaRecord>, StoreError> {
    let rkey = (
        key.project.as_str(),
        key.dataset.as_str(),
        key.version.as_str(),
        key.tier.as_str(),
        key.node.as_deref().unwrap_or(""),
    );
    txn.open_table(REPLICAS)?
        .get(rkey)?
        .map(|v| decode::<ReplicaRecord>(v.value(), || format!("replica {rkey:?}")))
        .transpose()
}

/// Opens the readiness bucket, creating it if missing and correcting the drift of its
/// replicas (through [`stagehand_bus::Bus::provision_kv`]).
pub async fn open_bucket(bus: &stagehand_bus::Bus) -> Result<kv::Store, RecorderError> {
    Ok(bus.provision_kv(&stagehand_bus::READINESS).await?)
}

/// Writes one readiness record into the bucket.
pub async fn mirror(bucket: &kv::Store, readiness: &Readiness) -> Result<(), RecorderError> {
    let value =
        serde_json::to_vec(readiness).map_err(|e| RecorderError::nats("encoding readiness", e))?;
    bucket
        .put(kv_key(&readiness.key), value.into())
        .await
        .map_err(|e| RecorderError::nats("writing readiness", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::{JobCounts, Stamp};
    use stagehand_schemas::EventId;

    use super::*;
    use crate::model::StageFact;

    fn key() -> ReadinessKey {
        ReadinessKey {
            project: "p".into(),
            dataset: "d".into(),
            version: "v".into(),
            tier: "hot".into(),
            node: None,
        }
    }

    fn stamp(s: i64) -> Stamp {
        Stamp {
            at: time::OffsetDateTime::from_unix_timestamp(s).unwrap(),
            event_id: EventId::new(format!("e{s}")).unwrap(),
        }
    }

    #[test]
    fn a_failure_after_the_request_fails_and_a_request_after_a_failure_waits() {
        let mut a = ReadinessAggregate {
            jobs: JobCounts {
                pending: 1,
                failed: 1,
                ..Default::default()
            },
            newest: Some(StageFact {
                stamp: stamp(2),
                state: StageState::Failed,
                reason: Some("quota exceeded".into()),
                retryable: Some(false),
            }),
            ready_path: None,
        };
        let r = derive(key(), &a, None);
        assert_eq!(
            r.state,
            ReadinessState::Failed {
                reason: "quota exceeded".into(),
                retryable: false
            }
        );
        a.newest = Some(StageFact {
            stamp: stamp(3),
            state: StageState::Pending,
            reason: None,
            retryable: None,
        });
        assert!(matches!(
            derive(key(), &a, None).state,
            ReadinessState::Pending { .. }
        ));
        a.jobs = JobCounts {
            released: 2,
            ..Default::default()
        };
        assert_eq!(derive(key(), &a, None).state, ReadinessState::Released);
    }

    /// A replica found damaged withdraws readiness even while a job still holds a `ready`
    /// stage on it; a newer `replica.created` (its repair) makes it ready again.
    #[test]
    fn a_damaged_replica_is_not_ready_whatever_holds_it() {
        let a = ReadinessAggregate {
            jobs: JobCounts {
                ready: 1,
                ..Default::default()
            },
            newest: None,
            ready_path: Some((stamp(1), "/tiers/hot/p/d/v".into())),
        };
        let mut replica = ReplicaRecord {
            project: "p".into(),
            dataset: "d".into(),
            version: "v".into(),
            tier: "hot".into(),
            node: None,
            prefix: "p/d/v".into(),
            state: ReplicaState::Damaged,
            reason: Some(
                "damaged (found by fingerprint): 1 path(s) — a.bin missing; being repaired".into(),
            ),
            stamp: Some(stamp(2)),
            files: 1,
            total_bytes: 1,
            verified_by: Some("hashed-in-flight".into()),
            backup: false,
            copied: Some(stamp(1)),
            last_drill: None,
            last_verified: None,
            last_repaired: None,
        };
        let r = derive(key(), &a, Some(&replica));
        assert!(!r.ready);
        match r.state {
            ReadinessState::Pending { reason } => {
                assert!(reason.contains("a.bin missing"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        replica.state = ReplicaState::Present;
        assert!(derive(key(), &a, Some(&replica)).ready);
    }
}
