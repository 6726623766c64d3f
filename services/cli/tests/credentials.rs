//! Every binary reaches a NATS that has users, and never shows their secrets: against a real
//! nats-server with `deploy/nats/accounts.conf` the operator provisions with `stagehand
//! provision --project demo`, the validator runs as its own restricted user, an uploader's
//! `stagehand ingest --wait` (first and repeated) gets its verdict with only the uploader's
//! permissions, a dataset whose manifest travels by reference (put by the uploader in its
//! project's upload bucket, stored validated in the services' bucket, read by the recorder)
//! goes through with each role's own user, a training job's user commits its project's
//! checkpoints (inline, by reference, a re-commit compared) and nothing else, and `stagehand up
//! --external-nats` says where it runs without the password. NKey seed files work
//! for the CLI and the services; a failed connection names the server without its password.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand::ingest::{IngestOptions, Outcome};
use stagehand_bus::{Bus, BusConfig};
use stagehand_manifest::ManifestStore;
use stagehand_schemas::Body;
use stagehand_schemas::subject::MANIFEST_BUCKET;
use stagehand_testkit::{NatsServer, accounts_roles, role_password, user_url};

fn start_server() -> NatsServer {
    NatsServer::builder().shipped_accounts().start()
}

/// Runs the real `stagehand` binary with `STAGEHAND_NATS_URL = url` and nothing else of the
/// caller's NATS environment.
fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(args).stdin(Stdio::null());
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    // Debug logs of every crate, the client library's included: none may carry a secret.
    Ok(cmd
        .env("STAGEHAND_NATS_URL", url)
        .env("RUST_LOG", "debug")
        .output()?)
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn no_secrets(text: &str) -> anyhow::Result<()> {
    for role in accounts_roles() {
        ensure!(
            !text.contains(&role_password(&role)),
            "a password was shown:\n{text}"
        );
    }
    Ok(())
}

fn write_folder(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("images"))?;
    std::fs::write(dir.join("images/1.bin"), vec![7u8; 5000])?;
    std::fs::write(dir.join("labels.csv"), "id,label\n1,cat\n")?;
    Ok(())
}

/// Files of the by-reference dataset: a few thousand, so that its manifest is over the inline
/// bound (about 2,500 entries).
const MANY_FILES: usize = 3000;

/// `MANY_FILES` small distinct files in ten folders.
fn write_many(dir: &Path) -> anyhow::Result<()> {
    for class in 0..10 {
        std::fs::create_dir_all(dir.join(format!("images/c{class:02}")))?;
    }
    for i in 0..MANY_FILES {
        std::fs::write(
            dir.join(format!("images/c{:02}/img-{i:05}.bin", i % 10)),
            format!("image {i}\n"),
        )?;
    }
    Ok(())
}

