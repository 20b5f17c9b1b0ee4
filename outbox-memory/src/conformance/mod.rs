//! One conformance suite, run against every [`OutboxStore`].
//!
//! The same scenarios run against the in-memory store (in `outbox-sim`'s
//! tests) and against the PostgreSQL store, so both are held to the same
//! protocol: claims and fencing (PROTOCOL §4), the single acceptance point
//! (PROTOCOL §5), unknown outcomes and reconciliation (PROTOCOL §3, §6) and per-key
//! ordering.
//!
//! A store plugs in through a small [`Harness`]: it emits events (the
//! business transaction and the PENDING envelope), can tamper with a stored
//! payload, and owns the clock the store reads. Every scenario creates its own
//! events under unique command keys and aggregate ids, so scenarios may share
//! one store (and one database) with each other and with leftovers of earlier
//! runs: claims and reconcile batches that pick up foreign events hand them
//! back untouched (release, or recheck far in the future).
//!
//! The scenarios, by what they hold a store to: claims, fencing and
//! registration (`claims.rs`), the receipt decision (`receipts.rs`),
//! unknown outcomes and reconciliation (`reconcile.rs`), the emit command
//! (`emit.rs`), destination migration (`migration.rs`), retention
//! (`retention.rs`), the bypass scan with its [`ScanLog`] broker
//! (`scans.rs`), the comparison's findings (`findings.rs`) and an
//! operator's skip of a blocked key's head (`skip.rs`); `ctx.rs`
//! holds what they share.
//!
//! ```ignore
//! let results = outbox_memory::conformance::run_all(&harness).await;
//! for (name, r) in &results { assert!(r.is_ok(), "{name}: {r:?}"); }
//! ```

use async_trait::async_trait;

use outbox_core::envelope::{EmitRequest, RoutePolicy};
use outbox_core::error::CoreError;
use outbox_core::id::EventId;
use outbox_core::migration::MigrationFence;
use outbox_core::reconcile::RetryPolicy;
use outbox_core::skip::{PoisonRule, SkipRecord};
use outbox_core::store::{ConsumerWatermark, LookupOutcome, OutboxStore};

use crate::MemoryWatermark;

mod claims;
mod ctx;
mod emit;
mod findings;
mod migration;
mod receipts;
mod reconcile;
mod retention;
mod scans;
mod skip;

use ctx::{offset_block, Ctx};
pub use scans::{ScanLog, ScanOutcome};

/// Lease every scenario asks for.
pub const LEASE_MS: i64 = 1_000;

/// The reconcile policy of the scenarios: attempts older than
/// [`RetryPolicy::in_flight_bound_ms`] are settled.
pub const POLICY: RetryPolicy = RetryPolicy { allow_retry: true, max_attempts: 10, in_flight_bound_ms: 5_000, recheck_ms: 1_000 };

/// The cluster the scenarios' events are routed to.
pub const CLUSTER: &str = "sim-cluster";

/// The topic the scenarios' events are routed to.
pub const TOPIC: &str = "orders";

/// The route of the suite: event type `order.created` to `topic` of
/// [`CLUSTER`], 4 partitions, per-key ordering ([`RoutePolicy::new`]'s
/// defaults). A harness routes its emits by `route(TOPIC)`, and a
/// migration to `to_topic` by `route(to_topic)`.
pub fn route(topic: &str) -> RoutePolicy {
    RoutePolicy::new("order.created", CLUSTER, topic, 4)
}

/// The event type of the scenarios that replace a log under their events
/// (a receipt accepted at a position another event's receipt holds). It
/// has a topic of its own, [`REPLACED_TOPIC`] ([`routes`]): a replaced
/// partition holds every `destination.v1` event of it from retention and
/// makes each `unconsumed_published` whatever a watermark says, which must
/// not reach the other scenarios' events.
pub const REPLACED_EVENT_TYPE: &str = "order.replaced";

/// The topic of [`REPLACED_EVENT_TYPE`].
pub const REPLACED_TOPIC: &str = "orders-replaced";

/// Every route of the suite: [`route`] of [`TOPIC`] (`order.created`), and
/// [`REPLACED_EVENT_TYPE`] to [`REPLACED_TOPIC`] of the same cluster.
pub fn routes() -> Vec<RoutePolicy> {
    vec![route(TOPIC), RoutePolicy::new(REPLACED_EVENT_TYPE, CLUSTER, REPLACED_TOPIC, 4)]
}

