//! Side data: a file larger than a piece has its piece hashes taken in the same read as its
//! SHA-256 and stored in the services' manifest bucket under the SHA-256 found, before the
//! verdict is published; a file of a piece or less has none. On posix and S3 source tiers,
//! against a real nats-server (and S3 server).

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use common::*;
use stagehand_bus::{Bus, BusConfig, CancellationToken, WorkerStats, run_worker};
use stagehand_ingest_validator::{IngestValidator, Settings, SourceChecks, ValidatorOptions};
use stagehand_manifest::{BucketOptions, ManifestStore};
use stagehand_mover::Tier;
use stagehand_mover::s3::{S3Config, S3Tier};
use stagehand_policy::{Policies, TierRole};
use stagehand_schemas::pieces::{PIECE_BYTES, PieceHashes};
use stagehand_schemas::{Body, Event, FileRef, sha256_hex, version_digest};
use stagehand_testkit::{NatsServer, PolicyFiles, S3Server, TierSpec};

/// Files up to 64 MiB, so that files of several pieces pass the policy.
const VALIDATION: &str = r#"
max_file_size = "64 MiB"
max_entries = 1000
max_total_bytes = "1 GiB"
allowed_suffixes = []
denied_suffixes = []
allow_hidden = false
"#;

/// `len` bytes that differ from piece to piece (`seed` tells files apart).
fn body(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 13) ^ seed ^ (i / 65_537)) as u8)
        .collect()
}

/// The validator's handler over `tier` (named `name`, role source), run by the worker
/// runtime against `nats`.
struct Running {
    bus: Bus,
    shutdown: CancellationToken,
    worker: tokio::task::JoinHandle<WorkerStats>,
    _tmp: tempfile::TempDir,
}

impl Running {
    async fn start(nats: &NatsServer, name: &str, tier: Tier) -> Running {
        let tmp = tempfile::tempdir().unwrap();
        let policies_dir = tmp.path().join("policies");
        PolicyFiles::new()
            .tier(
                "source",
                TierSpec::posix("source", "lab").root(tmp.path().join("unused")),
            )
            .validation(VALIDATION)
            .write(&policies_dir);
        let policies = Policies::load_dir_with_home(&policies_dir, tmp.path()).unwrap();
        let tiers = HashMap::from([(name.to_owned(), (TierRole::Source, Some(tier)))]);
        let checks = SourceChecks::from_parts(policies.validation().clone(), tiers);
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        let state = tmp.path().join("state");
        let handler = IngestValidator::new(
            checks,
            bus.jetstream().clone(),
            ValidatorOptions::new(&state),
        )
        .unwrap();
        let cfg = Settings::new(&policies_dir, &state).worker_config();
        let shutdown = CancellationToken::new();
        let worker = tokio::spawn(run_worker(
            bus.clone(),
            cfg,
            Arc::new(handler),
            shutdown.clone(),
        ));
        let worker = tokio::spawn(async move { worker.await.unwrap().expect("worker") });
        Running {
            bus,
            shutdown,
            worker,
            _tmp: tmp,
        }
    }

    async fn stop(self) -> WorkerStats {
        self.shutdown.cancel();
        self.worker.await.unwrap()
    }
}

/// A request of [`PROJECT`] for `files` beneath `prefix` on source tier `tier`.
fn request_on(tier: &str, id: &str, prefix: &str, files: Vec<FileRef>) -> Event {
    let mut event = request(id, prefix, files);
    let Body::IngestRequested(r) = &mut event.body else {
        unreachable!()
    };
    r.source.tier = tier.into();
    event
}

