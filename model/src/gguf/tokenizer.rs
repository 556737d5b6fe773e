//! The tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata, rebuilt as a
//! `tokenizer.json` document for the `tokenizers` crate, so a GGUF checkpoint encodes and decodes
//! through the same [`crate::tokenizer::Tokenizer`] as a Hugging Face directory.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE from `tokens` and `merges`) with
//! the pre-tokenizers named by `tokenizer.ggml.pre` that the models strata runs use, and
//! `"llama"` (SentencePiece: `tokens` with `scores`, byte fallback). Each
//! pre-tokenizer is the split llama.cpp applies for that name, written as the `tokenizers`
//! pre-tokenizer that splits identically. An unknown name, or another tokenizer model, is an
//! error naming the key, never a silent fallback to a different split: a wrong split gives
//! fluent-looking but wrong ids.
//!
//! Token types (`tokenizer.ggml.token_type`, llama.cpp's `LLAMA_TOKEN_TYPE_*`): control tokens
//! (3) become special added tokens, user-defined tokens (4) plain added tokens; both are matched
//! whole in input text, as llama.cpp does when it parses special tokens and as HF does always.

use serde_json::{Value as Json, json};

use super::{GgufArray, GgufHeader, GgufValue, GgufValueType};

const MODEL_KEY: &str = "tokenizer.ggml.model";
const PRE_KEY: &str = "tokenizer.ggml.pre";
const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
const TOKEN_TYPE_KEY: &str = "tokenizer.ggml.token_type";
const MERGES_KEY: &str = "tokenizer.ggml.merges";
const SCORES_KEY: &str = "tokenizer.ggml.scores";
const UNK_KEY: &str = "tokenizer.ggml.unknown_token_id";
const ADD_SPACE_PREFIX_KEY: &str = "tokenizer.ggml.add_space_prefix";
const BOS_KEY: &str = "tokenizer.ggml.bos_token_id";
const EOS_KEY: &str = "tokenizer.ggml.eos_token_id";
const EOT_KEY: &str = "tokenizer.ggml.eot_token_id";
const EOM_KEY: &str = "tokenizer.ggml.eom_token_id";
const ADD_BOS_KEY: &str = "tokenizer.ggml.add_bos_token";
const ADD_EOS_KEY: &str = "tokenizer.ggml.add_eos_token";
/// The chat template llama.cpp's converter copies from `tokenizer_config.json`.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";
/// Names of further templates, each under `tokenizer.chat_template.{name}`.
const CHAT_TEMPLATE_NAMES_KEY: &str = "tokenizer.chat_templates";

/// llama.cpp's token types: ordinary pieces, and those that are added tokens rather than
/// vocabulary pieces.
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split (`llama-bpe`): case-insensitive contractions, numbers in runs of up to three
/// digits, newlines kept with the symbols before them.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split: as Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values understood here.
pub const SUPPORTED_PRE_TOKENIZERS: [&str; 6] = [
    "default",
    "gpt-2",
    "smollm",
    "llama-bpe",
    "qwen2",
    "deepseek-r1-qwen",
];

/// Why a GGUF file's tokenizer metadata cannot be rebuilt.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufTokenizerError {
    #[error("missing metadata key {key}")]
    MissingKey { key: &'static str },
    #[error("metadata key {key}: {problem}")]
    Malformed { key: &'static str, problem: String },
    #[error(
        "{MODEL_KEY} is \"{model}\": only \"gpt2\" (byte-level BPE) and \"llama\" \
         (SentencePiece) tokenizers are supported from GGUF so far"
    )]
    UnsupportedModel { model: String },
    #[error(
        "{PRE_KEY} is \"{pre}\", a pre-tokenizer strata does not know (known: {})",
        SUPPORTED_PRE_TOKENIZERS.join(", ")
    )]
    UnsupportedPre { pre: String },
}

/// The tokenizer a GGUF file describes: the `tokenizer.json` document and the special tokens.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    /// A document `tokenizers::Tokenizer::from_bytes` accepts.
    pub json: Json,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Whether encoding with special tokens prepends BOS.
    pub add_bos_token: bool,
}

