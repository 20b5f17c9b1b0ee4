//! Reconcile decisions (PROTOCOL §6): what to do with an event whose dispatch
//! outcome is unknown, given its attempts and what the broker answered.

use serde::{Deserialize, Serialize};

use crate::id::{AttemptId, EventId};
use crate::receipt::{AttemptRecord, BrokerReceipt};
use crate::state::{AttemptState, EventState};
use crate::log::LookupOutcome;

/// When a reconciler may re-send, and how often it looks again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Whether a proven-absent event may be re-sent to its frozen destination.
    pub allow_retry: bool,
    /// At most this many attempts per event that may have been delivered
    /// (every attempt but NOT_SENT ones, which the broker definitely did not
    /// persist); beyond it the event stays UNKNOWN and pages.
    pub max_attempts: u32,
    /// An attempt may still be in flight inside the client this long after
    /// the later of its registration and the end of the lease it was sent
    /// under ([`AttemptRecord::in_flight_from_ms`]): no absence proof covers
    /// it before. It must cover the client's longest in-flight time plus a
    /// clock skew allowance ([`check_in_flight_bound`]).
    pub in_flight_bound_ms: i64,
    /// Delay before an unresolved event is looked at again.
    pub recheck_ms: i64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { allow_retry: true, max_attempts: 10, in_flight_bound_ms: 65_000, recheck_ms: 30_000 }
    }
}

/// Why an unknown stays unknown for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecheckReason {
    /// The broker could not be asked.
    BrokerUnavailable,
    /// An attempt may still be in flight inside the client.
    AttemptInFlight,
    /// Policy forbids re-sending.
    RetryNotAllowed,
    /// The attempt budget is spent.
    AttemptsExhausted,
    /// Receipts were found but none filled the slot.
    ReceiptsRefused,
}

/// What the reconciler does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum ReconcileDecision {
    /// Found in the broker: submit every receipt through `acceptDispatchReceipt`
    /// (which accepts, keeps duplicates and quarantines divergence).
    Submit(Vec<BrokerReceipt>),
    /// Nothing in flight and either proven absent, or the adapter cannot look
    /// up and policy allows a blind same-destination retry: RETRY_CLAIMED to
    /// the same frozen destination. Open attempts close as ABSENT only when
    /// `proven_absent`; otherwise they stay UNKNOWN, so a late genuine ACK of
    /// theirs still converges (as the primary or a duplicate receipt).
    Retry {
        /// Whether a lookup proved the frozen partition holds no message of the event.
        proven_absent: bool,
    },
    /// Nothing provable now: back to DISPATCH_UNKNOWN, look again at `next_check_at_ms`.
    Recheck {
        /// Why.
        reason: RecheckReason,
        /// When to look again.
        next_check_at_ms: i64,
    },
}

/// The state a reconciler takes a due event from, and the state its
/// reconcile claim holds it in (PROTOCOL §6). Taking it grants a new claim
/// generation, as a dispatcher's claim does, and clears the claim's attempt
/// id. `PgStore::begin_reconcile_where` writes its states from these.
pub const RECONCILE_FROM: EventState = EventState::DispatchUnknown;
/// See [`RECONCILE_FROM`].
pub const RECONCILE_CLAIM: EventState = EventState::Reconciling;

/// The attempt states a proof of absence closes ABSENT: the attempts that
/// may still be in flight ([`AttemptState::possibly_in_flight`]).
pub const OPEN_ATTEMPT_STATES: [AttemptState; 2] = [AttemptState::Sending, AttemptState::Unknown];

/// What finishing a reconcile writes, under the reconcile claim, on an event
/// still in [`RECONCILE_CLAIM`]: the new state, the claim released (owner,
/// lease and attempt id cleared; the next claim bumps the generation), the
/// recheck's due time, and whether the event's open attempts close ABSENT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileFinish {
    /// The state the event moves to.
    pub to: EventState,
    /// When the event is due for the reconciler again (`None`: unchanged).
    pub next_check_at_ms: Option<i64>,
    /// Whether the attempts in [`OPEN_ATTEMPT_STATES`] become ABSENT.
    pub close_open_attempts: bool,
}

