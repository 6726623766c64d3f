//! Measures the worker runtime against raw JetStream on the same server and payload size:
//!
//! 1. raw publish: async publishes with pipelined PubAcks;
//! 2. raw consume + ack and consume + double ack, acks in flight concurrently;
//! 3. the runtime (`run_worker`) with a no-op handler and the redb ledger on, with claims as
//!    `WorkerConfig` defaults them (the headline), then with claims toggled, and with one fact
//!    published per message.
//!
//! Each row also gives the CPU time per message of this process and of the nats-server it
//! started: on a shared machine throughput moves with the neighbours' load, CPU per message
//! much less.
//!
//! `cargo run --release -p stagehand-loadtest --bin runtime-bench -- --messages 100000 --payload 512`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, consumer::pull, stream};
use clap::Parser;
use futures::{StreamExt, stream::FuturesUnordered};
use stagehand_bus::{
    Bus, BusConfig, CancellationToken, Handler, HandlerError, WorkContext, WorkerConfig, run_worker,
};
use stagehand_loadtest::process_cpu_seconds;
use stagehand_schemas::{
    Body, Event, EventId, Location, StageReady, StageRequested, subject, wire,
};

#[derive(Parser, Debug)]
#[command(about = "Worker runtime throughput against raw JetStream")]
struct Args {
    /// Messages per measurement.
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Encoded size of each message in bytes.
    #[arg(long, default_value_t = 512)]
    payload: usize,
    /// Runtime concurrency (max messages in flight).
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Use this server instead of starting one (it must have JetStream; streams are created).
    /// Its CPU time is then not reported.
    #[arg(long)]
    url: Option<String>,
    /// Run only the headline runtime case (no-op handler, ledger, claims as configured by
    /// default), not the variants with claims toggled and with one fact per message.
    #[arg(long)]
    headline_only: bool,
}

struct Row {
    name: String,
    secs: f64,
    messages: usize,
    cpu: Cpu,
}

/// CPU seconds spent by this process (every thread) and by the nats-server it started.
#[derive(Clone, Copy, Default)]
struct Cpu {
    client: f64,
    server: Option<f64>,
}

impl Cpu {
    fn now(server_pid: Option<u32>) -> Cpu {
        Cpu {
            client: process_cpu_seconds(std::process::id()).unwrap_or(0.0),
            server: server_pid.and_then(process_cpu_seconds),
        }
    }

    fn since(self, start: Cpu) -> Cpu {
        Cpu {
            client: self.client - start.client,
            server: self.server.zip(start.server).map(|(a, b)| a - b),
        }
    }
}

/// The pid of the nats-server whose command line names `store` (the one the testkit started).
fn server_pid(store: &std::path::Path) -> Option<u32> {
    let store = store.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            (cmdline.contains("nats-server") && cmdline.contains(store.as_str())).then_some(pid)
        })
}

impl Row {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.secs
    }
}

struct NoOp;
impl Handler for NoOp {
    async fn handle(&self, _e: &Event, _c: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        Ok(Vec::new())
    }
}

struct OneFact;
impl Handler for OneFact {
    async fn handle(&self, e: &Event, _c: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let Body::StageRequested(r) = &e.body else {
            return Err(HandlerError::permanent("not a stage request"));
        };
        Ok(vec![e.caused(
            "ready",
            Body::StageReady(StageReady {
                dataset: r.dataset.clone(),
                version: r.version.clone(),
                location: Location {
                    tier: r.tier.clone(),
                    prefix: stagehand_schemas::layout::version_folder(
                        &e.project, &r.dataset, &r.version,
                    ),
                },
                job_id: r.job_id.clone(),
                request_id: e.id.clone(),
                node: None,
                path: None,
            }),
        )])
    }
}

