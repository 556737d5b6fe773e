//! The byte-level BPE pre-tokenizers of GGUF files that no real GGUF here carries — Llama 3's
//! `llama-bpe` and Qwen's `qwen2` — against the Hugging Face `tokenizer.json` of the same models
//! (fetched by `scripts/fetch-test-data.sh`). Each model's vocabulary, token types and merges are
//! written into a GGUF header the way llama.cpp's converter writes them; the tokenizer strata
//! rebuilds from it must encode the shared corpus (`tests/oracle/gguf/corpus.json`) exactly as the
//! HF tokenizer does. Qwen's HF tokenizer NFC-normalizes its input and llama.cpp's does not, so
//! for Qwen entries that NFC changes (combining marks) are the only ones allowed to differ.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use strata_model::gguf::{GgufArray, GgufValue, GgufValueType, encode_string};
use strata_model::tokenizer::Tokenizer;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tokenizer_dir(name: &str) -> PathBuf {
    let dir = repo().join("target/test-data/tokenizers").join(name);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "missing {}: run scripts/fetch-test-data.sh from the repository root",
        dir.display()
    );
    dir
}

fn strings(values: Vec<String>) -> GgufValue {
    GgufValue::Array(GgufArray {
        element_type: GgufValueType::String,
        values: values.into_iter().map(GgufValue::String).collect(),
    })
}

/// A GGUF file (no tensors) carrying `dir/tokenizer.json` as llama.cpp's converter writes it.
fn gguf_of(dir: &Path, pre: &str) -> Vec<u8> {
    let json: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let added = json["added_tokens"].as_array().unwrap();
    let size = vocab.len().max(
        added
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as usize + 1)
            .max()
            .unwrap_or(0),
    );
    let mut tokens = vec![String::new(); size];
    let mut types = vec![1i32; size];
    for (token, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = token.clone();
    }
    for t in added {
        let id = t["id"].as_u64().unwrap() as usize;
        tokens[id] = t["content"].as_str().unwrap().to_string();
        types[id] = if t["special"].as_bool().unwrap() {
            3
        } else {
            4
        };
    }
    // Ids no token names (gaps) are padding pieces in llama.cpp's converter.
    for (id, token) in tokens.iter_mut().enumerate() {
        if token.is_empty() {
            *token = format!("[PAD{id}]");
        }
    }
    let merges: Vec<String> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Json::String(s) => s.clone(),
            Json::Array(pair) => format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            ),
            other => panic!("merge {other}"),
        })
        .collect();
    let metadata = [
        ("general.architecture", GgufValue::String("llama".into())),
        ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        (
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray {
                element_type: GgufValueType::I32,
                values: types.into_iter().map(GgufValue::I32).collect(),
            }),
        ),
        ("tokenizer.ggml.merges", strings(merges)),
    ];
    let mut out = Vec::new();
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in &metadata {
        encode_string(&mut out, key);
        out.extend(value.value_type().id().to_le_bytes());
        value.encode(&mut out);
    }
    out
}

/// Whether NFC would change `text`: it holds a combining mark (the corpus's only such case).
fn nfc_sensitive(text: &str) -> bool {
    text.chars().any(|c| ('\u{300}'..='\u{36f}').contains(&c))
}

fn compare(name: &str, pre: &str, nfc_input: bool) {
    let dir = tokenizer_dir(name);
    let hf = Tokenizer::from_dir(&dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(format!("{name}.gguf"));
    std::fs::write(&path, gguf_of(&dir, pre)).unwrap();
    let ours = Tokenizer::from_dir(&path).unwrap();
    let corpus: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/oracle/gguf/corpus.json")).unwrap(),
    )
    .unwrap();
    let mut wrong = Vec::new();
    let mut excused = 0;
    for (i, text) in corpus.iter().enumerate() {
        let want = hf.encode(text, false).unwrap();
        let got = ours.encode(text, false).unwrap();
        if got != want {
            if nfc_input && nfc_sensitive(text) {
                excused += 1;
            } else {
                wrong.push((i, text.clone(), want, got));
            }
        }
    }
    eprintln!(
        "{name}: {} entries, {excused} differ only by HF's NFC",
        corpus.len()
    );
    assert!(
        wrong.is_empty(),
        "{name}: {} entries differ from HF; first: {:?}",
        wrong.len(),
        wrong.first()
    );
}

#[test]
fn llama_bpe_from_gguf_encodes_like_llama_3_1s_tokenizer_json() {
    compare("llama3_1", "llama-bpe", false);
}

#[test]
fn qwen2_from_gguf_encodes_like_qwen3s_tokenizer_json() {
    compare("qwen3", "qwen2", true);
}
