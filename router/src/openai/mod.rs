//! The OpenAI surface: request JSON → one canonical `GenerateRequest`, and the engine's token
//! stream → OpenAI's response objects or SSE chunks.

pub mod cache;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod models;
pub mod responses;
mod responses_output;
mod responses_tools;
pub mod schema;
pub mod tokenize;
pub use crate::tools;

use std::convert::Infallible;

use axum::body::Bytes;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::get, routing::post};
use futures_util::{StreamExt, stream};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use strata_protocol::{Constraint, GenerateRequest, MAX_TOP_LOGPROBS, SamplingParams};

use crate::auth::Tenant;
use crate::error::ApiError;
use crate::sampling::{Requested, resolve};
use crate::serving::generation::{Generation, Step};
use crate::state::{AppState, unix_now};
use schema::{SamplingFields, UsageBody};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::retrieve))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/completions", post(completions::create))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/version", get(tokenize::version))
}

/// Parses a request body; a malformed or mistyped body is a 400 naming what serde found.
fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    crate::body::from_json(body)
        .map_err(|e| ApiError::invalid(None, format!("invalid request body: {e}")))
}

fn check_model(state: &AppState, requested: &str) -> Result<(), ApiError> {
    state.check_model(requested)
}

/// The most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 32;

/// A validated request, ready for the engine.
pub(crate) struct Prepared {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Choices to generate (`n`); choice `i` samples with seed `seed + i`.
    pub n: usize,
    /// What the output must follow (`response_format`, a forced tool call).
    pub constraint: Option<Constraint>,
    pub stream: bool,
    pub include_usage: bool,
    /// The field the prompt came from, named in prompt-related refusals.
    pub prompt_param: &'static str,
    /// The tenant's salt: its cached prefixes are never shared with other tenants.
    pub cache_salt: u64,
    /// Decode with the tokenizer's special tokens kept (the rendered tool format needs them).
    pub keep_special_tokens: bool,
}

impl Prepared {
    pub fn new(
        state: &AppState,
        fields: &SamplingFields,
        prompt: Vec<u32>,
        prompt_param: &'static str,
    ) -> Result<Self, ApiError> {
        let sampling = sampling_params(state, fields, prompt.len())?;
        let n = match fields.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    Some("n"),
                    format!("`n` must be between 1 and {MAX_CHOICES}; got {n}"),
                ));
            }
        };
        Ok(Self {
            prompt,
            sampling,
            n,
            constraint: constraint(fields)?,
            stream: fields.stream.unwrap_or(false),
            include_usage: fields.include_usage(),
            prompt_param,
            cache_salt: 0,
            keep_special_tokens: false,
        })
    }

    pub fn for_tenant(mut self, tenant: Option<&Tenant>) -> Self {
        self.cache_salt = tenant.map_or(0, |t| t.cache_salt);
        self
    }
}

