//! Constrained decoding: a [`Constraint`] compiled by llguidance against the tokenizer's
//! vocabulary, then, per sequence, a mask over each row of logits that leaves only the tokens
//! keeping the output inside the language (end-of-sequence only once the output is complete).
//!
//! llguidance works on bytes, so every token id needs the exact bytes it stands for. They are
//! derived here from the `tokenizers` model: byte-level BPE vocabularies (GPT-2's byte ↔ char
//! map) and SentencePiece-style ones (`▁` for a space, `<0xNN>` byte-fallback pieces). Added
//! tokens flagged special carry llguidance's special-token marker, so free text can never spell
//! them; ids the model has beyond the tokenizer (padding rows) become unreachable specials.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{CancellationHandle, Matcher, ParserFactory};
use serde_json::Value;
use strata_protocol::Constraint;

use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("constrained decoding is not available for this tokenizer: {0}")]
    Tokenizer(String),
    #[error("constrained decoding needs an end-of-sequence token, and the model names none")]
    NoEos,
    #[error("invalid JSON schema: {0}")]
    SchemaJson(String),
    #[error("the grammar cannot be compiled: {0}")]
    Compile(String),
    #[error("the grammar matcher failed: {0}")]
    Matcher(String),
    #[error(
        "the grammar matcher was stopped after {0:?} on one token: the constraint is too \
         ambiguous to follow"
    )]
    TooSlow(Duration),
}

/// The longest one mask or one advance of a matcher may run. llguidance bounds most of its work
/// with fuel, but not all: an ambiguous Lark grammar (`/ +/+ / +/+` after a run of spaces) was
/// found by the fuzz campaign forcing bytes without end, its memory growing. Past this, the step
/// is cancelled and the sequence's constraint fails with [`GrammarError::TooSlow`].
pub const STEP_LIMIT: Duration = Duration::from_secs(1);

/// The matcher steps running now, each with its deadline, and the thread that cancels the
/// overdue ones (started with the first step).
struct Deadlines {
    running: Mutex<Vec<(u64, Instant, CancellationHandle)>>,
    next: AtomicU64,
}

fn deadlines() -> &'static Deadlines {
    static DEADLINES: OnceLock<Deadlines> = OnceLock::new();
    DEADLINES.get_or_init(|| {
        std::thread::Builder::new()
            .name("grammar-deadlines".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(Duration::from_millis(20));
                    let now = Instant::now();
                    let running = deadlines().running.lock();
                    for (_, deadline, handle) in running.unwrap_or_else(|p| p.into_inner()).iter() {
                        if now > *deadline {
                            handle.cancel();
                        }
                    }
                }
            })
            .expect("a thread for the grammar deadlines");
        Deadlines {
            running: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
    })
}

/// One matcher step under [`STEP_LIMIT`]: cancelled by the deadline thread if it runs past it.
struct Step(u64);

impl Step {
    fn start(handle: &CancellationHandle) -> Self {
        let d = deadlines();
        let id = d.next.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + STEP_LIMIT;
        d.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((id, deadline, handle.clone()));
        Self(id)
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        let mut running = deadlines()
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        running.retain(|(id, _, _)| *id != self.0);
    }
}

/// Compiles constraints for one model. Built once per model (it indexes the whole vocabulary),
/// shared by every request.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// `model_vocab` is the number of logits per row (it may exceed the tokenizer's vocabulary);
    /// `eos` the ids that end a sequence, the first one primary.
    pub fn new(
        tokenizer: &Tokenizer,
        model_vocab: usize,
        eos: &[u32],
    ) -> Result<Self, GrammarError> {
        let &primary = eos.first().ok_or(GrammarError::NoEos)?;
        if let Some(&bad) = eos.iter().find(|&&id| id as usize >= model_vocab) {
            return Err(GrammarError::Tokenizer(format!(
                "end-of-sequence id {bad} is outside the model's {model_vocab} logits"
            )));
        }
        let mut words = token_bytes(tokenizer.inner()).map_err(GrammarError::Tokenizer)?;
        if words.len() > model_vocab {
            return Err(GrammarError::Tokenizer(format!(
                "the tokenizer has {} tokens but the model only {model_vocab} logits",
                words.len()
            )));
        }
        for id in words.len()..model_vocab {
            words.push(unreachable_special(id));
        }
        for (id, word) in words.iter_mut().enumerate() {
            if word.is_empty() {
                *word = unreachable_special(id);
            }
        }
        let vocab = u32::try_from(model_vocab)
            .map_err(|_| GrammarError::Tokenizer("vocabulary too large".into()))?;
        let info = TokRxInfo::new(vocab, primary);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        // Text the grammar forces is tokenized as text: a special token's spelling inside it (a
        // schema's property named "<|im_start|>") must not become the special token, whose bytes
        // the trie does not hold (the surface fuzz campaign's 500 "token doesn't satisfy the
        // grammar").
        let mut forced = tokenizer.inner().clone();
        forced.set_encode_special_tokens(true);
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: forced,
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            vocab_size: model_vocab,
            eos: eos.into(),
        })
    }

    /// A fresh matcher for one sequence. Errors name what is wrong with the constraint.
    pub fn compile(&self, constraint: &Constraint) -> Result<ConstrainedDecoder, GrammarError> {
        let grammar = match constraint {
            Constraint::JsonObject => json_grammar(serde_json::json!({"type": "object"})),
            Constraint::JsonSchema(text) => {
                let schema: Value = serde_json::from_str(text)
                    .map_err(|e| GrammarError::SchemaJson(e.to_string()))?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::SchemaJson(
                        "a schema must be a JSON object (or a boolean)".into(),
                    ));
                }
                json_grammar(schema)
            }
            Constraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Compile(one_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(one_line(&e)));
        }
        let cancel = matcher
            .cancellation_handle()
            .ok_or_else(|| GrammarError::Compile("the matcher cannot be bounded in time".into()))?;
        Ok(ConstrainedDecoder {
            matcher,
            cancel,
            vocab_size: self.vocab_size,
            eos: self.eos.clone(),
        })
    }
}

