//! Claims on the stream (PROTOCOL §4): bucket leases, the cut of a
//! bucket's next batch, the hand-out of what may be sent now, and the
//! takeover of a batch whose lease ran out.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering as AtomicOrdering;

use outbox_core::stream::{batch_attempt_id, grant_lease, may_cut_next_batch, plan_takeover, sendable_now, BatchEvent, BucketLease};
use outbox_core::{AttemptRecord, AttemptState, ClaimToken, ClaimedEvent, CoreError, Destination, Envelope, EventState, StoreError};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};

use super::lane::{move_to_lane, LaneAttempt, LaneClaim, LaneMove, LaneState};
use super::DispatchPath;
use crate::error::store_err;
use crate::pg::rows::parse_id;
use crate::pg::PgStore;

/// One bucket's lease row, as a claim reads and rewrites it.
#[derive(Debug, Clone)]
struct BucketRow {
    cluster_id: String,
    bucket: i16,
    owner: Option<String>,
    generation: i64,
    lease_until_ms: i64,
    prev_cut: String,
    cut: String,
    after_seq: i64,
    /// The highest seq the window's events may have (0: not known yet).
    cut_seq: i64,
    window_done: bool,
    open_batch: Option<i64>,
    /// The claim's snapshot (the same on every row), a new window's cut.
    snapshot: String,
    /// The holder before this claim.
    held_by: Option<String>,
    dirty: bool,
}

/// A log's scan floor at a cut, as registration records it for an attempt.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Floor {
    pub topic: String,
    pub topic_id: Option<String>,
    pub partition: i32,
    pub scan_from: i64,
    pub anchor: Option<String>,
    pub anchor_attempt: Option<String>,
}

/// A batch with where each of its events stands.
#[derive(Debug, Clone)]
pub(super) struct Batch {
    pub id: i64,
    pub bucket: i16,
    pub lease_generation: i64,
    pub owner: String,
    pub event_ids: Vec<String>,
    pub keys: Vec<Option<String>>,
    pub floor_of: Vec<i32>,
    pub floors: Vec<Floor>,
    pub cut_at_ms: i64,
    pub registered_db_ms: i64,
    /// Per event.
    pub facts: Vec<Facts>,
}

/// Where one event of a batch stands.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Facts {
    pub receipted: bool,
    pub in_lane: bool,
    pub handed: bool,
    pub registered: bool,
}

impl Batch {
    /// The core's view of its events.
    pub(super) fn batch_events(&self) -> Vec<BatchEvent> {
        self.facts.iter().map(|f| BatchEvent { registered: f.registered, receipted: f.receipted, in_lane: f.in_lane }).collect()
    }

    /// The attempt of its `index`-th event, as the lane records it.
    pub(super) fn attempt(&self, index: usize, destination_digest: String) -> Result<LaneAttempt, StoreError> {
        let floor = self.floor_of.get(index).and_then(|i| self.floors.get(*i as usize));
        Ok(LaneAttempt {
            attempt_id: batch_attempt_id(self.id as u64, index, self.cut_at_ms.max(0) as u64)?.to_string(),
            destination_digest,
            started_at_ms: self.cut_at_ms,
            registered_db_ms: self.registered_db_ms,
            scan_from: floor.map_or(0, |f| f.scan_from),
            scan_anchor: floor.and_then(|f| f.anchor.clone()),
            scan_anchor_attempt: floor.and_then(|f| f.anchor_attempt.clone()),
        })
    }
}

impl Batch {
    /// The attempt record of its `index`-th event, `event_id`, as the
    /// chains path's registration would have written it.
    pub(super) fn attempt_record(&self, index: usize, event_id: &str, destination_digest: String, state: AttemptState, send_deadline_ms: Option<i64>) -> Result<AttemptRecord, StoreError> {
        let a = self.attempt(index, destination_digest)?;
        Ok(AttemptRecord {
            attempt_id: a.attempt_id.parse()?,
            event_id: event_id.parse()?,
            envelope_generation: 1,
            attempt_generation: 1,
            claim_generation: self.id as u64,
            owner: self.owner.clone(),
            state,
            destination_digest: a.destination_digest,
            started_at_ms: a.started_at_ms,
            send_deadline_ms,
            scan_from_offset: a.scan_from,
            scan_anchor: a.scan_anchor.map(|s| s.parse()).transpose()?,
            scan_anchor_attempt: a.scan_anchor_attempt.map(|s| s.parse()).transpose()?,
        })
    }
}

