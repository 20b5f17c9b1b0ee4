//! The command line (clap derive). Every command and flag is documented
//! here; `outbox --help` and `outbox <command> --help` print it.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

const AFTER_HELP: &str = "\
CONFIGURATION PRECEDENCE (highest first):
  1. command-line flags
  2. environment: DATABASE_URL, OUTBOX_KAFKA_BOOTSTRAP (one name for the CLI, the producer
     and the consumer; tests read OUTBOX_TEST_KAFKA_BOOTSTRAP), OUTBOX_CONSUMER_DATABASE_URL
     (trace, dead-letters), OUTBOX_KAFKA_OIDC_CLIENT_SECRET,
     OUTBOX_METRICS_ADDR, OUTBOX_LOG_FORMAT, RUST_LOG, and OUTBOX_DISPATCH_NAME/_WORKERS/_BATCH_SIZE/_LEASE_MS/_POLL_INTERVAL_MS/
     _SWEEP_INTERVAL_MS/_SHUTDOWN_GRACE_MS/_LISTEN for the dispatcher
  3. the TOML file given by --config (or OUTBOX_CONFIG): sections [kafka], [dispatch],
     [reconcile], [retention], [report], [metrics]; see outbox-cli/README.md
  4. built-in defaults

DURATIONS: every --*-ms flag takes milliseconds (30000) or units (30s, 5m, 1h30m, 7d).
TIMESTAMPS: RFC 3339 UTC (2026-12-01T09:00:00.000Z); --json output is always one object.

EXIT CODES:
  0 success; 1 error; 2 findings present (reconcile --once, status or report with --fail-on-findings);
  3 destination migration or skip refused; 4 the Kafka producer could not deliver (with --exit-on-fatal);
  130 interrupted twice (no graceful drain).";

/// Operate a transactional outbox on PostgreSQL + Kafka.
///
/// `migrate` installs the schema; `dispatch` and `reconcile` are the
/// long-running services; `status`, `trace` and `report` inspect; `route`
/// sets where event types go; `dead-letters`, `findings` and `unknown` are
/// the runbook's steps; `purge` applies retention; `migrate-destination`
/// moves an undelivered event to a new destination with proof that the old
/// one never received it; `skip` closes a key's blocked head so that the
/// key goes on.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about, long_about, after_long_help = AFTER_HELP, after_help = "Configuration precedence: flags > environment > --config file > defaults (see --help).")]
pub struct Cli {
    /// TOML configuration file (see outbox-cli/README.md for its sections).
    #[arg(long, global = true, env = "OUTBOX_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// PostgreSQL URL of the outbox database, e.g. postgres://user@host:5432/db.
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: Option<String>,

    /// Log format on standard error.
    #[arg(long, global = true, env = "OUTBOX_LOG_FORMAT", value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,

