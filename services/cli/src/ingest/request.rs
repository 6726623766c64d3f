//! The ingest request a producer publishes, and how a rerun gets past an earlier answer.
//!
//! **The manifest** travels inline only when its canonical bytes fit the contract's bound
//! ([`INLINE_MANIFEST_MAX_BYTES`]); otherwise it is put into the project's upload bucket
//! `stagehand_uploads_<project>` (named by its SHA-256, the declared version) and the request
//! carries the reference. [`inline_files`] refuses to build an inline request over the bound,
//! so this producer cannot emit one.
//!
//! **Ids and attempts.** The same upload of the same bytes to the same dataset is the same
//! request: attempt 0 has the id [`EventId::for_ingest`]`(project, dataset, version)`. A
//! request whose answer was a *rejection* has that answer recorded by the validator for good
//! (publishing the id again is answered with the same rejection, even after the cause — a
//! policy, a tier — was fixed), so a rerun with `--wait` that meets an earlier attempt's
//! rejection (a verdict that became true before this run published it) moves on to the next
//! attempt, `EventId::derive(attempt 0, "attempt-<n>")`, which the validator works on afresh.
//! A request that was *dead-lettered* (its source tier was unreachable for every retry) has
//! no recorded answer: it only needs to reach the validator again. Outside the requests
//! stream's duplicate window it does by itself; inside it the stream drops the rerun's
//! message as a copy (the PubAck says so), and a rerun that waits publishes the same request
//! once more as a message of its own (`Nats-Msg-Id` = `<id>.<run>`), which the validator
//! answers from its record or works on again. Both are decided with what an uploader may
//! see: its PubAcks and its own project's verdicts.

use anyhow::bail;
use stagehand_bus::Bus;
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore};
use stagehand_schemas::Retryable;
use stagehand_schemas::manifest::{INLINE_MANIFEST_MAX_BYTES, canonical_len};
use stagehand_schemas::subject::upload_manifest_bucket;
use stagehand_schemas::{Body, Event, EventId, FileRef, IngestRequested, Location, ManifestRef};

/// Attempts a single run walks through before it stops (each met an earlier rejection).
pub const MAX_ATTEMPTS_PER_RUN: u32 = 16;

/// How a request carries its manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Carried {
    /// Every entry in the event (small manifests only).
    Inline(Vec<FileRef>),
    /// A reference into the project's upload bucket.
    Reference(ManifestRef),
}

impl Carried {
    pub fn files(&self) -> u64 {
        match self {
            Carried::Inline(files) => files.len() as u64,
            Carried::Reference(r) => r.files,
        }
    }

    pub fn is_reference(&self) -> bool {
        matches!(self, Carried::Reference(_))
    }
}

/// `files` as an inline manifest, refused when their canonical bytes exceed the contract's
/// inline bound: such a request must carry a reference instead.
pub fn inline_files(files: Vec<FileRef>) -> anyhow::Result<Carried> {
    let bytes = canonical_len(&files);
    if bytes > INLINE_MANIFEST_MAX_BYTES {
        bail!(
            "refused: an inline manifest of {} files is {bytes} bytes of manifest lines, over the \
             contract's inline bound of {INLINE_MANIFEST_MAX_BYTES} bytes \
             (INLINE_MANIFEST_MAX_BYTES); put the manifest into the project's upload bucket and \
             send a reference",
            files.len()
        );
    }
    Ok(Carried::Inline(files))
}

/// How `manifest` travels: inline when it fits, else put into `project`'s upload bucket (once:
/// an object of that digest already there holds the same bytes) and referenced.
pub async fn carry(bus: &Bus, project: &str, manifest: &Manifest) -> anyhow::Result<Carried> {
    if let Some(files) = manifest.inline_entries()? {
        return inline_files(files);
    }
    let bucket = upload_manifest_bucket(project);
    let store = match ManifestStore::uploads(
        bus.jetstream(),
        project,
        BucketOptions {
            replicas: bus.replicas(),
        },
    )
    .await
    {
        Ok(store) => store,
        Err(e) if bus.was_denied("$JS.API.STREAM.CREATE") => {
            bail!(
                "the manifest ({} files) is too large to travel inline and the project's upload \
                 bucket {bucket} does not exist; this NATS user may not create it: ask an \
                 operator to run `stagehand provision --project {project}` ({e})",
                manifest.files()
            );
        }
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("opening the project's upload bucket {bucket}")));
        }
    };
    let put = || store.put(manifest);
    let reference = crate::args::through_election(
        bus.publish_timeout(),
        stagehand_manifest::ManifestError::is_retryable,
        put,
    )
    .await
    .map_err(|e| {
        anyhow::Error::new(e).context(format!(
            "putting the manifest ({} files) into the project's upload bucket {bucket}",
            manifest.files()
        ))
    })?;
    Ok(Carried::Reference(reference))
}

