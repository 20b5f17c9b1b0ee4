//! The message of one attempt of one claimed event: the outbox headers, the
//! source and claims digest, the signature, CloudEvents and trace context.

use outbox_core::{headers, AttemptRecord, ClaimedEvent, OutgoingMessage};

/// The W3C `tracestate` header, sent with `traceparent` when one was recorded at emit.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// Builds the message for one attempt of one claimed event: the outbox
/// headers, then the CloudEvents headers when its route generation has them on.
pub fn outgoing_message(event: &ClaimedEvent, attempt: &AttemptRecord) -> OutgoingMessage {
    outgoing_message_signed(event, attempt, None)
}

/// [`outgoing_message`], plus the source and claims digest (when the store
/// knows its source) and, with `key`, the signature ([`outbox_core::trust::seal`]).
pub fn outgoing_message_signed(event: &ClaimedEvent, attempt: &AttemptRecord, key: Option<&outbox_core::trust::SigningKey>) -> OutgoingMessage {
    let mut headers = headers::build(&event.envelope, &event.destination, &event.destination_digest, &attempt.attempt_id, event.traceparent.as_deref());
    if let Some(source) = &event.source {
        if let Err(e) = outbox_core::trust::seal(&mut headers, source, key) {
            // Unreachable: `build` writes every covered header.
            tracing::error!(event_id = %event.envelope.event_id, error = %e, "could not seal the message claims");
        }
    }
    if let Some(binding) = &event.cloudevents {
        headers.extend(headers::cloudevents(&event.envelope, binding));
    }
    if let (Some(_), Some(ts)) = (&event.traceparent, &event.tracestate) {
        headers.push((TRACESTATE_HEADER.into(), ts.as_bytes().to_vec()));
    }
    OutgoingMessage {
        topic: event.destination.topic.clone(),
        partition: event.destination.partition,
        key: event.destination.routing_key.as_bytes().to_vec(),
        payload: event.payload.clone(),
        headers,
    }
}
