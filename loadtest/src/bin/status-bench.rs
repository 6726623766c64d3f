//! `status-bench`: how fast `stagehand status` answers on a large installation.
//!
//! One run, on one nats-server started here, with the catalogue recorder in this process (under
//! the service runner, so keeping its heartbeat): `--datasets` datasets (default 1,000, one
//! small file each: status reads no file list) across `--projects` projects (default 50), each
//! with a replica on a bounded hot tier; `--stages` stage requests (default 10,000) in mixed
//! states — 60 % pending, 20 % failed, 20 % released; `--dead-letters` dead letters (default
//! 500) over five services; `--consumers` durable consumers (default 20) on the fact stream
//! that never consume, so each has the whole stream as backlog; a heartbeat per service. Once
//! the recorder has folded it all, `stagehand status --json --policies P` (the `--cli` binary)
//! runs `--runs` times as a process, then as often without policies (tiers not checked);
//! prints p50/p99/max and the largest peak RSS of those processes (GNU time's).
//! Targets (issue 18): p99 < 1 s, under 64 MiB RSS.
//!
//! `cargo run -p stagehand-loadtest --bin status-bench -- --cli target/debug/stagehand`

use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::consumer::pull;
use clap::Parser;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{Catalogue, Query, StageState};
use stagehand_catalogue_recorder::{config, run};
use stagehand_schemas::*;
use stagehand_testkit::NatsServer;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 1_000)]
    datasets: usize,
    #[arg(long, default_value_t = 50)]
    projects: usize,
    #[arg(long, default_value_t = 10_000)]
    stages: usize,
    #[arg(long, default_value_t = 500)]
    dead_letters: usize,
    #[arg(long, default_value_t = 20)]
    consumers: usize,
    /// Runs of `stagehand status` timed.
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// The `stagehand` binary timed.
    #[arg(long)]
    cli: std::path::PathBuf,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Runs the `stagehand` binary with `args` under `/usr/bin/time` (GNU time): its exit code,
