//! The audit of one tier for stray and lost data (`stagehand audit TIER`): what is on storage
//! beneath the tier's project folders is compared with what the catalogue says is there.
//!
//! It lives beside the scrub because both keep the catalogue and the tiers honest with each
//! other: the scrub reads what the catalogue lists and finds it damaged; the audit lists what
//! storage holds and finds what the catalogue does not list (**stray**) or lists but storage
//! lacks (**lost**). A lost replica is announced with `replica.damaged` (`found_by` `audit`,
//! every file `missing`), which withdraws its readiness like the scrub's damage does; the
//! scrub's next pass repairs it from another verified replica (`Scrubber::pass`).
//!
//! Copies in flight must not count as stray, so the audit reads the catalogue twice, around
//! the listing, and notes the facts stream's last sequence each time (the report's window):
//! a folder is stray only if no replica on the tier claims it (the replica's prefix is the
//! folder, beneath it, or above it) — nor, on a node's local tier, a checkpoint part committed
//! there (`Query::CheckpointPartsOn`: until it is offloaded, the only copy) — at either reading, no stage request still pending names
//! its version on the tier at either reading, nothing in it changed after the first reading,
//! and — for a writer's temporary (a staging folder, a temp file, a resharder's `prepare-`
//! folder) — it is older than the mover's own limit for resuming a staging folder
//! ([`stagehand_mover::SweepOptions::keep_sets_for`]). A replica is lost only if the
//! catalogue listed it present at both readings and its folder is not on storage.
//!
//! Stray data is never deleted. With quarantine asked for, each stray entry untouched for
//! `scrub.toml`'s `[audit] quarantine_after` is moved into
//! `<root>/.stagehand-quarantine/<date>/<path>`: on a posix tier by one confined rename, never
//! a copy; on an S3 tier, which has no rename, object by object with
//! [`stagehand_mover::s3::rename_object`] — the store copies the object, pinned to the ETag the
//! listing found, the copy is checked, and only then is the old key deleted, so no byte is
//! deleted that is not at its quarantine key. An entry with anything newer than the grace is
//! left whole; an object replaced since the listing stays where it is (the rest of its entry
//! moves, and the next audit finds it again). When the
//! stray bytes exceed `[audit] stop_above_fraction` of the tier's catalogued bytes, the audit
//! quarantines nothing and says a person must look: that much is more likely a catalogue
//! that lost track than garbage.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use serde::Serialize;
use stagehand_bus::Bus;
use stagehand_catalogue::{
    Catalogue, CatalogueError, ReplicaRecord, ReplicaState, StageState, StageStatus, views,
};
use stagehand_mover::s3::{ListedObject, Renamed, rename_object};
use stagehand_mover::{Tier, Time, TransferError};
use stagehand_policy::AuditPolicy;
use stagehand_schemas::subject::FACTS;
use stagehand_schemas::{
    Body, DamagedFile, Event, EventId, Location, ReplicaDamaged, Retryable, layout,
};
use time::OffsetDateTime;
use tracing::{info, warn};

/// `found_by` of the damage the audit finds.
pub const FOUND_BY: &str = "audit";

/// Stage requests asked of the catalogue at once.
const STAGES_PAGE: u32 = 500;

