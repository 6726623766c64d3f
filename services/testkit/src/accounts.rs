//! The shipped NATS accounts config (`deploy/nats/accounts.conf`) on a test server.
//!
//! That file takes every user's password from a variable `STAGEHAND_NATS_<ROLE>_PASSWORD`, and
//! nats-server refuses to start while one is unset. The roles are read from the file itself, so
//! a role added there needs no edit in any test; each test connects as a role's user with
//! [`role_password`] / [`user_url`].
//!
//! The shipped file declares one tenant, project `demo`, in an account of its own
//! (`PROJECT_DEMO`), the schedulers in another (`SCHEDULERS`), and Stagehand's services in
//! [`STAGEHAND_ACCOUNT`], which exports to each exactly what its users are granted. Tests of
//! what one tenant can do to another add more projects with [`accounts_conf_with_projects`],
//! which applies the recipe the file's own comments give an operator (deploy/README.md,
//! *Adding a project*): a copy of each per-project block (permissions, account) and of every
//! per-project grant and export. [`crossing_gaps`] holds a config to its shape: every grant of
//! a user outside Stagehand's account crosses into it by an import matched by an export
//! restricted to that account, nothing more crosses, and none of those users may create a
//! consumer.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::{NatsClusterBuilder, NatsServer, NatsServerBuilder, repo_root};

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

pub use stagehand_bus::accounts::{
    SHIPPED_NODE, SHIPPED_PROJECT, node_inbox_prefix, node_role, node_user, project_account,
};

/// An accounts config `text` of the shipped shape with a user for each of `nodes` besides
/// [`SHIPPED_NODE`], by the recipe an operator runs (`stagehand accounts add-node`,
/// [`stagehand_bus::accounts::with_node_users`]). Panics when `text` is not of that shape, so
/// a change to the file cannot silently leave a test's nodes without users.
pub fn with_node_users(text: &str, nodes: &[&str]) -> String {
    stagehand_bus::accounts::with_node_users(text, nodes).unwrap_or_else(|e| panic!("{e}"))
}

/// The shipped accounts config with tenants of `projects` besides `demo`, by the recipe an
/// operator runs (`stagehand accounts add-project`,
/// [`stagehand_bus::accounts::with_project_users`]). Panics when the shipped file no longer has
/// that shape, so a change to it cannot silently leave a test's second tenant without users,
/// imports or exports.
pub fn accounts_conf_with_projects(projects: &[&str]) -> String {
    let path = accounts_conf();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    stagehand_bus::accounts::with_project_users(&text, projects)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The subjects `role`'s block of an accounts config `text` (such as
/// [`accounts_conf_with_projects`] returns) allows it to publish, in the order written:
/// the quoted entries of the block's `publish: { allow: [ … ] }`, comments left out. Empty when
/// the block or its publish list is missing. Tests of what a role can do read its subjects
/// here, so a grant added to or removed from the config is tried without an edit to a test.
pub fn publish_allowed(text: &str, role: &str) -> Vec<String> {
    allowed(text, role, "publish:")
}

/// The subjects `role`'s block of an accounts config `text` allows it to subscribe to, as
/// [`publish_allowed`] reads its publish list.
pub fn subscribe_allowed(text: &str, role: &str) -> Vec<String> {
    allowed(text, role, "subscribe:")
}

/// The quoted entries of the `allow` list of `section` (`publish:` or `subscribe:`) in
/// `role`'s block.
fn allowed(text: &str, role: &str, section: &str) -> Vec<String> {
    let head = format!("{role} = {{");
    let mut lines = text.lines().skip_while(|l| l.trim_end() != head).skip(1);
    let mut subjects = Vec::new();
    let mut in_section = false;
    let mut in_allow = false;
    for line in lines.by_ref() {
        if line == "}" {
            break;
        }
        let code = line.split_once('#').map_or(line, |(code, _)| code).trim();
        if !in_section {
            in_section = code.starts_with(section);
            if !in_section {
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

/// The account that holds Stagehand's streams and buckets, its services and the operator;
/// every other account reaches them only through what it exports.
pub const STAGEHAND_ACCOUNT: &str = "STAGEHAND";

/// How a subject crosses from one account into another: a service export carries a publish
/// in and its one answer back (to the asker's reply subject, in the asker's account), a
/// stream export carries messages out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Crossing {
    Service,
    Stream,
}

impl std::fmt::Display for Crossing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Crossing::Service => "service",
            Crossing::Stream => "stream",
        })
    }
}

