//! An in-memory [`OutboxStore`] over the same decisions as the PostgreSQL
//! store. The simulator and the conformance suite use it; it keeps every
//! record the PostgreSQL schema keeps (attempts, primary and duplicate
//! receipts, quarantine, audit), with a clock the caller sets.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use crate::command::{decide_command, Command, CommandDecision, CommandRefusal};
use crate::claim::{check_fence, check_registration, grant, is_claimable, validate_lease_ms, Claim, ClaimToken, FencedWrite, MAX_CLAIM_BATCH};
use crate::envelope::{Destination, Envelope, Ordering};
use crate::error::CoreError;
use crate::id::{AttemptId, EventId};
use crate::receipt::{decide_receipt, AttemptRecord, BrokerReceipt, LockedEvent, ReceiptDecision};
use crate::state::{AttemptState, EventState};
use crate::reconcile::{plan_reconcile_finish, ReconcileDecision, RetryPolicy, OPEN_ATTEMPT_STATES, RECONCILE_CLAIM, RECONCILE_FROM};
use crate::migration::{check_migration_fence, decide_migration, MigrationDecision, MigrationFence, MigrationProof};
use crate::store::{ClaimedEvent, FenceOutcome, LookupOutcome, OutboxStore, ReceiptOutcome, ReconcileTask, StoreError, SweepOutcome};

/// One event row.
#[derive(Debug, Clone)]
pub struct MemoryEvent {
    /// Commit order.
    pub seq: u64,
    /// Frozen envelope.
    pub envelope: Envelope,
    /// Frozen destination.
    pub destination: Destination,
    /// Its digest.
    pub destination_digest: String,
    /// Stored payload.
    pub payload: Vec<u8>,
    /// State.
    pub state: EventState,
    /// Claim columns.
    pub claim: Claim,
    /// Highest attempt generation so far.
    pub attempt_generation: u32,
    /// The publish slot.
    pub slot: Option<BrokerReceipt>,
    /// When the event entered its current state, ms.
    pub state_since_ms: i64,
    /// When a DISPATCH_UNKNOWN event is due for reconciliation, ms.
    pub next_check_at_ms: i64,
    /// When it first became DISPATCH_UNKNOWN (kept until resolved), ms.
    pub unknown_since_ms: Option<i64>,
    /// When the publish slot was filled, ms (the replay window counts from here).
    pub published_at_ms: Option<i64>,
    /// How long each of its unknown outcomes took to resolve (from
    /// DISPATCH_UNKNOWN to PUBLISHED, QUARANTINED or PENDING), ms: the
    /// release gate's UNKNOWN time-to-resolution.
    pub unknown_resolved_after_ms: Vec<i64>,
    /// When it was committed, ms.
    pub created_at_ms: i64,
}

/// A migration receipt (PROTOCOL §7): links envelope generation N (kept as it
/// was, never edited) to N + 1 with its new frozen destination, with the proof.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrationRecord {
    /// Event moved.
    pub event_id: EventId,
    /// Generation left behind.
    pub from_generation: u32,
    /// New generation (`from_generation + 1`).
    pub to_generation: u32,
    /// The envelope of the generation left behind, as it was frozen.
    pub from_envelope: Envelope,
    /// Its frozen destination.
    pub from_destination: Destination,
    /// Its digest.
    pub from_destination_digest: String,
    /// The new frozen destination.
    pub to_destination: Destination,
    /// Its digest.
    pub to_destination_digest: String,
    /// Why the old target does not hold the event.
    pub proof: MigrationProof,
    /// Who asked.
    pub operator: String,
    /// When, ms.
    pub at_ms: i64,
    /// Attempts of the old generation closed ABSENT by the move (only under `ProvenAbsent`).
    pub closed_attempts: Vec<AttemptId>,
}

/// One consumer's published watermark on one log, as retention reads it:
/// the store traits' [`ConsumerWatermark`](crate::ConsumerWatermark), under
/// the name the in-memory store's callers know.
pub type MemoryWatermark = crate::store::ConsumerWatermark;

/// A registered consumer (as `outbox_consumers`): whether the reconciler
/// compares its watermarks (`critical`), whether retention waits for it
/// (`mandatory`), and the topics it reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryConsumer {
    /// Compared by the reconciler (`unconsumed_published`).
    pub critical: bool,
    /// Waited for by retention.
    pub mandatory: bool,
    /// Topic names it reads.
    pub topics: Vec<String>,
}

/// An audit record (stale writes, rejected receipts).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRecord {
    /// Event concerned.
    pub event_id: EventId,
    /// What happened.
    pub action: String,
    /// Details.
    pub detail: String,
}

/// Everything the store holds; public for the simulator's invariant checks.
#[derive(Debug, Default)]
pub struct MemoryState {
    /// Events by id.
    pub events: BTreeMap<EventId, MemoryEvent>,
    /// Attempts by event, oldest first.
    pub attempts: BTreeMap<EventId, Vec<AttemptRecord>>,
    /// Duplicate transport receipts.
    pub duplicates: Vec<BrokerReceipt>,
    /// Quarantine records: event, reason.
    pub quarantine: Vec<(EventId, String)>,
    /// Audit records.
    pub audit: Vec<AuditRecord>,
    /// Command key -> event id.
    pub commands: BTreeMap<String, EventId>,
    /// Highest primary offset accepted per (cluster, topic, topic id,
    /// partition). The cluster is part of the key: two clusters may carry the
    /// same topic name (a route revision to another cluster), and their
    /// offsets are unrelated; so is the topic id: a topic deleted and created
    /// again under the same name starts another log at offset 0.
    /// The value is the offset past it (an attempt's scan floor) and the
    /// event whose receipt holds it (the floor's anchor).
    pub partition_high: BTreeMap<(String, String, Option<String>, i32), (i64, EventId, AttemptId)>,
    /// Migration receipts, in order.
    pub migrations: Vec<MigrationRecord>,
    /// The highest version each aggregate (tenant, type, id) emitted.
    pub aggregate_versions: BTreeMap<(String, String, String), i64>,
    /// The topics events were routed to, per (cluster, topic): the
    /// partition count of the latest destination (the bypass scan reads them).
    pub routes: BTreeMap<(String, String), i32>,
    /// Open findings, (kind, event id or label, consumer id or empty) -> detail.
    pub findings: BTreeMap<(String, String, String), String>,
    /// Registered consumers by id (the comparison reads the critical ones).
    pub consumers: BTreeMap<String, MemoryConsumer>,
    /// Consumers' watermarks, one per consumer and log.
    pub watermarks: Vec<MemoryWatermark>,
    /// The published-without-receipt sweep's cursor: the last event id of its last full page.
    pub receipt_sweep_after: String,
    /// The bypass scan's cursors, (cluster, topic, partition) -> next offset.
    pub bypass_cursors: BTreeMap<(String, String, i32), crate::store::BypassCursor>,
    /// Bypass evidence by (cluster, topic, partition, offset): messages
    /// the outbox never committed or another outbox wrote, and when seen.
    pub bypass_messages: BTreeMap<(String, String, i32, i64), (crate::store::ScannedMessage, i64)>,
    next_seq: u64,
}

