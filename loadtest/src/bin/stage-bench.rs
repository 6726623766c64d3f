//! The promoter end to end on one machine (`loadtest/stage/bench.sh` runs it beside rclone and
//! cp + sha256sum): a nats-server, the catalogue recorder and the promoter in this process,
//! posix tiers under `--dir`. It lays out validated datasets on the capacity tier (manifests by
//! reference in the services' bucket), then measures, each from the request's publish to its
//! `stage.ready`:
//!
//! - `small`: `--small-files` × 4 KiB, staged to hot;
//! - `large`: `--large-files` × `--large-mib` MiB, staged to hot;
//! - `staged`: `--latency-requests` requests, one after another, for a version already on hot
//!   (p50, p99);
//! - `fifty`: `--concurrent` requests at once for one version not yet on hot (one copy).
//!
//! Prints one JSON object per measurement on stdout.

// The promoter runs in this process, its worker futures nested inside the bench's own: a
// release build computes their layout deeper than the default limit (128) allows.
#![recursion_limit = "256"]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, Location, StageRequested, sha256_hex, subject,
};
use stagehand_testkit::NatsServer;

const PROJECT: &str = "bench";

#[derive(Debug, Parser)]
struct Args {
    /// Where the tiers, the state and the policies go (kept between runs: the data is made
    /// once).
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, default_value_t = 100_000)]
    small_files: usize,
    #[arg(long, default_value_t = 8)]
    large_files: usize,
    #[arg(long, default_value_t = 1024)]
    large_mib: usize,
    #[arg(long, default_value_t = 200)]
    latency_requests: usize,
    #[arg(long, default_value_t = 50)]
    concurrent: usize,
    /// `read-back` or `hashed-in-flight`.
    #[arg(long, default_value = "hashed-in-flight")]
    verify: String,
    /// The promoter's mover block size in KiB (default: the mover's).
    #[arg(long)]
    block_kib: Option<usize>,
    /// The promoter's mover buffers in flight (default: the mover's).
    #[arg(long)]
    buffers: Option<usize>,
}

