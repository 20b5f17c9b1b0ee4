//! An in-memory [`ConsumerStore`]: the rows of the PostgreSQL store
//! (receipts, dead letters, quarantine, watermarks) and the handlers'
//! writes, kept in one process, with transactions that commit all their
//! writes at once or none. For tests and for the simulator, which runs the
//! shipped [`Processor`](crate::Processor) over it; it keeps the store
//! contract of [`crate::store`], and a conformance test runs one scenario on
//! both stores.
//!
//! Two transactions that claim one event do not wait for each other as
//! PostgreSQL's do: the second fails with the retryable
//! [`ConsumerError::Unavailable`] while the first is open, and the
//! processor tries again after its backoff.
//!
//! ```
//! # async fn demo() -> Result<(), outbox_consumer::ConsumerError> {
//! use outbox_consumer::memory::{MemoryConsumerStore, MemoryTx};
//! use outbox_consumer::{async_trait, ConsumedEvent, HandlerError, Processor, TxHandler};
//! use serde_json::{json, Value};
//!
//! struct Count;
//! #[async_trait]
//! impl TxHandler<MemoryTx> for Count {
//!     async fn handle_in(&self, tx: &mut MemoryTx, event: &ConsumedEvent) -> Result<Value, HandlerError> {
//!         tx.write_effect("counted", json!(event.event_id.as_str()));
//!         Ok(json!({}))
//!     }
//! }
//!
//! let store = MemoryConsumerStore::new();
//! let processor = Processor::over(store.clone(), "billing", Count)?.with_cluster_id("kafka-a");
//! # let _ = processor;
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::error::ConsumerError;
use crate::event::ConsumedEvent;
use crate::outcome::{Position, Quarantined, Receipt};
use crate::gap::{OffsetGap, Reading, ReadingChange};
use crate::store::{Claim, ConsumerStore, DeadLetterRow, QuarantineRow, WatermarkAdvance};

/// `(consumer id, event id)`.
type ReceiptKey = (String, String);

/// `(consumer id, cluster id, topic, partition, topic id)`.
pub type WatermarkKey = (String, String, String, i32, Option<String>);

/// `(consumer id, cluster id, topic, partition)`.
pub type PartitionKey = (String, String, String, i32);

/// A gap as the store keeps it: its range, and why it closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapRow {
    /// The range as it stands.
    pub gap: OffsetGap,
    /// `None` while open; `replayed` once every offset of it was decided.
    pub close_reason: Option<String>,
}

/// What the store holds (committed state).
#[derive(Debug, Clone, Default)]
pub struct MemoryConsumerState {
    /// Receipts by (consumer id, event id).
    pub receipts: BTreeMap<ReceiptKey, Receipt>,
    /// Dead letters by (consumer id, event id): (attempts, last error, position).
    pub dead_letters: BTreeMap<ReceiptKey, (u32, String, Position)>,
    /// Quarantined positions by (consumer id, topic, partition, offset).
    pub quarantine: BTreeMap<(String, String, i32, i64), Quarantined>,
    /// Watermark rows; `topic_id` and the counts are in the value.
    pub watermarks: BTreeMap<WatermarkKey, WatermarkAdvance>,
    /// Per partition: the offset after the greatest one decided.
    pub readings: BTreeMap<PartitionKey, i64>,
    /// Per partition: the log its reading is kept in, when known.
    pub reading_logs: BTreeMap<PartitionKey, String>,
    /// Gaps by partition and `detected_from`.
    pub gaps: BTreeMap<(PartitionKey, i64), GapRow>,
    /// The handlers' writes ([`MemoryTx::write_effect`]), by key, in commit order.
    pub effects: BTreeMap<String, Vec<Value>>,
    /// Transactions committed.
    pub commits: u64,
    /// Receipts claimed by open transactions: which one holds each.
    claimed: HashMap<ReceiptKey, u64>,
    next_tx: u64,
}

/// The in-memory receipt store; clones share their rows.
#[derive(Clone)]
pub struct MemoryConsumerStore {
    state: Arc<Mutex<MemoryConsumerState>>,
    clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
}

impl std::fmt::Debug for MemoryConsumerStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryConsumerStore").finish_non_exhaustive()
    }
}

impl Default for MemoryConsumerStore {
    fn default() -> Self {
        MemoryConsumerStore::new()
    }
}

