//! Fan-out between node agents, in-process against a real nats-server: three agents, each
//! with its own local tier and its own piece server on the loopback, stage one version from
//! the hot tier at once — every node byte-exact, every piece read from the hot tier once
//! between them, the files larger than a piece moved in slices where the manifest's side data
//! has their piece hashes and whole where it has none; and an agent whose copy is damaged on
//! disk is caught serving bad bytes, dropped from the swarm, and every other node still ends
//! byte-exact; and an agent restarted after staging a version serves it again once a job asks
//! for it there. (The same with each
//! agent in its own network namespace and killed mid-copy: `services/cli/tests/fanout.rs`.)

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use futures::StreamExt;
use stagehand_promoter::fanout::pieces::Piece;
use stagehand_promoter::fanout::{BadKey, Fanout, FanoutSettings, FanoutTls};
use stagehand_schemas::pieces::PieceHashes;
use stagehand_schemas::{Body, FileRef};
use stagehand_testkit::{TestCa, wait_for};

const DATASET: &str = "shards";

/// Many small files and two larger than a piece: 40 × 200 KiB + 2 × 9 MiB.
fn version_files() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = (0..40)
        .map(|i| (format!("part/{i:03}.bin"), bytes(i, 200 * 1024)))
        .collect();
    files.push(("big/a.bin".into(), bytes(101, 9 << 20)));
    files.push(("big/b.bin".into(), bytes(102, 9 << 20)));
    files
}

/// The agents' token, readable by its owner only.
fn token_file(root: &Path) -> PathBuf {
    let path = root.join("fanout.token");
    std::fs::write(&path, "stagehand-test-agents-token-0123456789\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

/// The local root of `node` (`local-<node>` beside the stack's tiers).
fn local_root(stack: &Stack, node: &str) -> PathBuf {
    stack.tier(&format!("local-{node}"))
}

/// Starts the agent of `node` with fan-out on, its own policies naming its own local root.
fn start_agent(stack: &mut Stack, node: &str, token: &Path) {
    start_agent_with(stack, node, token, None);
}

/// The port `node`'s agent serves pieces on.
fn piece_port(stack: &Stack, node: &str) -> u16 {
    std::fs::read_to_string(stack.root().join(format!("fanout-port-{node}")))
        .unwrap()
        .parse()
        .unwrap()
}

/// A `GET` of `path` on the loopback `port` with `Authorization: <authorization>`: the status
/// and the body.
fn get_presenting(port: u16, path: &str, authorization: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: {authorization}\r\n\r\n"
    )?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    Ok((status.unwrap_or(0), body.to_owned()))
}

/// [`start_agent`], its pieces served and fetched over mutual TLS with `tls`'s certificate.
fn start_agent_with(stack: &mut Stack, node: &str, token: &Path, tls: Option<&TestCa>) {
    let policies = stack.root().join(format!("policies-{node}"));
    std::fs::create_dir_all(&policies).unwrap();
    for entry in std::fs::read_dir(&stack.policies).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.replace("local-n1\"", &format!("local-{node}\""));
        std::fs::write(policies.join(path.file_name().unwrap()), text).unwrap();
    }
    std::fs::create_dir_all(local_root(stack, node)).unwrap();
    let mut config = stack.node_agent_config(node);
    config.service.policies_dir = policies;
    let port = free_port();
    std::fs::write(
        stack.root().join(format!("fanout-port-{node}")),
        port.to_string(),
    )
    .unwrap();
    config.service.fanout = Some(FanoutSettings {
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        advertise: None,
        token_file: token.to_owned(),
        claim_patience: std::time::Duration::from_secs(5),
        parallel: 4,
        tls: tls.map(|ca| FanoutTls {
            cert_file: ca.server_cert(),
            key_file: ca.server_key(),
            ca_file: ca.ca(),
            server_name: None,
        }),
    });
    stack.run(&agent(node), |token| stagehand_promoter::run(config, token));
}

/// The name `node`'s agent runs under in the stack ([`Stack::stop_service`]).
fn agent(node: &str) -> String {
    format!("agent-{node}")
}

