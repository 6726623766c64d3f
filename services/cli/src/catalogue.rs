//! `stagehand catalogue …`: questions to the catalogue recorders through the catalogue client
//! (`stagehand-catalogue`), printed as text or JSON. Lists are paged: `--limit` and `--after`
//! pick a page and the text ends with the command for the next one; `show D@V --json` streams
//! every file of the version as one JSON line each, asking page by page under the hood.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use futures::TryStreamExt;
use stagehand_catalogue::time::human;
use stagehand_catalogue::{
    Catalogue, DatasetDetail, DatasetRecord, FoldProblem, LineageNode, MAX_PAGE, Page,
    ReplicaRecord, StageStatus, VersionDetail,
};
use stagehand_schemas::FileRef;

/// How long to wait for a recorder's answer.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Files asked per request while `show D@V --json` streams a version.
const STREAM_PAGE: u32 = MAX_PAGE;

/// Splits `D` or `D@VERSION`.
pub fn parse_target(target: &str) -> (String, Option<String>) {
    match target.split_once('@') {
        Some((d, v)) => (d.to_owned(), Some(v.to_owned())),
        None => (target.to_owned(), None),
    }
}

/// What `show` prints.
#[derive(Debug, Clone, Default)]
pub struct ShowOptions {
    /// The project; needed only when several projects have a dataset of that name.
    pub project: Option<String>,
    /// Files (of `D@V`) or versions and rejections (of `D`) per page.
    pub limit: Option<u32>,
    /// Files after this path (`D@V`).
    pub after: Option<String>,
    /// One file's entry (`D@V`).
    pub path: Option<String>,
    pub json: bool,
    /// The lineage instead: raw versions → prepared versions → replicas per tier.
    pub lineage: bool,
}

fn more(out: &mut dyn Write, command: &str, next: &Option<String>) -> std::io::Result<()> {
    if let Some(next) = next {
        writeln!(out, "  … more: {command} --after {}", shell_quote(next))?;
    }
    Ok(())
}

fn shell_quote(s: &str) -> String {
    if s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_./:=@%+".contains(&b))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

pub fn datasets_text(page: &Page<DatasetRecord>, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<16} {:<24} {:>8} {:>9}  FIRST SEEN",
        "PROJECT", "DATASET", "VERSIONS", "REJECTED"
    )?;
    for d in &page.items {
        writeln!(
            out,
            "{:<16} {:<24} {:>8} {:>9}  {}",
            d.project,
            d.dataset,
            d.version_count,
            d.rejection_count,
            human(d.first_seen)
        )?;
    }
    more(out, "stagehand catalogue datasets", &page.next)
}

/// One replica: its tier, and its node on a node-local tier (`local@gpu-07`).
fn replica_line(out: &mut dyn Write, r: &ReplicaRecord) -> std::io::Result<()> {
    let place = match &r.node {
        Some(node) => format!("{}@{node}", r.tier),
        None => r.tier.clone(),
    };
    writeln!(
        out,
        "    {:<10} {:<8} {:>8} files {:>14} bytes  {}{}{}",
        place,
        format!("{:?}", r.state).to_lowercase(),
        r.files,
        r.total_bytes,
        r.verified_by
            .as_deref()
            .map(|v| format!("verified by {v}"))
            .unwrap_or_default(),
        r.stamp
            .as_ref()
            .map(|s| format!(" at {}", human(s.at)))
            .unwrap_or_default(),
        r.reason
            .as_deref()
            .map(|v| format!(" ({v})"))
            .unwrap_or_default(),
    )?;
    // When a scrub last read it back whole: a line of its own, only once one has.
    if let Some(v) = &r.last_verified {
        writeln!(
            out,
            "      last verified {} by {} ({} files, {} bytes read back)",
            human(v.stamp.at),
            v.verified_by,
            v.files,
            v.total_bytes
        )?;
    }
    Ok(())
}

