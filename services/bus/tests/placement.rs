//! The replica use record of `stagehand_bus::placement` against a real nats-server: the
//! compare-and-sets that keep a promoter from handing out a replica the demoter removes.

use stagehand_bus::placement::{self, Served, UseState};
use stagehand_bus::{Bus, BusConfig, PROMOTER};
use stagehand_testkit::NatsServer;

const TIER: &str = "hot";
const PREFIX: &str = "lab/cats/0123456789ab";

/// Guards the interleavings of one promoter request and one removal: a request served after
/// the demoter read the record makes the withdrawal's compare-and-set fail; a withdrawing
/// record serves no one; given back it serves again; deleted (the removal finished) a request
/// starts a fresh record; and a repeated delete leaves that fresh record alone.
#[tokio::test]
async fn a_withdrawal_loses_to_a_request_served_after_it_read_and_then_serves_no_one() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    let store = bus.provision_kv(&PROMOTER).await.unwrap();

    // The demoter reads (nothing yet); a request is served; the demoter's take fails.
    let seen = placement::read_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    assert_eq!(seen.value, None);
    let served = placement::serve(&store, TIER, None, PREFIX, "req-1")
        .await
        .unwrap();
    assert_eq!(served, Served::Yes);
    let taken = placement::begin_withdraw(&store, TIER, None, PREFIX, &seen, "idle")
        .await
        .unwrap();
    assert_eq!(taken, None, "a withdrawal on a stale read must fail");

    // Read again, taken: the served request comes back for the holds check; nobody is served.
    let seen = placement::read_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    let taken = placement::begin_withdraw(&store, TIER, None, PREFIX, &seen, "idle")
        .await
        .unwrap()
        .expect("taken");
    assert_eq!(taken.served, vec!["req-1".to_owned()]);
    assert_eq!(
        placement::serve(&store, TIER, None, PREFIX, "req-2")
            .await
            .unwrap(),
        Served::Withdrawing {
            reason: Some("idle".into())
        }
    );
    // A second take (a restarted step) finds it already taken.
    let again = placement::read_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    assert!(
        placement::begin_withdraw(&store, TIER, None, PREFIX, &again, "idle")
            .await
            .unwrap()
            .is_some()
    );

    // Undone: it serves again.
    placement::end_withdraw(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    assert_eq!(
        placement::serve(&store, TIER, None, PREFIX, "req-2")
            .await
            .unwrap(),
        Served::Yes
    );
    let now = placement::read_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    let value = now.value.clone().unwrap();
    assert_eq!(value.state, UseState::Serving);
    assert_eq!(value.served, vec!["req-1".to_owned(), "req-2".to_owned()]);

    // Removed for good: taken, then deleted; a request starts afresh, and deleting again (a
    // repeated step) leaves the fresh record.
    placement::begin_withdraw(&store, TIER, None, PREFIX, &now, "idle")
        .await
        .unwrap()
        .expect("taken");
    placement::forget_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    let gone = placement::read_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    assert_eq!(gone.value, None);
    assert_eq!(
        placement::serve(&store, TIER, None, PREFIX, "req-3")
            .await
            .unwrap(),
        Served::Yes
    );
    placement::forget_use(&store, TIER, None, PREFIX)
        .await
        .unwrap();
    let fresh = placement::read_use(&store, TIER, None, PREFIX)
        .await
        .unwrap()
        .value
        .expect("the fresh record stays");
    assert_eq!(fresh.served, vec!["req-3".to_owned()]);
}

/// Guards the space of a removed replica: given back once (idempotent), others untouched.
#[tokio::test]
async fn a_reservation_is_given_back_once() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    let store = bus.provision_kv(&PROMOTER).await.unwrap();
    let mut r = placement::Reservations::default();
    r.replicas.insert(PREFIX.into(), 10);
    r.replicas.insert("lab/dogs/0123456789ab".into(), 5);
    assert!(
        placement::write_reservations(&store, TIER, None, &r, None)
            .await
            .unwrap()
    );
    assert!(
        placement::release_reservation(&store, TIER, None, PREFIX)
            .await
            .unwrap()
    );
    assert!(
        !placement::release_reservation(&store, TIER, None, PREFIX)
            .await
            .unwrap()
    );
    let left = placement::reservations(&store, TIER, None)
        .await
        .unwrap()
        .value
        .unwrap();
    assert_eq!(left.total(), 5);
}
