//! The deployment files under deploy/ checked by the tools made for them: the systemd units by
//! `systemd-analyze verify` (their ExecStart pointed at the built binary, whose flags must accept
//! the units' arguments), with a canary unit carrying a bad directive that must be reported; the
//! Grafana dashboard's structure (its metric names are checked against live servers by
//! tests/cluster_serving.rs).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
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
