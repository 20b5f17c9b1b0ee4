//! The world the services run in: the state the store, the broker and the
//! driver of one trace share (the logs, gone and current; the hosts, their
//! pauses and clocks; what the services did, for the checks).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::config::ServiceFaults;
use super::figures::ServiceFigures;
use super::T0_MS;
use crate::rng::Rng;

/// Shared by the store, the broker and the driver of one trace.
pub(super) struct World {
    pub(super) rng: Rng,
    /// The hosts' clock offsets are drawn from their own stream, so that
    /// skew changes nothing else of a trace.
    pub(super) clock_rng: Rng,
    pub(super) faults: ServiceFaults,
    /// Whether faults are injected now.
    pub(super) on: bool,
    pub(super) start: Instant,
    pub(super) figures: ServiceFigures,
    pub(super) log: Option<Vec<String>>,
    /// Per (topic, partition), every message written, in order (including
    /// those retention deleted since: consumers may have read them).
    pub(super) logs: BTreeMap<(String, i32), Vec<Stored>>,
    /// Per (topic, partition), the first offset still in the log.
    pub(super) log_start: BTreeMap<(String, i32), i64>,
    /// Logs that are gone (a topic recreated, the cluster replaced), oldest first.
    pub(super) gone: Vec<GoneLog>,
    /// When (the world's clock) a reconciler's proof closed each attempt ABSENT.
    pub(super) absent_at: BTreeMap<String, i64>,
    /// The mandatory consumer group's watermarks on another cluster's topic
    /// of the same name, per (cluster, topic, partition): far ahead of this
    /// cluster's logs (retention must not take them for those).
    pub(super) consumer_at: BTreeMap<(String, String, i32), i64>,
    /// Violations found while the trace runs (a purge checked when it happens).
    pub(super) violations: Vec<String>,
    /// Whether `TOPIC` is degraded (why the operator moves the route away):
    /// from then on its writes lose their ACK or time out more often, and
    /// its lookups are slow more often.
    pub(super) old_degraded: bool,
    /// Findings the services recorded: (kind, event id).
    pub(super) findings: Vec<(String, String)>,
    /// Client requests not answered yet (the log may still change).
    pub(super) in_client: usize,
    /// Receipt calls in progress (stalled, or waiting for their host): a
    /// receipt on its way to the store may still change what it holds.
    pub(super) in_store: usize,
    /// Attempts whose write a host pause held back until its host resumed.
    pub(super) late_writes: BTreeSet<String>,
    /// (host, attempt) of every receipt a host's store call took.
    pub(super) handed_by: BTreeSet<(usize, String)>,
    /// (host, attempt) of every receipt a host called the store with
    /// (whether or not the call got through).
    pub(super) tried_by: BTreeSet<(usize, String)>,
    /// (host, attempt, position) of every ACK the broker client answered
    /// to a dispatcher of that host.
    pub(super) acks_delivered: Vec<(usize, String, String)>,
    /// Hosts whose process was killed (its memory lost: an ACK it held is
    /// the reconciler's to find).
    pub(super) killed_hosts: BTreeSet<usize>,
    /// Hosts started so far.
    pub(super) hosts: usize,
    /// Per send whose request never reaches the log, the chance that a
    /// forger writes a message with its headers and other payload bytes
    /// (0 in most traces), and the forger's own generator.
    pub(super) forge: f64,
    pub(super) forge_rng: Rng,
    /// Counts the commits of new events: what dispatchers' listening
    /// sessions hear (`NOTIFY outbox_pending` in PostgreSQL).
    /// (tokio's watch channel is not used: it wakes its receivers in an
    /// order drawn at random, which would make a trace differ between runs.)
    pub(super) commits: u64,
    pub(super) committed: Arc<tokio::sync::Notify>,
    /// Listening sessions lost, drawn on their own.
    pub(super) listen_rng: Rng,
    /// Offsets the bypass scan reported it could not read (`scan_gap`):
    /// (topic, partition), the log's incarnation, from, to.
    pub(super) scan_gaps: Vec<((String, i32), usize, i64, i64)>,
    /// Copies the reconciler's bypass scan recorded a finding about
    /// (`unrecorded_copy`, `divergent_copy`): (topic, partition, offset, attempt).
    pub(super) copies_reported: BTreeSet<(String, i32, i64, String)>,
}

/// The host a process runs on. A pause of the host (`ServiceFaults::host_pause`)
/// holds back everything of it: its store calls and its broker client.
#[derive(Debug, Default)]
pub(super) struct Host {
    /// Which host (numbered in the order they start).
    pub(super) id: usize,
    /// Until when (ms, the world's clock) the host is stopped.
    pub(super) paused_until_ms: std::sync::atomic::AtomicI64,
    /// How far this host's clock is ahead of true time (negative: behind).
    pub(super) skew_ms: i64,
}

impl Host {
    /// Waits until the host runs; whether it had to.
    pub(super) async fn wait_running(&self, world_ref: &Shared) -> bool {
        let mut waited = false;
        loop {
            let until = self.paused_until_ms.load(std::sync::atomic::Ordering::SeqCst);
            let now = world(world_ref).now_ms();
            if until <= now {
                return waited;
            }
            waited = true;
            tokio::time::sleep(Duration::from_millis((until - now) as u64)).await;
        }
    }
}

