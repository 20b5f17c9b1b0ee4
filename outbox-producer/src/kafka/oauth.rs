//! SASL/OAUTHBEARER tokens from a provider the service gives.

use std::sync::Arc;

use rdkafka::client::OAuthToken;
use tracing::{debug, warn};

#[cfg(doc)]
use super::KafkaBroker;

/// A source of SASL/OAUTHBEARER tokens, for clusters that authenticate with
/// short-lived tokens (AWS MSK IAM, an OIDC provider the service talks to
/// itself...). librdkafka asks for a token when a client starts and again
/// before the previous one expires; `sasl.oauthbearer.config` is passed
/// through. Set `security.protocol=SASL_SSL` and
/// `sasl.mechanism=OAUTHBEARER`, and give the provider to
/// [`KafkaBroker::connect_with_token_provider`]. For OIDC client
/// credentials librdkafka can fetch tokens itself instead
/// (`sasl.oauthbearer.method=oidc`, no provider).
pub trait OAuthTokenProvider: Send + Sync + 'static {
    /// A fresh token. An error is reported to librdkafka, which retries.
    fn token(&self, oauthbearer_config: Option<&str>) -> Result<OAuthBearerToken, String>;
}

/// One OAUTHBEARER token.
#[derive(Clone, PartialEq, Eq)]
pub struct OAuthBearerToken {
    /// The token (often a JWT).
    pub token: String,
    /// The Kafka principal it authenticates.
    pub principal_name: String,
    /// When it expires, ms since the Unix epoch.
    pub lifetime_ms: i64,
}

impl std::fmt::Debug for OAuthBearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthBearerToken").field("token", &"***").field("principal_name", &self.principal_name).field("lifetime_ms", &self.lifetime_ms).finish()
    }
}

pub(super) type TokenSource = Option<Arc<dyn OAuthTokenProvider>>;

pub(super) fn oauth_token(tokens: &TokenSource, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
    let Some(p) = tokens else { return Err("no OAUTHBEARER token provider".into()) };
    match p.token(config) {
        Ok(t) => {
            debug!(principal = %t.principal_name, lifetime_ms = t.lifetime_ms, "OAUTHBEARER token provided");
            Ok(OAuthToken { token: t.token, principal_name: t.principal_name, lifetime_ms: t.lifetime_ms })
        }
        Err(e) => {
            warn!(error = %e, "OAUTHBEARER token provider failed");
            Err(e.into())
        }
    }
}
