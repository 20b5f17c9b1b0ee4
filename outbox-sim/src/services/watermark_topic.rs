//! The watermark topic, in the traces that run it: the mandatory consumer
//! group publishes its watermark rows as signed records (the shipped
//! encoding, `outbox_consumer::watermark_record_of` and
//! `outbox_core::watermark_record`), a forger writes records of its own to
//! the same topic (unsigned, or signed with a key that is not the group's,
//! moving the group's watermark to the end of a partition it has not
//! read) and replays old genuine ones, and a reader runs the shipped
//! reader's decisions over what it read: each record screened
//! (`outbox_producer::watermark_topic::decide::screen`), then the round
//! (`watermark_topic::round::decide_round`: writer pin, partition end,
//! `judge`) writing through a sink of its own into the outbox side's copy
//! of the watermarks, the copy retention reads in those traces. A record
//! the reader wrongly applies shows as a `premature_purge`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_consumer::memory::MemoryConsumerStore;
use outbox_core::trust::SigningKey;
use outbox_core::watermark_record::WatermarkRecord;
use outbox_memory::MemoryWatermark;
use outbox_producer::watermark_topic::decide::{is_new_log, judge, screen, Judgement, RecordBytes, Screen, Stored};
use outbox_producer::watermark_topic::round::{decide_round, RoundFinding, RoundInput, RoundSink, Screened};
use outbox_producer::watermark_topic::IngestReport;
use outbox_producer::ProducerError;

use super::consumers::GROUP;
use super::processes::Process;
use super::world::{world, Shared};
use super::CLUSTER;
use crate::rng::Rng;

/// The group's watermark signing key (the reader holds it).
const KEY_ID: &str = "wm-sim";
/// The database that decides the group's watermarks (`outbox-watermark-decider`).
const DECIDER: &str = "7301/fulfilment";
/// A row of the copy: consumer, cluster, topic, topic id, partition.
type RowKey = (String, String, String, Option<String>, i32);

/// One record on the topic: key, value, and the headers the reader reads.
#[derive(Debug, Clone)]
struct TopicRecord {
    key: Vec<u8>,
    value: Vec<u8>,
    key_id: Option<Vec<u8>>,
    signature: Option<Vec<u8>>,
    decider: Option<Vec<u8>>,
}

/// The topic, the reader's position in it, and the outbox side's copy.
#[derive(Debug, Default)]
pub(super) struct WatermarkTopic {
    records: Vec<TopicRecord>,
    /// The reader's position (`outbox_watermark_topic_cursors`).
    read: usize,
    copy: BTreeMap<RowKey, CopyRow>,
    /// The writer pinned per consumer (`outbox_watermark_publishers`).
    pinned: BTreeMap<String, String>,
    /// Each row's version as published: what the row held, and since when
    /// (the consumer database's time of its last change).
    versions: BTreeMap<RowKey, (WatermarkRecord, i64)>,
}

/// A row of the outbox side's copy: what [`judge`] reads, and the anchor.
#[derive(Debug, Clone)]
struct CopyRow {
    stored: Stored,
    anchor_recorded: bool,
    anchor_event_id: Option<String>,
}

/// The topic shared by the publisher, the reader and retention.
pub(super) type SharedTopic = Arc<Mutex<WatermarkTopic>>;

fn lock(t: &SharedTopic) -> std::sync::MutexGuard<'_, WatermarkTopic> {
    t.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn group_key() -> SigningKey {
    SigningKey::from_hex(KEY_ID, &"5c".repeat(32)).expect("a valid key")
}

