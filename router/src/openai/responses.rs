//! `POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API over the same chat
//! template and [`Generation`] as `/v1/chat/completions`, with a bounded in-memory store so that
//! `previous_response_id` continues a conversation.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::stream;
use serde::Deserialize;
use serde_json::{Value, json};

use super::responses_output::{ItemEvent, OutputItems};
use super::responses_tools::{self, push_tool_item};
use super::schema::{SamplingFields, UsageBody};
use super::{Prepared, check_model, parse_body};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::serving::generation::{Generation, Step};
use crate::state::{AppState, unix_now};
use crate::tools::{ToolFormat, forced_constraint, render_conversation};

/// How many responses the store keeps; the oldest is forgotten first (FIFO).
pub const STORE_CAPACITY: usize = 10_000;

/// The Responses routes with a store of their own (one per app, so tests never share one).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/responses", post(create))
        .route("/v1/responses/{id}", get(retrieve))
        .layer(Extension(Arc::new(ResponseStore::new(STORE_CAPACITY))))
}

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: String,
    input: Input,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    store: Option<bool>,
    previous_response_id: Option<String>,
    /// Accepted and echoed; no per-user behaviour.
    #[allow(dead_code)]
    user: Option<String>,
    metadata: Option<Value>,
    /// Function tools, flat (`{"type": "function", "name", "parameters", ...}`); see
    /// [`responses_tools`].
    tools: Option<Value>,
    /// `auto`, `none`, `required` or `{"type": "function", "name"}`, as on chat.
    tool_choice: Option<Value>,
    /// `text.format`: `text`, `json_object` or `json_schema` (with `schema`), enforced while
    /// decoding (what the SDK's `responses.parse` sends).
    text: Option<Value>,
    /// Every other field: accepted only when listed in [`IGNORED`] (or null), else refused by
    /// name.
    #[serde(flatten)]
    extra: std::collections::BTreeMap<String, Value>,
}

/// Responses fields accepted and ignored: hints with no effect on what is generated here.
const IGNORED: &[&str] = &[
    "parallel_tool_calls",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// One stored response: who made it, the conversation it ended (input and output, as chat
/// messages with string content), and the response object for `GET`.
struct Stored {
    tenant: Arc<str>,
    conversation: Vec<Value>,
    response: Value,
}

/// A bounded map from response id to [`Stored`]; the insertion order drives eviction.
pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    next: u64,
    entries: HashMap<String, Stored>,
    order: VecDeque<String>,
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        // A panic while holding the lock leaves plain data behind; it stays usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_number(&self) -> u64 {
        let mut inner = self.lock();
        inner.next += 1;
        inner.next
    }

    fn insert(&self, id: String, stored: Stored) {
        let mut inner = self.lock();
        while inner.order.len() >= self.capacity {
            match inner.order.pop_front() {
                Some(old) => {
                    inner.entries.remove(&old);
                }
                None => break,
            }
        }
        inner.order.push_back(id.clone());
        inner.entries.insert(id, stored);
    }

    /// The stored entry's field, if `id` exists and belongs to `tenant` (another tenant's
    /// responses are as unknown as missing ones).
    fn read<T>(&self, id: &str, tenant: &str, f: impl FnOnce(&Stored) -> T) -> Option<T> {
        let inner = self.lock();
        inner
            .entries
            .get(id)
            .filter(|s| &*s.tenant == tenant)
            .map(f)
    }
}

/// `text.format` as chat's `response_format` (the Responses API puts `schema` beside `type`
/// instead of under `json_schema`); refusals name `text.format`.
fn text_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let refuse = |message: &str| Err(ApiError::invalid(Some("text.format"), message));
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => match format.get("schema") {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(
                json!({"type": "json_schema", "json_schema": {"schema": schema}}),
            )),
            _ => refuse("`text.format` of type `json_schema` needs `schema`, a JSON Schema object"),
        },
        _ => refuse("`text.format.type` must be \"text\", \"json_object\" or \"json_schema\""),
    }
}

