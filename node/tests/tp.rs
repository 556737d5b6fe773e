//! CPU tensor parallelism: greedy streams through the `Engine` at TP=2 and TP=4 are
//! byte-identical to TP=1, and a canary that reduces the row-parallel partials locally (skipping
//! the all-gather) is not — proving the comparison can fail.

use strata_model::ModelConfig;
use strata_model::config::Architecture;
use strata_model::cpu::{CpuModel, PartialsFault};
use strata_model::synth::{SynthSpec, synthesize};
use strata_model::weights::Checkpoint;
use strata_node::backend::{Backend, CpuBackend, CpuTpBackend};
use strata_node::scheduler::SchedulerLimits;
use strata_node::{Engine, EngineConfig, RequestStream};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

const BLOCK: usize = 16;
const BLOCKS: usize = 64;

fn spec(arch: Architecture, kv_heads: usize) -> SynthSpec {
    SynthSpec {
        layers: 2,
        hidden: 256,
        heads: 8,
        kv_heads,
        intermediate: 512,
        max_position: 256,
        ..SynthSpec::demo(arch, 11)
    }
}

/// The config and the mapped checkpoint a TP backend loads its ranks' slices from.
fn open(dir: &std::path::Path) -> (ModelConfig, Checkpoint) {
    (
        ModelConfig::from_dir(dir).unwrap(),
        Checkpoint::open(dir).unwrap(),
    )
}

fn engine(backend: Box<dyn Backend>) -> Engine {
    let config = EngineConfig {
        limits: SchedulerLimits::default(),
        tiers: Default::default(),
        eos_token_ids: vec![],
        grammar: None,
        speculative: None,
    };
    Engine::start(backend, config).unwrap()
}

fn request(seed: u32, len: u32, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        resume: None,
        embed: None,
        prompt: (0..len).map(|i| (i * 37 + seed * 101 + 5) % 300).collect(),
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: 0,
        deadline: None,
        constraint: None,
    }
}

fn drain(mut stream: RequestStream) -> Vec<u32> {
    let mut tokens = Vec::new();
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, .. } => tokens.push(id),
            TokenEvent::Finished { .. } => return tokens,
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                panic!("{message}")
            }
            TokenEvent::Embedding { .. } => panic!("an embedding for a generation"),
        }
    }
    panic!("stream ended without Finished");
}

/// The greedy streams of a fixed workload: two requests one after the other, then three submitted
/// together so they share steps (batched prefill and decode).
fn streams(backend: Box<dyn Backend>) -> Vec<Vec<u32>> {
    let engine = engine(backend);
    let mut out = vec![
        drain(engine.submit(request(0, 21, 12)).unwrap()),
        drain(engine.submit(request(1, 40, 8)).unwrap()),
    ];
    let batch: Vec<RequestStream> = [(2, 9, 10), (3, 33, 12), (4, 17, 6)]
        .into_iter()
        .map(|(seed, len, max)| engine.submit(request(seed, len, max)).unwrap())
        .collect();
    out.extend(batch.into_iter().map(drain));
    out
}

fn check_identical(spec: SynthSpec) {
    let (arch, kv_heads) = (spec.arch.clone(), spec.kv_heads);
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec, dir.path(), None).unwrap();
    let load = || CpuModel::load(dir.path()).unwrap();
    let (config, ckpt) = open(dir.path());
    let want = streams(Box::new(CpuBackend::with_blocks(load(), BLOCK, BLOCKS)));
    assert!(want.iter().all(|s| !s.is_empty()));
    for tp in [2, 4] {
        let backend = CpuTpBackend::with_blocks(&config, &ckpt, tp, BLOCK, BLOCKS).unwrap();
        assert_eq!(
            streams(Box::new(backend)),
            want,
            "{arch} kv_heads {kv_heads}: TP={tp} differs from TP=1"
        );
    }
}

#[test]
fn llama_gqa_tp_streams_equal_tp1() {
    // Two kv heads: sharded at TP=2, replicated (one per pair of ranks) at TP=4.
    check_identical(spec(Architecture::Llama, 2));
}

#[test]
fn qwen3_qk_norm_tp_streams_equal_tp1() {
    check_identical(spec(Architecture::Qwen3, 4));
}

#[test]
fn qwen2_biases_and_tied_head_tp_streams_equal_tp1() {
    check_identical(SynthSpec {
        tie_embeddings: true,
        ..spec(Architecture::Qwen2, 2)
    });
}

/// Gemma 3 (the real 270M file: sandwich norms, GELU-tanh, two rope bases, one kv head shared by
/// every rank) through the same layer forward at TP = 2 and 4: byte-identical to one rank.
#[test]
fn gemma3_tp_streams_equal_tp1() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-data/models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        path.is_file(),
        "missing {}: run scripts/fetch-test-data.sh from the repository root",
        path.display()
    );
    let (config, ckpt) = open(&path);
    assert!(config.gemma3.is_some());
    let one = CpuBackend::with_blocks(
        CpuModel::from_checkpoint(config.clone(), &ckpt).unwrap(),
        BLOCK,
        BLOCKS,
    );
    let want = streams(Box::new(one));
    for tp in [2, 4] {
        let backend = CpuTpBackend::with_blocks(&config, &ckpt, tp, BLOCK, BLOCKS).unwrap();
        assert_eq!(
            streams(Box::new(backend)),
            want,
            "Gemma 3: TP={tp} differs from TP=1"
        );
    }
}