    /// Log filter in tracing's EnvFilter syntax, e.g. `info` or `warn,outbox_producer=debug` [env: RUST_LOG; default: info,sqlx=warn].
    #[arg(long, global = true, value_name = "FILTER")]
    pub log: Option<String>,

    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the producer's and the consumer's schema migrations (idempotent, locked).
    Migrate(MigrateArgs),
    /// Run the dispatcher until SIGINT/SIGTERM: claim PENDING events, send them to Kafka, record receipts.
    ///
    /// On the first SIGINT or SIGTERM it stops claiming, waits for outstanding
    /// broker answers (at most shutdown_grace_ms) and exits 0; a second signal
    /// exits at once (130): unanswered attempts then turn DISPATCH_UNKNOWN when
    /// their leases expire and the reconciler resolves them.
    Dispatch(DispatchArgs),
    /// Resolve DISPATCH_UNKNOWN events and compare the three sets (outbox, receipts, consumer watermarks).
    ///
    /// Loops every --interval-ms until SIGINT/SIGTERM, or runs one round with --once.
    Reconcile(ReconcileArgs),
    /// Counts per state, oldest PENDING, open UNKNOWNs, open findings and each critical consumer's lag.
    Status(StatusArgs),
    /// One event's whole life: envelope, frozen destination, attempts, receipts, quarantine, audit, consumers.
    Trace(TraceArgs),
    /// The reconciliation report as text, JSON, or a self-contained HTML file with charts.
    Report(ReportArgs),
    /// Retention: PUBLISHED -> RETAINED after the replay window, RETAINED -> PURGED once every mandatory consumer passed.
    ///
    /// A dry run (the default) counts what would change and writes nothing;
    /// --execute runs bounded batches and prints each one.
    Purge(PurgeArgs),
    /// Move an undelivered event to a new destination (new envelope generation + migration receipt).
    ///
    /// Allowed only for a PENDING event no attempt may have delivered, a
    /// QUARANTINED one no attempt may have delivered (a re-send: the
    /// destination may stay the same), or a DISPATCH_UNKNOWN event the old
    /// cluster proves it does not hold (the Kafka connection must be to the
    /// event's frozen cluster). Otherwise refused (exit 3) and nothing
    /// changes.
    MigrateDestination(MigrateDestinationArgs),
    /// Close a QUARANTINED or DISPATCH_UNKNOWN event as SKIPPED, so that the later events of its key go on.
    ///
    /// The way out of a blocked key (see docs/OPERATIONS.md, "A blocked
    /// key"): the event is never published by the outbox and consumers see a
    /// gap in its key's sequence. Recorded in outbox_audit (action skip: the
    /// operator, the reason, the state it left). Any other state, or a
    /// reconciler's lease in flight (RECONCILING), is refused (exit 3) and
    /// nothing changes.
    Skip(SkipArgs),
    /// The dispatch path events emitted from now on take: chains (a row of outbox_events each) or stream (insert-only stream rows, dispatched in batches).
    ///
    /// Without --set it prints the path in force. Events already emitted
    /// drain on the path they took; after a switch back to chains, let the
    /// stream drain before relying on per-key order across the two (see
    /// docs/OPERATIONS.md, "Switching the dispatch path").
    #[command(name = "dispatch-path")]
    DispatchPath(DispatchPathArgs),
    /// Which emits write their aggregates' head rows: snapshot-isolation (emits at REPEATABLE READ or SERIALIZABLE, the default) or always.
    ///
    /// Without --set it prints the setting in force. A head row is what two
    /// emits of one aggregate both write, so that an emit at REPEATABLE READ
    /// whose snapshot predates another's commit fails with a retryable
    /// serialization error instead of committing a version below the
    /// other's. Set always when one aggregate's emits run at READ COMMITTED
    /// and at REPEATABLE READ (one more row write per aggregate per emitting
    /// transaction).
    #[command(name = "aggregate-heads")]
    AggregateHeads(AggregateHeadsArgs),
    /// Rollout: which events the outbox sends (event types and a share by eventId hash); the rest stays with the legacy publisher.
    #[command(subcommand)]
    Takeover(TakeoverCommand),
    /// Rollout and rollback: which dispatcher implementation claims under an alias.
    #[command(subcommand)]
    Alias(AliasCommand),
    /// Shadow mode, one round: record the messages the outbox would send for legacy events, compare with the topics, print mismatches.
    ///
    /// Exits 2 when mismatches are open. Sends nothing.
    Shadow(ShadowArgs),
    /// Route policies: where each event type goes (a change is a new generation; only later events are affected).
    #[command(subcommand)]
    Route(RouteCommand),
    /// Consumers' dead letters: list, show, and requeue (the running consumer runs the handler again).
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLettersCommand),
    /// Consumers' gaps: ranges of a partition a consumer skipped (a reset group, an offset out of range); list, and accept one that cannot be replayed.
    #[command(subcommand)]
    Gaps(GapsCommand),
    /// Consumers' watermark records over the broker: which database each consumer's records are taken from.
    #[command(subcommand)]
    Watermarks(WatermarksCommand),
    /// The reconciler's findings: list, and acknowledge (close) one.
    #[command(subcommand)]
    Findings(FindingsCommand),
    /// Events whose dispatch outcome is unknown, with the evidence: attempts and the reconciler's lookups.
    #[command(subcommand)]
    Unknown(UnknownCommand),
}