/// How a store plugs into the suite.
///
/// The shipped services a harness runs over its store (the migration
/// commit, a retention pass, the reconciler's bypass scan and comparison)
/// are run the same way for every store by `outbox_producer::conformance`
/// (this crate depends on no service); a harness adds only what its store
/// does differently: how it writes the consumer registry and watermarks,
/// and how it reads back what a run left.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store under test.
    type Store: OutboxStore;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// Runs a business command with idempotency key `command_key` that
    /// commits a PENDING event for aggregate `order/{aggregate_id}`
    /// (tenant `conformance`, version 1, event type `order.created`) with
    /// `payload`, in one transaction, under [`route`] of [`TOPIC`] (per-key
    /// ordering). A second call with the same key returns the first event
    /// id. Provided: [`Harness::emit_command`] of that request.
    async fn emit(&self, command_key: &str, aggregate_id: &str, payload: &[u8]) -> EventId {
        let request = EmitRequest {
            command_key,
            tenant: "conformance",
            aggregate_type: "order",
            aggregate_id,
            aggregate_version: 1,
            event_type: "order.created",
            payload_schema: "order-v1",
            payload,
        };
        self.emit_command(&request).await.unwrap_or_else(|e| panic!("emit {command_key}: {e}"))
    }

    /// Runs `request` as a business command in one transaction, as the
    /// store's emit does, under the suite's route of its event type
    /// ([`routes`]; a request of another event type is asked only as a
    /// repeat of an existing key). Refusals come back as
    /// [`CoreError::CommandKeyConflict`] and
    /// [`CoreError::AggregateVersionBackwards`]; nothing is committed then.
    async fn emit_command(&self, request: &EmitRequest<'_>) -> Result<EventId, CoreError>;

    /// The store's migration commit (PROTOCOL §7) of `id` to topic
    /// `to_topic` of the same cluster ([`route`] of `to_topic`), under
    /// `fence` (with the old target's `lookup` for a proven-absent move),
    /// with [`POLICY`]: `Ok(Ok(new envelope generation))` when it moved,
    /// `Ok(Err(reason))` when it was refused (nothing changed), `Err` when
    /// the store failed.
    async fn commit_migration(&self, id: &EventId, to_topic: &str, fence: &MigrationFence, lookup: Option<&LookupOutcome>) -> Result<Result<u32, String>, String>;

    /// The store's operator skip (`outbox skip`, `outbox_core::skip`) of
    /// `id` by `operator` for `reason`: `Ok(Ok(record))` when the event was
    /// closed SKIPPED (the record as stored), `Ok(Err(reason))` when the
    /// skip was refused (nothing changed), `Err` when the store failed.
    async fn skip_event(&self, id: &EventId, operator: &str, reason: &str) -> Result<Result<SkipRecord, String>, String>;

    /// The skip records (evidence) the store keeps for `id`, oldest first.
    async fn skip_records(&self, id: &EventId) -> Result<Vec<SkipRecord>, String>;

    /// Sets a route's poison policy (`outbox route poison`).
    async fn set_poison_policy(&self, rule: &PoisonRule) -> Result<(), String>;

    /// The store's release of QUARANTINED events of routes whose poison
    /// policy is skip (the reconciler's round runs it), up to `limit`: the skips made.
    async fn release_poisoned(&self, limit: usize) -> Result<Vec<SkipRecord>, String>;

    /// One retention pass (PROTOCOL §9) at the store's clock with
    /// `replay_window_ms`, under exactly this consumer registry
    /// (`(consumer, topics it reads, mandatory)`) and these watermarks,
    /// gone again afterwards: what moved PUBLISHED -> RETAINED and
    /// RETAINED -> PURGED, and how many RETAINED events a mandatory
    /// consumer held back.
    async fn purge(&self, replay_window_ms: i64, consumers: &[(&str, &[&str], bool)], watermarks: &[MemoryWatermark]) -> Result<PurgeCounts, String>;

    /// An event's stored payload bytes; `None` once purged (the tombstone keeps none).
    async fn payload(&self, id: &EventId) -> Option<Vec<u8>>;

    /// Runs the shipped reconciler's bypass scan (`Reconciler::scan_for_bypass`,
    /// retry policy [`POLICY`], clock skew allowance 1 000 ms) at the
    /// store's clock against `log` as its broker. Answers the findings the
    /// scan recorded (kind, event id), the store's scan cursor of each
    /// partition of `log` after it, and how many copies the scan handed to
    /// the receipt transaction.
    async fn bypass_scan(&self, log: &ScanLog) -> Result<ScanOutcome, String>;

    /// Registers `consumers` (critical, each with the topic names it reads;
    /// a registered one keeps its entry), sets each of `watermarks` on its
    /// log (replacing the consumer's watermark there), then runs the
    /// shipped reconciler's condition findings (`Reconciler::compare_findings`,
    /// with `thresholds`, retry policy [`POLICY`], clock skew allowance
    /// 1 000 ms) at the store's clock. Answers the open findings after it:
    /// (kind, event id, consumer id or empty).
    async fn compare_findings(&self, thresholds: &FindingThresholds, consumers: &[(String, Vec<String>)], watermarks: &[ConsumerWatermark]) -> Result<Vec<(String, String, String)>, String>;

    /// Overwrites the stored payload bytes of an event, leaving its frozen
    /// digest as it was (corruption, a bad migration script...).
    async fn tamper_payload(&self, id: &EventId, new_payload: &[u8]);

    /// The store's clock, ms since the epoch.
    fn now_ms(&self) -> i64;

    /// Moves the store's clock forward.
    fn advance_ms(&self, ms: i64);
}

