//! The configuration file every service reads (`--config FILE`): four tables with one shape,
//! parsed with unknown keys refused and validated, every error naming the file, the key and
//! its line.
//!
//! ```toml
//! [bus]        # how to reach NATS (BusConfig)
//! servers = ["nats://127.0.0.1:4222"]
//! [worker]     # the runtime's tunables (WorkerSettings); absent keys keep the service's defaults
//! concurrency = 4
//! [telemetry]  # logs and the Prometheus endpoint (TelemetryConfig)
//! metrics_listen = "127.0.0.1:9464"
//! [service]    # the service's own settings
//! state_dir = "/var/lib/stagehand/ingest-validator"
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use stagehand_config::{key_at, line_of};
use stagehand_telemetry::TelemetryConfig;

use crate::config::{BusConfig, DEFAULT_SHUTDOWN_DEADLINE, WorkerConfig};
use crate::error::BusError;
use crate::retry::RetrySchedule;

/// A service's own settings: the `[service]` table. [`validate`](ServiceSettings::validate)
/// checks what serde cannot (ranges, paths that must be absolute, …).
pub trait ServiceSettings: DeserializeOwned + Send + 'static {
    /// Checks the settings; an error names the key within `[service]`.
    fn validate(&self) -> Result<(), InvalidKey> {
        Ok(())
    }

    /// This instance's name, when the service's own settings decide it (a node agent: one
    /// per node, several on one host in a test or a one-machine cluster). `None`: the host
    /// name. `[worker] instance_id`, when set, comes first.
    fn instance(&self) -> Option<String> {
        None
    }
}

/// A service with no `[service]` table of its own.
impl ServiceSettings for () {}

/// One invalid key of a table, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidKey {
    /// Dotted key path within the table, e.g. `read_concurrency`.
    pub key: String,
    pub message: String,
}

impl InvalidKey {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// The runtime's tunables, the `[worker]` table. Each key given replaces the value the service
/// chose (or the runtime's default) in every worker the service runs: the one precedence rule,
/// applied by `runner::Context::worker`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// Most messages handled at once.
    pub concurrency: Option<usize>,
    /// Failed attempts before an event is dead-lettered (waiting for a claim does not count).
    pub max_attempts: Option<u32>,
    /// The consumer's safety ceiling on deliveries of any kind; must exceed `max_attempts`.
    pub max_deliver: Option<i64>,
    /// This instance's stable id (default: host, service and a digest of the ledger path).
    pub instance_id: Option<String>,
    /// How long an unrenewed claim stays valid (`"60s"`; default 2 × `ack_wait`).
    #[serde(default, with = "stagehand_config::duration::option")]
    pub claim_lifetime: Option<Duration>,
    /// How long the ledger keeps an outcome (`"721h"`; default the requests stream's retention
    /// plus its duplicate window).
    #[serde(default, with = "stagehand_config::duration::option")]
    pub ledger_retention: Option<Duration>,
    /// How often the ledger is pruned (`"1h"`).
    #[serde(default, with = "stagehand_config::duration::option")]
    pub prune_interval: Option<Duration>,
    /// How long the server waits for an ack before redelivering (`"30s"`).
    #[serde(default, with = "stagehand_config::duration::option")]
    pub ack_wait: Option<Duration>,
    /// Delays of negative acks after retryable failures.
    pub retry: Option<RetrySchedule>,
    /// How long in-flight work may take to finish after shutdown is asked for (`"20s"`).
    #[serde(default, with = "stagehand_config::duration::option")]
    pub shutdown_deadline: Option<Duration>,
    /// Claim event ids before working (needed when several instances share a consumer).
    pub claims: Option<bool>,
    /// How long a pull request waits on the server before it is renewed (`"5s"`).
    #[serde(default, with = "stagehand_config::duration::option")]
    pub pull_expires: Option<Duration>,
}

impl WorkerSettings {
    /// `declared` — the runtime's defaults ([`WorkerConfig::new`]) with whatever the service
    /// chose written over them — with every key given here written over that, and the
    /// [drain deadline](WorkerSettings::drain_deadline) as its shutdown deadline: a worker on a
    /// consumer the service's instances share.
    pub fn worker(&self, declared: WorkerConfig) -> WorkerConfig {
        let mut cfg = declared;
        self.apply(&mut cfg);
        cfg.shutdown_deadline = self.drain_deadline();
        cfg
    }

    /// [`WorkerSettings::worker`] for a worker on a consumer of one instance's own, which
    /// sees every message and so never claims. `claims = true` cannot apply to it: refused,
    /// naming the key, `service` and the consumer.
    pub fn own_worker(
        &self,
        service: &str,
        declared: WorkerConfig,
    ) -> Result<WorkerConfig, BusError> {
        if self.claims == Some(true) {
            return Err(BusError::config(
                "worker.claims",
                format!(
                    "true cannot apply to the {service}'s worker on consumer {:?}: that \
                     consumer is this instance's own, sees every message and never claims; \
                     leave `claims` out",
                    declared.service
                ),
            ));
        }
        let mut cfg = self.worker(declared);
        cfg.claims = false;
        Ok(cfg)
    }

