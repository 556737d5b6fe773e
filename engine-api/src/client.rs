//! The one seam between the surfaces and an engine (issue 37): [`EngineClient`] is what the HTTP
//! surfaces ask of an engine running in this process (strata-node's `Engine` implements it), and
//! [`StartEngine`] is how a server starts one from a checkpoint (strata-node's `EngineSpec`
//! implements it), so the router crate links no engine, kernels or CUDA.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use strata_model::chat::ChatTemplate;
use strata_model::tokenizer::Tokenizer;
use strata_model::{EmbeddingConfig, GenerationConfig, ModelConfig};
use strata_protocol::GenerateRequest;

use crate::kv::{BlockHash, KvDump};
use crate::load::{EngineLoad, StepTimes};
use crate::rpc::PinReport;
use crate::submit::{RequestStream, SubmitError};

/// The pieces of a checkpoint the front door keeps once the engine owns the weights.
pub struct ServingParts {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    /// How `/v1/embeddings` pools and scales (the checkpoint's sentence-transformers files).
    pub embedding: EmbeddingConfig,
}

/// An engine in this process, as the surfaces use it. [`EngineClient::kv_dump`], `pin`, `unpin`,
/// `pins` and `park_on_disk` wait for the engine thread's next loop turn (at most one step): call
/// those off the async workers; the rest answer at once.
pub trait EngineClient: Send + Sync {
    fn model_config(&self) -> &ModelConfig;
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Validates and starts `request`; its events arrive on the stream.
    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError>;
    fn cancel(&self, id: u64) -> Result<(), SubmitError>;
    /// Requests queued and running, KV blocks by tier, rates, speculation's counters.
    fn load(&self) -> EngineLoad;
    /// Where the engine thread's steps spent their time.
    fn step_times(&self) -> StepTimes;
    /// Every cached block and its tier, as of an event number.
    fn kv_dump(&self) -> Result<KvDump, SubmitError>;
    /// Pins the leading cached run of `hashes` under `name` until `expires` (a primed context);
    /// the inner error says why the tiers cannot hold it.
    fn pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        expires: Option<Instant>,
    ) -> Result<Result<PinReport, String>, SubmitError>;
    /// [`EngineClient::pin`] without waiting (a refusal is dropped).
    fn pin_detached(&self, name: String, hashes: Vec<BlockHash>, expires: Option<Instant>);
    /// Drops the pin `name`; whether there was one.
    fn unpin(&self, name: String) -> Result<bool, SubmitError>;
    /// Every pin and where its blocks are.
    fn pins(&self) -> Result<Vec<PinReport>, SubmitError>;
    /// Writes every cached block to the disk tier, for an engine about to stop; how many.
    fn park_on_disk(&self) -> Result<usize, SubmitError>;
}

/// Why an engine did not start: the starter's own error, shown as it words it.
pub type StartError = Box<dyn std::error::Error + Send + Sync>;

/// How a server starts its engine on a checkpoint directory: the engine and the front door's
/// pieces of the checkpoint.
pub trait StartEngine: std::fmt::Debug + Send + Sync {
    fn start(&self, dir: &Path) -> Result<(Arc<dyn EngineClient>, ServingParts), StartError>;
}
