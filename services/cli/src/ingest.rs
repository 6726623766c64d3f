//! `stagehand ingest`: the lab uploader.
//!
//! Walks a folder, copies every file onto the source tier while hashing it (each byte is read
//! once), publishes an `ingest.requested` event with the manifest, and prints the request id.
//!
//! Placement is content-addressed and atomic. Files are written under
//! `<project>/<dataset>/.incoming-<random>/` on the tier (each through the mover's temp file →
//! sync → rename), then that folder is renamed to `<project>/<dataset>/<first 16 hex of the
//! version digest>`. A partial upload is never visible under the version's prefix, and running
//! the same ingest again finds the prefix present and publishes the same request id
//! ([`EventId::for_content`] over project, dataset and digest), which JetStream's duplicate
//! window drops.
//!
//! With `--manifest FILE` the uploader declares its own manifest (`path<TAB>size<TAB>sha256`
//! lines) instead of the one measured here; the folder's files are placed as they are and the
//! validator judges the declaration against them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use stagehand_bus::Bus;
use stagehand_mover::{
    CopyOptions, CopyOutcome, EMPTY_SHA256, Mover, MoverConfig, PosixTier, Priority, Progress, Tier,
};
use stagehand_schemas::subject::FACTS;
use stagehand_schemas::{
    Body, DatasetRejected, DatasetValidated, Event, EventId, FileRef, IngestRequested, Location,
    check_relative_path, version_digest,
};

/// A file found in the folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFile {
    /// Path relative to the folder, `/`-separated.
    pub rel: String,
    pub size: u64,
}

/// Checks that a project or dataset name can be a path component and a subject-safe name.
pub fn check_name(what: &str, name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if !ok {
        bail!("{what} {name:?} must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'");
    }
    Ok(())
}

/// Lists the regular files beneath `folder`. A symlink that resolves outside the folder is
/// refused; one that stays inside is skipped (its target is ingested under its own path).
/// Anything else that is not a file or a directory (fifo, socket, device) is refused.
pub fn scan(folder: &Path) -> anyhow::Result<Vec<LocalFile>> {
    let root = folder
        .canonicalize()
        .with_context(|| format!("cannot open folder {}", folder.display()))?;
    if !root.is_dir() {
        bail!("{} is not a folder", folder.display());
    }
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(&root)
        .follow_links(false)
        .sort_by_file_name()
    {
        let entry = entry.with_context(|| format!("walking {}", folder.display()))?;
        if entry.depth() == 0 {
            continue;
        }
        let rel = entry
            .path()
            .strip_prefix(&root)
            .expect("walkdir yields paths beneath its root")
            .to_str()
            .with_context(|| format!("{} is not valid UTF-8", entry.path().display()))?
            .to_owned();
        let kind = entry.file_type();
        if kind.is_symlink() {
            let target = std::fs::canonicalize(entry.path())
                .with_context(|| format!("symlink {rel} is dangling"))?;
            if !target.starts_with(&root) {
                bail!(
                    "symlink {rel} points to {}, outside {}: refused",
                    target.display(),
                    folder.display()
                );
            }
            eprintln!(
                "note: symlink {rel} stays inside the folder and is skipped; its target is ingested under its own path"
            );
            continue;
        }
        if kind.is_dir() {
            continue;
        }
        if !kind.is_file() {
            bail!("{rel} is neither a regular file nor a folder: refused");
        }
        check_relative_path(&rel)
            .with_context(|| format!("file {rel} cannot be a manifest path"))?;
        let size = entry
            .metadata()
            .with_context(|| format!("stat {rel}"))?
            .len();
        files.push(LocalFile { rel, size });
    }
    if files.is_empty() {
        bail!("{} holds no files to ingest", folder.display());
    }
    Ok(files)
}

/// Reads a declared manifest: one `path<TAB>size<TAB>sha256` line per file. The entries are
/// taken as declared (even a bad path): judging them is the validator's job.
pub fn read_manifest(path: &Path) -> anyhow::Result<Vec<FileRef>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read manifest {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let mut parts = line.split('\t');
            let (Some(p), Some(size), Some(sha), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                bail!(
                    "{}:{}: expected path<TAB>size<TAB>sha256",
                    path.display(),
                    i + 1
                );
            };
            let size = size
                .parse()
                .with_context(|| format!("{}:{}: size {size:?}", path.display(), i + 1))?;
            Ok(FileRef::new(p, size, sha))
        })
        .collect()
}

