//! Message ids no one can borrow, against a real nats-server with the shipped accounts and a
//! second project (`labb`): a tenant that stores, on its own subject, a message under the
//! `Nats-Msg-Id` of another project's next stage request, release or fact — which the
//! publisher's header alone cannot prevent — no longer makes that request, release or fact
//! vanish. Each is stored exactly once on its own subject; an honest retry is still a
//! duplicate.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use async_nats::HeaderMap;
use stagehand_bus::{Bus, BusConfig, MSG_ID_HEADER, msg_id_for};
use stagehand_schemas::subject::{FACTS, REQUESTS, subject_for};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, Location, StageReleased, StageRequested,
    sha256_hex, version_digest, wire,
};
use stagehand_testkit::{NatsServer, stored_events, user_url};

/// A server with the shipped accounts and tenant users of `labb` besides `demo`, provisioned as
/// the operator does.
async fn server() -> Result<(NatsServer, Bus)> {
    let server = NatsServer::builder()
        .shipped_accounts_with_projects(&["labb"])
        .start();
    let mut cfg = BusConfig::new(user_url(&server, "operator", "OPERATOR"));
    cfg.connect_timeout = Duration::from_secs(10);
    let operator = Bus::connect(&cfg).await?;
    operator.provision().await?;
    Ok((server, operator))
}

async fn connect(server: &NatsServer, user: &str, role: &str) -> Result<Bus> {
    let mut cfg = BusConfig::new(user_url(server, user, role));
    cfg.provision = false;
    cfg.connect_timeout = Duration::from_secs(10);
    Bus::connect(&cfg)
        .await
        .with_context(|| format!("connecting as {user}"))
}

/// A tenant's connection as the CLI makes it: it may read only its own subjects.
async fn tenant(server: &NatsServer, user: &str, role: &str) -> Result<Bus> {
    Ok(connect(server, user, role)
        .await?
        .reading_own_subjects_only())
}

/// What a hostile tenant does: publishes `payload` on a subject it may use, under a message id
/// of its choosing, and checks the stream stored it.
async fn publish_under(bus: &Bus, subject: &str, msg_id: &str, payload: Vec<u8>) -> Result<()> {
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, msg_id);
    let ack = bus
        .jetstream()
        .publish_with_headers(subject.to_owned(), headers, payload.into())
        .await?
        .await
        .with_context(|| format!("the tenant's publish on {subject}"))?;
    ensure!(!ack.duplicate, "the tenant's own message was stored");
    Ok(())
}

/// The events stored on `subject` with `id`.
async fn stored(operator: &Bus, stream: &str, subject: &str, id: &EventId) -> Result<usize> {
    let events = stored_events(operator.jetstream(), stream, subject)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(events.iter().filter(|e| &e.id == id).count())
}

fn stage_request(project: &str, job: &str) -> Event {
    let version = "0123456789abcdef";
    Event::request(
        EventId::for_stage(project, job, "cats", version, "hot", None),
        project,
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: version.into(),
            tier: "hot".into(),
            job_id: job.into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    )
}

fn stage_release(project: &str, job: &str) -> Event {
    let version = "0123456789abcdef";
    Event::request(
        EventId::for_stage_release(project, job, "cats", version, "hot", None),
        project,
        Body::StageReleased(StageReleased {
            dataset: "cats".into(),
            version: version.into(),
            tier: "hot".into(),
            job_id: job.into(),
            node: None,
            reason: None,
        }),
    )
}

/// `labb`'s verdict on its ingest request `request`: the id the validator will give it follows
/// from public names.
fn validated(project: &str, request: &str) -> Event {
    let files = vec![FileRef::new("a.bin", 3, sha256_hex(b"abc"))];
    let request_id = EventId::new(request).unwrap();
    let mut fact = Event::request(
        EventId::for_fact(project, &request_id, "validated"),
        project,
        Body::DatasetValidated(DatasetValidated {
            dataset: "cats".into(),
            version: version_digest(&files),
            source: Location {
                tier: "source".into(),
                prefix: format!("{project}/cats/x"),
            },
            total_bytes: 3,
            files,
            manifest: None,
            requested_by: "alice".into(),
            request_id: request_id.clone(),
            labels: vec![],
        }),
    );
    fact.causation_id = Some(request_id);
    fact
}

/// The ids a hostile tenant would borrow for `event`: the scoped message id Stagehand
/// publishes it under, and the bare event id earlier releases used.
fn borrowed_ids(event: &Event) -> [String; 2] {
    let subject = subject_for(&event.body, &event.project);
    [
        msg_id_for(&subject, event.id.as_str()),
        event.id.to_string(),
    ]
}

