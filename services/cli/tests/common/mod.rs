//! What the scheduler tests share: a real nats-server with Stagehand's services running
//! in-process under the service runner, as `stagehand up` runs them — the catalogue recorder
//! (which keeps `stagehand_stages`), the shared promoter, optionally the promoter agent of
//! this node, and the ingest validator, which a test may start late (so that a job can be
//! submitted before its dataset is validated). Datasets are ingested with the real
//! `stagehand ingest`; tiers live under a home the test jobs' user can read.

#![allow(dead_code)] // each test binary uses part of this

pub mod attacks;
pub mod fanout;
pub mod shipped;
pub mod slurm;
pub mod tenants;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand::stage::{STAGES_BUCKET, Stage, StageStatus};
use stagehand_bus::runner::{self, ServiceConfig, ServiceSettings, WorkerSettings};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_schemas::{Event, EventId, FileRef, sha256_hex, version_digest};
use stagehand_testkit::{NatsServer, wait_for};
use tokio::task::JoinHandle;

/// Bound on anything the services or a scheduler should do in a test.
pub const WAIT: Duration = Duration::from_secs(60);

pub const PROJECT: &str = "lab";

/// A nats-server and Stagehand's services on it, under a home of their own.
pub struct Stagehand {
    pub server: NatsServer,
    pub url: String,
    pub bus: Bus,
    pub home: tempfile::TempDir,
    pub policies: PathBuf,
    bus_config: BusConfig,
    stop: CancellationToken,
    /// The recorder's own stop, a child of `stop`, so that a test can stop it alone.
    recorder_stop: CancellationToken,
    tasks: Vec<Running>,
}

/// One in-process service: its task, and the address of its `/readyz` probe.
struct Running {
    name: &'static str,
    task: JoinHandle<anyhow::Result<()>>,
    probe: SocketAddr,
    /// The node of a node agent started with [`Stagehand::start_node_agent`].
    node: Option<String>,
    /// What stops it.
    stop: CancellationToken,
}

/// What to run besides the catalogue recorder.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Start the ingest validator now (else [`Stagehand::start_validator`] later).
    pub validator: bool,
    /// Run the shared promoter (without it, stage requests stay waiting for the promoter).
    pub promoter: bool,
    /// Run the promoter agent of this node (the `local` tier).
    pub node_agent: Option<String>,
    /// Lines replacing `[tiers.local.quotas]` of the default tiers.toml.
    pub local_quota: Option<String>,
    /// The hot tier's capacity (and its projects' default quota) instead of the default's, e.g.
    /// `"64 KiB"`: a tier small enough for a test's datasets to fill.
    pub hot_capacity: Option<String>,
    /// A line added to `[tiers.hot.quotas]` (after `hot_capacity`'s default), e.g.
    /// `lab = "16 KiB"`: one project's own quota on hot.
    pub hot_quota: Option<String>,
    /// The URL the services and the test's own clients use: a user of the server's accounts
    /// (default the server's URL, for a server without users).
    pub nats_url: Option<String>,
    /// The CA of a server that requires TLS, trusted by the services and the test's clients.
    pub tls_ca: Option<PathBuf>,
    /// Each project's group (its jobs run with it), declared in tiers.toml's `[groups]`:
    /// staged data is readable by that group only.
    pub job_groups: Vec<(String, String)>,
    /// promotion.toml's `max_concurrent` instead of the default's: copy slots per promoter.
    pub copy_slots: Option<u32>,
    /// The shared promoter's copy rate, bytes a second (default unthrottled).
    pub copy_bytes_per_second: Option<u64>,
    /// Node agents, each with a local tier of its own (`tiers/local-<node>`, in policies of
    /// its own: two nodes' NVMe are two disks), started and stopped one by one
    /// ([`Stagehand::start_node_agent`], [`Stagehand::stop_node_agent`]).
    pub node_agents: Vec<String>,
    /// Run the shared demoter (it also watches node agents' liveness).
    pub demoter: bool,
    /// promotion.toml's `agent_silent_after` instead of the default's.
    pub agent_silent_after: Option<String>,
}

