//! A three-node JetStream cluster that loses a node in the middle of a stream of ingests, with
//! the ingest validator and the catalogue recorder running as `stagehand up --external-nats`
//! runs them against the comma-separated list of every node: every stream and bucket has three
//! replicas (learned from the cluster, and drift corrected), every request ends validated and
//! catalogued exactly once, and the restarted node catches up.

use std::time::Duration;

use anyhow::Context;
use futures::TryStreamExt;
use stagehand::ingest::{IngestOptions, ingest};
use stagehand::up::{Stack, UpOptions};
use stagehand_bus::{Bus, BusConfig, KV_BUCKETS};
use stagehand_catalogue::{Answer, MAX_PAGE, Query, ask};
use stagehand_schemas::subject;
use stagehand_testkit::{NatsCluster, wait_for, wait_until};

const WAIT: Duration = Duration::from_secs(90);
const REQUESTS: usize = 24;
const KILL_AFTER: usize = 8;

async fn stream_replicas(bus: &Bus, name: &str) -> anyhow::Result<usize> {
    let mut s = bus.jetstream().get_stream(name).await?;
    Ok(s.info().await?.config.num_replicas)
}

/// Messages on `subject` in `stream`.
async fn count_on(bus: &Bus, stream: &str, subject: &str) -> anyhow::Result<u64> {
    let s = bus.jetstream().get_stream(stream).await?;
    let subjects: std::collections::HashMap<String, usize> =
        s.info_with_subjects(subject).await?.try_collect().await?;
    Ok(subjects.values().map(|n| *n as u64).sum())
}

/// Whether every replica of `stream` is current with no lag (a restarted node caught up).
async fn all_replicas_current(bus: &Bus, stream: &str) -> bool {
    let Ok(mut s) = bus.jetstream().get_stream(stream).await else {
        return false;
    };
    let Ok(info) = s.info().await else {
        return false;
    };
    let Some(cluster) = &info.cluster else {
        return false;
    };
    cluster.leader.is_some()
        && cluster.replicas.len() == 2
        && cluster
            .replicas
            .iter()
            .all(|p| p.current && !p.offline && p.lag.unwrap_or(0) == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_node_loses_no_request_and_the_node_catches_up() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
    let mut cluster = NatsCluster::start(3);
    let servers = cluster.urls().join(",");
    let bus_cfg = BusConfig::new(&servers);
    assert_eq!(bus_cfg.servers.len(), 3);

    // Mistakes to correct: the facts log, the claims bucket and the manifest bucket created
    // with one replica.
    let bus = Bus::connect(&bus_cfg).await?;
    assert_eq!(bus.replicas(), 3, "replicas learned from the cluster");
    // A cluster just formed on a loaded machine may take longer than the client's default 5 s
    // to answer its first stream creations.
    let mut js = bus.jetstream().clone();
    js.set_timeout(Duration::from_secs(30));
    js.create_stream(stagehand_bus::stream_config(&subject::FACTS, 1))
        .await?;
    js.create_key_value(async_nats::jetstream::kv::Config {
        bucket: stagehand_bus::CLAIMS_BUCKET.into(),
        history: 1,
        num_replicas: 1,
        ..Default::default()
    })
    .await?;
    js.create_object_store(async_nats::jetstream::object_store::Config {
        bucket: subject::MANIFEST_BUCKET.into(),
        num_replicas: 1,
        ..Default::default()
    })
    .await?;
    assert_eq!(stream_replicas(&bus, subject::FACTS.name).await?, 1);
    assert_eq!(stream_replicas(&bus, "KV_stagehand_claims").await?, 1);
    assert_eq!(stream_replicas(&bus, "OBJ_stagehand_manifests").await?, 1);

    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(bus_cfg.clone()),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    for spec in subject::STREAMS {
        assert_eq!(stream_replicas(&bus, spec.name).await?, 3, "{}", spec.name);
    }
    for kv in KV_BUCKETS {
        let name = format!("KV_{}", kv.bucket);
        assert_eq!(stream_replicas(&bus, &name).await?, 3, "{name}");
    }
    for bucket in stagehand_bus::OBJECT_BUCKETS {
        let name = bucket.stream_name();
        assert_eq!(stream_replicas(&bus, &name).await?, 3, "{name}");
    }

    // A stream of ingests, one node killed a third of the way through.
    let folders = tempfile::tempdir()?;
    let mut ids = Vec::new();
    for i in 0..REQUESTS {
        if i == KILL_AFTER {
            cluster.node_mut(0).kill();
        }
        let folder = folders.path().join(format!("d{i}"));
        std::fs::create_dir_all(&folder)?;
        std::fs::write(
            folder.join("data.bin"),
            format!("request {i}\n").repeat(i + 1),
        )?;
        let opts = IngestOptions {
            source: folder.to_str().expect("a UTF-8 temp path").to_owned(),
            in_place: false,
            project: "lab-c".into(),
            dataset: format!("ds-{i}"),
            tier: "source".into(),
            policies: stack.env.policies.clone(),
            requested_by: "tester".into(),
            labels: vec![],
            manifest: None,
            wait: None,
            progress: false,
            clock_skew: stagehand::ingest::CLOCK_SKEW,
            spool: None,
        };
        // While the cluster elects new leaders a publish can fail; the same content is the same
        // request id, so trying again is safe (the duplicate window drops a second copy).
        let report = wait_for(WAIT, "the request to be published", || {
            let bus = &bus;
            let opts = &opts;
            async move { ingest(bus, opts).await.ok() }
        })
        .await?;
        ids.push(report.request.id.clone());
    }

    // Every request validated exactly once, and in the catalogue once.
    let validated = "stagehand.fact.dataset.validated.lab-c";
    wait_until(WAIT, "every request validated", || async {
        count_on(&bus, subject::FACTS.name, validated)
            .await
            .is_ok_and(|n| n >= REQUESTS as u64)
    })
    .await?;
    assert_eq!(
        count_on(&bus, subject::FACTS.name, validated).await?,
        REQUESTS as u64,
        "one validation per request"
    );
    assert_eq!(
        count_on(
            &bus,
            subject::FACTS.name,
            "stagehand.fact.dataset.rejected.lab-c"
        )
        .await?,
        0
    );
    assert_eq!(
        count_on(
            &bus,
            subject::REQUESTS.name,
            "stagehand.req.ingest.requested.lab-c"
        )
        .await?,
        REQUESTS as u64,
        "one request each"
    );
    let client = bus.client().clone();
    wait_until(WAIT, "every dataset catalogued with one version", || {
        let client = client.clone();
        async move {
            match ask(
                &client,
                &Query::Datasets {
                    project: Some("lab-c".into()),
                    limit: Some(MAX_PAGE),
                    after: None,
                },
                Duration::from_secs(5),
            )
            .await
            {
                Ok(Answer::Datasets { datasets, .. }) => {
                    datasets.len() == REQUESTS && datasets.iter().all(|d| d.version_count == 1)
                }
                _ => false,
            }
        }
    })
    .await?;

    // The killed node comes back and catches up with every stream.
    cluster.node_mut(0).restart();
    for spec in subject::STREAMS {
        wait_until(
            WAIT,
            &format!("{} current on every node", spec.name),
            || all_replicas_current(&bus, spec.name),
        )
        .await
        .with_context(|| spec.name)?;
    }
    stack.stop().await?;
    Ok(())
}
