//! Reaching a managed Kafka: TLS with certificate verification against an
//! external broker process (tansu) behind a TLS terminator (stunnel), both on
//! loopback, with certificates this test makes; a wrong CA refused with a
//! clear error; SASL and OAUTHBEARER configurations reaching librdkafka.
//! tansu 0.6.0 here cannot authenticate a client (its users cannot be
//! created once authentication is on, and its storages that outlive a
//! restart are not built in), so SASL mechanisms are checked as configured:
//! they fail clearly against a listener without SASL, and SCRAM runs its
//! exchange against tansu's SCRAM server up to "unknown user".

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::broker::{scratch, Certs, Stunnel, Tansu};
use common::{create_order, free_port, route, Env};
use outbox_producer::kafka::{KafkaBroker, KafkaConfig, OAuthBearerToken, OAuthTokenProvider};

struct TlsBroker {
    _stunnel: Stunnel,
    _tansu: Tansu,
    certs: Certs,
    tls_port: u16,
    dir: std::path::PathBuf,
}

fn tls_broker(name: &str) -> TlsBroker {
    let dir = scratch(name);
    let certs = Certs::make(&dir);
    let (plain, tls_port) = (free_port(), free_port());
    let tansu = Tansu::start(plain, &format!("localhost:{tls_port}"), "outbox-tls-cluster", &dir.join("tansu.log"));
    tansu.create_topic("orders", 3);
    let stunnel = Stunnel::start(&certs, tls_port, plain);
    TlsBroker { _stunnel: stunnel, _tansu: tansu, certs, tls_port, dir }
}

impl TlsBroker {
    fn bootstrap(&self) -> String {
        format!("localhost:{}", self.tls_port)
    }

    fn config(&self, ca: &std::path::Path) -> KafkaConfig {
        let mut c = KafkaConfig::new(self.bootstrap())
            .with_setting("security.protocol", "SSL")
            .with_setting("ssl.ca.location", ca.display().to_string())
            .with_setting("batch.num.messages", "1");
        c.connect_timeout_ms = 5_000;
        c
    }
}

