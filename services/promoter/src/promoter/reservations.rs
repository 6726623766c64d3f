//! Space reserved on bounded tiers and given back: by a request that ended without its
//! replica, and by the reconciler, for reservations nothing justifies any more.

use stagehand_bus::HandlerError;
use stagehand_policy::TierRole;
use time::OffsetDateTime;
use tracing::{debug, info, warn};

use crate::kv::LeaseState;
use crate::state::RequestRecord;

use super::copying::discard_staging;
use super::in_flight::Held;
use super::{Promoter, retry};

impl Promoter {
    /// Gives back the space a request that ended without its replica reserved, and removes its
    /// hidden staging folder ([`Promoter::reclaim`]); a failure to is logged, and the
    /// reconciler gives it back later.
    pub(super) async fn give_back(&self, record: &RequestRecord, why: &str) {
        let (Some(prefix), Some(r)) = (&record.reserved, record.stage()) else {
            return;
        };
        let why = format!("request {} ended: {why}", record.event.id);
        if let Err(e) = self.reclaim(&r.tier, r.node.as_deref(), prefix, &why).await {
            warn!(request = %record.event.id, %prefix, error = %e, "reservation not given back yet; the reconciler gives it back");
        }
    }

    /// Gives back the space reserved for the replica at `prefix` on `tier` (and `node`) and
    /// removes its hidden staging folder, unless something still justifies them: the replica
    /// is on the tier, a copy of it runs in this process, a request of this instance still
    /// waiting (its deadline ahead) reserved it, or another instance holds its copy lease. The
    /// decision is taken under the copy lease of the prefix — the lease every reservation of
    /// an absent replica is made under — so no reserve on any instance runs meanwhile, and the
    /// release itself is a compare-and-set on the revision it read. A reservation the demoter
    /// marked is left to the demoter. Returns whether a reservation was given back.
    pub async fn reclaim(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        why: &str,
    ) -> Result<bool, HandlerError> {
        let Some(dst) = self.p().tiers.get(tier) else {
            return Ok(false);
        };
        if dst.set_present(prefix).await.map_err(retry)? {
            return Ok(false);
        }
        let Some(_copying) = Held::take(&self.inner.copies, Self::copy_key(tier, node, prefix))
        else {
            return Ok(false);
        };
        if self
            .p()
            .state
            .reserved_by_live_request(tier, node, prefix, OffsetDateTime::now_utc())?
        {
            return Ok(false);
        }
        let coord = &self.p().coordination;
        let revision = match coord
            .lease(tier, node, prefix, RECLAIM_LEASE)
            .await
            .map_err(retry)?
        {
            LeaseState::Owned(rev) => rev,
            LeaseState::Held { .. } => return Ok(false),
        };
        let result = async {
            // Under the lease no copy of it runs anywhere: absent now, absent until it ends.
            if dst.set_present(prefix).await.map_err(retry)? {
                return Ok(false);
            }
            // The folder first: a crash in between leaves a reservation the next pass finds.
            discard_staging(dst, prefix).await;
            coord.release(tier, node, prefix).await.map_err(retry)
        }
        .await;
        if let Err(e) = coord.end_lease(tier, node, prefix, revision).await {
            debug!(error = %e, "reconciler's copy lease not ended; it ages out");
        }
        if let Ok(true) = result {
            info!(%tier, node = node.unwrap_or("-"), %prefix, %why, "reservation with no live request and no replica released; its staging folder removed");
            // A request that found the copy table taken meanwhile is looked at again now.
            let mut parts = prefix.splitn(3, '/');
            if let (Some(project), Some(dataset)) = (parts.next(), parts.next()) {
                self.wake_dataset(project, dataset, None);
            }
        }
        result
    }

    /// The tiers (and node) whose space this promoter reserves: the shared promoter's hot
    /// tiers, a node agent's own node's local tiers.
    fn bounded_places(&self) -> Vec<(String, Option<String>)> {
        let mut places: Vec<(String, Option<String>)> = self
            .p()
            .tiers
            .keys()
            .filter_map(|name| {
                let role = self.tier_policy(name)?.role;
                match (self.node(), role) {
                    (None, TierRole::Hot) => Some((name.clone(), None)),
                    (Some(n), TierRole::Local) => Some((name.clone(), Some(n.to_owned()))),
                    _ => None,
                }
            })
            .collect();
        places.sort();
        places
    }

    /// One pass of the reconciler: every reservation on this promoter's tiers with neither a
    /// live request nor a replica is given back (and logged), its staging folder removed
    /// ([`Promoter::reclaim`]); those the demoter marked are its own. Returns how many.
    pub async fn reconcile(&self) -> Result<usize, HandlerError> {
        let mut released = 0;
        for (tier, node) in self.bounded_places() {
            let (reserved, _) = self
                .p()
                .coordination
                .reservations(&tier, node.as_deref())
                .await
                .map_err(retry)?;
            for prefix in reserved.replicas.keys() {
                if self.p().shutdown.is_cancelled() {
                    return Ok(released);
                }
                if reserved.withdrawing.contains(prefix) {
                    continue;
                }
                if self
                    .reclaim(
                        &tier,
                        node.as_deref(),
                        prefix,
                        "the reconciler found no live request and no replica",
                    )
                    .await?
                {
                    released += 1;
                }
            }
        }
        Ok(released)
    }

    /// Reconciles reservations at start and every `reconcile_every` until shutdown.
    pub async fn reconciler(self) -> Result<(), HandlerError> {
        let every = self.p().promotion.reconcile_every;
        loop {
            match self.reconcile().await {
                Ok(0) => debug!("reservations reconciled: none to give back"),
                Ok(n) => info!(released = n, "reservations reconciled"),
                Err(e) => {
                    warn!(error = %e, "reconciling reservations failed; the next pass tries again")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.p().shutdown.cancelled() => return Ok(()),
            }
        }
    }
}

/// The lease holder named while the reconciler decides about a reservation.
const RECLAIM_LEASE: &str = "reconcile";
