//! `deploy/nats/accounts.conf` confines each role to its subjects, checked against a real
//! nats-server started with that file: every denial holds (no role reads another's inbox, no
//! service deletes, purges or reconfigures a stream, touches another service's consumer or
//! claims, no uploader touches another project's manifests or the services' bucket), and every
//! grant a role needs works (manifests put and fetched with `stagehand_manifest::ManifestStore`,
//! as the services do) — for tenants and schedulers, from their own accounts through what
//! Stagehand's account exports to them (custom inbox prefixes included), none of whom may
//! create a consumer.

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream::{self, stream};
use async_nats::{Client, ConnectOptions, Event, ServerError};
use futures::StreamExt;
use stagehand_manifest::{BucketOptions, Manifest, ManifestErrorKind, ManifestStore, Spool};
use stagehand_schemas::FileRef;
use stagehand_schemas::subject::{MANIFEST_BUCKET, upload_bucket_spec, upload_manifest_bucket};
use stagehand_testkit::{NatsServer, role_password, user_url, wait_for};
use tokio::sync::mpsc;

fn start_server() -> NatsServer {
    NatsServer::builder().shipped_accounts().start()
}

/// Connects as `user` with its own inbox prefix (`_INBOX_<user>`, the only inbox it may
/// read), forwarding the server's error messages (permission violations).
async fn connect(
    server: &NatsServer,
    user: &str,
    role: &str,
) -> Result<(Client, mpsc::UnboundedReceiver<String>)> {
    connect_with_inbox(server, user, role, &format!("_INBOX_{user}")).await
}

