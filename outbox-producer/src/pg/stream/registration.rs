//! Registration, lease renewal and the moves to the lane that a fenced
//! write of a stream event needs first.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use outbox_core::stream::{check_lease, BucketLease};
use outbox_core::{AttemptRecord, AttemptState, ClaimToken, CoreError, EventState, StoreError};
use sqlx::{Postgres, Row, Transaction};

use super::claims::{destination_digests, insert_steps, load_batches, take_over, Batch};
use super::lane::{move_to_lane, LaneClaim, LaneMove, LaneState};
use crate::error::store_err;
use crate::pg::PgStore;

/// A bucket's lease as a fenced write reads it, locked.
#[derive(Debug, Clone)]
pub(super) struct LeaseNow {
    pub owner: Option<String>,
    pub generation: i64,
    pub lease_until_ms: i64,
    pub open_batch: Option<i64>,
}

impl LeaseNow {
    fn core(&self, bucket: i16) -> BucketLease {
        BucketLease { bucket: bucket as u32, owner: self.owner.clone(), generation: self.generation as u64, lease_until_ms: self.lease_until_ms }
    }
}

/// The leases of the buckets of batches `ids`, locked (`FOR SHARE`, or
/// `FOR UPDATE` when `exclusive`), in key order.
pub(super) async fn lock_leases(tx: &mut Transaction<'static, Postgres>, ids: &[i64], exclusive: bool) -> Result<HashMap<i64, LeaseNow>, StoreError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let g = |e: sqlx::Error| store_err(e);
    let rows = sqlx::query("SELECT id, owner, generation, lease_until_ms, open_batch FROM outbox_stream_lock_leases($1, $2)")
    .bind(ids)
    .bind(exclusive)
    .fetch_all(&mut **tx)
    .await
    .map_err(g)?;
    let mut out = HashMap::new();
    for r in rows {
        out.insert(
            r.try_get("id").map_err(g)?,
            LeaseNow { owner: r.try_get("owner").map_err(g)?, generation: r.try_get("generation").map_err(g)?, lease_until_ms: r.try_get("lease_until_ms").map_err(g)?, open_batch: r.try_get("open_batch").map_err(g)? },
        );
    }
    Ok(out)
}

/// The events of `ids` that have a row in the lane.
pub(super) async fn in_lane(tx: &mut Transaction<'static, Postgres>, ids: &[&str]) -> Result<BTreeSet<String>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeSet::new());
    }
    Ok(sqlx::query_scalar("SELECT event_id FROM outbox_events WHERE event_id = ANY($1)").bind(ids).fetch_all(&mut **tx).await.map_err(store_err)?.into_iter().collect())
}

/// Every event of `batches`.
pub(super) fn batch_events<'a>(batches: impl Iterator<Item = &'a Batch>) -> Vec<&'a str> {
    batches.flat_map(|b| b.event_ids.iter().map(String::as_str)).collect()
}

/// The moves to the lane that take `index` of `batch` off the happy path in
/// the state it has, with the later unsettled events of its key in the
/// batch (they wait behind it there).
pub(super) fn moves_for(batch: &Batch, index: usize, lease: Option<&LeaseNow>, digests: &HashMap<String, String>) -> Result<Vec<LaneMove>, StoreError> {
    let key = batch.keys.get(index).cloned().flatten();
    let lease_until_ms = lease.filter(|l| l.generation == batch.lease_generation).map_or(0, |l| l.lease_until_ms);
    let mut out = Vec::new();
    for (j, id) in batch.event_ids.iter().enumerate() {
        let behind = j > index && key.is_some() && batch.keys.get(j).cloned().flatten() == key;
        if j != index && !behind {
            continue;
        }
        let f = batch.facts[j];
        if j != index && (f.receipted || f.in_lane) {
            continue;
        }
        let to = if f.receipted {
            LaneState::Published
        } else if f.registered {
            LaneState::Sending
        } else if f.handed {
            LaneState::Claimed
        } else {
            LaneState::Pending
        };
        let claim = match to {
            // Not handed out: only its generation, so that the next claim's is above the batch's.
            LaneState::Pending => Some(LaneClaim { owner: batch.owner.clone(), batch_id: batch.id, lease_until_ms, attempt: None }),
            LaneState::Claimed => Some(LaneClaim { owner: batch.owner.clone(), batch_id: batch.id, lease_until_ms, attempt: None }),
            _ => Some(LaneClaim {
                owner: batch.owner.clone(),
                batch_id: batch.id,
                lease_until_ms,
                attempt: Some(batch.attempt(j, digests.get(id).cloned().unwrap_or_default())?),
            }),
        };
        out.push(LaneMove { event_id: id.clone(), to, claim });
    }
    Ok(out)
}

