//! Nodes of a test as Linux network namespaces on one bridge: each node has an address of its
//! own, so services that serve each other (the node agents' fan-out) listen and dial as they
//! would across machines, while sharing this host's filesystem.
//!
//! A [`NodeNetwork`] makes a bridge with a private /24 (the host's end is `.1`) and, per node, a
//! namespace holding one end of a veth pair (named `eth0` inside, the other end on the bridge),
//! `lo` up and the address `.2`, `.3`, …. Names carry this process's id and a counter, so
//! test binaries running side by side never collide, and fit the kernel's 15-character limit
//! on interface names. Dropping the network deletes the namespaces, veths and the bridge;
//! making one first deletes what a killed earlier test process left under its names.
//!
//! It needs root or `CAP_NET_ADMIN` (and `CAP_SYS_ADMIN` for `ip netns`); without them
//! [`NodeNetwork::new`] fails saying so rather than letting a test skip.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Prefix of every bridge, veth and namespace name this module makes (to find leftovers).
const PREFIX: &str = "shn";

/// Why a [`NodeNetwork`] could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetworkError {
    /// `ip` or `tc` itself could not be run.
    #[error("running `{args}`: {source} (install iproute2)")]
    Spawn {
        args: String,
        source: std::io::Error,
    },
    /// The kernel refused: this process may not make namespaces or links.
    #[error(
        "`{args}` was refused: {stderr} — node networks need root or CAP_NET_ADMIN and \
         CAP_SYS_ADMIN (run the test as root, or in a container with those capabilities)"
    )]
    NotPermitted { args: String, stderr: String },
    /// Another failure of one `ip` or `tc` command.
    #[error("`{args}` failed: {stderr}")]
    Failed { args: String, stderr: String },
    /// Every candidate /24 under 10.0.0.0/8 is in use on this host.
    #[error("no free /24 under 10.0.0.0/8 for a node network")]
    NoSubnet,
    /// A network of more nodes than a /24 and the name scheme hold.
    #[error("{0} nodes: a node network holds 1 to 200")]
    TooManyNodes(usize),
}

/// One node of a [`NodeNetwork`]: its namespace and address.
#[derive(Debug, Clone)]
pub struct NetNode {
    namespace: String,
    host_veth: String,
    addr: Ipv4Addr,
}

impl NetNode {
    /// The namespace's name (`ip netns exec <name> ...`).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The node's address on the bridge.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// `ip netns exec <namespace> <program>`: a command that runs in the node's network.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespace]).arg(program);
        cmd
    }
}

/// A bridge and one network namespace per node on it; removed on drop.
#[derive(Debug)]
pub struct NodeNetwork {
    bridge: String,
    host_addr: Ipv4Addr,
    nodes: Vec<NetNode>,
}

