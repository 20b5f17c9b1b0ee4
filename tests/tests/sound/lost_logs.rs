//! Lost, truncated, recreated and replaced logs: floors, anchors, receipt positions and the bypass scan.

use super::*;

// ---------------------------------------------------------------- item 3

/// Issue 19 item 3: the topic was recreated (or the cluster replaced): the
/// scan floor recorded from the old log (past offset 500) lies above the new
/// log's end. An attempt recorded without an anchor (before anchors were
/// kept) cannot tell that log from a truncated one: the range proves
/// nothing, the event stays unknown (no second copy) and the lost log is a
/// finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item3_a_floor_above_the_log_end_is_unavailable_not_absent(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 1_000);
    let mut t = f.pool.begin().await.unwrap();
    let first = emit_in(&mut t, "cmd-1", 1).await;
    t.commit().await.unwrap();
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    // The old log had reached offset 500 on this partition.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 500 WHERE event_id = $1", first.as_str(), None).await;
    let mut t = f.pool.begin().await.unwrap();
    let second = emit_in(&mut t, "cmd-2", 2).await;
    t.commit().await.unwrap();
    let claimed = f.store.claim_batch("w", 10, 1_000).await.unwrap();
    let a = f.store.register_attempt(&claimed[0].token).await.unwrap();
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref()), (501, Some(&first)));
    // As an attempt registered before the anchor was kept.
    tamper(&f.pool, "UPDATE outbox_attempts SET scan_anchor_event_id = NULL WHERE event_id = $1", second.as_str(), None).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.retried, r.rechecks), (0, 1), "a range above the log's end was taken for a proof of absence: {r:?}");
    assert_eq!(f.state(second.as_str()).await, EventState::DispatchUnknown);
    assert_eq!(f.findings("log_unavailable", second.as_str()).await, 1);
}

/// Issue 19, the broker replaced by an empty one: the receipts (and so an
/// attempt's scan floor) come from the old log, which had reached offset 4
/// of the partition; the new log holds other messages there, and the
/// attempt's message landed below the floor, at offset 3, its ACK lost.
/// The floor's anchor (the event whose receipt held offset 4) is not at
/// offset 4 of this log, so the lookup reads the log from its start and
/// finds the message: the event is published from it, nothing is sent
/// again. (Before: the scan started at the old floor, 5, read [5, 7),
/// called the event absent and sent a second copy.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_replaced_a_floor_from_the_lost_log_does_not_hide_a_message_below_it(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 1_000);
    // Three events at offsets 0..2 of partition 0.
    let mut orders: Vec<String> = Vec::new();
    for _ in 0..3 {
        let not: Vec<&str> = orders.iter().map(String::as_str).collect();
        let o = order_on(&f, 0, &not);
        orders.push(o);
        create_order(&f.pool, orders.last().unwrap(), 1).await;
        assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    }
    let last: String = sqlx::query_scalar("SELECT event_id FROM outbox_publish_receipts WHERE partition = 0 AND \"offset\" = 2").fetch_one(&f.pool).await.unwrap();
    // The old log had that event at offset 4.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 4 WHERE event_id = $1", &last, None).await;
    let not: Vec<&str> = orders.iter().map(String::as_str).collect();
    let b_order = order_on(&f, 0, &not);
    let (b, a) = f.registered(&b_order, 1_000).await;
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref().map(|e| e.as_str())), (5, Some(last.as_str())));
    // Its message lands at offset 3 (below the floor); the ACK is lost.
    let lost_ack = f.send_late(&b, &a).await;
    assert_eq!(lost_ack.offset, 3);
    // Other events fill offsets 4..6 of the new log.
    for _ in 0..3 {
        let mut not: Vec<&str> = orders.iter().map(String::as_str).collect();
        not.push(&b_order);
        let o = order_on(&f, 0, &not);
        orders.push(o);
        create_order(&f.pool, orders.last().unwrap(), 1).await;
        d.dispatch_once("w2").await.unwrap();
    }
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    assert_eq!(f.state(b.envelope.event_id.as_str()).await, EventState::DispatchUnknown);
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 0, "the event was sent again while its message sits in the new log: {r:?}");
    assert_eq!(f.state(b.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.receipt_offset(b.envelope.event_id.as_str()).await, 3);
    assert_eq!(f.log_of(b.envelope.event_id.as_str()), 1);
}

