//! The Kafka runner: one subscription, one worker per assigned partition,
//! offsets stored and committed only after the decision transaction commits.
//!
//! Shape: the run loop owns the `StreamConsumer` and reads messages; each
//! message goes to the bounded queue of its partition's worker task. A worker
//! takes what its queue holds (up to the batch limits), decides it with the
//! [`Processor`] in as few transactions as possible, then stores and commits
//! the next offset. A partition whose queue is full is paused at the broker
//! and resumed when its queue drains, so one slow or poisoned partition never
//! blocks the others.
//!
//! **Invariant:** an offset is stored only for messages whose decision
//! committed; `enable.auto.commit` and `enable.auto.offset.store` are off.
//!
//! **Invariant:** per partition, messages are decided in offset order by one
//! worker at a time; a worker replacing a revoked one waits for it to end.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt as _;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::config::ConsumerConfig;
use crate::error::ConsumerError;
use crate::event::RawMessage;
use crate::handler::Handler;
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::processor::Processor;
use crate::store::ConsumerStore;
use crate::readiness::ConsumerReadiness;

/// What an `after_db_commit` hook sees: a batch of one partition whose
/// decisions just committed, before its offset is stored.
#[derive(Debug)]
pub struct CommittedBatch<'a> {
    /// Topic.
    pub topic: &'a str,
    /// Partition.
    pub partition: i32,
    /// The decisions, in offset order.
    pub outcomes: &'a [Outcome],
}

/// What the consumer does after an `after_db_commit` hook returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookAction {
    /// Store and commit the offset, go on.
    Continue,
    /// Stop at once *without* storing or committing the offset, as if the
    /// process died between the database commit and the offset commit:
    /// [`IdempotentConsumer::run`] aborts its workers, drops the Kafka client
    /// and returns [`ConsumerError::StoppedByHook`]. For fault injection.
    Crash,
}

/// A callback run after every committed batch (observability, fault injection).
pub type AfterCommitHook = Arc<dyn Fn(&CommittedBatch<'_>) -> HookAction + Send + Sync>;

/// Period of the run loop's housekeeping (draining overflow, resuming
/// partitions, retiring revoked workers).
const TICK_MS: u64 = 20;

type PartitionKey = (String, i32);

/// State shared by a partition worker, the run loop and the rebalance callback.
#[derive(Debug, Default)]
struct PartitionState {
    /// Set when the partition is revoked or the consumer shuts down: the
    /// worker finishes its current transaction and ends.
    stop: AtomicBool,
}

/// Rebalance callbacks: mark revoked partitions, commit stored offsets.
struct Context {
    registry: Arc<Mutex<HashMap<PartitionKey, Arc<PartitionState>>>>,
    metrics: Arc<Metrics>,
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            {
                let mut reg = self.registry.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for e in tpl.elements() {
                    if let Some(state) = reg.remove(&(e.topic().to_owned(), e.partition())) {
                        state.stop.store(true, Ordering::Release);
                    }
                }
            }
            info!(partitions = tpl.count(), "partitions revoked");
            // Offsets stored so far belong to committed decisions: hand them
            // to the group before the partitions move.
            if let Err(e) = base.commit_consumer_state(CommitMode::Sync) {
                if !is_no_offset(&e) {
                    debug!(error = %e, "offset commit on revoke failed");
                }
            }
        }
    }

    fn post_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            info!(partitions = tpl.count(), "partitions assigned");
            // A partition paused before a revoke must not stay paused.
            let _ = base.resume(tpl);
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(e) = result {
            if !is_no_offset(&e) {
                Metrics::add(&self.metrics.offset_commit_failures, 1);
                debug!(error = %e, "offset commit failed");
            }
        }
    }
}

fn is_no_offset(e: &KafkaError) -> bool {
    e.rdkafka_error_code() == Some(RDKafkaErrorCode::NoOffset)
}

type Client = StreamConsumer<Context>;

