//! The drill's broker handling against a real tansu process (installed by
//! `scripts/setup.d/41-tansu.sh`, which `scripts/test` runs).

use outbox_chaos::tansu::{tansu_bin, Tansu};

/// Creating a topic that is already there (a try whose answer was lost, or
/// a client that reconnected to the fresh broker first) is the topic when
/// its partitions are those asked for; one with other partitions (a
/// client's metadata request made the broker create it with its default
/// count) is deleted and created again. The drill failed on a replaced
/// broker first with "Topic with this name already exists", then with
/// "already exists with 4 partitions, not 6".
#[test]
fn creating_a_topic_that_exists_with_other_partitions_replaces_it() {
    let bin = tansu_bin().expect("tansu installed by scripts/setup.d/41-tansu.sh");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let dir = std::env::temp_dir().join(format!("outbox-chaos-tansu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("log dir");
    let mut t = Tansu::start(&bin, port, "outbox-chaos-test", &dir.join("tansu.log")).expect("tansu starts");
    let result = (|| {
        t.create_topic("t.exists", 3)?;
        t.create_topic("t.exists", 3)?;
        anyhow::ensure!(t.partitions_of("t.exists")? == 3);
        t.create_topic("t.exists", 5)?;
        let n = t.partitions_of("t.exists")?;
        anyhow::ensure!(n == 5, "a topic of 3 partitions was taken for one of 5 ({n} now)");
        Ok(())
    })();
    t.kill();
    let _ = std::fs::remove_dir_all(&dir);
    result.expect("create_topic over an existing topic");
}
