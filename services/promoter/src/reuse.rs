//! Checked before reuse: a replica already on the tier is handed to a job again — a second
//! job, a restore, a node agent's next request — only once what is there now is what was
//! verified when it was published.
//!
//! The mover's fingerprint of the set (every file's size, mtime, ctime and inode; on S3 size,
//! ETag and last-modified) is recorded in the promoter's bucket when the set is published
//! ([`record`], `stagehand_bus::placement::put_fingerprint`), where every instance sharing the
//! tier and the node's agent find it and no job can change it. Before a reuse it is compared
//! with a fresh metadata walk — no byte is read. With no fingerprint recorded (a replica older
//! than fingerprints, a crash between the publish and the record) or one that does not decode,
//! the set is verified by hash instead: unknown is never trusted.
//!
//! Any difference withdraws the replica first: `replica.damaged` is published (the catalogue
//! marks the copy damaged and its readiness pending with what was found) and the request says
//! why it waits; then the request takes the copy path, under the copy lease like any copy,
//! where the mover verifies every file found in place by hash, replaces what does not verify
//! with copies from the source tier, drops every entry the version's list does not name (stray
//! files go with the atomic exchange of folders), and publishes the whole. The repair's
//! `replica.created` makes it ready again. A job is never told ready on damaged bytes.

use stagehand_bus::HandlerError;
use stagehand_bus::placement;
use stagehand_mover::{Change, Difference, Fingerprint, SetReport, Tier};
use stagehand_schemas::{Body, DamagedFile, Location, ReplicaDamaged, StageRequested};
use tracing::{debug, info, warn};

use crate::promoter::{CopyFailed, Promoter};
use crate::resolve::Plan;
use crate::state::{RequestRecord, WaitingFor};

/// The step of a `replica.damaged` fact a request's check published.
pub fn step_damaged(tier: &str, node: Option<&str>) -> String {
    match node {
        Some(n) => format!("damaged:{tier}:{n}"),
        None => format!("damaged:{tier}"),
    }
}

/// What a check before reuse decided.
pub(crate) enum Reuse {
    /// As verified: hand it out.
    Intact,
    /// Withdrawn (`replica.damaged` published): verify and repair it through the copy path.
    Repair,
}

fn retry(why: impl std::fmt::Display) -> HandlerError {
    HandlerError::retryable(why.to_string())
}

/// The listed form of what differs, for the fact.
pub(crate) fn damaged_files(differences: &[Difference]) -> Vec<DamagedFile> {
    differences
        .iter()
        .take(ReplicaDamaged::MAX_LISTED)
        .map(|d| {
            let (expected_size, found_size) = match d.change {
                Change::Size { expected, found } => (Some(expected), Some(found)),
                _ => (None, None),
            };
            DamagedFile {
                path: if d.path.is_empty() {
                    ".".to_owned()
                } else {
                    d.path.clone()
                },
                how: d.change.as_str().to_owned(),
                expected_size,
                found_size,
            }
        })
        .collect()
}

/// Records the fingerprint a publish took (the replica at `prefix` on `tier`, `node`). A
/// failure leaves the fingerprint unknown — the next reuse verifies by hash — so it is logged,
/// not returned: the set itself is published and whole.
pub(crate) async fn record(
    store: &async_nats::jetstream::kv::Store,
    (tier, node): (&str, Option<&str>),
    prefix: &str,
    report: &SetReport,
) {
    let Some(print) = &report.fingerprint else {
        return;
    };
    record_print(store, (tier, node), prefix, print).await;
}

async fn record_print(
    store: &async_nats::jetstream::kv::Store,
    (tier, node): (&str, Option<&str>),
    prefix: &str,
    print: &Fingerprint,
) {
    match placement::put_fingerprint(store, tier, node, prefix, &print.encode()).await {
        Ok(()) => debug!(%tier, %prefix, entries = print.entries().len(), "fingerprint recorded"),
        Err(e) => {
            warn!(%tier, %prefix, error = %e, "fingerprint not recorded; the next reuse verifies the replica by hash")
        }
    }
}

/// What happens to a damaged replica of `plan`'s version next, for a person.
fn repair_source(plan: &Plan) -> String {
    plan.sources
        .first()
        .map(|(tier, _)| format!("being verified by hash and repaired from tier {tier}"))
        .unwrap_or_else(|| "no verified replica to repair it from".to_owned())
}

