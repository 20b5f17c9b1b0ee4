//! The stream mode of the in-memory store ([`MemoryStore::with_stream`]):
//! the happy path is the insert-only stream of `outbox_core::stream`, and
//! today's per-event machinery is its exception lane.
//!
//! - A dispatcher's claim first takes the lane's claimable events (as the
//!   claims path does), then goes round the key buckets: it holds or is
//!   granted a bucket's lease ([`grant_lease`], [`renew_lease`]), cuts the
//!   bucket's next batch when the open one is settled
//!   ([`may_cut_next_batch`]: the events whose transaction completed
//!   between the bucket's last cut and a snapshot now, [`in_batch`]), and
//!   hands out what may be sent now ([`sendable_now`]: one send in flight
//!   per key). A handed-out event's claim is the batch's: owner, the batch
//!   id as its claim generation, the bucket's lease.
//! - Registration is fenced on the event's claim and the bucket's lease
//!   ([`check_lease`]); the attempt is named by its place in the batch
//!   ([`batch_attempt_id`]).
//! - An event that leaves the happy path (a refused or unknown send, a
//!   release, a quarantine) moves to the lane, and so do the later events
//!   of its key in its batch, and any new event of a key whose earlier
//!   event is open in the lane: they wait behind it there.
//! - A bucket whose lease ran out is taken over ([`plan_takeover`]): its
//!   registered, unsettled events become DISPATCH_UNKNOWN in the lane; the
//!   rest go to the next holder as a batch of its own id.
//!
//! The event rows keep their state as the claims path writes it, so every
//! reader (the reconciler, retention, the simulator's checks) reads them
//! as before.

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::claim::{grant, is_claimable, validate_lease_ms, Claim, ClaimToken, MAX_CLAIM_BATCH};
use outbox_core::envelope::Ordering;
use outbox_core::error::CoreError;
use outbox_core::id::EventId;
use outbox_core::receipt::AttemptRecord;
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{ClaimedEvent, FenceOutcome, StoreError, SweepOutcome};
use outbox_core::stream::{
    batch_attempt_id, batch_xid_range, check_lease, grant_lease, in_batch, may_cut_next_batch, plan_takeover, release_lease, renew_lease, sendable_now, BatchEvent, BucketLease, Snapshot,
    STREAM_BUCKETS,
};

use super::transactions::snapshot_of;
use super::{MemoryEvent, MemoryState, MemoryStore};

/// The stream's records.
#[derive(Debug, Default)]
pub struct StreamState {
    /// Each bucket's lease (a bucket never held has none).
    pub leases: BTreeMap<u32, BucketLease>,
    /// Each bucket's last cut.
    pub cuts: BTreeMap<u32, Snapshot>,
    /// Each bucket's open batch.
    pub open: BTreeMap<u32, u64>,
    /// Every batch by id.
    pub batches: BTreeMap<u64, MemoryBatch>,
    /// The batch each event was last handed to.
    pub batch_of: BTreeMap<EventId, u64>,
    /// The events in the exception lane.
    pub lane: BTreeSet<EventId>,
    next_batch: u64,
    cursor: u32,
}

/// One batch of a bucket.
#[derive(Debug, Clone)]
pub struct MemoryBatch {
    /// Its bucket.
    pub bucket: u32,
    /// Who holds it.
    pub owner: String,
    /// The bucket lease's generation it runs under.
    pub generation: u64,
    /// Its events, in sequence order.
    pub events: Vec<EventId>,
    /// The indexes of the events whose attempt was registered.
    pub registered: BTreeSet<usize>,
    /// When it was cut, ms (its attempts' time).
    pub cut_at_ms: i64,
}

impl StreamState {
    fn new_batch(&mut self, batch: MemoryBatch) -> u64 {
        self.next_batch += 1;
        let id = self.next_batch;
        for e in &batch.events {
            self.batch_of.insert(e.clone(), id);
        }
        self.open.insert(batch.bucket, id);
        self.batches.insert(id, batch);
        id
    }

    /// The open batch holding `event` (not once it is in the lane).
    fn open_batch_of(&self, event: &EventId) -> Option<u64> {
        let id = *self.batch_of.get(event)?;
        let b = self.batches.get(&id)?;
        (self.open.get(&b.bucket) == Some(&id) && !self.lane.contains(event)).then_some(id)
    }
}

impl MemoryStore {
    /// This store with the insert-only stream as its happy path (see the
    /// module `stream`); the claims path otherwise.
    pub fn with_stream(self) -> Self {
        self.lock().stream = Some(StreamState::default());
        self
    }

