//! Shared by the SDK tests: a tiny synthesized model served on 127.0.0.1 in-process, driven by
//! a Python script with an official client SDK. The SDKs are installed by
//! `scripts/fetch-test-data.sh`; without them the tests fail (they never skip).

pub mod http;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::backend::{Backend, BackendError, CpuBackend, RowSampling, StepOutput, StepSeq};
use strata_node::kv::{BlockId, KvBlockIo, KvError};
use strata_node::scheduler::SchedulerLimits;
use strata_node::{Engine, EngineConfig};
use strata_node::{EngineSpec, KvBudget, LoadedModel, ServingParts, grammar_compiler};
use strata_router::auth::ApiKey;
use strata_router::state::AppState;
use strata_router::{Access, ServeConfig, ServedModel, ServingOptions, load_state, serve_on_with};

/// The SDK checkout under target/test-data/py, checked to hold `marker` (a file of the package);
/// `FOLDER:FILE` names another folder of target/test-data (an SDK kept apart from the others'
/// dependencies).
fn python_packages(marker: &str) -> PathBuf {
    let (folder, marker) = marker.split_once(':').unwrap_or(("py", marker));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-data")
        .join(folder);
    assert!(
        dir.join(marker).is_file(),
        "{marker} is missing from {}: run scripts/fetch-test-data.sh from the repository root",
        dir.display()
    );
    dir
}

/// Writes framed outputs with `write` into a fresh directory and runs `router/tests/<script>
/// --framed DIR` against them; the test fails with the script's output unless it exits 0.
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn run_framed_script(marker: &str, script: &str, write: impl FnOnce(&Path)) {
    let packages = python_packages(marker);
    let framed = tempfile::tempdir().unwrap();
    write(framed.path());
    let output = Command::new("python3")
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests")
                .join(script),
        )
        .arg("--framed")
        .arg(framed.path())
        .env("PYTHONPATH", &packages)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 ({e})"));
    assert!(
        output.status.success(),
        "{script} --framed failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

/// Serves a tiny Qwen3 as `tiny-qwen3` and runs `router/tests/<script>` with
/// `--base-url http://127.0.0.1:PORT<base_path> --model tiny-qwen3 --context-window N`;
/// the test fails with the script's output unless it exits 0.
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn run_sdk_script(marker: &str, script: &str, base_path: &str) {
    run_sdk_script_on(marker, script, base_path, &SdkServer::default());
}

/// What the server of an SDK script adds to the defaults: other names for the model
/// (`--served-model-name tiny-qwen3 ALIAS…`) and a key every request must carry
/// (`--api-key KEY`). The script gets them as `--alias ALIAS` (each) and `--api-key KEY`.
#[derive(Default)]
pub struct SdkServer {
    pub aliases: &'static [&'static str],
    pub api_key: Option<&'static str>,
    /// More arguments for the script.
    pub args: &'static [&'static str],
}

/// Serves `config` (its model loaded now) with `access` on a runtime of its own while `run`
/// gets the port; stops the server once `run` returns, and returns what it did.
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn serve_while<T>(config: &ServeConfig, access: Access, run: impl FnOnce(u16) -> T) -> T {
    let state = load_state(config).unwrap();
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
    let serving = runtime.spawn(async move {
        serve_on_with(listener, state, &access, async {
            let _ = stopped.await;
        })
        .await
    });
    let out = run(port);
    let _ = stop.send(());
    runtime.block_on(serving).unwrap().unwrap();
    out
}

/// The SDK tests' model, a tiny synthesized Qwen3, written into `dir`; returns its context
/// window, which holds the synthesized template's tool instructions (~270 tokens).
fn synth_sdk_model(dir: &Path) -> usize {
    let spec = SynthSpec {
        max_position: 1024,
        ..SynthSpec::tiny(Architecture::Qwen3, 1)
    };
    synthesize(&spec, dir, None).unwrap();
    spec.max_position
}

