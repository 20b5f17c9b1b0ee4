//! Names of the message headers every dispatcher writes and every consumer
//! and reconciler reads. The values are UTF-8 text.

/// Always `outboxEnvelope.v1`: tells readers how to interpret the others.
pub const SCHEMA: &str = "outbox-schema";
/// The eventId.
pub const EVENT_ID: &str = "outbox-event-id";
/// The envelope generation, decimal.
pub const ENVELOPE_GENERATION: &str = "outbox-envelope-generation";
/// The attemptId of the attempt that produced this message.
pub const ATTEMPT_ID: &str = "outbox-attempt-id";
/// `sha256:` digest of the message value.
pub const PAYLOAD_DIGEST: &str = "outbox-payload-digest";
/// `sha256:` digest of the canonical destination.
pub const DESTINATION_DIGEST: &str = "outbox-destination-digest";
/// The canonical `destination.v1` bytes, so a reader can recompute the digest
/// and compare topic, partition and key with where the message really is.
pub const DESTINATION: &str = "outbox-destination";
/// The event type.
pub const EVENT_TYPE: &str = "outbox-event-type";
/// The tenant.
pub const TENANT: &str = "outbox-tenant";
/// The aggregate, `type/id@version`.
pub const AGGREGATE: &str = "outbox-aggregate";
/// W3C trace context, when a trace is active.
pub const TRACEPARENT: &str = "traceparent";
