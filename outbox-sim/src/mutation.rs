//! Deliberate bugs in the model engine's *use* of the core, to show its
//! checks catch them. outbox-core itself is never modified here; the
//! mutations of shipped code (`--mutation list`, "services") are switches in
//! the shipped crates, and the migration and purge mutations that were
//! model copies here are among them now.

/// One deliberate bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// The store's claim fence is broken: a superseded or expired holder
    /// whose `register_attempt` is fenced takes the row back and registers
    /// anyway, and sends without checking its lease. Caught by `stale_sends`.
    ClaimFenceDisabled,
    /// `acceptDispatchReceipt` without the digest check: a receipt whose
    /// payload digest is not the frozen one is written straight into the
    /// slot, bypassing `decide_receipt`. Caught by `divergent_accepted`.
    AckWithoutDigestCheck,
    /// The retry after reconciliation re-resolves the route policy instead
    /// of using the frozen destination. Caught by `cross_destination_retries`.
    RetryToNewDestination,
    /// The consumer applies its effect without checking or writing the
    /// `(consumerId, eventId)` receipt. Caught by `duplicate_consumer_effects`.
    ConsumerSkipsReceipt,
    /// The dispatcher drops ACKs that arrive after its claim expired instead
    /// of submitting them. Caught by `late_acks_not_converged`.
    LateAcksDropped,
    /// The business row and the outbox insert are two transactions; a retry
    /// that finds the business row answers "already done". Caught by
    /// `commits_without_envelope`.
    EmitOutsideTransaction,
    /// A retried command gets a fresh idempotency key. Caught by
    /// `second_logical_event_ids`.
    NewEventIdOnRetry,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: [Mutation; 7] = [
        Mutation::ClaimFenceDisabled,
        Mutation::AckWithoutDigestCheck,
        Mutation::RetryToNewDestination,
        Mutation::ConsumerSkipsReceipt,
        Mutation::LateAcksDropped,
        Mutation::EmitOutsideTransaction,
        Mutation::NewEventIdOnRetry,
    ];

    /// Command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Mutation::ClaimFenceDisabled => "claim-fence-disabled",
            Mutation::AckWithoutDigestCheck => "ack-without-digest-check",
            Mutation::RetryToNewDestination => "retry-to-new-destination",
            Mutation::ConsumerSkipsReceipt => "consumer-skips-receipt",
            Mutation::LateAcksDropped => "late-acks-dropped",
            Mutation::EmitOutsideTransaction => "emit-outside-transaction",
            Mutation::NewEventIdOnRetry => "new-event-id-on-retry",
        }
    }

    /// Parses [`Mutation::name`].
    pub fn parse(s: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The gate counter this mutation must drive above zero.
    pub fn caught_by(self) -> &'static str {
        match self {
            Mutation::ClaimFenceDisabled => "stale_sends",
            Mutation::AckWithoutDigestCheck => "divergent_accepted",
            Mutation::RetryToNewDestination => "cross_destination_retries",
            Mutation::ConsumerSkipsReceipt => "duplicate_consumer_effects",
            Mutation::LateAcksDropped => "late_acks_not_converged",
            Mutation::EmitOutsideTransaction => "commits_without_envelope",
            Mutation::NewEventIdOnRetry => "second_logical_event_ids",
        }
    }
}
