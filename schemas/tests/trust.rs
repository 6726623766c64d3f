//! Who may say what, and where: the location rule (property-tested, since it is lexical), the
//! checks a consumer applies to an event against its subject, and the shipped NATS accounts
//! held to the table of roles (`schemas/README.md`, *Who may say what*).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use stagehand_schemas::layout::{self, Outside};
use stagehand_schemas::subject::{self, subject_for};
use stagehand_schemas::trust::{Refusal, Role, check_published, rule};
use stagehand_schemas::{ALL_KINDS, Body, Event, Location, REQUEST_KINDS, check_relative_path};

/// One path component as a hostile producer might write it: plain, dotted, empty, unicode.
fn component() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9_-]{1,8}",
        1 => Just(String::new()),
        1 => Just(".".to_owned()),
        2 => Just("..".to_owned()),
        1 => "[a-z]{0,3}\\.\\.[a-z]{0,3}",
        1 => "[éüßдемо日本]{1,4}",
        1 => Just("labb".to_owned()),
        1 => Just("demo".to_owned()),
    ]
}

fn rest() -> impl Strategy<Value = String> {
    proptest::collection::vec(component(), 1..6).prop_map(|parts| parts.join("/"))
}

fn project() -> impl Strategy<Value = String> {
    "[a-z0-9_-]{1,12}"
}

proptest! {
    /// Beneath `P/`, a prefix belongs to P exactly when it is a normalised relative path.
    #[test]
    fn beneath_the_project_folder_only_normalised_paths_belong(p in project(), r in rest()) {
        let prefix = format!("{p}/{r}");
        let accepted = layout::check_prefix_in_project(&p, &prefix).is_ok();
        prop_assert_eq!(accepted, check_relative_path(&prefix).is_ok(), "{}", prefix);
        if accepted {
            // What is accepted resolves, lexically, beneath P/: no component climbs.
            prop_assert!(prefix.split('/').all(|c| c != ".." && c != "." && !c.is_empty()));
            prop_assert!(prefix.split('/').count() >= 2);
        }
    }

    /// No prefix of another project belongs to P, however the two names relate (`labb` and
    /// `labb2`, `lab` and `labb`), and no prefix that climbs out (`P/../Q/x`) does either.
    #[test]
    fn another_projects_prefix_never_belongs(p in project(), q in project(), r in rest()) {
        prop_assume!(p != q);
        for prefix in [
            format!("{q}/{r}"),
            format!("{p}{q}/{r}"),
            format!("{p}/../{q}/{r}"),
            format!("{p}/{r}/../../{q}"),
            format!("/{p}/{r}"),
            format!("./{p}/{r}"),
            q.clone(),
            p.clone(),
        ] {
            prop_assert!(
                layout::check_prefix_in_project(&p, &prefix).is_err(),
                "{} accepted for {}", prefix, p
            );
        }
    }

    /// Any prefix with a `..` component is refused, wherever it stands.
    #[test]
    fn a_parent_component_is_always_refused(p in project(), a in rest(), b in rest()) {
        let prefix = format!("{p}/{a}/../{b}");
        prop_assert!(layout::check_prefix_in_project(&p, &prefix).is_err());
    }
}

#[test]
fn the_bare_project_folder_and_the_tier_root_are_refused() {
    assert_eq!(
        layout::check_prefix_in_project("demo", "demo"),
        Err(Outside::ProjectFolder)
    );
    assert_eq!(
        layout::check_prefix_in_project("demo", ""),
        Err(Outside::TierRoot)
    );
}

/// The examples' checkpoint commit, as project `project` with its location's prefix.
fn commit(project: &str, prefix: &str) -> Event {
    let mut event = common::example_event("checkpoint.committed");
    event.project = project.to_owned();
    let Body::CheckpointCommitted(p) = &mut event.body else {
        unreachable!()
    };
    p.location.prefix = prefix.to_owned();
    event
}

#[test]
fn every_example_passes_on_its_own_subject() {
    for event in common::all_examples() {
        let subject = subject_for(&event.body, &event.project);
        assert_eq!(
            check_published(&event, &subject),
            Ok(()),
            "{}",
            event.kind()
        );
    }
}

