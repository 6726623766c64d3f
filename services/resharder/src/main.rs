//! `stagehand-resharder --config FILE`: the resharder under the service runner.

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(stagehand_resharder::SERVICE, stagehand_resharder::serve)
}