/// Why an audit stopped.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("asking the catalogue: {0}")]
    Catalogue(#[from] CatalogueError),
    #[error("the bus: {0}")]
    Bus(#[from] stagehand_bus::BusError),
    #[error("the facts stream {stream}: {detail}")]
    Stream {
        stream: &'static str,
        detail: String,
    },
    #[error("listing tier {tier} at {path}: {source}")]
    List {
        tier: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Tier(#[from] Box<TransferError>),
    #[error("the listing task of tier {0} failed")]
    Task(String),
}

impl Retryable for AuditError {
    fn is_retryable(&self) -> bool {
        match self {
            AuditError::Catalogue(e) => e.is_retryable(),
            AuditError::Bus(e) => e.is_retryable(),
            AuditError::Stream { .. } | AuditError::List { .. } => true,
            AuditError::Tier(e) => e.is_retryable(),
            AuditError::Task(_) => false,
        }
    }
}

/// What one audit looks at and may do.
#[derive(Debug, Clone)]
pub struct AuditOptions {
    /// The tier's name in `tiers.toml`.
    pub tier: String,
    /// On a node-local tier, the node whose copies this tier's root holds.
    pub node: Option<String>,
    /// `scrub.toml`'s `[audit]`.
    pub policy: AuditPolicy,
    /// Rename stray entries older than `policy.quarantine_after` into the quarantine folder.
    pub quarantine: bool,
    /// A writer's temporary younger than this may still be a copy in flight.
    pub staging_grace: Duration,
}

impl AuditOptions {
    /// The audit of `tier` under `policy`: reporting only, the mover's staging grace.
    pub fn new(tier: &str, policy: AuditPolicy) -> Self {
        AuditOptions {
            tier: tier.to_owned(),
            node: None,
            policy,
            quarantine: false,
            staging_grace: stagehand_mover::SweepOptions::default().keep_sets_for,
        }
    }
}

/// What kind of thing a stray entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StrayKind {
    /// A folder no replica claims.
    Folder,
    /// A file no replica claims, outside any version's folder.
    File,
    /// A writer's temporary (staging folder, temp file, `prepare-` folder) left behind.
    Staging,
}

impl StrayKind {
    /// Its name, as `--json` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            StrayKind::Folder => "folder",
            StrayKind::File => "file",
            StrayKind::Staging => "staging",
        }
    }
}

/// One stray entry: a folder or file beneath a project's folder that nothing explains.
#[derive(Debug, Clone, Serialize)]
pub struct Stray {
    pub project: String,
    /// Beneath the tier's root.
    pub path: String,
    pub kind: StrayKind,
    pub files: u64,
    pub bytes: u64,
    /// The newest modification of anything in it (posix: mtime; S3: last-modified).
    #[serde(with = "time::serde::rfc3339::option")]
    pub modified: Option<OffsetDateTime>,
    /// Where the audit renamed it, when it did (beneath the tier's root).
    pub quarantined_to: Option<String>,
}

/// One lost replica: catalogued present, absent on storage.
#[derive(Debug, Clone, Serialize)]
pub struct Lost {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub prefix: String,
    pub node: Option<String>,
    /// The `replica.damaged` published for it; none when the audit stopped at its threshold.
    pub damaged_fact: Option<String>,
}

/// One project's line of the report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ProjectAudit {
    pub stray: u64,
    pub stray_bytes: u64,
    pub quarantined: u64,
    pub lost: u64,
}

/// What one audit of a tier found and did.
#[derive(Debug, Clone, Serialize)]
pub struct AuditReport {
    pub tier: String,
    pub node: Option<String>,
    /// The facts stream's last sequence at the first and at the second reading of the
    /// catalogue: what happened between is judged in flight.
    pub window: (u64, u64),
    /// Bytes of the replicas present on the tier (the threshold's base).
    pub catalogued_bytes: u64,
    pub stray_bytes: u64,
    /// Bytes of the replicas found lost.
    pub lost_bytes: u64,
    /// Entries left out as copies in flight (a pending stage, a young temporary, a change
    /// during the audit, an entry gone while the tier was listed).
    pub in_flight: u64,
    /// The stray or the lost bytes were above `stop_above_fraction` of the catalogued bytes:
    /// no lost replica was announced, nothing was quarantined, and a person must look.
    pub stopped: bool,
    pub stray: Vec<Stray>,
    pub lost: Vec<Lost>,
}

impl AuditReport {
    /// Whether anything stray or lost was found.
    pub fn found_anything(&self) -> bool {
        !self.stray.is_empty() || !self.lost.is_empty()
    }

    /// Per project (in name order): stray entries and bytes, quarantined entries, lost replicas.
    pub fn per_project(&self) -> BTreeMap<String, ProjectAudit> {
        let mut out: BTreeMap<String, ProjectAudit> = BTreeMap::new();
        for s in &self.stray {
            let p = out.entry(s.project.clone()).or_default();
            p.stray += 1;
            p.stray_bytes += s.bytes;
            p.quarantined += u64::from(s.quarantined_to.is_some());
        }
        for l in &self.lost {
            out.entry(l.project.clone()).or_default().lost += 1;
        }
        out
    }
}

/// One reading of the catalogue: the prefixes replicas on the tier claim, the replicas present
/// there, the stage requests pending on it, and the facts stream's position before it.
struct Reading {
    sequence: u64,
    claimed: BTreeSet<String>,
    present: BTreeMap<String, ReplicaRecord>,
    pending: Vec<StageStatus>,
}

