//! `stagehand up`: Stagehand on one machine.
//!
//! Starts a nats-server with JetStream whose data lives under the home folder (or uses the
//! server given with `--nats`), provisions the streams, writes the default policies into
//! `<home>/policies` if there are none (posix tiers under `<home>/tiers`), creates the tier
//! roots, and runs every service of [`SERVICES`] in this process through the service runner.
//! One cancellation token stops them all; each drains within its deadline, then the server
//! stops. One endpoint (`--metrics`, [`DEFAULT_METRICS`]) serves the Prometheus metrics of
//! every service it runs. Each service logs and traces through a `tracing` subscriber of its
//! own (`stagehand_telemetry::service_dispatch`), so that with `OTEL_EXPORTER_OTLP_ENDPOINT`
//! set its spans are exported under its own `service.name`, as its binary's would be.
//!
//! The server dies with `up`: it is started with `PR_SET_PDEATHSIG`, so even a SIGKILL of
//! `up` takes it down, and its pid is kept in `<home>/run/nats-server.pid`, so that the next
//! `up` on the same home finds a server left behind (by a kill that no signal could follow,
//! such as a container's) and stops it, saying so.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use stagehand_bus::runner::{self, ServiceConfig, ServiceSettings};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_telemetry::metrics::MetricsEndpoint;
use tokio::task::JoinHandle;
use tracing::instrument::WithSubscriber;

/// The default policies shipped with Stagehand (the repository's `policies/`): every file the
/// services read, so that each service of [`SERVICES`] finds its policy.
const DEFAULT_POLICIES: &[(&str, &str)] = &[
    ("tiers.toml", include_str!("../../../policies/tiers.toml")),
    (
        "validation.toml",
        include_str!("../../../policies/validation.toml"),
    ),
    (
        "packing.toml",
        include_str!("../../../policies/packing.toml"),
    ),
    (
        "promotion.toml",
        include_str!("../../../policies/promotion.toml"),
    ),
    (
        "demotion.toml",
        include_str!("../../../policies/demotion.toml"),
    ),
    (
        "retention.toml",
        include_str!("../../../policies/retention.toml"),
    ),
    ("backup.toml", include_str!("../../../policies/backup.toml")),
    (
        "priorities.toml",
        include_str!("../../../policies/priorities.toml"),
    ),
    ("scrub.toml", include_str!("../../../policies/scrub.toml")),
];

/// What starting one service needs: where the stack lives and how to reach NATS.
#[derive(Debug, Clone)]
pub struct UpEnv {
    pub home: PathBuf,
    pub policies: PathBuf,
    pub bus: BusConfig,
}

