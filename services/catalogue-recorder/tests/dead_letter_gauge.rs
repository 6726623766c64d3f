//! `stagehand_dead_letters_waiting` (issue 18 item 2) against a real nats-server and the real
//! recorder: the gauge of a service counts its dead letters and goes down when one is
//! replayed or discarded (once, however often), as `catalogue dead-letters` does. One test in this process, so the
//! process-wide gauge is this test's alone.

use std::time::Duration;

use stagehand_bus::{Bus, BusConfig, CancellationToken, runner};
use stagehand_catalogue_recorder::{SERVICE, Settings, serve};
use stagehand_schemas::*;
use stagehand_telemetry::names;
use stagehand_testkit::{NatsServer, scrape_sample, wait_until};

const WAIT: Duration = Duration::from_secs(30);

fn dead_letter(seq: u64) -> Event {
    Event::request(
        EventId::new(format!("dead-{seq}")).unwrap(),
        "lab-a",
        Body::DeadLetter(DeadLetter {
            service: "ingest-validator".into(),
            stream: "STAGEHAND_REQUESTS".into(),
            consumer: "ingest-validator".into(),
            stream_sequence: seq,
            subject: "stagehand.req.ingest.requested.lab-a".into(),
            delivered: 8,
            original: vec![0xc1],
            headers: vec![],
            errors: vec![],
            original_id: None,
        }),
    )
}

fn replayed(dead: &Event) -> Event {
    let Body::DeadLetter(d) = &dead.body else {
        panic!("not a dead letter")
    };
    dead.caused(
        "replayed",
        Body::DeadLetterReplayed(DeadLetterReplayed {
            service: d.service.clone(),
            dead_letter_id: dead.id.clone(),
            dead_letter_sequence: d.stream_sequence,
            subject: d.subject.clone(),
            original_id: None,
            replay_msg_id: format!("replay-{}", d.stream_sequence),
            replayed_by: "operator".into(),
        }),
    )
}

fn discarded(dead: &Event) -> Event {
    let Body::DeadLetter(d) = &dead.body else {
        panic!("not a dead letter")
    };
    dead.caused(
        "discarded",
        Body::OperatorAction(OperatorAction {
            action: action::DLQ_DISCARD.into(),
            by: "oncall".into(),
            target: format!("dead letter {} of {}", d.stream_sequence, d.service),
            reason: "withdrawn".into(),
            service: Some(d.service.clone()),
            dead_letter_id: Some(dead.id.clone()),
            dead_letter_sequence: Some(d.stream_sequence),
            request_id: None,
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_gauge_counts_dead_letters_less_their_replays_and_discards()
-> anyhow::Result<()> {
    let handle = stagehand_telemetry::metrics::install();
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let dir = tempfile::tempdir()?;
    let shutdown = CancellationToken::new();
    let recorder = tokio::spawn(serve(runner::Context::new(
        SERVICE,
        Settings::under(dir.path()),
        bus.clone(),
        shutdown.clone(),
    )));
    let label = r#"service="ingest-validator""#;
    let waiting = || scrape_sample(&handle.render(), names::DEAD_LETTERS_WAITING, label);

    let (first, second, third) = (dead_letter(1), dead_letter(2), dead_letter(3));
    for dead in [&first, &second, &third] {
        bus.publish(dead).await?;
    }
    wait_until(WAIT, "three dead letters waiting", || async {
        waiting() == Some(3.0)
    })
    .await?;
    bus.publish(&replayed(&second)).await?;
    wait_until(WAIT, "the replayed one to stop waiting", || async {
        waiting() == Some(2.0)
    })
    .await?;

    // A discard, twice, and one of the dead letter replayed already: one less.
    bus.publish(&discarded(&first)).await?;
    bus.publish(&discarded(&second)).await?;
    wait_until(WAIT, "the discarded one to stop waiting", || async {
        waiting() == Some(1.0)
    })
    .await?;
    let mut copy = discarded(&first);
    copy.id = EventId::new("discarded-again")?;
    bus.publish(&copy).await?;
    let fourth = dead_letter(4);
    bus.publish(&fourth).await?;
    wait_until(WAIT, "only the fourth added", || async {
        waiting() == Some(2.0)
    })
    .await?;
    // Once both of the recorder's consumers have handled everything, it still is.
    wait_until(WAIT, "the recorder to fold everything", || async {
        let js = bus.jetstream();
        stagehand_testkit::drained_through(js, subject::FACTS.name, SERVICE)
            .await
            .is_some()
            && stagehand_testkit::drained_through(
                js,
                subject::DEAD_LETTERS.name,
                &format!("{SERVICE}-dlq"),
            )
            .await
            .is_some()
    })
    .await?;
    assert_eq!(waiting(), Some(2.0), "{}", handle.render());

    shutdown.cancel();
    recorder.await??;
    Ok(())
}
