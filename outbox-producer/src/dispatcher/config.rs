//! [`DispatcherConfig`]: the settings, their defaults and limits, where
//! they are read from; the owner names claims are made under.

use outbox_core::claim::{MAX_CLAIM_BATCH, MAX_LEASE_MS, MIN_LEASE_MS};
use serde::Deserialize;

use crate::error::ProducerError;
#[cfg(doc)]
use crate::pg::PgStore;

/// Default number of concurrent workers.
pub const DEFAULT_WORKERS: usize = 2;
/// Default claim batch size.
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Default lease, ms.
pub const DEFAULT_LEASE_MS: i64 = 30_000;
/// Default fallback poll interval when no notification arrives, ms.
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 1_000;
/// Default lease sweep interval, ms.
pub const DEFAULT_SWEEP_INTERVAL_MS: u64 = 1_000;
/// Default time shutdown waits for outstanding broker answers, ms.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 30_000;
/// Default of [`DispatcherConfig::record_retry_ms`].
pub const DEFAULT_RECORD_RETRY_MS: u64 = 30_000;
/// Largest [`DispatcherConfig::record_retry_ms`].
pub const MAX_RECORD_RETRY_MS: u64 = 600_000;
/// Most workers one dispatcher runs.
pub const MAX_WORKERS: usize = 64;
/// Default of [`DispatcherConfig::head_scan_every`].
pub const DEFAULT_HEAD_SCAN_EVERY: u32 = 4;
/// Largest [`DispatcherConfig::head_scan_every`].
pub const MAX_HEAD_SCAN_EVERY: u32 = 64;
/// This build's implementation name, the default of [`DispatcherConfig::implementation`].
pub const IMPLEMENTATION: &str = concat!("outbox-rs/", env!("CARGO_PKG_VERSION"));

/// Dispatcher settings. Precedence: defaults, then a TOML file, then
/// `OUTBOX_DISPATCH_*` environment variables, then explicit code.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DispatcherConfig {
    /// Owner prefix; worker `i` claims as `<name>-<i>`.
    pub name: String,
    /// Concurrent workers (1..=64).
    pub workers: usize,
    /// Events per claim (1..=10000).
    pub batch_size: usize,
    /// Claim lease, ms; a batch outliving half of it renews it.
    pub lease_ms: i64,
    /// Fallback poll interval, ms, when LISTEN/NOTIFY is quiet or off. A
    /// worker waits (for a notification or this long) only after a claim
    /// that found nothing or a batch the broker did not take; otherwise it
    /// claims again at once.
    pub poll_interval_ms: u64,
    /// Lease sweep interval, ms.
    pub sweep_interval_ms: u64,
    /// A worker claims the next events of the keys it has just published
    /// ([`PgStore::claim_successors`], one index probe per key) and scans
    /// every ordering key's head ([`OutboxStore::claim_batch`](outbox_core::OutboxStore::claim_batch)) instead on
    /// its first claim and whenever `head_scan_every - 1` claims went by
    /// without a scan; a claim whose successors do not fill the batch is
    /// topped up from every key's head. A key no
    /// worker has in hand waits at most `head_scan_every - 1` more batches
    /// of a worker than it would under a scan on every claim (`1`: scan on
    /// every claim, strict oldest-first across keys). 1..=64.
    pub head_scan_every: u32,
    /// How long shutdown waits for outstanding answers, ms.
    pub shutdown_grace_ms: u64,
    /// How long a batch keeps trying to record the broker's answers (the
    /// receipt transaction, not-sent and unknown reports) while PostgreSQL
    /// fails with a retryable error: a lost connection, a restart or
    /// failover, a serialization failure or deadlock. Waits 50 ms, doubling
    /// to 2 s, between tries. Past it the batch fails and its events are
    /// left to their leases (DISPATCH_UNKNOWN, then the reconciler).
    /// 0..=600000; 0 tries once.
    pub record_retry_ms: u64,
    /// Wake on `NOTIFY outbox_pending` (sent by `emit`).
    pub listen: bool,
    /// The dispatcher alias this instance runs under (PROTOCOL §11). With an
    /// alias, it claims only while the alias names its `implementation`
    /// (checked at most every `poll_interval_ms`); otherwise it idles.
    /// Switching the alias is the rollout's only rollback step.
    pub alias: Option<String>,
    /// This instance's implementation name, e.g. `outbox-rs/0.1.0`.
    pub implementation: String,
    /// Message authentication: with a key, every message carries
    /// `outbox-key-id` and `outbox-signature`, an HMAC-SHA256 of its
    /// `outboxClaims.v1` record ([`outbox_core::trust`]). `None`: unsigned
    /// (the source and the claims digest are still written).
    pub signing: Option<SigningConfig>,
}

