//! The `stagehand-backup-copier` binary as operators run it (`--config FILE`), against a real
//! nats-server and a real S3 server (SeaweedFS): an S3 backup held under Object Lock (a locked
//! version cannot be deleted; an object replaced behind the copier's back fails the next drill,
//! naming it), an Object Lock the bucket cannot give refused at start-up, and SIGKILL of the
//! copier mid-backup — on posix and on S3 — leaving nothing under the set's final name (on S3:
//! no completion marker), the restarted copier resuming and completing it.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use common::*;
use futures::StreamExt;
use stagehand_catalogue::ReplicaState;
use stagehand_mover::s3::{BucketLock, RetentionMode, S3Config, S3Tier};
use stagehand_mover::{SET_COMPLETE_MARKER, Tier};
use stagehand_schemas::{Body, Event, sha256_hex, wire};
use stagehand_testkit::{S3Server, wait_for, wait_until};

/// The binary with its config file, S3 credentials in its environment (never in a file), its
/// `STAGEHAND_NATS_*` cleared so that only the file counts.
fn copier(config: &Path, stderr: &Path) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand-backup-copier"));
    cmd.arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .env("AWS_ACCESS_KEY_ID", stagehand_testkit::ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", stagehand_testkit::SECRET_KEY)
        .env_remove("AWS_PROFILE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(stderr)
                .unwrap(),
        );
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    cmd.spawn().unwrap()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kill_9(child: &mut Killed) {
    let pid = rustix::process::Pid::from_child(&child.0);
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    child.0.wait().unwrap();
}

/// A config file: a short ack wait, so that the message of a killed copier is redelivered
/// (and its claim taken over) within seconds.
fn write_config(path: &Path, nats: &str, policies: &Path, state: &Path, mover: &str) {
    std::fs::write(
        path,
        format!(
            "[bus]\nservers = \"{nats}\"\n\n[worker]\nack_wait = \"1s\"\n\n[service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\ndrill_check = \"100ms\"\n\n[service.mover]\n{mover}\n",
            policies.display(),
            state.display()
        ),
    )
    .unwrap();
}

fn s3_backup(server: &S3Server, bucket: &str, extra: &str) -> String {
    format!(
        "kind = \"s3\"\nrole = \"backup\"\nfailure_domain = \"backup-site\"\nendpoint = \"{}\"\nallow_plaintext = true\nbucket = \"{bucket}\"\nprefix = \"stagehand\"\nprotects = [\"source\", \"capacity\"]\n{extra}",
        server.endpoint()
    )
}

fn s3_tier(server: &S3Server, bucket: &str) -> S3Tier {
    let mut config = S3Config::new(bucket, "stagehand");
    config.endpoint = Some(server.endpoint());
    S3Tier::connect_with_keys("backup", config, server.access_key(), server.secret_key()).unwrap()
}

/// A bucket with Object Lock on (it can only be chosen at creation).
async fn locked_bucket(server: &S3Server) -> String {
    let name = stagehand_testkit::unique_name("lock").to_ascii_lowercase();
    let tier = s3_tier(server, &name);
    tier.client()
        .create_bucket()
        .bucket(&name)
        .object_lock_enabled_for_bucket(true)
        .send()
        .await
        .unwrap();
    name
}

async fn next_fact(sub: &mut async_nats::Subscriber, log: &Path) -> Event {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no fact within {WAIT:?}; copier log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
        })
        .unwrap();
    wire::decode(&msg.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_backup_is_held_under_object_lock_and_a_replaced_object_fails_the_next_drill() {
    let server = S3Server::shared();
    let bucket = locked_bucket(server).await;
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &s3_backup(server, &bucket, "")),
        &backup_toml("1s", "[object_lock]\nmode = \"compliance\"\ndays = 1\n"),
    );
    let stack = Stack::start().await;
    let config = root.join("copier.toml");
    write_config(
        &config,
        &stack.nats.url(),
        &policies,
        &root.join("copier"),
        "",
    );
    let log = root.join("copier.log");
    let _copier = Killed(copier(&config, &log));

    let files = sample_files(4, 70_000);
    let refs = write_files(
        &root.join("source/lab-a/cats/up"),
        &files
            .iter()
            .map(|(p, b)| (p.as_str(), b.clone()))
            .collect::<Vec<_>>(),
    );
    let fact = validated("cats", "lab-a/cats/up", refs);
    let Body::DatasetValidated(v) = &fact.body else {
        unreachable!()
    };
    let version = v.version.clone();
    stack.bus.publish(&fact).await.unwrap();
    let status = stack
        .wait_status("backed up to S3 and drilled", "cats", &version, |s| {
            s.on("backup")
                .and_then(|r| r.last_drill.as_ref())
                .is_some_and(|d| d.ok)
        })
        .await;
    let prefix = status.on("backup").unwrap().prefix.clone();

    // The bucket holds every new version for a day in compliance mode; so are the files.
    let tier = s3_tier(server, &bucket);
    assert!(matches!(
        tier.bucket_lock().await.unwrap(),
        BucketLock::Enabled { default: Some(d) } if d.mode == RetentionMode::Compliance && d.days == 1
    ));
    let victim = files[2].0.clone();
    for rel in [
        format!("{prefix}/{victim}"),
        format!("{prefix}/.stagehand-manifest"),
        format!("{prefix}/{SET_COMPLETE_MARKER}"),
    ] {
        let held = tier.retention(&rel).await.unwrap().expect("held");
        assert_eq!(held.mode, RetentionMode::Compliance, "{rel}");
        assert!(
            held.retain_until > SystemTime::now() + Duration::from_secs(23 * 3600),
            "{rel}"
        );
    }
    // Deleting the locked version is refused, by the S3 API, to the bucket's own admin.
    let key = format!("stagehand/{prefix}/{victim}");
    let versions = tier
        .client()
        .list_object_versions()
        .bucket(&bucket)
        .prefix(&key)
        .send()
        .await
        .unwrap();
    let locked = versions.versions()[0].version_id().unwrap().to_owned();
    let refused = tier
        .client()
        .delete_object()
        .bucket(&bucket)
        .key(&key)
        .version_id(&locked)
        .send()
        .await;
    assert!(refused.is_err(), "a locked version was deleted");

    // Replacing the object adds a version over the locked one: the next drill reads the new
    // bytes and fails, naming the file.
    // Same size, other bytes: a silent corruption, as a bad disk or a careless writer makes.
    server
        .put_object(&bucket, &key, &vec![0u8; files[2].1.len()])
        .unwrap();
    let failed = stack
        .wait_status(
            "the drill after the replacement failed",
            "cats",
            &version,
            |s| {
                backup_copy(s).is_some_and(|r| {
                    r.state == ReplicaState::Damaged && r.last_drill.as_ref().is_some_and(|d| !d.ok)
                })
            },
        )
        .await;
    // The catalogue holds the backup damaged: no longer a copy to rely on.
    assert_eq!(failed.on("backup"), None);
    let drill = backup_copy(&failed).unwrap().last_drill.clone().unwrap();
    assert_eq!(drill.problems.len(), 1, "{:#?}", drill.problems);
    assert_eq!(drill.problems[0].path.as_deref(), Some(victim.as_str()));
    assert_eq!(drill.problems[0].code, "checksum_mismatch");
    // The locked original is still there, behind the new version.
    let after = tier
        .client()
        .list_object_versions()
        .bucket(&bucket)
        .prefix(&key)
        .send()
        .await
        .unwrap();
    assert!(
        after
            .versions()
            .iter()
            .any(|v| v.version_id() == Some(locked.as_str())),
        "the locked version survives"
    );
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_lock_the_bucket_cannot_give_is_refused_at_start_up() {
    let server = S3Server::shared();
    let bucket = server.unique_bucket("nolock");
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &s3_backup(server, &bucket, "")),
        &backup_toml("1h", "[object_lock]\nmode = \"governance\"\ndays = 7\n"),
    );
    let nats = stagehand_testkit::NatsServer::start();
    let config = root.join("copier.toml");
    write_config(&config, &nats.url(), &policies, &root.join("copier"), "");
    let log = root.join("copier.log");
    let mut child = Killed(copier(&config, &log));
    let status = wait_for(WAIT, "the copier to exit", || {
        let status = child.0.try_wait().ok().flatten();
        async move { status }
    })
    .await
    .unwrap();
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "bucket {bucket:?} was created without Object Lock"
        )),
        "{said}"
    );
}

