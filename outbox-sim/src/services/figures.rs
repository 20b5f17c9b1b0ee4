//! The counters of one or many traces ([`ServiceFigures`]: informational
//! ones and the violations, which must stay zero) and what one trace
//! produced ([`ServiceOutcome`]).

/// Declares [`ServiceFigures`] from one list of its counters: informational
/// ones, then the violations (each must stay zero); merging, the
/// violations and the printed lines all follow the list.
macro_rules! service_figures {
    (info { $($(#[doc = $idoc:expr])* $info:ident,)* } violations { $($(#[doc = $vdoc:expr])* $violation:ident,)* }) => {
        /// Counters of one or many traces.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct ServiceFigures {
            $($(#[doc = $idoc])* pub $info: u64,)*
            $($(#[doc = $vdoc])* pub $violation: u64,)*
        }

        impl ServiceFigures {
            /// Adds `o`.
            pub fn merge(&mut self, o: &ServiceFigures) {
                $(self.$info += o.$info;)*
                $(self.$violation += o.$violation;)*
            }

            /// Violations: every one must be zero.
            pub fn violations(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($violation), self.$violation)),*]
            }

            fn info(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($info), self.$info)),*]
            }
        }
    };
}

service_figures! {
    info {
        /// Traces run.
        traces,
        /// Events committed.
        events,
        /// Events published.
        published,
        /// Events quarantined.
        quarantined,
        /// Events left waiting behind a QUARANTINED head at the end of a
        /// trace (settled for the gate: the key is blocked until an
        /// operator skips the head; each trace's log names the key).
        blocked_behind_quarantined,
        /// Events left waiting behind an unknown outcome whose log cannot
        /// answer (a `log_unavailable` finding), likewise.
        blocked_behind_unprovable,
        /// Attempts registered.
        attempts,
        /// Attempts whose outcome became unknown (and was resolved).
        unknown_attempts,
        /// Process kills.
        kills,
        /// Store faults injected.
        store_faults,
        /// Broker faults injected.
        broker_faults,
        /// Copies in the log beyond one per event (all accounted for).
        duplicates_in_log,
        /// Partitions truncated by retention while events were in flight.
        truncations,
        /// Unknown outcomes left unresolved and reported (the log that could
        /// prove them was truncated: the finding `log_unavailable`).
        unknown_reported,
        /// Events an operator migrated to another destination.
        migrations,
        /// Migration requests refused (nothing moved, nothing sent).
        migrations_refused,
        /// Re-sends of QUARANTINED events refused (a copy of the event may
        /// be in the old topic), among `migrations_refused`.
        resends_refused,
        /// Events retention purged (payload dropped, tombstone kept).
        purged,
        /// Retention passes that held an event back for a mandatory consumer.
        held_by_consumers,
        /// Events the consumer group applied (one receipt each).
        consumer_applied,
        /// Redeliveries the consumer group answered with a receipt.
        consumer_redeliveries,
        /// Events the consumer group dead-lettered.
        consumer_dead_lettered,
        /// Consumer owners that died after a database commit, before the offset commit.
        consumer_crashes,
        /// Consumer owners that started at the log's end instead of their
        /// committed offset (the group reset to latest, as an operator's
        /// reset or an expired committed offset does).
        offset_resets,
        /// Published events a reset made the consumer group skip: never
        /// applied, and held by retention (the group's watermark stops at
        /// the gap it recorded, or below them).
        skipped_by_reset,
        /// Copies no receipt records that the reconciler's bypass scan
        /// reported (`unrecorded_copy`, `divergent_copy`): of open attempts
        /// of events another receipt published, and late copies of paused
        /// hosts whose receipt never reached the store.
        copies_reported,
        /// Dispatcher and reconciler hosts whose clock is off.
        skewed_hosts,
        /// Kills of the consumer process.
        consumer_kills,
        /// Partitions moved to a new owner with a batch in flight.
        rebalances,
        /// Receipt-store faults injected.
        consumer_store_faults,
        /// Dispatcher hosts stopped with a message in their client's buffer.
        host_pauses,
        /// Absence proofs a genuine receipt refuted where a fault explains
        /// it (a paused host's write after the in-flight bound, or an ACK of
        /// a write into a log gone before the proof, which was about the
        /// log that replaced it), the receipt accepted (as the primary or a
        /// duplicate) and the store's finding `absence_proof_refuted`
        /// recorded: the protocol's answer to either.
        absence_refuted_late,
        /// Late copies of a paused host whose receipt never reached the
        /// store (its process was killed, the ACK lost) and that no scan
        /// finding names yet: their event is still unknown (reported as
        /// `log_unavailable`: the scan judges a copy of an attempt left
        /// UNKNOWN accounted, the lookups' to find), or the copy sits in a
        /// log the scan cannot read (gone, truncated, compacted). A copy of
        /// an attempt closed ABSENT or NOT_SENT is the scan's finding
        /// `absence_proof_refuted` (counted in `copies_reported`).
        late_copies_unheard,
        /// Topics deleted and created again, and clusters replaced by empty ones.
        log_resets,
        /// Records a forger wrote to the watermark topic (unsigned, or
        /// signed with a key not the group's), in the traces that run it.
        forged_watermark_records,
        /// Watermark-topic records the reader applied to the outbox side's copy.
        watermark_records_applied,
        /// Watermark-topic records the reader refused (the forger's among them).
        watermark_records_refused,
        /// Published events whose receipt's position held their message in
        /// a log that is gone since (its topic recreated, its cluster replaced).
        receipt_positions_lost,
        /// Committed commands a client retried (same key, same content).
        commands_retried,
        /// Passes of the log cleaner over a partition of the topic.
        compactions,
        /// Records those passes removed.
        records_compacted,
        /// Lookups whose range had a hole (compacted records): no absence proof.
        lookups_over_holes,
        /// ACKs the broker client answered to a dispatcher that lived on.
        acks_to_live_senders,
        /// ACKs that reached their dispatcher after the claim's lease ran
        /// out (its `late_acks` counter): each must be recorded all the same.
        late_acks,
        /// Messages a forger wrote with a registered attempt's headers and
        /// other payload bytes.
        forged_copies,
        /// Forged messages the consumer group quarantined (their bytes do
        /// not match their digest).
        forged_quarantined,
        /// Dispatchers' LISTEN sessions lost with a notice.
        listen_sessions_lost,
        /// Emitting transactions that stayed open after inserting (others
        /// that took later positions may have committed first).
        transactions_held_open,
        /// Emitting transactions that aborted after inserting.
        transactions_aborted,
    }
    violations {
        /// Committed events not published, or published at a position that does not hold them.
        lost_write,
        /// Copies from attempts the store holds no receipt of.
        duplicate,
        /// Copies of attempts the store closed as not sent or proven absent.
        refuted_absence,
        /// Positions holding receipts of two events.
        inconsistent_offsets,
        /// A key's events published out of commit order.
        order_violation,
        /// Unknown outcomes left after the run.
        unresolved_unknown,
        /// Traces that did not settle.
        stuck,
        /// A copy of a migrated event's old generation in the old target:
        /// delivered to the new target while a copy sat in the old one.
        migrated_over_copy,
        /// An event purged before the mandatory consumer group applied or
        /// dead-lettered it (its receipt store holds no decision of it).
        premature_purge,
        /// An event's effect written twice by the consumer group.
        duplicate_effect,
        /// A consumer receipt without its effect, or an effect without its receipt.
        receipt_effect_mismatch,
        /// An event published at a position the log still holds, never applied.
        unseen,
        /// A consumer watermark past an offset of the current log that
        /// holds a published event the group never applied nor dead-lettered.
        watermark_passes_unread,
        /// A message the dispatcher wrote, quarantined by the consumer.
        genuine_quarantined,
        /// A retried command answered with another event (or refused): one
        /// business command, two logical events.
        second_logical_event_id,
        /// A publish slot holding a message of the event whose bytes are
        /// not the frozen payload (a forged copy accepted).
        divergent_accepted,
        /// An ACK that reached a dispatcher that lived on, never handed to
        /// `acceptDispatchReceipt`.
        ack_dropped,
        /// A shipped service answered an error no fault explains (an
        /// illegal transition, a refused write of its own).
        service_error,
        /// An event of an aborted transaction seen in the store or a log.
        aborted_visible,
    }
}

impl ServiceFigures {
    /// Whether no violation was counted.
    pub fn clean(&self) -> bool {
        self.violations().iter().all(|(_, v)| *v == 0)
    }

    /// `name value` lines, the informational counters first.
    pub fn lines(&self) -> Vec<String> {
        self.info().into_iter().chain(self.violations()).map(|(n, v)| format!("services.{n} {v}")).collect()
    }
}

/// What one services trace produced.
#[derive(Debug, Clone)]
pub struct ServiceOutcome {
    /// The seed.
    pub seed: u64,
    /// Its counters.
    pub figures: ServiceFigures,
    /// The violations, in words.
    pub violations: Vec<String>,
    /// The trace's log, when asked for.
    pub log: Option<Vec<String>>,
    /// How long each unknown outcome took to resolve, virtual ms.
    pub unknown_resolved_ms: Vec<i64>,
}
