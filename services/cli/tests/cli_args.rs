//! The built `stagehand` binary, run the way a scheduler hook runs it: stdout and stderr are
//! pipes (not terminals), and the hook has a deadline.
//!
//! Guards issue 8 §3: every command checks its arguments before it connects (one line naming
//! the bad argument, exit 64, even with no server anywhere); an unreachable NATS is one line
//! after the bounded `--connect-timeout` wait, exit 69 (it used to retry for 9.5 s printing six
//! coloured WARN lines, never naming the missing folder of `stagehand ingest /nonexistent`); no
//! ANSI escape codes reach a pipe.

use std::net::TcpStream;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A loopback URL nothing listens on: a privileged port that refuses connections now. (A
/// port bound for a moment and freed could be taken meanwhile by another test's server, which
/// takes its ports — client and cluster route ones — from the ephemeral range; slurm.sh takes
/// Slurm's from 20000-32000.)
fn dead_url() -> String {
    let port = (1..1024u16)
        .find(|p| {
            TcpStream::connect_timeout(
                &std::net::SocketAddr::from(([127, 0, 0, 1], *p)),
                Duration::from_secs(1),
            )
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
        })
        .expect("a loopback port below 1024 that refuses connections");
    format!("nats://127.0.0.1:{port}")
}

/// Runs the binary with `args` against a server that does not exist, in a clean environment
/// (no STAGEHAND_PROJECT, no policies in the working directory).
fn run(args: &[&str]) -> (Output, Duration) {
    let cwd = tempfile::tempdir().expect("temp dir");
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", &dead_url()])
        .args(args)
        .current_dir(cwd.path())
        .env_remove("STAGEHAND_PROJECT")
        .env_remove("STAGEHAND_HOME")
        .env_remove("RUST_LOG")
        .env_remove("STAGEHAND_NATS_URL")
        .output()
        .expect("run stagehand");
    (out, started.elapsed())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Exactly one line on stderr, nothing on stdout, no escape codes; returns the line.
fn one_line(out: &Output) -> String {
    let err = stderr(out);
    assert!(
        !err.contains('\x1b'),
        "ANSI escape codes in a non-terminal stderr: {err:?}"
    );
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line on stderr, got {err:?}");
    lines[0].to_owned()
}

const V: &str = "ds@0123456789abcdef";

#[test]
fn bad_arguments_exit_64_with_one_line_naming_the_argument_before_connecting() {
    let folder = tempfile::tempdir().unwrap();
    let folder = folder.path().to_str().unwrap().to_owned();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "stage",
                "request",
                "ds",
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
            ],
            "DATASET@VERSION \"ds\"",
        ),
        (
            vec![
                "stage",
                "request",
                "ds@abc",
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
            ],
            "\"ds@abc\"",
        ),
        (
            vec![
                "stage",
                "request",
                "ds@0123456789ABCDEF",
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
            ],
            "lowercase hex",
        ),
        (
            vec![
                "stage",
                "request",
                ".ds@0123456789abcdef",
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
            ],
            "dataset name",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "Lab A",
            ],
            "--project \"Lab A\"",
        ),
        (
            vec!["stage", "request", V, "--tier", "hot", "--job", "j"],
            "--project (or STAGEHAND_PROJECT) is required",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "Hot!",
                "--job",
                "j",
                "--project",
                "p",
            ],
            "--tier \"Hot!\"",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "local",
                "--job",
                "j",
                "--node",
                "n.1",
                "--project",
                "p",
            ],
            "--node \"n.1\"",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "hot",
                "--job",
                "a b",
                "--project",
                "p",
            ],
            "--job \"a b\"",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
                "--deadline",
                "soon",
            ],
            "--deadline \"soon\"",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
                "--deadline",
                "2020-01-01T00:00:00Z",
            ],
            "in the past",
        ),
        (
            vec![
                "stage",
                "request",
                V,
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
                "--form",
                "zip",
            ],
            "'zip'",
        ),
        (
            vec!["stage", "request", V, "--tier", "hot", "--project", "p"],
            "--job <JOB>",
        ),
        (
            vec![
                "stage",
                "wait",
                V,
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
                "--timeout",
                "5x",
            ],
            "--timeout \"5x\"",
        ),
        (
            vec![
                "stage",
                "release",
                "ds@0123",
                "--tier",
                "hot",
                "--job",
                "j",
                "--project",
                "p",
            ],
            "\"ds@0123\"",
        ),
        (
            vec!["status", "--serve", "127.0.0.1:0", "--refresh", "500ms"],
            "--refresh 500ms: at least 1s",
        ),
        (vec!["status", "--serve", "nowhere"], "nowhere"),
        (vec!["status", "--refresh", "5s"], "--serve"),
        (vec!["stage", "status", "ds@xyz"], "\"ds@xyz\""),
        (vec!["stage", "status", "--project", "P"], "--project \"P\""),
        (
            vec!["stage", "status", "j1"],
            "--project (or STAGEHAND_PROJECT) is required",
        ),
        (
            vec!["--connect-timeout", "ten", "stage", "status"],
            "--connect-timeout \"ten\"",
        ),
        (
            vec!["ingest", "/nonexistent", "--project", "p", "--dataset", "d"],
            "folder /nonexistent: No such file or directory",
        ),
        (
            vec![
                "ingest",
                &folder,
                "--project",
                "p",
                "--dataset",
                "d/../x",
                "--policies",
                &folder,
            ],
            "--dataset \"d/../x\"",
        ),
        (
            vec![
                "ingest",
                &folder,
                "--project",
                "p",
                "--dataset",
                "d",
                "--policies",
                "/nonexistent-policies",
            ],
            "--policies /nonexistent-policies",
        ),
        (
            vec![
                "ingest",
                &folder,
                "--project",
                "p",
                "--dataset",
                "d",
                "--policies",
                &folder,
                "--manifest",
                "/nonexistent.tsv",
            ],
            "--manifest /nonexistent.tsv",
        ),
        (
            vec!["ingest", &folder, "--project", "p", "--dataset", "d"],
            "the default policy folder",
        ),
        (
            vec!["catalogue", "show", "ds@12"],
            "VERSION is 8-64 lowercase hex",
        ),
        (
            vec!["catalogue", "datasets", "--project", "A"],
            "--project \"A\"",
        ),
        (
            vec!["dlq", "list", "--service", "Bad Service"],
            "--service \"Bad Service\"",
        ),
        (vec!["dlq", "replay", "seven"], "'seven'"),
    ];
    for (args, names) in cases {
        let (out, elapsed) = run(&args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", stderr(&out));
        let line = one_line(&out);
        assert!(line.starts_with("stagehand: "), "{args:?}: {line}");
        assert!(
            line.contains(names),
            "{args:?}: {line:?} does not name {names:?}"
        );
        // Refused before any connection attempt: the server does not exist, so even one
        // attempt's retry back-off would show.
        assert!(
            elapsed < Duration::from_secs(2),
            "{args:?} took {elapsed:?}"
        );
    }
}