impl PgStore {
    /// Moves the stream events of `tokens` (event, claim generation = its
    /// batch) to the lane in the state the stream gave them, so that a
    /// fenced write of the chains path decides them; events already in the
    /// lane, and tokens that name no batch holding their event, are left.
    pub(crate) async fn stream_to_lane(&self, tokens: &[(&str, u64)]) -> Result<(), StoreError> {
        if !self.path_seen.maybe_stream() || tokens.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin().await?;
        let ids: Vec<&str> = tokens.iter().map(|t| t.0).collect();
        let lane = in_lane(&mut tx, &ids).await?;
        let wanted: Vec<(&str, i64)> = tokens.iter().filter(|t| !lane.contains(t.0)).map(|t| (t.0, t.1 as i64)).collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let batch_ids: Vec<i64> = wanted.iter().map(|w| w.1).collect::<BTreeSet<_>>().into_iter().collect();
        let leases = lock_leases(&mut tx, &batch_ids, true).await?;
        let batches = load_batches(&mut tx, &batch_ids, true).await?;
        let digests = destination_digests(&mut tx, &batch_events(batches.values())).await?;
        let mut moves = Vec::new();
        for (event, batch) in wanted {
            let Some(b) = batches.get(&batch) else { continue };
            let Some(index) = b.event_ids.iter().position(|e| e == event) else { continue };
            moves.extend(moves_for(b, index, leases.get(&batch), &digests)?);
        }
        move_to_lane(&mut tx, &moves, self.now_ms()).await?;
        tx.commit().await.map_err(store_err)?;
        Ok(())
    }