/// The in-memory store. Cheap to clone; clones share state.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<MemoryState>>,
    now_ms: Arc<AtomicI64>,
}

impl MemoryStore {
    /// An empty store at time 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the clock.
    pub fn set_now_ms(&self, now_ms: i64) {
        self.now_ms.store(now_ms, AtomicOrdering::SeqCst);
    }

    /// Reads the clock.
    pub fn now_ms(&self) -> i64 {
        self.now_ms.load(AtomicOrdering::SeqCst)
    }

    /// Locks the state for inspection.
    pub fn lock(&self) -> MutexGuard<'_, MemoryState> {
        // A panic while holding the lock would already have failed the run.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Inserts a PENDING event, as `emit` does in the caller's transaction,
    /// decided by [`decide_command`]: a second insert with the same command
    /// key and content returns the first event id, one with other content is
    /// [`CoreError::CommandKeyConflict`], and a version below the aggregate's
    /// last is [`CoreError::AggregateVersionBackwards`].
    pub fn insert(&self, command_key: &str, envelope: Envelope, destination: Destination, payload: Vec<u8>) -> Result<EventId, CoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let aggregate = (envelope.tenant.clone(), envelope.aggregate_type.clone(), envelope.aggregate_id.clone());
        let first = st.commands.get(command_key).map(|id| (id, Command::of(command_key, &st.events[id].envelope)));
        match decide_command(&Command::of(command_key, &envelope), first.as_ref().map(|f| &f.1), st.aggregate_versions.get(&aggregate).copied()) {
            Ok(CommandDecision::Repeat) => return Ok(first.map(|f| f.0.clone()).unwrap_or_else(|| envelope.event_id.clone())),
            Ok(CommandDecision::New) => {}
            Err(CommandRefusal::KeyReused { what }) => {
                let event_id = first.map(|f| f.0.clone()).unwrap_or_else(|| envelope.event_id.clone());
                return Err(CoreError::CommandKeyConflict { command_key: command_key.to_owned(), event_id, what });
            }
            Err(CommandRefusal::VersionBackwards { last }) => {
                let aggregate = format!("{}/{}", envelope.aggregate_type, envelope.aggregate_id);
                return Err(CoreError::AggregateVersionBackwards { aggregate, version: envelope.aggregate_version, last });
            }
        }
        let v = st.aggregate_versions.entry(aggregate).or_insert(envelope.aggregate_version);
        *v = (*v).max(envelope.aggregate_version);
        let id = envelope.event_id.clone();
        st.next_seq += 1;
        let seq = st.next_seq;
        let destination_digest = destination.digest();
        st.commands.insert(command_key.to_owned(), id.clone());
        st.routes.insert((destination.cluster_id.clone(), destination.topic.clone()), destination.partitions as i32);
        st.events.insert(
            id.clone(),
            MemoryEvent {
                seq,
                envelope,
                destination,
                destination_digest,
                payload,
                state: EventState::Pending,
                claim: Claim { owner: None, claim_generation: 0, lease_until_ms: None, attempt_id: None },
                attempt_generation: 0,
                slot: None,
                state_since_ms: now,
                next_check_at_ms: 0,
                unknown_since_ms: None,
                published_at_ms: None,
                unknown_resolved_after_ms: Vec::new(),
                created_at_ms: now,
            },
        );
        Ok(id)
    }

    /// Takes one DISPATCH_UNKNOWN event (due or not) for a fenced reconcile,
    /// as an operator's migration does before asking the old target.
    pub fn begin_reconcile_event(&self, owner: &str, event_id: &EventId, lease_ms: i64) -> Result<Option<ReconcileTask>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let Some(ev) = st.events.get_mut(event_id) else { return Err(StoreError::NotFound(event_id.clone())) };
        if ev.state != RECONCILE_FROM {
            return Ok(None);
        }
        Ok(Some(Self::take_for_reconcile(ev, &st.attempts, owner, now, lease_ms)?))
    }

    fn take_for_reconcile(ev: &mut MemoryEvent, attempts: &BTreeMap<EventId, Vec<AttemptRecord>>, owner: &str, now: i64, lease_ms: i64) -> Result<ReconcileTask, StoreError> {
        let since = ev.unknown_since_ms.unwrap_or(ev.state_since_ms);
        Self::transition(ev, RECONCILE_CLAIM, now)?;
        ev.claim = grant(&ev.claim, owner, now, lease_ms);
        ev.claim.attempt_id = None;
        Ok(ReconcileTask {
            token: Self::claimed(ev, EventState::DispatchUnknown).token,
            event: Self::locked(ev),
            attempts: attempts.get(&ev.envelope.event_id).cloned().unwrap_or_default(),
            unknown_since_ms: since,
        })
    }

    /// Destination migration (PROTOCOL §7): writes envelope generation + 1 with
    /// `new_destination`, keeps the old envelope in a migration receipt, and
    /// makes the event PENDING for the new destination.
    ///
    /// `NeverPersisted` is re-checked here ([`decide_migration`] on the locked
    /// row: PENDING, no attempt in flight or acknowledged). `ProvenAbsent` is
    /// accepted only for a RECONCILING event (the caller holds the reconcile
    /// claim under which it looked up the old target); only then are the old
    /// generation's SENDING/UNKNOWN attempts closed ABSENT. The move fences
    /// every earlier claim. `Ok(Err(why))` when refused; nothing changed.
    ///
    /// A proven-absent move commits only under the reconcile claim
    /// (`claim`) the proof was made under; the attempts are decided again
    /// here, under the store's lock.
    pub fn migrate(
        &self,
        event_id: &EventId,
        new_destination: Destination,
        proof: MigrationProof,
        operator: &str,
        claim: Option<&ClaimToken>,
    ) -> Result<Result<MigrationRecord, String>, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get_mut(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let attempts = st.attempts.entry(event_id.clone()).or_default();
        match (&proof, ev.state) {
            (MigrationProof::NeverPersisted, EventState::Pending) => {
                if let MigrationDecision::Refuse(r) = decide_migration(EventState::Pending, attempts, None, &Default::default(), now) {
                    return Ok(Err(r.to_string()));
                }
            }
            (MigrationProof::ProvenAbsent { .. }, EventState::Reconciling) => {
                let held = claim.is_some_and(|t| check_migration_fence(&MigrationFence::Claim(t.clone()), ev.state, ev.claim.claim_generation, ev.claim.owner.as_deref()).is_ok());
                if !held {
                    return Ok(Err("the reconcile claim the absence proof was made under is not held".into()));
                }
            }
            (p, s) => return Ok(Err(format!("state {s} cannot move under proof {p:?}"))),
        }
        Self::apply_migration(st, event_id, new_destination, proof, operator, now, false)
    }

    /// The commit of a destination migration, as the PostgreSQL store's:
    /// under the store's lock, checks that the row is still what the proof
    /// was made under ([`check_migration_fence`]), re-runs
    /// [`decide_migration`] on the attempts as they are now (with the old
    /// target's `lookup` for a proven-absent move), and only then writes
    /// envelope generation + 1 with `new_destination` (as
    /// [`MemoryStore::migrate`] does). With `dry_run`, decides the same and
    /// writes nothing. `Ok(Err(why))` when refused; nothing changed.
    #[allow(clippy::too_many_arguments)]
    pub fn commit_migration(
        &self,
        event_id: &EventId,
        new_destination: Destination,
        fence: &MigrationFence,
        lookup: Option<&LookupOutcome>,
        retry: &RetryPolicy,
        operator: &str,
        dry_run: bool,
    ) -> Result<Result<MigrationRecord, String>, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let decide_as = match check_migration_fence(fence, ev.state, ev.claim.claim_generation, ev.claim.owner.as_deref()) {
            Ok(s) => s,
            Err(why) => return Ok(Err(why)),
        };
        let attempts = st.attempts.get(event_id).map(Vec::as_slice).unwrap_or_default();
        let proof = match decide_migration(decide_as, attempts, lookup, retry, now) {
            MigrationDecision::Move { proof } => proof,
            MigrationDecision::Refuse(r) => return Ok(Err(r.to_string())),
        };
        Self::apply_migration(st, event_id, new_destination, proof, operator, now, dry_run)
    }

    /// Writes a migration decided under the lock (or, with `dry_run`, only
    /// builds its record).
    fn apply_migration(
        st: &mut MemoryState,
        event_id: &EventId,
        new_destination: Destination,
        proof: MigrationProof,
        operator: &str,
        now: i64,
        dry_run: bool,
    ) -> Result<Result<MigrationRecord, String>, StoreError> {
        let ev = st.events.get_mut(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let attempts = st.attempts.entry(event_id.clone()).or_default();
        let to_digest = new_destination.digest();
        if to_digest == ev.destination_digest {
            return Ok(Err("the new route resolves to the same destination".into()));
        }
        let mut closed = Vec::new();
        if matches!(proof, MigrationProof::ProvenAbsent { .. }) {
            closed = attempts.iter().filter(|a| a.state.possibly_in_flight()).map(|a| a.attempt_id.clone()).collect();
        }
        let old_envelope = ev.envelope.clone();
        let record = MigrationRecord {
            event_id: event_id.clone(),
            from_generation: old_envelope.envelope_generation,
            to_generation: old_envelope.envelope_generation + 1,
            from_destination: ev.destination.clone(),
            from_destination_digest: ev.destination_digest.clone(),
            to_destination: new_destination.clone(),
            to_destination_digest: to_digest.clone(),
            from_envelope: old_envelope.clone(),
            proof,
            operator: operator.to_owned(),
            at_ms: now,
            closed_attempts: closed,
        };
        if dry_run {
            return Ok(Ok(record));
        }
        if matches!(record.proof, MigrationProof::ProvenAbsent { .. }) {
            for a in attempts.iter_mut().filter(|a| a.state.possibly_in_flight()) {
                a.state = AttemptState::Absent;
            }
        }
        st.routes.insert((new_destination.cluster_id.clone(), new_destination.topic.clone()), new_destination.partitions as i32);
        ev.envelope = Envelope { envelope_generation: old_envelope.envelope_generation + 1, ..old_envelope };
        ev.destination = new_destination;
        ev.destination_digest = to_digest;
        // The new generation is PENDING and has no publish slot yet,
        // written as the SQL store writes it (`state = 'PENDING'`, slots per
        // envelope generation): the fence and the decision before this are
        // what keep a moved event from having been delivered.
        ev.state = EventState::Pending;
        ev.slot = None;
        ev.published_at_ms = None;
        ev.state_since_ms = now;
        // A migration resolves an unknown outcome too (proven absent, moved).
        if let Some(since) = ev.unknown_since_ms.take() {
            ev.unknown_resolved_after_ms.push(now - since);
        }
        ev.next_check_at_ms = 0;
        ev.claim.claim_generation += 1;
        ev.claim.owner = None;
        ev.claim.lease_until_ms = None;
        ev.claim.attempt_id = None;
        Self::audit(st, event_id, "migrated", format!("generation {} -> {} by {operator}", record.from_generation, record.to_generation));
        st.migrations.push(record.clone());
        Ok(Ok(record))
    }

    /// Replaces the consumer registry and the watermarks (the PostgreSQL
    /// store's `outbox_consumers` and `outbox_consumer_watermarks`) with
    /// these mandatory consumers (id, topics they read) and watermarks:
    /// what retention reads.
    pub fn set_retention_registry(&self, mandatory: Vec<(String, Vec<String>)>, watermarks: Vec<MemoryWatermark>) {
        let mut st = self.lock();
        st.consumers = mandatory.into_iter().map(|(id, topics)| (id, MemoryConsumer { critical: false, mandatory: true, topics })).collect();
        st.watermarks = watermarks;
    }

    /// Registers (or replaces) a consumer.
    pub fn register_consumer(&self, consumer_id: &str, consumer: MemoryConsumer) {
        self.lock().consumers.insert(consumer_id.to_owned(), consumer);
    }

    /// Sets a consumer's watermark on its log (replacing the one it had there).
    pub fn set_watermark(&self, watermark: MemoryWatermark) {
        let mut st = self.lock();
        let same_log = |w: &MemoryWatermark| {
            (&w.consumer_id, &w.cluster_id, &w.topic, &w.topic_id, w.partition) == (&watermark.consumer_id, &watermark.cluster_id, &watermark.topic, &watermark.topic_id, watermark.partition)
        };
        st.watermarks.retain(|w| !same_log(w));
        st.watermarks.push(watermark);
    }

    /// Moves an event, through the transition table.
    pub fn transition(ev: &mut MemoryEvent, to: EventState, now_ms: i64) -> Result<(), CoreError> {
        ev.state = ev.state.transition(to)?;
        ev.state_since_ms = now_ms;
        if to == EventState::Published {
            ev.published_at_ms.get_or_insert(now_ms);
        }
        match to {
            // Due for the reconciler at once, as in PostgreSQL; a recheck
            // sets its own time after this transition.
            EventState::DispatchUnknown => {
                ev.unknown_since_ms.get_or_insert(now_ms);
                ev.next_check_at_ms = now_ms;
            }
            EventState::Published | EventState::Quarantined | EventState::Pending => {
                if let Some(since) = ev.unknown_since_ms.take() {
                    ev.unknown_resolved_after_ms.push(now_ms - since);
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn audit(st: &mut MemoryState, event_id: &EventId, action: &str, detail: String) {
        st.audit.push(AuditRecord { event_id: event_id.clone(), action: action.to_owned(), detail });
    }

    /// The event as the receipt and reconcile decisions see it.
    fn locked(ev: &MemoryEvent) -> LockedEvent {
        LockedEvent {
            event_id: ev.envelope.event_id.clone(),
            envelope_generation: ev.envelope.envelope_generation,
            state: ev.state,
            payload_digest: ev.envelope.payload_digest.clone(),
            destination: ev.destination.clone(),
            destination_digest: ev.destination_digest.clone(),
            slot: ev.slot.clone(),
        }
    }

    fn claimed(ev: &MemoryEvent, from: EventState) -> ClaimedEvent {
        ClaimedEvent {
            token: ClaimToken {
                event_id: ev.envelope.event_id.clone(),
                owner: ev.claim.owner.clone().unwrap_or_default(),
                claim_generation: ev.claim.claim_generation,
                lease_until_ms: ev.claim.lease_until_ms.unwrap_or(0),
            },
            envelope: ev.envelope.clone(),
            destination: ev.destination.clone(),
            destination_digest: ev.destination_digest.clone(),
            payload: ev.payload.clone(),
            event_payload_digest: ev.envelope.payload_digest.clone(),
            claimed_from: from,
            traceparent: None,
            // The in-memory store has no source identity: no CloudEvents headers.
            cloudevents: None,
            tracestate: None,
            source: None,
        }
    }

    /// Whether an earlier event of the same destination and key holds the key.
    fn key_blocked(st: &MemoryState, ev: &MemoryEvent) -> bool {
        ev.destination.ordering == Ordering::Key
            && st.events.values().any(|o| {
                o.seq < ev.seq
                    && o.destination.topic == ev.destination.topic
                    && o.destination.cluster_id == ev.destination.cluster_id
                    && o.destination.routing_key == ev.destination.routing_key
                    && o.state.holds_key()
            })
    }

    fn fenced_write<T>(
        &self,
        token: &ClaimToken,
        write: FencedWrite,
        action: &str,
        f: impl FnOnce(&mut MemoryState, i64) -> Result<T, StoreError>,
    ) -> Result<Result<T, CoreError>, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let ev = st.events.get(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
        if let Err(e) = check_fence(&ev.claim, token, write, now) {
            Self::audit(&mut st, &token.event_id, "stale_write", format!("{action} by {} gen {}: {e}", token.owner, token.claim_generation));
            return Ok(Err(e));
        }
        f(&mut st, now).map(Ok)
    }
}

fn to_outcome(r: Result<FenceOutcome, CoreError>) -> Result<FenceOutcome, StoreError> {
    match r {
        Ok(o) => Ok(o),
        Err(CoreError::Fenced { .. } | CoreError::LeaseExpired { .. }) => Ok(FenceOutcome::Fenced),
        Err(e) => Err(e.into()),
    }
}

#[async_trait]
impl OutboxStore for MemoryStore {
    async fn claim_batch(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        // PENDING and due first (cheap), then the key (a scan of the store).
        let mut candidates: Vec<(u64, EventId)> =
            st.events.values().filter(|e| is_claimable(e.state, e.next_check_at_ms, false, now)).map(|e| (e.seq, e.envelope.event_id.clone())).collect();
        candidates.sort();
        let mut out = Vec::new();
        for (_, id) in candidates {
            if out.len() >= limit.min(MAX_CLAIM_BATCH) {
                break;
            }
            let ev = &st.events[&id];
            if !is_claimable(ev.state, ev.next_check_at_ms, Self::key_blocked(&st, ev), now) {
                continue;
            }
            let ev = st.events.get_mut(&id).ok_or_else(|| StoreError::NotFound(id.clone()))?;
            Self::transition(ev, EventState::Claimed, now)?;
            ev.claim = grant(&ev.claim, owner, now, lease_ms);
            out.push(Self::claimed(ev, EventState::Pending));
        }
        Ok(out)
    }

    async fn claim_retries(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let mut out = Vec::new();
        for ev in st.events.values_mut() {
            if out.len() >= limit.min(MAX_CLAIM_BATCH) {
                break;
            }
            // A retry claim is granted by the reconciler; a dispatcher takes
            // it over only once the reconciler's lease is gone or unowned.
            if ev.state == EventState::RetryClaimed && ev.claim.owner.is_none() {
                ev.claim = grant(&ev.claim, owner, now, lease_ms);
                out.push(Self::claimed(ev, EventState::RetryClaimed));
            }
        }
        Ok(out)
    }

    async fn register_attempt(&self, token: &ClaimToken) -> Result<AttemptRecord, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Send, "register_attempt", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            check_registration(ev.state, &ev.claim, token, now)?;
            Self::transition(ev, EventState::Sending, now)?;
            ev.attempt_generation += 1;
            let mut attempt = AttemptRecord {
                attempt_id: AttemptId::generate(now.max(0) as u64),
                event_id: token.event_id.clone(),
                envelope_generation: ev.envelope.envelope_generation,
                attempt_generation: ev.attempt_generation,
                claim_generation: token.claim_generation,
                owner: token.owner.clone(),
                state: AttemptState::Sending,
                destination_digest: ev.destination_digest.clone(),
                started_at_ms: now,
                send_deadline_ms: Some(token.lease_until_ms),
                scan_from_offset: 0,
                scan_anchor: None,
                scan_anchor_attempt: None,
            };
            if let Some((floor, anchor, anchor_attempt)) =
                st.partition_high.get(&(ev.destination.cluster_id.clone(), ev.destination.topic.clone(), ev.destination.topic_id.clone(), ev.destination.partition))
            {
                attempt.scan_from_offset = *floor;
                attempt.scan_anchor = Some(anchor.clone());
                attempt.scan_anchor_attempt = Some(anchor_attempt.clone());
            }
            ev.claim.attempt_id = Some(attempt.attempt_id.clone());
            st.attempts.entry(token.event_id.clone()).or_default().push(attempt.clone());
            Ok(attempt)
        })?;
        r.map_err(StoreError::from)
    }

    async fn accept_dispatch_receipt(&self, receipt: &BrokerReceipt) -> Result<ReceiptOutcome, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get_mut(&receipt.event_id).ok_or_else(|| StoreError::NotFound(receipt.event_id.clone()))?;
        let locked = Self::locked(ev);
        let attempts = st.attempts.entry(receipt.event_id.clone()).or_default();
        let decision = decide_receipt(&locked, attempts, receipt);
        if crate::receipt::refutes_absence(attempts, receipt, &decision) {
            st.audit.push(AuditRecord { event_id: receipt.event_id.clone(), action: "absence_proof_refuted".into(), detail: format!("{} @{}", receipt.attempt_id, receipt.offset) });
        }
        if crate::receipt::is_unregistered_message(&decision) {
            st.audit.push(AuditRecord { event_id: receipt.event_id.clone(), action: "unregistered_message".into(), detail: format!("{} @{}", receipt.attempt_id, receipt.offset) });
        }
        let mark_acked = |attempts: &mut Vec<AttemptRecord>| {
            attempts.iter_mut().filter(|a| a.attempt_id == receipt.attempt_id).for_each(|a| a.state = AttemptState::Acked)
        };
        match &decision {
            ReceiptDecision::Accept { .. } => {
                Self::transition(ev, EventState::Published, now)?;
                ev.slot = Some(receipt.clone());
                let log = (receipt.cluster_id.clone(), receipt.topic.clone(), receipt.topic_id.clone(), receipt.partition);
                let floor = crate::reconcile::advance_floor(st.partition_high.get(&log), receipt.offset, &receipt.event_id, &receipt.attempt_id);
                st.partition_high.insert(log, floor);
                ev.claim.owner = None;
                ev.claim.lease_until_ms = None;
                mark_acked(attempts);
            }
            ReceiptDecision::AlreadyAccepted => {}
            ReceiptDecision::Duplicate => {
                mark_acked(attempts);
                if !st.duplicates.iter().any(|d| d.event_id == receipt.event_id && d.same_placement(receipt)) {
                    st.duplicates.push(receipt.clone());
                }
            }
            ReceiptDecision::Quarantine { reason, move_event } => {
                if *move_event {
                    Self::transition(ev, EventState::Quarantined, now)?;
                    ev.claim.claim_generation += 1;
                    ev.claim.owner = None;
                }
                st.quarantine.push((receipt.event_id.clone(), format!("{reason:?}")));
            }
            ReceiptDecision::Reject { reason } => {
                st.audit.push(AuditRecord { event_id: receipt.event_id.clone(), action: "receipt_rejected".into(), detail: format!("{reason:?}") });
            }
        }
        let ev = &st.events[&receipt.event_id];
        Ok(ReceiptOutcome { decision, primary: ev.slot.clone(), state: ev.state })
    }

    async fn report_unknown(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "report_unknown", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let attempt = st.attempts.get_mut(&token.event_id).and_then(|v| v.iter_mut().find(|a| &a.attempt_id == attempt_id));
            let Some(attempt) = attempt else { return Ok(FenceOutcome::NoOp) };
            if attempt.state != AttemptState::Sending || ev.state != EventState::Sending {
                return Ok(FenceOutcome::NoOp);
            }
            attempt.state = AttemptState::Unknown;
            Self::transition(ev, EventState::DispatchUnknown, now)?;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            st.audit.push(AuditRecord { event_id: token.event_id.clone(), action: "unknown".into(), detail: detail.to_owned() });
            Ok(FenceOutcome::Applied)
        })?;
        to_outcome(r)
    }

    async fn report_not_sent(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "report_not_sent", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let attempt = st.attempts.get_mut(&token.event_id).and_then(|v| v.iter_mut().find(|a| &a.attempt_id == attempt_id));
            let Some(attempt) = attempt else { return Ok(FenceOutcome::NoOp) };
            if attempt.state != AttemptState::Sending || ev.state != EventState::Sending {
                return Ok(FenceOutcome::NoOp);
            }
            attempt.state = AttemptState::NotSent;
            // After a blind (unproven) retry an earlier attempt may still be
            // UNKNOWN, i.e. possibly in the log: the event's outcome is then
            // still unknown, and only DISPATCH_UNKNOWN keeps that attempt's
            // late genuine ACK acceptable (PENDING -> PUBLISHED is illegal).
            let earlier_open = st.attempts.get(&token.event_id).is_some_and(|v| v.iter().any(|a| &a.attempt_id != attempt_id && a.state.possibly_in_flight()));
            Self::transition(ev, if earlier_open { EventState::DispatchUnknown } else { EventState::Pending }, now)?;
            if !earlier_open {
                ev.next_check_at_ms = now + crate::claim::not_sent_backoff_ms(ev.attempt_generation);
            }
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            ev.claim.attempt_id = None;
            st.audit.push(AuditRecord { event_id: token.event_id.clone(), action: "not_sent".into(), detail: detail.to_owned() });
            Ok(FenceOutcome::Applied)
        })?;
        to_outcome(r)
    }

    async fn release(&self, token: &ClaimToken) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "release", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let back = match ev.state {
                EventState::Claimed => EventState::Pending,
                _ => return Ok(FenceOutcome::NoOp),
            };
            Self::transition(ev, back, now)?;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            Ok(FenceOutcome::Applied)
        })?;
        to_outcome(r)
    }

    async fn quarantine_claimed(&self, token: &ClaimToken, reason: &str, evidence: serde_json::Value) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "quarantine", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            Self::transition(ev, EventState::Quarantined, now)?;
            ev.claim.owner = None;
            st.quarantine.push((token.event_id.clone(), format!("{reason}: {evidence}")));
            Ok(FenceOutcome::Applied)
        })?;
        to_outcome(r)
    }

    async fn renew_lease(&self, token: &ClaimToken, lease_ms: i64) -> Result<Option<i64>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let r = self.fenced_write(token, FencedWrite::Send, "renew_lease", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let until = now + lease_ms;
            ev.claim.lease_until_ms = Some(until);
            Ok(until)
        })?;
        match r {
            Ok(until) => Ok(Some(until)),
            Err(CoreError::Fenced { .. } | CoreError::LeaseExpired { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn expire_leases(&self) -> Result<SweepOutcome, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let mut out = SweepOutcome::default();
        for ev in st.events.values_mut() {
            let expired = ev.claim.lease_until_ms.is_some_and(|l| l <= now) && ev.claim.owner.is_some();
            if !expired {
                continue;
            }
            let Some(plan) = crate::claim::plan_lease_expiry(ev.state) else { continue };
            match ev.state {
                EventState::Claimed => out.released += 1,
                EventState::Sending => out.unknown += 1,
                _ => out.retry_expired += 1,
            }
            if plan.attempt_unknown {
                if let Some(a) = st.attempts.get_mut(&ev.envelope.event_id).and_then(|v| v.iter_mut().find(|a| Some(&a.attempt_id) == ev.claim.attempt_id.as_ref())) {
                    if a.state == AttemptState::Sending {
                        a.state = AttemptState::Unknown;
                    }
                }
            }
            Self::transition(ev, plan.to, now)?;
            ev.claim.claim_generation += 1;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            if !plan.keeps_attempt {
                ev.claim.attempt_id = None;
            }
        }
        Ok(out)
    }

    async fn begin_reconcile(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ReconcileTask>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let mut out = Vec::new();
        for ev in st.events.values_mut() {
            if out.len() >= limit.min(MAX_CLAIM_BATCH) {
                break;
            }
            if ev.state != RECONCILE_FROM || ev.next_check_at_ms > now {
                continue;
            }
            out.push(Self::take_for_reconcile(ev, &st.attempts, owner, now, lease_ms)?);
        }
        Ok(out)
    }

    async fn finish_reconcile(&self, token: &ClaimToken, decision: &ReconcileDecision) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "finish_reconcile", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let Some(plan) = plan_reconcile_finish(decision).filter(|_| ev.state == RECONCILE_CLAIM) else { return Ok(FenceOutcome::NoOp) };
            Self::transition(ev, plan.to, now)?;
            if let Some(at) = plan.next_check_at_ms {
                ev.next_check_at_ms = at;
            }
            if plan.close_open_attempts {
                for a in st.attempts.entry(token.event_id.clone()).or_default().iter_mut().filter(|a| OPEN_ATTEMPT_STATES.contains(&a.state)) {
                    a.state = AttemptState::Absent;
                }
            }
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            ev.claim.attempt_id = None;
            Ok(FenceOutcome::Applied)
        })?;
        to_outcome(r)
    }

    async fn attempts(&self, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        Ok(self.lock().attempts.get(event_id).cloned().unwrap_or_default())
    }

    async fn event_state(&self, event_id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), StoreError> {
        let st = self.lock();
        let ev = st.events.get(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        Ok((ev.state, ev.slot.clone()))
    }
}

