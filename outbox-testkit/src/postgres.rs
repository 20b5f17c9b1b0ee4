//! PostgreSQL for tests: a throwaway server, the choice of server, and a
//! fresh database per test.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::TestkitError;

/// The local server [`pick_database`] tries when `DATABASE_URL` is not set.
pub const DEFAULT_LOCAL_URL: &str = "postgres://root@127.0.0.1:5432/test";

/// Set to `1` (or `true`) to make [`pick_database`] always start a throwaway server.
pub const FORCE_THROWAWAY_ENV: &str = "OUTBOX_THROWAWAY_POSTGRES";

/// Overrides where the PostgreSQL server binaries (`initdb`, `pg_ctl`) are.
pub const BINDIR_ENV: &str = "OUTBOX_POSTGRES_BINDIR";

const INSTALL_HINT: &str = "no PostgreSQL server binaries found (initdb, pg_ctl in /usr/lib/postgresql/<version>/bin or on PATH): install them with `apt-get install postgresql`, or set DATABASE_URL to a running server";

static COUNTER: AtomicU64 = AtomicU64::new(0);

pub(crate) fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{}_{}_{:x}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed), nanos)
}

/// The directory holding `initdb` and `pg_ctl`: `OUTBOX_POSTGRES_BINDIR`,
/// else the newest `/usr/lib/postgresql/<version>/bin` (Debian, Ubuntu),
/// else the directory of `initdb` on `PATH`. The error says what to install.
pub fn find_postgres_bindir() -> Result<PathBuf, TestkitError> {
    if let Ok(d) = std::env::var(BINDIR_ENV) {
        let d = PathBuf::from(d);
        return if usable(&d) { Ok(d) } else { Err(TestkitError::new(format!("{BINDIR_ENV}={} has no initdb and pg_ctl", d.display()))) };
    }
    find_bindir_in(Path::new("/usr/lib/postgresql"), std::env::var_os("PATH"))
}

fn usable(d: &Path) -> bool {
    d.join("initdb").is_file() && d.join("pg_ctl").is_file()
}

fn find_bindir_in(lib_root: &Path, path: Option<std::ffi::OsString>) -> Result<PathBuf, TestkitError> {
    let mut versions: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(lib_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let key: Vec<u32> = name.split('.').map(|p| p.parse().ok()).collect::<Option<_>>()?;
            let bin = e.path().join("bin");
            usable(&bin).then_some((key, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    if let Some(path) = path {
        for d in std::env::split_paths(&path) {
            if usable(&d) {
                return Ok(d);
            }
        }
    }
    Err(TestkitError::new(INSTALL_HINT))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// uid and gid of the `postgres` system user.
fn postgres_user() -> Result<(u32, u32), TestkitError> {
    let name = std::ffi::CString::new("postgres").expect("static name");
    // SAFETY: getpwnam returns NULL or a pointer to a static record we only read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(TestkitError::new(
            "running as root, but there is no `postgres` system user to run the throwaway server as (PostgreSQL refuses to run as root): install `postgresql` or run as another user",
        ));
    }
    // SAFETY: pw is non-null and points to a valid passwd record.
    unsafe { Ok(((*pw).pw_uid, (*pw).pw_gid)) }
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), TestkitError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|e| TestkitError::new(format!("chown {} to postgres: {e}", path.display())))
}

/// A command running `program` as the `postgres` user when we are root.
fn command_as_server_user(program: &Path, as_postgres: bool) -> Command {
    if as_postgres {
        if Path::new("/usr/sbin/runuser").exists() || Path::new("/sbin/runuser").exists() {
            let mut c = Command::new("runuser");
            c.arg("-u").arg("postgres").arg("--").arg(program);
            return c;
        }
        // `su` without runuser: every argument is passed through "$@" unquoted-safe.
        let mut c = Command::new("su");
        c.arg("postgres").arg("-s").arg("/bin/sh").arg("-c").arg("exec \"$0\" \"$@\"").arg(program);
        return c;
    }
    Command::new(program)
}

