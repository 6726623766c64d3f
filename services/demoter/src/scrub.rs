//! The scrub: a duty of the demoter that re-reads, on a schedule, every replica the catalogue
//! lists on each tier `scrub.toml` names, and hashes every file against the SHA-256 the
//! catalogue lists for it — so damage that happened after a replica was verified (a bad disk,
//! a failed rebuild, an administrator's `rm`) is found before a job reads it.
//!
//! A replica is due once its tier's period has passed since it was last known whole: the
//! newest of its last `replica.verified` (the catalogue's), this demoter's own record of its
//! last read ([`crate::scrub_state`]) and when it was made (verified by read-back then). Due
//! replicas are read most overdue first, one at a time, under `scrub.toml`'s budget (bytes and
//! files per second); within a replica up to `[budget] parallel_files` files are read and
//! hashed at once ([`read_replica`]), each in the mover's lowest priority class
//! ([`SCRUB_PRIORITY`]) and, on posix, in the kernel's idle I/O class, so a stage or a
//! checkpoint always goes first, in this process or in another (the promoter's).
//!
//! Each replica read is claimed first in the bus's claims (service `demoter.scrub`, keyed by
//! the replica and the verification it is due after), so several demoters share the work
//! without reading a replica twice, and a restarted one takes its earlier life's claim over at
//! once. A replica that verifies is announced with `replica.verified`; one with a file
//! missing, of another size, not a regular file or not hashing to its SHA-256 with
//! `replica.damaged` (`found_by` `scrub`), which withdraws its readiness. Both facts' ids
//! follow from the claim's, so a read repeated after a crash publishes nothing new. Then the
//! read is recorded in the scrub's state and the claim committed.
//!
//! At the end of each pass, copies on the tiers it repairs that another checker found damaged
//! (`stagehand audit`'s lost copies, [`crate::audit`]) are repaired the same way, once per
//! damage.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt, TryStreamExt};
use stagehand_bus::{Bus, CancellationToken, Claim, Claims, Lease, LeaseError};
use stagehand_catalogue::ReplicaState;
use stagehand_catalogue::{Catalogue, CatalogueError, views};
use stagehand_manifest::{ManifestBuilder, Spool};
use stagehand_mover::{
    CopyOptions, ErrorKind, Mover, Progress, RateLimiter, ReadLimit, Scheduler, SetCopy, Side,
    Tier, TransferError, VerifyMode,
};
use stagehand_policy::{ScrubBudget, ScrubPolicy};
use stagehand_schemas::layout::BACKUP_MANIFEST_NAME;
use stagehand_schemas::{
    Body, DamagedFile, Event, EventId, FileRef, Location, ReplicaDamaged, ReplicaRepaired,
    ReplicaVerified, Retryable,
};
use stagehand_telemetry::work::{self, ScrubOutcome};
use time::OffsetDateTime;
use tracing::{info, warn};

use crate::scrub_state::{ScrubState, ScrubStateError, Scrubbed};

/// The mover's class the scrub reads in: the background class, behind every stage, checkpoint
/// and ingest.
pub const SCRUB_PRIORITY: stagehand_mover::Priority = stagehand_mover::Priority::Backup;

/// The service name the scrub claims its reads under in the bus's claims bucket (beneath the
/// demoter's own keys, which are all its NATS user may write).
pub const SCRUB_CLAIMS_SERVICE: &str = "demoter.scrub";

/// `found_by` of the damage the scrub finds, `verified_by` of what it verifies.
pub const FOUND_BY: &str = "scrub";

/// How long a scrub's claim on a replica lasts unrenewed; it is renewed between files, so a
/// single file must be read within it (15 minutes is 175 GiB at 200 MiB/s). A lost claim costs
/// a second read, never a wrong fact.
pub const CLAIM_LIFETIME: Duration = Duration::from_secs(15 * 60);

/// Files asked of the catalogue at once.
const FILES_PAGE: u32 = 1000;

