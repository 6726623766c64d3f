//! A hostile tenant's crafted reply subjects (issue 19, defect 3 and *Replies go only to
//! inboxes*): whoever answers a message — the catalogue recorder answering a query, JetStream
//! acknowledging a publish or answering an API request — must not write the answer into a
//! subject the asker names when that is not the asker's inbox: a KV key (the promoter's
//! reservations, the victim's readiness or stage status), another user's inbox, or the victim's
//! fact and request subjects. Against the shipped accounts and the real services, as in
//! `hostile_tenant.rs`.
//!
//! One stack per test: an attack that succeeds can break staging for every project (today the
//! promoter's `quota.hot` entry, overwritten, fails every later stage onto hot), which must not
//! fail the other tests.

mod common;

use std::time::Duration;

use anyhow::{Context, ensure};
use async_nats::jetstream;
use common::attacks::{Attacker, addressed, forge, relocated, stream_subjects};
use common::tenants::{
    ATTACKER, KvSnapshot, Plan, Tenants, VICTIM, project_scheduler, scheduler, trainer, uploader,
};
use futures::StreamExt;
use stagehand_bus::Bus;
use stagehand_catalogue::Query;
use stagehand_schemas::EventId;
use stagehand_testkit::publish_allowed;

/// The promoter's reservations on the hot tier: every stage onto hot reads them.
fn quota_hot() -> String {
    format!(
        "$KV.{}.{}",
        stagehand_bus::PROMOTER_BUCKET,
        stagehand_bus::placement::quota_key("hot", None)
    )
}

/// An inbox subject of the victim's uploader, which only it may read.
fn victims_inbox() -> String {
    format!("_INBOX_uploader-{VICTIM}.stolen")
}

/// The victim's validated-dataset subject: whatever is stored there is its verdict.
fn victims_verdicts() -> String {
    format!("stagehand.fact.dataset.validated.{VICTIM}")
}

/// A catalogue query, as the scheduler (the attacking role that may ask the catalogue) sends.
fn a_query() -> Vec<u8> {
    serde_json::to_vec(&Query::DeadLetters {
        limit: Some(1),
        after: None,
    })
    .unwrap_or_default()
}

/// Messages stored on `subject` in `stream`.
async fn stored_on(bus: &Bus, stream: &str, subject: &str) -> anyhow::Result<u64> {
    let stream = bus.jetstream().get_stream(stream).await?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: subject.to_owned(),
            ..Default::default()
        })
        .await?;
    Ok(consumer.cached_info().num_pending)
}

/// What the victim owns besides its KV keys, counted before and after an attack: the messages
/// on its verdict and release subjects, and what arrived in its uploader's inbox.
struct Watch {
    operator: Bus,
    verdicts: u64,
    releases: u64,
    inbox: async_nats::Subscriber,
    inbox_client: Bus,
    kv: KvSnapshot,
}

impl Watch {
    async fn start(tenants: &Tenants) -> anyhow::Result<Watch> {
        let operator = tenants.operator().await?;
        let inbox_client = tenants.bus_as(&uploader(VICTIM)).await?;
        let inbox = inbox_client.client().subscribe(victims_inbox()).await?;
        inbox_client.client().flush().await?;
        Ok(Watch {
            verdicts: stored_on(&operator, "STAGEHAND_FACTS", &victims_verdicts()).await?,
            releases: stored_on(
                &operator,
                "STAGEHAND_REQUESTS",
                &format!("stagehand.req.stage.released.{VICTIM}"),
            )
            .await?,
            kv: KvSnapshot::take(&operator).await?,
            operator,
            inbox,
            inbox_client,
        })
    }

    /// What changed since [`Watch::start`] that the attacker had no right to change: a key
    /// outside the attacker's own project, a message on the victim's subjects, a message in
    /// the victim's inbox. Called after [`settle`].
    async fn changed(&mut self) -> anyhow::Result<Vec<String>> {
        let mut found = KvSnapshot::take(&self.operator)
            .await?
            .changed_since(&self.kv, |_, key| key.starts_with(&format!("{ATTACKER}.")));
        let verdicts = stored_on(&self.operator, "STAGEHAND_FACTS", &victims_verdicts()).await?;
        if verdicts != self.verdicts {
            found.push(format!(
                "{} messages stored as the victim's verdicts, {} before",
                verdicts, self.verdicts
            ));
        }
        let releases = stored_on(
            &self.operator,
            "STAGEHAND_REQUESTS",
            &format!("stagehand.req.stage.released.{VICTIM}"),
        )
        .await?;
        if releases != self.releases {
            found.push(format!(
                "{releases} messages stored as the victim's releases, {} before",
                self.releases
            ));
        }
        // Whatever was sent to the inbox before this round trip has been delivered.
        self.inbox_client.client().flush().await?;
        while let Ok(Some(msg)) =
            tokio::time::timeout(Duration::from_millis(1), self.inbox.next()).await
        {
            found.push(format!(
                "the victim's inbox {} received {:?}",
                msg.subject,
                String::from_utf8_lossy(&msg.payload)
            ));
        }
        Ok(found)
    }
}

