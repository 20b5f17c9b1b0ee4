//! The reconciler's bypass scan (PROTOCOL §8, the comparison of the three
//! sets): what a message read from a routed topic is to the outbox, where
//! the scan's cursor goes after a page, and which recorded receipts name a
//! position the log no longer has. Pure; the reconciler
//! (`Reconciler::scan_for_bypass`, written once over a
//! [`BypassScanStore`](crate::store::BypassScanStore)) asks these for every
//! page it reads, over either store.

use std::collections::{BTreeMap, BTreeSet};

use crate::receipt::AttemptRecord;
use crate::reconcile::{may_be_in_flight, RetryPolicy, OPEN_ATTEMPT_STATES};
use crate::state::AttemptState;
use crate::log::{PartitionScan, ScannedMessage};

/// A message of a routed topic whose eventId the outbox never committed, or without one.
pub const BYPASS_PUBLISH: &str = "bypass_publish";
/// A message another, undeclared outbox wrote.
pub const FOREIGN_SOURCE: &str = "foreign_source";
/// A byte-identical copy of a published event at a position no receipt records.
pub const UNRECORDED_COPY: &str = "unrecorded_copy";
/// A message with a published event's id and other bytes, at a position no receipt records.
pub const DIVERGENT_COPY: &str = "divergent_copy";
/// A copy of an attempt the store closed without a receipt (proven
/// ABSENT, or NOT_SENT): the proof, or the broker's refusal, was wrong.
/// The same kind the receipt transaction records for a genuine ACK of such
/// an attempt.
pub const ABSENCE_PROOF_REFUTED: &str = "absence_proof_refuted";
/// A receipt whose position now holds another message, or lies at or beyond the log's end.
pub const RECEIPT_POSITION_LOST: &str = "receipt_position_lost";

/// The detail of the [`RECEIPT_POSITION_LOST`] finding a receipt
/// transaction records for the event whose receipt held `receipt`'s
/// position (both stores write it when they accept `receipt` one position
/// epoch above it).
pub fn position_taken_detail(receipt: &crate::BrokerReceipt) -> String {
    format!(
        "its receipt's position {}/{}{}/{}@{} now holds event {}'s message: the log it was recorded in is gone (cluster replaced, or a topic without a recorded id recreated)",
        receipt.cluster_id,
        receipt.topic,
        receipt.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default(),
        receipt.partition,
        receipt.offset,
        receipt.event_id
    )
}
/// Offsets the bypass check had not read yet when the log's start moved
/// past them (retention, DeleteRecords): whatever copies they held cannot
/// be accounted for any more.
pub const SCAN_GAP: &str = "scan_gap";
/// A routed topic whose partition count is not the one its current route
/// policies froze: events routed to a partition the topic lacks wait.
pub const PARTITION_COUNT_CHANGED: &str = "partition_count_changed";

/// A receipt the store recorded at a log position: the publish slot's
/// (`primary`) or a duplicate transport receipt.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordedReceipt {
    /// Its event.
    pub event_id: String,
    /// The topic id it names (`None`: `destination.v1`).
    pub topic_id: Option<String>,
    /// Its offset.
    pub offset: i64,
    /// Whether it fills the publish slot (otherwise a duplicate transport receipt).
    pub primary: bool,
}

/// A published event as the bypass check compares a copy of it: its
/// frozen payload digest and routing key (the key every copy of it must carry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedCopy {
    /// `sha256:` digest of its frozen payload.
    pub payload_digest: String,
    /// Its frozen destination's routing key.
    pub routing_key: String,
}

/// What the store recorded about the known events of one scanned page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownCopies {
    /// (eventId, topic id, offset) of every receipt, primary or duplicate,
    /// at the scanned offsets: a position names its topic id.
    pub recorded: BTreeSet<(String, Option<String>, i64)>,
    /// Published events (a primary receipt of the current envelope
    /// generation exists), with their payload digests and routing keys.
    pub published: BTreeMap<String, PublishedCopy>,
    /// Open attempts that may still be answered ([`may_be_in_flight`] at the scan's time).
    pub in_flight: BTreeSet<String>,
    /// Open attempts (SENDING, UNKNOWN) past their in-flight bound: no
    /// dispatcher's answer will come for them.
    pub unanswerable: BTreeSet<String>,
    /// Attempts closed without a receipt (ABSENT, NOT_SENT).
    pub closed: BTreeSet<String>,
}

impl KnownCopies {
    /// From the store's reads: the receipts at the scanned offsets, the
    /// published events' digests and the attempts of the known events that
    /// no receipt answered.
    pub fn new<'a>(
        receipts: impl IntoIterator<Item = &'a RecordedReceipt>,
        published: BTreeMap<String, PublishedCopy>,
        unanswered: &[AttemptRecord],
        policy: &RetryPolicy,
        now_ms: i64,
    ) -> Self {
        KnownCopies {
            recorded: receipts.into_iter().map(|r| (r.event_id.clone(), r.topic_id.clone(), r.offset)).collect(),
            published,
            in_flight: unanswered
                .iter()
                .filter(|a| OPEN_ATTEMPT_STATES.contains(&a.state) && may_be_in_flight(a, policy, now_ms))
                .map(|a| a.attempt_id.to_string())
                .collect(),
            unanswerable: unanswered
                .iter()
                .filter(|a| OPEN_ATTEMPT_STATES.contains(&a.state) && !may_be_in_flight(a, policy, now_ms))
                .map(|a| a.attempt_id.to_string())
                .collect(),
            closed: unanswered.iter().filter(|a| matches!(a.state, AttemptState::Absent | AttemptState::NotSent)).map(|a| a.attempt_id.to_string()).collect(),
        }
    }
}

