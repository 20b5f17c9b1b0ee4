//! The mutation catalogue: deliberate defects in shipped code, each of
//! which the services gate must catch.

/// Deliberate defects in shipped code, each switched by
/// [`outbox_core::simulation::mutation_active`] at one line.
pub const SERVICE_MUTATIONS: [(&str, &str); 15] = [
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
];
