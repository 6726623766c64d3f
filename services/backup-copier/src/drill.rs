//! Restore drills: on the policy's clock, restore a sample of what the backup tier holds to a
//! scratch folder, verify every restored byte, record the result, clean up.
//!
//! **What is drilled.** The catalogue's `backup_status` answer lists every version with a
//! copy on the backup tier and its last drill. Versions never drilled come first (oldest
//! backup first), then the one whose last drill is oldest; a drill takes them in that order
//! until its budget — `drill_sample_files` files and `drill_sample_bytes` bytes — is spent. A
//! version that fits the remaining budget is restored whole; a larger one contributes a sample
//! of its files, chosen by a hash of the drill id and each path (uniform, reproducible from the
//! id, and a different sample each drill), so repeated drills cover it all in time.
//!
//! **What is verified.** For each version the manifest kept inside the backup is restored
//! first and must hash to the version digest the catalogue records — which commits to every
//! file's size and SHA-256 — and hold the file count and bytes the catalogue records. Then
//! each sampled file is restored through the mover, which hashes every byte it reads from the
//! backup tier and refuses a file whose size or hash differs from the manifest. Every problem
//! is kept (with the file's path and a stable code); the scratch copy is removed afterwards.
//!
//! **What is recorded.** One fact per drilled version: `restore.verified` (files and bytes
//! sampled) or `restore.failed` (every problem, bounded as the contract bounds them). A failure
//! to reach the backup tier, NATS or the catalogue is not a verdict on the backup: that
//! version's drill is left for the next one, and said in the log.
//!
//! **When.** The clock looks every `drill_check` whether a drill is due: no drill on this
//! backup tier, recorded in the catalogue or started by this process, within `drill_every`. A
//! claim in the `stagehand_claims` bucket (one key per backup tier and period) keeps two
//! copier instances from drilling the same period twice.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use stagehand_bus::Bus;
use stagehand_catalogue::{Catalogue, ReplicaRecord, VersionBackups};
use stagehand_manifest::Manifest;
use stagehand_mover::{
    CancellationToken, CopyOptions, ErrorKind, FileRef, Priority, Progress, Tier,
};
use stagehand_schemas::problem::{ProblemTally, code};
use stagehand_schemas::{
    Body, Event, EventId, Location, Problem, RestoreFailed, RestoreVerified, SCHEMA_VERSION,
    sha256_hex,
};
use time::OffsetDateTime;
use tracing::{info, warn};

use crate::copier::Copier;
use crate::error::BackupError;
use stagehand_schemas::Retryable;

/// Versions asked of the catalogue per page while listing what to drill.
const PAGE: u32 = 1000;

/// A version with a present copy on the backup tier, as the catalogue lists it.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub version: VersionBackups,
    /// Its copy on the backup tier.
    pub replica: ReplicaRecord,
}

impl Candidate {
    /// When its copy was last drilled (none: never).
    pub fn last_drilled(&self) -> Option<OffsetDateTime> {
        self.replica.last_drill.as_ref().map(|d| d.stamp.at)
    }

    fn backed_up(&self) -> Option<OffsetDateTime> {
        self.replica.copied.as_ref().map(|s| s.at)
    }
}

/// What a drill found for one version.
#[derive(Debug, Clone)]
pub struct DrillResult {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub sampled_files: u64,
    pub sampled_bytes: u64,
    /// Every problem found (empty: verified).
    pub problems: Vec<Problem>,
    /// The fact recorded (`restore.verified` or `restore.failed`).
    pub fact: Event,
}

/// What one drill did.
#[derive(Debug, Clone)]
pub struct DrillReport {
    pub drill_id: EventId,
    pub results: Vec<DrillResult>,
    /// Versions whose drill could not reach a verdict (a tier or NATS unavailable), with why.
    pub inconclusive: Vec<(String, String)>,
}

/// The order drills take versions in: never drilled first (oldest backup first), then by the
/// age of their last drill.
pub fn drill_order(candidates: &mut [Candidate]) {
    candidates.sort_by_key(|c| {
        (
            c.last_drilled().is_some(),
            c.last_drilled(),
            c.backed_up(),
            (c.version.project.clone(), c.version.dataset.clone()),
        )
    });
}

/// Whether a drill is due at `now`: nothing is protected yet, or no copy was drilled within
/// `every`.
pub fn drill_due(candidates: &[Candidate], now: OffsetDateTime, every: Duration) -> bool {
    if candidates.is_empty() {
        return false;
    }
    match candidates.iter().filter_map(Candidate::last_drilled).max() {
        None => true,
        Some(newest) => now - newest >= every,
    }
}

