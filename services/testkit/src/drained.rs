//! Whether a durable consumer has handled everything it was given, judged from the server's
//! own consumer info, the one check every test waits on.
//!
//! A consumer is drained when nothing is left to deliver (`num_pending == 0`), nothing
//! delivered awaits an ack (`num_ack_pending == 0`), and everything delivered was acked or
//! terminated: the ack floor stands at the last stream sequence delivered. The last clause is
//! what notices a loss. When the server gives up on a message at `max_deliver` it stops
//! redelivering it and no longer counts it as awaiting an ack, so the first two numbers read
//! as done; but the message was never acked, and the ack floor stays below it for good while
//! `delivered` has passed it (nats-server 2.15: floor 1, delivered 3, nothing pending, after
//! message 2 was dropped). That state is [`Drained::Dropped`], reported rather than waited
//! out, since it never turns into drained.

use async_nats::jetstream;

/// Where a durable consumer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every message delivered was acked or terminated, and nothing is left to deliver.
    Yes {
        /// The last stream sequence delivered (0 when nothing was).
        delivered: u64,
    },
    /// Work remains: messages to deliver or awaiting an ack, or the consumer (or its stream)
    /// does not exist yet.
    No,
    /// The server dropped at least one message at `max_deliver`: nothing is pending or
    /// awaiting an ack, yet the ack floor stays below the last message delivered. The lost
    /// messages are among the stream sequences after `ack_floor` up to `delivered`.
    Dropped {
        /// The stream sequence of the ack floor: every message up to it was acked.
        ack_floor: u64,
        /// The last stream sequence delivered.
        delivered: u64,
    },
}

impl Drained {
    /// The judgement on one consumer info.
    pub fn of(info: &jetstream::consumer::Info) -> Drained {
        let ack_floor = info.ack_floor.stream_sequence;
        let delivered = info.delivered.stream_sequence;
        if info.num_pending > 0 || info.num_ack_pending > 0 {
            Drained::No
        } else if ack_floor >= delivered {
            Drained::Yes { delivered }
        } else {
            Drained::Dropped {
                ack_floor,
                delivered,
            }
        }
    }
}

/// Where the durable consumer `consumer` of `stream` stands ([`Drained::No`] while either
/// does not exist).
pub async fn consumer_state(js: &jetstream::Context, stream: &str, consumer: &str) -> Drained {
    let Ok(stream) = js.get_stream(stream).await else {
        return Drained::No;
    };
    match stream.consumer_info(consumer).await {
        Ok(info) => Drained::of(&info),
        Err(_) => Drained::No,
    }
}

/// Whether every consumer named has handled everything it was given (false while one does
/// not exist yet): the condition a test waits on with [`wait_until`](crate::wait_until).
/// Panics when the server dropped a message of one of them at `max_deliver`: such a consumer
/// looks idle, but the message was lost, not handled, and waiting would only time out.
pub async fn drained(js: &jetstream::Context, stream: &str, consumers: &[&str]) -> bool {
    for consumer in consumers {
        match consumer_state(js, stream, consumer).await {
            Drained::Yes { .. } => {}
            Drained::No => return false,
            Drained::Dropped {
                ack_floor,
                delivered,
            } => lost(stream, consumer, ack_floor, delivered),
        }
    }
    true
}

fn lost(stream: &str, consumer: &str, ack_floor: u64, delivered: u64) -> ! {
    panic!(
        "consumer {consumer} of {stream} lost a message dropped at max_deliver: acked up to \
         stream sequence {ack_floor}, delivered up to {delivered}, nothing pending"
    )
}

/// The last stream sequence `consumer` of `stream` delivered, once it has handled everything
/// it was given (`None` before, or while it does not exist); panics, as [`drained`] does, on
/// a message the server dropped. For a test that waits for a consumer to have taken a given
/// number of messages as well.
pub async fn drained_through(js: &jetstream::Context, stream: &str, consumer: &str) -> Option<u64> {
    match consumer_state(js, stream, consumer).await {
        Drained::Yes { delivered } => Some(delivered),
        Drained::No => None,
        Drained::Dropped {
            ack_floor,
            delivered,
        } => lost(stream, consumer, ack_floor, delivered),
    }
}

/// Waits until every consumer named is [`drained`], within `timeout`.
pub async fn wait_drained(
    js: &jetstream::Context,
    stream: &str,
    consumers: &[&str],
    timeout: std::time::Duration,
) -> Result<(), crate::WaitTimeout> {
    let what = format!("consumers {consumers:?} of {stream} to handle every message");
    crate::wait_until(timeout, &what, || drained(js, stream, consumers)).await
}
