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
        speculative: None,
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
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                panic!("{message}")
            }
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
        pinned_blocks: 0,
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

/// Max |ours − transformers| over a vector, relative to max |transformers|.
const BOUND: f32 = 1e-4;

/// A prompt's last-token and mean vectors.
type Pooled = (Vec<f32>, Vec<f32>);

#[derive(serde::Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    spec: SynthSpec,
    prompts: Vec<Vec<u32>>,
}

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The fixture's weights sha256 and, per prompt, transformers' last-token and mean vectors.
fn transformers_fixture(name: &str) -> (String, Vec<Pooled>) {
    use safetensors::SafeTensors;
    let path = repo().join(format!("tests/oracle/fixtures/{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let sha = meta.metadata().as_ref().unwrap()["weights_sha256"].clone();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let vector = |key: &str| -> Option<Vec<f32>> {
        let t = st.tensor(key).ok()?;
        Some(
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        )
    };
    let rows = (0..)
        .map_while(|i| {
            Some((
                vector(&format!("prompt{i}.last"))?,
                vector(&format!("prompt{i}.mean"))?,
            ))
        })
        .collect();
    (sha, rows)
}

fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// The engine's last-token and mean embeddings of every prompt, on the checkpoint in `dir`
/// (`theta` scales its rope_theta: the canary's perturbation).
fn engine_embeddings(dir: &std::path::Path, prompts: &[Vec<u32>], theta: f64) -> Vec<Pooled> {
    let mut config = strata_model::ModelConfig::from_dir(dir).unwrap();
    config.rope_theta *= theta;
    let checkpoint = strata_model::weights::Checkpoint::open(dir).unwrap();
    let model = CpuModel::from_checkpoint(config, &checkpoint).unwrap();
    let backend = CpuBackend::with_blocks(model, 16, 64);
    let config = EngineConfig {
        limits: SchedulerLimits {
            max_batch_tokens: 48,
            max_running: 16,
        },
        tiers: Default::default(),
        eos_token_ids: vec![],
        grammar: None,
        speculative: None,
    };
    let engine = Engine::start(Box::new(backend), config).unwrap();
    // Every request at once: batched and chunked together.
    let streams: Vec<_> = prompts
        .iter()
        .flat_map(|p| {
            [Pooling::Last, Pooling::Mean].map(|pooling| request(p.clone(), Some(pooling)))
        })
        .map(|r| engine.submit(r).unwrap())
        .collect();
    let mut vectors = streams.into_iter().map(|s| embedding(drain(s)).0);
    prompts
        .iter()
        .map(|_| (vectors.next().unwrap(), vectors.next().unwrap()))
        .collect()
}

#[test]
fn embeddings_match_transformers_pooled_hidden_states() {
    use sha2::{Digest, Sha256};
    let text = std::fs::read_to_string(repo().join("tests/oracle/embedding_cases.json")).unwrap();
    let cases: Cases = serde_json::from_str(&text).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for case in cases.cases {
        let dir = tmp.path().join(&case.name);
        synthesize(&case.spec, &dir, None).unwrap();
        let (sha, fixture) = transformers_fixture(&case.name);
        let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
        let ours: String = Sha256::digest(&weights)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            ours, sha,
            "{}: synthesized weights differ from the fixture's; regenerate it \
             (tests/oracle/make_embedding_fixtures.py)",
            case.name
        );
        assert_eq!(fixture.len(), case.prompts.len());
        let mut worst = 0.0f32;
        for (i, ((last, mean), (hf_last, hf_mean))) in engine_embeddings(&dir, &case.prompts, 1.0)
            .iter()
            .zip(&fixture)
            .enumerate()
        {
            for (what, ours, theirs) in [("last", last, hf_last), ("mean", mean, hf_mean)] {
                let err = relative_error(ours, theirs);
                assert!(
                    err <= BOUND,
                    "{} prompt {i} {what}: relative error {err:e} > {BOUND:e}",
                    case.name
                );
                worst = worst.max(err);
            }
        }
        eprintln!(
            "{}: worst relative error {worst:.2e} (bound {BOUND:e})",
            case.name
        );

        // Canary: rope_theta off by 1 % breaks the bound on a prompt long enough for it to show.
        let perturbed = engine_embeddings(&dir, &case.prompts, 1.01);
        let canary = perturbed
            .iter()
            .zip(&fixture)
            .flat_map(|((l, m), (hl, hm))| [relative_error(l, hl), relative_error(m, hm)])
            .fold(0.0f32, f32::max);
        assert!(
            canary > BOUND,
            "{}: the canary stayed within the bound ({canary:e})",
            case.name
        );
    }
}
