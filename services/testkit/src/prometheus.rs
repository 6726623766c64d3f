//! A real Prometheus server (Debian's `prometheus` package) that scrapes given targets, on a
//! free loopback port with its own data directory, killed on drop; and its HTTP query API.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use tempfile::TempDir;

use crate::process::{self, Binary};

/// How long Prometheus may take to become ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A running Prometheus scraping `targets` every second.
#[derive(Debug)]
pub struct Prometheus {
    dir: TempDir,
    port: u16,
    child: Option<Child>,
}

impl Prometheus {
    /// Starts Prometheus scraping `GET /metrics` of each target (`host:port`) every second, as
    /// job `stagehand`. Panics, with the log tail, when it is not ready within 60 s.
    pub fn start(targets: &[SocketAddr]) -> Prometheus {
        Prometheus::start_with_rules(targets, &[])
    }

    /// [`Prometheus::start`], also evaluating the rule files `rules` (every second).
    pub fn start_with_rules(targets: &[SocketAddr], rules: &[PathBuf]) -> Prometheus {
        let bin = process::find_binary(Binary::Prometheus);
        let dir = tempfile::Builder::new()
            .prefix("stagehand-prometheus-")
            .tempdir()
            .expect("create a temp dir for prometheus");
        let list = targets
            .iter()
            .map(|t| format!("\"{t}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let rule_files = rules
            .iter()
            .map(|r| format!("\"{}\"", r.display()))
            .collect::<Vec<_>>()
            .join(", ");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [{rule_files}]\nscrape_configs:\n  - job_name: stagehand\n    metrics_path: /metrics\n    static_configs:\n      - targets: [{list}]\n"
            ),
        )
        .expect("write the prometheus config");
        let log = dir.path().join("prometheus.log");
        let mut last = String::new();
        // The web port is chosen up front; another process may take it first: retry.
        for _attempt in 0..3 {
            let port = process::free_ports(1)[0];
            let mut cmd = Command::new(&bin);
            cmd.arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn");
            let mut child = process::spawn(cmd, &log);
            let ready = process::poll_ready(&mut child, START_TIMEOUT, || {
                http_get(port, "/-/ready")
                    .ok()
                    .filter(|(status, _)| *status == 200)
            });
            match ready {
                Ok(_) => {
                    return Prometheus {
                        dir,
                        port,
                        child: Some(child),
                    };
                }
                Err(why) => {
                    process::kill(&mut child);
                    last = why;
                }
            }
        }
        panic!(
            "prometheus ({}) {last}; log {}:\n{}",
            bin.display(),
            log.display(),
            process::log_tail(&log, 4000)
        );
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Prometheus's data and config directory.
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    /// Runs an instant query (`/api/v1/query?query=...`) and returns the `data.result` array
    /// of the answer. Errors carry the HTTP status or Prometheus's error text.
    pub fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let path = format!("/api/v1/query?query={}", percent_encode(expr));
        let (status, body) = http_get(self.port, &path).map_err(|e| e.to_string())?;
        let answer: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
            format!(
                "HTTP {status}: not JSON ({e}): {}",
                String::from_utf8_lossy(&body)
            )
        })?;
        if answer["status"] != "success" {
            return Err(format!("HTTP {status}: {answer}"));
        }
        Ok(answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Whether every scrape target is up (`up == 1`), per `/api/v1/targets`.
    pub fn targets_up(&self) -> Result<bool, String> {
        let (_, body) = http_get(self.port, "/api/v1/targets").map_err(|e| e.to_string())?;
        let answer: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        let active = answer["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        Ok(!active.is_empty() && active.iter().all(|t| t["health"] == "up"))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            process::kill(&mut child);
        }
    }
}

/// One HTTP/1.0 GET on loopback (no chunked answers to decode): status and body. Also what a
/// test scrapes a service's `/metrics` or probes its `/healthz` with.
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, Vec<u8>)> {
    http_get_at(SocketAddr::from(([127, 0, 0, 1], port)), path)
}

/// [`http_get`] of a service listening elsewhere than loopback (in a [`crate::NodeNetwork`]'s
/// namespace, say).
pub fn http_get_at(addr: SocketAddr, path: &str) -> std::io::Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP header end"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {head}")))?;
    Ok((status, raw[split + 4..].to_vec()))
}

/// Percent-encodes a query parameter value.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The value of the sample `name{labels}` in a Prometheus text scrape (as a service's
/// `/metrics` answers or `PrometheusHandle::render` gives), when present. `labels` is written
/// as the exposition writes them: `tier="hot",outcome="ok"`.
pub fn scrape_sample(scrape: &str, name: &str, labels: &str) -> Option<f64> {
    let head = format!("{name}{{{labels}}} ");
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(&head))
        .and_then(|v| v.trim().parse().ok())
}
