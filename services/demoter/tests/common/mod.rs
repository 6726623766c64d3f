//! The demoter's test harness on the shared stack (stagehand_testkit::Stack): its tiers and
//! policies, the real catalogue recorder, replicas placed on the hot tier as the promoter
//! leaves them (a published folder and `replica.created`), stage requests and releases at
//! chosen times, and the demoter in-process or as its real binary.

#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use stagehand_catalogue::{Catalogue, ReadinessKey, ReplicaState, kv_key};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, Location, ReplicaCreated, sha256_hex,
    version_digest,
};
use stagehand_testkit::{PolicyFiles, StageRequest, TierSpec, VALIDATION, wait_until};
#[allow(unused_imports)] // each test binary uses part of this
pub use stagehand_testkit::{
    ServiceProcess, list_dir as list, pattern_bytes as bytes, stored_facts as facts,
};
use time::OffsetDateTime;

pub const WAIT: Duration = Duration::from_secs(30);
pub const PROJECT: &str = "lab-a";
pub const MIB: usize = 1 << 20;

/// The policies of a test.
pub struct Options {
    /// Capacity of the hot tier.
    pub hot_capacity: &'static str,
    pub high: f64,
    pub low: f64,
    pub idle_after: &'static str,
    pub unstaged_replica_after: &'static str,
    /// Run NATS with deploy/nats/accounts.conf: the test publishes as the operator, the
    /// recorder and the demoter connect as their own users, with their own rights only.
    pub accounts: bool,
    /// The `[checkpoints]` table of retention.toml.
    pub checkpoints: &'static str,
    /// An S3 capacity tier (endpoint, bucket) instead of the posix one.
    pub s3_capacity: Option<(String, String)>,
    /// Start the catalogue recorder with the stack (else: [`Stack::start_recorder`] later).
    pub recorder: bool,
    /// demotion.toml's `max_concurrent`: steps carried at once.
    pub max_concurrent: u32,
    /// Run NATS with accounts.conf extended to a user of each of these nodes (`node-<n>`,
    /// whose demoter connects as it: [`Stack::node_demoter_config`]).
    pub nodes: &'static [&'static str],
}

impl Default for Options {
    fn default() -> Self {
        Options {
            hot_capacity: "10 MiB",
            high: 0.85,
            low: 0.5,
            idle_after: "1d",
            unstaged_replica_after: "30d",
            accounts: false,
            s3_capacity: None,
            recorder: true,
            // Several at once, as deployed: every test runs its steps concurrently.
            max_concurrent: 4,
            nodes: &[],
            checkpoints: "keep_last = 5\nkeep_every = 0\nkeep_tagged = []\nhot_keep_last = 2\ndemote_to = \"capacity\"",
        }
    }
}

/// The shared stack with the demoter's tiers and policies; demoters are started on it.
pub struct Stack {
    kit: stagehand_testkit::Stack,
    pub catalogue: Catalogue,
}

impl Deref for Stack {
    type Target = stagehand_testkit::Stack;
    fn deref(&self) -> &Self::Target {
        &self.kit
    }
}

impl DerefMut for Stack {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.kit
    }
}

/// A version placed on the hot tier.
#[derive(Debug, Clone)]
pub struct Placed {
    pub dataset: String,
    pub version: String,
    pub files: Vec<(String, Vec<u8>)>,
}

impl Placed {
    pub fn prefix(&self) -> String {
        format!("{PROJECT}/{}/{}", self.dataset, self.version)
    }
}

