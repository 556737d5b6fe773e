//! The table: each case is a valid request for its route with one thing broken, and the
//! status and words the refusal must carry.

use serde_json::{Value, json};

pub const CHAT: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";
pub const RESPONSES: &str = "/v1/responses";
pub const MESSAGES: &str = "/v1/messages";
pub const COUNT_TOKENS: &str = "/v1/messages/count_tokens";
pub const CONVERSE: &str = "/model/tiny/converse";
pub const CONVERSE_STREAM: &str = "/model/tiny/converse-stream";

/// The test server's body limit: small, so an oversize body costs nothing to send.
pub const BODY_LIMIT: usize = 32 << 10;

/// One bad request and what the answer must be.
pub struct Case {
    pub name: String,
    pub method: &'static str,
    pub path: &'static str,
    pub body: Vec<u8>,
    pub status: u16,
    /// OpenAI's `param`, when the refusal must name the field.
    pub param: Option<&'static str>,
    /// Text the message must contain: the field's name, the numbers.
    pub mentions: Vec<&'static str>,
}

/// A request to `path` with raw bytes as its body, expected refused with 400.
pub fn raw(path: &'static str, name: &str, body: impl Into<Vec<u8>>) -> Case {
    Case {
        name: name.to_string(),
        method: "POST",
        path,
        body: body.into(),
        status: 400,
        param: None,
        mentions: Vec::new(),
    }
}

/// The valid request for `path` with `patch` merged in, expected refused with 400.
pub fn bad(path: &'static str, name: &str, patch: Value) -> Case {
    raw(path, name, merge(valid(path), &patch).to_string())
}