/// Waits until the crafted catalogue queries have been answered: the recorder takes queries
/// in the order they come and answers each at once, so once it has answered a few more after
/// them, it has answered those. (A sweep also waits, subject by subject, for an acknowledged
/// publish of its own after the crafted ones: a stream acknowledges in order.)
async fn settle(tenants: &Tenants) -> anyhow::Result<()> {
    let operator = tenants.operator().await?;
    for _ in 0..3 {
        tenants
            .ask(
                &operator,
                &Query::DeadLetters {
                    limit: Some(1),
                    after: None,
                },
            )
            .await?;
    }
    Ok(())
}

/// A stack with the victim's first round played (its readiness, stage status and the
/// promoter's reservations on hot exist), and a watch on what it owns.
async fn victim_with_data(tag: &str) -> anyhow::Result<(Tenants, Watch)> {
    let tenants = Tenants::start().await?;
    tenants.victim_round(&Plan::new(tag)).await?;
    let watch = Watch::start(&tenants).await?;
    Ok((tenants, watch))
}

/// After the attack `log` lists: nothing the attacker had no right to change changed, and
/// the victim's next round goes through.
async fn unharmed(
    tenants: &Tenants,
    watch: &mut Watch,
    log: &[String],
    tag: &str,
) -> anyhow::Result<()> {
    settle(tenants).await?;
    let changed = watch.changed().await?;
    ensure!(
        changed.is_empty(),
        "the attack changed what is not the attacker's:\n  {}\nattacks:\n  {}",
        changed.join("\n  "),
        log.join("\n  ")
    );
    tenants
        .victim_round(&Plan::new(tag))
        .await
        .with_context(|| format!("after the attacks:\n  {}", log.join("\n  ")))
}

/// The scheduler asks the catalogue with `reply` as the reply subject.
async fn crafted_query(tenants: &Tenants, reply: &str) -> anyhow::Result<Vec<String>> {
    let mut attacker = Attacker::connect(tenants, scheduler()).await?;
    attacker
        .publish_with_reply(
            stagehand_schemas::subject::CATALOGUE_QUERY,
            reply,
            a_query(),
        )
        .await?;
    Ok(attacker.log)
}

/// Defect 3, a KV key: a catalogue query whose reply subject is the promoter's `quota.hot`
/// entry. Today the recorder's user writes its answer there, and every later stage onto hot
/// fails (`missing field "replicas"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_3_a_catalogue_query_replying_into_the_promoters_quota_key_writes_nothing()
-> anyhow::Result<()> {
    let (tenants, mut watch) = victim_with_data("reply-kv").await?;
    let log = crafted_query(&tenants, &quota_hot()).await?;
    unharmed(&tenants, &mut watch, &log, "reply-kv-next").await
}

/// Defect 3, another user's inbox: a catalogue query whose reply subject is the victim's
/// uploader's inbox. Today the answer is delivered there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_3_a_catalogue_query_replying_into_another_users_inbox_sends_nothing_there()
-> anyhow::Result<()> {
    let (tenants, mut watch) = victim_with_data("reply-inbox").await?;
    let log = crafted_query(&tenants, &victims_inbox()).await?;
    unharmed(&tenants, &mut watch, &log, "reply-inbox-next").await
}

/// Defect 3, a facts subject: a catalogue query whose reply subject is the victim's
/// `dataset.validated` subject. Today the facts stream stores the answer as the victim's fact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_3_a_catalogue_query_replying_into_a_facts_subject_stores_nothing()
-> anyhow::Result<()> {
    let (tenants, mut watch) = victim_with_data("reply-fact").await?;
    let log = crafted_query(&tenants, &victims_verdicts()).await?;
    unharmed(&tenants, &mut watch, &log, "reply-fact-next").await
}

