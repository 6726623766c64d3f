//! `stagehand-mover-cp`: `stagehand cp` as a standalone binary (for benchmarks and the crash
//! test, which needs a real process to kill).

use clap::Parser;

/// Copy files between posix and S3 tiers, verified and atomically.
#[derive(Debug, Parser)]
#[command(name = "stagehand-mover-cp")]
struct Cli {
    #[command(flatten)]
    args: stagehand_mover::cp::CpArgs,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    match stagehand_mover::cp::run_cp(cli.args).await {
        Ok(summary) => std::process::exit(summary.exit_code()),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