/// What the output must follow: `response_format`, or one of vLLM's structured-output fields. Two
/// sources at once are refused by name rather than one silently winning.
fn constraint(f: &SamplingFields) -> Result<Option<Constraint>, ApiError> {
    fn set(v: &Option<Value>) -> Option<&Value> {
        v.as_ref().filter(|v| !v.is_null())
    }
    let mut sources: Vec<(&'static str, &Value)> = Vec::new();
    for (name, value) in [
        ("response_format", &f.response_format),
        ("structured_outputs", &f.structured_outputs),
        ("guided_json", &f.guided_json),
        ("guided_regex", &f.guided_regex),
        ("guided_choice", &f.guided_choice),
        ("guided_grammar", &f.guided_grammar),
    ] {
        if let Some(v) = set(value) {
            sources.push((name, v));
        }
    }
    match sources.as_slice() {
        [] => Ok(None),
        [("response_format", v)] => response_format(Some(v)),
        [("structured_outputs", v)] => structured_outputs(v),
        [(name, v)] => guided(name, name.trim_start_matches("guided_"), v),
        [(a, _), (b, _), ..] => Err(ApiError::invalid(
            Some(b),
            format!("`{a}` and `{b}` both constrain the output; give one"),
        )),
    }
}

/// vLLM's `structured_outputs`: an object with exactly one of `json`, `regex`, `choice`,
/// `grammar`.
fn structured_outputs(v: &Value) -> Result<Option<Constraint>, ApiError> {
    let refuse = |message: String| Err(ApiError::invalid(Some("structured_outputs"), message));
    let Some(object) = v.as_object() else {
        return refuse("`structured_outputs` must be an object".into());
    };
    let kinds: Vec<(&String, &Value)> = object.iter().filter(|(_, v)| !v.is_null()).collect();
    match kinds.as_slice() {
        [(kind, value)] if ["json", "regex", "choice", "grammar"].contains(&kind.as_str()) => {
            let param = format!("structured_outputs.{kind}");
            guided(&param, kind, value)
        }
        [(kind, _)] => refuse(format!(
            "`structured_outputs.{kind}` is not supported (json, regex, choice or grammar)"
        )),
        _ => {
            refuse("`structured_outputs` needs exactly one of json, regex, choice, grammar".into())
        }
    }
}

/// One structured-output request of `kind` (`json`, `regex`, `choice`, `grammar`) from `param`:
/// a JSON Schema (an object, or its text), a regular expression the whole output must match, a
/// list of strings the output must be one of, or a grammar in llguidance's Lark dialect.
fn guided(param: &str, kind: &str, v: &Value) -> Result<Option<Constraint>, ApiError> {
    let refuse = |message: String| Err(ApiError::invalid(Some(param), message));
    match (kind, v) {
        ("json", Value::Object(_) | Value::Bool(_)) => {
            Ok(Some(Constraint::JsonSchema(v.to_string())))
        }
        ("json", Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(schema @ (Value::Object(_) | Value::Bool(_))) => {
                Ok(Some(Constraint::JsonSchema(schema.to_string())))
            }
            _ => refuse(format!(
                "`{param}` must be a JSON Schema (an object or its JSON text)"
            )),
        },
        ("regex", Value::String(regex)) if !regex.is_empty() => match check_regex(regex) {
            Ok(()) => Ok(Some(Constraint::Lark(format!(
                "start: /{}/",
                lark_regex_body(regex)
            )))),
            Err(problem) => refuse(format!("`{param}`: {problem}")),
        },
        ("choice", Value::Array(choices)) if !choices.is_empty() => {
            let mut alternatives = Vec::with_capacity(choices.len());
            for choice in choices {
                match choice {
                    // A JSON string literal is a Lark string literal.
                    Value::String(text) if !text.is_empty() => {
                        alternatives.push(choice.to_string())
                    }
                    _ => return refuse(format!("`{param}` must be a list of non-empty strings")),
                }
            }
            Ok(Some(Constraint::Lark(format!(
                "start: {}",
                alternatives.join(" | ")
            ))))
        }
        ("grammar", Value::String(grammar)) if !grammar.trim().is_empty() => {
            Ok(Some(Constraint::Lark(grammar.clone())))
        }
        ("json", _) => refuse(format!("`{param}` must be a JSON Schema")),
        ("regex", _) => refuse(format!("`{param}` must be a non-empty regular expression")),
        ("choice", _) => refuse(format!("`{param}` must be a non-empty list of strings")),
        _ => refuse(format!(
            "`{param}` must be a grammar in the Lark dialect (text)"
        )),
    }
}

/// The most repetitions a structured-output regex may ask for, multiplied through nesting
/// (`(a{100}){100}` asks for 10 000): the grammar engine builds its automaton lazily, one state
/// per repetition left, and a count in the millions fails mid-request ("too many expressions").
const MAX_REGEX_REPETITIONS: u64 = 10_000;

/// Refuses a regular expression the grammar engine would fail on: unparsable, or asking for
/// more than [`MAX_REGEX_REPETITIONS`].
fn check_regex(regex: &str) -> Result<(), String> {
    let hir = regex_syntax::Parser::new().parse(regex).map_err(|e| {
        format!(
            "not a regular expression: {}",
            e.to_string().replace('\n', " ")
        )
    })?;
    let asked = repetitions(&hir);
    if asked > MAX_REGEX_REPETITIONS {
        return Err(format!(
            "the expression asks for {asked} repetitions; at most {MAX_REGEX_REPETITIONS} are \
             supported"
        ));
    }
    Ok(())
}

/// The largest count of repetitions `hir` asks for (a bounded repetition's maximum, an
/// unbounded one's minimum, multiplied through nesting).
fn repetitions(hir: &regex_syntax::hir::Hir) -> u64 {
    use regex_syntax::hir::HirKind;
    match hir.kind() {
        HirKind::Repetition(r) => {
            let count = u64::from(r.max.unwrap_or(r.min).max(1));
            count.saturating_mul(repetitions(&r.sub))
        }
        HirKind::Capture(c) => repetitions(&c.sub),
        HirKind::Concat(parts) | HirKind::Alternation(parts) => {
            parts.iter().map(repetitions).max().unwrap_or(1)
        }
        _ => 1,
    }
}

/// `regex` as the body of a Lark regex terminal `/…/`: a `/` not already escaped gets a
/// backslash, so it cannot end the terminal early.
fn lark_regex_body(regex: &str) -> String {
    let mut out = String::with_capacity(regex.len() + 4);
    let mut escaped = false;
    for c in regex.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

/// `response_format`: `text` (or absent) is free text; `json_object` any JSON object;
/// `json_schema` a value valid under `json_schema.schema`.
fn response_format(format: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let refuse = |message: &str| Err(ApiError::invalid(Some("response_format"), message));
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => match format.pointer("/json_schema/schema") {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                Ok(Some(Constraint::JsonSchema(schema.to_string())))
            }
            Some(_) => refuse("`response_format.json_schema.schema` must be a JSON Schema object"),
            None => refuse("`response_format` of type `json_schema` needs `json_schema.schema`"),
        },
        _ => refuse("`response_format.type` must be \"text\", \"json_object\" or \"json_schema\""),
    }
}