fn file_bytes(seed: u64, len: usize) -> Vec<u8> {
    // Cheap, non-repeating content (xorshift), so no filesystem dedups or compresses it.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes the files of a dataset (once) and returns its manifest entries.
fn lay_out(dir: &Path, files: usize, size: usize, seed: u64) -> anyhow::Result<Vec<FileRef>> {
    let list = dir.join(".manifest.tsv");
    if let Ok(text) = std::fs::read_to_string(&list) {
        return text
            .lines()
            .map(|l| {
                stagehand_schemas::manifest::parse_line(l.as_bytes())
                    .map_err(|e| anyhow::anyhow!("{e:?}"))
            })
            .collect();
    }
    let mut refs = Vec::with_capacity(files);
    for i in 0..files {
        // 1,000 files per folder, as a sharded dataset would be.
        let rel = format!("d{:03}/f{i:06}.bin", i / 1000);
        let path = dir.join(&rel);
        if i % 1000 == 0 {
            std::fs::create_dir_all(path.parent().unwrap())?;
        }
        let bytes = file_bytes(seed ^ (i as u64 + 1), size);
        std::fs::write(&path, &bytes)?;
        refs.push(FileRef::new(rel, size as u64, sha256_hex(&bytes)));
    }
    let mut text = String::new();
    for r in &refs {
        text.push_str(&r.manifest_line());
    }
    std::fs::write(&list, text)?;
    // The same list for `sha256sum -c`.
    let mut sums = String::new();
    for r in &refs {
        sums.push_str(&format!("{}  {}\n", r.sha256, r.path));
    }
    std::fs::write(dir.join(".sha256sums"), sums)?;
    Ok(refs)
}

struct Bench {
    bus: Bus,
    spool: Spool,
    ready: tokio::sync::Mutex<async_nats::Subscriber>,
    catalogue: stagehand_catalogue::Catalogue,
}

impl Bench {
    /// Publishes `dataset.validated` for a dataset on the capacity tier, its manifest stored
    /// by reference, and waits until the catalogue knows it.
    async fn validate(
        &self,
        dataset: &str,
        prefix: &str,
        refs: &[FileRef],
    ) -> anyhow::Result<String> {
        let mut builder = ManifestBuilder::new(&self.spool);
        for r in refs {
            builder.push(r)?;
        }
        let manifest = builder.finish()?;
        let store =
            ManifestStore::catalogue(self.bus.jetstream(), BucketOptions::default()).await?;
        let reference = store.put(&manifest).await?;
        let version = manifest.digest().to_owned();
        let ingest = EventId::for_ingest(PROJECT, dataset, &version);
        let fact = Event::request(
            EventId::derive(&ingest, "validated"),
            PROJECT,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.into(),
                version: version.clone(),
                source: Location {
                    tier: "capacity".into(),
                    prefix: prefix.into(),
                },
                files: vec![],
                manifest: Some(reference),
                total_bytes: manifest.bytes(),
                requested_by: "bench".into(),
                request_id: ingest,
                labels: vec![],
            }),
        );
        self.bus.publish(&fact).await?;
        let started = Instant::now();
        while self
            .catalogue
            .version(Some(PROJECT), dataset, &version)
            .await
            .is_err()
        {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(300),
                "the catalogue never folded {dataset}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(version)
    }

    /// Publishes a stage request and waits for its `stage.ready`; returns the wall time.
    async fn stage(&self, dataset: &str, version: &str, job: &str) -> anyhow::Result<Duration> {
        Ok(self.stage_timed(dataset, version, job).await?.0)
    }

    /// [`Bench::stage`], and when the promoter's last progress report of the copy (every byte
    /// staged, sent before the set is made durable and published) arrived, from the request.
    async fn stage_timed(
        &self,
        dataset: &str,
        version: &str,
        job: &str,
    ) -> anyhow::Result<(Duration, Option<Duration>)> {
        let request = request(dataset, version, job);
        let mut progress = self
            .bus
            .client()
            .subscribe(progress_subject(
                "stage.requested",
                None,
                PROJECT,
                &request.id,
            ))
            .await?;
        let started = Instant::now();
        let staged_at = std::sync::Arc::new(std::sync::Mutex::new(None));
        let seen = staged_at.clone();
        let watch = tokio::spawn(async move {
            while let Some(msg) = progress.next().await {
                if let Ok(p) = WorkProgress::decode(&msg.payload)
                    && p.bytes_total > 0
                    && p.bytes_done == p.bytes_total
                {
                    *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(started.elapsed());
                }
            }
        });
        self.bus.publish(&request).await?;
        let mut ready = self.ready.lock().await;
        self.await_ready(&mut ready, &[request.id]).await?;
        let took = started.elapsed();
        watch.abort();
        let staged = *staged_at.lock().unwrap_or_else(|e| e.into_inner());
        Ok((took, staged))
    }

    async fn await_ready(
        &self,
        sub: &mut async_nats::Subscriber,
        ids: &[EventId],
    ) -> anyhow::Result<()> {
        let mut left: std::collections::HashSet<EventId> = ids.iter().cloned().collect();
        while !left.is_empty() {
            let msg = tokio::time::timeout(Duration::from_secs(3600), sub.next())
                .await
                .context("no stage.ready within an hour")?
                .context("subscription ended")?;
            let event = stagehand_schemas::wire::decode(&msg.payload)?;
            if let Some(cause) = &event.causation_id {
                left.remove(cause);
            }
        }
        Ok(())
    }
}

