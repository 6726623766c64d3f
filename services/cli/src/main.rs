//! `stagehand`: see `stagehand --help`.

use clap::Parser;

#[tokio::main]
async fn main() {
    let args = stagehand::cli::Cli::parse();
    let code = match stagehand::cli::run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            2
        }
    };
    std::process::exit(code);
}
