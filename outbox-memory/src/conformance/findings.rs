//! The comparison's condition findings and how a round resolves them.

use outbox_core::id::EventId;
use outbox_core::receipt::ReceiptDecision;
use outbox_core::state::EventState;
use outbox_core::store::{FenceOutcome, OutboxStore};

use super::ctx::{eq, err, receipt, Ctx};
use super::{FindingThresholds, Harness, Verdict};

/// The comparison's condition findings (`outbox_core::findings`), on both
/// stores through the shipped reconciler: an old PENDING event is
/// `aged_pending`, a young one is not; a DISPATCH_UNKNOWN past the SLO is
/// `unknown_past_slo`; a quarantined event is `quarantined`; a published
/// event is `unconsumed_published` for a critical consumer whose watermark
/// is on another cluster's log, on another topic id, or at the event's
/// offset (behind it), and not for one whose watermark passed it. The next
/// round resolves the findings whose condition no longer holds (the
/// consumer caught up, the aged event was published) and keeps the others.
pub(super) async fn comparison_findings<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    use outbox_core::findings::{AGED_PENDING, QUARANTINED, UNCONSUMED_PUBLISHED, UNKNOWN_PAST_SLO};
    const T: i64 = 10_000;
    let th = FindingThresholds { aged_pending_ms: T, unknown_slo_ms: T, unconsumed_after_ms: T };
    // U: its send's outcome is unknown (the lease ran out while SENDING).
    let u = c.emit(1, "u").await;
    let ce_u = c.claim_some("w1", &u).await?;
    c.register(&ce_u.token).await?;
    c.expire().await?;
    c.expect_state(&u, EventState::DispatchUnknown).await?;
    // P: published at offset 10 of its log.
    let p = c.emit(2, "p").await;
    let ce_p = c.claim_some("w1", &p).await?;
    let a_p = c.register(&ce_p.token).await?;
    eq("P's ACK", c.accept(&receipt(&ce_p, &a_p, c.offset(10))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    // Q: quarantined by its dispatcher.
    let q = c.emit(3, "q").await;
    let ce_q = c.claim_some("w1", &q).await?;
    let out = c.s().quarantine_claimed(&ce_q.token, "conformance", serde_json::json!({})).await.map_err(err("quarantine_claimed"))?;
    eq("Q's quarantine", out, FenceOutcome::Applied)?;
    // O: PENDING past the threshold; Y: PENDING within it.
    let o = c.emit(4, "o").await;
    c.h.advance_ms(T + 1);
    let y = c.emit(5, "y").await;

    let d = &ce_p.destination;
    let other_topic_id = if d.topic_id.is_some() { None } else { Some("AAAAAAAAAAAAAAAAAAAAAQ".to_owned()) };
    let consumer = |n: &str| format!("{}-{n}", c.prefix);
    let (other_cluster, other_id, behind, passed) = (consumer("othercluster"), consumer("othertopicid"), consumer("behind"), consumer("passed"));
    let wm = |consumer_id: &str, cluster_id: &str, topic_id: Option<String>, committed_offset: i64| outbox_core::store::ConsumerWatermark {
        log: outbox_core::LogId { cluster_id: cluster_id.to_owned(), topic: d.topic.clone(), topic_id, partition: d.partition },
        consumer_id: consumer_id.to_owned(),
        committed_offset,
        anchor_recorded: false,
        anchor_event_id: None,
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: None,
    };
    let at = c.offset(10);
    let consumers: Vec<(String, Vec<String>)> = [&other_cluster, &other_id, &behind, &passed].iter().map(|id| ((*id).clone(), vec![d.topic.clone()])).collect();
    let watermarks = vec![
        wm(&other_cluster, "conformance-other-cluster", d.topic_id.clone(), at + 1_000),
        wm(&other_id, &d.cluster_id, other_topic_id, at + 1_000),
        wm(&behind, &d.cluster_id, d.topic_id.clone(), at),
        wm(&passed, &d.cluster_id, d.topic_id.clone(), at + 1),
    ];
    let ours = |open: Vec<(String, String, String)>| -> Vec<(String, String, String)> {
        // Critical consumers of other runs on a shared store read the topic too.
        let mine = [u.as_str(), p.as_str(), q.as_str(), o.as_str(), y.as_str()];
        let our_consumers = ["", other_cluster.as_str(), other_id.as_str(), behind.as_str(), passed.as_str()];
        let mut f: Vec<_> = open.into_iter().filter(|(_, e, c)| mine.contains(&e.as_str()) && our_consumers.contains(&c.as_str())).collect();
        f.sort();
        f
    };
    let finding = |kind: &str, e: &EventId, consumer: &str| (kind.to_owned(), e.to_string(), consumer.to_owned());
    let sorted = |mut v: Vec<(String, String, String)>| {
        v.sort();
        v
    };

    let open = ours(c.h.compare_findings(&th, &consumers, &watermarks).await?);
    let want = sorted(vec![
        finding(AGED_PENDING, &o, ""),
        finding(UNKNOWN_PAST_SLO, &u, ""),
        finding(QUARANTINED, &q, ""),
        finding(UNCONSUMED_PUBLISHED, &p, &other_cluster),
        finding(UNCONSUMED_PUBLISHED, &p, &other_id),
        finding(UNCONSUMED_PUBLISHED, &p, &behind),
    ]);
    eq("open findings after the first round", open, want)?;

    // The lagging consumer passes P; O is published.
    let ce_o = c.claim_some("w1", &o).await?;
    let a_o = c.register(&ce_o.token).await?;
    eq("O's ACK", c.accept(&receipt(&ce_o, &a_o, c.offset(11))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let open = ours(c.h.compare_findings(&th, &consumers, &[wm(&behind, &d.cluster_id, d.topic_id.clone(), at + 1)]).await?);
    let want = sorted(vec![
        finding(UNKNOWN_PAST_SLO, &u, ""),
        finding(QUARANTINED, &q, ""),
        finding(UNCONSUMED_PUBLISHED, &p, &other_cluster),
        finding(UNCONSUMED_PUBLISHED, &p, &other_id),
    ]);
    eq("open findings after the second round", open, want)
}

/// Issue 46: an event published in a log that replaced another under the
/// same name (a `destination.v1` receipt of a position epoch above 0) is
/// `unconsumed_published` whatever a watermark of that name says, on both
/// stores: the watermark may be the old log's. So is the event of the old
/// log at the same position (epoch 0): the watermark may be the new log's.
pub(super) async fn unconsumed_on_a_replaced_log<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    use outbox_core::findings::UNCONSUMED_PUBLISHED;
    const T: i64 = 10_000;
    let th = FindingThresholds { aged_pending_ms: T, unknown_slo_ms: T, unconsumed_after_ms: T };
    let mut published = Vec::new();
    for n in [1u32, 2] {
        let id = c.emit_on_replaced_topic(n, "replacedlog").await?;
        let ce = c.claim_some("w1", &id).await?;
        let a = c.register(&ce.token).await?;
        eq(&format!("event {n} at the same position"), c.accept(&receipt(&ce, &a, c.offset(30))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
        published.push((id, ce.destination));
    }
    let d = &published[0].1;
    eq("the route's topic id", d.topic_id.as_deref(), None)?;
    c.h.advance_ms(T + 1);
    let consumer = format!("{}-passed", c.prefix);
    let watermark = outbox_core::store::ConsumerWatermark {
        log: outbox_core::LogId { cluster_id: d.cluster_id.clone(), topic: d.topic.clone(), topic_id: None, partition: d.partition },
        consumer_id: consumer.clone(),
        committed_offset: c.offset(30) + 1,
        anchor_recorded: false,
        anchor_event_id: None,
        anchor_epoch: None,
        anchor_accepted_ms: None,
        log_id: None,
    };
    let open = c.h.compare_findings(&th, &[(consumer.clone(), vec![d.topic.clone()])], &[watermark]).await?;
    let ids: Vec<String> = published.iter().map(|(id, _)| id.to_string()).collect();
    let mut mine: Vec<(String, String, String)> = open.into_iter().filter(|(_, e, who)| ids.contains(e) && *who == consumer).collect();
    mine.sort();
    let mut want: Vec<(String, String, String)> = ids.iter().map(|id| (UNCONSUMED_PUBLISHED.to_owned(), id.clone(), consumer.clone())).collect();
    want.sort();
    eq("open findings", mine, want)
}