/// The plan of `finish_reconcile` for `decision`; `None` for a submit,
/// whose receipts go through the single acceptance point instead. Both
/// stores apply it: `MemoryStore::finish_reconcile` and
/// `PgStore::finish_reconcile` (one statement, its values bound from the
/// plan).
pub fn plan_reconcile_finish(decision: &ReconcileDecision) -> Option<ReconcileFinish> {
    match decision {
        ReconcileDecision::Submit(_) => None,
        ReconcileDecision::Retry { proven_absent } => {
            Some(ReconcileFinish { to: EventState::RetryClaimed, next_check_at_ms: None, close_open_attempts: *proven_absent })
        }
        ReconcileDecision::Recheck { next_check_at_ms, .. } => {
            Some(ReconcileFinish { to: EventState::DispatchUnknown, next_check_at_ms: Some(*next_check_at_ms), close_open_attempts: false })
        }
    }
}

/// Smallest clock skew allowance a reconciler may be configured with, ms.
pub const MIN_CLOCK_SKEW_ALLOWANCE_MS: i64 = 1_000;
/// Default clock skew allowance, ms.
pub const DEFAULT_CLOCK_SKEW_ALLOWANCE_MS: i64 = 2_000;

/// Checks that `in_flight_bound_ms` covers the longest time a message may
/// stay in the client after it was handed over (`max_in_flight_ms`, when
/// the adapter knows it) plus `clock_skew_allowance_ms` (at least
/// [`MIN_CLOCK_SKEW_ALLOWANCE_MS`]) for the clocks that measured the lease
/// and the registration. The lease itself is covered by counting from the
/// later of registration and lease end: a dispatcher hands a message to the
/// client only before its lease ends.
pub fn check_in_flight_bound(in_flight_bound_ms: i64, max_in_flight_ms: Option<u64>, clock_skew_allowance_ms: i64) -> Result<(), String> {
    if clock_skew_allowance_ms < MIN_CLOCK_SKEW_ALLOWANCE_MS {
        return Err(format!("clock_skew_allowance_ms = {clock_skew_allowance_ms} is below the minimum of {MIN_CLOCK_SKEW_ALLOWANCE_MS} ms"));
    }
    let client = max_in_flight_ms.map_or(0, |m| i64::try_from(m).unwrap_or(i64::MAX));
    let need = client.saturating_add(clock_skew_allowance_ms);
    if in_flight_bound_ms < need {
        return Err(format!(
            "in_flight_bound_ms = {in_flight_bound_ms} is shorter than the {client} ms a message of this broker adapter may stay in the client \
             plus the clock skew allowance of {clock_skew_allowance_ms} ms ({need} ms); an absence proof could miss a message still on its way"
        ));
    }
    Ok(())
}

/// What a reconciler does once it has submitted every receipt a lookup found
/// and the event is still RECONCILING. When each one was refused (messages
/// no registered attempt sent, refused positions), none of them is a
/// message of this event's registered attempts: the lookup proved the same
/// as an empty one, so the absence logic decides. Otherwise look again later.
pub fn decide_after_submit(
    decisions: &[crate::receipt::ReceiptDecision],
    attempts: &[AttemptRecord],
    broker_supports_lookup: bool,
    policy: &RetryPolicy,
    now_ms: i64,
) -> ReconcileDecision {
    if !decisions.is_empty() && decisions.iter().all(|d| matches!(d, crate::receipt::ReceiptDecision::Reject { .. })) {
        return decide_reconcile(attempts, &LookupOutcome::Absent, broker_supports_lookup, policy, now_ms);
    }
    ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, next_check_at_ms: now_ms.saturating_add(policy.recheck_ms) }
}

/// How a lookup's [`LookupOutcome::Unavailable`] reason starts when the log
/// itself cannot prove absence (truncated, recreated, compacted), as opposed
/// to a broker that could not be asked.
pub const LOG_INCOMPLETE: &str = "log incomplete: ";

/// Whether the partition log `[log_start, log_end)` can prove that no message
/// of an event lies at or above `from_offset` (the scan's lower bound): not
/// when the log starts above the bound (retention or deleted records took
/// what was below: messages may be gone unseen), nor when the bound is above
/// the log's end (the log was recreated or truncated since the bound was
/// recorded: it is another log). `Err` is the reason, starting
/// [`LOG_INCOMPLETE`]; a broker adapter answers it as `Unavailable`.
pub fn check_absence_range(topic: &str, partition: i32, from_offset: i64, log_start: i64, log_end: i64) -> Result<(), String> {
    if crate::simulation::mutation_active("absence-from-truncated-log") {
        return Ok(());
    }
    if log_start > from_offset {
        return Err(format!(
            "{LOG_INCOMPLETE}{topic}/{partition} starts at offset {log_start}, above the lower bound {from_offset}: the log was truncated and messages below may be gone"
        ));
    }
    if from_offset > log_end {
        return Err(format!("{LOG_INCOMPLETE}the lower bound {from_offset} of {topic}/{partition} is above its end {log_end}: the log was recreated or truncated since it was recorded"));
    }
    Ok(())
}

