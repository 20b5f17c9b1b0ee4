//! Bounded scans of one partition with fresh group-less consumers: a
//! lookup's absence proof (with the anchor check of its lower bound) and
//! its matches, and the bypass check's reads of eventId headers.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use outbox_core::headers;
use outbox_core::{sha256_digest, AnchorCheck, AttemptId, BrokerReceipt, EventId, LookupOutcome, ScanFrom};
use rdkafka::client::OAuthToken;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tracing::{debug, warn};

use super::delivery::forward_log;
use super::error::describe_kafka_error;
use super::oauth::{oauth_token, TokenSource};
use super::settings::KafkaConfig;
use super::topic_id::destination_topic_id;
use super::PAST_END_READ_MS;

/// Longest single consumer poll during a lookup.
const LOOKUP_POLL_SLICE_MS: u64 = 100;

struct LookupContext<const OAUTH: bool> {
    tokens: TokenSource,
}

impl<const OAUTH: bool> ClientContext for LookupContext<OAUTH> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = OAUTH;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        debug!(%error, reason, "kafka lookup consumer error");
    }

    fn generate_oauth_token(&self, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        oauth_token(&self.tokens, config)
    }
}

impl<const OAUTH: bool> rdkafka::consumer::ConsumerContext for LookupContext<OAUTH> {}

/// One bounded scan.
pub(super) struct ScanRequest {
    pub(super) tokens: TokenSource,
    pub(super) cluster_id: String,
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) event_id: EventId,
    /// Where to read from; for a lookup, with the bound's anchor.
    pub(super) from: ScanFrom,
    pub(super) max_messages: u64,
    pub(super) deadline: Instant,
}

