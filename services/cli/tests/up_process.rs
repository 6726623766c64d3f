//! `stagehand up` as a real process, stopped the way a person stops it: the built binary starts
//! its own nats-server under a fresh home, a folder is ingested into it with the real
//! `stagehand ingest --wait`, and a Ctrl-C to its process group (what a terminal sends) must
//! stop it cleanly: exit status success, its nats-server gone and stopped by `up` itself after
//! the services drained, and every store under the home unlocked and intact, so that a second
//! `up` on the same home serves the same catalogue.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use stagehand_bus::Ledger;
use stagehand_catalogue::{Answer, Query, ask};
use stagehand_catalogue_recorder::{Store, answer};
use stagehand_schemas::{Body, EventId, FileRef, sha256_hex, version_digest};
use stagehand_testkit::wait_for;

/// Bound on start-up (nats-server, streams, services, the catalogue answering).
const START: Duration = Duration::from_secs(90);
/// Bound on a clean stop: the services' drain deadline plus the server's own shutdown.
const STOP: Duration = Duration::from_secs(
    stagehand::up::STOP_DEADLINE.as_secs() + 30, // the server flushes JetStream after the drain
);

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

/// A running `stagehand up`: the child, its stdout lines as they come, its stderr in a file.
struct Up {
    child: Child,
    home: PathBuf,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: PathBuf,
}

impl Up {
    fn start(home: &Path, port: u16, stderr: PathBuf) -> anyhow::Result<Up> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_stagehand"))
            .args(["up", "--home"])
            .arg(home)
            .args(["--port", &port.to_string()])
            .env(
                "STAGEHAND_NATS_SERVER",
                stagehand_testkit::nats_server_binary(),
            )
            .env_remove("STAGEHAND_NATS_URL")
            .env_remove("STAGEHAND_HOME")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr)?)
            // Its own process group, as a shell gives a foreground job: a Ctrl-C from the
            // "terminal" below reaches `up` and everything it started, and nothing else.
            .process_group(0)
            .spawn()
            .context("starting stagehand up")?;
        let stdout = child.stdout.take().context("stdout of stagehand up")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Up {
            child,
            home: home.to_owned(),
            lines,
            seen: Vec::new(),
            stderr,
        })
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits i32")
    }

    /// What the process said so far, for failure messages.
    fn output(&mut self) -> String {
        self.seen.extend(self.lines.try_iter());
        let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
        format!(
            "stdout:\n{}\nstderr (last lines):\n{}",
            self.seen.join("\n"),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// Waits until `up` prints that it is up; fails at once if it exits first.
    async fn wait_up(&mut self) -> anyhow::Result<()> {
        let found = wait_for(START, "`stagehand up` to print that it is up", || {
            self.seen.extend(self.lines.try_iter());
            let up = self.seen.iter().any(|l| l.starts_with("stagehand is up"));
            let exited = self.child.try_wait().ok().flatten();
            async move {
                match (up, exited) {
                    (true, _) => Some(Ok(())),
                    (false, Some(status)) => Some(Err(status)),
                    (false, None) => None,
                }
            }
        })
        .await;
        match found {
            Ok(Ok(())) => Ok(()),
            Ok(Err(status)) => bail!(
                "stagehand up exited with {status} before it was up\n{}",
                self.output()
            ),
            Err(e) => bail!("{e}\n{}", self.output()),
        }
    }

    /// Sends SIGINT to the whole process group, as a terminal does on Ctrl-C.
    fn ctrl_c(&self) -> anyhow::Result<()> {
        let pgid = rustix::process::Pid::from_raw(self.pid()).context("pid")?;
        rustix::process::kill_process_group(pgid, rustix::process::Signal::INT)?;
        Ok(())
    }

    /// Waits, within [`STOP`], for the process to exit.
    async fn wait_exit(&mut self) -> anyhow::Result<ExitStatus> {
        let child = &mut self.child;
        let status = wait_for(STOP, "`stagehand up` to exit after Ctrl-C", || {
            let status = child.try_wait().ok().flatten();
            async move { status }
        })
        .await;
        match status {
            Ok(status) => Ok(status),
            Err(e) => bail!("{e}\n{}", self.output()),
        }
    }
}

impl Drop for Up {
    /// A failed test must not leave processes behind: kill `up`'s group if it still runs, and
    /// the nats-server it started for this home (which runs in a group of its own).
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            if let Some(pgid) = rustix::process::Pid::from_raw(self.pid()) {
                let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
            }
            let _ = self.child.wait();
        }
        for (pid, _) in server_processes(&self.home) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

/// Live (not zombie) processes whose command line mentions `needle`, with their parent pid.
fn processes_mentioning(needle: &str) -> Vec<(i32, i32)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if !String::from_utf8_lossy(&cmdline)
            .replace('\0', " ")
            .contains(needle)
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
        let mut rest = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace();
        let state = rest.next().unwrap_or("");
        let ppid = rest.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if state != "Z" && state != "X" {
            found.push((pid, ppid));
        }
    }
    found
}

/// The nats-server `up` started for `home`: recognised by its configuration file under the home.
fn server_processes(home: &Path) -> Vec<(i32, i32)> {
    processes_mentioning(&home.join("nats-dev.conf").display().to_string())
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

    let mut up = Up::start(&home, port, logs.path().join("up-1.stderr"))?;
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
    let mut up2 = Up::start(&home, port2, logs.path().join("up-2.stderr"))?;
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
    let mut up = Up::start(&home, port, logs.path().join("up.stderr"))?;
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
    let mut up = Up::start(&home, port, logs.path().join("up.stderr"))?;
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
