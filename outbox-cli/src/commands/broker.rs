//! The Kafka flags of a command and the connection to the broker, for the
//! commands that need one.

use std::sync::Arc;

use anyhow::Context;
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};

use crate::cli::KafkaArgs;
use crate::config::KafkaFlags;

pub(super) fn kafka_flags(a: &KafkaArgs) -> KafkaFlags {
    KafkaFlags {
        bootstrap: a.kafka_bootstrap.clone(),
        message_timeout_ms: a.kafka_message_timeout_ms,
        request_timeout_ms: a.kafka_request_timeout_ms,
        max_in_flight: a.kafka_max_in_flight,
        lookup_timeout_ms: a.kafka_lookup_timeout_ms,
        producer_stall_ms: a.kafka_producer_stall_ms,
        settings: a.kafka_settings.clone(),
        lookup_settings: a.kafka_lookup_settings.clone(),
        oidc_token_url: a.kafka_oidc_token_url.clone(),
        oidc_client_id: a.kafka_oidc_client_id.clone(),
        oidc_client_secret: a.kafka_oidc_client_secret.clone(),
        oidc_scope: a.kafka_oidc_scope.clone(),
    }
}

pub(super) async fn connect_kafka(k: KafkaConfig) -> anyhow::Result<Arc<KafkaBroker>> {
    let bootstrap = k.bootstrap_servers.clone();
    let b = KafkaBroker::connect(k).await.with_context(|| format!("connecting to Kafka at {bootstrap}"))?;
    tracing::info!(cluster_id = b.cluster_id(), %bootstrap, "connected to Kafka");
    Ok(Arc::new(b))
}
