//! Secrets never leave the process: every output path of `outbox` (stdout,
//! stderr, text and JSON logs, --print-config, configuration errors, Kafka
//! client errors, database errors) is searched for planted secrets. And the
//! edges fail clearly: a refused database in seconds with host and cause,
//! each error text once, non-PostgreSQL URLs refused, a database without the
//! schema answered with "run `outbox migrate`".

mod common;

use std::time::{Duration, Instant};

use common::{free_port, outbox_bin, Env};

const PLANTED: [&str; 9] = ["Planted_Sasl_1", "Planted_KeyPw_2", "Planted_OauthCfg_3", "Planted_DbPw_4", "Planted_Pem_5", "Planted_File_6", "Planted_Flag_7", "Planted_Oidc_8", PLANTED_HEX];
/// A watermark verification key's secret (it must be hex).
const PLANTED_HEX: &str = "c0ffee0dc0ffee0dc0ffee0dc0ffee0dc0ffee0dc0ffee0dc0ffee0dc0ffee0d";

fn run(args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut c = outbox_bin();
    c.args(args);
    for (k, v) in envs {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    (out.status.code(), format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn assert_clean(what: &str, text: &str) {
    for p in PLANTED {
        assert!(!text.contains(p), "{what}: the secret {p} appears in the output:\n{text}");
    }
}

#[tokio::test]
async fn no_output_path_shows_a_secret() {
    let env = Env::new("cli_secrets").await;
    env.ok(&["migrate"]);
    // trust authentication ignores the password: the URL still carries one.
    let url = env.db.url.replacen("://root@", "://root:Planted_DbPw_4@", 1);
    assert!(url.contains("Planted_DbPw_4"), "{url}");
    let dir = common::broker::scratch("secrets");
    let file = dir.join("outbox.toml");
    std::fs::write(&file, "[kafka]\nconnect_timeout_ms = 1500\nsettings = { \"sasl.oauthbearer.config\" = \"principal=x secret=Planted_OauthCfg_3\" }\n").unwrap();
    let cfg = file.to_str().unwrap();
    let kafka = ["--kafka-bootstrap", "127.0.0.1:1", "--kafka-setting", "sasl.password=Planted_Sasl_1", "--kafka-setting", "ssl.key.password=Planted_KeyPw_2", "--kafka-setting", "sasl.username=orders"];
    let wm_keys = format!("shipping=wm-1={PLANTED_HEX}");
    let oidc = [("OUTBOX_KAFKA_OIDC_CLIENT_SECRET", "Planted_Oidc_8"), ("OUTBOX_RECONCILE_WATERMARK_KEYS", wm_keys.as_str())];
    let oidc_flags = ["--kafka-oidc-token-url", "http://127.0.0.1:1/token", "--kafka-oidc-client-id", "orders"];

    // --print-config: TOML, every secret masked, non-secrets shown.
    for command in ["dispatch", "reconcile"] {
        let mut args = vec!["--database-url", &url, "--config", cfg, command, "--print-config"];
        args.extend(kafka);
        args.extend(oidc_flags);
        let (code, text) = run(&args, &oidc);
        assert_eq!(code, Some(0), "{text}");
        assert_clean(&format!("{command} --print-config"), &text);
        let doc: toml::Table = toml::from_str(text.trim()).unwrap_or_else(|e| panic!("{command} --print-config is not TOML: {e}\n{text}"));
        let settings = &doc["kafka"]["settings"];
        for key in ["sasl.password", "ssl.key.password", "sasl.oauthbearer.config", "sasl.oauthbearer.client.secret"] {
            assert_eq!(settings[key].as_str(), Some("***"), "{command}: {key} masked");
        }
        assert_eq!(settings["sasl.username"].as_str(), Some("orders"));
        assert!(doc["database_url"].as_str().unwrap().contains(":***@"), "{text}");
        if command == "reconcile" {
            let key = &doc["reconcile"]["watermark_keys"]["shipping"][0];
            assert_eq!((key["key_id"].as_str(), key["secret_hex"].as_str()), (Some("wm-1"), Some("***")), "{text}");
        }
    }
    // Verification keys from the file (no environment variable): masked too.
    let keyed = dir.join("keyed.toml");
    std::fs::write(&keyed, format!("[reconcile]\nwatermark_keys = [\"billing=wm-f={PLANTED_HEX}\"]\n")).unwrap();
    let (code, text) = run(&["--database-url", &url, "--config", keyed.to_str().unwrap(), "reconcile", "--print-config", "--kafka-bootstrap", "127.0.0.1:1"], &[]);
    assert_eq!(code, Some(0), "{text}");
    assert_clean("reconcile --print-config, keys from the file", &text);
    // The former string form is still read, with a deprecation warning in the log.
    assert!(text.contains("reconcile.watermark_keys: the array of \"CONSUMER_ID=KEY_ID=HEX\" strings is deprecated"), "{text}");
    let printed: String = text.lines().filter(|l| !l.contains(" WARN ")).map(|l| format!("{l}\n")).collect();
    let doc: toml::Table = toml::from_str(printed.trim()).unwrap_or_else(|e| panic!("not TOML: {e}\n{text}"));
    assert_eq!(doc["reconcile"]["watermark_keys"]["billing"][0]["key_id"].as_str(), Some("wm-f"), "{text}");
    assert_eq!(doc["reconcile"]["watermark_keys"]["billing"][0]["secret_hex"].as_str(), Some("***"), "{text}");
    // A malformed verification key: the error names the entry, not the secret.
    let short = format!("shipping=wm-1={}", &PLANTED_HEX[..20]);
    let (code, text) = run(&["--database-url", &url, "reconcile", "--print-config", "--kafka-bootstrap", "127.0.0.1:1"], &[("OUTBOX_RECONCILE_WATERMARK_KEYS", short.as_str())]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("OUTBOX_RECONCILE_WATERMARK_KEYS: entry 1"), "{text}");
    assert!(!text.contains(&PLANTED_HEX[..20]), "{text}");

    // Running against a cluster that is not there, in both log formats and at debug level.
    for format in ["text", "json"] {
        let mut args = vec!["--database-url", &url, "--config", cfg, "--log-format", format, "--log", "debug", "dispatch"];
        args.extend(kafka);
        args.extend(oidc_flags);
        let (code, text) = run(&args, &oidc);
        assert_eq!(code, Some(1), "{text}");
        assert_clean(&format!("dispatch, {format} logs"), &text);
        let (code, text) = run(&["--database-url", &url, "--log-format", format, "reconcile", "--once", "--kafka-bootstrap", "127.0.0.1:1", "--kafka-setting", "sasl.password=Planted_Sasl_1"], &oidc[1..]);
        assert_eq!(code, Some(1), "{text}");
        assert_clean(&format!("reconcile, {format} logs"), &text);
    }

    // librdkafka refuses a secret-bearing setting: the error names it, not its value.
    let (code, text) = run(&["--database-url", &url, "dispatch", "--kafka-bootstrap", "127.0.0.1:1", "--kafka-setting", "security.protocol=SSL", "--kafka-setting", "ssl.key.pem=Planted_Pem_5", "--kafka-setting", "ssl.key.password=Planted_KeyPw_2"], &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("ssl.key.pem"), "{text}");
    assert_clean("invalid ssl.key.pem", &text);

    // A configuration file with a mistake: the error names the line, not its text.
    std::fs::write(&file, "[kafka]\nsettings = { \"sasl.password\" = \"Planted_File_6\" }\nbootstrap = Planted_File_6\n").unwrap();
    let (code, text) = run(&["--config", cfg, "dispatch", "--print-config"], &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("line 3"), "{text}");
    assert_clean("config file error", &text);
    // A malformed --kafka-setting.
    let (code, text) = run(&["--database-url", &url, "dispatch", "--kafka-bootstrap", "b:1", "--kafka-setting", "sasl.password:Planted_Flag_7"], &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("--kafka-setting number 1: expected KEY=VALUE"), "{text}");
    assert_clean("malformed --kafka-setting", &text);
    // A database that refuses: the URL's password is not shown.
    let (code, text) = run(&["--database-url", &format!("postgres://root:Planted_DbPw_4@127.0.0.1:{}/x", free_port()), "status"], &[]);
    assert_eq!(code, Some(1), "{text}");
    assert_clean("refused database", &text);
    env.drop_now().await;
}

#[tokio::test]
async fn the_edges_fail_clearly() {
    let env = Env::new("cli_edges").await;
    // Refused: in seconds, with the host and the cause (not "pool timed out" after 30 s).
    let port = free_port();
    let started = Instant::now();
    let (code, text) = run(&["--database-url", &format!("postgres://root@127.0.0.1:{port}/app"), "status"], &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
    assert!(text.contains(&format!("connecting to PostgreSQL at 127.0.0.1:{port}/app")) && text.to_lowercase().contains("refused"), "{text}");
    assert!(!text.contains("pool timed out"), "{text}");
    // A missing database: said once.
    let missing = env.db.url.rsplit_once('/').map(|(base, _)| format!("{base}/outbox_no_such_db")).unwrap();
    let (code, text) = run(&["--database-url", &missing, "status"], &[]);
    assert_eq!(code, Some(1), "{text}");
    let line = text.lines().find(|l| l.contains("outbox: error:")).unwrap_or_else(|| panic!("{text}"));
    assert_eq!(line.matches("does not exist").count(), 1, "each error text once: {line}");
    // Not PostgreSQL.
    for url in ["mysql://root@127.0.0.1/app", "127.0.0.1:5432/app", "sqlite://x.db"] {
        let (code, text) = run(&["--database-url", url, "status"], &[]);
        assert_eq!(code, Some(1), "{text}");
        assert!(text.contains("not a PostgreSQL URL"), "{url}: {text}");
    }
    // A database without the schema: every command says to run `outbox migrate`.
    let url = env.db.url.clone();
    let trace = ["trace", "evt-01J0000000000000000000000A"];
    let reconcile = ["reconcile", "--once", "--kafka-bootstrap", "127.0.0.1:1"];
    let dispatch = ["dispatch", "--kafka-bootstrap", "127.0.0.1:1"];
    let migrate_destination = ["migrate-destination", "evt-01J0000000000000000000000A", "--operator", "ops", "--dry-run"];
    let commands: [&[&str]; 10] = [&["status"], &trace, &["report"], &["purge"], &dispatch, &reconcile, &migrate_destination, &["takeover", "show"], &["alias", "show"], &["shadow", "--kafka-bootstrap", "127.0.0.1:1"]];
    for args in commands {
        let mut all = vec!["--database-url", url.as_str()];
        all.extend_from_slice(args);
        let (code, text) = run(&all, &[]);
        assert_eq!(code, Some(1), "{args:?}: {text}");
        assert!(text.contains("run `outbox migrate` first"), "{args:?}: {text}");
        assert!(!text.contains("does not exist"), "{args:?}: no raw 'function/relation ... does not exist': {text}");
    }
    // The library's emit says the same.
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY)").execute(env.pool()).await.unwrap();
    let mut tx = env.pool().begin().await.unwrap();
    let request = outbox_core::EmitRequest {
        command_key: "c-1",
        tenant: "t",
        aggregate_type: "order",
        aggregate_id: "o-1",
        aggregate_version: 1,
        event_type: common::ORDER_CREATED,
        payload_schema: "s",
        payload: b"{}",
    };
    let err = outbox_producer::emit(&mut tx, &request, &outbox_producer::EmitOptions::default()).await.expect_err("no schema").to_string();
    assert!(err.contains("run `outbox migrate`"), "{err}");
    drop(tx);
    env.drop_now().await;
}

/// Issue 48: the one configuration file is validated when `outbox` starts,
/// as an embedding service's `Config::from_file` validates it: a consumer
/// section that holds none of the dispatcher's key ids is refused, the
/// error names both settings and never a secret.
#[test]
fn the_cli_refuses_a_file_whose_consumer_lacks_the_dispatchers_key_id() {
    let dir = std::env::temp_dir().join(format!("outbox-cli-keyids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("outbox.toml");
    let example = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/outbox.toml")).unwrap();
    std::fs::write(&file, &example).unwrap();
    let (code, text) = run(&["--config", file.to_str().unwrap(), "dispatch", "--print-config"], &[]);
    assert_eq!(code, Some(0), "the example file as it is: {text}");
    let broken = example.replacen("key_id = \"orders-2026-12\", secret_hex", "key_id = \"orders-2026-11\", secret_hex", 1);
    assert_ne!(broken, example, "the example names the dispatcher's key id");
    std::fs::write(&file, &broken).unwrap();
    let (code, text) = run(&["--config", file.to_str().unwrap(), "dispatch", "--print-config"], &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("dispatch.signing.key_id") && text.contains("keys"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
