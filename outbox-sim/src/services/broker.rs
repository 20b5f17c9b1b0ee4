//! The broker seam: a Kafka-like log per partition behind a client that
//! owns each request until it is answered ([`SimBroker`]: refused sends,
//! timeouts, lost and late ACKs, duplicated writes, forged copies, failed
//! and slow lookups, the bypass scan's reads), and the log cleaner.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{headers, sha256_digest, Broker, BrokerReceipt, Destination, EventId, LookupOutcome, OutgoingMessage, SendOutcome};

use super::world::{world, Host, Shared, Stored, World};
use super::{CLUSTER, LEASE_MS, MESSAGE_TIMEOUT_MS, T0_MS, TOPIC};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Written,
    Refused,
    NeverWritten,
    AckLost,
    WrittenTwice,
}

/// A Kafka-like log per partition behind a client that owns each request
/// until it is answered: what it was handed is written (or not) whether or
/// not the process that sent it is still alive.
pub struct SimBroker {
    pub(super) world: Shared,
    /// The host of the process using this client.
    pub(super) host: Arc<Host>,
}

/// The attempt id a message's headers name.
fn attempt_of(m: &OutgoingMessage) -> String {
    m.headers.iter().rev().find(|(k, _)| k == headers::ATTEMPT_ID).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).unwrap_or_default()
}

impl SimBroker {
    /// A forger (a mirror rewriting payloads, a compromised producer)
    /// writes a message with `m`'s headers, the outbox's eventId and
    /// attemptId among them, and other payload bytes, where `m` itself
    /// never reached the log. A lookup finds it as that attempt's message;
    /// `acceptDispatchReceipt` must quarantine it, never publish it.
    fn forge(w: &mut World, m: &OutgoingMessage) {
        let mut payload = m.payload.clone();
        payload.extend_from_slice(b" (forged)");
        let forged = OutgoingMessage { payload, ..m.clone() };
        let offset = SimBroker::write(w, &forged);
        if let Some(last) = w.logs.get_mut(&(m.topic.clone(), m.partition)).and_then(|l| l.last_mut()) {
            last.forged = true;
        }
        w.figures.forged_copies += 1;
        w.note(|| format!("a forger writes {}/p{}@{offset} with the headers of attempt {} and other bytes", m.topic, m.partition, attempt_of(m)));
    }

    /// [`SimBroker::forge`] in traces with forgers, at their rate, while faults are on.
    fn maybe_forge(w: &mut World, m: &OutgoingMessage) {
        let forge = w.forge;
        if forge > 0.0 && w.on && w.forge_rng.chance(forge) {
            SimBroker::forge(w, m);
        }
    }

    fn write(w: &mut World, m: &OutgoingMessage) -> i64 {
        let log = w.logs.entry((m.topic.clone(), m.partition)).or_default();
        let offset = log.len() as i64;
        let scanned = outbox_core::ScannedMessage::read(CLUSTER, &m.topic, m.partition, offset, Some(&m.key), &m.payload, &m.headers);
        let (event_id, attempt_id) = (scanned.event_id.clone().unwrap_or_default(), scanned.attempt_id.clone().unwrap_or_default());
        w.note(|| format!("log {}/p{}@{offset}: {event_id} attempt {attempt_id}", m.topic, m.partition));
        let log = w.logs.entry((m.topic.clone(), m.partition)).or_default();
        log.push(Stored { event_id, attempt_id, key: m.key.clone(), headers: m.headers.clone(), payload: m.payload.clone(), compacted: false, forged: false, scanned });
        offset
    }
}

#[async_trait]
impl Broker for SimBroker {
    fn cluster_id(&self) -> &str {
        CLUSTER
    }

    fn log_id(&self, topic: &str, partition: i32) -> Option<String> {
        Some(world(&self.world).log_id(&(topic.to_owned(), partition)))
    }

