//! Retention decisions (PROTOCOL §9), with no I/O.
//!
//! [`may_retain`] / [`may_purge`]: evidence goes only after the maximum
//! replay window *and* after every mandatory consumer reading the topic has
//! committed past the event on its partition. Seeing an ACK is never a
//! reason to delete the only evidence. A purge drops the payload bytes and
//! keeps a tombstone (eventId, command key, digests, envelopes, receipts).
//!
//! `outbox_producer::retention::purge` (over PostgreSQL and over the
//! in-memory store) and the simulator call these functions.

use serde::{Deserialize, Serialize};

use crate::state::EventState;
use crate::log::LogRef;

/// Why an event's evidence is kept for now.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "hold")]
pub enum HoldReason {
    /// Only RETAINED events are purged (PUBLISHED ones are retained first).
    NotRetained {
        /// The event's state.
        state: EventState,
    },
    /// Published within the replay window.
    WithinReplayWindow,
    /// A mandatory consumer reading the topic has published no watermark for the partition.
    NoWatermark {
        /// The consumer.
        consumer_id: String,
    },
    /// A mandatory consumer's committed offset has not passed the event.
    WatermarkBehind {
        /// The consumer.
        consumer_id: String,
        /// Its committed offset (the next offset it will read).
        committed_offset: i64,
    },
    /// The event's primary receipt names no topic id (`destination.v1`)
    /// and was accepted in a position epoch above 0: another event's
    /// receipt held its position, so the log it was written to replaced an
    /// earlier one of the same cluster, topic and partition (the topic
    /// deleted and created again, or the cluster replaced), whose offsets
    /// it reuses. A watermark of that partition cannot say which of the
    /// logs it counted (and never moves back, so it may still stand where
    /// the old log left it): no watermark lets the event go. Held until an
    /// operator confirms the consumer processed it (docs/OPERATIONS.md,
    /// *A topic was recreated, or the cluster replaced by an empty one*).
    /// The same holds for every `destination.v1` receipt of a partition
    /// (cluster, topic, partition) that holds a receipt of a position epoch
    /// above 0 ([`LogPosition::partition_replaced`]), whatever its own
    /// epoch: an epoch-0 receipt there may be of the log that was replaced
    /// (a watermark of the new log then says nothing of it), or of the new
    /// log at an offset no old receipt held (the watermark may still stand
    /// where the old log left it).
    ReplacedLog {
        /// The mandatory consumer whose watermark cannot be trusted for it.
        consumer_id: String,
        /// The receipt's position epoch.
        position_epoch: i32,
    },
    /// The log no longer holds the event at its receipt's position (an
    /// open `receipt_position_lost` finding names it: the topic was
    /// recreated, the cluster replaced, the partition removed). Its payload
    /// is the only copy left, and no watermark can have counted it since:
    /// held, whatever the consumers, until an operator re-publishes it or
    /// resolves the finding (docs/OPERATIONS.md, `receipt_position_lost`).
    PositionLost,
    /// The mandatory consumer's watermark of the event's `destination.v1`
    /// log has passed it, but the event the consumer recorded at the
    /// watermark's last offset ([`WatermarkAnchor`]) has no receipt there
    /// in the event's position epoch: the watermark was moved by another
    /// log of the same name (one that replaced the event's, or the one the
    /// event's replaced), or the consumer's last message there was not the
    /// event's receipt's message (a copy). Held until the watermark moves
    /// on to an offset whose anchor agrees.
    WatermarkOfAnotherLog {
        /// The consumer.
        consumer_id: String,
        /// Its committed offset.
        committed_offset: i64,
    },
}

/// What a consumer recorded of the message just below its watermark (the
/// last one it decided there), and what the store's receipts say of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WatermarkAnchor {
    /// Nothing recorded (a watermark moved by a watermark record older
    /// than `outboxWatermark.v4`): the watermark is judged by its log's
    /// name (and log id) alone.
    #[default]
    Unrecorded,
    /// The consumer recorded what it decided at `committed_offset - 1`;
    /// `epoch` is the position epoch of the receipt of that event at that
    /// very position (`None`: the store holds no receipt of it there, or
    /// the message there was no genuine message of an event, or the
    /// watermark stops at a gap's start, whose message an earlier
    /// transaction decided).
    At {
        /// The position epoch of the anchor's receipt at that position.
        epoch: Option<i32>,
        /// When that receipt was accepted, ms: the anchor's message was
        /// written before (`None`: no receipt there, or not known).
        accepted_at_ms: Option<i64>,
    },
}

