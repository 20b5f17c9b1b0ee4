//! Gaps in what a consumer read, and how far its watermark may move.
//!
//! A consumer's watermark on a log says "every message below this offset was
//! decided here": retention purges on it and the reconciler counts on it.
//! Kafka can make a consumer skip offsets it never decided: its committed
//! offset fell below the log's start (retention passed it), an operator
//! reset the group to the end, a new group started at the end. librdkafka
//! then simply fetches from the new place. This module turns such a jump
//! into a recorded *gap* instead of a watermark that passes it.
//!
//! Per partition, a store keeps a [`Reading`]: the offset after the greatest
//! one decided (`next_offset`) and the open gaps. [`decide_reading`] takes
//! the offsets a transaction decided and answers the new reading:
//! - offsets decided beyond `next_offset` with others missing before them
//!   open a gap over the missing range;
//! - a replay that decides a gap's first (or last) offsets shrinks it from
//!   that side; a gap whose range was all decided closes (`replayed`);
//! - the watermark of the partition may move to at most the start of its
//!   first open gap ([`ReadingChange::watermark_cap`]).
//!
//! An operator closes a gap that cannot be replayed (its messages are gone)
//! with [`accept_gap`](crate::accept_gap): the watermark then moves on, and
//! the events of the range stay `unconsumed_published` findings on the
//! producer's side, which is the truth about them.
//!
//! A partition this consumer never decided anything of starts its reading at
//! offset 0: a first read that begins later is a gap too (a group that
//! started at the end, or a log whose start retention moved). Pure
//! functions, no I/O: the PostgreSQL and in-memory stores both apply them.

use serde::{Deserialize, Serialize};

/// A range of one partition's offsets the consumer skipped: `[from_offset,
/// to_offset)`, as it stands; `detected_from` is where it began when found
/// (its identity: it never changes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetGap {
    /// The gap's start when it was found.
    pub detected_from: i64,
    /// The first offset not decided.
    pub from_offset: i64,
    /// The first offset after the range (decided, or not read yet).
    pub to_offset: i64,
}

impl OffsetGap {
    /// Whether every offset of the range has been decided.
    pub fn is_closed(&self) -> bool {
        self.from_offset >= self.to_offset
    }

    /// The number of offsets still undecided.
    pub fn len(&self) -> i64 {
        (self.to_offset - self.from_offset).max(0)
    }

    /// Whether no offset is left undecided (the same as [`is_closed`](Self::is_closed)).
    pub fn is_empty(&self) -> bool {
        self.is_closed()
    }
}

/// What a store knows of one partition's reading before a transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reading {
    /// The offset after the greatest one decided (`None`: nothing decided yet).
    pub next_offset: Option<i64>,
    /// The open gaps, in any order.
    pub open: Vec<OffsetGap>,
    /// The log the reading was kept in ([`RawMessage::log_id`](crate::RawMessage::log_id);
    /// `None`: not known).
    pub log_id: Option<String>,
}

/// What a transaction changes in a partition's reading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadingChange {
    /// The new offset after the greatest one decided.
    pub next_offset: i64,
    /// Gaps found in this transaction.
    pub opened: Vec<OffsetGap>,
    /// Open gaps this transaction shrank (closed when [`OffsetGap::is_closed`]).
    pub shrunk: Vec<OffsetGap>,
    /// The highest value the partition's watermark may take: the start of
    /// its first gap still open (`None`: no gap open).
    pub watermark_cap: Option<i64>,
    /// The log the reading is kept in from now on (`None`: not known).
    pub log_id: Option<String>,
    /// Whether the messages were of another log than the reading's
    /// ([`reading_in_log`]): the store replaces the reading (its next
    /// offset may go back, the old log's gaps are dropped) and the
    /// partition's watermark rows of the old log.
    pub new_log: bool,
}

/// The reading a transaction decides from, for messages fetched from the
/// log `log_id`, and whether that log replaced the reading's: `before` when
/// it was kept in the same log (or either id is not known; the id then
/// becomes the one known), and a reading that starts over (nothing decided,
/// no gap) when the log is another. A topic deleted and created again
/// under its name, or a cluster replaced, starts its offsets anew: what
/// this consumer decided in the old log says nothing of the new one's
/// offsets, so a first read of the new log past its start is a gap there.
pub fn reading_in_log(before: Reading, log_id: Option<&str>) -> (Reading, bool) {
    match (before.log_id.as_deref(), log_id) {
        (Some(was), Some(now)) if was != now => (Reading { next_offset: None, open: Vec::new(), log_id: Some(now.to_owned()) }, true),
        (None, Some(now)) => (Reading { log_id: Some(now.to_owned()), ..before }, false),
        _ => (before, false),
    }
}