/// What every worker needs.
struct Shared {
    processor: Arc<Processor>,
    hook: Option<AfterCommitHook>,
    fatal: mpsc::UnboundedSender<ConsumerError>,
    max_batch_messages: usize,
    max_batch_bytes: usize,
}

/// The run loop's view of one partition.
struct Slot {
    tx: mpsc::Sender<RawMessage>,
    state: Arc<PartitionState>,
    handle: JoinHandle<()>,
    /// Messages read while the queue was full (the partition is paused).
    overflow: VecDeque<RawMessage>,
    paused: bool,
    /// Next offset expected; lower ones are re-fetches after a resume.
    next_offset: i64,
}

/// The idempotent Kafka consumer (PROTOCOL §8).
///
/// For every message, in one PostgreSQL transaction: the `(consumerId,
/// eventId)` receipt is claimed, the [`Handler`] runs on that transaction, the
/// receipt records its result and the partition's watermark moves; only after
/// the commit is the offset stored and committed. Redeliveries get the
/// original receipt and no second effect; messages that fail verification are
/// quarantined; handlers that keep failing lead to dead letters; partitions
/// are processed independently.
pub struct IdempotentConsumer {
    config: ConsumerConfig,
    processor: Arc<Processor>,
    hook: Option<AfterCommitHook>,
    readiness: ConsumerReadiness,
}

impl std::fmt::Debug for IdempotentConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentConsumer").field("config", &self.config).field("hook", &self.hook.is_some()).finish()
    }
}

impl IdempotentConsumer {
    /// A consumer for `config` (validated) writing receipts to `pool`.
    pub fn new(config: ConsumerConfig, pool: PgPool, handler: impl Handler + 'static) -> Result<Self, ConsumerError> {
        config.validate()?;
        config.check_trust_environment()?;
        let processor = Processor::new(&config.consumer_id, pool, handler)?
            .with_retry(config.retry.clone())?
            .with_max_evidence_payload_bytes(config.max_evidence_payload_bytes)
            .with_trust(config.trust.clone())?;
        let open = config.trust.open_topics(&config.topics);
        if !open.is_empty() {
            tracing::warn!(
                consumer_id = %config.consumer_id,
                topics = ?open,
                "no trust policy for these topics: messages from any source are accepted (anyone who can produce to them can forge a self-consistent message); configure ConsumerConfig::trust"
            );
        }
        Ok(IdempotentConsumer { config, processor: Arc::new(processor), hook: None, readiness: ConsumerReadiness::default() })
    }

