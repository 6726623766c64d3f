//! `stagehand tier usage`: per bounded tier, its capacity, the bytes Stagehand placed there
//! (from the catalogue), the bytes others use on its filesystem (`statfs`), its watermarks,
//! the bytes live stages hold, and each project's share — the demoter's own survey
//! ([`stagehand_catalogue::survey::survey`]), so what it shows is what the demoter acts on.
//! `stagehand tier pool` writes each tier's capacity and free space as the pools Slurm's burst
//! buffer stages jobs against ([`pools`], [`write_slurm_pools`]); free is what the promoter
//! would still reserve, its own rule ([`Reservations::free`]), not merely what is not held,
//! and never more than the tier's filesystem can still take where this host can measure it
//! ([`stagehand_mover::PosixTier::available_bytes`], what the promoter admits a copy by too).

use std::collections::BTreeSet;
use std::io::Write;

use async_nats::jetstream::kv;
use serde::Serialize;
use stagehand_bus::placement::{self, Reservations};
use stagehand_catalogue::Catalogue;
use stagehand_catalogue::survey::TierSurvey;
use stagehand_mover::PosixTier;
use stagehand_policy::{Policies, TierKind, TierLimits, TierPolicy};

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

/// A tier as a scheduler's pool: its capacity, the bytes live stages hold on it
/// ([`TierUsageRow`]'s `held`), the bytes reserved on it in the promoter's bucket, what its
/// filesystem can still take, and what a new stage may still take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pool {
    pub tier: String,
    pub capacity: u64,
    pub held: u64,
    /// Every replica reserved on the tier, held by a live stage or not: what the promoter
    /// counts (an unheld replica stays until the demoter removes it, above the high watermark).
    pub reserved: u64,
    /// What the filesystem under the tier's root can still take, as this host measures it
    /// ([`PosixTier::available_bytes`]: others' files on a shared filesystem count). `None`
    /// when this host cannot tell: an S3 tier, a root it cannot open (the Slurm controller
    /// need not mount the tier), a filesystem that reports no size.
    pub fs_available: Option<u64>,
    /// What a new stage may still take: what the promoter would reserve for a new copy now
    /// ([`Reservations::free`]: the capacity less everything reserved, not only what live
    /// stages hold), and no more than `fs_available` when it is known.
    pub free: u64,
    /// The quota of every project the policies name none for (`[tiers.<t>.quotas] default`).
    pub default_quota: Option<u64>,
    /// Each project with a quota of its own, or with bytes reserved under the default: what
    /// the promoter admits a project's copy by before the tier's room ([`ProjectQuota`]).
    pub quotas: Vec<ProjectQuota>,
}

/// A project's share of a pool: its quota on the tier and the bytes reserved there for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProjectQuota {
    pub project: String,
    pub quota: u64,
    pub reserved: u64,
}

impl Pool {
    fn new(
        tier: String,
        capacity: u64,
        held: u64,
        reservations: &Reservations,
        fs_available: Option<u64>,
    ) -> Pool {
        let by_policy = reservations.free(capacity);
        Pool {
            tier,
            capacity,
            held,
            reserved: reservations.total(),
            fs_available,
            free: fs_available.map_or(by_policy, |fs| by_policy.min(fs)),
            default_quota: None,
            quotas: Vec::new(),
        }
    }

    /// The pool with its projects' quotas (`limits`) and what each has reserved
    /// (`reservations`, keyed `<project>/...`), as the promoter's quota check counts them.
    fn with_quotas(mut self, limits: &TierLimits, reservations: &Reservations) -> Pool {
        let mut projects: BTreeSet<&str> = limits.quotas.keys().map(String::as_str).collect();
        if limits.default_quota.is_some() {
            projects.extend(reservations.projects());
        }
        self.default_quota = limits.default_quota;
        self.quotas = projects
            .into_iter()
            .filter_map(|project| {
                Some(ProjectQuota {
                    project: project.to_owned(),
                    quota: limits.quota_for(project)?,
                    reserved: reservations.used_by(project),
                })
            })
            .collect();
        self
    }
}