/// The dispatcher's signing key (`[dispatch.signing]`, or
/// `OUTBOX_DISPATCH_SIGNING_KEY_ID` and `OUTBOX_DISPATCH_SIGNING_SECRET_HEX`).
/// Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SigningConfig {
    /// The key id consumers look the verification key up by, e.g. `2026-12`.
    pub key_id: String,
    /// The secret, hex (16..=64 bytes: 32..=128 hex digits).
    pub secret_hex: String,
}

impl std::fmt::Debug for SigningConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningConfig").field("key_id", &self.key_id).field("secret_hex", &"***").finish()
    }
}

impl SigningConfig {
    /// The key, checked.
    pub fn key(&self) -> Result<outbox_core::trust::SigningKey, ProducerError> {
        outbox_core::trust::SigningKey::from_hex(&self.key_id, &self.secret_hex).map_err(|e| ProducerError::Config(format!("dispatch.signing: {e}")))
    }
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            name: default_owner_name("dispatcher"),
            workers: DEFAULT_WORKERS,
            batch_size: DEFAULT_BATCH_SIZE,
            lease_ms: DEFAULT_LEASE_MS,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
            sweep_interval_ms: DEFAULT_SWEEP_INTERVAL_MS,
            head_scan_every: DEFAULT_HEAD_SCAN_EVERY,
            shutdown_grace_ms: DEFAULT_SHUTDOWN_GRACE_MS,
            record_retry_ms: DEFAULT_RECORD_RETRY_MS,
            listen: true,
            alias: None,
            implementation: IMPLEMENTATION.to_owned(),
            signing: None,
        }
    }
}

/// `<prefix>-<host name>-<pid>`: a claim owner that tells hosts apart (in a
/// container every process is pid 1, the host name is the pod's). The host
/// name is reduced to the characters an identifier may hold.
pub fn default_owner_name(prefix: &str) -> String {
    let host = host_name().unwrap_or_else(|| "host".to_owned());
    let host: String = host.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')).take(100).collect();
    let host = if host.is_empty() { "host".to_owned() } else { host };
    format!("{prefix}-{host}-{}", std::process::id())
}

/// This machine's host name: `HOSTNAME`, else `/proc/sys/kernel/hostname`,
/// else `/etc/hostname`; read once per process (every default config asks).
pub fn host_name() -> Option<String> {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let clean = |s: String| Some(s.trim().to_owned()).filter(|s| !s.is_empty());
        std::env::var("HOSTNAME")
            .ok()
            .and_then(clean)
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().and_then(clean))
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().and_then(clean))
    })
    .clone()
}

fn env_parse<T: std::str::FromStr>(get: &impl Fn(&str) -> Option<String>, key: &str, into: &mut T) -> Result<(), ProducerError> {
    if let Some(v) = get(key) {
        *into = v.trim().parse().map_err(|_| ProducerError::Config(format!("{key}={v:?} is not a valid value")))?;
    }
    Ok(())
}

