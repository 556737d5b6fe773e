//! The OpenAI surface: request JSON → one canonical `GenerateRequest`, and the engine's token
//! stream → OpenAI's response objects or SSE chunks.

pub mod chat;
pub mod completions;
pub(crate) mod generation;
pub mod models;
pub mod responses;
pub mod schema;
pub mod tools;

use std::convert::Infallible;

use axum::body::Bytes;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::get, routing::post};
use futures_util::stream;
use serde::de::DeserializeOwned;
use serde_json::Value;
use strata_protocol::{GenerateRequest, SamplingParams};

use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::{AppState, unix_now};
use generation::{Generation, Step};
use schema::{SamplingFields, UsageBody};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::retrieve))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/completions", post(completions::create))
}

/// Parses a request body; a malformed or mistyped body is a 400 naming what serde found.
fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("invalid request body: {e}")))
}

fn check_model(state: &AppState, requested: &str) -> Result<(), ApiError> {
    if requested == state.name {
        Ok(())
    } else {
        Err(ApiError::model_not_found(requested, &state.name))
    }
}

/// A validated request, ready for the engine.
pub(crate) struct Prepared {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// The field the prompt came from, named in prompt-related refusals.
    pub prompt_param: &'static str,
    /// The tenant's salt: its cached prefixes are never shared with other tenants.
    pub cache_salt: u64,
}

impl Prepared {
    pub fn new(
        state: &AppState,
        fields: &SamplingFields,
        prompt: Vec<u32>,
        prompt_param: &'static str,
    ) -> Result<Self, ApiError> {
        let sampling = sampling_params(state, fields, prompt.len())?;
        Ok(Self {
            prompt,
            sampling,
            stream: fields.stream.unwrap_or(false),
            include_usage: fields.include_usage(),
            prompt_param,
            cache_salt: 0,
        })
    }

    pub fn for_tenant(mut self, tenant: Option<&Tenant>) -> Self {
        self.cache_salt = tenant.map_or(0, |t| t.cache_salt);
        self
    }
}

/// OpenAI's fields over the checkpoint's defaults. An omitted `temperature` / `top_p` takes the
/// checkpoint's generation_config.json (greedy when it says `do_sample: false`), else OpenAI's
/// default of 1.0; `top_k`, `min_p` and `repetition_penalty` have no OpenAI field and always come
/// from the checkpoint.
fn sampling_params(
    state: &AppState,
    f: &SamplingFields,
    prompt_len: usize,
) -> Result<SamplingParams, ApiError> {
    if let Some(unsupported) = f.unsupported() {
        return Err(ApiError::invalid(
            Some(unsupported),
            format!("`{unsupported}` is not supported by this server yet"),
        ));
    }
    if let Some(n) = f.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid(
            Some("n"),
            format!("only n = 1 is supported; got n = {n}"),
        ));
    }
    let room = state.context_window().saturating_sub(prompt_len).max(1);
    let max_tokens = match (f.max_completion_tokens, f.max_tokens) {
        (Some(v), _) => positive("max_completion_tokens", v)?,
        (None, Some(v)) => positive("max_tokens", v)?,
        // The engine ends at the context window in any case.
        (None, None) => u32::try_from(room).unwrap_or(u32::MAX),
    };
    let g = &state.generation_config;
    let default_temperature = match g.do_sample {
        Some(false) => 0.0,
        _ => g.temperature.unwrap_or(1.0),
    };
    let mut logit_bias = std::collections::BTreeMap::new();
    for (token, &bias) in f.logit_bias.iter().flatten() {
        let id = token.parse::<u32>().map_err(|_| {
            ApiError::invalid(
                Some("logit_bias"),
                format!("logit_bias keys must be token ids; got {token:?}"),
            )
        })?;
        logit_bias.insert(id, bias);
    }
    let sampling = SamplingParams {
        temperature: f.temperature.unwrap_or(default_temperature),
        top_p: f.top_p.or(g.top_p).unwrap_or(1.0),
        top_k: g.top_k.unwrap_or(0),
        min_p: g.min_p.unwrap_or(0.0),
        repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        logit_bias,
        // Two-complement reinterpretation keeps negative seeds distinct and deterministic.
        seed: f.seed.map_or_else(fresh_seed, |s| s as u64),
        max_tokens,
        stop: f.stop.as_ref().map(|s| s.clone_vec()).unwrap_or_default(),
        ..SamplingParams::default()
    };
    sampling
        .validate()
        .map_err(|e| ApiError::invalid(Some(e.field), e.to_string()))?;
    Ok(sampling)
}

