//! A real `nats-server` with JetStream per test, and a three-node JetStream cluster.
//!
//! Each server gets its own temporary directory holding the JetStream store, the log and the
//! ports file. The first start asks the server for a free client port (`-p -1`) and reads the
//! port it chose from `--ports_file_dir`; a restart reuses that port and store, as a crashed
//! server coming back would. Dropping the server kills it and removes the directory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use tempfile::TempDir;

use crate::process::{self, Binary};

/// How long a server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a cluster may take to elect a JetStream meta leader and accept an R3 stream.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(60);

/// Clustering settings of one node.
#[derive(Debug, Clone)]
struct ClusterNode {
    name: String,
    cluster_name: String,
    port: u16,
    routes: Vec<String>,
}

/// The settings every development and test server runs with (deploy/nats/dev.conf).
const DEV_CONF: &str = include_str!("../../../deploy/nats/dev.conf");

/// A running `nats-server` with JetStream on loopback. Killed, and its store removed, on drop.
#[derive(Debug)]
pub struct NatsServer {
    dir: TempDir,
    config: Option<PathBuf>,
    env: Vec<(String, String)>,
    cluster: Option<ClusterNode>,
    /// The address the client and monitoring ports listen on (`-a`).
    host: IpAddr,
    port: u16,
    /// The monitoring port (`/varz`, `/jsz`, `/healthz`) of the running process: a free one,
    /// chosen again at each start.
    monitor_port: Option<u16>,
    child: Option<Child>,
}

/// Options for a server other than the defaults: a configuration file and environment
/// variables (a config can read secrets as `$VAR`).
#[derive(Debug, Default, Clone)]
pub struct NatsServerBuilder {
    config: Option<PathBuf>,
    config_text: Option<String>,
    env: Vec<(String, String)>,
    host: Option<IpAddr>,
}

impl NatsServerBuilder {
    /// Listens on `addr` instead of `127.0.0.1`: a node network's bridge address
    /// ([`crate::NodeNetwork::host_addr`]), so that processes in its namespaces connect, or
    /// `0.0.0.0` (then [`NatsServer::url`] still names `127.0.0.1`).
    pub fn bind(mut self, addr: impl Into<IpAddr>) -> Self {
        self.host = Some(addr.into());
        self
    }

    /// Starts the server with `-c path`. Port, address and store dir still come from the testkit.
    pub fn config_file(mut self, path: impl AsRef<Path>) -> Self {
        self.config = Some(path.as_ref().to_path_buf());
        self
    }

    /// Starts the server with a configuration made by the test: `text` is written into the
    /// server's own directory and passed as `-c`.
    pub fn config_text(mut self, text: impl Into<String>) -> Self {
        self.config_text = Some(text.into());
        self.config = None;
        self
    }

    /// Sets an environment variable for the server process.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Starts the server and waits until it accepts connections. Panics, with the log tail,
    /// when it does not within 20 s.
    pub fn start(self) -> NatsServer {
        let host = self.host.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        NatsServer::launch(self.config, self.config_text, self.env, None, host)
    }
}

impl NatsServer {
    /// Starts a JetStream server on a free loopback port with its own store.
    pub fn start() -> NatsServer {
        Self::builder().start()
    }

    /// Starts a server with `nats-server -c path` (accounts, permissions, limits).
    pub fn start_with_config(path: impl AsRef<Path>) -> NatsServer {
        Self::builder().config_file(path).start()
    }

    /// Options for a server: a configuration file and environment variables.
    pub fn builder() -> NatsServerBuilder {
        NatsServerBuilder::default()
    }

