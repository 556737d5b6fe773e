//! The official `anthropic` Python SDK against a live server (router/tests/anthropic_sdk.py).

mod support;

#[test]
fn official_anthropic_sdk_works_unmodified() {
    support::run_sdk_script("anthropic/_version.py", "anthropic_sdk.py", "");
}
