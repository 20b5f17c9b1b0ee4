//! The comparison's condition findings (aged, unknown past the SLO,
//! quarantined, unconsumed, published without a receipt, stale watermarks),
//! and which open findings a round resolves, with no I/O.
//!
//! Each function decides one finding from a row's facts and answers its age
//! (ms) when the row is a finding. The reconciler reads candidate rows
//! through [`crate::store::FindingsStore`] (a store may pre-filter them by
//! time, with an index, but records only what these functions say) and
//! writes the round's findings with
//! [`crate::store::FindingsStore::record_round_findings`], which resolves open
//! findings as [`round_resolves`] says.

use crate::retention::{LogPosition, WatermarkRef};
use crate::state::EventState;

/// PENDING (or held by a dispatcher) past the threshold.
pub const AGED_PENDING: &str = "aged_pending";
/// DISPATCH_UNKNOWN since longer than the SLO, not yet closed.
pub const UNKNOWN_PAST_SLO: &str = "unknown_past_slo";
/// A quarantined event.
pub const QUARANTINED: &str = "quarantined";
/// Published and not passed by a critical consumer's watermark of its log.
pub const UNCONSUMED_PUBLISHED: &str = "unconsumed_published";
/// PUBLISHED, RETAINED or PURGED without a primary receipt.
pub const PUBLISHED_WITHOUT_RECEIPT: &str = "published_without_receipt";
/// A consumer whose broker watermark records stopped arriving.
pub const STALE_WATERMARK: &str = "stale_watermark";
/// A consumer skipped offsets of a log it never read (its watermark stands
/// at the gap): raised from its watermark record, resolved by its first
/// record without the gap.
pub const CONSUMER_GAP: &str = "consumer_gap";

/// Findings that are evidence, not conditions: opened (or seen again) by
/// what found them and left open until an operator resolves them; a
/// comparison round never resolves them.
pub const EVIDENCE_FINDINGS: &[&str] = &[
    "bypass_publish",
    "absence_proof_refuted",
    "unregistered_message",
    "receipt_position_lost",
    "log_unavailable",
    PUBLISHED_WITHOUT_RECEIPT,
    "foreign_source",
    "unrecorded_copy",
    "divergent_copy",
    "scan_gap",
    "partition_count_changed",
    "watermark_undeclared_consumer",
    "watermark_moved_back",
    "watermark_beyond_end",
    "watermark_rejected",
    CONSUMER_GAP,
];

/// `at` is more than `threshold_ms` before `now_ms` (the SQL's `at < now - threshold`).
fn older_than(at_ms: i64, now_ms: i64, threshold_ms: i64) -> bool {
    at_ms < now_ms.saturating_sub(threshold_ms)
}

/// `aged_pending`: an event this outbox publishes (not a legacy
/// publisher's), not delivered: PENDING, or CLAIMED/SENDING while a
/// dispatcher holds it (a send the broker refuses puts it back to PENDING,
/// so counting only PENDING would close and reopen the finding), created
/// more than `aged_pending_ms` ago. Answers its age.
pub fn aged_pending(state: EventState, held_by_dispatcher: bool, by_outbox: bool, created_at_ms: i64, now_ms: i64, aged_pending_ms: i64) -> Option<i64> {
    let undelivered = state == EventState::Pending || (matches!(state, EventState::Claimed | EventState::Sending) && held_by_dispatcher);
    (by_outbox && undelivered && older_than(created_at_ms, now_ms, aged_pending_ms)).then(|| now_ms - created_at_ms)
}

/// `unknown_past_slo`: unknown since more than `unknown_slo_ms` ago and
/// not closed yet (neither published, retained, purged, skipped nor
/// quarantined; a retry or reconcile in progress still counts). Answers its age.
pub fn unknown_past_slo(state: EventState, unknown_since_ms: Option<i64>, now_ms: i64, unknown_slo_ms: i64) -> Option<i64> {
    let closed = state.is_closed() || state == EventState::Quarantined;
    let since = unknown_since_ms?;
    (!closed && older_than(since, now_ms, unknown_slo_ms)).then(|| now_ms - since)
}

/// `quarantined`: a quarantined event, for as long as it is. Answers how
/// long it has been.
pub fn quarantined(state: EventState, state_since_ms: i64, now_ms: i64) -> Option<i64> {
    (state == EventState::Quarantined).then(|| now_ms - state_since_ms)
}

