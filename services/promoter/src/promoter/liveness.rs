//! A node's agent says it is alive, takes its copies back when it returns, and serves its
//! peers again what it holds intact when it starts.
//!
//! Every `agent_beat_every` (a quarter of `promotion.toml`'s `agent_silent_after`) the agent
//! rewrites its node's liveness record in the promoter's bucket
//! (`stagehand_bus::placement::beat`), on a loop of its own. The demoter judges a node whose
//! record is older than `agent_silent_after` silent and states `replica.unreachable` for each
//! of its present local copies. As often, on a second loop, the agent asks the catalogue for
//! its node's copies held unreachable and re-checks each against the fingerprint recorded when
//! it was published (no byte read): intact, it states `replica.created` again (usable);
//! different or gone, `replica.damaged` with what differs (repaired by hash on the next request
//! for it). A copy with no fingerprint recorded stays unreachable here: the next request for
//! it verifies it by hash through the copy path, which treats an unreachable copy as a damaged
//! one.

use stagehand_bus::HandlerError;
use stagehand_bus::placement;
use stagehand_catalogue::{ReplicaRecord, ReplicaState};
use stagehand_mover::{Change, Difference, Fingerprint, Tier};
use stagehand_policy::TierRole;
use stagehand_schemas::{
    Body, Event, EventId, Location, ManifestRef, ReplicaCreated, ReplicaDamaged, SCHEMA_VERSION,
};
use tracing::{debug, info, warn};

use super::{Promoter, retry};
use crate::fanout::ReplicaAt;
use crate::reuse::damaged_files;

/// The step of the fact a node's agent states for a copy it re-checked on its return.
pub fn step_returned(tier: &str, node: &str) -> String {
    format!("returned:{tier}:{node}")
}

