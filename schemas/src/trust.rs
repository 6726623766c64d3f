//! Who may say what, and where: the roles that may state each kind of event, and the checks
//! every consumer applies to an event before it reads a byte or folds anything it names.
//!
//! Trust is per fact, not per connection. NATS permissions (`deploy/nats/accounts.conf`) let
//! each role publish only the subjects of the kinds [`stated_by`] gives it; a consumer cannot
//! see who published a message, so it holds the message to its subject instead
//! ([`check_published`]): the body's kind is the subject's kind, the envelope's project is the
//! subject's project, and every location the event names lies beneath that project's folder
//! ([`crate::layout::check_location`]). Together, an event that passes names only what its
//! publisher's role may say about its own project.

use crate::event::{Body, Event};
use crate::layout::LocationError;
use crate::subject::{ROOT, subject_for};

/// A role that states events: one NATS user (or one per project) in the shipped accounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A lab's uploader (`stagehand ingest`), one per project.
    Uploader,
    /// A project's training jobs (`stagehand checkpoint commit`), one per project.
    Trainer,
    /// A scheduler plugin (Slurm burst buffer, Kubernetes init container).
    Scheduler,
    IngestValidator,
    Resharder,
    Promoter,
    Demoter,
    /// One node's promoter agent and demoter: one user per node, whose facts are all about
    /// that node's local tier and travel on its node's subjects.
    Node,
    BackupCopier,
    CatalogueRecorder,
    /// On-call and the `stagehand` CLI's administrative commands: may state anything (a
    /// replay republishes any kind), so it is exempt from the table.
    Operator,
}

impl Role {
    /// Every role, in the order of the table in `schemas/README.md`.
    pub const ALL: &'static [Role] = &[
        Role::Uploader,
        Role::Trainer,
        Role::Scheduler,
        Role::IngestValidator,
        Role::Resharder,
        Role::Promoter,
        Role::Demoter,
        Role::Node,
        Role::BackupCopier,
        Role::CatalogueRecorder,
        Role::Operator,
    ];

    /// The role's name as the table writes it (`ingest-validator`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Uploader => "uploader",
            Role::Trainer => "trainer",
            Role::Scheduler => "scheduler",
            Role::IngestValidator => "ingest-validator",
            Role::Resharder => "resharder",
            Role::Promoter => "promoter",
            Role::Demoter => "demoter",
            Role::Node => "node",
            Role::BackupCopier => "backup-copier",
            Role::CatalogueRecorder => "catalogue-recorder",
            Role::Operator => "operator",
        }
    }

    /// Whether the role acts for one project only (one user per project: its subjects end
    /// in that project) rather than for every project (its subjects end in `*`).
    pub fn per_project(self) -> bool {
        matches!(self, Role::Uploader | Role::Trainer)
    }

    /// Whether the role acts for one node only (one user per node: its subjects name that
    /// node before the project, `<kind>.<node>.*`).
    pub fn per_node(self) -> bool {
        self == Role::Node
    }

    /// Whether the role states the kinds that may name a node on a node's subject too
    /// (`<kind>.<node>.<project>`: a copy on a node-local tier, a stage addressed to a node).
    /// Every role but the shared demoter: a node's demoter runs as its node's user, so the
    /// shared one speaks of shared tiers' copies alone, apart from the kinds every subject of
    /// which names a node (`replica.unreachable`: it judges a node silent).
    pub fn states_on_node_subjects(self) -> bool {
        self != Role::Demoter
    }

    /// Whether the role is one of Stagehand's services (each publishes its own dead letters).
    pub fn is_service(self) -> bool {
        matches!(
            self,
            Role::IngestValidator
                | Role::Resharder
                | Role::Promoter
                | Role::Demoter
                | Role::BackupCopier
                | Role::CatalogueRecorder
        )
    }

    /// The kinds of request and fact this role may state (dead letters aside: every service
    /// states its own). The operator may state any kind and is listed with none.
    pub fn kinds(self) -> Vec<&'static str> {
        crate::event::ALL_KINDS
            .iter()
            .copied()
            .filter(|kind| stated_by(kind).contains(&self))
            .collect()
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The roles that may state an event of `kind` (`schemas/README.md`, *Who may say what*).
/// Dead letters are stated by every service on its own subject; the operator, exempt, is
/// named only where it alone states a kind (`dead.letter.replayed`, `operator.action`). An unknown kind: nobody.
pub fn stated_by(kind: &str) -> &'static [Role] {
    use Role::*;
    match kind {
        "ingest.requested" => &[Uploader],
        "dataset.validated" | "dataset.rejected" => &[IngestValidator],
        "dataset.prepared" => &[Resharder],
        "stage.requested" | "stage.released" => &[Scheduler],
        // A node's agent states these about its local tier alone (on its node's subjects);
        // the shared promoter and demoter about every tier.
        "stage.pending" | "stage.ready" | "stage.failed" => &[Promoter, Node],
        "replica.created" | "replica.damaged" => &[Promoter, Demoter, Node],
        // A node's demoter removes and scrubs its node's copies (on its node's subjects).
        "replica.removed" | "replica.verified" => &[Demoter, Node],
        // The scrub repairs capacity and backup copies; the promoter the hot and node-local
        // copies it wrote, when jobs hold them.
        "replica.repaired" => &[Promoter, Demoter, Node],
        "replica.unreachable" => &[Demoter],
        // A step committed in parts on node-local tiers is announced whole by a node's agent
        // once every part is offloaded (`services/promoter`, "Checkpoints offloaded").
        "checkpoint.committed" => &[Trainer, Promoter],
        "checkpoint.part.committed" => &[Trainer],
        // A node's agent removes its node's part once the step is committed whole.
        "checkpoint.part.offloaded" | "checkpoint.part.removed" => &[Promoter, Node],
        "checkpoint.demoted" | "checkpoint.expired" | "checkpoint.held" => &[Demoter],
        "backup.completed" | "restore.verified" | "restore.failed" => &[BackupCopier],
        "dead.letter" => &[
            IngestValidator,
            Resharder,
            Promoter,
            Demoter,
            BackupCopier,
            CatalogueRecorder,
        ],
        "dead.letter.replayed" | "operator.action" => &[Operator],
        _ => &[],
    }
}