/// What an uploader does for a dataset whose manifest is too large to inline, with its own
/// user only: `stagehand ingest --wait` as a library call places the files on the source tier,
/// puts the manifest in its project's upload bucket, publishes the request carrying the
/// reference, follows its progress and waits for the verdict. Returns the reference and the
/// verdict.
async fn ingest_by_reference(
    uploader_url: &str,
    policies: &Path,
    folder: &Path,
    dataset: &str,
) -> anyhow::Result<(stagehand_schemas::ManifestRef, Outcome)> {
    let mut cfg = BusConfig::new(uploader_url);
    cfg.provision = false;
    let bus = Bus::connect(&cfg).await?;
    let opts = IngestOptions {
        source: folder.to_str().context("a UTF-8 temp path")?.to_owned(),
        in_place: false,
        project: "demo".into(),
        dataset: dataset.into(),
        tier: "source".into(),
        policies: policies.to_owned(),
        requested_by: "uploader-demo".into(),
        labels: Vec::new(),
        manifest: None,
        wait: Some(Duration::from_secs(60)),
        progress: false,
        clock_skew: stagehand::ingest::CLOCK_SKEW,
        spool: None,
    };
    // The bucket is the operator's (`stagehand provision --project demo`): opened, not made.
    let report = stagehand::ingest::ingest(&bus, &opts).await?;
    let Body::IngestRequested(request) = &report.request.body else {
        anyhow::bail!("not an ingest request: {:?}", report.request.body);
    };
    let reference = request
        .manifest
        .clone()
        .with_context(|| format!("{MANY_FILES} files' manifest travelled inline"))?;
    ensure!(
        request.files.is_empty() && reference.files > 0,
        "the request carries only the reference"
    );
    // Waiting for the catalogue is a courtesy an uploader without query rights goes without
    // (the ingest stops asking at the first refusal); nothing else may be refused.
    let refused: Vec<String> = bus
        .permission_violations()
        .into_iter()
        .filter(|v| !v.contains("\"stagehand.catalogue.query\""))
        .collect();
    ensure!(refused.is_empty(), "the uploader was refused: {refused:?}");
    Ok((reference, report.outcome.context("no verdict")?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_works_with_its_own_user_and_no_password_is_shown() -> anyhow::Result<()> {
    // A permission the services lack shows in the test's output (the bus logs violations).
    let _ = tracing_subscriber::fmt()
        .with_env_filter("warn")
        .with_test_writer()
        .try_init();
    let server = start_server();
    let home = tempfile::tempdir()?;
    let policies = home.path().join("policies");
    stagehand::up::write_default_policies(&policies, home.path())?;
    std::fs::create_dir_all(home.path().join("tiers/source"))?;

    // The operator provisions, the project's upload bucket too; the password never appears
    // in what it prints.
    let out = stagehand(
        &user_url(&server, "operator", "OPERATOR"),
        &["provision", "--project", "demo"],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    let text = said(&out);
    ensure!(
        text.contains("provisioned streams STAGEHAND_REQUESTS")
            && text.contains("Object Store buckets stagehand_manifests, stagehand_uploads_demo")
            && text.contains(&format!("nats://operator:***@127.0.0.1:{}", server.port())),
        "{text}"
    );
    no_secrets(&text)?;

    // The validator runs as its own user, checking rather than managing streams.
    let mut config = stagehand_ingest_validator::config(
        &user_url(&server, "ingest-validator", "INGEST_VALIDATOR"),
        &policies,
        home.path().join("state/ingest-validator"),
    );
    config.bus.provision = false;
    let shutdown = stagehand_bus::CancellationToken::new();
    let validator = tokio::spawn(stagehand_ingest_validator::run(config, shutdown.clone()));

    // The uploader ingests into its project and waits, with only its own permissions.
    let folder = tempfile::tempdir()?;
    write_folder(folder.path())?;
    let uploader = user_url(&server, "uploader-demo", "UPLOADER_DEMO");
    let ingest = [
        "ingest",
        folder.path().to_str().context("utf-8")?,
        "--project",
        "demo",
        "--dataset",
        "perm-cats",
        "--policies",
        policies.to_str().context("utf-8")?,
        "--wait",
        "--timeout",
        "60",
        "--json",
    ];
    for run in ["first", "repeated"] {
        let out = stagehand(&uploader, &ingest)?;
        let text = said(&out);
        ensure!(out.status.success(), "{run} ingest: {text}");
        no_secrets(&text)?;
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).with_context(|| text.clone())?;
        ensure!(
            report["outcome"]["validated"]["dataset"] == "perm-cats",
            "{run} ingest not validated: {report}"
        );
        ensure!(
            report["duplicate"] == (run == "repeated"),
            "{run}: {report}"
        );
        // The catalogue is not the uploader's to ask: it does not wait for it.
        ensure!(
            !text.contains("has not recorded the outcome"),
            "{run} ingest waited for a catalogue it may not query: {text}"
        );
    }
    // Another project's ingest is refused to this uploader.
    let other = ingest.map(|a| if a == "demo" { "other-lab" } else { a });
    let out = stagehand(&uploader, &other)?;
    ensure!(
        !out.status.success(),
        "an ingest for another project: {}",
        said(&out)
    );
    no_secrets(&said(&out))?;

    // A dataset whose manifest travels by reference: the validator reads it from the upload
    // bucket and stores the validated one in the services' bucket, as its own user.
    let many = tempfile::tempdir()?;
    write_many(many.path())?;
    let (reference, outcome) =
        ingest_by_reference(&uploader, &policies, many.path(), "perm-many").await?;
    let Outcome::Validated(validated) = outcome else {
        anyhow::bail!("the by-reference ingest was not validated: {outcome:?}");
    };
    ensure!(
        validated.files.is_empty()
            && validated.manifest.as_ref() == Some(&reference)
            && validated.version == reference.digest
            && reference.files == MANY_FILES as u64,
        "{validated:?}"
    );
    let operator_bus =
        Bus::connect(&BusConfig::new(user_url(&server, "operator", "OPERATOR"))).await?;
    ensure!(
        ManifestStore::open(operator_bus.jetstream(), MANIFEST_BUCKET)
            .await?
            .contains(&reference.digest)
            .await?,
        "the validated manifest is in the services' bucket"
    );

    shutdown.cancel();
    let stats = validator.await??;
    ensure!(stats.handled == 2, "{stats:?}");

    // The recorder runs as its own user: it rebuilds its catalogue from the facts log (an
    // ephemeral consumer), folds live facts, mirrors readiness and answers the operator.
    let mut config = stagehand_catalogue_recorder::config(
        &user_url(&server, "catalogue-recorder", "CATALOGUE_RECORDER"),
        home.path().join("state/catalogue"),
    );
    config.bus.provision = false;
    let shutdown = stagehand_bus::CancellationToken::new();
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(config, shutdown.clone()));
    let operator = user_url(&server, "operator", "OPERATOR");
    let shown =
        stagehand_testkit::wait_for(Duration::from_secs(60), "the catalogue to answer", || {
            let operator = operator.clone();
            async move {
                let out = stagehand(
                    &operator,
                    &[
                        "catalogue",
                        "show",
                        "perm-cats",
                        "--project",
                        "demo",
                        "--json",
                    ],
                )
                .ok()?;
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            }
        })
        .await?;
    let detail: serde_json::Value = serde_json::from_str(&shown).context(shown.clone())?;
    ensure!(
        detail["versions"].as_array().is_some_and(|v| v.len() == 1),
        "one catalogued version: {detail}"
    );
    // The by-reference version's file list, which the recorder read (verified) from the
    // services' bucket as its own user: every file, once.
    let target = format!("perm-many@{}", reference.digest);
    let listed = stagehand_testkit::wait_for(
        Duration::from_secs(60),
        "the by-reference version's files",
        || {
            let (operator, target) = (operator.clone(), target.clone());
            async move {
                let out = stagehand(
                    &operator,
                    &["catalogue", "show", &target, "--project", "demo", "--json"],
                )
                .ok()?;
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            }
        },
    )
    .await?;
    let mut paths = Vec::new();
    for line in listed.lines() {
        let file: serde_json::Value = serde_json::from_str(line).context(line.to_owned())?;
        paths.push(file["path"].as_str().context("a path")?.to_owned());
    }
    let distinct: std::collections::BTreeSet<&String> = paths.iter().collect();
    ensure!(
        paths.len() == MANY_FILES
            && distinct.len() == MANY_FILES
            && paths.iter().all(|p| p.starts_with("images/c")),
        "{} files listed, {} distinct",
        paths.len(),
        distinct.len()
    );
    shutdown.cancel();
    let stats = recorder.await??;
    ensure!(
        stats.rebuilt.is_some_and(|(facts, _)| facts >= 1),
        "rebuilt from the log: {stats:?}"
    );

    // `stagehand up` on that server says where it runs, without the password.
    let mut up = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args([
            "up",
            "--external-nats",
            "--metrics",
            "127.0.0.1:0",
            "--home",
        ])
        .arg(home.path().join("up"))
        .env(
            "STAGEHAND_NATS_URL",
            user_url(&server, "operator", "OPERATOR"),
        )
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = up.stdout.take().context("stdout")?;
    let line = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("stagehand is up"))
    });
    let line = tokio::time::timeout(Duration::from_secs(90), line)
        .await
        .context("up did not start")??
        .context("up exited before it was up")?;
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(&up),
        rustix::process::Signal::INT,
    );
    let out = up.wait_with_output()?;
    let all = format!("{line}\n{}", said(&out));
    ensure!(
        line.contains(&format!(
            "NATS nats://operator:***@127.0.0.1:{}",
            server.port()
        )),
        "{line}"
    );
    no_secrets(&all)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nkey_seed_files_work_for_the_cli_and_the_services() -> anyhow::Result<()> {
    let user = nkeys::KeyPair::new_user();
    let dir = tempfile::tempdir()?;
    let conf = dir.path().join("nkey.conf");
    std::fs::write(
        &conf,
        format!(
            "authorization {{\n  users: [ {{ nkey: {} }} ]\n}}\n",
            user.public_key()
        ),
    )?;
    let server = NatsServer::start_with_config(&conf);
    let seed = dir.path().join("user.nk");
    std::fs::write(&seed, format!("{}\n", user.seed()?))?;

    // Without the seed the server refuses the connection, at once (no retries) …
    let out = stagehand(&server.url(), &["provision"])?;
    ensure!(!out.status.success(), "{}", said(&out));
    ensure!(
        said(&out).contains("refused the credentials"),
        "{}",
        said(&out)
    );
    // … with it the CLI provisions …
    let out = stagehand(
        &server.url(),
        &["provision", "--nkey", seed.to_str().context("utf-8")?],
    )?;
    ensure!(out.status.success(), "{}", said(&out));
    // … and a service connects through its [bus] table.
    let mut cfg = BusConfig::new(server.url());
    cfg.nkey_seed_file = Some(seed.clone());
    let bus = stagehand_bus::Bus::connect(&cfg).await?;
    bus.provision().await?;
    let seed_text = std::fs::read_to_string(&seed)?;
    ensure!(!format!("{cfg:?}").contains(seed_text.trim()), "{cfg:?}");
    Ok(())
}

