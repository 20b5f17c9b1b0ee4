//! The decision core on real PostgreSQL, without Kafka: messages are built
//! from outbox-core envelopes exactly as a dispatcher sends them.

mod common;

use common::*;
use outbox_consumer::{Outcome, Processor, QuarantineReason, RawMessage, RetryPolicy};
use outbox_core::headers;
use sqlx::PgPool;

const TOPIC: &str = "orders";

fn processor(pool: &PgPool, h: &TestHandler) -> Processor {
    let retry = RetryPolicy { max_attempts: 3, initial_backoff_ms: 5, max_backoff_ms: 20, ..RetryPolicy::default() };
    Processor::new("billing", pool.clone(), h.clone()).unwrap().with_retry(retry).unwrap()
}

fn kinds(outs: &[Outcome]) -> Vec<&'static str> {
    outs.iter().map(Outcome::kind).collect()
}

/// A redelivery returns the original receipt, result included, and runs nothing.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn duplicate_returns_the_original_receipt(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let f = fixture(TOPIC, 4, "o-1");

    let first = p.process_message(&f.raw(10)).await.unwrap();
    let Outcome::Applied { receipt } = &first else { panic!("{first:?}") };
    assert_eq!(receipt.result["applied_at_offset"], 10);
    assert_eq!(receipt.event_id, *f.event_id());

    let again = p.process_message(&f.raw(11)).await.unwrap();
    let Outcome::Duplicate { original, delivery } = &again else { panic!("{again:?}") };
    assert_eq!(original, receipt, "the original receipt, byte for byte");
    assert_eq!(delivery.offset, 11);
    // A different Processor instance (a restarted process) sees the same.
    let p2 = processor(&pool, &h);
    let third = p2.process_message(&f.raw(10)).await.unwrap();
    assert_eq!(third.receipt(), Some(receipt));

    assert_eq!(h.calls(), 1);
    assert_eq!(effects(&pool).await, (1, 1));
    assert_eq!(outbox_consumer::receipt(&pool, "billing", f.event_id()).await.unwrap().as_ref(), Some(receipt));
    // Another consumer id has its own receipt and its own effect.
    let other = Processor::new("shipping", pool.clone(), h.clone()).unwrap();
    assert_eq!(other.process_message(&f.raw(10)).await.unwrap().kind(), "applied");
    assert_eq!(effects(&pool).await, (2, 2));
}

