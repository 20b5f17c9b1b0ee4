//! The one configuration: the file, the environment, masked secrets, errors
//! that name the setting, the key-id checks, and the TLS settings reaching
//! the librdkafka clients.

use outbox_config::{Config, ConfigError};

const EXAMPLE: &str = include_str!("../../examples/outbox.toml");
const DISPATCH_HEX: &str = "5eb63bbbe01eeed093cb22bb8f5acdc35eb63bbbe01eeed093cb22bb8f5acdc3";

fn err(text: &str) -> ConfigError {
    Config::from_toml(text).expect_err("refused")
}

fn env(pairs: &[(&str, &str)]) -> (impl Fn(&str) -> Option<String>, Vec<(String, String)>) {
    let all: Vec<(String, String)> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let lookup = all.clone();
    (move |k: &str| lookup.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()), all)
}

#[test]
fn the_example_file_parses_validates_and_builds_every_sdk_type() {
    let c = Config::from_toml(EXAMPLE).unwrap();
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    assert_eq!(c.database_url().unwrap(), "postgres://outbox@db.internal:5432/app");
    let k = c.kafka_config().unwrap();
    assert_eq!(k.bootstrap_servers, "kafka-1.internal:9093,kafka-2.internal:9093");
    assert!(k.extra.contains(&("ssl.key.password".to_owned(), "example-key-password".to_owned())));
    assert_eq!(k.lookup_extra, vec![("fetch.max.bytes".to_owned(), "1048576".to_owned())]);
    let d = c.dispatcher_config().unwrap();
    assert_eq!((d.name.as_str(), d.workers, d.signing.as_ref().unwrap().key_id.as_str()), ("dispatcher-a", 4, "orders-2026-12"));
    assert_eq!(c.signing_key().unwrap().unwrap().key_id(), "orders-2026-12");
    assert_eq!(c.consumer_ids(), vec!["fulfilment"]);
    let f = c.consumer_config("fulfilment").unwrap();
    assert_eq!(f.topics, vec!["orders"]);
    assert_eq!(f.bootstrap_servers, k.bootstrap_servers);
    assert!(f.trust.topics["orders"].require_signature);
    assert!(f.trust.keys["urn:example:order-service"].contains_key("orders-2026-12"));
    assert_eq!(f.watermark_signing_key.as_ref().unwrap().key_id(), "fulfilment-wm-1");
    assert_eq!(f.watermark_topic.as_deref(), Some("outbox.watermarks"));
    assert_eq!(c.consumer_database_url("fulfilment").unwrap(), "postgres://fulfilment@db.internal:5432/fulfilment");
    // The consumer gets the shared security settings, not the producer's client.id.
    assert_eq!(f.kafka.get("security.protocol").map(String::as_str), Some("SASL_SSL"));
    assert_eq!(f.kafka.get("sasl.password").map(String::as_str), Some("example-sasl-password"));
    assert_eq!(f.kafka.get("client.id"), None);
    assert_eq!(f.kafka.get("auto.offset.reset").map(String::as_str), Some("earliest"));
    let w = c.watermark_topic_config().unwrap().unwrap();
    assert_eq!(w.verify_keys["fulfilment"][0].key_id(), "fulfilment-wm-1");
    assert_eq!(w.kafka.get("ssl.ca.location").map(String::as_str), Some("/etc/outbox/ca.pem"));
}

/// TLS and SASL settings of the file reach the librdkafka configurations the
/// SDK builds: the producer's, the reconciler's lookup consumers' and the
/// consumer's. (No TLS broker runs here: this checks the configuration
/// handed to librdkafka, not a handshake.)
#[test]
fn tls_settings_reach_every_librdkafka_client_config() {
    let c = Config::from_toml(EXAMPLE).unwrap();
    let k = c.kafka_config().unwrap();
    let producer = k.producer_config();
    let lookup = k.lookup_config("g");
    let consumer = c.consumer_config("fulfilment").unwrap().client_config();
    for (name, client) in [("producer", &producer), ("lookup", &lookup), ("consumer", &consumer)] {
        for (key, want) in [
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", "/etc/outbox/ca.pem"),
            ("ssl.certificate.location", "/etc/outbox/client.pem"),
            ("ssl.key.location", "/etc/outbox/client.key"),
            ("ssl.key.password", "example-key-password"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "orders-outbox"),
            ("sasl.password", "example-sasl-password"),
        ] {
            assert_eq!(client.get(key), Some(want), "{name}: {key}");
        }
    }
    assert_eq!(producer.get("acks"), Some("all"), "the guarantees stay the adapter's");
    assert_eq!(producer.get("fetch.max.bytes"), None);
    assert_eq!(consumer.get("group.id"), Some("fulfilment"));
    assert_eq!(consumer.get("enable.auto.commit"), Some("false"));
}