#[test]
fn a_failed_connection_names_the_server_without_its_password() -> anyhow::Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let out = stagehand(
        &format!("nats://lab:hunter2-secret@127.0.0.1:{port}"),
        &["catalogue", "datasets"],
    )?;
    let text = said(&out);
    ensure!(!out.status.success(), "{text}");
    ensure!(
        text.contains(&format!("nats://lab:***@127.0.0.1:{port}")),
        "the server is named: {text}"
    );
    ensure!(!text.contains("hunter2"), "the password is shown: {text}");
    Ok(())
}

#[test]
fn a_comma_separated_server_list_works_in_the_cli() -> anyhow::Result<()> {
    let server = NatsServer::start();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let list = format!("nats://127.0.0.1:{dead}, {}", server.url());
    let out = stagehand(&list, &["provision", "--replicas", "1"])?;
    ensure!(out.status.success(), "{}", said(&out));
    ensure!(
        said(&out).contains(&format!("nats://127.0.0.1:{dead},{}", server.url())),
        "{}",
        said(&out)
    );
    Ok(())
}

/// `stagehand provision` creates every KV bucket declared in `stagehand-bus`, those of one
/// service too (the promoter's reservations and leases, [`stagehand_bus::SERVICE_KV_BUCKETS`]),
/// as declared, and says so; the promoter's own user then opens its bucket without creating it.
#[tokio::test]
async fn provision_creates_every_declared_kv_bucket_the_services_own_included() -> anyhow::Result<()>
{
    let server = start_server();
    let out = stagehand(&user_url(&server, "operator", "OPERATOR"), &["provision"])?;
    ensure!(out.status.success(), "{}", said(&out));
    let declared: Vec<_> = stagehand_bus::KV_BUCKETS
        .iter()
        .chain(stagehand_bus::SERVICE_KV_BUCKETS)
        .collect();
    ensure!(
        declared
            .iter()
            .any(|b| b.bucket == stagehand_bus::PROMOTER_BUCKET),
        "the promoter's bucket is declared"
    );
    let text = said(&out);
    let operator = Bus::connect(&BusConfig::new(user_url(&server, "operator", "OPERATOR"))).await?;
    for spec in &declared {
        ensure!(
            text.contains(spec.bucket),
            "{} not listed: {text}",
            spec.bucket
        );
        let mut stream = operator
            .jetstream()
            .get_stream(format!("KV_{}", spec.bucket))
            .await
            .with_context(|| format!("bucket {} missing", spec.bucket))?;
        let config = stream.info().await?.config.clone();
        ensure!(
            config.max_messages_per_subject == spec.history,
            "{}",
            spec.bucket
        );
        ensure!(
            config.description.as_deref() == Some(spec.description),
            "{}",
            spec.bucket
        );
    }
    let mut cfg = BusConfig::new(user_url(&server, "promoter", "PROMOTER"));
    cfg.provision = false;
    let promoter = Bus::connect(&cfg).await?;
    promoter.provision_kv(&stagehand_bus::PROMOTER).await?;
    ensure!(
        promoter.permission_violations().is_empty(),
        "{:?}",
        promoter.permission_violations()
    );
    Ok(())
}