/// OpenAI's fields over the checkpoint's defaults: an omitted `temperature` / `top_p` / `top_k`
/// / `min_p` / `repetition_penalty` takes [`GenerationConfig::sampling_defaults`], the one rule
/// every surface uses.
fn sampling_params(
    state: &AppState,
    f: &SamplingFields,
    prompt_len: usize,
) -> Result<SamplingParams, ApiError> {
    if let Some((field, message)) = f.unsupported() {
        return Err(ApiError::invalid(Some(&field), message));
    }
    let max_tokens = match (f.max_completion_tokens, f.max_tokens) {
        (Some(v), _) => Some(positive("max_completion_tokens", v)?),
        (None, Some(v)) => Some(positive("max_tokens", v)?),
        // The engine ends at the context window in any case.
        (None, None) => None,
    };
    let mut logit_bias = std::collections::BTreeMap::new();
    for (token, &bias) in f.logit_bias.iter().flatten() {
        let id = token.parse::<u32>().map_err(|_| {
            ApiError::invalid(
                Some("logit_bias"),
                format!("logit_bias keys must be token ids; got {token:?}"),
            )
        })?;
        let vocab = state.engine.model_config().vocab_size;
        if id as usize >= vocab {
            return Err(ApiError::invalid(
                Some("logit_bias"),
                format!("logit_bias key {id} is outside the vocabulary of {vocab}"),
            ));
        }
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                Some("logit_bias"),
                format!("logit_bias values are -100 to 100; got {bias} for token {id}"),
            ));
        }
        logit_bias.insert(id, bias);
    }
    let top_k = match f.top_k {
        None => None,
        // vLLM's convention: -1 (or 0) turns top-k off.
        Some(-1 | 0) => Some(0),
        Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(k) => {
            return Err(ApiError::invalid(
                Some("top_k"),
                format!("`top_k` must be -1 (off) or at least 1; got {k}"),
            ));
        }
    };
    let min_tokens = match f.min_tokens {
        None => 0,
        Some(v) => u32::try_from(v).map_err(|_| {
            ApiError::invalid(
                Some("min_tokens"),
                format!("`min_tokens` must be a non-negative integer; got {v}"),
            )
        })?,
    };
    let logprobs = logprobs(f)?;
    let requested = Requested {
        temperature: f.temperature,
        top_p: f.top_p,
        top_k,
        min_p: f.min_p,
        repetition_penalty: f.repetition_penalty,
        // Two-complement reinterpretation keeps negative seeds distinct and deterministic.
        seed: f.seed.map(|s| s as u64),
        max_tokens,
        stop: f.stop.as_ref().map(|s| s.clone_vec()).unwrap_or_default(),
    };
    let invalid =
        |e: strata_protocol::SamplingParamsError| ApiError::invalid(Some(e.field), e.to_string());
    let room = state.context_window().saturating_sub(prompt_len);
    let sampling = SamplingParams {
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        logit_bias,
        logprobs,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        min_tokens,
        ..resolve(&state.generation_config, room, requested).map_err(invalid)?
    };
    // The penalties only this surface names.
    sampling.validate().map_err(invalid)?;
    Ok(sampling)
}