    fn launch(
        config: Option<PathBuf>,
        config_text: Option<String>,
        env: Vec<(String, String)>,
        cluster: Option<ClusterNode>,
        host: IpAddr,
    ) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("stagehand-nats-")
            .tempdir()
            .expect("create a temp dir for nats-server");
        let config = match config_text {
            Some(text) => {
                let path = dir.path().join("server.conf");
                std::fs::write(&path, text).expect("write the test's nats config");
                Some(path)
            }
            None => config,
        };
        let mut server = NatsServer {
            dir,
            config,
            env,
            cluster,
            host,
            port: 0,
            monitor_port: None,
            child: None,
        };
        server.run();
        server
    }

    /// `nats://127.0.0.1:PORT`, or the address it was bound to ([`NatsServerBuilder::bind`]).
    pub fn url(&self) -> String {
        format!("nats://{}:{}", self.dialled(), self.port)
    }

    /// Where a client on this host reaches the server: its bound address, loopback for the
    /// unspecified one.
    fn dialled(&self) -> IpAddr {
        match self.host.is_unspecified() {
            true => IpAddr::V4(Ipv4Addr::LOCALHOST),
            false => self.host,
        }
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The monitoring endpoint's `127.0.0.1:PORT` (or the bound address; `http://` it for `/varz`, `/jsz`,
    /// `/healthz`); a restart moves it. Panics when the server is not running.
    pub fn monitor_addr(&self) -> String {
        let port = self
            .monitor_port
            .expect("a running nats-server has a monitoring port");
        format!("{}:{port}", self.dialled())
    }

    /// The server's store directory (`-sd`); JetStream keeps its data in `jetstream/` below it.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Kills the server with SIGKILL, as a crash would. Its store stays for [`restart`](Self::restart).
    pub fn kill(&mut self) {
        self.monitor_port = None;
        if let Some(mut child) = self.child.take() {
            process::kill(&mut child);
        }
    }

    /// Replaces the configuration the server was started with by `text` (its users, accounts
    /// and limits) and has the running server reload it (SIGHUP, as `nats-server --signal
    /// reload` sends), as an operator does after editing the accounts config. Waits until the
    /// server says it reloaded; an error the server logged while reloading (it then keeps
    /// what it could apply) is returned, with its log lines. Panics when the server was
    /// started without a configuration of the test's own ([`NatsServerBuilder::config_text`]).
    pub fn reload_config_text(&mut self, text: &str) -> Result<(), String> {
        let config = self.dir.path().join("server.conf");
        assert!(
            self.config.as_deref() == Some(config.as_path()),
            "reload_config_text: the server runs {:?}, not a configuration of the test's own",
            self.config
        );
        let pid = self
            .child
            .as_ref()
            .map(|c| c.id())
            .expect("reload_config_text: the server is running");
        std::fs::write(&config, text).expect("write the test's nats config");
        let log = self.log_path();
        let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
        let before = read_log().len();
        const RELOADED: &str = "Reloaded server configuration";
        let pid = libc::pid_t::try_from(pid).expect("a pid fits pid_t");
        // SAFETY: kill(2) on the server this struct started and still holds.
        if unsafe { libc::kill(pid, libc::SIGHUP) } != 0 {
            return Err(format!(
                "signalling nats-server {pid} to reload: {}",
                std::io::Error::last_os_error()
            ));
        }
        crate::wait_until_blocking(
            START_TIMEOUT,
            "nats-server to reload its configuration",
            || {
                read_log()
                    .get(before..)
                    .is_some_and(|new| new.contains(RELOADED))
            },
        )
        .map_err(|e| format!("{e}; log {}", log.display()))?;
        let logged = read_log();
        let errors: Vec<&str> = logged[before..]
            .lines()
            .filter(|l| l.contains("[ERR]"))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "nats-server reloaded {} with errors:\n{}",
                config.display(),
                errors.join("\n")
            ))
        }
    }

    /// Kills the server (if running) and starts it again on the same port with the same store,
    /// then waits until it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }

    fn ports_dir(&self) -> PathBuf {
        self.dir.path().join("ports")
    }

    fn run(&mut self) {
        let bin = process::find_binary(Binary::NatsServer);
        let ports_dir = self.ports_dir();
        std::fs::create_dir_all(&ports_dir).expect("create the ports dir");
        std::fs::create_dir_all(self.store_dir()).expect("create the store dir");
        let mut cmd = Command::new(&bin);
        match &self.config {
            // A free monitoring port: a configuration's own (`http: ...:8222`, as the shipped
            // ones say) would be taken by another server of this test or another.
            Some(config) => cmd.arg("-c").arg(config).args(["-m", "-1"]),
            None => {
                // Tests run with the settings development uses (deploy/nats/dev.conf): the
                // server's default limits, max_payload included.
                let dev_conf = self.dir.path().join("dev.conf");
                std::fs::write(&dev_conf, DEV_CONF).expect("write the dev nats config");
                cmd.arg("-c").arg(dev_conf).args(["-m", "-1"])
            }
        };
        // `-1` asks the server for a free port; a restart keeps the port clients know.
        let port = if self.port == 0 {
            "-1".to_string()
        } else {
            self.port.to_string()
        };
        cmd.args(["-js", "-a", &self.host.to_string(), "-p", &port])
            .arg("-sd")
            .arg(self.store_dir())
            .arg("--ports_file_dir")
            .arg(&ports_dir);
        if let Some(c) = &self.cluster {
            cmd.args(["-n", &c.name, "--cluster_name", &c.cluster_name])
                .args(["--cluster", &format!("nats://127.0.0.1:{}", c.port)])
                .args(["--routes", &c.routes.join(",")]);
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let log = self.log_path();
        let mut child = process::spawn(cmd, &log);
        let ports_file = ports_dir.join(format!("nats-server_{}.ports", child.id()));
        let dialled = self.dialled();
        let ready = process::poll_ready(&mut child, START_TIMEOUT, || {
            let port = read_port(&ports_file, "nats")?;
            process::accepts_at(dialled, port).then_some(port)
        });
        match ready {
            Ok(port) => {
                self.port = port;
                self.monitor_port = read_port(&ports_file, "monitoring");
                self.child = Some(child);
            }
            Err(why) => {
                process::kill(&mut child);
                panic!(
                    "nats-server ({}) {why}; log {}:\n{}",
                    bin.display(),
                    log.display(),
                    process::log_tail(&log, 4000)
                );
            }
        }
    }
}

