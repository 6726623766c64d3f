//! `stagehand ingest`: the lab uploader, for datasets of any size.
//!
//! Three kinds of source, resolved against the tier policy ([`source`]):
//!
//! - **A local folder** is walked, copied onto a posix tier and hashed in one pass (each byte
//!   read once), then published atomically under `<project>/<dataset>/<first 16 hex of the
//!   measured digest>` ([`place`]). Memory is bounded by a constant whatever the file count:
//!   the walk streams into the mover's set copy, and each proven file goes to the manifest
//!   builder (an external sort) as it lands.
//! - **A folder already beneath a posix source tier's root** (`--in-place`, or detected) and
//!   **objects already on an S3 source tier** (`s3://bucket/prefix`) are registered where they
//!   are, without a copy: listed as a stream, hashed ([`register`]) — or taken from the
//!   uploader's `--manifest FILE` — and requested. Their prefix must lie beneath the project's
//!   own on the tier.
//!
//! The manifest travels inline when it fits the contract's bound, else it is put into the
//! project's upload bucket and referenced ([`request`]). The request's id follows from
//! project, dataset and declared version, so the same upload is the same request; a rerun
//! after a rejection or a dead-lettered outage can still succeed once the cause is fixed (see
//! [`request`] for how). With `--wait` the command shows the upload's and the validation's
//! progress on a terminal ([`bars`]) and prints the verdict.

pub mod bars;
pub mod manifest;
pub mod place;
pub mod register;
pub mod request;
pub mod source;
pub mod walk;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use stagehand_bus::{Bus, RetrySchedule};
use stagehand_catalogue::AskError;
use stagehand_manifest::{Manifest, Spool};
use stagehand_mover::Progress;
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::subject;
use stagehand_schemas::{
    Body, DatasetRejected, DatasetValidated, Event, EventId, Location, layout,
};
use time::OffsetDateTime;

use self::bars::{Bars, ValidationBar};
use self::request::{Carried, MAX_ATTEMPTS_PER_RUN, RequestParts};
use self::source::Source;

/// The kind whose progress subject the validator publishes on.
const KIND: &str = "ingest.requested";

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Validated(DatasetValidated),
    Rejected(DatasetRejected),
}

/// A verdict as it arrived: the outcome, when the validator reached it, and whether it is an
/// answer recorded before this run published (see [`is_recorded`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub outcome: Outcome,
    pub occurred_at: OffsetDateTime,
}

/// Whether a verdict is an earlier run's recorded answer rather than one reached for this
/// publication: it became true before this run published, by more than the clocks of this
/// machine and the validator's may disagree.
pub fn is_recorded(verdict: &Verdict, published_at: OffsetDateTime, clock_skew: Duration) -> bool {
    verdict.occurred_at + clock_skew < published_at
}

/// The subjects of the facts that answer an ingest request of `project`.
fn verdict_subjects(project: &str) -> [String; 2] {
    [
        subject::kind_subject(subject::FACT, "dataset.validated", project),
        subject::kind_subject(subject::FACT, "dataset.rejected", project),
    ]
}

/// The subscriptions one attempt waits on: the project's verdicts and the request's progress,
/// taken before the request is published, so the answer cannot slip past them. Plain
/// subscriptions, not JetStream consumers: an uploader's NATS user may read its own project's
/// verdicts and progress, but creating consumers on the facts stream would let it read, or
/// re-filter, anyone's.
pub struct Watch {
    verdicts: Vec<async_nats::Subscriber>,
    progress: Option<async_nats::Subscriber>,
}

impl Watch {
    /// Subscribes before the request of `id` is published.
    pub async fn start(bus: &Bus, project: &str, id: &EventId) -> anyhow::Result<Watch> {
        let mut verdicts = Vec::new();
        for subject in verdict_subjects(project) {
            verdicts.push(
                bus.client()
                    .subscribe(subject.clone())
                    .await
                    .with_context(|| format!("subscribing to {subject}"))?,
            );
        }
        // Progress is a nicety: a user who may not watch it still gets the verdict.
        let progress = bus
            .client()
            .subscribe(progress_subject(KIND, None, project, id))
            .await
            .ok();
        // The server has the subscriptions before the request goes out.
        bus.client().flush().await?;
        Ok(Watch { verdicts, progress })
    }

