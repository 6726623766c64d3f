//! The connection: connect with retries, provision streams and the claims bucket, publish
//! events with their id, scoped by subject, as `Nats-Msg-Id` and the current trace context.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv, object_store, stream};
use backon::Retryable;
use bytes::Bytes;
use stagehand_schemas::subject::{
    MANIFESTS, ObjectBucketSpec, Retention, STREAMS, StreamSpec, subject_for,
};
use stagehand_schemas::{Event, wire};
use tracing::{debug, error, info, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::config::{BusConfig, UrlCredentials, redact_text, url_credentials, without_credentials};
use crate::dedup::scope_msg_id;
use crate::error::{BoxError, BusError, BusErrorKind};
use crate::retry::RetrySchedule;

/// The KV bucket in which workers claim event ids (see the crate docs, "Claims").
pub const CLAIMS_BUCKET: &str = "stagehand_claims";

/// How long claim and completion markers are kept in [`CLAIMS_BUCKET`].
pub const CLAIMS_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// The header JetStream deduplicates on.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// What the server said about a published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishAck {
    pub stream: String,
    pub sequence: u64,
    /// The id was already stored within the duplicate window and the stored message is this
    /// one (same subject, same event id); this copy was dropped. A message id found taken by
    /// another message is published again under a fresh one, and that PubAck is returned.
    pub duplicate: bool,
    /// How many times the message was sent before this answer (1 unless the stream could not
    /// answer at first, see [`BusConfig::publish_timeout`](crate::BusConfig)). A duplicate
    /// after more than one try may be this publish's own earlier try, stored although its
    /// acknowledgement was lost.
    pub tries: u32,
}

/// A KV bucket Stagehand declares: provisioned, and its drift corrected, like a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSpec {
    /// The bucket name (its stream is `KV_<bucket>`).
    pub bucket: &'static str,
    /// What the bucket holds, shown in `nats kv ls`.
    pub description: &'static str,
    /// Values kept per key.
    pub history: i64,
    /// How long an entry is kept (zero: for ever).
    pub max_age: Duration,
}

/// The claims bucket every worker claims event ids in.
pub const CLAIMS: KvSpec = KvSpec {
    bucket: CLAIMS_BUCKET,
    description: "Stagehand workers' claims on event ids",
    history: 1,
    max_age: CLAIMS_MAX_AGE,
};

/// The readiness bucket the catalogue recorder mirrors and schedulers read.
pub const READINESS_BUCKET: &str = "stagehand_readiness";

/// The readiness bucket: per (dataset version, tier) state, a few values of history.
pub const READINESS: KvSpec = KvSpec {
    bucket: READINESS_BUCKET,
    description: "Stagehand readiness per (dataset version, tier)",
    history: 5,
    max_age: Duration::ZERO,
};

/// The stage status bucket: one key per stage request (`<project>.<hex(request id)>`), written
/// by the catalogue recorder, watched by `stagehand stage wait`.
pub const STAGES_BUCKET: &str = "stagehand_stages";

/// The stage status bucket's declaration.
pub const STAGES: KvSpec = KvSpec {
    bucket: STAGES_BUCKET,
    description: "Stagehand: the status of each stage request, by request id",
    history: 5,
    max_age: Duration::ZERO,
};

/// The heartbeat bucket: one key per running service instance (`<service>.<instance>`),
/// written by the service runner (`runner::heartbeat`), read by `stagehand status`.
pub const HEARTBEATS_BUCKET: &str = "stagehand_heartbeats";

/// The heartbeat bucket's declaration. An instance that stopped beating a week ago is
/// forgotten: long enough for on-call to see it silent, short enough that a retired host does
/// not haunt the view for ever.
pub const HEARTBEATS: KvSpec = KvSpec {
    bucket: HEARTBEATS_BUCKET,
    description: "Stagehand: each service instance's heartbeat (version, host, start, progress)",
    history: 1,
    max_age: Duration::from_secs(7 * 24 * 3600),
};

/// Every KV bucket Stagehand declares, provisioned by [`Bus::provision`].
pub const KV_BUCKETS: &[KvSpec] = &[CLAIMS, READINESS, STAGES, HEARTBEATS];

/// The promoter's coordination bucket: space reserved per bounded tier (`quota.<tier>[.<node>]`)
/// and copy leases (`copy.<tier>[.<node>].<hash of prefix>`), shared by promoter instances.
pub const PROMOTER_BUCKET: &str = "stagehand_promoter";

/// The promoter's coordination bucket's declaration.
pub const PROMOTER: KvSpec = KvSpec {
    bucket: PROMOTER_BUCKET,
    description: "Stagehand promoter: space reserved per bounded tier, copy leases",
    history: 1,
    max_age: Duration::ZERO,
};

/// The node agents' fan-out board: per version being staged onto a node-local tier by
/// several nodes, who reads which piece from the shared tier (`swarm.<swarm>.claim.<piece>`),
/// which node holds which piece verified (`swarm.<swarm>.have.<piece>.<node>`) and which node
/// served bytes that did not verify, and to whom (`swarm.<swarm>.bad.<node>.<by>`). Written by
/// the promoter's node agents only (`services/promoter/src/fanout`).
pub const SWARMS_BUCKET: &str = "stagehand_swarms";

