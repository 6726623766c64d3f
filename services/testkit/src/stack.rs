//! The shared stack of the services' integration tests: a nats-server (with or without the
//! shipped accounts), the streams and buckets `stagehand provision` makes, posix tiers and a
//! policy folder in a temporary directory, and the services a test runs, in-process (each
//! stopped with the stack) or as processes ([`ServiceProcess`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::Catalogue;
use stagehand_schemas::Event;

use crate::policies::{PolicyFiles, TierSpec};
use crate::{NatsServer, user_url};

/// How long a stopped service may take to finish.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// What a [`Stack`] starts with.
#[derive(Debug, Default)]
pub struct StackBuilder {
    /// `Some(projects)`: the server runs the shipped accounts, extended to `projects`.
    accounts: Option<Vec<String>>,
    /// Nodes whose services get a user of their own under the shipped accounts.
    node_users: Vec<String>,
    policies: PolicyFiles,
    tier_dirs: Vec<String>,
    /// Posix tiers whose root is `<root>/tiers/<folder>` rather than their name.
    folders: Vec<(String, String)>,
    recorder: bool,
}

impl StackBuilder {
    /// Runs the server with `deploy/nats/accounts.conf`: the stack's own client provisions as
    /// the operator, and each service connects as its own user ([`Stack::url_of`]).
    pub fn shipped_accounts(self) -> StackBuilder {
        self.shipped_accounts_with_projects(&[])
    }

    /// [`shipped_accounts`](Self::shipped_accounts) extended to tenants of `projects`.
    pub fn shipped_accounts_with_projects(mut self, projects: &[&str]) -> StackBuilder {
        self.accounts = Some(projects.iter().map(|p| (*p).to_owned()).collect());
        self
    }

    /// [`shipped_accounts`](Self::shipped_accounts) with a user for the services of each of
    /// `nodes` (`node-<node>`: [`crate::with_node_users`]), as each node of a cluster has.
    pub fn shipped_accounts_with_nodes(mut self, nodes: &[&str]) -> StackBuilder {
        self.accounts.get_or_insert_with(Vec::new);
        self.node_users = nodes.iter().map(|n| (*n).to_owned()).collect();
        self
    }

    /// Declares tier `name`; a posix tier without a root gets `<root>/tiers/<name>`.
    pub fn tier(mut self, name: &str, spec: TierSpec) -> StackBuilder {
        self.policies = self.policies.tier(name, spec);
        self
    }

    /// Declares posix tier `name` with its root at `<root>/tiers/<folder>` (one node's local
    /// tier of several, say).
    pub fn tier_in(mut self, name: &str, folder: &str, spec: TierSpec) -> StackBuilder {
        self.folders.push((name.to_owned(), folder.to_owned()));
        self.tier(name, spec)
    }

    /// The policy files besides the tiers (tiers declared on them are kept too).
    pub fn policies(mut self, files: PolicyFiles) -> StackBuilder {
        let tiers: Vec<(String, TierSpec)> = self
            .policies
            .tiers()
            .map(|(n, s)| (n.to_owned(), s.clone()))
            .collect();
        self.policies = tiers
            .into_iter()
            .fold(files, |files, (name, spec)| files.tier(&name, spec));
        self
    }

    /// The policy file `name` with `text`.
    pub fn policy(mut self, name: &str, text: impl Into<String>) -> StackBuilder {
        self.policies = self.policies.file(name, text);
        self
    }

    /// Another folder `<root>/tiers/<name>` to create (the root of a tier a test declares in
    /// a policy folder of its own).
    pub fn tier_dir(mut self, name: &str) -> StackBuilder {
        self.tier_dirs.push(name.to_owned());
        self
    }

    /// Runs the catalogue recorder in-process from the start (else
    /// [`Stack::start_recorder`] later).
    pub fn recorder(mut self) -> StackBuilder {
        self.recorder = true;
        self
    }