    /// Writes every key given into `cfg`.
    fn apply(&self, cfg: &mut WorkerConfig) {
        if let Some(v) = self.concurrency {
            cfg.concurrency = v;
        }
        if let Some(v) = self.max_attempts {
            cfg.max_attempts = v;
        }
        if let Some(v) = self.max_deliver {
            cfg.max_deliver = v;
        }
        if let Some(v) = &self.instance_id {
            cfg.instance_id = Some(v.clone());
        }
        if let Some(v) = self.claim_lifetime {
            cfg.claim_lifetime = Some(v);
        }
        if let Some(v) = self.ledger_retention {
            cfg.ledger_retention = v;
        }
        if let Some(v) = self.prune_interval {
            cfg.prune_interval = v;
        }
        if let Some(v) = self.ack_wait {
            cfg.ack_wait = v;
        }
        if let Some(v) = &self.retry {
            cfg.retry = v.clone();
        }
        if let Some(v) = self.shutdown_deadline {
            cfg.shutdown_deadline = v;
        }
        if let Some(v) = self.claims {
            cfg.claims = v;
        }
        if let Some(v) = self.pull_expires {
            cfg.pull_expires = v;
        }
    }

    /// The service's drain deadline: `shutdown_deadline` when given, else
    /// [`DEFAULT_SHUTDOWN_DEADLINE`]. Every worker of the service stops within it, and the
    /// runner waits that long (and a little more) for the service to return.
    pub fn drain_deadline(&self) -> Duration {
        self.shutdown_deadline.unwrap_or(DEFAULT_SHUTDOWN_DEADLINE)
    }

    /// Checks the values against what the runtime accepts, on a worker with every other
    /// setting at its default.
    fn validate(&self) -> Result<(), BusError> {
        let mut probe = WorkerConfig::new("probe", "STREAM", vec!["s.>".into()], "probe.redb");
        self.apply(&mut probe);
        probe.validate()
    }
}

/// A whole configuration file: `[bus]`, `[worker]`, `[telemetry]` and `[service]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig<S> {
    /// How to reach NATS.
    #[serde(default)]
    pub bus: BusConfig,
    /// The runtime's tunables.
    #[serde(default)]
    pub worker: WorkerSettings,
    /// Logs, traces and the metrics endpoint.
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// The service's own settings.
    pub service: S,
}

impl<S> ServiceConfig<S> {
    /// A configuration with `bus` and `service` and every other table at its defaults: for
    /// running a service in-process (tests, `stagehand up`).
    pub fn new(bus: BusConfig, service: S) -> Self {
        Self {
            bus,
            worker: WorkerSettings::default(),
            telemetry: TelemetryConfig::default(),
            service,
        }
    }

    /// [`ServiceConfig::new`] for the service `name` against `nats_url`, its connections
    /// named after it: what each service's `config(nats_url, …)` builds.
    pub fn in_process(name: &str, nats_url: &str, service: S) -> Self {
        Self::new(
            BusConfig {
                client_name: name.into(),
                ..BusConfig::new(nats_url)
            },
            service,
        )
    }
}

/// Why a configuration file could not be used. Permanent: the file must be fixed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("cannot read configuration file {}: {source}", file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}{}: `{key}`: {message}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: PathBuf,
        /// Dotted key path (`bus.replicas`, `service.state_dir`), or the environment variable
        /// whose value was refused.
        key: String,
        /// 1-based line of the key, where it is written in the file.
        line: Option<usize>,
        message: String,
    },
}

impl ConfigError {
    /// The dotted key concerned, for [`ConfigError::Invalid`].
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Read { .. } => None,
        }
    }

    /// The file concerned.
    pub fn file(&self) -> &Path {
        match self {
            ConfigError::Read { file, .. } | ConfigError::Invalid { file, .. } => file,
        }
    }
}