/// The fan-out board's declaration. A swarm lives as long as its copies: a day outlasts any
/// stage, and a board nobody cleaned up (every member killed) is gone by itself.
pub const SWARMS: KvSpec = KvSpec {
    bucket: SWARMS_BUCKET,
    description: "Stagehand node agents: who reads, holds and spoiled which piece of a version fanned out to nodes",
    history: 1,
    max_age: Duration::from_secs(24 * 3600),
};

/// KV buckets that belong to one service: created by `stagehand provision` (the operator) and
/// by that service when it provisions, never by [`Bus::provision`], because other services'
/// users have no right even to look them up (`deploy/nats/accounts.conf`).
pub const SERVICE_KV_BUCKETS: &[KvSpec] = &[PROMOTER, SWARMS];

/// The Object Store buckets [`Bus::provision`] declares: the services' manifest bucket. Each
/// project's upload bucket is created by [`Bus::provision_object_bucket`] with
/// `stagehand_schemas::subject::upload_bucket_spec(project)` (`stagehand provision --project`),
/// or by an uploader's first upload where its user may create streams.
pub const OBJECT_BUCKETS: &[ObjectBucketSpec] = &[MANIFESTS];

/// Longest wait for a new or re-replicated stream to have a leader and current replicas.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest a provisioning step is tried again while JetStream cannot answer (see
/// [`through_elections`]): a cluster that lost a node elects a new meta leader in seconds,
/// longer on a loaded machine.
const ELECTION_BUDGET: Duration = Duration::from_secs(60);

/// How many permission violations a connection remembers (see [`Bus::permission_violations`]).
const VIOLATIONS_KEPT: usize = 16;

/// Runs a provisioning step again while it fails because JetStream cannot answer for now
/// ([`passes_by_itself`]), for at most [`ELECTION_BUDGET`]. A service that starts while a
/// cluster node is down would otherwise exit on the first API request sent during the
/// election of a new meta leader; any other failure (a refusal, a conflict) returns at once.
async fn through_elections<T, F, Fut>(step: F) -> Result<T, BusError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BusError>>,
{
    step.retry(
        RetrySchedule::exponential(Duration::from_millis(200), Duration::from_secs(5))
            .delays()
            .within(ELECTION_BUDGET),
    )
    .when(|e| passes_by_itself(e))
    .notify(|e, delay| warn!(error = %e, ?delay, "JetStream did not answer; provisioning again"))
    .await
}