/// The bypass scan's reads and write over the in-memory records (as
/// `PgStore`'s over its tables).
#[async_trait]
impl crate::store::BypassScanStore for MemoryStore {
    async fn routed_topics(&self, cluster_id: &str) -> Result<Vec<(String, i32)>, StoreError> {
        Ok(self.lock().routes.iter().filter(|((c, _), _)| c == cluster_id).map(|((_, t), n)| (t.clone(), *n)).collect())
    }

    async fn source_identity(&self) -> Result<Option<String>, StoreError> {
        // The in-memory store has no source identity (its messages carry no `outbox-source`).
        Ok(None)
    }

    async fn bypass_cursor(&self, cluster_id: &str, topic: &str, partition: i32) -> Result<crate::store::BypassCursor, StoreError> {
        Ok(self.lock().bypass_cursors.get(&(cluster_id.to_owned(), topic.to_owned(), partition)).cloned().unwrap_or_default())
    }

    async fn committed_event_ids(&self, event_ids: &[String]) -> Result<std::collections::BTreeSet<String>, StoreError> {
        let st = self.lock();
        Ok(event_ids.iter().filter(|id| id.parse::<EventId>().is_ok_and(|id| st.events.contains_key(&id))).cloned().collect())
    }

    async fn receipts_at(&self, cluster_id: &str, topic: &str, partition: i32, offsets: &[i64]) -> Result<Vec<crate::compare::RecordedReceipt>, StoreError> {
        let st = self.lock();
        let at = |r: &BrokerReceipt| r.cluster_id == cluster_id && r.topic == topic && r.partition == partition && offsets.contains(&r.offset);
        let recorded = |r: &BrokerReceipt, primary: bool| crate::compare::RecordedReceipt { event_id: r.event_id.to_string(), topic_id: r.topic_id.clone(), offset: r.offset, primary };
        let primaries = st.events.values().filter_map(|e| e.slot.as_ref()).filter(|r| at(r)).map(|r| recorded(r, true));
        Ok(primaries.chain(st.duplicates.iter().filter(|r| at(r)).map(|r| recorded(r, false))).collect())
    }