impl Body {
    /// The roles that may state this kind ([`stated_by`]).
    pub fn stated_by(&self) -> &'static [Role] {
        stated_by(self.kind())
    }
}

/// Why a consumer refuses an event before reading or folding anything it names. Each names
/// its rule ([`Refusal::rule`]), the field and the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The body's kind is not the kind its subject names (for a kind routed by node, the kind
    /// and node: `subject_kind` is then `<kind>.<node token>`).
    #[error(
        "refused ({rule}): event {id} is a {kind:?} but was published on {subject}, whose kind is {subject_kind:?}; an event travels only on its own kind's subject (a checkpoint part's: its own node's too)",
        rule = rule::SUBJECT_KIND
    )]
    SubjectKind {
        id: String,
        kind: &'static str,
        subject: String,
        subject_kind: String,
    },
    /// The envelope's project is not the project its subject names.
    #[error(
        "refused ({rule}): event {id} of project {project:?} was published on {subject} (project {subject_project:?}): an event may only travel on its own project's subjects",
        rule = rule::SUBJECT_PROJECT
    )]
    SubjectProject {
        id: String,
        project: String,
        subject: String,
        subject_project: String,
    },
    /// A location the event names lies outside its project's folder.
    #[error(
        "refused ({rule}): event {id} ({kind}) names in `{field}` a {location}; nothing there is read, copied or recorded",
        rule = rule::OUTSIDE_PROJECT
    )]
    OutsideProject {
        id: String,
        kind: &'static str,
        /// The payload field, e.g. `payload.location`.
        field: &'static str,
        /// Boxed: the common answer, `Ok`, stays small.
        location: Box<LocationError>,
    },
}

