// 1. Rebuild when a migration is added: sqlx::migrate!() embeds the directory.
// 2. Refuse a librdkafka built without OIDC. librdkafka's configure turns
//    OIDC off, silently, when it finds no libcurl to link; the Kafka adapter
//    documents `sasl.oauthbearer.method=oidc` (managed clusters), so a build
//    without it would fail only when it first meets such a cluster.
use std::path::Path;

const ALLOW: &str = "OUTBOX_ALLOW_NO_OIDC";

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-env-changed={ALLOW}");
    // rdkafka-sys (links = "rdkafka") hands its build directory to direct dependents.
    let Ok(root) = std::env::var("DEP_RDKAFKA_ROOT") else { return };
    let config = Path::new(&root).join("config.h");
    let Ok(text) = std::fs::read_to_string(&config) else {
        // Another build layout (rdkafka's cmake-build): nothing to read here.
        println!("cargo:warning=could not read {}: whether librdkafka has OIDC is not checked", config.display());
        return;
    };
    println!("cargo:rerun-if-changed={}", config.display());
    if text.lines().any(|l| l.trim() == "#define WITH_OAUTHBEARER_OIDC 1") {
        return;
    }
    if std::env::var_os(ALLOW).is_some_and(|v| v == "1") {
        println!("cargo:warning=librdkafka was built without OIDC ({ALLOW}=1): sasl.oauthbearer.method=oidc will be refused");
        return;
    }
    let wrapper = Path::new(env!("CARGO_MANIFEST_DIR")).join("build-support/pkg-config");
    eprintln!(
        "error: librdkafka was built without OIDC (sasl.oauthbearer.method=oidc): its configure found no libcurl to link.\n\
         Either:\n\
         - build with PKG_CONFIG={wrapper} (as this repository's .cargo/config.toml does; in your own project, put it in\n\
           the [env] table of your .cargo/config.toml): it answers configure with the libcurl that cargo builds (curl-sys), or\n\
         - install libcurl's development package (Debian/Ubuntu: libcurl4-openssl-dev; Fedora: libcurl-devel; Alpine: curl-dev);\n\
         then rebuild librdkafka: cargo clean -p rdkafka-sys && cargo build\n\
         To build without OIDC on purpose, set {ALLOW}=1.",
        wrapper = wrapper.display()
    );
    std::process::exit(1);
}