    async fn published_digests(&self, event_ids: &[String]) -> Result<BTreeMap<String, String>, StoreError> {
        let st = self.lock();
        Ok(event_ids
            .iter()
            .filter_map(|id| st.events.get(&id.parse::<EventId>().ok()?))
            .filter(|e| e.slot.as_ref().is_some_and(|s| s.envelope_generation == e.envelope.envelope_generation))
            .map(|e| (e.envelope.event_id.to_string(), e.envelope.payload_digest.clone()))
            .collect())
    }

    async fn unanswered_attempts_of(&self, event_ids: &[String]) -> Result<Vec<AttemptRecord>, StoreError> {
        let st = self.lock();
        Ok(event_ids
            .iter()
            .filter_map(|id| st.attempts.get(&id.parse::<EventId>().ok()?))
            .flatten()
            .filter(|a| a.state != AttemptState::Acked)
            .cloned()
            .collect())
    }

    async fn receipts_from(
        &self,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        from_offset: i64,
        accepted_before_ms: i64,
        limit: i64,
    ) -> Result<Vec<crate::compare::RecordedReceipt>, StoreError> {
        let st = self.lock();
        let mut out: Vec<crate::compare::RecordedReceipt> = st
            .events
            .values()
            .filter_map(|e| e.slot.as_ref().filter(|r| r.offset >= from_offset && r.partition == partition && r.topic == topic && r.cluster_id == cluster_id).map(|r| (e, r)))
            .filter(|(e, _)| e.published_at_ms.is_some_and(|at| at < accepted_before_ms))
            .map(|(_, r)| r)
            .filter(|r| !st.findings.contains_key(&(crate::compare::RECEIPT_POSITION_LOST.to_owned(), r.event_id.to_string(), String::new())))
            .map(|r| crate::compare::RecordedReceipt { event_id: r.event_id.to_string(), topic_id: r.topic_id.clone(), offset: r.offset, primary: true })
            .collect();
        out.sort_by_key(|r| r.offset);
        out.truncate(usize::try_from(limit.max(0)).unwrap_or(usize::MAX));
        Ok(out)
    }

