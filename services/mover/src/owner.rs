//! Who wrote a temporary file or staging folder, written into its name so that anyone can
//! later prove the writer dead (and the temporary garbage) or alive (and the temporary
//! untouchable).
//!
//! An owner token is `<machine>-<boot>-<pidns>-<pid>-<start>`: a hash of `/etc/machine-id`
//! (the hostname where there is none), a hash of the kernel's boot id, the pid namespace's
//! inode, the pid, and the process's start time in clock ticks since boot (field 22 of
//! `/proc/<pid>/stat`, which makes a reused pid a different owner). A temporary is provably
//! dead only when it was written on this machine and either before the last boot, or in this
//! pid namespace by a process that no longer runs with that start time. A token from another
//! machine (a shared filesystem mounted on many nodes) or another pid namespace (another
//! container) proves nothing, and its temporary is left alone: that node or container sweeps
//! its own.

use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// The writer of a temporary, as its name records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    machine: u32,
    boot: u32,
    pid_ns: u64,
    pid: u32,
    start: u64,
}

/// What can be proven about an owner from here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// The owner runs (this process, or another live one with the same start time).
    Alive,
    /// The owner is gone: an earlier boot of this machine, or no process with that pid and
    /// start time in this pid namespace.
    Dead,
    /// Another machine or another pid namespace wrote it; nothing can be proven.
    Unknown,
}

fn short_hash(bytes: &[u8]) -> u32 {
    let d = Sha256::digest(bytes);
    u32::from_be_bytes([d[0], d[1], d[2], d[3]])
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn machine_hash() -> u32 {
    let id = read_trimmed("/etc/machine-id")
        .or_else(|| read_trimmed("/var/lib/dbus/machine-id"))
        .or_else(|| read_trimmed("/proc/sys/kernel/hostname"))
        .unwrap_or_default();
    short_hash(id.as_bytes())
}

fn boot_hash() -> u32 {
    short_hash(
        read_trimmed("/proc/sys/kernel/random/boot_id")
            .unwrap_or_default()
            .as_bytes(),
    )
}

fn pid_ns() -> u64 {
    // `pid:[4026531836]`
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|p| {
            let s = p.to_string_lossy().into_owned();
            s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
        })
        .unwrap_or(0)
}

/// The start time (clock ticks since boot) of `pid` in this pid namespace, if it runs.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // Fields after the name start at field 3 (state); start time is field 22.
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Owner {
    /// This process.
    pub fn current() -> Owner {
        static CURRENT: OnceLock<Owner> = OnceLock::new();
        *CURRENT.get_or_init(|| {
            let pid = std::process::id();
            Owner {
                machine: machine_hash(),
                boot: boot_hash(),
                pid_ns: pid_ns(),
                pid,
                start: start_time(pid).unwrap_or(0),
            }
        })
    }

    /// The token written into names: `<machine>-<boot>-<pidns>-<pid>-<start>`, only
    /// `[0-9a-f-]`.
    pub fn token(&self) -> String {
        format!(
            "{:08x}-{:08x}-{:x}-{:x}-{:x}",
            self.machine, self.boot, self.pid_ns, self.pid, self.start
        )
    }

    /// Parses a token written by [`Owner::token`].
    pub fn parse(token: &str) -> Option<Owner> {
        let mut parts = token.split('-');
        let mut next = || parts.next().filter(|p| !p.is_empty());
        let machine = u32::from_str_radix(next()?, 16).ok()?;
        let boot = u32::from_str_radix(next()?, 16).ok()?;
        let pid_ns = u64::from_str_radix(next()?, 16).ok()?;
        let pid = u32::from_str_radix(next()?, 16).ok()?;
        let start = u64::from_str_radix(next()?, 16).ok()?;
        if parts.next().is_some() {
            return None;
        }
        Some(Owner {
            machine,
            boot,
            pid_ns,
            pid,
            start,
        })
    }

    /// Whether this owner can be proven alive or dead from here.
    pub fn liveness(&self) -> Liveness {
        let me = Owner::current();
        if self.machine != me.machine {
            return Liveness::Unknown;
        }
        if self.boot != me.boot {
            return Liveness::Dead;
        }
        if self.pid_ns != me.pid_ns {
            return Liveness::Unknown;
        }
        if *self == me {
            return Liveness::Alive;
        }
        match start_time(self.pid) {
            Some(start) if start == self.start => Liveness::Alive,
            _ => Liveness::Dead,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_its_token_round_trips() {
        let me = Owner::current();
        assert_ne!(me.start, 0, "the start time of this process is readable");
        let token = me.token();
        assert!(token.chars().all(|c| c.is_ascii_hexdigit() || c == '-'));
        assert_eq!(Owner::parse(&token), Some(me));
        assert_eq!(me.liveness(), Liveness::Alive);
    }

    #[test]
    fn other_boots_pids_and_machines_are_told_apart() {
        let me = Owner::current();
        let old_boot = Owner {
            boot: me.boot ^ 1,
            ..me
        };
        assert_eq!(old_boot.liveness(), Liveness::Dead);
        let reused_pid = Owner {
            start: me.start + 1,
            ..me
        };
        assert_eq!(reused_pid.liveness(), Liveness::Dead);
        let elsewhere = Owner {
            machine: me.machine ^ 1,
            boot: me.boot ^ 1,
            ..me
        };
        assert_eq!(elsewhere.liveness(), Liveness::Unknown);
        let other_container = Owner {
            pid_ns: me.pid_ns ^ 1,
            ..me
        };
        assert_eq!(other_container.liveness(), Liveness::Unknown);
        assert_eq!(Owner::parse("zz-1-2-3-4"), None);
        assert_eq!(Owner::parse("1-2-3-4"), None);
        assert_eq!(Owner::parse("1-2-3-4-5-6"), None);
    }
}