fn request(dataset: &str, version: &str, job: &str) -> Event {
    Event::request(
        EventId::for_stage(PROJECT, job, dataset, version, "hot", None),
        PROJECT,
        Body::StageRequested(StageRequested {
            dataset: dataset.into(),
            version: version.into(),
            tier: "hot".into(),
            job_id: job.into(),
            requested_by: "bench".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    )
}

/// The SHA-256 rate of every core on `files` (read from the page cache), in bytes per
/// second: one thread per core, each hashing whole files (SHA-256 is sequential within a
/// file), with the same `sha2` crate the mover hashes with.
fn sha256_limit(files: &[PathBuf]) -> f64 {
    use sha2::Digest;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let started = Instant::now();
    let total: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut bytes = 0u64;
                    let mut buf = vec![0u8; 1 << 20];
                    for f in files.iter().skip(t).step_by(threads) {
                        let mut file = std::fs::File::open(f).expect("a bench file");
                        let mut h = sha2::Sha256::new();
                        loop {
                            let n = std::io::Read::read(&mut file, &mut buf).expect("read");
                            if n == 0 {
                                break;
                            }
                            h.update(&buf[..n]);
                            bytes += n as u64;
                        }
                        std::hint::black_box(h.finalize());
                    }
                    bytes
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    total as f64 / started.elapsed().as_secs_f64()
}

/// The rate a plain copy of `files` into `dir` reaches, in bytes per second, and the CPU it
/// cost (core-seconds of this process per byte): every file at once on its own thread, read
/// from the page cache in 4 MiB blocks and written with `O_DIRECT` into preallocated space
/// (buffered where the filesystem refuses it), each `fdatasync`ed; no hashing. The device's
/// (or tmpfs's) write rate as a copy sees it: a ceiling for the stage when it is below the
/// SHA-256 limit. Its CPU cost says whether the copy competes with the hash for the cores (on
/// tmpfs every byte is copied into newly allocated memory; `O_DIRECT` to a disk costs little).
fn copy_limit(files: &[PathBuf], dir: &Path) -> anyhow::Result<(f64, f64)> {
    let cpu_before = stagehand_loadtest::process_cpu_seconds(std::process::id()).unwrap_or(0.0);
    use std::os::unix::fs::FileExt;
    const BLOCK: usize = 4 << 20;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let started = Instant::now();
    let total: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(i, src)| {
                let dst = dir.join(format!("copy-{i}"));
                scope.spawn(move || -> anyhow::Result<u64> {
                    let src = std::fs::File::open(src)?;
                    let size = src.metadata()?.len();
                    let dst = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&dst)?;
                    let fd = std::os::fd::AsRawFd::as_raw_fd(&dst);
                    // SAFETY: plain syscalls on an open descriptor. O_DIRECT is turned on after
                    // the open, as the mover does, and stays off where the filesystem refuses it.
                    unsafe {
                        let flags = libc::fcntl(fd, libc::F_GETFL);
                        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT);
                        libc::fallocate(fd, 0, 0, size as i64);
                    }
                    let layout = std::alloc::Layout::from_size_align(BLOCK, 4096)?;
                    // SAFETY: the layout is non-zero; the block is freed below.
                    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
                    anyhow::ensure!(!ptr.is_null(), "no memory for a copy block");
                    // SAFETY: `ptr` points at BLOCK bytes this thread alone uses.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, BLOCK) };
                    let mut off = 0u64;
                    let result = (|| {
                        while off < size {
                            let want = ((size - off) as usize).min(BLOCK);
                            let mut n = 0;
                            while n < want {
                                let got = src.read_at(&mut buf[n..want], off + n as u64)?;
                                anyhow::ensure!(got > 0, "the source ended early");
                                n += got;
                            }
                            // A short final block is written whole (O_DIRECT wants aligned
                            // lengths) and the file cut back to its size after.
                            let len = n.next_multiple_of(4096);
                            dst.write_all_at(&buf[..len], off)?;
                            off += n as u64;
                        }
                        dst.set_len(size)?;
                        dst.sync_data()?;
                        Ok(size)
                    })();
                    // SAFETY: allocated above with this layout.
                    unsafe { std::alloc::dealloc(ptr, layout) };
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("copy thread panicked")))
            })
            .sum::<anyhow::Result<u64>>()
    })?;
    let rate = total as f64 / started.elapsed().as_secs_f64();
    let cpu =
        stagehand_loadtest::process_cpu_seconds(std::process::id()).unwrap_or(0.0) - cpu_before;
    std::fs::remove_dir_all(dir)?;
    Ok((rate, cpu / total.max(1) as f64))
}

/// CPU seconds spent between two points, by thread of this process (see
/// [`stagehand_loadtest::thread_cpu_seconds`]) and for the whole machine.
struct CpuMark {
    threads: std::collections::BTreeMap<String, f64>,
    process: f64,
    machine: Option<(f64, f64, f64)>,
}

impl CpuMark {
    fn now() -> CpuMark {
        let pid = std::process::id();
        CpuMark {
            threads: stagehand_loadtest::thread_cpu_seconds(pid),
            process: stagehand_loadtest::process_cpu_seconds(pid).unwrap_or(0.0),
            machine: stagehand_loadtest::machine_cpu_seconds(),
        }
    }

    /// What was spent since `self`, as JSON: per thread name, threads that exited meanwhile,
    /// and the machine's busy, idle and iowait core-seconds (busy includes other processes
    /// and the kernel's workers).
    fn since(&self) -> serde_json::Value {
        let now = CpuMark::now();
        let mut threads = serde_json::Map::new();
        let mut listed = 0.0;
        for (name, secs) in &now.threads {
            let d = secs - self.threads.get(name).copied().unwrap_or(0.0);
            listed += d;
            if d >= 0.005 {
                threads.insert(
                    name.clone(),
                    serde_json::json!((d * 1000.0).round() / 1000.0),
                );
            }
        }
        let exited = (now.process - self.process - listed).max(0.0);
        threads.insert(
            "(exited)".into(),
            serde_json::json!((exited * 1000.0).round() / 1000.0),
        );
        let machine = match (self.machine, now.machine) {
            (Some(a), Some(b)) => serde_json::json!({
                "busy": b.0 - a.0, "idle": b.1 - a.1, "iowait": b.2 - a.2,
            }),
            _ => serde_json::Value::Null,
        };
        serde_json::json!({
            "process": now.process - self.process,
            "threads": threads,
            "machine": machine,
        })
    }
}

