//! The receipt decision of `acceptDispatchReceipt` (PROTOCOL §5), as a pure
//! function of the locked event, its attempts and one broker receipt.
//!
//! Stores lock the event row, load its attempts, call [`decide_receipt`] and
//! apply the answer in the same transaction. The decision never looks at the
//! current claim: a late genuine ACK of an old attempt competes for the slot
//! like any other.

use serde::{Deserialize, Serialize};

use crate::envelope::Destination;
use crate::id::{AttemptId, EventId};
use crate::state::{AttemptState, EventState};

/// What the broker said about one produced message.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BrokerReceipt {
    /// From the message's headers.
    pub event_id: EventId,
    /// From the message's headers.
    pub envelope_generation: u32,
    /// From the message's headers.
    pub attempt_id: AttemptId,
    /// Digest of the bytes that were produced.
    pub payload_digest: String,
    /// Digest of the destination the message claims.
    pub destination_digest: String,
    /// Cluster that acknowledged.
    pub cluster_id: String,
    /// Topic written.
    pub topic: String,
    /// The topic's identity (Kafka topic id) as the destination the message
    /// names has it frozen (`destination.v2`); `None` for a `destination.v1`.
    /// Part of the log position: a topic deleted and created again under the
    /// same name starts another log at offset 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic_id: Option<String>,
    /// Partition written.
    pub partition: i32,
    /// Offset assigned.
    pub offset: i64,
    /// The message's key as written (the dispatcher's ACK: the key it sent;
    /// a lookup or a scan: the key read back). A message without a key
    /// reads as the empty key, which no frozen destination has (a routing
    /// key never renders empty). `None` only for receipts recorded before
    /// the key was kept: the key is then not compared. Serialized as hex.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "key_hex")]
    pub key: Option<Vec<u8>>,
    /// The identity of the log the message was written to or read from, as
    /// the client that did it saw the topic just before: its topic id then
    /// (`None`: not known). For a `destination.v1` (no topic id frozen) the
    /// one evidence of which log a receipt is in once a topic was created
    /// again under its name or its cluster replaced: a consumer watermark
    /// kept under another log id does not cover it
    /// ([`crate::WatermarkRef::anchor_agrees_with`]). Read before the write,
    /// it can lag a replacement (the receipt is then held, never passed),
    /// but never name a log that did not exist yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_id: Option<String>,
}