impl<S: ServiceSettings> ServiceConfig<S> {
    /// Reads and validates `file`, then applies the `STAGEHAND_NATS_*` environment overrides
    /// (see [`crate::env`](mod@crate::env)).
    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
            file: file.to_owned(),
            source,
        })?;
        Self::parse(file, &text, |name| std::env::var(name).ok())
    }

    /// Parses `text` (read from `file`) with environment variables read through `var`.
    pub fn parse(
        file: &Path,
        text: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let located = Located { file, text };
        let mut config: Self = toml::from_str(text).map_err(|err| {
            let (key, line) = match err.span() {
                Some(span) => key_at(text, span.start),
                None => (String::new(), None),
            };
            ConfigError::Invalid {
                file: file.to_owned(),
                key: if key.is_empty() {
                    "(top level)".to_owned()
                } else {
                    key
                },
                line,
                message: err.message().trim().to_owned(),
            }
        })?;
        config
            .bus
            .apply_env(&var)
            .map_err(|e| match e.config_key() {
                Some((key, reason)) => ConfigError::Invalid {
                    file: file.to_owned(),
                    key: key.to_owned(),
                    line: None,
                    message: reason.to_owned(),
                },
                None => located.invalid("bus", e.to_string()),
            })?;
        config.validate_in(&located)?;
        Ok(config)
    }

    fn validate_in(&self, at: &Located<'_>) -> Result<(), ConfigError> {
        let table = |table: &str, e: BusError| match e.config_key() {
            Some((key, reason)) => at.invalid(format!("{table}.{key}"), reason.to_owned()),
            None => at.invalid(table, e.to_string()),
        };
        self.bus.validate().map_err(|e| table("bus", e))?;
        self.worker.validate().map_err(|e| table("worker", e))?;
        self.telemetry
            .validate()
            .map_err(|e| at.invalid("telemetry.log_level", e.to_string()))?;
        self.service
            .validate()
            .map_err(|e| at.invalid(format!("service.{}", e.key), e.message))
    }
}

