//! Anthropic Messages request bodies as clients send them. Content blocks and tools stay JSON
//! values: `prompt.rs` reads them and refuses what it does not understand by position, never
//! silently dropping it.

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    /// Required by Anthropic; checked by hand so the refusal names the field.
    pub max_tokens: Option<i64>,
    #[serde(flatten)]
    pub conversation: Conversation,
    #[serde(default)]
    pub stop_sequences: Vec<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    /// Accepted and ignored: no per-user behaviour yet.
    #[allow(dead_code)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub stream: bool,
    /// Not implemented yet: refused by name when set.
    pub thinking: Option<Value>,
    /// `format` (`{"type": "json_schema", "schema": …}`) is enforced while decoding; `effort`
    /// is accepted and has no effect here.
    pub output_config: Option<Value>,
    /// Every other field: `service_tier` is accepted and ignored, anything else is refused by
    /// name (never silently dropped).
    #[serde(flatten)]
    pub extra: std::collections::BTreeMap<String, Value>,
}

/// What is rendered into the prompt: shared by `/v1/messages` and `/v1/messages/count_tokens`.
#[derive(Debug, Clone, Deserialize)]
pub struct Conversation {
    pub system: Option<Content>,
    pub messages: Vec<Message>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct CountTokensRequest {
    pub model: String,
    #[serde(flatten)]
    pub conversation: Conversation,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Content,
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
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// A string, or an array of content blocks (kept as JSON so a non-text block is refused by
/// position rather than as an opaque parse error).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Value>),
}
