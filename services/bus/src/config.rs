//! Configuration of the connection and of a worker, with defaults and validation.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::BusError;
use crate::retry::RetrySchedule;

/// How to reach NATS: the `[bus]` table of every service's configuration file.
///
/// Secrets never appear in logs: `Debug` and [`BusConfig::servers_display`] show a URL's
/// password as `***` (see [`redact_url`]). Prefer a credentials or NKey seed file to a password
/// in the URL.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// Server URLs, e.g. `["nats://n1:4222", "nats://n2:4222"]`; a single string may list
    /// several separated by commas. The client picks one and fails over to the others.
    #[serde(deserialize_with = "server_list::deserialize")]
    pub servers: Vec<String>,
    /// A `.creds` file (user JWT and NKey seed) for this service's NATS user.
    pub creds_file: Option<PathBuf>,
    /// A file holding an NKey seed (`SU...`) for this service's NATS user.
    pub nkey_seed_file: Option<PathBuf>,
    /// A file holding the password of the user the server URLs name without one
    /// (`nats://scheduler@host:4222`): the password is then on no command line, in no
    /// environment and in no configuration file. Refused when group or others may read it.
    pub password_file: Option<PathBuf>,
    /// A PEM file of CA certificates to trust for the server's TLS certificate.
    pub tls_ca: Option<PathBuf>,
    /// A PEM client certificate, for servers that verify clients (with `tls_client_key`).
    pub tls_client_cert: Option<PathBuf>,
    /// The PEM private key of `tls_client_cert`.
    pub tls_client_key: Option<PathBuf>,
    /// Refuse to talk to a server without TLS.
    pub tls_required: bool,
    /// The connection name servers show in monitoring (`connz`).
    pub client_name: String,
    /// The subject prefix of this connection's reply inboxes. Default: `_INBOX_<user>` when the
    /// URL names a user (each user of `deploy/nats/accounts.conf` may read only its own
    /// inboxes), else `_INBOX`. Set it for users authenticated by creds or NKey.
    pub inbox_prefix: Option<String>,
    /// Replicas of each stream and KV bucket Stagehand declares. Default: what the cluster
    /// can hold, min(3, servers in the cluster), learned from the server at connect (1 for a
    /// server that is not clustered).
    pub replicas: Option<usize>,
    /// Create streams and buckets, and correct their drift. With `false` (a service whose
    /// user may not manage streams) they are only checked; an operator provisions them with
    /// `stagehand provision`.
    pub provision: bool,
    /// How long to keep trying the first connection before giving up.
    #[serde(with = "stagehand_config::duration")]
    pub connect_timeout: Duration,
    /// How long a publish keeps trying while the stream cannot answer — no responders, no
    /// stream found on a clustered server, no acknowledgement in time: what a JetStream leader
    /// election looks like — before it gives up with one error. Default 60 s; a worker's
    /// outcomes use its `ack_wait` instead (the delivery's own deadline).
    #[serde(with = "stagehand_config::duration")]
    pub publish_timeout: Duration,
}

/// How long a publish rides out a stream that cannot answer unless configured otherwise
/// ([`BusConfig::publish_timeout`]): several times the 8 s a three-node cluster took here to
/// elect a new leader after losing one.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            servers: vec!["nats://127.0.0.1:4222".into()],
            creds_file: None,
            nkey_seed_file: None,
            password_file: None,
            tls_ca: None,
            tls_client_cert: None,
            tls_client_key: None,
            tls_required: false,
            client_name: "stagehand".into(),
            inbox_prefix: None,
            replicas: None,
            provision: true,
            connect_timeout: Duration::from_secs(30),
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
        }
    }
}

impl std::fmt::Debug for BusConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusConfig")
            .field("servers", &self.servers_display())
            .field("creds_file", &self.creds_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("password_file", &self.password_file)
            .field("tls_ca", &self.tls_ca)
            .field("tls_client_cert", &self.tls_client_cert)
            .field("tls_client_key", &self.tls_client_key)
            .field("tls_required", &self.tls_required)
            .field("client_name", &self.client_name)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("replicas", &self.replicas)
            .field("provision", &self.provision)
            .field("connect_timeout", &self.connect_timeout)
            .field("publish_timeout", &self.publish_timeout)
            .finish()
    }
}