pub fn dataset_text(d: &DatasetDetail, out: &mut dyn Write) -> std::io::Result<()> {
    let r = &d.dataset;
    writeln!(
        out,
        "dataset {}/{}: {} versions, {} rejected requests, first seen {}",
        r.project,
        r.dataset,
        r.version_count,
        r.rejection_count,
        human(r.first_seen)
    )?;
    if d.versions.is_empty() {
        writeln!(out, "  no validated version")?;
    }
    for v in &d.versions {
        writeln!(
            out,
            "  version {}  {} files, {} bytes, by {} at {}, request {}{}",
            v.version,
            v.file_count,
            v.total_bytes,
            v.provenance.by,
            human(v.provenance.at),
            v.provenance.request_id,
            if v.request_count > 1 {
                format!(" (+{} more requests)", v.request_count - 1)
            } else {
                String::new()
            }
        )?;
        if let Some(from) = &v.provenance.derived_from {
            writeln!(out, "    derived from {from}")?;
        }
        for replica in d.replicas.iter().filter(|x| x.version == v.version) {
            replica_line(out, replica)?;
        }
    }
    if let Some(next) = &d.versions_next {
        writeln!(
            out,
            "  … more versions (the catalogue's `versions` query, after {next})"
        )?;
    }
    for rejection in &d.rejections {
        writeln!(
            out,
            "  rejected request {} by {} at {}: {} problems",
            rejection.request_id,
            rejection.requested_by,
            human(rejection.stamp.at),
            rejection.problems_total
        )?;
        for p in &rejection.problems {
            writeln!(
                out,
                "    {:<20} {:<30} {}",
                p.code,
                p.path.as_deref().unwrap_or("-"),
                p.detail
            )?;
        }
        if let Some(q) = &rejection.quarantine {
            writeln!(out, "    full report: {q}")?;
        }
    }
    if let Some(next) = &d.rejections_next {
        writeln!(
            out,
            "  … more rejections (the catalogue's `rejections` query, after {next})"
        )?;
    }
    Ok(())
}

/// Under a present replica, why it is held: the live stage requests of it (the demoter never
/// removes a replica one holds), or that none does.
fn holds_line(
    out: &mut dyn Write,
    r: &ReplicaRecord,
    version: &str,
    requests: &[StageStatus],
) -> std::io::Result<()> {
    if !r.is_usable() {
        return Ok(());
    }
    let holding: Vec<String> = requests
        .iter()
        .filter(|s| {
            stagehand_catalogue::views::stages(s, version, &r.tier, r.node.as_deref())
                && s.holds_at(time::OffsetDateTime::now_utc())
        })
        .map(|s| {
            format!(
                "job {} ({} since {}, request {})",
                s.job_id,
                format!("{:?}", s.state).to_lowercase(),
                human(s.updated_at),
                s.request_id
            )
        })
        .collect();
    if holding.is_empty() {
        writeln!(out, "      held by no live stage")
    } else {
        writeln!(out, "      held by {}", holding.join(", "))
    }
}

/// A version and its replicas, each present one with the live stage requests holding it
/// (`requests`: the version's stage requests).
pub fn version_text(
    v: &VersionDetail,
    requests: &[StageStatus],
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let r = &v.version;
    writeln!(
        out,
        "version {} of {}/{}: {} files, {} bytes\n  by {} at {}, request {}",
        r.version,
        r.project,
        r.dataset,
        r.file_count,
        r.total_bytes,
        r.provenance.by,
        human(r.provenance.at),
        r.provenance.request_id
    )?;
    for replica in &v.replicas {
        replica_line(out, replica)?;
        holds_line(out, replica, &r.version, requests)?;
    }
    Ok(())
}

/// `catalogue show D --lineage`: one tree per raw version, each version with its replicas.
pub fn lineage_text(
    dataset: &str,
    page: &Page<LineageNode>,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    fn node(out: &mut dyn Write, n: &LineageNode, depth: usize) -> std::io::Result<()> {
        let v = &n.version;
        let pad = "  ".repeat(depth);
        let what = match (&v.provenance.derived_from, &v.provenance.layout) {
            (None, _) => "raw".to_owned(),
            (Some(_), Some(layout)) => format!("prepared ({layout})"),
            (Some(_), None) => "derived".to_owned(),
        };
        writeln!(
            out,
            "{pad}{what} {}  {} files, {} bytes, by {} at {}",
            v.version,
            v.file_count,
            v.total_bytes,
            v.provenance.by,
            human(v.provenance.at)
        )?;
        if depth == 0
            && let Some(from) = &v.provenance.derived_from
        {
            writeln!(
                out,
                "{pad}  derived from {from} (not a version of this dataset)"
            )?;
        }
        for r in &n.replicas {
            write!(out, "{pad}")?;
            replica_line(out, r)?;
        }
        for child in &n.derived {
            writeln!(out, "{pad}  ↳")?;
            node(out, child, depth + 1)?;
        }
        if n.truncated {
            writeln!(
                out,
                "{pad}  … more replicas or derived versions (show that version with --lineage)"
            )?;
        }
        Ok(())
    }
    if page.items.is_empty() {
        writeln!(out, "no version of {dataset}")?;
    }
    for root in &page.items {
        node(out, root, 0)?;
    }
    more(
        out,
        &format!("stagehand catalogue show {dataset} --lineage"),
        &page.next,
    )
}