/// One account of an accounts config, as written in its `accounts` block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Account {
    /// Each user's name and the permissions block it names (`None`: all permissions).
    pub users: Vec<(String, Option<String>)>,
    /// What it imports: how, from which account, which subject.
    pub imports: Vec<(Crossing, String, String)>,
    /// What it exports: how, which subject, to which accounts (none listed: any account).
    pub exports: Vec<(Crossing, String, Vec<String>)>,
}

/// Every account of an accounts config `text` by name, read from the one-entry-a-line shape
/// `deploy/nats/accounts.conf` is written in: an account opens with `  NAME {`, a user is
/// `{ user: NAME, …, permissions: $BLOCK }`, an import `{ service: { account: A, subject: "S" } }`
/// (or `stream:`), an export `{ service: "S", accounts: [A, B] }` (or `stream:`).
pub fn accounts_of(text: &str) -> BTreeMap<String, Account> {
    let mut accounts = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut inside = false;
    for line in text.lines() {
        if !inside {
            inside = line.trim_end() == "accounts {";
            continue;
        }
        if line == "}" {
            break;
        }
        let code = line.split_once('#').map_or(line, |(code, _)| code).trim();
        if let Some(name) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(" {"))
            && !name.starts_with(' ')
        {
            current = Some(name.to_owned());
            accounts.insert(name.to_owned(), Account::default());
            continue;
        }
        let Some(account) = current.as_ref().and_then(|c| accounts.get_mut(c)) else {
            continue;
        };
        let quoted = code.split('"').nth(1).map(str::to_owned);
        let crossing = if code.starts_with("{ service:") {
            Some(Crossing::Service)
        } else if code.starts_with("{ stream:") {
            Some(Crossing::Stream)
        } else {
            None
        };
        if let Some(rest) = code.strip_prefix("{ user:") {
            let user = rest.split(',').next().unwrap_or("").trim().to_owned();
            let block = rest
                .split("permissions: $")
                .nth(1)
                .map(|b| b.trim_end_matches(['}', ' ']).trim().to_owned());
            account.users.push((user, block));
        } else if let (Some(crossing), Some(subject)) = (crossing, quoted) {
            if let Some((_, from)) = code.split_once("account:") {
                let from = from.split(',').next().unwrap_or("").trim().to_owned();
                account.imports.push((crossing, from, subject));
            } else {
                let to = code
                    .split_once("accounts: [")
                    .and_then(|(_, rest)| rest.split_once(']'))
                    .map(|(list, _)| list.split(',').map(|a| a.trim().to_owned()).collect())
                    .unwrap_or_default();
                account.exports.push((crossing, subject, to));
            }
        }
    }
    accounts
}

