//! Measures the ingest validator on one large request: `--files` files of `--size` bytes in
//! `--dirs` folders on a posix source tier, the manifest by reference in the upload bucket.
//!
//! The validator runs in its own process (this binary re-executed with `--serve`, which runs
//! `stagehand_ingest_validator::run` and nothing else), so its peak RSS (`VmHWM`) and CPU time
//! are its own. The files were just written, so they are read from the page cache: this is
//! the validator's own cost (stat, open, read, hash, report), not a disk's. Prints files/s,
//! MiB/s, peak RSS, CPU seconds and cores busy, the progress messages seen, the SHA-256 rate
//! of one and of every core measured in the same run, and the load average.
//!
//! `cargo run --profile bench-release -p stagehand-loadtest --bin validator-bench -- --files 200000 --size 1024`

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_loadtest::{load_average, peak_rss_bytes, process_cpu_seconds};
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::{
    Body, Event, EventId, FileRef, IngestRequested, Location, sha256_hex, subject, wire,
};

const PROJECT: &str = "bench";

#[derive(Parser, Debug)]
#[command(about = "The ingest validator on one large request")]
struct Args {
    /// Files in the dataset.
    #[arg(long, default_value_t = 200_000)]
    files: usize,
    /// Bytes per file.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Folders the files are spread over.
    #[arg(long, default_value_t = 1000)]
    dirs: usize,
    /// The validator's `read_concurrency`.
    #[arg(long, default_value_t = 8)]
    read_concurrency: usize,
    /// Where the tier, policies and state go (default: a temporary folder, removed after).
    #[arg(long)]
    work: Option<PathBuf>,
    /// Internal: run the validator against this NATS URL with the configuration in `--work`.
    #[arg(long, hide = true)]
    serve: Option<String>,
}

fn write_policies(dir: &Path, source_root: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n",
            source_root.display()
        ),
    )?;
    std::fs::write(
        dir.join("validation.toml"),
        "max_file_size = \"64 GiB\"\nmax_entries = 100000000\nmax_total_bytes = \"100 TiB\"\n\
         allowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )?;
    Ok(())
}

/// The child: the validator alone in this process until SIGTERM.
async fn serve(url: String, work: &Path, read_concurrency: usize) -> anyhow::Result<()> {
    let mut config =
        stagehand_ingest_validator::config(&url, work.join("policies"), work.join("state"));
    config.service.read_concurrency = read_concurrency;
    let shutdown = CancellationToken::new();
    let on_term = shutdown.clone();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        term.recv().await;
        on_term.cancel();
    });
    stagehand_ingest_validator::run(config, shutdown).await?;
    Ok(())
}

/// Writes the dataset beneath `root/prefix` and returns its entries.
fn write_dataset(root: &Path, prefix: &str, args: &Args) -> anyhow::Result<Vec<FileRef>> {
    let base = root.join(prefix);
    for d in 0..args.dirs.max(1) {
        std::fs::create_dir_all(base.join(format!("{d:05}")))?;
    }
    let mut buf = vec![0u8; args.size];
    let mut files = Vec::with_capacity(args.files);
    for i in 0..args.files {
        // Distinct bytes per file, cheaply.
        for (j, b) in buf.iter_mut().enumerate() {
            *b = (i.wrapping_mul(31) ^ j.wrapping_mul(7)) as u8;
        }
        let path = format!("{:05}/{i:08}.bin", i % args.dirs.max(1));
        std::fs::write(base.join(&path), &buf)?;
        files.push(FileRef::new(path, buf.len() as u64, sha256_hex(&buf)));
    }
    Ok(files)
}

