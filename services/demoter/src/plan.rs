//! What to demote from one bounded tier, decided from what is placed on it, what holds it and
//! what the filesystem says: a pure function, so the order of the rules is tested without a
//! server.
//!
//! Usage counted against the watermarks is Stagehand's own bytes plus the part of its budget
//! the filesystem cannot give any more because others filled it: with `capacity` C, Stagehand's
//! bytes P and the filesystem's free bytes F, `counted = P + max(0, (C - P) - F)`. Removing X
//! bytes of a replica lowers `counted` by X whichever term is larger, so the demoter knows how
//! far a removal gets it before `statfs` sees it.

use std::time::Duration;

use stagehand_catalogue::survey::TierUsage;
use stagehand_policy::TierLimits;
use time::OffsetDateTime;

/// Why a replica leaves a tier: the reason `replica.removed` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// Not staged for `unstaged_replica_after` (`retention.toml`).
    Expired,
    /// Unheld and unused for `idle_after` (`demotion.toml`).
    Idle,
    /// The tier was above its high watermark; least recently staged first.
    Watermark,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Expired => "expired",
            Reason::Idle => "idle",
            Reason::Watermark => "watermark",
        }
    }

    /// The sentence `replica.removed` carries.
    pub fn describe(self, tier: &str, limits: &TierLimits, rules: &Rules) -> String {
        match self {
            Reason::Expired => format!(
                "expired: not staged on tier {tier} for {} (retention.toml unstaged_replica_after)",
                human(rules.expire_after.unwrap_or_default())
            ),
            Reason::Idle => format!(
                "idle: no live stage held it on tier {tier} for {} (demotion.toml idle_after)",
                human(rules.idle_after)
            ),
            Reason::Watermark => format!(
                "watermark: tier {tier} was above its high watermark ({:.0} % of {} bytes); least recently staged replicas demoted down to its low watermark ({:.0} %)",
                limits.high_watermark * 100.0,
                limits.capacity,
                limits.low_watermark * 100.0
            ),
        }
    }
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{} ms", d.as_millis()),
        s if s % 86_400 == 0 => format!("{} d", s / 86_400),
        s if s % 3_600 == 0 => format!("{} h", s / 3_600),
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// The time rules of a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    pub idle_after: Duration,
    /// `None` when `retention.toml` is absent: nothing expires.
    pub expire_after: Option<Duration>,
}

/// One replica on the tier, as the pass sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub project: String,
    pub bytes: u64,
    /// When it was last staged (or, never staged, when it was made).
    pub last_used: OffsetDateTime,
    /// A live stage (requested and not released) holds it.
    pub held: bool,
}

