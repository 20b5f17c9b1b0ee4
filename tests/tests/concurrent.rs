//! The concurrent checker (issue 44 item 2, `outbox_tests::concurrent`)
//! over real PostgreSQL and librdkafka's in-process Kafka cluster: many
//! connections interleave emits (overlapping, long, aborted transactions,
//! commits whose answers are lost), real dispatchers are killed and taken
//! over, their sessions terminated mid-statement and their COMMIT answers
//! lost, sends lose their answers, a reconciler resolves what is left
//! unknown, an operator migrates events to another topic and retention
//! runs; then every record of the topics is read back and checked for
//! `lost`, `duplicate`, `order_violation`, `stuck`, `cross_destination`
//! and `second_logical_event`.
//!
//! `scripts/test` (`cargo test --workspace`) runs the bounded form (about
//! 500 events over 8 s of faults). The longer run is the same test with
//! a bigger workload from the environment (events spread at 60 a second;
//! each round has its own seed and topics):
//!
//! ```text
//! OUTBOX_CHECKER_EVENTS=20000 OUTBOX_CHECKER_ROUNDS=3 OUTBOX_CHECKER_SEED=7 \
//!   cargo nextest run -p outbox-tests --test concurrent --no-capture the_concurrent_checker_is_green_on_the_stream
//! ```
//!
//! `OUTBOX_CHECKER_EMITTERS`, `OUTBOX_CHECKER_KEYS` and
//! `OUTBOX_CHECKER_DISPATCHERS` change the rest of the shape; each fault
//! can be switched off to find which one a violation needs
//! (`OUTBOX_CHECKER_FAULTS`, `_KILLS`, `_TAKEOVERS`, `_BROKER_FAULTS`,
//! `_MIGRATIONS`, `_RETENTION`, `_LONG` = 0; `_LOST_COMMITS` = per mille of
//! COMMIT answers lost; `_LEASE_MS`). A red verdict prints every violation
//! by category with the seed to reproduce it under, and what the store
//! holds for the first stuck keys and the events the others name.

use outbox_core::EventId;
use outbox_producer::DispatchPath;
use outbox_tests::concurrent::{run_checker, CheckerConfig, Verdict};
use sqlx::PgPool;

/// Runs the checker `cfg.rounds` times (seeds `cfg.seed`, `cfg.seed + 1`,
/// ...), printing each round's figures; every violation of every round.
/// `workload_ran` asserts on each round's figures that its workload and
/// faults happened.
async fn rounds(
    pool: &PgPool,
    cfg: &CheckerConfig,
    path: &str,
    workload_ran: fn(&CheckerConfig, &Verdict),
) -> Vec<String> {
    let mut violations = Vec::new();
    for round in 0..cfg.rounds {
        let cfg = CheckerConfig {
            seed: cfg.seed + round as u64,
            ..cfg.clone()
        };
        let verdict = run_checker(pool, &cfg).await;
        report(path, &cfg, &verdict);
        workload_ran(&cfg, &verdict);
        violations.extend(
            verdict
                .violations
                .into_iter()
                .map(|v| format!("[seed {}] {v}", cfg.seed)),
        );
    }
    violations
}

fn report(path: &str, cfg: &CheckerConfig, v: &Verdict) {
    eprintln!(
        "concurrent checker, {path} path, seed {}: {:#?}",
        cfg.seed, v.figures
    );
    let mut categories = std::collections::BTreeMap::new();
    for violation in &v.violations {
        *categories
            .entry(violation.split(':').next().unwrap_or_default())
            .or_insert(0) += 1;
    }
    eprintln!("violations by category: {categories:?}");
    for violation in v.violations.iter().take(50) {
        eprintln!("  VIOLATION {violation}");
    }
    if v.violations.len() > 50 {
        eprintln!("  ... and {} more", v.violations.len() - 50);
    }
    for line in &v.diagnostics {
        eprintln!("  {line}");
    }
}

/// The workload really happened: the faults the checker claims to inject
/// were injected, so a green verdict means something.
fn assert_the_faults_happened(cfg: &CheckerConfig, v: &Verdict) {
    let f = &v.figures;
    assert!(
        f.committed as usize > cfg.events / 2 && f.aborted > 0,
        "the workload did not run: {f:#?}"
    );
    if cfg.long_transaction {
        assert!(
            f.long_transaction_events > 0 && f.commits_under_long_transaction > 0,
            "the long transaction overlapped nothing: {f:#?}"
        );
    }
    if !cfg.faults {
        return;
    }
    assert!(!cfg.takeovers || f.takeovers > 0, "no takeover: {f:#?}");
    assert!(
        !cfg.kills || f.sessions_killed > 0,
        "no session was killed: {f:#?}"
    );
    assert!(
        !cfg.broker_faults || f.slow_broker_windows + f.produce_errors > 0,
        "no send lost its answer: {f:#?}"
    );
    assert!(
        cfg.lost_commit_per_mille == 0 || f.commit_answers_cut > 0,
        "no COMMIT answer was lost: {f:#?}"
    );
    assert!(
        !cfg.migrations || f.migrations > 0,
        "no destination migration: {f:#?}"
    );
    assert!(!cfg.retention || f.retained > 0, "retention retained nothing: {f:#?}");
}

/// The whole bounded workload on the stream. It found four defects of the
/// stream path (a lost claim COMMIT answer wedged a key bucket, a
/// migration's move between hand-out and registration lost the attempt, a
/// moved event overtook its key's earlier stream events, and the lane
/// inherited the chains path's stale chain heads); each has its own test
/// now (tests/tests/dispatch/stream_faults.rs, stream_lane_moves.rs,
/// chain_head_races.rs).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_concurrent_checker_is_green_on_the_stream(pool: PgPool) {
    run_on(&pool, DispatchPath::Stream, "stream").await;
}

/// The same workload on the chains path (seed 45 left a key's chain head
/// on a purged event before the chain-head races were fixed).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_concurrent_checker_on_the_chains_path(pool: PgPool) {
    run_on(&pool, DispatchPath::Chains, "chains").await;
}

/// The workload from the environment on `path` (named `name`), every
/// round green and every round's faults having happened.
async fn run_on(pool: &PgPool, path: DispatchPath, name: &str) {
    outbox_producer::set_dispatch_path(pool, path)
        .await
        .unwrap();
    let cfg = CheckerConfig::from_env();
    let violations = rounds(pool, &cfg, name, assert_the_faults_happened).await;
    assert!(
        violations.is_empty(),
        "{} violations on the {name} path:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

/// The checker can fail: a small calm run whose checks are also handed an
/// event id the client "committed" that never reached the outbox or the
/// log is red with a `lost:` entry for exactly that id (and nothing else).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_checker_sees_a_lost_event(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream)
        .await
        .unwrap();
    let never_emitted = EventId::generate(1).to_string();
    let cfg = CheckerConfig {
        events: 60,
        emit_for: std::time::Duration::from_secs(1),
        faults: false,
        migrations: false,
        retention: false,
        extra_committed: vec![never_emitted.clone()],
        ..CheckerConfig::bounded()
    };
    let verdict = run_checker(&pool, &cfg).await;
    report("stream", &cfg, &verdict);
    assert!(verdict.figures.committed > 20, "{:#?}", verdict.figures);
    assert_eq!(
        verdict.violations,
        vec![format!(
            "lost: {never_emitted} committed and not in the outbox"
        )]
    );
}
