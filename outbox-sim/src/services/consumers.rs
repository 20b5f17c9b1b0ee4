//! The consumer side of the services engine: the shipped
//! `outbox_consumer::Processor` and its partition loop
//! (`outbox_consumer::run_partition`, the loop `IdempotentConsumer` runs for
//! every assigned partition) read the simulated broker's logs and apply
//! every event once over `MemoryConsumerStore`, behind the faults a
//! consumer meets:
//! - the receipt store: calls that fail, stall, or commit and lose their
//!   answer (the processor decides again and must find its own receipts);
//! - the process: crashes after the database commit and before the offset
//!   commit (the shipped `after_db_commit` hook answering `Crash`), kills of
//!   the whole consumer process (every partition task dropped at an await,
//!   open transactions rolled back), offset commits that are lost (the
//!   client commits asynchronously), so batches are read again;
//! - the group: rebalances with a batch in flight: the partition's stop flag
//!   is set and a new owner starts at once from the committed offset while
//!   the old one finishes its transaction (its offset commit is refused, as
//!   a fenced member's is), so two owners race on one event's receipt;
//! - the handler: transient failures (the batch splits, the event retries
//!   alone).
//!
//! - the group's offsets: an owner that starts at the log's end instead of
//!   its committed offset (the group reset to latest by an operator, or an
//!   expired committed offset reset by `auto.offset.reset`): the offsets in
//!   between are never read, and the shipped processor must record them as
//!   a gap its watermark does not pass.
//!
//! The feeder that hands each partition's messages to the loop stands in
//! for librdkafka's fetch (the seam the shipped run loop reads through): in
//! offset order, from the committed offset, from the log's start once
//! retention truncated below it (an offset out of range).
//!
//! Checks after the run (names as Jepsen's Kafka checker uses where they
//! apply): `duplicate_effect` (an event's effect written twice),
//! `receipt_effect_mismatch` (a receipt without its effect or an effect
//! without its receipt), `unseen` (an event published at a position the log
//! still holds, never applied nor dead-lettered, and not skipped by a
//! reset), `watermark_passes_unread` (the group's watermark in such an
//! event's log past its offset, reset or not, in a replaced log or the
//! first), `genuine_quarantined` (a message the
//! dispatcher wrote refused by the consumer's verification). Retention
//! (`retention.rs`) purges on the watermarks this group's store holds.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_consumer::memory::{MemoryConsumerStore, MemoryTx};
use outbox_consumer::store::{Claim, DeadLetterRow, QuarantineRow, WatermarkAdvance};
use outbox_consumer::{
    run_partition, AfterCommitHook, BatchLimits, ConsumedEvent, ConsumerError, ConsumerStore, HandlerError, HookAction, OffsetCommit, Processor, RawMessage, Receipt,
    TxHandler,
};
use outbox_memory::{MemoryStore, MemoryWatermark};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::world::{world, Shared};
use super::{CLUSTER, NEW_TOPIC, PARTITIONS, T0_MS, TOPIC};
use crate::rng::Rng;

/// The consumer group whose receipts and effects are checked.
pub(super) const GROUP: &str = "fulfilment";
/// Traces whose consumer owners may start at the log's end (a reset).
const RESET_TRACES: f64 = 0.3;
/// Where the handler writes its effects in the store.
const EFFECTS: &str = "fulfilment.effects";

/// Fault probabilities of the consumers in one trace.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConsumerFaults {
    /// A receipt-store call fails before doing anything.
    store_fail: f64,
    /// A commit happens and its answer is lost.
    answer_lost: f64,
    /// A store call stalls (up to two seconds).
    stall: f64,
    /// After a batch's database commit, the process dies before the offset commit.
    crash_after_commit: f64,
    /// An offset commit is lost.
    offset_commit_lost: f64,
    /// A handler run fails transiently.
    handler_fail: f64,
    /// Mean virtual ms between rebalances (0: none).
    rebalance_every_ms: i64,
    /// Mean virtual ms between kills of the consumer process (0: none).
    kill_every_ms: i64,
    /// An owner starts at the log's end, not at the committed offset.
    reset: f64,
}