/// How far apart the clocks that time an attempt's start and a receipt's
/// acceptance may be (ms) for [`WatermarkRef::anchor_agrees_with`] to
/// conclude from their order.
pub const ANCHOR_ORDER_SKEW_MS: i64 = crate::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS;

/// Whether an event published at `published_at_ms` is past the replay
/// window at `now_ms` (PUBLISHED -> RETAINED). Same condition as the SQL:
/// `published_at_ms < now_ms - replay_window_ms`.
pub fn may_retain(published_at_ms: i64, now_ms: i64, replay_window_ms: i64) -> bool {
    published_at_ms < now_ms.saturating_sub(replay_window_ms.max(0))
}

/// A position in a broker's log: the cluster is part of it, since two
/// clusters may carry a topic of the same name with unrelated offsets, and
/// so is the topic's identity, since a topic deleted and created again under
/// the same name starts another log at offset 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPosition<'a> {
    /// The log: cluster, topic, the topic id the message's frozen
    /// destination names (`destination.v2`; `None` for a `destination.v1`)
    /// and partition.
    pub log: LogRef<'a>,
    /// Offset.
    pub offset: i64,
    /// The receipt's position epoch (0: the first receipt at its position;
    /// above 0: accepted at a position another event's receipt held, in a
    /// log that replaced that receipt's log; see
    /// [`crate::compare::next_position_epoch`]).
    pub position_epoch: i32,
    /// Whether a receipt of this partition (cluster, topic, partition) has
    /// a position epoch above 0: the partition's log was replaced at least
    /// once, and a watermark of its name may be of either log.
    pub partition_replaced: bool,
    /// Whether an open `receipt_position_lost` finding says the log no
    /// longer holds the event at this position.
    pub position_lost: bool,
    /// When the message at this position was written at the earliest, ms:
    /// the start of the attempt the receipt names (the message carries that
    /// attempt's id, which did not exist before), or the cut of the stream
    /// batch that registered it (`None`: not known).
    pub sent_from_ms: Option<i64>,
    /// The log id the receipt names: the topic's id as the client that
    /// wrote or read the message saw it just before
    /// ([`crate::BrokerReceipt::log_id`]; `None`: not known).
    pub log_id: Option<&'a str>,
}

impl LogPosition<'_> {
    /// Whether this position is of a log that replaced another one under the
    /// same name (cluster, topic, partition) that watermarks cannot tell
    /// apart, or of the log that was replaced: a `destination.v1` position
    /// (no topic id) of a position epoch above 0, or of a partition that
    /// holds such a receipt. A `destination.v2` position names its topic
    /// id, and a recreated topic's new id starts watermarks of its own.
    pub fn on_replaced_unnamed_log(&self) -> bool {
        self.log.topic_id.is_none() && (self.position_epoch > 0 || self.partition_replaced)
    }
}

/// One consumer's watermark on one partition of one cluster's topic: every
/// message below `committed_offset` has a committed decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatermarkRef<'a> {
    /// The consumer.
    pub consumer_id: &'a str,
    /// The log the consumer read: its topic id is the one the messages it
    /// counted name in their destinations (`None`: `destination.v1`
    /// messages, or ones whose destination did not parse).
    pub log: LogRef<'a>,
    /// The next offset the consumer reads.
    pub committed_offset: i64,
    /// The log the consumer kept it in, as its fetches saw it (the topic's
    /// id; `None`: not known).
    pub log_id: Option<&'a str>,
    /// What it recorded of its last message there.
    pub anchor: WatermarkAnchor,
}