/// What a scanned message is, to the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanJudgement {
    /// A declared other outbox's message: not this outbox's to judge.
    Ignored,
    /// A message of a known event that is not published yet (the
    /// reconciler will look it up), or at a position a receipt of it records.
    Accounted,
    /// A copy whose attempt may still be answered: judged again later (the cursor waits at it).
    Wait,
    /// A copy of an unpublished event's open attempt that no answer will
    /// reach any more: its receipt ([`ScannedMessage::receipt`]) goes to
    /// the receipt transaction, as a lookup's finding would.
    Submit,
    /// A finding: [`BYPASS_PUBLISH`], [`FOREIGN_SOURCE`] (both also kept as
    /// bypass evidence, [`ScanJudgement::is_bypass_message`]),
    /// [`UNRECORDED_COPY`] or [`DIVERGENT_COPY`].
    Finding(&'static str),
}

impl ScanJudgement {
    /// Whether the message is kept as bypass evidence (`outbox_bypass_messages`).
    pub fn is_bypass_message(&self) -> bool {
        matches!(self, ScanJudgement::Finding(k) if *k == BYPASS_PUBLISH || *k == FOREIGN_SOURCE)
    }
}

/// What message `m` of a routed topic is. `own_source` is this outbox's
/// source identity (`None` when the store has none: then every message
/// carrying an `outbox-source` is another outbox's); `declared` the other
/// outboxes declared to write these topics; `known` which of the page's
/// eventIds the outbox committed; `copies` what the store recorded of them.
pub fn judge_scanned(m: &ScannedMessage, own_source: Option<&str>, declared: &[String], known: &BTreeSet<String>, copies: &KnownCopies) -> ScanJudgement {
    let foreign = m.source.as_deref().filter(|s| Some(*s) != own_source);
    if foreign.is_some_and(|s| declared.iter().any(|d| d == s)) {
        return ScanJudgement::Ignored;
    }
    if foreign.is_some() {
        return ScanJudgement::Finding(FOREIGN_SOURCE);
    }
    let Some(id) = m.event_id.as_ref().filter(|id| known.contains(*id)) else { return ScanJudgement::Finding(BYPASS_PUBLISH) };
    if copies.recorded.contains(&(id.clone(), m.topic_id.clone(), m.offset)) {
        return ScanJudgement::Accounted;
    }
    // A copy of an attempt closed without a receipt, published or not: its
    // ACK may never come (its sender died), and no lookup asks about a
    // closed attempt again.
    if m.attempt_id.as_ref().is_some_and(|a| copies.closed.contains(a)) {
        return ScanJudgement::Finding(ABSENCE_PROOF_REFUTED);
    }
    // A copy whose attempt may still be answered is judged again later,
    // whether its event is published yet or not: another attempt may
    // publish the event meanwhile, and then nothing asks about this one.
    if m.attempt_id.as_ref().is_some_and(|a| copies.in_flight.contains(a)) {
        return ScanJudgement::Wait;
    }
    // Past its bound, a copy of an open attempt of an event not published
    // yet is what a lookup would find: the receipt transaction takes it
    // now. Left to a lookup, it was lost when another attempt's receipt
    // published the event first (a lookup begun before this copy was
    // written; or a log the lookup cannot read from the attempt's floor).
    let unpublished = !copies.published.contains_key(id);
    if unpublished && m.receipt.is_some() && m.attempt_id.as_ref().is_some_and(|a| copies.unanswerable.contains(a)) {
        return ScanJudgement::Submit;
    }
    let Some(published) = copies.published.get(id) else { return ScanJudgement::Accounted };
    // The same bytes under the frozen key: a transport copy no receipt
    // records. Other bytes, or the same bytes under another key (or none:
    // a consumer partitioning by key sees the event under that one, and it
    // sits in that key's compaction chain): a divergent copy.
    let same_key = m.key.as_deref() == Some(published.routing_key.as_bytes());
    ScanJudgement::Finding(if published.payload_digest == m.payload_digest && same_key { UNRECORDED_COPY } else { DIVERGENT_COPY })
}

/// Where the scan's cursor goes after a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorMove {
    /// Back to offset 0: the log ends below the cursor, so it is another
    /// log (the topic recreated, the cluster replaced), read from its start.
    Restart,
    /// Forward to this offset (never backwards: a store keeps the greater).
    Advance(i64),
}

/// The offsets `[cursor, log start)` a page read from `cursor` could not
/// read because the log's start had moved past them (retention,
/// DeleteRecords): the bypass check's coverage has a gap there
/// ([`SCAN_GAP`]). `None` when the adapter does not know the start, when
/// nothing below it was unread, and when the log ends below the cursor (a
/// replaced log, read again from its start: [`CursorMove::Restart`]).
pub fn unread_range(cursor: i64, scan: &PartitionScan) -> Option<(i64, i64)> {
    let start = scan.log_start?;
    (!ends_below(cursor, scan) && cursor < start).then_some((cursor, start))
}

/// The log ends below the cursor: another log than the one the cursor was
/// moved in (the topic recreated, the cluster replaced).
fn ends_below(cursor: i64, scan: &PartitionScan) -> bool {
    scan.log_end.is_some_and(|end| cursor > end)
}

/// The name a [`SCAN_GAP`] finding carries in place of an event id: the
/// partition and its unread offsets, `topic/partition@from..to`.
pub fn scan_gap_label(topic: &str, partition: i32, (from, to): (i64, i64)) -> String {
    format!("{topic}/{partition}@{from}..{to}")
}

/// The name a [`PARTITION_COUNT_CHANGED`] finding carries in place of an
/// event id: the topic, `topic/partitions`.
pub fn partition_count_label(topic: &str) -> String {
    format!("{topic}/partitions")
}