/// Puts the version on the hot tier (through the shared promoter): its version and files
/// (in manifest order). With `side_data`, the piece hashes of its files larger than a piece
/// are stored first, as the validator stores them.
async fn on_hot(
    stack: &mut Stack,
    side_data: bool,
) -> (String, Vec<(String, Vec<u8>)>, Vec<FileRef>) {
    let files = version_files();
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
    let (prefix, mut refs) = stack.put_files("capacity", DATASET, "v1", &named);
    refs.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    if side_data {
        let store =
            stagehand_manifest::ManifestStore::catalogue(stack.bus.jetstream(), Default::default())
                .await
                .unwrap();
        for (name, bytes) in files
            .iter()
            .filter(|(_, b)| PieceHashes::wanted(b.len() as u64))
        {
            let sha = &refs.iter().find(|r| &r.path == name).unwrap().sha256;
            store
                .put_pieces(sha, &PieceHashes::of(bytes))
                .await
                .unwrap();
        }
    }
    let version = stack.validated(DATASET, "capacity", &prefix, &refs).await;
    let hot = stage_request(DATASET, &version, "hot", "job-hot", None, None);
    stack.publish(&hot).await;
    let js = stack.bus.jetstream().clone();
    wait_for(WAIT, "the version ready on hot", || async {
        answers(&js, "stage.ready", &hot.id).await.pop()
    })
    .await
    .unwrap();
    (version, files, refs)
}

/// Asks for the version on `local` of each of `nodes` and waits until every one is ready.
async fn stage_on(stack: &Stack, version: &str, nodes: &[&str]) {
    stage_for(stack, version, nodes, "job").await;
}

/// [`stage_on`] for the jobs `<job>-<node>`.
async fn stage_for(stack: &Stack, version: &str, nodes: &[&str], job: &str) {
    let js = stack.bus.jetstream().clone();
    let requests: Vec<_> = nodes
        .iter()
        .map(|n| {
            stage_request(
                DATASET,
                version,
                "local",
                &format!("{job}-{n}"),
                Some(n),
                None,
            )
        })
        .collect();
    for r in &requests {
        stack.publish(r).await;
    }
    for (r, node) in requests.iter().zip(nodes) {
        let answer = wait_for(WAIT * 2, &format!("local ready on {node}"), || async {
            let ready = answers(&js, "stage.ready", &r.id).await.pop();
            let failed = answers(&js, "stage.failed", &r.id).await.pop();
            ready.or(failed)
        })
        .await
        .unwrap();
        assert_eq!(answer.kind(), "stage.ready", "{node}: {answer:?}");
    }
}

/// Every file of the version on `node`'s local tier, byte for byte.
fn assert_exact(stack: &Stack, node: &str, version: &str, files: &[(String, Vec<u8>)]) {
    let folder = local_root(stack, node).join(format!("{PROJECT}/{DATASET}/{version}"));
    for (name, want) in files {
        let got =
            std::fs::read(folder.join(name)).unwrap_or_else(|e| panic!("{node}: {name}: {e}"));
        assert!(got == *want, "{node}: {name} differs from the source");
    }
}

/// The fan-out board, the swarm of `version` (files `refs`) on the local tier, and its pieces.
async fn board_of(
    stack: &Stack,
    version: &str,
    refs: &[FileRef],
) -> (async_nats::jetstream::kv::Store, String, Vec<Piece>) {
    let js = stack.bus.jetstream();
    let board = js
        .get_key_value(stagehand_bus::SWARMS_BUCKET)
        .await
        .unwrap();
    let side = stagehand_promoter::fanout::side_data(js, refs)
        .await
        .unwrap();
    let pieces = stagehand_promoter::fanout::pieces::cut(refs, &side);
    let swarm = Fanout::swarm_of(&Fanout::swarm("local", PROJECT, DATASET, version), &pieces);
    (board, swarm, pieces)
}

/// A counter of the in-process services (every agent of this test: one process per test).
fn counter(name: &str, labels: &str) -> f64 {
    let text = stagehand_telemetry::metrics::install().render();
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The large files in slices, from the side data's piece hashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_stage_one_version_reading_the_hot_tier_once_between_them() {
    three_nodes_fan_out(None, true).await;
}