    async fn send(&self, message: OutgoingMessage) -> SendOutcome {
        let (fate, write_after, answer_after) = {
            let mut w = world(&self.world);
            let mut f = w.faults;
            if w.old_degraded && message.topic == TOPIC {
                f.ack_lost = f.ack_lost.max(0.5);
                f.unsent_timeout = f.unsent_timeout.max(0.2);
            }
            let on = w.on;
            let mut pick = |p: f64| on && w.rng.chance(p);
            let fate = if pick(f.not_persisted) {
                Fate::Refused
            } else if pick(f.unsent_timeout) {
                Fate::NeverWritten
            } else if pick(f.ack_lost) {
                Fate::AckLost
            } else if pick(f.write_duplicated) {
                Fate::WrittenTwice
            } else {
                Fate::Written
            };
            let slow = pick(f.slow_write);
            let write_after = if slow { w.rng.range(1, MESSAGE_TIMEOUT_MS) } else { w.rng.range(1, 20) };
            // The host stops right after the handover, the message still in
            // the client's buffer (drawn only where the fault is on).
            if f.host_pause > 0.0 && on && w.rng.chance(f.host_pause) {
                let until = w.now_ms() + w.rng.range(2 * LEASE_MS, 5 * LEASE_MS);
                if self.host.paused_until_ms.fetch_max(until, std::sync::atomic::Ordering::SeqCst) < until {
                    w.figures.host_pauses += 1;
                    w.note(|| format!("the sender's host stops until {} ms, p{} in its client's buffer", until - T0_MS, message.partition));
                }
            }
            let answer_after = match fate {
                Fate::NeverWritten | Fate::AckLost => MESSAGE_TIMEOUT_MS,
                _ => write_after,
            };
            if fate != Fate::Written || slow {
                w.figures.broker_faults += 1;
            }
            w.in_client += 1;
            w.note(|| format!("client takes p{} ({fate:?}, write in {write_after} ms)", message.partition));
            (fate, write_after, answer_after)
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (attempt, topic) = (attempt_of(&message), message.topic.clone());
        let world_ref = self.world.clone();
        let host = self.host.clone();
        // The client: lives on whether or not the sender does, and runs only
        // while its host does.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(write_after as u64)).await;
            let late = host.wait_running(&world_ref).await;
            let mut written = None;
            {
                let mut w = world(&world_ref);
                if late && matches!(fate, Fate::Written | Fate::AckLost | Fate::WrittenTwice) {
                    let a = message.headers.iter().rev().find(|(k, _)| k == headers::ATTEMPT_ID).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
                    w.late_writes.insert(a);
                }
                match fate {
                    Fate::Written => written = Some(SimBroker::write(&mut w, &message)),
                    Fate::AckLost => {
                        // A forger's copy ahead of a genuine write whose
                        // ACK is lost: the reconciler's lookup finds both,
                        // the forged one first, and the event is
                        // QUARANTINED with its genuine copy in the log (an
                        // operator's re-send must be refused).
                        SimBroker::maybe_forge(&mut w, &message);
                        written = Some(SimBroker::write(&mut w, &message));
                    }
                    Fate::WrittenTwice => {
                        SimBroker::write(&mut w, &message);
                        written = Some(SimBroker::write(&mut w, &message));
                    }
                    Fate::NeverWritten => SimBroker::maybe_forge(&mut w, &message),
                    Fate::Refused => {}
                }
            }
            if answer_after > write_after {
                tokio::time::sleep(Duration::from_millis((answer_after - write_after) as u64)).await;
            }
            host.wait_running(&world_ref).await;
            let outcome = match (fate, written) {
                (Fate::Refused, _) => SendOutcome::NotPersisted("simulated: refused".into()),
                (Fate::NeverWritten | Fate::AckLost, _) | (_, None) => SendOutcome::Unknown("simulated: message timed out".into()),
                (_, Some(offset)) => SendOutcome::Acked { partition: message.partition, offset },
            };
            world(&world_ref).in_client -= 1;
            let _ = tx.send(outcome);
        });
        let outcome = rx.await.unwrap_or_else(|_| SendOutcome::Unknown("simulated: client gone".into()));
        if let SendOutcome::Acked { partition, offset } = &outcome {
            let mut w = world(&self.world);
            w.acks_delivered.push((self.host.id, attempt, format!("{topic}/p{partition}@{offset}")));
        }
        outcome
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    fn max_in_flight_ms(&self) -> Option<u64> {
        Some(MESSAGE_TIMEOUT_MS as u64)
    }

    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &outbox_core::ScanFrom) -> LookupOutcome {
        let slow = {
            let mut w = world(&self.world);
            let (fail, mut slow) = (w.faults.lookup_fail, w.faults.lookup_slow);
            if w.old_degraded && destination.topic == TOPIC {
                slow = slow.max(0.5);
            }
            if w.on && w.rng.chance(fail) {
                w.figures.broker_faults += 1;
                return LookupOutcome::Unavailable("simulated: lookup failed".into());
            }
            let slow = if w.on && w.rng.chance(slow) { w.rng.range(1, 2 * LEASE_MS) } else { 0 };
            if slow > 0 {
                w.figures.broker_faults += 1;
                w.note(|| format!("lookup of {event_id} takes {slow} ms"));
            }
            slow
        };
        // A long scan reads up to the log's end as it was when it began (as
        // the Kafka adapter's scan does: its end offset is fetched first),
        // and answers `slow` ms later.
        let answer = self.scan(destination, event_id, from);
        if slow > 0 {
            tokio::time::sleep(Duration::from_millis(slow as u64)).await;
        }
        answer
    }

    /// The reconciler's bypass scan reads the partition's current log, as
    /// the Kafka adapter's does: from the later of `from_offset` and the
    /// log's start (retention), records compaction removed skipped, up to
    /// `max_messages` offsets, with the log's end as it was when it began.
    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<outbox_core::PartitionScan, String> {
        let w = world(&self.world);
        let key = (topic.to_owned(), partition);
        let log = w.logs.get(&key).map(Vec::as_slice).unwrap_or_default();
        let (low, end) = (w.log_start.get(&key).copied().unwrap_or(0), log.len() as i64);
        let start = from_offset.max(low).max(0);
        let high = end.min(start.saturating_add(i64::try_from(max_messages).unwrap_or(i64::MAX)));
        if start >= high {
            return Ok(outbox_core::PartitionScan { messages: Vec::new(), next_offset: start.max(from_offset), log_end: Some(end), log_start: Some(low) });
        }
        let messages = (start..high).filter_map(|o| log.get(o as usize).filter(|m| !m.compacted).map(|m| m.scanned.clone())).collect();
        Ok(outbox_core::PartitionScan { messages, next_offset: high, log_end: Some(end), log_start: Some(low) })
    }
}

