//! Tool calling shared by every surface. Each surface reads its own JSON (OpenAI's function
//! tools, Anthropic's `tools` and `tool_use` / `tool_result` blocks, Converse's `toolConfig` and
//! `toolUse` / `toolResult` blocks) into the one shape the chat template takes; the model's
//! output is split back into text and calls by one splitter (`calls.rs`; the formats that need
//! more than a few lines live in `mistral.rs`, `qwen_xml.rs` and `pythonic.rs`) and, for the
//! block-based surfaces, framed into content blocks by one framer ([`blocks`]); their tool
//! conversations are translated by [`transcript`].

pub mod blocks;
mod calls;
pub mod constraint;
pub mod definitions;
mod mistral;
mod pythonic;
mod qwen_xml;
pub mod transcript;

pub use calls::{Parsed, Piece, ToolCall, ToolCallSplitter, ToolFormat, parse};

use strata_protocol::Constraint;

use constraint::{ForcedCall, forced_call};

/// A rendered prompt: its token ids, the call format to parse when tools were rendered, and the
/// grammar when the tool choice forces a call.
pub(crate) type Rendered = (Vec<u32>, Option<ToolFormat>, Option<Constraint>);

/// The grammar forcing `forced` calls of the rendered `tools`, when tools were rendered (and so
/// a call format is known) and the choice forces a call.
pub(crate) fn forced_constraint(
    format: Option<&ToolFormat>,
    tools: Option<&[Value]>,
    forced: Option<ForcedCall>,
) -> Option<Constraint> {
    Some(forced_call(format?, tools?, &forced?))
}

use serde_json::Value;
use strata_model::chat::ChatRequest;

use crate::error::ApiError;
use crate::state::AppState;

/// Template-shaped messages (and tools) through the model's chat template with the generation
/// prompt, as token ids, and the call format to parse when tools were rendered. `param` names
/// the request field a missing template is blamed on.
pub(crate) fn render_conversation(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    param: &'static str,
) -> Result<(Vec<u32>, Option<ToolFormat>), ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            Some(param),
            "the served model has no chat template; use /v1/completions",
        )
    })?;
    let request = ChatRequest {
        messages,
        tools,
        add_generation_prompt: true,
        extra: Default::default(),
    };
    let text = template.render(&request)?;
    let format = request
        .tools
        .as_deref()
        .map(|tools| ToolFormat::detect(&text).typed_by(tools));
    Ok((state.tokenizer.encode(&text, false)?, format))
}
