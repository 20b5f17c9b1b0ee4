//! The adapter's setup errors, and error texts with every secret masked.

use rdkafka::error::KafkaError;

use super::settings::is_secret_setting;
#[cfg(doc)]
use outbox_core::{LookupOutcome, SendOutcome};

/// Errors of the Kafka adapter's setup calls. Sends and lookups never fail
/// with an error: they answer with [`SendOutcome`] and [`LookupOutcome`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaAdapterError {
    /// The configuration is invalid (a limit is zero, a protected setting in `extra`...).
    #[error("kafka adapter configuration: {0}")]
    Config(String),
    /// librdkafka refused to create or use a client. The text never holds
    /// the value of a secret-bearing setting (see [`is_secret_setting`]).
    #[error("kafka client: {0}")]
    Client(String),
    /// After a rebuild the bootstrap servers answer for another cluster:
    /// the events are frozen for the first one, so nothing is sent.
    #[error("the Kafka cluster changed from {expected} to {found}: not sending to it")]
    ClusterChanged {
        /// The cluster id the adapter connected to first.
        expected: String,
        /// The cluster id the bootstrap servers report now.
        found: String,
    },
    /// The cluster did not tell its id within the connect timeout.
    #[error("no cluster id from the Kafka cluster within {timeout_ms} ms{}", last_error.as_deref().map(|e| format!(" (last client error: {e})")).unwrap_or_default())]
    NoClusterId {
        /// The timeout that ran out.
        timeout_ms: u64,
        /// The client's last error meanwhile (a refused connection, a failed
        /// TLS handshake, a failed authentication...), secrets masked.
        last_error: Option<String>,
    },
    /// Topic metadata could not be read or is not usable.
    #[error("kafka metadata: {0}")]
    Metadata(String),
    /// A blocking task of the adapter failed.
    #[error("kafka adapter task: {0}")]
    Task(String),
}

impl From<KafkaError> for KafkaAdapterError {
    fn from(e: KafkaError) -> Self {
        KafkaAdapterError::Client(describe_kafka_error(&e, &[]))
    }
}

/// `e` as text with no secret in it: a configuration error names the
/// setting and says what is wrong, shows the value only for a setting that
/// carries no secret, and every value of `settings` whose key is
/// secret-bearing is replaced by `***` wherever it appears.
pub fn describe_kafka_error(e: &KafkaError, settings: &[(String, String)]) -> String {
    let text = match e {
        KafkaError::ClientConfig(_, desc, key, value) if is_secret_setting(key) => {
            format!("setting {key}: {}", redact_text(desc, &[(key.clone(), value.clone())]))
        }
        KafkaError::ClientConfig(_, desc, key, value) => format!("setting {key} = {value:?}: {desc}"),
        other => other.to_string(),
    };
    redact_text(&text, settings)
}

/// `text` with the value of every secret-bearing setting of `settings` replaced by `***`.
pub fn redact_text(text: &str, settings: &[(String, String)]) -> String {
    let mut out = text.to_owned();
    for (k, v) in settings {
        if is_secret_setting(k) && !v.is_empty() {
            out = out.replace(v.as_str(), "***");
        }
    }
    out
}

impl KafkaAdapterError {
    /// Whether the same call may succeed if retried (the cluster may be
    /// unreachable for now).
    pub fn is_retryable(&self) -> bool {
        matches!(self, KafkaAdapterError::NoClusterId { .. } | KafkaAdapterError::Metadata(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kafka::{KafkaBroker, KafkaConfig, OAuthBearerToken};

    #[test]
    fn secrets_never_appear_in_debug_or_errors() {
        let c = KafkaConfig::new("b:1")
            .with_setting("sasl.password", "Planted_Pw_1")
            .with_setting("ssl.key.password", "SslKeyPw_55")
            .with_setting("sasl.oauthbearer.config", "principal=x secret=Planted_Cfg_2")
            .with_setting("sasl.oauthbearer.client.secret", "Planted_Client_3")
            .with_setting("sasl.username", "svc-orders");
        let debug = format!("{c:?}");
        for planted in ["Planted_Pw_1", "SslKeyPw_55", "Planted_Cfg_2", "Planted_Client_3"] {
            assert!(!debug.contains(planted), "{debug}");
        }
        assert!(debug.contains("svc-orders"), "non-secret values are shown: {debug}");
        let e = KafkaError::ClientConfig(rdkafka_sys::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID, "Invalid value SslKeyPw_55".into(), "ssl.key.password".into(), "SslKeyPw_55".into());
        assert!(e.to_string().contains("SslKeyPw_55"), "librdkafka's own text echoes the value");
        let text = describe_kafka_error(&e, &c.extra);
        assert!(!text.contains("SslKeyPw_55") && text.contains("ssl.key.password"), "{text}");
        let e = KafkaError::ClientCreation("sasl.password Planted_Pw_1 rejected".into());
        assert!(!describe_kafka_error(&e, &c.extra).contains("Planted_Pw_1"));
        let e = KafkaError::ClientConfig(rdkafka_sys::types::RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, "No such configuration property".into(), "lingr.ms".into(), "5".into());
        assert!(describe_kafka_error(&e, &[]).contains("lingr.ms = \"5\""), "a non-secret value is shown");
        assert!(format!("{:?}", OAuthBearerToken { token: "Planted_Tok".into(), principal_name: "p".into(), lifetime_ms: 1 }).contains("***"));
    }

    #[tokio::test]
    async fn a_real_client_config_error_does_not_echo_the_secret() {
        let mut c = KafkaConfig::new("127.0.0.1:1").with_setting("security.protocol", "SSL").with_setting("ssl.key.password", "SslKeyPw_55").with_setting("ssl.key.pem", "SslKeyPem_66");
        c.connect_timeout_ms = 500;
        let err = KafkaBroker::connect(c.clone()).await.expect_err("invalid key").to_string();
        eprintln!("{err}");
        assert!(!err.contains("SslKeyPw_55") && !err.contains("SslKeyPem_66"), "{err}");
        c.extra.push(("sasl.mechanism".into(), "SslKeyPw_55".into()));
        c.extra.push(("security.protocol".into(), "SASL_SSL".into()));
        let err = KafkaBroker::connect(c).await.expect_err("invalid mechanism").to_string();
        eprintln!("{err}");
        assert!(!err.contains("SslKeyPw_55"), "{err}");
    }
}
