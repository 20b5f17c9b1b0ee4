//! The examples' HMAC keys: never written in the source.
//!
//! Each key is read from an environment variable (hex, 32..=128 digits) or,
//! when the variable is not set, made of 32 random bytes for the run. The
//! secret is never printed: `Debug` and [`ExampleKey::describe`] show the key
//! id and where the secret came from, nothing else.
//!
//! * [`SIGNING_SECRET_ENV`]: the dispatcher's message signing key, which
//!   consumers verify (`DispatcherConfig::signing`, `TrustPolicy::with_key`);
//! * [`WATERMARK_SECRET_ENV`]: a consumer's watermark signing key, which the
//!   watermark topic's reader verifies (`ConsumerConfig::watermark_signing_key`,
//!   `WatermarkTopicConfig::with_key`).
//!
//! In a service the secrets come from its secret store: the dispatcher reads
//! `OUTBOX_DISPATCH_SIGNING_KEY_ID` / `OUTBOX_DISPATCH_SIGNING_SECRET_HEX`,
//! the consumer `OUTBOX_CONSUMER_VERIFY_KEYS` and
//! `OUTBOX_CONSUMER_WATERMARK_SIGNING_*`, the reconciler
//! `OUTBOX_RECONCILE_WATERMARK_KEYS`.

use anyhow::Context;
use outbox_core::trust::SigningKey;
use outbox_producer::SigningConfig;
use rand::RngCore;

/// The examples' message signing secret (hex); generated when not set.
pub const SIGNING_SECRET_ENV: &str = "OUTBOX_EXAMPLE_SIGNING_SECRET_HEX";
/// The examples' watermark signing secret (hex); generated when not set.
pub const WATERMARK_SECRET_ENV: &str = "OUTBOX_EXAMPLE_WATERMARK_SECRET_HEX";

/// A key id with its secret. `Debug` never shows the secret.
#[derive(Clone)]
pub struct ExampleKey {
    key_id: String,
    secret_hex: String,
    from_env: Option<&'static str>,
}

impl std::fmt::Debug for ExampleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExampleKey").field("key_id", &self.key_id).field("secret_hex", &"***").field("from_env", &self.from_env).finish()
    }
}

impl ExampleKey {
    /// Key `key_id` with the secret of `env` when set (checked: hex, 16..=64
    /// bytes; an error names the variable, never its value), else 32 random
    /// bytes from the operating system.
    pub fn from_env_or_random(key_id: &str, env: &'static str) -> anyhow::Result<Self> {
        let (secret_hex, from_env) = match std::env::var(env).ok().filter(|v| !v.trim().is_empty()) {
            Some(v) => (v.trim().to_owned(), Some(env)),
            None => (random_secret_hex(), None),
        };
        let key = ExampleKey { key_id: key_id.to_owned(), secret_hex, from_env };
        key.signing_key().with_context(|| format!("{env}: not a usable secret (32..=128 hex digits)"))?;
        Ok(key)
    }

    /// Key `key_id` with 32 random bytes from the operating system, whatever
    /// the environment says.
    pub fn random(key_id: &str) -> anyhow::Result<Self> {
        let key = ExampleKey { key_id: key_id.to_owned(), secret_hex: random_secret_hex(), from_env: None };
        key.signing_key()?;
        Ok(key)
    }

    /// The key id (written in every signed message or record; not secret).
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The key, to sign or verify with.
    pub fn signing_key(&self) -> anyhow::Result<SigningKey> {
        Ok(SigningKey::from_hex(&self.key_id, &self.secret_hex)?)
    }

    /// The dispatcher's form of the key (`DispatcherConfig::signing`).
    pub fn signing_config(&self) -> SigningConfig {
        SigningConfig { key_id: self.key_id.clone(), secret_hex: self.secret_hex.clone() }
    }

    /// `key id <id> (secret generated for this run)`, or `(secret from <ENV>)`: no secret.
    pub fn describe(&self) -> String {
        match self.from_env {
            Some(env) => format!("key id {} (secret from {env})", self.key_id),
            None => format!("key id {} (secret generated for this run)", self.key_id),
        }
    }
}

/// 32 random bytes from the operating system, as 64 hex digits.
fn random_secret_hex() -> String {
    let mut secret = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    secret.iter().map(|b| format!("{b:02x}")).collect()
}