impl Case {
    pub fn status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    pub fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn mentions(mut self, words: &[&'static str]) -> Self {
        self.mentions.extend_from_slice(words);
        self
    }

    pub fn method(mut self, method: &'static str) -> Self {
        self.method = method;
        self
    }

    /// The request, shortened, for failure messages.
    pub fn describe(&self) -> String {
        let mut body = String::from_utf8_lossy(&self.body).into_owned();
        if body.len() > 300 {
            let cut = (0..=300).rev().find(|&i| body.is_char_boundary(i));
            body.truncate(cut.unwrap_or(0));
            body = format!("{body}… ({} bytes)", self.body.len());
        }
        format!("{} {} {body}", self.method, self.path)
    }
}

/// A request `path` accepts: four greedy tokens for "hi".
pub fn valid(path: &str) -> Value {
    let user = json!([{"role": "user", "content": "hi"}]);
    match path {
        CHAT => json!({"model": "tiny", "messages": user, "max_tokens": 4, "temperature": 0}),
        COMPLETIONS => json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}),
        RESPONSES => {
            json!({"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0})
        }
        MESSAGES => json!({"model": "tiny", "messages": user, "max_tokens": 4, "temperature": 0}),
        COUNT_TOKENS => json!({"model": "tiny", "messages": user}),
        _ => json!({"messages": [{"role": "user", "content": [{"text": "hi"}]}],
                    "inferenceConfig": {"maxTokens": 4, "temperature": 0}}),
    }
}

/// `base` with `patch` merged in, objects field by field; a `"-"` value removes the field.
pub fn merge(mut base: Value, patch: &Value) -> Value {
    let (Some(fields), Some(patch)) = (base.as_object_mut(), patch.as_object()) else {
        return patch.clone();
    };
    for (k, v) in patch {
        if v == "-" {
            fields.remove(k);
        } else {
            let merged = merge(fields.remove(k).unwrap_or(Value::Null), v);
            fields.insert(k.clone(), merged);
        }
    }
    base
}

/// Malformed bodies every route must refuse with a 400 in its own shape.
fn malformed(path: &'static str) -> Vec<Case> {
    let text = valid(path).to_string();
    let mut invalid_utf8 = text.clone().into_bytes();
    invalid_utf8[text.find("hi").unwrap()] = 0xff;
    let depth = 10_000;
    let deep = format!(
        r#"{{"model": "tiny", "messages": {}{}}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    );
    vec![
        raw(path, "truncated JSON", &text[..text.len() / 2]),
        raw(path, "empty body", ""),
        raw(path, "not an object", "[1, 2]"),
        raw(path, "a bare string", "\"hello\""),
        raw(path, "invalid UTF-8", invalid_utf8),
        raw(path, "trailing garbage", format!("{text}}}")),
        raw(path, "JSON nested 10,000 deep", deep),
    ]
}

pub fn openai() -> Vec<Case> {
    let mut cases = malformed(CHAT);
    cases.extend(malformed(COMPLETIONS));
    cases.extend(malformed(RESPONSES));
    let image = json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]);
    let tool = |function: Value| json!({"tools": [{"type": "function", "function": function}]});
    cases.extend([
        bad(CHAT, "messages as a string", json!({"messages": "hi"})),
        bad(CHAT, "max_tokens \"ten\"", json!({"max_tokens": "ten"})),
        bad(CHAT, "max_tokens 1.5", json!({"max_tokens": 1.5})),
        raw(
            CHAT,
            "max_tokens beyond i64",
            r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 99999999999999999999}"#,
        ),
        bad(
            CHAT,
            "temperature as a string",
            json!({"temperature": "hot"}),
        ),
        bad(CHAT, "stream \"yes\"", json!({"stream": "yes"})),
        bad(CHAT, "stop as a number", json!({"stop": 7})),
        bad(CHAT, "model as a number", json!({"model": 7})),
        bad(CHAT, "unknown model", json!({"model": "gpt-4o"}))
            .status(404)
            .param("model")
            .mentions(&["gpt-4o", "tiny"]),
        bad(CHAT, "missing model", json!({"model": "-"})).mentions(&["model"]),
        bad(CHAT, "missing messages", json!({"messages": "-"})).mentions(&["messages"]),
        bad(CHAT, "empty messages", json!({"messages": []})).param("messages"),
        bad(
            CHAT,
            "a message that is not an object",
            json!({"messages": [7]}),
        )
        .param("messages[0]"),
        bad(
            CHAT,
            "a message without a role",
            json!({"messages": [{"content": "hi"}]}),
        )
        .param("messages[0].role"),
        bad(
            CHAT,
            "a message with a role the template does not know",
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}]}),
        )
        .param("messages[1].role")
        .mentions(&["narrator"]),
        bad(
            CHAT,
            "an image part",
            json!({"messages": [{"role": "user", "content": image}]}),
        )
        .param("messages[0].content[0]"),
        bad(CHAT, "a field this server does not know", json!({"frobnicate": 1}))
            .param("frobnicate")
            .mentions(&["frobnicate"]),
        bad(
            CHAT,
            "include_stop_str_in_output true",
            json!({"include_stop_str_in_output": true}),
        )
        .param("include_stop_str_in_output"),
        bad(COMPLETIONS, "prompt_logprobs", json!({"prompt_logprobs": 1})).param("prompt_logprobs"),
        bad(CHAT, "negative max_tokens", json!({"max_tokens": -5}))
            .param("max_tokens")
            .mentions(&["-5"]),
        bad(
            CHAT,
            "zero max_completion_tokens",
            json!({"max_completion_tokens": 0}),
        )
        .param("max_completion_tokens"),
        bad(CHAT, "n = 0", json!({"n": 0}))
            .param("n")
            .mentions(&["0"]),
        bad(CHAT, "temperature -1", json!({"temperature": -1}))
            .param("temperature")
            .mentions(&["-1"]),
        bad(CHAT, "temperature beyond f32", json!({"temperature": 1e39})).param("temperature"),
        bad(CHAT, "top_p 2", json!({"top_p": 2}))
            .param("top_p")
            .mentions(&["2"]),
        bad(CHAT, "top_p 0", json!({"top_p": 0})).param("top_p"),
        bad(CHAT, "negative min_tokens", json!({"min_tokens": -1}))
            .param("min_tokens")
            .mentions(&["min_tokens", "-1"]),
        bad(
            COMPLETIONS,
            "min_tokens above max_tokens",
            json!({"min_tokens": 5}),
        )
        .param("min_tokens")
        .mentions(&["min_tokens", "max_tokens"]),
        bad(CHAT, "ignore_eos as a string", json!({"ignore_eos": "yes"})),
        bad(
            CHAT,
            "logit_bias keyed by text",
            json!({"logit_bias": {"hello": 1}}),
        )
        .param("logit_bias"),
        bad(
            CHAT,
            "logit_bias of a token outside the vocabulary",
            json!({"logit_bias": {"99999999": 1}}),
        )
        .param("logit_bias")
        .mentions(&["99999999", "vocabulary"]),
        bad(
            COMPLETIONS,
            "logit_bias beyond 100",
            json!({"logit_bias": {"1": 200}}),
        )
        .param("logit_bias")
        .mentions(&["-100 to 100"]),
        bad(
            CHAT,
            "tools not an array",
            json!({"tools": {"type": "function"}}),
        )
        .param("tools"),
        bad(
            CHAT,
            "a tool without a name",
            tool(json!({"parameters": {"type": "object"}})),
        )
        .param("tools[0]"),
        bad(
            CHAT,
            "a tool of another type",
            json!({"tools": [{"type": "retrieval"}]}),
        )
        .param("tools[0]"),
        bad(
            CHAT,
            "tool_choice naming an unknown function",
            merge(
                tool(json!({"name": "f"})),
                &json!({"tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
        )
        .param("tool_choice"),
        bad(
            CHAT,
            "tool_choice without tools",
            json!({"tool_choice": "required"}),
        )
        .param("tool_choice"),
        bad(
            COMPLETIONS,
            "prompt as an object",
            json!({"prompt": {"text": "hi"}}),
        )
        .param("prompt"),
        bad(
            COMPLETIONS,
            "a batch of 129 prompts",
            json!({"prompt": vec!["a"; 129]}),
        )
        .param("prompt")
        .mentions(&["128"]),
        bad(
            COMPLETIONS,
            "a batch mixing a string and a token id",
            json!({"prompt": ["a", 5]}),
        )
        .param("prompt"),
        bad(COMPLETIONS, "missing prompt", json!({"prompt": "-"})).mentions(&["prompt"]),
        bad(COMPLETIONS, "empty prompt", json!({"prompt": []})).param("prompt"),
        bad(
            COMPLETIONS,
            "a token beyond the vocabulary",
            json!({"prompt": [4_000_000_000u32]}),
        )
        .param("prompt")
        .mentions(&["4000000000"]),
        bad(COMPLETIONS, "unknown model", json!({"model": "davinci"}))
            .status(404)
            .param("model"),
        bad(
            COMPLETIONS,
            "negative max_tokens",
            json!({"max_tokens": -1}),
        )
        .param("max_tokens"),
        bad(COMPLETIONS, "n = 0", json!({"n": 0})).param("n"),
        bad(COMPLETIONS, "top_p 2", json!({"top_p": 2})).param("top_p"),
        bad(COMPLETIONS, "tools", tool(json!({"name": "f"}))).param("tools"),
        bad(COMPLETIONS, "echo not a boolean", json!({"echo": "yes"})).param("echo"),
        bad(
            COMPLETIONS,
            "echo with logprobs",
            json!({"echo": true, "logprobs": 2}),
        )
        .param("echo"),
        bad(COMPLETIONS, "best_of 2", json!({"best_of": 2})).param("best_of"),
        bad(
            COMPLETIONS,
            "a prompt beyond the window",
            json!({"prompt": vec![5u32; 300]}),
        )
        .param("prompt")
        .mentions(&["300", "256"]),
        bad(RESPONSES, "a field this server does not know", json!({"reasoning": {"effort": "high"}}))
            .param("reasoning"),
        bad(RESPONSES, "input as a number", json!({"input": 7})),
        bad(RESPONSES, "missing input", json!({"input": "-"})).mentions(&["input"]),
        bad(RESPONSES, "empty input", json!({"input": []})).param("input"),
        bad(RESPONSES, "unknown model", json!({"model": "gpt-4o"}))
            .status(404)
            .param("model"),
        bad(
            RESPONSES,
            "max_output_tokens \"ten\"",
            json!({"max_output_tokens": "ten"}),
        ),
        bad(
            RESPONSES,
            "zero max_output_tokens",
            json!({"max_output_tokens": 0}),
        )
        .param("max_output_tokens"),
        bad(
            RESPONSES,
            "negative max_output_tokens",
            json!({"max_output_tokens": -3}),
        )
        .param("max_output_tokens")
        .mentions(&["-3"]),
        bad(RESPONSES, "temperature -1", json!({"temperature": -1})).param("temperature"),
        bad(RESPONSES, "top_p 2", json!({"top_p": 2})).param("top_p"),
        bad(
            RESPONSES,
            "a tool role",
            json!({"input": [{"role": "tool", "content": "x"}]}),
        )
        .param("input[0].role"),
        bad(
            RESPONSES,
            "an image part",
            json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
        )
        .param("input[0].content[0]"),
        bad(
            RESPONSES,
            "a reasoning item",
            json!({"input": [{"type": "reasoning", "summary": []}]}),
        )
        .param("input[0].type"),
        bad(
            RESPONSES,
            "a function call item without call_id",
            json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
        )
        .param("input[0].call_id"),
        bad(
            RESPONSES,
            "a function call output of a number",
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}),
        )
        .param("input[0].output"),
        bad(
            RESPONSES,
            "a web_search tool",
            json!({"tools": [{"type": "web_search"}]}),
        )
        .param("tools[0].type")
        .mentions(&["web_search"]),
        bad(
            RESPONSES,
            "a function tool without a name",
            json!({"tools": [{"type": "function", "parameters": {}}]}),
        )
        .param("tools[0].name"),
        bad(
            RESPONSES,
            "tool_choice naming an unknown function",
            json!({"tools": [{"type": "function", "name": "f", "parameters": {}}],
                   "tool_choice": {"type": "function", "name": "g"}}),
        )
        .param("tool_choice"),
        bad(
            RESPONSES,
            "tool_choice required without tools",
            json!({"tool_choice": "required"}),
        )
        .param("tool_choice"),
        bad(
            RESPONSES,
            "an unknown previous_response_id",
            json!({"previous_response_id": "r"}),
        )
        .status(404)
        .param("previous_response_id"),
    ]);
    cases
}

