//! `POST /v1/embeddings` (OpenAI's shape) and `POST /v1/rerank` (Cohere's and vLLM's shape, also
//! at `/rerank` and `/v2/rerank`): prompts run through the engine as embedding requests, batched
//! with whatever else it computes, and come back as the checkpoint's pooled, normalized hidden
//! states ([`strata_model::EmbeddingConfig`]). A rerank scores each document by the cosine
//! similarity of its embedding with the query's, as vLLM scores with an embedding model.

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::{Extension, Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

use super::completions::encode_prompts;
use super::{check_model, parse_body};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::AppState;

/// Inputs one embeddings request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;
/// Documents one rerank request may carry.
pub const MAX_DOCUMENTS: usize = 1000;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/rerank", post(rerank))
        .route("/v2/rerank", post(rerank))
        .route("/rerank", post(rerank))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbeddingRequest {
    model: String,
    input: Value,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
    /// OpenAI's end-user id: accepted, not used.
    #[allow(dead_code)]
    user: Option<String>,
    /// vLLM's: a text input is tokenized with the tokenizer's special tokens unless false.
    add_special_tokens: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RerankRequest {
    model: String,
    query: String,
    documents: Vec<Document>,
    top_n: Option<i64>,
    return_documents: Option<bool>,
    /// Cohere's: each document is cut to its first this many tokens.
    max_tokens_per_doc: Option<i64>,
}

/// A document: its text, or an object holding it (`{"text": ...}`, as vLLM and Jina take).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Document {
    Text(String),
    Object(DocumentObject),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DocumentObject {
    text: String,
}

impl Document {
    fn text(&self) -> &str {
        match self {
            Document::Text(text) | Document::Object(DocumentObject { text }) => text,
        }
    }
}

async fn embeddings(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: EmbeddingRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                Some("encoding_format"),
                format!("`encoding_format` is `float` or `base64`; got `{other}`"),
            ));
        }
    };
    let hidden = state.engine.model_config().hidden_size;
    let dimensions = match request.dimensions {
        None => hidden,
        Some(d) if (1..=hidden as i64).contains(&d) => d as usize,
        Some(d) => {
            return Err(ApiError::invalid(
                Some("dimensions"),
                format!("`dimensions` is 1 to the model's {hidden}; got {d}"),
            ));
        }
    };
    let special = request.add_special_tokens.unwrap_or(true);
    let inputs = encode_prompts(&state, &request.input, "input", MAX_INPUTS, special)?;
    let prompts: Vec<Vec<u32>> = inputs.into_iter().map(|(ids, _)| ids).collect();
    let (vectors, prompt_tokens) = embed(&state, prompts, tenant.as_deref(), "input").await?;
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, vector)| {
            let vector = finish(&state, vector, dimensions);
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": state.name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })))
}

async fn rerank(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: RerankRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    let n = request.documents.len();
    if n == 0 || n > MAX_DOCUMENTS {
        return Err(ApiError::invalid(
            Some("documents"),
            format!("`documents` holds 1 to {MAX_DOCUMENTS}; got {n}"),
        ));
    }
    let top_n = match request.top_n {
        None => n,
        Some(k) if k >= 1 => (k as usize).min(n),
        Some(k) => {
            return Err(ApiError::invalid(
                Some("top_n"),
                format!("`top_n` is at least 1; got {k}"),
            ));
        }
    };
    let cut = match request.max_tokens_per_doc {
        None => usize::MAX,
        Some(k) if k >= 1 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                Some("max_tokens_per_doc"),
                format!("`max_tokens_per_doc` is at least 1; got {k}"),
            ));
        }
    };
    let mut prompts = vec![state.tokenizer.encode(&request.query, true)?];
    for doc in &request.documents {
        let mut ids = state.tokenizer.encode(doc.text(), true)?;
        ids.truncate(cut);
        prompts.push(ids);
    }
    let (vectors, tokens) = embed(&state, prompts, tenant.as_deref(), "documents").await?;
    let unit: Vec<Vec<f32>> = vectors.into_iter().map(|v| unit_length(&v)).collect();
    let (query, docs) = unit
        .split_first()
        .expect("the query and at least one document");
    let mut scored: Vec<(usize, f64)> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let dot = query
                .iter()
                .zip(d)
                .map(|(a, b)| f64::from(*a) * f64::from(*b));
            (i, dot.sum::<f64>())
        })
        .collect();
    // Most relevant first; equal scores keep the documents' order.
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let return_documents = request.return_documents.unwrap_or(true);
    let results: Vec<Value> = scored
        .into_iter()
        .take(top_n)
        .map(|(index, score)| {
            let mut result = json!({"index": index, "relevance_score": score});
            if return_documents {
                result["document"] = json!({"text": request.documents[index].text()});
            }
            result
        })
        .collect();
    Ok(Json(json!({
        "id": format!("rerank-{}", state.next_response_number()),
        "model": state.name,
        "usage": {"total_tokens": tokens},
        "results": results,
    })))
}

