//! `stagehand ingest` end to end, as the real binary, against a real nats-server, the real
//! ingest validator and catalogue recorder (in-process), and SeaweedFS for S3 source tiers:
//! manifests by reference, registration in place (posix and S3), refusals before anything is
//! read, a rerun after a rejection and after a dead-lettered outage, and a SIGKILL mid-copy
//! followed by a rerun that leaves no temporary behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand_bus::{Bus, BusConfig, CancellationToken, WorkerConfig, WorkerStats, run_worker};
use stagehand_catalogue::{Answer, Query, ask};
use stagehand_ingest_validator::{IngestValidator, Settings, SourceChecks, ValidatorOptions};
use stagehand_manifest::{BucketOptions, ManifestStore};
use stagehand_mover::Tier;
use stagehand_mover::s3::{S3Config, S3Tier};
use stagehand_policy::{Policies, TierKind};
use stagehand_schemas::{FileRef, sha256_hex, subject, version_digest};
use stagehand_testkit::{
    ACCESS_KEY, NatsServer, REGION, S3Server, SECRET_KEY, wait_for, wait_until,
};

const WAIT: Duration = Duration::from_secs(60);
const PROJECT: &str = "lab-a";

/// A home with the default policies (the posix source tier at `<home>/tiers/source`),
/// optionally an S3 source tier `lab` on `bucket` (prefix `drop`) at `endpoint`.
struct Home {
    dir: tempfile::TempDir,
    policies: PathBuf,
    source_root: PathBuf,
}

impl Home {
    fn new(s3: Option<(&str, &str)>) -> anyhow::Result<Home> {
        Home::new_in(&std::env::temp_dir(), s3)
    }

    /// A home beneath `parent`.
    fn new_in(parent: &Path, s3: Option<(&str, &str)>) -> anyhow::Result<Home> {
        let dir = tempfile::tempdir_in(parent)?;
        let policies = dir.path().join("policies");
        stagehand::up::write_default_policies(&policies, dir.path())?;
        if let Some((bucket, endpoint)) = s3 {
            let mut tiers = std::fs::read_to_string(policies.join("tiers.toml"))?;
            tiers.push_str(&format!(
                "\n[tiers.lab]\nkind = \"s3\"\nrole = \"source\"\nfailure_domain = \"lab-bucket\"\n\
                 endpoint = \"{endpoint}\"\nallow_plaintext = true\nbucket = \"{bucket}\"\nprefix = \"drop\"\n"
            ));
            std::fs::write(policies.join("tiers.toml"), tiers)?;
        }
        let source_root = dir.path().join("tiers/source");
        std::fs::create_dir_all(&source_root)?;
        Ok(Home {
            dir,
            policies,
            source_root,
        })
    }

    fn set_validation(&self, key: &str, value: &str) -> anyhow::Result<()> {
        let path = self.policies.join("validation.toml");
        let text = std::fs::read_to_string(&path)?;
        let replaced: Vec<String> = text
            .lines()
            .map(|l| {
                if l.starts_with(&format!("{key} =")) {
                    format!("{key} = {value}")
                } else {
                    l.to_owned()
                }
            })
            .collect();
        std::fs::write(&path, replaced.join("\n") + "\n")?;
        Ok(())
    }
}

/// The ingest validator in-process on `nats`, reading the source tiers of `policies` (an S3
/// tier with the test server's keys, at `s3_endpoint` — which may be a port nothing listens
/// on, for an outage).
struct Validator {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<WorkerStats, stagehand_bus::BusError>>,
}

