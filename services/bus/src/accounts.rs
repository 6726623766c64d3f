//! The users of `deploy/nats/accounts.conf` that an operator adds as a cluster grows: a node's
//! (its promoter agent's and demoter's) and a project's tenants' (its uploader, training jobs
//! and Kubernetes init containers), by the recipes deploy/README.md gives (*Adding a node*,
//! *Adding a project*). `stagehand accounts add-node` and `add-project` run them for an
//! operator; the test kit runs them for the tests' nodes and projects. One definition, so that
//! what the tests prove of a user is what an operator deploys.

use stagehand_schemas::subject::node_token;

/// The node the shipped accounts config declares its node user for (`NODE_GPU_01`, user
/// `node-gpu-01`): the services of one node, its promoter agent and its demoter.
pub const SHIPPED_NODE: &str = "gpu-01";

/// The project the shipped accounts config declares its tenants for (`UPLOADER_DEMO`,
/// `TRAINER_DEMO`, `SCHEDULER_DEMO`, the account `PROJECT_DEMO`).
pub const SHIPPED_PROJECT: &str = "demo";

/// The role (and permissions block) of `node`'s user: `NODE_GPU_01`.
pub fn node_role(node: &str) -> String {
    format!(
        "NODE_{}",
        node_token(node).to_ascii_uppercase().replace('-', "_")
    )
}

/// The user of `node`'s services: `node-gpu-01`.
pub fn node_user(node: &str) -> String {
    format!("node-{}", node_token(node))
}

/// The inbox prefix `node`'s services use (`bus.inbox_prefix`): the one its user may
/// subscribe to, and whose inboxes the recorder answers on.
pub fn node_inbox_prefix(node: &str) -> String {
    format!("_INBOX_node.{}", node_token(node))
}

/// The account a project's tenant users (its uploader and training jobs) are in.
pub fn project_account(project: &str) -> String {
    format!("PROJECT_{}", project.to_ascii_uppercase())
}

/// Why users could not be added to an accounts config.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecipeError {
    /// The config is not of the shipped shape: it lacks what the recipe copies.
    #[error(
        "the accounts config is not of the shipped shape: {found}, where the recipe copies \
         {expected} (deploy/README.md, \"{recipe}\")"
    )]
    Shape {
        recipe: &'static str,
        expected: String,
        found: String,
    },
    /// A user the recipe would add is in the config already.
    #[error("{what} {name:?}: its user {user} is in the accounts config already")]
    Present {
        what: &'static str,
        name: String,
        user: String,
    },
}

/// Appends to `out` a copy of `lines` for each of `names`, each line renamed for it by
/// `rename`; with `apart`, each copy after a blank line (a block), else right after the
/// original (a line of a list).
fn push_copies(
    out: &mut String,
    lines: &[&str],
    names: &[&str],
    rename: impl Fn(&str, &str) -> String,
    apart: bool,
) {
    for name in names {
        if apart {
            out.push('\n');
        }
        for line in lines {
            out.push_str(&rename(line, name));
            out.push('\n');
        }
    }
}

/// Refuses when a user line `{ user: <user(name)>,` of any of `names` is in `text`.
fn none_present(
    text: &str,
    what: &'static str,
    names: &[&str],
    users: impl Fn(&str) -> Vec<String>,
) -> Result<(), RecipeError> {
    for name in names {
        for user in users(name) {
            let line = format!("{{ user: {user},");
            if text.lines().any(|l| l.trim_start().starts_with(&line)) {
                return Err(RecipeError::Present {
                    what,
                    name: (*name).to_owned(),
                    user,
                });
            }
        }
    }
    Ok(())
}

