//! `outbox-chaos`: the real-stack chaos drill. See `--help` and the crate docs.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use outbox_chaos::check::{self, Replacement};
use outbox_chaos::pg::{free_port, PgServer};
use outbox_chaos::roles::{self, ROLE_ENV};
use outbox_chaos::snapshot;
use outbox_chaos::tansu::{self, Tansu};
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

const USAGE: &str = "\
usage: outbox-chaos [--events N] [--seed S] [--path chains|stream] [--no-broker-replacement] [--keep] [--help]

A real-stack chaos drill. Starts its own PostgreSQL server (a producer and a
consumer database), a tansu broker (OUTBOX_CHAOS_TANSU, else where
scripts/setup.d/41-tansu.sh puts it) or uses OUTBOX_CHAOS_KAFKA_BOOTSTRAP,
then runs 2 emitters, 2 `outbox dispatch`, 1 `outbox reconcile` and 2
consumer processes while it SIGKILLs a random dispatcher or consumer every
1-3 s (and restarts it), restarts PostgreSQL once (immediate), pauses a
dispatcher past its lease once (SIGSTOP/SIGCONT) and replaces the broker by
an empty one once. Then it waits until everything settles and checks the
databases and the broker's log. The last line is `chaos PASS ...` (exit 0)
or `chaos FAIL ...` (exit 1) after the evidence.

  --events N                business transactions (events) to commit [default: 20000]
  --seed S                  seed of the fault schedule [default: from the clock, printed]
  --path chains|stream      the producer database's dispatch path (outbox dispatch-path) [default: chains]
  --no-broker-replacement   do not replace the broker
  --keep                    keep the temporary directory (logs, data) at the end
  --help                    print this and exit";

const TOPIC: &str = "chaos.orders";
const PARTITIONS: i32 = 6;
const WATERMARK_TOPIC: &str = "outbox.watermarks";
const CONSUMER_ID: &str = "chaos-effects";
const CLUSTER_ID: &str = "outbox-chaos-cluster";
const LEASE_MS: u64 = 10_000;
const PAUSE_MS: u64 = LEASE_MS + 4_000;

#[derive(Debug)]
struct Opts {
    events: u64,
    seed: u64,
    broker_replacement: bool,
    keep: bool,
    path: outbox_producer::DispatchPath,
}