pub fn anthropic() -> Vec<Case> {
    let mut cases = malformed(MESSAGES);
    cases.extend(malformed(COUNT_TOKENS));
    let image = json!({"type": "image", "source": {"type": "base64", "data": "AA"}});
    let long = "a ".repeat(400);
    cases.extend([
        bad(MESSAGES, "messages as a string", json!({"messages": "hi"})),
        bad(MESSAGES, "max_tokens \"ten\"", json!({"max_tokens": "ten"})),
        bad(MESSAGES, "unknown model", json!({"model": "claude-opus-4"}))
            .status(404)
            .mentions(&["claude-opus-4"]),
        bad(MESSAGES, "missing model", json!({"model": "-"})).mentions(&["model"]),
        bad(MESSAGES, "a field this server does not know", json!({"mcp_servers": [{}]}))
            .mentions(&["mcp_servers"]),
        bad(MESSAGES, "missing max_tokens", json!({"max_tokens": "-"})).mentions(&["max_tokens"]),
        bad(MESSAGES, "negative max_tokens", json!({"max_tokens": -1}))
            .mentions(&["max_tokens", "-1"]),
        bad(MESSAGES, "zero max_tokens", json!({"max_tokens": 0})).mentions(&["max_tokens"]),
        bad(MESSAGES, "negative top_k", json!({"top_k": -1})),
        bad(MESSAGES, "temperature -1", json!({"temperature": -1})).mentions(&["temperature"]),
        bad(MESSAGES, "top_p 2", json!({"top_p": 2})).mentions(&["top_p"]),
        bad(MESSAGES, "missing messages", json!({"messages": "-"})).mentions(&["messages"]),
        bad(MESSAGES, "empty messages", json!({"messages": []})).mentions(&["messages"]),
        bad(
            MESSAGES,
            "a system role in messages",
            json!({"messages": [{"role": "system", "content": "hi"}]}),
        ),
        bad(MESSAGES, "content as a number", json!({"messages": [{"role": "user", "content": 7}]})),
        bad(
            MESSAGES,
            "an image block",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]}),
        )
        .mentions(&["messages.0.content.1"]),
        bad(MESSAGES, "a system image block", json!({"system": [image]})).mentions(&["system.0"]),
        bad(MESSAGES, "stop_sequences as a string", json!({"stop_sequences": "x"})),
        bad(
            MESSAGES,
            "a prompt beyond the window",
            json!({"messages": [{"role": "user", "content": long}]}),
        )
        .mentions(&["256"]),
        bad(COUNT_TOKENS, "unknown model", json!({"model": "x"})).status(404),
        bad(COUNT_TOKENS, "empty messages", json!({"messages": []})),
    ]);
    cases
}