    /// Installs a callback run after every committed batch and before its
    /// offset is stored. Returning [`HookAction::Crash`] simulates a process
    /// death at exactly that point.
    pub fn after_db_commit(mut self, hook: impl Fn(&CommittedBatch<'_>) -> HookAction + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// The readiness signal of this instance (see [`ConsumerReadiness`]);
    /// take it before [`IdempotentConsumer::run`], which consumes `self`.
    pub fn readiness(&self) -> ConsumerReadiness {
        self.readiness.clone()
    }

    /// The counters of this instance.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.processor.metrics().clone()
    }

    /// Registers this consumer's metrics (counters `outbox_consumer_*_total`,
    /// histograms of handler duration and commit -> consumed, all labelled
    /// with its consumer id) into `registry`, for the service to serve on
    /// its `/metrics` (e.g. with `prometheus::TextEncoder`).
    pub fn register_metrics(&self, registry: &prometheus::Registry) -> prometheus::Result<()> {
        self.processor.metrics().register(registry, self.processor.consumer_id())
    }

    /// The processor (for [`redrive_dead_letter`](Processor::redrive_dead_letter)).
    pub fn processor(&self) -> &Arc<Processor> {
        &self.processor
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    fn client_config(&self) -> ClientConfig {
        self.config.client_config()
    }

    /// Subscribes and consumes until `shutdown` resolves or a fatal error
    /// occurs.
    ///
    /// On shutdown, workers finish the transaction they are in, store and
    /// commit their offsets (waiting at most `shutdown_timeout_ms`), and the
    /// consumer leaves its group. A fatal error (a non-retryable database
    /// error, retryable ones past `db_max_attempts`, a crashed worker, a hook
    /// returning [`HookAction::Crash`]) aborts every worker without storing
    /// more offsets and is returned; restart the consumer to continue, and
    /// already committed decisions come back as duplicates.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ConsumerError> {
        let metrics = self.processor.metrics().clone();
        let registry: Arc<Mutex<HashMap<PartitionKey, Arc<PartitionState>>>> = Arc::default();
        let context = Context { registry: registry.clone(), metrics: metrics.clone() };
        let client: Arc<Client> = Arc::new(self.client_config().create_with_context(context)?);
        let topics: Vec<&str> = self.config.topics.iter().map(String::as_str).collect();
        let cluster_id = fetch_cluster_id(&client).await?;
        let cluster_id = self.processor.set_cluster_id_if_unset(cluster_id).to_owned();
        client.subscribe(&topics)?;
        // The id of each topic's log, as this consumer last read it: every
        // message fetched is tagged with it (`RawMessage::log_id`).
        // The first read is waited for a short while only (a cluster that
        // does not answer it must not hold the start): until it is in,
        // messages carry no log id, and the partition's reading keeps the
        // log it had.
        let topic_ids: TopicIds = Arc::default();
        let mut first_read = tokio::spawn(refresh_topic_ids(client.clone(), self.config.topics.clone(), topic_ids.clone()));
        let mut id_refresh = match tokio::time::timeout(Duration::from_millis(TOPIC_ID_START_WAIT_MS), &mut first_read).await {
            Ok(_) => None,
            Err(_) => Some(first_read),
        };
        let mut id_tick = tokio::time::interval(Duration::from_millis(TOPIC_ID_REFRESH_MS));
        id_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        id_tick.reset();
        let publisher = crate::watermark_publisher::start(&self.config, self.processor.pool().clone(), metrics.clone(), cluster_id.clone())?;
        info!(consumer = %self.config.consumer_id, group = %self.config.group_id, cluster = %cluster_id, ?topics, "consumer started");

        let (fatal_tx, mut fatal_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            processor: self.processor.clone(),
            hook: self.hook.clone(),
            fatal: fatal_tx,
            max_batch_messages: self.config.max_batch_messages,
            max_batch_bytes: self.config.max_batch_bytes,
        });
        let mut run = RunLoop {
            client: client.clone(),
            shared,
            registry,
            slots: HashMap::new(),
            retired: HashMap::new(),
            capacity: self.config.max_buffered_per_partition,
        };
        let readiness = self.readiness.clone();
        readiness.started();
        let mut probe = tokio::time::interval(Duration::from_millis(crate::readiness::PROBE_EVERY_MS));
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut probing: Option<JoinHandle<()>> = None;
        let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shutdown = std::pin::pin!(shutdown);
        // Requeue requests (`outbox dead-letters requeue`): one redrive task at a time.
        let mut requeue_tick = tokio::time::interval(Duration::from_millis(crate::dead_letters::REQUEUE_CHECK_MS));
        requeue_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut requeue_task: Option<JoinHandle<()>> = None;
        let outcome = loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                Some(e) = fatal_rx.recv() => break Err(e),
                _ = requeue_tick.tick() => {
                    if requeue_task.as_ref().is_none_or(|t| t.is_finished()) {
                        requeue_task = Some(tokio::spawn(redrive_requested(self.processor.clone())));
                    }
                }
                // Before `recv`, which is always ready under load: paused
                // partitions must be drained and resumed on time.
                _ = tick.tick() => run.housekeeping(),
                _ = probe.tick() => {
                    // One probe at a time, off the run loop (both calls may block).
                    if probing.as_ref().is_none_or(|h| h.is_finished()) {
                        let (client, pool, readiness) = (client.clone(), self.processor.pool().clone(), readiness.clone());
                        // One subscribed topic: a cheap request, and one that cannot create a topic.
                        let topic = self.config.topics.first().cloned();
                        probing = Some(tokio::spawn(async move {
                            let timeout = Duration::from_millis(crate::readiness::PROBE_TIMEOUT_MS);
                            let k = tokio::task::spawn_blocking(move || client.fetch_metadata(topic.as_deref(), timeout).map(|_| ()).map_err(|e| e.to_string())).await;
                            readiness.kafka(k.unwrap_or_else(|e| Err(format!("probe task: {e}"))));
                            let db = tokio::time::timeout(timeout, sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&pool)).await;
                            readiness.database(match db {
                                Ok(Ok(_)) => Ok(()),
                                Ok(Err(e)) => Err(e.to_string()),
                                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                            });
                        }));
                    }
                }
                _ = id_tick.tick() => {
                    if id_refresh.as_ref().is_none_or(|t| t.is_finished()) {
                        id_refresh = Some(tokio::spawn(refresh_topic_ids(client.clone(), self.config.topics.clone(), topic_ids.clone())));
                    }
                }
                m = client.recv() => match m {
                    Ok(m) => {
                        let mut raw = RawMessage::from_kafka(&m);
                        drop(m);
                        raw.log_id = topic_ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&raw.topic).cloned();
                        Metrics::add(&metrics.received, 1);
                        run.dispatch(raw);
                    }
                    Err(e) => warn!(error = %e, "kafka consumer error"),
                },
            }
        };
        if let Some(h) = probing.take() {
            h.abort();
        }
        if let Some(h) = id_refresh.take() {
            h.abort();
        }
        readiness.stopped(outcome.as_ref().err().map(|e| e.to_string()));
        match outcome {
            Ok(()) => {
                run.stop_gracefully(Duration::from_millis(self.config.shutdown_timeout_ms)).await;
                if let Err(e) = client.commit_consumer_state(CommitMode::Sync) {
                    if !is_no_offset(&e) {
                        warn!(error = %e, "final offset commit failed");
                    }
                }
                if let Some(p) = publisher {
                    p.finish().await;
                }
                info!(consumer = %self.config.consumer_id, "consumer stopped");
            }
            Err(ref e) => {
                warn!(error = %e, "consumer stopping on error");
                run.abort().await;
                if let Some(p) = publisher {
                    p.abort().await;
                }
            }
        }
        if let Some(t) = requeue_task {
            t.abort();
        }
        drop(run);
        leave_group(client, Duration::from_millis(self.config.shutdown_timeout_ms)).await;
        outcome
    }
}

