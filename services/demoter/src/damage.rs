//! A copy down whose source does not verify says so: the hot (or node-local) replica being
//! demoted is read whole and every byte hashed against the version's manifest, so a damaged
//! one can never become the capacity copy — and when a file of it is missing, of another size
//! or does not hash to its SHA-256, `replica.damaged` (`found_by` `hash`, naming the file and
//! how) withdraws its readiness at once, so no job is told it is ready while the demotion
//! waits. The next stage request of the version finds it withdrawn, verifies it by hash and
//! repairs it (the promoter's check before reuse), after which the demotion goes through.

use stagehand_bus::Bus;
use stagehand_mover::{ErrorKind, Side, TransferError};
use stagehand_schemas::{Body, DamagedFile, Event, EventId, Location, ReplicaDamaged};
use tracing::warn;

use crate::demoter::PassError;
use crate::state::Step;

/// How a source error names the damage of the file it is about, if it is about damage.
fn how(e: &TransferError) -> Option<&'static str> {
    if e.side != Side::Source {
        return None;
    }
    match e.kind {
        ErrorKind::NotFound => Some("missing"),
        ErrorKind::SizeMismatch => Some("size"),
        ErrorKind::ChecksumMismatch => Some("hash"),
        ErrorKind::NotAFile => Some("kind"),
        _ => None,
    }
}

/// The step's error for a copy down that failed with `e`; when `e` says the source replica is
/// damaged, `replica.damaged` is published for it first.
pub(crate) async fn copy_down_failed(bus: &Bus, step: &Step, e: TransferError) -> PassError {
    let Some(how) = how(&e) else {
        return PassError::Step(e.to_string());
    };
    let step_name = match &step.node {
        Some(n) => format!("damaged:{}:{n}", step.tier),
        None => format!("damaged:{}", step.tier),
    };
    let fact = Event::request(
        EventId::for_fact(&step.project, &step.id, &step_name),
        step.project.clone(),
        Body::ReplicaDamaged(ReplicaDamaged {
            dataset: step.dataset.clone(),
            version: step.version.clone(),
            location: Location {
                tier: step.tier.clone(),
                prefix: step.prefix.clone(),
            },
            node: step.node.clone(),
            found_by: "hash".into(),
            files: vec![DamagedFile {
                path: e.path.clone(),
                how: how.into(),
                expected_size: None,
                found_size: None,
            }],
            damaged_total: 1,
            reason: "the demoter's copy down read it against the version's manifest; readiness withdrawn, the demotion waits until a stage request of it has verified and repaired it".into(),
        }),
    );
    warn!(tier = %step.tier, prefix = %step.prefix, file = %e.path, how, "the replica being demoted is damaged: its readiness is withdrawn and nothing is copied down");
    if let Err(pe) = bus.publish(&fact).await {
        return PassError::Step(format!(
            "{e}; and replica.damaged could not be published: {pe}"
        ));
    }
    PassError::Step(e.to_string())
}
