//! Retention (PROTOCOL §9): a purge waits for every mandatory consumer's
//! watermark on the event's very log.

use outbox_core::id::EventId;
use outbox_core::receipt::{BrokerReceipt, ReceiptDecision};
use outbox_core::state::EventState;

use super::ctx::{ensure, eq, receipt, Ctx};
use super::{Harness, PurgeCounts, Verdict};
use crate::MemoryWatermark;

/// Retention's purge decision (`may_purge`, `WatermarkRef::covers_log_of`)
/// on both stores, events published on several partitions of one log:
/// nothing goes inside the replay window; past it, a mandatory consumer
/// without a watermark holds everything, and so does one whose watermark
/// has not passed an event's offset, or whose watermarks are on another
/// cluster's topic of the same name or on another topic id; once its
/// watermark on the very log has passed an event, the event is PURGED (a
/// tombstone: the row and its receipt stay, the payload goes). A consumer
/// that is not mandatory, or reads another topic, holds nothing.
pub(super) async fn purge_waits_for_mandatory_watermarks<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    const W: i64 = 60_000;
    // Whatever earlier scenarios published goes first, so the counts below
    // are this scenario's; but for the events whose position the log lost
    // (earlier runs' on this store), held in every pass.
    c.h.advance_ms(W + 1);
    let lost_before = c.h.purge(W, &[], &[]).await?.lost_position;
    let counts = |retained, purged, held| PurgeCounts { retained, purged, held, replaced_log: 0, lost_position: lost_before };
    let mut events: Vec<(EventId, BrokerReceipt, Vec<u8>)> = Vec::new();
    for n in 0..64u32 {
        let id = c.emit(n, &format!("p{n}")).await;
        let ce = c.claim_some("w1", &id).await?;
        let a = c.register(&ce.token).await?;
        let r = receipt(&ce, &a, c.offset(i64::from(n)));
        eq("publish", c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
        events.push((id, r, ce.payload.clone()));
        let mut partitions: Vec<i32> = events.iter().map(|e| e.1.partition).collect();
        partitions.sort_unstable();
        partitions.dedup();
        if events.len() >= 6 && partitions.len() >= 2 {
            break;
        }
    }
    let first = &events[0].1;
    let (cluster, topic, topic_id, p_a) = (first.cluster_id.clone(), first.topic.clone(), first.topic_id.clone(), first.partition);
    ensure(events.iter().all(|e| (&e.1.cluster_id, &e.1.topic, &e.1.topic_id) == (&cluster, &topic, &topic_id)), || "the events are not on one log".into())?;
    ensure(events.iter().any(|e| e.1.partition != p_a), || "the events are on one partition".into())?;
    let n = events.len() as u64;
    let mut partitions: Vec<i32> = events.iter().map(|e| e.1.partition).collect();
    partitions.sort_unstable();
    partitions.dedup();
    let last_on = |p: i32| events.iter().filter(|e| e.1.partition == p).map(|e| e.1.offset).max().unwrap_or(0);
    let wm = |cluster_id: &str, topic_id: Option<&str>, partition: i32, committed_offset: i64| MemoryWatermark {
        log: outbox_core::LogId { cluster_id: cluster_id.into(), topic: topic.clone(), topic_id: topic_id.map(Into::into), partition },
        consumer_id: format!("{}-m", c.prefix),
        committed_offset,
        anchor_recorded: false,
        anchor_event_id: None,
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: None,
    };
    let (m, o, x, other_topic) = (format!("{}-m", c.prefix), format!("{}-o", c.prefix), format!("{}-x", c.prefix), format!("{}-other", c.prefix));
    let (on_topic, on_other): (&[&str], &[&str]) = (&[topic.as_str()], &[other_topic.as_str()]);
    let mandatory = [(m.as_str(), on_topic, true)];
    let check = |stage: &'static str, held: Vec<bool>| {
        let events = &events;
        async move {
            for ((id, r, payload), held) in events.iter().zip(held) {
                let (state, slot) = c.state(id).await?;
                let want = if held { EventState::Retained } else { EventState::Purged };
                eq(&format!("{stage}: {id} on partition {} at {}", r.partition, r.offset), state, want)?;
                eq(&format!("{stage}: {id}'s receipt"), slot.as_ref(), Some(r))?;
                let want = if held { Some(payload.clone()) } else { None };
                eq(&format!("{stage}: {id}'s payload"), c.h.payload(id).await, want)?;
            }
            Ok::<_, String>(())
        }
    };

    eq("inside the replay window", c.h.purge(W, &mandatory, &[]).await?, counts(0, 0, 0))?;
    for (id, _, _) in &events {
        c.expect_state(id, EventState::Published).await?;
    }
    c.h.advance_ms(W + 1);
    eq("no watermark", c.h.purge(W, &mandatory, &[]).await?, counts(n, 0, n))?;
    check("no watermark", vec![true; events.len()]).await?;

    // Far along every partition of another cluster's topic of the same
    // name, and of another topic id on this cluster; on this very log, at
    // the first event's offset (not past it) on its partition only.
    let other_id = if topic_id.as_deref() == Some("AAECAwQFBgcICQoLDA0ODw") { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let tid = topic_id.as_deref();
    let other_cluster = format!("{cluster}-b");
    let elsewhere: Vec<MemoryWatermark> = partitions.iter().flat_map(|&p| [wm(&other_cluster, tid, p, i64::MAX), wm(&cluster, Some(other_id), p, i64::MAX)]).collect();
    let here = |committed: &dyn Fn(i32) -> i64| elsewhere.iter().cloned().chain(partitions.iter().map(|&p| wm(&cluster, tid, p, committed(p)))).collect::<Vec<_>>();
    let mut behind = elsewhere.clone();
    behind.push(wm(&cluster, tid, p_a, events[0].1.offset));
    eq("watermarks not past, or of other logs", c.h.purge(W, &mandatory, &behind).await?, counts(0, 0, n))?;
    check("watermarks not past, or of other logs", vec![true; events.len()]).await?;

    // Past every event of the first partition; on each other partition at
    // its last event's offset: that one is held, the ones before it go.
    // A consumer that is not mandatory, without watermarks, and a mandatory
    // one of another topic hold nothing.
    let partly = here(&|p| if p == p_a { last_on(p) + 1 } else { last_on(p) });
    let held: Vec<bool> = events.iter().map(|e| e.1.partition != p_a && e.1.offset == last_on(e.1.partition)).collect();
    let still = held.iter().filter(|h| **h).count() as u64;
    let registry = [(m.as_str(), on_topic, true), (o.as_str(), on_topic, false), (x.as_str(), on_other, true)];
    eq("partly passed", c.h.purge(W, &registry, &partly).await?, counts(0, n - still, still))?;
    check("partly passed", held).await?;

    let passed = here(&|p| last_on(p) + 1);
    eq("all passed", c.h.purge(W, &registry, &passed).await?, counts(0, still, 0))?;
    check("all passed", vec![false; events.len()]).await?;
    eq("nothing left", c.h.purge(W, &registry, &passed).await?, counts(0, 0, 0))
}

