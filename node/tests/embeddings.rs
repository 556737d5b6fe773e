//! Embedding requests through the engine: the pooled final hidden states of the prompt, equal bit
//! for bit to the reference forward pass however the prompt was chunked, batched with other
//! traffic or found in the prefix cache.

use strata_model::config::Architecture;
use strata_model::cpu::{CpuModel, LogitRows, SeqChunk};
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::backend::CpuBackend;
use strata_node::scheduler::SchedulerLimits;
use strata_node::{Admission, Engine, EngineConfig, RequestStream, SubmitError};
use strata_protocol::{
    Constraint, FinishReason, GenerateRequest, Pooling, SamplingParams, TokenEvent, Usage,
};

const PROMPT: usize = 40;

fn prompt(salt: u32) -> Vec<u32> {
    (0..PROMPT as u32).map(|i| (i * 37 + salt) % 250).collect()
}

fn request(prompt: Vec<u32>, embed: Option<Pooling>) -> GenerateRequest {
    GenerateRequest {
        prompt,
        sampling: SamplingParams {
            max_tokens: 12,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: 0,
        deadline: None,
        constraint: None,
        resume: None,
        embed,
    }
}

/// A 16-token step budget: a 40-token prompt runs in three chunks, beside whatever else runs.
fn engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Qwen3, 5), dir.path(), None).unwrap();
    let backend = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 8, 64);
    let config = EngineConfig {
        limits: SchedulerLimits {
            max_batch_tokens: 16,
            max_running: 8,
        },
        tiers: Default::default(),
        eos_token_ids: vec![],
        grammar: None,
    };
    (dir, Engine::start(Box::new(backend), config).unwrap())
}

/// The final hidden state of every prompt row, from one pass of the reference model.
fn reference_rows(dir: &std::path::Path, prompt: &[u32]) -> Vec<Vec<f32>> {
    let model = CpuModel::load(dir).unwrap();
    let mut cache = model.new_cache();
    let chunk = SeqChunk {
        tokens: prompt,
        first_position: 0,
        logits: LogitRows::None,
    };
    let rows = model
        .forward_batch_rows(&[chunk], &[LogitRows::All], &mut cache)
        .unwrap();
    let hidden = model.config().hidden_size;
    rows.hidden.chunks(hidden).map(<[f32]>::to_vec).collect()
}

fn mean(rows: &[Vec<f32>]) -> Vec<f32> {
    (0..rows[0].len())
        .map(|j| (rows.iter().map(|r| f64::from(r[j])).sum::<f64>() / rows.len() as f64) as f32)
        .collect()
}

enum Outcome {
    Embedding(Vec<f32>, Usage),
    Tokens(Vec<u32>),
}

fn drain(mut stream: RequestStream) -> Outcome {
    let (mut tokens, mut vector) = (Vec::new(), None);
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, .. } => tokens.push(id),
            TokenEvent::Embedding { vector: v } => {
                assert!(vector.is_none(), "one embedding per request");
                vector = Some(v);
            }
            TokenEvent::Finished { reason, usage } => {
                return match vector {
                    Some(v) => {
                        assert_eq!(reason, FinishReason::Stop);
                        assert!(tokens.is_empty(), "an embedding generates nothing");
                        assert_eq!(usage.completion_tokens, 0);
                        Outcome::Embedding(v, usage)
                    }
                    None => Outcome::Tokens(tokens),
                };
            }
            TokenEvent::Failed { message } => panic!("{message}"),
        }
    }
    panic!("stream ended without Finished");
}

fn embedding(outcome: Outcome) -> (Vec<f32>, Usage) {
    match outcome {
        Outcome::Embedding(v, usage) => (v, usage),
        Outcome::Tokens(_) => panic!("no embedding"),
    }
}

fn tokens(outcome: Outcome) -> Vec<u32> {
    match outcome {
        Outcome::Tokens(t) => t,
        Outcome::Embedding(..) => panic!("an embedding for a generation"),
    }
}