/// The same as the shipped configurations run it: over mutual TLS, each agent connected as
/// its own node's user of `deploy/nats/accounts.conf` (`node-<node>`, which must grant it
/// its consumers, its node's records, the board and the side data, and nothing of another
/// node's). No side data here: the large files move whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_fan_out_over_mutual_tls_each_as_its_own_nodes_user() {
    let ca = TestCa::new("stagehand-agents");
    three_nodes_fan_out(Some(&ca), false).await;
}

async fn three_nodes_fan_out(tls: Option<&TestCa>, side_data: bool) {
    // The counters of every service in this process (one process per test).
    stagehand_telemetry::metrics::install();
    let nodes = ["n1", "n2", "n3"];
    let mut stack = Stack::start_with(Options {
        accounts: tls.is_some(),
        node_users: &["n1", "n2", "n3"],
        ..Options::default()
    })
    .await;
    stack.run_promoter(stack.promoter_config("shared"));
    let token = token_file(stack.root());
    let (version, files, refs) = on_hot(&mut stack, side_data).await;
    for n in nodes {
        start_agent_with(&mut stack, n, &token, tls);
    }
    stage_on(&stack, &version, &nodes).await;
    for n in nodes {
        assert_exact(&stack, n, &version, &files);
    }
    let (board, swarm, pieces) = board_of(&stack, &version, &refs).await;
    let slices = pieces.iter().filter(|p| p.slice.is_some()).count();
    assert_eq!(
        slices,
        if side_data { 4 } else { 0 },
        "each 9 MiB file in two slices where it has side data"
    );
    // Each agent stayed within its node's grants: the server refused it nothing.
    if tls.is_some() {
        let log = std::fs::read_to_string(stack.nats.log_path()).unwrap();
        let refused: Vec<&str> = (log.lines())
            .filter(|l| l.contains(" Violation - "))
            .collect();
        assert!(refused.is_empty(), "{refused:#?}");
    }
    // A caller without the token is served nothing; over TLS, nothing without a handshake.
    let route = format!("/v1/swarms/{swarm}/pieces/0");
    let port = piece_port(&stack, "n1");
    let secret = std::fs::read_to_string(&token).unwrap();
    let (plain, bearer) = tokio::task::spawn_blocking(move || {
        let plain = stagehand_testkit::http_get(port, &route);
        let bearer = get_presenting(port, &route, &format!("Bearer {}", secret.trim()));
        (plain, bearer)
    })
    .await
    .unwrap();
    match tls {
        None => {
            assert_eq!(plain.unwrap().0, 401);
            // The secret is a signing key, not a password: presented as itself it opens
            // nothing (so a peer that leaked it on the wire would have leaked nothing usable).
            let (status, body) = bearer.unwrap();
            assert_eq!(status, 401, "{body}");
            assert!(body.contains("signature is required"), "{body}");
        }
        Some(_) => assert!(plain.is_err(), "a plain request answered: {plain:?}"),
    }
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    let shared = counter("stagehand_fanout_bytes_total", "source=\"shared\"");
    let peer = counter("stagehand_fanout_bytes_total", "source=\"peer\"");
    // Every piece read once from hot, unless a claim went stale on a slow machine.
    assert!(
        shared >= total as f64 && shared <= 1.25 * total as f64,
        "read {shared} bytes from the hot tier for a {total}-byte version on three nodes"
    );
    assert_eq!(
        shared + peer,
        3.0 * total as f64,
        "every node got every byte once"
    );
    assert_eq!(counter("stagehand_fanout_peers_dropped_total", ""), 0.0);
    // The board says who holds what: every node every piece.
    let pieces = pieces.len();
    let held = holdings(&board, &swarm).await;
    assert_eq!(held.len(), nodes.len(), "{held:?}");
    assert!(held.values().all(|&n| n == pieces), "{held:?}");
    // n1's agent starting again serves nothing it held before, so it takes back its word:
    // peers are not sent to ask it. The others' announcements stand.
    let again = FanoutSettings {
        listen: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        advertise: None,
        token_file: token_file(stack.root()),
        claim_patience: std::time::Duration::from_secs(5),
        parallel: 4,
        tls: None,
    };
    let stop = stagehand_bus::CancellationToken::new();
    let restarted = Fanout::bind(&again, "n1", board.clone(), stack.bus.clone(), stop.clone())
        .await
        .unwrap();
    let held = holdings(&board, &swarm).await;
    assert_eq!(held.get("n1"), None, "{held:?}");
    assert_eq!(
        (held.get("n2"), held.get("n3")),
        (Some(&pieces), Some(&pieces))
    );
    stop.cancel();
    drop(restarted);
    stack.stop().await;
}

