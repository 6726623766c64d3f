//! The shipped NATS accounts config (`deploy/nats/accounts.conf`) on a test server.
//!
//! That file takes every user's password from a variable `STAGEHAND_NATS_<ROLE>_PASSWORD`, and
//! nats-server refuses to start while one is unset. The roles are read from the file itself, so
//! a role added there needs no edit in any test; each test connects as a role's user with
//! [`role_password`] / [`user_url`].
//!
//! The shipped file declares one tenant, project `demo`. Tests of what one tenant can do to
//! another add more with [`accounts_conf_with_projects`], which applies the recipe the file's
//! own comments give an operator (deploy/README.md, *Adding a project*): a copy of each
//! per-project user block and of every per-project grant in the services' blocks.

use std::path::PathBuf;

use crate::{NatsClusterBuilder, NatsServer, NatsServerBuilder, repo_root};

/// The shipped accounts config.
pub fn accounts_conf() -> PathBuf {
    repo_root().join("deploy/nats/accounts.conf")
}

/// The project the shipped accounts config declares its tenant users for.
pub const SHIPPED_PROJECT: &str = "demo";

/// Every role whose password the shipped accounts config reads (`UPLOADER_DEMO`, `PROMOTER`,
/// …), sorted, each once.
pub fn accounts_roles() -> Vec<String> {
    let path = accounts_conf();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    roles_of(&text)
}

