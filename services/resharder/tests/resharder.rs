//! The resharder against a real nats-server with JetStream and real posix tiers: validated
//! versions packed into WebDataset shards that read back as the raw samples, byte for byte,
//! in the seeded order; the same input giving the same derived version and another seed
//! another; a corrupted member failing the derivation by name; incomplete samples handled as
//! the policy says; versions the policy does not select left alone.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use stagehand_bus::{Bus, BusConfig, CancellationToken, WorkerStats};
use stagehand_resharder::{config, problem_report_path, run};
use stagehand_schemas::layout::version_folder;
use stagehand_schemas::{FileRef, subject};
use stagehand_testkit::{NatsServer, wait_until};

/// A nats-server, posix source and capacity tiers in a temp dir, and the resharder running
/// in-process with `packing` as its policy.
struct Harness {
    _nats: NatsServer,
    _tmp: tempfile::TempDir,
    source: PathBuf,
    capacity: PathBuf,
    bus: Bus,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<WorkerStats>,
}

impl Harness {
    async fn start(packing: &str) -> Harness {
        let nats = NatsServer::start();
        let tmp = tempfile::tempdir().unwrap();
        let source = tmp.path().join("source");
        let capacity = tmp.path().join("capacity");
        let policies = tmp.path().join("policies");
        write_policies(&policies, &source, &capacity, packing);
        let mut config = config(&nats.url(), &policies, tmp.path().join("state"));
        config.service.read_threads = 2;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(config, shutdown.clone()));
        let task = tokio::spawn(async move { task.await.unwrap().expect("resharder run") });
        let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
        bus.provision().await.unwrap();
        Harness {
            _nats: nats,
            _tmp: tmp,
            source,
            capacity,
            bus,
            shutdown,
            task,
        }
    }

    async fn stop(self) -> WorkerStats {
        self.shutdown.cancel();
        self.task.await.unwrap()
    }
}

fn key_of(path: &str) -> String {
    stagehand_resharder::sample::split_key(path)
        .unwrap()
        .0
        .to_owned()
}

/// The keys of `members` in shard order, each once.
fn sample_order(members: &[ReadMember]) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for m in members {
        let key = key_of(&m.path);
        if keys.last() != Some(&key) {
            keys.push(key);
        }
    }
    keys
}

