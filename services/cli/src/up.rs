//! `stagehand up`: Stagehand on one machine.
//!
//! Starts a nats-server with JetStream whose data lives under the home folder (or uses the
//! server given with `--nats`), provisions the streams, writes the default policies into
//! `<home>/policies` if there are none (posix tiers under `<home>/tiers`), creates the tier
//! roots, and runs the ingest validator and the catalogue recorder in this process. One
//! cancellation token stops them all; each drains within its deadline, then the server stops.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue_recorder::RecorderConfig;
use tokio::task::JoinHandle;

/// The default policies shipped with Stagehand (the repository's `policies/`).
const DEFAULT_POLICIES: &[(&str, &str)] = &[
    ("tiers.toml", include_str!("../../../policies/tiers.toml")),
    (
        "validation.toml",
        include_str!("../../../policies/validation.toml"),
    ),
];

/// How long services may take to drain after Ctrl-C.
pub const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// Options of `stagehand up`.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub home: PathBuf,
    /// Use this server instead of starting one.
    pub nats: Option<String>,
    /// Port of the server `up` starts.
    pub port: u16,
    /// Policy folder; default `<home>/policies`, written with the defaults when missing.
    pub policies: Option<PathBuf>,
}

/// A running Stagehand: the server (if `up` started it) and the in-process services.
pub struct Stack {
    pub url: String,
    pub home: PathBuf,
    pub policies: PathBuf,
    pub shutdown: CancellationToken,
    validator: JoinHandle<anyhow::Result<()>>,
    recorder: JoinHandle<anyhow::Result<()>>,
    server: Option<Child>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("url", &self.url)
            .field("home", &self.home)
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

fn start_server(home: &Path, port: u16) -> anyhow::Result<Child> {
    let data = home.join("data/nats");
    std::fs::create_dir_all(&data)?;
    let log = home.join("nats-server.log");
    let binary = nats_server_binary(home);
    // Raise max_payload above Stagehand's event bound (deploy/nats/dev.conf says why).
    let conf = home.join("nats-dev.conf");
    std::fs::write(&conf, include_str!("../../../deploy/nats/dev.conf"))?;
    Command::new(&binary)
        .arg("-c")
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
        .process_group(0)
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (install it with `deploy/servers.sh install`, or pass --nats URL)",
                binary.display()
            )
        })
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
        let (url, mut server) = match &opts.nats {
            Some(url) => (url.clone(), None),
            None => (
                format!("nats://127.0.0.1:{}", opts.port),
                Some(start_server(&home, opts.port)?),
            ),
        };
        let connected = async {
            let mut cfg = BusConfig::new(url.clone());
            cfg.connect_timeout = Duration::from_secs(20);
            let bus = Bus::connect(&cfg).await?;
            bus.provision().await?;
            anyhow::Ok(bus)
        }
        .await;
        let bus = match connected {
            Ok(bus) => bus,
            Err(e) => {
                if let Some(child) = server.as_mut() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(e.context(format!("connecting to NATS at {url}")));
            }
        };
        let shutdown = CancellationToken::new();
        let validator_cfg = stagehand_ingest_validator::Config::new(
            url.clone(),
            policies.clone(),
            home.join("state/ingest-validator"),
        );
        let token = shutdown.clone();
        let validator = tokio::spawn(async move {
            stagehand_ingest_validator::run(validator_cfg, token).await?;
            Ok(())
        });
        let recorder_cfg = RecorderConfig::under(home.join("state/catalogue"));
        let token = shutdown.clone();
        let recorder = tokio::spawn(async move {
            stagehand_catalogue_recorder::run(bus, recorder_cfg, token).await?;
            Ok(())
        });
        Ok(Stack {
            url,
            home,
            policies,
            shutdown,
            validator,
            recorder,
            server,
        })
    }

    /// Waits until the catalogue answers (the recorder is live).
    pub async fn ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let client = async_nats::connect(&self.url).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let q = stagehand_catalogue::Query::DeadLetters {
                limit: Some(1),
                after: None,
            };
            if stagehand_catalogue::ask(&client, &q, Duration::from_millis(500))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if self.validator.is_finished() || self.recorder.is_finished() {
                bail!("a service stopped during start-up (see the log above)");
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
        let both = async { tokio::join!(&mut self.validator, &mut self.recorder) };
        let result = match tokio::time::timeout(STOP_DEADLINE, both).await {
            Ok((v, r)) => {
                let v = v
                    .map_err(anyhow::Error::from)
                    .and_then(|r| r)
                    .context("ingest validator");
                let r = r
                    .map_err(anyhow::Error::from)
                    .and_then(|r| r)
                    .context("catalogue recorder");
                v.and(r)
            }
            Err(_) => Err(anyhow::anyhow!(
                "services did not stop within {STOP_DEADLINE:?}"
            )),
        };
        if let Some(mut child) = self.server.take() {
            // SIGTERM lets nats-server flush JetStream; wait for it to exit.
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_child(&child),
                rustix::process::Signal::TERM,
            );
            let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        }
        result
    }

    /// Whether a service stopped on its own (an error).
    pub fn failed(&self) -> bool {
        self.validator.is_finished() || self.recorder.is_finished()
    }
}

/// Runs `stagehand up` until Ctrl-C or SIGTERM.
pub async fn run(opts: UpOptions) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let stack = Stack::start(opts).await?;
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
        "stagehand is up: NATS {} · home {} · policies {}\nPress Ctrl-C to stop.",
        stack.url,
        stack.home.display(),
        stack.policies.display()
    );
    let mut watch = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = interrupt.recv() => break,
            _ = term.recv() => break,
            _ = watch.tick() => if stack.failed() { break },
        }
    }
    println!("stopping…");
    stack.stop().await?;
    println!("stopped");
    Ok(())
}
