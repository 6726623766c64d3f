//! The validator as a worker-runtime handler: one `ingest.requested` in, one
//! `dataset.validated` or `dataset.rejected` out, with progress on core NATS meanwhile.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use stagehand_bus::{Handler, HandlerError, WorkContext};
use stagehand_manifest::{ManifestErrorKind, ManifestSource, Spool, inline_or_stored};
use stagehand_mover::{EngineChoice, Mover, MoverConfig, Tier};
use stagehand_policy::{Opening, Policies, TierError, TierRole, ValidationPolicy};
use stagehand_schemas::problem::code;
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::{Body, DatasetRejected, DatasetValidated, Event, IngestRequested, Problem};
use tracing::{debug, info, warn};

use crate::ValidatorError;
use crate::check::{self, Declared, SourceTier};
use crate::pieces::Catalogue;
use crate::report::{Findings, QUARANTINE_DIR, ReportHeader, SpooledReport, report_path};
use crate::source::SourceFiles;
use crate::validate::{ReadOptions, ReadProgress, validate};
use stagehand_schemas::Retryable;

/// The fact-id steps (see `stagehand_schemas::id`).
pub const STEP_VALIDATED: &str = "validated";
pub const STEP_REJECTED: &str = "rejected";

/// The kind whose progress subject the validator publishes on.
const KIND: &str = "ingest.requested";

/// The phase a [`WorkProgress`] names while files are read.
pub const PHASE_HASHING: &str = "hashing";

/// How often a progress ack is sent from the handler itself (the runtime also sends one
/// every AckWait/3).
const ACK_EVERY: Duration = Duration::from_secs(5);

/// The validation policy and the opened source tiers: everything the checks need, opened
/// from the policies without connecting to anything (so a mistake there fails at start,
/// before NATS is reached).
pub struct SourceChecks<S = Tier> {
    validation: ValidationPolicy,
    /// Every declared tier's role, and the opened tier for source tiers.
    tiers: HashMap<String, (TierRole, Option<Arc<S>>)>,
}

impl SourceChecks<Tier> {
    /// Opens every source tier the policies declare, and removes from each posix one the
    /// temporaries of report copies a killed run left (only those whose writer is provably
    /// dead; see `PosixTier::sweep_stale`).
    pub async fn open(policies: &Policies) -> Result<Self, ValidatorError> {
        let tiers = policies
            .open_sources(&Opening::read().sweeping(QUARANTINE_DIR))
            .await?;
        Ok(Self::from_parts(policies.validation().clone(), tiers))
    }
}

impl<S> SourceChecks<S> {
    /// Checks over given tiers (tests use an in-memory [`SourceFiles`]).
    pub fn from_parts(
        validation: ValidationPolicy,
        tiers: HashMap<String, (TierRole, Option<S>)>,
    ) -> Self {
        SourceChecks {
            validation,
            tiers: tiers
                .into_iter()
                .map(|(name, (role, tier))| (name, (role, tier.map(Arc::new))))
                .collect(),
        }
    }
}

/// How the handler runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatorOptions {
    /// How files are read: concurrency, reporting window, progress interval.
    pub read: ReadOptions,
    /// A local directory for manifests too large for memory (about 100 bytes per file) and
    /// for quarantine reports while they are written. The validator owns
    /// `<spool_dir>/ingest-validator/` and empties it when it starts.
    pub spool_dir: PathBuf,
    /// Replicas of the services' manifest bucket when the validator creates it.
    pub replicas: usize,
}

impl ValidatorOptions {
    /// Every option at its default, spooling in `spool_dir`.
    pub fn new(spool_dir: impl Into<PathBuf>) -> Self {
        ValidatorOptions {
            read: ReadOptions::default(),
            spool_dir: spool_dir.into(),
            replicas: 1,
        }
    }
}

/// Validates ingest requests against the validation policy and the files on source tiers.
///
/// Built from the [`SourceChecks`] and a JetStream context: the manifest buckets
/// (`stagehand_uploads_<project>` to read a request's manifest, `stagehand_manifests` to
/// store a validated one) and core NATS for progress are reached through it. In the service
/// that is the runtime's own connection (`Bus::jetstream()`).
pub struct IngestValidator<S = Tier> {
    checks: SourceChecks<S>,
    js: jetstream::Context,
    read: ReadOptions,
    /// Manifests fetched by reference are spooled here.
    manifest_spool: Spool,
    /// Reports are spooled here while they are written.
    report_spool: PathBuf,
    /// The services' manifest bucket (validated manifests, side data), opened on first use.
    catalogue: Arc<Catalogue>,
    /// Puts reports on source tiers.
    mover: Mover,
}