impl Reading {
    async fn take(
        bus: &Bus,
        catalogue: &Catalogue,
        opts: &AuditOptions,
    ) -> Result<Reading, AuditError> {
        let sequence = facts_sequence(bus).await?;
        let node = opts.node.as_deref();
        let replicas = views::replicas_on(catalogue, &opts.tier, node).await?;
        let mut claimed: BTreeSet<String> = replicas
            .iter()
            .filter(|r| r.state != ReplicaState::Removed)
            .map(|r| r.prefix.clone())
            .collect();
        // A checkpoint part on a node's local tier is no replica, and until it is offloaded
        // the only copy of its part of the step: never stray.
        if let Some(node) = node {
            let parts = catalogue
                .checkpoint_parts_on(&opts.tier, Some(node))
                .await?;
            claimed.extend(parts.into_iter().map(|p| p.location.prefix));
        }
        let present = replicas
            .into_iter()
            .filter(|r| r.state == ReplicaState::Present)
            .map(|r| (r.prefix.clone(), r))
            .collect();
        let mut pending = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let (page, _) = catalogue
                .open_stages(
                    StageState::Pending,
                    &[],
                    Some(STAGES_PAGE),
                    after.as_deref(),
                )
                .await?;
            pending.extend(
                (page.items.into_iter())
                    .filter(|s| s.tier == opts.tier && s.node.as_deref() == node),
            );
            match page.next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        Ok(Reading {
            sequence,
            claimed,
            present,
            pending,
        })
    }

    /// How the replicas' prefixes stand to `path`.
    fn judge(&self, path: &str) -> Claim {
        let mut at = path;
        loop {
            if self.claimed.contains(at) {
                return Claim::Claimed;
            }
            match at.rsplit_once('/') {
                Some((parent, _)) => at = parent,
                None => break,
            }
        }
        let beneath = format!("{path}/");
        match self.claimed.range(beneath.clone()..).next() {
            Some(c) if c.starts_with(&beneath) => Claim::Above,
            _ => Claim::Unclaimed,
        }
    }

    /// Whether a pending stage request explains what is at `path` (`project/dataset[/name]`).
    fn stage_in_flight(&self, path: &str, opts: &AuditOptions) -> bool {
        let mut parts = path.splitn(4, '/');
        let (Some(project), Some(dataset)) = (parts.next(), parts.next()) else {
            return false;
        };
        let name = parts.next().map(|n| final_name(n).unwrap_or(n));
        self.pending.iter().any(|s| {
            s.project == project
                && s.dataset == dataset
                && name.is_none_or(|v| {
                    views::stages(s, v, &opts.tier, opts.node.as_deref())
                        // A stage waiting on a preparation lands in a `prepare-` folder first.
                        || layout::is_prepare_folder_name(v)
                })
        })
    }
}

/// How the catalogue's replicas stand to one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// It is a replica's folder, or beneath one.
    Claimed,
    /// A replica's folder lies beneath it: look inside.
    Above,
    Unclaimed,
}

/// The final name a temporary is bound for (`.<stem>.stagehand-…` → `<stem>`).
fn final_name(name: &str) -> Option<&str> {
    if !layout::is_temporary_name(name) {
        return None;
    }
    let end = name.find(layout::TEMPORARY_MARK)?;
    name.get(1..end)
}

/// The facts stream's last sequence now.
async fn facts_sequence(bus: &Bus) -> Result<u64, AuditError> {
    let stream_err = |e: &dyn std::fmt::Display| AuditError::Stream {
        stream: FACTS.name,
        detail: e.to_string(),
    };
    let mut stream = (bus.jetstream().get_stream(FACTS.name).await).map_err(|e| stream_err(&e))?;
    let info = stream.info().await.map_err(|e| stream_err(&e))?;
    Ok(info.state.last_sequence)
}

/// A candidate found on storage: an entry nothing claimed at the first reading.
#[derive(Debug, Clone)]
struct Candidate {
    path: String,
    is_dir: bool,
    files: u64,
    bytes: u64,
    modified: Option<SystemTime>,
    /// On an S3 tier, its objects as listed (what a quarantine moves, each pinned to its
    /// ETag); on a posix tier, none: the folder or file moves by one rename.
    objects: Vec<ListedObject>,
}