async fn create(
    State(state): State<AppState>,
    Extension(store): Extension<Arc<ResponseStore>>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: ResponsesRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    if let Some((name, _)) = request
        .extra
        .iter()
        .find(|(name, value)| !value.is_null() && !IGNORED.contains(&name.as_str()))
    {
        return Err(ApiError::invalid(
            Some(name),
            format!("`{name}` is not supported by /v1/responses"),
        ));
    }
    let tenant_name: Arc<str> = tenant.as_ref().map_or(Arc::from(""), |t| t.name.clone());
    let mut conversation = match &request.previous_response_id {
        Some(id) => store
            .read(id, &tenant_name, |s| s.conversation.clone())
            .ok_or_else(|| unknown_response(id, Some("previous_response_id")))?,
        None => Vec::new(),
    };
    let tools = responses_tools::read(request.tools.as_ref(), request.tool_choice.as_ref())?;
    input_messages(&request.input, &mut conversation)?;
    let (prompt, format) = render(
        &state,
        request.instructions.as_deref(),
        &conversation,
        tools.template.clone(),
    )?;
    let fields = SamplingFields {
        max_completion_tokens: request.max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        stream: Some(request.stream),
        response_format: text_format(request.text.as_ref())?,
        ..SamplingFields::default()
    };
    let mut prepared = Prepared::new(&state, &fields, prompt, "input")
        .map_err(rename_max_tokens)?
        .for_tenant(tenant.as_deref());
    prepared.keep_special_tokens = format
        .as_ref()
        .is_some_and(crate::tools::ToolFormat::keeps_special_tokens);
    if let Some(forced) =
        forced_constraint(format.as_ref(), tools.template.as_deref(), tools.forced)
    {
        if prepared.constraint.is_some() {
            return Err(ApiError::invalid(
                Some("text.format"),
                "`text.format` cannot apply when `tool_choice` forces a tool call",
            ));
        }
        prepared.constraint = Some(forced);
    }
    let number = store.next_number();
    let shell = ResponseShell {
        id: format!("resp_{number}"),
        number,
        format,
        created_at: unix_now(),
        model: state.name.clone(),
        request: json!({
            "instructions": request.instructions,
            "previous_response_id": request.previous_response_id,
            "temperature": prepared.sampling.temperature,
            "top_p": prepared.sampling.top_p,
            "max_output_tokens": request.max_output_tokens,
            "store": request.store.unwrap_or(true),
            "user": request.user,
            "metadata": request.metadata.clone().unwrap_or_else(|| json!({})),
            "text": request.text.clone().filter(|t| t.get("format").is_some_and(|f| !f.is_null()))
                .unwrap_or_else(|| json!({"format": {"type": "text"}})),
            "tools": tools.echo_tools,
            "tool_choice": tools.echo_choice,
            "parallel_tool_calls": request.extra.get("parallel_tool_calls")
                .and_then(Value::as_bool).unwrap_or(true),
        }),
    };
    let keep = request.store.unwrap_or(true).then(|| Keep {
        store,
        tenant: tenant_name,
        conversation,
    });
    let generation = super::start(state, &prepared)?;
    if !prepared.stream {
        let (text, reason, usage) = generation.collect().await?;
        let items = shell.items().whole(&text, reason == "length");
        let response = shell.finished(&items, reason, &usage);
        if let Some(keep) = keep {
            keep.save(&shell.id, &items, response.clone());
        }
        return Ok(Json(response).into_response());
    }
    let events = ResponseEvents {
        generation,
        items: shell.items(),
        shell,
        keep,
        sequence: 0,
        queued: VecDeque::new(),
        phase: Phase::Opening,
    };
    let sse = stream::unfold(events, |mut events| async move {
        let event = events.next_event().await?;
        Some((Ok::<_, Infallible>(event), events))
    });
    Ok(Sse::new(sse).into_response())
}

async fn retrieve(
    Extension(store): Extension<Arc<ResponseStore>>,
    tenant: Option<Extension<Tenant>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let tenant_name = tenant.as_ref().map_or("", |t| &*t.name);
    store
        .read(&id, tenant_name, |s| {
            Json(s.response.clone()).into_response()
        })
        .ok_or_else(|| unknown_response(&id, None))
}

fn unknown_response(id: &str, param: Option<&str>) -> ApiError {
    let mut e = ApiError::not_found(format!(
        "no stored response with id {id:?} (unknown, evicted, or created with store: false)"
    ));
    e.param = param.map(str::to_owned);
    e
}

/// The shared sampling check names chat's field; here the client sent `max_output_tokens`.
fn rename_max_tokens(mut e: ApiError) -> ApiError {
    if e.param.as_deref() == Some("max_completion_tokens") {
        e.param = Some("max_output_tokens".into());
        e.message = e
            .message
            .replace("max_completion_tokens", "max_output_tokens");
    }
    e
}

