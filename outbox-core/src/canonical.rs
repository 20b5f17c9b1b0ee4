//! Canonical encoding `canonical.v1` and digests.
//!
//! Every digest in the protocol is computed over bytes that any
//! implementation can reproduce. The encoding is deliberately plain:
//!
//! ```text
//! <schema>\n
//! <field>=<byte length>:<value>\n      (one line per field, in the schema's fixed order)
//! ```
//!
//! * `<schema>` names the record and its version, e.g. `outboxEnvelope.v1`.
//! * Field names and their order are fixed per schema (see [`crate::Envelope`]
//!   and [`crate::Destination`]); every field is always present.
//! * Values are UTF-8 text; integers are base-10 without sign for unsigned
//!   values, with a leading `-` only when negative; the length prefix is the
//!   value's byte length in base 10, so a value may contain any byte,
//!   including `\n` and `=`.
//! * A digest is `sha256:` followed by 64 lower-case hex characters of
//!   SHA-256 over the exact bytes.
//!
//! Changing a field, its order or a value's rendering is a new schema version
//! (`.v2`); `.v1` bytes never change meaning.

use sha2::{Digest as _, Sha256};

use crate::error::CoreError;

/// Name of this encoding, recorded beside stored canonical bytes.
pub const ENCODING_VERSION: &str = "canonical.v1";

/// A `sha256:<hex>` digest.
pub fn sha256_digest(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in Sha256::digest(bytes) {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    out
}

/// Whether `s` has the form of a digest this crate produces.
pub fn is_digest(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// Builds canonical bytes field by field.
#[derive(Debug)]
pub struct CanonicalWriter {
    buf: Vec<u8>,
}

impl CanonicalWriter {
    /// Starts a record of `schema`.
    pub fn new(schema: &str) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(schema.as_bytes());
        buf.push(b'\n');
        CanonicalWriter { buf }
    }

    /// Appends one field.
    pub fn field(mut self, name: &str, value: impl AsRef<str>) -> Self {
        let value = value.as_ref();
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(b'=');
        // Writing into a Vec cannot fail.
        let _ = std::io::Write::write_fmt(&mut self.buf, format_args!("{}", value.len()));
        self.buf.push(b':');
        self.buf.extend_from_slice(value.as_bytes());
        self.buf.push(b'\n');
        self
    }

    /// The finished bytes.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads canonical bytes back, checking the schema and the field order.
#[derive(Debug)]
pub struct CanonicalReader<'a> {
    rest: &'a [u8],
}

impl<'a> CanonicalReader<'a> {
    /// Opens `bytes`, which must start with `schema`.
    pub fn new(bytes: &'a [u8], schema: &str) -> Result<Self, CoreError> {
        let rest = bytes
            .strip_prefix(schema.as_bytes())
            .and_then(|r| r.strip_prefix(b"\n"))
            .ok_or_else(|| CoreError::InvalidEncoding(format!("expected schema {schema}")))?;
        Ok(CanonicalReader { rest })
    }

    /// Reads the next field, which must be called `name`.
    pub fn field(&mut self, name: &str) -> Result<&'a str, CoreError> {
        let bad = |why: &str| CoreError::InvalidEncoding(format!("field {name}: {why}"));
        let after = self.rest.strip_prefix(name.as_bytes()).and_then(|r| r.strip_prefix(b"=")).ok_or_else(|| bad("missing or out of order"))?;
        let colon = after.iter().take(12).position(|&b| b == b':').ok_or_else(|| bad("no length"))?;
        let len: usize = std::str::from_utf8(&after[..colon])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("bad length"))?;
        let body = &after[colon + 1..];
        if body.len() < len + 1 || body[len] != b'\n' {
            return Err(bad("truncated"));
        }
        let value = std::str::from_utf8(&body[..len]).map_err(|_| bad("not UTF-8"))?;
        self.rest = &body[len + 1..];
        Ok(value)
    }

    /// Reads the next field as an integer.
    pub fn int<T: std::str::FromStr>(&mut self, name: &str) -> Result<T, CoreError> {
        let v = self.field(name)?;
        v.parse().map_err(|_| CoreError::InvalidEncoding(format!("field {name}: {v:?} is not an integer")))
    }

    /// Requires that nothing follows the last field.
    pub fn end(self) -> Result<(), CoreError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(CoreError::InvalidEncoding("trailing bytes after the last field".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digest() {
        // SHA-256 of the empty string, a value every implementation knows.
        assert_eq!(sha256_digest(b""), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert!(is_digest(&sha256_digest(b"x")));
        assert!(!is_digest("sha256:XYZ"));
    }

    #[test]
    fn length_prefix_makes_values_unambiguous() {
        let a = CanonicalWriter::new("t.v1").field("a", "x\nb=1:y").finish();
        let b = CanonicalWriter::new("t.v1").field("a", "x").field("b", "y").finish();
        assert_ne!(a, b);
        let mut r = CanonicalReader::new(&a, "t.v1").unwrap();
        assert_eq!(r.field("a").unwrap(), "x\nb=1:y");
        r.end().unwrap();
    }

    #[test]
    fn exact_bytes_are_documented() {
        let bytes = CanonicalWriter::new("s.v1").field("k", "vé").field("n", "12").finish();
        assert_eq!(bytes, b"s.v1\nk=3:v\xc3\xa9\nn=2:12\n".to_vec());
    }

    #[test]
    fn reader_refuses_reordered_or_truncated_fields() {
        let bytes = CanonicalWriter::new("s.v1").field("a", "1").field("b", "2").finish();
        let mut r = CanonicalReader::new(&bytes, "s.v1").unwrap();
        assert!(r.field("b").is_err());
        assert!(CanonicalReader::new(&bytes[..bytes.len() - 1], "s.v1").unwrap().field("a").is_ok());
        let mut r = CanonicalReader::new(&bytes[..bytes.len() - 1], "s.v1").unwrap();
        r.field("a").unwrap();
        assert!(r.field("b").is_err());
        assert!(CanonicalReader::new(&bytes, "other.v1").is_err());
    }
}
