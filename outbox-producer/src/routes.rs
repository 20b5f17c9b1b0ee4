//! Route policies with generations. A revision is a new generation; events
//! already emitted keep the destination they froze. Generations are
//! append-only (the database refuses UPDATE and DELETE), so everything a
//! generation says, its CloudEvents switch and content type included, is
//! fixed for the events whose destination names it.

use outbox_core::{Ordering, Partitioner, RoutePolicy};
use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, Row};

use crate::error::ProducerError;

/// The current (highest) generation of the route of `event_type`.
pub async fn current<'e>(db: impl PgExecutor<'e>, event_type: &str) -> Result<Option<RoutePolicy>, ProducerError> {
    let row = sqlx::query(
        &format!("SELECT {POLICY_COLUMNS} FROM outbox_route_policies WHERE event_type = $1 ORDER BY generation DESC LIMIT 1"),
    )
    .bind(event_type)
    .fetch_optional(db)
    .await?;
    row.map(|r| from_row(&r)).transpose()
}

/// The columns [`from_row`] reads, for queries that join the current policy.
pub(crate) const POLICY_COLUMNS: &str =
    "event_type, generation, cluster_id, topic, partitions, partitioner, key_template, serializer, durability, required_acks, ordering,
     cloudevents, content_type, topic_id";

/// Reads a policy from a row carrying [`POLICY_COLUMNS`]; `None` when they are NULL (no route).
pub(crate) fn from_row_opt(r: &PgRow) -> Result<Option<RoutePolicy>, ProducerError> {
    if r.try_get::<Option<i32>, _>("generation")?.is_none() {
        return Ok(None);
    }
    from_row(r).map(Some)
}

fn from_row(r: &PgRow) -> Result<RoutePolicy, ProducerError> {
    Ok(RoutePolicy {
        event_type: r.try_get("event_type")?,
        generation: r.try_get::<i32, _>("generation")? as u32,
        cluster_id: r.try_get("cluster_id")?,
        topic: r.try_get("topic")?,
        partitions: r.try_get::<i32, _>("partitions")? as u32,
        partitioner: Partitioner::parse(r.try_get("partitioner")?)?,
        key_template: r.try_get("key_template")?,
        serializer: r.try_get("serializer")?,
        durability: r.try_get("durability")?,
        required_acks: r.try_get("required_acks")?,
        ordering: Ordering::parse(r.try_get("ordering")?)?,
        cloudevents: r.try_get("cloudevents")?,
        content_type: r.try_get("content_type")?,
        topic_id: r.try_get("topic_id")?,
    })
}

/// Publishes a new generation of the route of `policy.event_type` (the
/// `generation` field of the argument is ignored) and returns it. Only events
/// emitted after this commits are affected.
pub async fn revise<'e>(db: impl PgExecutor<'e>, policy: &RoutePolicy) -> Result<RoutePolicy, ProducerError> {
    policy.validate()?;
    let generation: i32 = sqlx::query_scalar(
        "INSERT INTO outbox_route_policies (event_type, generation, cluster_id, topic, partitions, partitioner,
             key_template, serializer, durability, required_acks, ordering, cloudevents, content_type, topic_id)
         SELECT $1, coalesce(max(generation), 0) + 1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13
         FROM outbox_route_policies WHERE event_type = $1
         RETURNING generation",
    )
    .bind(&policy.event_type)
    .bind(&policy.cluster_id)
    .bind(&policy.topic)
    .bind(policy.partitions as i32)
    .bind(policy.partitioner.as_str())
    .bind(&policy.key_template)
    .bind(&policy.serializer)
    .bind(&policy.durability)
    .bind(&policy.required_acks)
    .bind(policy.ordering.as_str())
    .bind(policy.cloudevents)
    .bind(&policy.content_type)
    .bind(&policy.topic_id)
    .fetch_one(db)
    .await?;
    Ok(RoutePolicy { generation: generation as u32, ..policy.clone() })
}

/// What [`ensure`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnsuredRoute {
    /// The current policy, with its generation.
    pub policy: RoutePolicy,
    /// Whether this call published a new generation (false: the current one
    /// already said the same).
    pub revised: bool,
}

/// Whether two policies route the same way (every field but the generation).
/// Another topic id for the same topic name (the topic was recreated) is
/// another route: [`ensure`] publishes a new generation for it.
pub fn same_route(a: &RoutePolicy, b: &RoutePolicy) -> bool {
    RoutePolicy { generation: 0, ..a.clone() } == RoutePolicy { generation: 0, ..b.clone() }
}

/// Idempotent [`revise`]: returns the current generation when it already
/// routes as `policy` does (the argument's `generation` is ignored), and
/// publishes a new generation otherwise. Safe to call at every start-up of
/// a service; concurrent callers are serialised per event type, so they
/// never publish two identical generations.
pub async fn ensure(pool: &sqlx::PgPool, policy: &RoutePolicy) -> Result<EnsuredRoute, ProducerError> {
    policy.validate()?;
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('outbox_route_policies:' || $1, 0))").bind(&policy.event_type).execute(&mut *tx).await?;
    if let Some(current) = current(&mut *tx, &policy.event_type).await? {
        if same_route(&current, policy) {
            tx.commit().await?;
            return Ok(EnsuredRoute { policy: current, revised: false });
        }
    }
    let revised = revise(&mut *tx, policy).await?;
    tx.commit().await?;
    Ok(EnsuredRoute { policy: revised, revised: true })
}

/// The current generation of every event type's route, by event type.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<RoutePolicy>, ProducerError> {
    let rows = sqlx::query(&format!(
        "SELECT DISTINCT ON (event_type) {POLICY_COLUMNS} FROM outbox_route_policies ORDER BY event_type, generation DESC"
    ))
    .fetch_all(db)
    .await?;
    rows.iter().map(from_row).collect()
}