impl Stack {
    pub async fn start(opts: Options) -> Stack {
        let mut builder = stagehand_testkit::Stack::builder();
        if !opts.nodes.is_empty() {
            builder = builder.shipped_accounts_with_nodes(opts.nodes);
        } else if opts.accounts {
            builder = builder.shipped_accounts();
        }
        let capacity = match &opts.s3_capacity {
            None => TierSpec::posix("capacity", "cap"),
            Some((endpoint, bucket)) => TierSpec::s3_at("capacity", "cap", endpoint, bucket),
        };
        let hot = TierSpec::posix("hot", "hot")
            .capacity(opts.hot_capacity)
            .watermarks(opts.high, opts.low);
        // Every node's local tier at one root here: a node's demoter that touched another
        // node's replica would find its folder.
        let local = TierSpec::posix("local", "nvme")
            .capacity(opts.hot_capacity)
            .watermarks(opts.high, opts.low);
        let policies = PolicyFiles::new()
            .validation(VALIDATION)
            .file(
                "demotion.toml",
                // A long clock: passes come at start and from facts, so each test knows when.
                format!(
                    "idle_after = \"{}\"\ncheck_every = \"1h\"\ntarget = \"capacity\"\nmax_concurrent = {}\n",
                    opts.idle_after, opts.max_concurrent
                ),
            )
            .file(
                "retention.toml",
                format!(
                    "[checkpoints]\n{}\n\n[expiry]\nunstaged_replica_after = \"{}\"\n",
                    opts.checkpoints, opts.unstaged_replica_after
                ),
            );
        let mut builder = builder
            .tier("source", TierSpec::posix("source", "lab"))
            .tier("capacity", capacity)
            .tier("hot", hot)
            .tier("local", local)
            .tier_dir("capacity")
            .policies(policies);
        if opts.recorder {
            builder = builder.recorder();
        }
        let kit = builder.start().await;
        let catalogue = kit.catalogue();
        Stack { kit, catalogue }
    }

    pub fn demoter_config(&self) -> stagehand_demoter::Config {
        let mut config = stagehand_demoter::config(
            &self.url_of("demoter", "DEMOTER"),
            &self.policies,
            self.root().join("state/demoter"),
        );
        config.bus.provision = !self.accounts();
        config
    }

    /// The demoter of `node` (`[service] node`), connected as its node's user with its inbox
    /// prefix, as deploy/README.md (*Adding a node*) has every node's services run.
    pub fn node_demoter_config(&self, node: &str) -> stagehand_demoter::Config {
        let mut config = stagehand_demoter::config(
            &self.url_of(
                &stagehand_testkit::node_user(node),
                &stagehand_testkit::node_role(node),
            ),
            &self.policies,
            self.root().join(format!("state/demoter-{node}")),
        );
        config.bus.provision = !self.accounts();
        config.bus.inbox_prefix = Some(stagehand_testkit::node_inbox_prefix(node));
        config.service.node = Some(node.to_owned());
        config
    }

    /// Runs the demoter in-process until the stack stops.
    pub fn run_demoter(&mut self) {
        let config = self.demoter_config();
        self.run(stagehand_demoter::SERVICE, |token| {
            stagehand_demoter::run(config, token)
        });
    }

    /// Runs the real promoter in-process until the stack stops, copying to hot from capacity
    /// and looking at waiting requests again every 200 ms.
    pub fn run_promoter(&mut self) {
        std::fs::write(
            self.policies.join("promotion.toml"),
            "default_tier = \"hot\"\nsources = [\"capacity\", \"source\"]\n\
             max_concurrent = 2\ndefault_deadline = \"1h\"\nverify = \"read-back\"\n\
             recheck_every = \"200ms\"\n",
        )
        .unwrap();
        let mut config = stagehand_promoter::config(
            &self.url_of("promoter", "PROMOTER"),
            &self.policies,
            self.root().join("state/promoter"),
        );
        config.bus.provision = !self.accounts();
        config.service.instance = Some("p1".into());
        self.run(stagehand_promoter::SERVICE, |token| {
            stagehand_promoter::run(config, token)
        });
    }

    /// Places a version of `dataset` on the hot tier as the promoter leaves one, with `n`
    /// files of `size` bytes. `durable`: the version was validated on the capacity tier (a
    /// verified copy is there); else it was validated on the source tier, whose copy is then
    /// deleted, so the only verified copy left is the hot one.
    pub async fn place(
        &self,
        dataset: &str,
        seed: u8,
        n: usize,
        size: usize,
        durable: bool,
    ) -> Placed {
        self.place_on("hot", None, dataset, seed, n, size, durable)
            .await
    }

    /// [`Stack::place`] on `tier`, for `node` on a node-local tier (its `replica.created`
    /// carries the node).
    #[allow(clippy::too_many_arguments)]
    pub async fn place_on(
        &self,
        tier: &str,
        node: Option<&str>,
        dataset: &str,
        seed: u8,
        n: usize,
        size: usize,
        durable: bool,
    ) -> Placed {
        self.place_on_at(tier, node, dataset, (seed, n, size), durable, None)
            .await
    }