/// Guards the promise of a prepared version: every raw file comes back exactly once, byte for
/// byte, grouped by sample in the seeded order; the same input (another dataset, another
/// source folder, a manifest by reference instead of inline) gives the same derived version,
/// and another seed another order and another version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_input_same_version_another_seed_another_order() {
    let h = Harness::start(&packing(
        "1 MiB",
        "[datasets.\"lab/cats-seeded\"]\nseed = 7\n",
    ))
    .await;
    let raw = image_samples(300);
    let manifest = place(&h.source, "lab/cats/up-1", &raw);
    place(&h.source, "lab/cats-again/up-2", &raw);
    place(&h.source, "lab/cats-seeded/up-3", &raw);
    let js = h.bus.jetstream().clone();
    let a = publish_validated(
        &h.bus,
        "a",
        "cats",
        "lab/cats/up-1",
        manifest.clone(),
        false,
    )
    .await;
    let b = publish_validated(
        &h.bus,
        "b",
        "cats-again",
        "lab/cats-again/up-2",
        manifest.clone(),
        true,
    )
    .await;
    let c = publish_validated(
        &h.bus,
        "c",
        "cats-seeded",
        "lab/cats-seeded/up-3",
        manifest.clone(),
        false,
    )
    .await;
    let (fa, pa) = prepared(&js, &a).await;
    let (_, pb) = prepared(&js, &b).await;
    let (_, pc) = prepared(&js, &c).await;

    let raw_version = stagehand_schemas::version_digest(&manifest);
    for p in [&pa, &pb, &pc] {
        assert_eq!(p.derived_from, raw_version);
        assert_eq!(p.layout, "webdataset");
        assert_eq!(p.samples, 300);
        assert_eq!(p.location.tier, "capacity");
    }
    assert_eq!((pa.seed, pc.seed), (0, 7));
    assert_eq!(pa.version, pb.version, "same input and seed: same version");
    assert_ne!(pa.version, pc.version, "another seed: another version");
    assert_eq!(
        pa.location.prefix,
        version_folder("lab", "cats", &pa.version)
    );
    assert_eq!(fa.id, a.caused("prepared", fa.body.clone()).id);

    // The shard manifest lists what is on the tier, and hashes to the version.
    let files = prepared_files(&js, &fa).await;
    assert_eq!(stagehand_schemas::version_digest(&files), pa.version);
    let dir_a = h.capacity.join(&pa.location.prefix);
    let dir_b = h.capacity.join(&pb.location.prefix);
    let shards = files.iter().filter(|f| f.path.ends_with(".tar")).count();
    assert!(shards >= 3, "{shards} shards of 1 MiB for ~2.7 MiB");
    assert_eq!(
        files.len(),
        2 * shards + 1,
        "shards, their indexes, prepared.json"
    );
    for f in &files {
        let bytes = std::fs::read(dir_a.join(&f.path)).unwrap();
        assert_eq!(
            FileRef::new(
                f.path.clone(),
                bytes.len() as u64,
                stagehand_schemas::sha256_hex(&bytes)
            ),
            *f
        );
        assert_eq!(
            std::fs::read(dir_b.join(&f.path)).unwrap(),
            bytes,
            "byte-identical: {}",
            f.path
        );
        if f.path.ends_with(".tar") {
            assert!(f.size <= 1 << 20, "{} is {} bytes", f.path, f.size);
        }
    }
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir_a.join("prepared.json")).unwrap()).unwrap();
    assert_eq!(doc["derived_from"], raw_version);
    assert_eq!(doc["samples"], 300);
    assert_eq!(doc["members"], 900);
    assert_eq!(doc["shuffle"], "sha256-keyed-order-v1");

    // Read back: every raw file once, byte for byte, samples whole, in the seeded order.
    let keys: Vec<String> = (0..300).map(|i| format!("train/{i:04}")).collect();
    let raw_by_path: BTreeMap<&str, &[u8]> = raw
        .iter()
        .map(|(p, d)| (p.as_str(), d.as_slice()))
        .collect();
    for (dir, seed) in [(&dir_a, 0u64), (&h.capacity.join(&pc.location.prefix), 7)] {
        let members = read_shards(dir);
        assert_eq!(members.len(), 900);
        let mut seen = BTreeMap::new();
        for m in &members {
            assert_eq!(
                raw_by_path.get(m.path.as_str()),
                Some(&m.data.as_slice()),
                "{}",
                m.path
            );
            assert!(
                seen.insert(m.path.clone(), ()).is_none(),
                "{} twice",
                m.path
            );
        }
        let order = sample_order(&members);
        assert_eq!(order.len(), 300, "each sample's members are adjacent");
        assert_eq!(order, seeded_order(&keys, seed), "seed {seed}");
    }
    let order_a = sample_order(&read_shards(&dir_a));
    let order_c = sample_order(&read_shards(&h.capacity.join(&pc.location.prefix)));
    assert_ne!(order_a, order_c);

    // Nothing but the versions is left on the target tier: no staging folder, no temp file.
    for dataset in ["cats", "cats-again", "cats-seeded"] {
        let left = names(&h.capacity.join("lab").join(dataset));
        assert_eq!(left.len(), 1, "{dataset}: {left:?}");
        assert!(!left[0].starts_with('.'), "{left:?}");
    }
    assert!(names(&dir_a).iter().all(|n| !n.starts_with('.')));
    let stats = h.stop().await;
    assert_eq!(stats.dead_lettered, 0);
}

/// Guards the checksum chain raw → shard: a member whose bytes on the source changed since
/// the upload (one byte, same size) fails the derivation naming its path, and nothing of the
/// derived version becomes visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_member_fails_the_derivation_naming_its_path() {
    let h = Harness::start(&packing("1 MiB", "")).await;
    let raw = image_samples(200);
    let manifest = place(&h.source, "lab/dogs/up", &raw);
    let victim = h.source.join("lab/dogs/up/train/0123.jpg");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[100] ^= 0xFF;
    std::fs::write(&victim, &bytes).unwrap();
    let js = h.bus.jetstream().clone();
    let event = publish_validated(&h.bus, "dogs", "dogs", "lab/dogs/up", manifest, false).await;
    let error = dead_letter(&js, &event.id).await;
    assert!(error.contains("train/0123.jpg"), "{error}");
    assert!(error.contains("hash"), "{error}");
    assert!(facts_of(&js, &event.id).await.is_empty(), "no fact");
    assert_eq!(names(&h.capacity.join("lab/dogs")), Vec::<String>::new());
    let stats = h.stop().await;
    assert_eq!(stats.dead_lettered, 1);
}