    async fn record_bypass_scan(&self, write: &crate::store::BypassScanWrite) -> Result<(), StoreError> {
        let mut st = self.lock();
        let (cluster, topic, partition) = (write.cluster_id.clone(), write.topic.clone(), write.partition);
        for m in &write.bypass_messages {
            st.bypass_messages.entry((cluster.clone(), topic.clone(), partition, m.offset)).or_insert_with(|| (m.clone(), write.now_ms));
        }
        for f in &write.findings {
            st.findings.insert((f.kind.to_owned(), f.event_id.clone(), String::new()), f.detail.clone());
        }
        let cursor = st.bypass_cursors.entry((cluster, topic, partition)).or_default();
        match write.cursor {
            crate::compare::CursorMove::Advance(to) if to > cursor.next_offset => {
                *cursor = crate::store::BypassCursor { next_offset: to, anchor: write.anchor.clone() };
            }
            crate::compare::CursorMove::Advance(_) => {}
            crate::compare::CursorMove::Restart => *cursor = crate::store::BypassCursor::default(),
        }
        Ok(())
    }
}

fn facts(ev: &MemoryEvent, st: &MemoryState) -> crate::store::EventFacts {
    let id = &ev.envelope.event_id;
    crate::store::EventFacts {
        event_id: id.to_string(),
        state: ev.state,
        held_by_dispatcher: ev.claim.owner.is_some(),
        by_outbox: true,
        created_at_ms: ev.created_at_ms,
        state_since_ms: ev.state_since_ms,
        unknown_since_ms: ev.unknown_since_ms,
        quarantine_reason: st.quarantine.iter().rev().find(|(e, _)| e == id).map(|(_, r)| r.clone()).unwrap_or_default(),
    }
}