impl NodeNetwork {
    /// Makes a bridge with a free private /24 and `nodes` namespaces on it, each reachable
    /// from the host and from the others.
    pub fn new(nodes: usize) -> Result<NodeNetwork, NetworkError> {
        if nodes == 0 || nodes > 200 {
            return Err(NetworkError::TooManyNodes(nodes));
        }
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "{:x}x{:x}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed) % 256
        );
        remove_leftovers()?;
        let subnet = free_subnet()?;
        let host_addr = Ipv4Addr::new(10, subnet[0], subnet[1], 1);
        let nodes = (0..nodes)
            .map(|i| NetNode {
                namespace: format!("{PREFIX}{tag}n{i:x}"),
                host_veth: format!("{PREFIX}{tag}v{i:x}"),
                addr: Ipv4Addr::new(10, subnet[0], subnet[1], 2 + i as u8),
            })
            .collect();
        // Made before anything is created, so that a failure half-way removes what was made.
        let network = NodeNetwork {
            bridge: format!("{PREFIX}{tag}b"),
            host_addr,
            nodes,
        };
        // An earlier process of this pid (the pid reused) may have died holding these names.
        network.remove();
        network.create()?;
        Ok(network)
    }

    fn create(&self) -> Result<(), NetworkError> {
        let br = self.bridge.as_str();
        ip(&["link", "add", br, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}/24", self.host_addr), "dev", br])?;
        ip(&["link", "set", br, "up"])?;
        for node in &self.nodes {
            let ns = node.namespace.as_str();
            ip(&["netns", "add", ns])?;
            // The peer is made inside the namespace, as its eth0.
            ip(&[
                "link",
                "add",
                &node.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            ])?;
            ip(&["link", "set", &node.host_veth, "master", br])?;
            ip(&["link", "set", &node.host_veth, "up"])?;
            let inside = |args: &[&str]| {
                let mut all = vec!["-n", ns];
                all.extend_from_slice(args);
                ip(&all)
            };
            inside(&["addr", "add", &format!("{}/24", node.addr), "dev", "eth0"])?;
            inside(&["link", "set", "eth0", "up"])?;
            inside(&["link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// The host's address on the bridge (`.1`): bind a server the nodes reach here.
    pub fn host_addr(&self) -> Ipv4Addr {
        self.host_addr
    }

    /// The nodes, in order.
    pub fn nodes(&self) -> &[NetNode] {
        &self.nodes
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &NetNode {
        &self.nodes[i]
    }

    /// Limits what node `i` sends (its `eth0`'s egress: what it serves its peers and the
    /// host) to `rate` (`tc` units, e.g. `"200mbit"`), so that a transfer lasts long enough
    /// for a test to act in the middle of it.
    pub fn limit_egress(&self, i: usize, rate: &str) -> Result<(), NetworkError> {
        let ns = self.nodes[i].namespace.as_str();
        run(
            "tc",
            &[
                "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst",
                "256kb", "latency", "200ms",
            ],
        )
        .map(drop)
    }

    /// The bridge's name.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }
}

impl NodeNetwork {
    /// Deletes the namespaces, veths and bridge of these names, those that exist.
    fn remove(&self) {
        // Deleting a namespace deletes its veth end and with it the pair.
        for node in &self.nodes {
            let _ = ip(&["netns", "delete", &node.namespace]);
            let _ = ip(&["link", "delete", &node.host_veth]);
        }
        let _ = ip(&["link", "delete", &self.bridge]);
    }
}

impl Drop for NodeNetwork {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Runs `ip args`; its stderr in the error.
fn ip(args: &[&str]) -> Result<String, NetworkError> {
    run("ip", args)
}

/// Runs `program args` (`ip`, `tc`); its stderr in the error.
fn run(program: &str, args: &[&str]) -> Result<String, NetworkError> {
    let joined = format!("{program} {}", args.join(" "));
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| NetworkError::Spawn {
            args: joined.clone(),
            source,
        })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    let refused = ["Operation not permitted", "Permission denied"];
    if refused.iter().any(|r| stderr.contains(r)) {
        Err(NetworkError::NotPermitted {
            args: joined,
            stderr,
        })
    } else {
        Err(NetworkError::Failed {
            args: joined,
            stderr,
        })
    }
}

/// The process id a name of this module carries (`shn<pid hex>x<counter hex>...`).
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let hex = rest.split('x').next()?;
    u32::from_str_radix(hex, 16).ok()
}

/// Deletes the namespaces and links a test process that is gone left behind (killed before
/// its networks' drop ran).
fn remove_leftovers() -> Result<(), NetworkError> {
    let dead = |name: &str| {
        owner_pid(name).is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
    };
    for line in ip(&["netns", "list"])?.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if dead(name) {
            let _ = ip(&["netns", "delete", name]);
        }
    }
    for line in ip(&["-o", "link", "show"])?.lines() {
        // `7: shn1a2x0b: <BROADCAST,...`, a veth as `shn1a2x0v0@if6:`.
        let Some(name) = line.split(": ").nth(1) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or(name);
        if dead(name) {
            let _ = ip(&["link", "delete", name]);
        }
    }
    Ok(())
}

/// A /24 of 10.0.0.0/8 no address of this host is in, starting from one derived from the
/// process id (so that processes starting together try different ones first).
fn free_subnet() -> Result<[u8; 2], NetworkError> {
    let used: HashSet<[u8; 2]> = ip(&["-4", "-o", "addr", "show"])?
        .lines()
        .filter_map(|l| {
            let cidr = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
            let addr: Ipv4Addr = cidr.split('/').next()?.parse().ok()?;
            let o = addr.octets();
            (o[0] == 10).then_some([o[1], o[2]])
        })
        .collect();
    // 10.200.0.0 – 10.255.255.0: clear of the low ranges sites tend to use.
    let start = std::process::id() as usize % (56 * 256);
    (0..56 * 256)
        .map(|i| (start + i) % (56 * 256))
        .map(|i| [200 + (i / 256) as u8, (i % 256) as u8])
        .find(|s| !used.contains(s))
        .ok_or(NetworkError::NoSubnet)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_their_owner_and_fit_interface_names() {
        // The largest pid Linux hands out, 255 networks in one process, node 199.
        let longest = format!("{PREFIX}{:x}x{:x}v{:x}", 4_194_304u32, 255u32, 199);
        assert!(longest.len() <= 15, "{longest}");
        assert_eq!(owner_pid(&longest), Some(4_194_304));
        assert_eq!(owner_pid("eth0"), None);
        assert_eq!(owner_pid("shnzz"), None);
    }
}