/// How many alternatives to report per token, if any. Chat sends `logprobs: true` with
/// `top_logprobs: k`; completions sends `logprobs: k`.
fn logprobs(f: &SamplingFields) -> Result<Option<u32>, ApiError> {
    let count = |field: &'static str, v: &Value| match v.as_u64() {
        Some(k) if k <= u64::from(MAX_TOP_LOGPROBS) => Ok(k as u32),
        _ => Err(ApiError::invalid(
            Some(field),
            format!("`{field}` must be an integer from 0 to {MAX_TOP_LOGPROBS}; got {v}"),
        )),
    };
    let top = f.top_logprobs.as_ref().filter(|v| !v.is_null());
    match f.logprobs.as_ref() {
        None | Some(Value::Null) | Some(Value::Bool(false)) => match top {
            Some(_) => Err(ApiError::invalid(
                Some("top_logprobs"),
                "`top_logprobs` needs `logprobs: true`",
            )),
            None => Ok(None),
        },
        Some(Value::Bool(true)) => top.map_or(Ok(0), |v| count("top_logprobs", v)).map(Some),
        Some(v) => count("logprobs", v).map(Some),
    }
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

/// How one surface's objects look for one choice: a whole response, or the chunks of a stream.
/// Chunks are built for choice 0; [`respond`] renumbers them for the others.
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
    /// A choice's `logprobs` member for these tokens (chat's shape unless overridden).
    fn logprobs(&self, state: &AppState, tokens: &[TokenLogprob]) -> Value {
        json!({
            "content": tokens.iter().map(|t| chat_logprob(state, t)).collect::<Vec<_>>(),
            "refusal": null,
        })
    }
}

pub(crate) use crate::serving::generation::TokenLogprob;

/// Chat's entry for one token: its text, bytes and log-probability, and the alternatives.
fn chat_logprob(state: &AppState, (id, info): &TokenLogprob) -> Value {
    let entry = |id: u32, logprob: f32| {
        let bytes = state.token_bytes(id);
        json!({
            "token": String::from_utf8_lossy(bytes),
            "logprob": finite_logprob(logprob),
            "bytes": bytes,
        })
    };
    let mut value = entry(*id, info.logprob);
    value["top_logprobs"] = info.top.iter().map(|&(t, l)| entry(t, l)).collect();
    value
}

/// JSON has no `-inf`: a token the distribution excludes is reported as -9999, as OpenAI does.
pub(crate) fn finite_logprob(logprob: f32) -> f32 {
    logprob.max(-9999.0)
}

/// Response id and creation time, shared by every chunk of one response.
#[derive(Clone)]
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

/// Submits the prepared request (its first choice) to the engine.
pub(crate) fn start(state: AppState, prepared: &Prepared) -> Result<Generation, ApiError> {
    start_choice(state, prepared, 0)
}

/// Submits choice `index`: the same request with seed `seed + index`.
fn start_choice(
    state: AppState,
    prepared: &Prepared,
    index: usize,
) -> Result<Generation, ApiError> {
    let mut sampling = prepared.sampling.clone();
    sampling.seed = sampling.seed.wrapping_add(index as u64);
    let stream = state.submit(
        GenerateRequest {
            resume: None,
            embed: None,
            prompt: prepared.prompt.clone(),
            sampling,
            cache_salt: prepared.cache_salt,
            deadline: None,
            constraint: prepared.constraint.clone(),
        },
        prepared.prompt_param,
    )?;
    Ok(Generation::new(
        state,
        stream,
        &prepared.prompt,
        &prepared.sampling.stop,
        prepared.keep_special_tokens,
    ))
}

/// Submits the request's `n` choices (choice `c` framed by `framer(c)`) and answers with one
/// JSON object or an SSE stream. Choices run concurrently; a stream interleaves their chunks,
/// each naming its choice `index`.
pub(crate) async fn respond<F: Framer>(
    state: AppState,
    prepared: Prepared,
    framer: impl Fn(usize) -> F,
) -> Result<Response, ApiError> {
    respond_batch(state, vec![prepared], |_, choice| framer(choice)).await
}

