//! `stagehand-promoter --config FILE`: the promoter (or, with `node = "<name>"` in its
//! `[service]` table, the node agent of that node) under the service runner.

// The workers' futures nest the promoter's handlers (a copy's fan-out among them): a release
// build computes their layout deeper than the default limit (128) allows.
#![recursion_limit = "256"]

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(stagehand_promoter::SERVICE, stagehand_promoter::serve)
}
