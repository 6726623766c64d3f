//! What an attacking tenant does, shared by the hostile-tenant tests: a user's connection that
//! publishes on the subjects its grants allow ([`Attacker`]), with any `Nats-Msg-Id` and reply
//! subject, and events forged to name the victim's round ([`forge`]).

use std::time::Duration;

use anyhow::Context;
use async_nats::HeaderMap;
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value, json};
use stagehand_bus::Bus;
use stagehand_schemas::{Body, Event, EventId, wire};

use super::tenants::{ATTACKER, Plan, Tenants, VICTIM};

/// How an attacker's publish ended.
#[derive(Debug)]
pub enum Landed {
    /// Stored by a stream at this sequence.
    Stored(u64),
    /// The stream already held the Nats-Msg-Id: dropped.
    Duplicate(u64),
    /// Refused (a permission the config does not grant after all, or no stream).
    Refused(String),
}

/// An attacking user: its connection and what it published.
pub struct Attacker {
    pub who: (String, String),
    pub bus: Bus,
    pub js: jetstream::Context,
    pub log: Vec<String>,
}

impl Attacker {
    pub async fn connect(tenants: &Tenants, who: (String, String)) -> anyhow::Result<Attacker> {
        let bus = tenants.bus_as(&who).await?;
        let mut js = jetstream::new(bus.client().clone());
        // A refused publish gets no ack: bounds the wait for it.
        js.set_timeout(Duration::from_secs(5));
        Ok(Attacker {
            who,
            bus,
            js,
            log: Vec::new(),
        })
    }

    /// Publishes `payload` on `subject` asking for the answer on `reply`, whatever subject
    /// that is: core NATS lets any client name any reply subject.
    pub async fn publish_with_reply(
        &mut self,
        subject: &str,
        reply: &str,
        payload: Vec<u8>,
    ) -> anyhow::Result<()> {
        let client = self.bus.client();
        client
            .publish_with_reply(subject.to_owned(), reply.to_owned(), payload.into())
            .await
            .with_context(|| format!("publishing on {subject}"))?;
        client.flush().await?;
        self.log.push(format!(
            "{} published {subject} with reply subject {reply}",
            self.who.0
        ));
        Ok(())
    }

    /// Sends a JetStream API request, whatever its subject, and returns the server's answer
    /// (`Ok`), or the permission violation that refused it (`Err`).
    pub async fn api_request(
        &mut self,
        subject: &str,
        body: &Value,
    ) -> anyhow::Result<Result<Value, String>> {
        // The connection keeps only its latest violations: the one refusing this request is
        // the one naming its subject, quoted whole (a subject is asked once per connection).
        let quoted = format!("\"{subject}\"");
        let client = self.bus.client();
        let inbox = client.new_inbox();
        let mut answers = client.subscribe(inbox.clone()).await?;
        client
            .publish_with_reply(subject.to_owned(), inbox, body.to_string().into())
            .await?;
        client.flush().await?;
        let bus = &self.bus;
        let refused = stagehand_testkit::wait_for(
            Duration::from_secs(10),
            "an answer or a permission violation",
            || async {
                bus.permission_violations()
                    .into_iter()
                    .find(|v| v.contains(&quoted))
            },
        );
        let outcome = tokio::select! {
            answer = answers.next() => {
                let answer = answer.context("the answer's subscription closed")?;
                Ok(serde_json::from_slice(&answer.payload).with_context(|| {
                    format!(
                        "the answer to {subject}: {:?}",
                        String::from_utf8_lossy(&answer.payload)
                    )
                })?)
            }
            violation = refused => Err(violation?),
        };
        self.log.push(format!(
            "{} asked {subject} with {body}: {outcome:?}",
            self.who.0
        ));
        Ok(outcome)
    }

    /// Publishes `event` on `subject` with `msg_id` as its Nats-Msg-Id.
    pub async fn publish(&mut self, subject: &str, event: &Event, msg_id: &str) -> Landed {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        let landed = match wire::encode(event) {
            Err(e) => Landed::Refused(format!("does not encode: {e}")),
            Ok(bytes) => match self
                .js
                .publish_with_headers(subject.to_owned(), headers, bytes.into())
                .await
            {
                Err(e) => Landed::Refused(e.to_string()),
                Ok(ack) => match ack.await {
                    Err(e) => Landed::Refused(e.to_string()),
                    Ok(ack) if ack.duplicate => Landed::Duplicate(ack.sequence),
                    Ok(ack) => Landed::Stored(ack.sequence),
                },
            },
        };
        self.log.push(format!(
            "{} published {} {} (project {:?}, id {}) with Nats-Msg-Id {msg_id}: {landed:?}",
            self.who.0,
            subject,
            event.kind(),
            event.project,
            event.id
        ));
        landed
    }
}

