//! The librdkafka this crate links has every feature the Kafka adapter
//! documents, however the machine was set up when it was built, and the
//! `PKG_CONFIG` wrapper that makes it so answers as librdkafka's configure
//! needs.

use std::path::{Path, PathBuf};
use std::process::Command;

/// librdkafka's own list of what it was built with.
fn builtin_features() -> Vec<String> {
    let native = rdkafka::ClientConfig::new().create_native_config().expect("a native config");
    native.get("builtin.features").expect("builtin.features").split(',').map(str::to_owned).collect()
}

#[test]
fn librdkafka_is_built_with_tls_sasl_and_oidc() {
    let features = builtin_features();
    for f in ["ssl", "sasl_scram", "sasl_oauthbearer", "http", "oidc"] {
        assert!(features.iter().any(|x| x == f), "librdkafka lacks {f}: built with {features:?}");
    }
}

fn wrapper() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("build-support/pkg-config")
}

/// A directory laid out as curl-sys leaves its build (DEP_CURL_ROOT).
fn fake_curl_root() -> PathBuf {
    let root = std::env::temp_dir().join(format!("outbox-curl-root-{}", std::process::id()));
    std::fs::create_dir_all(root.join("include/curl")).unwrap();
    std::fs::write(root.join("include/curl/curl.h"), "/* curl */\n").unwrap();
    std::fs::write(root.join("include/curl/curlver.h"), "#define LIBCURL_VERSION \"8.22.0\"\n").unwrap();
    root
}

fn run(args: &[&str], curl_root: Option<&Path>) -> (bool, String) {
    let mut c = Command::new(wrapper());
    c.args(args).env_remove("DEP_CURL_ROOT");
    if let Some(r) = curl_root {
        c.env("DEP_CURL_ROOT", r);
    }
    let out = c.output().expect("run the pkg-config wrapper");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[test]
fn the_pkg_config_wrapper_answers_libcurl_with_the_copy_cargo_built() {
    let root = fake_curl_root();
    let r = root.display();
    assert_eq!(run(&["--exists", "libcurl"], Some(&root)), (true, String::new()));
    assert_eq!(run(&["--short-errors", "--cflags", "libcurl"], Some(&root)), (true, format!("-I{r}/include -DCURL_STATICLIB")));
    let (ok, libs) = run(&["--short-errors", "--libs", "libcurl"], Some(&root));
    assert!(ok && libs.starts_with(&format!("-L{r}/build -lcurl ")) && libs.contains("-lssl -lcrypto"), "{libs}");
    assert_eq!(run(&["--modversion", "libcurl"], Some(&root)), (true, "8.22.0".to_owned()));
    // Outside librdkafka's build (no DEP_CURL_ROOT) it is the system's
    // pkg-config, which knows no libcurl without its development package.
    let system = Command::new("pkg-config").args(["--exists", "libcurl"]).status().map(|s| s.success()).unwrap_or(false);
    assert_eq!(run(&["--exists", "libcurl"], None).0, system);
    // Another library's question goes to the system's pkg-config unchanged.
    let (wrapped, _) = run(&["--exists", "zlib"], Some(&root));
    let direct = Command::new("pkg-config").args(["--exists", "zlib"]).status().map(|s| s.success()).unwrap_or(false);
    assert_eq!(wrapped, direct, "zlib answered differently through the wrapper");
    assert!(run(&["--version"], Some(&root)).0, "configure decides whether pkg-config exists by --version");
    std::fs::remove_dir_all(&root).ok();
}
