//! `stagehand tier usage`: per bounded tier, its capacity, the bytes Stagehand placed there
//! (from the catalogue), the bytes others use on its filesystem (`statfs`), its watermarks,
//! the bytes live stages hold, and each project's share — the demoter's own survey
//! ([`stagehand_catalogue::survey::survey`]), so what it shows is what the demoter acts on.

use std::io::Write;

use serde::Serialize;
use stagehand_catalogue::Catalogue;
use stagehand_catalogue::survey::TierSurvey;
use stagehand_policy::Policies;

/// One tier's line of the report (also its `--json` form).
#[derive(Debug, Serialize)]
pub struct TierUsageRow {
    pub tier: String,
    pub role: &'static str,
    pub capacity: u64,
    pub used_by_stagehand: u64,
    /// Bytes on the tier's filesystem that are not Stagehand's replicas; absent when `statfs`
    /// could not tell (an S3 tier, or a root this machine cannot see).
    pub used_by_others: Option<u64>,
    /// Usage the demoter counts against the watermarks (Stagehand's bytes plus the budget others
    /// made unusable).
    pub counted: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub held: u64,
    pub replicas: usize,
    pub projects: Vec<ProjectUsage>,
}

#[derive(Debug, Serialize)]
pub struct ProjectUsage {
    pub project: String,
    pub used: u64,
    pub held: u64,
    pub quota: Option<u64>,
}

fn row(s: &TierSurvey) -> TierUsageRow {
    TierUsageRow {
        tier: s.tier.clone(),
        role: s.role.as_str(),
        capacity: s.limits.capacity,
        used_by_stagehand: s.usage.placed,
        used_by_others: s.usage.fs.map(|_| s.usage.others()),
        counted: s.usage.counted(),
        high_watermark: s.limits.high_watermark,
        low_watermark: s.limits.low_watermark,
        held: s.held_bytes(),
        replicas: s.replicas.len(),
        projects: s
            .per_project()
            .into_iter()
            .map(|(project, (used, held))| ProjectUsage {
                quota: s.limits.quota_for(&project),
                project,
                used,
                held,
            })
            .collect(),
    }
}

pub(crate) fn size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Prints the usage of every bounded tier (or of `only`).
pub async fn usage(
    catalogue: &Catalogue,
    policies: &Policies,
    only: Option<&str>,
    json: bool,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    if let Some(name) = only
        && !policies.tiers().contains_key(name)
    {
        anyhow::bail!("no tier {name:?} in the policies");
    }
    let mut rows = Vec::new();
    for tier in policies.tiers().values() {
        if only.is_some_and(|n| n != tier.name) {
            continue;
        }
        if let Some(s) = stagehand_catalogue::survey::survey(catalogue, policies, tier).await? {
            rows.push(row(&s));
        }
    }
    if json {
        serde_json::to_writer_pretty(&mut *out, &rows)?;
        writeln!(out)?;
        return Ok(());
    }
    for r in &rows {
        let pct = |b: u64| 100.0 * b as f64 / r.capacity.max(1) as f64;
        writeln!(
            out,
            "{} ({}): capacity {}, used by Stagehand {} ({:.1} %), used by others {}, counted {} ({:.1} %), watermarks {:.0} % / {:.0} %, held {} in {} replicas",
            r.tier,
            r.role,
            size(r.capacity),
            size(r.used_by_stagehand),
            pct(r.used_by_stagehand),
            r.used_by_others.map_or("unknown".into(), size),
            size(r.counted),
            pct(r.counted),
            r.high_watermark * 100.0,
            r.low_watermark * 100.0,
            size(r.held),
            r.replicas,
        )?;
        for p in &r.projects {
            writeln!(
                out,
                "  {}: {} used, {} held, quota {}",
                p.project,
                size(p.used),
                size(p.held),
                p.quota.map_or("none".into(), size)
            )?;
        }
    }
    Ok(())
}