/// Where an upload was placed and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Every file placed, measured while copying.
    pub files: Vec<FileRef>,
    /// The version prefix on the tier.
    pub prefix: String,
    /// Whether the prefix was already there (a re-run of the same upload).
    pub existed: bool,
}

/// Copies `files` from `folder` onto `tier` under the content-addressed prefix, hashing each
/// byte as it is copied. `digest_of` picks the manifest whose digest names the prefix (the
/// measured one, or a declared one). Blocking: run it off the async runtime.
pub async fn place(
    tier: &PosixTier,
    folder: &Path,
    project: &str,
    dataset: &str,
    files: &[LocalFile],
    declared: Option<&[FileRef]>,
    bar: &ProgressBar,
) -> anyhow::Result<Placed> {
    // The mover's confined opens: a symlink swapped in since the walk is refused. It hashes
    // each file in flight while copying it (read once), publishes atomically, and makes the
    // whole batch durable before returning.
    let upload = Tier::Posix(
        PosixTier::open("upload", folder)
            .with_context(|| format!("cannot open folder {}", folder.display()))?,
    );
    let incoming = format!("{project}/{dataset}/.incoming-{}", EventId::random());
    let incoming_root = tier.root().join(&incoming);
    std::fs::create_dir_all(&incoming_root)
        .with_context(|| format!("cannot create {incoming} on tier {}", tier.name()))?;
    let cleanup = Cleanup(incoming_root.clone());
    let staging = Tier::Posix(PosixTier::open(tier.name(), &incoming_root)?);
    let wanted: Vec<FileRef> = files
        .iter()
        .map(|f| FileRef::new(f.rel.clone(), f.size, EMPTY_SHA256))
        .collect();
    let opts = CopyOptions {
        priority: Priority::Ingest,
        expected_hash_unknown: true,
        ..CopyOptions::default()
    };
    let mover = Mover::new(MoverConfig::default())?;
    let progress = Progress::new();
    let ticker = {
        let (bar, progress) = (bar.clone(), progress.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                bar.set_position(progress.bytes_done());
            }
        })
    };
    let report = mover
        .copy_all(&upload, &staging, &wanted, &opts, &progress)
        .await;
    ticker.abort();
    let mut measured = Vec::with_capacity(files.len());
    for (file, result) in files.iter().zip(report.results) {
        let outcome = result
            .result
            .with_context(|| format!("cannot place {} on tier {}", file.rel, tier.name()))?;
        measured.push(FileRef::new(
            file.rel.clone(),
            file.size,
            match outcome {
                CopyOutcome::Copied { sha256, .. } | CopyOutcome::Skipped { sha256, .. } => sha256,
            },
        ));
    }
    let digest = version_digest(declared.unwrap_or(&measured));
    let prefix = format!("{project}/{dataset}/{}", &digest[..16]);
    let target = tier.root().join(&prefix);
    let existed = match std::fs::rename(tier.root().join(&incoming), &target) {
        Ok(()) => {
            if let Some(parent) = target.parent() {
                std::fs::File::open(parent)
                    .and_then(|d| d.sync_all())
                    .with_context(|| format!("syncing {}", parent.display()))?;
            }
            std::mem::forget(cleanup);
            false
        }
        // The same content is there already (a re-run): keep it, drop this copy.
        Err(e) if target.is_dir() => {
            tracing::debug!(error = %e, %prefix, "version prefix already present");
            true
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("cannot publish {prefix} on tier {}", tier.name()));
        }
    };
    Ok(Placed {
        files: measured,
        prefix,
        existed,
    })
}

