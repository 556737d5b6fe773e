//! Each surface's request decoding, fuzzed against the live server (`tests/fuzz/mod.rs`):
//! mutations of valid requests for every route — tools, tool choice, structured output, streams,
//! stop strings, logprobs — are sent over raw HTTP. Every answer must come within the deadline,
//! never be a server error, be a refusal in its surface's error shape or a success whose body
//! is well formed: JSON, an SSE stream of JSON events ending as the surface ends it, or
//! Converse's event stream whose every frame's lengths and both CRCs check.

use std::time::Duration;

use serde_json::{Value, json};

use crate::cases::{
    self, CHAT, COMPLETIONS, CONVERSE, CONVERSE_STREAM, COUNT_TOKENS, MESSAGES, RESPONSES, merge,
    valid,
};
use crate::fuzz::{Campaign, Report};
use crate::support::http::{self, Answer};

/// The CI-sized campaign: at most this many cases within this budget.
const CASES: usize = 8_000;
const BUDGET: Duration = Duration::from_secs(25);

/// Seed requests for `path`: the minimal valid one and richer ones.
pub fn seeds(path: &'static str) -> Vec<Vec<u8>> {
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"]});
    let patches = match path {
        CHAT => vec![
            json!({"stream": true, "stream_options": {"include_usage": true}}),
            json!({"tools": [tool], "tool_choice": "required"}),
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "r", "schema": schema}}, "n": 2, "seed": 7}),
            json!({"logprobs": true, "top_logprobs": 2, "stop": ["a", "b"],
                "messages": [{"role": "system", "content": "terse"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        ],
        COMPLETIONS => vec![
            json!({"stream": true, "echo": true, "logprobs": 1}),
            json!({"prompt": [[1, 2, 3], "text"], "n": 2, "best_of": 2, "stop": "x"}),
        ],
        RESPONSES => vec![
            json!({"stream": true, "instructions": "terse"}),
            json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                "tools": [{"type": "function", "name": "f", "parameters": schema}],
                "tool_choice": "required"}),
            json!({"text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}}),
        ],
        MESSAGES => vec![
            json!({"stream": true, "system": [{"type": "text", "text": "terse"}]}),
            json!({"tools": [{"name": "f", "input_schema": schema}],
                "tool_choice": {"type": "any"}, "stop_sequences": ["x"], "top_k": 5}),
            json!({"messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                    "input": {"ok": true}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                    "content": "done"}]}]}),
        ],
        COUNT_TOKENS => vec![json!({"system": "terse", "tools": [{"name": "f",
            "input_schema": schema}]})],
        _ => vec![
            json!({"system": [{"text": "terse"}], "inferenceConfig": {"stopSequences": ["x"],
                "topP": 0.5}}),
            json!({"toolConfig": {"tools": [{"toolSpec": {"name": "f",
                "inputSchema": {"json": schema}}}], "toolChoice": {"any": {}}}}),
            json!({"messages": [{"role": "user", "content": [{"text": "hi"}]},
                {"role": "assistant", "content": [{"toolUse": {"toolUseId": "t1", "name": "f",
                    "input": {"ok": true}}}]},
                {"role": "user", "content": [{"toolResult": {"toolUseId": "t1",
                    "content": [{"text": "done"}]}}]}],
                "performanceConfig": {"latency": "standard"}}),
        ],
    };
    std::iter::once(valid(path))
        .chain(patches.iter().map(|p| merge(valid(path), p)))
        .map(|v| v.to_string().into_bytes())
        .collect()
}

/// What is wrong with `answer` to a request on `path`, if anything.
fn judge(path: &'static str, answer: &Answer) -> Result<&'static str, String> {
    if answer.status >= 500 {
        return Err("a server error".into());
    }
    if answer.status >= 400 {
        let probe = cases::raw(path, "fuzz", "").status(answer.status);
        crate::check(&probe, answer)?;
        return Ok("refused");
    }
    let content_type = answer.header("content-type").unwrap_or_default();
    if content_type.starts_with("application/json") {
        answer.try_json().ok_or("a 2xx body that is not JSON")?;
    } else if content_type.starts_with("text/event-stream") {
        let events = answer.sse_data();
        let last = events.last().ok_or("an empty stream")?;
        for data in &events {
            if data != "[DONE]" {
                serde_json::from_str::<Value>(data).map_err(|e| format!("event {data:?}: {e}"))?;
            }
        }
        // OpenAI's [DONE], Anthropic's message_stop, Responses' completed or incomplete.
        let ended = last == "[DONE]" || last.contains("message_stop") || last.contains("complete");
        if !ended {
            return Err(format!("the stream ends with {last:?}"));
        }
    } else if content_type.starts_with("application/vnd.amazon.eventstream") {
        event_stream_frames(&answer.body)?;
    } else {
        return Err(format!("a 2xx of content-type {content_type:?}"));
    }
    Ok("answered")
}

/// Checks every frame of a Converse event stream: lengths, the prelude and message CRCs, and a
/// JSON payload; returns how many there were.
fn event_stream_frames(mut body: &[u8]) -> Result<usize, String> {
    let mut frames = 0;
    while !body.is_empty() {
        let be32 = |at: usize| -> Result<u32, String> {
            let b = body
                .get(at..at + 4)
                .ok_or(format!("frame {frames} short"))?;
            Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        let (total, headers) = (be32(0)? as usize, be32(4)? as usize);
        if total < 16 + headers || total > body.len() {
            return Err(format!("frame {frames}: lengths {total} / {headers}"));
        }
        if be32(8)? != crc32fast::hash(&body[..8]) {
            return Err(format!("frame {frames}: prelude CRC"));
        }
        if be32(total - 4)? != crc32fast::hash(&body[..total - 4]) {
            return Err(format!("frame {frames}: message CRC"));
        }
        serde_json::from_slice::<Value>(&body[12 + headers..total - 4])
            .map_err(|e| format!("frame {frames}: payload {e}"))?;
        body = &body[total..];
        frames += 1;
    }
    if frames == 0 {
        return Err("an empty event stream".into());
    }
    Ok(frames)
}

pub const ROUTES: [&str; 7] = [
    CHAT,
    COMPLETIONS,
    RESPONSES,
    MESSAGES,
    COUNT_TOKENS,
    CONVERSE,
    CONVERSE_STREAM,
];

/// One campaign over every route (the route is the input's key; mutations change the body)
/// against a fresh server, driven from this thread outside the server's runtime. Every route
/// must both answer and refuse some of its cases, and the server must still serve afterwards.
pub fn surfaces(campaign: Campaign) -> Report {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (addr, _model) = runtime.block_on(crate::start());
    let corpus: Vec<(&'static str, Vec<u8>)> = ROUTES
        .into_iter()
        .flat_map(|path| seeds(path).into_iter().map(move |body| (path, body)))
        .collect();
    let mut outcomes = std::collections::BTreeSet::new();
    let report = campaign.run_keyed(&corpus, |&path, body| {
        let raw = http::request_bytes("POST", path, &[], body);
        let answer = runtime
            .block_on(http::send_raw(addr, &raw))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let outcome = judge(path, &answer)
            .unwrap_or_else(|e| panic!("{path}: {e}\n  got: {}", answer.describe()));
        outcomes.insert((path, outcome));
        outcome
    });
    for path in ROUTES {
        for outcome in ["answered", "refused"] {
            assert!(
                outcomes.contains(&(path, outcome)),
                "{path}: no case {outcome} in {report:?}"
            );
        }
    }
    runtime.block_on(crate::assert_healthy(addr));
    report
}

/// The CI-sized campaign.
pub fn surfaces_bounded() -> Report {
    surfaces(Campaign::new("surface requests", 0x5_0001, CASES, BUDGET))
}
