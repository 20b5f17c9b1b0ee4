//! The drill's checker, proven on made-up snapshots: a clean one passes, and
//! each defect the drill exists to find turns it to FAIL with evidence.

use outbox_chaos::check::{check, BusinessRow, ConsumerSide, EventRow, Finding, LogRecord, Receipt, Replacement, Snapshot};
use outbox_chaos::snapshot::digest;

fn payload(id: &str) -> Vec<u8> {
    format!("{{\"order\":\"{id}\"}}").into_bytes()
}

/// `n` events on one key `k`, versions 1..=n, each published at offset i-1
/// of partition 0, consumed once.
fn clean(n: usize) -> Snapshot {
    let mut s = Snapshot { requested_events: n as u64, ..Snapshot::default() };
    let mut consumer = ConsumerSide { consumer_id: "c".into(), ..ConsumerSide::default() };
    for i in 1..=n {
        let id = format!("evt-{i}");
        let order = format!("o-{i}");
        s.business.push(BusinessRow { order_id: order.clone(), aggregate_id: "agg".into(), version: i as i64, event_id: id.clone() });
        s.events.push(EventRow {
            event_id: id.clone(),
            state: "PUBLISHED".into(),
            aggregate_id: "agg".into(),
            aggregate_version: i as i64,
            routing_key: "k".into(),
            payload_digest: digest(&payload(&order)),
            was_unknown: false,
            first_attempt_at_ms: Some(1_000),
        });
        s.receipts.push(Receipt { event_id: id.clone(), topic: "t".into(), partition: 0, offset: i as i64 - 1, attempt_started_at_ms: 1_000 });
        s.log.push(LogRecord { topic: "t".into(), partition: 0, offset: i as i64 - 1, event_id: Some(id.clone()), value_digest: digest(&payload(&order)) });
        consumer.effects.push(id.clone());
        consumer.receipts.push(id);
    }
    s.consumers.push(consumer);
    s
}

fn failures(s: &Snapshot) -> Vec<&'static str> {
    let v = check(s);
    for line in &v.evidence {
        eprintln!("{line}");
    }
    v.failures.keys().copied().collect()
}

#[test]
fn a_clean_snapshot_passes() {
    let v = check(&clean(5));
    assert!(v.pass(), "{:?}", v.evidence);
    assert_eq!((v.figures.published, v.figures.duplicates_in_log, v.figures.duplicate_effects, v.figures.effects), (5, 0, 0, 5));
}

#[test]
fn an_unaccounted_duplicate_copy_fails() {
    let mut s = clean(3);
    // A second copy of evt-2 at offset 3: no duplicate receipt, no finding.
    s.log.push(LogRecord { topic: "t".into(), partition: 0, offset: 3, event_id: Some("evt-2".into()), value_digest: s.log[1].value_digest.clone() });
    assert_eq!(failures(&s), vec!["unaccounted_copy"]);
    // Recorded as a duplicate transport receipt, it is accounted for.
    s.duplicate_receipts.push(Receipt { event_id: "evt-2".into(), topic: "t".into(), partition: 0, offset: 3, attempt_started_at_ms: 1_000 });
    let v = check(&s);
    assert!(v.pass(), "{:?}", v.evidence);
    assert_eq!((v.figures.duplicates_in_log, v.figures.duplicate_receipts_in_log), (1, 1));
    // Or named by the reconciler's finding.
    s.duplicate_receipts.clear();
    s.findings.push(Finding { kind: "unrecorded_copy".into(), event_id: "evt-2".into(), detail: "a byte-identical copy of the published event at c/t/0@3, neither ...".into() });
    let v = check(&s);
    assert!(v.pass(), "{:?}", v.evidence);
    assert_eq!(v.figures.copies_named_by_findings, 1);
}

#[test]
fn a_missing_event_fails() {
    let mut s = clean(3);
    // The business row of evt-2 committed, its event is gone.
    s.events.remove(1);
    s.receipts.remove(1);
    let f = failures(&s);
    assert!(f.contains(&"business_row_without_event"), "{f:?}");
    // An event still PENDING at the end is a failure too.
    let mut s = clean(3);
    s.events[2].state = "PENDING".into();
    s.receipts.pop();
    s.log.pop();
    assert_eq!(failures(&s), vec!["not_published"]);
    // Fewer business rows than requested.
    let mut s = clean(3);
    s.requested_events = 4;
    assert_eq!(failures(&s), vec!["business_rows"]);
}

