//! The Responses API through the official `openai` Python SDK (router/tests/openai_responses.py).

mod support;

#[test]
fn official_openai_sdk_drives_the_responses_api() {
    support::run_sdk_script("openai/_version.py", "openai_responses.py", "/v1");
}