/// The end of a partition as far as the broker serves it: the end it
/// reports, or past the last record it served at or beyond that end. A
/// broker may report an end below records it serves (tansu 0.6: its last
/// produce batch's base offset + 1).
pub fn served_end(reported_end: i64, last_served: Option<i64>) -> i64 {
    last_served.map_or(reported_end, |last| reported_end.max(last.saturating_add(1)))
}

/// Where an absence proof of `topic`/`partition` must read to: the end the
/// broker reports, or past what a read from that end still served (its last
/// offset, `None` when it served nothing and reached the partition's end).
/// A proof that stopped at an under-reported end would call a message
/// beyond it absent, and the event would be sent again: a duplicate. A read
/// past the end that failed, ran out of time or stopped before the
/// partition's end cannot tell where the log ends, and proves nothing
/// (`Err`, the reason: the broker could not be asked, not an incomplete log).
pub fn absence_proof_end(topic: &str, partition: i32, reported_end: i64, served_past: Result<Option<i64>, String>) -> Result<i64, String> {
    match served_past {
        Ok(last) => Ok(served_end(reported_end, last)),
        Err(e) => Err(format!("{topic}/{partition} reports its end at {reported_end}, and what it serves past that end could not be read to its end: {e}")),
    }
}

/// Whether an absence proof's read may go on when, expecting offset
/// `next`, it gets the record at `got`: a record above the next expected
/// offset means the offsets between hold no record (a compacted topic,
/// deleted records, transaction markers), and a range with a hole cannot
/// prove absence (a message of the event may have been there). `Err` is the
/// reason, starting [`LOG_INCOMPLETE`]. The Kafka adapter's scan and the
/// simulator's broker both ask it.
pub fn check_no_hole(topic: &str, partition: i32, next: i64, got: i64) -> Result<(), String> {
    if got > next && !crate::simulation::mutation_active("absence-across-holes") {
        return Err(format!("{LOG_INCOMPLETE}offsets [{next}, {got}) of {topic}/{partition} hold no record (a compacted topic, deleted records or transaction markers)"));
    }
    Ok(())
}

/// The lowest offset a scan for this event's messages must start from: the
/// smallest bound among attempts that may have reached the log.
pub fn scan_lower_bound(attempts: &[AttemptRecord]) -> i64 {
    scan_floor(attempts).offset
}

/// Where a lookup's scan for an event's messages starts, and what makes the
/// log that lower bound was read from recognisable.
///
/// A lower bound is the highest receipted offset of the partition when an
/// attempt was registered, plus one: sound for that log only. After the
/// cluster was replaced by an empty one (or a topic without a recorded id
/// was recreated) the same partition is another log, whose messages start
/// at 0 again, and a bound from the old log would hide the new log's
/// messages below it. The anchor names the event whose receipt held
/// `offset - 1`; a lookup reads that offset first (see [`plan_absence_scan`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanFrom {
    /// The lower bound.
    pub offset: i64,
    /// The event whose receipt held `offset - 1` when the bound was taken;
    /// `None` for a bound of 0 and for bounds recorded before anchors were
    /// kept (such a bound is trusted as it is).
    pub anchor: Option<EventId>,
    /// The attempt whose receipt held `offset - 1`, when known: the
    /// anchor's message must be that attempt's ([`anchor_holds`]).
    pub anchor_attempt: Option<AttemptId>,
}

impl ScanFrom {
    /// A bound with no anchor: trusted for whatever log is read.
    pub fn at(offset: i64) -> Self {
        ScanFrom { offset, anchor: None, anchor_attempt: None }
    }
}

/// Whether the message read at a bound's anchor offset, with these
/// `outbox-event-id` and `outbox-attempt-id` headers, is the anchor's: its
/// event, and its attempt when the bound names one. The same event's
/// message written by another attempt (a replaced log that a paused
/// sender's late write reached at the same offset) is another message.
pub fn anchor_holds(from: &ScanFrom, event_id: Option<&[u8]>, attempt_id: Option<&[u8]>) -> bool {
    let Some(anchor) = &from.anchor else { return true };
    event_id == Some(anchor.as_str().as_bytes()) && from.anchor_attempt.as_ref().is_none_or(|a| attempt_id == Some(a.as_str().as_bytes()))
}

