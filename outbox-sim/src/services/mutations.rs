//! The mutation catalogue: deliberate defects in shipped code, each of
//! which the services gate must catch.

/// Deliberate defects in shipped code, each switched by
/// [`outbox_core::simulation::mutation_active`] at one line.
pub const SERVICE_MUTATIONS: [(&str, &str); 18] = [
    ("send-after-lease", "the dispatcher hands a message to the client after its claim's lease ran out"),
    ("bound-from-registration-clock", "the in-flight bound counts from the attempt's registration, not from the end of the lease it was sent under"),
    ("absence-from-truncated-log", "a lookup range below the log's start (or above its end) proves absence"),
    ("migration-unfenced", "the migration commit does not check that the row is still under the claim (reconcile claim, or claim generation) its proof was made under"),
    ("watermark-ignores-cluster", "retention matches a consumer's watermark to an event's log without comparing the cluster"),
    ("offset-before-commit", "the consumer's partition loop commits a batch's offset before its decisions commit"),
    ("redelivery-reapplied", "the consumer's processor applies a redelivered event again instead of answering with its receipt"),
    ("absent-attempt-ack-discarded", "a genuine ACK of an attempt closed ABSENT is rejected instead of competing for the slot and refuting the proof"),
    ("command-dedupe-disabled", "emit's command decision treats a retried command (its key already committed) as a new command"),
    ("purge-ignores-watermarks", "retention purges past the replay window without looking at the mandatory consumers' watermarks"),
    ("migration-without-proof", "the migration decision moves a DISPATCH_UNKNOWN event whatever the old target's lookup answered"),
    ("absence-across-holes", "a lookup range with offsets that hold no record (a compacted topic) proves absence"),
    ("consumer-skips-receipt", "the consumer's processor runs the handler without claiming (or writing) the (consumerId, eventId) receipt"),
    ("late-acks-dropped", "the dispatcher drops an ACK that arrives after its claim's lease ran out instead of recording it"),
    ("ack-without-digest-check", "acceptDispatchReceipt takes a receipt whose payload digest is not the frozen one (no quarantine)"),
    ("quarantine-resend-unproven", "the migration decision re-sends a QUARANTINED event under a new envelope generation whatever its attempts say (one whose genuine copy is in the old topic too)"),
    ("watermark-passes-gaps", "the consumer's watermark moves to the last offset decided plus one, past a range of offsets it never read (a group reset to latest, an offset out of range); the consumer's own test `processor::the_gap_test_catches_a_watermark_that_passes_a_gap` catches it too"),
    ("watermark-signature-unchecked", "the watermark topic's reader applies a record of a consumer it holds keys for without checking its signature: a forged record moves the consumer's watermark"),
];

/// Deliberate defects in the insert-only stream's shipped decisions
/// (`outbox_core::stream`), each caught by the gate over the stream path
/// (`outbox-sim --mode stream`).
pub const STREAM_MUTATIONS: [(&str, &str); 4] = [
    ("stream-cut-by-position", "a batch holds the transactions above the last cut's horizon instead of those completed since the last cut: a transaction that took its id before the cut and committed after it is in no batch"),
    ("stream-takeover-leaves-sending", "a takeover of an expired bucket lease leaves the open batch's registered events SENDING instead of making them DISPATCH_UNKNOWN"),
    ("stream-two-sends-per-key", "a batch hands out a key's next event while the key's previous send is still in flight"),
    ("stream-cut-before-settled", "a bucket's next batch is cut before the open one is settled"),
];

/// Deliberate defects in shipped code that a component's own test catches
/// rather than the gate (the gate runs neither librdkafka nor forged
/// payload bytes through those lines): name, defect, and the test, as
/// `package test-binary test-name`. The test runs itself again in a child
/// process with the defect switched on (`outbox_core::simulation::MUTATION_ENV`)
/// and expects it to fail; `every_component_mutation_has_a_test` holds this
/// list to the tests.
pub const COMPONENT_MUTATIONS: [(&str, &str, &str); 5] = [
    (
        "payload-digest-from-header",
        "a message's payload digest is taken from its header instead of hashed from its bytes, so changed bytes verify",
        "outbox-consumer processor the_tampering_test_catches_a_digest_taken_from_the_header",
    ),
    (
        "possibly-persisted-as-not-persisted",
        "the Kafka adapter reads librdkafka's \"possibly persisted\" as \"not persisted\": a message that may be in the log is reported never written",
        "outbox-producer kafka_adapter the_slow_ack_test_catches_possibly_persisted_read_as_not_persisted",
    ),
    (
        "receipt-key-unchecked",
        "acceptDispatchReceipt takes a receipt whose message key is not the frozen routing key (no quarantine): a forged or re-keyed copy becomes the event's publication",
        "outbox-producer kafka_adapter the_forged_key_test_catches_a_receipt_key_left_unchecked",
    ),
    (
        "replaced-log-read-as-continuous",
        "the consumer's reading of a partition goes on across a replaced log (a topic created again, a cluster replaced), so a consumer that reads the new log from the old log's position counts the new log's offsets below it as read",
        "outbox-consumer store_conformance the_replaced_log_test_catches_a_reading_kept_across_logs",
    ),
    (
        "receipt-log-id-ignored",
        "retention and the reconciler let a destination.v1 receipt pass a consumer watermark kept in another log than the one the receipt names (both log ids known)",
        "outbox-sim conformance the_log_id_scenario_catches_a_receipts_log_id_ignored",
    ),
];
