//! Source identity and message authentication.
//!
//! Every message a dispatcher writes names the outbox that wrote it
//! ([`SOURCE`], the database's source identity) and carries the digest of its
//! **message claims** ([`CLAIMS_DIGEST`]): the canonical record
//! `outboxClaims.v1` (see [`claims_bytes`]) of what the outbox headers say
//! about the event. Optionally it also carries an HMAC-SHA256 of those bytes
//! ([`SIGNATURE`]) under a key named by [`KEY_ID`].
//!
//! What this proves to a reader:
//! * the claims digest: that none of the covered headers was changed on its
//!   own (copying a message under a new eventId without recomputing the
//!   digest is caught). It proves nothing about *who* wrote the message:
//!   anyone who can produce to the topic can write a self-consistent one.
//! * the signature: that the message was written by a holder of the key,
//!   i.e. by a dispatcher of the named source (when only its dispatchers
//!   hold the key).
//!
//! `outboxClaims.v1` fields, in this order, each the exact text of a header:
//! `source` ([`SOURCE`]), `eventId`, `envelopeGeneration`, `attemptId`,
//! `aggregate` (`type/id@version`), `eventType`, `tenant`, `payloadDigest`,
//! `destinationDigest`. The record is encoded with `canonical.v1`
//! ([`crate::canonical`]); a change of field or order is a new version.

use sha2::{Digest as _, Sha256};

use crate::canonical::{sha256_digest, CanonicalWriter};
use crate::error::CoreError;
use crate::headers::{self, VerifyError};

/// The outbox's source identity (one per outbox database), on every message.
pub const SOURCE: &str = "outbox-source";
/// `sha256:` digest of the `outboxClaims.v1` bytes.
pub const CLAIMS_DIGEST: &str = "outbox-claims-digest";
/// The id of the key that signed the message (only on signed messages).
pub const KEY_ID: &str = "outbox-key-id";
/// `hmac-sha256:` + 64 lower-case hex: HMAC-SHA256 of the `outboxClaims.v1` bytes.
pub const SIGNATURE: &str = "outbox-signature";
/// Schema name of the message claims record.
pub const CLAIMS_SCHEMA: &str = "outboxClaims.v1";
/// Prefix of [`SIGNATURE`] values.
pub const SIGNATURE_PREFIX: &str = "hmac-sha256:";
/// Shortest HMAC secret accepted, bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// Longest HMAC secret accepted, bytes (one SHA-256 block).
pub const MAX_SECRET_BYTES: usize = 64;

/// The header values covered by `outboxClaims.v1`, in record order.
pub const CLAIMS_HEADERS: [(&str, &str); 9] = [
    ("source", SOURCE),
    ("eventId", headers::EVENT_ID),
    ("envelopeGeneration", headers::ENVELOPE_GENERATION),
    ("attemptId", headers::ATTEMPT_ID),
    ("aggregate", headers::AGGREGATE),
    ("eventType", headers::EVENT_TYPE),
    ("tenant", headers::TENANT),
    ("payloadDigest", headers::PAYLOAD_DIGEST),
    ("destinationDigest", headers::DESTINATION_DIGEST),
];

fn last<'a>(hs: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    hs.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
}

/// The text of the last header `name`, if present and UTF-8.
pub fn header_text<'a>(hs: &'a [(String, Vec<u8>)], name: &'static str) -> Result<Option<&'a str>, VerifyError> {
    match last(hs, name) {
        None => Ok(None),
        Some(v) => std::str::from_utf8(v).map(Some).map_err(|_| VerifyError::MissingHeader(name)),
    }
}

/// The canonical `outboxClaims.v1` bytes of a message, from the exact text of
/// its headers (the last of each name). Every covered header must be present.
pub fn claims_bytes(hs: &[(String, Vec<u8>)]) -> Result<Vec<u8>, VerifyError> {
    let mut w = CanonicalWriter::new(CLAIMS_SCHEMA);
    for (field, name) in CLAIMS_HEADERS {
        let v = header_text(hs, name)?.ok_or(VerifyError::MissingHeader(name))?;
        w = w.field(field, v);
    }
    Ok(w.finish())
}

/// An HMAC-SHA256 signing or verification key. Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKey {
    key_id: String,
    secret: Vec<u8>,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey").field("key_id", &self.key_id).field("secret", &"***").finish()
    }
}

