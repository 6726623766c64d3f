//! The backlog of a service's durable consumer in the work metrics: every
//! [`BACKLOG_EVERY`] while its worker runs, the consumer's info from JetStream sets
//! [`stagehand_telemetry::work::consumer_backlog`] — messages not yet delivered, delivered and
//! not acked, and redelivered and not acked — labelled by service and consumer name (both
//! fixed by the code, so bounded).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::bus::Bus;

/// How often the backlog is read: one JetStream request per consumer.
pub(crate) const BACKLOG_EVERY: Duration = Duration::from_secs(5);

/// Reads the backlog of `consumer` on `stream` until `stop`. A failed read (the consumer not
/// made yet, NATS away) leaves the last values and is tried again on the next tick.
pub(crate) async fn watch(
    bus: Bus,
    service: &'static str,
    stream: String,
    consumer: String,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(BACKLOG_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let info = async {
            let stream = bus.jetstream().get_stream_no_info(&stream).await?;
            stream
                .consumer_info(&consumer)
                .await
                .map_err(Box::<dyn std::error::Error + Send + Sync>::from)
        };
        match info.await {
            Ok(info) => stagehand_telemetry::work::consumer_backlog(
                service,
                &consumer,
                info.num_pending,
                info.num_ack_pending as u64,
                info.num_redelivered as u64,
            ),
            Err(e) => debug!(%consumer, error = %e, "consumer backlog not read; trying again"),
        }
    }
}
