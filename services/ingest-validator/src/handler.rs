//! The validator as a worker-runtime handler: one `ingest.requested` in, one
//! `dataset.validated` or `dataset.rejected` out.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use stagehand_bus::{Handler, HandlerError, WorkContext};
use stagehand_mover::Tier;
use stagehand_policy::{Policies, TierRole, ValidationPolicy};
use stagehand_schemas::problem::ProblemTally;
use stagehand_schemas::{
    Body, DatasetRejected, DatasetValidated, Event, EventId, IngestRequested, Location, Problem,
    total_bytes, version_digest,
};
use tracing::{info, warn};

use crate::ValidatorError;
use crate::check::SourceTier;
use crate::source::SourceFiles;
use crate::validate::{ReadProgress, Verdict, validate};

/// The fact-id steps (see `stagehand_schemas::id`).
pub const STEP_VALIDATED: &str = "validated";
pub const STEP_REJECTED: &str = "rejected";

/// Where a rejected request's marker goes, beneath the source tier root.
pub fn marker_path(project: &str, request: &EventId) -> String {
    format!(".stagehand/quarantine/{project}/{request}.json")
}

/// The marker left beside a rejected upload: the upload itself is never moved or deleted.
#[derive(Debug, Serialize)]
struct Marker<'a> {
    request_id: &'a EventId,
    project: &'a str,
    dataset: &'a str,
    requested_by: &'a str,
    source: &'a Location,
    declared_version: &'a str,
    problems: &'a [Problem],
}

/// Validates ingest requests against the validation policy and the files on source tiers.
pub struct IngestValidator<S = Tier> {
    validation: ValidationPolicy,
    /// Every declared tier's role, and the opened tier for source tiers.
    tiers: HashMap<String, (TierRole, Option<S>)>,
    read_concurrency: usize,
    progress_every: Duration,
}

impl IngestValidator<Tier> {
    /// Opens every source tier the policies declare.
    pub fn open(policies: &Policies, read_concurrency: usize) -> Result<Self, ValidatorError> {
        let mut tiers = HashMap::new();
        for (name, tier) in policies.tiers() {
            let opened = if tier.role == TierRole::Source {
                Some(tier.open().map_err(|source| ValidatorError::Tier {
                    tier: name.clone(),
                    location: tier.location(),
                    source: Box::new(source),
                })?)
            } else {
                None
            };
            tiers.insert(name.clone(), (tier.role, opened));
        }
        Ok(Self::from_parts(
            policies.validation().clone(),
            tiers,
            read_concurrency,
        ))
    }
}

impl<S: SourceFiles> IngestValidator<S> {
    /// A validator over given tiers (tests use an in-memory [`SourceFiles`]).
    pub fn from_parts(
        validation: ValidationPolicy,
        tiers: HashMap<String, (TierRole, Option<S>)>,
        read_concurrency: usize,
    ) -> Self {
        Self {
            validation,
            tiers,
            read_concurrency: read_concurrency.max(1),
            progress_every: Duration::from_secs(5),
        }
    }

    /// The facts one event causes. `progress` is awaited every few seconds while files are read.
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
        let (tier, source) = match self.tiers.get(&request.source.tier) {
            None => (SourceTier::Unknown, None),
            Some((TierRole::Source, opened)) => (SourceTier::Usable, opened.as_ref()),
            Some((role, _)) => (SourceTier::WrongRole(*role), None),
        };
        let verdict = validate(
            request,
            &self.validation,
            tier,
            source,
            self.read_concurrency,
            self.progress_every,
            progress,
        )
        .await
        .map_err(|e| {
            warn!(event_id = %event.id, error = %e, "source tier failed; the request will be retried");
            HandlerError::retryable(e)
        })?;
        match verdict {
            Verdict::Valid => {
                let version = version_digest(&request.files);
                info!(event_id = %event.id, dataset = %request.dataset, %version, files = request.files.len(), "validated");
                Ok(vec![event.caused(
                    STEP_VALIDATED,
                    Body::DatasetValidated(validated(event, request, version)),
                )])
            }
            Verdict::Invalid(problems) => {
                let quarantine = self.mark(event, request, source, &problems).await?;
                info!(event_id = %event.id, dataset = %request.dataset, problems = problems.len(), "rejected");
                let mut tally = ProblemTally::new();
                for problem in &problems {
                    tally.add(problem.clone());
                }
                let (listed, problem_counts, problems_total) = tally.finish();
                Ok(vec![event.caused(
                    STEP_REJECTED,
                    Body::DatasetRejected(DatasetRejected {
                        dataset: request.dataset.clone(),
                        source: request.source.clone(),
                        declared_version: version_digest(&request.files),
                        requested_by: request.requested_by.clone(),
                        request_id: event.id.clone(),
                        problems: listed,
                        quarantine,
                        problem_counts,
                        problems_total: Some(problems_total),
                    }),
                )])
            }
        }
    }

    /// Writes the quarantine marker on the source tier; `None` when there is no tier to write
    /// on, or it refuses writes (a read-only upload area): the rejection fact still records it.
    async fn mark(
        &self,
        event: &Event,
        request: &IngestRequested,
        source: Option<&S>,
        problems: &[Problem],
    ) -> Result<Option<String>, HandlerError> {
        let Some(source) = source else {
            return Ok(None);
        };
        let rel = marker_path(&event.project, &event.id);
        let marker = Marker {
            request_id: &event.id,
            project: &event.project,
            dataset: &request.dataset,
            requested_by: &request.requested_by,
            source: &request.source,
            declared_version: &version_digest(&request.files),
            problems,
        };
        let bytes = serde_json::to_vec_pretty(&marker)
            .map_err(|e| HandlerError::permanent(format!("encoding the quarantine marker: {e}")))?;
        match source.write_marker(&rel, bytes).await {
            Ok(()) => Ok(Some(source.describe(&rel))),
            Err(e) if e.is_retryable() => Err(HandlerError::retryable(e)),
            Err(e) => {
                warn!(event_id = %event.id, error = %e, "cannot write the quarantine marker; the rejection is recorded without one");
                Ok(None)
            }
        }
    }
}

fn validated(event: &Event, request: &IngestRequested, version: String) -> DatasetValidated {
    DatasetValidated {
        dataset: request.dataset.clone(),
        version,
        source: request.source.clone(),
        files: request.files.clone(),
        manifest: None,
        total_bytes: total_bytes(&request.files),
        requested_by: request.requested_by.clone(),
        request_id: event.id.clone(),
        labels: request.labels.clone(),
    }
}

impl<S: SourceFiles + 'static> Handler for IngestValidator<S> {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.decide(event, |status| async move {
            tracing::debug!(
                files_done = status.files_done,
                files_total = status.files_total,
                bytes_done = status.bytes_done,
                "hashing"
            );
            if let Err(e) = ctx.progress().await {
                warn!(error = %e, "progress ack failed");
            }
        })
        .await
    }
}
