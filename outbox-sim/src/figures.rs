//! The counters every trace produces, their sum over a run, and the release
//! gate (PROTOCOL §10) over that sum.

/// Whether a counter must stay zero for the gate to pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A violation: any non-zero value fails the trace and the gate.
    MustBeZero,
    /// Coverage and context: how often the trace exercised something.
    Info,
}

macro_rules! figures {
    ($( $(#[$doc:meta])* $name:ident : $kind:ident ),* $(,)?) => {
        /// Counters of one trace, or the sum over many.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct Figures {
            $( $(#[$doc])* pub $name: u64, )*
        }

        impl Figures {
            /// Adds `other` into `self`.
            pub fn merge(&mut self, other: &Figures) {
                $( self.$name += other.$name; )*
            }

            /// Every counter with its name and kind, in declaration order.
            pub fn entries(&self) -> Vec<(&'static str, u64, Kind)> {
                vec![$( (stringify!($name), self.$name, Kind::$kind), )*]
            }
        }
    };
}

figures! {
    /// Traces run.
    traces: Info,
    /// Committed events that did not end PUBLISHED after quiescence, other
    /// than the allowed end states (see the crate docs).
    lost_events: MustBeZero,
    /// Extra event ids returned for one business command key.
    second_logical_event_ids: MustBeZero,
    /// Business commits without an outbox envelope.
    commits_without_envelope: MustBeZero,
    /// Outbox envelopes without a business commit (a rolled-back command left an event).
    envelopes_without_commit: MustBeZero,
    /// Attempts or broker messages of an event that are not at its frozen destination.
    cross_destination_retries: MustBeZero,
    /// Publish slots holding a receipt whose payload, destination or placement
    /// diverges from the frozen envelope, or that names no such message in the broker.
    divergent_accepted: MustBeZero,
    /// Consumer effects beyond the first, per (consumer, event).
    duplicate_consumer_effects: MustBeZero,
    /// Events seen DISPATCH_UNKNOWN / RECONCILING / RETRY_CLAIMED with no attempt recorded.
    unknown_without_trail: MustBeZero,
    /// Broker messages whose attempt is not registered for their event.
    untraced_messages: MustBeZero,
    /// Sends by a holder whose lease had run out or whose claim was superseded (PROTOCOL §4).
    stale_sends: MustBeZero,
    /// Lookups that answered "absent" although a message of an attempt that
    /// may be in flight sits in the frozen partition (an unsound scan bound),
    /// and attempts closed ABSENT whose message is in the broker after all.
    false_absence_proofs: MustBeZero,
    /// Genuine broker receipts (right bytes, right destination, registered
    /// attempt) that `acceptDispatchReceipt` neither accepted nor kept as a duplicate.
    genuine_receipts_refused: MustBeZero,
    /// Genuine ACKs received after the receiver's claim expired.
    late_acks_total: Info,
    /// Of those, the ones that ended as the primary or a duplicate receipt.
    late_acks_converged: Info,
    /// Late genuine ACKs that did not converge (`late_acks_total - late_acks_converged`).
    late_acks_not_converged: MustBeZero,
    /// PUBLISHED events a consumer never took effect for, after quiescence.
    published_not_consumed: MustBeZero,
    /// Sends under envelope generation N + 1 to a new destination while the
    /// old target may hold generation N (a message of it is in the old log or
    /// still on its way), or after a move made without an absence proof while
    /// old attempts were open (PROTOCOL §7: no cross-target re-send while UNKNOWN).
    cross_target_resends_while_unknown: MustBeZero,
    /// Migrations accepted although the old target holds (or will hold) the
    /// old generation, or whose `ProvenAbsent` proof no lookup of the old target backed.
    migrations_without_proof: MustBeZero,
    /// Events purged while a mandatory consumer had not committed past their
    /// offset (ground truth: the consumer's committed position in that log).
    purged_before_mandatory_watermark: MustBeZero,
    /// Events purged before the replay window had passed since their publication.
    purged_within_replay_window: MustBeZero,
    /// After a purge, a late duplicate ACK (the slot's or a duplicate's
    /// receipt) or a retried command not recognised through the tombstone.
    late_duplicates_unrecognised_after_purge: MustBeZero,
    /// Store calls that failed where the protocol allows no failure (illegal transitions...).
    unexpected_store_errors: MustBeZero,
    /// Traces that did not settle within the quiescence budget.
    not_quiescent: MustBeZero,
    /// Business commands issued.
    commands: Info,
    /// Commands whose client gave up after a crash before commit (no business row, no event).
    commands_abandoned: Info,
    /// Command tries that crashed after the commit and were retried with the same key.
    commands_retried_after_commit: Info,
    /// Events committed.
    events: Info,
    /// Events PUBLISHED at the end.
    events_published: Info,
    /// Events whose stored payload the trace tampered with.
    events_tampered: Info,
    /// Tampered events that ended QUARANTINED (allowed).
    quarantined_injected: Info,
    /// Events held PENDING behind a QUARANTINED earlier event of the same key (allowed).
    held_behind_quarantine: Info,
    /// Attempts registered.
    attempts: Info,
    /// Messages written to the broker.
    broker_messages: Info,
    /// Events that went DISPATCH_UNKNOWN.
    unknowns: Info,
    /// Unknowns resolved (PUBLISHED, proven not sent, or quarantined).
    unknowns_resolved: Info,
    /// Retries granted by reconcilers.
    reconcile_retries: Info,
    /// Duplicate transport receipts kept.
    duplicate_receipts: Info,
    /// Broker lookups that failed.
    lookups_failed: Info,
    /// Traces whose broker adapter cannot look up at all.
    traces_without_lookup: Info,
    /// Route policy revisions.
    route_revisions: Info,
    /// Receipt transactions rolled back.
    receipt_rollbacks: Info,
    /// Receipt transactions committed whose answer was lost (resubmitted).
    receipt_answers_lost: Info,
    /// Worker stalls (GC pauses, network hangs).
    stalls: Info,
    /// Worker crashes.
    crashes: Info,
    /// Fenced writes refused by the store.
    fenced_writes: Info,
    /// Deliveries a consumer had already taken effect for (original receipt returned).
    consumer_redeliveries: Info,
    /// Offset commits lost after the consumer's database commit.
    offset_commits_lost: Info,
    /// Messages consumers quarantined (bytes do not match their digest).
    consumer_quarantined: Info,
    /// Destination migrations accepted (envelope generation + 1).
    migrations: Info,
    /// Migration requests refused (nothing moved, nothing sent).
    migrations_refused: Info,
    /// Of those, refused because the old target was UNKNOWN and unqueryable.
    migrations_refused_unqueryable: Info,
    /// Events moved PUBLISHED -> RETAINED.
    events_retained: Info,
    /// Events purged (payload dropped, tombstone kept).
    events_purged: Info,
    /// Retention passes in which a mandatory consumer's watermark held an event back.
    purges_held_by_consumers: Info,
    /// Late duplicate ACKs and retried commands replayed against tombstones.
    late_duplicates_after_purge: Info,
}

impl Figures {
    /// Whether every must-be-zero counter is zero.
    pub fn clean(&self) -> bool {
        self.entries().iter().all(|(_, v, k)| *k == Kind::Info || *v == 0)
    }

    /// The must-be-zero counters that are not.
    pub fn violations(&self) -> Vec<(&'static str, u64)> {
        self.entries().into_iter().filter(|(_, v, k)| *k == Kind::MustBeZero && *v > 0).map(|(n, v, _)| (n, v)).collect()
    }

    /// The value of a counter by name.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.entries().into_iter().find(|(n, _, _)| *n == name).map(|(_, v, _)| v)
    }

    /// Percentage of late genuine ACKs that converged (100 when there were none).
    pub fn late_acks_converged_pct(&self) -> f64 {
        if self.late_acks_total == 0 {
            100.0
        } else {
            100.0 * self.late_acks_converged as f64 / self.late_acks_total as f64
        }
    }
}

/// PROTOCOL §10: UNKNOWN p99 must be reconciled within 15 minutes of simulated time.
pub const UNKNOWN_P99_LIMIT_MS: i64 = 15 * 60 * 1000;

/// The p-th percentile (nearest rank) of `values`; 0 when empty. Reorders `values`.
pub fn percentile(values: &mut [i64], p: f64) -> i64 {
    if values.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * values.len() as f64).ceil().max(1.0) as usize - 1;
    let rank = rank.min(values.len() - 1);
    *values.select_nth_unstable(rank).1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let mut v: Vec<i64> = (1..=100).rev().collect();
        assert_eq!(percentile(&mut v, 99.0), 99);
        assert_eq!(percentile(&mut v, 100.0), 100);
        assert_eq!(percentile(&mut [], 99.0), 0);
        assert_eq!(percentile(&mut [7], 99.0), 7);
    }

    #[test]
    fn clean_means_no_violation() {
        let mut f = Figures { traces: 3, late_acks_total: 2, ..Figures::default() };
        assert!(f.clean());
        f.stale_sends = 1;
        assert!(!f.clean());
        assert_eq!(f.violations(), vec![("stale_sends", 1)]);
        assert_eq!(f.get("stale_sends"), Some(1));
    }
}
