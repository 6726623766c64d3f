//! The shared test stack: the drained check tells handled from lost (a message the server
//! dropped at `max_deliver` leaves nothing pending, yet is reported), the stream reader gives
//! each stored message once with its subject and headers, and a stack writes policies the
//! services load, provisions, and runs the recorder, which answers.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures::StreamExt;
use stagehand_schemas::{EventId, Location, subject};
use stagehand_testkit::{
    Drained, NatsServer, PolicyFiles, Stack, StageRequest, TierSpec, VALIDATION, consumer_state,
    drained, facts_caused_by, pattern_bytes, put_files, stored_messages, validated_fact, wait_for,
    wait_until,
};

const WAIT: Duration = Duration::from_secs(30);

/// A stream `S` on `s.>` with three messages and a durable pull consumer `c` delivering each
/// at most `max_deliver` times.
async fn three_messages(
    max_deliver: i64,
) -> (
    NatsServer,
    jetstream::Context,
    jetstream::consumer::PullConsumer,
) {
    let server = NatsServer::start();
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let stream = js
        .create_stream(stream::Config {
            name: "S".into(),
            subjects: vec!["s.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("c".into()),
            max_deliver,
            ..Default::default()
        })
        .await
        .unwrap();
    for i in 1..=3 {
        js.publish(format!("s.{i}"), "x".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    (server, js, consumer)
}

/// Fetches what `consumer` offers within 200 ms and answers each message with `answer`
/// (given its subject); returns how many came.
async fn answer_batch(
    consumer: &jetstream::consumer::PullConsumer,
    answer: impl Fn(&str) -> AckKind,
) -> usize {
    let mut batch = consumer
        .fetch()
        .max_messages(10)
        .expires(Duration::from_millis(200))
        .messages()
        .await
        .unwrap();
    let mut n = 0;
    while let Some(m) = batch.next().await {
        let m = m.unwrap();
        m.double_ack_with(answer(m.subject.as_str())).await.ok();
        n += 1;
    }
    n
}

#[tokio::test]
async fn a_consumer_is_drained_once_every_message_is_acked_or_terminated() {
    let (_server, js, consumer) = three_messages(5).await;
    assert_eq!(
        consumer_state(&js, "S", "c").await,
        Drained::No,
        "all pending"
    );
    assert_eq!(consumer_state(&js, "S", "absent").await, Drained::No);
    assert!(!drained(&js, "S", &["c"]).await);
    // Delivered but not answered yet: awaiting acks, not drained.
    let mut batch = consumer.fetch().max_messages(3).messages().await.unwrap();
    let mut held = Vec::new();
    while let Some(m) = batch.next().await {
        held.push(m.unwrap());
    }
    assert_eq!(held.len(), 3);
    assert_eq!(
        consumer_state(&js, "S", "c").await,
        Drained::No,
        "acks awaited"
    );
    for m in held {
        let kind = if m.subject.as_str() == "s.2" {
            AckKind::Term
        } else {
            AckKind::Ack
        };
        m.double_ack_with(kind).await.unwrap();
    }
    assert_eq!(
        consumer_state(&js, "S", "c").await,
        Drained::Yes { delivered: 3 }
    );
    assert!(drained(&js, "S", &["c"]).await);
}

/// nats-server, giving up on message 2 at `max_deliver`, stops counting it as pending or
/// awaiting an ack: only the ack floor, stuck below it, tells. The check reports the loss
/// (and `drained` panics) instead of calling the consumer drained.
#[tokio::test]
async fn a_message_dropped_at_max_deliver_is_reported_not_drained() {
    let (_server, js, consumer) = three_messages(2).await;
    let nak_two = |subject: &str| {
        if subject == "s.2" {
            AckKind::Nak(None)
        } else {
            AckKind::Ack
        }
    };
    let state = wait_for(WAIT, "the server to give up on message 2", || async {
        // Each pull gives the server the occasion to redeliver, or to give up.
        answer_batch(&consumer, nak_two).await;
        match consumer_state(&js, "S", "c").await {
            Drained::No => None,
            other => Some(other),
        }
    })
    .await
    .unwrap();
    assert_eq!(
        state,
        Drained::Dropped {
            ack_floor: 1,
            delivered: 3
        }
    );
    let info = js
        .get_stream("S")
        .await
        .unwrap()
        .consumer_info("c")
        .await
        .unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    let panicked = tokio::spawn(async move { drained(&js, "S", &["c"]).await })
        .await
        .unwrap_err();
    assert!(panicked.is_panic());
}

#[tokio::test]
async fn the_stream_reader_gives_each_stored_message_once_with_subject_and_headers() {
    let stack = Stack::builder().start().await;
    let js = stack.bus.jetstream();
    let source = Location {
        tier: "source".into(),
        prefix: "lab/cats/up".into(),
    };
    let files = put_files(
        &stack.root().join("files"),
        &[
            ("a.bin", pattern_bytes(1, 10)),
            ("b/c.bin", pattern_bytes(2, 20)),
        ],
    );
    assert_eq!(files[1].path, "b/c.bin");
    assert_eq!(files[1].size, 20);
    let request = EventId::new("ingest-1").unwrap();
    let fact = validated_fact("lab", request.clone(), "cats", source, &files, None);
    stack.publish(&fact).await;
    // A republished copy is the same message: stored once.
    stack.publish(&fact).await;
    let stage = StageRequest::new("lab", "cats", "0123456789abcdef", "hot", "job-1");
    stack.publish(&stage.event()).await;
    let facts = stored_messages(js, subject::FACTS.name, "").await.unwrap();
    assert_eq!(facts.len(), 1);
    assert_eq!(facts[0].subject, "stagehand.fact.dataset.validated.lab");
    let msg_id = facts[0].headers.get("Nats-Msg-Id").map(|v| v.as_str());
    assert!(
        msg_id.is_some_and(|id| id.contains(fact.id.as_str())),
        "{msg_id:?}"
    );
    assert_eq!(facts[0].event().unwrap(), fact);
    assert_eq!(facts_caused_by(js, &request).await, vec![fact]);
    let requests = stored_messages(js, subject::REQUESTS.name, "")
        .await
        .unwrap();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].event().unwrap().id, stage.event().id);
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_writes_policies_the_services_load_and_runs_the_recorder() {
    let stack = Stack::builder()
        .shipped_accounts()
        .tier("source", TierSpec::posix("source", "lab"))
        .tier(
            "hot",
            TierSpec::posix("hot", "hot")
                .capacity("1 GiB")
                .watermarks(0.85, 0.5)
                .quotas("default = \"100 MiB\""),
        )
        .policies(PolicyFiles::new().validation(VALIDATION))
        .recorder()
        .start()
        .await;
    let policies = stagehand_policy::Policies::load_dir(&stack.policies).unwrap();
    assert!(policies.tier("hot").is_some());
    assert!(stack.tier("hot").is_dir() && stack.tier("source").is_dir());
    let catalogue = stack.catalogue();
    wait_until(WAIT, "the recorder to answer", || async {
        catalogue.datasets(None, None, None).await.is_ok()
    })
    .await
    .unwrap();
    stack.stop().await;
}