fn parse(args: &[String]) -> Result<Option<Opts>, String> {
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) % 1_000_000_007;
    let mut o = Opts { events: 20_000, seed, broker_replacement: true, keep: false, path: outbox_producer::DispatchPath::Chains };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_owned())),
            _ => (a.as_str(), None),
        };
        let mut value = |name: &str| inline.clone().or_else(|| it.next().cloned()).ok_or_else(|| format!("{name} needs a value"));
        match flag {
            "--help" | "-h" => return Ok(None),
            "--events" => o.events = value("--events")?.parse().map_err(|_| "--events takes a positive integer".to_owned())?,
            "--seed" => o.seed = value("--seed")?.parse().map_err(|_| "--seed takes an unsigned integer".to_owned())?,
            "--no-broker-replacement" if inline.is_none() => o.broker_replacement = false,
            "--keep" if inline.is_none() => o.keep = true,
            "--path" => {
                o.path = match value("--path")?.as_str() {
                    "chains" => outbox_producer::DispatchPath::Chains,
                    "stream" => outbox_producer::DispatchPath::Stream,
                    other => return Err(format!("--path takes chains or stream, not {other:?}")),
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.events == 0 {
        return Err("--events must be at least 1".into());
    }
    Ok(Some(o))
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

fn say(t0: Instant, msg: impl AsRef<str>) {
    eprintln!("chaos [{:>6.1}s] {}", t0.elapsed().as_secs_f64(), msg.as_ref());
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dispatcher,
    Reconciler,
    Consumer,
    Emitter,
}

/// One supervised child process.
struct Proc {
    name: String,
    kind: Kind,
    args: Vec<String>,
    env: Vec<(String, String)>,
    role: &'static str,
    child: Option<std::process::Child>,
    incarnation: u32,
    log: PathBuf,
    paused: bool,
    finished: Option<std::process::ExitStatus>,
    restart_at: Option<Instant>,
}

/// Everything the drill started; dropping it kills every child and removes the directory.
struct Drill {
    exe: PathBuf,
    dir: PathBuf,
    keep: bool,
    t0: Instant,
    pg: Option<PgServer>,
    tansu: Option<Tansu>,
    procs: Vec<Proc>,
    unexpected_exits: BTreeMap<String, u32>,
}

impl Drill {
    fn spawn(&mut self, i: usize) -> Result<()> {
        let exe = self.exe.clone();
        let p = &mut self.procs[i];
        p.incarnation += 1;
        let mut args = p.args.clone();
        if p.kind == Kind::Dispatcher {
            args.extend(["--name".to_owned(), format!("{}-{}", p.name, p.incarnation)]);
        }
        if p.kind == Kind::Reconciler {
            args.extend(["--owner".to_owned(), format!("{}-{}", p.name, p.incarnation)]);
        }
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&p.log)?;
        let mut c = Command::new(&exe);
        c.args(&args);
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_") || k == "DATABASE_URL" || k == "RUST_LOG" {
                c.env_remove(k);
            }
        }
        c.env(ROLE_ENV, p.role);
        for (k, v) in &p.env {
            c.env(k, v);
        }
        c.stdin(Stdio::null()).stdout(Stdio::from(out.try_clone()?)).stderr(Stdio::from(out));
        // SAFETY: prctl in the forked child before exec; async-signal-safe.
        unsafe {
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = c.spawn().with_context(|| format!("starting {}", p.name))?;
        p.child = Some(child);
        p.paused = false;
        p.restart_at = None;
        Ok(())
    }

    fn signal(&self, i: usize, sig: i32) {
        if let Some(c) = &self.procs[i].child {
            // SAFETY: kill(2) on a child we started and have not reaped.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    fn kill(&mut self, i: usize) {
        self.signal(i, libc::SIGCONT);
        if let Some(mut c) = self.procs[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.procs[i].paused = false;
    }

    /// Reaps exited children: emitters are done (or failed); any other
    /// exit is unexpected and the process is restarted after 500 ms.
    fn supervise(&mut self, restart: bool) -> Result<()> {
        for i in 0..self.procs.len() {
            if let Some(at) = self.procs[i].restart_at {
                if Instant::now() >= at && restart {
                    self.spawn(i)?;
                }
                continue;
            }
            let Some(c) = self.procs[i].child.as_mut() else { continue };
            let Some(status) = c.try_wait()? else { continue };
            self.procs[i].child = None;
            let p = &mut self.procs[i];
            if p.kind == Kind::Emitter {
                p.finished = Some(status);
                if !status.success() {
                    say(self.t0, format!("{} exited {status}: see {}", p.name, p.log.display()));
                }
                continue;
            }
            *self.unexpected_exits.entry(p.name.clone()).or_insert(0) += 1;
            say(self.t0, format!("{} exited on its own ({status}); restarting it", p.name));
            p.restart_at = Some(Instant::now() + Duration::from_millis(500));
        }
        Ok(())
    }

    fn index(&self, name: &str) -> usize {
        self.procs.iter().position(|p| p.name == name).expect("known process")
    }

    /// SIGTERM to every service, SIGKILL to what is left after `grace`.
    fn stop_services(&mut self, grace: Duration) {
        for i in 0..self.procs.len() {
            self.signal(i, libc::SIGCONT);
            self.signal(i, libc::SIGTERM);
            self.procs[i].restart_at = None;
        }
        let deadline = Instant::now() + grace;
        for p in &mut self.procs {
            if let Some(c) = p.child.as_mut() {
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = c.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        for i in 0..self.procs.len() {
            self.kill(i);
        }
    }
}

impl Drop for Drill {
    fn drop(&mut self) {
        for i in 0..self.procs.len() {
            self.kill(i);
        }
        self.tansu = None;
        if let Some(mut pg) = self.pg.take() {
            if let Err(e) = pg.stop() {
                eprintln!("outbox-chaos: {e:#}");
            }
        }
        if self.keep {
            eprintln!("outbox-chaos: kept {}", self.dir.display());
        } else if self.dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                eprintln!("outbox-chaos: removing {}: {e}", self.dir.display());
            }
        }
    }
}

/// What the drill did, for the last line.
#[derive(Debug, Default)]
struct Tally {
    kills: u32,
    pg_restarts: u32,
    pauses: u32,
    broker_replacements: u32,
    broker_replacement_skipped: Option<&'static str>,
    replacement: Option<Replacement>,
    settle_seconds: f64,
    evidence: Vec<String>,
}

async fn connect(url: &str) -> Result<PgPool> {
    Ok(PgPoolOptions::new().max_connections(4).acquire_timeout(Duration::from_secs(5)).connect(url).await?)
}

async fn states(pool: &PgPool) -> Result<BTreeMap<String, i64>> {
    // Wherever the events live: the exception lane (outbox_events) and the stream.
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT state, n FROM outbox_state_counts()").fetch_all(pool).await?;
    Ok(rows.into_iter().collect())
}

/// States with RECONCILING counted as DISPATCH_UNKNOWN (a reconciler's
/// claim on an UNKNOWN it cannot decide comes and goes every round).
fn settled_view(s: &BTreeMap<String, i64>) -> BTreeMap<String, i64> {
    let mut v = BTreeMap::new();
    for (k, n) in s {
        let k = if k == "RECONCILING" { "DISPATCH_UNKNOWN" } else { k.as_str() };
        *v.entry(k.to_owned()).or_insert(0) += n;
    }
    v
}

/// Events neither PUBLISHED, nor an UNKNOWN a finding reports, nor PENDING
/// behind such an UNKNOWN of their key: the lane's rows, and the stream's
/// events without a lane row (PUBLISHED with a receipt in the slot, else
/// on their way; an UNKNOWN is always in the lane).
const UNSETTLED_SQL: &str = "
WITH ev AS (
    SELECT e.event_id, e.state, e.routing_key, e.aggregate_version FROM outbox_events e
    UNION ALL
    SELECT s.event_id,
           CASE WHEN EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = s.event_id AND r.envelope_generation = 1)
                THEN 'PUBLISHED' ELSE 'PENDING' END,
           s.routing_key, s.aggregate_version
    FROM outbox_stream s WHERE NOT EXISTS (SELECT 1 FROM outbox_events x WHERE x.event_id = s.event_id))
SELECT count(*) FROM ev e
 WHERE e.state <> 'PUBLISHED'
   AND NOT (e.state IN ('DISPATCH_UNKNOWN', 'RECONCILING') AND EXISTS (
            SELECT 1 FROM outbox_findings f WHERE f.event_id = e.event_id AND f.kind IN ('log_unavailable', 'unknown_past_slo')))
   AND NOT (e.state = 'PENDING' AND EXISTS (
            SELECT 1 FROM outbox_events u JOIN outbox_findings f ON f.event_id = u.event_id AND f.kind IN ('log_unavailable', 'unknown_past_slo')
             WHERE u.routing_key = e.routing_key AND u.state IN ('DISPATCH_UNKNOWN', 'RECONCILING') AND u.aggregate_version < e.aggregate_version))";

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        return roles::run(&role);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse(&args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("outbox-chaos: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // One thread: children get PR_SET_PDEATHSIG from it, which fires when
    // the thread that forked them ends; this one lives until exit.
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-chaos: {e}");
            return ExitCode::from(1);
        }
    };
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("outbox-chaos-{}", std::process::id()));
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("outbox-chaos: {e}");
            return ExitCode::from(1);
        }
    };
    let mut drill = Drill { exe, dir: dir.clone(), keep: opts.keep, t0: started, pg: None, tansu: None, procs: Vec::new(), unexpected_exits: BTreeMap::new() };
    let mut tally = Tally::default();
    let result = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            r = run(&mut drill, &opts, &mut tally) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted (SIGINT)")),
            _ = term.recv() => Err(anyhow!("interrupted (SIGTERM)")),
        }
    });
    let unexpected: u32 = drill.unexpected_exits.values().sum();
    drop(drill);
    let wall = started.elapsed().as_secs_f64();
    let mut tail = format!(
        "path={} kills={} pg_restarts={} pauses={} broker_replacements={} unexpected_exits={unexpected} seed={} settle_seconds={:.0} wall_seconds={wall:.0}",
        opts.path.as_str(), tally.kills, tally.pg_restarts, tally.pauses, tally.broker_replacements, opts.seed, tally.settle_seconds
    );
    if let Some(why) = tally.broker_replacement_skipped {
        tail.push_str(&format!(" broker_replacement_skipped={why}"));
    }
    match result {
        Ok(v) => {
            for line in &tally.evidence {
                println!("{line}");
            }
            for line in &v.evidence {
                println!("{line}");
            }
            let f = &v.figures;
            let findings: Vec<String> = f.findings_by_kind.iter().map(|(k, n)| format!("{k}:{n}")).collect();
            println!("findings {}", if findings.is_empty() { "none".to_owned() } else { findings.join(" ") });
            let pairs: Vec<String> = check::figure_pairs(f).into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            let pass = v.pass() && tally.evidence.is_empty();
            let failed: Vec<String> = v.failures.iter().map(|(k, n)| format!("{k}:{n}")).collect();
            let failed = if failed.is_empty() { String::new() } else { format!(" failures={}", failed.join(",")) };
            println!("chaos {} {} {tail}{failed}", if pass { "PASS" } else { "FAIL" }, pairs.join(" "));
            if pass {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            for line in &tally.evidence {
                println!("{line}");
            }
            println!("error: {e:#}");
            println!("chaos FAIL events={} {tail} error=\"{}\"", opts.events, format!("{e}").replace('"', "'"));
            ExitCode::from(1)
        }
    }
}