/// Whether `attempt` may still be on its way (to the log, or with its ACK
/// to its receipt): open (SENDING or UNKNOWN) and within the in-flight
/// bound, counted from the end of the lease it was sent under. No absence
/// proof covers such an attempt ([`decide_reconcile`] rechecks), and the
/// reconciler's comparison waits for its receipt before it calls its copy
/// unrecorded; past the bound, an open attempt's copy of a published event
/// is a finding (no receipt will come for it: its ACK was lost).
pub fn may_be_in_flight(attempt: &AttemptRecord, policy: &RetryPolicy, now_ms: i64) -> bool {
    attempt.state.possibly_in_flight() && now_ms.saturating_sub(attempt.in_flight_from_ms()) < policy.in_flight_bound_ms
}

/// The registration floor of a partition's log after a primary receipt at
/// `offset` of `event`: the offset past the highest receipted one (where a
/// new attempt's message must lie, the log being append-only) and the event
/// whose receipt holds the offset below it (the anchor that recognises the
/// log, [`plan_absence_scan`]). `current` is the floor before the receipt;
/// `None` for a log with no receipt yet (a new attempt then records 0 and no
/// anchor). A log is (cluster, topic, topic id, partition): a recreated
/// topic's new log starts its own floor.
///
/// `MemoryStore` keeps each log's floor with it as receipts are accepted;
/// `PgStore::register_attempts` computes the same from the receipts table at
/// registration (the highest offset of the log, by position epoch, plus
/// one). Conformance `registration_floor_is_past_the_logs_last_receipt`
/// runs both.
pub fn advance_floor(current: Option<&(i64, EventId, AttemptId)>, offset: i64, event: &EventId, attempt: &AttemptId) -> (i64, EventId, AttemptId) {
    match current {
        Some(floor) if floor.0 > offset => floor.clone(),
        _ => (offset + 1, event.clone(), attempt.clone()),
    }
}

/// [`scan_lower_bound`] with the anchor of the attempt it came from: the
/// smallest bound among attempts that may have reached the log.
pub fn scan_floor(attempts: &[AttemptRecord]) -> ScanFrom {
    attempts
        .iter()
        .filter(|a| a.state.possibly_in_flight())
        .min_by_key(|a| a.scan_from_offset)
        .map(|a| {
            let anchored = a.scan_from_offset > 0;
            ScanFrom {
                offset: a.scan_from_offset.max(0),
                anchor: a.scan_anchor.clone().filter(|_| anchored),
                anchor_attempt: a.scan_anchor_attempt.clone().filter(|_| anchored),
            }
        })
        .unwrap_or_default()
}

/// What a log holds at a lower bound's anchor offset (`offset - 1`), as a
/// broker adapter read it before an absence proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnchorCheck {
    /// The bound has no anchor (0, or recorded before anchors were kept).
    NoAnchor,
    /// The anchor event's message is there: the log is the bound's log.
    Holds,
    /// Another message is there: the log is not the one the bound was read from.
    HoldsOther,
    /// The anchor offset is at or past the log's end: another log.
    BeyondEnd,
    /// No record is there (below the log's start, compacted away, deleted):
    /// which log this is cannot be told.
    NoRecord,
}

/// The anchor offset a broker adapter must read for `from` in a log
/// `[log_start, log_end)`, with the event expected there; or, when the
/// answer is known without reading (no anchor, the offset past the end or
/// below the start), that answer. The adapter turns what it reads at the
/// offset into [`AnchorCheck::Holds`], [`AnchorCheck::HoldsOther`] or
/// [`AnchorCheck::NoRecord`].
pub fn anchor_to_read(from: &ScanFrom, log_start: i64, log_end: i64) -> Result<(i64, &EventId), AnchorCheck> {
    match &from.anchor {
        Some(anchor) if from.offset > 0 => {
            let at = from.offset - 1;
            if at >= log_end {
                Err(AnchorCheck::BeyondEnd)
            } else if at < log_start {
                Err(AnchorCheck::NoRecord)
            } else {
                Ok((at, anchor))
            }
        }
        _ => Err(AnchorCheck::NoAnchor),
    }
}