/// Closes the client (leaving the consumer group) on a blocking thread,
/// waiting at most `within`, so that `run` returns whatever librdkafka does.
///
/// Closing a consumer makes librdkafka serve a last rebalance (the revoke of
/// everything assigned), and its close can wait forever inside that
/// callback (`rd_kafka_assign` waiting on the group's thread; librdkafka
/// issue 4884). Seen here: a test's consumer stopping during a rebalance
/// hung in `BaseConsumer::drop` for good, and since the drop ran on the
/// runtime's thread, every timer of that runtime stopped with it, the
/// caller's own timeout included. (Unsubscribing first and serving the
/// revoke before the close was tried: librdkafka then aborted the process,
/// `rd_kafka_cgrp_terminated: assert: !rd_kafka_assignment_in_progress`.)
/// A close that does not finish in time is logged and left behind; the
/// group moves the partitions once the session times out.
async fn leave_group(client: Arc<Client>, within: Duration) {
    let closing = tokio::task::spawn_blocking(move || drop(client));
    if tokio::time::timeout(within, closing).await.is_err() {
        warn!(within_ms = within.as_millis() as u64, "the Kafka client did not close in time (a rebalance in progress); leaving it behind");
    }
}

/// Redrives the dead letters an operator asked to requeue.
async fn redrive_requested(processor: Arc<Processor>) {
    let ids = match crate::dead_letters::requested(processor.pool(), processor.consumer_id()).await {
        Ok(ids) => ids,
        Err(e) => {
            debug!(error = %e, "reading requeue requests failed");
            return;
        }
    };
    for id in ids {
        let Ok(event_id) = id.parse::<outbox_core::EventId>() else { continue };
        match processor.redrive_dead_letter(&event_id).await {
            Ok(Some(outcome)) => info!(event_id = %id, outcome = outcome.kind(), "requeued dead letter redriven"),
            Ok(None) => {}
            Err(e) => {
                // Not retried every second: the request is cleared, the dead letter stays.
                warn!(event_id = %id, error = %e, "requeued dead letter could not be redriven; request cleared");
                let _ = sqlx::query(
                    "UPDATE outbox_consumer_dead_letters SET requeue_requested_at_ms = NULL, requeue_requested_by = NULL WHERE consumer_id = $1 AND event_id = $2",
                )
                .bind(processor.consumer_id())
                .bind(&id)
                .execute(processor.pool())
                .await;
            }
        }
    }
}