impl<S: SourceFiles + 'static> IngestValidator<S> {
    /// The handler over `checks`, reaching NATS through `js`. Prepares the spool (emptying
    /// what an earlier run left) and a small mover for the reports.
    pub fn new(
        checks: SourceChecks<S>,
        js: jetstream::Context,
        options: ValidatorOptions,
    ) -> Result<Self, ValidatorError> {
        let root = options.spool_dir.join(crate::SERVICE);
        let spool_err = |source| ValidatorError::Spool {
            path: root.clone(),
            source,
        };
        // The spool is this instance's alone (like its ledger): what is in it is left from a
        // run that stopped mid-request.
        match std::fs::remove_dir_all(&root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(spool_err(e)),
        }
        let manifest_spool = root.join("manifests");
        let report_spool = root.join("reports");
        for dir in [&manifest_spool, &report_spool] {
            std::fs::create_dir_all(dir).map_err(spool_err)?;
        }
        // Reports are a few MiB at most: one pread thread is plenty, and no io_uring ring
        // (with its registered buffers) is held for them.
        let mover = Mover::new(MoverConfig {
            engine: EngineChoice::Pread,
            pread_threads: 1,
            buffers: 2,
            block_size: 256 << 10,
            concurrency: 4,
            ..MoverConfig::default()
        })
        .map_err(|source| TierError {
            tier: "quarantine-spool".into(),
            location: report_spool.display().to_string(),
            source: Box::new(source),
        })?;
        let catalogue_js = js.clone();
        Ok(IngestValidator {
            checks,
            js,
            read: options.read,
            manifest_spool: Spool::in_dir(manifest_spool),
            report_spool,
            catalogue: Arc::new(Catalogue::new(catalogue_js, options.replicas)),
            mover,
        })
    }

    /// The facts one event causes. `progress` is awaited about once a
    /// [`ReadOptions::progress_every`] while files are read.
    pub async fn decide<P, F>(&self, event: &Event, progress: P) -> Result<Vec<Event>, HandlerError>
    where
        P: FnMut(ReadProgress) -> F,
        F: Future<Output = ()>,
    {
        let Body::IngestRequested(request) = &event.body else {
            return Err(HandlerError::permanent(format!(
                "the ingest validator handles ingest.requested, not {}",
                event.kind()
            )));
        };
        let (tier, source) = match self.checks.tiers.get(&request.source.tier) {
            None => (SourceTier::Unknown, None),
            Some((TierRole::Source, opened)) => (SourceTier::Usable, opened.as_ref()),
            Some((role, _)) => (SourceTier::WrongRole(*role), None),
        };
        let manifest_source = ManifestSource::of(event);
        let declared_version = match &manifest_source {
            Ok(Some(m)) => m.digest(),
            _ => request
                .manifest
                .as_ref()
                .map(|m| m.digest.clone())
                .unwrap_or_default(),
        };
        let mut findings = Findings::new(
            ReportHeader {
                request_id: event.id.clone(),
                project: event.project.clone(),
                dataset: request.dataset.clone(),
                requested_by: request.requested_by.clone(),
                source: request.source.clone(),
                declared_version,
            },
            source.map(|_| self.report_spool.clone()),
        );
        let manifest_source = match manifest_source {
            Ok(Some(m)) => m,
            Ok(None) => {
                return Err(HandlerError::permanent(
                    "the request carries no manifest the manifest reader knows",
                ));
            }
            Err(e) => {
                findings
                    .add(Problem::new(code::MANIFEST_MALFORMED, None, e.to_string()))
                    .map_err(HandlerError::retryable)?;
                return self.reject(event, request, source, findings).await;
            }
        };
        // The request step: bounds judged from the declared counts, before anything is read.
        let declared = Declared {
            files: manifest_source.files(),
            bytes: manifest_source.bytes(),
        };
        let wide = check::request_problems(
            &event.project,
            &request.source,
            declared,
            &self.checks.validation,
            tier,
        );
        if !wide.is_empty() {
            for problem in wide {
                findings.add(problem).map_err(HandlerError::retryable)?;
            }
            return self.reject(event, request, source, findings).await;
        }
        let Some(source) = source else {
            return Err(HandlerError::permanent(format!(
                "source tier {:?} is declared but was not opened",
                request.source.tier
            )));
        };
        let manifest = match manifest_source.open(&self.js, &self.manifest_spool).await {
            Ok(manifest) => manifest,
            Err(e) => {
                let code = match e.kind {
                    ManifestErrorKind::Mismatch => code::MANIFEST_MISMATCH,
                    ManifestErrorKind::Malformed | ManifestErrorKind::Invalid => {
                        code::MANIFEST_MALFORMED
                    }
                    _ => {
                        let e = HandlerError::from(e);
                        if e.is_retryable() {
                            warn!(event_id = %event.id, error = %e, "manifest unavailable; the request will be retried");
                        }
                        return Err(e);
                    }
                };
                findings
                    .add(Problem::new(code, None, e.to_string()))
                    .map_err(HandlerError::retryable)?;
                return self.reject(event, request, Some(source), findings).await;
            }
        };
        let measured = validate(
            &manifest,
            &request.source.prefix,
            &self.checks.validation,
            source,
            &self.catalogue,
            &self.read,
            &mut findings,
            progress,
        )
        .await
        .map_err(|e| {
            warn!(event_id = %event.id, error = %e, "reading failed; the request will be retried");
            HandlerError::retryable(e)
        })?;
        if !findings.is_empty() {
            return self.reject(event, request, Some(source), findings).await;
        }
        // Every file was read and is as declared, so what was read is the declared manifest;
        // anything else is a fault in the validator itself, for on-call.
        if measured.digest != manifest.digest() {
            return Err(HandlerError::permanent(format!(
                "measured version {} differs from the verified manifest's digest {} with no problem found",
                measured.digest,
                manifest.digest()
            )));
        }
        // A manifest that travels inline needs no bucket (nor the rights to one).
        let (files, reference) = match manifest.inline_entries().map_err(HandlerError::retryable)? {
            Some(files) => (files, None),
            None => {
                let store = self
                    .catalogue
                    .store()
                    .await
                    .map_err(HandlerError::retryable)?;
                inline_or_stored(&manifest, store)
                    .await
                    .map_err(HandlerError::retryable)?
            }
        };
        info!(event_id = %event.id, dataset = %request.dataset, version = %measured.digest, files = measured.files, bytes = measured.bytes, by_reference = reference.is_some(), "validated");
        stagehand_telemetry::work::ingest_verdict(true);
        Ok(vec![event.caused(
            STEP_VALIDATED,
            Body::DatasetValidated(DatasetValidated {
                dataset: request.dataset.clone(),
                version: measured.digest,
                source: request.source.clone(),
                files,
                manifest: reference,
                total_bytes: measured.bytes,
                requested_by: request.requested_by.clone(),
                request_id: event.id.clone(),
                labels: request.labels.clone(),
            }),
        )])
    }

    /// The rejection: the report put on the source tier (when there is one), the event with
    /// the problems that fit it.
    async fn reject(
        &self,
        event: &Event,
        request: &IngestRequested,
        source: Option<&Arc<S>>,
        findings: Findings,
    ) -> Result<Vec<Event>, HandlerError> {
        let declared_version = findings.header().declared_version.clone();
        let (tallied, report) = findings.finish().map_err(HandlerError::retryable)?;
        let quarantine = match (source, report) {
            (Some(source), Some(report)) => {
                self.quarantine(event, source.as_ref(), &report).await?
            }
            _ => None,
        };
        info!(event_id = %event.id, dataset = %request.dataset, problems = tallied.total, listed = tallied.listed.len(), "rejected");
        stagehand_telemetry::work::ingest_verdict(false);
        Ok(vec![event.caused(
            STEP_REJECTED,
            Body::DatasetRejected(DatasetRejected {
                dataset: request.dataset.clone(),
                source: request.source.clone(),
                declared_version,
                requested_by: request.requested_by.clone(),
                request_id: event.id.clone(),
                problems: tallied.listed,
                quarantine,
                problem_counts: tallied.counts,
                problems_total: Some(tallied.total),
            }),
        )])
    }

    /// Puts the report on the source tier; `None` when the tier refuses writes (a read-only
    /// upload area): the rejection fact still records every problem's count.
    async fn quarantine(
        &self,
        event: &Event,
        source: &S,
        report: &SpooledReport,
    ) -> Result<Option<String>, HandlerError> {
        debug_assert_eq!(report.rel(), report_path(&event.project, &event.id));
        match source.put_report(&self.mover, report).await {
            Ok(()) => Ok(Some(source.describe(report.rel()))),
            Err(e) if e.is_retryable() => Err(HandlerError::retryable(e)),
            Err(e) => {
                warn!(event_id = %event.id, error = %e, "cannot put the quarantine report on the tier; the rejection is recorded without one");
                Ok(None)
            }
        }
    }
}