/// Where an absence proof's scan of a partition log `[log_start, log_end)`
/// starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbsenceScan {
    /// The first offset to read.
    pub start: i64,
    /// The bound belonged to another log (replaced cluster, recreated
    /// topic): this log is read from its start.
    pub floor_from_another_log: bool,
}

/// Decides where an absence proof reads `topic`/`partition` from, given the
/// log's watermarks and what its anchor offset holds.
///
/// - A bound whose anchor holds (or that has none) is a bound of this log:
///   [`check_absence_range`] applies and the scan starts at the bound.
/// - A bound whose anchor offset holds another message, or lies past the
///   log's end, was read from another log: it says nothing of this one, so
///   the scan starts at 0, provided the log still starts there (a log that
///   starts above 0 may have lost the message: no proof).
/// - An anchor offset with no record: no proof either way.
pub fn plan_absence_scan(topic: &str, partition: i32, from: &ScanFrom, log_start: i64, log_end: i64, anchor: AnchorCheck) -> Result<AbsenceScan, String> {
    match anchor {
        AnchorCheck::NoAnchor | AnchorCheck::Holds => {
            check_absence_range(topic, partition, from.offset, log_start, log_end)?;
            Ok(AbsenceScan { start: from.offset.max(log_start).max(0), floor_from_another_log: false })
        }
        AnchorCheck::HoldsOther | AnchorCheck::BeyondEnd => {
            if log_start > 0 && !crate::simulation::mutation_active("absence-from-truncated-log") {
                return Err(format!(
                    "{LOG_INCOMPLETE}{topic}/{partition} is not the log the lower bound {} was read from (offset {} no longer holds its anchor), and it starts at offset {log_start}: messages below may be gone",
                    from.offset,
                    from.offset - 1
                ));
            }
            Ok(AbsenceScan { start: 0, floor_from_another_log: true })
        }
        AnchorCheck::NoRecord => Err(format!(
            "{LOG_INCOMPLETE}offset {} of {topic}/{partition}, the anchor of the lower bound {}, holds no record (the log starts at {log_start}): cannot tell whether this is the log the bound was read from",
            from.offset - 1,
            from.offset
        )),
    }
}

/// Decides the fate of one RECONCILING event.
///
/// Invariant: `Retry` is only ever to the frozen destination (there is no
/// other kind of retry), and only when the lookup proved absence (or the
/// adapter cannot look up at all and policy allows blind same-destination
/// retries) *and* no attempt may still be in flight.
pub fn decide_reconcile(attempts: &[AttemptRecord], lookup: &LookupOutcome, broker_supports_lookup: bool, policy: &RetryPolicy, now_ms: i64) -> ReconcileDecision {
    let recheck = |reason| ReconcileDecision::Recheck { reason, next_check_at_ms: now_ms.saturating_add(policy.recheck_ms) };
    let proven_absent = match lookup {
        LookupOutcome::Found(receipts) if !receipts.is_empty() => return ReconcileDecision::Submit(receipts.clone()),
        LookupOutcome::Found(_) | LookupOutcome::Absent => true,
        LookupOutcome::Unavailable(_) => false,
    };
    if !proven_absent && broker_supports_lookup {
        return recheck(RecheckReason::BrokerUnavailable);
    }
    let in_flight = attempts.iter().any(|a| may_be_in_flight(a, policy, now_ms));
    if in_flight {
        return recheck(RecheckReason::AttemptInFlight);
    }
    if !policy.allow_retry {
        return recheck(RecheckReason::RetryNotAllowed);
    }
    // Only attempts that may have reached the log count: one the broker
    // definitely did not persist (NOT_SENT, e.g. during an outage) spends
    // nothing of the budget.
    let may_have_delivered = attempts.iter().filter(|a| a.state != AttemptState::NotSent).count();
    if may_have_delivered as u32 >= policy.max_attempts {
        return recheck(RecheckReason::AttemptsExhausted);
    }
    ReconcileDecision::Retry { proven_absent }
}

#[cfg(test)]
mod served_end_tests {
    use super::*;

