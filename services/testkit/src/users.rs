//! Users and groups of this host made for one test (as root, with `groupadd`/`useradd`) and
//! removed on drop: a second, unprivileged user to check file modes with, a project's group,
//! a service running as an ordinary user. Names are unique per process and call, so tests
//! running at once never share one.

use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

/// A group made for a test; deleted on drop.
#[derive(Debug)]
pub struct HostGroup {
    pub name: String,
    pub gid: u32,
}

/// A user made for a test, with its own primary group and the given supplementary groups;
/// deleted (with its primary group) on drop.
#[derive(Debug)]
pub struct HostUser {
    pub name: String,
    pub uid: u32,
    /// Its primary group (named like the user).
    pub gid: u32,
}

/// A name no other test uses: `sht<pid>x<n>` (letters and digits, within the 32 characters
/// `useradd` takes).
fn unique(kind: char) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("sh{kind}{}x{n}", std::process::id())
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd} cannot run: {e} (these tests create users as root)"));
    assert!(
        out.status.success(),
        "`{cmd} {}` failed ({}): {} (these tests create users and groups, as root)",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn number(cmd: &str, args: &[&str]) -> u32 {
    let text = run(cmd, args);
    text.parse()
        .unwrap_or_else(|_| panic!("`{cmd} {}` printed {text:?}", args.join(" ")))
}

impl HostGroup {
    /// Creates a new group.
    pub fn add() -> HostGroup {
        let name = unique('g');
        run("groupadd", &[&name]);
        let line = run("getent", &["group", &name]);
        let gid = line
            .split(':')
            .nth(2)
            .and_then(|g| g.parse().ok())
            .unwrap_or_else(|| panic!("getent group {name} printed {line:?}"));
        HostGroup { name, gid }
    }
}

impl Drop for HostGroup {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.name).output();
    }
}

impl HostUser {
    /// Creates a user without a home or login shell, with its own group and membership of
    /// `groups`.
    pub fn add(groups: &[&HostGroup]) -> HostUser {
        let name = unique('u');
        let mut args = vec![
            "--no-create-home",
            "--user-group",
            "--shell",
            "/usr/sbin/nologin",
        ];
        let list = groups
            .iter()
            .map(|g| g.name.as_str())
            .collect::<Vec<_>>()
            .join(",");
        if !list.is_empty() {
            args.extend(["--groups", &list]);
        }
        args.push(&name);
        run("useradd", &args);
        let uid = number("id", &["-u", &name]);
        let gid = number("id", &["-g", &name]);
        HostUser { name, uid, gid }
    }

    /// `program args…` run as this user (`runuser -u`), its output.
    pub fn run(&self, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Output {
        self.command(program)
            .args(args)
            .output()
            .expect("runuser runs")
    }

    /// A command that runs `program` as this user, to add arguments and environment to.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", &self.name, "--"]).arg(program);
        cmd
    }
}

impl Drop for HostUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).output();
        let _ = Command::new("groupdel").arg(&self.name).output();
    }
}