fn take<T>(mut v: Vec<T>, limit: i64) -> Vec<T> {
    v.truncate(usize::try_from(limit.max(0)).unwrap_or(usize::MAX));
    v
}

/// The comparison's reads and write over the in-memory records (as
/// `PgStore`'s over its tables). Its reads pre-filter as the SQL does
/// (time, state), so that a read's limit cuts the same rows; what is a
/// finding is the reconciler's call (`crate::findings`).
#[async_trait]
impl crate::store::FindingsStore for MemoryStore {
    async fn aged_candidates(&self, created_before_ms: i64, limit: i64) -> Result<Vec<crate::store::EventFacts>, StoreError> {
        let st = self.lock();
        let mut v: Vec<&MemoryEvent> = st
            .events
            .values()
            .filter(|e| e.created_at_ms < created_before_ms)
            .filter(|e| e.state == EventState::Pending || (matches!(e.state, EventState::Claimed | EventState::Sending) && e.claim.owner.is_some()))
            .collect();
        v.sort_by_key(|e| e.seq);
        Ok(take(v.into_iter().map(|e| facts(e, &st)).collect(), limit))
    }

    async fn unknown_candidates(&self, unknown_before_ms: i64, limit: i64) -> Result<Vec<crate::store::EventFacts>, StoreError> {
        let st = self.lock();
        let closed = [EventState::Published, EventState::Retained, EventState::Purged, EventState::Quarantined];
        let mut v: Vec<&MemoryEvent> = st.events.values().filter(|e| e.unknown_since_ms.is_some_and(|u| u < unknown_before_ms) && !closed.contains(&e.state)).collect();
        v.sort_by_key(|e| e.unknown_since_ms);
        Ok(take(v.into_iter().map(|e| facts(e, &st)).collect(), limit))
    }

