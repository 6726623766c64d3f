//! The `stagehand-ingest-validator` binary as operators run it: `--config FILE` under the
//! service runner, against a real nats-server, its `/metrics` scraped by a real Prometheus
//! (Debian's package), stopped by SIGTERM; and a broken configuration refused with exit 78.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, ensure};
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::{
    Body, Event, EventId, FileRef, IngestRequested, Location, sha256_hex, subject, wire,
};
use stagehand_testkit::{NatsServer, PolicyFiles, Prometheus, ServiceProcess, wait_for};

const WAIT: Duration = Duration::from_secs(60);

/// A loopback address nothing listens on right now, for the metrics endpoint.
fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The binary with its Stagehand environment cleared, so that only the file (and `home`)
/// counts.
fn validator(config: &Path, home: &Path, stderr: &Path) -> ServiceProcess {
    let home = home.display().to_string();
    ServiceProcess::spawn(
        env!("CARGO_BIN_EXE_stagehand-ingest-validator"),
        config,
        stderr,
        &[("STAGEHAND_HOME", &home), ("RUST_LOG", "info")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_validators_handler_metrics() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir()?;
    let home = tmp.path().join("home");
    let policies = tmp.path().join("policies");
    // The shipped policies, every posix tier beneath `home`.
    PolicyFiles::new()
        .shipped("tiers.toml")
        .shipped("validation.toml")
        .write(&policies);
    let metrics = free_addr()?;
    let config = tmp.path().join("ingest-validator.toml");
    std::fs::write(
        &config,
        format!(
            "[bus]\n# A comma-separated list whose first server is down.\nservers = \"nats://127.0.0.1:1,{}\"\n\n[worker]\nconcurrency = 2\n\n[telemetry]\nmetrics_listen = \"{metrics}\"\n\n[service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\n",
            nats.url(),
            policies.display(),
            tmp.path().join("state").display()
        ),
    )?;
    // One upload on the source tier (the tier root exists before the service opens it).
    let root = home.join("tiers/source/demo/metrics");
    std::fs::create_dir_all(&root)?;
    std::fs::write(root.join("a.txt"), b"scraped")?;
    let stderr = tmp.path().join("validator.stderr");
    let mut child = validator(&config, &home, &stderr);
    let log = || std::fs::read_to_string(&stderr).unwrap_or_default();

    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    bus.provision().await?;
    let request = Event::request(
        EventId::new("metrics-1")?,
        "demo",
        Body::IngestRequested(IngestRequested {
            dataset: "metrics".into(),
            source: Location {
                tier: "source".into(),
                prefix: "demo/metrics".into(),
            },
            files: vec![FileRef::new("a.txt", 7, sha256_hex(b"scraped"))],
            manifest: None,
            requested_by: "tester".into(),
            labels: Vec::new(),
        }),
    );
    let mut verdicts = bus
        .client()
        .subscribe(subject::kind_filter("fact", "dataset.validated"))
        .await?;
    bus.publish(&request).await?;
    let fact = tokio::time::timeout(WAIT, verdicts.next())
        .await
        .with_context(|| format!("no verdict within {WAIT:?}\n{}", log()))?
        .context("subscription closed")?;
    let fact = wire::decode(&fact.payload)?;
    ensure!(fact.correlation_id.as_str() == "metrics-1", "{fact:?}");

    // Prometheus scrapes the binary's endpoint and answers for the handler's one success.
    let prometheus = Prometheus::start(&[metrics]);
    let value = wait_for(WAIT, "Prometheus to have scraped the handler counter", || {
        let answer = prometheus.query(
            r#"stagehand_handler_calls_total{job="stagehand",service="ingest-validator",result="ok"}"#,
        );
        async move {
            let series = answer.ok()?;
            let [one] = series.as_slice() else { return None };
            one["value"][1].as_str().map(str::to_owned)
        }
    })
    .await
    .with_context(|| format!("targets up: {:?}\n{}", prometheus.targets_up(), log()))?;
    assert_eq!(value, "1", "exactly one handled request");
    let verdicts = prometheus
        .query(r#"stagehand_ingest_verdicts_total{outcome="validated"}"#)
        .map_err(anyhow::Error::msg)?;
    assert_eq!(verdicts.len(), 1, "{verdicts:?}");
    assert_eq!(verdicts[0]["value"][1], "1", "{verdicts:?}");
    let info = prometheus
        .query(r#"stagehand_service_info{service="ingest-validator"}"#)
        .map_err(anyhow::Error::msg)?;
    assert_eq!(info.len(), 1, "{info:?}");
    assert_eq!(info[0]["value"][1], "1", "{info:?}");
    assert_eq!(
        info[0]["metric"]["version"],
        env!("CARGO_PKG_VERSION"),
        "{info:?}"
    );

    // SIGTERM drains and exits 0.
    let pid = rustix::process::Pid::from_child(child.child());
    rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
    let status = wait_for(WAIT, "the validator to exit after SIGTERM", || {
        let status = child.child().try_wait().ok().flatten();
        async move { status }
    })
    .await?;
    assert!(status.success(), "{status}\n{}", log());
    assert!(log().contains("draining"), "{}", log());
    Ok(())
}

/// One alert of the shipped rules (`deploy/prometheus/alerts.rules.yml`) made to fire by a real
/// Prometheus scraping the real binary: `StagehandServiceSilent` stays quiet while the
/// validator answers and fires once it has been stopped for the alert's minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_service_silent_alert_fires_when_the_validator_stops() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir()?;
    let home = tmp.path().join("home");
    let policies = tmp.path().join("policies");
    PolicyFiles::new()
        .shipped("tiers.toml")
        .shipped("validation.toml")
        .write(&policies);
    std::fs::create_dir_all(home.join("tiers/source"))?;
    let metrics = free_addr()?;
    let config = tmp.path().join("ingest-validator.toml");
    std::fs::write(
        &config,
        format!(
            "[bus]\nservers = \"{}\"\n\n[telemetry]\nmetrics_listen = \"{metrics}\"\n\n[service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\n",
            nats.url(),
            policies.display(),
            tmp.path().join("state").display()
        ),
    )?;
    let stderr = tmp.path().join("validator.stderr");
    let mut child = validator(&config, &home, &stderr);
    let log = || std::fs::read_to_string(&stderr).unwrap_or_default();
    let rules = stagehand_testkit::repo_root().join("deploy/prometheus");
    let prometheus = Prometheus::start_with_rules(
        &[metrics],
        &[
            rules.join("recording.rules.yml"),
            rules.join("alerts.rules.yml"),
        ],
    );
    wait_for(WAIT, "Prometheus to scrape the validator", || {
        let up = prometheus.targets_up();
        async move { up.ok().filter(|up| *up) }
    })
    .await
    .with_context(log)?;
    let silent = r#"ALERTS{alertname="StagehandServiceSilent"}"#;
    let quiet = prometheus.query(silent).map_err(anyhow::Error::msg)?;
    assert!(
        quiet.is_empty(),
        "an answering service is not silent: {quiet:?}"
    );

    let pid = rustix::process::Pid::from_child(child.child());
    rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
    wait_for(WAIT, "the validator to exit after SIGTERM", || {
        let status = child.child().try_wait().ok().flatten();
        async move { status }
    })
    .await?;
    // The alert's `for: 1m` after the first failed scrape, and an evaluation to notice.
    let firing = wait_for(
        Duration::from_secs(150),
        "StagehandServiceSilent to fire",
        || {
            let alerts = prometheus
                .query(r#"ALERTS{alertname="StagehandServiceSilent",alertstate="firing"}"#);
            async move { alerts.ok().filter(|a| !a.is_empty()) }
        },
    )
    .await
    .with_context(|| format!("alerts: {:?}", prometheus.query(silent)))?;
    assert_eq!(firing.len(), 1, "{firing:?}");
    assert_eq!(
        firing[0]["metric"]["instance"],
        metrics.to_string(),
        "{firing:?}"
    );
    assert_eq!(firing[0]["metric"]["severity"], "page", "{firing:?}");
    Ok(())
}

#[test]
fn a_configuration_error_exits_78_naming_the_file_and_key() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let config = tmp.path().join("ingest-validator.toml");
    std::fs::write(
        &config,
        "[bus]\nservers = [\"nats://127.0.0.1:1\"]\n\n[service]\npolicies_dir = \"/p\"\nstate_dir = \"/s\"\nread_concurency = 3\n",
    )?;
    let stderr = tmp.path().join("stderr");
    let mut child = validator(&config, tmp.path(), &stderr);
    let status = child.child().wait()?;
    let said = std::fs::read_to_string(&stderr)?;
    assert_eq!(status.code(), Some(78), "{said}");
    assert!(
        said.contains(&format!(
            "{}:7: `service.read_concurency`",
            config.display()
        )),
        "{said}"
    );

    let missing = Command::new(env!("CARGO_BIN_EXE_stagehand-ingest-validator")).output()?;
    assert_eq!(missing.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--config FILE is required"));
    Ok(())
}
