//! A client that hangs up mid-stream takes its generation with it: the SSE body is dropped,
//! which drops the engine stream, which cancels the request before it runs to `max_tokens`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::backend::{Backend, BackendError, CpuBackend, StepSeq};
use strata_node::kv::{BlockId, KvBlockIo};
use strata_node::scheduler::SchedulerLimits;
use strata_node::{Engine, EngineConfig};
use strata_router::state::ServingParts;
use strata_router::{LoadedModel, ServedModel, serve_on};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The CPU backend, slowed to a known pace and counting its steps.
struct PacedBackend {
    inner: CpuBackend,
    steps: Arc<AtomicUsize>,
}

impl KvBlockIo for PacedBackend {
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn export_block(&self, id: BlockId, out: &mut [u8]) {
        self.inner.export_block(id, out)
    }
    fn import_block(&mut self, id: BlockId, data: &[u8]) {
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
    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        self.steps.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(10));
        self.inner.step(seqs)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_up_mid_stream_cancels_the_generation() {
    let model_dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec::tiny(Architecture::Qwen3, 1);
    synthesize(&spec, model_dir.path(), None).unwrap();
    let loaded = LoadedModel::load(model_dir.path()).unwrap();
    let steps = Arc::new(AtomicUsize::new(0));
    let backend = PacedBackend {
        inner: CpuBackend::new(loaded.model, 16, 16 << 20),
        steps: steps.clone(),
    };
    let engine = Engine::start(
        Box::new(backend),
        EngineConfig {
            limits: SchedulerLimits::default(),
            host_blocks: 0,
            disk: None,
            eos_token_ids: Vec::new(),
        },
    )
    .unwrap();
    let parts = ServingParts {
        tokenizer: loaded.tokenizer,
        template: loaded.template,
        generation_config: loaded.generation_config,
    };
    let state = Arc::new(ServedModel::new(
        "tiny".into(),
        "test".into(),
        engine,
        parts,
    ));
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_on(listener, state, std::future::pending()));

    // No eos ids and 200 tokens at 10 ms a step: left alone this runs for two seconds.
    let body =
        r#"{"model":"tiny","prompt":"Hello","max_tokens":200,"temperature":0,"stream":true}"#;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: {") {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed before the first chunk");
        received.extend_from_slice(&buf[..n]);
    }
    drop(conn);

    // Wait until the engine goes quiet, then check it stopped well short of max_tokens.
    let mut last = usize::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = steps.load(Ordering::Relaxed);
        if now == last {
            break;
        }
        last = now;
    }
    assert!(
        last < 100,
        "the engine ran {last} steps for a client that hung up after the first chunk"
    );
}