impl ScanRequest {
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

static LOOKUP_SEQ: AtomicU64 = AtomicU64::new(0);

/// How the reason of a lookup that found the log incomplete (truncated,
/// recreated, compacted) begins: see [`is_log_incomplete`].
pub use outbox_core::reconcile::LOG_INCOMPLETE;

/// Whether an [`LookupOutcome::Unavailable`] reason says the log itself
/// cannot prove absence (truncated, recreated, compacted), as opposed to a
/// broker that could not be asked: the reconciler reports it as the finding
/// `log_unavailable`.
pub fn is_log_incomplete(reason: &str) -> bool {
    reason.starts_with(LOG_INCOMPLETE)
}

/// Scans one partition with a fresh consumer; see the module documentation.
///
/// - The range is `[max(from_offset, low watermark), end)`, with both
///   watermarks read first, where `end` is the high watermark or past the
///   records the broker serves beyond it (read first, [`served_past_end`]);
///   an empty range is `Absent`. A range wider
///   than `lookup_max_messages` offsets, a deadline that runs out or any
///   broker or consumer error is `Unavailable`.
/// - A message matches when its last `outbox-event-id` header equals the
///   eventId. Its receipt is `MessageClaims::receipt` of its parsed headers
///   at its real position, with the digest of the bytes read back. If the
///   headers do not parse, the receipt is built from what can be read (the
///   generation or 0, the attemptId or the nil id, the destination digest
///   header or empty) with the real payload digest and position, so the
///   receipt decision rejects or quarantines it rather than it going unseen.
/// - Messages whose placement or key contradict their destination header are
///   still reported (the receipt carries the real placement; the decision
///   quarantines a wrong partition); a wrong key is logged as a warning,
///   since a receipt has no field for it.
pub(super) fn scan_partition(config: &KafkaConfig, req: &ScanRequest) -> LookupOutcome {
    let mut found = Vec::new();
    let scanned = scan_range(config, req, None, |msg| {
        if let Some(receipt) = match_message(&req.cluster_id, &req.event_id, msg) {
            found.push(receipt);
        }
    });
    match scanned {
        Err(what) => {
            warn!(topic = %req.topic, partition = req.partition, event_id = %req.event_id, reason = %what, "kafka lookup unavailable");
            LookupOutcome::Unavailable(what)
        }
        Ok(_) if found.is_empty() => LookupOutcome::Absent,
        Ok(_) => LookupOutcome::Found(found),
    }
}

/// Reads `[max(from_offset, low), end)` of one partition with a fresh
/// consumer, where `end` is the high watermark read at the start (for a
/// lookup, with no `limit`: past the records the broker serves beyond it),
/// or `from_offset + limit` if that is lower. Calls `on_message` for each
/// message in order and returns the next offset to read and the low and
/// high watermarks read at the start. A range wider than
/// `max_messages` (with no `limit`), a deadline that runs out or any broker
/// error is an `Err`.
pub(super) fn scan_range(config: &KafkaConfig, req: &ScanRequest, limit: Option<u64>, on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<(i64, i64, i64), String> {
    if req.from.offset < 0 {
        return Err(format!("negative lower bound {}", req.from.offset));
    }
    if req.tokens.is_some() {
        scan_range_with::<true>(config, req, limit, on_message)
    } else {
        scan_range_with::<false>(config, req, limit, on_message)
    }
}

/// A fresh group-less consumer for one read of the request's partition
/// (its own `group.id`, ending in `suffix`).
fn lookup_consumer<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, suffix: &str) -> Result<BaseConsumer<LookupContext<OAUTH>>, String> {
    let seq = LOOKUP_SEQ.fetch_add(1, AtomicOrdering::Relaxed);
    let group_id = format!("outbox-lookup-{}-{}-{}{suffix}", std::process::id(), seq, req.event_id.as_str());
    config
        .lookup_config(&group_id)
        .create_with_context(LookupContext::<OAUTH> { tokens: req.tokens.clone() })
        .map_err(|e| format!("lookup consumer: {}", describe_kafka_error(&e, &config.lookup_settings())))
}

fn scan_range_with<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, limit: Option<u64>, mut on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<(i64, i64, i64), String> {
    let consumer = lookup_consumer::<OAUTH>(config, req, "")?;
    let (low, reported_end) = consumer
        .fetch_watermarks(&req.topic, req.partition, req.remaining())
        .map_err(|e| format!("watermarks of {}/{}: {e}", req.topic, req.partition))?;
    // A lookup (no limit) is an absence proof: it must read every offset
    // from the lower bound. A log that starts above the bound was truncated
    // (retention, deleted records) and a bound above the log's end belongs
    // to another log (the topic was recreated, the cluster replaced, the
    // partition truncated): either way messages may be gone unseen.
    let proof = limit.is_none();
    // Its end is the end the broker serves, not the one it reports: a
    // broker may report an end below records it serves (tansu 0.6), and a
    // proof that stopped there would call a message beyond it absent.
    let high = if proof {
        let past = served_past_end::<OAUTH>(config, req, reported_end);
        let end = outbox_core::reconcile::absence_proof_end(&req.topic, req.partition, reported_end, past)?;
        if end > reported_end {
            warn_under_reported(&req.cluster_id, &req.topic, req.partition, reported_end, end, "lookups read to the records served");
        }
        end
    } else {
        reported_end
    };
    let mut from_offset = req.from.offset;
    if proof {
        let check = match outbox_core::anchor_to_read(&req.from, low, high) {
            Ok((at, _)) => read_anchor::<OAUTH>(config, req, at, &req.from)?,
            Err(known) => known,
        };
        let plan = outbox_core::plan_absence_scan(&req.topic, req.partition, &req.from, low, high, check)?;
        if plan.floor_from_another_log {
            warn!(topic = %req.topic, partition = req.partition, event_id = %req.event_id, lower_bound = req.from.offset, ?check, low, high,
                "kafka lookup: the lower bound was read from another log (the cluster replaced or the topic recreated): reading this log from its start");
        }
        from_offset = plan.start;
    }
    let start = from_offset.max(low).max(0);
    let log_end = reported_end;
    let high = match limit {
        Some(l) => high.min(start.saturating_add(i64::try_from(l).unwrap_or(i64::MAX))),
        None => high,
    };
    if start >= high {
        debug!(topic = %req.topic, partition = req.partition, start, low, high, "kafka scan: empty range");
        return Ok((start.max(from_offset), low, log_end));
    }
    let width = u64::try_from(high - start).unwrap_or(u64::MAX);
    if width > req.max_messages {
        return Err(format!("range [{start}, {high}) of {}/{} exceeds the lookup bound of {} messages", req.topic, req.partition, req.max_messages));
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&req.topic, req.partition, Offset::Offset(start)).map_err(|e| format!("assignment: {e}"))?;
    consumer.assign(&tpl).map_err(|e| format!("assign {}/{}: {e}", req.topic, req.partition))?;
    debug!(topic = %req.topic, partition = req.partition, start, high, "kafka scan");
    let mut next = start;
    let mut read: u64 = 0;
    while next < high {
        let remaining = req.remaining();
        if remaining.is_zero() {
            return Err(format!("scan timed out at offset {next} of [{start}, {high}) of {}/{}", req.topic, req.partition));
        }
        match consumer.poll(remaining.min(Duration::from_millis(LOOKUP_POLL_SLICE_MS))) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {
                // Offsets without messages (e.g. transaction markers) advance
                // the position without yielding anything.
                if let Some(p) = position_of(&consumer, &req.topic, req.partition) {
                    next = next.max(p);
                }
            }
            Some(Err(e)) => return Err(format!("reading {}/{} at offset {next}: {e}", req.topic, req.partition)),
            Some(Ok(msg)) => {
                if msg.topic() != req.topic || msg.partition() != req.partition || msg.offset() < next {
                    continue;
                }
                if msg.offset() >= high {
                    break;
                }
                // A record above the next expected offset: the offsets in
                // between hold no record (compaction removed them, or
                // transaction markers): the range cannot prove absence.
                if proof {
                    outbox_core::reconcile::check_no_hole(&req.topic, req.partition, next, msg.offset())?;
                }
                next = msg.offset() + 1;
                read += 1;
                if read > req.max_messages {
                    return Err(format!("scan read more than {} messages", req.max_messages));
                }
                on_message(&msg);
            }
        }
    }
    debug!(topic = %req.topic, partition = req.partition, start, high, read, "kafka scan complete");
    Ok((next, low, log_end))
}

