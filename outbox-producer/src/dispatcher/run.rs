//! One batch, both steps ([`Dispatcher::dispatch_once`]), and the service
//! ([`Dispatcher::run`]): the workers, the lease sweeper and the LISTEN
//! wake-up, until shutdown, then the drain.

use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::Broker;
use tokio::sync::{watch, Notify};
use tracing::Instrument;

use super::{BatchReport, ClaimCursor, Dispatcher};
use crate::error::ProducerError;
use crate::service_store::{Notice, ServiceStore};
use crate::sweeper::LeaseSweeper;

impl<B: Broker + 'static, S: ServiceStore> Dispatcher<B, S> {
    /// One batch, both steps, with a full claim (every key's head).
    pub async fn dispatch_once(&self, owner: &str) -> Result<BatchReport, ProducerError> {
        self.dispatch_next(owner, &mut ClaimCursor::default()).await
    }

    /// One batch, both steps, as a worker runs them: the claim starts from
    /// `cursor` (the successors of the events the previous batch published,
    /// and a scan of every key's head when one is due), and the cursor
    /// then holds the events this batch published.
    pub async fn dispatch_next(&self, owner: &str, cursor: &mut ClaimCursor) -> Result<BatchReport, ProducerError> {
        let batch = self.claim_and_send_from(owner, cursor).await?;
        self.settle_into(batch, cursor).await
    }

    /// Runs the workers, the lease sweeper and the LISTEN wake-up until
    /// `shutdown` resolves (the same shape as `Reconciler::run` and
    /// `IdempotentConsumer::run`: e.g. `async { let _ = tokio::signal::ctrl_c().await; }`);
    /// then stops claiming, drains outstanding answers (bounded by
    /// `shutdown_grace_ms`) and returns the totals. A `watch::Receiver<bool>`
    /// becomes a shutdown future with [`until_true`].
    ///
    /// `shutdown` is any `Future<Output = ()> + Send` ([`IntoShutdown`]'s
    /// form [`ShutdownFuture`]). **Deprecated form:** a
    /// `tokio::sync::watch::Receiver<bool>`, what `run` took before it took
    /// a future, is still accepted ([`ShutdownWatch`]) and stops the run when
    /// it holds `true` or its sender is dropped, as it did; each such call
    /// logs a WARN naming the caller's file and line and the replacement,
    /// `run(outbox_producer::until_true(rx))`. It is not a compiler warning:
    /// rustc gives none for the choice of a trait impl (`#[deprecated]` on an
    /// impl or its items has no effect, rust-lang/rust#39935), and `run`'s
    /// name is the same in both forms.
    #[track_caller]
    pub fn run<Form>(
        self: Arc<Self>,
        shutdown: impl IntoShutdown<Form>,
    ) -> impl std::future::Future<Output = Result<BatchReport, ProducerError>> {
        // Converted here, not when first polled: a deprecated form's warning
        // names the caller's line (`#[track_caller]`).
        let shutdown = shutdown.into_shutdown();
        self.run_until(shutdown)
    }

    async fn run_until(self: Arc<Self>, shutdown: impl std::future::Future<Output = ()> + Send) -> Result<BatchReport, ProducerError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let run = self.run_with(stop_rx);
        let mut run = std::pin::pin!(run);
        let mut shutdown = std::pin::pin!(shutdown);
        tokio::select! {
            biased;
            r = &mut run => return r,
            () = &mut shutdown => {}
        }
        let _ = stop_tx.send(true);
        run.await
    }

    /// [`Dispatcher::run`] until `shutdown` becomes true.
    #[deprecated(note = "use `run(shutdown_future)`; `outbox_producer::until_true(rx)` turns a watch::Receiver<bool> into one")]
    pub async fn run_watch(self: Arc<Self>, shutdown: watch::Receiver<bool>) -> Result<BatchReport, ProducerError> {
        self.run_with(shutdown).await
    }

    async fn run_with(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) -> Result<BatchReport, ProducerError> {
        let wake = Arc::new(Notify::new());
        // Owned by this future: dropping it (a cancelled run) stops every task.
        let mut tasks = tokio::task::JoinSet::new();
        if self.config.listen {
            let me = self.clone();
            let wake = wake.clone();
            let mut stop = shutdown.clone();
            tasks.spawn(async move {
                let mut listener = match me.store.listen().await {
                    Ok(Some(l)) => l,
                    Ok(None) => return Ok(BatchReport::default()),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN unavailable; polling only");
                        return Ok(BatchReport::default());
                    }
                };
                loop {
                    tokio::select! {
                        biased;
                        n = listener.next() => match n {
                            Ok(Notice::Committed) => wake.notify_waiters(),
                            // The session was lost (a restart, a failover, a
                            // killed backend) and another one listens now.
                            // What was notified meanwhile went to the lost
                            // session: the workers look once.
                            Ok(Notice::Replaced) => {
                                tracing::warn!("LISTEN session lost and replaced; looking for work committed meanwhile");
                                wake.notify_waiters();
                            }
                            // Not even replaced yet: the next try_recv
                            // connects again; meanwhile the workers look
                            // once a second.
                            Err(e) => {
                                tracing::warn!(error = %e, "LISTEN session lost; polling until it is back");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                wake.notify_waiters();
                            }
                        },
                        _ = stop.changed() => return Ok(BatchReport::default()),
                    }
                }
            });
        }
        {
            let me = self.clone();
            let stop = shutdown.clone();
            tasks.spawn(async move {
                let sweeper = LeaseSweeper::new(&me.store, Duration::from_millis(me.config.sweep_interval_ms), me.config.lease_ms);
                sweeper
                    .run(until_true(stop), |sweep| {
                        if let Some(age) = sweep.oldest_pending_age_ms {
                            me.metrics.oldest_pending_age_ms.store(age.unwrap_or(0).max(0) as u64, AtomicOrdering::Relaxed);
                        }
                        if let Some(skew) = sweep.clock_skew_ms {
                            me.metrics.clock_skew_ms.store(skew, AtomicOrdering::Relaxed);
                        }
                        if let Some(refused) = sweep.rows_beyond_protocol {
                            me.metrics.refused_protocol_rows.store(refused.max(0) as u64, AtomicOrdering::Relaxed);
                        }
                    })
                    .await;
                Ok(BatchReport::default())
            });
        }
        for w in 0..self.config.workers {
            let me = self.clone();
            let wake = wake.clone();
            let mut stop = shutdown.clone();
            let owner = self.config.owner(w);
            tasks.spawn(
                async move {
                    let mut total = BatchReport::default();
                    let mut cursor = ClaimCursor::default();
                    let poll = Duration::from_millis(me.config.poll_interval_ms);
                    while !*stop.borrow() {
                        // Registered before the claim: a commit notified while
                        // the claim runs (after its statements took their
                        // snapshots, or after it linked the new chains) wakes
                        // the wait below instead of going to no waiter.
                        let notified = wake.notified();
                        tokio::pin!(notified);
                        notified.as_mut().enable();
                        match me.dispatch_next(&owner, &mut cursor).await {
                            Ok(r) => {
                                total += r;
                                // A batch that found work and met no broker failure
                                // looks again at once: under per-key ordering a short
                                // batch does not mean the backlog is empty, only that
                                // the other heads were still in flight, and their
                                // receipts free the next ones. An empty claim, or
                                // sends the broker did not take (it may be down),
                                // wait for a wake-up or the poll interval.
                                if r.claimed > 0 && r.not_sent == 0 && r.unknown == 0 {
                                    continue;
                                }
                            }
                            Err(e) => tracing::warn!(error = %e, retryable = e.is_retryable(), "batch failed"),
                        }
                        tokio::select! {
                            biased;
                            _ = notified => {}
                            _ = tokio::time::sleep(poll) => {}
                            _ = stop.changed() => {}
                        }
                    }
                    Ok::<_, ProducerError>(total)
                }
                .instrument(tracing::info_span!("worker", worker = w)),
            );
        }
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        tracing::info!("dispatcher stopping: no new claims; draining outstanding answers");
        let grace = Duration::from_millis(self.config.shutdown_grace_ms);
        let mut total = BatchReport::default();
        let drained = tokio::time::timeout(grace, async {
            while let Some(r) = tasks.join_next().await {
                if let Ok(Ok(r)) = r {
                    total += r;
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!("shutdown grace elapsed; unanswered attempts will turn DISPATCH_UNKNOWN when their leases expire");
        }
        Ok(total)
    }
}

/// A shutdown future for [`Dispatcher::run`] (or `Reconciler::run`, or the
/// consumer's `run`) that resolves once `rx` holds `true` or its sender is
/// dropped.
pub async fn until_true(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// What [`Dispatcher::run`] takes as its shutdown signal. `Form` is never
/// written by a caller: it is inferred from the argument's type, which picks
/// one of the two implementations.
///
/// - [`ShutdownFuture`]: any `Future<Output = ()> + Send`, e.g.
///   `async { let _ = tokio::signal::ctrl_c().await; }` or
///   [`until_true(rx)`](until_true). The form to use.
/// - [`ShutdownWatch`] (deprecated): a `tokio::sync::watch::Receiver<bool>`,
///   as `run` took before; the run stops once it holds `true` or its sender
///   is dropped ([`until_true`]). Each use logs a WARN with the caller's file
///   and line (`Dispatcher::run` is `#[track_caller]`) and the replacement.
///   The compiler cannot warn here: `#[deprecated]` on a trait impl has no
///   effect (rust-lang/rust#39935), so the warning is at run time.
pub trait IntoShutdown<Form>: Send + Sized {
    /// The shutdown future.
    type Future: std::future::Future<Output = ()> + Send;

    /// Turns `self` into the shutdown future.
    #[track_caller]
    fn into_shutdown(self) -> Self::Future;
}

/// [`IntoShutdown`]'s form for a shutdown future (the form to use).
#[derive(Debug)]
pub enum ShutdownFuture {}

/// [`IntoShutdown`]'s form for a `watch::Receiver<bool>` handed to
/// [`Dispatcher::run`]: accepted for callers of the old signature, with a
/// WARN at run time naming the caller.
#[deprecated(note = "pass a shutdown future: `run(outbox_producer::until_true(rx))` instead of `run(rx)`")]
#[derive(Debug)]
pub enum ShutdownWatch {}

impl<F: std::future::Future<Output = ()> + Send> IntoShutdown<ShutdownFuture> for F {
    type Future = F;

    fn into_shutdown(self) -> F {
        self
    }
}

/// The run-time warning of [`ShutdownWatch`].
const WATCH_SHUTDOWN_DEPRECATED: &str =
    "Dispatcher::run(watch::Receiver<bool>) is deprecated: pass a shutdown future, `run(outbox_producer::until_true(rx))`; the receiver still stops the run when it holds true";

#[allow(deprecated)]
impl IntoShutdown<ShutdownWatch> for watch::Receiver<bool> {
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

    #[track_caller]
    fn into_shutdown(self) -> Self::Future {
        let caller = std::panic::Location::caller();
        tracing::warn!(caller = %caller, "{WATCH_SHUTDOWN_DEPRECATED}");
        Box::pin(until_true(self))
    }
}