    /// Registers the attempts of stream tokens (none of whose events was in
    /// the lane when the caller looked): each must be handed out by its
    /// bucket's open batch, under the batch's lease, running. One
    /// `registered` step per batch.
    ///
    /// An event moved to the lane meanwhile (an operator's migration or
    /// retention, `stream_event_to_lane`, which holds the bucket's lease row
    /// exclusively, so it is seen here once the lease is locked) is not
    /// registered on the stream: it went there CLAIMED under the batch's
    /// claim, and its attempt is registered in the lane, fenced by that
    /// claim, so that the lane knows the attempt it may find in the log.
    pub(crate) async fn register_stream(&self, tokens: &[&ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let batch_ids: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect::<BTreeSet<_>>().into_iter().collect();
        let leases = lock_leases(&mut tx, &batch_ids, false).await?;
        let batches = load_batches(&mut tx, &batch_ids, false).await?;
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        // Read after the lease rows are locked: a move to the lane under
        // them has committed, or waits for this transaction.
        let lane = in_lane(&mut tx, &ids).await?;
        let digests = destination_digests(&mut tx, &ids).await?;
        let mut out = Vec::with_capacity(tokens.len());
        let mut steps: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
        let mut to_lane: Vec<(usize, ClaimToken)> = Vec::new();
        for t in tokens {
            if lane.contains(t.event_id.as_str()) {
                to_lane.push((out.len(), (*t).clone()));
                out.push(Err(StoreError::NotFound(t.event_id.clone())));
                continue;
            }
            let batch_id = t.claim_generation as i64;
            let decided = (|| -> Result<(usize, AttemptRecord), StoreError> {
                // A batch that does not hold the event: a generation never granted for it.
                let unknown = || -> StoreError {
                    if digests.contains_key(t.event_id.as_str()) {
                        CoreError::Fenced { writer_generation: t.claim_generation, current_generation: 0 }.into()
                    } else {
                        StoreError::NotFound(t.event_id.clone())
                    }
                };
                let b = batches.get(&batch_id).ok_or_else(unknown)?;
                let index = b.event_ids.iter().position(|e| e == t.event_id.as_str()).ok_or_else(unknown)?;
                let lease = leases.get(&batch_id).ok_or_else(|| StoreError::NotFound(t.event_id.clone()))?;
                if lease.open_batch != Some(batch_id) || b.owner != t.owner {
                    return Err(CoreError::Fenced { writer_generation: t.claim_generation, current_generation: lease.open_batch.unwrap_or_default() as u64 }.into());
                }
                check_lease(&lease.core(b.bucket), &t.owner, b.lease_generation as u64, now, true)?;
                let f = b.facts[index];
                if !f.handed || f.registered || steps.get(&batch_id).is_some_and(|p| p.contains(&index)) {
                    let from = if f.registered { EventState::Sending } else { EventState::Pending };
                    return Err(CoreError::IllegalTransition { from, to: EventState::Sending }.into());
                }
                let digest = digests.get(t.event_id.as_str()).cloned().unwrap_or_default();
                Ok((index, b.attempt_record(index, t.event_id.as_str(), digest, AttemptState::Sending, Some(lease.lease_until_ms))?))
            })();
            out.push(decided.map(|(index, record)| {
                steps.entry(batch_id).or_default().push(index);
                record
            }));
        }
        insert_steps(&mut tx, "registered", &steps.into_iter().collect::<Vec<_>>(), now).await?;
        tx.commit().await.map_err(store_err)?;
        if !to_lane.is_empty() {
            // After this transaction: the stream's registrations stand
            // whatever the lane's answer, which is per token.
            let lane_tokens: Vec<ClaimToken> = to_lane.iter().map(|(_, t)| t.clone()).collect();
            match Box::pin(self.register_attempts_tx(&lane_tokens)).await {
                Ok(registered) => {
                    for ((at, _), r) in to_lane.into_iter().zip(registered) {
                        out[at] = r;
                    }
                }
                Err(e) => {
                    let message = format!("registration in the exception lane: {e}");
                    for (at, _) in to_lane {
                        out[at] = Err(StoreError::Backend { message: message.clone(), retryable: true });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Renews the bucket lease of stream tokens whose batch is open under
    /// their owner's running lease: the new end per token, or `None`.
    pub(crate) async fn renew_stream(&self, tokens: &[&ClaimToken], lease_ms: i64) -> Result<HashMap<String, i64>, StoreError> {
        let now = self.now_ms();
        let batch_ids: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect::<BTreeSet<_>>().into_iter().collect();
        let owners: Vec<&str> = batch_ids.iter().map(|b| tokens.iter().find(|t| t.claim_generation as i64 == *b).map_or("", |t| t.owner.as_str())).collect();
        let rows = sqlx::query("SELECT id, lease_until_ms FROM outbox_stream_renew($1, $2, $3, $4)")
        .bind(&batch_ids)
        .bind(&owners)
        .bind(now)
        .bind(lease_ms)
        .fetch_all(&self.pool)
        .await
        .map_err(store_err)?;
        let mut renewed: HashMap<i64, i64> = HashMap::new();
        for r in rows {
            renewed.insert(r.try_get("id").map_err(store_err)?, r.try_get("lease_until_ms").map_err(store_err)?);
        }
        Ok(tokens.iter().filter_map(|t| renewed.get(&(t.claim_generation as i64)).map(|l| (t.event_id.to_string(), *l))).collect())
    }

    /// The lease sweep's share on the stream: open batches whose lease ran
    /// out are taken over, then the lease log is pruned. Returns the events
    /// moved to the lane.
    pub(crate) async fn expire_stream(&self) -> Result<usize, StoreError> {
        if !self.path_seen.maybe_stream() {
            return Ok(0);
        }
        let taken_over = self.take_over_expired().await?;
        self.prune_lease_log().await;
        Ok(taken_over)
    }

    /// The lease sweep's takeovers on the stream: open batches whose lease
    /// ran out go to the lane and are closed. Returns the events moved.
    async fn take_over_expired(&self) -> Result<usize, StoreError> {
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar("SELECT * FROM outbox_stream_expired($1)")
        .bind(now)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        if ids.is_empty() {
            return Ok(0);
        }
        let batches = load_batches(&mut tx, &ids, true).await?;
        let n = take_over(&mut tx, &batches, now).await?;
        sqlx::query("SELECT outbox_stream_close($1)").bind(&ids).execute(&mut *tx).await.map_err(store_err)?;
        tx.commit().await.map_err(store_err)?;
        Ok(n)
    }

    /// Deletes the lease log's rows behind each bucket's newest state (at
    /// most `LEASE_LOG_PRUNE` per sweep), from where the last prune of this
    /// store stopped: rows it deleted are not read again even while a held
    /// snapshot keeps them. A failure is logged and the next sweep tries
    /// again: the takeovers of the sweep stand whatever the prune does.
    async fn prune_lease_log(&self) {
        const LEASE_LOG_PRUNE: i32 = 50_000;
        let after = self.lease_log_pruned.load(std::sync::atomic::Ordering::Relaxed);
        match sqlx::query_scalar::<_, i64>("SELECT outbox_bucket_lease_log_prune($1, $2)").bind(after).bind(LEASE_LOG_PRUNE).fetch_one(&self.pool).await {
            Ok(upto) => {
                self.lease_log_pruned.fetch_max(upto, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, "pruning the bucket lease log failed; the next lease sweep tries again"),
        }
    }
}

impl PgStore {
    /// The attempt of a stream event that is not in the lane: the one its
    /// batch registered, ACKED when its receipt fills the slot.
    pub(crate) async fn stream_attempts(&self, event_id: &str) -> Result<Vec<AttemptRecord>, StoreError> {
        if !self.path_seen.maybe_stream() {
            return Ok(Vec::new());
        }
        let mut tx = self.begin().await?;
        // The batch of its receipt, else its bucket's open batch.
        let found: Option<(i64, bool)> = sqlx::query_as(
            "SELECT coalesce(r.batch_id, l.open_batch), r.event_id IS NOT NULL
             FROM outbox_stream s
             LEFT JOIN outbox_publish_receipts r ON r.event_id = s.event_id AND r.envelope_generation = 1
             LEFT JOIN outbox_bucket_leases l ON l.cluster_id = s.cluster_id AND l.bucket = s.bucket
             WHERE s.event_id = $1 AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)",
        )
        .bind(event_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(store_err)?
        .and_then(|(b, acked): (Option<i64>, bool)| b.map(|b| (b, acked)));
        let Some((batch_id, acked)) = found else { return Ok(Vec::new()) };
        let batches = load_batches(&mut tx, &[batch_id], false).await?;
        let Some(b) = batches.get(&batch_id) else { return Ok(Vec::new()) };
        let Some(index) = b.event_ids.iter().position(|e| e == event_id) else { return Ok(Vec::new()) };
        if !b.facts[index].registered {
            return Ok(Vec::new());
        }
        let digests = destination_digests(&mut tx, &[event_id]).await?;
        let state = if acked { AttemptState::Acked } else { AttemptState::Sending };
        Ok(vec![b.attempt_record(index, event_id, digests.get(event_id).cloned().unwrap_or_default(), state, None)?])
    }
}

impl PgStore {
    /// Moves stream event `event_id` to the lane in the state the stream
    /// gives it (an operator's write, retention): under its bucket's lease
    /// row, so that no cut, registration or receipt of the bucket runs
    /// meanwhile. Nothing for an event that is in the lane already, or not
    /// on the stream.
    ///
    /// An event without a receipt takes the earlier unsettled events of its
    /// key (neither receipted nor in the lane: in the bucket's open batch,
    /// or not cut yet) along, each in the state the stream gave it, so that
    /// it does not overtake them: the lane's chain of the key starts at the
    /// oldest of them, and the stream hands the key's later events to the
    /// lane (`outbox_stream_window`'s `to_lane`).
    pub(crate) async fn stream_event_to_lane(&self, event_id: &str) -> Result<(), StoreError> {
        if !self.path_seen.maybe_stream() {
            return Ok(());
        }
        let mut tx = self.begin().await?;
        let g = |e: sqlx::Error| store_err(e);
        let Some((cluster_id, bucket)): Option<(String, i16)> = sqlx::query_as("SELECT cluster_id, bucket FROM outbox_stream WHERE event_id = $1")
            .bind(event_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(g)?
        else {
            return Ok(());
        };
        // The slot's lock first, then its state, read after it.
        sqlx::query("SELECT 1 FROM outbox_bucket_slots WHERE cluster_id = $1 AND bucket = $2 FOR UPDATE")
            .bind(&cluster_id)
            .bind(bucket)
            .execute(&mut *tx)
            .await
            .map_err(g)?;
        let open: Option<Option<i64>> = sqlx::query_scalar("SELECT open_batch FROM outbox_bucket_leases WHERE cluster_id = $1 AND bucket = $2")
            .bind(&cluster_id)
            .bind(bucket)
            .fetch_optional(&mut *tx)
            .await
            .map_err(g)?;
        if !in_lane(&mut tx, &[event_id]).await?.is_empty() {
            return Ok(());
        }
        let receipt_batch: Option<Option<i64>> = sqlx::query_scalar("SELECT batch_id FROM outbox_publish_receipts WHERE event_id = $1 AND envelope_generation = 1")
            .bind(event_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(g)?;
        // The earlier events of its key that are not settled, oldest first.
        // Every event of a transaction below the bucket's last window's
        // lower bound was cut into a batch before the open one, and those
        // batches are settled: the read starts there.
        let earlier: Vec<String> = if receipt_batch.is_some() {
            Vec::new()
        } else {
            sqlx::query_scalar(
                "SELECT p.event_id FROM outbox_stream s
                 JOIN outbox_bucket_leases l ON l.cluster_id = s.cluster_id AND l.bucket = s.bucket
                 JOIN outbox_stream p ON p.cluster_id = s.cluster_id AND p.bucket = s.bucket
                      AND p.xid >= least(pg_snapshot_xmin(l.prev_cut), pg_snapshot_xmin(l.cut))
                      AND p.key_chain = s.key_chain AND p.ordered AND p.seq < s.seq
                 WHERE s.event_id = $1 AND s.ordered
                   AND NOT EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = p.event_id AND r.envelope_generation = 1)
                   AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = p.event_id)
                 ORDER BY p.seq",
            )
            .bind(event_id)
            .fetch_all(&mut *tx)
            .await
            .map_err(g)?
        };
        let candidates: Vec<i64> = [receipt_batch.flatten(), open.flatten()].into_iter().flatten().collect::<BTreeSet<_>>().into_iter().collect();
        let leases = lock_leases(&mut tx, &candidates, true).await?;
        let batches = load_batches(&mut tx, &candidates, true).await?;
        let digests = destination_digests(&mut tx, &batch_events(batches.values())).await?;
        let mut moves: Vec<LaneMove> = Vec::new();
        for id in earlier.iter().map(String::as_str).chain([event_id]) {
            if moves.iter().any(|m| m.event_id == id) {
                continue;
            }
            let holder = batches.values().find_map(|b| b.event_ids.iter().position(|e| e == id).map(|i| (b, i)));
            let found = match holder {
                Some((b, index)) => moves_for(b, index, leases.get(&b.id), &digests)?,
                // Not cut yet: PENDING in the lane; the cut leaves it there.
                None => vec![LaneMove { event_id: id.to_owned(), to: LaneState::Pending, claim: None }],
            };
            for m in found {
                if moves.iter().all(|x| x.event_id != m.event_id) {
                    moves.push(m);
                }
            }
        }
        move_to_lane(&mut tx, &moves, self.now_ms()).await?;
        tx.commit().await.map_err(store_err)?;
        Ok(())
    }

    /// Retention's share on the stream until partitions are dropped whole:
    /// up to `limit` stream events whose receipt was accepted before
    /// `before_ms` move to the lane as PUBLISHED, where retention retains
    /// and purges them. Returns how many moved.
    pub async fn stream_published_to_lane(&self, before_ms: i64, limit: i64) -> Result<usize, StoreError> {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT r.event_id FROM outbox_publish_receipts r
             WHERE r.batch_id IS NOT NULL AND r.envelope_generation = 1 AND r.accepted_at_ms < $1
               AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = r.event_id)
             ORDER BY r.accepted_at_ms LIMIT $2",
        )
        .bind(before_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(store_err)?;
        for id in &ids {
            self.stream_event_to_lane(id).await?;
        }
        Ok(ids.len())
    }
}