/// What offset `at` of the request's partition holds, for the anchor check
/// of an absence proof: read with a consumer of its own (a scan that starts
/// elsewhere must not see its prefetched records).
fn read_anchor<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, at: i64, from: &ScanFrom) -> Result<AnchorCheck, String> {
    let consumer = lookup_consumer::<OAUTH>(config, req, "-anchor")?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&req.topic, req.partition, Offset::Offset(at)).map_err(|e| format!("assignment: {e}"))?;
    consumer.assign(&tpl).map_err(|e| format!("assign {}/{}: {e}", req.topic, req.partition))?;
    loop {
        let remaining = req.remaining();
        if remaining.is_zero() {
            return Err(format!("reading the anchor offset {at} of {}/{} timed out", req.topic, req.partition));
        }
        match consumer.poll(remaining.min(Duration::from_millis(LOOKUP_POLL_SLICE_MS))) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {
                if position_of(&consumer, &req.topic, req.partition).is_some_and(|p| p > at) {
                    return Ok(AnchorCheck::NoRecord);
                }
            }
            Some(Err(e)) => return Err(format!("reading {}/{} at offset {at}: {e}", req.topic, req.partition)),
            Some(Ok(msg)) => {
                if msg.topic() != req.topic || msg.partition() != req.partition || msg.offset() < at {
                    continue;
                }
                if msg.offset() > at {
                    return Ok(AnchorCheck::NoRecord);
                }
                let owned = message_headers(&msg);
                let header = |name: &str| owned.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_slice());
                let holds = outbox_core::anchor_holds(from, header(headers::EVENT_ID), header(headers::ATTEMPT_ID));
                return Ok(if holds { AnchorCheck::Holds } else { AnchorCheck::HoldsOther });
            }
        }
    }
}