/// What the filesystem under a posix tier's root can still take, measured here; `None` when
/// this host cannot tell ([`Pool::fs_available`]). A root that does not open is a tier this
/// host does not mount, which is no error: its pool keeps the promoter's figure alone.
fn fs_available(tier: &TierPolicy) -> Option<u64> {
    let TierKind::Posix { root } = &tier.kind else {
        return None;
    };
    let posix = PosixTier::open(&tier.name, root).ok()?;
    match posix.available_bytes() {
        Ok(available) => available,
        Err(e) => {
            tracing::warn!(tier = %tier.name, error = %e, "the tier's filesystem could not be measured; its pool is the promoter's figure alone");
            None
        }
    }
}

/// The pools of `tiers`, each a bounded shared tier of the policies: capacity and held from
/// the demoter's survey, reserved from the promoter's reservations in `promoter` (the
/// [`stagehand_bus::PROMOTER_BUCKET`] bucket), the filesystem's room from `statvfs` of a
/// posix tier's root where this host has it, and free from both.
pub async fn pools(
    catalogue: &Catalogue,
    promoter: &kv::Store,
    policies: &Policies,
    tiers: &[String],
) -> anyhow::Result<Vec<Pool>> {
    let mut pools = Vec::new();
    for name in tiers {
        let tier = policies
            .tiers()
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("no tier {name:?} in the policies"))?;
        let s = stagehand_catalogue::survey::survey(catalogue, policies, tier)
            .await?
            .ok_or_else(|| anyhow::anyhow!("tier {name:?} has no capacity to report as a pool"))?;
        let reserved = placement::reservations(promoter, name, None)
            .await
            .map_err(|e| anyhow::anyhow!("reading tier {name:?}'s reservations: {e}"))?;
        let row = row(&s);
        let reserved = reserved.value.unwrap_or_default();
        pools.push(
            Pool::new(
                row.tier,
                row.capacity,
                row.held,
                &reserved,
                fs_available(tier),
            )
            .with_quotas(&s.limits, &reserved),
        );
    }
    Ok(pools)
}

/// The pool file `burst_buffer.lua`'s `slurm_bb_pools` reads (`stagehand_slurm.read_pool_file`):
/// `written <unix seconds>`; per tier one `pool <tier> <capacity> <free>` line, in bytes
/// ([`Pool::free`], the filesystem's cap included), then its quotas, from which the hook
/// reports each project's own pool `<tier>.<project>`: `quota-default <tier> <bytes>` and one
/// `quota <tier> <project> <quota> <reserved>` line per [`ProjectQuota`].
pub fn slurm_pool_text(pools: &[Pool], written: time::OffsetDateTime) -> String {
    let mut text = String::from(
        "# Stagehand's tiers as Slurm burst-buffer pools, written by `stagehand tier pool`.\n",
    );
    text.push_str(&format!("written {}\n", written.unix_timestamp()));
    for p in pools {
        text.push_str(&format!("pool {} {} {}\n", p.tier, p.capacity, p.free));
        if let Some(default) = p.default_quota {
            text.push_str(&format!("quota-default {} {default}\n", p.tier));
        }
        for q in &p.quotas {
            text.push_str(&format!(
                "quota {} {} {} {}\n",
                p.tier, q.project, q.quota, q.reserved
            ));
        }
    }
    text
}