/// Guards the checksum chain raw → shard → tier, followed through what is recorded: the
/// prepared fact's `derived_from` leads to the raw version's `dataset.validated` and its
/// manifest (by reference, verified against that digest); every index entry is exactly one
/// raw entry (path, size, the upload's SHA-256) and every raw entry is in one index; every
/// member's bytes at its offset hash to it; the mover copies the prepared version to another
/// tier proving every shard against the prepared manifest. One byte flipped inside a shard on
/// the tier is then found at both hops: the mover refuses the copy naming that shard, and the
/// index names the one member whose bytes no longer hash to the upload's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checksum_chain_leads_from_every_shard_member_back_to_the_raw_version() {
    use stagehand_mover::{
        CancellationToken, ErrorKind, Mover, MoverConfig, PosixTier, Progress, SetCopy, Tier,
    };

    let h = Harness::start(&packing("1 MiB", "")).await;
    let raw = image_samples(200);
    let manifest = place(&h.source, "lab/owls/up", &raw);
    let js = h.bus.jetstream().clone();
    let event = publish_validated(&h.bus, "owls", "owls", "lab/owls/up", manifest, true).await;
    let (fact, p) = prepared(&js, &event).await;

    // derived_from → the raw version's fact and manifest, as any reader finds them.
    let validated = stream_messages(&js, subject::FACTS.name)
        .await
        .iter()
        .filter_map(|m| m.event().ok())
        .find(|e: &stagehand_schemas::Event| {
            matches!(&e.body, stagehand_schemas::Body::DatasetValidated(v) if v.version == p.derived_from)
        })
        .expect("the raw version's dataset.validated");
    let spool = tempfile::tempdir().unwrap();
    let raw_manifest = stagehand_manifest::open_manifest(
        &js,
        &validated,
        &stagehand_manifest::Spool::in_dir(spool.path()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(raw_manifest.digest(), p.derived_from);
    let mut raw_entries: BTreeMap<String, FileRef> = raw_manifest
        .entries()
        .map(|f| f.unwrap())
        .map(|f| (f.path.clone(), f))
        .collect();
    assert_eq!(raw_entries.len(), 600);

    // Every index entry is one raw entry, and its bytes in the shard hash to it.
    let files = prepared_files(&js, &fact).await;
    let dir = h.capacity.join(&p.location.prefix);
    let mut located = Vec::new();
    for index in files.iter().filter(|f| f.path.ends_with(".index.jsonl")) {
        let shard = index.path.replace(".index.jsonl", ".tar");
        let bytes = std::fs::read(dir.join(&shard)).unwrap();
        for line in std::fs::read_to_string(dir.join(&index.path))
            .unwrap()
            .lines()
        {
            let sample: serde_json::Value = serde_json::from_str(line).unwrap();
            for m in sample["members"].as_array().unwrap() {
                let path = m["path"].as_str().unwrap().to_owned();
                let (offset, size) = (m["offset"].as_u64().unwrap(), m["size"].as_u64().unwrap());
                let entry = FileRef::new(path.clone(), size, m["sha256"].as_str().unwrap());
                assert_eq!(raw_entries.remove(&path), Some(entry.clone()), "{path}");
                let data = &bytes[offset as usize..(offset + size) as usize];
                assert_eq!(stagehand_schemas::sha256_hex(data), entry.sha256, "{path}");
                located.push((shard.clone(), offset, entry));
            }
        }
    }
    assert!(raw_entries.is_empty(), "not packed: {raw_entries:?}");
    assert_eq!(located.len(), 600);

    // The tier hop: the mover proves every shard against the prepared manifest.
    let hot_root = h.capacity.parent().unwrap().join("hot");
    std::fs::create_dir_all(&hot_root).unwrap();
    let capacity = Tier::Posix(PosixTier::open("capacity", &h.capacity).unwrap());
    let hot = Tier::Posix(PosixTier::open("hot", &hot_root).unwrap());
    let mover = Mover::new(MoverConfig::default()).unwrap();
    let copy = |dst: &str| SetCopy {
        src_prefix: p.location.prefix.clone(),
        dst_prefix: dst.into(),
        ..SetCopy::default()
    };
    let cancel = CancellationToken::new();
    let report = mover
        .copy_set(
            &capacity,
            &hot,
            &copy("owls-good"),
            futures::stream::iter(files.clone()),
            &Progress::new(),
            &cancel,
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.files, files.len() as u64);

    // One byte flipped inside a member of a shard on the capacity tier.
    let (shard, offset, victim) = located
        .iter()
        .find(|(_, _, e)| e.size > 100)
        .cloned()
        .unwrap();
    let on_tier = dir.join(&shard);
    let mut bytes = std::fs::read(&on_tier).unwrap();
    bytes[offset as usize + 50] ^= 0xFF;
    std::fs::write(&on_tier, &bytes).unwrap();
    let err = mover
        .copy_set(
            &capacity,
            &hot,
            &copy("owls-bad"),
            futures::stream::iter(files.clone()),
            &Progress::new(),
            &cancel,
            |_| {},
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
    assert!(err.path.ends_with(&shard), "{err}");
    assert!(!hot_root.join("owls-bad").exists());
    let broken: Vec<&FileRef> = located
        .iter()
        .filter(|(s, off, e)| {
            *s == shard
                && stagehand_schemas::sha256_hex(&bytes[*off as usize..(*off + e.size) as usize])
                    != e.sha256
        })
        .map(|(_, _, e)| e)
        .collect();
    assert_eq!(broken, vec![&victim]);
    let stats = h.stop().await;
    assert_eq!(stats.dead_lettered, 0);
}

/// Guards the policy on incomplete samples: `abort` fails listing every problem (the full
/// list left on the target tier), `warn` packs them and lists them, `exclude` leaves them out
/// and lists them; a file without an extension is never packed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_samples_abort_warn_or_exclude_as_the_policy_says() {
    let tables = ["abort", "warn", "exclude"]
        .iter()
        .map(|p| {
            format!("[datasets.\"lab/inc-{p}\"]\nrequire_extensions = [\"cls\", \"jpg\"]\nincomplete = \"{p}\"\n")
        })
        .collect::<String>();
    let h = Harness::start(&packing("1 MiB", &tables)).await;
    let mut raw = image_samples(20);
    // Two samples without a label, one file no sample can hold.
    raw.retain(|(p, _)| p != "train/0003.cls" && p != "train/0011.cls");
    raw.push(("README".into(), b"about this set".to_vec()));
    let js = h.bus.jetstream().clone();
    let mut events = BTreeMap::new();
    for policy in ["abort", "warn", "exclude"] {
        let dataset = format!("inc-{policy}");
        let prefix = format!("lab/{dataset}/up");
        let manifest = place(&h.source, &prefix, &raw);
        let e = publish_validated(&h.bus, &dataset, &dataset, &prefix, manifest, false).await;
        events.insert(policy, e);
    }

    let error = dead_letter(&js, &events["abort"].id).await;
    assert!(
        error.contains("3 problem(s) (missing_extension: 2, no_sample_key: 1)"),
        "{error}"
    );
    assert!(
        error.contains("train/0003: the sample has no cls"),
        "{error}"
    );
    let report = h
        .capacity
        .join(problem_report_path("lab", &events["abort"].id));
    assert!(
        error.contains(&problem_report_path("lab", &events["abort"].id)),
        "{error}"
    );
    let lines = std::fs::read_to_string(&report).unwrap();
    assert_eq!(lines.lines().count(), 3, "{lines}");
    assert_eq!(
        names(&h.capacity.join("lab/inc-abort")),
        Vec::<String>::new()
    );

    for (policy, samples, packed_0003) in [("warn", 20, true), ("exclude", 18, false)] {
        let (_, p) = prepared(&js, &events[policy]).await;
        assert_eq!(p.samples, samples, "{policy}");
        let dir = h.capacity.join(&p.location.prefix);
        let listed = std::fs::read_to_string(dir.join("incomplete.jsonl")).unwrap();
        let problems: Vec<serde_json::Value> = listed
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(problems.len(), 3, "{listed}");
        assert_eq!(problems[0]["code"], "no_sample_key");
        assert_eq!(problems[0]["paths"][0], "README");
        assert_eq!(problems[0]["action"], "excluded");
        let action = if policy == "warn" {
            "packed"
        } else {
            "excluded"
        };
        assert!(
            problems[1..]
                .iter()
                .all(|p| p["code"] == "missing_extension" && p["action"] == action)
        );
        let members = read_shards(&dir);
        assert!(members.iter().all(|m| m.path != "README"));
        assert_eq!(
            members.iter().any(|m| m.path == "train/0003.jpg"),
            packed_0003,
            "{policy}"
        );
    }
    h.stop().await;
}

/// Guards selection: a validated version the packing policy does not select (too few files)
/// is handled without a fact and without a file on the target tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_the_policy_does_not_select_is_left_alone() {
    let h = Harness::start(&packing("1 MiB", "")).await;
    let raw = image_samples(1);
    let manifest = place(&h.source, "lab/tiny/up", &raw);
    let js = h.bus.jetstream().clone();
    let event = publish_validated(&h.bus, "tiny", "tiny", "lab/tiny/up", manifest, false).await;
    // Handled: the consumer acknowledged it.
    wait_until(TIMEOUT, "the resharder acknowledged the fact", || async {
        stagehand_testkit::drained_through(&js, subject::FACTS.name, "resharder")
            .await
            .is_some_and(|delivered| delivered >= 1)
    })
    .await
    .unwrap();
    assert!(facts_of(&js, &event.id).await.is_empty());
    assert_eq!(names(&h.capacity.join("lab")), Vec::<String>::new());
    let stats = h.stop().await;
    assert_eq!((stats.handled, stats.dead_lettered), (1, 0));
}