impl<S: SourceFiles + 'static> Handler for IngestValidator<S> {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let subject = progress_subject(KIND, None, &event.project, &event.id);
        let client = self.js.client();
        let mut last_ack = tokio::time::Instant::now();
        // Boxed: the whole validation is one heap future, so the runtime's per-message future
        // stays shallow (its layout is otherwise nested too deep for the compiler's query
        // limit in release builds).
        Box::pin(self.decide(event, |status| {
            let ack = last_ack.elapsed() >= ACK_EVERY;
            if ack {
                last_ack = tokio::time::Instant::now();
            }
            let message = WorkProgress {
                request_id: event.id.clone(),
                service: crate::SERVICE.to_owned(),
                phase: PHASE_HASHING.to_owned(),
                files_done: status.files_done,
                files_total: status.files_total,
                bytes_done: status.bytes_done,
                bytes_total: status.bytes_total,
                eta_seconds: status.eta().map(|d| d.as_secs()),
            };
            let client = &client;
            let subject = &subject;
            async move {
                // Core NATS: a lost progress message costs nothing.
                if let Err(e) = client
                    .publish(subject.clone(), message.encode().into())
                    .await
                {
                    debug!(error = %e, "progress not published");
                }
                if ack && let Err(e) = ctx.progress().await {
                    warn!(error = %e, "progress ack failed");
                }
            }
        }))
        .await
    }
}