#[test]
fn embeddings_pool_the_reference_hidden_states_whatever_runs_beside_them() {
    let (dir, engine) = engine();
    let rows = reference_rows(dir.path(), &prompt(1));
    let want_last = rows.last().unwrap().clone();
    let want_mean = mean(&rows);
    assert_ne!(want_last, want_mean);

    // Alone: a generation, then each pooling (three chunks each).
    let alone = tokens(drain(engine.submit(request(prompt(2), None)).unwrap()));
    let (last, usage) = embedding(drain(
        engine
            .submit(request(prompt(1), Some(Pooling::Last)))
            .unwrap(),
    ));
    assert_eq!(last, want_last, "last-token pooling, chunked");
    assert_eq!((usage.prompt_tokens, usage.cached_tokens), (40, 0));
    // Mean pooling never reads the cache: every row must be computed to be pooled.
    let (mean_pooled, usage) = embedding(drain(
        engine
            .submit(request(prompt(1), Some(Pooling::Mean)))
            .unwrap(),
    ));
    assert_eq!(mean_pooled, want_mean, "mean pooling, chunked");
    assert_eq!(usage.cached_tokens, 0);
    // Last-token pooling reads the cached prefix (the block holding the last token is computed).
    let (again, usage) = embedding(drain(
        engine
            .submit(request(prompt(1), Some(Pooling::Last)))
            .unwrap(),
    ));
    assert_eq!(again, want_last, "from the prefix cache");
    assert_eq!(usage.cached_tokens, 32);

    // Together: generations and embeddings of other prompts share the steps.
    let other = reference_rows(dir.path(), &prompt(3));
    let streams: Vec<_> = [
        request(prompt(2), None),
        request(prompt(3), Some(Pooling::Mean)),
        request(prompt(4), None),
        request(prompt(3), Some(Pooling::Last)),
    ]
    .into_iter()
    .map(|r| engine.submit(r).unwrap())
    .collect();
    let mut outcomes = streams.into_iter().map(drain);
    assert_eq!(
        tokens(outcomes.next().unwrap()),
        alone,
        "generation beside embeddings"
    );
    assert_eq!(embedding(outcomes.next().unwrap()).0, mean(&other));
    let _ = tokens(outcomes.next().unwrap());
    assert_eq!(
        embedding(outcomes.next().unwrap()).0,
        *other.last().unwrap()
    );

    // Canary: the comparison sees a change of the prompt's last token.
    let mut changed = prompt(1);
    *changed.last_mut().unwrap() += 1;
    let canary = reference_rows(dir.path(), &changed);
    assert_ne!(*canary.last().unwrap(), last);
    assert_ne!(mean(&canary), mean_pooled);
}

#[test]
fn embedding_requests_that_cannot_run_are_refused_by_name() {
    let (dir, engine) = engine();
    let constrained = GenerateRequest {
        constraint: Some(Constraint::JsonObject),
        ..request(prompt(1), Some(Pooling::Last))
    };
    assert!(matches!(
        engine.submit(constrained),
        Err(SubmitError::EmbedWithGeneration)
    ));
    // A backend without hidden states (a tensor-parallel one) refuses, naming why.
    let config = strata_model::ModelConfig::from_dir(dir.path()).unwrap();
    let admission = Admission {
        config: &config,
        block_size: 8,
        device_blocks: 64,
        grammar: None,
        embeds: false,
    };
    let err = admission
        .admit(&request(prompt(1), Some(Pooling::Mean)))
        .unwrap_err();
    assert!(matches!(err, SubmitError::NoEmbeddings));
    assert!(err.to_string().contains("embeddings"), "{err}");
    assert!(admission.admit(&request(prompt(1), None)).is_ok());
    // The whole window may be embedded (no generated token needs room).
    let window = config.max_position_embeddings;
    let full = request(vec![1; window], Some(Pooling::Last));
    let admission = Admission {
        embeds: true,
        device_blocks: window,
        ..admission
    };
    assert!(admission.admit(&full).is_ok());
    assert!(matches!(
        admission.admit(&request(vec![1; window], None)),
        Err(SubmitError::ContextWindow { .. })
    ));
}