    /// Whether the store runs the stream.
    pub fn stream_mode(&self) -> bool {
        self.lock().stream.is_some()
    }
}

impl MemoryStore {
    /// After a fenced write that took a batch event off the happy path
    /// (unknown, not sent, released, quarantined): it moves to the lane.
    pub(super) fn left_stream(&self, token: &ClaimToken, outcome: Result<FenceOutcome, StoreError>) -> Result<FenceOutcome, StoreError> {
        if matches!(outcome, Ok(FenceOutcome::Applied)) {
            let mut st = self.lock();
            with_stream(&mut st, |st, s| to_lane(st, s, &token.event_id));
        }
        outcome
    }
}

/// Runs `f` over the state and its stream records, if the store runs the stream.
pub(super) fn with_stream<T>(st: &mut MemoryState, f: impl FnOnce(&mut MemoryState, &mut StreamState) -> T) -> Option<T> {
    let mut s = st.stream.take()?;
    let out = f(st, &mut s);
    st.stream = Some(s);
    Some(out)
}

fn chain_key(ev: &MemoryEvent) -> Option<String> {
    (ev.destination.ordering == Ordering::Key).then(|| format!("{}\u{0}{}\u{0}{}", ev.destination.cluster_id, ev.destination.topic, ev.destination.routing_key))
}

fn facts(st: &MemoryState, s: &StreamState, batch: &MemoryBatch) -> Vec<BatchEvent> {
    batch
        .events
        .iter()
        .enumerate()
        .map(|(i, e)| BatchEvent { registered: batch.registered.contains(&i), receipted: st.events.get(e).is_some_and(|ev| ev.state.is_published()), in_lane: s.lane.contains(e) })
        .collect()
}

/// Moves `event` to the lane, with the later unsettled events of its key in its open batch.
pub(super) fn to_lane(st: &MemoryState, s: &mut StreamState, event: &EventId) {
    if let Some(id) = s.open_batch_of(event) {
        let batch = &s.batches[&id];
        if let Some(key) = st.events.get(event).and_then(chain_key) {
            let at = batch.events.iter().position(|e| e == event).unwrap_or(usize::MAX);
            let later: Vec<EventId> = batch
                .events
                .iter()
                .skip(at.saturating_add(1))
                .filter(|e| st.events.get(*e).is_some_and(|ev| !ev.state.is_closed() && chain_key(ev).as_ref() == Some(&key)))
                .cloned()
                .collect();
            s.lane.extend(later);
        }
    }
    s.lane.insert(event.clone());
}

/// Events of open batches that a path other than the stream's moved (a
/// receipt that quarantined, a reconciliation): into the lane.
fn sync_lane(st: &MemoryState, s: &mut StreamState) {
    let left: Vec<EventId> = s
        .open
        .values()
        .flat_map(|id| s.batches[id].events.iter())
        .filter(|e| !s.lane.contains(*e))
        .filter(|e| st.events.get(*e).is_some_and(|ev| !ev.state.is_closed() && !matches!(ev.state, EventState::Pending | EventState::Claimed | EventState::Sending)))
        .cloned()
        .collect();
    for e in left {
        to_lane(st, s, &e);
    }
}

/// Whether an earlier event of `ev`'s key is open in the lane.
fn lane_holds_key(st: &MemoryState, s: &StreamState, ev: &MemoryEvent) -> bool {
    let Some(key) = chain_key(ev) else { return false };
    s.lane.iter().filter_map(|e| st.events.get(e)).any(|o| o.seq < ev.seq && o.state.holds_key() && chain_key(o).as_ref() == Some(&key))
}

