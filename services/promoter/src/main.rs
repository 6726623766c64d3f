//! `stagehand-promoter --config FILE`: the promoter (or, with `node = "<name>"` in its
//! `[service]` table, the node agent of that node) under the service runner.

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(stagehand_promoter::SERVICE, stagehand_promoter::serve)
}