/// stdout and peak RSS in MiB. Measured by a small intermediate process on purpose: Linux
/// carries the high-water RSS of the process that forks across `exec`, so `wait4` here would
/// report this benchmark's own size (the recorder runs in it), not the command's.
fn run_measured(
    cli: &std::path::Path,
    args: &[std::ffi::OsString],
    rss_file: &std::path::Path,
) -> anyhow::Result<(Option<i32>, Vec<u8>, f64)> {
    let out = std::process::Command::new("/usr/bin/time")
        .args(["-f", "%M", "-o"])
        .arg(rss_file)
        .arg(cli)
        .args(args)
        // A home without policies: only `--policies` brings tiers in.
        .env("STAGEHAND_HOME", rss_file.with_file_name("no-home"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running /usr/bin/time (GNU time)")?;
    let kib: f64 = std::fs::read_to_string(rss_file)?
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .parse()
        .context("GNU time's %M")?;
    Ok((out.status.code(), out.stdout, kib / 1024.0))
}

fn project(i: usize, projects: usize) -> String {
    format!("p{:02}", i % projects)
}

/// Publishes `events`, 64 in flight.
async fn publish_all(bus: &Bus, events: Vec<Event>) -> anyhow::Result<()> {
    let mut results = futures::stream::iter(events.into_iter().map(|e| {
        let bus = bus.clone();
        async move { bus.publish(&e).await.map(|_| ()) }
    }))
    .buffer_unordered(64);
    while let Some(r) = results.next().await {
        r?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "status-bench: {} datasets in {} projects, {} stages, {} dead letters, {} consumers with backlog; load average {}",
        args.datasets,
        args.projects,
        args.stages,
        args.dead_letters,
        args.consumers,
        load.trim()
    );
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let dir = tempfile::tempdir()?;
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies)?;
    for tier in ["source", "capacity", "hot"] {
        std::fs::create_dir_all(dir.path().join("tiers").join(tier))?;
    }
    std::fs::write(
        policies.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
             [tiers.capacity]\nkind = \"posix\"\nrole = \"capacity\"\nfailure_domain = \"cap\"\nroot = \"{}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{}\"\n\
             capacity = \"1 TiB\"\nhigh_watermark = 0.85\nlow_watermark = 0.5\n",
            dir.path().join("tiers/source").display(),
            dir.path().join("tiers/capacity").display(),
            dir.path().join("tiers/hot").display()
        ),
    )?;

    std::fs::write(
        policies.join("validation.toml"),
        "max_file_size = \"1 GiB\"\nmax_entries = 1000\nmax_total_bytes = \"1 GiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )?;
    std::fs::write(
        policies.join("demotion.toml"),
        "idle_after = \"1d\"\ncheck_every = \"1h\"\ntarget = \"capacity\"\n",
    )?;

    let shutdown = CancellationToken::new();
    let recorder = tokio::spawn(run(
        config(&nats.url(), dir.path().join("catalogue")),
        shutdown.clone(),
    ));
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(Duration::from_secs(10));
    while catalogue.problems(Some(1), None).await.is_err() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let started = Instant::now();
    let mut versions = Vec::new();
    let mut events = Vec::new();
    for d in 0..args.datasets {
        let project = project(d, args.projects);
        let dataset = format!("set{d:04}");
        let refs = vec![FileRef::new("data.bin", 4096, sha256_hex(&d.to_le_bytes()))];
        let version = version_digest(&refs);
        let ingest = EventId::for_ingest(&project, &dataset, &version);
        let location = |tier: &str| Location {
            tier: tier.into(),
            prefix: format!("{project}/{dataset}/{version}"),
        };
        events.push(Event::request(
            EventId::derive(&ingest, "validated"),
            &project,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.clone(),
                version: version.clone(),
                source: location("source"),
                files: refs,
                manifest: None,
                total_bytes: 4096,
                requested_by: "bench".into(),
                request_id: ingest.clone(),
                labels: vec![],
            }),
        ));
        events.push(Event::request(
            EventId::derive(&ingest, "replica:hot"),
            &project,
            Body::ReplicaCreated(ReplicaCreated {
                dataset: dataset.clone(),
                version: version.clone(),
                location: location("hot"),
                files: 1,
                total_bytes: 4096,
                verified_by: "read-back".into(),
                node: None,
            }),
        ));
        versions.push((project, dataset, version));
    }
    publish_all(&bus, std::mem::take(&mut events)).await?;
    let (mut pending, mut failed) = (0u64, 0u64);
    let mut requests = Vec::new();
    for s in 0..args.stages {
        let (project, dataset, version) = &versions[s % versions.len()];
        let job = format!("job{s:05}");
        let short = &version[..12];
        let request = Event::request(
            EventId::for_stage(project, &job, dataset, short, "hot", None),
            project,
            Body::StageRequested(StageRequested {
                dataset: dataset.clone(),
                version: short.into(),
                tier: "hot".into(),
                job_id: job.clone(),
                requested_by: "bench".into(),
                deadline: None,
                node: None,
                form: None,
                hold_until: None,
            }),
        );
        match s % 5 {
            0 => {
                events.push(request.caused(
                    "failed",
                    Body::StageFailed(StageFailed {
                        dataset: dataset.clone(),
                        version: short.into(),
                        tier: "hot".into(),
                        job_id: job.clone(),
                        request_id: request.id.clone(),
                        reason: "the hot tier is full".into(),
                        retryable: true,
                        node: None,
                    }),
                ));
                failed += 1;
            }
            1 => events.push(Event::request(
                EventId::for_stage_release(project, &job, dataset, short, "hot", None),
                project,
                Body::StageReleased(StageReleased {
                    dataset: dataset.clone(),
                    version: short.into(),
                    tier: "hot".into(),
                    job_id: job.clone(),
                    node: None,
                    reason: None,
                }),
            )),
            _ => pending += 1,
        }
        requests.push(request);
    }
    // Every request stored before any outcome: the outcomes then fold onto their requests.
    publish_all(&bus, requests).await?;
    publish_all(&bus, std::mem::take(&mut events)).await?;
    for n in 0..args.dead_letters {
        let service = [
            "ingest-validator",
            "promoter",
            "demoter",
            "resharder",
            "backup-copier",
        ][n % 5];
        let id = EventId::for_ingest("p00", "dead", &format!("{n}"));
        events.push(Event::request(
            EventId::derive(&id, "dead-letter"),
            "p00",
            Body::DeadLetter(DeadLetter {
                service: service.into(),
                stream: "STAGEHAND_REQUESTS".into(),
                consumer: service.into(),
                stream_sequence: n as u64 + 1,
                subject: "stagehand.req.ingest.requested.p00".into(),
                delivered: 8,
                original: vec![0xc1],
                headers: vec![],
                errors: vec![],
                original_id: None,
            }),
        ));
    }
    publish_all(&bus, std::mem::take(&mut events)).await?;
    let facts = bus.jetstream().get_stream(subject::FACTS.name).await?;
    for c in 0..args.consumers {
        facts
            .create_consumer(pull::Config {
                durable_name: Some(format!("bench-backlog-{c:02}")),
                ..Default::default()
            })
            .await?;
    }
    let published = started.elapsed();
    loop {
        let (_, counts) = catalogue
            .open_stages(StageState::Pending, &[], Some(1), None)
            .await?;
        let dead = match catalogue
            .ask(&Query::DeadLetters {
                limit: None,
                after: None,
            })
            .await?
        {
            stagehand_catalogue::Answer::DeadLetters { services, .. } => {
                services.iter().map(|s| s.count).sum::<u64>()
            }
            _ => 0,
        };
        if counts.pending == pending && counts.failed == failed && dead == args.dead_letters as u64
        {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(900),
            "not folded in 15 min: {counts:?}, {dead} dead letters"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "published in {:.1} s, folded in {:.1} s: {pending} pending, {failed} failed",
        published.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );

    let rss_file = dir.path().join("rss");
    // With the policies (tiers and quotas surveyed), then without (the rest alone: no
    // `STAGEHAND_HOME` policies exist here, so tiers are not checked).
    for with_policies in [true, false] {
        let mut times = Vec::new();
        let mut findings = 0;
        let mut peak_rss: f64 = 0.0;
        for _ in 0..args.runs {
            let started = Instant::now();
            let mut argv: Vec<std::ffi::OsString> = vec![
                "status".into(),
                "--json".into(),
                "--nats".into(),
                nats.url().into(),
            ];
            if with_policies {
                argv.push("--policies".into());
                argv.push(policies.clone().into());
            }
            let (code, stdout, rss) = run_measured(&args.cli, &argv, &rss_file)?;
            times.push(started.elapsed());
            peak_rss = peak_rss.max(rss);
            anyhow::ensure!(code == Some(1), "stagehand status exited {code:?}");
            let report: serde_json::Value = serde_json::from_slice(&stdout)?;
            findings = report["findings"].as_array().map_or(0, Vec::len);
        }
        times.sort();
        println!(
            "stagehand status --json{} ({findings} findings)   n={} p50 {:.0} ms   p99 {:.0} ms   max {:.0} ms   peak RSS {peak_rss:.1} MiB",
            if with_policies {
                " --policies P"
            } else {
                " (no policies)"
            },
            times.len(),
            percentile(&times, 0.50).as_secs_f64() * 1e3,
            percentile(&times, 0.99).as_secs_f64() * 1e3,
            times.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        );
    }
    shutdown.cancel();
    recorder.await??;
    Ok(())
}