impl MemoryConsumerStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        MemoryConsumerStore { state: Arc::default(), clock: Arc::new(Utc::now) }
    }

    /// Stamps receipts with `clock` (the simulator's virtual time).
    pub fn with_clock(mut self, clock: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The committed state, locked.
    pub fn lock(&self) -> MutexGuard<'_, MemoryConsumerState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A transaction of [`MemoryConsumerStore`]: its writes, applied at commit;
/// dropped uncommitted, it releases its claims and writes nothing.
pub struct MemoryTx {
    id: u64,
    state: Arc<Mutex<MemoryConsumerState>>,
    claimed: Vec<ReceiptKey>,
    receipts: Vec<Receipt>,
    results: Vec<(ReceiptKey, Value)>,
    dead_letters: Vec<(ReceiptKey, (u32, String, Position))>,
    quarantine: Vec<((String, String, i32, i64), Quarantined)>,
    watermarks: Vec<(WatermarkKey, WatermarkAdvance)>,
    readings: Vec<(PartitionKey, ReadingChange)>,
    effects: Vec<(String, Value)>,
    open: bool,
}

impl std::fmt::Debug for MemoryTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTx").field("id", &self.id).field("claimed", &self.claimed.len()).finish_non_exhaustive()
    }
}

impl MemoryTx {
    /// A write of the handler: appended to [`MemoryConsumerState::effects`]
    /// under `key` when (and only when) the transaction commits.
    pub fn write_effect(&mut self, key: impl Into<String>, value: Value) {
        self.effects.push((key.into(), value));
    }

    fn lock(&self) -> MutexGuard<'_, MemoryConsumerState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn release(&mut self) {
        if !self.open {
            return;
        }
        self.open = false;
        let id = self.id;
        let claimed = std::mem::take(&mut self.claimed);
        let mut st = self.lock();
        for k in claimed {
            if st.claimed.get(&k) == Some(&id) {
                st.claimed.remove(&k);
            }
        }
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        self.release();
    }
}

impl MemoryTx {
    /// Refuses work on a transaction that committed or rolled back.
    fn ensure_open(&self) -> Result<(), ConsumerError> {
        if self.open {
            Ok(())
        } else {
            Err(ConsumerError::Unavailable("the transaction is closed".into()))
        }
    }
}

#[async_trait]
impl ConsumerStore for MemoryConsumerStore {
    type Tx = MemoryTx;

    async fn begin(&self) -> Result<MemoryTx, ConsumerError> {
        let id = {
            let mut st = self.lock();
            st.next_tx += 1;
            st.next_tx
        };
        Ok(MemoryTx {
            id,
            state: self.state.clone(),
            claimed: Vec::new(),
            receipts: Vec::new(),
            results: Vec::new(),
            dead_letters: Vec::new(),
            quarantine: Vec::new(),
            watermarks: Vec::new(),
            readings: Vec::new(),
            effects: Vec::new(),
            open: true,
        })
    }

    async fn commit(&self, mut tx: MemoryTx) -> Result<(), ConsumerError> {
        tx.ensure_open()?;
        {
            let mut st = self.lock();
            for r in tx.receipts.drain(..) {
                st.receipts.insert((r.consumer_id.clone(), r.event_id.as_str().to_owned()), r);
            }
            for (k, v) in tx.results.drain(..) {
                if let Some(r) = st.receipts.get_mut(&k) {
                    r.result = v;
                }
            }
            for (k, v) in tx.dead_letters.drain(..) {
                st.dead_letters.entry(k).or_insert(v);
            }
            for (k, v) in tx.quarantine.drain(..) {
                st.quarantine.entry(k).or_insert(v);
            }
            for (k, a) in tx.watermarks.drain(..) {
                let row = st.watermarks.entry(k).or_insert_with(|| WatermarkAdvance { topic_id: a.topic_id.clone(), ..WatermarkAdvance::default() });
                // A row of another log (both ids known, and different) is
                // replaced; otherwise it keeps the anchor of its committed offset.
                let replaced = matches!((&row.log_id, &a.log_id), (Some(was), Some(now)) if was != now);
                if replaced || a.committed_offset > row.committed_offset || (a.committed_offset == row.committed_offset && a.anchor_event_id.is_some()) {
                    row.anchor_event_id = a.anchor_event_id.clone();
                }
                // The row's log id is the one its offset was read in.
                if a.log_id.is_some() && (replaced || a.committed_offset >= row.committed_offset) {
                    row.log_id = a.log_id.clone();
                }
                row.committed_offset = if replaced { a.committed_offset } else { row.committed_offset.max(a.committed_offset) };
                row.applied += a.applied;
                row.duplicates += a.duplicates;
                row.quarantined += a.quarantined;
                row.dead_lettered += a.dead_lettered;
                if a.last_event_id.is_some() {
                    row.last_event_id = a.last_event_id;
                }
            }
            for (k, c) in tx.readings.drain(..) {
                apply_reading(&mut st, &k, &c);
            }
            for (k, v) in tx.effects.drain(..) {
                st.effects.entry(k).or_default().push(v);
            }
            st.commits += 1;
        }
        tx.release();
        Ok(())
    }