/// The broker replaced, and the new log holds the floor's anchor event at
/// the anchor offset, written there by another attempt (a paused sender's
/// late write reached the new log): the same event, another message. The
/// anchor names the attempt whose receipt held the offset, so the lookup
/// takes this log for another one, reads it from its start and finds the
/// attempt's message below the floor. (Before: checked by event alone, the
/// anchor held, the scan started at the floor, proved the event absent
/// and sent it again; seed 495754 of the 1,000,000-trace gate.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_replaced_the_anchor_event_by_another_attempt_at_the_anchor_offset_is_another_log(pool: PgPool) {
    let f = fixture(pool).await;
    // L: published at offset 1 of the old log by its attempt X (that log is gone).
    let l_order = order_on(&f, 0, &[]);
    let (l, x) = f.registered(&l_order, 1_000).await;
    let old = f.receipt(&l, &x, 0, 1);
    assert_eq!(f.store.accept_dispatch_receipt(&old).await.unwrap().state, EventState::Published);
    // B registers past it: floor 2, anchored at L's receipt (L, X).
    let b_order = order_on(&f, 0, &[&l_order]);
    let (b, a) = f.registered(&b_order, 1_000).await;
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref(), a.scan_anchor_attempt.as_ref()), (2, Some(&l.envelope.event_id), Some(&x.attempt_id)));
    // The new log: B's message at offset 0 (its ACK lost), then L's
    // message of another attempt Y at offset 1, the anchor offset.
    assert_eq!(f.send_late(&b, &a).await.offset, 0);
    let y = outbox_core::AttemptRecord { attempt_id: outbox_core::AttemptId::generate(7), ..x.clone() };
    assert_eq!(f.send_late(&l, &y).await.offset, 1);
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 0, "B was sent again while its message sits below the floor: {r:?}");
    assert_eq!(f.state(b.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.receipt_offset(b.envelope.event_id.as_str()).await, 0);
    assert_eq!(f.log_of(b.envelope.event_id.as_str()), 1);
}

/// Issue 19, the broker replaced by an empty one, shorter than the old
/// log: the floor (past the old log's offset 500) is above the new log's
/// end, so its anchor is not there; the new log is read whole. An
/// attempt whose message is not in it (it went to the lost log, or never
/// left) is proven absent from every log there is, once nothing can be in
/// flight, and retried to the same destination; one that is in it is found.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_replaced_a_floor_past_the_new_logs_end_reads_the_new_log_whole(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 1_000);
    let first_order = order_on(&f, 0, &[]);
    let first = create_order(&f.pool, &first_order, 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 500 WHERE event_id = $1", first.event_id().as_str(), None).await;
    // One attempt sends (ACK lost), one never does.
    let sent_order = order_on(&f, 0, &[&first_order]);
    let (sent, a1) = f.registered(&sent_order, 1_000).await;
    assert_eq!(a1.scan_from_offset, 501);
    f.send_late(&sent, &a1).await;
    let (silent, a2) = f.registered(&order_on(&f, 0, &[&first_order, &sent_order]), 1_000).await;
    assert_eq!(a2.scan_anchor.as_ref(), Some(first.event_id()));
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.published, r.retried), (1, 1), "{r:?}");
    assert_eq!(f.state(sent.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.log_of(sent.envelope.event_id.as_str()), 1);
    assert_eq!(f.state(silent.envelope.event_id.as_str()).await, EventState::RetryClaimed);
    assert_eq!(f.findings("log_unavailable", silent.envelope.event_id.as_str()).await, 0);
}