/// What one retention pass did ([`Harness::purge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeCounts {
    /// PUBLISHED -> RETAINED.
    pub retained: u64,
    /// RETAINED -> PURGED.
    pub purged: u64,
    /// RETAINED events past the window held back by a mandatory consumer.
    pub held: u64,
    /// Of `held`, the events of a replaced log (`HoldReason::ReplacedLog`).
    pub replaced_log: u64,
    /// RETAINED events past the window held because the log lost their
    /// position (`HoldReason::PositionLost`; not in `held`).
    pub lost_position: u64,
}

/// The thresholds of a comparison round ([`Harness::compare_findings`]), ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FindingThresholds {
    /// `aged_pending_ms`.
    pub aged_pending_ms: i64,
    /// `unknown_slo_ms`.
    pub unknown_slo_ms: i64,
    /// `unconsumed_after_ms`.
    pub unconsumed_after_ms: i64,
}

/// A scenario's verdict.
pub type Verdict = Result<(), String>;

/// Runs every scenario in order and returns each one's name and verdict.
pub async fn run_all<H: Harness>(h: &H) -> Vec<(&'static str, Verdict)> {
    run_all_as(h, rand::random::<u64>()).await
}

/// The run id the stream-mode suites run under ([`run_all_as`]).
pub const STREAM_RUN: u64 = 1;

