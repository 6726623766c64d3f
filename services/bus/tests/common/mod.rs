//! Shared fixtures of the runtime's integration tests: a real nats-server with the Stagehand
//! streams, requests, readers of the facts and dead-letter streams, and small handlers.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, Handler, HandlerError, WorkContext, WorkerConfig};
use stagehand_schemas::{
    Body, Event, EventId, Location, StageReady, StageRequested, subject, wire,
};
use stagehand_testkit::NatsServer;

pub const WAIT: Duration = Duration::from_secs(30);

/// Where a consumer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every message was acked or terminated.
    Yes,
    /// Work is pending or awaiting an ack.
    No,
    /// The server dropped this many messages at `max_deliver`.
    Lost(u64),
}

pub struct Env {
    pub nats: NatsServer,
    pub bus: Bus,
    pub dir: tempfile::TempDir,
    /// Messages the server dropped at `max_deliver`, per consumer, from its advisories.
    dropped: Arc<Mutex<HashMap<String, u64>>>,
}

impl Env {
    pub async fn start() -> Env {
        let nats = NatsServer::start();
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        let dropped = Arc::new(Mutex::new(HashMap::new()));
        // The server says, once and only to whoever listens, that it gave up on a message at
        // max_deliver: listen from the start, so that no loss goes unseen.
        let mut advisories = bus
            .client()
            .subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>")
            .await
            .unwrap();
        bus.client().flush().await.unwrap();
        let seen = dropped.clone();
        tokio::spawn(async move {
            while let Some(m) = advisories.next().await {
                let consumer = m.subject.rsplit('.').next().unwrap_or_default().to_owned();
                *seen.lock().unwrap().entry(consumer).or_insert(0) += 1;
            }
        });
        Env {
            nats,
            bus,
            dir: tempfile::tempdir().unwrap(),
            dropped,
        }
    }

    /// Messages the server dropped at `max_deliver` for consumer `name`: lost, neither acked
    /// nor dead-lettered.
    pub fn dropped_at_max_deliver(&self, name: &str) -> u64 {
        self.dropped.lock().unwrap().get(name).copied().unwrap_or(0)
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
    /// to the end: nothing pending, nothing awaiting an ack, the ack floor at the last message
    /// delivered. Panics when the server dropped a message at `max_deliver`: such a message
    /// also leaves nothing pending, but it was lost, not handled.
    pub async fn consumer_drained(&self, name: &str) -> bool {
        let state = self.consumer_state(name).await;
        if let Drained::Lost(n) = state {
            panic!(
                "{n} message(s) of consumer {name} were dropped at max_deliver: lost, not drained"
            );
        }
        state == Drained::Yes
    }

    /// What [`consumer_drained`](Self::consumer_drained) judges, without panicking.
    pub async fn consumer_state(&self, name: &str) -> Drained {
        let lost = self.dropped_at_max_deliver(name);
        if lost > 0 {
            return Drained::Lost(lost);
        }
        let stream = self
            .bus
            .jetstream()
            .get_stream(subject::REQUESTS.name)
            .await
            .unwrap();
        match stream.consumer_info(name).await {
            Ok(info)
                if info.num_pending == 0
                    && info.num_ack_pending == 0
                    && info.ack_floor.stream_sequence >= info.delivered.stream_sequence =>
            {
                Drained::Yes
            }
            _ => Drained::No,
        }
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
    let mut stream = bus.jetstream().get_stream(name).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return out;
    }
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = stream.get_raw_message(seq).await {
            out.push((m.subject.to_string(), m.headers, m.payload.to_vec()));
        }
    }
    out
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