/// Every subject `who` may publish, each with every reply subject that is not its inbox: the
/// promoter's reservations, the victim's readiness and stage status keys, the victim's inbox,
/// its verdict and release subjects. On a request or fact subject the event is the attacker's
/// own (a fresh id, its own names), so only the reply subject is hostile.
async fn reply_sweep(who: (String, String), tag: &str) -> anyhow::Result<()> {
    let (tenants, mut watch) = victim_with_data(tag).await?;
    let mut replies = vec![
        quota_hot(),
        victims_inbox(),
        victims_verdicts(),
        format!("stagehand.req.stage.released.{VICTIM}"),
    ];
    // The victim's own keys, as they stand.
    for (bucket, key) in watch.kv.0.keys() {
        if key.starts_with(&format!("{VICTIM}.")) {
            replies.push(format!("$KV.{bucket}.{key}"));
        }
    }
    let own = Plan::new(&format!("{tag}-own"));
    let mut attacker = Attacker::connect(&tenants, who.clone()).await?;
    let granted = publish_allowed(&tenants.accounts, &who.1);
    for subject in &granted {
        let targets: Vec<(String, Vec<u8>)> = match stream_subjects(subject) {
            Some(streams) => streams
                .into_iter()
                .filter(|(_, project, _)| project == ATTACKER)
                .filter_map(|(subject, project, kind)| {
                    let event = forge(&kind, &project, &EventId::random(), &own, &who.0)?;
                    let event = addressed(relocated(&event, &project)?, &subject);
                    Some((subject, stagehand_schemas::wire::encode(&event).ok()?))
                })
                .collect(),
            None if subject == stagehand_schemas::subject::CATALOGUE_QUERY => {
                vec![(subject.clone(), a_query())]
            }
            None => vec![(subject.replace(['>', '*'], "probe"), b"{}".to_vec())],
        };
        for (subject, payload) in targets {
            for reply in &replies {
                attacker
                    .publish_with_reply(&subject, reply, payload.clone())
                    .await?;
            }
            // Answered in order: once this is answered to the attacker's own inbox, the
            // crafted ones before it were answered too, wherever they asked.
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                attacker
                    .bus
                    .client()
                    .request(subject.clone(), payload.into()),
            )
            .await;
        }
    }
    unharmed(&tenants, &mut watch, &attacker.log, &format!("{tag}-next")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_subject_another_projects_uploader_may_publish_answers_into_what_is_not_its_inbox()
-> anyhow::Result<()> {
    reply_sweep(uploader(ATTACKER), "replies-up").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_subject_another_projects_training_job_may_publish_answers_into_what_is_not_its_inbox()
-> anyhow::Result<()> {
    reply_sweep(trainer(ATTACKER), "replies-tr").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_subject_the_shared_scheduler_may_publish_answers_into_what_is_not_its_inbox()
-> anyhow::Result<()> {
    reply_sweep(scheduler(), "replies-sch").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_subject_another_projects_scheduler_may_publish_answers_into_what_is_not_its_inbox()
-> anyhow::Result<()> {
    reply_sweep(project_scheduler(ATTACKER), "replies-psch").await
}

/// Where a consumer the attacker asks for could deliver from, and what it would filter: each
/// stream a tenant or scheduler could name, with a subject of the attacker's own project's part
/// of it (what a filter checked against its grants would admit). Literal subjects: the form
/// with the filter in the request's subject must name it there.
fn streams_to_redirect() -> Vec<(String, String)> {
    use stagehand_catalogue::READINESS_BUCKET;
    use stagehand_schemas::subject::{FACTS, REQUESTS, upload_bucket_spec};
    let stages = stagehand::stage::STAGES_BUCKET;
    let uploads = upload_bucket_spec(ATTACKER);
    vec![
        (
            format!("KV_{stages}"),
            format!("$KV.{stages}.{ATTACKER}.6576696c"),
        ),
        (
            format!("KV_{READINESS_BUCKET}"),
            format!("$KV.{READINESS_BUCKET}.{ATTACKER}.evil.v1.hot"),
        ),
        (
            FACTS.name.to_owned(),
            format!("stagehand.fact.stage.ready.{ATTACKER}"),
        ),
        (
            REQUESTS.name.to_owned(),
            format!("stagehand.req.stage.requested.{ATTACKER}"),
        ),
        (
            uploads.stream_name(),
            format!("$O.{}.M.evil", uploads.bucket),
        ),
    ]
}

/// Every form of a consumer-create request on `stream` for a push consumer delivering to
/// `deliver` (unnamed, named, named with its filter in the subject — the form whose filter the
/// server checks against the subject — and the older durable form), each with its body.
fn consumer_creates(
    stream: &str,
    filter: &str,
    deliver: &str,
    name: &str,
) -> Vec<(String, serde_json::Value)> {
    let config = |named: Option<&str>, durable: bool| {
        let mut config = serde_json::json!({
            "deliver_subject": deliver,
            "deliver_policy": "all",
            "ack_policy": "none",
            "replay_policy": "instant",
            "filter_subject": filter,
            "mem_storage": true,
        });
        if let Some(n) = named {
            config[if durable { "durable_name" } else { "name" }] = n.into();
        }
        serde_json::json!({"stream_name": stream, "config": config})
    };
    vec![
        (
            format!("$JS.API.CONSUMER.CREATE.{stream}"),
            config(None, false),
        ),
        (
            format!("$JS.API.CONSUMER.CREATE.{stream}.{name}"),
            config(Some(name), false),
        ),
        (
            format!("$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter}"),
            config(Some(name), false),
        ),
        (
            format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}"),
            config(Some(name), true),
        ),
    ]
}

/// Every consumer of the streams an attacker could name, as (stream, consumer).
async fn consumers_of(
    operator: &Bus,
    streams: &[(String, String)],
) -> anyhow::Result<std::collections::BTreeSet<(String, String)>> {
    let mut all = std::collections::BTreeSet::new();
    for (name, _) in streams {
        let stream = operator.jetstream().get_stream(name).await?;
        let mut names = stream.consumer_names();
        while let Some(consumer) = names.next().await {
            all.insert((name.clone(), consumer?));
        }
    }
    Ok(all)
}

/// Issue 19, *Who may say what*: a push consumer's deliver subject. Whoever may create a
/// consumer names where the server delivers its messages, and the server checks that subject
/// against nothing (it is in the request's body, which permissions cannot see). Measured
/// before this test: while `labb`'s uploader waited on its verdict subject (`stagehand ingest
/// --wait`: a live subscription, imported into its account), a consumer the shared scheduler or
/// `scheduler-demo` created on the readiness or stage-status bucket with that deliver subject
/// made the server publish the bucket's entries there, and the facts stream stored one as
/// `labb`'s verdict. Now no tenant or scheduler may create a consumer in any form on any
/// stream: each request is refused, no consumer appears, nothing reaches the waiting uploader
/// or is stored as its verdict, and `labb`'s next round goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_scheduler_creates_a_consumer_delivering_into_a_waiting_uploaders_verdicts()
-> anyhow::Result<()> {
    let (tenants, mut watch) = victim_with_data("deliver").await?;
    // The victim's uploader waits for a verdict, as `stagehand ingest --wait` does: its live
    // subscription is what makes the server deliver there at all.
    let waiting = tenants.bus_as(&uploader(VICTIM)).await?;
    let mut verdicts = waiting.client().subscribe(victims_verdicts()).await?;
    waiting.client().flush().await?;
    let operator = tenants.operator().await?;
    let streams = streams_to_redirect();
    let before = consumers_of(&operator, &streams).await?;

    let mut log = Vec::new();
    let mut created = Vec::new();
    for who in [scheduler(), project_scheduler(ATTACKER)] {
        let mut attacker = Attacker::connect(&tenants, who.clone()).await?;
        for (stream, filter) in &streams {
            for (subject, body) in consumer_creates(stream, filter, &victims_verdicts(), "evil") {
                if let Ok(answer) = attacker.api_request(&subject, &body).await?
                    && answer.get("error").is_none()
                {
                    created.push(format!("{} created {answer}", who.0));
                }
            }
        }
        log.extend(attacker.log);
    }
    let after = consumers_of(&operator, &streams).await?;
    let new: Vec<&(String, String)> = after.difference(&before).collect();
    ensure!(
        created.is_empty() && new.is_empty(),
        "consumers were created: {created:?}; new on the streams: {new:?}\nattacks:\n  {}",
        log.join("\n  ")
    );
    // Nothing was delivered to the waiting uploader: whatever was sent before this round trip
    // has arrived.
    waiting.client().flush().await?;
    if let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(1), verdicts.next()).await {
        anyhow::bail!(
            "the waiting uploader received {:?} on {}",
            String::from_utf8_lossy(&msg.payload),
            msg.subject
        );
    }
    unharmed(&tenants, &mut watch, &log, "deliver-next").await
}