pub fn converse() -> Vec<Case> {
    let mut cases = Vec::new();
    let image = json!({"image": {"format": "png", "source": {"bytes": "AA"}}});
    let long = "a ".repeat(400);
    for path in [CONVERSE, CONVERSE_STREAM] {
        let config = |patch: Value| json!({"inferenceConfig": patch});
        let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
        cases.extend(malformed(path));
        cases.extend([
            bad(path, "messages as a string", json!({"messages": "hi"})),
            bad(path, "content as a string", user(json!("hi"))),
            bad(
                path,
                "maxTokens \"ten\"",
                config(json!({"maxTokens": "ten"})),
            ),
            bad(path, "negative maxTokens", config(json!({"maxTokens": -3})))
                .mentions(&["maxTokens", "-3"]),
            bad(path, "zero maxTokens", config(json!({"maxTokens": 0}))).mentions(&["maxTokens"]),
            bad(path, "temperature -1", config(json!({"temperature": -1})))
                .mentions(&["temperature"]),
            bad(path, "topP 2", config(json!({"topP": 2}))).mentions(&["topP"]),
            bad(path, "missing messages", json!({"messages": "-"})).mentions(&["messages"]),
            bad(path, "empty messages", json!({"messages": []})).mentions(&["messages"]),
            bad(
                path,
                "a system role in messages",
                json!({"messages": [{"role": "system", "content": [{"text": "hi"}]}]}),
            ),
            bad(
                path,
                "an image block",
                user(json!([{"text": "look"}, image])),
            )
            .mentions(&["messages.0.content.1"]),
            bad(
                path,
                "a system block that is not text",
                json!({"system": [{"guardContent": {}}]}),
            )
            .mentions(&["system.0"]),
            bad(
                path,
                "guardrailConfig",
                json!({"guardrailConfig": {"guardrailIdentifier": "g"}}),
            )
            .mentions(&["guardrailConfig"]),
            bad(path, "an unknown member", json!({"topK": 5})).mentions(&["topK"]),
            bad(
                path,
                "an unknown inferenceConfig member",
                config(json!({"topK": 5})),
            )
            .mentions(&["topK"]),
            bad(
                path,
                "an additional field other than top_k",
                json!({"additionalModelRequestFields": {"min_p": 0.1}}),
            )
            .mentions(&["additionalModelRequestFields.min_p"]),
            bad(
                path,
                "top_k not an integer",
                json!({"additionalModelRequestFields": {"top_k": "five"}}),
            )
            .mentions(&["top_k"]),
            bad(
                path,
                "additional response field paths",
                json!({"additionalModelResponseFieldPaths": ["/stop_sequence"]}),
            )
            .mentions(&["additionalModelResponseFieldPaths"]),
            bad(
                path,
                "optimized latency",
                json!({"performanceConfig": {"latency": "optimized"}}),
            )
            .mentions(&["performanceConfig.latency"]),
            bad(
                path,
                "performanceConfig a list",
                json!({"performanceConfig": [null, null]}),
            )
            .mentions(&["performanceConfig", "object"]),
            bad(
                path,
                "performanceConfig with an unknown member",
                json!({"performanceConfig": {"latency": "standard", "tier": "x"}}),
            )
            .mentions(&["performanceConfig", "tier"]),
            bad(
                path,
                "a prompt beyond the window",
                user(json!([{"text": long}])),
            )
            .mentions(&["256"]),
        ]);
    }
    let mut unknown = bad(CONVERSE, "unknown model", json!({}))
        .status(404)
        .mentions(&["anthropic.claude-v2"]);
    unknown.path = "/model/anthropic.claude-v2/converse";
    let mut unknown_stream = bad(CONVERSE_STREAM, "unknown model", json!({}))
        .status(404)
        .mentions(&["other"]);
    unknown_stream.path = "/model/other/converse-stream";
    cases.extend([unknown, unknown_stream]);
    cases
}