/// Why reading a replica, or a pass, stopped.
#[derive(Debug, thiserror::Error)]
pub enum ScrubError {
    #[error("asking the catalogue: {0}")]
    Catalogue(#[from] CatalogueError),
    #[error(transparent)]
    State(#[from] ScrubStateError),
    #[error("reading {tier}/{path}: {source}")]
    Read {
        tier: String,
        path: String,
        #[source]
        source: Box<TransferError>,
    },
    #[error("the bus: {0}")]
    Bus(#[from] stagehand_bus::BusError),
    #[error("tier {0} is not open in this demoter")]
    TierNotOpen(String),
    #[error("the file list of {prefix}: {detail}")]
    FileList { prefix: String, detail: String },
    #[error("repairing {tier}/{prefix}: {source}")]
    Repair {
        tier: String,
        prefix: String,
        #[source]
        source: Box<TransferError>,
    },
}

impl Retryable for ScrubError {
    fn is_retryable(&self) -> bool {
        match self {
            ScrubError::Catalogue(e) => e.is_retryable(),
            ScrubError::State(_) | ScrubError::TierNotOpen(_) => false,
            ScrubError::FileList { .. } => true,
            ScrubError::Repair { source, .. } => source.is_retryable(),
            ScrubError::Read { source, .. } => source.is_retryable(),
            ScrubError::Bus(e) => e.is_retryable(),
        }
    }
}

/// What the scrub needs, built once at start.
pub struct ScrubParts {
    pub bus: Bus,
    pub catalogue: Catalogue,
    pub policy: ScrubPolicy,
    /// The tiers this demoter scrubs, by name (those `scrub.toml` names that it opened: a
    /// node's demoter its node's local tiers, the shared demoter every other).
    pub tiers: HashMap<String, Tier>,
    /// A node's demoter reads that node's copies on the local tiers.
    pub node: Option<String>,
    pub state: ScrubState,
    pub claims: Claims,
    /// The demoter's mover: each file is read holding one of its scheduler's slots, in
    /// [`SCRUB_PRIORITY`]; a repair copies through it.
    pub mover: Arc<Mover>,
    /// Every tier the demoter opened: where a damaged copy is repaired from.
    pub sources: HashMap<String, Tier>,
    /// The scrubbed tiers whose damaged copies the scrub repairs (capacity and backup roles;
    /// a hot or local copy is repaired by the promoter's check before it is handed out).
    pub repairable: HashSet<String>,
    /// Of those, the backup tiers: a backup keeps its version's manifest inside it, and a
    /// repaired one gets it again.
    pub backups: HashSet<String>,
    /// Where the version's file list is spooled while a repair reads it (and a backup's
    /// manifest is written before it is copied in).
    pub spool_dir: std::path::PathBuf,
    pub shutdown: CancellationToken,
}

/// The scrub duty. Clones share everything.
#[derive(Clone)]
pub struct Scrubber {
    inner: Arc<Inner>,
}

struct Inner {
    parts: ScrubParts,
    budget: ReadBudget,
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ScrubReport {
    /// Replicas read and found whole.
    pub verified: u64,
    /// Replicas read and found damaged.
    pub damaged: u64,
    /// Of those, repaired from another verified replica (`replica.repaired`).
    pub repaired: u64,
    /// Of those, with no verified replica to repair them from: they stay damaged.
    pub unrepaired: u64,
    /// Replicas due that another demoter was reading, or had read.
    pub elsewhere: u64,
    /// Replicas whose read failed for a reason not theirs (left for the next pass).
    pub failed: u64,
}

/// One replica due, and the verification it is due after.
struct Due {
    placed: views::Placed,
    tier: String,
    since: Option<OffsetDateTime>,
}

/// What reading one replica came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Verified,
    /// Damaged, and repaired from another verified replica.
    Repaired,
    /// Damaged, and not repaired (no verified replica to repair it from, or its tier is not
    /// one the scrub repairs).
    Damaged,
}

/// Whether a source error says the source's file is damaged (not the path to it).
fn source_damaged(e: &TransferError) -> bool {
    matches!(
        e.kind,
        ErrorKind::NotFound
            | ErrorKind::SizeMismatch
            | ErrorKind::ChecksumMismatch
            | ErrorKind::NotAFile
    )
}

/// How one read of a replica ended ([`read_replica`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    Verified {
        files: u64,
        bytes: u64,
    },
    Damaged {
        files: u64,
        bytes: u64,
        /// The first [`ReplicaDamaged::MAX_LISTED`] damaged files in the order the file list
        /// names them, whatever order their reads finished in.
        damaged: Vec<DamagedFile>,
        total: u64,
    },
}

/// What one scrubbing process may read: `scrub.toml`'s `[budget]`, shared by every replica
/// it reads.
pub struct ReadBudget {
    bytes: RateLimiter,
    files: RateLimiter,
    parallel_files: NonZeroUsize,
}

impl ReadBudget {
    /// The policy's budget.
    pub fn new(budget: &ScrubBudget) -> ReadBudget {
        ReadBudget {
            bytes: RateLimiter::new(budget.bytes_per_second.bytes()),
            files: RateLimiter::new(budget.files_per_second),
            parallel_files: NonZeroUsize::new(budget.parallel_files as usize)
                .unwrap_or(NonZeroUsize::MIN),
        }
    }

    /// No rate at all, `parallel_files` files at once: for measuring what the read itself
    /// costs (the scrub benchmark), never for a running demoter.
    pub fn unlimited(parallel_files: NonZeroUsize) -> ReadBudget {
        ReadBudget {
            bytes: RateLimiter::new(u64::MAX),
            files: RateLimiter::new(u64::MAX),
            parallel_files,
        }
    }
}

/// The claim a read renews while it goes on, so another demoter does not judge it dead.
pub struct Renewal<'a> {
    pub claims: &'a Claims,
    pub lease: &'a mut Lease,
}