/// Records a step (`handed` or `registered`) of each batch's `positions`:
/// one row per batch, its round the batch's next of that kind.
pub(super) async fn insert_steps(tx: &mut Transaction<'static, Postgres>, kind: &str, steps: &[(i64, Vec<usize>)], now: i64) -> Result<(), StoreError> {
    if steps.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO outbox_batch_steps (batch_id, kind, round, positions, at_ms)
         SELECT t.batch_id, $3, coalesce((SELECT max(s.round) FROM outbox_batch_steps s WHERE s.batch_id = t.batch_id AND s.kind = $3), 0) + 1,
                t.positions::int[], $4
         FROM UNNEST($1::bigint[], $2::text[]) AS t(batch_id, positions)",
    )
    .bind(steps.iter().map(|s| s.0).collect::<Vec<_>>())
    .bind(steps.iter().map(|s| format!("{{{}}}", s.1.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","))).collect::<Vec<_>>())
    .bind(kind)
    .bind(now)
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}

/// Reads batches `ids` with their steps, and, when `settled`, whether each
/// event has a receipt or a lane row.
pub(super) async fn load_batches(tx: &mut Transaction<'static, Postgres>, ids: &[i64], settled: bool) -> Result<BTreeMap<i64, Batch>, StoreError> {
    let mut out = BTreeMap::new();
    if ids.is_empty() {
        return Ok(out);
    }
    let g = |e: sqlx::Error| store_err(e);
    // One statement: each batch with, per event, whether it has a receipt
    // or a lane row (when `settled`), and its positions of each step kind.
    for r in sqlx::query(
        "SELECT b.id, b.cluster_id, b.bucket, b.lease_generation, b.owner, b.event_ids, b.keys, b.floor_of, b.floors, b.cut_at_ms, b.registered_db_ms,
                CASE WHEN $2 THEN ARRAY(SELECT EXISTS (SELECT 1 FROM outbox_publish_receipts p WHERE p.event_id = x.event_id AND p.envelope_generation = 1)
                                        FROM unnest(b.event_ids) WITH ORDINALITY AS x(event_id, pos) ORDER BY x.pos) END AS receipted,
                CASE WHEN $2 THEN ARRAY(SELECT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = x.event_id)
                                        FROM unnest(b.event_ids) WITH ORDINALITY AS x(event_id, pos) ORDER BY x.pos) END AS in_lane,
                ARRAY(SELECT p FROM outbox_batch_steps s CROSS JOIN unnest(s.positions) p WHERE s.batch_id = b.id AND s.kind = 'registered') AS registered,
                ARRAY(SELECT p FROM outbox_batch_steps s CROSS JOIN unnest(s.positions) p WHERE s.batch_id = b.id AND s.kind = 'handed') AS handed
         FROM outbox_batches b WHERE b.id = ANY($1)",
    )
    .bind(ids)
    .bind(settled)
    .fetch_all(&mut **tx)
    .await
    .map_err(g)?
    {
        let event_ids: Vec<String> = r.try_get("event_ids").map_err(g)?;
        let floors: Vec<Floor> = serde_json::from_value(r.try_get("floors").map_err(g)?).map_err(|e| CoreError::InvalidEncoding(format!("batch floors: {e}")))?;
        let mut facts = vec![Facts::default(); event_ids.len()];
        let receipted: Option<Vec<bool>> = r.try_get("receipted").map_err(g)?;
        let in_lane: Option<Vec<bool>> = r.try_get("in_lane").map_err(g)?;
        for (f, x) in facts.iter_mut().zip(receipted.unwrap_or_default()) {
            f.receipted = x;
        }
        for (f, x) in facts.iter_mut().zip(in_lane.unwrap_or_default()) {
            f.in_lane = x;
        }
        for p in r.try_get::<Vec<i32>, _>("registered").map_err(g)? {
            if let Some(f) = facts.get_mut(p as usize) {
                f.registered = true;
            }
        }
        for p in r.try_get::<Vec<i32>, _>("handed").map_err(g)? {
            if let Some(f) = facts.get_mut(p as usize) {
                f.handed = true;
            }
        }
        let b = Batch {
            id: r.try_get("id").map_err(g)?,
            bucket: r.try_get("bucket").map_err(g)?,
            lease_generation: r.try_get("lease_generation").map_err(g)?,
            owner: r.try_get("owner").map_err(g)?,
            facts,
            event_ids,
            keys: r.try_get("keys").map_err(g)?,
            floor_of: r.try_get("floor_of").map_err(g)?,
            floors,
            cut_at_ms: r.try_get("cut_at_ms").map_err(g)?,
            registered_db_ms: r.try_get("registered_db_ms").map_err(g)?,
        };
        out.insert(b.id, b);
    }
    Ok(out)
}

