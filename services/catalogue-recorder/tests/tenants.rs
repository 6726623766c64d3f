//! The recorder among hostile tenants, against a real nats-server with the shipped accounts
//! (`deploy/nats/accounts.conf`) and a second project (`labb`), the recorder running as its
//! own restricted user: answers go only to inboxes, and a fact whose id another project's
//! training job borrowed is still folded.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use async_nats::HeaderMap;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, CancellationToken, MSG_ID_HEADER, PROMOTER, runner};
use stagehand_catalogue::{Catalogue, Query};
use stagehand_catalogue_recorder::{RecorderError, RecorderStats, SERVICE, Settings, serve};
use stagehand_schemas::subject::{CATALOGUE_QUERY, FACTS, subject_for};
use stagehand_schemas::*;
use stagehand_testkit::{NatsServer, stored_events, user_url, wait_until};

const WAIT: Duration = Duration::from_secs(30);

async fn connect(server: &NatsServer, user: &str, role: &str) -> Result<Bus> {
    let mut cfg = BusConfig::new(user_url(server, user, role));
    cfg.provision = false;
    cfg.connect_timeout = Duration::from_secs(10);
    Bus::connect(&cfg)
        .await
        .with_context(|| format!("connecting as {user}"))
}

/// The shipped accounts with `labb`'s users, provisioned as the operator does (the promoter's
/// bucket included); returns the operator's connection.
async fn server() -> Result<(NatsServer, Bus)> {
    let server = NatsServer::builder()
        .shipped_accounts_with_projects(&["labb"])
        .start();
    let mut cfg = BusConfig::new(user_url(&server, "operator", "OPERATOR"));
    cfg.connect_timeout = Duration::from_secs(10);
    let operator = Bus::connect(&cfg).await?;
    operator.provision().await?;
    operator.provision_kv(&PROMOTER).await?;
    Ok((server, operator))
}

struct Running {
    bus: Bus,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<RecorderStats, RecorderError>>,
}

/// The recorder as its own NATS user, as `stagehand up --external-nats` runs it.
async fn start(server: &NatsServer, dir: &std::path::Path) -> Result<Running> {
    let bus = connect(server, "catalogue-recorder", "CATALOGUE_RECORDER").await?;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve(runner::Context::new(
        SERVICE,
        Settings::under(dir),
        bus.clone(),
        shutdown.clone(),
    )));
    Ok(Running {
        bus,
        shutdown,
        task,
    })
}

impl Running {
    /// Stops the recorder, and waits until whatever it published has reached the server.
    async fn stop(self) -> Result<RecorderStats> {
        self.shutdown.cancel();
        let stats = self.task.await??;
        self.bus.client().flush().await?;
        Ok(stats)
    }
}

/// The scheduler's catalogue: a user that may ask.
async fn answering(catalogue: &Catalogue) -> Result<()> {
    wait_until(WAIT, "the recorder to answer", || async {
        catalogue
            .ask(&Query::DeadLetters {
                limit: None,
                after: None,
            })
            .await
            .is_ok()
    })
    .await?;
    Ok(())
}

