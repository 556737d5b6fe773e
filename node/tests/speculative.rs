//! Speculative decoding through `start_engine`, as `strata serve` builds it: n-gram and draft
//! model engines stream what a plain engine streams and count their proposals; a draft whose
//! tokenizer is not the target's, a draft beside tensor parallelism and a draft that is not a
//! checkpoint are refused at start by name.

use strata_model::config::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::speculative::{SpecMethod, SpeculativeConfig};
use strata_node::{Engine, EngineSpec, KvBudget, start_engine};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

fn synth(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synthesize(
        &SynthSpec::tiny(Architecture::Llama, seed),
        dir.path(),
        None,
    )
    .unwrap();
    dir
}

fn spec(speculative: Option<SpeculativeConfig>) -> EngineSpec {
    EngineSpec {
        kv: KvBudget::Bytes(32 << 20),
        speculative,
        ..EngineSpec::default()
    }
}

/// Prompts repeating a stretch, greedy and seeded.
fn requests() -> Vec<GenerateRequest> {
    (0..6u32)
        .map(|i| {
            let stretch: Vec<u32> = (0..20).map(|j| (j * 37 + i * 11) % 250).collect();
            GenerateRequest {
                resume: None,
                embed: None,
                prompt: [stretch.clone(), vec![3, 4], stretch].concat(),
                sampling: SamplingParams {
                    max_tokens: 40,
                    ignore_eos: true,
                    temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
                    seed: u64::from(i),
                    ..SamplingParams::default()
                },
                cache_salt: 0,
                deadline: None,
                constraint: None,
            }
        })
        .collect()
}

/// Each request's tokens, one request at a time: a lone sequence's first decode step is
/// cheaper than its prefill whatever the machine's timing, so the cost policy lets its first
/// proposals through and the counters below are not left to chance (identity across batching
/// is the gates' subject).
fn outputs(engine: &Engine) -> Vec<Vec<u32>> {
    requests()
        .into_iter()
        .map(|r| {
            let mut s = engine.submit(r).unwrap();
            let mut ids = Vec::new();
            while let Some(e) = s.events.blocking_recv() {
                match e {
                    TokenEvent::Token { id, .. } => ids.push(id),
                    TokenEvent::Finished { .. } => break,
                    other => panic!("{other:?}"),
                }
            }
            ids
        })
        .collect()
}

fn draft_config(model: &std::path::Path) -> SpeculativeConfig {
    SpeculativeConfig {
        method: SpecMethod::DraftModel,
        model: Some(model.to_path_buf()),
        ..SpeculativeConfig::ngram(4)
    }
}

#[test]
fn ngram_and_draft_engines_stream_what_a_plain_engine_streams() {
    let target = synth(3);
    let other = synth(9);
    let (plain, _) = start_engine(target.path(), &spec(None)).unwrap();
    let want = outputs(&plain);
    assert_eq!(plain.load().spec.drafts, 0);
    drop(plain);
    let ngram = SpeculativeConfig {
        prompt_lookup_min: Some(1),
        ..SpeculativeConfig::ngram(5)
    };
    for config in [
        ngram,
        draft_config(target.path()),
        draft_config(other.path()),
    ] {
        let (engine, _) = start_engine(target.path(), &spec(Some(config.clone()))).unwrap();
        assert_eq!(outputs(&engine), want, "{config:?}");
        let counters = engine.load().spec;
        assert!(counters.drafts > 0, "{config:?}: nothing was proposed");
        assert!(counters.accepted_tokens <= counters.draft_tokens);
    }
}

#[test]
fn a_draft_with_another_tokenizer_or_beside_tp_is_refused_by_name() {
    let target = synth(3);
    let draft = synth(4);
    // One vocabulary entry renamed: the ids no longer mean the same text.
    let path = draft.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let (name, id) = vocab
        .iter()
        .find(|(_, id)| id.as_u64() == Some(65))
        .map(|(n, id)| (n.clone(), id.clone()))
        .unwrap();
    vocab.remove(&name);
    vocab.insert("renamed".into(), id);
    std::fs::write(&path, json.to_string()).unwrap();
    let refused = start_engine(target.path(), &spec(Some(draft_config(draft.path()))))
        .err()
        .expect("another tokenizer is refused")
        .to_string();
    assert!(
        refused.contains("tokenizer differs") && refused.contains("token 65"),
        "{refused}"
    );
    let tp = EngineSpec {
        tp: 2,
        ..spec(Some(draft_config(target.path())))
    };
    let refused = start_engine(target.path(), &tp).err().unwrap().to_string();
    assert!(refused.contains("TP degrees"), "{refused}");
    let missing = std::path::Path::new("/nonexistent-draft");
    let refused = start_engine(target.path(), &spec(Some(draft_config(missing))))
        .err()
        .unwrap()
        .to_string();
    assert!(refused.contains("the draft model"), "{refused}");
}