/// A message key as lowercase hex in serialized receipts.
mod key_hex {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(key: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match key {
            Some(k) => s.serialize_some(&hex::encode(k)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Option::<String>::deserialize(d)?.map(|h| hex::decode(h).map_err(D::Error::custom)).transpose()
    }
}

impl AttemptRecord {
    /// From when the in-flight bound counts: the later of registration and
    /// the end of the lease the attempt was sent under.
    pub fn in_flight_from_ms(&self) -> i64 {
        if crate::simulation::mutation_active("bound-from-registration-clock") {
            return self.started_at_ms;
        }
        self.send_deadline_ms.map_or(self.started_at_ms, |d| d.max(self.started_at_ms))
    }
}

impl BrokerReceipt {
    /// Whether two receipts name the same log position: cluster, topic,
    /// topic id (exactly: `None` matches only `None`), partition and offset.
    pub fn same_placement(&self, other: &BrokerReceipt) -> bool {
        self.cluster_id == other.cluster_id
            && self.topic == other.topic
            && self.topic_id == other.topic_id
            && self.partition == other.partition
            && self.offset == other.offset
    }
}

/// The locked event row as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockedEvent {
    /// Event id.
    pub event_id: EventId,
    /// Current envelope generation.
    pub envelope_generation: u32,
    /// Current state.
    pub state: EventState,
    /// Frozen payload digest.
    pub payload_digest: String,
    /// Frozen destination.
    pub destination: Destination,
    /// Its digest as stored.
    pub destination_digest: String,
    /// The publish slot.
    pub slot: Option<BrokerReceipt>,
}

/// One registered attempt as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRecord {
    /// Attempt id.
    pub attempt_id: AttemptId,
    /// Event.
    pub event_id: EventId,
    /// Envelope generation the attempt sent.
    pub envelope_generation: u32,
    /// 1 for the first attempt, + 1 for each later one.
    pub attempt_generation: u32,
    /// Claim generation it was registered under.
    pub claim_generation: u64,
    /// Claim holder that registered it.
    pub owner: String,
    /// Its state.
    pub state: AttemptState,
    /// Destination digest it sent to.
    pub destination_digest: String,
    /// When the attempt was registered, ms since the epoch.
    pub started_at_ms: i64,
    /// The end of the lease it was registered under, in the same clock as
    /// `started_at_ms`: a dispatcher hands its message to the client only
    /// before it, so the message may reach the log until this plus the
    /// longest time a message sits in the client. `None` for attempts
    /// recorded before this was kept (the bound then counts from
    /// registration).
    #[serde(default)]
    pub send_deadline_ms: Option<i64>,
    /// A sound lower bound for a scan: the highest offset already
    /// acknowledged on the frozen partition when the attempt was registered
    /// (the log is append-only, so this attempt's message lies above it), or 0.
    /// It holds only for the log it was read from: see `scan_anchor`.
    pub scan_from_offset: i64,
    /// The event whose receipt held offset `scan_from_offset - 1` when the
    /// attempt was registered: what makes the floor's log recognisable. A
    /// lookup reads that offset first; a log that no longer holds that
    /// event there is another log (the cluster replaced, a topic without a
    /// recorded id recreated) and the floor says nothing of it, so the scan
    /// starts at that log's start. `None` when the floor is 0, and for
    /// attempts recorded before the anchor was kept (their floor is trusted
    /// as before).
    #[serde(default)]
    pub scan_anchor: Option<EventId>,
    /// The attempt whose receipt held that offset: with the event, what
    /// the anchor's message must be. A replaced log may hold the same
    /// event's message at the same offset, written by another attempt (a
    /// paused sender's late write): the event alone took it for the old
    /// log, and proved absence above a floor that said nothing of it.
    /// `None` when the floor is 0 and for attempts recorded before it was
    /// kept (the event alone is checked).
    #[serde(default)]
    pub scan_anchor_attempt: Option<AttemptId>,
}

/// Why a receipt was quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuarantineReason {
    /// The produced bytes are not the frozen payload.
    PayloadDigestMismatch,
    /// The message claims another destination digest.
    DestinationDigestMismatch,
    /// Cluster, topic, topic id or partition are not the ones the frozen
    /// routing gives.
    PlacementMismatch,
    /// The message's key is not the frozen destination's routing key: a
    /// consumer partitioning work by key would see the event under another
    /// key, and the copy sits in another key's compaction chain.
    KeyMismatch,
}

/// Why a receipt was refused without quarantine. Refusals are audited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    /// The receipt names another event.
    WrongEvent,
    /// The receipt is for an envelope generation other than the current one.
    EnvelopeGenerationMismatch,
    /// Negative offset.
    InvalidOffset,
    /// No attempt with this id is registered for this event and generation.
    UnregisteredAttempt,
    /// The attempt was closed as not sent or proven absent.
    AttemptClosed,
    /// Another attempt's receipt claims the same log position.
    ConflictingPlacement,
    /// The event's state cannot become PUBLISHED (e.g. QUARANTINED).
    EventNotAccepting,
}

/// The answer of the receipt decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum ReceiptDecision {
    /// Fill the slot, move the event to PUBLISHED, mark the attempt ACKED.
    Accept {
        /// State the event leaves.
        from: EventState,
    },
    /// This exact receipt already fills the slot: same answer, nothing written.
    AlreadyAccepted,
    /// The slot holds another receipt, or cannot take this genuine copy of
    /// an attempt proven absent (the event went on without it; or the copy
    /// sits at the primary's offset in a log that replaced the primary's):
    /// keep this one as a duplicate transport receipt (evidence) and mark
    /// its attempt ACKED.
    Duplicate,
    /// Divergent payload or destination: record the evidence; move the event
    /// to QUARANTINED when its state allows.
    Quarantine {
        /// What diverged.
        reason: QuarantineReason,
        /// Whether the event itself moves to QUARANTINED.
        move_event: bool,
    },
    /// Refused; audited, nothing else changes.
    Reject {
        /// Why.
        reason: RejectReason,
    },
}

impl ReceiptDecision {
    /// Whether this receipt fills or already filled the slot.
    pub fn is_primary(&self) -> bool {
        matches!(self, ReceiptDecision::Accept { .. } | ReceiptDecision::AlreadyAccepted)
    }
}