/// Rebuilds the tokenizer of the GGUF file whose header is `header`.
pub fn tokenizer(header: &GgufHeader) -> Result<GgufTokenizer, GgufTokenizerError> {
    let model =
        string(header, MODEL_KEY)?.ok_or(GgufTokenizerError::MissingKey { key: MODEL_KEY })?;
    if model != "gpt2" && model != "llama" {
        return Err(GgufTokenizerError::UnsupportedModel {
            model: model.to_string(),
        });
    }
    let spm = model == "llama";
    let tokens =
        strings(header, TOKENS_KEY)?.ok_or(GgufTokenizerError::MissingKey { key: TOKENS_KEY })?;
    if tokens.is_empty() {
        return Err(malformed(TOKENS_KEY, "the vocabulary is empty".into()));
    }
    let types = match header.get_array(TOKEN_TYPE_KEY) {
        None => vec![TOKEN_TYPE_NORMAL; tokens.len()],
        Some(array) => integers(array, TOKEN_TYPE_KEY)?,
    };
    if types.len() != tokens.len() {
        return Err(malformed(
            TOKEN_TYPE_KEY,
            format!("{} types for {} tokens", types.len(), tokens.len()),
        ));
    }
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&token, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(token.to_string(), json!(id)).is_some() {
            return Err(malformed(
                TOKENS_KEY,
                format!("token {token:?} appears twice (again at id {id})"),
            ));
        }
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id,
                "content": token,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let SpecialTokens {
        bos: bos_token,
        eos: eos_token,
    } = special_tokens(header)?;
    // SentencePiece files add BOS unless they say otherwise, as llama.cpp reads them.
    let add_bos_token = boolean(header, ADD_BOS_KEY)?.unwrap_or(spm);
    let add_eos_token = boolean(header, ADD_EOS_KEY)?.unwrap_or(false);
    let bos = bos_token.as_deref().zip(token_id(header, BOS_KEY)?);
    let eos = eos_token.as_deref().zip(token_id(header, EOS_KEY)?);
    let post_processor =
        post_processor(bos.filter(|_| add_bos_token), eos.filter(|_| add_eos_token));
    let json = if spm {
        spm_json(header, &tokens, &types, vocab, added, post_processor)?
    } else {
        bpe_json(header, vocab, added, post_processor)?
    };
    Ok(GgufTokenizer {
        json,
        bos_token,
        eos_token,
        add_bos_token,
    })
}

/// Byte-level BPE (`gpt2`): the vocabulary, the file's merges and the pre-tokenizer it names.
fn bpe_json(
    header: &GgufHeader,
    vocab: serde_json::Map<String, Json>,
    added: Vec<Json>,
    post_processor: Json,
) -> Result<Json, GgufTokenizerError> {
    let pre = string(header, PRE_KEY)?.unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = pre_tokenizer(pre)?;
    let merges =
        strings(header, MERGES_KEY)?.ok_or(GgufTokenizerError::MissingKey { key: MERGES_KEY })?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, merge)| {
            // llama.cpp splits at the first space after the first byte: a merge's left part
            // is never empty, and byte-level pieces carry no raw spaces.
            merge
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(at, _)| json!([&merge[..at], &merge[at + 1..]]))
                .ok_or_else(|| malformed(MERGES_KEY, format!("merge {i} ({merge:?}) has no space")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": true,
            "use_regex": true
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges
        }
    }))
}