/// Removes an unpublished incoming folder when placement fails or finds the version present.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The ingest request for a placed upload. Its id follows from project, dataset and the
/// manifest's digest, so the same upload is the same request.
pub fn request(
    project: &str,
    dataset: &str,
    tier: &str,
    prefix: &str,
    files: Vec<FileRef>,
    requested_by: &str,
    labels: Vec<(String, String)>,
) -> Event {
    let digest = version_digest(&files);
    let id = EventId::for_content(&[
        b"ingest",
        project.as_bytes(),
        dataset.as_bytes(),
        digest.as_bytes(),
    ]);
    Event::request(
        id,
        project,
        Body::IngestRequested(IngestRequested {
            dataset: dataset.into(),
            source: Location {
                tier: tier.into(),
                prefix: prefix.into(),
            },
            files,
            manifest: None,
            requested_by: requested_by.into(),
            labels,
        }),
    )
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Validated(DatasetValidated),
    Rejected(DatasetRejected),
}

/// The subjects of the facts that answer an ingest request of `project`.
fn verdict_subjects(project: &str) -> [String; 2] {
    [
        format!("stagehand.fact.dataset.validated.{project}"),
        format!("stagehand.fact.dataset.rejected.{project}"),
    ]
}

/// A live subscription to the project's validated/rejected facts: taken before the request
/// is published, so the answer cannot slip past it. A plain subscription, not a JetStream
/// consumer: an uploader's NATS user may read its own project's verdicts, but creating
/// consumers on the facts stream would let it read, or re-filter, anyone's.
pub async fn watch_outcomes(
    bus: &Bus,
    project: &str,
) -> anyhow::Result<Vec<async_nats::Subscriber>> {
    let mut subs = Vec::new();
    for subject in verdict_subjects(project) {
        subs.push(
            bus.client()
                .subscribe(subject.clone())
                .await
                .with_context(|| format!("subscribing to {subject}"))?,
        );
    }
    // The server has the subscriptions before the request goes out.
    bus.client().flush().await?;
    Ok(subs)
}

/// The answer to `request` among the project's *last* validated and rejected facts, read with
/// JetStream direct gets by subject (all an uploader may read of the stream). Used when the
/// request was a duplicate of an earlier run whose answer may already be stored.
async fn last_verdict(bus: &Bus, project: &str, request: &EventId) -> Option<Outcome> {
    for subject in verdict_subjects(project) {
        let api = format!("$JS.API.DIRECT.GET.{}.{subject}", FACTS.name);
        let Ok(Ok(answer)) = tokio::time::timeout(
            Duration::from_secs(5),
            bus.client().request(api, Default::default()),
        )
        .await
        else {
            continue;
        };
        if answer
            .status
            .is_some_and(|s| s != async_nats::StatusCode::OK)
        {
            continue;
        }
        let Ok(event) = stagehand_schemas::wire::decode(&answer.payload) else {
            continue;
        };
        if &event.correlation_id != request {
            continue;
        }
        match event.body {
            Body::DatasetValidated(v) => return Some(Outcome::Validated(v)),
            Body::DatasetRejected(r) => return Some(Outcome::Rejected(r)),
            _ => {}
        }
    }
    None
}

/// Waits for the fact that answers `request` (matched by correlation id).
pub async fn wait_outcome(
    subs: Vec<async_nats::Subscriber>,
    request: &EventId,
    timeout: Duration,
) -> anyhow::Result<Outcome> {
    let mut facts = futures::stream::select_all(subs);
    let wait = async {
        while let Some(message) = facts.next().await {
            let Ok(event) = stagehand_schemas::wire::decode(&message.payload) else {
                continue;
            };
            if &event.correlation_id != request {
                continue;
            }
            match event.body {
                Body::DatasetValidated(v) => return Ok(Outcome::Validated(v)),
                Body::DatasetRejected(r) => return Ok(Outcome::Rejected(r)),
                _ => continue,
            }
        }
        bail!("the connection closed before request {request} was answered")
    };
    tokio::time::timeout(timeout, wait)
        .await
        .with_context(|| format!("no validation of request {request} within {timeout:?} (is the ingest validator running?)"))?
}