/// A node that claims every piece of a swarm and renews its claims without ever reading them
/// (claims are anyone's to take over, so every node's user may write them) costs its peers
/// time, never the copy: a claim one node has held past any read of its piece is read past,
/// and both nodes end byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_renewed_and_never_read_are_read_past() {
    stagehand_telemetry::metrics::install();
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("shared"));
    let token = token_file(stack.root());
    let (version, files, refs) = on_hot(&mut stack, true).await;
    let (board, swarm, pieces) = board_of(&stack, &version, &refs).await;
    // "n9" claims every piece before anyone else and renews each claim at a steady cadence,
    // faster than any patience, for as long as the test runs.
    let keys: Vec<String> = (0..pieces.len())
        .map(|p| format!("swarm.{swarm}.claim.{p}"))
        .collect();
    let hog = tokio::spawn({
        let board = board.clone();
        async move {
            let mut cadence = tokio::time::interval(std::time::Duration::from_millis(200));
            loop {
                cadence.tick().await;
                for key in &keys {
                    let _ = board.put(key, br#"{"node":"n9"}"#.as_slice().into()).await;
                }
            }
        }
    });
    for n in ["n1", "n2"] {
        start_agent(&mut stack, n, &token);
    }
    stage_on(&stack, &version, &["n1", "n2"]).await;
    hog.abort();
    for n in ["n1", "n2"] {
        assert_exact(&stack, n, &version, &files);
    }
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    let shared = counter("stagehand_fanout_bytes_total", "source=\"shared\"");
    let peer = counter("stagehand_fanout_bytes_total", "source=\"peer\"");
    assert_eq!(
        shared + peer,
        2.0 * total as f64,
        "every node got every byte once"
    );
    stack.stop().await;
}

/// A stack whose version (side data stored) n1's agent has staged from the hot tier: the stack,
/// the agents' token, and the version as [`on_hot`] gives it.
async fn staged_on_n1() -> (
    Stack,
    PathBuf,
    (String, Vec<(String, Vec<u8>)>, Vec<FileRef>),
) {
    // The counters of every service in this process (one process per test).
    stagehand_telemetry::metrics::install();
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("shared"));
    let token = token_file(stack.root());
    let put = on_hot(&mut stack, true).await;
    start_agent(&mut stack, "n1", &token);
    stage_on(&stack, &put.0, &["n1"]).await;
    (stack, token, put)
}

/// An agent restarted after it staged a version serves it again as it starts: its restart
/// takes back every word it gave on the board, then each copy the catalogue holds present on
/// its node that still matches its recorded fingerprint is announced again, before any job
/// asks for it there. A node joining later reads all of it from that agent, nothing from the
/// hot tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_serves_what_it_holds_intact_again_as_it_starts() {
    let (mut stack, token, (version, files, refs)) = staged_on_n1().await;
    let (board, swarm, pieces) = board_of(&stack, &version, &refs).await;
    let pieces = pieces.len();
    restart_n1_unannounced(&mut stack, &token, &board, &swarm, pieces).await;
    n1_serving_every_piece(
        &board,
        &swarm,
        pieces,
        "n1 serving its replica again as it starts",
    )
    .await;
    n2_reads_everything_from_n1(stack, &token, &version, &files).await;
}

/// One node's report is not enough to drop a peer for the others: any node may write a report
/// in its own name, so "n9" reporting n1 (which serves intact bytes) leaves n1 serving n2, which
/// reads every byte from n1 and none from the hot tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_nodes_false_report_drops_nobody_for_the_others() {
    let (stack, token, (version, files, refs)) = staged_on_n1().await;
    let (board, swarm, pieces) = board_of(&stack, &version, &refs).await;
    let pieces = pieces.len();
    n1_serving_every_piece(&board, &swarm, pieces, "n1 serving its copy").await;
    let lie = BadKey {
        swarm: &swarm,
        node: "n1",
        by: "n9",
    };
    let report = serde_json::json!({"file": files[0].0, "why": "a lie"}).to_string();
    board.put(lie.key(), report.into()).await.unwrap();
    n2_reads_everything_from_n1(stack, &token, &version, &files).await;
}

