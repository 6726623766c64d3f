//! `stagehand-catalogue-recorder`: runs one catalogue recorder until Ctrl-C or SIGTERM.
//!
//! Usage: `stagehand-catalogue-recorder [--nats URL] [--dir DIR] [--instance NAME]`
//! (defaults: `$NATS_URL` or `nats://127.0.0.1:4222`, `$STAGEHAND_HOME/catalogue`).

use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue_recorder::{RecorderConfig, run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = stagehand_telemetry::init("catalogue-recorder")?;
    let mut url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let home = std::env::var("STAGEHAND_HOME").unwrap_or_else(|_| ".stagehand".into());
    let mut config = RecorderConfig::under(std::path::Path::new(&home).join("catalogue"));
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--nats" => url = value()?,
            "--dir" => {
                config = RecorderConfig {
                    instance: config.instance.clone(),
                    ..RecorderConfig::under(value()?)
                }
            }
            "--instance" => config.instance = value()?,
            other => anyhow::bail!(
                "unknown argument {other:?}; usage: stagehand-catalogue-recorder [--nats URL] [--dir DIR] [--instance NAME]"
            ),
        }
    }
    let bus = Bus::connect(&BusConfig::new(url)).await?;
    bus.provision().await?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        stop.cancel();
    });
    let stats = run(bus, config, shutdown).await?;
    tracing::info!(?stats, "catalogue recorder stopped");
    Ok(())
}