/// Waits until the catalogue shows `outcome`, so that a `stagehand catalogue show` right after
/// `ingest --wait` sees it: the fact is in the stream before the recorder has folded it. A
/// catalogue that does not answer by the deadline is only warned about — the outcome itself is
/// already certain.
async fn wait_catalogued(
    bus: &Bus,
    project: &str,
    outcome: &Outcome,
    deadline: tokio::time::Instant,
) {
    use stagehand_catalogue::{Answer, Query};
    let (dataset, query) = match outcome {
        Outcome::Validated(v) => (
            &v.dataset,
            Query::Version {
                project: Some(project.to_owned()),
                dataset: v.dataset.clone(),
                version: v.version.clone(),
                limit: Some(1),
            },
        ),
        Outcome::Rejected(r) => (
            &r.dataset,
            Query::Rejection {
                project: Some(project.to_owned()),
                dataset: r.dataset.clone(),
                request_id: r.request_id.to_string(),
            },
        ),
    };
    let mut pause = Duration::from_millis(20);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            tracing::warn!(%project, %dataset, "the catalogue has not recorded the outcome yet");
            return;
        }
        match stagehand_catalogue::ask(bus.client(), &query, left.min(Duration::from_secs(2))).await
        {
            Ok(Answer::Version(_) | Answer::Rejection { .. }) => return,
            // An uploader's user may not query the catalogue: nothing to wait for.
            Err(_) if bus.was_denied(stagehand_schemas::subject::CATALOGUE_QUERY) => {
                tracing::debug!("this NATS user may not query the catalogue; not waiting for it");
                return;
            }
            _ => {}
        }
        tokio::time::sleep(pause.min(left)).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Options of one ingest.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    pub folder: PathBuf,
    pub project: String,
    pub dataset: String,
    pub tier: String,
    pub policies: PathBuf,
    pub requested_by: String,
    pub labels: Vec<(String, String)>,
    pub manifest: Option<PathBuf>,
    /// Wait for the validator's answer this long.
    pub wait: Option<Duration>,
    /// Show a progress bar (on a terminal, for large folders).
    pub progress: bool,
}

/// What an ingest did.
#[derive(Debug, Clone)]
pub struct IngestReport {
    pub request: Event,
    pub placed: Placed,
    /// Whether the request was new to the stream (false: a duplicate of an earlier run).
    pub published_new: bool,
    pub outcome: Option<Outcome>,
}

/// Bars appear only for folders at least this big (bytes), and only on a terminal.
pub const PROGRESS_FROM: u64 = 64 << 20;