impl Promoter {
    /// Checks the replica of `plan`'s version at `prefix` on the request's tier before it is
    /// handed out again (the module docs): [`Reuse::Intact`], or the damage found is published
    /// (`replica.damaged`, then `stage.pending` saying why) and [`Reuse::Repair`].
    pub(crate) async fn check_before_reuse(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        plan: &Plan,
        dst: &Tier,
        prefix: &str,
    ) -> Result<Reuse, HandlerError> {
        let node = request.node.as_deref();
        let place = (request.tier.as_str(), node);
        if plan
            .damaged
            .iter()
            .any(|(t, n)| *t == request.tier && n.as_deref() == node)
        {
            // Withdrawn already (by a copy down, a scrub or an earlier check): the copy path
            // verifies every file by hash and repairs it, and its replica.created makes it
            // ready again. Its fingerprint may well match: bytes can rot under metadata.
            info!(request = %record.event.id, tier = %request.tier, %prefix, "the catalogue holds this replica damaged or unreachable: verifying by hash and repairing before it is handed out");
            let waiting = self.pending_fact(
                record,
                WaitingFor::Copy,
                &format!(
                    "version {} on tier {} is recorded damaged or unreachable; {}",
                    plan.version,
                    request.tier,
                    repair_source(plan)
                ),
                None,
            );
            self.emit(std::slice::from_ref(&waiting)).await?;
            return Ok(Reuse::Repair);
        }
        let store = self.p().coordination.store();
        let recorded = placement::fingerprint(store, &request.tier, node, prefix)
            .await
            .map_err(retry)?
            .and_then(|bytes| match Fingerprint::decode(&bytes) {
                Ok(print) => Some(print),
                Err(e) => {
                    warn!(tier = %request.tier, %prefix, error = %e, "recorded fingerprint unreadable: verifying the replica by hash");
                    None
                }
            });
        let (found_by, differences) = match recorded {
            Some(recorded) => {
                let found = dst.fingerprint(prefix).await.map_err(retry)?;
                let differences = recorded.compare(&found);
                if differences.is_empty() {
                    return Ok(Reuse::Intact);
                }
                ("fingerprint", differences)
            }
            None => {
                let project = record.event.project.as_str();
                let manifest = match self.manifest(project, &request.dataset, plan).await {
                    Ok(m) => m,
                    Err(CopyFailed::Retry(e)) => return Err(e),
                    // Nothing can be verified without the list: the copy path answers the
                    // request (`stage.failed` with the reason) and hands nothing out.
                    Err(CopyFailed::Fail { .. }) => return Ok(Reuse::Repair),
                };
                let (files, listed) = manifest.file_stream(4096);
                let check = self
                    .p()
                    .mover
                    .check_set(dst, prefix, files)
                    .await
                    .map_err(retry)?;
                if let Some(e) = listed.take_error() {
                    return Err(retry(format!(
                        "the manifest of version {} ended early while the replica on tier {} was verified: {e}",
                        plan.version, request.tier
                    )));
                }
                if check.differences.is_empty() {
                    info!(tier = %request.tier, %prefix, files = check.files, "a replica with no fingerprint verified by hash; its fingerprint recorded");
                    record_print(store, place, prefix, &check.fingerprint).await;
                    return Ok(Reuse::Intact);
                }
                ("hash", check.differences)
            }
        };
        let source = repair_source(plan);
        let reason = match found_by {
            "fingerprint" => format!(
                "its files differ from the fingerprint recorded when it was staged; readiness withdrawn, {source}"
            ),
            _ => format!(
                "its files do not verify against the version's manifest; readiness withdrawn, {source}"
            ),
        };
        let fact = record.event.caused(
            &step_damaged(&request.tier, node),
            Body::ReplicaDamaged(ReplicaDamaged {
                dataset: request.dataset.clone(),
                version: plan.version.clone(),
                location: Location {
                    tier: request.tier.clone(),
                    prefix: prefix.to_owned(),
                },
                node: node.map(str::to_owned),
                found_by: found_by.to_owned(),
                files: damaged_files(&differences),
                damaged_total: differences.len() as u64,
                reason: reason.clone(),
            }),
        );
        warn!(
            request = %record.event.id,
            tier = %request.tier,
            node = node.unwrap_or("-"),
            %prefix,
            found_by,
            damaged = differences.len(),
            first = %differences[0].path,
            how = differences[0].change.as_str(),
            "a replica found damaged before reuse: withdrawn, to be verified and repaired"
        );
        // Withdrawn first: nothing of the repair starts before the fact is stored.
        self.emit(std::slice::from_ref(&fact)).await?;
        let waiting = self.pending_fact(
            record,
            WaitingFor::Copy,
            &format!(
                "version {} on tier {} was found damaged ({} path(s), found by {found_by}); {source}",
                plan.version,
                request.tier,
                differences.len()
            ),
            None,
        );
        self.emit(std::slice::from_ref(&waiting)).await?;
        Ok(Reuse::Repair)
    }
}
