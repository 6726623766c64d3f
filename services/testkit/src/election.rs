//! Reading a cluster's streams right after a node was killed. The survivors may still be
//! electing a meta leader or a stream's leader, and until they have one, a stream's info or
//! messages time out: what a client waits out, and so what a test's read waits out too.

use std::time::Duration;

use async_nats::jetstream;
use stagehand_schemas::Event;

use crate::facts::{StoredEventsError, stored_events};
use crate::wait::wait_for;

/// How long a read after a node's loss may go on failing: a cluster on a loaded machine
/// elects in seconds, seldom in tens of them.
pub const ELECTION: Duration = Duration::from_secs(60);

/// The index (0 for `n1`, as the testkit names a cluster's nodes) of the node leading
/// `stream`, once the cluster names one, asked again through an election within [`ELECTION`].
pub async fn stream_leader(
    js: &jetstream::Context,
    stream: &str,
) -> Result<usize, StoredEventsError> {
    let leader = wait_for(ELECTION, &format!("a leader of {stream}"), || async {
        let info = js.get_stream(stream).await.ok()?.info().await.ok()?.clone();
        info.cluster?.leader
    })
    .await?;
    leader
        .strip_prefix('n')
        .and_then(|n| n.parse::<usize>().ok())
        .and_then(|n| n.checked_sub(1))
        .ok_or_else(|| format!("leader {leader:?} of {stream} is not a testkit node name").into())
}

/// [`stored_events`] asked again until it answers, within [`ELECTION`]; on a timeout, the
/// last error it gave.
pub async fn stored_events_through_election(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
) -> Result<Vec<Event>, StoredEventsError> {
    let last: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let last = &last;
    let read = wait_for(ELECTION, &format!("the events of {stream}"), || {
        let answer = stored_events(js, stream, filter);
        async move {
            match answer.await {
                Ok(events) => Some(events),
                Err(e) => {
                    if let Ok(mut l) = last.lock() {
                        *l = Some(e.to_string());
                    }
                    None
                }
            }
        }
    })
    .await;
    read.map_err(
        |timeout| match last.lock().ok().and_then(|mut l| l.take()) {
            Some(e) => format!("{timeout}; the last read: {e}").into(),
            None => timeout.into(),
        },
    )
}
