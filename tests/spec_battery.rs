//! `scripts/device/spec.sh` in its CPU mode: the GPU battery of speculative decoding must not
//! fail on its own plumbing (paths, flags, the summary) when a device is finally lent. The same
//! steps run on the CPU reference with small synthesized models, and the identity checks inside
//! (`strata bench spec`, plain and speculative engines compared request by request) must pass.

use std::process::Command;

#[test]
fn the_spec_battery_runs_on_the_cpu_and_finds_speculation_identical() {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new("bash")
        .arg("scripts/device/spec.sh")
        .arg(out.path())
        .env("STRATA_BIN", env!("CARGO_BIN_EXE_strata"))
        .env("DEVICE", "cpu")
        .env("PORT", "18391")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run bash");
    let summary = std::fs::read_to_string(out.path().join("summary.txt")).unwrap_or_default();
    assert!(status.success(), "spec.sh failed:\n{summary}");
    for report in ["gate", "speed"] {
        let text = std::fs::read_to_string(out.path().join(format!("{report}.json"))).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["identical"], true, "{report}: {text}");
        let drafts: u64 = json["arms"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|a| a["points"].as_array().unwrap())
            .map(|p| p["drafts"].as_u64().unwrap())
            .sum();
        assert!(drafts > 0, "{report}: nothing was proposed");
    }
    assert!(summary.contains("served c=8"), "{summary}");
    assert!(out.path().join("logs.tar.gz").exists());
}
