//! The drill's verdict, from a [`Snapshot`] of the databases and of the
//! broker's log taken after the faults stopped and the system settled.
//!
//! Pure: no I/O, so the checker itself is tested with made-up snapshots
//! (`tests/checker.rs`): a log with an unaccounted copy, a missing event, a
//! second effect, keys out of order must each turn the verdict to FAIL.
//!
//! What counts as what:
//! - **lost with the broker**: a PUBLISHED event whose primary receipt names
//!   a position that does not hold its message in the current log, sent
//!   (attempt started) before the replacement broker was up. The product
//!   promises to report it (`receipt_position_lost`, docs/OPERATIONS.md §5
//!   and §6 "A topic was recreated, or the cluster replaced"): reported, it
//!   is counted and printed, never a failure; unreported, it is a failure.
//! - **reported UNKNOWN**: an event still DISPATCH_UNKNOWN at the end with a
//!   finding naming it (`log_unavailable`, `unknown_past_slo`) and an attempt
//!   started before the replacement broker was up: its message may have
//!   gone with the lost log, the runbook's case ("nothing can prove that the
//!   lost log did not hold it"). **held by an UNKNOWN**: a PENDING event
//!   whose key has an earlier event that is a reported UNKNOWN (per-key
//!   ordering holds it, as documented). Both counted, not failures. An
//!   UNKNOWN whose every attempt went to the current broker is not covered
//!   by that case: left unresolved, it fails (the current log can decide it).
//! - every other event not PUBLISHED, every copy in the log that is neither
//!   a primary receipt, nor a recorded duplicate receipt, nor named by a
//!   finding, every second effect, every effect without its receipt, every
//!   event in the current log a consumer never applied, every key whose
//!   first copies are out of commit order: failures, with evidence.

use std::collections::{BTreeMap, HashMap, HashSet};

/// A committed business row (the drill's `chaos_orders`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusinessRow {
    /// The order's id (the command key is `order-<id>`).
    pub order_id: String,
    /// The aggregate (one ordering key per aggregate).
    pub aggregate_id: String,
    /// Position of the order in its aggregate: 1, 2, ... in commit order.
    pub version: i64,
    /// The event `emit` answered in the same transaction.
    pub event_id: String,
}

/// An event, from the exception lane (`outbox_events`) or the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRow {
    /// The eventId.
    pub event_id: String,
    /// Its state at the end.
    pub state: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// The aggregate version (the drill's commit order within the key).
    pub aggregate_version: i64,
    /// The frozen routing key.
    pub routing_key: String,
    /// The frozen payload digest (`sha256:<hex>`).
    pub payload_digest: String,
    /// Whether it was ever DISPATCH_UNKNOWN (`unknown_since_ms` set, or a recorded resolution).
    pub was_unknown: bool,
    /// When its first attempt started (ms since the epoch), if it has one.
    pub first_attempt_at_ms: Option<i64>,
}

/// A primary or duplicate transport receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The event.
    pub event_id: String,
    /// Topic of the position.
    pub topic: String,
    /// Partition of the position.
    pub partition: i32,
    /// Offset of the position.
    pub offset: i64,
    /// When the attempt that produced the message started (ms since the epoch).
    pub attempt_started_at_ms: i64,
}

/// An `outbox_findings` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Its kind, e.g. `receipt_position_lost`.
    pub kind: String,
    /// The event (or label) it names.
    pub event_id: String,
    /// Its detail text (names positions as `cluster/topic/partition@offset`).
    pub detail: String,
}

/// One record of the current log, as read back from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Its `outbox-event-id` header.
    pub event_id: Option<String>,
    /// `sha256:<hex>` of its value bytes.
    pub value_digest: String,
}

/// One consumer's side, from its own database.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConsumerSide {
    /// The consumer id.
    pub consumer_id: String,
    /// The event id of every effect row (with repetitions, if any).
    pub effects: Vec<String>,
    /// The event id of every consumption receipt of this consumer.
    pub receipts: Vec<String>,
}

/// When the broker was replaced (ms since the epoch, this machine's clock,
/// which is also the databases' clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replacement {
    /// The old broker was killed at.
    pub old_killed_at_ms: i64,
    /// The new, empty broker answered (its topics created) at.
    pub new_up_at_ms: i64,
}

