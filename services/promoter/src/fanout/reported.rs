//! A node told it served bad bytes checks itself. Its peers drop it from the swarm at once
//! (`swarm.<s>.bad.<node>.<by>`); the node's agent, watching for its own name, hashes the file the
//! report names where it served it from. Bytes that do not verify there mean its own copy is
//! damaged — rot under unchanged metadata, which a fingerprint check before reuse cannot see:
//! it stops serving the swarm and, when the copy is a published replica, withdraws it
//! (`replica.damaged`, `found_by` `hash`), so no job is sent to it and the next request for it
//! on this node verifies and repairs it. A report its own hash does not bear out is logged and
//! changes nothing here (its peers still leave it out of that swarm). Only a node's own agent
//! states its replica damaged, and only after reading the bytes itself.

use std::sync::Arc;

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use stagehand_bus::Bus;
use stagehand_bus::runner::consumer_token;
use stagehand_schemas::{Body, DamagedFile, Event, EventId, Location, ReplicaDamaged};
use tracing::{info, warn};

use super::board::{BadKey, Spoiled};
use super::serve::{Holding, Registry};

/// Watches for reports naming `node` until the watch ends; a watch that cannot start is
/// retried by the caller's task group.
pub async fn watch(
    store: kv::Store,
    registry: Arc<Registry>,
    bus: Bus,
    node: String,
) -> Result<(), kv::WatchError> {
    let mut reports = store.watch(BadKey::naming(&consumer_token(&node))).await?;
    while let Some(entry) = reports.next().await {
        let Ok(entry) = entry else { continue };
        if entry.operation != Operation::Put {
            continue;
        }
        let Some(key) = BadKey::parse(&entry.key) else {
            continue;
        };
        let Ok(report) = serde_json::from_slice::<Spoiled>(&entry.value) else {
            continue;
        };
        if let Some(holding) = registry.get(key.swarm) {
            check(
                &registry,
                key,
                &holding,
                &report,
                &bus,
                &node,
                entry.revision,
            )
            .await;
        }
    }
    Ok(())
}

async fn check(
    registry: &Registry,
    key: BadKey<'_>,
    holding: &Holding,
    report: &Spoiled,
    bus: &Bus,
    node: &str,
    revision: u64,
) {
    let (swarm, by) = (key.swarm, key.by);
    let Some(listed) = holding
        .files
        .iter()
        .find(|f| f.path == report.file)
        .cloned()
    else {
        warn!(%swarm, reported_by = %by, file = %report.file, "reported for a file this swarm does not list; ignored");
        return;
    };
    let folder = holding.folder();
    let path = listed.path.clone();
    let found = tokio::task::spawn_blocking(move || folder.hash_file(&path)).await;
    let found = match found {
        Ok(Ok(digest)) if digest.sha256 == listed.sha256 && digest.size == listed.size => {
            info!(%swarm, reported_by = %by, file = %listed.path, "reported serving bad bytes, but the file verifies here; its peers leave this node out of the swarm all the same");
            return;
        }
        Ok(Ok(digest)) => format!(
            "{} bytes hashing to {} (listed: {} bytes, {})",
            digest.size, digest.sha256, listed.size, listed.sha256
        ),
        Ok(Err(e)) => format!("unreadable: {e}"),
        Err(e) => format!("not checked: {e}"),
    };
    warn!(%swarm, reported_by = %by, file = %listed.path, %found, "this node served bad bytes and its copy does not verify: no longer serving it");
    registry.forget(swarm);
    let Some(replica) = holding.published_replica() else {
        // Still a staging folder: its copy fails or repairs itself when its own pieces are
        // checked; nothing was handed out.
        return;
    };
    let cause = EventId::for_content(&[
        b"fanout-spoiled",
        swarm.as_bytes(),
        node.as_bytes(),
        &revision.to_be_bytes(),
    ]);
    let fact = Event::request(
        EventId::for_fact(&replica.project, &cause, "damaged"),
        &replica.project,
        Body::ReplicaDamaged(ReplicaDamaged {
            dataset: replica.dataset.clone(),
            version: replica.version.clone(),
            location: Location {
                tier: replica.tier.clone(),
                prefix: replica.prefix.clone(),
            },
            node: Some(node.to_owned()),
            found_by: "hash".into(),
            files: vec![DamagedFile {
                path: listed.path.clone(),
                how: "hash".into(),
                expected_size: None,
                found_size: None,
            }],
            damaged_total: 1,
            reason: format!(
                "node {} found {} served from this copy not to verify ({}); hashed again here: {found}; readiness withdrawn, the next request for it on this node verifies and repairs it",
                by, listed.path, report.why
            ),
        }),
    );
    if let Err(e) = bus.publish(&fact).await {
        warn!(error = %e, "the damage found could not be stated; the copy is not served to peers, and a scrub or the next check finds it");
    }
}
