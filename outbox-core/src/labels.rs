//! Bounded metric label values: a metric labelled by values that arrive from
//! outside (an event type in a message header, a topic name) keeps a fixed
//! number of label sets, so a flood of distinct values cannot grow a
//! process's metrics without limit.

use std::collections::HashSet;
use std::sync::Mutex;

/// Default of [`BoundedLabels::new`]'s limit: label sets per metric family.
pub const DEFAULT_MAX_LABEL_SETS: usize = 256;
/// Longest label value kept, bytes; longer values are cut at a character boundary.
pub const MAX_LABEL_VALUE_BYTES: usize = 128;
/// The value every label of a set takes once the limit is reached.
pub const OVERFLOW_LABEL: &str = "_other";

/// Admits up to `max_sets` distinct label sets; later new sets become
/// [`OVERFLOW_LABEL`] in every position.
#[derive(Debug)]
pub struct BoundedLabels {
    max_sets: usize,
    seen: Mutex<HashSet<Vec<String>>>,
}

impl Default for BoundedLabels {
    fn default() -> Self {
        BoundedLabels::new(DEFAULT_MAX_LABEL_SETS)
    }
}

fn cut(v: &str) -> String {
    if v.len() <= MAX_LABEL_VALUE_BYTES {
        return v.to_owned();
    }
    let mut end = MAX_LABEL_VALUE_BYTES;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    v[..end].to_owned()
}

impl BoundedLabels {
    /// At most `max_sets` label sets (at least 1).
    pub fn new(max_sets: usize) -> Self {
        BoundedLabels { max_sets: max_sets.max(1), seen: Mutex::new(HashSet::new()) }
    }

    /// The label values to record `values` under.
    pub fn admit(&self, values: &[&str]) -> Vec<String> {
        let key: Vec<String> = values.iter().map(|v| cut(v)).collect();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(&key) {
            return key;
        }
        if seen.len() < self.max_sets {
            seen.insert(key.clone());
            return key;
        }
        vec![OVERFLOW_LABEL.to_owned(); values.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_known_sets_and_folds_the_rest() {
        let b = BoundedLabels::new(2);
        assert_eq!(b.admit(&["orders", "a"]), ["orders", "a"]);
        assert_eq!(b.admit(&["orders", "b"]), ["orders", "b"]);
        assert_eq!(b.admit(&["orders", "c"]), [OVERFLOW_LABEL, OVERFLOW_LABEL]);
        assert_eq!(b.admit(&["orders", "a"]), ["orders", "a"]);
        let long = "é".repeat(100);
        assert!(BoundedLabels::new(5).admit(&[&long])[0].len() <= MAX_LABEL_VALUE_BYTES);
    }
}