/// A log replaced under a `destination.v1` receipt (issue 46) on both
/// stores: a topic without a recorded id deleted and created again (or the
/// cluster replaced) restarts each partition at offset 0, and a receipt of
/// the new log at a position an old receipt holds is accepted one position
/// epoch above it. A consumer's watermark of "(cluster, topic, partition)"
/// cannot say which log it counted (it never moves back, so after the
/// replacement it still stands where the old log left it): it holds the
/// epoch-1 event however far it is (`HoldReason::ReplacedLog`), and the
/// events of epoch 0 on that partition too: one of the old log the
/// consumer may never have read before the log went (a watermark of the
/// new log would let it go), one of the new log at an offset no old
/// receipt held may be below a watermark the old log left. The first
/// event's position, now the second's, is lost (`receipt_position_lost`,
/// which the receipt transaction records): it is held whatever the
/// consumers (`HoldReason::PositionLost`), its payload the only copy left.
/// A consumer that is not mandatory holds nothing else.
pub(super) async fn purge_holds_an_event_of_a_replaced_log<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    const W: i64 = 60_000;
    // Whatever earlier scenarios published goes first, so the counts below
    // are this scenario's; but for the events whose position the log lost
    // (earlier scenarios' and runs'), held in every pass.
    c.h.advance_ms(W + 1);
    let lost_before = c.h.purge(W, &[], &[]).await?.lost_position;
    let counts = |retained, purged, held, replaced_log, lost: u64| PurgeCounts { retained, purged, held, replaced_log, lost_position: lost_before + lost };
    // One key, so one partition: the first event at offset 0 of the old
    // log, the second at offset 0 of the new one (the same position), the
    // third at offset 1.
    let mut events: Vec<(EventId, BrokerReceipt)> = Vec::new();
    for (n, at) in [(0u32, 0i64), (1, 0), (2, 1)] {
        let id = c.emit_on_replaced_topic(n, "replaced").await?;
        let ce = c.claim_some("w1", &id).await?;
        let a = c.register(&ce.token).await?;
        let r = receipt(&ce, &a, c.offset(at));
        eq(&format!("publish {n} at offset {at}"), c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
        events.push((id, r));
    }
    let first = &events[0].1;
    eq("the route's topic id", first.topic_id.as_deref(), None)?;
    ensure(events.iter().all(|e| e.1.partition == first.partition), || "the events are not on one partition".into())?;
    let (m, o, topic) = (format!("{}-m", c.prefix), format!("{}-o", c.prefix), first.topic.clone());
    eq("the scenario's topic", topic.as_str(), super::REPLACED_TOPIC)?;
    let on_topic: &[&str] = &[topic.as_str()];
    let wm = |consumer_id: &str, committed_offset: i64| MemoryWatermark {
        log: outbox_core::LogId { cluster_id: first.cluster_id.clone(), topic: topic.clone(), topic_id: None, partition: first.partition },
        consumer_id: consumer_id.into(),
        committed_offset,
        anchor_recorded: false,
        anchor_event_id: None,
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: None,
    };
    let check = |stage: &'static str, want: [EventState; 3]| {
        let events = &events;
        async move {
            for ((id, r), want) in events.iter().zip(want) {
                eq(&format!("{stage}: {id} at {}", r.offset), c.state(id).await?.0, want)?;
            }
            Ok::<_, String>(())
        }
    };
    c.h.advance_ms(W + 1);
    // Past every offset of the partition: every event of it is held.
    let past = [wm(&m, c.offset(2)), wm(&o, c.offset(2))];
    let registry = [(m.as_str(), on_topic, true), (o.as_str(), on_topic, false)];
    eq("a watermark past the replaced log's positions", c.h.purge(W, &registry, &past).await?, counts(3, 0, 2, 2, 1))?;
    check("a watermark past the replaced log's positions", [EventState::Retained, EventState::Retained, EventState::Retained]).await?;
    let far = [wm(&m, i64::MAX)];
    eq("a watermark far past", c.h.purge(W, &registry, &far).await?, counts(0, 0, 2, 2, 1))?;
    check("a watermark far past", [EventState::Retained, EventState::Retained, EventState::Retained]).await?;
    // Without a mandatory consumer on the topic only the lost one is held.
    eq("no mandatory consumer", c.h.purge(W, &[(o.as_str(), on_topic, false)], &[]).await?, counts(0, 2, 0, 0, 1))?;
    check("no mandatory consumer", [EventState::Retained, EventState::Purged, EventState::Purged]).await
}