/// Issue 19 item 3, at the adapter: a lower bound above the high watermark
/// is Unavailable, the bound at the end is an empty range (Absent).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item3_lookup_of_a_range_past_the_end_of_the_log_is_unavailable(pool: PgPool) {
    let f = fixture(pool).await;
    let dest = outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32).resolve("t", "order", "o-1").unwrap();
    let id = outbox_core::EventId::generate(1);
    assert_eq!(f.broker.lookup(&dest, &id, &outbox_core::ScanFrom::at(0)).await, outbox_core::LookupOutcome::Absent);
    match f.broker.lookup(&dest, &id, &outbox_core::ScanFrom::at(10)).await {
        outbox_core::LookupOutcome::Unavailable(why) => assert!(outbox_producer::kafka::is_log_incomplete(&why), "{why}"),
        other => panic!("a lower bound above the log's end answered {other:?}"),
    }
}

/// Issue 19 item 4: after the log was replaced, a fresh ACK lands at a
/// position an old receipt (of another event) still claims. Offsets are
/// unique within one log, so the old receipt's log is gone: its lost
/// position is a finding, and the new receipt is accepted one position
/// epoch above it (before: refused, its event never published, its key
/// blocked), with the other receipts of the batch.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_a_receipt_colliding_with_a_lost_position_does_not_drop_its_batch(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 5_000);
    let old_id = order_on(&f, 0, &[]);
    let old = create_order(&f.pool, &old_id, 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    // The old log's receipt claims offset 1 of partition 0, where the next message will land.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 1 WHERE event_id = $1", old.event_id().as_str(), None).await;
    let colliding_id = order_on(&f, 0, &[&old_id]);
    let other_id = order_on(&f, 1, &[]);
    let colliding = create_order(&f.pool, &colliding_id, 1).await;
    let other = create_order(&f.pool, &other_id, 1).await;
    let report = d.dispatch_once("w").await.expect("one colliding receipt failed the whole batch");
    assert_eq!(report.published, 2, "{report:?}");
    assert_eq!(f.state(other.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.state(colliding.event_id().as_str()).await, EventState::Published, "a genuine ACK at a lost position was refused");
    assert_eq!(f.findings("receipt_position_lost", old.event_id().as_str()).await, 1);
    let at_1: Vec<(String, i32)> =
        sqlx::query_as("SELECT event_id, position_epoch FROM outbox_publish_receipts WHERE partition = 0 AND \"offset\" = 1 ORDER BY position_epoch").fetch_all(&f.pool).await.unwrap();
    assert_eq!(at_1, vec![(old.event_id().to_string(), 0), (colliding.event_id().to_string(), 1)]);
    // The next attempt on the partition anchors its floor on the newest receipt there.
    let (_, a) = f.registered(&order_on(&f, 0, &[&old_id, &colliding_id]), 5_000).await;
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref()), (2, Some(colliding.event_id())));
    // The report names the lost log.
    let report = outbox_producer::report::build_report(&f.pool, &outbox_producer::report::ReportOptions::at(outbox_core::Clock::now_ms(&f.clock))).await.unwrap();
    let lost = outbox_producer::report::LostLog {
        cluster_id: f.broker.cluster_id().to_owned(),
        topic: TOPIC.into(),
        topic_id: None,
        partition: 0,
        receipts_lost: 1,
        first_offset: 1,
        last_offset: 1,
    };
    assert_eq!(report.lost_logs, vec![lost]);
    assert!(report.to_text().contains(&format!("lost log {}/{TOPIC}/0: 1 receipts (offsets 1..1)", f.broker.cluster_id())), "{}", report.to_text());
    // The bypass scan reads the same at 0/1: the newer epoch's message, so
    // the older receipt lost its log (it is not one that never matched).
    f.reconciler().compare_once().await.unwrap();
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost' AND event_id = $1")
        .bind(old.event_id().as_str())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(detail.contains("is gone (topic recreated, cluster replaced)") && !detail.contains("never matched"), "the scan did not judge it a lost log: {detail}");
}

