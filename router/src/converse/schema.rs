//! The Converse request body, as botocore's service model spells it (camelCase). Content blocks
//! stay JSON values so that an unsupported block is refused by position, not as a parse error.

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConverseRequest {
    #[serde(default)]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub system: Vec<Value>,
    #[serde(default)]
    pub inference_config: InferenceConfig,
    pub tool_config: Option<Value>,
    pub guardrail_config: Option<Value>,
    pub prompt_variables: Option<Value>,
    /// Model parameters Converse has no member for: `top_k` is taken, any other is refused.
    pub additional_model_request_fields: Option<Value>,
    /// Refused unless empty: no model-specific response fields are returned.
    pub additional_model_response_field_paths: Option<Value>,
    /// Accepted and ignored: tags for the caller's own logs.
    pub request_metadata: Option<Value>,
    /// `{"latency": "standard"}`, how this server always runs; `optimized` is refused.
    pub performance_config: Option<Value>,
    /// Any other member: refused by name unless `null`.
    #[serde(flatten)]
    pub extra: std::collections::BTreeMap<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Vec<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceConfig {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stop_sequences: Vec<String>,
}
