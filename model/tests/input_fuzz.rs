//! Hostile text never crashes strata's model layer: bounded, seeded fuzz campaigns
//! (`tests/fuzz/mod.rs`) over the files an operator hands it and the content a client sends
//! through it.
//!
//! - tokenizer.json and tokenizer_config.json: each mutation is loaded as a checkpoint's
//!   tokenizer and template are (`Tokenizer::from_dir`, `ChatTemplate::from_dir`); what loads
//!   encodes, decodes and streams text and renders a conversation.
//! - Chat-template rendering with hostile message content: mutated conversations (tool calls,
//!   tool results, reasoning, tools) rendered by real checkpoints' templates (Qwen3, Llama 3.1,
//!   SmolLM2's GGUF template) and the synthesized models' one.
//! - JSON Schema and Lark → grammar: each mutation is compiled for a real vocabulary and, when
//!   it compiles, walked for a few tokens (mask, advance) as a constrained request would be.
//!
//! Every case must end as a value or an error, never a panic or a hang. CI runs each for a few
//! seconds; the `#[ignore]`d `*_for_ten_minutes` tests are the recorded runs
//! (scripts/fuzz-long.sh, docs/receipts/fuzz-long.json).

#[path = "../../tests/fuzz/mod.rs"]
mod fuzz;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fuzz::{Campaign, Report};
use serde_json::{Value, json};
use strata_model::chat::{ChatRequest, ChatTemplate};
use strata_model::config::Architecture;
use strata_model::grammar::{GrammarCompiler, GrammarError, STEP_LIMIT};
use strata_model::synth::{SynthSpec, synthesize};
use strata_model::tokenizer::{IncrementalDecoder, Tokenizer};
use strata_protocol::Constraint;

const CASES: usize = 3_000;
const BUDGET: Duration = Duration::from_secs(8);

fn data_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-data");
    assert!(
        dir.join("tokenizers/qwen3/tokenizer_config.json").is_file(),
        "missing test data in {}: run scripts/fetch-test-data.sh from the repository root",
        dir.display()
    );
    dir
}

fn synthesized() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Qwen3, 7), dir.path(), None).unwrap();
    dir
}

/// Whatever a loaded tokenizer and template do with text; the outcome's label.
fn exercise(dir: &Path) -> &'static str {
    let Ok(tokenizer) = Tokenizer::from_dir(dir) else {
        return "refused";
    };
    for text in ["Hello, wörld! {\"a\": [1, 2]}\n", "", "<|im_end|> 😀\u{0}"] {
        for special in [false, true] {
            if let Ok(ids) = tokenizer.encode(text, special) {
                let _ = tokenizer.decode(&ids, special);
                let mut stream = IncrementalDecoder::new(special);
                for &id in &ids {
                    let _ = stream.push(&tokenizer, id);
                }
                let _ = stream.finish(&tokenizer);
            }
        }
    }
    // Ids the vocabulary does not have, as a sampler over padded logits could produce.
    let _ = tokenizer.decode(&[u32::MAX, tokenizer.vocab_size() as u32], false);
    match ChatTemplate::from_dir(dir) {
        Ok(Some(template)) => {
            let _ = template.render(&chat(json!([{"role": "user", "content": "hi"}])));
            "loaded"
        }
        Ok(None) => "loaded, no template",
        Err(_) => "template refused",
    }
}

fn chat(messages: Value) -> ChatRequest {
    ChatRequest {
        messages: messages.as_array().cloned().unwrap_or_default(),
        tools: None,
        add_generation_prompt: true,
        extra: Default::default(),
    }
}

/// Both files of a tokenizer, one target: each case mutates one of them (the key) and loads the
/// directory with the other intact.
fn tokenizer_files(campaign: Campaign) -> Report {
    let source = synthesized();
    let case = tempfile::tempdir().unwrap();
    let files = ["tokenizer.json", "tokenizer_config.json"];
    for name in files {
        std::fs::copy(source.path().join(name), case.path().join(name)).unwrap();
    }
    assert_eq!(exercise(case.path()), "loaded", "the unmutated files load");
    let mut corpus: Vec<(&str, Vec<u8>)> = files
        .iter()
        .map(|&f| (f, std::fs::read(source.path().join(f)).unwrap()))
        .collect();
    // Real checkpoints' configs: long templates, added tokens, special-token maps.
    for real in ["qwen3", "llama3_1"] {
        let path = data_dir().join("tokenizers").join(real).join(files[1]);
        corpus.push((files[1], std::fs::read(path).unwrap()));
    }
    campaign.run_keyed(&corpus, |&file, input| {
        for name in files {
            let bytes = if name == file {
                input
            } else {
                &corpus.iter().find(|(f, _)| *f == name).unwrap().1[..]
            };
            std::fs::write(case.path().join(name), bytes).unwrap();
        }
        exercise(case.path())
    })
}

