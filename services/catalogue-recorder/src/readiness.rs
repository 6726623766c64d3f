//! The readiness mirror: a JetStream KV bucket a scheduler can watch.
//!
//! After each commit the recorder writes the [`TierReadiness`] of every (version, tier) the
//! committed facts touched under `<project>.<dataset>.<version>.<tier>` in the bucket
//! [`BUCKET`]. A scheduler plugin watches `<project>.<dataset>.<version>.*` (or one key) and
//! starts its job when `ready` is true. The bucket is a view like the redb file: writing the
//! same state twice is harmless, and a rebuild rewrites every key it touches.

use async_nats::jetstream::kv;

use crate::error::RecorderError;
use crate::fold::TierKey;
use crate::model::TierReadiness;

/// The readiness bucket (declared with the runtime's other buckets, [`stagehand_bus::READINESS`]).
pub const BUCKET: &str = stagehand_bus::READINESS_BUCKET;

/// The bucket key of a (version, tier). Dataset and tier names are escaped to the characters a
/// KV key token allows: any byte outside `[A-Za-z0-9_-]` becomes `=XX` (hex).
pub fn kv_key(tier: &TierKey) -> String {
    [
        tier.project.as_str(),
        tier.dataset.as_str(),
        tier.version.as_str(),
        tier.tier.as_str(),
    ]
    .iter()
    .map(|part| token(part))
    .collect::<Vec<_>>()
    .join(".")
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

/// Opens the readiness bucket, creating it if missing and correcting the drift of its
/// replicas (through [`stagehand_bus::Bus::provision_kv`]).
pub async fn open_bucket(bus: &stagehand_bus::Bus) -> Result<kv::Store, RecorderError> {
    Ok(bus.provision_kv(&stagehand_bus::READINESS).await?)
}

/// Writes one tier's readiness into the bucket.
pub async fn mirror(bucket: &kv::Store, readiness: &TierReadiness) -> Result<(), RecorderError> {
    let key = kv_key(&TierKey {
        project: readiness.project.clone(),
        dataset: readiness.dataset.clone(),
        version: readiness.version.clone(),
        tier: readiness.tier.clone(),
    });
    let value = serde_json::to_vec(readiness).map_err(|e| RecorderError::Worker(e.to_string()))?;
    bucket
        .put(&key, value.into())
        .await
        .map_err(|e| RecorderError::nats("writing readiness", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_kv_keys() {
        let key = kv_key(&TierKey {
            project: "lab-a".into(),
            dataset: "cats v2/final".into(),
            version: "ab12".into(),
            tier: "hot".into(),
        });
        assert_eq!(key, "lab-a.cats=20v2=2Ffinal.ab12.hot");
        assert_eq!(key.split('.').count(), 4);
    }
}
