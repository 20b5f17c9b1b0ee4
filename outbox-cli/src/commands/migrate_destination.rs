//! `outbox migrate-destination`: moving one event to another destination,
//! with proof that it was not delivered to the old one.

use anyhow::{bail, Context};
use outbox_core::{EventId, RetryPolicy, RoutePolicy};
use outbox_producer::{MigrationOutcome, PgStore};

use super::broker::{connect_kafka, kafka_flags};
use super::db::open;
use super::EXIT_REFUSED;
use crate::cli::MigrateDestinationArgs;
use crate::config::{self, FileConfig};

pub(super) async fn migrate_destination_cmd(url: &str, file: &FileConfig, a: &MigrateDestinationArgs) -> anyhow::Result<u8> {
    let id: EventId = a.event_id.parse().with_context(|| format!("{:?} is not an eventId", a.event_id))?;
    let pool = open(url, 4).await?;
    let row: Option<(String, String, String, String, String)> = sqlx::query_as(
        "SELECT e.event_type, e.state, e.tenant, e.aggregate_type, e.aggregate_id FROM outbox_events e WHERE e.event_id = $1",
    )
    .bind(id.as_str())
    .fetch_optional(&pool)
    .await?;
    let Some((event_type, state, tenant, aggregate_type, aggregate_id)) = row else { bail!("no outbox event {id}") };
    let current = outbox_producer::routes::current(&pool, &event_type).await?;
    let explicit = a.to_cluster.is_some() || a.to_topic.is_some() || a.to_partitions.is_some();
    let route: RoutePolicy = match (current, explicit) {
        (Some(mut r), true) => {
            // The current route's topic id names its own topic on its own
            // cluster: another topic or cluster has another id (or none
            // recorded), so the destination names none (destination.v1)
            // rather than one a send would be refused for.
            if a.to_cluster.as_ref().is_some_and(|c| *c != r.cluster_id) || a.to_topic.as_ref().is_some_and(|t| *t != r.topic) {
                r.topic_id = None;
            }
            if let Some(c) = &a.to_cluster {
                r.cluster_id = c.clone();
            }
            if let Some(t) = &a.to_topic {
                r.topic = t.clone();
            }
            if let Some(p) = a.to_partitions {
                r.partitions = p;
            }
            r
        }
        (Some(r), false) => r,
        (None, true) => match (&a.to_cluster, &a.to_topic, a.to_partitions) {
            (Some(c), Some(t), Some(p)) => RoutePolicy::new(&event_type, c, t, p),
            _ => bail!("no route policy for {event_type}: pass all of --to-cluster, --to-topic and --to-partitions"),
        },
        (None, false) => bail!("no route policy for {event_type}: pass --to-cluster, --to-topic and --to-partitions"),
    };
    let destination = route.resolve(&tenant, &aggregate_type, &aggregate_id)?;
    println!(
        "event {id} ({state}) -> {}/{} partition {} of {} key {} (route {}@{}, destination {})",
        destination.cluster_id,
        destination.topic,
        destination.partition,
        destination.partitions,
        destination.routing_key,
        route.event_type,
        route.generation,
        destination.digest()
    );
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let broker = connect_kafka(kafka).await?;
    let retry = RetryPolicy { in_flight_bound_ms: a.in_flight_bound_ms.unwrap_or(RetryPolicy::default().in_flight_bound_ms), ..RetryPolicy::default() };
    let store = PgStore::new(pool.clone());
    // A dry run runs the same eligibility check (reads, lookup, decision
    // under the row lock) and changes nothing.
    match outbox_producer::migration::migrate_destination_with(&store, broker.as_ref(), &id, &route, &a.operator, &retry, a.dry_run).await? {
        MigrationOutcome::WouldMigrate { from_generation, to_destination_digest, proof } => {
            println!("dry run: nothing changed; it would migrate envelope generation {from_generation} -> {}, destination {to_destination_digest}, proof {proof}", from_generation + 1);
            Ok(0)
        }
        MigrationOutcome::Migrated { from_generation, to_generation, to_destination_digest } => {
            println!("migrated: envelope generation {from_generation} -> {to_generation}, destination {to_destination_digest}; the event is PENDING for its new destination");
            Ok(0)
        }
        MigrationOutcome::Refused { reason } => {
            println!("refused: {reason}; nothing changed");
            Ok(EXIT_REFUSED)
        }
    }
}
