//! The connection: connect with retries, provision streams and the claims bucket, publish
//! events with their id as `Nats-Msg-Id` and the current trace context.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use stagehand_schemas::subject::{Retention, STREAMS, StreamSpec, subject_for};
use stagehand_schemas::{Event, wire};
use tracing::{info, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::config::BusConfig;
use crate::error::{BoxError, BusError, BusErrorKind};

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
    /// The id was already stored within the duplicate window; this copy was dropped.
    pub duplicate: bool,
}

/// A connection to NATS with JetStream.
#[derive(Clone)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    replicas: usize,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus")
            .field("state", &self.client.connection_state())
            .finish()
    }
}

impl Bus {
    /// Connects, retrying with exponential backoff until `cfg.connect_timeout` has passed.
    /// Once connected, the client reconnects by itself after losing the server.
    pub async fn connect(cfg: &BusConfig) -> Result<Bus, BusError> {
        if cfg.replicas == 0 || cfg.replicas > 5 {
            return Err(BusError::config(
                "replicas",
                format!("{} is not in 1..=5", cfg.replicas),
            ));
        }
        let err = |kind, source: BoxError| {
            BusError::with_source(kind, format!("connecting to NATS at {}", cfg.url), source)
        };
        let attempt = || async {
            let mut opts = async_nats::ConnectOptions::new()
                .name(&cfg.client_name)
                .require_tls(cfg.tls_required)
                .connection_timeout(Duration::from_secs(5));
            if let Some(creds) = &cfg.creds_file {
                opts = opts.credentials_file(creds).await.map_err(|e| {
                    let what = format!("reading credentials file {}", creds.display());
                    BusError::with_source(BusErrorKind::Config, what, e)
                })?;
            }
            if let Some(ca) = &cfg.tls_ca {
                opts = opts.add_root_certificates(ca.clone());
            }
            opts.connect(cfg.url.as_str()).await.map_err(|e| {
                let kind = match e.kind() {
                    async_nats::ConnectErrorKind::ServerParse
                    | async_nats::ConnectErrorKind::Authentication
                    | async_nats::ConnectErrorKind::AuthorizationViolation
                    | async_nats::ConnectErrorKind::Tls => BusErrorKind::ConnectRefused,
                    _ => BusErrorKind::Connect,
                };
                err(kind, e.into())
            })
        };
        let started = std::time::Instant::now();
        let client = attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(100))
                    .with_max_delay(Duration::from_secs(5))
                    .without_max_times()
                    .with_jitter(),
            )
            .when(|e: &BusError| e.is_retryable() && started.elapsed() < cfg.connect_timeout)
            .notify(|e, delay| warn!(error = %e, ?delay, "connecting to NATS failed; retrying"))
            .await?;
        let js = jetstream::new(client.clone());
        Ok(Bus {
            client,
            js,
            replicas: cfg.replicas,
        })
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Creates every stream Stagehand declares and the claims bucket, or brings existing ones
    /// to the declared configuration. Idempotent.
    pub async fn provision(&self) -> Result<(), BusError> {
        for spec in STREAMS {
            self.provision_stream(spec).await?;
        }
        self.provision_claims().await
    }

    /// Creates one stream, or updates it where its configuration drifted from `spec`.
    pub async fn provision_stream(&self, spec: &StreamSpec) -> Result<(), BusError> {
        let wanted = stream_config(spec, self.replicas);
        let perr = |e: BoxError| {
            BusError::with_source(
                BusErrorKind::Provision,
                format!("provisioning stream {}", spec.name),
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
                updated.max_message_size = wanted.max_message_size;
                updated.duplicate_window = wanted.duplicate_window;
                updated.num_replicas = wanted.num_replicas;
                if updated != have {
                    info!(stream = spec.name, "stream configuration drifted; updating");
                    self.js
                        .update_stream(updated)
                        .await
                        .map_err(|e| perr(e.into()))?;
                }
                Ok(())
            }
            Err(e) => match e.kind() {
                jetstream::context::GetStreamErrorKind::JetStream(js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    self.create_stream(spec, wanted).await
                }
                _ => Err(perr(e.into())),
            },
        }
    }

    async fn create_stream(
        &self,
        spec: &StreamSpec,
        config: stream::Config,
    ) -> Result<(), BusError> {
        info!(stream = spec.name, "creating stream");
        self.js
            .create_stream(config)
            .await
            .map(|_| ())
            .map_err(|e| {
                BusError::with_source(
                    BusErrorKind::Provision,
                    format!("creating stream {}", spec.name),
                    e,
                )
            })
    }

    async fn provision_claims(&self) -> Result<(), BusError> {
        if self.js.get_key_value(CLAIMS_BUCKET).await.is_ok() {
            return Ok(());
        }
        self.js
            .create_key_value(jetstream::kv::Config {
                bucket: CLAIMS_BUCKET.into(),
                description: "Stagehand workers' claims on event ids".into(),
                history: 1,
                max_age: CLAIMS_MAX_AGE,
                num_replicas: self.replicas,
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map(|_| ())
            .map_err(|e| {
                BusError::with_source(
                    BusErrorKind::Provision,
                    format!("creating KV bucket {CLAIMS_BUCKET}"),
                    e,
                )
            })
    }

    /// Publishes `event` on its subject with `Nats-Msg-Id` = its id and the current span's
    /// trace context, and waits for the stream to store it.
    pub async fn publish(&self, event: &Event) -> Result<PublishAck, BusError> {
        let cx = tracing::Span::current().context();
        let (subject, headers, payload) = prepare(event, &cx)?;
        self.publish_prepared(subject, headers, payload).await
    }

    /// Publishes already-encoded bytes with the given headers and waits for the PubAck.
    pub(crate) async fn publish_prepared(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<PublishAck, BusError> {
        let perr = |e: BoxError| {
            BusError::with_source(BusErrorKind::Publish, format!("publishing to {subject}"), e)
        };
        let ack = self
            .js
            .publish_with_headers(subject.clone(), headers, payload)
            .await
            .map_err(|e| perr(e.into()))?
            .await
            .map_err(|e| perr(e.into()))?;
        Ok(PublishAck {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
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
            format!("encoding event {}", event.id),
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
        max_message_size: i32::try_from(spec.max_msg_size).unwrap_or(i32::MAX),
        duplicate_window: spec.duplicate_window,
        num_replicas: replicas,
        storage: stream::StorageType::File,
        ..Default::default()
    }
}
