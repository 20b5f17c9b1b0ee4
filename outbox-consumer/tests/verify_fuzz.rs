//! Property test of the consumer's verification over arbitrary messages:
//! `verify_message` must answer for any bytes (never panic), and must accept
//! only messages whose bytes, placement and headers agree with each other.
//! Under a trust policy (`verify_message_with`), it must also accept only
//! messages of the declared source whose claims digest matches and whose
//! signature verifies under one of that source's keys.
//!
//! Cases: `OUTBOX_FUZZ_CASES` (default 2,000; CI runs 20,000; before a
//! release, 1,000,000 in a release build:
//! `OUTBOX_FUZZ_CASES=1000000 cargo test --release -p outbox-consumer --test verify_fuzz`;
//! with the trust checks, 1,000,000 mutated plus 250,000 arbitrary cases took 93 s here).

use outbox_consumer::{verify_message, verify_message_with, RawMessage, TrustPolicy};
use outbox_core::trust::{self, SigningKey};
use outbox_core::{headers, sha256_digest, AttemptId, EmitRequest, EventId, RoutePolicy};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const SOURCE: &str = "urn:uuid:11111111-1111-4111-8111-111111111111";
const OTHER: &str = "urn:uuid:22222222-2222-4222-8222-222222222222";

/// The source's keys during a rotation (old, new) and an attacker's key
/// under the new key's id.
fn keys() -> [SigningKey; 3] {
    [SigningKey::from_hex("k-old", &"0a".repeat(32)).unwrap(), SigningKey::from_hex("k-new", &"0b".repeat(32)).unwrap(), SigningKey::from_hex("k-new", &"ee".repeat(32)).unwrap()]
}

fn strict() -> TrustPolicy {
    let [old, new, _] = keys();
    TrustPolicy::default().accept("orders", &[SOURCE], true).with_key(SOURCE, old).with_key(SOURCE, new)
}

/// A genuine message as a dispatcher writes it, from a few varied fields,
/// sealed by [`SOURCE`] and signed with the old or the new key.
fn genuine(order: u32, partitions: u32, payload: Vec<u8>) -> RawMessage {
    let aggregate_id = format!("o-{order}");
    let req = EmitRequest {
        command_key: &format!("create-{order}"),
        tenant: "tenant-1",
        aggregate_type: "order",
        aggregate_id: &aggregate_id,
        aggregate_version: 1,
        event_type: "order.created.v1",
        payload_schema: "order-v1",
        payload: &payload,
    };
    let now = 1_800_000_000_000u64 + u64::from(order);
    let (envelope, destination) =
        req.freeze(EventId::generate(now), now as i64, 42, &RoutePolicy::new("order.created.v1", "cluster-1", "orders", partitions)).expect("freeze");
    let mut hs = headers::build(&envelope, &destination, &destination.digest(), &AttemptId::generate(now), None);
    trust::seal(&mut hs, SOURCE, Some(&keys()[(order % 2) as usize])).expect("seal");
    RawMessage {
        topic: destination.topic.clone(),
        partition: destination.partition,
        offset: i64::from(order),
        key: Some(destination.routing_key.into_bytes()),
        payload: Some(payload),
        headers: hs,
        non_utf8_header_names: Vec::new(),
        log_id: None,
    }
}

/// One change to a message.
#[derive(Debug, Clone)]
enum Mutation {
    FlipPayloadByte(usize, u8),
    Tombstone,
    SetHeaderValue(usize, Vec<u8>),
    FlipHeaderValueByte(usize, usize, u8),
    DropHeader(usize),
    DuplicateHeader(usize),
    AddHeader(Vec<u8>, Vec<u8>),
    RenameHeader(usize, Vec<u8>),
    Topic(String),
    Partition(i32),
    Key(Option<Vec<u8>>),
    /// Recompute the trust headers as someone holding (or not) a key would:
    /// source (0: the genuine one, 1: another, else: none written) and key
    /// (0, 1: the source's, 2: an attacker's under a real key id, else: unsigned).
    Reseal(u8, u8),
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..max),
        // printable, close to the real headers' alphabet
        proptest::collection::vec(0x20u8..0x7f, 0..max),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::FlipPayloadByte(i, x)),
        Just(Mutation::Tombstone),
        (any::<usize>(), bytes(200)).prop_map(|(i, v)| Mutation::SetHeaderValue(i, v)),
        (any::<usize>(), any::<usize>(), 1u8..=255).prop_map(|(i, j, x)| Mutation::FlipHeaderValueByte(i, j, x)),
        any::<usize>().prop_map(Mutation::DropHeader),
        any::<usize>().prop_map(Mutation::DuplicateHeader),
        (bytes(40), bytes(200)).prop_map(|(k, v)| Mutation::AddHeader(k, v)),
        (any::<usize>(), bytes(40)).prop_map(|(i, k)| Mutation::RenameHeader(i, k)),
        "[a-z]{0,8}".prop_map(Mutation::Topic),
        any::<i32>().prop_map(Mutation::Partition),
        proptest::option::of(bytes(64)).prop_map(Mutation::Key),
        (0u8..3, 0u8..4).prop_map(|(s, k)| Mutation::Reseal(s, k)),
    ]
}