    #[test]
    fn an_absence_proof_reads_to_the_served_end() {
        assert_eq!(served_end(1, None), 1);
        assert_eq!(served_end(1, Some(4)), 5);
        assert_eq!(served_end(5, Some(2)), 5, "a record below the reported end moves nothing");
        assert_eq!(absence_proof_end("t", 0, 1, Ok(Some(4))), Ok(5));
        assert_eq!(absence_proof_end("t", 0, 3, Ok(None)), Ok(3));
        let refused = absence_proof_end("t", 0, 1, Err("timed out".into())).unwrap_err();
        assert!(refused.contains("reports its end at 1") && refused.contains("timed out") && !refused.starts_with(LOG_INCOMPLETE), "{refused}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reconcile_finish_is_a_legal_transition_from_the_reconcile_claim() {
        assert!(RECONCILE_FROM.can_transition_to(RECONCILE_CLAIM));
        let decisions = [
            ReconcileDecision::Retry { proven_absent: true },
            ReconcileDecision::Retry { proven_absent: false },
            ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: 7 },
        ];
        for d in &decisions {
            let plan = plan_reconcile_finish(d).expect("a finish writes");
            assert!(RECONCILE_CLAIM.can_transition_to(plan.to), "{d:?}");
        }
        assert_eq!(plan_reconcile_finish(&decisions[2]).map(|p| p.next_check_at_ms), Some(Some(7)));
        assert!(plan_reconcile_finish(&ReconcileDecision::Submit(vec![])).is_none());
        // Only a proof closes the open attempts; a blind retry leaves them UNKNOWN.
        assert_eq!(decisions.iter().map(|d| plan_reconcile_finish(d).map(|p| p.close_open_attempts)).collect::<Vec<_>>(), vec![Some(true), Some(false), Some(false)]);
        let open: Vec<AttemptState> = crate::state::ALL_ATTEMPT_STATES.into_iter().filter(|s| s.possibly_in_flight()).collect();
        assert_eq!(open, OPEN_ATTEMPT_STATES.to_vec());
    }

    fn attempt(state: AttemptState, started_at_ms: i64, scan_from_offset: i64) -> AttemptRecord {
        crate::receipt::sample_attempt(state, started_at_ms, scan_from_offset)
    }

    const P: RetryPolicy = RetryPolicy { allow_retry: true, max_attempts: 3, in_flight_bound_ms: 1_000, recheck_ms: 500 };

    /// Seed 495754 of the 1,000,000-trace gate: the cluster replaced by an
    /// empty one, a paused sender's late write put the anchor event's
    /// message, of another attempt, at the anchor offset of the new log.
    /// Checked by event alone, the floor was taken for the old log's, and
    /// an absence proof above it passed over a copy below it.
    #[test]
    fn an_anchor_holds_only_with_its_events_message_of_its_attempt() {
        let (e, x, y) = (EventId::from_parts(9, 1), AttemptId::from_parts(9, 1), AttemptId::from_parts(9, 2));
        let from = ScanFrom { offset: 5, anchor: Some(e.clone()), anchor_attempt: Some(x.clone()) };
        let b = |s: &str| Some(s.as_bytes().to_vec());
        let holds = |ev: Option<Vec<u8>>, at: Option<Vec<u8>>| anchor_holds(&from, ev.as_deref(), at.as_deref());
        assert!(holds(b(e.as_str()), b(x.as_str())));
        assert!(!holds(b(e.as_str()), b(y.as_str())), "the same event by another attempt is another message");
        assert!(!holds(b(e.as_str()), None));
        assert!(!holds(b(EventId::from_parts(9, 2).as_str()), b(x.as_str())));
        assert!(!holds(None, None));
        // A floor recorded before the attempt was kept: the event alone.
        let old = ScanFrom { anchor_attempt: None, ..from.clone() };
        assert!(anchor_holds(&old, Some(e.as_str().as_bytes()), Some(y.as_str().as_bytes())));
        assert!(anchor_holds(&ScanFrom::at(5), None, None), "no anchor: nothing to tell");
        // The floor keeps the attempt of the receipt it came from.
        let mut a = attempt(AttemptState::Unknown, 0, 5);
        (a.scan_anchor, a.scan_anchor_attempt) = (Some(e.clone()), Some(x.clone()));
        assert_eq!(scan_floor(&[a]), from);
        assert_eq!(advance_floor(None, 4, &e, &x), (5, e.clone(), x.clone()));
        assert_eq!(advance_floor(Some(&(9, e.clone(), y.clone())), 4, &e, &x), (9, e, y), "a lower receipt keeps the floor");
    }

