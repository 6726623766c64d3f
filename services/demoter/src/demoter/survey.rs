//! The survey of one bounded tier: the catalogue's replicas on it, what holds each, and
//! the filesystem's usage under it.

use std::collections::HashSet;

use futures::{StreamExt, TryStreamExt};
use stagehand_catalogue::{Catalogue, CatalogueError};
use stagehand_policy::{Policies, TierLimits, TierPolicy, TierRole};

use crate::plan::{FsUsage, TierUsage};
use crate::view::{self, Holds, Placed};

/// Questions about holds a survey has in flight at once: one per replica, each a round trip
/// to the catalogue, so a tier of many replicas is surveyed in a few round trips' time.
const SURVEY_QUESTIONS_AT_ONCE: usize = 16;

/// What a survey of one bounded tier found.
#[derive(Debug, Clone)]
pub struct TierSurvey {
    pub tier: String,
    pub role: TierRole,
    pub limits: TierLimits,
    pub usage: TierUsage,
    /// Every replica present on the tier and what holds it.
    pub replicas: Vec<(Placed, Holds)>,
}

impl TierSurvey {
    /// Bytes of replicas a live stage holds.
    pub fn held_bytes(&self) -> u64 {
        self.replicas
            .iter()
            .filter(|(_, h)| !h.live_jobs.is_empty())
            .map(|(p, _)| p.bytes)
            .sum()
    }

    /// Per project: bytes placed and bytes held.
    pub fn per_project(&self) -> std::collections::BTreeMap<String, (u64, u64)> {
        let mut out = std::collections::BTreeMap::<String, (u64, u64)>::new();
        for (p, h) in &self.replicas {
            let e = out.entry(p.project.clone()).or_default();
            e.0 += p.bytes;
            if !h.live_jobs.is_empty() {
                e.1 += p.bytes;
            }
        }
        out
    }
}

/// The durable tiers: where a verified copy lets a replica above it go.
pub fn durable_tiers(policies: &Policies) -> HashSet<String> {
    policies
        .tiers()
        .values()
        .filter(|t| matches!(t.role, TierRole::Capacity | TierRole::Backup))
        .map(|t| t.name.clone())
        .collect()
}

/// Surveys one bounded shared tier: the catalogue's replicas on it, their holds, and `statfs`
/// of a posix tier's root.
pub async fn survey(
    catalogue: &Catalogue,
    policies: &Policies,
    tier: &TierPolicy,
) -> Result<Option<TierSurvey>, CatalogueError> {
    survey_on_node(catalogue, policies, tier, None).await
}

/// [`survey`] of a bounded tier as seen from `node` (`None`: a shared tier): on a node-local
/// tier only that node's replicas count, and `statfs` is of the tier's root on this machine
/// (the node's own disk, where its demoter runs).
pub async fn survey_on_node(
    catalogue: &Catalogue,
    policies: &Policies,
    tier: &TierPolicy,
    node: Option<&str>,
) -> Result<Option<TierSurvey>, CatalogueError> {
    let Some(limits) = tier.limits.clone() else {
        return Ok(None);
    };
    let placed = view::placed_on(catalogue, &tier.name, node, &durable_tiers(policies)).await?;
    let replicas: Vec<(Placed, Holds)> = futures::stream::iter(placed)
        .map(|p| async move {
            let h = view::holds(catalogue, &p, &tier.name, node).await?;
            Ok::<_, CatalogueError>((p, h))
        })
        .buffered(SURVEY_QUESTIONS_AT_ONCE)
        .try_collect()
        .await?;
    let fs = match &tier.kind {
        stagehand_policy::TierKind::Posix { root } => {
            rustix::fs::statvfs(root).ok().map(|s| FsUsage {
                total: s.f_blocks.saturating_mul(s.f_frsize),
                avail: s.f_bavail.saturating_mul(s.f_frsize),
            })
        }
        stagehand_policy::TierKind::S3(_) => None,
    };
    let usage = TierUsage {
        capacity: limits.capacity,
        placed: replicas.iter().map(|(p, _)| p.bytes).sum(),
        fs,
    };
    Ok(Some(TierSurvey {
        tier: tier.name.clone(),
        role: tier.role,
        limits,
        usage,
        replicas,
    }))
}
