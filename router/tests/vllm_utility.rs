//! vLLM's utility endpoints over real HTTP: `/tokenize` (a prompt, and chat messages through the
//! template, whose ids must be the ones `/v1/chat/completions` counts as its prompt),
//! `/detokenize` back to the text, `/version`, `/ping`, and `max_model_len` in `/v1/models`;
//! bad input refused by name.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use strata_router::Access;
use support::http;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_version_ping_and_the_context_window() {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    let window = state.context_window() as u64;
    let addr = http::serve(state, Access::default()).await;

    let models = http::send(addr, "GET", "/v1/models", b"").await.json();
    assert_eq!(models["data"][0]["max_model_len"], window, "{models}");
    let version = http::send(addr, "GET", "/version", b"").await.json();
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));
    for method in ["GET", "POST"] {
        let ping = http::send(addr, method, "/ping", b"").await;
        assert_eq!(ping.status, 200, "{}", ping.describe());
    }

    // A prompt, and its ids back to the text.
    let text = "Hello there, tokenizer ✓";
    let out = http::post(addr, "/tokenize", &json!({"model": "tiny", "prompt": text})).await;
    let out = out.json();
    let tokens: Vec<u64> = serde_json::from_value(out["tokens"].clone()).unwrap();
    assert_eq!(out["count"], tokens.len() as u64);
    assert_eq!(out["max_model_len"], window);
    let plain = http::post(
        addr,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    )
    .await
    .json();
    let plain: Vec<u64> = serde_json::from_value(plain["tokens"].clone()).unwrap();
    let back = http::post(addr, "/detokenize", &json!({"tokens": plain}))
        .await
        .json();
    assert_eq!(back["prompt"], text, "{back}");

    // Chat messages: the ids chat completions count as its prompt.
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let chat = http::post(addr, "/tokenize", &json!({"messages": messages}))
        .await
        .json();
    let completion = http::post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": messages, "max_tokens": 1}),
    )
    .await
    .json();
    assert_eq!(
        chat["count"], completion["usage"]["prompt_tokens"],
        "{chat} {completion}"
    );

    // Refusals name what is wrong.
    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": []}),
            "messages",
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "narrator", "content": "x"}]}),
            "messages[0].role",
        ),
        ("/detokenize", json!({"tokens": [u32::MAX]}), "tokens"),
    ] {
        let answer = http::post(addr, path, &body).await;
        assert_eq!(answer.status, 400, "{path} {body}: {}", answer.describe());
        let error: Value = answer.json();
        assert_eq!(error["error"]["param"], param, "{path} {body}: {error}");
    }
    let wrong = http::post(addr, "/tokenize", &json!({"model": "other", "prompt": "a"})).await;
    assert_eq!(wrong.status, 404, "{}", wrong.describe());
    let unknown = http::post(addr, "/tokenize", &json!({"prompt": "a", "frob": 1})).await;
    assert_eq!(unknown.status, 400, "{}", unknown.describe());
}
