//! The emit command (PROTOCOL §2): command keys and aggregate versions.

use outbox_core::error::CoreError;
use outbox_core::state::EventState;
use outbox_core::store::OutboxStore;

use super::ctx::{ensure, eq, err, Ctx};
use super::{Harness, Verdict};

/// `emit`'s command decision (`decide_command`): a key names one event for
/// ever (a retry with the same content answers it, even after later
/// commands of its aggregate; other content is refused), and an
/// aggregate's versions never go backwards (an equal version is allowed).
pub(super) async fn command_keys_and_aggregate_versions<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let n = |name: &str| format!("{}-{name}", c.prefix);
    let first = c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":1}").await.map_err(err("first command"))?;
    eq("a retry of the command", c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":1}").await.map_err(err("retry"))?, first.clone())?;
    for (what, result) in [
        ("payload", c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":2}").await),
        ("aggregate", c.command(&n("k1"), &n("b"), 2, "order.created", b"{\"n\":1}").await),
        ("event type", c.command(&n("k1"), &n("a"), 2, "order.paid", b"{\"n\":1}").await),
    ] {
        match result {
            Err(CoreError::CommandKeyConflict { event_id, what: got, .. }) => {
                eq("the conflict names the key's first event", &event_id, &first)?;
                eq("what differs", got, what)?;
            }
            other => return Err(format!("the key reused with another {what}: got {other:?}, want CommandKeyConflict")),
        }
    }
    match c.command(&n("k2"), &n("a"), 1, "order.created", b"{\"n\":3}").await {
        Err(CoreError::AggregateVersionBackwards { version: 1, last: 2, .. }) => {}
        other => return Err(format!("version 1 after 2: got {other:?}, want AggregateVersionBackwards {{ version: 1, last: 2 }}")),
    }
    let equal = c.command(&n("k2"), &n("a"), 2, "order.created", b"{\"n\":3}").await.map_err(err("an equal version"))?;
    ensure(equal != first, || "an equal version under a new key is a new event".into())?;
    // The other aggregate has its own versions.
    c.command(&n("k3"), &n("b"), 1, "order.created", b"{\"n\":4}").await.map_err(err("another aggregate's version 1"))?;
    c.command(&n("k4"), &n("a"), 5, "order.created", b"{\"n\":5}").await.map_err(err("version 5"))?;
    eq("a retry after later commands of the aggregate", c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":1}").await.map_err(err("late retry"))?, first.clone())?;
    // The refused commands wrote nothing: the key still names the first event, which waits to be claimed.
    eq("the first event's state", c.s().event_state(&first).await.map_err(err("event_state"))?.0, EventState::Pending)?;
    Ok(())
}