/// Sets the drill gauges of backup tier `tier` in the work metrics
/// ([`stagehand_telemetry::work::drill_survey`]): the versions protected there, those never
/// drilled, those whose last drill failed, and when the newest drill ran. `drilled` (a drill
/// just run at `now`) counts over what the catalogue said of the versions it reached a verdict
/// on, so a failure shows before the catalogue has folded its fact.
pub fn record_survey(
    tier: &str,
    candidates: &[Candidate],
    drilled: Option<&DrillReport>,
    now: OffsetDateTime,
    every: Duration,
) {
    let verdict = |c: &Candidate| {
        drilled.and_then(|r| {
            r.results
                .iter()
                .find(|d| {
                    d.project == c.version.project
                        && d.dataset == c.version.dataset
                        && d.version == c.version.version
                })
                .map(|d| (now, d.problems.is_empty()))
        })
    };
    let last: Vec<Option<(OffsetDateTime, bool)>> = candidates
        .iter()
        .map(|c| verdict(c).or_else(|| c.replica.last_drill.as_ref().map(|d| (d.stamp.at, d.ok))))
        .collect();
    let count = |f: fn(&Option<(OffsetDateTime, bool)>) -> bool| {
        last.iter().filter(|l| f(l)).count() as u64
    };
    stagehand_telemetry::work::drill_survey(&stagehand_telemetry::work::DrillSurvey {
        tier: tier.to_owned(),
        protected: candidates.len() as u64,
        never: count(|l| l.is_none()),
        failed: count(|l| matches!(l, Some((_, false)))),
        last_drill_unix: last
            .iter()
            .flatten()
            .map(|(at, _)| *at)
            .max()
            .map(|at| at.unix_timestamp_nanos() as f64 / 1e9),
        interval: every,
    });
}

/// Files of `manifest` a drill with `files_left` files and `bytes_left` bytes to spend
/// restores, in path order: all of them when they fit, else a sample ranked by a hash of the
/// drill id and each path, taken while it fits the bytes. Blocking (reads the manifest).
pub fn sample(
    manifest: &Manifest,
    drill_id: &EventId,
    files_left: u64,
    bytes_left: u64,
) -> Result<Vec<FileRef>, BackupError> {
    if manifest.files() <= files_left && manifest.bytes() <= bytes_left {
        return Ok(manifest.entries().collect::<Result<_, _>>()?);
    }
    let keep = usize::try_from(files_left).unwrap_or(usize::MAX);
    // The `keep` lowest ranks; the heap's top is the highest rank kept.
    let mut heap: BinaryHeap<(u64, Reverse<String>, u64, String)> = BinaryHeap::new();
    for entry in manifest.entries() {
        let f = entry?;
        if f.size > bytes_left {
            continue;
        }
        let rank = rank(drill_id, &f.path);
        if heap.len() < keep {
            heap.push((rank, Reverse(f.path), f.size, f.sha256));
        } else if heap.peek().is_some_and(|top| rank < top.0) {
            heap.pop();
            heap.push((rank, Reverse(f.path), f.size, f.sha256));
        }
    }
    let mut ranked = heap.into_vec();
    ranked.sort();
    let mut bytes = 0u64;
    let mut out = Vec::new();
    for (_, Reverse(path), size, sha) in ranked {
        if bytes + size <= bytes_left {
            bytes += size;
            out.push(FileRef::new(path, size, sha));
        }
    }
    out.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    Ok(out)
}

fn rank(drill_id: &EventId, path: &str) -> u64 {
    let hex = sha256_hex(format!("{drill_id}\0{path}").as_bytes());
    u64::from_str_radix(&hex[..16], 16).unwrap_or(u64::MAX)
}

/// The problem code for a file the mover could not restore, or `None` when the failure says
/// nothing about the backup (the tier was unreachable, the drill was cancelled).
fn problem_code(kind: ErrorKind) -> Option<&'static str> {
    Some(match kind {
        ErrorKind::ChecksumMismatch | ErrorKind::DestinationConflict => code::CHECKSUM_MISMATCH,
        ErrorKind::SizeMismatch | ErrorKind::SourceChanged => code::SIZE_MISMATCH,
        ErrorKind::NotFound => code::MISSING,
        ErrorKind::NotAFile => code::NOT_A_FILE,
        ErrorKind::TooLarge => code::TOO_LARGE,
        ErrorKind::PathRefused | ErrorKind::ObjectRefused | ErrorKind::PermissionDenied => {
            code::UNREADABLE
        }
        // Unreachable, throttled, cancelled, out of scratch space, I/O, a server error: no
        // verdict on the backup.
        _ => return None,
    })
}

