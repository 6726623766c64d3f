//! `deploy/nats/accounts.conf` confines each role to its subjects, checked against a real
//! nats-server started with that file.

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream::{self, stream};
use async_nats::{Client, ConnectOptions, Event, ServerError};
use futures::StreamExt;
use stagehand_testkit::{NatsServer, repo_root, wait_for};
use tokio::sync::mpsc;

const ROLES: &[&str] = &[
    "UPLOADER_DEMO",
    "SCHEDULER",
    "INGEST_VALIDATOR",
    "RESHARDER",
    "PROMOTER",
    "DEMOTER",
    "BACKUP_COPIER",
    "CATALOGUE_RECORDER",
    "OPERATOR",
    "SYS",
];

fn password(role: &str) -> String {
    format!("test-password-{}", role.to_ascii_lowercase())
}

fn start_server() -> NatsServer {
    let mut builder =
        NatsServer::builder().config_file(repo_root().join("deploy/nats/accounts.conf"));
    for role in ROLES {
        builder = builder.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password(role));
    }
    builder.start()
}

/// Connects as `user`, forwarding the server's error messages (permission violations).
async fn connect(
    server: &NatsServer,
    user: &str,
    role: &str,
) -> Result<(Client, mpsc::UnboundedReceiver<String>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let client = ConnectOptions::with_user_and_password(user.into(), password(role))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if let Event::ServerError(ServerError::Other(e)) = event {
                    let _ = tx.send(e);
                }
            }
        })
        .connect(server.url())
        .await
        .with_context(|| format!("connect as {user}"))?;
    Ok((client, rx))
}

/// The next message on a subscription, within a bound.
async fn next_message(sub: &mut async_nats::Subscriber) -> Result<async_nats::Message> {
    tokio::time::timeout(Duration::from_secs(10), sub.next())
        .await
        .context("no message within 10 s")?
        .context("subscription closed")
}

/// Publishes `denied` then `allowed` as `user`: the server must report a violation naming
/// `denied`, and a watcher subscribed to everything must see `allowed` and never `denied`
/// (one connection's messages arrive in order, so `denied` would have come first).
async fn check_role(
    server: &NatsServer,
    watcher: &mut async_nats::Subscriber,
    user: &str,
    role: &str,
    allowed: &str,
    denied: &str,
) -> Result<()> {
    let (client, mut errors) = connect(server, user, role).await?;
    client.publish(denied.to_string(), "no".into()).await?;
    client.publish(allowed.to_string(), "yes".into()).await?;
    client.flush().await?;

    let got = next_message(watcher).await?;
    assert_eq!(
        got.subject.as_str(),
        allowed,
        "{user}: watcher saw {}",
        got.subject
    );

    let violation = wait_for(Duration::from_secs(10), "a permissions violation", || {
        let e = errors.try_recv().ok();
        async move { e }
    })
    .await?;
    let lower = violation.to_lowercase();
    assert!(
        lower.contains("permissions violation for publish") && violation.contains(denied),
        "{user}: {violation}"
    );
    Ok(())
}

