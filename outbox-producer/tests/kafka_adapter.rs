//! The Kafka adapter against librdkafka's in-process Kafka-protocol mock
//! cluster, each test injecting a real fault and checking the outcome.
//!
//! The mock cluster is not `Send`: it lives on the test thread, in the test
//! body, and outlives the adapter (declared first, dropped last).

use std::time::{Duration, Instant};

use outbox_core::{headers, AttemptId, Broker, Destination, EmitRequest, Envelope, EventId, LookupOutcome, OutgoingMessage, RoutePolicy, SendOutcome};
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

type Mock = MockCluster<'static, DefaultProducerContext>;

const BROKER: i32 = 1;
const PARTITIONS: u32 = 4;

fn mock(topic: &str) -> Mock {
    let cluster = MockCluster::new(1).expect("mock cluster");
    cluster.create_topic(topic, PARTITIONS as i32, 1).expect("create topic");
    cluster
}

fn config(cluster: &Mock, message_timeout_ms: u64) -> KafkaConfig {
    let mut c = KafkaConfig::new(cluster.bootstrap_servers());
    c.message_timeout_ms = message_timeout_ms;
    c.request_timeout_ms = message_timeout_ms;
    c.lookup_timeout_ms = 10_000;
    c.connect_timeout_ms = 10_000;
    c
}

async fn connect(cluster: &Mock, message_timeout_ms: u64) -> KafkaBroker {
    KafkaBroker::connect(config(cluster, message_timeout_ms)).await.expect("connect")
}

/// One event frozen for `broker`'s real cluster, and its message for one attempt.
struct Event {
    envelope: Envelope,
    destination: Destination,
    attempt: AttemptId,
    message: OutgoingMessage,
}

fn event(broker: &KafkaBroker, topic: &str, aggregate_id: &str) -> Event {
    event_of(broker, topic, None, aggregate_id)
}

/// [`event`] with a destination naming `topic_id` (`destination.v2`) when given.
fn event_of(broker: &KafkaBroker, topic: &str, topic_id: Option<&str>, aggregate_id: &str) -> Event {
    let now_ms = 1_700_000_000_000u64;
    let payload = format!("{{\"order\":\"{aggregate_id}\"}}").into_bytes();
    let request = EmitRequest {
        command_key: aggregate_id,
        tenant: "t1",
        aggregate_type: "order",
        aggregate_id,
        aggregate_version: 1,
        event_type: "order.created",
        payload_schema: "s",
        payload: &payload,
    };
    let policy = RoutePolicy { topic_id: topic_id.map(str::to_owned), ..RoutePolicy::new("order.created", broker.cluster_id(), topic, PARTITIONS) };
    let (envelope, destination) = request.freeze(EventId::generate(now_ms), now_ms as i64, 7, &policy).expect("freeze");
    let attempt = AttemptId::generate(now_ms);
    let message = OutgoingMessage {
        topic: destination.topic.clone(),
        partition: destination.partition,
        key: destination.routing_key.clone().into_bytes(),
        payload,
        headers: headers::build(&envelope, &destination, &destination.digest(), &attempt, None),
    };
    Event { envelope, destination, attempt, message }
}

fn acked(outcome: &SendOutcome) -> (i32, i64) {
    match outcome {
        SendOutcome::Acked { partition, offset } => (*partition, *offset),
        other => panic!("expected Acked, got {other:?}"),
    }
}

/// Looks `e` up from 0 and checks the one receipt found against what was frozen.
async fn assert_found_once(broker: &KafkaBroker, e: &Event) -> i64 {
    match broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await {
        LookupOutcome::Found(receipts) => {
            assert_eq!(receipts.len(), 1, "{receipts:?}");
            let r = &receipts[0];
            assert_eq!(r.event_id, e.envelope.event_id);
            assert_eq!(r.attempt_id, e.attempt);
            assert_eq!(r.envelope_generation, e.envelope.envelope_generation);
            assert_eq!(r.payload_digest, e.envelope.payload_digest);
            assert_eq!(r.destination_digest, e.destination.digest());
            assert_eq!(r.cluster_id, broker.cluster_id());
            assert!(e.destination.admits(&r.cluster_id, &r.topic, r.partition));
            assert_eq!(r.key.as_deref(), Some(e.destination.routing_key.as_bytes()), "the key read back");
            r.offset
        }
        other => panic!("expected Found, got {other:?}"),
    }
}

