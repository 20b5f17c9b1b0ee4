//! A TCP proxy in front of PostgreSQL that loses the answers to COMMITs:
//! the COMMIT reaches the server, and the connection is closed before the
//! server's answer reaches the client. The transaction is committed; the
//! client sees a broken connection, as after a network cut or a failover
//! at the worst moment. Used by the database-fault tests (one armed cut)
//! and the concurrent checker (a share of every COMMIT).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgPoolOptions, PgSslMode};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// Which COMMITs lose their answer.
#[derive(Debug, Clone, Default)]
enum Rule {
    /// None.
    #[default]
    Off,
    /// This many per thousand, drawn from the proxy's seed.
    PerMille(u32),
    /// The next COMMIT of a session after a statement containing the
    /// fragment, once (then the rule is off again).
    After(String),
}

/// What every session of one proxy shares.
#[derive(Debug, Default)]
struct Shared {
    rule: Mutex<Rule>,
    cuts: AtomicU64,
    seen: AtomicU64,
    draws: AtomicU64,
}

/// The proxy (see the module docs); it stops accepting when dropped.
pub struct CommitCutter {
    addr: std::net::SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl CommitCutter {
    /// A proxy to the PostgreSQL server at `server` (`host:port`), its
    /// draws seeded with `seed`; no COMMIT loses its answer until a rule is set.
    pub async fn start(server: &str, seed: u64) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared { draws: AtomicU64::new(seed), ..Shared::default() });
        let (s, server) = (shared.clone(), server.to_owned());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(server.as_str()).await else { continue };
                tokio::spawn(session(client, upstream, s.clone()));
            }
        });
        Ok(CommitCutter { addr, shared, accept })
    }

    /// [`CommitCutter::start`] in front of `pool`'s server.
    pub async fn in_front_of(pool: &PgPool, seed: u64) -> std::io::Result<Self> {
        let options = pool.connect_options();
        Self::start(&format!("{}:{}", options.get_host(), options.get_port()), seed).await
    }

    /// From now on, `n` COMMITs per thousand lose their answer (0: none).
    pub fn set_per_mille(&self, n: u32) {
        *self.shared.rule.lock().unwrap() = if n == 0 { Rule::Off } else { Rule::PerMille(n) };
    }

    /// The next COMMIT of a session after a statement containing
    /// `fragment` loses its answer, once.
    pub fn arm_after(&self, fragment: &str) {
        *self.shared.rule.lock().unwrap() = Rule::After(fragment.to_owned());
    }

    /// COMMIT answers lost so far.
    pub fn cuts(&self) -> u64 {
        self.shared.cuts.load(Ordering::SeqCst)
    }

    /// COMMITs that went through the proxy so far.
    pub fn commits_seen(&self) -> u64 {
        self.shared.seen.load(Ordering::SeqCst)
    }

    /// A pool of at most `max` sessions on `pool`'s database through this
    /// proxy, named `app` (`application_name`).
    pub async fn pool(&self, pool: &PgPool, max: u32, app: &str) -> Result<PgPool, sqlx::Error> {
        let options = (*pool.connect_options()).clone().host(&self.addr.ip().to_string()).port(self.addr.port()).ssl_mode(PgSslMode::Disable).application_name(app);
        PgPoolOptions::new().max_connections(max).acquire_timeout(Duration::from_secs(20)).connect_with(options).await
    }
}

impl Drop for CommitCutter {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Whether this COMMIT (of a session that did or did not send the armed
/// fragment since its last COMMIT) loses its answer; an `After` rule is
/// spent by its cut.
fn cut_this_commit(shared: &Shared, fragment_seen: bool) -> bool {
    let mut rule = shared.rule.lock().unwrap();
    let cut = match &*rule {
        Rule::Off => false,
        Rule::PerMille(n) => crate::concurrent::mix(shared.draws.fetch_add(1, Ordering::SeqCst)) % 1_000 < u64::from(*n),
        Rule::After(_) => fragment_seen,
    };
    if cut && matches!(*rule, Rule::After(_)) {
        *rule = Rule::Off;
    }
    cut
}

/// Forwards one session, cutting the answer of a COMMIT the rule picks.
async fn session(client: tokio::net::TcpStream, server: tokio::net::TcpStream, shared: Arc<Shared>) -> std::io::Result<()> {
    // Each message is written whole, and at once (no Nagle delay).
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (cr, mut cw) = client.into_split();
    let mut cr = tokio::io::BufReader::new(cr);
    let (mut sr, mut sw) = server.into_split();
    let cut = Arc::new(AtomicBool::new(false));
    let down = {
        let cut = cut.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = sr.read(&mut buf).await?;
                if n == 0 || cut.load(Ordering::SeqCst) {
                    // The server's answer to the cut COMMIT is dropped.
                    return cw.shutdown().await;
                }
                cw.write_all(&buf[..n]).await?;
            }
        })
    };
    // Untyped start-up messages (SSL or GSS encryption requests, then the
    // startup message), then typed messages: a type byte, a length, a body.
    loop {
        let len = cr.read_u32().await?;
        let mut body = vec![0u8; (len as usize).saturating_sub(4)];
        cr.read_exact(&mut body).await?;
        let mut message = len.to_be_bytes().to_vec();
        message.extend_from_slice(&body);
        sw.write_all(&message).await?;
        let code = body.get(..4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        if !(len == 8 && matches!(code, Some(80877103 | 80877104))) {
            break;
        }
    }
    let mut fragment_seen = false;
    loop {
        let kind = cr.read_u8().await?;
        let len = cr.read_u32().await?;
        let mut body = vec![0u8; (len as usize).saturating_sub(4)];
        cr.read_exact(&mut body).await?;
        if let Rule::After(fragment) = &*shared.rule.lock().unwrap() {
            fragment_seen |= String::from_utf8_lossy(&body).contains(fragment.as_str());
        }
        if kind == b'Q' && body.starts_with(b"COMMIT") {
            shared.seen.fetch_add(1, Ordering::SeqCst);
            if cut_this_commit(&shared, fragment_seen) {
                cut.store(true, Ordering::SeqCst);
                shared.cuts.fetch_add(1, Ordering::SeqCst);
            }
            fragment_seen = false;
        }
        let mut message = Vec::with_capacity(body.len() + 5);
        message.push(kind);
        message.extend_from_slice(&len.to_be_bytes());
        message.extend_from_slice(&body);
        sw.write_all(&message).await?;
        if cut.load(Ordering::SeqCst) {
            break;
        }
    }
    let _ = down.await;
    Ok(())
}
