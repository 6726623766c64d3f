//! The survey of one bounded tier: the catalogue's replicas on it, what holds each, and
//! the filesystem's usage under it. The demoter acts on it and `stagehand tier usage` shows
//! it, so what the operator sees is what the demoter acts on; it only asks questions.

use std::collections::HashSet;

use futures::{StreamExt, TryStreamExt};
use stagehand_policy::{Policies, TierLimits, TierPolicy, TierRole};

use crate::views::{self as view, Holds, Placed};
use crate::{Catalogue, CatalogueError};

/// Questions about holds a survey has in flight at once: one per replica, each a round trip
/// to the catalogue, so a tier of many replicas is surveyed in a few round trips' time.
const SURVEY_QUESTIONS_AT_ONCE: usize = 16;

/// What `statfs` says of a posix tier's filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsUsage {
    /// Size of the filesystem, bytes.
    pub total: u64,
    /// Bytes an unprivileged writer can still use.
    pub avail: u64,
}

impl FsUsage {
    /// The filesystem's usage at `root`; `None` when it cannot be measured from here (not
    /// mounted on this host, no permission).
    pub fn at(root: &std::path::Path) -> Option<FsUsage> {
        let s = rustix::fs::statvfs(root).ok()?;
        Some(FsUsage {
            total: s.f_blocks.saturating_mul(s.f_frsize),
            avail: s.f_bavail.saturating_mul(s.f_frsize),
        })
    }

    /// Bytes in use (what is neither free nor reserved for root counts as used).
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.avail)
    }
}

/// The usage of one bounded tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierUsage {
    /// Bytes Stagehand may place on the tier (`tiers.toml`).
    pub capacity: u64,
    /// Bytes of the replicas the catalogue lists as present on the tier.
    pub placed: u64,
    /// The filesystem, when the tier is posix and `statfs` answered.
    pub fs: Option<FsUsage>,
}

impl TierUsage {
    /// Bytes on the filesystem that are not Stagehand's replicas.
    pub fn others(&self) -> u64 {
        self.fs
            .map_or(0, |fs| fs.used().saturating_sub(self.placed))
    }

    /// Usage counted against the watermarks: Stagehand's own bytes plus the part of its budget
    /// the filesystem cannot give any more because others filled it (the demoter's `plan`
    /// module docs say why).
    pub fn counted(&self) -> u64 {
        let budget_left = self.capacity.saturating_sub(self.placed);
        let unusable = self.fs.map_or(0, |fs| budget_left.saturating_sub(fs.avail));
        self.placed.saturating_add(unusable)
    }
}

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

/// The tiers whose copies count elsewhere ([`view::CountedTiers`]), by their roles.
pub fn counted_tiers(policies: &Policies) -> view::CountedTiers {
    let with_role = |roles: &[TierRole]| -> HashSet<String> {
        (policies.tiers().values())
            .filter(|t| roles.contains(&t.role))
            .map(|t| t.name.clone())
            .collect()
    };
    view::CountedTiers {
        durable: with_role(&[TierRole::Capacity, TierRole::Backup]),
        kept: with_role(&[TierRole::Hot, TierRole::Capacity, TierRole::Backup]),
    }
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
    let placed = view::placed_on(catalogue, &tier.name, node, &counted_tiers(policies)).await?;
    let replicas: Vec<(Placed, Holds)> = futures::stream::iter(placed)
        .map(|p| async move {
            let h = view::holds(catalogue, &p, &tier.name, node).await?;
            Ok::<_, CatalogueError>((p, h))
        })
        .buffered(SURVEY_QUESTIONS_AT_ONCE)
        .try_collect()
        .await?;
    let fs = match &tier.kind {
        stagehand_policy::TierKind::Posix { root } => FsUsage::at(root),
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