#[test]
fn secrets_are_masked_in_debug_display_and_errors() {
    let c = Config::from_toml(&EXAMPLE.replace("postgres://outbox@", "postgres://outbox:DbPw_Planted@")).unwrap();
    let k = c.kafka_config().unwrap();
    for text in [format!("{c:?}"), format!("{c}"), format!("{c:#?}"), format!("{k:?}"), format!("{:?}", c.consumer_config("fulfilment").unwrap())] {
        for secret in ["example-key-password", "example-sasl-password", DISPATCH_HEX, "0b0b0b0b", "DbPw_Planted"] {
            assert!(!text.contains(secret), "{secret} shown in {text}");
        }
        assert!(text.contains("***"), "{text}");
    }
    assert!(format!("{c:?}").contains("orders-2026-12"), "key ids are shown");
    // A secret of the wrong type: the error names the setting, not the value.
    let e = err("[kafka.settings]\n\"sasl.password\" = 12345\n");
    assert_eq!(e.setting(), "kafka.settings.sasl.password", "{e}");
    let e = err("[dispatch]\nworkers = \"Secret_Planted_7\"\n");
    assert!(e.to_string().starts_with("dispatch.workers: ") && !e.to_string().contains("Secret_Planted_7"), "{e}");
    // A malformed secret: named by its setting and key id.
    let e = err("[dispatch.signing]\nkey_id = \"k1\"\nsecret_hex = \"zz0102030405060708090a0b0c0d0e0f\"\n");
    assert!(e.to_string().starts_with("dispatch.signing: ") && !e.to_string().contains("zz01"), "{e}");
    // Legacy watermark keys in Debug.
    let legacy = Config::parse(&format!("[reconcile]\nwatermark_keys = [\"shipping=wm-1={DISPATCH_HEX}\"]\n")).unwrap();
    assert!(!format!("{legacy:?}").contains(DISPATCH_HEX), "{legacy:?}");
}

#[test]
fn errors_name_the_setting() {
    let cases: &[(&str, &str)] = &[
        ("[dispatch]\nwokers = 3\n", "dispatch.wokers"),
        ("colour = 1\n", "colour"),
        ("[kafka]\nbootstrap = \"b:1\"\n[kafka.settings]\nacks = \"0\"\n", "kafka.settings.acks"),
        ("[kafka]\nbootstrap = \"b:1\"\nmessage_timeout_ms = 0\n", "kafka.message_timeout_ms"),
        ("[kafka]\noidc_token_url = \"https://idp/token\"\n", "kafka.oidc_token_url"),
        ("[consumer.fulfilment]\ntopics = []\n", "consumer.fulfilment.topics"),
        ("[consumer.fulfilment]\ntopics = [\"orders\"]\nrequire_signature = [\"payments\"]\n", "consumer.fulfilment.require_signature"),
        ("[consumer.fulfilment]\ntopics = [\"orders\"]\nrequire_signature = [\"orders\"]\naccept = { orders = [\"urn:x\"] }\n", "consumer.fulfilment.keys"),
        ("[consumer.fulfilment]\ntopics = [\"orders\"]\n[consumer.fulfilment.keys]\n\"urn:x\" = [{ key_id = \"k\", secret_hex = \"00\" }]\n", "consumer.fulfilment.keys.\"urn:x\""),
        ("[consumer.fulfilment]\ntopics = [\"orders\"]\nmax_batch_messages = 0\n", "consumer.fulfilment.max_batch_messages"),
        ("[consumer.fulfilment]\ntopics = [\"orders\"]\n[consumer.fulfilment.kafka]\n\"group.id\" = \"x\"\n", "consumer.fulfilment.kafka.\"group.id\""),
        ("[consumer.fulfilment]\ntopics = [\"orders\"]\nwatermark_topic = \"orders\"\n", "consumer.fulfilment.watermark_topic"),
        ("[consumer.\"bad id\"]\ntopics = [\"orders\"]\n", "consumer.\"bad id\""),
        ("[reconcile.watermark_keys]\nshipping = []\n", "reconcile.watermark_keys.shipping"),
        ("log_format = \"xml\"\n", "log_format"),
    ];
    for (text, setting) in cases {
        let e = err(text);
        assert_eq!(e.setting(), *setting, "{text}: {e}");
        assert!(e.to_string().starts_with(&format!("{setting}: ")), "{e}");
    }
}