fn run(mut cmd: Command, what: &str) -> Result<(), TestkitError> {
    let out = cmd.stdin(std::process::Stdio::null()).output().map_err(|e| TestkitError::new(format!("{what}: cannot run: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let last = text.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("").to_owned();
    Err(TestkitError::new(format!("{what} failed ({}): {last}", out.status)))
}

fn free_port() -> Result<u16, TestkitError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| TestkitError::new(format!("no free 127.0.0.1 port: {e}")))?;
    Ok(l.local_addr().map_err(|e| TestkitError::new(e.to_string()))?.port())
}

/// A PostgreSQL server of its own, from the locally installed binaries, in
/// a temporary directory, listening on a free 127.0.0.1 port with trust
/// authentication (superuser `postgres`). Dropping it stops the server
/// (immediate shutdown) and removes the directory.
///
/// Run as root (as CI does), the directory is given to the `postgres`
/// system user and `initdb` / `pg_ctl` run as that user (`runuser`, or `su`).
///
/// Starting takes one to a few seconds (`initdb` with `--no-sync`, then the
/// server with `fsync=off`: for tests only). [`ThrowawayPostgres::start`]
/// blocks; from async code call it through `tokio::task::spawn_blocking`
/// (as [`pick_database`] does).
#[derive(Debug)]
pub struct ThrowawayPostgres {
    dir: PathBuf,
    bindir: PathBuf,
    port: u16,
    as_postgres: bool,
    stopped: bool,
}

impl ThrowawayPostgres {
    /// Creates the cluster and starts the server.
    pub fn start() -> Result<Self, TestkitError> {
        let bindir = find_postgres_bindir()?;
        let as_postgres = is_root();
        let owner = if as_postgres { Some(postgres_user()?) } else { None };
        let dir = std::env::temp_dir().join(format!("outbox-pg-{}", unique_suffix()));
        std::fs::create_dir(&dir).map_err(|e| TestkitError::new(format!("creating {}: {e}", dir.display())))?;
        // Owned by us from here: dropping removes the directory even on failure.
        let mut server = ThrowawayPostgres { dir, bindir, port: 0, as_postgres, stopped: true };
        if let Some((uid, gid)) = owner {
            chown(&server.dir, uid, gid)?;
        }
        let mut initdb = command_as_server_user(&server.bindir.join("initdb"), as_postgres);
        initdb.arg("-D").arg(server.data_dir()).args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]);
        run(initdb, "initdb")?;
        let mut last_error = None;
        // A free port can be taken between the probe and the bind: try a few.
        for _ in 0..3 {
            server.port = free_port()?;
            let opts = format!(
                "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200",
                server.port,
                server.dir.display()
            );
            let mut start = command_as_server_user(&server.bindir.join("pg_ctl"), as_postgres);
            start.arg("-D").arg(server.data_dir()).arg("-l").arg(server.log_path()).args(["-w", "-t", "60", "-o", &opts, "start"]);
            match run(start, "pg_ctl start") {
                Ok(()) => {
                    server.stopped = false;
                    return Ok(server);
                }
                Err(e) => last_error = Some(e),
            }
        }
        let log = std::fs::read_to_string(server.log_path()).unwrap_or_default();
        let tail = log.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        Err(TestkitError::new(format!("{} (server log: {tail})", last_error.expect("three tries"))))
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temporary directory (data directory, socket, log); removed at drop.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The PostgreSQL binaries used.
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// Stops the server and removes its directory now (also done at drop).
    pub fn stop(mut self) -> Result<(), TestkitError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), TestkitError> {
        let mut result = Ok(());
        if !self.stopped {
            let mut stop = command_as_server_user(&self.bindir.join("pg_ctl"), self.as_postgres);
            stop.arg("-D").arg(self.data_dir()).args(["-m", "immediate", "-w", "-t", "30", "stop"]);
            result = run(stop, "pg_ctl stop");
            self.stopped = true;
        }
        if self.dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                result = result.and(Err(TestkitError::new(format!("removing {}: {e}", self.dir.display()))));
            }
        }
        result
    }
}

impl Drop for ThrowawayPostgres {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("outbox-testkit: {e}");
        }
    }
}

/// Where [`pick_database`] found its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseSource {
    /// `DATABASE_URL`.
    Env,
    /// The local server at [`PickOptions::local_url`].
    Local,
    /// A [`ThrowawayPostgres`] started for this run.
    Throwaway,
}

