//! A PostgreSQL server of the drill's own (initdb into a temporary
//! directory, `pg_ctl` on a free port), so that it can be restarted with
//! `pg_ctl restart -m immediate` without touching any other server.
//!
//! `fsync=off` (the machine does not crash, only the server), but
//! `synchronous_commit` stays on: an immediate shutdown must not lose a
//! transaction the server reported committed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The server; [`PgServer::stop`] (or drop) stops it and removes its directory.
#[derive(Debug)]
pub struct PgServer {
    dir: PathBuf,
    bindir: PathBuf,
    port: u16,
    as_postgres: bool,
    running: bool,
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn postgres_ids() -> Result<(u32, u32)> {
    let name = std::ffi::CString::new("postgres").expect("static");
    // SAFETY: getpwnam returns NULL or a pointer to a static record read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        bail!("running as root, but there is no `postgres` user to run PostgreSQL as (scripts/setup.d/20-postgresql.sh installs it)");
    }
    // SAFETY: pw is non-null.
    unsafe { Ok(((*pw).pw_uid, (*pw).pw_gid)) }
}

/// A free 127.0.0.1 port (probed; may be taken before it is bound).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl PgServer {
    /// `initdb` into `dir` (created, owned by `postgres` when run as root)
    /// and starts the server.
    pub fn start(dir: &Path) -> Result<PgServer> {
        let bindir = outbox_testkit::find_postgres_bindir().map_err(|e| anyhow::anyhow!("{e}"))?;
        let as_postgres = is_root();
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut s = PgServer { dir: dir.to_owned(), bindir, port: 0, as_postgres, running: false };
        if as_postgres {
            let (uid, gid) = postgres_ids()?;
            std::os::unix::fs::chown(dir, Some(uid), Some(gid)).with_context(|| format!("chown {}", dir.display()))?;
        }
        let mut initdb = s.cmd("initdb");
        initdb.arg("-D").arg(s.data()).args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]);
        run(initdb, "initdb")?;
        let mut last = None;
        for _ in 0..3 {
            s.port = free_port()?;
            let mut start = s.cmd("pg_ctl");
            start.arg("-D").arg(s.data()).arg("-l").arg(s.log()).args(["-w", "-t", "60", "-o", &s.options(), "start"]);
            match run(start, "pg_ctl start") {
                Ok(()) => {
                    s.running = true;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("three tries"))
    }

    fn options(&self) -> String {
        format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c full_page_writes=off -c max_connections=300 -c shared_buffers=256MB",
            self.port,
            self.dir.display()
        )
    }

    fn cmd(&self, program: &str) -> Command {
        let bin = self.bindir.join(program);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.arg("-u").arg("postgres").arg("--").arg(bin);
            c
        } else {
            Command::new(bin)
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The server's log file.
    pub fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// `pg_ctl restart -m immediate`: every backend killed, crash recovery at start.
    pub fn restart_immediate(&mut self) -> Result<()> {
        let mut c = self.cmd("pg_ctl");
        c.arg("-D").arg(self.data()).arg("-l").arg(self.log()).args(["-m", "immediate", "-w", "-t", "60", "-o", &self.options(), "restart"]);
        run(c, "pg_ctl restart -m immediate")
    }

    /// Stops the server (immediate) and removes its directory.
    pub fn stop(&mut self) -> Result<()> {
        let mut r = Ok(());
        if self.running {
            let mut c = self.cmd("pg_ctl");
            c.arg("-D").arg(self.data()).args(["-m", "immediate", "-w", "-t", "30", "stop"]);
            r = run(c, "pg_ctl stop");
            self.running = false;
        }
        if self.dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                r = r.and(Err(anyhow::anyhow!("removing {}: {e}", self.dir.display())));
            }
        }
        r
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("outbox-chaos: {e:#}");
        }
    }
}

fn run(mut c: Command, what: &str) -> Result<()> {
    let out = c.stdin(Stdio::null()).output().with_context(|| format!("{what}: cannot run"))?;
    if out.status.success() {
        return Ok(());
    }
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    bail!("{what} failed ({}): {}", out.status, text.lines().rev().take(3).collect::<Vec<_>>().join(" | "))
}