/// Route four: `demo`'s training job publishes, on its own subject and under its own message
/// id (nothing for the duplicate window to drop), a checkpoint commit whose event id is the id
/// `labb`'s verdict on upload `u-1` will have (it follows from public names). The recorder
/// folds it first; `labb`'s `dataset.validated` with the same id is folded after it all the
/// same, and the catalogue finds `labb`'s dataset.
#[tokio::test]
async fn a_fact_whose_id_another_project_borrowed_is_folded() -> Result<()> {
    let (server, operator) = server().await?;
    let dir = tempfile::tempdir()?;
    let recorder = start(&server, dir.path()).await?;
    let scheduler = connect(&server, "scheduler", "SCHEDULER").await?;
    let catalogue = Catalogue::new(scheduler.client().clone());
    answering(&catalogue).await?;

    let request = EventId::new("u-1")?;
    let borrowed = EventId::for_fact("labb", &request, "validated");
    let files = vec![FileRef::new("a.bin", 3, sha256_hex(b"abc"))];
    let mut shadow = Event::request(
        borrowed.clone(),
        "demo",
        Body::CheckpointCommitted(CheckpointCommitted {
            run: "r1".into(),
            step: 1,
            location: Location {
                tier: "hot".into(),
                prefix: "demo/checkpoints/r1/step-1".into(),
            },
            files: files.clone(),
            manifest: None,
            total_bytes: 3,
            tags: vec![],
        }),
    );
    shadow.occurred_at = now();
    let trainer = connect(&server, "trainer-demo", "TRAINER_DEMO").await?;
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, "the-trainers-own-message-id");
    trainer
        .jetstream()
        .publish_with_headers(
            subject_for(&shadow.body, &shadow.project),
            headers,
            wire::encode(&shadow)?.into(),
        )
        .await?
        .await?;
    wait_until(WAIT, "the commit to be folded", || async {
        catalogue.dataset(Some("demo"), "ckpt-r1").await.is_ok()
    })
    .await?;

    let mut verdict = Event::request(
        borrowed.clone(),
        "labb",
        Body::DatasetValidated(DatasetValidated {
            dataset: "cats".into(),
            version: version_digest(&files),
            source: Location {
                tier: "source".into(),
                prefix: "labb/cats/x".into(),
            },
            total_bytes: 3,
            files: files.clone(),
            manifest: None,
            requested_by: "alice".into(),
            request_id: request.clone(),
            labels: vec![],
        }),
    );
    verdict.causation_id = Some(request);
    let validator = connect(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    validator.publish(&verdict).await?;
    wait_until(WAIT, "labb's dataset in the catalogue", || async {
        catalogue
            .dataset(Some("labb"), "cats")
            .await
            .is_ok_and(|d| d.versions.len() == 1)
    })
    .await?;
    let stats = recorder.stop().await?;
    ensure!(stats.facts.dead_lettered == 0, "{stats:?}");
    drop(operator);
    Ok(())
}

/// Queries whose reply subject is the promoter's quota KV key, another user's inbox or one of
/// `labb`'s facts subjects, sent by a user of Stagehand's own account that may ask (a service's
/// user: the promoter's), are refused and counted; the same crafted by the scheduler, whose
/// queries cross from its own account, reach the recorder with a one-off `_R_.…` reply subject
/// the server routes back into the scheduler's account. Either way the quota entry keeps its
/// revision, the facts stream holds nothing on that subject, the inbox gets nothing. A query
/// asked the ordinary way, after them, is answered.
#[tokio::test]
async fn a_query_with_a_reply_subject_that_is_no_inbox_is_refused_and_counted() -> Result<()> {
    let (server, operator) = server().await?;
    let dir = tempfile::tempdir()?;
    let quota = operator
        .jetstream()
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await?;
    let revision = quota
        .put(
            "quota.hot",
            br#"{"replicas":{},"reserved":0}"#.to_vec().into(),
        )
        .await?;
    let mut inbox = operator
        .client()
        .subscribe("_INBOX_uploader-demo.>".to_owned())
        .await?;
    operator.client().flush().await?;

    let recorder = start(&server, dir.path()).await?;
    let scheduler = connect(&server, "scheduler", "SCHEDULER").await?;
    let catalogue = Catalogue::new(scheduler.client().clone());
    answering(&catalogue).await?;

    let query = serde_json::to_vec(&Query::DeadLetters {
        limit: None,
        after: None,
    })?;
    let crafted = [
        "$KV.stagehand_promoter.quota.hot",
        "_INBOX_uploader-demo.stolen",
        "stagehand.fact.dataset.validated.labb",
    ];
    let promoter = connect(&server, "promoter", "PROMOTER").await?;
    for asker in [&scheduler, &promoter] {
        for reply in crafted {
            asker
                .client()
                .publish_with_reply(CATALOGUE_QUERY, reply.to_owned(), query.clone().into())
                .await?;
        }
        asker.client().flush().await?;
    }
    // Asked the ordinary way, after them on the same connections: answered.
    answering(&catalogue).await?;
    answering(&Catalogue::new(promoter.client().clone())).await?;
    let stats = recorder.stop().await?;
    ensure!(
        stats.queries_refused == crafted.len() as u64,
        "refused {} of {} crafted queries",
        stats.queries_refused,
        crafted.len()
    );

    let entry = quota.entry("quota.hot").await?.context("the quota entry")?;
    ensure!(
        entry.revision == revision,
        "the promoter's quota entry was overwritten: {:?}",
        String::from_utf8_lossy(&entry.value)
    );
    let facts = stored_events(
        operator.jetstream(),
        FACTS.name,
        "stagehand.fact.dataset.validated.labb",
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(facts.is_empty(), "an answer stored as a fact: {facts:?}");
    operator.client().flush().await?;
    ensure!(
        futures::FutureExt::now_or_never(inbox.next()).is_none(),
        "an answer reached another user's inbox"
    );
    Ok(())
}