/// Whether an error (or one of its causes) is JetStream not answering for now: an API request
/// that timed out or found no responder, or a server answering 503 (JetStream temporarily
/// unavailable) — what a cluster electing a leader looks like to a client.
fn passes_by_itself(e: &(dyn std::error::Error + 'static)) -> bool {
    use jetstream::context::{
        CreateKeyValueError, CreateKeyValueErrorKind, CreateStreamError, CreateStreamErrorKind,
        GetStreamError, GetStreamErrorKind, RequestError, RequestErrorKind, UpdateKeyValueError,
        UpdateKeyValueErrorKind,
    };
    let unavailable = |js: &jetstream::Error| js.code() == 503;
    let mut cause = Some(e);
    while let Some(e) = cause {
        let passes = if let Some(r) = e.downcast_ref::<RequestError>() {
            matches!(
                r.kind(),
                RequestErrorKind::TimedOut | RequestErrorKind::NoResponders
            )
        } else if let Some(r) = e.downcast_ref::<async_nats::RequestError>() {
            matches!(
                r.kind(),
                async_nats::RequestErrorKind::TimedOut | async_nats::RequestErrorKind::NoResponders
            )
        } else if let Some(r) = e.downcast_ref::<GetStreamError>() {
            match r.kind() {
                GetStreamErrorKind::Request => true,
                GetStreamErrorKind::JetStream(js) => unavailable(&js),
                _ => false,
            }
        } else if let Some(r) = e.downcast_ref::<CreateStreamError>() {
            match r.kind() {
                CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => {
                    true
                }
                CreateStreamErrorKind::JetStream(js) => unavailable(&js),
                _ => false,
            }
        } else if let Some(r) = e.downcast_ref::<CreateKeyValueError>() {
            r.kind() == CreateKeyValueErrorKind::TimedOut
        } else if let Some(r) = e.downcast_ref::<UpdateKeyValueError>() {
            r.kind() == UpdateKeyValueErrorKind::TimedOut
        } else if let Some(js) = e.downcast_ref::<jetstream::Error>() {
            unavailable(js)
        } else {
            false
        };
        if passes {
            return true;
        }
        cause = e.source();
    }
    false
}

/// A connection to NATS with JetStream.
#[derive(Clone)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    replicas: usize,
    provision: bool,
    violations: Arc<Mutex<VecDeque<String>>>,
    servers: String,
    /// Whether a duplicate's stored message may be read by its sequence (see `dedup`).
    pub(crate) reads_by_sequence: bool,
    /// How long a publish rides out a stream that cannot answer ([`BusConfig::publish_timeout`]).
    publish_timeout: Duration,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus")
            .field("servers", &self.servers)
            .field("state", &self.client.connection_state())
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl Bus {
    /// Connects, retrying with exponential backoff until `cfg.connect_timeout` has passed.
    /// Once connected, the client reconnects by itself after losing the server, trying every
    /// server of the list.
    ///
    /// Stream and bucket replicas are `cfg.replicas`, or learned from the server: 1 when it
    /// is not clustered, else min(3, the servers of its cluster).
    pub async fn connect(cfg: &BusConfig) -> Result<Bus, BusError> {
        cfg.validate()?;
        let servers = cfg.servers_display();
        // Messages only, redacted: what a connection failure says may name a server.
        let err = |detail: String| {
            BusError::new(
                BusErrorKind::Connect,
                format!(
                    "could not connect to NATS at {servers}: {}",
                    redact_text(&detail)
                ),
            )
        };
        let servers = &servers;
        let nkey_seed = match &cfg.nkey_seed_file {
            Some(path) => Some(read_seed(path).map_err(|e| {
                BusError::with_source(BusErrorKind::Config, "reading the NKey seed file", e)
            })?),
            None => None,
        };
        let password = match &cfg.password_file {
            Some(path) => Some(read_password(path).map_err(|e| {
                BusError::with_source(BusErrorKind::Config, "reading the password file", e)
            })?),
            None => None,
        };
        let violations: Arc<Mutex<VecDeque<String>>> = Arc::default();
        // The client library gets the addresses only; the credentials go through its options.
        let addrs: Vec<String> = cfg.servers.iter().map(|s| without_credentials(s)).collect();
        let attempt = || async {
            let seen = violations.clone();
            let mut opts = async_nats::ConnectOptions::new()
                .name(&cfg.client_name)
                .require_tls(cfg.tls_required)
                .custom_inbox_prefix(cfg.effective_inbox_prefix())
                .connection_timeout(Duration::from_secs(5))
                .event_callback(move |event| {
                    let seen = seen.clone();
                    async move { on_event(event, &seen) }
                });
            if let Some(creds) = &cfg.creds_file {
                opts = opts.credentials_file(creds).await.map_err(|e| {
                    let what = format!("reading credentials file {}", creds.display());
                    BusError::with_source(BusErrorKind::Config, what, e)
                })?;
            }
            if let Some(seed) = &nkey_seed {
                opts = opts.nkey(seed.clone());
            }
            // async-nats ignores credentials in the URL: pass them on (the first URL with
            // credentials gives them; a cluster's nodes share their users).
            if let (Some(user), Some(password)) = (cfg.user(), &password) {
                opts = opts.user_and_password(user, password.clone());
            } else {
                match cfg.servers.iter().find_map(|s| url_credentials(s)) {
                    Some(UrlCredentials::UserPassword(user, password)) => {
                        opts = opts.user_and_password(user, password);
                    }
                    Some(UrlCredentials::Token(token)) => opts = opts.token(token),
                    None => {}
                }
            }
            if let Some(ca) = &cfg.tls_ca {
                opts = opts.add_root_certificates(ca.clone());
            }
            if let (Some(cert), Some(key)) = (&cfg.tls_client_cert, &cfg.tls_client_key) {
                opts = opts.add_client_certificate(cert.clone(), key.clone());
            }
            opts.connect(addrs.as_slice()).await.map_err(|e| {
                let detail = redact_text(&e.to_string());
                match e.kind() {
                    // A wrong password or an unknown key does not fix itself: no retries.
                    async_nats::ConnectErrorKind::AuthorizationViolation
                    | async_nats::ConnectErrorKind::Authentication => BusError::new(
                        BusErrorKind::Unauthorized,
                        format!("NATS at {servers} refused the credentials: {detail}"),
                    ),
                    _ => err(detail),
                }
            })
        };
        // Retries until `connect_timeout`, counted from the first attempt (a retry's pause is
        // cut short by it, so the bound is the bound).
        let last = Mutex::new(String::new());
        let retried = attempt
            .retry(
                RetrySchedule::exponential(Duration::from_millis(100), Duration::from_secs(5))
                    .with_jitter(0.5)
                    .delays(),
            )
            .when(|e| e.kind() != BusErrorKind::Unauthorized)
            .notify(|e, delay| {
                warn!(error = %e, ?delay, "connecting to NATS failed; retrying");
                *last.lock().unwrap_or_else(|p| p.into_inner()) = e.to_string();
            });
        let client = match tokio::time::timeout(cfg.connect_timeout, retried).await {
            Ok(connected) => connected?,
            Err(_) => {
                let last = last.lock().unwrap_or_else(|p| p.into_inner()).clone();
                return Err(err(format!(
                    "no connection within {:?}{}",
                    cfg.connect_timeout,
                    if last.is_empty() {
                        String::new()
                    } else {
                        format!(" (last: {last})")
                    }
                )));
            }
        };
        let replicas = match cfg.replicas {
            Some(n) => n,
            None => {
                let info = client.server_info();
                let n = replicas_for(&info);
                debug!(
                    replicas = n,
                    cluster = info.cluster.as_deref().unwrap_or("-"),
                    "stream replicas learned from the server"
                );
                n
            }
        };
        let js = jetstream::new(client.clone());
        Ok(Bus {
            client,
            js,
            replicas,
            provision: cfg.provision,
            violations,
            servers: servers.clone(),
            reads_by_sequence: true,
            publish_timeout: cfg.publish_timeout,
        })
    }

    /// This connection with another publish timeout: how long its publishes ride out a stream
    /// that cannot answer (a command's own timeout, a delivery's ack wait).
    pub fn with_publish_timeout(&self, timeout: Duration) -> Bus {
        Bus {
            publish_timeout: timeout,
            ..self.clone()
        }
    }

    /// How long this connection's publishes ride out a stream that cannot answer.
    pub fn publish_timeout(&self) -> Duration {
        self.publish_timeout
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Replicas of the streams and buckets this connection provisions.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The servers this connection was given, passwords redacted.
    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// The last permission violations the server reported on this connection (its text, which
    /// names the subject), newest last. A denied publish is dropped by the server, so a
    /// request to a denied subject only times out; callers look here to say why.
    pub fn permission_violations(&self) -> Vec<String> {
        self.violations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Whether the server refused a publish or subscription on `subject` on this connection.
    pub fn was_denied(&self, subject: &str) -> bool {
        self.permission_violations()
            .iter()
            .any(|v| v.contains(subject))
    }

    /// Creates every stream, KV bucket and Object Store bucket Stagehand declares
    /// ([`STREAMS`], [`KV_BUCKETS`], [`OBJECT_BUCKETS`]), or brings existing ones to the
    /// declared configuration. Idempotent. With `provision = false` it only checks that they
    /// exist (see [`BusConfig::provision`]).
    pub async fn provision(&self) -> Result<(), BusError> {
        for spec in STREAMS {
            self.provision_stream(spec).await?;
        }
        for spec in KV_BUCKETS {
            self.provision_kv(spec).await?;
        }
        for spec in OBJECT_BUCKETS {
            self.provision_object_bucket(spec).await?;
        }
        Ok(())
    }

    /// Creates the Object Store bucket of `spec`, or corrects the drift of its replicas, age
    /// and direct gets (readers' NATS rights are direct gets by subject); with
    /// `provision = false`, only checks that it exists.
    pub async fn provision_object_bucket(&self, spec: &ObjectBucketSpec) -> Result<(), BusError> {
        through_elections(|| self.provision_object_bucket_once(spec)).await
    }

    async fn provision_object_bucket_once(&self, spec: &ObjectBucketSpec) -> Result<(), BusError> {
        let perr = |e: BoxError| {
            BusError::with_source(
                BusErrorKind::Provision,
                format!("could not provision Object Store bucket {}", spec.bucket),
                e,
            )
        };
        let stream_name = spec.stream_name();
        match self.js.get_stream(&stream_name).await {
            Ok(existing) => {
                let have = existing.cached_info().config.clone();
                let mut updated = have.clone();
                updated.num_replicas = self.replicas;
                updated.max_age = spec.max_age;
                updated.max_bytes = spec.stream_max_bytes();
                updated.allow_direct = true;
                if updated == have {
                    return Ok(());
                }
                if !self.provision {
                    warn!(
                        bucket = %spec.bucket,
                        replicas = have.num_replicas,
                        wanted_replicas = updated.num_replicas,
                        "Object Store bucket configuration drifted from the declared one; this \
                         user may not correct it (run `stagehand provision` as the operator)"
                    );
                    return Ok(());
                }
                info!(
                    bucket = %spec.bucket,
                    replicas = updated.num_replicas,
                    "Object Store bucket configuration drifted; updating"
                );
                self.js
                    .update_stream(updated)
                    .await
                    .map_err(|e| perr(e.into()))?;
                self.settle(&stream_name, self.replicas).await;
                Ok(())
            }
            Err(e) if stream_missing(&e) => {
                if !self.provision {
                    return Err(perr(not_provisioned("buckets")));
                }
                info!(
                    bucket = %spec.bucket,
                    replicas = self.replicas,
                    "creating Object Store bucket"
                );
                self.js
                    .create_object_store(object_store::Config {
                        bucket: spec.bucket.to_string(),
                        description: Some(spec.description.to_owned()),
                        max_age: spec.max_age,
                        max_bytes: spec.stream_max_bytes(),
                        num_replicas: self.replicas,
                        storage: stream::StorageType::File,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| perr(e.into()))?;
                self.settle(&stream_name, self.replicas).await;
                Ok(())
            }
            Err(e) => Err(perr(e.into())),
        }
    }

    /// Creates one stream, or updates it where its configuration drifted from `spec`.
    pub async fn provision_stream(&self, spec: &StreamSpec) -> Result<(), BusError> {
        through_elections(|| self.provision_stream_once(spec)).await
    }

    async fn provision_stream_once(&self, spec: &StreamSpec) -> Result<(), BusError> {
        let wanted = stream_config(spec, self.replicas);
        let perr = |e: BoxError| {
            BusError::with_source(
                BusErrorKind::Provision,
                format!("could not provision stream {}", spec.name),
                e,
            )
        };
        match self.js.get_stream(spec.name).await {
            Ok(mut existing) => {
                let info = existing.info().await.map_err(|e| perr(e.into()))?;
                let have = info.config.clone();
                if have.retention != wanted.retention {
                    return Err(BusError::new(
                        BusErrorKind::RetentionMismatch,
                        format!(
                            "stream {} has retention {:?}, but {:?} is declared; retention is fixed at creation, so the stream must be migrated by hand",
                            spec.name, have.retention, wanted.retention
                        ),
                    ));
                }
                let mut updated = have.clone();
                updated.subjects = wanted.subjects.clone();
                updated.max_age = wanted.max_age;
                updated.max_bytes = wanted.max_bytes;
                updated.max_messages_per_subject = wanted.max_messages_per_subject;
                updated.discard = wanted.discard;
                updated.discard_new_per_subject = wanted.discard_new_per_subject;
                updated.max_message_size = wanted.max_message_size;
                updated.duplicate_window = wanted.duplicate_window;
                updated.num_replicas = wanted.num_replicas;
                updated.allow_direct = wanted.allow_direct;
                if updated == have {
                    return Ok(());
                }
                if !self.provision {
                    warn!(
                        stream = spec.name,
                        replicas = have.num_replicas,
                        wanted_replicas = wanted.num_replicas,
                        "stream configuration drifted from the declared one; this user may not \
                         correct it (run `stagehand provision` as the operator)"
                    );
                    return Ok(());
                }
                info!(
                    stream = spec.name,
                    replicas = updated.num_replicas,
                    "stream configuration drifted; updating"
                );
                self.js
                    .update_stream(updated)
                    .await
                    .map_err(|e| perr(e.into()))?;
                self.settle(spec.name, wanted.num_replicas).await;
                Ok(())
            }
            Err(e) if stream_missing(&e) => {
                if !self.provision {
                    return Err(perr(not_provisioned("streams")));
                }
                self.create_stream(spec, wanted).await
            }
            Err(e) => Err(perr(e.into())),
        }
    }

    async fn create_stream(
        &self,
        spec: &StreamSpec,
        config: stream::Config,
    ) -> Result<(), BusError> {
        info!(
            stream = spec.name,
            replicas = config.num_replicas,
            "creating stream"
        );
        let replicas = config.num_replicas;
        self.js.create_stream(config).await.map_err(|e| {
            BusError::with_source(
                BusErrorKind::Provision,
                format!("could not create stream {}", spec.name),
                e,
            )
        })?;
        self.settle(spec.name, replicas).await;
        Ok(())
    }

    /// Waits (at most [`SETTLE_TIMEOUT`]) until a stream just created or re-replicated has a
    /// leader and every replica current: until then the cluster refuses consumers on it
    /// ("insufficient resources") and writes can stall, which a service starting right after
    /// provisioning would take for a failure. A stream that does not settle in time is only
    /// warned about: it may still settle, and the next operation says what is wrong.
    async fn settle(&self, stream: &str, replicas: usize) {
        if replicas <= 1 {
            return;
        }
        let started = std::time::Instant::now();
        let poll =
            RetrySchedule::exponential(Duration::from_millis(20), Duration::from_millis(500));
        let mut polls = 0;
        loop {
            let settled = match self.js.get_stream(stream).await {
                Ok(mut s) => s.info().await.ok().is_some_and(|info| {
                    info.config.num_replicas == replicas
                        && info.cluster.as_ref().is_some_and(|c| {
                            c.leader.is_some()
                                && c.replicas.len() + 1 == replicas
                                && c.replicas.iter().all(|p| p.current && !p.offline)
                        })
                }),
                Err(_) => false,
            };
            if settled {
                return;
            }
            if started.elapsed() >= SETTLE_TIMEOUT {
                warn!(
                    stream,
                    replicas, "stream replicas not settled after {SETTLE_TIMEOUT:?}"
                );
                return;
            }
            // Polling the cluster's view of the stream: JetStream offers no event for it.
            polls += 1;
            tokio::time::sleep(poll.delay(polls)).await;
        }
    }

    /// Opens the KV bucket of `spec`, creating it when missing and correcting the drift of its
    /// history, age and replicas (with `provision = false`, only opens it).
    pub async fn provision_kv(&self, spec: &KvSpec) -> Result<kv::Store, BusError> {
        through_elections(|| self.provision_kv_once(spec)).await
    }

    async fn provision_kv_once(&self, spec: &KvSpec) -> Result<kv::Store, BusError> {
        let perr = |e: BoxError| {
            BusError::with_source(
                BusErrorKind::Provision,
                format!("could not provision KV bucket {}", spec.bucket),
                e,
            )
        };
        let wanted = kv::Config {
            bucket: spec.bucket.into(),
            description: spec.description.into(),
            history: spec.history,
            max_age: spec.max_age,
            num_replicas: self.replicas,
            storage: stream::StorageType::File,
            ..Default::default()
        };
        let stream_name = format!("KV_{}", spec.bucket);
        match self.js.get_stream(&stream_name).await {
            Ok(mut existing) => {
                let have = existing
                    .info()
                    .await
                    .map_err(|e| perr(e.into()))?
                    .config
                    .clone();
                let drifted = have.num_replicas != wanted.num_replicas
                    || have.max_messages_per_subject != wanted.history
                    || have.max_age != wanted.max_age;
                if drifted && self.provision {
                    info!(
                        bucket = spec.bucket,
                        replicas = wanted.num_replicas,
                        "KV bucket configuration drifted; updating"
                    );
                    let replicas = wanted.num_replicas;
                    let store = self
                        .js
                        .update_key_value(wanted)
                        .await
                        .map_err(|e| perr(e.into()))?;
                    self.settle(&stream_name, replicas).await;
                    return Ok(store);
                }
                if drifted {
                    warn!(
                        bucket = spec.bucket,
                        "KV bucket configuration drifted; this user may not correct it"
                    );
                }
                self.js
                    .get_key_value(spec.bucket)
                    .await
                    .map_err(|e| perr(e.into()))
            }
            Err(e) if stream_missing(&e) => {
                if !self.provision {
                    return Err(perr(not_provisioned("buckets")));
                }
                info!(
                    bucket = spec.bucket,
                    replicas = self.replicas,
                    "creating KV bucket"
                );
                // Services that share a bucket (the promoter and the demoter) create it
                // at the same start, and a replicated create can outlast the request
                // timeout while a cluster is busy and still happen. So a failed create
                // looks for the bucket before trying again, a bounded number of times.
                let create = || async {
                    match self.js.create_key_value(wanted.clone()).await {
                        Ok(store) => Ok(store),
                        Err(create_error) => match self.js.get_key_value(spec.bucket).await {
                            Ok(store) => Ok(store),
                            Err(_) => Err(perr(create_error.into())),
                        },
                    }
                };
                create
                    .retry(
                        RetrySchedule::exponential(
                            Duration::from_millis(200),
                            Duration::from_secs(2),
                        )
                        .delays()
                        .times(4),
                    )
                    .notify(|e, delay| {
                        warn!(error = %e, ?delay, "creating a KV bucket failed; retrying")
                    })
                    .await
            }
            Err(e) => Err(perr(e.into())),
        }
    }

    /// Publishes `event` on its subject with `Nats-Msg-Id` = its id and the current span's
    /// trace context, and waits for the stream to store it.
    pub async fn publish(&self, event: &Event) -> Result<PublishAck, BusError> {
        let cx = tracing::Span::current().context();
        let (subject, headers, payload) = prepare(event, &cx)?;
        self.publish_prepared(subject, headers, payload).await
    }

    /// Publishes `event` like [`Bus::publish`] but with `Nats-Msg-Id` = `msg_id`: a producer
    /// that must get an event past the duplicate window on purpose (`stagehand ingest` run
    /// again after an outage: the same request, a new message, so that a dead-lettered request
    /// is worked on again). Retries of the same publish reuse `msg_id` and stay deduplicated.
    pub async fn publish_with_msg_id(
        &self,
        event: &Event,
        msg_id: &str,
    ) -> Result<PublishAck, BusError> {
        let cx = tracing::Span::current().context();
        let (subject, mut headers, payload) = prepare(event, &cx)?;
        headers.insert(MSG_ID_HEADER, msg_id);
        self.publish_prepared(subject, headers, payload).await
    }

    /// Publishes already-encoded bytes with the given headers and waits for the PubAck. The
    /// `Nats-Msg-Id` given is scoped by the subject; a stream that cannot answer is ridden out
    /// for at most this connection's publish timeout ([`Bus::publish_acked`]); and a PubAck that
    /// says "duplicate" is believed only once the stored message is proven to be this one
    /// (`dedup`).
    pub(crate) async fn publish_prepared(
        &self,
        subject: String,
        mut headers: HeaderMap,
        payload: Bytes,
    ) -> Result<PublishAck, BusError> {
        scope_msg_id(&subject, &mut headers);
        let (sent_headers, sent_payload) = (headers.clone(), payload.clone());
        let ack = self
            .publish_acked(&subject, headers, payload, self.publish_timeout)
            .await?;
        self.unless_shadowed(subject, sent_headers, sent_payload, ack)
            .await
    }

    /// One message stored, or one error: publishes and waits for the PubAck, and while the
    /// answer is one a JetStream leader election gives ([`unanswered`]: no responders, no
    /// stream found on a clustered server, no acknowledgement in time) publishes the same
    /// bytes again with backoff, for at most `budget` in all (each try is cut short by what is
    /// left of it). The same `Nats-Msg-Id` makes a try that was stored after all a duplicate,
    /// never a second message. A subject the server refused this connection
    /// ([`Bus::was_denied`]) and any other answer end it at once. Past the budget the error is
    /// [`BusErrorKind::Unavailable`], naming the subject, how long and how often it tried, and
    /// the last answer.
    async fn publish_acked(
        &self,
        subject: &str,
        headers: HeaderMap,
        payload: Bytes,
        budget: Duration,
    ) -> Result<PublishAck, BusError> {
        let started = tokio::time::Instant::now();
        let deadline = started + budget;
        let tries = std::sync::atomic::AtomicU32::new(0);
        let once = || async {
            let first = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            // The first try always gets long enough for an answer, even with no budget left.
            let left = if first {
                left.max(MIN_PUBLISH_TRY)
            } else {
                left
            };
            let publish = async {
                self.js
                    .publish_with_headers(subject.to_owned(), headers.clone(), payload.clone())
                    .await?
                    .await
            };
            match tokio::time::timeout(left, publish).await {
                Ok(acked) => acked,
                Err(_) => Err(jetstream::context::PublishError::new(
                    jetstream::context::PublishErrorKind::TimedOut,
                )),
            }
        };
        let retried = once
            .retry(
                RetrySchedule::exponential(Duration::from_millis(100), Duration::from_secs(2))
                    .with_jitter(0.5)
                    .delays(),
            )
            .when(|e| {
                unanswered(e, self.client.server_info().cluster.is_some())
                    && tokio::time::Instant::now() < deadline
                    && !self.was_denied(subject)
            })
            // No pause runs past the budget.
            .adjust(|_, pause| {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                pause.map(|p| p.min(left)).filter(|p| !p.is_zero())
            })
            .notify(|e, delay| {
                warn!(%subject, error = %e, ?delay, "the stream did not answer; publishing again")
            })
            .await;
        match retried {
            Ok(ack) => Ok(PublishAck {
                stream: ack.stream,
                sequence: ack.sequence,
                duplicate: ack.duplicate,
                tries: tries.load(std::sync::atomic::Ordering::Relaxed),
            }),
            Err(e)
                if unanswered(&e, self.client.server_info().cluster.is_some())
                    && !self.was_denied(subject) =>
            {
                Err(BusError::with_source(
                    BusErrorKind::Unavailable,
                    format!(
                        "could not publish to {subject}: no stream answered within {:.1} s ({} tries; a JetStream leader being elected, or no stream for this subject)",
                        started.elapsed().as_secs_f64(),
                        tries.load(std::sync::atomic::Ordering::Relaxed),
                    ),
                    e,
                ))
            }
            Err(e) => Err(BusError::with_source(
                BusErrorKind::Publish,
                format!("could not publish to {subject}"),
                e,
            )),
        }
    }
}

/// JetStream's error code for a publish refused because its subject holds as many messages as
/// the stream allows per subject (a project's request subjects are bounded so).
const MAX_MSGS_PER_SUBJECT_EXCEEDED: u64 = 10077;

/// How long the first try of a publish may wait for its answer even with a budget shorter
/// than that (or none): one try always happens.
const MIN_PUBLISH_TRY: Duration = Duration::from_millis(500);

/// Whether a publish's answer is what a stream without a leader gives, and so passes by
/// itself: no responders (async-nats says "no stream found for given subject") — only on a
/// clustered server, since a single server answers so for a subject no stream captures, and
/// that lasts —, no acknowledgement in time, the connection dropped, too many acks pending,
/// or JetStream answering 503 (temporarily unavailable).
fn unanswered(e: &jetstream::context::PublishError, clustered: bool) -> bool {
    use jetstream::context::PublishErrorKind;
    match e.kind() {
        PublishErrorKind::StreamNotFound => clustered,
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => true,
        // 503 is also how a subject at its per-subject limit is refused (error 10077,
        // `discard_new_per_subject`): that lasts, and is no election to wait out.
        PublishErrorKind::Other => std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .is_some_and(|js| {
                js.code() == 503
                    && js.error_code() != jetstream::ErrorCode(MAX_MSGS_PER_SUBJECT_EXCEEDED)
            }),
        _ => false,
    }
}

/// Subject, headers (`Nats-Msg-Id`, `traceparent`) and payload for publishing `event`.
pub(crate) fn prepare(
    event: &Event,
    cx: &opentelemetry::Context,
) -> Result<(String, HeaderMap, Bytes), BusError> {
    let bytes = wire::encode(event).map_err(|e| {
        BusError::with_source(
            BusErrorKind::Encode,
            format!("could not encode event {}", event.id),
            e,
        )
    })?;
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, event.id.as_str());
    stagehand_telemetry::inject_context(cx, &mut headers);
    let subject = subject_for(&event.body, &event.project);
    Ok((subject, headers, Bytes::from(bytes)))
}

/// Headers for republishing recorded bytes: `Nats-Msg-Id` and trace context.
pub(crate) fn headers_for(id: &str, cx: &opentelemetry::Context) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, id);
    stagehand_telemetry::inject_context(cx, &mut headers);
    headers
}

/// Why a service with `bus.provision = false` stops at a stream or bucket that is not there.
fn not_provisioned(what: &str) -> BoxError {
    format!(
        "it does not exist, and this service does not provision {what} (bus.provision = false): \
         run `stagehand provision` as the operator"
    )
    .into()
}

/// Whether `e` says the stream does not exist (as opposed to a server that did not answer).
pub fn stream_missing(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(js)
        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

/// Whether `e` says the KV bucket does not exist: a missing bucket is an answer ("none"), a
/// timeout or a refusal is not.
pub fn bucket_missing(e: &jetstream::context::KeyValueError) -> bool {
    use std::error::Error as _;
    e.kind() == jetstream::context::KeyValueErrorKind::GetBucket
        && e.source()
            .and_then(|s| s.downcast_ref::<jetstream::context::GetStreamError>())
            .is_some_and(stream_missing)
}

/// The JetStream configuration of a declared stream.
pub fn stream_config(spec: &StreamSpec, replicas: usize) -> stream::Config {
    stream::Config {
        name: spec.name.to_owned(),
        subjects: spec.subjects.iter().map(|s| (*s).to_owned()).collect(),
        retention: match spec.retention {
            Retention::Limits => stream::RetentionPolicy::Limits,
            Retention::WorkQueue => stream::RetentionPolicy::WorkQueue,
        },
        max_age: spec.max_age,
        max_bytes: if spec.max_bytes == 0 {
            -1
        } else {
            i64::try_from(spec.max_bytes).unwrap_or(i64::MAX)
        },
        // A per-subject bound refuses what is past it: dropping the oldest would silently lose
        // requests no one consumed yet.
        max_messages_per_subject: if spec.max_msgs_per_subject > 0 {
            spec.max_msgs_per_subject
        } else {
            -1
        },
        discard: if spec.max_msgs_per_subject > 0 {
            stream::DiscardPolicy::New
        } else {
            stream::DiscardPolicy::Old
        },
        discard_new_per_subject: spec.max_msgs_per_subject > 0,
        max_message_size: i32::try_from(spec.max_msg_size).unwrap_or(i32::MAX),
        duplicate_window: spec.duplicate_window,
        num_replicas: replicas,
        // Direct gets by subject let a client with read rights on one subject (an uploader on
        // its project's verdicts) read that subject's last message, and nothing else.
        allow_direct: true,
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

/// Replicas a server's cluster can hold: 1 when it is not clustered, else min(3, the servers
/// it reports in `connect_urls`, which lists the client URLs of every server of the cluster).
fn replicas_for(info: &async_nats::ServerInfo) -> usize {
    if info.cluster.is_none() {
        return 1;
    }
    let mut servers: Vec<&str> = info.connect_urls.iter().map(String::as_str).collect();
    servers.sort_unstable();
    servers.dedup();
    if servers.is_empty() {
        warn!(
            cluster = info.cluster.as_deref().unwrap_or("-"),
            "the server is clustered but advertises no cluster URLs (no_advertise?); \
             streams get 1 replica: set bus.replicas to what the cluster holds"
        );
    }
    servers.len().clamp(1, 3)
}

/// Reads an NKey seed file: the first line that is a user seed (`SU…`).
fn read_seed(path: &Path) -> Result<String, std::io::Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        std::io::Error::new(e.kind(), format!("NKey seed file {}: {e}", path.display()))
    })?;
    text.lines()
        .map(str::trim)
        .find(|l| l.starts_with("SU"))
        .map(str::to_owned)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("NKey seed file {} holds no user seed (SU…)", path.display()),
            )
        })
}