/// Issue 19 item 1: `trainer-demo` committed a checkpoint at project `labb`'s prefix.
#[test]
fn a_location_of_another_project_is_refused_naming_the_rule_field_and_prefix() {
    let event = commit("demo", "labb/runs/r1/step-1");
    let subject = subject_for(&event.body, "demo");
    let refusal = check_published(&event, &subject).unwrap_err();
    assert_eq!(refusal.rule(), rule::OUTSIDE_PROJECT);
    let text = refusal.to_string();
    for part in [
        "outside_project",
        "payload.location",
        "labb/runs/r1/step-1",
        "\"demo\"",
    ] {
        assert!(text.contains(part), "{part} missing from {text}");
    }
    // A demotion is checked on both ends.
    let mut demoted = common::example_event("checkpoint.demoted");
    let Body::CheckpointDemoted(p) = &mut demoted.body else {
        unreachable!()
    };
    p.to = Location {
        tier: "capacity".into(),
        prefix: "other-lab/x".into(),
    };
    let refusal = demoted.check_locations().unwrap_err();
    assert!(matches!(
        refusal,
        Refusal::OutsideProject {
            field: "payload.to",
            ..
        }
    ));
}

#[test]
fn an_event_on_another_kinds_or_projects_subject_is_refused() {
    let event = commit("demo", "demo/runs/r1/step-1");
    let refusal = check_published(&event, "stagehand.fact.dataset.validated.demo").unwrap_err();
    assert_eq!(refusal.rule(), rule::SUBJECT_KIND);
    assert!(
        refusal.to_string().contains("\"dataset.validated\""),
        "{refusal}"
    );
    let refusal = check_published(&event, "stagehand.fact.checkpoint.committed.labb").unwrap_err();
    assert_eq!(refusal.rule(), rule::SUBJECT_PROJECT);
    assert!(refusal.to_string().contains("\"labb\""), "{refusal}");
    // A request kind on the facts' class is another kind's subject too.
    let refusal = check_published(&event, "stagehand.req.checkpoint.committed.demo").unwrap_err();
    assert_eq!(refusal.rule(), rule::SUBJECT_KIND);
    // A subject outside Stagehand's names no kind or project; the locations still count.
    assert_eq!(check_published(&event, "test.stream.x"), Ok(()));
    assert!(check_published(&commit("demo", "labb/x"), "test.stream.x").is_err());
}

/// An event about a node's local tier travels on its own node's subject: one stated for
/// `gpu-07` on `gpu-08`'s subject (where `gpu-08`'s services alone listen, and which
/// `gpu-08`'s credentials may publish) is refused, for every kind that names a node.
#[test]
fn an_event_on_another_nodes_subject_is_refused() {
    let kinds = (ALL_KINDS.iter()).filter(|k| subject::may_name_node(k));
    for kind in kinds {
        let mut json = common::example_json(kind);
        json["payload"]["node"] = "gpu-07".into();
        let event: Event = serde_json::from_value(json).expect(kind);
        assert_eq!(event.body.node(), Some("gpu-07"), "{kind}");
        let own = subject_for(&event.body, &event.project);
        assert!(
            own.ends_with(&format!(".gpu-07.{}", event.project)),
            "{own}"
        );
        assert_eq!(check_published(&event, &own), Ok(()), "{kind}");
        let elsewhere = own.replace(".gpu-07.", ".gpu-08.");
        let refusal = check_published(&event, &elsewhere).unwrap_err();
        assert_eq!(refusal.rule(), rule::SUBJECT_KIND, "{kind}");
        assert!(refusal.to_string().contains("gpu-08"), "{refusal}");
        // Nor on the subject of an event about no node (a shared tier's).
        let unrouted = subject::kind_subject(
            subject::class_of_subject(&own).unwrap(),
            kind,
            &event.project,
        );
        assert!(check_published(&event, &unrouted).is_err(), "{kind}");
    }
    // Nor the other way: an event about a shared tier on a node's subject.
    let shared = common::example_event("stage.ready");
    assert_eq!(shared.body.node(), None);
    let on_a_node =
        subject::node_kind_subject(subject::FACT, "stage.ready", "gpu-07", &shared.project);
    let refusal = check_published(&shared, &on_a_node).unwrap_err();
    assert_eq!(refusal.rule(), rule::SUBJECT_KIND);
}

