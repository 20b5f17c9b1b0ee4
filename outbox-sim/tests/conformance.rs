//! The store conformance suite of `outbox_core::conformance`, against the in-memory store.

use outbox_sim::{now, MemoryHarness};

#[test]
fn memory_store_passes_the_conformance_suite() {
    let h = MemoryHarness::new();
    let results = now(outbox_core::conformance::run_all(&h));
    assert!(results.len() >= 10, "the suite has {} scenarios", results.len());
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "conformance failures:\n{}", failed.join("\n"));
}

#[test]
fn the_suite_can_run_twice_on_one_store() {
    // Scenarios use unique keys and hand foreign claims back, so a second
    // run (a reused database) passes too.
    let h = MemoryHarness::new();
    for _ in 0..2 {
        for (n, r) in now(outbox_core::conformance::run_all(&h)) {
            assert!(r.is_ok(), "{n}: {r:?}");
        }
    }
}
