//! The shipped NATS accounts config (`deploy/nats/accounts.conf`) on a test server.
//!
//! That file takes every user's password from a variable `STAGEHAND_NATS_<ROLE>_PASSWORD`, and
//! nats-server refuses to start while one is unset. The roles are read from the file itself, so
//! a role added there needs no edit in any test; each test connects as a role's user with
//! [`role_password`] / [`user_url`].

use std::path::PathBuf;

use crate::{NatsServer, NatsServerBuilder, repo_root};

/// The shipped accounts config.
pub fn accounts_conf() -> PathBuf {
    repo_root().join("deploy/nats/accounts.conf")
}

/// Every role whose password the shipped accounts config reads (`UPLOADER_DEMO`, `PROMOTER`,
/// …), sorted, each once.
pub fn accounts_roles() -> Vec<String> {
    let path = accounts_conf();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut roles: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
        .filter_map(|t| t.strip_prefix("$STAGEHAND_NATS_"))
        .filter_map(|t| t.strip_suffix("_PASSWORD"))
        .map(str::to_string)
        .collect();
    roles.sort();
    roles.dedup();
    roles
}

/// The password a test server gives `role`'s user.
pub fn role_password(role: &str) -> String {
    format!("test-password-{}", role.to_ascii_lowercase())
}

/// A URL that connects to `server` as `user` with `role`'s password.
pub fn user_url(server: &NatsServer, user: &str, role: &str) -> String {
    format!(
        "nats://{user}:{}@127.0.0.1:{}",
        role_password(role),
        server.port()
    )
}

impl NatsServerBuilder {
    /// Runs the server with the shipped accounts config, every role's password set.
    pub fn shipped_accounts(self) -> Self {
        accounts_roles()
            .into_iter()
            .fold(self.config_file(accounts_conf()), |b, role| {
                let password = role_password(&role);
                b.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_read_from_the_shipped_file() {
        let roles = accounts_roles();
        for role in [
            "OPERATOR",
            "PROMOTER",
            "UPLOADER_DEMO",
            "CATALOGUE_RECORDER",
        ] {
            assert!(
                roles.iter().any(|r| r == role),
                "{role} missing from {roles:?}"
            );
        }
        assert!(
            roles.iter().all(|r| !r.is_empty() && !r.contains('$')),
            "{roles:?}"
        );
    }
}
