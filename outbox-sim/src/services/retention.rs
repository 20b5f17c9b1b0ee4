//! Retention: the job that runs the shipped retention pass on the
//! watermarks the mandatory consumer group's shipped `Processor` wrote, each
//! purge checked against that group's receipts.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_consumer::memory::MemoryConsumerStore;
use outbox_core::{EventId, EventState};
use outbox_memory::{MemoryStore, MemoryWatermark};

use super::consumers::{decided, group_watermarks, GROUP};
use super::processes::Process;
use super::watermark_topic::{copied_watermarks, SharedTopic};
use super::world::{world, Shared};
use super::{NEW_TOPIC, PARTITIONS, TOPIC};

/// Another cluster carrying a topic of the same name, which the mandatory
/// consumer group reads too: its watermarks there say nothing about this
/// one's log.
const OTHER_CLUSTER: &str = "sim-cluster-b";
/// Retention's policy: a short replay window, small pages.
const RETENTION_POLICY: outbox_producer::retention::RetentionPolicy = outbox_producer::retention::RetentionPolicy { replay_window_ms: 2_000, batch_size: 3, max_batches: 50 };

/// The mandatory consumer group and retention: the group (the shipped
/// `Processor` over `consumers`, see `consumers.rs`) reads `CLUSTER`'s logs
/// and keeps its watermarks in its receipt store; it also reads a topic of
/// the same name on `OTHER_CLUSTER` (another log, far ahead). A retention
/// job runs the shipped retention pass (`outbox_producer::retention::purge_with`,
/// which `outbox purge` runs over PostgreSQL; its decision is `may_purge`)
/// on the watermarks the group's store holds at that moment (or, in the
/// traces that run the watermark topic, the copy its reader keeps), every
/// 0.6–6 s, in small pages, and every event it purges must have been
/// applied or dead-lettered by the group.
pub(super) fn start_retention(shared: &Shared, inner: &MemoryStore, consumers: MemoryConsumerStore, copy: Option<SharedTopic>) -> Process {
    let (shared, inner) = (shared.clone(), inner.clone());
    tokio::spawn(async move {
        let mandatory = vec![(GROUP.to_owned(), vec![TOPIC.to_owned(), NEW_TOPIC.to_owned()])];
        loop {
            let tick = world(&shared).rng.range(600, 6_000);
            tokio::time::sleep(Duration::from_millis(tick as u64)).await;
            // The group's rows as its store holds them, or (the traces that
            // run the watermark topic) the outbox side's copy of them.
            let mut watermarks = match &copy {
                Some(topic) => copied_watermarks(topic),
                None => group_watermarks(&consumers),
            };
            {
                let mut w = world(&shared);
                for partition in 0..PARTITIONS as i32 {
                    let step = w.rng.range(0, 6);
                    *w.consumer_at.entry((OTHER_CLUSTER.to_owned(), TOPIC.to_owned(), partition)).or_insert(0) += step;
                }
                watermarks.extend(w.consumer_at.iter().map(|((cluster_id, topic, partition), at)| MemoryWatermark {
                    log: outbox_core::LogId { cluster_id: cluster_id.clone(), topic: topic.clone(), topic_id: None, partition: *partition },
                    consumer_id: GROUP.to_owned(),
                    committed_offset: *at,
                    anchor_recorded: false,
                    anchor_event_id: None,
                    anchor_epoch: None,
                    anchor_accepted_ms: None,
                    log_id: None,
                }));
                // Rows come in no particular order.
                if w.rng.chance(0.5) {
                    watermarks.reverse();
                }
            }
            let now = world(&shared).now_ms();
            inner.set_now_ms(now);
            inner.set_retention_registry(mandatory.clone(), watermarks.clone());
            let purged_before: BTreeSet<EventId> = inner.lock().events.values().filter(|e| e.state == EventState::Purged).map(|e| e.envelope.event_id.clone()).collect();
            let out = outbox_producer::retention::purge_with(&inner, now, &RETENTION_POLICY, false, |_| {}).await;
            let mut w = world(&shared);
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    w.violations.push(format!("service_error: the retention pass failed: {e}"));
                    w.figures.service_error += 1;
                    return;
                }
            };
            w.figures.held_by_consumers += out.held_by_consumers;
            let st = inner.lock();
            let purged: Vec<EventId> = st.events.values().filter(|e| e.state == EventState::Purged && !purged_before.contains(&e.envelope.event_id)).map(|e| e.envelope.event_id.clone()).collect();
            for id in &purged {
                let Some(slot) = st.events.get(id).and_then(|e| e.slot.as_ref()) else { continue };
                w.figures.purged += 1;
                let at = |w: &MemoryWatermark| w.log.as_ref().same_name(&slot.log());
                let marks: Vec<i64> = watermarks.iter().filter(|w| at(w)).map(|w| w.committed_offset).collect();
                w.note(|| format!("retention purges {id} at {}/{}/p{}@{} ({GROUP}'s watermarks there {marks:?})", slot.cluster_id, slot.topic, slot.partition, slot.offset));
                // Receipts are never taken back: one read after the purge
                // sees every decision the watermarks could have counted.
                if decided(&consumers, id.as_str()) {
                    continue;
                }
                // Whatever its route: a destination.v1 event of a replaced
                // log too (the receipt's log id and the consumer's tell
                // the two logs apart, `WatermarkRef::anchor_agrees_with`).
                w.figures.premature_purge += 1;
                let v = format!(
                    "premature_purge: {id} at {}/{}/p{}@{} purged, never applied nor dead-lettered by {GROUP} (its watermarks there {marks:?})",
                    slot.cluster_id, slot.topic, slot.partition, slot.offset
                );
                w.violations.push(v);
            }
        }
    })
}
