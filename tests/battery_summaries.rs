//! The GPU batteries' summary code runs in CI on a real run's files (issue 39), so a battery never
//! dies on its own plumbing on the GPU machine: `scripts/device/serve_bench_summary.py` over the
//! raw outputs of an H100 run of `scripts/device/serve_bench.sh` (RUN_ORDER=1, 37611c3; the
//! `.log` files left out), kept in `tests/fixtures/serve_bench_h100.tar.gz`; and
//! `scripts/device/quant_engine.sh`'s receipt over the files of an H100 run of its decode and
//! tiles parts (dd6b66f) with two `strata gpu decode --profile` outputs of the 4-layer 8B shape
//! (the same day, an earlier build), in `tests/fixtures/quant_engine_h100.tar.gz`.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fixture of `tests/fixtures/` unpacked into a fresh directory.
fn unpacked(fixture: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let untar = Command::new("tar")
        .arg("xzf")
        .arg(root().join("tests/fixtures").join(fixture))
        .arg("-C")
        .arg(dir.path())
        .status()
        .expect("tar");
    assert!(untar.success(), "{fixture} did not unpack");
    dir
}

#[test]
fn serve_bench_writes_its_receipt_and_sets_each_arm_against_its_own_microbenchmark() {
    let dir = unpacked("serve_bench_h100.tar.gz");
    let out = Command::new("python3")
        .arg(root().join("scripts/device/serve_bench_summary.py"))
        .arg(dir.path())
        .arg("0")
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the summary failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Both arms are printed, each against its own kernels' microbenchmark: the run-order arm's
    // 2 296 tok/s at 64 over its 5 105 tok/s, not the default's.
    assert!(
        stdout.contains("[new]") && stdout.contains("[runorder]"),
        "{stdout}"
    );
    let c64 = |arm: &str| {
        stdout
            .split(&format!("[{arm}]"))
            .nth(1)
            .and_then(|rest| rest.lines().find(|l| l.trim_start().starts_with("c64 ")))
            .unwrap_or_else(|| panic!("no c64 line for {arm}:\n{stdout}"))
            .to_string()
    };
    assert!(c64("new").contains("vs micro  0.68"), "{}", c64("new"));
    assert!(
        c64("runorder").contains("vs micro  0.45"),
        "{}",
        c64("runorder")
    );
    let receipt: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("receipt.json")).expect("receipt.json"),
    )
    .expect("JSON");
    assert_eq!(
        receipt["gpu"],
        "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB"
    );
    for arm in ["new", "runorder"] {
        let c64 = &receipt["serve"][arm]["c64"];
        assert!(c64["engine_steps"].as_f64().unwrap() > 0.0, "{arm}");
        assert!(
            c64["gpu_utilization_mean_pct"].as_f64().unwrap() > 90.0,
            "{arm}"
        );
    }
}

/// `quant_engine.sh` with no part to run assembles its receipt from what OUT already holds: the
/// decode arms, the tiles' per-M summary and the profiles, and prints each arm's tokens/s.
#[test]
fn quant_engine_assembles_its_receipt_from_a_real_runs_files() {
    let dir = unpacked("quant_engine_h100.tar.gz");
    let out = Command::new("bash")
        .arg(root().join("scripts/device/quant_engine.sh"))
        .arg(dir.path())
        .env("PARTS", "none")
        .env("STRATA_BIN", env!("CARGO_BIN_EXE_strata"))
        .env("FILES", dir.path().join("files"))
        .current_dir(root())
        .output()
        .expect("bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the battery failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("nvfp4-kept       b1: 330.83"),
        "each arm's tokens/s printed:\n{stdout}"
    );
    let receipt: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("receipt.json")).expect("receipt.json"),
    )
    .expect("JSON");
    let tok_s = |arm: &str, row: usize| {
        receipt["decode"][arm]["results"][row]["tokens_per_s"]
            .as_f64()
            .unwrap_or_else(|| panic!("no {arm} row {row} in {receipt}"))
    };
    // Kept NVFP4 against bf16 at batch 1 and 64, as the run measured them.
    assert!((tok_s("nvfp4-kept", 0) / tok_s("bf16", 0) - 2.06).abs() < 0.01);
    assert!((tok_s("nvfp4-kept", 4) / tok_s("bf16", 4) - 1.24).abs() < 0.01);
    let per_m = receipt["tiles_per_m"].as_array().expect("tiles_per_m");
    assert_eq!(per_m.len(), 5);
    assert_eq!(per_m[0]["m"], 1);
    let profile = receipt["profile"]["nvfp4"]
        .as_array()
        .expect("the NVFP4 profile");
    assert!(
        profile
            .iter()
            .any(|l| l.as_str().is_some_and(|l| l.contains("lm head"))),
        "the profile's families kept: {profile:?}"
    );
    assert!(receipt["profile"]["bf16"].is_array());
}
