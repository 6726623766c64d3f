//! Node agents' liveness records under the shipped permissions (`deploy/nats/accounts.conf`):
//! the promoter's user writes a node's record, the demoter's user reads it (with the time the
//! server stored it) and may not write it — so the service that decides a node is silent cannot
//! make one look alive or dead — and a scheduler, a tenant's neighbour, reaches none of it.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use stagehand_bus::placement::{beat, liveness, liveness_key};
use stagehand_bus::{Bus, BusConfig, PROMOTER, PROMOTER_BUCKET};
use stagehand_testkit::{NatsServer, user_url};

async fn connect(server: &NatsServer, user: &str, role: &str) -> Result<Bus> {
    let mut cfg = BusConfig::new(user_url(server, user, role));
    cfg.provision = false;
    cfg.connect_timeout = Duration::from_secs(10);
    Bus::connect(&cfg)
        .await
        .with_context(|| format!("connecting as {user}"))
}

#[tokio::test]
async fn the_promoter_writes_a_nodes_liveness_and_the_demoter_only_reads_it() -> Result<()> {
    let server = NatsServer::builder()
        .shipped_accounts_with_projects(&["labb"])
        .start();
    let mut cfg = BusConfig::new(user_url(&server, "operator", "OPERATOR"));
    cfg.connect_timeout = Duration::from_secs(10);
    let operator = Bus::connect(&cfg).await?;
    operator.provision().await?;
    operator.provision_kv(&PROMOTER).await?;

    let promoter = connect(&server, "promoter", "PROMOTER").await?;
    let store = promoter.jetstream().get_key_value(PROMOTER_BUCKET).await?;
    beat(&store, "gpu-07", Duration::from_secs(1)).await?;

    let demoter = connect(&server, "demoter", "DEMOTER").await?;
    let seen = demoter.jetstream().get_key_value(PROMOTER_BUCKET).await?;
    let record = liveness(&seen, "gpu-07")
        .await?
        .context("the demoter sees no liveness record")?;
    let age = time::OffsetDateTime::now_utc() - record.stored_at;
    ensure!(age.whole_seconds().abs() < 10, "{record:?}");
    ensure!(record.node == "gpu-07", "{record:?}");
    ensure!(
        liveness(&seen, "gpu-08").await?.is_none(),
        "a node that never beat has a record"
    );
    // The demoter may not write one (a node kept alive, or its record removed).
    let key = liveness_key("gpu-07");
    let put = tokio::time::timeout(
        Duration::from_secs(10),
        seen.put(
            &key,
            br#"{"node":"gpu-07","every_seconds":1}"#.to_vec().into(),
        ),
    )
    .await;
    ensure!(
        !matches!(put, Ok(Ok(_))),
        "the demoter wrote a node's liveness record"
    );
    let after = liveness(&store, "gpu-07").await?.context("record gone")?;
    ensure!(
        after.stored_at == record.stored_at,
        "{after:?} after {record:?}"
    );

    // A scheduler reaches no part of the promoter's bucket.
    let scheduler = connect(&server, "scheduler", "SCHEDULER").await?;
    let reached = tokio::time::timeout(
        Duration::from_secs(10),
        scheduler.jetstream().get_key_value(PROMOTER_BUCKET),
    )
    .await;
    ensure!(
        !matches!(reached, Ok(Ok(_))),
        "the scheduler opened the promoter's bucket"
    );
    Ok(())
}
