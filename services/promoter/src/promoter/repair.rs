//! A damaged copy on a tier the promoter writes (hot; a node's `local`, by its agent) is
//! repaired as soon as it is stated damaged while a job holds it, not when the next request
//! for it comes: whoever found the damage (the scrub, the audit, a copy down, a peer's fan-out,
//! this promoter's own check before reuse), the jobs holding the copy see it withdrawn with the
//! reason, and readiness returns when the repair is published (`replica.repaired`), with no
//! new request and no person needed.
//!
//! The repair is the promoter's set copy into the copy's own folder, under the copy's lease
//! and a copy slot like any copy: every listed file already there is verified by hash and
//! kept when it matches, the others copied again from a verified replica on a source tier,
//! and the set published at once, so a job never reads it half-repaired; the fingerprint is
//! recorded afresh. Nothing is removed before its verified replacement is in place. A copy no
//! job holds is left withdrawn: the next request for it repairs it on its way (the check
//! before reuse), and no hot space is spent on a version nobody asked for again.

use stagehand_bus::{HandlerError, WorkContext};
use stagehand_catalogue::Stamp;
use stagehand_catalogue::views::{self, Placed};
use stagehand_policy::TierRole;
use stagehand_schemas::{Body, Event, Location, ReplicaDamaged, ReplicaRepaired, layout};
use tracing::{error, info, warn};

use crate::kv::LeaseState;
use crate::resolve::{self, Decision, Plan};

use super::copying::{CopyFailed, CopyFor};
use super::in_flight::Held;
use super::{Promoter, retry};

/// The step of the `replica.repaired` fact a repair states, caused by the damage it repaired.
pub fn step_repaired(tier: &str, node: Option<&str>) -> String {
    match node {
        Some(n) => format!("repaired:{tier}:{n}"),
        None => format!("repaired:{tier}"),
    }
}

impl Promoter {
    /// `replica.damaged` of a copy this instance writes: repaired now if a job holds it (the
    /// module docs). Returns the `replica.repaired` it published, if it repaired it.
    pub(super) async fn on_damaged(
        &self,
        event: &Event,
        d: &ReplicaDamaged,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let (tier, node) = (d.location.tier.as_str(), d.node.as_deref());
        if !self.answers(tier, node) || !self.follows(tier, node) {
            return Ok(Vec::new());
        }
        let project = event.project.as_str();
        let prefix = layout::version_folder(project, &d.dataset, &d.version);
        let Some(dst) = self.p().tiers.get(tier) else {
            return Ok(Vec::new());
        };
        if d.location.prefix != prefix {
            // Not a folder the promoter stages into: nothing of it is this promoter's to write.
            warn!(%tier, prefix = %d.location.prefix, "a damaged copy outside the version's folder is not repaired here");
            return Ok(Vec::new());
        }
        let Some(plan) = self.repair_plan(event, d).await? else {
            return Ok(Vec::new());
        };
        let placed = Placed {
            project: project.to_owned(),
            dataset: d.dataset.clone(),
            version: d.version.clone(),
            prefix: prefix.clone(),
            files: plan.files,
            bytes: plan.bytes,
            made_at: None,
            durable_elsewhere: false,
            shared_elsewhere: false,
            verified_by: None,
            last_verified: None,
        };
        let holds = views::holds(&self.p().catalogue, &placed, tier, node)
            .await
            .map_err(retry)?;
        if holds.live_jobs.is_empty() {
            info!(%tier, node = node.unwrap_or("-"), %prefix, "a damaged copy no job holds: left withdrawn, repaired by the next request for it");
            return Ok(Vec::new());
        }
        let Some((src_tier, src_prefix)) = plan.sources.first().cloned() else {
            error!(%tier, node = node.unwrap_or("-"), %prefix, lost = ?d.files.iter().map(|f| &f.path).collect::<Vec<_>>(), "a damaged copy jobs hold has no verified replica on a source tier to repair it from: it stays withdrawn (runbooks/replica-damaged.md)");
            return Ok(Vec::new());
        };
        // A copy of the same set in this process (a request's, which repairs it on its way)
        // or under another instance's lease makes this one unneeded.
        let copy_key = Self::copy_key(tier, node, &prefix);
        let Some(_copying) = Held::take(&self.inner.copies, copy_key) else {
            return Ok(Vec::new());
        };
        // The slot first: the lease is short and renewed only while the copy runs.
        let _slot = self.inner.slots.enqueue(plan.priority).await;
        let coord = &self.p().coordination;
        let mut revision = match coord
            .lease(tier, node, &prefix, event.id.as_str())
            .await
            .map_err(retry)?
        {
            LeaseState::Owned(rev) => rev,
            LeaseState::Held { .. } => return Ok(Vec::new()),
        };
        let limits = self.limits(tier, project);
        if let Ok(Err(refused)) = coord
            .reserve(tier, node, project, &prefix, plan.bytes, limits)
            .await
        {
            // The damaged copy holds its bytes on the tier whatever the books say.
            warn!(?refused, %prefix, "a damaged copy being repaired holds no reservation and does not fit one");
        }
        info!(%tier, node = node.unwrap_or("-"), %prefix, from = %src_tier, damaged = d.damaged_total, jobs = holds.live_jobs.len(), "repairing a damaged copy jobs hold");
        let job = CopyFor {
            project,
            dataset: &d.dataset,
            tier,
            node,
            holder: &event.id,
            request: None,
        };
        let cancel = self.p().shutdown.child_token();
        let copied = Box::pin(self.run_copy(
            &job,
            &plan,
            dst,
            &prefix,
            (&src_tier, &src_prefix),
            &mut revision,
            &cancel,
            ctx,
        ))
        .await;
        if let Err(e) = coord.end_lease(tier, node, &prefix, revision).await {
            tracing::debug!(error = %e, "repair lease not ended; it ages out");
        }
        let report = match copied {
            Ok(report) => report,
            Err(CopyFailed::Retry(e)) => return Err(e),
            Err(CopyFailed::Fail { reason, .. }) => {
                // Left withdrawn, the damaged files in place: the next request tries again.
                error!(%tier, node = node.unwrap_or("-"), %prefix, %reason, "repairing a damaged copy failed: it stays withdrawn");
                return Ok(Vec::new());
            }
        };
        let fact = event.caused(
            &step_repaired(tier, node),
            Body::ReplicaRepaired(ReplicaRepaired {
                dataset: d.dataset.clone(),
                version: d.version.clone(),
                location: Location {
                    tier: tier.to_owned(),
                    prefix: prefix.clone(),
                },
                node: node.map(str::to_owned),
                from_tier: src_tier.clone(),
                repaired: d.files.iter().map(|f| f.path.clone()).collect(),
                repaired_total: report.copied,
                files: plan.files,
                total_bytes: plan.bytes,
            }),
        );
        self.emit(std::slice::from_ref(&fact)).await?;
        info!(%tier, node = node.unwrap_or("-"), %prefix, from = %src_tier, copied = report.copied, kept = report.skipped, "damaged copy repaired: ready again for the jobs holding it");
        Ok(vec![fact])
    }