    /// Waits for the fact that answers `request` (matched by correlation id) until
    /// `deadline`, moving `bar` with the validator's progress meanwhile.
    pub async fn verdict(
        self,
        request: &EventId,
        deadline: tokio::time::Instant,
        bar: &ValidationBar,
    ) -> anyhow::Result<Verdict> {
        let mut facts = futures::stream::select_all(self.verdicts);
        let mut progress = self.progress;
        let wait = async {
            loop {
                tokio::select! {
                    message = facts.next() => {
                        let Some(message) = message else {
                            bail!("the connection closed before request {request} was answered");
                        };
                        let Ok(event) = stagehand_schemas::wire::decode(&message.payload) else {
                            continue;
                        };
                        if &event.correlation_id != request {
                            continue;
                        }
                        let outcome = match event.body {
                            Body::DatasetValidated(v) => Outcome::Validated(v),
                            Body::DatasetRejected(r) => Outcome::Rejected(r),
                            _ => continue,
                        };
                        return Ok(Verdict { outcome, occurred_at: event.occurred_at });
                    }
                    Some(message) = async {
                        match progress.as_mut() {
                            Some(p) => p.next().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        if let Ok(p) = WorkProgress::decode(&message.payload) {
                            bar.update(&p);
                        }
                    }
                }
            }
        };
        tokio::time::timeout_at(deadline, wait)
            .await
            .unwrap_or_else(|_| {
                bail!(
                    "no verdict on request {request} in time (is the ingest validator running? a \
                 request whose source tier stayed unreachable is dead-lettered: run the same \
                 `stagehand ingest` again once it is back)"
                )
            })
    }
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
    let poll = RetrySchedule::exponential(Duration::from_millis(20), Duration::from_millis(500));
    let mut polls = 0;
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
            // No recorder is subscribed at all (a deployment without one): nothing to wait
            // for either.
            Err(AskError::NoResponders) => {
                tracing::debug!("no catalogue recorder answers; not waiting for it");
                return;
            }
            _ => {}
        }
        polls += 1;
        tokio::time::sleep(poll.delay(polls).min(left)).await;
    }
}

/// Options of one ingest.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// A local folder, or `s3://bucket/prefix` on an S3 source tier.
    pub source: String,
    /// The folder must already be beneath a posix source tier's root (registered in place).
    pub in_place: bool,
    pub project: String,
    pub dataset: String,
    /// The posix tier a local folder is copied onto.
    pub tier: String,
    pub policies: PathBuf,
    pub requested_by: String,
    pub labels: Vec<(String, String)>,
    /// A declared manifest file (`path<TAB>size<TAB>sha256` lines) to request instead of the
    /// measured one.
    pub manifest: Option<PathBuf>,
    /// Wait for the validator's answer this long.
    pub wait: Option<Duration>,
    /// Show progress bars (on a terminal).
    pub progress: bool,
    /// How far the validator's clock may be behind this machine's: a verdict older than this
    /// run's publication by more than this is an earlier attempt's recorded answer.
    pub clock_skew: Duration,
    /// Where manifests are spooled while built (default: the temp folder).
    pub spool: Option<PathBuf>,
}

/// The default [`IngestOptions::clock_skew`].
pub const CLOCK_SKEW: Duration = Duration::from_secs(2);

/// What an ingest did.
#[derive(Debug, Clone)]
pub struct IngestReport {
    /// The request of the last attempt published.
    pub request: Event,
    /// Where the request says the files are.
    pub location: Location,
    /// Whether the files were registered where they were (no copy).
    pub in_place: bool,
    /// Whether a copy found its version already placed (the same bytes ingested before).
    pub existed: bool,
    /// The requested manifest (declared, else measured): its digest is the declared version.
    pub manifest: Manifest,
    pub digest: String,
    pub files: u64,
    pub bytes: u64,
    /// Whether the manifest travelled by reference (the project's upload bucket).
    pub by_reference: bool,
    /// The attempt published (0 for a first ingest of this content).
    pub attempt: u32,
    /// Earlier attempts whose recorded rejections this run met and moved past.
    pub earlier_rejections: u32,
    /// Whether the stream stored the first attempt's request as new (false: the same request
    /// was published within the duplicate window).
    pub published_new: bool,
    pub outcome: Option<Outcome>,
    /// Whether the outcome is an answer recorded before this run (the same request validated
    /// before).
    pub answered_before: bool,
    /// How long each phase took.
    pub phases: Phases,
}

