//! `stagehand-ingest-validator`: flags and environment in, [`stagehand_ingest_validator::run`].

use clap::Parser;
use stagehand_ingest_validator::{Config, SERVICE, run};

/// Validates ingest requests: reads every file of every upload and publishes
/// dataset.validated or dataset.rejected.
#[derive(Debug, Parser)]
#[command(name = "stagehand-ingest-validator", version)]
struct Args {
    /// NATS server URL(s), comma separated.
    #[arg(
        long,
        env = "STAGEHAND_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// NATS credentials file for this service's user.
    #[arg(long, env = "STAGEHAND_NATS_CREDS")]
    nats_creds: Option<std::path::PathBuf>,
    /// The policy folder.
    #[arg(long, env = "STAGEHAND_POLICIES", default_value = "policies")]
    policies: std::path::PathBuf,
    /// Where the service keeps its ledger.
    #[arg(long, env = "STAGEHAND_STATE_DIR", default_value = ".stagehand/state")]
    state_dir: std::path::PathBuf,
    /// Files hashed at once within one request.
    #[arg(long, env = "STAGEHAND_READ_CONCURRENCY", default_value_t = 8)]
    read_concurrency: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = stagehand_telemetry::init(SERVICE)?;
    let mut config = Config::new(args.nats_url, args.policies, args.state_dir);
    config.bus.creds_file = args.nats_creds;
    config.read_concurrency = args.read_concurrency;
    let shutdown = stagehand_bus::CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        on_signal.cancel();
    });
    let stats = run(config, shutdown).await?;
    tracing::info!(?stats, "ingest validator stopped");
    Ok(())
}