/// A version of a file of two pieces and a bit and a small file is validated; the bucket then
/// holds exactly the large file's side data, equal to its bytes' piece hashes.
async fn a_large_file_has_its_side_data_stored_before_the_verdict(
    running: &Running,
    tier: &str,
    prefix: &str,
    large: &[u8],
    small: &[u8],
) {
    let files = vec![
        FileRef::new("big/weights.bin", large.len() as u64, sha256_hex(large)),
        FileRef::new("small.json", small.len() as u64, sha256_hex(small)),
    ];
    running
        .bus
        .publish(&request_on(tier, "pieces-1", prefix, files.clone()))
        .await
        .unwrap();
    let js = running.bus.jetstream();
    let fact = fact_for(js, "pieces-1").await;
    let Body::DatasetValidated(v) = &fact.body else {
        panic!("expected dataset.validated, got {fact:?}")
    };
    assert_eq!(v.version, version_digest(&files));
    // The fact is out, so every side data of the version is stored.
    let store = ManifestStore::catalogue(js, BucketOptions::default())
        .await
        .unwrap();
    let size = large.len() as u64;
    let stored = store.pieces(&sha256_hex(large), size).await.unwrap();
    assert_eq!(stored, Some(PieceHashes::of(large)));
    assert_eq!(stored.unwrap().pieces.len(), 3);
    assert_eq!(
        store
            .pieces(&sha256_hex(small), small.len() as u64)
            .await
            .unwrap(),
        None
    );
    // The manifest travels inline: the side data is all the bucket holds.
    assert_eq!(v.manifest, None);
    assert_eq!(
        store.list().await.unwrap(),
        vec![PieceHashes::object_name(&sha256_hex(large))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_posix_upload_stores_the_side_data_of_its_large_files() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("source");
    let tier = Tier::Posix(stagehand_mover::PosixTier::open("source", mkdir(&root)).unwrap());
    let running = Running::start(&nats, "source", tier).await;
    let prefix = "lab-a/up/model";
    let large = body(2 * PIECE_BYTES + 123, 1);
    let small = b"{\"epochs\": 3}".to_vec();
    put(&root, prefix, "big/weights.bin", &large);
    put(&root, prefix, "small.json", &small);
    a_large_file_has_its_side_data_stored_before_the_verdict(
        &running, "source", prefix, &large, &small,
    )
    .await;

    // A large file that is not what its manifest says: rejected, and its side data is stored
    // under the hash of the bytes read (true of them, whatever the verdict).
    let other = body(PIECE_BYTES + 1, 2);
    put(&root, prefix, "other.bin", &other);
    let declared = FileRef::new("other.bin", other.len() as u64, sha256_hex(b"not these"));
    running
        .bus
        .publish(&request_on("source", "pieces-2", prefix, vec![declared]))
        .await
        .unwrap();
    let fact = fact_for(running.bus.jetstream(), "pieces-2").await;
    assert_eq!(
        problems_of(&fact),
        vec![("checksum_mismatch".to_owned(), Some("other.bin".to_owned()))]
    );
    let store = ManifestStore::catalogue(running.bus.jetstream(), BucketOptions::default())
        .await
        .unwrap();
    assert_eq!(
        store
            .pieces(&sha256_hex(&other), other.len() as u64)
            .await
            .unwrap(),
        Some(PieceHashes::of(&other))
    );
    let stats = running.stop().await;
    assert_eq!((stats.handled, stats.retried), (2, 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_upload_stores_the_side_data_of_its_large_files() {
    let nats = NatsServer::start();
    let s3 = S3Server::shared();
    let bucket = s3.unique_bucket("pieces");
    let mut config = S3Config::new(&bucket, "tier");
    config.endpoint = Some(s3.endpoint());
    config.region = s3.region().to_owned();
    let tier = S3Tier::connect_with_keys("lake", config, s3.access_key(), s3.secret_key()).unwrap();
    let running = Running::start(&nats, "lake", Tier::S3(tier)).await;
    let prefix = "lab-a/up/s3-model";
    let large = body(2 * PIECE_BYTES + 123, 3);
    let small = b"{\"epochs\": 4}".to_vec();
    for (path, bytes) in [("big/weights.bin", &large), ("small.json", &small)] {
        s3.put_object(&bucket, &format!("tier/{prefix}/{path}"), bytes)
            .unwrap();
    }
    a_large_file_has_its_side_data_stored_before_the_verdict(
        &running, "lake", prefix, &large, &small,
    )
    .await;
    let stats = running.stop().await;
    assert_eq!((stats.handled, stats.retried), (1, 0), "{stats:?}");
}

fn mkdir(path: &Path) -> &Path {
    std::fs::create_dir_all(path).unwrap();
    path
}
