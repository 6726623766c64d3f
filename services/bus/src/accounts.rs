//! A node's NATS user in `deploy/nats/accounts.conf`: its name, its permissions block and
//! the inbox prefix its services use, and the recipe that adds one for each new node
//! (deploy/README.md, *Adding a node*). `stagehand accounts add-node` runs the recipe for an
//! operator; the test kit runs it for the tests' nodes. One definition, so that what the
//! tests prove of a node's user is what an operator deploys.

use stagehand_schemas::subject::node_token;

/// The node the shipped accounts config declares its node user for (`NODE_GPU_01`, user
/// `node-gpu-01`): the services of one node, its promoter agent and its demoter.
pub const SHIPPED_NODE: &str = "gpu-01";

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

/// Why a node's user could not be added to an accounts config.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddNodeError {
    /// The config is not of the shipped shape: it lacks the block or the user line the recipe
    /// copies (or has more than one of either).
    #[error(
        "the accounts config has {blocks} `{block} = {{ … }}` block(s) and {users} user line(s) \
         `{{ user: {user}, …`; the recipe copies exactly one of each (deploy/README.md, \
         \"Adding a node\")"
    )]
    Shape {
        block: String,
        user: String,
        blocks: usize,
        users: usize,
    },
    /// The node's user is in the config already.
    #[error("node {node:?}: its user {user} is in the accounts config already")]
    Present { node: String, user: String },
}

/// `text` (an accounts config of the shipped shape) with a user for each of `nodes` besides
/// [`SHIPPED_NODE`]: the permissions block `NODE_GPU_01 = { … }` and the user line of
/// `node-gpu-01`, each copied right after the original with the node's token
/// ([`node_token`]) for `gpu-01` and its role for `NODE_GPU_01`. The password of each new
/// user comes from `STAGEHAND_NATS_<ROLE>_PASSWORD`, which the server's environment must set.
pub fn with_node_users(text: &str, nodes: &[&str]) -> Result<String, AddNodeError> {
    let shipped_role = node_role(SHIPPED_NODE);
    let shipped_block = format!("{shipped_role} = {{");
    let shipped_user = format!("{{ user: {},", node_user(SHIPPED_NODE));
    for node in nodes {
        let user = format!("{{ user: {},", node_user(node));
        if text.lines().any(|l| l.trim_start().starts_with(&user)) {
            return Err(AddNodeError::Present {
                node: (*node).to_owned(),
                user: node_user(node),
            });
        }
    }
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
                for node in nodes {
                    out.push('\n');
                    for l in lines.iter() {
                        out.push_str(&for_node(l, node));
                        out.push('\n');
                    }
                }
                block = None;
                blocks += 1;
            }
            continue;
        }
        if line.starts_with(&shipped_block) {
            block = Some(vec![line]);
        } else if line.trim_start().starts_with(&shipped_user) {
            for node in nodes {
                out.push_str(&for_node(line, node));
                out.push('\n');
            }
            users += 1;
        }
    }
    if (blocks, users) != (1, 1) {
        return Err(AddNodeError::Shape {
            block: shipped_role,
            user: node_user(SHIPPED_NODE),
            blocks,
            users,
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
            Err(AddNodeError::Shape {
                blocks: 0,
                users: 0,
                ..
            })
        ));
        assert!(matches!(
            with_node_users(SHAPED, &["gpu-01"]),
            Err(AddNodeError::Present { .. })
        ));
        let added = with_node_users(SHAPED, &["gpu-07"]).unwrap();
        assert!(matches!(
            with_node_users(&added, &["gpu-07"]),
            Err(AddNodeError::Present { .. })
        ));
        // A DNS name (dots, capitals) is written as its token, in the user and the block.
        let dns = with_node_users(SHAPED, &["GPU-07.cluster.local"]).unwrap();
        let token = node_token("GPU-07.cluster.local");
        assert!(dns.contains(&format!("{{ user: node-{token},")), "{dns}");
        assert!(dns.contains(&format!("\"a.{token}.*\"")), "{dns}");
    }
}