fn request(i: usize, pad: usize) -> Event {
    Event::request(
        EventId::new(format!("bench-{i:08}")).expect("valid id"),
        "bench",
        Body::StageRequested(StageRequested {
            dataset: "bench".into(),
            version: "0123456789abcdef0123".into(),
            tier: "hot".into(),
            job_id: format!("{i}"),
            requested_by: "x".repeat(pad),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let n = args.messages;
    let _server;
    let mut spid = None;
    let url = match &args.url {
        Some(u) => u.clone(),
        None => {
            let s = stagehand_testkit::NatsServer::start();
            let u = s.url();
            spid = server_pid(&s.store_dir());
            _server = s;
            u
        }
    };
    let client = async_nats::connect(&url).await.context("connecting")?;
    let js = jetstream::new(client.clone());
    let mut rows = Vec::new();

    // Raw publish.
    let raw_name = format!("BENCH_RAW_{}", std::process::id());
    js.create_stream(stream::Config {
        name: raw_name.clone(),
        subjects: vec!["bench.raw.>".into()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await?;
    let payload = bytes::Bytes::from(vec![b'x'; args.payload]);
    let start = Instant::now();
    let cpu = Cpu::now(spid);
    let mut acks = FuturesUnordered::new();
    for i in 0..n {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("raw-{i}").as_str());
        acks.push(
            js.publish_with_headers("bench.raw.x", headers, payload.clone())
                .await?
                .into_future(),
        );
        while acks.len() >= 4096 {
            acks.next().await.transpose()?;
        }
    }
    while acks.next().await.transpose()?.is_some() {}
    rows.push(Row {
        name: "raw publish (pipelined PubAcks)".into(),
        secs: start.elapsed().as_secs_f64(),
        messages: n,
        cpu: Cpu::now(spid).since(cpu),
    });

    // Raw consume + ack, then consume + double ack, each on its own durable consumer.
    let raw = js.get_stream(&raw_name).await?;
    for (name, double) in [
        ("raw consume + ack", false),
        ("raw consume + double ack", true),
    ] {
        let durable = if double { "raw-double" } else { "raw-ack" };
        let consumer = raw
            .create_consumer(pull::Config {
                durable_name: Some(durable.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: (args.concurrency * 2) as i64,
                ..Default::default()
            })
            .await?;
        let start = Instant::now();
        let cpu = Cpu::now(spid);
        let messages = consumer
            .stream()
            .max_messages_per_batch(args.concurrency)
            .messages()
            .await?;
        messages
            .take(n)
            .for_each_concurrent(args.concurrency, |m| async move {
                let m = m.expect("message");
                if double {
                    m.double_ack().await.expect("double ack");
                } else {
                    m.ack().await.expect("ack");
                }
            })
            .await;
        if !double {
            client.flush().await?;
        }
        rows.push(Row {
            name: name.into(),
            secs: start.elapsed().as_secs_f64(),
            messages: n,
            cpu: Cpu::now(spid).since(cpu),
        });
    }

    // The runtime: the same number of Stagehand requests, of the same encoded size.
    let bus = Bus::connect(&BusConfig::new(url.clone())).await?;
    bus.provision().await?;
    let base = wire::encode(&request(0, 0))?.len();
    let pad = args.payload.saturating_sub(base);
    println!(
        "request events encode to {} bytes",
        wire::encode(&request(0, pad))?.len()
    );
    let mut acks = FuturesUnordered::new();
    for i in 0..n {
        let e = request(i, pad);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", e.id.as_str());
        let subj = subject::subject_for(&e.body, &e.project);
        acks.push(
            js.publish_with_headers(subj, headers, wire::encode(&e)?.into())
                .await?
                .into_future(),
        );
        while acks.len() >= 4096 {
            acks.next().await.transpose()?;
        }
    }
    while acks.next().await.transpose()?.is_some() {}

    let dir = tempfile::tempdir()?;
    let default_claims = WorkerConfig::new("x", "x", vec![], "x").claims;
    let claims_label = |on: bool| {
        let default = if on == default_claims {
            " (default)"
        } else {
            ""
        };
        format!("claims {}{default}", if on { "on" } else { "off" })
    };
    let mut cases = vec![(
        format!("runtime, no-op, ledger, {}", claims_label(default_claims)),
        default_claims,
        false,
    )];
    if !args.headline_only {
        cases.push((
            format!("runtime, no-op, ledger, {}", claims_label(!default_claims)),
            !default_claims,
            false,
        ));
        cases.push((
            format!(
                "runtime, 1 fact/msg, ledger, {}",
                claims_label(default_claims)
            ),
            default_claims,
            true,
        ));
    }
    let mut commit_notes = Vec::new();
    for (i, (name, claims, fact)) in cases.into_iter().enumerate() {
        let service = format!("bench-{i}");
        let mut cfg = WorkerConfig::new(
            service.clone(),
            subject::REQUESTS.name,
            vec![subject::kind_filter("req", "stage.requested")],
            dir.path().join(format!("{service}.redb")),
        );
        cfg.concurrency = args.concurrency;
        cfg.claims = claims;
        let token = CancellationToken::new();
        let start = Instant::now();
        let cpu = Cpu::now(spid);
        let worker = if fact {
            tokio::spawn(run_worker(
                bus.clone(),
                cfg,
                Arc::new(OneFact),
                token.clone(),
            ))
        } else {
            tokio::spawn(run_worker(bus.clone(), cfg, Arc::new(NoOp), token.clone()))
        };
        let requests = js.get_stream(subject::REQUESTS.name).await?;
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Ok(info) = requests.consumer_info(&service).await
                && info.num_pending == 0
                && info.num_ack_pending == 0
                && info.ack_floor.stream_sequence > 0
            {
                break;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu = Cpu::now(spid).since(cpu);
        token.cancel();
        let stats = worker.await??;
        anyhow::ensure!(
            stats.handled as usize == n,
            "{name}: handled {} of {n}",
            stats.handled
        );
        commit_notes.push(format!(
            "{name}: {} ledger commits for {} writes ({:.0} outcomes per commit, one commit every {:.2} ms)",
            stats.ledger_commits,
            stats.ledger_writes,
            stats.ledger_writes as f64 / stats.ledger_commits.max(1) as f64,
            1000.0 * secs / stats.ledger_commits.max(1) as f64,
        ));
        rows.push(Row {
            name,
            secs,
            messages: n,
            cpu,
        });
    }

    let reference = rows
        .iter()
        .find(|r| r.name == "raw consume + double ack")
        .map(Row::rate)
        .unwrap_or(1.0);
    println!();
    for note in &commit_notes {
        println!("{note}");
    }
    println!();
    println!(
        "{n} messages of {} bytes; raw consumers and runtime: concurrency {} (runtime: {} handlers, \
         {} messages in flight = max_ack_pending); ledger fsyncs every commit",
        args.payload,
        args.concurrency,
        args.concurrency,
        args.concurrency * 2
    );
    println!(
        "{:<52} {:>8} {:>10} {:>9} {:>11} {:>11}",
        "measurement", "seconds", "msgs/s", "vs dbl-ack", "client µs/msg", "server µs/msg"
    );
    for r in &rows {
        let per_msg = |s: f64| 1e6 * s / r.messages as f64;
        println!(
            "{:<52} {:>8.2} {:>10.0} {:>9.0}% {:>13.1} {:>13}",
            r.name,
            r.secs,
            r.rate(),
            100.0 * r.rate() / reference,
            per_msg(r.cpu.client),
            r.cpu
                .server
                .map_or_else(|| "n/a".to_owned(), |s| format!("{:.1}", per_msg(s))),
        );
    }
    Ok(())
}
