//! From a stage request to a decision, through the catalogue: which version it names (a
//! unique prefix is enough; an ambiguous one fails naming the candidates), in which form,
//! whether it is there already, where to copy it from, or why it must wait or fail. A source
//! is only ever a location of the request's own project (the location rule,
//! `stagehand_schemas::layout`), and a version the catalogue refused for breaking that rule
//! fails naming it.

use stagehand_catalogue::{
    Answer, Catalogue, CatalogueError, ErrorCode, FoldProblem, FoldProblemCode, Query,
    RejectionRecord, ReplicaState, VersionDetail, VersionRecord,
};
use stagehand_policy::{PackingPolicy, PriorityClass};
use stagehand_schemas::{Location, layout, trust};

use crate::state::{WaitGuard, WaitingFor};

/// Pages of versions read when looking for candidates or a prepared form (each page holds
/// up to [`stagehand_catalogue::MAX_PAGE`] versions).
const VERSION_PAGES: usize = 20;

/// What to do with a stage request now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Answer `stage.failed`.
    Fail { reason: String, retryable: bool },
    /// Nothing is known of the version: answer `stage.failed` (retryable) with `reason`, but
    /// only once this promoter has handled every fact and upload stored before now — until
    /// then the fact that names it may be one it has not seen yet.
    Unknown { reason: String },
    /// Record the wait and answer `stage.pending`.
    Wait {
        waiting_for: WaitingFor,
        reason: String,
        guard: WaitGuard,
    },
    /// Copy (or find already there) this version.
    Stage(Plan),
}

/// The version to put on the tier and where it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The full digest staged (the prepared version for `form = prepared`).
    pub version: String,
    /// Verified replicas of it on source tiers, in the policy's order: (tier, prefix).
    pub sources: Vec<(String, String)>,
    pub files: u64,
    pub bytes: u64,
    pub priority: PriorityClass,
    /// The (tier, node) copies of it the catalogue holds damaged (`replica.damaged`, from any
    /// checker) or unreachable (`replica.unreachable`: its node was silent, and what happened
    /// to it meanwhile is unknown): none is handed out on its fingerprint, which cannot see bytes that rotted
    /// under unchanged metadata; each is verified by hash and repaired first.
    pub damaged: Vec<(String, Option<String>)>,
}

/// A catalogue that did not answer: retry later.
#[derive(Debug, thiserror::Error)]
#[error("asking the catalogue: {0}")]
pub struct Unanswered(pub String);

fn unanswered(e: CatalogueError) -> Unanswered {
    Unanswered(e.to_string())
}

/// What the resolver needs to know besides the catalogue.
pub struct Context<'a> {
    pub catalogue: &'a Catalogue,
    pub project: &'a str,
    pub dataset: &'a str,
    /// The version as the request gave it.
    pub version: &'a str,
    pub prepared: bool,
    /// Source tiers in order of preference.
    pub sources: &'a [String],
    pub packing: Option<&'a PackingPolicy>,
    pub priority: PriorityClass,
    /// An upload of the dataset asked for and not yet answered whose declared version
    /// matches: (ingest request id, declared version).
    pub ingest_in_flight: Option<(String, String)>,
    /// What the facts this promoter has seen say about versions with the request's prefix.
    pub seen: crate::state::Seen,
}

/// Decides what to do with a request (see the module docs).
pub async fn decide(cx: &Context<'_>) -> Result<Decision, Unanswered> {
    let raw = match cx
        .catalogue
        .version(Some(cx.project), cx.dataset, cx.version)
        .await
    {
        Ok(detail) => detail,
        Err(CatalogueError::Answered {
            code: ErrorCode::Ambiguous,
            ..
        }) => {
            let candidates = versions_with_prefix(cx).await?;
            return Ok(Decision::Fail {
                reason: format!(
                    "version {:?} of dataset {:?} is ambiguous: it is the prefix of {}; give more characters",
                    cx.version,
                    cx.dataset,
                    candidates.join(", ")
                ),
                retryable: false,
            });
        }
        Err(e) if e.is_not_found() => return not_validated(cx).await,
        Err(e) => return Err(unanswered(e)),
    };
    let detail = if cx.prepared {
        match prepared_form(cx, &raw.version.version).await? {
            Some(prepared) => prepared,
            None => return Ok(preparation(cx, &raw.version)),
        }
    } else {
        raw
    };
    let mut sources = Vec::new();
    let mut refused = Vec::new();
    for tier in cx.sources {
        // A source tier is shared: a copy there that names a node is only a node's word (its
        // user states facts about its own node alone), never a source.
        if let Some(r) = detail
            .replicas
            .iter()
            .find(|r| &r.tier == tier && r.node.is_none() && r.state == ReplicaState::Present)
        {
            // The location rule, again, on what the catalogue says: a catalogue folded before
            // the rule held may list another project's folder, and nothing is read from one.
            let location = Location {
                tier: r.tier.clone(),
                prefix: r.prefix.clone(),
            };
            match layout::check_location(cx.project, &location) {
                Ok(()) => sources.push((r.tier.clone(), r.prefix.clone())),
                Err(e) => refused.push(e.to_string()),
            }
        }
    }
    if sources.is_empty() && !refused.is_empty() {
        return Ok(Decision::Fail {
            reason: format!(
                "version {} of dataset {:?} is refused ({}): {}; nothing was read",
                detail.version.version,
                cx.dataset,
                trust::rule::OUTSIDE_PROJECT,
                refused.join("; ")
            ),
            retryable: false,
        });
    }
    Ok(Decision::Stage(Plan {
        version: detail.version.version.clone(),
        sources,
        files: detail.version.file_count,
        bytes: detail.version.total_bytes,
        priority: cx.priority,
        damaged: detail
            .replicas
            .iter()
            .filter(|r| r.state.is_withdrawn())
            .map(|r| (r.tier.clone(), r.node.clone()))
            .collect(),
    }))
}