impl SigningKey {
    /// A key: `key_id` is an identifier (1–200 bytes of `[A-Za-z0-9.-_:/@]`),
    /// the secret [`MIN_SECRET_BYTES`]..=[`MAX_SECRET_BYTES`] bytes.
    pub fn new(key_id: &str, secret: Vec<u8>) -> Result<Self, CoreError> {
        crate::id::validate_identifier("keyId", key_id)?;
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&secret.len()) {
            return Err(CoreError::MalformedIdentifier {
                field: "secret",
                reason: format!("key {key_id}: {} bytes ({MIN_SECRET_BYTES}..={MAX_SECRET_BYTES})", secret.len()),
            });
        }
        Ok(SigningKey { key_id: key_id.to_owned(), secret })
    }

    /// A key whose secret is given as hex (32..=128 hex digits).
    pub fn from_hex(key_id: &str, secret_hex: &str) -> Result<Self, CoreError> {
        let bad = || CoreError::MalformedIdentifier { field: "secret", reason: format!("key {key_id}: the secret is not hex") };
        let secret = hex::decode(secret_hex.trim()).map_err(|_| bad())?;
        Self::new(key_id, secret)
    }

    /// The key id, written in [`KEY_ID`].
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// `hmac-sha256:<hex>` of `bytes`.
    pub fn sign(&self, bytes: &[u8]) -> String {
        let mac = hmac_sha256(&self.secret, bytes);
        let mut out = String::with_capacity(SIGNATURE_PREFIX.len() + 64);
        out.push_str(SIGNATURE_PREFIX);
        for b in mac {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// Whether `signature` is this key's signature of `bytes` (constant time in the value).
    pub fn verifies(&self, bytes: &[u8], signature: &[u8]) -> bool {
        let expected = self.sign(bytes);
        expected.len() == signature.len() && expected.as_bytes().iter().zip(signature).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// HMAC-SHA256 (RFC 2104) of `data` under `key`.
pub fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(data);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Adds [`SOURCE`], [`CLAIMS_DIGEST`] and, with a key, [`KEY_ID`] and
/// [`SIGNATURE`] to headers built by [`headers::build`]. Any earlier
/// trust headers are replaced.
pub fn seal(hs: &mut Vec<(String, Vec<u8>)>, source: &str, key: Option<&SigningKey>) -> Result<(), VerifyError> {
    hs.retain(|(k, _)| ![SOURCE, CLAIMS_DIGEST, KEY_ID, SIGNATURE].contains(&k.as_str()));
    hs.push((SOURCE.into(), source.as_bytes().to_vec()));
    let bytes = claims_bytes(hs)?;
    hs.push((CLAIMS_DIGEST.into(), sha256_digest(&bytes).into_bytes()));
    if let Some(k) = key {
        hs.push((KEY_ID.into(), k.key_id().as_bytes().to_vec()));
        hs.push((SIGNATURE.into(), k.sign(&bytes).into_bytes()));
    }
    Ok(())
}

/// What [`check_claims`] read from a message's trust headers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrustClaims {
    /// The [`SOURCE`] header, when present.
    pub source: Option<String>,
    /// The `outboxClaims.v1` bytes, when the message has a claims digest
    /// (and the digest matched).
    pub claims: Option<Vec<u8>>,
    /// The [`KEY_ID`] header, when present.
    pub key_id: Option<String>,
    /// The [`SIGNATURE`] header, when present (not checked here).
    pub signature: Option<Vec<u8>>,
}

/// Reads the trust headers and checks the claims digest when there is one:
/// a message with a [`CLAIMS_DIGEST`] whose covered headers do not hash to it
/// is refused ([`VerifyError::ClaimsDigest`]), and so is one whose CloudEvents
/// `ce_source`, when present, is not the `outbox-source` the digest covers
/// ([`VerifyError::CeSourceMismatch`]; docs/WIRE.md, "Verifying a message",
/// item 7). Signatures are checked by the reader against its own keys.
pub fn check_claims(hs: &[(String, Vec<u8>)]) -> Result<TrustClaims, VerifyError> {
    let source = header_text(hs, SOURCE)?.map(str::to_owned);
    let key_id = header_text(hs, KEY_ID)?.map(str::to_owned);
    let signature = last(hs, SIGNATURE).map(<[u8]>::to_vec);
    let claims = match last(hs, CLAIMS_DIGEST) {
        None => None,
        Some(digest) => {
            let bytes = claims_bytes(hs)?;
            if sha256_digest(&bytes).as_bytes() != digest {
                return Err(VerifyError::ClaimsDigest);
            }
            if let Some(ce_source) = last(hs, crate::headers::CE_SOURCE) {
                let covered = source.as_deref().unwrap_or("");
                if ce_source != covered.as_bytes() {
                    return Err(VerifyError::CeSourceMismatch { ce_source: String::from_utf8_lossy(ce_source).chars().take(200).collect(), outbox_source: covered.to_owned() });
                }
            }
            Some(bytes)
        }
    };
    Ok(TrustClaims { source, claims, key_id, signature })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EmitRequest, RoutePolicy};
    use crate::id::{AttemptId, EventId};

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test case 2.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // Test case 6: a key longer than a block is hashed first.
        let mac = hmac_sha256(&[0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    fn sealed(key: Option<&SigningKey>) -> Vec<(String, Vec<u8>)> {
        let payload = b"{}".to_vec();
        let req = EmitRequest { command_key: "c", tenant: "t", aggregate_type: "order", aggregate_id: "o-1", aggregate_version: 1, event_type: "order.created", payload_schema: "s", payload: &payload };
        let (e, d) = req.freeze(EventId::from_parts(5, 5), 5, 9, &RoutePolicy::new("order.created", "c1", "orders", 4)).unwrap();
        let mut h = headers::build(&e, &d, &d.digest(), &AttemptId::from_parts(1, 1), None);
        seal(&mut h, "urn:uuid:a", key).unwrap();
        h
    }

    #[test]
    fn sealed_headers_check_and_sign() {
        let key = SigningKey::from_hex("k1", &"ab".repeat(32)).unwrap();
        let h = sealed(Some(&key));
        let t = check_claims(&h).unwrap();
        assert_eq!(t.source.as_deref(), Some("urn:uuid:a"));
        assert_eq!(t.key_id.as_deref(), Some("k1"));
        let claims = t.claims.unwrap();
        assert!(claims.starts_with(b"outboxClaims.v1\nsource=10:urn:uuid:a\neventId="));
        assert!(key.verifies(&claims, &t.signature.unwrap()));
        let other = SigningKey::from_hex("k1", &"cd".repeat(32)).unwrap();
        assert!(!other.verifies(&claims, key.sign(&claims).as_bytes()));
        assert!(!format!("{key:?}").contains("abab"), "the secret is never printed");
    }

    #[test]
    fn any_covered_header_changed_alone_breaks_the_digest() {
        let h = sealed(None);
        for (_, name) in CLAIMS_HEADERS {
            let mut bad = h.clone();
            for (k, v) in bad.iter_mut() {
                if k == name {
                    v.push(b'x');
                }
            }
            assert_eq!(check_claims(&bad), Err(VerifyError::ClaimsDigest), "{name}");
        }
        let mut unsealed = h.clone();
        unsealed.retain(|(k, _)| k != CLAIMS_DIGEST);
        assert_eq!(check_claims(&unsealed).unwrap().claims, None);
    }

    /// docs/WIRE.md, "Verifying a message", item 7: with a claims digest,
    /// a `ce_source` that is not the covered `outbox-source` is refused (the
    /// digest does not cover `ce_source`, so nothing else would see it).
    #[test]
    fn a_ce_source_that_is_not_the_outbox_source_is_refused() {
        let mut h = sealed(None);
        h.push((headers::CE_SOURCE.into(), b"urn:uuid:a".to_vec()));
        assert!(check_claims(&h).is_ok(), "the same source");
        let mut forged = sealed(None);
        forged.push((headers::CE_SOURCE.into(), b"urn:uuid:other".to_vec()));
        assert_eq!(check_claims(&forged), Err(VerifyError::CeSourceMismatch { ce_source: "urn:uuid:other".into(), outbox_source: "urn:uuid:a".into() }));
        // The last of a repeated header counts, as everywhere else.
        forged.push((headers::CE_SOURCE.into(), b"urn:uuid:a".to_vec()));
        assert!(check_claims(&forged).is_ok());
        // Without a claims digest nothing is covered, so nothing is compared.
        let mut unsealed = sealed(None);
        unsealed.retain(|(k, _)| k != CLAIMS_DIGEST);
        unsealed.push((headers::CE_SOURCE.into(), b"urn:uuid:other".to_vec()));
        assert!(check_claims(&unsealed).is_ok());
    }

    #[test]
    fn bad_keys_are_refused() {
        assert!(SigningKey::from_hex("k", "abc").is_err());
        assert!(SigningKey::from_hex("k", &"zz".repeat(32)).is_err());
        assert!(SigningKey::from_hex("k", &"ab".repeat(16)).is_ok());
        assert!(SigningKey::from_hex("k", &"AB".repeat(64)).is_ok());
        assert!(SigningKey::from_hex("k", &"ab".repeat(15)).is_err());
        assert!(SigningKey::from_hex("k", &"ab".repeat(65)).is_err());
        assert!(SigningKey::from_hex("bad id", &"ab".repeat(32)).is_err());
    }
}