/// The servers (passwords redacted) and the connection name: what a log line says of a
/// connection.
impl std::fmt::Display for BusConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} as {}", self.servers_display(), self.client_name)
    }
}

/// The environment variables that override the `[bus]` table, one naming scheme for every
/// binary: services (through the runner) and the `stagehand` CLI.
pub mod env {
    /// Server URL(s), comma separated.
    pub const NATS_URL: &str = "STAGEHAND_NATS_URL";
    /// A `.creds` file.
    pub const NATS_CREDS: &str = "STAGEHAND_NATS_CREDS";
    /// An NKey seed file.
    pub const NATS_NKEY: &str = "STAGEHAND_NATS_NKEY";
    /// A file holding the password of the user the URL names.
    pub const NATS_PASSWORD_FILE: &str = "STAGEHAND_NATS_PASSWORD_FILE";
    /// A CA bundle for the servers' TLS certificates.
    pub const NATS_TLS_CA: &str = "STAGEHAND_NATS_TLS_CA";
    /// Stream and bucket replicas.
    pub const NATS_REPLICAS: &str = "STAGEHAND_NATS_REPLICAS";
    /// Every variable above, for documentation and tests.
    pub const ALL: &[&str] = &[
        NATS_URL,
        NATS_CREDS,
        NATS_NKEY,
        NATS_PASSWORD_FILE,
        NATS_TLS_CA,
        NATS_REPLICAS,
    ];
}

impl BusConfig {
    /// A default configuration for `servers`: one URL or several separated by commas.
    pub fn new(servers: impl AsRef<str>) -> Self {
        Self {
            servers: split_servers(servers.as_ref()),
            ..Self::default()
        }
    }

    /// The server URLs with passwords replaced by `***`, comma separated: what logs and
    /// messages show.
    pub fn servers_display(&self) -> String {
        self.servers
            .iter()
            .map(|s| redact_url(s))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Applies the environment overrides of [`env`](mod@env), reading variables through `var` (so that
    /// tests need not touch the process environment). A value that does not parse is an error
    /// naming the variable.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), BusError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = set(env::NATS_URL) {
            self.servers = split_servers(&v);
        }
        if let Some(v) = set(env::NATS_CREDS) {
            self.creds_file = Some(v.into());
        }
        if let Some(v) = set(env::NATS_NKEY) {
            self.nkey_seed_file = Some(v.into());
        }
        if let Some(v) = set(env::NATS_PASSWORD_FILE) {
            self.password_file = Some(v.into());
        }
        if let Some(v) = set(env::NATS_TLS_CA) {
            self.tls_ca = Some(v.into());
        }
        if let Some(v) = set(env::NATS_REPLICAS) {
            let n = v.trim().parse().map_err(|_| {
                BusError::config(
                    env::NATS_REPLICAS,
                    format!("{v:?} is not a number of replicas"),
                )
            })?;
            self.replicas = Some(n);
        }
        Ok(())
    }

    /// Checks the values before anything connects; errors name the key.
    pub fn validate(&self) -> Result<(), BusError> {
        let bad = |key: &str, reason: String| Err(BusError::config(key, reason));
        if self.servers.is_empty() {
            return bad("servers", "must list at least one server URL".into());
        }
        for s in &self.servers {
            if s.parse::<async_nats::ServerAddr>().is_err() {
                return bad(
                    "servers",
                    format!("{:?} is not a NATS server URL", redact_url(s)),
                );
            }
        }
        if let Some(n) = self.replicas
            && !(1..=5).contains(&n)
        {
            return bad("replicas", format!("{n} is not in 1..=5"));
        }
        if self.creds_file.is_some() && self.nkey_seed_file.is_some() {
            return bad(
                "nkey_seed_file",
                "give either creds_file or nkey_seed_file, not both".into(),
            );
        }
        if self.password_file.is_some() {
            if self.creds_file.is_some() || self.nkey_seed_file.is_some() {
                return bad(
                    "password_file",
                    "give one of creds_file, nkey_seed_file and password_file".into(),
                );
            }
            if self.servers.iter().any(|s| {
                url_credentials(s).is_some_and(|c| matches!(c, UrlCredentials::UserPassword(..)))
            }) {
                return bad(
                    "password_file",
                    "the server URLs carry a password too: name only the user (nats://<user>@host:4222)".into(),
                );
            }
            if self.user().is_none() {
                return bad(
                    "password_file",
                    "no server URL names the user whose password it holds (nats://<user>@host:4222)".into(),
                );
            }
        }
        if self.tls_client_cert.is_some() != self.tls_client_key.is_some() {
            return bad(
                "tls_client_key",
                "tls_client_cert and tls_client_key go together".into(),
            );
        }
        if let Some(prefix) = &self.inbox_prefix
            && (prefix.is_empty()
                || prefix.contains(['*', '>', ' '])
                || prefix.starts_with('.')
                || prefix.ends_with('.'))
        {
            return bad(
                "inbox_prefix",
                format!("{prefix:?} is not a subject prefix without wildcards"),
            );
        }
        Ok(())
    }

