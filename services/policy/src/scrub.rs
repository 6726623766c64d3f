//! `scrub.toml`: how often every replica on each tier is read back whole and hashed against
//! the catalogue's SHA-256, and the I/O budget the scrub keeps to while it does so.
//!
//! A tier the file does not name is not scrubbed; a named tier must be declared in
//! `tiers.toml`. The budget is shared by everything one scrubbing process reads. Its optional
//! `[audit]` table says how `stagehand audit` treats stray data ([`AuditPolicy`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use stagehand_config::{ByteSize, duration, parse_duration};

use crate::error::{PolicyError, Source};
use crate::tiers::Tiers;

/// How often a scrub looks for replicas that are due when `scrub.toml` sets no `check_every`.
pub const DEFAULT_SCRUB_CHECK_EVERY: Duration = Duration::from_secs(600);

/// `scrub.toml` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    period: BTreeMap<String, String>,
    budget: ScrubBudget,
    #[serde(default, with = "duration::option")]
    check_every: Option<Duration>,
    #[serde(default)]
    audit: Option<RawAudit>,
}

/// `[audit]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAudit {
    #[serde(default)]
    quarantine_after: Option<String>,
    #[serde(default)]
    stop_above_fraction: Option<f64>,
}

/// How long a folder stays stray before `stagehand audit` quarantines it when `scrub.toml`
/// sets no `[audit] quarantine_after`.
pub const DEFAULT_QUARANTINE_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

/// The share of a tier's catalogued bytes above which stray data stops the audit when
/// `scrub.toml` sets no `[audit] stop_above_fraction`.
pub const DEFAULT_STOP_ABOVE_FRACTION: f64 = 0.2;

/// `[audit]`: what `stagehand audit` does with stray data (folders under a tier's root that no
/// replica claims and no copy in flight explains).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AuditPolicy {
    /// How long a folder must have been stray (untouched since) before the audit renames it
    /// into the tier's quarantine folder; never deleted.
    pub quarantine_after: Duration,
    /// Stray or lost bytes above this share of the tier's catalogued bytes stop the audit: it
    /// announces nothing lost, quarantines nothing and asks for a person (so much stray data
    /// is more likely a catalogue that lost track than garbage, and so much lost data a tier
    /// not mounted or audited from the wrong node). Within `[0, 1]`.
    pub stop_above_fraction: f64,
}

impl Default for AuditPolicy {
    fn default() -> Self {
        AuditPolicy {
            quarantine_after: DEFAULT_QUARANTINE_AFTER,
            stop_above_fraction: DEFAULT_STOP_ABOVE_FRACTION,
        }
    }
}

/// `scrub.toml`: per tier, the longest a replica may go without being re-read and hashed.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrubPolicy {
    /// Tier name → period: every byte of every replica on the tier is verified at least once
    /// within it. Tiers not listed are not scrubbed.
    pub period: BTreeMap<String, Duration>,
    pub budget: ScrubBudget,
    /// How often the scrub looks for replicas that are due.
    pub check_every: Duration,
    /// How `stagehand audit` treats stray data (the defaults when `[audit]` is absent).
    pub audit: AuditPolicy,
}

/// What one scrubbing process may read, at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubBudget {
    /// Bytes read per second, a size (`"200 MiB"`); more than 0.
    pub bytes_per_second: ByteSize,
    /// Files opened per second; more than 0.
    pub files_per_second: u64,
    /// Files of one replica read and hashed at once, each holding its own slot of the mover;
    /// 1 to [`MAX_SCRUB_PARALLEL_FILES`] (default [`DEFAULT_SCRUB_PARALLEL_FILES`]).
    #[serde(default = "default_parallel_files")]
    pub parallel_files: u32,
}

/// Files of one replica the scrub reads at once when `scrub.toml` sets no
/// `[budget] parallel_files`: enough to keep every core of a small node hashing while one file
/// waits on the disk.
pub const DEFAULT_SCRUB_PARALLEL_FILES: u32 = 4;

/// The most files of one replica the scrub may read at once: each holds one of the mover's
/// slots and a blocking thread while it reads, which a background duty must not take by the
/// hundred.
pub const MAX_SCRUB_PARALLEL_FILES: u32 = 64;

fn default_parallel_files() -> u32 {
    DEFAULT_SCRUB_PARALLEL_FILES
}

impl ScrubPolicy {
    /// The period of `tier`, when it is scrubbed.
    pub fn period_of(&self, tier: &str) -> Option<Duration> {
        self.period.get(tier).copied()
    }
}

pub(crate) fn parse_scrub(src: &Source<'_>, tiers: &Tiers) -> Result<ScrubPolicy, PolicyError> {
    let raw: Raw = src.parse()?;
    let mut period = BTreeMap::new();
    for (tier, text) in raw.period {
        let key = format!("period.{tier}");
        if tiers.get(&tier).is_none() {
            return Err(src.invalid(
                key,
                format!("names tier {tier:?}, which tiers.toml does not declare"),
            ));
        }
        let d = parse_duration(&text).map_err(|e| src.invalid(&key, e.to_string()))?;
        if d.is_zero() {
            return Err(src.invalid(key, "must be longer than 0"));
        }
        period.insert(tier, d);
    }
    if raw.budget.bytes_per_second.bytes() == 0 {
        return Err(src.invalid("budget.bytes_per_second", "must be more than 0"));
    }
    if raw.budget.files_per_second == 0 {
        return Err(src.invalid("budget.files_per_second", "must be more than 0"));
    }
    if !(1..=MAX_SCRUB_PARALLEL_FILES).contains(&raw.budget.parallel_files) {
        return Err(src.invalid(
            "budget.parallel_files",
            format!("must be 1 to {MAX_SCRUB_PARALLEL_FILES}"),
        ));
    }
    let check_every = raw.check_every.unwrap_or(DEFAULT_SCRUB_CHECK_EVERY);
    if check_every.is_zero() {
        return Err(src.invalid("check_every", "must be longer than 0"));
    }
    let audit = parse_audit(src, raw.audit)?;
    Ok(ScrubPolicy {
        period,
        budget: raw.budget,
        check_every,
        audit,
    })
}

fn parse_audit(src: &Source<'_>, raw: Option<RawAudit>) -> Result<AuditPolicy, PolicyError> {
    let mut audit = AuditPolicy::default();
    let Some(raw) = raw else {
        return Ok(audit);
    };
    if let Some(text) = raw.quarantine_after {
        audit.quarantine_after = parse_duration(&text)
            .map_err(|e| src.invalid("audit.quarantine_after", e.to_string()))?;
    }
    if let Some(f) = raw.stop_above_fraction {
        if !(0.0..=1.0).contains(&f) {
            return Err(src.invalid(
                "audit.stop_above_fraction",
                format!("{f} is not a share of a tier: 0 to 1 (0.2 is 20 %)"),
            ));
        }
        audit.stop_above_fraction = f;
    }
    Ok(audit)
}