/// Duplicated and reordered messages inside one batch and across batches.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn duplicated_and_reordered_messages_have_one_effect_each(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let (a, b, c) = (fixture_on(TOPIC, 4, 1, "a"), fixture_on(TOPIC, 4, 1, "b"), fixture_on(TOPIC, 4, 1, "c"));
    let outs = p.process_batch(&[a.raw(0), b.raw(1), a.raw(2), c.raw(3), b.raw(4)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied", "applied", "duplicate", "applied", "duplicate"]);
    assert_eq!(outs[2].receipt(), outs[0].receipt());
    assert_eq!(outs[4].receipt(), outs[1].receipt());
    // Replayed out of order in a later batch (e.g. after a reset of offsets).
    let outs = p.process_batch(&[c.raw(5), a.raw(6), b.raw(7)]).await.unwrap();
    assert_eq!(kinds(&outs), ["duplicate", "duplicate", "duplicate"]);
    assert_eq!(h.calls(), 3);
    assert_eq!(effects(&pool).await, (3, 3));

    let w = outbox_consumer::watermarks(&pool, "billing").await.unwrap();
    assert_eq!(w.len(), 1);
    assert_eq!((w[0].committed_offset, w[0].applied_count, w[0].duplicate_count), (8, 3, 5));
}

/// Tampered bytes, a wrong placement and a missing header are quarantined
/// with evidence; the events around them are applied.
#[tokio::test]
async fn tampered_messages_are_quarantined_and_the_partition_moves_on() {
    // Its own database: `run_mutant` runs this test again in a child process.
    let db = own_database("consumer_tampered").await;
    let pool = db.pool.clone();
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let good1 = fixture_on(TOPIC, 4, 2, "g1");
    let good2 = fixture_on(TOPIC, 4, 2, "g2");
    let victim = fixture_on(TOPIC, 4, 2, "v");
    let mut tampered = victim.raw(1);
    tampered.payload = Some(b"{\"order\":\"o-v\",\"quantity\":200}".to_vec());
    let mut wrong_key = victim.raw(2);
    wrong_key.key = Some(b"someone-else".to_vec());
    let mut no_id = victim.raw(3);
    no_id.headers.retain(|(k, _)| k != headers::EVENT_ID);
    let outs = p.process_batch(&[good1.raw(0), tampered, wrong_key, no_id, good2.raw(4)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied", "quarantined", "quarantined", "quarantined", "applied"]);
    let codes: Vec<String> = outs[1..4]
        .iter()
        .map(|o| match o {
            Outcome::Quarantined(q) => q.reason.code(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(codes, ["verify:payload_digest", "verify:placement", "verify:missing_header"]);
    assert_eq!(h.calls(), 2, "the handler never saw a quarantined message");

    type Row = (i64, Option<String>, String, serde_json::Value, String, Option<Vec<u8>>);
    let rows: Vec<Row> =
        sqlx::query_as(r#"SELECT "offset", event_id, reason, evidence, payload_digest, payload FROM outbox_consumer_quarantine ORDER BY "offset""#).fetch_all(&pool).await.unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].1.as_deref(), Some(victim.event_id().as_str()));
    assert!(rows[0].3["error"].as_str().unwrap().contains("payload digest mismatch"));
    assert!(rows[0].3["headers"].as_array().unwrap().iter().any(|h| h["name"] == headers::PAYLOAD_DIGEST));
    assert_eq!(rows[0].4, outbox_core::sha256_digest(b"{\"order\":\"o-v\",\"quantity\":200}"));
    assert!(rows[0].5.is_some(), "small tampered payloads are kept as evidence");
    assert_eq!(rows[2].1, None);

    // The genuine copy of the victim still applies later; redelivering the
    // tampered position does not add a second quarantine row.
    let mut tampered_again = victim.raw(1);
    tampered_again.payload = Some(b"x".to_vec());
    assert_eq!(p.process_message(&tampered_again).await.unwrap().kind(), "quarantined");
    assert_eq!(p.process_message(&victim.raw(5)).await.unwrap().kind(), "applied");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine").fetch_one(&pool).await.unwrap();
    assert_eq!(n, 3);
    let w = &outbox_consumer::watermarks(&pool, "billing").await.unwrap()[0];
    assert_eq!((w.committed_offset, w.applied_count, w.quarantined_count, w.duplicate_count), (6, 3, 3, 1));
    // The row's anchor: the event of the message at committed_offset - 1,
    // decided there as genuine (retention finds its receipt there).
    let anchor: Option<String> = sqlx::query_scalar("SELECT anchor_event_id FROM outbox_consumer_watermarks WHERE consumer_id = 'billing'").fetch_one(&pool).await.unwrap();
    assert_eq!(anchor.as_deref(), Some(victim.event_id().as_str()));
    db.drop_now().await;
}

/// The same eventId with other payload bytes (each copy self-consistent) is
/// never accepted as a duplicate: it is quarantined as divergent.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn same_event_id_with_other_bytes_is_quarantined(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let f = fixture(TOPIC, 4, "o-9");
    assert_eq!(p.process_message(&f.raw(0)).await.unwrap().kind(), "applied");
    // A second envelope claiming the same eventId with another payload.
    let mut forged = fixture(TOPIC, 4, "o-9");
    forged.envelope.event_id = f.event_id().clone();
    forged.payload = b"{\"order\":\"o-9\",\"quantity\":99}".to_vec();
    forged.envelope.payload_digest = outbox_core::sha256_digest(&forged.payload);
    forged.headers = headers::build(&forged.envelope, &forged.destination, &forged.destination.digest(), &outbox_core::AttemptId::generate(1), None);
    let o = p.process_message(&forged.raw(1)).await.unwrap();
    let Outcome::Quarantined(q) = &o else { panic!("{o:?}") };
    assert!(matches!(q.reason, QuarantineReason::DivergentDuplicate { .. }));
    assert_eq!(h.calls(), 1);
}

/// A handler failing twice then succeeding: retried alone with backoff,
/// applied once; the events before and after it in the batch commit too.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn handler_failing_twice_then_succeeding(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let fs: Vec<_> = (0..5).map(|i| fixture_on(TOPIC, 4, 0, &format!("f{i}"))).collect();
    h.script(fs[2].event_id(), Script::FailTimes(2));
    let msgs: Vec<RawMessage> = fs.iter().enumerate().map(|(i, f)| f.raw(i as i64)).collect();
    let outs = p.process_batch(&msgs).await.unwrap();
    assert_eq!(kinds(&outs), ["applied"; 5]);
    let m = p.metrics().snapshot();
    assert_eq!((m.applied, m.handler_failures, m.dead_lettered), (5, 2, 0));
    assert_eq!(effects(&pool).await, (5, 5), "failed attempts left no effect");
    assert_eq!(outs[2].receipt().unwrap().result["applied_at_offset"], 2);
}

/// A handler that always fails: bounded attempts, then a dead letter; the
/// rest of the batch is applied; a redelivery does not run it again; a
/// redrive after the fix applies it once.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn always_failing_handler_is_dead_lettered_then_redriven(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let fs: Vec<_> = (0..3).map(|i| fixture_on(TOPIC, 4, 3, &format!("d{i}"))).collect();
    h.script(fs[1].event_id(), Script::AlwaysFail);
    let outs = p.process_batch(&[fs[0].raw(0), fs[1].raw(1), fs[2].raw(2)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied", "dead_lettered", "applied"]);
    let Outcome::DeadLettered(d) = &outs[1] else { unreachable!() };
    assert_eq!((d.attempts, d.redelivery), (3, false));
    assert!(d.error.contains("always fails"));
    let calls = h.calls();

    let again = p.process_message(&fs[1].raw(3)).await.unwrap();
    let Outcome::DeadLettered(d) = &again else { panic!("{again:?}") };
    assert!(d.redelivery);
    assert_eq!(h.calls(), calls, "a dead-lettered event is not retried on redelivery");

    let (attempts, err, payload): (i32, String, Vec<u8>) =
        sqlx::query_as("SELECT attempts, last_error, payload FROM outbox_consumer_dead_letters WHERE event_id = $1").bind(fs[1].event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!((attempts, payload), (3, fs[1].payload.clone()));
    assert!(err.contains("always fails"));

    // Redrive while still broken: stays dead-lettered, attempts grow.
    let o = p.redrive_dead_letter(fs[1].event_id()).await.unwrap().unwrap();
    assert!(matches!(o, Outcome::DeadLettered(ref d) if d.attempts == 4));
    // Fixed: applied once, dead letter gone.
    h.clear(fs[1].event_id());
    let o = p.redrive_dead_letter(fs[1].event_id()).await.unwrap().unwrap();
    assert_eq!(o.kind(), "applied");
    assert!(p.redrive_dead_letter(fs[1].event_id()).await.unwrap().is_none());
    assert_eq!(p.process_message(&fs[1].raw(4)).await.unwrap().kind(), "duplicate");
    assert_eq!(effects(&pool).await, (3, 3));
    let w = &outbox_consumer::watermarks(&pool, "billing").await.unwrap()[0];
    assert_eq!((w.committed_offset, w.applied_count, w.dead_lettered_count), (5, 3, 1));
}

/// Permanent errors skip the retries; panics and swallowed query errors are
/// contained and end as dead letters without blocking their neighbours.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn permanent_errors_panics_and_swallowed_query_errors(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let fs: Vec<_> = (0..5).map(|i| fixture_on(TOPIC, 4, 1, &format!("p{i}"))).collect();
    h.script(fs[0].event_id(), Script::Permanent);
    h.script(fs[2].event_id(), Script::Panic);
    h.script(fs[3].event_id(), Script::SwallowDbError);
    let msgs: Vec<RawMessage> = fs.iter().enumerate().map(|(i, f)| f.raw(i as i64)).collect();
    let outs = p.process_batch(&msgs).await.unwrap();
    assert_eq!(kinds(&outs), ["dead_lettered", "applied", "dead_lettered", "dead_lettered", "applied"]);
    let attempts: Vec<u32> = outs
        .iter()
        .filter_map(|o| match o {
            Outcome::DeadLettered(d) => Some(d.attempts),
            _ => None,
        })
        .collect();
    assert_eq!(attempts, [1, 3, 3]);
    assert!(matches!(&outs[2], Outcome::DeadLettered(d) if d.error.contains("panicked")));
    assert_eq!(effects(&pool).await, (2, 2));
}

/// A handler that runs past its time limit is a transient failure; the
/// transaction (and what the handler wrote) is rolled back.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn slow_handler_times_out_and_is_dead_lettered(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    h.delay_ms.store(300, std::sync::atomic::Ordering::SeqCst);
    let retry = RetryPolicy { max_attempts: 2, initial_backoff_ms: 5, max_backoff_ms: 5, handler_timeout_ms: 50, ..RetryPolicy::default() };
    let p = Processor::new("billing", pool.clone(), h.clone()).unwrap().with_retry(retry).unwrap();
    let f = fixture(TOPIC, 4, "slow");
    let o = p.process_message(&f.raw(0)).await.unwrap();
    assert!(matches!(&o, Outcome::DeadLettered(d) if d.attempts == 2 && d.error.contains("timed out after 50 ms")), "{o:?}");
    assert_eq!(effects(&pool).await, (0, 0));
    // Fast again: a redrive applies it.
    h.delay_ms.store(0, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(p.redrive_dead_letter(f.event_id()).await.unwrap().map(|o| o.kind()), Some("applied"));
}

/// Two processors (two instances) racing on the same events: the receipt's
/// primary key serializes them, one effect per event.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn concurrent_instances_apply_each_event_once(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p1 = processor(&pool, &h);
    let p2 = processor(&pool, &h);
    let msgs: Vec<RawMessage> = (0..200).map(|i| fixture_on(TOPIC, 4, 0, &format!("r{i}")).raw(i)).collect();
    let (a, b) = tokio::join!(p1.process_batch(&msgs), p2.process_batch(&msgs));
    let (a, b) = (a.unwrap(), b.unwrap());
    for (x, y) in a.iter().zip(&b) {
        let mut k = [x.kind(), y.kind()];
        k.sort();
        assert_eq!(k, ["applied", "duplicate"]);
        assert_eq!(x.receipt(), y.receipt());
    }
    assert_eq!(effects(&pool).await, (200, 200));
}

/// Watermarks are copied, monotonically, into the outbox database.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn watermarks_are_published_to_the_outbox_database(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    for part in 0..2 {
        let msgs: Vec<RawMessage> = (0..3).map(|i| fixture_on(TOPIC, 4, part, &format!("w{part}{i}")).raw(i)).collect();
        p.process_batch(&msgs).await.unwrap();
    }
    // A second database standing for the outbox database.
    let name = format!("outbox_wm_{}_{}", std::process::id(), rand_suffix());
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&pool).await.unwrap();
    let opts = pool.connect_options().as_ref().clone().database(&name);
    let outbox = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect_with(opts).await.unwrap();
    outbox_consumer::migrate(&outbox).await.unwrap();

    assert_eq!(outbox_consumer::publish_watermarks(&pool, &outbox, "billing").await.unwrap(), 2);
    let copied = outbox_consumer::watermarks(&outbox, "billing").await.unwrap();
    assert_eq!(copied, outbox_consumer::watermarks(&pool, "billing").await.unwrap());
    assert_eq!(copied.iter().map(|w| w.committed_offset).collect::<Vec<_>>(), [3, 3]);
    // Publishing an older state never moves the copy back.
    sqlx::query("UPDATE outbox_consumer_watermarks SET committed_offset = 1, applied_count = 0").execute(&pool).await.unwrap();
    outbox_consumer::publish_watermarks(&pool, &outbox, "billing").await.unwrap();
    let again = outbox_consumer::watermarks(&outbox, "billing").await.unwrap();
    assert_eq!(again, copied);

    // Partition 0's log is replaced under the consumer (the topic created
    // again), which goes on from the old log's position: its reading
    // starts over in the new log, its watermark there stands at 0 with the
    // new log's [0, 3) a gap, and the copy follows it back, log id and all.
    let known = |log: &str, part: i32, tag: &str, at: i64| RawMessage { log_id: Some(log.to_owned()), ..fixture_on(TOPIC, 4, part, tag).raw(at) };
    p.process_batch(&[known("log-a", 0, "wa", 3)]).await.unwrap();
    outbox_consumer::publish_watermarks(&pool, &outbox, "billing").await.unwrap();
    let first = outbox_consumer::watermarks(&outbox, "billing").await.unwrap();
    let p0 = first.iter().find(|w| w.partition == 0).unwrap();
    assert_eq!((p0.committed_offset, p0.log_id.as_deref()), (4, Some("log-a")));
    p.process_batch(&[known("log-b", 0, "wb", 4)]).await.unwrap();
    outbox_consumer::publish_watermarks(&pool, &outbox, "billing").await.unwrap();
    let replaced = outbox_consumer::watermarks(&outbox, "billing").await.unwrap();
    let p0 = replaced.iter().find(|w| w.partition == 0).unwrap();
    assert_eq!((p0.committed_offset, p0.log_id.as_deref()), (0, Some("log-b")), "{replaced:?}");
    let own = outbox_consumer::watermarks(&pool, "billing").await.unwrap();
    let own0 = own.iter().find(|w| w.partition == 0).unwrap();
    assert_eq!((own0.committed_offset, own0.log_id.as_deref(), own0.open_gap_end), (0, Some("log-b"), Some(4)), "{own:?}");

    outbox.close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&pool).await.unwrap();
}

/// A topic deleted and created again under the same name: the new log
/// starts at offset 0 again and its events' destinations name the new
/// topic id. The consumer keeps a watermark row per topic id (the old log's
/// is not moved by the new log's offsets), its receipts name the id, and a
/// batch of one log mixing destination.v1 and .v2 messages (a route that
/// learned the id) moves each row to the last offset of its own messages.
/// `publish_watermarks` copies every row with its id.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn watermarks_and_receipts_are_kept_per_topic_id(pool: PgPool) {
    const OLD: &str = "AAECAwQFBgcICQoLDA0ODw";
    const NEW: &str = "_____________________w";
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let on = |topic_id: Option<&str>, tag: &str| {
        (0..10_000).map(|i| fixture_of(TOPIC, topic_id, 4, &format!("o-{tag}-{i}"))).find(|f| f.partition() == 1).unwrap()
    };
    let old: Vec<Fixture> = (0..3).map(|i| on(Some(OLD), &format!("old{i}"))).collect();
    let new: Vec<Fixture> = (0..3).map(|i| on(Some(NEW), &format!("new{i}"))).collect();
    let outs = p.process_batch(&[old[0].raw(0), old[1].raw(1), old[2].raw(2)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied"; 3]);
    // The recreated topic's log, from offset 0 again.
    let outs = p.process_batch(&[new[0].raw(0), new[1].raw(1)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied"; 2]);
    let rows = || async {
        sqlx::query_as::<_, (Option<String>, i64, i64, i64, i64)>(
            "SELECT topic_id, committed_offset, applied_count, duplicate_count, quarantined_count FROM outbox_consumer_watermarks
             WHERE consumer_id = 'billing' AND partition = 1 ORDER BY topic_id NULLS FIRST",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    assert_eq!(outbox_consumer::watermarks(&pool, "billing").await.unwrap().len(), 2, "one watermark row for two logs: {:?}", rows().await);
    assert_eq!(rows().await, vec![(Some(OLD.into()), 3, 3, 0, 0), (Some(NEW.into()), 2, 2, 0, 0)]);
    let receipts: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT event_id, topic_id FROM outbox_consumer_receipts WHERE consumer_id = 'billing' ORDER BY topic_id, \"offset\"").fetch_all(&pool).await.unwrap();
    let want: Vec<(String, Option<String>)> =
        old.iter().map(|f| (f.event_id().to_string(), Some(OLD.into()))).chain(new[..2].iter().map(|f| (f.event_id().to_string(), Some(NEW.into())))).collect();
    assert_eq!(receipts, want);

    // One batch of the new log: a destination.v1 event, a .v2 one, a
    // tampered copy of a .v2 event (quarantined; its destination names the
    // new id) and another destination.v1 event.
    let (v1a, v1b) = (on(None, "v1a"), on(None, "v1b"));
    let mut tampered = new[2].raw(4);
    tampered.payload = Some(b"{\"order\":\"forged\"}".to_vec());
    let outs = p.process_batch(&[v1a.raw(2), new[2].raw(3), tampered, v1b.raw(5)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied", "applied", "quarantined", "applied"]);
    assert_eq!(rows().await, vec![(None, 6, 2, 0, 0), (Some(OLD.into()), 3, 3, 0, 0), (Some(NEW.into()), 5, 3, 0, 1)]);
    let receipt = outbox_consumer::receipt(&pool, "billing", new[2].event_id()).await.unwrap().unwrap();
    assert_eq!(receipt.topic_id.as_deref(), Some(NEW));
    assert_eq!(outbox_consumer::receipt(&pool, "billing", v1a.event_id()).await.unwrap().unwrap().topic_id, None);

    // The copy into an outbox database keeps each row with its topic id.
    let name = format!("outbox_wm_ids_{}_{}", std::process::id(), rand_suffix());
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&pool).await.unwrap();
    let opts = pool.connect_options().as_ref().clone().database(&name);
    let outbox = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect_with(opts).await.unwrap();
    outbox_consumer::migrate(&outbox).await.unwrap();
    assert_eq!(outbox_consumer::publish_watermarks(&pool, &outbox, "billing").await.unwrap(), 3);
    let copied = outbox_consumer::watermarks(&outbox, "billing").await.unwrap();
    assert_eq!(copied, outbox_consumer::watermarks(&pool, "billing").await.unwrap());
    assert_eq!(copied.iter().map(|w| w.topic_id.as_deref()).collect::<Vec<_>>(), [None, Some(OLD), Some(NEW)]);
    outbox.close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&pool).await.unwrap();
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos() as u64).unwrap_or(0)
}

/// Batches must be one partition in increasing offsets.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn invalid_batches_are_refused(pool: PgPool) {
    let p = processor(&pool, &TestHandler::default());
    let a = fixture_on(TOPIC, 4, 0, "x");
    let b = fixture_on(TOPIC, 4, 1, "y");
    assert!(p.process_batch(&[a.raw(1), a.raw(1)]).await.is_err());
    assert!(p.process_batch(&[a.raw(2), b.raw(3)]).await.is_err());
    assert!(p.process_batch(&[]).await.unwrap().is_empty());
}

/// Receipts older than the replay window can be purged in bounded batches.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn receipts_are_purged_in_bounded_batches(pool: PgPool) {
    create_effects_table(&pool).await;
    let p = processor(&pool, &TestHandler::default());
    let msgs: Vec<RawMessage> = (0..5).map(|i| fixture_on(TOPIC, 4, 0, &format!("u{i}")).raw(i)).collect();
    p.process_batch(&msgs).await.unwrap();
    let cutoff = chrono::Utc::now() + chrono::Duration::seconds(1);
    assert!(outbox_consumer::purge_receipts_before(&pool, "billing", cutoff, 0).await.is_err());
    assert_eq!(outbox_consumer::purge_receipts_before(&pool, "billing", chrono::Utc::now() - chrono::Duration::hours(1), 10).await.unwrap(), 0);
    assert_eq!(outbox_consumer::purge_receipts_before(&pool, "billing", cutoff, 3).await.unwrap(), 3);
    assert_eq!(outbox_consumer::purge_receipts_before(&pool, "billing", cutoff, 3).await.unwrap(), 2);
    assert_eq!(outbox_consumer::purge_receipts_before(&pool, "other", cutoff, 3).await.unwrap(), 0);
}

/// A receipt the partition's watermark has not passed is never purged,
/// whatever its age: its message may still be redelivered.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn purge_never_overtakes_the_watermark(pool: PgPool) {
    create_effects_table(&pool).await;
    let p = processor(&pool, &TestHandler::default());
    let msgs: Vec<RawMessage> = (0..5).map(|i| fixture_on(TOPIC, 4, 0, &format!("w{i}")).raw(i)).collect();
    p.process_batch(&msgs).await.unwrap();
    // As if the offsets 3 and 4 were decided but the watermark had not moved past them.
    sqlx::query("UPDATE outbox_consumer_watermarks SET committed_offset = 3 WHERE consumer_id = 'billing'").execute(&pool).await.unwrap();
    let cutoff = chrono::Utc::now() + chrono::Duration::seconds(1);
    assert_eq!(outbox_consumer::purge_receipts_before(&pool, "billing", cutoff, 100).await.unwrap(), 3);
    let left: Vec<i64> = sqlx::query_scalar("SELECT \"offset\" FROM outbox_consumer_receipts WHERE consumer_id = 'billing' ORDER BY 1").fetch_all(&pool).await.unwrap();
    assert_eq!(left, vec![3, 4]);
}

/// A pool of one connection to the test's database: its statements are
/// the only ones a session's counters count.
async fn one_session(pool: &PgPool) -> PgPool {
    sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.unwrap()
}

/// The receipts table's sequential scans and rows read (rows read by
/// sequential scans plus index entries read by index scans), once the
/// session `own` has reported its counters (`pg_stat_force_next_flush`:
/// reported when its next transaction ends, before it answers).
async fn receipt_reads(pool: &PgPool, own: &PgPool) -> (i64, i64) {
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(own).await.unwrap();
    sqlx::query_as(
        "SELECT t.seq_scan, t.seq_tup_read + (SELECT coalesce(sum(i.idx_tup_read), 0) FROM pg_stat_user_indexes i WHERE i.relid = t.relid)::bigint
         FROM pg_stat_user_tables t WHERE t.relname = 'outbox_consumer_receipts'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A batch's receipt statements probe the receipts' primary key whatever the
/// statistics said when the session first ran them: a session that ran them
/// against a handful of analyzed receipts (as autovacuum leaves a young
/// table) goes on consuming after the table has grown to 300,000 receipts
/// without reading all of the consumer's receipts once per batch.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn batches_planned_on_a_tiny_receipts_table_stay_index_probes(pool: PgPool) {
    create_effects_table(&pool).await;
    let own = one_session(&pool).await;
    let h = TestHandler::default();
    let p = processor(&own, &h);
    let all: Vec<RawMessage> = (0..2_018).map(|i| fixture(TOPIC, 1, &format!("o-{i}")).raw(i)).collect();
    // Run more than five times (PostgreSQL may settle on a generic plan
    // after five), then again with statistics of a tiny table, redeliveries
    // included.
    for batch in all[..18].chunks(3) {
        assert!(p.process_batch(batch).await.unwrap().iter().all(|o| o.kind() == "applied"));
    }
    sqlx::query("ANALYZE outbox_consumer_receipts").execute(&pool).await.unwrap();
    assert!(p.process_batch(&all[..18]).await.unwrap().iter().all(|o| o.kind() == "duplicate"));
    // The consumer's receipts grow to 300,000 through another session.
    sqlx::query(
        r#"INSERT INTO outbox_consumer_receipts (consumer_id, event_id, envelope_generation, event_type, topic, partition, "offset", payload_digest)
           SELECT 'billing', 'evt-7' || lpad(i::text, 25, '0'), 1, 'order.created', 'elsewhere', 0, i, 'sha256:0'
           FROM generate_series(1, 300000) AS s(i)"#,
    )
    .execute(&pool)
    .await
    .unwrap();
    let (scans_before, rows_before) = receipt_reads(&pool, &own).await;
    for batch in all[18..].chunks(200) {
        assert!(p.process_batch(batch).await.unwrap().iter().all(|o| o.kind() == "applied"));
    }
    // Redelivered: 10 batches of events already applied answer their
    // receipts.
    for batch in all[18..].chunks(200) {
        assert!(p.process_batch(batch).await.unwrap().iter().all(|o| o.kind() == "duplicate"));
    }
    let (scans_after, rows_after) = receipt_reads(&pool, &own).await;
    let (scans, rows) = (scans_after - scans_before, rows_after - rows_before);
    // A statement that scanned would start one scan per batch.
    assert!(scans < 5, "consuming 2,000 events and 2,000 redeliveries started {scans} sequential scans of the receipts");
    // A few index entries per event; a plan that read the consumer's
    // receipts from end to end reads 300,000 per batch.
    assert!(rows < 5 * 4_000, "consuming 2,000 events and 2,000 redeliveries read {rows} receipts and index entries");
    assert_eq!(effects(&pool).await, (2_018, 2_018));
}

/// A batch's receipts are inserted by its claim and given their handlers'
/// results by one update each: that update is heap-only (the result is
/// in no index, and each page keeps room for its rows' second versions),
/// so it writes no index entry. At the table's earlier fillfactor (80)
/// about three in four of those updates moved their row to another page
/// and wrote an entry into each of the receipts' three indexes:
/// `consume_bench` spent 30 µs of PostgreSQL's CPU per event, 23-26 at 40.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn storing_handler_results_writes_no_index_entries(pool: PgPool) {
    create_effects_table(&pool).await;
    let own = one_session(&pool).await;
    let h = TestHandler::default();
    let p = processor(&own, &h);
    let all: Vec<RawMessage> = (0..1_000).map(|i| fixture(TOPIC, 1, &format!("o-{i}")).raw(i)).collect();
    for batch in all.chunks(250) {
        assert!(p.process_batch(batch).await.unwrap().iter().all(|o| o.kind() == "applied"));
    }
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&own).await.unwrap();
    let (inserted, updated, heap_only): (i64, i64, i64) =
        sqlx::query_as("SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'outbox_consumer_receipts'").fetch_one(&pool).await.unwrap();
    assert_eq!((inserted, updated), (1_000, 1_000), "one insert and one result update per event");
    assert!(heap_only * 100 >= updated * 95, "{heap_only} of {updated} result updates were heap-only");
    assert_eq!(effects(&pool).await, (1_000, 1_000));
}

