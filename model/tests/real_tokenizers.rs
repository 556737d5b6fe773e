//! Real checkpoints' tokenizers and chat templates (Qwen3, Llama 3.1) against their reference
//! behaviour: text round trips, streaming detokenization, and chat renders compared byte for
//! byte with Python's Jinja2 set up as HF transformers sets it up.
//!
//! The data is fetched, not vendored: run `scripts/fetch-test-data.sh` first. Missing data fails
//! these tests rather than skipping them, so a green run always means they ran.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value as Json;
use strata_model::chat::{ChatRequest, ChatTemplate};
use strata_model::tokenizer::{IncrementalDecoder, Tokenizer};

const TEMPLATES: [&str; 2] = ["qwen3", "llama3_1"];

const TEXTS: &[&str] = &[
    "Hello, world!",
    " leading space, then   runs of   spaces and trailing ones   ",
    "Unicode: naïve café, Straße, ½ ≤ ∞, «quotes» — dashes…",
    "Emoji: 🌍👋🏽 👩‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🧑🏿‍🚀",
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트.",
    "RTL: مرحبا بالعالم — שלום עולם",
    "fn main() {\n\tlet x = vec![1, 2, 3];\n\t\tprintln!(\"{x:?}\");\n}\n",
    "def f(x):\r\n    return x  # comment\r\n\r\n\r\n",
    "\n\n\nmany\n\n\n\nnewlines\n",
    "\t\ttabs\t\tand\t spaces \t",
    "Special-looking text: <|im_end|> <|eot_id|> <think> </think>",
    "Numbers 1234567890 3.14159 -0.5e-10 0x1F",
    "",
];

fn data_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-data");
    assert!(
        dir.join("chat-expected.json").is_file(),
        "missing test data in {}: run scripts/fetch-test-data.sh from the repository root",
        dir.display()
    );
    dir
}

fn tokenizer_dir(name: &str) -> PathBuf {
    data_dir().join("tokenizers").join(name)
}

/// Each tokenizer.json is ~10 MB: load each once per test binary.
fn tokenizer(name: &str) -> &'static Tokenizer {
    static QWEN3: OnceLock<Tokenizer> = OnceLock::new();
    static LLAMA3_1: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match name {
        "qwen3" => &QWEN3,
        "llama3_1" => &LLAMA3_1,
        other => panic!("no tokenizer {other}"),
    };
    cell.get_or_init(|| Tokenizer::from_dir(&tokenizer_dir(name)).unwrap())
}

#[test]
fn encode_decode_round_trips() {
    for name in TEMPLATES {
        let tok = tokenizer(name);
        for text in TEXTS {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), *text, "{name}: {text:?}");
        }
    }
}

#[test]
fn incremental_decode_matches_full_decode() {
    for name in TEMPLATES {
        let tok = tokenizer(name);
        for text in TEXTS {
            let ids = tok.encode(text, true).unwrap();
            for skip in [false, true] {
                let mut decoder = IncrementalDecoder::new(skip);
                let mut streamed = String::new();
                for &id in &ids {
                    let piece = decoder.push(tok, id).unwrap();
                    assert!(
                        !piece.contains('\u{FFFD}'),
                        "{name}: partial UTF-8 leaked: {piece:?}"
                    );
                    streamed += &piece;
                }
                streamed += &decoder.finish(tok).unwrap();
                assert_eq!(
                    streamed,
                    tok.decode(&ids, skip).unwrap(),
                    "{name} skip={skip}: {text:?}"
                );
            }
        }
    }
}

#[test]
fn incremental_decode_after_a_prompt() {
    for name in TEMPLATES {
        let tok = tokenizer(name);
        let prompt = tok
            .encode("User: say something in Chinese\nAssistant:", true)
            .unwrap();
        let answer = " 当然！这是中文 🙂 and back.";
        let mut decoder = IncrementalDecoder::with_context(true, &prompt);
        let mut streamed = String::new();
        for id in tok.encode(answer, false).unwrap() {
            streamed += &decoder.push(tok, id).unwrap();
        }
        streamed += &decoder.finish(tok).unwrap();
        assert_eq!(streamed, answer, "{name}");
    }
}

