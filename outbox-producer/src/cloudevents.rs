//! CloudEvents Kafka protocol binding (binary mode): what a message adds to
//! the outbox headers, and where it comes from.
//!
//! * `ce_source` is the outbox's source identity, one per database, made
//!   when the migrations first run (`outbox_identity`, `urn:uuid:<random>`)
//!   and never changed.
//! * Whether an event carries the headers, and its `content-type`, is the
//!   route policy generation's (`cloudevents`, `content_type`). The
//!   destination freezes the generation at commit and generations are
//!   append-only, so the choice is fixed at commit: a later revision that
//!   switches CloudEvents off affects only events emitted after it.
//!
//! * `outbox-source` carries the same identity on every message, whatever
//!   the route's CloudEvents switch ([`outbox_core::trust`]).
//!
//! Both are immutable, so a store reads each once and keeps it.

use std::collections::HashMap;
use std::sync::Mutex;

use outbox_core::{headers, CloudEventsBinding, ClaimedEvent, StoreError, DEFAULT_CONTENT_TYPE};
use sqlx::PgConnection;

use crate::error::store_err;

/// Most route generations one store remembers; past it the memory starts over.
pub const MAX_CACHED_ROUTE_GENERATIONS: usize = 10_000;

/// The outbox's CloudEvents source identity (`ce_source`).
pub async fn source<'e>(db: impl sqlx::PgExecutor<'e>) -> Result<String, StoreError> {
    let source: Option<String> = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_optional(db).await.map_err(store_err)?;
    let source = source.ok_or_else(|| StoreError::Backend { message: "outbox_identity holds no source identity (was the table emptied by hand?)".into(), retryable: false })?;
    headers::validate_source(&source)?;
    Ok(source)
}

#[derive(Debug, Default)]
struct Known {
    source: Option<String>,
    /// (route policy, generation) -> the content type when CloudEvents is on.
    routes: HashMap<(String, u32), Option<String>>,
}

/// What one store has read of the (immutable) source identity and route generations.
#[derive(Debug, Default)]
pub(crate) struct CloudEventsCache {
    known: Mutex<Known>,
}

impl CloudEventsCache {
    /// Fills `events` from what is known already; false when something must be read.
    pub(crate) fn fill_from_known(&self, events: &mut [ClaimedEvent]) -> bool {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let Some(source) = &known.source else { return events.is_empty() };
        let mut bindings = Vec::with_capacity(events.len());
        for e in events.iter() {
            match known.routes.get(&(e.destination.route_policy.clone(), e.destination.route_policy_generation)) {
                Some(ct) => bindings.push(ct.clone().map(|content_type| CloudEventsBinding { source: source.clone(), content_type })),
                None => return false,
            }
        }
        for (e, b) in events.iter_mut().zip(bindings) {
            e.cloudevents = b;
            e.source = Some(source.clone());
        }
        true
    }

    /// Fills [`ClaimedEvent::cloudevents`] of `events` from their frozen route
    /// generations, reading on `conn` only what is not known yet.
    pub(crate) async fn attach(&self, conn: &mut PgConnection, events: &mut [ClaimedEvent]) -> Result<(), StoreError> {
        if self.fill_from_known(events) {
            return Ok(());
        }
        let (need_source, missing) = {
            let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
            let mut missing: Vec<(String, u32)> = events
                .iter()
                .map(|e| (e.destination.route_policy.clone(), e.destination.route_policy_generation))
                .filter(|k| !known.routes.contains_key(k))
                .collect();
            missing.sort();
            missing.dedup();
            (known.source.is_none(), missing)
        };
        let source = if need_source { Some(source(&mut *conn).await?) } else { None };
        let mut found: Vec<((String, u32), Option<String>)> = Vec::new();
        if !missing.is_empty() {
            let rows: Vec<(String, i32, bool, String)> = sqlx::query_as(
                "SELECT p.event_type, p.generation, p.cloudevents, p.content_type
                 FROM UNNEST($1::text[], $2::int[]) AS k(event_type, generation)
                 JOIN outbox_route_policies p ON p.event_type = k.event_type AND p.generation = k.generation",
            )
            .bind(missing.iter().map(|k| k.0.as_str()).collect::<Vec<_>>())
            .bind(missing.iter().map(|k| k.1 as i32).collect::<Vec<_>>())
            .fetch_all(&mut *conn)
            .await
            .map_err(store_err)?;
            found = rows.into_iter().map(|(t, g, on, ct)| ((t, g as u32), on.then_some(ct))).collect();
        }
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = source {
            known.source = Some(s);
        }
        if known.routes.len() + found.len() > MAX_CACHED_ROUTE_GENERATIONS {
            known.routes.clear();
        }
        let found: HashMap<_, _> = found.into_iter().collect();
        let source = known.source.clone().unwrap_or_default();
        for e in events.iter_mut() {
            let key = (e.destination.route_policy.clone(), e.destination.route_policy_generation);
            let content_type = match known.routes.get(&key).or_else(|| found.get(&key)) {
                Some(ct) => ct.clone(),
                // A destination naming no stored generation (written by
                // hand): the default, on with opaque bytes; not remembered.
                None => Some(DEFAULT_CONTENT_TYPE.to_owned()),
            };
            e.cloudevents = content_type.map(|content_type| CloudEventsBinding { source: source.clone(), content_type });
            e.source = Some(source.clone());
        }
        known.routes.extend(found);
        Ok(())
    }
}
