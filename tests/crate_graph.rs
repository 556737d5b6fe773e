//! The router reaches an engine only through strata-engine-api (issue 37): its library links no
//! engine, kernels, collective or CUDA crate (`cargo tree -e normal`: its tests may start real
//! engines as dev-dependencies). The canary: strata-node's own graph does hold them, so the
//! check can see what it looks for.

use std::process::Command;

/// The crates `package`'s library links, one name per line (`cargo tree -e normal`).
fn linked(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
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