/// How long each phase of an ingest took, for the benchmark and for a user asking where the
/// time went (`--json`). Each is measured from the end of the one before.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    /// Policies loaded, the folder placed (walked, copied, hashed, made durable, published)
    /// or the in-place files hashed, and the manifest built.
    pub place: Duration,
    /// The manifest carried (inline, or put into the upload bucket) and the request
    /// published.
    pub request: Duration,
    /// From the publication to the verdict: the validator reading and hashing every file.
    pub verdict: Duration,
    /// From the verdict until the catalogue shows it.
    pub catalogue: Duration,
}

/// Places or registers the files, publishes the request and optionally waits for the answer.
pub async fn ingest(bus: &Bus, opts: &IngestOptions) -> anyhow::Result<IngestReport> {
    let mut phases = Phases::default();
    let mut phase_started = tokio::time::Instant::now();
    let mut phase_done = |phase: &mut Duration| {
        let now = tokio::time::Instant::now();
        *phase = now - phase_started;
        phase_started = now;
    };
    layout::check_project(&opts.project)?;
    layout::check_dataset_name(&opts.dataset)?;
    let policies = stagehand_policy::Policies::load_dir(&opts.policies)
        .with_context(|| format!("loading policies from {}", opts.policies.display()))?;
    let source = source::resolve(
        &opts.source,
        opts.in_place,
        &opts.project,
        &opts.tier,
        &policies,
        &opts.policies,
    )?;
    let spool = match &opts.spool {
        Some(dir) => Spool::in_dir(dir),
        None => Spool::default(),
    };
    // A declared manifest is read first: a bad line fails before any byte is copied.
    let declared = match &opts.manifest {
        Some(path) => {
            let (path, spool) = (path.clone(), spool.clone());
            Some(
                tokio::task::spawn_blocking(move || manifest::read_declared(&path, &spool))
                    .await??,
            )
        }
        None => None,
    };
    let bars = Bars::new(opts.progress);
    let progress = Progress::new();
    let (location, measured, existed) = match &source {
        Source::Copy { folder, tier } => {
            let ticker = bars.follow("placing", &progress);
            let placed = place::place(
                tier,
                folder,
                &opts.project,
                &opts.dataset,
                &spool,
                &progress,
            )
            .await;
            ticker.finish();
            let placed = placed?;
            if placed.swept.sets_removed + placed.swept.files_removed > 0 {
                eprintln!(
                    "removed {} staging folder(s) and {} temp file(s) of earlier uploads that were killed",
                    placed.swept.sets_removed, placed.swept.files_removed
                );
            }
            (
                Location {
                    tier: tier.name().to_owned(),
                    prefix: placed.prefix,
                },
                Some(placed.manifest),
                placed.report.existed,
            )
        }
        Source::PosixInPlace {
            folder,
            tier,
            prefix,
        } => {
            let measured = match declared {
                Some(_) => None,
                None => {
                    let ticker = bars.follow("hashing", &progress);
                    let m = register::hash_posix(tier, folder, prefix, &spool, &progress).await;
                    ticker.finish();
                    Some(m?)
                }
            };
            (
                Location {
                    tier: tier.name().to_owned(),
                    prefix: prefix.clone(),
                },
                measured,
                false,
            )
        }
        Source::S3InPlace { tier, prefix, .. } => {
            let measured = match declared {
                Some(_) => None,
                None => {
                    let ticker = bars.follow("hashing", &progress);
                    let m = register::hash_s3(tier, prefix, &spool, &progress).await;
                    ticker.finish();
                    Some(m?)
                }
            };
            (
                Location {
                    tier: tier.name().to_owned(),
                    prefix: prefix.clone(),
                },
                measured,
                false,
            )
        }
    };
    let requested: Manifest = match (declared, measured) {
        (Some(declared), _) => declared,
        (None, Some(measured)) => measured,
        (None, None) => unreachable!("a manifest is measured unless one is declared"),
    };
    phase_done(&mut phases.place);
    let carried = request::carry(bus, &opts.project, &requested).await?;
    let parts = RequestParts {
        project: opts.project.clone(),
        dataset: opts.dataset.clone(),
        source: location.clone(),
        requested_by: opts.requested_by.clone(),
        labels: opts.labels.clone(),
    };
    let run = EventId::random();
    let deadline = opts.wait.map(|w| tokio::time::Instant::now() + w);
    let mut attempt = 0u32;
    let mut earlier_rejections = 0u32;
    let mut published_new = false;
    loop {
        let id = request::attempt_id(&opts.project, &opts.dataset, requested.digest(), attempt);
        let event = request::request_event(id.clone(), &parts, &carried);
        let watch = match deadline {
            Some(_) => Some(Watch::start(bus, &opts.project, &id).await?),
            None => None,
        };
        let published_at = stagehand_schemas::event::now();
        // A stream without a leader is waited out for as long as --wait's timeout leaves.
        let bus = &match deadline {
            Some(deadline) => bus.with_publish_timeout(
                deadline.saturating_duration_since(tokio::time::Instant::now()),
            ),
            None => bus.clone(),
        };
        let ack = bus
            .publish(&event)
            .await
            .with_context(|| format!("publishing ingest request {id}"))?;
        if attempt == 0 {
            published_new = !ack.duplicate;
            phase_done(&mut phases.request);
        }
        let counts = (attempt, earlier_rejections, published_new);
        let (Some(watch), Some(deadline)) = (watch, deadline) else {
            return Ok(report(
                event, location, &source, existed, requested, &carried, counts, None, false, phases,
            ));
        };
        // A duplicate after several tries may be this run's own earlier try, stored though
        // its acknowledgement was lost in an election: that copy reaches the validator.
        if ack.duplicate && ack.tries == 1 {
            // Published within the duplicate window, so the stream dropped it and the
            // validator will not see it: its earlier copy may have been answered long ago, or
            // dead-lettered. The same request as a message of this run's reaches the
            // validator, which answers from its record or works on it again.
            bus.publish_with_msg_id(&event, &request::run_msg_id(&id, &run))
                .await
                .with_context(|| format!("publishing ingest request {id}"))?;
        }
        let bar = bars.validation();
        let verdict = watch.verdict(&id, deadline, &bar).await;
        bar.finish();
        let verdict = verdict?;
        let recorded = is_recorded(&verdict, published_at, opts.clock_skew);
        if recorded
            && matches!(verdict.outcome, Outcome::Rejected(_))
            && attempt + 1 < MAX_ATTEMPTS_PER_RUN
        {
            // An earlier run's rejection, answered again from the validator's record: the
            // cause may have been fixed since, so ask again under the next attempt's id.
            eprintln!(
                "attempt {attempt} ({id}) was rejected at {} by an earlier run; asking again as attempt {}",
                verdict.occurred_at,
                attempt + 1
            );
            attempt += 1;
            earlier_rejections += 1;
            continue;
        }
        phase_done(&mut phases.verdict);
        wait_catalogued(bus, &opts.project, &verdict.outcome, deadline).await;
        phase_done(&mut phases.catalogue);
        return Ok(report(
            event,
            location,
            &source,
            existed,
            requested,
            &carried,
            counts,
            Some(verdict.outcome),
            recorded,
            phases,
        ));
    }
}