/// Runs `stagehand checkpoint commit` as `user_url` for `project`; returns its output.
fn commit_checkpoint(
    user_url: &str,
    policies: &Path,
    project: &str,
    step: &str,
    dir: &Path,
    extra: &[&str],
) -> anyhow::Result<Output> {
    let mut args = vec![
        "checkpoint",
        "commit",
        "--project",
        project,
        "--run",
        "r1",
        "--step",
        step,
        "--policies",
        policies.to_str().context("utf-8")?,
        "--json",
    ];
    args.extend_from_slice(extra);
    args.push(dir.to_str().context("utf-8")?);
    stagehand(user_url, &args)
}

/// Waits for the bus's next permission violation and checks that it names `subject`.
async fn violation_names(bus: &Bus, seen: usize, subject: &str) -> anyhow::Result<()> {
    let all = stagehand_testkit::wait_for(Duration::from_secs(10), "a violation", || async {
        let all = bus.permission_violations();
        (all.len() > seen).then_some(all)
    })
    .await?;
    ensure!(
        all[seen..].iter().any(|v| v.contains(subject)),
        "no violation names {subject}: {all:?}"
    );
    Ok(())
}

/// Guards the TRAINER_DEMO role of `deploy/nats/accounts.conf`: a training job's user commits
/// its project's checkpoints with `stagehand checkpoint commit` (inline, by reference in the
/// project's upload bucket, a re-commit compared with the stored one) and may do nothing else
/// (another project's fact subject or upload bucket, a request subject, a catalogue query);
/// the recorder's user reads the manifest it put.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_training_job_commits_its_projects_checkpoints_and_nothing_else() -> anyhow::Result<()> {
    let server = start_server();
    let home = tempfile::tempdir()?;
    let policies = home.path().join("policies");
    stagehand::up::write_default_policies(&policies, home.path())?;
    let operator = user_url(&server, "operator", "OPERATOR");
    for project in ["demo", "other-lab"] {
        let out = stagehand(&operator, &["provision", "--project", project])?;
        ensure!(out.status.success(), "{}", said(&out));
    }
    let trainer = user_url(&server, "trainer-demo", "TRAINER_DEMO");
    let run_dir = home.path().join("tiers/hot/demo/runs/r1");

    // Inline: a DCP save, committed; again as the same fact; with a tag it was not committed
    // with, refused after the stored commit was read (by subject, the trainer's right).
    let dcp = run_dir.join("step-100");
    std::fs::create_dir_all(&dcp)?;
    std::fs::write(dcp.join("__0_0.distcp"), b"shard zero")?;
    std::fs::write(dcp.join(".metadata"), b"dcp metadata")?;
    for duplicate in [false, true] {
        let out = commit_checkpoint(&trainer, &policies, "demo", "100", &dcp, &[])?;
        no_secrets(&said(&out))?;
        ensure!(out.status.success(), "inline commit: {}", said(&out));
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        ensure!(
            answer["duplicate"] == duplicate && answer["manifest"].is_null(),
            "{answer}"
        );
    }
    let out = commit_checkpoint(&trainer, &policies, "demo", "100", &dcp, &["--tag", "best"])?;
    ensure!(
        out.status.code() == Some(1)
            && said(&out).contains("step 100 of run r1 was committed before with tags []"),
        "a re-commit with another tag: {}",
        said(&out)
    );

    // By reference: the manifest goes into the project's upload bucket.
    let many = run_dir.join("step-200");
    std::fs::create_dir_all(&many)?;
    for i in 0..MANY_FILES {
        std::fs::write(
            many.join(format!("shard-with-a-long-name-{i:05}.bin")),
            format!("shard {i}\n"),
        )?;
    }
    let out = commit_checkpoint(&trainer, &policies, "demo", "200", &many, &["--complete"])?;
    ensure!(out.status.success(), "by-reference commit: {}", said(&out));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        answer["files"] == MANY_FILES && answer["manifest"].is_string(),
        "{answer}"
    );

    // Both facts are stored; the recorder's user reads (verified) the manifest put by the
    // training job.
    let operator_bus = Bus::connect(&BusConfig::new(&operator)).await?;
    let mut facts = operator_bus
        .jetstream()
        .get_stream("STAGEHAND_FACTS")
        .await?;
    let stored = facts.info().await?.state.messages;
    ensure!(stored == 2, "{stored} commits stored, not 2");
    let last = facts
        .get_last_raw_message_by_subject("stagehand.fact.checkpoint.committed.demo")
        .await?;
    let Body::CheckpointCommitted(fact) = stagehand_schemas::wire::decode(&last.payload)?.body
    else {
        anyhow::bail!("not a checkpoint commit");
    };
    let reference = fact.manifest.context("step 200 by reference")?;
    // Read (verified) by the recorder, which catalogues it, and by the demoter, which moves it.
    for (user, role) in [
        ("catalogue-recorder", "CATALOGUE_RECORDER"),
        ("demoter", "DEMOTER"),
    ] {
        let mut cfg = BusConfig::new(user_url(&server, user, role));
        cfg.provision = false;
        let reader = Bus::connect(&cfg).await?;
        let manifest = ManifestStore::open(reader.jetstream(), "stagehand_uploads_demo")
            .await?
            .fetch(&reference, &stagehand_manifest::Spool::default())
            .await
            .with_context(|| format!("{user} reading the checkpoint's manifest"))?;
        ensure!(
            manifest.files() == MANY_FILES as u64 && manifest.digest() == reference.digest,
            "{user}: {} entries",
            manifest.files()
        );
        ensure!(
            reader.permission_violations().is_empty(),
            "{user}: {:?}",
            reader.permission_violations()
        );
    }

    // Nothing else: another project's commit (its fact subject and its upload bucket), a
    // verdict, a request, a catalogue query, a direct get by sequence (any project's fact), a
    // consumer. Each is refused by the server, which says so at once.
    let mut cfg = BusConfig::new(&trainer);
    cfg.provision = false;
    let bus = Bus::connect(&cfg).await?;
    for denied in [
        "stagehand.fact.checkpoint.committed.other-lab",
        "stagehand.fact.dataset.validated.demo",
        "stagehand.req.stage.requested.demo",
        "stagehand.req.ingest.requested.demo",
        "stagehand.catalogue.query",
        "$JS.API.STREAM.INFO.OBJ_stagehand_uploads_other-lab",
        "$JS.API.DIRECT.GET.OBJ_stagehand_uploads_other-lab.$O.stagehand_uploads_other-lab.M.x",
        "$O.stagehand_uploads_other-lab.C.x",
        "$O.stagehand_uploads_other-lab.M.x",
        "$JS.API.DIRECT.GET.STAGEHAND_FACTS",
        "$JS.API.CONSUMER.CREATE.STAGEHAND_FACTS",
    ] {
        let seen = bus.permission_violations().len();
        bus.client().publish(denied, "no".into()).await?;
        bus.client().flush().await?;
        violation_names(&bus, seen, denied).await?;
    }
    // Nor may it read what others publish, its own project's facts included.
    for denied in [
        "stagehand.fact.checkpoint.committed.demo",
        "stagehand.fact.>",
    ] {
        let seen = bus.permission_violations().len();
        let _sub = bus.client().subscribe(denied).await?;
        bus.client().flush().await?;
        violation_names(&bus, seen, denied).await?;
    }
    let stored = facts.info().await?.state.messages;
    ensure!(
        stored == 2,
        "{stored} facts stored after the denials, not 2"
    );
    Ok(())
}