impl ConsumerFaults {
    fn from_rng(rng: &mut Rng) -> Self {
        let mut p = |max: f64| if rng.chance(0.3) { 0.0 } else { rng.unit() * max };
        let f = ConsumerFaults {
            store_fail: p(0.05),
            answer_lost: p(0.05),
            stall: p(0.03),
            crash_after_commit: p(0.1),
            offset_commit_lost: p(0.3),
            handler_fail: p(0.1),
            rebalance_every_ms: 0,
            kill_every_ms: 0,
            reset: 0.0,
        };
        let rebalance_every_ms = if rng.chance(0.6) { rng.range(1_000, 10_000) } else { 0 };
        let kill_every_ms = if rng.chance(0.5) { rng.range(2_000, 15_000) } else { 0 };
        ConsumerFaults { rebalance_every_ms, kill_every_ms, ..f }
    }

    /// Draws the reset fault from its own generator (`seed`), so that the
    /// faults drawn before it stay as they were for every seed.
    fn with_resets(self, seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x0ff5_e7_4e5e7);
        let reset = if rng.chance(RESET_TRACES) { 0.05 + rng.unit() * 0.25 } else { 0.0 };
        ConsumerFaults { reset, ..self }
    }
}

/// What the consumers' fault points share: the trace's world (whether
/// faults are on, the figures, the log), their own random stream (so that
/// the producer side of a trace does not change with them) and the faults.
struct Faults {
    world: Shared,
    rng: Mutex<Rng>,
    faults: ConsumerFaults,
}

impl Faults {
    fn chance(&self, p: f64) -> bool {
        world(&self.world).on && self.rng.lock().unwrap_or_else(|e| e.into_inner()).chance(p)
    }

    fn range(&self, lo: i64, hi: i64) -> i64 {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).range(lo, hi)
    }

    fn note(&self, line: impl FnOnce() -> String) {
        world(&self.world).note(line);
    }
}

/// The receipt store behind a database's faults.
#[derive(Clone)]
struct SimConsumerStore {
    inner: MemoryConsumerStore,
    faults: Arc<Faults>,
}

impl SimConsumerStore {
    async fn before(&self, what: &str) -> Result<(), ConsumerError> {
        let f = self.faults.faults;
        if self.faults.chance(f.stall) {
            let ms = self.faults.range(1, 2_000);
            world(&self.faults.world).figures.consumer_store_faults += 1;
            tokio::time::sleep(Duration::from_millis(ms as u64)).await;
        }
        if self.faults.chance(f.store_fail) {
            world(&self.faults.world).figures.consumer_store_faults += 1;
            return Err(ConsumerError::Unavailable(format!("simulated: connection lost before {what}")));
        }
        Ok(())
    }
}

#[async_trait]
impl ConsumerStore for SimConsumerStore {
    type Tx = MemoryTx;

    async fn begin(&self) -> Result<MemoryTx, ConsumerError> {
        self.before("begin").await?;
        self.inner.begin().await
    }

    async fn commit(&self, tx: MemoryTx) -> Result<(), ConsumerError> {
        if let Err(e) = self.before("commit").await {
            drop(tx);
            return Err(e);
        }
        self.inner.commit(tx).await?;
        if self.faults.chance(self.faults.faults.answer_lost) {
            world(&self.faults.world).figures.consumer_store_faults += 1;
            return Err(ConsumerError::Unavailable("simulated: the commit happened and its answer was lost".into()));
        }
        Ok(())
    }

    async fn rollback(&self, tx: MemoryTx) {
        self.inner.rollback(tx).await;
    }

    async fn claim(&self, tx: &mut MemoryTx, consumer_id: &str, cluster_id: &str, events: &[&ConsumedEvent]) -> Result<HashMap<String, Claim>, ConsumerError> {
        self.before("claim").await?;
        self.inner.claim(tx, consumer_id, cluster_id, events).await
    }