#[test]
fn a_second_effect_fails() {
    let mut s = clean(3);
    s.consumers[0].effects.push("evt-1".into());
    let v = check(&s);
    assert!(!v.pass());
    assert_eq!(v.figures.duplicate_effects, 1);
    assert!(v.failures.contains_key("duplicate_effect"), "{:?}", v.failures);
    // An event of the current log that the consumer never applied.
    let mut s = clean(3);
    s.consumers[0].effects.pop();
    s.consumers[0].receipts.pop();
    assert_eq!(failures(&s), vec!["not_consumed"]);
}

#[test]
fn a_key_out_of_order_fails() {
    let mut s = clean(3);
    // Versions 2 and 3 swapped in the log (and their receipts).
    s.log[1].offset = 2;
    s.log[2].offset = 1;
    s.receipts[1].offset = 2;
    s.receipts[2].offset = 1;
    assert_eq!(failures(&s), vec!["key_out_of_order"]);
}

#[test]
fn a_receipt_whose_position_holds_other_bytes_fails() {
    let mut s = clean(2);
    s.log[1].value_digest = digest(b"tampered");
    assert_eq!(failures(&s), vec!["receipt_position_other_bytes"]);
}

#[test]
fn a_message_lost_with_the_replaced_broker_counts_only_when_reported() {
    let mut s = clean(3);
    // evt-1 was published to the old log; the new log holds evt-2 and evt-3
    // at offsets 0 and 1 (their receipts say so), evt-1's receipt says 0 too.
    s.replacement = Some(Replacement { old_killed_at_ms: 5_000, new_up_at_ms: 6_000 });
    s.log.remove(0);
    s.log[0].offset = 0;
    s.log[1].offset = 1;
    s.receipts[0] = Receipt { event_id: "evt-1".into(), topic: "t".into(), partition: 0, offset: 0, attempt_started_at_ms: 1_000 };
    s.receipts[1].offset = 0;
    s.receipts[1].attempt_started_at_ms = 7_000;
    s.receipts[2].offset = 1;
    s.receipts[2].attempt_started_at_ms = 7_000;
    // Unreported, it is a failure...
    assert_eq!(failures(&s), vec!["lost_with_broker_unreported"]);
    // ... reported by the product, it is counted, not failed.
    s.findings.push(Finding { kind: "receipt_position_lost".into(), event_id: "evt-1".into(), detail: "its receipt's position c/t/0@0 now holds ...".into() });
    let v = check(&s);
    assert!(v.pass(), "{:?}", v.evidence);
    assert_eq!((v.figures.lost_with_broker, v.figures.lost_unconsumed), (1, 0));
    // Without a replacement the same receipt is a plain failure.
    s.replacement = None;
    assert_eq!(failures(&s), vec!["receipt_position_not_in_log"]);
}

#[test]
fn an_unknown_left_open_fails_unless_reported() {
    let mut s = clean(3);
    s.events[2].state = "DISPATCH_UNKNOWN".into();
    s.events[2].was_unknown = true;
    s.receipts.pop();
    s.log.pop();
    s.consumers[0].effects.pop();
    s.consumers[0].receipts.pop();
    assert_eq!(failures(&s), vec!["unknown_unresolved"]);
    // Reported, but no broker was replaced: the log can decide it.
    s.findings.push(Finding { kind: "log_unavailable".into(), event_id: "evt-3".into(), detail: "the lower bound is above the log's end".into() });
    assert_eq!(failures(&s), vec!["unknown_unresolved"]);
    // Reported, sent before the replacement broker was up: the runbook's case.
    s.replacement = Some(Replacement { old_killed_at_ms: 1_500, new_up_at_ms: 2_000 });
    let v = check(&s);
    assert!(v.pass(), "{:?}", v.evidence);
    assert_eq!((v.figures.unknown, v.figures.unknown_reported), (1, 1));
    // Sent only to the new broker: not excused.
    s.events[2].first_attempt_at_ms = Some(3_000);
    assert_eq!(failures(&s), vec!["unknown_unresolved"]);
}