/// `outbox route`.
#[derive(Debug, Subcommand)]
pub enum RouteCommand {
    /// Route an event type (idempotent: the current generation when nothing changes, else a new one).
    ///
    /// With a Kafka connection, the cluster id defaults to the connected
    /// cluster's and the topic's partition count is checked against the
    /// cluster's metadata (a mismatch or a missing topic is refused).
    Set(RouteSetArgs),
    /// Print the current route of an event type (with a Kafka connection: the cluster id and a partition check).
    Show {
        /// The event type, e.g. order.created.v2.
        event_type: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Kafka connection (optional).
        #[command(flatten)]
        kafka: KafkaArgs,
    },
    /// Print the current route of every event type.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Set what becomes of an event of the type that blocks its key for good
    /// (QUARANTINED): `block` (the default: the key waits for an operator's
    /// `outbox skip`) or `skip` (the reconciler's next round skips it,
    /// recording this setting in the skip's evidence; consumers see a gap).
    /// Without --policy, prints the policy in force.
    Poison(RoutePoisonArgs),
}

/// `outbox route poison`.
#[derive(Debug, Args)]
pub struct RoutePoisonArgs {
    /// The event type, e.g. order.created.v2.
    pub event_type: String,
    /// `block` or `skip` (omit to print the policy in force).
    #[arg(long, value_name = "POLICY", requires_all = ["operator", "reason"])]
    pub policy: Option<String>,
    /// Who sets it (recorded), e.g. your login.
    #[arg(long, value_name = "NAME")]
    pub operator: Option<String>,
    /// Why (recorded; at most 1000 bytes), e.g. the ticket and who agreed that consumers accept gaps.
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `outbox route set`.
#[derive(Debug, Args)]
pub struct RouteSetArgs {
    /// The event type, e.g. order.created.v2.
    pub event_type: String,
    /// The topic.
    #[arg(long, value_name = "TOPIC")]
    pub topic: String,
    /// The topic's partition count.
    #[arg(long, value_name = "N")]
    pub partitions: u32,
    /// The cluster id (what `outbox route show` and the dispatcher log print) [default: the connected cluster's].
    #[arg(long, value_name = "CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// The routing-key template, e.g. `{tenant}.{aggregate_type}.{aggregate_id}` [default: the SDK's].
    #[arg(long, value_name = "TEMPLATE")]
    pub key_template: Option<String>,
    /// Ordering: `key` (per routing key) or `none` [default: key].
    #[arg(long, value_name = "ORDERING")]
    pub ordering: Option<String>,
    /// Skip the partition-count check (no Kafka connection needed; --cluster-id then required).
    #[arg(long)]
    pub no_check: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Kafka connection (for the cluster id and the partition check).
    #[command(flatten)]
    pub kafka: KafkaArgs,
}

/// `outbox dead-letters`.
#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, oldest first.
    List {
        /// Only this consumer's.
        #[arg(long, value_name = "CONSUMER_ID")]
        consumer: Option<String>,
        /// Most rows, 1..=10000 [default: 100].
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// The consumer's database, if not the outbox database.
        #[arg(long, env = "OUTBOX_CONSUMER_DATABASE_URL", hide_env_values = true, value_name = "URL")]
        consumer_database_url: Option<String>,
    },
    /// Show the dead letters of one event (one per consumer).
    Show {
        /// The event.
        event_id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// The consumer's database, if not the outbox database.
        #[arg(long, env = "OUTBOX_CONSUMER_DATABASE_URL", hide_env_values = true, value_name = "URL")]
        consumer_database_url: Option<String>,
    },
    /// Ask the running consumer to run the handler of a dead letter again (within a second).
    ///
    /// Success deletes the dead letter and writes the receipt; another
    /// failure keeps it, with attempts + 1 and the new error.
    Requeue {
        /// The event.
        event_id: String,
        /// The consumer whose dead letter it is.
        #[arg(long, value_name = "CONSUMER_ID")]
        consumer: String,
        /// Who asks (recorded), e.g. your login.
        #[arg(long, value_name = "NAME")]
        operator: String,
        /// The consumer's database, if not the outbox database.
        #[arg(long, env = "OUTBOX_CONSUMER_DATABASE_URL", hide_env_values = true, value_name = "URL")]
        consumer_database_url: Option<String>,
    },
}