/// Why one version's drill ended without a verdict.
struct Inconclusive(String);

impl Copier {
    /// Every version with a present copy on the backup tier, from the catalogue, in drill
    /// order.
    pub async fn drill_candidates(
        &self,
        catalogue: &Catalogue,
    ) -> Result<Vec<Candidate>, BackupError> {
        let tier = self.target.name.clone();
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = catalogue
                .backup_status(None, Some(&tier), true, Some(PAGE), after.as_deref())
                .await?;
            for version in page.items {
                if let Some(replica) = version.on(&tier).cloned() {
                    out.push(Candidate { version, replica });
                }
            }
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        drill_order(&mut out);
        Ok(out)
    }

    /// Runs one drill over `candidates` (in drill order) and publishes a fact for each
    /// version it reached a verdict on.
    pub async fn drill(
        &self,
        bus: &Bus,
        candidates: &[Candidate],
        drill_id: &EventId,
        cancel: &CancellationToken,
    ) -> Result<DrillReport, BackupError> {
        let mut files_left = u64::from(self.policy.drill_sample_files);
        let mut bytes_left = self.policy.drill_sample_bytes.bytes();
        let mut report = DrillReport {
            drill_id: drill_id.clone(),
            results: Vec::new(),
            inconclusive: Vec::new(),
        };
        for candidate in candidates {
            if files_left == 0 || bytes_left == 0 || cancel.is_cancelled() {
                break;
            }
            let v = &candidate.version;
            let name = format!("{}/{}@{}", v.project, v.dataset, v.version);
            match self
                .drill_one(candidate, drill_id, files_left, bytes_left, cancel)
                .await
            {
                Ok(None) => {}
                Ok(Some((files, bytes, problems))) => {
                    files_left = files_left.saturating_sub(files);
                    bytes_left = bytes_left.saturating_sub(bytes);
                    let fact = drill_fact(
                        candidate,
                        drill_id,
                        files,
                        bytes,
                        &problems,
                        &self.target.name,
                    );
                    bus.publish(&fact).await?;
                    stagehand_telemetry::work::drill_verdict(
                        &self.target.name,
                        problems.is_empty(),
                    );
                    if problems.is_empty() {
                        info!(version = %name, files, bytes, "restore drill verified");
                    } else {
                        warn!(version = %name, problems = problems.len(), first = %problems[0].detail, "restore drill FAILED");
                    }
                    report.results.push(DrillResult {
                        project: v.project.clone(),
                        dataset: v.dataset.clone(),
                        version: v.version.clone(),
                        sampled_files: files,
                        sampled_bytes: bytes,
                        problems,
                        fact,
                    });
                }
                Err(Inconclusive(why)) => {
                    warn!(version = %name, reason = %why, "restore drill inconclusive; left for the next drill");
                    report.inconclusive.push((name, why));
                }
            }
        }
        Ok(report)
    }

    /// Drills one version: `None` when nothing of it fits the budget, else the files and
    /// bytes sampled and every problem found.
    async fn drill_one(
        &self,
        candidate: &Candidate,
        drill_id: &EventId,
        files_left: u64,
        bytes_left: u64,
        cancel: &CancellationToken,
    ) -> Result<Option<(u64, u64, Vec<Problem>)>, Inconclusive> {
        let v = &candidate.version;
        let prefix = candidate.replica.prefix.clone();
        let manifest = match self.read_manifest(&self.backup, &prefix, &v.version).await {
            Ok(m) => m,
            Err(e) => return verdict_on_manifest(e, &prefix),
        };
        if (manifest.files(), manifest.bytes()) != (v.files, v.total_bytes) {
            let problem = Problem::new(
                code::MANIFEST_MISMATCH,
                Some(&crate::layout::manifest_path(&prefix)),
                format!(
                    "the manifest on the backup lists {} files of {} bytes; the catalogue records {} files of {} bytes",
                    manifest.files(),
                    manifest.bytes(),
                    v.files,
                    v.total_bytes
                ),
            );
            return Ok(Some((0, 0, vec![problem])));
        }
        let (m, id) = (manifest.clone(), drill_id.clone());
        let files = tokio::task::spawn_blocking(move || sample(&m, &id, files_left, bytes_left))
            .await
            .map_err(|e| Inconclusive(format!("sampling task failed: {e}")))?
            .map_err(|e| Inconclusive(e.to_string()))?;
        if files.is_empty() {
            return Ok(None);
        }
        let dir = format!("drills/{}/{}", drill_id, v.version);
        let restored = async {
            let src = self.backup.beneath(&prefix)?;
            let dst = Tier::Posix(self.scratch.beneath(&dir, true)?);
            let opts = CopyOptions {
                priority: Priority::Backup,
                ..CopyOptions::default()
            };
            let progress = Progress::new();
            let batch = tokio::select! {
                b = self.mover.copy_all(&src, &dst, &files, &opts, &progress) => b,
                _ = cancel.cancelled() => return Err(Inconclusive("the drill was cancelled".into())),
            };
            Ok(batch)
        };
        let batch = restored.await;
        self.remove_scratch_tree(&format!("drills/{drill_id}"))
            .await;
        let batch = batch?;
        let mut problems = Vec::new();
        let mut bytes = 0u64;
        for (file, result) in files.iter().zip(&batch.results) {
            bytes += file.size;
            if let Err(e) = &result.result {
                match problem_code(e.kind) {
                    Some(code) => problems.push(Problem::new(
                        code,
                        Some(&file.path),
                        format!("restored from {}:{prefix}: {}", self.target.name, e.detail),
                    )),
                    None => return Err(Inconclusive(e.to_string())),
                }
            }
        }
        Ok(Some((files.len() as u64, bytes, problems)))
    }