/// Side data: with a shard size above a piece and samples of a few MiB, every shard is larger
/// than a piece, and by the time `dataset.prepared` is out the services' manifest bucket holds
/// each shard's piece hashes under its SHA-256 (equal to those of the shard's bytes on the
/// tier); the indexes and `prepared.json`, smaller, have none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shard_larger_than_a_piece_has_its_piece_hashes_stored() {
    use stagehand_manifest::{BucketOptions, ManifestStore};
    use stagehand_schemas::pieces::{PIECE_BYTES, PieceHashes};
    let h = Harness::start(&packing("12 MiB", "")).await;
    // Six samples of a 3 MiB `.bin` and a `.cls`: three to a shard, two shards of about 9 MiB.
    let raw: Vec<(String, Vec<u8>)> = (0..6u64)
        .flat_map(|i| {
            [
                (format!("big/{i:04}.bin"), bytes(100 + i, 3 << 20)),
                (format!("big/{i:04}.cls"), i.to_string().into_bytes()),
            ]
        })
        .collect();
    let manifest = place(&h.source, "lab/weights/up", &raw);
    let js = h.bus.jetstream().clone();
    let event = publish_validated(&h.bus, "w", "weights", "lab/weights/up", manifest, false).await;
    let (fact, p) = prepared(&js, &event).await;
    let store = ManifestStore::catalogue(&js, BucketOptions::default())
        .await
        .unwrap();
    let folder = h.capacity.join(&p.location.prefix);
    let mut expected = Vec::new();
    for file in prepared_files(&js, &fact).await {
        let stored = store.pieces(&file.sha256, file.size).await.unwrap();
        if file.path.ends_with(".tar") {
            assert!(file.size > PIECE_BYTES, "{file:?}");
            let bytes = std::fs::read(folder.join(&file.path)).unwrap();
            assert_eq!(stored, Some(PieceHashes::of(&bytes)), "{}", file.path);
            expected.push(PieceHashes::object_name(&file.sha256));
        } else {
            assert!(file.size <= PIECE_BYTES, "{file:?}");
            assert_eq!(stored, None, "{}", file.path);
        }
    }
    assert_eq!(expected.len(), 2, "{expected:?}");
    expected.sort();
    let side_data: Vec<String> = store
        .list()
        .await
        .unwrap()
        .into_iter()
        .filter(|name| name.starts_with("pieces."))
        .collect();
    assert_eq!(side_data, expected);
    let stats = h.stop().await;
    assert_eq!((stats.handled, stats.retried), (1, 0), "{stats:?}");
}
