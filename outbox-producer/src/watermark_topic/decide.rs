//! The reader's decisions about one record, apart from any I/O: whether it
//! may speak at all ([`screen`]: it decodes, names the cluster it was read
//! from, and passes the signature rule of the consumer it names), and what
//! it does to the stored watermark of its log ([`judge`]). The reader over
//! Kafka and PostgreSQL (`reader.rs`, `apply.rs`) and the simulator's
//! reader over its own topic and an in-memory copy both decide here.

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::trust::SigningKey;
use outbox_core::watermark_record::{self, WatermarkRecord};

use super::config::no_key_reason;

/// What the reader knows besides a record when it screens it.
#[derive(Debug, Clone, Copy)]
pub struct Screen<'a> {
    /// The cluster the watermark topic was read from.
    pub cluster_id: &'a str,
    /// Each consumer's verification keys.
    pub verify_keys: &'a BTreeMap<String, Vec<SigningKey>>,
    /// The consumers opted out of verification by name.
    pub allow_unsigned: &'a BTreeSet<String>,
    /// The consumers declared in the registry.
    pub declared: &'a [String],
}

/// The parts of a record read from the watermark topic that the reader
/// decides on (the last header of each name).
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordBytes<'a> {
    /// The record's key.
    pub key: Option<&'a [u8]>,
    /// The record's value.
    pub value: Option<&'a [u8]>,
    /// The `outbox-watermark-key-id` header.
    pub key_id: Option<&'a [u8]>,
    /// The `outbox-watermark-signature` header.
    pub signature: Option<&'a [u8]>,
}

/// Why [`screen`] refused a record, and the consumer it named when it decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The reason, for the finding.
    pub why: String,
    /// The consumer the record named, when it decoded.
    pub consumer: Option<String>,
    /// What the refusal counts as.
    pub cause: Cause,
}

/// What a refusal counts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// Does not decode, or names another cluster.
    Format,
    /// Fails the signature check of a consumer with keys.
    Signature,
    /// Of a declared consumer without keys that is not opted out; the log
    /// the record is about (what its finding names).
    NoKey(String),
}

/// The log a record is about, as findings name it.
pub fn log_of(r: &WatermarkRecord) -> String {
    watermark_record::log_name(&r.cluster_id, &r.topic, r.topic_id.as_deref(), r.partition)
}

/// Decodes a record and checks that it may speak: it names the cluster it
/// was read from, and it is signed by one of the keys held for the consumer
/// it names; a consumer without keys is heard only when opted out by name
/// (a record of an undeclared consumer passes here: the caller reports it).
pub fn screen(ctx: &Screen<'_>, bytes: RecordBytes<'_>) -> Result<WatermarkRecord, Rejected> {
    let r = WatermarkRecord::decode(bytes.key, bytes.value).map_err(|e| Rejected { why: e.to_string(), consumer: None, cause: Cause::Format })?;
    if r.cluster_id != ctx.cluster_id {
        return Err(Rejected { why: format!("names cluster {:?} but was read from cluster {:?}", r.cluster_id, ctx.cluster_id), consumer: None, cause: Cause::Format });
    }
    match ctx.verify_keys.get(&r.consumer_id) {
        // The deliberate defect: a keyed consumer's records are not checked.
        Some(_) if outbox_core::simulation::mutation_active("watermark-signature-unchecked") => {}
        Some(keys) => {
            let value = bytes.value.unwrap_or_default();
            if let Err(e) = watermark_record::verify_signature(value, bytes.key_id, bytes.signature, keys) {
                return Err(Rejected { why: format!("consumer {}: {e}", r.consumer_id), consumer: Some(r.consumer_id.clone()), cause: Cause::Signature });
            }
        }
        // Opted out by name: not checked.
        None if ctx.allow_unsigned.contains(&r.consumer_id) => {}
        // Neither keyed nor opted out: refused.
        None if ctx.declared.contains(&r.consumer_id) => {
            return Err(Rejected { why: no_key_reason(&r.consumer_id), consumer: Some(r.consumer_id.clone()), cause: Cause::NoKey(log_of(&r)) });
        }
        None => {}
    }
    Ok(r)
}

/// The stored watermark of a record's log, as far as [`judge`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its committed offset.
    pub committed_offset: i64,
    /// Its counts: applied, duplicates, quarantined, dead-lettered.
    pub counts: [i64; 4],
    /// When the consumer's database last moved it, ms.
    pub updated_at_ms: i64,
    /// The log its offset was read in, if known.
    pub log_id: Option<String>,
}

/// What a record does to its log's stored watermark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// Applied (monotonically within its log; replacing the row when it is
    /// of a new log).
    Apply,
    /// Older than what is stored (a reordered earlier publication): ignored quietly.
    OutOfDate,
    /// An offset or count below what is stored, in the same log: ignored, a finding.
    MovedBack(String),
}

/// Whether `r` is of another log than the stored row `s`: both log ids
/// known and different (the consumer's reading started over in a new log).
pub fn is_new_log(s: &Stored, r: &WatermarkRecord) -> bool {
    matches!((s.log_id.as_deref(), r.log_id.as_deref()), (Some(was), Some(now)) if was != now)
}