/// Whether the partition count `actual` the cluster reports for `topic`
/// differs from what its current routes froze (`routes`: event type and
/// frozen count); answers the finding's words. Fewer partitions than a
/// route froze stalls its events on the missing ones (a send there is
/// refused; they stay PENDING); more leaves the extra ones unused by the
/// outbox (the partition of an event is frozen with it), which an operator
/// should still know of.
pub fn partition_count_finding(cluster_id: &str, topic: &str, actual: u32, routes: &[(String, i32)]) -> Option<String> {
    let differ: Vec<&(String, i32)> = routes.iter().filter(|(_, frozen)| i64::from(*frozen) != i64::from(actual)).collect();
    let most = differ.iter().map(|(_, n)| *n).max()?;
    let named: Vec<String> = differ.iter().map(|(t, n)| format!("{t} ({n})")).collect();
    Some(if i64::from(most) > i64::from(actual) {
        format!(
            "topic {cluster_id}/{topic} has {actual} partitions; its route policies froze more: {}. Events routed to partitions {actual}..{most} cannot be sent and wait (PENDING), and receipts there name positions the cluster no longer has. Bring the partitions back (increase the topic's partition count to {most}) or migrate the waiting events to a route that matches the topic (docs/OPERATIONS.md, \"A changed partition count\")",
            named.join(", ")
        )
    } else {
        format!(
            "topic {cluster_id}/{topic} has {actual} partitions; its route policies froze fewer: {}. The outbox sends nothing to the extra partitions (each event's partition is frozen with it); revise the route (`outbox route set`) if new events should use them (docs/OPERATIONS.md, \"A changed partition count\")",
            named.join(", ")
        )
    })
}

/// The unread offsets a [`scan_gap_label`] names.
pub fn scan_gap_range(label: &str) -> Option<(i64, i64)> {
    let (_, range) = label.rsplit_once('@')?;
    let (from, to) = range.split_once("..")?;
    Some((from.parse().ok()?, to.parse().ok()?))
}

/// The cursor after a page read from `cursor`: at the first copy that was
/// waited for ([`ScanJudgement::Wait`], so that it is judged again), else
/// at the page's next offset; back to the start when the log ends below the cursor.
pub fn next_bypass_cursor(cursor: i64, scan: &PartitionScan, first_wait: Option<i64>) -> CursorMove {
    if ends_below(cursor, scan) {
        return CursorMove::Restart;
    }
    CursorMove::Advance(first_wait.unwrap_or(scan.next_offset))
}

/// What makes message `m` recognisable at its offset: a digest of its
/// offset, eventId, attemptId and payload digest. A bypass cursor keeps the
/// anchor of the message below it ([`crate::log::BypassCursor`]).
pub fn scan_anchor(m: &ScannedMessage) -> String {
    let text = format!("{}\n{}\n{}\n{}", m.offset, m.event_id.as_deref().unwrap_or(""), m.attempt_id.as_deref().unwrap_or(""), m.payload_digest);
    crate::canonical::sha256_digest(text.as_bytes())
}

/// For a page read from `cursor.next_offset - 1` (one below the cursor,
/// when it has an anchor): takes the message at that offset out of `scan`
/// and says whether it is another message than the one the cursor was
/// anchored on. `true` proves the log was replaced (a cluster come back
/// empty, a topic recreated) and has grown past the cursor since: the
/// offset alone cannot tell, and the new log is read from its start. A
/// message not read there (below the log's start, compacted) proves
/// nothing; the page is judged as it is.
pub fn take_scan_anchor(cursor: &crate::log::BypassCursor, scan: &mut PartitionScan) -> bool {
    let Some(anchor) = cursor.anchor.as_deref().filter(|_| cursor.next_offset > 0) else { return false };
    let below = cursor.next_offset - 1;
    let Some(i) = scan.messages.iter().position(|m| m.offset == below) else {
        scan.messages.retain(|m| m.offset >= cursor.next_offset);
        return false;
    };
    let m = scan.messages.remove(i);
    scan.messages.retain(|m| m.offset >= cursor.next_offset);
    scan_anchor(&m) != anchor
}

/// The anchor for a cursor moved to `to`: the anchor of the message at
/// `to - 1` among `messages`, if the page read it.
pub fn anchor_below<'a>(to: i64, messages: impl IntoIterator<Item = &'a ScannedMessage>) -> Option<String> {
    messages.into_iter().find(|m| m.offset == to - 1).map(scan_anchor)
}

/// The offset of the first message of `judged` that is waited for.
pub fn first_wait<'a>(judged: impl IntoIterator<Item = (&'a ScannedMessage, ScanJudgement)>) -> Option<i64> {
    judged.into_iter().find(|(_, j)| *j == ScanJudgement::Wait).map(|(m, _)| m.offset)
}

/// Why a recorded receipt's position is lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PositionLost {
    /// The position now holds another message: another event's, one
    /// without an eventId (`holder` `None`), or the same event's of
    /// another topic id.
    HoldsOther {
        /// The eventId of the message there.
        holder: Option<String>,
        /// The topic id that message names.
        topic_id: Option<String>,
    },
    /// The position lies at or beyond the log's end.
    BeyondEnd {
        /// The log's end when the scan began.
        end: i64,
    },
    /// The position holds the message another event's primary receipt
    /// recorded there, of the same topic id, in an earlier position epoch
    /// than this receipt's: the log was not replaced since that receipt (it
    /// still holds what that receipt recorded), so this receipt, accepted
    /// as if in a later log, never matched the log. It was written without
    /// the broker's acknowledgement (a forged or corrupted row), or the log
    /// was restored from an older copy; it is not a lost log, and its
    /// event's message may never have been written. Decided by
    /// [`never_matched`] for a [`PositionLost::HoldsOther`].
    NeverMatched {
        /// The event whose message is there, and whose receipt recorded it.
        holder: String,
        /// The position epoch of that receipt.
        holder_epoch: i32,
        /// The position epoch of the receipt that never matched.
        epoch: i32,
    },
}

