//! Checkpoint retention decisions: from a run's committed checkpoints and the `[checkpoints]`
//! policy of `retention.toml` to one decision per step — keep on hot, demote to a tier, or
//! expire — each carrying the rule that decided.
//!
//! This is a pure function so the demoter (which acts), `stagehand checkpoint list` (which
//! explains) and tests all agree on one answer. It knows nothing of where a checkpoint is now:
//! the demoter compares the decision with the catalogue's placement and moves what differs.
//!
//! The rules, for the distinct steps of one run ordered by step:
//! - the newest `hot_keep_last` steps stay on hot (rule `hot_keep_last`);
//! - other checkpoints that are among the newest `keep_last` (rule `keep_last`), carry a tag in
//!   `keep_tagged` (rule `tagged:<tag>`), or whose step is a multiple of `keep_every` (rule
//!   `keep_every`) are demoted to `demote_to`; the first rule in that order is the deciding one;
//! - every other checkpoint expires (rule `expired`).
//!
//! A validated policy has `1 <= hot_keep_last <= keep_last`. For a policy built by hand the
//! function clamps both up to 1 (and `keep_last` up to `hot_keep_last`), so the newest
//! checkpoint is always kept on hot: a run resumes from it.
//!
//! ```
//! use stagehand_policy::{CheckpointRetention, retention::{CommittedCheckpoint, Placement, decide}};
//! let policy = CheckpointRetention {
//!     keep_last: 2,
//!     keep_every: 100,
//!     keep_tagged: vec!["best".into()],
//!     hot_keep_last: 1,
//!     demote_to: "capacity".into(),
//! };
//! let run: Vec<_> = (1..=4).map(|i| CommittedCheckpoint::new(i * 50, &[])).collect();
//! let decisions = decide(&policy, &run);
//! let placements: Vec<_> = decisions.iter().map(|d| (d.step, d.rule.to_string())).collect();
//! assert_eq!(
//!     placements,
//!     [(50, "expired".into()), (100, "keep_every".into()), (150, "keep_last".into()), (200, "hot_keep_last".into())]
//! );
//! assert_eq!(decisions[1].placement, Placement::Demote { tier: "capacity".into() });
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::OffsetDateTime;

use crate::pipeline::CheckpointRetention;

/// One committed checkpoint of a run, as retention sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedCheckpoint {
    /// Training step; orders the run's checkpoints (the highest is the newest).
    pub step: u64,
    /// Tags given at commit (`best`, `release`, ...); only those in `keep_tagged` matter.
    pub tags: Vec<String>,
    /// When the commit was recorded. Two records of one step merge (their tags joined), and
    /// the merged decision carries the later time.
    pub committed_at: Option<OffsetDateTime>,
}

impl CommittedCheckpoint {
    /// A checkpoint at `step` with `tags`, committed at an unknown time.
    pub fn new(step: u64, tags: &[&str]) -> Self {
        CommittedCheckpoint {
            step,
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            committed_at: None,
        }
    }
}

/// Where retention wants a checkpoint to be.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "placement")]
pub enum Placement {
    /// Kept on the hot tier (where the run wrote it).
    Hot,
    /// Kept, moved to `tier` (the policy's `demote_to`) and removed from hot.
    Demote { tier: String },
    /// Removed from every tier.
    Expire,
}

impl Placement {
    /// Whether the checkpoint is kept somewhere.
    pub fn is_kept(&self) -> bool {
        !matches!(self, Placement::Expire)
    }
}

/// The rule behind a decision. Written as `hot_keep_last`, `keep_last`, `keep_every`,
/// `tagged:<tag>`, `expired` (the `rule` of `checkpoint.demoted`/`checkpoint.expired`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RetentionRule {
    /// Among the newest `hot_keep_last`: stays on hot.
    HotKeepLast,
    /// Among the newest `keep_last`.
    KeepLast,
    /// Carries this tag, listed in `keep_tagged`.
    Tagged(String),
    /// Its step is a multiple of `keep_every`.
    KeepEvery,
    /// No rule keeps it.
    Expired,
}