    /// The version's plan (its sources, in the policy's order), if the catalogue holds the
    /// copy withdrawn: `None` once a newer fact made it present again (a repair meanwhile), or
    /// the version is gone. A catalogue that has not folded `damage` yet (its record of the
    /// copy older than the damage, in the recorder's own order) is asked again later.
    async fn repair_plan(
        &self,
        damage: &Event,
        d: &ReplicaDamaged,
    ) -> Result<Option<Plan>, HandlerError> {
        let (tier, node) = (d.location.tier.as_str(), d.node.as_deref());
        let detail = match (self.p().catalogue)
            .version(Some(&damage.project), &d.dataset, &d.version)
            .await
        {
            Ok(detail) => detail,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(retry(e)),
        };
        let damaged_at = Stamp {
            at: damage.occurred_at,
            event_id: damage.id.clone(),
        };
        let Some(copy) =
            (detail.replicas.iter()).find(|r| r.tier == tier && r.node.as_deref() == node)
        else {
            return Ok(None);
        };
        if !copy.state.is_withdrawn() {
            if copy.stamp.as_ref().is_some_and(|s| *s >= damaged_at) {
                return Ok(None);
            }
            return Err(retry(format!(
                "the catalogue has not folded {} yet",
                damage.id
            )));
        }
        let role = self.tier_policy(tier).map_or(TierRole::Hot, |t| t.role);
        let cx = resolve::Context {
            catalogue: &self.p().catalogue,
            project: &damage.project,
            dataset: &d.dataset,
            version: &d.version,
            prepared: false,
            sources: self.p().promotion.sources_for(role),
            packing: None,
            priority: self.p().promotion.priority_for(&d.dataset),
            ingest_in_flight: None,
            seen: Default::default(),
        };
        match resolve::decide(&cx).await.map_err(retry)? {
            Decision::Stage(plan) => Ok(Some(plan)),
            _ => Ok(None),
        }
    }
}
