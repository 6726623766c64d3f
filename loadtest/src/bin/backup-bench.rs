//! One backup and one restore drill, timed: the driver of `loadtest/backup/bench.sh`.
//!
//! The files under `--source-root`/`--prefix` (a posix source tier) are hashed into a manifest
//! (timed apart: that is the ingest validator's work), and a `dataset.validated` for them is
//! published as the validator would. The backup copier — a separate process the script starts
//! — backs the version up; the time from the publish to its `backup.completed` is the backup
//! time. Then one restore drill of that backup runs in this process through the copier's own
//! drill (`Copier::drill`: the manifest restored and checked, a sample of up to
//! `drill_sample_files` files and `drill_sample_bytes` bytes restored to `--scratch` and every
//! byte verified, the fact published). Prints one JSON line.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use stagehand_backup_copier::{Candidate, Copier};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{ReplicaRecord, ReplicaState, Stamp, VersionBackups};
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore, inline_or_stored};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, IngestRequested, Location, sha256_hex,
    subject, wire,
};

const PROJECT: &str = "bench";

#[derive(Parser, Debug)]
#[command(about = "One backup and one restore drill, timed")]
struct Args {
    #[arg(long)]
    nats: String,
    /// The policy folder the copier runs with.
    #[arg(long)]
    policies: PathBuf,
    /// The source tier's root.
    #[arg(long)]
    source_root: PathBuf,
    /// The dataset's folder beneath it.
    #[arg(long)]
    prefix: String,
    #[arg(long, default_value = "bench")]
    dataset: String,
    /// The drill's scratch folder.
    #[arg(long)]
    scratch: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let root = args.source_root.join(&args.prefix);

    let hashed = Instant::now();
    let files = tokio::task::spawn_blocking(move || hash_tree(&root)).await??;
    let manifest_secs = hashed.elapsed().as_secs_f64();
    let manifest = Manifest::from_entries(files);

    let bus = Bus::connect(&BusConfig::new(&args.nats)).await?;
    // The streams and buckets exist before the first publish, whether or not the copier
    // (started just before) has provisioned them yet.
    bus.provision().await?;
    let store = ManifestStore::catalogue(bus.jetstream(), BucketOptions::default()).await?;
    let (inline, reference) = inline_or_stored(&manifest, &store).await?;
    let request = EventId::for_ingest(PROJECT, &args.dataset, manifest.digest());
    let source = Location {
        tier: "source".into(),
        prefix: args.prefix.clone(),
    };
    let fact = Event::request(
        request.clone(),
        PROJECT,
        Body::IngestRequested(IngestRequested {
            dataset: args.dataset.clone(),
            source: source.clone(),
            files: vec![],
            manifest: None,
            requested_by: "bench".into(),
            labels: vec![],
        }),
    )
    .caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: args.dataset.clone(),
            version: manifest.digest().to_owned(),
            source,
            files: inline,
            manifest: reference,
            total_bytes: manifest.bytes(),
            requested_by: "bench".into(),
            request_id: request,
            labels: vec![],
        }),
    );
    let mut completed = bus
        .client()
        .subscribe(subject::kind_filter("fact", "backup.completed"))
        .await?;
    let started = Instant::now();
    bus.publish(&fact).await?;
    let done = loop {
        let msg = completed.next().await.context("subscription ended")?;
        let event = wire::decode(&msg.payload)?;
        if let Body::BackupCompleted(b) = &event.body
            && b.version == manifest.digest()
        {
            break event;
        }
    };
    let backup_secs = started.elapsed().as_secs_f64();
    let Body::BackupCompleted(b) = &done.body else {
        unreachable!()
    };

    // The drill, as the copier's clock runs it, on the backup just made.
    let policies = stagehand_policy::Policies::load_dir(&args.policies)?;
    let copier = Copier::open(policies, &args.scratch, Default::default())?;
    let stamp = Stamp {
        at: done.occurred_at,
        event_id: done.id.clone(),
    };
    let candidate = Candidate {
        version: VersionBackups {
            project: PROJECT.into(),
            dataset: b.dataset.clone(),
            version: b.version.clone(),
            files: b.files,
            total_bytes: b.total_bytes,
            recorded: true,
            backups: vec![],
        },
        replica: ReplicaRecord {
            project: PROJECT.into(),
            dataset: b.dataset.clone(),
            version: b.version.clone(),
            tier: b.location.tier.clone(),
            node: None,
            prefix: b.location.prefix.clone(),
            state: ReplicaState::Present,
            reason: None,
            stamp: Some(stamp.clone()),
            files: b.files,
            total_bytes: b.total_bytes,
            verified_by: Some("backup".into()),
            backup: true,
            copied: Some(stamp),
            last_drill: None,
            last_verified: None,
            last_repaired: None,
        },
    };
    let drill_started = Instant::now();
    let id = EventId::random();
    let report = copier
        .drill(&bus, &[candidate], &id, &CancellationToken::new())
        .await?;
    let drill_secs = drill_started.elapsed().as_secs_f64();
    let result = report
        .results
        .first()
        .with_context(|| format!("the drill reached no verdict: {:?}", report.inconclusive))?;
    anyhow::ensure!(
        result.problems.is_empty(),
        "the drill failed: {:?}",
        result.problems
    );
    println!(
        "{}",
        serde_json::json!({
            "files": manifest.files(),
            "bytes": manifest.bytes(),
            "manifest_secs": manifest_secs,
            "backup_secs": backup_secs,
            "drill_files": result.sampled_files,
            "drill_bytes": result.sampled_bytes,
            "drill_secs": drill_secs,
        })
    );
    Ok(())
}

/// Every regular file beneath `root`, hashed, with paths relative to it.
fn hash_tree(root: &std::path::Path) -> anyhow::Result<Vec<FileRef>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let bytes = std::fs::read(&path)?;
            let rel = path.strip_prefix(root)?.to_string_lossy().into_owned();
            out.push(FileRef::new(rel, bytes.len() as u64, sha256_hex(&bytes)));
        }
    }
    Ok(out)
}
