//! Source identity and message authentication end to end: librdkafka's
//! in-process mock cluster and real PostgreSQL. Messages carry the trust
//! headers exactly as a dispatcher seals them (`outbox_core::trust::seal`,
//! which `outgoing_message_signed` calls).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use outbox_consumer::{ConsumerError, HookAction, IdempotentConsumer, Outcome, TrustPolicy};
use outbox_core::trust::{seal, SigningKey, KEY_ID, SIGNATURE};
use outbox_core::{headers, EventId};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const GENUINE: &str = "urn:uuid:11111111-1111-4111-8111-111111111111";
const FOREIGN: &str = "urn:uuid:22222222-2222-4222-8222-222222222222";

fn key(id: &str, byte: &str) -> SigningKey {
    SigningKey::from_hex(id, &byte.repeat(32)).unwrap()
}

/// `f` with its trust headers sealed by `source`, signed with `k`.
fn sealed(mut f: Fixture, source: &str, k: Option<&SigningKey>) -> Fixture {
    seal(&mut f.headers, source, k).unwrap();
    f
}

fn set_header(hs: &mut [(String, Vec<u8>)], name: &str, value: &[u8]) {
    for (k, v) in hs.iter_mut() {
        if k == name {
            *v = value.to_vec();
        }
    }
}

struct Running {
    seen: Arc<Mutex<Vec<Outcome>>>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ConsumerError>>,
}

impl Running {
    fn start(consumer: IdempotentConsumer) -> Running {
        let seen: Arc<Mutex<Vec<Outcome>>> = Arc::default();
        let s = seen.clone();
        let consumer = consumer.after_db_commit(move |b| {
            s.lock().unwrap().extend_from_slice(b.outcomes);
            HookAction::Continue
        });
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(async move {
            let _ = rx.await;
        }));
        Running { seen, stop: Some(tx), task }
    }

    async fn stop_after(mut self, n: usize) -> Vec<Outcome> {
        let seen = self.seen.clone();
        wait_until(60, &format!("{n} decisions"), || {
            let seen = seen.clone();
            async move { seen.lock().unwrap().len() >= n }
        })
        .await;
        let _ = self.stop.take().map(|tx| tx.send(()));
        tokio::time::timeout(Duration::from_secs(30), &mut self.task).await.expect("stops in time").expect("task").expect("clean stop");
        let out = self.seen.lock().unwrap().clone();
        out
    }
}

fn by_offset(outs: &[Outcome], offset: i64) -> &Outcome {
    outs.iter().find(|o| o.position().offset == offset).unwrap_or_else(|| panic!("no decision at offset {offset}: {outs:?}"))
}

fn quarantine_code(o: &Outcome) -> String {
    match o {
        Outcome::Quarantined(q) => q.reason.code(),
        other => format!("not quarantined: {}", other.kind()),
    }
}

async fn effects_for(pool: &PgPool, consumer: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT event_id FROM test_effects WHERE consumer_id = $1 ORDER BY id").bind(consumer).fetch_all(pool).await.unwrap()
}

/// Forged, foreign, replayed-under-a-new-eventId and wrongly signed messages
/// are quarantined with their reason and have no effect; a genuine signed
/// message is applied once; a message signed with the old key during a
/// rotation is accepted. An open consumer (no policy) shows what the policy
/// buys: it applies the forgery.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn only_the_declared_source_with_a_valid_signature_has_an_effect(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    let (k_old, k_new) = (key("k-2026-11", "0a"), key("k-2026-12", "0b"));
    let stolen_id_wrong_secret = key("k-2026-12", "ee");
    let foreign_key = key("k-2026-12", "0f");

    let genuine = sealed(fixture("orders", 1, "o-genuine"), GENUINE, Some(&k_new));
    let rotated = sealed(fixture("orders", 1, "o-rotated"), GENUINE, Some(&k_old));
    let forged = sealed(fixture("orders", 1, "o-forged"), GENUINE, None);
    let foreign = sealed(fixture("orders", 1, "o-foreign"), FOREIGN, Some(&foreign_key));
    let wrong_hmac = sealed(fixture("orders", 1, "o-wrong-hmac"), GENUINE, Some(&stolen_id_wrong_secret));
    let unknown_key = sealed(fixture("orders", 1, "o-unknown-key"), GENUINE, Some(&key("k-1999", "0c")));
    // The real bytes of the published event under a fresh eventId, headers
    // otherwise untouched...
    let mut replay = genuine.clone();
    set_header(&mut replay.headers, headers::EVENT_ID, EventId::generate(1_800_000_000_000).as_str().as_bytes());
    // ... and with the claims digest recomputed, keeping the old signature.
    let mut resealed = replay.clone();
    let (kid, sig) = {
        let get = |n: &str| genuine.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap();
        (get(KEY_ID), get(SIGNATURE))
    };
    seal(&mut resealed.headers, GENUINE, None).unwrap();
    resealed.headers.push((KEY_ID.into(), kid));
    resealed.headers.push((SIGNATURE.into(), sig));

    let mut offsets = Vec::new();
    for f in [&genuine, &genuine, &rotated, &forged, &foreign, &replay, &resealed, &wrong_hmac, &unknown_key] {
        offsets.push(kafka.send(f).await);
    }

    let h = TestHandler::default();
    let mut cfg = config(&kafka, "fulfilment", "orders");
    cfg.trust = TrustPolicy::default().accept("orders", &[GENUINE], true).with_key(GENUINE, k_old.clone()).with_key(GENUINE, k_new.clone());
    let outs = Running::start(IdempotentConsumer::new(cfg, pool.clone(), h.clone()).unwrap()).stop_after(offsets.len()).await;

    assert!(matches!(by_offset(&outs, offsets[0]), Outcome::Applied { .. }), "{outs:?}");
    assert!(matches!(by_offset(&outs, offsets[1]), Outcome::Duplicate { .. }), "{outs:?}");
    assert!(matches!(by_offset(&outs, offsets[2]), Outcome::Applied { .. }), "old key during the rotation: {outs:?}");
    let expected = [
        (3, "verify:signature_missing"),
        (4, "verify:source_unknown"),
        (5, "verify:claims_digest"),
        (6, "verify:signature_bad"),
        (7, "verify:signature_bad"),
        (8, "verify:key_unknown"),
    ];
    for (i, code) in expected {
        assert_eq!(quarantine_code(by_offset(&outs, offsets[i])), code, "message {i}");
    }
    let rows: Vec<(i64, String)> = sqlx::query_as(r#"SELECT "offset", reason FROM outbox_consumer_quarantine ORDER BY "offset""#).fetch_all(&pool).await.unwrap();
    assert_eq!(rows, expected.iter().map(|(i, c)| (offsets[*i], (*c).to_owned())).collect::<Vec<_>>());
    assert_eq!(effects_for(&pool, "fulfilment").await, vec![genuine.event_id().to_string(), rotated.event_id().to_string()], "only the genuine events had an effect, once each");
    assert_eq!(h.calls(), 2);

    // Without a policy the forgery is applied (anyone who can produce to the
    // topic can write a self-consistent message); only the un-recomputed
    // replay is caught, by the claims digest.
    let open = TestHandler::default();
    let outs = Running::start(IdempotentConsumer::new(config(&kafka, "open", "orders"), pool.clone(), open.clone()).unwrap()).stop_after(offsets.len()).await;
    assert!(matches!(by_offset(&outs, offsets[3]), Outcome::Applied { .. }), "{outs:?}");
    assert_eq!(quarantine_code(by_offset(&outs, offsets[5])), "verify:claims_digest");
    assert!(effects_for(&pool, "open").await.contains(&forged.event_id().to_string()));
}