/// A file's text, to point errors at the line of a key.
struct Located<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Located<'_> {
    fn invalid(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        let key = key.into();
        ConfigError::Invalid {
            file: self.file.to_owned(),
            line: line_of(self.text, &key),
            key,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::Retryable;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Echo {
        /// Must be positive.
        width: u32,
    }

    impl ServiceSettings for Echo {
        fn validate(&self) -> Result<(), InvalidKey> {
            if self.width == 0 {
                return Err(InvalidKey::new("width", "must be positive"));
            }
            Ok(())
        }
    }

    fn parse(text: &str) -> Result<ServiceConfig<Echo>, ConfigError> {
        ServiceConfig::parse(Path::new("/etc/stagehand/echo.toml"), text, |_| None)
    }

    #[test]
    fn a_whole_file_parses_into_its_tables() {
        let c = parse(
            "[bus]\nservers = \"nats://a:1,nats://b:2\"\nreplicas = 3\n\n[worker]\nconcurrency = 4\nack_wait = \"45s\"\n\n[telemetry]\nlog_format = \"json\"\nmetrics_listen = \"127.0.0.1:9464\"\n\n[service]\nwidth = 7\n",
        )
        .unwrap();
        assert_eq!(c.bus.servers.len(), 2);
        assert_eq!(c.bus.replicas, Some(3));
        assert_eq!(c.worker.concurrency, Some(4));
        assert_eq!(c.worker.ack_wait, Some(Duration::from_secs(45)));
        assert_eq!(c.service, Echo { width: 7 });
        let mut w = WorkerConfig::new("echo", "S", vec!["s.>".into()], "x.redb");
        c.worker.apply(&mut w);
        assert_eq!((w.concurrency, w.ack_wait), (4, Duration::from_secs(45)));
        assert_eq!(
            w.max_deliver,
            WorkerConfig::new("e", "S", vec![], "x").max_deliver
        );
    }

    #[test]
    fn an_unknown_key_is_named_with_its_file_table_and_line() {
        let err =
            parse("[bus]\nservers = \"nats://a:1\"\ncolour = \"red\"\n[service]\nwidth = 1\n")
                .unwrap_err();
        assert_eq!(err.key(), Some("bus.colour"), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with("/etc/stagehand/echo.toml:3: `bus.colour`:"),
            "{text}"
        );
        assert!(text.contains("unknown field `colour`"), "{text}");

        let err = parse("[service]\nwidth = 1\nheight = 2\n").unwrap_err();
        assert_eq!(err.key(), Some("service.height"), "{err}");
        let err = parse("[service]\nwidth = 1\n[extras]\nx = 1\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `extras`"), "{err}");
    }

    #[test]
    fn invalid_values_are_named_by_table_and_key() {
        let err = parse("[bus]\nreplicas = 9\n[service]\nwidth = 1\n").unwrap_err();
        assert_eq!(err.key(), Some("bus.replicas"));
        assert!(err.to_string().contains(":2:"), "{err}");
        let err = parse("[worker]\nconcurrency = 0\n[service]\nwidth = 1\n").unwrap_err();
        assert_eq!(err.key(), Some("worker.concurrency"));
        let err = parse("[worker]\nack_wait = \"3 days\"\n[service]\nwidth = 1\n").unwrap_err();
        assert_eq!(err.key(), Some("worker.ack_wait"), "{err}");
        let err = parse("[telemetry]\nlog_level = \"info,[\"\n[service]\nwidth = 1\n").unwrap_err();
        assert_eq!(err.key(), Some("telemetry.log_level"), "{err}");
        let err = parse("[service]\nwidth = 0\n").unwrap_err();
        assert_eq!(err.key(), Some("service.width"));
        assert!(err.to_string().contains(":2:"), "{err}");
        let err = parse("[bus]\n").unwrap_err();
        assert!(err.to_string().contains("missing field `service`"), "{err}");
    }

    /// `[worker]` durations take the grammar policies use: `ack_wait = "1d"` was refused while
    /// a policy's `idle_after = "1d"` was accepted.
    #[test]
    fn worker_durations_read_the_grammar_policies_use() {
        let c = parse(
            "[worker]\nack_wait = \"1d\"\nledger_retention = \"5w\"\nclaim_lifetime = \"2 d\"\n[service]\nwidth = 1\n",
        )
        .unwrap();
        assert_eq!(c.worker.ack_wait, Some(Duration::from_secs(86_400)));
        assert_eq!(
            c.worker.ledger_retention,
            Some(Duration::from_secs(35 * 86_400))
        );
        assert_eq!(
            c.worker.claim_lifetime,
            Some(Duration::from_secs(2 * 86_400))
        );
        let err = parse("[worker]\nack_wait = \"30\"\n[service]\nwidth = 1\n").unwrap_err();
        assert_eq!(err.key(), Some("worker.ack_wait"), "{err}");
        assert!(err.to_string().contains("write \"30s\""), "{err}");
    }

    #[test]
    fn environment_overrides_apply_after_the_file_and_name_their_variable() {
        let c = ServiceConfig::<Echo>::parse(Path::new("x.toml"), "[service]\nwidth = 1\n", |k| {
            (k == crate::env::NATS_URL).then(|| "nats://u:p@a:1,nats://u:p@b:2".into())
        })
        .unwrap();
        assert_eq!(c.bus.servers.len(), 2);
        let err =
            ServiceConfig::<Echo>::parse(Path::new("x.toml"), "[service]\nwidth = 1\n", |k| {
                (k == crate::env::NATS_REPLICAS).then(|| "lots".into())
            })
            .unwrap_err();
        assert_eq!(err.key(), Some(crate::env::NATS_REPLICAS));
    }

    /// The one precedence rule: the runtime's default, then the service's own, then each
    /// key `[worker]` gives; the shutdown deadline is the drain deadline whatever the service
    /// declared.
    #[test]
    fn a_worker_is_the_services_defaults_then_the_worker_table() {
        let mut declared = WorkerConfig::new("svc", "S", vec!["s.>".into()], "x.redb");
        declared.concurrency = 16;
        declared.max_deliver = 50;
        declared.shutdown_deadline = Duration::from_secs(3);
        let none = WorkerSettings::default().worker(declared.clone());
        assert_eq!((none.concurrency, none.max_deliver), (16, 50));
        assert_eq!(
            none.max_attempts,
            WorkerConfig::new("e", "S", vec![], "x").max_attempts
        );
        assert_eq!(none.shutdown_deadline, DEFAULT_SHUTDOWN_DEADLINE);

        let table = WorkerSettings {
            concurrency: Some(4),
            claims: Some(false),
            shutdown_deadline: Some(Duration::from_secs(7)),
            ..WorkerSettings::default()
        };
        let given = table.worker(declared);
        assert_eq!((given.concurrency, given.max_deliver), (4, 50));
        assert!(!given.claims);
        assert_eq!(given.shutdown_deadline, Duration::from_secs(7));
        assert_eq!(table.drain_deadline(), Duration::from_secs(7));
    }

    /// A worker on an instance's own consumer never claims, and `claims = true` is refused
    /// with the key and the consumer named, not ignored.
    #[test]
    fn claims_cannot_be_asked_of_a_worker_on_its_own_consumer() {
        let declared = WorkerConfig::new("svc-facts-a", "S", vec!["s.>".into()], "x.redb");
        let own = WorkerSettings::default()
            .own_worker("svc", declared.clone())
            .unwrap();
        assert!(!own.claims);
        let off = WorkerSettings {
            claims: Some(false),
            ..WorkerSettings::default()
        };
        assert!(!off.own_worker("svc", declared.clone()).unwrap().claims);
        let on = WorkerSettings {
            claims: Some(true),
            ..WorkerSettings::default()
        };
        let err = on.own_worker("svc", declared.clone()).unwrap_err();
        assert_eq!(err.config_key().map(|(k, _)| k), Some("worker.claims"));
        assert!(err.to_string().contains("svc-facts-a"), "{err}");
        assert!(!err.is_retryable());
        assert!(
            on.worker(declared).claims,
            "a shared consumer's worker claims"
        );
    }
}