#[tokio::test]
async fn each_role_publishes_only_its_subjects() -> Result<()> {
    let server = start_server();
    let (operator, _) = connect(&server, "operator", "OPERATOR").await?;
    let mut watcher = operator.subscribe("stagehand.>").await?;
    operator.flush().await?;

    check_role(
        &server,
        &mut watcher,
        "uploader-demo",
        "UPLOADER_DEMO",
        "stagehand.req.ingest.requested.demo",
        "stagehand.req.ingest.requested.other-lab",
    )
    .await?;
    check_role(
        &server,
        &mut watcher,
        "uploader-demo",
        "UPLOADER_DEMO",
        "stagehand.req.ingest.requested.demo",
        "stagehand.req.stage.requested.demo",
    )
    .await?;
    check_role(
        &server,
        &mut watcher,
        "scheduler",
        "SCHEDULER",
        "stagehand.req.stage.requested.demo",
        "stagehand.req.ingest.requested.demo",
    )
    .await?;
    check_role(
        &server,
        &mut watcher,
        "ingest-validator",
        "INGEST_VALIDATOR",
        "stagehand.fact.dataset.validated.demo",
        "stagehand.fact.stage.ready.demo",
    )
    .await?;
    check_role(
        &server,
        &mut watcher,
        "ingest-validator",
        "INGEST_VALIDATOR",
        "stagehand.dlq.dead.letter.ingest-validator",
        "stagehand.dlq.dead.letter.promoter",
    )
    .await?;
    check_role(
        &server,
        &mut watcher,
        "promoter",
        "PROMOTER",
        "stagehand.fact.stage.ready.demo",
        "stagehand.fact.dataset.validated.demo",
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn uploader_gets_a_jetstream_ack_for_its_project_only() -> Result<()> {
    let server = start_server();
    let (operator, _) = connect(&server, "operator", "OPERATOR").await?;
    jetstream::new(operator)
        .create_stream(stream::Config {
            name: "STAGEHAND_REQUESTS".into(),
            subjects: vec!["stagehand.req.>".into()],
            ..Default::default()
        })
        .await?;

    let (uploader, mut errors) = connect(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let mut js = jetstream::new(uploader);
    // Bounds the wait for the PubAck that a refused publish never gets.
    js.set_timeout(Duration::from_secs(2));
    let ack = js
        .publish("stagehand.req.ingest.requested.demo", "req".into())
        .await?
        .await?;
    assert_eq!(ack.stream, "STAGEHAND_REQUESTS");

    let denied = js
        .publish("stagehand.req.ingest.requested.other-lab", "req".into())
        .await?;
    // The server drops the message, so no PubAck ever comes: the ack future fails.
    assert!(denied.await.is_err());
    let violation = wait_for(Duration::from_secs(10), "a permissions violation", || {
        let e = errors.try_recv().ok();
        async move { e }
    })
    .await?;
    assert!(
        violation.contains("stagehand.req.ingest.requested.other-lab"),
        "{violation}"
    );
    Ok(())
}

#[tokio::test]
async fn a_wrong_password_is_refused() {
    let server = start_server();
    let refused = ConnectOptions::with_user_and_password("uploader-demo".into(), "wrong".into())
        .connect(server.url())
        .await;
    assert!(refused.is_err(), "a wrong password must not connect");
}

/// A JetStream context for `user` whose requests give up after 2 s (a refused publish is
/// dropped by the server, so its ack never comes).
async fn jetstream_as(
    server: &NatsServer,
    user: &str,
    role: &str,
) -> Result<(jetstream::Context, mpsc::UnboundedReceiver<String>)> {
    let (client, errors) = connect(server, user, role).await?;
    let mut js = jetstream::new(client);
    js.set_timeout(Duration::from_secs(2));
    Ok((js, errors))
}

#[tokio::test]
async fn a_service_provisions_claims_consumes_acks_and_publishes_its_facts() -> Result<()> {
    let server = start_server();
    let (js, _) = jetstream_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    for (name, subjects) in [
        ("STAGEHAND_REQUESTS", "stagehand.req.>"),
        ("STAGEHAND_FACTS", "stagehand.fact.>"),
    ] {
        js.create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subjects.into()],
            ..Default::default()
        })
        .await
        .with_context(|| format!("create {name}"))?;
    }
    let claims = js
        .create_key_value(jetstream::kv::Config {
            bucket: "stagehand_claims".into(),
            ..Default::default()
        })
        .await?;
    claims.create("event-1", "owner".into()).await?;

    let (uploader, _) = jetstream_as(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    uploader
        .publish("stagehand.req.ingest.requested.demo", "req".into())
        .await?
        .await?;

    let consumer = js
        .get_stream("STAGEHAND_REQUESTS")
        .await?
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("ingest-validator".into()),
            filter_subject: "stagehand.req.ingest.requested.*".into(),
            ..Default::default()
        })
        .await?;
    let mut batch = consumer.fetch().max_messages(1).messages().await?;
    let message = tokio::time::timeout(Duration::from_secs(10), batch.next())
        .await
        .context("no request delivered")?
        .context("batch ended")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(
        message.subject.as_str(),
        "stagehand.req.ingest.requested.demo"
    );
    message
        .double_ack()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    js.publish("stagehand.fact.dataset.validated.demo", "fact".into())
        .await?
        .await?;
    let refused = js
        .publish("stagehand.fact.stage.ready.demo", "fact".into())
        .await?
        .await;
    assert!(
        refused.is_err(),
        "the validator must not publish stage facts"
    );
    Ok(())
}

#[tokio::test]
async fn a_scheduler_reads_readiness_but_cannot_write_it() -> Result<()> {
    let server = start_server();
    let (recorder, _) = jetstream_as(&server, "catalogue-recorder", "CATALOGUE_RECORDER").await?;
    let readiness = recorder
        .create_key_value(jetstream::kv::Config {
            bucket: "stagehand_readiness".into(),
            ..Default::default()
        })
        .await?;
    readiness.put("demo.ds.v1.hot", "ready".into()).await?;

    let (scheduler, _) = jetstream_as(&server, "scheduler", "SCHEDULER").await?;
    let view = scheduler.get_key_value("stagehand_readiness").await?;
    let value = view.get("demo.ds.v1.hot").await?;
    assert_eq!(value.as_deref(), Some(&b"ready"[..]));
    let mut watch = view.watch_with_history("demo.>").await?;
    let entry = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .context("no readiness entry")?
        .context("watch ended")??;
    assert_eq!(entry.key, "demo.ds.v1.hot");

    assert!(
        view.put("demo.ds.v1.hot", "forged".into()).await.is_err(),
        "a scheduler must not write readiness"
    );
    Ok(())
}
