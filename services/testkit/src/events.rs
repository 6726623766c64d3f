//! The events tests publish as another party would: a validator's `dataset.validated`, a
//! scheduler's stage request and release.

use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, IngestRequested, Location, ManifestRef,
    StageReleased, StageRequested, version_digest,
};
use time::OffsetDateTime;

/// The `dataset.validated` the ingest validator publishes in answer to ingest request
/// `request` of `project`, for `files` at `source`: its version their digest, its manifest
/// inline, or `manifest` (a reference to the same entries) when given.
pub fn validated_fact(
    project: &str,
    request: EventId,
    dataset: &str,
    source: Location,
    files: &[FileRef],
    manifest: Option<ManifestRef>,
) -> Event {
    let ingest = Event::request(
        request.clone(),
        project,
        Body::IngestRequested(IngestRequested {
            dataset: dataset.into(),
            source: source.clone(),
            files: Vec::new(),
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    );
    let inline = if manifest.is_some() {
        Vec::new()
    } else {
        files.to_vec()
    };
    ingest.caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: dataset.into(),
            version: version_digest(files),
            source,
            files: inline,
            manifest,
            total_bytes: files.iter().map(|f| f.size).sum(),
            requested_by: "alice".into(),
            request_id: request,
            labels: vec![],
        }),
    )
}

/// A scheduler's stage request of job `job`: its id from the job, as the CLI derives it
/// ([`EventId::for_stage`]), and its release ([`StageRequest::release`]).
#[derive(Debug, Clone)]
pub struct StageRequest {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    pub job: String,
    pub node: Option<String>,
    pub deadline: Option<OffsetDateTime>,
    pub form: Option<String>,
    pub hold_until: Option<OffsetDateTime>,
    /// When the event says it happened (now when unset).
    pub at: Option<OffsetDateTime>,
}

impl StageRequest {
    pub fn new(project: &str, dataset: &str, version: &str, tier: &str, job: &str) -> Self {
        StageRequest {
            project: project.into(),
            dataset: dataset.into(),
            version: version.into(),
            tier: tier.into(),
            job: job.into(),
            node: None,
            deadline: None,
            form: None,
            hold_until: None,
            at: None,
        }
    }

    /// On `node`'s node-local tier.
    pub fn node(mut self, node: Option<&str>) -> Self {
        self.node = node.map(str::to_owned);
        self
    }

    pub fn deadline(mut self, deadline: Option<OffsetDateTime>) -> Self {
        self.deadline = deadline;
        self
    }

    pub fn form(mut self, form: Option<&str>) -> Self {
        self.form = form.map(str::to_owned);
        self
    }

    pub fn hold_until(mut self, hold_until: Option<OffsetDateTime>) -> Self {
        self.hold_until = hold_until;
        self
    }

    /// Said to have happened at `at`.
    pub fn at(mut self, at: OffsetDateTime) -> Self {
        self.at = Some(at);
        self
    }

    /// The `stage.requested` event.
    pub fn event(&self) -> Event {
        let id = EventId::for_stage(
            &self.project,
            &self.job,
            &self.dataset,
            &self.version,
            &self.tier,
            self.node.as_deref(),
        );
        let mut e = Event::request(
            id,
            &self.project,
            Body::StageRequested(StageRequested {
                dataset: self.dataset.clone(),
                version: self.version.clone(),
                tier: self.tier.clone(),
                job_id: self.job.clone(),
                requested_by: "slurm".into(),
                deadline: self.deadline,
                node: self.node.clone(),
                form: self.form.clone(),
                hold_until: self.hold_until,
            }),
        );
        if let Some(at) = self.at {
            e.occurred_at = at;
        }
        e
    }

    /// The job's `stage.released` of the same data ([`EventId::for_stage_release`]).
    pub fn release(&self) -> Event {
        let id = EventId::for_stage_release(
            &self.project,
            &self.job,
            &self.dataset,
            &self.version,
            &self.tier,
            self.node.as_deref(),
        );
        let mut e = Event::request(
            id,
            &self.project,
            Body::StageReleased(StageReleased {
                dataset: self.dataset.clone(),
                version: self.version.clone(),
                tier: self.tier.clone(),
                job_id: self.job.clone(),
                node: self.node.clone(),
                reason: None,
            }),
        );
        if let Some(at) = self.at {
            e.occurred_at = at;
        }
        e
    }
}