/// Moves the unsettled events of batches whose lease ran out to the lane:
/// the registered ones DISPATCH_UNKNOWN (they may be in the log), the
/// others PENDING (nothing of them was sent).
pub(super) async fn take_over(tx: &mut Transaction<'static, Postgres>, batches: &BTreeMap<i64, Batch>, now: i64) -> Result<usize, StoreError> {
    let mut moves = Vec::new();
    for b in batches.values() {
        let plan = plan_takeover(&b.batch_events());
        let digests = destination_digests(tx, &plan.unknown.iter().map(|i| b.event_ids[*i].as_str()).collect::<Vec<_>>()).await?;
        for i in plan.unknown {
            let digest = digests.get(&b.event_ids[i]).cloned().unwrap_or_default();
            let claim = LaneClaim { owner: b.owner.clone(), batch_id: b.id, lease_until_ms: now, attempt: Some(b.attempt(i, digest)?) };
            moves.push(LaneMove { event_id: b.event_ids[i].clone(), to: LaneState::Unknown, claim: Some(claim) });
        }
        for i in plan.unsent {
            let claim = LaneClaim { owner: b.owner.clone(), batch_id: b.id, lease_until_ms: now, attempt: None };
            moves.push(LaneMove { event_id: b.event_ids[i].clone(), to: LaneState::Pending, claim: Some(claim) });
        }
    }
    if !moves.is_empty() {
        tracing::info!(events = moves.len(), batches = batches.len(), "stream batches taken over after their lease ran out: their open events go to the exception lane");
    }
    move_to_lane(tx, &moves, now).await.map(|m| m.len())
}

/// Gives every cluster routed to (of `scope`, or all) its buckets' lease
/// rows, which the claims find work by.
pub(super) async fn ensure_leases<'e>(executor: impl sqlx::PgExecutor<'e>, scope: Option<&str>) -> Result<(), StoreError> {
    sqlx::query(
        "WITH made AS (
             INSERT INTO outbox_bucket_slots (cluster_id, bucket)
             SELECT c.cluster_id, b::smallint FROM (SELECT DISTINCT cluster_id FROM outbox_route_policies WHERE $1::text IS NULL OR cluster_id = $1) c
             CROSS JOIN generate_series(0, 63) b
             ON CONFLICT DO NOTHING
             RETURNING cluster_id, bucket)
         INSERT INTO outbox_bucket_lease_log (cluster_id, bucket) SELECT cluster_id, bucket FROM made",
    )
    .bind(scope)
    .execute(executor)
    .await
    .map_err(store_err)?;
    Ok(())
}

/// The frozen destination digest of stream events.
pub(super) async fn destination_digests(tx: &mut Transaction<'static, Postgres>, ids: &[&str]) -> Result<HashMap<String, String>, StoreError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    sqlx::query("SELECT event_id, destination_digest FROM outbox_stream WHERE event_id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
        .map_err(store_err)?
        .iter()
        .map(|r| Ok((r.try_get("event_id").map_err(store_err)?, r.try_get("destination_digest").map_err(store_err)?)))
        .collect()
}

/// The most rows of one bucket's window a claim reads. A batch holds one
/// event per key, so a bucket of a few keys gives a few events per batch:
/// reading far more than that per round is read again next round (256
/// rows read per 16 taken cost 11 ms per claim at 1,000 keys).
pub(super) const PER_BUCKET: usize = 64;

/// A row of `outbox_stream_window`.
struct WindowRow {
    ord: i32,
    seq: i64,
    event_id: String,
    key: Option<String>,
    key_chain: i64,
    to_lane: bool,
    topic: String,
    topic_id: Option<String>,
    partition: i32,
    /// The bound of its window's seqs (`cut_seq`).
    upto: i64,
    /// Its row of the window's answer, which carries what a send needs
    /// (a batch's events are handed out from it without a second read).
    row: usize,
}

/// A batch about to be inserted.
struct NewBatch {
    bucket: usize,
    rows: Vec<WindowRow>,
}

impl PgStore {
    /// The first read of a claim: whether the stream may have anything to
    /// claim (it is the dispatch path, or it still holds events not yet
    /// cut, open batches, or a window not read to its end: events emitted
    /// on the stream drain on it after a switch back to the chains path,
    /// whatever commits late), and whether the chains machinery may (always
    /// on the chains path; on the stream, only while the exception lane
    /// holds arrivals to link, PENDING or retry events, or claimable chain
    /// heads). A claim on the stream with a quiet lane skips the chains
    /// path's four statements.
    pub(crate) async fn claim_paths(&self, tx: &mut Transaction<'static, Postgres>) -> Result<(DispatchPath, bool), StoreError> {
        let (stream, lane_busy): (bool, bool) = sqlx::query_as("SELECT stream, lane_busy FROM outbox_claim_paths($1)")
        .bind(self.cluster_scope.as_deref())
        .fetch_one(&mut **tx)
        .await
        .map_err(store_err)?;
        let path = if stream { DispatchPath::Stream } else { DispatchPath::Chains };
        self.path_seen.set(path);
        Ok((path, lane_busy))
    }