/// Waits until the board says n1 holds every one of `pieces` pieces of `swarm`.
async fn n1_serving_every_piece(
    board: &async_nats::jetstream::kv::Store,
    swarm: &str,
    pieces: usize,
    what: &str,
) {
    wait_for(WAIT, what, || async {
        (holdings(board, swarm).await.get("n1") == Some(&pieces)).then_some(())
    })
    .await
    .unwrap();
}

/// Starts n2's agent and stages the version there: byte-exact, every byte fetched from n1 and
/// none read from the hot tier. Stops the stack.
async fn n2_reads_everything_from_n1(
    mut stack: Stack,
    token: &Path,
    version: &str,
    files: &[(String, Vec<u8>)],
) {
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    let shared = || counter("stagehand_fanout_bytes_total", "source=\"shared\"");
    let peer = || counter("stagehand_fanout_bytes_total", "source=\"peer\"");
    let (shared_before, peer_before) = (shared(), peer());
    start_agent(&mut stack, "n2", token);
    stage_on(&stack, version, &["n2"]).await;
    assert_exact(&stack, "n2", version, files);
    assert_eq!(shared() - shared_before, 0.0, "n2 read from the hot tier");
    assert_eq!(
        peer() - peer_before,
        total as f64,
        "n2 fetched every byte from n1"
    );
    stack.stop().await;
}

/// A copy whose fingerprint record is gone is not served as its agent starts (nothing says it
/// is intact without reading it); once a job asks for it there, the request's check verifies
/// it by hash, records its fingerprint and answers ready, and the copy is served to its swarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_with_no_fingerprint_is_served_once_a_job_has_it_verified() {
    let (mut stack, token, (version, _files, refs)) = staged_on_n1().await;
    let (board, swarm, pieces) = board_of(&stack, &version, &refs).await;
    let pieces = pieces.len();
    let prefix = stagehand_schemas::layout::version_folder(PROJECT, DATASET, &version);
    let promoter_kv = (stack.bus.jetstream())
        .get_key_value("stagehand_promoter")
        .await
        .unwrap();
    let print = stagehand_bus::placement::fingerprint_key("local", Some("n1"), &prefix);
    promoter_kv.delete(&print).await.unwrap();
    restart_n1_unannounced(&mut stack, &token, &board, &swarm, pieces).await;
    stage_for(&stack, &version, &["n1"], "job-2").await;
    n1_serving_every_piece(
        &board,
        &swarm,
        pieces,
        "n1 serving its replica once a job had it verified",
    )
    .await;
    let recorded =
        stagehand_bus::placement::fingerprint(&promoter_kv, "local", Some("n1"), &prefix)
            .await
            .unwrap();
    assert!(
        recorded.is_some(),
        "the job's check recorded the copy's fingerprint"
    );
    stack.stop().await;
}

/// Stops n1's agent, takes back every piece of `swarm` it announced (as its restart would,
/// so that what the board says afterwards is the restarted agent's own word), and starts it
/// again.
async fn restart_n1_unannounced(
    stack: &mut Stack,
    token: &Path,
    board: &async_nats::jetstream::kv::Store,
    swarm: &str,
    pieces: usize,
) {
    use futures::StreamExt;
    assert_eq!(holdings(board, swarm).await.get("n1"), Some(&pieces));
    stack.stop_service(&agent("n1")).await;
    let keys: Vec<String> = (board.keys().await.unwrap())
        .filter_map(|k| async move { k.ok() })
        .filter(|k| std::future::ready(k.ends_with(".n1")))
        .collect()
        .await;
    assert_eq!(keys.len(), pieces, "{keys:?}");
    for key in keys {
        board.delete(&key).await.unwrap();
    }
    assert!(!holdings(board, swarm).await.contains_key("n1"));
    start_agent(stack, "n1", token);
}

