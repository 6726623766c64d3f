//! Shared fixtures of the runtime's integration tests: a real nats-server with the Stagehand
//! streams, requests, readers of the facts and dead-letter streams, and small handlers. The
//! drained check and the stream reader are the testkit's.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use stagehand_bus::{Bus, BusConfig, Handler, HandlerError, WorkContext, WorkerConfig};
use stagehand_schemas::{
    Body, Event, EventId, Location, StageReady, StageRequested, subject, wire,
};
#[allow(unused_imports)] // each test binary uses part of this
pub use stagehand_testkit::Drained;
use stagehand_testkit::{NatsServer, consumer_state, drained, stored_messages};

pub const WAIT: Duration = Duration::from_secs(30);

pub struct Env {
    pub nats: NatsServer,
    pub bus: Bus,
    pub dir: tempfile::TempDir,
}

impl Env {
    pub async fn start() -> Env {
        let nats = NatsServer::start();
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        Env {
            nats,
            bus,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    pub fn ledger(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.redb"))
    }

    /// A worker configuration for stage requests with short timers.
    pub fn worker(&self, service: &str) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(
            service,
            subject::REQUESTS.name,
            vec![subject::kind_filter("req", "stage.requested")],
            self.ledger(service),
        );
        cfg.ack_wait = Duration::from_secs(2);
        cfg.retry.initial = Duration::from_millis(100);
        cfg.retry.max = Duration::from_millis(500);
        cfg.retry.jitter = 0.0;
        cfg.shutdown_deadline = Duration::from_secs(5);
        cfg.concurrency = 8;
        cfg
    }

    /// Publishes raw bytes on a request subject with the given message id and headers.
    pub async fn publish_raw(
        &self,
        subject: &str,
        msg_id: &str,
        extra: &[(&str, &str)],
        payload: Vec<u8>,
    ) -> bool {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        for (k, v) in extra {
            headers.insert(*k, *v);
        }
        let ack = self
            .bus
            .jetstream()
            .publish_with_headers(subject.to_owned(), headers, Bytes::from(payload))
            .await
            .unwrap()
            .await
            .unwrap();
        ack.duplicate
    }

    pub async fn facts(&self) -> Vec<(String, HeaderMap, Event)> {
        read_stream(&self.bus, subject::FACTS.name)
            .await
            .into_iter()
            .map(|(s, h, p)| (s, h, wire::decode(&p).unwrap()))
            .collect()
    }

    pub async fn dead_letters(&self) -> Vec<(String, Event)> {
        read_stream(&self.bus, subject::DEAD_LETTERS.name)
            .await
            .into_iter()
            .map(|(s, _, p)| (s, wire::decode(&p).unwrap()))
            .collect()
    }

    pub async fn fact_count(&self) -> u64 {
        let mut stream = self
            .bus
            .jetstream()
            .get_stream(subject::FACTS.name)
            .await
            .unwrap();
        stream.info().await.unwrap().state.messages
    }

    /// Whether the durable consumer `name` on the requests stream has handled every message
    /// (the testkit's drained check). Panics when the server dropped a message at
    /// `max_deliver`: such a message also leaves nothing pending, but it was lost, not handled.
    pub async fn consumer_drained(&self, name: &str) -> bool {
        drained(self.bus.jetstream(), subject::REQUESTS.name, &[name]).await
    }

    /// What [`consumer_drained`](Self::consumer_drained) judges, without panicking.
    pub async fn consumer_state(&self, name: &str) -> Drained {
        consumer_state(self.bus.jetstream(), subject::REQUESTS.name, name).await
    }

    pub async fn dead_letter_count(&self) -> u64 {
        let mut stream = self
            .bus
            .jetstream()
            .get_stream(subject::DEAD_LETTERS.name)
            .await
            .unwrap();
        stream.info().await.unwrap().state.messages
    }
}

/// Every message of a stream, in order: (subject, headers, payload).
pub async fn read_stream(bus: &Bus, name: &str) -> Vec<(String, HeaderMap, Vec<u8>)> {
    stored_messages(bus.jetstream(), name, "")
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.subject, m.headers, m.payload))
        .collect()
}

pub fn stage_request(id: &str) -> Event {
    Event::request(
        EventId::new(id).unwrap(),
        "lab-a",
        Body::StageRequested(StageRequested {
            dataset: format!("ds-{id}"),
            version: "0123456789abcdef".into(),
            tier: "hot".into(),
            job_id: format!("job-{id}"),
            requested_by: "scheduler".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    )
}

pub fn ready_fact(event: &Event) -> Event {
    let Body::StageRequested(req) = &event.body else {
        panic!("not a stage request: {}", event.kind());
    };
    event.caused(
        "ready",
        Body::StageReady(StageReady {
            dataset: req.dataset.clone(),
            version: req.version.clone(),
            location: Location {
                tier: req.tier.clone(),
                prefix: stagehand_schemas::layout::version_folder(
                    &event.project,
                    &req.dataset,
                    &req.version,
                ),
            },
            job_id: req.job_id.clone(),
            request_id: event.id.clone(),
            node: None,
            path: None,
        }),
    )
}

/// Emits one `stage.ready` per request and counts its calls per event id.
#[derive(Default)]
pub struct Emit {
    pub calls: Mutex<HashMap<EventId, u32>>,
}

impl Emit {
    pub fn calls_for(&self, id: &str) -> u32 {
        self.calls
            .lock()
            .unwrap()
            .get(&EventId::new(id).unwrap())
            .copied()
            .unwrap_or(0)
    }
    pub fn total_calls(&self) -> u32 {
        self.calls.lock().unwrap().values().sum()
    }
}

impl Handler for Emit {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(event.id.clone())
            .or_default() += 1;
        Ok(vec![ready_fact(event)])
    }
}

/// Fails retryably `fail_times` times, then emits; or always fails permanently.
pub struct Flaky {
    pub fail_times: u32,
    pub permanent: bool,
    pub calls: AtomicU32,
}

impl Flaky {
    pub fn retryable(fail_times: u32) -> Self {
        Self {
            fail_times,
            permanent: false,
            calls: AtomicU32::new(0),
        }
    }
    pub fn permanent() -> Self {
        Self {
            fail_times: u32::MAX,
            permanent: true,
            calls: AtomicU32::new(0),
        }
    }
}

impl Handler for Flaky {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.permanent {
            return Err(HandlerError::permanent(format!(
                "tier `nowhere` is not declared (delivery {})",
                ctx.delivery()
            )));
        }
        if n <= self.fail_times {
            return Err(HandlerError::retryable(format!(
                "hot tier offline (delivery {})",
                ctx.delivery()
            )));
        }
        Ok(vec![ready_fact(event)])
    }
}