    async fn receipts(&self, tx: &mut MemoryTx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, Receipt>, ConsumerError> {
        self.inner.receipts(tx, consumer_id, ids).await
    }

    async fn dead_letters(&self, tx: &mut MemoryTx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, (u32, String)>, ConsumerError> {
        self.inner.dead_letters(tx, consumer_id, ids).await
    }

    async fn store_results(&self, tx: &mut MemoryTx, consumer_id: &str, results: &[(String, Value)]) -> Result<(), ConsumerError> {
        self.inner.store_results(tx, consumer_id, results).await
    }

    async fn quarantine(&self, tx: &mut MemoryTx, consumer_id: &str, rows: &[QuarantineRow<'_>], max_payload_bytes: usize) -> Result<HashSet<i64>, ConsumerError> {
        self.inner.quarantine(tx, consumer_id, rows, max_payload_bytes).await
    }

    async fn insert_dead_letter(&self, tx: &mut MemoryTx, consumer_id: &str, row: &DeadLetterRow<'_>) -> Result<bool, ConsumerError> {
        self.inner.insert_dead_letter(tx, consumer_id, row).await
    }

    async fn reading(&self, tx: &mut MemoryTx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32) -> Result<outbox_consumer::gap::Reading, ConsumerError> {
        self.inner.reading(tx, consumer_id, cluster_id, topic, partition).await
    }

    async fn save_reading(&self, tx: &mut MemoryTx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32, change: &outbox_consumer::gap::ReadingChange) -> Result<(), ConsumerError> {
        self.inner.save_reading(tx, consumer_id, cluster_id, topic, partition, change).await
    }

    async fn advance_watermarks(
        &self,
        tx: &mut MemoryTx,
        consumer_id: &str,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        rows: &[WatermarkAdvance],
    ) -> Result<(), ConsumerError> {
        self.before("watermark").await?;
        self.inner.advance_watermarks(tx, consumer_id, cluster_id, topic, partition, rows).await
    }
}

/// The service's handler: one effect per event, written in the receipt
/// transaction; sometimes it fails transiently.
struct Fulfil {
    faults: Arc<Faults>,
}

#[async_trait]
impl TxHandler<MemoryTx> for Fulfil {
    async fn handle_in(&self, tx: &mut MemoryTx, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        if self.faults.chance(self.faults.faults.handler_fail) {
            return Err(HandlerError::transient("simulated: the dependency is down"));
        }
        tx.write_effect(EFFECTS, json!(event.event_id.as_str()));
        Ok(json!({ "offset": event.offset }))
    }
}

type Key = (String, i32);

/// The group coordinator: committed offsets and, per partition, the
/// current owner's generation and stop flag.
#[derive(Default)]
struct Group {
    /// Committed offsets per partition and log incarnation (a recreated
    /// topic's or a replaced cluster's log is another log: its offsets
    /// start again at 0).
    committed: BTreeMap<(Key, usize), i64>,
    generation: BTreeMap<Key, u64>,
    stop: BTreeMap<Key, (Arc<AtomicBool>, Arc<tokio::sync::Notify>)>,
}

/// An owner's offset commits: refused once its generation is superseded.
struct Offsets {
    ctx: Arc<Ctx>,
    generation: u64,
    incarnation: usize,
}

impl OffsetCommit for Offsets {
    fn commit(&self, topic: &str, partition: i32, next_offset: i64) {
        let key = (topic.to_owned(), partition);
        if self.ctx.faults.chance(self.ctx.faults.faults.offset_commit_lost) {
            self.ctx.faults.note(|| format!("{GROUP} {topic}/p{partition}: offset commit {next_offset} lost"));
            return;
        }
        let mut g = self.ctx.group.lock().unwrap_or_else(|e| e.into_inner());
        if g.generation.get(&key) != Some(&self.generation) {
            return;
        }
        let at = g.committed.entry((key, self.incarnation)).or_insert(0);
        *at = (*at).max(next_offset);
    }
}

struct Ctx {
    world: Shared,
    faults: Arc<Faults>,
    group: Mutex<Group>,
    processor: Processor<SimConsumerStore>,
    /// Every partition owner's task (current and superseded), for a kill.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Offsets resets made the group skip: partition, log incarnation,
    /// `[from, to)`.
    skipped: Mutex<Vec<(Key, usize, i64, i64)>>,
}

/// The consumers of one trace.
pub(super) struct Consumers {
    ctx: Arc<Ctx>,
    store: MemoryConsumerStore,
    supervisors: Vec<JoinHandle<()>>,
    next_kill: i64,
    next_rebalance: i64,
    rng: Rng,
}

fn keys() -> Vec<Key> {
    [TOPIC, NEW_TOPIC].iter().flat_map(|t| (0..PARTITIONS as i32).map(move |p| ((*t).to_owned(), p))).collect()
}

impl Consumers {
    /// Starts the group's consumer process over `world`.
    pub(super) fn start(world_ref: &Shared, seed: u64) -> Consumers {
        let mut rng = Rng::new(seed.wrapping_mul(0xA24B_AED4_963E_E407) ^ 0xC0_5E);
        let faults = ConsumerFaults::from_rng(&mut rng).with_resets(seed);
        let start = world(world_ref).start;
        let store = MemoryConsumerStore::new().with_clock(move || {
            let ms = T0_MS + i64::try_from(start.elapsed().as_millis()).unwrap_or(0);
            chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default()
        });
        let faults = Arc::new(Faults { world: world_ref.clone(), rng: Mutex::new(Rng::new(rng.below(u64::MAX))), faults });
        let sim_store = SimConsumerStore { inner: store.clone(), faults: faults.clone() };
        let retry = outbox_consumer::RetryPolicy { max_attempts: 50, initial_backoff_ms: 20, max_backoff_ms: 500, handler_timeout_ms: 30_000, db_max_attempts: 5 };
        let processor = Processor::over(sim_store, GROUP, Fulfil { faults: faults.clone() })
            .and_then(|p| p.with_retry(retry))
            .expect("a valid consumer configuration")
            .with_cluster_id(CLUSTER);
        world(world_ref).note(|| format!("consumers {GROUP}: {faults:?}", faults = faults.faults));
        let ctx = Arc::new(Ctx { world: world_ref.clone(), faults, group: Mutex::new(Group::default()), processor, tasks: Mutex::new(Vec::new()), skipped: Mutex::new(Vec::new()) });
        let f = ctx.faults.faults;
        let next_kill = if f.kill_every_ms > 0 { rng.range(1, 2 * f.kill_every_ms) } else { i64::MAX };
        let next_rebalance = if f.rebalance_every_ms > 0 { rng.range(1, 2 * f.rebalance_every_ms) } else { i64::MAX };
        let mut c = Consumers { ctx, store, supervisors: Vec::new(), next_kill, next_rebalance, rng };
        c.spawn_supervisors();
        c
    }

    fn spawn_supervisors(&mut self) {
        self.supervisors = keys().into_iter().map(|k| tokio::spawn(supervise(self.ctx.clone(), k))).collect();
    }

    /// The next virtual time (ms from the start) this needs the driver.
    pub(super) fn next_due(&self) -> i64 {
        self.next_kill.min(self.next_rebalance)
    }

    /// Runs what is due at `clock`: a kill of the consumer process, a rebalance.
    pub(super) fn tick(&mut self, clock: i64) {
        let f = self.ctx.faults.faults;
        if self.next_kill <= clock {
            self.next_kill = clock + self.rng.range(1, 2 * f.kill_every_ms);
            self.ctx.faults.note(|| format!("kill consumer process {GROUP}; restart"));
            world(&self.ctx.world).figures.consumer_kills += 1;
            self.kill();
            self.spawn_supervisors();
        }
        if self.next_rebalance <= clock {
            self.next_rebalance = clock + self.rng.range(1, 2 * f.rebalance_every_ms);
            let all = keys();
            let key = all[self.rng.below(all.len() as u64) as usize].clone();
            let g = self.ctx.group.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((stop, moved)) = g.stop.get(&key) {
                stop.store(true, Ordering::Release);
                moved.notify_one();
                drop(g);
                world(&self.ctx.world).figures.rebalances += 1;
                self.ctx.faults.note(|| format!("rebalance {GROUP} {}/p{}: a new owner starts; the old one finishes its batch", key.0, key.1));
            }
        }
    }

    fn kill(&mut self) {
        for s in self.supervisors.drain(..) {
            s.abort();
        }
        for t in self.ctx.tasks.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            t.abort();
        }
    }

    /// The group's receipt store (its watermarks are what retention reads).
    pub(super) fn store(&self) -> MemoryConsumerStore {
        self.store.clone()
    }

    /// Whether every event published at a position the log still holds (and
    /// that holds it) was applied or dead-lettered by the group, or skipped
    /// by a reset.
    pub(super) fn caught_up(&self, outbox: &MemoryStore) -> bool {
        self.undecided(outbox).iter().all(|u| self.skipped(u))
    }

    /// The events published at a position the current log still holds
    /// (and that holds them) that the group neither applied nor dead-lettered.
    fn undecided(&self, outbox: &MemoryStore) -> Vec<Undecided> {
        let readable: Vec<Undecided> = {
            let st = outbox.lock();
            let w = world(&self.ctx.world);
            st.events
                .values()
                .filter_map(|e| {
                    let slot = e.slot.as_ref()?;
                    let key = (slot.topic.clone(), slot.partition);
                    let start = w.log_start.get(&key).copied().unwrap_or(0);
                    // Only a position that holds the event can be read: one
                    // that does not is a lost write, reported by the producer checks.
                    let holds = w.logs.get(&key).and_then(|l| l.get(usize::try_from(slot.offset).ok()?)).is_some_and(|m| m.event_id == e.envelope.event_id.as_str() && !m.compacted);
                    let incarnation = w.incarnation(&key);
                    (e.state.is_published() && slot.offset >= start && holds).then(|| Undecided { id: e.envelope.event_id.to_string(), key, offset: slot.offset, incarnation })
                })
                .collect()
        };
        readable.into_iter().filter(|u| !decided(&self.store, &u.id)).collect()
    }

    /// Whether a reset made the group skip `u`'s offset of its log.
    fn skipped(&self, u: &Undecided) -> bool {
        self.ctx.skipped.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|(k, inc, from, to)| *k == u.key && *inc == u.incarnation && (*from..*to).contains(&u.offset))
    }

    /// Stops every consumer task and checks the group's receipts and effects.
    pub(super) fn finish(mut self, outbox: &MemoryStore, violations: &mut Vec<String>) {
        self.kill();
        let undecided: Vec<(Undecided, bool)> = self.undecided(outbox).into_iter().map(|u| {
            let skipped = self.skipped(&u);
            (u, skipped)
        }).collect();
        let st = self.store.lock();
        let mut w = world(&self.ctx.world);
        let mut effects: BTreeMap<&str, u64> = BTreeMap::new();
        for v in st.effects.get(EFFECTS).into_iter().flatten() {
            *effects.entry(v.as_str().unwrap_or_default()).or_default() += 1;
        }
        for (id, n) in &effects {
            if *n > 1 {
                w.figures.duplicate_effect += 1;
                violations.push(format!("duplicate_effect: {GROUP} applied {id} {n} times"));
            }
        }
        let receipts: BTreeSet<&str> = st.receipts.keys().filter(|(c, _)| c == GROUP).map(|(_, e)| e.as_str()).collect();
        let with_effect: BTreeSet<&str> = effects.keys().copied().collect();
        for id in receipts.symmetric_difference(&with_effect) {
            w.figures.receipt_effect_mismatch += 1;
            let has = if receipts.contains(id) { "a receipt and no effect" } else { "an effect and no receipt" };
            violations.push(format!("receipt_effect_mismatch: {GROUP} has {has} for {id}"));
        }
        for (u, skipped) in &undecided {
            let (id, (t, p), o) = (&u.id, &u.key, u.offset);
            if *skipped {
                w.figures.skipped_by_reset += 1;
            } else {
                w.figures.unseen += 1;
                violations.push(format!("unseen: {id} at {t}/p{p}@{o} published and never applied by {GROUP}"));
            }
            // The watermarks the consumer keeps in the event's own log (the
            // log id its fetches saw: one per incarnation), of any
            // incarnation: a consumer that reads a replaced log from the old
            // log's position must not count the new log's offsets below it.
            let log = super::world::log_id_of(u.incarnation);
            let mark = st
                .watermarks
                .iter()
                .filter(|((c, cl, wt, wp, _), row)| (c.as_str(), cl.as_str(), wt.as_str(), *wp) == (GROUP, CLUSTER, t.as_str(), *p) && row.log_id.as_deref() == Some(log.as_str()))
                .map(|(_, row)| row.committed_offset)
                .max();
            if mark.is_some_and(|m| m > o) {
                w.figures.watermark_passes_unread += 1;
                violations.push(format!("watermark_passes_unread: {GROUP}'s watermark on {t}/p{p} is {mark:?}, past {id}@{o}, which it never applied"));
            }
        }
        for ((_, t, p, o), q) in &st.quarantine {
            if w.forged_at(t, *p, *o) {
                w.figures.forged_quarantined += 1;
                continue;
            }
            w.figures.genuine_quarantined += 1;
            violations.push(format!("genuine_quarantined: {GROUP} quarantined {t}/p{p}@{o}: {:?}", q.reason));
        }
        w.figures.consumer_applied += receipts.len() as u64;
        w.figures.consumer_redeliveries += st.watermarks.values().map(|r| r.duplicates as u64).sum::<u64>();
        w.figures.consumer_dead_lettered += st.dead_letters.len() as u64;
    }
}

/// A published event the group has not decided, where the current log holds it.
struct Undecided {
    id: String,
    key: Key,
    offset: i64,
    /// The log's incarnation (see `World::incarnation`).
    incarnation: usize,
}

/// The group's watermark rows, as retention's registry reads them.
pub(super) fn group_watermarks(store: &MemoryConsumerStore) -> Vec<MemoryWatermark> {
    store
        .lock()
        .watermarks
        .iter()
        .filter(|((consumer_id, ..), _)| consumer_id == GROUP)
        .map(|((_, cluster_id, topic, partition, topic_id), row)| MemoryWatermark {
            log: outbox_core::LogId { cluster_id: cluster_id.clone(), topic: topic.clone(), topic_id: topic_id.clone(), partition: *partition },
            consumer_id: GROUP.to_owned(),
            committed_offset: row.committed_offset,
            anchor_recorded: true,
            anchor_event_id: row.anchor_event_id.clone(),
            anchor_epoch: None,
            anchor_accepted_ms: None,
            log_id: row.log_id.clone(),
        })
        .collect()
}

/// Whether the group applied or dead-lettered `event_id`.
pub(super) fn decided(store: &MemoryConsumerStore, event_id: &str) -> bool {
    let st = store.lock();
    let k = (GROUP.to_owned(), event_id.to_owned());
    st.receipts.contains_key(&k) || st.dead_letters.contains_key(&k)
}

/// One partition's owners, one after another: each starts from the
/// committed offset; a crashed one is replaced after a pause, a rebalanced
/// one at once (it finishes its batch alongside its successor).
async fn supervise(ctx: Arc<Ctx>, key: Key) {
    loop {
        let (generation, stop, moved) = {
            let mut g = ctx.group.lock().unwrap_or_else(|e| e.into_inner());
            let gen = g.generation.get(&key).copied().unwrap_or(0) + 1;
            g.generation.insert(key.clone(), gen);
            let (stop, moved) = (Arc::new(AtomicBool::new(false)), Arc::new(tokio::sync::Notify::new()));
            if let Some((old, _)) = g.stop.insert(key.clone(), (stop.clone(), moved.clone())) {
                old.store(true, Ordering::Release);
            }
            (gen, stop, moved)
        };
        let mut owner = tokio::spawn(own(ctx.clone(), key.clone(), generation, stop.clone()));
        ctx.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(owner.abort_handle());
        // Until this owner ends (a crash: replaced after a pause) or is
        // rebalanced away (replaced at once; it finishes its batch alongside).
        tokio::select! {
            biased;
            _ = &mut owner => {
                let pause = ctx.faults.range(50, 1_000);
                tokio::time::sleep(Duration::from_millis(pause as u64)).await;
            }
            () = moved.notified() => {}
        }
        ctx.tasks.lock().unwrap_or_else(|e| e.into_inner()).retain(|t| !t.is_finished());
    }
}

/// One owner of a partition: a feeder reading the log from the committed
/// offset, and the shipped partition loop deciding what it hands over.
async fn own(ctx: Arc<Ctx>, key: Key, generation: u64, stop: Arc<AtomicBool>) {
    let incarnation = world(&ctx.world).incarnation(&key);
    let mut from = ctx.group.lock().unwrap_or_else(|e| e.into_inner()).committed.get(&(key.clone(), incarnation)).copied().unwrap_or(0);
    if ctx.faults.chance(ctx.faults.faults.reset) {
        // The group is reset to latest: this owner and every later one
        // start at the log's end; what lies between is never read.
        let end = world(&ctx.world).logs.get(&key).map_or(0, |l| l.len() as i64);
        if end > from {
            ctx.skipped.lock().unwrap_or_else(|e| e.into_inner()).push((key.clone(), incarnation, from, end));
            let mut g = ctx.group.lock().unwrap_or_else(|e| e.into_inner());
            let at = g.committed.entry((key.clone(), incarnation)).or_insert(0);
            *at = (*at).max(end);
            drop(g);
            world(&ctx.world).figures.offset_resets += 1;
            ctx.faults.note(|| format!("{GROUP} {}/p{} is reset to latest: it starts at @{end}, not @{from}", key.0, key.1));
            from = end;
        }
    }
    let (tx, mut rx) = mpsc::channel(16);
    let offsets = Offsets { ctx: ctx.clone(), generation, incarnation };
    let faults = ctx.faults.clone();
    let hook: AfterCommitHook = Arc::new(move |_batch| if faults.chance(faults.faults.crash_after_commit) { HookAction::Crash } else { HookAction::Continue });
    let limits = BatchLimits { max_messages: 8, max_bytes: 1 << 20 };
    let (topic, partition) = key.clone();
    let work = run_partition(&mut rx, &stop, &ctx.processor, Some(&hook), limits, &offsets, &topic, partition);
    let feeder = feed(ctx.clone(), key.clone(), incarnation, from, tx, stop.clone());
    tokio::pin!(work, feeder);
    // The feeder ends when the owner is stopped (its sender dropped: the
    // loop finishes what it holds); the loop's end ends the feeder.
    let result = tokio::select! {
        biased;
        r = &mut work => r,
        () = &mut feeder => work.await,
    };
    match result {
        Ok(()) => {}
        Err(ConsumerError::StoppedByHook { last_offset, .. }) => {
            world(&ctx.world).figures.consumer_crashes += 1;
            ctx.faults.note(|| format!("{GROUP} {topic}/p{partition} dies after the database commit up to @{last_offset}, before the offset commit"));
        }
        Err(e) => ctx.faults.note(|| format!("{GROUP} {topic}/p{partition} stops: {e}")),
    }
}

/// Hands the partition's messages to the loop in offset order from `next`
/// (from the log's start when retention removed what lies below), until the
/// owner is stopped, the loop ends, or the log is replaced (the topic
/// recreated, the cluster replaced: the partition is lost to this owner,
/// and the next one reads the new log from its start).
async fn feed(ctx: Arc<Ctx>, key: Key, incarnation_read: usize, mut next: i64, tx: mpsc::Sender<RawMessage>, stop: Arc<AtomicBool>) {
    let mut idle_ms = 100;
    loop {
        if stop.load(Ordering::Acquire) || tx.is_closed() {
            return;
        }
        let batch: Vec<RawMessage> = {
            let w = world(&ctx.world);
            if w.incarnation(&key) != incarnation_read {
                return;
            }
            let start = w.log_start.get(&key).copied().unwrap_or(0);
            next = next.max(start);
            w.logs
                .get(&key)
                .map(|log| {
                    log.iter()
                        .enumerate()
                        .skip(usize::try_from(next).unwrap_or(usize::MAX))
                        // A compacted offset holds no record: the fetch skips it.
                        .filter(|(_, m)| !m.compacted)
                        .take(8)
                        .map(|(offset, m)| RawMessage {
                            topic: key.0.clone(),
                            partition: key.1,
                            offset: offset as i64,
                            key: Some(m.key.clone()),
                            payload: Some(m.payload.clone()),
                            headers: m.headers.clone(),
                            non_utf8_header_names: Vec::new(),
                            // The log's identity as the fetch saw it (a
                            // topic id: another for each incarnation).
                            log_id: Some(super::world::log_id_of(incarnation_read)),
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        if batch.is_empty() {
            // An idle fetch waits longer each time (as a consumer's fetch
            // waits on the broker), up to five seconds.
            idle_ms = (idle_ms * 2).clamp(200, 5_000);
            let idle = ctx.faults.range(idle_ms / 2, idle_ms);
            tokio::time::sleep(Duration::from_millis(idle as u64)).await;
            continue;
        }
        idle_ms = 100;
        for m in batch {
            next = m.offset + 1;
            if tx.send(m).await.is_err() {
                return;
            }
        }
    }
}