/// SHA-256 bytes per second on `threads` threads at once, over 256 MiB each.
fn sha256_rate(threads: usize) -> f64 {
    use sha2::Digest;
    let block = vec![0x5au8; 1 << 20];
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut h = sha2::Sha256::new();
                for _ in 0..256 {
                    h.update(&block);
                }
                std::hint::black_box(h.finalize());
            });
        }
    });
    (threads as f64 * 256.0 * 1024.0 * 1024.0) / start.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(url) = args.serve.clone() {
        let work = args.work.clone().context("--serve needs --work")?;
        return serve(url, &work, args.read_concurrency).await;
    }
    let tmp = tempfile::tempdir()?;
    let work = args.work.clone().unwrap_or_else(|| tmp.path().to_owned());
    let source_root = work.join("source");
    std::fs::create_dir_all(&source_root)?;
    write_policies(&work.join("policies"), &source_root)?;
    let nats = stagehand_testkit::NatsServer::start();

    let prefix = format!("{PROJECT}/data/1");
    let started = Instant::now();
    let files = write_dataset(&source_root, &prefix, &args)?;
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    println!(
        "wrote {} files of {} bytes in {} folders in {:.1} s",
        files.len(),
        args.size,
        args.dirs,
        started.elapsed().as_secs_f64()
    );
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let spool = Spool::in_dir(&work);
    let mut builder = ManifestBuilder::new(&spool);
    for f in &files {
        builder.push(f)?;
    }
    drop(files);
    let manifest = builder.finish()?;
    let reference = ManifestStore::uploads(bus.jetstream(), PROJECT, BucketOptions::default())
        .await?
        .put(&manifest)
        .await?;

    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--serve", &nats.url(), "--read-concurrency"])
        .arg(args.read_concurrency.to_string())
        .arg("--work")
        .arg(&work)
        .spawn()
        .context("starting the validator process")?;
    let pid = child.id();
    // Ready once its durable consumer exists.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stream = bus.jetstream().get_stream(subject::REQUESTS.name).await?;
        if stream.consumer_info("ingest-validator").await.is_ok() {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the validator did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let id = EventId::new("validator-bench-1")?;
    let mut facts = bus.client().subscribe(subject::FACTS.subjects[0]).await?;
    let mut progress = bus
        .client()
        .subscribe(progress_subject("ingest.requested", None, PROJECT, &id))
        .await?;
    let progress_seen = Arc::new(AtomicU64::new(0));
    let seen = progress_seen.clone();
    tokio::spawn(async move {
        while let Some(msg) = progress.next().await {
            if WorkProgress::decode(&msg.payload).is_ok() {
                seen.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let event = Event::request(
        id.clone(),
        PROJECT,
        Body::IngestRequested(IngestRequested {
            dataset: "bench".into(),
            source: Location {
                tier: "source".into(),
                prefix,
            },
            files: vec![],
            manifest: Some(reference.clone()),
            requested_by: "bench".into(),
            labels: vec![],
        }),
    );
    let cpu_before = process_cpu_seconds(pid).unwrap_or(0.0);
    let start = Instant::now();
    bus.publish(&event).await?;
    let verdict = loop {
        let msg = tokio::time::timeout(Duration::from_secs(3600), facts.next())
            .await
            .context("no verdict within an hour")?
            .context("facts subscription ended")?;
        let fact = wire::decode(&msg.payload)?;
        if fact.causation_id.as_ref() == Some(&id) {
            break fact;
        }
    };
    let secs = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds(pid).unwrap_or(0.0) - cpu_before;
    let rss = peak_rss_bytes(pid).unwrap_or(0);
    let load = load_average().unwrap_or_default();
    // SAFETY: kill has no memory preconditions; pid is our child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = child.wait();

    match &verdict.body {
        Body::DatasetValidated(v) => anyhow::ensure!(
            v.version == reference.digest,
            "validated as {} instead of {}",
            v.version,
            reference.digest
        ),
        other => anyhow::bail!("not validated: {other:?}"),
    }
    let one = sha256_rate(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all = sha256_rate(cores);
    let mib = bytes as f64 / (1024.0 * 1024.0);
    println!(
        "validated {} files, {:.1} MiB, one version",
        reference.files, mib
    );
    println!("| measure | value |");
    println!("| --- | --- |");
    println!("| request to verdict | {secs:.2} s |");
    println!("| files/s | {:.0} |", reference.files as f64 / secs);
    println!("| MiB/s | {:.1} |", mib / secs);
    println!(
        "| validator peak RSS (VmHWM) | {:.1} MiB |",
        rss as f64 / (1024.0 * 1024.0)
    );
    println!(
        "| validator CPU | {cpu:.1} s ({:.2} cores busy) |",
        cpu / secs
    );
    println!(
        "| progress messages seen | {} |",
        progress_seen.load(Ordering::Relaxed)
    );
    println!(
        "| SHA-256, 1 core / {cores} cores | {:.0} / {:.0} MiB/s |",
        one / (1024.0 * 1024.0),
        all / (1024.0 * 1024.0)
    );
    println!("| load average (1, 5, 15 min) at the verdict | {load} |");
    Ok(())
}