/// Per node, how many pieces of `swarm` the board says it holds.
async fn holdings(
    board: &async_nats::jetstream::kv::Store,
    swarm: &str,
) -> std::collections::BTreeMap<String, usize> {
    use futures::StreamExt;
    let keys: Vec<String> = board
        .keys()
        .await
        .unwrap()
        .filter_map(|k| async move { k.ok() })
        .collect()
        .await;
    let mut held = std::collections::BTreeMap::new();
    for key in keys {
        if let Some(node) = key
            .strip_prefix(&format!("swarm.{swarm}.have."))
            .and_then(|rest| rest.split_once('.'))
            .map(|(_, node)| node.to_owned())
        {
            *held.entry(node).or_default() += 1;
        }
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_serving_damaged_bytes_is_dropped_reports_its_copy_and_every_node_still_ends_exact()
{
    let (mut stack, token, (version, files, refs)) = staged_on_n1().await;
    // n1's copy rots on its disk after it was verified: one byte of every file flipped.
    let folder = local_root(&stack, "n1").join(format!("{PROJECT}/{DATASET}/{version}"));
    for (name, _) in &files {
        let path = folder.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[0] ^= 0xff;
        let mode = std::fs::metadata(&path).unwrap().permissions();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, mode).unwrap();
    }
    for n in ["n2", "n3"] {
        start_agent(&mut stack, n, &token);
    }
    stage_on(&stack, &version, &["n2", "n3"]).await;
    for n in ["n2", "n3"] {
        assert_exact(&stack, n, &version, &files);
    }
    assert!(counter("stagehand_fanout_peers_dropped_total", "") >= 1.0);
    let (board, swarm, _) = board_of(&stack, &version, &refs).await;
    let spoiled = wait_for(WAIT, "n1 reported", || async {
        // Reported by whichever of n2 and n3 caught it, in its own name.
        let mut keys = board.keys().await.ok()?;
        while let Some(Ok(key)) = keys.next().await {
            if BadKey::parse(&key)
                .is_some_and(|k| k.swarm == swarm && k.node == "n1" && ["n2", "n3"].contains(&k.by))
            {
                return board.get(&key).await.ok().flatten();
            }
        }
        None
    })
    .await
    .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&spoiled).unwrap();
    assert!(
        report["why"].as_str().unwrap().contains("hashes to"),
        "{report}"
    );
    // n1 hashed the file it was reported for, found its own copy damaged, and withdrew it;
    // its first job still holds it, so its agent repaired it from hot at once, no request
    // needed (`promoter/repair.rs`).
    let js = stack.bus.jetstream().clone();
    let (damaged, repaired) = wait_for(WAIT, "n1's copy withdrawn, then repaired", || async {
        let facts = stagehand_testkit::stored_events(
            &js,
            stagehand_schemas::subject::FACTS.name,
            "stagehand.fact.replica.>",
        )
        .await
        .ok()?;
        let on_n1 = |tier: &str, node: &Option<String>| tier == "local" && node.as_deref() == Some("n1");
        let damaged = facts.iter().position(|e| {
            matches!(&e.body, Body::ReplicaDamaged(d) if on_n1(&d.location.tier, &d.node) && d.found_by == "hash")
        })?;
        let repaired = facts.iter().position(|e| {
            matches!(&e.body, Body::ReplicaRepaired(r) if on_n1(&r.location.tier, &r.node) && r.from_tier == "hot")
        })?;
        Some((damaged, repaired))
    })
    .await
    .unwrap();
    assert!(damaged < repaired, "withdrawn first, then repaired");
    assert_exact(&stack, "n1", &version, &files);
    stage_for(&stack, &version, &["n1"], "next-job").await;
    assert_exact(&stack, "n1", &version, &files);
    // Nothing n1 served reached the others: they hold the source's bytes (above), and no
    // file of theirs was left half-written.
    for n in ["n2", "n3"] {
        let left = leftovers(&local_root(&stack, n));
        assert!(left.is_empty(), "{n} kept {left:?}");
    }
    stack.stop().await;
}

/// Stagehand's temporaries (temp files, staging folders) anywhere beneath `dir`.
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_name().to_string_lossy().contains(".stagehand-") {
            found.push(path.clone());
        }
        if path.is_dir() {
            found.extend(leftovers(&path));
        }
    }
    found
}