    /// A version on the capacity tier (validated there) and on hot, both copies made (their
    /// facts dated) `made_at`: what a scrub finds due once its tiers' period has passed.
    pub async fn place_made(
        &self,
        dataset: &str,
        (seed, n, size): (u8, usize, usize),
        made_at: OffsetDateTime,
    ) -> Placed {
        self.place_on_at("hot", None, dataset, (seed, n, size), true, Some(made_at))
            .await
    }

    /// [`Stack::place_on`], its facts dated `made_at` when given (else now).
    async fn place_on_at(
        &self,
        tier: &str,
        node: Option<&str>,
        dataset: &str,
        (seed, n, size): (u8, usize, usize),
        durable: bool,
        made_at: Option<OffsetDateTime>,
    ) -> Placed {
        let files: Vec<(String, Vec<u8>)> = (0..n)
            .map(|i| {
                (
                    format!("part-{i:02}.bin"),
                    bytes(seed.wrapping_add(i as u8), size),
                )
            })
            .collect();
        let refs: Vec<FileRef> = files
            .iter()
            .map(|(p, b)| FileRef::new(p.as_str(), b.len() as u64, sha256_hex(b)))
            .collect();
        let version = version_digest(&refs);
        let prefix = format!("{PROJECT}/{dataset}/{version}");
        let source_tier = if durable { "capacity" } else { "source" };
        for t in [source_tier, tier] {
            for (p, b) in &files {
                let path = self.tier(t).join(&prefix).join(p);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, b).unwrap();
            }
        }
        let total: u64 = refs.iter().map(|f| f.size).sum();
        let ingest = EventId::for_ingest(PROJECT, dataset, &version);
        let validated = Event::request(
            EventId::derive(&ingest, "validated"),
            PROJECT,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.into(),
                version: version.clone(),
                source: Location {
                    tier: source_tier.into(),
                    prefix: prefix.clone(),
                },
                files: refs.clone(),
                manifest: None,
                total_bytes: total,
                requested_by: "test".into(),
                request_id: ingest.clone(),
                labels: vec![],
            }),
        );
        let mut validated = validated;
        if let Some(at) = made_at {
            validated.occurred_at = at;
        }
        self.publish(&validated).await;
        if !durable {
            std::fs::remove_dir_all(self.tier("source").join(&prefix)).unwrap();
        }
        let created = Event::request(
            EventId::derive(
                &ingest,
                &match node {
                    None => format!("replica:{tier}"),
                    Some(node) => format!("replica:{tier}:{node}"),
                },
            ),
            PROJECT,
            Body::ReplicaCreated(ReplicaCreated {
                dataset: dataset.into(),
                version: version.clone(),
                location: Location {
                    tier: tier.into(),
                    prefix: prefix.clone(),
                },
                files: n as u64,
                total_bytes: total,
                verified_by: "read-back".into(),
                node: node.map(str::to_owned),
            }),
        );
        let mut created = created;
        if let Some(at) = made_at {
            created.occurred_at = at;
        }
        self.publish(&created).await;
        Placed {
            dataset: dataset.into(),
            version,
            files,
        }
    }

    /// A training run's checkpoint at `step`: `n` files written under
    /// `<project>/ckpt/<run>/step-<step>` on the hot tier, then `checkpoint.committed` (its
    /// files inline) with `tags`.
    pub async fn commit_checkpoint(&self, run: &str, step: u64, tags: &[&str]) -> Placed {
        self.commit_checkpoint_as(run, step, tags, false).await
    }

    /// [`Stack::commit_checkpoint`], its file list by reference in the project's upload bucket
    /// (as `stagehand checkpoint commit` sends a large one) when `by_reference`.
    pub async fn commit_checkpoint_as(
        &self,
        run: &str,
        step: u64,
        tags: &[&str],
        by_reference: bool,
    ) -> Placed {
        let prefix = format!("{PROJECT}/ckpt/{run}/step-{step}");
        self.commit_checkpoint_at(run, step, tags, by_reference, &prefix)
            .await
    }

    /// [`Stack::commit_checkpoint_as`] with its files written at `prefix` on the hot tier
    /// (a step saved inside another's folder, say).
    pub async fn commit_checkpoint_at(
        &self,
        run: &str,
        step: u64,
        tags: &[&str],
        by_reference: bool,
        prefix: &str,
    ) -> Placed {
        let prefix = prefix.to_owned();
        let files: Vec<(String, Vec<u8>)> = (0..3)
            .map(|i| {
                (
                    format!("shard-{i}.distcp"),
                    bytes(step as u8 ^ i, 8192 + i as usize),
                )
            })
            .collect();
        let refs: Vec<FileRef> = files
            .iter()
            .map(|(p, b)| FileRef::new(p.as_str(), b.len() as u64, sha256_hex(b)))
            .collect();
        for (p, b) in &files {
            let path = self.tier("hot").join(&prefix).join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b).unwrap();
        }
        let total_bytes = refs.iter().map(|f| f.size).sum();
        let (refs, manifest) = if by_reference {
            let store = stagehand_manifest::ManifestStore::uploads(
                self.bus.jetstream(),
                PROJECT,
                stagehand_manifest::BucketOptions::default(),
            )
            .await
            .unwrap();
            let reference = store
                .put(&stagehand_manifest::Manifest::from_entries(refs))
                .await
                .unwrap();
            (Vec::new(), Some(reference))
        } else {
            (refs, None)
        };
        let e = Event::request(
            EventId::for_checkpoint(PROJECT, run, step),
            PROJECT,
            Body::CheckpointCommitted(stagehand_schemas::CheckpointCommitted {
                run: run.into(),
                step,
                location: Location {
                    tier: "hot".into(),
                    prefix: prefix.clone(),
                },
                total_bytes,
                files: refs,
                manifest,
                tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            }),
        );
        self.publish(&e).await;
        Placed {
            dataset: format!("ckpt/{run}"),
            version: format!("step-{step}"),
            files,
        }
    }

    /// Job `job` asks for `p` on the hot tier at `at`.
    pub async fn stage(&self, p: &Placed, job: &str, at: OffsetDateTime) {
        self.stage_until(p, job, at, None).await;
    }

    /// Job `job` asks for `p` on the hot tier at `at`, its hold ending at `hold_until`.
    pub async fn stage_until(
        &self,
        p: &Placed,
        job: &str,
        at: OffsetDateTime,
        hold_until: Option<OffsetDateTime>,
    ) {
        self.stage_as(p, job, "hot", None, at, hold_until).await;
    }

    /// Job `job` asks for `p` on `tier` (of `node`, a node-local tier) at `at`.
    pub async fn stage_on(
        &self,
        p: &Placed,
        job: &str,
        tier: &str,
        node: Option<&str>,
        at: OffsetDateTime,
    ) {
        self.stage_as(p, job, tier, node, at, None).await;
    }

    /// Job `job` asks for `p` on `tier` (of `node`) at `at`, its hold ending at `hold_until`.
    async fn stage_as(
        &self,
        p: &Placed,
        job: &str,
        tier: &str,
        node: Option<&str>,
        at: OffsetDateTime,
        hold_until: Option<OffsetDateTime>,
    ) {
        let request = StageRequest::new(PROJECT, &p.dataset, &p.version, tier, job)
            .node(node)
            .hold_until(hold_until)
            .at(at);
        self.publish(&request.event()).await;
    }

    /// Job `job` releases `p` on the hot tier at `at`.
    pub async fn release(&self, p: &Placed, job: &str, at: OffsetDateTime) {
        self.release_on(p, job, "hot", None, at).await
    }

    /// Job `job` releases `p` on `tier` (of `node`, a node-local tier) at `at`.
    pub async fn release_on(
        &self,
        p: &Placed,
        job: &str,
        tier: &str,
        node: Option<&str>,
        at: OffsetDateTime,
    ) {
        let request = StageRequest::new(PROJECT, &p.dataset, &p.version, tier, job)
            .node(node)
            .at(at);
        self.publish(&request.release()).await;
    }

    /// Waits until the catalogue lists `p`'s hot replica as present and `requests` stage
    /// requests of it, `released` of them released (what the demoter's first pass must see).
    pub async fn recorded(&self, p: &Placed, requests: usize, released: usize) {
        wait_until(WAIT, "the recorder to fold the placement", || async {
            let Ok(v) = self
                .catalogue
                .version(Some(PROJECT), &p.dataset, &p.version)
                .await
            else {
                return false;
            };
            let hot = v
                .replicas
                .iter()
                .any(|r| r.tier == "hot" && r.state == ReplicaState::Present);
            let Ok(stages) = self
                .catalogue
                .stage_requests(PROJECT, None, Some(&p.dataset), Some(&p.version), None)
                .await
            else {
                return false;
            };
            let gone = stages
                .items
                .iter()
                .filter(|s| s.state == stagehand_catalogue::StageState::Released)
                .count();
            hot && stages.items.len() == requests && gone == released
        })
        .await
        .unwrap();
    }

    /// Waits until the catalogue lists `requests` stage requests of `p`, `released` of them
    /// released (its replica may be gone meanwhile).
    pub async fn recorded_requests(&self, p: &Placed, requests: usize, released: usize) {
        wait_until(WAIT, "the recorder to fold the stage requests", || async {
            let Ok(stages) = self
                .catalogue
                .stage_requests(PROJECT, None, Some(&p.dataset), Some(&p.version), None)
                .await
            else {
                return false;
            };
            let gone = stages
                .items
                .iter()
                .filter(|s| s.state == stagehand_catalogue::StageState::Released)
                .count();
            stages.items.len() == requests && gone == released
        })
        .await
        .unwrap();
    }

    pub async fn readiness(&self) -> kv::Store {
        self.bus
            .jetstream()
            .get_key_value("stagehand_readiness")
            .await
            .unwrap()
    }

    pub async fn stop(self) {
        self.kit.stop().await;
    }
}