/// What the listing of a tier found: candidates, and which replica folders are there.
#[derive(Debug, Default)]
struct Listing {
    candidates: Vec<Candidate>,
    /// Of the prefixes asked about, those with something on storage.
    found: BTreeSet<String>,
    /// Entries that went while they were listed: a writer published (renamed) or removed its
    /// temporary meanwhile, so they are copies in flight, not stray.
    vanished: u64,
}

/// Lists a posix tier beneath its project folders, descending only where a replica's folder
/// lies beneath, so claimed folders are never walked. The tier is live while it is walked: an
/// entry that is gone by the time it is read (a staging folder published by its rename, a
/// temporary removed) is counted in [`Listing::vanished`], not an error.
fn list_posix(root: &Path, tier: &str, reading: &Reading) -> Result<Listing, AuditError> {
    let list_err = |path: &Path, source| AuditError::List {
        tier: tier.to_owned(),
        path: path.display().to_string(),
        source,
    };
    let mut listing = Listing::default();
    for prefix in reading.present.keys() {
        match std::fs::symlink_metadata(root.join(prefix)) {
            Ok(m) if m.is_dir() => {
                listing.found.insert(prefix.clone());
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(list_err(&root.join(prefix), e)),
        }
    }
    let mut stack: Vec<String> = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|e| list_err(root, e))? {
        let entry = entry.map_err(|e| list_err(root, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        // Only project folders are Stagehand's; the quarantine folder and anything else at
        // the root (another user's data on a shared filesystem) are not audited.
        if layout::check_project(&name).is_ok() && entry.file_type().is_ok_and(|t| t.is_dir()) {
            stack.push(name);
        }
    }
    // Folders whose entries are looked at: project folders, and folders above a replica's.
    while let Some(dir) = stack.pop() {
        let at = root.join(&dir);
        let entries = match std::fs::read_dir(&at) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                listing.vanished += 1;
                continue;
            }
            Err(e) => return Err(list_err(&at, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| list_err(&at, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = format!("{dir}/{name}");
            match reading.judge(&path) {
                Claim::Claimed => {}
                Claim::Above => {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        stack.push(path);
                    }
                }
                Claim::Unclaimed => {
                    let (files, bytes, modified) = match measure(&root.join(&path)) {
                        Ok(measured) => measured,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            listing.vanished += 1;
                            continue;
                        }
                        Err(e) => return Err(list_err(&root.join(&path), e)),
                    };
                    let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                    listing.candidates.push(Candidate {
                        path,
                        is_dir,
                        files,
                        bytes,
                        modified,
                        objects: Vec::new(),
                    });
                }
            }
        }
    }
    Ok(listing)
}

/// Files, bytes and newest modification of everything at `path` (symlinks not followed).
/// `path` itself gone is `NotFound`; an entry beneath it that goes while it is measured (a
/// temporary file renamed into place or removed) is left out.
fn measure(path: &Path) -> std::io::Result<(u64, u64, Option<SystemTime>)> {
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let meta = std::fs::symlink_metadata(path)?;
    let mut newest = meta.modified().ok();
    if !meta.is_dir() {
        return Ok((1, meta.len(), newest));
    }
    let (mut files, mut bytes) = (0u64, 0u64);
    let mut stack = vec![path.to_owned()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if dir == path => return Err(e),
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let meta = match entry.metadata() {
                Ok(meta) => meta,
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(e),
            };
            newest = newest.max(meta.modified().ok());
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                files += 1;
                bytes += meta.len();
            }
        }
    }
    Ok((files, bytes, newest))
}