    #[test]
    fn absent_and_settled_retries_same_destination() {
        let a = [attempt(AttemptState::Unknown, 0, 10)];
        assert_eq!(decide_reconcile(&a, &LookupOutcome::Absent, true, &P, 5_000), ReconcileDecision::Retry { proven_absent: true });
    }

    #[test]
    fn absent_but_in_flight_waits() {
        let a = [attempt(AttemptState::Unknown, 4_500, 10)];
        assert!(matches!(decide_reconcile(&a, &LookupOutcome::Absent, true, &P, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::AttemptInFlight, next_check_at_ms: 5_500 }));
    }

    #[test]
    fn unavailable_broker_never_retries_when_it_could_answer() {
        let a = [attempt(AttemptState::Unknown, 0, 10)];
        assert!(matches!(decide_reconcile(&a, &LookupOutcome::Unavailable("down".into()), true, &P, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, .. }));
    }

    #[test]
    fn adapter_without_lookup_may_only_retry_same_destination() {
        let a = [attempt(AttemptState::Unknown, 0, 10)];
        assert_eq!(decide_reconcile(&a, &LookupOutcome::Unavailable("no lookup".into()), false, &P, 5_000), ReconcileDecision::Retry { proven_absent: false });
    }

    #[test]
    fn budget_and_policy_are_respected() {
        let a = [attempt(AttemptState::Absent, 0, 0), attempt(AttemptState::Absent, 1, 0), attempt(AttemptState::Unknown, 2, 0)];
        assert!(matches!(decide_reconcile(&a, &LookupOutcome::Absent, true, &P, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::AttemptsExhausted, .. }));
        let no = RetryPolicy { allow_retry: false, ..P };
        assert!(matches!(decide_reconcile(&a[..1], &LookupOutcome::Absent, true, &no, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::RetryNotAllowed, .. }));
    }

    #[test]
    fn in_flight_counts_from_the_later_of_registration_and_lease_end() {
        let mut a = attempt(AttemptState::Unknown, 0, 0);
        a.send_deadline_ms = Some(3_000);
        // 5 s after registration but only 2 s after the lease ended: it may still land.
        assert!(matches!(decide_reconcile(&[a.clone()], &LookupOutcome::Absent, true, &P, 3_999), ReconcileDecision::Recheck { reason: RecheckReason::AttemptInFlight, .. }));
        assert_eq!(decide_reconcile(&[a], &LookupOutcome::Absent, true, &P, 4_000), ReconcileDecision::Retry { proven_absent: true });
    }

    #[test]
    fn the_bound_must_cover_the_client_and_a_skew_allowance() {
        assert!(check_in_flight_bound(25_000, Some(25_000), 2_000).is_err());
        assert!(check_in_flight_bound(27_000, Some(25_000), 2_000).is_ok());
        assert!(check_in_flight_bound(27_000, Some(25_000), 0).is_err());
        assert!(check_in_flight_bound(2_000, None, 2_000).is_ok());
    }