impl fmt::Display for RetentionRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetentionRule::HotKeepLast => f.write_str("hot_keep_last"),
            RetentionRule::KeepLast => f.write_str("keep_last"),
            RetentionRule::Tagged(tag) => write!(f, "tagged:{tag}"),
            RetentionRule::KeepEvery => f.write_str("keep_every"),
            RetentionRule::Expired => f.write_str("expired"),
        }
    }
}

/// A string that names no retention rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a retention rule (hot_keep_last, keep_last, keep_every, tagged:<tag>, expired)"
)]
pub struct UnknownRule(pub String);

impl FromStr for RetentionRule {
    type Err = UnknownRule;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "hot_keep_last" => RetentionRule::HotKeepLast,
            "keep_last" => RetentionRule::KeepLast,
            "keep_every" => RetentionRule::KeepEvery,
            "expired" => RetentionRule::Expired,
            _ => match s.strip_prefix("tagged:") {
                Some(tag) if !tag.is_empty() => RetentionRule::Tagged(tag.to_owned()),
                _ => return Err(UnknownRule(s.to_owned())),
            },
        })
    }
}

impl Serialize for RetentionRule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RetentionRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Retention's decision for one step of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionDecision {
    pub step: u64,
    pub placement: Placement,
    /// The rule that decided the placement.
    pub rule: RetentionRule,
    /// Every keep rule that holds for this step, deciding one first among them except for
    /// `hot_keep_last` (which places rather than keeps); empty when it expires. What
    /// `stagehand checkpoint list` shows as "why kept".
    pub kept_by: Vec<RetentionRule>,
    /// The latest commit time among the step's records.
    pub committed_at: Option<OffsetDateTime>,
}

/// Decides every distinct step of `checkpoints` (one run's committed checkpoints, any order,
/// duplicates allowed) under `policy`. The answer has exactly one decision per distinct step,
/// ordered by step.
pub fn decide(
    policy: &CheckpointRetention,
    checkpoints: &[CommittedCheckpoint],
) -> Vec<RetentionDecision> {
    // One record per step: tags joined (a tag once given keeps), the later commit time.
    let mut by_step: BTreeMap<u64, (Vec<&str>, Option<OffsetDateTime>)> = BTreeMap::new();
    for c in checkpoints {
        let entry = by_step.entry(c.step).or_default();
        for tag in &c.tags {
            if !entry.0.contains(&tag.as_str()) {
                entry.0.push(tag);
            }
        }
        entry.1 = entry.1.max(c.committed_at);
    }

    let hot_keep_last = policy.hot_keep_last.max(1) as usize;
    let keep_last = (policy.keep_last as usize).max(hot_keep_last);
    let count = by_step.len();
    by_step
        .into_iter()
        .enumerate()
        .map(|(index, (step, (tags, committed_at)))| {
            // 0 for the newest step.
            let age = count - 1 - index;
            let mut kept_by = Vec::new();
            if age < keep_last {
                kept_by.push(RetentionRule::KeepLast);
            }
            for wanted in &policy.keep_tagged {
                if tags.contains(&wanted.as_str()) {
                    kept_by.push(RetentionRule::Tagged(wanted.clone()));
                }
            }
            if policy.keep_every > 0 && step % policy.keep_every == 0 {
                kept_by.push(RetentionRule::KeepEvery);
            }
            let (placement, rule) = if age < hot_keep_last {
                (Placement::Hot, RetentionRule::HotKeepLast)
            } else if let Some(first) = kept_by.first() {
                (
                    Placement::Demote {
                        tier: policy.demote_to.clone(),
                    },
                    first.clone(),
                )
            } else {
                (Placement::Expire, RetentionRule::Expired)
            };
            RetentionDecision {
                step,
                placement,
                rule,
                kept_by,
                committed_at,
            }
        })
        .collect()
}