/// Refusals of streamed requests come before the stream: a plain error answer, not SSE.
pub fn streamed() -> Vec<Case> {
    let stream = |patch: Value| merge(json!({"stream": true}), &patch);
    vec![
        bad(
            CHAT,
            "streamed, temperature -1",
            stream(json!({"temperature": -1})),
        )
        .param("temperature"),
        bad(
            CHAT,
            "streamed, unknown model",
            stream(json!({"model": "x"})),
        )
        .status(404)
        .param("model"),
        bad(
            COMPLETIONS,
            "streamed, empty prompt",
            stream(json!({"prompt": []})),
        )
        .param("prompt"),
        bad(RESPONSES, "streamed, top_p 2", stream(json!({"top_p": 2}))).param("top_p"),
        bad(
            MESSAGES,
            "streamed, temperature -1",
            stream(json!({"temperature": -1})),
        )
        .mentions(&["temperature"]),
        bad(
            MESSAGES,
            "streamed, unknown model",
            stream(json!({"model": "x"})),
        )
        .status(404),
    ]
}

/// Oversize bodies on every surface (the server's limit is [`BODY_LIMIT`]).
pub fn oversize() -> Vec<Case> {
    let big = "a ".repeat(BODY_LIMIT);
    let bodies = [
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": big}]}),
        ),
        (COMPLETIONS, json!({"prompt": big})),
        (RESPONSES, json!({"input": big})),
        (
            MESSAGES,
            json!({"messages": [{"role": "user", "content": big}]}),
        ),
        (
            CONVERSE,
            json!({"messages": [{"role": "user", "content": [{"text": big}]}]}),
        ),
        (
            CONVERSE_STREAM,
            json!({"messages": [{"role": "user", "content": [{"text": big}]}]}),
        ),
    ];
    bodies
        .into_iter()
        .map(|(path, patch)| {
            bad(path, "oversize body", patch)
                .status(413)
                .mentions(&["32768"])
        })
        .collect()
}