impl Validator {
    async fn start(
        nats: &NatsServer,
        home: &Home,
        s3_endpoint: Option<&str>,
        tweak: impl FnOnce(&mut WorkerConfig),
    ) -> anyhow::Result<Validator> {
        let policies = Policies::load_dir_with_home(&home.policies, home.dir.path())?;
        let mut tiers = HashMap::new();
        for (name, tier) in policies.tiers() {
            let opened = match (&tier.kind, tier.role) {
                (TierKind::Posix { root }, stagehand_policy::TierRole::Source) => {
                    Some(Tier::Posix(stagehand_mover::PosixTier::open(name, root)?))
                }
                (TierKind::S3(config), stagehand_policy::TierRole::Source) => {
                    let mut config: S3Config = config.clone();
                    if let Some(endpoint) = s3_endpoint {
                        config.endpoint = Some(endpoint.to_owned());
                    }
                    let s3 = S3Server::shared();
                    Some(Tier::S3(S3Tier::connect_with_keys(
                        name,
                        config,
                        s3.access_key(),
                        s3.secret_key(),
                    )?))
                }
                _ => None,
            };
            tiers.insert(name.clone(), (tier.role, opened));
        }
        let checks = SourceChecks::from_parts(policies.validation().clone(), tiers);
        let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
        bus.provision().await?;
        let state = home.dir.path().join("state/ingest-validator");
        let handler = IngestValidator::new(
            checks,
            bus.jetstream().clone(),
            ValidatorOptions::new(&state),
        )?;
        let mut cfg = Settings::new(&home.policies, &state).worker_config();
        tweak(&mut cfg);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run_worker(bus, cfg, Arc::new(handler), shutdown.clone()));
        Ok(Validator { shutdown, task })
    }

    async fn stop(self) -> anyhow::Result<WorkerStats> {
        self.shutdown.cancel();
        Ok(self.task.await??)
    }
}

