//! `stagehand`: see `stagehand --help`.
//!
//! Exit codes: what the command answers (0, and for some 1, 2 or 3: see each command's help), 64
//! for a bad argument, 69 when NATS cannot be reached in time, 70 for any other error; an error
//! is one line on stderr.

use clap::Parser;
use clap::error::ErrorKind;
use stagehand::args::{EX_USAGE, error_line, exit_code};

#[tokio::main]
async fn main() {
    let args = match stagehand::cli::Cli::try_parse() {
        Ok(args) => args,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            let _ = e.print();
            std::process::exit(0);
        }
        Err(e) if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            std::process::exit(EX_USAGE);
        }
        Err(e) => {
            eprintln!("{}", stagehand::cli::clap_error_line(&e));
            std::process::exit(EX_USAGE);
        }
    };
    let code = match stagehand::cli::run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{}", error_line(&e));
            exit_code(&e)
        }
    };
    std::process::exit(code);
}