/// Everything the checker reads.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Business rows the emitters were asked to commit.
    pub requested_events: u64,
    /// The committed business rows.
    pub business: Vec<BusinessRow>,
    /// Every outbox event.
    pub events: Vec<EventRow>,
    /// Every primary receipt (one per published event).
    pub receipts: Vec<Receipt>,
    /// Every duplicate transport receipt.
    pub duplicate_receipts: Vec<Receipt>,
    /// Every finding, open or closed.
    pub findings: Vec<Finding>,
    /// The whole current log of the drill's topic(s).
    pub log: Vec<LogRecord>,
    /// Each consumer's receipts and effects.
    pub consumers: Vec<ConsumerSide>,
    /// The broker replacement, if one happened.
    pub replacement: Option<Replacement>,
}

/// The figures of a verdict (printed on the last line).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Figures {
    /// Business rows committed.
    pub business_rows: usize,
    /// Outbox events.
    pub events: usize,
    /// Events PUBLISHED.
    pub published: usize,
    /// Events that were DISPATCH_UNKNOWN at some point.
    pub unknown: usize,
    /// Events still UNKNOWN at the end, each named by a finding.
    pub unknown_reported: usize,
    /// PENDING events held behind a reported UNKNOWN of their key.
    pub held_by_unknown: usize,
    /// Records in the current log.
    pub log_records: usize,
    /// Copies in the log beyond each event's primary one.
    pub duplicates_in_log: usize,
    /// Of those, the ones a duplicate receipt records.
    pub duplicate_receipts_in_log: usize,
    /// Of those, the ones a finding names (`unrecorded_copy`, ...).
    pub copies_named_by_findings: usize,
    /// Effects beyond the first, per consumer and event.
    pub duplicate_effects: usize,
    /// Effect rows, all consumers.
    pub effects: usize,
    /// Published events whose message went with the replaced broker (all reported).
    pub lost_with_broker: usize,
    /// Of those, events no consumer applied before the log was lost (the runbook's step 3).
    pub lost_unconsumed: usize,
    /// Findings recorded by the reconciler (open or closed), by kind.
    pub findings_by_kind: BTreeMap<String, usize>,
}

/// The checker's answer.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Every failure, one line each (capped per kind, with a count line).
    pub evidence: Vec<String>,
    /// The figures.
    pub figures: Figures,
    /// Failures per kind (uncapped counts).
    pub failures: BTreeMap<&'static str, usize>,
}

impl Verdict {
    /// No failure.
    pub fn pass(&self) -> bool {
        self.failures.is_empty()
    }

    fn fail(&mut self, kind: &'static str, line: String) {
        let n = self.failures.entry(kind).or_insert(0);
        *n += 1;
        if *n <= EVIDENCE_PER_KIND {
            self.evidence.push(format!("{kind}: {line}"));
        }
    }

    fn close(&mut self) {
        for (kind, n) in &self.failures {
            if *n > EVIDENCE_PER_KIND {
                self.evidence.push(format!("{kind}: ... {} more (total {n})", n - EVIDENCE_PER_KIND));
            }
        }
    }
}

/// Lines of evidence printed per kind of failure.
pub const EVIDENCE_PER_KIND: usize = 10;

/// Finding kinds that name an UNKNOWN the product could not resolve.
const UNKNOWN_REPORTS: &[&str] = &["log_unavailable", "unknown_past_slo"];
/// Finding kinds that account for a copy at a position their detail names.
const COPY_REPORTS: &[&str] = &["unrecorded_copy", "divergent_copy", "absence_proof_refuted", "unregistered_message"];

type Position = (String, i32, i64);

fn names_position(detail: &str, p: &Position) -> bool {
    detail.contains(&format!("/{}/{}@{}", p.0, p.1, p.2))
}