async fn gaps(pool: &PgPool) -> Vec<(i64, i64, i64, Option<String>)> {
    outbox_consumer::list_gaps(pool, Some("billing"), true, 100).await.unwrap().into_iter().map(|g| (g.detected_from, g.from_offset, g.to_offset, g.close_reason)).collect()
}

async fn watermark(pool: &PgPool) -> i64 {
    outbox_consumer::watermarks(pool, "billing").await.unwrap().iter().map(|w| w.committed_offset).max().unwrap()
}

/// The group's offset was reset past messages this consumer never read (an
/// operator reset it to the end, or its offset fell out of range below the
/// log's start and librdkafka jumped to the new start; the in-process
/// cluster cannot delete records, so this is the processor's view of it):
/// the fetched offsets jump. The range
/// is a recorded gap, counted and logged; the watermark stays at its start
/// (so retention cannot purge what it holds); a replay of the range closes
/// the gap and the watermark moves on.
#[tokio::test]
async fn an_offset_reset_or_out_of_range_jump_is_a_gap_the_watermark_does_not_pass() {
    // Its own database: `run_mutant` runs this test again in a child process.
    let db = own_database("consumer_gap_jump").await;
    let pool = db.pool.clone();
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let fs: Vec<_> = (0..12).map(|i| fixture_on(TOPIC, 4, 2, &format!("g{i}"))).collect();
    let raw = |i: usize| fs[i].raw(i as i64);
    p.process_batch(&[raw(0), raw(1), raw(2)]).await.unwrap();
    assert_eq!(watermark(&pool).await, 3);

    // Offsets 3..=9 are skipped: the next fetch starts at 10.
    let outs = p.process_batch(&[raw(10), raw(11)]).await.unwrap();
    assert_eq!(kinds(&outs), ["applied", "applied"]);
    assert_eq!(watermark(&pool).await, 3, "the watermark does not pass offsets never decided");
    assert_eq!(gaps(&pool).await, vec![(3, 3, 10, None)]);
    let m = p.metrics().snapshot();
    assert_eq!((m.offset_gaps, m.offset_gap_offsets), (1, 7));
    // Later messages keep the watermark at the gap; no second gap is found.
    p.process_message(&raw(11)).await.unwrap();
    assert_eq!((watermark(&pool).await, gaps(&pool).await.len()), (3, 1));

    // A replay from the gap's start shrinks it, then closes it.
    p.process_batch(&[raw(3), raw(4), raw(5)]).await.unwrap();
    assert_eq!(gaps(&pool).await, vec![(3, 6, 10, None)]);
    assert_eq!(watermark(&pool).await, 6);
    p.process_batch(&(6..12).map(raw).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(gaps(&pool).await, vec![(3, 10, 10, Some("replayed".into()))]);
    assert_eq!(watermark(&pool).await, 12);
    assert_eq!(effects(&pool).await, (12, 12), "every event applied once");
    assert_eq!(p.metrics().snapshot().offset_gaps, 1);
    db.drop_now().await;
}

/// A consumer whose first read of a partition begins past offset 0 (a new
/// group started at the end, or the log's start moved on) never read what
/// lies before: a gap from 0, and a watermark at 0.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn a_first_read_past_the_log_start_is_a_gap(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let f = fixture_on(TOPIC, 4, 0, "late");
    p.process_message(&f.raw(40)).await.unwrap();
    assert_eq!(gaps(&pool).await, vec![(0, 0, 40, None)]);
    assert_eq!(watermark(&pool).await, 0);
}

