//! Real servers for Stagehand's tests: a `nats-server` with JetStream per test (and a
//! three-node cluster), a SeaweedFS S3 server, and a Prometheus that scrapes a service, each on
//! dynamic loopback ports with its own data directory, killed and cleaned up on drop; and users
//! and groups of this host for one test ([`HostUser`], [`HostGroup`]), removed on drop.
//!
//! Above the servers, the shared stack of the services' tests ([`Stack`]: a server with or
//! without the shipped accounts, provisioned, posix tiers and a policy folder written by
//! [`PolicyFiles`], services in-process or as [`ServiceProcess`]es), the one check that a
//! consumer has handled everything ([`drained`], which notices messages the server dropped),
//! the one stream reader ([`stored_messages`], [`stored_events`], [`stored_facts`]), and the
//! events and files tests lay down as another party would ([`StageRequest`],
//! [`validated_fact`], [`put_files`]).
//!
//! Nodes of one test can be network namespaces on a bridge ([`NodeNetwork`]), each with an
//! address of its own, for services that dial each other across nodes.
//!
//! Binaries are found through `STAGEHAND_NATS_SERVER` / `STAGEHAND_WEED` /
//! `STAGEHAND_PROMETHEUS`, then the venv that `deploy/servers.sh install` creates, then `PATH`
//! (Debian's `prometheus` package, which `deploy/servers.sh install` installs). Tests wait on real conditions with
//! [`wait_until`] / [`wait_for`] instead of sleeping.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nats = stagehand_testkit::NatsServer::start();
//! let client = async_nats::connect(nats.url()).await?;
//! let js = async_nats::jetstream::new(client);
//! js.create_stream(async_nats::jetstream::stream::Config {
//!     name: stagehand_testkit::unique_name("TEST"),
//!     subjects: vec!["test.>".into()],
//!     ..Default::default()
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```

mod accounts;
mod drained;
mod election;
mod events;
mod facts;
mod files;
mod nats;
mod netns;
mod policies;
mod process;
mod prometheus;
mod s3;
mod stack;
mod tls;
mod tmpfs;
mod users;
mod wait;

pub use accounts::{
    Account, Crossing, SHIPPED_NODE, SHIPPED_PROJECT, STAGEHAND_ACCOUNT, TEST_MAX_FILE,
    accounts_conf, accounts_conf_with_projects, accounts_of, accounts_roles, covers, crossing_gaps,
    node_inbox_prefix, node_role, node_user, project_account, publish_allowed, reaches_consumers,
    role_password, roles_of, subscribe_allowed, user_url, with_node_users, with_test_host_limits,
};
pub use drained::{Drained, consumer_state, drained, drained_through, wait_drained};
pub use election::{ELECTION, stored_events_through_election, stream_leader};
pub use events::{StageRequest, validated_fact};
pub use facts::{
    StoredEventsError, StoredMessage, facts_caused_by, stored_events, stored_facts, stored_messages,
};
pub use files::{backdate, list_dir, pattern_bytes, put_files};
pub use nats::{NatsCluster, NatsClusterBuilder, NatsServer, NatsServerBuilder};
pub use netns::{NetNode, NetworkError, NodeNetwork};
pub use policies::{PolicyFiles, TierSpec, VALIDATION};
pub use prometheus::{Prometheus, http_get, http_get_at, scrape_sample};
pub use s3::{ACCESS_KEY, REGION, S3Error, S3Server, SECRET_KEY};
pub use stack::{ServiceProcess, Stack, StackBuilder};
pub use tls::{DEPLOY_TLS_DIR, TestCa};
pub use tmpfs::Tmpfs;
pub use users::{HostGroup, HostUser};
pub use wait::{WaitTimeout, wait_for, wait_until, wait_until_blocking};

pub(crate) use wait::block_on;

use std::sync::atomic::{AtomicU64, Ordering};

/// A name no other test of any running process uses: `<prefix>-<pid>-<counter>-<time>`, in
/// characters valid for stream, consumer, KV and bucket names (`[A-Za-z0-9-]`, lowercase
/// when `prefix` is).
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}-{:x}-{n}-{nanos:x}", std::process::id())
}

/// The `nats-server` binary the testkit runs (for tests that run it with other flags, such as
/// `-t` to check a configuration file). Panics, naming the install command, when none is found.
pub fn nats_server_binary() -> std::path::PathBuf {
    process::find_binary(process::Binary::NatsServer)
}

/// Prometheus's `promtool` (Debian's `prometheus` package), for checking and unit-testing
/// the shipped rules.
pub fn promtool_binary() -> std::path::PathBuf {
    process::find_binary(process::Binary::Promtool)
}

/// The SeaweedFS `weed` binary the testkit runs.
pub fn weed_binary() -> std::path::PathBuf {
    process::find_binary(process::Binary::Weed)
}

/// The repository root, for tests that read files such as `deploy/nats/accounts.conf`.
pub fn repo_root() -> std::path::PathBuf {
    process::repo_root()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_differ_and_fit_bucket_rules() {
        let a = unique_name("bkt");
        let b = unique_name("bkt");
        assert_ne!(a, b);
        assert!(a.len() <= 63, "{a}");
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'),
            "{a}"
        );
    }
}
