//! `scripts/device/moe.sh` in its CPU mode: the mixture-of-experts GPU battery must not fail on
//! its own plumbing (synthesizing the three families, flags, serving, the summary) when a device
//! is lent. The same steps run on the CPU reference: every family's staggered sequences equal
//! their solo runs, and the three surfaces answer on the shared-expert model.

use std::process::Command;

#[test]
fn the_moe_battery_runs_on_the_cpu() {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new("bash")
        .arg("scripts/device/moe.sh")
        .arg(out.path())
        .env("STRATA_BIN", env!("CARGO_BIN_EXE_strata"))
        .env("DEVICE", "cpu")
        .env("PORT", "18393")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run bash");
    let summary = std::fs::read_to_string(out.path().join("summary.txt")).unwrap_or_default();
    assert!(status.success(), "moe.sh failed:\n{summary}");
    for family in ["qwen3", "qwen2", "mixtral"] {
        let path = out.path().join(format!("invariance-{family}.json"));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(json["passed"], true, "{family}: {json}");
        assert!(
            summary.contains(&format!("invariance {family}: passed=True")),
            "{summary}"
        );
    }
    for surface in ["openai", "anthropic", "converse"] {
        assert!(
            summary.contains(&format!("served {surface}: HTTP 200")),
            "{summary}"
        );
    }
    assert!(out.path().join("logs.tar.gz").exists());
}
