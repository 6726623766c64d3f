//! `stagehand policy check DIR`: every policy file in a folder parsed and validated by the
//! same code a service runs at start (`stagehand_policy`), with nothing connected and nothing
//! created, so that an edit is checked before the services are restarted with it.
//!
//! Every problem is printed, one per line, each exactly as a service would refuse to start with
//! it (file, line, key, what is wrong), and the command exits 78 (`EX_CONFIG`, what a service
//! exits with on a bad configuration); with none, it lists the files it checked and exits 0.

use std::fmt::Write as _;
use std::path::Path;

use stagehand_policy::{POLICY_FILES, Policies};

/// Exit status of a folder with a problem: `EX_CONFIG`, as a service refusing it exits.
pub const EXIT_INVALID: i32 = 78;

/// What `check` found.
#[derive(Debug)]
pub struct Checked {
    /// The policy files present, in [`POLICY_FILES`] order.
    pub present: Vec<&'static str>,
    /// Every problem, as a service would state it at start.
    pub errors: Vec<String>,
}

/// Checks every policy file in `dir`, resolving relative posix roots against `home` as the
/// services do.
pub fn check(dir: &Path, home: &Path) -> Checked {
    let errors = Policies::check_dir(dir, home)
        .iter()
        .map(ToString::to_string)
        .collect();
    let present = POLICY_FILES
        .iter()
        .copied()
        .filter(|f| dir.join(f).is_file())
        .collect();
    Checked { present, errors }
}

/// The report and the exit status: 0 when every file is valid, [`EXIT_INVALID`] otherwise.
pub fn report(dir: &Path, checked: &Checked) -> (String, i32) {
    let mut out = String::new();
    if checked.errors.is_empty() {
        let _ = writeln!(
            out,
            "{}: valid ({})",
            dir.display(),
            checked.present.join(", ")
        );
        return (out, 0);
    }
    for e in &checked.errors {
        let _ = writeln!(out, "{e}");
    }
    let _ = writeln!(
        out,
        "{}: {} problem{}; a service started with this folder would refuse to start",
        dir.display(),
        checked.errors.len(),
        if checked.errors.len() == 1 { "" } else { "s" }
    );
    (out, EXIT_INVALID)
}