/// The reading after deciding `decided` on messages fetched from the log
/// `log_id`, from the reading `stored` kept for the partition: started over
/// first when `log_id` replaced the stored reading's log
/// ([`reading_in_log`]; the change then says so, `new_log`).
pub fn decide_reading_in_log(stored: &Reading, log_id: Option<&str>, decided: &[i64]) -> ReadingChange {
    let (before, new_log) = reading_in_log(stored.clone(), log_id);
    ReadingChange { new_log, ..decide_reading(&before, decided) }
}

/// The reading after deciding `decided` (the offsets a transaction decided
/// on the partition, in any order, repeats allowed), from `before`.
pub fn decide_reading(before: &Reading, decided: &[i64]) -> ReadingChange {
    let mut offsets: Vec<i64> = decided.iter().copied().filter(|&o| o >= 0).collect();
    offsets.sort_unstable();
    offsets.dedup();
    // Runs of consecutive offsets: [start, end).
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for o in offsets {
        match runs.last_mut() {
            Some((_, end)) if *end == o => *end = o + 1,
            _ => runs.push((o, o + 1)),
        }
    }
    let mut frontier = before.next_offset.unwrap_or(0).max(0);
    let mut opened = Vec::new();
    for &(start, end) in &runs {
        if start > frontier {
            opened.push(OffsetGap { detected_from: frontier, from_offset: frontier, to_offset: start });
        }
        frontier = frontier.max(end);
    }
    let mut shrunk = Vec::new();
    for gap in &before.open {
        let mut g = gap.clone();
        // Runs in order: one that covers the front moves the start on, and
        // the next run may then cover the new front.
        for &(start, end) in &runs {
            if start <= g.from_offset && g.from_offset < end {
                g.from_offset = end;
            }
        }
        for &(start, end) in runs.iter().rev() {
            if start > g.from_offset && start < g.to_offset && g.to_offset <= end {
                g.to_offset = start;
            }
        }
        if g.from_offset >= g.to_offset {
            // Closed: every offset of it decided; kept as the empty range at its end.
            g.from_offset = g.to_offset;
        }
        if g != *gap {
            shrunk.push(g);
        }
    }
    let still_open = before
        .open
        .iter()
        .map(|g| shrunk.iter().find(|s| s.detected_from == g.detected_from).unwrap_or(g))
        .chain(opened.iter())
        .filter(|g| !g.is_closed());
    let watermark_cap = still_open.map(|g| g.from_offset).min();
    ReadingChange { next_offset: frontier, opened, shrunk, watermark_cap, log_id: before.log_id.clone(), new_log: false }
}

