//! Node failure has a defined cost: the copies on a node whose agent went silent are marked
//! unreachable, so no job is sent to them and no space is counted for them.
//!
//! The shared demoter watches (a node's own demoter goes down with its node). Every quarter of
//! `promotion.toml`'s `agent_silent_after` it lists the present copies on every `local` tier
//! by node, reads each node's liveness record (`stagehand_bus::placement::liveness`, judged by
//! the time the server stored it) and, for a node silent past the interval, states
//! `replica.unreachable` for each of its present copies. A node that never wrote a record (an
//! agent from before liveness records) is not judged. The node's agent takes its copies back
//! when it beats again (`stagehand-promoter`'s `liveness` task): re-checked, each is created
//! again or found damaged.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use stagehand_bus::placement::{self, NodeLiveness};
use stagehand_bus::{Bus, CancellationToken, HandlerError};
use stagehand_catalogue::{Catalogue, ReplicaRecord, ReplicaState};
use stagehand_policy::{Policies, TierRole};
use stagehand_schemas::{Body, Event, EventId, Location, ReplicaUnreachable, SCHEMA_VERSION};
use time::OffsetDateTime;
use tracing::{debug, info, warn};

/// What the watch needs.
pub struct NodeWatch {
    pub bus: Bus,
    pub catalogue: Catalogue,
    /// The promoter's bucket, where node agents write their liveness records.
    pub placement: kv::Store,
    /// The node-local tiers.
    pub tiers: Vec<String>,
    /// `promotion.toml`'s `agent_silent_after`.
    pub silent_after: Duration,
    /// How often to look.
    pub every: Duration,
    pub shutdown: CancellationToken,
}

/// The step of a `replica.unreachable` fact.
pub fn step_unreachable(tier: &str, node: &str) -> String {
    format!("unreachable:{tier}:{node}")
}

impl NodeWatch {
    /// The watch of `policies`' local tiers, when `promotion.toml` is there and declares any.
    pub fn of(
        policies: &Policies,
        (bus, catalogue, placement): (Bus, Catalogue, kv::Store),
        shutdown: CancellationToken,
    ) -> Option<NodeWatch> {
        let promotion = policies.promotion()?;
        let tiers: Vec<String> = (policies.tiers().values())
            .filter(|t| t.role == TierRole::Local)
            .map(|t| t.name.clone())
            .collect();
        (!tiers.is_empty()).then(|| NodeWatch {
            bus,
            catalogue,
            placement,
            tiers,
            silent_after: promotion.agent_silent_after,
            every: promotion.agent_beat_every(),
            shutdown,
        })
    }

    /// Looks every `every` until shutdown; a look that fails is logged and made again.
    pub async fn run(self) -> Result<(), HandlerError> {
        info!(tiers = ?self.tiers, silent_after = ?self.silent_after, "watching node agents");
        loop {
            if let Err(e) = self.look().await {
                warn!(error = %e, "node liveness not judged this time; looked at again");
            }
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = self.shutdown.cancelled() => return Ok(()),
            }
        }
    }

    /// One look: every local tier's present copies, by node, judged.
    async fn look(&self) -> Result<(), HandlerError> {
        let retry = |e: &dyn std::fmt::Display| HandlerError::retryable(e.to_string());
        for tier in &self.tiers {
            let present = (self.catalogue)
                .replicas_on(tier, None, Some(ReplicaState::Present))
                .await
                .map_err(|e| retry(&e))?;
            // Before the records are read: a record stored while they are read is judged
            // younger, never older, than it is.
            let now = OffsetDateTime::now_utc();
            let mut seen: BTreeMap<String, Option<NodeLiveness>> = BTreeMap::new();
            for node in present.iter().filter_map(|r| r.node.as_deref()) {
                if !seen.contains_key(node) {
                    let record = placement::liveness(&self.placement, node)
                        .await
                        .map_err(|e| retry(&e))?;
                    seen.insert(node.to_owned(), record);
                }
            }
            let facts = unreachable_facts(&present, &seen, now, self.silent_after);
            if !facts.is_empty() {
                warn!(%tier, copies = facts.len(), "node agents silent: their copies marked unreachable (runbooks/node-lost.md)");
            }
            for fact in &facts {
                self.bus
                    .publish(fact)
                    .await
                    .map_err(|e| retry(&format!("publishing {}: {e}", fact.kind())))?;
            }
            debug!(%tier, nodes = seen.len(), "node liveness judged");
        }
        Ok(())
    }
}

