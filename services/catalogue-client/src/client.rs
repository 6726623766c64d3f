//! Asking the catalogue: [`ask`] sends one [`Query`] and returns the [`Answer`] as it came;
//! [`Catalogue`] turns answers into typed results (an `error` answer becomes
//! [`CatalogueError::Answered`]) and pages through long lists.

use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use stagehand_schemas::FileRef;
use stagehand_schemas::subject::CATALOGUE_QUERY;

use crate::query::*;
use crate::readiness::Readiness;
use crate::records::*;
use stagehand_schemas::Retryable;

/// Why asking the catalogue failed (the catalogue's own `error` answers are not failures of
/// [`ask`]). Callers branch on the variant, never on the text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AskError {
    /// No catalogue recorder is subscribed to the query subject: the server said so at once.
    /// Retryable (a recorder may be starting), and for a caller that only hoped for an answer,
    /// a sign that this deployment runs none.
    #[error("catalogue query over NATS failed (is a catalogue recorder running?): no responders")]
    NoResponders,
    /// No answer within the caller's timeout. Retryable.
    #[error(
        "catalogue query over NATS failed (is a catalogue recorder running?): no answer within {0:?}"
    )]
    TimedOut(Duration),
    /// NATS failed otherwise (the connection, the client's own request timeout). Retryable.
    #[error("catalogue query over NATS failed (is a catalogue recorder running?): {0}")]
    Request(async_nats::RequestError),
    /// The query could not be encoded. Permanent.
    #[error("catalogue query could not be encoded: {0}")]
    Encode(serde_json::Error),
    /// What came back is not an answer. Permanent.
    #[error("catalogue answered something that is not an answer: {0}")]
    BadAnswer(serde_json::Error),
}

impl Retryable for AskError {
    fn is_retryable(&self) -> bool {
        matches!(
            self,
            AskError::NoResponders | AskError::TimedOut(_) | AskError::Request(_)
        )
    }
}

/// Asks the catalogue one query and waits up to `timeout` for the answer.
pub async fn ask(
    client: &async_nats::Client,
    query: &Query,
    timeout: Duration,
) -> Result<Answer, AskError> {
    let bytes = serde_json::to_vec(query).map_err(AskError::Encode)?;
    let response = tokio::time::timeout(timeout, client.request(CATALOGUE_QUERY, bytes.into()))
        .await
        .map_err(|_| AskError::TimedOut(timeout))?
        .map_err(|e| match e.kind() {
            async_nats::RequestErrorKind::NoResponders => AskError::NoResponders,
            _ => AskError::Request(e),
        })?;
    serde_json::from_slice(&response.payload).map_err(AskError::BadAnswer)
}

/// Why a typed question to the catalogue got no result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogueError {
    #[error(transparent)]
    Ask(#[from] AskError),
    /// The catalogue answered with an error (`not_found`, `ambiguous`, …).
    #[error("{message} ({code})")]
    Answered { code: ErrorCode, message: String },
    /// The catalogue answered another kind of answer than the query asks for.
    #[error("the catalogue answered {got:?} to a {wanted} query")]
    Unexpected { wanted: &'static str, got: String },
}

impl CatalogueError {
    /// Whether the catalogue said it has no such thing.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            CatalogueError::Answered {
                code: ErrorCode::NotFound,
                ..
            }
        )
    }
}

impl Retryable for CatalogueError {
    /// Whether asking again later may succeed (no recorder answered, or it failed inside).
    fn is_retryable(&self) -> bool {
        match self {
            CatalogueError::Ask(e) => e.is_retryable(),
            CatalogueError::Answered { code, .. } => *code == ErrorCode::Internal,
            CatalogueError::Unexpected { .. } => false,
        }
    }
}

/// One page of a list: its items and the cursor of the next page, if more remain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

/// One page of a version's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilesPage {
    /// The full version digest.
    pub version: String,
    pub files: Vec<FileRef>,
    pub next: Option<String>,
}

/// A typed client of the catalogue over one NATS connection.
#[derive(Debug, Clone)]
pub struct Catalogue {
    client: async_nats::Client,
    timeout: Duration,
}

fn unexpected(wanted: &'static str, got: &Answer) -> CatalogueError {
    let got = serde_json::to_value(got)
        .ok()
        .and_then(|v| v["answer"].as_str().map(str::to_owned))
        .unwrap_or_default();
    CatalogueError::Unexpected { wanted, got }
}