fn report(case: &str, fields: serde_json::Value) {
    let mut v = serde_json::json!({ "case": case });
    v.as_object_mut()
        .unwrap()
        .extend(fields.as_object().unwrap().clone());
    println!("{v}");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = std::fs::canonicalize(&args.dir).or_else(|_| {
        std::fs::create_dir_all(&args.dir)?;
        std::fs::canonicalize(&args.dir)
    })?;
    let capacity = dir.join("capacity");
    let hot = dir.join("hot");
    let policies = dir.join("policies");
    for d in [&capacity, &hot, &policies] {
        std::fs::create_dir_all(d)?;
    }
    // A fresh hot tier and state for every run: each run copies.
    let _ = std::fs::remove_dir_all(hot.join(PROJECT));
    let _ = std::fs::remove_dir_all(dir.join("state"));
    std::fs::write(
        policies.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{src}\"\n\n\
             [tiers.capacity]\nkind = \"posix\"\nrole = \"capacity\"\nfailure_domain = \"cap\"\nroot = \"{cap}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{hot}\"\ncapacity = \"1 PiB\"\n\n\
             [tiers.hot.quotas]\ndefault = \"1 PiB\"\n",
            src = dir.join("source").display(),
            cap = capacity.display(),
            hot = hot.display(),
        ),
    )?;
    std::fs::create_dir_all(dir.join("source"))?;
    std::fs::write(
        policies.join("validation.toml"),
        "max_file_size = \"1 TiB\"\nmax_entries = 100000000\nmax_total_bytes = \"1 PiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = true\n",
    )?;
    std::fs::write(
        policies.join("promotion.toml"),
        format!(
            "default_tier = \"hot\"\nsources = [\"capacity\"]\nmax_concurrent = 4\ndefault_deadline = \"2h\"\nverify = \"{}\"\nrecheck_every = \"1h\"\n",
            args.verify
        ),
    )?;

    eprintln!("laying out the datasets under {} ...", capacity.display());
    let small_prefix = format!("{PROJECT}/small/v1");
    let large_prefix = format!("{PROJECT}/large/v1");
    let fifty_prefix = format!("{PROJECT}/fifty/v1");
    let small = lay_out(&capacity.join(&small_prefix), args.small_files, 4096, 1)?;
    let large = lay_out(
        &capacity.join(&large_prefix),
        args.large_files,
        args.large_mib << 20,
        2,
    )?;
    let fifty = lay_out(&capacity.join(&fifty_prefix), 256, 64 << 10, 3)?;

    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let shutdown = CancellationToken::new();
    let recorder = stagehand_catalogue_recorder::config(&nats.url(), dir.join("state/recorder"));
    let r_token = shutdown.clone();
    let recorder =
        tokio::spawn(async move { stagehand_catalogue_recorder::run(recorder, r_token).await });
    let mut promoter =
        stagehand_promoter::config(&nats.url(), &policies, dir.join("state/promoter"));
    promoter.service.instance = Some("bench".into());
    if let Some(kib) = args.block_kib {
        promoter.service.mover.block_size = kib << 10;
    }
    if let Some(n) = args.buffers {
        promoter.service.mover.buffers = n;
    }
    let p_token = shutdown.clone();
    let promoter = tokio::spawn(async move { stagehand_promoter::run(promoter, p_token).await });

    let ready = bus
        .client()
        .subscribe(subject::kind_subject(subject::FACT, "stage.ready", PROJECT))
        .await?;
    let mut replicas = bus
        .client()
        .subscribe(subject::kind_subject(
            subject::FACT,
            "replica.created",
            PROJECT,
        ))
        .await?;
    let bench = Bench {
        catalogue: stagehand_catalogue::Catalogue::new(bus.client().clone()),
        bus: bus.clone(),
        spool: Spool::in_dir(dir.join("state")),
        ready: tokio::sync::Mutex::new(ready),
    };
    std::fs::create_dir_all(dir.join("state"))?;
    let small_v = bench.validate("small", &small_prefix, &small).await?;
    let large_v = bench.validate("large", &large_prefix, &large).await?;
    let fifty_v = bench.validate("fifty", &fifty_prefix, &fifty).await?;

    let bytes = |refs: &[FileRef]| refs.iter().map(|r| r.size).sum::<u64>();
    let large_paths: Vec<PathBuf> = large
        .iter()
        .map(|r| capacity.join(&large_prefix).join(&r.path))
        .collect();
    for (case, dataset, version, refs) in [
        ("small", "small", &small_v, &small),
        ("large", "large", &large_v, &large),
    ] {
        // The all-core SHA-256 rate right before and right after the large stage: the load of
        // the machine moves both, so the stage is compared with the better of the two.
        let large_case = case == "large";
        let before = large_case.then(|| sha256_limit(&large_paths));
        let copy = match large_case {
            true => Some(copy_limit(&large_paths, &hot.join(".copy-limit"))?),
            false => None,
        };
        let cpu = CpuMark::now();
        let (took, staged) = bench
            .stage_timed(dataset, version, &format!("{case}-first"))
            .await?;
        let cpu = cpu.since();
        let after = large_case.then(|| sha256_limit(&large_paths));
        let b = bytes(refs);
        report(
            case,
            serde_json::json!({
                "files": refs.len(), "bytes": b, "seconds": took.as_secs_f64(),
                "staged_seconds": staged.map(|d| d.as_secs_f64()),
                "mib_per_s": b as f64 / (1 << 20) as f64 / took.as_secs_f64(),
                "files_per_s": refs.len() as f64 / took.as_secs_f64(),
                "path": hot.join(PROJECT).join(dataset).join(version),
                "sha256_limit_before": before, "sha256_limit_after": after,
                "copy_limit": copy.map(|c| c.0), "copy_cpu_per_byte": copy.map(|c| c.1),
                "cpu_seconds": cpu,
            }),
        );
    }

    let mut latencies = Vec::with_capacity(args.latency_requests);
    for i in 0..args.latency_requests {
        latencies.push(
            bench
                .stage("small", &small_v, &format!("again-{i}"))
                .await?,
        );
    }
    latencies.sort();
    let pct = |p: f64| {
        latencies[((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1]
    };
    report(
        "staged",
        serde_json::json!({
            "requests": latencies.len(),
            "p50_ms": pct(0.50).as_secs_f64() * 1e3,
            "p99_ms": pct(0.99).as_secs_f64() * 1e3,
            "max_ms": latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        }),
    );

    let requests: Vec<Event> = (0..args.concurrent)
        .map(|i| request("fifty", &fifty_v, &format!("fifty-{i}")))
        .collect();
    let ids: Vec<EventId> = requests.iter().map(|r| r.id.clone()).collect();
    let mut sub = bench.ready.lock().await;
    let started = Instant::now();
    futures::future::try_join_all(requests.iter().map(|r| bus.publish(r))).await?;
    bench.await_ready(&mut sub, &ids).await?;
    let took = started.elapsed();
    drop(sub);
    // Copies are the `replica.created` facts the facts stream stored (one per copy: its id
    // comes from the copying request). A core subscriber sees every publish of a fact, and
    // each answer is published twice (by the promoter as it answers, then by the worker
    // runtime with the handler's result; the stream's duplicate window drops the second), so
    // counting those messages would count each copy twice: they are reported as `publishes`.
    let mut publishes = 0;
    let mut ids = std::collections::HashSet::new();
    while let Ok(Some(msg)) =
        tokio::time::timeout(Duration::from_millis(500), replicas.next()).await
    {
        if let Ok(e) = stagehand_schemas::wire::decode(&msg.payload)
            && matches!(&e.body, Body::ReplicaCreated(r) if r.dataset == "fifty")
        {
            publishes += 1;
            ids.insert(e.id);
        }
    }
    let copies = stagehand_loadtest::stored_facts(&bus, "replica.created", PROJECT)
        .await?
        .iter()
        .filter(|e| matches!(&e.body, Body::ReplicaCreated(r) if r.dataset == "fifty"))
        .count();
    anyhow::ensure!(
        copies == ids.len(),
        "{copies} replica.created stored for fifty, {} distinct ids published",
        ids.len()
    );
    report(
        "fifty",
        serde_json::json!({
            "requests": args.concurrent, "files": fifty.len(), "bytes": bytes(&fifty),
            "seconds": took.as_secs_f64(), "copies": copies, "publishes": publishes,
        }),
    );

    shutdown.cancel();
    let _ = recorder.await;
    let _ = promoter.await;
    Ok(())
}