/// The SDK tests' server of the model in `dir`, served as `tiny-qwen3` on a free port, with
/// `speculative` decoding when given.
fn sdk_serve_config(
    dir: &Path,
    speculative: Option<strata_node::speculative::SpeculativeConfig>,
) -> ServeConfig {
    ServeConfig {
        model_dir: dir.to_path_buf(),
        model_name: "tiny-qwen3".into(),
        owned_by: "strata (test)".into(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        engine: std::sync::Arc::new(EngineSpec {
            kv: KvBudget::Bytes(16 << 20),
            speculative,
            ..EngineSpec::default()
        }),
        options: ServingOptions::default(),
    }
}

/// [`run_sdk_script`] against a server presented as `server` says.
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn run_sdk_script_on(marker: &str, script: &str, base_path: &str, server: &SdkServer) {
    let packages = python_packages(marker);
    let model_dir = tempfile::tempdir().unwrap();
    let window = synth_sdk_model(model_dir.path());
    let config = ServeConfig {
        options: ServingOptions {
            aliases: server.aliases.iter().map(|a| a.to_string()).collect(),
            ..ServingOptions::default()
        },
        ..sdk_serve_config(model_dir.path(), None)
    };
    let access = Access {
        api_key: server.api_key.map(|k| ApiKey::new(k).unwrap()),
        ..Access::default()
    };
    let mut served = Vec::new();
    for alias in server.aliases {
        served.extend(["--alias", alias]);
    }
    if let Some(key) = server.api_key {
        served.extend(["--api-key", key]);
    }
    served.extend(server.args);

    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let output = serve_while(&config, access, |port| {
        Command::new("python3")
            .arg(&path)
            .args(["--base-url", &format!("http://127.0.0.1:{port}{base_path}")])
            .args(["--model", &config.model_name])
            .args(["--context-window", &window.to_string()])
            .args(&served)
            .env("PYTHONPATH", &packages)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run python3 ({e}): install Python 3, then run \
                     scripts/fetch-test-data.sh"
                )
            })
    });
    assert!(
        output.status.success(),
        "{script} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

/// `script` with the official SDK against two servers of one tiny model: `--plain-url` decoding
/// plainly and `--spec-url` with `speculative` (the script compares what both stream).
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn run_sdk_script_on_pair(
    marker: &str,
    script: &str,
    speculative: strata_node::speculative::SpeculativeConfig,
) {
    let packages = python_packages(marker);
    let model_dir = tempfile::tempdir().unwrap();
    synth_sdk_model(model_dir.path());
    let config = |speculative| sdk_serve_config(model_dir.path(), speculative);
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let output = serve_while(&config(None), Access::default(), |plain| {
        serve_while(&config(Some(speculative)), Access::default(), |spec| {
            Command::new("python3")
                .arg(&path)
                .args(["--plain-url", &format!("http://127.0.0.1:{plain}")])
                .args(["--spec-url", &format!("http://127.0.0.1:{spec}")])
                .args(["--model", "tiny-qwen3"])
                .env("PYTHONPATH", &packages)
                .output()
                .unwrap_or_else(|e| panic!("cannot run python3 ({e})"))
        })
    });
    assert!(
        output.status.success(),
        "{script} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

/// The CPU backend slowed to `delay` per step, counting its steps.
struct PacedBackend {
    inner: CpuBackend,
    delay: Duration,
    steps: Arc<AtomicUsize>,
}

impl KvBlockIo for PacedBackend {
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        self.inner.export_block(id, out)
    }
    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        self.inner.import_block(id, data)
    }
}

impl Backend for PacedBackend {
    fn model_config(&self) -> &strata_model::ModelConfig {
        self.inner.model_config()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn kv_layout(&self) -> String {
        self.inner.kv_layout()
    }
    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        self.steps.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.delay);
        self.inner.step(seqs)
    }
    fn embeds(&self) -> bool {
        self.inner.embeds()
    }
    fn step_sampling(
        &mut self,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
    ) -> Result<StepOutput, BackendError> {
        self.steps.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.delay);
        self.inner.step_sampling(seqs, sampling)
    }
}

/// A tiny synthesized Qwen3 served as `tiny` (no end-of-sequence ids: it runs to `max_tokens`)
/// on a backend that takes `delay` per step and counts its steps in `steps`. The checkpoint
/// lives in `model_dir`.
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn paced_tiny_state(model_dir: &Path, delay: Duration, steps: Arc<AtomicUsize>) -> AppState {
    synthesize(&SynthSpec::tiny(Architecture::Qwen3, 1), model_dir, None).unwrap();
    served_state(model_dir, delay, steps)
}

/// A tiny synthesized Qwen3-MoE (8 experts, 2 per token, a dense layer between two sparse ones)
/// served as `tiny`, like [`paced_tiny_state`].
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn tiny_moe_state(model_dir: &Path) -> AppState {
    synthesize(&SynthSpec::tiny_moe(1), model_dir, None).unwrap();
    served_state(model_dir, Duration::ZERO, Default::default())
}

/// The checkpoint in `model_dir` served as `tiny` on a backend taking `delay` per step.
fn served_state(model_dir: &Path, delay: Duration, steps: Arc<AtomicUsize>) -> AppState {
    let loaded = LoadedModel::load(model_dir).unwrap();
    let grammar = grammar_compiler(
        &loaded.tokenizer,
        loaded.model.config().vocab_size,
        &loaded.eos_token_ids,
    );
    let backend = PacedBackend {
        inner: CpuBackend::new(loaded.model, 16, 16 << 20),
        delay,
        steps,
    };
    let engine = Engine::start(
        Box::new(backend),
        EngineConfig {
            limits: SchedulerLimits::default(),
            tiers: Default::default(),
            eos_token_ids: Vec::new(),
            grammar,
            speculative: None,
        },
    )
    .unwrap();
    let parts = ServingParts {
        tokenizer: loaded.tokenizer,
        generation_config: loaded.generation_config,
        embedding: loaded.embedding,
        template: loaded.template,
    };
    Arc::new(ServedModel::new(
        "tiny".into(),
        "test".into(),
        strata_router::EngineHandle::local(engine),
        parts,
    ))
}

/// `/metrics` text with the `model_name` label every `strata_` sample carries taken out, so
/// that tests can look for `name value` and `name{other labels} value`.
#[allow(dead_code)] // each test crate includes this module; not all use every helper
pub fn unlabelled(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        out.push_str(&without_model_label(line));
        out.push('\n');
    }
    out
}

#[allow(dead_code)] // used by `unlabelled`, which not every test crate uses
fn without_model_label(line: &str) -> String {
    const LABEL: &str = "model_name=\"";
    let Some(at) = line.find(LABEL) else {
        return line.to_string();
    };
    let (before, rest) = (&line[..at], &line[at + LABEL.len()..]);
    let Some(end) = rest.find('"') else {
        return line.to_string();
    };
    let after = &rest[end + 1..];
    match (
        before.strip_suffix('{'),
        after.strip_prefix('}'),
        after.strip_prefix(','),
    ) {
        (Some(name), Some(value), _) => format!("{name}{value}"),
        (_, _, Some(others)) => format!("{before}{others}"),
        _ => line.to_string(),
    }
}
