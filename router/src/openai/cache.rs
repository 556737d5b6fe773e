//! `/v1/cache`: primed contexts as a resource. `POST` prefills a prompt (text, token ids or
//! chat messages rendered as a conversation's prefix) and pins its KV blocks for `ttl_seconds`:
//! they are evicted from the device after every unpinned block, parked in the host and disk
//! tiers, and restored when a later request starts with the same prefix (its usage reports
//! them as cached tokens). `GET` lists a tenant's contexts or reads one, with where its blocks
//! are now; `DELETE` unpins one (its blocks stay cached, unpinned).
//!
//! Each tenant sees and deletes only its own contexts (their blocks carry its cache salt).
//! Through a cluster router the prompt runs where the router places it and every node pins the
//! part of it it holds; a context's blocks are summed over the nodes.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_engine_api::kv::{BlockHash, prompt_block_hashes};
use strata_engine_api::rpc::PinReport;
use strata_engine_api::submit::SubmitError;
use strata_protocol::{GenerateRequest, SamplingParams};

use super::chat::{normalize_message, render_conversation};
use super::{check_model, parse_body};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::{AppState, unix_now};

/// How long a context stays pinned unless the request says: one hour.
pub const DEFAULT_TTL_SECONDS: u64 = 3600;
/// The longest pin one request may ask for: a week.
pub const MAX_TTL_SECONDS: u64 = 7 * 24 * 3600;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/cache", post(create).get(list))
        .route("/v1/cache/{id}", get(retrieve).delete(delete))
}

/// What the router keeps of a primed context besides the engine's pin.
#[derive(Debug, Clone)]
pub struct PrimedContext {
    pub cache_salt: u64,
    pub prompt_tokens: usize,
    pub created_at: u64,
    pub expires_at: u64,
}

/// The primed contexts of this server, by id.
pub type PrimedContexts = std::sync::Mutex<HashMap<String, PrimedContext>>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    model: Option<String>,
    prompt: Option<String>,
    prompt_token_ids: Option<Vec<u32>>,
    messages: Option<Vec<Value>>,
    ttl_seconds: Option<u64>,
}

async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: CreateRequest = parse_body(&body)?;
    if let Some(model) = &request.model {
        check_model(&state, model)?;
    }
    let block_size = state.engine.block_size();
    let ttl = request.ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS);
    if ttl == 0 || ttl > MAX_TTL_SECONDS {
        return Err(ApiError::invalid(
            Some("ttl_seconds"),
            format!("`ttl_seconds` must be 1 to {MAX_TTL_SECONDS}; got {ttl}"),
        ));
    }
    let (tokens, param) = prompt_tokens(&state, request)?;
    if tokens.len() < block_size {
        return Err(ApiError::invalid(
            Some(param),
            format!(
                "a primed context needs at least one whole KV block of {block_size} tokens; \
                 this prompt has {}",
                tokens.len()
            ),
        ));
    }
    let salt = tenant.as_deref().map_or(0, |t| t.cache_salt);
    // Prefill it: one generated token, discarded; its full blocks are now cached.
    let prime = GenerateRequest {
        resume: None,
        embed: None,
        prompt: tokens.clone(),
        sampling: SamplingParams {
            max_tokens: 1,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: salt,
        deadline: None,
        constraint: None,
    };
    let mut stream = state.submit(prime, param)?;
    while let Some(event) = stream.events.recv().await {
        if let strata_protocol::TokenEvent::Failed { message } = event {
            return Err(ApiError::internal(format!(
                "prefilling the context failed: {message}"
            )));
        }
    }
    let id = format!("kvcache-{:016x}", state.next_response_number());
    let hashes = prompt_block_hashes(
        &tokens[..tokens.len() / block_size * block_size],
        block_size,
        salt,
    );
    let status = pin(&state, &id, hashes, Duration::from_secs(ttl), param).await?;
    let now = unix_now();
    let context = PrimedContext {
        cache_salt: salt,
        prompt_tokens: tokens.len(),
        created_at: now,
        expires_at: now + ttl,
    };
    lock(&state.primed).insert(id.clone(), context.clone());
    Ok(Json(context_object(
        &state, &id, &context, &status, block_size,
    )))
}