/// The report of an ingest; `counts` are the attempt, the earlier rejections passed and
/// whether the first attempt's request was new to the stream.
#[allow(clippy::too_many_arguments)]
fn report(
    request: Event,
    location: Location,
    source: &Source,
    existed: bool,
    manifest: Manifest,
    carried: &Carried,
    (attempt, earlier_rejections, published_new): (u32, u32, bool),
    outcome: Option<Outcome>,
    answered_before: bool,
    phases: Phases,
) -> IngestReport {
    IngestReport {
        request,
        location,
        in_place: source.in_place(),
        existed,
        digest: manifest.digest().to_owned(),
        files: manifest.files(),
        bytes: manifest.bytes(),
        manifest,
        by_reference: carried.is_reference(),
        attempt,
        earlier_rejections,
        published_new,
        outcome,
        answered_before,
        phases,
    }
}

/// What `stagehand ingest` says on stderr about the placement and the request.
pub fn report_text(report: &IngestReport) -> String {
    let mut out = format!(
        "{} {} files ({} bytes) {} {} on tier {}{}\n",
        if report.in_place {
            "registered"
        } else {
            "placed"
        },
        report.files,
        report.bytes,
        if report.in_place {
            "in place at"
        } else {
            "under"
        },
        report.location.prefix,
        report.location.tier,
        if report.existed {
            " (already placed by an earlier run)"
        } else {
            ""
        }
    );
    if report.by_reference {
        out.push_str(&format!(
            "the manifest travels by reference: {} in {}\n",
            report.digest,
            stagehand_schemas::subject::upload_manifest_bucket(&report.request.project)
        ));
    }
    if report.attempt > 0 {
        out.push_str(&format!(
            "published as attempt {} (earlier attempts were rejected)\n",
            report.attempt
        ));
    }
    if report.answered_before {
        out.push_str("answered by the validator's record of an earlier run\n");
    }
    out
}