/// A partition's log that is gone: its topic was deleted (and created
/// again), or its cluster replaced.
#[derive(Debug)]
pub(super) struct GoneLog {
    /// (topic, partition).
    pub(super) key: (String, i32),
    /// When it went (the world's clock).
    pub(super) gone_at_ms: i64,
    /// Every message it held.
    pub(super) log: Vec<Stored>,
}

#[derive(Debug, Clone)]
pub(super) struct Stored {
    pub(super) event_id: String,
    pub(super) attempt_id: String,
    pub(super) key: Vec<u8>,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) payload: Vec<u8>,
    /// Removed by log compaction (a later record has its key): the offset
    /// holds no record for a reader; the checks still know what was there.
    pub(super) compacted: bool,
    /// Written by a forger, not by the outbox: a registered attempt's
    /// headers over other payload bytes.
    pub(super) forged: bool,
    /// What the reconciler's bypass scan reads of it, computed once at
    /// the write (the scan reads a page again while it waits at a copy).
    pub(super) scanned: outbox_core::ScannedMessage,
}

impl World {
    /// Which of the logs `topic`/`partition` has had (the gone ones oldest
    /// first, then the current one) holds `attempt`'s message of `event` at
    /// `offset`: its index, whether it is the current log, and the message.
    pub(super) fn log_holding(&self, topic: &str, partition: i32, offset: i64, event: &str, attempt: &str) -> Option<(usize, bool, &Stored)> {
        let key = (topic.to_owned(), partition);
        let at = usize::try_from(offset).ok()?;
        let gone = self.gone.iter().filter(|g| g.key == key).map(|g| (&g.log, false));
        gone.chain(self.logs.get(&key).map(|l| (l, true)))
            .enumerate()
            .find_map(|(i, (l, current))| l.get(at).filter(|m| m.event_id == event && m.attempt_id == attempt).map(|m| (i, current, m)))
    }

    /// Deletes the logs `which` picks: their messages are gone, their
    /// partitions start again empty at offset 0, and the consumer reads them
    /// from their start (its group's offsets went with the old topic).
    pub(super) fn reset_logs(&mut self, which: impl Fn(&str) -> bool) {
        let now = self.now_ms();
        let keys: Vec<(String, i32)> = self.logs.keys().filter(|(t, _)| which(t)).cloned().collect();
        for key in keys {
            let log = self.logs.remove(&key).unwrap_or_default();
            self.log_start.remove(&key);
            self.gone.push(GoneLog { key, gone_at_ms: now, log });
        }
        self.figures.log_resets += 1;
    }

    /// ACKs answered to a dispatcher that lives on and that it has not
    /// handed to `acceptDispatchReceipt` (yet): (host, attempt, position).
    pub(super) fn unrecorded_acks(&self) -> impl Iterator<Item = &(usize, String, String)> {
        self.acks_delivered.iter().filter(|(host, attempt, _)| !self.killed_hosts.contains(host) && !self.handed_by.contains(&(*host, attempt.clone())))
    }

    /// Of [`World::unrecorded_acks`], those its dispatcher never even tried
    /// to record (a try whose store call failed, and that the dispatcher
    /// gave up after its retry budget, leaves the ACK to the reconciler).
    pub(super) fn untried_acks(&self) -> impl Iterator<Item = &(usize, String, String)> {
        self.unrecorded_acks().filter(|(host, attempt, _)| !self.tried_by.contains(&(*host, attempt.clone())))
    }

    /// Whether a forged message sits at `offset` of `topic`/`partition`, in
    /// its current log or one that is gone.
    pub(super) fn forged_at(&self, topic: &str, partition: i32, offset: i64) -> bool {
        let key = (topic.to_owned(), partition);
        let Ok(at) = usize::try_from(offset) else { return false };
        self.gone.iter().filter(|g| g.key == key).map(|g| &g.log).chain(self.logs.get(&key)).any(|l| l.get(at).is_some_and(|m| m.forged))
    }

    pub(super) fn now_ms(&self) -> i64 {
        T0_MS + i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
    }

    /// How many logs of (topic, partition) are gone: the current one's
    /// number among them.
    pub(super) fn incarnation(&self, key: &(String, i32)) -> usize {
        self.gone.iter().filter(|g| g.key == *key).count()
    }

    /// The identity of a partition's current log, as clients read it (a
    /// topic id: another for each incarnation).
    pub(super) fn log_id(&self, key: &(String, i32)) -> String {
        log_id_of(self.incarnation(key))
    }

    pub(super) fn note(&mut self, line: impl FnOnce() -> String) {
        if self.log.is_some() {
            let at = self.now_ms() - T0_MS;
            let line = line();
            if let Some(log) = &mut self.log {
                log.push(format!("{at:>8} ms  {line}"));
            }
        }
    }
}

pub(super) type Shared = Arc<Mutex<World>>;

/// A receipt call in progress (see `World::in_store`).
pub(super) struct Busy(pub(super) Shared);

impl Drop for Busy {
    fn drop(&mut self) {
        world(&self.0).in_store -= 1;
    }
}

pub(super) fn world(w: &Shared) -> std::sync::MutexGuard<'_, World> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

/// The identity of a partition's log in its `incarnation` (what a client
/// reads as the topic's id).
pub(super) fn log_id_of(incarnation: usize) -> String {
    // In a topic id's text form, as a broker gives it (watermark records
    // carry it and refuse anything else).
    let mut bytes = [0x51u8; 16];
    bytes[8..].copy_from_slice(&(incarnation as u64).to_be_bytes());
    outbox_core::envelope::topic_id_text(&bytes)
}
