//! One round's decisions over the records it read, apart from reading
//! them: each screened record is refused, pinned, judged against its log's
//! stored watermark and applied, or ignored with a finding; the read
//! positions move; each consumer's gap findings open and resolve. What a
//! round writes goes through a [`RoundSink`]: PostgreSQL's in one
//! transaction (`reader.rs`), the simulator's in memory. The reader over
//! Kafka and the simulator's reader both run [`decide_round`].

use std::collections::{BTreeSet, HashMap};

use outbox_core::watermark_record::{self, WatermarkRecord, WriterDecision};

use super::decide::{log_of, Cause, Judgement, Rejected};
use crate::error::ProducerError;

/// What one round of [`WatermarkTopicReader::ingest_once`](super::WatermarkTopicReader::ingest_once) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestReport {
    /// Records read.
    pub read: usize,
    /// Records applied (the stored watermark now says what they say).
    pub applied: usize,
    /// Records older than the stored watermark (reordered earlier publications), ignored.
    pub out_of_date: usize,
    /// Records of consumers not declared in `outbox_consumers`, ignored.
    pub undeclared: usize,
    /// Records that would move an offset or a count back, ignored.
    pub moved_back: usize,
    /// Records beyond the end of their partition, ignored.
    pub beyond_end: usize,
    /// Records that do not decode, name another cluster, fail their
    /// consumer's signature check, or are of a declared consumer the reader
    /// holds no key for, ignored.
    pub rejected: usize,
    /// Of [`Self::rejected`], those that failed the signature check of a
    /// consumer with keys (unsigned, unknown key id, bad signature).
    pub bad_signature: usize,
    /// Of [`Self::rejected`], those of a declared consumer that has no
    /// verification key and is not opted out
    /// ([`WatermarkTopicConfig::allow_unsigned`](super::WatermarkTopicConfig::allow_unsigned)), signed or not.
    pub no_key: usize,
    /// Of [`Self::rejected`], those decided by another database than the
    /// one pinned for their consumer (a second writer under its id: a
    /// replay; [`watermark_record::DECIDER_HEADER`]).
    pub second_writer: usize,
    /// Logs whose last applied record stands at an open gap (a
    /// `consumer_gap` finding each; applied, not ignored).
    pub gaps: usize,
}

impl IngestReport {
    /// Records ignored with a finding.
    pub fn findings(&self) -> usize {
        self.undeclared + self.moved_back + self.beyond_end + self.rejected
    }
}