/// Decides what `acceptDispatchReceipt` does with `receipt`.
///
/// Order of the rules: identity (event, envelope generation) and the offset;
/// then the registered attempt: a message that no registered attempt of
/// this event and generation sent (a mirror or replay tool, a bypass
/// publish, headers that do not parse) is refused as evidence and never
/// quarantines or moves the event; then divergence of a registered
/// attempt's message (payload digest, destination digest, placement against
/// the frozen routing: cluster, topic, topic id and partition; then the
/// message key against the frozen routing key), which quarantines; then
/// the slot. A genuine message
/// of an attempt that was proven ABSENT refutes that proof: it competes for
/// the slot like any other (see [`refutes_absence`]).
pub fn decide_receipt(event: &LockedEvent, attempts: &[AttemptRecord], receipt: &BrokerReceipt) -> ReceiptDecision {
    use ReceiptDecision::*;
    if receipt.event_id != event.event_id {
        return Reject { reason: RejectReason::WrongEvent };
    }
    if receipt.envelope_generation != event.envelope_generation {
        return Reject { reason: RejectReason::EnvelopeGenerationMismatch };
    }
    if receipt.offset < 0 {
        return Reject { reason: RejectReason::InvalidOffset };
    }
    let Some(attempt) = registered_attempt(event, attempts, receipt) else {
        return Reject { reason: RejectReason::UnregisteredAttempt };
    };
    if attempt.state == AttemptState::Absent && crate::simulation::mutation_active("absent-attempt-ack-discarded") {
        return Reject { reason: RejectReason::AttemptClosed };
    }
    let quarantine = |reason| Quarantine { reason, move_event: event.state.can_transition_to(EventState::Quarantined) };
    if receipt.payload_digest != event.payload_digest && !crate::simulation::mutation_active("ack-without-digest-check") {
        return quarantine(QuarantineReason::PayloadDigestMismatch);
    }
    if receipt.destination_digest != event.destination_digest || attempt.destination_digest != event.destination_digest {
        return quarantine(QuarantineReason::DestinationDigestMismatch);
    }
    // The log the receipt names must be the frozen destination's: cluster,
    // topic and partition, and the topic id exactly (`None`, a
    // `destination.v1`, matches only `None`), as `same_placement` and the
    // watermarks' `covers_log_of` compare it. A topic deleted and created
    // again under the same name is another log; a lookup takes the id from
    // the message's own destination header, so a header that names another
    // id than the digest it carries is caught here.
    if !event.destination.admits(&receipt.cluster_id, &receipt.topic, receipt.partition) || receipt.topic_id != event.destination.topic_id {
        return quarantine(QuarantineReason::PlacementMismatch);
    }
    // The key the message carries must be the frozen routing key: the
    // headers and payload say nothing of it, and a copy under another key
    // reaches consumers under that key. A receipt that does not know its
    // key (recorded before the key was kept) is not judged by it.
    if receipt.key.as_deref().is_some_and(|k| k != event.destination.routing_key.as_bytes()) && !crate::simulation::mutation_active("receipt-key-unchecked") {
        return quarantine(QuarantineReason::KeyMismatch);
    }
    match &event.slot {
        Some(primary) if primary.same_placement(receipt) => {
            if primary.attempt_id == receipt.attempt_id {
                AlreadyAccepted
            } else if attempt.state == AttemptState::Absent {
                // One position holds one message: a genuine copy of an
                // attempt proven absent at the primary's very position is in
                // another log (the topic recreated, the cluster replaced).
                // It refutes the proof and is kept as evidence.
                Duplicate
            } else {
                Reject { reason: RejectReason::ConflictingPlacement }
            }
        }
        Some(_) => match attempt.state {
            AttemptState::Sending | AttemptState::Unknown | AttemptState::Acked | AttemptState::Absent => Duplicate,
            AttemptState::NotSent => Reject { reason: RejectReason::AttemptClosed },
        },
        None => match attempt.state {
            AttemptState::Sending | AttemptState::Unknown | AttemptState::Absent if event.state.accepts_receipt() => Accept { from: event.state },
            // The proof sent the event on without this copy (its retry was
            // refused: it is PENDING again, or claimed anew): it cannot be
            // published without a send of its own, but the copy is in the log
            // and is never thrown away. Kept as evidence; it refutes the proof.
            AttemptState::Absent => Duplicate,
            // A genuine message of an event quarantined meanwhile (another
            // copy diverged): the event stays QUARANTINED for an operator,
            // and this copy, which consumers may apply, is kept as evidence.
            // So is a late copy of an UNKNOWN an operator skipped: the event
            // stays SKIPPED (its key has moved on), the copy is on record.
            AttemptState::Sending | AttemptState::Unknown if matches!(event.state, EventState::Quarantined | EventState::Skipped) => Duplicate,
            AttemptState::Sending | AttemptState::Unknown => Reject { reason: RejectReason::EventNotAccepting },
            // Only a copy kept as evidence so (above) is ACKED with the slot
            // empty: the same answer again.
            AttemptState::Acked => Duplicate,
            AttemptState::NotSent => Reject { reason: RejectReason::AttemptClosed },
        },
    }
}