/// Every stage request of one version, page by page.
async fn stage_requests_of(
    catalogue: &Catalogue,
    project: &str,
    dataset: &str,
    version: &str,
) -> anyhow::Result<Vec<StageStatus>> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = catalogue
            .stage_requests(
                project,
                None,
                Some(dataset),
                Some(version),
                after.as_deref(),
            )
            .await
            .context("catalogue show: the version's stage requests")?;
        all.extend(page.items);
        match page.next {
            Some(n) => after = Some(n),
            None => return Ok(all),
        }
    }
}

fn file_line(out: &mut dyn Write, f: &FileRef) -> std::io::Result<()> {
    writeln!(out, "    {}\t{}\t{}", f.path, f.size, f.sha256)
}

/// `stagehand catalogue datasets`.
pub async fn datasets(
    catalogue: &Catalogue,
    project: Option<&str>,
    limit: Option<u32>,
    after: Option<&str>,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let page = catalogue.datasets(project, limit, after).await?;
    if json {
        let value = serde_json::json!({"datasets": page.items, "next": page.next});
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        datasets_text(&page, out)?;
    }
    Ok(())
}

/// `stagehand catalogue show D[@VERSION]`.
pub async fn show(
    catalogue: &Catalogue,
    target: &str,
    opts: &ShowOptions,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let (dataset, version) = parse_target(target);
    let project = opts.project.as_deref();
    if opts.lineage {
        let page = catalogue
            .lineage(
                project,
                &dataset,
                version.as_deref(),
                opts.limit,
                opts.after.as_deref(),
            )
            .await
            .context("catalogue show --lineage")?;
        if opts.json {
            let value = serde_json::json!({"lineage": page.items, "next": page.next});
            writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        } else {
            lineage_text(&dataset, &page, out)?;
        }
        return Ok(());
    }
    let Some(version) = version else {
        let q = stagehand_catalogue::Query::Dataset {
            project: opts.project.clone(),
            dataset: dataset.clone(),
            limit: opts.limit,
        };
        let stagehand_catalogue::Answer::Dataset(detail) =
            catalogue.ask(&q).await.context("catalogue show")?
        else {
            anyhow::bail!("the catalogue answered something else than a dataset");
        };
        if opts.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&detail)?)?;
        } else {
            dataset_text(&detail, out)?;
        }
        return Ok(());
    };
    if let Some(path) = &opts.path {
        let (digest, file) = catalogue
            .file(project, &dataset, &version, path)
            .await
            .context("catalogue show --path")?;
        if opts.json {
            let value = serde_json::json!({"version": digest, "file": file});
            writeln!(out, "{}", serde_json::to_string(&value)?)?;
        } else {
            writeln!(out, "{}\t{}\t{}", file.path, file.size, file.sha256)?;
        }
        return Ok(());
    }
    if opts.json {
        // One line per file of the whole version, page by page: memory stays one page.
        let files = catalogue.all_files(
            opts.project.clone(),
            dataset,
            version,
            STREAM_PAGE,
            opts.after.clone(),
        );
        let mut files = std::pin::pin!(files);
        while let Some(file) = files.try_next().await.context("catalogue show --json")? {
            serde_json::to_writer(&mut *out, &file)?;
            out.write_all(b"\n")?;
        }
        return Ok(());
    }
    let detail = catalogue
        .version(project, &dataset, &version)
        .await
        .context("catalogue show")?;
    let page = catalogue
        .files(
            project,
            &dataset,
            &detail.version.version,
            opts.limit,
            opts.after.as_deref(),
        )
        .await
        .context("catalogue show")?;
    let requests = stage_requests_of(
        catalogue,
        &detail.version.project,
        &dataset,
        &detail.version.version,
    )
    .await?;
    version_text(&detail, &requests, out)?;
    writeln!(out, "  files:")?;
    for f in &page.files {
        file_line(out, f)?;
    }
    let command = format!(
        "stagehand catalogue show {dataset}@{}{}",
        &detail.version.version[..12],
        opts.limit
            .map(|l| format!(" --limit {l}"))
            .unwrap_or_default()
    );
    more(out, &command, &page.next)?;
    Ok(())
}