/// A topic deleted and created again under the same name starts a new log
/// at offset 0, under another topic id. An event frozen for the new topic
/// (destination.v2 with its id) lands at a position an event of the old
/// topic (the old id) holds a receipt for: another log, so its receipt is
/// accepted too, and its attempt's scan floor counts the new log's receipts
/// only. A receipt at that position under the same topic id proves that
/// log lost its position: the lost position is a finding, the receipt is
/// accepted one position epoch above.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipts_of_a_recreated_topic_do_not_collide_with_the_old_logs(pool: PgPool) {
    let f = fixture(pool).await;
    let current = f.broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let old = if current == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = |id: &str| outbox_core::RoutePolicy { topic_id: Some(id.to_owned()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    let receipt_at = |c: &ClaimedEvent, a: &outbox_core::AttemptRecord, offset: i64| {
        headers::parse(&outgoing_message(c, a).headers).unwrap().receipt(f.broker.cluster_id(), TOPIC, 0, offset, Some(c.destination.routing_key.as_bytes()), &c.payload)
    };
    // The old topic: an event frozen with the old id, published at 0/0 of the old log.
    outbox_producer::routes::revise(&f.pool, &policy(old)).await.unwrap();
    let (on_old, a) = f.registered(&order_on(&f, 0, &[]), 5_000).await;
    assert_eq!(on_old.destination.topic_id.as_deref(), Some(old));
    let out = f.store.accept_dispatch_receipt(&receipt_at(&on_old, &a, 0)).await.unwrap();
    assert_eq!(out.state, EventState::Published);

    // The topic recreated: the route learns the new id; the next event lands at 0/0 of the new log.
    outbox_producer::routes::revise(&f.pool, &policy(&current)).await.unwrap();
    let new_order = order_on(&f, 0, &[&on_old.envelope.aggregate_id]);
    let on_new = create_order(&f.pool, &new_order, 1).await;
    let report = f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap();
    assert_eq!(report.published, 1, "the new log's receipt was refused as a collision with the old log's: {report:?}");
    assert_eq!(f.state(on_new.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.findings("receipt_position_lost", on_old.envelope.event_id.as_str()).await, 0);
    let at_0: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT event_id, topic_id FROM outbox_publish_receipts WHERE partition = 0 AND \"offset\" = 0 ORDER BY topic_id = $1").bind(old).fetch_all(&f.pool).await.unwrap();
    assert_eq!(at_0, vec![(on_new.event_id().to_string(), Some(current.clone())), (on_old.envelope.event_id.to_string(), Some(old.to_owned()))]);
    let floor: i64 = sqlx::query_scalar("SELECT scan_from_offset FROM outbox_attempts WHERE event_id = $1").bind(on_new.event_id().as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(floor, 0, "the new log's scan floor counted the old log's receipts");

    // The same topic id at the same position: that log lost the position.
    let (again, a) = f.registered(&order_on(&f, 0, &[&on_old.envelope.aggregate_id, &new_order]), 5_000).await;
    let out = f.store.accept_dispatch_receipt(&receipt_at(&again, &a, 0)).await.unwrap();
    assert!(matches!(out.decision, outbox_core::ReceiptDecision::Accept { .. }), "{out:?}");
    assert_eq!(f.state(again.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.findings("receipt_position_lost", on_new.event_id().as_str()).await, 1);
    let epoch: i32 = sqlx::query_scalar("SELECT position_epoch FROM outbox_publish_receipts WHERE event_id = $1").bind(again.envelope.event_id.as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(epoch, 1);
}

/// After a recreation the bypass scan reads the new log: the old log's
/// receipt at a position the new log's event now holds is a lost position
/// (that log is gone); the new log's own receipt there is its message,
/// neither lost nor an unrecorded copy.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_bypass_scan_tells_the_logs_of_a_recreated_topic_apart(pool: PgPool) {
    let f = fixture(pool).await;
    let current = f.broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let old = if current == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = |id: &str| outbox_core::RoutePolicy { topic_id: Some(id.to_owned()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    outbox_producer::routes::revise(&f.pool, &policy(old)).await.unwrap();
    let (on_old, a) = f.registered(&order_on(&f, 0, &[]), 5_000).await;
    let receipt = headers::parse(&outgoing_message(&on_old, &a).headers).unwrap().receipt(f.broker.cluster_id(), TOPIC, 0, 0, Some(on_old.destination.routing_key.as_bytes()), &on_old.payload);
    assert_eq!(f.store.accept_dispatch_receipt(&receipt).await.unwrap().state, EventState::Published);
    outbox_producer::routes::revise(&f.pool, &policy(&current)).await.unwrap();
    let on_new = create_order(&f.pool, &order_on(&f, 0, &[&on_old.envelope.aggregate_id]), 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);

    let c = f.reconciler().compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.unrecorded_copy, c.divergent_copy), (0, 0, 0), "{c:?}");
    assert_eq!(f.findings("receipt_position_lost", on_old.envelope.event_id.as_str()).await, 1);
    assert_eq!(f.findings("receipt_position_lost", on_new.event_id().as_str()).await, 0);
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost'").fetch_one(&f.pool).await.unwrap();
    assert!(detail.contains(&format!("(topic id {old})")) && detail.contains(&format!("of topic id {current}")), "{detail}");
}

/// Issue 19 item 4: one event the reconciler cannot handle (its frozen
/// destination is unreadable) does not abort the round: it is quarantined,
/// the other event is resolved.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_one_bad_event_does_not_abort_the_reconcile_round(pool: PgPool) {
    let f = fixture(pool).await;
    let (bad, _) = f.registered("o-bad", 1_000).await;
    let claimed = f.store.claim_batch("w", 10, 1_000).await.unwrap();
    let good = claimed.into_iter().next().map(|c| c.envelope.event_id);
    let good = match good {
        Some(g) => g,
        None => {
            let (g, _) = f.registered("o-good", 1_000).await;
            g.envelope.event_id
        }
    };
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    tamper(&f.pool, "UPDATE outbox_envelopes SET destination_canonical = 'garbage' WHERE event_id = $1", bad.envelope.event_id.as_str(), None).await;
    let r = f.reconciler().resolve_unknown_once().await.expect("one unreadable event aborted the round");
    assert_eq!(r.retried, 1, "{r:?}");
    assert_eq!(f.state(good.as_str()).await, EventState::RetryClaimed);
    assert_eq!(f.state(bad.envelope.event_id.as_str()).await, EventState::Quarantined);
}

/// Issue 19 item 4: the bypass scan finds a receipt whose position now holds
/// another message (the log was replaced): a finding, named after the event
/// whose receipt lost its position.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_the_bypass_scan_reports_a_receipt_whose_position_was_lost(pool: PgPool) {
    let f = fixture(pool).await;
    let id = order_on(&f, 0, &[]);
    let e = create_order(&f.pool, &id, 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    assert_eq!(rec.compare_once().await.unwrap().total(), 0);
    // The receipt says offset 1; a message without an eventId lands there.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 1 WHERE event_id = $1", e.event_id().as_str(), None).await;
    let stray = outbox_core::OutgoingMessage { topic: TOPIC.into(), partition: 0, key: b"k".to_vec(), payload: b"{}".to_vec(), headers: vec![] };
    assert!(matches!(f.broker.send(stray).await, SendOutcome::Acked { offset: 1, .. }));
    rec.compare_once().await.unwrap();
    assert_eq!(f.findings("receipt_position_lost", e.event_id().as_str()).await, 1);
}

/// Defect (outside read): a receipt row forged by the dispatcher role (its
/// grants allow inserting receipts and publishing events) at a position
/// that holds another event's message was reported as
/// `receipt_position_lost` with the cause "the log it was recorded in is
/// gone", sending the operator to the runbook of a recreated topic. The
/// log was never replaced: the bypass scan's anchor holds, and the
/// position still holds the very message the other event's receipt
/// recorded there, in an earlier position epoch of the same log. The
/// forged receipt (it must take a later epoch: positions are unique per
/// epoch) never matched the log, and its event's message was never
/// written: the finding names that cause.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_forged_receipt_at_another_messages_position_is_not_reported_as_a_lost_log(pool: PgPool) {
    let f = fixture(pool).await;
    sqlx::raw_sql(ROLES_SQL).execute(&f.pool).await.expect("roles.sql applies");
    let d = f.dispatcher(&f.store, 5_000);
    let first = create_order(&f.pool, &order_on(&f, 0, &[]), 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    assert_eq!(rec.compare_once().await.unwrap().total(), 0);
    // The next message of the partition, published genuinely at 0/1.
    let not = [first.envelope.aggregate_id.as_str()];
    let holder = create_order(&f.pool, &order_on(&f, 0, &not), 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    assert_eq!(f.receipt_offset(holder.event_id().as_str()).await, 1);
    // An event claimed and registered, never sent.
    let not = [first.envelope.aggregate_id.as_str(), holder.envelope.aggregate_id.as_str()];
    let (forged, a) = f.registered(&order_on(&f, 0, &not), 5_000).await;
    let id = forged.envelope.event_id.as_str().to_owned();

    // As the dispatcher role: a receipt for it at 0/1 (epoch 0 is the
    // holder's there) and the event PUBLISHED, triggers and all.
    let now = outbox_core::Clock::now_ms(&f.clock);
    let mut tx = f.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL ROLE outbox_dispatcher").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_publish_receipts (event_id, envelope_generation, attempt_id, cluster_id, topic, topic_id, partition, \"offset\",
                                              payload_digest, destination_digest, accepted_at_ms, position_epoch)
         VALUES ($1, 1, $2, $3, $4, NULL, 0, 1, $5, $6, $7, 1)",
    )
    .bind(&id)
    .bind(a.attempt_id.as_str())
    .bind(f.broker.cluster_id())
    .bind(TOPIC)
    .bind(&forged.envelope.payload_digest)
    .bind(&forged.destination_digest)
    .bind(now)
    .execute(&mut *tx)
    .await
    .expect("the dispatcher role may insert a receipt");
    sqlx::query(
        "UPDATE outbox_events SET state = 'PUBLISHED', claim_owner = NULL, lease_until_ms = NULL, published_at_ms = $2, state_since_ms = $2
         WHERE event_id = $1",
    )
    .bind(&id)
    .bind(now)
    .execute(&mut *tx)
    .await
    .expect("the dispatcher role may publish an event");
    tx.commit().await.unwrap();
    assert_eq!(f.state(&id).await, EventState::Published);
    assert_eq!(f.log_of(&id), 0, "the forged receipt's event was never sent");

    // The bypass scan reads 0/1 (its anchor, 0/0, holds: the same log).
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.unrecorded_copy, c.divergent_copy), (0, 0, 0), "{c:?}");
    assert_eq!(f.findings("receipt_position_lost", holder.event_id().as_str()).await, 0, "the holder's receipt matches the log");
    assert_eq!(f.findings("receipt_position_lost", &id).await, 1, "the forged receipt was not reported");
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost' AND event_id = $1")
        .bind(&id)
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(detail.contains("never matched the log") && detail.contains("forged or corrupted"), "the finding names another cause: {detail}");
    assert!(!detail.contains("is gone"), "the finding blames a lost log: {detail}");
    assert!(detail.contains(&format!("event {}'s message", holder.event_id())), "{detail}");
}