/// Requests no handler takes, which the fallback answers in OpenAI's shape.
pub fn unrouted() -> Vec<Case> {
    vec![
        bad(CHAT, "unknown route", json!({})).status(404),
        bad(MESSAGES, "unknown route", json!({})).status(404),
    ]
    .into_iter()
    .zip(["/v1/chat/complete", "/v1/message"])
    .map(|(mut case, path)| {
        case.path = path;
        case
    })
    .collect()
}

/// A method a route does not take.
pub fn wrong_method() -> Vec<Case> {
    [CHAT, MESSAGES, CONVERSE]
        .into_iter()
        .map(|path| {
            raw(path, "GET on a POST route", "")
                .status(405)
                .method("GET")
        })
        .collect()
}

/// Bodies cut short, as raw requests: a `Content-Length` beyond the bytes sent, a 10 GB
/// `Content-Length`, a chunked body cut mid-chunk; on converse-stream and on one route of each
/// other surface. The client closes its write half after sending.
pub fn truncated() -> Vec<(&'static str, &'static str, String)> {
    let body = valid(CONVERSE).to_string();
    let cut = &body[..body.len() / 2];
    let request = |path: &str, framing: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             {framing}\r\n\r\n{cut}"
        )
    };
    let larger = format!("Content-Length: {}", body.len() + 100);
    // The chunk announces the whole body; half of it follows.
    let chunked = format!("Transfer-Encoding: chunked\r\n\r\n{:x}", body.len());
    let huge = "Content-Length: 10000000000";
    vec![
        (
            "Content-Length beyond the bytes sent",
            CONVERSE_STREAM,
            request(CONVERSE_STREAM, &larger),
        ),
        (
            "a Content-Length of 10 GB",
            CONVERSE_STREAM,
            request(CONVERSE_STREAM, huge),
        ),
        (
            "a chunked body cut mid-chunk",
            CONVERSE_STREAM,
            request(CONVERSE_STREAM, &chunked),
        ),
        (
            "Content-Length beyond the bytes sent",
            CHAT,
            request(CHAT, &larger),
        ),
        (
            "Content-Length beyond the bytes sent",
            MESSAGES,
            request(MESSAGES, &larger),
        ),
    ]
}
