//! Perplexity of the two real models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M, GGUF) on a
//! real text (Hamlet, Project Gutenberg) through the CPU backend's own steps, against the two
//! oracles' numbers in `tests/oracle/gguf/*-perplexity-hamlet.json` (written by
//! `tests/oracle/gguf_oracle.py perplexity`): within 1e-4 of transformers' float32 value and
//! within 1 % of llama.cpp's. The
//! model and text are fetched by `scripts/fetch-test-data.sh`; missing data fails the test.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use strata_node::eval::perplexity;
use strata_node::{Device, EngineSpec, KvBudget, build_backend};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn data(relative: &str) -> PathBuf {
    let path = repo().join("target/test-data").join(relative);
    assert!(
        path.is_file(),
        "missing {}: run scripts/fetch-test-data.sh from the repository root",
        path.display()
    );
    path
}

#[test]
fn smollm2_perplexity_matches_transformers_and_llama_cpp() {
    perplexity_matches("smollm2-perplexity-hamlet.json");
}

#[test]
fn gemma3_perplexity_matches_transformers_and_llama_cpp() {
    perplexity_matches("gemma3-perplexity-hamlet.json");
}

fn perplexity_matches(fixture_file: &str) {
    let fixture: Json = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/oracle/gguf").join(fixture_file)).unwrap(),
    )
    .unwrap();
    let model = data(&format!(
        "models/{}",
        fixture["model"]["file"].as_str().unwrap()
    ));
    let text = std::fs::read_to_string(data("texts/hamlet_gut.txt")).unwrap();
    let context = fixture["context"].as_u64().unwrap() as usize;
    let chunks = fixture["chunks"].as_u64().unwrap() as usize;

    let mut spec = EngineSpec::for_device(Device::Cpu);
    spec.kv = KvBudget::Bytes(256 << 20);
    let built = build_backend(&model, &spec).unwrap();
    let (mut backend, parts) = (built.backend, built.parts);
    let tokens = parts.tokenizer.encode(&text, true).unwrap();
    assert_eq!(
        tokens.len() as u64,
        fixture["text_tokens"].as_u64().unwrap(),
        "the text tokenizes as llama.cpp tokenized it"
    );
    // As llama-perplexity: each chunk starts with BOS where the model adds it.
    let bos = parts.tokenizer.added_bos_id();
    let ours = perplexity(backend.as_mut(), &tokens, context, bos, Some(chunks)).unwrap();
    assert_eq!(
        ours.scored as u64,
        fixture["scored_tokens"].as_u64().unwrap()
    );
    let transformers = fixture["perplexity"]["transformers"].as_f64().unwrap();
    let llama_cpp = fixture["perplexity"]["llama_cpp"].as_f64().unwrap();
    let p = ours.value();
    eprintln!(
        "perplexity: strata {p:.4}, transformers {transformers:.4}, llama.cpp {llama_cpp:.4}"
    );
    assert!(
        (p - transformers).abs() <= 1e-4 * transformers,
        "strata {p} vs transformers {transformers}"
    );
    assert!(
        (p - llama_cpp).abs() <= 0.01 * llama_cpp,
        "strata {p} vs llama.cpp {llama_cpp}"
    );

    // Canary: the first chunk alone, one token later, is a different measurement, outside the
    // bound of its own unshifted value.
    let one = perplexity(backend.as_mut(), &tokens, context, bos, Some(1)).unwrap();
    let shifted = perplexity(backend.as_mut(), &tokens[1..], context, bos, Some(1)).unwrap();
    assert!(
        (shifted.value() - one.value()).abs() > 1e-4 * one.value(),
        "canary: a shifted text stayed within the bound ({} vs {})",
        shifted.value(),
        one.value()
    );
}
