//! The deployment files under deploy/ are checked here, as far as this
//! machine can: the systemd units with `systemd-analyze verify` (no warning
//! allowed) and their command lines parsed by this build of `outbox`; the
//! Kubernetes manifests parsed as YAML, their container arguments parsed by
//! `outbox` with the configuration from their Secrets, probes on the port the
//! metrics listener binds, PodDisruptionBudgets selecting the Deployments;
//! the container recipe's inputs present. No Kubernetes cluster or container
//! daemon runs here: applying the manifests and building the image are not
//! tested (docs/DEPLOYMENT.md says so).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::outbox_bin;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `outbox` with `args`; returns (exit code, stdout, stderr).
fn outbox(args: &[String]) -> (Option<i32>, String, String) {
    let out = outbox_bin().args(args).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn systemd_units_verify_and_their_command_lines_parse() {
    let dir = common::broker::scratch("systemd");
    let units: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/systemd")).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(units.len() >= 4, "{units:?}");
    let bin = env!("CARGO_BIN_EXE_outbox");
    let mut names = Vec::new();
    for u in &units {
        let text = std::fs::read_to_string(u).unwrap();
        // verify checks that ExecStart's program exists: point it at this build.
        std::fs::write(dir.join(u.file_name().unwrap()), text.replace("/usr/local/bin/outbox", bin)).unwrap();
        names.push(format!("./{}", u.file_name().unwrap().to_string_lossy()));
    }
    let out = Command::new("systemd-analyze").arg("verify").args(&names).current_dir(&dir).output().expect("systemd-analyze (scripts/setup.d/42-systemd.sh installs it)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {:?}\n{stderr}", out.status);

    // Each ExecStart is a command line this build accepts.
    let config = dir.join("outbox.toml");
    std::fs::write(&config, "database_url = \"postgres://u@db/app\"\n[kafka]\nbootstrap = \"k:9092\"\n").unwrap();
    for u in &units {
        let text = std::fs::read_to_string(u).unwrap();
        let Some(exec) = text.lines().find_map(|l| l.strip_prefix("ExecStart=")) else { continue };
        let mut args: Vec<String> = exec.split_whitespace().skip(1).map(|a| a.replace("%d/outbox.toml", config.to_str().unwrap())).collect();
        let long_running = args.iter().any(|a| a == "dispatch" || a == "reconcile");
        args.push(if long_running { "--print-config".into() } else { "--help".into() });
        let (code, stdout, stderr) = outbox(&args);
        assert_eq!(code, Some(0), "{}: {args:?}\n{stderr}", u.display());
        if long_running {
            let doc: toml::Table = toml::from_str(&stdout).unwrap();
            assert!(doc["metrics"]["addr"].as_str().is_some_and(|a| a.starts_with("127.0.0.1:")), "{}: health and metrics on loopback: {stdout}", u.display());
        }
        assert!(text.contains("LoadCredential=outbox.toml:/etc/outbox/"), "{}: the config (secrets) as a credential", u.display());
    }
}

fn get<'a>(v: &'a serde_yaml::Value, path: &str) -> &'a serde_yaml::Value {
    path.split('.').fold(v, |v, k| match k.parse::<usize>() {
        Ok(i) => &v[i],
        Err(_) => &v[k],
    })
}

