//! The comparison's condition findings (`outbox_core::findings`).

use super::*;

/// The comparison's condition findings, over any store with their seam.
impl<B: Broker + 'static, S: ServiceStore + FindingsStore> Reconciler<B, S> {
    /// Reads the candidates of the comparison's condition findings through
    /// [`FindingsStore`] (each read bounded by `max_findings_per_kind`) and
    /// decides each with `outbox_core::findings`: `aged_pending`,
    /// `unknown_past_slo`, `quarantined`, `unconsumed_published` (per
    /// critical consumer, against its watermarks of the event's very log),
    /// `published_without_receipt` (the sweep's next page) and
    /// `stale_watermark`; then records them, resolving the open findings
    /// that no longer hold ([`FindingsStore::record_round_findings`]). Counts
    /// them; the bypass scan is not part of it.
    pub async fn compare_findings(&self) -> Result<CompareReport, ProducerError> {
        self.compare_findings_at(self.store.now_ms()).await
    }

    pub(super) async fn compare_findings_at(&self, now: i64) -> Result<CompareReport, ProducerError> {
        use outbox_core::findings as f;
        let c = &self.config;
        let limit = c.max_findings_per_kind;
        let mut found: Vec<RoundFinding> = Vec::new();
        let mut push = |kind: &'static str, event_id: String, consumer_id: String, age_ms: i64, detail: String| found.push(RoundFinding { kind, event_id, consumer_id, age_ms, detail });

        for e in self.store.aged_candidates(now.saturating_sub(c.aged_pending_ms), limit).await? {
            if let Some(age) = f::aged_pending(e.state, e.held_by_dispatcher, e.by_outbox, e.created_at_ms, now, c.aged_pending_ms) {
                push(f::AGED_PENDING, e.event_id, String::new(), age, "not delivered past the threshold (PENDING or being sent): is a dispatcher running for its cluster, does the broker take its sends?".into());
            }
        }
        for e in self.store.unknown_candidates(now.saturating_sub(c.unknown_slo_ms), limit).await? {
            if let Some(age) = f::unknown_past_slo(e.state, e.unknown_since_ms, now, c.unknown_slo_ms) {
                push(f::UNKNOWN_PAST_SLO, e.event_id, String::new(), age, format!("dispatch outcome unknown past the SLO (now {})", e.state.as_str()));
            }
        }
        for e in self.store.quarantined_candidates(limit).await? {
            if let Some(age) = f::quarantined(e.state, e.state_since_ms, now) {
                push(f::QUARANTINED, e.event_id, String::new(), age, format!("quarantined: {}", e.quarantine_reason));
            }
        }
        for (consumer_id, topics) in self.store.critical_consumers().await? {
            let watermarks = self.store.consumer_watermarks(&consumer_id, &topics).await?;
            let refs: Vec<outbox_core::WatermarkRef<'_>> = watermarks.iter().map(|w| w.watermark_ref()).collect();
            for p in self.store.published_candidates(&consumer_id, &topics, now.saturating_sub(c.unconsumed_after_ms), limit).await? {
                let at = p.position();
                let Some(age) = f::unconsumed_published(p.state, p.published_at_ms, now, c.unconsumed_after_ms, &at, &consumer_id, &topics, &refs) else { continue };
                let of_id = p.log.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                let detail = if at.on_replaced_unnamed_log() {
                    format!(
                        "published at {}/{}@{} in a partition whose log was replaced under the same name (its position epoch {}; a receipt of the partition above epoch 0): no watermark can say the consumer read it; check its receipts, and set the route again with its topic id (runbook: a topic was recreated)",
                        p.log.topic, p.log.partition, p.offset, p.position_epoch
                    )
                } else {
                    format!("published at {}{of_id}/{}@{}, not passed by the consumer's watermark of that log", p.log.topic, p.log.partition, p.offset)
                };
                push(f::UNCONSUMED_PUBLISHED, p.event_id, consumer_id.clone(), age, detail);
            }
        }
        for e in self.store.receipt_sweep_page(c.published_check_batch).await? {
            if f::published_without_receipt(e.state, e.has_primary_receipt) {
                push(f::PUBLISHED_WITHOUT_RECEIPT, e.event_id, String::new(), now - e.state_since_ms, format!("{} without a primary receipt", e.state.as_str()));
            }
        }
        for p in self.store.watermark_publishers(now.saturating_sub(c.stale_watermark_after_ms), limit).await? {
            if let Some(age) = f::stale_watermark(p.records_accepted, p.last_received_ms, now, c.stale_watermark_after_ms) {
                let detail = format!(
                    "no watermark record from this consumer on cluster {} for {age} ms (threshold {} ms); its watermark stays where it was",
                    p.cluster_id, c.stale_watermark_after_ms
                );
                push(f::STALE_WATERMARK, p.cluster_id, p.consumer_id, age, detail);
            }
        }

        let mut report = CompareReport::default();
        for r in &found {
            match r.kind {
                f::AGED_PENDING => report.aged_pending += 1,
                f::UNKNOWN_PAST_SLO => report.unknown_past_slo += 1,
                f::QUARANTINED => report.quarantined += 1,
                f::UNCONSUMED_PUBLISHED => report.unconsumed_published += 1,
                f::PUBLISHED_WITHOUT_RECEIPT => report.published_without_receipt += 1,
                _ => report.stale_watermark += 1,
            }
        }
        self.store.record_round_findings(now, &found).await?;
        Ok(report)
    }
}