/// A password file (what the Slurm hooks use, so that no command line holds the password)
/// connects the user the URL names, and is refused when group or others may read it, or when
/// the URL carries a password too.
#[test]
fn a_password_file_connects_the_named_user_and_must_be_private() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let server = start_server();
    let out = stagehand(&user_url(&server, "operator", "OPERATOR"), &["provision"])?;
    ensure!(out.status.success(), "provision: {}", said(&out));
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("scheduler.password");
    std::fs::write(&file, format!("{}\n", role_password("SCHEDULER")))?;
    let file_arg = file.to_str().context("a UTF-8 temp path")?;
    let url = format!("nats://scheduler@127.0.0.1:{}", server.port());
    let status = [
        "--password-file",
        file_arg,
        "stage",
        "status",
        "--project",
        "demo",
    ];

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
    let out = stagehand(&url, &status)?;
    ensure!(
        !out.status.success() && said(&out).contains("has mode 0644"),
        "a world-readable password file was used: {}",
        said(&out)
    );

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
    let out = stagehand(&url, &status)?;
    ensure!(out.status.success(), "as scheduler: {}", said(&out));
    no_secrets(&said(&out))?;

    let out = stagehand(&user_url(&server, "scheduler", "SCHEDULER"), &status)?;
    ensure!(
        !out.status.success() && said(&out).contains("password_file"),
        "a URL with a password and a password file: {}",
        said(&out)
    );
    Ok(())
}

