//! The checkpoint's tokenizer: HF `tokenizer.json` through the `tokenizers` crate, the special
//! tokens `tokenizer_config.json` names, and streaming detokenization ([`IncrementalDecoder`]).
//!
//! `tokenizer.json` is authoritative for how text becomes ids: `encode(.., true)` adds exactly
//! what its post-processor adds (Llama 3's `<|begin_of_text|>`, nothing for Qwen3), as HF's fast
//! tokenizers do. `tokenizer_config.json` only names the BOS/EOS tokens the chat template and the
//! stop logic refer to. Python-side `clean_up_tokenization_spaces` is deliberately not applied:
//! it is not part of `tokenizer.json` and it breaks `decode(encode(text)) == text`.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

/// Why a tokenizer could not be loaded or used. Always one line that names the file.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: cannot read: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: malformed tokenizer JSON: {message}", path.display())]
    MalformedTokenizer { path: PathBuf, message: String },
    #[error("{}: malformed tokenizer config: {message}", path.display())]
    MalformedConfig { path: PathBuf, message: String },
    #[error("{}: cannot encode text: {message}", path.display())]
    Encode { path: PathBuf, message: String },
    #[error("{}: cannot decode ids: {message}", path.display())]
    Decode { path: PathBuf, message: String },
}

/// `model_max_length` at or above this is HF's "no limit" sentinel (`int(1e30)` and friends).
const UNLIMITED_MODEL_LENGTH: f64 = 1e18;

/// The parts of `tokenizer_config.json` that serving reads. Shared with [`crate::chat`], which
/// needs the same BOS/EOS strings for the template context.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub add_bos_token: Option<bool>,
    pub model_max_length: Option<usize>,
}

impl TokenizerConfig {
    /// Reads the fields leniently where HF is lenient (absent or null means unset) and rejects
    /// values HF itself could not use. The error is the problem alone; callers add the path.
    pub(crate) fn from_json(json: &Json) -> Result<Self, String> {
        let Json::Object(map) = json else {
            return Err("expected a JSON object at the top level".into());
        };
        let add_bos_token = match map.get("add_bos_token") {
            None | Some(Json::Null) => None,
            Some(Json::Bool(b)) => Some(*b),
            Some(other) => return Err(format!("add_bos_token: expected a boolean, found {other}")),
        };
        let model_max_length = match map.get("model_max_length") {
            None | Some(Json::Null) => None,
            // HF writes its "unlimited" sentinel as int(1e30), beyond u64: it arrives as f64.
            Some(Json::Number(n)) => match (n.as_u64(), n.as_f64()) {
                (Some(v), _) if (v as f64) < UNLIMITED_MODEL_LENGTH => usize::try_from(v).ok(),
                (_, Some(f)) if f >= UNLIMITED_MODEL_LENGTH => None,
                _ => {
                    return Err(format!(
                        "model_max_length: expected a non-negative integer, found {n}"
                    ));
                }
            },
            Some(other) => {
                return Err(format!(
                    "model_max_length: expected a number, found {other}"
                ));
            }
        };
        Ok(TokenizerConfig {
            bos_token: special_token(map, "bos_token")?,
            eos_token: special_token(map, "eos_token")?,
            add_bos_token,
            model_max_length,
        })
    }

    /// Reads and parses `path`, mapping failures to [`TokenizerError`].
    fn load(path: &Path) -> Result<Self, TokenizerError> {
        let text = fs::read_to_string(path).map_err(|error| TokenizerError::Read {
            path: path.to_owned(),
            error,
        })?;
        let malformed = |message: String| TokenizerError::MalformedConfig {
            path: path.to_owned(),
            message,
        };
        let json: Json = serde_json::from_str(&text).map_err(|e| malformed(e.to_string()))?;
        Self::from_json(&json).map_err(malformed)
    }
}

/// A special token is written either as a plain string or as a serialized `AddedToken`
/// (`{"content": "<s>", "lstrip": false, ...}`).
fn special_token(map: &serde_json::Map<String, Json>, key: &str) -> Result<Option<String>, String> {
    match map.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(token)) => match token.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!(
                "{key}: AddedToken object without a string \"content\""
            )),
        },
        Some(other) => Err(format!(
            "{key}: expected a string or {{\"content\": ...}}, found {other}"
        )),
    }
}

