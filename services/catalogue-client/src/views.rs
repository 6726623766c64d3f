//! What the catalogue says is on a tier, and what holds it: the demoter's (and `stagehand tier
//! usage`'s) view, asked through this client only.
//!
//! Anything the view misses fails safe: a replica not listed is not demoted, and a durable
//! copy not listed is made again before the replica above it is removed.

use std::collections::{BTreeMap, HashSet};

use crate::{Catalogue, CatalogueError, Query, ReplicaRecord, StageStatus, VersionRecord};
use time::OffsetDateTime;

/// A verified replica present on the tier looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub project: String,
    pub dataset: String,
    pub version: String,
    /// Beneath the tier's root.
    pub prefix: String,
    pub files: u64,
    pub bytes: u64,
    /// When the replica was made, if the catalogue knows.
    pub made_at: Option<OffsetDateTime>,
    /// A verified copy is present on a durable tier (capacity or backup).
    pub durable_elsewhere: bool,
    /// A verified copy is present on another shared tier the demoters keep (one of
    /// [`CountedTiers::kept`], naming no node): what lets a node's demoter remove a node's copy
    /// without stating anything about a shared tier (a node-local replica is never the last
    /// copy).
    pub shared_elsewhere: bool,
    /// How the replica was proven when it was made.
    pub verified_by: Option<String>,
    /// When a scrub last read it back whole and found it verified (`replica.verified`).
    pub last_verified: Option<OffsetDateTime>,
}

/// The tiers a copy elsewhere counts on, by role (`survey::counted_tiers`).
#[derive(Debug, Clone, Default)]
pub struct CountedTiers {
    /// Capacity and backup: a verified copy there lets a replica above it go without a copy
    /// down ([`Placed::durable_elsewhere`]).
    pub durable: HashSet<String>,
    /// The durable tiers and the hot ones, whose last copy the shared demoter copies down
    /// before it removes it; not a source tier, whose copy its lab may delete
    /// ([`Placed::shared_elsewhere`]).
    pub kept: HashSet<String>,
}

/// What the stage requests of a version on the tier say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holds {
    /// Jobs whose stage is requested and not released (pending, copying or ready).
    pub live_jobs: Vec<String>,
    /// The newest change of any of its stage requests on the tier.
    pub last_staged: Option<OffsetDateTime>,
}

/// Every replica the catalogue lists as present on `tier` (on a node-local tier: `node`'s
/// replicas only; `None`: the shared tier's), with whether a verified copy of the same version
/// is present on one of `counted`'s tiers. Those tiers are shared: a copy there that names
/// a node is no copy of theirs. It can only have been stated by a node's agent, whose user may
/// state facts about its own node alone, and counting it would let the last copy above it be
/// removed without a copy down.
pub async fn placed_on(
    catalogue: &Catalogue,
    tier: &str,
    node: Option<&str>,
    counted: &CountedTiers,
) -> Result<Vec<Placed>, CatalogueError> {
    let mut out = Vec::new();
    for (v, rs) in every_version(catalogue).await? {
        let present = |r: &&ReplicaRecord| r.is_usable();
        let Some(here) = rs
            .iter()
            .filter(present)
            .find(|r| r.tier == tier && r.node.as_deref() == node)
        else {
            continue;
        };
        // A checkpoint's own copy (where its run wrote it, or retention put it) is
        // retention's to move, not the watermarks'; a restored copy is a stage's.
        if here.verified_by.as_deref() == Some(crate::CHECKPOINT_VERIFIED_BY) {
            continue;
        }
        out.push(Placed {
            project: here.project.clone(),
            dataset: here.dataset.clone(),
            version: v.version.clone(),
            prefix: here.prefix.clone(),
            files: here.files.max(v.file_count),
            bytes: here.total_bytes.max(v.total_bytes),
            made_at: here.copied.as_ref().or(here.stamp.as_ref()).map(|s| s.at),
            durable_elsewhere: rs
                .iter()
                .filter(present)
                .any(|r| r.node.is_none() && counted.durable.contains(&r.tier)),
            shared_elsewhere: rs.iter().filter(present).any(|r| {
                r.node.is_none()
                    && counted.kept.contains(&r.tier)
                    && (node.is_some() || r.tier != tier)
            }),
            verified_by: here.verified_by.clone(),
            last_verified: here.last_verified.as_ref().map(|v| v.stamp.at),
        });
    }
    Ok(out)
}