/// Whether primary receipt `r` of the scanned partition names a position
/// the log no longer has: at a scanned offset that now holds another
/// message (receipts of any topic id: the log read is the topic's current
/// one), or at or beyond the log's end. Duplicate receipts are not judged.
/// Receipts at offsets the page did not read are not judged either.
/// Whether a [`PositionLost::HoldsOther`] is a receipt that never matched
/// the log instead is [`never_matched`]'s decision.
pub fn receipt_position_lost(scan: &PartitionScan, r: &RecordedReceipt) -> Option<PositionLost> {
    if !r.primary {
        return None;
    }
    if let Some(m) = scan.messages.iter().find(|m| m.offset == r.offset) {
        let same = m.event_id.as_deref() == Some(r.event_id.as_str()) && m.topic_id == r.topic_id;
        return (!same).then(|| PositionLost::HoldsOther { holder: m.event_id.clone(), topic_id: m.topic_id.clone() });
    }
    scan.log_end.filter(|end| r.offset >= *end).map(|end| PositionLost::BeyondEnd { end })
}

/// A primary receipt at a log position with its position epoch, as the
/// store recorded it: the receipts of one position (cluster, topic, topic
/// id, partition, offset) in the order it accepted them, each one epoch
/// above the receipts whose log it found gone there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PositionEpoch {
    /// Its event.
    pub event_id: String,
    /// The topic id it names (`None`: `destination.v1`).
    pub topic_id: Option<String>,
    /// Its offset.
    pub offset: i64,
    /// Its position epoch.
    pub position_epoch: i32,
}

/// The position epoch of a primary receipt being accepted at its position
/// (cluster, topic, topic id, partition, offset), from the newest primary
/// receipt the store holds there (`newest_here`: its event and epoch;
/// `None`: none). Another event's receipt there means the log that receipt
/// was written to is gone (offsets are unique within one log): the new
/// receipt is accepted one epoch above it, the old one stays as evidence.
/// Otherwise (no receipt there, or `event_id`'s own) the epoch is 0. Both
/// stores assign epochs with it; retention reads them
/// ([`crate::LogPosition::on_replaced_unnamed_log`]).
pub fn next_position_epoch(newest_here: Option<(&str, i32)>, event_id: &str) -> i32 {
    match newest_here {
        Some((holder, epoch)) if holder != event_id => epoch.saturating_add(1),
        _ => 0,
    }
}

/// Whether primary receipt `r`, whose position holds another message
/// (`lost` is [`PositionLost::HoldsOther`]), never matched the log rather
/// than lost it: the message there is the one another event's primary
/// receipt of the same topic id recorded there in an earlier position epoch
/// than `r`'s (`epochs`: the primary receipts the store holds at `r`'s
/// position, any topic id, `r` among them). A receipt is accepted one epoch
/// above the receipts of its position only when a genuine message of a
/// later log sits there, and a log never goes back to an earlier one; so
/// the log was not replaced since that earlier receipt, and `r` was written
/// without a genuine ACK (forged, or a corrupted row) or the log restored
/// from an older copy. Answers [`PositionLost::NeverMatched`] then, `None`
/// otherwise: a message no earlier receipt recorded (a bypass publish, a
/// message without an eventId, a later epoch's) cannot tell a replaced log
/// from a receipt that never matched, and stays a lost position.
pub fn never_matched(lost: &PositionLost, r: &RecordedReceipt, epochs: &[PositionEpoch]) -> Option<PositionLost> {
    let PositionLost::HoldsOther { holder: Some(holder), topic_id } = lost else { return None };
    if !r.primary || *topic_id != r.topic_id {
        return None;
    }
    let at = |e: &PositionEpoch, event: &str| e.offset == r.offset && e.topic_id == r.topic_id && e.event_id == event;
    let own = epochs.iter().find(|e| at(e, &r.event_id))?.position_epoch;
    let earlier = epochs.iter().find(|e| at(e, holder) && e.position_epoch < own)?;
    Some(PositionLost::NeverMatched { holder: holder.clone(), holder_epoch: earlier.position_epoch, epoch: own })
}

/// Receipts at or beyond the log's end are judged only when accepted
/// before this time (the scan's time less the clock skew allowance): a
/// receipt accepted just now may name a position the scan's end, fetched
/// first, did not reach yet.
pub fn beyond_end_accepted_before_ms(now_ms: i64, clock_skew_allowance_ms: i64) -> i64 {
    now_ms.saturating_sub(clock_skew_allowance_ms)
}

// A broker whose reported end is below records it serves (issue 48.6).

/// The read past a partition's reported end `end` that can tell whether the
/// primary receipts `beyond` (at or beyond it) still hold their events: from
/// the lowest such offset, as many messages as reach the highest, at most
/// `max_messages`. `None` when no primary receipt is at or beyond `end`.
/// Receipts above the range read stay unverified ([`served_past_reported_end`]
/// is false for them).
pub fn past_end_read(end: i64, beyond: &[RecordedReceipt], max_messages: u64) -> Option<(i64, u64)> {
    let offsets = beyond.iter().filter(|r| r.primary && r.offset >= end).map(|r| r.offset);
    let (low, high) = offsets.fold(None, |acc: Option<(i64, i64)>, o| Some(acc.map_or((o, o), |(l, h)| (l.min(o), h.max(o)))))?;
    let span = u64::try_from(high - low).unwrap_or(u64::MAX).saturating_add(1);
    Some((low, span.min(max_messages.max(1))))
}