/// The readiness key of `p` on the hot tier.
pub fn hot_key(p: &Placed) -> String {
    key_on(p, "hot", None)
}

/// The readiness key of `p` on `tier` (of `node`, a node-local tier).
pub fn key_on(p: &Placed, tier: &str, node: Option<&str>) -> String {
    kv_key(&ReadinessKey {
        project: PROJECT.into(),
        dataset: p.dataset.clone(),
        version: p.version.clone(),
        tier: tier.into(),
        node: node.map(str::to_owned),
    })
}

/// Whether the readiness bucket says `key` is ready.
pub async fn is_ready(bucket: &kv::Store, key: &str) -> bool {
    match bucket.get(key).await.unwrap() {
        Some(v) => serde_json::from_slice::<serde_json::Value>(&v).unwrap()["ready"] == true,
        None => false,
    }
}

/// The replica facts (`replica.created` and `replica.removed`) in stream order, each as
/// (kind, tier, version, reason).
pub async fn replica_facts(js: &jetstream::Context) -> Vec<(String, String, String, String)> {
    facts(js, "replica.*")
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            Body::ReplicaCreated(c) => {
                Some(("created".into(), c.location.tier, c.version, String::new()))
            }
            Body::ReplicaRemoved(r) => {
                Some(("removed".into(), r.location.tier, r.version, r.reason))
            }
            _ => None,
        })
        .collect()
}