/// Reads up to `req.max_messages` messages of the request's partition from
/// `req.from.offset` as the broker serves them, **without** stopping at the
/// high watermark it reports (`Broker::read_past_reported_end`): until the
/// consumer reaches the partition's end (EOF), `max_messages`, or the
/// deadline. A broker that reports its end below records it serves (tansu
/// 0.6) serves them here; a broker whose log really ends there serves
/// nothing (or answers an offset out of range: an `Err`, as `auto.offset.reset`
/// is `error`). Calls `on_message` for each message at or above the offset.
pub(super) fn read_past_reported_end(config: &KafkaConfig, req: &ScanRequest, on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<(), String> {
    if req.from.offset < 0 {
        return Err(format!("negative offset {}", req.from.offset));
    }
    if req.tokens.is_some() {
        read_past_reported_end_with::<true>(config, req, on_message)
    } else {
        read_past_reported_end_with::<false>(config, req, on_message)
    }
}

fn read_past_reported_end_with<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<(), String> {
    let group_id = format!("outbox-lookup-{}-{}-past-end", std::process::id(), LOOKUP_SEQ.fetch_add(1, AtomicOrdering::Relaxed));
    let mut settings = config.lookup_config(&group_id);
    // The one place the partition's end is read from the consumer's fetches,
    // not from the watermark the broker reports.
    settings.set("enable.partition.eof", "true");
    let consumer: BaseConsumer<LookupContext<OAUTH>> = settings
        .create_with_context(LookupContext::<OAUTH> { tokens: req.tokens.clone() })
        .map_err(|e| format!("lookup consumer: {}", describe_kafka_error(&e, &config.lookup_settings())))?;
    read_served(&consumer, &req.topic, req.partition, req.from.offset, req.max_messages, req.deadline, on_message).map(|_| ())
}

/// What an absence proof's broker serves at or past its reported end
/// `reported_end`: the last offset served (`None`: nothing, the partition
/// ends there), read within [`PAST_END_READ_MS`] of the lookup's deadline.
/// A read that does not reach the partition's end is an `Err`.
fn served_past_end<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, reported_end: i64) -> Result<Option<i64>, String> {
    let deadline = req.deadline.min(Instant::now() + Duration::from_millis(PAST_END_READ_MS));
    let group_id = format!("outbox-lookup-{}-{}-past-end", std::process::id(), LOOKUP_SEQ.fetch_add(1, AtomicOrdering::Relaxed));
    let mut settings = config.lookup_config(&group_id);
    settings.set("enable.partition.eof", "true");
    let consumer: BaseConsumer<LookupContext<OAUTH>> = settings
        .create_with_context(LookupContext::<OAUTH> { tokens: req.tokens.clone() })
        .map_err(|e| format!("lookup consumer: {}", describe_kafka_error(&e, &config.lookup_settings())))?;
    let mut last = None;
    let at_end = read_served(&consumer, &req.topic, req.partition, reported_end.max(0), req.max_messages, deadline, |msg| last = Some(msg.offset()))?;
    if !at_end {
        return Err(format!("more than {} messages past the reported end", req.max_messages));
    }
    Ok(last)
}

/// Reads `topic`/`partition` from offset `at` as the broker serves it, with
/// a consumer whose `enable.partition.eof` is on: until the partition's end
/// (EOF: `Ok(true)`), `max_messages` (`Ok(false)`) or the deadline (`Err`).
/// Calls `on_message` for each message at or above `at`.
fn read_served<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
    at: i64,
    max_messages: u64,
    deadline: Instant,
    mut on_message: impl FnMut(&BorrowedMessage<'_>),
) -> Result<bool, String> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(at)).map_err(|e| format!("assignment: {e}"))?;
    consumer.assign(&tpl).map_err(|e| format!("assign {topic}/{partition}: {e}"))?;
    let mut read: u64 = 0;
    let mut at_end = false;
    while read < max_messages {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(format!("reading {topic}/{partition} past its reported end from offset {at} timed out after {read} messages"));
        }
        match consumer.poll(remaining.min(Duration::from_millis(LOOKUP_POLL_SLICE_MS))) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(_))) => {
                at_end = true;
                break;
            }
            Some(Err(e)) => return Err(format!("reading {topic}/{partition} past its reported end at offset {at}: {e}")),
            Some(Ok(msg)) => {
                if msg.topic() != topic || msg.partition() != partition || msg.offset() < at {
                    continue;
                }
                read += 1;
                on_message(&msg);
            }
        }
    }
    debug!(topic, partition, from = at, read, at_end, "kafka read past the reported end");
    Ok(at_end)
}

/// The last offset of `topic`/`partition` served at or past `from`, reading
/// at most `max_messages` messages until `deadline`, with a group-less
/// consumer of `settings` (the connection settings; the rest is set here);
/// `None` when nothing is served there. For the watermark-topic reader's
/// check of a committed offset beyond a partition's reported end. What was
/// read before an error or the deadline still counts.
pub(crate) fn last_served_past(mut settings: ClientConfig, topic: &str, partition: i32, from: i64, max_messages: u64, deadline: Instant) -> (Option<i64>, Result<(), String>) {
    let group_id = format!("outbox-past-end-{}-{}", std::process::id(), LOOKUP_SEQ.fetch_add(1, AtomicOrdering::Relaxed));
    settings
        .set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "error")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_uncommitted");
    let consumer: BaseConsumer = match settings.create() {
        Ok(c) => c,
        Err(e) => return (None, Err(format!("consumer: {e}"))),
    };
    let mut last = None;
    let read = read_served(&consumer, topic, partition, from.max(0), max_messages, deadline, |msg| last = Some(msg.offset())).map(|_| ());
    (last, read)
}

/// Partitions already said to under-report their end (cluster, topic, partition).
static UNDER_REPORTED: Mutex<BTreeSet<(String, String, i32)>> = Mutex::new(BTreeSet::new());

