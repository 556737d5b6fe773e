//! Shared by the SDK tests: a tiny synthesized model served on 127.0.0.1 in-process, driven by
//! a Python script with an official client SDK. The SDKs are installed by
//! `scripts/fetch-test-data.sh`; without them the tests fail (they never skip).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_router::{ServeConfig, load_state, serve_on};

/// The SDK checkout under target/test-data/py, checked to hold `marker` (a file of the package).
fn python_packages(marker: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-data/py");
    assert!(
        dir.join(marker).is_file(),
        "{marker} is missing from {}: run scripts/fetch-test-data.sh from the repository root",
        dir.display()
    );
    dir
}

/// Serves a tiny Qwen3 as `tiny-qwen3` and runs `router/tests/<script>` with
/// `--base-url http://127.0.0.1:PORT<base_path> --model tiny-qwen3 --context-window N`;
/// the test fails with the script's output unless it exits 0.
pub fn run_sdk_script(marker: &str, script: &str, base_path: &str) {
    let packages = python_packages(marker);
    let model_dir = tempfile::tempdir().unwrap();
    // A window that holds the synthesized template's tool instructions (~270 tokens).
    let spec = SynthSpec {
        max_position: 1024,
        ..SynthSpec::tiny(Architecture::Qwen3, 1)
    };
    let window = spec.max_position;
    synthesize(&spec, model_dir.path(), None).unwrap();
    let config = ServeConfig {
        model_dir: model_dir.path().to_path_buf(),
        model_name: "tiny-qwen3".into(),
        owned_by: "strata (test)".into(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        kv_cache_mib: 16,
        block_size: 16,
    };
    let state = load_state(&config).unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(config.addr))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(serve_on(listener, state, async {
        let _ = stopped.await;
    }));

    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let output = Command::new("python3")
        .arg(&path)
        .args(["--base-url", &format!("http://127.0.0.1:{port}{base_path}")])
        .args(["--model", &config.model_name])
        .args(["--context-window", &window.to_string()])
        .env("PYTHONPATH", &packages)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run python3 ({e}): install Python 3, then run scripts/fetch-test-data.sh"
            )
        });
    let _ = stop.send(());
    runtime.block_on(server).unwrap().unwrap();
    assert!(
        output.status.success(),
        "{script} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}