    /// The stream's share of a claim of up to `limit` events by `owner`, in
    /// `tx`: nothing unless the stream may have work (`claim_paths`).
    pub(crate) async fn claim_stream_in(&self, tx: &mut Transaction<'static, Postgres>, path: DispatchPath, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        if path != DispatchPath::Stream || limit == 0 {
            return Ok(Vec::new());
        }
        let now = self.now_ms();
        if self.stream_rounds.fetch_add(1, AtomicOrdering::Relaxed).is_multiple_of(256) {
            ensure_leases(&mut **tx, self.cluster_scope.as_deref()).await?;
        }
        let g = |e: sqlx::Error| store_err(e);
        let mut buckets: Vec<BucketRow> = sqlx::query(
            "SELECT * FROM outbox_stream_claim_leases($1, $2, $3)",
        )
        .bind(self.cluster_scope.as_deref())
        .bind(owner)
        .bind(now)
        .fetch_all(&mut **tx)
        .await
        .map_err(g)?
        .iter()
        .map(|r| {
            Ok(BucketRow {
                cluster_id: r.try_get("cluster_id")?,
                bucket: r.try_get("bucket")?,
                owner: r.try_get("owner")?,
                generation: r.try_get("generation")?,
                lease_until_ms: r.try_get("lease_until_ms")?,
                prev_cut: r.try_get("prev_cut")?,
                cut: r.try_get("cut")?,
                after_seq: r.try_get("after_seq")?,
                cut_seq: r.try_get("cut_seq")?,
                window_done: r.try_get("window_done")?,
                open_batch: r.try_get("open_batch")?,
                snapshot: r.try_get("snapshot")?,
                held_by: r.try_get("owner")?,
                dirty: false,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(g)?;
        if buckets.is_empty() {
            return Ok(Vec::new());
        }
        // Each round starts at another bucket, so a small limit serves them all in turn.
        let turn = self.stream_rounds.load(AtomicOrdering::Relaxed) as usize % buckets.len();
        buckets.rotate_left(turn);

        // The leases: granted where vacant or run out; an open batch under a
        // lease that ran out is taken over.
        //
        // A lease this owner holds, running, is NOT renewed here merely
        // because the owner claims again: that it claims says nothing about
        // the batch's hand-outs. If an earlier claim's answer was lost (its
        // COMMIT's answer dropped with the connection), its hand-outs reached
        // nobody, nobody registers them, and `sendable_now` never hands them
        // out again; a claim round renewing its own live leases would keep
        // that batch open for ever under the same owner name (no takeover,
        // its events CLAIMED, its bucket's later events PENDING). So the
        // lease of an open batch lives on only by work on it:
        // - the dispatcher renews the lease of the sends it has in flight
        //   (`renew_stream`, every half lease while answers are outstanding);
        // - a claim round that hands events of the bucket out, or could but
        //   has no room left, renews it below (`renew_for`): that answer's
        //   tokens carry the lease, and the dispatcher that gets them renews
        //   from then on.
        // A lease nobody renews runs out and is taken over (by anyone, this
        // owner too): the generation goes up, the open batch is abandoned,
        // its handed-out unregistered events go to the lane PENDING and its
        // registered ones DISPATCH_UNKNOWN (`take_over`). A late
        // registration of a lost hand-out is fenced: the lease's open batch
        // and generation are no longer the batch's (`register_stream`).
        let mut abandoned = Vec::new();
        for b in buckets.iter_mut() {
            let current = BucketLease { bucket: b.bucket as u32, owner: b.owner.clone(), generation: b.generation as u64, lease_until_ms: b.lease_until_ms };
            if current.owner.as_deref() == Some(owner) && current.live(now) {
                continue;
            }
            let Some(grant) = grant_lease(&current, owner, now, lease_ms)? else { continue };
            b.owner = grant.lease.owner;
            b.generation = grant.lease.generation as i64;
            b.lease_until_ms = grant.lease.lease_until_ms;
            b.dirty = true;
            if let Some(open) = b.open_batch.take() {
                abandoned.push(open);
            }
        }
        if !abandoned.is_empty() {
            let batches = load_batches(tx, &abandoned, true).await?;
            take_over(tx, &batches, now).await?;
        }

        // Open batches: close the settled, hand out what may go now.
        let mut remaining = limit.min(outbox_core::claim::MAX_CLAIM_BATCH);
        let open_ids: Vec<i64> = buckets.iter().filter_map(|b| b.open_batch).collect();
        let open = load_batches(tx, &open_ids, true).await?;
        let mut handouts: Vec<(i64, Vec<usize>)> = Vec::new();
        for b in buckets.iter_mut() {
            let Some(batch) = b.open_batch.and_then(|id| open.get(&id)) else { continue };
            let events = batch.batch_events();
            if may_cut_next_batch(Some(&events)) {
                b.open_batch = None;
                b.dirty = true;
                continue;
            }
            let input: Vec<(Option<&str>, BatchEvent, bool)> = batch.keys.iter().zip(&events).zip(&batch.facts).map(|((k, e), f)| (k.as_deref(), *e, f.handed)).collect();
            let mut go = sendable_now(&input);
            // Events that may go now but find no room in this claim wait for
            // this owner's next one: nothing of the batch is in anyone's
            // hands, so the owner is the one working on it, and keeps it.
            let only_waiting = !go.is_empty() && !batch.facts.iter().zip(&events).any(|(f, e)| f.handed && !e.settled());
            go.truncate(remaining);
            remaining -= go.len();
            if !go.is_empty() {
                renew_for(b, now, lease_ms);
                handouts.push((batch.id, go));
            } else if only_waiting && b.lease_until_ms - now < lease_ms / 2 {
                renew_for(b, now, lease_ms);
            }
        }

        // New batches for buckets with none open.
        let mut new_batches: Vec<NewBatch> = Vec::new();
        let mut window_rows: Vec<PgRow> = Vec::new();
        let mut to_lane: Vec<LaneMove> = Vec::new();
        let candidates: Vec<usize> = (0..buckets.len()).filter(|i| buckets[*i].open_batch.is_none()).collect();
        if remaining > 0 && !candidates.is_empty() {
            let snapshot = buckets[0].snapshot.clone();
            let windows: Vec<(String, String, i64, i64)> = candidates
                .iter()
                .map(|i| {
                    let b = &buckets[*i];
                    if b.window_done {
                        (b.cut.clone(), snapshot.clone(), 0, 0)
                    } else {
                        (b.prev_cut.clone(), b.cut.clone(), b.after_seq, b.cut_seq)
                    }
                })
                .collect();
            // A batch is a run of its window with one event per key (each
            // handed out at once); a bucket's read is bounded by a batch's
            // most (PER_BUCKET), the claim's by a few limits' worth.
            let read_limit = (remaining * 4).min(outbox_core::claim::MAX_CLAIM_BATCH * 4);
            let per_bucket: Vec<usize> = candidates.iter().map(|i| remaining.min(self.window_reads.size(&buckets[*i].cluster_id, buckets[*i].bucket))).collect();
            let rows = sqlx::query(
                "SELECT * FROM outbox_stream_window($1::text[], $2::smallint[], $3::text[]::pg_snapshot[], $4::text[]::pg_snapshot[], $5::bigint[], $6::bigint[], $7, $8::int[], $9)",
            )
            .bind(candidates.iter().map(|i| buckets[*i].cluster_id.as_str()).collect::<Vec<_>>())
            .bind(candidates.iter().map(|i| buckets[*i].bucket).collect::<Vec<_>>())
            .bind(windows.iter().map(|w| w.0.as_str()).collect::<Vec<_>>())
            .bind(windows.iter().map(|w| w.1.as_str()).collect::<Vec<_>>())
            .bind(windows.iter().map(|w| w.2).collect::<Vec<_>>())
            .bind(windows.iter().map(|w| w.3).collect::<Vec<_>>())
            .bind(read_limit as i32)
            .bind(per_bucket.iter().map(|n| *n as i32).collect::<Vec<_>>())
            .bind(self.max_protocol_version)
            .fetch_all(&mut **tx)
            .await
            .map_err(g)?;
            let mut by_ord: BTreeMap<i32, Vec<WindowRow>> = BTreeMap::new();
            for (row, r) in rows.iter().enumerate() {
                let ordered: bool = r.try_get("ordered").map_err(g)?;
                let w = WindowRow {
                    ord: r.try_get("ord").map_err(g)?,
                    seq: r.try_get("seq").map_err(g)?,
                    event_id: r.try_get("event_id").map_err(g)?,
                    key: if ordered { Some(r.try_get("routing_key").map_err(g)?) } else { None },
                    key_chain: r.try_get("key_chain").map_err(g)?,
                    to_lane: r.try_get("to_lane").map_err(g)?,
                    topic: r.try_get("topic").map_err(g)?,
                    topic_id: r.try_get("topic_id").map_err(g)?,
                    partition: r.try_get("partition").map_err(g)?,
                    upto: r.try_get("upto").map_err(g)?,
                    row,
                };
                by_ord.entry(w.ord).or_default().push(w);
            }
            window_rows = rows;
            let mut left_to_read = read_limit;
            let mut left = remaining;
            for (n, i) in candidates.iter().enumerate() {
                if left == 0 || left_to_read == 0 {
                    break;
                }
                let given = left_to_read.min(per_bucket[n]);
                let read = by_ord.remove(&(n as i32 + 1)).unwrap_or_default();
                left_to_read -= read.len().min(left_to_read);
                // The run with one event per key (an unordered event never
                // repeats a key), at most what the claim still takes.
                let mut keys = std::collections::HashSet::new();
                let mut found = Vec::new();
                let mut taken = 0;
                let mut repeat = false;
                for w in read.iter() {
                    let sendable = !w.to_lane && (w.key.is_none() || keys.insert(w.key_chain));
                    if sendable && taken == left {
                        break;
                    }
                    if w.key.is_some() && !sendable && !w.to_lane {
                        repeat = true;
                        break;
                    }
                    taken += usize::from(sendable);
                    found.push(w.seq);
                }
                self.window_reads.learn(&buckets[*i].cluster_id, buckets[*i].bucket, given, read.len(), found.len(), repeat);
                let stopped_early = found.len() < read.len();
                let truncated = stopped_early || read.len() == given;
                let found: Vec<WindowRow> = read.into_iter().take(found.len()).collect();
                left -= taken;
                let b = &mut buckets[*i];
                if found.is_empty() {
                    if !b.window_done {
                        // The window ran out exactly at the last batch's end.
                        b.window_done = true;
                        b.after_seq = 0;
                        b.cut_seq = 0;
                        b.dirty = true;
                    }
                    // An empty new window is not written: the next cut starts where this one did.
                    continue;
                }
                let (prev, cut, _, _) = windows[n].clone();
                b.prev_cut = prev;
                b.cut = cut;
                b.after_seq = if truncated { found.last().map_or(0, |w| w.seq) } else { 0 };
                b.cut_seq = if truncated { found.last().map_or(0, |w| w.upto) } else { 0 };
                b.window_done = !truncated;
                b.dirty = true;
                // A key with an open event in the lane waits there, and so do its later events.
                let mut lane_keys = std::collections::HashSet::new();
                let mut batch_rows = Vec::new();
                for w in found {
                    let behind = w.key.is_some() && lane_keys.contains(&w.key_chain);
                    if w.to_lane || behind {
                        if w.key.is_some() {
                            lane_keys.insert(w.key_chain);
                        }
                        to_lane.push(LaneMove { event_id: w.event_id, to: LaneState::Pending, claim: None });
                    } else {
                        batch_rows.push(w);
                    }
                }
                if !batch_rows.is_empty() {
                    new_batches.push(NewBatch { bucket: *i, rows: batch_rows });
                }
            }
        }
        move_to_lane(tx, &to_lane, now).await?;

        // Insert the new batches (their registration) with their logs' scan
        // floors: one statement for the floors, one for the batches.
        // Each log once in `all_floors` (batches of one claim share their
        // logs); per batch, the logs it uses (`mine`, indexes into
        // `all_floors`) and each event's entry among them (`floor_of`).
        let mut all_floors: Vec<(String, Floor)> = Vec::new();
        let mut log_index: HashMap<(String, String, Option<String>, i32), usize> = HashMap::new();
        let mut shapes: Vec<(Vec<usize>, Vec<i32>)> = Vec::with_capacity(new_batches.len());
        for nb in &new_batches {
            let cluster = &buckets[nb.bucket].cluster_id;
            let mut mine: Vec<usize> = Vec::new();
            let mut floor_of: Vec<i32> = Vec::with_capacity(nb.rows.len());
            for w in &nb.rows {
                let log = *log_index.entry((cluster.clone(), w.topic.clone(), w.topic_id.clone(), w.partition)).or_insert_with(|| {
                    all_floors.push((cluster.clone(), Floor { topic: w.topic.clone(), topic_id: w.topic_id.clone(), partition: w.partition, scan_from: 0, anchor: None, anchor_attempt: None }));
                    all_floors.len() - 1
                });
                let at = mine.iter().position(|f| *f == log).unwrap_or_else(|| {
                    mine.push(log);
                    mine.len() - 1
                });
                floor_of.push(at as i32);
            }
            shapes.push((mine, floor_of));
        }
        fill_floors(tx, &mut all_floors).await?;
        if !new_batches.is_empty() {
            let mut input = Vec::with_capacity(new_batches.len());
            for (nb, (mine, floor_of)) in new_batches.iter().zip(&shapes) {
                let b = &buckets[nb.bucket];
                let floors: Vec<&Floor> = mine.iter().map(|f| &all_floors[*f].1).collect();
                input.push(serde_json::json!({
                    "cluster_id": b.cluster_id, "bucket": b.bucket, "lease_generation": b.generation, "prev_cut": b.prev_cut, "cut": b.cut,
                    "after_seq": b.after_seq, "event_ids": nb.rows.iter().map(|w| w.event_id.as_str()).collect::<Vec<_>>(),
                    "keys": nb.rows.iter().map(|w| w.key.as_deref()).collect::<Vec<_>>(), "floor_of": floor_of, "floors": floors,
                }));
            }
            let ids: HashMap<(String, i16), i64> = sqlx::query(
                "INSERT INTO outbox_batches (cluster_id, bucket, lease_generation, owner, prev_cut, cut, after_seq, event_ids, keys, floor_of, cut_at_ms, floors)
                 SELECT t.cluster_id, t.bucket, t.lease_generation, $2, t.prev_cut::pg_snapshot, t.cut::pg_snapshot, t.after_seq, t.event_ids, t.keys,
                        t.floor_of, $3, t.floors
                 FROM jsonb_to_recordset($1) AS t(cluster_id text, bucket smallint, lease_generation bigint, prev_cut text, cut text, after_seq bigint,
                                                  event_ids text[], keys text[], floor_of integer[], floors jsonb)
                 RETURNING id, cluster_id, bucket",
            )
            .bind(serde_json::Value::Array(input))
            .bind(owner)
            .bind(now)
            .fetch_all(&mut **tx)
            .await
            .map_err(g)?
            .iter()
            .map(|r| Ok(((r.try_get("cluster_id")?, r.try_get("bucket")?), r.try_get("id")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(g)?;
            for nb in &new_batches {
                let b = &buckets[nb.bucket];
                let id = *ids.get(&(b.cluster_id.clone(), b.bucket)).ok_or_else(|| StoreError::Backend { message: "a batch insert returned no id".into(), retryable: false })?;
                buckets[nb.bucket].open_batch = Some(id);
                renew_for(&mut buckets[nb.bucket], now, lease_ms);
                let input: Vec<(Option<&str>, BatchEvent, bool)> = nb.rows.iter().map(|w| (w.key.as_deref(), BatchEvent::default(), false)).collect();
                handouts.push((id, sendable_now(&input)));
            }
        }

        // The hand-outs, one step row per batch.
        let handouts: Vec<(i64, Vec<usize>)> = handouts.into_iter().filter(|(_, p)| !p.is_empty()).collect();
        insert_steps(tx, "handed", &handouts, now).await?;

        // A bucket with nothing open goes back: it is written only when
        // somebody held it or its window moved.
        for b in buckets.iter_mut().filter(|b| b.open_batch.is_none()) {
            if b.held_by.is_some() {
                b.dirty = true;
            }
            b.owner = None;
            b.lease_until_ms = 0;
        }
        // The lease states that changed.
        let dirty: Vec<&BucketRow> = buckets.iter().filter(|b| b.dirty).collect();
        if !dirty.is_empty() {
            // A new state row per bucket (the lease log is insert-only: no
            // row version for a held snapshot to keep), under the slots'
            // locks this claim holds.
            sqlx::query(
                "SELECT outbox_bucket_lease_write($1::text[], $2::smallint[], $3::text[], $4::bigint[], $5::bigint[], $6::text[], $7::text[], $8::bigint[],
                                                  $9::bigint[], $10::bool[], $11::bigint[])",
            )
            .bind(dirty.iter().map(|b| b.cluster_id.as_str()).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.bucket).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.owner.as_deref()).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.generation).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.lease_until_ms).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.prev_cut.as_str()).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.cut.as_str()).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.after_seq).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.cut_seq).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.window_done).collect::<Vec<_>>())
            .bind(dirty.iter().map(|b| b.open_batch).collect::<Vec<_>>())
            .execute(&mut **tx)
            .await
            .map_err(g)?;
        }

        // The events handed out, to send.
        let lease_of: HashMap<i64, i64> = buckets.iter().filter_map(|b| b.open_batch.map(|id| (id, b.lease_until_ms))).collect();
        // A new batch's events come with the window's answer; an open
        // batch's are read here.
        let mut claimed: Vec<(i64, ClaimedEvent)> = Vec::new();
        let mut wanted: Vec<(String, i64)> = Vec::new();
        for (id, positions) in &handouts {
            let lease = lease_of.get(id).copied().unwrap_or(now);
            match open.get(id) {
                Some(b) => wanted.extend(positions.iter().map(|p| (b.event_ids[*p].clone(), *id))),
                None => {
                    let nb = new_batches.iter().find(|nb| buckets[nb.bucket].open_batch == Some(*id));
                    for w in positions.iter().filter_map(|p| nb.and_then(|nb| nb.rows.get(*p))) {
                        claimed.push((w.seq, claimed_event(&window_rows[w.row], owner, *id, lease)?));
                    }
                }
            }
        }
        if !wanted.is_empty() {
            let rows = sqlx::query(
                "SELECT seq, event_id, envelope_canonical, destination_canonical, destination_digest, payload, payload_digest, traceparent, tracestate
                 FROM outbox_stream WHERE event_id = ANY($1)",
            )
            .bind(wanted.iter().map(|w| w.0.as_str()).collect::<Vec<_>>())
            .fetch_all(&mut **tx)
            .await
            .map_err(g)?;
            let batch_of: HashMap<&str, i64> = wanted.iter().map(|(e, b)| (e.as_str(), *b)).collect();
            for r in &rows {
                let id: &str = r.try_get("event_id").map_err(g)?;
                let batch = batch_of.get(id).copied().unwrap_or_default();
                claimed.push((r.try_get("seq").map_err(g)?, claimed_event(r, owner, batch, lease_of.get(&batch).copied().unwrap_or(now))?));
            }
        }
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        claimed.sort_by_key(|c| c.0);
        let mut claimed: Vec<ClaimedEvent> = claimed.into_iter().map(|c| c.1).collect();
        self.cloudevents.attach(tx, &mut claimed).await?;
        Ok(claimed)
    }
}