impl Promoter {
    /// A node agent's liveness loops (the module docs); the shared promoter has none. Runs
    /// until shutdown. The beat has a loop of its own: a re-check waiting on a slow catalogue
    /// or a slow disk must not delay the record that says the node is alive, or a busy node
    /// would be judged silent and its copies withdrawn.
    pub async fn liveness(self) -> Result<(), HandlerError> {
        let Some(node) = self.node().map(str::to_owned) else {
            return Ok(());
        };
        let every = self.p().promotion.agent_beat_every();
        let beats = async {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = self.p().shutdown.cancelled() => return,
                }
                if let Err(e) = placement::beat(self.p().coordination.store(), &node, every).await {
                    warn!(%node, error = %e, "liveness record not written; written again next beat");
                }
            }
        };
        let take_backs = async {
            loop {
                if let Err(e) = self.take_back(&node).await {
                    debug!(%node, error = %e, "unreachable copies not re-checked yet; tried again next beat");
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = self.p().shutdown.cancelled() => return,
                }
            }
        };
        // Once at start, until it has gone through every copy (the catalogue may not answer
        // yet): what this node holds intact is served to its peers again.
        let serve_held = async {
            loop {
                match self.serve_held(&node).await {
                    Ok(()) => return,
                    Err(e) => {
                        debug!(%node, error = %e, "copies held here not served to peers yet; tried again next beat")
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = self.p().shutdown.cancelled() => return,
                }
            }
        };
        tokio::join!(beats, take_backs, serve_held);
        Ok(())
    }

    /// A node agent with fan-out, as it starts, serves its peers again every copy the
    /// catalogue holds present on its node that still matches the fingerprint recorded when it
    /// was staged (no byte read; peers verify every byte they fetch anyway). Its restart took
    /// back every piece it had announced (`Fanout::bind`), so without this a node joining a
    /// swarm later would read from the shared tier what this node holds. A copy that differs,
    /// or has no fingerprint, is not served: the next request for it here verifies it and
    /// repairs it (`reuse.rs`), and the scrub finds it on its schedule.
    async fn serve_held(&self, node: &str) -> Result<(), HandlerError> {
        if self.p().fanout.is_none() {
            return Ok(());
        }
        for (dst, replica) in self.copies_here(node, ReplicaState::Present).await? {
            if self.p().shutdown.is_cancelled() {
                return Ok(());
            }
            let (tier, prefix) = (replica.tier.as_str(), replica.prefix.as_str());
            match self.differences_from_print(dst, node, &replica).await? {
                Some(differences) if differences.is_empty() => {}
                Some(differences) => {
                    info!(%tier, %node, %prefix, differ = differences.len(), "a copy held here differs from its fingerprint: not served to peers; the next request for it verifies and repairs it");
                    continue;
                }
                None => {
                    debug!(%tier, %node, %prefix, "a copy held here has no fingerprint recorded: not served to peers until a request verifies it");
                    continue;
                }
            }
            let reference = ManifestRef {
                digest: replica.version.clone(),
                files: replica.files,
                bytes: replica.total_bytes,
            };
            let at = ReplicaAt {
                project: replica.project,
                dataset: replica.dataset,
                version: replica.version,
                tier: replica.tier,
                prefix: replica.prefix,
            };
            self.serve_replica(dst, at, &reference).await;
        }
        Ok(())
    }

    /// Every copy on `node`'s local tiers the catalogue holds in `state`, each with the open
    /// tier it is on.
    async fn copies_here(
        &self,
        node: &str,
        state: ReplicaState,
    ) -> Result<Vec<(&Tier, ReplicaRecord)>, HandlerError> {
        let local = (self.p().policies.tiers().values()).filter(|t| t.role == TierRole::Local);
        let mut copies = Vec::new();
        for tier in local {
            let Some(dst) = self.p().tiers.get(&tier.name) else {
                continue;
            };
            let held = (self.p().catalogue)
                .replicas_on(&tier.name, Some(node), Some(state))
                .await
                .map_err(retry)?;
            copies.extend(held.into_iter().map(|replica| (dst, replica)));
        }
        Ok(copies)
    }

    /// How `replica` on `dst` differs from the fingerprint recorded when it was published
    /// (a missing folder: everything); `None` when none was recorded.
    async fn differences_from_print(
        &self,
        dst: &Tier,
        node: &str,
        replica: &ReplicaRecord,
    ) -> Result<Option<Vec<Difference>>, HandlerError> {
        let (tier, prefix) = (replica.tier.as_str(), replica.prefix.as_str());
        let store = self.p().coordination.store();
        let recorded = placement::fingerprint(store, tier, Some(node), prefix)
            .await
            .map_err(retry)?
            .and_then(|bytes| Fingerprint::decode(&bytes).ok());
        let Some(recorded) = recorded else {
            return Ok(None);
        };
        Ok(Some(if dst.set_present(prefix).await.map_err(retry)? {
            recorded.compare(&dst.fingerprint(prefix).await.map_err(retry)?)
        } else {
            vec![Difference {
                path: String::new(),
                change: Change::Missing,
            }]
        }))
    }

    /// Re-checks every copy of `node` the catalogue holds unreachable, on each local tier.
    async fn take_back(&self, node: &str) -> Result<(), HandlerError> {
        for (dst, replica) in self.copies_here(node, ReplicaState::Unreachable).await? {
            if self.p().shutdown.is_cancelled() {
                return Ok(());
            }
            self.recheck(dst, node, &replica).await?;
        }
        Ok(())
    }

    /// Compares one returned copy with its recorded fingerprint and states what it is now.
    async fn recheck(
        &self,
        dst: &Tier,
        node: &str,
        replica: &ReplicaRecord,
    ) -> Result<(), HandlerError> {
        let (tier, prefix) = (replica.tier.as_str(), replica.prefix.as_str());
        let Some(differences) = self.differences_from_print(dst, node, replica).await? else {
            info!(%tier, %node, %prefix, "a returned copy has no fingerprint recorded: left unreachable until a request verifies it by hash");
            return Ok(());
        };
        let fact = returned_fact(replica, node, &differences);
        match &fact.body {
            Body::ReplicaCreated(_) => {
                info!(%tier, %node, %prefix, "a copy of a returned node matches its fingerprint: usable again")
            }
            _ => {
                warn!(%tier, %node, %prefix, damaged = differences.len(), "a copy of a returned node differs from its fingerprint: damaged")
            }
        }
        self.emit(std::slice::from_ref(&fact)).await
    }
}

