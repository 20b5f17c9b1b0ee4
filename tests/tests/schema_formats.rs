//! The format checks the schema runs on every insert (event and attempt
//! ids, digests, traceparent) are written as a length test plus a pattern
//! with `*`, because PostgreSQL matches counted repetitions (`{64}`) several
//! times slower. These tests read the conditions actually installed by the
//! migrations and evaluate them, in PostgreSQL, against the counted
//! patterns on valid values and on thousands of near misses.

use outbox_core::{sha256_digest, AttemptId, EventId};
use sqlx::PgPool;

const EVENT_ID: &str = "^evt-[0-7][0-9A-HJKMNP-TV-Z]{25}$";
const ATTEMPT_ID: &str = "^att-[0-7][0-9A-HJKMNP-TV-Z]{25}$";
const DIGEST: &str = "^sha256:[0-9a-f]{64}$";
const TRACEPARENT: &str = "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$";

/// Characters a mutation puts in: the edges of each class, letters the
/// Crockford alphabet leaves out, case, separators, whitespace and
/// multi-byte characters (which a byte count and a character count see
/// differently).
const ODD: &[&str] = &["0", "7", "8", "9", "A", "H", "I", "J", "L", "O", "U", "V", "Z", "a", "f", "g", "z", "-", ":", "_", " ", "\n", "é", "€", "ß"];

/// `valid`, and values one edit away from it: each character replaced by
/// each of [`ODD`], each prefix, each character doubled, each neighbour
/// pair swapped (a separator moved by one), [`ODD`] prepended and appended,
/// and the value doubled.
fn near_misses(valid: &str) -> Vec<String> {
    let chars: Vec<char> = valid.chars().collect();
    let mut out = vec![valid.to_owned(), format!("{valid}{valid}"), String::new()];
    for i in 0..chars.len() {
        for odd in ODD {
            let mut s: String = chars[..i].iter().collect();
            s.push_str(odd);
            s.extend(&chars[i + 1..]);
            out.push(s);
        }
        out.push(chars[..i].iter().collect());
        let mut doubled: String = chars[..=i].iter().collect();
        doubled.extend(&chars[i..]);
        out.push(doubled);
        if i + 1 < chars.len() {
            let mut swapped = chars.clone();
            swapped.swap(i, i + 1);
            out.push(swapped.into_iter().collect());
        }
    }
    for odd in ODD {
        out.push(format!("{odd}{valid}"));
        out.push(format!("{valid}{odd}"));
    }
    out
}

fn traceparent(n: u64) -> String {
    let h = sha256_digest(n.to_string().as_bytes());
    let hex = &h["sha256:".len()..];
    format!("00-{}-{}-01", &hex[..32], &hex[32..48])
}

/// The text between `WHEN (` and `) EXECUTE` of the trigger's definition.
async fn when_clause(pool: &PgPool, trigger: &str) -> String {
    let def: String = sqlx::query_scalar("SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = $1")
        .bind(trigger)
        .fetch_one(pool)
        .await
        .unwrap();
    let start = def.find(" WHEN ").unwrap_or_else(|| panic!("no WHEN in {def}")) + " WHEN ".len();
    let end = def.rfind(" EXECUTE FUNCTION").unwrap_or_else(|| panic!("no EXECUTE in {def}"));
    def[start..end].to_owned()
}

/// The expression of a CHECK constraint, without `CHECK` and `NOT VALID`.
async fn check_expression(pool: &PgPool, table: &str, constraint: &str) -> String {
    let def: String = sqlx::query_scalar("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = $1::regclass AND conname = $2")
        .bind(table)
        .bind(constraint)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("constraint {constraint} of {table}: {e}"));
    def.trim_start_matches("CHECK ").trim_end_matches(" NOT VALID").to_owned()
}