/// One file's read, as it came back.
struct Hashed {
    /// Where the file stands in the list: the damaged files are listed in this order.
    index: usize,
    file: FileRef,
    digest: Result<stagehand_mover::FileDigest, TransferError>,
}

/// Where a listed file of the replica at `prefix` is, beneath its tier's root.
fn rel_of(prefix: &str, file: &FileRef) -> String {
    format!("{prefix}/{}", file.path)
}

/// On a posix tier, the most files read one after another on one reading thread, and their
/// most bytes together (a larger file is read alone): a tier of small files costs one
/// hand-off between the runtime and a reading thread per batch, not per file
/// ([`Tier::hash_files_on_device`]).
const BATCH_FILES: usize = 16;
const BATCH_BYTES: u64 = 2 << 20;

/// `files` (each with its place in the list) in batches of [`BATCH_FILES`] and at most
/// [`BATCH_BYTES`] together, in order.
fn batches(files: Vec<(usize, FileRef)>) -> Vec<Vec<(usize, FileRef)>> {
    let mut out: Vec<Vec<(usize, FileRef)>> = Vec::new();
    let mut bytes = 0u64;
    for f in files {
        match out.last_mut() {
            Some(batch) if bytes.saturating_add(f.1.size) <= BATCH_BYTES => {
                bytes += f.1.size;
                batch.push(f);
            }
            _ => {
                bytes = f.1.size;
                out.push(vec![f]);
            }
        }
    }
    out
}

/// `listed` in [`batches`] of at most `batch_files` files, in order.
fn batched(
    listed: impl Stream<Item = Result<(usize, FileRef), ScrubError>>,
    batch_files: usize,
) -> impl Stream<Item = Result<Vec<(usize, FileRef)>, ScrubError>> {
    listed
        .try_chunks(batch_files)
        .map_err(|e| e.1)
        .map_ok(|chunk| futures::stream::iter(batches(chunk).into_iter().map(Ok)))
        .try_flatten()
}

/// Reads every file of `files` (the replica's list, in the catalogue's order) beneath
/// `prefix` on `tier` (named `tier_name`) and hashes it against the list's SHA-256: up to the
/// budget's `parallel_files` at once, each taking its bytes and one file of the budget before
/// it starts and holding one of `scheduler`'s slots in [`SCRUB_PRIORITY`] while it reads (on
/// posix, a few small files in a row under one slot, `BATCH_FILES`). The claim in
/// `renewal` is renewed between batches. A file missing, of another size, not a
/// regular file or hashing to something else is damage; any other error stops the read.
/// The result does not depend on the order the reads finish in.
pub async fn read_replica<S, E>(
    tier: &Tier,
    tier_name: &str,
    prefix: &str,
    files: S,
    budget: &ReadBudget,
    scheduler: &Scheduler,
    mut renewal: Option<Renewal<'_>>,
) -> Result<Read, ScrubError>
where
    S: Stream<Item = Result<FileRef, E>>,
    ScrubError: From<E>,
{
    // An S3 file is a request of its own: one at a time per slot, as many as the budget says.
    let batch_files = match tier {
        Tier::Posix(_) => BATCH_FILES,
        Tier::S3(_) => 1,
    };
    let listed = files
        .enumerate()
        .map(|(index, f)| f.map(|f| (index, f)).map_err(ScrubError::from));
    let hashed = batched(listed, batch_files)
        .map_ok(|batch| async move {
            budget.files.take(batch.len() as u64).await;
            budget
                .bytes
                .take(batch.iter().map(|(_, f)| f.size).sum())
                .await;
            let files: Arc<[(String, ReadLimit)]> = (batch.iter())
                .map(|(_, f)| (rel_of(prefix, f), ReadLimit::declared(f.size, None)))
                .collect();
            let _slot = scheduler.acquire(SCRUB_PRIORITY).await;
            let digests = tier.hash_files_on_device(files, SCRUB_PRIORITY).await;
            Ok::<_, ScrubError>(
                (batch.into_iter().zip(digests))
                    .map(|((index, file), digest)| Hashed {
                        index,
                        file,
                        digest,
                    })
                    .collect::<Vec<_>>(),
            )
        })
        .try_buffer_unordered(budget.parallel_files.get())
        .map_ok(|batch| futures::stream::iter(batch.into_iter().map(Ok::<_, ScrubError>)))
        .try_flatten();
    let mut hashed = std::pin::pin!(hashed);
    let (mut count, mut bytes, mut total) = (0u64, 0u64, 0u64);
    // The damaged files listed so far, by their place in the list; only the first
    // MAX_LISTED are kept, as a read of one file after another would have kept.
    let mut damaged: BTreeMap<usize, DamagedFile> = BTreeMap::new();
    let mut renewed = Instant::now();
    while let Some(h) = hashed.try_next().await? {
        if let Some(r) = renewal.as_mut()
            && renewed.elapsed() > CLAIM_LIFETIME / 3
        {
            match r.claims.renew(r.lease).await {
                Ok(()) => renewed = Instant::now(),
                // Another demoter took it (it judged the claim dead): let it finish.
                Err(LeaseError::Lost) => {
                    return Err(ScrubError::Bus(stagehand_bus::BusError::new(
                        stagehand_bus::BusErrorKind::Claim,
                        "the scrub's claim was taken by another demoter",
                    )));
                }
                Err(LeaseError::Unavailable(e)) => return Err(e.into()),
            }
        }
        count += 1;
        let how = match h.digest {
            Ok(got) if got.sha256 == h.file.sha256 => {
                bytes += got.size;
                continue;
            }
            Ok(got) => {
                bytes += got.size;
                "hash"
            }
            Err(e) => match e.kind {
                ErrorKind::NotFound => "missing",
                ErrorKind::SizeMismatch => "size",
                ErrorKind::NotAFile => "kind",
                _ => {
                    return Err(ScrubError::Read {
                        tier: tier_name.to_owned(),
                        path: rel_of(prefix, &h.file),
                        source: Box::new(e),
                    });
                }
            },
        };
        total += 1;
        // What a size mismatch found, for the report (one more lookup, of a damaged file
        // only); a file gone meanwhile has none.
        let found_size = if how == "size" {
            tier.size(&rel_of(prefix, &h.file)).await.ok().flatten()
        } else {
            None
        };
        damaged.insert(
            h.index,
            DamagedFile {
                path: h.file.path,
                how: how.into(),
                expected_size: (how == "size").then_some(h.file.size),
                found_size,
            },
        );
        if damaged.len() > ReplicaDamaged::MAX_LISTED {
            damaged.pop_last();
        }
    }
    Ok(if damaged.is_empty() {
        Read::Verified {
            files: count,
            bytes,
        }
    } else {
        Read::Damaged {
            files: count,
            bytes,
            damaged: damaged.into_values().collect(),
            total,
        }
    })
}

