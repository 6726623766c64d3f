//! What the validator's integration tests share: a real nats-server, a posix source tier in a
//! temporary directory, the validator running in-process, and helpers to build requests,
//! put manifests in the upload bucket and read what the validator published (through the
//! testkit's stream reader and drained check).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, CancellationToken, WorkerConfig, WorkerStats, run_worker};
use stagehand_ingest_validator::source::SourceFiles;
use stagehand_ingest_validator::{
    Config, IngestValidator, SERVICE, Settings, SourceChecks, ValidatorOptions, config, run,
};
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_policy::{Policies, TierRole};
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::{
    Body, Event, EventId, FileRef, IngestRequested, Location, ManifestRef, sha256_hex, subject,
    wire,
};
#[allow(unused_imports)] // each test binary uses part of this
pub use stagehand_testkit::stored_messages;
use stagehand_testkit::{
    NatsServer, PolicyFiles, StoredMessage, TierSpec, drained, stored_events, wait_for, wait_until,
};

pub const TIMEOUT: Duration = Duration::from_secs(60);
pub const PROJECT: &str = "lab-a";

pub const VALIDATION: &str = r#"
max_file_size = "1 MiB"
max_entries = 1000000
max_total_bytes = "100 MiB"
allowed_suffixes = []
denied_suffixes = [".exe"]
allow_hidden = false
"#;

/// Writes the validator's policies into `dir`: a posix source tier at `source_root` and a
/// hot tier, and [`VALIDATION`].
pub fn write_policies(dir: &Path, source_root: &Path) {
    PolicyFiles::new()
        .tier("source", TierSpec::posix("source", "lab").root(source_root))
        .tier(
            "hot",
            TierSpec::posix("hot", "hot").root("hot").capacity("1 GiB"),
        )
        .validation(VALIDATION)
        .write(dir);
}

/// A nats-server, a posix source tier in a temp dir, and the validator running in-process.
pub struct Harness {
    pub nats: NatsServer,
    pub tmp: tempfile::TempDir,
    pub source_root: PathBuf,
    pub policies_dir: PathBuf,
    pub bus: Bus,
    pub js: jetstream::Context,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<WorkerStats>,
}

impl Harness {
    /// The validator as the service runs it ([`run`]).
    pub async fn start() -> Harness {
        Self::start_with(|_| {}).await
    }

    /// The validator as the service runs it, with `tweak` applied to its configuration.
    pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> Harness {
        let (nats, tmp, source_root, policies_dir) = Self::prepare();
        let mut config = config(&nats.url(), &policies_dir, tmp.path().join("state"));
        config.service.read_concurrency = 4;
        tweak(&mut config);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(config, shutdown.clone()));
        let task = tokio::spawn(async move { task.await.unwrap().expect("validator run") });
        Self::finish(nats, tmp, source_root, policies_dir, shutdown, task).await
    }

    /// The validator's handler over the posix source tier wrapped by `wrap`, run by the
    /// worker runtime with `tweak` applied to its worker configuration.
    pub async fn start_worker<S, W>(wrap: W, tweak: impl FnOnce(&mut WorkerConfig)) -> Harness
    where
        S: SourceFiles + 'static,
        W: FnOnce(stagehand_mover::Tier) -> S,
    {
        let (nats, tmp, source_root, policies_dir) = Self::prepare();
        let policies = Policies::load_dir(&policies_dir).unwrap();
        let tier = policies.tiers()["source"].open().unwrap();
        let tiers = std::collections::HashMap::from([
            ("source".to_owned(), (TierRole::Source, Some(wrap(tier)))),
            ("hot".to_owned(), (TierRole::Hot, None)),
        ]);
        let checks = SourceChecks::from_parts(policies.validation().clone(), tiers);
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        let state = tmp.path().join("state");
        let handler = IngestValidator::new(
            checks,
            bus.jetstream().clone(),
            ValidatorOptions::new(&state),
        )
        .unwrap();
        let mut cfg = Settings::new(&policies_dir, &state).worker_config();
        tweak(&mut cfg);
        let shutdown = CancellationToken::new();
        let worker = tokio::spawn(run_worker(bus, cfg, Arc::new(handler), shutdown.clone()));
        let task = tokio::spawn(async move { worker.await.unwrap().expect("worker") });
        Self::finish(nats, tmp, source_root, policies_dir, shutdown, task).await
    }

    fn prepare() -> (NatsServer, tempfile::TempDir, PathBuf, PathBuf) {
        let nats = NatsServer::start();
        let tmp = tempfile::tempdir().unwrap();
        let source_root = tmp.path().join("source");
        std::fs::create_dir_all(&source_root).unwrap();
        let policies_dir = tmp.path().join("policies");
        write_policies(&policies_dir, &source_root);
        (nats, tmp, source_root, policies_dir)
    }

    async fn finish(
        nats: NatsServer,
        tmp: tempfile::TempDir,
        source_root: PathBuf,
        policies_dir: PathBuf,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<WorkerStats>,
    ) -> Harness {
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        let js = bus.jetstream().clone();
        Harness {
            nats,
            tmp,
            source_root,
            policies_dir,
            bus,
            js,
            shutdown,
            task,
        }
    }

    pub async fn stop(self) -> WorkerStats {
        self.shutdown.cancel();
        self.task.await.unwrap()
    }

    /// Puts `files` as a manifest in `project`'s upload bucket, as an uploader does.
    pub async fn upload_manifest(&self, project: &str, files: &[FileRef]) -> ManifestRef {
        let spool = Spool::in_dir(self.tmp.path());
        let mut builder = ManifestBuilder::new(&spool);
        for f in files {
            builder.push(f).unwrap();
        }
        let manifest = builder.finish().unwrap();
        ManifestStore::uploads(&self.js, project, BucketOptions::default())
            .await
            .unwrap()
            .put(&manifest)
            .await
            .unwrap()
    }

    /// Every progress message published for request `id` from now on.
    pub async fn watch_progress(&self, id: &str) -> Arc<Mutex<Vec<WorkProgress>>> {
        let subject = progress_subject(
            "ingest.requested",
            None,
            PROJECT,
            &EventId::new(id).unwrap(),
        );
        let mut sub = self.bus.client().subscribe(subject).await.unwrap();
        // The subscription is registered before anything is published on it.
        self.bus.client().flush().await.unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let into = seen.clone();
        tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                into.lock()
                    .unwrap()
                    .push(WorkProgress::decode(&msg.payload).expect("progress decodes"));
            }
        });
        seen
    }
}