/// `outbox watermarks`.
#[derive(Debug, Subcommand)]
pub enum WatermarksCommand {
    /// Forget the database pinned as a consumer's watermark writer (its records name it): the next record's database is pinned. For a consumer whose database really moved.
    ///
    /// Records of another database than the pinned one (a scratch replay
    /// under the production consumer's id) are refused as a second writer.
    Repin {
        /// The consumer.
        #[arg(long, value_name = "CONSUMER_ID")]
        consumer: String,
        /// Who asks (logged), e.g. your login.
        #[arg(long, value_name = "NAME")]
        operator: String,
    },
}

/// `outbox gaps`.
#[derive(Debug, Subcommand)]
pub enum GapsCommand {
    /// List open gaps (with --all, closed ones too), oldest first.
    List {
        /// Only this consumer's.
        #[arg(long, value_name = "CONSUMER_ID")]
        consumer: Option<String>,
        /// Include gaps closed by a replay or accepted.
        #[arg(long)]
        all: bool,
        /// Most rows, 1..=10000 [default: 100].
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// The consumer's database, if not the outbox database.
        #[arg(long, env = "OUTBOX_CONSUMER_DATABASE_URL", hide_env_values = true, value_name = "URL")]
        consumer_database_url: Option<String>,
    },
    /// Accept an open gap whose messages are gone from the log: it closes (who and why kept) and the consumer's watermark moves on with its next decision there.
    ///
    /// The events of the range stay unconsumed for that consumer; the
    /// reconciler's unconsumed_published findings keep saying so.
    Accept {
        /// The consumer.
        #[arg(long, value_name = "CONSUMER_ID")]
        consumer: String,
        /// The log: cluster id, as `gaps list` prints it.
        #[arg(long, value_name = "CLUSTER_ID")]
        cluster: String,
        /// Topic.
        #[arg(long, value_name = "TOPIC")]
        topic: String,
        /// Partition.
        #[arg(long, value_name = "N")]
        partition: i32,
        /// Where the gap began when found (the FROM column of `gaps list`).
        #[arg(long, value_name = "OFFSET")]
        detected_from: i64,
        /// Who accepts, e.g. your login.
        #[arg(long, value_name = "NAME")]
        operator: String,
        /// Why (kept with the gap).
        #[arg(long, value_name = "TEXT")]
        reason: String,
        /// The consumer's database, if not the outbox database.
        #[arg(long, env = "OUTBOX_CONSUMER_DATABASE_URL", hide_env_values = true, value_name = "URL")]
        consumer_database_url: Option<String>,
    },
}