/// [`respond`] for several prompts (a batched `/v1/completions`), each with the same `n`: prompt
/// `p`'s choice `i` is choice `p * n + i` of the answer, framed by `framer(p)`. Every prompt
/// counts once in the usage.
pub(crate) async fn respond_batch<F: Framer>(
    state: AppState,
    batch: Vec<Prepared>,
    framer: impl Fn(usize, usize) -> F,
) -> Result<Response, ApiError> {
    let Some(first) = batch.first() else {
        return Err(ApiError::invalid(Some("prompt"), "no prompt to complete"));
    };
    let (n, stream, include_usage) = (first.n, first.stream, first.include_usage);
    let with_logprobs = first.sampling.logprobs.is_some();
    let mut generations = Vec::with_capacity(batch.len() * n);
    for prepared in &batch {
        for index in 0..n {
            // An error drops the choices already submitted, which cancels them.
            generations.push(start_choice(state.clone(), prepared, index)?);
        }
    }
    let choices = generations.len();
    if !stream {
        let framers: Vec<F> = (0..choices).map(|c| framer(c / n, c)).collect();
        let collected =
            futures_util::future::join_all(generations.into_iter().map(Generation::collect_all))
                .await;
        let mut body = Value::Null;
        let mut total = UsageBody::new(0, 0);
        for (index, (framer, result)) in framers.into_iter().zip(collected).enumerate() {
            let (text, reason, usage, logprobs) = result?;
            let mut whole = framer.whole(text, reason, usage);
            if with_logprobs {
                whole["choices"][0]["logprobs"] = framer.logprobs(&state, &logprobs);
            }
            renumber(&mut whole, index);
            total = total.merge_choice(usage, index % n == 0);
            if index == 0 {
                body = whole;
            } else if let (Some(all), Some(more)) = (
                body["choices"].as_array_mut(),
                whole["choices"].as_array().cloned(),
            ) {
                all.extend(more);
            }
        }
        body["usage"] = json!(total);
        return Ok(Json(body).into_response());
    }
    let usage_framer = framer(0, 0);
    let streams = generations
        .into_iter()
        .enumerate()
        .map(|(index, generation)| {
            let choice = ChoiceStream {
                state: state.clone(),
                generation,
                framer: framer(index / n, index),
                index,
                counts_prompt: index % n == 0,
                with_logprobs,
                phase: Phase::Opening,
                queued: std::collections::VecDeque::new(),
            };
            stream::unfold(choice, |mut choice| async move {
                let event = choice.next_event().await?;
                Some((event, choice))
            })
            .boxed()
        });
    let merged = MergedStream {
        choices: stream::select_all(streams),
        usage_framer,
        include_usage,
        usage: None,
        finished: 0,
        n: choices,
        done: false,
    };
    let events = stream::unfold(merged, |mut merged| async move {
        let event = merged.next_event().await?;
        Some((Ok::<_, Infallible>(event), merged))
    });
    Ok(Sse::new(events).into_response())
}

/// Sets the choice index of every choice in a response or chunk.
fn renumber(body: &mut Value, index: usize) {
    if let Some(choices) = body["choices"].as_array_mut() {
        for choice in choices {
            choice["index"] = index.into();
        }
    }
}

enum Phase {
    Opening,
    Text,
    Closed,
}

/// What one choice's stream yields.
enum ChoiceEvent {
    Chunk(Value),
    /// The choice's usage, and whether its prompt's tokens count (the first choice of each
    /// prompt).
    Finished(UsageBody, bool),
    /// A failure after the stream began: the error body, sent as a chunk; the stream then ends.
    Failed(Value),
}

/// One choice of a stream: dropped with the connection, which drops the `Generation` and so
/// cancels it.
struct ChoiceStream<F> {
    state: AppState,
    generation: Generation,
    framer: F,
    index: usize,
    /// The first choice of its prompt: its prompt tokens count in the usage.
    counts_prompt: bool,
    with_logprobs: bool,
    phase: Phase,
    /// Chunks released together, sent one per event before the next step is read.
    queued: std::collections::VecDeque<ChoiceEvent>,
}