/// Places the folder on the tier, publishes the request and optionally waits for the answer.
pub async fn ingest(bus: &Bus, opts: &IngestOptions) -> anyhow::Result<IngestReport> {
    check_name("project", &opts.project)?;
    check_name("dataset", &opts.dataset)?;
    if !stagehand_schemas::subject::is_subject_token(&opts.project) {
        bail!(
            "project {:?} must be 1-64 characters of [a-z0-9_-]",
            opts.project
        );
    }
    let policies = stagehand_policy::Policies::load_dir(&opts.policies)
        .with_context(|| format!("loading policies from {}", opts.policies.display()))?;
    let tier_policy = policies.tier(&opts.tier).with_context(|| {
        format!(
            "tier {:?} is not declared in {}",
            opts.tier,
            opts.policies.display()
        )
    })?;
    let Tier::Posix(tier) = tier_policy.open()? else {
        bail!(
            "tier {:?} is not a posix tier; ingest places files on posix tiers",
            opts.tier
        );
    };
    let declared = opts.manifest.as_deref().map(read_manifest).transpose()?;

    let folder = opts.folder.clone();
    let files = tokio::task::spawn_blocking(move || scan(&folder)).await??;
    let total: u64 = files.iter().map(|f| f.size).sum();
    let bar = if opts.progress && total >= PROGRESS_FROM {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("a valid progress template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let placed = place(
        &tier,
        &opts.folder,
        &opts.project,
        &opts.dataset,
        &files,
        declared.as_deref(),
        &bar,
    )
    .await?;
    bar.finish_and_clear();

    let manifest = declared.unwrap_or_else(|| placed.files.clone());
    let request = request(
        &opts.project,
        &opts.dataset,
        &opts.tier,
        &placed.prefix,
        manifest,
        &opts.requested_by,
        opts.labels.clone(),
    );
    let watch = match opts.wait {
        Some(_) => Some(watch_outcomes(bus, &opts.project).await?),
        None => None,
    };
    let ack = bus.publish(&request).await?;
    let outcome = match (watch, opts.wait) {
        (Some(watch), Some(timeout)) => {
            let deadline = tokio::time::Instant::now() + timeout;
            // A duplicate of an earlier run may have been answered before the subscription.
            let earlier = if ack.duplicate {
                last_verdict(bus, &opts.project, &request.id).await
            } else {
                None
            };
            let outcome = match earlier {
                Some(outcome) => outcome,
                None => wait_outcome(watch, &request.id, timeout)
                    .await
                    .map_err(|e| {
                        if ack.duplicate {
                            e.context(format!(
                                "request {} was published before (the same files); its answer is \
                             no longer the project's latest: see `stagehand catalogue show {}`",
                                request.id, opts.dataset
                            ))
                        } else {
                            e
                        }
                    })?,
            };
            wait_catalogued(bus, &opts.project, &outcome, deadline).await;
            Some(outcome)
        }
        _ => None,
    };
    Ok(IngestReport {
        request,
        placed,
        published_new: !ack.duplicate,
        outcome,
    })
}

/// The text `stagehand ingest` prints for an outcome; every problem on its own line.
pub fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Validated(v) => format!(
            "validated: {} version {} ({} files, {} bytes)\n",
            v.dataset,
            v.version,
            v.files.len(),
            v.total_bytes
        ),
        Outcome::Rejected(r) => {
            let mut out = format!("rejected: {} ({} problems)\n", r.dataset, r.problems.len());
            for p in &r.problems {
                out.push_str(&format!(
                    "  {:<20} {:<30} {}\n",
                    p.code,
                    p.path.as_deref().unwrap_or("-"),
                    p.detail
                ));
            }
            if let Some(q) = &r.quarantine {
                out.push_str(&format!("  quarantined: {q}\n"));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_refuses_a_symlink_that_leaves_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"x").unwrap();
        std::fs::write(dir.path().join("a.txt"), b"a").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("link")).unwrap();
        let err = scan(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("symlink link points to") && err.contains("refused"),
            "{err}"
        );
    }

    #[test]
    fn scan_lists_files_and_skips_inner_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b.bin"), b"bb").unwrap();
        std::fs::write(dir.path().join("a.txt"), b"a").unwrap();
        std::os::unix::fs::symlink(dir.path().join("a.txt"), dir.path().join("alias")).unwrap();
        let files = scan(dir.path()).unwrap();
        assert_eq!(
            files,
            vec![
                LocalFile {
                    rel: "a.txt".into(),
                    size: 1
                },
                LocalFile {
                    rel: "sub/b.bin".into(),
                    size: 2
                }
            ]
        );
    }

    #[tokio::test]
    async fn placing_twice_is_one_version_and_no_partial_prefix() {
        let folder = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        for i in 0..20 {
            std::fs::write(folder.path().join(format!("f{i}")), vec![i as u8; 1000 + i]).unwrap();
        }
        let tier = PosixTier::open("source", root.path()).unwrap();
        let files = scan(folder.path()).unwrap();
        let bar = ProgressBar::hidden();
        let a = place(&tier, folder.path(), "p", "d", &files, None, &bar)
            .await
            .unwrap();
        let b = place(&tier, folder.path(), "p", "d", &files, None, &bar)
            .await
            .unwrap();
        assert!(!a.existed && b.existed);
        assert_eq!(
            Placed {
                existed: false,
                ..b
            },
            a
        );
        let entries: Vec<_> = std::fs::read_dir(root.path().join("p/d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(entries.len(), 1, "no incoming folder left: {entries:?}");
        let f3 = a.files.iter().find(|f| f.path == "f3").unwrap();
        assert_eq!(f3.sha256, stagehand_schemas::sha256_hex(&[3u8; 1003]));
        let r1 = request("p", "d", "source", &a.prefix, a.files.clone(), "u", vec![]);
        let r2 = request("p", "d", "source", &a.prefix, a.files, "u", vec![]);
        assert_eq!(r1.id, r2.id, "the same upload is the same request");
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("dataset", "imagenet-1k_v2.0").is_ok());
        for bad in ["", ".hidden", "a/b", "../x", "sp ace"] {
            assert!(check_name("dataset", bad).is_err(), "{bad:?}");
        }
    }
}