#[test]
fn mutated_tokenizer_files_never_panic() {
    let report = tokenizer_files(Campaign::new("tokenizer files", 0x70c_0001, CASES, BUDGET));
    assert!(
        report.count("loaded") > 0 && report.count("refused") > 0,
        "{report:?}"
    );
    assert!(report.count("template refused") > 0, "{report:?}");
}

/// Conversations a client might send, tool calls and results, reasoning and tools included.
fn conversations() -> Vec<Vec<u8>> {
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let seeds = [
        json!({"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
            {"role": "user", "content": [{"type": "text", "text": "and in Paris?"}]}]}),
        json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}],
            "tools": [tool]}),
        json!({"messages": [{"role": "user", "content": "{{ raise_exception('x') }} {% for %}"}],
            "tools": [tool, tool]}),
    ];
    seeds
        .iter()
        .map(|s| serde_json::to_vec(s).unwrap())
        .collect()
}

fn templates() -> Vec<ChatTemplate> {
    let data = data_dir();
    let synthesized = synthesized();
    let dirs = [
        data.join("tokenizers/qwen3"),
        data.join("tokenizers/llama3_1"),
        data.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        synthesized.path().to_path_buf(),
    ];
    dirs.iter()
        .map(|d| ChatTemplate::from_dir(d).unwrap().expect("a template"))
        .collect()
}

/// Where a case's bytes go: a whole conversation as JSON (mutated structure), or text put into
/// one place of a valid conversation (every case reaches the templates).
#[derive(Debug, Clone, Copy)]
enum Place {
    Conversation,
    UserText,
    ToolArguments,
    ToolResult,
    ToolName,
}

/// The request a case makes: `None` when a mutated conversation is not a JSON object.
fn hostile_request(place: Place, input: &[u8]) -> Option<ChatRequest> {
    let text = String::from_utf8_lossy(input).into_owned();
    let body = match place {
        Place::Conversation => match serde_json::from_slice::<Value>(input) {
            Ok(Value::Object(body)) => Value::Object(body),
            _ => return None,
        },
        Place::UserText => json!({"messages": [{"role": "system", "content": text},
            {"role": "user", "content": text}]}),
        Place::ToolArguments | Place::ToolResult | Place::ToolName => {
            let (name, arguments, result) = match place {
                Place::ToolArguments => ("f".to_string(), text.clone(), "ok".to_string()),
                Place::ToolResult => ("f".to_string(), "{}".to_string(), text.clone()),
                _ => (text.clone(), "{}".to_string(), "ok".to_string()),
            };
            json!({"messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                    "type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": result}],
                "tools": [{"type": "function", "function": {"name": name,
                    "description": text, "parameters": {"type": "object"}}}]})
        }
    };
    Some(ChatRequest {
        tools: body.get("tools").and_then(Value::as_array).cloned(),
        ..chat(body.get("messages").cloned().unwrap_or(Value::Null))
    })
}

fn hostile_content(campaign: Campaign) -> Report {
    let templates = templates();
    let texts = [
        "What is the capital of France?",
        "{\"city\": \"Paris\"}",
        "get_weather",
    ];
    let mut corpus: Vec<(Place, Vec<u8>)> = conversations()
        .into_iter()
        .map(|c| (Place::Conversation, c))
        .collect();
    for place in [
        Place::UserText,
        Place::ToolArguments,
        Place::ToolResult,
        Place::ToolName,
    ] {
        corpus.extend(texts.iter().map(|t| (place, t.as_bytes().to_vec())));
    }
    campaign.run_keyed(&corpus, |&place, input| {
        let Some(request) = hostile_request(place, input) else {
            return "not a JSON object";
        };
        let rendered = templates
            .iter()
            .filter(|t| t.render(&request).is_ok())
            .count();
        if rendered == 0 { "refused" } else { "rendered" }
    })
}

#[test]
fn hostile_message_content_renders_or_is_refused() {
    let report = hostile_content(Campaign::new(
        "chat templates",
        0x7e4_0001,
        5 * CASES,
        BUDGET,
    ));
    assert!(
        report.count("rendered") > 0 && report.count("refused") > 0,
        "{report:?}"
    );
}

