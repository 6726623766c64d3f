//! `stagehand status --serve` as a real process against a real nats-server with the real
//! catalogue recorder, looked at in a real browser: Debian's Chromium, headless. A stage
//! request planted two hours old with no promoter running is stuck; the page Chromium renders
//! names it first with its command and runbook page, a job id carrying a `<script>` shows as
//! text (escaped, never run), and a screenshot of it is a real picture. `/status.json` is the
//! JSON view, other paths 404, other methods 405, and SIGTERM stops the server with exit 0.
//!
//! Chromium comes from `deploy/servers.sh install` (Debian's `chromium`); without it the test
//! fails saying so.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{PROJECT, Stagehand, WAIT};
use stagehand_schemas::{Body, Event, EventId, StageRequested};
use stagehand_testkit::{wait_for, wait_until};
use time::OffsetDateTime;

const CHROMIUM: &str = "/usr/bin/chromium";
/// Bound on one Chromium run on a loaded machine.
const BROWSER: Duration = Duration::from_secs(120);
/// The job id a tenant chose: markup that must show as text.
const HOSTILE_JOB: &str = "<script>document.title='owned'</script>";

/// A running `stagehand status --serve`: the child and its stdout lines as they come.
struct Served {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: PathBuf,
}

impl Served {
    fn start(stack: &Stagehand, stderr: PathBuf) -> Served {
        let mut child = Command::new(env!("CARGO_BIN_EXE_stagehand"))
            .args(["--nats", &stack.url, "status", "--serve", "127.0.0.1:0"])
            .args(["--refresh", "5s", "--policies"])
            .arg(&stack.policies)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("starting stagehand status --serve");
        let stdout = child.stdout.take().expect("its stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Served {
            child,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    fn output(&mut self) -> String {
        self.seen.extend(self.lines.try_iter());
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.seen.join("\n"),
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        )
    }

    /// The address of `status page: http://ADDR/ …`, once printed; fails if it exits first.
    async fn addr(&mut self) -> SocketAddr {
        let found = wait_for(WAIT, "the status page's URL on stdout", || {
            self.seen.extend(self.lines.try_iter());
            let addr = self.seen.iter().find_map(|l| {
                l.strip_prefix("status page: http://")?
                    .split_once('/')?
                    .0
                    .parse::<SocketAddr>()
                    .ok()
            });
            let exited = self.child.try_wait().ok().flatten();
            async move {
                match (addr, exited) {
                    (Some(addr), _) => Some(Ok(addr)),
                    (None, Some(status)) => Some(Err(status)),
                    (None, None) => None,
                }
            }
        })
        .await;
        match found {
            Ok(Ok(addr)) => addr,
            Ok(Err(status)) => panic!("it exited with {status}\n{}", self.output()),
            Err(e) => panic!("{e}\n{}", self.output()),
        }
    }

    async fn wait_exit(&mut self) -> ExitStatus {
        let child = &mut self.child;
        let status = wait_for(WAIT, "stagehand status --serve to exit", || {
            let status = child.try_wait().ok().flatten();
            async move { status }
        })
        .await;
        status.unwrap_or_else(|e| panic!("{e}\n{}", self.output()))
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 request; the status code and the body.
fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (code, body.to_owned())
}

/// Runs headless Chromium with `args` (and the flags that keep it off the network and out of
/// the machine's profile) within [`BROWSER`]; its output.
async fn chromium(profile: &Path, args: &[String]) -> Output {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: run `deploy/servers.sh install` (it installs Debian's chromium) \
         and run the test again"
    );
    let stdout = profile.with_extension("stdout");
    let stderr = profile.with_extension("stderr");
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("starting chromium");
    let status = wait_for(BROWSER, "chromium to finish", || {
        let status = child.try_wait().ok().flatten();
        async move { status }
    })
    .await;
    let status = match status {
        Ok(status) => status,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{e}: {}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
        }
    };
    Output {
        status,
        stdout: std::fs::read(&stdout).unwrap(),
        stderr: std::fs::read(&stderr).unwrap(),
    }
}

/// A PNG's width and height from its IHDR chunk, after checking the signature.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "not a PNG: {:?}",
        &bytes[..bytes.len().min(16)]
    );
    assert_eq!(&bytes[12..16], b"IHDR", "the first chunk of a PNG is IHDR");
    let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