/// A gap whose messages are gone for good: an operator accepts it (who and
/// why are kept) and the watermark moves on with the next decision.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn a_gap_that_cannot_be_replayed_is_accepted_by_an_operator(pool: PgPool) {
    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let p = processor(&pool, &h);
    let fs: Vec<_> = (0..3).map(|i| fixture_on(TOPIC, 4, 1, &format!("a{i}"))).collect();
    p.process_message(&fs[0].raw(0)).await.unwrap();
    p.process_message(&fs[1].raw(5)).await.unwrap();
    assert_eq!(watermark(&pool).await, 1);
    let (cluster, topic) = (p.cluster_id().to_owned(), TOPIC);
    assert!(outbox_consumer::accept_gap(&pool, "billing", &cluster, topic, 1, 1, "", "x").await.is_err(), "an operator is named");
    assert_eq!(outbox_consumer::accept_gap(&pool, "billing", &cluster, topic, 1, 2, "ops", "gone").await.unwrap(), None, "no such gap");
    let g = outbox_consumer::accept_gap(&pool, "billing", &cluster, topic, 1, 1, "ops@example", "offsets 1..4 deleted by retention").await.unwrap().unwrap();
    assert_eq!((g.closed_by.as_deref(), g.close_reason.as_deref()), (Some("ops@example"), Some("offsets 1..4 deleted by retention")));
    assert_eq!(outbox_consumer::list_gaps(&pool, Some("billing"), false, 10).await.unwrap(), vec![], "no gap open");
    p.process_message(&fs[2].raw(6)).await.unwrap();
    assert_eq!(watermark(&pool).await, 7);
}

/// The deliberate defect `watermark-passes-gaps` (the watermark moves past
/// a range of offsets this consumer never read) turns the gap test red.
#[test]
fn the_gap_test_catches_a_watermark_that_passes_a_gap() {
    let out = run_mutant("an_offset_reset_or_out_of_range_jump_is_a_gap_the_watermark_does_not_pass", "watermark-passes-gaps");
    assert!(out.contains("the watermark does not pass offsets never decided"), "{out}");
}

/// The deliberate defect `payload-digest-from-header` (a message's payload
/// digest taken from its header instead of hashed from its bytes) turns the
/// tampering test red.
#[test]
fn the_tampering_test_catches_a_digest_taken_from_the_header() {
    let out = run_mutant("tampered_messages_are_quarantined_and_the_partition_moves_on", "payload-digest-from-header");
    assert!(out.contains("panicked"), "{out}");
}
