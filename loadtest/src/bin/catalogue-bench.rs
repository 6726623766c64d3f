//! `catalogue-bench`: how fast the catalogue answers a page of a very large version.
//!
//! One run, on one nats-server started here: a version of `--files` files (default 1,000,000,
//! in 1,000 folders) is built with `stagehand-manifest`, put in the manifest bucket by
//! reference and published as `dataset.validated`; the catalogue recorder (in this process)
//! fetches it, verifies it and stores it in chunks. Then `--queries` times (default 100) the
//! exact questions `stagehand catalogue show D@V --limit 100 [--after P]` asks — the version,
//! then a page of 100 files after a random path (the first page once) — and, when `--cli`
//! names a `stagehand` binary, that command itself as a process. Prints the fold time, the
//! latency percentiles, the store size and the peak RSS of this process (recorder included).
//!
//! `cargo run --profile bench-release -p stagehand-loadtest --bin catalogue-bench -- --files 1000000`

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{Catalogue, Query};
use stagehand_catalogue_recorder::{config, run};
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_schemas::*;
use stagehand_testkit::NatsServer;

#[derive(Debug, Parser)]
struct Args {
    /// Files in the version.
    #[arg(long, default_value_t = 1_000_000)]
    files: u64,
    /// Queries timed.
    #[arg(long, default_value_t = 100)]
    queries: usize,
    /// Files per page, as `--limit` asks.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// A `stagehand` binary: also time `stagehand catalogue show D@V --limit N --after P` as a
    /// process (start, connect, two queries, print).
    #[arg(long)]
    cli: Option<std::path::PathBuf>,
}

fn path_of(i: u64) -> String {
    format!("train/{:04}/{i:08}.jpg", i % 1000)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn report(name: &str, mut times: Vec<Duration>) {
    times.sort();
    println!(
        "{name:<44} n={:<4} p50 {:>8.2} ms   p99 {:>8.2} ms   max {:>8.2} ms",
        times.len(),
        percentile(&times, 0.50).as_secs_f64() * 1e3,
        percentile(&times, 0.99).as_secs_f64() * 1e3,
        times.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
}

fn peak_rss_mib() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as f64 / 1024.0
}

/// A cheap deterministic sequence of indices (no randomness crate needed for a benchmark).
fn pick(n: u64, k: usize) -> Vec<u64> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..k)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "catalogue-bench: {} files, {} queries of {} files; load average {}",
        args.files,
        args.queries,
        args.limit,
        load.trim()
    );
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let dir = tempfile::tempdir()?;

    let started = Instant::now();
    let mut builder = ManifestBuilder::new(&Spool::in_dir(dir.path()));
    for i in 0..args.files {
        builder.push(&FileRef::new(
            path_of(i),
            1024 + i % 4096,
            sha256_hex(&i.to_le_bytes()),
        ))?;
    }
    let manifest = builder.finish()?;
    let built = started.elapsed();
    let store = ManifestStore::catalogue(bus.jetstream(), BucketOptions::default()).await?;
    let started = Instant::now();
    let reference = store.put(&manifest).await?;
    let put = started.elapsed();

    let shutdown = CancellationToken::new();
    let recorder = tokio::spawn(run(
        config(&nats.url(), dir.path().join("catalogue")),
        shutdown.clone(),
    ));
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(Duration::from_secs(10));
    while catalogue
        .ask(&Query::Problems {
            limit: Some(1),
            after: None,
        })
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let request = Event::request(
        EventId::new("bench-request")?,
        "bench",
        Body::IngestRequested(IngestRequested {
            dataset: "frames".into(),
            source: Location {
                tier: "source".into(),
                prefix: "bench/frames".into(),
            },
            files: vec![],
            manifest: Some(reference.clone()),
            requested_by: "bench".into(),
            labels: vec![],
        }),
    );
    let fact = request.caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: "frames".into(),
            version: reference.digest.clone(),
            source: Location {
                tier: "source".into(),
                prefix: "bench/frames".into(),
            },
            files: vec![],
            manifest: Some(reference.clone()),
            total_bytes: reference.bytes,
            requested_by: "bench".into(),
            request_id: request.id.clone(),
            labels: vec![],
        }),
    );
    let started = Instant::now();
    bus.publish(&fact).await?;
    let digest = reference.digest.clone();
    loop {
        match catalogue.version(Some("bench"), "frames", &digest).await {
            Ok(v) if v.version.file_count == args.files => break,
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(1800),
            "the version was not folded in 30 min"
        );
    }
    let folded = started.elapsed();
    let store_bytes = std::fs::metadata(dir.path().join("catalogue/catalogue.redb"))?.len();
    println!(
        "manifest built {:.1} s, put {:.1} s ({} MiB); fetched, verified and stored by the recorder in {:.1} s; store {} MiB",
        built.as_secs_f64(),
        put.as_secs_f64(),
        manifest.canonical_len() >> 20,
        folded.as_secs_f64(),
        store_bytes >> 20
    );

    // The questions `catalogue show D@V --limit N --after P` asks, one after the other.
    let short = &digest[..12];
    let afters = pick(args.files, args.queries);
    let mut show = Vec::new();
    let mut files_only = Vec::new();
    let mut lookups = Vec::new();
    for (n, i) in afters.iter().enumerate() {
        let after = (n > 0).then(|| path_of(*i));
        let started = Instant::now();
        let v = catalogue.version(None, "frames", short).await?;
        let t = Instant::now();
        let page = catalogue
            .files(
                None,
                "frames",
                &v.version.version,
                Some(args.limit),
                after.as_deref(),
            )
            .await?;
        files_only.push(t.elapsed());
        show.push(started.elapsed());
        anyhow::ensure!(
            page.files.len() as u32 == args.limit.min(args.files as u32) || page.next.is_none(),
            "short page"
        );
        let started = Instant::now();
        catalogue.file(None, "frames", short, &path_of(*i)).await?;
        lookups.push(started.elapsed());
    }
    report("show D@V --limit N (version + files page)", show);
    report("  of which the files page", files_only);
    report("show D@V --path P (one entry)", lookups);

    if let Some(cli) = &args.cli {
        let mut processes = Vec::new();
        for (n, i) in afters.iter().enumerate() {
            let mut cmd = std::process::Command::new(cli);
            cmd.args([
                "--nats",
                &nats.url(),
                "catalogue",
                "show",
                &format!("frames@{short}"),
                "--limit",
                &args.limit.to_string(),
            ]);
            if n > 0 {
                cmd.args(["--after", &path_of(*i)]);
            }
            let started = Instant::now();
            let out = cmd.output().context("running the stagehand binary")?;
            processes.push(started.elapsed());
            anyhow::ensure!(
                out.status.success(),
                "stagehand failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        report(
            "`stagehand catalogue show D@V --limit N` (process)",
            processes,
        );
    }
    println!(
        "peak RSS of this process (recorder included): {:.0} MiB",
        peak_rss_mib()
    );
    shutdown.cancel();
    recorder.await??;
    Ok(())
}