/// [`run_all`] under run id `run` (the scenarios' keys are named after it).
///
/// On the stream, the events of one key bucket (64, by the routing key's
/// hash) are cut in batches one after another: an event still in flight
/// holds back the later events of every key of its bucket, not only its
/// own key's, until it is settled (a receipt, or the lane when its lease
/// runs out). The scenarios assume keys independent, so under a random run
/// id two scenarios' keys sometimes share a bucket and a claim the scenario
/// expects finds nothing. The stream-mode runs use a fixed run id whose
/// keys do not collide that way.
pub async fn run_all_as<H: Harness>(h: &H, run: u64) -> Vec<(&'static str, Verdict)> {
    let run = format!("{:012x}", run & 0xffff_ffff_ffff);
    let ctx = |name: &'static str| Ctx { h, prefix: format!("conf-{run}-{name}"), offsets: offset_block() };
    vec![
        ("claim_register_accept_publishes", claims::claim_register_accept_publishes(&ctx("publish")).await),
        ("second_claimer_is_fenced", claims::second_claimer_is_fenced(&ctx("second")).await),
        ("stale_writer_after_lease_expiry_changes_nothing", claims::stale_writer_after_lease_expiry(&ctx("stale")).await),
        ("old_and_new_attempt_acked_one_primary_one_duplicate", receipts::old_and_new_attempt_acked(&ctx("both")).await),
        ("not_sent_retry_after_blind_retry_stays_unknown", reconcile::not_sent_retry_after_blind_retry(&ctx("blindnotsent")).await),
        ("divergent_payload_receipt_quarantines", receipts::divergent_payload_receipt_quarantines(&ctx("diverge")).await),
        ("receipt_of_another_topic_id_quarantines", receipts::receipt_of_another_topic_id_quarantines(&ctx("topicid")).await),
        ("receipt_under_another_key_quarantines", receipts::receipt_under_another_key_quarantines(&ctx("rekeyed")).await),
        ("unregistered_attempt_is_rejected", receipts::unregistered_attempt_is_rejected(&ctx("unreg")).await),
        ("same_receipt_twice_same_answer", receipts::same_receipt_twice_same_answer(&ctx("twice")).await),
        ("not_sent_is_pending_again_same_destination", reconcile::not_sent_is_pending_again(&ctx("notsent")).await),
        ("lease_expiry_while_sending_is_unknown", claims::lease_expiry_while_sending_is_unknown(&ctx("expiry")).await),
        ("per_key_ordering_holds_the_second_event", claims::per_key_ordering(&ctx("order")).await),
        ("reconcile_absent_retries_same_destination", reconcile::reconcile_absent_retries_same_destination(&ctx("retry")).await),
        ("reconcile_found_publishes_through_the_slot", reconcile::reconcile_found_publishes(&ctx("found")).await),
        ("tampered_payload_is_quarantined_unsent", receipts::tampered_payload_is_quarantined(&ctx("tamper")).await),
        ("late_ack_of_an_absent_attempt_converges", reconcile::late_ack_of_an_absent_attempt_converges(&ctx("refuted")).await),
        ("late_ack_of_an_absent_attempt_after_a_refused_retry_is_kept", reconcile::late_ack_after_a_refused_retry_is_kept(&ctx("refusedretry")).await),
        ("stray_divergent_message_is_evidence_not_a_quarantine", receipts::stray_divergent_message_is_evidence(&ctx("stray")).await),
        ("command_keys_and_aggregate_versions", emit::command_keys_and_aggregate_versions(&ctx("command")).await),
        ("registration_guard_refuses_every_stale_claim", claims::registration_guard(&ctx("guard")).await),
        ("reconcile_finish_writes_its_plan", reconcile::reconcile_finish_writes_its_plan(&ctx("finish")).await),
        ("migration_commit_is_fenced", migration::migration_commit_is_fenced(&ctx("migrate")).await),
        ("a_key_is_held_until_its_event_closes", claims::a_key_is_held_until_its_event_closes(&ctx("held")).await),
        ("skip_of_a_quarantined_head_frees_its_key", skip::skip_of_a_quarantined_head_frees_its_key(&ctx("skipq")).await),
        ("resend_of_a_quarantined_head_publishes_it_under_a_new_generation", skip::resend_of_a_quarantined_head_publishes_it_under_a_new_generation(&ctx("resendq")).await),
        ("skip_of_an_unprovable_unknown_head_is_fenced_and_frees_its_key", skip::skip_of_an_unprovable_unknown_head_is_fenced_and_frees_its_key(&ctx("skipu")).await),
        ("purge_waits_for_every_mandatory_watermark_on_the_same_log", retention::purge_waits_for_mandatory_watermarks(&ctx("purge")).await),
        ("purge_holds_an_event_of_a_replaced_log", retention::purge_holds_an_event_of_a_replaced_log(&ctx("replacedlog")).await),
        ("purge_checks_a_watermarks_anchor", retention::purge_checks_a_watermarks_anchor(&ctx("anchor")).await),
        ("purge_holds_an_event_first_sent_after_the_watermarks_anchor_below_it", retention::purge_holds_an_event_first_sent_after_the_watermarks_anchor_below_it(&ctx("late")).await),
        ("purge_holds_an_event_whose_receipt_names_another_log", retention::purge_holds_an_event_whose_receipt_names_another_log(&ctx("logid")).await),
        ("registration_floor_is_past_the_logs_last_receipt", claims::registration_floor(&ctx("floor")).await),
        ("the_bypass_scan_judges_every_message_of_a_page", scans::bypass_scan_judgement(&ctx("scan")).await),
        ("the_comparison_judges_each_condition_and_resolves_what_no_longer_holds", findings::comparison_findings(&ctx("findings")).await),
        ("an_event_of_a_replaced_log_is_unconsumed_whatever_a_watermark_of_its_name_says", findings::unconsumed_on_a_replaced_log(&ctx("replacedfind")).await),
        // Last: its policy of skip releases every QUARANTINED event of the
        // type, those earlier scenarios left too (it sets block again after).
        ("a_routes_poison_policy_releases_its_quarantined_heads", skip::a_routes_poison_policy_releases_its_quarantined_heads(&ctx("poison")).await),
    ]
}
