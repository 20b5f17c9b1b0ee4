//! Quarantines said out loud: a WARN line per quarantined message (rate
//! limited), and an ERROR when nothing but quarantines comes through (a
//! mistyped accepted source, a missing verification key, a producer that
//! signs with another key): a consumer that quarantines everything applies
//! nothing, and used to say nothing either.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{error, warn};

use crate::outcome::Outcome;

/// The window the line budget counts in.
pub const QUARANTINE_LOG_WINDOW: Duration = Duration::from_secs(10);
/// Most quarantine lines per window; the rest are counted and summed up in
/// one line when the window ends.
pub const QUARANTINE_LOG_LINES_PER_WINDOW: u32 = 20;
/// The first run of consecutive quarantines that raises the ERROR; it is
/// raised again at ten times the run, and so on.
pub const QUARANTINE_RUN_ALARM: u64 = 10;

#[derive(Debug)]
struct State {
    window_start: Instant,
    logged: u32,
    suppressed: u64,
    /// Messages quarantined since the last one that was not.
    run: u64,
    next_alarm: u64,
}

/// The quarantine log of one processor.
#[derive(Debug)]
pub(crate) struct QuarantineLog {
    state: Mutex<State>,
}

impl Default for QuarantineLog {
    fn default() -> Self {
        QuarantineLog { state: Mutex::new(State { window_start: Instant::now(), logged: 0, suppressed: 0, run: 0, next_alarm: QUARANTINE_RUN_ALARM }) }
    }
}

impl QuarantineLog {
    /// Says what a committed transaction quarantined.
    pub(crate) fn observe(&self, consumer_id: &str, outcomes: &[Outcome]) {
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if now.duration_since(st.window_start) >= QUARANTINE_LOG_WINDOW {
            if st.suppressed > 0 {
                warn!(consumer = %consumer_id, not_logged = st.suppressed, "{} more messages quarantined in the last {} s (lines are limited to {} per window; outbox_consumer_quarantined_messages_total counts every one)",
                    st.suppressed, QUARANTINE_LOG_WINDOW.as_secs(), QUARANTINE_LOG_LINES_PER_WINDOW);
            }
            st.window_start = now;
            st.logged = 0;
            st.suppressed = 0;
        }
        for o in outcomes {
            let Outcome::Quarantined(q) = o else {
                st.run = 0;
                st.next_alarm = QUARANTINE_RUN_ALARM;
                continue;
            };
            st.run += 1;
            let reason = q.reason.code();
            if st.logged < QUARANTINE_LOG_LINES_PER_WINDOW {
                st.logged += 1;
                warn!(consumer = %consumer_id, topic = %q.position.topic, partition = q.position.partition, offset = q.position.offset,
                    event_id = %q.event_id.as_deref().unwrap_or("-"), reason = %reason, "message quarantined: not applied (outbox trace <eventId>, or the consumer's outbox_consumer_quarantine row, has the evidence)");
            } else {
                st.suppressed += 1;
            }
            if st.run >= st.next_alarm {
                error!(consumer = %consumer_id, quarantined_in_a_row = st.run, last_reason = %reason,
                    "every one of the last {} messages was quarantined and none applied (last reason {reason}): check the consumer's trust policy (accepted sources, verification keys) against what the producer sends (docs/OPERATIONS.md, `quarantined`)", st.run);
                st.next_alarm = st.next_alarm.saturating_mul(10);
            }
        }
    }
}