/// Takes over bucket `b`'s open batch after its lease ran out.
fn takeover(st: &mut MemoryState, s: &mut StreamState, b: u32, now: i64, out: &mut SweepOutcome) -> Result<(), StoreError> {
    let Some(&id) = s.open.get(&b) else { return Ok(()) };
    let batch = s.batches[&id].clone();
    let facts = facts(st, s, &batch);
    let plan = plan_takeover(&facts);
    for &i in &plan.unknown {
        let e = &batch.events[i];
        let Some(ev) = st.events.get_mut(e) else { continue };
        if ev.state != EventState::Sending {
            continue;
        }
        if let Some(a) = st.attempts.get_mut(e).and_then(|v| v.iter_mut().find(|a| Some(&a.attempt_id) == ev.claim.attempt_id.as_ref())) {
            if a.state == AttemptState::Sending {
                a.state = AttemptState::Unknown;
            }
        }
        MemoryStore::transition(ev, EventState::DispatchUnknown, now)?;
        ev.claim.claim_generation += 1;
        ev.claim.owner = None;
        ev.claim.lease_until_ms = None;
        out.unknown += 1;
    }
    for &i in &plan.unsent {
        let Some(ev) = st.events.get_mut(&batch.events[i]) else { continue };
        if ev.state == EventState::Claimed {
            MemoryStore::transition(ev, EventState::Pending, now)?;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            ev.claim.attempt_id = None;
            out.released += 1;
        }
    }
    // The unknowns go to the lane with the later events of their keys (the
    // batch still open, so that they follow), then the rest to the next holder.
    for &i in &plan.unknown {
        to_lane(st, s, &batch.events[i]);
    }
    s.open.remove(&b);
    let rest: Vec<usize> = (0..batch.events.len()).filter(|i| !facts[*i].settled() && !plan.unknown.contains(i) && !s.lane.contains(&batch.events[*i])).collect();
    if !rest.is_empty() {
        let registered = rest.iter().enumerate().filter(|(_, i)| batch.registered.contains(i)).map(|(n, _)| n).collect();
        s.new_batch(MemoryBatch { bucket: b, owner: String::new(), generation: 0, events: rest.iter().map(|i| batch.events[*i].clone()).collect(), registered, cut_at_ms: now });
    }
    Ok(())
}

/// Cuts bucket `b`'s next batch under `lease`.
fn cut(st: &MemoryState, s: &mut StreamState, b: u32, lease: &BucketLease, now: i64) {
    let snap = snapshot_of(st);
    let prev = s.cuts.get(&b).cloned().unwrap_or_else(Snapshot::origin);
    let range = batch_xid_range(&prev, &snap);
    let mut members: Vec<(u64, EventId)> = st
        .events
        .values()
        .filter(|e| st.created_by.get(&e.envelope.event_id).is_some_and(|x| range.contains(x) && in_batch(&prev, &snap, *x)))
        .filter(|e| st.stream_buckets.get(&e.envelope.event_id) == Some(&b))
        .map(|e| (e.seq, e.envelope.event_id.clone()))
        .collect();
    members.sort();
    s.cuts.insert(b, snap);
    let mut events = Vec::new();
    for (_, id) in members {
        if lane_holds_key(st, s, &st.events[&id]) {
            s.lane.insert(id);
        } else {
            events.push(id);
        }
    }
    if !events.is_empty() {
        s.new_batch(MemoryBatch { bucket: b, owner: lease.owner.clone().unwrap_or_default(), generation: lease.generation, events, registered: BTreeSet::new(), cut_at_ms: now });
    }
}