#[tokio::test]
async fn plain_send_is_acked_and_found_by_lookup() {
    let started = Instant::now();
    let cluster = mock("orders");
    let broker = connect(&cluster, 5_000).await;
    assert!(!broker.cluster_id().is_empty());
    assert!(broker.supports_lookup());
    assert_eq!(broker.partition_count("orders").await.expect("partitions"), PARTITIONS);

    let e = event(&broker, "orders", "o-1");
    let (partition, offset) = acked(&broker.send(e.message.clone()).await);
    assert_eq!(partition, e.destination.partition);
    assert_eq!(assert_found_once(&broker, &e).await, offset);

    // Another event id on the same partition: provably absent.
    let other = event(&broker, "orders", "o-1");
    assert_ne!(other.envelope.event_id, e.envelope.event_id);
    assert_eq!(broker.lookup(&other.destination, &other.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Absent);
    // A lower bound past the message: the range no longer holds it.
    assert_eq!(broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(offset + 1)).await, LookupOutcome::Absent);
    // A destination on another cluster is not answered from this one.
    let mut elsewhere = e.destination.clone();
    elsewhere.cluster_id = "another-cluster".into();
    assert!(matches!(broker.lookup(&elsewhere, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Unavailable(_)));
    eprintln!("plain_send_is_acked_and_found_by_lookup: {:?}", started.elapsed());
}

#[tokio::test]
async fn ack_slower_than_message_timeout_is_unknown_but_written() {
    let started = Instant::now();
    let cluster = mock("orders");
    let broker = connect(&cluster, 2_000).await;
    // Warm up: producer id obtained, connection established.
    let warm = event(&broker, "orders", "o-warm");
    acked(&broker.send(warm.message.clone()).await);

    cluster.broker_round_trip_time(BROKER, Duration::from_millis(4_000)).expect("rtt");
    let e = event(&broker, "orders", "o-2");
    let outcome = broker.send(e.message.clone()).await;
    eprintln!("outcome: {outcome:?} after {:?}", started.elapsed());
    assert!(matches!(outcome, SendOutcome::Unknown(_)), "expected Unknown, got {outcome:?}");

    // The broker wrote it all the same: "written but not ACKed".
    cluster.broker_round_trip_time(BROKER, Duration::ZERO).expect("rtt");
    assert_found_once(&broker, &e).await;
    // The producer recovers (epoch bump) and keeps sending.
    let after = event(&broker, "orders", "o-2b");
    acked(&broker.send(after.message.clone()).await);
    eprintln!("ack_slower_than_message_timeout_is_unknown_but_written: {:?}", started.elapsed());
}

#[tokio::test]
async fn permanent_produce_error_is_not_persisted_and_absent() {
    let started = Instant::now();
    let cluster = mock("orders");
    let broker = connect(&cluster, 5_000).await;
    let warm = event(&broker, "orders", "o-warm");
    acked(&broker.send(warm.message.clone()).await);

    // librdkafka classifies TOPIC_AUTHORIZATION_FAILED on Produce as
    // PERMANENT | MSG_NOT_PERSISTED (rdkafka_request.c).
    cluster.request_errors(RDKafkaApiKey::Produce, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED]);
    let e = event(&broker, "orders", "o-3");
    let outcome = broker.send(e.message.clone()).await;
    eprintln!("outcome: {outcome:?}");
    // Reported by the delivery report's persistence status, not refused at enqueue.
    assert!(matches!(&outcome, SendOutcome::NotPersisted(r) if !r.starts_with("not enqueued")), "expected NotPersisted, got {outcome:?}");
    assert_eq!(broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Absent);

    // Right after, librdkafka may still hold the topic's authorization error
    // and refuse at enqueue (NotPersisted, and absent), or already send (Acked).
    let again = event(&broker, "orders", "o-3b");
    let outcome = broker.send(again.message.clone()).await;
    eprintln!("outcome: {outcome:?}");
    match outcome {
        SendOutcome::Acked { .. } => {
            assert_found_once(&broker, &again).await;
        }
        SendOutcome::NotPersisted(_) => assert_eq!(broker.lookup(&again.destination, &again.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Absent),
        other => panic!("expected Acked or NotPersisted, got {other:?}"),
    }
    // The producer keeps working.
    cluster.create_topic("payments", PARTITIONS as i32, 1).expect("create topic");
    let other = event(&broker, "payments", "o-3c");
    acked(&broker.send(other.message.clone()).await);
    eprintln!("permanent_produce_error_is_not_persisted_and_absent: {:?}", started.elapsed());
}

#[tokio::test]
async fn broker_down_before_sending_is_not_persisted_and_absent() {
    let started = Instant::now();
    let cluster = mock("orders");
    // While the leader is unreachable, librdkafka notices expired messages
    // between reconnect attempts: a short reconnect backoff keeps the report
    // close to message.timeout.ms (default backoff: up to 10 s later).
    let cfg = config(&cluster, 2_000).with_setting("reconnect.backoff.max.ms", "500");
    let broker = KafkaBroker::connect(cfg).await.expect("connect");
    let warm = event(&broker, "orders", "o-warm");
    acked(&broker.send(warm.message.clone()).await);

    cluster.broker_down(BROKER).expect("down");
    let e = event(&broker, "orders", "o-4");
    let outcome = broker.send(e.message.clone()).await;
    eprintln!("outcome: {outcome:?} after {:?}", started.elapsed());
    assert!(matches!(outcome, SendOutcome::NotPersisted(_)), "expected NotPersisted, got {outcome:?}");

    cluster.broker_up(BROKER).expect("up");
    assert_eq!(broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Absent);
    eprintln!("broker_down_before_sending_is_not_persisted_and_absent: {:?}", started.elapsed());
}

#[tokio::test]
async fn unknown_partition_is_not_persisted() {
    let cluster = mock("orders");
    let broker = connect(&cluster, 2_000).await;
    let e = event(&broker, "orders", "o-5");
    let mut m = e.message.clone();
    m.partition = PARTITIONS as i32 + 3;
    let outcome = broker.send(m).await;
    assert!(matches!(outcome, SendOutcome::NotPersisted(_)), "expected NotPersisted, got {outcome:?}");
    let mut m = e.message.clone();
    m.partition = -1;
    assert!(matches!(broker.send(m).await, SendOutcome::NotPersisted(_)));
}

#[tokio::test]
async fn lookup_with_all_brokers_down_is_unavailable() {
    let started = Instant::now();
    let cluster = mock("orders");
    let mut cfg = config(&cluster, 2_000);
    cfg.lookup_timeout_ms = 2_000;
    let broker = KafkaBroker::connect(cfg).await.expect("connect");
    let e = event(&broker, "orders", "o-6");
    acked(&broker.send(e.message.clone()).await);

    cluster.broker_down(-1).expect("down");
    let outcome = broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await;
    assert!(matches!(outcome, LookupOutcome::Unavailable(_)), "expected Unavailable, got {outcome:?}");
    assert!(started.elapsed() < Duration::from_secs(15));
    eprintln!("lookup_with_all_brokers_down_is_unavailable: {:?}", started.elapsed());
}

#[tokio::test]
async fn lookup_over_its_bound_is_unavailable() {
    let cluster = mock("orders");
    let mut cfg = config(&cluster, 5_000);
    cfg.lookup_max_messages = 2;
    let broker = KafkaBroker::connect(cfg).await.expect("connect");
    let mut last = None;
    for i in 0..3 {
        let e = event(&broker, "orders", "o-7");
        acked(&broker.send(e.message.clone()).await);
        assert!(i < 2 || last.is_some());
        last = Some(e);
    }
    let e = last.expect("sent");
    // Three messages on the partition, bound two: no answer from offset 0...
    assert!(matches!(broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Unavailable(_)));
    // ...but a sound lower bound narrows the range enough.
    assert!(matches!(broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(1)).await, LookupOutcome::Found(_)));
}