/// Every kind whose body can name a node is routed by it: the list of such kinds
/// (`subject::may_name_node`) and the bodies (`Body::node`) agree, so no body that names a node
/// travels on a subject every node's services may be handed.
#[test]
fn every_kind_that_can_name_a_node_travels_on_its_nodes_subject() {
    let mut routed = 0;
    for kind in ALL_KINDS {
        let mut json = common::example_json(kind);
        json["payload"]["node"] = "gpu-07".into();
        // A body with no `node` may refuse the field: it names no node either way.
        let Ok(event) = serde_json::from_value::<Event>(json) else {
            assert!(!subject::may_name_node(kind), "{kind}");
            continue;
        };
        assert_eq!(
            event.body.node().is_some(),
            subject::may_name_node(kind),
            "{kind}"
        );
        routed += usize::from(subject::may_name_node(kind));
    }
    assert_eq!(routed, 14, "the kinds that name a node, each checked");
}

/// An ingest request outside its project reaches the validator, which rejects it naming the
/// same rule (a verdict for the uploader, not a dead letter); a fact never passes.
#[test]
fn a_requests_location_is_its_consumers_to_answer() {
    let mut request = common::example_event("ingest.requested");
    let Body::IngestRequested(p) = &mut request.body else {
        unreachable!()
    };
    p.source.prefix = "other-lab/uploads/1".into();
    let subject = subject_for(&request.body, &request.project);
    assert_eq!(check_published(&request, &subject), Ok(()));
    assert_eq!(
        request.check_locations().unwrap_err().rule(),
        rule::OUTSIDE_PROJECT
    );
}

/// The publish allow-list of every permissions block (`NAME = { publish: { allow: [...] } }`)
/// of an accounts config: the quoted strings between `publish:` and `subscribe:`.
fn publish_allows(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut blocks = BTreeMap::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line.strip_suffix(" = {") else {
            continue;
        };
        let mut body = String::new();
        for l in lines.by_ref() {
            if l == "}" {
                break;
            }
            // Comments may quote subjects; they grant nothing.
            body.push_str(l.split('#').next().unwrap_or(""));
            body.push('\n');
        }
        let publish = body
            .split_once("publish:")
            .map(|(_, p)| p.split("subscribe:").next().unwrap_or(p))
            .unwrap_or("");
        let allowed = publish
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        blocks.insert(name.trim().to_owned(), allowed);
    }
    blocks
}

/// The `permissions: $BLOCK` each user of the accounts config has (none: the operator).
fn users(text: &str) -> BTreeMap<String, Option<String>> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("{ user: "))
        .map(|l| {
            let user = l.split(',').next().unwrap_or("").trim().to_owned();
            let block = l
                .split("permissions: $")
                .nth(1)
                .map(|b| b.trim_end_matches(['}', ' ']).trim().to_owned());
            (user, block)
        })
        .collect()
}

/// The node the shipped accounts config declares a node user for (`NODE_GPU_01`).
const SHIPPED_NODE: &str = "gpu-01";

