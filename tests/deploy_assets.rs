//! The deployment files under deploy/ checked by the tools made for them, each with a canary the
//! tool must reject:
//! - the systemd units by `systemd-analyze verify` (their ExecStart pointed at the built binary,
//!   whose flags must accept the units' arguments);
//! - the Kubernetes manifests by kubernetes-validate (strict: unknown fields refused) against the
//!   Kubernetes schemas it bundles, and every `strata` command they run, probes and the member
//!   start script included, by the binary's own parser (kubernetes.rs);
//! - the Dockerfile by hadolint, and its stages against the images the manifests name;
//! - the Grafana dashboard by TypeScript's compiler against `@grafana/schema`'s `Dashboard` type
//!   (generated from Grafana's dashboard schema), and its structure (its metric names are checked
//!   against live servers by tests/cluster_serving.rs).
//!
//! The tools are installed by scripts/fetch-test-data.sh under target/test-data.

#[path = "deploy_assets/docker.rs"]
mod docker;
#[path = "deploy_assets/kubernetes.rs"]
mod kubernetes;

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// `target/test-data/<dir>`, which scripts/fetch-test-data.sh fills.
fn test_data(dir: &str) -> PathBuf {
    let path = repo().join("target/test-data").join(dir);
    assert!(
        path.is_dir(),
        "{} is missing: run scripts/fetch-test-data.sh from the repository root",
        path.display()
    );
    path
}

const UNITS: [&str; 3] = [
    "strata-member.service",
    "strata-node.service",
    "strata-router.service",
];

/// `systemd-analyze verify` of `units` (paths); its status and everything it printed.
fn verify(units: &[PathBuf]) -> (bool, String) {
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(units)
        .env("SYSTEMD_LOG_LEVEL", "warning")
        .output()
        .unwrap_or_else(|e| panic!("cannot run systemd-analyze ({e}): install systemd"));
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), printed)
}

/// The unit's text with its ExecStart on the built binary.
fn localized(unit: &str) -> String {
    let text = std::fs::read_to_string(repo().join("deploy/systemd").join(unit)).unwrap();
    text.replace("/usr/local/bin/strata", env!("CARGO_BIN_EXE_strata"))
}

#[test]
fn systemd_units_verify_and_their_commands_parse() {
    let tmp = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for unit in UNITS {
        let text = localized(unit);
        let path = tmp.path().join(unit);
        std::fs::write(&path, &text).unwrap();
        paths.push(path);
        // The arguments are the binary's: with --help appended, clap refuses an unknown flag
        // before it prints the help.
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap_or_else(|| panic!("{unit} has no ExecStart"));
        let mut words = exec.split_whitespace();
        let binary = words.next().unwrap();
        let out = Command::new(binary)
            .args(words)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{unit}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (ok, printed) = verify(&paths);
    assert!(ok && printed.trim().is_empty(), "{printed}");

    // Canary: a directive systemd cannot parse is reported.
    let bad = tmp.path().join("bad.service");
    let text =
        localized("strata-router.service").replace("Restart=on-failure", "Restart=sometimes");
    std::fs::write(&bad, text).unwrap();
    let (_, printed) = verify(&[bad]);
    assert!(
        printed.contains("sometimes"),
        "the canary passed: {printed:?}"
    );
}

#[test]
fn the_grafana_dashboard_is_well_formed() {
    let text =
        std::fs::read_to_string(repo().join("deploy/grafana/strata-dashboard.json")).unwrap();
    let d: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(d["uid"], "strata-serving");
    let panels = d["panels"].as_array().unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "panel ids repeat");
        let grid = &p["gridPos"];
        let (x, w) = (grid["x"].as_u64().unwrap(), grid["w"].as_u64().unwrap());
        assert!(x + w <= 24, "{} overflows the 24-column grid", p["title"]);
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            assert_eq!(
                expr.matches('(').count(),
                expr.matches(')').count(),
                "unbalanced query in {}: {expr}",
                p["title"]
            );
        }
    }
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "model"]);
}

/// TypeScript's verdict on `dashboard` as a value of `@grafana/schema`'s `Dashboard`: whether it
/// compiles, and the compiler's messages. An object literal meets excess-property checks, so a
/// field the schema lacks is an error, as is a value of the wrong type.
fn typecheck_dashboard(dashboard: &serde_json::Value) -> (bool, String) {
    let packages = test_data("grafana-schema").join("node_modules");
    let tmp = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&packages, tmp.path().join("node_modules")).unwrap();
    let source = format!(
        "import type {{ Dashboard }} from \"@grafana/schema\";\n\
         export const dashboard: Dashboard = {};\n",
        serde_json::to_string_pretty(dashboard).unwrap()
    );
    std::fs::write(tmp.path().join("dashboard.ts"), source).unwrap();
    // The package's own declarations are not checked (--skipLibCheck), only the dashboard.
    let out = Command::new("node")
        .arg(packages.join("typescript/bin/tsc"))
        .args([
            "--noEmit",
            "--strict",
            "--skipLibCheck",
            "--pretty",
            "false",
            "--target",
            "es2022",
            "--module",
            "nodenext",
            "--moduleResolution",
            "nodenext",
            "dashboard.ts",
        ])
        .current_dir(tmp.path())
        .output()
        .expect("run node");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), printed)
}

#[test]
fn the_grafana_dashboard_matches_grafanas_schema() {
    let text =
        std::fs::read_to_string(repo().join("deploy/grafana/strata-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (ok, printed) = typecheck_dashboard(&dashboard);
    assert!(ok, "{printed}");

    // Canaries: a field the schema does not have, and a panel position given as text.
    let mut unknown = dashboard.clone();
    unknown["refreshInterval"] = "10s".into();
    let mut mistyped = dashboard.clone();
    mistyped["panels"][0]["gridPos"]["w"] = "12".into();
    for (canary, finding) in [
        (
            unknown,
            "refreshInterval\"' does not exist in type 'Dashboard'",
        ),
        (mistyped, "Type 'string' is not assignable to type 'number'"),
    ] {
        let (ok, printed) = typecheck_dashboard(&canary);
        assert!(
            !ok && printed.contains(finding),
            "the canary passed: {printed}"
        );
    }
}
