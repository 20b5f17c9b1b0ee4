//! The gate passes on the real protocol, is deterministic per seed, and
//! turns red for every deliberate bug in the way the core is used.

use outbox_sim::{run_gate, run_trace, Mutation};

/// Traces per gate run in these tests (debug builds are slower than the release gate).
const TRACES: u64 = 3_000;

#[test]
fn unmutated_gate_passes() {
    let r = run_gate(1, TRACES, None, 0);
    assert!(r.pass(), "gate failed:\n{}\nfailing seeds {:?}", r.lines().join("\n"), r.failing_seeds);
    let f = &r.figures;
    assert_eq!(f.traces, TRACES);
    // The traces exercise what the gate is about.
    for (what, v) in [
        ("late_acks_total", f.late_acks_total),
        ("unknowns", f.unknowns),
        ("reconcile_retries", f.reconcile_retries),
        ("duplicate_receipts", f.duplicate_receipts),
        ("route_revisions", f.route_revisions),
        ("consumer_redeliveries", f.consumer_redeliveries),
        ("commands_retried_after_commit", f.commands_retried_after_commit),
        ("quarantined_injected", f.quarantined_injected),
        ("receipt_rollbacks", f.receipt_rollbacks),
        ("stalls", f.stalls),
        ("crashes", f.crashes),
        ("fenced_writes", f.fenced_writes),
        ("migrations", f.migrations),
        ("migrations_refused_unqueryable", f.migrations_refused_unqueryable),
        ("events_purged", f.events_purged),
        ("purges_held_by_consumers", f.purges_held_by_consumers),
        ("late_duplicates_after_purge", f.late_duplicates_after_purge),
    ] {
        assert!(v > 0, "no {what} in {TRACES} traces");
    }
    assert!(r.unknown_samples > 0);
}

#[test]
fn a_seed_replays_identically() {
    for seed in [1, 7, 4904, 91609] {
        let a = run_trace(seed, None, true);
        let b = run_trace(seed, None, true);
        assert_eq!(a.log, b.log, "seed {seed}");
        assert_eq!(a.figures, b.figures, "seed {seed}");
        assert_eq!(a.figures, run_trace(seed, None, false).figures, "logging changes the trace {seed}");
    }
}

#[test]
fn seeds_that_found_core_bugs_stay_green() {
    // 4904: memory store scan bound ignored the cluster (route revision to another cluster).
    // 91609: not-sent retry after a blind retry went PENDING, refusing the first attempt's late ACK.
    for seed in [4904, 10408, 39883, 44647, 83762, 91609, 105714, 128813, 135268] {
        let out = run_trace(seed, None, true);
        assert!(!out.failed(), "seed {seed}: {:?}", out.violations);
    }
}

fn assert_caught(m: Mutation) {
    let r = run_gate(1, TRACES, Some(m), 0);
    assert!(!r.pass(), "{} was not caught:\n{}", m.name(), r.lines().join("\n"));
    let counter = m.caught_by();
    let v = r.figures.get(counter).expect("counter exists");
    assert!(v > 0, "{} turned the gate red, but not through {counter}:\n{}", m.name(), r.lines().join("\n"));
    assert!(!r.failing_seeds.is_empty());
    // The failing seed replays to the same failure.
    let seed = r.failing_seeds[0];
    assert!(run_trace(seed, Some(m), true).failed(), "seed {seed} does not replay the failure");
}

#[test]
fn mutation_claim_fence_disabled_is_caught() {
    assert_caught(Mutation::ClaimFenceDisabled);
}

#[test]
fn mutation_ack_without_digest_check_is_caught() {
    assert_caught(Mutation::AckWithoutDigestCheck);
}

#[test]
fn mutation_retry_to_new_destination_is_caught() {
    assert_caught(Mutation::RetryToNewDestination);
}

#[test]
fn mutation_consumer_skips_receipt_is_caught() {
    assert_caught(Mutation::ConsumerSkipsReceipt);
}

#[test]
fn mutation_late_acks_dropped_is_caught() {
    assert_caught(Mutation::LateAcksDropped);
}

#[test]
fn mutation_emit_outside_transaction_is_caught() {
    assert_caught(Mutation::EmitOutsideTransaction);
}

#[test]
fn mutation_new_event_id_on_retry_is_caught() {
    assert_caught(Mutation::NewEventIdOnRetry);
}

#[test]
fn every_mutation_has_a_test() {
    assert_eq!(Mutation::ALL.len(), 7);
    for m in Mutation::ALL {
        assert_eq!(Mutation::parse(m.name()), Some(m));
    }
}
