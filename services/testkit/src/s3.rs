//! A real S3 server for tests: SeaweedFS `weed mini` on free loopback ports with its own data
//! directory and fixed test credentials.
//!
//! `weed mini` runs master, volume, filer and the S3 gateway in one process, ready in about a
//! second but with a large memory footprint, so it starts only when a test asks, and
//! [`S3Server::shared`] lets every test of one test binary use one instance with its own bucket
//! ([`S3Server::unique_bucket`]).

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tempfile::TempDir;

use crate::process::{self, Binary};

/// Access key of the test identity.
pub const ACCESS_KEY: &str = "stagehand-test";
/// Secret key of the test identity.
pub const SECRET_KEY: &str = "stagehand-test-secret";
/// Region the test server is addressed as (SeaweedFS accepts any; signatures must agree).
pub const REGION: &str = "us-east-1";

const START_TIMEOUT: Duration = Duration::from_secs(60);
const SHARED_PREFIX: &str = "stagehand-s3-shared-";

/// An error from a request to the test S3 server.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    /// The server could not be reached or the connection broke.
    #[error("S3 {method} {path}: {source}")]
    Io {
        method: &'static str,
        path: String,
        source: std::io::Error,
    },
    /// The server answered with an error status.
    #[error("S3 {method} {path}: HTTP {status}: {body}")]
    Status {
        method: &'static str,
        path: String,
        status: u16,
        body: String,
    },
}

/// A running SeaweedFS S3 server. Killed, and its data removed, on drop.
#[derive(Debug)]
pub struct S3Server {
    dir: TempDir,
    s3_port: u16,
    child: Option<Child>,
}

impl S3Server {
    /// Starts a server of its own (for tests that kill or fill it) and waits until S3 answers.
    /// Panics, with the log tail, when it does not within 60 s.
    pub fn start() -> S3Server {
        Self::start_in(
            tempfile::Builder::new()
                .prefix("stagehand-s3-")
                .tempdir()
                .expect("create a temp dir for weed"),
        )
    }

    /// The server shared by every test of this test binary, started on first use. Give each
    /// test its own bucket with [`unique_bucket`](Self::unique_bucket).
    ///
    /// A `static` is never dropped: the process is killed with the test binary (parent-death
    /// signal), and the data directories of finished test binaries are removed by the next one.
    pub fn shared() -> &'static S3Server {
        static SHARED: OnceLock<S3Server> = OnceLock::new();
        SHARED.get_or_init(|| {
            remove_stale_shared_dirs();
            let dir = tempfile::Builder::new()
                .prefix(&format!("{SHARED_PREFIX}{}-", std::process::id()))
                .tempdir()
                .expect("create a temp dir for weed");
            Self::start_in(dir)
        })
    }

    fn start_in(dir: TempDir) -> S3Server {
        let mut server = S3Server {
            dir,
            s3_port: 0,
            child: None,
        };
        // Ports are chosen before weed binds them; another process can take one in between.
        let mut last = String::new();
        for _attempt in 0..3 {
            match server.try_run() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("{last}");
    }

    fn try_run(&mut self) -> Result<(), String> {
        let bin = process::find_binary(Binary::Weed);
        let data = self.dir.path().join("data");
        fs::create_dir_all(&data).expect("create the weed data dir");
        let s3_config = self.dir.path().join("s3.json");
        fs::write(&s3_config, identities_json()).expect("write the S3 identities file");

        let ports = process::free_ports(8);
        let admin = admin_port_pair();
        let mut cmd = Command::new(&bin);
        cmd.arg("mini")
            .arg(format!("-dir={}", data.display()))
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
            ])
            .arg(format!("-master.port={}", ports[0]))
            .arg(format!("-master.port.grpc={}", ports[1]))
            .arg(format!("-volume.port={}", ports[2]))
            .arg(format!("-volume.port.grpc={}", ports[3]))
            .arg(format!("-filer.port={}", ports[4]))
            .arg(format!("-filer.port.grpc={}", ports[5]))
            .arg(format!("-s3.port={}", ports[6]))
            .arg(format!("-s3.port.grpc={}", ports[7]))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false"])
            .arg("-admin.ui=false")
            .arg(format!("-admin.port={}", admin.0))
            .arg(format!("-admin.port.grpc={}", admin.1))
            .arg(format!("-s3.config={}", s3_config.display()))
            // The default sockets live in /tmp under the port number, shared by all servers.
            .arg(format!(
                "-s3.localSocket={}",
                self.dir.path().join("s3.sock").display()
            ))
            .arg(format!(
                "-filer.localSocket={}",
                self.dir.path().join("filer.sock").display()
            ));
        let log = self.log_path();
        let mut child = process::spawn(cmd, &log);
        let s3_port = ports[6];
        let ready = process::poll_ready(&mut child, START_TIMEOUT, || {
            if !process::accepts(s3_port) {
                return None;
            }
            request(s3_port, "GET", "/", &[]).ok()
        });
        match ready {
            Ok(_) => {
                self.s3_port = s3_port;
                self.child = Some(child);
                Ok(())
            }
            Err(why) => {
                process::kill(&mut child);
                Err(format!(
                    "weed mini ({}) {why}; log {}:\n{}",
                    bin.display(),
                    log.display(),
                    process::log_tail(&log, 4000)
                ))
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port)
    }

    /// The S3 port.
    pub fn port(&self) -> u16 {
        self.s3_port
    }

    /// The test access key.
    pub fn access_key(&self) -> &'static str {
        ACCESS_KEY
    }

    /// The test secret key.
    pub fn secret_key(&self) -> &'static str {
        SECRET_KEY
    }

    /// The region to sign requests for.
    pub fn region(&self) -> &'static str {
        REGION
    }

    /// The environment a service process needs to reach this server: its credentials and
    /// region, and no proxy for loopback.
    pub fn client_env(&self) -> [(&'static str, &'static str); 4] {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", REGION),
            ("NO_PROXY", "127.0.0.1,localhost"),
        ]
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("weed.log")
    }

    /// Creates a bucket (names are 3–63 characters of `[a-z0-9.-]`).
    pub fn create_bucket(&self, name: &str) -> Result<(), S3Error> {
        request(self.s3_port, "PUT", &format!("/{name}"), &[]).map(drop)
    }

    /// Creates a bucket with a name no other test uses, `<prefix>-<unique suffix>`, and returns
    /// the name. Panics when the server refuses.
    pub fn unique_bucket(&self, prefix: &str) -> String {
        let name = crate::unique_name(prefix)
            .to_ascii_lowercase()
            .replace('_', "-");
        self.create_bucket(&name)
            .unwrap_or_else(|e| panic!("create test bucket {name}: {e}"));
        name
    }

    /// Uploads an object with a single signed PUT.
    pub fn put_object(&self, bucket: &str, key: &str, body: &[u8]) -> Result<(), S3Error> {
        request(self.s3_port, "PUT", &format!("/{bucket}/{key}"), body).map(drop)
    }

    /// Downloads an object.
    pub fn get_object(&self, bucket: &str, key: &str) -> Result<Vec<u8>, S3Error> {
        request(self.s3_port, "GET", &format!("/{bucket}/{key}"), &[])
    }

    /// Kills the server with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            process::kill(&mut child);
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn identities_json() -> String {
    serde_json::json!({
        "identities": [{
            "name": "stagehand-test",
            "credentials": [{ "accessKey": ACCESS_KEY, "secretKey": SECRET_KEY }],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]
        }]
    })
    .to_string()
}

