//! A Kafka topic's id: the 16-byte UUID a cluster gives a topic when it is
//! created (KIP-516). A topic deleted and created again under its name, or
//! the same name on a replaced cluster, has another id, so the id tells one
//! log from another where the name cannot.
//!
//! The rdkafka crate does not wrap librdkafka's DescribeTopics admin call;
//! this crate is that one call, for both sides of the outbox: the producer
//! refuses a send whose `destination.v2` froze another topic's id, and the
//! consumer tags each message it fetches with the id of its topic (a
//! replaced log then starts the consumer's reading over).

#![deny(unsafe_op_in_unsafe_fn)]

use std::time::Duration;

use rdkafka::client::{Client, ClientContext};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka_sys as sys;

/// The id of `topic` (its 16 bytes), from a DescribeTopics request sent to
/// broker `broker_id` (any broker answers it: it is a metadata request, not
/// one for the controller librdkafka would wait for), or `None` when the
/// cluster answers the all-zero id (a broker without topic ids). Bounded by
/// `timeout`, plus a second for the answer's event.
#[allow(unsafe_code)]
pub fn describe_topic_id<C: ClientContext>(client: &Client<C>, topic: &str, broker_id: i32, timeout: Duration) -> Result<Option<[u8; 16]>, String> {
    let name = std::ffi::CString::new(topic).map_err(|_| format!("topic name {topic:?} holds a NUL byte"))?;
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX).max(1);
    let rk = client.native_ptr();
    let mut names = [name.as_ptr()];
    // SAFETY: every object created below is destroyed exactly once on every
    // path; `rk` is the live handle `client` owns for the whole call; the
    // strings librdkafka returns are copied before the event that owns them
    // is destroyed.
    unsafe {
        let topics = sys::rd_kafka_TopicCollection_of_topic_names(names.as_mut_ptr(), 1);
        if topics.is_null() {
            return Err("DescribeTopics: no topic collection".into());
        }
        let options = sys::rd_kafka_AdminOptions_new(rk, sys::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS);
        if !options.is_null() {
            let mut errstr = [0 as std::os::raw::c_char; 256];
            sys::rd_kafka_AdminOptions_set_request_timeout(options, timeout_ms, errstr.as_mut_ptr(), errstr.len());
            sys::rd_kafka_AdminOptions_set_broker(options, broker_id, errstr.as_mut_ptr(), errstr.len());
        }
        let queue = sys::rd_kafka_queue_new(rk);
        sys::rd_kafka_DescribeTopics(rk, topics, options, queue);
        // One result event per request; bounded by the timeout plus a margin
        // (the request timeout answers first).
        let event = sys::rd_kafka_queue_poll(queue, timeout_ms.saturating_add(1_000));
        let out = if event.is_null() {
            Err(format!("DescribeTopics {topic}: no answer within {timeout_ms} ms"))
        } else {
            let r = describe_topics_answer(event, topic);
            sys::rd_kafka_event_destroy(event);
            r
        };
        sys::rd_kafka_queue_destroy(queue);
        if !options.is_null() {
            sys::rd_kafka_AdminOptions_destroy(options);
        }
        sys::rd_kafka_TopicCollection_destroy(topics);
        out
    }
}

/// The id of `topic` as [`describe_topic_id`] reads it, asked of the leader
/// of one of its partitions (which surely knows the topic) found in a
/// metadata request, or of any broker when none has a leader. `Err` when the
/// cluster does not answer within `timeout`, does not know the topic, or
/// refuses the request.
pub fn topic_id<C: ClientContext>(client: &Client<C>, topic: &str, timeout: Duration) -> Result<Option<[u8; 16]>, String> {
    let md = client.fetch_metadata(Some(topic), timeout).map_err(|e| format!("metadata of {topic}: {e}"))?;
    let t = md.topics().iter().find(|t| t.name() == topic).ok_or_else(|| format!("topic {topic}: not in the cluster's metadata"))?;
    if let Some(e) = t.error() {
        return Err(format!("topic {topic}: {:?}", RDKafkaErrorCode::from(e)));
    }
    let broker_id = t
        .partitions()
        .iter()
        .map(|p| p.leader())
        .find(|l| *l >= 0)
        .or_else(|| md.brokers().first().map(|b| b.id()))
        .ok_or_else(|| format!("topic {topic}: no broker in metadata"))?;
    describe_topic_id(client, topic, broker_id, timeout)
}

/// Reads the topic id of `topic` out of one DescribeTopics result event.
///
/// # Safety
/// `event` must be a live event returned by `rd_kafka_queue_poll`.
#[allow(unsafe_code)]
unsafe fn describe_topics_answer(event: *mut sys::rd_kafka_event_t, topic: &str) -> Result<Option<[u8; 16]>, String> {
    // SAFETY: `event` is live (the caller's promise), and so is every
    // pointer librdkafka hands out of it until it is destroyed; strings are
    // copied out at once.
    unsafe {
        let text = |p: *const std::os::raw::c_char| if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() };
        let err = sys::rd_kafka_event_error(event);
        if RDKafkaErrorCode::from(err) != RDKafkaErrorCode::NoError {
            return Err(format!("DescribeTopics {topic}: {}: {}", RDKafkaErrorCode::from(err), text(sys::rd_kafka_event_error_string(event))));
        }
        let result = sys::rd_kafka_event_DescribeTopics_result(event);
        if result.is_null() {
            return Err(format!("DescribeTopics {topic}: not a DescribeTopics result"));
        }
        let mut count = 0usize;
        let descs = sys::rd_kafka_DescribeTopics_result_topics(result, &mut count);
        if descs.is_null() || count == 0 {
            return Err(format!("DescribeTopics {topic}: no topic in the answer"));
        }
        for i in 0..count {
            let d = *descs.add(i);
            if d.is_null() || text(sys::rd_kafka_TopicDescription_name(d)) != topic {
                continue;
            }
            let e = sys::rd_kafka_TopicDescription_error(d);
            if !e.is_null() && RDKafkaErrorCode::from(sys::rd_kafka_error_code(e)) != RDKafkaErrorCode::NoError {
                return Err(format!("DescribeTopics {topic}: {}", text(sys::rd_kafka_error_string(e))));
            }
            let id = sys::rd_kafka_TopicDescription_topic_id(d);
            if id.is_null() {
                return Ok(None);
            }
            let hi = sys::rd_kafka_Uuid_most_significant_bits(id).to_be_bytes();
            let lo = sys::rd_kafka_Uuid_least_significant_bits(id).to_be_bytes();
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&hi);
            bytes[8..].copy_from_slice(&lo);
            return Ok(if bytes == [0u8; 16] { None } else { Some(bytes) });
        }
        Err(format!("DescribeTopics {topic}: topic not in the answer"))
    }
}