/// JSON Schemas and Lark grammars of the kinds clients send.
fn grammars() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let schemas = [
        json!({"type": "object", "properties": {"ok": {"type": "boolean"},
            "color": {"enum": ["red", "green"]}}, "required": ["ok", "color"],
            "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 500},
            "minItems": 1, "maxItems": 4}),
        json!({"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string",
            "maxLength": 8}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
            "$ref": "#/$defs/node"}),
        json!({"type": "string", "pattern": "^[a-z]{2,5}(-[0-9]+)?$"}),
        json!({"oneOf": [{"type": "number", "multipleOf": 0.5}, {"const": "none"}],
            "x-guidance": {"whitespace_flexible": true}}),
        json!({"type": "object", "patternProperties": {"^x_": {"type": "string",
            "format": "date-time"}}, "minProperties": 1}),
    ];
    let larks = [
        "start: greeting \" \" name\ngreeting: \"hi\" | \"hello\"\nname: /[A-Z][a-z]+/\n",
        "start: item (\",\" item)*\nitem: NUMBER | WORD\n%import common.NUMBER\n%import common.WORD\n",
        "start: \"answer: \" value\nvalue: %json {\"type\": \"integer\"}\n",
        "start: /a{1,3}b+/ | \"x\"{2,4}\n",
    ];
    (
        schemas
            .iter()
            .map(|s| serde_json::to_vec(s).unwrap())
            .collect(),
        larks.iter().map(|l| l.as_bytes().to_vec()).collect(),
    )
}

/// JSON Schemas and Lark grammars, one target: the key says which the text is compiled as.
fn grammar_campaign(campaign: Campaign) -> Report {
    let dir = data_dir().join("tokenizers/qwen3");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let eos = tokenizer.eos_token_id().unwrap();
    let compiler = GrammarCompiler::new(&tokenizer, tokenizer.vocab_size(), &[eos]).unwrap();
    let (schemas, larks) = grammars();
    let corpus: Vec<(bool, Vec<u8>)> = (schemas.into_iter().map(|s| (false, s)))
        .chain(larks.into_iter().map(|l| (true, l)))
        .collect();
    campaign.run_keyed(&corpus, |&lark, input| {
        let text = String::from_utf8_lossy(input).into_owned();
        let constraint = match lark {
            true => Constraint::Lark(text),
            false => Constraint::JsonSchema(text),
        };
        let Ok(mut decoder) = compiler.compile(&constraint) else {
            return "refused";
        };
        // A few steps of a constrained request: a spread of the allowed tokens, taken in turn.
        for step in 0..8usize {
            let vocab = tokenizer.vocab_size() as u32;
            let Ok(mask) = decoder.allowed(vocab as usize) else {
                return "matcher error";
            };
            let allowed: Vec<u32> = (0..vocab)
                .filter(|&id| mask[id as usize / 32] >> (id % 32) & 1 == 1)
                .collect();
            let Some(&token) = allowed.get(step.wrapping_mul(7919) % allowed.len().max(1)) else {
                break;
            };
            if token == eos {
                break;
            }
            if decoder.advance(token).is_err() {
                return "matcher error";
            }
        }
        "compiled"
    })
}

#[test]
fn mutated_schemas_and_grammars_compile_or_are_refused() {
    let report = grammar_campaign(Campaign::new("grammars", 0x9a4_0001, CASES, BUDGET));
    assert!(
        report.count("compiled") > 0 && report.count("refused") > 0,
        "{report:?}"
    );
}

/// The recorded runs (scripts/fuzz-long.sh): ten minutes per target, no case limit.
fn long(target: &str, seed: u64) -> Campaign {
    Campaign::new(target, seed, 0, Duration::ZERO).long()
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn tokenizer_files_for_ten_minutes() {
    tokenizer_files(long("tokenizer files", 1));
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn chat_templates_for_ten_minutes() {
    hostile_content(long("chat templates", 3));
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn grammars_for_ten_minutes() {
    grammar_campaign(long("grammars", 4));
}

/// Found by the grammars' ten-minute run (seed 4, case 216216): after a run of spaces this Lark
/// grammar made llguidance force bytes without end, its memory growing. Each matcher step is now
/// cancelled past `grammar::STEP_LIMIT` and the constraint fails with `TooSlow`.
#[test]
fn a_grammar_whose_matcher_runs_without_end_is_stopped() {
    let dir = data_dir().join("tokenizers/qwen3");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let eos = tokenizer.eos_token_id().unwrap();
    let compiler = GrammarCompiler::new(&tokenizer, tokenizer.vocab_size(), &[eos]).unwrap();
    let text = format!("start: /a{{1,3}}b+/{} | \"x\"{{2,4}}\n", " +/".repeat(58));
    let mut decoder = compiler.compile(&Constraint::Lark(text)).unwrap();
    let spaces = " ".repeat(81);
    let started = Instant::now();
    let mut stopped = None;
    for piece in ["a", "aab", spaces.as_str(), " "] {
        if let Err(e) = decoder.allowed(tokenizer.vocab_size()) {
            stopped = Some(e);
            break;
        }
        let ids = tokenizer.encode(piece, false).unwrap();
        assert_eq!(ids.len(), 1, "{piece:?} is one token of this vocabulary");
        if let Err(e) = decoder.advance(ids[0]) {
            stopped = Some(e);
            break;
        }
    }
    let took = started.elapsed();
    assert_eq!(
        stopped,
        Some(GrammarError::TooSlow(STEP_LIMIT)),
        "after {took:?}"
    );
    assert!(took < STEP_LIMIT * 5, "stopped only after {took:?}");
}