    async fn rollback(&self, tx: MemoryTx) {
        drop(tx);
    }

    async fn claim(&self, tx: &mut MemoryTx, consumer_id: &str, cluster_id: &str, events: &[&ConsumedEvent]) -> Result<HashMap<String, Claim>, ConsumerError> {
        tx.ensure_open()?;
        let now = (self.clock)();
        let mut out = HashMap::with_capacity(events.len());
        let mut st = tx.lock();
        // Decide first, then take: a conflict leaves nothing claimed.
        for e in events {
            let k = (consumer_id.to_owned(), e.event_id.as_str().to_owned());
            if let Some(&holder) = st.claimed.get(&k) {
                if holder != tx.id {
                    return Err(ConsumerError::Unavailable(format!("the receipt of {} is held by another open transaction", e.event_id)));
                }
            }
        }
        let mut taken = Vec::new();
        let mut receipts = Vec::new();
        for e in events {
            let k = (consumer_id.to_owned(), e.event_id.as_str().to_owned());
            if st.dead_letters.contains_key(&k) {
                out.insert(k.1, Claim::Dead);
                continue;
            }
            if st.receipts.contains_key(&k) || st.claimed.contains_key(&k) {
                continue;
            }
            st.claimed.insert(k.clone(), tx.id);
            receipts.push(Receipt {
                consumer_id: consumer_id.to_owned(),
                event_id: e.event_id.clone(),
                envelope_generation: e.envelope_generation,
                event_type: e.event_type.clone(),
                position: Position { topic: e.topic.clone(), partition: e.partition, offset: e.offset },
                topic_id: e.topic_id.clone(),
                payload_digest: e.payload_digest.clone(),
                result: Value::Null,
                received_at: now,
            });
            out.insert(k.1.clone(), Claim::New(now));
            taken.push(k);
        }
        drop(st);
        let _ = cluster_id;
        tx.claimed.extend(taken);
        tx.receipts.extend(receipts);
        Ok(out)
    }

