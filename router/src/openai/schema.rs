//! OpenAI request bodies as clients send them, and the usage block responses carry. Fields this
//! server does not implement yet are kept as raw JSON so they can be refused by name instead of
//! silently ignored.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// The sampling fields `/v1/chat/completions` and `/v1/completions` share.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string, per OpenAI) → bias added to its logit.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub n: Option<i64>,
    /// Extensions (vLLM's names): keep the `top_k` most likely tokens; drop tokens below
    /// `min_p` × the top probability; HF's repetition penalty. Omitted: the checkpoint's defaults.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Extensions (vLLM's names): keep generating past end-of-sequence tokens; hold back stop
    /// tokens until this many tokens were generated. Benchmarks depend on both.
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Accepted and ignored: no per-user behaviour yet.
    #[allow(dead_code)]
    pub user: Option<String>,
    /// Chat: a boolean (with `top_logprobs` 0–20 alternatives); completions: an integer count
    /// of alternatives.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    /// Chat takes `tools` and `tool_choice` out before these fields are checked; every other
    /// route still refuses them.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    /// `text`, `json_object` or `json_schema`: enforced while decoding.
    pub response_format: Option<Value>,
    /// vLLM's structured outputs, enforced like `response_format` (one source at most):
    /// `structured_outputs: {json | regex | choice | grammar}` and the older `guided_json`,
    /// `guided_regex`, `guided_choice`, `guided_grammar`.
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub echo: Option<Value>,
    pub best_of: Option<Value>,
    pub suffix: Option<Value>,
    /// Every other field the request carries: accepted only when listed in [`IGNORED_FIELDS`]
    /// or set to the value this server always behaves as ([`DEFAULT_ONLY_FIELDS`]); any other is
    /// refused by name, never silently dropped.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// Fields accepted and ignored: hints with no effect on what is generated (docs/SERVING.md).
pub const IGNORED_FIELDS: &[&str] = &[
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
];

/// vLLM's fields whose only accepted value is how this server always behaves: the stop string
/// is left out of the output, special tokens are skipped and spaced, no prompt log-probabilities.
pub const DEFAULT_ONLY_FIELDS: &[(&str, Value)] = &[
    ("include_stop_str_in_output", Value::Bool(false)),
    ("skip_special_tokens", Value::Bool(true)),
    ("spaces_between_special_tokens", Value::Bool(true)),
];

impl SamplingFields {
    /// The first field set to a value this server cannot honour (yet), or that it does not know.
    pub fn unsupported(&self) -> Option<(String, String)> {
        if let Some(name) = self.unsupported_known() {
            return Some((
                name.to_string(),
                format!("`{name}` is not supported by this server yet"),
            ));
        }
        self.extra.iter().find_map(|(name, value)| {
            if value.is_null() || IGNORED_FIELDS.contains(&name.as_str()) {
                return None;
            }
            if let Some((_, default)) = DEFAULT_ONLY_FIELDS.iter().find(|(n, _)| n == name) {
                return (value != default).then(|| {
                    (
                        name.clone(),
                        format!("`{name}` can only be {default} on this server; got {value}"),
                    )
                });
            }
            Some((
                name.clone(),
                format!("`{name}` is not a field this server knows"),
            ))
        })
    }

    fn unsupported_known(&self) -> Option<&'static str> {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        let truthy = |v: &Option<Value>| {
            v.as_ref()
                .is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)))
        };
        let one = |v: &Option<Value>| v.as_ref().is_none_or(|v| v.is_null() || v == 1);
        [
            ("tools", set(&self.tools)),
            ("tool_choice", set(&self.tool_choice)),
            ("functions", set(&self.functions)),
            ("echo", truthy(&self.echo)),
            ("best_of", !one(&self.best_of)),
            ("suffix", set(&self.suffix)),
        ]
        .into_iter()
        .find_map(|(name, refused)| refused.then_some(name))
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn clone_vec(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<Value>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    /// A string, an array of token ids, or a batch: an array of strings or of token-id arrays.
    pub prompt: Value,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

pub use crate::serving::usage::{PromptTokensDetails, UsageBody};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> SamplingFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn unknown_fields_are_refused_by_name_and_hints_are_accepted() {
        let ok = fields(json!({
            "temperature": 0, "store": true, "metadata": {"a": "b"}, "service_tier": "auto",
            "skip_special_tokens": true, "include_stop_str_in_output": false, "unheard_of": null
        }));
        assert_eq!(ok.unsupported(), None);
        let (field, message) = fields(json!({"unheard_of": 3})).unsupported().unwrap();
        assert_eq!(field, "unheard_of");
        assert!(message.contains("`unheard_of`"), "{message}");
        let (field, message) = fields(json!({"skip_special_tokens": false}))
            .unsupported()
            .unwrap();
        assert_eq!(field, "skip_special_tokens");
        assert!(message.contains("true"), "{message}");
        assert_eq!(
            fields(json!({"echo": true})).unsupported().map(|u| u.0),
            Some("echo".to_string())
        );
    }
}