/// Writes `bytes` at `prefix/path` beneath `root` and returns its manifest entry (path
/// relative to `prefix`).
pub fn put(root: &Path, prefix: &str, path: &str, bytes: &[u8]) -> FileRef {
    let full = root.join(prefix).join(path);
    std::fs::create_dir_all(full.parent().unwrap()).unwrap();
    std::fs::write(full, bytes).unwrap();
    FileRef::new(path, bytes.len() as u64, sha256_hex(bytes))
}

/// An ingest request of [`PROJECT`] with its manifest inline.
pub fn request(id: &str, prefix: &str, files: Vec<FileRef>) -> Event {
    request_in(PROJECT, id, prefix, files, None)
}

/// An ingest request of `project`, its manifest inline (`files`) or by `reference`.
pub fn request_in(
    project: &str,
    id: &str,
    prefix: &str,
    files: Vec<FileRef>,
    reference: Option<ManifestRef>,
) -> Event {
    Event::request(
        EventId::new(id).unwrap(),
        project,
        Body::IngestRequested(IngestRequested {
            dataset: "cats".into(),
            source: Location {
                tier: "source".into(),
                prefix: prefix.into(),
            },
            files,
            manifest: reference,
            requested_by: "alice".into(),
            labels: vec![("modality".into(), "image".into())],
        }),
    )
}

/// Every message in a stream, in order.
pub async fn stream_messages(js: &jetstream::Context, stream: &str) -> Vec<StoredMessage> {
    stored_messages(js, stream, "").await.unwrap()
}

pub async fn facts(js: &jetstream::Context) -> Vec<Event> {
    stored_events(js, subject::FACTS.name, "").await.unwrap()
}

pub async fn facts_caused_by(js: &jetstream::Context, id: &str) -> Vec<Event> {
    facts(js)
        .await
        .into_iter()
        .filter(|e| e.causation_id.as_ref().is_some_and(|c| c.as_str() == id))
        .collect()
}

/// Waits for the first fact caused by request `id`.
pub async fn fact_for(js: &jetstream::Context, id: &str) -> Event {
    wait_for(TIMEOUT, &format!("a fact caused by {id}"), || async {
        facts_caused_by(js, id).await.into_iter().next()
    })
    .await
    .unwrap()
}

/// The encoded size of the first fact caused by request `id`, as stored.
pub async fn fact_bytes_for(js: &jetstream::Context, id: &str) -> usize {
    stream_messages(js, subject::FACTS.name)
        .await
        .iter()
        .find(|m| {
            wire::decode(&m.payload)
                .ok()
                .and_then(|e| e.causation_id)
                .is_some_and(|c| c.as_str() == id)
        })
        .map(|m| m.payload.len())
        .expect("the fact is stored")
}

/// Waits until the validator's consumer has acked (or terminated) everything in the stream.
pub async fn wait_idle(js: &jetstream::Context) {
    wait_until(TIMEOUT, "the validator to finish every request", || {
        drained(js, subject::REQUESTS.name, &[SERVICE])
    })
    .await
    .unwrap();
}

pub fn rejection(event: &Event) -> &stagehand_schemas::DatasetRejected {
    let Body::DatasetRejected(r) = &event.body else {
        panic!("expected a rejection, got {event:?}")
    };
    r
}

pub fn problems_of(event: &Event) -> Vec<(String, Option<String>)> {
    rejection(event)
        .problems
        .iter()
        .map(|p| (p.code.clone(), p.path.clone()))
        .collect()
}

/// The lines of a JSON-lines quarantine report.
pub fn report_lines(bytes: &[u8]) -> Vec<serde_json::Value> {
    bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("a report line is JSON"))
        .collect()
}

/// The `(code, path)` of every problem line of a report.
pub fn report_problems(bytes: &[u8]) -> Vec<(String, Option<String>)> {
    report_lines(bytes)
        .iter()
        .filter(|l| l["kind"] == "problem")
        .map(|l| {
            (
                l["code"].as_str().unwrap().to_owned(),
                l["path"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

/// Every entry sorted by path bytes, as the canonical manifest (and the validator) has them.
pub fn sorted(mut files: Vec<FileRef>) -> Vec<FileRef> {
    files.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    files
}