    async fn receipts(&self, tx: &mut MemoryTx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, Receipt>, ConsumerError> {
        tx.ensure_open()?;
        let mut out = HashMap::new();
        for r in &tx.receipts {
            if r.consumer_id == consumer_id && ids.contains(&r.event_id.as_str()) {
                out.insert(r.event_id.as_str().to_owned(), r.clone());
            }
        }
        let st = tx.lock();
        for id in ids {
            if let Some(r) = st.receipts.get(&(consumer_id.to_owned(), (*id).to_owned())) {
                out.entry((*id).to_owned()).or_insert_with(|| r.clone());
            }
        }
        Ok(out)
    }

    async fn dead_letters(&self, tx: &mut MemoryTx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, (u32, String)>, ConsumerError> {
        tx.ensure_open()?;
        let st = tx.lock();
        Ok(ids
            .iter()
            .filter_map(|id| st.dead_letters.get(&(consumer_id.to_owned(), (*id).to_owned())).map(|(a, e, _)| ((*id).to_owned(), (*a, e.clone()))))
            .collect())
    }

    async fn store_results(&self, tx: &mut MemoryTx, consumer_id: &str, results: &[(String, Value)]) -> Result<(), ConsumerError> {
        tx.ensure_open()?;
        for (id, v) in results {
            match tx.receipts.iter_mut().find(|r| r.consumer_id == consumer_id && r.event_id.as_str() == id) {
                Some(r) => r.result = v.clone(),
                None => tx.results.push(((consumer_id.to_owned(), id.clone()), v.clone())),
            }
        }
        Ok(())
    }

    async fn quarantine(&self, tx: &mut MemoryTx, consumer_id: &str, rows: &[QuarantineRow<'_>], _max_payload_bytes: usize) -> Result<HashSet<i64>, ConsumerError> {
        tx.ensure_open()?;
        let mut inserted = HashSet::new();
        let st = tx.lock();
        let mut new = Vec::new();
        for r in rows {
            let k = (consumer_id.to_owned(), r.msg.topic.clone(), r.msg.partition, r.msg.offset);
            if st.quarantine.contains_key(&k) || new.iter().any(|(n, _)| n == &k) {
                continue;
            }
            inserted.insert(r.msg.offset);
            new.push((k, r.quarantined.clone()));
        }
        drop(st);
        tx.quarantine.extend(new);
        Ok(inserted)
    }

    async fn insert_dead_letter(&self, tx: &mut MemoryTx, consumer_id: &str, row: &DeadLetterRow<'_>) -> Result<bool, ConsumerError> {
        tx.ensure_open()?;
        let k = (consumer_id.to_owned(), row.event.event_id.as_str().to_owned());
        if tx.lock().dead_letters.contains_key(&k) || tx.dead_letters.iter().any(|(d, _)| d == &k) {
            return Ok(false);
        }
        let at = Position { topic: row.msg.topic.clone(), partition: row.msg.partition, offset: row.msg.offset };
        tx.dead_letters.push((k, (row.attempts, row.error.to_owned(), at)));
        Ok(true)
    }

    async fn reading(&self, tx: &mut MemoryTx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32) -> Result<Reading, ConsumerError> {
        tx.ensure_open()?;
        let k: PartitionKey = (consumer_id.to_owned(), cluster_id.to_owned(), topic.to_owned(), partition);
        // The committed reading with this transaction's own changes on top.
        let mut r = reading_of(&tx.lock(), &k);
        for (_, c) in tx.readings.iter().filter(|(pk, _)| *pk == k) {
            if c.new_log {
                r.next_offset = None;
                r.open.clear();
            }
            if c.log_id.is_some() {
                r.log_id = c.log_id.clone();
            }
            r.next_offset = Some(r.next_offset.unwrap_or(0).max(c.next_offset));
            for g in c.opened.iter().chain(c.shrunk.iter()) {
                r.open.retain(|o| o.detected_from != g.detected_from);
                if !g.is_closed() {
                    r.open.push(g.clone());
                }
            }
        }
        Ok(r)
    }

    async fn save_reading(&self, tx: &mut MemoryTx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32, change: &ReadingChange) -> Result<(), ConsumerError> {
        tx.ensure_open()?;
        tx.readings.push(((consumer_id.to_owned(), cluster_id.to_owned(), topic.to_owned(), partition), change.clone()));
        Ok(())
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
        tx.ensure_open()?;
        for r in rows {
            let k = (consumer_id.to_owned(), cluster_id.to_owned(), topic.to_owned(), partition, r.topic_id.clone());
            tx.watermarks.push((k, r.clone()));
        }
        Ok(())
    }
}

/// The reading of a partition in `st` (the watermark rows' greatest offset
/// when it has none yet, as the PostgreSQL store answers).
fn reading_of(st: &MemoryConsumerState, k: &PartitionKey) -> Reading {
    let next = st.readings.get(k).copied().or_else(|| {
        st.watermarks.iter().filter(|((c, cl, t, p, _), _)| (c, cl, t, p) == (&k.0, &k.1, &k.2, &k.3)).map(|(_, w)| w.committed_offset).max()
    });
    let open = st.gaps.range((k.clone(), i64::MIN)..=(k.clone(), i64::MAX)).filter(|(_, g)| g.close_reason.is_none()).map(|(_, g)| g.gap.clone()).collect();
    Reading { next_offset: next, open, log_id: st.reading_logs.get(k).cloned() }
}

/// Applies a committed reading change.
fn apply_reading(st: &mut MemoryConsumerState, k: &PartitionKey, c: &ReadingChange) {
    if c.new_log {
        // The old log's reading and gaps say nothing of the new log.
        st.readings.insert(k.clone(), c.next_offset);
        st.gaps.retain(|(pk, _), _| pk != k);
    }
    if let Some(log) = &c.log_id {
        st.reading_logs.insert(k.clone(), log.clone());
    }
    let next = st.readings.entry(k.clone()).or_insert(c.next_offset);
    *next = (*next).max(c.next_offset);
    for g in c.opened.iter().chain(c.shrunk.iter()) {
        let row = st.gaps.entry((k.clone(), g.detected_from)).or_insert_with(|| GapRow { gap: g.clone(), close_reason: None });
        if row.close_reason.is_some() {
            continue;
        }
        row.gap = g.clone();
        if g.is_closed() {
            row.close_reason = Some("replayed".into());
        }
    }
}
