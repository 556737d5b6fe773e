//! One conversation, four surfaces: greedy text for the same system prompt and messages must be
//! byte-identical through OpenAI chat, OpenAI Responses, Anthropic Messages and Bedrock
//! Converse, whole and streamed, at the same token limit. They share the chat template and the
//! engine, so any difference is a surface translating the conversation (or the text) wrongly.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use strata_router::Access;
use support::http::{self, Answer};

const MAX_TOKENS: u32 = 12;

/// A conversation as the surfaces all take it: a system prompt and alternating turns, the last
/// from the user.
struct Conversation {
    system: &'static str,
    turns: &'static [(&'static str, &'static str)],
}

const SINGLE: Conversation = Conversation {
    system: "You are a terse assistant.",
    turns: &[("user", "Name three colours.")],
};

const MULTI_TURN: Conversation = Conversation {
    system: "Answer in one word.",
    turns: &[
        ("user", "What is the capital of France?"),
        ("assistant", "Paris."),
        ("user", "And of Italy? Ünïcode ✓ 東京"),
    ],
};

/// What a surface answered: its text, prompt tokens and generated tokens.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    text: String,
    prompt_tokens: u64,
    output_tokens: u64,
}

fn chat_body(c: &Conversation, stream: bool) -> Value {
    let mut messages = vec![json!({"role": "system", "content": c.system})];
    messages.extend(
        c.turns
            .iter()
            .map(|(role, text)| json!({"role": role, "content": text})),
    );
    json!({"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
           "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
}

fn responses_body(c: &Conversation, stream: bool) -> Value {
    let input: Vec<Value> = c
        .turns
        .iter()
        .map(|(role, text)| json!({"type": "message", "role": role, "content": text}))
        .collect();
    json!({"model": "tiny", "instructions": c.system, "input": input,
           "max_output_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, "store": false})
}

fn anthropic_body(c: &Conversation, stream: bool) -> Value {
    let messages: Vec<Value> = c
        .turns
        .iter()
        .map(|(role, text)| json!({"role": role, "content": [{"type": "text", "text": text}]}))
        .collect();
    json!({"model": "tiny", "system": c.system, "messages": messages, "max_tokens": MAX_TOKENS,
           "temperature": 0, "stream": stream})
}

fn converse_body(c: &Conversation) -> Value {
    let messages: Vec<Value> = c
        .turns
        .iter()
        .map(|(role, text)| json!({"role": role, "content": [{"text": text}]}))
        .collect();
    json!({"system": [{"text": c.system}], "messages": messages,
           "inferenceConfig": {"maxTokens": MAX_TOKENS, "temperature": 0}})
}

fn ok(answer: &Answer, what: &str) {
    assert_eq!(answer.status, 200, "{what}: {}", answer.describe());
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

async fn openai_chat(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/v1/chat/completions", &chat_body(c, false)).await;
    ok(&answer, "chat");
    let body = answer.json();
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    Outcome {
        text: body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        prompt_tokens: u(&body["usage"]["prompt_tokens"]),
        output_tokens: u(&body["usage"]["completion_tokens"]),
    }
}

async fn openai_chat_stream(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/v1/chat/completions", &chat_body(c, true)).await;
    ok(&answer, "chat stream");
    let data = answer.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|r| !r.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")], "{data:?}");
    let usage = &chunks.last().unwrap()["usage"];
    Outcome {
        text,
        prompt_tokens: u(&usage["prompt_tokens"]),
        output_tokens: u(&usage["completion_tokens"]),
    }
}

async fn responses(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/v1/responses", &responses_body(c, false)).await;
    ok(&answer, "responses");
    let body = answer.json();
    assert_eq!(body["status"], "incomplete", "{body}");
    Outcome {
        text: body["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .to_string(),
        prompt_tokens: u(&body["usage"]["input_tokens"]),
        output_tokens: u(&body["usage"]["output_tokens"]),
    }
}

async fn responses_stream(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/v1/responses", &responses_body(c, true)).await;
    ok(&answer, "responses stream");
    let events: Vec<Value> = answer
        .sse_data()
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect::<String>();
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .expect("response.output_text.done");
    assert_eq!(done["text"], text.as_str());
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.incomplete", "{last}");
    let usage = &last["response"]["usage"];
    Outcome {
        text,
        prompt_tokens: u(&usage["input_tokens"]),
        output_tokens: u(&usage["output_tokens"]),
    }
}

async fn anthropic(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/v1/messages", &anthropic_body(c, false)).await;
    ok(&answer, "messages");
    let body = answer.json();
    assert_eq!(body["stop_reason"], "max_tokens", "{body}");
    Outcome {
        text: body["content"][0]["text"].as_str().unwrap().to_string(),
        prompt_tokens: anthropic_prompt(&body["usage"]),
        output_tokens: u(&body["usage"]["output_tokens"]),
    }
}

async fn anthropic_stream(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/v1/messages", &anthropic_body(c, true)).await;
    ok(&answer, "messages stream");
    let events: Vec<Value> = answer
        .sse_data()
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta")
        .map(|e| e["delta"]["text"].as_str().unwrap())
        .collect::<String>();
    let start = events
        .iter()
        .find(|e| e["type"] == "message_start")
        .unwrap();
    let delta = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens", "{delta}");
    assert_eq!(events.last().unwrap()["type"], "message_stop");
    Outcome {
        text,
        // message_start has the whole prompt uncached; the final delta splits it.
        prompt_tokens: u(&start["message"]["usage"]["input_tokens"]),
        output_tokens: u(&delta["usage"]["output_tokens"]),
    }
}

async fn converse(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/model/tiny/converse", &converse_body(c)).await;
    ok(&answer, "converse");
    let body = answer.json();
    assert_eq!(body["stopReason"], "max_tokens", "{body}");
    Outcome {
        text: body["output"]["message"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .to_string(),
        prompt_tokens: converse_prompt(&body["usage"]),
        output_tokens: u(&body["usage"]["outputTokens"]),
    }
}

async fn converse_stream(addr: SocketAddr, c: &Conversation) -> Outcome {
    let answer = http::post(addr, "/model/tiny/converse-stream", &converse_body(c)).await;
    ok(&answer, "converse-stream");
    let frames = eventstream_frames(&answer.body);
    let mut text = String::new();
    let mut stop = None;
    let mut usage = None;
    for (event, payload) in &frames {
        match event.as_str() {
            "contentBlockDelta" => text.push_str(payload["delta"]["text"].as_str().unwrap()),
            "messageStop" => stop = Some(payload["stopReason"].clone()),
            "metadata" => usage = Some(payload["usage"].clone()),
            _ => {}
        }
    }
    let names: Vec<&str> = frames.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names.first(), Some(&"messageStart"), "{names:?}");
    assert_eq!(
        names[names.len() - 3..],
        ["contentBlockStop", "messageStop", "metadata"],
        "{names:?}"
    );
    assert_eq!(stop, Some(json!("max_tokens")));
    let usage = usage.unwrap();
    Outcome {
        text,
        prompt_tokens: converse_prompt(&usage),
        output_tokens: u(&usage["outputTokens"]),
    }
}

/// Anthropic's prompt: its uncached tokens and those read from and written to the cache.
fn anthropic_prompt(usage: &Value) -> u64 {
    u(&usage["input_tokens"])
        + u(&usage["cache_read_input_tokens"])
        + u(&usage["cache_creation_input_tokens"])
}

/// Converse's prompt, split the same way.
fn converse_prompt(usage: &Value) -> u64 {
    u(&usage["inputTokens"])
        + u(&usage["cacheReadInputTokens"])
        + u(&usage["cacheWriteInputTokens"])
}

/// `(:event-type, JSON payload)` of every frame, both CRCs checked; the body must be whole frames.
fn eventstream_frames(mut body: &[u8]) -> Vec<(String, Value)> {
    let be32 = |b: &[u8]| u32::from_be_bytes(b[..4].try_into().unwrap()) as usize;
    let mut frames = Vec::new();
    while !body.is_empty() {
        assert!(body.len() >= 16, "a partial frame: {body:?}");
        let total = be32(body);
        let headers_len = be32(&body[4..]);
        assert_eq!(
            be32(&body[8..]) as u32,
            crc32fast::hash(&body[..8]),
            "prelude CRC"
        );
        let frame = &body[..total];
        assert_eq!(
            be32(&frame[total - 4..]) as u32,
            crc32fast::hash(&frame[..total - 4]),
            "message CRC"
        );
        let mut headers = &frame[12..12 + headers_len];
        let mut event = None;
        while !headers.is_empty() {
            let name_len = headers[0] as usize;
            let name = std::str::from_utf8(&headers[1..1 + name_len]).unwrap();
            assert_eq!(headers[1 + name_len], 7, "string header");
            let at = 2 + name_len;
            let value_len = u16::from_be_bytes([headers[at], headers[at + 1]]) as usize;
            let value = std::str::from_utf8(&headers[at + 2..at + 2 + value_len]).unwrap();
            if name == ":event-type" {
                event = Some(value.to_string());
            }
            assert!(
                name != ":message-type" || value == "event",
                "an exception frame: {}",
                String::from_utf8_lossy(frame)
            );
            headers = &headers[at + 2 + value_len..];
        }
        let payload = serde_json::from_slice(&frame[12 + headers_len..total - 4]).unwrap();
        frames.push((event.expect(":event-type"), payload));
        body = &body[total..];
    }
    frames
}

/// Every surface's outcome for `c`, labelled, all required equal to OpenAI chat's.
async fn assert_identical(addr: SocketAddr, c: &Conversation) {
    let reference = openai_chat(addr, c).await;
    assert_eq!(reference.output_tokens, u64::from(MAX_TOKENS));
    assert!(!reference.text.is_empty(), "greedy text is empty");
    let others = [
        ("chat stream", openai_chat_stream(addr, c).await),
        ("responses", responses(addr, c).await),
        ("responses stream", responses_stream(addr, c).await),
        ("anthropic", anthropic(addr, c).await),
        ("anthropic stream", anthropic_stream(addr, c).await),
        ("converse", converse(addr, c).await),
        ("converse-stream", converse_stream(addr, c).await),
    ];
    for (surface, outcome) in others {
        assert_eq!(
            outcome, reference,
            "{surface} differs from OpenAI chat for system {:?}",
            c.system
        );
    }
}

async fn start() -> (SocketAddr, tempfile::TempDir) {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    (http::serve(state, Access::default()).await, model_dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_system_prompt_and_one_user_turn_read_the_same_everywhere() {
    let (addr, _model) = start().await;
    assert_identical(addr, &SINGLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_turn_conversation_reads_the_same_everywhere() {
    let (addr, _model) = start().await;
    assert_identical(addr, &MULTI_TURN).await;
}

/// A mixture of experts serves every surface the same way (the surfaces never see the MLP).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixture_of_experts_model_reads_the_same_everywhere() {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::tiny_moe_state(model_dir.path());
    assert_eq!(
        state.engine.model_config().architecture.to_string(),
        "Qwen3MoeForCausalLM"
    );
    let addr = http::serve(state, Access::default()).await;
    assert_identical(addr, &MULTI_TURN).await;
}

/// Canary: the comparison tells conversations apart. The same turns under another system
/// prompt must not pass as the reference, as a surface that dropped or rewrote the system
/// prompt would not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_system_prompt_is_told_apart() {
    let (addr, _model) = start().await;
    let reference = openai_chat(addr, &SINGLE).await;
    let changed = Conversation {
        system: "You are a verbose assistant who always explains.",
        ..SINGLE
    };
    assert_ne!(anthropic(addr, &changed).await, reference);
    assert_ne!(converse(addr, &changed).await, reference);
}
