//! The store conformance suite of `outbox_memory::conformance`, against the in-memory store.

use outbox_sim::{now, MemoryHarness};

#[test]
fn memory_store_passes_the_conformance_suite() {
    let h = MemoryHarness::new();
    let results = now(outbox_memory::conformance::run_all(&h));
    assert!(results.len() >= 10, "the suite has {} scenarios", results.len());
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "conformance failures:\n{}", failed.join("\n"));
}

/// The stream-mode run id (`run_all_as`): `OUTBOX_CONFORMANCE_RUN` or the fixed one.
fn seed() -> u64 {
    std::env::var("OUTBOX_CONFORMANCE_RUN").ok().and_then(|s| s.parse().ok()).unwrap_or(outbox_memory::conformance::STREAM_RUN)
}

#[test]
fn memory_store_in_stream_mode_passes_the_conformance_suite() {
    let h = MemoryHarness::stream();
    let results = now(outbox_memory::conformance::run_all_as(&h, seed()));
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "conformance failures in stream mode:\n{}", failed.join("\n"));
}

#[test]
fn the_suite_can_run_twice_on_one_store() {
    // Scenarios use unique keys and hand foreign claims back, so a second
    // run (a reused database) passes too.
    let h = MemoryHarness::new();
    for _ in 0..2 {
        for (n, r) in now(outbox_memory::conformance::run_all(&h)) {
            assert!(r.is_ok(), "{n}: {r:?}");
        }
    }
}

/// Entering DISPATCH_UNKNOWN makes an event due for the reconciler at once,
/// as PostgreSQL's store does, even when a recheck had been scheduled
/// later: here an operator took the event (as a migration does) and let
/// the lease expire.
#[test]
fn an_expired_reconcile_lease_makes_the_event_due_at_once() {
    use outbox_memory::conformance::Harness;
    use outbox_core::{EventState, OutboxStore, ReconcileDecision, RecheckReason};
    let h = MemoryHarness::new();
    let s = h.store();
    now(async {
        let id = h.emit("due-1", "o-due", b"{}").await;
        let claimed = s.claim_batch("w", 10, 1_000).await.unwrap().pop().expect("claimed");
        let attempt = s.register_attempt(&claimed.token).await.unwrap();
        s.report_unknown(&claimed.token, &attempt.attempt_id, "timeout").await.unwrap();
        let task = s.begin_reconcile("r", 10, 1_000).await.unwrap().pop().expect("due after the report");
        let later = h.now_ms() + 60_000;
        let recheck = ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: later };
        s.finish_reconcile(&task.token, &recheck).await.unwrap();
        assert!(s.begin_reconcile("r", 10, 1_000).await.unwrap().is_empty(), "not due before its recheck");

        s.begin_reconcile_event("operator", &id, 1_000).unwrap().expect("taken by the operator");
        h.advance_ms(2_000);
        s.expire_leases().await.unwrap();
        assert_eq!(s.event_state(&id).await.unwrap().0, EventState::DispatchUnknown);
        let due = s.begin_reconcile("r", 10, 1_000).await.unwrap();
        assert_eq!(due.len(), 1, "an expired lease leaves the event due now, not at the old recheck");
    });
}

/// `compare_every_rounds`: a running reconciler compares the three sets
/// on rounds 0, N, 2N, ... and resolves on every round; 0 is refused.
#[test]
fn the_reconciler_compares_every_nth_round() {
    use outbox_memory::conformance::{Harness, ScanLog};
    use outbox_producer::{Reconciler, ReconcilerConfig};
    let h = MemoryHarness::new();
    now(async {
        h.emit("every-1", "o-every", b"{}").await;
        let mut log = ScanLog { cluster_id: "sim-cluster".into(), topic: "orders".into(), ..Default::default() };
        let bypass = outbox_core::ScannedMessage { offset: 0, event_id: Some("evt-never-committed".into()), key: None, payload_digest: "sha256:x".into(), source: None, attempt_id: None, topic_id: None, receipt: None };
        log.partitions.insert(0, vec![bypass]);
        let cfg = |n| ReconcilerConfig { owner: "every".into(), compare_every_rounds: n, ..Default::default() };
        assert!(Reconciler::new(h.store().clone(), std::sync::Arc::new(log.clone()), cfg(0)).is_err(), "0 is refused");
        let r = Reconciler::new(h.store().clone(), std::sync::Arc::new(log.clone()), cfg(3)).expect("a valid config");
        let (_, skipped) = r.run_round(1).await.expect("round 1");
        assert_eq!((skipped.bypass_publish, skipped.scanned_messages), (0, 0), "round 1 does not compare");
        let (_, compared) = r.run_round(3).await.expect("round 3");
        assert_eq!((compared.bypass_publish, compared.scanned_messages), (1, 1), "round 3 compares");
    });
}

/// The deliberate defect `receipt-log-id-ignored` (retention and the
/// reconciler let a `destination.v1` receipt pass a watermark kept in
/// another log than the one the receipt names) turns the suite red on the
/// scenario `purge_holds_an_event_whose_receipt_names_another_log`.
#[test]
fn the_log_id_scenario_catches_a_receipts_log_id_ignored() {
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args(["memory_store_passes_the_conformance_suite", "--exact", "--test-threads", "1", "--nocapture"])
        .env(outbox_core::simulation::MUTATION_ENV, "receipt-log-id-ignored")
        .output()
        .expect("the test binary runs again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("running 1 test"), "the child ran no test: {text}");
    assert!(!out.status.success(), "the suite passed with the defect switched on\n{text}");
    assert!(text.contains("purge_holds_an_event_whose_receipt_names_another_log"), "{text}");
}