fn stop(child: &mut std::process::Child) -> std::process::ExitStatus {
    // SAFETY: kill(2) with a child's pid we own.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "outbox did not stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn dispatch_publishes_over_tls_and_a_wrong_ca_is_refused() {
    let b = tls_broker("tls");
    // The library over TLS: the cluster answers through the terminator.
    let broker = KafkaBroker::connect(b.config(&b.certs.ca)).await.expect("TLS connection with the right CA");
    let cluster = broker.cluster_id().to_owned();
    drop(broker);

    let env = Env::new("cli_tls").await;
    env.ok(&["migrate"]);
    route(env.pool(), &cluster, "orders", 3).await;
    for i in 0..5 {
        create_order(env.pool(), &format!("tls-{i}")).await;
    }
    let log = b.dir.join("dispatch.log");
    let ca = format!("ssl.ca.location={}", b.certs.ca.display());
    let mut child = env
        .outbox()
        .args(["dispatch", "--kafka-bootstrap", &b.bootstrap(), "--kafka-setting", "security.protocol=SSL", "--kafka-setting", &ca])
        .args(["--kafka-setting", "batch.num.messages=1", "--poll-interval-ms", "100", "--name", "tls"])
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(b.dir.join("dispatch.err")).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await < 5 {
        let err = std::fs::read_to_string(b.dir.join("dispatch.err")).unwrap_or_default();
        assert!(Instant::now() < deadline, "the dispatcher did not publish the 5 events over TLS: {err}");
        assert!(child.try_wait().unwrap().is_none(), "outbox dispatch exited early: {err}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(env.count("SELECT count(*) FROM outbox_publish_receipts").await, 5, "one receipt per event, at positions the TLS broker acknowledged");
    assert!(stop(&mut child).success());

    // A CA that did not sign the broker's certificate: refused, and the error says why.
    let file = b.dir.join("wrong-ca.toml");
    std::fs::write(&file, "[kafka]\nconnect_timeout_ms = 3000\n").unwrap();
    let wrong = format!("ssl.ca.location={}", b.certs.other_ca.display());
    let started = Instant::now();
    let out = env
        .outbox()
        .arg("--config")
        .arg(&file)
        .args(["dispatch", "--kafka-bootstrap", &b.bootstrap(), "--kafka-setting", "security.protocol=SSL", "--kafka-setting", &wrong])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or("");
    assert!(last.contains("outbox: error: connecting to Kafka at") && last.contains("certificate verify failed"), "a clear error naming the failed verification: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(20), "refused within the connect timeout");
    // Without ssl.ca.location the system's CAs do not know the test CA either.
    let out = env.outbox().arg("--config").arg(&file).args(["dispatch", "--kafka-bootstrap", &b.bootstrap(), "--kafka-setting", "security.protocol=SSL"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("certificate verify failed"), "{}", String::from_utf8_lossy(&out.stderr));
    env.drop_now().await;
}

#[tokio::test]
async fn sasl_settings_reach_librdkafka_and_fail_clearly_against_a_listener_without_sasl() {
    let b = tls_broker("sasl");
    let env = Env::new("cli_sasl").await;
    env.ok(&["migrate"]);
    let file = b.dir.join("sasl.toml");
    let ca = b.certs.ca.display().to_string();
    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
        std::fs::write(
            &file,
            format!("[kafka]\nconnect_timeout_ms = 3000\nsettings = {{ \"security.protocol\" = \"SASL_SSL\", \"sasl.mechanism\" = \"{mechanism}\", \"sasl.username\" = \"orders\", \"sasl.password\" = \"Planted_Sasl_Pw_9\", \"ssl.ca.location\" = \"{ca}\" }}\n"),
        )
        .unwrap();
        let out = env.outbox().arg("--config").arg(&file).args(["dispatch", "--kafka-bootstrap", &b.bootstrap()]).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{mechanism}: {text}");
        let last = text.lines().last().unwrap_or("");
        eprintln!("{mechanism}: {last}");
        assert!(last.contains("connecting to Kafka at") && last.contains("last client error"), "{mechanism}: a clear error: {text}");
        assert!(!text.contains("No provider") && !text.contains("not available at build time"), "{mechanism} is built in: {text}");
        assert!(!text.contains("Planted_Sasl_Pw_9"), "{mechanism}: the password never appears: {text}");
    }
    env.drop_now().await;
}

#[tokio::test]
async fn scram_runs_its_exchange_against_a_real_scram_server() {
    let dir = scratch("scram");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let _tansu = Tansu::start_with(port, &addr, "outbox-scram-cluster", &dir.join("tansu.log"), &["--authentication"]);
    let env = Env::new("cli_scram").await;
    env.ok(&["migrate"]);
    let file = dir.join("scram.toml");
    for mechanism in ["SCRAM-SHA-256", "SCRAM-SHA-512"] {
        std::fs::write(&file, format!("[kafka]\nconnect_timeout_ms = 3000\nsettings = {{ \"security.protocol\" = \"SASL_PLAINTEXT\", \"sasl.mechanism\" = \"{mechanism}\", \"sasl.username\" = \"orders\", \"sasl.password\" = \"Planted_Scram_Pw_3\" }}\n")).unwrap();
        let out = env.outbox().arg("--config").arg(&file).args(["dispatch", "--kafka-bootstrap", &addr]).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{text}");
        let last = text.lines().last().unwrap_or("");
        eprintln!("{mechanism}: {last}");
        assert!(last.contains("SASL SCRAM authentication failed") && last.contains("unknown-user"), "{mechanism}: the SCRAM exchange reached the server: {text}");
        assert!(!text.contains("Planted_Scram_Pw_3"), "{text}");
    }
    env.drop_now().await;
}

struct CountingProvider(AtomicUsize);

impl OAuthTokenProvider for CountingProvider {
    fn token(&self, config: Option<&str>) -> Result<OAuthBearerToken, String> {
        self.0.fetch_add(1, Ordering::SeqCst);
        assert_eq!(config, Some("principal=orders"), "sasl.oauthbearer.config is passed through");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        Ok(OAuthBearerToken { token: "Planted_Token_7".into(), principal_name: "orders".into(), lifetime_ms: now + 60_000 })
    }
}

#[tokio::test]
async fn the_oauthbearer_token_provider_is_asked_for_tokens() {
    let b = tls_broker("oauth");
    let provider = Arc::new(CountingProvider(AtomicUsize::new(0)));
    let mut c = b.config(&b.certs.ca).with_setting("security.protocol", "SASL_SSL").with_setting("sasl.mechanism", "OAUTHBEARER").with_setting("sasl.oauthbearer.config", "principal=orders");
    c.connect_timeout_ms = 3_000;
    let r = KafkaBroker::connect_with_token_provider(c, provider.clone()).await;
    assert!(provider.0.load(Ordering::SeqCst) >= 1, "librdkafka asked the provider for a token");
    // This listener has no SASL: the connection is refused, and says so without the token.
    let err = r.expect_err("no SASL on this listener").to_string();
    assert!(err.contains("no cluster id") && !err.contains("Planted_Token_7"), "{err}");
}

/// A one-shot OIDC token endpoint: records the request, answers a JWT-shaped token.
async fn token_endpoint(listener: tokio::net::TcpListener, seen: Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut s, _)) = listener.accept().await else { return };
        let mut buf = vec![0u8; 16384];
        let mut n = 0;
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Ok(k) = s.read(&mut buf[n..]).await {
                if k == 0 {
                    break;
                }
                n += k;
                let text = String::from_utf8_lossy(&buf[..n]);
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0))).unwrap_or(0);
                    if body.len() >= len {
                        break;
                    }
                }
            }
        })
        .await;
        seen.lock().unwrap().push(String::from_utf8_lossy(&buf[..n]).into_owned());
        let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600;
        let b64 = |s: &str| {
            const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
            let bytes = s.as_bytes();
            let mut out = String::new();
            for chunk in bytes.chunks(3) {
                let v = chunk.iter().enumerate().fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
                for i in 0..(chunk.len() + 1) {
                    out.push(T[((v >> (18 - 6 * i)) & 63) as usize] as char);
                }
            }
            out
        };
        let jwt = format!("{}.{}.c2ln", b64(r#"{"alg":"none"}"#), b64(&format!(r#"{{"sub":"orders","exp":{exp}}}"#)));
        let body = format!(r#"{{"access_token":"{jwt}","token_type":"bearer","expires_in":3600}}"#);
        let resp = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        let _ = s.write_all(resp.as_bytes()).await;
        let _ = s.shutdown().await;
    }
}

#[tokio::test]
async fn oidc_client_credentials_reach_the_token_endpoint_and_stay_secret() {
    let b = tls_broker("oidc");
    let env = Env::new("cli_oidc").await;
    env.ok(&["migrate"]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/oauth2/token", listener.local_addr().unwrap());
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let server = tokio::spawn(token_endpoint(listener, seen.clone()));
    let file = b.dir.join("oidc.toml");
    std::fs::write(&file, format!("[kafka]\nconnect_timeout_ms = 4000\nsettings = {{ \"ssl.ca.location\" = \"{}\" }}\n", b.certs.ca.display())).unwrap();
    let out = tokio::task::spawn_blocking({
        let mut c = env.outbox();
        c.arg("--config").arg(&file).args(["dispatch", "--kafka-bootstrap", &b.bootstrap(), "--kafka-oidc-token-url", &url, "--kafka-oidc-client-id", "orders-svc", "--kafka-oidc-scope", "kafka"]);
        c.env("OUTBOX_KAFKA_OIDC_CLIENT_SECRET", "Planted_Oidc_Secret_4");
        move || c.output().unwrap()
    })
    .await
    .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let requests = seen.lock().unwrap().clone();
    assert!(!requests.is_empty(), "librdkafka (with libcurl) called the token endpoint: {text}");
    assert!(requests[0].starts_with("POST /oauth2/token") && requests[0].contains("grant_type=client_credentials") && requests[0].contains("scope=kafka"), "{}", requests[0]);
    assert_eq!(out.status.code(), Some(1), "the listener has no SASL: {text}");
    assert!(!text.contains("Planted_Oidc_Secret_4"), "the client secret never appears: {text}");
    // --print-config masks it too and stays TOML.
    let printed = env.outbox().args(["dispatch", "--print-config", "--kafka-bootstrap", "b:1", "--kafka-oidc-token-url", &url, "--kafka-oidc-client-id", "orders-svc"]).env("OUTBOX_KAFKA_OIDC_CLIENT_SECRET", "Planted_Oidc_Secret_4").output().unwrap();
    let printed = String::from_utf8_lossy(&printed.stdout);
    let doc: toml::Table = toml::from_str(&printed).unwrap();
    assert_eq!(doc["kafka"]["settings"]["sasl.oauthbearer.method"].as_str(), Some("oidc"));
    assert_eq!(doc["kafka"]["settings"]["sasl.oauthbearer.client.secret"].as_str(), Some("***"));
    server.abort();
    env.drop_now().await;
}
