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
