//! `stagehand-demoter --config FILE`: the demoter on the service runner.

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(stagehand_demoter::SERVICE, stagehand_demoter::serve)
}
