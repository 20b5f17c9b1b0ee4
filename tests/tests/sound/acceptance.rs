//! What the store refuses to accept or send: stray messages, tampered payloads, unreadable destinations, PUBLISHED without a receipt.

use super::*;

// ---------------------------------------------------------------- item 9

/// Issue 19 item 9: a mirror or replay tool copies only the eventId header.
/// Its message is evidence (a finding), not a reason to quarantine the
/// event; when nothing else was found, the absence logic goes on.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item9_stray_message_with_the_event_id_does_not_quarantine_the_event(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, _a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    let stray = outbox_core::OutgoingMessage {
        topic: TOPIC.into(),
        partition: ev.destination.partition,
        key: ev.destination.routing_key.as_bytes().to_vec(),
        payload: b"mirrored copy".to_vec(),
        headers: vec![(headers::EVENT_ID.to_owned(), id.as_bytes().to_vec()), (headers::ENVELOPE_GENERATION.to_owned(), b"1".to_vec())],
    };
    assert!(matches!(f.broker.send(stray).await, SendOutcome::Acked { .. }));
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.quarantined, 0, "{r:?}");
    assert_ne!(f.state(&id).await, EventState::Quarantined);
    assert_eq!(r.retried, 1, "no message of a registered attempt was found: the absence logic decides: {r:?}");
    assert_eq!(f.findings("unregistered_message", &id).await, 1);
    assert_eq!(f.count("SELECT count(*) FROM outbox_quarantine").await, 0);
}

/// Issue 19 item 7: the payload and the envelope's payloadDigest are
/// rewritten together; the event row's immutable digest still names the
/// original bytes. The dispatcher must catch it before the send.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item7_payload_and_envelope_digest_rewritten_together_are_quarantined_before_the_send(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    let canonical: Vec<u8> = sqlx::query_scalar("SELECT envelope_canonical FROM outbox_envelopes WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    let mut envelope = outbox_core::Envelope::from_canonical(&canonical).unwrap();
    let evil = b"{\"order\":\"o-1\",\"totalCents\":100000}".to_vec();
    envelope.payload_digest = outbox_core::sha256_digest(&evil);
    tamper(&f.pool, "UPDATE outbox_events SET payload = $2 WHERE event_id = $1", &id, Some(evil)).await;
    tamper(&f.pool, "UPDATE outbox_envelopes SET envelope_canonical = $2 WHERE event_id = $1", &id, Some(envelope.canonical_bytes())).await;
    let report = f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap();
    assert_eq!((report.sent, report.quarantined), (0, 1), "{report:?}");
    assert_eq!(f.log_of(&id), 0, "the rewritten payload was sent");
    assert_eq!(f.state(&id).await, EventState::Quarantined);
}

/// Issue 19 item 7: one event's frozen destination cannot be read. That
/// event is quarantined; every other event of the batch is sent.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item7_one_unreadable_destination_quarantines_that_event_only(pool: PgPool) {
    let f = fixture(pool).await;
    let bad = create_order(&f.pool, "o-bad", 1).await;
    let good = create_order(&f.pool, "o-good", 1).await;
    unreadable_destination(&f.pool, &bad).await;
    let d = f.dispatcher(&f.store, 1_000);
    let report = d.dispatch_once("w").await.expect("one unreadable destination failed the whole claim");
    assert_eq!((report.published, report.quarantined), (1, 1), "{report:?}");
    assert_eq!(f.state(good.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.state(bad.event_id().as_str()).await, EventState::Quarantined);
    let reason: String = sqlx::query_scalar("SELECT reason FROM outbox_quarantine WHERE event_id = $1").bind(bad.event_id().as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(reason, "frozen_record_unreadable");
    // Nothing is left for a second round to fail on.
    assert_eq!(d.dispatch_once("w").await.unwrap().claimed, 0);
}

// ---------------------------------------------------------------- item 6

/// Issue 19 item 6: the database refuses an event inserted in any state but
/// PENDING, and PUBLISHED (RETAINED, PURGED) without a primary receipt.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item6_the_database_refuses_published_without_a_receipt(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    // The application role inserts an already-PUBLISHED event.
    let copy = outbox_core::EventId::generate(f.store.now_ms() as u64).to_string();
    sqlx::query("INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version) VALUES ('raw-copy', $1, 't', 'order', 'o-9', 1)")
        .bind(&copy)
        .execute(&f.pool)
        .await
        .unwrap();
    let err = sqlx::query(
        "INSERT INTO outbox_events (event_id, command_key, state, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest,
                                    destination_digest, cluster_id, topic, partition, routing_key, ordered, created_at_ms, state_since_ms)
         SELECT $2, 'raw-copy', 'PUBLISHED', tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest,
                destination_digest, cluster_id, topic, partition, routing_key, ordered, 0, 0 FROM outbox_events WHERE event_id = $1",
    )
    .bind(&id)
    .bind(&copy)
    .execute(&f.pool)
    .await
    .expect_err("an event inserted PUBLISHED was accepted");
    assert!(err.to_string().contains("PENDING"), "{err}");
    // The dispatcher role walks PENDING -> CLAIMED -> SENDING -> PUBLISHED with no receipt.
    let mut tx = f.pool.begin().await.unwrap();
    for sql in [
        "UPDATE outbox_events SET state = 'CLAIMED', claim_owner = 'w', claim_generation = claim_generation + 1, lease_until_ms = 1 WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'SENDING' WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'PUBLISHED', claim_owner = NULL WHERE event_id = $1",
    ] {
        sqlx::query(sql).bind(&id).execute(&mut *tx).await.unwrap();
    }
    let err = tx.commit().await.expect_err("PUBLISHED without a receipt was committed");
    assert!(err.to_string().contains("without a primary receipt"), "{err}");
    assert_eq!(f.state(&id).await, EventState::Pending);
    // The real path still works: a receipt in the same transaction. (A
    // lease long enough for a loaded machine: with 1 s, a CI run once
    // published nothing, the send and receipt outlasting the lease.)
    assert_eq!(f.dispatcher(&f.store, 30_000).dispatch_once("w").await.unwrap().published, 1);
}