/// Renews `b`'s lease (held by the claiming owner) for a claim that hands
/// out events of its open batch: a full lease from now, so that the
/// answer's tokens outlive the dispatcher's registration and its first
/// renewal (half a lease after its sends start). The only renewal a claim
/// round makes: see the lease loop of `claim_stream_in` for why a claim
/// does not renew a lease it holds otherwise.
fn renew_for(b: &mut BucketRow, now: i64, lease_ms: i64) {
    b.lease_until_ms = b.lease_until_ms.max(now.saturating_add(lease_ms));
    b.dirty = true;
}

/// A handed-out stream row as an event to send, under its batch's claim.
fn claimed_event(r: &PgRow, owner: &str, batch: i64, lease_until_ms: i64) -> Result<ClaimedEvent, StoreError> {
    let g = |e: sqlx::Error| store_err(e);
    let envelope = Envelope::from_canonical(r.try_get::<&[u8], _>("envelope_canonical").map_err(g)?)?;
    let destination = Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical").map_err(g)?)?;
    let event_id = parse_id(r.try_get::<&str, _>("event_id").map_err(g)?)?;
    Ok(ClaimedEvent {
        token: ClaimToken { event_id, owner: owner.to_owned(), claim_generation: batch as u64, lease_until_ms },
        envelope,
        destination,
        destination_digest: r.try_get("destination_digest").map_err(g)?,
        payload: r.try_get("payload").map_err(g)?,
        event_payload_digest: r.try_get("payload_digest").map_err(g)?,
        claimed_from: EventState::Pending,
        traceparent: r.try_get("traceparent").map_err(g)?,
        tracestate: r.try_get("tracestate").map_err(g)?,
        cloudevents: None,
        source: None,
    })
}

