//! Node agents as real `stagehand-promoter` processes, each in a network namespace of its own
//! ([`NodeNetwork`]) with an address of its own, on a nats-server bound to the bridge; the rest
//! of the stack (recorder, validator, shared promoter) runs in-process as
//! [`Stagehand::start_on`] runs it. Each agent has its own local tier
//! ([`Stagehand::write_node_policies`]); the shared `hot` tier is one folder every agent reads,
//! as a parallel filesystem mounted on every node would be.
//!
//! With fan-out on, each agent serves pieces on `<its address>:7700` under the agents' shared
//! token; its metrics and `/readyz` are on `<its address>:9466`. Both ports are fixed: each
//! namespace has its own port space, in which nothing else listens.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use stagehand::stage::{RequestOptions, STAGES_BUCKET, Stage};
use stagehand_catalogue::{StageState, StageStatus};
use stagehand_testkit::{NatsServer, NodeNetwork, ServiceProcess, http_get_at, scrape_sample};

use super::{Options, PROJECT, Stagehand, WAIT};

/// Where an agent's metrics and `/readyz` listen, inside its namespace.
pub const METRICS_PORT: u16 = 9466;
/// Where an agent serves pieces to its peers, inside its namespace.
pub const FANOUT_PORT: u16 = 7700;
/// How long a piece a peer claimed but has not announced waits before it is read from the
/// shared tier: short, so that a killed claimant costs a test seconds.
pub const CLAIM_PATIENCE: &str = "3s";

/// A stack with `n` nodes on a bridge, each node's agent a process in its namespace.
pub struct Fleet {
    /// Declared first: the agents die before the stack and the network go.
    agents: Vec<Option<Agent>>,
    pub sh: Stagehand,
    pub net: NodeNetwork,
    /// The agents' shared secret (mode 0600).
    token_file: PathBuf,
    fanout: bool,
}

/// One node agent process.
pub struct Agent {
    pub node: String,
    pub addr: Ipv4Addr,
    process: ServiceProcess,
}

impl Agent {
    /// `<address>:9466`: its `/metrics` and `/readyz`.
    pub fn metrics_addr(&self) -> SocketAddr {
        SocketAddr::from((self.addr, METRICS_PORT))
    }

    /// Its `/metrics` text.
    pub fn scrape(&self) -> anyhow::Result<String> {
        let (status, body) = http_get_at(self.metrics_addr(), "/metrics")
            .with_context(|| format!("scraping {}'s agent", self.node))?;
        ensure!(status == 200, "{}'s /metrics answered {status}", self.node);
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// The value of the counter `name{labels}`; zero while the agent has not counted any.
    pub fn counter(&self, name: &str, labels: &str) -> anyhow::Result<f64> {
        let scrape = self.scrape()?;
        Ok(match labels.is_empty() {
            true => scrape
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.trim().parse().ok()),
            false => scrape_sample(&scrape, name, labels),
        }
        .unwrap_or(0.0))
    }

    /// What it wrote to stderr.
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// SIGKILL: the node's agent crashes.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

impl Fleet {
    /// The stack (validator and shared promoter in-process) on a nats-server the nodes reach,
    /// and `nodes` namespaces; no agent runs yet ([`Fleet::start_agents`]). With `fanout`
    /// each agent is configured with `[service.fanout]`.
    pub async fn start(nodes: usize, fanout: bool) -> anyhow::Result<Fleet> {
        let net = NodeNetwork::new(nodes)?;
        let server = NatsServer::builder().bind(net.host_addr()).start();
        let sh = Stagehand::start_on(
            server,
            Options {
                validator: true,
                promoter: true,
                ..Default::default()
            },
        )
        .await?;
        let token_file = sh.home.path().join("fanout.token");
        std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&token_file)?
            .write_all(stagehand_testkit::unique_name("token").as_bytes())?;
        Ok(Fleet {
            agents: (0..nodes).map(|_| None).collect(),
            sh,
            net,
            token_file,
            fanout,
        })
    }

    /// The name of node `i` (a token of KV keys: no dots).
    pub fn node(i: usize) -> String {
        format!("n{i}")
    }