macro_rules! expect {
    ($answer:expr, $wanted:literal, $pattern:pat => $out:expr) => {
        match $answer {
            $pattern => Ok($out),
            other => Err(unexpected($wanted, &other)),
        }
    };
}

impl Catalogue {
    /// How long [`Catalogue`] waits for an answer unless told otherwise.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

    pub fn new(client: async_nats::Client) -> Self {
        Catalogue {
            client,
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// The same client waiting `timeout` for each answer.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Asks `query`; an `error` answer becomes [`CatalogueError::Answered`].
    pub async fn ask(&self, query: &Query) -> Result<Answer, CatalogueError> {
        match ask(&self.client, query, self.timeout).await? {
            Answer::Error { code, message } => Err(CatalogueError::Answered { code, message }),
            answer => Ok(answer),
        }
    }

    /// One page of datasets (of `project`, or of all).
    pub async fn datasets(
        &self,
        project: Option<&str>,
        limit: Option<u32>,
        after: Option<&str>,
    ) -> Result<Page<DatasetRecord>, CatalogueError> {
        let q = Query::Datasets {
            project: project.map(Into::into),
            limit,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "datasets",
            Answer::Datasets { datasets, next } => Page { items: datasets, next })
    }

    /// One dataset with the first pages of its versions and rejections.
    pub async fn dataset(
        &self,
        project: Option<&str>,
        dataset: &str,
    ) -> Result<DatasetDetail, CatalogueError> {
        let q = Query::Dataset {
            project: project.map(Into::into),
            dataset: dataset.into(),
            limit: None,
        };
        expect!(self.ask(&q).await?, "dataset", Answer::Dataset(d) => d)
    }

    /// One version (a digest or a unique prefix) with its replicas.
    pub async fn version(
        &self,
        project: Option<&str>,
        dataset: &str,
        version: &str,
    ) -> Result<VersionDetail, CatalogueError> {
        let q = Query::Version {
            project: project.map(Into::into),
            dataset: dataset.into(),
            version: version.into(),
            limit: None,
        };
        expect!(self.ask(&q).await?, "version", Answer::Version(v) => v)
    }

    /// One page of a version's files, in path order, after `after`.
    pub async fn files(
        &self,
        project: Option<&str>,
        dataset: &str,
        version: &str,
        limit: Option<u32>,
        after: Option<&str>,
    ) -> Result<FilesPage, CatalogueError> {
        let q = Query::Files {
            project: project.map(Into::into),
            dataset: dataset.into(),
            version: version.into(),
            limit,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "files",
            Answer::Files { version, files, next } => FilesPage { version, files, next })
    }

    /// Every file of a version from `after` on, in path order, asked `page` at a time: memory
    /// stays one page whatever the version's size.
    pub fn all_files(
        &self,
        project: Option<String>,
        dataset: String,
        version: String,
        page: u32,
        after: Option<String>,
    ) -> impl Stream<Item = Result<FileRef, CatalogueError>> + Send + 'static {
        let this = self.clone();
        // State: the version to ask for (the full digest once known) and the cursor, or None
        // once the last page came.
        let pages = futures::stream::try_unfold(Some((version, after)), move |state| {
            let this = this.clone();
            let project = project.clone();
            let dataset = dataset.clone();
            async move {
                let Some((version, after)) = state else {
                    return Ok(None);
                };
                let p = this
                    .files(
                        project.as_deref(),
                        &dataset,
                        &version,
                        Some(page),
                        after.as_deref(),
                    )
                    .await?;
                let next = p.next.map(|n| (p.version, Some(n)));
                Ok::<_, CatalogueError>(Some((p.files, next)))
            }
        });
        pages
            .map_ok(|files| futures::stream::iter(files.into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    /// One file's entry, by path.
    pub async fn file(
        &self,
        project: Option<&str>,
        dataset: &str,
        version: &str,
        path: &str,
    ) -> Result<(String, FileRef), CatalogueError> {
        let q = Query::File {
            project: project.map(Into::into),
            dataset: dataset.into(),
            version: version.into(),
            path: path.into(),
        };
        expect!(self.ask(&q).await?, "file", Answer::File { version, file } => (version, file))
    }

    /// The rejection of one ingest request.
    pub async fn rejection(
        &self,
        project: Option<&str>,
        dataset: &str,
        request_id: &str,
    ) -> Result<RejectionRecord, CatalogueError> {
        let q = Query::Rejection {
            project: project.map(Into::into),
            dataset: dataset.into(),
            request_id: request_id.into(),
        };
        expect!(self.ask(&q).await?, "rejection", Answer::Rejection { rejection } => rejection)
    }

    /// Readiness of a version on every tier (or one), first page.
    pub async fn readiness(
        &self,
        project: Option<&str>,
        dataset: &str,
        version: &str,
        tier: Option<&str>,
    ) -> Result<Page<Readiness>, CatalogueError> {
        let q = Query::Readiness {
            project: project.map(Into::into),
            dataset: dataset.into(),
            version: version.into(),
            tier: tier.map(Into::into),
            limit: None,
            after: None,
        };
        expect!(self.ask(&q).await?, "readiness",
            Answer::Readiness { readiness, next } => Page { items: readiness, next })
    }

    /// One page of the stage requests of a job, or of a dataset (and version).
    pub async fn stage_requests(
        &self,
        project: &str,
        job_id: Option<&str>,
        dataset: Option<&str>,
        version: Option<&str>,
        after: Option<&str>,
    ) -> Result<Page<StageStatus>, CatalogueError> {
        let q = Query::StageRequests {
            project: project.into(),
            job_id: job_id.map(Into::into),
            dataset: dataset.map(Into::into),
            version: version.map(Into::into),
            limit: None,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "stage_requests",
            Answer::StageRequests { stages, next } => Page { items: stages, next })
    }

    /// One stage request's status.
    pub async fn stage_request(
        &self,
        project: &str,
        request_id: &str,
    ) -> Result<StageStatus, CatalogueError> {
        let q = Query::StageRequest {
            project: project.into(),
            request_id: request_id.into(),
        };
        expect!(self.ask(&q).await?, "stage_request", Answer::StageRequest { stage } => stage)
    }

    /// One page of a training run's checkpoints in step order (after step `after`).
    pub async fn checkpoints(
        &self,
        project: &str,
        run: &str,
        limit: Option<u32>,
        after: Option<u64>,
    ) -> Result<Page<CheckpointRecord>, CatalogueError> {
        let q = Query::Checkpoints {
            project: project.into(),
            run: run.into(),
            limit,
            after: after.map(|step| step.to_string()),
        };
        expect!(self.ask(&q).await?, "checkpoints",
            Answer::Checkpoints { checkpoints, next } => Page { items: checkpoints, next })
    }

    /// The project's live checkpoints whose folder overlaps `prefix`
    /// ([`Query::CheckpointsOverlapping`]).
    pub async fn checkpoints_overlapping(
        &self,
        project: &str,
        prefix: &str,
    ) -> Result<Vec<CheckpointRecord>, CatalogueError> {
        let q = Query::CheckpointsOverlapping {
            project: project.into(),
            prefix: prefix.into(),
        };
        expect!(self.ask(&q).await?, "checkpoints",
            Answer::Checkpoints { checkpoints, .. } => checkpoints)
    }

    /// The parts of a run's checkpoint steps committed on node-local tiers
    /// ([`Query::CheckpointParts`]): of `step` with their files, or of every step not yet
    /// committed whole without them.
    pub async fn checkpoint_parts(
        &self,
        project: &str,
        run: &str,
        step: Option<u64>,
    ) -> Result<Vec<CheckpointPartRecord>, CatalogueError> {
        let q = Query::CheckpointParts {
            project: project.into(),
            run: run.into(),
            step,
        };
        expect!(self.ask(&q).await?, "checkpoint parts",
            Answer::CheckpointParts { parts } => parts)
    }

    /// The checkpoint parts on node-local tier `tier` of `node`, or of every node
    /// ([`Query::CheckpointPartsOn`]).
    pub async fn checkpoint_parts_on(
        &self,
        tier: &str,
        node: Option<&str>,
    ) -> Result<Vec<CheckpointPartRecord>, CatalogueError> {
        let q = Query::CheckpointPartsOn {
            tier: tier.into(),
            node: node.map(str::to_owned),
        };
        expect!(self.ask(&q).await?, "checkpoint parts",
            Answer::CheckpointParts { parts } => parts)
    }

    /// Every checkpoint of a training run in step order, page after page.
    pub async fn all_checkpoints(
        &self,
        project: &str,
        run: &str,
    ) -> Result<Vec<CheckpointRecord>, CatalogueError> {
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let page = self
                .checkpoints(project, run, Some(MAX_PAGE), after)
                .await?;
            all.extend(page.items);
            match page.next {
                Some(next) => {
                    after = Some(next.parse().map_err(|_| CatalogueError::Unexpected {
                        wanted: "checkpoints",
                        got: format!("a page cursor {next:?} that is not a step"),
                    })?);
                }
                None => return Ok(all),
            }
        }
    }

    /// One page of versions with their backup copies (of `project`, or of all; on `tier`, or
    /// on every backup tier), after the cursor `after`.
    pub async fn backup_status(
        &self,
        project: Option<&str>,
        tier: Option<&str>,
        protected_only: bool,
        limit: Option<u32>,
        after: Option<&str>,
    ) -> Result<Page<VersionBackups>, CatalogueError> {
        let q = Query::BackupStatus {
            project: project.map(Into::into),
            tier: tier.map(Into::into),
            protected_only,
            limit,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "backup_status",
            Answer::BackupStatus { versions, next } => Page { items: versions, next })
    }

    /// One page of the open stage requests in `state` (pending or failed) of `projects` (empty:
    /// every project), with the counts of all open ones.
    pub async fn open_stages(
        &self,
        state: StageState,
        projects: &[String],
        limit: Option<u32>,
        after: Option<&str>,
    ) -> Result<(Page<StageStatus>, OpenStageCounts), CatalogueError> {
        let q = Query::OpenStages {
            state,
            projects: projects.to_vec(),
            limit,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "open_stages",
            Answer::OpenStages { stages, counts, next } => (Page { items: stages, next }, counts))
    }

    /// What every project's replicas take on every tier (or on `tier`), all pages.
    pub async fn tier_usage(
        &self,
        tier: Option<&str>,
    ) -> Result<Vec<TierProjectUsage>, CatalogueError> {
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let q = Query::TierUsage {
                tier: tier.map(Into::into),
                limit: Some(MAX_PAGE),
                after: after.take(),
            };
            let (usage, next) = expect!(self.ask(&q).await?, "tier_usage",
                Answer::TierUsage { usage, next } => (usage, next))?;
            out.extend(usage);
            match next {
                Some(n) => after = Some(n),
                None => return Ok(out),
            }
        }
    }

    /// The replicas on `tier` (of `node` only, when given; in `state` only, when given),
    /// all pages.
    pub async fn replicas_on(
        &self,
        tier: &str,
        node: Option<&str>,
        state: Option<ReplicaState>,
    ) -> Result<Vec<ReplicaRecord>, CatalogueError> {
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let q = Query::ReplicasOn {
                tier: tier.into(),
                node: node.map(Into::into),
                state,
                limit: Some(MAX_PAGE),
                after: after.take(),
            };
            let (replicas, next) = expect!(self.ask(&q).await?, "replicas_on",
                Answer::ReplicasOn { replicas, next } => (replicas, next))?;
            out.extend(replicas);
            match next {
                Some(n) => after = Some(n),
                None => return Ok(out),
            }
        }
    }

    /// The scrub coverage of `tier`: verified means by a scrub at or after `verified_since`;
    /// the first `limit` damaged copies listed.
    pub async fn scrub_status(
        &self,
        tier: &str,
        verified_since: ::time::OffsetDateTime,
        limit: Option<u32>,
    ) -> Result<TierScrub, CatalogueError> {
        let q = Query::ScrubStatus {
            tier: tier.into(),
            verified_since,
            limit,
        };
        expect!(self.ask(&q).await?, "scrub_status", Answer::ScrubStatus(s) => *s)
    }

    /// One page of the facts the recorder could not fold, and how many there are in all.
    pub async fn problems(
        &self,
        limit: Option<u32>,
        after: Option<&str>,
    ) -> Result<(Page<FoldProblem>, u64), CatalogueError> {
        let q = Query::Problems {
            limit,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "problems",
            Answer::Problems { problems, total, next } => (Page { items: problems, next }, total))
    }

    /// One page of a dataset's lineage (raw versions, their derived versions, replicas), or
    /// the lineage of one `version`.
    pub async fn lineage(
        &self,
        project: Option<&str>,
        dataset: &str,
        version: Option<&str>,
        limit: Option<u32>,
        after: Option<&str>,
    ) -> Result<Page<LineageNode>, CatalogueError> {
        let q = Query::Lineage {
            project: project.map(Into::into),
            dataset: dataset.into(),
            version: version.map(Into::into),
            limit,
            after: after.map(Into::into),
        };
        expect!(self.ask(&q).await?, "lineage",
            Answer::Lineage { lineage, next } => Page { items: lineage, next })
    }
}