impl UpEnv {
    /// Runs `serve` with `settings` under the service runner until `stop` is cancelled.
    fn spawn<S, F, Fut, T, E>(
        &self,
        name: &'static str,
        settings: S,
        serve: F,
        stop: CancellationToken,
    ) -> JoinHandle<anyhow::Result<()>>
    where
        S: ServiceSettings,
        F: FnOnce(runner::Context<S>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
        T: Send + 'static,
    {
        let mut bus = self.bus.clone();
        bus.client_name = name.to_owned();
        let config = ServiceConfig::new(bus, settings);
        tokio::spawn(async move {
            // A subscriber of its own, as the service's binary would have: its spans are
            // exported under its own `service.name`, not `up`'s.
            let (dispatch, telemetry) =
                stagehand_telemetry::service_dispatch(name, &config.telemetry)
                    .with_context(|| format!("{name}: telemetry"))?;
            let result = runner::run(name, config, stop, serve)
                .with_subscriber(dispatch)
                .await
                .map(|_| ())
                .with_context(|| name.to_owned());
            // Flushes the service's last spans.
            drop(telemetry);
            result
        })
    }
}

/// Starts one service of the stack.
type Start = fn(&UpEnv, CancellationToken) -> JoinHandle<anyhow::Result<()>>;

/// An entry of [`SERVICES`] for the service crate `$krate`, which exports, as every service
/// crate does, `SERVICE` (its name), a settings type `$settings` with
/// `dev(home, policies)` (its settings on one machine) and `serve` (what its binary runs).
macro_rules! service {
    ($krate:ident, $settings:ident) => {
        ($krate::SERVICE, |env, stop| {
            env.spawn(
                $krate::SERVICE,
                $krate::$settings::dev(&env.home, &env.policies),
                $krate::serve,
                stop,
            )
        })
    };
}

/// Every service `stagehand up` runs, in start order. Adding a service is one line.
pub const SERVICES: &[(&str, Start)] = &[
    service!(stagehand_ingest_validator, Settings),
    service!(stagehand_catalogue_recorder, Settings),
    service!(stagehand_resharder, Settings),
    service!(stagehand_promoter, Settings),
    service!(stagehand_demoter, Settings),
    service!(stagehand_backup_copier, Settings),
];

/// The `service.name` of `up`'s own spans and logs (each service it runs has its own).
pub const UP_SERVICE: &str = "stagehand-up";

/// How long services may take to drain after Ctrl-C.
pub const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// Where `stagehand up` serves `/metrics` unless `--metrics` says otherwise: loopback, on the
/// port after the shipped services' (`deploy/config`, 9464–9469), so that `up` beside a
/// service installed on the same host does not take its port.
pub const DEFAULT_METRICS: &str = "127.0.0.1:9470";

/// Options of `stagehand up`.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub home: PathBuf,
    /// Use this server instead of starting one.
    pub nats: Option<BusConfig>,
    /// Port of the server `up` starts.
    pub port: u16,
    /// Policy folder; default `<home>/policies`, written with the defaults when missing.
    pub policies: Option<PathBuf>,
}

/// A running Stagehand: the server (if `up` started it) and the in-process services.
pub struct Stack {
    pub env: UpEnv,
    pub shutdown: CancellationToken,
    services: Vec<(&'static str, JoinHandle<anyhow::Result<()>>)>,
    server: Option<Server>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("servers", &self.env.bus.servers_display())
            .field("home", &self.env.home)
            .finish()
    }
}

/// Writes the default policies into `dir` unless it already holds a `tiers.toml`, with the
/// posix tier roots made absolute beneath `home`.
pub fn write_default_policies(dir: &Path, home: &Path) -> anyhow::Result<()> {
    if dir.join("tiers.toml").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, text) in DEFAULT_POLICIES {
        let text: String = text
            .lines()
            .map(|line| match line.trim_start().strip_prefix("root = \"") {
                Some(rest) if !rest.starts_with('/') => {
                    format!("root = \"{}/{rest}", home.display())
                }
                _ => line.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text + "\n").with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The nats-server binary: `$STAGEHAND_NATS_SERVER`, the venv `deploy/servers.sh install`
/// makes under the home, or `nats-server` on `PATH`.
fn nats_server_binary(home: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("STAGEHAND_NATS_SERVER") {
        return p.into();
    }
    let venv = home.join("venv/bin/nats-server");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("nats-server")
}

/// The nats-server `up` started, and its pid file.
struct Server {
    child: Child,
    pid_file: PathBuf,
}

impl Server {
    /// Stops the server with SIGTERM (JetStream flushes) and waits for it; removes the pid file.
    async fn stop(self) {
        let Server {
            mut child,
            pid_file,
        } = self;
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&child),
            rustix::process::Signal::TERM,
        );
        let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        let _ = std::fs::remove_file(&pid_file);
    }

    /// Kills the server at once (a start that failed half-way).
    fn kill(self) {
        let Server {
            mut child,
            pid_file,
        } = self;
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_file(&pid_file);
    }
}

/// The pid file of the server `up` starts under `home`.
pub fn pid_file(home: &Path) -> PathBuf {
    home.join("run/nats-server.pid")
}

/// The configuration file `up` gives its server; it also marks the process as ours.
fn server_conf(home: &Path) -> PathBuf {
    home.join("nats-dev.conf")
}