/// The request's prompt as token ids, and the field it came from.
fn prompt_tokens(
    state: &AppState,
    request: CreateRequest,
) -> Result<(Vec<u32>, &'static str), ApiError> {
    match (request.prompt, request.prompt_token_ids, request.messages) {
        (Some(text), None, None) => Ok((state.tokenizer.encode(&text, true)?, "prompt")),
        (None, Some(ids), None) => {
            let vocab = state.engine.model_config().vocab_size;
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    Some("prompt_token_ids"),
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            Ok((ids, "prompt_token_ids"))
        }
        (None, None, Some(messages)) => {
            let messages = messages
                .iter()
                .enumerate()
                .map(|(i, m)| normalize_message(i, m))
                .collect::<Result<_, _>>()?;
            // A conversation's prefix: what a later turn's rendering starts with.
            Ok((
                render_conversation(state, messages, "messages", false)?,
                "messages",
            ))
        }
        (None, None, None) => Err(ApiError::invalid(
            Some("prompt"),
            "one of `prompt`, `prompt_token_ids` or `messages` is required",
        )),
        _ => Err(ApiError::invalid(
            Some("prompt"),
            "give one of `prompt`, `prompt_token_ids` or `messages`, not several",
        )),
    }
}

async fn list(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
) -> Result<Json<Value>, ApiError> {
    let block_size = state.engine.block_size();
    let salt = tenant.as_deref().map_or(0, |t| t.cache_salt);
    let statuses = live_pins(&state).await?;
    let primed = lock(&state.primed).clone();
    let mut data: Vec<(u64, String, Value)> = statuses
        .iter()
        .filter_map(|status| {
            let context = primed.get(&status.name)?;
            (context.cache_salt == salt).then(|| {
                let object = context_object(&state, &status.name, context, status, block_size);
                (context.created_at, status.name.clone(), object)
            })
        })
        .collect();
    data.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let data: Vec<Value> = data.into_iter().map(|(_, _, v)| v).collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn retrieve(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let block_size = state.engine.block_size();
    let context = owned(&state, tenant.as_deref(), &id)?;
    let statuses = live_pins(&state).await?;
    let status = statuses
        .iter()
        .find(|s| s.name == id)
        .ok_or_else(|| unknown(&id))?;
    Ok(Json(context_object(
        &state, &id, &context, status, block_size,
    )))
}

async fn delete(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    owned(&state, tenant.as_deref(), &id)?;
    let held = unpin(&state, &id).await?;
    lock(&state.primed).remove(&id);
    if !held {
        return Err(unknown(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "kv_cache.deleted", "deleted": true}),
    ))
}

/// The tenant's context `id`, or a 404 (another tenant's context is not named as existing).
fn owned(state: &AppState, tenant: Option<&Tenant>, id: &str) -> Result<PrimedContext, ApiError> {
    let salt = tenant.map_or(0, |t| t.cache_salt);
    lock(&state.primed)
        .get(id)
        .filter(|c| c.cache_salt == salt)
        .cloned()
        .ok_or_else(|| unknown(id))
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(format!("no cached context `{id}` (it may have expired)"))
}

/// The engine's pins (summed over the nodes of a cluster), after dropping the router's record
/// of those that expired.
async fn live_pins(state: &AppState) -> Result<Vec<PinReport>, ApiError> {
    let statuses = state.engine.pins().await.map_err(engine_error)?;
    let mut primed = lock(&state.primed);
    primed.retain(|id, _| statuses.iter().any(|s| &s.name == id));
    Ok(statuses)
}

/// Pins the primed prompt's `hashes` as `id` for `ttl`; a pin beyond what the KV tiers may hold
/// is a 400 naming `param`.
async fn pin(
    state: &AppState,
    id: &str,
    hashes: Vec<BlockHash>,
    ttl: Duration,
    param: &'static str,
) -> Result<PinReport, ApiError> {
    let refused = |message: String| {
        if message.contains("lowest KV tier holds") {
            ApiError::invalid(Some(param), message)
        } else {
            ApiError::internal(format!("pinning the context: {message}"))
        }
    };
    let pinned = state.engine.pin(id.to_string(), hashes, ttl).await;
    pinned.map_err(engine_error)?.map_err(refused)
}

/// Unpins `id`; whether it was held.
async fn unpin(state: &AppState, id: &str) -> Result<bool, ApiError> {
    state
        .engine
        .unpin(id.to_string())
        .await
        .map_err(engine_error)
}

fn context_object(
    state: &AppState,
    id: &str,
    context: &PrimedContext,
    status: &PinReport,
    block_size: usize,
) -> Value {
    json!({
        "id": id,
        "object": "kv_cache",
        "model": state.name,
        "created_at": context.created_at,
        "expires_at": context.expires_at,
        "prompt_tokens": context.prompt_tokens,
        "cached_tokens": status.blocks * block_size,
        "blocks": {
            "device": status.device,
            "host": status.host,
            "disk": status.disk,
        },
    })
}

/// The engine (or the nodes) could not answer.
fn engine_error(e: SubmitError) -> ApiError {
    ApiError::internal(e.to_string())
}

fn lock(primed: &PrimedContexts) -> std::sync::MutexGuard<'_, HashMap<String, PrimedContext>> {
    primed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