/// Submits every prompt as an embedding request (all at once, so the engine batches them) and
/// waits for their vectors, in order, with the prompt tokens they took together.
async fn embed(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
    tenant: Option<&Tenant>,
    param: &'static str,
) -> Result<(Vec<Vec<f32>>, u32), ApiError> {
    let pooling = state.embedding.pooling.clone().map_err(|why| {
        ApiError::invalid(None, format!("this model does not serve embeddings: {why}"))
    })?;
    let started = std::time::Instant::now();
    let mut streams = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let request = GenerateRequest {
            prompt,
            sampling: SamplingParams {
                max_tokens: 1,
                ..SamplingParams::greedy()
            },
            cache_salt: tenant.map_or(0, |t| t.cache_salt),
            deadline: None,
            constraint: None,
            resume: None,
            embed: Some(pooling),
        };
        streams.push(state.submit(request, param)?);
    }
    let (mut vectors, mut tokens, mut cached) = (Vec::with_capacity(streams.len()), 0, 0);
    for mut stream in streams {
        let mut vector = None;
        loop {
            match stream.events.recv().await {
                Some(TokenEvent::Embedding { vector: v }) => vector = Some(v),
                Some(TokenEvent::Finished { usage, .. }) => {
                    tokens += usage.prompt_tokens;
                    cached += usage.cached_tokens;
                    break;
                }
                Some(TokenEvent::Failed { message }) => {
                    return Err(ApiError::internal(format!("embedding failed: {message}")));
                }
                Some(TokenEvent::Unavailable { message }) => {
                    return Err(ApiError::unavailable(message));
                }
                Some(TokenEvent::Token { .. }) => {
                    return Err(ApiError::internal(
                        "the engine answered an embedding request with tokens",
                    ));
                }
                None => return Err(ApiError::internal("the engine stopped mid-request")),
            }
        }
        vectors.push(vector.ok_or_else(|| {
            ApiError::internal("the engine finished an embedding request without its vector")
        })?);
    }
    state.metrics.observe_e2e(started.elapsed());
    state.metrics.record_usage(tokens, cached, 0);
    Ok((vectors, tokens))
}

/// A pooled vector as served: its first `dimensions` values (Matryoshka truncation), scaled to
/// unit length when the checkpoint normalizes.
fn finish(state: &AppState, mut vector: Vec<f32>, dimensions: usize) -> Vec<f32> {
    vector.truncate(dimensions);
    if state.embedding.normalize {
        unit_length(&vector)
    } else {
        vector
    }
}

/// `v / ‖v‖` (sentence-transformers' Normalize: the norm clamped at 1e-12), in f64.
fn unit_length(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let norm = norm.max(1e-12);
    v.iter().map(|x| (f64::from(*x) / norm) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_length_scales_to_one_and_keeps_zero() {
        let v = unit_length(&[3.0, 4.0]);
        assert_eq!(v, vec![0.6, 0.8]);
        assert_eq!(unit_length(&[0.0, 0.0]), vec![0.0, 0.0]);
    }
}
