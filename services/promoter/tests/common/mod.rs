//! The promoter's test harness: a real nats-server, the real catalogue recorder, posix tiers
//! in a temp dir, promoters in-process (or as processes), and readers of the facts stream.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_schemas::{
    Body, DatasetRejected, DatasetValidated, Event, EventId, FileRef, IngestRequested, Location,
    Problem, StageReleased, StageRequested, sha256_hex, subject, version_digest,
};
use stagehand_testkit::{NatsServer, user_url};

pub const WAIT: Duration = Duration::from_secs(30);
pub const PROJECT: &str = "lab-a";

pub const VALIDATION: &str = r#"
max_file_size = "1 GiB"
max_entries = 100000
max_total_bytes = "10 GiB"
allowed_suffixes = []
denied_suffixes = [".exe"]
allow_hidden = false
"#;

/// A stack: NATS, the recorder, tiers and policies; promoters are started on it.
pub struct Stack {
    pub nats: NatsServer,
    /// Whether the server runs `deploy/nats/accounts.conf`.
    pub accounts: bool,
    pub tmp: tempfile::TempDir,
    pub bus: Bus,
    pub policies: PathBuf,
    pub shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

pub struct Options {
    /// Extra lines of tiers.toml's `[tiers.hot.quotas]`.
    pub hot_quotas: &'static str,
    pub hot_capacity: &'static str,
    /// An S3 capacity tier instead of posix: (endpoint, bucket).
    pub s3_capacity: Option<(String, String)>,
    /// Run the server with `deploy/nats/accounts.conf`: the operator provisions, the recorder
    /// and the promoters connect as their own users, which may not provision.
    pub accounts: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            hot_quotas: "default = \"100 MiB\"",
            hot_capacity: "1 GiB",
            s3_capacity: None,
            accounts: false,
        }
    }
}

