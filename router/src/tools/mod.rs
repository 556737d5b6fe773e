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
    render(state, messages, tools, param, false)
}

/// [`render_conversation`] for the surfaces whose last assistant turn is a prefill (Anthropic
/// Messages, Bedrock Converse): a conversation ending with an assistant turn of text is rendered
/// without the generation prompt and cut right after that text, so the model continues it
/// rather than answering it; the answer holds only the continuation.
pub(crate) fn render_prefilled(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    param: &'static str,
) -> Result<(Vec<u32>, Option<ToolFormat>), ApiError> {
    render(state, messages, tools, param, true)
}

/// The text an assistant turn ending `messages` prefills, if it does: plain text content,
/// no tool calls, not blank.
fn prefill(messages: &[Value]) -> Option<&str> {
    let last = messages.last()?;
    if last.get("role").and_then(Value::as_str) != Some("assistant")
        || last.get("tool_calls").is_some_and(|c| !c.is_null())
    {
        return None;
    }
    let text = last.get("content")?.as_str()?.trim_end();
    (!text.trim_start().is_empty()).then_some(text)
}

/// `text` (a conversation rendered without the generation prompt) cut right after the last
/// occurrence of `prefix`, the final assistant turn's text: templates close a turn after its
/// text (an end-of-turn token), and the continuation starts where the text ends. Templates trim
/// the text or keep it as written; one that rewrites it leaves nothing to cut at (`None`).
fn continued(mut text: String, prefix: &str) -> Option<String> {
    let end = text.rfind(prefix)? + prefix.len();
    text.truncate(end);
    Some(text)
}

fn render(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    param: &'static str,
    prefilled: bool,
) -> Result<(Vec<u32>, Option<ToolFormat>), ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            Some(param),
            "the served model has no chat template; use /v1/completions",
        )
    })?;
    let prefix = prefilled
        .then(|| prefill(&messages).map(str::to_owned))
        .flatten();
    let request = ChatRequest {
        messages,
        tools,
        add_generation_prompt: prefix.is_none(),
        extra: Default::default(),
    };
    let mut text = template.render(&request)?;
    if let Some(prefix) = prefix {
        text = continued(text, &prefix).ok_or_else(|| {
            ApiError::invalid(
                Some(param),
                "the chat template does not render the final assistant turn as written, so it \
                 cannot be continued; end the conversation with a user turn",
            )
        })?;
    }
    let format = request
        .tools
        .as_deref()
        .map(|tools| ToolFormat::detect(&text).typed_by(tools));
    Ok((state.encode(&text, false, param)?, format))
}

#[cfg(test)]
mod prefill_tests {
    use serde_json::json;
    use strata_model::chat::{ChatRequest, ChatTemplate};

    use super::{continued, prefill};

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
        {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn rendered(messages: serde_json::Value, add_generation_prompt: bool) -> String {
        let template = ChatTemplate::new(CHATML.into(), None, None).unwrap();
        template
            .render(&ChatRequest {
                messages: messages.as_array().unwrap().clone(),
                tools: None,
                add_generation_prompt,
                extra: Default::default(),
            })
            .unwrap()
    }

    #[test]
    fn a_final_assistant_text_is_continued_where_it_ends() {
        let question = json!([{"role": "user", "content": "What is the capital of France?"}]);
        let mut prefilled = question.as_array().unwrap().clone();
        prefilled.push(json!({"role": "assistant", "content": "The capital is "}));
        let prefix = prefill(&prefilled).unwrap();
        assert_eq!(prefix, "The capital is");
        let text = continued(rendered(json!(prefilled), false), prefix).unwrap();
        // The question with its generation prompt, then the prefill: no end of turn between.
        assert_eq!(text, format!("{}The capital is", rendered(question, true)));
        assert!(continued("<|im_start|>assistant\nParis".into(), "Lyon").is_none());
    }

    #[test]
    fn only_a_text_turn_of_the_assistant_last_is_a_prefill() {
        let user = json!({"role": "user", "content": "hi"});
        let said = |content: serde_json::Value| json!({"role": "assistant", "content": content});
        assert!(prefill(std::slice::from_ref(&user)).is_none());
        assert!(prefill(&[user.clone(), said(json!("  "))]).is_none());
        assert!(prefill(&[user.clone(), said(json!(null))]).is_none());
        let called = json!({"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]});
        assert!(prefill(&[user.clone(), called]).is_none());
        assert_eq!(prefill(&[user, said(json!("Sure:"))]), Some("Sure:"));
    }
}