/// The copy's rows, as retention's registry reads them (with the anchor a
/// `.v4` record carries).
pub(super) fn copied_watermarks(topic: &SharedTopic) -> Vec<MemoryWatermark> {
    lock(topic)
        .copy
        .iter()
        .map(|((consumer_id, cluster_id, topic, topic_id, partition), row)| MemoryWatermark {
            log: outbox_core::LogId { cluster_id: cluster_id.clone(), topic: topic.clone(), topic_id: topic_id.clone(), partition: *partition },
            consumer_id: consumer_id.clone(),
            committed_offset: row.stored.committed_offset,
            anchor_recorded: row.anchor_recorded,
            anchor_event_id: row.anchor_event_id.clone(),
            anchor_epoch: None,
            anchor_accepted_ms: None,
            log_id: row.stored.log_id.clone(),
        })
        .collect()
}

/// The group's watermark rows as its database would list them
/// (`outbox_consumer::watermarks`): an open gap at a row's offset is
/// named, and each row's time is when it last changed.
fn group_rows(store: &MemoryConsumerStore, topic: &mut WatermarkTopic, now_ms: i64) -> Vec<WatermarkRecord> {
    let st = store.lock();
    let mut out = Vec::new();
    for ((consumer_id, cluster_id, t, partition, topic_id), row) in &st.watermarks {
        if consumer_id != GROUP {
            continue;
        }
        let pk = (consumer_id.clone(), cluster_id.clone(), t.clone(), *partition);
        let open_gap_end = st
            .gaps
            .range((pk.clone(), i64::MIN)..=(pk, i64::MAX))
            .filter(|(_, g)| g.close_reason.is_none() && g.gap.from_offset <= row.committed_offset && g.gap.to_offset > row.committed_offset)
            .map(|(_, g)| g.gap.to_offset)
            .min();
        let w = outbox_consumer::Watermark {
            consumer_id: consumer_id.clone(),
            cluster_id: cluster_id.clone(),
            topic: t.clone(),
            topic_id: topic_id.clone(),
            partition: *partition,
            committed_offset: row.committed_offset,
            applied_count: row.applied,
            duplicate_count: row.duplicates,
            quarantined_count: row.quarantined,
            dead_lettered_count: row.dead_lettered,
            last_event_id: row.last_event_id.clone(),
            updated_at: chrono::DateTime::from_timestamp_millis(now_ms).unwrap_or_default(),
            open_gap_end,
            log_id: row.log_id.clone(),
            anchor_recorded: true,
            anchor_event_id: row.anchor_event_id.clone(),
        };
        let mut record = outbox_consumer::watermark_record_of(w, GROUP, now_ms);
        let key = (consumer_id.clone(), cluster_id.clone(), t.clone(), topic_id.clone(), *partition);
        let since = match topic.versions.get(&key) {
            Some((was, since)) if WatermarkRecord { updated_at_ms: was.updated_at_ms, published_at_ms: was.published_at_ms, ..record.clone() } == *was => *since,
            _ => now_ms,
        };
        record.updated_at_ms = since;
        topic.versions.insert(key, (record.clone(), since));
        out.push(record);
    }
    out
}