/// The fact a re-check states: `replica.created` (the copy's own files, bytes and proof) when
/// nothing differs, else `replica.damaged` with what does. Its id comes from the fact that made
/// the copy unreachable, so a re-check done twice states the same fact.
pub(crate) fn returned_fact(
    replica: &ReplicaRecord,
    node: &str,
    differences: &[Difference],
) -> Event {
    let location = Location {
        tier: replica.tier.clone(),
        prefix: replica.prefix.clone(),
    };
    let body = if differences.is_empty() {
        Body::ReplicaCreated(ReplicaCreated {
            dataset: replica.dataset.clone(),
            version: replica.version.clone(),
            location,
            files: replica.files,
            total_bytes: replica.total_bytes,
            // What proved the copy when it was made (a checkpoint's own copy stays one).
            verified_by: replica
                .verified_by
                .clone()
                .unwrap_or_else(|| "fingerprint".to_owned()),
            node: Some(node.to_owned()),
        })
    } else {
        Body::ReplicaDamaged(ReplicaDamaged {
            dataset: replica.dataset.clone(),
            version: replica.version.clone(),
            location,
            node: Some(node.to_owned()),
            found_by: "fingerprint".to_owned(),
            files: damaged_files(differences),
            damaged_total: differences.len() as u64,
            reason: format!(
                "found when node {node} returned: its files differ from the fingerprint recorded when it was staged; verified by hash and repaired on the next request for it"
            ),
        })
    };
    // The unreachable fact's id: the cause of this one.
    let cause = replica
        .stamp
        .as_ref()
        .map(|s| s.event_id.clone())
        .unwrap_or_else(|| EventId::for_content(&[replica.prefix.as_bytes(), node.as_bytes()]));
    Event {
        id: EventId::for_fact(
            &replica.project,
            &cause,
            &step_returned(&replica.tier, node),
        ),
        schema: SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: replica.project.clone(),
        correlation_id: cause.clone(),
        causation_id: Some(cause),
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_catalogue::Stamp;

    fn unreachable_copy() -> ReplicaRecord {
        let stamp = Stamp {
            at: stagehand_schemas::now(),
            event_id: EventId::new("unreachable-1").unwrap(),
        };
        ReplicaRecord {
            project: "demo".into(),
            dataset: "owls".into(),
            version: "ab".repeat(32),
            tier: "nvme".into(),
            node: Some("gpu-07".into()),
            prefix: format!("demo/owls/{}", "ab".repeat(32)),
            state: ReplicaState::Unreachable,
            reason: Some("unreachable".into()),
            stamp: Some(stamp),
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

    #[test]
    fn an_intact_copy_is_created_again_with_its_own_proof() {
        let fact = returned_fact(&unreachable_copy(), "gpu-07", &[]);
        let Body::ReplicaCreated(created) = &fact.body else {
            panic!("expected replica.created, got {}", fact.kind());
        };
        assert_eq!(created.node.as_deref(), Some("gpu-07"));
        assert_eq!((created.files, created.total_bytes), (3, 300));
        assert_eq!(created.verified_by, "read-back");
        assert_eq!(
            fact.causation_id.as_ref().unwrap().as_str(),
            "unreachable-1"
        );
        // The same re-check twice is the same fact (the duplicate window drops the copy).
        assert_eq!(
            fact.id,
            returned_fact(&unreachable_copy(), "gpu-07", &[]).id
        );
    }

    #[test]
    fn a_changed_copy_is_damaged_with_what_differs() {
        let differences = [Difference {
            path: "a.bin".into(),
            change: Change::Missing,
        }];
        let fact = returned_fact(&unreachable_copy(), "gpu-07", &differences);
        let Body::ReplicaDamaged(damaged) = &fact.body else {
            panic!("expected replica.damaged, got {}", fact.kind());
        };
        assert_eq!(damaged.files[0].path, "a.bin");
        assert_eq!(damaged.files[0].how, "missing");
        assert_eq!(damaged.damaged_total, 1);
        fact.check_locations().unwrap();
    }
}
