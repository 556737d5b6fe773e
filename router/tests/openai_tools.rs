//! Tool calling through the official `openai` Python SDK (router/tests/openai_tools.py): the
//! request path against a live tiny synthesized model, and the response framing (whole and
//! streamed) of fixed generated texts, which a random-weight model never writes by itself,
//! checked by the SDK's own types.

mod support;

use std::path::Path;

use strata_router::openai::chat::frame_offline;
use strata_router::openai::tools::ToolFormat;

#[test]
fn tool_requests_through_the_official_openai_sdk() {
    support::run_sdk_script("openai/_version.py", "openai_tools.py", "/v1");
}

/// Fixed outputs through the handler's framing, written as JSON files for the script.
fn write_framed(dir: &Path) {
    let cases: [(&str, &[&str], Option<ToolFormat>); 4] = [
        (
            "hermes_two_calls",
            &[
                "Checking.\n<tool_",
                "call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
            ],
            Some(ToolFormat::Hermes),
        ),
        (
            "hermes_malformed",
            &["<tool_call>{\"name\": oops}</tool_call>"],
            Some(ToolFormat::Hermes),
        ),
        (
            "llama_json",
            &[
                "{\"name\": \"get_weather\", ",
                "\"parameters\": {\"city\": \"Oslo\"}}",
            ],
            Some(ToolFormat::LlamaJson),
        ),
        ("no_tools", &["<tool_call>{}</tool_call>"], None),
    ];
    for (name, pieces, format) in cases {
        let (whole, chunks) = frame_offline(pieces, "stop", format);
        let framed = serde_json::json!({"whole": whole, "chunks": chunks});
        std::fs::write(dir.join(format!("{name}.json")), framed.to_string()).unwrap();
    }
}

#[test]
fn tool_call_framing_parses_with_the_official_openai_sdk() {
    support::run_framed_script("openai/_version.py", "openai_tools.py", write_framed);
}