#[test]
fn limits_on_sizes() {
    let many: String = (0..=outbox_config::MAX_SETTINGS).map(|i| format!("\"linger.ms.{i}\" = \"1\"\n")).collect();
    assert_eq!(err(&format!("[kafka.settings]\n{many}")).setting(), "kafka.settings");
    let long = "x".repeat(outbox_config::MAX_SETTING_VALUE_BYTES + 1);
    assert_eq!(err(&format!("[kafka.settings]\n\"ssl.ca.pem\" = \"{long}\"\n")).setting(), "kafka.settings.\"ssl.ca.pem\"");
    let consumers: String = (0..=outbox_config::MAX_CONSUMERS).map(|i| format!("[consumer.c{i}]\ntopics = [\"t\"]\n")).collect();
    assert_eq!(err(&consumers).setting(), "consumer");
    let keys: String = (0..=outbox_config::keys::MAX_KEYS_PER_OWNER).map(|i| format!("{{ key_id = \"k{i}\", secret_hex = \"{DISPATCH_HEX}\" }},")).collect();
    assert_eq!(err(&format!("[reconcile.watermark_keys]\nshipping = [{keys}]\n")).setting(), "reconcile.watermark_keys.shipping");
    let huge = format!("log = \"{}\"\n", "x".repeat(outbox_config::MAX_FILE_BYTES as usize));
    assert_eq!(Config::parse(&huge).unwrap_err().setting(), "config");
}

#[test]
fn a_consumer_without_the_dispatchers_key_id_is_refused_naming_both() {
    let other = EXAMPLE.replace("{ key_id = \"orders-2026-12\", secret_hex", "{ key_id = \"orders-2026-11\", secret_hex");
    let e = err(&other);
    assert_eq!(e.setting(), "consumer.fulfilment.keys", "{e}");
    let text = e.to_string();
    assert!(text.contains("dispatch.signing.key_id = \"orders-2026-12\"") && text.contains("orders-2026-11"), "{text}");
    assert!(!text.contains(DISPATCH_HEX), "{text}");
    // The same key id with another secret.
    let e = err(&EXAMPLE.replacen(&format!("key_id = \"orders-2026-12\", secret_hex = \"{DISPATCH_HEX}\""), &format!("key_id = \"orders-2026-12\", secret_hex = \"{}\"", "11".repeat(32)), 1));
    assert_eq!(e.setting(), "consumer.fulfilment.keys", "{e}");
    assert!(e.to_string().contains("another secret than dispatch.signing"), "{e}");
    // A key rotation: the consumer holds the old and the new key: accepted.
    let rotation = EXAMPLE.replace(
        "  { key_id = \"orders-2026-12\"",
        &format!("  {{ key_id = \"orders-2026-11\", secret_hex = \"{}\" }},\n  {{ key_id = \"orders-2026-12\"", "22".repeat(32)),
    );
    Config::from_toml(&rotation).unwrap();
    // The watermark side: the reconciler's keys must hold the consumer's key id.
    let e = err(&EXAMPLE.replace("fulfilment = [{ key_id = \"fulfilment-wm-1\"", "fulfilment = [{ key_id = \"fulfilment-wm-0\""));
    assert_eq!(e.setting(), "reconcile.watermark_keys.fulfilment", "{e}");
    assert!(e.to_string().contains("consumer.fulfilment.watermark_signing") && e.to_string().contains("fulfilment-wm-1"), "{e}");
}