/// `outbox findings`.
#[derive(Debug, Subcommand)]
pub enum FindingsCommand {
    /// List open findings (with --all, closed ones too), oldest first.
    List {
        /// Include resolved and acknowledged findings.
        #[arg(long)]
        all: bool,
        /// Only this kind (aged_pending, unconsumed_published, bypass_publish, unknown_past_slo, quarantined).
        #[arg(long, value_name = "KIND")]
        kind: Option<String>,
        /// Most rows, 1..=10000 [default: 100].
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Acknowledge an open finding: it closes, with who and why (a condition that still holds opens a new one at the next round).
    Ack {
        /// The finding's id (first column of `findings list`).
        id: i64,
        /// Who acknowledges, e.g. your login.
        #[arg(long, value_name = "NAME")]
        operator: String,
        /// Why (kept with the finding).
        #[arg(long, value_name = "TEXT")]
        note: Option<String>,
    },
}

/// `outbox unknown`.
#[derive(Debug, Subcommand)]
pub enum UnknownCommand {
    /// List open UNKNOWN events (DISPATCH_UNKNOWN, RECONCILING, RETRY_CLAIMED), oldest first, with attempt and lookup counts.
    List {
        /// Most rows, 1..=10000 [default: 100].
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One UNKNOWN event's evidence: its attempts and every lookup the reconciler made, with its decision.
    Show {
        /// The event.
        event_id: String,
        /// Most lookups shown, newest first, 1..=10000 [default: 20].
        #[arg(long, value_name = "N", default_value_t = 20)]
        lookups: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `outbox takeover`.
#[derive(Debug, Subcommand)]
pub enum TakeoverCommand {
    /// Publish a new takeover policy generation (affects only events emitted after it).
    Set {
        /// Event type the outbox may own (repeatable; `*` = every type; none = shadow mode).
        #[arg(long = "event-type", value_name = "TYPE")]
        event_types: Vec<String>,
        /// Share of the selected types' events the outbox owns, basis points (500 = 5%).
        #[arg(long, value_name = "BP")]
        percent_bp: u32,
    },
    /// Print the current takeover policy.
    Show,
}

/// `outbox alias`.
#[derive(Debug, Subcommand)]
pub enum AliasCommand {
    /// Point an alias at an implementation (the rollout step and the only rollback step).
    Switch {
        /// The alias dispatchers run under (`OUTBOX_DISPATCH_ALIAS`).
        alias: String,
        /// The implementation that claims from now on (`OUTBOX_DISPATCH_IMPLEMENTATION`).
        implementation: String,
        /// The protocol version that implementation speaks.
        #[arg(long, value_name = "N", default_value_t = 1)]
        protocol_version: i32,
    },
    /// Print every alias and the implementation it names.
    Show,
}

/// `outbox shadow`.
#[derive(Debug, Args)]
pub struct ShadowArgs {
    /// Kafka connection (the cluster the legacy publisher writes to); used only to read.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// A shadow attempt with no message after this long is `missing` [default: 1m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub grace_ms: Option<i64>,
    /// Most messages read per partition in this round [default: 100000].
    #[arg(long, value_name = "N")]
    pub max_messages: Option<u64>,
}

/// `outbox migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Apply only one side's migrations.
    #[arg(long, value_enum)]
    pub only: Option<Side>,
    /// Name the outbox's source identity (ce_source / outbox-source) when the schema is made, e.g.
    /// urn:example:orders-prod; default a random urn:uuid:. It never changes: on a database that has
    /// one, only the same value is accepted.
    #[arg(long, env = "OUTBOX_SOURCE")]
    pub source: Option<String>,
}

/// Which migration set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Side {
    /// outbox-producer (outbox tables, route policies, reconciler tables).
    Producer,
    /// outbox-consumer (receipts, watermarks, consumer quarantine, dead letters).
    Consumer,
}

/// Kafka connection flags.
#[derive(Debug, Args, Clone, Default)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers, host:port[,host:port...].
    #[arg(long, env = "OUTBOX_KAFKA_BOOTSTRAP", value_name = "SERVERS")]
    pub kafka_bootstrap: Option<String>,
    /// librdkafka message.timeout.ms: how long one message may take to be delivered [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub kafka_message_timeout_ms: Option<u64>,
    /// librdkafka request.timeout.ms: how long one produce request may wait [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub kafka_request_timeout_ms: Option<u64>,
    /// Most messages handed to the Kafka client and not yet reported on [default: 1000].
    #[arg(long, value_name = "N")]
    pub kafka_max_in_flight: Option<usize>,
    /// Longest one reconciler lookup (partition scan) may take [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub kafka_lookup_timeout_ms: Option<u64>,
    /// Extra librdkafka setting of the producer, KEY=VALUE (repeatable), e.g. security.protocol=SASL_SSL; connection settings (security.*, ssl.*, sasl.*, socket.*, client.id...) also go to the lookup consumers; settings carrying the guarantees are refused.
    #[arg(long = "kafka-setting", value_name = "KEY=VALUE")]
    pub kafka_settings: Vec<String>,
    /// Extra librdkafka setting of the lookup consumers only, KEY=VALUE (repeatable), e.g. fetch.max.bytes=1048576.
    #[arg(long = "kafka-lookup-setting", value_name = "KEY=VALUE")]
    pub kafka_lookup_settings: Vec<String>,
    /// A producer with messages to deliver and no acknowledgement for this long cannot deliver: not ready, then rebuilt (or, with --exit-on-fatal, the service exits 4) [default: 60000].
    #[arg(long, value_name = "MS")]
    pub kafka_producer_stall_ms: Option<u64>,
    /// SASL/OAUTHBEARER with OIDC client credentials: the token endpoint (librdkafka fetches and refreshes the tokens; sets sasl.mechanism=OAUTHBEARER, sasl.oauthbearer.method=oidc and, unless set, security.protocol=SASL_SSL).
    #[arg(long, value_name = "URL")]
    pub kafka_oidc_token_url: Option<String>,
    /// OIDC client id (with --kafka-oidc-token-url).
    #[arg(long, value_name = "ID")]
    pub kafka_oidc_client_id: Option<String>,
    /// OIDC client secret (with --kafka-oidc-token-url); prefer the environment variable or the config file to the command line, which other users can read.
    #[arg(long, env = "OUTBOX_KAFKA_OIDC_CLIENT_SECRET", hide_env_values = true, value_name = "SECRET")]
    pub kafka_oidc_client_secret: Option<String>,
    /// OIDC scope (with --kafka-oidc-token-url).
    #[arg(long, value_name = "SCOPE")]
    pub kafka_oidc_scope: Option<String>,
}

/// `outbox dispatch`.
#[derive(Debug, Args)]
pub struct DispatchArgs {
    /// Kafka connection.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Owner prefix of the claims; worker i claims as NAME-i [default: dispatcher-HOSTNAME-PID].
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Concurrent workers, 1..=64 [default: 2].
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
    /// Events per claim, 1..=10000 [default: 500].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Claim lease; a batch outliving half of it renews it [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub lease_ms: Option<i64>,
    /// Fallback poll interval when no NOTIFY arrives [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub poll_interval_ms: Option<u64>,
    /// Interval of the expired-lease sweep [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub sweep_interval_ms: Option<u64>,
    /// Scan every ordering key's head at least every N claims of a worker;
    /// between scans it claims the next events of the keys it just
    /// published. 1 scans on every claim (strict oldest-first) [default: 4].
    #[arg(long, value_name = "N")]
    pub head_scan_every: Option<u32>,
    /// How long shutdown waits for outstanding broker answers [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub shutdown_grace_ms: Option<u64>,
    /// How long a batch keeps recording broker answers through retryable
    /// database errors (lost connection, failover), 0..=10m [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub record_retry_ms: Option<u64>,
    /// Do not LISTEN for `outbox_pending` notifications; poll only.
    #[arg(long)]
    pub no_listen: bool,
    /// Serve Prometheus metrics on HOST:PORT at /metrics, and the health checks at /healthz and /readyz (see outbox-cli/METRICS.md).
    #[arg(long, env = "OUTBOX_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// When the Kafka producer cannot deliver (fatal error, or no acknowledgement for --kafka-producer-stall-ms while the cluster answers), stop and exit 4 instead of rebuilding the producer (for supervisors that restart the service).
    #[arg(long)]
    pub exit_on_fatal: bool,
    /// Print the effective configuration (after flags, environment and file) as TOML, secrets masked, and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// `outbox reconcile`.
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// Kafka connection (the cluster the events are frozen for).
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Run one round, print the report, and exit.
    #[arg(long)]
    pub once: bool,
    /// Pause between rounds in the loop [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms)]
    pub interval_ms: Option<u64>,
    /// Claim owner name of the reconciler [default: reconciler-HOSTNAME-PID].
    #[arg(long, value_name = "NAME")]
    pub owner: Option<String>,
    /// UNKNOWN events resolved per round [default: 100].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Lease of a RECONCILING claim [default: 1m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub lease_ms: Option<i64>,
    /// Never re-send a proven-absent event (it stays DISPATCH_UNKNOWN and pages) [default: re-send to the same frozen destination].
    #[arg(long)]
    pub no_retry: bool,
    /// Most attempts per event that may have been delivered (NOT_SENT ones do not count); beyond it the event stays UNKNOWN [default: 10].
    #[arg(long, value_name = "N")]
    pub max_attempts: Option<u32>,
    /// How long an attempt may still be in flight inside the client, from the later of its registration and its lease's end; no absence proof covers a younger one. At least the adapter's in-flight time + 2000 [default: 65s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub in_flight_bound_ms: Option<i64>,
    /// Delay before an unresolved UNKNOWN is looked at again [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub recheck_ms: Option<i64>,
    /// A PENDING event older than this is an `aged_pending` finding [default: 1m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub aged_pending_ms: Option<i64>,
    /// A PUBLISHED event a critical consumer has not passed after this long is `unconsumed_published` [default: 5m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub unconsumed_after_ms: Option<i64>,
    /// An UNKNOWN older than this is `unknown_past_slo`; also the report's SLO [default: the SLO the reconciler recorded, else 15m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub unknown_slo_ms: Option<i64>,
    /// Most messages the bypass-publish check reads per partition per round [default: 10000].
    #[arg(long, value_name = "N")]
    pub bypass_scan_max_messages: Option<u64>,
    /// Source identity of another outbox declared to write these topics too
    /// (repeat, or comma-separated in the environment); its messages are not
    /// `foreign_source` findings [default: none].
    #[arg(long = "declared-source", env = "OUTBOX_RECONCILE_DECLARED_SOURCES", value_delimiter = ',', value_name = "SOURCE")]
    pub declared_sources: Vec<String>,
    /// The compacted topic consumers publish their watermarks to (on the cluster of --kafka-bootstrap), read and applied each round [default: outbox.watermarks].
    #[arg(long, value_name = "TOPIC")]
    pub watermark_topic: Option<String>,
    /// Do not read the watermark topic (consumers copy their watermarks into the outbox database themselves).
    #[arg(long)]
    pub no_watermark_topic: bool,
    /// A consumer whose watermark records are applied unsigned, an explicit
    /// opt-out of verification (repeat, or comma-separated in the
    /// environment; replaces the file's `watermark_unsigned`). Records of a
    /// declared consumer with no key in OUTBOX_RECONCILE_WATERMARK_KEYS that
    /// is not named here are refused [default: none].
    #[arg(long = "watermark-unsigned", env = "OUTBOX_RECONCILE_WATERMARK_UNSIGNED", value_delimiter = ',', value_name = "CONSUMER")]
    pub watermark_unsigned: Vec<String>,
    /// A declared consumer whose watermark records stopped arriving this long ago is `stale_watermark` [default: 60000].
    #[arg(long, value_name = "MS")]
    pub stale_watermark_after_ms: Option<i64>,
    /// Serve Prometheus metrics on HOST:PORT at /metrics, and the health checks at /healthz and /readyz (see outbox-cli/METRICS.md).
    #[arg(long, env = "OUTBOX_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// When the Kafka producer cannot deliver, stop and exit 4 instead of rebuilding it (see `outbox dispatch --help`).
    #[arg(long)]
    pub exit_on_fatal: bool,
    /// With --once: exit 2 when findings are open (for cron jobs and CI).
    #[arg(long)]
    pub fail_on_findings: bool,
    /// With --once: print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Print the effective configuration as TOML, secrets masked, and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// `outbox status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// A last reconciler round older than this (or three of its intervals) is a `reconciler_stale` finding [default: 5m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub reconciler_stale_ms: Option<i64>,
    /// Exit 2 when findings are open (a stale reconciler included).
    #[arg(long)]
    pub fail_on_findings: bool,
}

/// `outbox trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// The event, e.g. evt-01J....
    #[arg(value_name = "EVENT_ID")]
    pub event_id: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The consumers' database (repeatable), where their receipts live when it is not the outbox database.
    #[arg(long = "consumer-database-url", env = "OUTBOX_CONSUMER_DATABASE_URL", hide_env_values = true, value_name = "URL", value_delimiter = ' ')]
    pub consumer_database_urls: Vec<String>,
}

