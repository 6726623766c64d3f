//! The promoter's test harness on the shared stack (stagehand_testkit::Stack): its tiers and
//! policies, the promoter in-process (or as its binary), and the facts other services publish
//! (a validation, a preparation, a removal, a rejection).

#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use async_nats::jetstream;
use stagehand_schemas::{
    Body, DatasetRejected, Event, EventId, FileRef, IngestRequested, Location, Problem, subject,
    version_digest,
};
use stagehand_testkit::{PolicyFiles, VALIDATION, validated_fact};
#[allow(unused_imports)] // each test binary uses part of this
pub use stagehand_testkit::{
    ServiceProcess, StageRequest, TierSpec, drained, list_dir as list, pattern_bytes as bytes,
    put_files, stored_facts as facts,
};

pub const WAIT: Duration = Duration::from_secs(30);
pub const PROJECT: &str = "lab-a";

/// The shared stack with the promoter's tiers and policies and the recorder running;
/// promoters are started on it.
pub struct Stack(pub stagehand_testkit::Stack);

impl Deref for Stack {
    type Target = stagehand_testkit::Stack;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for Stack {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
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
    /// promotion.toml's `max_concurrent`: copy slots per instance.
    pub max_concurrent: u32,
    /// With `accounts`: the nodes whose agents connect as their own node's user
    /// (`node-<node>`) rather than the promoter's.
    pub node_users: &'static [&'static str],
}

impl Default for Options {
    fn default() -> Self {
        Options {
            hot_quotas: "default = \"100 MiB\"",
            hot_capacity: "1 GiB",
            s3_capacity: None,
            accounts: false,
            max_concurrent: 4,
            node_users: &[],
        }
    }
}

impl Stack {
    pub async fn start() -> Stack {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(opts: Options) -> Stack {
        let mut builder = stagehand_testkit::Stack::builder();
        if opts.accounts {
            builder = builder.shipped_accounts_with_nodes(opts.node_users);
        }
        let capacity = match &opts.s3_capacity {
            None => TierSpec::posix("capacity", "cap"),
            Some((endpoint, bucket)) => TierSpec::s3_at("capacity", "cap", endpoint, bucket),
        };
        let stack = builder
            .tier("source", TierSpec::posix("source", "lab"))
            .tier("capacity", capacity)
            .tier(
                "hot",
                TierSpec::posix("hot", "hot")
                    .capacity(opts.hot_capacity)
                    .quotas(opts.hot_quotas),
            )
            // Each node agent of a test gets its own root through its own policy folder.
            .tier_in(
                "local",
                "local-n1",
                TierSpec::posix("local", "nvme").capacity("1 GiB"),
            )
            .tier_dir("local-n2")
            .tier_dir("capacity")
            .policies(
                PolicyFiles::new().validation(VALIDATION).file(
                    "promotion.toml",
                    // A long clock: the tests show that facts, not the clock, answer waiting
                    // requests.
                    format!(
                        "default_tier = \"hot\"\nsources = [\"capacity\", \"source\"]\nlocal_sources = [\"hot\", \"capacity\"]\n\
                         max_concurrent = {}\ndefault_deadline = \"1h\"\nverify = \"read-back\"\nrecheck_every = \"1h\"\n\
                         checkpoint_datasets = [\"ckpt-*\"]\n",
                        opts.max_concurrent
                    ),
                ),
            )
            .recorder()
            .start()
            .await;
        Stack(stack)
    }

    /// The promoter's configuration for an instance named `instance` (its own state).
    pub fn promoter_config(&self, instance: &str) -> stagehand_promoter::Config {
        let mut config = stagehand_promoter::config(
            &self.url_of("promoter", "PROMOTER"),
            &self.policies,
            self.root().join("state").join(instance),
        );
        config.bus.provision = !self.accounts();
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

    /// The configuration of `node`'s agent (its own state, named by its node): connected as
    /// its node's own user (`node-<node>`, its inbox `_INBOX_node.<node>`) when the server
    /// runs the shipped accounts and [`Options::node_users`] named the node.
    pub fn node_agent_config(&self, node: &str) -> stagehand_promoter::Config {
        let mut config = self.promoter_config(&format!("agent-{node}"));
        config.service.node = Some(node.into());
        // Named by its node (`node-<node>`), as a node's user is granted.
        config.service.instance = None;
        if self.accounts() {
            use stagehand_testkit::{node_inbox_prefix, node_role, node_user};
            config.bus.servers = vec![self.url_of(&node_user(node), &node_role(node))];
            config.bus.inbox_prefix = Some(node_inbox_prefix(node));
        }
        config
    }

    /// Runs a promoter in-process until the stack stops.
    pub fn run_promoter(&mut self, config: stagehand_promoter::Config) {
        self.run(stagehand_promoter::SERVICE, |token| {
            stagehand_promoter::run(config, token)
        });
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
        let refs = put_files(&self.tier(tier).join(&prefix), files);
        (prefix, refs)
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
        let fact = validated_fact(
            PROJECT,
            EventId::for_ingest(PROJECT, dataset, &version),
            dataset,
            location(tier, prefix),
            files,
            None,
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

    pub async fn stop(self) {
        self.0.stop().await;
    }
}

fn location(tier: &str, prefix: &str) -> Location {
    Location {
        tier: tier.into(),
        prefix: prefix.into(),
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
    StageRequest::new(PROJECT, dataset, version, tier, job)
        .node(node)
        .deadline(deadline)
        .form(form)
        .event()
}

pub fn stage_release(dataset: &str, version: &str, tier: &str, job: &str) -> Event {
    StageRequest::new(PROJECT, dataset, version, tier, job).release()
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

/// Starts the real `stagehand-promoter` binary (instance `crashy`) with a configuration file
/// of its own, optionally bandwidth-limited; its log is [`log_of`] `name`.
pub fn spawn(
    stack: &Stack,
    name: &str,
    bytes_per_second: Option<u64>,
    envs: &[(&str, &str)],
) -> ServiceProcess {
    let limit = bytes_per_second
        .map(|b| format!("bytes_per_second = {b}\n"))
        .unwrap_or_default();
    let config = format!(
        "[bus]\nservers = [\"{url}\"]\n\n[worker]\nack_wait = \"3s\"\nretry = {{ initial = \"100ms\", max = \"500ms\", factor = 2.0, jitter = 0.0 }}\n\n\
         [telemetry]\nlog_level = \"info\"\n\n\
         [service]\npolicies_dir = \"{policies}\"\nstate_dir = \"{state}\"\ninstance = \"crashy\"\nprogress_every = \"200ms\"\nlease_lifetime = \"3s\"\n\n\
         [service.mover]\n{limit}",
        url = stack.nats.url(),
        policies = stack.policies.display(),
        state = stack.root().join("state/crashy").display(),
    );
    stack.spawn_process(
        name,
        env!("CARGO_BIN_EXE_stagehand-promoter"),
        &config,
        envs,
    )
}

/// The stderr of a promoter process started by [`spawn`], for a failing test's message.
pub fn log_of(stack: &Stack, name: &str) -> String {
    stack.0.log_of(name)
}
