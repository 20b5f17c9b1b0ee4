//! The stream's SQL under deliberate defects (`outbox_tests::sql_mutations`):
//! each rewrites one function of the installed schema, and the concurrent
//! checker (`outbox_tests::concurrent`), run over the defective database,
//! must report the violation the defect causes, and the same workload
//! without the defect is green. A mutation the checker does not catch
//! fails here (`every_sql_mutation_has_a_test`).

use std::time::Duration;

use outbox_producer::DispatchPath;
use outbox_tests::concurrent::{run_checker, CheckerConfig, Figures};
use outbox_tests::sql_mutations::{events_in_two_batches, sql_mutation, SQL_MUTATIONS};
use sqlx::PgPool;

#[test]
fn every_sql_mutation_has_a_test() {
    let source = include_str!("sql_mutations.rs");
    for m in SQL_MUTATIONS {
        assert!(source.contains(&format!("caught(pool, \"{}\"", m.name)), "no test runs the checker under {}", m.name);
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn every_sql_mutation_finds_its_fragment_and_installs(pool: PgPool) {
    for m in SQL_MUTATIONS {
        m.apply(&pool).await.unwrap_or_else(|e| panic!("{e}"));
    }
    // The rewritten functions run.
    sqlx::query("SELECT * FROM outbox_stream_window('{}'::text[], '{}'::smallint[], '{}'::pg_snapshot[], '{}'::pg_snapshot[], '{}'::bigint[], '{}'::bigint[], 1, '{}'::int[], 1)")
        .fetch_all(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT * FROM outbox_stream_claim_leases(NULL, 'o', 0)").fetch_all(&pool).await.unwrap();
}

/// A calm workload: overlapping, aborted and one long transaction, two
/// dispatchers, no faults (`the_checker_sees_a_lost_event` holds it green).
fn calm() -> CheckerConfig {
    CheckerConfig {
        events: 240,
        emit_for: Duration::from_secs(3),
        faults: false,
        migrations: false,
        retention: false,
        long_transaction: true,
        settle_for: Duration::from_secs(40),
        ..CheckerConfig::bounded()
    }
}

/// [`calm`] with a share of COMMIT answers lost (a claim that committed and
/// lost its answer leaves hand-outs nobody sends: they go to the exception
/// lane when the bucket's lease runs out, and their keys' later events
/// wait there), and nothing else.
fn with_lost_commits() -> CheckerConfig {
    CheckerConfig { faults: true, kills: false, takeovers: false, broker_faults: false, lost_commit_per_mille: 20, ..calm() }
}

/// Runs the checker on the stream over a database with the defect `name`
/// under `cfg`, and expects a violation of the kind the catalogue names.
async fn caught(pool: PgPool, name: &str, cfg: CheckerConfig) {
    let m = sql_mutation(name).expect("a catalogued mutation");
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    m.apply(&pool).await.unwrap_or_else(|e| panic!("{e}"));
    // A defect that strands events need not be waited out for the whole
    // settling time the green runs get.
    let cfg = CheckerConfig { settle_for: Duration::from_secs(20), ..cfg };
    let verdict = run_checker(&pool, &cfg).await;
    let mut violations = verdict.violations;
    violations.extend(events_in_two_batches(&pool).await);
    eprintln!("{name}: {} violations, e.g. {:?}", violations.len(), violations.iter().take(5).collect::<Vec<_>>());
    // A `stuck` catch names the event left behind: the checker's general
    // lines (nothing settled in time, a retried commit never made) would
    // also be written by a defect that merely stalls all dispatch.
    let wanted = if m.caught_as == "stuck" { "stuck: evt-".to_owned() } else { format!("{}:", m.caught_as) };
    assert!(verdict.figures.published > 0, "{name}: nothing was published, the defect stalled the workload: {:#?}", verdict.figures);
    assert!(
        violations.iter().any(|v| v.starts_with(&wanted)),
        "the checker did not catch {name} ({}) as {}: {violations:#?}\n{:#?}",
        m.defect,
        m.caught_as,
        verdict.figures
    );
}

/// Runs the checker on the stream under `cfg` over the intact schema:
/// `workload_ran` asserts on the figures that the workload happened, then
/// the verdict must be green (no event in two batches either).
async fn assert_green(pool: &PgPool, cfg: CheckerConfig, workload_ran: impl FnOnce(&Figures)) {
    outbox_producer::set_dispatch_path(pool, DispatchPath::Stream).await.unwrap();
    let verdict = run_checker(pool, &cfg).await;
    let mut violations = verdict.violations;
    violations.extend(events_in_two_batches(pool).await);
    workload_ran(&verdict.figures);
    assert!(violations.is_empty(), "{violations:#?}");
}

/// The workload [`calm`] is green without a defect.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_is_green_on_a_calm_stream(pool: PgPool) {
    assert_green(&pool, calm(), |f| assert!(f.long_transaction_events > 0 && f.aborted > 0, "{f:#?}")).await;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_catches_a_reversed_order(pool: PgPool) {
    caught(pool, "stream-sql-reversed-order", calm()).await;
}

/// The workload [`with_lost_commits`] is green without a defect.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_is_green_with_lost_commit_answers(pool: PgPool) {
    assert_green(&pool, with_lost_commits(), |f| assert!(f.commit_answers_cut > 0, "no COMMIT answer was lost: {f:#?}")).await;
}

/// The defect needs events in the exception lane, which here only a
/// claim whose COMMIT answer was lost puts there: at 20 per mille of all
/// COMMITs a run once lost none of a claim's (10 answers cut, 0 events in
/// the lane, not caught), so this run loses more.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_catches_a_dropped_lane_state_predicate(pool: PgPool) {
    caught(pool, "stream-sql-lane-state-dropped", CheckerConfig { lost_commit_per_mille: 80, ..with_lost_commits() }).await;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_catches_an_unfenced_lease_write(pool: PgPool) {
    caught(pool, "stream-sql-unfenced-lease-write", calm()).await;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_catches_a_batch_cut_by_position(pool: PgPool) {
    caught(pool, "stream-sql-cut-by-position", calm()).await;
}