/// The id of attempt `attempt` of ingesting the manifest `digest` into `dataset`.
pub fn attempt_id(project: &str, dataset: &str, digest: &str, attempt: u32) -> EventId {
    let first = EventId::for_ingest(project, dataset, digest);
    match attempt {
        0 => first,
        n => EventId::derive(&first, &format!("attempt-{n}")),
    }
}

/// What a request says besides its manifest.
#[derive(Debug, Clone)]
pub struct RequestParts {
    pub project: String,
    pub dataset: String,
    pub source: Location,
    pub requested_by: String,
    pub labels: Vec<(String, String)>,
}

/// The `ingest.requested` event of attempt `id`.
pub fn request_event(id: EventId, parts: &RequestParts, carried: &Carried) -> Event {
    let (files, manifest) = match carried {
        Carried::Inline(files) => (files.clone(), None),
        Carried::Reference(r) => (Vec::new(), Some(r.clone())),
    };
    Event::request(
        id,
        parts.project.clone(),
        Body::IngestRequested(IngestRequested {
            dataset: parts.dataset.clone(),
            source: parts.source.clone(),
            files,
            manifest,
            requested_by: parts.requested_by.clone(),
            labels: parts.labels.clone(),
        }),
    )
}

/// The `Nats-Msg-Id` of a run's publication of `id`: distinct per run, so the stream never
/// drops a rerun as a copy of an earlier (perhaps dead-lettered) message.
pub fn run_msg_id(id: &EventId, run: &EventId) -> String {
    format!("{id}.{run}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::sha256_hex;

    /// Issue 7: a request with an inline manifest over the inline bound is refused at the
    /// producer, with an error that names the bound and the way out.
    #[test]
    fn an_inline_manifest_over_the_bound_is_refused() {
        let line = |i: usize| {
            FileRef::new(
                format!("images/{i:08}.jpg"),
                1000,
                sha256_hex(&i.to_be_bytes()),
            )
        };
        let one = canonical_len(&[line(0)]);
        let fits = (INLINE_MANIFEST_MAX_BYTES / one) as usize;
        let at_bound: Vec<FileRef> = (0..fits).map(line).collect();
        assert!(canonical_len(&at_bound) <= INLINE_MANIFEST_MAX_BYTES);
        assert!(matches!(inline_files(at_bound).unwrap(), Carried::Inline(f) if f.len() == fits));
        let over: Vec<FileRef> = (0..fits + 1).map(line).collect();
        let err = inline_files(over).unwrap_err().to_string();
        assert!(
            err.starts_with("refused: an inline manifest of")
                && err.contains(&INLINE_MANIFEST_MAX_BYTES.to_string())
                && err.contains("upload bucket"),
            "{err}"
        );
    }

    #[test]
    fn attempts_have_distinct_stable_ids_and_the_first_is_the_contracts() {
        let digest = sha256_hex(b"manifest");
        assert_eq!(
            attempt_id("p", "d", &digest, 0),
            EventId::for_ingest("p", "d", &digest)
        );
        let ids: std::collections::BTreeSet<EventId> =
            (0..5).map(|n| attempt_id("p", "d", &digest, n)).collect();
        assert_eq!(ids.len(), 5);
        assert_eq!(
            attempt_id("p", "d", &digest, 3),
            attempt_id("p", "d", &digest, 3)
        );
        let run = EventId::random();
        assert_ne!(
            run_msg_id(&attempt_id("p", "d", &digest, 0), &run),
            run_msg_id(&attempt_id("p", "d", &digest, 0), &EventId::random())
        );
    }
}