    /// The inbox prefix this connection uses: the configured one, else `_INBOX_<user>` for a
    /// URL that names a user, else `_INBOX`.
    pub fn effective_inbox_prefix(&self) -> String {
        if let Some(p) = &self.inbox_prefix {
            return p.clone();
        }
        match self.user() {
            Some(user) => format!("_INBOX_{user}"),
            None => "_INBOX".into(),
        }
    }

    /// The user the server URLs name: `nats://user:password@host`, or `nats://user@host`
    /// with a [`password_file`](Self::password_file) (without one, a bare name there is a
    /// token, not a user).
    pub fn user(&self) -> Option<String> {
        self.servers.iter().find_map(|s| {
            let userinfo = url_userinfo(s)?;
            match userinfo.split_once(':') {
                Some((user, _)) if !user.is_empty() => Some(percent_decode(user)),
                None if self.password_file.is_some() && !userinfo.is_empty() => {
                    Some(percent_decode(userinfo))
                }
                _ => None,
            }
        })
    }
}

/// Splits a comma-separated server list, dropping empty entries and surrounding spaces.
pub fn split_servers(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `servers` in a file: a list of URLs, or one string of comma-separated URLs.
mod server_list {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        Ok(match OneOrMany::deserialize(d)? {
            OneOrMany::One(s) => super::split_servers(&s),
            OneOrMany::Many(v) => v.iter().flat_map(|s| super::split_servers(s)).collect(),
        })
    }
}

/// Credentials a URL carries: `nats://user:password@host` gives the user and the password,
/// `nats://token@host` a token (percent-decoded). async-nats does not read them from the URL
/// itself, so [`crate::Bus::connect`] passes them on.
pub(crate) fn url_credentials(url: &str) -> Option<UrlCredentials> {
    let userinfo = url_userinfo(url)?;
    Some(match userinfo.split_once(':') {
        Some((user, password)) => {
            UrlCredentials::UserPassword(percent_decode(user), percent_decode(password))
        }
        None => UrlCredentials::Token(percent_decode(userinfo)),
    })
}

/// `url` without its userinfo (`nats://user:pass@host:4222` → `nats://host:4222`): what is
/// handed to the client library, so that none of its own logs can carry a secret.
pub(crate) fn without_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://{host}{}", &rest[end..]),
        None => url.to_owned(),
    }
}

