//! Measures one Prometheus scrape of a service's `/metrics` with every series of
//! `stagehand_telemetry::names` present, at the label counts of a large site: `--tiers` tiers
//! (every ordered pair of them moving bytes in each of the four priority classes),
//! `--projects` projects on each tier, `--services` services with two consumers each. Every
//! metric of `names::ALL` is checked to be in the scrape before timing starts; then
//! `--scrapes` scrapes run one after another over fresh connections, as Prometheus makes them,
//! and the latency percentiles, the answer's size and its series count are printed. The
//! issue's target: p99 below 50 ms.
//!
//! `cargo run --release -p stagehand-loadtest --bin scrape-bench -- --scrapes 2000`

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use stagehand_telemetry::metrics::MetricsEndpoint;
use stagehand_telemetry::names;
use stagehand_telemetry::work::{self, DrillSurvey, StageCounts, TierFill};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Parser, Debug)]
#[command(about = "Latency of one /metrics scrape with every series present")]
struct Args {
    /// Scrapes timed.
    #[arg(long, default_value_t = 2000)]
    scrapes: usize,
    /// Tiers (every ordered pair moves bytes in every class).
    #[arg(long, default_value_t = 6)]
    tiers: usize,
    /// Projects with bytes and a quota on every tier.
    #[arg(long, default_value_t = 50)]
    projects: usize,
    /// Services (each with two consumers and the runner's own metrics).
    #[arg(long, default_value_t = 6)]
    services: usize,
}

const CLASSES: [&str; 4] = ["checkpoint", "stage", "ingest", "backup"];

/// Records a value in every series a large site has.
fn populate(args: &Args) {
    let tiers: Vec<String> = (0..args.tiers).map(|i| format!("tier-{i}")).collect();
    let services: Vec<&'static str> = (0..args.services)
        .map(|i| &*Box::leak(format!("service-{i}").into_boxed_str()))
        .collect();
    for from in &tiers {
        for to in tiers.iter().filter(|t| *t != from) {
            for class in CLASSES {
                for mib in [1u64, 64, 1024] {
                    work::moved(from, to, class, 3, mib << 20, Duration::from_millis(40));
                }
            }
        }
    }
    let mut stages = StageCounts::new();
    for tier in &tiers {
        for ready in [true, false] {
            for ms in [5u64, 900, 40_000] {
                work::stage_answered(tier, ready, Duration::from_millis(ms));
            }
        }
        for (state, waits) in [
            ("pending", "validation"),
            ("pending", "preparation"),
            ("copying", "copy"),
        ] {
            stages.insert((tier.clone(), state, waits), 2);
        }
        work::tier_fill(&TierFill {
            tier: tier.clone(),
            capacity: 1 << 50,
            used: 1 << 49,
            counted: 1 << 49,
            held: 1 << 45,
            high_watermark: 0.85,
            projects: (0..args.projects)
                .map(|p| (format!("project-{p}"), 1 << 40, Some(1 << 42)))
                .collect(),
        });
        work::drill_verdict(tier, true);
        work::drill_verdict(tier, false);
        work::drill_survey(&DrillSurvey {
            tier: tier.clone(),
            protected: 10_000,
            never: 10,
            failed: 1,
            last_drill_unix: Some(1.0e9),
            interval: Duration::from_secs(86_400),
        });
    }
    work::stages(&stages);
    work::ingest_verdict(true);
    work::ingest_verdict(false);
    for service in &services {
        for consumer in ["a", "b"] {
            work::consumer_backlog(service, &format!("{service}-{consumer}"), 5, 2, 1);
        }
        work::dead_letters_waiting(service, 1);
        metrics::gauge!(names::SERVICE_INFO, names::label::SERVICE => *service, names::label::VERSION => "bench").set(1.0);
        for result in [
            names::result::OK,
            names::result::RETRYABLE,
            names::result::PERMANENT,
        ] {
            metrics::counter!(names::HANDLER_CALLS_TOTAL, names::label::SERVICE => *service, names::label::RESULT => result).increment(1);
        }
        metrics::histogram!(names::HANDLER_SECONDS, names::label::SERVICE => *service).record(0.01);
        metrics::counter!(names::TASK_FAILURES_TOTAL, names::label::SERVICE => *service, names::label::TASK => "worker").increment(1);
        metrics::counter!(names::QUERIES_REFUSED_TOTAL, names::label::SERVICE => *service)
            .increment(1);
        metrics::counter!(names::DEAD_LETTERS_TOTAL, names::label::SERVICE => *service)
            .increment(1);
        for outcome in [
            names::outcome::DONE,
            names::outcome::REPLAYED,
            names::outcome::REDUNDANT,
            names::outcome::RETRIED,
            names::outcome::DEAD_LETTERED,
            names::outcome::DEFERRED,
        ] {
            metrics::counter!(names::MESSAGES_TOTAL, names::label::SERVICE => *service, names::label::OUTCOME => outcome).increment(1);
        }
    }
    metrics::counter!(names::LEDGER_COMMITS_TOTAL).increment(1);
    metrics::counter!(names::PUBLISHES_SHADOWED_TOTAL, names::label::STREAM => "STAGEHAND_FACTS")
        .increment(1);
}

/// One scrape over a fresh connection: the answer's body.
async fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8(out)?;
    ensure!(
        text.starts_with("HTTP/1.1 200"),
        "{}",
        &text[..text.len().min(200)]
    );
    Ok(text)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    stagehand_telemetry::metrics::install();
    populate(&args);
    let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse()?).await?;
    let addr = endpoint.local_addr()?;
    let stop = tokio::sync::Notify::new();
    let server = endpoint.serve(stop.notified());
    let bench = async {
        let body = scrape(addr).await.context("first scrape")?;
        let missing: Vec<&str> = names::ALL
            .iter()
            .copied()
            .filter(|n| !body.lines().any(|l| l.starts_with(n)))
            .collect();
        ensure!(
            missing.is_empty(),
            "series missing from the scrape: {missing:?}"
        );
        let series = body.lines().filter(|l| l.starts_with("stagehand_")).count();
        let mut times = Vec::with_capacity(args.scrapes);
        for _ in 0..args.scrapes {
            let t = Instant::now();
            scrape(addr).await?;
            times.push(t.elapsed());
        }
        times.sort();
        println!(
            "scrape of {} bytes, {series} series ({} metric names), {} scrapes: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            body.len(),
            names::ALL.len(),
            args.scrapes,
            percentile(&times, 0.5).as_secs_f64() * 1e3,
            percentile(&times, 0.9).as_secs_f64() * 1e3,
            percentile(&times, 0.99).as_secs_f64() * 1e3,
            times.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        );
        stop.notify_one();
        Ok(())
    };
    let (_, result) = tokio::join!(server, bench);
    result
}