    #[test]
    fn when_every_found_message_is_refused_the_absence_logic_decides() {
        use crate::receipt::{ReceiptDecision, RejectReason};
        let a = [attempt(AttemptState::Unknown, 0, 10)];
        let refused = [ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt }];
        assert_eq!(decide_after_submit(&refused, &a, true, &P, 5_000), ReconcileDecision::Retry { proven_absent: true });
        let young = [attempt(AttemptState::Unknown, 4_900, 10)];
        assert!(matches!(decide_after_submit(&refused, &young, true, &P, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::AttemptInFlight, .. }));
        let mixed = [refused[0].clone(), ReceiptDecision::Duplicate];
        assert!(matches!(decide_after_submit(&mixed, &a, true, &P, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, .. }));
    }

    #[test]
    fn item8_an_outage_does_not_spend_the_attempt_budget() {
        // Issue 19 item 8: attempts the broker definitely did not persist
        // (NOT_SENT, e.g. while it was down) are not deliveries.
        let mut a: Vec<_> = (0..5).map(|i| attempt(AttemptState::NotSent, i, 0)).collect();
        a.push(attempt(AttemptState::Unknown, 10, 0));
        assert_eq!(decide_reconcile(&a, &LookupOutcome::Absent, true, &P, 5_000), ReconcileDecision::Retry { proven_absent: true });
        a.extend([attempt(AttemptState::Absent, 11, 0), attempt(AttemptState::Absent, 12, 0)]);
        assert!(matches!(decide_reconcile(&a, &LookupOutcome::Absent, true, &P, 5_000), ReconcileDecision::Recheck { reason: RecheckReason::AttemptsExhausted, .. }));
    }

    #[test]
    fn found_is_submitted() {
        let r = crate::receipt::sample_receipt(11);
        assert_eq!(decide_reconcile(&[], &LookupOutcome::Found(vec![r.clone()]), true, &P, 0), ReconcileDecision::Submit(vec![r]));
    }

    #[test]
    fn lower_bound_is_the_smallest_open_attempt_bound() {
        let a = [attempt(AttemptState::Unknown, 0, 40), attempt(AttemptState::NotSent, 1, 3), attempt(AttemptState::Sending, 2, 25)];
        assert_eq!(scan_lower_bound(&a), 25);
        assert_eq!(scan_lower_bound(&[]), 0);
    }

    #[test]
    fn the_floor_carries_the_anchor_of_its_attempt() {
        let anchored = |state, bound: i64, n: u128| AttemptRecord { scan_anchor: Some(EventId::from_parts(9, n)), ..attempt(state, 0, bound) };
        let a = [anchored(AttemptState::Unknown, 40, 1), anchored(AttemptState::Sending, 25, 2), anchored(AttemptState::NotSent, 3, 3)];
        assert_eq!(scan_floor(&a), ScanFrom { offset: 25, anchor: Some(EventId::from_parts(9, 2)), anchor_attempt: None });
        // A floor of 0 needs no anchor.
        assert_eq!(scan_floor(&[anchored(AttemptState::Unknown, 0, 4)]), ScanFrom::at(0));
        assert_eq!(scan_floor(&[]), ScanFrom::at(0));
    }

    #[test]
    fn the_anchor_is_read_only_inside_the_log() {
        let e = EventId::from_parts(9, 1);
        let from = ScanFrom { offset: 289, anchor: Some(e.clone()), anchor_attempt: None };
        assert_eq!(anchor_to_read(&from, 0, 400), Ok((288, &e)));
        assert_eq!(anchor_to_read(&from, 0, 288), Err(AnchorCheck::BeyondEnd));
        assert_eq!(anchor_to_read(&from, 289, 400), Err(AnchorCheck::NoRecord));
        assert_eq!(anchor_to_read(&ScanFrom::at(289), 0, 400), Err(AnchorCheck::NoAnchor));
        assert_eq!(anchor_to_read(&ScanFrom { offset: 0, anchor: Some(e.clone()), anchor_attempt: None }, 0, 400), Err(AnchorCheck::NoAnchor));
    }

    #[test]
    fn a_floor_from_another_log_is_read_from_the_start_of_this_one() {
        let from = ScanFrom { offset: 289, anchor: Some(EventId::from_parts(9, 1)), anchor_attempt: None };
        // The bound's own log: read from the bound.
        assert_eq!(plan_absence_scan("t", 4, &from, 0, 400, AnchorCheck::Holds), Ok(AbsenceScan { start: 289, floor_from_another_log: false }));
        // A replaced log, shorter or longer than the old one: read whole.
        for check in [AnchorCheck::BeyondEnd, AnchorCheck::HoldsOther] {
            assert_eq!(plan_absence_scan("t", 4, &from, 0, 24, check), Ok(AbsenceScan { start: 0, floor_from_another_log: true }), "{check:?}");
        }
        assert_eq!(plan_absence_scan("t", 4, &from, 0, 900, AnchorCheck::HoldsOther), Ok(AbsenceScan { start: 0, floor_from_another_log: true }));
        // Another log that no longer starts at 0, or an anchor offset without a record: no proof.
        assert!(plan_absence_scan("t", 4, &from, 5, 900, AnchorCheck::HoldsOther).unwrap_err().starts_with(LOG_INCOMPLETE));
        assert!(plan_absence_scan("t", 4, &from, 289, 900, AnchorCheck::NoRecord).unwrap_err().starts_with(LOG_INCOMPLETE));
        // No anchor: the bound is trusted, with the range checks as before.
        assert!(plan_absence_scan("t", 4, &ScanFrom::at(289), 0, 24, AnchorCheck::NoAnchor).unwrap_err().starts_with(LOG_INCOMPLETE));
        assert_eq!(plan_absence_scan("t", 4, &ScanFrom::at(7), 2, 24, AnchorCheck::NoAnchor), Ok(AbsenceScan { start: 7, floor_from_another_log: false }));
    }
}
