//! The GPU batteries' summary code runs in CI on a real run's files (issue 39), so a battery never
//! dies on its own plumbing on the GPU machine: `scripts/device/serve_bench_summary.py` over the
//! raw outputs of an H100 run of `scripts/device/serve_bench.sh` (RUN_ORDER=1, 37611c3; the
//! `.log` files left out), kept in `tests/fixtures/serve_bench_h100.tar.gz`.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn serve_bench_writes_its_receipt_and_sets_each_arm_against_its_own_microbenchmark() {
    let dir = tempfile::tempdir().unwrap();
    let untar = Command::new("tar")
        .arg("xzf")
        .arg(root().join("tests/fixtures/serve_bench_h100.tar.gz"))
        .arg("-C")
        .arg(dir.path())
        .status()
        .expect("tar");
    assert!(untar.success());
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