/// Every replica the catalogue lists on `tier` (on a node-local tier: `node`'s only; `None`:
/// the shared tier's), in every state, checkpoints' own copies included: what claims a folder
/// there (`stagehand audit`).
pub async fn replicas_on(
    catalogue: &Catalogue,
    tier: &str,
    node: Option<&str>,
) -> Result<Vec<ReplicaRecord>, CatalogueError> {
    Ok(every_version(catalogue)
        .await?
        .into_iter()
        .flat_map(|(_, rs)| rs)
        .filter(|r| r.tier == tier && r.node.as_deref() == node)
        .collect())
}

/// Every version of every dataset with its replicas, page by page.
async fn every_version(
    catalogue: &Catalogue,
) -> Result<Vec<(VersionRecord, Vec<ReplicaRecord>)>, CatalogueError> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = catalogue.datasets(None, None, after.as_deref()).await?;
        for d in &page.items {
            let detail = catalogue.dataset(Some(&d.project), &d.dataset).await?;
            let mut versions: Vec<VersionRecord> = detail.versions.clone();
            let mut replicas: BTreeMap<String, Vec<ReplicaRecord>> = BTreeMap::new();
            for r in detail.replicas {
                replicas.entry(r.version.clone()).or_default().push(r);
            }
            // Versions past the detail's first page, each with its replicas.
            let mut next = detail.versions_next.clone();
            while let Some(cursor) = next {
                let answer = catalogue
                    .ask(&Query::Versions {
                        project: Some(d.project.clone()),
                        dataset: d.dataset.clone(),
                        limit: None,
                        after: Some(cursor),
                    })
                    .await?;
                let crate::Answer::Versions {
                    versions: more,
                    next: n,
                } = answer
                else {
                    break;
                };
                for v in &more {
                    let vd = catalogue
                        .version(Some(&d.project), &d.dataset, &v.version)
                        .await?;
                    replicas.insert(v.version.clone(), vd.replicas);
                }
                versions.extend(more);
                next = n;
            }
            for v in versions {
                if let Some(rs) = replicas.remove(&v.version) {
                    out.push((v, rs));
                }
            }
        }
        match page.next {
            Some(n) => after = Some(n),
            None => return Ok(out),
        }
    }
}

/// Whether stage request `s` asks for the replica of `version` (full digest) on `tier` (and
/// `node`, on a node-local tier): its resolved version, else the prefix it asked for.
pub fn stages(s: &StageStatus, version: &str, tier: &str, node: Option<&str>) -> bool {
    let same_version = s
        .resolved_version
        .as_deref()
        .map_or(version.starts_with(&s.version), |v| v == version);
    s.tier == tier && s.node.as_deref() == node && same_version
}

/// The stage requests of one version on `tier` (and `node`, on a node-local tier): which jobs
/// hold it, and when it was last staged.
pub async fn holds(
    catalogue: &Catalogue,
    placed: &Placed,
    tier: &str,
    node: Option<&str>,
) -> Result<Holds, CatalogueError> {
    let mut holds = Holds::default();
    let now = OffsetDateTime::now_utc();
    let mut after: Option<String> = None;
    loop {
        let page = catalogue
            .stage_requests(
                &placed.project,
                None,
                Some(&placed.dataset),
                Some(&placed.version),
                after.as_deref(),
            )
            .await?;
        for s in &page.items {
            if !stages(s, &placed.version, tier, node) {
                continue;
            }
            if s.holds_at(now) {
                holds.live_jobs.push(s.job_id.clone());
            }
            holds.last_staged = holds.last_staged.max(Some(s.updated_at));
        }
        match page.next {
            Some(n) => after = Some(n),
            None => return Ok(holds),
        }
    }
}