/// Header names arrive as bytes; the reader keeps a lossy name and notes
/// the position of any that was not UTF-8, as `RawMessage::from_kafka` does.
fn set_name(m: &mut RawMessage, index: usize, name: &[u8]) {
    m.non_utf8_header_names.retain(|&i| i != index);
    let text = match std::str::from_utf8(name) {
        Ok(s) => s.to_owned(),
        Err(_) => {
            m.non_utf8_header_names.push(index);
            String::from_utf8_lossy(name).into_owned()
        }
    };
    m.headers[index].0 = text;
}

fn apply(m: &mut RawMessage, mutation: &Mutation) {
    let n = m.headers.len();
    match mutation {
        Mutation::FlipPayloadByte(i, x) => {
            if let Some(p) = m.payload.as_mut().filter(|p| !p.is_empty()) {
                let len = p.len();
                p[i % len] ^= x;
            }
        }
        Mutation::Tombstone => m.payload = None,
        Mutation::SetHeaderValue(i, v) if n > 0 => m.headers[i % n].1 = v.clone(),
        Mutation::FlipHeaderValueByte(i, j, x) if n > 0 => {
            let v = &mut m.headers[i % n].1;
            if !v.is_empty() {
                let len = v.len();
                v[j % len] ^= x;
            }
        }
        Mutation::DropHeader(i) if n > 0 => {
            let i = i % n;
            m.headers.remove(i);
            m.non_utf8_header_names = m.non_utf8_header_names.iter().filter(|&&b| b != i).map(|&b| if b > i { b - 1 } else { b }).collect();
        }
        Mutation::DuplicateHeader(i) if n > 0 && n < 64 => {
            let h = m.headers[i % n].clone();
            let bad = m.non_utf8_header_names.contains(&(i % n));
            m.headers.push(h);
            if bad {
                m.non_utf8_header_names.push(n);
            }
        }
        Mutation::AddHeader(k, v) if n < 64 => {
            m.headers.push((String::new(), v.clone()));
            set_name(m, n, k);
        }
        Mutation::RenameHeader(i, k) if n > 0 => set_name(m, i % n, k),
        Mutation::Topic(t) => m.topic = t.clone(),
        Mutation::Partition(p) => m.partition = *p,
        Mutation::Key(k) => m.key = k.clone(),
        Mutation::Reseal(source, key) if m.non_utf8_header_names.is_empty() => {
            let ks = keys();
            let key = ks.get(usize::from(*key));
            match source {
                0 => drop(trust::seal(&mut m.headers, SOURCE, key)),
                1 => drop(trust::seal(&mut m.headers, OTHER, key)),
                _ => m.headers.retain(|(k, _)| ![trust::SOURCE, trust::CLAIMS_DIGEST, trust::KEY_ID, trust::SIGNATURE].contains(&k.as_str())),
            }
        }
        _ => {}
    }
}