/// Reads a port from a ports file: `{"nats":["nats://127.0.0.1:PORT"],"monitoring":
/// ["http://127.0.0.1:PORT"],...}`, the first URL under `key`.
fn read_port(path: &Path, key: &str) -> Option<u16> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = v.get(key)?.get(0)?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A JetStream cluster of nodes on loopback, all in one cluster, each with its own store.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

/// How the testkit's own client reaches a cluster that has users or TLS, to see that it is
/// ready: options made afresh for each connection.
type ClientOptions = std::sync::Arc<dyn Fn() -> async_nats::ConnectOptions + Send + Sync>;

/// Options for a cluster other than the defaults: each node's configuration (a shipped
/// `cluster-<n>.conf`, say; ports, store and routes still come from the testkit, overriding
/// it) and environment, and how to connect to it.
#[derive(Clone)]
pub struct NatsClusterBuilder {
    size: usize,
    configs: Vec<String>,
    env: Vec<(String, String)>,
    client: ClientOptions,
}

impl std::fmt::Debug for NatsClusterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsClusterBuilder")
            .field("size", &self.size)
            .field("configs", &self.configs.len())
            .finish()
    }
}

impl NatsClusterBuilder {
    /// Node `i` (from 0) runs with configuration `texts[i]` (written into its own folder).
    /// The monitoring port a configuration names is replaced by a free one.
    pub fn config_texts(mut self, texts: Vec<String>) -> Self {
        self.configs = texts;
        self
    }

    /// Sets an environment variable for every node (a config can read secrets as `$VAR`).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// How the testkit connects to see that the cluster is ready (a user, TLS roots).
    pub fn client_options(
        mut self,
        options: impl Fn() -> async_nats::ConnectOptions + Send + Sync + 'static,
    ) -> Self {
        self.client = std::sync::Arc::new(options);
        self
    }

