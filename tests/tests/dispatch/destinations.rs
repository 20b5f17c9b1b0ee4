//! Frozen destinations on the wire: destination.v1 and .v2 events dispatch,
//! verify and are found; an event frozen for a recreated topic is not sent
//! into the new log; the database reads a destination's topic id as
//! outbox-core does. Real PostgreSQL and librdkafka's in-process Kafka
//! cluster.


use outbox_core::{headers, Broker, EventState, LookupOutcome};
use outbox_producer::{Dispatcher, PgStore};
use outbox_tests::dispatch::{config, started, state_of, PARTITIONS, TOPIC};
use outbox_tests::kafka::read_topic;
use outbox_tests::*;
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn v1_and_v2_destinations_dispatch_verify_and_are_found(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    // Generation 1 has no topic id: its event freezes destination.v1.
    let e1 = create_order(&pool, "o-v1", 10).await;
    let id = broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let g2 = outbox_producer::routes::revise(&pool, &outbox_core::RoutePolicy { topic_id: Some(id.clone()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, broker.cluster_id(), TOPIC, PARTITIONS as u32) })
        .await
        .unwrap();
    assert_eq!(g2.generation, 2);
    let e2 = create_order(&pool, "o-v2", 20).await;
    assert_eq!(e1.destination.topic_id, None);
    assert_eq!(e2.destination.topic_id.as_deref(), Some(id.as_str()));
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.sent, r.published), (2, 2, 2));
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log.len(), 2);
    for (e, schema) in [(&e1, "destination.v1\n"), (&e2, "destination.v2\n")] {
        assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Published);
        let m = log.iter().find(|m| m.header(headers::EVENT_ID).as_deref() == Some(e.event_id().as_str())).expect("in the log");
        assert!(m.header(headers::DESTINATION).unwrap().starts_with(schema), "{schema}");
        let claims = headers::verify(&m.headers, &m.payload, TOPIC, m.partition, Some(&m.key)).unwrap();
        assert_eq!(claims.destination_digest, e.destination_digest);
        match broker.lookup(&e.destination, e.event_id(), &outbox_core::ScanFrom::at(0)).await {
            LookupOutcome::Found(receipts) => assert_eq!((receipts.len(), receipts[0].offset), (1, m.offset)),
            other => panic!("expected Found, got {other:?}"),
        }
    }
}

/// An event frozen for a topic that was deleted and created again under
/// the same name (its destination.v2 names the old id) is not sent into the
/// new topic's log: its attempt is NOT_SENT with the reason, the event
/// stays PENDING (a destination migration moves it), nothing is written.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_event_frozen_for_a_recreated_topic_is_not_sent(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let current = broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let old = if current == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = outbox_core::RoutePolicy { topic_id: Some(old.to_owned()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    outbox_producer::routes::revise(&pool, &policy).await.unwrap();
    let e = create_order(&pool, "o-old", 10).await;
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.published, r.not_sent), (1, 0, 1), "{r:?}");
    assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Pending);
    let (state, detail): (String, Option<String>) =
        sqlx::query_as("SELECT state, detail FROM outbox_attempts WHERE event_id = $1").bind(e.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(state, "NOT_SENT");
    assert!(detail.as_deref().is_some_and(|d| d.contains("recreated") && d.contains(old)), "{detail:?}");
    assert!(read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).is_empty(), "written into the recreated topic's log");
}

/// The database reads the topic id of a frozen destination as outbox-core
/// does (the scan floor of an attempt uses it): a destination.v2's `topicId`, whatever
/// bytes the length-prefixed cluster id and topic before it hold; none for
/// a destination.v1; bytes that claim destination.v2 and do not parse are
/// refused.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_database_reads_a_destinations_topic_id_as_the_core_does(pool: PgPool) {
    let ids = [None, Some("AAECAwQFBgcICQoLDA0ODw"), Some("_____________________w")];
    let clusters = ["kafka-prod", "a:b", "x\ntopicId=22:AAAAAAAAAAAAAAAAAAAAAQ\n", "日本"];
    for cluster in clusters {
        for topic_id in ids {
            let policy = outbox_core::RoutePolicy { topic_id: topic_id.map(str::to_owned), ..outbox_core::RoutePolicy::new(ORDER_CREATED, "cluster-a", "orders.v2", 6) };
            // Bytes a route would refuse to make, read all the same.
            let d = outbox_core::Destination { cluster_id: cluster.to_owned(), ..policy.resolve("t", "order", "o-1").unwrap() };
            let bytes = d.canonical_bytes();
            assert_eq!(outbox_core::Destination::from_canonical(&bytes).unwrap().topic_id.as_deref(), topic_id);
            let read: Option<String> = sqlx::query_scalar("SELECT outbox_destination_topic_id($1)").bind(&bytes).fetch_one(&pool).await.unwrap();
            assert_eq!(read.as_deref(), topic_id, "{:?}", String::from_utf8_lossy(&bytes));
        }
    }
    for bad in [&b"destination.v2\nclusterId=3:ab\n"[..], b"destination.v2\nclusterId=x:a\n", b"destination.v2\ntopic=1:a\n", b"destination.v2\nclusterId=1:a\ntopic=1:b\ntopicId=30:short\n"] {
        let r: Result<Option<String>, _> = sqlx::query_scalar("SELECT outbox_destination_topic_id($1)").bind(bad).fetch_one(&pool).await;
        assert!(r.is_err(), "{:?} was read as {r:?}", String::from_utf8_lossy(bad));
    }
}
