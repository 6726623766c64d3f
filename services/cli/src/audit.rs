//! `stagehand audit TIER`: stray and lost data on one tier, per project — the demoter's audit
//! ([`stagehand_demoter::audit`]) run once from the command line, with `scrub.toml`'s
//! `[audit]` policy.

use std::io::Write;

use anyhow::Context;
use stagehand_bus::Bus;
use stagehand_catalogue::Catalogue;
use stagehand_demoter::audit::{AuditOptions, AuditReport, audit};
use stagehand_policy::{Opening, Policies, TierRole};

use crate::args::UsageError;
use crate::tier::size;

/// Exit status of an audit that found nothing stray or lost.
pub const CLEAN: i32 = 0;
/// Exit status of an audit that reported stray or lost data.
pub const FOUND: i32 = 1;
/// Exit status of an audit stopped by its threshold: a person must look.
pub const STOPPED: i32 = 2;

/// Runs the audit of `tier` and prints its report; returns the exit status.
pub async fn run(
    bus: &Bus,
    catalogue: &Catalogue,
    policies: &Policies,
    (tier, node): (&str, Option<&str>),
    quarantine: bool,
    json: bool,
    out: &mut impl Write,
) -> anyhow::Result<i32> {
    let Some(declared) = policies.tiers().get(tier) else {
        return Err(UsageError(format!("TIER: no tier {tier:?} in the policies")).into());
    };
    match (declared.role, node) {
        (TierRole::Local, None) => {
            return Err(UsageError(format!(
                "--node: tier {tier:?} is node-local; name the node whose copies this machine sees there"
            ))
            .into());
        }
        (TierRole::Local, Some(_)) | (_, None) => {}
        (_, Some(_)) => {
            return Err(UsageError(format!(
                "--node: tier {tier:?} is shared by every node; --node is for a node-local tier"
            ))
            .into());
        }
    }
    let opened = declared.open_for(&Opening::read()).await?;
    let mut opts = AuditOptions::new(tier, policies.scrub().map(|s| s.audit).unwrap_or_default());
    opts.node = node.map(str::to_owned);
    opts.quarantine = quarantine;
    let report = audit(bus, catalogue, &opened, &opts)
        .await
        .with_context(|| format!("auditing tier {tier}"))?;
    if json {
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        text(&report, out)?;
    }
    Ok(if report.stopped {
        STOPPED
    } else if report.found_anything() {
        FOUND
    } else {
        CLEAN
    })
}

/// The report as a table per project, then each stray entry and lost replica.
pub fn text(r: &AuditReport, out: &mut impl Write) -> std::io::Result<()> {
    let node = r
        .node
        .as_deref()
        .map(|n| format!(" on {n}"))
        .unwrap_or_default();
    writeln!(
        out,
        "{}{node}: {} stray ({}), {} lost, {} in flight left out; catalogued {}; facts {}..{}",
        r.tier,
        r.stray.len(),
        size(r.stray_bytes),
        r.lost.len(),
        r.in_flight,
        size(r.catalogued_bytes),
        r.window.0,
        r.window.1,
    )?;
    let projects = r.per_project();
    if !projects.is_empty() {
        writeln!(
            out,
            "{:<24} {:>6} {:>12} {:>11} {:>5}",
            "PROJECT", "STRAY", "BYTES", "QUARANTINED", "LOST"
        )?;
        for (project, p) in &projects {
            writeln!(
                out,
                "{project:<24} {:>6} {:>12} {:>11} {:>5}",
                p.stray,
                size(p.stray_bytes),
                p.quarantined,
                p.lost
            )?;
        }
    }
    for s in &r.stray {
        let moved = s
            .quarantined_to
            .as_deref()
            .map(|to| format!(", quarantined to {to}"))
            .unwrap_or_default();
        writeln!(
            out,
            "  stray {}: {} ({} files, {}){moved}",
            s.kind.as_str(),
            s.path,
            s.files,
            size(s.bytes)
        )?;
    }
    for l in &r.lost {
        writeln!(
            out,
            "  lost: {} ({}/{}@{}), {}",
            l.prefix,
            l.project,
            l.dataset,
            &l.version[..12.min(l.version.len())],
            if l.damaged_fact.is_some() {
                "announced damaged"
            } else {
                "not announced (stopped)"
            }
        )?;
    }
    if r.stopped {
        writeln!(
            out,
            "stopped: stray or lost data is above the tier's threshold (scrub.toml [audit] stop_above_fraction; is the tier mounted, and is this its node?); nothing was announced lost or quarantined and a person must look (runbooks/stray-data.md)"
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_demoter::audit::{Lost, Stray, StrayKind};

    /// Guards the text report's shape (the README shows it): one header line, one row per
    /// project with its stray count, bytes, quarantined and lost, then each entry.
    #[test]
    fn the_text_report_has_a_row_per_project_and_a_line_per_entry() {
        let report = AuditReport {
            tier: "hot".into(),
            node: None,
            window: (12, 14),
            catalogued_bytes: 576 * 1024,
            stray_bytes: 1000,
            lost_bytes: 4096,
            in_flight: 1,
            stopped: false,
            stray: vec![Stray {
                project: "lab-a".into(),
                path: "lab-a/strays".into(),
                kind: StrayKind::Folder,
                files: 1,
                bytes: 1000,
                modified: None,
                quarantined_to: None,
            }],
            lost: vec![Lost {
                project: "lab-a".into(),
                dataset: "dogs".into(),
                version: "5d1c8e2f9a04".repeat(5),
                prefix: "lab-a/dogs/5d1c".into(),
                node: None,
                damaged_fact: Some("f".into()),
            }],
        };
        let mut out = Vec::new();
        text(&report, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "hot: 1 stray (1000 B), 1 lost, 1 in flight left out; catalogued 576.0 KiB; facts 12..14"
        );
        assert!(lines[1].starts_with("PROJECT"), "{text}");
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            ["lab-a", "1", "1000", "B", "0", "1"]
        );
        assert_eq!(lines[3], "  stray folder: lab-a/strays (1 files, 1000 B)");
        assert_eq!(
            lines[4],
            "  lost: lab-a/dogs/5d1c (lab-a/dogs@5d1c8e2f9a04), announced damaged"
        );
        assert_eq!(lines.len(), 5);
    }
}
