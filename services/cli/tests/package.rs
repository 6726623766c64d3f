//! `deploy/package.sh`'s artefacts, installed where no Rust toolchain is: the Debian package
//! and the tarball hold the same tree — every binary the workspace ships, the systemd units,
//! the service configurations and policies as conffiles under `/etc/stagehand`, the runbooks,
//! and man pages and completions generated from the CLI — and the package installs with `dpkg`
//! on a clean Debian root made by debootstrap (`deploy/package.sh clean-root`, kept under the
//! target folder so that a second run downloads nothing), where the CLI and the services run
//! and the shipped policies load. Needs root (dpkg and chroot), as CI runs.
//!
//! The package is built from the debug binaries the suite already built
//! (`STAGEHAND_PACKAGE_PROFILE=debug`): the release build is the same script with another
//! profile.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, bail, ensure};

/// The folder every build of this test binary goes to (`target/debug/deps/<test>` → `target`).
fn target_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .with_context(|| format!("no target folder above {}", exe.display()))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn run(cmd: &mut Command) -> anyhow::Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    Ok(out)
}

/// Runs `cmd` and fails with its output unless it succeeded.
fn ok(cmd: &mut Command) -> anyhow::Result<String> {
    let out = run(cmd)?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    Ok(text(&out.stdout))
}

/// A command run inside `root` as a host would run it: a fresh environment, the system PATH.
fn chroot(root: &Path, program: &str) -> Command {
    let mut cmd = Command::new("chroot");
    cmd.arg(root)
        .arg(program)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("HOME", "/root")
        .env("LANG", "C.UTF-8");
    cmd
}

/// The regular files of the Debian package, as paths below `/` (`usr/bin/stagehand`).
fn deb_files(deb: &Path) -> anyhow::Result<BTreeSet<String>> {
    let listing = ok(Command::new("dpkg-deb").arg("--contents").arg(deb))?;
    Ok(listing
        .lines()
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(|p| p.trim_start_matches("./").to_owned())
        .collect())
}

/// The regular files of the tarball, the same way.
fn tar_files(tarball: &Path) -> anyhow::Result<BTreeSet<String>> {
    let listing = ok(Command::new("tar").arg("-tvzf").arg(tarball))?;
    Ok(listing
        .lines()
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(|p| p.trim_start_matches("./").to_owned())
        .collect())
}

/// The names of the files of a repository folder ending in `suffix`.
fn repo_files(dir: &str, suffix: &str) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(stagehand_testkit::repo_root().join(dir))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(suffix) {
            names.push(name);
        }
    }
    names.sort();
    ensure!(!names.is_empty(), "nothing ending in {suffix} under {dir}");
    Ok(names)
}

/// Checks the shipped policies at `dir` inside `root` with what the CLI has today.
///
/// `stagehand tier usage --policies DIR` loads and validates every policy file (the same
/// loader, and the same errors, as a service at start) before it connects; against a port
/// nothing listens on, a valid folder then ends in "cannot reach NATS" (exit 69) and an invalid
/// one in the policy error (exit 70). When `stagehand policy check DIR` exists, it replaces this
/// (exit 0 for a valid folder) and the caller's expectations become its own.
fn policy_check(root: &Path, dir: &str) -> anyhow::Result<Output> {
    run(chroot(root, "stagehand").args([
        "tier",
        "usage",
        "--policies",
        dir,
        "--nats",
        "nats://127.0.0.1:9",
        "--connect-timeout",
        "200ms",
    ]))
}