/// What the userinfo of a server URL holds.
pub(crate) enum UrlCredentials {
    UserPassword(String, String),
    Token(String),
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = text.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The userinfo of a URL (`user:pass` of `nats://user:pass@host`), if any.
fn url_userinfo(url: &str) -> Option<&str> {
    let (_, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    authority.rsplit_once('@').map(|(userinfo, _)| userinfo)
}

/// A URL with its secret replaced: `nats://user:pass@host` → `nats://user:***@host`, and a
/// token (`nats://token@host`) → `nats://***@host`. Anything else is returned unchanged.
pub fn redact_url(url: &str) -> String {
    redact_text(url)
}

/// Every URL inside `text` with its secret replaced as [`redact_url`] does: for error
/// messages that may quote a URL.
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c == '/' || c == '?' || c == '#' || c == ',' || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rsplit_once('@') {
            Some((userinfo, host)) => {
                match userinfo.split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str("***"),
                }
                out.push('@');
                out.push_str(host);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// How long a service's in-flight work may take to finish after shutdown is asked for, unless
/// `[worker] shutdown_deadline` says otherwise: every worker's deadline and the service
/// runner's drain deadline (`runner::Context::drain_deadline`).
pub const DEFAULT_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(20);

/// One worker: which consumer it is, where its ledger lives, and how it paces work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// The service name: the durable consumer's name and the dead-letter subject's last token.
    pub service: String,
    /// The stream consumed, e.g. `STAGEHAND_REQUESTS`.
    pub stream: String,
    /// Subjects of that stream this service consumes, e.g. `stagehand.req.ingest.requested.*`.
    pub filter_subjects: Vec<String>,
    /// The service's redb file (ledger).
    pub ledger_path: PathBuf,
    /// This instance's stable identity: an instance restarting under the same id takes over
    /// its own claims at once instead of waiting for them to expire. Default: host name,
    /// service and a digest of `ledger_path` (see `default_instance_id`). Two processes must
    /// never share one; a worker that finds its id registered by another process stops.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// Most messages handled at once; the worker pulls only as many as it has free slots.
    #[serde(default = "defaults::concurrency")]
    pub concurrency: usize,
    /// Failed attempts (handler errors, and ledger, claim or publish failures) before an
    /// event is dead-lettered. Waiting for another instance's claim does not count.
    #[serde(default = "defaults::max_attempts")]
    pub max_attempts: u32,
    /// The consumer's `max_deliver`: a high safety ceiling on deliveries of any kind. At this
    /// delivery the runtime dead-letters without running the handler. Must exceed
    /// `max_attempts`.
    #[serde(default = "defaults::max_deliver")]
    pub max_deliver: i64,
    /// How long the server waits for an ack before redelivering; progress acks restart it.
    #[serde(default = "defaults::ack_wait", with = "stagehand_config::duration")]
    pub ack_wait: Duration,
    /// How long a claim not renewed stays valid before another instance may take it over
    /// (judged by the server's clock). Default: 2 × `ack_wait`.
    #[serde(default, with = "stagehand_config::duration::option")]
    pub claim_lifetime: Option<Duration>,
    /// Delays of negative acks after retryable failures.
    #[serde(default)]
    pub retry: RetrySchedule,
    /// After shutdown is asked for, how long in-flight work may take to finish and be recorded.
    #[serde(
        default = "defaults::shutdown_deadline",
        with = "stagehand_config::duration"
    )]
    pub shutdown_deadline: Duration,
    /// Claim each event in the `stagehand_claims` KV bucket before working on it, so that two
    /// instances never do the same work (needed when several instances share a consumer).
    #[serde(default = "defaults::claims")]
    pub claims: bool,
    /// How long a pull request waits on the server for messages before it is renewed.
    #[serde(
        default = "defaults::pull_expires",
        with = "stagehand_config::duration"
    )]
    pub pull_expires: Duration,
    /// How long the ledger keeps an outcome: past the requests stream's retention plus its
    /// duplicate window, no copy of the event can still arrive within either.
    #[serde(
        default = "defaults::ledger_retention",
        with = "stagehand_config::duration"
    )]
    pub ledger_retention: Duration,
    /// How often the ledger is pruned of outcomes older than `ledger_retention`.
    #[serde(
        default = "defaults::prune_interval",
        with = "stagehand_config::duration"
    )]
    pub prune_interval: Duration,
}

mod defaults {
    use std::time::Duration;
    pub fn concurrency() -> usize {
        32
    }
    pub fn max_attempts() -> u32 {
        8
    }
    pub fn max_deliver() -> i64 {
        1000
    }
    pub fn ack_wait() -> Duration {
        Duration::from_secs(30)
    }
    pub fn shutdown_deadline() -> Duration {
        super::DEFAULT_SHUTDOWN_DEADLINE
    }
    pub fn claims() -> bool {
        true
    }
    pub fn pull_expires() -> Duration {
        Duration::from_secs(5)
    }
    pub fn ledger_retention() -> Duration {
        let requests = stagehand_schemas::subject::REQUESTS;
        requests.max_age + requests.duplicate_window
    }
    pub fn prune_interval() -> Duration {
        Duration::from_secs(3600)
    }
}

