//! `stagehand up` as a real process, stopped the way a person stops it: the built binary starts
//! its own nats-server under a fresh home, a folder is ingested into it with the real
//! `stagehand ingest --wait`, and a Ctrl-C to its process group (what a terminal sends) must
//! stop it cleanly: exit status success, its nats-server gone and stopped by `up` itself after
//! the services drained, and every store under the home unlocked and intact, so that a second
//! `up` on the same home serves the same catalogue.

mod up_child;

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use stagehand_bus::Ledger;
use stagehand_catalogue::{Answer, Query, ask};
use stagehand_catalogue_recorder::{Store, answer};
use stagehand_schemas::{Body, EventId, FileRef, sha256_hex, version_digest};
use stagehand_testkit::wait_for;
use up_child::{START, STOP, Up, server_processes};

/// A loopback port nothing listens on right now.
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn accepts(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

/// Runs the real `stagehand` binary against `url` and returns its stdout; fails on non-zero.
fn stagehand(url: &str, home: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(args)
        .env("STAGEHAND_NATS_URL", url)
        .env("STAGEHAND_HOME", home)
        .output()?;
    ensure!(
        out.status.success(),
        "stagehand {args:?} exited {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

fn write_folder(dir: &Path) -> anyhow::Result<Vec<FileRef>> {
    let files: [(&str, Vec<u8>); 4] = [
        (
            "images/0001.bin",
            (0..=255u8).cycle().take(70_000).collect(),
        ),
        ("images/0002.bin", b"second image\n".repeat(100)),
        ("labels.csv", b"id,label\n1,cat\n2,dog\n".to_vec()),
        ("empty.txt", Vec::new()),
    ];
    let mut refs = Vec::new();
    for (rel, data) in files {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().context("parent")?)?;
        std::fs::write(&path, &data)?;
        refs.push(FileRef {
            path: rel.into(),
            size: data.len() as u64,
            sha256: sha256_hex(&data),
        });
    }
    Ok(refs)
}

/// Waits until the catalogue of the `up` at `url` answers a `datasets` query.
async fn catalogue_answers(url: &str) -> anyhow::Result<async_nats::Client> {
    let client = async_nats::connect(url).await?;
    wait_for(START, "the catalogue to answer a datasets query", || {
        let client = client.clone();
        async move {
            let q = Query::Datasets {
                project: None,
                limit: None,
                after: None,
            };
            match ask(&client, &q, Duration::from_secs(2)).await {
                Ok(Answer::Datasets { .. }) => Some(()),
                _ => None,
            }
        }
    })
    .await?;
    Ok(client)
}

/// Stops `up` with Ctrl-C and checks it stopped cleanly and took its nats-server with it.
async fn ctrl_c_and_check(up: &mut Up, home: &Path, port: u16) -> anyhow::Result<()> {
    let servers = server_processes(home);
    ensure!(
        servers.len() == 1 && servers[0].1 == up.pid(),
        "expected one nats-server child of up (pid {}) for {}, found (pid, parent) {servers:?}",
        up.pid(),
        home.display()
    );
    up.ctrl_c()?;
    let status = up.wait_exit().await?;
    let output = up.output();
    ensure!(status.success(), "up exited with {status}\n{output}");
    ensure!(
        output.contains("\nstopped"),
        "up did not say it stopped\n{output}"
    );
    ensure!(
        server_processes(home).is_empty(),
        "nats-server still running after up exited: {:?}",
        server_processes(home)
    );
    ensure!(!accepts(port), "port {port} still accepts connections");
    // The server was stopped by `up` (SIGTERM, after the services drained), not by the Ctrl-C
    // itself: that would have cut the services off from NATS while they drained.
    let log = std::fs::read_to_string(home.join("nats-server.log"))?;
    let last_start = log.rfind("Starting nats-server").unwrap_or(0);
    let this_run = &log[last_start..];
    ensure!(
        this_run.contains("Trapped \"terminated\" signal"),
        "nats-server was not stopped by up's SIGTERM:\n{this_run}"
    );
    ensure!(
        !this_run.contains("Trapped \"interrupt\" signal"),
        "the Ctrl-C reached nats-server directly:\n{this_run}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_runs_ingest_and_stops_cleanly_on_ctrl_c() -> anyhow::Result<()> {
    let home_dir = tempfile::tempdir()?;
    let home = home_dir.path().join("home");
    let logs = tempfile::tempdir()?;
    let port = free_port()?;
    let url = format!("nats://127.0.0.1:{port}");

    let mut up = Up::start(&home, port, logs.path().join("up-1.stderr"), &[])?;
    up.wait_up().await?;
    let client = catalogue_answers(&url).await?;
    ensure!(
        home.join("data/nats").is_dir(),
        "JetStream data under the home"
    );

    // Ingest a folder with the real CLI and wait for the validator's answer.
    let folder = tempfile::tempdir()?;
    let files = write_folder(folder.path())?;
    let digest = version_digest(&files);
    let policies = home.join("policies");
    let out = stagehand(
        &url,
        &home,
        &[
            "ingest",
            folder.path().to_str().context("utf-8 path")?,
            "--project",
            "lab-up",
            "--dataset",
            "up-sample",
            "--policies",
            policies.to_str().context("utf-8 path")?,
            "--by",
            "tester",
            "--wait",
            "--timeout",
            "60",
            "--json",
        ],
    )?;
    let report: serde_json::Value = serde_json::from_str(&out).context(out.clone())?;
    ensure!(
        report["outcome"]["validated"]["version"] == digest.as_str(),
        "not validated with version {digest}: {report}"
    );
    let request_id = report["request_id"]
        .as_str()
        .context("request_id")?
        .to_owned();
    // The catalogue recorder folds the fact after the validator published it: wait for it.
    wait_for(START, "the version in the live catalogue", || {
        let client = client.clone();
        let digest = digest.clone();
        async move {
            let q = Query::Dataset {
                project: Some("lab-up".into()),
                dataset: "up-sample".into(),
                limit: None,
            };
            match ask(&client, &q, Duration::from_secs(2)).await {
                Ok(Answer::Dataset(d)) if d.versions.iter().any(|v| v.version == digest) => {
                    Some(())
                }
                _ => None,
            }
        }
    })
    .await?;
    drop(client);

    ctrl_c_and_check(&mut up, &home, port).await?;
    drop(up);

    // Every store under the home opens again in this process (not locked, not damaged) and
    // holds what the run recorded.
    let store = Store::open(home.join("state/catalogue/catalogue.redb"))?;
    ensure!(
        store.is_complete()?,
        "the catalogue store is marked complete"
    );
    let Answer::Dataset(detail) = answer(
        &store,
        &Query::Dataset {
            project: Some("lab-up".into()),
            dataset: "up-sample".into(),
            limit: None,
        },
    ) else {
        bail!("the catalogue store has no dataset up-sample");
    };
    ensure!(
        detail.versions.len() == 1
            && detail.versions[0].version == digest
            && detail.versions[0].file_count == files.len() as u64,
        "stored versions: {:?}",
        detail.versions
    );
    drop(store);
    let ledger = Ledger::open(home.join("state/ingest-validator/ingest-validator.redb"))?;
    let outcome = ledger
        .outcome(
            "lab-up",
            "ingest.requested",
            &EventId::new(request_id.clone())?,
        )?
        .context("the validator's ledger has the request's outcome")?;
    ensure!(
        matches!(
            outcome.facts.as_slice(),
            [fact] if matches!(&fact.body, Body::DatasetValidated(v) if v.version == digest)
        ),
        "ledger outcome: {:?}",
        outcome.facts
    );
    drop(ledger);

    // A second `up` on the same home (another port) serves the same catalogue.
    let port2 = free_port()?;
    let url2 = format!("nats://127.0.0.1:{port2}");
    let mut up2 = Up::start(&home, port2, logs.path().join("up-2.stderr"), &[])?;
    up2.wait_up().await?;
    drop(catalogue_answers(&url2).await?);
    let out = stagehand(&url2, &home, &["catalogue", "datasets", "--json"])?;
    let listing: serde_json::Value = serde_json::from_str(&out).context(out.clone())?;
    let datasets = listing["datasets"].as_array().context(out.clone())?;
    ensure!(
        datasets.iter().any(|d| d["project"] == "lab-up"
            && d["dataset"] == "up-sample"
            && d["version_count"] == 1),
        "the second up does not list up-sample: {out}"
    );
    let out = stagehand(&url2, &home, &["catalogue", "show", "up-sample", "--json"])?;
    let detail: serde_json::Value = serde_json::from_str(&out).context(out.clone())?;
    ensure!(
        detail["versions"][0]["version"] == digest.as_str(),
        "the second up does not show up-sample@{digest}: {out}"
    );
    ctrl_c_and_check(&mut up2, &home, port2).await?;
    Ok(())
}

/// `up` killed with SIGKILL (no handler runs) must not leave its nats-server holding the port
/// and the store: the server was started with `PR_SET_PDEATHSIG`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_up_takes_its_nats_server_with_it() -> anyhow::Result<()> {
    let home_dir = tempfile::tempdir()?;
    let home = home_dir.path().join("home");
    let logs = tempfile::tempdir()?;
    let port = free_port()?;
    let mut up = Up::start(&home, port, logs.path().join("up.stderr"), &[])?;
    up.wait_up().await?;
    let servers = server_processes(&home);
    ensure!(
        servers.len() == 1 && servers[0].1 == up.pid(),
        "one nats-server child of up: {servers:?}"
    );
    let pid_file = std::fs::read_to_string(stagehand::up::pid_file(&home))?;
    ensure!(
        pid_file.trim() == servers[0].0.to_string(),
        "the pid file names the server: {pid_file:?} vs {servers:?}"
    );

    up.child.kill()?; // SIGKILL
    up.child.wait()?;
    wait_for(STOP, "the nats-server to die with up", || async {
        server_processes(&home).is_empty().then_some(())
    })
    .await
    .with_context(|| format!("still running: {:?}", server_processes(&home)))?;
    Ok(())
}

/// A nats-server left running under the home (by a kill no signal could follow) is found
/// through the pid file by the next `up`, stopped, and named in what `up` prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_up_stops_a_server_left_behind_and_says_so() -> anyhow::Result<()> {
    let home_dir = tempfile::tempdir()?;
    let home = home_dir.path().join("home");
    std::fs::create_dir_all(home.join("run"))?;
    std::fs::create_dir_all(home.join("data/nats"))?;
    // What an earlier `up` leaves: its server, running its config file for this home, and the
    // pid file. This one has no parent-death signal, as if its `up` had been lost with it.
    let conf = home.join("nats-dev.conf");
    std::fs::write(&conf, include_str!("../../../deploy/nats/dev.conf"))?;
    let old_port = free_port()?;
    let mut orphan = Command::new(stagehand_testkit::nats_server_binary())
        .arg("-c")
        .arg(&conf)
        .args(["-js", "-a", "127.0.0.1", "-p", &old_port.to_string(), "-sd"])
        .arg(home.join("data/nats"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    std::fs::write(
        home.join("run/nats-server.pid"),
        format!("{}\n", orphan.id()),
    )?;
    wait_for(START, "the orphan to listen", || async {
        accepts(old_port).then_some(())
    })
    .await?;

    ensure!(
        orphan.try_wait()?.is_none(),
        "the orphan exited before up started (its port taken?)"
    );

    let logs = tempfile::tempdir()?;
    let port = free_port()?;
    let mut up = Up::start(&home, port, logs.path().join("up.stderr"), &[])?;
    up.wait_up().await?;
    let said = up.output();
    ensure!(
        said.contains(&format!(
            "found nats-server (pid {}) left running by an earlier `stagehand up`",
            orphan.id()
        )),
        "up did not name the orphan it stopped (orphan now {:?}):\n{said}",
        orphan.try_wait()
    );
    // `up` stopped it with SIGTERM (nats-server traps it and exits cleanly). Its port is not
    // checked: another test's server may take a freed port at once.
    let status = orphan.wait()?;
    ensure!(
        status.success() || status.signal() == Some(libc_sigterm()),
        "the orphan ended with {status}"
    );
    let servers = server_processes(&home);
    ensure!(
        servers.len() == 1 && servers[0].1 == up.pid(),
        "only up's own server runs: {servers:?}"
    );
    ctrl_c_and_check(&mut up, &home, port).await?;
    Ok(())
}

/// SIGTERM's number, for exit statuses.
fn libc_sigterm() -> i32 {
    rustix::process::Signal::TERM.as_raw()
}

/// `stagehand up` serves one `/metrics` for every service it runs (issue 18 item 2): each
/// service's series carry its own `service` label, and the probes answer beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_the_metrics_of_every_service_it_runs() -> anyhow::Result<()> {
    let home_dir = tempfile::tempdir()?;
    let home = home_dir.path().join("home");
    let logs = tempfile::tempdir()?;
    let port = free_port()?;
    let mut up = Up::start(&home, port, logs.path().join("up.stderr"), &[])?;
    up.wait_up().await?;
    let metrics = up.metrics_port()?;
    let scrape = || {
        stagehand_testkit::http_get(metrics, "/metrics")
            .map(|(status, body)| (status, String::from_utf8_lossy(&body).into_owned()))
    };
    let every_service = wait_for(START, "every service's series on up's /metrics", || {
        let got = scrape();
        async move {
            let (status, body) = got.ok()?;
            let all = stagehand::up::SERVICES.iter().all(|(service, _)| {
                body.lines().any(|l| {
                    l.starts_with(&format!(
                        "{}{{service=\"{service}\"",
                        stagehand_telemetry::names::SERVICE_INFO
                    )) && l.ends_with(" 1")
                })
            });
            (status == 200 && all).then_some(())
        }
    })
    .await;
    if let Err(e) = every_service {
        bail!("{e}\n{:?}\n{}", scrape(), up.output());
    }
    let (status, _) = stagehand_testkit::http_get(metrics, "/healthz")?;
    ensure!(status == 200, "/healthz answered {status}");
    ctrl_c_and_check(&mut up, &home, port).await?;
    ensure!(
        !accepts(metrics),
        "the metrics port still accepts connections after up stopped"
    );
    Ok(())
}