#[test]
fn unreachable_nats_is_one_line_after_the_bounded_wait_exit_69() {
    let folder = tempfile::tempdir().unwrap();
    let folder = folder.path().to_str().unwrap().to_owned();
    let cases: Vec<Vec<&str>> = vec![
        vec![
            "stage",
            "request",
            V,
            "--tier",
            "hot",
            "--job",
            "j",
            "--project",
            "p",
        ],
        vec![
            "stage",
            "wait",
            V,
            "--tier",
            "hot",
            "--job",
            "j",
            "--project",
            "p",
            "--timeout",
            "0",
        ],
        vec!["stage", "status", "--project", "p"],
        vec![
            "stage",
            "release",
            V,
            "--tier",
            "hot",
            "--job",
            "j",
            "--project",
            "p",
        ],
        vec![
            "ingest",
            &folder,
            "--project",
            "p",
            "--dataset",
            "d",
            "--policies",
            &folder,
        ],
        vec!["catalogue", "datasets"],
        vec!["dlq", "list"],
    ];
    // The cases run side by side: each waits out its own bound.
    std::thread::scope(|scope| {
        for args in &cases {
            scope.spawn(move || {
                let mut full = vec!["--connect-timeout", "1500ms"];
                full.extend(args.iter().copied());
                let (out, elapsed) = run(&full);
                assert_eq!(out.status.code(), Some(69), "{args:?}: {}", stderr(&out));
                let line = one_line(&out);
                assert!(
                    line.starts_with("stagehand: cannot reach NATS at nats://127.0.0.1:"),
                    "{args:?}: {line}"
                );
                assert!(line.contains("Connection refused"), "{args:?}: {line}");
                // It kept trying for the whole bound, and not much longer.
                assert!(
                    elapsed >= Duration::from_millis(1400) && elapsed < Duration::from_secs(5),
                    "{args:?}: gave up after {elapsed:?}"
                );
            });
        }
    });
}

/// The bus logs each failed connection attempt; the CLI shows those lines only when debug
/// logs are asked for (without RUST_LOG, the one error line of the test above is all).
#[test]
fn connection_retries_show_only_when_debug_logs_are_asked_for_and_never_in_colour() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    let out = cmd
        .args(["--nats", &dead_url(), "--connect-timeout", "700ms"])
        .args(["stage", "status", "--project", "p"])
        .env("RUST_LOG", "stagehand_bus=debug")
        .output()
        .expect("run stagehand");
    assert_eq!(out.status.code(), Some(69));
    let err = stderr(&out);
    assert!(!err.contains('\x1b'), "colour in a pipe: {err:?}");
    let retries = err
        .lines()
        .filter(|l| l.contains("connecting to NATS failed; retrying"))
        .count();
    assert!(
        retries >= 2,
        "expected the retries with RUST_LOG=debug: {err}"
    );
    assert!(
        err.lines()
            .last()
            .is_some_and(|l| l.starts_with("stagehand: cannot reach NATS")),
        "{err}"
    );
}

/// Guards against the NATS client's own connector errors reaching a hook's stderr: pointed at a
/// port where a nats-server answers, but not as a client port (a cluster's route port, which a
/// freed "dead" port once turned out to be), a command still prints its one line, exit 69.
#[test]
fn a_port_that_is_not_a_client_port_is_still_one_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let route = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port();
    let conf = dir.path().join("route.conf");
    std::fs::write(
        &conf,
        // JetStream (the testkit starts it) wants routes in a cluster: the node's own will do.
        format!(
            "server_name: probe\ncluster {{ name: probe, listen: \"127.0.0.1:{route}\", \
             routes: [\"nats://127.0.0.1:{route}\"] }}\n"
        ),
    )
    .expect("write the config");
    let _server = stagehand_testkit::NatsServer::builder()
        .config_file(&conf)
        .start();
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", &format!("nats://127.0.0.1:{route}")])
        .args(["--connect-timeout", "1s", "dlq", "list"])
        .env_remove("RUST_LOG")
        .output()
        .expect("run stagehand");
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    let line = one_line(&out);
    assert!(line.contains("route port"), "{line}");
}