#[test]
fn exported_blocks_resume_on_another_tp_backend() {
    use strata_node::kv::KvBlockIo;
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec(Architecture::Llama, 2), dir.path(), None).unwrap();
    let (config, ckpt) = open(dir.path());
    let prompt = request(6, 2 * BLOCK as u32, 1).prompt;
    let mut a = CpuTpBackend::with_blocks(&config, &ckpt, 4, BLOCK, 4).unwrap();
    let mut b = CpuTpBackend::with_blocks(&config, &ckpt, 4, BLOCK, 4).unwrap();
    let first = prefill_logits(&mut a, &prompt);
    let mut bytes = vec![0; a.block_bytes()];
    for id in 0..2 {
        a.export_block(id, &mut bytes).unwrap();
        b.import_block(id, &bytes).unwrap();
    }
    let next = [argmax(&first)];
    let decode = |backend: &mut CpuTpBackend| {
        backend
            .step(&[strata_node::backend::StepSeq {
                tokens: &next,
                first_position: prompt.len(),
                prompt_len: prompt.len(),
                block_table: &[0, 1, 2],
                logit_rows: 1,
            }])
            .unwrap()
    };
    let (want, got) = (decode(&mut a), decode(&mut b));
    assert_eq!(
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Logits of one prompt's prefill through a backend's `step`.
fn prefill_logits(backend: &mut dyn Backend, prompt: &[u32]) -> Vec<f32> {
    use strata_node::backend::StepSeq;
    let table: Vec<u32> = (0..prompt.len().div_ceil(BLOCK) as u32).collect();
    backend
        .step(&[StepSeq {
            tokens: prompt,
            first_position: 0,
            prompt_len: prompt.len(),
            block_table: &table,
            logit_rows: 1,
        }])
        .unwrap()
}

#[test]
fn canary_partials_reduced_without_the_all_gather_differ() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec(Architecture::Llama, 2), dir.path(), None).unwrap();
    let load = || CpuModel::load(dir.path()).unwrap();
    let (config, ckpt) = open(dir.path());
    let prompt = request(5, 30, 1).prompt;
    let want = prefill_logits(&mut CpuBackend::with_blocks(load(), BLOCK, 4), &prompt);
    let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut honest = CpuTpBackend::with_blocks(&config, &ckpt, 2, BLOCK, 4).unwrap();
    assert_eq!(bits(&prefill_logits(&mut honest, &prompt)), bits(&want));
    for fault in [PartialsFault::LocalSumOnly, PartialsFault::SumThenAllReduce] {
        let mut faulty =
            CpuTpBackend::with_partials_fault(&config, &ckpt, 2, BLOCK, 4, fault).unwrap();
        assert_ne!(
            bits(&prefill_logits(&mut faulty, &prompt)),
            bits(&want),
            "{fault:?} must change the logits"
        );
    }
    // Skipping the collective loses half of every o/down projection: the greedy stream changes.
    let faulty = CpuTpBackend::with_partials_fault(
        &config,
        &ckpt,
        2,
        BLOCK,
        BLOCKS,
        PartialsFault::LocalSumOnly,
    )
    .unwrap();
    let honest = CpuBackend::with_blocks(load(), BLOCK, BLOCKS);
    assert_ne!(streams(Box::new(faulty)), streams(Box::new(honest)));
}

/// A mixture of experts over 2 and 4 ranks (each holding a run of experts whole, a dense layer
/// between the sparse ones split as usual, Qwen2-MoE's shared expert on every rank): the same
/// streams as one rank.
#[test]
fn moe_experts_split_over_ranks_stream_what_one_rank_does() {
    let moe = |arch| SynthSpec {
        layers: 3,
        moe: Some(strata_model::synth::SynthMoe {
            experts: 8,
            experts_per_token: 2,
            expert_intermediate: Some(64),
            shared_expert_intermediate: (arch == Architecture::Qwen2Moe).then_some(128),
            norm_topk_prob: true,
            mlp_only_layers: if arch == Architecture::Mixtral {
                vec![]
            } else {
                vec![1]
            },
            decoder_sparse_step: None,
        }),
        ..spec(arch, 2)
    };
    for arch in [Architecture::Qwen2Moe, Architecture::Mixtral] {
        check_identical(moe(arch));
    }
    // Canary: ranks that reduce the dense partials but keep only their own experts' outputs.
    let dir = tempfile::tempdir().unwrap();
    synthesize(&moe(Architecture::Qwen2Moe), dir.path(), None).unwrap();
    let (config, ckpt) = open(dir.path());
    let prompt = request(5, 30, 1).prompt;
    let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let load = || CpuModel::load(dir.path()).unwrap();
    let want = prefill_logits(&mut CpuBackend::with_blocks(load(), BLOCK, 4), &prompt);
    let fault = PartialsFault::OwnExpertsOnly;
    let mut faulty = CpuTpBackend::with_partials_fault(&config, &ckpt, 2, BLOCK, 4, fault).unwrap();
    assert_ne!(bits(&prefill_logits(&mut faulty, &prompt)), bits(&want));
    // Experts that do not split evenly over the ranks are refused by name.
    let dir = tempfile::tempdir().unwrap();
    let mut six = moe(Architecture::Mixtral);
    six.moe.as_mut().unwrap().experts = 6;
    synthesize(&six, dir.path(), None).unwrap();
    let (config, ckpt) = open(dir.path());
    let err = CpuTpBackend::with_blocks(&config, &ckpt, 4, BLOCK, 4)
        .err()
        .unwrap();
    assert!(err.to_string().contains("6 experts"), "{err}");
}

#[test]
fn unsupported_degrees_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec(Architecture::Llama, 2), dir.path(), None).unwrap();
    let (config, ckpt) = open(dir.path());
    let err = CpuTpBackend::with_blocks(&config, &ckpt, 3, BLOCK, 4)
        .err()
        .unwrap();
    assert!(err.to_string().contains("tensor parallelism of 3"), "{err}");
}