/// The catalogue has no such version: rejected, being validated, or unknown.
async fn not_validated(cx: &Context<'_>) -> Result<Decision, Unanswered> {
    if let Some(rejection) = rejection_of(cx).await? {
        return Ok(Decision::Fail {
            reason: rejection_reason(cx, &rejection),
            retryable: false,
        });
    }
    if let Some(refused) = refusal_of(cx).await? {
        return Ok(Decision::Fail {
            reason: format!(
                "version {:?} of dataset {:?} was refused by the catalogue ({:?}, event {}): {}",
                cx.version, cx.dataset, refused.code, refused.event_id, refused.detail
            ),
            retryable: false,
        });
    }
    use crate::state::Seen;
    if cx
        .seen
        .has(Seen::VALIDATED | Seen::PREPARED | Seen::REJECTED)
    {
        // This promoter saw the fact; the recorder has not folded it yet.
        return Err(Unanswered(format!(
            "the catalogue does not show yet what the facts say of version {:?} of {:?}",
            cx.version, cx.dataset
        )));
    }
    if let Some((request, declared)) = &cx.ingest_in_flight {
        return Ok(Decision::Wait {
            waiting_for: WaitingFor::Validation,
            reason: format!(
                "version {declared} of dataset {:?} is being validated (ingest request {request}); the stage starts once it is",
                cx.dataset
            ),
            guard: WaitGuard::Validated {
                prefix: cx.version.to_owned(),
            },
        });
    }
    let known = match cx.catalogue.dataset(Some(cx.project), cx.dataset).await {
        Ok(detail) => Some(detail.dataset.version_count),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(unanswered(e)),
    };
    let reason = match known {
        None => format!(
            "unknown dataset {:?} in project {:?}: nothing of that name was ever validated, and no upload of it is in progress; ingest it first",
            cx.dataset, cx.project
        ),
        Some(n) => format!(
            "dataset {:?} has no version {:?} ({n} version(s) validated, none of them this one, and no upload of it is in progress); check the version or ingest it first",
            cx.dataset, cx.version
        ),
    };
    Ok(Decision::Unknown { reason })
}

/// A validated version without a prepared form yet: wait if the packing policy will prepare
/// it, else fail saying why it never will be.
fn preparation(cx: &Context<'_>, raw: &VersionRecord) -> Decision {
    let why_not = match cx.packing {
        None => Some("no packing policy (packing.toml) is in force".to_owned()),
        Some(p) if !p.enabled => Some("packing is disabled in packing.toml".to_owned()),
        Some(p) if raw.file_count < p.min_files => Some(format!(
            "it has {} files, fewer than packing.toml's min_files of {}",
            raw.file_count, p.min_files
        )),
        Some(p)
            if raw.file_count > 0
                && raw.total_bytes / raw.file_count > p.max_mean_file_size.bytes() =>
        {
            Some(format!(
                "its mean file size of {} bytes is above packing.toml's max_mean_file_size of {}",
                raw.total_bytes / raw.file_count,
                p.max_mean_file_size
            ))
        }
        Some(_) => None,
    };
    match why_not {
        Some(why) => Decision::Fail {
            reason: format!(
                "version {} of dataset {:?} has no prepared form and will not get one: {why}; ask for form raw",
                raw.version, cx.dataset
            ),
            retryable: false,
        },
        None => Decision::Wait {
            waiting_for: WaitingFor::Preparation,
            reason: format!(
                "version {} of dataset {:?} is validated and waits to be resharded (packing.toml); the stage starts once its prepared form exists",
                raw.version, cx.dataset
            ),
            guard: WaitGuard::Prepared {
                version: raw.version.clone(),
            },
        },
    }
}