/// `text` (an accounts config of the shipped shape) with a user for each of `nodes` besides
/// [`SHIPPED_NODE`]: the permissions block `NODE_GPU_01 = { … }` and the user line of
/// `node-gpu-01`, each copied right after the original with the node's token
/// ([`node_token`]) for `gpu-01` and its role for `NODE_GPU_01`. The password of each new
/// user comes from `STAGEHAND_NATS_<ROLE>_PASSWORD`, which the server's environment must set.
pub fn with_node_users(text: &str, nodes: &[&str]) -> Result<String, RecipeError> {
    none_present(text, "node", nodes, |n| vec![node_user(n)])?;
    let shipped_role = node_role(SHIPPED_NODE);
    let shipped_block = format!("{shipped_role} = {{");
    let shipped_user = format!("{{ user: {},", node_user(SHIPPED_NODE));
    let for_node = |line: &str, node: &str| {
        line.replace(&shipped_role, &node_role(node))
            .replace(SHIPPED_NODE, &node_token(node))
    };
    let mut out = String::with_capacity(text.len() * (1 + nodes.len()));
    let mut block: Option<Vec<&str>> = None;
    let (mut blocks, mut users) = (0, 0);
    for line in text.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(lines) = block.as_mut() {
            lines.push(line);
            if line == "}" {
                push_copies(&mut out, lines, nodes, for_node, true);
                block = None;
                blocks += 1;
            }
            continue;
        }
        if line.starts_with(&shipped_block) {
            block = Some(vec![line]);
        } else if line.trim_start().starts_with(&shipped_user) {
            push_copies(&mut out, &[line], nodes, for_node, false);
            users += 1;
        }
    }
    if (blocks, users) != (1, 1) {
        return Err(RecipeError::Shape {
            recipe: "Adding a node",
            expected: format!(
                "one `{shipped_role} = {{ … }}` block and one user line `{shipped_user} …`"
            ),
            found: format!("{blocks} block(s) and {users} user line(s)"),
        });
    }
    Ok(out)
}

