//! `stagehand scrub status [--json]`: per tier `scrub.toml` names, how much of what the
//! catalogue lists there a scrub verified within the tier's period (coverage), the rate that
//! took, the copy longest without a verification, the copies repaired within the period, and
//! the damaged copies. It exits 1 while a
//! copy is damaged and not repaired (the catalogue's `damaged` state: a repair makes the copy
//! present again).

use std::io::Write;
use std::time::Duration;

use serde::Serialize;
use stagehand_catalogue::time::human;
use stagehand_catalogue::{Catalogue, ReplicaRecord};
use stagehand_policy::Policies;
use time::OffsetDateTime;

use crate::tier::size;

/// Damaged copies listed per tier (the count says how many there are).
const LISTED: u32 = 20;

/// One tier's report (also its `--json` form).
#[derive(Debug, Serialize)]
pub struct ScrubRow {
    pub tier: String,
    /// `scrub.toml`'s period for the tier, in seconds.
    pub period_seconds: u64,
    /// Copies present or damaged on the tier, and their bytes.
    pub replicas: u64,
    pub bytes: u64,
    /// Bytes of present copies a scrub verified within the period.
    pub verified_bytes: u64,
    pub verified_replicas: u64,
    /// `verified_bytes / bytes` (1 for an empty tier).
    pub coverage: f64,
    /// Bytes verified within the period, per second of the period.
    pub rate_bytes_per_second: f64,
    /// The present copy longest without a verification: `project/dataset@version` (`@node`).
    pub oldest_unverified: Option<OldestCopy>,
    /// Copies found damaged and repaired within the period.
    pub repaired_within_period: u64,
    /// Copies damaged and not repaired.
    pub damaged_total: u64,
    pub damaged: Vec<DamagedCopy>,
}

#[derive(Debug, Serialize)]
pub struct OldestCopy {
    pub replica: String,
    /// Its last verification by a scrub, if any.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_verified: Option<OffsetDateTime>,
}

#[derive(Debug, Serialize)]
pub struct DamagedCopy {
    pub replica: String,
    /// What was found and what happens next.
    pub reason: Option<String>,
}

fn name(r: &ReplicaRecord) -> String {
    let node = r
        .node
        .as_deref()
        .map(|n| format!(" on {n}"))
        .unwrap_or_default();
    format!(
        "{}/{}@{}{node}",
        r.project,
        r.dataset,
        &r.version[..12.min(r.version.len())]
    )
}

/// The report of every scrubbed tier; `Ok(true)` when a copy is damaged and not repaired.
pub async fn status(
    catalogue: &Catalogue,
    policies: &Policies,
    json: bool,
    out: &mut impl Write,
) -> anyhow::Result<bool> {
    let Some(policy) = policies.scrub() else {
        anyhow::bail!(
            "{}: absent, so nothing is scrubbed (policies/scrub.toml shows one)",
            policies.dir().join("scrub.toml").display()
        );
    };
    let now = OffsetDateTime::now_utc();
    let mut rows = Vec::new();
    for (tier, period) in &policy.period {
        let since = now - time::Duration::try_from(*period).unwrap_or(time::Duration::MAX);
        let s = catalogue.scrub_status(tier, since, Some(LISTED)).await?;
        rows.push(row(s, *period));
    }
    let damage = rows.iter().any(|r| r.damaged_total > 0);
    if json {
        serde_json::to_writer_pretty(&mut *out, &rows)?;
        writeln!(out)?;
        return Ok(damage);
    }
    for r in &rows {
        writeln!(
            out,
            "{}: every {}, coverage {:.1} % ({} of {} in {} of {} copies verified within it), rate {}/s, {} repaired within it, {} damaged",
            r.tier,
            stagehand_config::format_duration(Duration::from_secs(r.period_seconds)),
            100.0 * r.coverage,
            size(r.verified_bytes),
            size(r.bytes),
            r.verified_replicas,
            r.replicas,
            size(r.rate_bytes_per_second as u64),
            r.repaired_within_period,
            r.damaged_total,
        )?;
        if let Some(o) = &r.oldest_unverified {
            let when = o
                .last_verified
                .map_or("never verified by a scrub".to_owned(), |t| {
                    format!("last verified {}", human(t))
                });
            writeln!(out, "  oldest: {} ({when})", o.replica)?;
        }
        for d in &r.damaged {
            writeln!(
                out,
                "  damaged: {}: {}",
                d.replica,
                d.reason.as_deref().unwrap_or("no reason recorded")
            )?;
        }
        if r.damaged_total > r.damaged.len() as u64 {
            writeln!(
                out,
                "  and {} more damaged",
                r.damaged_total - r.damaged.len() as u64
            )?;
        }
    }
    Ok(damage)
}

fn row(s: stagehand_catalogue::TierScrub, period: Duration) -> ScrubRow {
    let coverage = if s.bytes == 0 {
        1.0
    } else {
        s.verified_bytes as f64 / s.bytes as f64
    };
    ScrubRow {
        period_seconds: period.as_secs(),
        replicas: s.replicas,
        bytes: s.bytes,
        verified_bytes: s.verified_bytes,
        verified_replicas: s.verified_replicas,
        coverage,
        rate_bytes_per_second: s.verified_bytes as f64 / period.as_secs_f64().max(1.0),
        oldest_unverified: s.oldest.as_ref().map(|r| OldestCopy {
            replica: name(r),
            last_verified: r.last_verified.as_ref().map(|v| v.stamp.at),
        }),
        repaired_within_period: s.repaired_replicas,
        damaged_total: s.damaged_total,
        damaged: s
            .damaged
            .iter()
            .map(|r| DamagedCopy {
                replica: name(r),
                reason: r.reason.clone(),
            })
            .collect(),
        tier: s.tier,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards the exit status of `scrub status` and its coverage: a tier with a damaged copy
    /// reports it (and `status` would exit 1), coverage is the verified share of the bytes.
    #[test]
    fn coverage_is_the_verified_share_and_damage_is_counted() {
        let s = stagehand_catalogue::TierScrub {
            tier: "capacity".into(),
            replicas: 4,
            bytes: 400,
            verified_replicas: 1,
            verified_bytes: 100,
            oldest: None,
            damaged: vec![],
            damaged_total: 1,
            repaired_replicas: 0,
        };
        let r = row(s, Duration::from_secs(100));
        assert!((r.coverage - 0.25).abs() < 1e-9);
        assert!((r.rate_bytes_per_second - 1.0).abs() < 1e-9);
        assert_eq!(r.damaged_total, 1);
    }
}
