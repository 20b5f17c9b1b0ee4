//! Reading the store's rows: attempts, receipts, claims and the frozen
//! envelope and destination of a claimed event.

use outbox_core::{AttemptRecord, AttemptState, BrokerReceipt, ClaimToken, CoreError, Destination, Envelope, EventId, StoreError};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::store_err;

pub(super) fn parse_id<T: std::str::FromStr<Err = CoreError>>(s: &str) -> Result<T, StoreError> {
    s.parse().map_err(StoreError::Core)
}

pub(super) fn attempt_from_row(r: &PgRow) -> Result<AttemptRecord, StoreError> {
    let g = |e: sqlx::Error| store_err(e);
    Ok(AttemptRecord {
        attempt_id: parse_id(r.try_get::<&str, _>("attempt_id").map_err(g)?)?,
        event_id: parse_id(r.try_get::<&str, _>("event_id").map_err(g)?)?,
        envelope_generation: r.try_get::<i32, _>("envelope_generation").map_err(g)? as u32,
        attempt_generation: r.try_get::<i32, _>("attempt_generation").map_err(g)? as u32,
        claim_generation: r.try_get::<i64, _>("claim_generation").map_err(g)? as u64,
        owner: r.try_get("owner").map_err(g)?,
        state: AttemptState::parse(r.try_get("state").map_err(g)?)?,
        destination_digest: r.try_get("destination_digest").map_err(g)?,
        started_at_ms: r.try_get("started_at_ms").map_err(g)?,
        send_deadline_ms: r.try_get("send_deadline_ms").map_err(g)?,
        scan_from_offset: r.try_get("scan_from_offset").map_err(g)?,
        scan_anchor: r.try_get::<Option<&str>, _>("scan_anchor_event_id").map_err(g)?.map(parse_id).transpose()?,
        scan_anchor_attempt: r.try_get::<Option<&str>, _>("scan_anchor_attempt_id").map_err(g)?.map(parse_id).transpose()?,
    })
}

pub(super) fn receipt_from_row(r: &PgRow) -> Result<BrokerReceipt, StoreError> {
    let g = |e: sqlx::Error| store_err(e);
    Ok(BrokerReceipt {
        event_id: parse_id(r.try_get::<&str, _>("event_id").map_err(g)?)?,
        envelope_generation: r.try_get::<i32, _>("envelope_generation").map_err(g)? as u32,
        attempt_id: parse_id(r.try_get::<&str, _>("attempt_id").map_err(g)?)?,
        payload_digest: r.try_get("payload_digest").map_err(g)?,
        destination_digest: r.try_get("destination_digest").map_err(g)?,
        cluster_id: r.try_get("cluster_id").map_err(g)?,
        topic: r.try_get("topic").map_err(g)?,
        topic_id: r.try_get("topic_id").map_err(g)?,
        partition: r.try_get("partition").map_err(g)?,
        offset: r.try_get("offset").map_err(g)?,
        key: r.try_get("message_key").map_err(g)?,
        log_id: r.try_get("log_id").map_err(g)?,
    })
}

pub(super) const ATTEMPT_COLUMNS: &str =
    "attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms, scan_from_offset, send_deadline_ms, scan_anchor_event_id, scan_anchor_attempt_id";
pub(super) const RECEIPT_COLUMNS: &str = "event_id, envelope_generation, attempt_id, payload_digest, destination_digest, cluster_id, topic, topic_id, partition, \"offset\", message_key, log_id";

/// A claimed row whose frozen envelope or destination cannot be read:
/// `(event id, envelope generation, why)`.
pub(super) type Unreadable = (String, i32, String);

/// The frozen envelope and destination of a claimed row (columns
/// `envelope_canonical`, `destination_canonical`), or why they cannot be read.
pub(super) fn frozen_records(r: &PgRow) -> Result<Result<(Envelope, Destination), Unreadable>, StoreError> {
    let envelope = Envelope::from_canonical(r.try_get::<&[u8], _>("envelope_canonical").map_err(store_err)?);
    let destination = Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical").map_err(store_err)?);
    Ok(match envelope.and_then(|e| destination.map(|d| (e, d))) {
        Ok(p) => Ok(p),
        Err(e) => Err((r.try_get("event_id").map_err(store_err)?, r.try_get("envelope_generation").map_err(store_err)?, e.to_string())),
    })
}

/// The claim a row's columns `claim_owner`, `claim_generation` and
/// `lease_until_ms` describe.
pub(super) fn claim_token(r: &PgRow, event_id: &EventId) -> Result<ClaimToken, StoreError> {
    Ok(ClaimToken {
        event_id: event_id.clone(),
        owner: r.try_get("claim_owner").map_err(store_err)?,
        claim_generation: r.try_get::<i64, _>("claim_generation").map_err(store_err)? as u64,
        lease_until_ms: r.try_get("lease_until_ms").map_err(store_err)?,
    })
}