impl Stack {
    pub async fn start() -> Stack {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(opts: Options) -> Stack {
        let nats = if opts.accounts {
            NatsServer::builder().shipped_accounts().start()
        } else {
            NatsServer::start()
        };
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for t in ["source", "capacity", "hot", "local-n1", "local-n2"] {
            std::fs::create_dir_all(root.join("tiers").join(t)).unwrap();
        }
        let policies = root.join("policies");
        std::fs::create_dir_all(&policies).unwrap();
        let capacity = match &opts.s3_capacity {
            None => format!(
                "kind = \"posix\"\nroot = \"{}\"",
                root.join("tiers/capacity").display()
            ),
            Some((endpoint, bucket)) => {
                format!(
                    "kind = \"s3\"\nendpoint = \"{endpoint}\"\nallow_plaintext = true\nbucket = \"{bucket}\"\nprefix = \"\"\nregion = \"us-east-1\""
                )
            }
        };
        std::fs::write(
            policies.join("tiers.toml"),
            format!(
                "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{src}\"\n\n\
                 [tiers.capacity]\n{capacity}\nrole = \"capacity\"\nfailure_domain = \"cap\"\n\n\
                 [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{hot}\"\ncapacity = \"{hotcap}\"\n\n\
                 [tiers.hot.quotas]\n{quotas}\n\n\
                 [tiers.local]\nkind = \"posix\"\nrole = \"local\"\nfailure_domain = \"nvme\"\nroot = \"{local}\"\ncapacity = \"1 GiB\"\n",
                src = root.join("tiers/source").display(),
                hot = root.join("tiers/hot").display(),
                hotcap = opts.hot_capacity,
                quotas = opts.hot_quotas,
                // Each node agent of a test gets its own root through its own policy folder.
                local = root.join("tiers/local-n1").display(),
            ),
        )
        .unwrap();
        std::fs::write(policies.join("validation.toml"), VALIDATION).unwrap();
        std::fs::write(
            policies.join("promotion.toml"),
            // A long clock: the tests show that facts, not the clock, answer waiting requests.
            "default_tier = \"hot\"\nsources = [\"capacity\", \"source\"]\nlocal_sources = [\"hot\", \"capacity\"]\n\
             max_concurrent = 4\ndefault_deadline = \"1h\"\nverify = \"read-back\"\nrecheck_every = \"1h\"\n\
             checkpoint_datasets = [\"ckpt-*\"]\n",
        )
        .unwrap();
        let operator = if opts.accounts {
            user_url(&nats, "operator", "OPERATOR")
        } else {
            nats.url()
        };
        let bus = Bus::connect(&BusConfig::new(operator)).await.unwrap();
        // What `stagehand provision` does: the streams and buckets, the promoter's included.
        bus.provision().await.unwrap();
        for spec in stagehand_bus::SERVICE_KV_BUCKETS {
            bus.provision_kv(spec).await.unwrap();
        }
        let shutdown = CancellationToken::new();
        let mut stack = Stack {
            accounts: opts.accounts,
            nats,
            tmp,
            bus,
            policies,
            shutdown,
            tasks: Vec::new(),
        };
        let mut recorder = stagehand_catalogue_recorder::config(
            &stack.url_of("catalogue-recorder", "CATALOGUE_RECORDER"),
            stack.tmp.path().join("recorder"),
        );
        recorder.bus.provision = !stack.accounts;
        let token = stack.shutdown.clone();
        stack.tasks.push(tokio::spawn(async move {
            stagehand_catalogue_recorder::run(recorder, token)
                .await
                .expect("recorder");
        }));
        stack
    }

    /// The server's URL for `user` (with its password when the server runs accounts.conf).
    pub fn url_of(&self, user: &str, role: &str) -> String {
        if self.accounts {
            user_url(&self.nats, user, role)
        } else {
            self.nats.url()
        }
    }

    pub fn root(&self) -> &Path {
        self.tmp.path()
    }

    pub fn tier(&self, name: &str) -> PathBuf {
        self.root().join("tiers").join(name)
    }

    /// The promoter's configuration for an instance named `instance` (its own state).
    pub fn promoter_config(&self, instance: &str) -> stagehand_promoter::Config {
        let mut config = stagehand_promoter::config(
            &self.url_of("promoter", "PROMOTER"),
            &self.policies,
            self.root().join("state").join(instance),
        );
        config.bus.provision = !self.accounts;
        config.service.instance = Some(instance.into());
        config.service.progress_every = Duration::from_millis(200);
        config.service.lease_lifetime = Duration::from_secs(3);
        config.worker.ack_wait = Some(Duration::from_secs(3));
        config.worker.retry = Some(stagehand_bus::RetrySchedule {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(500),
            factor: 2.0,
            jitter: 0.0,
        });
        config
    }

    /// Runs a promoter in-process until the stack stops.
    pub fn run_promoter(&mut self, config: stagehand_promoter::Config) {
        let token = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            stagehand_promoter::run(config, token)
                .await
                .expect("promoter");
        }));
    }

    /// Writes files of `dataset` under `<project>/<dataset>/<tag>` on a posix tier; returns
    /// the prefix and the manifest.
    pub fn put_files(
        &self,
        tier: &str,
        dataset: &str,
        tag: &str,
        files: &[(&str, Vec<u8>)],
    ) -> (String, Vec<FileRef>) {
        let prefix = format!("{PROJECT}/{dataset}/{tag}");
        let mut refs = Vec::new();
        for (path, bytes) in files {
            let p = self.tier(tier).join(&prefix).join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, bytes).unwrap();
            refs.push(FileRef::new(*path, bytes.len() as u64, sha256_hex(bytes)));
        }
        (prefix, refs)
    }

    pub async fn publish(&self, event: &Event) {
        self.bus.publish(event).await.unwrap();
    }

    /// Publishes `dataset.validated` for files at `prefix` on `tier`; returns the version.
    pub async fn validated(
        &self,
        dataset: &str,
        tier: &str,
        prefix: &str,
        files: &[FileRef],
    ) -> String {
        let version = version_digest(files);
        let ingest = EventId::for_ingest(PROJECT, dataset, &version);
        let fact = Event::request(
            ingest.clone(),
            PROJECT,
            Body::IngestRequested(ingest_body(dataset, tier, prefix, files)),
        )
        .caused(
            "validated",
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.into(),
                version: version.clone(),
                source: Location {
                    tier: tier.into(),
                    prefix: prefix.into(),
                },
                files: files.to_vec(),
                manifest: None,
                total_bytes: files.iter().map(|f| f.size).sum(),
                requested_by: "test".into(),
                request_id: ingest,
                labels: vec![],
            }),
        );
        self.publish(&fact).await;
        version
    }

    /// Publishes `dataset.prepared`: shards at `prefix` on `tier` derived from `raw`.
    pub async fn prepared(
        &self,
        dataset: &str,
        raw: &str,
        tier: &str,
        prefix: &str,
        files: &[FileRef],
    ) -> String {
        let version = version_digest(files);
        let cause = EventId::for_content(&[b"prepare", raw.as_bytes()]);
        let fact = Event::request(
            EventId::derive(&cause, "prepared"),
            PROJECT,
            Body::DatasetPrepared(stagehand_schemas::DatasetPrepared {
                dataset: dataset.into(),
                version: version.clone(),
                derived_from: raw.into(),
                location: Location {
                    tier: tier.into(),
                    prefix: prefix.into(),
                },
                files: files.to_vec(),
                manifest: None,
                total_bytes: files.iter().map(|f| f.size).sum(),
                layout: "webdataset".into(),
                samples: files.len() as u64,
                seed: 0,
            }),
        );
        self.publish(&fact).await;
        version
    }

    /// Publishes `replica.removed` of the replica at `prefix` on `tier` (on `node`'s local
    /// tier when given): what the demoter does after removing it.
    pub async fn removed(
        &self,
        dataset: &str,
        version: &str,
        (tier, node): (&str, Option<&str>),
        prefix: &str,
    ) {
        let fact = Event::request(
            EventId::for_content(&[
                b"removed",
                tier.as_bytes(),
                node.unwrap_or("").as_bytes(),
                prefix.as_bytes(),
            ]),
            PROJECT,
            Body::ReplicaRemoved(stagehand_schemas::ReplicaRemoved {
                dataset: dataset.into(),
                version: version.into(),
                location: Location {
                    tier: tier.into(),
                    prefix: prefix.into(),
                },
                reason: "demoted".into(),
                node: node.map(str::to_owned),
            }),
        );
        self.publish(&fact).await;
    }

    /// Publishes the `ingest.requested` an upload of these files would.
    pub async fn ingest_requested(
        &self,
        dataset: &str,
        tier: &str,
        prefix: &str,
        files: &[FileRef],
    ) {
        let version = version_digest(files);
        let id = EventId::for_ingest(PROJECT, dataset, &version);
        self.publish(&Event::request(
            id,
            PROJECT,
            Body::IngestRequested(ingest_body(dataset, tier, prefix, files)),
        ))
        .await;
    }

    /// Publishes `dataset.rejected` of these files with one checksum problem.
    pub async fn rejected(&self, dataset: &str, files: &[FileRef], bad: &str) -> String {
        let version = version_digest(files);
        let ingest = EventId::for_ingest(PROJECT, dataset, &version);
        let fact = Event::request(
            ingest.clone(),
            PROJECT,
            Body::IngestRequested(ingest_body(dataset, "source", "x", files)),
        )
        .caused(
            "rejected",
            Body::DatasetRejected(DatasetRejected {
                dataset: dataset.into(),
                source: Location {
                    tier: "source".into(),
                    prefix: format!("{PROJECT}/{dataset}/up"),
                },
                declared_version: version.clone(),
                requested_by: "test".into(),
                request_id: ingest,
                problems: vec![Problem {
                    code: "checksum_mismatch".into(),
                    path: Some(bad.into()),
                    detail: "the bytes hash to something else than the manifest says".into(),
                }],
                quarantine: None,
                problem_counts: vec![("checksum_mismatch".into(), 1)],
                problems_total: Some(1),
            }),
        );
        self.publish(&fact).await;
        version
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
        }
    }
}