/// Issue 46: a `destination.v1` watermark names the event its consumer
/// decided at its last offset (its anchor); retention, on both stores,
/// lets an event go on it only when that event's receipt sits at that
/// offset in the event's position epoch. A watermark whose anchor has no
/// receipt there was moved by another log of the same name (one that
/// replaced this one before any receipt said so, or a watermark carried
/// over from the one this replaced): it holds everything
/// (`HoldReason::WatermarkOfAnotherLog`), as does one whose consumer
/// recorded no event there (another message, or a gap's start). A
/// watermark whose consumer records no anchor (one read from the watermark
/// topic) is judged by its name (the other scenarios' watermarks).
pub(super) async fn purge_checks_a_watermarks_anchor<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    const W: i64 = 60_000;
    c.h.advance_ms(W + 1);
    let lost_before = c.h.purge(W, &[], &[]).await?.lost_position;
    let counts = |retained, purged, held| PurgeCounts { retained, purged, held, replaced_log: 0, lost_position: lost_before };
    let mut events: Vec<(EventId, BrokerReceipt)> = Vec::new();
    for n in 0..2u32 {
        let id = c.emit(n, "anchored").await;
        let ce = c.claim_some("w1", &id).await?;
        let a = c.register(&ce.token).await?;
        let r = receipt(&ce, &a, c.offset(n as i64));
        eq(&format!("publish {n}"), c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
        events.push((id, r));
    }
    let last = &events[1].1;
    eq("the route's topic id", last.topic_id.as_deref(), None)?;
    ensure(events[0].1.partition == last.partition, || "the events are not on one partition".into())?;
    let m = format!("{}-m", c.prefix);
    let on_topic: &[&str] = &[last.topic.as_str()];
    let registry = [(m.as_str(), on_topic, true)];
    let wm = |anchor: Option<&str>| MemoryWatermark {
        log: outbox_core::LogId { cluster_id: last.cluster_id.clone(), topic: last.topic.clone(), topic_id: None, partition: last.partition },
        consumer_id: m.clone(),
        committed_offset: c.offset(2),
        anchor_recorded: true,
        anchor_event_id: anchor.map(str::to_owned),
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: None,
    };
    c.h.advance_ms(W + 1);
    let stranger = EventId::generate(c.h.now_ms() as u64).to_string();
    eq("an anchor with no receipt at the last offset", c.h.purge(W, &registry, &[wm(Some(&stranger))]).await?, counts(2, 0, 2))?;
    eq("an anchor whose receipt is at another offset", c.h.purge(W, &registry, &[wm(Some(events[0].0.as_str()))]).await?, counts(0, 0, 2))?;
    eq("no event recorded at the last offset", c.h.purge(W, &registry, &[wm(None)]).await?, counts(0, 0, 2))?;
    for (id, _) in &events {
        eq(&format!("{id} held"), c.state(id).await?.0, EventState::Retained)?;
    }
    eq("the anchor's receipt at the last offset", c.h.purge(W, &registry, &[wm(Some(events[1].0.as_str()))]).await?, counts(0, 2, 0))?;
    for (id, _) in &events {
        eq(&format!("{id} purged"), c.state(id).await?.0, EventState::Purged)?;
    }
    Ok(())
}