/// The stable names of the rules a [`Refusal`] cites.
pub mod rule {
    /// The body's kind must be the subject's kind token.
    pub const SUBJECT_KIND: &str = "subject_kind";
    /// The envelope's project must be the subject's project token.
    pub const SUBJECT_PROJECT: &str = "subject_project";
    /// Every location an event names lies beneath its project's folder; the same code as
    /// the ingest validator's rejection problem (`problem::code::OUTSIDE_PROJECT`).
    pub const OUTSIDE_PROJECT: &str = crate::problem::code::OUTSIDE_PROJECT;
}

impl Refusal {
    /// The rule the event breaks ([`rule`]).
    pub fn rule(&self) -> &'static str {
        match self {
            Refusal::SubjectKind { .. } => rule::SUBJECT_KIND,
            Refusal::SubjectProject { .. } => rule::SUBJECT_PROJECT,
            Refusal::OutsideProject { .. } => rule::OUTSIDE_PROJECT,
        }
    }
}

impl crate::Retryable for Refusal {
    /// Always false: the same event is refused the same way on every delivery.
    fn is_retryable(&self) -> bool {
        false
    }
}

impl Event {
    /// Every location this event names lies beneath its own project's folder
    /// ([`crate::layout::check_location`]); the first that does not is the error.
    pub fn check_locations(&self) -> Result<(), Refusal> {
        for (field, location) in self.body.locations() {
            crate::layout::check_location(&self.project, location).map_err(|location| {
                Refusal::OutsideProject {
                    id: self.id.to_string(),
                    kind: self.kind(),
                    field,
                    location: Box::new(location),
                }
            })?;
        }
        Ok(())
    }
}

/// The checks a consumer applies to an event that arrived on `subject`, before anything else:
/// on a Stagehand subject (`stagehand.<class>.…`) the subject must be exactly the one the event
/// is published on ([`subject_for`]): its kind and its project (a dead letter: its service);
/// and, on any subject, every location a fact names must belong to the event's project
/// ([`Event::check_locations`]). Subjects outside Stagehand's (a test's own stream) carry no
/// kind or project to compare.
///
/// A request's locations (an `ingest.requested` source) are its consumer's to answer: the
/// ingest validator rejects one outside the project with `outside_project` through the same
/// rule, reading nothing, so that the uploader gets a verdict rather than a dead letter.
pub fn check_published(event: &Event, subject: &str) -> Result<(), Refusal> {
    let stagehand = subject
        .strip_prefix(ROOT)
        .is_some_and(|rest| rest.starts_with('.'));
    if stagehand {
        let expected = subject_for(&event.body, &event.project);
        if subject != expected {
            // Which token differs: the kind (everything before the last token) or the
            // project (the last token).
            let (head, last) = subject.rsplit_once('.').unwrap_or((subject, ""));
            let (expected_head, _) = expected.rsplit_once('.').unwrap_or((&expected, ""));
            if head != expected_head {
                let subject_kind = head.splitn(3, '.').nth(2).unwrap_or_default().to_owned();
                return Err(Refusal::SubjectKind {
                    id: event.id.to_string(),
                    kind: event.kind(),
                    subject: subject.to_owned(),
                    subject_kind,
                });
            }
            return Err(Refusal::SubjectProject {
                id: event.id.to_string(),
                project: event.project.clone(),
                subject: subject.to_owned(),
                subject_project: last.to_owned(),
            });
        }
    }
    if event.body.is_request() {
        return Ok(());
    }
    event.check_locations()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ALL_KINDS;

    #[test]
    fn every_kind_has_a_role_and_only_the_operator_replays() {
        for kind in ALL_KINDS {
            assert!(!stated_by(kind).is_empty(), "{kind} has no role");
        }
        assert!(stated_by("no.such.kind").is_empty());
        assert_eq!(
            Role::Operator.kinds(),
            vec!["dead.letter.replayed", "operator.action"]
        );
        assert_eq!(Role::Uploader.kinds(), vec!["ingest.requested"]);
        assert_eq!(
            Role::Trainer.kinds(),
            vec!["checkpoint.committed", "checkpoint.part.committed"]
        );
        assert_eq!(Role::CatalogueRecorder.kinds(), vec!["dead.letter"]);
    }
}
