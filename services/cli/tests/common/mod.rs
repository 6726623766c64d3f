//! What the scheduler tests share: a real nats-server with Stagehand's services running
//! in-process as `stagehand up` runs them (the catalogue recorder keeps `stagehand_stages`),
//! the stage requests a plugin published, and the promoter's answers to them.
//!
//! The answers are the promoter's facts (`stage.pending`, `stage.ready`, `stage.failed`, with
//! the ids the contract derives from the request), published on the facts stream; the real
//! recorder folds them into the status the plugins wait on.

#![allow(dead_code)] // each test binary uses part of this

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream;
use futures::StreamExt;
use stagehand::stage::{STAGES_BUCKET, Stage, StageStatus};
use stagehand::up::{Stack, UpOptions};
use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::{
    Body, Event, EventId, Location, StageFailed, StagePending, StageReady, wire,
};
use stagehand_testkit::{NatsServer, wait_for};

/// Bound on anything the services or a scheduler should do in a test.
pub const WAIT: Duration = Duration::from_secs(60);

/// The full digest the tests' versions resolve to; requests name its first 16 characters.
pub const VERSION: &str = "5f2c9a0e11b34d7a";
pub const FULL_VERSION: &str = "5f2c9a0e11b34d7a000000000000000000000000000000000000000000c0ffee";

/// A nats-server and the services of `stagehand up` on it.
pub struct Stagehand {
    pub server: NatsServer,
    pub url: String,
    pub bus: Bus,
    pub home: tempfile::TempDir,
    stack: Option<Stack>,
}

impl Stagehand {
    pub async fn start() -> anyhow::Result<Stagehand> {
        let server = NatsServer::start();
        let url = server.url();
        let home = tempfile::tempdir()?;
        let stack = Stack::start(UpOptions {
            home: home.path().to_owned(),
            nats: Some(BusConfig::new(&url)),
            port: 0,
            policies: None,
        })
        .await?;
        stack.ready(WAIT).await?;
        let bus = Bus::connect(&BusConfig::new(&url)).await?;
        Ok(Stagehand {
            server,
            url,
            bus,
            home,
            stack: Some(stack),
        })
    }

    /// Waits until the stage's request is in the requests stream; returns it.
    pub async fn requested(&self, stage: &Stage) -> anyhow::Result<Event> {
        let subject = format!("stagehand.req.stage.requested.{}", stage.project);
        self.find(&subject, &stage.request_id()).await
    }

    /// Waits until the stage's release is in the requests stream; returns it.
    pub async fn released(&self, stage: &Stage) -> anyhow::Result<Event> {
        let subject = format!("stagehand.req.stage.released.{}", stage.project);
        self.find(&subject, &stage.release_id()).await
    }

    /// Whether the stage's release is in the requests stream now.
    pub async fn was_released(&self, stage: &Stage) -> anyhow::Result<bool> {
        let subject = format!("stagehand.req.stage.released.{}", stage.project);
        Ok(self.scan(&subject, &stage.release_id()).await?.is_some())
    }

    async fn scan(&self, subject: &str, id: &EventId) -> anyhow::Result<Option<Event>> {
        let stream = self
            .bus
            .jetstream()
            .get_stream("STAGEHAND_REQUESTS")
            .await?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: subject.to_owned(),
                ..Default::default()
            })
            .await?;
        let pending = consumer.cached_info().num_pending as usize;
        let mut messages = consumer.messages().await?;
        for _ in 0..pending {
            let msg = messages.next().await.context("the stream ended")??;
            let event = wire::decode(&msg.payload)?;
            if event.id == *id {
                return Ok(Some(event));
            }
        }
        Ok(None)
    }

    async fn find(&self, subject: &str, id: &EventId) -> anyhow::Result<Event> {
        wait_for(WAIT, &format!("event {id} on {subject}"), || async {
            self.scan(subject, id).await.ok().flatten()
        })
        .await
        .map_err(Into::into)
    }

    /// The promoter's `stage.pending` for the stage's request.
    pub async fn pending(
        &self,
        stage: &Stage,
        waiting_for: &str,
        reason: &str,
    ) -> anyhow::Result<()> {
        let request = self.requested(stage).await?;
        let fact = request.caused(
            &format!("pending:{waiting_for}"),
            Body::StagePending(StagePending {
                dataset: stage.dataset.clone(),
                version: stage.version.clone(),
                tier: stage.tier.clone(),
                node: stage.node.clone(),
                job_id: stage.job.clone(),
                request_id: request.id.clone(),
                waiting_for: waiting_for.to_owned(),
                reason: reason.to_owned(),
            }),
        );
        self.bus.publish(&fact).await?;
        Ok(())
    }

    /// The promoter's `stage.ready` for the stage's request, the data at `path`.
    pub async fn ready(&self, stage: &Stage, path: &std::path::Path) -> anyhow::Result<()> {
        let request = self.requested(stage).await?;
        let fact = request.caused(
            "ready",
            Body::StageReady(StageReady {
                dataset: stage.dataset.clone(),
                version: FULL_VERSION.to_owned(),
                location: Location {
                    tier: stage.tier.clone(),
                    prefix: format!("{}/{}/{FULL_VERSION}", stage.project, stage.dataset),
                },
                job_id: stage.job.clone(),
                request_id: request.id.clone(),
                node: stage.node.clone(),
                path: Some(path.display().to_string()),
            }),
        );
        self.bus.publish(&fact).await?;
        Ok(())
    }

    /// The promoter's `stage.failed` for the stage's request.
    pub async fn failed(&self, stage: &Stage, reason: &str) -> anyhow::Result<()> {
        let request = self.requested(stage).await?;
        let fact = request.caused(
            "failed",
            Body::StageFailed(StageFailed {
                dataset: stage.dataset.clone(),
                version: stage.version.clone(),
                tier: stage.tier.clone(),
                job_id: stage.job.clone(),
                request_id: request.id.clone(),
                reason: reason.to_owned(),
                retryable: false,
                node: stage.node.clone(),
            }),
        );
        self.bus.publish(&fact).await?;
        Ok(())
    }

    /// The stage's status in `stagehand_stages`, once the recorder has written one that
    /// satisfies `pred`.
    pub async fn status_where(
        &self,
        stage: &Stage,
        what: &str,
        pred: impl Fn(&StageStatus) -> bool,
    ) -> anyhow::Result<StageStatus> {
        let kv = self.bus.jetstream().get_key_value(STAGES_BUCKET).await?;
        let key = stage.status_key();
        wait_for(WAIT, what, || async {
            let value = kv.get(key.clone()).await.ok().flatten()?;
            let status: StageStatus = serde_json::from_slice(&value).ok()?;
            pred(&status).then_some(status)
        })
        .await
        .map_err(Into::into)
    }
}

impl Drop for Stagehand {
    fn drop(&mut self) {
        if let Some(stack) = self.stack.take() {
            stack.shutdown.cancel();
        }
    }
}