    /// The number of nodes.
    pub fn len(&self) -> usize {
        self.agents.len()
    }

    /// Agent `i`, when it was started.
    pub fn agent(&self, i: usize) -> &Agent {
        self.agents[i].as_ref().expect("the agent was started")
    }

    /// Agent `i`, to kill it.
    pub fn agent_mut(&mut self, i: usize) -> &mut Agent {
        self.agents[i].as_mut().expect("the agent was started")
    }

    /// The running agents.
    pub fn agents(&self) -> impl Iterator<Item = &Agent> {
        self.agents.iter().flatten()
    }

    /// Starts the agents of the nodes `which` and waits until each answers `/readyz`.
    pub async fn start_agents(
        &mut self,
        which: impl IntoIterator<Item = usize>,
    ) -> anyhow::Result<()> {
        let which: Vec<usize> = which.into_iter().collect();
        for &i in &which {
            let agent = self.spawn_agent(i)?;
            self.agents[i] = Some(agent);
        }
        for &i in &which {
            self.wait_agent_ready(i).await?;
        }
        Ok(())
    }

    /// The configuration of node `i`'s agent, as an operator writes it on that node.
    fn agent_config(&self, i: usize) -> anyhow::Result<String> {
        let node = Self::node(i);
        let addr = self.net.node(i).addr();
        let policies = self.sh.write_node_policies(&node)?;
        let state = self
            .sh
            .home
            .path()
            .join("state")
            .join(format!("agent-{node}"));
        let mut config = format!(
            "[bus]\nservers = [\"{url}\"]\nclient_name = \"promoter-{node}\"\n\n\
             [worker]\ninstance_id = \"{node}\"\n\n\
             [telemetry]\nmetrics_listen = \"{addr}:{METRICS_PORT}\"\n\n\
             [service]\npolicies_dir = \"{policies}\"\nstate_dir = \"{state}\"\nnode = \"{node}\"\n",
            url = self.sh.url,
            policies = policies.display(),
            state = state.display(),
        );
        if self.fanout {
            config.push_str(&format!(
                "\n[service.fanout]\nlisten = \"{addr}:{FANOUT_PORT}\"\ntoken_file = \"{}\"\n\
                 claim_patience = \"{CLAIM_PATIENCE}\"\n",
                self.token_file.display()
            ));
        }
        Ok(config)
    }

    fn spawn_agent(&self, i: usize) -> anyhow::Result<Agent> {
        let binary = promoter_binary()?;
        let node = Self::node(i);
        let dir = self.sh.home.path().join(format!("agent-{node}"));
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("promoter.toml");
        std::fs::write(&config, self.agent_config(i)?)?;
        let process = ServiceProcess::spawn_command(
            self.net.node(i).command(binary),
            &config,
            &dir.join("stderr.log"),
            &[("RUST_LOG", "info")],
        );
        Ok(Agent {
            node,
            addr: self.net.node(i).addr(),
            process,
        })
    }