/// Lists an S3 tier: every object, grouped into the entries nothing claims the way
/// [`list_posix`] would find them (the shortest unclaimed path beneath a project's folder),
/// each with its newest object's last-modified time and its objects.
async fn list_s3(
    tier: &stagehand_mover::s3::S3Tier,
    reading: &Reading,
) -> Result<Listing, AuditError> {
    let mut listing = Listing::default();
    let mut by_path: BTreeMap<String, Candidate> = BTreeMap::new();
    let mut token = None;
    loop {
        let (objects, next) = tier
            .list_stamped_page("", token.take())
            .await
            .map_err(Box::new)?;
        for object in objects {
            judge_object(reading, &mut listing, &mut by_path, object);
        }
        match next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    listing.candidates = by_path.into_values().collect();
    Ok(listing)
}

/// Places one listed object: in the claimed folder it lies in, or in the unclaimed entry it
/// makes stray.
fn judge_object(
    reading: &Reading,
    listing: &mut Listing,
    by_path: &mut BTreeMap<String, Candidate>,
    object: ListedObject,
) {
    let parts: Vec<&str> = object.rel.split('/').collect();
    if parts.len() < 2 || layout::check_project(parts[0]).is_err() {
        return;
    }
    for depth in 2..=parts.len() {
        let path = parts[..depth].join("/");
        match reading.judge(&path) {
            Claim::Claimed => {
                // The replica's folder is the claimed path this key lies in.
                if let Some(p) = (2..=depth)
                    .map(|d| parts[..d].join("/"))
                    .find(|p| reading.present.contains_key(p))
                {
                    listing.found.insert(p);
                }
                return;
            }
            Claim::Above => continue,
            Claim::Unclaimed => {
                let c = by_path.entry(path.clone()).or_insert(Candidate {
                    path,
                    is_dir: depth < parts.len(),
                    files: 0,
                    bytes: 0,
                    modified: None,
                    objects: Vec::new(),
                });
                let modified = system_time(object.modified);
                c.files += 1;
                c.bytes += object.size;
                c.modified = c.modified.max(Some(modified));
                c.objects.push(object);
                return;
            }
        }
    }
}

/// An object store's time as a [`SystemTime`] (before 1970: 1970).
fn system_time(t: Time) -> SystemTime {
    let since = Duration::new(t.secs.max(0) as u64, t.nanos);
    SystemTime::UNIX_EPOCH + since
}

/// Audits `tier` (opened from `tiers.toml`): reads the catalogue, lists storage, reads the
/// catalogue again, and judges; publishes `replica.damaged` for each lost replica and, when
/// asked and not stopped, quarantines stray entries older than the grace.
pub async fn audit(
    bus: &Bus,
    catalogue: &Catalogue,
    tier: &Tier,
    opts: &AuditOptions,
) -> Result<AuditReport, AuditError> {
    let started = SystemTime::now();
    let first = Reading::take(bus, catalogue, opts).await?;
    let (listing, first) = match tier {
        Tier::Posix(posix) => {
            let root = posix.root().to_owned();
            let name = opts.tier.clone();
            tokio::task::spawn_blocking(move || {
                let listing = list_posix(&root, &name, &first);
                listing.map(|l| (l, first))
            })
            .await
            .map_err(|_| AuditError::Task(opts.tier.clone()))??
        }
        Tier::S3(s3) => (list_s3(s3, &first).await?, first),
    };
    let second = Reading::take(bus, catalogue, opts).await?;

    let mut report = AuditReport {
        tier: opts.tier.clone(),
        node: opts.node.clone(),
        window: (first.sequence, second.sequence),
        catalogued_bytes: second.present.values().map(|r| r.total_bytes).sum(),
        stray_bytes: 0,
        lost_bytes: 0,
        in_flight: listing.vanished,
        stopped: false,
        stray: Vec::new(),
        lost: Vec::new(),
    };
    let now = SystemTime::now();
    let mut objects = BTreeMap::new();
    for c in listing.candidates {
        if second.judge(&c.path) != Claim::Unclaimed {
            continue;
        }
        let name = c.path.rsplit('/').next().unwrap_or(&c.path);
        let temporary = layout::is_temporary_name(name) || layout::is_prepare_folder_name(name);
        let age = c
            .modified
            .map(|m| now.duration_since(m).unwrap_or_default());
        let in_flight = first.stage_in_flight(&c.path, opts)
            || second.stage_in_flight(&c.path, opts)
            // Changed after the first reading: written by something the catalogue does not
            // know of yet.
            || c.modified.is_some_and(|m| m >= started)
            || (temporary && age.is_none_or(|a| a < opts.staging_grace));
        if in_flight {
            report.in_flight += 1;
            continue;
        }
        let project = c.path.split('/').next().unwrap_or_default().to_owned();
        let kind = match (temporary, c.is_dir) {
            (true, _) => StrayKind::Staging,
            (false, true) => StrayKind::Folder,
            (false, false) => StrayKind::File,
        };
        report.stray_bytes += c.bytes;
        objects.insert(c.path.clone(), c.objects);
        report.stray.push(Stray {
            project,
            path: c.path,
            kind,
            files: c.files,
            bytes: c.bytes,
            modified: c.modified.map(OffsetDateTime::from),
            quarantined_to: None,
        });
    }
    report.stray.sort_by(|a, b| a.path.cmp(&b.path));

    // Lost: catalogued present at both readings, absent on storage. Judged before anything
    // is announced: a root that lists empty (a filesystem not mounted, an audit run on
    // another node's machine) makes every copy look lost, and announcing them all would
    // withdraw every copy from readiness and send repairs onto the wrong disk.
    let lost: Vec<(&String, &ReplicaRecord)> = first
        .present
        .iter()
        .filter(|(prefix, _)| {
            !listing.found.contains(*prefix) && second.present.contains_key(*prefix)
        })
        .collect();
    report.lost_bytes = lost.iter().map(|(_, r)| r.total_bytes).sum();
    let limit = opts.policy.stop_above_fraction * report.catalogued_bytes as f64;
    let above = |bytes: u64| bytes > 0 && bytes as f64 > limit;
    report.stopped = above(report.stray_bytes) || above(report.lost_bytes);
    for (prefix, r) in lost {
        let damaged_fact = if report.stopped {
            None
        } else {
            Some(publish_lost(bus, catalogue, opts, r).await?)
        };
        report.lost.push(Lost {
            project: r.project.clone(),
            dataset: r.dataset.clone(),
            version: r.version.clone(),
            prefix: prefix.clone(),
            node: r.node.clone(),
            damaged_fact,
        });
    }

    if report.stopped {
        warn!(tier = %opts.tier, stray_bytes = report.stray_bytes, lost_bytes = report.lost_bytes, catalogued_bytes = report.catalogued_bytes, "stray or lost data above the audit's threshold: nothing announced lost, nothing quarantined, a person must look (runbooks/stray-data.md)");
    } else if opts.quarantine {
        quarantine(tier, opts, &mut report.stray, &mut objects).await?;
    }
    Ok(report)
}

/// Moves each stray entry untouched for `[audit] quarantine_after` into the quarantine
/// folder (`objects`: an S3 entry's objects as listed), recording where in its
/// `quarantined_to`. An entry something else already took the quarantine path of, or (on S3)
/// with an object changed since it was listed, stays where it is, with a warning.
async fn quarantine(
    tier: &Tier,
    opts: &AuditOptions,
    stray: &mut [Stray],
    objects: &mut BTreeMap<String, Vec<ListedObject>>,
) -> Result<(), AuditError> {
    let now = OffsetDateTime::now_utc();
    let grace =
        time::Duration::try_from(opts.policy.quarantine_after).unwrap_or(time::Duration::MAX);
    let date = now.date().to_string();
    for s in stray {
        if s.modified.is_none_or(|m| now - m < grace) {
            continue;
        }
        let to = layout::quarantine_path(&date, &s.path);
        let moved = match tier {
            Tier::Posix(posix) => {
                let (posix, from, dest) = (posix.clone(), s.path.clone(), to.clone());
                tokio::task::spawn_blocking(move || posix.rename_dir_noreplace(&from, &dest))
                    .await
                    .map_err(|_| AuditError::Task(opts.tier.clone()))?
                    .map_err(Box::new)?
            }
            Tier::S3(s3) => {
                let listed = objects.remove(&s.path).unwrap_or_default();
                quarantine_objects(s3, &opts.tier, &date, &listed).await?
            }
        };
        if moved {
            info!(tier = %opts.tier, from = %s.path, to = %to, bytes = s.bytes, "stray data quarantined");
            s.quarantined_to = Some(to);
        } else {
            warn!(tier = %opts.tier, from = %s.path, to = %to, "not quarantined: something is already at the quarantine path, or it changed since it was listed");
        }
    }
    Ok(())
}

/// Moves one S3 stray entry's `listed` objects beneath the quarantine folder of `date`, each
/// pinned to its listed ETag; `false` when any was replaced since it was listed or its
/// quarantine key is taken (those stay; the next audit finds them again). An error (the store
/// unreachable, a copy that did not check) stops the audit with every object not yet moved in
/// place.
async fn quarantine_objects(
    s3: &stagehand_mover::s3::S3Tier,
    tier: &str,
    date: &str,
    listed: &[ListedObject],
) -> Result<bool, AuditError> {
    let mut all = !listed.is_empty();
    for object in listed {
        let to = layout::quarantine_path(date, &object.rel);
        match rename_object(s3, &object.rel, &to, &object.etag).await {
            Ok(Renamed::Moved) => {}
            Ok(Renamed::DestinationTaken) => all = false,
            Err(e) if e.kind == stagehand_mover::ErrorKind::SourceChanged => {
                warn!(%tier, object = %object.rel, error = %e, "not quarantined: changed since it was listed");
                all = false;
            }
            Err(e) => return Err(AuditError::Tier(Box::new(e))),
        }
    }
    Ok(all)
}

/// Announces `r` lost: `replica.damaged` (`found_by` `audit`), its files (the first
/// [`ReplicaDamaged::MAX_LISTED`]) each `missing`. Its id follows from the fact that made the
/// replica what it is, so audits repeated before the catalogue folds it publish it once.
async fn publish_lost(
    bus: &Bus,
    catalogue: &Catalogue,
    opts: &AuditOptions,
    r: &ReplicaRecord,
) -> Result<String, AuditError> {
    let mut files = Vec::new();
    let listed = catalogue.all_files(
        Some(r.project.clone()),
        r.dataset.clone(),
        r.version.clone(),
        ReplicaDamaged::MAX_LISTED as u32,
        None,
    );
    let mut listed = std::pin::pin!(listed);
    while let Some(f) = listed.try_next().await? {
        files.push(DamagedFile {
            path: f.path,
            how: "missing".into(),
            expected_size: None,
            found_size: None,
        });
        if files.len() == ReplicaDamaged::MAX_LISTED {
            break;
        }
    }
    let made = r
        .stamp
        .as_ref()
        .map(|s| s.event_id.to_string())
        .unwrap_or_default();
    let id = EventId::for_content(&[
        FOUND_BY.as_bytes(),
        r.project.as_bytes(),
        opts.tier.as_bytes(),
        r.node.as_deref().unwrap_or("").as_bytes(),
        r.prefix.as_bytes(),
        made.as_bytes(),
    ]);
    let fact = Event::request(
        EventId::for_fact(&r.project, &id, "damaged"),
        r.project.clone(),
        Body::ReplicaDamaged(ReplicaDamaged {
            dataset: r.dataset.clone(),
            version: r.version.clone(),
            location: Location {
                tier: opts.tier.clone(),
                prefix: r.prefix.clone(),
            },
            node: r.node.clone(),
            found_by: FOUND_BY.into(),
            damaged_total: r.files.max(files.len() as u64),
            files,
            reason: "catalogued present, and its folder is not on the tier (stagehand audit); readiness withdrawn until it is repaired from another verified replica or copied again".into(),
        }),
    );
    bus.publish(&fact).await?;
    warn!(tier = %opts.tier, prefix = %r.prefix, "a catalogued replica is not on its tier: announced damaged");
    Ok(fact.id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards the walk of a live tier: staging folders published (renamed to their final
    /// name) and removed while the audit lists the tier are never an error, only entries gone
    /// meanwhile; a measured path that is gone is `NotFound`, for the walk to leave out.
    #[test]
    fn a_tier_written_while_it_is_listed_lists_without_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        let birds = root.join("lab/birds");
        std::fs::create_dir_all(&birds).unwrap();
        // A replica of the dataset is there, so the dataset's folder is walked entry by entry.
        std::fs::create_dir_all(birds.join("kept")).unwrap();
        let reading = Reading {
            sequence: 0,
            claimed: BTreeSet::from(["lab/birds/kept".to_owned()]),
            present: BTreeMap::new(),
            pending: Vec::new(),
        };
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..4000 {
                    let staging = birds.join(format!(".v{i}.stagehand-set-0"));
                    std::fs::create_dir(&staging).unwrap();
                    for f in 0..2 {
                        std::fs::write(staging.join(format!("f{f}")), b"bytes").unwrap();
                    }
                    let published = birds.join(format!("v{i}"));
                    std::fs::rename(&staging, &published).unwrap();
                    std::fs::remove_dir_all(&published).unwrap();
                }
                done.store(true, std::sync::atomic::Ordering::Release);
            });
            let mut listings = 0;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                let listing = list_posix(&root, "hot", &reading);
                assert!(listing.is_ok(), "listing {listings}: {listing:?}");
                listings += 1;
            }
        });
        let gone = measure(&root.join("lab/birds/v0")).unwrap_err();
        assert_eq!(gone.kind(), std::io::ErrorKind::NotFound);
    }
}