/// Whether the subject pattern `pattern` matches every subject `subject` (itself possibly a
/// pattern) matches: `*` stands for any one token, a final `>` for one or more.
pub fn covers(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(t)) if t != ">" => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// What keeps a tenant or scheduler from doing what its grants allow, or lets an account
/// reach more than its users are granted, in an accounts config `text`: each line one
/// finding, none when every account but [`STAGEHAND_ACCOUNT`] imports exactly what its users
/// may publish (services) and subscribe to (streams; a user's own inbox needs none), each
/// import matches an export of Stagehand's restricted to that account, and every such export
/// is imported by each account it names. An account that imports any JetStream API request
/// imports `$JS.API.INFO` too (see accounts.conf: otherwise the server's own answers race
/// Stagehand's). No user of those accounts may use the consumer API or its flow control
/// ([`reaches_consumers`]): a consumer delivers to whatever subject its creator names.
pub fn crossing_gaps(text: &str) -> Vec<String> {
    let accounts = accounts_of(text);
    let mut gaps = Vec::new();
    let Some(home) = accounts.get(STAGEHAND_ACCOUNT) else {
        return vec![format!("no account {STAGEHAND_ACCOUNT}")];
    };
    for (name, account) in accounts.iter().filter(|(n, _)| *n != STAGEHAND_ACCOUNT) {
        let imports = |crossing: Crossing, subject: &str| {
            account
                .imports
                .iter()
                .any(|(c, _, s)| *c == crossing && covers(s, subject))
        };
        let mut needed: Vec<(Crossing, String)> = Vec::new();
        for (user, block) in &account.users {
            let Some(block) = block else { continue };
            let inbox = format!("_INBOX_{user}.>");
            for (crossing, granted) in publish_allowed(text, block)
                .into_iter()
                .map(|s| (Crossing::Service, s))
                .chain(
                    subscribe_allowed(text, block)
                        .into_iter()
                        .map(|s| (Crossing::Stream, s)),
                )
            {
                if crossing == Crossing::Service && reaches_consumers(&granted) {
                    gaps.push(format!(
                        "user {user} of {name} may use {granted} ({block}): it could create a \
                         consumer, whose deliver subject nothing checks"
                    ));
                }
                let own_inbox = crossing == Crossing::Stream && granted == inbox;
                if !own_inbox && !imports(crossing, &granted) {
                    gaps.push(format!(
                        "user {user} of {name} may use {granted} ({block}), but {name} has no \
                         {crossing} import of it"
                    ));
                }
                needed.push((crossing, granted));
            }
        }
        let uses_js_api = account
            .imports
            .iter()
            .any(|(_, _, s)| s.starts_with("$JS.API."));
        if uses_js_api && !imports(Crossing::Service, "$JS.API.INFO") {
            gaps.push(format!(
                "{name} imports JetStream API requests but not $JS.API.INFO"
            ));
        }
        for (crossing, from, subject) in &account.imports {
            let granted = needed
                .iter()
                .any(|(c, g)| c == crossing && covers(subject, g));
            if !granted && subject != "$JS.API.INFO" {
                gaps.push(format!(
                    "{name} imports {subject} ({crossing}), which none of its users is granted"
                ));
            }
            let exported = accounts.get(from).is_some_and(|a| {
                a.exports.iter().any(|(c, s, to)| {
                    c == crossing && covers(s, subject) && to.iter().any(|t| t == name)
                })
            });
            if !exported {
                gaps.push(format!(
                    "{name} imports {subject} ({crossing}) from {from}, which exports no such \
                     {crossing} to {name}"
                ));
            }
        }
    }
    for (crossing, subject, to) in &home.exports {
        if to.is_empty() {
            gaps.push(format!(
                "{STAGEHAND_ACCOUNT} exports {subject} ({crossing}) to any account"
            ));
        }
        for name in to {
            let imported = accounts.get(name).is_some_and(|a| {
                a.imports
                    .iter()
                    .any(|(c, from, s)| c == crossing && from == STAGEHAND_ACCOUNT && s == subject)
            });
            if !imported {
                gaps.push(format!(
                    "{STAGEHAND_ACCOUNT} exports {subject} ({crossing}) to {name}, which does \
                     not import it"
                ));
            }
        }
    }
    gaps
}

/// Whether publishing on `granted` (a subject or pattern) reaches JetStream's consumer API or
/// its flow control: creating, deleting or driving a consumer. A push consumer delivers to the
/// subject its creator names in the request's body, which permissions cannot see, so such a
/// right lets its holder have the server publish a stream's messages onto any subject that
/// has a live subscriber (deploy/nats/accounts.conf, *Consumers*).
pub fn reaches_consumers(granted: &str) -> bool {
    const CONSUMER_API: [&str; 3] = ["$JS.API.CONSUMER.>", "$JS.FC.>", "$JS.ACK.>"];
    // What a grant broader than those patterns (`$JS.API.>`, `>`) would also let through.
    const PROBES: [&str; 6] = [
        "$JS.API.CONSUMER.CREATE.S",
        "$JS.API.CONSUMER.CREATE.S.N",
        "$JS.API.CONSUMER.CREATE.S.N.F",
        "$JS.API.CONSUMER.DURABLE.CREATE.S.N",
        "$JS.FC.S.N",
        "$JS.ACK.S.N",
    ];
    CONSUMER_API.iter().any(|api| covers(api, granted))
        || PROBES.iter().any(|probe| covers(granted, probe))
}