/// `input` appended to `messages` as chat messages with string content: a bare string is one
/// user message; an item list holds messages whose content is a string or `input_text` /
/// `output_text` parts, and the tool items ([`push_tool_item`]).
fn input_messages(input: &Input, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    match input {
        Input::Text(text) => messages.push(json!({"role": "user", "content": text})),
        Input::Items(items) if items.is_empty() => {
            return Err(ApiError::invalid(
                Some("input"),
                "`input` must hold at least one message",
            ));
        }
        Input::Items(items) => {
            for (index, item) in items.iter().enumerate() {
                if !push_tool_item(messages, index, item)? {
                    messages.push(input_message((index, item))?);
                }
            }
        }
    }
    Ok(())
}

fn input_message((index, item): (usize, &Value)) -> Result<Value, ApiError> {
    let at = |field: &str| format!("input[{index}]{field}");
    let invalid = |field: &str, what: &str| {
        let param = at(field);
        ApiError::invalid(Some(&param), format!("{param} {what}"))
    };
    if item
        .get("type")
        .is_some_and(|t| t != &Value::from("message"))
    {
        return Err(invalid(
            ".type",
            "must be \"message\", \"function_call\" or \"function_call_output\" \
             (other items are not supported)",
        ));
    }
    let role = match item.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(role @ ("user" | "assistant" | "system")) => role,
        _ => {
            return Err(invalid(
                ".role",
                "must be one of user, assistant, system, developer",
            ));
        }
    };
    let content = match item.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("input_text" | "output_text"), Some(Value::String(t))) => {
                        text.push_str(t);
                    }
                    _ => {
                        return Err(invalid(
                            &format!(".content[{j}]"),
                            "must be an input_text or output_text part with `text`",
                        ));
                    }
                }
            }
            text
        }
        _ => {
            return Err(invalid(
                ".content",
                "must be a string or a list of text parts",
            ));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// The prompt: `instructions` as a system message, then the conversation, through the model's
/// chat template with the tools, and the call format to parse when tools were rendered.
/// Instructions are per request and never stored, as OpenAI does: a follow-up states its own.
fn render(
    state: &AppState,
    instructions: Option<&str>,
    conversation: &[Value],
    tools: Option<Vec<Value>>,
) -> Result<(Vec<u32>, Option<ToolFormat>), ApiError> {
    let messages = instructions
        .map(|text| json!({"role": "system", "content": text}))
        .into_iter()
        .chain(conversation.iter().cloned())
        .collect();
    render_conversation(state, messages, tools, "input")
}

/// What a stored response keeps once its output is known.
struct Keep {
    store: Arc<ResponseStore>,
    tenant: Arc<str>,
    conversation: Vec<Value>,
}

impl Keep {
    fn save(mut self, id: &str, output: &OutputItems, response: Value) {
        self.conversation.push(output.assistant_message());
        self.store.insert(
            id.to_owned(),
            Stored {
                tenant: self.tenant,
                conversation: self.conversation,
                response,
            },
        );
    }
}

/// The parts of the response object known before generation.
struct ResponseShell {
    id: String,
    /// The response's number, which its items' ids carry.
    number: u64,
    /// The call format to parse, when tools were rendered.
    format: Option<ToolFormat>,
    created_at: u64,
    model: String,
    /// Request fields echoed back (instructions, temperature, tools, ...).
    request: Value,
}

impl ResponseShell {
    /// The response object with `status`, `output` and `usage` as given.
    fn object(&self, status: &str, output: Value, usage: Value, incomplete: Value) -> Value {
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
        });
        if let (Some(object), Some(request)) = (object.as_object_mut(), self.request.as_object()) {
            object.extend(request.clone());
        }
        object
    }

    fn items(&self) -> OutputItems {
        OutputItems::new(
            self.format.clone(),
            format!("msg_{}", self.number),
            self.number,
        )
    }

    fn in_progress(&self) -> Value {
        self.object("in_progress", json!([]), Value::Null, Value::Null)
    }

    fn finished(&self, items: &OutputItems, reason: &str, usage: &UsageBody) -> Value {
        let (status, incomplete) = match reason {
            "length" => ("incomplete", json!({"reason": "max_output_tokens"})),
            _ => ("completed", Value::Null),
        };
        self.object(status, items.output(), responses_usage(usage), incomplete)
    }
}

fn responses_usage(usage: &UsageBody) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    })
}

enum Phase {
    Opening,
    Text,
    Closed,
}

