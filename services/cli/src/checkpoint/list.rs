//! `list`: a run's checkpoints from the catalogue, with what retention decides for each now.

use std::io::Write;
use std::time::Duration;

use stagehand_catalogue::{
    Catalogue, CheckpointPartRecord, CheckpointRecord, CheckpointState, StepParts,
};
use stagehand_policy::retention::{CommittedCheckpoint, Placement, RetentionDecision};
use stagehand_schemas::Retryable;

use crate::cli::Connection;

use super::args::{ListArgs, check_project, check_run, default_policies};
use super::commit::unavailable_or_other;
use super::{CheckpointError, usage};

/// One line of `checkpoint list`: the catalogue's record and what retention decides now.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ListedCheckpoint {
    pub step: u64,
    pub tags: Vec<String>,
    pub state: ListedState,
    pub tiers: Vec<String>,
    /// The rule of the latest demotion or expiry carried out.
    pub rule: Option<String>,
    /// What retention decides for it now (`None` without `retention.toml`, or once expired).
    pub retention: Option<Decision>,
    pub total_bytes: u64,
    /// A demotion or expiry the demoter left undone, and why (the folder is whole).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<stagehand_catalogue::CheckpointHold>,
    /// A step committed in parts on node-local tiers and not committed whole yet: its parts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<StepOffload>,
}

/// The state `list` shows: the catalogue's, or for a step committed in parts and not whole
/// yet, whether any of it is still on node NVMe only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ListedState {
    Committed,
    Demoted,
    Expired,
    /// Parts still on node NVMe only: not the run's latest; lost with a node.
    AtRisk,
    /// At risk past `[offload] deadline`: a failure someone must look at.
    OffloadLate,
    /// Every part offloaded; the step's commit is on its way (not the latest yet).
    Offloaded,
}

impl From<CheckpointState> for ListedState {
    fn from(s: CheckpointState) -> Self {
        match s {
            CheckpointState::Committed => ListedState::Committed,
            CheckpointState::Demoted => ListedState::Demoted,
            CheckpointState::Expired => ListedState::Expired,
        }
    }
}

/// Where a step committed in parts stands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StepOffload {
    pub parts: u32,
    pub offloaded: u32,
    /// The parts on node NVMe only, with their nodes ("?" for a part never committed).
    pub on_node: Vec<PartOnNode>,
    /// Bytes of those parts.
    pub bytes_on_node: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PartOnNode {
    pub part: u32,
    pub node: String,
}

/// The lines of the steps of `parts` not committed whole: at risk, late past `deadline`
/// (from the oldest part still on its node), or offloaded and about to be committed.
fn incomplete(
    parts: &[CheckpointPartRecord],
    deadline: Option<Duration>,
    now: time::OffsetDateTime,
) -> Vec<ListedCheckpoint> {
    StepParts::of(parts)
        .into_iter()
        .map(|step| {
            let state = if step.complete() {
                ListedState::Offloaded
            } else if deadline.is_some_and(|d| step.late(d, now)) {
                ListedState::OffloadLate
            } else {
                ListedState::AtRisk
            };
            let mut tags: Vec<String> = parts
                .iter()
                .filter(|p| p.step == step.step)
                .flat_map(|p| p.tags.clone())
                .collect();
            tags.sort();
            tags.dedup();
            let tiers: Vec<String> = parts
                .iter()
                .filter(|p| p.step == step.step)
                .map(|p| p.location.tier.clone())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            ListedCheckpoint {
                step: step.step,
                tags,
                state,
                tiers,
                rule: None,
                retention: None,
                total_bytes: parts
                    .iter()
                    .filter(|p| p.step == step.step)
                    .map(|p| p.total_bytes)
                    .sum(),
                held: None,
                offload: Some(StepOffload {
                    parts: step.parts,
                    offloaded: step.offloaded,
                    on_node: step
                        .on_node
                        .iter()
                        .map(|(part, node)| PartOnNode {
                            part: *part,
                            node: node.clone(),
                        })
                        .collect(),
                    bytes_on_node: step.bytes_on_node,
                }),
            }
        })
        .collect()
}

/// Retention's decision, as listed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Decision {
    /// `hot`, `demote`, `expire`.
    pub placement: &'static str,
    /// The tier a demotion goes to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    pub rule: String,
    /// Every keep rule that holds.
    pub kept_by: Vec<String>,
}