#[tokio::test]
async fn stalled_caller_still_gets_the_genuine_ack() {
    let started = Instant::now();
    let cluster = mock("orders");
    let broker = connect(&cluster, 5_000).await;
    let e = event(&broker, "orders", "o-8");

    let mut send = Box::pin(broker.send(e.message.clone()));
    // One poll hands the message over; then the caller stalls.
    assert!(futures::poll!(&mut send).is_pending());
    let deadline = Instant::now() + Duration::from_secs(10);
    let offset = loop {
        // The broker wrote it and librdkafka reported on it while nobody polled.
        if let LookupOutcome::Found(r) = broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await {
            break r[0].offset;
        }
        assert!(Instant::now() < deadline, "message never reached the log");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let wait = Instant::now() + Duration::from_secs(10);
    while broker.in_flight() > 0 {
        assert!(Instant::now() < wait, "delivery report never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The caller resumes and gets the genuine outcome.
    let (partition, acked_offset) = acked(&send.await);
    assert_eq!((partition, acked_offset), (e.destination.partition, offset));
    eprintln!("stalled_caller_still_gets_the_genuine_ack: {:?}", started.elapsed());
}

#[tokio::test]
async fn detached_sends_respect_the_in_flight_bound() {
    let started = Instant::now();
    let cluster = mock("orders");
    let mut cfg = config(&cluster, 5_000);
    cfg.max_in_flight = 2;
    let broker = KafkaBroker::connect(cfg).await.expect("connect");
    let events: Vec<Event> = (0..20).map(|i| event(&broker, "orders", &format!("o-{i}"))).collect();
    let handles: Vec<_> = events.iter().map(|e| tokio::spawn(broker.send_detached(e.message.clone()))).collect();
    assert!(broker.in_flight() <= 2);
    let mut positions = Vec::new();
    for (e, h) in events.iter().zip(handles) {
        let (partition, offset) = acked(&h.await.expect("join"));
        assert_eq!(partition, e.destination.partition);
        positions.push((partition, offset));
    }
    positions.sort();
    positions.dedup();
    assert_eq!(positions.len(), 20);
    assert_eq!(broker.in_flight(), 0);
    eprintln!("detached_sends_respect_the_in_flight_bound: {:?}", started.elapsed());
}

#[tokio::test]
async fn config_is_checked() {
    let mut c = KafkaConfig::new("127.0.0.1:9");
    assert!(c.validate().is_ok());
    c.max_in_flight = 0;
    assert!(c.validate().is_err());
    let c = KafkaConfig::new("127.0.0.1:9").with_setting("enable.idempotence", "false");
    assert!(c.validate().is_err());
    let c = KafkaConfig::new("127.0.0.1:9").with_setting("client.id", "outbox");
    assert!(c.validate().is_ok());
    assert!(KafkaBroker::connect(KafkaConfig::new(" ")).await.is_err());
}

/// Runs against a real cluster when `OUTBOX_TEST_KAFKA_BOOTSTRAP` is set (the
/// tests' variable, never the services' `OUTBOX_KAFKA_BOOTSTRAP`); the
/// topic is `OUTBOX_KAFKA_TEST_TOPIC` (default `outbox-adapter-test`) and must exist.
#[tokio::test]
async fn real_cluster_send_and_lookup_when_configured() {
    let cfg = match std::env::var("OUTBOX_TEST_KAFKA_BOOTSTRAP") {
        Ok(b) if !b.trim().is_empty() => KafkaConfig::new(b.trim()),
        _ => {
            eprintln!("OUTBOX_TEST_KAFKA_BOOTSTRAP not set: skipped");
            return;
        }
    };
    let topic = std::env::var("OUTBOX_KAFKA_TEST_TOPIC").unwrap_or_else(|_| "outbox-adapter-test".into());
    let broker = KafkaBroker::connect(cfg).await.expect("connect");
    let partitions = broker.partition_count(&topic).await.expect("topic");
    let payload = b"{\"order\":\"real\"}".to_vec();
    let request = EmitRequest { command_key: "c", tenant: "t1", aggregate_type: "order", aggregate_id: "real", aggregate_version: 1, event_type: "order.created", payload_schema: "s", payload: &payload };
    let now_ms = 1_700_000_000_000u64;
    let policy = RoutePolicy::new("order.created", broker.cluster_id(), &topic, partitions);
    let (envelope, destination) = request.freeze(EventId::generate(now_ms), now_ms as i64, 7, &policy).expect("freeze");
    let attempt = AttemptId::generate(now_ms);
    let message = OutgoingMessage {
        topic: topic.clone(),
        partition: destination.partition,
        key: destination.routing_key.clone().into_bytes(),
        payload,
        headers: headers::build(&envelope, &destination, &destination.digest(), &attempt, None),
    };
    let (_, offset) = acked(&broker.send(message).await);
    match broker.lookup(&destination, &envelope.event_id, &outbox_core::ScanFrom::at(offset)).await {
        LookupOutcome::Found(r) => assert_eq!(r[0].offset, offset),
        other => panic!("expected Found, got {other:?}"),
    }
}

#[tokio::test]
async fn divergent_and_unreadable_matches_are_reported_not_hidden() {
    let cluster = mock("orders");
    let broker = connect(&cluster, 5_000).await;

    // Same headers, other bytes: the receipt carries the digest of what is
    // really in the log, so the receipt decision quarantines it.
    let e = event(&broker, "orders", "o-9");
    let mut tampered = e.message.clone();
    tampered.payload = b"{\"order\":\"forged\"}".to_vec();
    let (_, offset) = acked(&broker.send(tampered.clone()).await);
    match broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await {
        LookupOutcome::Found(r) => {
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].offset, offset);
            assert_eq!(r[0].payload_digest, outbox_core::sha256_digest(&tampered.payload));
            assert_ne!(r[0].payload_digest, e.envelope.payload_digest);
        }
        other => panic!("expected Found, got {other:?}"),
    }

    // Only the eventId header is readable: still reported, from what can be read.
    let f = event(&broker, "orders", "o-10");
    let mut foreign = f.message.clone();
    foreign.headers = vec![(headers::EVENT_ID.to_owned(), f.envelope.event_id.as_str().as_bytes().to_vec()), (headers::SCHEMA.to_owned(), b"garbage".to_vec())];
    let (_, offset) = acked(&broker.send(foreign.clone()).await);
    match broker.lookup(&f.destination, &f.envelope.event_id, &outbox_core::ScanFrom::at(0)).await {
        LookupOutcome::Found(r) => {
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].event_id, f.envelope.event_id);
            assert_eq!(r[0].offset, offset);
            assert_eq!(r[0].envelope_generation, 0);
            assert_eq!(r[0].destination_digest, "");
            assert_eq!(r[0].payload_digest, outbox_core::sha256_digest(&foreign.payload));
        }
        other => panic!("expected Found, got {other:?}"),
    }
}