/// Writes [`slurm_pool_text`] to `path` whole: a temporary file beside it, readable by all
/// (slurmctld reads it as SlurmUser), renamed over it, so the hook never reads half a file.
pub fn write_slurm_pools(
    path: &std::path::Path,
    pools: &[Pool],
    written: time::OffsetDateTime,
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::fs::PermissionsExt;

    let name = path
        .file_name()
        .ok_or_else(|| anyhow::anyhow!("--slurm {}: not a file name", path.display()))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, slurm_pool_text(pools, written))
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
        .with_context(|| format!("making {} readable", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_file_says_when_it_was_written_and_each_tier_s_free_bytes() {
        let mut reserved = Reservations::default();
        reserved.replicas.insert("lab/held/v1".into(), 40_960);
        reserved.replicas.insert("lab/unheld/v1".into(), 10_240);
        // Only the first is held, but the promoter counts both: so does the pool.
        let hot = Pool::new("hot".into(), 65_536, 40_960, &reserved, None);
        assert_eq!((hot.reserved, hot.free), (51_200, 14_336));
        // More reserved than the capacity (a tier over its bound) leaves nothing free.
        let warm = Pool::new("warm".into(), 50_000, 0, &reserved, None);
        // Others filled the filesystem: it takes 9 000 bytes more, less than the policy's room.
        let cold = Pool::new("cold".into(), 65_536, 0, &reserved, Some(9_000));
        let written = time::OffsetDateTime::from_unix_timestamp(1_764_700_000).unwrap();
        let text = slurm_pool_text(&[hot, warm, cold], written);
        assert!(text.contains("\nwritten 1764700000\n"), "{text}");
        assert!(
            text.ends_with("\npool hot 65536 14336\npool warm 50000 0\npool cold 65536 9000\n"),
            "{text}"
        );
    }

    /// Each project with a quota of its own, or reserving under the default, is written with
    /// its quota and what it has reserved: the hook's per-project pools.
    #[test]
    fn the_pool_file_gives_each_project_s_quota_and_what_it_reserved() {
        let mut reserved = Reservations::default();
        reserved.replicas.insert("lab/a/v1".into(), 10_240);
        reserved.replicas.insert("lab/b/v1".into(), 2_048);
        reserved.replicas.insert("vision/c/v1".into(), 4_096);
        let limits = TierLimits {
            capacity: 65_536,
            high_watermark: 0.9,
            low_watermark: 0.8,
            default_quota: Some(32_768),
            quotas: [("lab".to_owned(), 16_384), ("idle".to_owned(), 8_192)].into(),
        };
        let hot =
            Pool::new("hot".into(), 65_536, 0, &reserved, None).with_quotas(&limits, &reserved);
        let written = time::OffsetDateTime::from_unix_timestamp(1_764_700_000).unwrap();
        let text = slurm_pool_text(&[hot], written);
        assert!(
            text.ends_with(
                "\npool hot 65536 49152\nquota-default hot 32768\nquota hot idle 8192 0\n\
                 quota hot lab 16384 12288\nquota hot vision 32768 4096\n"
            ),
            "{text}"
        );
        // Without a default, only the projects named have a quota.
        let named = TierLimits {
            default_quota: None,
            ..limits
        };
        let hot =
            Pool::new("hot".into(), 65_536, 0, &reserved, None).with_quotas(&named, &reserved);
        let projects: Vec<&str> = hot.quotas.iter().map(|q| q.project.as_str()).collect();
        assert_eq!(projects, ["idle", "lab"]);
        assert!(!slurm_pool_text(&[hot], written).contains("quota-default"));
    }

    /// Free is the smaller of the promoter's room and the filesystem's; a filesystem this host
    /// cannot measure leaves the promoter's.
    #[test]
    fn a_pool_s_free_space_is_capped_by_its_filesystem() {
        let mut reserved = Reservations::default();
        reserved.replicas.insert("lab/a/v1".into(), 1_000);
        let pool = |fs| Pool::new("hot".into(), 1 << 60, 0, &reserved, fs).free;
        assert_eq!(pool(Some(5_000)), 5_000);
        assert_eq!(pool(Some(0)), 0);
        assert_eq!(pool(None), (1 << 60) - 1_000);
        let small = Pool::new("hot".into(), 3_000, 0, &reserved, Some(5_000));
        assert_eq!((small.fs_available, small.free), (Some(5_000), 2_000));
    }
}
