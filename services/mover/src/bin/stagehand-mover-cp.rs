//! `stagehand-mover-cp`: the mover's recursive copy as a process of its own, for the tests
//! that must kill a real copy with SIGKILL and for the benchmarks (which then do not build the
//! whole CLI). It parses no flags: its one argument is a [`CpOptions`] as JSON, e.g.
//! `stagehand-mover-cp '{"src":"a","dst":"b","recursive":true}'` (`stagehand cp` is the
//! command people run). It prints the summary as JSON and exits 0 when every file is in
//! place, 1 when any failed, 2 when the copy could not start.

use stagehand_mover::Progress;
use stagehand_mover::cp::{CpOptions, run_cp};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [json] = args.as_slice() else {
        eprintln!("usage: stagehand-mover-cp '<CpOptions as JSON>'");
        std::process::exit(2);
    };
    let opts: CpOptions = match serde_json::from_str(json) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: the options are not a CpOptions: {e}");
            std::process::exit(2);
        }
    };
    match run_cp(&opts, &Progress::new()).await {
        Ok(summary) => {
            println!(
                "{}",
                serde_json::to_string(&summary).expect("a summary serialises")
            );
            std::process::exit(summary.exit_code());
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