    /// Waits until agent `i` answers `/readyz` with 200; fails at once when it exits.
    async fn wait_agent_ready(&mut self, i: usize) -> anyhow::Result<()> {
        let agent = self.agents[i].as_mut().context("the agent was started")?;
        let addr = agent.metrics_addr();
        let what = format!("{} ready", agent.node);
        let outcome = stagehand_testkit::wait_for(WAIT, &what, || {
            let exited = agent.process.child().try_wait().ok().flatten();
            let probe = tokio::task::spawn_blocking(move || http_get_at(addr, "/readyz"));
            async move {
                match (exited, probe.await) {
                    (Some(status), _) => Some(Err(status)),
                    (None, Ok(Ok((200, _)))) => Some(Ok(())),
                    _ => None,
                }
            }
        })
        .await;
        let log = || format!("{}'s agent log:\n{}", agent.node, agent.log());
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(status)) => anyhow::bail!("{} exited ({status}); {}", agent.node, log()),
            Err(timeout) => Err(timeout).with_context(log),
        }
    }

    /// Ingests `folder` as `dataset` and stages it on the shared hot tier; returns its digest.
    pub async fn ingest_to_hot(&self, folder: &Path, dataset: &str) -> anyhow::Result<String> {
        let digest = self.sh.ingest(folder, dataset, true)?;
        let stage = stage_of(dataset, &digest, "hot", None);
        request(&self.sh, &stage).await?;
        self.wait_ready(&stage).await?;
        Ok(digest)
    }

    /// Requests `dataset@digest` on node `i`'s local tier; returns the stage.
    pub async fn request_local(
        &self,
        dataset: &str,
        digest: &str,
        i: usize,
    ) -> anyhow::Result<Stage> {
        let stage = stage_of(dataset, digest, "local", Some(&Self::node(i)));
        request(&self.sh, &stage).await?;
        Ok(stage)
    }

    /// Requests the version on every node's `local` tier at once and waits until all are
    /// ready.
    pub async fn stage_everywhere(&self, dataset: &str, digest: &str) -> anyhow::Result<()> {
        let mut stages = Vec::new();
        for i in 0..self.len() {
            stages.push(self.request_local(dataset, digest, i).await?);
        }
        for stage in &stages {
            self.wait_ready(stage).await?;
        }
        Ok(())
    }

    /// Waits until `stage` is ready; fails at once when it failed.
    pub async fn wait_ready(&self, stage: &Stage) -> anyhow::Result<()> {
        let outcome = stagehand::stage::wait(&self.sh.bus, stage, WAIT).await?;
        ensure!(
            matches!(outcome, stagehand::stage::WaitOutcome::Ready(_)),
            "{} on {:?} did not become ready: {outcome:?}",
            stage.dataset,
            stage.node
        );
        Ok(())
    }

    /// Whether `stage` is ready now (the recorder's status of it).
    pub async fn is_ready(&self, stage: &Stage) -> anyhow::Result<bool> {
        let kv = self.sh.bus.jetstream().get_key_value(STAGES_BUCKET).await?;
        let Some(value) = kv.get(stage.status_key()).await? else {
            return Ok(false);
        };
        let status: StageStatus = serde_json::from_slice(&value)?;
        Ok(status.state == StageState::Ready)
    }

    /// Where node `i`'s replica of `dataset@digest` is.
    pub fn replica(&self, i: usize, dataset: &str, digest: &str) -> PathBuf {
        self.sh
            .node_local_root(&Self::node(i))
            .join(PROJECT)
            .join(dataset)
            .join(digest)
    }

    /// Fails unless node `i`'s replica holds exactly the files of `source`, byte for byte.
    pub fn assert_byte_exact(
        &self,
        i: usize,
        dataset: &str,
        digest: &str,
        source: &Path,
    ) -> anyhow::Result<()> {
        let replica = self.replica(i, dataset, digest);
        let expected = files_of(source)?;
        let found = files_of(&replica)?;
        let names = |v: &[(String, PathBuf)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        ensure!(
            names(&expected) == names(&found),
            "{}: the files differ from the source's",
            replica.display()
        );
        for ((name, want), (_, got)) in expected.iter().zip(&found) {
            ensure!(
                std::fs::read(want)? == std::fs::read(got)?,
                "{}: {name} differs from the source's",
                replica.display()
            );
        }
        Ok(())
    }

    /// The sum over the running agents of the counter `name{labels}`.
    pub fn sum_counter(&self, name: &str, labels: &str) -> anyhow::Result<f64> {
        self.agents().map(|a| a.counter(name, labels)).sum()
    }

    /// The keys of the fan-out board (`stagehand_swarms`) that start with `swarm.` and satisfy `pred`.
    pub async fn swarm_keys(&self, pred: impl Fn(&str) -> bool) -> anyhow::Result<Vec<String>> {
        use futures::TryStreamExt;
        let kv = self
            .sh
            .bus
            .jetstream()
            .get_key_value(stagehand_bus::SWARMS_BUCKET)
            .await?;
        let keys: Vec<String> = kv.keys().await?.try_collect().await?;
        Ok(keys
            .into_iter()
            .filter(|k| k.starts_with("swarm.") && pred(k))
            .collect())
    }
}

