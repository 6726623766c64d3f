//! `ask` against a real nats-server: each way a query can fail is its own `AskError` variant,
//! so that callers branch on the variant and never on the text (`stagehand ingest --wait` once
//! matched "no responders" in the message).

use std::time::Duration;

use futures::StreamExt;
use stagehand_catalogue::{AskError, Query, ask};
use stagehand_schemas::Retryable;
use stagehand_schemas::subject::CATALOGUE_QUERY;
use stagehand_testkit::NatsServer;

fn query() -> Query {
    Query::Datasets {
        project: Some("lab-a".into()),
        limit: None,
        after: None,
    }
}

#[tokio::test]
async fn a_query_nobody_listens_to_is_no_responders() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let err = ask(&client, &query(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, AskError::NoResponders), "{err:?}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn a_silent_recorder_times_out_and_a_garbled_answer_is_permanent() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut queries = client.subscribe(CATALOGUE_QUERY).await.unwrap();
    client.flush().await.unwrap();

    // The subscriber takes the query and says nothing.
    let err = ask(&client, &query(), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AskError::TimedOut(t) if t == Duration::from_millis(300)),
        "{err:?}"
    );
    assert!(err.is_retryable());
    queries.next().await.unwrap();

    // The subscriber answers something that is not an answer.
    let responder = client.clone();
    let answering = tokio::spawn(async move {
        let q = queries.next().await.unwrap();
        let reply = q.reply.unwrap();
        responder.publish(reply, "not json".into()).await.unwrap();
        responder.flush().await.unwrap();
    });
    let err = ask(&client, &query(), Duration::from_secs(5))
        .await
        .unwrap_err();
    answering.await.unwrap();
    assert!(matches!(err, AskError::BadAnswer(_)), "{err:?}");
    assert!(!err.is_retryable());
}