/// A claim in stream mode: the lane's claimable events, then the buckets'.
pub(super) fn claim(st: &mut MemoryState, s: &mut StreamState, owner: &str, limit: usize, lease_ms: i64, now: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
    validate_lease_ms(lease_ms)?;
    let limit = limit.min(MAX_CLAIM_BATCH);
    sync_lane(st, s);
    let mut out = Vec::new();
    // The lane: per-event claims, as the claims path makes them.
    let mut candidates: Vec<(u64, EventId)> =
        s.lane.iter().filter_map(|id| st.events.get(id)).filter(|e| is_claimable(e.state, e.next_check_at_ms, false, now)).map(|e| (e.seq, e.envelope.event_id.clone())).collect();
    candidates.sort();
    for (_, id) in candidates {
        if out.len() >= limit {
            break;
        }
        let ev = &st.events[&id];
        if !is_claimable(ev.state, ev.next_check_at_ms, MemoryStore::key_blocked(st, ev), now) {
            continue;
        }
        let ev = st.events.get_mut(&id).ok_or_else(|| StoreError::NotFound(id.clone()))?;
        MemoryStore::transition(ev, EventState::Claimed, now)?;
        ev.claim = grant(&ev.claim, owner, now, lease_ms);
        out.push(MemoryStore::claimed(ev, EventState::Pending));
    }
    // The buckets, from a cursor that moves on with every claim.
    let start = s.cursor;
    s.cursor = (s.cursor + 1) % STREAM_BUCKETS;
    for k in 0..STREAM_BUCKETS {
        if out.len() >= limit {
            break;
        }
        let b = (start + k) % STREAM_BUCKETS;
        let mut current = s.leases.get(&b).cloned().unwrap_or_else(|| BucketLease::vacant(b));
        // A holder with nothing in flight here (no open batch, or a settled
        // one) holds the bucket for nothing: it goes to whoever claims.
        // Nothing of it can be sent twice, and its next write is fenced by
        // the new generation.
        if current.live(now) && current.owner.as_deref() != Some(owner) {
            let idle = match s.open.get(&b) {
                None => true,
                Some(id) => may_cut_next_batch(Some(&facts(st, s, &s.batches[id]))),
            };
            if idle {
                s.open.remove(&b);
                current = BucketLease { owner: None, lease_until_ms: 0, ..current };
            }
        }
        let lease = if current.live(now) {
            if current.owner.as_deref() != Some(owner) {
                continue;
            }
            // The holder claims again, so it waits on nothing it was handed
            // here: an event still CLAIMED is one whose claim answer it lost
            // (handed out again below), one still SENDING one whose outcome
            // it lost. While any is SENDING the lease is not renewed: it
            // runs out, and the takeover makes them unknown, as a lease
            // that runs out does on the claims path.
            let open = s.open.get(&b).copied();
            let lost_outcome = open.is_some_and(|id| {
                s.batches[&id].events.iter().any(|e| st.events.get(e).is_some_and(|ev| ev.state == EventState::Sending && ev.claim.owner.as_deref() == Some(owner) && ev.claim.claim_generation == id))
            });
            if lost_outcome {
                current
            } else {
                let renewed = renew_lease(&current, owner, current.generation, now, lease_ms)?;
                if let Some(id) = open {
                    extend_claims(st, &s.batches[&id], id, renewed.lease_until_ms);
                }
                renewed
            }
        } else {
            if current.owner.is_some() {
                takeover(st, s, b, now, &mut SweepOutcome::default())?;
            }
            match grant_lease(&current, owner, now, lease_ms)? {
                Some(g) => g.lease,
                None => continue,
            }
        };
        s.leases.insert(b, lease.clone());
        // An open batch left by a takeover runs on under this lease, as a batch of its own id.
        if let Some(&id) = s.open.get(&b) {
            if s.batches[&id].generation != lease.generation {
                let mut rest = s.batches[&id].clone();
                rest.owner = owner.to_owned();
                rest.generation = lease.generation;
                rest.cut_at_ms = now;
                s.new_batch(rest);
            }
        }
        let open_facts = s.open.get(&b).map(|id| facts(st, s, &s.batches[id]));
        if may_cut_next_batch(open_facts.as_deref()) {
            s.open.remove(&b);
            cut(st, s, b, &lease, now);
        }
        let Some(&id) = s.open.get(&b) else {
            // Nothing to send: the bucket goes back.
            s.leases.insert(b, release_lease(&lease, owner, lease.generation, now)?);
            continue;
        };
        let batch = &s.batches[&id];
        let view: Vec<(Option<String>, BatchEvent, bool)> = batch
            .events
            .iter()
            .zip(facts(st, s, batch))
            .map(|(e, f)| {
                let ev = &st.events[e];
                (chain_key(ev), f, matches!(ev.state, EventState::Claimed | EventState::Sending))
            })
            .collect();
        let view: Vec<(Option<&str>, BatchEvent, bool)> = view.iter().map(|(k, f, i)| (k.as_deref(), *f, *i)).collect();
        let events = batch.events.clone();
        // Claims this holder was handed and lost the answer of: handed out again, as they are.
        for e in &events {
            if out.len() >= limit {
                break;
            }
            let ev = &st.events[e];
            if ev.state == EventState::Claimed && ev.claim.owner.as_deref() == Some(owner) && ev.claim.claim_generation == id {
                out.push(MemoryStore::claimed(ev, EventState::Pending));
            }
        }
        for i in sendable_now(&view).into_iter().take(limit.saturating_sub(out.len())) {
            let ev = st.events.get_mut(&events[i]).ok_or_else(|| StoreError::NotFound(events[i].clone()))?;
            if ev.state != EventState::Pending {
                continue;
            }
            MemoryStore::transition(ev, EventState::Claimed, now)?;
            ev.claim = Claim { owner: Some(owner.to_owned()), claim_generation: id, lease_until_ms: Some(lease.lease_until_ms), attempt_id: None };
            out.push(MemoryStore::claimed(ev, EventState::Pending));
        }
    }
    Ok(out)
}

