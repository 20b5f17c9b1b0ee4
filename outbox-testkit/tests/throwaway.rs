//! A throwaway PostgreSQL server starts from the local binaries (as the
//! `postgres` user when run as root), answers, and is gone after drop.

use std::net::TcpStream;
use std::time::Duration;

use outbox_testkit::{pick_database_with, DatabaseSource, PickOptions, TestDatabase, ThrowawayPostgres};
use sqlx::{Connection, PgConnection};

#[tokio::test]
async fn throwaway_server_starts_answers_and_is_removed_at_drop() {
    let started = std::time::Instant::now();
    let server = tokio::task::spawn_blocking(ThrowawayPostgres::start).await.unwrap().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("throwaway PostgreSQL on port {} from {} in {:?}", server.port(), server.bindir().display(), started.elapsed());
    let dir = server.dir().to_path_buf();
    let port = server.port();
    assert!(dir.join("data").join("PG_VERSION").is_file(), "data directory initialised");
    assert!(server.url().starts_with("postgres://postgres@127.0.0.1:"));

    let mut conn = PgConnection::connect(&server.url()).await.expect("connect to the throwaway server");
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await.unwrap();
    assert_eq!(one, 1);
    let user: String = sqlx::query_scalar("SELECT current_user").fetch_one(&mut conn).await.unwrap();
    assert_eq!(user, "postgres");
    conn.close().await.unwrap();

    drop(server);
    assert!(!dir.exists(), "{} removed at drop", dir.display());
    assert!(TcpStream::connect_timeout(&format!("127.0.0.1:{port}").parse().unwrap(), Duration::from_millis(500)).is_err(), "server stopped at drop");
}

#[tokio::test]
async fn forced_pick_gives_a_throwaway_server_and_test_databases_work_on_it() {
    let picked = pick_database_with(PickOptions { force_throwaway: true, ..PickOptions::default() }).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(picked.source(), DatabaseSource::Throwaway);
    assert!(picked.describe().contains("throwaway"), "{}", picked.describe());
    let dir = picked.throwaway().unwrap().dir().to_path_buf();

    let db = TestDatabase::create(picked.url(), "testkit_pick", 2).await.unwrap();
    outbox_producer::migrate(&db.pool).await.expect("producer migrations on the throwaway server");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events").fetch_one(&db.pool).await.unwrap();
    assert_eq!(n, 0);
    let name = db.name.clone();
    db.drop_now().await.unwrap();
    let mut conn = PgConnection::connect(picked.url()).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1").bind(&name).fetch_one(&mut conn).await.unwrap();
    assert_eq!(left, 0, "test database dropped");
    conn.close().await.unwrap();

    drop(picked);
    assert!(!dir.exists());
}
