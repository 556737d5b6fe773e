//! vLLM's utility endpoints over real HTTP: `/tokenize` (a prompt, and chat messages through the
//! template, whose ids must be the ones `/v1/chat/completions` counts as its prompt),
//! `/detokenize` back to the text, `/version`, `/ping`, and `max_model_len` in `/v1/models`;
//! bad input refused by name. Then vLLM's serving options on every surface: other names for the
//! model (`--served-model-name`), a smaller window (`--max-model-len`) reported and enforced,
//! and a chat template file (`--chat-template`) in place of the checkpoint's.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::{EngineSpec, KvBudget};
use strata_router::{Access, ServeConfig, ServingOptions, load_state};
use support::http::{self, Answer};

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

/// A window well below the tiny model's 256.
const SERVED_WINDOW: u64 = 64;

/// The tiny Qwen3 served as `served` with the alias `alias`, a window of [`SERVED_WINDOW`] and
/// the template file `template`, through the path `strata serve` takes ([`load_state`]).
async fn serve_presented(model_dir: &std::path::Path, template: &str) -> SocketAddr {
    synthesize(&SynthSpec::tiny(Architecture::Qwen3, 1), model_dir, None).unwrap();
    let file = model_dir.join("override.jinja");
    std::fs::write(&file, template).unwrap();
    let config = ServeConfig {
        model_dir: model_dir.to_path_buf(),
        model_name: "served".into(),
        owned_by: "test".into(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        engine: std::sync::Arc::new(EngineSpec {
            kv: KvBudget::Bytes(16 << 20),
            ..EngineSpec::default()
        }),
        options: ServingOptions {
            aliases: vec!["alias".into()],
            max_model_len: Some(SERVED_WINDOW as usize),
            chat_template: Some(file),
        },
    };
    let state = load_state(&config).unwrap();
    assert_eq!(state.context_window() as u64, SERVED_WINDOW);
    http::serve(state, Access::default()).await
}

fn refused(answer: &Answer, status: u16, what: &str) -> Value {
    assert_eq!(answer.status, status, "{what}: {}", answer.describe());
    answer.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_names_a_smaller_window_and_a_template_file_hold_on_every_surface() {
    let model_dir = tempfile::tempdir().unwrap();
    let template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}\
                    {% if add_generation_prompt %}>>{% endif %}";
    let addr = serve_presented(model_dir.path(), template).await;

    // Listed under each name (the served one first, as vLLM lists them), with the served
    // window; an alias is retrieved as itself, naming the model it serves.
    let models = http::send(addr, "GET", "/v1/models", b"").await.json();
    let data = models["data"].as_array().unwrap();
    let ids: Vec<&Value> = data.iter().map(|m| &m["id"]).collect();
    assert_eq!(ids, [&json!("served"), &json!("alias")], "{models}");
    assert!(
        data.iter()
            .all(|m| m["max_model_len"] == SERVED_WINDOW && m["root"] == "served")
    );
    let by_alias = http::send(addr, "GET", "/v1/models/alias", b"")
        .await
        .json();
    assert_eq!(
        (&by_alias["id"], &by_alias["root"]),
        (&json!("alias"), &json!("served"))
    );

    // The template file renders chat prompts: /tokenize shows what chat would feed the model.
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let rendered = http::post(
        addr,
        "/tokenize",
        &json!({"model": "alias", "messages": messages}),
    )
    .await
    .json();
    assert_eq!(rendered["max_model_len"], SERVED_WINDOW, "{rendered}");
    let text = http::post(addr, "/detokenize", &json!({"tokens": rendered["tokens"]}))
        .await
        .json();
    assert_eq!(text["prompt"], "[user] Name a colour.\n>>", "{text}");

    // Every surface takes either name and reports the served one.
    let chat = json!({"model": "alias", "messages": messages, "max_tokens": 2});
    let answer = http::post(addr, "/v1/chat/completions", &chat).await.json();
    assert_eq!(answer["model"], "served", "{answer}");
    assert_eq!(
        answer["usage"]["prompt_tokens"], rendered["count"],
        "{answer}"
    );
    let completion = json!({"model": "served", "prompt": "hello", "max_tokens": 2});
    let answer = http::post(addr, "/v1/completions", &completion)
        .await
        .json();
    assert_eq!(answer["model"], "served", "{answer}");
    let responses = json!({"model": "alias", "input": "hello", "max_output_tokens": 2,
                           "store": false});
    let answer = http::post(addr, "/v1/responses", &responses).await.json();
    assert_eq!(answer["model"], "served", "{answer}");
    let anthropic = json!({"model": "alias", "messages": messages, "max_tokens": 2});
    let answer = http::post(addr, "/v1/messages", &anthropic).await.json();
    assert_eq!(answer["model"], "served", "{answer}");
    let converse = json!({"messages": [{"role": "user", "content": [{"text": "hello"}]}],
                          "inferenceConfig": {"maxTokens": 2}});
    let answer = http::post(addr, "/model/alias/converse", &converse).await;
    assert_eq!(answer.status, 200, "{}", answer.describe());
    let unknown = json!({"model": "other", "messages": messages, "max_tokens": 2});
    refused(
        &http::post(addr, "/v1/chat/completions", &unknown).await,
        404,
        "unknown",
    );
    refused(
        &http::post(addr, "/model/other/converse", &converse).await,
        404,
        "converse",
    );

    // A prompt whose max_tokens would run past the served window is refused in each surface's
    // shape, though the model's own window (256) holds it.
    let over = (SERVED_WINDOW + 10) as u32;
    let completion = json!({"model": "served", "prompt": "hello", "max_tokens": over});
    let error = refused(
        &http::post(addr, "/v1/completions", &completion).await,
        400,
        "openai",
    );
    assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains(&SERVED_WINDOW.to_string()), "{message}");
    let anthropic = json!({"model": "served", "messages": messages, "max_tokens": over});
    let error = refused(
        &http::post(addr, "/v1/messages", &anthropic).await,
        400,
        "anthropic",
    );
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    let converse = json!({"messages": [{"role": "user", "content": [{"text": "hello"}]}],
                          "inferenceConfig": {"maxTokens": over}});
    let answer = http::post(addr, "/model/served/converse", &converse).await;
    refused(&answer, 400, "converse");
    assert_eq!(
        answer.header("x-amzn-errortype"),
        Some("ValidationException")
    );
    // A prompt past the window by itself, whatever max_tokens.
    let long = "hello ".repeat(SERVED_WINDOW as usize);
    let completion = json!({"model": "served", "prompt": long, "max_tokens": 1});
    let error = refused(
        &http::post(addr, "/v1/completions", &completion).await,
        400,
        "long",
    );
    assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");

    // Without max_tokens the output may fill the served window, not more.
    let open = json!({"model": "served", "prompt": "hello", "ignore_eos": true});
    let answer = http::post(addr, "/v1/completions", &open).await.json();
    assert_eq!(answer["usage"]["total_tokens"], SERVED_WINDOW, "{answer}");
}