/// The versions removed from the hot tier, in the order of their `replica.removed`.
pub async fn removed_from_hot(js: &jetstream::Context) -> Vec<String> {
    replica_facts(js)
        .await
        .into_iter()
        .filter(|(k, t, _, _)| k == "removed" && t == "hot")
        .map(|(_, _, v, _)| v)
        .collect()
}

/// Whether every file of `p` is under `prefix` on `tier` with its bytes.
pub fn whole_on(stack: &Stack, tier: &str, p: &Placed) -> bool {
    let dir = stack.tier(tier).join(p.prefix());
    let names: Vec<String> = p.files.iter().map(|(n, _)| n.clone()).collect();
    list(&dir) == names
        && p.files
            .iter()
            .all(|(n, b)| std::fs::read(dir.join(n)).is_ok_and(|got| &got == b))
}

/// `minutes` before now.
pub fn ago(minutes: i64) -> OffsetDateTime {
    OffsetDateTime::now_utc() - time::Duration::minutes(minutes)
}

/// Starts the real `stagehand-demoter` binary with a configuration file of its own, its
/// stderr in `proc-<name>/stderr.log`.
pub fn spawn(stack: &Stack, name: &str, envs: &[(&str, &str)]) -> ServiceProcess {
    let config = format!(
        "[bus]\nservers = [\"{url}\"]\n\n[telemetry]\nlog_level = \"info\"\n\n\
         [service]\npolicies_dir = \"{policies}\"\nstate_dir = \"{state}\"\n",
        url = stack.nats.url(),
        policies = stack.policies.display(),
        state = stack.root().join("state/demoter").display(),
    );
    stack.spawn_process(name, env!("CARGO_BIN_EXE_stagehand-demoter"), &config, envs)
}

/// The stderr of a demoter process started by [`spawn`].
pub fn log_of(stack: &Stack, name: &str) -> String {
    stack.kit.log_of(name)
}
