//! Finding the server binaries and spawning them so that they never outlive the test process.
//!
//! Every child is spawned from one long-lived thread with `PR_SET_PDEATHSIG = SIGKILL`. The
//! kernel delivers that signal when the *thread* that forked the child exits, so spawning from a
//! test's own thread would kill a server handed to another thread (or kept in a `static`) as soon
//! as the first test finishes. The spawner thread lives as long as the process, so a server dies
//! exactly when the test binary does, even when it aborts or is killed.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// A server binary the testkit runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Binary {
    NatsServer,
    Weed,
    Prometheus,
    Promtool,
}

impl Binary {
    fn file_name(self) -> &'static str {
        match self {
            Binary::NatsServer => "nats-server",
            Binary::Weed => "weed",
            Binary::Prometheus => "prometheus",
            Binary::Promtool => "promtool",
        }
    }

    fn env_var(self) -> &'static str {
        match self {
            Binary::NatsServer => "STAGEHAND_NATS_SERVER",
            Binary::Weed => "STAGEHAND_WEED",
            Binary::Prometheus => "STAGEHAND_PROMETHEUS",
            Binary::Promtool => "STAGEHAND_PROMTOOL",
        }
    }
}

/// The repository root, known at compile time from this crate's location.
pub(crate) fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Finds a server binary: the `STAGEHAND_NATS_SERVER` / `STAGEHAND_WEED` variable, then the venv
/// that `deploy/servers.sh install` creates (`$STAGEHAND_HOME/venv/bin`, else
/// `<repo>/.stagehand/venv/bin`), then `PATH`. Panics with the install command when none exists.
pub(crate) fn find_binary(bin: Binary) -> PathBuf {
    static CACHE: OnceLock<Mutex<Vec<(&'static str, PathBuf)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = cache.iter().find(|(n, _)| *n == bin.file_name()) {
        return p.clone();
    }

    let mut tried = Vec::new();
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os(bin.env_var()) {
        candidates.push(PathBuf::from(p));
    }
    if let Some(home) = std::env::var_os("STAGEHAND_HOME") {
        candidates.push(Path::new(&home).join("venv/bin").join(bin.file_name()));
    }
    candidates.push(
        repo_root()
            .join(".stagehand/venv/bin")
            .join(bin.file_name()),
    );
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            candidates.push(dir.join(bin.file_name()));
        }
    }
    for c in candidates {
        if is_executable(&c) {
            cache.push((bin.file_name(), c.clone()));
            return c;
        }
        tried.push(c.display().to_string());
    }
    panic!(
        "{} not found (set {} or run `deploy/servers.sh install`); looked at: {}",
        bin.file_name(),
        bin.env_var(),
        tried.join(", ")
    );
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `cmd` from the process-lifetime spawner thread, with its output appended to `log`.
pub(crate) fn spawn(mut cmd: Command, log: &Path) -> Child {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        thread::Builder::new()
            .name("stagehand-testkit-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    // The receiver may have gone (a panicking caller); the child then dies with us.
                    let _ = reply.send(cmd.spawn());
                }
                // The senders live in a static, so the loop above never ends: this thread, and
                // with it every child's parent-death signal, lasts as long as the process.
                loop {
                    thread::park();
                }
            })
            .expect("start the testkit spawner thread");
        Mutex::new(tx)
    });

    let out = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("open server log {}: {e}", log.display()));
    let err = out
        .try_clone()
        .unwrap_or_else(|e| panic!("dup server log {}: {e}", log.display()));
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let (tx, rx) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, tx))
        .expect("testkit spawner thread is gone");
    rx.recv()
        .expect("testkit spawner thread is gone")
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
}

/// Kills a child with SIGKILL and reaps it.
pub(crate) fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `max` bytes of a log file, for failure messages.
pub(crate) fn log_tail(log: &Path, max: u64) -> String {
    let Ok(mut f) = fs::File::open(log) else {
        return format!("(no log at {})", log.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    s
}

/// Asks the OS for `n` distinct free loopback ports. They are free when this returns; a server
/// started right after can lose one to another process, which callers handle by retrying.
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// Whether something accepts TCP connections on the loopback port.
pub(crate) fn accepts(port: u16) -> bool {
    accepts_at(std::net::IpAddr::from([127, 0, 0, 1]), port)
}

/// Whether something accepts TCP connections on `addr:port`.
pub(crate) fn accepts_at(addr: std::net::IpAddr, port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from((addr, port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

/// Polls `ready` until it yields a value, the child exits, or `timeout` passes.
pub(crate) fn poll_ready<T>(
    child: &mut Child,
    timeout: Duration,
    mut ready: impl FnMut() -> Option<T>,
) -> Result<T, String> {
    let start = Instant::now();
    let mut interval = Duration::from_millis(5);
    loop {
        if let Some(v) = ready() {
            return Ok(v);
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited before it was ready ({status})"));
        }
        if start.elapsed() > timeout {
            return Err(format!("not ready after {timeout:?}"));
        }
        // Polling a process that offers no readiness signal but its open port.
        thread::sleep(interval);
        interval = (interval * 2).min(Duration::from_millis(100));
    }
}