/// `weed mini`'s admin worker dials the admin gRPC port at admin port + 10000 whatever
/// `-admin.port.grpc` says, so both must be free.
fn admin_port_pair() -> (u16, u16) {
    for _ in 0..100 {
        let p = process::free_ports(1)[0];
        if let Some(g) = p.checked_add(10000)
            && std::net::TcpListener::bind(("127.0.0.1", g)).is_ok()
        {
            return (p, g);
        }
    }
    panic!("no free loopback port pair (p, p + 10000) for the weed admin server");
}

/// Removes the data directories of shared servers whose test process has exited.
fn remove_stale_shared_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SHARED_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: signal 0 only checks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// One path-style S3 request signed with AWS Signature V4, over plain HTTP/1.1 on loopback.
/// Returns the response body of a 2xx answer.
fn request(port: u16, method: &'static str, path: &str, body: &[u8]) -> Result<Vec<u8>, S3Error> {
    let io = |source| S3Error::Io {
        method,
        path: path.to_string(),
        source,
    };
    let host = format!("127.0.0.1:{port}");
    let now = time::OffsetDateTime::now_utc();
    let amz_date = now
        .format(time::macros::format_description!(
            "[year][month][day]T[hour][minute][second]Z"
        ))
        .expect("format a date");
    let date = &amz_date[..8];
    let payload_hash = hex::encode(Sha256::digest(body));
    let canonical_path = uri_encode_path(path);
    let canonical_request = format!(
        "{method}\n{canonical_path}\n\nhost:{host}\nx-amz-content-sha256:{payload_hash}\n\
         x-amz-date:{amz_date}\n\nhost;x-amz-content-sha256;x-amz-date\n{payload_hash}"
    );
    let scope = format!("{date}/{REGION}/s3/aws4_request");
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical_request.as_bytes()))
    );
    let mut key = hmac_sha256(format!("AWS4{SECRET_KEY}").as_bytes(), date.as_bytes());
    for part in [REGION, "s3", "aws4_request"] {
        key = hmac_sha256(&key, part.as_bytes());
    }
    let signature = hex::encode(hmac_sha256(&key, string_to_sign.as_bytes()));

    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io)?;
    let head = format!(
        "{method} {canonical_path} HTTP/1.1\r\nHost: {host}\r\nx-amz-date: {amz_date}\r\n\
         x-amz-content-sha256: {payload_hash}\r\nAuthorization: AWS4-HMAC-SHA256 \
         Credential={ACCESS_KEY}/{scope}, SignedHeaders=host;x-amz-content-sha256;x-amz-date, \
         Signature={signature}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).map_err(io)?;
    stream.write_all(body).map_err(io)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).map_err(io)?;
    let (status, body) = parse_response(&response).ok_or_else(|| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "malformed HTTP response",
        ))
    })?;
    if (200..300).contains(&status) {
        Ok(body)
    } else {
        Err(S3Error::Status {
            method,
            path: path.to_string(),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
}

/// Splits an HTTP/1.1 response into status and body (identity or chunked encoding).
fn parse_response(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
    let body = &raw[split + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if !chunked {
        return Some((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Some((status, out));
        }
        out.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

/// Percent-encodes a path as SigV4's canonical URI wants: everything but unreserved characters
/// and `/`.
fn uri_encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(msg);
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231 test case 2.
    #[test]
    fn hmac_matches_rfc4231() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn parses_chunked_and_plain_responses() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi";
        assert_eq!(parse_response(plain), Some((200, b"hi".to_vec())));
        let chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Some((404, b"abcde".to_vec())));
    }

    #[test]
    fn encodes_paths_for_signing() {
        assert_eq!(uri_encode_path("/b/a b+c.txt"), "/b/a%20b%2Bc.txt");
    }
}