/// The SSE body: dropped with the connection, which drops the `Generation` and so cancels it
/// (a cancelled response is never stored).
struct ResponseEvents {
    generation: Generation,
    shell: ResponseShell,
    items: OutputItems,
    keep: Option<Keep>,
    sequence: u64,
    queued: VecDeque<Event>,
    phase: Phase,
}

impl ResponseEvents {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            match std::mem::replace(&mut self.phase, Phase::Closed) {
                Phase::Opening => {
                    self.phase = Phase::Text;
                    let response = self.shell.in_progress();
                    self.push("response.created", json!({"response": response}));
                    self.push("response.in_progress", json!({"response": response}));
                    let events = self.items.opening();
                    self.push_all(events);
                }
                Phase::Text => match self.generation.next().await {
                    Some(Ok(Step::Text(piece))) => {
                        self.phase = Phase::Text;
                        let events = self.items.push(&piece);
                        self.push_all(events);
                    }
                    Some(Ok(Step::Finished { reason, usage })) => self.close(reason, &usage),
                    Some(Err(e)) => {
                        let error = e.body()["error"].clone();
                        let mut event = json!({"code": error["code"], "param": error["param"]});
                        event["message"] = error["message"].clone();
                        self.push("error", event);
                    }
                    None => {}
                },
                Phase::Closed => return None,
            }
        }
    }

    fn close(&mut self, reason: &str, usage: &UsageBody) {
        let events = self.items.finish(reason == "length");
        self.push_all(events);
        let response = self.shell.finished(&self.items, reason, usage);
        let kind = if response["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.push(kind, json!({"response": response}));
        if let Some(keep) = self.keep.take() {
            keep.save(&self.shell.id, &self.items, response);
        }
    }

    fn push_all(&mut self, events: Vec<ItemEvent>) {
        for (kind, body) in events {
            self.push(kind, body);
        }
    }

    /// Queues one event: its `type` and `sequence_number` added to `body`.
    fn push(&mut self, kind: &'static str, mut body: Value) {
        body["type"] = kind.into();
        body["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        self.queued
            .push_back(Event::default().event(kind).data(body.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(input: Input) -> Result<Vec<Value>, ApiError> {
        let mut messages = Vec::new();
        input_messages(&input, &mut messages).map(|()| messages)
    }

    #[test]
    fn a_string_input_is_one_user_message() {
        let m = messages(Input::Text("hi".into())).unwrap();
        assert_eq!(m, vec![json!({"role": "user", "content": "hi"})]);
    }

    #[test]
    fn text_parts_are_joined_and_developer_becomes_system() {
        let items = vec![json!({"role": "developer", "content": [
            {"type": "input_text", "text": "Be "}, {"type": "output_text", "text": "brief."}
        ]})];
        let m = messages(Input::Items(items)).unwrap();
        assert_eq!(m, vec![json!({"role": "system", "content": "Be brief."})]);
    }

    #[test]
    fn bad_items_are_refused_by_position() {
        let items = vec![
            json!({"role": "user", "content": "ok"}),
            json!({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}),
        ];
        let e = messages(Input::Items(items)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[1].content[0]"));
        let e = messages(Input::Items(vec![json!({"role": "tool", "content": "x"})])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].role"));
    }

    #[test]
    fn tool_items_mix_with_messages_in_order() {
        let items = vec![
            json!({"role": "user", "content": "Weather?"}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Checking."}]}),
            json!({"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "call_1", "output": "18"}),
        ];
        let m = messages(Input::Items(items)).unwrap();
        let roles: Vec<_> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "assistant", "tool"]);
        assert_eq!(m[1]["content"], "Checking.");
        assert_eq!(m[1]["tool_calls"][0]["function"]["name"], "w");
        assert_eq!(m[2]["tool_call_id"], "call_1");
        let e = messages(Input::Items(vec![json!({"type": "reasoning"})])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].type"));
    }

    fn stored(tenant: &str) -> Stored {
        Stored {
            tenant: Arc::from(tenant),
            conversation: vec![],
            response: json!({}),
        }
    }

    #[test]
    fn the_store_forgets_the_oldest_first_and_keeps_tenants_apart() {
        let store = ResponseStore::new(2);
        for id in ["resp_1", "resp_2", "resp_3"] {
            store.insert(id.into(), stored("a"));
        }
        assert!(store.read("resp_1", "a", |_| ()).is_none());
        assert!(store.read("resp_2", "a", |_| ()).is_some());
        assert!(store.read("resp_3", "a", |_| ()).is_some());
        assert!(store.read("resp_3", "b", |_| ()).is_none());
    }
}