/// Checks a snapshot.
pub fn check(s: &Snapshot) -> Verdict {
    let mut v = Verdict::default();
    let events: HashMap<&str, &EventRow> = s.events.iter().map(|e| (e.event_id.as_str(), e)).collect();
    v.figures.events = s.events.len();
    v.figures.business_rows = s.business.len();
    v.figures.log_records = s.log.len();
    for f in &s.findings {
        *v.figures.findings_by_kind.entry(f.kind.clone()).or_insert(0) += 1;
    }
    let findings_of: HashMap<&str, Vec<&Finding>> = s.findings.iter().fold(HashMap::new(), |mut m, f| {
        m.entry(f.event_id.as_str()).or_default().push(f);
        m
    });
    let has_finding = |event_id: &str, kinds: &[&str]| findings_of.get(event_id).is_some_and(|fs| fs.iter().any(|f| kinds.contains(&f.kind.as_str())));
    // An open UNKNOWN the product reports, whose message may be in a lost log.
    let excused_unknown = |e: &EventRow| {
        matches!(e.state.as_str(), "DISPATCH_UNKNOWN" | "RECONCILING")
            && has_finding(&e.event_id, UNKNOWN_REPORTS)
            && s.replacement.is_some_and(|rep| e.first_attempt_at_ms.is_some_and(|t| t < rep.new_up_at_ms))
    };

    // 1. Every committed business row has one event, and every event one business row.
    if s.business.len() as u64 != s.requested_events {
        v.fail("business_rows", format!("{} business rows committed, {} requested", s.business.len(), s.requested_events));
    }
    let mut rows_of_event: HashMap<&str, usize> = HashMap::new();
    for b in &s.business {
        *rows_of_event.entry(b.event_id.as_str()).or_insert(0) += 1;
        match events.get(b.event_id.as_str()) {
            None => v.fail("business_row_without_event", format!("order {} names event {}, which the outbox does not hold", b.order_id, b.event_id)),
            Some(e) if e.aggregate_id != b.aggregate_id || e.aggregate_version != b.version => v.fail(
                "business_row_event_mismatch",
                format!("order {} ({}@{}) names event {} of {}@{}", b.order_id, b.aggregate_id, b.version, e.event_id, e.aggregate_id, e.aggregate_version),
            ),
            Some(_) => {}
        }
    }
    for e in &s.events {
        match rows_of_event.get(e.event_id.as_str()).copied().unwrap_or(0) {
            1 => {}
            0 => v.fail("event_without_business_row", format!("event {} ({}@{}) has no committed business row", e.event_id, e.aggregate_id, e.aggregate_version)),
            n => v.fail("event_with_several_business_rows", format!("event {} is named by {n} business rows", e.event_id)),
        }
    }

    // 2. States, and each primary receipt's position.
    let log_at: HashMap<Position, &LogRecord> = s.log.iter().map(|r| ((r.topic.clone(), r.partition, r.offset), r)).collect();
    let mut receipts_of: HashMap<&str, Vec<&Receipt>> = HashMap::new();
    for r in &s.receipts {
        receipts_of.entry(r.event_id.as_str()).or_default().push(r);
    }
    let primary_positions: HashSet<Position> = s.receipts.iter().map(|r| (r.topic.clone(), r.partition, r.offset)).collect();
    let mut lost: Vec<&str> = Vec::new();
    // The oldest reported UNKNOWN version per key (for held PENDING events).
    let mut reported_unknown_head: HashMap<&str, i64> = HashMap::new();
    for e in &s.events {
        if e.was_unknown {
            v.figures.unknown += 1;
        }
        if excused_unknown(e) {
            let head = reported_unknown_head.entry(e.routing_key.as_str()).or_insert(i64::MAX);
            *head = (*head).min(e.aggregate_version);
        }
    }
    for e in &s.events {
        let receipts = receipts_of.get(e.event_id.as_str()).map(Vec::as_slice).unwrap_or_default();
        match e.state.as_str() {
            "PUBLISHED" => {
                v.figures.published += 1;
                if receipts.len() != 1 {
                    v.fail("published_without_one_receipt", format!("event {} is PUBLISHED with {} primary receipts", e.event_id, receipts.len()));
                    continue;
                }
                let r = receipts[0];
                let pos = (r.topic.clone(), r.partition, r.offset);
                match log_at.get(&pos) {
                    Some(m) if m.event_id.as_deref() == Some(e.event_id.as_str()) => {
                        if m.value_digest != e.payload_digest {
                            v.fail("receipt_position_other_bytes", format!("event {}'s receipt {}/{}@{} holds a message of it with digest {} (frozen {})", e.event_id, r.topic, r.partition, r.offset, m.value_digest, e.payload_digest));
                        }
                    }
                    there => {
                        let holds = there.map_or("nothing (beyond the log's end)".to_owned(), |m| format!("{:?}'s message", m.event_id));
                        let sent_to_old_log = s.replacement.is_some_and(|rep| r.attempt_started_at_ms < rep.new_up_at_ms);
                        if !sent_to_old_log {
                            v.fail("receipt_position_not_in_log", format!("event {}'s receipt {}/{}@{} holds {holds}, and no broker replacement explains it", e.event_id, r.topic, r.partition, r.offset));
                        } else if !has_finding(&e.event_id, &["receipt_position_lost"]) {
                            v.fail("lost_with_broker_unreported", format!("event {}'s receipt {}/{}@{} (attempt started before the new broker was up) holds {holds}, and no receipt_position_lost finding names it", e.event_id, r.topic, r.partition, r.offset));
                        } else {
                            lost.push(e.event_id.as_str());
                        }
                    }
                }
            }
            "DISPATCH_UNKNOWN" | "RECONCILING" if excused_unknown(e) => v.figures.unknown_reported += 1,
            "PENDING" if reported_unknown_head.get(e.routing_key.as_str()).is_some_and(|head| *head < e.aggregate_version) => v.figures.held_by_unknown += 1,
            "DISPATCH_UNKNOWN" | "RECONCILING" => v.fail(
                "unknown_unresolved",
                format!(
                    "event {} ({}@{}, key {}) is {}; {}",
                    e.event_id,
                    e.aggregate_id,
                    e.aggregate_version,
                    e.routing_key,
                    e.state,
                    if has_finding(&e.event_id, UNKNOWN_REPORTS) { "a finding names it, but every attempt went to the current broker, whose log can decide it" } else { "no finding names it" }
                ),
            ),
            other => v.fail("not_published", format!("event {} ({}@{}, key {}) is {other}", e.event_id, e.aggregate_id, e.aggregate_version, e.routing_key)),
        }
    }
    v.figures.lost_with_broker = lost.len();

    // 3. Every copy in the log is accounted for.
    let duplicate_positions: HashSet<(String, Position)> = s.duplicate_receipts.iter().map(|r| (r.event_id.clone(), (r.topic.clone(), r.partition, r.offset))).collect();
    for m in &s.log {
        let pos = (m.topic.clone(), m.partition, m.offset);
        let Some(id) = m.event_id.as_deref() else {
            v.fail("message_without_event_id", format!("{}/{}@{} carries no outbox-event-id", m.topic, m.partition, m.offset));
            continue;
        };
        let Some(e) = events.get(id) else {
            v.fail("message_of_unknown_event", format!("{}/{}@{} carries event {id}, which the outbox never committed", m.topic, m.partition, m.offset));
            continue;
        };
        let is_primary = receipts_of.get(id).is_some_and(|rs| rs.iter().any(|r| r.topic == m.topic && r.partition == m.partition && r.offset == m.offset));
        if is_primary {
            continue;
        }
        v.figures.duplicates_in_log += 1;
        let named = findings_of.get(id).is_some_and(|fs| fs.iter().any(|f| COPY_REPORTS.contains(&f.kind.as_str()) && names_position(&f.detail, &pos)));
        if duplicate_positions.contains(&(id.to_owned(), pos.clone())) {
            v.figures.duplicate_receipts_in_log += 1;
            if m.value_digest != e.payload_digest && !named {
                v.fail("duplicate_with_other_bytes", format!("{}/{}@{}: a duplicate receipt of {id} whose bytes have digest {} (frozen {})", m.topic, m.partition, m.offset, m.value_digest, e.payload_digest));
            }
        } else if named {
            v.figures.copies_named_by_findings += 1;
        } else {
            let other = if primary_positions.contains(&pos) { " (another event's receipt names this position)" } else { "" };
            v.fail("unaccounted_copy", format!("{}/{}@{}: a copy of event {id} that is neither its primary receipt, nor a duplicate receipt, nor named by a finding{other}", m.topic, m.partition, m.offset));
        }
    }

    // 4. Effects: one per event per consumer, each with its receipt; every
    //    event of the current log applied.
    let in_log: HashSet<&str> = s.log.iter().filter_map(|m| m.event_id.as_deref()).filter(|id| events.contains_key(id)).collect();
    let mut applied_by_all: Option<HashSet<&str>> = None;
    for c in &s.consumers {
        v.figures.effects += c.effects.len();
        let mut count: HashMap<&str, usize> = HashMap::new();
        for id in &c.effects {
            *count.entry(id.as_str()).or_insert(0) += 1;
        }
        for (id, n) in &count {
            if *n > 1 {
                v.figures.duplicate_effects += n - 1;
                v.fail("duplicate_effect", format!("consumer {} applied event {id} {n} times", c.consumer_id));
            }
            if !events.contains_key(id) {
                v.fail("effect_of_unknown_event", format!("consumer {} applied event {id}, which the outbox never committed", c.consumer_id));
            }
        }
        let receipts: HashSet<&str> = c.receipts.iter().map(String::as_str).collect();
        if receipts.len() != c.receipts.len() {
            v.fail("consumer_receipts_repeat", format!("consumer {} holds {} receipts for {} events", c.consumer_id, c.receipts.len(), receipts.len()));
        }
        if count.len() != c.effects.len() || c.effects.len() != receipts.len() {
            v.fail("effects_vs_receipts", format!("consumer {}: {} effect rows, {} distinct events with effects, {} consumption receipts", c.consumer_id, c.effects.len(), count.len(), receipts.len()));
        }
        for id in receipts.iter().filter(|id| !count.contains_key(*id)) {
            v.fail("receipt_without_effect", format!("consumer {} holds a receipt for {id} but no effect", c.consumer_id));
        }
        for id in count.keys().filter(|id| !receipts.contains(*id)) {
            v.fail("effect_without_receipt", format!("consumer {} holds an effect of {id} but no receipt", c.consumer_id));
        }
        for id in in_log.iter().filter(|id| !count.contains_key(*id)) {
            v.fail("not_consumed", format!("consumer {} never applied event {id}, which is in the current log", c.consumer_id));
        }
        let applied: HashSet<&str> = count.keys().copied().collect();
        applied_by_all = Some(match applied_by_all {
            None => applied,
            Some(a) => a.intersection(&applied).copied().collect(),
        });
    }
    let applied_by_all = applied_by_all.unwrap_or_default();
    v.figures.lost_unconsumed = lost.iter().filter(|id| !applied_by_all.contains(**id)).count();

    // 5. Per-key order: the first copies of each key's events are in commit order.
    let mut by_key: HashMap<&str, Vec<&LogRecord>> = HashMap::new();
    for m in &s.log {
        if let Some(e) = m.event_id.as_deref().and_then(|id| events.get(id)) {
            by_key.entry(e.routing_key.as_str()).or_default().push(m);
        }
    }
    for (key, mut records) in by_key {
        let partitions: HashSet<i32> = records.iter().map(|m| m.partition).collect();
        if partitions.len() > 1 {
            v.fail("key_on_several_partitions", format!("key {key} has messages on partitions {partitions:?}"));
            continue;
        }
        records.sort_by_key(|m| m.offset);
        let mut seen: HashSet<&str> = HashSet::new();
        let mut last: Option<(i64, &LogRecord)> = None;
        for m in records {
            let id = m.event_id.as_deref().unwrap_or_default();
            if !seen.insert(id) {
                continue;
            }
            let version = events[id].aggregate_version;
            if let Some((prev, pm)) = last {
                if version <= prev {
                    v.fail("key_out_of_order", format!("key {key}: first copy of version {version} ({id}) at {}@{} follows version {prev} at {}@{}", m.partition, m.offset, pm.partition, pm.offset));
                }
            }
            last = Some((version, m));
        }
    }
    v.close();
    v
}

/// The figures as `name=value` pairs, in the order the last line prints them.
pub fn figure_pairs(f: &Figures) -> Vec<(&'static str, String)> {
    vec![
        ("events", f.events.to_string()),
        ("published", f.published.to_string()),
        ("unknown", f.unknown.to_string()),
        ("unknown_reported", f.unknown_reported.to_string()),
        ("held_by_unknown", f.held_by_unknown.to_string()),
        ("duplicates_in_log", f.duplicates_in_log.to_string()),
        ("duplicate_receipts_in_log", f.duplicate_receipts_in_log.to_string()),
        ("copies_named_by_findings", f.copies_named_by_findings.to_string()),
        ("duplicate_effects", f.duplicate_effects.to_string()),
        ("effects", f.effects.to_string()),
        ("lost_with_broker", f.lost_with_broker.to_string()),
        ("lost_unconsumed", f.lost_unconsumed.to_string()),
        ("log_records", f.log_records.to_string()),
    ]
}
