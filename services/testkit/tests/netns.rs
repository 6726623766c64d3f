//! Node networks: a namespace reaches a server bound to the bridge and a server in another
//! namespace, and everything is removed on drop. Needs root (or CAP_NET_ADMIN and
//! CAP_SYS_ADMIN); without, `NodeNetwork::new` fails saying so and so does this test.

use std::process::{Command, Stdio};
use std::time::Duration;

use stagehand_testkit::{NatsServer, NetNode, NodeNetwork, wait_until_blocking};

/// Whether `node` opens a TCP connection to `addr:port` and reads a NATS server's greeting.
fn greets(node: &NetNode, addr: &str, port: u16) -> bool {
    let script = format!("exec 3<>/dev/tcp/{addr}/{port} && head -c 4 <&3");
    let out = node
        .command("timeout")
        .args(["5", "bash", "-c", &script])
        .output()
        .expect("run bash in a namespace");
    out.status.success() && out.stdout == b"INFO"
}

fn links() -> String {
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn namespaces() -> String {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn namespaces_reach_the_bridge_and_each_other_and_are_removed_on_drop() {
    let net = NodeNetwork::new(2).expect("a node network");
    let nats = NatsServer::builder().bind(net.host_addr()).start();
    assert_eq!(
        nats.url(),
        format!("nats://{}:{}", net.host_addr(), nats.port())
    );
    let host = net.host_addr().to_string();
    for node in net.nodes() {
        assert!(
            greets(node, &host, nats.port()),
            "{} reaches NATS",
            node.namespace()
        );
    }
    // Not on loopback: the server listens only where it was told.
    assert!(!greets(net.node(0), "127.0.0.1", nats.port()));

    // A server in node 1's namespace, on its own address; node 0 dials it across the bridge.
    let store = tempfile::tempdir().unwrap();
    let mut peer = net
        .node(1)
        .command(stagehand_testkit::nats_server_binary())
        .args(["-a", &net.node(1).addr().to_string(), "-p", "4222", "-sd"])
        .arg(store.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nats-server in node 1");
    let peer_addr = net.node(1).addr().to_string();
    let reached = wait_until_blocking(Duration::from_secs(20), "node 0 reaches node 1", || {
        greets(net.node(0), &peer_addr, 4222)
    });
    let _ = peer.kill();
    let _ = peer.wait();
    reached.unwrap();

    // A node's sending can be slowed, as a busy link would be; it still connects.
    net.limit_egress(0, "200mbit")
        .expect("limit node 0's egress");
    let qdisc = Command::new("tc")
        .args([
            "-n",
            net.node(0).namespace(),
            "qdisc",
            "show",
            "dev",
            "eth0",
        ])
        .output()
        .unwrap();
    let qdisc = String::from_utf8_lossy(&qdisc.stdout);
    assert!(
        qdisc.contains("tbf") && qdisc.contains("200Mbit"),
        "{qdisc}"
    );
    assert!(greets(net.node(0), &host, nats.port()));

    let bridge = net.bridge().to_owned();
    let names: Vec<String> = net
        .nodes()
        .iter()
        .map(|n| n.namespace().to_owned())
        .collect();
    assert!(links().contains(&format!(" {bridge}:")), "{}", links());
    drop(nats);
    drop(net);
    assert!(!links().contains(&bridge), "{}", links());
    let left = namespaces();
    for name in names {
        assert!(!left.contains(&name), "{name} left: {left}");
    }
}

/// Set in the child the test below starts without capabilities.
const WITHOUT_CAPS: &str = "STAGEHAND_TEST_NETNS_WITHOUT_CAPS";

/// A process without CAP_NET_ADMIN is told what a node network needs, rather than skipping:
/// this test runs itself again under `setpriv` with every capability dropped, and the child
/// checks the error.
#[test]
fn without_net_admin_the_error_says_what_is_needed() {
    if std::env::var_os(WITHOUT_CAPS).is_some() {
        let err = NodeNetwork::new(1).expect_err("no network without capabilities");
        assert!(
            matches!(err, stagehand_testkit::NetworkError::NotPermitted { .. }),
            "{err:?}"
        );
        let said = err.to_string();
        assert!(said.contains("root or CAP_NET_ADMIN"), "{said}");
        return;
    }
    let out = Command::new("setpriv")
        .args(["--bounding-set=-all", "--inh-caps=-all", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "without_net_admin_the_error_says_what_is_needed",
            "--nocapture",
        ])
        .env(WITHOUT_CAPS, "1")
        .output()
        .expect("run setpriv (util-linux)");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    assert!(said.contains("1 passed"), "{said}");
}
