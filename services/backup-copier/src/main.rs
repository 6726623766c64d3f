//! `stagehand-backup-copier --config FILE`: the backup copier under the service runner.

fn main() -> std::process::ExitCode {
    stagehand_bus::runner::main(
        stagehand_backup_copier::SERVICE,
        stagehand_backup_copier::serve,
    )
}
