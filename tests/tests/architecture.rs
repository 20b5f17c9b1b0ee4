//! The dependency invariants ARCHITECTURE.md states, held by reading the
//! crates' manifests (`cargo metadata`) and their modules' imports:
//! - `outbox-core` does no I/O: it depends on neither sqlx, rdkafka nor tokio;
//! - `outbox-core` holds no test doubles: the in-memory store and the
//!   conformance suite are `outbox-memory`'s, which does no I/O either and
//!   depends on neither `outbox-producer` nor `outbox-consumer`;
//! - `outbox-producer` and `outbox-consumer` never depend on each other;
//! - the decision modules of `outbox-core` import no store or broker trait;
//! - the modules of `outbox-core`, `outbox-producer` and `outbox-memory`
//!   (and the files of `outbox-memory`'s two modules) import each other in
//!   no circle (imports of a crate's `error` module are not counted: the
//!   error type names domain values, and every module returns it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

/// The host's target triple (`rustc -vV`).
fn host_triple() -> String {
    let out = std::process::Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into())).arg("-vV").output().expect("rustc -vV");
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| l.strip_prefix("host: ").map(str::to_owned)).expect("rustc -vV names the host")
}

/// Every package a package depends on for its build (normal dependencies,
/// transitively; dev- and build-dependencies left out), on this host: a
/// fresh machine's registry holds only the crates the host builds, and an
/// unfiltered `cargo metadata --offline` wants every platform's.
fn normal_closure(package: &str) -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--offline", "--filter-platform", &host_triple()])
        .current_dir(workspace())
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let name_of: BTreeMap<String, String> =
        meta["packages"].as_array().unwrap().iter().map(|p| (p["id"].as_str().unwrap().to_owned(), p["name"].as_str().unwrap().to_owned())).collect();
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let normal = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null()))
            .map(|d| d["pkg"].as_str().unwrap().to_owned())
            .collect();
        deps.insert(node["id"].as_str().unwrap().to_owned(), normal);
    }
    let start = name_of.iter().find(|(_, n)| n.as_str() == package).map(|(id, _)| id.clone()).unwrap_or_else(|| panic!("no package {package}"));
    let mut seen = BTreeSet::new();
    let mut todo = vec![start];
    while let Some(id) = todo.pop() {
        for d in deps.get(&id).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen.into_iter().map(|id| name_of[&id].clone()).collect()
}

#[test]
fn core_does_no_io_and_producer_and_consumer_never_depend_on_each_other() {
    let core = normal_closure("outbox-core");
    for io in ["sqlx", "rdkafka", "tokio"] {
        assert!(!core.contains(io), "outbox-core depends on {io}");
    }
    assert!(!normal_closure("outbox-producer").contains("outbox-consumer"), "outbox-producer depends on outbox-consumer");
    assert!(!normal_closure("outbox-consumer").contains("outbox-producer"), "outbox-consumer depends on outbox-producer");
}

#[test]
fn the_in_memory_stores_do_no_io_and_depend_on_no_service() {
    let memory = normal_closure("outbox-memory");
    assert!(memory.contains("outbox-core"), "outbox-memory is read: {memory:?}");
    for dep in ["sqlx", "rdkafka", "tokio", "outbox-producer", "outbox-consumer"] {
        assert!(!memory.contains(dep), "outbox-memory depends on {dep}");
    }
    assert!(!normal_closure("outbox-core").contains("outbox-memory"), "outbox-core depends on outbox-memory");
}

/// The test doubles left the protocol crate: no `memory` or `conformance`
/// module in `outbox-core` (the in-memory store and the conformance suite
/// are `outbox-memory`'s).
#[test]
fn core_holds_no_test_doubles() {
    let src = workspace().join("outbox-core/src");
    assert!(src.join("lib.rs").exists(), "outbox-core is read");
    for m in ["memory", "conformance"] {
        assert!(!src.join(format!("{m}.rs")).exists() && !src.join(m).exists(), "outbox-core has a {m} module again: it belongs in outbox-memory");
        let lib = code_of(&src.join("lib.rs"));
        assert!(!lib.contains(&format!("mod {m};")), "outbox-core's lib.rs declares `mod {m}`");
    }
    let memory = workspace().join("outbox-memory/src");
    assert!(memory.join("memory/mod.rs").exists() && memory.join("conformance/mod.rs").exists(), "outbox-memory holds them");
}

/// A module's code without comments and without its `#[cfg(test)]` tail.
fn code_of(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let tests = text.match_indices("#[cfg(test)]").find(|(i, _)| text[i + "#[cfg(test)]".len()..].trim_start().starts_with("mod "));
    let text = match tests {
        Some((i, _)) => &text[..i],
        None => &text[..],
    };
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The code of a top-level module: `src/m.rs`, or every file of `src/m/`.
fn module_code(src: &Path, m: &str) -> String {
    let file = src.join(format!("{m}.rs"));
    let dir = src.join(m);
    let mut code = if file.exists() { code_of(&file) } else { String::new() };
    if dir.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "rs")).collect();
        files.sort();
        for f in files {
            code.push('\n');
            code.push_str(&code_of(&f));
        }
    }
    code
}

/// The top-level modules of a crate (`src/*.rs`, and `src/m/` with its
/// files as one module) and the crate modules each names (`crate::m`,
/// `use crate::{m, ...}`).
fn module_graph(krate: &str) -> BTreeMap<String, BTreeSet<String>> {
    modules_naming(&workspace().join(krate).join("src"), "crate::")
}

