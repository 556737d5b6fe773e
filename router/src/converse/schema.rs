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
#[serde(rename_all = "camelCase")]
pub struct InferenceConfig {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stop_sequences: Vec<String>,
}
