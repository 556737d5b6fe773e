//! The official `openai` Python SDK streams a speculative completion exactly as a plain one
//! (router/tests/openai_spec.py): two servers of one model, one with n-gram speculation, the
//! same requests to both, every chunk's text, log-probabilities and finish reason compared.

mod support;

use strata_node::speculative::SpeculativeConfig;

#[test]
fn official_openai_sdk_streams_speculation_as_plain_decoding() {
    let speculative = SpeculativeConfig {
        prompt_lookup_min: Some(1),
        ..SpeculativeConfig::ngram(4)
    };
    support::run_sdk_script_on_pair("openai/_version.py", "openai_spec.py", speculative);
}