fn spawn<S, F, Fut, T, E>(
    bus: &BusConfig,
    name: &'static str,
    settings: S,
    serve: F,
    stop: CancellationToken,
) -> Running
where
    S: ServiceSettings + Send + 'static,
    F: FnOnce(runner::Context<S>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    T: Send + 'static,
{
    spawn_with(bus, name, settings, WorkerSettings::default(), serve, stop)
}

/// [`spawn`] with the runtime's tunables (`[worker]`) given.
fn spawn_with<S, F, Fut, T, E>(
    bus: &BusConfig,
    name: &'static str,
    settings: S,
    worker: WorkerSettings,
    serve: F,
    stop: CancellationToken,
) -> Running
where
    S: ServiceSettings + Send + 'static,
    F: FnOnce(runner::Context<S>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    T: Send + 'static,
{
    let mut bus = bus.clone();
    bus.client_name = name.to_owned();
    let mut config = ServiceConfig::new(bus, settings);
    config.worker = worker;
    // The probe the stack waits on before a test acts (`Stagehand::ready`), as a supervisor
    // would: a free port, closed again for the service to bind.
    let probe = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port");
    config.telemetry.metrics_listen = Some(probe);
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            runner::run(name, config, stop, serve)
                .await
                .map(|_| ())
                .with_context(|| name.to_owned())
        }
    });
    Running {
        name,
        task,
        probe,
        node: None,
        stop,
    }
}

impl Stagehand {
    pub async fn start(opts: Options) -> anyhow::Result<Stagehand> {
        Stagehand::start_on(NatsServer::start(), opts).await
    }

