//! demote-bench: the demoter draining a hot tier from 95 % of its capacity to its low watermark,
//! every demoted version copied down to capacity and verified first (each version's only
//! verified copy is on hot), beside `rsync -a --remove-source-files` moving the same version
//! folders. The demoter runs as its real binary (`--demoter`), so its CPU time and peak RSS are
//! its own (`/proc/<pid>`); nats-server and the catalogue recorder run beside it.
//!
//! Prints one JSON line per measurement: `{"case":"demote",...}` and `{"case":"rsync",...}`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{Catalogue, ReplicaState};
use stagehand_loadtest::{flush_filesystem, peak_rss_bytes, process_cpu_seconds};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, Location, ReplicaCreated, StageReleased,
    StageRequested, sha256_hex, version_digest,
};
use stagehand_testkit::{NatsServer, wait_until};

#[derive(Parser)]
struct Args {
    /// Where the tiers and state live (removed at the end).
    #[arg(long)]
    dir: PathBuf,
    /// The `stagehand-demoter` binary.
    #[arg(long)]
    demoter: PathBuf,
    /// Versions on the hot tier.
    #[arg(long, default_value_t = 200)]
    versions: usize,
    /// Their bytes in all, MiB (the benchmark has 20 GiB; this machine's disk is shared).
    #[arg(long, default_value_t = 1536)]
    total_mib: u64,
    /// The hot tier's low watermark (the high one is 0.85; the tier starts at 0.95).
    #[arg(long, default_value_t = 0.5)]
    low: f64,
    /// demotion.toml's `max_concurrent` (steps carried at once).
    #[arg(long, default_value_t = stagehand_policy::DEFAULT_DEMOTION_CONCURRENCY)]
    max_concurrent: u32,
    /// The demoter's log level (`info` gives each step's timeline in the kept log).
    #[arg(long, default_value = "warn")]
    log_level: String,
}

const PROJECT: &str = "bench";