/// What `up` found of an earlier run's server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Orphan {
    /// No pid file, or its process is gone (the stale file was removed).
    None,
    /// A server left by an earlier `up` on this home was running and has been stopped.
    Stopped { pid: i32, forced: bool },
}

/// Finds a nats-server left running by an earlier `up` on `home` (through its pid file, and
/// only if that process runs our configuration file for this home: a reused pid is left
/// alone) and stops it: SIGTERM, then SIGKILL after `grace`.
pub fn stop_orphan(home: &Path, grace: Duration) -> anyhow::Result<Orphan> {
    let file = pid_file(home);
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(Orphan::None);
    };
    let pid: Option<i32> = text.trim().parse().ok();
    let ours = pid.filter(|pid| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|cmd| {
                String::from_utf8_lossy(&cmd)
                    .split('\0')
                    .any(|arg| Path::new(arg) == server_conf(home))
            })
            .unwrap_or(false)
    });
    let Some(pid) = ours.and_then(rustix::process::Pid::from_raw) else {
        std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
        return Ok(Orphan::None);
    };
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero()))
            .map(|stat| {
                let state = stat
                    .rsplit_once(')')
                    .map(|(_, r)| r.trim_start())
                    .unwrap_or("");
                !state.starts_with('Z') && !state.starts_with('X')
            })
            .unwrap_or(false)
    };
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    let deadline = std::time::Instant::now() + grace;
    let mut forced = false;
    while alive() {
        if std::time::Instant::now() >= deadline {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            forced = true;
        }
        // Waiting for a process that is not our child: there is nothing to wait on but its
        // /proc entry.
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(&file);
    Ok(Orphan::Stopped {
        pid: pid.as_raw_nonzero().get(),
        forced,
    })
}

fn start_server(home: &Path, port: u16) -> anyhow::Result<Server> {
    let data = home.join("data/nats");
    std::fs::create_dir_all(&data)?;
    let log = home.join("nats-server.log");
    let binary = nats_server_binary(home);
    // The development settings (deploy/nats/dev.conf): the server's own limits, as a stock
    // nats-server has them.
    let conf = server_conf(home);
    std::fs::write(&conf, include_str!("../../../deploy/nats/dev.conf"))?;
    let parent = rustix::process::getpid();
    let mut cmd = Command::new(&binary);
    cmd.arg("-c")
        .arg(&conf)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(&data)
        .arg("-l")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C at the terminal goes to the whole foreground group,
        // and the server must outlive it until the services have drained; `Stack::stop` then
        // stops it with SIGTERM.
        .process_group(0);
    // SAFETY: prctl and getppid are async-signal-safe and touch no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            // The kernel sends SIGTERM when the thread that forked this child exits: `up`
            // starts the server from the thread that runs its main future, which lives as long
            // as the process, so the server dies when `up` dies, even by SIGKILL.
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
            // `up` may have died between the fork and the prctl: then no signal will come.
            if rustix::process::getppid() != Some(parent) {
                return Err(std::io::Error::other("stagehand up exited during start"));
            }
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| {
        format!(
            "starting {} (install it with `deploy/servers.sh install`, or pass --nats URL)",
            binary.display()
        )
    })?;
    let pid_file = pid_file(home);
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(pid_file.parent().expect("the pid file has a folder"))?;
        let tmp = pid_file.with_extension("pid.tmp");
        std::fs::write(&tmp, format!("{}\n", child.id()))?;
        std::fs::rename(&tmp, &pid_file)
    };
    if let Err(e) = write() {
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
        return Err(anyhow::Error::from(e).context(format!("writing {}", pid_file.display())));
    }
    Ok(Server { child, pid_file })
}