/// The `replica.unreachable` facts due at `now`: one per present copy whose node's liveness
/// record was stored longer than `silent_after` ago. A node with no record is not judged; a
/// copy not present (damaged, removed, unreachable already) is left as it is. Each fact's id
/// comes from the fact that made the copy present, so a silence judged again states the same
/// fact, and a later silence (after the copy came back) a new one.
pub fn unreachable_facts(
    replicas: &[ReplicaRecord],
    liveness: &BTreeMap<String, Option<NodeLiveness>>,
    now: OffsetDateTime,
    silent_after: Duration,
) -> Vec<Event> {
    replicas
        .iter()
        .filter(|r| r.state == ReplicaState::Present)
        .filter_map(|r| {
            let node = r.node.as_deref()?;
            let record = liveness.get(node)?.as_ref()?;
            let stamp = r.stamp.as_ref()?;
            record
                .silent(now, silent_after)
                .then(|| unreachable_fact(r, node, record, &stamp.event_id, silent_after))
        })
        .collect()
}

fn unreachable_fact(
    r: &ReplicaRecord,
    node: &str,
    record: &NodeLiveness,
    cause: &EventId,
    silent_after: Duration,
) -> Event {
    Event {
        id: EventId::for_fact(&r.project, cause, &step_unreachable(&r.tier, node)),
        schema: SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: r.project.clone(),
        correlation_id: cause.clone(),
        causation_id: Some(cause.clone()),
        body: Body::ReplicaUnreachable(ReplicaUnreachable {
            dataset: r.dataset.clone(),
            version: r.version.clone(),
            location: Location {
                tier: r.tier.clone(),
                prefix: r.prefix.clone(),
            },
            node: node.to_owned(),
            last_seen: record.stored_at,
            silent_after_seconds: silent_after.as_secs(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_catalogue::Stamp;
    use time::macros::datetime;

    const AFTER: Duration = Duration::from_secs(120);

    fn copy(node: &str, state: ReplicaState) -> ReplicaRecord {
        ReplicaRecord {
            project: "demo".into(),
            dataset: "owls".into(),
            version: "ab".repeat(32),
            tier: "nvme".into(),
            node: Some(node.into()),
            prefix: format!("demo/owls/{}", "ab".repeat(32)),
            state,
            reason: None,
            stamp: Some(Stamp {
                at: datetime!(2026-12-09 03:00:00 UTC),
                event_id: EventId::new(format!("created-on-{node}")).unwrap(),
            }),
            files: 3,
            total_bytes: 300,
            verified_by: Some("read-back".into()),
            backup: false,
            copied: None,
            last_drill: None,
            last_verified: None,
            last_repaired: None,
        }
    }

    fn beat(node: &str, at: OffsetDateTime) -> (String, Option<NodeLiveness>) {
        let record = NodeLiveness {
            node: node.into(),
            every_seconds: 30,
            stored_at: at,
        };
        (node.to_owned(), Some(record))
    }

    #[test]
    fn only_the_present_copies_of_a_silent_node_become_unreachable() {
        let now = datetime!(2026-12-09 04:00:00 UTC);
        let replicas = [
            copy("gpu-a", ReplicaState::Present),
            copy("gpu-b", ReplicaState::Present),
            copy("gpu-b", ReplicaState::Damaged),
            copy("gpu-c", ReplicaState::Present),
        ];
        let liveness = BTreeMap::from([
            beat("gpu-a", now - Duration::from_secs(20)),
            beat("gpu-b", now - Duration::from_secs(600)),
            // gpu-c never wrote a record: not judged.
            ("gpu-c".to_owned(), None),
        ]);
        let facts = unreachable_facts(&replicas, &liveness, now, AFTER);
        assert_eq!(facts.len(), 1, "{facts:?}");
        let Body::ReplicaUnreachable(p) = &facts[0].body else {
            panic!("expected replica.unreachable");
        };
        assert_eq!(p.node, "gpu-b");
        assert_eq!(p.last_seen, now - Duration::from_secs(600));
        assert_eq!(p.silent_after_seconds, 120);
        facts[0].check_locations().unwrap();
        assert_eq!(
            facts[0].causation_id.as_ref().unwrap().as_str(),
            "created-on-gpu-b"
        );
    }

    #[test]
    fn a_silence_judged_twice_states_the_same_fact() {
        let now = datetime!(2026-12-09 04:00:00 UTC);
        let replicas = [copy("gpu-b", ReplicaState::Present)];
        let liveness = BTreeMap::from([beat("gpu-b", now - Duration::from_secs(600))]);
        let first = unreachable_facts(&replicas, &liveness, now, AFTER);
        let again = unreachable_facts(&replicas, &liveness, now + AFTER, AFTER);
        assert_eq!(first[0].id, again[0].id);
    }
}
