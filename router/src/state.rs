//! What every handler shares: the served model's name, its tokenizer and chat template, the
//! engine that runs it, and the decoding defaults its checkpoint ships.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use strata_engine_api::client::{EngineClient, ServingParts};
use strata_engine_api::submit::{RequestStream, SubmitError};
use strata_model::chat::ChatTemplate;
use strata_model::grammar::vocabulary_bytes;
use strata_model::tokenizer::Tokenizer;
use strata_model::{EmbeddingConfig, GenerationConfig};
use strata_protocol::GenerateRequest;

use crate::cluster::{Cluster, ClusterClient};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::serving_options::{OptionsError, ServingOptions};

/// The served model as the handlers see it.
pub struct ServedModel {
    /// The name clients put in `model`, and the one responses report.
    pub name: String,
    /// Other names a request's `model` may give (`--served-model-name`'s later names).
    pub aliases: Vec<String>,
    /// `owned_by` in /v1/models.
    pub owned_by: String,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    /// How embeddings pool and scale.
    pub embedding: EmbeddingConfig,
    pub engine: EngineHandle,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// Counters behind `/metrics`.
    pub metrics: Metrics,
    next_response: AtomicU64,
    /// The bytes of each token id, for log-probability reports.
    token_bytes: Vec<Vec<u8>>,
    /// The most bytes one token stands for (at least 1).
    longest_token: usize,
    /// The window requests are held to, vLLM's way, under `--max-model-len` (at most the
    /// model's own window).
    max_model_len: Option<usize>,
    /// Contexts primed through `/v1/cache` and still pinned.
    pub primed: crate::openai::cache::PrimedContexts,
    /// Set once SIGTERM starts the drain: `/ready` then answers 503.
    pub draining: crate::drain::Draining,
}

/// Where this process's response numbers start: drawn from the clock and the process id, so
/// a restarted server does not hand out the ids of the last run again (a client's stale
/// `previous_response_id` is then a 404, not another conversation). Below 2^52, so the numbers
/// stay exact in any JSON reader.
fn first_response_number() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    (h.finish() >> 12) | 1
}

impl ServedModel {
    pub fn new(
        name: String,
        owned_by: String,
        engine: impl Into<EngineHandle>,
        parts: ServingParts,
    ) -> Self {
        // A vocabulary whose bytes cannot be derived reports each token's decoded text.
        let token_bytes = vocabulary_bytes(&parts.tokenizer).unwrap_or_else(|_| {
            (0..parts.tokenizer.vocab_size() as u32)
                .map(|id| {
                    let text = parts.tokenizer.decode(&[id], false).unwrap_or_default();
                    text.into_bytes()
                })
                .collect()
        });
        Self {
            name,
            aliases: Vec::new(),
            owned_by,
            tokenizer: parts.tokenizer,
            template: parts.template,
            generation_config: parts.generation_config,
            embedding: parts.embedding,
            engine: engine.into(),
            created: unix_now(),
            metrics: Metrics::default(),
            next_response: AtomicU64::new(first_response_number()),
            longest_token: token_bytes.iter().map(Vec::len).max().unwrap_or(1).max(1),
            token_bytes,
            max_model_len: None,
            primed: Default::default(),
            draining: Default::default(),
        }
    }

    /// The model presented as `options` say: its aliases and its window. The template file is
    /// not applied here: it is read before the checkpoint loads
    /// ([`ServingOptions::chat_template`]).
    pub fn serving(mut self, options: &ServingOptions) -> Result<Self, OptionsError> {
        let window = self.engine.model_config().max_position_embeddings;
        let served = options.context_window(window)?;
        self.max_model_len = options.max_model_len.is_some().then_some(served);
        self.aliases = options.aliases.clone();
        Ok(self)
    }