#[test]
fn special_tokens_follow_each_post_processor() {
    let llama = tokenizer("llama3_1");
    let bos = llama.token_to_id("<|begin_of_text|>").unwrap();
    let with = llama.encode("Hello", true).unwrap();
    let without = llama.encode("Hello", false).unwrap();
    assert_eq!(with[0], bos);
    assert_eq!(&with[1..], &without[..]);
    assert_eq!(llama.bos_token(), Some("<|begin_of_text|>"));
    assert_eq!(llama.eos_token(), Some("<|eot_id|>"));
    assert_eq!(llama.eos_token_id(), llama.token_to_id("<|eot_id|>"));
    assert_eq!(llama.model_max_length(), None, "1e30 sentinel");

    let qwen = tokenizer("qwen3");
    assert_eq!(
        qwen.encode("Hello", true).unwrap(),
        qwen.encode("Hello", false).unwrap()
    );
    assert_eq!(qwen.bos_token(), None);
    assert_eq!(qwen.eos_token(), Some("<|im_end|>"));
    assert!(qwen.eos_token_id().is_some());
    assert_eq!(qwen.model_max_length(), Some(131072));
    // Special tokens in text are recognised as single ids, and skipped on request.
    let ids = qwen
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .unwrap();
    assert_eq!(ids.first().copied(), qwen.token_to_id("<|im_start|>"));
    assert_eq!(qwen.decode(&ids, true).unwrap(), "user\nhi");
}

fn chat_request(conversation: &Json) -> ChatRequest {
    let tools = conversation.get("tools").and_then(Json::as_array).cloned();
    ChatRequest {
        messages: conversation["messages"]
            .as_array()
            .cloned()
            .unwrap_or_default(),
        tools,
        add_generation_prompt: conversation["add_generation_prompt"]
            .as_bool()
            .unwrap_or(false),
        extra: conversation
            .get("extra")
            .and_then(Json::as_object)
            .cloned()
            .unwrap_or_default(),
    }
}

#[test]
fn chat_renders_match_jinja2_byte_for_byte() {
    let expected: Json = serde_json::from_str(
        &std::fs::read_to_string(data_dir().join("chat-expected.json")).unwrap(),
    )
    .unwrap();
    let conversations: Json = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/chat/conversations.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let conversations = conversations.as_array().unwrap();
    assert!(conversations.len() >= 12);

    let mut failures = Vec::new();
    let mut compared = 0;
    for name in TEMPLATES {
        let template = ChatTemplate::from_dir(&tokenizer_dir(name))
            .unwrap()
            .unwrap();
        for conversation in conversations {
            let label = conversation["name"].as_str().unwrap();
            let want = &expected[name][label];
            let got = template.render(&chat_request(conversation));
            compared += 1;
            match (want, &got) {
                (Json::String(want), Ok(got)) if want == got => {}
                (Json::Object(e), Err(_)) if e.contains_key("error") => {}
                _ => failures.push(format!(
                    "{name}/{label}:\n  jinja2: {want}\n  ours:   {got:?}"
                )),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} renders differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn jinja2_reference_is_fresh() {
    // A stale chat-expected.json would compare against renders of other conversations.
    let expected: Json = serde_json::from_str(
        &std::fs::read_to_string(data_dir().join("chat-expected.json")).unwrap(),
    )
    .unwrap();
    let conversations: Json = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/chat/conversations.json"),
        )
        .unwrap(),
    )
    .unwrap();
    for name in TEMPLATES {
        for conversation in conversations.as_array().unwrap() {
            let label = conversation["name"].as_str().unwrap();
            assert!(
                expected[name].get(label).is_some(),
                "{name}/{label} has no Jinja2 render: rerun scripts/fetch-test-data.sh"
            );
        }
    }
}