    /// Starts the server, writes the tiers and policies, provisions the streams and buckets
    /// (the services' key-value buckets included) and starts the recorder when asked.
    pub async fn start(self) -> Stack {
        let nats = match &self.accounts {
            None => NatsServer::start(),
            Some(projects) => {
                let projects: Vec<&str> = projects.iter().map(String::as_str).collect();
                let nodes: Vec<&str> = self.node_users.iter().map(String::as_str).collect();
                NatsServer::builder()
                    .shipped_accounts_with(&projects, &nodes)
                    .start()
            }
        };
        let tmp = tempfile::tempdir().expect("a temporary directory");
        let root = tmp.path().to_owned();
        let policies = root.join("policies");
        let folders = &self.folders;
        let files = self.policies.default_roots(|name| {
            let folder = folders
                .iter()
                .find(|(n, _)| n == name)
                .map_or(name, |(_, f)| f.as_str());
            root.join("tiers").join(folder)
        });
        for name in &self.tier_dirs {
            std::fs::create_dir_all(root.join("tiers").join(name)).expect("a tier folder");
        }
        files.write(&policies);
        let accounts = self.accounts.is_some();
        let operator = if accounts {
            user_url(&nats, "operator", "OPERATOR")
        } else {
            nats.url()
        };
        let bus = Bus::connect(&BusConfig::new(operator))
            .await
            .expect("connect to the test's nats-server");
        // What `stagehand provision` does: the streams and buckets, the services' included.
        bus.provision().await.expect("provision the streams");
        for spec in stagehand_bus::SERVICE_KV_BUCKETS {
            bus.provision_kv(spec).await.expect("provision a bucket");
        }
        let mut stack = Stack {
            nats,
            tmp,
            bus,
            policies,
            accounts,
            shutdown: CancellationToken::new(),
            tasks: Vec::new(),
        };
        if self.recorder {
            stack.start_recorder();
        }
        stack
    }
}

/// A running stack; dropping it stops its services and its server.
#[derive(Debug)]
pub struct Stack {
    pub nats: NatsServer,
    pub tmp: tempfile::TempDir,
    /// The test's own client: the operator's when the server runs accounts.
    pub bus: Bus,
    /// The policy folder.
    pub policies: PathBuf,
    /// Cancelled when the stack stops; each in-process service runs on a child of it.
    pub shutdown: CancellationToken,
    accounts: bool,
    tasks: Vec<(String, CancellationToken, tokio::task::JoinHandle<()>)>,
}

impl Stack {
    pub fn builder() -> StackBuilder {
        StackBuilder::default()
    }

    /// The temporary directory everything of the stack lives under.
    pub fn root(&self) -> &Path {
        self.tmp.path()
    }

    /// The folder of posix tier `name` (`<root>/tiers/<name>`).
    pub fn tier(&self, name: &str) -> PathBuf {
        self.root().join("tiers").join(name)
    }

    /// Whether the server runs the shipped accounts.
    pub fn accounts(&self) -> bool {
        self.accounts
    }

    /// The server's URL for `user`, whose password is the role `role`'s (the plain URL when
    /// the server runs without accounts).
    pub fn url_of(&self, user: &str, role: &str) -> String {
        if self.accounts {
            user_url(&self.nats, user, role)
        } else {
            self.nats.url()
        }
    }

    /// A catalogue client on the test's connection, answering within 5 s.
    pub fn catalogue(&self) -> Catalogue {
        Catalogue::new(self.bus.client().clone()).with_timeout(Duration::from_secs(5))
    }

    /// Publishes `event` as the test's client; panics when it is not stored.
    pub async fn publish(&self, event: &Event) {
        self.bus
            .publish(event)
            .await
            .unwrap_or_else(|e| panic!("publishing {}: {e}", event.kind()));
    }

    /// Runs a service in-process until the stack stops: `service` gets its own stop token
    /// and its future must end `Ok` (a failure panics, naming `name`, when the stack stops).
    pub fn run<F, Fut, T, E>(&mut self, name: &str, service: F)
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: std::fmt::Display,
        T: Send + 'static,
    {
        let token = self.shutdown.child_token();
        let run = service(token.clone());
        let label = name.to_owned();
        let task = tokio::spawn(async move {
            if let Err(e) = run.await {
                panic!("{label} failed: {e}");
            }
        });
        self.tasks.push((name.to_owned(), token, task));
    }

