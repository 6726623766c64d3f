//! `stagehand catalogue …`: questions to the catalogue recorders over request/reply, printed
//! as text or JSON.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, bail};
use stagehand_catalogue_recorder::{
    Answer, DatasetDetail, DatasetRecord, Query, ReplicaRecord, VersionDetail, ask,
};

/// How long to wait for a recorder's answer.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Asks and turns an `error` answer into an error.
pub async fn query(client: &async_nats::Client, query: &Query) -> anyhow::Result<Answer> {
    match ask(client, query, TIMEOUT).await? {
        Answer::Error { code, message } => bail!("{message} ({code:?})"),
        answer => Ok(answer),
    }
}

/// Splits `D` or `D@VERSION`.
pub fn parse_target(target: &str) -> (String, Option<String>) {
    match target.split_once('@') {
        Some((d, v)) => (d.to_owned(), Some(v.to_owned())),
        None => (target.to_owned(), None),
    }
}

/// The project of `dataset`: the one given, or the only project that has a dataset so named.
pub async fn resolve_project(
    client: &async_nats::Client,
    project: Option<String>,
    dataset: &str,
) -> anyhow::Result<String> {
    if let Some(p) = project {
        return Ok(p);
    }
    let Answer::Datasets { datasets } = query(client, &Query::Datasets { project: None }).await?
    else {
        bail!("the catalogue answered something else than a dataset list");
    };
    let mut projects: Vec<String> = datasets
        .into_iter()
        .filter(|d| d.dataset == dataset)
        .map(|d| d.project)
        .collect();
    projects.dedup();
    match projects.len() {
        0 => bail!("no dataset {dataset:?} in the catalogue"),
        1 => Ok(projects.remove(0)),
        _ => bail!(
            "dataset {dataset:?} exists in several projects ({}): give --project",
            projects.join(", ")
        ),
    }
}

pub fn datasets_text(datasets: &[DatasetRecord]) -> String {
    let mut out = format!(
        "{:<16} {:<24} {:>8} {:>9}\n",
        "PROJECT", "DATASET", "VERSIONS", "REJECTED"
    );
    for d in datasets {
        let _ = writeln!(
            out,
            "{:<16} {:<24} {:>8} {:>9}",
            d.project,
            d.dataset,
            d.versions.len(),
            d.rejected_requests.len()
        );
    }
    out
}

fn replica_line(out: &mut String, r: &ReplicaRecord) {
    let _ = writeln!(
        out,
        "    {:<10} {:<8} {:>6} files {:>12} bytes  {}{}",
        r.tier,
        format!("{:?}", r.state).to_lowercase(),
        r.files,
        r.total_bytes,
        r.verified_by
            .as_deref()
            .map(|v| format!("verified by {v}"))
            .unwrap_or_default(),
        r.reason
            .as_deref()
            .map(|v| format!(" ({v})"))
            .unwrap_or_default(),
    );
}

pub fn dataset_text(d: &DatasetDetail) -> String {
    let mut out = format!("dataset {}/{}\n", d.dataset.project, d.dataset.dataset);
    if d.versions.is_empty() {
        out.push_str("  no validated version\n");
    }
    for v in &d.versions {
        let _ = writeln!(
            out,
            "  version {}  {} files, {} bytes, by {} at {}, request {}",
            v.version,
            v.file_count,
            v.total_bytes,
            v.provenance.by,
            v.provenance.at,
            v.provenance.request_id
        );
        if let Some(from) = &v.provenance.derived_from {
            let _ = writeln!(out, "    derived from {from}");
        }
        for r in d.replicas.iter().filter(|r| r.version == v.version) {
            replica_line(&mut out, r);
        }
        for s in d.stages.iter().filter(|s| s.version == v.version) {
            let _ = writeln!(
                out,
                "    stage {} on {}: {:?}{}",
                s.job_id,
                s.tier,
                s.state,
                s.reason
                    .as_deref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            );
        }
    }
    for r in &d.rejections {
        let _ = writeln!(
            out,
            "  rejected request {} by {} at {}: {} problems",
            r.request_id,
            r.requested_by,
            r.stamp.at,
            r.problems.len()
        );
        for p in &r.problems {
            let _ = writeln!(
                out,
                "    {:<20} {:<30} {}",
                p.code,
                p.path.as_deref().unwrap_or("-"),
                p.detail
            );
        }
    }
    out
}

pub fn version_text(v: &VersionDetail) -> String {
    let r = &v.version;
    let mut out = format!(
        "version {} of {}/{}: {} files, {} bytes\n  by {} at {}, request {}\n",
        r.version,
        r.project,
        r.dataset,
        r.file_count,
        r.total_bytes,
        r.provenance.by,
        r.provenance.at,
        r.provenance.request_id
    );
    for replica in &v.replicas {
        replica_line(&mut out, replica);
    }
    out.push_str("  files:\n");
    for f in &v.files {
        let _ = writeln!(out, "    {}\t{}\t{}", f.path, f.size, f.sha256);
    }
    out
}

/// `stagehand catalogue datasets`.
pub async fn datasets(
    client: &async_nats::Client,
    project: Option<String>,
    json: bool,
) -> anyhow::Result<String> {
    let answer = query(client, &Query::Datasets { project }).await?;
    Ok(match (&answer, json) {
        (_, true) => serde_json::to_string_pretty(&answer)? + "\n",
        (Answer::Datasets { datasets }, false) => datasets_text(datasets),
        _ => bail!("unexpected answer"),
    })
}

/// `stagehand catalogue show D[@VERSION]`.
pub async fn show(
    client: &async_nats::Client,
    project: Option<String>,
    target: &str,
    json: bool,
) -> anyhow::Result<String> {
    let (dataset, version) = parse_target(target);
    let project = resolve_project(client, project, &dataset).await?;
    let q = match version {
        Some(version) => Query::Version {
            project,
            dataset,
            version,
        },
        None => Query::Dataset { project, dataset },
    };
    let answer = query(client, &q).await.context("catalogue show")?;
    Ok(match (&answer, json) {
        (_, true) => serde_json::to_string_pretty(&answer)? + "\n",
        (Answer::Dataset(d), false) => dataset_text(d),
        (Answer::Version(v), false) => version_text(v),
        _ => bail!("unexpected answer"),
    })
}

/// `stagehand catalogue dead-letters`.
pub async fn dead_letters(client: &async_nats::Client, json: bool) -> anyhow::Result<String> {
    let answer = query(client, &Query::DeadLetters).await?;
    Ok(match (&answer, json) {
        (_, true) => serde_json::to_string_pretty(&answer)? + "\n",
        (Answer::DeadLetters { services }, false) => {
            let mut out = format!("{:<24} {:>6}  LAST ERROR\n", "SERVICE", "COUNT");
            for s in services {
                let _ = writeln!(
                    out,
                    "{:<24} {:>6}  {}",
                    s.service,
                    s.count,
                    s.last_error.as_deref().unwrap_or("-")
                );
            }
            out
        }
        _ => bail!("unexpected answer"),
    })
}
