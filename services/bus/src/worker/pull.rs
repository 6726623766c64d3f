//! The pull loop, and step 1 of the consume loop: decode each message and hold it to its
//! subject (`stagehand_schemas::trust::check_published`: kind, project, locations).

use std::sync::Arc;
use std::time::Duration;
use tracing::instrument::WithSubscriber;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use stagehand_schemas::wire;
use stagehand_telemetry::{extract_context, names, propagation::has_span};
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::dead_letter::Failure;
use super::slots::Slots;
use super::{Delivery, Handler, MsgInfo, REPLAY_HEADER, Shared};
use crate::ledger::EventKey;

/// Pulls as many messages as there are free slots and runs each in its own task; once `stop`
/// is cancelled, drains until the deadline. Returns how many tasks were abandoned then.
pub(super) async fn pull_loop<H: Handler>(
    shared: &Arc<Shared<H>>,
    consumer: &PullConsumer,
    stop: &CancellationToken,
) -> u64 {
    let cfg = &shared.cfg;
    let slots = Slots::new(cfg);
    let low_water = (cfg.concurrency / 4).max(1);
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut pull_failures: u32 = 0;
    'pull: loop {
        while let Some(done) = tasks.try_join_next() {
            report_join(done);
        }
        let mut pool = tokio::select! {
            biased;
            _ = stop.cancelled() => break 'pull,
            p = slots.acquire(!tasks.is_empty(), low_water) => match p {
                Some(p) => p,
                None => break 'pull,
            },
        };
        let wanted = pool.handlers.num_permits();
        let batch = consumer
            .batch()
            .max_messages(wanted)
            .expires(cfg.pull_expires)
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => {
                pull_failures = 0;
                b
            }
            Err(e) => {
                pull_failures = pull_failures.saturating_add(1);
                let delay = cfg
                    .retry
                    .delay(u64::from(pull_failures))
                    .min(Duration::from_secs(5));
                warn!(error = %e, ?delay, "pull request failed; retrying");
                drop(pool);
                tokio::select! {
                    _ = stop.cancelled() => break 'pull,
                    _ = tokio::time::sleep(delay) => continue 'pull,
                }
            }
        };
        loop {
            let next = tokio::select! {
                biased;
                _ = stop.cancelled() => break 'pull,
                m = batch.next() => m,
            };
            match next {
                None => break,
                Some(Err(e)) => {
                    debug!(error = %e, "pull batch ended");
                    break;
                }
                Some(Ok(msg)) => {
                    let (Some(handler_slot), Some(in_flight)) =
                        (pool.handlers.split(1), pool.in_flight.split(1))
                    else {
                        // The server sent more than asked for; leave it for redelivery.
                        warn!("pull batch delivered more messages than requested");
                        break;
                    };
                    let shared = shared.clone();
                    // Boxed: the task's future is large, and tokio moves an unboxed future
                    // several times on its way into the task; a box moves once.
                    tasks.spawn(Box::pin(
                        async move {
                            process(&shared, msg, handler_slot).await;
                            drop(in_flight);
                        }
                        .with_current_subscriber(),
                    ));
                }
            }
        }
    }
    info!(
        in_flight = tasks.len(),
        "stopping: no more pulls, draining in-flight work"
    );
    let deadline = tokio::time::sleep(cfg.shutdown_deadline);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => {
                let abandoned = tasks.len() as u64;
                if abandoned > 0 {
                    warn!(abandoned, "shutdown deadline passed; leaving in-flight messages un-acked for redelivery");
                }
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                return abandoned;
            }
            done = tasks.join_next() => match done {
                Some(done) => report_join(done),
                None => return 0,
            },
        }
    }
}

fn report_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && e.is_panic()
    {
        error!("message task panicked outside the handler: {e}");
    }
}

fn msg_info(msg: &jetstream::Message) -> Option<MsgInfo> {
    let info = msg.info().ok()?;
    Some(MsgInfo {
        stream: info.stream.to_owned(),
        consumer: info.consumer.to_owned(),
        stream_sequence: info.stream_sequence,
        delivered: u64::try_from(info.delivered).unwrap_or(1).max(1),
        published: info.published,
    })
}

/// Step 1 for one message, then the rest of the loop. `handler_slot` is given back as soon as
/// the handler has returned.
async fn process<H: Handler>(
    shared: &Arc<Shared<H>>,
    msg: jetstream::Message,
    handler_slot: OwnedSemaphorePermit,
) {
    let Some(info) = msg_info(&msg) else {
        warn!(subject = %msg.subject, "message without JetStream metadata; ignoring");
        return;
    };
    // Held until this delivery is acked, retried or dead-lettered (or abandoned).
    let _working = shared
        .claims
        .as_ref()
        .map(|c| c.working_on(info.stream_sequence));
    let msg = Arc::new(msg);
    let parent = extract_context(msg.headers.as_ref());
    let replay_of = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(REPLAY_HEADER))
        .map(|v| v.as_str().to_owned());
    let decoded = wire::decode(&msg.payload);
    let span = match &decoded {
        Err(_) => info_span!(
            names::SPAN_HANDLE_MESSAGE,
            service = %shared.cfg.service,
            stream_sequence = info.stream_sequence,
            delivery = info.delivered,
        ),
        Ok(event) => info_span!(
            names::SPAN_HANDLE_MESSAGE,
            event_id = %event.id,
            kind = event.kind(),
            project = %event.project,
            dataset = event.body.dataset().unwrap_or(""),
            delivery = info.delivered,
            stream_sequence = info.stream_sequence,
            service = %shared.cfg.service,
        ),
    };
    if has_span(&parent) {
        let _ = span.set_parent(parent.clone());
    }
    let (event, rejection) = match decoded {
        Err(e) => (
            None,
            Some(format!("undecodable message on {}: {e}", msg.subject)),
        ),
        Ok(event) => {
            // Held to its subject before anything it names is read: a refusal is permanent.
            let refused = stagehand_schemas::trust::check_published(&event, &msg.subject).err();
            if let Some(refusal) = &refused {
                shared
                    .handler
                    .refused(&event, info.stream_sequence, refusal)
                    .instrument(span.clone())
                    .await;
            }
            let key = refused
                .is_none()
                .then(|| EventKey::of_message(&event, info.published));
            (Some((event, key)), refused.map(|r| r.to_string()))
        }
    };
    let delivery = Delivery {
        msg,
        info,
        parent,
        event,
        replay_of,
    };
    match (&delivery.event, rejection) {
        (Some((event, Some(key))), None) => {
            shared
                .process_event(&delivery, event, key, handler_slot)
                .instrument(span)
                .await;
        }
        (_, rejection) => {
            drop(handler_slot);
            let error = rejection.unwrap_or_else(|| "undecodable message".to_owned());
            warn!(parent: &span, %error, "dead-lettering a message that cannot be handled");
            Box::pin(
                shared
                    .failed(&delivery, Failure::rejected(error), None)
                    .instrument(span),
            )
            .await;
        }
    }
}