/// Judges `r` against the stored watermark of its log (`None`: none yet).
/// A record never moves an offset or a count back within a log; one of
/// another log than the stored row's (both log ids known and different) is
/// the consumer's reading started over in a new log, and replaces it.
pub fn judge(stored: Option<&Stored>, r: &WatermarkRecord) -> Judgement {
    let Some(s) = stored else { return Judgement::Apply };
    if r.updated_at_ms < s.updated_at_ms {
        return Judgement::OutOfDate;
    }
    if is_new_log(s, r) {
        return Judgement::Apply;
    }
    let [applied, duplicates, quarantined, dead] = s.counts;
    for (name, stored, got) in [
        ("committed offset", s.committed_offset, r.committed_offset),
        ("applied count", applied, r.applied_count),
        ("duplicate count", duplicates, r.duplicate_count),
        ("quarantined count", quarantined, r.quarantined_count),
        ("dead-lettered count", dead, r.dead_lettered_count),
    ] {
        if got < stored {
            return Judgement::MovedBack(format!("{name} {got} is below the stored {stored}"));
        }
    }
    Judgement::Apply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(committed: i64, updated_at_ms: i64, log_id: Option<&str>) -> WatermarkRecord {
        WatermarkRecord {
            consumer_id: "shipping".into(),
            group_id: "shipping".into(),
            cluster_id: "c".into(),
            topic: "orders".into(),
            topic_id: None,
            log_id: log_id.map(str::to_owned),
            anchor_recorded: false,
            anchor_event_id: None,
            partition: 0,
            committed_offset: committed,
            open_gap_end: None,
            applied_count: committed,
            duplicate_count: 0,
            quarantined_count: 0,
            dead_lettered_count: 0,
            last_event_id: None,
            updated_at_ms,
            published_at_ms: updated_at_ms,
        }
    }

    fn stored(committed: i64, updated_at_ms: i64, log_id: Option<&str>) -> Stored {
        Stored { committed_offset: committed, counts: [committed, 0, 0, 0], updated_at_ms, log_id: log_id.map(str::to_owned) }
    }

    const A: &str = "AAECAwQFBgcICQoLDA0ODw";
    const B: &str = "ERESERESERESERESERESEQ";

    #[test]
    fn a_record_moves_forward_within_its_log_and_replaces_the_row_of_another() {
        assert_eq!(judge(None, &record(5, 10, None)), Judgement::Apply);
        assert_eq!(judge(Some(&stored(5, 10, Some(A))), &record(7, 11, Some(A))), Judgement::Apply);
        assert_eq!(judge(Some(&stored(5, 10, Some(A))), &record(5, 9, Some(A))), Judgement::OutOfDate);
        for lower in [record(3, 11, Some(A)), record(3, 11, None)] {
            assert!(matches!(judge(Some(&stored(5, 10, Some(A))), &lower), Judgement::MovedBack(why) if why.contains("committed offset 3 is below the stored 5")));
        }
        assert_eq!(judge(Some(&stored(5, 10, Some(A))), &record(3, 11, Some(B))), Judgement::Apply, "a new log");
        assert_eq!(judge(Some(&stored(5, 10, Some(A))), &record(3, 9, Some(B))), Judgement::OutOfDate, "older, whatever its log");
        let fewer = WatermarkRecord { applied_count: 1, ..record(6, 11, Some(A)) };
        assert!(matches!(judge(Some(&stored(5, 10, Some(A))), &fewer), Judgement::MovedBack(why) if why.contains("applied count 1")));
    }

    #[test]
    fn screening_checks_the_cluster_and_the_consumers_keys() {
        let key = SigningKey::from_hex("wm-1", &"5a".repeat(32)).unwrap();
        let keys: BTreeMap<String, Vec<SigningKey>> = [("shipping".to_owned(), vec![key.clone()])].into();
        let none = BTreeSet::new();
        let declared = vec!["shipping".to_owned(), "billing".to_owned()];
        let ctx = Screen { cluster_id: "c", verify_keys: &keys, allow_unsigned: &none, declared: &declared };
        let r = record(5, 10, None);
        let (k, v, sig) = (r.key_bytes(), r.value_bytes(), r.signature(&key));
        let signed = RecordBytes { key: Some(&k), value: Some(&v), key_id: Some(b"wm-1"), signature: Some(sig.as_bytes()) };
        assert_eq!(screen(&ctx, signed), Ok(r.clone()));
        assert_eq!(screen(&ctx, RecordBytes { signature: None, ..signed }).unwrap_err().cause, Cause::Signature);
        let other = Screen { cluster_id: "d", ..ctx };
        assert_eq!(screen(&other, signed).unwrap_err().cause, Cause::Format);
        let billing = WatermarkRecord { consumer_id: "billing".into(), ..r };
        let (bk, bv) = (billing.key_bytes(), billing.value_bytes());
        let unsigned = RecordBytes { key: Some(&bk), value: Some(&bv), ..Default::default() };
        assert!(matches!(screen(&ctx, unsigned).unwrap_err().cause, Cause::NoKey(_)));
        let opted: BTreeSet<String> = ["billing".to_owned()].into();
        assert_eq!(screen(&Screen { allow_unsigned: &opted, ..ctx }, unsigned), Ok(billing));
    }
}