/// JSON without free-form whitespace between tokens: a model cannot wander off into endless
/// spaces, and the output is what `json.dumps(..., separators=(",", ":"))` would give (a schema
/// that sets its own `x-guidance` options keeps them).
fn json_grammar(mut schema: Value) -> TopLevelGrammar {
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// One sequence's position in its grammar.
pub struct ConstrainedDecoder {
    matcher: Matcher,
    /// Cancels a step of `matcher` that runs past [`STEP_LIMIT`].
    cancel: CancellationHandle,
    vocab_size: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for ConstrainedDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstrainedDecoder")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl ConstrainedDecoder {
    /// Sets every logit the grammar forbids next to `-inf`. Once the output is complete, only the
    /// end-of-sequence tokens remain.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self.allowed(logits.len())?;
        apply_allowed(&allowed, logits);
        Ok(())
    }

    /// The tokens the grammar allows next as a bitmask over `vocab` ids (bit `i % 32` of word
    /// `i / 32`, llguidance's layout); ids past the grammar's vocabulary are not allowed. What
    /// [`ConstrainedDecoder::mask`] applies; a GPU backend applies the same bits on the device.
    pub fn allowed(&mut self, vocab: usize) -> Result<Vec<u32>, GrammarError> {
        let step = Step::start(&self.cancel);
        let allowed = self.matcher.compute_mask_or_eos();
        drop(step);
        let allowed = allowed.map_err(|e| self.failed(&e))?;
        let n = vocab.min(self.vocab_size);
        let source = allowed.as_slice();
        let mut words: Vec<u32> = (0..vocab.div_ceil(32))
            .map(|i| source.get(i).copied().unwrap_or(0))
            .collect();
        for id in n..words.len() * 32 {
            words[id / 32] &= !(1 << (id % 32));
        }
        Ok(words)
    }

    /// Moves past `token`, which must have been allowed by the last mask.
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            // Past the end only end-of-sequence was allowed, and that ends the sequence.
            return Ok(());
        }
        let step = Step::start(&self.cancel);
        let consumed = self.matcher.consume_token(token);
        drop(step);
        consumed.map_err(|e| self.failed(&e))
    }

    /// The error of a failed step: [`GrammarError::TooSlow`] once the deadline cancelled it.
    fn failed(&self, e: &impl std::fmt::Display) -> GrammarError {
        if self.cancel.is_cancelled() {
            GrammarError::TooSlow(STEP_LIMIT)
        } else {
            GrammarError::Matcher(one_line(&e.to_string()))
        }
    }

    /// `token` ends the sequence here: it is one of the grammar's end-of-sequence tokens and the
    /// output is complete (the mask allows end-of-sequence only then).
    pub fn ends_with(&mut self, token: u32) -> bool {
        self.eos.contains(&token) && (self.matcher.is_stopped() || self.is_accepting())
    }

    /// The output so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// llguidance's view of the vocabulary, with our tokenizer for re-tokenizing forced text.
struct Env {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// A name no text can produce: the special marker then `[id]`.
fn unreachable_special(id: usize) -> Vec<u8> {
    let mut word = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    word.extend_from_slice(format!("[{id}]").as_bytes());
    word
}

/// How a vocabulary entry spells its bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Spelling {
    /// GPT-2 byte-level BPE: each char stands for one byte.
    ByteLevel,
    /// SentencePiece: `space` stands for ' ', `<0xNN>` pieces for single bytes.
    Pieces { space: char },
}