/// Starts the group's publisher (every 0.3–3 s), the forger (while faults
/// are on), and the reader (every 0.6–4 s), all on `topic`.
pub(super) fn start(shared: &Shared, seed: u64, consumers: MemoryConsumerStore, topic: SharedTopic) -> Vec<Process> {
    let publisher = {
        let (shared, topic) = (shared.clone(), topic.clone());
        let mut rng = Rng::new(seed ^ 0x000b_115e);
        tokio::spawn(async move {
            let key = group_key();
            let wrong = SigningKey::from_hex(KEY_ID, &"e7".repeat(32)).expect("a valid key");
            loop {
                tokio::time::sleep(Duration::from_millis(rng.range(300, 3_000) as u64)).await;
                // Each partition's end, and the event of its last message
                // (what a forger reading the log names as the anchor).
                let (now, ends, on) = {
                    let w = world(&shared);
                    let ends: BTreeMap<(String, i32), (i64, Option<String>)> = w.logs.iter().map(|(k, l)| (k.clone(), (l.len() as i64, l.last().map(|m| m.event_id.clone())))).collect();
                    (w.now_ms(), ends, w.on)
                };
                let mut t = lock(&topic);
                for r in group_rows(&consumers, &mut t, now) {
                    let value = r.value_bytes();
                    let signature = key.sign(&value);
                    t.records.push(TopicRecord { key: r.key_bytes(), value, key_id: Some(KEY_ID.into()), signature: Some(signature.into_bytes()), decider: Some(DECIDER.into()) });
                    if !on {
                        continue;
                    }
                    // The forger: the group's watermark moved to the end of
                    // the partition, unsigned or under a key not the group's.
                    if rng.chance(0.5) {
                        let (end, last) = ends.get(&(r.topic.clone(), r.partition)).cloned().unwrap_or((0, None));
                        let forged = if end > r.committed_offset {
                            WatermarkRecord { committed_offset: end, open_gap_end: None, anchor_event_id: last, updated_at_ms: now, ..r.clone() }
                        } else {
                            WatermarkRecord { open_gap_end: None, updated_at_ms: now, ..r.clone() }
                        };
                        let value = forged.value_bytes();
                        let signed = rng.chance(0.5).then(|| wrong.sign(&value).into_bytes());
                        let key_id = signed.as_ref().map(|_| KEY_ID.as_bytes().to_vec());
                        t.records.push(TopicRecord { key: forged.key_bytes(), value, key_id, signature: signed, decider: Some(DECIDER.into()) });
                        world(&shared).figures.forged_watermark_records += 1;
                    }
                    // A genuine record of a while ago, replayed.
                    if rng.chance(0.1) && t.records.len() > 10 {
                        let at = rng.below(t.records.len() as u64) as usize;
                        let old = t.records[at].clone();
                        t.records.push(old);
                    }
                }
            }
        })
    };
    let reader = {
        let (shared, topic) = (shared.clone(), topic.clone());
        let mut rng = Rng::new(seed ^ 0x000e_ade7);
        tokio::spawn(async move {
            let keys: BTreeMap<String, Vec<SigningKey>> = [(GROUP.to_owned(), vec![group_key()])].into();
            let (unsigned, declared) = (BTreeSet::new(), vec![GROUP.to_owned()]);
            let ctx = Screen { cluster_id: CLUSTER, verify_keys: &keys, allow_unsigned: &unsigned, declared: &declared };
            loop {
                tokio::time::sleep(Duration::from_millis(rng.range(600, 4_000) as u64)).await;
                let data_ends: HashMap<(String, i32), Result<i64, String>> = world(&shared).logs.iter().map(|(k, l)| (k.clone(), Ok(l.len() as i64))).collect();
                let (screened, next) = {
                    let t = lock(&topic);
                    let from = t.read;
                    let screened: Vec<Screened> = t.records[from..]
                        .iter()
                        .enumerate()
                        .map(|(i, rec)| {
                            let bytes = RecordBytes { key: Some(&rec.key), value: Some(&rec.value), key_id: rec.key_id.as_deref(), signature: rec.signature.as_deref() };
                            Screened { partition: 0, offset: (from + i) as i64, record: screen(&ctx, bytes), decider: rec.decider.clone() }
                        })
                        .collect();
                    (screened, HashMap::from([(0, t.records.len() as i64)]))
                };
                let now = world(&shared).now_ms();
                let input = RoundInput { cluster_id: CLUSTER, topic: outbox_core::watermark_record::DEFAULT_TOPIC, declared: &declared, data_ends: &data_ends, next: &next, now };
                let mut report = IngestReport::default();
                let mut sink = MemorySink(topic.clone());
                if let Err(e) = decide_round(&mut sink, input, screened, &mut report).await {
                    let mut w = world(&shared);
                    w.violations.push(format!("service_error: the watermark topic's round failed: {e}"));
                    w.figures.service_error += 1;
                    return;
                }
                let mut w = world(&shared);
                w.figures.watermark_records_applied += report.applied as u64;
                w.figures.watermark_records_refused += report.rejected as u64;
            }
        })
    };
    vec![publisher, reader]
}