struct RunLoop {
    client: Arc<Client>,
    shared: Arc<Shared>,
    registry: Arc<Mutex<HashMap<PartitionKey, Arc<PartitionState>>>>,
    slots: HashMap<PartitionKey, Slot>,
    /// Workers of revoked partitions that may still be finishing a batch.
    retired: HashMap<PartitionKey, JoinHandle<()>>,
    capacity: usize,
}

impl RunLoop {
    fn set_paused(&self, key: &PartitionKey, paused: bool) {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&key.0, key.1);
        debug!(topic = %key.0, partition = key.1, paused, "flow control");
        let r = if paused { self.client.pause(&tpl) } else { self.client.resume(&tpl) };
        if let Err(e) = r {
            debug!(topic = %key.0, partition = key.1, paused, error = %e, "pause/resume refused");
        }
    }

    fn retire_stopped(&mut self) {
        let stopped: Vec<PartitionKey> = self.slots.iter().filter(|(_, s)| s.state.stop.load(Ordering::Acquire)).map(|(k, _)| k.clone()).collect();
        for key in stopped {
            if let Some(slot) = self.slots.remove(&key) {
                // Dropping the sender lets the worker end after its batch.
                if let Some(old) = self.retired.insert(key, slot.handle) {
                    old.abort();
                }
            }
        }
        self.retired.retain(|_, h| !h.is_finished());
    }

    fn spawn_worker(&mut self, key: PartitionKey, first_offset: i64) {
        let (tx, rx) = mpsc::channel(self.capacity);
        let state = Arc::new(PartitionState::default());
        self.registry.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key.clone(), state.clone());
        let previous = self.retired.remove(&key);
        let shared = self.shared.clone();
        let client = self.client.clone();
        let worker_state = state.clone();
        let (topic, partition) = key.clone();
        let handle = tokio::spawn(async move {
            let fatal = shared.fatal.clone();
            let body = worker(rx, worker_state, shared, client, topic, partition, previous);
            if let Err(panic) = AssertUnwindSafe(body).catch_unwind().await {
                let text = panic.downcast_ref::<&str>().map(|s| (*s).to_owned()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
                let _ = fatal.send(ConsumerError::Worker(format!("partition worker panicked: {text}")));
            }
        });
        self.slots.insert(key, Slot { tx, state, handle, overflow: VecDeque::new(), paused: false, next_offset: first_offset });
    }

    fn dispatch(&mut self, msg: RawMessage) {
        let key = (msg.topic.clone(), msg.partition);
        if self.slots.get(&key).is_some_and(|s| s.state.stop.load(Ordering::Acquire)) {
            self.retire_stopped();
        }
        if !self.slots.contains_key(&key) {
            self.spawn_worker(key.clone(), msg.offset);
        }
        let mut pause = false;
        if let Some(slot) = self.slots.get_mut(&key) {
            if msg.offset < slot.next_offset {
                return;
            }
            slot.next_offset = msg.offset.saturating_add(1);
            if !slot.overflow.is_empty() {
                slot.overflow.push_back(msg);
                return;
            }
            match slot.tx.try_send(msg) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(msg)) => {
                    slot.overflow.push_back(msg);
                    if !slot.paused {
                        slot.paused = true;
                        pause = true;
                    }
                }
                // The worker ended: a fatal error is on its way to the run loop.
                Err(mpsc::error::TrySendError::Closed(_)) => {}
            }
        }
        if pause {
            Metrics::add(&self.shared.processor.metrics().partitions_paused, 1);
            self.set_paused(&key, true);
        }
    }

    fn housekeeping(&mut self) {
        self.retire_stopped();
        let mut resume = Vec::new();
        for (key, slot) in &mut self.slots {
            while let Some(msg) = slot.overflow.pop_front() {
                match slot.tx.try_send(msg) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(msg)) => {
                        slot.overflow.push_front(msg);
                        break;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        slot.overflow.clear();
                        break;
                    }
                }
            }
            if slot.paused && slot.overflow.is_empty() {
                slot.paused = false;
                resume.push(key.clone());
            }
        }
        for key in resume {
            self.set_paused(&key, false);
        }
    }

    /// Stops every worker after its current transaction and waits for them.
    async fn stop_gracefully(&mut self, timeout: Duration) {
        let mut handles = Vec::new();
        for (_, slot) in self.slots.drain() {
            slot.state.stop.store(true, Ordering::Release);
            handles.push(slot.handle);
        }
        handles.extend(self.retired.drain().map(|(_, h)| h));
        let deadline = tokio::time::Instant::now() + timeout;
        for mut h in handles {
            if tokio::time::timeout_at(deadline, &mut h).await.is_err() {
                warn!("a partition worker did not stop in time; abandoning its batch");
                h.abort();
                let _ = h.await;
            }
        }
    }

    /// Aborts every worker at its next await point, storing nothing more.
    async fn abort(&mut self) {
        let mut handles: Vec<JoinHandle<()>> = self.slots.drain().map(|(_, s)| s.handle).collect();
        handles.extend(self.retired.drain().map(|(_, h)| h));
        for h in &handles {
            h.abort();
        }
        for h in handles {
            let _ = h.await;
        }
    }
}