/// `stagehand catalogue dead-letters`.
pub async fn dead_letters(
    catalogue: &Catalogue,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let answer = catalogue
        .ask(&stagehand_catalogue::Query::DeadLetters {
            limit: Some(MAX_PAGE),
            after: None,
        })
        .await?;
    let stagehand_catalogue::Answer::DeadLetters { services, next } = answer else {
        anyhow::bail!("the catalogue answered something else than dead letters");
    };
    if json {
        let value = serde_json::json!({"services": services, "next": next});
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<24} {:>6} {:>8}  {:<20}  LAST ERROR",
        "SERVICE", "COUNT", "WAITING", "LAST"
    )?;
    for s in &services {
        writeln!(
            out,
            "{:<24} {:>6} {:>8}  {:<20}  {}",
            s.service,
            s.count,
            // Not replayed since; a recorder that does not fold replays cannot tell.
            s.waiting.map_or("-".into(), |w| w.to_string()),
            human(s.stamp.at),
            s.last_error.as_deref().unwrap_or("-")
        )?;
    }
    Ok(())
}

pub fn problems_text(
    problems: &[FoldProblem],
    total: u64,
    next: &Option<String>,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    writeln!(
        out,
        "{total} facts the catalogue could not fold\n{:<32} {:<18} {:<20} {:<24} {:<20} DETAIL",
        "EVENT", "KIND", "OCCURRED", "PROJECT/DATASET", "CODE"
    )?;
    for p in problems {
        writeln!(
            out,
            "{:<32} {:<18} {:<20} {:<24} {:<20} {}",
            p.event_id,
            p.kind,
            human(p.occurred_at),
            format!("{}/{}", p.project, p.dataset.as_deref().unwrap_or("-")),
            serde_json::to_value(p.code)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            p.detail
        )?;
    }
    more(out, "stagehand catalogue problems", next)
}