impl From<&RetentionDecision> for Decision {
    fn from(d: &RetentionDecision) -> Self {
        let (placement, tier) = match &d.placement {
            Placement::Hot => ("hot", None),
            Placement::Demote { tier } => ("demote", Some(tier.clone())),
            Placement::Expire => ("expire", None),
        };
        Decision {
            placement,
            tier,
            rule: d.rule.to_string(),
            kept_by: d.kept_by.iter().map(ToString::to_string).collect(),
        }
    }
}

/// Joins the catalogue's records of a run with retention's decisions over its live ones.
pub fn listing(
    records: &[CheckpointRecord],
    retention: Option<&stagehand_policy::CheckpointRetention>,
) -> Vec<ListedCheckpoint> {
    let live: Vec<CommittedCheckpoint> = records
        .iter()
        .filter(|r| r.state != CheckpointState::Expired)
        .map(|r| CommittedCheckpoint {
            step: r.step,
            tags: r.tags.clone(),
            committed_at: r.committed.as_ref().map(|s| s.at),
        })
        .collect();
    let decisions = retention.map(|p| p.decide(&live)).unwrap_or_default();
    records
        .iter()
        .map(|r| ListedCheckpoint {
            step: r.step,
            tags: r.tags.clone(),
            state: r.state.into(),
            tiers: r.tiers().into_iter().map(str::to_owned).collect(),
            rule: r.rule.clone(),
            retention: decisions
                .iter()
                .find(|d| d.step == r.step)
                .map(Decision::from),
            total_bytes: r.total_bytes,
            held: r.held_now().cloned(),
            offload: None,
        })
        .collect()
}

/// [`listing`] with the steps committed in parts and not whole yet, in step order.
pub fn listing_with_parts(
    records: &[CheckpointRecord],
    parts: &[CheckpointPartRecord],
    retention: Option<&stagehand_policy::CheckpointRetention>,
    deadline: Option<Duration>,
    now: time::OffsetDateTime,
) -> Vec<ListedCheckpoint> {
    let mut all = listing(records, retention);
    let whole: std::collections::HashSet<u64> = records.iter().map(|r| r.step).collect();
    all.extend(
        incomplete(parts, deadline, now)
            .into_iter()
            .filter(|c| !whole.contains(&c.step)),
    );
    all.sort_by_key(|c| c.step);
    all
}

fn state_name(state: ListedState) -> &'static str {
    match state {
        ListedState::Committed => "committed",
        ListedState::Demoted => "demoted",
        ListedState::Expired => "expired",
        ListedState::AtRisk => "at risk",
        ListedState::OffloadLate => "offload late",
        ListedState::Offloaded => "offloaded",
    }
}

