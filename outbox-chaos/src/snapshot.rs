//! Reads a [`Snapshot`] from the two databases and the broker's log.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

use crate::check::{BusinessRow, ConsumerSide, EventRow, Finding, LogRecord, Receipt, Snapshot};
use crate::roles::EFFECTS_TABLE;

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Reads the whole of `topic` (`partitions` partitions) from its start to
/// the high watermarks read first, within `timeout`.
pub fn read_log(bootstrap: &str, topic: &str, partitions: i32, timeout: Duration) -> Result<Vec<LogRecord>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("outbox-chaos-checker-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .context("log reader")?;
    let deadline = Instant::now() + timeout;
    let mut ends = Vec::new();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        let (low, high) = c.fetch_watermarks(topic, p, Duration::from_secs(10)).with_context(|| format!("watermarks of {topic}/{p}"))?;
        ends.push(high);
        if high > low {
            tpl.add_partition_offset(topic, p, Offset::Offset(low))?;
        }
    }
    let mut out = Vec::new();
    if tpl.count() == 0 {
        return Ok(out);
    }
    c.assign(&tpl)?;
    let mut next: Vec<i64> = vec![0; partitions as usize];
    let done = |next: &[i64]| next.iter().zip(&ends).all(|(n, e)| n >= e);
    while !done(&next) {
        if Instant::now() > deadline {
            bail!("reading {topic}: positions {next:?} of ends {ends:?} after {timeout:?}");
        }
        match c.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(e)) => bail!("reading {topic}: {e}"),
            Some(Ok(m)) => {
                let p = m.partition() as usize;
                next[p] = next[p].max(m.offset() + 1);
                if m.offset() >= ends[p] {
                    continue;
                }
                let event_id = m.headers().and_then(|h| h.iter().find(|x| x.key == "outbox-event-id").and_then(|x| x.value).map(|v| String::from_utf8_lossy(v).into_owned()));
                out.push(LogRecord { topic: topic.to_owned(), partition: m.partition(), offset: m.offset(), event_id, value_digest: digest(m.payload().unwrap_or_default()) });
            }
        }
    }
    Ok(out)
}

/// Reads the databases' side of the snapshot.
pub async fn read_databases(producer: &PgPool, consumer: &PgPool, consumer_ids: &[String]) -> Result<Snapshot> {
    let mut s = Snapshot::default();
    for r in sqlx::query("SELECT order_id, aggregate_id, version, event_id FROM chaos_orders").fetch_all(producer).await? {
        s.business.push(BusinessRow { order_id: r.get(0), aggregate_id: r.get(1), version: r.get(2), event_id: r.get(3) });
    }
    for r in sqlx::query(
        "SELECT e.event_id, e.state, e.aggregate_id, e.aggregate_version, e.routing_key, e.payload_digest,
                (e.unknown_since_ms IS NOT NULL OR EXISTS (SELECT 1 FROM outbox_unknown_resolutions u WHERE u.event_id = e.event_id)
                 OR EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.event_id = e.event_id AND a.state IN ('UNKNOWN', 'ABSENT'))),
                (SELECT min(a.started_at_ms) FROM outbox_attempts a WHERE a.event_id = e.event_id)
         FROM outbox_events e
         UNION ALL
         -- A stream event without a lane row: never UNKNOWN (that moves it
         -- to the lane), its attempt the one its batch registered.
         SELECT s.event_id, outbox_event_state(s.event_id), s.aggregate_id, s.aggregate_version, s.routing_key, s.payload_digest, false,
                (SELECT b.cut_at_ms FROM outbox_publish_receipts r JOIN outbox_batches b ON b.id = r.batch_id
                 WHERE r.event_id = s.event_id AND r.envelope_generation = 1)
         FROM outbox_stream s WHERE NOT EXISTS (SELECT 1 FROM outbox_events x WHERE x.event_id = s.event_id)",
    )
    .fetch_all(producer)
    .await?
    {
        s.events.push(EventRow { event_id: r.get(0), state: r.get(1), aggregate_id: r.get(2), aggregate_version: r.get(3), routing_key: r.get(4), payload_digest: r.get(5), was_unknown: r.get(6), first_attempt_at_ms: r.get(7) });
    }
    // A primary receipt names an attempt of the lane's (outbox_attempts) or
    // a stream batch's (started when the batch was cut); a duplicate
    // transport receipt always one of the lane's.
    let primary = "SELECT r.event_id, r.topic, r.partition, r.\"offset\", coalesce(a.started_at_ms, b.cut_at_ms) AS started FROM outbox_publish_receipts r
                   LEFT JOIN outbox_attempts a ON a.attempt_id = r.attempt_id LEFT JOIN outbox_batches b ON b.id = r.batch_id
                   WHERE a.attempt_id IS NOT NULL OR b.id IS NOT NULL";
    let duplicate = "SELECT r.event_id, r.topic, r.partition, r.\"offset\", a.started_at_ms FROM outbox_duplicate_receipts r JOIN outbox_attempts a ON a.attempt_id = r.attempt_id";
    for (sql, into) in [(primary, &mut s.receipts), (duplicate, &mut s.duplicate_receipts)] {
        for r in sqlx::query(sql).fetch_all(producer).await? {
            into.push(Receipt { event_id: r.get(0), topic: r.get(1), partition: r.get(2), offset: r.get(3), attempt_started_at_ms: r.get(4) });
        }
    }
    for r in sqlx::query("SELECT kind, event_id, detail FROM outbox_findings").fetch_all(producer).await? {
        s.findings.push(Finding { kind: r.get(0), event_id: r.get(1), detail: r.get(2) });
    }
    for id in consumer_ids {
        let effects = sqlx::query_scalar(&format!("SELECT event_id FROM {EFFECTS_TABLE} WHERE consumer_id = $1")).bind(id).fetch_all(consumer).await?;
        let receipts = sqlx::query_scalar("SELECT event_id FROM outbox_consumer_receipts WHERE consumer_id = $1").bind(id).fetch_all(consumer).await?;
        s.consumers.push(ConsumerSide { consumer_id: id.clone(), effects, receipts });
    }
    Ok(s)
}