/// An event of `kind` and `project` with id `id` whose payload names the victim's round of
/// `plan`: its dataset, version, job, run, files and the place `stagehand ingest` put them.
/// Built from the wire form, so that a field added to the contract (optional, as every new one
/// is) needs no edit here. `None` for a kind this suite does not know how to forge: a grant of
/// such a subject to an attacking role fails the sweep until it does.
pub fn forge(kind: &str, project: &str, id: &EventId, plan: &Plan, by: &str) -> Option<Event> {
    let files: Vec<Value> = plan
        .refs()
        .iter()
        .map(|f| json!({"path": f.path, "size": f.size, "sha256": f.sha256}))
        .collect();
    let total: u64 = plan.refs().iter().map(|f| f.size).sum();
    let location = json!({"tier": "source", "prefix": plan.source_prefix()});
    let deadline = stagehand_schemas::event::now() + Duration::from_secs(20);
    let payload = match kind {
        "ingest.requested" => json!({
            "dataset": plan.dataset, "source": location, "files": files, "requested_by": by,
        }),
        "checkpoint.committed" => json!({
            "run": plan.run, "step": plan.step, "location": location, "files": files,
            "total_bytes": total,
        }),
        "checkpoint.part.committed" => json!({
            "run": plan.run, "step": plan.step, "part": 0, "parts": 1, "node": FORGED_NODE,
            "location": location, "files": files, "total_bytes": total,
        }),
        "stage.requested" => json!({
            "dataset": plan.dataset, "version": plan.version, "tier": "hot",
            "job_id": plan.job, "requested_by": by,
            "deadline": deadline.format(&time::format_description::well_known::Rfc3339).ok()?,
        }),
        "stage.released" => json!({
            "dataset": plan.dataset, "version": plan.version, "tier": "hot", "job_id": plan.job,
        }),
        _ => return None,
    };
    let event = json!({
        "id": id, "kind": kind, "schema": stagehand_schemas::event::SCHEMA_VERSION,
        "occurred_at": stagehand_schemas::event::now()
            .format(&time::format_description::well_known::Rfc3339).ok()?,
        "project": project, "correlation_id": id, "payload": payload,
    });
    serde_json::from_value(event).ok()
}

/// `event` with the place its payload names (`location`, `source`) moved beneath `project`'s
/// own folder: an event of the attacker's own whose every field is its own to state.
pub fn relocated(event: &Event, project: &str) -> Option<Event> {
    let mut value = serde_json::to_value(event).ok()?;
    for field in ["location", "source"] {
        if let Some(prefix) = value["payload"][field]["prefix"].as_str() {
            let rest = prefix.split_once('/').map_or("", |(_, rest)| rest);
            value["payload"][field]["prefix"] = Value::String(format!("{project}/{rest}"));
        }
    }
    serde_json::from_value(value).ok()
}

/// The node a forged checkpoint part names.
pub const FORGED_NODE: &str = "gpu-x";

/// `event` as published on `subject`: a stage request or release on a subject naming
/// [`FORGED_NODE`] names that node too (the subject of a node's `local` tier).
pub fn addressed(mut event: Event, subject: &str) -> Event {
    if subject.contains(&format!(".{FORGED_NODE}.")) {
        match &mut event.body {
            Body::StageRequested(r) => r.node = Some(FORGED_NODE.to_owned()),
            Body::StageReleased(r) => r.node = Some(FORGED_NODE.to_owned()),
            _ => {}
        }
    }
    event
}

/// The (subject, project, kind) of a request or fact subject an attacking role may publish,
/// a `*` project expanded to the attacker's and the victim's (and a `*` node, of a kind routed
/// by node, to [`FORGED_NODE`]); `None` for any other subject.
pub fn stream_subjects(granted: &str) -> Option<Vec<(String, String, String)>> {
    let rest = granted
        .strip_prefix("stagehand.req.")
        .or_else(|| granted.strip_prefix("stagehand.fact."))?;
    let (kind, project) = rest.rsplit_once('.')?;
    let class = &granted[..granted.len() - rest.len()];
    // A kind routed by node names the node before the project.
    let (kind, node) = match kind.strip_suffix(".*") {
        Some(routed) if stagehand_schemas::subject::may_name_node(routed) => {
            (routed, format!(".{FORGED_NODE}"))
        }
        _ => (kind, String::new()),
    };
    let projects = match project {
        "*" => vec![ATTACKER, VICTIM],
        p => vec![p],
    };
    Some(
        projects
            .into_iter()
            .map(|p| {
                let subject = format!("{class}{kind}{node}.{p}");
                (subject, p.to_owned(), kind.to_owned())
            })
            .collect(),
    )
}