/// The watermark a row may move to: `next_offset` (the offset after the last
/// message it counts, plus one) capped at the first open gap's start.
pub fn capped_watermark(next_offset: i64, cap: Option<i64>) -> i64 {
    match cap {
        Some(c) => next_offset.min(c),
        None => next_offset,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reading(next: Option<i64>, open: &[(i64, i64)]) -> Reading {
        Reading { next_offset: next, open: open.iter().map(|&(f, t)| OffsetGap { detected_from: f, from_offset: f, to_offset: t }).collect(), log_id: None }
    }

    #[test]
    fn contiguous_reading_opens_no_gap_and_caps_nothing() {
        let c = decide_reading(&reading(Some(10), &[]), &[10, 11, 12]);
        assert_eq!(c, ReadingChange { next_offset: 13, opened: vec![], shrunk: vec![], watermark_cap: None, ..ReadingChange::default() });
    }

    #[test]
    fn a_jump_past_the_next_offset_is_a_gap_that_caps_the_watermark() {
        let c = decide_reading(&reading(Some(10), &[]), &[50, 51]);
        assert_eq!(c.opened, vec![OffsetGap { detected_from: 10, from_offset: 10, to_offset: 50 }]);
        assert_eq!(c.next_offset, 52);
        assert_eq!(c.watermark_cap, Some(10));
        assert_eq!(capped_watermark(52, c.watermark_cap), 10);
    }

    #[test]
    fn a_jump_inside_one_transaction_is_a_gap() {
        let c = decide_reading(&reading(Some(0), &[]), &[0, 1, 7, 8]);
        assert_eq!(c.opened, vec![OffsetGap { detected_from: 2, from_offset: 2, to_offset: 7 }]);
        assert_eq!(c.watermark_cap, Some(2));
    }

    #[test]
    fn a_first_read_that_begins_after_offset_zero_is_a_gap() {
        let c = decide_reading(&Reading::default(), &[100]);
        assert_eq!(c.opened, vec![OffsetGap { detected_from: 0, from_offset: 0, to_offset: 100 }]);
        assert_eq!(decide_reading(&Reading::default(), &[0, 1]).opened, vec![]);
    }

    #[test]
    fn a_redelivery_below_the_next_offset_is_no_gap() {
        let c = decide_reading(&reading(Some(100), &[]), &[40, 41]);
        assert_eq!(c, ReadingChange { next_offset: 100, opened: vec![], shrunk: vec![], watermark_cap: None, ..ReadingChange::default() });
    }

    #[test]
    fn a_replay_from_the_gaps_start_shrinks_then_closes_it() {
        let before = reading(Some(60), &[(10, 50)]);
        let c = decide_reading(&before, &[10, 11, 12]);
        assert_eq!(c.shrunk, vec![OffsetGap { detected_from: 10, from_offset: 13, to_offset: 50 }]);
        assert_eq!(c.watermark_cap, Some(13));
        let after = Reading { next_offset: Some(60), open: c.shrunk.clone(), log_id: None };
        let all: Vec<i64> = (13..55).collect();
        let c = decide_reading(&after, &all);
        assert!(c.shrunk[0].is_closed(), "{c:?}");
        assert_eq!(c.watermark_cap, None);
    }

    #[test]
    fn a_replay_that_starts_inside_the_gap_keeps_its_front_open() {
        // The gap's first offsets are gone from the log: the replay reads from
        // the log's new start; the range before it stays a gap.
        let c = decide_reading(&reading(Some(60), &[(10, 50)]), &(30..60).collect::<Vec<_>>());
        assert_eq!(c.shrunk, vec![OffsetGap { detected_from: 10, from_offset: 10, to_offset: 30 }]);
        assert_eq!(c.watermark_cap, Some(10));
    }

    /// Messages of another log than the reading's start it over: the old
    /// log's next offset and gaps say nothing of the new log, and a first
    /// read of it past its start is a gap from 0, whatever was decided in
    /// the old log. The same log, or an unknown id, keeps the reading.
    #[test]
    fn a_replaced_log_starts_the_reading_over() {
        let old = Reading { next_offset: Some(500), open: vec![OffsetGap { detected_from: 10, from_offset: 10, to_offset: 20 }], log_id: Some("A".into()) };
        let (r, new_log) = reading_in_log(old.clone(), Some("B"));
        assert!(new_log);
        assert_eq!(r, Reading { next_offset: None, open: vec![], log_id: Some("B".into()) });
        // The consumer goes on in the new log from the old log's position.
        let c = decide_reading(&r, &[500, 501]);
        assert_eq!(c.opened, vec![OffsetGap { detected_from: 0, from_offset: 0, to_offset: 500 }]);
        assert_eq!(capped_watermark(c.next_offset, c.watermark_cap), 0);
        assert_eq!(c.log_id.as_deref(), Some("B"));
        assert_eq!(decide_reading_in_log(&old, Some("B"), &[500, 501]), ReadingChange { new_log: true, ..c.clone() }, "the same in one call");
        assert!(!decide_reading_in_log(&old, Some("A"), &[500, 501]).new_log);
        // Without the log's identity the same reads look continuous: the
        // watermark would pass the new log's 500 unread offsets.
        let blind = decide_reading(&old, &[500, 501]);
        assert_eq!(capped_watermark(blind.next_offset, blind.watermark_cap), 10);
        assert!(blind.opened.is_empty());
        for same in [Some("A"), None] {
            assert_eq!(reading_in_log(old.clone(), same), (old.clone(), false), "{same:?}");
        }
        let unknown = Reading { log_id: None, ..old.clone() };
        assert_eq!(reading_in_log(unknown, Some("A")), (old, false));
    }

    proptest! {
        /// Whatever is decided in whatever order: every offset below the
        /// watermark cap (and below the next offset) was decided, in this
        /// transaction or before; and every offset in an open gap was not.
        #[test]
        fn the_watermark_never_passes_an_undecided_offset(batches in proptest::collection::vec(proptest::collection::vec(0i64..200, 0..20), 1..12)) {
            let mut decided = std::collections::BTreeSet::new();
            let mut r = Reading::default();
            for batch in batches {
                let c = decide_reading(&r, &batch);
                decided.extend(batch.iter().copied());
                let mut open: Vec<OffsetGap> = r.open.iter().map(|g| c.shrunk.iter().find(|s| s.detected_from == g.detected_from).unwrap_or(g).clone()).collect();
                open.extend(c.opened.iter().cloned());
                open.retain(|g| !g.is_closed());
                r = Reading { next_offset: Some(c.next_offset), open, log_id: None };
                let w = capped_watermark(c.next_offset, c.watermark_cap);
                for o in 0..w {
                    prop_assert!(decided.contains(&o), "watermark {} passes undecided offset {}", w, o);
                }
                // And nothing skipped goes unrecorded: every undecided offset
                // below the next offset lies in an open gap.
                for o in 0..c.next_offset {
                    if !decided.contains(&o) {
                        prop_assert!(r.open.iter().any(|g| g.from_offset <= o && o < g.to_offset), "undecided offset {} is in no open gap: {:?}", o, r.open);
                    }
                }
            }
        }
    }
}