/// `swarm.<swarm>.have.<piece>.<node>`: whether `key` announces a piece `node` holds.
pub fn is_have_of(key: &str, node: &str) -> bool {
    let tokens: Vec<&str> = key.split('.').collect();
    tokens.len() >= 5 && tokens[2] == "have" && tokens.last() == Some(&node)
}

/// `swarm.<swarm>.bad.<node>.<by>`: whether `key` marks `node` as having served bad bytes.
pub fn is_bad_of(key: &str, node: &str) -> bool {
    stagehand_promoter::fanout::BadKey::parse(key).is_some_and(|k| k.node == node)
}

fn stage_of(dataset: &str, digest: &str, tier: &str, node: Option<&str>) -> Stage {
    Stage {
        project: PROJECT.into(),
        dataset: dataset.into(),
        version: digest.into(),
        tier: tier.into(),
        job: format!("job-{dataset}-{}", node.unwrap_or(tier)),
        node: node.map(str::to_owned),
    }
}

async fn request(sh: &Stagehand, stage: &Stage) -> anyhow::Result<()> {
    let options = RequestOptions {
        requested_by: "scheduler".into(),
        ..Default::default()
    };
    stagehand::stage::request(&sh.bus, stage, &options).await?;
    Ok(())
}

/// The `stagehand-promoter` binary next to the CLI's (built by `cargo build -p
/// stagehand-promoter`).
fn promoter_binary() -> anyhow::Result<PathBuf> {
    let binary = Path::new(env!("CARGO_BIN_EXE_stagehand")).with_file_name("stagehand-promoter");
    ensure!(
        binary.exists(),
        "{} is missing: cargo build -p stagehand-promoter",
        binary.display()
    );
    Ok(binary)
}

/// Every file beneath `root` as (relative path, path), sorted.
fn files_of(root: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(root).sort_by_file_name() {
        let entry = entry.with_context(|| root.display().to_string())?;
        if entry.file_type().is_file() {
            let rel = entry.path().strip_prefix(root)?.display().to_string();
            files.push((rel, entry.path().to_owned()));
        }
    }
    Ok(files)
}

/// Writes a version of `small` files of `small_size` bytes and one file per entry of `large`
/// (its size) into `root`, each of bytes no other file repeats; returns its total size.
pub fn write_version(
    root: &Path,
    small: usize,
    small_size: usize,
    large: &[usize],
) -> anyhow::Result<u64> {
    let mut total = 0u64;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut write = |rel: String, len: usize| -> anyhow::Result<()> {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().context("a file has a parent")?)?;
        let mut bytes = Vec::with_capacity(len + 8);
        while bytes.len() < len {
            // xorshift64: cheap bytes that neither compress nor repeat across pieces.
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            bytes.extend_from_slice(&seed.to_le_bytes());
        }
        bytes.truncate(len);
        std::fs::write(&path, &bytes)?;
        total += len as u64;
        Ok(())
    };
    for (i, len) in large.iter().enumerate() {
        write(format!("large/shard-{i:02}.bin"), *len)?;
    }
    for i in 0..small {
        write(format!("small/{:02}/file-{i:04}.bin", i % 16), small_size)?;
    }
    Ok(total)
}

/// Flips one byte in the middle of every file of `replica` in place (same size), as a disk
/// that rots would: returns how many files it changed.
pub fn flip_a_byte_of_each_file(replica: &Path) -> anyhow::Result<usize> {
    use std::os::unix::fs::FileExt;
    let files = files_of(replica)?;
    ensure!(!files.is_empty(), "{} holds no files", replica.display());
    for (_, path) in &files {
        // Root writes through the replica's read-only modes.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| path.display().to_string())?;
        let len = file.metadata()?.len();
        ensure!(len > 0, "{} is empty", path.display());
        let at = len / 2;
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at)?;
        file.write_all_at(&[byte[0] ^ 0xff], at)?;
    }
    Ok(files.len())
}