/// `outbox report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Also write a self-contained HTML report (inline SVG charts, no network) to FILE.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The UNKNOWN SLO the p99 is held to [default: 900000 = 15 min].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub unknown_slo_ms: Option<i64>,
    /// Most findings listed [default: 1000].
    #[arg(long, value_name = "N")]
    pub max_findings: Option<i64>,
    /// Most state snapshots in the history chart [default: 200].
    #[arg(long, value_name = "N")]
    pub max_history: Option<i64>,
    /// A last reconciler round older than this (or three of its intervals) is a `reconciler_stale` finding [default: 5m].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub reconciler_stale_ms: Option<i64>,
    /// Exit 2 when findings are open.
    #[arg(long)]
    pub fail_on_findings: bool,
}

/// `outbox purge`.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Actually retain and purge; without it, a dry run that writes nothing.
    #[arg(long)]
    pub execute: bool,
    /// The maximum replay window: nothing published more recently is touched [default: 7d].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub replay_window_ms: Option<i64>,
    /// Rows per statement, 1..=10000 [default: 1000].
    #[arg(long, value_name = "N")]
    pub batch_size: Option<i64>,
    /// Most batches per phase in this run (bounds the run's work) [default: 100].
    #[arg(long, value_name = "N")]
    pub max_batches: Option<u32>,
}

