//! Encrypted by default (issue 19, item 11): the shipped three-node cluster configurations
//! (`deploy/nats/cluster-{1,2,3}.conf`, with the shipped accounts) run with TLS on for clients
//! and routes, against a real certificate chain made here. Stagehand's bus and the `stagehand`
//! CLI connect over TLS trusting that CA (the CLI as the `scheduler` user with its password in
//! a file); a plaintext client is refused, a client that does not trust the CA is refused, and
//! a node whose certificate another CA signed cannot join the cluster's routes.
//!
//! Only ports, store folders and routes come from the testkit (its flags override the files);
//! the certificate folder and the accounts include are the two strings replaced
//! (`TestCa::shipped_nats_config`).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand_bus::{Bus, BusConfig};
use stagehand_testkit::{NatsCluster, NatsServer, TestCa, accounts_conf, role_password};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_cluster_runs_tls_for_clients_and_routes() -> anyhow::Result<()> {
    let ca = TestCa::new("Stagehand test CA");
    let configs: Vec<String> = (1..=3)
        .map(|n| ca.shipped_nats_config(&format!("cluster-{n}.conf")))
        .collect();
    let accounts = std::fs::read_to_string(accounts_conf())?;
    let operator_password = role_password("OPERATOR");
    let ca_file = ca.ca();
    let cluster = NatsCluster::builder(3)
        .config_texts(configs)
        .role_passwords(&accounts)
        .client_options(move || {
            async_nats::ConnectOptions::new()
                .user_and_password("operator".into(), operator_password.clone())
                .add_root_certificates(ca_file.clone())
                .require_tls(true)
        })
        .start();
    let port = cluster.nodes()[0].port();

    // The bus over TLS: provisions Stagehand's streams (replicated across the TLS routes).
    let servers: Vec<String> = cluster
        .nodes()
        .iter()
        .map(|n| {
            format!(
                "nats://operator:{}@127.0.0.1:{}",
                role_password("OPERATOR"),
                n.port()
            )
        })
        .collect();
    let bus_cfg = BusConfig {
        tls_ca: Some(ca.ca()),
        tls_required: true,
        connect_timeout: WAIT,
        ..BusConfig::new(servers.join(","))
    };
    let bus = Bus::connect(&bus_cfg).await?;
    ensure!(bus.replicas() == 3, "replicas {}", bus.replicas());
    bus.provision().await?;

    // The CLI over TLS, as the scheduler with its password in a file.
    let secrets = tempfile::tempdir()?;
    let password_file = secrets.path().join("scheduler.password");
    std::fs::write(&password_file, role_password("SCHEDULER"))?;
    std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600))?;
    let cli = |tls_ca: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
        for var in stagehand_bus::env::ALL {
            cmd.env_remove(var);
        }
        cmd.args(["--nats", &format!("nats://scheduler@127.0.0.1:{port}")])
            .arg("--password-file")
            .arg(&password_file)
            .args(["--connect-timeout", "5s"]);
        if tls_ca {
            cmd.arg("--tls-ca").arg(ca.ca());
        }
        cmd.args(["stage", "status", "--project", "demo"]);
        cmd.output()
    };
    let out = cli(true)?;
    ensure!(
        out.status.success(),
        "the CLI over TLS: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Not trusting the CA, it cannot talk to the server.
    let out = cli(false)?;
    ensure!(
        !out.status.success(),
        "the CLI connected without trusting the test CA"
    );

    // A plaintext client is refused: the server asks for TLS and answers a plaintext CONNECT
    // with an error, never a PONG.
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut info = String::new();
    reader.read_line(&mut info)?;
    ensure!(
        info.starts_with("INFO ") && info.contains("\"tls_required\":true"),
        "{info}"
    );
    let mut writer = stream;
    writer.write_all(
        format!(
            "CONNECT {{\"verbose\":false,\"user\":\"operator\",\"pass\":\"{}\"}}\r\nPING\r\n",
            role_password("OPERATOR")
        )
        .as_bytes(),
    )?;
    let mut answer = String::new();
    let _ = reader.read_line(&mut answer);
    ensure!(
        !answer.starts_with("PONG"),
        "a plaintext client got {answer:?}"
    );

    // A node with another CA's certificate is refused by the routes: it trusts the cluster's
    // CA (so it would accept the cluster), and the cluster refuses its certificate.
    let rogue_ca = TestCa::new("Not the cluster's CA");
    let node_log = cluster.nodes()[0].log_path();
    let handshake_errors = || {
        std::fs::read_to_string(&node_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("TLS route handshake error"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let before = handshake_errors().len();
    let route_port = cluster_route_port(&cluster)?;
    let rogue = NatsServer::builder()
        .config_text(format!(
            "server_name: rogue\n\
             tls {{ cert_file: \"{cert}\", key_file: \"{key}\", ca_file: \"{ca}\" }}\n\
             cluster {{\n  name: stagehand\n  listen: 127.0.0.1:-1\n  routes: [ nats-route://127.0.0.1:{route_port} ]\n  \
               tls {{ cert_file: \"{cert}\", key_file: \"{key}\", ca_file: \"{ca}\", verify: true, timeout: 2 }}\n}}\n",
            cert = rogue_ca.server_cert().display(),
            key = rogue_ca.server_key().display(),
            ca = ca.ca().display(),
        ))
        .start();
    let refused = stagehand_testkit::wait_for(WAIT, "the rogue route to be refused", || {
        let seen = handshake_errors().get(before).cloned();
        async move { seen }
    })
    .await
    .with_context(|| std::fs::read_to_string(rogue.log_path()).unwrap_or_default())?;
    eprintln!("node 1: {refused}");
    Ok(())
}

/// The route port of the cluster's first node, as its log says it listens.
fn cluster_route_port(cluster: &NatsCluster) -> anyhow::Result<u16> {
    let text = std::fs::read_to_string(cluster.nodes()[0].log_path())?;
    text.lines()
        .find_map(|l| {
            l.split("Listening for route connections on 127.0.0.1:")
                .nth(1)
                .and_then(|p| p.trim().parse().ok())
        })
        .context("no route port in the first node's log")
}