/// Routes one and two: `demo`'s uploader stores, on its own ingest subject, messages under the
/// message ids of `labb`'s next stage request and its release (both follow from the job's
/// public names). The scheduler's request and release each still reach the requests stream,
/// once; the hook run again is an honest duplicate.
#[tokio::test]
async fn a_stage_request_and_its_release_get_past_borrowed_message_ids() -> Result<()> {
    let (server, operator) = server().await?;
    let uploader = connect(&server, "uploader-demo", "UPLOADER_DEMO").await?;
    let scheduler = tenant(&server, "scheduler", "SCHEDULER").await?;
    let request = stage_request("labb", "4242");
    let release = stage_release("labb", "4242");
    for event in [&request, &release] {
        for borrowed in borrowed_ids(event) {
            publish_under(
                &uploader,
                "stagehand.req.ingest.requested.demo",
                &borrowed,
                b"anything".to_vec(),
            )
            .await?;
        }
    }

    for event in [&request, &release] {
        let subject = subject_for(&event.body, &event.project);
        let ack = scheduler.publish(event).await?;
        ensure!(
            !ack.duplicate,
            "{}: acked as a duplicate of another's message",
            event.kind()
        );
        ensure!(
            stored(&operator, REQUESTS.name, &subject, &event.id).await? == 1,
            "{} stored once on {subject}",
            event.kind()
        );
        // The hook run again (slurmctld restarted): the same request, proven by the last
        // message on its own subject, and not stored again.
        let again = scheduler.publish(event).await?;
        ensure!(again.duplicate, "{}: a retry is a duplicate", event.kind());
        ensure!(again.sequence == ack.sequence);
        ensure!(stored(&operator, REQUESTS.name, &subject, &event.id).await? == 1);
    }
    Ok(())
}

/// Route three: `demo`'s training job stores, on its own checkpoint subject, messages under the
/// message ids of `labb`'s future `dataset.validated` fact. The validator's fact still reaches
/// the facts stream, once; an honest republish is a duplicate, proven by what is stored.
#[tokio::test]
async fn a_fact_gets_past_a_training_job_borrowing_its_message_id() -> Result<()> {
    let (server, operator) = server().await?;
    let trainer = connect(&server, "trainer-demo", "TRAINER_DEMO").await?;
    let validator = connect(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    let fact = validated("labb", "upload-7");
    let subject = subject_for(&fact.body, &fact.project);
    for borrowed in borrowed_ids(&fact) {
        publish_under(
            &trainer,
            "stagehand.fact.checkpoint.committed.demo",
            &borrowed,
            b"anything".to_vec(),
        )
        .await?;
    }

    let ack = validator.publish(&fact).await?;
    ensure!(!ack.duplicate, "acked as a duplicate of another's message");
    ensure!(stored(&operator, FACTS.name, &subject, &fact.id).await? == 1);
    // Republished at once (a redelivery answered from the ledger): the last fact on its
    // subject is this one, so it is a duplicate, not a second copy.
    let again = validator.publish(&fact).await?;
    ensure!(
        again.duplicate && again.sequence == ack.sequence,
        "{again:?}"
    );
    ensure!(stored(&operator, FACTS.name, &subject, &fact.id).await? == 1);

    // A fact whose id nobody borrowed, republished after other verdicts of `labb` (no longer
    // the last on its subject): proven by its sequence, which services may read.
    let honest = validated("labb", "upload-8");
    let first = validator.publish(&honest).await?;
    validator.publish(&validated("labb", "upload-9")).await?;
    let again = validator.publish(&honest).await?;
    ensure!(
        again.duplicate && again.sequence == first.sequence,
        "{again:?}"
    );
    ensure!(stored(&operator, FACTS.name, &subject, &honest.id).await? == 1);
    Ok(())
}

/// The same id on another subject, published honestly by Stagehand (an id a producer chose
/// for two projects' requests), is two messages: the duplicate window no longer spans
/// subjects.
#[tokio::test]
async fn the_same_id_on_two_projects_subjects_is_two_messages() -> Result<()> {
    let (server, operator) = server().await?;
    let scheduler = tenant(&server, "scheduler", "SCHEDULER").await?;
    let mut demo = stage_request("demo", "1");
    let mut labb = stage_request("labb", "1");
    let shared = EventId::new("job-1-stage").unwrap();
    demo.id = shared.clone();
    labb.id = shared.clone();
    for event in [&demo, &labb] {
        let ack = scheduler.publish(event).await?;
        ensure!(!ack.duplicate, "{}: {ack:?}", event.project);
    }
    for event in [&demo, &labb] {
        let subject = subject_for(&event.body, &event.project);
        ensure!(stored(&operator, REQUESTS.name, &subject, &shared).await? == 1);
    }
    // Not a side effect of a re-publication: the stream holds each under its scoped id.
    let mut s = operator.jetstream().get_stream(REQUESTS.name).await?;
    let state = s.info().await?.state.clone();
    ensure!(state.messages == 2, "{state:?}");
    let first = s.direct_get(state.first_sequence).await?;
    ensure!(
        first.headers.get(MSG_ID_HEADER).map(|v| v.as_str())
            == Some(msg_id_for(&first.subject, shared.as_str()).as_str())
    );
    let _ = wire::decode(&first.payload)?;
    Ok(())
}
