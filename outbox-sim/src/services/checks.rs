//! The end-of-trace checks: what the store and the logs must show once a
//! trace settled (no lost write, no unaccounted copy, no refuted absence,
//! consistent offsets, per-key order, no unknown outcome left, no ACK a
//! living dispatcher dropped).

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::{sha256_digest, AttemptRecord, AttemptState, EventId, EventState};
use outbox_memory::MemoryStore;

use super::world::World;

/// Every ACK the broker client answered to a dispatcher that lived on was
/// handed by that dispatcher to `acceptDispatchReceipt` (SPEC §5: the
/// result of a request already sent is never thrown away, whatever became
/// of its claim). A killed dispatcher's ACKs are the reconciler's to find.
pub(super) fn check_acks(store: &MemoryStore, w: &mut World, late_acks: u64, violations: &mut Vec<String>) {
    w.figures.late_acks += late_acks;
    w.figures.acks_to_live_senders += w.acks_delivered.iter().filter(|(host, ..)| !w.killed_hosts.contains(host)).count() as u64;
    // Receipts the store holds, by attempt.
    let st = store.lock();
    let held: BTreeSet<String> = st.events.values().filter_map(|e| e.slot.as_ref()).chain(&st.duplicates).map(|r| r.attempt_id.to_string()).collect();
    let event_of: BTreeMap<String, String> = st.attempts.values().flatten().map(|a| (a.attempt_id.to_string(), a.event_id.to_string())).collect();
    // Closed by a reconciler's proof about the log as it is now (the copy
    // went with a log since lost; a copy still there is `refuted_absence`).
    let proven_absent: BTreeSet<String> = st.attempts.values().flatten().filter(|a| a.state == AttemptState::Absent).map(|a| a.attempt_id.to_string()).collect();
    drop(st);
    let mut dropped = Vec::new();
    for (host, attempt, at) in w.unrecorded_acks() {
        // Tried, its store call failed past the dispatcher's retry budget:
        // the ACK is the reconciler's to find, and must have converged, or
        // its event be reported (`log_unavailable`: the log cannot say), or
        // its attempt be proven absent from the log there is now.
        let reported = event_of.get(attempt).is_some_and(|e| w.findings.iter().any(|(k, id)| k == "log_unavailable" && id == e));
        if w.tried_by.contains(&(*host, attempt.clone())) && (held.contains(attempt) || reported || proven_absent.contains(attempt)) {
            continue;
        }
        dropped.push(format!("ack_dropped: the ACK of attempt {attempt} at {at} reached host {host}'s dispatcher, which lived on and never recorded it"));
    }
    w.figures.ack_dropped += dropped.len() as u64;
    violations.extend(dropped);
}