impl WorkerConfig {
    /// A configuration with every tunable at its default.
    pub fn new(
        service: impl Into<String>,
        stream: impl Into<String>,
        filter_subjects: Vec<String>,
        ledger_path: impl Into<PathBuf>,
    ) -> Self {
        Self {
            service: service.into(),
            stream: stream.into(),
            filter_subjects,
            ledger_path: ledger_path.into(),
            instance_id: None,
            concurrency: defaults::concurrency(),
            max_attempts: defaults::max_attempts(),
            max_deliver: defaults::max_deliver(),
            ack_wait: defaults::ack_wait(),
            claim_lifetime: None,
            retry: RetrySchedule::default(),
            shutdown_deadline: defaults::shutdown_deadline(),
            claims: defaults::claims(),
            pull_expires: defaults::pull_expires(),
            ledger_retention: defaults::ledger_retention(),
            prune_interval: defaults::prune_interval(),
        }
    }

    /// How long a claim not renewed stays valid: `claim_lifetime`, or 2 × `ack_wait`.
    pub fn claim_lifetime(&self) -> Duration {
        self.claim_lifetime.unwrap_or(self.ack_wait * 2)
    }

    /// Checks the values against what the runtime and the server accept.
    pub fn validate(&self) -> Result<(), BusError> {
        let bad = |key, reason: String| Err(BusError::config(key, reason));
        if !stagehand_schemas::subject::is_subject_token(&self.service) {
            return bad(
                "service",
                format!("{:?} must be 1-64 characters of [a-z0-9_-]", self.service),
            );
        }
        if self.stream.is_empty() {
            return bad("stream", "must name a stream".into());
        }
        if self.filter_subjects.is_empty() {
            return bad("filter_subjects", "must list at least one subject".into());
        }
        if self
            .instance_id
            .as_ref()
            .is_some_and(|id| id.is_empty() || id.len() > 256)
        {
            return bad("instance_id", "must be 1-256 characters".into());
        }
        if self.concurrency == 0 || self.concurrency > 10_000 {
            return bad(
                "concurrency",
                format!("{} is not in 1..=10000", self.concurrency),
            );
        }
        let kept = crate::ledger::MAX_ATTEMPTS_KEPT;
        if self.max_attempts < 1 || self.max_attempts as usize > kept {
            return bad(
                "max_attempts",
                format!("{} is not in 1..={kept}", self.max_attempts),
            );
        }
        if self.max_deliver <= i64::from(self.max_attempts) {
            return bad(
                "max_deliver",
                format!(
                    "{} must exceed max_attempts ({}): it is the ceiling on deliveries that did not count as attempts",
                    self.max_deliver, self.max_attempts
                ),
            );
        }
        if self.ack_wait < Duration::from_secs(1) {
            return bad(
                "ack_wait",
                format!("{:?} is under one second", self.ack_wait),
            );
        }
        if self.claim_lifetime() < self.ack_wait {
            return bad(
                "claim_lifetime",
                format!(
                    "{:?} is under ack_wait ({:?}): a claim must outlive the redelivery of its message",
                    self.claim_lifetime(),
                    self.ack_wait
                ),
            );
        }
        if self.pull_expires < Duration::from_millis(100) {
            return bad(
                "pull_expires",
                format!("{:?} is under 100ms", self.pull_expires),
            );
        }
        if self.prune_interval < Duration::from_millis(100) {
            return bad(
                "prune_interval",
                format!("{:?} is under 100ms", self.prune_interval),
            );
        }
        let factor_ok = self.retry.factor.is_finite() && self.retry.factor >= 1.0;
        if !factor_ok || !(0.0..=1.0).contains(&self.retry.jitter) {
            return bad(
                "retry",
                "factor must be >= 1 and jitter within 0..=1".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_config_rejects_bad_values_by_key() {
        let mut c = WorkerConfig::new("ingest-validator", "S", vec!["a.*".into()], "/tmp/x.redb");
        c.validate().unwrap();
        c.concurrency = 0;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("concurrency")
        );
        c.concurrency = 4;
        c.service = "Bad Name".into();
        assert!(c.validate().unwrap_err().to_string().contains("service"));
    }

    #[test]
    fn unknown_config_keys_are_refused() {
        let err = toml_like_json(r#"{"servers":"nats://x:4222","colour":"red"}"#);
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn passwords_never_show_in_debug_display_or_errors() {
        let cfg = BusConfig::new("nats://svc:s3cret@n1:4222, nats://tok3n@n2:4222,nats://n3:4222");
        assert_eq!(cfg.servers.len(), 3);
        let shown = format!("{cfg:?} {cfg} {}", cfg.servers_display());
        assert!(
            !shown.contains("s3cret") && !shown.contains("tok3n"),
            "{shown}"
        );
        assert!(shown.contains("nats://svc:***@n1:4222"), "{shown}");
        assert!(shown.contains("nats://***@n2:4222"), "{shown}");
        assert!(shown.contains("nats://n3:4222"), "{shown}");
        assert_eq!(
            redact_text("failed: nats://a:b@h:1/x and tls://c:d@e:2"),
            "failed: nats://a:***@h:1/x and tls://c:***@e:2"
        );
        let mut bad = cfg.clone();
        bad.servers = vec!["nats://svc:s3cret@".into(), "not a url at all".into()];
        let err = bad.validate().map(|_| ()).unwrap_err().to_string();
        assert!(!err.contains("s3cret"), "{err}");
    }

    #[test]
    fn server_lists_parse_from_a_string_or_a_list() {
        let one: BusConfig =
            serde_json::from_str(r#"{"servers":"nats://a:1,nats://b:2"}"#).unwrap();
        let many: BusConfig =
            serde_json::from_str(r#"{"servers":["nats://a:1","nats://b:2"]}"#).unwrap();
        assert_eq!(one.servers, vec!["nats://a:1", "nats://b:2"]);
        assert_eq!(one.servers, many.servers);
        one.validate().unwrap();
    }

    #[test]
    fn environment_overrides_use_one_naming_scheme() {
        let mut cfg = BusConfig::default();
        let vars = [
            (env::NATS_URL, "nats://u:p@a:1,nats://u:p@b:2"),
            (env::NATS_CREDS, "/etc/stagehand/svc.creds"),
            (env::NATS_REPLICAS, "3"),
        ];
        cfg.apply_env(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
        .unwrap();
        assert_eq!(cfg.servers.len(), 2);
        assert_eq!(
            cfg.creds_file.as_deref(),
            Some(std::path::Path::new("/etc/stagehand/svc.creds"))
        );
        assert_eq!(cfg.replicas, Some(3));
        assert_eq!(cfg.effective_inbox_prefix(), "_INBOX_u");
        let err = cfg
            .apply_env(|k| (k == env::NATS_REPLICAS).then(|| "three".to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains(env::NATS_REPLICAS), "{err}");
    }

    #[test]
    fn credentials_come_out_of_the_url_decoded() {
        match url_credentials("nats://svc%2Done:p%40ss@h:1") {
            Some(UrlCredentials::UserPassword(u, p)) => {
                assert_eq!((u.as_str(), p.as_str()), ("svc-one", "p@ss"))
            }
            _ => panic!("user and password"),
        }
        assert!(
            matches!(url_credentials("nats://t0k@h:1"), Some(UrlCredentials::Token(t)) if t == "t0k")
        );
        assert!(url_credentials("nats://h:1").is_none());
        assert_eq!(without_credentials("nats://u:p@h:1"), "nats://h:1");
        assert_eq!(without_credentials("tls://t@h:1/x"), "tls://h:1/x");
        assert_eq!(without_credentials("nats://h:1"), "nats://h:1");
    }

    #[test]
    fn inbox_prefix_follows_the_user_unless_set() {
        assert_eq!(
            BusConfig::new("nats://h:1").effective_inbox_prefix(),
            "_INBOX"
        );
        let mut cfg = BusConfig::new("nats://uploader-demo:pw@h:1");
        assert_eq!(cfg.effective_inbox_prefix(), "_INBOX_uploader-demo");
        cfg.inbox_prefix = Some("_INBOX_lab".into());
        assert_eq!(cfg.effective_inbox_prefix(), "_INBOX_lab");
        cfg.inbox_prefix = Some("_INBOX.>".into());
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("inbox_prefix")
        );
    }

    fn toml_like_json(text: &str) -> String {
        serde_json::from_str::<BusConfig>(text)
            .unwrap_err()
            .to_string()
    }
}