/// docs/WIRE.md, "Verifying a message", item 7: a sealed message whose
/// CloudEvents `ce_source` names another source than its `outbox-source` is
/// quarantined before the handler, on a topic without a trust policy too
/// (a reader going by `ce_source`, as CloudEvents tooling does, would take
/// it for the other outbox's); the same message with the matching
/// `ce_source` is applied.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn a_ce_source_mismatch_is_quarantined_without_a_policy(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    let mut matching = sealed(fixture("orders", 1, "o-matching"), GENUINE, None);
    matching.headers.push((headers::CE_SOURCE.into(), GENUINE.as_bytes().to_vec()));
    let mut mismatched = sealed(fixture("orders", 1, "o-mismatched"), GENUINE, None);
    mismatched.headers.push((headers::CE_SOURCE.into(), FOREIGN.as_bytes().to_vec()));
    let offsets = [kafka.send(&matching).await, kafka.send(&mismatched).await];

    let h = TestHandler::default();
    let outs = Running::start(IdempotentConsumer::new(config(&kafka, "open", "orders"), pool.clone(), h.clone()).unwrap()).stop_after(2).await;
    assert!(matches!(by_offset(&outs, offsets[0]), Outcome::Applied { .. }), "{outs:?}");
    assert_eq!(quarantine_code(by_offset(&outs, offsets[1])), "verify:ce_source_mismatch", "{outs:?}");
    assert_eq!(effects_for(&pool, "open").await, vec![matching.event_id().to_string()]);
    assert_eq!(h.calls(), 1);
}

#[test]
fn a_policy_that_requires_signatures_needs_keys() {
    let p = TrustPolicy::default().accept("orders", &[GENUINE], true);
    assert!(p.validate().is_err());
    p.with_key(GENUINE, key("k", "01")).validate().unwrap();
    assert!(TrustPolicy::default().accept("orders", &["has space"], false).validate().is_err());
    let dbg = format!("{:?}", TrustPolicy::default().with_key(GENUINE, key("k", "7d")));
    assert!(!dbg.contains("7d7d"), "no secret in Debug: {dbg}");
}

/// A consumer with no policy for a topic says so once, at start; one whose
/// every topic has a policy says nothing.
#[tokio::test]
async fn an_open_consumer_warns_once_at_start() {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://root@127.0.0.1:5432/test").unwrap();
    tracing::subscriber::with_default(subscriber, || {
        let mut open = outbox_consumer::ConsumerConfig::new("open", "127.0.0.1:9", &["orders", "payments"]);
        open.trust = TrustPolicy::default().accept("payments", &[GENUINE], false);
        IdempotentConsumer::new(open, pool.clone(), TestHandler::default()).unwrap();
        let mut closed = outbox_consumer::ConsumerConfig::new("closed", "127.0.0.1:9", &["orders"]);
        closed.trust = TrustPolicy::default().accept("orders", &[GENUINE], false);
        IdempotentConsumer::new(closed, pool.clone(), TestHandler::default()).unwrap();
    });
    let log = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    assert_eq!(log.matches("messages from any source are accepted").count(), 1, "{log}");
    assert!(log.contains("consumer_id=open") && log.contains("[\"orders\"]") && !log.contains("payments\"]"), "{log}");
}
