//! `reshard-bench`: one timed derivation by the real `stagehand-resharder` process, for
//! `loadtest/reshard/bench.sh`, which runs it beside `tar -cf` and webdataset's `ShardWriter`
//! on the same files.
//!
//! A nats-server is started here; the raw files beneath `--source-root/--prefix` (hashed once,
//! the manifest cached in `--work`) are published as a validated version by reference, the way
//! the ingest validator publishes them; the resharder binary (`--resharder`, started before and
//! ready) packs them into `--shard-size` shards on a posix capacity tier under `--work`. Timed
//! from the publish of `dataset.validated` to the arrival of `dataset.prepared`: fetching and
//! verifying the manifest, the shuffle's sort, reading and re-hashing every member, writing
//! and hashing every shard, making them durable, publishing the set and the fact. Prints one
//! JSON line: seconds, files, bytes, samples, shards, the resharder's CPU seconds in that time
//! and its peak RSS. The prepared version is removed afterwards.
//!
//! With `--stage-to-hot` (for `loadtest/reshard/stage.sh`), the catalogue recorder and the
//! promoter run in this process too, on a posix hot tier under `--work`; once the version is
//! prepared, the raw version (form `raw`, from the source tier) and then its prepared version
//! (form `prepared`, from the capacity tier) are staged to hot, each timed from the publish of
//! `stage.requested` to the arrival of its `stage.ready`, and one JSON line is printed for
//! each (`"tool": "stage raw"` / `"stage prepared"`: seconds, files and bytes staged).

// The promoter runs in this process, its worker futures nested inside the bench's own: a
// release build computes their layout deeper than the default limit (128) allows.
#![recursion_limit = "256"]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig};
use stagehand_loadtest::{flush_filesystem, peak_rss_bytes, process_cpu_seconds};
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_schemas::*;
use stagehand_testkit::NatsServer;

#[derive(Debug, Parser)]
struct Args {
    /// Root of the posix source tier.
    #[arg(long)]
    source_root: PathBuf,
    /// The raw version's folder beneath the root (`<project>/...`).
    #[arg(long)]
    prefix: String,
    /// Scratch folder: the capacity tier, state, policies and the cached manifest.
    #[arg(long)]
    work: PathBuf,
    /// The `stagehand-resharder` binary.
    #[arg(long)]
    resharder: PathBuf,
    /// Target shard size (a policy size: "256 MiB").
    #[arg(long, default_value = "256 MiB")]
    shard_size: String,
    /// The resharder's reader threads.
    #[arg(long, default_value_t = 4)]
    read_threads: usize,
    /// The dataset name (one per round, so that rounds do not share a version folder).
    #[arg(long, default_value = "small-files")]
    dataset: String,
    /// Stage the raw and the prepared version to a hot tier through the promoter, timed.
    #[arg(long)]
    stage_to_hot: bool,
    /// Where each staged version's files are when its request is published: `cold` (evicted
    /// from the page cache, read from the disk, as a version on a capacity tier is in
    /// practice) or `warm` (read into the cache first).
    #[arg(long, value_enum, default_value_t = SourceCache::Cold)]
    source_cache: SourceCache,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum SourceCache {
    Cold,
    Warm,
}

const PROJECT: &str = "bench";

/// The raw version's entries: read from the cache, else hashed (on every core) and cached.
fn manifest(root: &Path, cache: &Path) -> anyhow::Result<Vec<FileRef>> {
    if let Ok(text) = std::fs::read_to_string(cache) {
        return text
            .lines()
            .map(|l| {
                manifest::parse_line(l.as_bytes()).map_err(|e| anyhow::anyhow!("{cache:?}: {e}"))
            })
            .collect();
    }
    let mut paths = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&rel))? {
            let entry = entry?;
            let child = rel.join(entry.file_name());
            if entry.file_type()?.is_dir() {
                stack.push(child);
            } else {
                paths.push(child.to_string_lossy().into_owned());
            }
        }
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = paths.len().div_ceil(threads).max(1);
    let mut files: Vec<FileRef> = std::thread::scope(|s| {
        let handles: Vec<_> = paths
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|p| {
                            let data = std::fs::read(root.join(p))?;
                            Ok(FileRef::new(
                                p.clone(),
                                data.len() as u64,
                                sha256_hex(&data),
                            ))
                        })
                        .collect::<std::io::Result<Vec<_>>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a hashing thread"))
            .collect::<std::io::Result<Vec<Vec<_>>>>()
    })?
    .into_iter()
    .flatten()
    .collect();
    files.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let mut out = std::io::BufWriter::new(std::fs::File::create(cache)?);
    for f in &files {
        out.write_all(f.manifest_line().as_bytes())?;
    }
    out.flush()?;
    Ok(files)
}