fn stuck_request(job: &str) -> Event {
    let mut event = Event::request(
        EventId::for_stage(PROJECT, job, "cats", "0123456789ab", "hot", None),
        PROJECT,
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: "0123456789ab".into(),
            tier: "hot".into(),
            job_id: job.into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    );
    // Unchanged for two hours with no promoter running: past status's 30 minutes.
    event.occurred_at = OffsetDateTime::now_utc() - time::Duration::hours(2);
    event
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_status_page_shows_a_stuck_stage_first_in_a_real_browser() {
    let stack = Stagehand::start(common::Options::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    for job in ["page-stuck-job", HOSTILE_JOB] {
        stack.bus.publish(&stuck_request(job)).await.unwrap();
    }

    let mut served = Served::start(&stack, dir.path().join("serve.stderr"));
    let addr = served.addr().await;

    // The JSON view: the same object as `status --json`, once the recorder folded both.
    let mut last = String::new();
    wait_until(WAIT, "both stuck stages in /status.json", || {
        let (code, body) = http(addr, "GET", "/status.json");
        let report: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let stuck = |job: &str| {
            report["findings"].as_array().is_some_and(|f| {
                f.iter().any(|f| {
                    f["area"] == "stage"
                        && f["subject"].as_str().unwrap_or("").contains(job)
                        && f["run"]
                            .as_str()
                            .unwrap_or("")
                            .contains("runbooks/stage-stuck.md")
                })
            })
        };
        let ok = code == 200
            && report["needs_person"] == true
            && stuck("page-stuck-job")
            && stuck(HOSTILE_JOB);
        last = body;
        async move { ok }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {last}"));

    // The page as Chromium renders it.
    let url = format!("http://{addr}/");
    let dom = chromium(
        &dir.path().join("dump"),
        &["--dump-dom".into(), url.clone()],
    )
    .await;
    let dom_text = String::from_utf8_lossy(&dom.stdout);
    assert!(
        dom.status.success(),
        "chromium --dump-dom: {}",
        String::from_utf8_lossy(&dom.stderr)
    );
    let at = |what: &str| {
        dom_text
            .find(what)
            .unwrap_or_else(|| panic!("{what:?} is not in the rendered page:\n{dom_text}"))
    };
    // Stuck items first, with what to run and the runbook page; then tiers, stages, drills.
    let first = at("page-stuck-job");
    assert!(first < at("id=\"tiers\""));
    assert!(at("id=\"needs-person\"") < first);
    assert!(at("id=\"tiers\"") < at("id=\"stages\""));
    assert!(at("id=\"stages\"") < at("id=\"drills\""));
    at("stagehand stage status --project lab page-stuck-job");
    at("runbooks/stage-stuck.md");
    at("<meta http-equiv=\"refresh\" content=\"5\">");
    // The tenant's markup is text in the page: escaped, no script element, never run.
    at("&lt;script&gt;document.title='owned'&lt;/script&gt;");
    assert!(!dom_text.contains("<script"), "{dom_text}");
    assert!(!dom_text.contains("<title>owned"), "{dom_text}");

    // A screenshot: a real picture of the window's size, with more than a blank page in it.
    let png = dir.path().join("status.png");
    let shot = chromium(
        &dir.path().join("shot"),
        &[
            format!("--screenshot={}", png.display()),
            "--window-size=1200,900".into(),
            "--hide-scrollbars".into(),
            url,
        ],
    )
    .await;
    assert!(
        shot.status.success(),
        "chromium --screenshot: {}",
        String::from_utf8_lossy(&shot.stderr)
    );
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(png_size(&bytes), (1200, 900));
    // A blank 1200x900 page compresses to about a kilobyte; text and tables take far more.
    assert!(
        bytes.len() > 20_000,
        "the screenshot is {} bytes: nearly blank",
        bytes.len()
    );
    if let Ok(keep) = std::env::var("STAGEHAND_STATUS_SCREENSHOT") {
        std::fs::copy(&png, keep).unwrap();
    }

    // Read-only: nothing else is served, nothing but GET is answered.
    assert_eq!(http(addr, "GET", "/nothing-here").0, 404);
    assert_eq!(http(addr, "POST", "/").0, 405);
    assert_eq!(http(addr, "DELETE", "/status.json").0, 405);

    // SIGTERM (what a supervisor sends) stops it cleanly.
    let pid = rustix::process::Pid::from_raw(i32::try_from(served.child.id()).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = served.wait_exit().await;
    assert!(status.success(), "{status}\n{}", served.output());
}