/// For each value, whether `condition` (over `new.<column>`, or `<column>`
/// for a CHECK) and the counted `pattern` disagree; the other columns hold
/// `others`. Returns the values on which they disagree, and how many of the
/// values the pattern admits (so a test can see both kinds were tried).
async fn disagreements(pool: &PgPool, condition: &str, fires_on_offence: bool, column: &str, values: &[String], others: &[(&str, &str)], pattern: &str) -> (Vec<String>, usize) {
    let mut columns = vec![column.to_owned()];
    let mut selects = vec!["v.value".to_owned()];
    for (name, value) in others {
        columns.push((*name).to_owned());
        selects.push(format!("'{value}'::text"));
    }
    // The condition reads the row as `new` (a trigger's WHEN) or by bare
    // column names (a CHECK): a derived table named `new` serves both.
    let verdict = if fires_on_offence { format!("({condition})") } else { format!("NOT coalesce({condition}, true)") };
    let sql = format!(
        "SELECT new.{column}, {verdict} AS offends, NOT coalesce(new.{column} ~ $2, false) AS reference
         FROM (SELECT {} FROM unnest($1::text[]) AS v(value)) AS new({})",
        selects.join(", "),
        columns.join(", ")
    );
    let rows: Vec<(String, bool, bool)> = sqlx::query_as(&sql).bind(values).bind(pattern).fetch_all(pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    assert_eq!(rows.len(), values.len());
    let admitted = rows.iter().filter(|r| !r.2).count();
    (rows.into_iter().filter(|(_, offends, reference)| offends != reference).map(|r| r.0).collect(), admitted)
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn insert_format_checks_admit_exactly_what_the_counted_patterns_admit(pool: PgPool) {
    outbox_consumer::migrate(&pool).await.unwrap();
    let when = when_clause(&pool, "outbox_events_formats_insert").await;
    assert!(!when.contains('{'), "the installed condition still counts repetitions: {when}");

    let event_ids: Vec<String> = (0..4u64).map(|n| EventId::generate(1_700_000_000_000 + n * 977_000_000_000).to_string()).collect();
    let attempt_ids: Vec<String> = (0..4u64).map(|n| AttemptId::generate(1_700_000_000_000 + n * 977_000_000_000).to_string()).collect();
    let digests: Vec<String> = (0..4u64).map(|n| sha256_digest(&n.to_be_bytes())).collect();
    let traceparents: Vec<String> = (0..4u64).map(traceparent).collect();
    let (e, d, t) = (event_ids[0].as_str(), digests[0].as_str(), traceparents[0].as_str());

    // (column, valid values, the other columns' values, counted pattern)
    type Case<'a> = (&'a str, &'a Vec<String>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: [Case; 4] = [
        ("event_id", &event_ids, vec![("payload_digest", d), ("destination_digest", d), ("traceparent", t)], EVENT_ID),
        ("payload_digest", &digests, vec![("event_id", e), ("destination_digest", d), ("traceparent", t)], DIGEST),
        ("destination_digest", &digests, vec![("event_id", e), ("payload_digest", d), ("traceparent", t)], DIGEST),
        ("traceparent", &traceparents, vec![("event_id", e), ("payload_digest", d), ("destination_digest", d)], TRACEPARENT),
    ];
    for (column, valid, others, pattern) in cases {
        let values: Vec<String> = valid.iter().flat_map(|v| near_misses(v)).collect();
        let (wrong, admitted) = disagreements(&pool, &when, true, column, &values, &others, pattern).await;
        assert!(wrong.is_empty(), "{column}: the trigger and {pattern} disagree on {wrong:?}");
        // Every valid value, plus the replacements by a character of the class.
        assert!(admitted >= valid.len() && admitted < values.len() / 2, "{column}: {admitted} of {} admitted", values.len());
    }
    // A missing traceparent is allowed; a missing digest is not the
    // trigger's business (NOT NULL is).
    let null_tp: bool = sqlx::query_scalar(&format!(
        "SELECT ({when}) FROM (SELECT '{e}'::text, '{d}'::text, '{d}'::text, NULL::text) AS new(event_id, payload_digest, destination_digest, traceparent)"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!null_tp, "a row without traceparent offends");

    for (table, constraint, column, valid, pattern) in [
        ("outbox_attempts", "outbox_attempts_attempt_id_format", "attempt_id", &attempt_ids, ATTEMPT_ID),
        ("outbox_consumer_receipts", "outbox_consumer_receipts_event_id_format", "event_id", &event_ids, EVENT_ID),
    ] {
        let check = check_expression(&pool, table, constraint).await;
        assert!(!check.contains('{'), "{table}: the installed CHECK still counts repetitions: {check}");
        let values: Vec<String> = valid.iter().flat_map(|v| near_misses(v)).collect();
        let (wrong, admitted) = disagreements(&pool, &check, false, column, &values, &[], pattern).await;
        assert!(wrong.is_empty(), "{table}.{column}: the CHECK and {pattern} disagree on {wrong:?}");
        assert!(admitted >= valid.len() && admitted < values.len() / 2, "{table}: {admitted} of {} admitted", values.len());
    }
}

/// The replaced constraints still refuse a malformed value written by hand
/// (the trigger's refusal of malformed event rows is checked in
/// `emit.rs::constraints_hold_against_a_buggy_caller`).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn malformed_attempt_and_receipt_ids_are_refused(pool: PgPool) {
    outbox_consumer::migrate(&pool).await.unwrap();
    let att = AttemptId::generate(1_700_000_000_000).to_string();
    // One character too many for the id's 25: a Crockford letter at the end.
    let long = format!("{}A", &att);
    let err = sqlx::query(
        "INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms)
         VALUES ($1, 'evt-none', 1, 1, 1, 'w', 'SENDING', 'd', 0)",
    )
    .bind(&long)
    .execute(&pool)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("outbox_attempts_attempt_id_format"), "{err}");

    let evt = EventId::generate(1_700_000_000_000).to_string();
    for bad in [evt.to_lowercase(), evt.replacen("evt-0", "evt-8", 1), format!("{}é", &evt[..28])] {
        let err = sqlx::query(
            "INSERT INTO outbox_consumer_receipts (consumer_id, event_id, envelope_generation, event_type, topic, partition, \"offset\", payload_digest)
             VALUES ('c', $1, 1, 't', 'orders', 0, 0, 'd')",
        )
        .bind(&bad)
        .execute(&pool)
        .await
        .unwrap_err();
        assert!(err.to_string().contains("outbox_consumer_receipts_event_id_format"), "{bad}: {err}");
    }
}
