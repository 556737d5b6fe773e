//! The official `anthropic` Python SDK against a live server (router/tests/anthropic_sdk.py),
//! which also knows the model by an alias (`--served-model-name`) and requires its own key
//! (`--api-key`), which the SDK sends as `x-api-key`.

mod support;

use support::SdkServer;

#[test]
fn official_anthropic_sdk_works_unmodified() {
    let server = SdkServer {
        aliases: &["claude-sonnet-4-5"],
        api_key: Some("sk-anthropic-sdk-test-key"),
        ..SdkServer::default()
    };
    support::run_sdk_script_on("anthropic/_version.py", "anthropic_sdk.py", "", &server);
}