impl Scrubber {
    /// The scrub over `parts`, reading within the policy's budget.
    pub fn new(parts: ScrubParts) -> Scrubber {
        let budget = ReadBudget::new(&parts.policy.budget);
        Scrubber {
            inner: Arc::new(Inner { budget, parts }),
        }
    }

    fn p(&self) -> &ScrubParts {
        &self.inner.parts
    }

    /// Passes every `check_every` until shutdown. A pass that stops (the catalogue or the bus
    /// unreachable) goes on at the next; only the state store failing stops the scrub (and the
    /// demoter).
    pub async fn run(self) -> Result<(), ScrubError> {
        let every = self.p().policy.check_every;
        loop {
            match self.pass().await {
                Ok(r) => info!(
                    verified = r.verified,
                    damaged = r.damaged,
                    repaired = r.repaired,
                    unrepaired = r.unrepaired,
                    elsewhere = r.elsewhere,
                    failed = r.failed,
                    "scrub pass done"
                ),
                Err(e @ ScrubError::State(_)) => return Err(e),
                Err(e) => warn!(error = %e, "scrub pass stopped; the next pass goes on"),
            }
            tokio::select! {
                () = self.p().shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(every) => {}
            }
        }
    }

    /// One pass: every due replica of every scrubbed tier, most overdue first.
    pub async fn pass(&self) -> Result<ScrubReport, ScrubError> {
        let mut report = ScrubReport::default();
        let now = OffsetDateTime::now_utc();
        let mut due = Vec::new();
        for (tier, period) in &self.p().policy.period {
            if !self.p().tiers.contains_key(tier) {
                continue;
            }
            let placed = views::placed_on(
                &self.p().catalogue,
                tier,
                self.p().node.as_deref(),
                &views::CountedTiers::default(),
            )
            .await?;
            for placed in placed {
                let mine = self
                    .p()
                    .state
                    .last(tier, self.p().node.as_deref(), &placed.prefix)?
                    .map(|s| s.at);
                // A replica read and found damaged here is the catalogue's `damaged` now (not
                // listed); read again only once a repair or new copy made it present again.
                let since = [placed.last_verified, mine, placed.made_at]
                    .into_iter()
                    .flatten()
                    .max();
                let overdue = since.is_none_or(|s| now - s >= *period);
                if overdue {
                    due.push(Due {
                        placed,
                        tier: tier.clone(),
                        since,
                    });
                }
            }
        }
        due.sort_by_key(|d| d.since);
        // What is due when the pass starts, and what it leaves due (not read here to the end:
        // failed, another demoter's, or the pass stopped), per tier.
        let mut left: BTreeMap<&str, u64> = (self.p().policy.period.keys())
            .filter(|t| self.p().tiers.contains_key(*t))
            .map(|t| (t.as_str(), 0))
            .collect();
        for d in &due {
            *left.entry(d.tier.as_str()).or_default() += 1;
        }
        for (tier, n) in &left {
            work::scrub_overdue(tier, *n);
        }
        for d in &due {
            if self.p().shutdown.is_cancelled() {
                break;
            }
            let outcome = self.scrub_one(d).await;
            if matches!(outcome, Ok(Some(_))) {
                *left.entry(d.tier.as_str()).or_default() -= 1;
            }
            match outcome {
                Ok(Some(Found::Verified)) => report.verified += 1,
                Ok(Some(Found::Repaired)) => {
                    report.damaged += 1;
                    report.repaired += 1;
                }
                Ok(Some(Found::Damaged)) => {
                    report.damaged += 1;
                    report.unrepaired += 1;
                }
                Ok(None) => report.elsewhere += 1,
                // Only the scrub's own state failing stops it: a replica that could not be
                // read or repaired is that replica's trouble, tried again at the next pass.
                Err(e @ ScrubError::State(_)) => return Err(e),
                Err(e) if e.is_retryable() => {
                    warn!(tier = %d.tier, prefix = %d.placed.prefix, error = %e, "scrub read failed; the replica is read again at the next pass");
                    work::scrubbed(&d.tier, ScrubOutcome::Failed, 0);
                    report.failed += 1;
                }
                Err(e) => {
                    tracing::error!(tier = %d.tier, prefix = %d.placed.prefix, error = %e, "scrub of a replica failed; it is tried again at the next pass");
                    work::scrubbed(&d.tier, ScrubOutcome::Failed, 0);
                    report.failed += 1;
                }
            }
        }
        for (tier, n) in &left {
            work::scrub_overdue(tier, *n);
        }
        self.repair_found_elsewhere(&mut report).await?;
        Ok(report)
    }