/// Issue 19 item 4: the broker came back with a shorter log: a receipt
/// recorded beyond the log's end names a position that is gone: a finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_a_receipt_beyond_the_log_end_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 50 WHERE event_id = $1", e.event_id().as_str(), None).await;
    f.clock.advance(10_000);
    f.reconciler().compare_once().await.unwrap();
    assert_eq!(f.findings("receipt_position_lost", e.event_id().as_str()).await, 1);
}

/// Issue 19 item 4, as the chaos drill found it: more receipts beyond the
/// log's end than one round reports (`max_findings_per_kind`) are all
/// reported after enough rounds, not the same lowest ones again and again.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_every_receipt_beyond_the_log_end_is_reported_in_time(pool: PgPool) {
    let f = fixture(pool).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let e = create_order(&f.pool, &format!("o-{i}"), 1).await;
        ids.push(e.event_id().to_string());
    }
    let d = f.dispatcher(&f.store, 5_000);
    let mut published = 0;
    while published < 5 {
        let r = d.dispatch_once("w").await.unwrap();
        assert!(r.claimed > 0, "nothing left to claim at {published} published");
        published += r.published;
    }
    // The broker came back empty: every receipt lies beyond the new log's end.
    for id in &ids {
        tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = \"offset\" + 100 WHERE event_id = $1", id, None).await;
    }
    f.clock.advance(10_000);
    let cfg = ReconcilerConfig {
        owner: "r".into(),
        max_findings_per_kind: 2,
        retry: RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() },
        ..Default::default()
    };
    let rec = Reconciler::new(f.store.clone(), f.broker.clone(), cfg).unwrap();
    for _ in 0..3 {
        rec.compare_once().await.unwrap();
    }
    for id in &ids {
        assert_eq!(f.findings("receipt_position_lost", id).await, 1, "{id}'s lost position was never reported in 3 rounds of 2");
    }
}