#[test]
fn the_environment_carries_the_same_settings() {
    let secret = "0c".repeat(32);
    let verify = format!("urn:example:order-service=orders-2026-12={DISPATCH_HEX}");
    let wm = format!("fulfilment=fulfilment-wm-1={secret}");
    let (get, all) = env(&[
        ("DATABASE_URL", "postgres://env/db"),
        ("OUTBOX_KAFKA_BOOTSTRAP", "env:9093"),
        ("OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS", "4321"),
        ("OUTBOX_KAFKA_SETTING_SECURITY_PROTOCOL", "SSL"),
        ("OUTBOX_KAFKA_SETTING_SSL_CA_LOCATION", "/ca.pem"),
        ("OUTBOX_KAFKA_SETTING_SSL_KEY_PASSWORD", "Env_KeyPw_9"),
        ("OUTBOX_KAFKA_SETTING_LOG__LEVEL", "6"),
        ("OUTBOX_KAFKA_LOOKUP_SETTING_FETCH_MAX_BYTES", "1000"),
        ("OUTBOX_DISPATCH_WORKERS", "3"),
        ("OUTBOX_DISPATCH_SIGNING_KEY_ID", "orders-2026-12"),
        ("OUTBOX_DISPATCH_SIGNING_SECRET_HEX", DISPATCH_HEX),
        ("OUTBOX_RECONCILE_INTERVAL_MS", "500"),
        ("OUTBOX_RECONCILE_WATERMARK_KEYS", &wm),
        ("OUTBOX_METRICS_ADDR", "127.0.0.1:9"),
        ("OUTBOX_CONSUMER_ID", "fulfilment"),
        ("OUTBOX_CONSUMER_TOPICS", "orders, payments"),
        ("OUTBOX_CONSUMER_MAX_ATTEMPTS", "3"),
        ("OUTBOX_CONSUMER_ACCEPT_SOURCES", "orders=urn:example:order-service"),
        ("OUTBOX_CONSUMER_REQUIRE_SIGNATURE", "orders"),
        ("OUTBOX_CONSUMER_VERIFY_KEYS", &verify),
        ("OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID", "fulfilment-wm-1"),
        ("OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX", &secret),
        ("OUTBOX_CONSUMER_KAFKA_FETCH_WAIT_MAX_MS", "50"),
    ]);
    let c = Config::default().with_env_lookup(get, all).unwrap();
    c.validate().unwrap();
    assert_eq!(c.database_url().unwrap(), "postgres://env/db");
    let k = c.kafka_config().unwrap();
    assert_eq!((k.bootstrap_servers.as_str(), k.message_timeout_ms), ("env:9093", 4321));
    let producer = k.producer_config();
    assert_eq!(producer.get("ssl.key.password"), Some("Env_KeyPw_9"));
    assert_eq!(producer.get("log_level"), Some("6"));
    assert_eq!(k.lookup_extra, vec![("fetch.max.bytes".to_owned(), "1000".to_owned())]);
    assert_eq!(c.dispatcher_config().unwrap().workers, 3);
    assert_eq!(c.signing_key().unwrap().unwrap().key_id(), "orders-2026-12");
    assert_eq!(c.reconcile.interval_ms, Some(500));
    assert_eq!(c.metrics.addr.as_deref(), Some("127.0.0.1:9"));
    let f = c.consumer_config("fulfilment").unwrap();
    assert_eq!(f.topics, vec!["orders", "payments"]);
    assert_eq!(f.retry.max_attempts, 3);
    assert!(f.trust.topics["orders"].require_signature);
    assert_eq!(f.kafka.get("ssl.ca.location").map(String::as_str), Some("/ca.pem"), "TLS from the environment reaches the consumer");
    assert_eq!(f.kafka.get("fetch.wait.max.ms").map(String::as_str), Some("50"));
    assert_eq!(f.client_config().get("security.protocol"), Some("SSL"));
    assert_eq!(c.watermark_topic_config().unwrap().unwrap().verify_keys["fulfilment"][0].key_id(), "fulfilment-wm-1");
    assert!(!format!("{c:?}").contains("Env_KeyPw_9") && !format!("{c:?}").contains(&secret));

    // The environment over the file: a variable that is set wins.
    let (get, all) = env(&[("OUTBOX_DISPATCH_WORKERS", "7"), ("OUTBOX_KAFKA_BOOTSTRAP", "env:1"), ("OUTBOX_CONSUMER_ID", "fulfilment"), ("OUTBOX_CONSUMER_MAX_ATTEMPTS", "9")]);
    let c = Config::from_toml(EXAMPLE).unwrap().with_env_lookup(get, all).unwrap();
    c.validate().unwrap();
    assert_eq!(c.dispatcher_config().unwrap().workers, 7);
    assert_eq!(c.dispatcher_config().unwrap().batch_size, 500);
    assert_eq!(c.kafka_config().unwrap().bootstrap_servers, "env:1");
    let f = c.consumer_config("fulfilment").unwrap();
    assert_eq!((f.retry.max_attempts, f.topics.as_slice()), (9, &["orders".to_owned()][..]), "overlaid on the file's section");

    // Errors name the variable, never its value.
    let bad = |pairs: &[(&str, &str)]| {
        let (get, all) = env(pairs);
        Config::default().with_env_lookup(get, all).and_then(|c| c.validate().map(|_| c)).unwrap_err()
    };
    let e = bad(&[("OUTBOX_KAFKA_MAX_IN_FLIGHT", "Planted_NaN")]);
    assert!(e.setting() == "OUTBOX_KAFKA_MAX_IN_FLIGHT" && !e.to_string().contains("Planted_NaN"), "{e}");
    let e = bad(&[("OUTBOX_DISPATCH_WORKERS", "Planted_NaN")]);
    assert!(e.setting() == "OUTBOX_DISPATCH_WORKERS" && !e.to_string().contains("Planted_NaN"), "{e}");
    let e = bad(&[("OUTBOX_CONSUMER_ID", "c"), ("OUTBOX_CONSUMER_TOPICS", "t"), ("OUTBOX_CONSUMER_VERIFY_KEYS", "urn:a=k1")]);
    assert_eq!(e.to_string(), "OUTBOX_CONSUMER_VERIFY_KEYS: entry 1 is not OWNER=KEY_ID=HEX");
    let e = bad(&[("OUTBOX_CONSUMER_ACCEPT_SOURCES", "orders=urn:a")]);
    assert_eq!(e.setting(), "OUTBOX_CONSUMER_ID", "{e}");
    let e = bad(&[("OUTBOX_CONSUMER_ID", "c"), ("OUTBOX_CONSUMER_TOPICS", "t"), ("OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID", "k")]);
    assert_eq!(e.setting(), "OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID", "{e}");
    // The key-id check holds for the environment too.
    let e = bad(&[
        ("OUTBOX_KAFKA_BOOTSTRAP", "b:1"),
        ("OUTBOX_DISPATCH_SIGNING_KEY_ID", "k-new"),
        ("OUTBOX_DISPATCH_SIGNING_SECRET_HEX", DISPATCH_HEX),
        ("OUTBOX_CONSUMER_ID", "c"),
        ("OUTBOX_CONSUMER_TOPICS", "t"),
        ("OUTBOX_CONSUMER_VERIFY_KEYS", &format!("urn:a=k-old={DISPATCH_HEX}")),
    ]);
    assert!(e.setting() == "consumer.c.keys" && e.to_string().contains("\"k-new\"") && e.to_string().contains("k-old"), "{e}");
}