impl Stack {
    /// Starts everything and returns once the services run.
    pub async fn start(opts: UpOptions) -> anyhow::Result<Stack> {
        let home = std::path::absolute(&opts.home)?;
        std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
        // Policies and tier roots first: a mistake there fails before any server is started,
        // so no nats-server is left behind by a failed start.
        let policies = match &opts.policies {
            Some(p) => p.clone(),
            None => {
                let dir = home.join("policies");
                write_default_policies(&dir, &home)?;
                dir
            }
        };
        let loaded = stagehand_policy::Policies::load_dir_with_home(&policies, &home)?;
        for tier in loaded.tiers().values() {
            tier.create_root()
                .with_context(|| format!("creating the root of tier {}", tier.name))?;
        }
        let (bus, server) = match &opts.nats {
            Some(bus) => (bus.clone(), None),
            None => {
                if let Orphan::Stopped { pid, forced } =
                    stop_orphan(&home, Duration::from_secs(15))?
                {
                    println!(
                        "found nats-server (pid {pid}) left running by an earlier `stagehand up` on {}; {} it",
                        home.display(),
                        if forced { "killed" } else { "stopped" }
                    );
                }
                let mut bus = BusConfig::new(format!("nats://127.0.0.1:{}", opts.port));
                bus.connect_timeout = Duration::from_secs(20);
                (bus, Some(start_server(&home, opts.port)?))
            }
        };
        let connected = async {
            let connected = Bus::connect(&bus).await?;
            connected.provision().await?;
            anyhow::Ok(connected)
        }
        .await;
        if let Err(e) = connected {
            if let Some(server) = server {
                server.kill();
            }
            return Err(e.context(format!("connecting to NATS at {}", bus.servers_display())));
        }
        let env = UpEnv {
            home,
            policies,
            bus,
        };
        let shutdown = CancellationToken::new();
        let services = SERVICES
            .iter()
            .map(|(name, start)| (*name, start(&env, shutdown.clone())))
            .collect();
        Ok(Stack {
            env,
            shutdown,
            services,
            server,
        })
    }

    /// Serves `GET /metrics` (and the `/healthz`, `/readyz` probes) on `addr` for every
    /// service of the stack until it stops. The services run in this process and share its
    /// one registry, each series carrying its `service` label, so one endpoint serves them
    /// all. Returns the address bound (`addr` with port 0 picks one).
    pub async fn serve_metrics(&self, addr: SocketAddr) -> anyhow::Result<SocketAddr> {
        let endpoint = MetricsEndpoint::bind(addr)
            .await
            .with_context(|| format!("serving metrics on --metrics {addr}"))?;
        let bound = endpoint.local_addr()?;
        let stop = self.shutdown.clone();
        tokio::spawn(endpoint.serve(async move { stop.cancelled().await }));
        Ok(bound)
    }

    /// The servers the stack uses, passwords redacted.
    pub fn servers(&self) -> String {
        self.env.bus.servers_display()
    }

    /// Waits until the catalogue answers (the recorder is live).
    pub async fn ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let bus = Bus::connect(&self.env.bus).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let q = stagehand_catalogue::Query::DeadLetters {
                limit: Some(1),
                after: None,
            };
            if stagehand_catalogue::ask(bus.client(), &q, Duration::from_millis(500))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if let Some(name) = self.failed() {
                bail!("{name} stopped during start-up (see the log above)");
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("the catalogue recorder did not answer within {timeout:?}");
            }
            // "No responders" comes back at once while the recorder starts: pace the retries.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the services (each within its deadline), then the server `up` started.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let services = std::mem::take(&mut self.services);
        let all = futures::future::join_all(services.into_iter().map(|(name, task)| async move {
            task.await
                .map_err(anyhow::Error::from)
                .and_then(|r| r)
                .with_context(|| name.to_owned())
        }));
        let result = match tokio::time::timeout(STOP_DEADLINE, all).await {
            Ok(results) => results
                .into_iter()
                .collect::<anyhow::Result<Vec<()>>>()
                .map(|_| ()),
            Err(_) => Err(anyhow::anyhow!(
                "services did not stop within {STOP_DEADLINE:?}"
            )),
        };
        if let Some(server) = self.server.take() {
            server.stop().await;
        }
        result
    }

    /// The first service that stopped on its own (an error), if any.
    pub fn failed(&self) -> Option<&'static str> {
        self.services
            .iter()
            .find(|(_, task)| task.is_finished())
            .map(|(name, _)| *name)
    }
}