/// The request and fact subjects `role` may publish on, ending in `token`: one project, or
/// `*` for a role acting for every project. A role acting for one node publishes on that
/// node's subjects alone, of every project.
fn subjects_of(role: Role, token: &str) -> BTreeSet<String> {
    if role.per_node() {
        return role
            .kinds()
            .into_iter()
            .map(|kind| subject::node_kind_filter(subject::FACT, kind, token))
            .collect();
    }
    role.kinds()
        .into_iter()
        .filter(|kind| !kind.starts_with("dead.letter"))
        .flat_map(|kind| {
            let class = if REQUEST_KINDS.contains(&kind) {
                "req"
            } else {
                "fact"
            };
            // A checkpoint part's subject names its node before the project, any node; a
            // stage request's may (one for a node's local tier) or may not.
            let mut subjects = Vec::new();
            if !stagehand_schemas::subject::routed_by_node(kind) {
                subjects.push(format!("stagehand.{class}.{kind}.{token}"));
            }
            let routed = stagehand_schemas::subject::routed_by_node(kind);
            if stagehand_schemas::subject::may_name_node(kind)
                && (routed || role.states_on_node_subjects())
            {
                subjects.push(format!("stagehand.{class}.{kind}.*.{token}"));
            }
            subjects
        })
        .collect()
}

/// Each shipped user may publish exactly the `stagehand.req`/`stagehand.fact` subjects of the
/// kinds the table lets its role state: no more, no less. The operator is exempt.
#[test]
fn each_shipped_user_publishes_exactly_what_its_role_may_state() {
    let path = common::crate_dir().join("../deploy/nats/accounts.conf");
    let text = std::fs::read_to_string(&path).unwrap();
    let blocks = publish_allows(&text);
    let users = users(&text);
    let project = "demo";
    let mut checked = BTreeSet::new();
    for (user, block) in &users {
        let Some(block) = block else {
            assert!(
                user == "operator" || user == "sys",
                "user {user} has no permissions: only the operator may"
            );
            continue;
        };
        // A role acting for every project has one block (`SCHEDULER`); a per-project role,
        // or a scheduler deployed for one project only (a Kubernetes namespace's init
        // container), has one block per project (`SCHEDULER_DEMO`), granted that project's
        // subjects alone.
        let (role, token) = Role::ALL
            .iter()
            .copied()
            .filter(|r| *r != Role::Operator)
            .find_map(|r| {
                let name = r.as_str().to_ascii_uppercase().replace('-', "_");
                let for_project = format!("{name}_{}", project.to_ascii_uppercase());
                let for_node =
                    format!("{name}_{}", SHIPPED_NODE.to_ascii_uppercase()).replace('-', "_");
                if r.per_node() {
                    (&for_node == block).then_some((r, SHIPPED_NODE))
                } else if &for_project == block {
                    Some((r, project))
                } else if !r.per_project() && &name == block {
                    Some((r, "*"))
                } else {
                    None
                }
            })
            .unwrap_or_else(|| panic!("user {user}'s block {block} is no role of the table"));
        let granted: BTreeSet<String> = blocks[block]
            .iter()
            .filter(|s| s.starts_with("stagehand.req.") || s.starts_with("stagehand.fact."))
            .cloned()
            .collect();
        assert_eq!(
            granted,
            subjects_of(role, token),
            "user {user} ({role}) in {}",
            path.display()
        );
        checked.insert(role);
    }
    let roles: BTreeSet<Role> = Role::ALL
        .iter()
        .copied()
        .filter(|r| *r != Role::Operator)
        .collect();
    assert_eq!(checked, roles, "every role of the table has a shipped user");
}

/// The README's table is the Rust table: one row per kind naming exactly its roles.
#[test]
fn the_readme_table_is_the_rust_table() {
    let readme = std::fs::read_to_string(common::crate_dir().join("README.md")).unwrap();
    let section = readme
        .split("## Who may say what")
        .nth(1)
        .expect("schemas/README.md has a *Who may say what* section");
    for kind in ALL_KINDS {
        let row = section
            .lines()
            .find(|l| l.starts_with(&format!("| `{kind}` |")))
            .unwrap_or_else(|| panic!("no row for {kind} in *Who may say what*"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let listed: BTreeSet<&str> = cells[2]
            .split(',')
            .map(|r| r.trim().trim_matches('`'))
            .filter(|r| !r.is_empty())
            .collect();
        let table: BTreeSet<&str> = stagehand_schemas::trust::stated_by(kind)
            .iter()
            .map(|r| r.as_str())
            .collect();
        assert_eq!(listed, table, "README row for {kind}");
    }
}
