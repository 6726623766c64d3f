//! `stagehand-ingest-validator --config FILE`: the validator under the service runner.

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(
        stagehand_ingest_validator::SERVICE,
        stagehand_ingest_validator::serve,
    )
}