/// Issue 19 item 4: the bypass scan's cursor from the old log lies beyond
/// the new log's end; the new log is read from its start rather than never.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_the_bypass_scan_reads_a_replaced_log_from_its_start(pool: PgPool) {
    let f = fixture(pool).await;
    create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    rec.compare_once().await.unwrap();
    sqlx::query("UPDATE outbox_scan_cursors SET next_offset = 900").execute(&f.pool).await.unwrap();
    // A bypass publish lands in the new log, below the old cursor.
    let stray = outbox_core::OutgoingMessage { topic: TOPIC.into(), partition: 0, key: b"k".to_vec(), payload: b"{}".to_vec(), headers: vec![] };
    assert!(matches!(f.broker.send(stray).await, SendOutcome::Acked { .. }));
    rec.compare_once().await.unwrap();
    let c = rec.compare_once().await.unwrap();
    let bypass = f.count("SELECT count(*) FROM outbox_findings WHERE kind = 'bypass_publish'").await;
    assert_eq!(bypass, 1, "the bypass publish in the new log was never read: {c:?}");
}

/// Issue 47 item 2: the topic came back with fewer partitions than its
/// route froze (auto-created with the broker's default after a broker
/// replacement). A receipt on a partition the topic no longer has names a
/// position that is gone, like a receipt beyond a log's end: a
/// `receipt_position_lost` finding naming the partition and the topic's
/// count, not only the topic's `partition_count_changed`.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_receipt_on_a_partition_the_topic_no_longer_has_is_a_lost_position(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    assert_eq!(rec.compare_once().await.unwrap().total(), 0);
    // The route froze 6 partitions; the receipt names partition 4, which
    // the topic (3 partitions) no longer has.
    route(&f.pool, ORDER_CREATED, f.broker.cluster_id(), TOPIC, 6).await;
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET partition = 4 WHERE event_id = $1", e.event_id().as_str(), None).await;
    f.clock.advance(10_000);
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.partition_count_changed, 1, "{c:?}");
    assert_eq!(f.findings("receipt_position_lost", e.event_id().as_str()).await, 1, "{c:?}");
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost' AND event_id = $1")
        .bind(e.event_id().as_str())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(detail.contains(&format!("{TOPIC}/4@")) && detail.contains("has 3 partitions"), "{detail}");
    // Round after round: the same finding.
    rec.compare_once().await.unwrap();
    assert_eq!(f.count("SELECT count(*) FROM outbox_findings WHERE kind = 'receipt_position_lost'").await, 1);
}