impl WatermarkRef<'_> {
    /// Whether this watermark's anchor agrees with the log of `at`: always
    /// for a `destination.v2` position (its topic id names its log). For a
    /// `destination.v1` position, never when the watermark and the receipt
    /// each name a log id and the two differ (the consumer kept the
    /// watermark in another log than the one the message went to); then
    /// always for an unrecorded anchor; otherwise the anchor's
    /// receipt sits at the watermark's last offset in `at`'s position
    /// epoch (a watermark carried over from a replaced log, or moved by the
    /// log that replaced `at`'s, names an event whose receipt is elsewhere),
    /// and the two can be of one log by time: in one log a message below
    /// the anchor's was written before the anchor's, so before the anchor's
    /// receipt was accepted. An event at a lower offset whose message was
    /// written after that (its receipt's attempt started beyond
    /// [`ANCHOR_ORDER_SKEW_MS`] after it) was written to
    /// another log of the same name: the anchor's log was replaced, with
    /// no receipt yet at a position the old one held to say so.
    pub fn anchor_agrees_with(&self, at: &LogPosition<'_>) -> bool {
        if at.log.topic_id.is_none() && !crate::simulation::mutation_active("receipt-log-id-ignored") {
            if let (Some(kept), Some(written)) = (self.log_id, at.log_id) {
                if kept != written {
                    // The consumer kept this watermark in another log than
                    // the one the receipt's message went to.
                    return false;
                }
            }
        }
        match self.anchor {
            _ if at.log.topic_id.is_some() => true,
            WatermarkAnchor::Unrecorded => true,
            WatermarkAnchor::At { epoch, accepted_at_ms } => {
                let written_later = match (at.sent_from_ms, accepted_at_ms) {
                    (Some(sent), Some(accepted)) => at.offset < self.committed_offset - 1 && sent > accepted.saturating_add(ANCHOR_ORDER_SKEW_MS),
                    _ => false,
                };
                epoch == Some(at.position_epoch) && !written_later
            }
        }
    }

    /// Whether this watermark is of `consumer_id` on the log of `at`: same
    /// cluster, topic, topic id (exactly: `None` matches only `None`) and
    /// partition.
    pub fn covers_log_of(&self, consumer_id: &str, at: &LogPosition<'_>) -> bool {
        let same_log = if crate::simulation::mutation_active("watermark-ignores-cluster") {
            LogRef { cluster_id: at.log.cluster_id, ..self.log } == at.log
        } else {
            self.log == at.log
        };
        self.consumer_id == consumer_id && same_log
    }
}

