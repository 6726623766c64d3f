//! The worker's durable pull consumer: created, or updated where its configuration drifted.
//!
//! `max_deliver` is a high safety ceiling, not the number of attempts: the runtime counts real
//! failures itself (`WorkerConfig::max_attempts`), so that deliveries spent waiting out
//! another instance's claim cost the request nothing. See step G in `dead_letter.rs`.
//!
//! A worker starting while a stream elects a new leader (a server of the cluster lost) gets no
//! answer for seconds: [`provision_consumer_patiently`] asks again for up to
//! [`PROVISION_PATIENCE`], as the pull loop waits out an outage, before the failure is the
//! service's (and its supervisor's restart the next try).

use async_nats::jetstream::consumer::{self, PullConsumer, pull};
use async_nats::jetstream::{self};
use stagehand_schemas::Retryable;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::slots::in_flight_window;
use crate::bus::Bus;
use crate::config::WorkerConfig;
use crate::error::{BusError, BusErrorKind};

/// How long a starting worker keeps asking for its consumer while NATS answers with errors
/// that may pass (a time-out, no leader yet).
pub const PROVISION_PATIENCE: Duration = Duration::from_secs(60);

/// [`provision_consumer`], asked again after a retryable failure (delays from the worker's
/// retry schedule, at most 5 s apart) until [`PROVISION_PATIENCE`] has passed or `shutdown`.
pub async fn provision_consumer_patiently(
    bus: &Bus,
    cfg: &WorkerConfig,
    shutdown: &CancellationToken,
) -> Result<PullConsumer, BusError> {
    let started = Instant::now();
    let mut failures = 0u64;
    loop {
        let e = match provision_consumer(bus, cfg).await {
            Ok(consumer) => return Ok(consumer),
            Err(e) => e,
        };
        if !e.is_retryable() || started.elapsed() >= PROVISION_PATIENCE {
            return Err(e);
        }
        failures += 1;
        let delay = cfg.retry.delay(failures).min(Duration::from_secs(5));
        warn!(consumer = %cfg.service, error = %e, ?delay, "consumer not provisioned yet; asking again");
        tokio::select! {
            _ = shutdown.cancelled() => return Err(e),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Creates the durable pull consumer of `cfg`, or updates it where its configuration drifted
/// (ack wait, max deliveries, filter subjects, max ack pending).
pub async fn provision_consumer(bus: &Bus, cfg: &WorkerConfig) -> Result<PullConsumer, BusError> {
    let what = || {
        format!(
            "provisioning consumer {} on stream {}",
            cfg.service, cfg.stream
        )
    };
    let perr = |e: Box<dyn std::error::Error + Send + Sync>| {
        BusError::with_source(BusErrorKind::Provision, what(), e)
    };
    let stream = bus
        .jetstream()
        .get_stream(&cfg.stream)
        .await
        .map_err(|e| perr(e.into()))?;
    let wanted = consumer_config(cfg);
    match stream.consumer_info(&cfg.service).await {
        Ok(info) => {
            let have = &info.config;
            let drifted = have.ack_wait != wanted.ack_wait
                || have.max_deliver != wanted.max_deliver
                || have.max_ack_pending != wanted.max_ack_pending
                || effective_filters(&have.filter_subject, &have.filter_subjects)
                    != effective_filters(&wanted.filter_subject, &wanted.filter_subjects);
            if drifted {
                info!(consumer = %cfg.service, "consumer configuration drifted; updating");
                stream
                    .update_consumer(wanted)
                    .await
                    .map_err(|e| perr(e.into()))
            } else {
                stream.get_consumer(&cfg.service).await.map_err(perr)
            }
        }
        Err(e) if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => {
            info!(consumer = %cfg.service, stream = %cfg.stream, "creating consumer");
            stream
                .create_consumer(wanted)
                .await
                .map_err(|e| perr(e.into()))
        }
        Err(e) => Err(perr(e.into())),
    }
}

fn consumer_config(cfg: &WorkerConfig) -> pull::Config {
    // One filter goes in `filter_subject`, which every server version honours.
    let (filter_subject, filter_subjects) = match cfg.filter_subjects.as_slice() {
        [one] => (one.clone(), Vec::new()),
        many => (String::new(), many.to_vec()),
    };
    pull::Config {
        durable_name: Some(cfg.service.clone()),
        description: Some(format!("Stagehand service {}", cfg.service)),
        ack_policy: consumer::AckPolicy::Explicit,
        deliver_policy: consumer::DeliverPolicy::All,
        ack_wait: cfg.ack_wait,
        max_deliver: cfg.max_deliver,
        filter_subject,
        filter_subjects,
        max_ack_pending: i64::try_from(in_flight_window(cfg)).unwrap_or(i64::MAX),
        ..Default::default()
    }
}

fn effective_filters(one: &str, many: &[String]) -> Vec<String> {
    let mut v: Vec<String> = if many.is_empty() {
        if one.is_empty() {
            Vec::new()
        } else {
            vec![one.to_owned()]
        }
    } else {
        many.to_vec()
    };
    v.sort();
    v
}
