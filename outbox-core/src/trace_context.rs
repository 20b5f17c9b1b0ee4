//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the
//! `traceparent` and `tracestate` values an event carries from the
//! transaction that emitted it to the handler that consumes it.
//!
//! The outbox stores and sends the 55-character form
//! `vv-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lower-case hex.
//! Refused: version `ff` (forbidden by the specification), an all-zero trace
//! id or parent id, upper-case hex, and anything longer (a later version's
//! extra fields are not stored, so such a value is refused rather than cut).

use std::fmt;

/// Length of a stored `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;
/// Longest `tracestate` the outbox stores and sends, bytes (the
/// specification asks vendors to propagate at least 512).
pub const MAX_TRACESTATE_BYTES: usize = 512;
/// Most list members of a `tracestate` (the specification's limit).
pub const MAX_TRACESTATE_MEMBERS: usize = 32;

/// A parsed, valid `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// Version, 0..=254.
    pub version: u8,
    /// Trace id, not all zero.
    pub trace_id: [u8; 16],
    /// Parent (span) id, not all zero.
    pub parent_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

/// Why a `traceparent` or `tracestate` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceContextError {
    /// Not `vv-<32 hex>-<16 hex>-<2 hex>` in lower-case hex, 55 characters.
    #[error("traceparent is not of the form vv-<32 hex>-<16 hex>-<2 hex> (55 lower-case characters)")]
    Form,
    /// Version `ff` is invalid.
    #[error("traceparent version ff is invalid")]
    VersionFF,
    /// All-zero trace id.
    #[error("traceparent trace id is all zeros")]
    ZeroTraceId,
    /// All-zero parent id.
    #[error("traceparent parent id is all zeros")]
    ZeroParentId,
    /// A malformed `tracestate`.
    #[error("tracestate: {0}")]
    TraceState(String),
}

fn hex_into(s: &str, out: &mut [u8]) -> Result<(), TraceContextError> {
    let b = s.as_bytes();
    if b.len() != out.len() * 2 {
        return Err(TraceContextError::Form);
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(TraceContextError::Form),
    };
    for (i, o) in out.iter_mut().enumerate() {
        *o = (nibble(b[2 * i])? << 4) | nibble(b[2 * i + 1])?;
    }
    Ok(())
}

impl TraceParent {
    /// Parses and validates a `traceparent` value.
    pub fn parse(s: &str) -> Result<Self, TraceContextError> {
        if s.len() != TRACEPARENT_LEN || !s.is_ascii() {
            return Err(TraceContextError::Form);
        }
        let parts: Vec<&str> = s.split('-').collect();
        let [v, t, p, f] = parts.as_slice() else {
            return Err(TraceContextError::Form);
        };
        let (mut version, mut trace_id, mut parent_id, mut flags) = ([0u8; 1], [0u8; 16], [0u8; 8], [0u8; 1]);
        hex_into(v, &mut version)?;
        hex_into(t, &mut trace_id)?;
        hex_into(p, &mut parent_id)?;
        hex_into(f, &mut flags)?;
        if version[0] == 0xff {
            return Err(TraceContextError::VersionFF);
        }
        if trace_id == [0; 16] {
            return Err(TraceContextError::ZeroTraceId);
        }
        if parent_id == [0; 8] {
            return Err(TraceContextError::ZeroParentId);
        }
        Ok(TraceParent { version: version[0], trace_id, parent_id, flags: flags[0] })
    }

    /// Whether the sampled flag is set.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02x}-{}-{}-{:02x}", self.version, hex::encode(self.trace_id), hex::encode(self.parent_id), self.flags)
    }
}

/// Whether `s` is a valid `traceparent` ([`TraceParent::parse`]).
pub fn is_traceparent(s: &str) -> bool {
    TraceParent::parse(s).is_ok()
}

fn valid_key(k: &str) -> bool {
    // simple-key / multi-tenant-key: lcalpha or digit first, then
    // lcalpha / digit / _ - * /, with at most one @ (tenant@system).
    let simple = |s: &str, max: usize, digit_first: bool| {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= max
            && (b[0].is_ascii_lowercase() || (digit_first && b[0].is_ascii_digit()))
            && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-' | b'*' | b'/'))
    };
    match k.split_once('@') {
        None => simple(k, 256, true),
        Some((tenant, system)) => simple(tenant, 241, true) && simple(system, 14, false),
    }
}

fn valid_value(v: &str) -> bool {
    // 1..=256 printable ASCII except , and =, not ending in a space.
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= 256 && b.iter().all(|&c| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=') && b[b.len() - 1] != b' '
}

/// Validates a `tracestate` value: at most [`MAX_TRACESTATE_BYTES`] bytes
/// and [`MAX_TRACESTATE_MEMBERS`] `key=value` members, keys unique, each
/// key and value of the specification's form. An empty value is refused
/// (send no `tracestate` instead).
pub fn validate_tracestate(s: &str) -> Result<(), TraceContextError> {
    let bad = |m: String| Err(TraceContextError::TraceState(m));
    if s.len() > MAX_TRACESTATE_BYTES {
        return bad(format!("{} bytes, the limit is {MAX_TRACESTATE_BYTES}", s.len()));
    }
    let mut keys = Vec::new();
    for member in s.split(',') {
        let member = member.trim_matches(|c| c == ' ' || c == '\t');
        if member.is_empty() {
            continue;
        }
        let Some((k, v)) = member.split_once('=') else {
            return bad(format!("member {member:?} is not key=value"));
        };
        if !valid_key(k) {
            return bad(format!("key {k:?} is not a valid tracestate key"));
        }
        if !valid_value(v) {
            return bad(format!("the value of {k:?} is not a valid tracestate value"));
        }
        if keys.contains(&k) {
            return bad(format!("key {k:?} appears twice"));
        }
        keys.push(k);
    }
    if keys.is_empty() {
        return bad("no list member".into());
    }
    if keys.len() > MAX_TRACESTATE_MEMBERS {
        return bad(format!("{} members, the limit is {MAX_TRACESTATE_MEMBERS}", keys.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn accepts_the_specification_example_and_round_trips() {
        let tp = TraceParent::parse(GOOD).unwrap();
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), GOOD);
        assert!(is_traceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"));
    }

    #[test]
    fn refuses_what_the_specification_forbids() {
        assert_eq!(TraceParent::parse("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), Err(TraceContextError::VersionFF));
        assert_eq!(TraceParent::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), Err(TraceContextError::ZeroTraceId));
        assert_eq!(TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"), Err(TraceContextError::ZeroParentId));
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1é",
        ] {
            assert!(TraceParent::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn tracestate_form_and_limits() {
        validate_tracestate("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE").unwrap();
        validate_tracestate("fw529a3039@dt=ahfj, tenant@vendor=x").unwrap();
        assert!(validate_tracestate("").is_err());
        assert!(validate_tracestate("Rojo=1").is_err());
        assert!(validate_tracestate("rojo=1,rojo=2").is_err());
        assert!(validate_tracestate("rojo=a=b").is_err());
        assert!(validate_tracestate("rojo").is_err());
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert!(validate_tracestate(&many.join(",")).is_err());
        assert!(validate_tracestate(&format!("k={}", "v".repeat(600))).is_err());
    }
}