    /// Starts the nodes and waits until the cluster accepts a stream with `num_replicas =
    /// size`. Panics when it does not within 60 s.
    pub fn start(self) -> NatsCluster {
        let size = self.size;
        assert!(size >= 1, "a cluster needs at least one node");
        assert!(
            self.configs.is_empty() || self.configs.len() == size,
            "{} configurations for {size} nodes",
            self.configs.len()
        );
        // JetStream clustering needs explicit routes on every node, so the route ports are
        // chosen up front. Another process can take one before the nodes bind it: retry.
        let mut last_err = String::new();
        for _attempt in 0..3 {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                NatsCluster::try_start(&self)
            })) {
                Ok(Ok(cluster)) => return cluster,
                Ok(Err(e)) => last_err = e,
                Err(panic) => {
                    last_err = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "node failed to start".into())
                }
            }
        }
        panic!("NATS cluster of {size} did not start: {last_err}");
    }
}

impl NatsCluster {
    /// Starts `size` nodes (3 for replicated streams) and waits until the cluster accepts a
    /// stream with `num_replicas = size`. Panics when it does not within 60 s.
    pub fn start(size: usize) -> NatsCluster {
        Self::builder(size).start()
    }

    /// Options for a cluster of `size` nodes: configurations, environment, client options.
    pub fn builder(size: usize) -> NatsClusterBuilder {
        NatsClusterBuilder {
            size,
            configs: Vec::new(),
            env: Vec::new(),
            client: std::sync::Arc::new(async_nats::ConnectOptions::new),
        }
    }

    fn try_start(b: &NatsClusterBuilder) -> Result<NatsCluster, String> {
        let size = b.size;
        let cluster_name = crate::unique_name("stagehand-c");
        let route_ports = process::free_ports(size);
        let routes: Vec<String> = route_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect();
        let nodes: Vec<NatsServer> = route_ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let node = ClusterNode {
                    name: format!("n{}", i + 1),
                    cluster_name: cluster_name.clone(),
                    port: *port,
                    routes: routes.clone(),
                };
                NatsServer::launch(
                    None,
                    b.configs.get(i).cloned(),
                    b.env.clone(),
                    Some(node),
                    IpAddr::V4(Ipv4Addr::LOCALHOST),
                )
            })
            .collect();
        let cluster = NatsCluster { nodes };
        cluster.wait_for_replicated_stream(size, &b.client)?;
        Ok(cluster)
    }

    /// Creates and deletes an R`size` stream until the meta leader and peers accept it.
    fn wait_for_replicated_stream(
        &self,
        size: usize,
        client: &ClientOptions,
    ) -> Result<(), String> {
        let addrs = self.server_addrs();
        let probe = crate::unique_name("READY");
        let options = client();
        let run = async move {
            let client = options
                .connect(addrs.as_slice())
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let js = async_nats::jetstream::new(client);
            let last = std::sync::Mutex::new(String::new());
            let got = crate::wait_for(CLUSTER_TIMEOUT, "a replicated stream to be created", || {
                let js = js.clone();
                let probe = probe.clone();
                let last = &last;
                async move {
                    let config = async_nats::jetstream::stream::Config {
                        name: probe.clone(),
                        subjects: vec![format!("{probe}.>")],
                        num_replicas: size,
                        ..Default::default()
                    };
                    match js.create_stream(config).await {
                        Ok(_) => Some(()),
                        Err(e) => {
                            *last.lock().unwrap_or_else(|p| p.into_inner()) = e.to_string();
                            None
                        }
                    }
                }
            })
            .await;
            match got {
                Ok(()) => {
                    js.delete_stream(&probe)
                        .await
                        .map_err(|e| format!("delete probe stream: {e}"))?;
                    Ok(())
                }
                Err(e) => Err(format!(
                    "{e}; last error: {}",
                    last.lock().unwrap_or_else(|p| p.into_inner())
                )),
            }
        };
        crate::block_on(run)
    }

    /// Client URLs of every node, in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// Every node's address, for `async_nats::connect(cluster.server_addrs().as_slice())`.
    pub fn server_addrs(&self) -> Vec<async_nats::ServerAddr> {
        self.urls()
            .iter()
            .map(|u| u.parse().expect("a node URL is a valid server address"))
            .collect()
    }

    /// The nodes, to kill or restart one.
    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// One node, to kill or restart it.
    pub fn node_mut(&mut self, i: usize) -> &mut NatsServer {
        &mut self.nodes[i]
    }
}
