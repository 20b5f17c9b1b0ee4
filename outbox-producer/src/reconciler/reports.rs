//! What a round reports: the comparison's counts, the resolve round's, the bypass scan's.

// For the doc links only.
#[cfg(doc)]
use {super::Reconciler, outbox_core::compare::ScanJudgement};

/// What one comparison of the three sets found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompareReport {
    /// PENDING past `aged_pending_ms`.
    pub aged_pending: usize,
    /// PUBLISHED but not passed by a critical consumer's watermark.
    pub unconsumed_published: usize,
    /// Messages in a routed topic that the outbox never committed (this round).
    pub bypass_publish: usize,
    /// UNKNOWN past the SLO.
    pub unknown_past_slo: usize,
    /// Quarantined events.
    pub quarantined: usize,
    /// PUBLISHED, RETAINED or PURGED events without a primary receipt found
    /// by this round's part of the sweep.
    pub published_without_receipt: usize,
    /// Declared consumers whose watermark records stopped arriving.
    pub stale_watermark: usize,
    /// Messages read by the bypass check.
    pub scanned_messages: usize,
    /// Copies the bypass check handed to the receipt transaction: copies
    /// of an attempt past its in-flight bound, whose event was not
    /// published, that no answer will reach (this round).
    pub bypass_submitted: usize,
    /// Messages whose `outbox-source` is another outbox's, not declared (this round).
    pub foreign_source: usize,
    /// Copies of a published event, byte-identical, at a position that is
    /// neither its primary receipt nor a recorded duplicate transport receipt (this round).
    pub unrecorded_copy: usize,
    /// Messages with a published event's id whose bytes differ from the event's (this round).
    pub divergent_copy: usize,
    /// Routed topics whose partition count is not what their routes froze (this round).
    pub partition_count_changed: usize,
}

impl CompareReport {
    /// Total findings.
    pub fn total(&self) -> usize {
        self.aged_pending
            + self.unconsumed_published
            + self.bypass_publish
            + self.unknown_past_slo
            + self.quarantined
            + self.published_without_receipt
            + self.foreign_source
            + self.unrecorded_copy
            + self.divergent_copy
            + self.stale_watermark
            + self.partition_count_changed
    }
}

/// What one round of [`Reconciler::resolve_unknown_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResolveReport {
    /// Events taken into RECONCILING.
    pub examined: usize,
    /// Found in the broker and published through the receipt transaction.
    pub published: usize,
    /// Found but divergent: quarantined.
    pub quarantined: usize,
    /// Proven absent (or no lookup): RETRY_CLAIMED to the same destination.
    pub retried: usize,
    /// Still unknown, next check scheduled.
    pub rechecks: usize,
    /// Failed on their own (logged); looked at again after their lease.
    pub failed: usize,
    /// Given back unstarted: the round ran past half of its lease.
    pub given_back: usize,
    /// QUARANTINED events closed SKIPPED by their route's poison policy
    /// (`skip`), this round's or earlier rounds' quarantines.
    pub poison_skipped: usize,
}

/// What one bypass scan ([`Reconciler::scan_for_bypass`]) read and recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BypassScanReport {
    /// Messages read.
    pub scanned: usize,
    /// Copies handed to the receipt transaction ([`ScanJudgement::Submit`]).
    pub submitted: usize,
    /// Findings recorded: kind, and the event (or label) each names.
    pub findings: Vec<(&'static str, String)>,
    /// What the scan saw that is no finding, in words, each also logged at
    /// WARN: a partition whose broker reports its end below receipts whose
    /// events it still serves there (one note per partition per scan).
    pub notes: Vec<String>,
}

impl BypassScanReport {
    /// Adds what the scan read, what it handed to the receipt transaction
    /// and its findings about messages to `report` (receipts whose position
    /// was lost are recorded, not counted there).
    pub fn count_into(&self, report: &mut CompareReport) {
        report.scanned_messages += self.scanned;
        report.bypass_submitted += self.submitted;
        for (kind, _) in &self.findings {
            match *kind {
                "bypass_publish" => report.bypass_publish += 1,
                "foreign_source" => report.foreign_source += 1,
                "unrecorded_copy" => report.unrecorded_copy += 1,
                "divergent_copy" => report.divergent_copy += 1,
                "partition_count_changed" => report.partition_count_changed += 1,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bypass scan's figures reach the round's report: what it read, what
    /// it handed to the receipt transaction, its findings about messages.
    #[test]
    fn a_scan_counts_into_the_rounds_report() {
        let scan = BypassScanReport { scanned: 7, submitted: 2, findings: vec![(outbox_core::compare::UNRECORDED_COPY, "evt-a".into()), (outbox_core::compare::SCAN_GAP, "t/0@1..3".into())], notes: Vec::new() };
        let mut report = CompareReport::default();
        scan.count_into(&mut report);
        scan.count_into(&mut report);
        assert_eq!((report.scanned_messages, report.bypass_submitted, report.unrecorded_copy), (14, 4, 2));
    }
}