/// Registration of a batch event (`None`: not one, the lane registers it):
/// fenced on the event's claim (the caller checked it) and on the bucket's
/// lease; the attempt is named by the event's place in its batch.
pub(super) fn register(st: &mut MemoryState, s: &mut StreamState, token: &ClaimToken, now: i64) -> Option<Result<AttemptRecord, StoreError>> {
    let id = s.open_batch_of(&token.event_id)?;
    Some((|| {
        let batch = &s.batches[&id];
        let lease = s.leases.get(&batch.bucket).cloned().unwrap_or_else(|| BucketLease::vacant(batch.bucket));
        check_lease(&lease, &token.owner, batch.generation, now, true)?;
        if token.claim_generation != id {
            return Err(CoreError::Fenced { writer_generation: token.claim_generation, current_generation: id }.into());
        }
        let index = batch.events.iter().position(|e| e == &token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
        let attempt_id = batch_attempt_id(id, index, batch.cut_at_ms.max(0) as u64)?;
        let attempt = MemoryStore::register_in(st, token, attempt_id, now)?;
        if let Some(b) = s.batches.get_mut(&id) {
            b.registered.insert(index);
        }
        Ok(attempt)
    })())
}

/// Renewal for a batch event's claim (`None`: not one): the bucket's lease,
/// and with it every handed-out event of the batch.
pub(super) fn renew(st: &mut MemoryState, s: &mut StreamState, token: &ClaimToken, lease_ms: i64, now: i64) -> Option<Result<Option<i64>, StoreError>> {
    let id = s.open_batch_of(&token.event_id)?;
    if token.claim_generation != id {
        return Some(Ok(None));
    }
    let batch = &s.batches[&id];
    let lease = s.leases.get(&batch.bucket).cloned().unwrap_or_else(|| BucketLease::vacant(batch.bucket));
    let renewed = match renew_lease(&lease, &token.owner, batch.generation, now, lease_ms) {
        Ok(l) => l,
        Err(CoreError::Fenced { .. } | CoreError::LeaseExpired { .. }) => return Some(Ok(None)),
        Err(e) => return Some(Err(e.into())),
    };
    extend_claims(st, batch, id, renewed.lease_until_ms);
    let until = renewed.lease_until_ms;
    s.leases.insert(batch.bucket, renewed);
    Some(Ok(Some(until)))
}

/// The claims of `batch`'s handed-out events follow its bucket's lease.
fn extend_claims(st: &mut MemoryState, batch: &MemoryBatch, id: u64, until: i64) {
    for e in &batch.events {
        if let Some(ev) = st.events.get_mut(e) {
            if ev.claim.claim_generation == id && ev.claim.owner.is_some() && matches!(ev.state, EventState::Claimed | EventState::Sending) {
                ev.claim.lease_until_ms = Some(until);
            }
        }
    }
}

/// The sweep in stream mode: every bucket whose lease ran out is taken over
/// (its lease vacated with the next generation). Answers the events the
/// per-event sweep must leave alone (those of open batches).
pub(super) fn expire(st: &mut MemoryState, s: &mut StreamState, now: i64, out: &mut SweepOutcome) -> Result<BTreeSet<EventId>, StoreError> {
    sync_lane(st, s);
    let expired: Vec<u32> = s.leases.iter().filter(|(_, l)| l.owner.is_some() && now >= l.lease_until_ms).map(|(b, _)| *b).collect();
    for b in expired {
        takeover(st, s, b, now, out)?;
        if let Some(l) = s.leases.get_mut(&b) {
            l.owner = None;
            l.generation += 1;
            l.lease_until_ms = 0;
        }
    }
    Ok(s.open.values().flat_map(|id| s.batches[id].events.iter()).filter(|e| !s.lane.contains(*e)).cloned().collect())
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use outbox_core::stream::{batch_position, bucket_of_key};
    use outbox_core::OutboxStore;

    use super::super::EmitTx;
    use super::*;

    const LEASE: i64 = 1_000;

    fn now<F: Future>(f: F) -> F::Output {
        match pin!(f).as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("the in-memory store never waits"),
        }
    }

    fn store() -> MemoryStore {
        let s = MemoryStore::new().with_stream();
        s.set_now_ms(1_700_000_000_000);
        s
    }

    /// Aggregates whose keys share one bucket.
    fn same_bucket(n: usize) -> Vec<String> {
        let b = bucket_of_key("t.order.o-0");
        (0..).map(|i| format!("o-{i}")).filter(|k| bucket_of_key(&format!("t.order.{k}")) == b).take(n).collect()
    }

    fn insert(s: &MemoryStore, tx: &EmitTx, aggregate: &str, version: i64) -> EventId {
        super::super::transactions::insert_order(s, tx, &format!("c-{aggregate}-{version}"), aggregate, version).unwrap()
    }

    fn claim(s: &MemoryStore, owner: &str) -> Vec<ClaimedEvent> {
        now(s.claim_batch(owner, 100, LEASE)).unwrap()
    }

    fn ids(claimed: &[ClaimedEvent]) -> Vec<EventId> {
        claimed.iter().map(|c| c.envelope.event_id.clone()).collect()
    }

    #[test]
    fn a_transaction_that_commits_after_a_cut_is_in_the_next_batch_of_its_bucket() {
        let s = store();
        let keys = same_bucket(2);
        let slow = s.begin_emit();
        let early = insert(&s, &slow, &keys[0], 1);
        let fast = s.begin_emit();
        let late = insert(&s, &fast, &keys[1], 1);
        s.commit(fast);
        // The cut sees the later position committed and the earlier one open.
        let first = claim(&s, "w1");
        assert_eq!(ids(&first), vec![late.clone()]);
        let a = now(s.register_attempt(&first[0].token)).unwrap();
        now(s.report_not_sent(&first[0].token, &a.attempt_id, "refused")).unwrap();
        s.commit(slow);
        let second = claim(&s, "w1");
        assert_eq!(ids(&second), vec![early.clone()], "the event of the transaction that committed last is not skipped");
        let b = now(s.register_attempt(&second[0].token)).unwrap();
        assert!(batch_position(&b.attempt_id).0 > batch_position(&a.attempt_id).0, "in a later batch");
        let st = s.lock();
        assert!(st.events[&early].seq < st.events[&late].seq, "an earlier position");
        assert!(st.stream.as_ref().unwrap().lane.contains(&late), "the refused send left the stream");
    }

    #[test]
    fn takeover_makes_the_registered_events_unknown_and_gives_the_unsent_to_the_new_holder() {
        let s = store();
        let keys = same_bucket(2);
        let tx = s.begin_emit();
        let sent = insert(&s, &tx, &keys[0], 1);
        let unsent = insert(&s, &tx, &keys[1], 1);
        s.commit(tx);
        let held = claim(&s, "w1");
        assert_eq!(ids(&held), vec![sent.clone(), unsent.clone()]);
        now(s.register_attempt(&held[0].token)).unwrap();
        // Another dispatcher waits while the lease runs.
        assert!(claim(&s, "w2").is_empty(), "a bucket has one holder at a time");
        s.set_now_ms(s.now_ms() + LEASE);
        let taken = claim(&s, "w2");
        assert_eq!(ids(&taken), vec![unsent.clone()]);
        assert!(taken[0].token.claim_generation > held[1].token.claim_generation);
        assert_eq!(now(s.event_state(&sent)).unwrap().0, EventState::DispatchUnknown);
        let stale = now(s.register_attempt(&held[1].token));
        assert!(matches!(&stale, Err(e) if e.is_fenced()), "the old holder is fenced: {stale:?}");
        assert!(now(s.register_attempt(&taken[0].token)).is_ok());
    }

    #[test]
    fn a_keys_second_event_waits_for_the_first_and_follows_it_into_the_lane() {
        let s = store();
        let tx = s.begin_emit();
        let first = insert(&s, &tx, "o-k", 1);
        let second = insert(&s, &tx, "o-k", 2);
        s.commit(tx);
        let claimed = claim(&s, "w1");
        assert_eq!(ids(&claimed), vec![first.clone()], "one send in flight per key");
        // Claiming again, the holder gets the first back (it claims again, so
        // it lost that answer), never the second, which waits for the first's outcome.
        assert_eq!(ids(&claim(&s, "w1")), vec![first.clone()]);
        assert!(claim(&s, "w2").is_empty(), "the bucket is w1's");
        let a = now(s.register_attempt(&claimed[0].token)).unwrap();
        now(s.report_unknown(&claimed[0].token, &a.attempt_id, "timeout")).unwrap();
        // The first is unknown in the lane; the second follows it there, and so
        // does a new event of the key, behind it.
        let tx = s.begin_emit();
        let third = insert(&s, &tx, "o-k", 3);
        s.commit(tx);
        assert!(claim(&s, "w1").is_empty(), "nothing of the key goes while its first is unknown");
        let st = s.lock();
        let lane = &st.stream.as_ref().unwrap().lane;
        assert!(lane.contains(&first) && lane.contains(&second) && lane.contains(&third), "{lane:?}");
    }
}
