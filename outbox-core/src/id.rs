//! Identifiers: time-sortable event and attempt ids, and validation of the
//! free-form identifiers a caller supplies.
//!
//! An [`EventId`] is 128 bits: 48 bits of milliseconds since the Unix epoch
//! followed by 80 random bits, rendered as `evt-` and 26 characters of
//! Crockford base32 (the ULID layout). Ids therefore sort by creation time as
//! strings, and two ids of the same millisecond differ by their random part.

use std::fmt;
use std::str::FromStr;

use crate::error::CoreError;

const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
const ULID_LEN: usize = 26;

fn encode_ulid(value: u128) -> String {
    let mut out = [0u8; ULID_LEN];
    for (i, slot) in out.iter_mut().enumerate() {
        let shift = 5 * (ULID_LEN - 1 - i);
        *slot = CROCKFORD[((value >> shift) & 0x1f) as usize];
    }
    // The alphabet is ASCII, so this cannot fail.
    String::from_utf8(out.to_vec()).unwrap_or_default()
}

fn decode_ulid(field: &'static str, text: &str) -> Result<u128, CoreError> {
    if text.len() != ULID_LEN {
        return Err(CoreError::MalformedIdentifier {
            field,
            reason: format!("expected {ULID_LEN} base32 characters, got {}", text.len()),
        });
    }
    let first = text.as_bytes()[0];
    if first > b'7' {
        return Err(CoreError::MalformedIdentifier { field, reason: "value overflows 128 bits".into() });
    }
    let mut value: u128 = 0;
    for c in text.bytes() {
        let digit = CROCKFORD.iter().position(|&a| a == c).ok_or_else(|| CoreError::MalformedIdentifier {
            field,
            reason: format!("character {:?} is not upper-case Crockford base32", c as char),
        })?;
        value = (value << 5) | digit as u128;
    }
    Ok(value)
}

fn compose(unix_ms: u64, random: u128) -> u128 {
    (((unix_ms & 0xFFFF_FFFF_FFFF) as u128) << 80) | (random & ((1u128 << 80) - 1))
}

macro_rules! ulid_id {
    ($name:ident, $prefix:literal, $field:literal, $doc:literal) => {
        #[doc = $doc]
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// Builds an id from a creation time and 80 bits of randomness.
            pub fn from_parts(unix_ms: u64, random: u128) -> Self {
                $name(format!(concat!($prefix, "{}"), encode_ulid(compose(unix_ms, random))))
            }

            /// A new id for `unix_ms` with randomness from the thread RNG.
            pub fn generate(unix_ms: u64) -> Self {
                Self::from_parts(unix_ms, crate::simulation::id_random())
            }

            /// Milliseconds since the epoch encoded in the id.
            pub fn unix_ms(&self) -> u64 {
                // Parsed ids are valid by construction.
                decode_ulid($field, &self.0[$prefix.len()..]).map(|v| (v >> 80) as u64).unwrap_or(0)
            }

            /// The 80 bits after the time: random for a generated id, or
            /// what [`Self::from_parts`] was given.
            pub fn random_bits(&self) -> u128 {
                // Parsed ids are valid by construction.
                decode_ulid($field, &self.0[$prefix.len()..]).map(|v| v & ((1u128 << 80) - 1)).unwrap_or(0)
            }

            /// The rendered id.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = CoreError;
            fn from_str(s: &str) -> Result<Self, CoreError> {
                let rest = s.strip_prefix($prefix).ok_or_else(|| CoreError::MalformedIdentifier {
                    field: $field,
                    reason: format!(concat!("must start with '", $prefix, "', got {:?}"), truncate(s)),
                })?;
                decode_ulid($field, rest)?;
                Ok($name(s.to_owned()))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

ulid_id!(EventId, "evt-", "eventId", "The business identity of one logical event, born when the command is first accepted.");
ulid_id!(AttemptId, "att-", "attemptId", "The identity of one delivery attempt of one event.");

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Longest accepted free-form identifier, in bytes.
pub const MAX_IDENTIFIER_BYTES: usize = 200;

/// Checks a caller-supplied identifier (aggregate type and id, tenant, event
/// type, owner, command key, topic...): 1 to [`MAX_IDENTIFIER_BYTES`] bytes of
/// ASCII letters, digits and `.-_:/@`.
pub fn validate_identifier(field: &'static str, value: &str) -> Result<(), CoreError> {
    if value.is_empty() {
        return Err(CoreError::MalformedIdentifier { field, reason: "must not be empty".into() });
    }
    if value.len() > MAX_IDENTIFIER_BYTES {
        return Err(CoreError::MalformedIdentifier {
            field,
            reason: format!("{} bytes, the limit is {MAX_IDENTIFIER_BYTES}", value.len()),
        });
    }
    if let Some(c) = value.chars().find(|c| !(c.is_ascii_alphanumeric() || ".-_:/@".contains(*c))) {
        return Err(CoreError::MalformedIdentifier {
            field,
            reason: format!("character {c:?} is not allowed (letters, digits and .-_:/@ only)"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_render_and_parse_back() {
        let id = EventId::from_parts(1_700_000_000_123, 42);
        assert!(id.as_str().starts_with("evt-"));
        assert_eq!(id.as_str().len(), 4 + 26);
        let parsed: EventId = id.as_str().parse().unwrap();
        assert_eq!(parsed, id);
        assert_eq!(parsed.unix_ms(), 1_700_000_000_123);
    }

    #[test]
    fn event_ids_sort_by_creation_time() {
        let mut ids: Vec<EventId> = (0..200u64).rev().map(|i| EventId::from_parts(1_000 + i * 7, u128::MAX - i as u128)).collect();
        ids.sort();
        let times: Vec<u64> = ids.iter().map(|i| i.unix_ms()).collect();
        let mut sorted = times.clone();
        sorted.sort();
        assert_eq!(times, sorted);
    }

    #[test]
    fn malformed_ids_are_refused() {
        for bad in ["", "evt-", "att-01ARZ3NDEKTSV4RRFFQ69G5FAV", "evt-01ARZ3NDEKTSV4RRFFQ69G5FA", "evt-01ARZ3NDEKTSV4RRFFQ69G5FAI", "evt-81ARZ3NDEKTSV4RRFFQ69G5FAV", "evt-01arz3ndektsv4rrffq69g5fav"] {
            assert!(bad.parse::<EventId>().is_err(), "{bad} should be refused");
        }
        assert!("evt-01ARZ3NDEKTSV4RRFFQ69G5FAV".parse::<EventId>().is_ok());
    }

    #[test]
    fn identifiers_are_validated() {
        assert!(validate_identifier("tenant", "tenant-7").is_ok());
        assert!(validate_identifier("tenant", "").is_err());
        assert!(validate_identifier("tenant", "a b").is_err());
        assert!(validate_identifier("tenant", "é").is_err());
        assert!(validate_identifier("tenant", &"x".repeat(201)).is_err());
        assert!(validate_identifier("tenant", &"x".repeat(200)).is_ok());
    }
}
