//! `outbox status` and `outbox report` show consumer quarantines and dead
//! letters per consumer; `--print-config` never shows the signing secret.

mod common;

use common::{outbox_bin, Env};
use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError, Processor, RawMessage, TrustPolicy};
use outbox_core::{headers, AttemptId, EmitRequest, EventId, RoutePolicy};
use serde_json::Value;
use sqlx::{Postgres, Transaction};

struct Refuse;

#[async_trait]
impl Handler for Refuse {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, _e: &ConsumedEvent) -> Result<Value, HandlerError> {
        Err(HandlerError::permanent("cannot ever apply"))
    }
}

fn message(order: &str, source: &str) -> RawMessage {
    let payload = format!("{{\"order\":\"{order}\"}}").into_bytes();
    let req = EmitRequest { command_key: order, tenant: "t", aggregate_type: "order", aggregate_id: order, aggregate_version: 1, event_type: "order.created", payload_schema: "s", payload: &payload };
    let now = 1_800_000_000_000;
    let (e, d) = req.freeze(EventId::generate(now), now as i64, 1, &RoutePolicy::new("order.created", "kafka-a", "orders", 1)).unwrap();
    let mut hs = headers::build(&e, &d, &d.digest(), &AttemptId::generate(now), None);
    outbox_core::trust::seal(&mut hs, source, None).unwrap();
    RawMessage { topic: "orders".into(), partition: 0, offset: 0, key: Some(d.routing_key.into_bytes()), payload: Some(payload), headers: hs, non_utf8_header_names: Vec::new(), log_id: None }
}

#[tokio::test]
async fn status_and_report_show_quarantines_and_dead_letters_per_consumer() {
    let env = Env::new("cli_trust").await;
    env.ok(&["migrate"]);
    let mine: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(env.pool()).await.unwrap();
    sqlx::query("INSERT INTO outbox_consumers (consumer_id, critical, mandatory, topics) VALUES ('billing', true, true, '{orders}')").execute(env.pool()).await.unwrap();
    let trust = TrustPolicy::default().accept("orders", &[&mine], false);
    let billing = Processor::new("billing", env.pool().clone(), Refuse).unwrap().with_cluster_id("kafka-a").with_trust(trust).unwrap();
    let mut foreign = message("o-foreign", "urn:uuid:99999999-9999-4999-8999-999999999999");
    foreign.offset = 0;
    let mut own = message("o-own", &mine);
    own.offset = 1;
    let outs = billing.process_batch(&[foreign, own]).await.unwrap();
    assert_eq!(outs.iter().map(|o| o.kind()).collect::<Vec<_>>(), vec!["quarantined", "dead_lettered"]);

    let status = env.ok(&["status"]);
    assert!(status.contains("quarantined 1 (verify:source_unknown=1) dead-lettered 1"), "{status}");
    let json: Value = serde_json::from_str(&env.ok(&["status", "--json"])).unwrap();
    let d = &json["consumerDecisions"][0];
    assert_eq!((d["consumerId"].as_str(), d["quarantined"].as_i64(), d["deadLettered"].as_i64()), (Some("billing"), Some(1), Some(1)), "{json}");
    let report = env.ok(&["report"]);
    assert!(report.contains("consumer billing quarantined 1 (verify:source_unknown=1) dead-lettered 1"), "{report}");
    assert!(!report.contains("EVERY MESSAGE QUARANTINED"), "one event was verified (and dead-lettered): {report}");
    env.drop_now().await;
}

#[test]
fn print_config_masks_the_signing_secret() {
    let secret = "5eb63bbbe01eeed093cb22bb8f5acdc35eb63bbbe01eeed093cb22bb8f5acdc3";
    let run = |envs: &[(&str, &str)]| {
        let mut c = outbox_bin();
        c.args(["dispatch", "--print-config", "--kafka-bootstrap", "b:9092"]);
        for (k, v) in envs {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let out = run(&[("OUTBOX_DISPATCH_SIGNING_KEY_ID", "k-2026-12"), ("OUTBOX_DISPATCH_SIGNING_SECRET_HEX", secret)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let parsed: toml::Value = toml::from_str(&stdout).unwrap_or_else(|e| panic!("print-config is TOML: {e}\n{stdout}"));
    assert_eq!(parsed["dispatch"]["signing"]["key_id"].as_str(), Some("k-2026-12"), "{stdout}");
    assert_eq!(parsed["dispatch"]["signing"]["secret_hex"].as_str(), Some("***"), "{stdout}");
    assert!(!stdout.contains(secret) && !stdout.contains(&secret[..16]), "{stdout}");
    let off: toml::Value = toml::from_str(&String::from_utf8_lossy(&run(&[]).stdout)).unwrap();
    assert!(off["dispatch"].get("signing").is_none(), "no signing table without a key");
    let half = run(&[("OUTBOX_DISPATCH_SIGNING_KEY_ID", "k-2026-12")]);
    assert_eq!(half.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&half.stderr).contains("OUTBOX_DISPATCH_SIGNING_SECRET_HEX"));
    let bad = run(&[("OUTBOX_DISPATCH_SIGNING_KEY_ID", "k"), ("OUTBOX_DISPATCH_SIGNING_SECRET_HEX", "not-hex")]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(!String::from_utf8_lossy(&bad.stderr).contains("not-hex"), "the secret is not echoed in the error");
}

#[test]
fn declared_sources_come_from_flags_environment_or_file() {
    let dir = std::env::temp_dir().join(format!("outbox-cli-trust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("outbox.toml");
    std::fs::write(&file, "[reconcile]\ndeclared_sources = [\"urn:file\"]\n").unwrap();
    let run = |envs: &[(&str, &str)], flags: &[&str]| {
        let mut c = outbox_bin();
        c.args(["reconcile", "--print-config", "--kafka-bootstrap", "b:9092", "--config"]).arg(&file).args(flags);
        for (k, v) in envs {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(run(&[], &[]).contains("\"urn:file\""));
    let env = run(&[("OUTBOX_RECONCILE_DECLARED_SOURCES", "urn:a,urn:b")], &[]);
    assert!(env.contains("\"urn:a\"") && env.contains("\"urn:b\"") && !env.contains("urn:file"), "{env}");
    let flag = run(&[("OUTBOX_RECONCILE_DECLARED_SOURCES", "urn:a")], &["--declared-source", "urn:flag"]);
    assert!(flag.contains("\"urn:flag\"") && !flag.contains("\"urn:a\""), "{flag}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_file_takes_a_signing_key_and_declared_sources() {
    let f = outbox_cli::config::FileConfig::parse(
        "[dispatch.signing]\nkey_id = \"k-2026-12\"\nsecret_hex = \"000102030405060708090a0b0c0d0e0f\"\n[reconcile]\ndeclared_sources = [\"urn:uuid:x\"]\n",
    )
    .unwrap();
    let s = f.dispatch.as_ref().unwrap().signing.as_ref().unwrap();
    assert_eq!(s.key_id, "k-2026-12");
    assert!(s.key().is_ok());
    assert_eq!(f.reconcile.declared_sources.as_deref(), Some(&["urn:uuid:x".to_owned()][..]));
    assert!(outbox_cli::config::FileConfig::parse("[dispatch.signing]\nkey_id = \"k\"\nsecret = \"x\"\n").is_err(), "unknown keys refused");
    let short = outbox_cli::config::FileConfig::parse("[dispatch.signing]\nkey_id = \"k\"\nsecret_hex = \"00\"\n").unwrap();
    assert!(short.dispatch.unwrap().validate().is_err(), "a one-byte secret is refused");
}