/// What `stagehand ingest --json` prints.
pub fn report_json(report: &IngestReport) -> serde_json::Value {
    let outcome = match &report.outcome {
        Some(Outcome::Validated(v)) => serde_json::json!({ "validated": v }),
        Some(Outcome::Rejected(r)) => serde_json::json!({ "rejected": r }),
        None => serde_json::Value::Null,
    };
    serde_json::json!({
        "request_id": report.request.id,
        "attempt": report.attempt,
        "earlier_rejections": report.earlier_rejections,
        "tier": report.location.tier,
        "prefix": report.location.prefix,
        "in_place": report.in_place,
        "digest": report.digest,
        "files": report.files,
        "bytes": report.bytes,
        "by_reference": report.by_reference,
        "existed": report.existed,
        "answered_before": report.answered_before,
        // The same upload as an earlier run: placed already, requested within the duplicate
        // window, or answered from the validator's record.
        "duplicate": report.existed || !report.published_new || report.answered_before,
        "outcome": outcome,
        // Seconds per phase (see `Phases`); a phase not reached is 0.
        "seconds": {
            "place": report.phases.place.as_secs_f64(),
            "request": report.phases.request.as_secs_f64(),
            "verdict": report.phases.verdict.as_secs_f64(),
            "catalogue": report.phases.catalogue.as_secs_f64(),
        },
    })
}

/// The text `stagehand ingest` prints for an outcome; every problem on its own line.
pub fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Validated(v) => format!(
            "validated: {} version {} ({} files, {} bytes)\n",
            v.dataset,
            v.version,
            v.manifest
                .as_ref()
                .map_or(v.files.len() as u64, |m| m.files),
            v.total_bytes
        ),
        Outcome::Rejected(r) => {
            let total = r.problems_total.unwrap_or(r.problems.len() as u64);
            let mut out = format!("rejected: {} ({total} problems)\n", r.dataset);
            for p in &r.problems {
                out.push_str(&format!(
                    "  {:<20} {:<30} {}\n",
                    p.code,
                    p.path.as_deref().unwrap_or("-"),
                    p.detail
                ));
            }
            if (r.problems.len() as u64) < total {
                let counts: Vec<String> = r
                    .problem_counts
                    .iter()
                    .map(|(code, n)| format!("{code} {n}"))
                    .collect();
                out.push_str(&format!(
                    "  … {} more not listed (by code: {})\n",
                    total - r.problems.len() as u64,
                    counts.join(", ")
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
    fn names_are_checked() {
        assert!(layout::check_dataset_name("imagenet-1k_v2.0").is_ok());
        for bad in ["", ".hidden", "a/b", "../x", "sp ace"] {
            assert!(layout::check_dataset_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_verdict_from_before_the_publication_is_recorded() {
        let now = stagehand_schemas::event::now();
        let verdict = |at| Verdict {
            outcome: Outcome::Rejected(DatasetRejected {
                dataset: "d".into(),
                source: Location {
                    tier: "source".into(),
                    prefix: "p/d".into(),
                },
                declared_version: "0".repeat(64),
                requested_by: "u".into(),
                request_id: EventId::random(),
                problems: vec![],
                quarantine: None,
                problem_counts: vec![],
                problems_total: None,
            }),
            occurred_at: at,
        };
        let skew = Duration::from_secs(2);
        assert!(is_recorded(
            &verdict(now - Duration::from_secs(60)),
            now,
            skew
        ));
        assert!(!is_recorded(
            &verdict(now - Duration::from_secs(1)),
            now,
            skew
        ));
        assert!(!is_recorded(
            &verdict(now + Duration::from_secs(1)),
            now,
            skew
        ));
        assert!(is_recorded(
            &verdict(now - Duration::from_millis(1)),
            now,
            Duration::ZERO
        ));
    }
}