fn ingest_body(dataset: &str, tier: &str, prefix: &str, files: &[FileRef]) -> IngestRequested {
    IngestRequested {
        dataset: dataset.into(),
        source: Location {
            tier: tier.into(),
            prefix: prefix.into(),
        },
        files: files.to_vec(),
        manifest: None,
        requested_by: "test".into(),
        labels: vec![],
    }
}

/// A stage request of job `job` (its id from the job, as the CLI derives it).
pub fn stage_request(
    dataset: &str,
    version: &str,
    tier: &str,
    job: &str,
    node: Option<&str>,
    deadline: Option<time::OffsetDateTime>,
) -> Event {
    stage_request_form(dataset, version, tier, job, node, deadline, None)
}

/// [`stage_request`] with a `form`.
pub fn stage_request_form(
    dataset: &str,
    version: &str,
    tier: &str,
    job: &str,
    node: Option<&str>,
    deadline: Option<time::OffsetDateTime>,
    form: Option<&str>,
) -> Event {
    let id = EventId::for_stage(PROJECT, job, dataset, version, tier, node);
    Event::request(
        id,
        PROJECT,
        Body::StageRequested(StageRequested {
            dataset: dataset.into(),
            version: version.into(),
            tier: tier.into(),
            job_id: job.into(),
            requested_by: "slurm".into(),
            deadline,
            node: node.map(Into::into),
            form: form.map(Into::into),
            hold_until: None,
        }),
    )
}