    async fn quarantined_candidates(&self, limit: i64) -> Result<Vec<crate::store::EventFacts>, StoreError> {
        let st = self.lock();
        let mut v: Vec<&MemoryEvent> = st.events.values().filter(|e| e.state == EventState::Quarantined).collect();
        v.sort_by_key(|e| e.state_since_ms);
        Ok(take(v.into_iter().map(|e| facts(e, &st)).collect(), limit))
    }

    async fn critical_consumers(&self) -> Result<Vec<(String, Vec<String>)>, StoreError> {
        Ok(self.lock().consumers.iter().filter(|(_, c)| c.critical).map(|(id, c)| (id.clone(), c.topics.clone())).collect())
    }

    async fn published_candidates(&self, _consumer_id: &str, topics: &[String], published_before_ms: i64, limit: i64) -> Result<Vec<crate::store::PublishedFacts>, StoreError> {
        let st = self.lock();
        let mut v: Vec<crate::store::PublishedFacts> = st
            .events
            .values()
            .filter(|e| matches!(e.state, EventState::Published | EventState::Retained))
            .filter_map(|e| Some((e, e.slot.as_ref().filter(|s| s.envelope_generation == e.envelope.envelope_generation)?, e.published_at_ms?)))
            .filter(|(_, slot, at)| *at < published_before_ms && topics.contains(&slot.topic))
            .map(|(e, slot, at)| crate::store::PublishedFacts {
                event_id: e.envelope.event_id.to_string(),
                state: e.state,
                published_at_ms: at,
                cluster_id: slot.cluster_id.clone(),
                topic: slot.topic.clone(),
                topic_id: slot.topic_id.clone(),
                partition: slot.partition,
                offset: slot.offset,
            })
            .collect();
        v.sort_by_key(|p| p.published_at_ms);
        Ok(take(v, limit))
    }

