//! The policy clock: every waiting request looked at again every `recheck_every`, and each
//! one answered as its deadline passes.

use std::time::Duration;
use tracing::instrument::WithSubscriber;

use stagehand_bus::HandlerError;
use stagehand_schemas::Event;
use time::OffsetDateTime;
use tracing::debug;

use crate::state::{RequestRecord, Standing, WaitingFor};

use super::Promoter;
use super::in_flight::{Active, request_key};

impl Promoter {
    /// The policy clock: looks again at every waiting request every `recheck_every` (at once
    /// on start, which takes up copies a crash interrupted), and answers each request whose
    /// deadline passes as it passes. Runs until shutdown.
    pub async fn clock(self) -> Result<(), HandlerError> {
        let every = self.p().promotion.recheck_every;
        let mut next_sweep = tokio::time::Instant::now();
        loop {
            let waiting = self.p().state.waiting()?;
            record_waiting(&waiting);
            let sweep = tokio::time::Instant::now() >= next_sweep;
            if sweep {
                next_sweep = tokio::time::Instant::now() + every;
            }
            let now = OffsetDateTime::now_utc();
            let mut next = next_sweep;
            for record in waiting {
                if self.p().shutdown.is_cancelled() {
                    return Ok(());
                }
                let due = record.deadline <= now;
                if !due {
                    if let Ok(d) = Duration::try_from(record.deadline - now) {
                        next = next.min(tokio::time::Instant::now() + d);
                    }
                    if !sweep {
                        continue;
                    }
                }
                let this = self.clone();
                // Each on its own task: a copy taken up again must not hold the clock.
                tokio::spawn(
                    async move {
                        let id = record.event.id.clone();
                        let r = if due {
                            this.expire(record).await
                        } else {
                            this.advance(record, None).await
                        };
                        if let Err(e) = r {
                            debug!(request = %id, error = %e, "waiting request not answered yet");
                        }
                    }
                    .with_current_subscriber(),
                );
            }
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = self.inner.clock.notified() => {}
                _ = self.p().shutdown.cancelled() => return Ok(()),
            }
        }
    }

    /// Answers a request whose deadline passed while it waited (one being copied here right
    /// now is left to its copy).
    async fn expire(&self, record: RequestRecord) -> Result<Vec<Event>, HandlerError> {
        let Some(_active) = Active::take(&self.inner.active, &request_key(&record)) else {
            return Ok(Vec::new());
        };
        self.deadline_passed(&record).await
    }

    /// Answers a request whose deadline has passed with what it was waiting for.
    pub(super) async fn deadline_passed(
        &self,
        record: &RequestRecord,
    ) -> Result<Vec<Event>, HandlerError> {
        let Standing::Waiting {
            waiting_for,
            reason,
        } = &record.standing
        else {
            return Ok(record.answer.clone());
        };
        let reason = deadline_reason(record, *waiting_for, reason);
        self.fail(record, reason, true).await
    }
}

/// Why a request failed at its deadline: the deadline and what it waited for.
pub(super) fn deadline_reason(
    record: &RequestRecord,
    waiting_for: WaitingFor,
    reason: &str,
) -> String {
    let deadline = record
        .deadline
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    format!(
        "the deadline {deadline} passed while waiting for {}: {reason}",
        waiting_for.as_str()
    )
}

/// Sets the requests this promoter has not answered yet in the work metrics
/// ([`stagehand_telemetry::work::stages`]), by tier, state (`copying` while waiting for a
/// copy, else `pending`) and what they wait for.
fn record_waiting(waiting: &[RequestRecord]) {
    let mut counts = stagehand_telemetry::work::StageCounts::new();
    for record in waiting {
        let (Some(request), Standing::Waiting { waiting_for, .. }) =
            (record.stage(), &record.standing)
        else {
            continue;
        };
        let state = match waiting_for {
            WaitingFor::Copy => "copying",
            _ => "pending",
        };
        let waits = stagehand_telemetry::work::waiting_label(Some(waiting_for.as_str()));
        *counts
            .entry((request.tier.clone(), state, waits))
            .or_default() += 1;
    }
    stagehand_telemetry::work::stages(&counts);
}
