//! The router reaches an engine only through strata-engine-api (issue 37): its library links no
//! engine, kernels, collective or CUDA crate (`cargo tree -e normal`: its tests may start real
//! engines as dev-dependencies). The canary: strata-node's own graph does hold them, so the
//! check can see what it looks for.

use std::process::Command;

/// Cargo, as the test harness names it (`CARGO`, set by cargo for its tests).
fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// The crates `package`'s library links, one name per line (`cargo tree -e normal`).
fn linked(package: &str) -> Vec<String> {
    let out = cargo()
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

const ENGINE_SIDE: [&str; 4] = [
    "strata-node",
    "strata-kernels",
    "strata-collective",
    "cudarc",
];

#[test]
fn the_router_links_no_engine_kernels_or_cuda() {
    let router = linked("strata-router");
    assert!(
        router.iter().any(|c| c == "strata-engine-api"),
        "{router:?}"
    );
    let found: Vec<&str> = ENGINE_SIDE
        .into_iter()
        .filter(|c| router.iter().any(|l| l == c))
        .collect();
    assert!(found.is_empty(), "strata-router links {found:?}");
    // Canary: the engine's own graph holds every one of them.
    let node = linked("strata-node");
    for c in ENGINE_SIDE.into_iter().skip(1) {
        assert!(node.iter().any(|l| l == c), "strata-node does not link {c}");
    }
}

/// Each workspace crate's library dependencies among the workspace's crates, by name.
type Graph = std::collections::BTreeMap<String, std::collections::BTreeSet<String>>;

/// The graph `cargo metadata` reads from the manifests (normal dependencies only).
fn manifest_graph() -> Graph {
    let out = cargo()
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = meta["packages"].as_array().unwrap();
    let names: std::collections::BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap().to_string())
                .filter(|d| names.contains(d))
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

/// The graph docs/ARCHITECTURE.md draws in its `crate-graph` block: `crate: dep dep …`.
fn documented_graph(doc: &str) -> Graph {
    let block = doc
        .split("```crate-graph\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/ARCHITECTURE.md holds a crate-graph block");
    block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let (name, deps) = line.split_once(':').expect("`crate: deps`");
            let deps = deps.split_whitespace().map(str::to_string).collect();
            (name.trim().to_string(), deps)
        })
        .collect()
}

#[test]
fn the_architecture_doc_draws_the_crate_graph_the_manifests_declare() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md"),
    )
    .unwrap();
    let drawn = documented_graph(&doc);
    let declared = manifest_graph();
    assert_eq!(
        drawn, declared,
        "docs/ARCHITECTURE.md's crate-graph block differs from the manifests"
    );
    // Canary: an edge the manifests do not declare is seen.
    let extra = doc.replace(
        "strata-router: strata-protocol",
        "strata-router: strata-node strata-protocol",
    );
    assert_ne!(documented_graph(&extra), declared);
}
