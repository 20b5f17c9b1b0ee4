//! The one way keys are written.
//!
//! **In the file** a key is always a table `{ key_id = "…", secret_hex = "…" }`
//! (`[dispatch.signing]`, `[consumer.<id>.watermark_signing]`), and the keys
//! of several owners are a table from owner to an array of keys:
//! `[consumer.<id>.keys]` (owner: a source identity) and
//! `[reconcile.watermark_keys]` (owner: a consumer id).
//!
//! **In the environment** a single key is two variables, `<PREFIX>_KEY_ID`
//! and `<PREFIX>_SECRET_HEX` (both or neither), and the keys of several
//! owners are one variable of space-separated `OWNER=KEY_ID=HEX` entries
//! (`OUTBOX_CONSUMER_VERIFY_KEYS`, `OUTBOX_RECONCILE_WATERMARK_KEYS`).
//!
//! The former file form of `[reconcile] watermark_keys`, an array of
//! `"CONSUMER_ID=KEY_ID=HEX"` strings, is still read, with a deprecation
//! warning ([`crate::Config::warnings`]).

use std::collections::BTreeMap;

use outbox_core::trust::SigningKey;
use serde::Deserialize;

use crate::error::ConfigError;

/// Most keys one owner may have in a key list (a rotation needs two).
pub const MAX_KEYS_PER_OWNER: usize = 16;
/// Most owners in one key list.
pub const MAX_KEY_OWNERS: usize = 1_000;

/// One key: its id and its secret, hex (16..=64 bytes). `Debug` shows the
/// key id only.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// The id verifiers look the key up by.
    pub key_id: String,
    /// The secret, hex.
    pub secret_hex: String,
}

impl std::fmt::Debug for KeySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySpec").field("key_id", &self.key_id).field("secret_hex", &"***").finish()
    }
}

impl KeySpec {
    /// The key, checked; an error names `setting` and the key id, never the secret.
    pub fn key(&self, setting: &str) -> Result<SigningKey, ConfigError> {
        SigningKey::from_hex(self.key_id.trim(), self.secret_hex.trim()).map_err(|e| ConfigError::new(setting, format!("key id {:?}: {e}", self.key_id)))
    }
}

/// Keys per owner as written in the file: the table form, or the former
/// array of `OWNER=KEY_ID=HEX` strings (read with a deprecation warning).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum KeyList {
    /// `{ OWNER = [{ key_id = "…", secret_hex = "…" }, …], … }`.
    ByOwner(BTreeMap<String, Vec<KeySpec>>),
    /// Deprecated: `["OWNER=KEY_ID=HEX", …]`.
    Legacy(Vec<String>),
}

impl Default for KeyList {
    fn default() -> Self {
        KeyList::ByOwner(BTreeMap::new())
    }
}

impl std::fmt::Debug for KeyList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyList::ByOwner(m) => f.debug_tuple("ByOwner").field(m).finish(),
            KeyList::Legacy(v) => {
                let shown: Vec<String> = v.iter().map(|e| e.rsplit_once('=').map(|(head, _)| format!("{head}=***")).unwrap_or_else(|| "***".into())).collect();
                f.debug_tuple("Legacy").field(&shown).finish()
            }
        }
    }
}

impl KeyList {
    /// The table form; the legacy strings are split (`setting` names them in errors).
    pub fn by_owner(&self, setting: &str) -> Result<BTreeMap<String, Vec<KeySpec>>, ConfigError> {
        match self {
            KeyList::ByOwner(m) => Ok(m.clone()),
            KeyList::Legacy(entries) => parse_owned_entries(setting, entries.iter().map(String::as_str)),
        }
    }

    /// Whether this is the deprecated form.
    pub fn is_legacy(&self) -> bool {
        matches!(self, KeyList::Legacy(v) if !v.is_empty())
    }
}

/// Splits `OWNER=KEY_ID=HEX` entries (the owner may hold `=`; the key id and
/// the hex do not). Errors name the entry's number, never its text.
pub fn parse_owned_entries<'a>(setting: &str, entries: impl IntoIterator<Item = &'a str>) -> Result<BTreeMap<String, Vec<KeySpec>>, ConfigError> {
    let mut out: BTreeMap<String, Vec<KeySpec>> = BTreeMap::new();
    for (i, entry) in entries.into_iter().enumerate() {
        let bad = || ConfigError::new(setting, format!("entry {} is not OWNER=KEY_ID=HEX", i + 1));
        let mut parts = entry.trim().rsplitn(3, '=');
        let (hex, key_id, owner) = (parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?);
        if owner.trim().is_empty() || key_id.trim().is_empty() {
            return Err(bad());
        }
        out.entry(owner.trim().to_owned()).or_default().push(KeySpec { key_id: key_id.trim().to_owned(), secret_hex: hex.trim().to_owned() });
    }
    Ok(out)
}

/// Checks a key list and makes its keys: at most [`MAX_KEY_OWNERS`]
/// owners, 1..=[`MAX_KEYS_PER_OWNER`] keys each, no key id twice per owner.
pub fn resolve(setting: &str, list: &BTreeMap<String, Vec<KeySpec>>) -> Result<BTreeMap<String, Vec<SigningKey>>, ConfigError> {
    if list.len() > MAX_KEY_OWNERS {
        return Err(ConfigError::new(setting, format!("{} owners (..={MAX_KEY_OWNERS})", list.len())));
    }
    let mut out = BTreeMap::new();
    for (owner, keys) in list {
        let at = format!("{setting}.{}", quote_key(owner));
        if keys.is_empty() || keys.len() > MAX_KEYS_PER_OWNER {
            return Err(ConfigError::new(at, format!("{} keys (1..={MAX_KEYS_PER_OWNER})", keys.len())));
        }
        let mut made: Vec<SigningKey> = Vec::with_capacity(keys.len());
        for k in keys {
            let key = k.key(&at)?;
            if made.iter().any(|m| m.key_id() == key.key_id()) {
                return Err(ConfigError::new(at, format!("key id {:?} given twice", key.key_id())));
            }
            made.push(key);
        }
        out.insert(owner.clone(), made);
    }
    Ok(out)
}

/// `owner` as a TOML key in a setting's path: bare when it can be.
pub(crate) fn quote_key(owner: &str) -> String {
    if !owner.is_empty() && owner.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        owner.to_owned()
    } else {
        format!("{owner:?}")
    }
}
