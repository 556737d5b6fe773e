//! The tool-call format is picked from the rendered prompt, end to end: a tiny synthesized model
//! served with a Mistral-style `--chat-template` (tools rendered inside `[AVAILABLE_TOOLS]`).
//! Random weights never call a tool by themselves, so a named `tool_choice` forces one: the
//! grammar of the detected format writes it and that format's parser reads it back. A stop
//! string on a format's marker shows which format wrote the output.

mod support;

use std::net::SocketAddr;

use serde_json::{Value, json};
use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::{EngineSpec, KvBudget};
use strata_router::{Access, ServeConfig, ServingOptions, load_state};
use support::http;

/// Mistral's way of rendering tools, reduced to what detection reads.
const MISTRAL_TEMPLATE: &str = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}{%- for m in messages %}{%- if m.role == 'user' %}[INST]\
{{ m.content }}[/INST]{%- else %}{{ m.content }}{%- endif %}{%- endfor %}";

async fn serve_with_template(dir: &std::path::Path, template: &str) -> SocketAddr {
    let spec = SynthSpec {
        max_position: 1024,
        ..SynthSpec::tiny(Architecture::Qwen3, 1)
    };
    synthesize(&spec, dir, None).unwrap();
    let template_file = dir.join("mistral.jinja");
    std::fs::write(&template_file, template).unwrap();
    let config = ServeConfig {
        model_dir: dir.to_path_buf(),
        model_name: "tiny".into(),
        owned_by: "test".into(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        engine: std::sync::Arc::new(EngineSpec {
            kv: KvBudget::Bytes(16 << 20),
            ..EngineSpec::default()
        }),
        options: ServingOptions {
            chat_template: Some(template_file),
            ..ServingOptions::default()
        },
    };
    http::serve(load_state(&config).unwrap(), Access::default()).await
}

/// A forced call of a tool whose only argument is an enum, so the whole output is fixed but
/// for the enum's value; `stop` ends the output at a marker.
fn forced(stop: &str) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"], "additionalProperties": false}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64,
        "stop": [stop],
    })
}

/// The answer ended at its stop string with no call reported.
fn assert_stopped_without_a_call(body: &Value) {
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{body}");
    assert!(
        choice["message"]
            .get("tool_calls")
            .is_none_or(Value::is_null),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mistral_template_makes_calls_in_mistral_format() {
    let dir = tempfile::tempdir().unwrap();
    let addr = serve_with_template(dir.path(), MISTRAL_TEMPLATE).await;

    // Written in Mistral's form and read back by its parser as a call.
    let answer = http::post(addr, "/v1/chat/completions", &forced("<tool_call>")).await;
    assert_eq!(answer.status, 200, "{}", answer.describe());
    let body = answer.json();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{body}");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["c", "f"].contains(&arguments["unit"].as_str().unwrap()),
        "{body}"
    );

    // The canary: stopping at Mistral's marker leaves no call, so the output began with it.
    let answer = http::post(addr, "/v1/chat/completions", &forced("[TOOL_CALLS]")).await;
    assert_stopped_without_a_call(&answer.json());
}

/// The canary: the same template showing `<tool_call>` instead is Hermes, and the first
/// request above, stopped at Hermes's marker, then has no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_under_a_hermes_template_is_told_apart() {
    let dir = tempfile::tempdir().unwrap();
    let hermes = MISTRAL_TEMPLATE.replace("[AVAILABLE_TOOLS]", "<tool_call>");
    let addr = serve_with_template(dir.path(), &hermes).await;
    let answer = http::post(addr, "/v1/chat/completions", &forced("<tool_call>")).await;
    assert_stopped_without_a_call(&answer.json());
}