    async fn remove_scratch_tree(&self, dir: &str) {
        let (scratch, dir) = (self.scratch.clone(), dir.to_owned());
        let removed = tokio::task::spawn_blocking(move || scratch.remove_tree(&dir)).await;
        if let Ok(Err(e)) = removed
            && e.kind != ErrorKind::NotFound
        {
            warn!(error = %e, "could not remove a drill's scratch folder; the next start sweeps it");
        }
    }
}

impl From<stagehand_mover::TransferError> for Inconclusive {
    fn from(e: stagehand_mover::TransferError) -> Self {
        Inconclusive(e.to_string())
    }
}

/// The verdict when the manifest inside a backup could not be read: a missing or damaged
/// manifest is a failed drill; an unreachable tier is no verdict.
fn verdict_on_manifest(
    e: BackupError,
    prefix: &str,
) -> Result<Option<(u64, u64, Vec<Problem>)>, Inconclusive> {
    let path = crate::layout::manifest_path(prefix);
    let code = match &e {
        BackupError::Transfer(t) => match problem_code(t.kind) {
            Some(code::CHECKSUM_MISMATCH) | Some(code::SIZE_MISMATCH) => code::MANIFEST_MISMATCH,
            Some(code) => code,
            None => return Err(Inconclusive(e.to_string())),
        },
        BackupError::Manifest(m) if m.is_retryable() => return Err(Inconclusive(e.to_string())),
        BackupError::Manifest(m) => match m.kind {
            stagehand_manifest::ManifestErrorKind::Mismatch => code::MANIFEST_MISMATCH,
            _ => code::MANIFEST_MALFORMED,
        },
        _ => return Err(Inconclusive(e.to_string())),
    };
    Ok(Some((
        0,
        0,
        vec![Problem::new(code, Some(&path), e.to_string())],
    )))
}

/// The fact a drill records for one version.
fn drill_fact(
    candidate: &Candidate,
    drill_id: &EventId,
    files: u64,
    bytes: u64,
    problems: &[Problem],
    tier: &str,
) -> Event {
    let v = &candidate.version;
    let location = Location {
        tier: tier.to_owned(),
        prefix: candidate.replica.prefix.clone(),
    };
    let body = if problems.is_empty() {
        Body::RestoreVerified(RestoreVerified {
            dataset: v.dataset.clone(),
            version: v.version.clone(),
            location,
            sampled_files: files,
            sampled_bytes: bytes,
        })
    } else {
        let mut tally = ProblemTally::new();
        for p in problems {
            tally.add(p.clone());
        }
        let (problems, problem_counts, total) = tally.finish();
        Body::RestoreFailed(RestoreFailed {
            dataset: v.dataset.clone(),
            version: v.version.clone(),
            location,
            problems,
            problem_counts,
            problems_total: Some(total),
        })
    };
    Event {
        // One verdict per version per drill (the contract's fact id: project, cause, step).
        id: EventId::for_fact(
            &v.project,
            drill_id,
            &format!("drill:{}/{}", v.dataset, v.version),
        ),
        schema: SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: v.project.clone(),
        correlation_id: drill_id.clone(),
        // The backup the drill tested.
        causation_id: candidate
            .replica
            .copied
            .as_ref()
            .map(|s| s.event_id.clone()),
        body,
    }
}

