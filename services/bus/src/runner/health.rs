//! What a service's `GET /readyz` answers (the metrics endpoint serves it): ready once the
//! service is connected to NATS and every worker it built consumes (a service that builds three
//! workers is not ready while one of them still makes its consumer); not ready while it
//! connects, after it lost its connection, once a worker stopped, or while it drains. A
//! supervisor (Kubernetes' readiness probe, a load balancer, an operator's `curl`) reads the
//! reason in the answer's body. Liveness (`/healthz`) asks none of this: an outage of NATS
//! must not get every service restarted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio_util::sync::CancellationToken;

/// The readiness of one service, shared by the runner, its workers and the endpoint.
#[derive(Clone, Debug)]
pub(crate) struct Health {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shutdown: CancellationToken,
    client: OnceLock<async_nats::Client>,
    workers_built: AtomicUsize,
    workers_started: AtomicUsize,
    workers_stopped: AtomicUsize,
}

impl Health {
    /// Not ready until [`Health::connected`] and a worker started; draining once `shutdown`
    /// is cancelled.
    pub(crate) fn new(shutdown: &CancellationToken) -> Health {
        Health {
            inner: Arc::new(Inner {
                shutdown: shutdown.clone(),
                client: OnceLock::new(),
                workers_built: AtomicUsize::new(0),
                workers_started: AtomicUsize::new(0),
                workers_stopped: AtomicUsize::new(0),
            }),
        }
    }

    /// The service is connected and its streams are provisioned.
    pub(crate) fn connected(&self, client: &async_nats::Client) {
        let _ = self.inner.client.set(client.clone());
    }

    /// A worker was built (`Context::run_worker_until`): the service is not ready until it
    /// has started too.
    pub(crate) fn worker_built(&self) {
        self.inner.workers_built.fetch_add(1, Ordering::SeqCst);
    }

    /// A worker has its consumer, ledger and claims and pulls.
    pub(crate) fn worker_started(&self) {
        self.inner.workers_started.fetch_add(1, Ordering::SeqCst);
    }

    /// A worker returned (it stopped on shutdown, or failed: the service is going down).
    pub(crate) fn worker_stopped(&self) {
        self.inner.workers_stopped.fetch_add(1, Ordering::SeqCst);
    }

    /// `Ok` when ready for work, else why not.
    pub(crate) fn check(&self) -> Result<(), String> {
        let inner = &self.inner;
        if inner.shutdown.is_cancelled() {
            return Err("draining".into());
        }
        let Some(client) = inner.client.get() else {
            return Err("connecting to NATS".into());
        };
        let state = client.connection_state();
        if state != async_nats::connection::State::Connected {
            return Err(format!("NATS connection {state}"));
        }
        if inner.workers_stopped.load(Ordering::SeqCst) > 0 {
            return Err("a worker stopped".into());
        }
        let started = inner.workers_started.load(Ordering::SeqCst);
        if started == 0 {
            return Err("no worker consumes yet".into());
        }
        let built = inner.workers_built.load(Ordering::SeqCst);
        if started < built {
            return Err(format!("{started} of {built} workers consume yet"));
        }
        Ok(())
    }
}