/// How [`pick_database_with`] chooses.
#[derive(Debug, Clone)]
pub struct PickOptions {
    /// Always start a throwaway server, even when `DATABASE_URL` is set.
    pub force_throwaway: bool,
    /// The local server tried when `DATABASE_URL` is not set.
    pub local_url: String,
    /// How long the local server has to answer.
    pub probe_timeout: Duration,
}

impl Default for PickOptions {
    /// Not forced (unless `OUTBOX_THROWAWAY_POSTGRES=1`), [`DEFAULT_LOCAL_URL`], 1 s.
    fn default() -> Self {
        let forced = std::env::var(FORCE_THROWAWAY_ENV).map(|v| matches!(v.trim(), "1" | "true" | "yes")).unwrap_or(false);
        PickOptions { force_throwaway: forced, local_url: DEFAULT_LOCAL_URL.to_owned(), probe_timeout: Duration::from_secs(1) }
    }
}

/// A PostgreSQL server to run against; keeps a throwaway server alive as
/// long as it lives.
#[derive(Debug)]
pub struct PickedDatabase {
    url: String,
    source: DatabaseSource,
    server: Option<ThrowawayPostgres>,
}

impl PickedDatabase {
    /// The server's URL (its default database).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Where it came from.
    pub fn source(&self) -> DatabaseSource {
        self.source
    }

    /// The throwaway server, if one was started.
    pub fn throwaway(&self) -> Option<&ThrowawayPostgres> {
        self.server.as_ref()
    }

    /// One line for humans, without credentials.
    pub fn describe(&self) -> String {
        let host = redact(&self.url);
        match self.source {
            DatabaseSource::Env => format!("PostgreSQL from DATABASE_URL ({host})"),
            DatabaseSource::Local => format!("local PostgreSQL ({host})"),
            DatabaseSource::Throwaway => {
                let bin = self.server.as_ref().map(|s| s.bindir().display().to_string()).unwrap_or_default();
                format!("throwaway PostgreSQL ({host}, from {bin}; removed at exit)")
            }
        }
    }
}

/// The URL with any password replaced.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// [`pick_database_with`] with [`PickOptions::default`].
pub async fn pick_database() -> Result<PickedDatabase, TestkitError> {
    pick_database_with(PickOptions::default()).await
}

/// `DATABASE_URL` if set (and not forced to a throwaway server); else the
/// local server if it accepts a connection within `probe_timeout`; else a
/// [`ThrowawayPostgres`].
pub async fn pick_database_with(options: PickOptions) -> Result<PickedDatabase, TestkitError> {
    if !options.force_throwaway {
        if let Ok(url) = std::env::var("DATABASE_URL") {
            if !url.trim().is_empty() {
                return Ok(PickedDatabase { url, source: DatabaseSource::Env, server: None });
            }
        }
        if answers(&options.local_url, options.probe_timeout).await {
            return Ok(PickedDatabase { url: options.local_url, source: DatabaseSource::Local, server: None });
        }
    }
    let server = tokio::task::spawn_blocking(ThrowawayPostgres::start).await.map_err(|e| TestkitError::new(format!("starting PostgreSQL: {e}")))??;
    Ok(PickedDatabase { url: server.url(), source: DatabaseSource::Throwaway, server: Some(server) })
}

async fn answers(url: &str, timeout: Duration) -> bool {
    let Ok(opts) = url.parse::<PgConnectOptions>() else { return false };
    // A quick TCP probe first: a closed port fails at once.
    let addr = format!("{}:{}", opts.get_host(), opts.get_port());
    let reachable = tokio::task::spawn_blocking(move || {
        use std::net::ToSocketAddrs;
        addr.to_socket_addrs().ok().and_then(|mut a| a.next()).map(|a: SocketAddr| TcpStream::connect_timeout(&a, timeout).is_ok()).unwrap_or(false)
    })
    .await
    .unwrap_or(false);
    if !reachable {
        return false;
    }
    match tokio::time::timeout(timeout, opts.disable_statement_logging().connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            true
        }
        _ => false,
    }
}