/// SentencePiece (`llama`): llama.cpp merges the adjacent pair whose joined piece scores highest
/// (leftmost first), and spells a piece missing from the vocabulary as its `<0xXX>` bytes. That
/// is a BPE whose merges are every split of every piece into two pieces of the vocabulary, ranked
/// by the joined piece's score, with byte fallback. Spaces become `▁`; no prefix space is added
/// unless `tokenizer.ggml.add_space_prefix` says so.
fn spm_json(
    header: &GgufHeader,
    tokens: &[&str],
    types: &[i64],
    vocab: serde_json::Map<String, Json>,
    added: Vec<Json>,
    post_processor: Json,
) -> Result<Json, GgufTokenizerError> {
    let scores = match header.metadata(SCORES_KEY) {
        Some(GgufValue::Array(array)) => array
            .values
            .iter()
            .map(|v| match v {
                GgufValue::F32(f) => Ok(*f),
                _ => Err(malformed(SCORES_KEY, "expected an array of f32".into())),
            })
            .collect::<Result<Vec<f32>, _>>()?,
        Some(other) => {
            return Err(malformed(
                SCORES_KEY,
                format!("expected an array of f32, found a {}", other.value_type()),
            ));
        }
        None => return Err(GgufTokenizerError::MissingKey { key: SCORES_KEY }),
    };
    if scores.len() != tokens.len() {
        return Err(malformed(
            SCORES_KEY,
            format!("{} scores for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let id_of: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    // Only ordinary pieces take part in merges; control, byte and unused tokens do not.
    let mergeable = |id: usize| types[id] == TOKEN_TYPE_NORMAL;
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if !mergeable(id) {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (id_of.get(&piece[..at]), id_of.get(&piece[at..]))
                && mergeable(l)
                && mergeable(r)
            {
                merges.push((scores[id], id, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<Json> = merges
        .iter()
        .map(|&(_, _, l, r)| json!([tokens[l], tokens[r]]))
        .collect();
    let unk = token_id(header, UNK_KEY)?
        .and_then(|id| tokens.get(id as usize))
        .map(|t| t.to_string());
    let prefix = boolean(header, ADD_SPACE_PREFIX_KEY)?.unwrap_or(false);
    let mut normalizers = Vec::new();
    if prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    }))
}

/// The BOS and EOS tokens a GGUF file names (`tokenizer.ggml.{bos,eos}_token_id`), as text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
}

/// The file's BOS and EOS tokens, whatever its tokenizer model (a chat template needs them even
/// where the tokenizer itself is not supported).
pub fn special_tokens(header: &GgufHeader) -> Result<SpecialTokens, GgufTokenizerError> {
    let Some(GgufValue::Array(tokens)) = header.metadata(TOKENS_KEY) else {
        return Ok(SpecialTokens::default());
    };
    let token_at = |key: &'static str| -> Result<Option<String>, GgufTokenizerError> {
        let Some(id) = token_id(header, key)? else {
            return Ok(None);
        };
        match tokens.values.get(id as usize) {
            Some(GgufValue::String(t)) => Ok(Some(t.clone())),
            Some(_) => Err(malformed(TOKENS_KEY, "expected an array of strings".into())),
            None => Err(malformed(
                key,
                format!("id {id} is past the {} tokens", tokens.values.len()),
            )),
        }
    };
    Ok(SpecialTokens {
        bos: token_at(BOS_KEY)?,
        eos: token_at(EOS_KEY)?,
    })
}

/// Every chat template the file carries: `tokenizer.chat_template` as `default`, then each name
/// listed in `tokenizer.chat_templates` from `tokenizer.chat_template.{name}`.
pub fn chat_templates(header: &GgufHeader) -> Result<Vec<(String, String)>, GgufTokenizerError> {
    let mut out = Vec::new();
    if let Some(source) = string(header, CHAT_TEMPLATE_KEY)? {
        out.push(("default".to_string(), source.to_string()));
    }
    for name in strings(header, CHAT_TEMPLATE_NAMES_KEY)?.unwrap_or_default() {
        let key = format!("{CHAT_TEMPLATE_KEY}.{name}");
        match header.metadata(&key) {
            Some(GgufValue::String(source)) => out.push((name.to_string(), source.clone())),
            _ => {
                return Err(malformed(
                    CHAT_TEMPLATE_NAMES_KEY,
                    format!("lists {name:?}, but {key} is not a string"),
                ));
            }
        }
    }
    Ok(out)
}

/// Every token id that ends generation in llama.cpp's reading of the file: EOS, and the
/// end-of-turn / end-of-message tokens where named.
pub fn end_token_ids(header: &GgufHeader) -> Result<Vec<u32>, GgufTokenizerError> {
    let mut ids = Vec::new();
    for key in [EOS_KEY, EOT_KEY, EOM_KEY] {
        ids.extend(token_id(header, key)?);
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// The `tokenizers` pre-tokenizer for llama.cpp's pre-tokenizer `pre`, and whether whole words
/// found in the vocabulary skip the merges (Llama 3's `ignore_merges`).
fn pre_tokenizer(pre: &str) -> Result<(Json, bool), GgufTokenizerError> {
    let byte_level = |use_regex: bool| {
        json!({
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": true,
            "use_regex": use_regex
        })
    };
    let split_then_bytes = |pattern: &str| {
        json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": false
                },
                byte_level(false)
            ]
        })
    };
    Ok(match pre {
        // ByteLevel's own regex is GPT-2's split.
        "default" | "gpt-2" => (byte_level(true), false),
        // Every digit alone, then GPT-2's split.
        "smollm" => (
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(true)
                ]
            }),
            false,
        ),
        "llama-bpe" => (split_then_bytes(LLAMA3_SPLIT), true),
        "qwen2" | "deepseek-r1-qwen" => (split_then_bytes(QWEN2_SPLIT), false),
        other => {
            return Err(GgufTokenizerError::UnsupportedPre {
                pre: other.to_string(),
            });
        }
    })
}

