//! `stagehand-catalogue-recorder --config FILE`: the recorder under the service runner.

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(
        stagehand_catalogue_recorder::SERVICE,
        stagehand_catalogue_recorder::serve,
    )
}