/// What a test server and each of its accounts may store on disk (the server's
/// `max_file_store`, each account's `max_file`): enough for every stream's own bound (an upload
/// bucket of 4 GiB per project, two projects in the tests that add one), and stated rather
/// than left to the server, whose default is 75 % of its disk's free space: on a test host
/// shared with other builds that is less than the shipped 200GB, and less from one run to the
/// next. The production servers state `max_file_store: 200GB` (deploy/nats/single.conf).
pub const TEST_MAX_FILE: &str = "10GB";

/// An accounts config `text` as a test server runs it: a `jetstream` block stating the
/// server's limits ([`TEST_MAX_FILE`], and the 1GB of memory the shipped servers state) and
/// every account's `max_file` set to [`TEST_MAX_FILE`]. nats-server starts with an account
/// limit above the server's own (it logs nothing), but a reload then refuses every account's
/// JetStream ("Error enabling jetstream on configured accounts: insufficient storage resources
/// available"). Panics when the text sets no `max_file`, so a change of the shipped file
/// cannot silently leave a test server with its production limit.
pub fn with_test_host_limits(text: &str) -> String {
    let mut set = 0;
    let mut out = format!(
        "# The test host's limits (stagehand_testkit::with_test_host_limits).\n\
         jetstream {{ max_file_store: {TEST_MAX_FILE}, max_memory_store: 1GB }}\n\n"
    );
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("max_file:") {
            let indent = &line[..line.len() - code.len()];
            out.push_str(&format!("{indent}max_file: {TEST_MAX_FILE}"));
            set += 1;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    assert!(set > 0, "an accounts config without an account's max_file");
    out
}

impl NatsServerBuilder {
    /// Runs the server with the shipped accounts config, every role's password set.
    pub fn shipped_accounts(self) -> Self {
        self.shipped_accounts_with_projects(&[])
    }

    /// Sets the password of every role that `accounts_text` reads: for a server whose
    /// configuration a test later reloads with more users than it started with (nats-server
    /// reads each `$VAR` from the environment it was started in).
    pub fn role_passwords(self, accounts_text: &str) -> Self {
        roles_of(accounts_text).into_iter().fold(self, |b, role| {
            let password = role_password(&role);
            b.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password)
        })
    }

    /// Runs the server with the shipped accounts config extended to tenant users of `projects`
    /// besides `demo` ([`accounts_conf_with_projects`]), every role's password set: for tests
    /// of what one project's users can do to another's. The accounts' JetStream limits are
    /// those a test host can honour ([`with_test_host_limits`]).
    pub fn shipped_accounts_with_projects(self, projects: &[&str]) -> Self {
        self.shipped_accounts_with(projects, &[])
    }

    /// [`shipped_accounts_with_projects`](Self::shipped_accounts_with_projects), with a user
    /// for the services of each of `nodes` too ([`with_node_users`]).
    pub fn shipped_accounts_with(self, projects: &[&str], nodes: &[&str]) -> Self {
        let text = if projects.is_empty() {
            let path = accounts_conf();
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        } else {
            accounts_conf_with_projects(projects)
        };
        let text = if nodes.is_empty() {
            text
        } else {
            with_node_users(&text, nodes)
        };
        self.config_text(with_test_host_limits(&text))
            .role_passwords(&text)
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
        // Its tenants are in an account of their own, which Stagehand exports its subjects
        // to (and only to it), and which shares the exports every project imports.
        let accounts = accounts_of(&text);
        let labb = &accounts[&project_account("labb")];
        let users: Vec<&str> = labb.users.iter().map(|(u, _)| u.as_str()).collect();
        assert!(
            users.contains(&"uploader-labb") && users.contains(&"trainer-labb"),
            "{users:?}"
        );
        assert!(users.iter().all(|u| u.ends_with("-labb")), "{users:?}");
        let home = &accounts[STAGEHAND_ACCOUNT];
        let to_labb: Vec<&(Crossing, String, Vec<String>)> = home
            .exports
            .iter()
            .filter(|(_, _, to)| to.contains(&"PROJECT_LABB".to_string()))
            .collect();
        assert!(
            to_labb
                .iter()
                .any(|(_, s, to)| s == "stagehand.req.ingest.requested.labb" && to.len() == 1),
            "{to_labb:?}"
        );
        assert!(
            to_labb
                .iter()
                .any(|(_, s, to)| s == "$JS.API.INFO" && to.contains(&"PROJECT_DEMO".into())),
            "{to_labb:?}"
        );
        assert!(
            to_labb
                .iter()
                .all(|(_, s, to)| !s.contains("demo") && (to.len() == 1 || !s.contains("labb"))),
            "{to_labb:?}"
        );
    }

    #[test]
    fn the_shipped_accounts_keep_tenants_and_schedulers_out_of_stagehands_account() {
        let accounts = accounts_of(&std::fs::read_to_string(accounts_conf()).unwrap());
        let home: Vec<&str> = accounts[STAGEHAND_ACCOUNT]
            .users
            .iter()
            .map(|(u, _)| u.as_str())
            .collect();
        for outsider in ["uploader-demo", "trainer-demo", "scheduler"] {
            assert!(!home.contains(&outsider), "{outsider} in {home:?}");
        }
        assert!(
            home.contains(&"promoter") && home.contains(&"operator"),
            "{home:?}"
        );
        let demo: Vec<&str> = accounts[&project_account(SHIPPED_PROJECT)]
            .users
            .iter()
            .map(|(u, _)| u.as_str())
            .collect();
        assert!(
            demo.contains(&"uploader-demo") && demo.contains(&"trainer-demo"),
            "{demo:?}"
        );
        // A project's account holds its own users only.
        assert!(demo.iter().all(|u| u.ends_with("-demo")), "{demo:?}");
    }

    /// Guards the accounts' crossings: every grant of a tenant or scheduler is imported into
    /// its account and exported to it alone, nothing more is, in the shipped config and with a
    /// second project added by the recipe.
    #[test]
    fn every_account_imports_what_its_users_are_granted_and_nothing_else() {
        let shipped = std::fs::read_to_string(accounts_conf()).unwrap();
        assert_eq!(crossing_gaps(&shipped), Vec::<String>::new());
        let two = accounts_conf_with_projects(&["labb"]);
        assert_eq!(crossing_gaps(&two), Vec::<String>::new());
    }

    /// The check finds each kind of gap: a grant with no import, an import with no export to
    /// the account, an import no user needs, an export nobody imports.
    #[test]
    fn a_grant_without_its_crossing_is_found() {
        let shipped = std::fs::read_to_string(accounts_conf()).unwrap();
        let cut = |text: &str, needle: &str| -> String {
            let lines: Vec<&str> = text.lines().filter(|l| !l.contains(needle)).collect();
            assert!(
                lines.len() < text.lines().count(),
                "{needle} not in the config"
            );
            lines.join("\n")
        };
        let import = r#"{ service: { account: STAGEHAND, subject: "stagehand.req.ingest.requested.demo" } }"#;
        let gaps = crossing_gaps(&cut(&shipped, import));
        assert!(
            gaps.iter().any(|g| g.contains("uploader-demo")
                && g.contains("stagehand.req.ingest.requested.demo")),
            "{gaps:?}"
        );
        assert!(
            gaps.iter().any(|g| g.contains("does not import it")),
            "{gaps:?}"
        );
        let export = r#"{ stream: "stagehand.fact.stage.ready.*", accounts: [SCHEDULERS] }"#;
        let gaps = crossing_gaps(&cut(&shipped, export));
        assert!(
            gaps.iter()
                .any(|g| g.contains("stagehand.fact.stage.ready.*")
                    && g.contains("exports no such stream")),
            "{gaps:?}"
        );
        let grant = r#""$JS.API.STREAM.MSG.GET.OBJ_stagehand_uploads_demo","#;
        let gaps = crossing_gaps(&cut(&shipped, grant));
        assert!(
            gaps.iter()
                .any(|g| g.contains("none of its users is granted")),
            "{gaps:?}"
        );
        let info = r#"{ service: { account: STAGEHAND, subject: "$JS.API.INFO" } }"#;
        let gaps = crossing_gaps(&cut(&shipped, info));
        assert!(
            gaps.iter().any(|g| g.contains("but not $JS.API.INFO")),
            "{gaps:?}"
        );
    }

    /// Guards the deliver-subject hole: a consumer-create right given back to a project's
    /// scheduler (with its import and export, as it once was) is found, and so is a grant
    /// broad enough to include one.
    #[test]
    fn a_consumer_right_outside_stagehands_account_is_found() {
        let shipped = std::fs::read_to_string(accounts_conf()).unwrap();
        // The grant as written in SCHEDULER_DEMO's block (its exports and imports name it in
        // braces).
        let grant =
            "\n      \"$JS.API.DIRECT.GET.KV_stagehand_stages.$KV.stagehand_stages.demo.>\"";
        let create =
            r#""$JS.API.CONSUMER.CREATE.KV_stagehand_stages.*.$KV.stagehand_stages.demo.>""#;
        assert_eq!(shipped.matches(grant).count(), 1, "{grant}");
        let export = r#"{ service: "$JS.API.CONSUMER.CREATE.KV_stagehand_stages.*.$KV.stagehand_stages.demo.>", accounts: [PROJECT_DEMO] }"#;
        let import = r#"{ service: { account: STAGEHAND, subject: "$JS.API.CONSUMER.CREATE.KV_stagehand_stages.*.$KV.stagehand_stages.demo.>" } }"#;
        let text = shipped
            .replace(grant, &format!("{grant}, {create}"))
            .replace(
                "    exports: [\n",
                &format!("    exports: [\n      {export}\n"),
            )
            // The first account with imports is PROJECT_DEMO.
            .replacen(
                "    imports: [\n",
                &format!("    imports: [\n      {import}\n"),
                1,
            );
        let gaps = crossing_gaps(&text);
        assert!(
            gaps.iter().any(|g| g.contains("scheduler-demo")
                && g.contains("$JS.API.CONSUMER.CREATE.KV_stagehand_stages")
                && g.contains("deliver subject")),
            "{gaps:?}"
        );
        for granted in [
            "$JS.API.CONSUMER.CREATE.KV_stagehand_stages",
            "$JS.API.CONSUMER.DURABLE.CREATE.STAGEHAND_FACTS.x",
            "$JS.FC.KV_stagehand_stages.>",
            "$JS.API.>",
            ">",
        ] {
            assert!(reaches_consumers(granted), "{granted}");
        }
        for granted in [
            "$JS.API.DIRECT.GET.KV_stagehand_stages.>",
            "$JS.API.STREAM.INFO.KV_stagehand_stages",
            "stagehand.req.stage.requested.*",
        ] {
            assert!(!reaches_consumers(granted), "{granted}");
        }
    }

    #[test]
    fn a_pattern_covers_what_it_matches() {
        assert!(covers("a.>", "a.b.c"));
        assert!(covers("a.*", "a.*"));
        assert!(covers("a.*.c", "a.b.c"));
        assert!(covers("a.b", "a.b"));
        assert!(!covers("a.*", "a.>"));
        assert!(!covers("a.*", "a.b.c"));
        assert!(!covers("a.>", "a"));
        assert!(!covers("a.b", "a.*"));
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
        // Subscribe grants are not publish grants, and read the same way.
        assert!(
            !scheduler.iter().any(|s| s.starts_with("_INBOX")),
            "{scheduler:?}"
        );
        assert_eq!(
            subscribe_allowed(&text, "TRAINER_LABB"),
            ["_INBOX_trainer-labb.>"]
        );
        let reads = subscribe_allowed(&text, "SCHEDULER");
        assert!(
            reads.contains(&"_INBOX_scheduler.>".to_string())
                && reads.contains(&"stagehand.progress.stage.requested.*.*".to_string()),
            "{reads:?}"
        );
        assert!(publish_allowed(&text, "NO_SUCH_ROLE").is_empty());
        // The operator has no block: no list (it may publish anything).
        assert!(publish_allowed(&text, "OPERATOR").is_empty());
    }
}