/// Runs `stagehand up` until Ctrl-C or SIGTERM, serving every service's metrics on `metrics`.
pub async fn run(opts: UpOptions, metrics: SocketAddr) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let stack = Stack::start(opts).await?;
    let metrics = match stack.serve_metrics(metrics).await {
        Ok(bound) => bound,
        Err(e) => {
            let _ = stack.stop().await;
            return Err(e);
        }
    };
    // Listen for the stop signals before saying "up", and keep listening on the same streams:
    // a Ctrl-C that comes right after the line is printed, or between two turns of the loop
    // below, must stop Stagehand cleanly, not kill it with the default action or be missed.
    let (mut interrupt, mut term) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(i), Ok(t)) => (i, t),
        (Err(e), _) | (_, Err(e)) => {
            let _ = stack.stop().await;
            return Err(
                anyhow::Error::from(e).context("installing the Ctrl-C and SIGTERM handlers")
            );
        }
    };
    let started = tokio::select! {
        r = stack.ready(Duration::from_secs(60)) => r.map(|()| true),
        _ = interrupt.recv() => Ok(false),
        _ = term.recv() => Ok(false),
    };
    match started {
        Ok(true) => {}
        Ok(false) => {
            println!("stopping…");
            stack.stop().await?;
            println!("stopped");
            return Ok(());
        }
        Err(e) => {
            let _ = stack.stop().await;
            return Err(e);
        }
    }
    println!(
        "stagehand is up: NATS {} · home {} · policies {} · metrics http://{metrics}/metrics\nPress Ctrl-C to stop.",
        stack.servers(),
        stack.env.home.display(),
        stack.env.policies.display()
    );
    let mut watch = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = interrupt.recv() => break,
            _ = term.recv() => break,
            _ = watch.tick() => if stack.failed().is_some() { break },
        }
    }
    println!("stopping…");
    stack.stop().await?;
    println!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_file_is_written_by_default() {
        let written: Vec<&str> = DEFAULT_POLICIES.iter().map(|(name, _)| *name).collect();
        assert_eq!(written, stagehand_policy::POLICY_FILES);
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join("policies");
        write_default_policies(&dir, home.path()).unwrap();
        let loaded = stagehand_policy::Policies::load_dir_with_home(&dir, home.path()).unwrap();
        assert!(loaded.promotion().is_some() && loaded.backup().is_some());
    }

    #[test]
    fn the_default_metrics_port_is_no_shipped_services() {
        let default: SocketAddr = DEFAULT_METRICS.parse().unwrap();
        assert!(default.ip().is_loopback());
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/config");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            for line in text.lines() {
                if let Some(addr) = line.trim().strip_prefix("metrics_listen = ") {
                    let addr: SocketAddr = addr.trim_matches('"').parse().unwrap();
                    assert_ne!(addr.port(), default.port(), "{line}");
                    checked += 1;
                }
            }
        }
        assert!(checked >= 6, "only {checked} shipped metrics ports found");
    }

    #[test]
    fn a_stale_pid_file_is_removed_and_a_foreign_pid_left_alone() {
        let home = tempfile::tempdir().unwrap();
        let file = pid_file(home.path());
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        // Our own pid: alive, but not a nats-server of this home.
        std::fs::write(&file, format!("{}\n", std::process::id())).unwrap();
        assert_eq!(
            stop_orphan(home.path(), Duration::from_secs(1)).unwrap(),
            Orphan::None
        );
        assert!(!file.exists(), "the stale pid file is removed");
        assert_eq!(
            stop_orphan(home.path(), Duration::from_secs(1)).unwrap(),
            Orphan::None
        );
    }
}