/// The modules of the directory `src` (`*.rs` but `lib`, `main` and `mod`,
/// and `m/` with its files as one module) and which of them each names
/// through `prefix` (`crate::` for a crate's top-level modules, `super::`
/// for the files of a directory module).
fn modules_naming(src: &Path, prefix: &str) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeSet<String> = std::fs::read_dir(src)
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            if e.path().is_dir() {
                e.path().join("mod.rs").exists().then_some(name)
            } else {
                name.strip_suffix(".rs").map(str::to_owned)
            }
        })
        .filter(|m| m != "lib" && m != "main" && m != "mod")
        .collect();
    let mut graph = BTreeMap::new();
    for m in &modules {
        let code = module_code(src, m);
        let mut named = BTreeSet::new();
        for (i, _) in code.match_indices(prefix) {
            let rest = &code[i + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                named.extend(group.split(',').map(|p| p.trim().split("::").next().unwrap_or("").trim().to_owned()));
            } else {
                named.insert(rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect());
            }
        }
        named.retain(|n| n != m && modules.contains(n));
        graph.insert(m.clone(), named);
    }
    graph
}

/// A circle of imports, if any (edges into `error` left out).
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(m: &str, graph: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_owned());
            return Some(circle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for n in graph[m].iter().filter(|n| n.as_str() != "error") {
            if let Some(c) = visit(n, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_modules_of_core_producer_and_memory_import_each_other_in_no_circle() {
    for krate in ["outbox-core", "outbox-producer", "outbox-memory"] {
        let graph = module_graph(krate);
        if krate == "outbox-memory" {
            assert!(graph.contains_key("memory") && graph.contains_key("conformance"), "{krate}: read {:?}", graph.keys());
        } else {
            assert!(graph.len() > 10, "{krate}: read only {} modules", graph.len());
        }
        if krate == "outbox-producer" {
            assert!(graph.contains_key("kafka") && graph.contains_key("pg"), "the directory modules are read: {:?}", graph.keys());
            assert!(graph["pg"].contains("service_store"), "pg's files are read: {:?}", graph["pg"]);
        }
        if let Some(circle) = find_circle(&graph) {
            panic!("{krate}: a circle of imports: {}", circle.join(" -> "));
        }
    }
    // outbox-memory's two modules are directories of files with one job
    // each; their files (naming each other through `super::`) too.
    for dir in ["memory", "conformance"] {
        let graph = modules_naming(&workspace().join("outbox-memory/src").join(dir), "super::");
        assert!(graph.len() > 5, "outbox-memory's {dir}: read only {} files", graph.len());
        assert!(graph.values().any(|named| !named.is_empty()), "outbox-memory's {dir}: no file names another: {graph:?}");
        if let Some(circle) = find_circle(&graph) {
            panic!("outbox-memory's {dir}: a circle of imports: {}", circle.join(" -> "));
        }
    }
}

#[test]
fn the_circle_check_sees_a_circle() {
    let graph: BTreeMap<String, BTreeSet<String>> = [("a", vec!["b"]), ("b", vec!["c", "error"]), ("c", vec!["a"]), ("error", vec!["a"])]
        .into_iter()
        .map(|(m, ns)| (m.to_owned(), ns.into_iter().map(str::to_owned).collect()))
        .collect();
    assert_eq!(find_circle(&graph), Some(vec!["a".to_owned(), "b".to_owned(), "c".to_owned(), "a".to_owned()]));
    let only_through_error: BTreeMap<String, BTreeSet<String>> =
        [("a", vec!["error"]), ("error", vec!["a"])].into_iter().map(|(m, ns)| (m.to_owned(), ns.into_iter().map(str::to_owned).collect())).collect();
    assert_eq!(find_circle(&only_through_error), None);
}

/// The modules that decide, with no I/O and no store: the stores call them.
const DECISIONS: [&str; 11] = ["claim", "command", "compare", "findings", "receipt", "reconcile", "retention", "state", "stream", "takeover", "migration"];

#[test]
fn decision_modules_import_no_store_or_broker_trait() {
    let src = workspace().join("outbox-core/src");
    let traits = ["OutboxStore", "Broker", "BypassScanStore", "FindingsStore"];
    let mut read = 0;
    for m in DECISIONS {
        if !src.join(format!("{m}.rs")).exists() && !src.join(m).is_dir() {
            continue;
        }
        read += 1;
        let code = module_code(&src, m);
        assert!(!code.contains("crate::store"), "{m} imports the store module");
        for t in traits {
            let uses = code.match_indices(t).any(|(i, _)| {
                let before = code[..i].chars().next_back().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
                let after = code[i + t.len()..].chars().next().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
                before && after
            });
            assert!(!uses, "{m} names the trait {t}");
        }
    }
    assert!(read >= 9, "read only {read} decision modules");
}

/// What production runs is what the simulator runs: `outbox reconcile`
/// loops through `Reconciler::run_observed` (the loop of `Reconciler::run`,
/// which the simulator runs), never round by round on its own.
#[test]
fn the_cli_reconciles_through_the_reconcilers_own_loop() {
    // Every file of the crate, directory modules (`src/commands/`) too.
    let mut dirs = vec![workspace().join("outbox-cli/src")];
    let mut calls_run = false;
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let code = code_of(&path);
            assert!(!code.contains(".run_round("), "{} drives reconciler rounds itself", path.display());
            calls_run |= code.contains(".run_observed(");
        }
    }
    assert!(calls_run, "outbox-cli never calls Reconciler::run_observed");
}