impl DispatcherConfig {
    /// Reads a TOML file of these fields (unknown keys are an error).
    pub fn from_file(path: &std::path::Path) -> Result<Self, ProducerError> {
        let text = std::fs::read_to_string(path).map_err(|e| ProducerError::Config(format!("{}: {e}", path.display())))?;
        let cfg: DispatcherConfig = toml::from_str(&text).map_err(|e| ProducerError::Config(format!("{}: {e}", path.display())))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies `OUTBOX_DISPATCH_NAME`, `_WORKERS`, `_BATCH_SIZE`, `_LEASE_MS`,
    /// `_POLL_INTERVAL_MS`, `_SWEEP_INTERVAL_MS`, `_HEAD_SCAN_EVERY`,
    /// `_SHUTDOWN_GRACE_MS`, `_RECORD_RETRY_MS`, `_LISTEN`, `_ALIAS`, `_IMPLEMENTATION`,
    /// `_SIGNING_KEY_ID` with `_SIGNING_SECRET_HEX` (both or neither).
    pub fn with_env(self) -> Result<Self, ProducerError> {
        self.with_env_lookup(|k| std::env::var(k).ok())
    }

    /// [`DispatcherConfig::with_env`] over `get` (a variable's value by
    /// name) instead of the process environment.
    pub fn with_env_lookup(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self, ProducerError> {
        env_parse(&get, "OUTBOX_DISPATCH_NAME", &mut self.name)?;
        env_parse(&get, "OUTBOX_DISPATCH_WORKERS", &mut self.workers)?;
        env_parse(&get, "OUTBOX_DISPATCH_BATCH_SIZE", &mut self.batch_size)?;
        env_parse(&get, "OUTBOX_DISPATCH_LEASE_MS", &mut self.lease_ms)?;
        env_parse(&get, "OUTBOX_DISPATCH_POLL_INTERVAL_MS", &mut self.poll_interval_ms)?;
        env_parse(&get, "OUTBOX_DISPATCH_SWEEP_INTERVAL_MS", &mut self.sweep_interval_ms)?;
        env_parse(&get, "OUTBOX_DISPATCH_HEAD_SCAN_EVERY", &mut self.head_scan_every)?;
        env_parse(&get, "OUTBOX_DISPATCH_SHUTDOWN_GRACE_MS", &mut self.shutdown_grace_ms)?;
        env_parse(&get, "OUTBOX_DISPATCH_RECORD_RETRY_MS", &mut self.record_retry_ms)?;
        env_parse(&get, "OUTBOX_DISPATCH_LISTEN", &mut self.listen)?;
        if let Some(a) = get("OUTBOX_DISPATCH_ALIAS") {
            self.alias = Some(a.trim().to_owned()).filter(|a| !a.is_empty());
        }
        env_parse(&get, "OUTBOX_DISPATCH_IMPLEMENTATION", &mut self.implementation)?;
        let key_id = get("OUTBOX_DISPATCH_SIGNING_KEY_ID").filter(|v| !v.trim().is_empty());
        let secret = get("OUTBOX_DISPATCH_SIGNING_SECRET_HEX").filter(|v| !v.trim().is_empty());
        match (key_id, secret) {
            (Some(key_id), Some(secret_hex)) => self.signing = Some(SigningConfig { key_id: key_id.trim().to_owned(), secret_hex }),
            (None, None) => {}
            _ => return Err(ProducerError::Config("set both OUTBOX_DISPATCH_SIGNING_KEY_ID and OUTBOX_DISPATCH_SIGNING_SECRET_HEX, or neither".into())),
        }
        self.validate()?;
        Ok(self)
    }

    /// Checks every limit.
    pub fn validate(&self) -> Result<(), ProducerError> {
        outbox_core::id::validate_identifier("dispatcher name", &self.name)?;
        outbox_core::id::validate_identifier("dispatcher implementation", &self.implementation)?;
        if let Some(alias) = &self.alias {
            outbox_core::id::validate_identifier("dispatcher alias", alias)?;
        }
        let bad = |m: String| Err(ProducerError::Config(m));
        if !(1..=MAX_WORKERS).contains(&self.workers) {
            return bad(format!("workers = {} (1..={MAX_WORKERS})", self.workers));
        }
        if !(1..=MAX_CLAIM_BATCH).contains(&self.batch_size) {
            return bad(format!("batch_size = {} (1..={MAX_CLAIM_BATCH})", self.batch_size));
        }
        if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&self.lease_ms) {
            return bad(format!("lease_ms = {} ({MIN_LEASE_MS}..={MAX_LEASE_MS})", self.lease_ms));
        }
        if !(1..=MAX_HEAD_SCAN_EVERY).contains(&self.head_scan_every) {
            return bad(format!("head_scan_every = {} (1..={MAX_HEAD_SCAN_EVERY})", self.head_scan_every));
        }
        if !(10..=600_000).contains(&self.poll_interval_ms) || !(10..=600_000).contains(&self.sweep_interval_ms) {
            return bad("poll_interval_ms and sweep_interval_ms must be within 10..=600000".into());
        }
        if self.record_retry_ms > MAX_RECORD_RETRY_MS {
            return bad(format!("record_retry_ms = {} (0..={MAX_RECORD_RETRY_MS})", self.record_retry_ms));
        }
        if let Some(s) = &self.signing {
            s.key()?;
        }
        Ok(())
    }

    pub(super) fn owner(&self, worker: usize) -> String {
        format!("{}-{worker}", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_owner_names_the_host() {
        let host = host_name().expect("a host name");
        let name = DispatcherConfig::default().name;
        let expected_host: String = host.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')).collect();
        assert!(name.starts_with(&format!("dispatcher-{expected_host}-")), "{name} should carry the host name {host}");
        assert!(name.ends_with(&format!("-{}", std::process::id())), "{name}");
        outbox_core::id::validate_identifier("dispatcher name", &name).expect("a valid identifier");
        assert!(crate::ReconcilerConfig::default().owner.starts_with(&format!("reconciler-{expected_host}-")));
    }
}