fn write_policies(
    args: &Args,
    dir: &Path,
    capacity: &Path,
    hot: Option<&Path>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tiers = format!(
        "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
         [tiers.capacity]\nkind = \"posix\"\nrole = \"capacity\"\nfailure_domain = \"store\"\nroot = \"{}\"\n",
        args.source_root.display(),
        capacity.display()
    );
    if let Some(hot) = hot {
        tiers.push_str(&format!(
            "\n[tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{}\"\ncapacity = \"1 PiB\"\n\n\
             [tiers.hot.quotas]\ndefault = \"1 PiB\"\n",
            hot.display()
        ));
        // The promoter's own defaults but for the sources: the raw version lives on the
        // source tier, its prepared version on capacity.
        std::fs::write(
            dir.join("promotion.toml"),
            "default_tier = \"hot\"\nsources = [\"capacity\", \"source\"]\nmax_concurrent = 4\ndefault_deadline = \"2h\"\nverify = \"hashed-in-flight\"\nrecheck_every = \"1h\"\n",
        )?;
    }
    std::fs::write(dir.join("tiers.toml"), tiers)?;
    std::fs::write(
        dir.join("validation.toml"),
        "max_file_size = \"1 GiB\"\nmax_entries = 20000000\nmax_total_bytes = \"10 TiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )?;
    std::fs::write(
        dir.join("packing.toml"),
        format!(
            "enabled = true\nmin_files = 1\nmax_mean_file_size = \"4 MiB\"\nshard_size = \"{}\"\nlayout = \"webdataset\"\nseed = 20261129\ntarget_tier = \"capacity\"\n",
            args.shard_size
        ),
    )?;
    Ok(())
}

fn validated(args: &Args, files: &[FileRef], reference: ManifestRef) -> Event {
    let request = EventId::for_ingest(PROJECT, &args.dataset, &reference.digest);
    let source = Location {
        tier: "source".into(),
        prefix: args.prefix.clone(),
    };
    Event::request(
        request.clone(),
        PROJECT,
        Body::IngestRequested(IngestRequested {
            dataset: args.dataset.clone(),
            source: source.clone(),
            files: Vec::new(),
            manifest: None,
            requested_by: "bench".into(),
            labels: vec![],
        }),
    )
    .caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: args.dataset.clone(),
            version: reference.digest.clone(),
            source,
            files: Vec::new(),
            manifest: Some(reference),
            total_bytes: total_bytes(files),
            requested_by: "bench".into(),
            request_id: request,
            labels: vec![],
        }),
    )
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.work)?;
    let files = manifest(
        &args.source_root.join(&args.prefix),
        &args.work.join("manifest.tsv"),
    )
    .context("hashing the raw files")?;
    let capacity = args.work.join("capacity");
    std::fs::create_dir_all(&capacity)?;
    let policies = args.work.join("policies");
    let hot = args.work.join("hot");
    if args.stage_to_hot {
        std::fs::create_dir_all(&hot)?;
    }
    write_policies(
        &args,
        &policies,
        &capacity,
        args.stage_to_hot.then_some(hot.as_path()),
    )?;

    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let config = args.work.join("resharder.toml");
    std::fs::write(
        &config,
        format!(
            "[bus]\nservers = [\"{}\"]\n\n[worker]\nclaims = false\n\n[service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\nread_threads = {}\n",
            nats.url(),
            policies.display(),
            args.work.join("state").display(),
            args.read_threads
        ),
    )?;
    let child = Child(
        Command::new(&args.resharder)
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(args.work.join("resharder.log"))?)
            .spawn()
            .context("starting the resharder")?,
    );
    let pid = child.0.id();
    let js = bus.jetstream().clone();
    let ready = Instant::now();
    while js
        .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
            "resharder",
            subject::FACTS.name,
        )
        .await
        .is_err()
    {
        if ready.elapsed() > Duration::from_secs(60) {
            bail!("the resharder's consumer did not appear; see its log");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let spool = Spool::in_dir(&args.work);
    let entries = files.clone();
    let built = tokio::task::spawn_blocking(move || {
        let mut b = ManifestBuilder::new(&spool);
        for f in &entries {
            b.push(f)?;
        }
        b.finish()
    })
    .await??;
    let store = ManifestStore::catalogue(&js, BucketOptions::default()).await?;
    let reference = store.put(&built).await?;
    let event = validated(&args, &files, reference);
    let mut prepared = bus
        .client()
        .subscribe(subject::kind_subject(
            subject::FACT,
            "dataset.prepared",
            PROJECT,
        ))
        .await?;

    let cpu0 = process_cpu_seconds(pid).unwrap_or(0.0);
    let start = Instant::now();
    bus.publish(&event).await?;
    let fact = loop {
        let msg = tokio::time::timeout(Duration::from_secs(3600), prepared.next())
            .await
            .context("no dataset.prepared within an hour")?
            .context("subscription ended")?;
        let fact = wire::decode(&msg.payload)?;
        if fact.causation_id.as_ref() == Some(&event.id) {
            break fact;
        }
    };
    let seconds = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds(pid).unwrap_or(0.0) - cpu0;
    let rss = peak_rss_bytes(pid).unwrap_or(0);
    let Body::DatasetPrepared(p) = &fact.body else {
        bail!("not a dataset.prepared: {}", fact.kind());
    };
    let shards = p
        .files
        .iter()
        .filter(|f| f.path.ends_with(".tar"))
        .count()
        .max(
            p.manifest
                .as_ref()
                .map_or(0, |m| ((m.files.saturating_sub(1)) / 2) as usize),
        );
    println!(
        "{}",
        serde_json::json!({
            "tool": "stagehand-resharder",
            "seconds": seconds,
            "files": files.len(),
            "bytes": total_bytes(&files),
            "samples": p.samples,
            "shards": shards,
            "shard_bytes": p.total_bytes,
            "cpu_seconds": cpu,
            "peak_rss_bytes": rss,
            "version": p.version,
        })
    );
    if args.stage_to_hot {
        let raw_version = match &event.body {
            Body::DatasetValidated(v) => v.version.clone(),
            _ => bail!("the published fact is not dataset.validated"),
        };
        // The resharder is done; the promoter and the recorder start now, so that the
        // resharding above was timed alone.
        drop(child);
        stage_both(&args, &bus, &nats, &policies, &raw_version, p).await?;
        std::fs::remove_dir_all(&hot)?;
    } else {
        drop(child);
    }
    std::fs::remove_dir_all(&capacity)?;
    Ok(())
}

/// The staging comparison of `--stage-to-hot` (see the module docs).
async fn stage_both(
    args: &Args,
    bus: &Bus,
    nats: &NatsServer,
    policies: &Path,
    raw_version: &str,
    prepared: &DatasetPrepared,
) -> anyhow::Result<()> {
    let shutdown = stagehand_bus::CancellationToken::new();
    let recorder =
        stagehand_catalogue_recorder::config(&nats.url(), args.work.join("state-recorder"));
    let token = shutdown.clone();
    let recorder =
        tokio::spawn(async move { stagehand_catalogue_recorder::run(recorder, token).await });
    let mut promoter =
        stagehand_promoter::config(&nats.url(), policies, args.work.join("state-promoter"));
    promoter.service.instance = Some("bench".into());
    let token = shutdown.clone();
    let promoter = tokio::spawn(async move { stagehand_promoter::run(promoter, token).await });

    // Both versions folded into the catalogue before either request is timed.
    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone());
    let folded = Instant::now();
    for version in [raw_version, prepared.version.as_str()] {
        while catalogue
            .version(Some(PROJECT), &args.dataset, version)
            .await
            .is_err()
        {
            if folded.elapsed() > Duration::from_secs(120) {
                bail!(
                    "the catalogue never folded version {version} of {}",
                    args.dataset
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let mut ready = bus
        .client()
        .subscribe(subject::kind_subject(subject::FACT, "stage.ready", PROJECT))
        .await?;
    for (form, staged_version) in [
        ("raw", raw_version),
        ("prepared", prepared.version.as_str()),
    ] {
        let request = Event::request(
            EventId::for_stage(PROJECT, form, &args.dataset, raw_version, "hot", None),
            PROJECT,
            Body::StageRequested(StageRequested {
                dataset: args.dataset.clone(),
                version: raw_version.to_owned(),
                tier: "hot".into(),
                job_id: form.into(),
                requested_by: "bench".into(),
                deadline: None,
                node: None,
                form: Some(form.into()),
                hold_until: None,
            }),
        );
        let files = match form {
            "raw" => args.source_root.join(&args.prefix),
            _ => args.work.join("capacity").join(&prepared.location.prefix),
        };
        set_cached(&files, args.source_cache)?;
        let start = Instant::now();
        bus.publish(&request).await?;
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(3600), ready.next())
                .await
                .context("no stage.ready within an hour")?
                .context("subscription ended")?;
            if wire::decode(&msg.payload)?.causation_id.as_ref() == Some(&request.id) {
                break;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        // What is on hot now: every file of the staged version, counted and summed.
        let (files, bytes) = tree_size(
            &args
                .work
                .join("hot")
                .join(PROJECT)
                .join(&args.dataset)
                .join(staged_version),
        )?;
        println!(
            "{}",
            serde_json::json!({
                "tool": format!("stage {form}"),
                "seconds": seconds,
                "files": files,
                "bytes": bytes,
                "version": staged_version,
            })
        );
    }
    shutdown.cancel();
    recorder.await??;
    promoter.await??;
    Ok(())
}

/// Puts every file beneath `dir` in the page cache (`warm`: read whole) or out of it
/// (`cold`: the filesystem flushed, then `POSIX_FADV_DONTNEED` on each file), so that both
/// staged versions start from the same place.
fn set_cached(dir: &Path, cache: SourceCache) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    flush_filesystem(dir)?;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).with_context(|| format!("listing {d:?}"))? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                stack.push(entry.path());
                continue;
            }
            let mut file = std::fs::File::open(entry.path())?;
            match cache {
                SourceCache::Warm => {
                    std::io::copy(&mut file, &mut std::io::sink())?;
                }
                SourceCache::Cold => {
                    // SAFETY: a plain system call on a descriptor this function owns.
                    let err = unsafe {
                        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
                    };
                    if err != 0 {
                        bail!(
                            "evicting {:?}: {}",
                            entry.path(),
                            std::io::Error::from_raw_os_error(err)
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// Files beneath `dir` and their total size.
fn tree_size(dir: &Path) -> anyhow::Result<(u64, u64)> {
    let (mut files, mut bytes) = (0, 0);
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).with_context(|| format!("listing {d:?}"))? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                files += 1;
                bytes += meta.len();
            }
        }
    }
    Ok((files, bytes))
}