/// A `TemplateProcessing` that wraps a sequence in the given BOS / EOS tokens, or null.
fn post_processor(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Json {
    if bos.is_none() && eos.is_none() {
        return Json::Null;
    }
    let special = |(token, _): (&str, u32)| json!({"SpecialToken": {"id": token, "type_id": 0}});
    let sequence = |id: &str| json!({"Sequence": {"id": id, "type_id": 0}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    single.extend(bos.map(special));
    single.push(sequence("A"));
    single.extend(eos.map(special));
    pair.extend(bos.map(special));
    pair.push(sequence("A"));
    pair.extend(eos.map(special));
    pair.extend(bos.map(special));
    pair.push(sequence("B"));
    pair.extend(eos.map(special));
    let mut special_tokens = serde_json::Map::new();
    for (token, id) in bos.into_iter().chain(eos) {
        special_tokens.insert(
            token.to_string(),
            json!({"id": token, "ids": [id], "tokens": [token]}),
        );
    }
    json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special_tokens
    })
}

fn malformed(key: &'static str, problem: String) -> GgufTokenizerError {
    GgufTokenizerError::Malformed { key, problem }
}

fn string<'a>(
    header: &'a GgufHeader,
    key: &'static str,
) -> Result<Option<&'a str>, GgufTokenizerError> {
    match header.metadata(key) {
        None => Ok(None),
        Some(GgufValue::String(s)) => Ok(Some(s)),
        Some(other) => Err(malformed(
            key,
            format!("expected a string, found a {}", other.value_type()),
        )),
    }
}

fn boolean(header: &GgufHeader, key: &'static str) -> Result<Option<bool>, GgufTokenizerError> {
    match header.metadata(key) {
        None => Ok(None),
        Some(GgufValue::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(malformed(
            key,
            format!("expected a bool, found a {}", other.value_type()),
        )),
    }
}

fn token_id(header: &GgufHeader, key: &'static str) -> Result<Option<u32>, GgufTokenizerError> {
    match header.metadata(key) {
        None => Ok(None),
        Some(value) => integer(value)
            .and_then(|v| u32::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| malformed(key, format!("expected a token id, found {value:?}"))),
    }
}

fn strings<'a>(
    header: &'a GgufHeader,
    key: &'static str,
) -> Result<Option<Vec<&'a str>>, GgufTokenizerError> {
    let Some(value) = header.metadata(key) else {
        return Ok(None);
    };
    let GgufValue::Array(array) = value else {
        return Err(malformed(
            key,
            format!(
                "expected an array of strings, found a {}",
                value.value_type()
            ),
        ));
    };
    array
        .values
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| malformed(key, "expected an array of strings".into()))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn integers(array: &GgufArray, key: &'static str) -> Result<Vec<i64>, GgufTokenizerError> {
    if matches!(
        array.element_type,
        GgufValueType::F32
            | GgufValueType::F64
            | GgufValueType::String
            | GgufValueType::Array
            | GgufValueType::Bool
    ) {
        return Err(malformed(
            key,
            format!(
                "expected an array of integers, found {}s",
                array.element_type
            ),
        ));
    }
    array
        .values
        .iter()
        .map(|v| integer(v).ok_or_else(|| malformed(key, "expected an array of integers".into())))
        .collect()
}

/// Any integer value, widened.
fn integer(value: &GgufValue) -> Option<i64> {
    match *value {
        GgufValue::U8(v) => Some(v.into()),
        GgufValue::I8(v) => Some(v.into()),
        GgufValue::U16(v) => Some(v.into()),
        GgufValue::I16(v) => Some(v.into()),
        GgufValue::U32(v) => Some(v.into()),
        GgufValue::I32(v) => Some(v.into()),
        GgufValue::U64(v) => i64::try_from(v).ok(),
        GgufValue::I64(v) => Some(v),
        _ => None,
    }
}