impl SimBroker {
    fn scan(&self, destination: &Destination, event_id: &EventId, from: &outbox_core::ScanFrom) -> LookupOutcome {
        let w = world(&self.world);
        let log_key = (destination.topic.clone(), destination.partition);
        let log_id = w.log_id(&log_key);
        let start = w.log_start.get(&log_key).copied().unwrap_or(0);
        let end = w.logs.get(&log_key).map_or(0, |l| l.len() as i64);
        // The anchor check as the Kafka adapter makes it, decided by the same core function.
        let check = match outbox_core::anchor_to_read(from, start, end) {
            Ok((at, _)) => match w.logs.get(&log_key).and_then(|l| l.get(at as usize)).filter(|m| !m.compacted) {
                Some(m) if outbox_core::anchor_holds(from, Some(m.event_id.as_bytes()), Some(m.attempt_id.as_bytes())) => outbox_core::AnchorCheck::Holds,
                Some(_) => outbox_core::AnchorCheck::HoldsOther,
                None => outbox_core::AnchorCheck::NoRecord,
            },
            Err(known) => known,
        };
        let plan = match outbox_core::plan_absence_scan(&destination.topic, destination.partition, from, start, end, check) {
            Ok(plan) => plan,
            Err(why) => return LookupOutcome::Unavailable(why),
        };
        let Some(log) = w.logs.get(&log_key) else { return LookupOutcome::Absent };
        let from = usize::try_from(plan.start.max(start).max(0)).unwrap_or(usize::MAX);
        let mut found = Vec::new();
        let mut next = from as i64;
        for (offset, m) in log.iter().enumerate().skip(from) {
            // A compacted offset holds no record: the next record read is
            // above the offset expected, and the core says what that proves.
            if m.compacted {
                continue;
            }
            if let Err(why) = outbox_core::reconcile::check_no_hole(&destination.topic, destination.partition, next, offset as i64) {
                drop(w);
                world(&self.world).figures.lookups_over_holes += 1;
                return LookupOutcome::Unavailable(why);
            }
            next = offset as i64 + 1;
            if m.event_id != event_id.as_str() {
                continue;
            }
            let Ok(claims) = headers::parse(&m.headers) else { continue };
            found.push(BrokerReceipt {
                event_id: claims.event_id,
                envelope_generation: claims.envelope_generation,
                attempt_id: claims.attempt_id,
                payload_digest: sha256_digest(&m.payload),
                destination_digest: claims.destination_digest,
                cluster_id: CLUSTER.into(),
                topic: destination.topic.clone(),
                topic_id: claims.destination.topic_id.clone(),
                partition: destination.partition,
                offset: offset as i64,
                key: Some(m.key.clone()),
                log_id: Some(log_id.clone()),
            });
        }
        if found.is_empty() {
            LookupOutcome::Absent
        } else {
            LookupOutcome::Found(found)
        }
    }
}

/// The records at a log's end that compaction leaves alone (the active segment).
const ACTIVE_SEGMENT: usize = 2;

/// Compacts `log` as Kafka's log cleaner does: a record outside the active
/// segment whose key a later record has is removed. Answers how many were.
pub(super) fn compact(log: &mut [Stored]) -> u64 {
    let cleanable = log.len().saturating_sub(ACTIVE_SEGMENT);
    let mut removed = 0;
    for i in 0..cleanable {
        if !log[i].compacted && log[i + 1..].iter().any(|later| !later.compacted && later.key == log[i].key) {
            log[i].compacted = true;
            removed += 1;
        }
    }
    removed
}