impl<F: Framer> ChoiceStream<F> {
    async fn next_event(&mut self) -> Option<ChoiceEvent> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            match std::mem::replace(&mut self.phase, Phase::Closed) {
                Phase::Opening => {
                    self.phase = Phase::Text;
                    if let Some(chunk) = self.framer.opening() {
                        return Some(self.chunk(chunk));
                    }
                }
                Phase::Text => match self.generation.next().await {
                    Some(Ok(Step::Text(text))) => {
                        self.phase = Phase::Text;
                        let mut chunks = self.framer.deltas(&text);
                        self.attach_logprobs(&mut chunks);
                        let chunks: Vec<_> = chunks.into_iter().map(|c| self.chunk(c)).collect();
                        self.queued.extend(chunks);
                    }
                    Some(Ok(Step::Finished { reason, usage })) => {
                        let mut chunks = self.framer.closing(reason);
                        self.attach_logprobs(&mut chunks);
                        let chunks: Vec<_> = chunks.into_iter().map(|c| self.chunk(c)).collect();
                        self.queued.extend(chunks);
                        self.queued
                            .push_back(ChoiceEvent::Finished(usage, self.counts_prompt));
                    }
                    Some(Err(e)) => return Some(ChoiceEvent::Failed(e.body())),
                    None => {}
                },
                Phase::Closed => return None,
            }
        }
    }

    fn chunk(&self, mut chunk: Value) -> ChoiceEvent {
        renumber(&mut chunk, self.index);
        ChoiceEvent::Chunk(chunk)
    }

    /// The tokens behind the text released so far go on the first chunk that carries a
    /// choice (a framer holding text back releases none, and the tokens wait).
    fn attach_logprobs(&mut self, chunks: &mut [Value]) {
        if !self.with_logprobs {
            return;
        }
        let Some(chunk) = chunks
            .iter_mut()
            .find(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
        else {
            return;
        };
        let tokens = self.generation.take_logprobs();
        chunk["choices"][0]["logprobs"] = self.framer.logprobs(&self.state, &tokens);
    }
}

/// Every choice's chunks as they come, then the usage chunk (when asked for) and `[DONE]`.
struct MergedStream<F, S> {
    choices: stream::SelectAll<S>,
    usage_framer: F,
    include_usage: bool,
    usage: Option<UsageBody>,
    finished: usize,
    n: usize,
    done: bool,
}

impl<F: Framer, S: futures_util::Stream<Item = ChoiceEvent> + Unpin> MergedStream<F, S> {
    async fn next_event(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        loop {
            match self.choices.next().await {
                Some(ChoiceEvent::Chunk(chunk)) => return Some(data(&chunk)),
                Some(ChoiceEvent::Finished(usage, counts_prompt)) => {
                    let total = self.usage.unwrap_or(UsageBody::new(0, 0));
                    self.usage = Some(total.merge_choice(usage, counts_prompt));
                    self.finished += 1;
                }
                Some(ChoiceEvent::Failed(body)) => {
                    // One failed choice ends the response: the others are dropped (cancelled),
                    // and `[DONE]` follows the error.
                    self.choices = stream::select_all(Vec::new());
                    self.include_usage = false;
                    return Some(data(&body));
                }
                None => {
                    self.done = true;
                    if self.include_usage
                        && self.finished == self.n
                        && let Some(usage) = self.usage
                    {
                        self.done = false;
                        self.include_usage = false;
                        return Some(data(&self.usage_framer.usage(usage)));
                    }
                    return Some(Event::default().data("[DONE]"));
                }
            }
        }
    }
}

fn data(chunk: &Value) -> Event {
    Event::default().data(chunk.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regex_becomes_one_lark_terminal_whatever_its_slashes() {
        assert_eq!(lark_regex_body("a/b"), "a\\/b");
        assert_eq!(
            lark_regex_body("a\\/b"),
            "a\\/b",
            "an escaped slash stays as it is"
        );
        assert_eq!(
            lark_regex_body("a\\\\/b"),
            "a\\\\\\/b",
            "after an escaped backslash"
        );
        assert_eq!(lark_regex_body("[0-9]{3}"), "[0-9]{3}");
    }

    /// A regex the grammar engine would fail on mid-request is a 400 naming the field; an
    /// ordinary one passes.
    #[test]
    fn regexes_the_engine_cannot_build_are_refused_up_front() {
        let refused = |regex: &str| {
            let v = serde_json::json!({"regex": regex});
            let e = structured_outputs(&v).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{regex}");
            assert_eq!(
                e.param.as_deref(),
                Some("structured_outputs.regex"),
                "{regex}"
            );
            e.message
        };
        assert!(refused("a{1000000}").contains("1000000 repetitions"));
        assert!(refused("(a{200}){200}").contains("40000 repetitions"));
        assert!(refused("a(").contains("not a regular expression"));
        for fine in ["[0-9]{3}-[0-9]{4}", "(yes|no)", "a{10000}", "[a-z]+"] {
            let v = serde_json::json!({"regex": fine});
            assert!(structured_outputs(&v).unwrap().is_some(), "{fine}");
        }
    }
}
