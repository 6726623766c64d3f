//! Man pages and shell completions generated from the command line's own clap definition
//! ([`crate::cli::Cli`]), so that what the package ships cannot drift from what the binary
//! accepts. `deploy/package.sh` runs the hidden `stagehand generate-docs --out DIR` and installs
//! the result: `DIR/man/man1/stagehand*.1` (one page per command and subcommand) and
//! `DIR/completions/` for bash (`stagehand`), zsh (`_stagehand`) and fish (`stagehand.fish`).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::CommandFactory;
use clap_complete::Shell;

/// The shells completions are written for, with the file name each looks for.
pub const COMPLETIONS: &[(Shell, &str)] = &[
    (Shell::Bash, "stagehand"),
    (Shell::Zsh, "_stagehand"),
    (Shell::Fish, "stagehand.fish"),
];

/// What [`generate`] wrote.
#[derive(Debug, Default)]
pub struct Generated {
    /// `man/man1/*.1`, sorted.
    pub man_pages: Vec<PathBuf>,
    /// `completions/*`, in [`COMPLETIONS`]' order.
    pub completions: Vec<PathBuf>,
}

/// Writes every man page and completion script under `out` (created when missing).
pub fn generate(out: &Path) -> anyhow::Result<Generated> {
    let man = out.join("man/man1");
    let completions = out.join("completions");
    for dir in [&man, &completions] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    clap_mangen::generate_to(crate::cli::Cli::command(), &man)
        .with_context(|| format!("writing man pages into {}", man.display()))?;
    let mut generated = Generated::default();
    for entry in std::fs::read_dir(&man)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "1") {
            generated.man_pages.push(path);
        }
    }
    generated.man_pages.sort();
    for (shell, file) in COMPLETIONS {
        let mut cmd = without_hidden(crate::cli::Cli::command());
        let path = completions.join(file);
        let mut text = Vec::new();
        clap_complete::generate(*shell, &mut cmd, "stagehand", &mut text);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        generated.completions.push(path);
    }
    Ok(generated)
}

/// `cmd` without its hidden subcommands: clap_complete offers every subcommand, hidden or not
/// (clap_mangen leaves them out by itself), and clap cannot remove one, so the top-level
/// command is made again from its arguments and its visible subcommands.
fn without_hidden(cmd: clap::Command) -> clap::Command {
    let visible: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let mut bare = clap::Command::new("stagehand")
        .version(env!("CARGO_PKG_VERSION"))
        .subcommand_required(cmd.is_subcommand_required_set())
        .args(cmd.get_arguments().cloned())
        .subcommands(visible);
    if let Some(about) = cmd.get_about() {
        bare = bare.about(about.clone());
    }
    bare
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every visible command path of the CLI, `stagehand-stage-request` style.
    fn command_paths(cmd: &clap::Command, prefix: &str, out: &mut Vec<String>) {
        let name = if prefix.is_empty() {
            cmd.get_name().to_owned()
        } else {
            format!("{prefix}-{}", cmd.get_name())
        };
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            command_paths(sub, &name, out);
        }
        out.push(name);
    }

    #[test]
    fn a_man_page_for_every_command_and_completions_that_know_them() {
        let dir = tempfile::tempdir().unwrap();
        let generated = generate(dir.path()).unwrap();
        let cli = crate::cli::Cli::command();
        let mut paths = Vec::new();
        command_paths(&cli, "", &mut paths);
        paths.sort();
        let mut pages: Vec<String> = generated
            .man_pages
            .iter()
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        pages.sort();
        assert_eq!(pages, paths, "one man page per command");
        assert!(
            paths.contains(&"stagehand-stage-request".to_owned()),
            "{paths:?}"
        );
        assert!(
            !paths.iter().any(|p| p.contains("generate-docs")),
            "the hidden command has no page: {paths:?}"
        );
        let page =
            std::fs::read_to_string(dir.path().join("man/man1/stagehand-stage-request.1")).unwrap();
        assert!(page.starts_with(".ie") || page.contains(".TH"), "{page}");
        assert!(
            page.contains("deadline"),
            "the page documents the flags: {page}"
        );

        let top = clap::Command::get_subcommands(&cli)
            .filter(|s| !s.is_hide_set())
            .map(|s| s.get_name().to_owned())
            .collect::<Vec<_>>();
        for path in &generated.completions {
            let text = std::fs::read_to_string(path).unwrap();
            for name in &top {
                assert!(
                    text.contains(name.as_str()),
                    "{} does not complete {name}",
                    path.display()
                );
            }
            assert!(!text.contains("generate-docs"), "{}", path.display());
        }
    }
}