/// The two dispatch paths, as `outbox dispatch-path --set` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PathArg {
    /// Each event a row of outbox_events, claimed through its key chain's head.
    Chains,
    /// Each event an insert-only row of outbox_stream, dispatched in batches per key bucket.
    Stream,
}

/// `outbox dispatch-path`.
#[derive(Debug, Args)]
pub struct DispatchPathArgs {
    /// Switch to this path (events emitted after the switch take it).
    #[arg(long, value_enum, value_name = "PATH")]
    pub set: Option<PathArg>,
}

/// The aggregate-heads settings, as `outbox aggregate-heads --set` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeadsArg {
    /// Emits at REPEATABLE READ or SERIALIZABLE write head rows.
    SnapshotIsolation,
    /// Every emit writes head rows.
    Always,
}

/// `outbox aggregate-heads`.
#[derive(Debug, Args)]
pub struct AggregateHeadsArgs {
    /// Switch to this setting (emits that start after the switch follow it).
    #[arg(long, value_enum, value_name = "WHICH")]
    pub set: Option<HeadsArg>,
}

/// `outbox skip`.
#[derive(Debug, Args)]
pub struct SkipArgs {
    /// The event to skip, e.g. evt-01J....
    #[arg(value_name = "EVENT_ID")]
    pub event_id: String,
    /// Who skips it (recorded as the audit row's actor), e.g. your login.
    #[arg(long, value_name = "NAME")]
    pub operator: String,
    /// Why (recorded; at most 1000 bytes), e.g. the ticket and what consumers were told.
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
    /// Print the outcome as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `outbox migrate-destination`: a PENDING event, a proven-absent
/// DISPATCH_UNKNOWN one, or a QUARANTINED one stopped before any send
/// (re-sent under a new envelope generation, to the same destination
/// allowed).
#[derive(Debug, Args)]
pub struct MigrateDestinationArgs {
    /// The event to move.
    #[arg(value_name = "EVENT_ID")]
    pub event_id: String,
    /// Who asks (recorded in the migration receipt), e.g. your login.
    #[arg(long, value_name = "NAME")]
    pub operator: String,
    /// New cluster id [default: the event type's current route policy].
    #[arg(long, value_name = "CLUSTER_ID")]
    pub to_cluster: Option<String>,
    /// New topic [default: the event type's current route policy].
    #[arg(long, value_name = "TOPIC")]
    pub to_topic: Option<String>,
    /// Partition count of the new topic [default: the event type's current route policy].
    #[arg(long, value_name = "N")]
    pub to_partitions: Option<u32>,
    /// How long an attempt may still be in flight inside the client, from the later of its registration and its lease's end; no absence proof covers a younger one. At least the adapter's in-flight time + 2000 [default: 65s].
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_ms_i64)]
    pub in_flight_bound_ms: Option<i64>,
    /// Run the same eligibility check as the move (it asks the old target) and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Kafka connection to the event's current (old) cluster, asked whether it holds the event.
    #[command(flatten)]
    pub kafka: KafkaArgs,
}