    async fn consumer_watermarks(&self, consumer_id: &str, topics: &[String]) -> Result<Vec<crate::store::ConsumerWatermark>, StoreError> {
        Ok(self
            .lock()
            .watermarks
            .iter()
            .filter(|w| w.consumer_id == consumer_id && topics.contains(&w.topic))
            .map(|w| crate::store::ConsumerWatermark {
                consumer_id: w.consumer_id.clone(),
                cluster_id: w.cluster_id.clone(),
                topic: w.topic.clone(),
                topic_id: w.topic_id.clone(),
                partition: w.partition,
                committed_offset: w.committed_offset,
            })
            .collect())
    }

    async fn receipt_sweep_page(&self, limit: i64) -> Result<Vec<crate::store::SweptEvent>, StoreError> {
        let mut st = self.lock();
        let after = st.receipt_sweep_after.clone();
        let mut all: Vec<crate::store::SweptEvent> = st
            .events
            .iter()
            .filter(|(id, _)| id.as_str() > after.as_str())
            .map(|(id, e)| crate::store::SweptEvent {
                event_id: id.to_string(),
                state: e.state,
                has_primary_receipt: e.slot.as_ref().is_some_and(|s| s.envelope_generation == e.envelope.envelope_generation),
                state_since_ms: e.state_since_ms,
            })
            .collect();
        all.sort_by(|a, b| a.event_id.cmp(&b.event_id));
        let page = take(all, limit);
        st.receipt_sweep_after = if i64::try_from(page.len()).unwrap_or(i64::MAX) >= limit { page.last().map(|e| e.event_id.clone()).unwrap_or_default() } else { String::new() };
        Ok(page)
    }

    async fn watermark_publishers(&self, _received_before_ms: i64, _limit: i64) -> Result<Vec<crate::store::WatermarkPublisherFacts>, StoreError> {
        // The in-memory store has no broker watermark topic.
        Ok(Vec::new())
    }

    async fn record_round_findings(&self, _now_ms: i64, findings: &[crate::store::RoundFinding]) -> Result<(), StoreError> {
        let mut st = self.lock();
        let seen: std::collections::BTreeSet<(String, String, String)> = findings.iter().map(|f| (f.kind.to_owned(), f.event_id.clone(), f.consumer_id.clone())).collect();
        for f in findings {
            st.findings.insert((f.kind.to_owned(), f.event_id.clone(), f.consumer_id.clone()), f.detail.clone());
        }
        // Opened first, then resolved as `round_resolves` says (as the SQL store does).
        st.findings.retain(|key, _| !crate::findings::round_resolves(&key.0, seen.contains(key)));
        Ok(())
    }
}
