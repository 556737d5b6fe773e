//! The official `openai` Python SDK against a live server (router/tests/openai_sdk.py).

mod support;

#[test]
fn official_openai_sdk_works_unmodified() {
    support::run_sdk_script("openai/_version.py", "openai_sdk.py", "/v1");
}