    /// Repairs, once each, the damaged copies on the tiers the scrub repairs that another
    /// checker found damaged — the audit's lost copies (`stagehand audit`): the scrub reads
    /// only present copies, so without this a copy withdrawn by someone else would wait for a
    /// person. A copy whose damage this scrub found itself was tried when it was found (its
    /// state says so, from the same time). Claimed like a read, keyed by the damage's fact,
    /// so several demoters try each damage once, and a later damage of the same copy again.
    async fn repair_found_elsewhere(&self, report: &mut ScrubReport) -> Result<(), ScrubError> {
        let node = self.p().node.as_deref();
        let now = OffsetDateTime::now_utc();
        for tier in self.p().policy.period.keys() {
            if !self.p().tiers.contains_key(tier) || !self.p().repairable.contains(tier) {
                continue;
            }
            let status = (self.p().catalogue)
                .scrub_status(tier, now, Some(stagehand_catalogue::MAX_DETAIL))
                .await?;
            for r in status.damaged {
                if self.p().shutdown.is_cancelled() {
                    return Ok(());
                }
                let damaged_at = r.stamp.as_ref().map(|s| s.at);
                let mine = self.p().state.last(tier, node, &r.prefix)?;
                if r.node.as_deref() != node
                    || mine.is_some_and(|s| !s.verified && Some(s.at) >= damaged_at)
                {
                    continue;
                }
                let damage = (r.stamp.as_ref())
                    .map(|s| s.event_id.to_string())
                    .unwrap_or_default();
                let id = EventId::for_content(&[
                    b"scrub-repair".as_slice(),
                    r.project.as_bytes(),
                    tier.as_bytes(),
                    node.unwrap_or("").as_bytes(),
                    r.prefix.as_bytes(),
                    damage.as_bytes(),
                ]);
                let lease = match self.p().claims.claim(&r.project, "scrub", &id, 0).await? {
                    Claim::Owned(lease) => lease,
                    Claim::Done(_) | Claim::HeldElsewhere { .. } | Claim::InFlightElsewhere => {
                        continue;
                    }
                };
                let due = Due {
                    placed: views::Placed {
                        project: r.project.clone(),
                        dataset: r.dataset.clone(),
                        version: r.version.clone(),
                        prefix: r.prefix.clone(),
                        files: r.files,
                        bytes: r.total_bytes,
                        made_at: None,
                        durable_elsewhere: false,
                        shared_elsewhere: false,
                        verified_by: r.verified_by.clone(),
                        last_verified: None,
                    },
                    tier: tier.clone(),
                    since: damaged_at,
                };
                // What was found damaged is not known here: the repair names the version's
                // first files (all of them were found missing, for a lost copy).
                let named = self.first_paths(&r).await;
                match self.repair(&due, &id, (named, r.files)).await {
                    Ok(repaired) => {
                        report.damaged += 1;
                        let outcome = if repaired {
                            report.repaired += 1;
                            ScrubOutcome::Repaired
                        } else {
                            report.unrepaired += 1;
                            ScrubOutcome::Damaged
                        };
                        work::scrubbed(tier, outcome, 0);
                        if let Err(e) = self.p().claims.commit(&lease, &[]).await {
                            warn!(error = ?e, "committing the scrub's repair claim failed");
                        }
                    }
                    Err(e) => {
                        warn!(tier = %tier, prefix = %r.prefix, error = %e, "repairing a copy found damaged elsewhere failed; tried again at the next pass");
                        work::scrubbed(tier, ScrubOutcome::Failed, 0);
                        report.failed += 1;
                        if let Err(re) = self.p().claims.release(&lease, Vec::new()).await {
                            warn!(error = %re, "releasing the scrub's claim failed; it lapses");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Claims and reads one replica, announces what it found (and repairs it when damaged)
    /// and records it; `None`: another demoter has it.
    async fn scrub_one(&self, d: &Due) -> Result<Option<Found>, ScrubError> {
        let p = &d.placed;
        let node = self.p().node.as_deref();
        let since = d
            .since
            .map(|s| s.unix_timestamp_nanos().to_string())
            .unwrap_or_default();
        let id = EventId::for_content(&[
            b"scrub".as_slice(),
            p.project.as_bytes(),
            d.tier.as_bytes(),
            node.unwrap_or("").as_bytes(),
            p.prefix.as_bytes(),
            since.as_bytes(),
        ]);
        let mut lease = match self.p().claims.claim(&p.project, "scrub", &id, 0).await? {
            Claim::Owned(lease) => lease,
            Claim::Done(_) | Claim::HeldElsewhere { .. } | Claim::InFlightElsewhere => {
                return Ok(None);
            }
        };
        let read = match self.read(d, &mut lease).await {
            Ok(read) => read,
            Err(e) => {
                if let Err(re) = self.p().claims.release(&lease, Vec::new()).await {
                    warn!(error = %re, "releasing the scrub's claim failed; it lapses");
                }
                return Err(e);
            }
        };
        let location = Location {
            tier: d.tier.clone(),
            prefix: p.prefix.clone(),
        };
        // Files gone because the replica was removed meanwhile (a demotion renames its folder
        // away only after the catalogue has folded `replica.removed`) are no damage.
        if matches!(read, Read::Damaged { .. }) && !self.still_present(d).await? {
            info!(tier = %d.tier, prefix = %p.prefix, "replica removed while the scrub read it");
            if let Err(e) = self.p().claims.commit(&lease, &[]).await {
                warn!(error = ?e, "committing the scrub's claim failed");
            }
            return Ok(None);
        }
        let damaged_paths: Vec<String> = match &read {
            Read::Verified { .. } => Vec::new(),
            Read::Damaged { damaged, .. } => damaged.iter().map(|f| f.path.clone()).collect(),
        };
        let damaged_total = match &read {
            Read::Verified { .. } => 0,
            Read::Damaged { total, .. } => *total,
        };
        let (fact, scrubbed) = match read {
            Read::Verified { files, bytes } => (
                Event::request(
                    EventId::for_fact(&p.project, &id, "verified"),
                    p.project.clone(),
                    Body::ReplicaVerified(ReplicaVerified {
                        dataset: p.dataset.clone(),
                        version: p.version.clone(),
                        location,
                        node: node.map(str::to_owned),
                        files,
                        total_bytes: bytes,
                        verified_by: FOUND_BY.into(),
                    }),
                ),
                (true, files, bytes),
            ),
            Read::Damaged {
                files,
                bytes,
                damaged,
                total,
            } => {
                warn!(tier = %d.tier, prefix = %p.prefix, damaged = total, first = %damaged[0].path, how = %damaged[0].how, "the scrub found a damaged replica: its readiness is withdrawn");
                (
                    Event::request(
                        EventId::for_fact(&p.project, &id, "damaged"),
                        p.project.clone(),
                        Body::ReplicaDamaged(ReplicaDamaged {
                            dataset: p.dataset.clone(),
                            version: p.version.clone(),
                            location,
                            node: node.map(str::to_owned),
                            found_by: FOUND_BY.into(),
                            files: damaged,
                            damaged_total: total,
                            reason: "read back by the scrub against the catalogue's SHA-256; readiness withdrawn until it is repaired from another verified replica".into(),
                        }),
                    ),
                    (false, files, bytes),
                )
            }
        };
        if let Err(e) = self.p().bus.publish(&fact).await {
            if let Err(re) = self.p().claims.release(&lease, Vec::new()).await {
                warn!(error = %re, "releasing the scrub's claim failed; it lapses");
            }
            return Err(e.into());
        }
        let (verified, files, bytes) = scrubbed;
        let at = fact.occurred_at;
        let found = if verified {
            Found::Verified
        } else if !self.p().repairable.contains(&d.tier) {
            Found::Damaged
        } else {
            match self.repair(d, &id, (damaged_paths, damaged_total)).await {
                Ok(true) => Found::Repaired,
                Ok(false) => Found::Damaged,
                Err(e) => {
                    if let Err(re) = self.p().claims.release(&lease, Vec::new()).await {
                        warn!(error = %re, "releasing the scrub's claim failed; it lapses");
                    }
                    return Err(e);
                }
            }
        };
        self.p()
            .state
            .record(
                &d.tier,
                node,
                &p.prefix,
                &Scrubbed {
                    at,
                    verified,
                    files,
                    bytes,
                },
            )
            .await?;
        if let Err(e) = self.p().claims.commit(&lease, &[]).await {
            // The fact and the record stand; another demoter that takes the lapsed claim
            // finds the replica verified in the catalogue, or publishes the same fact id.
            warn!(error = ?e, "committing the scrub's claim failed");
        }
        if verified {
            info!(tier = %d.tier, prefix = %p.prefix, files, bytes, "replica verified by the scrub");
        }
        let outcome = match found {
            Found::Verified => ScrubOutcome::Verified,
            Found::Repaired => ScrubOutcome::Repaired,
            Found::Damaged => ScrubOutcome::Damaged,
        };
        work::scrubbed(&d.tier, outcome, bytes);
        Ok(Some(found))
    }

    /// The first [`ReplicaDamaged::MAX_LISTED`] paths of `r`'s version (none if the
    /// catalogue cannot say now: they only name what a repair copied).
    async fn first_paths(&self, r: &stagehand_catalogue::ReplicaRecord) -> Vec<String> {
        let list = self.p().catalogue.all_files(
            Some(r.project.clone()),
            r.dataset.clone(),
            r.version.clone(),
            ReplicaDamaged::MAX_LISTED as u32,
            None,
        );
        let first: Result<Vec<_>, _> = list.take(ReplicaDamaged::MAX_LISTED).try_collect().await;
        first
            .map(|files| files.into_iter().map(|f| f.path).collect())
            .unwrap_or_default()
    }

    /// Whether the catalogue still lists `d`'s copy as present.
    async fn still_present(&self, d: &Due) -> Result<bool, ScrubError> {
        let p = &d.placed;
        let v = (self.p().catalogue)
            .version(Some(&p.project), &p.dataset, &p.version)
            .await?;
        Ok(v.replicas.iter().any(|r| {
            r.tier == d.tier
                && r.node.as_deref() == self.p().node.as_deref()
                && r.state == ReplicaState::Present
        }))
    }

    /// Repairs the damaged copy `d` from another present replica of the same version on a
    /// tier this demoter opened (shared tiers only): the mover's set copy reads every listed
    /// file where the copy is, replaces those that do not verify with copies from the source
    /// (each hashed against the version's list as it is read, so a damaged source is found
    /// and the next one tried), and publishes the set at once; then `replica.repaired`. The
    /// copy is only ever replaced by verified bytes: nothing is removed before its
    /// replacement is in place. `Ok(false)`: no replica could repair it (it stays damaged,
    /// its lost files named by its `replica.damaged`).
    async fn repair(
        &self,
        d: &Due,
        id: &EventId,
        (damaged, damaged_total): (Vec<String>, u64),
    ) -> Result<bool, ScrubError> {
        let p = &d.placed;
        let dst = (self.p().sources.get(&d.tier))
            .ok_or_else(|| ScrubError::TierNotOpen(d.tier.clone()))?;
        let v = (self.p().catalogue)
            .version(Some(&p.project), &p.dataset, &p.version)
            .await?;
        let candidates = v.replicas.iter().filter(|r| {
            r.state == ReplicaState::Present
                && r.node.is_none()
                && r.tier != d.tier
                && r.verified_by.as_deref() != Some(stagehand_catalogue::CHECKPOINT_VERIFIED_BY)
        });
        for r in candidates {
            let Some(src) = self.p().sources.get(&r.tier) else {
                continue;
            };
            let spool = Spool::in_dir(self.p().spool_dir.clone());
            let mut builder = ManifestBuilder::new(&spool);
            let mut list = std::pin::pin!(self.p().catalogue.all_files(
                Some(p.project.clone()),
                p.dataset.clone(),
                p.version.clone(),
                FILES_PAGE,
                None,
            ));
            let list_err = |e: &dyn std::fmt::Display| ScrubError::FileList {
                prefix: p.prefix.clone(),
                detail: e.to_string(),
            };
            while let Some(file) = list.try_next().await? {
                builder.push(&file).map_err(|e| list_err(&e))?;
            }
            let manifest = builder.finish().map_err(|e| list_err(&e))?;
            // A list that is not the version's whole list would publish part of it.
            if manifest.digest() != p.version {
                return Err(list_err(&format!(
                    "it hashes to {}, not to the version",
                    manifest.digest()
                )));
            }
            let (files, listed) = manifest.file_stream(4096);
            let set = SetCopy {
                src_prefix: r.prefix.clone(),
                dst_prefix: p.prefix.clone(),
                opts: CopyOptions {
                    priority: SCRUB_PRIORITY,
                    trust_recorded_hash: false,
                    verify_destination: VerifyMode::ReadBack,
                    expected_hash_unknown: false,
                },
                chunk_files: 0,
                totals: Some((manifest.files(), manifest.bytes())),
            };
            let cancel = self.p().shutdown.child_token();
            let staged = match (self.p().mover)
                .stage_set(src, dst, &set, files, &Progress::new(), &cancel, |_| {})
                .await
            {
                Ok(staged) => staged,
                Err(e) if e.side == Side::Source && source_damaged(&e) => {
                    warn!(tier = %d.tier, prefix = %p.prefix, from = %r.tier, file = %e.path, error = %e, "the repair's source does not verify either; trying another");
                    continue;
                }
                Err(e) => {
                    return Err(ScrubError::Repair {
                        tier: d.tier.clone(),
                        prefix: p.prefix.clone(),
                        source: Box::new(e),
                    });
                }
            };
            if let Some(e) = listed.take_error() {
                return Err(list_err(&e));
            }
            // The set is published whole, so a backup's manifest (not a file of the version,
            // dropped from the staged set as a stray) is written into it again first.
            if let (true, Some(staging)) =
                (self.p().backups.contains(&d.tier), staged.staging_tier())
            {
                self.put_backup_manifest(&manifest, staging)
                    .await
                    .map_err(|e| ScrubError::Repair {
                        tier: d.tier.clone(),
                        prefix: p.prefix.clone(),
                        source: Box::new(e),
                    })?;
            }
            staged.publish().await.map_err(|e| ScrubError::Repair {
                tier: d.tier.clone(),
                prefix: p.prefix.clone(),
                source: Box::new(e),
            })?;
            let fact = Event::request(
                EventId::for_fact(&p.project, id, "repaired"),
                p.project.clone(),
                Body::ReplicaRepaired(ReplicaRepaired {
                    dataset: p.dataset.clone(),
                    version: p.version.clone(),
                    location: Location {
                        tier: d.tier.clone(),
                        prefix: p.prefix.clone(),
                    },
                    node: self.p().node.clone(),
                    from_tier: r.tier.clone(),
                    repaired: damaged,
                    repaired_total: damaged_total,
                    files: manifest.files(),
                    total_bytes: manifest.bytes(),
                }),
            );
            self.p().bus.publish(&fact).await?;
            info!(tier = %d.tier, prefix = %p.prefix, from = %r.tier, files = damaged_total, "damaged replica repaired by the scrub");
            return Ok(true);
        }
        tracing::error!(tier = %d.tier, prefix = %p.prefix, lost = ?damaged, "a damaged replica has no verified replica to repair it from: it stays damaged (stagehand scrub status)");
        Ok(false)
    }

    /// Writes `manifest`'s canonical bytes as [`BACKUP_MANIFEST_NAME`] at the root of a
    /// repaired backup's staging tier: spooled to a file of the demoter's own, then copied by
    /// the mover, proven like any copy.
    async fn put_backup_manifest(
        &self,
        manifest: &stagehand_manifest::Manifest,
        staging: &Tier,
    ) -> Result<(), TransferError> {
        let dir = format!("backup-manifests/{}", manifest.digest());
        let spool = stagehand_mover::PosixTier::open("spool", &self.p().spool_dir)?;
        let rel = format!("{dir}/{BACKUP_MANIFEST_NAME}");
        let (m, at, r) = (manifest.clone(), spool.clone(), rel.clone());
        let written = tokio::task::spawn_blocking(move || {
            let file = at.create_atomic(&r, m.canonical_len())?;
            let len = m.write_canonical_at(file.file()).map_err(|e| {
                TransferError::new(ErrorKind::Io, Side::Destination, "spool", &r, e.to_string())
            })?;
            file.commit()?;
            Ok::<u64, TransferError>(len)
        })
        .await
        .map_err(|e| {
            TransferError::new(
                ErrorKind::Io,
                Side::Destination,
                "spool",
                &rel,
                e.to_string(),
            )
        })?;
        let copied = async {
            let len = written?;
            let src = Tier::Posix(spool.beneath(&dir, false)?);
            let file = FileRef::new(BACKUP_MANIFEST_NAME, len, manifest.digest());
            let opts = CopyOptions {
                priority: SCRUB_PRIORITY,
                verify_destination: VerifyMode::ReadBack,
                ..CopyOptions::default()
            };
            self.p().mover.copy(&src, staging, &file, &opts).await
        }
        .await;
        if let Err(e) = spool.remove_tree(&dir)
            && e.kind != ErrorKind::NotFound
        {
            warn!(error = %e, "could not remove a backup manifest's spool file");
        }
        copied.map(|_| ())
    }

    /// Reads every listed file of the replica and hashes it ([`read_replica`]), within the
    /// budget, renewing the claim between files.
    async fn read(&self, d: &Due, lease: &mut Lease) -> Result<Read, ScrubError> {
        let p = &d.placed;
        let tier =
            (self.p().tiers.get(&d.tier)).ok_or_else(|| ScrubError::TierNotOpen(d.tier.clone()))?;
        let list = self.p().catalogue.all_files(
            Some(p.project.clone()),
            p.dataset.clone(),
            p.version.clone(),
            FILES_PAGE,
            None,
        );
        read_replica(
            tier,
            &d.tier,
            &p.prefix,
            list,
            &self.inner.budget,
            self.p().mover.scheduler(),
            Some(Renewal {
                claims: &self.p().claims,
                lease,
            }),
        )
        .await
    }
}
