//! The official `openai` Python SDK's Responses API against a live server: a tiny synthesized
//! model served on 127.0.0.1 in-process, driven by router/tests/openai_responses.py. The SDK is
//! installed by `scripts/fetch-test-data.sh`; without it this test fails (it never skips).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_router::{ServeConfig, load_state, serve_on};

fn python_packages() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-data/py");
    assert!(
        dir.join("openai/_version.py").is_file(),
        "the openai Python SDK is missing from {}: run scripts/fetch-test-data.sh from the \
         repository root",
        dir.display()
    );
    dir
}

#[test]
fn official_openai_sdk_responses_work_unmodified() {
    let packages = python_packages();
    let model_dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec::tiny(Architecture::Qwen3, 1);
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

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_responses.py");
    let output = Command::new("python3")
        .arg(&script)
        .args(["--base-url", &format!("http://127.0.0.1:{port}/v1")])
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
        "openai_responses.py failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}