/// The text of `checkpoint list`.
pub fn list_text(
    run: &str,
    items: &[ListedCheckpoint],
    out: &mut dyn Write,
) -> std::io::Result<()> {
    if items.is_empty() {
        return writeln!(out, "no checkpoints of run {run} in the catalogue");
    }
    writeln!(
        out,
        "{:>10}  {:<16} {:<10} {:<12} {:<16} RETENTION NOW",
        "STEP", "TAGS", "STATE", "TIERS", "RULE"
    )?;
    for c in items {
        let tags = if c.tags.is_empty() {
            "-".to_owned()
        } else {
            c.tags.join(",")
        };
        let tiers = if c.tiers.is_empty() {
            "-".to_owned()
        } else {
            c.tiers.join(",")
        };
        let now = match &c.retention {
            None => "-".to_owned(),
            Some(d) => {
                let place = match &d.tier {
                    Some(tier) => format!("{} to {tier}", d.placement),
                    None => d.placement.to_owned(),
                };
                let also: Vec<&String> = d.kept_by.iter().filter(|r| **r != d.rule).collect();
                if also.is_empty() {
                    format!("{place} ({})", d.rule)
                } else {
                    let also: Vec<&str> = also.iter().map(|s| s.as_str()).collect();
                    format!("{place} ({}; also {})", d.rule, also.join(", "))
                }
            }
        };
        writeln!(
            out,
            "{:>10}  {:<16} {:<10} {:<12} {:<16} {now}",
            c.step,
            tags,
            state_name(c.state),
            tiers,
            c.rule.as_deref().unwrap_or("-"),
        )?;
        if let Some(o) = &c.offload {
            let on: Vec<String> = o
                .on_node
                .iter()
                .map(|p| format!("part {} on {}", p.part, p.node))
                .collect();
            let line = if on.is_empty() {
                format!(
                    "{:>10}  all {} parts offloaded; not the latest until the step's commit folds",
                    "", o.parts
                )
            } else {
                format!(
                    "{:>10}  {}: {} of {} parts offloaded; on node NVMe only: {} ({} bytes); \
                     not the run's latest",
                    "",
                    state_name(c.state),
                    o.offloaded,
                    o.parts,
                    on.join(", "),
                    o.bytes_on_node
                )
            };
            writeln!(out, "{line}")?;
        }
        if let Some(h) = &c.held {
            let mut line = format!(
                "{:>10}  held: {} not carried out: {}",
                "", h.decision, h.reason
            );
            if !h.unlisted.is_empty() {
                line.push_str(&format!(" (unlisted: {}", h.unlisted.join(", ")));
                if h.unlisted_total > h.unlisted.len() as u64 {
                    line.push_str(&format!(", … {} in all", h.unlisted_total));
                }
                line.push(')');
            }
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}

/// How long `list` waits for the catalogue's answer to each page.
pub(super) const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// `stagehand checkpoint list`: the run's checkpoints from the catalogue.
pub async fn list(
    connection: &Connection,
    args: &ListArgs,
) -> Result<Vec<ListedCheckpoint>, CheckpointError> {
    let project = args
        .project
        .clone()
        .ok_or_else(|| usage("--project (or STAGEHAND_PROJECT) is required"))?;
    check_project(&project)?;
    check_run(&args.run)?;
    let dir = args.policies.clone().unwrap_or_else(default_policies);
    let policies = match (&args.policies, dir.join("tiers.toml").exists()) {
        (None, false) => None,
        _ => Some(
            stagehand_policy::Policies::load_dir(&dir)
                .map_err(|e| usage(format!("policies {}: {e}", dir.display())))?,
        ),
    };
    let bus = crate::cli::connect(connection)
        .await
        .map_err(CheckpointError::Unavailable)?;
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(LIST_TIMEOUT);
    let records = catalogue
        .all_checkpoints(&project, &args.run)
        .await
        .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
    let parts = catalogue
        .checkpoint_parts(&project, &args.run, None)
        .await
        .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
    let retention = policies.as_ref().and_then(|p| p.retention());
    let deadline = retention
        .and_then(|r| r.offload.as_ref())
        .map(|o| o.deadline);
    Ok(listing_with_parts(
        &records,
        &parts,
        retention.map(|r| &r.checkpoints),
        deadline,
        time::OffsetDateTime::now_utc(),
    ))
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::Stamp;
    use stagehand_schemas::{EventId, Location};

    use super::*;

    fn part(
        step: u64,
        part: u32,
        node: &str,
        minutes_ago: i64,
        offloaded: bool,
    ) -> CheckpointPartRecord {
        let now = time::OffsetDateTime::now_utc();
        let stamp = |ago: i64| Stamp {
            at: now - time::Duration::minutes(ago),
            event_id: EventId::new(format!("e-{step}-{part}-{ago}")).unwrap(),
        };
        let location = Location {
            tier: "local".into(),
            prefix: format!("lab/ckpt-r/step-{step}/part-{part}"),
        };
        CheckpointPartRecord {
            project: "lab".into(),
            run: "r".into(),
            step,
            part,
            parts: 2,
            node: node.into(),
            location: location.clone(),
            files: vec![],
            total_bytes: 100,
            tags: vec![],
            committed: Some(stamp(minutes_ago)),
            offloaded_to: offloaded.then(|| Location {
                tier: "hot".into(),
                ..location
            }),
            offloaded: offloaded.then(|| stamp(0)),
            removed: None,
        }
    }

    #[test]
    fn a_part_on_its_node_past_the_deadline_is_listed_offload_late() {
        let parts = [
            part(4, 0, "n0", 30, true),
            part(4, 1, "n1", 30, false),
            part(5, 0, "n0", 1, false),
            part(5, 1, "n1", 1, true),
        ];
        let deadline = Some(Duration::from_secs(15 * 60));
        let listed =
            listing_with_parts(&[], &parts, None, deadline, time::OffsetDateTime::now_utc());
        let states: Vec<(u64, ListedState)> = listed.iter().map(|c| (c.step, c.state)).collect();
        assert_eq!(
            states,
            [(4, ListedState::OffloadLate), (5, ListedState::AtRisk)]
        );
        let mut text = Vec::new();
        list_text("r", &listed, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains(
                "offload late: 1 of 2 parts offloaded; on node NVMe only: part 1 on n1 (100 bytes)"
            ),
            "{text}"
        );
        // Without a deadline nothing is late.
        let listed = listing_with_parts(&[], &parts, None, None, time::OffsetDateTime::now_utc());
        assert_eq!(listed[0].state, ListedState::AtRisk);
    }
}