#[test]
fn the_package_installs_on_a_clean_root_and_runs_there() -> anyhow::Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("installing a package on a clean root needs root (dpkg, chroot), as CI runs");
    }
    let repo = stagehand_testkit::repo_root();
    let target = target_dir()?;
    let work = tempfile::tempdir()?;

    // What ships is what the workspace builds for operators.
    let binaries = common::shipped::package_binaries()?;
    ensure!(
        binaries == common::shipped::workspace_binaries()?,
        "deploy/package.sh binaries ({binaries:?}) is not the workspace's binaries"
    );
    ensure!(
        binaries.len() == 7,
        "the CLI and six services: {binaries:?}"
    );

    // Build the artefacts from the debug build.
    let out_dir = work.path().join("out");
    let built = ok(Command::new(repo.join("deploy/package.sh"))
        .arg("build")
        .env("STAGEHAND_PACKAGE_PROFILE", "debug")
        .env("STAGEHAND_PACKAGE_OUT", &out_dir)
        .env("CARGO_TARGET_DIR", &target))?;
    let lines: Vec<&str> = built.lines().collect();
    let [deb, tarball] = lines.as_slice() else {
        bail!("deploy/package.sh printed {built:?}, not the package and the tarball");
    };
    let (deb, tarball) = (PathBuf::from(deb), PathBuf::from(tarball));
    let version = env!("CARGO_PKG_VERSION");
    let deb_name = deb.file_name().unwrap_or_default().to_string_lossy();
    ensure!(
        deb_name.starts_with(&format!("stagehand_{version}_")) && deb_name.ends_with(".deb"),
        "{}",
        deb.display()
    );

    // Both hold the same files, and every one that must ship.
    let files = deb_files(&deb)?;
    ensure!(
        files == tar_files(&tarball)?,
        "the tarball and the package differ:\n{:?}\n{:?}",
        files,
        tar_files(&tarball)?
    );
    let mut wanted: Vec<String> = binaries.iter().map(|b| format!("usr/bin/{b}")).collect();
    for unit in repo_files("deploy/systemd", ".service")?
        .into_iter()
        .chain(repo_files("deploy/systemd", ".timer")?)
    {
        wanted.push(format!("lib/systemd/system/{unit}"));
    }
    for config in repo_files("deploy/config", ".toml")? {
        wanted.push(format!("etc/stagehand/{config}"));
    }
    for policy in repo_files("policies", ".toml")? {
        wanted.push(format!("etc/stagehand/policies/{policy}"));
    }
    for conf in ["accounts.conf", "single.conf", "cluster-1.conf"] {
        wanted.push(format!("etc/stagehand/nats/{conf}"));
    }
    for page in repo_files("runbooks", ".md")? {
        wanted.push(format!("usr/share/doc/stagehand/runbooks/{page}"));
    }
    for generated in [
        "usr/share/man/man1/stagehand.1.gz",
        "usr/share/man/man1/stagehand-stage-request.1.gz",
        "usr/share/bash-completion/completions/stagehand",
        "usr/share/zsh/vendor-completions/_stagehand",
        "usr/share/fish/vendor_completions.d/stagehand.fish",
    ] {
        wanted.push(generated.to_owned());
    }
    let missing: Vec<&String> = wanted.iter().filter(|w| !files.contains(*w)).collect();
    ensure!(missing.is_empty(), "the package lacks {missing:?}");
    // What an operator edits survives an upgrade: every file under /etc is a conffile.
    let conffiles = ok(Command::new("dpkg-deb")
        .arg("--info")
        .arg(&deb)
        .arg("conffiles"))?;
    for etc in files.iter().filter(|f| f.starts_with("etc/")) {
        ensure!(
            conffiles.lines().any(|l| l == format!("/{etc}")),
            "/{etc} is not a conffile:\n{conffiles}"
        );
    }

    // A clean Debian root, made once and kept; the package goes into a copy of it.
    let clean = target.join("stagehand-clean-root/bookworm");
    ok(Command::new(repo.join("deploy/package.sh"))
        .arg("clean-root")
        .arg(&clean))?;
    let root = work.path().join("root");
    ok(Command::new("cp").arg("-a").arg(&clean).arg(&root))?;
    ensure!(
        !root.join("usr/bin/stagehand").exists() && !root.join("usr/bin/cargo").exists(),
        "the clean root already holds Stagehand or a Rust toolchain"
    );
    std::fs::copy(&deb, root.join("tmp/stagehand.deb"))?;
    ok(chroot(&root, "dpkg").args(["--install", "/tmp/stagehand.deb"]))?;

    // The CLI and every service run there.
    let shown = ok(chroot(&root, "stagehand").arg("--version"))?;
    ensure!(shown.trim() == format!("stagehand {version}"), "{shown}");
    let help = ok(chroot(&root, "stagehand").arg("--help"))?;
    ensure!(
        help.contains("Usage: stagehand") && help.contains("stage"),
        "{help}"
    );
    let usage = ok(chroot(&root, "stagehand-promoter").arg("--help"))?;
    ensure!(usage.contains("usage: promoter --config FILE"), "{usage}");
    for bin in &binaries {
        // A service names itself by its service name (`promoter 0.1.0`), the CLI `stagehand`.
        let name = bin.strip_prefix("stagehand-").unwrap_or(bin);
        let shown = ok(chroot(&root, bin).arg("--version"))?;
        ensure!(
            shown.trim() == format!("{name} {version}"),
            "{bin}: {shown}"
        );
    }

    // The shipped policies load; a broken copy is refused naming the file and the key.
    let checked = policy_check(&root, "/etc/stagehand/policies")?;
    let said = text(&checked.stderr);
    ensure!(
        checked.status.code() == Some(69) && said.contains("cannot reach NATS"),
        "the shipped policies did not load: {} {said}",
        checked.status
    );
    let broken = root.join("tmp/broken-policies");
    ok(Command::new("cp")
        .arg("-a")
        .arg(root.join("etc/stagehand/policies"))
        .arg(&broken))?;
    let tiers = std::fs::read_to_string(broken.join("tiers.toml"))?;
    std::fs::write(
        broken.join("tiers.toml"),
        tiers.replacen("[tiers.hot]\n", "[tiers.hot]\ncolour = \"red\"\n", 1),
    )?;
    let refused = policy_check(&root, "/tmp/broken-policies")?;
    let said = text(&refused.stderr);
    ensure!(
        refused.status.code() == Some(70)
            && said.contains("/tmp/broken-policies/tiers.toml")
            && said.contains("`tiers.hot.colour`"),
        "a broken policy was not refused by name: {} {said}",
        refused.status
    );

    // The units' programs are where the package put them; they run as the user it made.
    for unit in repo_files("deploy/systemd", ".service")? {
        let text = std::fs::read_to_string(root.join("lib/systemd/system").join(&unit))?;
        let program = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .and_then(|e| e.split_whitespace().next())
            .with_context(|| format!("{unit}: no ExecStart"))?;
        if program.ends_with("/nats-server") {
            continue; // NATS is installed on its own (deploy/README.md).
        }
        let inside = root.join(program.trim_start_matches('/'));
        ensure!(
            inside.is_file(),
            "{unit} runs {program}, which the package does not install"
        );
    }
    let user = ok(chroot(&root, "getent").args(["passwd", "stagehand"]))?;
    ensure!(user.trim_end().ends_with(":/usr/sbin/nologin"), "{user}");

    // The completions load in the root's bash.
    let completion = ok(chroot(&root, "bash").args([
        "-c",
        "source /usr/share/bash-completion/completions/stagehand && complete -p stagehand",
    ]))?;
    ensure!(completion.contains("stagehand"), "{completion}");

    // Purged, nothing of it stays.
    ok(chroot(&root, "dpkg").args(["--purge", "stagehand"]))?;
    for gone in ["usr/bin/stagehand", "etc/stagehand/promoter.toml"] {
        ensure!(!root.join(gone).exists(), "/{gone} outlived a purge");
    }
    Ok(())
}