/// Every role whose password an accounts config text reads, sorted, each once.
pub fn roles_of(text: &str) -> Vec<String> {
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

/// The shipped accounts config with tenant users and grants for `projects` besides `demo`:
/// every block named `<ROLE>_DEMO` (the project's uploader and training jobs) is copied for each
/// project, every other line naming the demo project's upload bucket
/// (`stagehand_uploads_demo`, granted to the services that read it) is repeated for each, and
/// so is each `users` entry of a demo user. Panics when the shipped file no longer has that
/// shape, so a change to it cannot silently leave a test's second tenant without users.
pub fn accounts_conf_with_projects(projects: &[&str]) -> String {
    let path = accounts_conf();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let demo_upper = format!("_{}", SHIPPED_PROJECT.to_ascii_uppercase());
    let demo_bucket = format!("stagehand_uploads_{SHIPPED_PROJECT}");
    let demo_user = format!("-{SHIPPED_PROJECT},");
    let for_project = |line: &str, project: &str| {
        line.replace(&demo_upper, &format!("_{}", project.to_ascii_uppercase()))
            .replace(&demo_bucket, &format!("stagehand_uploads_{project}"))
            .replace(&format!("-{SHIPPED_PROJECT}"), &format!("-{project}"))
            .replace(&format!(".{SHIPPED_PROJECT}"), &format!(".{project}"))
    };
    let mut out = String::with_capacity(text.len() * 2);
    let mut block: Option<Vec<&str>> = None;
    let (mut blocks, mut grants, mut users) = (0, 0, 0);
    for line in text.lines() {
        if let Some(lines) = block.as_mut() {
            lines.push(line);
            out.push_str(line);
            out.push('\n');
            if line == "}" {
                for project in projects {
                    out.push('\n');
                    for l in lines.iter() {
                        out.push_str(&for_project(l, project));
                        out.push('\n');
                    }
                }
                block = None;
                blocks += 1;
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
        let head = line.split_whitespace().next().unwrap_or("");
        if head.ends_with(&demo_upper) && line.trim_end().ends_with("= {") {
            block = Some(vec![line]);
        } else if line.contains(&demo_bucket) && !line.trim_start().starts_with('#') {
            for project in projects {
                out.push_str(&for_project(line, project));
                out.push('\n');
            }
            grants += 1;
        } else if line.trim_start().starts_with("{ user:") && line.contains(&demo_user) {
            for project in projects {
                out.push_str(&for_project(line, project));
                out.push('\n');
            }
            users += 1;
        }
    }
    assert!(
        blocks >= 2 && grants > 0 && users >= 2,
        "{}: expected per-project blocks, bucket grants and users of project {SHIPPED_PROJECT} \
         to copy (found {blocks} blocks, {grants} grants, {users} users)",
        path.display()
    );
    out
}

/// The subjects `role`'s block of an accounts config `text` (such as
/// [`accounts_conf_with_projects`] returns) allows it to publish, in the order written:
/// the quoted entries of the block's `publish: { allow: [ … ] }`, comments left out. Empty when
/// the block or its publish list is missing. Tests of what a role can do read its subjects
/// here, so a grant added to or removed from the config is tried without an edit to a test.
pub fn publish_allowed(text: &str, role: &str) -> Vec<String> {
    let head = format!("{role} = {{");
    let mut lines = text.lines().skip_while(|l| l.trim_end() != head).skip(1);
    let mut subjects = Vec::new();
    let mut in_publish = false;
    let mut in_allow = false;
    for line in lines.by_ref() {
        if line == "}" {
            break;
        }
        let code = line.split_once('#').map_or(line, |(code, _)| code).trim();
        if !in_publish {
            in_publish = code.starts_with("publish:");
            if !in_publish {
                continue;
            }
        }
        if !in_allow {
            match code.find("allow:") {
                Some(at) => in_allow = code[at..].contains('['),
                None => continue,
            }
        }
        // Quoted entries: every other piece between double quotes.
        subjects.extend(code.split('"').skip(1).step_by(2).map(str::to_string));
        if code.contains(']') {
            break;
        }
    }
    subjects
}

impl NatsServerBuilder {
    /// Runs the server with the shipped accounts config, every role's password set.
    pub fn shipped_accounts(self) -> Self {
        self.shipped_accounts_with_projects(&[])
    }

    /// Runs the server with the shipped accounts config extended to tenant users of `projects`
    /// besides `demo` ([`accounts_conf_with_projects`]), every role's password set: for tests
    /// of what one project's users can do to another's.
    pub fn shipped_accounts_with_projects(self, projects: &[&str]) -> Self {
        let (builder, text) = if projects.is_empty() {
            let text = std::fs::read_to_string(accounts_conf()).unwrap_or_default();
            (self.config_file(accounts_conf()), text)
        } else {
            let text = accounts_conf_with_projects(projects);
            (self.config_text(text.clone()), text)
        };
        roles_of(&text).into_iter().fold(builder, |b, role| {
            let password = role_password(&role);
            b.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password)
        })
    }
}

impl NatsClusterBuilder {
    /// Every role's password that `accounts_text` (an accounts config the nodes include, such
    /// as the shipped one) reads, set for every node.
    pub fn role_passwords(self, accounts_text: &str) -> Self {
        roles_of(accounts_text).into_iter().fold(self, |b, role| {
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

    #[test]
    fn a_second_project_gets_its_own_users_and_grants() {
        let text = accounts_conf_with_projects(&["labb"]);
        let roles = roles_of(&text);
        for role in ["UPLOADER_LABB", "TRAINER_LABB", "UPLOADER_DEMO"] {
            assert!(
                roles.iter().any(|r| r == role),
                "{role} missing from {roles:?}"
            );
        }
        assert!(text.contains("\"stagehand.req.ingest.requested.labb\""));
        assert!(text.contains("\"stagehand.fact.checkpoint.committed.labb\""));
        assert!(text.contains("{ user: uploader-labb,"));
        assert!(text.contains("_INBOX_trainer-labb.>"));
        // The services that read upload buckets read labb's too.
        assert_eq!(
            text.matches("\"$JS.FC.OBJ_stagehand_uploads_labb.>\"")
                .count(),
            text.matches("\"$JS.FC.OBJ_stagehand_uploads_demo.>\"")
                .count()
        );
        // Nothing of demo's own block names labb.
        let demo_block = text.split("UPLOADER_DEMO = {").nth(1).unwrap();
        let demo_block = &demo_block[..demo_block.find("\n}").unwrap()];
        assert!(!demo_block.contains("labb"), "{demo_block}");
    }

    #[test]
    fn a_roles_publish_grants_are_read_from_its_block() {
        let text = accounts_conf_with_projects(&["labb"]);
        let uploader = publish_allowed(&text, "UPLOADER_LABB");
        assert_eq!(
            uploader.first().map(String::as_str),
            Some("stagehand.req.ingest.requested.labb"),
            "{uploader:?}"
        );
        assert!(uploader.contains(&"$O.stagehand_uploads_labb.M.>".to_string()));
        assert!(
            uploader
                .iter()
                .all(|s| !s.contains("demo") && !s.contains('#'))
        );
        let scheduler = publish_allowed(&text, "SCHEDULER");
        assert!(scheduler.contains(&"stagehand.catalogue.query".to_string()));
        // Subscribe grants are not publish grants.
        assert!(
            !scheduler.iter().any(|s| s.starts_with("_INBOX")),
            "{scheduler:?}"
        );
        assert!(publish_allowed(&text, "NO_SUCH_ROLE").is_empty());
        // The operator has no block: no list (it may publish anything).
        assert!(publish_allowed(&text, "OPERATOR").is_empty());
    }
}