/// The staging folders (and anything else) beneath the dataset's folder on a posix tier.
fn dataset_entries(backup: &Path) -> Vec<String> {
    listing(&backup.join("lab-a/cats"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_backup_to_posix_leaves_nothing_under_the_final_name_and_the_retry_completes() {
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &posix_backup(&root)),
        &backup_toml("1h", ""),
    );
    let nats = stagehand_testkit::NatsServer::start();
    let bus = stagehand_bus::Bus::connect(&stagehand_bus::BusConfig::new(nats.url()))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    let mut completed = bus
        .client()
        .subscribe(stagehand_schemas::subject::kind_filter(
            "fact",
            "backup.completed",
        ))
        .await
        .unwrap();
    // 16 × 256 KiB at 2 MiB/s (with one second of burst): a second of copying to kill it in.
    let config = root.join("copier.toml");
    write_config(
        &config,
        &nats.url(),
        &policies,
        &root.join("copier"),
        "bytes_per_second = 2097152",
    );
    let log = root.join("copier.log");
    let mut first = Killed(copier(&config, &log));
    let files = sample_files(16, 256 * 1024);
    let refs = write_files(
        &root.join("source/lab-a/cats/up"),
        &files
            .iter()
            .map(|(p, b)| (p.as_str(), b.clone()))
            .collect::<Vec<_>>(),
    );
    let fact = validated("cats", "lab-a/cats/up", refs);
    let Body::DatasetValidated(v) = &fact.body else {
        unreachable!()
    };
    let version = v.version.clone();
    bus.publish(&fact).await.unwrap();

    let backup = root.join("backup");
    // Files land in the staging folder as temp files, renamed when their batch is committed.
    wait_until(
        WAIT,
        "two files being written in the staging folder",
        || {
            let n = dataset_entries(&backup)
                .iter()
                .filter(|p| p.contains(".bin"))
                .count();
            async move { n >= 2 }
        },
    )
    .await
    .unwrap();
    kill_9(&mut first);
    let left = dataset_entries(&backup);
    assert!(
        !backup.join("lab-a/cats").join(&version).exists(),
        "the set is not under its final name: {left:#?}"
    );
    assert!(
        left.iter().all(|p| p.starts_with('.')),
        "only the hidden staging folder: {left:#?}"
    );
    assert!(
        left.iter().any(|p| p.ends_with(".tmp")),
        "killed mid-copy, files still being written: {left:#?}"
    );

    let _second = Killed(copier(&config, &log));
    let done = next_fact(&mut completed, &log).await;
    let Body::BackupCompleted(b) = &done.body else {
        panic!("{done:?}")
    };
    assert_eq!((b.version.as_str(), b.files), (version.as_str(), 16));
    let set = backup.join(&b.location.prefix);
    for (path, bytes) in &files {
        assert_eq!(
            sha256_hex(&std::fs::read(set.join(path)).unwrap()),
            sha256_hex(bytes),
            "{path}"
        );
    }
    assert_eq!(
        dataset_entries(&backup)
            .iter()
            .filter(|p| p.starts_with('.'))
            .count(),
        0,
        "the staging folder became the set"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("resuming the staging folder of a dead run"),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_backup_to_s3_leaves_no_completion_marker_and_the_retry_completes() {
    let server = S3Server::shared();
    let bucket = server.unique_bucket("kill");
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    // One request at a time: 300 objects take long enough to kill the copier in the middle.
    write_policies(
        &policies,
        &tiers_toml(
            &root,
            "hot-fs",
            &s3_backup(server, &bucket, "concurrency = 1\n"),
        ),
        &backup_toml("1h", ""),
    );
    let nats = stagehand_testkit::NatsServer::start();
    let bus = stagehand_bus::Bus::connect(&stagehand_bus::BusConfig::new(nats.url()))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    let mut completed = bus
        .client()
        .subscribe(stagehand_schemas::subject::kind_filter(
            "fact",
            "backup.completed",
        ))
        .await
        .unwrap();
    let config = root.join("copier.toml");
    write_config(&config, &nats.url(), &policies, &root.join("copier"), "");
    let log = root.join("copier.log");
    let mut first = Killed(copier(&config, &log));
    let files = sample_files(300, 16 * 1024);
    let refs = write_files(
        &root.join("source/lab-a/cats/up"),
        &files
            .iter()
            .map(|(p, b)| (p.as_str(), b.clone()))
            .collect::<Vec<_>>(),
    );
    let fact = validated("cats", "lab-a/cats/up", refs);
    let Body::DatasetValidated(v) = &fact.body else {
        unreachable!()
    };
    let prefix = format!("lab-a/cats/{}", v.version);
    bus.publish(&fact).await.unwrap();

    let tier = s3_tier(server, &bucket);
    wait_until(WAIT, "ten objects of the set", || {
        let (tier, prefix) = (tier.clone(), prefix.clone());
        async move { tier.list(&prefix).await.is_ok_and(|l| l.len() >= 10) }
    })
    .await
    .unwrap();
    kill_9(&mut first);
    let listed = tier.list(&prefix).await.unwrap();
    assert!(
        listed.len() < files.len(),
        "killed after the copy: {} objects",
        listed.len()
    );
    let marker = format!("{prefix}/{SET_COMPLETE_MARKER}");
    assert!(
        tier.stat(&marker).await.unwrap().is_none(),
        "no completion marker"
    );
    assert!(!Tier::S3(tier.clone()).set_present(&prefix).await.unwrap());

    let _second = Killed(copier(&config, &log));
    let done = next_fact(&mut completed, &log).await;
    let Body::BackupCompleted(b) = &done.body else {
        panic!("{done:?}")
    };
    assert_eq!(b.files, 300);
    assert!(Tier::S3(tier.clone()).set_present(&prefix).await.unwrap());
    // Every object verifies (the set, its manifest and its marker).
    let listed = tier.list(&prefix).await.unwrap();
    assert_eq!(listed.len(), 302, "300 files, the manifest, the marker");
    for (path, bytes) in files.iter().step_by(37) {
        let got = tier.hash_file(&format!("{prefix}/{path}")).await.unwrap();
        assert_eq!(got.sha256, sha256_hex(bytes), "{path}");
    }
}