pub fn stage_release(dataset: &str, version: &str, tier: &str, job: &str) -> Event {
    let id = EventId::for_stage_release(PROJECT, job, dataset, version, tier, None);
    Event::request(
        id,
        PROJECT,
        Body::StageReleased(StageReleased {
            dataset: dataset.into(),
            version: version.into(),
            tier: tier.into(),
            job_id: job.into(),
            node: None,
            reason: None,
        }),
    )
}

/// Every fact of `kind` stored in the facts stream, in order.
pub async fn facts(js: &jetstream::Context, kind: &str) -> Vec<Event> {
    stagehand_testkit::stored_events(js, subject::FACTS.name, subject::kind_filter("fact", kind))
        .await
        .unwrap()
}

/// Whether every consumer named has handled and acked everything it was given (false while
/// a consumer does not exist yet).
pub async fn drained(js: &jetstream::Context, stream: &str, consumers: &[&str]) -> bool {
    let Ok(stream) = js.get_stream(stream).await else {
        return false;
    };
    for c in consumers {
        match stream.clone().consumer_info(*c).await {
            Ok(info) if info.num_pending == 0 && info.num_ack_pending == 0 => {}
            _ => return false,
        }
    }
    true
}

/// Waits until instance `instance`'s facts and ingests consumers have handled everything.
pub async fn settled(js: &jetstream::Context, instance: &str) {
    let facts = format!("promoter-facts-{instance}");
    let ingests = format!("promoter-ingests-{instance}");
    stagehand_testkit::wait_until(WAIT, "the promoter to have seen every fact", || async {
        drained(js, subject::FACTS.name, &[&facts]).await
            && drained(js, subject::REQUESTS.name, &[&ingests]).await
    })
    .await
    .unwrap();
}

/// The facts of `kind` answering request `id`.
pub async fn answers(js: &jetstream::Context, kind: &str, id: &EventId) -> Vec<Event> {
    facts(js, kind)
        .await
        .into_iter()
        .filter(|e| e.causation_id.as_ref() == Some(id))
        .collect()
}

/// The path a `stage.ready` gives.
pub fn ready_path(e: &Event) -> String {
    match &e.body {
        Body::StageReady(r) => r.path.clone().unwrap_or_default(),
        _ => panic!("not stage.ready: {e:?}"),
    }
}

pub fn failed_reason(e: &Event) -> (String, bool) {
    match &e.body {
        Body::StageFailed(f) => (f.reason.clone(), f.retryable),
        _ => panic!("not stage.failed: {e:?}"),
    }
}

/// Entries of a directory (names), sorted; empty when it does not exist.
pub fn list(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Deterministic bytes of a file.
pub fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Starts the real `stagehand-promoter` binary (instance `crashy`) with a configuration file
/// of its own, optionally bandwidth-limited.
pub fn spawn(
    stack: &Stack,
    name: &str,
    bytes_per_second: Option<u64>,
    envs: &[(&str, &str)],
) -> Child {
    let dir = stack.root().join(format!("proc-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("promoter.toml");
    let limit = bytes_per_second
        .map(|b| format!("bytes_per_second = {b}\n"))
        .unwrap_or_default();
    std::fs::write(
        &file,
        format!(
            "[bus]\nservers = [\"{url}\"]\n\n[worker]\nack_wait = \"3s\"\nretry = {{ initial = \"100ms\", max = \"500ms\", factor = 2.0, jitter = 0.0 }}\n\n\
             [telemetry]\nlog_level = \"info\"\n\n\
             [service]\npolicies_dir = \"{policies}\"\nstate_dir = \"{state}\"\ninstance = \"crashy\"\nprogress_every = \"200ms\"\nlease_lifetime = \"3s\"\n\n\
             [service.mover]\n{limit}",
            url = stack.nats.url(),
            policies = stack.policies.display(),
            state = stack.root().join("state/crashy").display(),
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("stderr.log")).unwrap();
    Command::new(env!("CARGO_BIN_EXE_stagehand-promoter"))
        // The environment's server (if any) would override the file's.
        .env("STAGEHAND_NATS_URL", stack.nats.url())
        .envs(envs.iter().copied())
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// The stderr of a promoter process started by [`spawn`], for a failing test's message.
pub fn log_of(stack: &Stack, name: &str) -> String {
    std::fs::read_to_string(stack.root().join(format!("proc-{name}/stderr.log")))
        .unwrap_or_default()
}