/// Pages through the dataset's versions, calling `f` on each until it returns `Some`.
async fn scan_versions<T>(
    cx: &Context<'_>,
    mut f: impl FnMut(&VersionRecord) -> Option<T>,
) -> Result<Option<T>, Unanswered> {
    let mut after = None;
    for _ in 0..VERSION_PAGES {
        let q = Query::Versions {
            project: Some(cx.project.to_owned()),
            dataset: cx.dataset.to_owned(),
            limit: Some(stagehand_catalogue::MAX_PAGE),
            after: after.take(),
        };
        let (versions, next) = match cx.catalogue.ask(&q).await {
            Ok(Answer::Versions { versions, next }) => (versions, next),
            Ok(_) => return Err(Unanswered("unexpected answer to a versions query".into())),
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(unanswered(e)),
        };
        for v in &versions {
            if let Some(found) = f(v) {
                return Ok(Some(found));
            }
        }
        match next {
            Some(n) => after = Some(n),
            None => return Ok(None),
        }
    }
    Ok(None)
}

async fn versions_with_prefix(cx: &Context<'_>) -> Result<Vec<String>, Unanswered> {
    let mut found = Vec::new();
    scan_versions(cx, |v| {
        if v.version.starts_with(cx.version) {
            found.push(v.version.clone());
        }
        (found.len() >= 10).then_some(())
    })
    .await?;
    found.sort();
    Ok(found)
}

/// The prepared version derived from `raw`, with its replicas, if one is recorded.
async fn prepared_form(cx: &Context<'_>, raw: &str) -> Result<Option<VersionDetail>, Unanswered> {
    let derived = scan_versions(cx, |v| {
        (v.provenance.derived_from.as_deref() == Some(raw)).then(|| v.version.clone())
    })
    .await?;
    let Some(derived) = derived else {
        return Ok(None);
    };
    cx.catalogue
        .version(Some(cx.project), cx.dataset, &derived)
        .await
        .map(Some)
        .map_err(unanswered)
}

/// A rejection of an upload whose declared version starts with the request's version.
async fn rejection_of(cx: &Context<'_>) -> Result<Option<RejectionRecord>, Unanswered> {
    let mut after = None;
    for _ in 0..VERSION_PAGES {
        let q = Query::Rejections {
            project: Some(cx.project.to_owned()),
            dataset: cx.dataset.to_owned(),
            limit: None,
            after: after.take(),
        };
        let (rejections, next) = match cx.catalogue.ask(&q).await {
            Ok(Answer::Rejections { rejections, next }) => (rejections, next),
            Ok(_) => return Err(Unanswered("unexpected answer to a rejections query".into())),
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(unanswered(e)),
        };
        if let Some(r) = rejections
            .into_iter()
            .find(|r| r.declared_version.starts_with(cx.version))
        {
            return Ok(Some(r));
        }
        match next {
            Some(n) => after = Some(n),
            None => return Ok(None),
        }
    }
    Ok(None)
}

/// Pages of catalogue problems read when looking for a refused fact of the version asked for.
const PROBLEM_PAGES: usize = 10;

/// A fact of this project and dataset, naming a version the request's prefix matches, that
/// the catalogue refused for breaking a rule of who may say what (a checkpoint committed at
/// another project's prefix): the reason the version is not there. Its detail quotes only
/// what the project's own event said.
async fn refusal_of(cx: &Context<'_>) -> Result<Option<FoldProblem>, Unanswered> {
    let mut after: Option<String> = None;
    for _ in 0..PROBLEM_PAGES {
        let (page, _) = cx
            .catalogue
            .problems(None, after.as_deref())
            .await
            .map_err(unanswered)?;
        let found = page.items.into_iter().find(|p| {
            matches!(
                p.code,
                FoldProblemCode::OutsideProject | FoldProblemCode::WrongSubject
            ) && p.project == cx.project
                && p.dataset.as_deref() == Some(cx.dataset)
                && p.version
                    .as_deref()
                    .is_some_and(|v| v.starts_with(cx.version))
        });
        if found.is_some() {
            return Ok(found);
        }
        match page.next {
            Some(n) => after = Some(n),
            None => return Ok(None),
        }
    }
    Ok(None)
}

fn rejection_reason(cx: &Context<'_>, r: &RejectionRecord) -> String {
    let listed: Vec<String> = r
        .problems
        .iter()
        .take(3)
        .map(|p| match &p.path {
            Some(path) => format!("{} at {path}: {}", p.code, p.detail),
            None => format!("{}: {}", p.code, p.detail),
        })
        .collect();
    let more = r.problems_total.saturating_sub(listed.len() as u64);
    format!(
        "version {} of dataset {:?} was rejected by validation (ingest request {}), {} problem(s): {}{}{}",
        r.declared_version,
        cx.dataset,
        r.request_id,
        r.problems_total,
        listed.join("; "),
        if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        },
        r.quarantine
            .as_deref()
            .map(|q| format!(" (full report: {q})"))
            .unwrap_or_default()
    )
}
