//! The Kafka topic id against an external broker process (tansu): read from
//! the cluster, and a topic deleted and created again under the same name is
//! told apart by its new id.

mod common;

use common::broker::{scratch, Tansu};
use common::free_port;
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};

const CLUSTER: &str = "outbox-topic-id-cluster";

fn config(bootstrap: &str) -> KafkaConfig {
    let mut c = KafkaConfig::new(bootstrap);
    c.connect_timeout_ms = 10_000;
    c.lookup_timeout_ms = 10_000;
    c
}

#[tokio::test]
async fn a_recreated_topic_has_another_id() {
    let dir = scratch("topic-id");
    let port = free_port();
    let tansu = Tansu::start(port, &format!("127.0.0.1:{port}"), CLUSTER, &dir.join("tansu.log"));
    tansu.create_topic("orders", 3);
    let broker = KafkaBroker::connect(config(&tansu.bootstrap())).await.expect("connect");
    let first = broker.topic_id("orders").await.expect("describe").expect("tansu gives topic ids");
    outbox_core::envelope::validate_topic_id(&first).expect("valid topic id text");
    assert_eq!(broker.topic_id("orders").await.unwrap().as_deref(), Some(first.as_str()), "stable while the topic lives");
    tansu.delete_topic("orders");
    tansu.create_topic("orders", 3);
    let second = broker.topic_id("orders").await.expect("describe").expect("tansu gives topic ids");
    assert_ne!(first, second, "the recreated topic must have a new id");
}

/// The last event's frozen destination, decoded.
async fn last_destination(env: &common::Env) -> (Vec<u8>, outbox_core::Destination) {
    let bytes: Vec<u8> = sqlx::query_scalar("SELECT destination_canonical FROM outbox_envelopes ORDER BY created_at_ms DESC, event_id DESC LIMIT 1")
        .fetch_one(env.pool())
        .await
        .unwrap();
    let d = outbox_core::Destination::from_canonical(&bytes).expect("frozen destination decodes");
    (bytes, d)
}