/// Stores and commits `next_offset` for one partition.
fn commit_offset(client: &Client, metrics: &Metrics, topic: &str, partition: i32, next_offset: i64) {
    let mut tpl = TopicPartitionList::new();
    if let Err(e) = tpl.add_partition_offset(topic, partition, Offset::Offset(next_offset)) {
        warn!(error = %e, "cannot build offset list");
        return;
    }
    // Fails with _STATE when the partition was revoked meanwhile: the next
    // owner reads from the last committed offset and finds duplicates.
    if let Err(e) = client.store_offsets(&tpl) {
        Metrics::add(&metrics.offset_commit_failures, 1);
        debug!(topic, partition, error = %e, "offset not stored");
        return;
    }
    if let Err(e) = client.commit(&tpl, CommitMode::Async) {
        Metrics::add(&metrics.offset_commit_failures, 1);
        debug!(topic, partition, error = %e, "offset commit not sent");
    }
}

async fn worker(
    mut rx: mpsc::Receiver<RawMessage>,
    state: Arc<PartitionState>,
    shared: Arc<Shared>,
    client: Arc<Client>,
    topic: String,
    partition: i32,
    previous: Option<JoinHandle<()>>,
) {
    if let Some(previous) = previous {
        // The previous worker of this partition may still be committing.
        let _ = previous.await;
    }
    let committer = KafkaOffsets { client, metrics: shared.processor.metrics().clone() };
    let limits = BatchLimits { max_messages: shared.max_batch_messages, max_bytes: shared.max_batch_bytes };
    if let Err(e) = run_partition(&mut rx, &state.stop, &shared.processor, shared.hook.as_ref(), limits, &committer, &topic, partition).await {
        let _ = shared.fatal.send(e);
    }
}