#[test]
fn kubernetes_manifests_parse_and_agree_with_the_binary() {
    use serde::Deserialize;
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/outbox.yaml")).unwrap();
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text).map(|d| serde_yaml::Value::deserialize(d).expect("valid YAML")).collect();
    let kind = |d: &serde_yaml::Value| get(d, "kind").as_str().unwrap_or("").to_owned();
    let name = |d: &serde_yaml::Value| get(d, "metadata.name").as_str().unwrap_or("").to_owned();
    let deployments: Vec<&serde_yaml::Value> = docs.iter().filter(|d| kind(d) == "Deployment").collect();
    assert_eq!(deployments.len(), 2, "dispatch and reconcile");
    let dir = common::broker::scratch("kubernetes");
    for d in &deployments {
        let spec = get(d, "spec.template.spec");
        let c = get(spec, "containers.0");
        // The configuration comes from the Secret mounted at /etc/outbox.
        let secret_name = get(spec, "volumes.0.secret.secretName").as_str().unwrap();
        let secret = docs.iter().find(|s| kind(s) == "Secret" && name(s) == secret_name).unwrap_or_else(|| panic!("Secret {secret_name}"));
        let toml_text = get(secret, "stringData.outbox.toml").as_str().unwrap_or_else(|| get(secret, "stringData").get("outbox.toml").and_then(|v| v.as_str()).unwrap());
        let config = dir.join(format!("{}.toml", name(d)));
        std::fs::write(&config, toml_text).unwrap();
        assert_eq!(get(c, "volumeMounts.0.mountPath").as_str(), Some("/etc/outbox"));
        let mut args: Vec<String> = get(c, "args").as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().replace("/etc/outbox/outbox.toml", config.to_str().unwrap())).collect();
        args.push("--print-config".into());
        let (code, stdout, stderr) = outbox(&args);
        assert_eq!(code, Some(0), "{}: {args:?}\n{stderr}", name(d));
        let printed: toml::Table = toml::from_str(&stdout).unwrap();
        assert_eq!(printed["kafka"]["settings"]["sasl.password"].as_str(), Some("***"), "secrets masked");
        let addr = printed["metrics"]["addr"].as_str().unwrap_or_else(|| panic!("{}: the metrics listener (and the probes) must be on", name(d)));
        let port: u64 = addr.rsplit(':').next().unwrap().parse().unwrap();
        assert_eq!(get(c, "ports.0.containerPort").as_u64(), Some(port), "{}: the probed port is the one the service binds", name(d));
        assert_eq!(get(c, "livenessProbe.httpGet.path").as_str(), Some("/healthz"), "{}", name(d));
        assert_eq!(get(c, "readinessProbe.httpGet.path").as_str(), Some("/readyz"), "{}", name(d));
        assert!(get(c, "resources.requests.memory").as_str().is_some() && get(c, "resources.limits.memory").as_str().is_some(), "{}", name(d));
        assert_eq!(get(c, "securityContext.readOnlyRootFilesystem").as_bool(), Some(true));
        if name(d) == "outbox-dispatch" {
            let grace_ms = printed["dispatch"]["shutdown_grace_ms"].as_integer().unwrap();
            let termination = get(spec, "terminationGracePeriodSeconds").as_i64().unwrap();
            assert!(termination * 1000 > grace_ms, "the pod outlives the dispatcher's drain ({termination} s vs {grace_ms} ms)");
        }
        // A PodDisruptionBudget selects this Deployment's pods.
        let labels = get(d, "spec.template.metadata.labels");
        assert!(
            docs.iter().filter(|p| kind(p) == "PodDisruptionBudget").any(|p| get(p, "spec.selector.matchLabels").as_mapping().unwrap().iter().all(|(k, v)| &labels[k.as_str().unwrap()] == v)),
            "{}: no PodDisruptionBudget",
            name(d)
        );
    }
    // The migration Job runs migrate and the roles file the image ships.
    let job = docs.iter().find(|d| kind(d) == "Job").expect("a migration Job");
    let command = get(job, "spec.template.spec.containers.0.command.2").as_str().unwrap();
    assert!(command.contains("outbox migrate") && command.contains("/usr/share/outbox/roles.sql"), "{command}");
    let recipe = std::fs::read_to_string(repo().join("deploy/container/Containerfile")).unwrap();
    assert!(recipe.contains("COPY docs/roles.sql /usr/share/outbox/roles.sql"), "the image ships the roles the Job applies");
}

#[test]
fn the_container_recipe_names_what_the_build_needs() {
    let recipe = std::fs::read_to_string(repo().join("deploy/container/Containerfile")).unwrap();
    for line in recipe.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from")) {
        let src = line.split_whitespace().nth(1).unwrap();
        assert!(repo().join(src).exists(), "{line}: {src} is not in the repository");
    }
    // The same build prerequisites as scripts/setup.d/10-build.sh (librdkafka
    // with OpenSSL; libcurl comes from curl-sys's bundled source).
    let setup = std::fs::read_to_string(repo().join("scripts/setup.d/10-build.sh")).unwrap();
    for pkg in ["libssl-dev", "zlib1g-dev", "g++", "make", "pkg-config"] {
        assert!(setup.contains(pkg) && recipe.contains(pkg), "{pkg}");
    }
    assert!(recipe.contains("-p outbox-cli --bin outbox"), "the binary this workspace builds");
    let cli_toml = std::fs::read_to_string(repo().join("outbox-cli/Cargo.toml")).unwrap();
    assert!(cli_toml.contains("name = \"outbox\""), "the bin target is `outbox`");
    assert!(recipe.contains("USER 65532"), "runs as a non-root user");
}