async fn run(d: &mut Drill, o: &Opts, tally: &mut Tally) -> Result<check::Verdict> {
    let t0 = d.t0;
    std::fs::create_dir_all(&d.dir)?;
    say(t0, format!("seed {} events {} dir {}", o.seed, o.events, d.dir.display()));

    // PostgreSQL of its own: producer and consumer databases.
    let pg = PgServer::start(&d.dir.join("pg"))?;
    let admin = connect(&pg.url("postgres")).await?;
    for db in ["chaos_producer", "chaos_consumer"] {
        sqlx::query(&format!("CREATE DATABASE {db}")).execute(&admin).await?;
    }
    admin.close().await;
    let producer_url = pg.url("chaos_producer");
    let consumer_url = pg.url("chaos_consumer");
    d.pg = Some(pg);
    say(t0, format!("postgres up: {producer_url}, {consumer_url}"));

    // The broker.
    let external = std::env::var("OUTBOX_CHAOS_KAFKA_BOOTSTRAP").ok().filter(|s| !s.is_empty());
    let (bootstrap, topic, group) = match &external {
        Some(b) => {
            let run_id = format!("{}-{}", std::process::id(), now_ms());
            tally.broker_replacement_skipped = Some("external_broker");
            say(t0, format!("external broker {b}: the broker replacement is skipped (the drill cannot replace a broker it did not start)"));
            let topic = format!("{TOPIC}.{run_id}");
            create_topics_admin(b, &[(topic.as_str(), PARTITIONS), (WATERMARK_TOPIC, 1)]).await?;
            (b.clone(), topic, format!("{CONSUMER_ID}-{run_id}"))
        }
        None => {
            let bin = tansu::tansu_bin()?;
            let port = free_port()?;
            let t = Tansu::start(&bin, port, CLUSTER_ID, &d.dir.join("tansu.log"))?;
            t.create_topic(TOPIC, PARTITIONS as u32)?;
            t.create_topic(WATERMARK_TOPIC, 1)?;
            let b = t.bootstrap();
            d.tansu = Some(t);
            if !o.broker_replacement {
                tally.broker_replacement_skipped = Some("no_broker_replacement_flag");
            }
            say(t0, format!("tansu up on {b} ({})", bin.display()));
            (b, TOPIC.to_owned(), CONSUMER_ID.to_owned())
        }
    };

    // Schemas, route, consumer registration.
    let producer = connect(&producer_url).await?;
    let consumer = connect(&consumer_url).await?;
    outbox_producer::migrate(&producer).await?;
    outbox_consumer::migrate(&consumer).await?;
    roles::create_business_table(&producer).await?;
    roles::create_effect_table(&consumer).await?;
    let cluster_id = {
        let mut kc = outbox_producer::KafkaConfig::new(bootstrap.clone());
        kc.connect_timeout_ms = 20_000;
        let b = outbox_producer::KafkaBroker::connect(kc).await.context("connecting to the broker")?;
        b.cluster_id().to_owned()
    };
    let policy = outbox_core::RoutePolicy::new(roles::EVENT_TYPE, &cluster_id, &topic, PARTITIONS as u32);
    outbox_producer::routes::ensure(&producer, &policy).await?;
    outbox_producer::register_consumer(&producer, CONSUMER_ID, &[topic.as_str()], true, false).await?;
    outbox_producer::set_dispatch_path(&producer, o.path).await?;
    say(t0, format!("cluster {cluster_id}, topic {topic} ({PARTITIONS} partitions), consumer {CONSUMER_ID} registered, dispatch path {}", o.path.as_str()));

    // The processes.
    let db_env = |url: &str| vec![("DATABASE_URL".to_owned(), url.to_owned()), ("RUST_LOG".to_owned(), "warn".to_owned())];
    let kafka_args: Vec<String> = [
        "--kafka-bootstrap", &bootstrap, "--kafka-message-timeout-ms", "5000", "--kafka-request-timeout-ms", "3000",
        "--kafka-setting", "batch.num.messages=1", "--kafka-producer-stall-ms", "4000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let add = |d: &mut Drill, name: &str, kind: Kind, role: &'static str, args: Vec<String>, env: Vec<(String, String)>| {
        let log = d.dir.join(format!("{name}.log"));
        d.procs.push(Proc { name: name.to_owned(), kind, args, env, role, child: None, incarnation: 0, log, paused: false, finished: None, restart_at: None });
    };
    for name in ["d1", "d2"] {
        let mut a: Vec<String> = vec!["dispatch".into()];
        a.extend(kafka_args.iter().cloned());
        a.extend(
            ["--workers", "2", "--batch-size", "200", "--lease-ms", &LEASE_MS.to_string(), "--poll-interval-ms", "200", "--sweep-interval-ms", "500", "--record-retry-ms", "30000", "--shutdown-grace-ms", "5000"]
                .iter()
                .map(|s| s.to_string()),
        );
        add(d, name, Kind::Dispatcher, "outbox", a, db_env(&producer_url));
    }
    {
        let mut a: Vec<String> = vec!["reconcile".into()];
        a.extend(kafka_args.iter().cloned());
        a.extend(["--interval-ms", "1000", "--recheck-ms", "2000", "--in-flight-bound-ms", "32000", "--lease-ms", "10000"].iter().map(|s| s.to_string()));
        // The drill's consumers publish unsigned watermark records (the drill
        // checks delivery under faults, not watermark authentication, and its
        // broker is its own): opted out explicitly, since the reconciler
        // refuses unsigned records of a consumer it holds no key for.
        a.extend(["--watermark-unsigned".to_owned(), CONSUMER_ID.to_owned()]);
        add(d, "reconciler", Kind::Reconciler, "outbox", a, db_env(&producer_url));
    }
    for name in ["c1", "c2"] {
        add(d, name, Kind::Consumer, "consumer", vec![consumer_url.clone(), bootstrap.clone(), CONSUMER_ID.into(), group.clone(), topic.clone()], db_env(&consumer_url));
    }
    // Emission spread over the chaos window: at least 40 s, at most 300 events/s.
    let emit_seconds = (o.events as f64 / 300.0).max(40.0);
    let per_emitter = [o.events / 2 + o.events % 2, o.events / 2];
    for (i, n) in per_emitter.iter().enumerate() {
        if *n == 0 {
            continue;
        }
        let aggregates = (*n / 20).clamp(1, 200);
        let rate = *n as f64 / emit_seconds;
        add(d, &format!("e{}", i + 1), Kind::Emitter, "emitter", vec![producer_url.clone(), (i + 1).to_string(), n.to_string(), aggregates.to_string(), format!("{rate:.3}")], db_env(&producer_url));
    }
    for i in 0..d.procs.len() {
        d.spawn(i)?;
    }
    say(t0, format!("started {} processes; emitting {} events over ~{emit_seconds:.0} s", d.procs.len(), o.events));

    // The faults.
    let mut rng = rand::rngs::StdRng::seed_from_u64(o.seed);
    let chaos_start = Instant::now();
    let at = |f: f64| chaos_start + Duration::from_secs_f64(emit_seconds * f);
    let pause_at = at(0.2);
    let pg_restart_at = at(0.4);
    let replace_at = at(0.6);
    let chaos_end = at(1.0);
    let mut next_kill = chaos_start + Duration::from_millis(rng.gen_range(1000..=3000));
    let mut paused: Option<(usize, Instant)> = None;
    let (mut did_pause, mut did_pg, mut did_replace) = (false, false, !o.broker_replacement || d.tansu.is_none());
    let victims: Vec<usize> = ["d1", "d2", "c1", "c2"].iter().map(|n| d.index(n)).collect();
    let mut last_report = Instant::now();
    loop {
        d.supervise(true)?;
        let now = Instant::now();
        let emitters_done = d.procs.iter().filter(|p| p.kind == Kind::Emitter).all(|p| p.finished.is_some());
        if emitters_done && did_pause && did_pg && did_replace && paused.is_none() && now >= chaos_end {
            break;
        }
        if now > chaos_end + Duration::from_secs(240) {
            bail!("the emitters did not finish within 240 s of the chaos window's end");
        }
        if now >= next_kill {
            let candidates: Vec<usize> = victims.iter().copied().filter(|i| d.procs[*i].child.is_some() && !d.procs[*i].paused).collect();
            if !candidates.is_empty() {
                let i = candidates[rng.gen_range(0..candidates.len())];
                d.kill(i);
                tally.kills += 1;
                d.spawn(i)?;
            }
            next_kill = now + Duration::from_millis(rng.gen_range(1000..=3000));
        }
        if !did_pause && now >= pause_at {
            let i = d.index(if rng.gen_bool(0.5) { "d1" } else { "d2" });
            if d.procs[i].child.is_some() {
                d.signal(i, libc::SIGSTOP);
                d.procs[i].paused = true;
                paused = Some((i, now + Duration::from_millis(PAUSE_MS)));
                did_pause = true;
                tally.pauses += 1;
                say(t0, format!("SIGSTOP {} for {PAUSE_MS} ms (lease {LEASE_MS} ms)", d.procs[i].name));
            }
        }
        if let Some((i, until)) = paused {
            if now >= until {
                d.signal(i, libc::SIGCONT);
                d.procs[i].paused = false;
                paused = None;
                say(t0, format!("SIGCONT {}", d.procs[i].name));
            }
        }
        if !did_pg && now >= pg_restart_at {
            say(t0, "pg_ctl restart -m immediate");
            let started = Instant::now();
            d.pg.as_mut().expect("postgres").restart_immediate()?;
            did_pg = true;
            tally.pg_restarts += 1;
            say(t0, format!("postgres back after {:.1} s", started.elapsed().as_secs_f64()));
        }
        if !did_replace && now >= replace_at {
            let t = d.tansu.as_mut().expect("tansu");
            let killed = now_ms();
            say(t0, "broker replaced: tansu killed (its log is gone), a fresh empty one starting on the same port");
            t.replace()?;
            t.create_topic(TOPIC, PARTITIONS as u32)?;
            t.create_topic(WATERMARK_TOPIC, 1)?;
            tally.replacement = Some(Replacement { old_killed_at_ms: killed, new_up_at_ms: now_ms() });
            tally.broker_replacements += 1;
            did_replace = true;
            say(t0, "new broker up, topics recreated");
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            let s = tokio::time::timeout(Duration::from_secs(2), states(&producer)).await;
            if let Ok(Ok(s)) = s {
                say(t0, format!("kills={} states={s:?}", tally.kills));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (p, status) in d.procs.iter().filter_map(|p| p.finished.map(|s| (p, s))) {
        if !status.success() {
            tally.evidence.push(format!("emitter_failed: {} exited {status} (its log: {})", p.name, tail(&p.log, 3)));
        }
    }

    // Settle: every event PUBLISHED (or an UNKNOWN a finding reports, or
    // held behind one), stable for 10 s; every event of the current log
    // applied by the consumer; then two more reconciler rounds.
    say(t0, format!("faults stopped after {} kills; settling", tally.kills));
    let settle_start = Instant::now();
    let settle_bound = Duration::from_secs(180 + o.events / 100);
    let mut stable_since: Option<(Instant, BTreeMap<String, i64>)> = None;
    let mut rounds_at_settle: Option<i64> = None;
    loop {
        d.supervise(true)?;
        if settle_start.elapsed() > settle_bound {
            let s = states(&producer).await.unwrap_or_default();
            tally.evidence.push(format!("not_settled: not settled within {} s; states {s:?}", settle_bound.as_secs()));
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok(raw) = states(&producer).await else { continue };
        let s = settled_view(&raw);
        let unsettled: i64 = match sqlx::query_scalar(UNSETTLED_SQL).fetch_one(&producer).await {
            Ok(n) => n,
            Err(_) => continue,
        };
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            say(t0, format!("settling: unsettled={unsettled} states={raw:?}"));
        }
        if unsettled > 0 {
            stable_since = None;
            rounds_at_settle = None;
            continue;
        }
        match &stable_since {
            Some((_, prev)) if *prev == s => {}
            _ => {
                stable_since = Some((Instant::now(), s));
                rounds_at_settle = None;
                continue;
            }
        }
        if stable_since.as_ref().is_some_and(|(t, _)| t.elapsed() < Duration::from_secs(10)) {
            continue;
        }
        let log = snapshot::read_log(&bootstrap, &topic, PARTITIONS, Duration::from_secs(60));
        let Ok(log) = log else { continue };
        let in_log: std::collections::HashSet<String> = log.into_iter().filter_map(|m| m.event_id).collect();
        let applied: Vec<String> = match sqlx::query_scalar(&format!("SELECT DISTINCT event_id FROM {} WHERE consumer_id = $1", roles::EFFECTS_TABLE)).bind(CONSUMER_ID).fetch_all(&consumer).await {
            Ok(a) => a,
            Err(_) => continue,
        };
        let applied: std::collections::HashSet<String> = applied.into_iter().collect();
        let missing = in_log.iter().filter(|id| !applied.contains(*id)).count();
        if missing > 0 {
            say(t0, format!("settling: {missing} events of the current log not applied yet"));
            rounds_at_settle = None;
            continue;
        }
        let rounds: i64 = sqlx::query_scalar("SELECT COALESCE(sum(rounds), 0)::bigint FROM outbox_reconciler_rounds").fetch_one(&producer).await.unwrap_or(0);
        match rounds_at_settle {
            None => rounds_at_settle = Some(rounds),
            Some(r0) if rounds >= r0 + 2 => break,
            Some(_) => {}
        }
    }
    tally.settle_seconds = settle_start.elapsed().as_secs_f64();
    say(t0, format!("settled after {:.0} s; stopping the services", tally.settle_seconds));
    d.stop_services(Duration::from_secs(20));

    let ids = vec![CONSUMER_ID.to_owned()];
    let mut snap = snapshot::read_databases(&producer, &consumer, &ids).await?;
    snap.log = snapshot::read_log(&bootstrap, &topic, PARTITIONS, Duration::from_secs(120))?;
    snap.requested_events = o.events;
    snap.replacement = tally.replacement;
    say(t0, format!("snapshot: {} business rows, {} events, {} log records, {} findings", snap.business.len(), snap.events.len(), snap.log.len(), snap.findings.len()));
    Ok(check::check(&snap))
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

async fn create_topics_admin(bootstrap: &str, topics: &[(&str, i32)]) -> Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new().set("bootstrap.servers", bootstrap).create()?;
    let new: Vec<NewTopic> = topics.iter().map(|(t, p)| NewTopic::new(t, *p, TopicReplication::Fixed(-1))).collect();
    let results = admin.create_topics(new.iter(), &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)))).await?;
    for r in results {
        match r {
            Ok(_) => {}
            Err((t, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) if t == WATERMARK_TOPIC => {}
            Err((t, e)) => bail!("creating topic {t}: {e}"),
        }
    }
    Ok(())
}
