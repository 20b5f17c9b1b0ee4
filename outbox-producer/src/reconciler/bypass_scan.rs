//! The bypass scan: every routed partition read from its cursor, each message judged by `outbox_core::compare`.

use super::*;

impl<B: Broker + 'static, S: ServiceStore> Reconciler<B, S> {
    /// Reads every routed topic of this broker's cluster from its cursor and
    /// reports messages whose eventId the outbox never committed, or that
    /// carry none (`bypass_publish`); messages another, undeclared outbox
    /// wrote (`foreign_source`); and copies of published events at a
    /// position that is neither their primary receipt nor a recorded
    /// duplicate transport receipt, byte-identical (`unrecorded_copy`) or
    /// not (`divergent_copy`); and receipts whose position the log no
    /// longer has (`receipt_position_lost`). What each message is, where
    /// the cursor goes and which positions are lost are
    /// `outbox_core::compare`'s decisions; each page's evidence, findings
    /// and cursor are written in one transaction
    /// ([`BypassScanStore::record_bypass_scan`]).
    pub async fn scan_for_bypass(&self) -> Result<BypassScanReport, ProducerError>
    where
        S: BypassScanStore,
    {
        self.scan_at(self.store.now_ms()).await
    }

    pub(super) async fn scan_at(&self, now: i64) -> Result<BypassScanReport, ProducerError>
    where
        S: BypassScanStore,
    {
        let cluster = self.broker.cluster_id().to_owned();
        let topics = self.store.routed_topics(&cluster).await?;
        let own_source = self.store.source_identity().await?;
        let mut report = BypassScanReport::default();
        for (topic, partitions) in topics {
            // A topic with another partition count than its routes froze
            // (brought back by auto-creation after a broker replacement, or
            // recreated): a finding naming both counts; the partitions it
            // lacks are not read (their events wait, visibly).
            let readable = match self.broker.partition_count(&topic).await {
                Ok(Some(actual)) => {
                    let routes = self.store.routes_to(&cluster, &topic).await?;
                    if let Some(detail) = outbox_core::compare::partition_count_finding(&cluster, &topic, actual, &routes) {
                        tracing::error!(%topic, actual, frozen = partitions, "{detail}");
                        let finding = ScanFinding {
                            kind: outbox_core::compare::PARTITION_COUNT_CHANGED,
                            event_id: outbox_core::compare::partition_count_label(&topic),
                            detail,
                            offset: None,
                            attempt_id: None,
                        };
                        // Recorded with partition 0's page; a cursor never
                        // moves back, so Advance(0) leaves it (and its anchor) as it is.
                        let write = BypassScanWrite { cluster_id: cluster.clone(), topic: topic.clone(), partition: 0, now_ms: now, bypass_messages: Vec::new(), findings: vec![finding], cursor: CursorMove::Advance(0), anchor: None };
                        self.store.record_bypass_scan(&write).await?;
                        report.findings.push((outbox_core::compare::PARTITION_COUNT_CHANGED, outbox_core::compare::partition_count_label(&topic)));
                    }
                    partitions.min(i32::try_from(actual).unwrap_or(i32::MAX))
                }
                Ok(None) => partitions,
                Err(e) => {
                    tracing::warn!(%topic, error = %e, "could not read the topic's partition count");
                    partitions
                }
            };
            // Receipts on the partitions the topic no longer has name
            // positions that are gone, like receipts beyond a log's end.
            for partition in readable..partitions {
                let before = outbox_core::compare::beyond_end_accepted_before_ms(now, self.config.clock_skew_allowance_ms);
                let lost = self.store.receipts_from(&cluster, &topic, partition, 0, before, self.config.max_findings_per_kind).await?;
                if lost.is_empty() {
                    continue;
                }
                tracing::error!(%topic, partition, has = readable, receipts = lost.len(), "receipts name a partition the topic no longer has: their positions are gone");
                let findings: Vec<ScanFinding> = lost
                    .iter()
                    .map(|r| {
                        let of_id = r.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                        ScanFinding {
                            kind: outbox_core::compare::RECEIPT_POSITION_LOST,
                            event_id: r.event_id.clone(),
                            detail: format!(
                                "its receipt's position {cluster}/{topic}{of_id}/{partition}@{} is on a partition the topic no longer has (it has {readable} partitions): the log it was recorded in is gone (topic recreated with fewer partitions, cluster replaced)",
                                r.offset
                            ),
                            offset: None,
                            attempt_id: None,
                        }
                    })
                    .collect();
                // A cursor never moves back: Advance(0) leaves the partition's as it is.
                let write = BypassScanWrite { cluster_id: cluster.clone(), topic: topic.clone(), partition, now_ms: now, bypass_messages: Vec::new(), findings, cursor: CursorMove::Advance(0), anchor: None };
                self.store.record_bypass_scan(&write).await?;
                report.findings.extend(write.findings.into_iter().map(|f| (f.kind, f.event_id)));
            }
            for partition in 0..readable {
                let at = self.store.bypass_cursor(&cluster, &topic, partition).await?;
                let cursor = at.next_offset;
                // A cursor with an anchor reads the message below it again:
                // a log replaced and grown past the cursor holds another
                // message there.
                let anchored = at.anchor.is_some() && cursor > 0;
                let from = if anchored { cursor - 1 } else { cursor };
                let mut scan = match self.broker.scan_event_ids(&topic, partition, from, self.config.bypass_scan_max_messages + u64::from(anchored)).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(%topic, partition, error = %e, "bypass check could not read the partition");
                        continue;
                    }
                };
                if take_scan_anchor(&at, &mut scan) {
                    tracing::error!(%topic, partition, cursor, "the partition's log holds another message below the bypass scan's cursor: the log was replaced; reading the new one from its start");
                    let write = BypassScanWrite { cluster_id: cluster.clone(), topic: topic.clone(), partition, now_ms: now, bypass_messages: Vec::new(), findings: Vec::new(), cursor: CursorMove::Restart, anchor: None };
                    self.store.record_bypass_scan(&write).await?;
                    continue;
                }
                report.scanned += scan.messages.len();
                let ids: Vec<String> = scan.messages.iter().filter_map(|m| m.event_id.clone()).collect();
                let known = if ids.is_empty() { BTreeSet::new() } else { self.store.committed_event_ids(&ids).await? };
                let offsets: Vec<i64> = scan.messages.iter().map(|m| m.offset).collect();
                let receipts = if offsets.is_empty() { Vec::new() } else { self.store.receipts_at(&cluster, &topic, partition, &offsets).await? };
                let known_ids: Vec<String> = known.iter().cloned().collect();
                let (published, open) = if known_ids.is_empty() {
                    Default::default()
                } else {
                    (self.store.published_digests(&known_ids).await?, self.store.unanswered_attempts_of(&known_ids).await?)
                };
                // A copy of an open attempt still within its in-flight bound
                // may be an answer on its way (waited for); past the bound no
                // receipt will come, and its copy is judged; a copy of an
                // attempt closed without a receipt refutes its closing.
                let copies = KnownCopies::new(&receipts, published, &open, &self.config.retry, now);
                let judged: Vec<(&outbox_core::ScannedMessage, ScanJudgement)> = scan
                    .messages
                    .iter()
                    .map(|m| (m, judge_scanned(m, own_source.as_deref(), &self.config.declared_sources, &known, &copies)))
                    .collect();
                // Copies no answer will reach, of events not published yet:
                // the receipt transaction takes them before the cursor moves
                // past (a failure leaves the page to be read again).
                let submit: Vec<outbox_core::BrokerReceipt> =
                    judged.iter().filter(|(_, j)| *j == ScanJudgement::Submit).filter_map(|(m, _)| m.receipt.clone()).collect();
                if !submit.is_empty() {
                    let outcomes = self.store.accept_dispatch_receipts(&submit).await?;
                    for (r, o) in submit.iter().zip(&outcomes) {
                        tracing::warn!(event_id = %r.event_id, attempt_id = %r.attempt_id, topic = %r.topic, partition = r.partition, offset = r.offset, decision = ?o.decision, state = ?o.state, "the bypass scan found a copy of an attempt past its in-flight bound, its event unpublished: handed to the receipt transaction");
                    }
                    report.submitted += submit.len();
                }
                let mut write = BypassScanWrite {
                    cluster_id: cluster.clone(),
                    topic: topic.clone(),
                    partition,
                    now_ms: now,
                    bypass_messages: Vec::new(),
                    findings: Vec::new(),
                    cursor: next_bypass_cursor(cursor, &scan, first_wait(judged.iter().copied())),
                    anchor: None,
                };
                if let CursorMove::Advance(to) = write.cursor {
                    write.anchor = anchor_below(to, &scan.messages);
                }
                // Offsets the log's start moved past before this check read
                // them (retention, DeleteRecords): the copies they held, if
                // any, can no longer be accounted for. Said once, with the page
                // that moves the cursor past them.
                if let Some(gap) = outbox_core::compare::unread_range(cursor, &scan) {
                    tracing::warn!(%topic, partition, from = gap.0, to = gap.1, "offsets were deleted from the partition before the bypass check read them");
                    write.findings.push(ScanFinding {
                        kind: outbox_core::compare::SCAN_GAP,
                        event_id: outbox_core::compare::scan_gap_label(&topic, partition, gap),
                        detail: format!(
                            "offsets {}..{} of {cluster}/{topic}/{partition} were deleted (retention, DeleteRecords) before the bypass check read them: copies they held cannot be accounted for (raise the topic's retention above the reconciler's lag; on a partition that held data from before the outbox, this is that history)",
                            gap.0, gap.1
                        ),
                        offset: Some(gap.0),
                        attempt_id: None,
                    });
                }
                for (m, j) in &judged {
                    let ScanJudgement::Finding(kind) = *j else { continue };
                    if j.is_bypass_message() {
                        write.bypass_messages.push((*m).clone());
                    }
                    let label = m.event_id.clone().unwrap_or_else(|| format!("no-event-id@{topic}/{partition}/{}", m.offset));
                    let detail = match kind {
                        outbox_core::compare::FOREIGN_SOURCE => {
                            let s: String = m.source.as_deref().unwrap_or_default().chars().take(200).collect();
                            format!("message of source {s} at {topic}/{partition}@{}: another outbox writes this topic (declare it, or stop it)", m.offset)
                        }
                        outbox_core::compare::BYPASS_PUBLISH => {
                            let why = if m.event_id.is_some() { "eventId in the topic that the outbox never committed" } else { "message without an outbox eventId" };
                            format!("{why} at {topic}/{partition}@{}", m.offset)
                        }
                        outbox_core::compare::ABSENCE_PROOF_REFUTED => {
                            let attempt = m.attempt_id.as_deref().unwrap_or_default();
                            format!("{attempt} @{}: a copy at {cluster}/{topic}/{partition}@{} of an attempt the outbox closed without a receipt (proven absent, or not sent)", m.offset, m.offset)
                        }
                        _ => {
                            let what = if kind == outbox_core::compare::UNRECORDED_COPY { "a byte-identical copy" } else { "a copy with other bytes" };
                            format!("{what} of the published event at {cluster}/{topic}/{partition}@{}, neither its primary receipt nor a recorded duplicate", m.offset)
                        }
                    };
                    write.findings.push(ScanFinding { kind, event_id: label, detail, offset: Some(m.offset), attempt_id: m.attempt_id.clone() });
                }
                // Receipts whose position now holds another message (or one
                // without an eventId, or the same event's message of another
                // topic id), and receipts at or beyond the log's end accepted
                // well before this round began: the log they were recorded in
                // is gone. Those already reported beyond the end are skipped,
                // so that a round's limit moves on to the next ones.
                let mut beyond = Vec::new();
                // What the broker serves past its reported end, from the
                // lowest receipt beyond it: a broker may report an end below
                // records it serves (tansu 0.6: its last produce batch's base
                // offset + 1), which is no lost log.
                let mut served = Vec::new();
                let mut under_reported: Vec<i64> = Vec::new();
                if let Some(end) = scan.log_end {
                    let before = outbox_core::compare::beyond_end_accepted_before_ms(now, self.config.clock_skew_allowance_ms);
                    beyond = self.store.receipts_from(&cluster, &topic, partition, end, before, self.config.max_findings_per_kind).await?;
                    if let Some((from, max)) = outbox_core::compare::past_end_read(end, &beyond, self.config.bypass_scan_max_messages) {
                        match self.broker.read_past_reported_end(&topic, partition, from, max).await {
                            Ok(m) => served = m,
                            Err(e) => tracing::debug!(%topic, partition, from, error = %e, "could not read past the partition's reported end"),
                        }
                    }
                }
                for r in receipts.iter().chain(&beyond) {
                    let Some(lost) = receipt_position_lost(&scan, r) else { continue };
                    if matches!(lost, PositionLost::BeyondEnd { .. }) && outbox_core::compare::served_past_reported_end(r, &served) {
                        under_reported.push(r.offset);
                        continue;
                    }
                    // Another event's message there, which that event's
                    // receipt recorded in an earlier position epoch: the log
                    // was not replaced, this receipt never matched it
                    // (`outbox_core::compare::never_matched`).
                    let lost = if matches!(lost, PositionLost::HoldsOther { holder: Some(_), .. }) {
                        let epochs = self.store.receipt_epochs_at(&cluster, &topic, partition, r.offset).await?;
                        outbox_core::compare::never_matched(&lost, r, &epochs).unwrap_or(lost)
                    } else {
                        lost
                    };
                    let offset = r.offset;
                    let detail = match lost {
                        PositionLost::HoldsOther { holder, topic_id } => {
                            let of_id = r.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                            let there = match (holder, topic_id) {
                                (None, _) => "a message without an eventId".to_owned(),
                                (Some(e), None) => format!("event {e}'s message"),
                                (Some(e), Some(id)) => format!("event {e}'s message of topic id {id}"),
                            };
                            format!("its receipt's position {cluster}/{topic}{of_id}/{partition}@{offset} now holds {there}: the log it was recorded in is gone (topic recreated, cluster replaced)")
                        }
                        PositionLost::BeyondEnd { end } => format!(
                            "its receipt's position {cluster}/{topic}/{partition}@{offset} is beyond the log's end {end}: the log it was recorded in is gone (broker replaced, topic recreated)"
                        ),
                        PositionLost::NeverMatched { holder, holder_epoch, epoch } => {
                            let of_id = r.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                            format!(
                                "its receipt's position {cluster}/{topic}{of_id}/{partition}@{offset} (position epoch {epoch}) holds event {holder}'s message, which that event's receipt recorded there in epoch {holder_epoch}: the log was not replaced since, so this receipt never matched the log: a forged or corrupted receipt row (written without the broker's acknowledgement), not a lost log, unless the log was restored from an older copy. Its event's message may never have been written: find what wrote the row (database audit logs) and look the event up (`outbox trace`)"
                            )
                        }
                    };
                    write.findings.push(ScanFinding { kind: outbox_core::compare::RECEIPT_POSITION_LOST, event_id: r.event_id.clone(), detail, offset: None, attempt_id: None });
                }
                // Receipts beyond the reported end whose events the broker
                // still serves at their offsets: no finding; said once per
                // partition per round, in the log and the scan's report.
                if let (Some(end), Some(low), Some(high)) = (scan.log_end, under_reported.iter().min(), under_reported.iter().max()) {
                    let note = format!(
                        "{cluster}/{topic}/{partition} reports its end at {end}, yet serves the events of {} receipts at offsets {low}..={high} there: the broker under-reports its end (tansu 0.6 after a multi-record produce batch), the log is not lost; no receipt_position_lost. Have dispatchers send one record per batch (`batch.num.messages=1`) to such a broker (docs/OPERATIONS.md, `receipt_position_lost`)",
                        under_reported.len()
                    );
                    tracing::warn!(%topic, partition, log_end = end, receipts = under_reported.len(), from_offset = low, to_offset = high, "{note}");
                    report.notes.push(note);
                }
                if write.cursor == CursorMove::Restart {
                    tracing::error!(%topic, partition, cursor, log_end = ?scan.log_end, "the partition's log ends below the bypass scan's cursor: the log was replaced; reading the new one from its start");
                }
                // A page that found nothing and moves nothing writes nothing.
                let idle = write.findings.is_empty() && write.bypass_messages.is_empty() && write.cursor == CursorMove::Advance(cursor);
                if !idle {
                    self.store.record_bypass_scan(&write).await?;
                }
                report.findings.extend(write.findings.into_iter().map(|f| (f.kind, f.event_id)));
            }
        }
        Ok(report)
    }
}
