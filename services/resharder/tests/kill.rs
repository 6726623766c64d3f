//! The `stagehand-resharder` binary killed with SIGKILL in the middle of a derivation: no
//! partial derived version is visible and no fact is published; restarted, it clears what the
//! dead run left and completes the derivation.

mod common;

use std::path::Path;

use common::*;
use stagehand_bus::{Bus, BusConfig};
use stagehand_testkit::{NatsServer, wait_until};

/// A finished shard inside a hidden staging folder beneath `dir`: the derivation is under way.
fn staged_shard(dir: &Path) -> bool {
    names(dir)
        .iter()
        .filter(|n| n.starts_with('.'))
        .any(|n| names(&dir.join(n)).iter().any(|f| f == "shard-000000.tar"))
}

/// Guards crash safety of a derivation: SIGKILL mid-way leaves only the hidden staging folder
/// (no version folder, no `dataset.prepared`), and the retry after a restart completes with
/// every member in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_derivation_leaves_no_partial_version_and_the_retry_completes() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let (source, capacity) = (tmp.path().join("source"), tmp.path().join("capacity"));
    let policies = tmp.path().join("policies");
    write_policies(&policies, &source, &capacity, &packing("1 MiB", ""));
    let state = tmp.path().join("state");
    let config = tmp.path().join("resharder.toml");

    // About 14 MiB in 400 samples: at 4 MiB/s the first run takes a few seconds, long after
    // its first 1 MiB shard is written.
    let raw: Vec<(String, Vec<u8>)> = (0..400)
        .flat_map(|i| {
            let key = format!("frames/{i:05}");
            [
                (
                    format!("{key}.png"),
                    bytes(i, 30_000 + (i as usize * 131) % 10_000),
                ),
                (format!("{key}.txt"), format!("frame {i}").into_bytes()),
            ]
        })
        .collect();
    let manifest = place(&source, "lab/video/up", &raw);

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let js = bus.jetstream().clone();
    let event = publish_validated(&bus, "video", "video", "lab/video/up", manifest, true).await;

    write_config(&config, &nats.url(), &policies, &state, Some("4 MiB"));
    let first = spawn_resharder(&config, &tmp.path().join("first.log"), &[]);
    let dataset_dir = capacity.join("lab/video");
    wait_until(TIMEOUT, "a shard written in the staging folder", || async {
        staged_shard(&dataset_dir)
    })
    .await
    .unwrap();
    drop(first); // SIGKILL, then reaped.

    let left = names(&dataset_dir);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        left[0].starts_with('.'),
        "only the hidden staging folder: {left:?}"
    );
    assert!(
        facts_of(&js, &event.id).await.is_empty(),
        "nothing published"
    );

    write_config(&config, &nats.url(), &policies, &state, None);
    let _second = spawn_resharder(&config, &tmp.path().join("second.log"), &[]);
    let (_, p) = prepared(&js, &event).await;
    assert_eq!(p.samples, 400);
    let left = names(&dataset_dir);
    assert_eq!(left, vec![p.version.clone()], "the version alone: {left:?}");
    let members = read_shards(&capacity.join(&p.location.prefix));
    assert_eq!(members.len(), 800);
    for m in &members {
        let (_, data) = raw.iter().find(|(path, _)| *path == m.path).unwrap();
        assert_eq!(&m.data, data, "{}", m.path);
    }
    let log = std::fs::read_to_string(tmp.path().join("second.log")).unwrap();
    assert!(
        log.contains("cleared the staging folder a killed derivation left"),
        "{log}"
    );
}