fn positive(field: &'static str, value: i64) -> Result<u32, ApiError> {
    if value < 1 {
        return Err(ApiError::invalid(
            Some(field),
            format!("`{field}` must be at least 1; got {value}"),
        ));
    }
    Ok(u32::try_from(value).unwrap_or(u32::MAX))
}

/// Without a `seed`, every request samples differently.
pub(crate) fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// How one surface's objects look: a whole response, or the chunks of a stream.
pub(crate) trait Framer: Send + 'static {
    /// The chunk sent before any text (chat's `role` delta), if the surface has one.
    fn opening(&self) -> Option<Value> {
        None
    }
    fn delta(&self, text: &str) -> Value;
    fn finish(&self, reason: &str) -> Value;
    /// The chunks one piece of text becomes: none while a surface holds text back (a tool call
    /// forming), several when it releases more than one thing.
    fn deltas(&mut self, text: &str) -> Vec<Value> {
        vec![self.delta(text)]
    }
    /// The chunks that end the choice: whatever was held back, then the finish chunk.
    fn closing(&mut self, reason: &str) -> Vec<Value> {
        vec![self.finish(reason)]
    }
    /// The `include_usage` chunk: usage and empty choices.
    fn usage(&self, usage: UsageBody) -> Value;
    fn whole(&self, text: String, reason: &str, usage: UsageBody) -> Value;
}

/// Response id and creation time, shared by every chunk of one response.
pub(crate) struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn new(state: &AppState, prefix: &str) -> Self {
        Self {
            id: format!("{prefix}-{}", state.next_response_number()),
            created: unix_now(),
            model: state.name.clone(),
        }
    }
}

/// Submits the prepared request to the engine.
pub(crate) fn start(state: AppState, prepared: &Prepared) -> Result<Generation, ApiError> {
    let stream = state
        .engine
        .submit(GenerateRequest {
            prompt: prepared.prompt.clone(),
            sampling: prepared.sampling.clone(),
            cache_salt: prepared.cache_salt,
            deadline: None,
        })
        .map_err(|e| ApiError::from_submit(e, prepared.prompt_param))?;
    Ok(Generation::new(
        state,
        stream,
        &prepared.prompt,
        &prepared.sampling.stop,
    ))
}

/// Submits the request and answers with one JSON object or an SSE stream.
pub(crate) async fn respond(
    state: AppState,
    prepared: Prepared,
    framer: impl Framer,
) -> Result<Response, ApiError> {
    let generation = start(state, &prepared)?;
    if !prepared.stream {
        let (text, reason, usage) = generation.collect().await?;
        return Ok(Json(framer.whole(text, reason, usage)).into_response());
    }
    let sse = SseState {
        generation,
        framer,
        include_usage: prepared.include_usage,
        phase: Phase::Opening,
        queued: std::collections::VecDeque::new(),
    };
    let events = stream::unfold(sse, |mut sse| async move {
        let event = sse.next_event().await?;
        Some((Ok::<_, Infallible>(event), sse))
    });
    Ok(Sse::new(events).into_response())
}

enum Phase {
    Opening,
    Text,
    Usage(UsageBody),
    Done,
    Closed,
}

/// The SSE body: dropped with the connection, which drops the `Generation` and so cancels it.
struct SseState<F> {
    generation: Generation,
    framer: F,
    include_usage: bool,
    phase: Phase,
    /// Chunks released together, sent one per event before the next step is read.
    queued: std::collections::VecDeque<Value>,
}

impl<F: Framer> SseState<F> {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(chunk) = self.queued.pop_front() {
                return Some(data(&chunk));
            }
            match std::mem::replace(&mut self.phase, Phase::Closed) {
                Phase::Opening => {
                    self.phase = Phase::Text;
                    if let Some(chunk) = self.framer.opening() {
                        return Some(data(&chunk));
                    }
                }
                Phase::Text => match self.generation.next().await {
                    Some(Ok(Step::Text(text))) => {
                        self.phase = Phase::Text;
                        self.queued.extend(self.framer.deltas(&text));
                    }
                    Some(Ok(Step::Finished { reason, usage })) => {
                        self.phase = if self.include_usage {
                            Phase::Usage(usage)
                        } else {
                            Phase::Done
                        };
                        self.queued.extend(self.framer.closing(reason));
                    }
                    Some(Err(e)) => {
                        self.phase = Phase::Done;
                        return Some(data(&e.body()));
                    }
                    None => self.phase = Phase::Done,
                },
                Phase::Usage(usage) => {
                    self.phase = Phase::Done;
                    return Some(data(&self.framer.usage(usage)));
                }
                Phase::Done => return Some(Event::default().data("[DONE]")),
                Phase::Closed => return None,
            }
        }
    }
}

fn data(chunk: &Value) -> Event {
    Event::default().data(chunk.to_string())
}