/// The password in `path`: its first line. A file that group or others may read is refused
/// (its mode named): a password file is there so that nobody else sees the password.
fn read_password(path: &Path) -> Result<String, std::io::Error> {
    use std::os::unix::fs::PermissionsExt;
    let named = |e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("password file {}: {e}", path.display()))
    };
    let mode = std::fs::metadata(path).map_err(named)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "password file {} has mode {:04o}: group and others may read it (chmod 0600, or \
                 0400, for the user that connects)",
                path.display(),
                mode & 0o7777
            ),
        ));
    }
    let text = std::fs::read_to_string(path).map_err(named)?;
    let password = text
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end_matches('\r');
    if password.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("password file {} is empty", path.display()),
        ));
    }
    Ok(password.to_owned())
}

/// Logs what the server says about the connection; permission violations are kept so that a
/// caller whose request timed out can say it was refused, and logged as errors: an operator
/// must fix the user's permissions or the service's configuration.
fn on_event(event: async_nats::Event, seen: &Mutex<VecDeque<String>>) {
    match event {
        async_nats::Event::ServerError(async_nats::ServerError::Other(text))
            if text.to_ascii_lowercase().contains("permissions violation") =>
        {
            error!(violation = %text, "NATS refused an operation on this connection");
            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.len() == VIOLATIONS_KEPT {
                seen.pop_front();
            }
            seen.push_back(text);
        }
        async_nats::Event::ServerError(e) => warn!(error = %e, "NATS server error"),
        async_nats::Event::Disconnected => warn!("disconnected from NATS; reconnecting"),
        async_nats::Event::Connected => debug!("connected to NATS"),
        async_nats::Event::LameDuckMode => {
            warn!("the NATS server entered lame duck mode; moving to another")
        }
        other => debug!(event = %other, "NATS connection event"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jetstream::context::{
        CreateKeyValueError, CreateKeyValueErrorKind, GetStreamError, GetStreamErrorKind,
        RequestError, RequestErrorKind,
    };

    fn provision_error(source: impl Into<BoxError>) -> BusError {
        BusError::with_source(BusErrorKind::Provision, "could not provision X", source)
    }

    /// Guards the classification provisioning retries on: what an election looks like passes
    /// (also when wrapped, as the API request inside a stream lookup is), a refusal does not.
    #[test]
    fn an_api_request_that_timed_out_passes_and_a_refusal_does_not() {
        let timed_out = GetStreamError::with_source(
            GetStreamErrorKind::Request,
            RequestError::new(RequestErrorKind::TimedOut),
        );
        assert!(passes_by_itself(&provision_error(timed_out)));
        assert!(passes_by_itself(&provision_error(
            CreateKeyValueError::new(CreateKeyValueErrorKind::TimedOut)
        )));
        assert!(passes_by_itself(&provision_error(
            async_nats::RequestError::new(async_nats::RequestErrorKind::NoResponders)
        )));

        assert!(!passes_by_itself(&provision_error(
            CreateKeyValueError::new(CreateKeyValueErrorKind::InvalidStoreName)
        )));
        assert!(!passes_by_itself(&provision_error(GetStreamError::new(
            GetStreamErrorKind::InvalidStreamName
        ))));
        assert!(!passes_by_itself(&BusError::new(
            BusErrorKind::RetentionMismatch,
            "stream X has retention Limits"
        )));
    }
}