/// Whether primary receipt `r`, at or beyond the partition's reported end
/// ([`PositionLost::BeyondEnd`]), names a message the broker still serves:
/// `served`, read past that end
/// ([`Broker::read_past_reported_end`](crate::Broker::read_past_reported_end)),
/// holds at the receipt's offset the receipt's event, of the receipt's topic
/// id. Then the log is not lost but its end under-reported (tansu 0.6
/// reports a partition's end as its last produce batch's base offset + 1):
/// no `receipt_position_lost`. A receipt whose offset holds another message,
/// or nothing, or that was not read, is not served.
pub fn served_past_reported_end(r: &RecordedReceipt, served: &[ScannedMessage]) -> bool {
    r.primary && served.iter().any(|m| m.offset == r.offset && m.event_id.as_deref() == Some(r.event_id.as_str()) && m.topic_id == r.topic_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::AttemptState;

    fn msg(offset: i64, event_id: Option<&str>, attempt: Option<&str>, digest: &str) -> ScannedMessage {
        ScannedMessage {
            offset,
            event_id: event_id.map(str::to_owned),
            key: Some(b"k-a".to_vec()),
            payload_digest: digest.to_owned(),
            source: None,
            attempt_id: attempt.map(str::to_owned),
            topic_id: None,
            receipt: None,
        }
    }

    const P: RetryPolicy = RetryPolicy { allow_retry: true, max_attempts: 3, in_flight_bound_ms: 1_000, recheck_ms: 500 };

    fn known(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    fn copies(open: &[AttemptRecord], now_ms: i64) -> KnownCopies {
        let receipts = [
            RecordedReceipt { event_id: "evt-a".into(), topic_id: None, offset: 10, primary: true },
            RecordedReceipt { event_id: "evt-a".into(), topic_id: None, offset: 11, primary: false },
        ];
        let published = [("evt-a".to_owned(), PublishedCopy { payload_digest: "sha256:a".into(), routing_key: "k-a".into() })].into_iter().collect();
        KnownCopies::new(&receipts, published, open, &P, now_ms)
    }

    #[test]
    fn a_receipt_at_another_events_position_is_one_epoch_above_it() {
        assert_eq!(next_position_epoch(None, "evt-b"), 0);
        assert_eq!(next_position_epoch(Some(("evt-a", 0)), "evt-b"), 1);
        assert_eq!(next_position_epoch(Some(("evt-b", 1)), "evt-c"), 2);
        assert_eq!(next_position_epoch(Some(("evt-b", 1)), "evt-b"), 0);
    }

    #[test]
    fn a_message_is_judged_by_its_event_its_position_and_its_source() {
        let c = copies(&[], 0);
        let k = known(&["evt-a", "evt-b"]);
        let j = |m: &ScannedMessage| judge_scanned(m, None, &[], &k, &c);
        assert_eq!(j(&msg(10, Some("evt-a"), Some("att-1"), "sha256:a")), ScanJudgement::Accounted, "the primary receipt's position");
        assert_eq!(j(&msg(11, Some("evt-a"), Some("att-2"), "sha256:a")), ScanJudgement::Accounted, "a duplicate receipt's position");
        assert_eq!(j(&msg(12, Some("evt-a"), Some("att-2"), "sha256:a")), ScanJudgement::Finding(UNRECORDED_COPY));
        assert_eq!(j(&msg(13, Some("evt-a"), Some("att-2"), "sha256:x")), ScanJudgement::Finding(DIVERGENT_COPY));
        // The same bytes under another key, or under none: divergent too.
        let rekeyed = ScannedMessage { key: Some(b"k-b".to_vec()), ..msg(17, Some("evt-a"), Some("att-2"), "sha256:a") };
        assert_eq!(j(&rekeyed), ScanJudgement::Finding(DIVERGENT_COPY), "a copy under another key");
        let keyless = ScannedMessage { key: None, ..msg(18, Some("evt-a"), Some("att-2"), "sha256:a") };
        assert_eq!(j(&keyless), ScanJudgement::Finding(DIVERGENT_COPY), "a copy without a key");
        assert_eq!(j(&msg(14, Some("evt-b"), Some("att-3"), "sha256:b")), ScanJudgement::Accounted, "not published: the reconciler looks it up");
        assert_eq!(j(&msg(15, Some("evt-zzz"), None, "sha256:z")), ScanJudgement::Finding(BYPASS_PUBLISH));
        assert_eq!(j(&msg(16, None, None, "sha256:z")), ScanJudgement::Finding(BYPASS_PUBLISH));
        // A receipt of another topic id does not account for this log's position.
        let other_log = ScannedMessage { topic_id: Some("t-2".into()), ..msg(10, Some("evt-a"), Some("att-1"), "sha256:a") };
        assert_eq!(j(&other_log), ScanJudgement::Finding(UNRECORDED_COPY));
        assert!(ScanJudgement::Finding(BYPASS_PUBLISH).is_bypass_message() && ScanJudgement::Finding(FOREIGN_SOURCE).is_bypass_message());
        assert!(!ScanJudgement::Finding(UNRECORDED_COPY).is_bypass_message() && !ScanJudgement::Wait.is_bypass_message());
    }

    #[test]
    fn sources_other_than_this_outboxs_are_foreign_unless_declared() {
        let c = copies(&[], 0);
        let k = known(&["evt-a"]);
        let declared = vec!["urn:other".to_owned()];
        let from = |s: &str| ScannedMessage { source: Some(s.to_owned()), ..msg(12, Some("evt-a"), None, "sha256:a") };
        assert_eq!(judge_scanned(&from("urn:me"), Some("urn:me"), &declared, &k, &c), ScanJudgement::Finding(UNRECORDED_COPY));
        assert_eq!(judge_scanned(&from("urn:other"), Some("urn:me"), &declared, &k, &c), ScanJudgement::Ignored);
        assert_eq!(judge_scanned(&from("urn:third"), Some("urn:me"), &declared, &k, &c), ScanJudgement::Finding(FOREIGN_SOURCE));
        assert_eq!(judge_scanned(&from("urn:me"), None, &[], &k, &c), ScanJudgement::Finding(FOREIGN_SOURCE), "a store without identity owns no source");
    }

    #[test]
    fn a_copy_of_an_open_attempt_is_waited_for_until_its_in_flight_bound() {
        let mut a = crate::receipt::sample_attempt(AttemptState::Unknown, 1_000, 0);
        a.attempt_id = crate::id::AttemptId::from_parts(1, 7);
        a.send_deadline_ms = Some(1_000);
        let id = a.attempt_id.to_string();
        let k = known(&["evt-a"]);
        let m = msg(12, Some("evt-a"), Some(&id), "sha256:a");
        assert_eq!(judge_scanned(&m, None, &[], &k, &copies(std::slice::from_ref(&a), 1_999)), ScanJudgement::Wait);
        assert_eq!(judge_scanned(&m, None, &[], &k, &copies(std::slice::from_ref(&a), 2_000)), ScanJudgement::Finding(UNRECORDED_COPY));
        a.state = AttemptState::Acked;
        assert_eq!(judge_scanned(&m, None, &[], &k, &copies(std::slice::from_ref(&a), 1_500)), ScanJudgement::Finding(UNRECORDED_COPY), "only an open attempt is waited for");
        // Of an event not published yet, too: judged again after the bound.
        a.state = AttemptState::Sending;
        let k = known(&["evt-a", "evt-b"]);
        let unpublished = msg(14, Some("evt-b"), Some(&id), "sha256:b");
        assert_eq!(judge_scanned(&unpublished, None, &[], &k, &copies(std::slice::from_ref(&a), 1_999)), ScanJudgement::Wait);
        assert_eq!(judge_scanned(&unpublished, None, &[], &k, &copies(std::slice::from_ref(&a), 2_000)), ScanJudgement::Accounted, "headers that do not parse: no receipt to hand on");
        // Past the bound, a copy whose headers claim a receipt goes to the
        // receipt transaction: no answer will come, and a lookup may miss it.
        let claimed = ScannedMessage { receipt: Some(crate::receipt::sample_receipt(14)), ..unpublished.clone() };
        assert_eq!(judge_scanned(&claimed, None, &[], &k, &copies(std::slice::from_ref(&a), 1_999)), ScanJudgement::Wait);
        assert_eq!(judge_scanned(&claimed, None, &[], &k, &copies(std::slice::from_ref(&a), 2_000)), ScanJudgement::Submit);
        // Of a published event it is a copy no receipt records, as before.
        let published = ScannedMessage { receipt: Some(crate::receipt::sample_receipt(12)), ..m.clone() };
        assert_eq!(judge_scanned(&published, None, &[], &k, &copies(std::slice::from_ref(&a), 2_000)), ScanJudgement::Finding(UNRECORDED_COPY));
    }

    /// A copy of an attempt closed without a receipt refutes what closed
    /// it, whether its event is published by another attempt or not yet:
    /// judged `Accounted` while the event was unpublished, such a copy (a
    /// paused host's late write after the proof, its sender killed) was
    /// passed over for ever once another attempt published the event.
    #[test]
    fn a_copy_of_an_attempt_closed_without_a_receipt_refutes_its_closing() {
        let k = known(&["evt-a", "evt-b"]);
        for state in [AttemptState::Absent, AttemptState::NotSent] {
            let mut a = crate::receipt::sample_attempt(state, 1_000, 0);
            a.attempt_id = crate::id::AttemptId::from_parts(1, 9);
            let id = a.attempt_id.to_string();
            let c = copies(std::slice::from_ref(&a), 5_000);
            assert_eq!(judge_scanned(&msg(12, Some("evt-a"), Some(&id), "sha256:a"), None, &[], &k, &c), ScanJudgement::Finding(ABSENCE_PROOF_REFUTED), "{state:?}, published");
            assert_eq!(judge_scanned(&msg(14, Some("evt-b"), Some(&id), "sha256:b"), None, &[], &k, &c), ScanJudgement::Finding(ABSENCE_PROOF_REFUTED), "{state:?}, not published");
            assert_eq!(judge_scanned(&msg(10, Some("evt-a"), Some(&id), "sha256:a"), None, &[], &k, &c), ScanJudgement::Accounted, "a recorded position stays accounted");
        }
    }

    #[test]
    fn the_cursor_waits_at_the_first_waiting_copy_and_restarts_below_a_replaced_logs_end() {
        let scan = PartitionScan { messages: vec![msg(5, None, None, ""), msg(6, None, None, ""), msg(7, None, None, "")], next_offset: 8, log_end: Some(8), log_start: None };
        let judged = [ScanJudgement::Accounted, ScanJudgement::Wait, ScanJudgement::Wait];
        let wait = first_wait(scan.messages.iter().zip(judged));
        assert_eq!(wait, Some(6));
        assert_eq!(next_bypass_cursor(5, &scan, wait), CursorMove::Advance(6));
        assert_eq!(next_bypass_cursor(5, &scan, None), CursorMove::Advance(8));
        assert_eq!(next_bypass_cursor(8, &scan, None), CursorMove::Advance(8), "at the end is not beyond it");
        assert_eq!(next_bypass_cursor(9, &scan, None), CursorMove::Restart);
        assert_eq!(next_bypass_cursor(9, &PartitionScan { log_end: None, ..scan }, None), CursorMove::Advance(8), "an end the adapter does not know restarts nothing");
    }

    /// Offsets the log's start moved past before the scan read them are a
    /// gap; a start the adapter does not know, one at or below the cursor,
    /// and a log ending below the cursor (another log, read from its start)
    /// are not.
    #[test]
    fn offsets_deleted_before_the_scan_read_them_are_a_gap() {
        let scan = |start: Option<i64>, end: i64| PartitionScan { messages: Vec::new(), next_offset: end, log_end: Some(end), log_start: start };
        assert_eq!(unread_range(3, &scan(Some(7), 9)), Some((3, 7)));
        assert_eq!(unread_range(0, &scan(Some(1), 1)), Some((0, 1)), "a cursor at 0: history before it, or a new log's first copies");
        assert_eq!(unread_range(7, &scan(Some(7), 9)), None);
        assert_eq!(unread_range(8, &scan(Some(7), 9)), None);
        assert_eq!(unread_range(3, &scan(None, 9)), None);
        assert_eq!(unread_range(12, &scan(Some(10), 11)), None, "the log ends below the cursor: restarted, not a gap");
        assert_eq!(scan_gap_label("orders", 2, (3, 7)), "orders/2@3..7");
        let routes = vec![("order.created".to_owned(), 6), ("order.paid".to_owned(), 4)];
        let fewer = partition_count_finding("k", "orders", 4, &routes).unwrap();
        assert!(fewer.contains("has 4 partitions") && fewer.contains("order.created (6)") && !fewer.contains("order.paid") && fewer.contains("partitions 4..6"), "{fewer}");
        let more = partition_count_finding("k", "orders", 8, &routes).unwrap();
        assert!(more.contains("froze fewer") && more.contains("order.created (6), order.paid (4)"), "{more}");
        assert_eq!(partition_count_finding("k", "orders", 6, &routes[..1]), None);
        assert_eq!(partition_count_finding("k", "orders", 6, &[]), None);
        assert_eq!(scan_gap_range(&scan_gap_label("a@b.c", 2, (3, 7))), Some((3, 7)));
        assert_eq!(scan_gap_range("evt-x"), None);
    }

    /// A replaced log that grew past the cursor before the scan came back
    /// (seed 116239 of the 1,000,000-trace gate: the cluster replaced, the
    /// new log's first message, a copy whose ACK was lost, passed over).
    #[test]
    fn a_cursor_recognises_its_log_by_the_message_below_it() {
        let old = msg(4, Some("evt-a"), Some("att-1"), "sha256:a");
        let cursor = crate::log::BypassCursor { next_offset: 5, anchor: Some(scan_anchor(&old)) };
        let page = |below: ScannedMessage| PartitionScan { messages: vec![below, msg(5, Some("evt-b"), None, "sha256:b")], next_offset: 6, log_end: Some(6), log_start: None };
        let mut same = page(old.clone());
        assert!(!take_scan_anchor(&cursor, &mut same), "the same message: the same log");
        assert_eq!(same.messages.iter().map(|m| m.offset).collect::<Vec<_>>(), vec![5], "the anchor's message is not judged again");
        for other in [msg(4, Some("evt-z"), Some("att-9"), "sha256:z"), msg(4, Some("evt-a"), Some("att-2"), "sha256:a"), msg(4, Some("evt-a"), Some("att-1"), "sha256:x")] {
            assert!(take_scan_anchor(&cursor, &mut page(other.clone())), "{other:?}: another log");
        }
        // Not read (below the log's start, compacted): nothing proven.
        let mut unread = PartitionScan { messages: vec![msg(5, Some("evt-b"), None, "sha256:b")], next_offset: 6, log_end: Some(6), log_start: None };
        assert!(!take_scan_anchor(&cursor, &mut unread));
        assert_eq!(unread.messages.len(), 1);
        // No anchor (a cursor at 0, or written before anchors were kept): nothing to check.
        let bare = crate::log::BypassCursor { next_offset: 5, anchor: None };
        assert!(!take_scan_anchor(&bare, &mut page(msg(4, Some("evt-z"), None, "sha256:z"))));
        assert_eq!(anchor_below(6, &page(old.clone()).messages), Some(scan_anchor(&msg(5, Some("evt-b"), None, "sha256:b"))));
        assert_eq!(anchor_below(9, &page(old).messages), None);
    }

    /// Defect (outside read): a receipt row written without a genuine ACK
    /// (forged by the dispatcher role, or corrupted) at a position that
    /// holds another event's message was reported as a lost log. When the
    /// message there is the one another event's receipt of the same log
    /// recorded in an earlier position epoch, the log was not replaced: the
    /// later receipt never matched it. A later epoch's holder (the genuine
    /// ACK of a new log that found this receipt's log gone), another topic
    /// id, a message no receipt recorded, or a message without an eventId
    /// still read as a lost log.
    #[test]
    fn a_receipt_above_the_epoch_of_the_message_there_never_matched_the_log() {
        let scan = PartitionScan { messages: vec![msg(3, Some("evt-a"), None, ""), msg(4, None, None, "")], next_offset: 5, log_end: Some(5), log_start: None };
        let r = |e: &str, offset: i64| RecordedReceipt { event_id: e.into(), topic_id: None, offset, primary: true };
        let at = |e: &str, epoch: i32, topic_id: Option<&str>| PositionEpoch { event_id: e.into(), topic_id: topic_id.map(Into::into), offset: 3, position_epoch: epoch };
        let forged = r("evt-x", 3);
        let lost = receipt_position_lost(&scan, &forged).unwrap();
        assert_eq!(lost, PositionLost::HoldsOther { holder: Some("evt-a".into()), topic_id: None });
        assert_eq!(
            never_matched(&lost, &forged, &[at("evt-a", 0, None), at("evt-x", 1, None)]),
            Some(PositionLost::NeverMatched { holder: "evt-a".into(), holder_epoch: 0, epoch: 1 })
        );
        // The genuine lost log: the receipt there is older than the holder's.
        assert_eq!(never_matched(&lost, &forged, &[at("evt-x", 0, None), at("evt-a", 1, None)]), None);
        // No receipt recorded the message there: nothing tells the cases apart.
        assert_eq!(never_matched(&lost, &forged, &[at("evt-x", 1, None)]), None);
        assert_eq!(never_matched(&lost, &forged, &[]), None, "a store that keeps no epochs");
        // The holder's receipt of another log (another topic id) says nothing of this one.
        assert_eq!(never_matched(&lost, &forged, &[at("evt-a", 0, Some("AAECAwQFBgcICQoLDA0ODw")), at("evt-x", 1, None)]), None);
        // A receipt naming another topic id than the message there: another log.
        let other_log = RecordedReceipt { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), ..forged.clone() };
        let lost_other = receipt_position_lost(&scan, &other_log).unwrap();
        assert_eq!(never_matched(&lost_other, &other_log, &[at("evt-a", 0, None), at("evt-x", 1, Some("AAECAwQFBgcICQoLDA0ODw"))]), None);
        // A message without an eventId, and the other kinds of loss.
        let at4 = r("evt-x", 4);
        let lost4 = receipt_position_lost(&scan, &at4).unwrap();
        assert_eq!(never_matched(&lost4, &at4, &[PositionEpoch { offset: 4, ..at("evt-x", 1, None) }]), None);
        assert_eq!(never_matched(&PositionLost::BeyondEnd { end: 5 }, &r("evt-x", 9), &[]), None);
    }

    #[test]
    fn a_receipt_whose_position_holds_another_message_or_lies_beyond_the_end_is_lost() {
        let scan = PartitionScan {
            messages: vec![msg(3, Some("evt-a"), None, ""), msg(4, None, None, ""), ScannedMessage { topic_id: Some("t-2".into()), ..msg(5, Some("evt-c"), None, "") }],
            next_offset: 6,
            log_end: Some(6),
            log_start: None,
        };
        let r = |e: &str, offset: i64, primary: bool| RecordedReceipt { event_id: e.into(), topic_id: None, offset, primary };
        assert_eq!(receipt_position_lost(&scan, &r("evt-a", 3, true)), None);
        assert_eq!(receipt_position_lost(&scan, &r("evt-b", 3, true)), Some(PositionLost::HoldsOther { holder: Some("evt-a".into()), topic_id: None }));
        assert_eq!(receipt_position_lost(&scan, &r("evt-b", 4, true)), Some(PositionLost::HoldsOther { holder: None, topic_id: None }));
        assert_eq!(receipt_position_lost(&scan, &r("evt-c", 5, true)), Some(PositionLost::HoldsOther { holder: Some("evt-c".into()), topic_id: Some("t-2".into()) }));
        assert_eq!(receipt_position_lost(&scan, &r("evt-b", 4, false)), None, "duplicates are not judged");
        assert_eq!(receipt_position_lost(&scan, &r("evt-d", 6, true)), Some(PositionLost::BeyondEnd { end: 6 }));
        assert_eq!(receipt_position_lost(&scan, &r("evt-d", 2, true)), None, "an offset the page did not read");
        assert_eq!(receipt_position_lost(&PartitionScan { log_end: None, ..scan }, &r("evt-d", 60, true)), None);
        assert_eq!(beyond_end_accepted_before_ms(10_000, 2_000), 8_000);
    }
}

#[cfg(test)]
mod under_reported_end_tests {
    use super::*;

    fn served(offset: i64, event_id: Option<&str>, topic_id: Option<&str>) -> ScannedMessage {
        ScannedMessage {
            offset,
            event_id: event_id.map(str::to_owned),
            key: None,
            payload_digest: String::new(),
            source: None,
            attempt_id: None,
            topic_id: topic_id.map(str::to_owned),
            receipt: None,
        }
    }

    fn r(event_id: &str, offset: i64, primary: bool) -> RecordedReceipt {
        RecordedReceipt { event_id: event_id.into(), topic_id: None, offset, primary }
    }

    /// A broker that reports its end at 1 after one batch of offsets 0..=4
    /// (tansu 0.6) and serves them all: the receipts at 1..=4 are beyond
    /// the reported end, and served.
    #[test]
    fn a_receipt_served_past_an_under_reported_end_is_not_lost() {
        let scan = PartitionScan { messages: vec![served(0, Some("evt-0"), None)], next_offset: 1, log_end: Some(1), log_start: Some(0) };
        let beyond: Vec<RecordedReceipt> = (1..=4).map(|o| r(&format!("evt-{o}"), o, true)).collect();
        assert_eq!(past_end_read(1, &beyond, 10_000), Some((1, 4)));
        let read: Vec<ScannedMessage> = (1..=4).map(|o| served(o, Some(&format!("evt-{o}")), None)).collect();
        for receipt in &beyond {
            assert_eq!(receipt_position_lost(&scan, receipt), Some(PositionLost::BeyondEnd { end: 1 }), "beyond the reported end");
            assert!(served_past_reported_end(receipt, &read), "{receipt:?} is served: the end under-reports");
        }
    }

    /// A lost log: nothing served there, another event's message, the same
    /// event of another topic id, or an offset the read did not reach.
    #[test]
    fn a_receipt_whose_offset_holds_other_or_nothing_stays_lost() {
        let receipt = RecordedReceipt { event_id: "evt-a".into(), topic_id: Some("t-1".into()), offset: 7, primary: true };
        assert!(!served_past_reported_end(&receipt, &[]), "nothing served");
        assert!(!served_past_reported_end(&receipt, &[served(7, Some("evt-b"), Some("t-1"))]), "another event there");
        assert!(!served_past_reported_end(&receipt, &[served(7, None, None)]), "a message without an eventId");
        assert!(!served_past_reported_end(&receipt, &[served(7, Some("evt-a"), Some("t-2"))]), "the event of another topic id: another log");
        assert!(!served_past_reported_end(&receipt, &[served(6, Some("evt-a"), Some("t-1"))]), "the event at another offset");
        assert!(served_past_reported_end(&receipt, &[served(6, Some("evt-x"), Some("t-1")), served(7, Some("evt-a"), Some("t-1"))]));
        assert!(!served_past_reported_end(&RecordedReceipt { primary: false, ..receipt }, &[served(7, Some("evt-a"), Some("t-1"))]), "duplicates are not judged");
    }

    #[test]
    fn the_read_past_the_end_spans_the_receipts_beyond_it() {
        assert_eq!(past_end_read(10, &[], 100), None);
        assert_eq!(past_end_read(10, &[r("a", 9, true), r("b", 12, false)], 100), None, "below the end, or not primary");
        assert_eq!(past_end_read(10, &[r("a", 14, true), r("b", 10, true), r("c", 11, true)], 100), Some((10, 5)));
        assert_eq!(past_end_read(10, &[r("a", 10, true), r("b", 5_000, true)], 100), Some((10, 100)), "bounded");
        assert_eq!(past_end_read(0, &[r("a", 3, true)], 0), Some((3, 1)), "at least the lowest");
    }
}