/// A fresh database for one test on a given server, dropped by
/// [`TestDatabase::drop_now`] (or, as a fallback, at drop, from a helper
/// thread).
#[derive(Debug)]
pub struct TestDatabase {
    admin: PgConnectOptions,
    /// The database's name.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// A pool on it.
    pub pool: PgPool,
    dropped: bool,
}

impl TestDatabase {
    /// Creates `<prefix>_<pid>_<n>_<nanos>` on the server of `server_url`
    /// (a URL whose database is any existing one, e.g. `postgres` or `test`).
    pub async fn create(server_url: &str, prefix: &str, max_connections: u32) -> Result<Self, TestkitError> {
        let admin: PgConnectOptions = server_url.parse().map_err(|e| TestkitError::new(format!("{} is not a PostgreSQL URL: {e}", redact(server_url))))?;
        let admin = admin.disable_statement_logging();
        let prefix: String = prefix.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
        let name = format!("{prefix}_{}", unique_suffix());
        let mut conn = admin.connect().await.map_err(|e| TestkitError::new(format!("cannot connect to PostgreSQL at {}: {e}", redact(server_url))))?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.map_err(|e| TestkitError::new(format!("CREATE DATABASE {name}: {e}")))?;
        let _ = conn.close().await;
        let opts = admin.clone().database(&name);
        let pool = PgPoolOptions::new().max_connections(max_connections).connect_with(opts).await.map_err(|e| TestkitError::new(format!("connecting to {name}: {e}")))?;
        let url = with_database(server_url, &name);
        Ok(TestDatabase { admin, name, url, pool, dropped: false })
    }

    /// Closes the pool and drops the database.
    pub async fn drop_now(mut self) -> Result<(), TestkitError> {
        self.dropped = true;
        self.pool.close().await;
        drop_database(&self.admin, &self.name).await
    }
}

async fn drop_database(admin: &PgConnectOptions, name: &str) -> Result<(), TestkitError> {
    let mut conn = admin.connect().await.map_err(|e| TestkitError::new(e.to_string()))?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut conn).await.map_err(|e| TestkitError::new(e.to_string()))?;
    Ok(())
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        // A test that panicked before drop_now: drop the database from a thread of its own.
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                let _ = rt.block_on(drop_database(&admin, &name));
            }
        })
        .join();
    }
}

/// `url` with its database replaced by `name` (query string kept).
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.find('?') {
        Some(q) => (&url[..q], &url[q..]),
        None => (url, ""),
    };
    let after_scheme = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_end = base[after_scheme..].find('/').map(|i| after_scheme + i).unwrap_or(base.len());
    format!("{}/{name}{query}", &base[..host_end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(with_database("postgres://root@127.0.0.1:5432/test", "x"), "postgres://root@127.0.0.1:5432/x");
        assert_eq!(with_database("postgres://u:p@h:1/db?sslmode=disable", "x"), "postgres://u:p@h:1/x?sslmode=disable");
        assert_eq!(with_database("postgres://h:1", "x"), "postgres://h:1/x");
        assert_eq!(redact("postgres://u:secret@h:1/db"), "postgres://u:***@h:1/db");
        assert_eq!(redact("postgres://u@h:1/db"), "postgres://u@h:1/db");
    }

    #[test]
    fn missing_binaries_name_what_to_install() {
        let empty = std::env::temp_dir().join(format!("outbox-no-pg-{}", unique_suffix()));
        std::fs::create_dir(&empty).unwrap();
        let err = find_bindir_in(&empty, Some(empty.clone().into_os_string())).unwrap_err().to_string();
        std::fs::remove_dir(&empty).unwrap();
        assert!(err.contains("apt-get install postgresql"), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }

    #[test]
    fn newest_version_wins() {
        let root = std::env::temp_dir().join(format!("outbox-pg-versions-{}", unique_suffix()));
        for v in ["9.6", "15", "13"] {
            let bin = root.join(v).join("bin");
            std::fs::create_dir_all(&bin).unwrap();
            std::fs::write(bin.join("initdb"), "").unwrap();
            std::fs::write(bin.join("pg_ctl"), "").unwrap();
        }
        let found = find_bindir_in(&root, None).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert!(found.ends_with("15/bin"), "{}", found.display());
    }
}