/// The id of the drill of `tier` started at `at`.
pub fn drill_id(tier: &str, at: OffsetDateTime) -> EventId {
    let nanos = at.unix_timestamp_nanos().to_be_bytes();
    EventId::for_content(&[b"restore-drill", tier.as_bytes(), &nanos])
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::{Drill, ReplicaState, Stamp};
    use stagehand_schemas::sha256_hex;
    use time::macros::datetime;

    use super::*;

    fn candidate(
        name: &str,
        backed_up: OffsetDateTime,
        drilled: Option<OffsetDateTime>,
    ) -> Candidate {
        let stamp = |at| Stamp {
            at,
            event_id: EventId::new(format!("e-{name}")).unwrap(),
        };
        Candidate {
            version: VersionBackups {
                project: "lab-a".into(),
                dataset: name.into(),
                version: "a".repeat(64),
                files: 1,
                total_bytes: 1,
                recorded: true,
                backups: vec![],
            },
            replica: ReplicaRecord {
                project: "lab-a".into(),
                dataset: name.into(),
                version: "a".repeat(64),
                tier: "backup".into(),
                node: None,
                prefix: format!("lab-a/{name}/v"),
                state: ReplicaState::Present,
                reason: None,
                stamp: Some(stamp(backed_up)),
                files: 1,
                total_bytes: 1,
                verified_by: Some("backup".into()),
                backup: true,
                copied: Some(stamp(backed_up)),
                last_drill: drilled.map(|at| Drill {
                    ok: true,
                    sampled_files: 1,
                    problems: vec![],
                    stamp: stamp(at),
                }),
                last_verified: None,
                last_repaired: None,
            },
        }
    }

    #[test]
    fn never_drilled_versions_come_first_then_the_oldest_drill() {
        let t = datetime!(2026-12-01 00:00 UTC);
        let mut c = vec![
            candidate("recent", t, Some(t + Duration::from_secs(7200))),
            candidate("new", t + Duration::from_secs(60), None),
            candidate("old", t, Some(t + Duration::from_secs(3600))),
            candidate("first", t, None),
        ];
        drill_order(&mut c);
        let names: Vec<&str> = c.iter().map(|c| c.version.dataset.as_str()).collect();
        assert_eq!(names, ["first", "new", "old", "recent"]);
        let fresh = [c[0].clone(), c[1].clone()];
        assert!(
            drill_due(&fresh, t, Duration::from_secs(3600)),
            "never drilled"
        );
        assert!(
            !drill_due(&c, t + Duration::from_secs(7300), Duration::from_secs(3600)),
            "a drill ran within the period: new backups wait for the next one"
        );
        let drilled = [c[2].clone(), c[3].clone()];
        let newest = t + Duration::from_secs(7200);
        assert!(!drill_due(
            &drilled,
            newest + Duration::from_secs(10),
            Duration::from_secs(3600)
        ));
        assert!(drill_due(
            &drilled,
            newest + Duration::from_secs(3600),
            Duration::from_secs(3600)
        ));
        assert!(
            !drill_due(&[], t, Duration::from_secs(1)),
            "nothing to drill"
        );
    }

    #[test]
    fn a_sample_fits_the_budget_is_reproducible_and_changes_with_the_drill() {
        let files: Vec<FileRef> = (0..200)
            .map(|i| FileRef::new(format!("f{i:03}"), 10 + i, sha256_hex(&[i as u8])))
            .collect();
        let manifest = Manifest::from_entries(files.clone());
        let all = sample(&manifest, &EventId::new("d1").unwrap(), 1000, u64::MAX).unwrap();
        assert_eq!(all, files, "a version that fits is restored whole");

        let d1 = EventId::new("d1").unwrap();
        let a = sample(&manifest, &d1, 16, 400).unwrap();
        assert!(!a.is_empty() && a.len() <= 16, "{}", a.len());
        assert!(a.iter().map(|f| f.size).sum::<u64>() <= 400);
        assert!(a.windows(2).all(|w| w[0].path < w[1].path), "in path order");
        assert_eq!(a, sample(&manifest, &d1, 16, 400).unwrap(), "reproducible");
        let b = sample(&manifest, &EventId::new("d2").unwrap(), 16, 400).unwrap();
        assert_ne!(a, b, "another drill, another sample");
        assert!(
            sample(&manifest, &d1, 16, 5).unwrap().is_empty(),
            "nothing fits 5 bytes"
        );
    }
}