    /// Stops the in-process service last started as `name` (its stop token cancelled) and
    /// waits for it to end, within 30 s: what a restart of that one service begins with.
    /// Panics when it failed or is not running.
    pub async fn stop_service(&mut self, name: &str) {
        let at = self
            .tasks
            .iter()
            .rposition(|(label, _, _)| label == name)
            .unwrap_or_else(|| panic!("no service {name} is running"));
        let (_, token, task) = self.tasks.remove(at);
        token.cancel();
        match tokio::time::timeout(STOP_TIMEOUT, task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{name} failed: {e}"),
            Err(_) => panic!("{name} did not stop within {STOP_TIMEOUT:?}"),
        }
    }

    /// Runs the real catalogue recorder in-process, as its own user, with its store under
    /// `<root>/recorder`.
    pub fn start_recorder(&mut self) {
        let mut config = stagehand_catalogue_recorder::config(
            &self.url_of("catalogue-recorder", "CATALOGUE_RECORDER"),
            self.root().join("recorder"),
        );
        config.bus.provision = !self.accounts;
        self.run(stagehand_catalogue_recorder::SERVICE, |token| {
            stagehand_catalogue_recorder::run(config, token)
        });
    }

    /// Starts `binary --config <root>/proc-<name>/<file name>` with `config` written there,
    /// its stderr in `<root>/proc-<name>/stderr.log` ([`ServiceProcess`]).
    pub fn spawn_process(
        &self,
        name: &str,
        binary: impl AsRef<Path>,
        config: &str,
        envs: &[(&str, &str)],
    ) -> ServiceProcess {
        let dir = self.root().join(format!("proc-{name}"));
        std::fs::create_dir_all(&dir).expect("a process folder");
        let file = dir.join("service.toml");
        std::fs::write(&file, config).expect("write a service's configuration");
        ServiceProcess::spawn(binary, &file, &dir.join("stderr.log"), envs)
    }

    /// The stderr of the process [`spawn_process`](Self::spawn_process) started as `name`.
    pub fn log_of(&self, name: &str) -> String {
        std::fs::read_to_string(self.root().join(format!("proc-{name}/stderr.log")))
            .unwrap_or_default()
    }

    /// Stops the in-process services, the last started first, each within 30 s; panics when
    /// one failed.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        let mut failed = Vec::new();
        while let Some((name, token, task)) = self.tasks.pop() {
            token.cancel();
            match tokio::time::timeout(STOP_TIMEOUT, task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if e.is_panic() => failed.push(name),
                Ok(Err(_)) => {}
                Err(_) => failed.push(format!("{name} (did not stop within {STOP_TIMEOUT:?})")),
            }
        }
        assert!(failed.is_empty(), "services failed: {}", failed.join(", "));
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A service binary run by a test: its Stagehand environment variables (`STAGEHAND_*`)
/// removed, so that only its configuration and what the test gives speak; SIGKILLed and
/// reaped when dropped.
#[derive(Debug)]
pub struct ServiceProcess {
    child: Child,
    log: PathBuf,
}

impl ServiceProcess {
    /// Starts `binary --config config` with `envs`, stdout discarded, stderr in `log`.
    pub fn spawn(
        binary: impl AsRef<Path>,
        config: &Path,
        log: &Path,
        envs: &[(&str, &str)],
    ) -> ServiceProcess {
        Self::spawn_command(Command::new(binary.as_ref()), config, log, envs)
    }

    /// [`spawn`](Self::spawn) of a command made by the caller: `cmd --config config`, such as
    /// a binary under `ip netns exec` ([`crate::NetNode::command`]).
    pub fn spawn_command(
        mut cmd: Command,
        config: &Path,
        log: &Path,
        envs: &[(&str, &str)],
    ) -> ServiceProcess {
        let program = format!("{:?}", cmd.get_args().last().unwrap_or(cmd.get_program()));
        for (var, _) in std::env::vars_os() {
            if var.to_string_lossy().starts_with("STAGEHAND_") {
                cmd.env_remove(var);
            }
        }
        let stderr = std::fs::File::create(log)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let child = cmd
            .arg("--config")
            .arg(config)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"));
        ServiceProcess {
            child,
            log: log.to_owned(),
        }
    }

    /// What the process wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process, to signal or wait on.
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// SIGKILLs the process and reaps it: a crash.
    pub fn kill(&mut self) {
        // An error means it had exited already: reaping it is all that is left.
        let _ = self.child.kill();
        self.child.wait().expect("reap a killed service");
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
