//! Raw versions on an S3 source tier (SeaweedFS), packed by the real `stagehand-resharder`
//! binary: the objects are fetched into its spool (each checked against the manifest), packed
//! exactly as the same files on a posix source tier are, and the fetched copy removed; a
//! corrupted object fails the derivation naming its path.

mod common;

use common::*;
use stagehand_bus::{Bus, BusConfig};
use stagehand_testkit::{NatsServer, S3Server};

/// Guards packing from object storage, where raw data lands: the same files on S3 and on
/// posix give byte-identical shards (so the same derived version), nothing fetched stays in
/// the spool, and a corrupted object is found and named before anything is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_version_on_s3_packs_like_the_same_files_on_posix() {
    let s3 = tokio::task::spawn_blocking(S3Server::shared).await.unwrap();
    let bucket = s3.unique_bucket("raw");
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let (source, capacity) = (tmp.path().join("source"), tmp.path().join("capacity"));
    let policies = tmp.path().join("policies");
    write_policies(&policies, &source, &capacity, &packing("1 MiB", ""));
    let tiers = std::fs::read_to_string(policies.join("tiers.toml")).unwrap();
    std::fs::write(
        policies.join("tiers.toml"),
        format!(
            "{tiers}\n[tiers.objects]\nkind = \"s3\"\nrole = \"source\"\nfailure_domain = \"objects\"\nendpoint = \"{}\"\nallow_plaintext = true\nbucket = \"{bucket}\"\nprefix = \"\"\nregion = \"{}\"\n",
            s3.endpoint(),
            s3.region()
        ),
    )
    .unwrap();

    // About 2 MiB: a few 1 MiB shards.
    let raw = image_samples(300);
    let on_posix = place(&source, "lab/pets/up", &raw);
    for (path, data) in &raw {
        s3.put_object(&bucket, &format!("lab/pets/up/{path}"), data)
            .unwrap();
    }
    // A second upload whose one object is not what the manifest says.
    let small = image_samples(20);
    let small_manifest: Vec<_> = small
        .iter()
        .map(|(path, data)| {
            stagehand_schemas::FileRef::new(
                path.clone(),
                data.len() as u64,
                stagehand_schemas::sha256_hex(data),
            )
        })
        .collect();
    let victim = small[7].0.clone();
    for (path, data) in &small {
        let mut data = data.clone();
        if *path == victim {
            data[0] ^= 0xff;
        }
        s3.put_object(&bucket, &format!("lab/bad/up/{path}"), &data)
            .unwrap();
    }

    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let js = bus.jetstream().clone();
    let state = tmp.path().join("state");
    let config = tmp.path().join("resharder.toml");
    write_config(&config, &nats.url(), &policies, &state, None);
    let env = s3.client_env();
    let log = tmp.path().join("resharder.log");
    let _resharder = spawn_resharder(&config, &log, &env);

    let posix =
        publish_validated(&bus, "posix", "pets", "lab/pets/up", on_posix.clone(), true).await;
    let (_, from_posix) = prepared(&js, &posix).await;
    let objects = publish_validated_on(
        &bus,
        "objects",
        "pets-s3",
        "objects",
        "lab/pets/up",
        on_posix.clone(),
        true,
    )
    .await;
    let (_, from_s3) = prepared(&js, &objects).await;
    assert_eq!(from_s3.samples, 300);
    assert_eq!(from_s3.derived_from, from_posix.derived_from);
    let shards = |p: &stagehand_schemas::DatasetPrepared| {
        let dir = capacity.join(&p.location.prefix);
        let mut shards: Vec<(String, Vec<u8>)> = names(&dir)
            .into_iter()
            .filter(|n| n.ends_with(".tar"))
            .map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap()))
            .collect();
        shards.sort();
        shards
    };
    let (s3_shards, posix_shards) = (shards(&from_s3), shards(&from_posix));
    assert!(s3_shards.len() > 1, "{} shards", s3_shards.len());
    assert!(
        s3_shards == posix_shards,
        "the shards differ between S3 and posix"
    );
    let members = read_shards(&capacity.join(&from_s3.location.prefix));
    assert_eq!(members.len(), raw.len());
    for m in &members {
        let (_, data) = raw.iter().find(|(path, _)| *path == m.path).unwrap();
        assert_eq!(&m.data, data, "{}", m.path);
    }

    let bad = publish_validated_on(
        &bus,
        "bad",
        "bad",
        "objects",
        "lab/bad/up",
        small_manifest,
        true,
    )
    .await;
    let error = dead_letter(&js, &bad.id).await;
    assert!(error.contains(&victim), "{error}");
    assert!(
        names(&capacity.join("lab")).iter().all(|n| n != "bad"),
        "nothing of the corrupted upload on the target tier"
    );
    let fetched = state.join("spool/fetched");
    assert!(
        !fetched.exists() || names(&fetched).is_empty(),
        "left in the spool: {:?}",
        names(&fetched)
    );
}
