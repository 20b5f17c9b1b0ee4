//! The drill's broker handling against a real tansu process (installed by
//! `scripts/setup.d/41-tansu.sh`, which `scripts/test` runs).

use outbox_chaos::tansu::{tansu_bin, Tansu};

/// Creating a topic that is already there (a try whose answer was lost, or
/// a client that reconnected to the fresh broker first) is the topic when
/// its partitions are those asked for, and a clear error otherwise: the
/// drill failed once on a replaced broker with "Topic with this name
/// already exists".
#[test]
fn creating_a_topic_that_exists_checks_its_partitions() {
    let bin = tansu_bin().expect("tansu installed by scripts/setup.d/41-tansu.sh");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let dir = std::env::temp_dir().join(format!("outbox-chaos-tansu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("log dir");
    let mut t = Tansu::start(&bin, port, "outbox-chaos-test", &dir.join("tansu.log")).expect("tansu starts");
    let result = (|| {
        t.create_topic("t.exists", 3)?;
        t.create_topic("t.exists", 3)?;
        match t.create_topic("t.exists", 5) {
            Ok(()) => anyhow::bail!("a topic of 3 partitions was taken for one of 5"),
            Err(e) if e.to_string().contains("already exists with 3 partitions") => Ok(()),
            Err(e) => Err(e),
        }
    })();
    t.kill();
    let _ = std::fs::remove_dir_all(&dir);
    result.expect("create_topic over an existing topic");
}
