//! The benchmarks count what happened from the facts stream, not from what a core subscriber
//! sees: the promoter publishes each answer twice (as it answers, and through the worker
//! runtime), so stage-bench's `fifty` case once reported `copies: 2` for one copy.

use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::{Body, Event, EventId, Location, ReplicaCreated};
use stagehand_testkit::NatsServer;

fn replica_created(request: &str) -> Event {
    let request = EventId::new(request).unwrap();
    let fact = Event::request(
        request.clone(),
        "bench",
        Body::ReplicaCreated(ReplicaCreated {
            dataset: "fifty".into(),
            version: "ab".repeat(32),
            location: Location {
                tier: "hot".into(),
                prefix: "bench/fifty/v".into(),
            },
            files: 1,
            total_bytes: 1,
            verified_by: "hashed-in-flight".into(),
            node: None,
        }),
    );
    fact.caused("replica:hot", fact.body.clone())
}

/// Guards stage-bench's `copies`: one copy whose fact is published twice counts once, two
/// copies (two requests' facts) count twice — while a core subscriber sees three messages.
#[tokio::test]
async fn a_fact_published_twice_is_one_stored_fact() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let mut seen = bus
        .client()
        .subscribe("stagehand.fact.replica.created.bench")
        .await
        .unwrap();
    let once = replica_created("stage-1");
    bus.publish(&once).await.unwrap();
    bus.publish(&once).await.unwrap();
    bus.publish(&replica_created("stage-2")).await.unwrap();
    let mut publishes = 0;
    while publishes < 3 {
        seen.next().await.unwrap();
        publishes += 1;
    }
    let stored = stagehand_loadtest::stored_facts(&bus, "replica.created", "bench")
        .await
        .unwrap();
    let ids: Vec<_> = stored.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ids, [once.id, replica_created("stage-2").id]);
}