pub(super) fn check(store: &MemoryStore, w: &mut World, emitted: &[(EventId, String)], violations: &mut Vec<String>) {
    let st = store.lock();
    w.figures.events += emitted.len() as u64;
    w.figures.migrations += st.migrations.len() as u64;
    // Receipts the store holds, by position.
    let mut receipts: BTreeMap<(String, i32, i64), Vec<(String, String)>> = BTreeMap::new();
    for ev in st.events.values() {
        if let Some(slot) = &ev.slot {
            receipts.entry((slot.topic.clone(), slot.partition, slot.offset)).or_default().push((slot.event_id.to_string(), slot.attempt_id.to_string()));
        }
    }
    for d in &st.duplicates {
        receipts.entry((d.topic.clone(), d.partition, d.offset)).or_default().push((d.event_id.to_string(), d.attempt_id.to_string()));
    }
    for ((t, p, o), rs) in &receipts {
        // Receipts at one position of two logs (the topic recreated, the
        // cluster replaced in between: offsets restart) are no conflict.
        let mut by_log: BTreeMap<Option<usize>, BTreeSet<&String>> = BTreeMap::new();
        for (e, a) in rs {
            by_log.entry(w.log_holding(t, *p, *o, e, a).map(|(i, ..)| i)).or_default().insert(e);
        }
        if let Some(events) = by_log.values().find(|events| events.len() > 1) {
            w.figures.inconsistent_offsets += 1;
            violations.push(format!("inconsistent_offsets: {t}/p{p}@{o} holds receipts of {events:?}"));
        }
    }
    let attempts_by_id: BTreeMap<String, &AttemptRecord> = st.attempts.values().flatten().map(|a| (a.attempt_id.to_string(), a)).collect();
    w.figures.attempts += attempts_by_id.len() as u64;
    let migrated: BTreeSet<&EventId> = st.migrations.iter().map(|m| &m.event_id).collect();
    // Every event: published with its slot holding it, or settled otherwise.
    let mut published_by_key: BTreeMap<String, Vec<(u64, usize, i32, i64)>> = BTreeMap::new();
    for (id, key) in emitted {
        let Some(ev) = st.events.get(id) else {
            w.figures.lost_write += 1;
            violations.push(format!("lost_write: {id} committed and not in the outbox"));
            continue;
        };
        match ev.state {
            s if s.is_published() => {
                w.figures.published += 1;
                let Some(slot) = &ev.slot else {
                    w.figures.lost_write += 1;
                    violations.push(format!("lost_write: {id} PUBLISHED without a receipt"));
                    continue;
                };
                // The receipt's position holds its message, in the current
                // log or in one that is gone since (the broker lost it with
                // the topic or the cluster: not the outbox's loss).
                let held = w.log_holding(&slot.topic, slot.partition, slot.offset, id.as_str(), slot.attempt_id.as_str());
                if held.is_some_and(|(_, _, m)| sha256_digest(&m.payload) != ev.envelope.payload_digest) {
                    w.figures.divergent_accepted += 1;
                    violations.push(format!("divergent_accepted: {id}'s slot {}/p{}@{} holds other bytes than its frozen payload", slot.topic, slot.partition, slot.offset));
                    continue;
                }
                let holding = held.map(|(i, current, _)| (i, current));
                match holding {
                    Some((_, false)) => w.figures.receipt_positions_lost += 1,
                    Some(_) => {}
                    None => {
                        w.figures.lost_write += 1;
                        violations.push(format!("lost_write: {id}'s receipt {}/p{}@{} does not hold its message", slot.topic, slot.partition, slot.offset));
                    }
                }
                let log_index = holding.map_or(usize::MAX, |(i, _)| i);
                // A migrated event left its key's order on purpose (the
                // operator moved it after later events took the new route).
                if !migrated.contains(id) && ev.destination.ordering == outbox_core::Ordering::Key {
                    published_by_key.entry(format!("{}/{key}", slot.topic)).or_default().push((ev.seq, log_index, slot.partition, slot.offset));
                }
            }
            EventState::Quarantined => w.figures.quarantined += 1,
            EventState::DispatchUnknown | EventState::Reconciling => {
                if w.findings.iter().any(|(k, e)| k == "log_unavailable" && e == id.as_str()) {
                    w.figures.unknown_reported += 1;
                } else {
                    w.figures.unresolved_unknown += 1;
                    violations.push(format!("unresolved_unknown: {id} is {:?} and no finding reports it", ev.state));
                }
            }
            _ => {}
        }
    }
    w.figures.unknown_attempts += st.audit.iter().filter(|a| a.action == "unknown").count() as u64
        + attempts_by_id.values().filter(|a| a.state == AttemptState::Absent).count() as u64;
    // When a proof closed an attempt ABSENT: a reconciler's, or a migration's.
    let closed_at = |attempt: &str| {
        w.absent_at.get(attempt).copied().or_else(|| st.migrations.iter().find(|r| r.closed_attempts.iter().any(|a| a.as_str() == attempt)).map(|r| r.at_ms))
    };
    // Attempts with a copy in a log that is gone, and when the first went.
    let mut in_gone: BTreeMap<&str, i64> = BTreeMap::new();
    for g in &w.gone {
        for m in &g.log {
            in_gone.entry(m.attempt_id.as_str()).or_insert(g.gone_at_ms);
        }
    }
    for a in st.audit.iter().filter(|a| a.action == "absence_proof_refuted") {
        // A paused host's write, landed after the in-flight bound, or a
        // write into a log gone before the proof (which was about the log
        // that replaced it, and true of it) whose ACK came after it: the
        // protocol's answer is this finding and the receipt's acceptance.
        let attempt = a.detail.split(' ').next().unwrap_or_default();
        let explained = w.late_writes.contains(attempt) || in_gone.get(attempt).is_some_and(|g| closed_at(attempt).is_some_and(|c| c >= *g));
        if explained && attempts_by_id.get(attempt).is_some_and(|r| r.state == AttemptState::Acked) {
            w.figures.absence_refuted_late += 1;
            continue;
        }
        w.figures.refuted_absence += 1;
        violations.push(format!("refuted_absence: the store saw a copy of {} after proving it absent ({})", a.event_id, a.detail));
    }
    if w.log.is_some() {
        let mut lines = Vec::new();
        for ev in st.events.values() {
            let stream = st.stream.as_ref().map(|s| {
                let id = &ev.envelope.event_id;
                let batch = s.batch_of.get(id).map(|b| format!("batch {b}{}", if s.open.values().any(|o| o == b) { " (open)" } else { "" }));
                format!(" [{}{}]", batch.unwrap_or_else(|| "unbatched".into()), if s.lane.contains(id) { ", lane" } else { "" })
            });
            lines.push(format!(
                "final {} seq {} key {} {:?} gen {} claim {:?}/{}/{:?} slot {:?}{}",
                ev.envelope.event_id,
                ev.seq,
                ev.envelope.aggregate_id,
                ev.state,
                ev.envelope.envelope_generation,
                ev.claim.owner,
                ev.claim.claim_generation,
                ev.claim.lease_until_ms,
                ev.slot.as_ref().map(|r| (r.topic.clone(), r.partition, r.offset, r.attempt_id.to_string())),
                stream.unwrap_or_default()
            ));
            for a in st.attempts.get(&ev.envelope.event_id).into_iter().flatten() {
                lines.push(format!("      attempt {} by {} gen {} envelope gen {} {:?}", a.attempt_id, a.owner, a.claim_generation, a.envelope_generation, a.state));
            }
        }
        for a in &st.audit {
            lines.push(format!("audit {} {} {}", a.event_id, a.action, a.detail));
        }
        if let Some(log) = &mut w.log {
            log.extend(lines);
        }
    }
    // Events a paused host wrote late.
    let late_events: BTreeSet<String> = w.late_writes.iter().filter_map(|a| attempts_by_id.get(a)).map(|a| a.event_id.to_string()).collect();
    // Every copy in the log is accounted for.
    let mut copies_per_event: BTreeMap<&str, u64> = BTreeMap::new();
    // The current logs, then those that are gone (with when they went), each
    // with its incarnation.
    let logs: Vec<_> = w
        .logs
        .iter()
        .map(|(key, l)| (&key.0, &key.1, l, None, w.incarnation(key)))
        .chain(w.gone.iter().enumerate().map(|(i, g)| (&g.key.0, &g.key.1, &g.log, Some(g.gone_at_ms), w.gone[..i].iter().filter(|o| o.key == g.key).count())))
        .collect();
    for (t, p, log, gone_at, incarnation) in logs {
        for (o, m) in log.iter().enumerate() {
            // Not the outbox's write: it must never fill a slot (above).
            if m.forged {
                continue;
            }
            *copies_per_event.entry(m.event_id.as_str()).or_default() += 1;
            let recorded = receipts.get(&(t.clone(), *p, o as i64)).is_some_and(|rs| rs.iter().any(|(e, _)| e == &m.event_id));
            let attempt = attempts_by_id.get(&m.attempt_id);
            // A copy of the generation a migration left behind, in the
            // target it left: the migration's proof of absence was wrong.
            // A log gone before the migration's proof was not the log it
            // proved absence in.
            let left_behind = attempt.is_some_and(|a| {
                st.migrations.iter().any(|r| {
                    r.event_id == a.event_id && r.from_generation == a.envelope_generation && r.from_destination.topic == *t && gone_at.is_none_or(|g| r.at_ms < g)
                })
            });
            if left_behind {
                w.figures.migrated_over_copy += 1;
                violations.push(format!("migrated_over_copy: {t}/p{p}@{o} holds {} attempt {} of the generation its migration proved absent from {t}", m.event_id, m.attempt_id));
                continue;
            }
            // The reconciler's bypass scan recorded a finding naming this
            // copy (`unrecorded_copy`, `divergent_copy`): its evidence.
            let reported = w.copies_reported.contains(&(t.clone(), *p, o as i64, m.attempt_id.clone()))
                // Or deleted from the log before the scan read it, and the
                // scan said so (`scan_gap`).
                || w.scan_gaps.iter().any(|((gt, gp), gi, from, to)| gt == t && gp == p && *gi == incarnation && (*from..*to).contains(&(o as i64)));
            match attempt.map(|a| a.state) {
                // A copy of an event a paused host wrote late (this copy, or
                // the retry the refuted proof let through, whose event the
                // late copy then published), whose receipt never reached the
                // store (its sender killed, its ACK lost): only the bypass
                // scan tells the store of it. One the store was handed and
                // left ABSENT is a genuine receipt discarded.
                Some(AttemptState::Absent | AttemptState::Unknown | AttemptState::Sending)
                    if late_events.contains(m.event_id.as_str()) && !w.handed_by.iter().any(|(_, a)| *a == m.attempt_id) =>
                {
                    if reported {
                        w.figures.copies_reported += 1;
                    } else {
                        w.figures.late_copies_unheard += 1;
                    }
                }
                // A copy in a log gone before the proof that closed its
                // attempt (a reconciler's, or a migration's): the proof was
                // about the log that replaced it, and true of it.
                Some(AttemptState::Absent) if gone_at.is_some_and(|g| closed_at(&m.attempt_id).is_some_and(|closed| closed >= g)) => {}
                Some(AttemptState::NotSent | AttemptState::Absent) => {
                    w.figures.refuted_absence += 1;
                    violations.push(format!("refuted_absence: {t}/p{p}@{o} holds {} attempt {}, closed {:?}", m.event_id, m.attempt_id, attempt.map(|a| a.state)));
                }
                _ if recorded => {}
                // Reported instead: its event's log was truncated before a
                // lookup could find it (the finding `log_unavailable`).
                _ if w.findings.iter().any(|(k, e)| k == "log_unavailable" && *e == m.event_id) => {}
                // A transport copy of an attempt whose receipt the store
                // holds elsewhere (the client wrote it twice): evidence the
                // reconciler's scan reports, not a second send.
                Some(AttemptState::Acked) => {}
                // A copy of an attempt still open (its ACK lost) of an
                // event another receipt published: no reconciliation asks
                // about an attempt of a published event, so no receipt
                // records it. The reconciler's bypass scan reports it
                // (`unrecorded_copy`) once the attempt is past its in-flight
                // bound (`outbox_core::compare::judge_scanned`; test
                // `sound/late_acks.rs::a_copy_of_an_attempt_left_open_by_a_late_ack_is_a_finding`).
                Some(AttemptState::Unknown | AttemptState::Sending) if reported => {
                    w.figures.copies_reported += 1;
                }
                // A copy compaction removed: no longer in the log, nothing
                // can find it (and no receipt is owed for it).
                _ if m.compacted => {}
                other => {
                    w.figures.duplicate += 1;
                    violations.push(format!("duplicate: {t}/p{p}@{o} holds {} attempt {} ({other:?}), no receipt accounts for it", m.event_id, m.attempt_id));
                }
            }
        }
    }
    w.figures.duplicates_in_log += copies_per_event.values().map(|n| n.saturating_sub(1)).sum::<u64>();
    // Per key and topic, publication follows commit order: positions rise with seq.
    for (key, mut evs) in published_by_key {
        evs.sort();
        for pair in evs.windows(2) {
            let ((s1, l1, p1, o1), (s2, l2, p2, o2)) = (pair[0], pair[1]);
            // Offsets compare within one log only (a recreated topic's restart at 0).
            if p1 == p2 && l1 == l2 && o2 < o1 {
                w.figures.order_violation += 1;
                violations.push(format!("order_violation: key {key}: seq {s2} at p{p2}@{o2} before seq {s1} at p{p1}@{o1}"));
            }
        }
    }
}

/// Nothing of an aborted emitting transaction is ever seen: its event is
/// not in the store, and no log, current or gone, holds a message of it.
pub(super) fn check_aborted(store: &MemoryStore, w: &mut World, aborted: &[EventId], violations: &mut Vec<String>) {
    let st = store.lock();
    for id in aborted {
        let in_store = st.events.contains_key(id);
        let in_log = w.logs.values().chain(w.gone.iter().map(|g| &g.log)).flatten().any(|m| m.event_id == id.as_str());
        if in_store || in_log {
            w.figures.aborted_visible += 1;
            violations.push(format!("aborted_visible: {id} of an aborted transaction is {}", if in_store { "in the store" } else { "in a log" }));
        }
    }
}