async fn connect_with_inbox(
    server: &NatsServer,
    user: &str,
    role: &str,
    inbox: &str,
) -> Result<(Client, mpsc::UnboundedReceiver<String>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let client = ConnectOptions::with_user_and_password(user.into(), role_password(role))
        .custom_inbox_prefix(inbox)
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
    // A project's own scheduler user (a Kubernetes namespace's init containers): its
    // project's stage requests only.
    check_role(
        &server,
        &mut watcher,
        "scheduler-demo",
        "SCHEDULER_DEMO",
        "stagehand.req.stage.requested.demo",
        "stagehand.req.stage.requested.other-lab",
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

/// The two-tenant config tests of one project against another run with
/// (`shipped_accounts_with_projects`): each project's uploader and training jobs publish their
/// own project's subjects and are refused the other's.
#[tokio::test]
async fn a_second_project_has_its_own_confined_users() -> Result<()> {
    let server = NatsServer::builder()
        .shipped_accounts_with_projects(&["labb"])
        .start();
    let (operator, _) = connect(&server, "operator", "OPERATOR").await?;
    let mut watcher = operator.subscribe("stagehand.>").await?;
    operator.flush().await?;
    for (user, role, own, other) in [
        ("uploader-labb", "UPLOADER_LABB", "labb", "demo"),
        ("uploader-demo", "UPLOADER_DEMO", "demo", "labb"),
    ] {
        check_role(
            &server,
            &mut watcher,
            user,
            role,
            &format!("stagehand.req.ingest.requested.{own}"),
            &format!("stagehand.req.ingest.requested.{other}"),
        )
        .await?;
    }
    for (user, role, own, other) in [
        ("trainer-labb", "TRAINER_LABB", "labb", "demo"),
        ("trainer-demo", "TRAINER_DEMO", "demo", "labb"),
    ] {
        check_role(
            &server,
            &mut watcher,
            user,
            role,
            &format!("stagehand.fact.checkpoint.committed.{own}"),
            &format!("stagehand.fact.checkpoint.committed.{other}"),
        )
        .await?;
    }
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

/// The operator's connection, which may manage streams.
async fn operator_bus(server: &NatsServer) -> Result<stagehand_bus::Bus> {
    let mut cfg = stagehand_bus::BusConfig::new(user_url(server, "operator", "OPERATOR"));
    cfg.connect_timeout = Duration::from_secs(10);
    Ok(stagehand_bus::Bus::connect(&cfg).await?)
}

/// The streams and buckets as the operator provisions them (`stagehand provision`).
async fn provision_as_operator(server: &NatsServer) -> Result<()> {
    operator_bus(server).await?.provision().await?;
    Ok(())
}

/// Everything, and the upload buckets of `projects` (`stagehand provision --project P`).
async fn provision_with_projects(server: &NatsServer, projects: &[&str]) -> Result<()> {
    let bus = operator_bus(server).await?;
    bus.provision().await?;
    for project in projects {
        bus.provision_object_bucket(&upload_bucket_spec(project))
            .await?;
    }
    Ok(())
}

/// A stagehand connection as `user` (its inbox prefix follows from the URL), checking rather
/// than managing streams, as the shipped service configurations do.
async fn bus_as(server: &NatsServer, user: &str, role: &str) -> Result<stagehand_bus::Bus> {
    let mut cfg = stagehand_bus::BusConfig::new(user_url(server, user, role));
    cfg.provision = false;
    cfg.connect_timeout = Duration::from_secs(10);
    Ok(stagehand_bus::Bus::connect(&cfg).await?)
}

/// Waits for the server to report a violation that names `subject`.
async fn violation_naming(
    errors: &mut mpsc::UnboundedReceiver<String>,
    subject: &str,
) -> Result<String> {
    let found = wait_for(Duration::from_secs(10), "a permissions violation", || {
        let mut hit = None;
        while let Ok(e) = errors.try_recv() {
            if e.contains(subject) {
                hit = Some(e);
            }
        }
        async move { hit }
    })
    .await
    .with_context(|| format!("no violation naming {subject}"))?;
    assert!(
        found.to_lowercase().contains("permissions violation"),
        "{found}"
    );
    Ok(found)
}

#[tokio::test]
async fn a_service_checks_streams_consumes_claims_acks_and_publishes_its_facts() -> Result<()> {
    let server = start_server();
    provision_as_operator(&server).await?;
    // The validator's user checks what it uses (provision = false) …
    let bus = bus_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    bus.provision().await?;
    assert!(
        bus.permission_violations().is_empty(),
        "{:?}",
        bus.permission_violations()
    );
    // … claims under its own name, reads the claim back (a direct get) and updates it …
    let claims = bus.jetstream().get_key_value("stagehand_claims").await?;
    let rev = claims
        .create("ingest-validator.event-1", "owner".into())
        .await?;
    let entry = claims
        .entry("ingest-validator.event-1")
        .await?
        .context("claim")?;
    assert_eq!(entry.value.as_ref(), b"owner");
    claims
        .update("ingest-validator.event-1", "done".into(), rev)
        .await?;

    let (uploader, _) = jetstream_as(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    uploader
        .publish("stagehand.req.ingest.requested.demo", "req".into())
        .await?
        .await?;

    // … creates and pulls from its own durable consumer and acks …
    let consumer = bus
        .jetstream()
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

    // … and publishes its facts, and no others.
    let mut js = bus.jetstream().clone();
    js.set_timeout(Duration::from_secs(2));
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
async fn no_user_reads_another_users_inbox() -> Result<()> {
    let server = start_server();
    for (user, role) in [
        ("uploader-demo", "UPLOADER_DEMO"),
        ("trainer-demo", "TRAINER_DEMO"),
        ("scheduler", "SCHEDULER"),
        ("ingest-validator", "INGEST_VALIDATOR"),
        ("resharder", "RESHARDER"),
        ("promoter", "PROMOTER"),
        ("demoter", "DEMOTER"),
        ("backup-copier", "BACKUP_COPIER"),
        ("catalogue-recorder", "CATALOGUE_RECORDER"),
    ] {
        let (client, mut errors) = connect(&server, user, role).await?;
        for foreign in [
            "_INBOX.>",
            "_INBOX.abc.*",
            "_INBOX_operator.>",
            "_INBOX_*.>",
        ] {
            let _sub = client.subscribe(foreign.to_owned()).await?;
            client.flush().await?;
            violation_naming(&mut errors, foreign)
                .await
                .with_context(|| format!("{user} subscribing to {foreign}"))?;
        }
        // Its own inbox works: a request to the server answers there.
        let mut js = jetstream::new(client.clone());
        js.set_timeout(Duration::from_secs(5));
        if role != "UPLOADER_DEMO" && role != "TRAINER_DEMO" {
            js.query_account()
                .await
                .with_context(|| format!("{user}: $JS.API.INFO answered on its own inbox"))?;
        }
    }
    // The default `_INBOX` prefix is refused too: a client that does not set its prefix gets no
    // replies, rather than everyone's.
    let (client, mut errors) =
        connect_with_inbox(&server, "uploader-demo", "UPLOADER_DEMO", "_INBOX").await?;
    let mut js = jetstream::new(client);
    js.set_timeout(Duration::from_secs(2));
    assert!(
        js.publish("stagehand.req.ingest.requested.demo", "r".into())
            .await?
            .await
            .is_err()
    );
    violation_naming(&mut errors, "_INBOX.").await?;
    Ok(())
}

#[tokio::test]
async fn no_service_deletes_purges_or_reconfigures_a_stream() -> Result<()> {
    let server = start_server();
    provision_as_operator(&server).await?;
    let (uploader, _) = jetstream_as(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    uploader
        .publish("stagehand.req.ingest.requested.demo", "req".into())
        .await?
        .await?;
    let (validator, _) = jetstream_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    validator
        .publish("stagehand.fact.dataset.validated.demo", "fact".into())
        .await?
        .await?;
    for (user, role) in [
        ("ingest-validator", "INGEST_VALIDATOR"),
        ("catalogue-recorder", "CATALOGUE_RECORDER"),
        ("promoter", "PROMOTER"),
        ("backup-copier", "BACKUP_COPIER"),
        ("scheduler", "SCHEDULER"),
        ("uploader-demo", "UPLOADER_DEMO"),
        ("trainer-demo", "TRAINER_DEMO"),
    ] {
        let (client, mut errors) = connect(&server, user, role).await?;
        for api in [
            "$JS.API.STREAM.DELETE.STAGEHAND_FACTS",
            "$JS.API.STREAM.PURGE.STAGEHAND_FACTS",
            "$JS.API.STREAM.UPDATE.STAGEHAND_FACTS",
            "$JS.API.STREAM.MSG.DELETE.STAGEHAND_FACTS",
            "$JS.API.STREAM.CREATE.STAGEHAND_EVIL",
            "$JS.API.STREAM.PURGE.STAGEHAND_REQUESTS",
            "$JS.API.STREAM.DELETE.KV_stagehand_claims",
            "$JS.API.CONSUMER.DELETE.STAGEHAND_REQUESTS.ingest-validator",
        ] {
            client.publish(api.to_owned(), "{}".into()).await?;
            client.flush().await?;
            violation_naming(&mut errors, api)
                .await
                .with_context(|| format!("{user} on {api}"))?;
        }
    }
    // The facts are all still there.
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let mut facts = operator.get_stream("STAGEHAND_FACTS").await?;
    assert_eq!(facts.info().await?.state.messages, 1);
    Ok(())
}

#[tokio::test]
async fn a_service_cannot_use_another_services_consumer_or_claims() -> Result<()> {
    let server = start_server();
    provision_as_operator(&server).await?;
    let (client, mut errors) = connect(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    for api in [
        // Re-filtering or reading the recorder's durable, or making one under another name.
        "$JS.API.CONSUMER.CREATE.STAGEHAND_FACTS.catalogue-recorder.stagehand.fact.>",
        "$JS.API.CONSUMER.MSG.NEXT.STAGEHAND_FACTS.catalogue-recorder",
        "$JS.API.CONSUMER.CREATE.STAGEHAND_REQUESTS.promoter.stagehand.req.>",
        "$JS.API.CONSUMER.CREATE.STAGEHAND_REQUESTS",
        "$JS.ACK.STAGEHAND_REQUESTS.promoter.1.2.3.4.5",
        // Another service's claims: writing or reading them.
        "$KV.stagehand_claims.promoter.event-1",
        "$JS.API.DIRECT.GET.KV_stagehand_claims.$KV.stagehand_claims.promoter.event-1",
        "$JS.API.STREAM.MSG.GET.KV_stagehand_claims",
    ] {
        client.publish(api.to_owned(), "{}".into()).await?;
        client.flush().await?;
        violation_naming(&mut errors, api)
            .await
            .with_context(|| format!("ingest-validator on {api}"))?;
    }
    // Its own claim key works (a KV create is a publish with an expected-sequence header).
    let bus = bus_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    let mut js = bus.jetstream().clone();
    // A refused publish never gets its PubAck: bound the wait for it.
    js.set_timeout(Duration::from_secs(2));
    let claims = js.get_key_value("stagehand_claims").await?;
    claims.create("ingest-validator.e2", "me".into()).await?;
    assert!(
        claims.create("promoter.e2", "me".into()).await.is_err(),
        "another service's key"
    );
    Ok(())
}

#[tokio::test]
async fn an_uploader_reads_its_own_projects_verdicts_only() -> Result<()> {
    let server = start_server();
    provision_as_operator(&server).await?;
    let (validator, _) = jetstream_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    for project in ["demo", "other-lab"] {
        validator
            .publish(
                format!("stagehand.fact.dataset.validated.{project}"),
                project.into(),
            )
            .await?
            .await?;
    }
    let (client, mut errors) = connect(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    // The last verdict of its project, by direct get.
    let own = client
        .request(
            "$JS.API.DIRECT.GET.STAGEHAND_FACTS.stagehand.fact.dataset.validated.demo",
            "".into(),
        )
        .await?;
    assert_eq!(own.payload.as_ref(), b"demo");
    for denied in [
        "$JS.API.DIRECT.GET.STAGEHAND_FACTS.stagehand.fact.dataset.validated.other-lab",
        "$JS.API.DIRECT.GET.STAGEHAND_FACTS",
        "$JS.API.STREAM.MSG.GET.STAGEHAND_FACTS",
        "$JS.API.CONSUMER.CREATE.STAGEHAND_FACTS.x.stagehand.fact.dataset.validated.demo",
        "stagehand.catalogue.query",
    ] {
        client.publish(denied.to_owned(), "{}".into()).await?;
        client.flush().await?;
        violation_naming(&mut errors, denied)
            .await
            .with_context(|| format!("uploader on {denied}"))?;
    }
    for denied in [
        "stagehand.fact.dataset.validated.other-lab",
        "stagehand.fact.>",
    ] {
        let _sub = client.subscribe(denied.to_owned()).await?;
        client.flush().await?;
        violation_naming(&mut errors, denied)
            .await
            .with_context(|| format!("uploader subscribing to {denied}"))?;
    }
    Ok(())
}

#[tokio::test]
async fn a_scheduler_reads_readiness_but_cannot_write_it() -> Result<()> {
    let server = start_server();
    provision_as_operator(&server).await?;
    let recorder = bus_as(&server, "catalogue-recorder", "CATALOGUE_RECORDER").await?;
    let readiness = recorder
        .jetstream()
        .get_key_value("stagehand_readiness")
        .await?;
    readiness.put("demo.ds.v1.hot", "ready".into()).await?;

    let (scheduler, mut errors) = jetstream_as(&server, "scheduler", "SCHEDULER").await?;
    let view = scheduler.get_key_value("stagehand_readiness").await?;
    let value = view.get("demo.ds.v1.hot").await?;
    assert_eq!(value.as_deref(), Some(&b"ready"[..]));
    // The keys the bucket holds, from its stream's info: no consumer.
    let mut keys = view
        .stream
        .info_with_subjects("$KV.stagehand_readiness.demo.>")
        .await?;
    let (subject, _) = keys.next().await.context("no key listed")??;
    assert_eq!(subject, "$KV.stagehand_readiness.demo.ds.v1.hot");
    // A watch is a consumer: refused.
    assert!(
        view.watch_with_history("demo.>").await.is_err(),
        "a scheduler must not create a consumer"
    );
    violation_naming(
        &mut errors,
        "$JS.API.CONSUMER.CREATE.KV_stagehand_readiness",
    )
    .await?;

    assert!(
        view.put("demo.ds.v1.hot", "forged".into()).await.is_err(),
        "a scheduler must not write readiness"
    );
    Ok(())
}

/// What one service role needs to run a worker: its stream and filter, and one fact it emits.
struct WorkerGrant {
    user: &'static str,
    role: &'static str,
    stream: &'static str,
    filter: &'static str,
    input: &'static str,
    fact: &'static str,
}

#[tokio::test]
async fn every_service_role_runs_its_own_worker() -> Result<()> {
    let server = start_server();
    provision_as_operator(&server).await?;
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let grants = [
        WorkerGrant {
            user: "ingest-validator",
            role: "INGEST_VALIDATOR",
            stream: "STAGEHAND_REQUESTS",
            filter: "stagehand.req.ingest.requested.*",
            input: "stagehand.req.ingest.requested.demo",
            fact: "stagehand.fact.dataset.validated.demo",
        },
        WorkerGrant {
            user: "resharder",
            role: "RESHARDER",
            stream: "STAGEHAND_FACTS",
            filter: "stagehand.fact.dataset.validated.*",
            input: "stagehand.fact.dataset.validated.demo",
            fact: "stagehand.fact.dataset.prepared.demo",
        },
        WorkerGrant {
            user: "promoter",
            role: "PROMOTER",
            stream: "STAGEHAND_REQUESTS",
            filter: "stagehand.req.stage.requested.*",
            input: "stagehand.req.stage.requested.demo",
            fact: "stagehand.fact.stage.ready.demo",
        },
        WorkerGrant {
            user: "demoter",
            role: "DEMOTER",
            stream: "STAGEHAND_REQUESTS",
            filter: "stagehand.req.stage.released.*",
            input: "stagehand.req.stage.released.demo",
            fact: "stagehand.fact.replica.removed.demo",
        },
        WorkerGrant {
            user: "backup-copier",
            role: "BACKUP_COPIER",
            stream: "STAGEHAND_FACTS",
            filter: "stagehand.fact.replica.created.*",
            input: "stagehand.fact.replica.created.demo",
            fact: "stagehand.fact.backup.completed.demo",
        },
    ];
    for g in &grants {
        operator.publish(g.input, "in".into()).await?.await?;
        let bus = bus_as(&server, g.user, g.role).await?;
        let mut js = bus.jetstream().clone();
        js.set_timeout(Duration::from_secs(5));
        let consumer = js
            .get_stream(g.stream)
            .await
            .with_context(|| format!("{}: stream info", g.user))?
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(g.user.into()),
                filter_subject: g.filter.into(),
                ..Default::default()
            })
            .await
            .with_context(|| format!("{}: its durable consumer", g.user))?;
        let mut batch = consumer.fetch().max_messages(1).messages().await?;
        let message = tokio::time::timeout(Duration::from_secs(10), batch.next())
            .await
            .with_context(|| format!("{}: nothing delivered", g.user))?
            .context("batch ended")?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(message.subject.as_str(), g.input, "{}", g.user);
        message
            .double_ack()
            .await
            .map_err(|e| anyhow::anyhow!("{}: ack: {e}", g.user))?;
        let claims = js.get_key_value("stagehand_claims").await?;
        claims
            .create(&format!("{}.event-1", g.user), "owner".into())
            .await
            .with_context(|| format!("{}: its claim", g.user))?;
        js.publish(g.fact, "fact".into())
            .await?
            .await
            .with_context(|| format!("{}: its fact", g.user))?;
        assert!(
            bus.permission_violations().is_empty(),
            "{}: {:?}",
            g.user,
            bus.permission_violations()
        );
    }
    Ok(())
}

/// Each service writes and reads back only its own heartbeat keys (what the runner does at
/// start and every beat); no service writes another's, and no tenant or scheduler reads any:
/// which services run where, and their versions, are the operator's to see.
#[tokio::test]
async fn each_service_keeps_its_own_heartbeat_and_no_tenant_reads_one() -> Result<()> {
    let server = start_server();
    provision_with_projects(&server, &["demo"]).await?;
    for (user, role) in [
        ("ingest-validator", "INGEST_VALIDATOR"),
        ("resharder", "RESHARDER"),
        ("promoter", "PROMOTER"),
        ("demoter", "DEMOTER"),
        ("backup-copier", "BACKUP_COPIER"),
        ("catalogue-recorder", "CATALOGUE_RECORDER"),
    ] {
        let bus = bus_as(&server, user, role).await?;
        let mut js = bus.jetstream().clone();
        js.set_timeout(Duration::from_secs(2));
        let beats = js
            .get_key_value(stagehand_bus::HEARTBEATS_BUCKET)
            .await
            .with_context(|| format!("{user}: the heartbeat bucket"))?;
        let key = stagehand_bus::runner::heartbeat_key(user, "host-1");
        beats
            .put(&key, "alive".into())
            .await
            .with_context(|| format!("{user}: its heartbeat"))?;
        assert_eq!(
            beats.get(&key).await?.as_deref(),
            Some(&b"alive"[..]),
            "{user}"
        );
        let other = if user == "promoter" {
            "demoter"
        } else {
            "promoter"
        };
        assert!(
            beats
                .put(&format!("{other}.host-1"), "forged".into())
                .await
                .is_err(),
            "{user} wrote {other}'s heartbeat"
        );
    }
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let all = operator
        .get_key_value(stagehand_bus::HEARTBEATS_BUCKET)
        .await?;
    assert!(all.get("promoter.host-1").await?.is_some());
    for (user, role) in [
        ("uploader-demo", "UPLOADER_DEMO"),
        ("scheduler-demo", "SCHEDULER_DEMO"),
        ("scheduler", "SCHEDULER"),
    ] {
        let (client, mut errors) = connect(&server, user, role).await?;
        for api in [
            "$JS.API.STREAM.INFO.KV_stagehand_heartbeats".to_owned(),
            "$JS.API.DIRECT.GET.KV_stagehand_heartbeats.$KV.stagehand_heartbeats.promoter.host-1"
                .to_owned(),
            "$KV.stagehand_heartbeats.promoter.host-1".to_owned(),
        ] {
            client.publish(api.clone(), "{}".into()).await?;
            client.flush().await?;
            violation_naming(&mut errors, &api)
                .await
                .with_context(|| format!("{user} on {api}"))?;
        }
    }
    Ok(())
}

/// Entries of a manifest big enough (about 6 MB) that reading it passes nats-server's
/// flow-control window of a push consumer (4 MB for a client's default 64 MB of pending bytes,
/// a flow-control request at half of it): a reader without its `$JS.FC` right stalls there.
const PAST_FLOW_CONTROL: usize = 60_000;

/// How long a fetch in these tests may take: a stalled one fails rather than hangs.
const FETCH_BOUND: Duration = Duration::from_secs(30);

/// A manifest of `n` entries, distinct per `tag`. From about 2,600 entries it is over the inline
/// bound (it must travel by reference) and over one Object Store chunk.
fn manifest(tag: &str, n: usize) -> Manifest {
    Manifest::from_entries(
        (0..n)
            .map(|i| {
                FileRef::new(
                    format!("{tag}/images/img-{i:06}.jpg"),
                    1000 + i as u64,
                    format!("{i:064x}"),
                )
            })
            .collect(),
    )
}

/// Whether `bucket` holds `manifest` under its digest, as the operator sees it.
async fn stored(operator: &jetstream::Context, bucket: &str, manifest: &Manifest) -> Result<bool> {
    Ok(ManifestStore::open(operator, bucket)
        .await?
        .contains(manifest.digest())
        .await?)
}

/// Messages in the stream of `bucket`: an exact count shows that nothing was written there.
async fn object_messages(operator: &jetstream::Context, bucket: &str) -> Result<u64> {
    Ok(operator
        .get_stream(format!("OBJ_{bucket}"))
        .await?
        .info()
        .await?
        .state
        .messages)
}

/// A clone of `js` whose requests give up after 1 s: for operations the server must refuse
/// (each refusal is also checked in the server's report, so a slow grant cannot pass for one).
fn refusing(js: &jetstream::Context) -> jetstream::Context {
    let mut quick = js.clone();
    quick.set_timeout(Duration::from_secs(1));
    quick
}

/// Objects' messages in a bucket's stream: its chunks and its info.
fn messages_of(manifest: &Manifest) -> u64 {
    manifest
        .canonical_len()
        .div_ceil(stagehand_manifest::CHUNK_BYTES as u64)
        + 1
}

/// Publishes each of `apis` as the connected user and waits for the server to refuse it.
async fn each_refused(
    client: &Client,
    errors: &mut mpsc::UnboundedReceiver<String>,
    user: &str,
    apis: &[&str],
) -> Result<()> {
    for api in apis {
        client.publish(api.to_string(), "{}".into()).await?;
        client.flush().await?;
        violation_naming(errors, api)
            .await
            .with_context(|| format!("{user} on {api}"))?;
    }
    Ok(())
}

#[tokio::test]
async fn an_uploader_puts_manifests_in_its_own_projects_bucket_only() -> Result<()> {
    let server = start_server();
    provision_with_projects(&server, &["demo", "other-lab"]).await?;
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let big = manifest("cats", 3000);
    assert!(!big.fits_inline(), "the manifest must travel by reference");

    // Its own bucket: opened, put into (chunks, info, the check of what is there), and a
    // second put of the same manifest finds it there.
    let (js, mut errors_js) = jetstream_as(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let uploads = ManifestStore::uploads(&js, "demo", BucketOptions::default()).await?;
    assert_eq!(uploads.put(&big).await?, big.reference());
    assert!(uploads.contains(big.digest()).await?);
    uploads.put(&big).await?;
    assert!(stored(&operator, &upload_manifest_bucket("demo"), &big).await?);
    assert_eq!(
        object_messages(&operator, &upload_manifest_bucket("demo")).await?,
        messages_of(&big)
    );
    // Its own bucket's messages by a message get too (how nats-py's Object Store reads an
    // object's info).
    let (client, mut errors) = connect(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let got = client
        .request(
            "$JS.API.STREAM.MSG.GET.OBJ_stagehand_uploads_demo",
            r#"{"seq":1}"#.into(),
        )
        .await?;
    let got: serde_json::Value = serde_json::from_slice(&got.payload)?;
    assert!(
        got["message"]["subject"]
            .as_str()
            .is_some_and(|s| s.starts_with("$O.stagehand_uploads_demo.C.")),
        "{got}"
    );

    // Another project's bucket and the services' bucket: not opened through the store …
    for bucket in [upload_manifest_bucket("other-lab"), MANIFEST_BUCKET.into()] {
        let refused = ManifestStore::open(&refusing(&js), &bucket).await;
        assert!(refused.is_err(), "the uploader opened {bucket}");
        violation_naming(&mut errors_js, &format!("$JS.API.STREAM.INFO.OBJ_{bucket}")).await?;
    }
    // … nor written, read or purged by hand; nor its own bucket read, purged, re-made or
    // deleted.
    each_refused(
        &client,
        &mut errors,
        "uploader-demo",
        &[
            "$O.stagehand_uploads_other-lab.C.nuid1",
            "$O.stagehand_uploads_other-lab.M.bmFtZQ==",
            "$O.stagehand_manifests.C.nuid1",
            "$O.stagehand_manifests.M.bmFtZQ==",
            "$JS.API.DIRECT.GET.OBJ_stagehand_uploads_other-lab.$O.stagehand_uploads_other-lab.M.bmFtZQ==",
            "$JS.API.DIRECT.GET.OBJ_stagehand_manifests.$O.stagehand_manifests.M.bmFtZQ==",
            "$JS.API.STREAM.MSG.GET.OBJ_stagehand_uploads_other-lab",
            "$JS.API.STREAM.MSG.GET.OBJ_stagehand_manifests",
            "$JS.API.CONSUMER.CREATE.OBJ_stagehand_uploads_other-lab",
            "$JS.API.CONSUMER.CREATE.OBJ_stagehand_manifests",
            "$JS.API.CONSUMER.CREATE.OBJ_stagehand_uploads_demo",
            "$JS.API.STREAM.PURGE.OBJ_stagehand_uploads_other-lab",
            "$JS.API.STREAM.PURGE.OBJ_stagehand_manifests",
            "$JS.API.STREAM.PURGE.OBJ_stagehand_uploads_demo",
            "$JS.API.STREAM.MSG.DELETE.OBJ_stagehand_uploads_demo",
            "$JS.API.STREAM.UPDATE.OBJ_stagehand_uploads_demo",
            "$JS.API.STREAM.DELETE.OBJ_stagehand_uploads_demo",
            "$JS.API.STREAM.CREATE.OBJ_stagehand_uploads_demo",
        ],
    )
    .await?;
    // Nothing reached either bucket.
    assert_eq!(
        object_messages(&operator, &upload_manifest_bucket("other-lab")).await?,
        0
    );
    assert_eq!(object_messages(&operator, MANIFEST_BUCKET).await?, 0);
    Ok(())
}

#[tokio::test]
async fn an_uploader_cannot_create_its_bucket_and_is_told_who_does() -> Result<()> {
    // A stream-create right would let it make a stream of that name on any subjects (every
    // catalogue query, another role's inbox): the operator creates upload buckets.
    let server = start_server();
    provision_as_operator(&server).await?;
    let (js, mut errors) = jetstream_as(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let err = ManifestStore::uploads(&js, "demo", BucketOptions::default())
        .await
        .expect_err("the uploader created its bucket");
    assert_eq!(err.kind, ManifestErrorKind::NotFound, "{err}");
    assert!(
        err.to_string()
            .contains("stagehand provision` (a project's upload bucket: `--project <project>`)"),
        "{err}"
    );
    violation_naming(
        &mut errors,
        "$JS.API.STREAM.CREATE.OBJ_stagehand_uploads_demo",
    )
    .await?;
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    assert!(
        operator
            .get_stream("OBJ_stagehand_uploads_demo")
            .await
            .is_err(),
        "no bucket was made"
    );
    Ok(())
}

#[tokio::test]
async fn the_validator_reads_uploads_and_writes_the_services_manifests_only() -> Result<()> {
    let server = start_server();
    provision_with_projects(&server, &["demo", "other-lab"]).await?;
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let big = manifest("cats", PAST_FLOW_CONTROL);
    let (uploader, _) = jetstream_as(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let reference = ManifestStore::uploads(&uploader, "demo", BucketOptions::default())
        .await?
        .put(&big)
        .await?;

    // It checks what it uses (the services' bucket among it) …
    let bus = bus_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    bus.provision().await?;
    let mut js = bus.jetstream().clone();
    js.set_timeout(Duration::from_secs(2));
    // … fetches the upload, verified (its chunks through an ordered consumer) …
    let spool = tempfile::tempdir()?;
    let uploads = ManifestStore::open(&js, &upload_manifest_bucket("demo")).await?;
    let fetched = tokio::time::timeout(
        FETCH_BOUND,
        uploads.fetch(&reference, &Spool::in_dir(spool.path())),
    )
    .await
    .context("the fetch stalled")??;
    assert_eq!(fetched.reference(), reference);
    // … and stores it in the services' bucket, opened, not created.
    let catalogue = ManifestStore::catalogue(&js, BucketOptions::default()).await?;
    assert_eq!(catalogue.put(&fetched).await?, reference);
    assert!(stored(&operator, MANIFEST_BUCKET, &big).await?);
    assert!(
        bus.permission_violations().is_empty(),
        "{:?}",
        bus.permission_violations()
    );

    // It writes no upload bucket, reads none it was not given, reads nothing of the services'
    // bucket beyond what a put checks, and purges or creates no bucket.
    let (client, mut errors) = connect(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    each_refused(
        &client,
        &mut errors,
        "ingest-validator",
        &[
            "$O.stagehand_uploads_demo.C.nuid1",
            "$O.stagehand_uploads_demo.M.bmFtZQ==",
            "$JS.API.STREAM.INFO.OBJ_stagehand_uploads_other-lab",
            "$JS.API.CONSUMER.CREATE.OBJ_stagehand_uploads_other-lab",
            "$JS.API.CONSUMER.CREATE.OBJ_stagehand_manifests",
            "$JS.API.STREAM.PURGE.OBJ_stagehand_uploads_demo",
            "$JS.API.STREAM.PURGE.OBJ_stagehand_manifests",
            "$JS.API.STREAM.CREATE.OBJ_stagehand_uploads_new-lab",
            "$JS.API.STREAM.DELETE.OBJ_stagehand_manifests",
        ],
    )
    .await?;
    // A put into an upload bucket through the store fails: its chunks are refused.
    let other = manifest("dogs", 10);
    assert!(
        ManifestStore::open(&refusing(&js), &upload_manifest_bucket("demo"))
            .await?
            .put(&other)
            .await
            .is_err(),
        "the validator wrote an upload bucket"
    );
    wait_for(Duration::from_secs(10), "the refused chunk", || {
        let denied = bus.was_denied("$O.stagehand_uploads_demo.C.");
        async move { denied.then_some(()) }
    })
    .await?;
    assert_eq!(
        object_messages(&operator, &upload_manifest_bucket("demo")).await?,
        messages_of(&big)
    );
    Ok(())
}

#[tokio::test]
async fn services_read_the_services_manifests_and_only_the_resharder_and_validator_write_them()
-> Result<()> {
    let server = start_server();
    provision_with_projects(&server, &["demo"]).await?;
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let big = manifest("cats", PAST_FLOW_CONTROL);
    let validator = bus_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    let reference = ManifestStore::catalogue(validator.jetstream(), BucketOptions::default())
        .await?
        .put(&big)
        .await?;
    let spool_dir = tempfile::tempdir()?;
    let spool = Spool::in_dir(spool_dir.path());

    // The recorder and the demoter also read upload buckets (checkpoint manifests training
    // jobs put there: the one catalogues them, the other moves them).
    for (user, role, writes, reads_uploads) in [
        ("catalogue-recorder", "CATALOGUE_RECORDER", false, true),
        ("promoter", "PROMOTER", false, false),
        ("demoter", "DEMOTER", false, true),
        ("backup-copier", "BACKUP_COPIER", false, false),
        ("resharder", "RESHARDER", true, false),
    ] {
        // It finds the bucket among what it uses, and fetches the manifest, verified.
        let bus = bus_as(&server, user, role).await?;
        bus.provision()
            .await
            .with_context(|| format!("{user}: checking what it uses"))?;
        let mut js = bus.jetstream().clone();
        js.set_timeout(Duration::from_secs(2));
        let store = ManifestStore::open(&js, MANIFEST_BUCKET).await?;
        let fetched = tokio::time::timeout(FETCH_BOUND, store.fetch(&reference, &spool))
            .await
            .with_context(|| format!("{user}: the fetch stalled"))?
            .with_context(|| format!("{user}: fetching the manifest"))?;
        assert_eq!(fetched.reference(), reference, "{user}");
        assert!(
            bus.permission_violations().is_empty(),
            "{user}: {:?}",
            bus.permission_violations()
        );

        // Only the resharder writes (its shard manifests); nobody purges, and nobody but the
        // validator and the recorder reads an upload bucket.
        let own = manifest(user, 10);
        if writes {
            store
                .put(&own)
                .await
                .with_context(|| format!("{user}: put"))?;
        } else {
            let refused = ManifestStore::open(&refusing(&js), MANIFEST_BUCKET)
                .await?
                .put(&own)
                .await;
            assert!(refused.is_err(), "{user} wrote the services' bucket");
            wait_for(Duration::from_secs(10), "the refused chunk", || {
                let denied = bus.was_denied("$O.stagehand_manifests.C.");
                async move { denied.then_some(()) }
            })
            .await
            .with_context(|| format!("{user}: put"))?;
        }
        assert_eq!(
            stored(&operator, MANIFEST_BUCKET, &own).await?,
            writes,
            "{user}"
        );
        let (client, mut errors) = connect(&server, user, role).await?;
        let mut refused = vec![
            "$JS.API.STREAM.PURGE.OBJ_stagehand_manifests",
            "$O.stagehand_uploads_demo.M.bmFtZQ==",
        ];
        if !reads_uploads {
            refused.extend([
                "$JS.API.STREAM.INFO.OBJ_stagehand_uploads_demo",
                "$JS.API.CONSUMER.CREATE.OBJ_stagehand_uploads_demo",
            ]);
        }
        if !writes {
            refused.extend([
                "$O.stagehand_manifests.C.nuid1",
                "$O.stagehand_manifests.M.bmFtZQ==",
            ]);
        }
        each_refused(&client, &mut errors, user, &refused).await?;
    }
    // The validator's object and the resharder's, nothing else.
    assert_eq!(
        object_messages(&operator, MANIFEST_BUCKET).await?,
        messages_of(&big) + messages_of(&manifest("resharder", 10))
    );
    Ok(())
}

#[tokio::test]
async fn schedulers_and_uploaders_follow_progress_of_their_own_requests() -> Result<()> {
    let server = start_server();
    let (scheduler, mut scheduler_errors) = connect(&server, "scheduler", "SCHEDULER").await?;
    let (uploader, mut uploader_errors) =
        connect(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let mut stages = scheduler
        .subscribe("stagehand.progress.stage.requested.*.*")
        .await?;
    // A stage on a node's local tier is reported on by its node's agent, on its node's subject.
    let mut node_stages = scheduler
        .subscribe("stagehand.progress.stage.requested.*.*.*")
        .await?;
    let mut ingests = uploader
        .subscribe("stagehand.progress.ingest.requested.demo.*")
        .await?;
    scheduler.flush().await?;
    uploader.flush().await?;
    // Who publishes progress: the promoter (stage requests) and the validator (ingests).
    let (promoter, _) = connect(&server, "promoter", "PROMOTER").await?;
    promoter
        .publish(
            "stagehand.progress.stage.requested.demo.6964",
            "copying".into(),
        )
        .await?;
    promoter.flush().await?;
    let (node, _) =
        connect_with_inbox(&server, "node-gpu-01", "NODE_GPU_01", "_INBOX_node.gpu-01").await?;
    node.publish(
        "stagehand.progress.stage.requested.gpu-01.demo.6964",
        "copying on gpu-01".into(),
    )
    .await?;
    node.flush().await?;
    let (validator, _) = connect(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    validator
        .publish(
            "stagehand.progress.ingest.requested.demo.6964",
            "hashing".into(),
        )
        .await?;
    validator.flush().await?;
    assert_eq!(
        next_message(&mut stages).await?.payload.as_ref(),
        b"copying"
    );
    assert_eq!(
        next_message(&mut node_stages).await?.payload.as_ref(),
        b"copying on gpu-01"
    );
    assert_eq!(
        next_message(&mut ingests).await?.payload.as_ref(),
        b"hashing"
    );

    // An uploader follows its own project only; neither follows the other's kind.
    for (client, errors, denied) in [
        (
            &uploader,
            &mut uploader_errors,
            [
                "stagehand.progress.ingest.requested.other-lab.*",
                "stagehand.progress.stage.requested.demo.*",
            ],
        ),
        (
            &scheduler,
            &mut scheduler_errors,
            [
                "stagehand.progress.ingest.requested.*.*",
                "stagehand.progress.>",
            ],
        ),
    ] {
        for denied in denied {
            let _sub = client.subscribe(denied.to_owned()).await?;
            client.flush().await?;
            violation_naming(errors, denied).await?;
        }
    }
    Ok(())
}

/// Guards issue 19's deliver-subject hole: whoever may create a consumer names, in the
/// request's body, the subject the server delivers to, and nothing checks it. No tenant or
/// scheduler may create one, on any stream, in any form (unnamed, named, with its filter in
/// the subject, the older durable form), nor answer a consumer's flow control; and what they
/// do instead works: a project's scheduler reads its own stage status by direct get and
/// follows its own project's stage facts live, and no other project's.
#[tokio::test]
async fn no_tenant_or_scheduler_creates_a_consumer() -> Result<()> {
    let server = start_server();
    provision_with_projects(&server, &["demo"]).await?;
    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    let stages = operator.get_key_value("stagehand_stages").await?;
    stages.put("demo.0042", "ready".into()).await?;
    stages.put("other-lab.0042", "theirs".into()).await?;
    for (user, role) in [
        ("uploader-demo", "UPLOADER_DEMO"),
        ("trainer-demo", "TRAINER_DEMO"),
        ("scheduler-demo", "SCHEDULER_DEMO"),
        ("scheduler", "SCHEDULER"),
    ] {
        let (client, mut errors) = connect(&server, user, role).await?;
        for stream in [
            "KV_stagehand_stages",
            "KV_stagehand_readiness",
            "STAGEHAND_FACTS",
            "STAGEHAND_REQUESTS",
            "OBJ_stagehand_uploads_demo",
        ] {
            for api in [
                format!("$JS.API.CONSUMER.CREATE.{stream}"),
                format!("$JS.API.CONSUMER.CREATE.{stream}.w"),
                format!("$JS.API.CONSUMER.CREATE.{stream}.w.$KV.stagehand_stages.demo.0042"),
                format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.w"),
                format!("$JS.API.CONSUMER.DELETE.{stream}.w"),
                format!("$JS.FC.{stream}.w"),
            ] {
                client.publish(api.clone(), "{}".into()).await?;
                client.flush().await?;
                violation_naming(&mut errors, &format!("\"{api}\""))
                    .await
                    .with_context(|| format!("{user} on {api}"))?;
            }
        }
    }

    // A project's scheduler reads its own status, by direct get, and nobody else's.
    let (scheduler, mut errors) = jetstream_as(&server, "scheduler-demo", "SCHEDULER_DEMO").await?;
    let view = scheduler.get_key_value("stagehand_stages").await?;
    assert_eq!(view.get("demo.0042").await?.as_deref(), Some(&b"ready"[..]));
    assert!(view.get("other-lab.0042").await.is_err());
    violation_naming(
        &mut errors,
        "$JS.API.DIRECT.GET.KV_stagehand_stages.$KV.stagehand_stages.other-lab.0042",
    )
    .await?;
    // It follows its own project's stage facts live (what wakes `stagehand stage wait`), and
    // no other project's.
    let (client, mut errors) = connect(&server, "scheduler-demo", "SCHEDULER_DEMO").await?;
    let mut ready = client.subscribe("stagehand.fact.stage.ready.demo").await?;
    let mut failed = client.subscribe("stagehand.fact.stage.failed.demo").await?;
    client.flush().await?;
    let (promoter, _) = jetstream_as(&server, "promoter", "PROMOTER").await?;
    for subject in [
        "stagehand.fact.stage.ready.demo",
        "stagehand.fact.stage.failed.demo",
    ] {
        promoter.publish(subject, "fact".into()).await?.await?;
    }
    assert_eq!(next_message(&mut ready).await?.payload.as_ref(), b"fact");
    assert_eq!(next_message(&mut failed).await?.payload.as_ref(), b"fact");
    for denied in [
        "stagehand.fact.stage.ready.other-lab",
        "stagehand.fact.stage.ready.*",
        "stagehand.fact.>",
    ] {
        let _sub = client.subscribe(denied.to_owned()).await?;
        client.flush().await?;
        violation_naming(&mut errors, denied)
            .await
            .with_context(|| format!("scheduler-demo subscribing to {denied}"))?;
    }
    Ok(())
}

/// Clients that set their own inbox prefix (`--inbox-prefix`, nats-py's `inbox_prefix=`) get
/// their answers across the accounts too, as long as it lies within the inbox their user may
/// read: a tenant's PubAcks and JetStream API answers, a scheduler's JetStream API answers and
/// direct gets (each mapped back into the asker's account). Each
/// answer is Stagehand's: the tenant and scheduler accounts import `$JS.API.INFO`, so the
/// server adds no `$JS.API.>` import of its own for them, whose "JetStream not enabled"
/// answers would race Stagehand's.
#[tokio::test]
async fn custom_inbox_prefixes_get_their_answers_across_accounts() -> Result<()> {
    let server = start_server();
    provision_with_projects(&server, &["demo"]).await?;
    let (uploader, _) = connect_with_inbox(
        &server,
        "uploader-demo",
        "UPLOADER_DEMO",
        "_INBOX_uploader-demo.lab-7",
    )
    .await?;
    let mut js = jetstream::new(uploader);
    js.set_timeout(Duration::from_secs(5));
    let ack = js
        .publish("stagehand.req.ingest.requested.demo", "req".into())
        .await?
        .await?;
    assert_eq!(ack.stream, "STAGEHAND_REQUESTS");
    for _ in 0..20 {
        let info = js
            .get_stream("OBJ_stagehand_uploads_demo")
            .await
            .context("the upload bucket's stream info, asked from the project's account")?;
        assert_eq!(info.cached_info().config.name, "OBJ_stagehand_uploads_demo");
    }

    let (operator, _) = jetstream_as(&server, "operator", "OPERATOR").await?;
    operator
        .get_key_value("stagehand_stages")
        .await?
        .put("demo.0042", "queued".into())
        .await?;
    let (scheduler, _) = connect_with_inbox(
        &server,
        "scheduler",
        "SCHEDULER",
        "_INBOX_scheduler.slurm-1",
    )
    .await?;
    let mut js = jetstream::new(scheduler);
    js.set_timeout(Duration::from_secs(5));
    for _ in 0..20 {
        js.query_account()
            .await
            .context("$JS.API.INFO, asked from the schedulers' account")?;
    }
    let stages = js.get_key_value("stagehand_stages").await?;
    for _ in 0..20 {
        assert_eq!(
            stages.get("demo.0042").await?.as_deref(),
            Some(&b"queued"[..])
        );
    }
    Ok(())
}