/// Whether a RETAINED event may be purged (RETAINED -> PURGED).
///
/// `placement` is the primary receipt's log position; `mandatory_watermarks`
/// holds the watermarks of mandatory consumers (the committed offset is the
/// next offset the consumer reads, so it has passed `offset` when
/// `committed_offset > offset`); `mandatory_consumers_on_topic` lists every
/// mandatory consumer reading the event's topic. A mandatory consumer
/// without a watermark on that very log (same cluster, topic, topic id and
/// partition) holds the event: a watermark on another cluster's topic of
/// the same name, or on another incarnation of the topic (another topic id),
/// says nothing about this one. Nor does any watermark about a
/// `destination.v1` receipt of a replaced log, or of a partition whose log
/// was replaced ([`LogPosition::on_replaced_unnamed_log`]): a mandatory
/// consumer on the topic holds it with [`HoldReason::ReplacedLog`]. An
/// event whose position the log lost is held whatever the consumers
/// ([`HoldReason::PositionLost`]).
pub fn may_purge(
    state: EventState,
    published_at_ms: i64,
    now_ms: i64,
    replay_window_ms: i64,
    placement: LogPosition<'_>,
    mandatory_watermarks: &[WatermarkRef<'_>],
    mandatory_consumers_on_topic: &[&str],
) -> Result<(), HoldReason> {
    if state != EventState::Retained {
        return Err(HoldReason::NotRetained { state });
    }
    if !may_retain(published_at_ms, now_ms, replay_window_ms) {
        return Err(HoldReason::WithinReplayWindow);
    }
    if placement.position_lost {
        return Err(HoldReason::PositionLost);
    }
    let consumers = if crate::simulation::mutation_active("purge-ignores-watermarks") { &[][..] } else { mandatory_consumers_on_topic };
    for &consumer in consumers {
        if placement.on_replaced_unnamed_log() {
            return Err(HoldReason::ReplacedLog { consumer_id: consumer.to_owned(), position_epoch: placement.position_epoch });
        }
        let Some(w) = mandatory_watermarks.iter().find(|w| w.covers_log_of(consumer, &placement)) else {
            return Err(HoldReason::NoWatermark { consumer_id: consumer.to_owned() });
        };
        let committed_offset = w.committed_offset;
        if committed_offset <= placement.offset {
            return Err(HoldReason::WatermarkBehind { consumer_id: consumer.to_owned(), committed_offset });
        }
        if !w.anchor_agrees_with(&placement) {
            return Err(HoldReason::WatermarkOfAnotherLog { consumer_id: consumer.to_owned(), committed_offset });
        }
    }
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retain_only_past_the_window() {
        assert!(may_retain(0, 1_001, 1_000));
        assert!(!may_retain(0, 1_000, 1_000));
        assert!(!may_retain(500, 1_000, 1_000));
        assert!(may_retain(999, 1_000, 0));
        assert!(!may_retain(1_000, 1_000, 0));
    }

    const W: i64 = 1_000;

    /// Watermarks as `(consumer, topic, partition, committed)` on cluster `k-a`,
    /// the event's cluster.
    fn purge(state: EventState, published: i64, wms: &[(&str, &str, i32, i64)], mandatory: &[&str]) -> Result<(), HoldReason> {
        let wms: Vec<WatermarkRef<'_>> = wms
            .iter()
            .map(|&(consumer_id, topic, partition, committed_offset)| WatermarkRef { consumer_id, log: crate::LogRef { cluster_id: "k-a", topic, topic_id: None, partition }, committed_offset, anchor: WatermarkAnchor::Unrecorded, log_id: None })
            .collect();
        may_purge(state, published, 10_000, W, LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, offset: 7, position_epoch: 0, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None }, &wms, mandatory)
    }

    #[test]
    fn a_watermark_on_another_cluster_holds_nothing_up() {
        let at = LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, offset: 7, position_epoch: 0, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None };
        let far_on_b = [WatermarkRef { consumer_id: "c1", log: crate::LogRef { cluster_id: "k-b", topic: "orders", topic_id: None, partition: 2 }, committed_offset: 1_000, anchor: WatermarkAnchor::Unrecorded, log_id: None }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &far_on_b, &["c1"]), Err(HoldReason::NoWatermark { consumer_id: "c1".into() }));
        let past_on_a = [WatermarkRef { log: crate::LogRef { cluster_id: "k-a", ..far_on_b[0].log }, ..far_on_b[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &past_on_a, &["c1"]), Ok(()));
    }

    /// A topic deleted and created again under the same name: the consumer
    /// is far along the new log (another topic id), which says nothing about
    /// a receipt of the old one, whatever the offsets say; only a watermark
    /// of the receipt's own topic id (or, for a `destination.v1` receipt,
    /// one without an id) lets it go.
    #[test]
    fn a_watermark_of_another_topic_id_holds_nothing_up() {
        const OLD: &str = "AAECAwQFBgcICQoLDA0ODw";
        const NEW: &str = "_____________________w";
        let at = LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: Some(OLD), partition: 2 }, offset: 7, position_epoch: 0, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None };
        let on_new = [WatermarkRef { consumer_id: "c1", log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: Some(NEW), partition: 2 }, committed_offset: 1_000, anchor: WatermarkAnchor::Unrecorded, log_id: None }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &on_new, &["c1"]), Err(HoldReason::NoWatermark { consumer_id: "c1".into() }));
        let without_id = [WatermarkRef { log: crate::LogRef { topic_id: None, ..on_new[0].log }, ..on_new[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &without_id, &["c1"]), Err(HoldReason::NoWatermark { consumer_id: "c1".into() }));
        let on_old = [WatermarkRef { log: crate::LogRef { topic_id: Some(OLD), ..on_new[0].log }, ..on_new[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &on_old, &["c1"]), Ok(()));
        // A destination.v1 receipt is passed by a watermark without an id only.
        let v1 = LogPosition { log: crate::LogRef { topic_id: None, ..at.log }, ..at };
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v1, &on_old, &["c1"]), Err(HoldReason::NoWatermark { consumer_id: "c1".into() }));
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v1, &without_id, &["c1"]), Ok(()));
    }

    /// Issue 46: a `destination.v1` receipt accepted one position epoch
    /// above another event's receipt at its position is of a log that
    /// replaced that one under the same cluster, topic and partition; a
    /// watermark of the partition, however far, does not let it go while a
    /// mandatory consumer reads the topic. Epoch 0, and a `destination.v2`
    /// receipt of any epoch (its topic id tells the logs apart), are judged
    /// by the watermark as before.
    #[test]
    fn a_v1_receipt_of_a_replaced_log_is_held_whatever_the_watermark() {
        const ID: &str = "AAECAwQFBgcICQoLDA0ODw";
        let at = LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, offset: 7, position_epoch: 1, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None };
        let past = [WatermarkRef { consumer_id: "c1", log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, committed_offset: i64::MAX, anchor: WatermarkAnchor::Unrecorded, log_id: None }];
        let held = Err(HoldReason::ReplacedLog { consumer_id: "c1".into(), position_epoch: 1 });
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &past, &["c1"]), held);
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &[], &["c1"]), held);
        let epoch3 = LogPosition { position_epoch: 3, ..at };
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, epoch3, &past, &["c1"]), Err(HoldReason::ReplacedLog { consumer_id: "c1".into(), position_epoch: 3 }));
        // No mandatory consumer on the topic: nothing to wait for.
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &past, &[]), Ok(()));
        // The window and the state come first.
        assert_eq!(may_purge(EventState::Retained, 9_500, 10_000, W, at, &past, &["c1"]), Err(HoldReason::WithinReplayWindow));
        // Epoch 0: as before.
        let epoch0 = LogPosition { position_epoch: 0, ..at };
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, epoch0, &past, &["c1"]), Ok(()));
        // destination.v2, any epoch: its own topic id's watermark decides.
        let v2 = LogPosition { log: crate::LogRef { topic_id: Some(ID), ..at.log }, ..at };
        let on_id = [WatermarkRef { log: crate::LogRef { topic_id: Some(ID), ..past[0].log }, committed_offset: 8, ..past[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v2, &on_id, &["c1"]), Ok(()));
        let behind = [WatermarkRef { committed_offset: 7, ..on_id[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v2, &behind, &["c1"]), Err(HoldReason::WatermarkBehind { consumer_id: "c1".into(), committed_offset: 7 }));
        assert!(at.on_replaced_unnamed_log() && !epoch0.on_replaced_unnamed_log() && !v2.on_replaced_unnamed_log());
    }

    /// Issue 46: once a partition's log was replaced (a receipt of it has a
    /// position epoch above 0), no watermark of its name lets any of its
    /// `destination.v1` receipts go, epoch 0 included: one of the log that
    /// was replaced, which the consumer never read before it went, would
    /// otherwise be purged on the new log's watermark. A `destination.v2`
    /// receipt there is judged by its own topic id's watermark.
    #[test]
    fn every_v1_receipt_of_a_replaced_partition_is_held_whatever_its_epoch() {
        const ID: &str = "AAECAwQFBgcICQoLDA0ODw";
        let at = LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, offset: 0, position_epoch: 0, partition_replaced: true, position_lost: false, sent_from_ms: None, log_id: None };
        let new_log = [WatermarkRef { consumer_id: "c1", log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, committed_offset: 1, anchor: WatermarkAnchor::Unrecorded, log_id: None }];
        assert!(at.on_replaced_unnamed_log());
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &new_log, &["c1"]), Err(HoldReason::ReplacedLog { consumer_id: "c1".into(), position_epoch: 0 }));
        let unreplaced = LogPosition { partition_replaced: false, ..at };
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, unreplaced, &new_log, &["c1"]), Ok(()));
        let v2 = LogPosition { log: crate::LogRef { topic_id: Some(ID), ..at.log }, ..at };
        let on_id = [WatermarkRef { log: crate::LogRef { topic_id: Some(ID), ..new_log[0].log }, ..new_log[0] }];
        assert!(!v2.on_replaced_unnamed_log());
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v2, &on_id, &["c1"]), Ok(()));
    }

    /// Issue 46: a `destination.v1` watermark is another log's when the
    /// event its consumer recorded at its last offset has no receipt there
    /// in the event's position epoch (a watermark carried over from a
    /// replaced log, or moved by the log that replaced the event's): it
    /// lets nothing go, and `unconsumed_published` holds. Unrecorded, it
    /// is judged by its name as before; a `destination.v2` event's own
    /// topic id decides.
    #[test]
    fn a_v1_watermark_anchored_in_another_log_lets_nothing_go() {
        const ID: &str = "AAECAwQFBgcICQoLDA0ODw";
        let at = LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, offset: 0, position_epoch: 0, partition_replaced: false, position_lost: false, sent_from_ms: None, log_id: None };
        let w = |anchor| [WatermarkRef { consumer_id: "c1", log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, committed_offset: 1, anchor, log_id: None }];
        let purge = |at: LogPosition<'_>, anchor| may_purge(EventState::Retained, 0, 10_000, W, at, &w(anchor), &["c1"]);
        let other = Err(HoldReason::WatermarkOfAnotherLog { consumer_id: "c1".into(), committed_offset: 1 });
        assert_eq!(purge(at, WatermarkAnchor::Unrecorded), Ok(()));
        assert_eq!(purge(at, WatermarkAnchor::At { epoch: Some(0), accepted_at_ms: None }), Ok(()));
        assert_eq!(purge(at, WatermarkAnchor::At { epoch: Some(1), accepted_at_ms: None }), other);
        assert_eq!(purge(at, WatermarkAnchor::At { epoch: None, accepted_at_ms: None }), other);
        let v2 = LogPosition { log: crate::LogRef { topic_id: Some(ID), ..at.log }, ..at };
        let on_id = [WatermarkRef { log: crate::LogRef { topic_id: Some(ID), ..w(WatermarkAnchor::At { epoch: None, accepted_at_ms: None })[0].log }, ..w(WatermarkAnchor::At { epoch: None, accepted_at_ms: None })[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v2, &on_id, &["c1"]), Ok(()));
        let topics = ["orders".to_owned()];
        let unconsumed = |anchor| crate::findings::unconsumed_published(EventState::Published, 0, 10_000, 1_000, &at, "c1", &topics, &w(anchor));
        assert_eq!(unconsumed(WatermarkAnchor::At { epoch: None, accepted_at_ms: None }), Some(10_000));
        assert_eq!(unconsumed(WatermarkAnchor::At { epoch: Some(0), accepted_at_ms: None }), None);
        assert_eq!(unconsumed(WatermarkAnchor::Unrecorded), None);
    }

    /// Issue 46, the residual of an undetected replacement: the old log
    /// wrote event A twice (@0 and @1; its receipt is @1, accepted at
    /// 1,000) and the consumer's watermark stands at 2 anchored on it. The
    /// cluster is replaced; the new log's first event lands at @0 (no
    /// receipt collides, so epoch 0, and no receipt says the log changed).
    /// Its receipt's attempt started at 5,000, after A's receipt: in one log it
    /// would lie above A, so the watermark is of another log and the event
    /// is held, and unconsumed. One that started before A's receipt (or
    /// within the clocks' allowance, or at A's own offset) may be of A's
    /// log, and the watermark counts as before.
    #[test]
    fn a_v1_watermark_anchored_before_the_events_first_send_lets_nothing_below_it_go() {
        let anchored = |accepted_at_ms| [WatermarkRef {
            consumer_id: "c1",
            log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 },
            committed_offset: 2,
            anchor: WatermarkAnchor::At { epoch: Some(0), accepted_at_ms },
            log_id: None,
        }];
        let at = |offset, sent_from_ms| LogPosition {
            log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 },
            offset,
            position_epoch: 0,
            partition_replaced: false,
            position_lost: false,
            sent_from_ms,
            log_id: None,
        };
        let purge = |at: LogPosition<'_>, accepted| may_purge(EventState::Retained, 0, 10_000, W, at, &anchored(accepted), &["c1"]);
        let other = Err(HoldReason::WatermarkOfAnotherLog { consumer_id: "c1".into(), committed_offset: 2 });
        assert_eq!(purge(at(0, Some(5_000)), Some(1_000)), other, "sent after the anchor was accepted, below it: another log");
        assert_eq!(purge(at(0, Some(500)), Some(1_000)), Ok(()), "sent before: one log");
        assert_eq!(purge(at(0, Some(1_000 + ANCHOR_ORDER_SKEW_MS)), Some(1_000)), Ok(()), "within the clocks' allowance");
        assert_eq!(purge(at(1, Some(5_000)), Some(1_000)), Ok(()), "the anchor's own offset");
        assert_eq!(purge(at(0, None), Some(1_000)), Ok(()), "no attempt known");
        assert_eq!(purge(at(0, Some(5_000)), None), Ok(()), "no acceptance time known");
        let v2 = LogPosition { log: crate::LogRef { topic_id: Some("AAECAwQFBgcICQoLDA0ODw"), ..at(0, Some(5_000)).log }, ..at(0, Some(5_000)) };
        let on_id = [WatermarkRef { log: v2.log, ..anchored(Some(1_000))[0] }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, v2, &on_id, &["c1"]), Ok(()), "a topic id decides");
        let topics = ["orders".to_owned()];
        let p = at(0, Some(5_000));
        assert_eq!(crate::findings::unconsumed_published(EventState::Published, 0, 10_000, 1_000, &p, "c1", &topics, &anchored(Some(1_000))), Some(10_000));
        assert_eq!(crate::findings::unconsumed_published(EventState::Published, 0, 10_000, 1_000, &at(0, Some(500)), "c1", &topics, &anchored(Some(1_000))), None);
    }

    /// Issue 46: an event whose position the log lost keeps its payload,
    /// whatever the watermarks say and with no mandatory consumer at all:
    /// it is the only copy left for the operator to publish again.
    #[test]
    fn an_event_whose_position_was_lost_is_held_whatever_the_consumers() {
        let at = LogPosition { log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, offset: 0, position_epoch: 0, partition_replaced: false, position_lost: true, sent_from_ms: None, log_id: None };
        let past = [WatermarkRef { consumer_id: "c1", log: crate::LogRef { cluster_id: "k-a", topic: "orders", topic_id: None, partition: 2 }, committed_offset: i64::MAX, anchor: WatermarkAnchor::Unrecorded, log_id: None }];
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &past, &["c1"]), Err(HoldReason::PositionLost));
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, at, &[], &[]), Err(HoldReason::PositionLost));
        // The window and the state come first.
        assert_eq!(may_purge(EventState::Retained, 9_500, 10_000, W, at, &past, &["c1"]), Err(HoldReason::WithinReplayWindow));
        let kept = LogPosition { position_lost: false, ..at };
        assert_eq!(may_purge(EventState::Retained, 0, 10_000, W, kept, &past, &["c1"]), Ok(()));
    }

    #[test]
    fn purge_needs_retained() {
        for s in [EventState::Published, EventState::Pending, EventState::Purged, EventState::DispatchUnknown] {
            assert_eq!(purge(s, 0, &[], &[]), Err(HoldReason::NotRetained { state: s }));
        }
    }

    #[test]
    fn purge_needs_the_replay_window() {
        assert_eq!(purge(EventState::Retained, 9_500, &[], &[]), Err(HoldReason::WithinReplayWindow));
        assert_eq!(purge(EventState::Retained, 9_000, &[], &[]), Err(HoldReason::WithinReplayWindow));
        assert_eq!(purge(EventState::Retained, 8_999, &[], &[]), Ok(()));
    }

    #[test]
    fn mandatory_consumer_without_watermark_holds() {
        assert_eq!(purge(EventState::Retained, 0, &[], &["c1"]), Err(HoldReason::NoWatermark { consumer_id: "c1".into() }));
        // A watermark of another partition, topic or consumer is no watermark.
        let wms = [("c1", "orders", 3, 100), ("c1", "other", 2, 100), ("c2", "orders", 2, 100)];
        assert_eq!(purge(EventState::Retained, 0, &wms, &["c1"]), Err(HoldReason::NoWatermark { consumer_id: "c1".into() }));
    }

    #[test]
    fn watermark_must_pass_the_offset() {
        let at = [("c1", "orders", 2, 7)];
        assert_eq!(purge(EventState::Retained, 0, &at, &["c1"]), Err(HoldReason::WatermarkBehind { consumer_id: "c1".into(), committed_offset: 7 }));
        let past = [("c1", "orders", 2, 8)];
        assert_eq!(purge(EventState::Retained, 0, &past, &["c1"]), Ok(()));
    }

    #[test]
    fn every_mandatory_consumer_must_have_passed() {
        let wms = [("c1", "orders", 2, 50), ("c2", "orders", 2, 3)];
        assert_eq!(purge(EventState::Retained, 0, &wms, &["c1", "c2"]), Err(HoldReason::WatermarkBehind { consumer_id: "c2".into(), committed_offset: 3 }));
        // A consumer that is not mandatory on the topic does not hold.
        assert_eq!(purge(EventState::Retained, 0, &wms, &["c1"]), Ok(()));
        assert_eq!(purge(EventState::Retained, 0, &wms, &[]), Ok(()));
    }
}