/// The bytes every token id stands for (special tokens: their text), for reporting tokens to
/// clients; ids with no entry are empty.
pub fn vocabulary_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>, String> {
    let mut words = token_bytes(tokenizer.inner())?;
    for word in &mut words {
        if word.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
            word.remove(0);
        }
    }
    Ok(words)
}

/// The bytes of every token id below the tokenizer's vocabulary size; ids with no entry stay
/// empty (the caller makes them unreachable).
fn token_bytes(tokenizer: &tokenizers::Tokenizer) -> Result<Vec<Vec<u8>>, String> {
    let decoder = tokenizer
        .get_decoder()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| e.to_string())?
        .unwrap_or(Value::Null);
    let spelling = spelling(&decoder).ok_or_else(|| {
        format!(
            "cannot tell how its tokens spell bytes (decoder {})",
            decoder.get("type").unwrap_or(&Value::Null)
        )
    })?;
    let size = tokenizer.get_vocab_size(true);
    let mut words = vec![Vec::new(); size];
    let byte_of_char: HashMap<char, u8> = byte_level_chars()
        .into_iter()
        .enumerate()
        .map(|(byte, c)| (c, byte as u8))
        .collect();
    for (piece, id) in tokenizer.get_vocab(false) {
        let Some(word) = words.get_mut(id as usize) else {
            continue;
        };
        *word = match spelling {
            Spelling::ByteLevel => piece
                .chars()
                .map(|c| byte_of_char.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_default(),
            Spelling::Pieces { space } => match byte_fallback(&piece) {
                Some(byte) => vec![byte],
                None => piece.replace(space, " ").into_bytes(),
            },
        };
    }
    for (id, token) in tokenizer.get_added_tokens_decoder() {
        if let Some(word) = words.get_mut(id as usize) {
            *word = token.content.into_bytes();
            if token.special {
                word.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
    }
    Ok(words)
}

fn spelling(decoder: &Value) -> Option<Spelling> {
    match decoder.get("type")?.as_str()? {
        "ByteLevel" => Some(Spelling::ByteLevel),
        "Metaspace" => {
            let space = decoder
                .get("replacement")
                .and_then(Value::as_str)
                .and_then(|s| s.chars().next())
                .unwrap_or('▁');
            Some(Spelling::Pieces { space })
        }
        "Sequence" => {
            let parts = decoder.get("decoders")?.as_array()?;
            if parts
                .iter()
                .any(|d| spelling(d) == Some(Spelling::ByteLevel))
            {
                return Some(Spelling::ByteLevel);
            }
            let fallback = parts
                .iter()
                .any(|d| d.get("type").and_then(Value::as_str) == Some("ByteFallback"));
            let space = parts.iter().find_map(|d| {
                let is_space = d.get("type").and_then(Value::as_str) == Some("Replace")
                    && d.get("content").and_then(Value::as_str) == Some(" ");
                let pattern = d.pointer("/pattern/String").and_then(Value::as_str)?;
                let mut chars = pattern.chars();
                match (is_space, chars.next(), chars.next()) {
                    (true, Some(c), None) => Some(c),
                    _ => None,
                }
            });
            let metaspace = parts.iter().find_map(|d| match spelling(d) {
                Some(Spelling::Pieces { space }) => Some(space),
                _ => None,
            });
            match (fallback, space.or(metaspace)) {
                (_, Some(space)) => Some(Spelling::Pieces { space }),
                (true, None) => Some(Spelling::Pieces { space: '▁' }),
                (false, None) => None,
            }
        }
        _ => None,
    }
}

/// `<0xNN>` → the byte.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// GPT-2's byte → char table: printable Latin-1 bytes stand for themselves, the other 68 bytes
/// for the chars from U+0100 on, in byte order.
fn byte_level_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in chars.iter_mut().enumerate() {
        let b = byte as u32;
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let code = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("codes below U+0200 are chars");
    }
    chars
}

fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Sets every logit whose bit in `allowed` (see [`ConstrainedDecoder::allowed`]) is clear to
/// `-inf`; ids past the bitmask are not allowed either.
pub fn apply_allowed(allowed: &[u32], logits: &mut [f32]) {
    for (id, logit) in logits.iter_mut().enumerate() {
        let word = allowed.get(id / 32).copied().unwrap_or(0);
        if word & (1 << (id % 32)) == 0 {
            *logit = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Architecture;
    use crate::synth::{SynthSpec, synthesize};

    fn tiny() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        synthesize(&SynthSpec::tiny(Architecture::Qwen3, 7), dir.path(), None).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    #[test]
    fn byte_level_table_is_a_bijection_onto_tokenizers_alphabet() {
        let chars = byte_level_chars();
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        let alphabet: std::collections::HashSet<char> =
            tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
                .into_iter()
                .collect();
        assert_eq!(distinct, alphabet);
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
    }

    #[test]
    fn token_bytes_decode_like_the_tokenizer() {
        let (_dir, tok) = tiny();
        let words = token_bytes(tok.inner()).unwrap();
        let text = "Hello, wörld! {\"a\": [1, 2]}\n";
        let ids = tok.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| words[id as usize].clone())
            .collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }

    /// Greedy decoding under a mask picks the best allowed token each step; driving it with
    /// adversarial logits (always preferring a forbidden token) must still yield valid JSON.
    #[test]
    fn masked_decoding_yields_schema_valid_json() {
        let (_dir, tok) = tiny();
        let vocab = tok.vocab_size() + 3;
        let eos = tok.eos_token_id().unwrap();
        let compiler = GrammarCompiler::new(&tok, vocab, &[eos]).unwrap();
        let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"},
            "color":{"enum":["red","green"]}},"required":["ok","color"],
            "additionalProperties":false}"#;
        let mut decoder = compiler
            .compile(&Constraint::JsonSchema(schema.into()))
            .unwrap();
        // Prefer, in order: '}' tokens, 'x', then anything by descending id — so the mask has to
        // do all the work.
        let mut out = Vec::new();
        for _ in 0..64 {
            let mut logits: Vec<f32> = (0..vocab).map(|i| i as f32 / vocab as f32).collect();
            decoder.mask(&mut logits).unwrap();
            let (best, _) = logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .max_by(|a, b| a.1.total_cmp(b.1))
                .expect("the mask always leaves a token");
            let best = best as u32;
            if best == eos {
                break;
            }
            decoder.advance(best).unwrap();
            out.push(best);
        }
        let text = tok.decode(&out, false).unwrap();
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(value["ok"].is_boolean(), "{text}");
        assert!(
            ["red", "green"].contains(&value["color"].as_str().unwrap()),
            "{text}"
        );
        assert!(decoder.is_accepting());
    }

    /// A property named with a special token's spelling is forced as text, not as the special
    /// token (which failed the matcher mid-request).
    #[test]
    fn forced_text_that_spells_a_special_token_stays_text() {
        let (_dir, tok) = tiny();
        let vocab = tok.vocab_size();
        let eos = tok.eos_token_id().unwrap();
        assert!(
            tok.token_to_id("<|im_start|>").is_some(),
            "the canary needs the special"
        );
        let compiler = GrammarCompiler::new(&tok, vocab, &[eos]).unwrap();
        let schema = r#"{"type":"object","properties":{"a<|im_start|>b":{"type":"boolean"}},
            "required":["a<|im_start|>b"],"additionalProperties":false}"#;
        let mut decoder = compiler
            .compile(&Constraint::JsonSchema(schema.into()))
            .unwrap();
        let mut out = Vec::new();
        for _ in 0..64 {
            let mask = decoder.allowed(vocab).unwrap();
            let next = (0..vocab as u32)
                .find(|&id| mask[id as usize / 32] >> (id % 32) & 1 == 1)
                .expect("the mask always leaves a token");
            if next == eos {
                break;
            }
            decoder.advance(next).unwrap();
            out.push(next);
        }
        let text = tok.decode(&out, false).unwrap();
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(value["a<|im_start|>b"].is_boolean(), "{text}");
    }

    #[test]
    fn padding_rows_and_bad_schemas_are_handled() {
        let (_dir, tok) = tiny();
        let vocab = tok.vocab_size() + 5;
        let eos = tok.eos_token_id().unwrap();
        let compiler = GrammarCompiler::new(&tok, vocab, &[eos]).unwrap();
        let mut decoder = compiler.compile(&Constraint::JsonObject).unwrap();
        let mut logits = vec![0.0; vocab];
        decoder.mask(&mut logits).unwrap();
        assert!(
            logits[tok.vocab_size()..]
                .iter()
                .all(|l| *l == f32::NEG_INFINITY)
        );
        assert!(logits.iter().any(|l| l.is_finite()));
        assert!(matches!(
            compiler.compile(&Constraint::JsonSchema("{not json".into())),
            Err(GrammarError::SchemaJson(_))
        ));
        assert!(matches!(
            compiler.compile(&Constraint::JsonSchema("[1]".into())),
            Err(GrammarError::SchemaJson(_))
        ));
        assert!(matches!(
            compiler.compile(&Constraint::Lark("start: ( ".into())),
            Err(GrammarError::Compile(_))
        ));
        assert!(matches!(
            GrammarCompiler::new(&tok, vocab, &[]),
            Err(GrammarError::NoEos)
        ));
    }
}
