//! A real `stagehand up` child process, as a person runs it, for the tests that need the
//! whole binary (`up_process`, `traces`, `ingest_at_scale`): started in a process group of its
//! own with its own nats-server under a home, its stdout read line by line, and killed with
//! everything it started when a test ends early.

#![allow(dead_code)] // each test binary uses part of this

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};
use stagehand_testkit::wait_for;

/// Bound on start-up (nats-server, streams, services, the catalogue answering).
pub const START: Duration = Duration::from_secs(120);
/// Bound on a clean stop: the services' drain deadline plus the server's own shutdown.
pub const STOP: Duration = Duration::from_secs(
    stagehand::up::STOP_DEADLINE.as_secs() + 30, // the server flushes JetStream after the drain
);

/// A running `stagehand up`: the child, its stdout lines as they come, its stderr in a file.
pub struct Up {
    pub child: Child,
    home: PathBuf,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: PathBuf,
}

impl Up {
    /// Starts `stagehand up --home HOME --port PORT` with its own nats-server; `env` is set
    /// last (a test's `RUST_LOG`, an OTLP endpoint).
    pub fn start(
        home: &Path,
        port: u16,
        stderr: PathBuf,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Up> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_stagehand"))
            .args(["up", "--home"])
            .arg(home)
            .args(["--port", &port.to_string()])
            // Tests run side by side: each `up` serves its metrics on a port of its own.
            .args(["--metrics", "127.0.0.1:0"])
            .env(
                "STAGEHAND_NATS_SERVER",
                stagehand_testkit::nats_server_binary(),
            )
            .env_remove("STAGEHAND_NATS_URL")
            .env_remove("STAGEHAND_HOME")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
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

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits i32")
    }

    /// What the process said so far, for failure messages.
    pub fn output(&mut self) -> String {
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
    pub async fn wait_up(&mut self) -> anyhow::Result<()> {
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

    /// The port `up` said it serves metrics on (`… · metrics http://ADDR/metrics`).
    pub fn metrics_port(&mut self) -> anyhow::Result<u16> {
        self.seen.extend(self.lines.try_iter());
        let line = self
            .seen
            .iter()
            .find(|l| l.starts_with("stagehand is up"))
            .context("no `stagehand is up` line")?;
        let addr = line
            .split_once("metrics http://")
            .and_then(|(_, rest)| rest.split_once("/metrics"))
            .map(|(addr, _)| addr)
            .with_context(|| format!("no metrics address in {line:?}"))?;
        Ok(addr.parse::<std::net::SocketAddr>()?.port())
    }

    /// Sends SIGINT to the whole process group, as a terminal does on Ctrl-C.
    pub fn ctrl_c(&self) -> anyhow::Result<()> {
        let pgid = rustix::process::Pid::from_raw(self.pid()).context("pid")?;
        rustix::process::kill_process_group(pgid, rustix::process::Signal::INT)?;
        Ok(())
    }

    /// Waits, within [`STOP`], for the process to exit.
    pub async fn wait_exit(&mut self) -> anyhow::Result<ExitStatus> {
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
pub fn processes_mentioning(needle: &str) -> Vec<(i32, i32)> {
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
pub fn server_processes(home: &Path) -> Vec<(i32, i32)> {
    processes_mentioning(&home.join("nats-dev.conf").display().to_string())
}