impl CheckpointRetention {
    /// [`decide`] under this policy.
    pub fn decide(&self, checkpoints: &[CommittedCheckpoint]) -> Vec<RetentionDecision> {
        decide(self, checkpoints)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn policy(keep_last: u32, keep_every: u64, hot_keep_last: u32) -> CheckpointRetention {
        CheckpointRetention {
            keep_last,
            keep_every,
            keep_tagged: vec!["keep".into(), "best".into(), "release".into()],
            hot_keep_last,
            demote_to: "capacity".into(),
        }
    }

    fn steps_where(decisions: &[RetentionDecision], f: impl Fn(&Placement) -> bool) -> Vec<u64> {
        decisions
            .iter()
            .filter(|d| f(&d.placement))
            .map(|d| d.step)
            .collect()
    }

    /// The issue's case: 120 committed checkpoints every 10 steps (10..=1200), keep_last 5,
    /// keep_every 50, tags on two. Kept: the newest five, the multiples of 50, the two tagged;
    /// on hot: the newest two.
    #[test]
    fn run_of_120_keeps_last_every_and_tagged() {
        let mut run: Vec<CommittedCheckpoint> = (1..=120u64)
            .map(|i| CommittedCheckpoint::new(i * 10, &[]))
            .collect();
        run[32].tags = vec!["best".into()]; // step 330
        run[76].tags = vec!["release".into(), "unrelated".into()]; // step 770
        let decisions = decide(&policy(5, 50, 2), &run);

        assert_eq!(decisions.len(), 120);
        let hot = steps_where(&decisions, |p| *p == Placement::Hot);
        assert_eq!(hot, [1190, 1200]);
        let demoted = steps_where(&decisions, |p| matches!(p, Placement::Demote { .. }));
        let mut expected: BTreeSet<u64> = (1..=23).map(|m| m * 50).collect(); // 50..=1150
        expected.extend([330, 770, 1160, 1170, 1180]);
        assert_eq!(demoted, expected.iter().copied().collect::<Vec<_>>());
        assert_eq!(demoted.len(), 28);
        let expired = steps_where(&decisions, |p| *p == Placement::Expire);
        assert_eq!(expired.len(), 120 - 2 - 28);

        let rule_of = |step: u64| {
            decisions
                .iter()
                .find(|d| d.step == step)
                .map(|d| d.rule.to_string())
                .expect("decided")
        };
        assert_eq!(rule_of(1200), "hot_keep_last");
        assert_eq!(rule_of(1190), "hot_keep_last");
        assert_eq!(rule_of(1180), "keep_last");
        assert_eq!(rule_of(1150), "keep_every");
        assert_eq!(rule_of(330), "tagged:best");
        assert_eq!(rule_of(770), "tagged:release");
        assert_eq!(rule_of(1000), "keep_every");
        assert_eq!(rule_of(10), "expired");
        assert_eq!(rule_of(1140), "expired");
        for d in &decisions {
            if let Placement::Demote { tier } = &d.placement {
                assert_eq!(tier, "capacity");
            }
        }
        // Step 1200 is a multiple of 50 and among the newest: every keep rule is listed.
        let newest = decisions.last().expect("decided");
        assert_eq!(
            newest.kept_by,
            [RetentionRule::KeepLast, RetentionRule::KeepEvery]
        );
    }

    #[test]
    fn keep_every_zero_keeps_none_that_way() {
        let run: Vec<_> = (1..=10u64)
            .map(|s| CommittedCheckpoint::new(s * 100, &[]))
            .collect();
        let decisions = decide(&policy(1, 0, 1), &run);
        assert_eq!(steps_where(&decisions, Placement::is_kept), [1000]);
    }

    /// A re-commit of a step with another tag is one decision, keeping by either record's tag.
    #[test]
    fn duplicate_steps_merge_their_tags() {
        let t1 = OffsetDateTime::from_unix_timestamp(1_000).expect("time");
        let t2 = OffsetDateTime::from_unix_timestamp(2_000).expect("time");
        let mut first = CommittedCheckpoint::new(3, &["best"]);
        first.committed_at = Some(t2);
        let mut again = CommittedCheckpoint::new(3, &[]);
        again.committed_at = Some(t1);
        let run = [
            first,
            CommittedCheckpoint::new(4, &[]),
            again,
            CommittedCheckpoint::new(5, &[]),
        ];
        let decisions = decide(&policy(1, 0, 1), &run);
        assert_eq!(decisions.len(), 3);
        assert_eq!(decisions[0].step, 3);
        assert_eq!(decisions[0].rule, RetentionRule::Tagged("best".into()));
        assert_eq!(decisions[0].committed_at, Some(t2));
        assert_eq!(decisions[1].placement, Placement::Expire);
    }

    /// A policy built by hand with hot_keep_last 0 still keeps the newest on hot.
    #[test]
    fn unvalidated_zero_policy_keeps_newest_on_hot() {
        let run = [
            CommittedCheckpoint::new(1, &[]),
            CommittedCheckpoint::new(2, &[]),
        ];
        let decisions = decide(&policy(0, 0, 0), &run);
        assert_eq!(decisions[1].placement, Placement::Hot);
        assert_eq!(decisions[0].placement, Placement::Expire);
    }

    #[test]
    fn empty_run_has_no_decisions() {
        assert!(decide(&policy(5, 50, 2), &[]).is_empty());
    }

    #[test]
    fn rules_round_trip_as_strings() {
        for rule in [
            RetentionRule::HotKeepLast,
            RetentionRule::KeepLast,
            RetentionRule::KeepEvery,
            RetentionRule::Tagged("best".into()),
            RetentionRule::Expired,
        ] {
            assert_eq!(rule.to_string().parse::<RetentionRule>(), Ok(rule));
        }
        assert_eq!(
            "tagged:".parse::<RetentionRule>(),
            Err(UnknownRule("tagged:".into()))
        );
        assert!("newest".parse::<RetentionRule>().is_err());
    }

    fn arb_run() -> impl Strategy<Value = Vec<CommittedCheckpoint>> {
        let tag = prop::sample::select(vec!["best", "keep", "release", "other"]);
        prop::collection::vec((0u64..400, prop::collection::vec(tag, 0..3)), 0..80).prop_map(|v| {
            v.into_iter()
                .map(|(step, tags)| CommittedCheckpoint::new(step, &tags))
                .collect()
        })
    }

    proptest! {
        /// Invariants: decisions are total (one per distinct step, in step order); the newest
        /// is kept on hot; hot is a subset of kept and at most hot_keep_last; exactly the
        /// newest keep_last are kept by keep_last; a decided rule is one of kept_by unless the
        /// placement is hot or expired; an expired step has no keep rule.
        #[test]
        fn retention_invariants(
            run in arb_run(),
            keep_last in 0u32..10,
            keep_every in 0u64..60,
            hot_keep_last in 0u32..10,
        ) {
            let p = policy(keep_last, keep_every, hot_keep_last);
            let decisions = decide(&p, &run);
            let distinct: BTreeSet<u64> = run.iter().map(|c| c.step).collect();
            let decided: Vec<u64> = decisions.iter().map(|d| d.step).collect();
            prop_assert_eq!(decided, distinct.iter().copied().collect::<Vec<_>>());

            if let Some(newest) = decisions.last() {
                prop_assert_eq!(&newest.placement, &Placement::Hot);
            }
            let hot = decisions.iter().filter(|d| d.placement == Placement::Hot).count();
            prop_assert!(hot <= (hot_keep_last.max(1) as usize));
            for d in &decisions {
                match &d.placement {
                    Placement::Hot => {
                        prop_assert_eq!(&d.rule, &RetentionRule::HotKeepLast);
                        prop_assert!(d.kept_by.contains(&RetentionRule::KeepLast));
                    }
                    Placement::Demote { tier } => {
                        prop_assert_eq!(tier, "capacity");
                        prop_assert_eq!(Some(&d.rule), d.kept_by.first());
                    }
                    Placement::Expire => {
                        prop_assert_eq!(&d.rule, &RetentionRule::Expired);
                        prop_assert!(d.kept_by.is_empty());
                    }
                }
            }
            let by_keep_last = decisions
                .iter()
                .filter(|d| d.kept_by.contains(&RetentionRule::KeepLast))
                .count();
            let wanted = (keep_last.max(hot_keep_last).max(1) as usize).min(distinct.len());
            prop_assert_eq!(by_keep_last, wanted);
            // A step is kept exactly when some keep rule holds for it.
            prop_assert!(decisions.iter().all(|d| d.placement.is_kept() != d.kept_by.is_empty()));
        }
    }
}