/// Issue 47: a forged message naming a registered attempt (its headers)
/// with the frozen payload, on the frozen partition, but under another
/// message key than the frozen destination's routing key. A consumer that
/// partitions work by key sees the event under the wrong key; it is not the
/// event's publication. The lookup's receipt says which key the message
/// carries, and the receipt decision quarantines it as a key mismatch.
#[tokio::test]
async fn a_forged_message_under_another_key_is_not_the_events_publication() {
    let cluster = mock("orders");
    let broker = connect(&cluster, 5_000).await;

    let e = event(&broker, "orders", "o-47");
    let mut forged = e.message.clone();
    forged.key = b"tenant-9.order.someone-else".to_vec();
    assert_ne!(forged.key, e.destination.routing_key.as_bytes());
    let (_, offset) = acked(&broker.send(forged).await);
    let found = match broker.lookup(&e.destination, &e.envelope.event_id, &outbox_core::ScanFrom::at(0)).await {
        LookupOutcome::Found(r) => r,
        other => panic!("expected Found, got {other:?}"),
    };
    assert_eq!(found.len(), 1, "{found:?}");
    let receipt = &found[0];
    assert_eq!(receipt.offset, offset);
    // Headers and payload are the frozen ones: only the key differs.
    assert_eq!(receipt.payload_digest, e.envelope.payload_digest);
    assert_eq!(receipt.destination_digest, e.destination.digest());
    assert!(e.destination.admits(&receipt.cluster_id, &receipt.topic, receipt.partition));

    let attempt = outbox_core::AttemptRecord {
        attempt_id: e.attempt.clone(),
        event_id: e.envelope.event_id.clone(),
        envelope_generation: e.envelope.envelope_generation,
        attempt_generation: 1,
        claim_generation: 1,
        owner: "w1".into(),
        state: outbox_core::AttemptState::Unknown,
        destination_digest: e.destination.digest(),
        started_at_ms: 0,
        send_deadline_ms: None,
        scan_from_offset: 0,
        scan_anchor: None,
        scan_anchor_attempt: None,
    };
    let locked = outbox_core::LockedEvent {
        event_id: e.envelope.event_id.clone(),
        envelope_generation: e.envelope.envelope_generation,
        state: outbox_core::EventState::Reconciling,
        payload_digest: e.envelope.payload_digest.clone(),
        destination_digest: e.destination.digest(),
        destination: e.destination.clone(),
        slot: None,
    };
    let decision = outbox_core::decide_receipt(&locked, &[attempt], receipt);
    assert!(
        !decision.is_primary(),
        "a message under key {:?} was accepted as the publication of an event frozen with routing key {:?}: {decision:?}",
        "tenant-9.order.someone-else",
        e.destination.routing_key
    );
}