/// `stagehand catalogue problems`.
pub async fn problems(
    catalogue: &Catalogue,
    limit: Option<u32>,
    after: Option<&str>,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let (page, total) = catalogue.problems(limit, after).await?;
    if json {
        let value = serde_json::json!({"problems": page.items, "total": total, "next": page.next});
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        problems_text(&page.items, total, &page.next, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::DatasetRecord;

    use super::*;

    /// Guards the time people read: RFC 3339 in UTC to the second, not `OffsetDateTime`'s
    /// Display (`2026-12-01 6:44:25.765729 +00:00:00`).
    #[test]
    fn listed_times_are_rfc3339_utc() {
        let page = Page {
            items: vec![DatasetRecord {
                project: "lab-a".into(),
                dataset: "cats".into(),
                first_seen: time::macros::datetime!(2026-12-01 06:44:25.765729 UTC),
                version_count: 2,
                rejection_count: 1,
            }],
            next: Some("lab-a/cats".into()),
        };
        let mut out = Vec::new();
        datasets_text(&page, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("  2026-12-01T06:44:25Z\n"), "{text}");
        assert!(
            text.ends_with("more: stagehand catalogue datasets --after lab-a/cats\n"),
            "{text}"
        );
    }

    /// `catalogue show D@V` tells node-local replicas apart: each line names its node.
    #[test]
    fn a_node_local_replica_is_shown_with_its_node() {
        let replica = |node: Option<&str>| ReplicaRecord {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: "ab".repeat(32),
            tier: "local".into(),
            node: node.map(Into::into),
            prefix: "lab-a/cats/v".into(),
            state: stagehand_catalogue::ReplicaState::Present,
            reason: None,
            stamp: None,
            files: 2,
            total_bytes: 3,
            verified_by: Some("read-back".into()),
            backup: false,
            copied: None,
            last_drill: None,
            last_verified: None,
            last_repaired: None,
        };
        let mut out = Vec::new();
        replica_line(&mut out, &replica(Some("gpu-07"))).unwrap();
        replica_line(&mut out, &replica(None)).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("    local@gpu-07 present"), "{text}");
        assert!(lines[1].starts_with("    local      present"), "{text}");
    }

    /// `catalogue show D@V` says when a scrub last read each copy back, and a damaged copy's
    /// reason names what was found.
    #[test]
    fn a_replica_shows_its_last_verification_and_its_damage() {
        use stagehand_catalogue::{ReplicaState, Stamp, Verification};
        let at = time::macros::datetime!(2026-12-09 03:12:44 UTC);
        let mut whole = ReplicaRecord {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: "ab".repeat(32),
            tier: "capacity".into(),
            node: None,
            prefix: "lab-a/cats/v".into(),
            state: ReplicaState::Present,
            reason: None,
            stamp: None,
            files: 2,
            total_bytes: 3,
            verified_by: Some("read-back".into()),
            backup: false,
            copied: None,
            last_drill: None,
            last_verified: Some(Verification {
                files: 2,
                total_bytes: 3,
                verified_by: "scrub".into(),
                stamp: Stamp {
                    at,
                    event_id: stagehand_schemas::EventId::new("v-1").unwrap(),
                },
            }),
            last_repaired: None,
        };
        let mut out = Vec::new();
        replica_line(&mut out, &whole).unwrap();
        whole.state = ReplicaState::Damaged;
        whole.last_verified = None;
        whole.reason = Some("damaged (found by scrub): 1 path(s) — a.bin hash; …".into());
        replica_line(&mut out, &whole).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[1],
            "      last verified 2026-12-09T03:12:44Z by scrub (2 files, 3 bytes read back)",
            "{text}"
        );
        assert!(lines[2].starts_with("    capacity   damaged"), "{text}");
        assert!(lines[2].contains("a.bin hash"), "{text}");
        assert_eq!(lines.len(), 3, "{text}");
    }

    /// Guards `show D --lineage`: a raw version, its replicas, and the prepared version under
    /// it with its own replicas, then the command for the next page.
    #[test]
    fn lineage_shows_prepared_versions_under_their_raw_version() {
        use stagehand_catalogue::{Provenance, ReplicaState, VersionRecord};
        use stagehand_schemas::{EventId, Location};
        let at = time::macros::datetime!(2026-12-01 06:44:25 UTC);
        let version = |digest: &str, derived_from: Option<&str>, tier: &str| {
            let provenance = Provenance {
                by: if derived_from.is_some() {
                    "resharder"
                } else {
                    "alice"
                }
                .into(),
                at,
                request_id: EventId::new("req-1").unwrap(),
                event_id: EventId::new("ev-1").unwrap(),
                labels: vec![],
                derived_from: derived_from.map(Into::into),
                layout: derived_from.map(|_| "webdataset".into()),
                location: Location {
                    tier: tier.into(),
                    prefix: "p".into(),
                },
            };
            let replica = ReplicaRecord {
                project: "lab".into(),
                dataset: "cats".into(),
                version: digest.into(),
                tier: tier.into(),
                node: None,
                prefix: "p".into(),
                state: ReplicaState::Present,
                reason: None,
                stamp: None,
                files: 2,
                total_bytes: 9,
                verified_by: Some("prepared".into()),
                backup: false,
                copied: None,
                last_drill: None,
                last_verified: None,
                last_repaired: None,
            };
            LineageNode {
                version: VersionRecord {
                    project: "lab".into(),
                    dataset: "cats".into(),
                    version: digest.into(),
                    file_count: 2,
                    total_bytes: 9,
                    provenance,
                    request_count: 1,
                },
                replicas: vec![replica],
                derived: vec![],
                truncated: false,
            }
        };
        let mut raw = version("aaaa1111", None, "source");
        raw.derived
            .push(version("bbbb2222", Some("aaaa1111"), "capacity"));
        let page = Page {
            items: vec![raw],
            next: Some("aaaa1111".into()),
        };
        let mut out = Vec::new();
        lineage_text("cats", &page, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("raw aaaa1111  2 files, 9 bytes, by alice"),
            "{text}"
        );
        assert!(lines[1].trim_start().starts_with("source"), "{text}");
        assert_eq!(lines[2].trim(), "↳", "{text}");
        assert!(
            lines[3].starts_with("  prepared (webdataset) bbbb2222"),
            "{text}"
        );
        assert!(lines[4].trim_start().starts_with("capacity"), "{text}");
        assert!(
            text.ends_with("more: stagehand catalogue show cats --lineage --after aaaa1111\n"),
            "{text}"
        );
    }

    #[test]
    fn cursors_are_quoted_for_the_shell() {
        assert_eq!(shell_quote("train/0001.jpg"), "train/0001.jpg");
        assert_eq!(shell_quote("it's a b"), r"'it'\''s a b'");
    }
}
