//! The lineage end to end against a real nats-server: `stagehand ingest` of many small files →
//! the ingest validator → the resharder → the catalogue recorder, all in-process as `stagehand
//! up` runs them, with a packing policy that selects the dataset; then `stagehand catalogue
//! show D --lineage`, run as the real binary, shows the raw version on the source tier and
//! the prepared version under it on the capacity tier.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use stagehand::ingest::{IngestOptions, Outcome, ingest};
use stagehand::up::{Stack, UpOptions, write_default_policies};
use stagehand_bus::{Bus, BusConfig};
use stagehand_catalogue::{Catalogue, ReplicaState};
use stagehand_testkit::{NatsServer, wait_for};

const WAIT: Duration = Duration::from_secs(60);
const SAMPLES: usize = 60;

/// `SAMPLES` samples `img/NNNN` of a `.jpg` (1–4 KiB) and a `.cls`.
fn write_samples(dir: &Path) {
    std::fs::create_dir_all(dir.join("img")).unwrap();
    for i in 0..SAMPLES {
        let jpg: Vec<u8> = (0..1024 + (i * 53) % 3072)
            .map(|b| (b * 31 + i) as u8)
            .collect();
        std::fs::write(dir.join(format!("img/{i:04}.jpg")), jpg).unwrap();
        std::fs::write(dir.join(format!("img/{i:04}.cls")), format!("{}", i % 7)).unwrap();
    }
}

/// Guards `catalogue show D --lineage` over the real services: the raw version's replica on
/// the source tier, the prepared version (webdataset) under it, derived from it, with its
/// replica present on the capacity tier holding the shards, indexes and `prepared.json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingested_dataset_shows_its_prepared_version_in_the_lineage() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = tempfile::tempdir()?;
    let policies = home.path().join("policies");
    write_default_policies(&policies, home.path())?;
    // The shipped policy packs datasets of at least 10,000 files; this one packs small ones.
    let packing = std::fs::read_to_string(policies.join("packing.toml"))?;
    let packing = packing
        .replace("min_files = 10000", "min_files = 10")
        .replace("shard_size = \"1 GiB\"", "shard_size = \"1 MiB\"");
    anyhow::ensure!(packing.contains("min_files = 10\n"), "{packing}");
    std::fs::write(policies.join("packing.toml"), packing)?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(BusConfig::new(nats.url())),
        port: 0,
        policies: Some(policies.clone()),
    })
    .await?;
    stack.ready(WAIT).await?;
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;

    let folder = tempfile::tempdir()?;
    write_samples(folder.path());
    let report = ingest(
        &bus,
        &IngestOptions {
            source: folder.path().to_string_lossy().into_owned(),
            in_place: false,
            project: "lab-l".into(),
            dataset: "birds".into(),
            tier: "source".into(),
            policies: policies.clone(),
            requested_by: "alice".into(),
            labels: vec![],
            manifest: None,
            wait: Some(WAIT),
            progress: false,
            clock_skew: stagehand::ingest::CLOCK_SKEW,
            spool: None,
        },
    )
    .await?;
    let Some(Outcome::Validated(validated)) = &report.outcome else {
        anyhow::bail!("not validated: {:?}", report.outcome)
    };
    let raw = validated.version.clone();

    let catalogue = Catalogue::new(bus.client().clone());
    let root = wait_for(WAIT, "the prepared version in the lineage", || async {
        let page = catalogue
            .lineage(Some("lab-l"), "birds", None, None, None)
            .await
            .ok()?;
        let root = page.items.into_iter().next()?;
        let prepared = root.derived.first()?;
        prepared
            .replicas
            .iter()
            .any(|r| r.tier == "capacity" && r.state == ReplicaState::Present)
            .then_some(root)
    })
    .await?;
    assert_eq!(root.version.version, raw);
    assert_eq!(root.version.file_count, 2 * SAMPLES as u64);
    assert!(root.replicas.iter().any(|r| r.tier == "source"));
    assert_eq!(root.derived.len(), 1);
    let prepared = &root.derived[0];
    let p = &prepared.version;
    assert_eq!(p.provenance.derived_from.as_deref(), Some(raw.as_str()));
    assert_eq!(p.provenance.layout.as_deref(), Some("webdataset"));
    // ~150 KiB of samples: one shard, its index and prepared.json.
    assert_eq!(p.file_count, 3);

    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args([
            "catalogue",
            "show",
            "birds",
            "--project",
            "lab-l",
            "--lineage",
        ])
        .env("STAGEHAND_NATS_URL", nats.url())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with(&format!("raw {raw}  120 files")),
        "{text}"
    );
    assert!(lines[1].trim_start().starts_with("source"), "{text}");
    assert_eq!(lines[2].trim(), "↳", "{text}");
    assert!(
        lines[3].starts_with(&format!("  prepared (webdataset) {}  3 files", p.version)),
        "{text}"
    );
    assert!(lines[4].trim_start().starts_with("capacity"), "{text}");
    assert!(lines[4].contains("present"), "{text}");
    stack.stop().await?;
    Ok(())
}