/// Logs, once per partition per process, that the broker reports the
/// partition's end at `reported_end` while it serves records up to
/// `served_end`: it under-reports its end (tansu 0.6 after a multi-record
/// produce batch). `what` says what reads past it.
pub(crate) fn warn_under_reported(cluster: &str, topic: &str, partition: i32, reported_end: i64, served_end: i64, what: &str) {
    let first = UNDER_REPORTED.lock().map(|mut seen| seen.insert((cluster.to_owned(), topic.to_owned(), partition))).unwrap_or(true);
    if first {
        warn!(cluster, topic, partition, reported_end, served_end,
            "{cluster}/{topic}/{partition} reports its end at {reported_end}, yet serves records up to offset {}: the broker under-reports its end (tansu 0.6 after a multi-record produce batch); {what}. Have producers send one record per batch (`batch.num.messages=1`) to such a broker", served_end - 1);
    }
}

fn position_of<const OAUTH: bool>(consumer: &BaseConsumer<LookupContext<OAUTH>>, topic: &str, partition: i32) -> Option<i64> {
    let tpl = consumer.position().ok()?;
    match tpl.find_partition(topic, partition)?.offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

/// Every header of a message, read without panicking whatever it holds
/// (rdkafka's own accessors panic on a name that is not UTF-8): such a name
/// is decoded lossily, so it can never equal an outbox header name, and the
/// message is read, reported and passed like any other.
pub fn message_headers(msg: &BorrowedMessage<'_>) -> Vec<(String, Vec<u8>)> {
    let Some(h) = msg.headers() else {
        return Vec::new();
    };
    let count = h.count();
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const std::os::raw::c_char = std::ptr::null();
        let mut value: *const std::os::raw::c_void = std::ptr::null();
        let mut size: usize = 0;
        // `BorrowedHeaders` is a zero-sized view whose address is librdkafka's
        // header list (rdkafka casts it the same way).
        let native = h as *const rdkafka::message::BorrowedHeaders as *const rdkafka_sys::rd_kafka_headers_t;
        // SAFETY: the list lives as long as `msg`; the pointers written are
        // borrowed from it and copied out below.
        let err = unsafe { rdkafka_sys::rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size) };
        if err != rdkafka_sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: header names are NUL-terminated; `value` spans `size` bytes.
        let name = String::from_utf8_lossy(unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes()).into_owned();
        let value = if value.is_null() { Vec::new() } else { unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec() };
        out.push((name, value));
    }
    out
}

/// The receipt of `msg` if its last eventId header is `event_id`; its topic
/// id is the one the message's `outbox-destination` header names.
fn match_message(cluster_id: &str, event_id: &EventId, msg: &BorrowedMessage<'_>) -> Option<BrokerReceipt> {
    let owned = message_headers(msg);
    let hit = owned.iter().rev().find(|(k, _)| k == headers::EVENT_ID)?;
    if hit.1 != event_id.as_str().as_bytes() {
        return None;
    }
    let payload = msg.payload().unwrap_or_default();
    let (topic, partition, offset) = (msg.topic(), msg.partition(), msg.offset());
    Some(match headers::parse(&owned) {
        Ok(claims) => {
            if let Err(e) = claims.check(payload, topic, partition, msg.key()) {
                warn!(event_id = %event_id, topic, partition, offset, error = %e, "kafka lookup: matching message does not verify");
            }
            claims.receipt(cluster_id, topic, partition, offset, msg.key(), payload)
        }
        Err(e) => {
            warn!(event_id = %event_id, topic, partition, offset, error = %e, "kafka lookup: matching message has unreadable headers");
            let text = |name: &str| owned.iter().rev().find(|(k, _)| k == name).and_then(|(_, v)| std::str::from_utf8(v).ok());
            BrokerReceipt {
                event_id: event_id.clone(),
                envelope_generation: text(headers::ENVELOPE_GENERATION).and_then(|v| v.parse().ok()).unwrap_or(0),
                attempt_id: text(headers::ATTEMPT_ID).and_then(|v| v.parse().ok()).unwrap_or_else(|| AttemptId::from_parts(0, 0)),
                payload_digest: sha256_digest(payload),
                destination_digest: text(headers::DESTINATION_DIGEST).unwrap_or_default().to_owned(),
                cluster_id: cluster_id.to_owned(),
                topic: topic.to_owned(),
                topic_id: destination_topic_id(&owned),
                partition,
                offset,
                key: Some(msg.key().unwrap_or_default().to_vec()),
                log_id: None,
            }
        }
    })
}