/// A loaded tokenizer plus the special tokens its config names.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The `tokenizer.json` it came from, named in encode/decode errors.
    path: PathBuf,
    config: TokenizerConfig,
    eos_token_id: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("config", &self.config)
            .finish()
    }
}

/// A call into the tokenizers library with its panics turned into errors: the library panics on
/// some malformed documents instead of refusing them (a `decoder` of the wrong shape at parse, a
/// post-processor template naming a special token it does not define at encode; found by
/// model/tests/input_fuzz.rs). A bad file is refused like any other, never taking the process.
fn guarded<T>(call: impl FnOnce() -> tokenizers::Result<T>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(one_line(&e.to_string())),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!(
                "the tokenizers library failed on it: {}",
                one_line(&what)
            ))
        }
    }
}

/// A `tokenizer.json` document read by the tokenizers library, refused when encoding a probe
/// text fails: a document the library accepts but cannot use fails at load, not per request.
fn parse(bytes: &[u8]) -> Result<tokenizers::Tokenizer, String> {
    let inner = guarded(|| tokenizers::Tokenizer::from_bytes(bytes))?;
    for special in [false, true] {
        guarded(|| inner.encode_fast("strata probe", special))?;
    }
    Ok(inner)
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`; or, when `dir`
    /// is a GGUF file, the tokenizer its metadata describes.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        if crate::gguf::is_gguf_file(dir) {
            return Self::from_gguf(dir);
        }
        let config = dir.join("tokenizer_config.json");
        let config = config.is_file().then_some(config);
        Self::from_file(&dir.join("tokenizer.json"), config.as_deref())
    }

    /// Loads a `tokenizer.json`, and the given `tokenizer_config.json`, which must then exist.
    pub fn from_file(
        tokenizer_json: &Path,
        config: Option<&Path>,
    ) -> Result<Tokenizer, TokenizerError> {
        let bytes = fs::read(tokenizer_json).map_err(|error| TokenizerError::Read {
            path: tokenizer_json.to_owned(),
            error,
        })?;
        let inner = parse(&bytes).map_err(|message| TokenizerError::MalformedTokenizer {
            path: tokenizer_json.to_owned(),
            message,
        })?;
        let config = match config {
            Some(path) => TokenizerConfig::load(path)?,
            None => TokenizerConfig::default(),
        };
        Ok(Self::assemble(inner, tokenizer_json, config))
    }

    /// The tokenizer over `inner`, its special tokens named by `config`.
    fn assemble(inner: tokenizers::Tokenizer, path: &Path, config: TokenizerConfig) -> Tokenizer {
        let eos_token_id = config
            .eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        Tokenizer {
            inner,
            path: path.to_owned(),
            config,
            eos_token_id,
        }
    }

    /// The tokenizer of the GGUF file at `path` (see [`crate::gguf::tokenizer`]).
    pub fn from_gguf(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let malformed = |message: String| TokenizerError::MalformedTokenizer {
            path: path.to_owned(),
            message,
        };
        let file = crate::gguf::GgufFile::open(path).map_err(|e| malformed(e.problem()))?;
        let built = crate::gguf::tokenizer(file.header()).map_err(|e| malformed(e.to_string()))?;
        let bytes = serde_json::to_vec(&built.json).map_err(|e| malformed(e.to_string()))?;
        let inner = parse(&bytes).map_err(malformed)?;
        let config = TokenizerConfig {
            bos_token: built.bos_token,
            eos_token: built.eos_token,
            add_bos_token: Some(built.add_bos_token),
            model_max_length: None,
        };
        Ok(Self::assemble(inner, path, config))
    }

    /// Token ids for `text`. With `add_special_tokens` the post-processor of `tokenizer.json`
    /// adds its special tokens (e.g. BOS), exactly as HF's fast tokenizers do.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        // encode_fast: serving never needs offsets, and computing them costs a pass.
        let encoding =
            guarded(|| self.inner.encode_fast(text, add_special_tokens)).map_err(|message| {
                TokenizerError::Encode {
                    path: self.path.clone(),
                    message,
                }
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text for `ids`. Ids outside the vocabulary are dropped (as the `tokenizers` crate does)
    /// rather than failing, so a sampler bug cannot turn into a panic here.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        guarded(|| self.inner.decode(ids, skip_special_tokens)).map_err(|message| {
            TokenizerError::Decode {
                path: self.path.clone(),
                message,
            }
        })
    }

    /// Number of distinct tokens including added tokens, like Python's `len(tokenizer)`. This
    /// can be smaller than the model's embedding rows, which are often padded.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.config.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.config.eos_token.as_deref()
    }

    /// The id of [`Self::eos_token`]; `None` when the config names none or the vocabulary lacks it.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// `add_bos_token` as written in the config. Informational: the post-processor of
    /// `tokenizer.json` decides what `encode(.., true)` adds.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.config.add_bos_token
    }

    /// The id of the BOS token when the config says the model adds one (what llama.cpp's
    /// `add_bos_token` means: each perplexity chunk starts with it).
    pub fn added_bos_id(&self) -> Option<u32> {
        match self.config.add_bos_token {
            Some(true) => self.bos_token().and_then(|t| self.token_to_id(t)),
            _ => None,
        }
    }

    /// `model_max_length` from the config; `None` when absent or HF's "unlimited" sentinel.
    pub fn model_max_length(&self) -> Option<usize> {
        self.config.model_max_length
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Errors from `tokenizers`/serde can span lines; ours are one line each.
fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// How many trailing context ids [`IncrementalDecoder::with_context`] keeps: enough for the
/// decoders that look back (SentencePiece's leading-space rule), few enough to stay cheap.
const CONTEXT_IDS: usize = 6;

/// Streaming detokenization: push ids one at a time, get the text they complete.
///
/// Keeps a short window of ids: `ids[..read]` is text already emitted (context, so that
/// decoders which treat the start of a sequence specially see the same neighbours as a full
/// decode) and `ids[read..]` is not emitted yet. Each push decodes the window and emits the
/// difference from the context's text, unless the window ends in an incomplete UTF-8
/// sequence (U+FFFD). For byte-level BPE tokenizers the concatenation of every `push` plus
/// [`finish`](Self::finish) equals `decode(all_ids)`.
///
/// The decoder holds no reference to the [`Tokenizer`], so it can live in per-request state.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    read: usize,
    /// Byte length of `decode(ids[..read])`, computed once per advance.
    context_len: Option<usize>,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> IncrementalDecoder {
        IncrementalDecoder {
            ids: Vec::with_capacity(16),
            read: 0,
            context_len: Some(0),
            skip_special_tokens,
        }
    }

    /// Starts after `prompt_ids`: their last few ids become context (never emitted), so the first
    /// generated token decodes as it would in the middle of the full sequence.
    pub fn with_context(skip_special_tokens: bool, prompt_ids: &[u32]) -> IncrementalDecoder {
        let mut decoder = Self::new(skip_special_tokens);
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(CONTEXT_IDS)..];
        decoder.ids.extend_from_slice(tail);
        decoder.read = tail.len();
        decoder.context_len = None;
        decoder
    }

    /// Adds one id; returns the text it completes, empty while that text is still partial.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let context_len = self.context_len(tokenizer)?;
        let mut text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let complete = text.len() > context_len
            && !text.ends_with(char::REPLACEMENT_CHARACTER)
            && text.is_char_boundary(context_len);
        if !complete {
            return Ok(String::new());
        }
        // Reuse the decoded buffer for the result: drop the context's text in place.
        text.drain(..context_len);
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.context_len = None;
        Ok(text)
    }

    /// Emits whatever is pending, even an incomplete UTF-8 tail (as U+FFFD, like a full
    /// decode would), and resets the decoder for reuse.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, TokenizerError> {
        let pending = self.read < self.ids.len();
        let out = if pending {
            let context_len = self.context_len(tokenizer)?;
            let mut text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
            match text.is_char_boundary(context_len) {
                true => {
                    text.drain(..context_len);
                    text
                }
                // The window's text does not extend the context's: only possible with exotic
                // decoders. Emitting nothing beats emitting the context twice.
                false => String::new(),
            }
        } else {
            String::new()
        };
        self.ids.clear();
        self.read = 0;
        self.context_len = Some(0);
        Ok(out)
    }

    fn context_len(&mut self, tokenizer: &Tokenizer) -> Result<usize, TokenizerError> {
        if let Some(len) = self.context_len {
            return Ok(len);
        }
        let len = tokenizer
            .decode(&self.ids[..self.read], self.skip_special_tokens)?
            .len();
        self.context_len = Some(len);
        Ok(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE tokenizer.json: the 256 byte symbols, two merges, two special tokens and
    /// a post-processor that prepends `<|bos|>`.
    fn tiny_byte_level_json() -> String {
        let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        alphabet.sort_unstable();
        let mut vocab = serde_json::Map::new();
        for (id, c) in alphabet.iter().enumerate() {
            vocab.insert(c.to_string(), Json::from(id));
        }
        vocab.insert("Ġt".into(), Json::from(256));
        vocab.insert("Ġth".into(), Json::from(257));
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 258, "content": "<|bos|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true},
                {"id": 259, "content": "<|eos|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                              "trim_offsets": true, "use_regex": true},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [258], "tokens": ["<|bos|>"]}}
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                        "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": [["Ġ", "t"], ["Ġt", "h"]]}
        })
        .to_string()
    }

    fn tiny_dir(config: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("tokenizer.json"), tiny_byte_level_json()).unwrap();
        if let Some(config) = config {
            fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
        }
        dir
    }

    fn tiny() -> (tempfile::TempDir, Tokenizer) {
        let dir = tiny_dir(Some(
            r#"{"bos_token": {"content": "<|bos|>", "lstrip": false}, "eos_token": "<|eos|>",
                "add_bos_token": true, "model_max_length": 1e30}"#,
        ));
        let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tokenizer)
    }

    const TEXTS: &[&str] = &[
        "the thing the",
        "héllo wörld",
        "你好，世界！",
        "emoji 🌍👋🏽 family 👩‍👩‍👧‍👦 end",
        "\tfn main() {\n\t\tprintln!(\"hi\");\n\t}\n",
        "   leading spaces and   runs   ",
        "\n\n\nnewlines\r\n",
        "",
    ];

    #[test]
    fn shareable_across_request_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<IncrementalDecoder>();
    }

    #[test]
    fn reads_config_special_tokens_in_both_forms() {
        let (_dir, tok) = tiny();
        assert_eq!(tok.bos_token(), Some("<|bos|>"));
        assert_eq!(tok.eos_token(), Some("<|eos|>"));
        assert_eq!(tok.eos_token_id(), Some(259));
        assert_eq!(tok.add_bos_token(), Some(true));
        assert_eq!(
            tok.model_max_length(),
            None,
            "1e30 is the unlimited sentinel"
        );
        assert_eq!(tok.vocab_size(), 256 + 2 + 2);
        assert_eq!(tok.token_to_id("<|bos|>"), Some(258));
        assert_eq!(tok.id_to_token(257).as_deref(), Some("Ġth"));
        assert_eq!(tok.id_to_token(9999), None);
    }

    #[test]
    fn config_is_optional_and_model_max_length_parses() {
        let dir = tiny_dir(None);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!((tok.bos_token(), tok.eos_token_id()), (None, None));
        let json = serde_json::json!({"model_max_length": 131072, "eos_token": null});
        let config = TokenizerConfig::from_json(&json).unwrap();
        assert_eq!(config.model_max_length, Some(131072));
        let huge: Json =
            serde_json::from_str(r#"{"model_max_length": 1000000000000000019884624838656}"#)
                .unwrap();
        assert_eq!(
            TokenizerConfig::from_json(&huge).unwrap().model_max_length,
            None
        );
    }

    #[test]
    fn add_special_tokens_follows_the_post_processor() {
        let (_dir, tok) = tiny();
        let plain = tok.encode("the", false).unwrap();
        let special = tok.encode("the", true).unwrap();
        assert_eq!(special[0], 258);
        assert_eq!(&special[1..], &plain[..]);
        assert_eq!(tok.encode(" th", false).unwrap(), vec![257], "merges apply");
        assert_eq!(tok.decode(&special, true).unwrap(), "the");
        assert_eq!(tok.decode(&special, false).unwrap(), "<|bos|>the");
    }

    #[test]
    fn encode_decode_round_trips() {
        let (_dir, tok) = tiny();
        for text in TEXTS {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), *text);
        }
    }

    #[test]
    fn incremental_decode_concatenates_to_full_decode() {
        let (_dir, tok) = tiny();
        for text in TEXTS {
            let ids = tok.encode(text, true).unwrap();
            for skip in [false, true] {
                let mut decoder = IncrementalDecoder::new(skip);
                let mut streamed = String::new();
                for &id in &ids {
                    streamed += &decoder.push(&tok, id).unwrap();
                }
                streamed += &decoder.finish(&tok).unwrap();
                assert_eq!(
                    streamed,
                    tok.decode(&ids, skip).unwrap(),
                    "{text:?} skip={skip}"
                );
            }
        }
    }

    #[test]
    fn incremental_decode_holds_back_partial_utf8() {
        let (_dir, tok) = tiny();
        let ids = tok.encode("🌍", false).unwrap();
        assert_eq!(ids.len(), 4, "one id per byte without merges");
        let mut decoder = IncrementalDecoder::new(false);
        for &id in &ids[..3] {
            assert_eq!(decoder.push(&tok, id).unwrap(), "");
        }
        assert_eq!(decoder.push(&tok, ids[3]).unwrap(), "🌍");
        // A stream cut mid-character flushes the replacement character, as a full decode shows.
        decoder.push(&tok, ids[0]).unwrap();
        assert_eq!(
            decoder.finish(&tok).unwrap(),
            tok.decode(&ids[..1], false).unwrap()
        );
        assert_eq!(decoder.finish(&tok).unwrap(), "", "finish resets");
    }

    #[test]
    fn incremental_decode_after_prompt_context() {
        let (_dir, tok) = tiny();
        let prompt = tok.encode("say 你好 then", true).unwrap();
        let generated = tok.encode(" the end 🌍", false).unwrap();
        let mut decoder = IncrementalDecoder::with_context(false, &prompt);
        let mut streamed = String::new();
        for &id in &generated {
            streamed += &decoder.push(&tok, id).unwrap();
        }
        streamed += &decoder.finish(&tok).unwrap();
        assert_eq!(streamed, " the end 🌍");
    }

    #[test]
    fn missing_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Read { .. }), "{err}");
        let message = err.to_string();
        assert!(message.contains("tokenizer.json: cannot read"), "{message}");
        assert!(!message.contains('\n'));
    }

    #[test]
    fn malformed_tokenizer_json_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        for bad in [
            "",
            "{",
            "[]",
            r#"{"model": {"type": "BPE", "vocab": 3}}"#,
            "\u{0}garbage",
        ] {
            fs::write(&path, bad).unwrap();
            let err = Tokenizer::from_file(&path, None).unwrap_err();
            let message = err.to_string();
            assert!(
                matches!(err, TokenizerError::MalformedTokenizer { .. }),
                "{message}"
            );
            assert!(
                message.contains("tokenizer.json: malformed tokenizer JSON: "),
                "{message}"
            );
            assert!(!message.contains('\n'), "{message}");
        }
    }

    #[test]
    fn malformed_config_is_an_error() {
        for bad in [
            "{",
            "[1]",
            r#"{"eos_token": 5}"#,
            r#"{"bos_token": {"lstrip": true}}"#,
            r#"{"add_bos_token": "yes"}"#,
            r#"{"model_max_length": -3}"#,
        ] {
            let dir = tiny_dir(Some(bad));
            let err = Tokenizer::from_dir(dir.path()).unwrap_err();
            let message = err.to_string();
            assert!(
                matches!(err, TokenizerError::MalformedConfig { .. }),
                "{bad}: {message}"
            );
            assert!(
                message.contains("tokenizer_config.json: malformed tokenizer config"),
                "{message}"
            );
        }
        let dir = tiny_dir(None);
        let missing = dir.path().join("tokenizer_config.json");
        let err = Tokenizer::from_file(&dir.path().join("tokenizer.json"), Some(&missing));
        assert!(matches!(err, Err(TokenizerError::Read { .. })));
    }

    #[test]
    fn unknown_ids_decode_without_panicking() {
        let (_dir, tok) = tiny();
        assert_eq!(tok.decode(&[u32::MAX, 256], false).unwrap(), " t");
        let mut decoder = IncrementalDecoder::new(false);
        assert_eq!(decoder.push(&tok, u32::MAX).unwrap(), "");
        assert_eq!(decoder.push(&tok, 256).unwrap(), " t");
    }
}