/// The registered attempt of this event and envelope generation that
/// `receipt` names, if any.
fn registered_attempt<'a>(event: &LockedEvent, attempts: &'a [AttemptRecord], receipt: &BrokerReceipt) -> Option<&'a AttemptRecord> {
    attempts.iter().find(|a| a.attempt_id == receipt.attempt_id && a.event_id == event.event_id && a.envelope_generation == event.envelope_generation)
}

/// Whether `decision` about `receipt` refutes an absence proof: the receipt
/// is a genuine message (it filled the slot or became a duplicate transport
/// receipt) of an attempt a reconciler had closed as ABSENT. Stores record
/// it as the finding `absence_proof_refuted`: a proof of absence missed a
/// message (a stalled sender, a log read short), and an operator should
/// know which.
pub fn refutes_absence(attempts: &[AttemptRecord], receipt: &BrokerReceipt, decision: &ReceiptDecision) -> bool {
    matches!(decision, ReceiptDecision::Accept { .. } | ReceiptDecision::Duplicate)
        && attempts.iter().any(|a| a.attempt_id == receipt.attempt_id && a.state == AttemptState::Absent)
}

/// Whether `decision` refused a message no registered attempt sent: stores
/// record it as the finding `unregistered_message` (evidence; the event is
/// left alone).
pub fn is_unregistered_message(decision: &ReceiptDecision) -> bool {
    matches!(decision, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })
}

/// An attempt of event `evt(1,1)` for unit tests of the decisions.
#[cfg(test)]
pub(crate) fn sample_attempt(state: AttemptState, started_at_ms: i64, scan_from_offset: i64) -> AttemptRecord {
    AttemptRecord {
        attempt_id: AttemptId::from_parts(1, started_at_ms as u128),
        event_id: EventId::from_parts(1, 1),
        envelope_generation: 1,
        attempt_generation: 1,
        claim_generation: 1,
        owner: "w".into(),
        state,
        destination_digest: "d".into(),
        started_at_ms,
        send_deadline_ms: None,
        scan_from_offset,
        scan_anchor: None,
        scan_anchor_attempt: None,
    }
}