/// The catalogue recorder in-process.
fn start_recorder(
    nats: &NatsServer,
    home: &Home,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<
        Result<
            stagehand_catalogue_recorder::RecorderStats,
            stagehand_catalogue_recorder::RecorderError,
        >,
    >,
) {
    let config = stagehand_catalogue_recorder::config(
        &nats.url(),
        home.dir.path().join("state/catalogue-recorder"),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(stagehand_catalogue_recorder::run(config, shutdown.clone()));
    (shutdown, task)
}

/// Runs the real `stagehand` binary with only the given NATS server and S3 keys in its
/// environment.
fn stagehand(nats: &NatsServer, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(args).stdin(Stdio::null());
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    cmd.env("STAGEHAND_NATS_URL", nats.url())
        .env_remove("STAGEHAND_HOME")
        .env("RUST_LOG", "warn")
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_REGION", REGION)
        .env_remove("AWS_PROFILE");
    Ok(cmd.output()?)
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `stagehand ingest SOURCE --project lab-a --dataset D --policies .. --wait --json` plus
/// `extra`; the parsed report.
fn ingest(
    nats: &NatsServer,
    home: &Home,
    source: &str,
    dataset: &str,
    extra: &[&str],
) -> anyhow::Result<(Output, serde_json::Value)> {
    let policies = home.policies.to_str().context("utf-8")?;
    let mut args = vec![
        "ingest",
        source,
        "--project",
        PROJECT,
        "--dataset",
        dataset,
        "--policies",
        policies,
        "--json",
        "--timeout",
        "60",
    ];
    args.extend_from_slice(extra);
    let out = stagehand(nats, &args)?;
    let report = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    Ok((out, report))
}

fn write_files(dir: &Path, n: usize) -> anyhow::Result<Vec<FileRef>> {
    let mut files = Vec::new();
    for i in 0..n {
        let rel = format!("part-{}/{i:05}.bin", i % 7);
        let body = format!("file {i}\n");
        std::fs::create_dir_all(dir.join(format!("part-{}", i % 7)))?;
        std::fs::write(dir.join(&rel), &body)?;
        files.push(FileRef::new(
            rel,
            body.len() as u64,
            sha256_hex(body.as_bytes()),
        ));
    }
    Ok(files)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

async fn version_files(nats: &NatsServer, dataset: &str, version: &str) -> Option<u64> {
    let client = async_nats::connect(nats.url()).await.ok()?;
    let q = Query::Version {
        project: Some(PROJECT.into()),
        dataset: dataset.into(),
        version: version.into(),
        limit: Some(1),
    };
    match ask(&client, &q, Duration::from_secs(5)).await {
        Ok(Answer::Version(v)) => Some(v.version.file_count),
        _ => None,
    }
}

/// Issue 7: a manifest too large to travel inline is put into the project's upload bucket,
/// named by its SHA-256, and referenced; the validator reads it from there and the version
/// is catalogued with every file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_over_the_inline_bound_travels_by_reference_and_is_catalogued()
-> anyhow::Result<()> {
    let nats = NatsServer::start();
    // The folder and the home (its tiers) on a tmpfs of their own: removing thousands of
    // files from a disk busy with other builds takes longer than the whole test.
    let scratch = tempfile::tempdir()?;
    let tmpfs = stagehand_testkit::Tmpfs::mount(scratch.path().join("fs"), "256m");
    let home = Home::new_in(tmpfs.path(), None)?;
    let validator = Validator::start(&nats, &home, None, |_| {}).await?;
    let (recorder_stop, recorder) = start_recorder(&nats, &home);
    let folder = tempfile::tempdir_in(tmpfs.path())?;
    let files = write_files(folder.path(), 4000)?;
    let digest = version_digest(&files);
    assert!(
        stagehand_schemas::manifest::canonical_len(&files)
            > stagehand_schemas::INLINE_MANIFEST_MAX_BYTES
    );

    let (out, report) = ingest(
        &nats,
        &home,
        folder.path().to_str().context("utf-8")?,
        "big",
        &["--wait"],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(report["by_reference"], true, "{report}");
    assert_eq!(report["files"], 4000);
    assert_eq!(report["digest"], digest.as_str());
    assert_eq!(report["outcome"]["validated"]["version"], digest.as_str());
    assert_eq!(
        report["prefix"],
        format!("{PROJECT}/big/{}", &digest[..16]).as_str()
    );

    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    let uploads =
        ManifestStore::uploads(bus.jetstream(), PROJECT, BucketOptions::default()).await?;
    assert_eq!(uploads.list().await?, vec![digest.clone()]);
    let counted = wait_for(WAIT, "the version in the catalogue", || {
        version_files(&nats, "big", &digest)
    })
    .await?;
    assert_eq!(counted, 4000);
    // The request itself is small: a reference, not 4,000 entries.
    let stream = bus.jetstream().get_stream(subject::REQUESTS.name).await?;
    let stored = stream
        .get_last_raw_message_by_subject(&format!("stagehand.req.ingest.requested.{PROJECT}"))
        .await?;
    assert!(
        stored.payload.len() < 2048,
        "{} bytes",
        stored.payload.len()
    );

    recorder_stop.cancel();
    recorder.await??;
    assert_eq!(validator.stop().await?.handled, 1);
    Ok(())
}

/// Issue 7 item 4: a folder already beneath a posix source tier's root is registered where it
/// is — nothing is copied — and validated at that prefix; one beneath another project's prefix
/// is refused before anything is read or published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_on_a_posix_source_tier_is_registered_in_place() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = Home::new(None)?;
    let validator = Validator::start(&nats, &home, None, |_| {}).await?;
    let drop = home.source_root.join("lab-a/drops/2026-12-01");
    let files = write_files(&drop, 40)?;
    let before = entries(&home.source_root.join("lab-a"));

    let (out, report) = ingest(
        &nats,
        &home,
        drop.to_str().context("utf-8")?,
        "drop",
        &["--wait"],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(report["in_place"], true, "{report}");
    assert_eq!(report["prefix"], "lab-a/drops/2026-12-01");
    assert_eq!(
        report["outcome"]["validated"]["version"],
        version_digest(&files).as_str()
    );
    assert_eq!(
        entries(&home.source_root.join("lab-a")),
        before,
        "nothing was copied"
    );

    // Beneath another project's prefix: refused, nothing published.
    let other = home.source_root.join("lab-b/drops/x");
    write_files(&other, 2)?;
    let (out, _) = ingest(
        &nats,
        &home,
        other.to_str().context("utf-8")?,
        "theirs",
        &["--in-place"],
    )?;
    assert!(!out.status.success());
    ensure!(
        said(&out).contains("not beneath project \"lab-a\"'s own prefix"),
        "{}",
        said(&out)
    );
    assert_eq!(validator.stop().await?.handled, 1);
    Ok(())
}

/// Issue 7 item 4: objects already in a lab's bucket (an S3 source tier on SeaweedFS) are
/// registered in place: listed a page at a time and hashed, or taken from the uploader's
/// `--manifest`; the validator reads them from the bucket. A URL outside the project's prefix,
/// or outside every declared tier, is refused before anything is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_on_an_s3_source_tier_are_registered_in_place() -> anyhow::Result<()> {
    let s3 = S3Server::shared();
    let bucket = s3.unique_bucket("lab");
    let nats = NatsServer::start();
    let home = Home::new(Some((&bucket, &s3.endpoint())))?;
    let validator = Validator::start(&nats, &home, None, |_| {}).await?;
    // More objects than one listing page (1,000) holds.
    let mut files = Vec::new();
    for i in 0..1100 {
        let rel = format!("cam-{}/{i:04}.jpg", i % 3);
        let body = format!("frame {i}");
        s3.put_object(&bucket, &format!("drop/lab-a/run-7/{rel}"), body.as_bytes())?;
        files.push(FileRef::new(
            rel,
            body.len() as u64,
            sha256_hex(body.as_bytes()),
        ));
    }
    let url = format!("s3://{bucket}/drop/lab-a/run-7");
    let (out, report) = ingest(&nats, &home, &url, "run-7", &["--wait"])?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(report["tier"], "lab", "{report}");
    assert_eq!(report["prefix"], "lab-a/run-7");
    assert_eq!(report["files"], 1100);
    assert_eq!(
        report["outcome"]["validated"]["version"],
        version_digest(&files).as_str()
    );

    // The uploader's own manifest instead of hashing: the same version, the same answer.
    let manifest = home.dir.path().join("run-7.tsv");
    let lines: String = files.iter().rev().map(FileRef::manifest_line).collect();
    std::fs::write(&manifest, lines)?;
    let (out, report) = ingest(
        &nats,
        &home,
        &url,
        "run-7",
        &["--wait", "--manifest", manifest.to_str().context("utf-8")?],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(
        report["outcome"]["validated"]["version"],
        version_digest(&files).as_str()
    );

    for (url, says) in [
        (
            format!("s3://{bucket}/drop/lab-b/run-7"),
            "not beneath project \"lab-a\"",
        ),
        (
            format!("s3://{bucket}/elsewhere/lab-a"),
            "not inside any s3 source tier",
        ),
        (
            "s3://no-such-lab/lab-a".to_owned(),
            "not inside any s3 source tier",
        ),
    ] {
        let (out, _) = ingest(&nats, &home, &url, "refused", &[])?;
        assert!(!out.status.success(), "{url}");
        ensure!(said(&out).contains(says), "{url}: {}", said(&out));
    }
    let stats = validator.stop().await?;
    assert_eq!(
        stats.handled, 1,
        "the second ingest is the same request: {stats:?}"
    );
    Ok(())
}

/// Issue 6 item 4 (CLI): a rejection is the validator's recorded answer to a request id for
/// good. Rerunning the same ingest after the cause is fixed (here the validation policy) is
/// asked as the request's next attempt, so it is validated instead of answered with the old
/// rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_after_a_rejection_is_validated_once_the_policy_is_fixed() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = Home::new(None)?;
    home.set_validation("max_file_size", "\"4 B\"")?;
    let validator = Validator::start(&nats, &home, None, |_| {}).await?;
    let folder = tempfile::tempdir()?;
    let files = write_files(folder.path(), 5)?;
    let source = folder.path().to_str().context("utf-8")?;
    let flags = ["--wait", "--clock-skew-ms", "0"];

    let (out, first) = ingest(&nats, &home, source, "strict", &flags)?;
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert_eq!(
        first["outcome"]["rejected"]["problems"][0]["code"], "too_large",
        "{first}"
    );
    validator.stop().await?;

    // The policy is fixed: the rerun meets attempt 0's recorded rejection and asks again.
    home.set_validation("max_file_size", "\"64 GiB\"")?;
    let validator = Validator::start(&nats, &home, None, |_| {}).await?;
    let (out, second) = ingest(&nats, &home, source, "strict", &flags)?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(second["attempt"], 1, "{second}");
    assert_eq!(second["earlier_rejections"], 1);
    assert_ne!(second["request_id"], first["request_id"]);
    assert_eq!(
        second["outcome"]["validated"]["version"],
        version_digest(&files).as_str()
    );

    // Once validated, a rerun is answered by that validation: no third attempt.
    let (out, third) = ingest(&nats, &home, source, "strict", &flags)?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(third["attempt"], 1, "{third}");
    assert_eq!(third["duplicate"], true);
    let stats = validator.stop().await?;
    assert_eq!(
        stats.handled, 1,
        "attempt 0 answered from the record twice, attempt 1 validated once: {stats:?}"
    );
    Ok(())
}

/// Issue 6 item 4 (CLI): a request dead-lettered because its source tier was unreachable is
/// worked on again when the same `stagehand ingest` runs after the tier is back — also inside
/// the requests stream's duplicate window, where the rerun's first publication is dropped as
/// a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_after_a_dead_lettered_outage_is_validated_once_the_tier_is_back()
-> anyhow::Result<()> {
    let s3 = S3Server::shared();
    let bucket = s3.unique_bucket("outage");
    let nats = NatsServer::start();
    let home = Home::new(Some((&bucket, &s3.endpoint())))?;
    let mut files = Vec::new();
    for i in 0..3 {
        let body = format!("scan {i}");
        s3.put_object(
            &bucket,
            &format!("drop/lab-a/scans/{i}.dcm"),
            body.as_bytes(),
        )?;
        files.push(FileRef::new(
            format!("{i}.dcm"),
            body.len() as u64,
            sha256_hex(body.as_bytes()),
        ));
    }
    // The validator's view of the bucket is down: nothing listens on port 1.
    let down = Validator::start(&nats, &home, Some("http://127.0.0.1:1"), |cfg| {
        cfg.max_attempts = 2;
        cfg.retry.initial = Duration::from_millis(50);
        cfg.retry.max = Duration::from_millis(100);
    })
    .await?;
    let url = format!("s3://{bucket}/drop/lab-a/scans");
    let (out, first) = ingest(&nats, &home, &url, "scans", &[])?;
    ensure!(out.status.success(), "{}", said(&out));
    let id = first["request_id"]
        .as_str()
        .context("request id")?
        .to_owned();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    let dead = bus
        .jetstream()
        .get_stream(subject::DEAD_LETTERS.name)
        .await?;
    wait_until(WAIT, "the request to be dead-lettered", || {
        let mut dead = dead.clone();
        async move { dead.info().await.is_ok_and(|i| i.state.messages >= 1) }
    })
    .await?;
    let stats = down.stop().await?;
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");

    // The tier is back: the same ingest, within the duplicate window, is validated.
    let up = Validator::start(&nats, &home, None, |_| {}).await?;
    let (out, second) = ingest(&nats, &home, &url, "scans", &["--wait"])?;
    ensure!(out.status.success(), "{}", said(&out));
    assert_eq!(
        second["request_id"],
        id.as_str(),
        "the same request, not a new attempt"
    );
    assert_eq!(
        second["outcome"]["validated"]["version"],
        version_digest(&files).as_str()
    );
    up.stop().await?;
    Ok(())
}

/// Issue 6 item 9: an ingest killed with SIGKILL in the middle of its copy leaves only its
/// owner-named staging folder (never a partial version), and the next run of the same ingest
/// removes it and publishes the version: afterwards the dataset's folder holds exactly the
/// version, and no temporary anywhere beneath it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_ingest_leaves_nothing_behind_once_rerun() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    Bus::connect(&BusConfig::new(nats.url()))
        .await?
        .provision()
        .await?;
    let home = Home::new(None)?;
    let folder = tempfile::tempdir()?;
    // Enough bytes that the copy takes a while.
    for i in 0..64u8 {
        std::fs::write(
            folder.path().join(format!("shard-{i:02}.bin")),
            vec![i; 4 << 20],
        )?;
    }
    let dataset_dir = home.source_root.join("lab-a/shards");
    let mut child = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["ingest"])
        .arg(folder.path())
        .args(["--project", PROJECT, "--dataset", "shards", "--policies"])
        .arg(&home.policies)
        .env("STAGEHAND_NATS_URL", nats.url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    // Killed once its staging folder holds a file, before the version is published.
    let staged = wait_for(WAIT, "the copy to be under way", || {
        let staging = entries(&dataset_dir)
            .into_iter()
            .find(|n| n.starts_with(".upload-") && n.contains(".stagehand-set-"));
        let dir = dataset_dir.clone();
        async move { staging.filter(|s| !entries(&dir.join(s)).is_empty()) }
    })
    .await?;
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::KILL,
    )?;
    child.wait()?;
    let left = entries(&dataset_dir);
    ensure!(
        left.iter().all(|n| n.starts_with('.')),
        "no version was published by the killed run: {left:?}"
    );
    assert!(left.contains(&staged), "{left:?}");

    let source = folder.path().to_str().context("utf-8")?;
    let (out, report) = ingest(&nats, &home, source, "shards", &[])?;
    ensure!(out.status.success(), "{}", said(&out));
    let prefix = report["prefix"].as_str().context("prefix")?;
    let version = prefix.rsplit('/').next().context("version")?.to_owned();
    assert_eq!(entries(&dataset_dir), vec![version.clone()]);
    for entry in walkdir::WalkDir::new(&dataset_dir) {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy();
        assert!(
            !stagehand_mover::posix::is_temp_name(&name)
                && !stagehand_schemas::layout::is_staging_folder_name(&name),
            "a temporary left: {}",
            entry.path().display()
        );
    }
    assert_eq!(report["files"], 64);
    Ok(())
}

/// Messages in the requests stream: what was published.
async fn requests_published(nats: &NatsServer) -> anyhow::Result<u64> {
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    let mut stream = bus.jetstream().get_stream(subject::REQUESTS.name).await?;
    Ok(stream.info().await?.state.messages)
}

/// Issue 7 item 4 and issue 6 (nothing outside its place): a hostile or odd source is refused
/// with a reason naming the file. Walked by the CLI, a FIFO (copying it could block forever)
/// and a symlink out of the folder (its target is not the uploader's to publish) stop the
/// ingest before anything is published or placed; declared in an uploader's `--manifest` for
/// data registered in place, the same two are rejected by the validator, whose reads never
/// open a FIFO nor follow a link, each with its problem code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_or_a_symlink_out_of_the_source_is_refused_with_its_reason() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = Home::new(None)?;
    let validator = Validator::start(&nats, &home, None, |_| {}).await?;
    let outside = tempfile::tempdir()?;
    std::fs::write(outside.path().join("secret.txt"), "not yours\n")?;

    // A local folder to copy, with a FIFO in it.
    let folder = tempfile::tempdir()?;
    write_files(folder.path(), 3)?;
    rustix::fs::mknodat(
        rustix::fs::CWD,
        folder.path().join("part-0/pipe"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )?;
    let (out, _) = ingest(
        &nats,
        &home,
        folder.path().to_str().context("utf-8")?,
        "piped",
        &["--wait"],
    )?;
    assert!(!out.status.success());
    ensure!(
        said(&out).contains("part-0/pipe is neither a regular file nor a folder: refused"),
        "{}",
        said(&out)
    );
    assert_eq!(
        entries(&home.source_root.join("lab-a/piped")),
        Vec::<String>::new(),
        "nothing placed, no staging folder left"
    );

    // A folder on the source tier, registered in place, with a link out of the tier.
    let drop = home.source_root.join("lab-a/drops/linked");
    let files = write_files(&drop, 3)?;
    std::os::unix::fs::symlink(outside.path().join("secret.txt"), drop.join("secret.txt"))?;
    let source = drop.to_str().context("utf-8")?;
    let (out, _) = ingest(&nats, &home, source, "linked", &["--wait"])?;
    assert!(!out.status.success());
    ensure!(
        said(&out).contains("symlink secret.txt points to")
            && said(&out).contains("secret.txt, outside"),
        "{}",
        said(&out)
    );
    assert_eq!(requests_published(&nats).await?, 0);

    // The same two declared by the uploader: the validator reads neither and rejects both.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        drop.join("pipe"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )?;
    let mut declared = files.clone();
    declared.push(FileRef::new("secret.txt", 10, sha256_hex(b"not yours\n")));
    declared.push(FileRef::new("pipe", 10, sha256_hex(b"not yours\n")));
    let manifest = home.dir.path().join("linked.tsv");
    let lines: String = declared.iter().map(FileRef::manifest_line).collect();
    std::fs::write(&manifest, lines)?;
    let (out, report) = ingest(
        &nats,
        &home,
        source,
        "linked",
        &["--wait", "--manifest", manifest.to_str().context("utf-8")?],
    )?;
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    let problems = report["outcome"]["rejected"]["problems"]
        .as_array()
        .with_context(|| format!("not rejected: {report}"))?;
    let mut found: Vec<(String, String)> = problems
        .iter()
        .map(|p| {
            (
                p["path"].as_str().unwrap_or("").to_owned(),
                p["code"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    found.sort();
    assert_eq!(
        found,
        vec![
            ("pipe".to_owned(), "not_a_file".to_owned()),
            ("secret.txt".to_owned(), "symlink_escape".to_owned()),
        ],
        "{report}"
    );
    assert_eq!(requests_published(&nats).await?, 1);
    assert_eq!(validator.stop().await?.handled, 1);
    Ok(())
}