/// Issue 19 item 6: a PUBLISHED event without a receipt that got in anyway
/// (written before the rule existed, or with the triggers off) is a finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item6_published_without_receipt_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let good = create_order(&f.pool, "o-2", 1).await;
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap().published, 2);
    tamper(&f.pool, "DELETE FROM outbox_publish_receipts WHERE event_id = $1", e.event_id().as_str(), None).await;
    f.reconciler().compare_once().await.unwrap();
    assert_eq!(f.findings("published_without_receipt", e.event_id().as_str()).await, 1);
    assert_eq!(f.findings("published_without_receipt", good.event_id().as_str()).await, 0);
}

/// Issue 47 item 1: a per-route poison policy. By default (block) a
/// QUARANTINED event holds its key: the key's next event waits for an
/// operator. Set to skip (who, why), the reconciler's next round closes the
/// QUARANTINED event SKIPPED with the evidence an operator's skip keeps,
/// naming the policy's setter and reason, and the key moves on. Set back to
/// block, a new quarantine holds its key again.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_routes_poison_policy_blocks_by_default_and_skips_when_set(pool: PgPool) {
    use outbox_core::{PoisonPolicy, PoisonRule};
    use outbox_producer::skip::SkipStore;
    let f = fixture(pool).await;
    let bad = create_order(&f.pool, "o-1", 1).await;
    let next = update_order(&f.pool, "o-1", 2, 2).await;
    unreadable_destination(&f.pool, &bad).await;
    let d = f.dispatcher(&f.store, 1_000);
    let r = d.dispatch_once("w").await.unwrap();
    assert_eq!((r.published, r.quarantined), (0, 1), "{r:?}");
    assert_eq!(f.state(bad.event_id().as_str()).await, EventState::Quarantined);

    // Block (no policy set): the key waits, round after round.
    let rec = f.reconciler();
    assert_eq!(rec.resolve_unknown_once().await.unwrap().poison_skipped, 0);
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 0);
    assert_eq!(f.state(next.event_id().as_str()).await, EventState::Pending);

    let rule = |policy, actor: &str, reason: &str| PoisonRule { event_type: ORDER_CREATED.into(), policy, actor: actor.into(), reason: reason.into(), at_ms: 0 };
    assert!(f.store.set_poison_policy(&rule(PoisonPolicy::Skip, "ops-bob", " ")).await.is_err(), "a policy without a reason was stored");
    f.store.set_poison_policy(&rule(PoisonPolicy::Skip, "ops-bob", "order events accept gaps, OPS-9")).await.unwrap();
    assert_eq!(f.store.poison_policy(ORDER_CREATED).await.unwrap().map(|r| r.policy), Some(PoisonPolicy::Skip));
    assert_eq!(rec.resolve_unknown_once().await.unwrap().poison_skipped, 1);
    assert_eq!(f.state(bad.event_id().as_str()).await, EventState::Skipped);
    let records = f.store.skip_records(bad.event_id()).await.unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!((records[0].operator.as_str(), records[0].from_state), (outbox_core::POISON_POLICY_ACTOR, EventState::Quarantined));
    assert!(records[0].reason.contains("ops-bob") && records[0].reason.contains("OPS-9"), "{records:?}");
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1, "the key did not move on");
    assert_eq!(f.state(next.event_id().as_str()).await, EventState::Published);

    // Back to block: a new quarantine holds its key again.
    f.store.set_poison_policy(&rule(PoisonPolicy::Block, "ops-carol", "gaps need a decision again, OPS-10")).await.unwrap();
    let bad2 = create_order(&f.pool, "o-2", 1).await;
    unreadable_destination(&f.pool, &bad2).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().quarantined, 1);
    assert_eq!(rec.resolve_unknown_once().await.unwrap().poison_skipped, 0);
    assert_eq!(f.state(bad2.event_id().as_str()).await, EventState::Quarantined);
    assert_eq!(f.count("SELECT count(*) FROM outbox_poison_policies").await, 2, "the policy's history is kept");
}

/// Makes `e`'s frozen destination unreadable (the dispatcher quarantines it before the send).
async fn unreadable_destination(pool: &PgPool, e: &outbox_producer::Emitted) {
    tamper(pool, "UPDATE outbox_envelopes SET destination_canonical = $2 WHERE event_id = $1", e.event_id().as_str(), Some(b"not a destination".to_vec())).await;
}