/// One finding a round records: kind, log (or the record's position),
/// consumer, detail.
pub type RoundFinding = (&'static str, String, String, String);

/// A record as a round decides on it: where it was read, what
/// [`screen`](super::decide::screen) answered, and its decider header.
#[derive(Debug, Clone)]
pub struct Screened {
    /// Partition of the watermark topic.
    pub partition: i32,
    /// Offset there.
    pub offset: i64,
    /// The screened record, or why it was refused.
    pub record: Result<WatermarkRecord, Rejected>,
    /// The last `outbox-watermark-decider` header.
    pub decider: Option<Vec<u8>>,
}

/// What a round writes. Every call of one round belongs to one
/// transaction: all of it, or none, is kept.
#[async_trait::async_trait]
pub trait RoundSink: Send {
    /// The database pinned as each consumer's writer on this cluster.
    async fn pinned(&mut self) -> Result<HashMap<String, String>, ProducerError>;
    /// Pins `decider` as the writer of `r`'s consumer.
    async fn pin(&mut self, r: &WatermarkRecord, decider: &str, now: i64) -> Result<(), ProducerError>;
    /// Counts `r` as ignored for its consumer.
    async fn ignored(&mut self, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError>;
    /// Judges `r` against its log's stored watermark
    /// ([`judge`](super::decide::judge)) and, when it applies, applies it.
    async fn apply(&mut self, r: &WatermarkRecord) -> Result<Judgement, ProducerError>;
    /// Counts an acceptable record of `r`'s consumer as arrived at `now`.
    async fn arrived(&mut self, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError>;
    /// Moves the read position of the watermark topic's `partition` to `next` (never back).
    async fn advance(&mut self, partition: i32, next: i64) -> Result<(), ProducerError>;
    /// Resolves the open `consumer_gap` findings of `consumer` on `logs`.
    async fn resolve_gaps(&mut self, consumer: &str, logs: &[String], now: i64) -> Result<(), ProducerError>;
    /// Records `findings`.
    async fn record_findings(&mut self, findings: &[RoundFinding], now: i64) -> Result<(), ProducerError>;
}

/// What a round knows besides its records.
#[derive(Debug, Clone, Copy)]
pub struct RoundInput<'a> {
    /// The cluster the watermark topic was read from.
    pub cluster_id: &'a str,
    /// The watermark topic.
    pub topic: &'a str,
    /// The consumers declared in the registry.
    pub declared: &'a [String],
    /// The end of every data partition the declared consumers' records
    /// speak about (or why it could not be read).
    pub data_ends: &'a HashMap<(String, i32), Result<i64, String>>,
    /// Per partition of the watermark topic, the offset after the last record read.
    pub next: &'a HashMap<i32, i64>,
    /// Now, ms.
    pub now: i64,
}

/// Decides a round's records in read order, counting them in `report`;
/// answers the declared consumers whose records were refused for want of a
/// verification key.
pub async fn decide_round<S: RoundSink + ?Sized>(sink: &mut S, input: RoundInput<'_>, screened: Vec<Screened>, report: &mut IngestReport) -> Result<BTreeSet<String>, ProducerError> {
    let now = input.now;
    let mut pinned = sink.pinned().await?;
    // Index in `findings` of the second-writer finding of each (log, consumer).
    let mut second_at: HashMap<(String, String), usize> = HashMap::new();
    let mut findings: Vec<RoundFinding> = Vec::new();
    let mut unkeyed: BTreeSet<String> = BTreeSet::new();
    // Index in `findings` of the no-key finding of each (log, consumer):
    // the last record's position wins.
    let mut no_key_at: HashMap<(String, String), usize> = HashMap::new();
    // Per consumer, per log: the applied watermark and its open gap's end.
    let mut gaps: HashMap<String, HashMap<String, (i64, Option<i64>)>> = HashMap::new();
    for Screened { partition: p, offset: off, record, decider } in screened {
        let at = format!("{}/{}/{p}@{off}", input.cluster_id, input.topic);
        let record = match record {
            Ok(r) => r,
            Err(Rejected { why, consumer, cause }) => {
                report.rejected += 1;
                let consumer = consumer.unwrap_or_default();
                match cause {
                    Cause::Format => findings.push(("watermark_rejected", at, consumer, format!("watermark record ignored: {why}"))),
                    Cause::Signature => {
                        report.bad_signature += 1;
                        findings.push(("watermark_rejected", at, consumer, format!("watermark record ignored: {why}")));
                    }
                    Cause::NoKey(log) => {
                        // One open finding per consumer and log, not per
                        // record: such a consumer publishes every few seconds.
                        report.no_key += 1;
                        let detail = format!("watermark record at {at} ignored: {why}");
                        match no_key_at.entry((log.clone(), consumer.clone())) {
                            std::collections::hash_map::Entry::Occupied(i) => findings[*i.get()].3 = detail,
                            std::collections::hash_map::Entry::Vacant(slot) => {
                                slot.insert(findings.len());
                                findings.push(("watermark_rejected", log, consumer.clone(), detail));
                            }
                        }
                        unkeyed.insert(consumer);
                    }
                }
                continue;
            }
        };
        let log = log_of(&record);
        if !input.declared.contains(&record.consumer_id) {
            report.undeclared += 1;
            findings.push(("watermark_undeclared_consumer", log, record.consumer_id.clone(), format!("watermark record at {at} from a consumer not declared in outbox_consumers, ignored")));
            continue;
        }
        match watermark_record::decide_writer(pinned.get(&record.consumer_id).map(String::as_str), decider.as_deref()) {
            WriterDecision::Same => {}
            WriterDecision::Pin(d) => {
                sink.pin(&record, &d, now).await?;
                pinned.insert(record.consumer_id.clone(), d);
            }
            WriterDecision::Second { pinned, found } => {
                // One open finding per consumer and log: a replay
                // publishes every few seconds.
                report.rejected += 1;
                report.second_writer += 1;
                sink.ignored(&record, now).await?;
                let detail = format!(
                    "watermark record at {at} ignored: a second writer under consumer id {c}: decided by database {found}, while {pinned} is this consumer's. A replay under the production consumer's id? Run it with OUTBOX_CONSUMER_REPLAY=true. If the consumer's database really moved, `outbox watermarks repin --consumer {c}` takes the next record's database",
                    c = record.consumer_id
                );
                match second_at.entry((log.clone(), record.consumer_id.clone())) {
                    std::collections::hash_map::Entry::Occupied(i) => findings[*i.get()].3 = detail,
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        slot.insert(findings.len());
                        findings.push(("watermark_rejected", log, record.consumer_id.clone(), detail));
                    }
                }
                continue;
            }
        }
        match input.data_ends.get(&(record.topic.clone(), record.partition)) {
            Some(Ok(end)) if record.committed_offset <= *end => {}
            other => {
                report.beyond_end += 1;
                let why = match other {
                    Some(Ok(end)) => format!("committed offset {} is beyond the partition's end {end}", record.committed_offset),
                    Some(Err(e)) => format!("the partition's end could not be read ({e})"),
                    None => "the partition's end is unknown".to_owned(),
                };
                sink.ignored(&record, now).await?;
                findings.push(("watermark_beyond_end", log, record.consumer_id.clone(), format!("watermark record at {at} ignored: {why}")));
                continue;
            }
        }
        match sink.apply(&record).await? {
            Judgement::Apply => {
                report.applied += 1;
                sink.arrived(&record, now).await?;
                gaps.entry(record.consumer_id.clone()).or_default().insert(log, (record.committed_offset, record.open_gap_end));
            }
            Judgement::OutOfDate => {
                report.out_of_date += 1;
                sink.arrived(&record, now).await?;
            }
            Judgement::MovedBack(why) => {
                report.moved_back += 1;
                sink.ignored(&record, now).await?;
                findings.push(("watermark_moved_back", log, record.consumer_id.clone(), format!("watermark record at {at} ignored: {why}")));
            }
        }
    }
    for (p, n) in input.next {
        sink.advance(*p, *n).await?;
    }
    for (consumer, logs) in gaps {
        let split = watermark_record::GapFindings::of(&consumer, logs.into_iter().map(|(log, (committed, end))| (log, committed, end)));
        report.gaps += split.open.len();
        for (log, detail) in split.open {
            findings.push((outbox_core::findings::CONSUMER_GAP, log, consumer.clone(), detail));
        }
        if !split.resolved.is_empty() {
            sink.resolve_gaps(&consumer, &split.resolved, now).await?;
        }
    }
    sink.record_findings(&findings, now).await?;
    Ok(unkeyed)
}
