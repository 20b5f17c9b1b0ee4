//! Verification of one message before any database work.

use outbox_core::headers::{self, VerifyError};
use outbox_core::sha256_digest;
use serde_json::{json, Value};

use super::position;
use crate::event::{headers_json, ConsumedEvent, RawMessage, MAX_EVIDENCE_HEADER_BYTES};
use crate::outcome::{QuarantineReason, Quarantined};
use crate::trust::TrustPolicy;

/// Why verification refused a message: the quarantine record and the
/// evidence stored with it.
#[derive(Debug, Clone)]
pub struct Rejection {
    /// The quarantine record (position, eventId if readable, reason, digest).
    pub quarantined: Quarantined,
    /// Bounded evidence: the error, the headers, the key, sizes.
    pub evidence: Value,
}

/// Verifies one message against its own headers, before any database work:
/// the checks every message passes before a handler may see it. Pure and
/// total: it answers for any bytes, never panics, and bounds the evidence it
/// keeps. The [`Processor`](super::Processor) calls exactly this.
///
/// This accepts any source (an open [`TrustPolicy`]); the claims digest is
/// still checked where present. See [`verify_message_with`].
pub fn verify_message(consumer_id: &str, msg: &RawMessage) -> Result<ConsumedEvent, Rejection> {
    verify_message_with(consumer_id, msg, &TrustPolicy::default())
}

/// [`verify_message`] under a trust policy: after the digests and the
/// placement, the claims digest, the topic's accepted sources and its
/// signature rules ([`TrustPolicy::check`]).
pub fn verify_message_with(consumer_id: &str, msg: &RawMessage, trust: &TrustPolicy) -> Result<ConsumedEvent, Rejection> {
    let payload = msg.payload_bytes();
    let verified = match msg.non_utf8_header_names.first() {
        Some(&index) => Err(VerifyError::HeaderName { index }),
        None => headers::verify(&msg.headers, payload, &msg.topic, msg.partition, msg.key.as_deref())
            .and_then(|claims| trust.check(&msg.topic, &msg.headers).map(|t| (claims, t.source))),
    };
    match verified {
        Ok((claims, source)) => Ok(ConsumedEvent::new(consumer_id, claims, source, msg)),
        Err(e) => {
            let event_id = msg
                .headers
                .iter()
                .rev()
                .find(|(k, _)| k == headers::EVENT_ID)
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
                .map(|s| s.chars().take(100).collect::<String>());
            let evidence = json!({
                "error": e.to_string(),
                "headers": headers_json(&msg.headers, MAX_EVIDENCE_HEADER_BYTES),
                "key": bytes_json(msg.key.as_deref()),
                "payloadBytes": payload.len(),
                "tombstone": msg.payload.is_none(),
            });
            let quarantined = Quarantined {
                position: position(msg),
                event_id,
                reason: QuarantineReason::Verification { code: verify_code(&e).to_owned(), detail: e.to_string() },
                payload_digest: sha256_digest(payload),
            };
            Err(Rejection { quarantined, evidence })
        }
    }
}

fn verify_code(e: &VerifyError) -> &'static str {
    match e {
        VerifyError::MissingHeader(_) => "missing_header",
        VerifyError::Malformed { .. } => "malformed_header",
        VerifyError::PayloadDigest { .. } => "payload_digest",
        VerifyError::DestinationDigest => "destination_digest",
        VerifyError::Placement(_) => "placement",
        VerifyError::HeaderName { .. } => "header_name",
        VerifyError::ClaimsDigest => "claims_digest",
        VerifyError::SourceMissing => "source_missing",
        VerifyError::SourceUnknown(_) => "source_unknown",
        VerifyError::SignatureMissing => "signature_missing",
        VerifyError::KeyUnknown(_) => "key_unknown",
        VerifyError::SignatureBad => "signature_bad",
        VerifyError::CeSourceMismatch { .. } => "ce_source_mismatch",
        _ => "other",
    }
}

pub(super) fn bytes_json(b: Option<&[u8]>) -> Value {
    match b {
        None => Value::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => json!({ "utf8": s }),
            Err(_) => json!({ "hex": hex::encode(b) }),
        },
    }
}