/// `stagehand accounts <command> --file FILE NAME`, connecting to nothing.
fn accounts(command: &str, file: &Path, name: &str) -> anyhow::Result<Output> {
    let file = file.to_str().context("the accounts config's path")?;
    stagehand(
        "nats://127.0.0.1:1",
        &["accounts", command, "--file", file, name],
    )
}

/// The shipped accounts config extended by `stagehand accounts <command> NAME`: the command
/// exits 0, and a second run for the same name over its output exits 78, printing nothing.
fn extended_once(command: &str, name: &str) -> anyhow::Result<String> {
    let out = accounts(command, &stagehand_testkit::accounts_conf(), name)?;
    ensure!(out.status.code() == Some(0), "{}", said(&out));
    let text = String::from_utf8(out.stdout)?;
    let dir = tempfile::tempdir()?;
    let extended = dir.path().join("accounts.conf");
    std::fs::write(&extended, &text)?;
    let again = accounts(command, &extended, name)?;
    ensure!(again.status.code() == Some(78), "{}", said(&again));
    ensure!(again.stdout.is_empty(), "{}", said(&again));
    Ok(text)
}

/// Against a server started with the accounts config `text`, `user` (of `role`, with its
/// inbox prefix when it has one of its own) publishes on `own` and on `refused`: the server
/// refuses it `refused` alone (its word read from its log).
async fn refused_only(
    text: &str,
    (user, role, inbox): (&str, &str, Option<String>),
    own: &str,
    refused: &str,
) -> anyhow::Result<()> {
    let server = NatsServer::builder()
        .config_text(stagehand_testkit::with_test_host_limits(text))
        .role_passwords(text)
        .start();
    let mut options =
        async_nats::ConnectOptions::with_user_and_password(user.into(), role_password(role));
    if let Some(inbox) = inbox {
        options = options.custom_inbox_prefix(inbox);
    }
    let client = options.connect(server.url()).await?;
    client.publish(refused.to_owned(), "forged".into()).await?;
    client.publish(own.to_owned(), "own".into()).await?;
    client.flush().await?;
    let log_path = server.log_path();
    let of_user = format!("user:{user}\"");
    let violations = stagehand_testkit::wait_for(
        Duration::from_secs(10),
        "the server's word on the refused subject",
        || {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let of_user = of_user.clone();
            async move {
                let lines: Vec<String> = (log.lines())
                    .filter(|l| l.contains(&of_user) && l.contains("Violation"))
                    .map(str::to_owned)
                    .collect();
                lines.iter().any(|l| l.contains(refused)).then_some(lines)
            }
        },
    )
    .await?;
    ensure!(violations.len() == 1, "{violations:#?}");
    Ok(())
}

