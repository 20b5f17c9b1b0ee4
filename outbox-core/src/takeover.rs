//! Partial takeover during a rollout (PROTOCOL §11): which events the outbox
//! dispatcher sends and which stay with the publisher it replaces.
//!
//! The choice is made once, at emit, and frozen with the event: a new
//! takeover policy generation only affects events emitted after it, so an
//! event never changes hands once it exists (let alone once it has an attempt).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::id::EventId;

/// Number of takeover buckets; a policy's share is in basis points of it.
pub const TAKEOVER_BUCKETS: u32 = 10_000;

/// The takeover bucket of an eventId, `0..10_000`: the first 8 bytes of
/// sha256 of the eventId text, read big-endian, modulo 10 000.
///
/// Deterministic and implementation-independent, so any dispatcher, the
/// legacy publisher and an operator's SQL compute the same bucket.
pub fn takeover_bucket(event_id: &EventId) -> u32 {
    let d = Sha256::digest(event_id.as_str().as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    (u64::from_be_bytes(first) % u64::from(TAKEOVER_BUCKETS)) as u32
}

/// Who sends an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Publisher {
    /// The outbox dispatcher (normal operation).
    Outbox,
    /// The publisher being replaced; the outbox only shadows it.
    Legacy,
}

impl Publisher {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Publisher::Outbox => "outbox",
            Publisher::Legacy => "legacy",
        }
    }

    /// Parses [`Publisher::as_str`].
    pub fn parse(s: &str) -> Result<Self, crate::CoreError> {
        match s {
            "outbox" => Ok(Publisher::Outbox),
            "legacy" => Ok(Publisher::Legacy),
            other => Err(crate::CoreError::MalformedIdentifier { field: "publisher", reason: format!("unknown publisher {other:?}") }),
        }
    }
}

/// One generation of the takeover policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TakeoverPolicy {
    /// Generation (the highest is current).
    pub generation: u32,
    /// Event types the outbox may own; `*` stands for every type.
    pub event_types: Vec<String>,
    /// Share of those types' events the outbox owns, basis points (0..=10000).
    pub percent_bp: u32,
}

impl TakeoverPolicy {
    /// Whether the outbox owns events of `event_type` with `event_id` under this policy.
    pub fn owns(&self, event_type: &str, event_id: &EventId) -> bool {
        self.event_types.iter().any(|t| t == event_type || t == "*") && takeover_bucket(event_id) < self.percent_bp
    }
}

/// Who sends an event: with no policy at all the outbox owns everything.
pub fn decide_publisher(policy: Option<&TakeoverPolicy>, event_type: &str, event_id: &EventId) -> Publisher {
    match policy {
        None => Publisher::Outbox,
        Some(p) if p.owns(event_type, event_id) => Publisher::Outbox,
        Some(_) => Publisher::Legacy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_is_deterministic_and_documented() {
        let id: EventId = "evt-01J00000000000000000000000".parse().unwrap();
        assert_eq!(takeover_bucket(&id), takeover_bucket(&id));
        // Recompute from the definition.
        let d = Sha256::digest(id.as_str().as_bytes());
        let want = u64::from_be_bytes(d[..8].try_into().unwrap()) % 10_000;
        assert_eq!(u64::from(takeover_bucket(&id)), want);
    }

    #[test]
    fn buckets_are_roughly_uniform_over_10000_ids() {
        let ids: Vec<EventId> = (0..10_000u64).map(|i| EventId::from_parts(1_700_000_000_000 + i, u128::from(i) * 7919)).collect();
        let mut per_decile = [0u32; 10];
        for id in &ids {
            let b = takeover_bucket(id);
            assert!(b < TAKEOVER_BUCKETS);
            per_decile[(b / 1_000) as usize] += 1;
        }
        for n in per_decile {
            assert!((850..=1_150).contains(&n), "{per_decile:?}");
        }
        let five = ids.iter().filter(|id| takeover_bucket(id) < 500).count();
        assert!((400..=600).contains(&five), "5% selected {five} of 10000");
    }

    #[test]
    fn no_policy_means_the_outbox_owns_everything() {
        let id = EventId::from_parts(1, 2);
        assert_eq!(decide_publisher(None, "a", &id), Publisher::Outbox);
        let shadow = TakeoverPolicy { generation: 1, event_types: vec![], percent_bp: 10_000 };
        assert_eq!(decide_publisher(Some(&shadow), "a", &id), Publisher::Legacy);
        let all = TakeoverPolicy { generation: 2, event_types: vec!["a".into()], percent_bp: 10_000 };
        assert_eq!(decide_publisher(Some(&all), "a", &id), Publisher::Outbox);
        assert_eq!(decide_publisher(Some(&all), "b", &id), Publisher::Legacy);
        let none = TakeoverPolicy { percent_bp: 0, ..all };
        assert_eq!(decide_publisher(Some(&none), "a", &id), Publisher::Legacy);
        let every = TakeoverPolicy { generation: 3, event_types: vec!["*".into()], percent_bp: 10_000 };
        assert_eq!(decide_publisher(Some(&every), "z", &id), Publisher::Outbox);
        assert_eq!(Publisher::parse("legacy").unwrap(), Publisher::Legacy);
        assert!(Publisher::parse("x").is_err());
    }
}
