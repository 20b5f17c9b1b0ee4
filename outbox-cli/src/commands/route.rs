//! `outbox route`: setting, showing and listing route policies.

use anyhow::bail;

use super::broker::{connect_kafka, kafka_flags};
use super::db::connect;
use crate::cli::KafkaArgs;
use crate::config::{self, FileConfig};

pub(super) async fn route_cmd(url: &str, file: &FileConfig, c: &crate::cli::RouteCommand) -> anyhow::Result<u8> {
    use crate::cli::RouteCommand as R;
    let pool = connect(url, 2).await?;
    let optional_kafka = |k: &KafkaArgs| {
        let flags = kafka_flags(k);
        if flags.bootstrap.is_none() && file.kafka.bootstrap.is_none() {
            Ok(None)
        } else {
            config::kafka_config(&flags, &file.kafka).map(Some)
        }
    };
    match c {
        R::Set(a) => {
            let broker = if a.no_check { None } else {
                match optional_kafka(&a.kafka)? {
                    Some(k) => Some(connect_kafka(k).await?),
                    None => bail!("checking the partition count needs a Kafka connection (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP); or pass --no-check with --cluster-id"),
                }
            };
            crate::runbook::route_set(&pool, broker.as_deref(), a).await
        }
        R::Show { event_type, json, kafka } => {
            let broker = match optional_kafka(kafka)? {
                Some(k) => Some(connect_kafka(k).await?),
                None => None,
            };
            crate::runbook::route_show(&pool, broker.as_deref(), event_type, *json).await
        }
        R::List { json } => crate::runbook::route_list(&pool, *json).await,
    }
}
