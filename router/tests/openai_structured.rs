//! Structured output, forced tool calls, log-probabilities, several choices and the sampling
//! extensions through the official `openai` Python SDK (router/tests/openai_structured.py)
//! against a live tiny synthesized model: a random-weight model writes valid JSON, and calls a
//! tool, only because the engine masks every token that would leave the grammar.

mod support;

#[test]
fn structured_output_logprobs_and_choices_through_the_official_openai_sdk() {
    support::run_sdk_script("openai/_version.py", "openai_structured.py", "/v1");
}
