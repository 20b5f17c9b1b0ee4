//! Retention: the mandatory consumer's watermarks on two clusters and the
//! job that runs the shipped retention pass on them, each purge checked
//! against the consumer's position on the purged event's own log.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_core::{EventId, EventState};
use outbox_memory::{MemoryStore, MemoryWatermark};

use super::processes::Process;
use super::world::{world, Shared};
use super::{CLUSTER, NEW_TOPIC, PARTITIONS, TOPIC};

/// Another cluster carrying a topic of the same name, which the mandatory
/// consumer reads too: its watermarks there say nothing about this one's log.
const OTHER_CLUSTER: &str = "sim-cluster-b";
/// The mandatory consumer retention waits for.
const CONSUMER: &str = "billing";
/// Retention's policy: a short replay window, small pages.
const RETENTION_POLICY: outbox_producer::retention::RetentionPolicy = outbox_producer::retention::RetentionPolicy { replay_window_ms: 2_000, batch_size: 3, max_batches: 50 };

/// The mandatory consumer and retention: the consumer reads `CLUSTER`'s
/// logs (sometimes not at all for a while: down, lagging) and a topic of
/// the same name on `OTHER_CLUSTER` (another log, far ahead); a retention
/// job runs the shipped retention pass (`outbox_producer::retention::purge_with`,
/// which `outbox purge` runs over PostgreSQL; its decision is `may_purge`)
/// on its watermarks every 0.6–6 s, in small pages, and every event
/// it purges is checked against the consumer's position on that event's
/// very log.
pub(super) fn start_retention(shared: &Shared, inner: &MemoryStore) -> Process {
    let (shared, inner) = (shared.clone(), inner.clone());
    tokio::spawn(async move {
        let mandatory = vec![(CONSUMER.to_owned(), vec![TOPIC.to_owned(), NEW_TOPIC.to_owned()])];
        loop {
            let tick = world(&shared).rng.range(600, 6_000);
            tokio::time::sleep(Duration::from_millis(tick as u64)).await;
            let watermarks = {
                let mut w = world(&shared);
                let reading = !w.rng.chance(0.4);
                let logs: Vec<((String, i32), i64)> = w.logs.iter().map(|(k, l)| (k.clone(), l.len() as i64)).collect();
                for ((topic, partition), end) in logs {
                    let step = if reading { w.rng.range(0, 2) } else { 0 };
                    let at = w.consumer_at.entry((CLUSTER.to_owned(), topic, partition)).or_insert(0);
                    *at = (*at + step).min(end);
                }
                for partition in 0..PARTITIONS as i32 {
                    let step = w.rng.range(0, 6);
                    *w.consumer_at.entry((OTHER_CLUSTER.to_owned(), TOPIC.to_owned(), partition)).or_insert(0) += step;
                }
                let mut wms: Vec<MemoryWatermark> = w
                    .consumer_at
                    .iter()
                    .map(|((cluster_id, topic, partition), at)| MemoryWatermark {
                        consumer_id: CONSUMER.to_owned(),
                        cluster_id: cluster_id.clone(),
                        topic: topic.clone(),
                        topic_id: None,
                        partition: *partition,
                        committed_offset: *at,
                    })
                    .collect();
                // Rows come in no particular order.
                if w.rng.chance(0.5) {
                    wms.reverse();
                }
                wms
            };
            let now = world(&shared).now_ms();
            inner.set_now_ms(now);
            inner.set_retention_registry(mandatory.clone(), watermarks);
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
                let passed = w.consumer_at.get(&(slot.cluster_id.clone(), slot.topic.clone(), slot.partition)).copied();
                w.note(|| format!("retention purges {id} at {}/{}/p{}@{} ({CONSUMER} there at {passed:?})", slot.cluster_id, slot.topic, slot.partition, slot.offset));
                if passed.is_none_or(|at| at <= slot.offset) {
                    w.figures.premature_purge += 1;
                    let v = format!(
                        "premature_purge: {id} at {}/{}/p{}@{} purged while {CONSUMER}'s watermark on that log is {passed:?}",
                        slot.cluster_id, slot.topic, slot.partition, slot.offset
                    );
                    w.violations.push(v);
                }
            }
        }
    })
}
