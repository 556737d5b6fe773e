//! The official SDKs against `/v1/embeddings` and `/v2/rerank` of a live server
//! (router/tests/embeddings_sdk.py): openai 3.x's `embeddings.create` (base64 by default, floats,
//! `dimensions`, typed refusals) and cohere's `ClientV2.rerank` (ordering, `top_n`,
//! `max_tokens_per_doc`, a typed refusal), each with the key the server requires.

mod support;

use support::SdkServer;

#[test]
fn official_openai_sdk_embeds() {
    let server = SdkServer {
        api_key: Some("sk-embeddings-test-key"),
        args: &["--sdk", "openai"],
        ..SdkServer::default()
    };
    support::run_sdk_script_on("openai/_version.py", "embeddings_sdk.py", "", &server);
}

#[test]
fn official_cohere_sdk_reranks() {
    let server = SdkServer {
        api_key: Some("co-rerank-test-key"),
        args: &["--sdk", "cohere"],
        ..SdkServer::default()
    };
    support::run_sdk_script_on(
        "py-cohere:cohere/version.py",
        "embeddings_sdk.py",
        "",
        &server,
    );
}