/// `stagehand accounts add-node` is the recipe an operator runs for a new node: a server
/// started with the config it prints knows the new node's user, which may publish its own
/// node's facts and is refused another node's; a second run for the same node, and a file of
/// another shape, are refused with 78 and print nothing.
#[tokio::test]
async fn accounts_add_node_gives_a_new_node_a_user_of_its_own() -> anyhow::Result<()> {
    use stagehand_testkit::{node_inbox_prefix, node_role, node_user};
    let text = extended_once("add-node", "gpu-07")?;
    let user = node_user("gpu-07");
    let identity = (
        user.as_str(),
        &*node_role("gpu-07"),
        Some(node_inbox_prefix("gpu-07")),
    );
    refused_only(
        &text,
        identity,
        "stagehand.fact.stage.ready.gpu-07.demo",
        "stagehand.fact.stage.ready.gpu-01.demo",
    )
    .await?;
    let dir = tempfile::tempdir()?;
    let other = dir.path().join("other.conf");
    std::fs::write(&other, "accounts: {}\n")?;
    let shape = accounts("add-node", &other, "gpu-08")?;
    ensure!(shape.status.code() == Some(78), "{}", said(&shape));
    ensure!(shape.stdout.is_empty(), "{}", said(&shape));
    Ok(())
}

/// `stagehand accounts add-project` is step 1 of adding a tenant: a server started with the
/// config it prints knows the new project's uploader, which may ask for its own project's
/// ingests and is refused another project's; a second run for the same project and a name
/// that is no project name are refused, with nothing printed.
#[tokio::test]
async fn accounts_add_project_gives_a_new_tenant_its_users() -> anyhow::Result<()> {
    let text = extended_once("add-project", "labc")?;
    refused_only(
        &text,
        ("uploader-labc", "UPLOADER_LABC", None),
        "stagehand.req.ingest.requested.labc",
        "stagehand.req.ingest.requested.demo",
    )
    .await?;
    let bad = accounts("add-project", &stagehand_testkit::accounts_conf(), "Lab.C")?;
    ensure!(bad.status.code() == Some(64), "{}", said(&bad));
    ensure!(bad.stdout.is_empty(), "{}", said(&bad));
    Ok(())
}
