//! Every binary reaches a NATS that has users, and never shows their secrets: against a real
//! nats-server with `deploy/nats/accounts.conf` the operator provisions with `stagehand
//! provision --project demo`, the validator runs as its own restricted user, an uploader's
//! `stagehand ingest --wait` (first and repeated) gets its verdict with only the uploader's
//! permissions, a dataset whose manifest travels by reference (put by the uploader in its
//! project's upload bucket, stored validated in the services' bucket, read by the recorder)
//! goes through with each role's own user, and `stagehand up --external-nats` says where it
//! runs without the password. NKey seed files work
//! for the CLI and the services; a failed connection names the server without its password.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand::ingest::{Outcome, place, scan, wait_outcome, watch_outcomes};
use stagehand_bus::{Bus, BusConfig};
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore};
use stagehand_schemas::subject::MANIFEST_BUCKET;
use stagehand_schemas::{
    Body, Event, EventId, INLINE_MANIFEST_MAX_BYTES, IngestRequested, Location,
};
use stagehand_testkit::{NatsServer, repo_root};

const ROLES: &[&str] = &[
    "UPLOADER_DEMO",
    "SCHEDULER",
    "INGEST_VALIDATOR",
    "RESHARDER",
    "PROMOTER",
    "DEMOTER",
    "BACKUP_COPIER",
    "CATALOGUE_RECORDER",
    "OPERATOR",
    "SYS",
];

fn password(role: &str) -> String {
    format!("secret-{}-pw", role.to_ascii_lowercase())
}

fn url(server: &NatsServer, user: &str, role: &str) -> String {
    format!(
        "nats://{user}:{}@127.0.0.1:{}",
        password(role),
        server.port()
    )
}

fn start_server() -> NatsServer {
    let mut builder =
        NatsServer::builder().config_file(repo_root().join("deploy/nats/accounts.conf"));
    for role in ROLES {
        builder = builder.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password(role));
    }
    builder.start()
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
    for role in ROLES {
        ensure!(
            !text.contains(&password(role)),
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
/// user only: places the files on the source tier, puts the manifest in its project's upload
/// bucket, publishes the request carrying the reference, follows its progress and waits for
/// the verdict. Returns the reference and the verdict.
async fn ingest_by_reference(
    uploader_url: &str,
    policies: &Path,
    folder: &Path,
    dataset: &str,
) -> anyhow::Result<(stagehand_schemas::ManifestRef, Outcome)> {
    let mut cfg = BusConfig::new(uploader_url);
    cfg.provision = false;
    let bus = Bus::connect(&cfg).await?;
    let policies = stagehand_policy::Policies::load_dir(policies)?;
    let stagehand_mover::Tier::Posix(tier) =
        policies.tier("source").context("a source tier")?.open()?
    else {
        anyhow::bail!("the source tier is not posix");
    };
    let files = scan(folder)?;
    let placed = place(
        &tier,
        folder,
        "demo",
        dataset,
        &files,
        None,
        &indicatif::ProgressBar::hidden(),
    )
    .await?;
    let manifest = Manifest::from_entries(placed.files.clone());
    ensure!(
        manifest.canonical_len() > INLINE_MANIFEST_MAX_BYTES && !manifest.fits_inline(),
        "{} bytes of manifest would travel inline",
        manifest.canonical_len()
    );
    // The bucket is the operator's (`stagehand provision --project demo`): opened, not made.
    let reference = ManifestStore::uploads(bus.jetstream(), "demo", BucketOptions::default())
        .await?
        .put(&manifest)
        .await?;
    let request = Event::request(
        EventId::for_content(&[
            b"ingest",
            b"demo",
            dataset.as_bytes(),
            reference.digest.as_bytes(),
        ]),
        "demo",
        Body::IngestRequested(IngestRequested {
            dataset: dataset.into(),
            source: Location {
                tier: "source".into(),
                prefix: placed.prefix.clone(),
            },
            files: Vec::new(),
            manifest: Some(reference.clone()),
            requested_by: "uploader-demo".into(),
            labels: Vec::new(),
        }),
    );
    // Its project's validation progress and verdicts, subscribed before the request goes out.
    let _progress = bus
        .client()
        .subscribe("stagehand.progress.ingest.requested.demo.*")
        .await?;
    let verdicts = watch_outcomes(&bus, "demo").await?;
    bus.publish(&request).await?;
    let outcome = wait_outcome(verdicts, &request.id, Duration::from_secs(60)).await?;
    ensure!(
        bus.permission_violations().is_empty(),
        "the uploader was refused: {:?}",
        bus.permission_violations()
    );
    Ok((reference, outcome))
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
        &url(&server, "operator", "OPERATOR"),
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
        &url(&server, "ingest-validator", "INGEST_VALIDATOR"),
        &policies,
        home.path().join("state/ingest-validator"),
    );
    config.bus.provision = false;
    let shutdown = stagehand_bus::CancellationToken::new();
    let validator = tokio::spawn(stagehand_ingest_validator::run(config, shutdown.clone()));

    // The uploader ingests into its project and waits, with only its own permissions.
    let folder = tempfile::tempdir()?;
    write_folder(folder.path())?;
    let uploader = url(&server, "uploader-demo", "UPLOADER_DEMO");
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
    let operator_bus = Bus::connect(&BusConfig::new(url(&server, "operator", "OPERATOR"))).await?;
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
        &url(&server, "catalogue-recorder", "CATALOGUE_RECORDER"),
        home.path().join("state/catalogue"),
    );
    config.bus.provision = false;
    let shutdown = stagehand_bus::CancellationToken::new();
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(config, shutdown.clone()));
    let operator = url(&server, "operator", "OPERATOR");
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
        .args(["up", "--external-nats", "--home"])
        .arg(home.path().join("up"))
        .env("STAGEHAND_NATS_URL", url(&server, "operator", "OPERATOR"))
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
            "max_payload: 16MB\nauthorization {{\n  users: [ {{ nkey: {} }} ]\n}}\n",
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
    let out = stagehand(&url(&server, "operator", "OPERATOR"), &["provision"])?;
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
    let operator = Bus::connect(&BusConfig::new(url(&server, "operator", "OPERATOR"))).await?;
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
    let mut cfg = BusConfig::new(url(&server, "promoter", "PROMOTER"));
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
