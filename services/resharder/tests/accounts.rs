//! The resharder under its own user of `deploy/nats/accounts.conf`, against a real nats-server
//! started with that file and provisioned by the operator (streams, claims, the services'
//! manifest bucket), as the shipped configuration runs it (`bus.provision = false`): it checks
//! what it uses exists, consumes `dataset.validated` with its own durable, claims in its own
//! keys, reads a raw manifest by reference from `stagehand_manifests`, publishes
//! `dataset.prepared`, and dead-letters a derivation that fails.

mod common;

use std::time::Duration;

use common::*;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_resharder::{config, run};
use stagehand_schemas::layout::version_folder;
use stagehand_testkit::{NatsServer, user_url};

/// A connection as `user`; only the operator's manages streams (`stagehand provision`).
async fn bus_as(server: &NatsServer, user: &str, role: &str) -> Bus {
    let mut cfg = BusConfig::new(user_url(server, user, role));
    cfg.provision = user == "operator";
    cfg.connect_timeout = Duration::from_secs(10);
    Bus::connect(&cfg).await.unwrap()
}

/// Guards the resharder's rights in `accounts.conf`: a version by reference is packed and its
/// `dataset.prepared` published, and a corrupted one dead-lettered naming its path, all as
/// the `resharder` user (a missing grant would stall the first or lose the second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resharder_packs_and_dead_letters_under_its_own_user() {
    let nats = NatsServer::builder().shipped_accounts().start();
    let operator = bus_as(&nats, "operator", "OPERATOR").await;
    operator.provision().await.unwrap();
    let js = operator.jetstream().clone();

    let tmp = tempfile::tempdir().unwrap();
    let (source, capacity) = (tmp.path().join("source"), tmp.path().join("capacity"));
    let policies = tmp.path().join("policies");
    write_policies(&policies, &source, &capacity, &packing("1 MiB", ""));
    let mut cfg = config(
        &user_url(&nats, "resharder", "RESHARDER"),
        &policies,
        tmp.path().join("state"),
    );
    cfg.bus.provision = false;
    cfg.bus.connect_timeout = Duration::from_secs(10);
    cfg.service.read_threads = 2;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(run(cfg, shutdown.clone()));

    // Published as the validator publishes: its user, the manifest in the services' bucket.
    let validator = bus_as(&nats, "ingest-validator", "INGEST_VALIDATOR").await;
    let raw = image_samples(40);
    let files = place(&source, "lab/pets/up", &raw);
    let good = publish_validated(&validator, "pets", "pets", "lab/pets/up", files, true).await;
    let (fact, prepared_body) = prepared(&js, &good).await;
    assert_eq!(prepared_body.samples, 40);
    let version = prepared_files(&js, &fact).await;
    let dir = capacity.join(version_folder(PROJECT, "pets", &prepared_body.version));
    let read = read_shards(&dir);
    assert_eq!(read.len(), raw.len());
    assert!(version.iter().any(|f| f.path == "prepared.json"));

    let bad_raw = image_samples(40);
    let files = place(&source, "lab/bad/up", &bad_raw);
    let victim = &files[3].path;
    let on_disk = source.join("lab/bad/up").join(victim);
    let mut bytes = std::fs::read(&on_disk).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&on_disk, &bytes).unwrap();
    let bad = publish_validated(&validator, "bad", "bad", "lab/bad/up", files.clone(), true).await;
    let error = dead_letter(&js, &bad.id).await;
    assert!(error.contains(victim.as_str()), "{error}");

    shutdown.cancel();
    let stats = task.await.unwrap().expect("resharder run");
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
}