/// Each log's scan floor (`floors` holds each log once; `outbox_log_floor`,
/// as the chains path's registration reads it).
async fn fill_floors(tx: &mut Transaction<'static, Postgres>, floors: &mut [(String, Floor)]) -> Result<(), StoreError> {
    if floors.is_empty() {
        return Ok(());
    }
    let g = |e: sqlx::Error| store_err(e);
    let rows = sqlx::query(
        "SELECT (p.ord - 1)::int AS i, f.scan_from, f.scan_anchor AS event_id, f.scan_anchor_attempt AS attempt_id
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int[]) WITH ORDINALITY AS p(cluster_id, topic, topic_id, partition, ord)
         CROSS JOIN LATERAL outbox_log_floor(p.cluster_id, p.topic, p.topic_id, p.partition) f",
    )
    .bind(floors.iter().map(|f| f.0.as_str()).collect::<Vec<_>>())
    .bind(floors.iter().map(|f| f.1.topic.as_str()).collect::<Vec<_>>())
    .bind(floors.iter().map(|f| f.1.topic_id.as_deref()).collect::<Vec<_>>())
    .bind(floors.iter().map(|f| f.1.partition).collect::<Vec<_>>())
    .fetch_all(&mut **tx)
    .await
    .map_err(g)?;
    for r in rows {
        let i: i32 = r.try_get("i").map_err(g)?;
        if let Some((_, f)) = floors.get_mut(i as usize) {
            f.scan_from = r.try_get("scan_from").map_err(g)?;
            f.anchor = r.try_get("event_id").map_err(g)?;
            f.anchor_attempt = r.try_get("attempt_id").map_err(g)?;
        }
    }
    Ok(())
}
