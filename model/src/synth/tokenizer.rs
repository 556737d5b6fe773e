//! The tokenizer of a synthesized checkpoint: a given real one, or a byte-level BPE whose first 256
//! ids are the bytes themselves, plus ChatML / tool / reasoning markers and a ChatML chat template.

use std::path::Path;

use serde_json::{Value, json};

use super::SynthError;

pub const DEFAULT_CHAT_TEMPLATE: &str = include_str!("template.jinja");

const BOS: &str = "<|begin_of_text|>";
const EOS: &str = "<|end_of_text|>";
const IM_END: &str = "<|im_end|>";
/// Added tokens after the 256 bytes: (content, special).
const ADDED: [(&str, bool); 8] = [
    (BOS, true),
    (EOS, true),
    ("<|im_start|>", true),
    (IM_END, true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<think>", false),
    ("</think>", false),
];
/// The embedding is padded to a multiple of this, as real checkpoints do.
const VOCAB_ALIGN: usize = 64;

pub(super) struct VocabInfo {
    pub size: usize,
    pub bos: Option<u32>,
    pub eos: Vec<u32>,
}

/// The GPT-2 byte → printable-char table that byte-level BPE vocabularies are written in.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("256..=323 are valid chars")
}

/// The byte-level BPE tokenizer.json of synthesized models.
pub fn byte_level_tokenizer() -> Value {
    let vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), json!(b)))
        .collect();
    let added: Vec<Value> = ADDED
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            json!({"id": 256 + i, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [256], "tokens": [BOS]}}
        },
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
}

/// Writes tokenizer.json and tokenizer_config.json into `out`; returns the vocabulary facts the
/// config needs.
pub(super) fn write_tokenizer(out: &Path, given: Option<&Path>) -> Result<VocabInfo, SynthError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SynthError::Io { path, source }
    };
    let dest = out.join("tokenizer.json");
    let Some(src) = given else {
        let text = serde_json::to_string(&byte_level_tokenizer()).expect("json Value");
        std::fs::write(&dest, text).map_err(io(&dest))?;
        let cfg_path = out.join("tokenizer_config.json");
        let cfg = json!({
            "bos_token": BOS, "eos_token": IM_END, "pad_token": EOS, "add_bos_token": false,
            "model_max_length": 4096, "chat_template": DEFAULT_CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        std::fs::write(
            &cfg_path,
            serde_json::to_string_pretty(&cfg).expect("json Value"),
        )
        .map_err(io(&cfg_path))?;
        let size = (256 + ADDED.len()).div_ceil(VOCAB_ALIGN) * VOCAB_ALIGN;
        // ids: 256 = BOS, 257 = EOS, 259 = <|im_end|>
        return Ok(VocabInfo {
            size,
            bos: Some(256),
            eos: vec![259, 257],
        });
    };

    let tokenizer = tokenizers::Tokenizer::from_file(src).map_err(|e| SynthError::Tokenizer {
        path: src.to_path_buf(),
        problem: e.to_string(),
    })?;
    if src != dest {
        std::fs::copy(src, &dest).map_err(io(&dest))?;
    }
    let src_cfg = src.with_file_name("tokenizer_config.json");
    let mut bos = None;
    let mut eos = Vec::new();
    if src_cfg.exists() {
        let text = std::fs::read_to_string(&src_cfg).map_err(io(&src_cfg))?;
        let cfg: Value = serde_json::from_str(&text).map_err(|e| SynthError::Tokenizer {
            path: src_cfg.clone(),
            problem: format!("malformed JSON: {e}"),
        })?;
        let id_of = |key: &str| {
            let token = match cfg.get(key) {
                Some(Value::String(s)) => Some(s.as_str()),
                Some(Value::Object(o)) => o.get("content").and_then(Value::as_str),
                _ => None,
            };
            token.and_then(|t| tokenizer.token_to_id(t))
        };
        bos = id_of("bos_token");
        eos.extend(id_of("eos_token"));
        let dest_cfg = out.join("tokenizer_config.json");
        if src_cfg != dest_cfg {
            std::fs::copy(&src_cfg, &dest_cfg).map_err(io(&dest_cfg))?;
        }
    }
    // Ids may have gaps; the embedding must cover the largest.
    let size = tokenizer
        .get_vocab(true)
        .values()
        .max()
        .map_or(0, |m| *m as usize + 1);
    Ok(VocabInfo { size, bos, eos })
}