/// The Kafka client as the [`OffsetCommit`] of a partition worker.
struct KafkaOffsets {
    client: Arc<Client>,
    metrics: Arc<Metrics>,
}

impl OffsetCommit for KafkaOffsets {
    fn commit(&self, topic: &str, partition: i32, next_offset: i64) {
        commit_offset(&self.client, &self.metrics, topic, partition, next_offset);
    }
}

/// Where a partition worker hands the next offset to read once a batch's
/// decisions committed: the Kafka client's offset store in production
/// (stored and committed asynchronously, so it may be lost: the next owner
/// then reads the batch again and finds duplicates), the simulated group
/// coordinator in the simulator.
pub trait OffsetCommit: Send + Sync {
    /// Stores `next_offset` as the partition's position (best effort).
    fn commit(&self, topic: &str, partition: i32, next_offset: i64);
}

/// How much one decision batch of a partition worker takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most messages per batch.
    pub max_messages: usize,
    /// A batch stops growing once its messages hold this many bytes.
    pub max_bytes: usize,
}

/// The loop of one partition, as [`IdempotentConsumer`] runs it for every
/// assigned partition: takes the messages that wait in `rx` (in offset
/// order, up to `limits`) as one batch, decides it with the
/// [`Processor`] (receipts and effects commit in the receipt store), runs
/// the `after_db_commit` hook, and only then hands the next offset to
/// `offsets`. Ends with `Ok` when `rx` closes or `stop` is set (the
/// partition was revoked: the batch in flight finishes its transaction or
/// gives up before it), and with the error the consumer must stop on
/// otherwise (a store error that retries did not cure, or
/// [`ConsumerError::StoppedByHook`]).
#[allow(clippy::too_many_arguments)]
pub async fn run_partition<S: ConsumerStore>(
    rx: &mut mpsc::Receiver<RawMessage>,
    stop: &AtomicBool,
    processor: &Processor<S>,
    hook: Option<&AfterCommitHook>,
    limits: BatchLimits,
    offsets: &dyn OffsetCommit,
    topic: &str,
    partition: i32,
) -> Result<(), ConsumerError> {
    // A message of another log than its batch's: the first of the next batch.
    let mut carried: Option<RawMessage> = None;
    loop {
        let first = match carried.take() {
            Some(m) => m,
            None => match rx.recv().await {
                Some(m) => m,
                None => break,
            },
        };
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut bytes = first.size_bytes();
        let mut batch = vec![first];
        while batch.len() < limits.max_messages && bytes < limits.max_bytes {
            match rx.try_recv() {
                Ok(m) if m.log_id != batch[0].log_id => {
                    carried = Some(m);
                    break;
                }
                Ok(m) => {
                    bytes += m.size_bytes();
                    batch.push(m);
                }
                Err(_) => break,
            }
        }
        if outbox_core::simulation::mutation_active("offset-before-commit") {
            // The deliberate defect: the offset moves before the decisions commit.
            offsets.commit(topic, partition, batch[batch.len() - 1].offset.saturating_add(1));
        }
        let outcomes = match processor.process_batch_until(&batch, stop).await {
            Ok(o) => o,
            Err(ConsumerError::Stopped) => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(last) = outcomes.last().map(|o| o.position().offset) else {
            return Ok(());
        };
        if let Some(hook) = hook {
            if hook(&CommittedBatch { topic, partition, outcomes: &outcomes }) == HookAction::Crash {
                return Err(ConsumerError::StoppedByHook { topic: topic.to_owned(), partition, last_offset: last });
            }
        }
        offsets.commit(topic, partition, last.saturating_add(1));
        if outcomes.len() < batch.len() {
            // Stopped in the middle of the batch.
            return Ok(());
        }
    }
    Ok(())
}

/// How often the consumer reads its topics' ids again, ms. A topic deleted
/// and created again under its name (or the same name on a replaced
/// cluster) has another id: the messages fetched once this consumer has
/// read it are of another log ([`RawMessage::log_id`]), and its reading of
/// each partition starts over there (module [`gap`](crate::gap)). Messages
/// fetched from the new log before that are counted in the old log's
/// reading, and become part of the new log's gap once the new id is read:
/// held, never passed, unless an operator accepts that gap (an accepted
/// range counts as read: accept a gap only once its messages are known
/// to be gone or not meant for this consumer).
pub const TOPIC_ID_REFRESH_MS: u64 = 5_000;

/// Most time one read of a topic's id may take, ms.
const TOPIC_ID_TIMEOUT_MS: u64 = 10_000;

/// Most time the start waits for the first read of the topics' ids, ms.
const TOPIC_ID_START_WAIT_MS: u64 = 3_000;

/// Topic name to the id of its log, as last read.
type TopicIds = Arc<Mutex<HashMap<String, String>>>;

/// Reads the ids of `topics` (off the async runtime: the calls block) into
/// `ids`. A topic whose id cannot be read keeps the one it had (a cluster
/// without topic ids, a topic not created yet: none, and its messages carry
/// no log id); a changed id is logged.
async fn refresh_topic_ids(client: Arc<Client>, topics: Vec<String>, ids: TopicIds) {
    let read = tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_millis(TOPIC_ID_TIMEOUT_MS);
        topics.into_iter().map(|t| {
            let id = outbox_topic_id::topic_id(client.client(), &t, timeout);
            (t, id)
        }).collect::<Vec<_>>()
    })
    .await;
    let Ok(read) = read else { return };
    let mut ids = ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for (topic, id) in read {
        match id {
            Ok(Some(bytes)) => {
                let id = outbox_core::envelope::topic_id_text(&bytes);
                match ids.insert(topic.clone(), id.clone()) {
                    Some(old) if old != id => warn!(%topic, old_id = %old, new_id = %id,
                        "the topic has a new id: it was deleted and created again (or its cluster replaced); what is fetched from now on is read as a new log"),
                    None => debug!(%topic, %id, "topic id read"),
                    _ => {}
                }
            }
            Ok(None) => debug!(%topic, "the cluster gives no topic ids: messages carry no log id"),
            Err(e) => debug!(%topic, error = %e, "the topic's id could not be read; the last one read stays"),
        }
    }
}

/// Most time spent asking the broker for its cluster id at start.
const CLUSTER_ID_TIMEOUT_MS: u64 = 30_000;

/// The broker's cluster id, which names this consumer's receipts and
/// watermarks. Asked with a bounded wait: a consumer that cannot learn which
/// cluster it reads does not start (its watermarks would be unattributable).
async fn fetch_cluster_id(client: &Arc<Client>) -> Result<String, ConsumerError> {
    let c = client.clone();
    let got = tokio::task::spawn_blocking(move || c.client().fetch_cluster_id(rdkafka::util::Timeout::After(Duration::from_millis(CLUSTER_ID_TIMEOUT_MS))))
        .await
        .map_err(|e| ConsumerError::Config(format!("cluster id lookup task failed: {e}")))?;
    match got {
        Some(id) if !id.is_empty() => Ok(id),
        _ => Err(ConsumerError::Config(format!(
            "the broker did not tell its cluster id within {CLUSTER_ID_TIMEOUT_MS} ms (is bootstrap.servers reachable, and the broker Kafka 0.10.1 or later?)"
        ))),
    }
}