/// `unconsumed_published`: a PUBLISHED or RETAINED event, published more
/// than `unconsumed_after_ms` ago at `placement` (its primary receipt),
/// on a topic `consumer_id` reads (`consumer_topics`), that no watermark
/// of the consumer on that very log (same cluster, topic, topic id and
/// partition: [`WatermarkRef::covers_log_of`]) has passed (committed
/// offset above the event's offset). No watermark passes an event of a
/// replaced `destination.v1` log ([`LogPosition::on_replaced_unnamed_log`]):
/// one under that name may be the old log's. Answers its age.
#[allow(clippy::too_many_arguments)]
pub fn unconsumed_published(
    state: EventState,
    published_at_ms: i64,
    now_ms: i64,
    unconsumed_after_ms: i64,
    placement: &LogPosition<'_>,
    consumer_id: &str,
    consumer_topics: &[String],
    watermarks: &[WatermarkRef<'_>],
) -> Option<i64> {
    if !matches!(state, EventState::Published | EventState::Retained) || !older_than(published_at_ms, now_ms, unconsumed_after_ms) {
        return None;
    }
    if !consumer_topics.iter().any(|t| t == placement.log.topic) {
        return None;
    }
    // A watermark under the name of a replaced log may be the old log's:
    // it proves nothing about an event of the new one.
    let passed = !placement.on_replaced_unnamed_log()
        && watermarks.iter().any(|w| w.covers_log_of(consumer_id, placement) && w.committed_offset > placement.offset && w.anchor_agrees_with(placement));
    (!passed).then(|| now_ms - published_at_ms)
}

/// `published_without_receipt`: PUBLISHED, RETAINED or PURGED with no
/// primary receipt of its current envelope generation.
pub fn published_without_receipt(state: EventState, has_primary_receipt: bool) -> bool {
    matches!(state, EventState::Published | EventState::Retained | EventState::Purged) && !has_primary_receipt
}

/// `stale_watermark`: a declared consumer that has published watermark
/// records over the broker (at least one accepted) and whose last accepted
/// record arrived more than `stale_after_ms` before `now_ms`. Answers its age.
pub fn stale_watermark(records_accepted: i64, last_received_ms: i64, now_ms: i64, stale_after_ms: i64) -> Option<i64> {
    (records_accepted > 0 && older_than(last_received_ms, now_ms, stale_after_ms)).then(|| now_ms - last_received_ms)
}

/// Whether a round resolves an open finding of `kind`: a condition that
/// the round did not see again no longer holds; evidence
/// ([`EVIDENCE_FINDINGS`]) stays open until an operator closes it.
pub fn round_resolves(kind: &str, seen_this_round: bool) -> bool {
    !seen_this_round && !EVIDENCE_FINDINGS.contains(&kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use EventState::*;

    const NOW: i64 = 1_000_000;

    #[test]
    fn aged_is_undelivered_past_the_threshold() {
        assert_eq!(aged_pending(Pending, false, true, NOW - 61, NOW, 60), Some(61));
        assert_eq!(aged_pending(Pending, false, true, NOW - 60, NOW, 60), None, "exactly at the threshold is not past it");
        assert_eq!(aged_pending(Sending, true, true, NOW - 100, NOW, 60), Some(100));
        assert_eq!(aged_pending(Claimed, true, true, NOW - 100, NOW, 60), Some(100));
        assert_eq!(aged_pending(Sending, false, true, NOW - 100, NOW, 60), None, "not held: its lease expiry decides");
        assert_eq!(aged_pending(Pending, false, false, NOW - 100, NOW, 60), None, "a legacy publisher's event");
        for s in [Published, Retained, Purged, DispatchUnknown, Reconciling, RetryClaimed, Quarantined] {
            assert_eq!(aged_pending(s, true, true, NOW - 100, NOW, 60), None, "{s:?}");
        }
    }

    #[test]
    fn unknown_past_slo_until_closed() {
        assert_eq!(unknown_past_slo(DispatchUnknown, Some(NOW - 11), NOW, 10), Some(11));
        assert_eq!(unknown_past_slo(DispatchUnknown, Some(NOW - 10), NOW, 10), None);
        assert_eq!(unknown_past_slo(DispatchUnknown, None, NOW, 10), None);
        for s in [Reconciling, RetryClaimed, Sending, Pending] {
            assert_eq!(unknown_past_slo(s, Some(NOW - 11), NOW, 10), Some(11), "{s:?} is not closed");
        }
        for s in [Published, Retained, Purged, Quarantined, Skipped] {
            assert_eq!(unknown_past_slo(s, Some(NOW - 11), NOW, 10), None, "{s:?} is closed");
        }
    }

    #[test]
    fn quarantined_while_quarantined() {
        assert_eq!(quarantined(Quarantined, NOW - 5, NOW), Some(5));
        assert_eq!(quarantined(Published, NOW - 5, NOW), None);
    }

    #[test]
    fn unconsumed_is_judged_on_the_very_log() {
        let topics = vec!["orders".to_owned()];
        let at = LogPosition { log: crate::LogRef { cluster_id: "k1", topic: "orders", topic_id: None, partition: 2 }, offset: 10, position_epoch: 0, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None };
        let wm = |cluster_id, topic_id, partition, committed_offset| WatermarkRef { log: crate::LogRef { cluster_id, topic: "orders", topic_id, partition }, consumer_id: "c", committed_offset, anchor: crate::retention::WatermarkAnchor::Unrecorded, log_id: None };
        let judge = |wms: &[WatermarkRef<'_>]| unconsumed_published(Published, NOW - 100, NOW, 50, &at, "c", &topics, wms);
        assert_eq!(judge(&[]), Some(100), "no watermark");
        assert_eq!(judge(&[wm("k1", None, 2, 11)]), None, "passed");
        assert_eq!(judge(&[wm("k1", None, 2, 10)]), Some(100), "the committed offset is the next one read: at the event is behind it");
        assert_eq!(judge(&[wm("k2", None, 2, 1_000)]), Some(100), "another cluster's log");
        assert_eq!(judge(&[wm("k1", Some("AAAAAAAAAAAAAAAAAAAAAQ"), 2, 1_000)]), Some(100), "another incarnation of the topic");
        assert_eq!(judge(&[wm("k1", None, 3, 1_000)]), Some(100), "another partition");
        let other = WatermarkRef { consumer_id: "d", ..wm("k1", None, 2, 1_000) };
        assert_eq!(judge(&[other]), Some(100), "another consumer's watermark");
        assert_eq!(unconsumed_published(Retained, NOW - 100, NOW, 50, &at, "c", &topics, &[]), Some(100));
        assert_eq!(unconsumed_published(Purged, NOW - 100, NOW, 50, &at, "c", &topics, &[]), None);
        assert_eq!(unconsumed_published(Published, NOW - 50, NOW, 50, &at, "c", &topics, &[]), None, "within the threshold");
        assert_eq!(unconsumed_published(Published, NOW - 100, NOW, 50, &at, "c", &["payments".to_owned()], &[]), None, "a topic it does not read");
    }

    /// Issue 46: a `destination.v1` receipt of a position epoch above 0 sits
    /// in a log that replaced another one under the same name; a watermark
    /// of that name may be the old log's, so it proves nothing about the
    /// event (retention holds it as `ReplacedLog` for the same reason), and
    /// the comparison reports it unconsumed. A `destination.v2` receipt of
    /// any epoch is judged by its topic id's watermarks as before.
    #[test]
    fn no_watermark_passes_an_event_of_a_replaced_unnamed_log() {
        let topics = vec!["orders".to_owned()];
        let wm = |topic_id| WatermarkRef { log: crate::LogRef { cluster_id: "k1", topic: "orders", topic_id, partition: 2 }, consumer_id: "c", committed_offset: 1_000, anchor: crate::retention::WatermarkAnchor::Unrecorded, log_id: None };
        let replaced = LogPosition { log: crate::LogRef { cluster_id: "k1", topic: "orders", topic_id: None, partition: 2 }, offset: 10, position_epoch: 1, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None };
        assert_eq!(unconsumed_published(Published, NOW - 100, NOW, 50, &replaced, "c", &topics, &[wm(None)]), Some(100));
        let named = LogPosition { log: crate::LogRef { topic_id: Some("AAAAAAAAAAAAAAAAAAAAAQ"), ..replaced.log }, ..replaced };
        assert_eq!(unconsumed_published(Published, NOW - 100, NOW, 50, &named, "c", &topics, &[wm(Some("AAAAAAAAAAAAAAAAAAAAAQ"))]), None);
    }

    #[test]
    fn published_without_receipt_is_a_closed_state_without_its_receipt() {
        for s in [Published, Retained, Purged] {
            assert!(published_without_receipt(s, false));
            assert!(!published_without_receipt(s, true));
        }
        assert!(!published_without_receipt(Pending, false));
        assert!(!published_without_receipt(Quarantined, false));
    }

    #[test]
    fn stale_only_after_a_first_record() {
        assert_eq!(stale_watermark(1, NOW - 61, NOW, 60), Some(61));
        assert_eq!(stale_watermark(1, NOW - 60, NOW, 60), None);
        assert_eq!(stale_watermark(0, NOW - 1_000, NOW, 60), None);
    }

    #[test]
    fn a_round_resolves_conditions_it_did_not_see_and_never_evidence() {
        for kind in [AGED_PENDING, UNKNOWN_PAST_SLO, QUARANTINED, UNCONSUMED_PUBLISHED, STALE_WATERMARK] {
            assert!(round_resolves(kind, false), "{kind}");
            assert!(!round_resolves(kind, true), "{kind}");
        }
        for kind in EVIDENCE_FINDINGS {
            assert!(!round_resolves(kind, false), "{kind}");
        }
        for kind in [crate::compare::BYPASS_PUBLISH, crate::compare::FOREIGN_SOURCE, crate::compare::UNRECORDED_COPY, crate::compare::DIVERGENT_COPY, crate::compare::RECEIPT_POSITION_LOST, crate::compare::SCAN_GAP] {
            assert!(EVIDENCE_FINDINGS.contains(&kind), "the scan's {kind} is evidence");
        }
    }
}