#[tokio::test]
async fn route_set_records_the_topic_id_and_a_recreated_topic_is_a_new_generation() {
    let env = common::Env::new("topicid_route").await;
    env.ok(&["migrate"]);
    let dir = scratch("topic-id-route");
    let port = free_port();
    let tansu = Tansu::start(port, &format!("127.0.0.1:{port}"), CLUSTER, &dir.join("tansu.log"));
    tansu.create_topic("orders", 3);
    let b = tansu.bootstrap();
    let broker = KafkaBroker::connect(config(&b)).await.expect("connect");
    let first = broker.topic_id("orders").await.unwrap().expect("tansu gives topic ids");

    // A v1 event first: a generation without an id (set without a check).
    common::route(env.pool(), CLUSTER, "orders", 3).await;
    common::create_order(env.pool(), "o-v1").await;
    let (v1_bytes, v1) = last_destination(&env).await;
    assert!(v1_bytes.starts_with(b"destination.v1\n") && v1.topic_id.is_none());

    // route set against the cluster records the id: a new generation, v2 events.
    let out = env.ok(&["route", "set", common::ORDER_CREATED, "--topic", "orders", "--partitions", "3", "--kafka-bootstrap", &b, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["route"]["topicId"].as_str(), Some(first.as_str()), "{out}");
    assert_eq!(v["route"]["generation"], 2, "{out}");
    let emitted = common::create_order(env.pool(), "o-v2").await;
    let (v2_bytes, v2) = last_destination(&env).await;
    let t = env.ok(&["trace", emitted.event_id().as_str()]);
    assert!(t.contains(&format!("destination.v2     {CLUSTER}/orders (topic id {first}) partition")) && !t.contains("MISMATCH"), "{t}");
    assert!(v2_bytes.starts_with(b"destination.v2\n"), "{}", String::from_utf8_lossy(&v2_bytes));
    assert_eq!(v2.topic_id.as_deref(), Some(first.as_str()));
    assert_eq!(v2.route_policy_generation, 2);
    // Setting it again unchanged is no new generation.
    let again = env.ok(&["route", "set", common::ORDER_CREATED, "--topic", "orders", "--partitions", "3", "--kafka-bootstrap", &b]);
    assert!(again.starts_with("unchanged"), "{again}");

    // The topic is deleted and created again under the same name.
    tansu.delete_topic("orders");
    tansu.create_topic("orders", 3);
    let second = broker.topic_id("orders").await.unwrap().expect("tansu gives topic ids");
    assert_ne!(first, second);
    let show = env.run(&["route", "show", common::ORDER_CREATED, "--kafka-bootstrap", &b]);
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(!show.status.success() && text.contains("the topic was recreated"), "route show must report the recreated topic: {text}");
    let revised = env.ok(&["route", "set", common::ORDER_CREATED, "--topic", "orders", "--partitions", "3", "--kafka-bootstrap", &b, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&revised).unwrap();
    assert_eq!(v["revised"], true, "{revised}");
    assert_eq!(v["route"]["generation"], 3, "{revised}");
    assert_eq!(v["route"]["topicId"].as_str(), Some(second.as_str()), "{revised}");
    common::create_order(env.pool(), "o-v2b").await;
    let (_, v2b) = last_destination(&env).await;
    assert_eq!(v2b.topic_id.as_deref(), Some(second.as_str()));
    assert_ne!(v2b.digest(), v2.digest());
    drop(broker);
    env.drop_now().await;
}

/// One event routed by `policy`, and its message for one attempt.
fn event(policy: &outbox_core::RoutePolicy, aggregate_id: &str) -> (outbox_core::Envelope, outbox_core::Destination, outbox_core::OutgoingMessage) {
    use outbox_core::{headers, AttemptId, EmitRequest, EventId, OutgoingMessage};
    let now_ms = 1_700_000_000_000u64;
    let payload = format!("{{\"order\":\"{aggregate_id}\"}}").into_bytes();
    let request = EmitRequest {
        command_key: aggregate_id,
        tenant: "t1",
        aggregate_type: "order",
        aggregate_id,
        aggregate_version: 1,
        event_type: &policy.event_type,
        payload_schema: "s",
        payload: &payload,
    };
    let (envelope, destination) = request.freeze(EventId::generate(now_ms), now_ms as i64, 7, policy).expect("freeze");
    let attempt = AttemptId::generate(now_ms);
    let message = OutgoingMessage {
        topic: destination.topic.clone(),
        partition: destination.partition,
        key: destination.routing_key.clone().into_bytes(),
        payload,
        headers: headers::build(&envelope, &destination, &destination.digest(), &attempt, None),
    };
    (envelope, destination, message)
}

#[tokio::test]
async fn a_lookup_on_a_recreated_topic_is_unavailable_not_absent() {
    use outbox_core::{Broker, LookupOutcome, RoutePolicy, SendOutcome};
    let dir = scratch("topic-id-lookup");
    let port = free_port();
    let tansu = Tansu::start(port, &format!("127.0.0.1:{port}"), CLUSTER, &dir.join("tansu.log"));
    tansu.create_topic("orders", 1);
    let mut c = config(&tansu.bootstrap());
    c.extra.push(("batch.num.messages".into(), "1".into()));
    let broker = KafkaBroker::connect(c).await.expect("connect");
    let id = broker.topic_id("orders").await.unwrap().expect("tansu gives topic ids");
    let v2_route = RoutePolicy { topic_id: Some(id.clone()), ..RoutePolicy::new("order.created", broker.cluster_id(), "orders", 1) };
    let v1_route = RoutePolicy::new("order.created", broker.cluster_id(), "orders", 1);
    let (env2, dest2, msg2) = event(&v2_route, "o-v2");
    let (env1, dest1, msg1) = event(&v1_route, "o-v1");
    assert_eq!(dest2.topic_id.as_deref(), Some(id.as_str()));
    for m in [msg2, msg1] {
        assert!(matches!(broker.send_detached(m).await, SendOutcome::Acked { .. }));
    }
    // The topic as frozen: both versions are found.
    assert!(matches!(broker.lookup(&dest2, &env2.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Found(_)), "v2 found before the topic is recreated");
    assert!(matches!(broker.lookup(&dest1, &env1.event_id, &outbox_core::ScanFrom::at(0)).await, LookupOutcome::Found(_)), "v1 found");

    // Deleted and created again: the new log is empty. For the v2 event this
    // is another destination: Unavailable, never Absent (Absent would let
    // the event be sent again into a topic its consumers may have left).
    tansu.delete_topic("orders");
    tansu.create_topic("orders", 1);
    match broker.lookup(&dest2, &env2.event_id, &outbox_core::ScanFrom::at(0)).await {
        LookupOutcome::Unavailable(why) => {
            assert!(why.contains("recreated"), "{why}");
            assert!(outbox_producer::kafka::is_log_incomplete(&why), "a log_unavailable reason: {why}");
        }
        other => panic!("expected Unavailable for the recreated topic, got {other:?}"),
    }
    // Nor is the v2 event sent again into the new log: its topic id is
    // not the destination's (the lookup just read the new one).
    let (_, _, again) = event(&v2_route, "o-v2");
    match broker.send_detached(again).await {
        SendOutcome::NotPersisted(why) => assert!(why.contains("recreated") && why.contains(&id), "{why}"),
        other => panic!("a message frozen for the old topic id was sent into the new log: {other:?}"),
    }
    let new_id = broker.topic_id("orders").await.unwrap().expect("tansu gives topic ids");
    assert_ne!(new_id, id);
    let fresh = RoutePolicy { topic_id: Some(new_id), ..v1_route.clone() };
    assert!(matches!(broker.send_detached(event(&fresh, "o-v2-new").2).await, SendOutcome::Acked { offset: 0, .. }), "the new log takes its own destination's messages");
}