    /// Whether `model` names the served model (its name or an alias); a 404 naming the served
    /// name otherwise. Every surface asks this one question.
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.name || self.aliases.iter().any(|a| a == model) {
            Ok(())
        } else {
            Err(ApiError::model_not_found(model, &self.name))
        }
    }

    /// `text` as token ids. A text whose bytes alone prove it longer than the context window
    /// (each token stands for at most the longest token's bytes; a margin of
    /// [`PROMPT_BYTES_MARGIN`] covers normalizers that drop characters) is refused naming
    /// `param` before it is tokenized: a multi-megabyte prompt costs no tokenizer memory.
    pub fn encode(&self, text: &str, special: bool, param: &str) -> Result<Vec<u32>, ApiError> {
        let longest = self.longest_token;
        let window = self.context_window();
        let bound = window
            .saturating_mul(longest)
            .saturating_mul(PROMPT_BYTES_MARGIN);
        if text.len() > bound {
            return Err(ApiError::context_length_exceeded(
                param,
                format!(
                    "the prompt is {} bytes, more than {} tokens of at most {longest} bytes each \
                     can hold: it exceeds the model's context window of {window} tokens",
                    text.len(),
                    window.saturating_mul(PROMPT_BYTES_MARGIN)
                ),
            ));
        }
        Ok(self.tokenizer.encode(text, special)?)
    }

    /// The bytes token `id` stands for (empty for an id the tokenizer does not know).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// The number in a response id (`chatcmpl-<n>`), unique within this process.
    pub fn next_response_number(&self) -> u64 {
        self.next_response.fetch_add(1, Ordering::Relaxed)
    }

    /// The context window served: the model's own, or `--max-model-len`.
    pub fn context_window(&self) -> usize {
        self.max_model_len
            .unwrap_or(self.engine.model_config().max_position_embeddings)
    }

    /// Starts `request` on the engine; a refusal names `prompt_param` in the surface's error.
    /// Under `--max-model-len` the request is first held to that window the way vLLM holds it:
    /// the prompt must leave room for a token, and the prompt with `max_tokens` must fit (at the
    /// model's own window the engine instead ends such a request at the window).
    pub fn submit(
        &self,
        request: GenerateRequest,
        prompt_param: &str,
    ) -> Result<RequestStream, ApiError> {
        if let Some(window) = self.max_model_len {
            let prompt = request.prompt.len();
            if request.embed.is_some() {
                if prompt > window {
                    let refusal = SubmitError::ContextWindow { prompt, window };
                    return Err(ApiError::from_submit(refusal, prompt_param));
                }
            } else if prompt >= window {
                let refusal = SubmitError::ContextWindow { prompt, window };
                return Err(ApiError::from_submit(refusal, prompt_param));
            }
            let max_tokens = request.sampling.max_tokens as usize;
            if request.embed.is_none() && prompt + max_tokens > window {
                return Err(ApiError::context_length_exceeded(
                    prompt_param,
                    format!(
                        "prompt of {prompt} tokens and max_tokens of {max_tokens} exceed the \
                         context window of {window} (--max-model-len)"
                    ),
                ));
            }
        }
        self.engine
            .submit(request)
            .map_err(|e| ApiError::from_submit(e, prompt_param))
    }
}

/// A prompt is refused untokenized when its bytes exceed this many context windows of the
/// longest token ([`ServedModel::encode`]).
pub const PROMPT_BYTES_MARGIN: usize = 4;

/// Shared by every handler.
pub type AppState = Arc<ServedModel>;

/// Where requests run, as the surfaces see it: one engine seam, this process's engine (`strata
/// serve`) or the nodes over QUIC (`strata router`) alike (DESIGN.md §2). A router also keeps its
/// cluster for the operator's views (the dashboard's nodes and members, the routing families of
/// `/metrics`).
pub struct EngineHandle {
    engine: Arc<dyn EngineClient>,
    cluster: Option<Arc<Cluster>>,
}

impl From<Arc<dyn EngineClient>> for EngineHandle {
    fn from(engine: Arc<dyn EngineClient>) -> Self {
        Self {
            engine,
            cluster: None,
        }
    }
}

impl From<Arc<Cluster>> for EngineHandle {
    fn from(cluster: Arc<Cluster>) -> Self {
        Self {
            engine: Arc::new(ClusterClient(cluster.clone())),
            cluster: Some(cluster),
        }
    }
}

impl std::ops::Deref for EngineHandle {
    type Target = dyn EngineClient;

    fn deref(&self) -> &Self::Target {
        self.engine.as_ref()
    }
}

impl EngineHandle {
    /// An engine in this process.
    pub fn local(engine: impl EngineClient + 'static) -> Self {
        let engine: Arc<dyn EngineClient> = Arc::new(engine);
        engine.into()
    }

    /// The nodes behind this router; `None` for an engine in this process.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::first_response_number;

    #[test]
    fn response_numbers_start_somewhere_new_each_run_and_stay_exact_in_json() {
        let starts: Vec<u64> = (0..8).map(|_| first_response_number()).collect();
        assert!(starts.iter().all(|&n| n > 0 && n < 1 << 52), "{starts:?}");
        let mut distinct = starts.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), starts.len(), "{starts:?}");
    }
}