/// Issue 46, an undetected replacement: the event at offset 1 is published
/// first and the consumer's watermark (2) is anchored on it; 10 s later
/// another event's first attempt starts and its receipt lands at offset 0,
/// with no receipt there before (no position collision, so no epoch to say
/// the log changed). In one log a message below the anchor's was written
/// before the anchor's receipt was accepted, so this one was written to
/// another log of the partition's name: it is held (the watermark is of
/// another log), and the anchor's own event goes. Within the clocks'
/// allowance the order proves nothing, and both would go.
pub(super) async fn purge_holds_an_event_first_sent_after_the_watermarks_anchor_below_it<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    const W: i64 = 60_000;
    c.h.advance_ms(W + 1);
    let lost_before = c.h.purge(W, &[], &[]).await?.lost_position;
    let anchor = c.emit(0, "late").await;
    let ce = c.claim_some("w1", &anchor).await?;
    let a = c.register(&ce.token).await?;
    let anchor_receipt = receipt(&ce, &a, c.offset(1));
    eq("publish the anchor", c.accept(&anchor_receipt).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.h.advance_ms(10_000);
    let late = c.emit(1, "late").await;
    let ce = c.claim_some("w1", &late).await?;
    let a = c.register(&ce.token).await?;
    let late_receipt = receipt(&ce, &a, c.offset(0));
    eq("publish the late event below it", c.accept(&late_receipt).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    eq("one partition", (late_receipt.partition, late_receipt.topic_id.as_deref()), (anchor_receipt.partition, None))?;
    let m = format!("{}-m", c.prefix);
    let on_topic: &[&str] = &[anchor_receipt.topic.as_str()];
    let registry = [(m.as_str(), on_topic, true)];
    let wm = MemoryWatermark {
        log: outbox_core::LogId { cluster_id: anchor_receipt.cluster_id.clone(), topic: anchor_receipt.topic.clone(), topic_id: None, partition: anchor_receipt.partition },
        consumer_id: m.clone(),
        committed_offset: c.offset(2),
        anchor_recorded: true,
        anchor_event_id: Some(anchor.to_string()),
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: None,
    };
    c.h.advance_ms(W + 1);
    let out = c.h.purge(W, &registry, &[wm]).await?;
    eq("the anchor's event goes, the late one is held", out, PurgeCounts { retained: 2, purged: 1, held: 1, replaced_log: 0, lost_position: lost_before })?;
    eq("the late event", c.state(&late).await?.0, EventState::Retained)?;
    eq("the anchor", c.state(&anchor).await?.0, EventState::Purged)?;
    Ok(())
}

/// A `destination.v1` receipt names the log its message was written to
/// (`BrokerReceipt::log_id`: the topic's id as the dispatcher's client knew
/// it), and a consumer's watermark the log it was kept in. An event written
/// to a partition's log before it was replaced, never read, sits below a
/// watermark the consumer kept in the new log, whose anchor's receipt
/// agrees with it by position epoch and by time (no receipt collided, and
/// the event was written first): the log ids alone tell the two logs
/// apart, and it is held; the anchor's own event, of the watermark's log,
/// goes.
pub(super) async fn purge_holds_an_event_whose_receipt_names_another_log<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    const W: i64 = 60_000;
    c.h.advance_ms(W + 1);
    let lost_before = c.h.purge(W, &[], &[]).await?.lost_position;
    let old = c.emit(0, "logid").await;
    let ce = c.claim_some("w1", &old).await?;
    let a = c.register(&ce.token).await?;
    let old_receipt = BrokerReceipt { log_id: Some("topic-id-old".into()), ..receipt(&ce, &a, c.offset(0)) };
    eq("publish the old log's event", c.accept(&old_receipt).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.h.advance_ms(10_000);
    let anchor = c.emit(1, "logid").await;
    let ce = c.claim_some("w1", &anchor).await?;
    let a = c.register(&ce.token).await?;
    let anchor_receipt = BrokerReceipt { log_id: Some("topic-id-new".into()), ..receipt(&ce, &a, c.offset(1)) };
    eq("publish the new log's event", c.accept(&anchor_receipt).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    eq("one partition", (old_receipt.partition, old_receipt.topic_id.as_deref()), (anchor_receipt.partition, None))?;
    let m = format!("{}-m", c.prefix);
    let on_topic: &[&str] = &[anchor_receipt.topic.as_str()];
    let registry = [(m.as_str(), on_topic, true)];
    let wm = MemoryWatermark {
        log: outbox_core::LogId { cluster_id: anchor_receipt.cluster_id.clone(), topic: anchor_receipt.topic.clone(), topic_id: None, partition: anchor_receipt.partition },
        consumer_id: m.clone(),
        committed_offset: c.offset(2),
        anchor_recorded: true,
        anchor_event_id: Some(anchor.to_string()),
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: Some("topic-id-new".into()),
    };
    c.h.advance_ms(W + 1);
    let out = c.h.purge(W, &registry, &[wm]).await?;
    eq("the new log's event goes, the old log's is held", out, PurgeCounts { retained: 2, purged: 1, held: 1, replaced_log: 0, lost_position: lost_before })?;
    eq("the old log's event", c.state(&old).await?.0, EventState::Retained)?;
    eq("the new log's event", c.state(&anchor).await?.0, EventState::Purged)?;
    Ok(())
}
