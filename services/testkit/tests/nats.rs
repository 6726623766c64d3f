//! The NATS helpers start real servers: one accepts JetStream work, a restarted one keeps its
//! streams, and a three-node cluster takes a replicated stream.

use std::time::Duration;

use anyhow::Result;
use async_nats::jetstream::{self, stream};
use stagehand_testkit::{NatsCluster, NatsServer, unique_name, wait_for};

#[tokio::test]
async fn server_starts_with_jetstream_on_a_dynamic_port() -> Result<()> {
    let server = NatsServer::start();
    assert_ne!(server.port(), 0);
    assert_eq!(server.url(), format!("nats://127.0.0.1:{}", server.port()));

    let js = jetstream::new(async_nats::connect(server.url()).await?);
    let name = unique_name("START");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec!["start.>".into()],
        ..Default::default()
    })
    .await?;
    let ack = js.publish("start.one", "hello".into()).await?.await?;
    assert_eq!(ack.stream, name);
    assert!(server.store_dir().join("jetstream").is_dir());
    Ok(())
}

/// A server bound to every address is dialled on loopback, and its monitoring answers there.
#[tokio::test]
async fn a_server_bound_to_every_address_is_reached_on_loopback() -> Result<()> {
    let server = NatsServer::builder()
        .bind(std::net::Ipv4Addr::UNSPECIFIED)
        .start();
    assert_eq!(server.url(), format!("nats://127.0.0.1:{}", server.port()));
    let client = async_nats::connect(server.url()).await?;
    client.flush().await?;
    let addr: std::net::SocketAddr = server.monitor_addr().parse()?;
    let (status, _) = stagehand_testkit::http_get_at(addr, "/healthz")?;
    assert_eq!(status, 200);
    Ok(())
}

#[tokio::test]
async fn two_servers_get_different_ports_and_stores() {
    let a = NatsServer::start();
    let b = NatsServer::start();
    assert_ne!(a.port(), b.port());
    assert_ne!(a.store_dir(), b.store_dir());
}

#[tokio::test]
async fn restart_after_kill_keeps_port_and_jetstream_data() -> Result<()> {
    let mut server = NatsServer::start();
    let port = server.port();
    let name = unique_name("DURABLE");
    {
        let js = jetstream::new(async_nats::connect(server.url()).await?);
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec!["durable.>".into()],
            ..Default::default()
        })
        .await?;
        for i in 0..3 {
            js.publish(format!("durable.{i}"), "x".into())
                .await?
                .await?;
        }
    }

    server.kill();
    assert!(!server.is_running());
    server.restart();
    assert!(server.is_running());
    assert_eq!(server.port(), port);

    let js = jetstream::new(async_nats::connect(server.url()).await?);
    // JetStream recovers its streams from the store while it starts.
    let messages = wait_for(Duration::from_secs(10), "the stream after restart", || {
        let js = js.clone();
        let name = name.clone();
        async move {
            let mut s = js.get_stream(&name).await.ok()?;
            Some(s.info().await.ok()?.state.messages)
        }
    })
    .await?;
    assert_eq!(messages, 3);
    Ok(())
}

#[tokio::test]
async fn drop_removes_the_store() {
    let server = NatsServer::start();
    let store = server.store_dir();
    assert!(store.is_dir());
    drop(server);
    assert!(!store.exists());
}

#[tokio::test]
async fn cluster_of_three_creates_a_replicated_stream() -> Result<()> {
    let cluster = NatsCluster::start(3);
    let urls = cluster.urls();
    assert_eq!(urls.len(), 3);

    let js = jetstream::new(async_nats::connect(cluster.server_addrs().as_slice()).await?);
    let name = unique_name("R3");
    let mut created = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec!["r3.>".into()],
            num_replicas: 3,
            ..Default::default()
        })
        .await?;
    js.publish("r3.one", "x".into()).await?.await?;
    let info = created.info().await?;
    assert_eq!(info.config.num_replicas, 3);
    let cluster_info = info
        .cluster
        .clone()
        .expect("a clustered stream has cluster info");
    assert_eq!(cluster_info.replicas.len(), 2, "{cluster_info:?}");
    assert_eq!(info.state.messages, 1);
    Ok(())
}

/// Regression: the server's default max_payload (1 MB) refused events under Stagehand's own
/// 8 MiB bound; test servers run with deploy/nats/dev.conf like development servers do.
#[tokio::test]
async fn server_accepts_events_up_to_the_stagehand_bound() -> Result<()> {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await?;
    assert!(client.server_info().max_payload >= stagehand_schemas::wire::MAX_DEAD_LETTER_BYTES);
    let js = jetstream::new(client);
    let name = unique_name("BIG");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec!["big.>".into()],
        ..Default::default()
    })
    .await?;
    let payload = vec![7u8; stagehand_schemas::wire::MAX_EVENT_BYTES];
    let ack = js.publish("big.one", payload.into()).await?.await?;
    assert_eq!(ack.stream, name);
    Ok(())
}