/// The copy's row after applying `r` (`COPY_UPSERT_SQL`): within a log,
/// offsets and counts only grow, and the log id and the anchor follow the
/// offset; a record of another log replaces the row's offset, log id and
/// anchor.
fn copy_upsert(row: Option<&CopyRow>, r: &WatermarkRecord) -> CopyRow {
    let counts = [r.applied_count, r.duplicate_count, r.quarantined_count, r.dead_lettered_count];
    let Some(c) = row else {
        let stored = Stored { committed_offset: r.committed_offset, counts, updated_at_ms: r.updated_at_ms, log_id: r.log_id.clone() };
        return CopyRow { stored, anchor_recorded: r.anchor_recorded, anchor_event_id: r.anchor_event_id.clone() };
    };
    let s = &c.stored;
    let new_log = is_new_log(s, r);
    let mut max = s.counts;
    for (m, n) in max.iter_mut().zip(counts) {
        *m = (*m).max(n);
    }
    let forward = new_log || r.committed_offset > s.committed_offset;
    let same = !new_log && r.committed_offset == s.committed_offset;
    let (anchor_recorded, anchor_event_id) = if forward {
        (r.anchor_recorded, r.anchor_event_id.clone())
    } else if same {
        (c.anchor_recorded || r.anchor_recorded, if r.anchor_recorded { r.anchor_event_id.clone() } else { c.anchor_event_id.clone() })
    } else {
        (c.anchor_recorded, c.anchor_event_id.clone())
    };
    let stored = Stored {
        committed_offset: if new_log { r.committed_offset } else { s.committed_offset.max(r.committed_offset) },
        counts: max,
        updated_at_ms: s.updated_at_ms.max(r.updated_at_ms),
        log_id: if new_log || r.committed_offset >= s.committed_offset { r.log_id.clone().or_else(|| s.log_id.clone()) } else { s.log_id.clone() },
    };
    CopyRow { stored, anchor_recorded, anchor_event_id }
}

/// What a round writes, in the simulator: the copy, the pinned writers and
/// the read position (findings are not kept: retention reads the copy).
struct MemorySink(SharedTopic);

#[async_trait::async_trait]
impl RoundSink for MemorySink {
    async fn pinned(&mut self) -> Result<HashMap<String, String>, ProducerError> {
        Ok(lock(&self.0).pinned.iter().map(|(c, d)| (c.clone(), d.clone())).collect())
    }

    async fn pin(&mut self, r: &WatermarkRecord, decider: &str, _now: i64) -> Result<(), ProducerError> {
        lock(&self.0).pinned.insert(r.consumer_id.clone(), decider.to_owned());
        Ok(())
    }

    async fn ignored(&mut self, _r: &WatermarkRecord, _now: i64) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn apply(&mut self, r: &WatermarkRecord) -> Result<Judgement, ProducerError> {
        let mut t = lock(&self.0);
        let key = (r.consumer_id.clone(), r.cluster_id.clone(), r.topic.clone(), r.topic_id.clone(), r.partition);
        let row = t.copy.get(&key).cloned();
        let judgement = judge(row.as_ref().map(|c| &c.stored), r);
        if judgement == Judgement::Apply {
            t.copy.insert(key, copy_upsert(row.as_ref(), r));
        }
        Ok(judgement)
    }

    async fn arrived(&mut self, _r: &WatermarkRecord, _now: i64) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn advance(&mut self, _partition: i32, next: i64) -> Result<(), ProducerError> {
        let mut t = lock(&self.0);
        t.read = t.read.max(next as usize);
        Ok(())
    }

    async fn resolve_gaps(&mut self, _consumer: &str, _logs: &[String], _now: i64) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn record_findings(&mut self, _findings: &[RoundFinding], _now: i64) -> Result<(), ProducerError> {
        Ok(())
    }
}