/// What any accepted message must satisfy, whatever was done to it.
fn check_accepted(m: &RawMessage) -> Result<(), TestCaseError> {
    match verify_message("c-1", m) {
        Ok(ev) => {
            prop_assert!(m.non_utf8_header_names.is_empty(), "accepted with a non-UTF-8 header name");
            prop_assert_eq!(&ev.payload_digest, &sha256_digest(m.payload_bytes()), "accepted bytes that do not hash to the digest");
            let last = |name: &str| m.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            prop_assert_eq!(last(headers::EVENT_ID), Some(ev.event_id.as_str().as_bytes().to_vec()));
            prop_assert_eq!(last(headers::PAYLOAD_DIGEST), Some(ev.payload_digest.as_bytes().to_vec()));
            prop_assert_eq!((&ev.topic, ev.partition), (&m.topic, m.partition));
        }
        Err(r) => {
            prop_assert!(r.quarantined.reason.code().starts_with("verify:"), "{:?}", r.quarantined.reason);
            prop_assert_eq!(&r.quarantined.payload_digest, &sha256_digest(m.payload_bytes()));
            let evidence = serde_json::to_vec(&r.evidence).expect("evidence serializes");
            prop_assert!(evidence.len() < 64 * 1024, "evidence is bounded: {} bytes", evidence.len());
        }
    }
    let last = |name: &str| m.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    // Open policy: a claims digest that is present matches the headers it covers.
    if verify_message("c-1", m).is_ok() {
        if let Some(d) = last(trust::CLAIMS_DIGEST) {
            let bytes = trust::claims_bytes(&m.headers).map_err(|e| TestCaseError::fail(format!("accepted with a digest over missing claims: {e}")))?;
            prop_assert_eq!(d, sha256_digest(&bytes).into_bytes(), "accepted with a claims digest that does not match");
        }
    }
    // Strict policy: the declared source, a matching digest, and a signature by one of its keys.
    let strict = strict();
    match verify_message_with("c-1", m, &strict) {
        Ok(ev) => {
            prop_assert_eq!(ev.source.as_deref(), Some(SOURCE));
            prop_assert!(verify_message("c-1", m).is_ok(), "strict accepted what the open policy refuses");
            prop_assert_eq!(m.topic.as_str(), "orders");
            let bytes = trust::claims_bytes(&m.headers).map_err(|e| TestCaseError::fail(format!("accepted without claims: {e}")))?;
            prop_assert_eq!(last(trust::CLAIMS_DIGEST), Some(sha256_digest(&bytes).into_bytes()));
            prop_assert_eq!(last(trust::SOURCE), Some(SOURCE.as_bytes().to_vec()));
            let sig = last(trust::SIGNATURE).unwrap_or_default();
            let [old, new, _] = keys();
            prop_assert!(old.verifies(&bytes, &sig) || new.verifies(&bytes, &sig), "accepted a signature no key of the source made");
        }
        Err(r) => prop_assert!(r.quarantined.reason.code().starts_with("verify:"), "{:?}", r.quarantined.reason),
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("OUTBOX_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000)
}

#[test]
fn genuine_messages_verify_and_mutated_ones_never_panic_nor_pass_unchecked() {
    // The unmutated message verifies: the property below is not vacuous.
    let m = genuine(1, 12, b"{\"order\":\"o-1\"}".to_vec());
    assert!(verify_message("c-1", &m).is_ok());
    assert!(verify_message_with("c-1", &m, &strict()).is_ok());

    let mut runner = TestRunner::new(Config { cases: cases(), failure_persistence: None, ..Config::default() });
    let strategy = (0u32..1_000, 1u32..64, bytes(512), proptest::collection::vec(mutation(), 0..6));
    let accepted = std::cell::Cell::new(0u64);
    let rejected = std::cell::Cell::new(0u64);
    let strict_accepted = std::cell::Cell::new(0u64);
    runner
        .run(&strategy, |(order, partitions, payload, mutations)| {
            let mut m = genuine(order, partitions, payload);
            for x in &mutations {
                apply(&mut m, x);
            }
            if verify_message("c-1", &m).is_ok() {
                accepted.set(accepted.get() + 1);
            } else {
                rejected.set(rejected.get() + 1);
            }
            if verify_message_with("c-1", &m, &strict()).is_ok() {
                strict_accepted.set(strict_accepted.get() + 1);
            }
            check_accepted(&m)
        })
        .unwrap();
    let (accepted, rejected) = (accepted.get(), rejected.get());
    let strict_accepted = strict_accepted.get();
    println!("verify_fuzz cases={} accepted={accepted} rejected={rejected} strict_accepted={strict_accepted} panics=0", accepted + rejected);
    assert!(accepted > 0 && rejected > 0, "both sides exercised: accepted={accepted} rejected={rejected}");
    assert!(strict_accepted > 0 && strict_accepted < accepted, "the strict policy accepts some and refuses more: {strict_accepted} of {accepted}");
}

#[test]
fn arbitrary_messages_never_panic() {
    let mut runner = TestRunner::new(Config { cases: cases() / 4, failure_persistence: None, ..Config::default() });
    let header = (bytes(40), bytes(400));
    let strategy = ("[a-z]{0,8}", any::<i32>(), any::<i64>(), proptest::option::of(bytes(64)), proptest::option::of(bytes(512)), proptest::collection::vec(header, 0..40));
    runner
        .run(&strategy, |(topic, partition, offset, key, payload, hs)| {
            let mut m = RawMessage { topic, partition, offset, key, payload, headers: Vec::new(), non_utf8_header_names: Vec::new(), log_id: None };
            for (k, v) in hs {
                m.headers.push((String::new(), v));
                let i = m.headers.len() - 1;
                set_name(&mut m, i, &k);
            }
            check_accepted(&m)
        })
        .unwrap();
}
