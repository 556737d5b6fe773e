//! Tool calling through boto3's bedrock-runtime client (router/tests/converse_tools.py): the
//! request path against a live tiny synthesized model (`toolConfig` and tool conversations reach
//! the template; bad configurations are `ValidationException`s), and the response framing
//! (`converse` and the `converse-stream` eventstream) of fixed generated texts, which a
//! random-weight model never writes by itself, served to boto3 as recorded bodies.

mod support;

use std::path::Path;

use strata_router::converse::stream::frame_offline;
use strata_router::tools::ToolFormat;

#[test]
fn tool_requests_through_boto3() {
    support::run_sdk_script("boto3/__init__.py", "converse_tools.py", "");
}

/// Fixed outputs through the handlers' framing: `<case>.json` (the `converse` answer) and
/// `<case>.stream` (the `converse-stream` body) for the script.
fn write_framed(dir: &Path) {
    let cases: [(&str, &[&str], &'static str, Option<ToolFormat>); 4] = [
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
        ("no_tools", &["<tool_call>{}</tool_call>"], "end_turn", None),
    ];
    for (name, pieces, stop_reason, format) in cases {
        let (whole, body) = frame_offline(pieces, stop_reason, format);
        std::fs::write(dir.join(format!("{name}.json")), whole.to_string()).unwrap();
        std::fs::write(dir.join(format!("{name}.stream")), body).unwrap();
    }
}

#[test]
fn tool_use_framing_parses_with_boto3() {
    support::run_framed_script("boto3/__init__.py", "converse_tools.py", write_framed);
}