/// The replicas to demote, as indices into `candidates` in the order to demote them, each with
/// its reason. Held replicas are never chosen. Expired and idle ones are chosen whatever the
/// usage; then, when the tier is above its high watermark, the least recently staged (replicas
/// of projects over their quota first) until it is at its low watermark.
pub fn choose(
    usage: &TierUsage,
    limits: &TierLimits,
    candidates: &[Candidate],
    rules: &Rules,
    now: OffsetDateTime,
) -> Vec<(usize, Reason)> {
    let mut per_project: std::collections::BTreeMap<&str, u64> = Default::default();
    for c in candidates {
        *per_project.entry(c.project.as_str()).or_default() += c.bytes;
    }
    let over_quota = |project: &str| {
        limits
            .quota_for(project)
            .is_some_and(|q| per_project.get(project).copied().unwrap_or(0) > q)
    };
    let mut order: Vec<usize> = (0..candidates.len())
        .filter(|&i| !candidates[i].held)
        .collect();
    order.sort_by_key(|&i| {
        let c = &candidates[i];
        (!over_quota(&c.project), c.last_used, i)
    });
    let mut counted = usage.counted();
    let draining = counted > limits.high_watermark_bytes();
    let low = limits.low_watermark_bytes();
    let mut chosen = Vec::new();
    for i in order {
        let c = &candidates[i];
        let unused = now - c.last_used;
        let unused = Duration::try_from(unused).unwrap_or_default();
        let reason = if rules.expire_after.is_some_and(|e| unused >= e) {
            Reason::Expired
        } else if unused >= rules.idle_after {
            Reason::Idle
        } else if draining && counted > low {
            Reason::Watermark
        } else {
            continue;
        };
        counted = counted.saturating_sub(c.bytes);
        chosen.push((i, reason));
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_catalogue::survey::FsUsage;

    const MIB: u64 = 1 << 20;

    fn limits(quota: Option<u64>) -> TierLimits {
        TierLimits {
            capacity: 10 * MIB,
            high_watermark: 0.85,
            low_watermark: 0.5,
            default_quota: quota,
            quotas: Default::default(),
        }
    }

    fn rules() -> Rules {
        Rules {
            idle_after: Duration::from_secs(86_400),
            expire_after: Some(Duration::from_secs(30 * 86_400)),
        }
    }

    fn at(min: i64) -> OffsetDateTime {
        OffsetDateTime::UNIX_EPOCH + time::Duration::minutes(1_000_000 + min)
    }

    fn now() -> OffsetDateTime {
        at(100)
    }

    fn c(project: &str, mib: u64, min: i64, held: bool) -> Candidate {
        Candidate {
            project: project.into(),
            bytes: mib * MIB,
            last_used: at(min),
            held,
        }
    }

    fn usage(placed: u64, fs: Option<FsUsage>) -> TierUsage {
        TierUsage {
            capacity: 10 * MIB,
            placed,
            fs,
        }
    }

    #[test]
    fn above_high_drains_least_recently_staged_to_low_skipping_held() {
        let cands = [
            c("a", 2, 5, false),
            c("a", 2, 1, true),
            c("a", 2, 3, false),
            c("a", 2, 2, false),
            c("a", 2, 4, false),
        ];
        let chosen = choose(
            &usage(10 * MIB, None),
            &limits(None),
            &cands,
            &rules(),
            now(),
        );
        // 10 → 8 (used 2) → 6 (used 3) → 4 (used 4): at or below 5 MiB, stop.
        assert_eq!(
            chosen,
            vec![
                (3, Reason::Watermark),
                (2, Reason::Watermark),
                (4, Reason::Watermark)
            ]
        );
    }

    #[test]
    fn between_the_watermarks_nothing_moves_but_idle_and_expired_ones() {
        let cands = [
            c("a", 1, 50, false),
            c("a", 1, 100 - 24 * 60, false),
            c("a", 1, 100 - 31 * 24 * 60, false),
            c("a", 1, 100 - 40 * 24 * 60, true),
        ];
        let chosen = choose(
            &usage(8 * MIB, None),
            &limits(None),
            &cands,
            &rules(),
            now(),
        );
        assert_eq!(chosen, vec![(2, Reason::Expired), (1, Reason::Idle)]);
    }

    #[test]
    fn others_bytes_count_toward_the_watermark() {
        // Stagehand has 4 MiB placed (40 %), but the filesystem has only 1 MiB free: the
        // budget left that cannot be used counts (4 + (6 - 1) = 9 MiB, above 8.5).
        let u = usage(
            4 * MIB,
            Some(FsUsage {
                total: 100 * MIB,
                avail: MIB,
            }),
        );
        assert_eq!(u.counted(), 9 * MIB);
        assert_eq!(u.others(), 95 * MIB);
        let cands = [c("a", 2, 1, false), c("a", 2, 2, false)];
        let chosen = choose(&u, &limits(None), &cands, &rules(), now());
        // 9 → 7 → 5: both go.
        assert_eq!(chosen, vec![(0, Reason::Watermark), (1, Reason::Watermark)]);
        // A roomy filesystem adds nothing.
        let roomy = usage(
            4 * MIB,
            Some(FsUsage {
                total: 100 * MIB,
                avail: 50 * MIB,
            }),
        );
        assert_eq!(roomy.counted(), 4 * MIB);
    }

    #[test]
    fn a_project_over_its_quota_is_demoted_first() {
        let cands = [
            c("small", 2, 1, false),
            c("big", 3, 5, false),
            c("big", 3, 6, false),
            c("small", 2, 2, false),
        ];
        let chosen = choose(
            &usage(10 * MIB, None),
            &limits(Some(4 * MIB)),
            &cands,
            &rules(),
            now(),
        );
        // "big" holds 6 MiB over a 4 MiB quota: its replicas go first, oldest first.
        assert_eq!(chosen, vec![(1, Reason::Watermark), (2, Reason::Watermark)]);
    }
}