/// `text` (an accounts config of the shipped shape) with tenants of each of `projects` besides
/// [`SHIPPED_PROJECT`]: every block whose name ends in `_DEMO` (the uploader's, training
/// jobs' and init containers' permissions, the account `PROJECT_DEMO` with their users and
/// imports) is copied for each project; every other line naming the demo project's upload
/// bucket (the services' grants on it) or exporting to `PROJECT_DEMO` alone is repeated for
/// each; and an export shared by every project (`accounts: [SCHEDULERS, PROJECT_DEMO]`) lists
/// each project's account too. The passwords of the new users come from
/// `STAGEHAND_NATS_<ROLE>_<P>_PASSWORD`, which the server's environment must set.
pub fn with_project_users(text: &str, projects: &[&str]) -> Result<String, RecipeError> {
    none_present(text, "project", projects, |p| {
        ["uploader", "trainer", "scheduler"]
            .iter()
            .map(|role| format!("{role}-{p}"))
            .collect()
    })?;
    let demo_upper = format!("_{}", SHIPPED_PROJECT.to_ascii_uppercase());
    let demo_bucket = format!("stagehand_uploads_{SHIPPED_PROJECT}");
    let demo_account = project_account(SHIPPED_PROJECT);
    let for_project = |line: &str, project: &str| {
        line.replace(&demo_upper, &format!("_{}", project.to_ascii_uppercase()))
            .replace(&demo_bucket, &format!("stagehand_uploads_{project}"))
            .replace(&format!("-{SHIPPED_PROJECT}"), &format!("-{project}"))
            .replace(&format!(".{SHIPPED_PROJECT}"), &format!(".{project}"))
    };
    let mut out = String::with_capacity(text.len() * 2);
    // A block being copied: its lines so far and the line that closes it.
    let mut block: Option<(Vec<&str>, String)> = None;
    let (mut blocks, mut grants, mut shared) = (0, 0, 0);
    for line in text.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some((lines, close)) = block.as_mut() {
            lines.push(line);
            if line == close.as_str() {
                push_copies(&mut out, lines, projects, for_project, true);
                block = None;
                blocks += 1;
            }
            continue;
        }
        let code = line.trim_start();
        if code.starts_with('#') {
            continue;
        }
        let head = code.split_whitespace().next().unwrap_or("");
        // The accounts an export line names, and where that list is in the line.
        let exports_to = line.find("accounts: [").and_then(|at| {
            let open = at + "accounts: [".len();
            let close = open + line[open..].find(']')?;
            let to: Vec<&str> = line[open..close].split(',').map(str::trim).collect();
            Some((open..close, to))
        });
        if head.ends_with(&demo_upper) && code.trim_end().ends_with('{') {
            let indent = &line[..line.len() - code.len()];
            block = Some((vec![line], format!("{indent}}}")));
        } else if let Some((span, to)) = exports_to.filter(|(_, to)| to.len() > 1) {
            if to.contains(&demo_account.as_str()) {
                let mut with: Vec<String> = to.iter().map(|a| a.to_string()).collect();
                with.extend(projects.iter().map(|p| project_account(p)));
                out.truncate(out.len() - line.len() - 1);
                out.push_str(&line[..span.start]);
                out.push_str(&with.join(", "));
                out.push_str(&line[span.end..]);
                out.push('\n');
                shared += 1;
            }
        } else if line.contains(&demo_bucket) || line.contains(&format!("[{demo_account}]")) {
            push_copies(&mut out, &[line], projects, for_project, false);
            grants += 1;
        }
    }
    if blocks < 3 || grants == 0 || shared == 0 {
        return Err(RecipeError::Shape {
            recipe: "Adding a project",
            expected: format!(
                "the blocks of project {SHIPPED_PROJECT} (permissions, account), the grants and \
                 exports naming it, and the exports it shares"
            ),
            found: format!("{blocks} block(s), {grants} line(s) and {shared} shared export(s)"),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPED: &str = "NODE_GPU_01 = {\n  publish: { allow: [\"a.gpu-01.*\"] }\n}\n\
                          users: [\n  { user: node-gpu-01, password: $STAGEHAND_NATS_NODE_GPU_01_PASSWORD, permissions: $NODE_GPU_01 }\n]\n";

    #[test]
    fn each_node_gets_the_block_and_the_user_line_in_its_own_name() {
        let out = with_node_users(SHAPED, &["gpu-07", "n_b"]).unwrap();
        assert!(out.contains("NODE_GPU_07 = {\n  publish: { allow: [\"a.gpu-07.*\"] }\n}\n"));
        assert!(out.contains("{ user: node-gpu-07, password: $STAGEHAND_NATS_NODE_GPU_07_PASSWORD, permissions: $NODE_GPU_07 }"));
        assert!(out.contains("NODE_N_B = {\n  publish: { allow: [\"a.n_b.*\"] }"));
        // The shipped node's own block and user are kept as they were.
        assert!(out.starts_with(SHAPED.lines().next().unwrap()));
        assert_eq!(out.matches("NODE_GPU_01 = {").count(), 1);
    }

    #[test]
    fn a_config_of_another_shape_or_a_node_present_is_refused_and_a_dns_name_is_its_token() {
        assert!(matches!(
            with_node_users("users: []\n", &["gpu-07"]),
            Err(RecipeError::Shape { .. })
        ));
        assert!(matches!(
            with_node_users(SHAPED, &["gpu-01"]),
            Err(RecipeError::Present { .. })
        ));
        let added = with_node_users(SHAPED, &["gpu-07"]).unwrap();
        assert!(matches!(
            with_node_users(&added, &["gpu-07"]),
            Err(RecipeError::Present { .. })
        ));
        // A DNS name (dots, capitals) is written as its token, in the user and the block.
        let dns = with_node_users(SHAPED, &["GPU-07.cluster.local"]).unwrap();
        let token = node_token("GPU-07.cluster.local");
        assert!(dns.contains(&format!("{{ user: node-{token},")), "{dns}");
        assert!(dns.contains(&format!("\"a.{token}.*\"")), "{dns}");
    }

    const PROJECT_SHAPED: &str = "UPLOADER_DEMO = {\n  publish: { allow: [\"stagehand.req.ingest.requested.demo\"] }\n}\n\
        TRAINER_DEMO = {\n  publish: { allow: [\"stagehand.fact.checkpoint.committed.demo\"] }\n}\n\
        accounts: {\n  STAGEHAND: {\n    exports: [\n      { stream: \"x\", accounts: [SCHEDULERS, PROJECT_DEMO] }\n      { service: \"y.demo\", accounts: [PROJECT_DEMO] }\n    ]\n  }\n  PROJECT_DEMO {\n    users: [\n      { user: uploader-demo, permissions: $UPLOADER_DEMO }\n    ]\n  }\n}\n";

    #[test]
    fn each_project_gets_its_blocks_grants_and_a_place_in_shared_exports() {
        let out = with_project_users(PROJECT_SHAPED, &["labb"]).unwrap();
        assert!(out.contains(
            "UPLOADER_LABB = {\n  publish: { allow: [\"stagehand.req.ingest.requested.labb\"] }\n}"
        ));
        assert!(out.contains("TRAINER_LABB = {"));
        assert!(out.contains("  PROJECT_LABB {\n    users: [\n      { user: uploader-labb, permissions: $UPLOADER_LABB }\n    ]\n  }"));
        assert!(out.contains("accounts: [SCHEDULERS, PROJECT_DEMO, PROJECT_LABB] }"));
        assert!(out.contains("{ service: \"y.labb\", accounts: [PROJECT_LABB] }"));
        assert!(matches!(
            with_project_users(&out, &["labb"]),
            Err(RecipeError::Present { .. })
        ));
        assert!(matches!(
            with_project_users(SHAPED, &["labb"]),
            Err(RecipeError::Shape { .. })
        ));
    }
}
