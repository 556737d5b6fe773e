//! The official `openai` Python SDK against a live server (router/tests/openai_sdk.py), which
//! also knows the model by an alias (`--served-model-name`) and requires its own key
//! (`--api-key`), passed to the SDK as vLLM's users do: `OpenAI(api_key=KEY)`.

mod support;

use support::SdkServer;

#[test]
fn official_openai_sdk_works_unmodified() {
    let server = SdkServer {
        aliases: &["gpt-4o-mini", "tiny-alias"],
        api_key: Some("sk-openai-sdk-test-key"),
        ..SdkServer::default()
    };
    support::run_sdk_script_on("openai/_version.py", "openai_sdk.py", "/v1", &server);
}