/// The forged-key test catches the receipt decision not comparing the key:
/// it runs alone, in a child process with that defect switched on
/// (`outbox_core::simulation::MUTATION_ENV`), and fails.
#[test]
fn the_forged_key_test_catches_a_receipt_key_left_unchecked() {
    let test = "a_forged_message_under_another_key_is_not_the_events_publication";
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([test, "--exact", "--test-threads", "1", "--nocapture"])
        .env(outbox_core::simulation::MUTATION_ENV, "receipt-key-unchecked")
        .output()
        .expect("the test binary runs again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("running 1 test"), "the child ran no test named {test}: {text}");
    assert!(!out.status.success(), "{test} passed with the defect switched on: it does not catch it\n{text}");
    assert!(text.contains("was accepted as the publication"), "{text}");
}

#[tokio::test]
async fn full_local_queue_is_waited_out_within_its_bound() {
    let started = Instant::now();
    let cluster = mock("orders");
    let mut cfg = config(&cluster, 10_000).with_setting("queue.buffering.max.messages", "1");
    cfg.enqueue_timeout_ms = 1_000;
    let broker = KafkaBroker::connect(cfg).await.expect("connect");
    let warm = event(&broker, "orders", "o-warm");
    acked(&broker.send(warm.message.clone()).await);

    // Room for one message in librdkafka: the others wait their turn.
    let events: Vec<Event> = (0..4).map(|i| event(&broker, "orders", &format!("q-{i}"))).collect();
    let handles: Vec<_> = events.iter().map(|e| tokio::spawn(broker.send_detached(e.message.clone()))).collect();
    for h in handles {
        acked(&h.await.expect("join"));
    }
    // A message leaves librdkafka's count only after its delivery report
    // has run, which may be just after its outcome arrived here: until it
    // has, the slow message below would find the queue full and race the
    // refused one for the slot (the likely cause of one failure seen on a
    // loaded machine).
    broker.flush(5_000).await.expect("flush");

    // The one queued message is stuck behind a slow broker: the next send
    // gives up after enqueue_timeout_ms, definitely not persisted.
    cluster.broker_round_trip_time(BROKER, Duration::from_millis(3_000)).expect("rtt");
    let slow = event(&broker, "orders", "q-slow");
    let first = tokio::spawn(broker.send_detached(slow.message.clone()));
    let refused = event(&broker, "orders", "q-refused");
    let outcome = broker.send(refused.message.clone()).await;
    eprintln!("outcome: {outcome:?}");
    assert!(matches!(&outcome, SendOutcome::NotPersisted(r) if r.contains("queue full")), "expected NotPersisted, got {outcome:?}");
    acked(&first.await.expect("join"));
    cluster.broker_round_trip_time(BROKER, Duration::ZERO).expect("rtt");
    assert_eq!(broker.lookup(&refused.destination, &refused.envelope.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Absent);
    eprintln!("full_local_queue_is_waited_out_within_its_bound: {:?}", started.elapsed());
}

/// Issue 19 item 8: a producer hit by a fatal error (raised inside
/// librdkafka with its own test hook, as broken idempotence raises it) is
/// reported as unable to deliver and not ready, and `supervise_once`
/// rebuilds it while the cluster answers; the rebuilt producer delivers.
#[tokio::test]
async fn item8_a_fatal_producer_is_reported_and_rebuilt() {
    let cluster = mock("orders");
    let mut c = config(&cluster, 3_000);
    c.producer_stall_ms = 60_000;
    let broker = KafkaBroker::connect(c).await.expect("connect");
    let first = event(&broker, "orders", "o-1");
    acked(&broker.send(first.message.clone()).await);
    assert_eq!(broker.ready(), Ok(()));
    assert!(broker.raise_fatal_error_for_tests("test: idempotence broken"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while broker.producer_health().fatal.is_none() {
        assert!(Instant::now() < deadline, "the fatal error is recorded: {:?}", broker.producer_health());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let why = broker.ready().expect_err("not ready after a fatal error");
    assert!(why.contains("fatal"), "{why}");
    // Without a rebuild, every further send fails.
    assert!(!matches!(broker.send(event(&broker, "orders", "o-3").message).await, SendOutcome::Acked { .. }));
    match broker.supervise_once(true).await {
        outbox_producer::kafka::SupervisionStep::Rebuilt { cause } => assert!(cause.contains("fatal"), "{cause}"),
        other => panic!("expected a rebuild, got {other:?}"),
    }
    assert_eq!(broker.ready(), Ok(()));
    assert_eq!(broker.producer_health().rebuilds, 1);
    acked(&broker.send(event(&broker, "orders", "o-4").message).await);
}

/// No acknowledgement for `producer_stall_ms` while messages wait: not
/// ready; while the cluster does not answer, nothing is rebuilt; once it
/// answers, the producer is rebuilt and delivers.
#[tokio::test]
async fn item8_a_stalled_producer_is_not_ready_and_rebuilt_once_the_cluster_answers() {
    let cluster = mock("orders");
    let mut c = config(&cluster, 1_000);
    c.producer_stall_ms = 1_500;
    c.probe_timeout_ms = 1_000;
    let broker = KafkaBroker::connect(c).await.expect("connect");
    acked(&broker.send(event(&broker, "orders", "o-1").message).await);
    cluster.broker_down(BROKER).expect("down");
    let outcome = broker.send(event(&broker, "orders", "o-2").message).await;
    assert!(!matches!(outcome, SendOutcome::Acked { .. }), "{outcome:?}");
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let h = broker.producer_health();
    assert!(h.stalled, "{h:?}");
    assert!(broker.ready().is_err());
    assert!(matches!(broker.supervise_once(true).await, outbox_producer::kafka::SupervisionStep::BrokerUnreachable(_)));
    assert_eq!(broker.producer_health().rebuilds, 0, "no rebuild while the cluster does not answer");
    cluster.broker_up(BROKER).expect("up");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match broker.supervise_once(true).await {
            outbox_producer::kafka::SupervisionStep::Rebuilt { cause } => {
                assert!(cause.contains("no delivery acknowledged"), "{cause}");
                break;
            }
            other => assert!(Instant::now() < deadline, "no rebuild: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(broker.ready(), Ok(()));
    acked(&broker.send(event(&broker, "orders", "o-3").message).await);
}

#[tokio::test]
async fn topic_id_is_read_from_the_cluster_and_differs_per_topic() {
    let cluster = mock("orders");
    cluster.create_topic("payments", 2, 1).expect("create topic");
    let broker = connect(&cluster, 5_000).await;
    let a = broker.topic_id("orders").await.expect("describe orders").expect("the mock cluster gives topic ids");
    let b = broker.topic_id("payments").await.expect("describe payments").expect("the mock cluster gives topic ids");
    outbox_core::envelope::validate_topic_id(&a).expect("a valid topic id text");
    assert_ne!(a, b, "two topics, two ids");
    assert_eq!(broker.topic_id("orders").await.unwrap().as_deref(), Some(a.as_str()), "stable for one topic");
}

/// A destination.v2 freezes its topic's id. A message whose destination
/// names another id than the topic has now (the topic was deleted and
/// created again under the same name; here the id the cluster gave another
/// topic stands for the old incarnation's) is refused before anything is
/// written, at once and again from the cached id, detached or not; one
/// naming the topic's current id is sent and found.
#[tokio::test]
async fn a_destination_frozen_with_another_topic_id_is_not_sent() {
    let cluster = mock("orders");
    cluster.create_topic("payments", PARTITIONS as i32, 1).expect("create topic");
    let broker = connect(&cluster, 5_000).await;
    let current = broker.topic_id("orders").await.expect("describe orders").expect("the mock cluster gives topic ids");
    let old = broker.topic_id("payments").await.expect("describe payments").expect("the mock cluster gives topic ids");
    assert_ne!(current, old);

    let stale = event_of(&broker, "orders", Some(&old), "o-old");
    for outcome in [broker.send(stale.message.clone()).await, broker.send_detached(stale.message.clone()).await] {
        match outcome {
            SendOutcome::NotPersisted(why) => {
                assert!(why.contains("recreated") && why.contains(&old) && why.contains(&current), "{why}")
            }
            other => panic!("a message frozen for another topic id was not refused: {other:?}"),
        }
    }
    let scan = broker.scan_event_ids("orders", stale.destination.partition, 0, 100).await.expect("scan");
    assert!(scan.messages.is_empty(), "written into another topic's log: {:?}", scan.messages);
    assert_eq!(scan.log_end, Some(0));

    let fresh = event_of(&broker, "orders", Some(&current), "o-new");
    let (partition, offset) = acked(&broker.send(fresh.message.clone()).await);
    assert_eq!(partition, fresh.destination.partition);
    assert_eq!(assert_found_once(&broker, &fresh).await, offset);
    // A destination.v1 names no id: sent as before.
    acked(&broker.send(event(&broker, "orders", "o-v1").message).await);
}

/// The deliberate defect `possibly-persisted-as-not-persisted` (librdkafka's
/// "possibly persisted" read as "not persisted": a message that may be in
/// the log would be sent again as if it never was) turns the test of an
/// ACK slower than the message timeout red. The test runs itself again,
/// alone, in a child process with the defect switched on
/// (`outbox_core::simulation::MUTATION_ENV`).
#[test]
fn the_slow_ack_test_catches_possibly_persisted_read_as_not_persisted() {
    let test = "ack_slower_than_message_timeout_is_unknown_but_written";
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([test, "--exact", "--test-threads", "1", "--nocapture"])
        .env(outbox_core::simulation::MUTATION_ENV, "possibly-persisted-as-not-persisted")
        .output()
        .expect("the test binary runs again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("running 1 test"), "the child ran no test named {test}: {text}");
    assert!(!out.status.success(), "{test} passed with the defect switched on: it does not catch it\n{text}");
    assert!(text.contains("expected Unknown, got NotPersisted"), "{text}");
}

/// A producer the cluster rejects (every produce request refused, as a
/// replaced broker refuses an old producer, or an authorization taken away)
/// used to look ready until the 60 s stall bound: it kept failing thousands
/// of sends while `/readyz` said ready. Now a run of failed deliveries makes
/// it not ready within seconds, and supervision rebuilds it at once while
/// the cluster answers; the rebuilt producer delivers.
#[tokio::test]
async fn a_rejected_producer_is_not_ready_and_rebuilt_while_the_cluster_answers() {
    let cluster = mock("orders");
    let mut c = config(&cluster, 5_000);
    c.producer_stall_ms = 60_000;
    let broker = KafkaBroker::connect(c).await.expect("connect");
    acked(&broker.send(event(&broker, "orders", "o-warm").message).await);
    let errors = [RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 40];
    cluster.request_errors(RDKafkaApiKey::Produce, &errors);
    let started = Instant::now();
    let mut failed = 0;
    while broker.ready().is_ok() {
        assert!(started.elapsed() < Duration::from_secs(20), "still ready after {failed} failed sends over {:?}", started.elapsed());
        let outcome = broker.send(event(&broker, "orders", &format!("o-{failed}")).message).await;
        assert!(!matches!(outcome, SendOutcome::Acked { .. }), "{outcome:?}");
        failed += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let why = broker.ready().unwrap_err();
    assert!(why.contains("every delivery failed") && why.contains("in a row"), "{why}");
    assert!(started.elapsed() < Duration::from_secs(15), "not ready only after {:?}", started.elapsed());
    let h = broker.producer_health();
    assert!(h.failing && !h.stalled && h.failures_in_a_row >= 5, "{h:?}");
    // The cluster answers: rebuilt now, not at the stall bound.
    match broker.supervise_once(true).await {
        outbox_producer::kafka::SupervisionStep::Rebuilt { cause } => assert!(cause.contains("every delivery failed"), "{cause}"),
        other => panic!("expected a rebuild, got {other:?}"),
    }
    assert_eq!(broker.producer_health().rebuilds, 1);
    assert_eq!(broker.ready(), Ok(()), "a new producer starts ready");
    // The cluster accepts produce requests again (the injected refusals run out).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let SendOutcome::Acked { .. } = broker.send(event(&broker, "orders", "o-after").message).await {
            break;
        }
        assert!(Instant::now() < deadline, "the rebuilt producer never delivered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(broker.ready(), Ok(()));
}
