//! Tool calling through the official `anthropic` Python SDK (router/tests/anthropic_tools.py):
//! the request path against a live tiny synthesized model (tools and tool conversations reach
//! the template; bad definitions are refused in Anthropic's shape), and the response framing
//! (whole and streamed) of fixed generated texts, which a random-weight model never writes by
//! itself, parsed by the SDK's own client and stream helpers.

mod support;

use std::path::Path;

use strata_router::anthropic::stream::frame_offline;
use strata_router::tools::ToolFormat;

#[test]
fn tool_requests_through_the_official_anthropic_sdk() {
    support::run_sdk_script("anthropic/_version.py", "anthropic_tools.py", "");
}

/// Fixed outputs through the handler's framing, written as JSON files for the script.
fn write_framed(dir: &Path) {
    let cases: [(&str, &[&str], &'static str, Option<ToolFormat>); 6] = [
        (
            "hermes_two_calls",
            &[
                "Checking.\n<tool_",
                "call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
                "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
            ],
            "end_turn",
            Some(ToolFormat::Hermes),
        ),
        (
            "hermes_malformed",
            &["<tool_call>{\"name\": oops}", "</tool_call>"],
            "max_tokens",
            Some(ToolFormat::Hermes),
        ),
        (
            "llama_json",
            &[
                "{\"name\": \"get_weather\", ",
                "\"parameters\": {\"city\": \"Oslo\"}}",
            ],
            "end_turn",
            Some(ToolFormat::LlamaJson),
        ),
        (
            "call_then_text",
            &[
                "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}</tool_call>",
                "\nDone.",
            ],
            "max_tokens",
            Some(ToolFormat::Hermes),
        ),
        (
            "hermes_cut_call",
            &["Let me check.", "<tool_call>{\"name\": \"get_wea"],
            "max_tokens",
            Some(ToolFormat::Hermes),
        ),
        ("no_tools", &["<tool_call>{}</tool_call>"], "end_turn", None),
    ];
    for (name, pieces, stop_reason, format) in cases {
        let (whole, events) = frame_offline(pieces, stop_reason, format);
        let framed = serde_json::json!({"whole": whole, "events": events});
        std::fs::write(dir.join(format!("{name}.json")), framed.to_string()).unwrap();
    }
}

#[test]
fn tool_use_framing_parses_with_the_official_anthropic_sdk() {
    support::run_framed_script("anthropic/_version.py", "anthropic_tools.py", write_framed);
}