/// Deterministic bytes of file `i` of version `v`.
fn content(v: usize, i: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = (v as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64 + 1);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The file sizes of version `v`: 1 to 8 files, mixed sizes, `bytes` in all.
fn layout(v: usize, bytes: u64) -> Vec<usize> {
    let n = 1 + v % 8;
    let each = (bytes / n as u64) as usize;
    let mut sizes = vec![each; n];
    sizes[0] += (bytes - each as u64 * n as u64) as usize;
    sizes
}

/// Writes version `v` under `root/<prefix>`; returns (prefix, refs).
fn write_version(
    root: &Path,
    v: usize,
    bytes: u64,
) -> anyhow::Result<(String, String, Vec<FileRef>)> {
    let files: Vec<(String, Vec<u8>)> = layout(v, bytes)
        .into_iter()
        .enumerate()
        .map(|(i, len)| (format!("part-{i:02}.bin"), content(v, i, len)))
        .collect();
    let refs: Vec<FileRef> = files
        .iter()
        .map(|(p, b)| FileRef::new(p.as_str(), b.len() as u64, sha256_hex(b)))
        .collect();
    let version = version_digest(&refs);
    let prefix = format!("{PROJECT}/ds{v:03}/{version}");
    let dir = root.join(&prefix);
    std::fs::create_dir_all(&dir)?;
    for (p, b) in &files {
        std::fs::write(dir.join(p), b)?;
    }
    Ok((format!("ds{v:03}"), version, refs))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let root = args.dir.clone();
    if root.exists() {
        std::fs::remove_dir_all(&root)?;
    }
    for t in ["source", "capacity", "hot", "rsync-src", "rsync-dst"] {
        std::fs::create_dir_all(root.join("tiers").join(t))?;
    }
    let total = args.total_mib << 20;
    let capacity = (total as f64 / 0.95) as u64;
    let policies = root.join("policies");
    std::fs::create_dir_all(&policies)?;
    let tiers = root.join("tiers");
    std::fs::write(
        policies.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
             [tiers.capacity]\nkind = \"posix\"\nrole = \"capacity\"\nfailure_domain = \"cap\"\nroot = \"{}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{}\"\ncapacity = {capacity}\n\
             high_watermark = 0.85\nlow_watermark = {}\n",
            tiers.join("source").display(),
            tiers.join("capacity").display(),
            tiers.join("hot").display(),
            args.low
        ),
    )?;
    std::fs::write(
        policies.join("validation.toml"),
        "max_file_size = \"1 TiB\"\nmax_entries = 1000000\nmax_total_bytes = \"1 TiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )?;
    std::fs::write(
        policies.join("demotion.toml"),
        format!(
            "idle_after = \"30d\"\ncheck_every = \"1h\"\ntarget = \"capacity\"\nmax_concurrent = {}\n",
            args.max_concurrent
        ),
    )?;

    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let stop = CancellationToken::new();
    let recorder = stagehand_catalogue_recorder::config(&nats.url(), root.join("recorder"));
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(recorder, stop.clone()));

    // Mixed sizes: version v weighs in proportion to 1 + v % 5, summing to `total`.
    let weights: Vec<u64> = (0..args.versions).map(|v| 1 + (v % 5) as u64).collect();
    let weight_sum: u64 = weights.iter().sum();
    let mut placed = Vec::new();
    let now = time::OffsetDateTime::now_utc();
    for (v, w) in weights.iter().enumerate() {
        let bytes = total * w / weight_sum;
        let (dataset, version, refs) = write_version(&tiers.join("hot"), v, bytes)?;
        let prefix = format!("{PROJECT}/{dataset}/{version}");
        let size: u64 = refs.iter().map(|f| f.size).sum();
        let ingest = EventId::for_ingest(PROJECT, &dataset, &version);
        let loc = |tier: &str| Location {
            tier: tier.into(),
            prefix: prefix.clone(),
        };
        // Validated on the source tier (not durable): each version's only verified copy is
        // on hot, so every demotion is a copy down first.
        bus.publish(&Event::request(
            EventId::derive(&ingest, "validated"),
            PROJECT,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.clone(),
                version: version.clone(),
                source: loc("source"),
                files: refs.clone(),
                manifest: None,
                total_bytes: size,
                requested_by: "bench".into(),
                request_id: ingest.clone(),
                labels: vec![],
            }),
        ))
        .await?;
        bus.publish(&Event::request(
            EventId::derive(&ingest, "replica:hot"),
            PROJECT,
            Body::ReplicaCreated(ReplicaCreated {
                dataset: dataset.clone(),
                version: version.clone(),
                location: loc("hot"),
                files: refs.len() as u64,
                total_bytes: size,
                verified_by: "read-back".into(),
                node: None,
            }),
        ))
        .await?;
        // Staged and released in version order: version 0 is the least recently staged.
        let at = now - time::Duration::minutes((args.versions - v) as i64);
        let mut req = Event::request(
            EventId::for_stage(PROJECT, "job", &dataset, &version, "hot", None),
            PROJECT,
            Body::StageRequested(StageRequested {
                dataset: dataset.clone(),
                version: version.clone(),
                tier: "hot".into(),
                job_id: "job".into(),
                requested_by: "bench".into(),
                deadline: None,
                node: None,
                form: None,
                hold_until: None,
            }),
        );
        req.occurred_at = at;
        bus.publish(&req).await?;
        let mut rel = Event::request(
            EventId::for_stage_release(PROJECT, "job", &dataset, &version, "hot", None),
            PROJECT,
            Body::StageReleased(StageReleased {
                dataset: dataset.clone(),
                version: version.clone(),
                tier: "hot".into(),
                job_id: "job".into(),
                node: None,
                reason: None,
            }),
        );
        rel.occurred_at = at + time::Duration::seconds(1);
        bus.publish(&rel).await?;
        placed.push((dataset, version, prefix, size));
    }
    // A hot tier's replicas were written long before they are demoted: on disk, not dirty in
    // the page cache. Without this the demoter's first flush would write them out first
    // (the rsync run below starts from the same flushed state).
    flush_filesystem(&tiers.join("hot"))?;
    // The versions the demoter must move: least recently staged first until at the low mark.
    let low = (capacity as f64 * args.low) as u64;
    let mut left: u64 = placed.iter().map(|p| p.3).sum();
    let mut moved = 0usize;
    while left > low {
        left -= placed[moved].3;
        moved += 1;
    }
    let moved_bytes: u64 = placed[..moved].iter().map(|p| p.3).sum();
    let catalogue = Catalogue::new(bus.client().clone());
    let last = placed.last().unwrap().clone();
    wait_until(
        Duration::from_secs(300),
        "the recorder to fold the placements",
        || async {
            let Ok(v) = catalogue.version(Some(PROJECT), &last.0, &last.1).await else {
                return false;
            };
            let Ok(s) = catalogue
                .stage_requests(PROJECT, None, Some(&last.0), Some(&last.1), None)
                .await
            else {
                return false;
            };
            v.replicas
                .iter()
                .any(|r| r.tier == "hot" && r.state == ReplicaState::Present)
                && s.items
                    .first()
                    .is_some_and(|s| s.state == stagehand_catalogue::StageState::Released)
        },
    )
    .await?;

    let config = root.join("demoter.toml");
    std::fs::write(
        &config,
        format!(
            "[bus]\nservers = [\"{}\"]\n\n[telemetry]\nlog_level = \"{}\"\n\n[service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\n",
            nats.url(),
            args.log_level,
            policies.display(),
            root.join("state").display()
        ),
    )?;
    let started = Instant::now();
    let mut child = Command::new(&args.demoter)
        .arg("--config")
        .arg(&config)
        .env("STAGEHAND_NATS_URL", nats.url())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(root.join("demoter.log"))?)
        .spawn()
        .context("starting the demoter")?;
    let hot = tiers.join("hot");
    wait_until(
        Duration::from_secs(3600),
        "the demoter to reach the low watermark",
        || async { placed[..moved].iter().all(|p| !hot.join(&p.2).exists()) },
    )
    .await?;
    let demote_secs = started.elapsed().as_secs_f64();
    let (cpu, rss) = (
        process_cpu_seconds(child.id()).context("the demoter's CPU time")?,
        peak_rss_bytes(child.id()).context("the demoter's peak RSS")?,
    );
    child.kill()?;
    child.wait()?;
    // Every moved version is whole on capacity (the demoter verified it; this checks it).
    for p in &placed[..moved] {
        let dir = tiers.join("capacity").join(&p.2);
        let bytes: u64 = std::fs::read_dir(&dir)?
            .map(|e| {
                e.map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
                    .unwrap_or(0)
            })
            .sum();
        if bytes != p.3 {
            bail!("{}: {bytes} bytes on capacity, {} expected", p.2, p.3);
        }
    }
    let untouched = placed[moved..].iter().all(|p| hot.join(&p.2).exists());
    println!(
        "{}",
        serde_json::json!({
            "case": "demote", "versions": args.versions, "moved_versions": moved,
            "moved_bytes": moved_bytes, "seconds": demote_secs,
            "mib_per_s": moved_bytes as f64 / (1 << 20) as f64 / demote_secs,
            "cpu_seconds": cpu, "peak_rss_bytes": rss, "others_untouched": untouched,
        })
    );
    stop.cancel();
    let _ = recorder.await;
    // The same version folders, written again, moved by rsync.
    std::fs::remove_dir_all(tiers.join("capacity"))?;
    std::fs::remove_dir_all(&hot)?;
    let src = tiers.join("rsync-src");
    for (v, w) in weights.iter().enumerate().take(moved) {
        write_version(&src, v, total * w / weight_sum)?;
    }
    flush_filesystem(&src)?;
    let dst = tiers.join("rsync-dst");
    let started = Instant::now();
    let status = Command::new("rsync")
        .arg("-a")
        .arg("--remove-source-files")
        .arg(format!("{}/", src.display()))
        .arg(format!("{}/", dst.display()))
        .status()?;
    let rsync_secs = started.elapsed().as_secs_f64();
    if !status.success() {
        bail!("rsync failed: {status}");
    }
    // What rsync left in the page cache, made durable (the demoter's copies are durable before
    // anything is removed): `sync -f` is one syncfs of the destination's filesystem.
    flush_filesystem(&dst)?;
    let rsync_sync_secs = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "case": "rsync", "moved_versions": moved, "moved_bytes": moved_bytes,
            "seconds": rsync_secs, "mib_per_s": moved_bytes as f64 / (1 << 20) as f64 / rsync_secs,
            "seconds_with_sync": rsync_sync_secs,
        })
    );
    // The demoter's log is kept beside the (removed) bench folder.
    std::fs::copy(root.join("demoter.log"), root.with_extension("demoter.log"))?;
    std::fs::remove_dir_all(&root)?;
    Ok(())
}