    /// The services on a nats-server the caller started (so that it can start something else
    /// that needs the server's address, such as a Slurm cluster, meanwhile).
    pub async fn start_on(server: NatsServer, opts: Options) -> anyhow::Result<Stagehand> {
        let url = opts.nats_url.clone().unwrap_or_else(|| server.url());
        let home = tempfile::Builder::new()
            .prefix("stagehand-home-")
            .tempdir()?;
        // Jobs run as an ordinary user and read the hot and local tiers beneath the home.
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755))?;
        let policies = home.path().join("policies");
        stagehand::up::write_default_policies(&policies, home.path())?;
        if let Some(quota) = &opts.local_quota {
            let tiers = policies.join("tiers.toml");
            let text = std::fs::read_to_string(&tiers)?;
            let text = match text.find("[tiers.local.quotas]") {
                Some(at) => {
                    let rest = &text[at..];
                    let end = rest[1..]
                        .find("\n[")
                        .map(|i| at + 1 + i)
                        .unwrap_or(text.len());
                    format!(
                        "{}[tiers.local.quotas]\n{quota}\n{}",
                        &text[..at],
                        &text[end..]
                    )
                }
                None => format!("{text}\n[tiers.local.quotas]\n{quota}\n"),
            };
            std::fs::write(&tiers, text)?;
        }
        if let Some(capacity) = &opts.hot_capacity {
            let tiers = policies.join("tiers.toml");
            let text = std::fs::read_to_string(&tiers)?;
            let mut section = String::new();
            let text: Vec<String> = text
                .lines()
                .map(|l| {
                    if l.starts_with('[') {
                        section = l.to_owned();
                    }
                    let hot = section == "[tiers.hot]" || section == "[tiers.hot.quotas]";
                    match hot && (l.starts_with("capacity =") || l.starts_with("default =")) {
                        true => format!("{} = \"{capacity}\"", l.split(" =").next().unwrap_or(l)),
                        false => l.to_owned(),
                    }
                })
                .collect();
            std::fs::write(&tiers, text.join("\n") + "\n")?;
        }
        if let Some(quota) = &opts.hot_quota {
            let tiers = policies.join("tiers.toml");
            let text = std::fs::read_to_string(&tiers)?;
            let header = "[tiers.hot.quotas]\n";
            anyhow::ensure!(text.contains(header), "tiers.toml has no {header:?}");
            std::fs::write(
                &tiers,
                text.replacen(header, &format!("{header}{quota}\n"), 1),
            )?;
        }
        if let Some(slots) = opts.copy_slots {
            let promotion = policies.join("promotion.toml");
            let text = std::fs::read_to_string(&promotion)?;
            let text: Vec<String> = text
                .lines()
                .map(|l| match l.starts_with("max_concurrent") {
                    true => format!("max_concurrent = {slots}"),
                    false => l.to_owned(),
                })
                .collect();
            std::fs::write(&promotion, text.join("\n") + "\n")?;
        }
        if let Some(after) = &opts.agent_silent_after {
            let promotion = policies.join("promotion.toml");
            let text = std::fs::read_to_string(&promotion)?;
            let text: Vec<String> = text
                .lines()
                .map(|l| match l.starts_with("agent_silent_after") {
                    true => format!("agent_silent_after = \"{after}\""),
                    false => l.to_owned(),
                })
                .collect();
            std::fs::write(&promotion, text.join("\n") + "\n")?;
        }
        if !opts.job_groups.is_empty() {
            let tiers = policies.join("tiers.toml");
            let mut text = std::fs::read_to_string(&tiers)?;
            text.push_str("\n[groups]\n");
            for (project, group) in &opts.job_groups {
                text.push_str(&format!("{project} = \"{group}\"\n"));
            }
            std::fs::write(&tiers, text)?;
        }
        for tier in ["source", "capacity", "hot", "local", "backup"] {
            let dir = home.path().join("tiers").join(tier);
            std::fs::create_dir_all(&dir)?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        }
        std::fs::set_permissions(
            home.path().join("tiers"),
            std::fs::Permissions::from_mode(0o755),
        )?;
        let bus_config = BusConfig {
            tls_ca: opts.tls_ca.clone(),
            ..BusConfig::new(&url)
        };
        let bus = Bus::connect(&bus_config).await?;
        bus.provision().await?;
        let stop = CancellationToken::new();
        let mut me = Stagehand {
            server,
            url,
            bus,
            policies: policies.clone(),
            home,
            bus_config,
            recorder_stop: stop.child_token(),
            stop,
            tasks: Vec::new(),
        };
        let home = me.home.path().to_owned();
        me.start_recorder();
        if opts.promoter {
            let mut settings = stagehand_promoter::Settings::dev(&home, &policies);
            settings.mover.bytes_per_second = opts.copy_bytes_per_second;
            me.tasks.push(spawn(
                &me.bus_config,
                stagehand_promoter::SERVICE,
                settings,
                stagehand_promoter::serve,
                me.stop.child_token(),
            ));
        }
        if let Some(node) = &opts.node_agent {
            let mut settings = stagehand_promoter::Settings::dev(&home, &policies);
            settings.node = Some(node.clone());
            settings.state_dir = home.join("state").join(format!("promoter-{node}"));
            me.tasks.push(spawn(
                &me.bus_config,
                stagehand_promoter::SERVICE,
                settings,
                stagehand_promoter::serve,
                me.stop.child_token(),
            ));
        }
        for node in &opts.node_agents {
            me.start_node_agent(node)?;
        }
        if opts.demoter {
            me.tasks.push(spawn(
                &me.bus_config,
                stagehand_demoter::SERVICE,
                stagehand_demoter::Settings::dev(&home, &policies),
                stagehand_demoter::serve,
                me.stop.child_token(),
            ));
        }
        if opts.validator {
            me.start_validator();
        }
        me.ready().await?;
        Ok(me)
    }

    /// The policies of `node`'s agent: the stack's, its local tier at `tiers/local-<node>`.
    pub fn node_policies(&self, node: &str) -> PathBuf {
        self.home.path().join(format!("policies-{node}"))
    }

    /// The root of `node`'s local tier.
    pub fn node_local_root(&self, node: &str) -> PathBuf {
        self.home.path().join("tiers").join(format!("local-{node}"))
    }

    /// Starts the agent of `node` (again, after [`Stagehand::stop_node_agent`]: same state,
    /// same tier), on its own local tier (`<home>/tiers/local-<node>`, as each node has its
    /// own NVMe); returns the node's policy folder (the stack's, its `local` root changed),
    /// for the node's own `stagehand` commands.
    pub fn start_node_agent(&mut self, node: &str) -> anyhow::Result<PathBuf> {
        self.start_node_agent_with(node, |_| {})
    }

    /// [`Stagehand::start_node_agent`] with its settings changed by `tune` (fan-out on, say).
    pub fn start_node_agent_with(
        &mut self,
        node: &str,
        tune: impl FnOnce(&mut stagehand_promoter::Settings),
    ) -> anyhow::Result<PathBuf> {
        let home = self.home.path().to_owned();
        let policies = self.write_node_policies(node)?;
        let mut settings = stagehand_promoter::Settings::dev(&home, &policies);
        settings.node = Some(node.to_owned());
        settings.state_dir = home.join("state").join(format!("promoter-{node}"));
        tune(&mut settings);
        let mut running = spawn(
            &self.bus_config,
            stagehand_promoter::SERVICE,
            settings,
            stagehand_promoter::serve,
            self.stop.child_token(),
        );
        running.node = Some(node.to_owned());
        self.tasks.push(running);
        Ok(policies)
    }

    /// The policy folder of `node`'s agent (the stack's, its `local` root at
    /// `<home>/tiers/local-<node>`), written with that root the first time.
    pub fn write_node_policies(&self, node: &str) -> anyhow::Result<PathBuf> {
        let home = self.home.path();
        let policies = self.node_policies(node);
        let root = self.node_local_root(node);
        if !policies.exists() {
            std::fs::create_dir_all(&policies)?;
            for entry in std::fs::read_dir(&self.policies)? {
                let path = entry?.path();
                let text = std::fs::read_to_string(&path)?;
                let text = text.replace(
                    &format!("{}\"", home.join("tiers/local").display()),
                    &format!("{}\"", root.display()),
                );
                std::fs::write(policies.join(path.file_name().context("a file")?), text)?;
            }
            std::fs::create_dir_all(&root)?;
            std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(policies)
    }

    /// Stops the agent of `node` as its supervisor would, and waits until it has.
    pub async fn stop_node_agent(&mut self, node: &str) -> anyhow::Result<()> {
        let at = self
            .tasks
            .iter()
            .position(|r| r.node.as_deref() == Some(node))
            .with_context(|| format!("no agent of {node} runs"))?;
        let running = self.tasks.remove(at);
        running.stop.cancel();
        running.task.await??;
        Ok(())
    }

    /// Waits until every service of the stack answers its `/readyz` probe with 200 (connected,
    /// and each of its workers consumes), as a supervisor's readiness check would: a test that
    /// takes NATS away must not do so while a service still makes its consumers.
    pub async fn ready(&self) -> anyhow::Result<()> {
        for r in &self.tasks {
            let port = r.probe.port();
            let last = std::sync::Mutex::new(String::new());
            let last_ref = &last;
            let answered =
                stagehand_testkit::wait_until(WAIT, &format!("{} ready", r.name), || async move {
                    let probe = tokio::task::spawn_blocking(move || {
                        stagehand_testkit::http_get(port, "/readyz")
                    });
                    let why = match probe.await {
                        Ok(Ok((200, _))) => return true,
                        Ok(Ok((_, body))) => String::from_utf8_lossy(&body).trim().to_owned(),
                        Ok(Err(e)) => e.to_string(),
                        Err(e) => e.to_string(),
                    };
                    *last_ref
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = why;
                    false
                })
                .await;
            if let Err(e) = answered {
                let last = last
                    .into_inner()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                anyhow::bail!("{e}: /readyz on {} last said {last:?}", r.probe);
            }
        }
        Ok(())
    }

    /// Starts the ingest validator (requests published before wait for it).
    pub fn start_validator(&mut self) {
        let home = self.home.path().to_owned();
        self.tasks.push(spawn(
            &self.bus_config,
            stagehand_ingest_validator::SERVICE,
            stagehand_ingest_validator::Settings::dev(&home, &self.policies),
            stagehand_ingest_validator::serve,
            self.stop.child_token(),
        ));
    }

    /// Stops the catalogue recorder as its supervisor would (it drains and writes its stop into
    /// its heartbeat), and waits until it has; [`Stagehand::start_recorder`] starts it again.
    pub async fn stop_recorder(&mut self) -> anyhow::Result<()> {
        self.recorder_stop.cancel();
        let at = self
            .tasks
            .iter()
            .position(|r| r.name == stagehand_catalogue_recorder::SERVICE)
            .context("no recorder runs")?;
        self.tasks.remove(at).task.await??;
        Ok(())
    }

    /// Stops every running instance of `service` (its name, e.g. `ingest-validator`) as its
    /// supervisor would (it drains and writes its stop into its heartbeat), and waits until each
    /// has; its `start_*` method starts it again, on the same state.
    pub async fn stop_service(&mut self, service: &str) -> anyhow::Result<()> {
        let (stopping, running): (Vec<Running>, Vec<Running>) = std::mem::take(&mut self.tasks)
            .into_iter()
            .partition(|r| r.name == service);
        self.tasks = running;
        ensure!(!stopping.is_empty(), "no {service} runs");
        for r in stopping {
            r.stop.cancel();
            r.task.await??;
        }
        Ok(())
    }

    /// Starts the catalogue recorder again on its store under the home.
    pub fn start_recorder(&mut self) {
        self.recorder_stop = self.stop.child_token();
        let home = self.home.path().to_owned();
        self.tasks.push(spawn(
            &self.bus_config,
            stagehand_catalogue_recorder::SERVICE,
            stagehand_catalogue_recorder::Settings::dev(&home, &self.policies),
            stagehand_catalogue_recorder::serve,
            self.recorder_stop.clone(),
        ));
    }

    /// Starts the shared promoter (a stack started without it).
    pub fn start_promoter(&mut self) {
        let home = self.home.path().to_owned();
        self.tasks.push(spawn(
            &self.bus_config,
            stagehand_promoter::SERVICE,
            stagehand_promoter::Settings::dev(&home, &self.policies),
            stagehand_promoter::serve,
            self.stop.child_token(),
        ));
    }

    /// Starts the backup copier: every version validated from then on, and those before,
    /// is copied onto the backup tier as `backup.toml` says.
    pub fn start_backup_copier(&mut self) {
        self.start_backup_copier_with(|_| {});
    }

    /// [`Stagehand::start_backup_copier`] with its settings changed by `tune` (a test that
    /// holds its drill clock back sets a long `drill_check`).
    pub fn start_backup_copier_with(
        &mut self,
        tune: impl FnOnce(&mut stagehand_backup_copier::Settings),
    ) {
        let home = self.home.path().to_owned();
        let mut settings = stagehand_backup_copier::Settings::dev(&home, &self.policies);
        tune(&mut settings);
        self.tasks.push(spawn(
            &self.bus_config,
            stagehand_backup_copier::SERVICE,
            settings,
            stagehand_backup_copier::serve,
            self.stop.child_token(),
        ));
    }

    /// Starts the ingest validator with the runtime's tunables `worker` (a test that needs it
    /// to give up on a request after fewer, quicker attempts than in production).
    pub fn start_validator_with(&mut self, worker: WorkerSettings) {
        let home = self.home.path().to_owned();
        self.tasks.push(spawn_with(
            &self.bus_config,
            stagehand_ingest_validator::SERVICE,
            stagehand_ingest_validator::Settings::dev(&home, &self.policies),
            worker,
            stagehand_ingest_validator::serve,
            self.stop.child_token(),
        ));
    }

    /// Runs the real `stagehand ingest` of `folder` as `dataset` (with `--wait` when
    /// `wait`); returns the version digest of the folder's files.
    pub fn ingest(&self, folder: &Path, dataset: &str, wait: bool) -> anyhow::Result<String> {
        self.ingest_to(PROJECT, folder, dataset, wait)
    }

    /// [`Stagehand::ingest`] into `project`.
    pub fn ingest_to(
        &self,
        project: &str,
        folder: &Path,
        dataset: &str,
        wait: bool,
    ) -> anyhow::Result<String> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
        cmd.args(["--nats", &self.url]);
        if let Some(ca) = &self.bus_config.tls_ca {
            cmd.arg("--tls-ca").arg(ca);
        }
        cmd.arg("ingest")
            .arg(folder)
            .args(["--project", project, "--dataset", dataset, "--json"])
            .arg("--policies")
            .arg(&self.policies)
            .env("STAGEHAND_HOME", self.home.path());
        if wait {
            cmd.args(["--wait", "--timeout", "60"]);
        }
        let out = cmd.output()?;
        ensure!(
            out.status.success(),
            "stagehand ingest: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        digest_of(folder)
    }

    /// Waits until the stage's request is in the requests stream (on its project's subject,
    /// or its node's); returns it.
    pub async fn requested(&self, stage: &Stage) -> anyhow::Result<Event> {
        let subject = stagehand_schemas::subject::kind_filter("req", "stage.requested");
        self.find(&subject, &stage.request_id()).await
    }

    /// Waits until the stage's release is in the requests stream; returns it.
    pub async fn released(&self, stage: &Stage) -> anyhow::Result<Event> {
        let subject = stagehand_schemas::subject::kind_filter("req", "stage.released");
        self.find(&subject, &stage.release_id()).await
    }

    async fn scan(&self, subject: &str, id: &EventId) -> anyhow::Result<Option<Event>> {
        let events =
            stagehand_testkit::stored_events(self.bus.jetstream(), "STAGEHAND_REQUESTS", subject)
                .await
                .map_err(|e| anyhow::anyhow!("reading the requests: {e}"))?;
        Ok(events.into_iter().find(|event| event.id == *id))
    }

    async fn find(&self, subject: &str, id: &EventId) -> anyhow::Result<Event> {
        wait_for(WAIT, &format!("event {id} on {subject}"), || async {
            self.scan(subject, id).await.ok().flatten()
        })
        .await
        .map_err(Into::into)
    }

    /// What the stack knows of `stage`, for a failing test's message: whether its request is
    /// stored, its `stagehand_stages` entry as written, and which services have stopped, with
    /// the error each stopped on (those are taken out of the stack).
    pub async fn explain(&mut self, stage: &Stage) -> String {
        let subject = stagehand_schemas::subject::kind_filter("req", "stage.requested");
        let request = match self.scan(&subject, &stage.request_id()).await {
            Ok(Some(_)) => "stored".to_owned(),
            Ok(None) => "not stored".to_owned(),
            Err(e) => format!("unknown ({e})"),
        };
        let status = match self.bus.jetstream().get_key_value(STAGES_BUCKET).await {
            Ok(kv) => match kv.get(stage.status_key()).await {
                Ok(Some(value)) => String::from_utf8_lossy(&value).into_owned(),
                Ok(None) => "none".to_owned(),
                Err(e) => format!("unreadable ({e})"),
            },
            Err(e) => format!("unreadable ({e})"),
        };
        // A stopped service's error: its task has finished, so awaiting it returns at once.
        let mut stopped = Vec::new();
        let mut running = Vec::new();
        for r in std::mem::take(&mut self.tasks) {
            if r.task.is_finished() {
                let outcome = match r.task.await {
                    Ok(Ok(())) => "stopped cleanly".to_owned(),
                    Ok(Err(e)) => format!("{e:#}"),
                    Err(e) => format!("task failed: {e}"),
                };
                stopped.push(format!("{} ({outcome})", r.name));
            } else {
                running.push(r);
            }
        }
        self.tasks = running;
        format!(
            "stage {}: request {request}; status {status}; services stopped: {stopped:?}",
            stage.status_key()
        )
    }

    /// The stage's status in `stagehand_stages`, once the recorder has written one that
    /// satisfies `pred`.
    pub async fn status_where(
        &self,
        stage: &Stage,
        what: &str,
        pred: impl Fn(&StageStatus) -> bool,
    ) -> anyhow::Result<StageStatus> {
        let kv = self.bus.jetstream().get_key_value(STAGES_BUCKET).await?;
        let key = stage.status_key();
        wait_for(WAIT, what, || async {
            let value = kv.get(key.clone()).await.ok().flatten()?;
            let status: StageStatus = serde_json::from_slice(&value).ok()?;
            pred(&status).then_some(status)
        })
        .await
        .map_err(Into::into)
    }
}

impl Drop for Stagehand {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The version digest of a folder's files (what `stagehand ingest` will name the version).
pub fn digest_of(folder: &Path) -> anyhow::Result<String> {
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(folder).sort_by_file_name() {
        let entry = entry?;
        if !entry.file_type().is_file() {
            continue;
        }
        let rel = entry
            .path()
            .strip_prefix(folder)?
            .to_str()
            .context("a UTF-8 path")?
            .to_owned();
        let bytes = std::fs::read(entry.path())?;
        files.push(FileRef {
            path: rel,
            size: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
        });
    }
    Ok(version_digest(&files))
}

/// Writes `files` beneath `root` (readable by everyone); returns ("./path", sha256) sorted.
pub fn write_files(root: &Path, files: &[(&str, &[u8])]) -> anyhow::Result<Vec<(String, String)>> {
    let mut sums = Vec::new();
    for (rel, bytes) in files {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().expect("a file has a parent"))?;
        std::fs::write(&path, bytes)?;
        sums.push((format!("./{rel}"), sha256_hex(bytes)));
    }
    sums.sort();
    Ok(sums)
}