#[test]
fn the_former_watermark_key_strings_still_work_with_a_warning() {
    let c = Config::from_toml(&format!("[kafka]\nbootstrap = \"b:1\"\n[reconcile]\nwatermark_keys = [\"shipping=wm-1={DISPATCH_HEX}\", \"shipping=wm-2={DISPATCH_HEX}\"]\n")).unwrap();
    assert_eq!(c.warnings().len(), 1);
    assert!(c.warnings()[0].contains("reconcile.watermark_keys") && c.warnings()[0].contains("deprecated"), "{:?}", c.warnings());
    let keys = c.reconcile.watermark_verify_keys().unwrap();
    assert_eq!(keys["shipping"].iter().map(|k| k.key_id()).collect::<Vec<_>>(), vec!["wm-1", "wm-2"]);
    let e = Config::from_toml("[reconcile]\nwatermark_keys = [\"shipping=wm-1\"]\n").unwrap_err();
    assert_eq!(e.to_string(), "reconcile.watermark_keys: entry 1 is not OWNER=KEY_ID=HEX");
}

#[test]
fn a_file_is_read_from_disk_and_a_missing_one_is_named() {
    let dir = std::env::temp_dir().join(format!("outbox-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("outbox.toml");
    std::fs::write(&path, EXAMPLE).unwrap();
    assert_eq!(Config::from_file(&path).unwrap(), Config::from_toml(EXAMPLE).unwrap());
    let missing = dir.join("missing.toml");
    let e = Config::from_file(&missing).unwrap_err();
    assert_eq!(e.setting(), missing.display().to_string());
    std::fs::write(&path, "[dispatch]\nworkers = 3\nwokers = 4\n").unwrap();
    let e = Config::from_file(&path).unwrap_err();
    assert_eq!(e.setting(), "dispatch.wokers");
    assert!(e.to_string().contains("line 3"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