/// A receipt of event `evt(1,1)`'s first attempt at `offset`, for unit tests
/// of the decisions.
#[cfg(test)]
pub(crate) fn sample_receipt(offset: i64) -> BrokerReceipt {
    BrokerReceipt {
        event_id: EventId::from_parts(1, 1),
        envelope_generation: 1,
        attempt_id: AttemptId::from_parts(1, 0),
        payload_digest: "p".into(),
        destination_digest: "d".into(),
        cluster_id: "c".into(),
        topic: "t".into(),
        topic_id: None,
        partition: 0,
        offset,
        key: None,
        log_id: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::sha256_digest;
    use crate::envelope::RoutePolicy;

    struct Case {
        event: LockedEvent,
        attempts: Vec<AttemptRecord>,
    }

    fn att(n: u128) -> AttemptId {
        AttemptId::from_parts(10, n)
    }

    impl Case {
        fn new() -> Self {
            let destination = RoutePolicy::new("order.created", "cluster-a", "orders", 6).resolve("t", "order", "o-1").unwrap();
            let event = LockedEvent {
                event_id: EventId::from_parts(1, 1),
                envelope_generation: 1,
                state: EventState::Sending,
                payload_digest: sha256_digest(b"payload"),
                destination_digest: destination.digest(),
                destination,
                slot: None,
            };
            Case { event, attempts: vec![] }
        }

        fn attempt(mut self, n: u128, state: AttemptState) -> Self {
            self.attempts.push(AttemptRecord {
                attempt_id: att(n),
                event_id: self.event.event_id.clone(),
                envelope_generation: 1,
                attempt_generation: self.attempts.len() as u32 + 1,
                claim_generation: n as u64,
                owner: format!("w{n}"),
                state,
                destination_digest: self.event.destination_digest.clone(),
                started_at_ms: 0,
                send_deadline_ms: None,
                scan_from_offset: 0,
                scan_anchor: None,
                scan_anchor_attempt: None,
            });
            self
        }

        fn state(mut self, s: EventState) -> Self {
            self.event.state = s;
            self
        }

        fn receipt(&self, n: u128, offset: i64) -> BrokerReceipt {
            BrokerReceipt {
                event_id: self.event.event_id.clone(),
                envelope_generation: 1,
                attempt_id: att(n),
                payload_digest: self.event.payload_digest.clone(),
                destination_digest: self.event.destination_digest.clone(),
                cluster_id: "cluster-a".into(),
                topic: "orders".into(),
                topic_id: self.event.destination.topic_id.clone(),
                partition: self.event.destination.partition,
                offset,
                key: Some(self.event.destination.routing_key.as_bytes().to_vec()),
                log_id: None,
            }
        }

        /// Applies a decision the way a store does, for multi-step scenarios.
        fn apply(&mut self, r: &BrokerReceipt) -> ReceiptDecision {
            let d = decide_receipt(&self.event, &self.attempts, r);
            match &d {
                ReceiptDecision::Accept { .. } => {
                    self.event.slot = Some(r.clone());
                    self.event.state = EventState::Published;
                    self.attempts.iter_mut().filter(|a| a.attempt_id == r.attempt_id).for_each(|a| a.state = AttemptState::Acked);
                }
                ReceiptDecision::Duplicate => {
                    self.attempts.iter_mut().filter(|a| a.attempt_id == r.attempt_id).for_each(|a| a.state = AttemptState::Acked);
                }
                _ => {}
            }
            d
        }
    }

    #[test]
    fn fresh_ack_fills_the_slot() {
        let c = Case::new().attempt(1, AttemptState::Sending);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Accept { from: EventState::Sending });
    }

    #[test]
    fn late_ack_of_an_old_attempt_after_a_new_claim_wins_the_empty_slot() {
        // Attempt 1 went UNKNOWN, the reconciler proved nothing, a retry claim
        // registered attempt 2; attempt 1's genuine ACK arrives now.
        let c = Case::new().attempt(1, AttemptState::Unknown).attempt(2, AttemptState::Sending).state(EventState::Sending);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 3)), ReceiptDecision::Accept { from: EventState::Sending });
        let c = c.state(EventState::RetryClaimed);
        assert!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 3)).is_primary());
    }

    #[test]
    fn both_attempts_acked_gives_one_primary_and_one_duplicate() {
        let mut c = Case::new().attempt(1, AttemptState::Unknown).attempt(2, AttemptState::Sending);
        let (r2, r1) = (c.receipt(2, 9), c.receipt(1, 3));
        assert!(matches!(c.apply(&r2), ReceiptDecision::Accept { .. }));
        assert_eq!(c.apply(&r1), ReceiptDecision::Duplicate);
        assert_eq!(c.event.slot.as_ref().unwrap().attempt_id, att(2));
        assert!(c.attempts.iter().all(|a| a.state == AttemptState::Acked));
        // The duplicate delivered again is still a duplicate, never a second primary.
        assert_eq!(c.apply(&r1), ReceiptDecision::Duplicate);
    }

    #[test]
    fn same_receipt_twice_gets_the_same_answer() {
        let mut c = Case::new().attempt(1, AttemptState::Sending);
        let r = c.receipt(1, 5);
        assert!(matches!(c.apply(&r), ReceiptDecision::Accept { .. }));
        assert_eq!(c.apply(&r), ReceiptDecision::AlreadyAccepted);
        assert_eq!(c.apply(&r), ReceiptDecision::AlreadyAccepted);
        assert!(ReceiptDecision::AlreadyAccepted.is_primary());
    }

    #[test]
    fn divergent_payload_is_quarantined() {
        let c = Case::new().attempt(1, AttemptState::Sending);
        let mut r = c.receipt(1, 5);
        r.payload_digest = sha256_digest(b"other");
        assert_eq!(
            decide_receipt(&c.event, &c.attempts, &r),
            ReceiptDecision::Quarantine { reason: QuarantineReason::PayloadDigestMismatch, move_event: true }
        );
    }

    #[test]
    fn divergent_destination_is_quarantined() {
        let c = Case::new().attempt(1, AttemptState::Sending);
        let mut r = c.receipt(1, 5);
        r.destination_digest = sha256_digest(b"elsewhere");
        assert!(matches!(decide_receipt(&c.event, &c.attempts, &r), ReceiptDecision::Quarantine { reason: QuarantineReason::DestinationDigestMismatch, .. }));
        for mutate in [
            (|r: &mut BrokerReceipt| r.topic = "payments".into()) as fn(&mut BrokerReceipt),
            |r| r.cluster_id = "cluster-b".into(),
            |r| r.partition = (r.partition + 1) % 6,
        ] {
            let mut r = c.receipt(1, 5);
            mutate(&mut r);
            assert!(matches!(decide_receipt(&c.event, &c.attempts, &r), ReceiptDecision::Quarantine { reason: QuarantineReason::PlacementMismatch, .. }));
        }
    }

    /// Defect (outside read): the decision compared cluster, topic and
    /// partition with the frozen destination but not the topic id, so a
    /// receipt naming another incarnation of the topic (deleted and created
    /// again: another log) was accepted as the event's publication. The
    /// topic id is compared exactly, as `same_placement` and the
    /// watermarks' `covers_log_of` do: `None` (a `destination.v1`) matches
    /// only `None`.
    #[test]
    fn a_receipt_naming_another_topic_id_is_not_the_events_publication() {
        const OLD: &str = "AAECAwQFBgcICQoLDA0ODw";
        const NEW: &str = "_____________________w";
        let placement = ReceiptDecision::Quarantine { reason: QuarantineReason::PlacementMismatch, move_event: true };
        // A destination.v1 (no topic id): a receipt naming one is another log's.
        let c = Case::new().attempt(1, AttemptState::Sending);
        assert_eq!(c.event.destination.topic_id, None);
        let r = BrokerReceipt { topic_id: Some(OLD.into()), ..c.receipt(1, 5) };
        assert_eq!(decide_receipt(&c.event, &c.attempts, &r), placement);
        // A destination.v2: another id, or none, is not its log.
        let mut c = Case::new().attempt(1, AttemptState::Sending);
        c.event.destination.topic_id = Some(OLD.into());
        c.event.destination_digest = c.event.destination.digest();
        c.attempts[0].destination_digest = c.event.destination_digest.clone();
        for other in [Some(NEW.to_owned()), None] {
            let r = BrokerReceipt { topic_id: other.clone(), ..c.receipt(1, 5) };
            assert_eq!(decide_receipt(&c.event, &c.attempts, &r), placement, "{other:?}");
        }
        // Its own id is its publication.
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Accept { from: EventState::Sending });
        // After the slot is filled, such a receipt is evidence and leaves the event alone.
        let r = c.receipt(1, 5);
        c.apply(&r);
        let stray = BrokerReceipt { topic_id: Some(NEW.into()), ..c.receipt(1, 6) };
        assert_eq!(c.apply(&stray), ReceiptDecision::Quarantine { reason: QuarantineReason::PlacementMismatch, move_event: false });
        assert_eq!(c.event.slot.as_ref(), Some(&r));
    }

    /// Issue 47: a message naming a registered attempt, with the frozen
    /// payload and destination digests, on the frozen partition, but under
    /// another key than the frozen routing key was accepted as the event's
    /// publication: the receipt carried no key. It is quarantined as a key
    /// mismatch; a receipt recorded before the key was kept (`None`) is not
    /// judged by it.
    #[test]
    fn a_receipt_under_another_key_is_not_the_events_publication() {
        let mut c = Case::new().attempt(1, AttemptState::Sending);
        for other in [b"tenant-9.order.someone-else".to_vec(), Vec::new()] {
            let r = BrokerReceipt { key: Some(other.clone()), ..c.receipt(1, 5) };
            assert_eq!(
                decide_receipt(&c.event, &c.attempts, &r),
                ReceiptDecision::Quarantine { reason: QuarantineReason::KeyMismatch, move_event: true },
                "{other:?}"
            );
        }
        let unkeyed = BrokerReceipt { key: None, ..c.receipt(1, 5) };
        assert_eq!(decide_receipt(&c.event, &c.attempts, &unkeyed), ReceiptDecision::Accept { from: EventState::Sending });
        let r = c.receipt(1, 5);
        assert!(matches!(c.apply(&r), ReceiptDecision::Accept { .. }));
        // After the slot is filled, such a copy is evidence and leaves the event alone.
        let stray = BrokerReceipt { key: Some(b"tenant-9.order.someone-else".to_vec()), ..c.receipt(1, 6) };
        assert_eq!(c.apply(&stray), ReceiptDecision::Quarantine { reason: QuarantineReason::KeyMismatch, move_event: false });
        assert_eq!(c.event.slot.as_ref(), Some(&r));
    }

    /// The key is serialized as hex; a receipt serialized before it was
    /// kept (no `key`) still parses, with no key.
    #[test]
    fn a_receipt_serialized_without_a_key_still_parses() {
        let c = Case::new();
        let r = c.receipt(1, 5);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["key"], serde_json::json!(hex::encode(c.event.destination.routing_key.as_bytes())));
        assert_eq!(serde_json::from_value::<BrokerReceipt>(json.clone()).unwrap(), r);
        let mut old = json;
        old.as_object_mut().unwrap().remove("key");
        assert_eq!(serde_json::from_value::<BrokerReceipt>(old).unwrap(), BrokerReceipt { key: None, ..r });
        assert_eq!(serde_json::to_value(QuarantineReason::KeyMismatch).unwrap(), serde_json::json!("key_mismatch"));
    }

    #[test]
    fn divergent_receipt_after_publish_is_evidence_but_does_not_move_the_event() {
        let mut c = Case::new().attempt(1, AttemptState::Sending);
        let r = c.receipt(1, 5);
        c.apply(&r);
        let mut bad = c.receipt(1, 6);
        bad.payload_digest = sha256_digest(b"tampered");
        assert_eq!(c.apply(&bad), ReceiptDecision::Quarantine { reason: QuarantineReason::PayloadDigestMismatch, move_event: false });
        assert_eq!(c.event.slot.as_ref(), Some(&r));
    }

    #[test]
    fn unregistered_attempt_is_rejected() {
        let c = Case::new().attempt(1, AttemptState::Sending);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(7, 5)), ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt });
    }

    #[test]
    fn a_not_sent_attempt_cannot_fill_the_slot() {
        let c = Case::new().attempt(1, AttemptState::NotSent).state(EventState::DispatchUnknown);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Reject { reason: RejectReason::AttemptClosed });
    }

    #[test]
    fn a_refuting_message_that_cannot_fill_the_slot_is_kept_as_evidence() {
        // The event went on without it: PENDING again after a refused retry.
        let c = Case::new().attempt(1, AttemptState::Absent).attempt(2, AttemptState::NotSent).state(EventState::Pending);
        let r = c.receipt(1, 5);
        let d = decide_receipt(&c.event, &c.attempts, &r);
        assert_eq!(d, ReceiptDecision::Duplicate);
        assert!(refutes_absence(&c.attempts, &r, &d));
        // An open attempt's receipt for a PENDING event is still refused.
        let c = Case::new().attempt(1, AttemptState::Unknown).state(EventState::Pending);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Reject { reason: RejectReason::EventNotAccepting });
        // At the primary's very offset, from a log that replaced the primary's.
        let mut c = Case::new().attempt(1, AttemptState::Absent).attempt(2, AttemptState::Sending);
        c.apply(&c.receipt(2, 5));
        let r = c.receipt(1, 5);
        let d = decide_receipt(&c.event, &c.attempts, &r);
        assert_eq!(d, ReceiptDecision::Duplicate);
        assert!(refutes_absence(&c.attempts, &r, &d));
        // Another open attempt there is still a conflicting placement.
        let mut c = Case::new().attempt(1, AttemptState::Unknown).attempt(2, AttemptState::Sending);
        c.apply(&c.receipt(2, 5));
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Reject { reason: RejectReason::ConflictingPlacement });
    }

    #[test]
    fn a_genuine_late_ack_of_an_absent_attempt_competes_for_the_slot_and_refutes_the_proof() {
        let c = Case::new().attempt(1, AttemptState::Absent).attempt(2, AttemptState::Sending).state(EventState::Sending);
        let r = c.receipt(1, 5);
        let d = decide_receipt(&c.event, &c.attempts, &r);
        assert_eq!(d, ReceiptDecision::Accept { from: EventState::Sending });
        assert!(refutes_absence(&c.attempts, &r, &d));
        // After the retry won the slot, it is a duplicate transport receipt.
        let mut c = Case::new().attempt(1, AttemptState::Absent).attempt(2, AttemptState::Sending);
        let r2 = c.receipt(2, 9);
        c.apply(&r2);
        let d = decide_receipt(&c.event, &c.attempts, &r);
        assert_eq!(d, ReceiptDecision::Duplicate);
        assert!(refutes_absence(&c.attempts, &r, &d));
        assert!(!refutes_absence(&c.attempts, &r2, &ReceiptDecision::AlreadyAccepted));
    }

    #[test]
    fn a_message_no_registered_attempt_sent_is_evidence_never_a_quarantine() {
        // A mirror copy with a made-up or missing attemptId, other bytes and no destination digest.
        let c = Case::new().attempt(1, AttemptState::Unknown).state(EventState::Reconciling);
        let mut r = c.receipt(7, 5);
        r.payload_digest = sha256_digest(b"mirrored");
        r.destination_digest = String::new();
        let d = decide_receipt(&c.event, &c.attempts, &r);
        assert_eq!(d, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt });
        assert!(is_unregistered_message(&d));
        // The same divergence from a registered attempt is quarantined.
        let mut r = c.receipt(1, 5);
        r.payload_digest = sha256_digest(b"mirrored");
        assert!(matches!(decide_receipt(&c.event, &c.attempts, &r), ReceiptDecision::Quarantine { .. }));
    }

    #[test]
    fn identity_mismatches_are_rejected() {
        let c = Case::new().attempt(1, AttemptState::Sending);
        let mut r = c.receipt(1, 5);
        r.envelope_generation = 2;
        assert_eq!(decide_receipt(&c.event, &c.attempts, &r), ReceiptDecision::Reject { reason: RejectReason::EnvelopeGenerationMismatch });
        let mut r = c.receipt(1, 5);
        r.event_id = EventId::from_parts(1, 2);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &r), ReceiptDecision::Reject { reason: RejectReason::WrongEvent });
        let r = c.receipt(1, -1);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &r), ReceiptDecision::Reject { reason: RejectReason::InvalidOffset });
    }

    #[test]
    fn a_quarantined_event_takes_no_slot_but_keeps_a_genuine_copy_as_evidence() {
        // Its genuine message is in the log (consumers may apply it): kept
        // as a duplicate transport receipt; the slot stays empty.
        let c = Case::new().attempt(1, AttemptState::Unknown).state(EventState::Quarantined);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Duplicate);
        let c = Case::new().attempt(1, AttemptState::NotSent).state(EventState::Quarantined);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Reject { reason: RejectReason::AttemptClosed });
    }

    #[test]
    fn a_skipped_event_takes_no_slot_but_keeps_a_late_copy_as_evidence() {
        // An UNKNOWN skipped by an operator whose send did reach the log:
        // the key has moved on, the event stays SKIPPED, the copy is kept.
        let c = Case::new().attempt(1, AttemptState::Unknown).state(EventState::Skipped);
        assert_eq!(decide_receipt(&c.event, &c.attempts, &c.receipt(1, 5)), ReceiptDecision::Duplicate);
        assert!(!EventState::Skipped.accepts_receipt());
    }

    #[test]
    fn two_attempts_cannot_claim_one_offset() {
        let mut c = Case::new().attempt(1, AttemptState::Sending).attempt(2, AttemptState::Unknown);
        let r = c.receipt(1, 5);
        c.apply(&r);
        assert_eq!(c.apply(&c.receipt(2, 5)), ReceiptDecision::Reject { reason: RejectReason::ConflictingPlacement });
    }
}
